"""train.optimizer.state on CPU (stages/engine/lowbit_adamw.py): the 8-bit block codec against a brute-force
nearest-code search, the counter hash against uint32 arithmetic, stochastic rounding's bias, each mode against an
fp64 AdamW on the same gradient stream, updates below bf16's resolution, and state_dict round trips."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stages.engine.lowbit_adamw import (BLOCK, M_EXP_BITS, S_EXP_BITS, LowBitAdamW, decode_magnitude, dequantize,
                                        encode_magnitude, mix32, quantize, random_bits, stochastic_round_bf16,
                                        stream_key)

torch.set_num_threads(1)


def spread(n: int, seed: int) -> torch.Tensor:
    """Values over ~13 decades, both signs: every code range is hit."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 5)


@pytest.mark.parametrize("exp_bits", [M_EXP_BITS, S_EXP_BITS])
def test_encode_is_round_to_nearest_even_over_the_code_table(exp_bits):
    """encode_magnitude (integer ops on the fp32 bits) against a brute-force search of the decoded code table
    in float64: the nearest code, ties to the even code; and decode(encode(table)) is the identity."""
    codes = torch.arange(0, 8 * 2 ** exp_bits - 7)            # up to 1.0 (exponent field top, mantissa 0)
    table = decode_magnitude(codes, exp_bits).double()
    assert float(table[-1]) == 1.0 and bool((table[1:] > table[:-1]).all())
    assert torch.equal(encode_magnitude(table.float(), exp_bits), codes)
    y = torch.cat([spread(20000, 1).abs().clamp(max=1.0), (table[1:] + table[:-1]).float() / 2,  # the midpoints
                   torch.rand(5000) * float(table[8])])                                          # subnormals
    y = y.float()
    got = encode_magnitude(y, exp_bits)
    dist = (table[None, :] - y.double()[:, None]).abs()
    best = dist.min(1, keepdim=True).values
    near = dist == best
    tie = near.sum(1) > 1
    want = torch.where(tie, torch.where(near & (codes[None] % 2 == 0), codes[None], 10 ** 6).min(1).values,
                       dist.argmin(1))
    assert torch.equal(got, want), int((got != want).sum())


@pytest.mark.parametrize("signed", [True, False])
def test_block_quantization_round_trip_error_bounds(signed):
    """Per block of 128: the absmax is kept exactly; every value at or above the smallest normal code
    (2^-14 of the absmax for m, 2^-30 for sqrt(v)) comes back within 2^-4 relative (half an ulp of a 3-bit
    mantissa, plus the scale multiply's 2^-24); smaller ones within half the smallest step; re-quantizing the
    decoded values gives the same codes and scales (what makes a dequantized checkpoint resume exactly)."""
    x = spread(BLOCK * 37 + 5, 2)                             # a partial last block too
    x[:BLOCK] = 0.0                                           # an all-zero block
    x = x if signed else x.abs()
    codes, scale = quantize(x, signed)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and scale.shape == (38,)
    y = dequantize(codes, scale, signed)
    per = scale.repeat_interleave(BLOCK)[:x.numel()].double()
    err = (y.double() - x.double()).abs()
    exp_bits = M_EXP_BITS if signed else S_EXP_BITS
    top = 2 ** exp_bits - 1
    normal = x.double().abs() >= 2.0 ** (1 - top) * per
    assert bool((err[normal] <= (2 ** -4 + 2 ** -23) * x.double().abs()[normal]).all())
    assert bool((err[~normal] <= 2.0 ** (-top - 3) * per[~normal] * (1 + 2 ** -20)).all())
    blocks = x.reshape(-1)[:BLOCK * 37].view(37, BLOCK).abs().amax(1)
    assert torch.equal(scale[:37], blocks) and float(scale[0]) == 0 and bool((y[:BLOCK] == 0).all())
    assert torch.equal(torch.sign(y[y != 0]), torch.sign(x[y != 0]))
    codes2, scale2 = quantize(y, signed)
    assert torch.equal(codes2, codes) and torch.equal(scale2, scale)


