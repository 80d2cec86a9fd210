"""Every use of DVC's internal Python APIs (dvc, dvc_data), behind small named functions: the one module a DVC upgrade
can break (issue 35 item 5).

DVC's Python API beyond `dvc.api` is internal: `Repo.index.stages`, an Output's `workspace_status()`, the cache's
`oid_to_path` and `check`, `Lockfile.dump_stages`, `lock_repo` change between releases without notice. The
workflow needs them (integrity.py compares every stage with dvc.lock in one locked session, sync_dvc.py writes
dvc.lock's bytes as `dvc commit` does), so they are all here, and tests/workflow/test_dvc_adapter.py calls each
function against the installed (locked) DVC in a tiny real repository, failing with the name of the DVC call that
changed. Nothing else in workflow/, prefpipe/ or stages/ imports dvc or dvc_data (that test greps for it); the `dvc`
command line, a public interface, is used as usual.

What the rest of the workflow sees: a stage as a `Stage` (its name, outs and deps as `Item`s with their paths: plain
data), and, for what only DVC can do with them (hash, compare, save, commit, dump), the DVC objects they carry
(`handle`), passed back in here untouched. DVC is imported inside the functions, never at import: it is optional for
a Snakemake-only user, and the Snakefile imports integrity.py (and so this module) at every start.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator


class CannotOpen(Exception):
    """DVC refused to open the repository (dvc.exceptions.DvcException); str() is DVC's first line."""


class LockBusy(Exception):
    """Another process holds the repository's DVC lock (dvc.lock.LockError from dvc.repo.lock_repo)."""


@dataclass(frozen=True)
class Item:
    """An out or a dep of a stage (DVC's Output, or a dependency built on it), as dvc.yaml names it."""
    def_path: str                   # as dvc.yaml writes it (Output.def_path)
    fs_path: str | None             # absolute (Output.fs_path)
    path: str | None                # fs_path relative to the repository's root (Repo.root_dir)
    persist: bool                   # `persist: true` (Output.persist)
    handle: Any = field(repr=False, compare=False)   # the DVC object, for the functions below

    @property
    def exists(self) -> bool:
        """Whether it is in the workspace now (Output.exists: a .dvcignore'd path is not), read at each call."""
        return self.handle.exists


@dataclass(frozen=True)
class Stage:
    """A dvc.yaml stage (dvc.stage.PipelineStage): its name (None for a .dvc file's stage), outs (outs, metrics,
    plots: Stage.outs) and deps (files and params: Stage.deps), in dvc.yaml's order."""
    name: str | None
    outs: tuple[Item, ...]
    deps: tuple[Item, ...]
    handle: Any = field(repr=False, compare=False)


# ---- the repository and its lock ---------------------------------------------------------------------------------

def installed() -> bool:
    """Whether DVC can be imported (dvc.repo.Repo, dvc.repo.lock_repo, dvc.lock.LockError)."""
    try:
        from dvc.lock import LockError  # noqa: F401
        from dvc.repo import Repo, lock_repo  # noqa: F401
    except ImportError:
        return False
    return True


def open_repo(root: Path):
    """dvc.repo.Repo of `root` (opened from inside it, as the dvc command does); CannotOpen when DVC refuses
    (dvc.exceptions.DvcException: e.g. .dvc/ without git)."""
    from dvc.exceptions import DvcException
    from dvc.repo import Repo
    with contextlib.chdir(root):
        try:
            return Repo(".")
        except DvcException as e:
            raise CannotOpen(str(e).splitlines()[0]) from e


@contextlib.contextmanager
def opened(repo) -> Iterator:
    """The Repo as its own context manager (Repo.__enter__/__exit__: closes its state db and file systems)."""
    with repo:
        yield repo


def take_lock(repo) -> Callable[[], None]:
    """Take the repository lock `dvc repro` takes (dvc.repo.lock_repo: .dvc/tmp/lock); returns the function that
    gives it back. LockBusy when another process holds it (dvc.lock.LockError)."""
    from dvc.lock import LockError
    from dvc.repo import lock_repo
    ctx = lock_repo(repo)
    try:
        ctx.__enter__()
    except LockError as e:
        raise LockBusy(str(e)) from e
    return lambda: ctx.__exit__(None, None, None)


