"""The CUDA-graph step's optimizer: clipped AdamW of MasterWeightAdamW as three Triton kernels over flat buffers.

Why: in the profile of the graphed 0.5B anchor step
(bench/results/step_profile_h200_before/step_profile_train_dpo_graphs_steady.txt) the optimizer
was a quarter of the GPU time: per-tensor foreach norms, a bf16 -> fp32 copy of every gradient into the
masters' gradients, torch's fused AdamW, a fp32 -> bf16 copy of every master back into the model and a
zeroing pass, each a full sweep (~22 GB of traffic per step for 0.5B parameters). Here the bf16
parameters and gradients, the fp32 masters and both moments are each ONE flat buffer (the tensors the
model and the optimizer see are views into them), and a step is
  1. _sumsq_kernel: per-block sums of squares of the flat bf16 gradient,
  2. _clip_kernel (one program): norm, clip divisor, step count + 1, in a fixed order (deterministic), and
     the bias corrections in double precision (as torch's fused AdamW: 1 - 0.999^t in fp32 cancels),
  3. _adamw_kernel per parameter group: read gradient / divisor, master, moments; write master, moments,
     the rounded bf16 parameter and a zeroed gradient: one pass (~15 GB).
The math is torch's AdamW (decoupled decay, bias correction) with clip_grad_norm_'s coefficient, per
element in fp32: equal to MasterWeightAdamW's own step to a few fp32 ulps (tests/engine/test_kernels.py under
Triton's interpreter, tests/engine/test_gpu.py against torch's fused CUDA kernel).

The flat layout is built at the run's first optimizer step (run eagerly by the graph path), from the
parameters that have a gradient then, exactly the ones torch's AdamW would update: existing optimizer
state (a resumed run) is copied in, and optimizer.state keeps per-parameter views, so state_dict() and
checkpoints are those of MasterWeightAdamW. The fp32 gradient copies of the masters are not needed: -2
bytes per parameter of memory.
"""
from __future__ import annotations

import time

import torch

from stages.engine import kernels
from stages.engine.modeling import mark_grad_accumulators

ALIGN = 128            # each group's range starts at, and spans, a multiple of this (aligned vector loads)
ADAM_BLOCK = 2048
NORM_BLOCK = 8192


