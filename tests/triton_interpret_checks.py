"""Run by tests/engine/test_kernels.py in a subprocess with TRITON_INTERPRET=1: Triton's interpreter executes the
real kernels of stages/engine/kernels.py on CPU tensors (the GPU run of the same kernels is tests/engine/test_gpu.py).

    TRITON_INTERPRET=1 python tests/triton_interpret_checks.py kernels
    TRITON_INTERPRET=1 python tests/triton_interpret_checks.py model <model_dir> <token_parquet> <out.pt>
    TRITON_INTERPRET=1 python tests/triton_interpret_checks.py model_lora <model_dir> <token_parquet> <out.pt>
    TRITON_INTERPRET=1 python tests/triton_interpret_checks.py decode_attention
    TRITON_INTERPRET=1 python tests/triton_interpret_checks.py flat_adamw
    TRITON_INTERPRET=1 python tests/triton_interpret_checks.py flat_lowbit
    TRITON_INTERPRET=1 python tests/triton_interpret_checks.py lowbit_geometry
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def check_kernels() -> None:
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb
    from stages.engine import kernels
    torch.manual_seed(0)
    for t, hq, hk, d in ((7, 3, 1, 8), (5, 14, 2, 16), (0, 2, 2, 8)):
        q = torch.randn(t, hq, d, dtype=torch.float64).float().requires_grad_()
        k = torch.randn(t, hk, d).requires_grad_()
        ang = torch.randn(t, d // 2)
        emb = torch.cat([ang, ang], -1)
        cos, sin = emb.cos(), emb.sin()
        assert kernels.rope_supported(q, k, cos, sin)
        qo, ko = kernels.rotary_qk(q, k, cos, sin)
        assert qo.is_contiguous() and ko.is_contiguous()
        q2, k2 = (x.detach().clone().requires_grad_() for x in (q, k))
        rq, rk = apply_rotary_pos_emb(q2.transpose(0, 1)[None], k2.transpose(0, 1)[None], cos[None], sin[None])
        rq, rk = rq[0].transpose(0, 1), rk[0].transpose(0, 1)
        torch.testing.assert_close(qo, rq, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ko, rk, rtol=1e-6, atol=1e-6)
        gq, gk = torch.randn_like(rq), torch.randn_like(rk)
        torch.autograd.backward((qo, ko), (gq, gk))
        torch.autograd.backward((rq, rk), (gq, gk))
        torch.testing.assert_close(q.grad, q2.grad, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(k.grad, k2.grad, rtol=1e-6, atol=1e-6)
    # autocast's mix: bf16 q/k, fp32 tables -> fp32 out (as HF's q * cos), gradients back in bf16
    q = torch.randn(4, 2, 8, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(4, 1, 8, dtype=torch.bfloat16, requires_grad=True)
    cos = torch.rand(4, 8)
    qo, ko = kernels.rotary_qk(q, k, cos, cos)
    assert qo.dtype == ko.dtype == torch.float32
    (qo.sum() + ko.sum()).backward()
    assert q.grad.dtype == k.grad.dtype == torch.bfloat16
    assert not kernels.rope_supported(torch.zeros(3, 2, 12), torch.zeros(3, 1, 12), torch.zeros(3, 12), torch.zeros(3, 12))
    for shape in ((3, 37), (0, 5), (2, 3, 4097)):
        g = torch.randn(shape, requires_grad=True)
        u = torch.randn(shape, requires_grad=True)
        out = kernels.silu_mul(g, u)
        g2, u2 = (x.detach().clone().requires_grad_() for x in (g, u))
        ref = F.silu(g2) * u2
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        w = torch.randn_like(ref)
        (out * w).sum().backward()
        (ref * w).sum().backward()
        torch.testing.assert_close(g.grad, g2.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(u.grad, u2.grad, rtol=1e-5, atol=1e-6)
    print("kernels ok")


def lora_model(model_dir: str):
    """The tiny causal LM with LoRA on every linear layer (stages/engine/adapters.py) and lora_B drawn non-zero,
    so the adapters change the output: the fused routing must keep them (tests/engine/test_lora.py)."""
    from stages.engine.adapters import attach_adapter
    from stages.engine.modeling import load_causal_lm
    lm = load_causal_lm(model_dir)
    torch.manual_seed(0)
    attach_adapter(lm, {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0, "export": "merged",
                        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
                   "lm_head")
    with torch.no_grad():
        for n, p in lm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return lm


def model_outputs(model_dir: str, parquet: str, out: str, lora: bool = False) -> None:
    """The packed model's log-probs and gradients with the fused routing live (interpreted kernels)."""
    from stages.engine import kernels, modeling
    from stages.engine.modeling import SequenceLogProbs, load_causal_lm
    from stages.engine.packing import build_packed_batch, load_token_pairs
    from stages.engine.data import model_inputs
    calls = {"rotary_qk": 0, "silu_mul_halves": 0, "grouped_linear": 0}
    for name in calls:                        # count that the fused paths, not HF's code, ran
        owner = modeling if name == "grouped_linear" else kernels
        fn = getattr(owner, name)
        def counted(*a, _fn=fn, _name=name):
            calls[_name] += 1
            return _fn(*a)
        setattr(owner, name, counted)
    torch.manual_seed(0)
    lm = lora_model(model_dir) if lora else load_causal_lm(model_dir)
    model = SequenceLogProbs(lm, chunk_tokens=16)
    pairs = load_token_pairs(Path(parquet))
    logps = model(**model_inputs(build_packed_batch(pairs, list(range(len(pairs))), share_prompt=True)))
    logps.sum().backward()
    torch.save({"logps": logps.detach(), "calls": calls, "routed": lm.prefpipe_fused_kernels,
                "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}, out)


def check_decode_rotary(device: str = "cpu") -> None:
    """modeling._fused_rotary on a decode step's q/k ([B, H, 1, D], views of the projections' [B, 1, H, D] outputs,
    the rows as the kernel's tokens) against HF's apply_rotary_pos_emb, forward."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb
    from stages.engine.modeling import _fused_rotary
    torch.manual_seed(0)
    fused = _fused_rotary(apply_rotary_pos_emb)
    for b, hq, hk, d in ((5, 4, 2, 16), (3, 14, 2, 64)):
        q = torch.randn(b, 1, hq, d, device=device).transpose(1, 2)
        k = torch.randn(b, 1, hk, d, device=device).transpose(1, 2)
        ang = torch.randn(b, 1, d // 2, device=device)
        emb = torch.cat([ang, ang], -1)
        cos, sin = emb.cos(), emb.sin()
        qo, ko = fused(q, k, cos, sin)
        rq, rk = apply_rotary_pos_emb(q, k, cos, sin)
        assert qo.shape == rq.shape == (b, hq, 1, d) and ko.shape == rk.shape
        torch.testing.assert_close(qo, rq, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ko, rk, rtol=1e-5, atol=1e-5)
    print("decode rotary ok")


def check_decode_attention(device: str = "cpu") -> None:
    """kernels.decode_attention against the decode step's masked two-matmul attention in float64 (the form the
    CPU path runs, generation_attention_forward without a key count), GQA groups of 1, 7 and 8 query heads a KV
    head, rows of 1 key to the whole cache, a block boundary crossed, keys past a row's count holding garbage
    (never read, so they must not matter)."""
    from stages.engine import kernels
    from stages.engine.generation import generation_attention_forward
    torch.manual_seed(0)
    for b, hq, hkv, length, d in ((3, 4, 4, 9, 16), (4, 14, 2, 130, 64), (2, 16, 2, 70, 32)):
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        q = torch.randn(b, 1, hq, d, device=device).to(dtype).transpose(1, 2)       # HF's [B, Hq, 1, D] view
        k = torch.randn(b, hkv, length, d, device=device).to(dtype)
        v = torch.randn(b, hkv, length, d, device=device).to(dtype)
        count = torch.tensor([1, length, min(65, length), length - 3][:b], device=device)
        mask = torch.arange(length, device=device)[None, :] < count[:, None]
        k.masked_fill_(~mask[:, None, :, None], 1e4)         # past a row's keys: values that would dominate
        v.masked_fill_(~mask[:, None, :, None], 1e4)
        assert kernels.decode_attention_supported(q, k)
        out = kernels.decode_attention(q, k, v, count, d ** -0.5)
        ref, _ = generation_attention_forward(None, q.double(), k.double(), v.double(), None, d ** -0.5,
                                              prefpipe_key_mask=mask)
        assert out.shape == (b, 1, hq, d)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    assert not kernels.decode_attention_supported(torch.randn(2, 4, 2, 16, device=device), k)   # two query tokens
    # generate's own check before it lets the kernel serve a call (decode_kernel_problem): passes here, and a
    # kernel made wrong (its output scaled) is caught, so the call would fall back to the matmul form
    from stages.engine import generation
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    assert generation.decode_kernel_problem(14, 2, 64, dtype, torch.device(device)) is None
    right = kernels.decode_attention
    try:
        kernels.decode_attention = lambda *a, **kw: right(*a, **kw) * 1.05
        assert "disagrees" in generation.decode_kernel_problem(14, 2, 64, dtype, torch.device(device))
    finally:
        kernels.decode_attention = right
    print("decode attention ok")


def check_flat_adamw(device: str = "cpu") -> None:
    """(CPU under the interpreter, or CUDA from tests/engine/test_gpu.py.) The graph path's flat Triton AdamW (flat_adamw.FlatMasterAdamW through graphed_optimizer_step) against
    the eager trainer's step (grads_to_master, clip_grad_norm_, MasterWeightAdamW.step, zero_grad), step after
    step with a changing learning rate and an active clip; a parameter without gradient stays untouched; the
    optimizer state_dict it leaves continues as MasterWeightAdamW's own."""
    from stages.engine.flat_adamw import FlatMasterAdamW
    from stages.engine.modeling import _ADDS_INTO_GRAD
    from stages.engine.dist import DistEnv
    from stages.engine.optim import MasterWeightAdamW, build_optimizer, total_grad_norm
    from stages.engine.steps import graphed_optimizer_step
    from engine_helpers import train_settings
    settings = train_settings(max_grad_norm=0.05, weight_decay=0.1, precision="bf16")
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device(device), backend="gloo")

    def net():
        return torch.nn.ModuleDict({"a": torch.nn.Linear(8, 40), "b": torch.nn.Linear(40, 4),
                                    "unused": torch.nn.Linear(3, 3)})

    def run(m, x):
        return m["b"](torch.tanh(m["a"](x)))

    torch.manual_seed(0)
    base = net()
    models, opts = [], []
    for _ in range(3):
        m = net().to(device)
        m.load_state_dict(base.state_dict())
        masters = {id(p): p.detach() for p in m.parameters()}
        m.to(torch.bfloat16)
        models.append(m)
        opts.append(build_optimizer(m, settings, env, masters))
    assert isinstance(opts[1], MasterWeightAdamW)
    flat = FlatMasterAdamW(opts[1], settings.max_grad_norm)
    assert FlatMasterAdamW.unsupported(opts[1]) is None
    unused_before = [p.detach().clone() for p in models[1]["unused"].parameters()]
    lrs = [torch.zeros((), dtype=torch.float32, device=device) for _ in opts[1].param_groups]
    sums, row = (torch.zeros(n, dtype=torch.float64, device=device) for n in (2, 3))

    def eager_step(m, opt):
        opt.grads_to_master()
        norm = total_grad_norm(opt.master_params, settings.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return norm

    def compare(oa, ob):
        for ma, mb in zip(oa.master_params, ob.master_params):
            # A few fp32 ulps of weights ~0.5: the flat kernel rounds each fp32 op, torch's fused CUDA kernel
            # computes several products (beta * m, lr * wd * w) in double (1.6e-7 seen on an H200 in 3 steps).
            torch.testing.assert_close(ma, mb, rtol=0, atol=4e-7)
        for p, m in zip(ob.model_params, ob.master_params):               # the model holds its master, rounded
            if device == "cpu":                                           # the interpreter truncates
                torch.testing.assert_close(p.float(), m.detach(), rtol=2 ** -7, atol=0)
            else:                                                         # a GPU rounds to nearest, as torch
                assert torch.equal(p, m.detach().to(p.dtype))
        sa, sb = oa.state_dict(), ob.state_dict()
        assert set(sa["state"]) == set(sb["state"]), (set(sa["state"]), set(sb["state"]))
        for i, st in sa["state"].items():
            for key in ("step", "exp_avg", "exp_avg_sq"):
                ref = st[key].float()        # atol: fp32 rounding at the tensor's scale (lerp cancels)
                torch.testing.assert_close(ref, sb["state"][i][key].float(), rtol=2e-5, atol=1e-6 * float(ref.abs().max()),
                                           msg=lambda m, key=key, i=i: f"{key} {i}: {m}")

    def same_grads(src, dst):
        # Both optimizers get the very same gradients (the models' bf16 weights may differ by a rounding: the
        # interpreter truncates where a GPU rounds to nearest), so the update math alone is compared.
        for ps, pd in zip(src.parameters(), dst.parameters()):
            pd.grad = None if ps.grad is None else ps.grad.clone()

    for step, lr in enumerate([1e-2, 5e-3, 2e-2]):
        x = torch.randn(5, 8, dtype=torch.bfloat16, device=device)
        for opt in opts:
            for g in opt.param_groups:
                g["lr"] = lr
        m = models[1]
        run(m, x).float().square().mean().backward()
        same_grads(m, models[0])
        norm = eager_step(models[0], opts[0])
        for t, g in zip(lrs, opts[1].param_groups):
            t.fill_(g["lr"])
        sums += torch.tensor([1.0, 2.0 * step], dtype=torch.float64, device=device)
        graphed_optimizer_step(opts[1], m, settings, lrs, sums, row, flat)
        assert row[:2].tolist() == [1.0, 2.0 * step] and sums.abs().sum() == 0
        assert abs(float(row[2]) / float(norm) - 1) < 1e-5, (row, norm)
        assert float(norm) > settings.max_grad_norm          # the clip is active
        used = [p for n, p in m.named_parameters() if not n.startswith("unused")]
        assert all(p.grad is not None and p.grad.abs().sum() == 0 for p in used)
        assert all(p.grad is None for p in m["unused"].parameters())
        # the flat gradient's views are marked: a GroupedLinear weight GEMM adds into them (modeling.py)
        assert all(getattr(p, _ADDS_INTO_GRAD, False) for p in used)
        assert not any(hasattr(p, _ADDS_INTO_GRAD) for p in m["unused"].parameters())
        compare(opts[0], opts[1])
    for p, before in zip(models[1]["unused"].parameters(), unused_before):
        assert torch.equal(p, before)
    # the bias corrections come out of _clip_kernel in double precision (1 - 0.999^t in fp32 would be off
    # by ~1e-5 relative: cancellation), per parameter group
    t = float(flat.step_count)
    assert t == 3.0
    for gi, row in zip([gi for gi, _, _ in flat.segments], flat.bias.tolist()):
        b1, b2 = opts[1].param_groups[gi]["betas"]
        assert abs(row[4] / (1 - b1 ** t) - 1) < 1e-12 and abs(row[5] / math.sqrt(1 - b2 ** t) - 1) < 1e-12, row
    # the views: one flat buffer each, what the model and the optimizer see
    assert models[1]["a"].weight.untyped_storage().data_ptr() == flat.param.untyped_storage().data_ptr()
    assert opts[1].master_params[0].untyped_storage().data_ptr() == flat.master.untyped_storage().data_ptr()
    # the flat run's state_dict continues as MasterWeightAdamW's own step
    flat.release()
    assert all(p.grad is None for p in models[1].parameters())
    assert not any(hasattr(p, _ADDS_INTO_GRAD) for p in models[1].parameters())      # unmarked with its buffer
    models[2].load_state_dict(models[1].state_dict())
    opts[2].load_state_dict(opts[1].state_dict())
    run(models[2], torch.randn(5, 8, dtype=torch.bfloat16, device=device)).float().square().mean().backward()
    same_grads(models[2], models[0])
    for k in (0, 2):
        eager_step(models[k], opts[k])
    compare(opts[0], opts[2])
    print("flat adamw ok")


def check_flat_lowbit(device: str = "cpu") -> None:
    """(CPU under the interpreter, or CUDA from tests/engine/test_gpu.py.) FlatLowBitAdamW (kernels._adamw8_kernel
    through graphed_optimizer_step) against LowBitAdamW's own step in torch ops, in each low-bit mode (fp32 masters of bf16
    weights, fp32 weights, bf16 weights with stochastic rounding), 4 steps with a changing learning rate, weight
    decay and an active clip, tensors not multiples of the 128-value block: masters / weights within a few fp32
    ulps (fp32_master_8bit) or equal bf16 values (bf16_sr_8bit: the same hash bits), but for the few values
    where a moment code flipped (an fp32 ulp at a code boundary) and what that flip moved since; the codes equal
    but for those, the decoded moments within two code steps; a parameter without gradient untouched; and a state_dict
    that continues as LowBitAdamW's own."""
    from stages.engine.dist import DistEnv
    from stages.engine.flat_adamw import FlatLowBitAdamW
    from stages.engine.lowbit_adamw import LowBitAdamW, dequantize
    from stages.engine.optim import build_optimizer, fp32_grad_norm
    from stages.engine.steps import graphed_optimizer_step
    from engine_helpers import train_settings
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device(device), backend="gloo")
    for state, precision in (("fp32_master_8bit", "bf16"), ("fp32_master_8bit", "autocast"), ("bf16_sr_8bit", "bf16")):
        settings = train_settings(max_grad_norm=0.005, weight_decay=0.1, precision=precision,
                                  optimizer={"state": state})
        bf16 = precision == "bf16"

        def net():
            return torch.nn.ModuleDict({"a": torch.nn.Linear(8, 40), "b": torch.nn.Linear(40, 300),
                                        "unused": torch.nn.Linear(3, 3)})

        torch.manual_seed(0)
        base = net()
        models, opts = [], []
        for _ in range(3):
            m = net().to(device)
            m.load_state_dict(base.state_dict())
            masters = {id(p): p.detach() for p in m.parameters()} if bf16 and state == "fp32_master_8bit" else None
            if bf16:
                m.to(torch.bfloat16)
            models.append(m)
            opts.append(build_optimizer(m, settings, env, masters))
        assert isinstance(opts[1], LowBitAdamW) and FlatLowBitAdamW.unsupported(opts[1]) is None
        flat = FlatLowBitAdamW(opts[1], settings.max_grad_norm)
        unused_before = [p.detach().clone() for p in models[1]["unused"].parameters()]
        lrs = [torch.zeros((), dtype=torch.float32, device=device) for _ in opts[1].param_groups]
        sums, row = (torch.zeros(n, dtype=torch.float64, device=device) for n in (2, 3))

        def eager(m, opt):
            norm = fp32_grad_norm(list(m.parameters()))
            divisor = 1.0 / torch.clamp(settings.max_grad_norm / (norm + 1e-6), max=1.0)
            opt.step(grad_divisor=divisor)
            opt.zero_grad()
            return norm

        def weights(opt):
            return [(opt.master_params[i] if opt.master_params is not None else p).detach().double()
                    for i, p in enumerate(opt.model_params)]

        def compare(oa, ob):
            for a, b in zip(weights(oa), weights(ob)):
                if state == "bf16_sr_8bit":      # the same hash bits: equal bf16 values but for rare flips (where
                    # a moment code flipped, below, the update differs by up to ~13% and may cross the random
                    # threshold): a few percent of the weights, by an ulp or two
                    assert float((a != b).double().mean()) < 0.03, float((a != b).double().mean())
                    assert float((a - b).abs().max()) <= 0.2 * 2e-2 * 4
                else:   # a few fp32 ulps, but where a code flipped (an fp32 ulp at a code boundary) a step's
                    # update differs by up to ~13% (one code step of m or sqrt(v)): rare, and bounded by lr
                    close = (a - b).abs() <= 4e-6
                    assert float(close.double().mean()) > 0.97, float(close.double().mean())
                    assert float((a - b).abs().max()) <= 0.2 * 2e-2 * 4
            da_, db_ = oa.state_dict()["state"], ob.state_dict()["state"]
            assert set(da_) == set(db_)
            for i in da_:
                sa, sb = da_[i], db_[i]
                for key, signed in (("m", True), ("s", False)):
                    # Codes equal but for values an fp32 ulp from a code boundary; such a flip (one code step, at
                    # most 1/16 of the block's scale) then decays through the moment's EMA; when it hits the block's
                    # absmax, the scale moves by up to a code step too and the block re-normalizes, so decoded values
                    # stay within two top-range code steps (0.13) of their block's scale.
                    differ = sa[f"{key}_codes"] != sb[f"{key}_codes"]
                    assert float(differ.double().mean()) < 0.02, (key, float(differ.double().mean()))
                    ra = (sa[f"{key}_scale"] - sb[f"{key}_scale"]).abs() / sa[f"{key}_scale"].abs().clamp_min(1e-30)
                    assert float((ra > 1e-5).double().mean()) < 0.05 and float(ra.max()) < 0.07, (key, float(ra.max()))
                    scale = sa[f"{key}_scale"].cpu()
                    da = dequantize(sa[f"{key}_codes"].cpu(), scale, signed)
                    db = dequantize(sb[f"{key}_codes"].cpu(), sb[f"{key}_scale"].cpu(), signed)
                    per = scale.repeat_interleave(128)[:da.numel()].view(da.shape)
                    worst = float(((da - db).abs() / per.clamp_min(1e-30)).max())
                    assert worst <= 0.13, (state, precision, key, worst)

        for step, lr in enumerate([1e-2, 5e-3, 2e-2, 1e-2]):
            x = torch.randn(5, 8, device=device, dtype=torch.bfloat16 if bf16 else torch.float32)
            for opt in opts:
                for g in opt.param_groups:
                    g["lr"] = lr
            m = models[1]
            m["b"](torch.tanh(m["a"](x))).float().square().mean().backward()
            for ps, pd in zip(m.parameters(), models[0].parameters()):
                pd.grad = None if ps.grad is None else ps.grad.clone()
            norm = eager(models[0], opts[0])
            for t, g in zip(lrs, opts[1].param_groups):
                t.fill_(g["lr"])
            graphed_optimizer_step(opts[1], m, settings, lrs, sums, row, flat)
            assert abs(float(row[2]) / float(norm) - 1) < 1e-5 and float(norm) > settings.max_grad_norm
            used = [p for n, p in m.named_parameters() if not n.startswith("unused")]
            assert all(p.grad is not None and p.grad.abs().sum() == 0 for p in used)
            compare(opts[0], opts[1])
        for p, before in zip(models[1]["unused"].parameters(), unused_before):
            assert torch.equal(p, before)
        assert float(flat.step_count) == 4.0 and float(opts[1].state_dict()["state"][0]["step"]) == 4.0
        flat.release()
        models[2].load_state_dict(models[1].state_dict())
        opts[2].load_state_dict(opts[1].state_dict())
        x = torch.randn(5, 8, device=device, dtype=torch.bfloat16 if bf16 else torch.float32)
        models[2]["b"](torch.tanh(models[2]["a"](x))).float().square().mean().backward()
        for ps, pd in zip(models[2].parameters(), models[0].parameters()):
            pd.grad = None if ps.grad is None else ps.grad.clone()
        for k in (0, 2):
            eager(models[k], opts[k])
        compare(opts[0], opts[2])
    print("flat lowbit ok")


