"""Engine stage start-up: seconds from process start to the first optimizer step (train_dpo, train_rm) or the
first pass (ref_logps), by phase, over repeated runs of the real stage CLIs under torchrun.

    python bench/startup_bench.py --shape tiny --repeats 3 [--stages ref_logps,train_dpo,train_rm] \
        [--out /tmp/startup.json] [--set train.precision=bf16 ...]

Workload: bench/gpu_bench.py's: its random-init model of --shape (made once in --model-cache; fp32 on the CPU,
bf16 on a GPU) and the first --pairs HH-RLHF pairs tokenized by our own code, --max-length short (start-up,
not training, is measured: a short sequence keeps a CPU run of the 0.5B shape to a minute). The params are
params.yaml's with train.global_batch_pairs = --pairs (one optimizer step) and, on a GPU, gpu_bench's
(train.gpus 1, bf16), then --set. Prints, per stage, the median seconds of each start-up phase (the `startup`
record of logs/<stage>.perf.json, stages/engine/startup.py) and of the whole; the JSON has every run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import gpu_bench  # noqa: E402  (the workload helpers: tokens, model, stage runner)

SHARED_DATA = REPO.parent / "shared" / "data"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="tiny", choices=sorted(gpu_bench.SHAPES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stages", default="ref_logps,train_dpo,train_rm")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--probe-pairs", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--hh", type=Path, default=SHARED_DATA / "hh-rlhf" / "harmless-base-test.jsonl.gz")
    ap.add_argument("--gpt2", type=Path, default=SHARED_DATA / "tokenizers" / "gpt2")
    ap.add_argument("--model-cache", type=Path, default=Path(tempfile.gettempdir()) / "prefpipe_models")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="params override (YAML value)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import torch
    args.model_cache.mkdir(parents=True, exist_ok=True)
    model_dir, model_facts = gpu_bench.make_model(args.shape, args.gpt2, args.model_cache)
    overrides = {"train.global_batch_pairs": args.pairs,
                 **({"train.gpus": 1, "train.precision": "bf16"} if torch.cuda.is_available() else {})}
    overrides.update({k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)})
    params = gpu_bench.bench_params(yaml.safe_load((REPO / "params.yaml").read_text()), overrides)
    stages = args.stages.split(",")
    runs: dict[str, list[dict]] = {s: [] for s in stages}
    with tempfile.TemporaryDirectory(prefix="startup_bench_") as tmp:
        work = Path(tmp)
        gpu_bench.prepare_tokens(args.hh, args.gpt2, args.pairs, args.probe_pairs, args.max_length, work)
        params_file = work / "params.yaml"
        params_file.write_text(yaml.safe_dump(params))
        logs = work / "logs"
        logs.mkdir()
        ref_path = work / "ref_logps.parquet"
        for _ in range(args.repeats):
            for stage in stages:
                if stage == "ref_logps" or not ref_path.exists():   # train_dpo reads the reference log-probs
                    rec = gpu_bench.run_stage("ref_logps", params_file, model_dir, work, ["--out", str(ref_path)], logs)
                    if stage == "ref_logps":
                        runs[stage].append({"startup": rec["startup"], "wall_s": rec["wall_s"]})
                        continue
                extra = ["--out-dir", str(work / stage)] + (["--ref-logps", str(ref_path)] if stage == "train_dpo" else [])
                rec = gpu_bench.run_stage(stage, params_file, model_dir, work, extra, logs)
                runs[stage].append({"startup": rec["startup"], "wall_s": rec["wall_s"]})
    summary = {}
    for stage, recs in runs.items():
        order = recs[0]["startup"]["order"]
        med = {p: round(statistics.median(r["startup"]["phases_seconds"][p] for r in recs), 3) for p in order}
        total = round(statistics.median(r["startup"]["total_seconds"] for r in recs), 3)
        summary[stage] = {"phases_median_seconds": med, "total_median_seconds": total,
                          "wall_median_seconds": round(statistics.median(r["wall_s"] for r in recs), 2)}
        print(f"{stage}: start-up {total:.2f} s (median of {len(recs)}; stage wall "
              f"{summary[stage]['wall_median_seconds']:.1f} s)")
        for p in order:
            print(f"  {p:14s} {med[p]:7.3f}")
    if args.out:
        args.out.write_text(json.dumps({"shape": args.shape, "model": model_facts, "overrides": overrides,
                                        "device": "cuda" if torch.cuda.is_available() else "cpu",
                                        "summary": summary, "runs": runs}, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
