"""Over ~500 lines on purpose: the model-side contract of training (attention backends, fused-kernel routing, the
log-prob and reward heads, loading) is read together; the fused routing patches the modules this file loads.

Models over packed micro-batches: varlen attention, chunked completion log-probs, a scalar reward head.

Attention: transformers' AttentionInterface lets a model call our function for every attention
layer. transformers (5.x) forwards extra model kwargs untouched down to it, so we pass
`cu_seq_lens_q/k` and `max_length_q/k` (the same names its flash-attention path uses) to the
model forward. Because our implementation name has no entry in the mask interface, transformers
builds no mask at all (attention_mask=None): the sequence boundaries come only from cu_seqlens.
Backends, fastest available first:
  - CUDA + flash_attn installed: flash_attn_varlen_func(causal=True), GQA native;
  - CUDA: torch.nn.attention.varlen.varlen_attn with window_size=(-1, 0) (= causal), k/v expanded
    to all query heads (torch 2.11 has no GQA flag there);
  - otherwise (CPU, fp32): per-sequence SDPA with is_causal. Exact, not fast.

Log-probs: the decoder body runs once; the LM head is applied only at positions that predict a
completion token, chunk by chunk under activation checkpointing, so [tokens, vocab] fp32 logits
never exist (see DESIGN.md "Kernel facts"). Per-sequence sums are float64.

Fused kernels (`use_fused_kernels`, on CUDA only; CPU keeps HF's forward bit for bit): Qwen2/Llama-style
RMSNorm through torch's fused kernel; the rotary embedding of q/k and the MLP's silu(gate) * up through the
Triton kernels of stages/engine/kernels.py; q|k|v and gate|up as one GEMM each (GroupedLinear: per layer 3 and
2 projections of the same input, and in a 0.5B step the k/v GEMMs are only 128 columns wide).

Reward model: AutoModelForSequenceClassification (num_labels=1) = the causal-LM body + `score`
(a linear hidden -> 1, no LM head). The score is read where HF's own forward pools for the exported
config: the last token whose id != pad_token_id (TokenPairs.with_score_positions), with pad_token_id
resolved once by `reward_pad_token_id` and exported in both config.json and the tokenizer, so the export
batch-scored with right padding reproduces the training and probe scores (pad == EOS included: a trailing
EOS is then not read, as in TRL's RewardTrainer).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from stages.engine import kernels

PACKED_ATTENTION = "prefpipe_packed_varlen"

_UNRESOLVED = object()
_flash_attn_varlen_func = _UNRESOLVED   # resolved on first CUDA use (_varlen_kernels): importing
_torch_varlen_attn = _UNRESOLVED        # torch.nn.attention.varlen pulls in torch._dynamo (~2 s), which a CPU
                                        # run never needs; a GPU run pays it once, at its first attention call


def _varlen_kernels():
    """(flash_attn_varlen_func or None, torch varlen_attn or None), imported once."""
    global _flash_attn_varlen_func, _torch_varlen_attn
    if _flash_attn_varlen_func is _UNRESOLVED:
        try:  # optional: classic flash-attn 2 (source build only); torch's varlen is the default fast path
            from flash_attn import flash_attn_varlen_func as found
        except Exception:  # noqa: BLE001 - any import failure means "not available"
            found = None
        _flash_attn_varlen_func = found
    if _torch_varlen_attn is _UNRESOLVED:
        try:
            from torch.nn.attention.varlen import varlen_attn as found
        except Exception:  # noqa: BLE001
            found = None
        _torch_varlen_attn = found
    return _flash_attn_varlen_func, _torch_varlen_attn


USED_BACKENDS: set[str] = set()   # which attention kernels actually ran in this process (run_info)


class ModelLoadError(ValueError):
    """The model directory is not what the stage needs (wrong head, missing weights)."""


# ----------------------------------------------------------------------------------------------
# Packed variable-length attention
# ----------------------------------------------------------------------------------------------

def attention_backend(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        flash, varlen = _varlen_kernels()
        if flash is not None:
            return "flash_attn"
        if varlen is not None:
            return "torch_varlen"
    return "sdpa_per_sequence"


def packed_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None,
                             dropout: float = 0.0, sliding_window: int | None = None,
                             cu_seq_lens_q: torch.Tensor | None = None, cu_seq_lens_k: torch.Tensor | None = None,
                             max_length_q: int | None = None, max_length_k: int | None = None,
                             kv_index: torch.Tensor | None = None, **_ignored):
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] -> ([1, T, Hq, D], None). Causal within each segment.

    Without kv_index, query segment i attends causally to the same tokens (cu_seq_lens_k must equal
    cu_seq_lens_q). With kv_index (a shared-prompt batch, see packing.PackedBatch), keys/values are
    first gathered by kv_index and query segment i attends to key segment i of cu_seq_lens_k, the
    causal mask aligned bottom-right (query j of an Lq-token segment sees keys [0, Lk - Lq + j]).
    """
    if cu_seq_lens_q is None or max_length_q is None:
        raise RuntimeError(f"{PACKED_ATTENTION} needs cu_seq_lens_q/max_length_q: call the model through "
                           "stages.engine.modeling (packed batches), not a plain forward")
    if attention_mask is not None:
        raise RuntimeError(f"{PACKED_ATTENTION} got an attention mask; packed batches are delimited by cu_seqlens only")
    if sliding_window is not None:
        raise NotImplementedError("sliding-window attention layers are not supported by the packed attention")
    if dropout:
        raise NotImplementedError("attention dropout > 0 is not supported by the packed attention")
    if query.shape[0] != 1:
        raise RuntimeError(f"packed attention expects batch size 1 (one packed row), got {query.shape[0]}")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))   # [T, H, D]
    if kv_index is None:
        cu_k, max_k = cu_seq_lens_q, max_length_q
    else:
        k, v = k.index_select(0, kv_index), v.index_select(0, kv_index)
        cu_k, max_k = cu_seq_lens_k, max_length_k
    n_rep = q.shape[1] // k.shape[1]
    if q.is_cuda and torch.is_autocast_enabled("cuda"):
        # Under autocast q/k come out of the fp32 rotary embedding as fp32 while v is bf16: run the
        # kernel in the autocast dtype, as autocast itself would for SDPA.
        dtype = torch.get_autocast_dtype("cuda")
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    backend = attention_backend(q.device, q.dtype)
    USED_BACKENDS.add(backend)

    if backend == "flash_attn":      # causal is bottom-right aligned in flash-attn >= 2.1
        out = _flash_attn_varlen_func(q, k, v, cu_seq_lens_q, cu_k, max_length_q, max_k,
                                      softmax_scale=scaling, causal=True)
    elif backend == "torch_varlen":  # window (-1, 0) = causal, bottom-right aligned (tests/engine/test_gpu.py)
        if n_rep > 1:
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        out = _torch_varlen_attn(q, k, v, cu_seq_lens_q, cu_k, max_length_q, max_k,
                                 scale=scaling, window_size=(-1, 0))
    else:
        q_bounds, k_bounds = cu_seq_lens_q.tolist(), cu_k.tolist()   # host tensors on CPU: no device sync
        # One split per tensor, not a slice per segment: a slice's backward is a zero tensor of the whole packed
        # row with its segment copied in, and autograd then adds one such tensor per segment (a 64-segment batch
        # did 64 full-row fills and adds per q, k and v per layer: a fifth of a CPU step). The split's backward is
        # one cat. The gradient values are the same (each row's from its one segment; only the sign of an exact
        # zero could differ, which no result depends on: tests/workflow/test_pipeline_e2e.py's golden record).
        q_parts, k_parts, v_parts = (_segments(x, bounds) for x, bounds in ((q, q_bounds), (k, k_bounds),
                                                                            (v, k_bounds)))
        outs = []
        for q_seg, k_seg, v_seg in zip(q_parts, k_parts, v_parts):
            qs = q_seg.transpose(0, 1)                                  # [H, Lq, D]
            ks, vs = k_seg.transpose(0, 1), v_seg.transpose(0, 1)
            lq, lk = qs.shape[1], ks.shape[1]
            if lq == 0:             # an empty segment (a padded batch's filler sequence) has no output rows
                continue
            if lq == lk:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling, enable_gqa=n_rep > 1)
            else:
                mask = (torch.arange(lk, device=q.device)[None, :]
                        <= torch.arange(lq, device=q.device)[:, None] + (lk - lq))
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scaling, enable_gqa=n_rep > 1)
            outs.append(o.transpose(0, 1))
        out = torch.cat(outs, dim=0)
    return out.unsqueeze(0), None


