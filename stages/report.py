"""Report: a deterministic evidence bundle (tar.gz) and a short markdown summary.

    python -m stages.report --params params.yaml \
        --artifacts results/normalize/pairs.parquet ... results/train_dpo/model results/train_rm/model \
        --metrics metrics/dpo.json metrics/rm.json \
        --per-pair results/train_dpo/probe_step0.jsonl results/train_dpo/probe_final.jsonl \
                   results/train_rm/probe_step0.jsonl results/train_rm/probe_final.jsonl \
        --bootstrap-summary results/evaluate/bootstrap_summary.json \
        --train-log dpo=results/train_dpo/train_log.csv rm=results/train_rm/train_log.csv \
        --run-info dpo=results/train_dpo/run_info.json rm=results/train_rm/run_info.json \
        --environment results/env/environment.json \
        --probe-manifests results/probe/probe_manifest.json results/tokens/probe_token_manifest.json \
        --bundle results/report/evidence.tar.gz --summary results/report/summary.md \
        --curves-dir results/report/curves --log logs/report.log

    python -m stages.report verify results/report/evidence.tar.gz [--workspace DIR] [--require-same-environment]

Bundle layout (every member under `evidence/`):
  manifest.json        every artifact's hash (DVC's md5, equal to dvc.lock's, and sha256 for files),
                       plus the sha256 of every other member of the bundle
  environment.json     the environment record (results/env/environment.json: versions, CPU dispatch, GPU
                       for GPU runs) and each training run's layout and record (from run_info.json)
  params.yaml          the params file, byte for byte
  summary.md           the metrics table and the curves
  curves/<label>_train_curves.png
  artifacts/<path>     metrics, per-pair JSONL, the bootstrap summary, the train logs, the environment
                       record and the two probe manifests, under their repo-relative paths
`--artifacts` are hashed only (weights, optimizer state and data never enter the bundle).

Deterministic: members sorted, mtime 0, uid/gid 0, empty owner names, mode 0644, gzip mtime 0 and no
file name in the gzip header, PNGs rendered by Agg with no metadata. Before anything is written,
every member is scanned for this machine's hostname, the absolute working directory, $HOME and common
credential patterns; a hit refuses the bundle (naming the member and what leaked).
`verify` is for a reviewer holding someone else's bundle: it re-hashes every member and packed artifact
against the manifest, the hashed-only artifacts (models, data) against --workspace when it holds them and
against its dvc.lock, reruns evaluate's checks, metrics and paired bootstrap on the packed per-pair rows,
and compares the environment record with this machine's. It prints MATCH / DIFFERS / SKIPPED per check
(ENV-DIFF for the environment) and exits 1 on any DIFFERS (and on ENV-DIFF with --require-same-environment).
"""
from __future__ import annotations

import logging
import csv
import gzip
import io
import json
import math
import os
import re
import socket
import tarfile
from pathlib import Path, PurePosixPath
from typing import Any

from stages.lib.cli import stage_main
from stages.lib.io import MD5, SHA256, atomic_path, hash_bytes, hash_file, sha256_bytes, write_text
from stages.lib.params import ParamsError, load_params

BUNDLE_ROOT = "evidence"
FIXED_MTIME = 0
PACKABLE_SUFFIXES = {".json", ".jsonl", ".csv"}
CURVE_COLUMNS = ["loss", "accuracy", "margin", "lr", "grad_norm"]
# Keys copied from a trainer's run_info.json (top level). A whitelist, because run_info also holds
# per-rank plans and settings that belong to the run, not to the environment.
RUN_INFO_ENV_KEYS = {"world_size", "backend", "device", "parallel", "attention"}


class ReportError(ValueError):
    """An input cannot go into the evidence bundle; the message names it and why."""


class LeakError(ReportError):
    """A bundle member contains a hostname, an absolute path, $HOME or a credential."""


