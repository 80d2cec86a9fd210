"""`python -m stages.report verify`: check what an evidence bundle means, not only that its hashes add up.

A forger can recompute every hash of a manifest, so hashes prove only that the bundle is self-consistent. The
checks below also hold each member to what it was made from:
  - members and packed artifacts against the manifest's sha256/md5 (a careless edit);
  - the manifest against the pipeline: every artifact of every stage the params imply (stages/lib/layout.py) is
    listed, nothing else; `evaluation` and `curves` are what the packed files and the layout give;
  - derived members remade with report's own functions (stages/evidence/bundle.py) and compared byte for byte:
    summary.md, the curve PNGs (SKIPPED, never MATCH, when this matplotlib is not the one that drew them),
    environment.json; metrics and bootstrap bounds recomputed from the per-pair rows by evaluate's code;
  - params.yaml: valid, the settings and objective each run recorded, the data sources the manifest pins;
  - the packed run records (stages/evidence/records.py) against their sums, one another, the probe manifests
    and params; probe_sources.json, with a workspace, remade from its probe pairs;
  - with --workspace DIR: every artifact present and equal in DIR (a missing one DIFFERS, naming the stage to
    rerun), dvc.lock recording the same hashes and the same params (absolute paths compared portably), the
    source files normalize read pinned as the manifest says.
Without --workspace, hashed-only artifacts and source files are SKIPPED: only the bundle can be checked.
About 560 lines, one function per group of checks in the order they print, all over one _Bundle and _Workspace.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from stages.evidence.bundle import (BUNDLE_ROOT, EXTERNAL, FORMAT, build_environment, curve_name,
                                 dvc_hashes, evaluation_map, json_bytes, metrics_label, portable_params,
                                 portable_path, BundleScan, read_train_log, render_curves_png, render_summary)
from stages.evidence.compare import numbers_agree
from stages.evidence.generation import check_generation, generation_members
from stages.evidence.records import (PROBE_SOURCES, bundle_records, portable_record, probe_sources_record,
                                         record_problems)
from stages.lib.io import MD5, hash_bytes, hash_file, leaves_repository, sha256_bytes
from stages.lib.layout import DEV_OUTPUTS, STAGE_OUTPUTS
from stages.lib.stage_plan import TRAINED, bundle_artifacts
from stages.lib.params import ABSENT, TRAIN_DISPLAY_ONLY, dotted_lookup, resolved_train

MANIFEST = f"{BUNDLE_ROOT}/manifest.json"
PARAMS = f"{BUNDLE_ROOT}/params.yaml"
ENVIRONMENT = f"{BUNDLE_ROOT}/environment.json"
SUMMARY = f"{BUNDLE_ROOT}/summary.md"


class Verdicts:
    """Each check's outcome, printed as `MATCH|DIFFERS|SKIPPED  what: detail`."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []

    def add(self, ok: bool | None, what: str, detail: str = "") -> None:
        self.rows.append(("SKIPPED" if ok is None else "MATCH" if ok else "DIFFERS", what, detail))

    def diffs(self, what: str, diffs: list[str], ok_detail: str) -> None:
        self.add(not diffs, what, ok_detail if not diffs else "; ".join(diffs[:5]) + (
            f"; and {len(diffs) - 5} more" if len(diffs) > 5 else ""))

    @property
    def failed(self) -> list[tuple[str, str, str]]:
        return [r for r in self.rows if r[0] == "DIFFERS"]

    def lines(self) -> list[str]:
        return [f"{status:<8} {what}" + (f": {detail}" if detail else "") for status, what, detail in self.rows]


# Every file report writes into a bundle beside the packed artifacts and curves (stages/report.py build_bundle).
FIXED_MEMBERS = {MANIFEST, PARAMS, ENVIRONMENT, SUMMARY, f"{BUNDLE_ROOT}/{PROBE_SOURCES}"}
LAYOUT_FILES = {path for outputs in (*STAGE_OUTPUTS.values(), *DEV_OUTPUTS.values()) for path in outputs.values()}


