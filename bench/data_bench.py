"""Data-stage benchmark (issue 19 part 4): N synthetic-unique HH pairs through normalize -> freeze_probe -> tokenize.

    python bench/data_bench.py --pairs 200000 --out bench/results/data_bench_200k.json [--shared ../shared]
        [--work /tmp/data_bench] [--ceiling-pairs 20000]

Data: the HH-RLHF harmless test file (../shared/data/hh-rlhf), its rows replicated under unique prefixes
("[k] " before the first human turn's text in both transcripts) until N rows, written as one .jsonl source;
every row is a distinct pair. Tokenizer: the real GPT-2 tokenizer (copied into the work dir and pinned there
with `verify_ref pin`, as a user's local reference is). Params: probe.size 512, tokenize max_length 4096,
max_prompt_length 3584 (every pair of the file fits), truncation reject, tokenize.workers 0 (all cores).

Each stage runs as its real CLI (`python -m stages.<stage>`, as the Snakemake rules run it) in a child
process; reported per stage: wall seconds, pairs/s (input pairs of the stage), the peak RSS of its largest
process (getrusage RUSAGE_CHILDREN of a fresh wrapper, which covers the stage's pool workers too) and the
peak total RSS of the stage's process tree (psutil, sampled every 0.1 s: what the machine must hold).

Ceiling: the raw fast tokenizer (tokenizers.Tokenizer.encode_batch, one thread: TOKENIZERS_PARALLELISM=false
in a child process) on the same texts the stage encodes (the full renderings of both branches of the first
--ceiling-pairs train pairs, rendered beforehand and not timed), in pairs per CPU-second (process_time); tokenize's
own rate per core is its pairs per CPU-second (user + system time of the stage and its pool workers, from
getrusage), so the comparison does not depend on how loaded the shared machine was. The machine's load averages (`uptime`) before and after each
stage are recorded: on a shared machine they say how much of the two cores the run really had.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Runs the stage in a child and prints the child's (and its waited descendants') peak RSS: one wrapper per stage,
# so that the figure is that stage's alone.
_WRAPPER = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
            "print('MAXRSS_KB', u.ru_maxrss, 'CPU_S', u.ru_utime + u.ru_stime, file=sys.stderr); "
            "sys.exit(r.returncode)")


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def make_source(hh: Path, n: int, path: Path) -> int:
    """n unique HH rows: copy k of row i gets "[k] " in front of its first human turn (both transcripts)."""
    rows = [json.loads(line) for line in gzip.open(hh, "rt", encoding="utf-8") if line.strip()]
    marker = "\n\nHuman: "
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        k = 0
        while written < n:
            for r in rows:
                if written == n:
                    break
                c, rj = r["chosen"], r["rejected"]
                if k:
                    c = c.replace(marker, f"{marker}[{k}] ", 1)
                    rj = rj.replace(marker, f"{marker}[{k}] ", 1)
                f.write(json.dumps({"chosen": c, "rejected": rj}, ensure_ascii=False) + "\n")
                written += 1
            k += 1
    return written


def tree_rss_sampler(pid: int, peak: list[int], stop: threading.Event) -> None:
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    while not stop.is_set():
        total = 0
        try:
            for p in [root, *root.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
        except psutil.NoSuchProcess:
            break
        peak[0] = max(peak[0], total)
        stop.wait(0.1)


def run_stage(name: str, args: list[str], cwd: Path, log_dir: Path) -> dict:
    cmd = [sys.executable, "-c", _WRAPPER, sys.executable, "-m", f"stages.{name}", *args]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    load_before = loadavg()
    t0 = time.perf_counter()
    with open(log_dir / f"{name}.stderr", "w") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        peak, stop = [0], threading.Event()
        sampler = threading.Thread(target=tree_rss_sampler, args=(proc.pid, peak, stop), daemon=True)
        sampler.start()
        rc = proc.wait()
        stop.set()
        sampler.join()
    wall = time.perf_counter() - t0
    text = (log_dir / f"{name}.stderr").read_text()
    if rc != 0:
        raise SystemExit(f"{name} failed (rc {rc}):\n{text[-3000:]}")
    usage = next(line.split() for line in text.splitlines() if line.startswith("MAXRSS_KB"))
    maxrss_kb, cpu_s = int(usage[1]), float(usage[3])
    return {"seconds": round(wall, 2), "cpu_seconds": round(cpu_s, 2), "max_process_rss_mb": round(maxrss_kb / 1024, 1),
            "peak_tree_rss_mb": round(peak[0] / 2**20, 1), "load_before": load_before, "load_after": loadavg()}


def ceiling(work: Path, tok_dir: Path, n_pairs: int) -> dict:
    """Raw tokenizer throughput, one thread, on the full renderings of the first n train pairs."""
    import pyarrow.parquet as pq

    from stages.data.pair_tokenizer import PairTokenizer
    from stages.data.tokenizer import load_tokenizer

    pf = pq.ParquetFile(work / "results" / "train.parquet")
    pairs = []
    for batch in pf.iter_batches(batch_size=4096, columns=["prompt", "chosen", "rejected"]):
        pairs += batch.to_pylist()
        if len(pairs) >= n_pairs:
            break
    pairs = pairs[:n_pairs]
    pt = PairTokenizer(load_tokenizer(tok_dir))
    texts = []
    t0 = time.perf_counter()
    for p in pairs:
        for side in ("chosen", "rejected"):
            texts.append(pt.render(p["prompt"], p[side])[1])
    render_s = time.perf_counter() - t0
    (work / "ceiling_texts.json").write_text(json.dumps(texts))
    backend = work / "ceiling_backend.json"
    backend.write_text(pt.backend.to_str())
    code = ("import json, sys, time; from tokenizers import Tokenizer; "
            "t = Tokenizer.from_file(sys.argv[1]); x = json.load(open(sys.argv[2])); "
            "t.encode_batch(x[:256]); s = time.process_time(); "
            "[t.encode_batch(x[i:i + 2048], add_special_tokens=True) for i in range(0, len(x), 2048)]; "
            "print(time.process_time() - s)")
    out = subprocess.run([sys.executable, "-c", code, str(backend), str(work / "ceiling_texts.json")],
                         env=dict(os.environ, TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1"),
                         check=True, capture_output=True, text=True)
    encode_s = float(out.stdout.strip())
    return {"pairs": len(pairs), "texts": len(texts), "encode_seconds_1_thread": round(encode_s, 3),
            "pairs_per_s_per_core": round(len(pairs) / encode_s, 1),
            "render_seconds_1_thread": round(render_s, 3),
            "render_pairs_per_s_per_core": round(len(pairs) / render_s, 1)}


def pinned_gpt2_reference(gpt2: Path, dest: Path) -> str:
    """The real GPT-2 tokenizer files in `dest` beside a tiny random GPT-2 (verify_ref pins model directories;
    tokenize reads only the tokenizer files), pinned with `verify_ref pin`; returns the revision to put in
    params.yaml's ref.revision."""
    shutil.copytree(gpt2, dest)
    subprocess.run([sys.executable, "-c", "import sys; from transformers import GPT2Config, GPT2LMHeadModel; "
                    "GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=1024))"
                    ".save_pretrained(sys.argv[1])", str(dest)], check=True, capture_output=True)
    pin = subprocess.run([sys.executable, "-m", "stages.verify_ref", "pin", str(dest), "--repo-id", "bench/gpt2"],
                         cwd=REPO, check=True, capture_output=True, text=True)
    return pin.stdout.strip().split()[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shared", default=str(REPO.parent / "shared"))
    ap.add_argument("--work", default="/tmp/data_bench")
    ap.add_argument("--ceiling-pairs", type=int, default=20000)
    args = ap.parse_args()

    import yaml

    shared = Path(args.shared)
    hh = shared / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"
    gpt2 = shared / "data" / "tokenizers" / "gpt2"
    if not hh.exists() or not (gpt2 / "tokenizer.json").exists():
        raise SystemExit(f"needs {hh} and {gpt2}")
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    (work / "results").mkdir(parents=True)
    logs = work / "logs"
    logs.mkdir()

    t0 = time.perf_counter()
    n = make_source(hh, args.pairs, work / "pairs_src.jsonl")
    make_s = time.perf_counter() - t0
    tok_dir = work / "gpt2"
    revision = pinned_gpt2_reference(gpt2, tok_dir)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["data"]["sources"] = [{"name": "hh_synthetic", "path": "pairs_src.jsonl", "format": "hh"}]
    params["probe"] = {"size": 512, "seed": 20261202}
    params["ref"] = {"source": "local", "repo_id": "bench/gpt2", "revision": revision, "local_dir": "gpt2"}
    # Limits every HH pair of the file fits (the probe must fit whole); the rows are tokenized whole.
    params["tokenize"] = {"max_length": 4096, "max_prompt_length": 3584, "truncation": "reject", "workers": 0}
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    R = "results"
    stages = {}
    subprocess.run([sys.executable, "-m", "stages.verify_ref", "verify", "--params", "params.yaml",
                    "--identity", f"{R}/ref_identity.json", "--log", "logs/verify_ref.log"],
                   cwd=work, env=dict(os.environ, PYTHONPATH=str(REPO)), check=True, capture_output=True)
    stages["normalize"] = run_stage("normalize", [
        "--params", "params.yaml", "--pairs", f"{R}/pairs.parquet", "--rejections", f"{R}/rejections.parquet",
        "--stats", f"{R}/normalize_stats.json", "--log", "logs/normalize.log"], work, logs)
    stages["freeze_probe"] = run_stage("freeze_probe", [
        "--params", "params.yaml", "--pairs", f"{R}/pairs.parquet", "--identity", f"{R}/ref_identity.json",
        "--train", f"{R}/train.parquet", "--probe", f"{R}/probe.parquet", "--manifest", f"{R}/probe_manifest.json", "--log", "logs/freeze_probe.log"],
        work, logs)
    stages["tokenize"] = run_stage("tokenize", [
        "--params", "params.yaml", "--identity", f"{R}/ref_identity.json", "--train", f"{R}/train.parquet",
        "--probe", f"{R}/probe.parquet", "--probe-manifest", f"{R}/probe_manifest.json",
        "--train-tokens", f"{R}/train_tokens.parquet", "--probe-tokens", f"{R}/probe_tokens.parquet",
        "--probe-token-manifest", f"{R}/probe_token_manifest.json", "--report", f"{R}/tokenize_report.json",
        "--rejections", f"{R}/token_rejections.parquet", "--log", "logs/tokenize.log"], work, logs)

    stats = json.loads((work / R / "normalize_stats.json").read_text())["totals"]
    manifest = json.loads((work / R / "probe_manifest.json").read_text())
    report = json.loads((work / R / "tokenize_report.json").read_text())["totals"]
    stages["normalize"]["pairs_in"] = stats["rows_in"]
    stages["freeze_probe"]["pairs_in"] = stats["pairs_out"]
    stages["tokenize"]["pairs_in"] = report["pairs_in"]
    for s in stages.values():
        s["pairs_per_s"] = round(s["pairs_in"] / s["seconds"], 1)
        s["pairs_per_cpu_s"] = round(s["pairs_in"] / s["cpu_seconds"], 1)
    cores = len(os.sched_getaffinity(0))
    ceil = ceiling(work, tok_dir, args.ceiling_pairs)
    # Per core = per CPU-second the stage used (its processes' user + system time, pool workers included):
    # independent of how busy the shared machine was, unlike wall time / cores.
    tok_per_core = stages["tokenize"]["pairs_per_cpu_s"]
    total = sum(s["seconds"] for s in stages.values())
    peak = max(max(s["max_process_rss_mb"], s["peak_tree_rss_mb"]) for s in stages.values())
    result = {
        "command": f"python bench/data_bench.py --pairs {args.pairs} --out {args.out}",
        "pairs": n, "make_source_seconds": round(make_s, 1), "cores": cores, "machine": platform.processor() or
        platform.machine(), "cpu_count": os.cpu_count(), "stages": stages,
        "train_pairs": manifest["train_pairs"], "tokenize_totals": {k: report[k] for k in ("pairs_out", "rejected")},
        "total_seconds": round(total, 1), "peak_rss_mb": peak,
        "tokenizer_ceiling": ceil,
        "tokenize_pairs_per_s_per_core": round(tok_per_core, 1),
        "tokenize_vs_ceiling_per_core": round(ceil["pairs_per_s_per_core"] / tok_per_core, 2),
        "targets": {"total_le_300s_at_1M": None if n != 1_000_000 else total <= 300,
                    "peak_rss_le_4GB": peak <= 4096,
                    "tokenize_within_1.5x_of_ceiling_per_core": ceil["pairs_per_s_per_core"] / tok_per_core <= 1.5},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"{n} pairs, {cores} cores ({args.out})")
    print(f"{'stage':<14}{'seconds':>9}{'CPU s':>8}{'pairs/s':>10}{'max proc RSS MB':>17}{'tree RSS MB':>13}"
          "  load before->after")
    for name, s in stages.items():
        print(f"{name:<14}{s['seconds']:>9.1f}{s['cpu_seconds']:>8.1f}{s['pairs_per_s']:>10.0f}{s['max_process_rss_mb']:>17.0f}"
              f"{s['peak_tree_rss_mb']:>13.0f}  {s['load_before']} -> {s['load_after']}")
    print(f"{'total':<14}{total:>9.1f}")
    print(f"raw tokenizer (1 thread): {ceil['pairs_per_s_per_core']:.0f} pairs/s/core; tokenize: "
          f"{tok_per_core:.0f} pairs/CPU-s ({result['tokenize_vs_ceiling_per_core']}x slower); "
          f"rendering alone: {ceil['render_pairs_per_s_per_core']:.0f} pairs/s/core")


if __name__ == "__main__":
    main()