# --------------------------------------------------------------------------------------------------
# DVC 3 hashes (dvc_data.hashfile): md5 of the bytes for a file; for a directory the md5 of its
# `.dir` listing, json.dumps(sorted([{"md5": ..., "relpath": ...}]), sort_keys=True), plus ".dir".
# --------------------------------------------------------------------------------------------------

# Hashing is most of report's time on a real run: the two exported models are GBs (2 x 2 GB at the 0.5B
# shape), and md5 runs at ~0.6 GB/s on one core. So: a directory's files get md5 only (the .dir listing needs
# nothing else; sha256 is recorded for single files), and every file is hashed in a thread pool (hashlib
# releases the GIL on large updates), biggest first. The digests, hence the bundle's bytes, do not change.
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))


# Snakemake's mtime marker inside a directory() output: present when Snakemake built the directory, absent when
# `dvc repro` did. Not part of a directory's hash here, as not in DVC's (.dvcignore lists it).
SNAKEMAKE_DIR_MARKER = ".snakemake_timestamp"


def _dir_files(path: Path) -> list[Path]:
    out = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        out += [Path(root) / name for name in files if name != SNAKEMAKE_DIR_MARKER]
    return out


def hash_files(jobs: dict[Path, tuple[str, ...]]) -> dict[Path, tuple[int, dict[str, str]]]:
    """{file: algos} -> {file: (size, {algo: hex digest})}, hashed in parallel threads."""
    from concurrent.futures import ThreadPoolExecutor
    order = sorted(jobs, key=lambda f: (-f.stat().st_size, str(f)))     # biggest first: the pool ends together
    if len(order) <= 1 or HASH_THREADS == 1:
        return {f: hash_file(f, jobs[f]) for f in order}
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        return dict(zip(order, pool.map(lambda f: hash_file(f, jobs[f]), order)))


def dvc_hashes(paths: list[Path]) -> list[dict[str, Any]]:
    """dvc_hash of each path, all their files hashed in one thread pool."""
    jobs: dict[Path, tuple[str, ...]] = {}
    for p in paths:
        if p.is_dir():
            jobs.update(dict.fromkeys(_dir_files(p), (MD5,)))
        elif p.is_file():
            jobs[p] = (MD5, SHA256)
    digests = hash_files(jobs)
    return [dvc_hash(p, digests) for p in paths]


def dvc_dir_entries(path: Path, digests: dict | None = None) -> list[dict]:
    """The `.dir` listing DVC builds: every file below `path` (walk order irrelevant: sorted by relpath)."""
    files = _dir_files(path)
    digests = digests if digests is not None else hash_files(dict.fromkeys(files, (MD5,)))
    entries = []
    for full in files:
        size, d = digests[full]
        entries.append({"md5": d[MD5], "relpath": full.relative_to(path).as_posix(), "_size": size})
    return sorted(entries, key=lambda e: e["relpath"])


def dvc_hash(path: str | os.PathLike, digests: dict | None = None) -> dict[str, Any]:
    """{"md5", "size", ["nfiles"], ["sha256"]} exactly as dvc.lock records md5/size/nfiles. `digests`: files
    already hashed (dvc_hashes), else hashed here."""
    p = Path(path)
    if p.is_dir():
        entries = dvc_dir_entries(p, digests)
        listing = [{"md5": e["md5"], "relpath": e["relpath"]} for e in entries]
        blob = json.dumps(listing, sort_keys=True).encode("utf-8")
        return {"kind": "dir", "md5": hash_bytes(blob, MD5) + ".dir",
                "size": sum(e["_size"] for e in entries), "nfiles": len(entries)}
    if p.is_file():
        size, d = digests[p] if digests is not None and p in digests else hash_file(p, (MD5, SHA256))
        return {"kind": "file", "md5": d[MD5], "sha256": d[SHA256], "size": size}
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