def _may_be_written(name: str) -> bool:
    """Whether report can write a member of this name under some params: the fixed members, a curve of a trained
    model, an output of a pipeline stage packed under artifacts/. Only such members are held in memory for the
    checks; any other is hashed as a stream and DIFFERS (_check_origin)."""
    if name in FIXED_MEMBERS:
        return True
    if name.startswith(f"{BUNDLE_ROOT}/curves/"):
        return name[len(f"{BUNDLE_ROOT}/curves/"):] in {curve_name(label) for label in TRAINED}
    return name.startswith(f"{BUNDLE_ROOT}/artifacts/") and name[len(f"{BUNDLE_ROOT}/artifacts/"):] in LAYOUT_FILES


class _Bundle:
    """The bundle's members, its manifest and its params, with the lookups the checks share. `members` holds the
    members report writes (BundleScan's kept), `names` every member's name."""

    def __init__(self, members: dict[str, bytes], manifest: dict, params: dict, names: list[str] | None = None) -> None:
        self.members, self.manifest, self.params = members, manifest, params
        self.names = list(names if names is not None else members)
        self.artifacts = {e["path"]: e for e in manifest.get("artifacts") or [] if isinstance(e, dict) and "path" in e}
        self.packed_paths = sorted(p for p, e in self.artifacts.items() if e.get("packed"))
        # Derived from the packed paths, never read from the manifest: a forger cannot skip a recomputation.
        self.evaluation = evaluation_map(self.packed_paths)

    def packed(self, rel: str | None) -> bytes | None:
        return self.members.get(f"{BUNDLE_ROOT}/artifacts/{rel}") if rel in self.packed_paths else None

    def packed_json(self, rel: str | None) -> Any:
        data = self.packed(rel)
        return json.loads(data) if data is not None else None

    def environment(self) -> dict:
        data = self.members.get(ENVIRONMENT)
        return json.loads(data) if data else {}


class _Workspace:
    """DIR and what its dvc.lock records: {out path: md5}, {stage: {param key: value}}, {stage: deps}."""

    def __init__(self, root: str | os.PathLike) -> None:
        import yaml
        self.root = Path(root)
        self.lock_problem: str | None = None
        self.outs: dict[str, str] = {}
        self.params: dict[str, dict] = {}
        self.deps: dict[str, list[dict]] = {}
        lock = self.root / "dvc.lock"
        if not lock.is_file():
            self.lock_problem = "not in the workspace"
            return
        try:
            doc = yaml.safe_load(lock.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            self.lock_problem = f"not readable YAML ({str(e).splitlines()[0]})"
            return
        if not isinstance(doc, dict) or not isinstance(doc.get("stages"), dict):
            self.lock_problem = "empty or without stages"
            return
        for name, stage in doc["stages"].items():
            for o in stage.get("outs") or []:
                if "md5" in o:
                    self.outs[o["path"]] = o["md5"]
            self.params[name] = (stage.get("params") or {}).get("params.yaml") or {}
            self.deps[name] = stage.get("deps") or []

    @property
    def has_lock(self) -> bool:
        return self.lock_problem is None


def verify_bundle(bundle: str | os.PathLike, workspace: str | os.PathLike | None = None) -> Verdicts:
    """Every check above, in order; a bundle whose manifest or params cannot be read stops after saying so."""
    v = Verdicts()
    # Streamed (BundleScan): members report cannot have written are hashed, never held; none is read past the size
    # the manifest gives it, so a bundle padded with a huge member costs its decompression, not its size in memory.
    scan = BundleScan.read(bundle, MANIFEST, _may_be_written)
    members = scan.kept
    if MANIFEST not in members:
        v.add(False, MANIFEST, "missing")
        return v
    try:
        manifest = json.loads(members[MANIFEST])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        v.add(False, MANIFEST, f"not JSON: {e}")
        return v
    if not _guarded(v, bundle, _check_members, scan, manifest):
        return v
    if manifest.get("format") != FORMAT:
        v.add(False, MANIFEST, f"format {manifest.get('format')!r}: this verify checks {FORMAT} bundles "
              "(remake the bundle with this checkout's report stage)")
        return v
    params = _bundle_params(v, members.get(PARAMS))
    if params is None:
        return v
    b = _Bundle(members, manifest, params, scan.names)
    ws = _Workspace(workspace) if workspace is not None else None
    for check, args in ((_check_origin, ()), (_check_layout, ()), (_check_artifacts, (ws,)), (_check_params, (ws,)),
                        (_check_sources, (ws,)), (_check_records, (ws,)), (_check_evaluation, ()),
                        (check_generation, ()), (_check_derived, ()), (_check_environment, ())):
        _guarded(v, bundle, check, b, *args)
    return v


def _guarded(v: Verdicts, bundle, check, *args) -> bool:
    """Run one check; a member or manifest entry of an unexpected shape is a verdict on the bundle, not a traceback."""
    try:
        check(v, *args)
        return True
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, UnicodeDecodeError) as e:
        v.add(False, str(bundle), f"malformed where {check.__name__.strip('_')} looks ({type(e).__name__}: {e})")
        return False


