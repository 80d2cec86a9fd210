"""Generate dvc.yaml from the Snakefile, so Snakemake and DVC run one DAG.

The Snakefile is the single source of truth. This script builds Snakemake's own DAG for `rule all`
(through the Snakemake API, with the current params.yaml) and writes, for each job, a DVC stage with
the very same shell command, deps (the rule's inputs), outs, params and metrics/plots:

* a rule parameter named `cli_*` is a command-line fragment (a path or flag), visible in the cmd;
* a rule parameter named after a params.yaml section (`probe=config["probe"]`) becomes DVC param
  `probe`; `train__lr=config["train"]["lr"]` becomes `train.lr` (`__` stands for the dot);
* an output whose name starts with `metrics` is a DVC metric (kept in git, `cache: false`); one named `plots*` is
  an ordinary cached out with one top-level `plots:` definition (x: step, y: loss/accuracy/margin), so each plot is
  defined once and `dvc plots diff REV` reads every revision's curve from DVC's cache (results/ is git-ignored:
  an uncached curve existed in no revision but the workspace); an output named `persist_*` is kept across reruns
  (`persist: true`); one named `live*` is a DVCLive folder (stages/engine/live_log.py): a cached out whose
  metrics.json is a top-level `metrics:` entry (`dvc exp show` reads it from the workspace while `dvc exp run` trains,
  and from DVC's cache for a finished experiment or commit). Its plots/metrics folder is no top-level plot: a plot
  path inside a directory out makes DVC open that directory's listing from its cache, and `dvc exp run <stage>` on a
  clone that never built the other training stages then fails on their missing listing (DVC's
  _collect_pipeline_files); `dvc plots show --targets results/<stage>/dvclive/plots/metrics` draws it;
* `benchmark:` files and `*.perf.json` logs are not DVC outs (timings change on every run and prove
  nothing); a rule param named `env_*` is a Snakemake-only rerun trigger (the installed packages,
  which DVC cannot hash: DVC sees the lock file, a dep of the environment stage);
* DVC's cmd is Snakemake's shell command followed by `--record-for-snakemake OUTS`, which runs
  `snakemake --touch OUTS`: Snakemake then records the params, code and inputs DVC just ran with,
  so its params/code triggers agree with DVC instead of reading the records of its own last run;
* each rule's main `log:` is a cached DVC out with `persist: true` (stage logs carry no timestamps or
  timings, so the record is the same on every run): the log is hash-tracked and, being in DVC's cache,
  `git checkout <older commit> && dvc checkout` restores it with the other outputs (`dvc status` clean);
  a persisted out turns off DVC's run-cache for the stage (dvc/stage/cache.py `_can_hash`), so DVC
  never restores outputs without running the cmd and its Snakemake bookkeeping.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import difflib
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(Path(__file__).resolve().parent) not in sys.path:      # `from integrity import ...` when imported by tests
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import dvc_adapter  # noqa: E402 -- after the path above; DVC itself is imported only inside its functions
PERF_SUFFIX = ".perf.json"
HEADER = (
    "# GENERATED from the Snakefile by `python workflow/sync_dvc.py`; do not edit by hand.\n"
    "# tests/workflow/test_dag.py fails when this file and the Snakefile disagree.\n"
)


# The train-log columns each curve plots: a preference objective's (train_dpo, train_rm), sft's.
PLOT_FIELDS = {"pairs": ["loss", "accuracy", "margin"], "sft": ["loss", "completion_logp"]}
# A DVCLive folder's summary and its per-metric histories (stages/engine/live_log.py).
LIVE_METRICS = "metrics.json"
# The dev curve (train.eval_every; probe.dev_size > 0): the columns of a training stage's dev_log.csv.
DEV_PLOT = ("dev_log.csv", ["accuracy", "margin", "sigmoid_loss"])


def plot_definition(path: str) -> dict:
    stage = Path(path).parent.name
    if Path(path).name == DEV_PLOT[0]:
        return {"x": "step", "y": list(DEV_PLOT[1]), "title": f"{stage} dev"}
    return {"x": "step", "y": list(PLOT_FIELDS.get(stage, PLOT_FIELDS["pairs"])), "title": f"{stage} training"}

def _param_key(name: str, value, config: dict) -> str:
    key = name.replace("__", ".")
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise SystemExit(f"rule param {name!r} names no params.yaml key {key!r}; name params after their key")
        node = node[part]
    if node != value:
        raise SystemExit(f"rule param {name!r} is not params.yaml's {key!r} value; it must be passed through unchanged")
    return key


@contextlib.contextmanager
def _environ(name: str, value: str):
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def snakemake_jobs(root: Path = ROOT) -> tuple[list, dict]:
    """Snakemake's jobs for `rule all`, in a deterministic topological order, plus the config."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import DAGSettings, OutputSettings, ResourceSettings
    from snakemake.settings.enums import Quietness

    from integrity import DAG_ONLY

    # A DAG read: the Snakefile's start-up takes no DVC lock and forces no rerun (restored after: tests import this).
    with _environ(DAG_ONLY, "1"), SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
        wf_api = api.workflow(resource_settings=ResourceSettings(cores=1), snakefile=root / "Snakefile", workdir=root)
        wf_api.dag(DAGSettings())
        workflow = wf_api._workflow
        workflow._prepare_dag(forceall=True, ignore_incomplete=True, lock_warn_only=True, nolock=True)
        workflow._build_dag()
        dag = workflow.dag
        order: list = []
        for level in dag.toposorted():
            order.extend(sorted(level, key=lambda j: j.rule.name))
        jobs = [j for j in order if j.rule.name != "all"]
        # Materialize everything we need before the API context is torn down.
        out = []
        for job in jobs:
            params = {name: job.params[name] for name in job.params.keys()}
            out.append({
                "name": job.rule.name,
                "cmd": " ".join(job.shellcmd.split()),
                "deps": list(dict.fromkeys(str(f) for f in job.input)),
                "outputs": [(name, str(job.output[name])) for name in job.output.keys()],
                "unnamed_outputs": [str(f) for f in job.output],
                "logs": [str(f) for f in job.log],
                "params": params,
            })
        return out, dict(workflow.config)