def environment_from_run_info(run_info: dict) -> dict[str, Any]:
    """The run's layout (whitelisted keys) and the environment record it trained under."""
    found: dict[str, Any] = {key: run_info[key] for key in sorted(RUN_INFO_ENV_KEYS & set(run_info))}
    if isinstance(run_info.get("environment"), dict):
        found["record"] = run_info["environment"]
    return found


def build_environment(record: dict | None, run_infos: dict[str, dict]) -> dict[str, Any]:
    """The bundle's environment.json: the pipeline's environment record (the environment stage's
    output, an input of every stage) and each training run's. Only facts that decide the numbers: no
    hostnames, drivers or timings, so the same run on another machine of the same kind packs the same bytes."""
    return {
        "record": record,
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
                 cwd: str | os.PathLike | None = None, environment: str | None = None,
                 probe_manifests: list[str] | None = None) -> tuple[dict[str, bytes], str, dict[str, bytes]]:
    """-> (bundle members by name, summary markdown, curve PNGs by file name)."""
    params = load_params(params_path if cwd is None else Path(cwd) / params_path)
    packed: dict[str, str] = {}  # relpath -> role
    for role, paths in (("metrics", metrics), ("per_pair", per_pair),
                        ("bootstrap_summary", [bootstrap_summary] if bootstrap_summary else []),
                        ("train_log", list(train_logs.values())),
                        ("environment", [environment] if environment else []),
                        # The probe's two manifests let `verify` rerun evaluate's checks on the per-pair rows.
                        ("probe_manifest", list(probe_manifests or []))):
        for p in paths:
            rel = relative_artifact_path(p)
            if Path(rel).suffix not in PACKABLE_SUFFIXES:
                raise ReportError(f"{p}: only {sorted(PACKABLE_SUFFIXES)} files are packed into the bundle")
            if not _path(p, cwd).is_file():
                raise ReportError(f"{p}: {role} file does not exist")
            packed[rel] = role
    hashed_only = {relative_artifact_path(p): "artifact" for p in artifacts}
    hashed_only.update({relative_artifact_path(p): "run_info" for p in run_infos.values()})

    rels = sorted(set(packed) | set(hashed_only))
    for rel in rels:    # refused before any hashing, as dvc_hash would refuse it one by one
        if not _path(rel, cwd).exists():
            raise ReportError(f"{rel}: artifact does not exist")
    # Hash in background threads while the curves render (matplotlib holds the GIL; hashlib mostly not).
    from concurrent.futures import ThreadPoolExecutor
    background = ThreadPoolExecutor(max_workers=1)
    hashing = background.submit(dvc_hashes, [_path(rel, cwd) for rel in rels])
    try:
        members, curves = _members_and_curves(params_path, packed, run_infos, environment, train_logs, cwd)
        hashes = hashing.result()
    finally:
        background.shutdown(wait=True)
    entries = [{"path": rel, "role": packed.get(rel) or hashed_only[rel], "packed": rel in packed, **h}
               for rel, h in zip(rels, hashes)]
    metrics_by_label = {Path(p).stem: json.loads(_read(p, cwd)) for p in metrics}
    boot = json.loads(_read(bootstrap_summary, cwd)) if bootstrap_summary else None
    summary = render_summary(metrics_by_label, boot, sorted(curves), params)
    members[f"{BUNDLE_ROOT}/summary.md"] = summary.encode("utf-8")

    manifest = {
        "format": "prefpipe-evidence/1",
        "evaluation": evaluation_map(sorted(packed)),
        "hashes": "md5 as in dvc.lock (directories: md5 of DVC's .dir listing + '.dir'); sha256 for files",
        "artifacts": entries,
        "params_sha256": sha256_bytes(members[f"{BUNDLE_ROOT}/params.yaml"]),
        "members": {name: {"sha256": sha256_bytes(data), "size": len(data)}
                    for name, data in sorted(members.items())},
    }
    members[f"{BUNDLE_ROOT}/manifest.json"] = _json_bytes(manifest)

    needles = leak_needles(cwd)
    for name, data in sorted(members.items()):
        scan_member(name, data, needles)
    return members, summary, curves


