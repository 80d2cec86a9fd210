"""Whole-pipeline benchmark: the real DAG through `snakemake`, wall time per rule and in total, against the
compute the training and reference passes themselves take.

    python bench/pipeline_bench.py --out bench/results/pipeline_h200.json            # the GPU run (issue 21)
    python bench/pipeline_bench.py --shape tiny --pairs 48 --probe-size 16 --set train.epochs=1 \
        --out /tmp/pipeline.json                                                      # CPU smoke test
(the smoke test takes minutes on a 2-core CPU box: too slow for the test suite, so no test runs it.)

What runs: a copy of this checkout (tracked and untracked-but-not-ignored files; results/ and logs/ are not
copied) in a temporary directory (--work to keep it), with params.yaml set for the run and nothing else
changed, then `snakemake --cores N` there, timed. The params: README's HH-RLHF block (the HH file beside the
checkout, --hh; its first --pairs rows, all by default; max_length 1024, max_prompt_length 256, keep_end),
the reference = bench/gpu_bench.py's random-init model of --shape (seed 0; bf16 made on the GPU, fp32 on the
CPU) with the GPT-2 tokenizer (--gpt2) beside it, pinned with `python -m stages.verify_ref pin` as a
`ref.source: local` reference; on a GPU train.gpus 1 and train.precision bf16 (README's GPU section); the
pipeline's own defaults otherwise (2 epochs). --set key=value overrides any of it (YAML values).

What it reports (table on stdout, JSON to --out, and the engine stages' logs/<stage>.perf.json copied beside it):
  - per rule: wall seconds from the rule's Snakemake `benchmark:` file (logs/benchmarks/<rule>.tsv, the
    shell command's wall time);
  - total: `snakemake --cores N` (scheduling and DAG building included) plus the dvc.lock record the
    Snakefile's onsuccess makes (`workflow/sync_dvc.py --commit-lock`, DVC re-hashing every output), timed
    apart ("parts_seconds");
  - compute: the training loops' seconds (train_dpo, train_rm: `train_seconds` of logs/<stage>.perf.json)
    plus the reference passes' (ref_logps: `pass_seconds` of its train split, and of its probe split at the train
    split's throughput: the probe pass runs first and carries the process's first-use costs, reported apart as
    `ref_first_pass_warmup`), and
    total / compute (issue 21's target: <= 2);
  - each engine stage's start-up record (perf json `startup`: seconds from process start to the first
    optimizer step / the first pass, by phase), the training stages' seconds after the loop (`after_loop`: the
    final probe, the export) and the rule's seconds outside the stage process (`outside_process`: torchrun's
    start-up and teardown, interpreter exit).
A GPU machine runs its own torch build: the environment stage refuses an install that differs from the lock
unless PREFPIPE_ALLOW_UNLOCKED=1 (set it in the environment; it is passed through).
"""
from __future__ import annotations

import argparse
import csv
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
ENGINE_STAGES = ("ref_logps", "train_dpo", "train_rm")

# README's HH-RLHF block (tokenize limits for HH dialogues); the data source itself is set per run.
HH_PARAMS = {"tokenize.max_length": 1024, "tokenize.max_prompt_length": 256, "tokenize.truncation": "keep_end"}
# README's GPU section: one GPU, bf16 weights with fp32 masters.
GPU_PARAMS = {"train.gpus": 1, "train.precision": "bf16"}


def git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", "-c", "user.email=bench@example.com", "-c", "user.name=bench", *args], cwd=cwd,
                   check=True, capture_output=True)