def render_dvc_yaml(jobs: list, config: dict) -> str:
    stages, curves, live = {}, [], []
    for job in jobs:
        named = {path: name for name, path in job["outputs"]}
        outs, metrics, plots = [], [], []
        for path in job["unnamed_outputs"]:
            name = named.get(path, "")
            if name.startswith("metrics"):
                metrics.append({path: {"cache": False}})
            elif name.startswith("plots"):
                outs.append(path)           # cached; drawn by the one top-level definition below
                plots.append(path)
            elif name.startswith("persist"):
                outs.append({path: {"persist": True}})
            elif name.startswith("live"):
                outs.append(path)           # cached (results/ is git-ignored); its files read by top-level entries
                live.append(path)
            else:
                outs.append(path)
        outs.extend({log: {"persist": True}} for log in job["logs"] if not log.endswith(PERF_SUFFIX))
        record = " ".join(job["unnamed_outputs"])
        stage = {"cmd": f"{job['cmd']} && python workflow/sync_dvc.py --record-for-snakemake {record}",
                 "deps": job["deps"]}
        params = sorted({_param_key(n, v, config) for n, v in job["params"].items()
                         if not n.startswith(("cli_", "env_"))})
        if params:
            stage["params"] = params
        if outs:
            stage["outs"] = outs
        if metrics:
            stage["metrics"] = metrics
        curves.extend(plots)
        stages[job["name"]] = stage
    doc = {"stages": stages}
    if curves:
        # The one definition of each plot (a stage-level `plots:` entry as well would draw it twice).
        # y: the columns the stage's train log has (sft's objective logs the completions' log-prob, not a pair's
        # accuracy and margin: naming those made every `dvc plots diff` warn that the fields are missing).
        doc["plots"] = [{p: plot_definition(p)} for p in curves]
    if live:
        doc["metrics"] = [f"{d}/{LIVE_METRICS}" for d in live]        # no top-level plots (module docstring)
    body = yaml.safe_dump(doc, sort_keys=False, width=1000, default_flow_style=False)
    return HEADER + body


class CommitRefused(Exception):
    """The run's record cannot be written as asked; str() names the file and the stage to rerun."""


