"""The evidence bundle's format: its hashes, its derived members and how it is packed, in one place.

`python -m stages.report` writes a bundle with these functions and `report verify` (stages/evidence/verify.py)
recomputes the derived members with the very same ones, then compares bytes: summary.md from the packed metrics,
bootstrap summary, train logs, run records and params; curves/*.png from the packed train logs; environment.json from the environment record
and the runs' run_info.json; the manifest's `evaluation` map from the packed paths.

Bundle layout (every member under `evidence/`):
  manifest.json        format, every artifact's hash (DVC's md5, equal to dvc.lock's, and sha256 for files), the
                       sha256 of every other member, `evaluation` (which packed files each model's metrics come
                       from), `curves` (which train log each PNG is drawn from) and `sources` (each data source
                       file by its hashes: the pin of what normalize read)
  environment.json     the environment record and each training run's layout, objective and settings
  params.yaml          the run's params.yaml, byte for byte but for absolute paths (see portable_path)
  summary.md           the metrics table, the generation section (stages/evidence/generation.py), what ran (sources,
                       tokenize, reference, training, per-source accuracy for mixtures: stages/evidence/records.py)
                       and the curves
  probe_sources.json   each probe pair's source, in probe order (the join per-source accuracy needs)
  curves/<label>_train_curves.png
  artifacts/<path>     metrics, per-pair JSONL, the bootstrap summary, the train logs, the environment record, the
                       two probe manifests, the judge's outputs and the run records (normalize_stats,
                       tokenize_report, ref_identity, run_info: absolute paths in them written portably), under their
                       repo-relative paths
"""
from __future__ import annotations

import copy
import csv
import gzip
import hashlib
import io
import json
import os
import re
import tarfile
import zlib
from pathlib import Path, PurePosixPath
from typing import Any

from stages.lib.implicit_reward import SUMMED_REWARD
from stages.lib.io import MD5, SHA256, hash_bytes, hash_file
from stages.lib.training_plan import plan_warnings

BUNDLE_ROOT = "evidence"
MEMBER_PREFIX = f"{BUNDLE_ROOT}/"
# 2: the manifest's `curves` and `sources`, environment.json's per-run objective and settings, absolute
# paths in params.yaml written portably. 3: the run records packed (an entry `portable: true` when their absolute
# paths were rewritten), probe_sources.json, summary.md's "What ran"; the generation evaluation (generate's and
# judge's artifacts, the judgments packed, summary.md's generation section). `verify` refuses a format it cannot
# fully check.
FORMAT = "prefpipe-evidence/4"   # 4: the packed records carry their `format` (stages/lib/record_formats.py)
FIXED_MTIME = 0
CURVE_COLUMNS = ["loss", "accuracy", "margin", "lr", "grad_norm"]
# Keys copied from a trainer's run_info.json (top level). A whitelist, because run_info also holds per-rank
# plans that belong to the run, and a trainer's record must never smuggle a timing or a path into the bundle.
# `objective` and `settings` (the run's `train` section as the trainer read it) let verify hold params.yaml to
# what the runs were trained with.
RUN_INFO_ENV_KEYS = {"world_size", "backend", "device", "parallel", "attention", "objective", "settings"}


class EvidenceError(ValueError):
    """An input cannot go into the evidence bundle, or a bundle cannot be read; the message names it and why."""


def json_bytes(obj: Any) -> bytes:
    """A JSON member of the bundle (indented, for a reader; sorted, for determinism)."""
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


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
    raise EvidenceError(f"{path}: artifact does not exist")


# --------------------------------------------------------------------------------------------------
# Paths in params.yaml: relative, or named portably with the manifest's pin
# --------------------------------------------------------------------------------------------------

