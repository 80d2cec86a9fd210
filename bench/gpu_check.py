"""The GPU gate: what CI cannot run (it has no GPU), in one go on a GPU machine, written to one record.

    python bench/gpu_check.py --out DIR [--parts suite,pipeline,fit] [--shared .device/shared] [--trl-site DIR]

Every submission that changes stages/ carries a record of this script for a commit at or after that change,
committed as bench/results/gpu_check_<sha>/ (README's GPU section). Parts, in this order (each recorded even when
an earlier one failed; the exit status is 1 when any failed):

  suite     the whole GPU test suite, `python -m pytest -m gpu tests` (tests/engine/test_gpu.py, the configuration
            matrix of tests/engine/test_gpu_configs.py, ...): its summary line and every failure's name.
  pipeline  the embedded default pipeline as a GPU user runs it: a copy of this checkout (a fresh git repository,
            no results), params.yaml's `train.gpus: 1` and nothing else changed (the default precision, CUDA graphs
            and optimizer state), `snakemake --cores N` to its end, dvc.lock recorded. Records each engine stage's
            device, precision and graphs, the metrics and the generation table of summary.md.
  fit       7B full DPO on this card as bench/gpu_bench.py's qwen2.5-7b preset runs it (bf16_sr_8bit, 4096-token
            micro-batches), with no allocator variable set by hand (the stages configure the allocator themselves:
            stages/engine/dist.py): ours_sr_dpo finishes, its peak (allocated and reserved) against the memory plan.
            With --trl-site (TRL's wheels) TRL's DPO defaults run in the same call: the one-card ratio.

The record (DIR/record.txt, and DIR/record.json) names the card, the commit, the torch/CUDA versions and every
figure. The commit: `git rev-parse HEAD` where the checkout is a repository, else PREFPIPE_COMMIT (the device
tool's copy has no .git: pass the commit you sent). A GPU machine runs its own torch build: the environment stage
is run with PREFPIPE_ALLOW_UNLOCKED=1.
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("suite", "pipeline", "fit")
# Kept out of the pipeline's copy: run outputs, environments, carried wheels and data, caches.
NOT_COPIED = {".git", ".snakemake", ".venv", ".whl", ".device", ".dvc/cache", ".dvc/tmp", "results", "logs",
              "checkpoints", ".pytest_cache", ".prefpipe-cache", "build", "__pycache__"}
ALLOCATOR_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def sh(cmd: list[str], cwd: Path, log: Path, env: dict | None = None, timeout: int | None = None) -> tuple[int, float]:
    """Run cmd with its output to log; (exit status, seconds). A timeout kills it (status 124)."""
    t = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, round(time.perf_counter() - t, 1)


def tail(path: Path, n: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


def machine() -> dict:
    import torch
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(card=p.name, card_memory_gib=round(p.total_memory / 2 ** 30, 1), gpus=torch.cuda.device_count())
    else:
        out.update(card=None)
    try:
        import transformers
        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    return out


def commit() -> str:
    if os.environ.get("PREFPIPE_COMMIT"):         # the device tool's copy carries a .git of another HEAD
        return os.environ["PREFPIPE_COMMIT"]
    r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if r.returncode == 0:
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return r.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    return os.environ.get("PREFPIPE_COMMIT", "unknown (no .git and no PREFPIPE_COMMIT)")


def part_suite(out: Path, args) -> dict:
    log = out / "gpu_suite.txt"
    rc, secs = sh([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests", "-p", "no:cacheprovider", "-rfE"],
                  ROOT, log, timeout=args.suite_timeout)
    text = log.read_text(errors="replace") if log.exists() else ""
    summary = next((ln.strip("= ") for ln in reversed(text.splitlines()) if re.search(r"\d+ (passed|failed)", ln)),
                   "no summary line (killed?)")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}
    failures = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, flags=re.M)
    return {"ok": rc == 0 and counts.get("failed", 0) == 0 and counts.get("passed", 0) > 0, "rc": rc,
            "seconds": secs, "summary": summary, "counts": counts, "failures": failures}


def copy_checkout(dest: Path) -> None:
    def ignore(directory: str, names: list[str]) -> set[str]:
        rel = Path(directory).relative_to(ROOT)
        return {n for n in names if n in NOT_COPIED or str(rel / n) in NOT_COPIED or n.endswith(".pyc")}
    shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)
    git = ["git", "-c", "user.email=gpu-check@example.com", "-c", "user.name=gpu-check"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "gpu_check copy"]):
        subprocess.run(git + cmd, cwd=dest, check=True, capture_output=True)


def part_pipeline(out: Path, args) -> dict:
    work = Path(args.work) / "pipeline"
    shutil.rmtree(work, ignore_errors=True)
    work.parent.mkdir(parents=True, exist_ok=True)
    copy_checkout(work)
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["train"]["gpus"] = 1                     # the one change a GPU user makes (README's GPU section)
    changed = {"train.gpus": 1}
    for item in args.set or []:                     # --set KEY=VALUE: an opt-in feature's run on the GPU
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        node = params
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = changed[key] = yaml.safe_load(value)
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = {**os.environ, "PREFPIPE_ALLOW_UNLOCKED": "1"}
    for name in ALLOCATOR_ENV:
        env.pop(name, None)
    cmd = ["snakemake", "--cores", str(args.cores)]
    if importlib.util.find_spec("pulp") is None:
        cmd += ["--scheduler", "greedy"]            # the ILP scheduler needs pulp; which job runs first changes no output
    rc, secs = sh(cmd, work, out / "pipeline_snakemake.txt", env=env, timeout=args.pipeline_timeout)
    rec: dict = {"ok": rc == 0, "rc": rc, "seconds": secs, "command": " ".join(cmd), "params_changed": changed}
    stages = {}
    for stage in ("ref_logps", "train_dpo", "train_rm", "generate", "judge"):
        for cand in (work / "results" / stage / "run_info.json", work / "logs" / f"{stage}.perf.json"):
            if cand.exists():
                data = json.loads(cand.read_text())
                # run_info's facts (device, cuda_graphs: enabled / reason) first; the perf record's measurements
                # (its own `cuda_graphs` holds timings, not the facts) must not overwrite them
                stages.setdefault(stage, {}).update(
                    {k: data[k] for k in ("device", "cuda_graphs", "tokens_per_s", "peak_memory_bytes_per_rank",
                                          "peak_reserved_bytes_per_rank", "cuda_allocator_conf")
                     if k in data and k not in stages[stage]})
                # the graphs' replay count is the process's (the perf log's cuda_graphs), beside run_info's facts
                if "replays" in (data.get("cuda_graphs") or {}) and isinstance(stages[stage].get("cuda_graphs"), dict):
                    stages[stage]["cuda_graphs"].setdefault("replays", data["cuda_graphs"]["replays"])
                if "settings" in data:
                    s = data["settings"]
                    stages[stage]["precision"] = s.get("precision")
                    stages[stage]["optimizer_state"] = (s.get("optimizer") or {}).get("state", "exact")
    for stage, info in stages.items():
        if isinstance(info.get("cuda_graphs"), dict):
            info["cuda_graphs"] = {k: info["cuda_graphs"].get(k) for k in ("enabled", "reason", "replays")
                                   if k in info["cuda_graphs"]}
    rec["stages"] = stages
    if rc == 0:                                     # before the run, metrics/ holds the committed CPU record
        rec["metrics"] = {p.name: json.loads(p.read_text()) for p in sorted((work / "metrics").glob("*.json"))}
    summary = work / "results" / "report" / "summary.md"
    if summary.exists():
        shutil.copy2(summary, out / "pipeline_summary.md")
    rec["summary_md"] = summary.exists()
    status = subprocess.run(["dvc", "status"], cwd=work, capture_output=True, text=True)
    rec["dvc_status"] = (status.stdout + status.stderr).strip()[-2000:]
    if rc != 0:
        rec["log_tail"] = tail(out / "pipeline_snakemake.txt", 40)
    return rec


def part_fit(out: Path, args) -> dict:
    modes = "ours_sr_dpo" + (",trl_dpo" if args.trl_site else "")
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_bench.py"), "--shape", "qwen2.5-7b", "--pairs", str(args.fit_pairs),
           "--probe-pairs", "32", "--max-length", "1024", "--modes", modes, "--shared", args.shared,
           "--work", str(Path(args.work) / "fit"), "--out", str(out / "fit_7b.json")]
    if args.trl_site:
        cmd += ["--trl-site", args.trl_site]
    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_ENV}   # none set by hand
    env["PREFPIPE_ALLOW_UNLOCKED"] = "1"
    rc, secs = sh(cmd, ROOT, out / "fit_7b_log.txt", env=env, timeout=args.fit_timeout)
    rec: dict = {"rc": rc, "seconds": secs, "command": " ".join(cmd[1:]), "allocator_variable_set_by_hand": False}
    result = json.loads((out / "fit_7b.json").read_text()) if (out / "fit_7b.json").exists() else {}
    rows = {r.get("mode"): r for r in result.get("table", [])}
    rec["rows"] = rows
    ours = rows.get("ours_sr_dpo", {})
    rec["ok"] = rc == 0 and ours.get("status") == "ok"
    trl = rows.get("trl_dpo", {})
    if ours.get("status") == "ok" and trl.get("status") == "ok":
        rec["ratio_tokens_per_s_ours_over_trl_dpo"] = round(ours["tokens_per_s"] / trl["tokens_per_s"], 2)
    if not rec["ok"]:
        rec["log_tail"] = tail(out / "fit_7b_log.txt", 40)
    return rec


def render(record: dict) -> str:
    m = record["machine"]
    lines = [f"# gpu_check {record['commit']}", "",
             f"date {record['date']}; card {m.get('card')} ({m.get('card_memory_gib')} GiB); torch {m.get('torch')} "
             f"CUDA {m.get('cuda')}; transformers {m.get('transformers')}; python {m.get('python')}",
             f"command: {record['command']}", ""]
    for part, rec in record["parts"].items():
        lines.append(f"## {part}: {'ok' if rec.get('ok') else 'FAILED'} ({rec.get('seconds')} s)")
        lines.append(json.dumps({k: v for k, v in rec.items() if k not in ("ok", "seconds")}, indent=1, default=str))
        lines.append("")
    lines.append("result: " + ("all parts ok" if record["ok"] else "FAILED: " + ", ".join(
        p for p, r in record["parts"].items() if not r.get("ok"))))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the record's folder (commit it as bench/results/gpu_check_<sha>)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--shared", default=str(ROOT.parent / "shared"), help="../shared (HH-RLHF, GPT-2 tokenizer)")
    ap.add_argument("--trl-site", help="TRL's wheels installed here (pip --target): TRL's DPO beside ours in `fit`")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="pipeline part: also set this params.yaml key (dotted; the value read as YAML), repeatable")
    ap.add_argument("--cores", type=int, default=8)
    ap.add_argument("--fit-pairs", type=int, default=128)
    ap.add_argument("--work", default="/tmp/prefpipe_gpu_check")
    ap.add_argument("--suite-timeout", type=int, default=None)
    ap.add_argument("--pipeline-timeout", type=int, default=None)
    ap.add_argument("--fit-timeout", type=int, default=None)
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown parts {unknown}; known: {', '.join(PARTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"commit": commit(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "command": "python bench/gpu_check.py " + " ".join(argv or sys.argv[1:]),
              "parts": {}}
    if record["machine"].get("card") is None:
        print("gpu_check: refused: no CUDA device (this gate runs on a GPU machine: the device tool)", file=sys.stderr)
        return 2
    for part in parts:
        print(f"gpu_check: {part} ...", flush=True)
        try:
            record["parts"][part] = {"suite": part_suite, "pipeline": part_pipeline, "fit": part_fit}[part](out, args)
        except Exception as exc:          # a part that breaks is recorded, and the next part still runs
            record["parts"][part] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(f"gpu_check: {part}: {'ok' if record['parts'][part].get('ok') else 'FAILED'}", flush=True)
        record["ok"] = all(r.get("ok") for r in record["parts"].values())
        (out / "record.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
        (out / "record.txt").write_text(render(record))
    print(render(record))
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
