"""Fused Triton kernels for a decoder layer's elementwise work on CUDA: the rotary embedding of q and k, and
the SiLU-gated product of the MLP.

Why: with CUDA graphs the training step is GPU-bound, and in the profile of the 0.5B anchor step
(bench/results/step_profile_h200*.txt) the elementwise kernels (mul, copy, add, sum) outweigh the GEMMs'
neighbours: HF's rotary is ~5 kernels per tensor forward and ~8 backward (q * cos, a `cat` for
rotate_half, another multiply, an add), its SiLU-gated product 2 forward and 3 backward, each a full
pass over memory. Here each is one kernel forward and one backward, computing in fp32 and rounding once
(HF rounds after every op in the model dtype: results differ by bf16 rounding only).

The routing (modeling.use_fused_kernels) sends a call here only on CUDA with Triton importable; CPU and
anything unusual keep HF's own code. `warm_up` compiles every kernel variant a run uses before it is timed
(Triton compiles on first launch and caches on disk).
"""
from __future__ import annotations

import os
import time

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means "not available"
    triton = None


# Read once, as Triton itself reads it when the kernels below are defined (not per call: the routed
# modules ask on every layer call).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def available(*tensors: torch.Tensor) -> bool:
    """Triton can run these (CUDA tensors, or CPU ones under TRITON_INTERPRET=1 in tests)."""
    return triton is not None and all(t.is_cuda or _INTERPRET for t in tensors)


# ----------------------------------------------------------------------------------------------
# Rotary embedding of q and k, packed [T, H, D] layout
# ----------------------------------------------------------------------------------------------