def copy_checkout(dest: Path) -> int:
    """The files git would consider this checkout's (tracked + untracked not ignored), as they are on disk, in a
    new git repository (DVC, which records the run in dvc.lock at the end, needs one)."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
    n = 0
    for name in filter(None, names):
        src = ROOT / name
        if not src.is_file() or name.split("/")[0] in ("results", "logs", "metrics", "checkpoints"):
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / name)
        n += 1
    git("init", "-q", cwd=dest)
    # The bench's model and data subset stay out of git (a 0.5B model is GBs); nothing reads them from git.
    (dest / ".git" / "info" / "exclude").write_text("/models/bench-*/\n/data/bench/\n")
    git("add", "-A", cwd=dest)
    git("commit", "-qm", "pipeline_bench copy", cwd=dest)
    return n


def set_dotted(params: dict, dotted: str, value) -> None:
    node = params
    *path, last = dotted.split(".")
    for key in path:
        if not isinstance(node.get(key), dict):
            raise SystemExit(f"pipeline_bench: refused: --set {dotted}: params has no section {key!r}")
        node = node[key]
    node[last] = value


def write_hh_subset(hh: Path, n_pairs: int | None, dest: Path) -> int:
    lines = gzip.open(hh, "rt").read().splitlines()
    lines = lines if n_pairs is None else lines[:n_pairs]
    dest.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(dest, "wb", mtime=0) as f:
        f.write(("\n".join(lines) + "\n").encode())
    return len(lines)


def make_reference(shape: str, gpt2: Path, models: Path) -> tuple[Path, dict]:
    """gpu_bench's model of this shape plus the GPT-2 tokenizer files, in one directory (not yet pinned)."""
    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT))
    from gpu_bench import make_model
    model_dir, facts = make_model(shape, gpt2, models)
    for f in gpt2.iterdir():
        if f.is_file():
            shutil.copy2(f, model_dir / f.name)
    return model_dir, facts


def read_benchmarks(logs: Path) -> dict[str, float]:
    """{rule: wall seconds} from Snakemake's benchmark files (the `s` column)."""
    out = {}
    for tsv in sorted((logs / "benchmarks").glob("*.tsv")):
        rows = list(csv.DictReader(tsv.open(), delimiter="\t"))
        if rows:
            out[tsv.stem] = round(float(rows[-1]["s"]), 3)
    return out


def read_perf(logs: Path) -> dict[str, dict]:
    return {s: json.loads((logs / f"{s}.perf.json").read_text()) for s in ENGINE_STAGES
            if (logs / f"{s}.perf.json").exists()}


def compute_seconds(perf: dict[str, dict]) -> dict[str, float]:
    """The passes' own compute: training loops and reference passes (no start-up, probes, export)."""
    out = {}
    for stage in ("train_dpo", "train_rm"):
        if stage in perf:
            out[stage] = perf[stage]["train_seconds"]
    if "ref_logps" in perf:
        out["ref_logps"] = round(sum(ref_pass_seconds(perf["ref_logps"]).values()), 3)
    return out


def ref_pass_seconds(ref: dict) -> dict[str, float]:
    """ref_logps' compute per split. The probe split runs first and takes the process's first-use costs (Triton
    compiles on a cold cache, GEMM heuristics, allocator growth; stages/ref_logps.py), so it counts at the train
    split's throughput; what it took beyond that is first-pass warm-up (`ref_first_pass_warmup`), not compute."""
    train = ref.get("train")
    out = {"train": train["pass_seconds"]} if train else {}
    if "probe" in ref:
        probe = ref["probe"]
        at_train_rate = probe["tokens"] / train["tokens_per_s"] if train and train["tokens_per_s"] else None
        out["probe"] = min(probe["pass_seconds"], at_train_rate) if at_train_rate is not None else probe["pass_seconds"]
    return out


def summarize(rules: dict[str, float], total: float, perf: dict[str, dict]) -> dict:
    compute = compute_seconds(perf)
    compute_total = round(sum(compute.values()), 3)
    return {"total_seconds": round(total, 3), "rules_seconds": rules,
            "rules_sum_seconds": round(sum(rules.values()), 3),
            "compute_seconds": compute, "compute_total_seconds": compute_total,
            "total_over_compute": round(total / compute_total, 2) if compute_total else None,
            "startup": {s: p["startup"] for s, p in perf.items() if "startup" in p},
            "after_loop": {s: p["after_loop_seconds"] for s, p in perf.items() if p.get("after_loop_seconds")},
            "outside_process": outside_process(rules, perf),
            "ref_first_pass_warmup": round(perf["ref_logps"]["probe"]["pass_seconds"]
                                           - ref_pass_seconds(perf["ref_logps"])["probe"], 3)
            if "probe" in perf.get("ref_logps", {}) else None}


