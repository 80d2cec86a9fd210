"""Hashes are the one truth for "up to date": what a Snakemake run checks before it schedules and records after.

Snakemake decides what to rerun from modification times and its own metadata, never from content: a bit flipped in
an output, a reference file edited in place (a directory input's mtime does not change), a source restored to an
older mtime, are all invisible to it. dvc.lock records the hash of every dep and out of every stage as last built. So, before Snakemake builds
its DAG (the Snakefile calls `RunGuard` at start-up, in Snakemake's main process only):

* the repository's DVC lock is taken for the whole run, so `dvc repro` cannot run beside this Snakemake run (and
  a Snakemake run started while DVC holds it is refused, saying so);
* dvc.lock must be readable: an empty or unparsable one (a crash mid-write by an older version, a bad merge) is
  refused, naming it, rather than treated as "nothing recorded";
* every stage dvc.lock records is compared with the workspace in one DVC session (DVC's state db keeps this cheap:
  a file is re-hashed only when its inode, mtime or size changed): a modified output, or a changed dep (file,
  params, command), makes the stage's rule rerun, and the reason is printed (a missing output Snakemake reruns by
  itself, and the run's end checks that no declared output is missing). The rerun is Snakemake's own
  `--forcerun` (the command starts itself again with those stages added: RunGuard.rerun_forcing), so the stage
  and everything downstream of it rerun, and `snakemake --dry-run` lists them as forced, changing nothing.
  (Marking outputs older than their inputs does not work: Snakemake ignores a newer input whose checksum it
  recorded unchanged, and an output mtime of 0.)
* a stage that matches dvc.lock completely but whose Snakemake records were written for another dvc.lock entry (an
  older run restored by `git checkout OLD && dvc checkout`, or a stage `dvc repro` built) gets those records refreshed
  (`snakemake --touch` of it alone: refresh_snakemake_records), so Snakemake's params/code/input triggers do not rerun
  what dvc.lock vouches for (docs/INTEGRITY.md, "Restoring an older run").

After a successful run, `workflow/sync_dvc.py --commit-lock --ran <rules>` records the jobs that ran (and only
those) and refuses to record an output of any other stage that no longer matches dvc.lock (sync_dvc.py).

What this cannot see: a change that keeps a file's size, mtime and inode (DVC's state db trusts those) and happens
while no stage reads the file; the stages that read bytes that matter re-verify them by content themselves
(token hashes, parquet page checksums, the reference's digests).
"""
from __future__ import annotations

import atexit
import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator

import yaml

import dvc_adapter

ROOT = Path(__file__).resolve().parents[1]
LOCKFILE = "dvc.lock"
# Set by the processes that must not take DVC's lock or force reruns: `dvc repro`'s own stage commands
# (sync_dvc.py --record-for-snakemake runs Snakemake's touch, through its API, while DVC holds the lock) and
# sync_dvc.py's DAG build.
INSIDE_DVC = "PREFPIPE_INSIDE_DVC"
DAG_ONLY = "PREFPIPE_DAG_ONLY"
# The stages a Snakemake command was started again to force (RunGuard.rerun_forcing), so the new process does not
# start itself again for them.
FORCED = "PREFPIPE_FORCED_STAGES"


# LibYAML's safe loader where PyYAML was built with it (the lock's wheel is): the same documents as yaml.SafeLoader,
# ~10x faster. dvc.lock is read at every Snakemake start (0.85 s with the pure-Python loader on a 2-core CPU).
FAST_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class IntegrityError(Exception):
    """The run cannot start or be recorded; str() is one line naming the file and what to do."""


def read_lockfile(root: Path = ROOT) -> dict:
    """dvc.lock's stages ({} when there is no dvc.lock yet); an empty or unparsable dvc.lock is refused."""
    path = root / LOCKFILE
    if not path.exists():
        return {}
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        doc = yaml.load(text, Loader=FAST_SAFE_LOADER)
    except yaml.YAMLError as e:
        raise IntegrityError(f"{LOCKFILE} is not valid YAML ({str(e).splitlines()[0]}): restore it with "
                             f"`git checkout {LOCKFILE}` (the committed record) before running") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("stages"), dict):
        what = "empty" if not text.strip() else "not a DVC lock file (no `stages:` mapping)"
        raise IntegrityError(f"{LOCKFILE} is {what}: restore it with `git checkout {LOCKFILE}` (the committed "
                             "record) before running; nothing can be trusted as up to date without it")
    return doc["stages"]


# "FD:PID": DVC's repository lock, already held, handed on (an inherited descriptor of the same open `.dvc/tmp/lock`:
# DVC locks it with flock, which belongs to the open file, so it stays held across RunGuard.rerun_forcing's exec and
# is shared with the onsuccess commit's process): the receiving process uses it instead of locking again, so no
# other process can take the lock in between (issue 34 item 4: `dvc repro` started in that gap ran beside us).
HELD_LOCK = "PREFPIPE_DVC_LOCK"