def _members_and_curves(params_path: str, packed: dict[str, str], run_infos: dict[str, str], environment: str | None,
                        train_logs: dict[str, str], cwd) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """build_bundle's members before the summary and manifest: packed files, params, environment, curves."""
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
    record = json.loads(_read(environment, cwd)) if environment else None
    members[f"{BUNDLE_ROOT}/environment.json"] = _json_bytes(build_environment(record, run_info_data))

    curves: dict[str, bytes] = {}
    for label, p in sorted(train_logs.items()):
        curves[f"{label}_train_curves.png"] = render_curves_png(label, read_train_log(_path(p, cwd)))
    for name, png in curves.items():
        members[f"{BUNDLE_ROOT}/curves/{name}"] = png
    return members, curves


PER_PAIR_NAME = re.compile(r"(?:^|/)train_(dpo|rm)/probe_(step0|final)\.jsonl$")
METRICS_NAME = re.compile(r"(?:^|/)(dpo|rm)\.json$")


def evaluation_map(packed_paths: list[str]) -> dict[str, dict[str, str]]:
    """Which packed files `verify` recomputes each model's metrics from: {kind: {step0, final, metrics}}."""
    out: dict[str, dict[str, str]] = {}
    for rel in packed_paths:
        if m := PER_PAIR_NAME.search(rel):
            out.setdefault(m.group(1), {})[m.group(2)] = rel
        elif rel.startswith("metrics/") and (m := METRICS_NAME.search(rel)):
            out.setdefault(m.group(1), {})["metrics"] = rel
    for rel in packed_paths:
        if rel.endswith("/probe_manifest.json"):
            out.setdefault("probe", {})["probe_manifest"] = rel
        elif rel.endswith("/probe_token_manifest.json"):
            out.setdefault("probe", {})["probe_token_manifest"] = rel
        elif rel.endswith("/bootstrap_summary.json"):
            out.setdefault("probe", {})["bootstrap_summary"] = rel
    return out


def _path(p: str, cwd) -> Path:
    return Path(p) if cwd is None else Path(cwd) / p


def _read(p: str, cwd) -> bytes:
    return _path(p, cwd).read_bytes()


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


# --------------------------------------------------------------------------------------------------
# Verify: a stranger checks someone else's bundle
# --------------------------------------------------------------------------------------------------

FLOAT_REL_TOL = 1e-9     # recomputed float64 metrics: same numpy reduction order, only last-bit slack
MEMBER_PREFIX = f"{BUNDLE_ROOT}/"