def commit_lock(root: Path = ROOT, ran: list[str] | None = None, jobs: int | None = None,
                dag: list[str] | None = None) -> list[str]:
    """Record in dvc.lock the stages whose jobs ran in this Snakemake run (`ran`: rule names = dvc.yaml stage
    names), what `dvc commit --force <those stages>` records, done in one DVC session. Returns the committed names.

    Only what this run built is recorded. Every other stage that dvc.lock records is checked: an output that exists
    but no longer hashes to its recorded value is never recorded. `dag`: the stages of this run's DAG (None: every
    stage). Such an output of a stage in the DAG changed while the run went on, outside the pipeline (on-disk
    corruption, a hand edit; the start-up check forced every stage of the DAG whose outputs had changed), so after
    writing the ran stages' entries the commit is refused naming it and the stage to rerun. A stage outside the DAG
    (a targeted run, `snakemake --cores 2 judge`, whose start-up check left it as it was) is reported, with the
    command that rebuilds it, and does not fail the run that did its work (issue 37 item 6). A missing output of a
    stage outside this run is a workspace that lacks it (`dvc status` says deleted), not a new truth: its entry is
    left as it was.

    dvc.lock is written atomically (a copy updated beside it, fsync'd, renamed over it): a crash leaves the old
    record or the new one, never an empty or partial file.

    Before DVC's own (sequential) pass, every distinct dep/out path is hashed once in a thread pool: DVC's state db
    then answers DVC's pass, which only copies new objects into the cache (hashlib and sendfile release the GIL;
    dvc-data hashes in threads only inside a directory of several large files, and a model directory has one)."""
    from integrity import (changed_paths, drop_corrupt_objects, dvc_session, note_snakemake_records, read_lockfile,
                           stage_changes)

    ran = list(dict.fromkeys(ran or []))
    recorded = read_lockfile(root)            # an empty or unparsable dvc.lock is refused, not overwritten blindly
    with dvc_session(root) as repo:
        if repo is None:
            return []
        by_name = {stage.name: stage for stage in dvc_adapter.pipeline_stages(repo)}
        unknown = [name for name in ran if name not in by_name]
        if unknown:
            raise CommitRefused(f"--ran names no dvc.yaml stage: {', '.join(unknown)} (run `python workflow/sync_dvc.py`"
                                " after changing the Snakefile or data.sources)")
        built = [by_name[name] for name in ran]
        for stage in built:
            missing = [o.def_path for o in stage.outs if not o.exists]
            if missing:
                raise CommitRefused(f"stage {stage.name} ran but its outputs are missing: {', '.join(missing)}; "
                                    f"nothing recorded (rerun it: snakemake --forcerun {stage.name})")
        others = {name: rec for name, rec in recorded.items() if name in by_name and name not in ran}
        # The bytes the ran stages read: each input another stage recorded, hashed whole (not through DVC's state
        # db, which trusts an unchanged inode, mtime and size), must be what dvc.lock records; else nothing is
        # recorded (refused before any entry is written).
        misread = read_inputs_changed(repo, built, [by_name[name] for name in others])
        if misread:
            raise CommitRefused("; ".join(
                f"{path} no longer hashes to what {LOCKFILE_NAME} records for stage {producer}, yet {', '.join(readers)} "
                f"read it (edited in place with its size and mtime kept: DVC's state cache missed it)"
                for path, (producer, readers) in sorted(misread.items()))
                + f": nothing recorded; `snakemake --cores N` now reruns "
                f"{', '.join(sorted({p for p, _ in misread.values()}))} and everything after it")
        _warm_hashes([*built, *(by_name[name] for name in others)], jobs)
        changed = {name: list(changed_paths(ch, "outs", modified_only=True))
                   for name, ch in stage_changes(repo, others).items()}
        changed = {name: paths for name, paths in changed.items() if paths}
        # What `dvc commit --force` does per stage (dvc/repo/commit.py): save = hash deps and outs,
        # commit = outs into the cache (and relinked), then the lock entries, all written in one dump.
        for stage in built:
            for out in stage.outs:        # what `dvc checkout` restored from a corrupt object is rebuilt: store it again
                for obj in drop_corrupt_objects(out):
                    print(f"sync_dvc: removed {obj} from DVC's cache: it no longer hashed to its name (stored again "
                          f"from {stage.name}'s rebuilt output)", file=sys.stderr)
            dvc_adapter.save_and_commit(stage)
        if built:
            _dump_lock_atomically(repo, root, built)
            # Snakemake's records of what ran (written by this run) now describe these entries (RunGuard's
            # refresh_snakemake_records reads this note).
            note_snakemake_records(root, read_lockfile(root), ran)
    outside = {name: paths for name, paths in changed.items() if dag is not None and name not in dag}
    if outside:
        names = sorted(outside)
        print("sync_dvc: not recorded in dvc.lock (outside this run's targets, changed since they were built): "
              + "; ".join(f"{', '.join(outside[name])} (stage {name})" for name in names)
              + f"; `snakemake --cores N --forcerun {' '.join(names)}` rebuilds them", file=sys.stderr)
    changed = {name: paths for name, paths in changed.items() if name not in outside}
    if changed:
        lines = "; ".join(f"{', '.join(paths)} (stage {name}: snakemake --forcerun {name})"
                          for name, paths in sorted(changed.items()))
        raise CommitRefused(f"not recorded in dvc.lock: outputs changed since they were built, and no job of this run "
                            f"wrote them: {lines}")
    return ran