def lock_path(root: Path) -> Path:
    return root / ".dvc" / "tmp" / "lock"


def inherited_lock(root: Path) -> int | None:
    """The descriptor of DVC's lock this process was handed (HELD_LOCK), when it really is one: given by this very
    process before its exec or by its parent, and open on `root`'s `.dvc/tmp/lock` (the same inode). Else None."""
    value = os.environ.get(HELD_LOCK, "")
    try:
        fd, pid = (int(part) for part in value.split(":"))
        if pid not in (os.getpid(), os.getppid()) or os.fstat(fd).st_ino != lock_path(root).stat().st_ino:
            return None
    except (ValueError, OSError):
        return None
    os.set_inheritable(fd, False)        # jobs of this run must not hold it (a job orphaned by a kill would keep it)
    return fd


def dvc_stage_running(root: Path) -> str | None:
    """A `dvc repro` stage command running in `root` now, as `cmd (pid N)`: DVC gives its repository lock back while
    a stage's command runs (dvc/stage/decorators.py unlocked_repo) and holds only its read/write lock on the
    stage's paths (.dvc/tmp/rwlock, with the holder's pid). None when no live process holds an entry."""
    import json
    try:
        info = json.loads((root / ".dvc" / "tmp" / "rwlock").read_text() or "{}")
    except (OSError, ValueError):
        return None
    for mode in ("write", "read"):
        for entries in (info.get(mode) or {}).values():
            for entry in entries if isinstance(entries, list) else [entries]:
                pid = entry.get("pid") if isinstance(entry, dict) else None
                if isinstance(pid, int) and pid != os.getpid() and _alive(pid):
                    return f"`{entry.get('cmd', 'dvc')}` (pid {pid})"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def dvc_session(root: Path = ROOT, hold: bool = True) -> Iterator:
    """A DVC Repo of `root` with its repository lock held (DVC's own `.dvc/tmp/lock`, the one `dvc repro`
    takes, or the one this process was handed: HELD_LOCK), or None when `root` is no DVC repository or DVC is not
    installed. Refused while a `dvc repro` stage command runs (it holds DVC's rwlock, not the repository lock)."""
    if not (root / ".dvc").is_dir():
        yield None
        return
    if not dvc_adapter.installed():       # DVC is optional for a Snakemake-only user
        yield None
        return
    with contextlib.chdir(root):
        try:
            repo = dvc_adapter.open_repo(root)
        except dvc_adapter.CannotOpen as e:    # e.g. .dvc/ without git (a tarball of the repository): DVC can't work
            print(f"integrity: hashes not checked and dvc.lock not written: DVC cannot open {root} "
                  f"({e})", file=sys.stderr, flush=True)
            yield None
            return
    with contextlib.chdir(root), dvc_adapter.opened(repo):
        handed = inherited_lock(root)
        if handed is not None:
            repo.prefpipe_lock_fd = handed
            dvc_adapter.adopt_held_lock(repo)       # held through `handed`: DVC sees the repository as locked
            try:
                yield repo
            finally:
                os.close(handed)      # never LOCK_UN: the process that handed it on still holds it
            return
        try:
            release = dvc_adapter.take_lock(repo)
        except dvc_adapter.LockBusy as e:
            raise IntegrityError(
                f"another DVC or Snakemake process holds this repository's lock ({root / '.dvc/tmp/lock'}): "
                "wait for that `dvc repro` / `snakemake` run to finish (two runs at once would write the same "
                "outputs)") from e
        try:
            running = dvc_stage_running(root)
            if running is not None:
                raise IntegrityError(f"`dvc repro` is running a stage in this repository ({running}, in "
                                     f"{root / '.dvc/tmp/rwlock'}): wait for it to finish (two runs at once would "
                                     "write the same outputs)")
            repo.prefpipe_lock_fd = dvc_adapter.lock_fd(repo)
            yield repo
        finally:
            release()