# The phases a training stage's CLI runs before it calls the loop (stages/train_*.py); the loop's wall_seconds
# starts there.
PRE_LOOP_PHASES = ("imports", "process_group", "environment", "tokens")


def outside_process(rules: dict[str, float], perf: dict[str, dict]) -> dict[str, float]:
    """Per training stage: the rule's wall time that the stage process itself did not measure (torchrun's own
    start-up and teardown, the worker's interpreter exit, the process group's shutdown)."""
    out = {}
    for stage in ("train_dpo", "train_rm"):
        p = perf.get(stage)
        if p is None or stage not in rules or "wall_seconds" not in p or "startup" not in p:
            continue
        before = sum(p["startup"]["phases_seconds"].get(k, 0.0) for k in PRE_LOOP_PHASES)
        out[stage] = round(rules[stage] - before - p["wall_seconds"], 3)
    return out


def table(summary: dict) -> str:
    compute = summary["compute_seconds"]
    lines = [f"{'rule':<14} {'wall s':>9} {'compute s':>10} {'start-up s':>11}"]
    for rule, s in sorted(summary["rules_seconds"].items(), key=lambda kv: -kv[1]):
        start = summary["startup"].get(rule, {}).get("total_seconds")
        lines.append(f"{rule:<14} {s:>9.2f} {compute.get(rule, float('nan')):>10.2f} "
                     f"{start if start is not None else float('nan'):>11.2f}")
    lines.append(f"{'sum of rules':<14} {summary['rules_sum_seconds']:>9.2f}")
    for part, s in summary.get("parts_seconds", {}).items():
        lines.append(f"{part:<14} {s:>9.2f}")
    lines.append(f"{'total':<14} {summary['total_seconds']:>9.2f} {summary['compute_total_seconds']:>10.2f}"
                 f"   total / compute = {summary['total_over_compute']}")
    if summary.get("ref_first_pass_warmup") is not None:
        lines.append(f"ref_logps first pass: {summary['ref_first_pass_warmup']:.2f} s of first-use costs beyond the "
                     "train split's throughput (not counted as compute)")
    for stage, rec in summary["startup"].items():
        phases = ", ".join(f"{k} {rec['phases_seconds'][k]:.2f}" for k in rec.get("order", rec["phases_seconds"]))
        lines.append(f"start-up {stage}: {rec['total_seconds']:.2f} s ({phases})")
    for stage, rec in summary.get("after_loop", {}).items():
        lines.append(f"after the loop {stage}: " + ", ".join(f"{k} {v:.2f}" for k, v in rec.items())
                     + f"; outside the process (torchrun, exit): {summary['outside_process'].get(stage, float('nan')):.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b", help="a bench/gpu_bench.py SHAPES key (tiny: CPU smoke test)")
    ap.add_argument("--hh", type=Path, default=SHARED_DATA / "hh-rlhf" / "harmless-base-test.jsonl.gz")
    ap.add_argument("--gpt2", type=Path, default=SHARED_DATA / "tokenizers" / "gpt2")
    ap.add_argument("--pairs", type=int, default=None, help="the first N HH rows (default: all)")
    ap.add_argument("--probe-size", type=int, default=None, help="probe.size (default: the pipeline's)")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--gpu", choices=("auto", "yes", "no"), default="auto",
                    help="apply the GPU params (train.gpus 1, bf16); auto: when torch sees a GPU")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a params override (YAML value)")
    ap.add_argument("--work", type=Path, help="run here and keep it (default: a temporary directory, removed)")
    ap.add_argument("--out", type=Path, help="the JSON result")
    args = ap.parse_args(argv)
    for path, what in ((args.hh, "--hh"), (args.gpt2, "--gpt2")):
        if not path.exists():
            raise SystemExit(f"pipeline_bench: refused: {what} {path} does not exist")

    import torch
    gpu = torch.cuda.is_available() if args.gpu == "auto" else args.gpu == "yes"
    tmp = None
    if args.work is None:
        tmp = tempfile.TemporaryDirectory(prefix="pipeline_bench_")
        args.work = Path(tmp.name)
    repo = args.work / "repo"
    try:
        if repo.exists():
            shutil.rmtree(repo)
        repo.mkdir(parents=True)
        n_files = copy_checkout(repo)
        rows = write_hh_subset(args.hh, args.pairs, repo / "data" / "bench" / "hh.jsonl.gz")
        t0 = time.perf_counter()
        model_dir, model_facts = make_reference(args.shape, args.gpt2, repo / "models" / f"bench-{args.shape}")
        revision = subprocess.run([sys.executable, "-m", "stages.verify_ref", "pin", str(model_dir.relative_to(repo)),
                                   "--repo-id", f"bench/{args.shape}"], cwd=repo, check=True, capture_output=True,
                                  text=True).stdout.strip().splitlines()[-1]
        model_facts["make_and_pin_s"] = round(time.perf_counter() - t0, 2)

        params = yaml.safe_load((repo / "params.yaml").read_text())
        overrides = {"data.sources": [{"name": "hh", "path": "data/bench/hh.jsonl.gz", "format": "hh"}],
                     "ref.source": "local", "ref.repo_id": f"bench/{args.shape}", "ref.revision": revision,
                     "ref.local_dir": model_dir.relative_to(repo).as_posix(), **HH_PARAMS,
                     **(GPU_PARAMS if gpu else {})}
        if args.probe_size is not None:
            overrides["probe.size"] = args.probe_size
        for item in args.set:
            key, sep, value = item.partition("=")
            if not sep:
                raise SystemExit(f"pipeline_bench: refused: --set {item!r} is not KEY=VALUE")
            overrides[key] = yaml.safe_load(value)
        for key, value in overrides.items():
            set_dotted(params, key, value)
        (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        subprocess.run([sys.executable, "workflow/sync_dvc.py"], cwd=repo, check=True, capture_output=True)

        # Snakemake's onsuccess records the run in dvc.lock (DVC re-hashes every output): timed apart, by
        # running it here instead (PREFPIPE_INSIDE_DVC makes the Snakefile skip it).
        log_path = args.work / "snakemake.log"
        parts = {}
        for part, cmd, env in (("snakemake", ["snakemake", "--cores", str(args.cores)], {"PREFPIPE_INSIDE_DVC": "1"}),
                               ("dvc_commit_lock", [sys.executable, "workflow/sync_dvc.py", "--commit-lock", "--ran",
                                                    *yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]], {})):
            t0 = time.perf_counter()
            with open(log_path, "a") as log:
                done = subprocess.run(cmd, cwd=repo, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
            parts[part] = round(time.perf_counter() - t0, 3)
            if done.returncode != 0:
                tail = log_path.read_text()[-4000:]
                raise SystemExit(f"pipeline_bench: {' '.join(cmd)} failed (exit {done.returncode}); log tail:\n{tail}")
        summary = summarize(read_benchmarks(repo / "logs"), sum(parts.values()), read_perf(repo / "logs"))
        summary["parts_seconds"] = parts
        result = {"shape": args.shape, "gpu": gpu, "device": torch.cuda.get_device_name(0) if gpu else "cpu",
                  "cores": args.cores, "hh_rows": rows, "files_copied": n_files, "model": model_facts,
                  "params_overrides": overrides, **summary}
        print(table(summary))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
            # The engine stages' perf records beside the result (start-up phases, passes, windows): the evidence.
            for stage in ENGINE_STAGES:
                perf_file = repo / "logs" / f"{stage}.perf.json"
                if perf_file.exists():
                    shutil.copy2(perf_file, args.out.parent / perf_file.name)
        return result
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    main()
