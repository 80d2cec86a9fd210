"""Optimizer-step micro-benchmark on one GPU: our flat Triton AdamW in each train.optimizer.state against torchao's
and bitsandbytes' 8-bit AdamW, torchao's bf16-stochastic-rounding AdamW and torch's fused AdamW, on ~1B parameters
(the Qwen2.5-7B shape's layer tensors, repeated until the count is reached: real tensor sizes, so per-tensor launch
costs are counted).

    python bench/optim_bench.py --out $OUT/optim_bench.json [--params 1.17e9] [--steps 20] [--peak-gbps 3350]
        [--torchao-site DIR] [--bnb-site DIR]
    python bench/optim_bench.py --out /tmp/dry.json --dry-run      # CPU, Triton's interpreter, tiny shapes

Rows (each in a fresh allocator state; weights, gradients and the optimizer's state allocated first, then the
step timed by CUDA events, median of --steps after 3 warm-up steps; memory = the optimizer's state plus what a
step allocates, over the weights and gradients, in bytes a parameter):
  ours_exact            flat_adamw.FlatMasterAdamW: bf16 weights + gradients, fp32 masters + moments (16 B/param)
  ours_fp32_master_8bit flat_adamw.FlatLowBitAdamW: fp32 masters, 8-bit m and sqrt(v)
  ours_bf16_sr_8bit     flat_adamw.FlatLowBitAdamW: bf16 weights, stochastic rounding, 8-bit moments
  torch_fused_fp32      torch.optim.AdamW(fused=True) over fp32 weights (what a plain fp32 run steps with)
  torchao_adamw8bit     torchao.optim.AdamW8bit over fp32 weights (its documented use)
  torchao_adamw_bf16_sr torchao.optim._AdamW(bf16_stochastic_round=True) over bf16 weights
  bnb_adamw8bit         bitsandbytes.optim.AdamW8bit over fp32 weights (its documented use; tensors under 4096
                        values keep 32-bit state, its min_8bit_size default)
Each row also reports the bytes a step must move per parameter (`bytes_per_param`: ours from
flat_adamw.step_bytes_per_param, the others from their formats, below: each buffer read and written once, the
minimum traffic, not a measurement of theirs), the bandwidth that implies at the measured time (`achieved_gbps`)
and its fraction of --peak-gbps (the card's memory bandwidth: 3350 GB/s for an H100 SXM, 4800 for an H200):
`bandwidth_fraction` = 1 / (time over the bandwidth bound). Ours includes the clip's gradient-norm pass and the
gradient zeroing (the graph path's step); torch's and the baselines' steps do neither.
torchao rows are skipped (with the reason) when it does not import: bring its wheel (3.4 MB) with
`pip install --no-deps -t DIR torchao==0.18.0` and pass --torchao-site DIR; bitsandbytes likewise
(`pip install --no-deps -t DIR bitsandbytes==0.50.2`, --bnb-site DIR; one DIR may hold both). The issue's figures for
torchao on the H200 (torch 2.11): AdamW8bit 19.9 ms and 3.0 B/param, _AdamW bf16 SR 5.3 ms and 4.0 B/param at 1.07B.
Expected duration: ~1 minute (each row allocates <= 20 GB and steps 23 times).
--dry-run: the same rows on CPU over the layer shapes divided by 112 (our kernels under TRITON_INTERPRET=1, set here
before Triton is imported), timed by the wall clock: it checks the plumbing (rows, the bytes model, the skips), its
times mean nothing.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Qwen2.5-7B's per-layer tensors (d 3584, KV 512, I 18944) and its norms: the sizes a real step sees.
LAYER = [(3584, 3584), (512, 3584), (512, 3584), (3584, 3584), (18944, 3584), (18944, 3584), (3584, 18944),
         (3584,), (3584,), (3584,), (512,), (512,)]


def shapes(total: float, shrink: int = 1) -> list[tuple[int, ...]]:
    """The whole number of layers nearest `total` parameters (at least one): 1.07e9 and 1.17e9 both give the five
    layers, 1,165,288,960 parameters, of every earlier result (bench/results/h200_7b_issue30)."""
    layer = [tuple(max(1, x // shrink) for x in s) for s in LAYER]
    per_layer = sum(math.prod(s) for s in layer)
    return layer * max(1, round(total / per_layer))


# Bytes a step must move per parameter in the baselines' formats (each buffer read and written once): torch's fused
# fp32 AdamW reads gradient, weight, m, v and writes weight, m, v (4 B each); torchao's and bitsandbytes' 8-bit AdamW
# over fp32 weights read gradient, weight, two 1-byte codes and write weight and codes, with one fp32 absmax per 256
# values per moment read and written (2 x 2 x 4 / 256); torchao's bf16 SR AdamW keeps m and v in bf16 (2 B each).
BASELINE_BYTES = {"torch_fused_fp32": 4 * 4 + 3 * 4, "torchao_adamw8bit": 4 + 4 + 2 + 4 + 2 + 16 / 256,
                  "bnb_adamw8bit": 4 + 4 + 2 + 4 + 2 + 16 / 256, "torchao_adamw_bf16_sr": 4 * 2 + 3 * 2}


def bytes_per_param(name: str) -> float:
    """The bytes a step of this row moves per parameter (the module docstring)."""
    if name.startswith("ours_"):
        from stages.engine.flat_adamw import step_bytes_per_param
        return step_bytes_per_param(name[len("ours_"):], weight_bytes=2, masters=name != "ours_bf16_sr_8bit")
    return BASELINE_BYTES[name]


def bandwidth(row: dict, peak_gbps: float) -> dict:
    """GB/s implied by the row's median time and its bytes a parameter, and the fraction of the peak."""
    moved = row["bytes_per_param"] * row["parameters"]
    gbps = moved / (row["ms_median"] * 1e-3) / 1e9
    return {"achieved_gbps": round(gbps, 1), "bandwidth_fraction": round(gbps / peak_gbps, 3),
            "bound_ms": round(moved / (peak_gbps * 1e9) * 1e3, 3)}