def lock_fd(repo) -> int | None:
    """The descriptor of the open lock file the repository lock holds (Repo.lock._lock._fp: DVC's flock), so that it
    can be handed on to another process; None when DVC holds no such file."""
    return repo.lock._lock._fp.fileno() if getattr(repo.lock, "_lock", None) else None


def adopt_held_lock(repo) -> None:
    """Make `repo` count as locked without locking (the lock is held through a descriptor handed on): DVC's own
    asserts (rwlocked) see Repo.lock as locked (dvc.lock.LockNoop), and Repo._lock_depth = 1 keeps a @locked DVC
    call inside from locking again."""
    from dvc.lock import LockNoop
    repo.lock = LockNoop()
    repo.lock.lock()
    repo._lock_depth = 1


def root_dir(repo) -> str:
    """The repository's root (Repo.root_dir)."""
    return repo.root_dir


def quiet_logging() -> None:
    """Importing dvc sets its logger to INFO: import it first (when installed), then quiet it, as `dvc commit --quiet`
    (no "Updating lock file")."""
    import logging
    try:
        import dvc.repo  # noqa: F401
    except ImportError:
        pass
    logging.getLogger("dvc").setLevel(logging.WARNING)


# ---- the stages --------------------------------------------------------------------------------------------------

def pipeline_stages(repo) -> list[Stage]:
    """Every stage of the repository (Repo.index.stages), in dvc.yaml's order, as plain data."""
    root = repo.root_dir

    def item(obj) -> Item:
        fs_path = getattr(obj, "fs_path", None)
        return Item(def_path=obj.def_path, fs_path=fs_path,
                    path=os.path.relpath(fs_path, root) if fs_path is not None else None,
                    persist=bool(getattr(obj, "persist", False)), handle=obj)

    return [Stage(name=getattr(s, "name", None), outs=tuple(item(o) for o in s.outs),
                  deps=tuple(item(d) for d in s.deps), handle=s) for s in repo.index.stages]


def workspace_status(item: Item) -> dict:
    """{path: change} between dvc.lock's record of an out or dep and the workspace (Output.workspace_status: a change
    is 'modified', 'deleted' or 'new'; a params dep gives {params.yaml: {key: change}}); {} when they match."""
    return item.handle.workspace_status()


def command_changed(stage: Stage) -> bool:
    """Whether the stage's command (or dvc.yaml's definition) differs from dvc.lock's (Stage.changed_stage)."""
    return stage.handle.changed_stage()


def save_and_commit(stage: Stage) -> None:
    """What `dvc commit --force` does per stage (dvc/repo/commit.py): Stage.save (hash deps and outs), then
    Stage.commit(relink=True) (outs into the cache, relinked)."""
    stage.handle.save()
    stage.handle.commit(relink=True)


def dump_lock_entries(repo, path: str | os.PathLike, stages: list[Stage]) -> None:
    """Write the stages' lock entries into the lock file at `path` (dvc.dvcfile.Lockfile.dump_stages: the bytes `dvc
    commit` writes; other entries kept, a missing file started). Called from the repository's root as cwd, as
    integrity.dvc_session's body runs: DVC checks the stages' paths against it (StagePathOutsideError)."""
    from dvc.dvcfile import Lockfile
    Lockfile(repo, path, verify=False).dump_stages([stage.handle for stage in stages])


def hashes_a_file(item: Item) -> bool:
    """Whether the item is a file or directory DVC hashes (dvc.output.Output.get_hash not overridden: a params dep
    hashes values, not files)."""
    from dvc.output import Output
    return type(item.handle).get_hash is Output.get_hash


def warm_hash(item: Item) -> None:
    """Hash the item into DVC's state db (Output.get_hash), so that a later pass finds it there."""
    item.handle.get_hash()


# ---- records and DVC's cache ---------------------------------------------------------------------------------------

def _hash_info(item: Item):
    return getattr(item.handle, "hash_info", None)


def is_dir_record(item: Item) -> bool:
    """Whether dvc.lock records the item as a directory (Output.hash_info.value ends with .dir)."""
    value = getattr(_hash_info(item), "value", None)
    return isinstance(value, str) and value.endswith(".dir")


