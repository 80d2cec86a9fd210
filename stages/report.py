"""Report: a deterministic evidence bundle (tar.gz) and a short markdown summary.

    python -m stages.report --params params.yaml \
        --artifacts results/normalize/pairs.parquet ... results/train_dpo/model results/train_rm/model \
        --metrics metrics/dpo.json metrics/rm.json \
        --per-pair results/train_dpo/probe_step0.jsonl results/train_dpo/probe_final.jsonl \
                   results/train_rm/probe_step0.jsonl results/train_rm/probe_final.jsonl \
        --bootstrap-summary results/evaluate/bootstrap_summary.json \
        --generation-eval results/judge/judgments.jsonl metrics/generation.json results/judge/judge_summary.json \
        --train-log dpo=results/train_dpo/train_log.csv rm=results/train_rm/train_log.csv \
        --run-info dpo=results/train_dpo/run_info.json rm=results/train_rm/run_info.json \
        --environment results/env/environment.json \
        --probe-manifests results/probe/probe_manifest.json results/tokens/probe_token_manifest.json \
        --normalize-stats results/normalize/normalize_stats.json \
        --bundle results/report/evidence.tar.gz --summary results/report/summary.md \
        --curves-dir results/report/curves --log logs/report.log

    python -m stages.report verify results/report/evidence.tar.gz [--workspace DIR] [--require-same-environment]

The bundle's format (members, hashes, the derived members and how they are made) is stages/evidence/bundle.py;
`verify` is stages/evidence/verify.py. `--artifacts` are hashed only (weights, optimizer state and data
never enter the bundle); the data sources normalize read (`--normalize-stats` names them) are pinned in the
manifest by their hashes.

Deterministic: members sorted, mtime 0, uid/gid 0, empty owner names, mode 0644, gzip mtime 0 and no
file name in the gzip header, PNGs rendered by Agg with no metadata. Before anything is written,
every member is scanned for this machine's hostname, the absolute working directory, $HOME and common
credential patterns; a hit refuses the bundle (naming the member and what leaked). Absolute paths in
params.yaml are written portably (stages.evidence.bundle.portable_path).
`verify` is for a reviewer holding someone else's bundle: it re-hashes every member and packed artifact,
requires every artifact the pipeline produces (stages/lib/layout.py) in the manifest, recomputes the derived
members (summary.md, the curve PNGs, environment.json, the evaluation map) and the metrics and bootstrap bounds
from the packed rows, holds params.yaml to the runs' recorded settings, and, with --workspace, every artifact and
data source to DIR and its dvc.lock (artifacts and params). It prints MATCH / DIFFERS / SKIPPED per check
(ENV-DIFF for the environment) and exits 1 on any DIFFERS (and on ENV-DIFF with --require-same-environment).
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
from pathlib import Path, PurePosixPath

from stages.lib.cli import stage_main
from stages.evidence.bundle import (BUNDLE_ROOT, FORMAT, EvidenceError, build_environment, curve_name,
                                 deterministic_targz, dvc_hash, dvc_hashes, evaluation_map, json_bytes,
                                 metrics_label, portable_params_text, portable_path, read_train_log,
                                 render_curves_png, render_summary)
from stages.evidence.records import PROBE_SOURCES, RECORDS, bundle_records, portable_record, probe_sources_record
from stages.lib.io import atomic_path, data_location, sha256_bytes, write_text
from stages.lib.layout import STAGE_OUTPUTS

RECORD_ROLES = set(RECORDS.values())
from stages.lib.params import ParamsError
from stages.lib.declared_params import load_stage_params

PACKABLE_SUFFIXES = {".json", ".jsonl", ".csv"}

__all__ = ["ReportError", "LeakError", "build_bundle", "dvc_hash", "dvc_hashes", "deterministic_targz", "main"]


class ReportError(EvidenceError):
    """An input cannot go into the evidence bundle; the message names it and why."""


class LeakError(ReportError):
    """A bundle member contains a hostname, an absolute path, $HOME or a credential."""


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


def source_files(params: dict, stats: dict, stats_path: str) -> list[list[str]]:
    """The files each data source named, as normalize read them (normalize_stats.json), per params source.
    Refused when the record is not of these params' sources: the bundle would pin data the run never read."""
    wanted = [s["path"] for s in params["data"]["sources"]]
    recorded = [s.get("path") for s in stats.get("sources", [])]
    if recorded != wanted:
        raise ReportError(f"{stats_path}: normalize read the sources {recorded}, params.yaml names {wanted}: "
                          "rerun normalize")
    files = [[f["path"] for f in s.get("files") or []] for s in stats["sources"]]
    for path, names in zip(wanted, files):
        if not names:
            raise ReportError(f"{stats_path}: source {path} lists no files read")
    return files


