"""Do CPU results depend on which CPU runs them? The real ref_logps / train_dpo / train_rm stage CLIs on the
embedded default's tokens, with `train.portable_numerics` off and on, under emulated CPUs: torch's dispatch
forced to each capability (ATEN_CPU_CAPABILITY=default|avx2|avx512) and MKL's own dispatch capped
(MKL_ENABLE_INSTRUCTIONS=SSE4_2|AVX2|AVX512). Prints, per run, the hashes of what each stage wrote and the
final probe metrics, then how many distinct results each mode produced (1 = portable).

    snakemake --cores 2 results/tokens/train_tokens.parquet      # or any completed run of the pipeline
    python bench/portable_numerics.py --tokens results/tokens --out /tmp/portable_numerics.json --jobs 2

Under the pin the ATen capability is set by the stage itself (that is the pin), so the forced-capability
runs show what a CPU of that capability computes in each mode; the MKL caps are not overridden by the pin.
A capability the CPU lacks is ignored by torch: each run records the dispatch actually in force.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
EMULATED = {
    "native": {},
    "aten=default": {"ATEN_CPU_CAPABILITY": "default"},
    "aten=avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "aten=avx512": {"ATEN_CPU_CAPABILITY": "avx512"},
    "mkl=SSE4_2": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "mkl=AVX2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "mkl=AVX512": {"MKL_ENABLE_INSTRUCTIONS": "AVX512"},
}
# Variables the pin sets: cleared from the parent environment so "off" really is the machine's own dispatch.
PIN_VARS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def probe_metrics(path: Path) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {"accuracy": sum(r["correct"] for r in rows) / len(rows),
            "mean_margin": sum(r["margin"] for r in rows) / len(rows)}


def one_run(name: str, portable: bool, tokens: Path, model_dir: Path, params: dict, work: Path) -> dict:
    run_dir = work / f"{name}_{'on' if portable else 'off'}"
    run_dir.mkdir(parents=True, exist_ok=True)
    p = json.loads(json.dumps(params))
    p["train"]["portable_numerics"] = portable
    (run_dir / "params.yaml").write_text(yaml.safe_dump(p))
    env = {k: v for k, v in os.environ.items() if k not in PIN_VARS}
    env.update(EMULATED[name], PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    common = ["--params", str(run_dir / "params.yaml"), "--model-dir", str(model_dir),
              "--train-tokens", str(tokens / "train_tokens.parquet"), "--probe-tokens", str(tokens / "probe_tokens.parquet")]
    steps = [("ref_logps", ["--out", str(run_dir / "ref_logps.parquet")]),
             ("train_dpo", ["--ref-logps", str(run_dir / "ref_logps.parquet"), "--out-dir", str(run_dir / "dpo")]),
             ("train_rm", ["--out-dir", str(run_dir / "rm")])]
    for stage, extra in steps:
        r = subprocess.run([sys.executable, "-m", f"stages.{stage}", *common, *extra, "--log", str(run_dir / f"{stage}.log"),
                            "--perf", str(run_dir / f"{stage}.perf.json")], cwd=REPO, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{run_dir.name} {stage} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    info = json.loads((run_dir / "rm" / "run_info.json").read_text())
    out = {"emulated": name, "portable": portable, "cpu_numerics": info["environment"]["cpu_numerics"],
           "ref_logps": sha(run_dir / "ref_logps.parquet")}
    for kind in ("dpo", "rm"):
        out[f"{kind}_probe_step0"] = sha(run_dir / kind / "probe_step0.jsonl")
        out[f"{kind}_probe_final"] = sha(run_dir / kind / "probe_final.jsonl")
        out[f"{kind}_model"] = sha(run_dir / kind / "model" / "model.safetensors")
        out[f"{kind}_final"] = probe_metrics(run_dir / kind / "probe_final.jsonl")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=Path, default=REPO / "results/tokens", help="dir with train/probe_tokens.parquet")
    ap.add_argument("--model-dir", type=Path, default=REPO / "models/tiny-qwen2")
    ap.add_argument("--params", type=Path, default=REPO / "params.yaml")
    ap.add_argument("--emulate", default="native,aten=default,mkl=SSE4_2", help=f"comma list of {sorted(EMULATED)}")
    ap.add_argument("--modes", default="off,on", help="train.portable_numerics values to run: off,on")
    ap.add_argument("--work", type=Path, default=Path("/tmp/prefpipe_portable_numerics"))
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel (each is one single-threaded process)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    params = yaml.safe_load(args.params.read_text())
    params["train"]["gpus"] = 0
    names = args.emulate.split(",")
    modes = [m == "on" for m in args.modes.split(",")]
    jobs = [(n, m) for m in modes for n in names]
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(lambda nm: one_run(nm[0], nm[1], args.tokens.resolve(), args.model_dir.resolve(), params,
                                                args.work), jobs))
    keys = ["ref_logps", "dpo_probe_step0", "dpo_probe_final", "dpo_model", "rm_probe_step0", "rm_probe_final", "rm_model"]
    summary = {}
    for mode in modes:
        mine = [r for r in runs if r["portable"] == mode]
        summary["on" if mode else "off"] = {k: len({r[k] for r in mine}) for k in keys}
    import platform
    result = {"command": " ".join(sys.argv), "machine": platform.machine(), "processor": _cpu_model(),
              "runs": runs, "distinct_results": summary}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'emulated':<14} {'portable':<8} {'aten':<8} {'mkl cbwr':<10} {'ref_logps':<17} {'dpo final':<17} "
          f"{'rm final':<17} dpo acc / margin      rm acc / margin")
    for r in runs:
        print(f"{r['emulated']:<14} {str(r['portable']):<8} {r['cpu_numerics']['aten_capability']:<8} "
              f"{str(r['cpu_numerics'].get('mkl_cbwr')):<10} {r['ref_logps']:<17} {r['dpo_probe_final']:<17} "
              f"{r['rm_probe_final']:<17} {r['dpo_final']['accuracy']:.4f} / {r['dpo_final']['mean_margin']:.6f}   "
              f"{r['rm_final']['accuracy']:.4f} / {r['rm_final']['mean_margin']:.6f}")
    print("distinct results per artifact (1 = the same bytes in every emulated CPU):", json.dumps(summary))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
