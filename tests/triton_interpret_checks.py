"""Run by tests/test_kernels.py in a subprocess with TRITON_INTERPRET=1: Triton's interpreter executes the
real kernels of stages/lib/kernels.py on CPU tensors (the GPU run of the same kernels is tests/test_gpu.py).

    TRITON_INTERPRET=1 python tests/triton_interpret_checks.py kernels
    TRITON_INTERPRET=1 python tests/triton_interpret_checks.py model <model_dir> <token_parquet> <out.pt>
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def check_kernels() -> None:
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb
    from stages.lib import kernels
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


def model_outputs(model_dir: str, parquet: str, out: str) -> None:
    """The packed model's log-probs and gradients with the fused routing live (interpreted kernels)."""
    from stages.lib import kernels
    from stages.lib.modeling import SequenceLogProbs, load_causal_lm
    from stages.lib.packing import build_packed_batch, load_token_pairs
    from stages.lib.trainer import model_inputs
    calls = {"rotary_qk": 0, "silu_mul": 0}
    for name in calls:                        # count that the fused kernels, not HF's code, ran
        fn = getattr(kernels, name)
        def counted(*a, _fn=fn, _name=name):
            calls[_name] += 1
            return _fn(*a)
        setattr(kernels, name, counted)
    torch.manual_seed(0)
    lm = load_causal_lm(model_dir)
    model = SequenceLogProbs(lm, chunk_tokens=16)
    pairs = load_token_pairs(Path(parquet))
    logps = model(**model_inputs(build_packed_batch(pairs, list(range(len(pairs))), share_prompt=True)))
    logps.sum().backward()
    torch.save({"logps": logps.detach(), "calls": calls, "routed": lm.prefpipe_fused_kernels,
                "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}, out)


if __name__ == "__main__":
    if sys.argv[1] == "kernels":
        check_kernels()
    else:
        model_outputs(*sys.argv[2:5])
