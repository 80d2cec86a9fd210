"""Report: a deterministic evidence bundle (tar.gz) and a short markdown summary.

    python -m stages.report --params params.yaml \
        --artifacts results/normalize/pairs.parquet ... results/train_dpo/model results/train_rm/model \
        --metrics metrics/dpo.json metrics/rm.json \
        --per-pair results/train_dpo/probe_step0.jsonl results/train_dpo/probe_final.jsonl \
                   results/train_rm/probe_step0.jsonl results/train_rm/probe_final.jsonl \
        --bootstrap-summary results/evaluate/bootstrap_summary.json \
        --train-log dpo=results/train_dpo/train_log.csv rm=results/train_rm/train_log.csv \
        --run-info dpo=results/train_dpo/run_info.json rm=results/train_rm/run_info.json \
        --bundle results/report/evidence.tar.gz --summary results/report/summary.md \
        --curves-dir results/report/curves --log logs/report.log

Bundle layout (every member under `evidence/`):
  manifest.json        every artifact's hash (DVC's md5, equal to dvc.lock's, and sha256 for files),
                       plus the sha256 of every other member of the bundle
  environment.json     python/package versions of this process, GPU/driver when nvidia-smi answers,
                       and the training environment taken from each run_info.json (whitelisted keys)
  params.yaml          the params file, byte for byte
  summary.md           the metrics table and the curves
  curves/<label>_train_curves.png
  artifacts/<path>     metrics, per-pair JSONL, the bootstrap summary and the train logs, under their
                       repo-relative paths
`--artifacts` are hashed only (weights, optimizer state and data never enter the bundle).

Deterministic: members sorted, mtime 0, uid/gid 0, empty owner names, mode 0644, gzip mtime 0 and no
file name in the gzip header, PNGs rendered by Agg with no metadata. Before anything is written,
every member is scanned for this machine's hostname, the absolute working directory, $HOME and common
credential patterns; a hit refuses the bundle (naming the member and what leaked).
"""
from __future__ import annotations

import argparse
import logging
import csv
import gzip
import hashlib
import io
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import tarfile
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Any

from stages.lib.io import atomic_path, setup_logging, write_text
from stages.lib.params import load_params

BUNDLE_ROOT = "evidence"
FIXED_MTIME = 0
PACKABLE_SUFFIXES = {".json", ".jsonl", ".csv"}
CURVE_COLUMNS = ["loss", "accuracy", "margin", "lr", "grad_norm", "tokens_per_s"]
ENV_PACKAGES = ["numpy", "scipy", "torch", "transformers", "tokenizers", "pandas", "pyarrow", "matplotlib",
                "dvc", "snakemake"]
# Keys copied from a trainer's run_info.json (top level or under one of ENV_SECTIONS). A whitelist,
# because run_info may also hold per-rank plans, timings or paths that do not belong in the bundle.
RUN_INFO_ENV_KEYS = {"python", "python_version", "torch", "torch_version", "transformers",
                     "transformers_version", "numpy", "numpy_version", "cuda", "cuda_version", "cudnn",
                     "cudnn_version", "nccl", "nccl_version", "gpu", "gpu_name", "gpu_names", "gpu_count",
                     "device_name", "driver", "driver_version", "world_size", "backend", "device", "dtype",
                     "parallel", "attention"}
ENV_SECTIONS = ("environment", "env", "versions", "hardware", "device_info")


class ReportError(ValueError):
    """An input cannot go into the evidence bundle; the message names it and why."""


class LeakError(ReportError):
    """A bundle member contains a hostname, an absolute path, $HOME or a credential."""


# --------------------------------------------------------------------------------------------------
# DVC 3 hashes (dvc_data.hashfile): md5 of the bytes for a file; for a directory the md5 of its
# `.dir` listing, json.dumps(sorted([{"md5": ..., "relpath": ...}]), sort_keys=True), plus ".dir".
# --------------------------------------------------------------------------------------------------