class Verdicts:
    """Each check's outcome, printed as `MATCH|DIFFERS|SKIPPED  what: detail`."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []

    def add(self, ok: bool | None, what: str, detail: str = "") -> None:
        self.rows.append(("SKIPPED" if ok is None else "MATCH" if ok else "DIFFERS", what, detail))

    @property
    def failed(self) -> list[tuple[str, str, str]]:
        return [r for r in self.rows if r[0] == "DIFFERS"]

    def lines(self) -> list[str]:
        return [f"{status:<8} {what}" + (f": {detail}" if detail else "") for status, what, detail in self.rows]


def read_bundle(path: str | os.PathLike) -> dict[str, bytes]:
    """Every member of an evidence tar.gz, by name; refuses links, directories and names outside evidence/."""
    members: dict[str, bytes] = {}
    try:
        with tarfile.open(path, mode="r:gz") as tar:
            for info in tar.getmembers():
                name = info.name
                if not info.isreg():
                    raise ReportError(f"{path}: member {name} is not a regular file")
                if not name.startswith(MEMBER_PREFIX) or ".." in PurePosixPath(name).parts:
                    raise ReportError(f"{path}: member {name} is outside {MEMBER_PREFIX}")
                if name in members:
                    raise ReportError(f"{path}: member {name} appears twice")
                members[name] = tar.extractfile(info).read()
    except (tarfile.TarError, OSError, EOFError) as e:
        raise ReportError(f"{path}: not a readable evidence bundle: {e}") from None
    return members


def _numbers_agree(a: Any, b: Any, where: str, out: list[str], skip=("distribution_sha256",)) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k in skip:
                continue
            if k not in a or k not in b:
                out.append(f"{where}.{k}: {'missing in the bundle' if k not in a else 'not recomputed'}")
            else:
                _numbers_agree(a[k], b[k], f"{where}.{k}", out, skip)
    elif isinstance(a, float) or isinstance(b, float):
        ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and \
            math.isclose(a, b, rel_tol=FLOAT_REL_TOL, abs_tol=1e-12)
        if not ok:
            out.append(f"{where}: bundle {a!r}, recomputed {b!r}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _numbers_agree(x, y, f"{where}[{i}]", out, skip)
    elif a != b:
        out.append(f"{where}: bundle {a!r}, recomputed {b!r}")


def _lock_outs(workspace: Path) -> dict[str, str]:
    """{path: md5} of every out/metric/plot recorded in the workspace's dvc.lock."""
    import yaml
    lock = workspace / "dvc.lock"
    if not lock.is_file():
        return {}
    doc = yaml.safe_load(lock.read_text(encoding="utf-8")) or {}
    out = {}
    for stage in (doc.get("stages") or {}).values():
        for o in stage.get("outs", []) or []:
            if "md5" in o:
                out[o["path"]] = o["md5"]
    return out