def source_entries(params: dict, stats: dict, files: list[list[str]], file_hash: dict[str, dict]) -> list[dict]:
    """The manifest's `sources`: each params source (its name as normalize resolved it, its portable path) and
    every file it named, portably, with md5 (dvc.lock's dep hash), sha256 and size."""
    return [{"name": rec.get("name"), "path": portable_path(src["path"]),
             "files": [{"path": portable_path(f, src["path"]),
                        **{k: file_hash[f][k] for k in ("md5", "sha256", "size")}} for f in names]}
            for src, rec, names in zip(params["data"]["sources"], stats["sources"], files)]


# --------------------------------------------------------------------------------------------------
# Leak scan
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


# --------------------------------------------------------------------------------------------------
# Assemble
# --------------------------------------------------------------------------------------------------

def build_bundle(params_path: str, artifacts: list[str], metrics: list[str], per_pair: list[str],
                 bootstrap_summary: str | None, train_logs: dict[str, str], run_infos: dict[str, str], *,
                 normalize_stats: str, cwd: str | os.PathLike | None = None, environment: str | None = None,
                 probe_manifests: list[str] | None = None,
                 generation_eval: list[str] | None = None,
                 rounds_metrics: str | None = None) -> tuple[dict[str, bytes], str, dict[str, bytes]]:
    """-> (bundle members by name, summary markdown, curve PNGs by file name). generation_eval: the judge stage's
    outputs (judgments, metrics, summary), packed."""
    params = load_stage_params(params_path if cwd is None else Path(cwd) / params_path, "report")
    packed: dict[str, str] = {}  # relpath -> role
    for role, paths in (("metrics", metrics), ("per_pair", per_pair),
                        ("bootstrap_summary", [bootstrap_summary] if bootstrap_summary else []),
                        ("train_log", list(train_logs.values())),
                        ("environment", [environment] if environment else []),
                        # The probe's two manifests let `verify` rerun evaluate's checks on the per-pair rows.
                        ("probe_manifest", list(probe_manifests or [])),
                        ("generation_eval", list(generation_eval or [])),
                        # metrics/rounds.json (dpo.rounds > 1): packed, summary.md's rounds table is made from it.
                        ("rounds", [rounds_metrics] if rounds_metrics else [])):
        for p in paths:
            rel = relative_artifact_path(p)
            if Path(rel).suffix not in PACKABLE_SUFFIXES:
                raise ReportError(f"{p}: only {sorted(PACKABLE_SUFFIXES)} files are packed into the bundle")
            if not _path(p, cwd).is_file():
                raise ReportError(f"{p}: {role} file does not exist")
            packed[rel] = role
    hashed_only = {relative_artifact_path(p): "artifact" for p in artifacts}
    hashed_only.update({relative_artifact_path(p): "run_info" for p in run_infos.values()})
    # The run's small JSON records are packed whole (stages/evidence/records.py), not only hashed.
    for rel in [rel for rel in hashed_only if rel in RECORDS]:
        del hashed_only[rel]
        packed[rel] = RECORDS[rel]

    rels = sorted(set(packed) | set(hashed_only))
    for rel in rels:    # refused before any hashing, as dvc_hash would refuse it one by one
        if not _path(rel, cwd).exists():
            raise ReportError(f"{rel}: artifact does not exist")
    try:
        stats = json.loads(_read(normalize_stats, cwd))
    except (OSError, json.JSONDecodeError) as e:
        raise ReportError(f"{normalize_stats}: not a readable normalize_stats.json: {e}") from None
    sources = source_files(params, stats, normalize_stats)
    data_files = sorted({f for files in sources for f in files})
    # Where each is on disk: a file outside the repository beside the workspace, also from DVC's experiment copy.
    located = [_path(data_location(f, cwd or "."), cwd) for f in data_files]
    for f, where in zip(data_files, located):
        if not where.is_file():
            raise ReportError(f"{f}: a data source file normalize read does not exist (rerun normalize)")
    # Hash in background threads while the curves render (matplotlib holds the GIL; hashlib mostly not).
    from concurrent.futures import ThreadPoolExecutor
    background = ThreadPoolExecutor(max_workers=1)
    hashing = background.submit(dvc_hashes, [_path(p, cwd) for p in rels] + located)
    try:
        members, curves = _members_and_curves(params_path, params, packed, run_infos, environment, train_logs, cwd)
        members[f"{BUNDLE_ROOT}/{PROBE_SOURCES}"] = json_bytes(_probe_sources(artifacts, probe_manifests or [], cwd))
        hashes = hashing.result()
    finally:
        background.shutdown(wait=True)
    entries = [{"path": rel, "role": packed.get(rel) or hashed_only[rel], "packed": rel in packed, **h,
                # a record packed with its absolute paths written portably: the member is not the file's bytes
                **({"portable": True} if rel in packed and sha256_bytes(members[f"{BUNDLE_ROOT}/artifacts/{rel}"])
                   != h.get("sha256") else {})}
               for rel, h in zip(rels, hashes)]
    file_hash = dict(zip(data_files, hashes[len(rels):]))
    metrics_by_label = {metrics_label(p): json.loads(_read(p, cwd)) for p in metrics}
    boot = json.loads(_read(bootstrap_summary, cwd)) if bootstrap_summary else None
    summary = render_summary(metrics_by_label, boot, sorted(curves), params,
                             {label: read_train_log(_path(p, cwd)) for label, p in train_logs.items()},
                             bundle_records(members, BUNDLE_ROOT), _generation(packed, cwd),
                             json.loads(_read(rounds_metrics, cwd)) if rounds_metrics else None)
    members[f"{BUNDLE_ROOT}/summary.md"] = summary.encode("utf-8")

    manifest = {
        "format": FORMAT,
        "evaluation": evaluation_map(sorted(packed)),
        # What each derived member is made from, so verify can remake it from the packed files.
        "curves": {curve_name(label): {"label": label, "train_log": relative_artifact_path(p)}
                   for label, p in sorted(train_logs.items())},
        # Each data source in params order, every file it named pinned by its hashes (md5 = dvc.lock's dep).
        "sources": source_entries(params, stats, sources, file_hash),
        "hashes": "md5 as in dvc.lock (directories: md5 of DVC's .dir listing + '.dir'); sha256 for files",
        "artifacts": entries,
        "params_sha256": sha256_bytes(members[f"{BUNDLE_ROOT}/params.yaml"]),
        "members": {name: {"sha256": sha256_bytes(data), "size": len(data)}
                    for name, data in sorted(members.items())},
    }
    members[f"{BUNDLE_ROOT}/manifest.json"] = json_bytes(manifest)

    needles = leak_needles(cwd)
    for name, data in sorted(members.items()):
        scan_member(name, data, needles)
    return members, summary, curves