def flat_optimizer(state: str, params: list, device: str = "cuda"):
    """Our CUDA-graph path's optimizer step in `state` over these (bf16) parameters -> a step callable."""
    import torch
    from stages.engine.flat_adamw import FlatLowBitAdamW, FlatMasterAdamW
    from stages.engine.lowbit_adamw import LowBitAdamW
    from stages.engine.optim import MasterWeightAdamW
    groups = [{"params": params, "weight_decay": 0.0}]
    lr = [torch.full((), 1e-4, device=device)]
    masters = {id(p): p.detach() for p in params} if state != "bf16_sr_8bit" else None   # the masters copy them
    if state == "exact":
        flat = FlatMasterAdamW(MasterWeightAdamW(groups, masters, lr=1e-4, betas=(0.9, 0.999), fused=True), 1.0)
    else:
        flat = FlatLowBitAdamW(LowBitAdamW(groups, state, seed=0, masters=masters, lr=1e-4, betas=(0.9, 0.999)), 1.0)
    return lambda: flat.step(lr)


def timed(step, steps: int, device: str = "cuda") -> list[float]:
    import torch
    for _ in range(3):
        step()
    if device != "cuda":                       # --dry-run: the wall clock (plumbing only)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
        return times
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


def run_row(name: str, total: float, steps: int, peak_gbps: float, device: str = "cuda", shrink: int = 1) -> dict:
    import torch
    from torch import nn
    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    dims = shapes(total, shrink)
    bf16 = name in ("ours_exact", "ours_fp32_master_8bit", "ours_bf16_sr_8bit", "torchao_adamw_bf16_sr")
    dtype = torch.bfloat16 if bf16 else torch.float32
    params = [nn.Parameter(torch.randn(*s, device=device, dtype=dtype) * 0.02) for s in dims]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in params)

    def allocated() -> int:
        if cuda:
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated()
        return 0

    base = allocated()
    if name.startswith("ours_"):
        step = flat_optimizer(name[len("ours_"):], params, device)
    elif name == "torch_fused_fp32":
        opt = torch.optim.AdamW(params, lr=1e-4, fused=cuda)
        step = opt.step
    elif name == "bnb_adamw8bit":
        import bitsandbytes as bnb
        step = bnb.optim.AdamW8bit(params, lr=1e-4).step
    else:
        import torchao.optim as tao
        opt = tao.AdamW8bit(params, lr=1e-4) if name == "torchao_adamw8bit" else tao._AdamW(
            params, lr=1e-4, bf16_stochastic_round=True)
        step = opt.step
    step()                                   # builds the state (the flat buffers, the baselines' quantized moments)
    held = allocated()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = timed(step, steps, device)
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    row = {"row": name, "parameters": n, "weight_dtype": str(dtype), "ms_median": round(statistics.median(times), 3),
           "ms_min": round(min(times), 3), "bytes_per_param": round(bytes_per_param(name), 4),
           "weights_and_grads_bytes_per_param": round(base / n, 2),
           # masters + moments (+ scales), what stays between steps beyond the weights and gradients
           "state_bytes_per_param": round((held - base) / n, 2),
           # what a step allocates on top (e.g. dequantized moments)
           "step_temporaries_bytes_per_param": round((peak - held) / n, 2) if cuda else 0.0,
           "state_and_temporaries_bytes_per_param": round((peak - base) / n, 2) if cuda else 0.0}
    row.update(bandwidth(row, peak_gbps))
    del params, step
    return row