def verify_bundle(bundle: str | os.PathLike, workspace: str | os.PathLike | None = None) -> Verdicts:
    """Recompute what a bundle claims: member hashes, artifact hashes (packed ones from the bundle, the
    others from `workspace` when it holds them, and against its dvc.lock), the metrics and bootstrap bounds
    from the per-pair rows, and the environment against this process's."""
    from stages.lib import scoring
    from stages.lib.contracts import PROBE_MANIFEST_SCHEMA, PROBE_TOKEN_MANIFEST_SCHEMA, shape_problem
    from stages.lib.environment import compare_records, environment_record

    v = Verdicts()
    members = read_bundle(bundle)
    manifest_name = f"{BUNDLE_ROOT}/manifest.json"
    if manifest_name not in members:
        v.add(False, manifest_name, "missing")
        return v
    try:
        manifest = json.loads(members[manifest_name])
    except json.JSONDecodeError as e:
        v.add(False, manifest_name, f"not JSON: {e}")
        return v

    # 1. members: every one listed, with its sha256; nothing extra
    listed = manifest.get("members", {})
    for name in sorted(set(listed) | set(members) - {manifest_name}):
        if name not in members:
            v.add(False, name, "listed in the manifest, missing from the bundle")
        elif name not in listed:
            v.add(False, name, "in the bundle, not listed in the manifest")
        else:
            got = sha256_bytes(members[name])
            v.add(got == listed[name]["sha256"] and len(members[name]) == listed[name]["size"], name,
                  f"sha256 {got[:16]}…" if got == listed[name]["sha256"] else
                  f"sha256 {got} != manifest {listed[name]['sha256']}")
    params_bytes = members.get(f"{BUNDLE_ROOT}/params.yaml", b"")
    v.add(sha256_bytes(params_bytes) == manifest.get("params_sha256"), f"{BUNDLE_ROOT}/params.yaml",
          "params_sha256 of the manifest")

    # 2. artifacts
    ws = Path(workspace) if workspace is not None else None
    lock_md5 = _lock_outs(ws) if ws is not None else {}
    for e in manifest.get("artifacts", []):
        rel = e["path"]
        if e.get("packed"):
            data = members.get(f"{BUNDLE_ROOT}/artifacts/{rel}")
            if data is None:
                v.add(False, rel, "packed artifact missing from the bundle")
                continue
            md5, sha = hash_bytes(data, MD5), sha256_bytes(data)
            ok = md5 == e.get("md5") and sha == e.get("sha256") and len(data) == e.get("size")
            v.add(ok, rel, f"md5 {md5}" if ok else f"md5 {md5} / sha256 {sha} != manifest {e.get('md5')} / "
                  f"{e.get('sha256')}")
        elif ws is not None and (ws / rel).exists():
            got = dvc_hash(ws / rel)
            v.add(got["md5"] == e.get("md5"), rel, f"workspace md5 {got['md5']}" + (
                "" if got["md5"] == e.get("md5") else f" != manifest {e.get('md5')}"))
        else:
            v.add(None, rel, "hashed only, not in the workspace: not checked")
        if rel in lock_md5:
            v.add(lock_md5[rel] == e.get("md5"), f"{rel} (dvc.lock)",
                  f"dvc.lock md5 {lock_md5[rel]}" + ("" if lock_md5[rel] == e.get("md5") else
                                                     f" != manifest {e.get('md5')}"))

    # 3. metrics and bootstrap bounds, recomputed from the per-pair rows by evaluate's own code
    import yaml
    params = yaml.safe_load(params_bytes) if params_bytes else {}
    ev_map = manifest.get("evaluation", {})
    probe = ev_map.get("probe", {})

    def packed_json(rel: str | None):
        return json.loads(members[f"{BUNDLE_ROOT}/artifacts/{rel}"]) if rel and \
            f"{BUNDLE_ROOT}/artifacts/{rel}" in members else None

    pm, tm = packed_json(probe.get("probe_manifest")), packed_json(probe.get("probe_token_manifest"))
    boot = packed_json(probe.get("bootstrap_summary"))
    misshapen = False
    for rel, obj, schema, what in ((probe.get("probe_manifest"), pm, PROBE_MANIFEST_SCHEMA, "probe manifest"),
                                   (probe.get("probe_token_manifest"), tm, PROBE_TOKEN_MANIFEST_SCHEMA,
                                    "probe token manifest")):
        if obj is not None and (problem := shape_problem(obj, schema)) is not None:
            v.add(False, rel, f"not a valid {what} ({problem})")
            misshapen = True
    for kind in ("dpo", "rm"):
        files = ev_map.get(kind, {})
        if misshapen:
            continue
        if pm is None or tm is None or not {"step0", "final", "metrics"} <= set(files):
            v.add(None, f"metrics ({kind})", "the bundle lacks the per-pair files or probe manifests to recompute")
            continue
        rows = {}
        for which in ("step0", "final"):
            text = members[f"{BUNDLE_ROOT}/artifacts/{files[which]}"].decode("utf-8")
            rows[which] = [json.loads(line) for line in text.splitlines() if line.strip()]
        try:
            metrics, summary = scoring.evaluate_model(kind, rows["step0"], rows["final"], pm, tm, params,
                                                       files["step0"], files["final"])
        except (scoring.ProbeMismatchError, scoring.PerPairFileError, KeyError, ValueError) as e:
            v.add(False, f"metrics ({kind})", f"per-pair rows refused by evaluate: {e}")
            continue
        diffs: list[str] = []
        _numbers_agree(packed_json(files["metrics"]), metrics, files["metrics"], diffs)
        v.add(not diffs, files["metrics"], "recomputed from " + ", ".join((files["step0"], files["final"]))
              if not diffs else "; ".join(diffs[:5]))
        if boot is not None:
            diffs = []
            _numbers_agree((boot.get("models") or {}).get(kind), summary, f"bootstrap_summary.models.{kind}", diffs)
            v.add(not diffs, f"{probe['bootstrap_summary']} ({kind})",
                  "bootstrap bounds recomputed" if not diffs else "; ".join(diffs[:5]))

    # 4. environment: the bundle's record against this process's (informational unless asked to require it)
    env_json = members.get(f"{BUNDLE_ROOT}/environment.json")
    record = (json.loads(env_json) or {}).get("record") if env_json else None
    if record is None or "train" not in params:
        v.add(None, "environment", "the bundle carries no environment record")
    else:
        here = environment_record(params["train"])
        diffs = compare_records({k: val for k, val in record.items() if k in here}, here)
        v.rows.append(("MATCH" if not diffs else "ENV-DIFF", "environment",
                       "same as this machine's" if not diffs else "; ".join(diffs)))
    return v


