"""AdamW with low-precision state (train.optimizer.state), in torch ops: the CPU path, every eager path (DDP,
FSDP2, eager GPU runs), and the reference the flat Triton kernels of the CUDA-graph path are tested against
(stages/engine/flat_adamw.py, stages/engine/kernels.py: the same formats, the same hash, the same update).

Modes (the exact one, fp32 masters + fp32 moments, stays stages/engine/optim.py's MasterWeightAdamW / AdamW):
  fp32_master_8bit  fp32 master weights, both moments block-wise 8-bit: ~10 bytes a parameter with bf16
                    weights and gradients (2 + 2 + 4 + 2 x 1.03).
  bf16_sr_8bit      no master: the bf16 weight is read as fp32, updated, and rounded to bf16 STOCHASTICALLY
                    (unbiased, so an update below bf16's resolution still moves the weight in expectation);
                    moments as above: ~6 bytes a parameter.

Block-wise 8-bit moments. Each parameter's values, flattened, in blocks of BLOCK = 128 (the last one padded with
zeros); per block an fp32 scale = the block's absmax, and per value one byte coding value / scale, in [-1, 1]:
  m (signed):         sign bit + a 7-bit minifloat: 4-bit exponent, 3-bit mantissa, 1.0 the top code,
                      subnormals below 2^-14: the smallest non-zero magnitude 2^-17 of the block's absmax;
  s = sqrt(v) (>= 0): an 8-bit minifloat: 5-bit exponent, 3-bit mantissa, smallest non-zero 2^-33 of the absmax.
Why these: the scale is the exact fp32 absmax, so a block's common growth and decay (v's 0.999 per step) is carried
in fp32 and only the spread within a block is coarse (as bitsandbytes' and torchao's 8-bit AdamW; a power-of-two
scale would freeze v inside a binade). Relative rounding error at most 2^-4 of a value (half a 3-bit mantissa ulp).
sqrt(v) rather than v: v spans twice the decades of the gradient, and a v rounded to 0 under a non-zero m would turn
m / (sqrt(v) + eps) into m / eps; sqrt(v) with a 5-bit exponent reaches 2^-33 of its block's largest value, so that
takes a gradient ~10^10 times smaller than its block's largest (an m that small rounds to 0 itself). Rounding is
to nearest, ties to even, done on the fp32 bit pattern with integer operations: the same codes on any CPU and in
the Triton kernel. Values flush to 0 below the smallest code.

Stochastic rounding (bf16_sr_8bit): 16 random bits are added to the fp32 bit pattern below bf16's mantissa and the
sum truncated (round up with probability = the dropped fraction). The bits are a counter-based hash (mix32 below,
integer multiply / xor / shift only) of (train.seed + rank, optimizer step, parameter ordinal, element index):
no RNG state, the same bits on every run and after a resume, the same in Triton and here.

Portability (train.portable_numerics): only IEEE basic operations (add, mul, div, fused by nothing), integer
operations and one square root, taken in double precision and rounded to float: torch.sqrt on float32 CPU tensors
goes through MKL's vector math, which is not correctly rounded and differs between CPU vendors; the double one is
within a double ulp, and a double within 2^-50 of sqrt(x) rounds to the correctly rounded float sqrt(x).
"""
from __future__ import annotations

import math

import torch

BLOCK = 128                       # values per quantization block (one fp32 scale each)
CHUNK = BLOCK * 2 ** 15           # the torch-ops update runs over a tensor in chunks of this many values
M_EXP_BITS, S_EXP_BITS = 4, 5      # the two minifloat formats (module docstring)
MASK32 = 0xFFFFFFFF
MIX1, MIX2 = 0x7FEB352D, 0x2C1B3C6D   # both < 2^31: a uint32 times either fits an int64 (the CPU emulation)
LOWBIT_STATES = ("fp32_master_8bit", "bf16_sr_8bit")