# An absolute path names a place on one machine: in a bundle it would leak that machine's layout (a home
# directory, a user name) and mean nothing to a reviewer. The bundle writes it `external:<tail>`, the tail being
# the path below the last directory before any wildcard (`/data/hh/test.jsonl.gz` -> `external:test.jsonl.gz`,
# `/data/hh/*.parquet` -> `external:hh/*.parquet`), and the manifest's `sources` pins each file a data source
# named by its md5 and sha256 (a reference directory is pinned by ref.revision already). Relative paths stay as
# written: they name the place in the checkout, which is the same for everyone.
#
# The rewrite is a pure function of the path, so verify applies it to what dvc.lock recorded (the run's real
# paths) and still compares every params value exactly, paths included; params.yaml otherwise stays byte for
# byte, comments and all.
EXTERNAL = "external:"
_GLOB_MAGIC = re.compile(r"[*?[]")


def _anchor(path: PurePosixPath) -> PurePosixPath:
    """The directory an absolute path's portable tail is taken below (see above)."""
    parts = path.parts
    cut = next((i for i, part in enumerate(parts) if _GLOB_MAGIC.search(part)), len(parts))
    kept = PurePosixPath(*parts[:cut])
    return kept.parent


def portable_path(path: str, source: str | None = None) -> str:
    """`path` as a bundle writes it: relative as written; absolute as `external:<tail>` below the anchor of
    `source` (the data source a file was found through; default the path itself)."""
    p = PurePosixPath(path.replace("\\", "/"))
    if not p.is_absolute():
        return path
    anchor = _anchor(PurePosixPath((source or path).replace("\\", "/")))
    try:
        tail = p.relative_to(anchor)
    except ValueError:          # not below its source's anchor (not one of its files): the name alone
        tail = PurePosixPath(p.name)
    return EXTERNAL + tail.as_posix()


def portable_params(params: dict) -> dict:
    """params with every path-valued key (data.sources[].path, ref.local_dir) made portable. Works on a part of
    params too (what dvc.lock records for one stage)."""
    out = copy.deepcopy(params)
    data = out.get("data")
    for src in (data.get("sources") if isinstance(data, dict) else None) or []:
        if isinstance(src, dict) and isinstance(src.get("path"), str):
            src["path"] = portable_path(src["path"])
    ref = out.get("ref")
    if isinstance(ref, dict) and isinstance(ref.get("local_dir"), str):
        ref["local_dir"] = portable_path(ref["local_dir"])
    return out


PORTABLE_NOTE = ("# evidence bundle: absolute paths of the run are written external:<path below its last directory "
                 "before any wildcard>;\n# manifest.json `sources` pins every data file by its md5 and sha256.\n")


def portable_params_text(text: str, params: dict, where: str = "params.yaml") -> str:
    """The bundle's params.yaml: `text` unchanged when it names no absolute path; else every absolute path
    replaced by its portable form (comments mentioning it too) under a one-line note, and checked to parse
    to portable_params(params), so the rewrite never changes another value."""
    import yaml
    target = portable_params(params)
    if target == params:
        return text
    olds = [s["path"] for s in params.get("data", {}).get("sources", [])] + [params.get("ref", {}).get("local_dir")]
    for old in sorted({o for o in olds if isinstance(o, str) and o != portable_path(o)}, key=len, reverse=True):
        text = text.replace(old, portable_path(old))
    text = PORTABLE_NOTE + text
    if yaml.safe_load(text) != target:
        raise EvidenceError(f"{where}: its absolute paths could not be rewritten in place (quoted or escaped in a "
                            "way the bundle's rewrite does not follow); write them plainly, or relative to the checkout")
    return text


# --------------------------------------------------------------------------------------------------
# Derived members: environment.json, curves, summary.md, the evaluation map
# --------------------------------------------------------------------------------------------------

def environment_from_run_info(run_info: dict) -> dict[str, Any]:
    """The run's layout, objective and settings (whitelisted keys) and the environment record it trained under."""
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


def curve_name(label: str) -> str:
    return f"{label}_train_curves.png"