if triton is not None:
    @triton.jit
    def _rope_rows(x_ptr, o_ptr, t, n_heads, c1, c2, s1, s2, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                   BACKWARD: tl.constexpr):
        d = tl.arange(0, HALF)[None, :]
        h = tl.arange(0, BLOCK_H)[:, None]
        mask = h < n_heads
        row = t * n_heads * 2 * HALF + h * 2 * HALF
        x1 = tl.load(x_ptr + row + d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + row + HALF + d, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            o1 = x1 * c1 + x2 * s2
            o2 = x2 * c2 - x1 * s1
        else:
            o1 = x1 * c1 - x2 * s1
            o2 = x2 * c2 + x1 * s2
        tl.store(o_ptr + row + d, o1.to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(o_ptr + row + HALF + d, o2.to(o_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, n_heads_q, n_heads_k,
                     HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BACKWARD: tl.constexpr):
        """One program per token t: every q head and k head of t (contiguous [T, H, 2 * HALF] rows).
        Forward (HF's q * cos + rotate_half(q) * sin):  o1 = x1 c1 - x2 s1,  o2 = x2 c2 + x1 s2.
        Backward (its transpose):                        d1 = g1 c1 + g2 s2,  d2 = g2 c2 - g1 s1."""
        t = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, HALF)[None, :]
        c1 = tl.load(cos_ptr + t * 2 * HALF + d).to(tl.float32)
        c2 = tl.load(cos_ptr + t * 2 * HALF + HALF + d).to(tl.float32)
        s1 = tl.load(sin_ptr + t * 2 * HALF + d).to(tl.float32)
        s2 = tl.load(sin_ptr + t * 2 * HALF + HALF + d).to(tl.float32)
        _rope_rows(q_ptr, qo_ptr, t, n_heads_q, c1, c2, s1, s2, HALF, BLOCK_HQ, BACKWARD)
        _rope_rows(k_ptr, ko_ptr, t, n_heads_k, c1, c2, s1, s2, HALF, BLOCK_HK, BACKWARD)

    # n stays specialized (Triton's "divisible by 16" flag): with it the tail mask is known constant over
    # 16-element groups and the loads vectorize; without it they are split per element, slower than
    # HF's two kernels (measured). T * intermediate is a multiple of 16 for every usual width.
    @triton.jit
    def _silu_mul_fwd_kernel(g_ptr, u_ptr, o_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_ptr + offs, (g * tl.sigmoid(g) * u).to(o_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_bwd_kernel(do_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
        """out = silu(g) * u:  du = dout * silu(g),  dg = dout * u * s * (1 + g (1 - s)),  s = sigmoid(g)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        do = tl.load(do_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        tl.store(du_ptr + offs, (do * g * s).to(du_ptr.dtype.element_ty), mask=mask)
        tl.store(dg_ptr + offs, (do * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=mask)


def rope_supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """q [T, Hq, D], k [T, Hk, D], cos/sin [T, D] with D / 2 a power of two (the kernel's vector width)."""
    if q.ndim != 3 or k.ndim != 3 or cos.shape != sin.shape or cos.ndim != 2:
        return False
    t, _, d = q.shape
    half = d // 2
    return (d % 2 == 0 and half >= 1 and half & (half - 1) == 0 and k.shape[0] == t and k.shape[2] == d
            and tuple(cos.shape) == (t, d) and cos.dtype == sin.dtype and q.dtype == k.dtype
            and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and cos.dtype in (torch.bfloat16, torch.float16, torch.float32))


def _rope(q, k, cos, sin, backward: bool, out_dtype: torch.dtype):
    q, k, cos, sin = (x.contiguous() for x in (q, k, cos, sin))
    qo = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=out_dtype, device=k.device)
    if q.shape[0]:
        _rope_kernel[(q.shape[0],)](q, k, qo, ko, cos, sin, q.shape[1], k.shape[1], HALF=q.shape[2] // 2,
                                    BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
                                    BLOCK_HK=triton.next_power_of_2(k.shape[1]), BACKWARD=backward)
    return qo, ko


class RotaryQK(torch.autograd.Function):
    """(q [T, Hq, D], k [T, Hk, D], cos [T, D], sin [T, D]) -> rotated (q, k), contiguous [T, H, D], in the
    dtype HF's `q * cos` would have (the promotion of q's and cos's). cos/sin get no gradient (HF's are
    computed from positions under no_grad semantics: position_ids are integers)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        out_dtype = torch.promote_types(q.dtype, cos.dtype)
        ctx.save_for_backward(cos, sin)
        ctx.in_dtype = q.dtype
        return _rope(q, k, cos, sin, backward=False, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        gq, gk = _rope(dq, dk, cos, sin, backward=True, out_dtype=ctx.in_dtype)
        return gq, gk, None, None


class SiluMul(torch.autograd.Function):
    """silu(gate) * up for two same-shape, same-dtype tensors; one kernel forward, one backward."""

    BLOCK = 2048

    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        n = gate.numel()
        if n:
            _silu_mul_fwd_kernel[(triton.cdiv(n, SiluMul.BLOCK),)](gate, up, out, n, BLOCK=SiluMul.BLOCK)
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dout = dout.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            _silu_mul_bwd_kernel[(triton.cdiv(n, SiluMul.BLOCK),)](dout, gate, up, dgate, dup, n,
                                                                   BLOCK=SiluMul.BLOCK)
        return dgate, dup


def rotary_qk(q, k, cos, sin):
    return RotaryQK.apply(q, k, cos, sin)


def silu_mul(gate, up):
    return SiluMul.apply(gate, up)


def warm_up(device: torch.device, dtype: torch.dtype, n_heads_q: int, n_heads_k: int, head_dim: int,
            cos_dtype: torch.dtype | None = None) -> float:
    """Compile (or load from Triton's disk cache) every kernel variant a training run of this shape
    launches, forward and backward, before the timed loop; returns the seconds spent."""
    if not (triton is not None and device.type == "cuda"):
        return 0.0
    t0 = time.perf_counter()
    q = torch.randn(4, n_heads_q, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(4, n_heads_k, head_dim, device=device, dtype=dtype, requires_grad=True)
    cos = torch.randn(4, head_dim, device=device, dtype=cos_dtype or dtype)
    if rope_supported(q, k, cos, cos):
        qo, ko = rotary_qk(q, k, cos, cos)
        (qo.float().sum() + ko.float().sum()).backward()
    g = torch.randn(4, 64, device=device, dtype=dtype, requires_grad=True)
    u = torch.randn(4, 64, device=device, dtype=dtype, requires_grad=True)
    silu_mul(g, u).float().sum().backward()
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0