def _segments(x: torch.Tensor, bounds: list[int]) -> tuple[torch.Tensor, ...]:
    """x[bounds[i]:bounds[i + 1]] for each segment i, as one split of dim 0 (rows outside the bounds, a padded
    batch's tail, are split off and dropped)."""
    sizes = [bounds[0], *(b - a for a, b in zip(bounds, bounds[1:])), x.shape[0] - bounds[-1]]
    return x.split(sizes)[1:-1]


# RMSNorm classes whose forward is exactly weight * (x / rms(x)) with eps inside the root (HF's own code).
FUSABLE_RMS_NORMS = ("Qwen2RMSNorm", "LlamaRMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")


def _fused_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """torch's fused RMSNorm kernel on CUDA (one kernel forward and one backward instead of HF's ~8 and ~12
    elementwise ones, 49 times per step on a 24-layer model); HF's own forward elsewhere, so CPU results are
    unchanged. Both compute in fp32 inside; HF rounds the normalized value to the input dtype before the
    weight multiply, the fused kernel once after it (a bf16 rounding difference)."""
    if hidden_states.is_cuda and hidden_states.dtype == self.weight.dtype:
        return torch.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)


# MLPs whose forward is exactly down(act(gate(x)) * up(x)), and attention classes that call their module's
# apply_rotary_pos_emb(q, k, cos, sin) with HF's standard formula.
FUSABLE_MLPS = ("Qwen2MLP", "LlamaMLP", "Qwen3MLP", "MistralMLP")
SILU_ACTIVATIONS = ("SiLU", "SiLUActivation")
ROTARY_ATTENTIONS = ("Qwen2Attention", "LlamaAttention", "Qwen3Attention", "MistralAttention")