def recorded_files(item: Item) -> list[tuple[str, str]]:
    """(workspace path, recorded md5) of each file an out or dep stands for in dvc.lock: the file itself, or each
    file of a directory's recorded listing (Output.get_obj: when its .dir object is in DVC's cache; [] when it is
    not). Output.hash_info's name is md5 or md5-dos2unix for a DVC 3 or DVC 2 record."""
    obj = item.handle
    hash_info = _hash_info(item)
    value = getattr(hash_info, "value", None)
    if not isinstance(value, str) or getattr(hash_info, "name", None) not in ("md5", "md5-dos2unix"):
        return []
    if not value.endswith(".dir"):
        return [(obj.fs_path, value)]
    try:
        listing = obj.get_obj()
    except Exception:  # noqa: BLE001 -- the listing is not at hand: nothing to compare file by file
        return []
    if listing is None:
        return []
    return [(os.path.join(obj.fs_path, *key), entry.value) for key, _, entry in listing]


def changed_files(item: Item) -> dict[str, str]:
    """{relpath: 'modified' | 'deleted' | 'new'} between a directory's recorded listing (DVC's cache holds the
    .dir object once the run was committed: Output.get_obj) and the workspace; {} when the listing is not at hand
    (then the directory itself is named). Uses DVC's own tree build (Output._build, dry run: nothing is written to
    the cache)."""
    obj = item.handle
    try:
        recorded = obj.get_obj()
        if recorded is None:
            return {}
        _, _, current = obj._build(obj.cache, obj.fs_path, obj.fs, obj.hash_name, ignore=obj.dvcignore,
                                   dry_run=True, no_progress_bar=True)
        old = {"/".join(key): hash_info.value for key, _, hash_info in recorded}
        new = {"/".join(key): hash_info.value for key, _, hash_info in current}
    except Exception:  # noqa: BLE001 -- only a nicer message is lost: the directory is still reported as modified
        return {}
    return {rel: "deleted" if rel not in new else "new" if rel not in old else "modified"
            for rel in sorted(set(old) | set(new)) if old.get(rel) != new.get(rel)}


def file_md5(path: str) -> str:
    """The md5 DVC records for a file, from its bytes read now (dvc_data.hashfile.hash.file_md5; never through DVC's
    state db)."""
    from dvc_data.hashfile.hash import file_md5 as md5
    return md5(path)


def uses_cache(item: Item) -> bool:
    """Whether the out is stored in DVC's cache (Output.cache present and Output.use_cache)."""
    return getattr(item.handle, "cache", None) is not None and bool(getattr(item.handle, "use_cache", False))


def object_path(item: Item, oid: str) -> str:
    """Where DVC's cache keeps the object named `oid` (HashFileDB.oid_to_path)."""
    return item.handle.cache.oid_to_path(oid)


def object_md5(item: Item, obj_path: str) -> str:
    """The md5 of a cache object's bytes, through DVC's state db (dvc_data.hashfile.hash.hash_file with the
    cache's fs, hash name and state: re-read only when its inode, mtime or size changed)."""
    from dvc_data.hashfile.hash import hash_file
    cache = item.handle.cache
    _, actual = hash_file(obj_path, cache.fs, cache.hash_name, cache.state)
    return actual.value


def note_hash_in_cache_state(item: Item, path: str, md5: str) -> None:
    """Write `md5` as `path`'s hash into the state db of the out's cache (HashFileDB.state.save with a
    dvc_data HashInfo), so DVC's own commands see the file as it is."""
    from dvc_data.hashfile.hash_info import HashInfo
    cache = item.handle.cache
    cache.state.save(path, cache.fs, HashInfo(cache.hash_name, md5))


def note_hash_in_repo_state(repo, item: Item, path: str, md5: str) -> None:
    """Write `md5` as `path`'s hash into the repository's state db (Repo.state.save on Repo.fs, with a dvc_data
    HashInfo of the item's hash name: Output.hash_info.name)."""
    from dvc_data.hashfile.hash_info import HashInfo
    repo.state.save(path, repo.fs, HashInfo(item.handle.hash_info.name, md5))


def object_root_dir(item: Item) -> str:
    """The root of the repository the item belongs to (Output.repo.root_dir)."""
    return item.handle.repo.root_dir


def drop_if_corrupt(item: Item, oid: str) -> bool:
    """Check the cache object `oid` (HashFileDB.check, which deletes an object that no longer hashes to its name and
    raises dvc_data.hashfile.db.ObjectFormatError): True when it was corrupt (and so removed); False when it is
    sound or absent (FileNotFoundError)."""
    from dvc_data.hashfile.db import ObjectFormatError
    try:
        item.handle.cache.check(oid)
    except ObjectFormatError:
        return True
    except FileNotFoundError:
        return False
    return False
