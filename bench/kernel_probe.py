"""The fused kernels on the GPU against HF's code, forward + backward, GPU time only (each variant captured
24 times, one per layer of the 0.5B anchor, in one CUDA graph, so launch gaps do not count).

    python3 bench/kernel_probe.py [--out kernel_probe.json]     # on a CUDA machine

Shapes: one padded DPO step of the anchor workload (~1,800 tokens), Qwen2.5-0.5B (hidden 896, 14 q heads,
2 kv heads, head dim 64, intermediate 4864). Rows: RMSNorm (HF vs torch.rms_norm, 2 per layer), rotary
(HF's apply_rotary_pos_emb vs kernels.rotary_qk), silu(gate) * up (HF vs kernels.silu_mul), each with the
largest difference to HF; and, for scale, the varlen attention as modeling's torch_varlen path runs it.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

T, H, HQ, HK, D, I, LAYERS = 1800, 896, 14, 2, 64, 4864, 24


def gpu_ms(fn, inputs, grads) -> float:
    """ms of GPU time per LAYERS calls of fn(*inputs).backward(grads), replayed as one CUDA graph."""
    def once():
        outs = fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(outs, grads)
    for _ in range(3):
        once()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        once()
    torch.cuda.current_stream().wait_stream(side)
    for x in inputs:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            once()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / 10, 3)


def max_diff(a, b) -> float:
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb as hf_rope
    from stages.engine import kernels
    torch.manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    rows = {}

    x = torch.randn(T, H, **bf, requires_grad=True)
    w = torch.randn(H, **bf, requires_grad=True)
    def hf_norm(x, w, eps=1e-6):          # transformers' Qwen2RMSNorm.forward
        h = x.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    def fused_norm(x, w, eps=1e-6):
        return torch.rms_norm(x, (H,), w, eps)
    g = torch.randn(T, H, **bf)
    rows["rms_norm_x2"] = {"hf_ms": 2 * gpu_ms(hf_norm, (x, w), (g,)), "fused_ms": 2 * gpu_ms(fused_norm, (x, w), (g,)),
                           "max_diff": max_diff(hf_norm(x, w), fused_norm(x, w))}

    # q/k as HF hands them to the rotary: [1, H, T, D] views of the projections' [1, T, H, D] outputs
    qp = torch.randn(1, T, HQ * D, **bf, requires_grad=True)
    kp = torch.randn(1, T, HK * D, **bf, requires_grad=True)
    ang = torch.rand(T, D // 2, device="cuda") * T
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos().to(torch.bfloat16)[None], emb.sin().to(torch.bfloat16)[None]
    def views(qp, kp):
        return qp.view(1, T, HQ, D).transpose(1, 2), kp.view(1, T, HK, D).transpose(1, 2)
    def hf(qp, kp):
        return hf_rope(*views(qp, kp), cos, sin)
    def fused(qp, kp):
        q, k = views(qp, kp)
        qo, ko = kernels.rotary_qk(q[0].transpose(0, 1), k[0].transpose(0, 1), cos[0], sin[0])
        return qo.transpose(0, 1).unsqueeze(0), ko.transpose(0, 1).unsqueeze(0)
    gr = (torch.randn(1, HQ, T, D, **bf), torch.randn(1, HK, T, D, **bf))
    rows["rotary"] = {"hf_ms": gpu_ms(hf, (qp, kp), gr), "fused_ms": gpu_ms(fused, (qp, kp), gr),
                      "max_diff": max_diff(hf(qp, kp), fused(qp, kp))}

    gate = torch.randn(T, I, **bf, requires_grad=True)
    up = torch.randn(T, I, **bf, requires_grad=True)
    gm = torch.randn(T, I, **bf)
    rows["silu_mul"] = {"hf_ms": gpu_ms(lambda a, b: F.silu(a) * b, (gate, up), (gm,)),
                        "fused_ms": gpu_ms(kernels.silu_mul, (gate, up), (gm,)),
                        "max_diff": max_diff(F.silu(gate) * up, kernels.silu_mul(gate, up))}

    from torch.nn.attention.varlen import varlen_attn
    lens = [300, 250, 400, 350, 500]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    n = sum(lens)
    q = torch.randn(n, HQ, D, **bf, requires_grad=True)
    k = torch.randn(n, HK, D, **bf, requires_grad=True)
    v = torch.randn(n, HK, D, **bf, requires_grad=True)
    ga = torch.randn(n, HQ, D, **bf)
    def expanded(q, k, v):
        return varlen_attn(q, k.repeat_interleave(HQ // HK, 1), v.repeat_interleave(HQ // HK, 1), cu, cu,
                           max(lens), max(lens), window_size=(-1, 0))
    att = {"expanded_ms": gpu_ms(expanded, (q, k, v), (ga,))}
    rows["varlen_attention"] = att

    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": getattr(kernels.triton, "__version__", None), "tokens": T, "layers": LAYERS, "rows": rows}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