def stage_changes(repo, recorded: dict) -> dict[str, dict]:
    """Every dvc.yaml stage that dvc.lock records and whose deps or outs no longer match it in the workspace:
    {stage: {"deps": {path: change}, "params": {key: change}, "outs": {path: change}, "files": {path: change},
    "other": [...]}}, a change being DVC's word ('modified', 'deleted', 'new'); "files" names the files inside a
    modified directory dep or out (when its recorded listing is in DVC's cache). Workspace status, not `dvc status`'s: that reports an out
    whose object is absent from the cache as 'not in cache' whatever its bytes (a fresh clone's state)."""
    stale = {}
    for stage in dvc_adapter.pipeline_stages(repo):
        if stage.name not in recorded:
            continue                        # never recorded: Snakemake's own rules decide
        changes: dict = {"deps": {}, "params": {}, "outs": {}, "files": {}, "other": []}
        for kind, items in (("deps", stage.deps), ("outs", stage.outs)):
            for item in items:
                for path, change in dvc_adapter.workspace_status(item).items():
                    if isinstance(change, dict):     # params: {params.yaml: {train.lr: modified}}
                        changes["params"].update(change)
                    else:
                        changes[kind][path] = change
                        if change == "modified" and dvc_adapter.is_dir_record(item):   # name the files inside
                            changes["files"].update({f"{path}/{rel}": what
                                                     for rel, what in dvc_adapter.changed_files(item).items()})
                if kind == "outs" and item.def_path not in changes["outs"]:
                    for path, why in unverified_restore(item).items():
                        changes["outs"][item.def_path] = "modified"
                        changes["files"][os.path.relpath(path, dvc_adapter.root_dir(repo))] = why
        if dvc_adapter.command_changed(stage):
            changes["other"].append("changed command")
        if any(changes.values()):
            stale[stage.name] = changes
    return stale


def content_md5(path: str) -> str:
    """The md5 DVC records for a file, from its bytes read now (never from DVC's state db, which trusts a file
    whose inode, mtime and size are unchanged, and an entry `dvc checkout` wrote from the cache object's name)."""
    return dvc_adapter.file_md5(path)


def unverified_restore(item) -> dict[str, str]:
    """{workspace file: why} for each file of a recorded out whose bytes are not the recorded ones although DVC's
    state db says they are, found where that claim has nothing behind it: the file's object in DVC's cache is
    missing or no longer hashes to its name. `dvc checkout` copies a corrupt object and writes the object's name
    into the state db as the file's hash (and DVC removes a corrupt object once it checks it), so the workspace
    compare alone calls such a file up to date. The object is hashed through the state db (one stat per object
    once hashed: a changed object has a new mtime); the workspace file is read whole only when its object is
    missing or corrupt. A right workspace file beside a bad object is not reported (the file is right). A file
    found wrong gets its true hash written into the state db, so DVC's own commands see it as modified too."""
    if not dvc_adapter.uses_cache(item):
        return {}
    bad = {}
    for path, oid in dvc_adapter.recorded_files(item):
        if not os.path.isfile(path):
            continue
        obj_path = dvc_adapter.object_path(item, oid)
        why = None
        if not os.path.isfile(obj_path):
            why = "not in DVC's cache"
        else:
            try:
                actual = dvc_adapter.object_md5(item, obj_path)
            except OSError:
                continue
            if actual != oid:
                shown = os.path.relpath(obj_path, dvc_adapter.object_root_dir(item))
                why = f"restored from a corrupt cache object ({shown})"
        if why is None:
            continue
        actual = content_md5(path)
        if actual != oid:
            bad[path] = f"modified: {why}, and its bytes differ from the record"
            dvc_adapter.note_hash_in_cache_state(item, path, actual)
    return bad


def drop_corrupt_objects(item) -> list[str]:
    """Delete from DVC's cache each object of a recorded out that no longer hashes to its name (DVC's own check,
    which removes it), so that the commit of the out rebuilt stores the right bytes under that name again: DVC adds
    no object that already exists. Returns the objects removed."""
    if not dvc_adapter.uses_cache(item):
        return []
    removed = []
    for _, oid in dvc_adapter.recorded_files(item):
        if dvc_adapter.drop_if_corrupt(item, oid):
            removed.append(dvc_adapter.object_path(item, oid))
    return removed


def unrecorded_outputs(repo, recorded: dict) -> dict[str, list[str]]:
    """{stage: its outputs that exist} for each dvc.yaml stage dvc.lock has no entry for (a bad merge dropped it, or
    a run died before recording it) while outputs of it exist (persisted logs aside): bytes nobody recorded are no
    evidence, so such a stage is rebuilt rather than trusted (and a stage that reads them is not run on them)."""
    found = {}
    for stage in dvc_adapter.pipeline_stages(repo):
        name = stage.name
        if not name or name in recorded:
            continue
        present = [out.def_path for out in stage.outs if not out.persist and out.exists]
        if present:
            found[name] = present
    return found


def content_changed(changes: dict) -> bool:
    """Whether a stage's changes are ones Snakemake cannot see: bytes that differ from the record (a modified out or
    dep, whatever its mtime), changed params or command. Missing files are not: Snakemake reruns a job whose output
    is missing, and rebuilds a missing dep upstream (a fresh clone, where nothing is built, forces nothing)."""
    return (bool(changes["params"]) or bool(changes["other"])
            or any(change == "modified" for kind in ("outs", "deps") for change in changes[kind].values()))