def check_lowbit_geometry(device: str = "cpu") -> None:
    """(CPU under the interpreter, or CUDA from tests/engine/test_gpu.py, where the fast paths run on the GPU's own
    MUFU approximations.) kernels._adamw8_kernel as the flat step launches it, one launch over a buffer of several
    tensors (each starting at a 128-value block, the last block of each padded with zeros, a block count that is
    not a multiple of the tile's rows, so the last tile is part empty) with EVEN (no per-element mask: the
    vectorized accesses) and FAST (the branch-free divisions and square root), gives bitwise the codes, scales,
    weights and zeroed gradients of one launch per tensor with the per-element mask and FAST=False (div_rn /
    sqrt_rn: together the kernel as it was before both), in each mode (fp32 masters of bf16 weights, fp32 weights,
    bf16 weights with stochastic rounding), on decayed, zero and tiny moments and in a launch whose every tile
    reruns in the reference form; the padding stays zero and nothing past the launch's blocks is written."""
    from stages.engine import kernels
    from stages.engine.flat_adamw import TILE_ROWS
    from stages.engine.lowbit_adamw import BLOCK, n_blocks
    # the last three: moments of blocks without gradient for thousands of steps (scales of 1e-20 .. 1e-44, the
    # fast paths' power-of-two rescaling), an all-zero tensor, a tensor with gradients of 1e-25 (tiny m)
    sizes = [300, 5 * BLOCK, 1, 3 * BLOCK + 77, 2049, 17 * BLOCK, 6 * BLOCK, BLOCK + 5, 2 * BLOCK]   # 58 blocks
    assert sum(n_blocks(k) for k in sizes) % TILE_ROWS != 0
    gen = torch.Generator().manual_seed(0)
    lr, divisor, step = (torch.full((), x, device=device) for x in (1e-2, 1.37, 3.0))   # divisor > 1: a clip
    seed = 0x9E3779B9
    # the last: sqrt(1 - beta2^t) below 2^-20, outside the fast paths' range: every tile reruns in the reference form
    for has_master, sr, wdtype, bias2 in ((True, False, torch.bfloat16, math.sqrt(1 - 0.999 ** 3)),
                                          (False, False, torch.float32, math.sqrt(1 - 0.999 ** 3)),
                                          (False, True, torch.bfloat16, math.sqrt(1 - 0.999 ** 3)),
                                          (True, False, torch.bfloat16, 1e-7)):
        bias = torch.tensor([0.0, 0.0, 0.9, 0.999, 1 - 0.9 ** 3, bias2], dtype=torch.float64, device=device)
        tensors = []
        for i, k in enumerate(sizes):
            g = torch.randn(k, generator=gen) * torch.exp(torch.randn(k, generator=gen) * 2) * 1e-2
            w = torch.randn(k, generator=gen)
            mc = torch.randint(0, 256, (k,), generator=gen, dtype=torch.uint8)
            mc[mc == 128] = 0                                     # canonical codes: no -0
            sc = torch.randint(0, 256, (k,), generator=gen, dtype=torch.uint8)
            ms, ss = torch.rand(n_blocks(k), generator=gen) * 1e-2, torch.rand(n_blocks(k), generator=gen) * 1e-2
            if i == 6:
                g.zero_()
                ms = ms * torch.logspace(-18, -42, n_blocks(k))
                ss = ss * torch.logspace(-18, -42, n_blocks(k))
            elif i == 7:
                g.zero_(), mc.zero_(), sc.zero_(), ms.zero_(), ss.zero_()
            elif i == 8:
                g = g * 1e-23
                ms, ss = ms * 1e-20, ss * 1e-20
            tensors.append((g.to(wdtype), w, mc, ms, sc, ss))
        # the flat buffers (FlatLowBitAdamW._build's layout) with 2 extra blocks of sentinels past the launch's range
        total = sum(n_blocks(k) for k in sizes) * BLOCK
        nb = total // BLOCK
        spare = 2 * BLOCK
        grad = torch.full((total + spare,), 7.0, dtype=wdtype)
        param = torch.full((total + spare,), 7.0, dtype=wdtype)
        master = torch.full((total + spare,), 7.0)
        mcodes, scodes = (torch.full((total + spare,), 77, dtype=torch.uint8) for _ in range(2))
        mscale, sscale = (torch.full((nb + 2,), 7.0) for _ in range(2))
        ordinal, base = torch.zeros(nb, dtype=torch.int32), torch.zeros(nb, dtype=torch.int32)
        o = 0
        for i, (k, (g, w, mc, ms, sc, ss)) in enumerate(zip(sizes, tensors)):
            kb, b0 = n_blocks(k), o // BLOCK
            end = o + kb * BLOCK
            for buf in (grad, param, master, mcodes, scodes):
                buf[o:end] = 0                                   # the build's zero padding
            grad[o:o + k], param[o:o + k], master[o:o + k] = g, w.to(wdtype), w
            mcodes[o:o + k], scodes[o:o + k] = mc, sc
            mscale[b0:b0 + kb], sscale[b0:b0 + kb] = ms, ss
            ordinal[b0:b0 + kb] = i
            base[b0:b0 + kb] = torch.arange(kb, dtype=torch.int32) * BLOCK
            o = end
        flat = [t.to(device) for t in (grad, param, master, mcodes, mscale, scodes, sscale)]
        before = [t.clone() for t in flat]
        fg, fp, fw, fmc, fms, fsc, fss = flat
        kernels._adamw8_kernel[(-(-nb // TILE_ROWS),)](
            fg[:total], fp[:total], fw[:total], fmc[:total], fms[:nb], fsc[:total], fss[:nb], ordinal.to(device),
            base.to(device), nb, total, lr, bias, divisor, step, seed, 0.9, 0.1, 0.999, 1.0 - 0.999, 1e-8, 0.1,
            HAS_MASTER=has_master, SR=sr, ROWS=TILE_ROWS, B=BLOCK, EVEN=True)
        for t, b in zip(flat, before):                           # nothing past the launch's range is written
            assert torch.equal(t[-spare if t.numel() > nb + 2 else -2:], b[-spare if t.numel() > nb + 2 else -2:])
        o = 0
        for i, (k, (g, w, mc, ms, sc, ss)) in enumerate(zip(sizes, tensors)):
            kb, b0 = n_blocks(k), o // BLOCK
            one = [x.clone().to(device) for x in (g, w.to(wdtype), w, mc, ms, sc, ss)]
            tg, tp, tw, tmc, tms, tsc, tss = one
            kernels._adamw8_kernel[(-(-kb // TILE_ROWS),)](
                tg, tp, tw, tmc, tms, tsc, tss, torch.full((kb,), i, dtype=torch.int32, device=device),
                torch.arange(kb, dtype=torch.int32, device=device) * BLOCK, kb, k, lr, bias, divisor, step, seed, 0.9,
                0.1, 0.999, 1.0 - 0.999, 1e-8, 0.1, HAS_MASTER=has_master, SR=sr, ROWS=TILE_ROWS, B=BLOCK, EVEN=False,
                FAST=False)
            for name, a, b in (("grad", fg[o:o + k], tg), ("param", fp[o:o + k], tp), ("m codes", fmc[o:o + k], tmc),
                               ("m scale", fms[b0:b0 + kb], tms), ("s codes", fsc[o:o + k], tsc),
                               ("s scale", fss[b0:b0 + kb], tss)) + ((("master", fw[o:o + k], tw),) if has_master else ()):
                assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
                                   b.view(torch.uint8) if b.dtype == torch.bfloat16 else b), (has_master, sr, i, name)
            now, was = (tw, w) if has_master else (tp.float(), w.to(wdtype).float())     # the master, else the weight
            moved = float((now != was.to(now.device)).double().mean())
            assert bool((tg == 0).all()) and (k == 1 or i >= 6 or moved > 0.5), (has_master, sr, i, moved)
            pad = slice(o + k, o + kb * BLOCK)
            for buf in (fg, fp, fw, fmc, fsc):                   # the padding: zero gradient, weight, moments
                assert bool((buf[pad] == 0).all()), (i, buf.dtype)
            o += kb * BLOCK
    print("lowbit geometry ok")


def check_flat_warm_up() -> None:
    """planned_sizes (what the warm-up compiles for, before any gradient exists) is the layout the first flat step
    builds when every trainable parameter gets a gradient, for both flat optimizers; and warm_up with a 7B-sized
    plan (i64 sizes past 2^31) runs one program over its scratch buffers, reaching nothing past them."""
    from stages.engine.dist import DistEnv
    from stages.engine.flat_adamw import FlatLowBitAdamW, FlatMasterAdamW
    from stages.engine.optim import build_optimizer
    from stages.engine.steps import graphed_optimizer_step
    from engine_helpers import train_settings
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    for cls, optimizer in ((FlatMasterAdamW, None), (FlatLowBitAdamW, {"state": "bf16_sr_8bit"})):
        settings = train_settings(max_grad_norm=1.0, weight_decay=0.1, precision="bf16",
                                  **({"optimizer": optimizer} if optimizer else {}))
        torch.manual_seed(0)
        m = torch.nn.ModuleDict({"a": torch.nn.Linear(8, 40), "b": torch.nn.Linear(40, 300)})
        masters = {id(p): p.detach() for p in m.parameters()} if optimizer is None else None
        m.to(torch.bfloat16)
        opt = build_optimizer(m, settings, env, masters)
        planned = cls.planned_sizes(opt)
        flat = cls(opt, settings.max_grad_norm)
        m["b"](torch.tanh(m["a"](torch.randn(5, 8, dtype=torch.bfloat16)))).float().square().mean().backward()
        lrs = [torch.full((), 1e-3) for _ in opt.param_groups]
        sums, row = torch.zeros(2, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
        graphed_optimizer_step(opt, m, settings, lrs, sums, row, flat)
        assert planned == (flat.grad.numel(), [e - s for _, s, e in flat.segments]), (planned, flat.segments)
        if cls is FlatLowBitAdamW:
            # the decay group is 97 blocks here: the second segment still starts where its per-block slices are
            # 16-byte aligned, as the warm-up's scratch is (else a variant the warm-up missed)
            from stages.engine.flat_adamw import SEGMENT_BLOCKS
            from stages.engine.lowbit_adamw import BLOCK
            assert len(flat.segments) == 2, flat.segments
            for _, s, _ in flat.segments:
                assert s % (SEGMENT_BLOCKS * BLOCK) == 0 and flat.m_scale[s // BLOCK:].data_ptr() % 16 == 0, s
        big = (2 ** 31 + 2 * 8192, [2 ** 31 + 1024, 8192])
        if cls is FlatMasterAdamW:
            assert cls.warm_up(torch.device("cpu"), torch.bfloat16, big) > 0
        else:
            assert cls.warm_up(torch.device("cpu"), torch.bfloat16, False, True, big) > 0
        flat.release()
    # The eager 8-bit step's warm-up (LowBitAdamW.warm_up_cuda, before the loop of a DDP, FSDP2 or cuda_graphs 0 run):
    # each variant's launch, here as it runs on a GPU, with ragged tensors (EVEN False) beside whole blocks.
    from stages.engine.lowbit_adamw import BLOCK, LowBitAdamW
    for state in ("fp32_master_8bit", "bf16_sr_8bit"):
        ps = [torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)) for n in (2 * BLOCK, BLOCK + 3)]
        masters = {id(p): p.detach().float() for p in ps} if state == "fp32_master_8bit" else None
        opt = LowBitAdamW([{"params": ps}], state, seed=3, masters=masters, lr=1e-3)
        assert [v[-1] for v in opt.eager_cuda_variants()] == [False, True], opt.eager_cuda_variants()
        assert opt.launch_eager_variants(torch.device("cpu")) > 0
    print("flat warm-up ok")


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    if sys.argv[1] == "kernels":
        check_kernels()
    elif sys.argv[1] == "decode_attention":
        check_decode_attention()
        check_decode_rotary()
    elif sys.argv[1] == "flat_adamw":
        check_flat_adamw()
        check_flat_warm_up()
    elif sys.argv[1] == "flat_lowbit":
        check_flat_lowbit()
    elif sys.argv[1] == "lowbit_geometry":
        check_lowbit_geometry()
    elif sys.argv[1] == "model_lora":
        model_outputs(*sys.argv[2:5], lora=True)
    else:
        model_outputs(*sys.argv[2:5])