def _check_members(v: Verdicts, scan: BundleScan, manifest: dict) -> None:
    """Every member listed with its sha256 and size, nothing extra (hashed as the bundle was streamed)."""
    listed = manifest.get("members", {})
    present = set(scan.names)
    for name in sorted(set(listed) | present - {MANIFEST}):
        if name not in present:
            v.add(False, name, "listed in the manifest, missing from the bundle")
        elif name not in listed:
            v.add(False, name, "in the bundle, not listed in the manifest")
        elif name in scan.refused:
            v.add(False, name, scan.refused[name])
        else:
            got, size = scan.digests[name]
            want = listed[name]["sha256"]
            v.add(got == want and size == listed[name]["size"], name,
                  f"sha256 {got[:16]}…" if got == want else f"sha256 {got} != manifest {want}")
    params = scan.kept.get(PARAMS, b"") if PARAMS not in scan.refused else None
    v.add(params is not None and sha256_bytes(params) == manifest.get("params_sha256"), PARAMS,
          "params_sha256 of the manifest")


def _check_origin(v: Verdicts, b: _Bundle) -> None:
    """Every member is one report writes under these params: the fixed members, the curves of the trained models,
    and the packed artifacts of the pipeline's layout. A member a forger added and listed in a recomputed manifest
    hashes right, so only this names it."""
    packed = set(b.packed_paths) & set(bundle_artifacts(b.params))
    curves = {f"{BUNDLE_ROOT}/curves/{curve_name(label)}" for label in TRAINED}
    written = FIXED_MEMBERS | curves | {f"{BUNDLE_ROOT}/artifacts/{rel}" for rel in packed}
    foreign = [name for name in b.names if name not in written]
    for name in foreign:
        v.add(False, name, "a member no stage writes (report packs params.yaml, environment.json, summary.md, "
              f"{PROBE_SOURCES}, the curves and the packed artifacts of the pipeline's layout)")
    if not foreign:
        v.add(True, "bundle members", f"each of the {len(b.names)} is one report writes")


def _bundle_params(v: Verdicts, data: bytes | None) -> dict | None:
    import yaml
    from stages.lib.params import ParamsError, validate_params
    try:
        params = yaml.safe_load(data or b"")
        validate_params(params if isinstance(params, dict) else {}, PARAMS)
        return params
    except (yaml.YAMLError, ParamsError) as e:
        v.add(False, PARAMS, " ".join(str(e).split()))
        return None


# --------------------------------------------------------------------------------------------------
# The manifest against the pipeline's layout
# --------------------------------------------------------------------------------------------------