def _members_and_curves(params_path: str, params: dict, packed: dict[str, str], run_infos: dict[str, str],
                        environment: str | None, train_logs: dict[str, str],
                        cwd) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """build_bundle's members before the summary and manifest: packed files, params, environment, curves."""
    members: dict[str, bytes] = {}
    for rel, role in packed.items():
        data = _read(rel, cwd)
        members[f"{BUNDLE_ROOT}/artifacts/{rel}"] = portable_record(rel, data, portable_path) if role in RECORD_ROLES \
            else data
    text = _read(params_path, cwd).decode("utf-8")
    members[f"{BUNDLE_ROOT}/params.yaml"] = portable_params_text(text, params, params_path).encode("utf-8")

    run_info_data = {}
    for label, p in run_infos.items():
        try:
            run_info_data[label] = json.loads(_read(p, cwd))
        except json.JSONDecodeError as e:
            raise ReportError(f"{p}: run_info is not JSON: {e}") from None
    record = json.loads(_read(environment, cwd)) if environment else None
    members[f"{BUNDLE_ROOT}/environment.json"] = json_bytes(build_environment(record, run_info_data))

    curves: dict[str, bytes] = {}
    for label, p in sorted(train_logs.items()):
        curves[curve_name(label)] = render_curves_png(label, read_train_log(_path(p, cwd)))
    for name, png in curves.items():
        members[f"{BUNDLE_ROOT}/curves/{name}"] = png
    return members, curves


def _probe_sources(artifacts: list[str], probe_manifests: list[str], cwd) -> dict:
    """probe_sources.json: the source of each probe pair (results/probe/probe.parquet), in the manifest's order."""
    from stages.lib.io import read_parquet
    probe = STAGE_OUTPUTS["freeze_probe"]["probe"]
    manifest = STAGE_OUTPUTS["freeze_probe"]["manifest"]
    if probe not in map(relative_artifact_path, artifacts) or manifest not in map(relative_artifact_path,
                                                                                   probe_manifests):
        raise ReportError(f"{probe} and {manifest} are needed for the probe pairs' sources (--artifacts, "
                          "--probe-manifests)")
    table = read_parquet(_path(probe, cwd)).select(["pair_id", "source"]).to_pydict()
    try:
        return probe_sources_record(json.loads(_read(manifest, cwd)), table["pair_id"], table["source"])
    except ValueError as e:
        raise ReportError(f"{probe}: {e}") from None