def test_mix32_is_uint32_arithmetic():
    """The int64 emulation equals wrapping uint32 arithmetic (numpy), which is what the Triton kernel computes."""
    x = np.random.default_rng(0).integers(0, 2 ** 32, 100000, dtype=np.uint64).astype(np.uint32)
    ref = x.copy()
    with np.errstate(over="ignore"):
        ref ^= ref >> np.uint32(16)
        ref *= np.uint32(0x7FEB352D)
        ref ^= ref >> np.uint32(15)
        ref *= np.uint32(0x2C1B3C6D)
        ref ^= ref >> np.uint32(16)
    got = mix32(torch.from_numpy(x.astype(np.int64)))
    assert np.array_equal(got.numpy().astype(np.uint32), ref)
    assert mix32(int(x[7])) == int(ref[7])


def test_stochastic_rounding_is_unbiased_and_reproducible():
    """One value 0.3 bf16-ulps above a bf16 number, rounded in 2^16 elements of one stream: the mean of the
    rounded values is the value within 5 standard deviations of the mean of 2^16 independent Bernoulli(0.3)
    ulps (ulp * sqrt(0.21 / 2^16) = 0.0018 ulp each: the bound, 0.009 ulp, is 33x tighter than the 0.3-ulp
    bias rounding to nearest would have); the same (seed, step, parameter) gives the same bits, another step
    other bits; the result is always one of the two neighbours."""
    n = 2 ** 16
    ulp = 2.0 ** -7                                        # bf16 spacing in [1, 2)
    w = torch.full((n,), 1.0 + 0.3 * ulp)
    bits = random_bits(stream_key(1234, 7, 3), n)
    r = stochastic_round_bf16(w, bits).double()
    assert set(r.unique().tolist()) == {1.0, 1.0 + ulp}
    assert abs(float(r.mean()) - (1.0 + 0.3 * ulp)) <= 5 * ulp * math.sqrt(0.21 / n)
    assert torch.equal(stochastic_round_bf16(w, random_bits(stream_key(1234, 7, 3), n)).double(), r)
    other = stochastic_round_bf16(w, random_bits(stream_key(1234, 8, 3), n)).double()
    assert not torch.equal(other, r)
    neg = stochastic_round_bf16(-w, bits).double()          # symmetric: magnitudes round the same way
    assert torch.equal(neg, -r)


def _fp64_adamw(w0, grads, lr, betas, eps, wd):
    """Textbook AdamW (Loshchilov & Hutter; torch's formulation) in float64."""
    w, m, v = w0.double().clone(), torch.zeros_like(w0, dtype=torch.float64), torch.zeros_like(w0, dtype=torch.float64)
    for t, g in enumerate(grads, 1):
        g = g.double()
        w = w * (1 - lr * wd)
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        w = w - lr / (1 - betas[0] ** t) * m / (v.sqrt() / math.sqrt(1 - betas[1] ** t) + eps)
    return w