def _check_layout(v: Verdicts, b: _Bundle) -> None:
    required = bundle_artifacts(b.params)
    missing = [f"{path} (an artifact of {stage})" for path, stage in sorted(required.items()) if path not in b.artifacts]
    extra = sorted(set(b.artifacts) - set(required))
    v.diffs(f"{MANIFEST} artifacts", [f"missing: {m}" for m in missing] + [
        f"{p}: not an artifact of the pipeline under these params (dpo.objective {b.params['dpo']['objective']})"
        for p in extra], f"every artifact of the {len({s for s in required.values()})} stages before report")

    declared, derived = b.manifest.get("evaluation") or {}, b.evaluation
    diffs = [f"evaluation.{k}: manifest {declared.get(k)!r}, the packed files give {derived.get(k)!r}"
             for k in sorted(set(declared) | set(derived)) if declared.get(k) != derived.get(k)]
    for label in TRAINED:
        if not {"step0", "final", "metrics"} <= set(derived.get(label, {})):
            diffs.append(f"evaluation.{label}: the bundle packs no per-pair rows and metrics for {label}")
    if not {"probe_manifest", "probe_token_manifest", "bootstrap_summary"} <= set(derived.get("probe", {})):
        diffs.append("evaluation.probe: the bundle packs no probe manifests and bootstrap summary")
    v.diffs(f"{MANIFEST} evaluation", diffs, "the packed per-pair rows, metrics and manifests of every model")

    expected = {curve_name(label): {"label": label, "train_log": STAGE_OUTPUTS[stage]["plots_train_log"]}
                for label, stage in TRAINED.items()}
    drawn = {name[len(f"{BUNDLE_ROOT}/curves/"):] for name in b.names if name.startswith(f"{BUNDLE_ROOT}/curves/")}
    declared = b.manifest.get("curves") or {}
    diffs = [f"curves.{n}: manifest {declared.get(n)!r}, the pipeline draws {expected.get(n)!r}"
             for n in sorted(set(declared) | set(expected)) if declared.get(n) != expected.get(n)]
    diffs += [f"curves/{n}: a member no curve of the manifest names" for n in sorted(drawn - set(declared))]
    v.diffs(f"{MANIFEST} curves", diffs, "one curve per trained model, from its train log")


# --------------------------------------------------------------------------------------------------
# Artifacts: packed ones against the bundle; with a workspace, every one against DIR and its dvc.lock
# --------------------------------------------------------------------------------------------------

def _same_md5(v: Verdicts, what: str, where: str, got: str | None, want: str | None, absent: str = "",
              why: str = "") -> None:
    """`<where> md5 X` when it is the manifest's, `... != manifest Y<why>` when not; `absent` when got is None."""
    v.add(got is not None and got == want, what, absent if got is None else
          f"{where} md5 {got}" + ("" if got == want else f" != manifest {want}{why}"))


def _check_artifacts(v: Verdicts, b: _Bundle, ws: _Workspace | None) -> None:
    stage_of = bundle_artifacts(b.params)
    for rel, e in sorted(b.artifacts.items()):
        if e.get("packed"):
            data = b.packed(rel)
            if data is None:
                v.add(False, rel, "packed artifact missing from the bundle")
            elif e.get("portable"):
                # Packed with its absolute paths written portably: the member is not the file; DIR's file is.
                if ws is None:
                    v.add(None, rel, "packed with absolute paths written portably: give --workspace DIR to check "
                                     "it against the file")
                elif not (ws.root / rel).is_file():
                    v.add(False, rel, f"missing: rerun {stage_of.get(rel, 'the pipeline')}")
                else:
                    same = portable_record(rel, (ws.root / rel).read_bytes(), portable_path) == data
                    v.add(same, rel, "the workspace's file, its absolute paths written portably" if same else
                          "not the workspace's file with its absolute paths written portably")
            else:
                md5, sha = hash_bytes(data, MD5), sha256_bytes(data)
                ok = md5 == e.get("md5") and sha == e.get("sha256") and len(data) == e.get("size")
                v.add(ok, rel, f"md5 {md5}" if ok else f"md5 {md5} / sha256 {sha} != manifest {e.get('md5')} / "
                      f"{e.get('sha256')}")
        elif ws is None:
            v.add(None, rel, "hashed only: give --workspace DIR to check it against DIR")
    if ws is None:
        return
    present = sorted(rel for rel in b.artifacts if (ws.root / rel).exists())
    got = dict(zip(present, dvc_hashes([ws.root / rel for rel in present])))
    for rel, e in sorted(b.artifacts.items()):
        what = f"{rel} (workspace)" if e.get("packed") else rel
        if rel not in got:
            # A deleted output (a crashed rerun, --forcerun) is not "unchecked": the workspace is not the run.
            v.add(False, what, f"missing: rerun {stage_of.get(rel, 'the pipeline')}")
        else:
            _same_md5(v, what, "workspace", got[rel]["md5"], e.get("md5"))
        if ws.has_lock:
            _same_md5(v, f"{rel} (dvc.lock)", "dvc.lock", ws.outs.get(rel), e.get("md5"), "not recorded in dvc.lock")
    if not ws.has_lock:
        v.add(None, f"{ws.root / 'dvc.lock'}", f"{ws.lock_problem}: recorded hashes and params not checked")