def changed_paths(changes: dict, kind: str, modified_only: bool = False) -> dict[str, str]:
    """A stage's changed `kind` ("outs" or "deps") paths as {path: change}, a modified directory replaced by the
    files that changed inside it where they are known. modified_only: leave out missing and new paths (whatever
    changed inside a modified directory stays)."""
    out: dict[str, str] = {}
    for path, change in changes[kind].items():
        if modified_only and change != "modified":
            continue
        inner = {p: c for p, c in changes["files"].items() if p == path or p.startswith(path + "/")}
        out.update(inner if change == "modified" and inner else {path: change})
    return out


def describe(changes: dict) -> list[str]:
    """A stage's changes as short reasons: 'results/x deleted', 'params train.lr modified', 'changed command'."""
    reasons = ([f"{path} {change}" for path, change in changed_paths(changes, "outs").items()]
               + [f"{path} {change}" for path, change in changed_paths(changes, "deps").items()]
               + [f"params {key} {change}" for key, change in changes["params"].items()] + changes["other"])
    return sorted(reasons, key=lambda r: r.endswith((" deleted", " new")))    # what forces the rerun first


# Which dvc.lock entry each stage's Snakemake records (.snakemake/metadata: the params, code, inputs and input checksums
# its triggers compare) were written for, and those records as they were then: {stage: _records_digest}. Written by
# the onsuccess commit for the stages a run recorded, and by RunGuard after it refreshes Snakemake's records
# (refresh_snakemake_records). A stage whose entry in dvc.lock, or whose Snakemake records, are not the ones noted
# here has outputs Snakemake did not make in the run it remembers: `git checkout OLD && dvc checkout` restored
# another run (issue 34 item 7), `dvc repro` built them, or a failed or killed job rewrote the records.
SNAKEMAKE_RECORDS = Path(".snakemake") / "prefpipe_lock_entries.json"
# Snakemake-only rerun triggers (rule params named env_*, which DVC cannot hash): {stage: its value now, from the
# run's params}. A stage whose Snakemake record holds another value is never refreshed: Snakemake reruns it, rightly.
def _env_triggers(params: dict) -> dict[str, str]:
    from stages.lib.environment import installed_fingerprint
    return {"environment": installed_fingerprint(params["train"])}


def entry_digest(entry) -> str:
    import hashlib
    import json
    return hashlib.sha256(json.dumps(entry, sort_keys=True, default=str).encode()).hexdigest()


def _noted_entries(root: Path) -> dict[str, str]:
    import json
    try:
        noted = json.loads((root / SNAKEMAKE_RECORDS).read_text())
    except (OSError, ValueError):
        return {}
    return noted if isinstance(noted, dict) else {}


def _records_digest(root: Path, entry) -> str:
    """A stage's dvc.lock entry together with Snakemake's metadata files of its outs, as they are now. Snakemake
    rewrites a job's metadata even when the job fails (a refused `probe.size`: its params then name the refused
    value), and a killed run leaves what it wrote: the note no longer matches, so the next run refreshes the records
    dvc.lock still vouches for instead of rerunning from there (issue 34)."""
    import hashlib
    digest = hashlib.sha256(entry_digest(entry).encode())
    outs = entry.get("outs", []) if isinstance(entry, dict) else []
    for out in sorted(str(o.get("path", "")) for o in outs if isinstance(o, dict)):
        try:
            data = _snakemake_metadata(root, out).read_bytes()
        except OSError:
            data = b"absent"
        digest.update(out.encode() + b"\0" + hashlib.sha256(data).digest())
    return digest.hexdigest()