# ----------------------------------------------------------------------------------------------
# The 8-bit block codec
# ----------------------------------------------------------------------------------------------

def _top(exp_bits: int) -> int:
    return 2 ** exp_bits - 1        # the exponent field of 1.0


def encode_magnitude(y: torch.Tensor, exp_bits: int) -> torch.Tensor:
    """y: fp32 in [0, 1] -> int64 codes (exponent << 3 | mantissa), rounded to nearest, ties to even.
    value(e, f) = 2^(e - top) (1 + f / 8) for e >= 1, 2^(1 - top) f / 8 for e == 0 (subnormals)."""
    top = _top(exp_bits)
    bits = y.contiguous().view(torch.int32).to(torch.int64)
    # drop 20 of the 23 mantissa bits, rounding half to even, the carry moving into the exponent
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - ((127 - top) << 3)
    sub = torch.round(y * 2.0 ** (top + 2)).to(torch.int64)          # y / 2^(1 - top) * 8, exact scaling
    return torch.where(y >= 2.0 ** (1 - top), normal, sub)


def decode_magnitude(code: torch.Tensor, exp_bits: int) -> torch.Tensor:
    """int64 codes -> fp32 magnitudes (exact)."""
    top = _top(exp_bits)
    e, f = code >> 3, code & 7
    normal = (((e + 127 - top) << 23) | (f << 20)).to(torch.int32).view(torch.float32)
    return torch.where(e > 0, normal, f.to(torch.float32) * 2.0 ** (-top - 2))


def _blocks(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % BLOCK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, BLOCK)


