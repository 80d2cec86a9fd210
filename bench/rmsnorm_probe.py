"""RMSNorm on the GPU: HF's Qwen2/Llama RMSNorm forward vs torch's fused kernel (torch.rms_norm), forward +
backward, GPU time only (48 norms captured in one CUDA graph, so launch gaps do not count).

    python3 bench/rmsnorm_probe.py          # on a CUDA machine; prints ms per 48 norms and the max difference

Why: stages/lib/modeling.use_fused_rms_norm routes the models' norms through the fused kernel on CUDA.
"""
import torch

T, H = 1800, 896   # ~one padded DPO step of the anchor workload, Qwen2.5-0.5B hidden size


def hf_norm(x, w, eps=1e-6):
    """transformers' Qwen2RMSNorm.forward, verbatim in effect."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dtype)


def fused(x, w, eps=1e-6):
    return torch.rms_norm(x, (H,), w, eps)


def main():
    torch.manual_seed(0)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    for name, fn in (("hf", hf_norm), ("fused", fused)):
        for _ in range(5):
            fn(x, w).backward(g)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()                  # warm up on a side stream before capture
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(x, w).backward(g)
        torch.cuda.current_stream().wait_stream(side)
        x.grad = w.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(48):
                fn(x, w).backward(g)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        print(name, "ms per 48 norms fwd+bwd (GPU):", start.elapsed_time(end) / 10)
    a, b = hf_norm(x, w), fused(x, w)
    print("max diff", (a.float() - b.float()).abs().max().item(), a.float().abs().mean().item())


if __name__ == "__main__":
    main()