def _verify_arguments(ap) -> None:
    ap.add_argument("bundle", help="evidence.tar.gz")
    ap.add_argument("--workspace", default=".", help="a checkout holding the run's artifacts and dvc.lock "
                    "(default: .); artifacts absent there are reported as not checked")
    ap.add_argument("--require-same-environment", action="store_true",
                    help="also fail when the bundle's environment record differs from this machine's")


VERIFY_HELP = ("Check an evidence bundle: member and artifact hashes, metrics and bootstrap bounds recomputed "
               "from the per-pair rows, environment compared.")


def verify_main(argv: list[str] | None) -> int:
    return stage_main(argv, "report", VERIFY_HELP, add_arguments=_verify_arguments, run=_verify,
                      params=None, log=False, prog="python -m stages.report verify")


def _verify(args) -> int:
    """A verdict, not a refusal: a bundle that cannot be read is a DIFFERS line on stdout, exit 1."""
    try:
        verdicts = verify_bundle(args.bundle, args.workspace)
    except ReportError as e:
        print(f"DIFFERS  {e}")
        return 1
    for line in verdicts.lines():
        print(line)
    env_diff = any(status == "ENV-DIFF" for status, _, _ in verdicts.rows)
    failed = verdicts.failed
    print(f"{args.bundle}: {sum(s == 'MATCH' for s, _, _ in verdicts.rows)} match, {len(failed)} differ, "
          f"{sum(s == 'SKIPPED' for s, _, _ in verdicts.rows)} not checked; environment "
          + ("differs from this machine's" if env_diff else "matches this machine's"))
    return 1 if failed or (env_diff and args.require_same_environment) else 0


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    import sys
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["verify"]:
        return verify_main(argv[1:])
    return stage_main(argv, "report", __doc__, add_arguments=_arguments, run=_run,
                      input_errors=(ReportError, ParamsError))


def _arguments(ap) -> None:
    ap.add_argument("--artifacts", nargs="*", default=[], help="pipeline artifacts (files or dirs) hashed, not packed")
    ap.add_argument("--metrics", nargs="*", default=[], help="metrics JSON (label = file stem), packed")
    ap.add_argument("--per-pair", nargs="*", default=[], help="per-pair probe JSONL, packed")
    ap.add_argument("--bootstrap-summary", help="evaluate's bootstrap_summary.json, packed")
    ap.add_argument("--train-log", nargs="*", default=[], metavar="LABEL=CSV", help="train logs, packed and plotted")
    ap.add_argument("--run-info", nargs="*", default=[], metavar="LABEL=JSON",
                    help="trainer run_info.json: hashed; whitelisted environment keys copied")
    ap.add_argument("--environment", help="the environment stage's environment.json: packed, and the bundle's "
                    "environment record")
    ap.add_argument("--probe-manifests", nargs="*", default=[],
                    help="probe_manifest.json and probe_token_manifest.json: packed, so `verify` can recompute")
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--summary", required=True)
    ap.add_argument("--curves-dir", help="also write the curve PNGs here (the summary links curves/<name>.png)")


def _run(args) -> int:
    log = logging.getLogger("report")
    members, summary, curves = build_bundle(
        args.params, args.artifacts, args.metrics, args.per_pair, args.bootstrap_summary,
        parse_labeled(args.train_log, "--train-log"), parse_labeled(args.run_info, "--run-info"),
        environment=args.environment, probe_manifests=args.probe_manifests)
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