def read_train_log(path: str | os.PathLike, text: str | None = None) -> dict[str, list[float]]:
    """A train log's columns as floats (`text`: its contents, when they come from a bundle, not a file)."""
    f = io.StringIO(text, newline="") if text is not None else open(path, newline="", encoding="utf-8")
    with f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or "step" not in reader.fieldnames:
            raise EvidenceError(f"{path}: train log needs a 'step' column (header: {reader.fieldnames})")
        cols: dict[str, list[float]] = {c: [] for c in reader.fieldnames}
        for lineno, row in enumerate(reader, start=2):
            for c in reader.fieldnames:
                v = row.get(c)
                try:
                    cols[c].append(float(v) if v not in (None, "") else float("nan"))
                except ValueError:
                    if c in CURVE_COLUMNS or c == "step":
                        raise EvidenceError(f"{path} line {lineno}: column {c!r} is not a number: {v!r}") from None
                    cols[c].append(float("nan"))
    return cols


def render_curves_png(label: str, cols: dict[str, list[float]]) -> bytes:
    """Byte-stable for one matplotlib version (Agg, no metadata); the environment record names the version."""
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


def _f(x: float) -> str:
    return f"{x:.4f}"


def render_summary(metrics: dict[str, dict], bootstrap: dict | None, curves: list[str], params: dict,
                   train_logs: dict[str, dict[str, list[float]]] | None = None, records: dict | None = None,
                   generation: dict | None = None, rounds: dict | None = None) -> str:
    """summary.md: the metrics table, the implicit reward scored, the plan's warnings (from each run's train log
    columns by label, read_train_log), the generation section (the packed judge outputs:
    stages/evidence/generation.py generation_members, or None), then what ran (`records`:
    stages.evidence.records.bundle_records of the bundle's members: sources, tokenize, reference, training,
    per-source accuracy for mixtures), then the curves."""
    from stages.evidence.generation import render_generation_section
    from stages.evidence.rounds import render_rounds_section
    from stages.evidence.records import summary_sections
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
    rewards = [f"{label}: {m['implicit_reward']}" for label, m in sorted(metrics.items())
               if m.get("implicit_reward") not in (None, SUMMED_REWARD)]
    if rewards:     # none: DPO's summed-log-prob reward (docs/DPO_LOSSES.md "probe reward")
        lines += [f"Implicit reward scored, as dpo.loss declares it: {', '.join(rewards)} (beta * the per-token "
                  "mean log-prob ratio).", ""]
    warnings = [f"- {label}: {w}" for label, cols in sorted((train_logs or {}).items())
                for w in plan_warnings(len(cols.get("step", [])), _all_in_warmup(cols, params),
                                       params["train"]["warmup_ratio"])]
    # Data lost to the length limits (tokenize_report.json's warnings: a split losing over a tenth of its pairs).
    warnings += [f"- tokenize: {w}" for w in ((records or {}).get("tokenize_report") or {}).get("warnings", [])]
    if warnings:
        lines += ["## Warnings", "", *warnings, ""]
    lines += render_generation_section(generation, params)
    lines += render_rounds_section(rounds)          # metrics/rounds.json, packed (dpo.rounds > 1)
    if records is not None:
        lines += summary_sections(records, params)
    if curves:
        lines += ["## Training curves", ""]
        for name in curves:
            lines += [f"![{name}](curves/{name})", ""]
    return "\n".join(lines)


def _all_in_warmup(cols: dict[str, list[float]], params: dict) -> bool:
    """No logged step reached train.lr (every step inside the warmup; after it, the schedule starts at train.lr)."""
    lrs = cols.get("lr") or []
    return bool(lrs) and max(lrs) < params["train"]["lr"]


def metrics_label(path: str) -> str:
    """A metrics file's label in the summary table: its stem (metrics/dpo.json -> dpo)."""
    return PurePosixPath(path).stem


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


# --------------------------------------------------------------------------------------------------
# The deterministic tar.gz, and reading one back
# --------------------------------------------------------------------------------------------------

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


# The manifest is read before any other member is hashed (it holds every member's size, the bound each is read to);
# report writes a few hundred KB of it, so a "manifest" past this is refused unread.
MANIFEST_LIMIT = 64 * 2**20
CHUNK = 2**20


