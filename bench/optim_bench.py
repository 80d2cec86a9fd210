"""Optimizer-step micro-benchmark on one GPU: our flat Triton AdamW in each train.optimizer.state against torchao's
8-bit and bf16-stochastic-rounding AdamW and torch's fused AdamW, on ~1B parameters (the Qwen2.5-7B shape's layer
tensors, repeated until the count is reached: real tensor sizes, so per-tensor launch costs are counted).

    python bench/optim_bench.py --out $OUT/optim_bench.json [--params 1.07e9] [--steps 20] [--torchao-site DIR]

Rows (each in a fresh allocator state; weights, gradients and the optimizer's state allocated first, then the
step timed by CUDA events, median of --steps after 3 warm-up steps; memory = the optimizer's state plus what a
step allocates, over the weights and gradients, in bytes a parameter):
  ours_exact            flat_adamw.FlatMasterAdamW: bf16 weights + gradients, fp32 masters + moments (16 B/param)
  ours_fp32_master_8bit flat_adamw.FlatLowBitAdamW: fp32 masters, 8-bit m and sqrt(v)
  ours_bf16_sr_8bit     flat_adamw.FlatLowBitAdamW: bf16 weights, stochastic rounding, 8-bit moments
  torch_fused_fp32      torch.optim.AdamW(fused=True) over fp32 weights (what a plain fp32 run steps with)
  torchao_adamw8bit     torchao.optim.AdamW8bit over fp32 weights (its documented use)
  torchao_adamw_bf16_sr torchao.optim._AdamW(bf16_stochastic_round=True) over bf16 weights
torchao rows are skipped (with the reason) when it does not import: bring its wheel (3.4 MB) with
`pip install --no-deps -t DIR torchao==0.18.0` and pass --torchao-site DIR. The issue's figures for torchao on the
H200 (torch 2.11): AdamW8bit 19.9 ms and 3.0 B/param, _AdamW bf16 SR 5.3 ms and 4.0 B/param at 1.07B.
Expected duration: ~1 minute (each row allocates <= 20 GB and steps 23 times).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Qwen2.5-7B's per-layer tensors (d 3584, KV 512, I 18944) and its norms: the sizes a real step sees.
LAYER = [(3584, 3584), (512, 3584), (512, 3584), (3584, 3584), (18944, 3584), (18944, 3584), (3584, 18944),
         (3584,), (3584,), (3584,), (512,), (512,)]


def shapes(total: float) -> list[tuple[int, ...]]:
    out, n = [], 0
    while n < total:
        for s in LAYER:
            out.append(s)
            k = 1
            for x in s:
                k *= x
            n += k
    return out


def flat_optimizer(state: str, params: list):
    """Our CUDA-graph path's optimizer step in `state` over these (bf16) parameters -> a step callable."""
    import torch
    from stages.engine.flat_adamw import FlatLowBitAdamW, FlatMasterAdamW
    from stages.engine.lowbit_adamw import LowBitAdamW
    from stages.engine.optim import MasterWeightAdamW
    groups = [{"params": params, "weight_decay": 0.0}]
    lr = [torch.full((), 1e-4, device="cuda")]
    masters = {id(p): p.detach() for p in params} if state != "bf16_sr_8bit" else None   # the masters copy them
    if state == "exact":
        flat = FlatMasterAdamW(MasterWeightAdamW(groups, masters, lr=1e-4, betas=(0.9, 0.999), fused=True), 1.0)
    else:
        flat = FlatLowBitAdamW(LowBitAdamW(groups, state, seed=0, masters=masters, lr=1e-4, betas=(0.9, 0.999)), 1.0)
    return lambda: flat.step(lr)


def timed(step, steps: int) -> list[float]:
    import torch
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def run_row(name: str, total: float, steps: int) -> dict:
    import torch
    from torch import nn
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    dims = shapes(total)
    bf16 = name in ("ours_exact", "ours_fp32_master_8bit", "ours_bf16_sr_8bit", "torchao_adamw_bf16_sr")
    dtype = torch.bfloat16 if bf16 else torch.float32
    params = [nn.Parameter(torch.randn(*s, device="cuda", dtype=dtype) * 0.02) for s in dims]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in params)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    if name.startswith("ours_"):
        step = flat_optimizer(name[len("ours_"):], params)
    elif name == "torch_fused_fp32":
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        step = opt.step
    else:
        import torchao.optim as tao
        opt = tao.AdamW8bit(params, lr=1e-4) if name == "torchao_adamw8bit" else tao._AdamW(
            params, lr=1e-4, bf16_stochastic_round=True)
        step = opt.step
    step()                                   # builds the state (the flat buffers, torchao's quantized moments)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = timed(step, steps)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    row = {"row": name, "parameters": n, "weight_dtype": str(dtype), "ms_median": round(statistics.median(times), 3),
           "ms_min": round(min(times), 3), "weights_and_grads_bytes_per_param": round(base / n, 2),
           # masters + moments (+ scales), what stays between steps beyond the weights and gradients
           "state_bytes_per_param": round((held - base) / n, 2),
           # what a step allocates on top (e.g. dequantized moments)
           "step_temporaries_bytes_per_param": round((peak - held) / n, 2),
           "state_and_temporaries_bytes_per_param": round((peak - base) / n, 2)}
    del params, step
    return row


ROWS = ["ours_exact", "ours_fp32_master_8bit", "ours_bf16_sr_8bit", "torch_fused_fp32", "torchao_adamw8bit",
        "torchao_adamw_bf16_sr"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--params", type=float, default=1.07e9)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--torchao-site", help="a directory with torchao installed (pip --target)")
    args = ap.parse_args(argv)
    if args.torchao_site:
        sys.path.insert(0, args.torchao_site)
    import torch
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    try:
        import torchao
        result["torchao"] = torchao.__version__
    except Exception as e:  # noqa: BLE001 - recorded, its rows skipped
        result["torchao"] = f"not importable: {e}"
    for name in args.rows.split(","):
        if name.startswith("torchao") and not str(result["torchao"])[0].isdigit():
            result["rows"].append({"row": name, "skipped": result["torchao"]})
            continue
        t0 = time.perf_counter()
        try:
            row = run_row(name, args.params, args.steps)
        except Exception as e:  # noqa: BLE001 - one failing row is recorded, the others still run
            row = {"row": name, "failed": f"{type(e).__name__}: {e}"[:500]}
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("| row | ms / step | state + temporaries B/param |")
    print("|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['row']} | {r.get('ms_median', r.get('skipped', r.get('failed')))} | "
              f"{r.get('state_and_temporaries_bytes_per_param', '')} |")


if __name__ == "__main__":
    main()