# --------------------------------------------------------------------------------------------------
# params.yaml against the runs' settings, dvc.lock's params and the pinned sources
# --------------------------------------------------------------------------------------------------

def _check_params(v: Verdicts, b: _Bundle, ws: _Workspace | None) -> None:
    training = b.environment().get("training") or {}
    # A run's settings are its TrainSettings record: params.yaml's `train` with every optional key filled
    # (resolved_train).
    train = resolved_train(b.params["train"])
    for label in TRAINED:
        run = training.get(label)
        if not isinstance(run, dict) or "settings" not in run:
            v.add(False, f"{PARAMS} ({label} run)", f"environment.json records no settings for the {label} run")
            continue
        settings = run["settings"]
        diffs = [f"train.{k}: params.yaml {train.get(k, '(absent)')!r}, the {label} run trained with "
                 f"{settings.get(k, '(absent)')!r}" for k in sorted(set(train) | set(settings))
                 if train.get(k, ABSENT) != settings.get(k, ABSENT) and k not in TRAIN_DISPLAY_ONLY]
        if label == "dpo" and run.get("objective") != b.params["dpo"]["objective"]:
            diffs.append(f"dpo.objective: params.yaml {b.params['dpo']['objective']!r}, the run's "
                         f"{run.get('objective')!r}")
        v.diffs(f"{PARAMS} ({label} run)", diffs, "the train settings (and objective) the run recorded")
    # The probe and its tokens record the knobs they were made with (probe manifests, packed).
    probe = b.evaluation.get("probe", {})
    pm, tm = b.packed_json(probe.get("probe_manifest")), b.packed_json(probe.get("probe_token_manifest"))
    recorded = {**({f"probe.{k}": pm.get(k) for k in ("size", "seed")} if isinstance(pm, dict) else {}),
                **({f"tokenize.{k}": val for k, val in tm["limits"].items()}
                   if isinstance(tm, dict) and isinstance(tm.get("limits"), dict) else {})}
    if recorded:                                # absent manifests: _check_layout said so
        v.diffs(f"{PARAMS} (probe manifests)",
                [f"{k}: params.yaml {dotted_lookup(b.params, k)!r}, the probe manifests record {val!r}"
                 for k, val in recorded.items() if dotted_lookup(b.params, k) != val],
                "probe size and seed" + (", tokenize limits" if any(k.startswith("tokenize.") for k in recorded)
                                         else "") + " as the probe manifests record them")
    if ws is None or not ws.has_lock:
        return
    diffs, n = [], 0
    for stage, lock_params in sorted(ws.params.items()):
        for key, value in sorted(lock_params.items()):
            nested: dict = {}
            node = nested
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
            want, have = dotted_lookup(portable_params(nested), key), dotted_lookup(b.params, key)
            n += 1
            if want != have:
                diffs.append(f"{key}: params.yaml {'(absent)' if have is ABSENT else repr(have)}, "
                             f"dvc.lock ({stage}) {want!r}")
    v.diffs(f"{PARAMS} (dvc.lock)", diffs, f"the {n} params dvc.lock records, stage by stage")


def _source_dep_name(dep_path: str, source_path: str, root: Path) -> str:
    """A normalize dep of dvc.lock by the name the manifest gives its file: the portable form, except for a source
    outside the repository (`../shared/...`), which dvc.lock records by its absolute path (stages.lib.io
    data_location) and the manifest as written: named again relative to the workspace."""
    if os.path.isabs(dep_path) and leaves_repository(source_path):
        return os.path.normpath(os.path.relpath(dep_path, os.path.abspath(root)))
    return portable_path(dep_path, source_path)


