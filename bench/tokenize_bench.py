"""tokenize's whole wall time on the real HH file, split by phase (issue 21: "the whole run is fast").

    python bench/tokenize_bench.py [--repeat 5] [--workers 0] [--repo PATH] [--out FILE.json] [--shared ../shared]

Data and params: the pipeline bench's (README's HH-RLHF block): the HH-RLHF harmless test file (2,312 rows)
through the real normalize and freeze_probe CLIs (probe.size 512: 1,786 train pairs), the real GPT-2 tokenizer
pinned with `verify_ref pin` beside a tiny random GPT-2 (tokenize reads only the tokenizer files), tokenize
max_length 1024, max_prompt_length 256, truncation keep_end, tokenize.workers --workers (0 = every core).

Each repeat runs `python -m stages.tokenize` as the Snakemake rule does, in a child process, and reports:
  - wall seconds and CPU seconds (the stage and its pool workers: getrusage of the children);
  - start-up: from the process's start to its log line naming the loaded tokenizer (interpreter, imports,
    reading + checking the probe, loading the tokenizer), from the stage's own stderr timestamps (ms);
  - work: from there to the exit (tokenizing the probe and the train pairs, writing the outputs);
  - whether torch was imported (a second run under `python -X importtime`), and the import time of
    transformers and torch as that run reports them.
--repo runs another checkout's stages on the same inputs (e.g. a `git worktree add /tmp/base <commit>`), so a
change can be measured before and after on one machine; the outputs of every repeat must be the same bytes.
The figures are medians over the repeats; on a shared machine the load averages before and after are recorded.
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def prepare(work: Path, shared: Path, workers: int) -> None:
    import yaml
    from data_bench import pinned_gpt2_reference     # the same pinned reference as the data bench (bench/ on sys.path)

    hh = shared / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"
    gpt2 = shared / "data" / "tokenizers" / "gpt2"
    if not hh.exists() or not (gpt2 / "tokenizer.json").exists():
        raise SystemExit(f"needs {hh} and {gpt2}")
    shutil.rmtree(work, ignore_errors=True)
    (work / "results").mkdir(parents=True)
    (work / "logs").mkdir()
    shutil.copy(hh, work / "hh.jsonl.gz")
    revision = pinned_gpt2_reference(gpt2, work / "gpt2")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["data"]["sources"] = [{"name": "hh", "path": "hh.jsonl.gz", "format": "hh"}]
    params["ref"] = {"source": "local", "repo_id": "bench/gpt2", "revision": revision, "local_dir": "gpt2"}
    params["tokenize"].update({"max_length": 1024, "max_prompt_length": 256, "truncation": "keep_end",
                               "workers": workers})
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for args in (["stages.verify_ref", "verify", "--identity", "results/ref_identity.json"],
                 ["stages.normalize", "--pairs", "results/pairs.parquet", "--rejections", "results/rejections.parquet",
                  "--stats", "results/normalize_stats.json"],
                 ["stages.freeze_probe", "--pairs", "results/pairs.parquet", "--train", "results/train.parquet",
                  "--probe", "results/probe.parquet", "--manifest", "results/probe_manifest.json"]):
        subprocess.run([sys.executable, "-m", *args, "--params", "params.yaml"], cwd=work, env=env, check=True,
                       capture_output=True)


def tokenize_args(out: Path) -> list[str]:
    return ["--params", "params.yaml", "--identity", "results/ref_identity.json", "--train", "results/train.parquet",
            "--probe", "results/probe.parquet", "--probe-manifest", "results/probe_manifest.json",
            "--train-tokens", f"{out}/train_tokens.parquet", "--probe-tokens", f"{out}/probe_tokens.parquet",
            "--probe-token-manifest", f"{out}/probe_token_manifest.json", "--report", f"{out}/tokenize_report.json",
            "--rejections", f"{out}/token_rejections.parquet", "--log", f"{out}/tokenize.log"]


def stamp(line: str) -> float:
    return dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def run_once(work: Path, repo: Path, out: Path, python_flags: list[str]) -> tuple[dict, str]:
    env = dict(os.environ, PYTHONPATH=str(repo))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t_start = time.time()
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, *python_flags, "-m", "stages.tokenize", *tokenize_args(out)], cwd=work,
                       env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"tokenize failed:\n{r.stderr[-3000:]}")
    loaded = next(stamp(line) for line in r.stderr.splitlines() if " tokenize INFO tokenizer " in line)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "startup_s": loaded - t_start, "work_s": wall - (loaded - t_start)}, r.stderr


def outputs_digest(out: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(out.iterdir()):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--workers", type=int, default=0, help="tokenize.workers (0 = every core)")
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout whose stages run (default: this one)")
    ap.add_argument("--shared", type=Path, default=REPO.parent / "shared")
    ap.add_argument("--work", type=Path, default=Path("/tmp/tokenize_bench"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    prepare(args.work, args.shared, args.workers)
    load_before = [round(x, 2) for x in os.getloadavg()]
    runs, digests = [], set()
    for i in range(args.repeat):
        out = args.work / f"out{i}"
        figures, _ = run_once(args.work, args.repo, out, [])
        runs.append(figures)
        digests.add(outputs_digest(out))
    _, stderr = run_once(args.work, args.repo, args.work / "out_importtime", ["-X", "importtime"])
    imports, top_level = set(), {}
    for line in stderr.splitlines():
        if line.startswith("import time:") and "cumulative" not in line:
            _, cumulative, name = line.split("|")
            imports.add(name.strip())
            if not name[1:].startswith(" "):     # top level: that import's whole tree, submodules included
                top_level[name.strip()] = top_level.get(name.strip(), 0) + int(cumulative) / 1e6
    if len(digests) != 1:
        raise SystemExit(f"outputs differ between repeats: {sorted(digests)}")
    median = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
    result = {
        "command": " ".join(["python bench/tokenize_bench.py", *sys.argv[1:]]),
        "repo": str(args.repo), "cores": len(os.sched_getaffinity(0)), "workers_param": args.workers,
        "repeats": args.repeat, "median": median, "runs": [{k: round(v, 3) for k, v in r.items()} for r in runs],
        "torch_imported": "torch" in imports,
        # Top-level entries only: transformers imports its submodules lazily, each a top-level entry of its own.
        "import_s": {k: round(v, 2) for k, v in top_level.items() if k.split(".")[0] in ("transformers", "torch")
                     and v >= 0.05},
        "outputs_sha256": digests.pop(), "load_before": load_before,
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(f"tokenize on HH ({result['cores']} cores, workers {args.workers}, {args.repeat} runs, repo {args.repo}):")
    print("  median " + ", ".join(f"{k} {v:.2f}" for k, v in median.items()))
    print(f"  torch imported: {result['torch_imported']}; import seconds {result['import_s']}; "
          f"outputs {result['outputs_sha256'][:16]}; load {load_before} -> {result['load_after']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
