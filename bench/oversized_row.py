"""What one oversized row costs the data stages (issue 26 item 7): the HH-RLHF test file plus one pair whose
chosen completion is --row-mb MB of words, through the real normalize -> freeze_probe -> tokenize CLIs.

    python bench/oversized_row.py --row-mb 50 --out bench/results/oversized_row_50mb.json \
        [--truncation reject] [--repo DIR] [--work /tmp/oversized_row]

Tokenizer: the real GPT-2 tokenizer (../shared/data/tokenizers/gpt2, pinned beside a tiny random GPT-2 as
bench/data_bench.py does). Params: data_bench's limits, which every HH pair fits (the probe must: max_length 4096,
max_prompt_length 3584), the given truncation, tokenize.workers 0. --repo runs another checkout's stages (e.g. the main checkout, for the figures
before a change); the inputs are the same. Per stage: wall seconds and the peak RSS of its largest process
(getrusage RUSAGE_CHILDREN of a fresh wrapper: the stage and its pool workers); and what tokenize recorded for
the oversized pair (token_rejections.parquet).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from data_bench import _WRAPPER, loadavg, pinned_gpt2_reference  # noqa: E402

R = "results"


def run_stage(repo: Path, name: str, args: list[str], work: Path) -> dict:
    cmd = [sys.executable, "-c", _WRAPPER, sys.executable, "-m", f"stages.{name}", *args]
    load = loadavg()
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=work, env=dict(os.environ, PYTHONPATH=str(repo)), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{name} failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    usage = next(line.split() for line in r.stderr.splitlines() if line.startswith("MAXRSS_KB"))
    return {"seconds": round(wall, 1), "cpu_seconds": round(float(usage[3]), 1),
            "max_process_rss_mb": round(int(usage[1]) / 1024, 1), "load_before": load}


def write_oversized_source(path: Path, row_mb: int, variant: int) -> None:
    """One trl row: a short prompt, a chosen completion of row_mb MB of words on one line."""
    words = "the quick brown fox jumps over the lazy dog and keeps on running "
    chosen = (words * (row_mb * 2**20 // len(words) + 1))[:row_mb * 2**20]
    row = {"prompt": "Tell me a very long story.", "chosen": " " + chosen, "rejected": f" No. ({variant})"}
    path.write_text(json.dumps(row) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--row-mb", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--truncation", default="reject", choices=["reject", "truncate_completion", "keep_end"])
    ap.add_argument("--repo", default=str(REPO), help="the checkout whose stages run (default: this one)")
    ap.add_argument("--shared", default=str(REPO.parent / "shared"))
    ap.add_argument("--work", default="/tmp/oversized_row")
    args = ap.parse_args()

    import pyarrow.parquet as pq
    import yaml

    repo, shared = Path(args.repo).resolve(), Path(args.shared)
    hh = shared / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"
    gpt2 = shared / "data" / "tokenizers" / "gpt2"
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    (work / R).mkdir(parents=True)
    (work / "logs").mkdir()
    revision = pinned_gpt2_reference(gpt2, work / "gpt2")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["data"]["sources"] = [{"name": "hh", "path": str(hh), "format": "hh"},
                                 {"name": "oversized", "path": "oversized.jsonl", "format": "trl"}]
    params["ref"] = {"source": "local", "repo_id": "bench/gpt2", "revision": revision, "local_dir": "gpt2"}
    params["tokenize"] = {"max_length": 4096, "max_prompt_length": 3584, "truncation": args.truncation, "workers": 0}
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run([sys.executable, "-m", "stages.verify_ref", "verify", "--params", "params.yaml",
                    "--identity", f"{R}/ref_identity.json", "--log", "logs/verify_ref.log"],
                   cwd=work, env=dict(os.environ, PYTHONPATH=str(repo)), check=True, capture_output=True)

    stages = {}
    for variant in range(8):  # the probe must not draw the oversized pair (the probe is tokenized whole)
        write_oversized_source(work / "oversized.jsonl", args.row_mb, variant)
        stages["normalize"] = run_stage(repo, "normalize", [
            "--params", "params.yaml", "--pairs", f"{R}/pairs.parquet", "--rejections", f"{R}/rejections.parquet",
            "--stats", f"{R}/normalize_stats.json", "--log", "logs/normalize.log"], work)
        stages["freeze_probe"] = run_stage(repo, "freeze_probe", [
            "--params", "params.yaml", "--pairs", f"{R}/pairs.parquet", "--identity", f"{R}/ref_identity.json",
            "--train", f"{R}/train.parquet",
            "--probe", f"{R}/probe.parquet", "--manifest", f"{R}/probe_manifest.json",
            "--log", "logs/freeze_probe.log"], work)
        sources = pq.read_table(work / R / "train.parquet", columns=["source", "pair_id"]).to_pylist()
        oversized = [r["pair_id"] for r in sources if r["source"] == "oversized"]
        if oversized:
            break
    else:
        raise SystemExit("the probe drew the oversized pair in every variant")
    stages["tokenize"] = run_stage(repo, "tokenize", [
        "--params", "params.yaml", "--identity", f"{R}/ref_identity.json", "--train", f"{R}/train.parquet",
        "--probe", f"{R}/probe.parquet", "--probe-manifest", f"{R}/probe_manifest.json",
        "--train-tokens", f"{R}/train_tokens.parquet", "--probe-tokens", f"{R}/probe_tokens.parquet",
        "--probe-token-manifest", f"{R}/probe_token_manifest.json", "--report", f"{R}/tokenize_report.json",
        "--rejections", f"{R}/token_rejections.parquet", "--log", "logs/tokenize.log"], work)
    rejections = [r for r in pq.read_table(work / R / "token_rejections.parquet").to_pylist()
                  if r["pair_id"] == oversized[0]]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True).stdout
    result = {
        "command": f"python bench/oversized_row.py --row-mb {args.row_mb} --truncation {args.truncation}"
                   + ("" if repo == REPO else f" --repo {repo}") + f" --out {args.out}",
        "stages_commit": commit.strip(), "row_mb": args.row_mb, "truncation": args.truncation,
        "cores": len(os.sched_getaffinity(0)), "machine": platform.processor() or platform.machine(),
        "stages": stages, "oversized_pair_token_rejection": rejections[0] if rejections else None,
        "tokenize_log": (work / "logs" / "tokenize.log").read_text().splitlines()[-1],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    for name, s in stages.items():
        print(f"{name:<14}{s['seconds']:>8.1f} s {s['max_process_rss_mb']:>9.0f} MB  (load {s['load_before']})")
    print("oversized pair:", {k: v for k, v in (rejections[0] if rejections else {}).items() if k != "detail"})


if __name__ == "__main__":
    main()
