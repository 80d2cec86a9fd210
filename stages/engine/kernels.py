"""Fused Triton kernels for a decoder layer's elementwise work on CUDA: the rotary embedding of q and k, and
the SiLU-gated product of the MLP.

Why: with CUDA graphs the training step is GPU-bound, and in the profile of the 0.5B anchor step
(a profile made before these kernels existed) the elementwise kernels (mul, copy, add, sum) outweigh the GEMMs'
neighbours: HF's rotary is ~5 kernels per tensor forward and ~8 backward (q * cos, a `cat` for
rotate_half, another multiply, an add), its SiLU-gated product 2 forward and 3 backward, each a full
pass over memory. Here each is one kernel forward and one backward, computing in fp32 and rounding once
(HF rounds after every op in the model dtype: results differ by bf16 rounding only).

The routing (modeling.use_fused_kernels) sends a call here only on CUDA with Triton importable; CPU and
anything unusual keep HF's own code. `warm_up` compiles every kernel variant a run uses before it is timed
(Triton compiles on first launch and caches on disk). The flat AdamW's three kernels live here too; their
caller, layout and warm-up are stages/engine/flat_adamw.py.
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
# _adamw8_kernel's FAST paths are PTX (MUFU reciprocal and root): on a ROCm build of torch (where tensors also say
# is_cuda) the launchers keep the reference form.
PTX = torch.version.hip is None
# quantization blocks per program of _adamw8_kernel (8 x 128 = 1024 values, 8 a thread at 4 warps): on an H100 over
# 1.17e9 values the update kernel took 7.6 ms (fp32_master_8bit) and 7.4 ms (bf16_sr_8bit) at 8 rows, 8.1 and 8.0
# at 16 (more registers a thread, fewer programs resident), 8.4 and 9.0 at 8 rows on 2 warps. Beside the kernel, so
# both of its launchers (flat_adamw's CUDA-graph path, lowbit_adamw's eager one) read it without importing each other.
TILE_ROWS = 8


def available(*tensors: torch.Tensor) -> bool:
    """Triton can run these (CUDA tensors, or CPU ones under TRITON_INTERPRET=1 in tests)."""
    return triton is not None and all(t.is_cuda or _INTERPRET for t in tensors)


class FirstLaunches:
    """Records every Triton kernel variant first launched in this process while active (with ... as seen:
    seen.names): each is a compile, or a load from Triton's disk cache, that a warm-up missed. Triton calls its
    jit_cache_hook on a kernel's in-process cache miss, before compiling; the hook returns None, so Triton goes on
    to compile as it would (a truthy return would skip the kernel). A hook already set is called after ours.
    names stays None where the hook cannot be set (no Triton, or one older than its knobs): nothing was observed,
    which must not read as "no kernel missed"."""

    def __init__(self):
        self.names: list[str] | None = None
        self._knobs = None
        self._before = None

    def _hook(self, *args, **kwargs):
        fn = kwargs.get("fn")                       # its name is qualified: a kernel defined in a function has
        name = getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[")[0]     # "f.<locals>.k"
        self.names.append(name.rsplit(".", 1)[-1])
        return self._before(*args, **kwargs) if self._before is not None else None

    def __enter__(self) -> "FirstLaunches":
        knobs = getattr(triton, "knobs", None) if triton is not None else None
        if knobs is not None and hasattr(knobs.runtime, "jit_cache_hook"):
            self._knobs, self._before = knobs, knobs.runtime.jit_cache_hook
            knobs.runtime.jit_cache_hook = self._hook
            self.names = []
        return self

    def __exit__(self, *exc) -> None:
        if self._knobs is not None:
            self._knobs.runtime.jit_cache_hook = self._before
            self._knobs = None


# ----------------------------------------------------------------------------------------------
# Rotary embedding of q and k, packed [T, H, D] layout
# ----------------------------------------------------------------------------------------------

if triton is not None:
    @triton.jit
    def _rope_rows(x_ptr, o_ptr, t, n_heads, x_stride, c1, c2, s1, s2, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                   BACKWARD: tl.constexpr):
        d = tl.arange(0, HALF)[None, :]
        h = tl.arange(0, BLOCK_H)[:, None]
        mask = h < n_heads
        x_row = t * x_stride + h * 2 * HALF          # the input may be a column slice of a wider row
        row = t * n_heads * 2 * HALF + h * 2 * HALF  # the output is contiguous
        x1 = tl.load(x_ptr + x_row + d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + x_row + HALF + d, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            o1 = x1 * c1 + x2 * s2
            o2 = x2 * c2 - x1 * s1
        else:
            o1 = x1 * c1 - x2 * s1
            o2 = x2 * c2 + x1 * s2
        tl.store(o_ptr + row + d, o1.to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(o_ptr + row + HALF + d, o2.to(o_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, n_heads_q, n_heads_k, q_stride, k_stride,
                     HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BACKWARD: tl.constexpr):
        """One program per token t: every q head and k head of t ([T, H, 2 * HALF] with contiguous heads; the
        inputs' rows `q_stride` / `k_stride` elements apart, the outputs contiguous).
        Forward (HF's q * cos + rotate_half(q) * sin):  o1 = x1 c1 - x2 s1,  o2 = x2 c2 + x1 s2.
        Backward (its transpose):                        d1 = g1 c1 + g2 s2,  d2 = g2 c2 - g1 s1."""
        t = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, HALF)[None, :]
        c1 = tl.load(cos_ptr + t * 2 * HALF + d).to(tl.float32)
        c2 = tl.load(cos_ptr + t * 2 * HALF + HALF + d).to(tl.float32)
        s1 = tl.load(sin_ptr + t * 2 * HALF + d).to(tl.float32)
        s2 = tl.load(sin_ptr + t * 2 * HALF + HALF + d).to(tl.float32)
        _rope_rows(q_ptr, qo_ptr, t, n_heads_q, q_stride, c1, c2, s1, s2, HALF, BLOCK_HQ, BACKWARD)
        _rope_rows(k_ptr, ko_ptr, t, n_heads_k, k_stride, c1, c2, s1, s2, HALF, BLOCK_HK, BACKWARD)

    # n stays specialized (Triton's "divisible by 16" flag): with it the tail mask is known constant over
    # 16-element groups and the loads vectorize; without it they are split per element, slower than
    # HF's two kernels (measured). T * intermediate is a multiple of 16 for every usual width.
    @triton.jit
    def _silu_mul(g, u):
        """silu(g) * u in fp32 (both SiLU-mul layouts below)."""
        return g * tl.sigmoid(g) * u

    @triton.jit
    def _silu_mul_grads(do, g, u):
        """out = silu(g) * u -> (dg, du):  dg = dout * u * s * (1 + g (1 - s)),  du = dout * silu(g),
        s = sigmoid(g)."""
        s = tl.sigmoid(g)
        return do * u * s * (1.0 + g * (1.0 - s)), do * g * s

    @triton.jit
    def _silu_mul_fwd_kernel(g_ptr, u_ptr, o_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_ptr + offs, _silu_mul(g, u).to(o_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_bwd_kernel(do_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        do = tl.load(do_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dg, du = _silu_mul_grads(do, g, u)
        tl.store(du_ptr + offs, du.to(du_ptr.dtype.element_ty), mask=mask)
        tl.store(dg_ptr + offs, dg.to(dg_ptr.dtype.element_ty), mask=mask)


    # The MLP's fused gate|up projection gives one [T, 2W] tensor; these read its halves in place and the
    # backward writes the [T, 2W] gradient the fused projection's backward takes (no split, no cat).
    @triton.jit
    def _silu_mul_halves_fwd_kernel(x_ptr, o_ptr, width, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = j < width
        g = tl.load(x_ptr + t * 2 * width + j, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + t * 2 * width + width + j, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_ptr + t * width + j, _silu_mul(g, u).to(o_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_halves_bwd_kernel(do_ptr, x_ptr, dx_ptr, width, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = j < width
        do = tl.load(do_ptr + t * width + j, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(x_ptr + t * 2 * width + j, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + t * 2 * width + width + j, mask=mask, other=0.0).to(tl.float32)
        dg, du = _silu_mul_grads(do, g, u)
        tl.store(dx_ptr + t * 2 * width + j, dg.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_ptr + t * 2 * width + width + j, du.to(dx_ptr.dtype.element_ty), mask=mask)

    # -- AdamW over flat fp32 master / moment buffers (stages/engine/flat_adamw.py) ------------------------
    @triton.jit
    def _sumsq_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr):
        """partial[p] = sum of x^2 over block p (fp32): stage one of the gradient norm."""
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(partial_ptr + pid, tl.sum(x * x, axis=0))

    @triton.jit(do_not_specialize=["n_partials", "n_groups"])
    def _clip_kernel(partial_ptr, n_partials, norm_ptr, divisor_ptr, step_ptr, bias_ptr, n_groups, max_norm,
                     CLIP: tl.constexpr, BLOCK: tl.constexpr):
        """One program: norm = sqrt(sum of the partials, in a fixed order: deterministic), the clip as a
        gradient divisor (clip_grad_norm_'s coefficient max_norm / (norm + 1e-6), at most 1, inverted), the
        step count + 1, and per parameter group (bias rows, fp64: beta1^t, beta2^t, beta1, beta2, then
        written 1 - beta1^t, sqrt(1 - beta2^t)) the bias corrections in double precision, as torch's fused
        AdamW computes them (1 - 0.999^t in fp32 would lose ~5 digits to cancellation)."""
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_partials, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(partial_ptr + offs, mask=offs < n_partials, other=0.0)
        norm = tl.sqrt(tl.sum(acc, axis=0))
        tl.store(norm_ptr, norm)
        if CLIP:
            coef = tl.minimum(max_norm / (norm + 1e-6), 1.0)
            tl.store(divisor_ptr, 1.0 / coef)
        else:
            tl.store(divisor_ptr, 1.0)
        tl.store(step_ptr, tl.load(step_ptr) + 1.0)
        for g in range(0, n_groups):
            row = bias_ptr + g * 6
            pow1 = tl.load(row) * tl.load(row + 2)
            pow2 = tl.load(row + 1) * tl.load(row + 3)
            tl.store(row, pow1)
            tl.store(row + 1, pow2)
            tl.store(row + 4, 1.0 - pow1)
            tl.store(row + 5, tl.sqrt(1.0 - pow2))

    @triton.jit
    def _adamw_kernel(grad_ptr, param_ptr, master_ptr, m_ptr, v_ptr, n, lr_ptr, bias_ptr, divisor_ptr,
                      beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, BLOCK: tl.constexpr):
        """torch's AdamW (decoupled weight decay, bias-corrected) on fp32 masters and moments, reading the
        model-dtype gradient divided by the clip divisor; writes the rounded model-dtype parameter and
        zeroes the gradient (the next step accumulates into it): one pass over every buffer. bias_ptr: this
        group's row of _clip_kernel's bias corrections; 1 - beta is passed as computed in double on the host."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        lr = tl.load(lr_ptr)
        step_size = (lr.to(tl.float64) / tl.load(bias_ptr + 4)).to(tl.float32)
        bias2_sqrt = tl.load(bias_ptr + 5).to(tl.float32)
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) / tl.load(divisor_ptr)
        w = tl.load(master_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        w = w - (lr * weight_decay) * w
        m = beta1 * m + one_minus_beta1 * g
        v = beta2 * v + one_minus_beta2 * g * g
        w = w - step_size * m / (tl.sqrt(v) / bias2_sqrt + eps)
        tl.store(master_ptr + offs, w, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(param_ptr + offs, w.to(param_ptr.dtype.element_ty), mask=mask)
        tl.store(grad_ptr + offs, tl.zeros([BLOCK], dtype=grad_ptr.dtype.element_ty), mask=mask)


    # -- AdamW with block-wise 8-bit moments (train.optimizer.state; stages/engine/lowbit_adamw.py is the
    # reference in torch ops: the same formats, hash and update; stages/engine/flat_adamw.py the caller) -------
    @triton.jit
    def _mix32(x):
        """lowbit_adamw.mix32 in uint32 arithmetic (multiplies wrap mod 2^32)."""
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x2C1B3C6D
        return x ^ (x >> 16)

    @triton.jit
    def _encode8(y, TOP: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_SCALE: tl.constexpr):
        """lowbit_adamw.encode_magnitude: y in [0, 1] -> int32 code, round to nearest even on the fp32 bits;
        subnormals by the 2^23 trick (RNE of z < 2^22 in fp32)."""
        bits = y.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - ((127 - TOP) << 3)
        z = tl.minimum(y * SUB_SCALE, 16.0)        # only z < 8 is used; the clamp keeps the cast in range
        sub = ((z + 8388608.0) - 8388608.0).to(tl.int32)
        return tl.where(y >= MIN_NORMAL, normal, sub)

    @triton.jit
    def _decode8(code, TOP: tl.constexpr, SUB_STEP: tl.constexpr):
        e = code >> 3
        f = code & 7
        normal = (((e + 127 - TOP) << 23) | (f << 20)).to(tl.float32, bitcast=True)
        return tl.where(e > 0, normal, f.to(tl.float32) * SUB_STEP)

    # div.rn.f32 and sqrt.rn.f32 compile to a fast path guarded by a range check (FCHK; an exponent compare for
    # sqrt) that branches per element to a slow-path call: 5 such sites per value made _adamw8_kernel issue-bound
    # (171 SASS instructions a value, convergence barriers between every one, so no overlap across values). The
    # helpers below are the fast paths themselves, the very instruction sequences ptxas emits (MUFU.RCP / MUFU.RSQ
    # then FFMA / FMUL: read off the kernel's SASS), branch-free; _adamw8_math checks its own operands' ranges, where
    # these sequences are exact, and the kernel reruns a tile with div_rn / sqrt_rn if any value is outside.
    _EMULATE_MUFU = tl.constexpr(_INTERPRET)     # Triton's interpreter runs no PTX: correctly rounded stand-ins

    @triton.jit
    def _rcp_approx(x):
        if _EMULATE_MUFU:
            return 1.0 / x
        else:
            return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)

    @triton.jit
    def _rsqrt_approx(x):
        if _EMULATE_MUFU:
            return 1.0 / tl.sqrt(x)
        else:
            return tl.inline_asm_elementwise("rsqrt.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)

    @triton.jit
    def _rcp_refined(b):
        """div.rn's reciprocal of b: MUFU.RCP and one Newton step (two FFMA)."""
        y0 = _rcp_approx(b)
        return tl.fma(y0, tl.fma(-b, y0, 1.0), y0)

    @triton.jit
    def _div_fast(a, b, y):
        """div.rn(a, b)'s fast path given y = _rcp_refined(b) (shared by every a of one b): a quotient, its exact
        remainder by FMA, one correction; correctly rounded for normal operands and a normal quotient whose
        remainder is exact (the ranges _adamw8_math checks), and +0 for a = +0."""
        q = tl.fma(y, a, 0.0)
        r = tl.fma(-b, q, a)
        return tl.fma(y, r, q)

    @triton.jit
    def _sqrt_fast(v):
        """sqrt.rn(v)'s fast path (valid for v in [2^-101, FLT_MAX], the range its guard admits), 0 for v = 0."""
        r = _rsqrt_approx(v)
        s0 = v * r
        s = tl.fma(tl.fma(-s0, s0, v), r * 0.5, s0)
        return tl.where(v == 0.0, 0.0, s)

    @triton.jit
    def _adamw8_math(g, w, m, s, lr, weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size,
                     bias2_sqrt, FAST: tl.constexpr):
        """The update of one tile (m, sqrt(v) decoded) -> (w, new m codes with sign, new sqrt(v) codes, m's and
        sqrt(v)'s block absmax, whether any value is outside the fast paths' exact ranges). FAST=False: div_rn /
        sqrt_rn (the reference form; never `bad`). FAST=True: the same operations by _div_fast / _sqrt_fast, equal
        bit for bit wherever not `bad`; where an operand is below a fast path's range it is scaled by a power of two
        first and the result scaled back, both exact (power-of-two scaling commutes with rounding while nothing
        is subnormal), so zero-gradient blocks whose moments decay for thousands of steps stay on the fast path:
          sqrt(v): v = 0, v in [2^-101, FLT_MAX] (sqrt.rn's own fast range), or below: sqrt(v 2^64) 2^-32 (the
            root of a v >= 2^-149 is >= 2^-75: normal); an infinite or NaN v is `bad`;
          s / bias2_sqrt, bias2_sqrt = sqrt(1 - beta2^t) in [2^-20, 1] (else `bad`): s = 0 or s >= 2^-75, so the
            remainder s - bias2_sqrt q is a multiple of >= 2^(e_s - 47) >= 2^-122: exact, the quotient normal;
          m / denom, denom = s / bias2_sqrt + eps in [2^-40, 2^60] (else `bad`): m = +0 gives +0 (codes are
            canonical, no -0 code, and +0 plus -0 is +0, so m is never -0); |m| >= 2^-60 directly (remainder grain
            2^(e_m - 47)); a smaller m as (m 2^64 / denom) 2^-64, `bad` if that scaled quotient is below 2^-62 (the
            result would be subnormal and the scaling back round);
          |m| / absmax and s / absmax per block, the absmax (1 where 0) <= 2^60 (else `bad`), both scaled by 2^100
            where the absmax is below 2^-60 (|m| <= absmax: no overflow): only the 8-bit code of the quotient is
            kept; a quotient that can round to a non-zero code (>= 2^-35) has an exact remainder (grain >=
            2^(-60 - 36 - 46)), a smaller one is off by far less than 2^-35 and codes 0 either way."""
        v = s * s
        w = w * (1.0 - lr * weight_decay)
        m = beta1 * m + one_minus_beta1 * g
        v = beta2 * v + one_minus_beta2 * g * g
        am = tl.max(tl.abs(m), axis=1)
        bm = tl.where(am > 0, am, 1.0)
        if FAST:
            tiny_v = v < 3.944304526105059e-31                                           # 2^-101
            s = _sqrt_fast(tl.where(tiny_v, v * 1.8446744073709552e+19, v)) \
                * tl.where(tiny_v, 2.3283064365386963e-10, 1.0)                          # 2^64, 2^-32
            denom = _div_fast(s, bias2_sqrt, _rcp_refined(bias2_sqrt)) + eps
            tiny_m = tl.abs(m) < 8.673617379884035e-19                                   # 2^-60
            qs = _div_fast(tl.where(tiny_m, m * 1.8446744073709552e+19, m), denom, _rcp_refined(denom))
            w = w - step_size * (qs * tl.where(tiny_m, 5.421010862427522e-20, 1.0))      # 2^-64
            a_s = tl.max(s, axis=1)
            bs = tl.where(a_s > 0, a_s, 1.0)
            fm = tl.where(bm < 8.673617379884035e-19, 1.2676506002282294e+30, 1.0)       # 2^-60, 2^100
            fs = tl.where(bs < 8.673617379884035e-19, 1.2676506002282294e+30, 1.0)
            bm2, bs2 = bm * fm, bs * fs
            ym = _div_fast(tl.abs(m) * fm[:, None], bm2[:, None], _rcp_refined(bm2)[:, None])
            ys = _div_fast(s * fs[:, None], bs2[:, None], _rcp_refined(bs2)[:, None])
            c = tl.zeros_like(v) + bias2_sqrt        # a tile: the interpreter's scalar booleans do not mix
            bad = ~(v <= 3.4028234663852886e+38) | ~((denom >= 9.094947017729282e-13) & (denom <= 1.152921504606847e+18)) \
                | (tiny_m & (m != 0.0) & ~(tl.abs(qs) >= 2.168404344971009e-19)) \
                | ~((c >= 9.5367431640625e-07) & (c <= 1.0)) \
                | ~((bm2 <= 1.152921504606847e+18) & (bs2 <= 1.152921504606847e+18))[:, None]
            # FLT_MAX; 2^-40, 2^60; 2^-62; 2^-20
        else:
            s = tl.math.sqrt_rn(v)
            w = w - step_size * tl.math.div_rn(m, tl.math.div_rn(s, bias2_sqrt) + eps)
            a_s = tl.max(s, axis=1)
            ym = tl.math.div_rn(tl.abs(m), bm[:, None])
            ys = tl.math.div_rn(s, tl.where(a_s > 0, a_s, 1.0)[:, None])
            bad = tl.zeros(m.shape, dtype=tl.int1)
        new_m = _encode8(ym, 15, 6.103515625e-05, 131072.0)       # 2^-14, 2^17
        new_m = tl.where((m < 0) & (new_m > 0), new_m | 128, new_m)
        new_s = _encode8(ys, 31, 9.31322574615478515625e-10, 8589934592.0)     # 2^-30, 2^33
        return w, new_m, new_s, am, a_s, tl.max(bad.to(tl.int32))

    @triton.jit(do_not_specialize=["n_blocks", "n", "seed"])
    def _adamw8_kernel(grad_ptr, param_ptr, master_ptr, mc_ptr, msc_ptr, sc_ptr, ssc_ptr, ord_ptr, base_ptr,
                       n_blocks, n, lr_ptr, bias_ptr, divisor_ptr, step_ptr, seed, beta1, one_minus_beta1, beta2,
                       one_minus_beta2, eps, weight_decay, HAS_MASTER: tl.constexpr, SR: tl.constexpr,
                       ROWS: tl.constexpr, B: tl.constexpr, EVEN: tl.constexpr, FAST: tl.constexpr = True):
        """One program = ROWS quantization blocks of B values (a tile [ROWS, B]; every tensor starts at a block,
        so a row is one block of one tensor). AdamW as _adamw_kernel, with m and sqrt(v) decoded from 8-bit codes
        and per-block fp32 scales, re-encoded after the update (absmax per row); the weight written to the fp32
        master and rounded to nearest into the model dtype (HAS_MASTER), or rounded stochastically to bf16 with
        the counter hash of (seed, step, block's parameter ordinal, element index in the parameter) (SR), or
        written as is (fp32 weights). Zeroes the gradient. n: the values (a flat buffer's are whole blocks; one
        tensor's, on the eager GPU path, may end inside its last block).

        One pass: every byte of the tile is loaded once and stored once, the absmax reductions stay in registers
        (flat_adamw.step_bytes_per_param counts the bytes). EVEN (n is whole blocks: every flat buffer, and most tensors):
        the only mask is per row, constant along a block, so Triton proves each thread's run of a row contiguous
        and unmasked-alike and issues 128-bit loads and stores. An element mask `offs < n` with n unknown at
        compile time (n is not specialised: it changes with every tensor) splits every access into one scalar
        load or store per element (the SASS of the kernel before EVEN had 32 one-byte loads and 32 one-byte
        stores per thread for 16 values: what made the 8-bit step 2.5x slower than the exact one, which moves more
        bytes). FAST (the default; False only as the tests' reference): the four divisions and the square root of
        a value by their branch-free fast paths (_adamw8_math), bitwise the div_rn / sqrt_rn results, a tile rerun
        in that reference form where some value falls outside the fast paths' exact ranges (uniform per program:
        the rerun costs only such tiles)."""
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        rmask = rows < n_blocks
        offs = rows[:, None] * B + tl.arange(0, B)[None, :]
        if EVEN:
            mask = rmask[:, None]          # per row only: constant along a block, so the accesses vectorize
        else:
            mask = rmask[:, None] & (offs < n)
        lr = tl.load(lr_ptr)
        step_size = (lr.to(tl.float64) / tl.load(bias_ptr + 4)).to(tl.float32)
        bias2_sqrt = tl.load(bias_ptr + 5).to(tl.float32)
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) / tl.load(divisor_ptr)
        if HAS_MASTER:
            w = tl.load(master_ptr + offs, mask=mask, other=0.0)
        else:
            w = tl.load(param_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mcode = tl.load(mc_ptr + offs, mask=mask, other=0).to(tl.int32)
        scode = tl.load(sc_ptr + offs, mask=mask, other=0).to(tl.int32)
        mscale = tl.load(msc_ptr + rows, mask=rmask, other=0.0)
        sscale = tl.load(ssc_ptr + rows, mask=rmask, other=0.0)
        m = _decode8(mcode & 0x7F, 15, 7.62939453125e-06) * mscale[:, None]       # 2^-17: the subnormal step
        m = tl.where(mcode >= 128, -m, m)
        s = _decode8(scode, 31, 1.16415321826934814453125e-10) * sscale[:, None]  # 2^-33
        w0 = w
        w, new_m, new_s, am, a_s, bad = _adamw8_math(g, w0, m, s, lr, weight_decay, beta1, one_minus_beta1, beta2,
                                                     one_minus_beta2, eps, step_size, bias2_sqrt, FAST)
        if bad:          # a rare tile with a value outside the fast paths' exact ranges: the reference form
            w, new_m, new_s, am, a_s, bad = _adamw8_math(g, w0, m, s, lr, weight_decay, beta1, one_minus_beta1,
                                                         beta2, one_minus_beta2, eps, step_size, bias2_sqrt, False)
        tl.store(mc_ptr + offs, new_m.to(tl.uint8), mask=mask)
        tl.store(sc_ptr + offs, new_s.to(tl.uint8), mask=mask)
        tl.store(msc_ptr + rows, am, mask=rmask)
        tl.store(ssc_ptr + rows, a_s, mask=rmask)
        if HAS_MASTER:
            tl.store(master_ptr + offs, w, mask=mask)
            tl.store(param_ptr + offs, w.to(param_ptr.dtype.element_ty), mask=mask)
        elif SR:
            t = tl.load(step_ptr).to(tl.uint32)
            ordinal = tl.load(ord_ptr + rows, mask=rmask, other=0).to(tl.uint32)
            idx = (tl.load(base_ptr + rows, mask=rmask, other=0)[:, None] + tl.arange(0, B)[None, :]).to(tl.uint32)
            key = _mix32(_mix32(_mix32(seed.to(tl.uint32)) ^ t) ^ ordinal)
            r = _mix32(idx ^ key[:, None])
            u = w.to(tl.uint32, bitcast=True)
            u = (u + (r & 0xFFFF)) & 0xFFFF0000
            tl.store(param_ptr + offs, u.to(tl.float32, bitcast=True).to(param_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(param_ptr + offs, w.to(param_ptr.dtype.element_ty), mask=mask)
        tl.store(grad_ptr + offs, tl.zeros([ROWS, B], dtype=grad_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Decode attention over a KV cache: each row reads its own keys only
# ----------------------------------------------------------------------------------------------

if triton is not None:
    @triton.jit
    def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, n_keys_ptr, scale, n_kv_heads, group,
                                 sqb, sqh, skb, skh, skl, sob, soh,
                                 D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
        """One program per (row b, KV head h): the `group` query heads of h (one query token each) against the
        row's first n_keys[b] cached keys/values ([B, Hkv, L, D], the rest never read), online softmax in
        fp32 (scores unrounded, the probabilities rounded to the values' dtype for the second product)."""
        pid = tl.program_id(0).to(tl.int64)
        b = pid // n_kv_heads
        h = pid % n_kv_heads
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        gmask = g < group
        q = tl.load(q_ptr + b * sqb + (h * group + g)[:, None] * sqh + d[None, :], mask=gmask[:, None], other=0.0)
        n_keys = tl.load(n_keys_ptr + b).to(tl.int64)
        kv = b * skb + h * skh
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        qk_scale = scale * 1.4426950408889634                     # exp(x) = exp2(x log2 e)
        for start in range(0, n_keys, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            nmask = n < n_keys
            k = tl.load(k_ptr + kv + n[:, None] * skl + d[None, :], mask=nmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where(nmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            den = den * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv + n[:, None] * skl + d[None, :], mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out = acc / den[:, None]
        tl.store(o_ptr + b * sob + (h * group + g)[:, None] * soh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=gmask[:, None])


def decode_attention_supported(query: torch.Tensor, key: torch.Tensor) -> bool:
    """query [B, Hq, 1, D], the cache's key [B, Hkv, L, D] with D a power of two >= 16 (tl.dot's tile) and
    Hq a multiple of Hkv, both in one 16-bit or fp32 dtype, on a device Triton runs on."""
    if query.ndim != 4 or key.ndim != 4 or query.shape[2] != 1 or not available(query, key):
        return False
    b, hq, _, d = query.shape
    hkv = key.shape[1]
    return (key.shape[0] == b and key.shape[3] == d and hkv > 0 and hq % hkv == 0 and d >= 16 and d & (d - 1) == 0
            and query.dtype == key.dtype and query.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and key.stride(3) == 1 and query.stride(3) == 1)


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, n_keys: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of one query token a row: query [B, Hq, 1, D] against key/value [B, Hkv, L, D] (value laid out as
    key), row b reading its first n_keys[b] positions only -> [B, 1, Hq, D] (HF's attention output layout).
    Generation's decode step on CUDA (stages/engine/generation.py): a row's cost follows its own length, not
    the cache's, and the scores never make a round trip through memory."""
    b, hq, _, d = query.shape
    hkv, group = key.shape[1], hq // key.shape[1]
    assert value.stride() == key.stride() and value.shape == key.shape
    out = torch.empty(b, 1, hq, d, dtype=query.dtype, device=query.device)
    if b:
        _decode_attention_kernel[(b * hkv,)](
            query, key, value, out, n_keys, scale, hkv, group, query.stride(0), query.stride(1), key.stride(0),
            key.stride(1), key.stride(2), out.stride(0), out.stride(2), D=d,
            BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=64, num_warps=4)
    return out


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


def _rows_of_heads(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] as the kernel reads it: heads contiguous within a row (a column slice of the fused QKV
    projection's [T, (Hq + 2 Hk) D] output is, without a copy); rows any stride."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def _rope(q, k, cos, sin, backward: bool, out_dtype: torch.dtype):
    q, k = _rows_of_heads(q), _rows_of_heads(k)
    cos, sin = cos.contiguous(), sin.contiguous()
    qo = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=out_dtype, device=k.device)
    if q.shape[0]:
        _rope_kernel[(q.shape[0],)](q, k, qo, ko, cos, sin, q.shape[1], k.shape[1], q.stride(0), k.stride(0),
                                    HALF=q.shape[2] // 2,
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


class SiluMulHalves(torch.autograd.Function):
    """x [..., 2W] (gate | up) -> silu(gate) * up [..., W]; one kernel each way, the gradient as one [..., 2W]."""

    BLOCK = 1024

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        width = x.shape[-1] // 2
        out = x.new_empty((*x.shape[:-1], width))
        rows = x.numel() // max(1, x.shape[-1])
        if rows and width:
            _silu_mul_halves_fwd_kernel[(rows, triton.cdiv(width, SiluMulHalves.BLOCK))](
                x, out, width, BLOCK=SiluMulHalves.BLOCK)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, dout):
        (x,) = ctx.saved_tensors
        dout = dout.contiguous()
        dx = torch.empty_like(x)
        width = x.shape[-1] // 2
        rows = x.numel() // max(1, x.shape[-1])
        if rows and width:
            _silu_mul_halves_bwd_kernel[(rows, triton.cdiv(width, SiluMulHalves.BLOCK))](
                dout, x, dx, width, BLOCK=SiluMulHalves.BLOCK)
        return dx


def silu_mul_halves(x):
    return SiluMulHalves.apply(x)


def rotary_qk(q, k, cos, sin):
    return RotaryQK.apply(q, k, cos, sin)


def silu_mul(gate, up):
    return SiluMul.apply(gate, up)


def launch_adamw8_scratch(device: torch.device, model_dtype: torch.dtype, master_dtype: torch.dtype, has_master: bool,
                          sr: bool, even: bool, n_blocks: int, n: int, block: int, seed: int) -> None:
    """One launch of _adamw8_kernel (one program of TILE_ROWS blocks) on scratch buffers, with the argument types of
    a run's launch: the gradient and weight in the model dtype, the master in its own (or the weight itself when
    there is none), every pointer a separate allocation (Triton specialises on 16-byte alignment), and the run's
    n_blocks and n (an int's type, i32 or i64, is part of the variant even where it is not specialised). Only the
    first TILE_ROWS blocks are touched whatever n_blocks says. For the warm-ups of the flat and the per-tensor
    8-bit steps (flat_adamw.FlatLowBitAdamW.warm_up, lowbit_adamw.LowBitAdamW.launch_eager_variants): one place,
    so the two cannot drift apart in what they launch."""
    size = TILE_ROWS * block
    grad = torch.zeros(size, dtype=model_dtype, device=device)
    param = torch.zeros(size, dtype=model_dtype, device=device)
    master = torch.zeros(size, dtype=master_dtype, device=device) if has_master else param
    codes = [torch.zeros(size, dtype=torch.uint8, device=device) for _ in range(2)]
    scales = [torch.zeros(TILE_ROWS, dtype=torch.float32, device=device) for _ in range(2)]
    ordinals = torch.zeros(TILE_ROWS, dtype=torch.int32, device=device)
    bases = torch.arange(TILE_ROWS, dtype=torch.int32, device=device) * block
    lr, divisor, step = (torch.ones((), dtype=torch.float32, device=device) for _ in range(3))
    bias = torch.tensor([0.0, 0.0, 0.9, 0.999, 0.1, 0.1], dtype=torch.float64, device=device)
    _adamw8_kernel[(1,)](grad, param, master, codes[0], scales[0], codes[1], scales[1], ordinals, bases, n_blocks, n,
                         lr, bias, divisor, step, seed, 0.9, 0.1, 0.999, 0.001, 1e-8, 0.0, HAS_MASTER=has_master,
                         SR=sr, ROWS=TILE_ROWS, B=block, EVEN=even, FAST=PTX)


def warm_up(device: torch.device, dtype: torch.dtype, n_heads_q: int, n_heads_k: int, head_dim: int,
            cos_dtype: torch.dtype | None = None) -> float:
    """Compile (or load from Triton's disk cache) every kernel variant a training run of this shape
    launches, forward and backward, before the timed loop; returns the seconds spent."""
    if not (triton is not None and device.type == "cuda"):
        return 0.0
    t0 = time.perf_counter()
    # q and k as column slices of one fused projection output, as the routed attention hands them over
    qkv = torch.randn(4, (n_heads_q + 2 * n_heads_k) * head_dim, device=device, dtype=dtype, requires_grad=True)
    q = qkv[:, :n_heads_q * head_dim].view(4, n_heads_q, head_dim)
    k = qkv[:, n_heads_q * head_dim:(n_heads_q + n_heads_k) * head_dim].view(4, n_heads_k, head_dim)
    cos = torch.randn(4, head_dim, device=device, dtype=cos_dtype or dtype)
    if rope_supported(q, k, cos, cos):
        qo, ko = rotary_qk(q, k, cos, cos)
        (qo.float().sum() + ko.float().sum()).backward()
    silu_mul_halves(torch.randn(4, 128, device=device, dtype=dtype, requires_grad=True)).float().sum().backward()
    g = torch.randn(4, 64, device=device, dtype=dtype, requires_grad=True)
    u = torch.randn(4, 64, device=device, dtype=dtype, requires_grad=True)
    silu_mul(g, u).float().sum().backward()
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0