class BundleScan:
    """A bundle read as a stream (BundleScan.read): `kept` {name: bytes} of the members the caller keeps (those a stage
    writes), `digests` {name: (sha256, size)} of every member hashed, `names` every member's name, in order, and
    `refused` {name: why} for members not read or read only up to their bound."""

    def __init__(self) -> None:
        self.kept: dict[str, bytes] = {}
        self.digests: dict[str, tuple[str, int]] = {}
        self.names: list[str] = []
        self.refused: dict[str, str] = {}

    @classmethod
    def read(cls, path: str | os.PathLike, manifest_name: str, keep) -> "BundleScan":
        """Two streaming passes over the tar.gz, holding no member but those `keep(name)` says and the manifest:
        the first reads the manifest (at most MANIFEST_LIMIT bytes), the second hashes every member the manifest
        lists in CHUNK-sized reads, each only up to the size the manifest gives it: a member whose header says more
        is not read at all, one that yields more than that (a header that lies cannot, tarfile reads by it) stops
        there. A member the manifest does not list is not read (it DIFFERS whatever it holds). Links, directories,
        names outside evidence/ and a name twice are refused (EvidenceError), as before any check."""
        scan = cls()
        try:
            raw = cls._manifest(path, manifest_name)
            if raw is not None:
                scan.kept[manifest_name] = raw
            try:
                manifest = json.loads(raw) if raw is not None else {}
            except (json.JSONDecodeError, UnicodeDecodeError):
                manifest = {}                    # the checks say so, from the kept bytes
            listed = manifest.get("members") if isinstance(manifest, dict) else None
            listed = listed if isinstance(listed, dict) else {}
            with tarfile.open(path, mode="r|gz") as tar:     # a stream: nothing before the current member is kept
                for info in tar:
                    name = info.name
                    if not info.isreg():
                        raise EvidenceError(f"{path}: member {name} is not a regular file")
                    if not name.startswith(MEMBER_PREFIX) or ".." in PurePosixPath(name).parts:
                        raise EvidenceError(f"{path}: member {name} is outside {MEMBER_PREFIX}")
                    if name in scan.names:
                        raise EvidenceError(f"{path}: member {name} appears twice")
                    scan.names.append(name)
                    if name == manifest_name:
                        continue
                    entry = listed.get(name)
                    bound = entry.get("size") if isinstance(entry, dict) else None
                    if not isinstance(bound, int) or isinstance(bound, bool) or bound < 0:
                        continue                 # not listed (or no size): reported by the member check, unread
                    if info.size > bound:
                        scan.refused[name] = (f"{info.size} bytes in the bundle, the manifest says {bound}: "
                                              "not read past the manifest's size")
                        continue
                    scan._hash(tar.extractfile(info), name, bound, keep(name))
        except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
            raise EvidenceError(f"{path}: not a readable evidence bundle: {e}") from None
        return scan

    @staticmethod
    def _manifest(path, manifest_name: str) -> bytes | None:
        """The manifest member's bytes (None when the bundle has none)."""
        with tarfile.open(path, mode="r|gz") as tar:
            for info in tar:
                if info.name == manifest_name and info.isreg():
                    if info.size > MANIFEST_LIMIT:
                        raise EvidenceError(f"{path}: member {manifest_name} is {info.size} bytes, more than a "
                                            f"manifest can be ({MANIFEST_LIMIT}): not a bundle report wrote")
                    return tar.extractfile(info).read()
        return None

    def _hash(self, f, name: str, bound: int, keep: bool) -> None:
        h, size, parts = hashlib.sha256(), 0, []
        while chunk := f.read(min(CHUNK, bound - size + 1)):
            size += len(chunk)
            if size > bound:
                self.refused[name] = f"more than the manifest's {bound} bytes: not read past them"
                return
            h.update(chunk)
            if keep:
                parts.append(chunk)
        self.digests[name] = (h.hexdigest(), size)
        if keep:
            self.kept[name] = b"".join(parts)

