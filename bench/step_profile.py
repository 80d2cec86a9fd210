"""Where a training step's time goes: torch.profiler over the real train_dpo / train_rm stage.

    python bench/step_profile.py --shared ../shared --out bench/results/step_profile_h200.json \
        [--variants graphs,eager] [--stages train_dpo] [--set train.precision=bf16 ...]

The workload is gpu_bench.py's (the TRL anchor's: HH-RLHF pairs through our normalize + tokenize,
random-init Qwen2.5-0.5B shape, 8 pairs per optimizer step). Each variant runs the stage CLI exactly as
the bench does, with PREFPIPE_PROFILE set (stages/engine/step_profiler.py): the first two optimizer steps
profiled by host time (one-off costs: the eager step, then the captures) and 6 steady steps by GPU kernel time. Variants:
  graphs   params as given (CUDA graphs on a single GPU): the steady table is the replayed kernels
  eager    train.cuda_graphs = 0: the same kernels launched one by one, with the ops that issue them
Writes OUT (JSON: per variant the profile summary and the run's timings) and, beside it,
step_profile_<stage>_<variant>_{first_step,steady}.txt.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

VARIANTS = {"graphs": {}, "eager": {"train.cuda_graphs": 0}}


def main(argv=None) -> None:
    import gpu_bench
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shared", default=str(REPO.parent / "shared"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--pairs", type=int, default=512)
    ap.add_argument("--probe-pairs", type=int, default=64,
                    help="probe pairs (scored before and after training, outside the profiled steps)")
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(gpu_bench.SHAPES),
                    help="'tiny' = a CPU smoke test of this script")
    ap.add_argument("--variants", default="graphs,eager")
    ap.add_argument("--stages", default="train_dpo", help="train_dpo and/or train_rm")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="params overrides for every variant")
    ap.add_argument("--profile-start", type=int, default=10, help="first optimizer step of the steady window")
    ap.add_argument("--profile-steps", type=int, default=6)
    ap.add_argument("--python", action="store_true",
                    help="also cProfile the first two steps (PREFPIPE_PROFILE_PY=1): host time by Python function")
    ap.add_argument("--work", default="/tmp/prefpipe_profile")
    ap.add_argument("--model-cache", help="gpu_bench's model cache: the random-init model made once and reused "
                    "(default: --work, made again)")
    args = ap.parse_args(argv)

    import torch
    shared = Path(args.shared).resolve()
    gpt2 = shared / "data" / "tokenizers" / "gpt2"
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    result = {"command": "python bench/step_profile.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    result["workload"] = gpu_bench.prepare_tokens(shared / "data/hh-rlhf/harmless-base-test.jsonl.gz", gpt2,
                                                  args.pairs, args.probe_pairs, 1024, work)
    cache = Path(args.model_cache) if args.model_cache else work
    model_dir, result["model"] = gpu_bench.make_model(args.shape, gpt2, cache)
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    common = {"train.gpus": 1 if cuda else 0, "train.epochs": 1, "train.global_batch_pairs": 8, "train.lr": 5e-7,
              "train.warmup_ratio": 0.0, "train.micro_batch_tokens": 16384, "tokenize.max_length": 1024,
              "rm.center_rewards_coefficient": 0.0}
    for kv in args.set:
        k, v = kv.split("=", 1)
        common[k] = yaml.safe_load(v)
    result["overrides"] = common
    result["runs"] = []
    stages = args.stages.split(",")
    ref = None
    for variant in args.variants.split(","):
        params = gpu_bench.bench_params(base, {**common, **VARIANTS[variant]})
        pdir = work / variant
        pdir.mkdir()
        (pdir / "params.yaml").write_text(yaml.safe_dump(params))
        if "train_dpo" in stages and ref is None:
            ref = work / "ref_logps.parquet"
            gpu_bench.run_stage("ref_logps", pdir / "params.yaml", model_dir, work, ["--out", str(ref)], out.parent)
        for stage in stages:
            prof_dir = work / f"profile_{stage}_{variant}"
            extra = ["--ref-logps", str(ref)] if stage == "train_dpo" else []
            info = gpu_bench.run_stage(stage, pdir / "params.yaml", model_dir, work,
                                       [*extra, "--out-dir", str(pdir / stage)], out.parent,
                                       env={"PREFPIPE_PROFILE": str(prof_dir), "PREFPIPE_PROFILE_START": str(args.profile_start),
                                            "PREFPIPE_PROFILE_STEPS": str(args.profile_steps),
                                            "PREFPIPE_PROFILE_PY": "1" if args.python else "0"})
            run = {"stage": stage, "variant": variant,
                   "profile": json.loads((prof_dir / "summary.json").read_text()),
                   **{k: info[k] for k in ("train_seconds", "tokens_per_s", "cuda_graphs", "fused_kernels",
                                           "kernel_warmup_seconds")}}
            for name in ("first_step", "second_step", "steady", "first_step_py", "second_step_py"):
                if (prof_dir / f"{name}.txt").exists():
                    shutil.copy(prof_dir / f"{name}.txt", out.parent / f"step_profile_{stage}_{variant}_{name}.txt")
            print(json.dumps(run), flush=True)
            result["runs"].append(run)
            out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