LOCKFILE_NAME = "dvc.lock"


def read_inputs_changed(repo, built: list, producers: list) -> dict[str, tuple[str, list[str]]]:
    """{path: (producing stage, [ran stages that read it])} for each input of a `built` stage that a stage in
    `producers` (recorded, not run now) records as its output and whose bytes, read now, hash to something else.
    A file found so gets its true hash written into DVC's state db, so that `prefpipe status`, `dvc status` and the
    next run's start-up check see it as modified from now on."""
    from integrity import content_md5

    owner = {out.fs_path: (stage.name, out) for stage in producers for out in stage.outs}
    found: dict[str, tuple[str, list[str]]] = {}
    for stage in built:
        for dep in stage.deps:
            hit = owner.get(dep.fs_path)
            if hit is None:
                continue
            producer, out = hit
            for path, recorded in dvc_adapter.recorded_files(out):
                rel = os.path.relpath(path, dvc_adapter.root_dir(repo))
                if rel in found:
                    found[rel][1].append(stage.name)
                    continue
                try:
                    actual = content_md5(path)
                except FileNotFoundError:
                    continue            # a missing file: the stage could not have read it (its run failed)
                if actual != recorded:
                    found[rel] = (producer, [stage.name])
                    dvc_adapter.note_hash_in_repo_state(repo, out, path, actual)
    return found


def _dump_lock_atomically(repo, root: Path, stages: list) -> None:
    """DVC's own lock serialization (dvc_adapter.dump_lock_entries: the bytes `dvc commit` writes), into a
    copy of dvc.lock beside it, then fsync and rename: DVC itself rewrites dvc.lock in place, so a kill -9
    mid-write used to leave it empty."""
    import shutil
    import tempfile

    target = root / "dvc.lock"
    # The copy lives in .dvc/tmp (git-ignored, the same file system as dvc.lock, so the rename is atomic): a
    # writer killed before the rename leaves its copy there, not an untracked file beside dvc.lock.
    tmp_dir = root / ".dvc" / "tmp"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="dvc.lock.", suffix=".tmp", dir=tmp_dir)
    os.close(fd)
    try:
        if target.exists():
            shutil.copyfile(target, tmp)
        else:
            os.unlink(tmp)                    # Lockfile starts a new file where none exists
        dvc_adapter.dump_lock_entries(repo, tmp, stages)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
        dir_fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _warm_hashes(stages: list, jobs: int | None) -> None:
    """Hash each distinct dep/out path of `stages` once, concurrently, into DVC's state db (an output of
    one stage is often a dep of others: it is hashed once either way, the state db is keyed by path,
    inode, mtime and size). A path that fails here is left to DVC's own pass to report."""
    from concurrent.futures import ThreadPoolExecutor

    unique = {}
    for stage in stages:
        for item in (*stage.deps, *stage.outs):
            # Output subclasses only: params deps hash values, not files.
            if dvc_adapter.hashes_a_file(item) and item.exists:
                unique.setdefault(item.fs_path, item)
    if not unique:
        return
    workers = jobs or min(len(unique), os.cpu_count() or 1)

    def warm(item) -> None:
        try:
            dvc_adapter.warm_hash(item)
        except Exception:  # noqa: BLE001 -- DVC's sequential pass raises it with its own message
            pass

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(warm, unique.values()))


def dvc_yaml_now_and_rendered(root: Path = ROOT) -> tuple[str, str]:
    """(dvc.yaml as it is on disk, "" when absent; dvc.yaml as the Snakefile renders it for params.yaml now)."""
    jobs, config = snakemake_jobs(root)
    target = root / "dvc.yaml"
    return (target.read_text() if target.exists() else ""), render_dvc_yaml(jobs, config)


class StaleDvcYaml(RuntimeError):
    """dvc.yaml is not what the Snakefile gives for params.yaml as it is now."""