def _md5_and_sha256(path: Path) -> tuple[str, str, int]:
    md5, sha = hashlib.md5(usedforsecurity=False), hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            md5.update(chunk)
            sha.update(chunk)
            size += len(chunk)
    return md5.hexdigest(), sha.hexdigest(), size


def dvc_dir_entries(path: Path) -> list[dict]:
    """The `.dir` listing DVC builds: every file below `path` (walk order irrelevant: sorted by relpath)."""
    entries = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in files:
            full = Path(root) / name
            md5, _, size = _md5_and_sha256(full)
            entries.append({"md5": md5, "relpath": full.relative_to(path).as_posix(), "_size": size})
    return sorted(entries, key=lambda e: e["relpath"])


def dvc_hash(path: str | os.PathLike) -> dict[str, Any]:
    """{"md5", "size", ["nfiles"], ["sha256"]} exactly as dvc.lock records md5/size/nfiles."""
    p = Path(path)
    if p.is_dir():
        entries = dvc_dir_entries(p)
        listing = [{"md5": e["md5"], "relpath": e["relpath"]} for e in entries]
        blob = json.dumps(listing, sort_keys=True).encode("utf-8")
        return {"kind": "dir", "md5": hashlib.md5(blob, usedforsecurity=False).hexdigest() + ".dir",
                "size": sum(e["_size"] for e in entries), "nfiles": len(entries)}
    if p.is_file():
        md5, sha, size = _md5_and_sha256(p)
        return {"kind": "file", "md5": md5, "sha256": sha, "size": size}
    raise ReportError(f"{path}: artifact does not exist")


# --------------------------------------------------------------------------------------------------
# Inputs: relative paths only (the bundle and its manifest must not carry machine paths)
# --------------------------------------------------------------------------------------------------

def relative_artifact_path(path: str) -> str:
    p = PurePosixPath(Path(path).as_posix())
    if p.is_absolute() or Path(path).is_absolute() or ".." in p.parts or not p.parts:
        raise ReportError(f"{path}: artifact paths must be relative to the repository root, without '..'")
    return p.as_posix()


def parse_labeled(values: list[str], flag: str) -> dict[str, str]:
    out = {}
    for v in values:
        label, sep, path = v.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", label) or not path:
            raise ReportError(f"{flag} {v!r}: expected LABEL=PATH (label of letters, digits, _ . -)")
        if label in out:
            raise ReportError(f"{flag}: label {label!r} given twice")
        out[label] = path
    return out


# --------------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------------