def _check_sources(v: Verdicts, b: _Bundle, ws: _Workspace | None) -> None:
    """The manifest's `sources` are params.yaml's, in order, each file pinned; with DIR, dvc.lock's normalize deps
    (mapped to the same portable names) carry the same md5, and the files DIR holds hash to it."""
    sources, wanted = b.manifest.get("sources"), b.params["data"]["sources"]
    if not isinstance(sources, list) or not all(isinstance(s, dict) and s.get("files") for s in sources) or \
            [s.get("path") for s in sources] != [s["path"] for s in wanted]:
        v.add(False, f"{MANIFEST} sources", f"not params.yaml's data.sources {[s['path'] for s in wanted]}, "
              "each with the files it named")
        return
    v.add(True, f"{MANIFEST} sources", f"{sum(len(s['files']) for s in sources)} file(s) of "
          f"{len(sources)} source(s) pinned by md5 and sha256")
    if ws is None:
        return
    lock_sources = (dotted_lookup(ws.params.get("normalize", {}).get("data"), "sources")
                    if ws.has_lock else ABSENT)
    if not isinstance(lock_sources, list) or len(lock_sources) != len(sources):
        lock_sources = None
    for k, src in enumerate(sources):
        lock_path = lock_sources[k]["path"] if lock_sources else None
        by_name = {} if lock_path is None else {_source_dep_name(d["path"], lock_path, ws.root): d
                                                  for d in ws.deps.get("normalize", [])}
        for f in src["files"]:
            what = f"source {f['path']}"
            dep = by_name.get(f["path"]) or by_name.get(os.path.normpath(f["path"]))
            if ws.has_lock:
                _same_md5(v, f"{what} (dvc.lock)", "dvc.lock", dep and dep.get("md5"), f.get("md5"),
                          "not a normalize dep in dvc.lock")
            local = Path(dep["path"]) if dep is not None else Path(f["path"])
            local = local if local.is_absolute() else ws.root / local
            if (f["path"].startswith(EXTERNAL) and dep is None) or not local.is_file():
                v.add(None, what, "not in the workspace: not hashed")
                continue
            _same_md5(v, what, "workspace", hash_file(local, (MD5,))[1][MD5], f.get("md5"),
                      why=": the data changed since the run")


# --------------------------------------------------------------------------------------------------
# Metrics and bootstrap bounds, recomputed from the per-pair rows by evaluate's own code
# --------------------------------------------------------------------------------------------------



def _check_evaluation(v: Verdicts, b: _Bundle) -> None:
    from stages.evidence import scoring
    from stages.lib.contracts import PROBE_MANIFEST_SCHEMA, PROBE_TOKEN_MANIFEST_SCHEMA, shape_problem

    probe = b.evaluation.get("probe", {})
    pm, tm = b.packed_json(probe.get("probe_manifest")), b.packed_json(probe.get("probe_token_manifest"))
    boot = b.packed_json(probe.get("bootstrap_summary"))
    for rel, obj, schema, what in ((probe.get("probe_manifest"), pm, PROBE_MANIFEST_SCHEMA, "probe manifest"),
                                   (probe.get("probe_token_manifest"), tm, PROBE_TOKEN_MANIFEST_SCHEMA,
                                    "probe token manifest")):
        if obj is not None and (problem := shape_problem(obj, schema)) is not None:
            v.add(False, rel, f"not a valid {what} ({problem})")
            return
    if pm is None or tm is None:
        return                                  # _check_layout said which files the bundle lacks
    ev = b.params["evaluate"]
    record = b.environment().get("record") or {}
    if boot is not None:
        # The bootstrap summary's own header: the params it ran with, the probe it scored, the bytes it read.
        expect = {"replicates": ev["bootstrap_replicates"], "seed": ev["seed"], "confidence": ev["confidence"],
                  "probe_digest": pm["probe_digest"], "token_digest": tm.get("token_digest"),
                  "numpy_version": (record.get("packages") or {}).get("numpy", boot.get("numpy_version")),
                  "inputs_sha256": {"probe_manifest": sha256_bytes(b.packed(probe["probe_manifest"])),
                                    "probe_token_manifest": sha256_bytes(b.packed(probe["probe_token_manifest"])),
                                    **{f"{kind}_{which}": sha256_bytes(b.packed(b.evaluation[kind][which]) or b"")
                                       for kind in TRAINED if kind in b.evaluation
                                       for which in ("step0", "final") if which in b.evaluation[kind]}}}
        v.diffs(f"{probe['bootstrap_summary']} (header)",
                [f"{k}: bundle {boot.get(k)!r}, expected {want!r}" for k, want in expect.items() if boot.get(k) != want],
                "params, probe digests, numpy and the sha256 of the per-pair files it read")
    for kind in TRAINED:
        files = b.evaluation.get(kind, {})
        if not {"step0", "final", "metrics"} <= set(files):
            continue                            # _check_layout reported it
        rows = {which: [json.loads(line) for line in b.packed(files[which]).decode("utf-8").splitlines()
                        if line.strip()] for which in ("step0", "final")}
        try:
            metrics, summary = scoring.evaluate_model(kind, rows["step0"], rows["final"], pm, tm, b.params,
                                                       files["step0"], files["final"])
        except (scoring.ProbeMismatchError, scoring.PerPairFileError, KeyError, ValueError) as e:
            v.add(False, f"metrics ({kind})", f"per-pair rows refused by evaluate: {e}")
            continue
        diffs: list[str] = []
        numbers_agree(b.packed_json(files["metrics"]), metrics, files["metrics"], diffs)
        v.diffs(files["metrics"], diffs, "recomputed from " + ", ".join((files["step0"], files["final"])))
        if boot is not None:
            diffs = []
            numbers_agree((boot.get("models") or {}).get(kind), summary, f"bootstrap_summary.models.{kind}", diffs)
            v.diffs(f"{probe['bootstrap_summary']} ({kind})", diffs, "bootstrap bounds recomputed")