def stale_dvc_yaml_problem(root: Path = ROOT) -> str | None:
    """Why dvc.yaml is not the Snakefile's DAG for the current params.yaml (None: it is). Some params shape the DAG
    itself: dpo.rounds adds each round's stages, `sft` and probe.dev_size add stages and outputs, a data source is
    a dep. DVC cannot know: `dvc exp run -S dpo.rounds=3` on a 2-round dvc.yaml reran only report (it tracks all of
    params.yaml) and recorded an experiment that says 3 rounds and holds 2."""
    current, text = dvc_yaml_now_and_rendered(root)
    if current == text:
        return None
    stages_now = yaml.safe_load(text).get("stages", {})
    stages_then = (yaml.safe_load(current) or {}).get("stages", {})
    missing, extra = sorted(set(stages_now) - set(stages_then)), sorted(set(stages_then) - set(stages_now))
    differ = sorted(n for n in set(stages_now) & set(stages_then) if stages_now[n] != stages_then[n])
    said = "; ".join(part for part in (f"stages it lacks: {', '.join(missing)}" if missing else "",
                                      f"stages it should not have: {', '.join(extra)}" if extra else "",
                                      f"stages that differ: {', '.join(differ)}" if differ else "") if part)
    return f"dvc.yaml was generated for other params than params.yaml's ({said or 'top-level entries differ'})"


def record_for_snakemake(paths: list[str], root: Path = ROOT) -> None:
    """After DVC built `paths`: first, dvc.yaml must be the DAG of the params this stage just ran with (else
    StaleDvcYaml: the stage fails, so DVC records nothing of it); then `snakemake --touch` them, which writes
    Snakemake's provenance records (params, code, inputs) for the current state. The env var keeps the Snakefile's
    onsuccess from calling `dvc commit` while `dvc repro` holds the repository lock."""
    problem = stale_dvc_yaml_problem(root)
    if problem is not None:
        raise StaleDvcYaml(problem)
    # `snakemake --touch --cores 1 --quiet all -- PATHS`, through Snakemake's API in this process: the DAG read
    # above already paid for importing Snakemake and collecting its plugins (a `snakemake` subprocess paid again,
    # ~2 s of every stage DVC runs).
    from snakemake.api import SnakemakeApi
    from snakemake.settings.enums import Quietness
    from snakemake.settings.types import DAGSettings, OutputSettings, ResourceSettings

    from integrity import INSIDE_DVC

    # workdir=root: the API changes into it, so PATHS resolve as on the command line DVC ran in root
    with _environ(INSIDE_DVC, "1"), SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
        wf_api = api.workflow(resource_settings=ResourceSettings(cores=1), snakefile=root / "Snakefile", workdir=root)
        wf_api.dag(DAGSettings(targets={"all", *paths})).execute_workflow(pseudo_executor="touch")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="fail if dvc.yaml is out of date")
    mode.add_argument("--commit-lock", action="store_true",
                      help="record in dvc.lock the stages named by --ran (the jobs a Snakemake run just ran)")
    ap.add_argument("--ran", nargs="*", default=[], metavar="STAGE",
                    help="with --commit-lock: the stages whose jobs ran (only these are recorded)")
    ap.add_argument("--dag", nargs="*", default=None, metavar="STAGE",
                    help="with --commit-lock: the stages of the run's DAG (ran or up to date); a changed output of "
                         "another stage is reported, not refused (a targeted run)")
    mode.add_argument("--record-for-snakemake", nargs="+", metavar="FILE",
                      help="record files DVC just built in Snakemake's provenance (snakemake --touch)")
    args = ap.parse_args(argv)
    target = ROOT / "dvc.yaml"
    if args.record_for_snakemake:
        try:
            record_for_snakemake(args.record_for_snakemake)
        except StaleDvcYaml as e:
            print(f"sync_dvc: refused: {e}: run `python workflow/sync_dvc.py`, then `dvc repro` (or the `dvc exp run` "
                  "again); this stage's outputs are not recorded", file=sys.stderr)
            return 1
        return 0
    if args.commit_lock:
        dvc_adapter.quiet_logging()         # as `dvc commit --quiet`: no "Updating lock file"
        from integrity import IntegrityError
        try:
            commit_lock(ran=args.ran, dag=args.dag)
        except (CommitRefused, IntegrityError) as e:
            print(f"sync_dvc --commit-lock: refused: {e}", file=sys.stderr)
            return 1
        return 0
    if args.check:
        current, text = dvc_yaml_now_and_rendered()
        if current != text:
            diff = difflib.unified_diff(current.splitlines(True), text.splitlines(True), "dvc.yaml", "from Snakefile")
            sys.stderr.write("dvc.yaml is out of date with the Snakefile; run `python workflow/sync_dvc.py`\n")
            sys.stderr.writelines(diff)
            return 1
        print("dvc.yaml matches the Snakefile")
        return 0
    jobs, config = snakemake_jobs()
    text = render_dvc_yaml(jobs, config)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")    # atomic: a crash leaves the old dvc.yaml
    tmp.write_text(text)
    os.replace(tmp, target)
    print(f"wrote {target.relative_to(ROOT)} ({len(jobs)} stages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