def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def gpu_of_this_process() -> list[dict] | None:
    """GPU names and driver from nvidia-smi when there is one (torch is not imported for this)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = []
    for line in out.strip().splitlines():
        name, _, driver = line.rpartition(",")
        gpus.append({"name": name.strip(), "driver": driver.strip()})
    return gpus or None


def environment_from_run_info(run_info: dict) -> dict[str, Any]:
    found: dict[str, Any] = {}
    sources = [run_info] + [run_info[s] for s in ENV_SECTIONS if isinstance(run_info.get(s), dict)]
    for src in sources:
        for key in sorted(RUN_INFO_ENV_KEYS & set(src)):
            v = src[key]
            if isinstance(v, (str, int, float, bool)) or v is None or (
                    isinstance(v, list) and all(isinstance(x, (str, int, float, bool)) for x in v)):
                found[key] = v
    return found


def build_environment(run_infos: dict[str, dict]) -> dict[str, Any]:
    return {
        "report_process": {
            "python": platform.python_version(),
            "implementation": platform.python_implementation(),
            "packages": {name: _package_version(name) for name in ENV_PACKAGES},
            "gpus": gpu_of_this_process(),
        },
        "training": {label: environment_from_run_info(info) for label, info in sorted(run_infos.items())},
    }


# --------------------------------------------------------------------------------------------------
# Training curves (PNG, byte-stable)
# --------------------------------------------------------------------------------------------------

def read_train_log(path: str | os.PathLike) -> dict[str, list[float]]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or "step" not in reader.fieldnames:
            raise ReportError(f"{path}: train log needs a 'step' column (header: {reader.fieldnames})")
        cols: dict[str, list[float]] = {c: [] for c in reader.fieldnames}
        for lineno, row in enumerate(reader, start=2):
            for c in reader.fieldnames:
                v = row.get(c)
                try:
                    cols[c].append(float(v) if v not in (None, "") else float("nan"))
                except ValueError:
                    if c in CURVE_COLUMNS or c == "step":
                        raise ReportError(f"{path} line {lineno}: column {c!r} is not a number: {v!r}") from None
                    cols[c].append(float("nan"))
    return cols


def render_curves_png(label: str, cols: dict[str, list[float]]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    present = [c for c in CURVE_COLUMNS if c in cols]
    with matplotlib.rc_context({"svg.hashsalt": "prefpipe", "figure.dpi": 100, "font.size": 9}):
        ncols = 3
        nrows = max(1, -(-len(present) // ncols))
        fig = Figure(figsize=(4 * ncols, 3 * nrows))
        FigureCanvasAgg(fig)
        for k, c in enumerate(present):
            ax = fig.add_subplot(nrows, ncols, k + 1)
            ax.plot(cols["step"], cols[c], linewidth=1.2)
            ax.set_title(c)
            ax.set_xlabel("step")
            ax.grid(True, alpha=0.3)
        fig.suptitle(f"{label} training")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


# --------------------------------------------------------------------------------------------------
# Summary markdown
# --------------------------------------------------------------------------------------------------

def _f(x: float) -> str:
    return f"{x:.4f}"


def render_summary(metrics: dict[str, dict], bootstrap: dict | None, curves: list[str], params: dict) -> str:
    ev = params["evaluate"]
    lines = ["# Evidence summary", ""]
    if bootstrap is not None:
        lines += [f"Probe: {params['probe']['size']} pairs, probe digest `{bootstrap.get('probe_digest')}`.",
                  f"Paired percentile bootstrap: {bootstrap.get('replicates')} replicates, seed {bootstrap.get('seed')}, "
                  f"numpy {bootstrap.get('numpy_version')}, {int(round(ev['confidence'] * 100))}% intervals.", ""]
    lines += ["| model | step-0 accuracy | final accuracy [CI] | improvement [CI] | training helped | "
              "ties step-0 / final | mean margin step-0 -> final |",
              "|---|---|---|---|---|---|---|"]
    for label, m in sorted(metrics.items()):
        s0, fi, imp = m["step0"], m["final"], m["improvement"]
        helped = "yes" if imp["accuracy_ci_low"] > 0 else "no"
        lines.append(
            f"| {label} | {_f(s0['accuracy'])} | {_f(fi['accuracy'])} [{_f(fi['accuracy_ci_low'])}, "
            f"{_f(fi['accuracy_ci_high'])}] | {_f(imp['accuracy'])} [{_f(imp['accuracy_ci_low'])}, "
            f"{_f(imp['accuracy_ci_high'])}] | {helped} | {s0['ties']} / {fi['ties']} | "
            f"{_f(s0['mean_margin'])} -> {_f(fi['mean_margin'])} |")
    lines += ["", "Accuracy counts a tie as 0.5; for DPO it is the implicit reward accuracy. "
              "Training helped when the improvement's lower bound is above 0.", ""]
    if curves:
        lines += ["## Training curves", ""]
        for name in curves:
            lines += [f"![{name}](curves/{name})", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Leak scan and the deterministic tar.gz
# --------------------------------------------------------------------------------------------------

CREDENTIAL_PATTERNS = {
    "huggingface token": rb"hf_[A-Za-z0-9]{30,}",
    "github token": rb"gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{30,}",
    "aws access key": rb"(?:AKIA|ASIA)[0-9A-Z]{16}",
    "private key": rb"-----BEGIN [A-Z ]*PRIVATE KEY-----",
    "openai-style key": rb"sk-[A-Za-z0-9_-]{20,}",
    "slack token": rb"xox[abprs]-[A-Za-z0-9-]{10,}",
    "secret assignment": rb"(?i)(?:api[_-]?key|secret[_-]?key|client[_-]?secret|password|passwd|access[_-]?token|"
                         rb"auth[_-]?token)['\"]?\s*[=:]\s*['\"]?[A-Za-z0-9_\-/+]{16,}",
}


def leak_needles(cwd: str | os.PathLike | None = None) -> dict[str, bytes]:
    """Machine-specific strings that must not appear in a bundle (short/trivial ones are skipped,
    since they would match innocently, e.g. HOME=/)."""
    cwd = Path(cwd or os.getcwd())
    needles = {"hostname": socket.gethostname(), "absolute repository path": str(cwd.resolve()),
               "absolute repository path (as given)": str(cwd.absolute()), "$HOME": os.environ.get("HOME", "")}
    return {k: v.encode() for k, v in needles.items() if len(v) >= 4 and v not in ("localhost", "/tmp")}


def scan_member(name: str, data: bytes, needles: dict[str, bytes]) -> None:
    for what, needle in needles.items():
        if needle in data:
            raise LeakError(f"bundle member {name} contains the {what}; refusing to write the evidence bundle")
    for what, pattern in CREDENTIAL_PATTERNS.items():
        if re.search(pattern, data):
            raise LeakError(f"bundle member {name} contains what looks like a {what}; refusing to write the bundle")


def deterministic_targz(members: dict[str, bytes]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in sorted(members):
            data = members[name]
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = FIXED_MTIME
            info.mode = 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.type = tarfile.REGTYPE
            tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=FIXED_MTIME, compresslevel=9) as gz:
        gz.write(raw.getvalue())
    return out.getvalue()


# --------------------------------------------------------------------------------------------------
# Assemble
# --------------------------------------------------------------------------------------------------

def build_bundle(params_path: str, artifacts: list[str], metrics: list[str], per_pair: list[str],
                 bootstrap_summary: str | None, train_logs: dict[str, str], run_infos: dict[str, str],
                 cwd: str | os.PathLike | None = None) -> tuple[dict[str, bytes], str, dict[str, bytes]]:
    """-> (bundle members by name, summary markdown, curve PNGs by file name)."""
    params = load_params(params_path)
    packed: dict[str, str] = {}  # relpath -> role
    for role, paths in (("metrics", metrics), ("per_pair", per_pair),
                        ("bootstrap_summary", [bootstrap_summary] if bootstrap_summary else []),
                        ("train_log", list(train_logs.values()))):
        for p in paths:
            rel = relative_artifact_path(p)
            if Path(rel).suffix not in PACKABLE_SUFFIXES:
                raise ReportError(f"{p}: only {sorted(PACKABLE_SUFFIXES)} files are packed into the bundle")
            if not Path(p).is_file():
                raise ReportError(f"{p}: {role} file does not exist")
            packed[rel] = role
    hashed_only = {relative_artifact_path(p): "artifact" for p in artifacts}
    hashed_only.update({relative_artifact_path(p): "run_info" for p in run_infos.values()})

    entries = []
    for rel in sorted(set(packed) | set(hashed_only)):
        h = dvc_hash(rel if cwd is None else Path(cwd) / rel)
        entries.append({"path": rel, "role": packed.get(rel) or hashed_only[rel], "packed": rel in packed, **h})

    members: dict[str, bytes] = {}
    for rel in packed:
        members[f"{BUNDLE_ROOT}/artifacts/{rel}"] = _read(rel, cwd)
    members[f"{BUNDLE_ROOT}/params.yaml"] = _read(params_path, cwd)

    run_info_data = {}
    for label, p in run_infos.items():
        try:
            run_info_data[label] = json.loads(_read(p, cwd))
        except json.JSONDecodeError as e:
            raise ReportError(f"{p}: run_info is not JSON: {e}") from None
    members[f"{BUNDLE_ROOT}/environment.json"] = _json_bytes(build_environment(run_info_data))

    curves: dict[str, bytes] = {}
    for label, p in sorted(train_logs.items()):
        curves[f"{label}_train_curves.png"] = render_curves_png(label, read_train_log(_path(p, cwd)))
    for name, png in curves.items():
        members[f"{BUNDLE_ROOT}/curves/{name}"] = png

    metrics_by_label = {Path(p).stem: json.loads(_read(p, cwd)) for p in metrics}
    boot = json.loads(_read(bootstrap_summary, cwd)) if bootstrap_summary else None
    summary = render_summary(metrics_by_label, boot, sorted(curves), params)
    members[f"{BUNDLE_ROOT}/summary.md"] = summary.encode("utf-8")

    manifest = {
        "format": "prefpipe-evidence/1",
        "hashes": "md5 as in dvc.lock (directories: md5 of DVC's .dir listing + '.dir'); sha256 for files",
        "artifacts": entries,
        "params_sha256": hashlib.sha256(members[f"{BUNDLE_ROOT}/params.yaml"]).hexdigest(),
        "members": {name: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
                    for name, data in sorted(members.items())},
    }
    members[f"{BUNDLE_ROOT}/manifest.json"] = _json_bytes(manifest)

    needles = leak_needles(cwd)
    for name, data in sorted(members.items()):
        scan_member(name, data, needles)
    return members, summary, curves


def _path(p: str, cwd) -> Path:
    return Path(p) if cwd is None else Path(cwd) / p


def _read(p: str, cwd) -> bytes:
    return _path(p, cwd).read_bytes()


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    try:
        return _run(argv)
    except ReportError as e:
        logging.getLogger("report").error("refused: %s", e)
        raise SystemExit(f"report: refused: {e}") from None


def _run(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", required=True)
    ap.add_argument("--artifacts", nargs="*", default=[], help="pipeline artifacts (files or dirs) hashed, not packed")
    ap.add_argument("--metrics", nargs="*", default=[], help="metrics JSON (label = file stem), packed")
    ap.add_argument("--per-pair", nargs="*", default=[], help="per-pair probe JSONL, packed")
    ap.add_argument("--bootstrap-summary", help="evaluate's bootstrap_summary.json, packed")
    ap.add_argument("--train-log", nargs="*", default=[], metavar="LABEL=CSV", help="train logs, packed and plotted")
    ap.add_argument("--run-info", nargs="*", default=[], metavar="LABEL=JSON",
                    help="trainer run_info.json: hashed; whitelisted environment keys copied")
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--summary", required=True)
    ap.add_argument("--curves-dir", help="also write the curve PNGs here (the summary links curves/<name>.png)")
    ap.add_argument("--log")
    args = ap.parse_args(argv)
    log = setup_logging(args.log, "report")

    members, summary, curves = build_bundle(
        args.params, args.artifacts, args.metrics, args.per_pair, args.bootstrap_summary,
        parse_labeled(args.train_log, "--train-log"), parse_labeled(args.run_info, "--run-info"))
    with atomic_path(args.bundle) as tmp:
        tmp.write_bytes(deterministic_targz(members))
    write_text(args.summary, summary)
    if args.curves_dir:
        for name, png in curves.items():
            with atomic_path(Path(args.curves_dir) / name) as tmp:
                tmp.write_bytes(png)
    log.info("evidence bundle %s: %d members, %d artifacts hashed", args.bundle, len(members),
             len(json.loads(members[f"{BUNDLE_ROOT}/manifest.json"])["artifacts"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