# --------------------------------------------------------------------------------------------------
# Derived members, remade by report's own functions
# --------------------------------------------------------------------------------------------------

def _first_difference(have: bytes, want: bytes) -> str:
    a, b = have.decode("utf-8", "replace").splitlines(), want.decode("utf-8", "replace").splitlines()
    for i, (x, y) in enumerate(zip(a, b), start=1):
        if x != y:
            return f"line {i}: bundle {x[:120]!r}, recomputed {y[:120]!r}"
    return f"bundle {len(a)} lines, recomputed {len(b)}"


def _check_derived(v: Verdicts, b: _Bundle) -> None:
    from importlib.metadata import PackageNotFoundError, version

    metric_files = [e["path"] for e in b.artifacts.values() if e.get("role") == "metrics" and e.get("packed")]
    curves = b.manifest.get("curves") or {}
    try:
        metrics = {metrics_label(p): b.packed_json(p) for p in metric_files}
        # (and the train logs: the plan's warnings are read from them)
        logs = {spec["label"]: read_train_log(spec["train_log"], b.packed(spec["train_log"]).decode("utf-8"))
                for spec in curves.values() if isinstance(spec, dict) and b.packed(spec.get("train_log")) is not None}
        want = render_summary(metrics, b.packed_json(b.evaluation.get("probe", {}).get("bootstrap_summary")),
                              sorted(curves), b.params, logs, bundle_records(b.members, BUNDLE_ROOT),
                              _bundle_generation(b), _bundle_rounds(b)).encode("utf-8")
        have = b.members.get(SUMMARY, b"")
        v.add(have == want, SUMMARY, "remade from the packed metrics, bootstrap summary, train logs, run records, "
              "per-pair rows and params" if have == want else f"not what report writes from the bundle's metrics, "
              f"bootstrap summary, train logs, run records and params: {_first_difference(have, want)}")
    except (KeyError, TypeError, ValueError) as e:
        v.add(False, SUMMARY, f"cannot be remade from the bundle's metrics and params: {e!r}")

    env = b.environment()
    record = env.get("record") or {}
    drawn_by = (record.get("packages") or {}).get("matplotlib")
    try:
        here = version("matplotlib")
    except PackageNotFoundError:
        here = None
    for name, spec in sorted(curves.items()):
        member = f"{BUNDLE_ROOT}/curves/{name}"
        log = b.packed(spec.get("train_log") if isinstance(spec, dict) else None)
        if log is None:
            v.add(False, member, "its train log is not packed in the bundle")
        elif drawn_by != here:
            v.add(None, member, f"drawn with matplotlib {drawn_by}, this machine has {here}: not redrawn")
        else:
            png = render_curves_png(spec["label"], read_train_log(spec["train_log"], log.decode("utf-8")))
            v.add(b.members.get(member) == png, member, f"redrawn from {spec['train_log']}" if
                  b.members.get(member) == png else f"not the curves of {spec['train_log']}")

    env_path = STAGE_OUTPUTS["environment"]["record"]
    diffs = [] if record == b.packed_json(env_path) else [f"record is not the packed {env_path}"]
    # A trainer records what it checked its process against: the record without the environment stage's `lock`.
    facts = {k: val for k, val in record.items() if k != "lock"}
    diffs += [f"training.{label}.record is not the environment record"
              for label, run in sorted((env.get("training") or {}).items()) if run.get("record") != facts]
    # The runs' run_info.json are packed (format 3): environment.json is remade from the bundle alone.
    run_infos = {label: info for label, stage in TRAINED.items()
                 if isinstance(info := b.packed_json(STAGE_OUTPUTS[stage]["run_info"]), dict)}
    detail = "remade from the packed environment record and run_info.json"
    if len(run_infos) != len(TRAINED):
        diffs.append("the runs' run_info.json are not all packed")
    elif json_bytes(build_environment(record, run_infos)) != b.members.get(ENVIRONMENT):
        diffs.append("not what report writes from the packed record and run_info.json")
    v.diffs(ENVIRONMENT, diffs, detail)