def note_snakemake_records(root: Path, recorded: dict, stages) -> None:
    """Note that Snakemake's records of `stages`' outputs now describe their entries in `recorded` (dvc.lock)."""
    import json
    noted = _noted_entries(root)
    noted.update({name: _records_digest(root, recorded[name]) for name in stages if name in recorded})
    path = root / SNAKEMAKE_RECORDS
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(noted, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _snakemake_metadata(root: Path, output: str) -> Path:
    """Where Snakemake's file backend keeps its record of `output` (.snakemake/metadata/<base64 of the path>)."""
    import base64
    return root / ".snakemake" / "metadata" / base64.urlsafe_b64encode(output.encode()).decode()


def _snakemake_params(root: Path, output: str) -> list | None:
    """The params Snakemake recorded for `output` (.snakemake/metadata, its file backend), or None."""
    import json
    try:
        record = json.loads(_snakemake_metadata(root, output).read_text())
    except (OSError, ValueError):
        return None
    return record.get("params") if isinstance(record, dict) else None


def refresh_snakemake_records(repo, root: Path, recorded: dict, matching: list[str], log) -> list[str]:
    """Bring Snakemake's records of the stages dvc.lock vouches for (`matching`: every dep, param, command and out
    as recorded) in line with that record, where they were written for another entry (SNAKEMAKE_RECORDS): after
    `git checkout OLD && dvc checkout` the workspace is the older run, but Snakemake's records are of its own last
    run, so its params/input/code triggers (and its mtime trigger: the restored files are newer than their
    dependents, with other checksums recorded) would rerun what dvc.lock says is up to date. `snakemake --touch`
    restricted to those stages (--allowed-rules) records the current params, code and inputs and orders their
    mtimes, exactly as after `dvc repro` (sync_dvc.py --record-for-snakemake). Nothing else is vouched for: a stage
    whose bytes, params or command differ is not matching (it is forced instead), and a stage whose Snakemake-only
    trigger (env_*: the installed packages) recorded another value is left to Snakemake. Returns the stages
    refreshed."""
    import subprocess
    noted = _noted_entries(root)
    behind = [name for name in matching if noted.get(name) != _records_digest(root, recorded[name])]
    if not behind:
        return []
    # And every matching stage downstream of those: touching an output makes it newer than what reads it, and a
    # reader whose checksum of it Snakemake cannot compare (files over its checksum size) would rerun for that.
    stages = dvc_adapter.pipeline_stages(repo)
    owner = {out.fs_path: stage.name for stage in stages for out in stage.outs}
    readers = {stage.name: {owner[dep.fs_path] for dep in stage.deps if dep.fs_path in owner}
               for stage in stages if stage.name}
    grown = True
    while grown:
        more = [name for name in matching if name not in behind and readers.get(name, set()) & set(behind)]
        behind += more
        grown = bool(more)
    outs = {stage.name: [out.path for out in stage.outs if not out.persist]   # persisted logs are no Snakemake outputs
            for stage in stages if stage.name in behind}
    try:
        params = yaml.load((root / "params.yaml").read_text(encoding="utf-8"), Loader=FAST_SAFE_LOADER)
        env_now = _env_triggers(params)
    except Exception as e:  # noqa: BLE001 -- no value to compare: such stages are left to Snakemake's trigger
        log(f"integrity: the installed-packages trigger could not be computed ({type(e).__name__}: {e})")
        env_now = None
    refresh = []
    for name in behind:
        if env_now is None and name == "environment":
            continue
        if env_now is not None and name in env_now:
            recorded_params = _snakemake_params(root, outs[name][0]) if outs[name] else None
            if recorded_params is None or repr(env_now[name]) not in recorded_params:
                continue                 # the packages changed since Snakemake recorded it: Snakemake reruns it
        if outs[name]:
            refresh.append(name)
    if not refresh:
        return []
    targets = [path for name in refresh for path in outs[name]]
    env = {**os.environ, INSIDE_DVC: "1"}             # no guard, lock or commit in the bookkeeping run
    env.pop(HELD_LOCK, None)
    done = subprocess.run([sys.executable, "-m", "snakemake", "--touch", "--cores", "1", "--quiet", "all",
                           "--allowed-rules", *refresh, "--", *targets], cwd=root, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        tail = " ".join(done.stderr.split())[-400:]
        log(f"integrity: Snakemake's records of {', '.join(refresh)} could not be refreshed (snakemake --touch "
            f"failed: {tail}); Snakemake may rerun them")
        return []
    note_snakemake_records(root, recorded, refresh)
    log(f"integrity: {', '.join(refresh)}: the workspace is dvc.lock's record, not the run Snakemake remembers "
        "(restored by `git checkout` and `dvc checkout`, or after a failed or killed run): Snakemake's records "
        "refreshed, nothing reruns for it")
    return refresh


def pipeline_status(root: Path = ROOT) -> list[tuple[str, str, list[str]]]:
    """Every dvc.yaml stage, upstream first, with its state by hash (what a Snakemake run would do about it):
    ("up to date", []), ("must rerun", reasons: recorded bytes, params or command changed), ("outputs missing",
    paths: `dvc checkout` restores them from DVC's cache, else the next run rebuilds them), ("rerun after", the
    upstream stages that rerun first), ("not recorded", why: dvc.lock has no entry while outputs of it exist: the
    next run rebuilds it) or ("never run", []: dvc.lock records no run of it). One DVC session, as
    RunGuard's start-up check (`prefpipe status`)."""
    recorded = read_lockfile(root)
    with dvc_session(root) as repo:
        if repo is None:
            raise IntegrityError(f"{root} is no DVC repository (no .dvc/, or DVC cannot open it): nothing is "
                                 "recorded to compare with")
        stages = [s for s in dvc_adapter.pipeline_stages(repo) if s.name]
        changes = stage_changes(repo, recorded)
        unrecorded = unrecorded_outputs(repo, recorded) if recorded else {}
        owner = {out.fs_path: s.name for s in stages for out in s.outs}
        upstream = {s.name: sorted({owner[d.fs_path] for d in s.deps if d.fs_path in owner}
                                   - {s.name}) for s in stages}
    order: list[str] = []
    while len(order) < len(upstream):        # dvc.yaml's order, each stage after the stages it reads from
        order.append(next((n for n in upstream if n not in order and set(upstream[n]) <= set(order)),
                          next(n for n in upstream if n not in order)))
    rows, redo = [], set()
    for name in order:
        ch = changes.get(name)
        before = [u for u in upstream[name] if u in redo]
        if name in unrecorded:
            rows.append((name, "not recorded", [f"{LOCKFILE} has no entry for it, yet its outputs exist: "
                                                f"{', '.join(unrecorded[name])}"]))
        elif name not in recorded:
            rows.append((name, "never run", []))
        elif ch is not None and content_changed(ch):
            rows.append((name, "must rerun", describe(ch)))
        elif before:
            rows.append((name, "rerun after", before))
        elif ch is not None:
            rows.append((name, "outputs missing", sorted(p for p, c in changed_paths(ch, "outs").items()
                                                         if c == "deleted") or describe(ch)))
        else:
            rows.append((name, "up to date", []))
        if rows[-1][1] != "up to date":
            redo.add(name)
    return rows


def guards_this_process(workflow) -> bool:
    """Only Snakemake's main process of a user's run checks and locks: not jobs on cluster nodes (their own
    Snakemake processes), not `dvc repro`'s bookkeeping calls, not sync_dvc.py's DAG build."""
    return (workflow.is_main_process and not os.environ.get(INSIDE_DVC) and not os.environ.get(DAG_ONLY))


def requested_targets() -> list[str] | None:
    """The targets of this `snakemake` command line (None: the default target, i.e. everything; also for an API
    caller, whose targets a Snakefile cannot see)."""
    program = Path(sys.argv[0]).name if sys.argv else ""
    if program not in ("snakemake", "__main__.py"):
        return None
    from snakemake.cli import get_argument_parser
    given, _ = get_argument_parser().parse_known_args(sys.argv[1:])
    return list(given.targets) or None


def needed_stages(repo, targets: list[str] | None) -> set[str] | None:
    """The dvc.yaml stages a run of `targets` (rule names or output paths) builds or reads: the targets' stages and
    everything upstream of them. None: all of them (no targets, `all`, or a target no stage makes)."""
    if not targets:
        return None
    stages = {stage.name: stage for stage in dvc_adapter.pipeline_stages(repo) if stage.name}
    outs = {out.def_path.rstrip("/"): name for name, stage in stages.items() for out in stage.outs}

    def producer(path: str) -> str | None:
        path = os.path.normpath(path)
        return next((name for out, name in outs.items() if path == out or path.startswith(out + "/")), None)

    todo = []
    for target in targets:
        name = target if target in stages else producer(target)
        if name is None:
            return None
        todo.append(name)
    needed: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            todo += [up for dep in stages[name].deps if (up := producer(dep.def_path)) is not None]
    return needed


class RunGuard:
    """What a Snakemake run holds from start-up to its end: DVC's repository lock, and the stages it must rerun."""

    def __init__(self, root: Path = ROOT, targets: list[str] | None = None, log=None):
        """targets: what this run was asked to build (None: everything). A stale stage outside those and their
        upstream is reported and left alone: forcing it would widen the run beyond what was asked."""
        self.root = root
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._session = None
        recorded = read_lockfile(root)
        self._session = dvc_session(root)
        repo = self._session.__enter__()
        self._session.prefpipe_repo = repo
        # A dry run has no onsuccess/onerror: give the lock back at exit, before the interpreter tears DVC down.
        atexit.register(self.release)
        already = {name for name in os.environ.get(FORCED, "").split(",") if name}
        self.stale: dict[str, list[str]] = {}
        needed = None
        try:
            matching: list[str] = []
            if repo is not None and recorded:
                every = stage_changes(repo, recorded)
                changes = {name: ch for name, ch in every.items() if content_changed(ch)}
                self.stale = {name: describe(ch) for name, ch in changes.items()}
                unrecorded = unrecorded_outputs(repo, recorded)
                matching = [stage.name for stage in dvc_adapter.pipeline_stages(repo) if stage.name in recorded
                            and stage.name not in every and stage.name not in unrecorded]
                for name, paths in unrecorded.items():
                    self.stale[name] = [f"{LOCKFILE} has no entry for it, yet its outputs exist "
                                        f"({', '.join(paths[:3])}{', ...' if len(paths) > 3 else ''}): outputs "
                                        "nobody recorded are no evidence, so they are rebuilt"]
                needed = needed_stages(repo, targets)
        except BaseException:
            self.release()
            raise
        self.rerun_incomplete = False
        self.refreshed: list[str] = []
        if repo is not None:
            for name, paths in self._recover_killed_run(repo).items():
                self.stale.setdefault(name, []).append(
                    f"a killed run left {', '.join(paths[:3])}{' ...' if len(paths) > 3 else ''} incomplete")
            if matching and not self.rerun_incomplete:
                try:
                    self.refreshed = refresh_snakemake_records(repo, root, recorded, matching, self._log)
                except BaseException:
                    self.release()
                    raise
        self.forced = sorted(name for name in self.stale if needed is None or name in needed)
        for name, reasons in self.stale.items():
            # The process started again by rerun_forcing said all this already (only something new is news).
            if name not in already and (FORCED not in os.environ or name in self.forced):
                shown = "; ".join(reasons[:4]) + (f"; and {len(reasons) - 4} more" if len(reasons) > 4 else "")
                verdict = "must rerun" if name in self.forced else "is not needed for these targets, left as it is"
                self._log(f"integrity: {name} {verdict}: it no longer matches {LOCKFILE} ({shown})")
        self.unforced = sorted(set(self.forced) - already)

    def _recover_killed_run(self, repo) -> dict[str, list[str]]:
        """What a run killed by kill -9, Ctrl-C or SIGTERM leaves behind, made good, saying so. Every Snakemake run
        of this checkout that runs jobs holds DVC's repository lock for its whole life (this class; `dvc repro`
        holds it too, and its rwlock while a stage command runs), and this process now holds it and no dvc stage
        is running: so a Snakemake lock in .snakemake/locks belongs to no living run and is removed. Outputs
        Snakemake marked incomplete (.snakemake/incomplete) are rebuilt: the command runs again with
        --rerun-incomplete (rerun_forcing), and their stages are forced: Snakemake alone would not rerun a stage
        whose outputs are missing while the final target exists ("Nothing to be done"). Returns {stage: its
        incomplete outputs}."""
        smk = self.root / ".snakemake"
        stale_locks = sorted((smk / "locks").glob("*.lock")) if (smk / "locks").is_dir() else []
        if stale_locks:
            for path in stale_locks:
                path.unlink(missing_ok=True)
            self._log("integrity: removed Snakemake's lock left by a killed run (.snakemake/locks): DVC's repository "
                      "lock was free, so no snakemake or dvc run is using this checkout")
        marks = sorted((smk / "incomplete").iterdir()) if (smk / "incomplete").is_dir() else []
        if not marks:
            return {}
        import base64
        names = []
        for mark in marks:
            try:
                names.append(base64.urlsafe_b64decode(mark.name.encode()).decode())
            except (ValueError, UnicodeDecodeError):
                names.append(mark.name)
        self.rerun_incomplete = "--rerun-incomplete" not in sys.argv and "--ri" not in sys.argv
        by_stage: dict[str, list[str]] = {}
        for stage in dvc_adapter.pipeline_stages(repo):
            for out in stage.outs:
                hits = [n for n in names if n == out.def_path or n.startswith(out.def_path.rstrip("/") + "/")]
                if hits and stage.name:
                    by_stage.setdefault(stage.name, []).extend(hits)
        if self.rerun_incomplete:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            self._log(f"integrity: a killed run left incomplete outputs ({shown}): their jobs run again "
                      "(--rerun-incomplete)")
        return by_stage

    def release(self) -> None:
        """Give DVC's lock back (at the run's end, or when it fails)."""
        if self._session is not None:
            session, self._session = self._session, None
            session.__exit__(None, None, None)

    def handed_lock(self) -> tuple[int, dict] | None:
        """(descriptor, environment) with which a child process (the onsuccess commit: sync_dvc.py --commit-lock)
        shares this run's hold on DVC's lock (subprocess pass_fds): the lock is never free between the run and
        its record. None when no lock is held."""
        repo = getattr(self._session, "prefpipe_repo", None)
        fd = getattr(repo, "prefpipe_lock_fd", None)
        if fd is None:
            return None
        return fd, {**os.environ, HELD_LOCK: f"{fd}:{os.getpid()}"}

    def commit_stages(self, ran: list[str], dag: list[str]) -> int:
        """`sync_dvc.py --commit-lock` of the stages `ran` (the Snakefile's onsuccess and onerror records), in a
        process that shares this run's hold on DVC's lock -> its exit code. `dag`: the run's DAG; a stage outside it
        (a targeted run such as `snakemake --cores 2 judge`) is reported by the record when its outputs no longer
        match, never a reason to fail the run that did its work."""
        import subprocess
        handed = self.handed_lock()
        return subprocess.run([sys.executable, "workflow/sync_dvc.py", "--commit-lock", "--ran", *ran, "--dag", *dag],
                              pass_fds=(handed[0],) if handed else (), env=handed[1] if handed else None).returncode

    def watch_jobs(self) -> None:
        """Start the watchdog (`python workflow/integrity.py --watch-jobs-of PID`): when this Snakemake process
        ends (kill -9 included), whatever it started that still runs (a stage's torchrun and its workers) is
        terminated, and killed 10 s later if still there: a stage's processes die with the run that started them."""
        import subprocess
        read_end, write_end = os.pipe()          # the write end is not inherited: only this process holds it
        subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--watch-jobs-of", str(os.getpid())],
                         stdin=read_end, stdout=subprocess.DEVNULL, start_new_session=True)
        os.close(read_end)
        RunGuard._watch_pipe = write_end         # kept open for this process's whole life, exec aside

    def rerun_forcing(self) -> None:
        """Start this same Snakemake command again with the stale stages added to --forcerun (what the user would
        type), replacing this process: Snakemake fixes --forcerun before the Snakefile is read, so a Snakefile can
        only ask for it this way. The stale stages and everything downstream of them then rerun, and a dry run
        lists them as forced. Only for the `snakemake` command line; an API caller is told what to pass."""
        forced = sorted(set(self.forced) | {n for n in os.environ.get(FORCED, "").split(",") if n})
        program = Path(sys.argv[0]).name if sys.argv else ""
        if program not in ("snakemake", "__main__.py"):
            raise IntegrityError(f"stages {', '.join(self.unforced)} no longer match {LOCKFILE}: run them with "
                                 f"--forcerun {' '.join(forced)}")
        from snakemake.cli import get_argument_parser
        argv = sys.argv[1:]
        given, _ = get_argument_parser().parse_known_args(argv)
        rules = sorted(set(given.forcerun or []) | set(forced))     # the last --forcerun wins: pass the union
        extra = (["--forcerun", *rules] if rules else []) + (["--rerun-incomplete"] if self.rerun_incomplete else [])
        self._log(f"integrity: running again as `snakemake {' '.join([*argv, *extra])}`")
        env = {**os.environ, FORCED: ",".join(forced)}
        handed = self.handed_lock()
        if handed is not None:                  # DVC's lock stays held across the exec (flock: the open file's)
            os.set_inheritable(handed[0], True)
            env[HELD_LOCK] = f"{handed[0]}:{os.getpid()}"
        else:
            self.release()
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "snakemake", *argv, *extra], env)