def adjacent_rows(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """torch.cat(tensors) (along dim 0) without a copy when they already lie back to back in one storage, as
    the flat parameter buffer of flat_adamw lays out a layer's q/k/v (and gate/up) weights; else None."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.storage_offset() != offset):
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))


# Marks a parameter whose .grad is a persistent accumulator that nothing hooks: flat_adamw's flat gradient under the
# CUDA-graph step (one process; the optimizer kernel zeroes it after each step). GroupedLinear's backward adds such a
# weight's gradient into .grad inside its GEMM (C += dy^T x, cuBLAS beta = 1) and hands autograd no gradient for it,
# so AccumulateGrad's separate add (reading .grad and the new gradient, writing .grad: three sweeps of the weights)
# and the new gradient's own write go away. At 7B on an H100 those adds were ~14 ms of a ~220 ms step (339 adds a
# step, bench/results/h100_issue38_dd4ac83/). DDP, FSDP2 and fused_backward hook AccumulateGrad, and an eager step
# sets .grad to None between steps: only the flat graph step marks parameters (mark_grad_accumulators).
_ADDS_INTO_GRAD = "_prefpipe_backward_adds_into_grad"


def mark_grad_accumulators(params, on: bool) -> int:
    """Mark (on) or unmark these parameters as persistent .grad accumulators (above) -> how many changed."""
    n = 0
    for p in params:
        if on and not getattr(p, _ADDS_INTO_GRAD, False):
            setattr(p, _ADDS_INTO_GRAD, True)
            n += 1
        elif not on and hasattr(p, _ADDS_INTO_GRAD):
            delattr(p, _ADDS_INTO_GRAD)
            n += 1
    return n


def _grad_accumulator(weights) -> torch.Tensor | None:
    """The weights' .grad as one [rows, in] tensor to add into in place: every weight marked, its .grad a tensor
    of its own dtype and shape, all back to back in one storage (adjacent_rows); else None (autograd adds)."""
    grads = []
    for w in weights:
        g = w.grad
        if not getattr(w, _ADDS_INTO_GRAD, False) or g is None or g.dtype != w.dtype or g.shape != w.shape:
            return None
        grads.append(g)
    return adjacent_rows(grads)


class GroupedLinear(torch.autograd.Function):
    """x @ cat(W_1..W_n).T + cat(b_1..b_n): n Linear layers that read the same input as ONE GEMM forward and
    one each for the input and weight gradients backward (instead of n each, plus n - 1 adds summing the
    input's gradient and n bias reductions). The weights are concatenated without a copy when adjacent
    (adjacent_rows), else with one. Same math as the separate layers; the GEMM's blocking may differ. Weights
    marked as gradient accumulators (mark_grad_accumulators) get their gradient added into .grad by the weight
    GEMM itself (one rounding to the gradient's dtype instead of two when .grad already holds a sum)."""

    @staticmethod
    def forward(ctx, x, n_weights: int, *params):
        weights, biases = params[:n_weights], params[n_weights:]
        w = adjacent_rows(list(weights))
        w = torch.cat(weights) if w is None else w
        b = None
        if biases:
            b = adjacent_rows(list(biases))
            b = torch.cat(biases) if b is None else b
        ctx.save_for_backward(x, w)
        ctx.weights = weights           # the leaf parameters themselves: their .grad is where a marked one adds
        ctx.splits = [t.shape[0] for t in weights]
        ctx.has_bias = bool(biases)
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dy.matmul(w) if ctx.needs_input_grad[0] else None
        n = len(ctx.splits)             # frozen weights (LoRA's base layers) need no weight gradient
        dw = (None,) * n
        if any(ctx.needs_input_grad[2:2 + n]):
            x2 = x.reshape(-1, x.shape[-1])
            acc = _grad_accumulator(ctx.weights) if all(ctx.needs_input_grad[2:2 + n]) else None
            if acc is not None:
                acc.addmm_(dy2.t(), x2)         # .grad += dy^T x in the GEMM; autograd gets None: nothing to add
            else:
                dw = dy2.t().matmul(x2).split(ctx.splits)
        db = dy2.sum(0).split(ctx.splits) if ctx.has_bias else ()
        return (dx, None, *dw, *db)


GROUPED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))   # what the fused path groups


def make_grouped_weights_adjacent(model: nn.Module) -> int:
    """Lay out each group of Linear layers that the fused path runs as one GEMM (an attention's q/k/v, an MLP's
    gate/up: GROUPED_PROJECTIONS) back to back in one storage, weights and biases, so GroupedLinear reads them in
    place (adjacent_rows) instead of concatenating them, a copy of every grouped weight, at every forward. For
    the no-grad models of generation and judging, whose parameters no optimizer lays out (flat_adamw does it for
    a training run): at a 7B decode step the copies were a quarter of the GPU time. Values are unchanged, so
    every output is too. Returns the number of groups laid out."""
    groups = 0
    with torch.no_grad():
        for module in model.modules():
            for names in GROUPED_PROJECTIONS:
                layers = [getattr(module, n, None) for n in names]
                if not all(type(m) is nn.Linear for m in layers):
                    continue
                for attr in ("weight", "bias"):
                    tensors = [getattr(m, attr) for m in layers]
                    if (any(t is None for t in tensors) or adjacent_rows(tensors) is not None
                            or len({(t.dtype, t.device, t.shape[1:]) for t in tensors}) != 1):
                        continue
                    joined = torch.cat([t.detach() for t in tensors])
                    start = 0
                    for m, t in zip(layers, tensors):
                        getattr(m, attr).data = joined[start:start + t.shape[0]]
                        start += t.shape[0]
                groups += 1
    return groups


def grouped_linear(x: torch.Tensor, layers: list[nn.Linear]) -> torch.Tensor:
    biases = [m.bias for m in layers if m.bias is not None]
    if biases and len(biases) != len(layers):
        raise ValueError("grouped_linear: either every layer has a bias or none")
    return GroupedLinear.apply(x, len(layers), *(m.weight for m in layers), *biases)


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """An attention's o_proj or an MLP's down_proj on the fused path: a one-weight GroupedLinear (the same GEMMs as
    F.linear), so a marked weight's gradient is added into .grad in its GEMM; F.linear elsewhere (bit-identical to
    nn.Linear's forward)."""
    if _fusable_projection_input(x, [self]):
        return GroupedLinear.apply(x, 1, self.weight, *([self.bias] if self.bias is not None else []))
    return F.linear(x, self.weight, self.bias)


def _fusable_projection_input(x: torch.Tensor, layers: list[nn.Linear]) -> bool:
    """One GEMM for these layers: on the fused-kernel path (CUDA), same dtype throughout, no autocast
    (autocast would run the GEMM in another dtype than the backward sees), not under torch.compile (which
    fuses on its own and would have to trace the q -> k -> v hand-over)."""
    return (kernels.available(x) and not torch.is_autocast_enabled(x.device.type) and not torch.compiler.is_compiling()
            and all(m.weight.dtype == x.dtype and (m.bias is None or m.bias.dtype == x.dtype) for m in layers))


def _fused_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """gate|up as one GEMM and silu(gate) * up as one Triton kernel each way on CUDA (stages/engine/kernels.py);
    HF's forward elsewhere."""
    if not kernels.available(x):
        return type(self).forward(self, x)
    pair = [self.gate_proj, self.up_proj]
    # Only plain Linear layers: a LoRA layer (peft's lora.Linear) exposes its base weight as `.weight`, and one
    # GEMM over that would drop the adapter; it runs through its own forward below.
    if (all(type(m) is nn.Linear for m in pair) and _fusable_projection_input(x, pair)
            and self.gate_proj.weight.shape == self.up_proj.weight.shape
            and self.gate_proj.bias is None and self.up_proj.bias is None):
        return self.down_proj(kernels.silu_mul_halves(grouped_linear(x, pair)))
    gate, up = self.gate_proj(x), self.up_proj(x)
    if gate.dtype != up.dtype or gate.shape != up.shape:
        return self.down_proj(self.act_fn(gate) * up)
    return self.down_proj(kernels.silu_mul(gate, up))


class _QKVProjection:
    """Routes an attention module's q_proj/k_proj/v_proj calls to one GroupedLinear GEMM while keeping HF's
    own attention forward: that forward calls q_proj(h), k_proj(h), v_proj(h) in turn on the same `h`, so
    q_proj computes all three and hands k and v (column slices of the one output) to the next two calls.
    A call with another input, or off the fused path, runs that layer's own Linear."""

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear):
        self.layers = [q, k, v]
        self.stash: tuple | None = None

    def install(self) -> None:
        import types
        for i, layer in enumerate(self.layers):
            layer.forward = types.MethodType(lambda lin, x, _i=i: self.call(_i, lin, x), layer)

    def call(self, i: int, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if i == 0:
            self.stash = None
            if _fusable_projection_input(x, self.layers):
                sizes = [m.weight.shape[0] for m in self.layers]
                q, k, v = grouped_linear(x, self.layers).split(sizes, dim=-1)
                self.stash = (x, k, v)
                return q
        elif self.stash is not None and self.stash[0] is x:
            out = self.stash[i]
            if i == 2:
                self.stash = None
            return out
        return F.linear(x, layer.weight, layer.bias)


def _fused_rotary(original):
    """A module's apply_rotary_pos_emb that sends a packed row's q/k ([1, H, T, D] views of the projections'
    [1, T, H, D] outputs) to one Triton kernel and returns them as views of contiguous [T, H, D] tensors, the
    layout the varlen attention reads without a copy. A decode step's ([B, H, 1, D]: one token a row, generation)
    goes to the same kernel with the rows as its tokens, instead of HF's ~5 kernels a tensor. Anything else goes
    to HF's function unchanged."""
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if (unsqueeze_dim == 1 and q.ndim == 4 and k.ndim == 4 and cos.ndim == 3 and sin.shape == cos.shape
                and kernels.available(q, k, cos)):
            if q.shape[0] == 1 and k.shape[0] == 1 and cos.shape[0] == 1:
                qf, kf = q[0].transpose(0, 1), k[0].transpose(0, 1)
                if kernels.rope_supported(qf, kf, cos[0], sin[0]):
                    qo, ko = kernels.rotary_qk(qf, kf, cos[0], sin[0])
                    return qo.transpose(0, 1).unsqueeze(0), ko.transpose(0, 1).unsqueeze(0)
            elif q.shape[2] == 1 and k.shape[2] == 1 and cos.shape[1] == 1 and cos.shape[0] == q.shape[0]:
                qf, kf = q[:, :, 0], k[:, :, 0]                # [B, H, D]: the rows are the kernel's tokens
                if kernels.rope_supported(qf, kf, cos[:, 0], sin[:, 0]):
                    qo, ko = kernels.rotary_qk(qf, kf, cos[:, 0], sin[:, 0])
                    return qo.unsqueeze(2), ko.unsqueeze(2)
        return original(q, k, cos, sin, unsqueeze_dim)
    apply_rotary_pos_emb.prefpipe_original = original
    return apply_rotary_pos_emb


def use_fused_kernels(model: nn.Module) -> dict:
    """Route a loaded model's norms, SiLU-gated MLPs and rotary embedding through fused kernels on CUDA
    (RMSNorm: torch's; the others: stages/engine/kernels.py). Every routed call falls back to HF's own code where
    the kernels cannot run (CPU, or no Triton: kernels.available), so CPU results are bit-identical. Routing
    does not depend on whether Triton is installed, so the counts (run_info's `fused_kernels`) of a CPU run are
    the same from either lock (the runtime lock has no triton). The rotary routing replaces the function
    in the attention class's transformers module (it is a module-level function there, called by name), for
    every model of that class in this process. Returns how many modules of each kind were routed. An attention's
    o_proj and an MLP's down_proj (plain Linear layers) also go through a one-weight GroupedLinear on the fused path
    (_linear_forward: the same GEMMs, so a marked weight's gradient is added in place); they are not counted, so
    run_info's `fused_kernels` stays what it was."""
    import sys
    import types
    counts = {"rms_norm": 0, "silu_mul": 0, "rotary": 0, "qkv_gemm": 0}
    for m in model.modules():
        name = type(m).__name__
        if name in FUSABLE_RMS_NORMS and hasattr(m, "variance_epsilon"):
            m.forward = types.MethodType(_fused_rms_norm_forward, m)
            counts["rms_norm"] += 1
        elif (name in FUSABLE_MLPS and type(getattr(m, "act_fn", None)).__name__ in SILU_ACTIVATIONS
                and all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj"))):
            m.forward = types.MethodType(_fused_mlp_forward, m)
            counts["silu_mul"] += 1
            if type(m.down_proj) is nn.Linear:
                m.down_proj.forward = types.MethodType(_linear_forward, m.down_proj)
        elif name in ROTARY_ATTENTIONS:
            hf_module = sys.modules[type(m).__module__]
            current = getattr(hf_module, "apply_rotary_pos_emb", None)
            if current is None:
                continue
            if not hasattr(current, "prefpipe_original"):
                hf_module.apply_rotary_pos_emb = _fused_rotary(current)
            counts["rotary"] += 1
            projections = [getattr(m, a, None) for a in ("q_proj", "k_proj", "v_proj")]
            if all(type(x) is nn.Linear for x in projections) and len({x.in_features for x in projections}) == 1:
                _QKVProjection(*projections).install()
                counts["qkv_gemm"] += 1
            if type(getattr(m, "o_proj", None)) is nn.Linear:
                m.o_proj.forward = types.MethodType(_linear_forward, m.o_proj)
    return counts


def warm_up_fused_kernels(model: nn.Module, device: torch.device, dtype: torch.dtype,
                          cos_dtype: torch.dtype | None = None) -> float:
    """Compile the Triton kernels a training run of this model launches (forward and backward) before its
    timed loop; 0 off CUDA. dtype: q/k and gate/up's dtype; cos_dtype: the rotary tables' (fp32 under
    autocast, where HF computes them in the fp32 hidden states' dtype)."""
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return kernels.warm_up(device, dtype, heads, getattr(cfg, "num_key_value_heads", None) or heads, head_dim,
                           cos_dtype)


def register_packed_attention() -> str:
    """Make PACKED_ATTENTION a transformers attn_implementation (idempotent). Called by the loaders below, not
    at import: the registry lives in transformers submodules that cost ~1.5 s to import, and importing this
    module should not (the stage CLIs import it before they know whether a model is needed)."""
    from transformers import AttentionInterface
    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    return PACKED_ATTENTION


def decoder_hidden_states(body: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                          cu_seqlens: torch.Tensor, max_seqlen: int, cu_seqlens_k: torch.Tensor | None = None,
                          max_seqlen_k: int = 0, kv_index: torch.Tensor | None = None) -> torch.Tensor:
    """Run the transformer body on one packed row -> final (normed) hidden states [T, H]."""
    shared = kv_index is not None
    out = body(input_ids=input_ids, position_ids=position_ids, use_cache=False, cu_seq_lens_q=cu_seqlens,
               cu_seq_lens_k=cu_seqlens_k if shared else cu_seqlens, max_length_q=max_seqlen,
               max_length_k=max_seqlen_k if shared else max_seqlen, kv_index=kv_index)
    return out.last_hidden_state[0]


# ----------------------------------------------------------------------------------------------
# Chunked completion log-probs
# ----------------------------------------------------------------------------------------------

def token_logps_chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      targets: torch.Tensor) -> torch.Tensor:
    """log softmax(h W^T + b)[target] in fp32, for one chunk of positions (temperature 1 by definition).

    log_softmax(dtype=float32) reads bf16 logits and writes fp32 in one kernel, and its backward writes the
    logits' gradient in their own dtype: no separate fp32 copy of the [chunk, vocab] logits, about a third
    of the memory traffic of `.float()` + gather - logsumexp (which is memory-bound at this size)."""
    logits = F.linear(hidden, weight, bias)
    return F.log_softmax(logits, dim=-1, dtype=torch.float32).gather(-1, targets[:, None]).squeeze(-1)


def completion_token_logps(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           targets: torch.Tensor, chunk_tokens: int, chunk_fn=token_logps_chunk) -> torch.Tensor:
    """Per-token log-probs [C] without materializing [C, vocab] logits: under grad each chunk is
    checkpointed (its logits are recomputed in backward instead of stored)."""
    outs = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        args = (hidden[start:start + chunk_tokens], weight, bias, targets[start:start + chunk_tokens])
        if torch.is_grad_enabled():
            # The chunk is deterministic (no dropout): skipping the RNG save/restore also keeps it capturable
            # in a CUDA graph (trainer's graphed step).
            outs.append(checkpoint(chunk_fn, *args, use_reentrant=False, preserve_rng_state=False))
        else:
            outs.append(chunk_fn(*args))
    return torch.cat(outs) if outs else hidden.new_zeros(0, dtype=torch.float32)


def base_model(model: nn.Module) -> nn.Module:
    return getattr(model, model.base_model_prefix)


class SequenceLogProbs(nn.Module):
    """Causal LM -> summed completion log-probs per packed sequence, float64 [S].

    The module DDP/FSDP wrap: its forward is the whole computation, so gradient hooks see one call.
    """

    def __init__(self, lm: nn.Module, chunk_tokens: int, compile_chunks: bool = False):
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        self.chunk_fn = torch.compile(token_logps_chunk, dynamic=True) if compile_chunks else token_logps_chunk

    def forward(self, input_ids, position_ids, cu_seqlens, max_seqlen, logp_positions, logp_targets, logp_seq,
                n_seqs: int, cu_seqlens_k=None, max_seqlen_k: int = 0, kv_index=None, **_unused) -> torch.Tensor:
        hidden = decoder_hidden_states(base_model(self.lm), input_ids, position_ids, cu_seqlens, max_seqlen,
                                       cu_seqlens_k, max_seqlen_k, kv_index)
        head = self.lm.get_output_embeddings()
        token_logps = completion_token_logps(hidden.index_select(0, logp_positions), head.weight, head.bias,
                                             logp_targets, self.chunk_tokens, self.chunk_fn)
        # Device-side check (no host sync): a non-finite logit makes its row's logsumexp, hence this, non-finite.
        torch._assert_async(torch.isfinite(token_logps).all(), "non-finite log-probs (inf/NaN logits)")
        return token_logps.new_zeros(n_seqs, dtype=torch.float64).index_add_(0, logp_seq, token_logps.double())


class SequenceRewards(nn.Module):
    """Sequence-classification model (body + scalar `score`) -> one fp32 reward per packed sequence [S],
    read at `last_positions` (from TokenPairs.with_score_positions(config.pad_token_id) for HF parity)."""

    def __init__(self, seq_cls: nn.Module):
        super().__init__()
        self.seq_cls = seq_cls

    def forward(self, input_ids, position_ids, cu_seqlens, max_seqlen, last_positions, cu_seqlens_k=None,
                max_seqlen_k: int = 0, kv_index=None, **_unused) -> torch.Tensor:
        hidden = decoder_hidden_states(base_model(self.seq_cls), input_ids, position_ids, cu_seqlens, max_seqlen,
                                       cu_seqlens_k, max_seqlen_k, kv_index)
        scores = self.seq_cls.score(hidden.index_select(0, last_positions)).float().squeeze(-1)
        torch._assert_async(torch.isfinite(scores).all(), "non-finite reward scores")
        return scores


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------

def _refuse_head(model_dir, config, want: str) -> None:
    archs = list(getattr(config, "architectures", None) or [])
    if want == "causal_lm" and any(a.endswith(("ForSequenceClassification", "ForTokenClassification")) for a in archs):
        raise ModelLoadError(f"{model_dir}: architectures {archs} carry a classification head, not an LM head; "
                             "a DPO policy/reference must be a causal LM")


def load_causal_lm(model_dir, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> nn.Module:
    """The policy / reference: a causal LM with the packed attention. Refuses a checkpoint whose
    weights do not cover the model (e.g. a reward model's directory loaded as a causal LM).
    device (CUDA): the safetensors are read straight into GPU memory, not through a CPU copy; elsewhere the
    model is loaded on the CPU, as before (CPU results unchanged)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(model_dir)
    _refuse_head(model_dir, config, "causal_lm")
    placement = {"device_map": {"": device}} if device is not None and device.type == "cuda" else {}
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                       attn_implementation=register_packed_attention(),
                                                       output_loading_info=True, **placement)
    if info.get("missing_keys"):
        raise ModelLoadError(f"{model_dir}: weights missing from the checkpoint: {sorted(info['missing_keys'])[:8]}")
    model.prefpipe_fused_kernels = use_fused_kernels(model)
    return model


TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def reward_pad_token_id(model_dir, config) -> tuple[int, str]:
    """(pad id, where it came from) for a reward model: the id HF's sequence-classification pooling skips
    (it reads the last token != pad_token_id) and that a batch is right-padded with. One id for both, so
    the directory's tokenizer, when it has one, decides: its pad token; else the config's pad_token_id;
    else EOS (the tokenizer's, else the config's), as TRL and most users set pad = EOS. Refuses a model
    with neither."""
    tok = None
    if any((Path(model_dir) / name).exists() for name in TOKENIZER_MARKERS):
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    cfg_pad = config.pad_token_id
    if tok is not None and tok.pad_token_id is not None:
        if cfg_pad is not None and cfg_pad != tok.pad_token_id:
            logging.getLogger(__name__).warning(
                "%s: config pad_token_id %s != the tokenizer's pad token %r (id %d); the reward model uses "
                "and exports the tokenizer's, the id a padded batch carries", model_dir, cfg_pad,
                tok.pad_token, tok.pad_token_id)
        return int(tok.pad_token_id), "tokenizer pad_token"
    if cfg_pad is not None:
        return int(cfg_pad), "config pad_token_id"
    eos = tok.eos_token_id if tok is not None and tok.eos_token_id is not None else config.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    if eos is None or isinstance(eos, (list, tuple)):
        raise ModelLoadError(f"{model_dir}: no pad token and no EOS token, so no padding id a reward model "
                             "can share with transformers' sequence-classification pooling; set pad_token_id in "
                             "config.json (or a pad token in the tokenizer)")
    return int(eos), "eos_token (no pad token)"


def load_reward_model(model_dir, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> nn.Module:
    """Body from `model_dir` + scalar head `score` (num_labels=1). A new head is initialised from the
    torch (CPU) RNG (seed first). config.pad_token_id is set to `reward_pad_token_id` (the model records where
    it came from in `prefpipe_pad_source`); the reward is read at the last token != that id.
    device (CUDA): the safetensors are read straight into GPU memory, not through a CPU copy, and a new head
    gets the values the CPU load gives it (see _load_reward_model); elsewhere the model is loaded on the CPU."""
    placement = {"device_map": {"": device}} if device is not None and device.type == "cuda" else {}
    return _load_reward_model(model_dir, dtype, placement)


def _load_reward_model(model_dir, dtype: torch.dtype, placement: dict) -> nn.Module:
    """load_reward_model; `placement`: from_pretrained's device_map, or {} (CPU, no device map)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification
    config = AutoConfig.from_pretrained(model_dir)
    is_classifier = any(a.endswith("ForSequenceClassification") for a in (config.architectures or []))
    if is_classifier and config.num_labels != 1:
        raise ModelLoadError(f"{model_dir}: a classification head with num_labels={config.num_labels} "
                             "is not a scalar reward head")
    from transformers.utils import logging as hf_logging
    # A new `score` head is expected (checked below, body keys refused when missing): transformers' load
    # report would say so in the stage log, with the model's absolute path and only in some environments
    # (CI=true), which would make the hashed log differ between checkouts.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    cpu_rng = torch.get_rng_state()
    devices = [d for d in placement.get("device_map", {}).values() if torch.device(d).type == "cuda"]
    try:
        # With a device map transformers initialises a new head on that device, from the device's RNG: leave
        # that RNG as it was (the CPU load never draws from it), the head is made again below.
        with torch.random.fork_rng(devices=devices, enabled=bool(placement)):
            model, info = AutoModelForSequenceClassification.from_pretrained(
                model_dir, num_labels=1, dtype=dtype, attn_implementation=register_packed_attention(),
                output_loading_info=True, **placement)
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = [k for k in info.get("missing_keys", []) if not k.startswith("score.")]
    if missing:
        raise ModelLoadError(f"{model_dir}: body weights missing from the checkpoint: {sorted(missing)[:8]}")
    if not isinstance(getattr(model, "score", None), nn.Linear) or model.score.out_features != 1:
        raise ModelLoadError(f"{model_dir}: {type(model).__name__} has no scalar `score` head")
    if placement and any(k.startswith("score.") for k in info.get("missing_keys", [])):
        # A new head, as the CPU load makes it: the model's own _init_weights on a CPU copy, drawing from the
        # CPU RNG at the state the load started from (and leaving it where the CPU load leaves it), so a run's
        # seeded head does not depend on where the weights were loaded (tests/engine/test_modeling.py checks this).
        score = model.score
        fresh = nn.Linear(score.in_features, score.out_features, bias=score.bias is not None, device="meta",
                          dtype=score.weight.dtype).to_empty(device="cpu")
        torch.set_rng_state(cpu_rng)
        model._init_weights(fresh)
        with torch.no_grad():
            for name, value in fresh.named_parameters():
                getattr(score, name).copy_(value)
    model.config.pad_token_id, model.prefpipe_pad_source = reward_pad_token_id(model_dir, model.config)
    model.prefpipe_fused_kernels = use_fused_kernels(model)
    return model