def _gradient_stream(shape, steps: int, seed: int) -> list[torch.Tensor]:
    """Gradients with a per-block scale spanning 4 decades (as tensors and rows differ), a spread of e^{+-1}
    within a block, a per-element mean that swells and shrinks (x0.5..1.5) and unit noise: the moments see
    growth, decay and sign changes."""
    g = torch.Generator().manual_seed(seed)
    n = shape[0]
    scale = (torch.exp(torch.randn(-(-n // BLOCK), generator=g) * 2).repeat_interleave(BLOCK)[:n]
             * torch.exp(torch.randn(shape, generator=g)))
    mean = torch.randn(shape, generator=g)
    return [scale * (mean * (1 + 0.5 * math.cos(t / 40)) + torch.randn(shape, generator=g)) for t in range(steps)]


def _run_mode(state: str, w0: torch.Tensor, grads, lr, wd, bf16: bool):
    p = torch.nn.Parameter(w0.clone().to(torch.bfloat16 if bf16 else torch.float32))
    masters = {id(p): w0.clone()} if bf16 and state == "fp32_master_8bit" else None
    opt = LowBitAdamW([{"params": [p], "weight_decay": wd}], state, seed=5, masters=masters, lr=lr,
                      betas=(0.9, 0.999))
    for g in grads:
        p.grad = g.to(p.dtype)
        opt.step()
    return (opt.master_params[0] if masters else p.detach()).double(), opt


@pytest.mark.parametrize("state,bf16", [("fp32_master_8bit", False), ("fp32_master_8bit", True),
                                        ("bf16_sr_8bit", True)])
def test_modes_track_an_fp64_adamw_over_many_steps(state, bf16):
    """400 steps on one fixed gradient stream (so only the optimizer's numerics differ, not the landscape):
    the mode's total displacement against fp64 AdamW's.

    Bound, the relative L2 error of the displacement over all elements: 0.2 (fp32 masters), 0.25 (stochastic
    rounding). Why: each stored m and sqrt(v) is off by up to 2^-4 relative (test above; RMS ~0.03 for a
    uniform position within a 3-bit-mantissa ulp). sqrt(v) changes by ~0.05% a step (beta2 = 0.999), far less
    than half an ulp, so an element's sqrt(v) rounding error does not average out over steps: it persists (the
    block's fp32 scale still carries the block's growth and decay), and m's, re-rounded as m moves ~10% a step,
    compounds through beta1 = 0.9 to RMS ~0.03 / sqrt(1 - 0.81) ~ 0.07. Together ~0.1 of each element's
    displacement, 2x margin. Stochastic rounding adds a random walk of <= ulp / 2 * sqrt(400) ~ 0.02-0.04 per
    weight (ulp 2^-9..2^-8 at the weights' ~0.5) against a ~0.2 mean displacement. Measured: 0.09-0.14 (masters),
    0.13-0.16 (stochastic rounding); round-to-nearest bf16 in place of stochastic rounding gives 0.73."""
    torch.manual_seed(0)
    w0 = torch.randn(3 * BLOCK + 17) * 0.5
    grads = _gradient_stream(w0.shape, 400, 1)
    lr, wd = 1e-3, 0.01
    ref = _fp64_adamw(w0, [g.to(torch.bfloat16).double() if bf16 else g for g in grads], lr, (0.9, 0.999), 1e-8, wd)
    got, _ = _run_mode(state, w0, grads, lr, wd, bf16)
    base = w0.to(torch.bfloat16).double() if state == "bf16_sr_8bit" else w0.double()
    rel = float((got - ref).norm() / (ref - w0.double()).norm())
    assert rel < (0.25 if state == "bf16_sr_8bit" else 0.2), rel
    assert float((got - base).norm()) > 0.5 * float((ref - w0.double()).norm())      # it moved as far


def test_an_update_below_bf16_resolution_still_moves_the_weights():
    """A constant gradient gives Adam steps of exactly lr = 1e-4, under a 40th of bf16's spacing at 1.0 (2^-8
    below 1): rounded to nearest in bf16 (what a pure-bf16 AdamW does) the weights never move. fp32 masters
    accumulate every step: after 50 the bf16 weights moved by 50 lr rounded. Stochastic rounding moves them in
    expectation: over 4096 weights the mean displacement is 50 lr within 5 standard deviations of the mean of
    4096 sums of 50 martingale rounding errors (each step's conditional variance <= ulp^2 / 4:
    5 * ulp * sqrt(50) / (2 sqrt(4096)) = 1.1e-3 against the 5e-3 signal)."""
    n, steps, lr = 4096, 50, 1e-4
    ulp = 2.0 ** -8
    grads = [torch.full((n,), 0.5) for _ in range(steps)]
    w0 = torch.ones(n)
    nearest = w0.to(torch.bfloat16)
    for _ in range(steps):                                  # pure bf16, round to nearest: lost
        nearest = (nearest.float() - lr).to(torch.bfloat16)
    assert bool((nearest == 1.0).all())
    master, opt = _run_mode("fp32_master_8bit", w0, grads, lr, 0.0, bf16=True)
    assert float(master.mean()) == pytest.approx(1 - steps * lr, rel=1e-6)
    model = opt.model_params[0].double()
    assert bool((model == 1 - 2 * ulp).all() | (model == 1 - ulp).all())             # rounded master, moved
    sr, _ = _run_mode("bf16_sr_8bit", w0, grads, lr, 0.0, bf16=True)
    assert abs(float(sr.mean()) - (1 - steps * lr)) <= 5 * ulp * math.sqrt(steps) / (2 * math.sqrt(n))
    assert float(sr.std()) > 0                               # the weights themselves are bf16 values that differ


@pytest.mark.parametrize("state,bf16", [("fp32_master_8bit", True), ("fp32_master_8bit", False),
                                        ("bf16_sr_8bit", True)])
def test_state_dict_round_trip_continues_bitwise_and_refuses_another_mode(state, bf16):
    torch.manual_seed(0)
    w0 = torch.randn(2 * BLOCK + 3)
    grads = _gradient_stream(w0.shape, 10, 2)
    _, a = _run_mode(state, w0, grads[:5], 1e-3, 0.01, bf16)
    sd = a.state_dict()
    assert sd["state_mode"] == state and set(sd["state"][0]) == {"step", "m_codes", "m_scale", "s_codes", "s_scale"}
    p = torch.nn.Parameter(a.model_params[0].detach().clone())
    masters = {id(p): p.detach().float()} if a.master_params is not None else None
    b = LowBitAdamW([{"params": [p], "weight_decay": 0.01}], state, seed=5, masters=masters, lr=1e-3, betas=(0.9, 0.999))
    b.load_state_dict(sd)
    for g in grads[5:]:
        for opt in (a, b):
            opt.model_params[0].grad = g.to(opt.model_params[0].dtype)
            opt.step()
    assert torch.equal(a.model_params[0], b.model_params[0])
    assert all(torch.equal(a.state[x][k], b.state[y][k]) for x, y in zip(a.state, b.state)
               for k in ("m_codes", "m_scale", "s_codes", "s_scale"))
    other = "bf16_sr_8bit" if state == "fp32_master_8bit" else "fp32_master_8bit"
    q = torch.nn.Parameter(p.detach().clone().float())
    c = LowBitAdamW([{"params": [q]}], other, seed=5, lr=1e-3, betas=(0.9, 0.999))
    with pytest.raises(ValueError, match=f"saved with train.optimizer.state {state}, this run uses {other}"):
        c.load_state_dict(sd)
    adamw = torch.optim.AdamW([q])
    q.grad = torch.ones_like(q)
    adamw.step()
    exact = adamw.state_dict()
    with pytest.raises(ValueError, match=f"saved with train.optimizer.state exact, this run uses {other}"):
        c.load_state_dict(exact)


@pytest.mark.parametrize("state,bf16", [("fp32_master_8bit", True), ("bf16_sr_8bit", True)])
def test_chunked_update_is_the_whole_tensor_update_bitwise(monkeypatch, state, bf16):
    """The torch-ops update walks a tensor in chunks of whole blocks (bounded temporaries): per element and per
    block, so chunks of 3 blocks give the bytes of one pass (the stochastic-rounding index continues across)."""
    import stages.engine.lowbit_adamw as lowbit
    torch.manual_seed(0)
    w0 = torch.randn(10 * BLOCK + 77)
    grads = _gradient_stream(w0.shape, 6, 3)
    whole, _ = _run_mode(state, w0, grads, 1e-3, 0.01, bf16)
    monkeypatch.setattr(lowbit, "CHUNK", 3 * BLOCK)
    chunked, _ = _run_mode(state, w0, grads, 1e-3, 0.01, bf16)
    assert torch.equal(whole, chunked)


def test_eager_cuda_variants_are_what_the_per_tensor_launches_differ_by():
    """warm_up_cuda compiles these before the loop: one per (model dtype, weight dtype, HAS_MASTER, SR, EVEN) over
    the optimizer's tensors, a tensor ending inside its last block (EVEN False) beside whole-block ones."""
    whole, ragged, bias = (torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)) for n in (2 * BLOCK, BLOCK + 3, 5))
    groups = [{"params": [whole, ragged]}, {"params": [bias], "weight_decay": 0.0}]
    masters = {id(p): p.detach().float() for p in (whole, ragged, bias)}
    opt = LowBitAdamW(groups, "fp32_master_8bit", seed=1, masters=masters, lr=1e-3)
    assert opt.eager_cuda_variants() == sorted([(torch.bfloat16, torch.float32, True, False, True),
                                                (torch.bfloat16, torch.float32, True, False, False)], key=str)
    sr = LowBitAdamW([{"params": [whole]}], "bf16_sr_8bit", seed=1, lr=1e-3)
    assert sr.eager_cuda_variants() == [(torch.bfloat16, torch.bfloat16, False, True, True)]
    fp32 = torch.nn.Parameter(torch.zeros(BLOCK + 1))
    assert LowBitAdamW([{"params": [fp32]}], "fp32_master_8bit", seed=1, lr=1e-3).eager_cuda_variants() == [
        (torch.float32, torch.float32, False, False, False)]
    assert opt.warm_up_cuda() == 0.0                    # off the GPU: nothing to compile
