"""The Snakefile's onsuccess record of a run in dvc.lock, before and after: `dvc commit --force <every ready
stage>` (DVC's CLI, what sync_dvc.py --commit-lock ran until c33fd17) against `sync_dvc.py --commit-lock` now
(one DVC session, paths hashed in threads first). Both must write the same dvc.lock (checked).

    python bench/dvc_commit_bench.py --repo /tmp/run --model-mb 1000 --reps 2

--repo: a repository in which the pipeline has run (e.g. a copy of the checkout, `dvc init`-ed as the
checkout is, after `snakemake --cores 2`); it is modified in place (its model files enlarged, dvc.lock
rewritten, .dvc/cache emptied), so use a scratch copy. To stand for a GPU run's 0.5B models, each trained
model's model.safetensors (results/train_{dpo,rm}/model) is replaced with --model-mb of random bytes, and
a --model-mb file is added to the reference directory (params ref.local_dir: a dep of verify_ref). Before
each timed commit every output's mtime is bumped (DVC's state db misses, as after a fresh run) and DVC's
cache is emptied (as in the bench's fresh clone), so each trial hashes and caches everything anew.
Prints seconds per trial and the median of each; also `md5sum` of one model file against Python's md5.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def random_file(path: Path, mb: int) -> None:
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        for _ in range(mb):
            f.write(os.urandom(1 << 20))


def fresh(repo: Path, lock: bytes) -> None:
    """As after a fresh run: every result newer than DVC's state db knows, an empty DVC cache, the old lock."""
    shutil.rmtree(repo / ".dvc" / "cache", ignore_errors=True)
    now = time.time()
    for top in ("results", "metrics", "logs", yaml.safe_load((repo / "params.yaml").read_text())["ref"]["local_dir"]):
        for dirpath, _, files in os.walk(repo / top):
            for name in files:
                os.utime(Path(dirpath) / name, (now, now))
    (repo / "dvc.lock").write_bytes(lock)
    subprocess.run(["sync"], check=True)


def md5_seconds(path: Path) -> tuple[float, float]:
    t0 = time.perf_counter()
    subprocess.run(["md5sum", str(path)], check=True, capture_output=True)
    t1 = time.perf_counter()
    h = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return t1 - t0, time.perf_counter() - t1


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", type=Path, required=True, help="a scratch repository where the pipeline ran")
    ap.add_argument("--model-mb", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args(argv)
    repo = args.repo.resolve()
    if not (repo / "dvc.lock").exists() or not (repo / "results" / "train_dpo" / "model").is_dir():
        raise SystemExit(f"dvc_commit_bench: refused: {repo} has no finished pipeline run (dvc.lock, results/)")
    ref_dir = repo / yaml.safe_load((repo / "params.yaml").read_text())["ref"]["local_dir"]
    big = [repo / "results/train_dpo/model/model.safetensors", repo / "results/train_rm/model/model.safetensors",
           ref_dir / "bench_padding.bin"]
    for path in big:
        if not path.exists() or path.stat().st_size != args.model_mb << 20:
            random_file(path, args.model_mb)
    # A finished run: every dvc.yaml stage ran (what the Snakefile's onsuccess passes as --ran).
    stages = list(yaml.safe_load((repo / "dvc.yaml").read_text())["stages"])
    lock = (repo / "dvc.lock").read_bytes()
    # sync_dvc.py works on the repository it sits in: this checkout's copy goes into --repo's workflow/.
    shutil.copy2(ROOT / "workflow" / "sync_dvc.py", repo / "workflow" / "sync_dvc_bench.py")
    shutil.copy2(ROOT / "workflow" / "integrity.py", repo / "workflow" / "integrity.py")
    cmds = {"dvc_commit_cli": ["dvc", "commit", "--force", "--quiet", *stages],
            "commit_lock": [sys.executable, "workflow/sync_dvc_bench.py", "--commit-lock", "--ran", *stages]}
    times: dict[str, list[float]] = {k: [] for k in cmds}
    locks: dict[str, bytes] = {}
    for _ in range(args.reps):
        for name, cmd in cmds.items():
            fresh(repo, lock)
            t0 = time.perf_counter()
            subprocess.run(cmd, cwd=repo, check=True)
            times[name].append(round(time.perf_counter() - t0, 3))
            locks[name] = (repo / "dvc.lock").read_bytes()
            status = subprocess.run(["dvc", "status", *stages], cwd=repo, capture_output=True, text=True, check=True)
            if "up to date" not in status.stdout:
                raise SystemExit(f"dvc_commit_bench: {name} left `dvc status` dirty:\n{status.stdout}")
    if locks["dvc_commit_cli"] != locks["commit_lock"]:
        raise SystemExit("dvc_commit_bench: the two commits wrote different dvc.lock files")
    # The no-change case (all hashes in the state db, all objects cached): what a rerun's onsuccess costs.
    t0 = time.perf_counter()
    subprocess.run(cmds["dvc_commit_cli"], cwd=repo, check=True)
    nochange_cli = round(time.perf_counter() - t0, 3)
    t0 = time.perf_counter()
    subprocess.run(cmds["commit_lock"], cwd=repo, check=True)
    nochange_new = round(time.perf_counter() - t0, 3)
    (repo / "workflow" / "sync_dvc_bench.py").unlink()
    md5sum_s, hashlib_s = md5_seconds(big[0])
    result = {"stages": stages, "model_mb": args.model_mb, "big_files": len(big), "cpus": os.cpu_count(),
              "fresh_seconds": times, "fresh_median": {k: statistics.median(v) for k, v in times.items()},
              "nochange_seconds": {"dvc_commit_cli": nochange_cli, "commit_lock": nochange_new},
              "md5_one_file_seconds": {"md5sum": round(md5sum_s, 3), "python_hashlib": round(hashlib_s, 3)},
              "lock_identical": True}
    for k, v in result.items():
        print(f"{k}: {v}")
    return result


if __name__ == "__main__":
    main()