ROWS = ["ours_exact", "ours_fp32_master_8bit", "ours_bf16_sr_8bit", "torch_fused_fp32", "torchao_adamw8bit",
        "torchao_adamw_bf16_sr", "bnb_adamw8bit"]


def library(site: str | None, module: str) -> str:
    """The library's version, or why it does not import (its rows are then skipped with that reason)."""
    if site and site not in sys.path:
        sys.path.insert(0, site)
    try:
        return __import__(module).__version__
    except Exception as e:  # noqa: BLE001 - recorded, its rows skipped
        return f"not importable: {type(e).__name__}: {e}"[:300]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--params", type=float, default=1.17e9)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--peak-gbps", type=float, default=3350.0,
                    help="the card's memory bandwidth, GB/s: 3350 (H100 SXM, the default), 4800 (H200)")
    ap.add_argument("--torchao-site", help="a directory with torchao installed (pip --target)")
    ap.add_argument("--bnb-site", help="a directory with bitsandbytes installed (pip --target)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, Triton's interpreter, the layer shapes / 112, 2 steps: the plumbing, no timing")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"          # before stages.engine.kernels (and Triton) are imported
    import torch
    device = "cpu" if args.dry_run else "cuda"
    shrink, total, steps = (112, min(args.params, 2e5), 2) if args.dry_run else (1, args.params, args.steps)
    result = {"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)", "torch": torch.__version__,
              "peak_gbps": args.peak_gbps, "rows": [],
              "torchao": library(args.torchao_site, "torchao"), "bitsandbytes": library(args.bnb_site, "bitsandbytes")}
    for name in args.rows.split(","):
        lib = "torchao" if name.startswith("torchao") else "bitsandbytes" if name.startswith("bnb") else None
        if lib and not str(result[lib])[0].isdigit():
            result["rows"].append({"row": name, "skipped": result[lib]})
            print(json.dumps(result["rows"][-1]), flush=True)
            continue
        t0 = time.perf_counter()
        try:
            row = run_row(name, total, steps, args.peak_gbps, device, shrink)
        except Exception as e:  # noqa: BLE001 - one failing row is recorded, the others still run
            row = {"row": name, "failed": f"{type(e).__name__}: {e}"[:500]}
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"| row | ms / step | bytes / param moved | GB/s | of {args.peak_gbps:g} GB/s | bound ms "
          f"| state + temporaries B/param |")
    print("|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        if "ms_median" in r:
            print(f"| {r['row']} | {r['ms_median']} | {r['bytes_per_param']} | {r['achieved_gbps']} | "
                  f"{r['bandwidth_fraction']:.0%} | {r['bound_ms']} | {r['state_and_temporaries_bytes_per_param']} |")
        else:
            print(f"| {r['row']} | {r.get('skipped', r.get('failed'))} | | | | | |")


if __name__ == "__main__":
    main()