def _children(pid: int) -> list[int]:
    """The direct children of `pid` (every thread's: Snakemake starts jobs from worker threads)."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _start_time(pid: int) -> str | None:
    """A process's start time in clock ticks (/proc/PID/stat field 22): a PID reused later has another."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _tree(pids: list[int]) -> list[int]:
    """`pids` and every process below them now (from /proc's parent links)."""
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent_of[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.append(pid)
            todo += [child for child, parent in parent_of.items() if parent == pid]
    return found


def watch_jobs_of(pid: int, poll: float = 0.1, grace: float = 10.0) -> int:
    """The watchdog's loop (RunGuard.watch_jobs): note `pid`'s children every `poll` seconds until its pipe closes
    (the process ended or exec'd), then terminate those still running (same start time) and everything below them;
    kill what is left after `grace` seconds. Only processes noted while `pid` lived are touched, never a process
    `pid` started after an exec (its own watchdog notes those)."""
    import select
    import signal
    import time
    noted: dict[int, str] = {}
    while True:
        ready, _, _ = select.select([0], [], [], poll)
        if ready and not os.read(0, 1):
            break
        for child in _children(pid):
            if child not in noted and (started := _start_time(child)) is not None:
                noted[child] = started
    alive = [child for child, started in noted.items() if _start_time(child) == started]
    victims = [p for p in _tree(alive) if p != os.getpid()]
    if not victims:
        return 0
    print(f"integrity: snakemake (pid {pid}) ended with its jobs still running: terminating {len(victims)} "
          f"processes it started (pids {' '.join(map(str, sorted(victims)))})", file=sys.stderr, flush=True)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for victim in victims:
            try:
                os.kill(victim, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while sig == signal.SIGTERM and time.monotonic() < deadline and any(_alive(v) and not _zombie(v) for v in victims):
            time.sleep(0.1)
    return 0


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--watch-jobs-of":
    sys.exit(watch_jobs_of(int(sys.argv[2])))