def release_freed_memory(device: torch.device) -> None:
    """Give the blocks a migration just freed (the per-tensor weights, gradients or masters now living in one flat
    buffer) back to the driver. The caching allocator keeps them otherwise, scattered in the sizes the model load
    made them, where no later flat buffer fits: on the 7B shape 57 GiB stayed reserved but unallocated after the
    build and the second step ran out of memory (bench/results/h200_7b_issue30)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class FlatMasterAdamW:
    """Owns the flat buffers of a MasterWeightAdamW (see the module docstring); `step` replaces
    grads_to_master + clip + optimizer.step() + zero_grad for the graph path."""

    def __init__(self, optimizer, max_grad_norm: float):
        self.optimizer = optimizer
        self.max_grad_norm = float(max_grad_norm)
        device = optimizer.master_params[0].device
        self.norm = torch.zeros((), dtype=torch.float32, device=device)
        self.divisor = torch.ones((), dtype=torch.float32, device=device)
        self.step_count: torch.Tensor | None = None
        self.segments: list[tuple[int, int, int]] | None = None     # (group index, start, end)
        self.hyper: list[tuple[float, float, float, float]] = []    # per segment: beta1, beta2, eps, weight decay
        self.grad = self.param = self.master = self.exp_avg = self.exp_avg_sq = self.partials = self.bias = None

    @staticmethod
    def unsupported(optimizer) -> str | None:
        """Why this optimizer cannot run flat (None: it can)."""
        if not hasattr(optimizer, "master_params"):
            return "not a MasterWeightAdamW (train.precision is not bf16)"
        if not kernels.available(*optimizer.master_params[:1]):
            return "Triton unavailable on this device"
        for g in optimizer.param_groups:
            if g.get("amsgrad") or g.get("maximize") or g.get("differentiable"):
                return "amsgrad / maximize / differentiable AdamW"
        return None

    @staticmethod
    def warm_up(device: torch.device, dtype: torch.dtype, sizes: tuple[int, list[int]] | None = None) -> float:
        """Compile the three kernels (Triton compiles on first launch) on scratch buffers with the same
        dtypes and specialisations as a run's (sizes: planned_sizes(), the run's own integer arguments, each
        kernel launched as one program over the scratch: no program reaches past its first block); returns the
        seconds spent."""
        t0 = time.perf_counter()
        n = max(2 * ALIGN, NORM_BLOCK, ADAM_BLOCK)
        g = torch.zeros(n, dtype=dtype, device=device)
        w = torch.zeros(n, dtype=torch.float32, device=device)
        # separate allocations, as a run's scalars are (Triton specialises on pointer alignment)
        norm, divisor, step, lr = (torch.ones((), dtype=torch.float32, device=device) for _ in range(4))
        partials = torch.zeros(1, dtype=torch.float32, device=device)
        bias = torch.tensor([[1.0, 1.0, 0.9, 0.999, 0.0, 0.0]], dtype=torch.float64, device=device)
        for total, segs in [(2 * ALIGN, [2 * ALIGN])] + ([sizes] if sizes else []):
            for max_norm in (1.0, 0.0):                      # with and without the clip (CLIP)
                _norm_and_clip(g, total, partials, norm, divisor, step, bias, max_norm)
            for seg in segs:
                kernels._adamw_kernel[(1,)](g, g.clone(), w, w.clone(), w.clone(), seg, lr, bias[0], divisor, 0.9,
                                            0.1, 0.999, 1.0 - 0.999, 1e-8, 0.0, BLOCK=ADAM_BLOCK)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    @staticmethod
    def _layout(opt, has_grad) -> tuple[list, list, int]:
        """(entries (model param, master, offset, numel), segments (group, start, end), flat length) of the
        parameters `has_grad` admits, each group's range a multiple of ALIGN."""
        model_of = {id(m): p for p, m in zip(opt.model_params, opt.master_params)}
        entries, segments, offset = [], [], 0
        for gi, group in enumerate(opt.param_groups):
            start = offset
            for m in group["params"]:
                p = model_of[id(m)]
                if not has_grad(p):          # torch's AdamW skips it too: it stays outside, untouched
                    continue
                entries.append((p, m, offset, p.numel()))
                offset += p.numel()
            offset = -(-offset // ALIGN) * ALIGN
            if offset > start:
                segments.append((gi, start, offset))
        return entries, segments, offset

    @staticmethod
    def planned_sizes(optimizer) -> tuple[int, list[int]]:
        """The integer sizes the first flat step launches its kernels with when every trainable parameter has a
        gradient (as _build lays them out): the flat length (_sumsq_kernel) and each segment's (_adamw_kernel).
        For warm_up: Triton specialises an int argument on its type (i32, or i64 past 2^31 values: a 7B model's
        flat length) and on divisibility by 16, so a scratch-sized warm-up missed a 7B run's own kernels, which
        then compiled inside its first step (eager first step 3.35 -> 2.47 s with this; h100_issue38_dd4ac83)."""
        _, segments, offset = FlatMasterAdamW._layout(optimizer, lambda p: p.requires_grad)
        return offset, [end - start for _, start, end in segments]

    @torch.no_grad()
    def _build(self) -> None:
        opt = self.optimizer
        entries, segments, offset = self._layout(opt, lambda p: p.grad is not None)
        if not entries:
            raise RuntimeError("flat AdamW: no parameter has a gradient at the first optimizer step")
        steps = {float(opt.state[m]["step"]) for _, m, _, _ in entries if opt.state[m]}
        if len(steps) > 1 or (steps and any(not opt.state[m] for _, m, _, _ in entries)):
            raise RuntimeError("flat AdamW: the parameters' optimizer step counts differ (resumed state from "
                               "another run?); one shared step count is required")
        p0, m0 = entries[0][0], entries[0][1]
        # One kind of buffer at a time, each old tensor re-pointed (and so freed) as it is copied: the build's
        # peak is the final footprint plus the largest buffer being filled, where allocating the five buffers
        # first held a second copy of weights, gradients and masters (+8 bytes a parameter: what made the
        # 7B full fine-tune run out of memory in its first step, bench/results/h200_7b_ea0d2f0).
        # `.data =` re-points the tensor the model / optimizer already hold (identity, leaf status and the tie of
        # shared weights kept).
        self.param = torch.zeros(offset, dtype=p0.dtype, device=p0.device)
        for p, m, o, n in entries:
            self.param[o:o + n].copy_(p.reshape(-1))
            p.data = self.param[o:o + n].view_as(p)
        release_freed_memory(p0.device)
        self.grad = torch.zeros(offset, dtype=p0.dtype, device=p0.device)
        for p, m, o, n in entries:
            self.grad[o:o + n].copy_(p.grad.reshape(-1))
            p.grad = self.grad[o:o + n].view_as(p)      # backward accumulates in place into this view
        # ... and the weight GEMMs add straight into it (modeling.GroupedLinear): nothing hooks AccumulateGrad here
        mark_grad_accumulators([p for p, _, _, _ in entries], True)
        release_freed_memory(p0.device)
        self.master = torch.zeros(offset, dtype=torch.float32, device=m0.device)
        for p, m, o, n in entries:
            self.master[o:o + n].copy_(m.reshape(-1))
            m.data = self.master[o:o + n].view_as(m)
            m.grad = None
        release_freed_memory(p0.device)
        self.step_count = torch.full((), steps.pop() if steps else 0.0, dtype=torch.float32, device=m0.device)
        for name in ("exp_avg", "exp_avg_sq"):
            buf = torch.zeros_like(self.master)
            for p, m, o, n in entries:
                state = opt.state[m]
                if name in state:
                    buf[o:o + n].copy_(state[name].reshape(-1))
                state[name] = buf[o:o + n].view_as(m)
            setattr(self, name, buf)
        for p, m, o, n in entries:
            opt.state[m]["step"] = self.step_count
        self.partials = torch.zeros(-(-offset // NORM_BLOCK), dtype=torch.float32, device=m0.device)
        # per segment: beta1^t, beta2^t (t = the step count so far, host doubles), beta1, beta2, and the two
        # bias corrections _clip_kernel writes each step
        groups = [opt.param_groups[gi] for gi, _, _ in segments]
        self.hyper = [(*g["betas"], g["eps"], g["weight_decay"]) for g in groups]
        t = float(self.step_count)
        self.bias = torch.tensor([[b1 ** t, b2 ** t, b1, b2, 0.0, 0.0] for b1, b2, _, _ in self.hyper],
                                 dtype=torch.float64, device=m0.device)
        self.segments = segments

    def step(self, lrs: list[torch.Tensor]) -> torch.Tensor:
        """Clip + AdamW + zero the gradients, no host sync, capturable; returns the (unclipped) gradient
        norm as a 0-dim fp32 device tensor. lrs: one device tensor per parameter group."""
        if self.segments is None:
            self._build()
        _launch(self.grad, self.param, self.master, self.exp_avg, self.exp_avg_sq, self.partials, self.norm,
                self.divisor, self.step_count, self.bias, self.segments, [lrs[gi] for gi, _, _ in self.segments],
                self.hyper, self.max_grad_norm)
        return self.norm

    def release(self) -> None:
        """Drop the gradient views and the flat gradient (the parameters, masters and moments stay views)."""
        opt = self.optimizer
        mark_grad_accumulators(opt.model_params, False)
        for p in opt.model_params:
            p.grad = None
        self.grad = None


def _norm_and_clip(grad, n: int, partials, norm, divisor, step_count, bias, max_grad_norm: float) -> None:
    """Stages 1 and 2 of both flat steps (module docstring): _sumsq_kernel, one program per partial, over n values
    of the flat gradient, then _clip_kernel's norm, clip divisor, step count and bias corrections."""
    kernels._sumsq_kernel[(partials.numel(),)](grad, partials, n, BLOCK=NORM_BLOCK)
    kernels._clip_kernel[(1,)](partials, partials.numel(), norm, divisor, step_count, bias, bias.shape[0],
                               max_grad_norm, CLIP=max_grad_norm > 0, BLOCK=1024)


def _launch(grad, param, master, exp_avg, exp_avg_sq, partials, norm, divisor, step_count, bias, segments, lrs,
            hyper, max_grad_norm: float) -> None:
    _norm_and_clip(grad, grad.numel(), partials, norm, divisor, step_count, bias, max_grad_norm)
    for i, ((_, start, end), lr, (beta1, beta2, eps, wd)) in enumerate(zip(segments, lrs, hyper)):
        sl = slice(start, end)
        kernels._adamw_kernel[(-(-(end - start) // ADAM_BLOCK),)](
            grad[sl], param[sl], master[sl], exp_avg[sl], exp_avg_sq[sl], end - start, lr, bias[i], divisor,
            beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps, wd, BLOCK=ADAM_BLOCK)


# ----------------------------------------------------------------------------------------------
# The low-bit modes (train.optimizer.state fp32_master_8bit / bf16_sr_8bit) on the CUDA-graph path
# ----------------------------------------------------------------------------------------------

TILE_ROWS = kernels.TILE_ROWS          # _adamw8_kernel's launch geometry (stages/engine/kernels.py says why 8)
SEGMENT_BLOCKS = 4                     # 4 fp32 scales = 16 bytes: Triton's pointer-alignment specialisation (_layout)


def step_bytes_per_param(state: str, weight_bytes: int = 2, masters: bool = True) -> float:
    """The bytes one flat step moves through GPU memory per parameter, every buffer read once and written once (the
    bandwidth bound is this times the parameters over the memory's bandwidth; bench/optim_bench.py reports GB/s from
    it). weight_bytes: the model weights' and gradients' dtype size; masters: fp32 masters beside them.
      the clip's norm pass (_sumsq_kernel) reads the gradient:                                   g
      exact (_adamw_kernel): reads gradient, fp32 master, m, v; writes master, m, v, the model
        weight and the zeroed gradient:                                       g + 12 + 12 + w + g   (bf16: 32)
      fp32_master_8bit over bf16 weights (_adamw8_kernel, HAS_MASTER): reads gradient, master, two 8-bit codes;
        writes master, weight, two codes, zeroed gradient; both fp32 scales read and written once
        per 128 values (16 / 128):                                 g + 4 + 2 + 4 + w + 2 + g + 0.125   (20.125)
      fp32_master_8bit over fp32 weights (autocast; the weight is the master):  g + 4 + 2 + 4 + 2 + g + 0.125  (24.125)
      bf16_sr_8bit: as the fp32-weight form with bf16 weights, plus the stochastic-rounding hash's two int32 tables
        (parameter ordinal, element index) per block (8 / 128):                                 (14.1875)
    The kernel launches and the one-program _clip_kernel move bytes independent of the parameter count."""
    g = w = weight_bytes
    norm = g
    if state == "exact":
        return norm + (g + 12) + (12 + w + g)
    if state not in ("fp32_master_8bit", "bf16_sr_8bit"):
        raise ValueError(f"unknown optimizer state {state!r}")
    scales = 2 * 2 * 4 / 128
    if state == "fp32_master_8bit" and masters:
        return norm + (g + 4 + 2) + (4 + w + 2 + g) + scales
    tables = 2 * 4 / 128 if state == "bf16_sr_8bit" else 0.0
    return norm + (g + w + 2) + (w + 2 + g) + scales + tables


class FlatLowBitAdamW:
    """LowBitAdamW's step over flat buffers, for the CUDA-graph path: the bf16 (or fp32) parameters and gradients,
    the fp32 masters (fp32_master_8bit over bf16 weights), the uint8 codes of m and sqrt(v), their per-block fp32
    scales, and per block the parameter ordinal and first element index (the stochastic-rounding hash's inputs).
    Every tensor starts at a 128-value block (kernels._adamw8_kernel quantizes per block), so a block never mixes
    two tensors and each tensor's codes and scales are views (optimizer.state keeps LowBitAdamW's layout: its
    state_dict and checkpoints are the eager optimizer's). A step: _sumsq_kernel + _clip_kernel (norm, clip
    divisor, step count, fp64 bias corrections: FlatMasterAdamW's) and one _adamw8_kernel per parameter group.
    Built at the first optimizer step, as FlatMasterAdamW; the buffers are filled one kind at a time (weights,
    gradients, masters, then the codes), each old tensor freed as it is copied, so the build's peak is the
    largest buffer over the final footprint, not a second copy of everything."""

    def __init__(self, optimizer, max_grad_norm: float):
        self.optimizer = optimizer
        self.max_grad_norm = float(max_grad_norm)
        device = optimizer.model_params[0].device
        self.norm = torch.zeros((), dtype=torch.float32, device=device)
        self.divisor = torch.ones((), dtype=torch.float32, device=device)
        self.segments = None
        self.grad = None

    @staticmethod
    def unsupported(optimizer) -> str | None:
        from stages.engine.lowbit_adamw import LowBitAdamW
        if not isinstance(optimizer, LowBitAdamW):
            return "not a LowBitAdamW"
        if not kernels.available(*optimizer.model_params[:1]):
            return "Triton unavailable on this device"
        return None

    @staticmethod
    def _layout(opt, has_grad) -> tuple[list, list, int]:
        """(entries (model param, state tensor, offset, numel), segments (group, start, end), flat length) of the
        parameters `has_grad` admits, each one's range whole quantization blocks."""
        from stages.engine.lowbit_adamw import BLOCK
        entries, segments, offset = [], [], 0
        for gi, group in enumerate(opt.param_groups):
            # Each segment starts at a multiple of SEGMENT_BLOCKS blocks: its per-block slices (fp32 scales, int32
            # ordinals and bases) are then 16-byte aligned, as warm_up's scratch buffers are. Triton specialises a
            # pointer argument on that alignment, so a segment starting at an odd block (a reward model's head
            # rounds the decay group to 97 blocks) launched a variant no warm-up had compiled, inside the timed
            # loop (issue 38: seen in perf.json's triton_first_launches).
            offset = -(-offset // (SEGMENT_BLOCKS * BLOCK)) * (SEGMENT_BLOCKS * BLOCK)
            start = offset
            for t in group["params"]:                     # t: the master (fp32_master_8bit over bf16) or the weight
                p = opt._model_of.get(id(t), t)
                if not has_grad(p):
                    continue
                entries.append((p, t, offset, p.numel()))
                offset += -(-p.numel() // BLOCK) * BLOCK
            if offset > start:
                segments.append((gi, start, offset))
        return entries, segments, offset

    @staticmethod
    def planned_sizes(optimizer) -> tuple[int, list[int]]:
        """As FlatMasterAdamW.planned_sizes: the flat length and each segment's values (its blocks follow)."""
        _, segments, offset = FlatLowBitAdamW._layout(optimizer, lambda p: p.requires_grad)
        return offset, [end - start for _, start, end in segments]

    @torch.no_grad()
    def _build(self) -> None:
        from stages.engine.lowbit_adamw import BLOCK, n_blocks
        opt = self.optimizer
        masters = opt.master_params is not None
        entries, segments, offset = self._layout(opt, lambda p: p.grad is not None)
        if not entries:
            raise RuntimeError("flat AdamW: no parameter has a gradient at the first optimizer step")
        p0 = entries[0][0]
        dev = p0.device
        nb = offset // BLOCK

        def migrate(dtype, get, put):
            buf = torch.zeros(offset, dtype=dtype, device=dev)
            for p, t, o, n in entries:
                buf[o:o + n].copy_(get(p, t).reshape(-1))
                put(p, t, buf[o:o + n])
            release_freed_memory(dev)
            return buf

        def set_data(p, t, view):
            p.data = view.view_as(p)

        def set_grad(p, t, view):
            p.grad = view.view_as(p)

        self.param = migrate(p0.dtype, lambda p, t: p, set_data)
        self.grad = migrate(p0.dtype, lambda p, t: p.grad, set_grad)
        mark_grad_accumulators([p for p, _, _, _ in entries], True)      # as FlatMasterAdamW._build
        self.master = migrate(torch.float32, lambda p, t: t, lambda p, t, v: setattr(t, "data", v.view_as(t))) \
            if masters else self.param
        self.step_count = opt.step_count
        bufs = {}
        for kind, dtype, size in (("m_codes", torch.uint8, offset), ("s_codes", torch.uint8, offset),
                                  ("m_scale", torch.float32, nb), ("s_scale", torch.float32, nb)):
            bufs[kind] = torch.zeros(size, dtype=dtype, device=dev)
        ordinal = torch.zeros(nb, dtype=torch.int32)
        base = torch.zeros(nb, dtype=torch.int32)
        for p, t, o, n in entries:
            state = opt.state[t]
            b0, k = o // BLOCK, n_blocks(n)
            ordinal[b0:b0 + k] = opt.ordinal[id(t)]
            base[b0:b0 + k] = torch.arange(k, dtype=torch.int32) * BLOCK
            views = {"m_codes": bufs["m_codes"][o:o + n].view_as(t), "s_codes": bufs["s_codes"][o:o + n].view_as(t),
                     "m_scale": bufs["m_scale"][b0:b0 + k], "s_scale": bufs["s_scale"][b0:b0 + k]}
            resumed = "m_codes" in state
            for key, view in views.items():
                if resumed:
                    view.copy_(state[key] if key.endswith("codes") else state[key][:k])
                state[key] = view
            state["step"] = self.step_count
        self.m_codes, self.s_codes, self.m_scale, self.s_scale = (bufs[k] for k in ("m_codes", "s_codes", "m_scale",
                                                                                    "s_scale"))
        self.ordinal, self.base = ordinal.to(dev), base.to(dev)
        self.partials = torch.zeros(-(-offset // NORM_BLOCK), dtype=torch.float32, device=dev)
        groups = [opt.param_groups[gi] for gi, _, _ in segments]
        self.hyper = [(*g["betas"], g["eps"], g["weight_decay"]) for g in groups]
        t = float(self.step_count)
        self.bias = torch.tensor([[b1 ** t, b2 ** t, b1, b2, 0.0, 0.0] for b1, b2, _, _ in self.hyper],
                                 dtype=torch.float64, device=dev)
        self.segments = segments
        self.has_master = masters
        self.sr = opt.state_mode == "bf16_sr_8bit" and p0.dtype == torch.bfloat16

    def step(self, lrs: list[torch.Tensor]) -> torch.Tensor:
        """As FlatMasterAdamW.step: clip + AdamW (8-bit moments) + zero the gradients; capturable."""
        from stages.engine.lowbit_adamw import BLOCK
        if self.segments is None:
            self._build()
        _norm_and_clip(self.grad, self.grad.numel(), self.partials, self.norm, self.divisor, self.step_count,
                       self.bias, self.max_grad_norm)
        for i, (gi, start, end) in enumerate(self.segments):
            beta1, beta2, eps, wd = self.hyper[i]
            b0, b1 = start // BLOCK, end // BLOCK
            sl = slice(start, end)
            kernels._adamw8_kernel[(-(-(b1 - b0) // TILE_ROWS),)](
                self.grad[sl], self.param[sl], self.master[sl], self.m_codes[sl], self.m_scale[b0:b1],
                self.s_codes[sl], self.s_scale[b0:b1], self.ordinal[b0:b1], self.base[b0:b1], b1 - b0, end - start,
                lrs[gi],
                self.bias[i], self.divisor, self.step_count, self.optimizer.seed, beta1, 1.0 - beta1, beta2,
                1.0 - beta2, eps, wd, HAS_MASTER=self.has_master, SR=self.sr, ROWS=TILE_ROWS, B=BLOCK, EVEN=True,
                FAST=kernels.PTX)
        return self.norm

    @staticmethod
    def warm_up(device: torch.device, dtype: torch.dtype, has_master: bool, sr: bool,
                sizes: tuple[int, list[int]] | None = None) -> float:
        """Compile the kernels a run launches, on scratch buffers (as FlatMasterAdamW.warm_up, sizes included:
        one program of TILE_ROWS blocks, the run's block and value counts)."""
        from stages.engine.lowbit_adamw import BLOCK
        t0 = time.perf_counter()
        n = max(2 * BLOCK, NORM_BLOCK)
        g = torch.zeros(n, dtype=dtype, device=device)
        norm, divisor, step = (torch.ones((), dtype=torch.float32, device=device) for _ in range(3))
        partials = torch.zeros(1, dtype=torch.float32, device=device)
        bias = torch.tensor([[1.0, 1.0, 0.9, 0.999, 0.1, 0.1]], dtype=torch.float64, device=device)
        for total, segs in [(2 * BLOCK, [2 * BLOCK])] + ([sizes] if sizes else []):
            for max_norm in (1.0, 0.0):                      # with and without the clip (CLIP)
                _norm_and_clip(g, total, partials, norm, divisor, step, bias, max_norm)
            for seg in segs:
                # the master argument as the run passes it: the fp32 masters, or else the weights themselves (a
                # bf16 pointer there is another specialisation: an fp32 one here left the real variant to compile
                # inside the first timed step, ~1 s at 7B on an H100)
                kernels.launch_adamw8_scratch(device, dtype, torch.float32, has_master, sr, True, seg // BLOCK, seg,
                                              BLOCK, 12345)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    def release(self) -> None:
        mark_grad_accumulators(self.optimizer.model_params, False)
        for p in self.optimizer.model_params:
            p.grad = None
        self.grad = None