def _check_records(v: Verdicts, b: _Bundle, ws: _Workspace | None) -> None:
    """The packed run records (stages/evidence/records.py) against their own arithmetic, one another, the
    probe manifests, the manifest's sources and params; probe_sources.json, with DIR, remade from its probe pairs."""
    probe = b.evaluation.get("probe", {})
    records = bundle_records(b.members, BUNDLE_ROOT)
    problems = record_problems(records, b.params, b.packed_json(probe.get("probe_manifest")),
                               b.packed_json(probe.get("probe_token_manifest")), b.manifest.get("sources"),
                               portable_path)
    for rel, found in problems.items():
        v.diffs(f"{rel} (record)", found, "consistent with the other records, the probe manifests and params")
    rel = STAGE_OUTPUTS["freeze_probe"]["probe"]
    pm = b.packed_json(probe.get("probe_manifest"))
    if ws is None or not (ws.root / rel).is_file() or not isinstance(pm, dict):
        v.add(None, f"{PROBE_SOURCES} (workspace)", f"give --workspace DIR holding {rel} to remake it")
        return
    from stages.lib.io import read_parquet
    table = read_parquet(ws.root / rel).select(["pair_id", "source"]).to_pydict()
    try:
        want = probe_sources_record(pm, table["pair_id"], table["source"])
    except ValueError as e:
        v.add(False, f"{PROBE_SOURCES} (workspace)", f"{rel}: {e}")
        return
    v.add(want == records.get("probe_sources"), f"{PROBE_SOURCES} (workspace)",
          f"remade from {rel}" if want == records.get("probe_sources") else f"not the sources of {rel}'s pairs")


def _bundle_rounds(b: _Bundle) -> dict | None:
    """The packed metrics/rounds.json (role `rounds`; a run of dpo.rounds > 1), or None."""
    paths = [e["path"] for e in b.artifacts.values() if e.get("role") == "rounds" and e.get("packed")]
    return b.packed_json(paths[0]) if paths else None


def _bundle_generation(b: _Bundle) -> dict | None:
    """The packed judge outputs, as report read them for summary.md (stages/evidence/generation.py)."""
    return generation_members(b.packed_json, lambda rel: None if b.packed(rel) is None else b.packed(rel).decode())


def _check_environment(v: Verdicts, b: _Bundle) -> None:
    """The bundle's record against this process's (informational unless asked to require it)."""
    from stages.lib.environment import compare_records, environment_record
    record = b.environment().get("record")
    if not record:
        v.add(None, "environment", "the bundle carries no environment record")
        return
    here = environment_record(b.params["train"])
    diffs = compare_records({k: val for k, val in record.items() if k in here}, here)
    v.rows.append(("MATCH" if not diffs else "ENV-DIFF", "environment",
                   "same as this machine's" if not diffs else "; ".join(diffs)))