def _generation(packed: dict[str, str], cwd) -> dict | None:
    """The packed judge outputs as the summary's generation section reads them (stages/evidence/generation.py)."""
    from stages.evidence.generation import generation_members
    mine = {rel for rel, role in packed.items() if role == "generation_eval"}
    return generation_members(lambda rel: json.loads(_read(rel, cwd)) if rel in mine else None,
                              lambda rel: _read(rel, cwd).decode("utf-8") if rel in mine else None)


def _path(p: str, cwd) -> Path:
    return Path(p) if cwd is None else Path(cwd) / p


def _read(p: str, cwd) -> bytes:
    return _path(p, cwd).read_bytes()


# --------------------------------------------------------------------------------------------------
# Verify: a stranger checks someone else's bundle (the checks: stages/evidence/verify.py)
# --------------------------------------------------------------------------------------------------

def _verify_arguments(ap) -> None:
    ap.add_argument("bundle", help="evidence.tar.gz")
    ap.add_argument("--workspace", default=None,
                    help="a checkout holding the run's artifacts and dvc.lock: every artifact of the manifest must "
                         "be there and match (a missing one DIFFERS, naming the stage to rerun), and dvc.lock must "
                         "record the same hashes and params; without it, hashed-only artifacts are SKIPPED")
    ap.add_argument("--require-same-environment", action="store_true",
                    help="also fail when the bundle's environment record differs from this machine's")


VERIFY_HELP = ("Check an evidence bundle: member and artifact hashes, the pipeline's artifacts all present, "
               "the derived members, metrics and bootstrap bounds recomputed, params against the runs and "
               "dvc.lock, environment compared.")


def verify_main(argv: list[str] | None, prog: str = "python -m stages.report verify") -> int:
    return stage_main(argv, "report", VERIFY_HELP, add_arguments=_verify_arguments, run=_verify,
                      params=None, log=False, prog=prog)


def _verify(args) -> int:
    """A verdict, not a refusal: a bundle that cannot be read is a DIFFERS line on stdout, exit 1."""
    from stages.evidence.verify import verify_bundle
    try:
        verdicts = verify_bundle(args.bundle, args.workspace)
    except EvidenceError as e:
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
                      input_errors=(EvidenceError, ParamsError))


def _arguments(ap) -> None:
    ap.add_argument("--artifacts", nargs="*", default=[], help="pipeline artifacts (files or dirs) hashed, not packed")
    ap.add_argument("--metrics", nargs="*", default=[], help="metrics JSON (label = file stem), packed")
    ap.add_argument("--per-pair", nargs="*", default=[], help="per-pair probe JSONL, packed")
    ap.add_argument("--bootstrap-summary", help="evaluate's bootstrap_summary.json, packed")
    ap.add_argument("--generation-eval", nargs="*", default=[],
                    help="the judge stage's judgments.jsonl, metrics/generation.json and judge_summary.json, packed")
    ap.add_argument("--train-log", nargs="*", default=[], metavar="LABEL=CSV", help="train logs, packed and plotted")
    ap.add_argument("--run-info", nargs="*", default=[], metavar="LABEL=JSON",
                    help="trainer run_info.json: hashed; whitelisted layout, objective and settings copied")
    ap.add_argument("--environment", help="the environment stage's environment.json: packed, and the bundle's "
                    "environment record")
    ap.add_argument("--probe-manifests", nargs="*", default=[],
                    help="probe_manifest.json and probe_token_manifest.json: packed, so `verify` can recompute")
    ap.add_argument("--normalize-stats", required=True,
                    help="normalize_stats.json: which files each data source named; the manifest pins them by hash")
    ap.add_argument("--rounds-metrics", help="metrics/rounds.json (dpo.rounds > 1): packed, and a rounds table in "
                    "the summary")
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--summary", required=True)
    ap.add_argument("--curves-dir", help="also write the curve PNGs here (the summary links curves/<name>.png)")


def _run(args) -> int:
    log = logging.getLogger("report")
    members, summary, curves = build_bundle(
        args.params, args.artifacts, args.metrics, args.per_pair, args.bootstrap_summary,
        parse_labeled(args.train_log, "--train-log"), parse_labeled(args.run_info, "--run-info"),
        environment=args.environment, probe_manifests=args.probe_manifests, normalize_stats=args.normalize_stats,
        generation_eval=args.generation_eval, rounds_metrics=args.rounds_metrics)
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