def n_blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def quantize(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 values (any shape) -> (uint8 codes of x's shape, fp32 scales [n_blocks]). Unsigned input must be >= 0."""
    blocks = _blocks(x)
    scale = blocks.abs().amax(dim=1)
    y = blocks.abs() / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
    code = encode_magnitude(y, M_EXP_BITS if signed else S_EXP_BITS)
    if signed:
        code = code | (((blocks < 0) & (code > 0)).to(torch.int64) << 7)     # no -0: codes are canonical
    return code.reshape(-1)[:x.numel()].to(torch.uint8).view(x.shape), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    """(uint8 codes, fp32 scales) -> fp32 values of the codes' shape."""
    c = _blocks(codes.to(torch.float32)).to(torch.int64)        # codes < 256: exact through fp32
    mag = decode_magnitude(c & 0x7F if signed else c, M_EXP_BITS if signed else S_EXP_BITS) * scale[:, None]
    if signed:
        mag = torch.where((c >> 7) == 1, -mag, mag)
    return mag.reshape(-1)[:codes.numel()].view(codes.shape)


# ----------------------------------------------------------------------------------------------
# Counter-based random bits and stochastic rounding to bf16
# ----------------------------------------------------------------------------------------------

def mix32(x):
    """A 32-bit integer hash (xorshift-multiply, Wellons' `lowbias32` shape with multipliers < 2^31) on Python ints
    or int64 tensors holding uint32 values; Triton's uint32 version is kernels._mix32."""
    x = x ^ (x >> 16)
    x = (x * MIX1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MIX2) & MASK32
    return x ^ (x >> 16)


def stream_key(seed: int, step: int, ordinal: int) -> int:
    """The key of one parameter's random stream at one optimizer step (step counts from 1)."""
    return mix32(mix32(mix32(seed & MASK32) ^ (step & MASK32)) ^ (ordinal & MASK32))


def random_bits(key: int, numel: int, device=None) -> torch.Tensor:
    """uint32 values (in int64) for element indices 0 .. numel - 1 of a stream."""
    return mix32(torch.arange(numel, dtype=torch.int64, device=device) ^ key)


def stochastic_round_bf16(w: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, rounding up (in magnitude) with probability = the dropped 16 bits' fraction: unbiased."""
    u = w.contiguous().view(torch.int32).to(torch.int64) & MASK32
    u = (u + (bits.view(w.shape) & 0xFFFF)) & 0xFFFF0000
    u = torch.where(u >= 2 ** 31, u - 2 ** 32, u)
    return u.to(torch.int32).view(torch.float32).to(torch.bfloat16)


def portable_sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 sqrt on any CPU (module docstring)."""
    return torch.sqrt(x.double()).float() if x.device.type == "cpu" else torch.sqrt(x)


# ----------------------------------------------------------------------------------------------
# The optimizer
# ----------------------------------------------------------------------------------------------

def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


class LowBitAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected; torch's AdamW) with 8-bit moments, over fp32 masters of bf16
    weights (fp32_master_8bit with `masters`), over fp32 weights (fp32_master_8bit without: precision autocast,
    or FSDP2, whose fp32 shards are the masters), or over bf16 weights with stochastic rounding (bf16_sr_8bit).

    One step count for every parameter (`step_count`, a device tensor; `_t` its host copy for the bias
    corrections). `step(grad_divisor)` divides every gradient by the clip divisor on the fly; `step_param`
    updates one parameter (train.optimizer.fused_backward, after `begin_step`). state_dict() carries the codes
    and scales, the masters, and `state_mode`; load_state_dict refuses another mode's state."""

    def __init__(self, groups: list[dict], state_mode: str, seed: int, masters: dict[int, torch.Tensor] | None = None,
                 rank: int = 0, **kw):
        if state_mode not in LOWBIT_STATES:
            raise ValueError(f"LowBitAdamW: unknown state mode {state_mode!r}")
        kw.setdefault("eps", 1e-8)
        kw.setdefault("weight_decay", 0.0)
        kw.pop("fused", None)
        self.state_mode = state_mode
        self.seed = (int(seed) + 0x9E3779B9 * int(rank)) & MASK32
        self.model_params = [p for g in groups for p in g["params"]]
        self.ordinal = {id(p): i for i, p in enumerate(self.model_params)}
        if masters is not None:
            if state_mode != "fp32_master_8bit":
                raise ValueError("bf16_sr_8bit keeps no master weights")
            made = {id(p): masters[id(p)].detach().float().clone() for p in self.model_params}
            self.master_params = [made[id(p)] for p in self.model_params]
            groups = [{**g, "params": [made[id(p)] for p in g["params"]]} for g in groups]
            self.ordinal = {id(made[id(p)]): i for i, p in enumerate(self.model_params)}
        else:
            self.master_params = None
        super().__init__(groups, kw)
        self._model_of = ({id(m): p for p, m in zip(self.model_params, self.master_params)}
                          if self.master_params is not None else {})
        device = _local(self.model_params[0]).device if self.model_params else torch.device("cpu")
        self.step_count = torch.zeros((), dtype=torch.float32, device=device)
        self._t = 0
        self._tables: dict[int, tuple] = {}      # the GPU eager path's per-block hash inputs, per parameter

    # -- the update --------------------------------------------------------------------------
    def begin_step(self) -> None:
        self._t += 1
        self.step_count.fill_(float(self._t))

    def _grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        src = self._model_of.get(id(p), p)
        return src.grad

    def _init_state(self, p: torch.Tensor) -> None:
        """Codes of the parameter's shape and placement; scales one per block of the (local) values. Under FSDP2
        (a DTensor parameter, sharded on dim 0) both are DTensors, so a sharded (DCP) checkpoint holds every rank's
        part: the codes placed as the parameter, the scales as [world x most blocks of a rank's shard], Shard(0)."""
        state, w = self.state[p], _local(p)
        state["step"] = self.step_count
        for name in ("m", "s"):
            codes = torch.zeros(w.shape, dtype=torch.uint8, device=w.device)
            scale = torch.zeros(n_blocks(w.numel()), dtype=torch.float32, device=w.device)
            if hasattr(p, "to_local"):
                from torch.distributed.tensor import DTensor, Shard
                world = p.device_mesh.size()
                rows = p.shape[0] if p.ndim else 1
                per_row = p.numel() // max(1, rows)
                most = n_blocks(-(-rows // world) * per_row)
                scale = torch.cat([scale, scale.new_zeros(most - scale.numel())])
                codes = DTensor.from_local(codes, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                           stride=p.stride())
                scale = DTensor.from_local(scale, p.device_mesh, [Shard(0)], run_check=False, shape=(world * most,),
                                           stride=(1,))
            state[f"{name}_codes"], state[f"{name}_scale"] = codes, scale

    @torch.no_grad()
    def _update(self, p: torch.Tensor, group: dict, grad: torch.Tensor, divisor: torch.Tensor | None) -> None:
        state = self.state[p]
        w_t = _local(p)
        if not state:
            self._init_state(p)
        model = self._model_of.get(id(p))
        target = _local(model) if model is not None else w_t      # what the model computes with
        g_t = _local(grad)
        if w_t.is_cuda:
            return self._update_cuda(p, group, g_t, divisor, w_t, target)
        n = w_t.numel()
        flat = {k: _local(state[k]).reshape(-1) for k in ("m_codes", "s_codes")}
        scales = {k: _local(state[k]) for k in ("m_scale", "s_scale")}
        w_flat, g_flat, target_flat = w_t.reshape(-1), g_t.reshape(-1), target.reshape(-1)
        # In chunks of whole blocks: every operation is per element or per block, so the bytes are those of one
        # pass over the tensor, and the temporaries stay a chunk's (an embedding's int64 code arithmetic would
        # otherwise take several times its size).
        for start in range(0, n, CHUNK):
            end = min(n, start + CHUNK)
            self._update_chunk(p, group, g_flat[start:end], divisor, w_flat[start:end], target_flat[start:end],
                               {k: v[start:end] for k, v in flat.items()},
                               {k: v[start // BLOCK:n_blocks(end)] for k, v in scales.items()}, start)

    def _update_chunk(self, p, group, g, divisor, w_t, target, codes, scales, start: int) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        g = g.float()
        if divisor is not None:
            g = g / divisor
        w = w_t.float() if w_t.dtype != torch.float32 else w_t.clone()
        m = dequantize(codes["m_codes"], scales["m_scale"], signed=True)
        s = dequantize(codes["s_codes"], scales["s_scale"], signed=False)
        v = s * s
        if wd:
            w.mul_(1.0 - lr * wd)
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        s = portable_sqrt(v)
        t = self._t
        step_size = lr / (1.0 - beta1 ** t)
        denom = (s / math.sqrt(1.0 - beta2 ** t)).add_(eps)
        w.addcdiv_(m, denom, value=-step_size)
        for name, signed, value in (("m", True, m), ("s", False, s)):
            new_codes, new_scale = quantize(value, signed=signed)
            codes[f"{name}_codes"].copy_(new_codes)
            scales[f"{name}_scale"].copy_(new_scale)
        if self.state_mode == "bf16_sr_8bit" and w_t.dtype == torch.bfloat16:
            key = stream_key(self.seed, t, self.ordinal[id(p)])
            bits = mix32((torch.arange(w.numel(), dtype=torch.int64, device=w.device) + start) ^ key)
            w_t.copy_(stochastic_round_bf16(w, bits))
        else:
            w_t.copy_(w)
            if target is not w_t:
                target.copy_(w)                       # the bf16 working copy: rounded to nearest, as MasterWeightAdamW

    def _update_cuda(self, p, group, g_t, divisor, w_t, target) -> None:
        """A GPU's eager step (DDP, FSDP2, fused_backward): kernels._adamw8_kernel on this one tensor, the same
        update as the CUDA-graph path's flat kernel, without the torch-ops path's fp32 and int64 temporaries."""
        from stages.engine import kernels
        TILE_ROWS = kernels.TILE_ROWS
        state = self.state[p]
        n, nb = w_t.numel(), n_blocks(w_t.numel())
        tables = self._tables.get(id(p))
        if tables is None:
            tables = self._tables[id(p)] = (
                torch.full((nb,), self.ordinal[id(p)], dtype=torch.int32, device=w_t.device),
                torch.arange(nb, dtype=torch.int32, device=w_t.device) * BLOCK)
        beta1, beta2 = group["betas"]
        t = self._t
        lr = torch.full((), group["lr"], dtype=torch.float32, device=w_t.device)
        bias = torch.tensor([0.0, 0.0, beta1, beta2, 1.0 - beta1 ** t, math.sqrt(1.0 - beta2 ** t)],
                            dtype=torch.float64, device=w_t.device)
        div = divisor.reshape(()).float() if divisor is not None else torch.ones((), device=w_t.device)
        master = self._model_of.get(id(p)) is not None
        g = g_t if g_t.is_contiguous() else g_t.contiguous()
        kernels._adamw8_kernel[(-(-nb // TILE_ROWS),)](
            g, target, w_t, _local(state["m_codes"]), _local(state["m_scale"]), _local(state["s_codes"]),
            _local(state["s_scale"]), tables[0], tables[1], nb, n, lr, bias, div, self.step_count, self.seed, beta1,
            1.0 - beta1, beta2, 1.0 - beta2, group["eps"], group["weight_decay"], HAS_MASTER=master,
            SR=self.state_mode == "bf16_sr_8bit" and target.dtype == torch.bfloat16, ROWS=TILE_ROWS, B=BLOCK,
            EVEN=n % BLOCK == 0, FAST=kernels.PTX)     # a tensor ending inside its last block: the element mask

    def eager_cuda_variants(self) -> list[tuple]:
        """The _adamw8_kernel specialisations _update_cuda will launch, one per distinct (gradient and model
        dtype, weight dtype, HAS_MASTER, SR, EVEN): what the launch's dtypes and constexprs differ by. Its integer
        arguments are not specialised (do_not_specialize), and its pointers are all separate allocations (16-byte
        aligned), as are the warm-up's."""
        variants = set()
        for group in self.param_groups:
            for p in group["params"]:            # as _update reads them: p the optimizer's, model the bf16 copy
                model = self._model_of.get(id(p))
                w_t = _local(p)
                target = _local(model) if model is not None else w_t
                if w_t.numel():
                    variants.add((target.dtype, w_t.dtype, model is not None,
                                  self.state_mode == "bf16_sr_8bit" and target.dtype == torch.bfloat16,
                                  w_t.numel() % BLOCK == 0))
        return sorted(variants, key=str)

    @torch.no_grad()
    def warm_up_cuda(self) -> float:
        """Compile (or load from Triton's disk cache) every kernel variant of the eager GPU step, on scratch
        buffers; EagerSteps calls it before its timed loop. Without it each variant compiled inside the first step
        (issue 38: seen in the perf record's triton_first_launches, EVEN True and False on any model with a tensor
        ending inside a block). Its launches are also checked on CPU under Triton's interpreter
        (tests/triton_interpret_checks.py). Returns the seconds spent; 0 off the GPU."""
        from stages.engine import kernels
        if not self.model_params or not _local(self.model_params[0]).is_cuda or kernels.triton is None:
            return 0.0
        return self.launch_eager_variants(_local(self.model_params[0]).device)

    @torch.no_grad()
    def launch_eager_variants(self, device: torch.device) -> float:
        """warm_up_cuda's launches on `device` (CUDA; or CPU under Triton's interpreter, where
        tests/triton_interpret_checks.py runs them); returns the seconds spent."""
        import time

        from stages.engine import kernels
        t0 = time.perf_counter()
        rows = kernels.TILE_ROWS
        for model_dtype, w_dtype, master, sr, even in self.eager_cuda_variants():
            n = rows * BLOCK if even else rows * BLOCK - 1      # EVEN False: the last block ends early
            kernels.launch_adamw8_scratch(device, model_dtype, w_dtype, master, sr, even, rows, n, BLOCK, self.seed)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    @torch.no_grad()
    def step(self, closure=None, grad_divisor: torch.Tensor | None = None):
        self.begin_step()
        for group in self.param_groups:
            for p in group["params"]:
                grad = self._grad_of(p)
                if grad is not None:
                    self._update(p, group, grad, grad_divisor)
        return None

    @torch.no_grad()
    def step_param(self, model_param: torch.Tensor) -> None:
        """fused_backward: update the parameter whose model tensor is `model_param` now (begin_step first)."""
        p = self._opt_param[id(model_param)]
        self._update(p, self._group_of[id(p)], model_param.grad, None)

    def prepare_fused(self) -> None:
        self._opt_param, self._group_of = {}, {}
        for group in self.param_groups:
            for p in group["params"]:
                self._group_of[id(p)] = group
                self._opt_param[id(self._model_of[id(p)] if self._model_of else p)] = p

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            p.grad = None

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["state_mode"] = self.state_mode
        # the shared step tensor is cloned per parameter (as MasterWeightAdamW's) so a load keeps no aliasing
        sd["state"] = {i: {**st, "step": st["step"].clone()} for i, st in sd["state"].items()}
        if self.master_params is not None:
            sd["master_params"] = [m.detach().clone() for m in self.master_params]
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        # the mode: named in our own state_dict; through FSDP2's get/set_optimizer_state_dict only the per-parameter
        # state survives, whose keys tell an exact (AdamW) state apart
        keys = {k for st in state_dict.get("state", {}).values() for k in st}
        mode = state_dict.pop("state_mode", "exact" if "exp_avg" in keys else self.state_mode)
        if mode != self.state_mode:
            raise ValueError(f"optimizer state was saved with train.optimizer.state {mode}, this run uses "
                             f"{self.state_mode}: a state resumes only in its own mode")
        masters = state_dict.pop("master_params", None)
        if (masters is None) != (self.master_params is None) or (masters and len(masters) != len(self.master_params)):
            raise ValueError("optimizer state's fp32 master weights do not fit this run (saved with another "
                             "train.precision?)")
        if masters is not None:
            with torch.no_grad():
                for m, saved, p in zip(self.master_params, masters, self.model_params):
                    m.copy_(saved)
                    p.copy_(m)
        super().load_state_dict(state_dict)
        # torch casts every state tensor of a floating parameter to its dtype: codes and scales are taken back as
        # saved (uint8, fp32)
        # the saved state's keys map to parameters as torch maps them: the saved groups' ids, in order
        params = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for i, p in zip(saved_ids, params):
            saved = state_dict["state"].get(i)
            if saved is None:
                continue
            for key in ("m_codes", "m_scale", "s_codes", "s_scale"):
                self.state[p][key] = saved[key].to(device=_local(p).device, copy=True)   # never shared with the source
        steps = {float(st["step"]) for st in self.state.values() if "step" in st}
        if len(steps) > 1:
            raise ValueError("optimizer state: the parameters' step counts differ; one shared count is required")
        self._t = int(steps.pop()) if steps else 0
        self.step_count.fill_(float(self._t))
        for st in self.state.values():           # one shared step tensor again
            if "step" in st:
                st["step"] = self.step_count


def state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes the optimizer holds now, by part (masters, moments): what the memory plan's parts are checked against."""
    masters = sum(_local(m).numel() * _local(m).element_size() for m in getattr(optimizer, "master_params", None) or [])
    moments = 0
    for st in optimizer.state.values():
        for k, v in st.items():
            if k != "step" and torch.is_tensor(v):
                moments += _local(v).numel() * _local(v).element_size()
    return {"masters": masters, "moments": moments}
