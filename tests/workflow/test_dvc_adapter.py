"""workflow/dvc_adapter.py, the one module that uses DVC's internal Python APIs (issue 35 item 5), against the
installed DVC (requirements/lock.txt's pins): every adapter function is called in a tiny real repository (git init,
dvc init, two stages built by `dvc repro`), and each assertion names the DVC call it relies on, so that a DVC
upgrade that changes one fails here, naming it, instead of somewhere in a pipeline run. Also: the installed dvc
packages are the locked ones, and nothing outside the adapter imports dvc or dvc_data.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT
from pipeline_helpers import sh

sys.path.insert(0, str(REPO_ROOT / "workflow"))
import dvc_adapter  # noqa: E402

needs_tools = pytest.mark.skipif(shutil.which("dvc") is None or shutil.which("git") is None,
                                 reason="needs the dvc and git commands")

# `make` reads a file and a param and writes a file; `split` reads that and writes a directory of two files, a
# metric (cache: false) and a persisted log: every kind of out and dep the pipeline's dvc.yaml has.
DVC_YAML = {
    "stages": {
        "make": {"cmd": "cat knob.txt knob.txt > out/made.txt", "deps": ["knob.txt"], "params": ["k"],
                 "outs": ["out/made.txt"]},
        "split": {"cmd": "mkdir -p out/dir && cp out/made.txt out/dir/a.txt && echo b > out/dir/b.txt"
                         " && echo '{\"n\": 2}' > out/m.json && echo ran > out/split.log",
                  "deps": ["out/made.txt"],
                  "outs": ["out/dir", {"out/split.log": {"persist": True}}],
                  "metrics": [{"out/m.json": {"cache": False}}]},
    }
}
LOCKED = ("dvc", "dvc-data", "dvc-objects")      # the distributions whose internals the adapter calls


def changed(call: str, detail: str) -> str:
    """The failure message: the DVC call the adapter relies on, and what it did instead."""
    return f"{call} changed: {detail}"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The tiny repository, built once by `dvc repro` (each test works on its own copy)."""
    repo = tmp_path_factory.mktemp("dvcrepo") / "repo"
    (repo / "out").mkdir(parents=True)
    (repo / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML, sort_keys=False))
    (repo / "params.yaml").write_text("k: 1\n")
    (repo / "knob.txt").write_text("one\n")
    sh("git", "init", "-q", cwd=repo)
    sh("dvc", "init", "-q", cwd=repo)
    sh("dvc", "repro", "-q", cwd=repo)
    return repo


@pytest.fixture
def repo_dir(built, tmp_path) -> Path:
    dst = tmp_path / "repo"
    shutil.copytree(built, dst, symlinks=True)
    return dst


def stage_named(stages, name):
    found = [s for s in stages if s.name == name]
    assert len(found) == 1, changed("Repo.index.stages / PipelineStage.name", f"{[s.name for s in stages]}")
    return found[0]


def item_named(items, def_path):
    found = [i for i in items if i.def_path == def_path]
    assert len(found) == 1, changed("Stage.outs / Stage.deps / Output.def_path", f"{[i.def_path for i in items]}")
    return found[0]


# ---- the pins, and the one place DVC is imported -------------------------------------------------------------------

def test_the_installed_dvc_packages_are_the_locked_ones():
    lock = (REPO_ROOT / "requirements" / "lock.txt").read_text()
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^\s\\;]+)", lock, flags=re.M))
    pins = {name.lower().replace("_", "-"): version for name, version in pins.items()}
    differ = []
    for name in LOCKED:
        assert name in pins, f"requirements/lock.txt pins no {name}: the adapter's DVC calls are checked against it"
        installed = metadata.version(name)
        if installed != pins[name]:
            differ.append(f"{name}: installed {installed}, requirements/lock.txt pins {pins[name]}")
    assert not differ, ("the DVC the adapter was checked against is not the one installed ("
                        + "; ".join(differ) + "): install the lock (pip install -r requirements/lock.txt), or, "
                        "upgrading on purpose, rerun tests/workflow/test_dvc_adapter.py and update the lock")


# An import of DVC's Python packages: `import dvc`, `from dvc.repo import ...`, `import dvc_data.x`,
# importlib.import_module("dvc..."). `import dvc_adapter` is not one.
DVC_IMPORT = re.compile(r"^\s*(?:import|from)\s+(?:dvc|dvc_data|dvc_objects)(?:\.|\s|,|$)"
                        r"|^\s*import\s+.*,\s*(?:dvc|dvc_data|dvc_objects)(?:\.|\s|,|$)"
                        r"|import_module\(\s*[\"'](?:dvc|dvc_data|dvc_objects)(?:\.|[\"'])"
                        r"|__import__\(\s*[\"'](?:dvc|dvc_data|dvc_objects)(?:\.|[\"'])")


def test_the_pattern_finds_dvc_imports_and_only_those():
    for line in ("import dvc", "import dvc.repo", "from dvc.repo import Repo", "    from dvc_data.hashfile import x",
                 "import os, dvc", "importlib.import_module('dvc.output')", "from dvc_objects.fs import LocalFileSystem"):
        assert DVC_IMPORT.search(line), line
    for line in ("import dvc_adapter", "from dvc_adapter import open_repo", "# dvc.lock records", "x = 'dvc repro'",
                 "import dvcx"):
        assert not DVC_IMPORT.search(line), line


def test_nothing_outside_the_adapter_imports_dvc():
    """Every use of DVC's internal APIs is in workflow/dvc_adapter.py (the `dvc` command line aside)."""
    files = [REPO_ROOT / "Snakefile", *sorted((REPO_ROOT / "workflow" / "rules").glob("*.smk"))]
    for tree in ("workflow", "prefpipe", "stages", "bench"):
        files += sorted((REPO_ROOT / tree).rglob("*.py"))
    adapter = REPO_ROOT / "workflow" / "dvc_adapter.py"
    found = [f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}"
             for path in files if path != adapter and "__pycache__" not in path.parts
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if DVC_IMPORT.search(line)]
    assert not found, ("DVC's Python packages imported outside workflow/dvc_adapter.py (put the call behind a "
                       "function there, with its case in tests/workflow/test_dvc_adapter.py): " + "; ".join(found))


# ---- the repository and its lock -------------------------------------------------------------------------------------

@needs_tools
def test_open_lock_and_hand_on(repo_dir, tmp_path):
    assert dvc_adapter.installed(), changed("import dvc.repo (Repo, lock_repo) / dvc.lock.LockError", "not importable")
    before = os.getcwd()
    repo = dvc_adapter.open_repo(repo_dir)
    assert os.getcwd() == before, "open_repo must leave the working directory as it was"
    with dvc_adapter.opened(repo) as same:
        assert same is repo, changed("dvc.repo.Repo.__enter__", f"returned {same!r}")
        assert Path(dvc_adapter.root_dir(repo)) == repo_dir, changed("dvc.repo.Repo.root_dir", dvc_adapter.root_dir(repo))
        release = dvc_adapter.take_lock(repo)
        try:
            fd = dvc_adapter.lock_fd(repo)
            assert isinstance(fd, int), changed("dvc.repo.lock_repo / Repo.lock._lock._fp (the held lock file)", repr(fd))
            assert os.fstat(fd).st_ino == (repo_dir / ".dvc" / "tmp" / "lock").stat().st_ino, changed(
                "Repo.lock._lock._fp", "the descriptor is not .dvc/tmp/lock")
            other = dvc_adapter.open_repo(repo_dir)
            with dvc_adapter.opened(other), pytest.raises(dvc_adapter.LockBusy):
                dvc_adapter.take_lock(other)        # dvc.lock.LockError, raised by lock_repo while we hold it
        finally:
            release()
        again = dvc_adapter.open_repo(repo_dir)
        with dvc_adapter.opened(again):
            dvc_adapter.take_lock(again)()          # given back: another session takes it
            dvc_adapter.adopt_held_lock(again)
            assert again.lock.is_locked and again._lock_depth == 1, changed(
                "dvc.lock.LockNoop / Repo._lock_depth", "a handed-on lock does not count as held")
    (tmp_path / "plain" / "sub").mkdir(parents=True)
    with pytest.raises(dvc_adapter.CannotOpen):    # no .dvc/ up the tree: dvc.exceptions.NotDvcRepoError
        dvc_adapter.open_repo(tmp_path / "plain" / "sub")


def test_quiet_logging():
    import logging
    dvc_adapter.quiet_logging()
    assert logging.getLogger("dvc").level == logging.WARNING, changed("importing dvc.repo (its logger)", "still loud")


# ---- the stages --------------------------------------------------------------------------------------------------

@needs_tools
def test_pipeline_stages_are_plain_data(repo_dir):
    with dvc_adapter.opened(dvc_adapter.open_repo(repo_dir)) as repo:
        stages = dvc_adapter.pipeline_stages(repo)
        assert [s.name for s in stages] == ["make", "split"], changed(
            "dvc.repo.Repo.index.stages / PipelineStage.name", f"{[s.name for s in stages]}")
        make, split = stages
        assert [o.def_path for o in split.outs] == ["out/dir", "out/split.log", "out/m.json"], changed(
            "Stage.outs (outs, then metrics) / Output.def_path", f"{[o.def_path for o in split.outs]}")
        assert [d.def_path for d in make.deps] == ["knob.txt", "params.yaml"], changed(
            "Stage.deps (files, then params) / Output.def_path", f"{[d.def_path for d in make.deps]}")
        for item in (*make.outs, *make.deps, *split.outs, *split.deps):
            assert item.fs_path == str(repo_dir / item.def_path), changed("Output.fs_path", item.fs_path)
            assert item.path == item.def_path, changed("Output.fs_path relative to Repo.root_dir", item.path)
            assert item.exists is True, changed("Output.exists", f"{item.def_path} said missing")
        assert [o.persist for o in split.outs] == [False, True, False], changed(
            "Output.persist", f"{[o.persist for o in split.outs]}")
        os.unlink(repo_dir / "out" / "made.txt")
        assert make.outs[0].exists is False, changed("Output.exists", "a deleted out said present")


@needs_tools
def test_workspace_status_and_command_changed(repo_dir):
    with dvc_adapter.opened(dvc_adapter.open_repo(repo_dir)) as repo:
        make, split = dvc_adapter.pipeline_stages(repo)
        for item in (*make.outs, *make.deps, *split.outs, *split.deps):
            status = dvc_adapter.workspace_status(item)
            assert status == {}, changed("Output.workspace_status", f"{item.def_path} after dvc repro: {status}")
        assert dvc_adapter.command_changed(make) is False, changed("Stage.changed_stage", "True after dvc repro")
    (repo_dir / "knob.txt").write_text("two\n")
    (repo_dir / "params.yaml").write_text("k: 2\n")
    (repo_dir / "out" / "dir" / "b.txt").write_text("B\n")
    (repo_dir / "out" / "dir" / "c.txt").write_text("c\n")
    os.unlink(repo_dir / "out" / "m.json")
    dvc_yaml = yaml.safe_load((repo_dir / "dvc.yaml").read_text())
    dvc_yaml["stages"]["make"]["cmd"] += " && true"
    (repo_dir / "dvc.yaml").write_text(yaml.safe_dump(dvc_yaml, sort_keys=False))
    with dvc_adapter.opened(dvc_adapter.open_repo(repo_dir)) as repo:
        make, split = dvc_adapter.pipeline_stages(repo)
        knob, params = make.deps
        status = dvc_adapter.workspace_status(knob)
        assert status == {"knob.txt": "modified"}, changed("Output.workspace_status (a file dep)", f"{status}")
        status = dvc_adapter.workspace_status(params)
        assert status == {"params.yaml": {"k": "modified"}}, changed(
            "ParamsDependency.workspace_status", f"{status}")
        directory, _, metric = split.outs
        status = dvc_adapter.workspace_status(directory)
        assert status == {"out/dir": "modified"}, changed("Output.workspace_status (a directory out)", f"{status}")
        status = dvc_adapter.workspace_status(metric)
        assert status == {"out/m.json": "deleted"}, changed("Output.workspace_status (a deleted metric)", f"{status}")
        assert dvc_adapter.command_changed(make) is True, changed("Stage.changed_stage", "an edited cmd unseen")
        assert dvc_adapter.is_dir_record(directory) and not dvc_adapter.is_dir_record(knob), changed(
            "Output.hash_info.value (a directory's ends with .dir)", "")
        files = dvc_adapter.changed_files(directory)
        assert files == {"b.txt": "modified", "c.txt": "new"}, changed(
            "Output.get_obj / Output._build(cache, fs_path, fs, hash_name, ignore=, dry_run=, no_progress_bar=)",
            f"{files}")


# ---- records and DVC's cache -------------------------------------------------------------------------------------

@needs_tools
def test_recorded_files_and_hashes(repo_dir):
    with dvc_adapter.opened(dvc_adapter.open_repo(repo_dir)) as repo:
        make, split = dvc_adapter.pipeline_stages(repo)
        made = make.outs[0]
        md5 = hashlib.md5((repo_dir / "out" / "made.txt").read_bytes()).hexdigest()
        assert dvc_adapter.file_md5(made.fs_path) == md5, changed("dvc_data.hashfile.hash.file_md5", "not the md5")
        assert dvc_adapter.recorded_files(made) == [(made.fs_path, md5)], changed(
            "Output.hash_info (name md5, value)", f"{dvc_adapter.recorded_files(made)}")
        listing = dvc_adapter.recorded_files(split.outs[0])
        expected = [(str(repo_dir / "out" / "dir" / name),
                     hashlib.md5((repo_dir / "out" / "dir" / name).read_bytes()).hexdigest())
                    for name in ("a.txt", "b.txt")]
        assert sorted(listing) == expected, changed("Output.get_obj (a .dir object's (key, meta, HashInfo) entries)",
                                                    f"{listing}")
        assert dvc_adapter.recorded_files(make.deps[1]) == [], changed("ParamsDependency.hash_info", "names files")
        assert dvc_adapter.uses_cache(made) and not dvc_adapter.uses_cache(split.outs[2]), changed(
            "Output.cache / Output.use_cache", "a cached out or a `cache: false` metric misjudged")
        assert Path(dvc_adapter.object_root_dir(made)) == repo_dir, changed("Output.repo.root_dir", "")
        obj = dvc_adapter.object_path(made, md5)
        assert Path(obj).is_relative_to(repo_dir / ".dvc" / "cache") and os.path.isfile(obj), changed(
            "Output.cache.oid_to_path", obj)
        assert dvc_adapter.object_md5(made, obj) == md5, changed(
            "dvc_data.hashfile.hash.hash_file(path, cache.fs, cache.hash_name, cache.state)", "not the object's md5")
        assert dvc_adapter.drop_if_corrupt(made, md5) is False and os.path.isfile(obj), changed(
            "HashFileDB.check", "a sound object reported corrupt")
        assert dvc_adapter.drop_if_corrupt(made, "0" * 32) is False, changed(
            "HashFileDB.check", "a missing object did not raise FileNotFoundError")
        os.chmod(obj, 0o644)
        Path(obj).write_text("corrupt\n")
        assert dvc_adapter.object_md5(made, obj) != md5, changed("dvc_data.hashfile.hash.hash_file", "stale hash")
        assert dvc_adapter.drop_if_corrupt(made, md5) is True and not os.path.exists(obj), changed(
            "HashFileDB.check (dvc_data.hashfile.db.ObjectFormatError, the object removed)", "a corrupt object kept")


@needs_tools
def test_hashes_noted_in_the_state_db(repo_dir):
    """A hash written into DVC's state db is what DVC's own workspace compare then sees (the file is untouched)."""
    with dvc_adapter.opened(dvc_adapter.open_repo(repo_dir)) as repo:
        make, split = dvc_adapter.pipeline_stages(repo)
        made, knob = make.outs[0], make.deps[0]
        dvc_adapter.note_hash_in_cache_state(made, made.fs_path, "f" * 32)
        status = dvc_adapter.workspace_status(made)
        assert status == {"out/made.txt": "modified"}, changed(
            "Output.cache.state.save(path, cache.fs, dvc_data HashInfo(cache.hash_name, md5))", f"{status}")
        dvc_adapter.note_hash_in_repo_state(repo, knob, knob.fs_path, "e" * 32)
        status = dvc_adapter.workspace_status(knob)
        assert status == {"knob.txt": "modified"}, changed(
            "Repo.state.save(path, Repo.fs, dvc_data HashInfo(Output.hash_info.name, md5))", f"{status}")


@needs_tools
def test_save_commit_and_dump_write_what_dvc_commit_writes(repo_dir):
    (repo_dir / "knob.txt").write_text("two\n")
    subprocess.run("cat knob.txt knob.txt > out/made.txt", shell=True, cwd=repo_dir, check=True)
    before = (repo_dir / "dvc.lock").read_bytes()
    ours = repo_dir / ".dvc" / "tmp" / "ours.lock"
    shutil.copyfile(repo_dir / "dvc.lock", ours)
    # In the repository's root, as integrity.dvc_session's body runs (DVC resolves a stage's paths from the cwd).
    with contextlib.chdir(repo_dir), dvc_adapter.opened(dvc_adapter.open_repo(repo_dir)) as repo:
        release = dvc_adapter.take_lock(repo)
        try:
            make, split = dvc_adapter.pipeline_stages(repo)
            items = [i for i in (*make.deps, *make.outs) if dvc_adapter.hashes_a_file(i)]
            assert [i.def_path for i in items] == ["knob.txt", "out/made.txt"], changed(
                "dvc.output.Output.get_hash (a params dep overrides it)", f"{[i.def_path for i in items]}")
            for item in items:
                dvc_adapter.warm_hash(item)
            dvc_adapter.save_and_commit(make)
            md5 = hashlib.md5(b"two\ntwo\n").hexdigest()
            assert os.path.isfile(dvc_adapter.object_path(make.outs[0], md5)), changed(
                "Stage.save / Stage.commit(relink=True)", "the new out is not in DVC's cache")
            dvc_adapter.dump_lock_entries(repo, ours, [make])
        finally:
            release()
    assert (repo_dir / "dvc.lock").read_bytes() == before, changed("dvc.dvcfile.Lockfile(repo, path).dump_stages",
                                                                   "wrote dvc.lock, not the path given")
    entry = yaml.safe_load(ours.read_text())["stages"]
    assert entry["make"]["outs"][0]["md5"] == md5 and entry["split"] == yaml.safe_load(before)["stages"]["split"], \
        changed("dvc.dvcfile.Lockfile.dump_stages", "the entry written, or the one kept, is not as expected")
    sh("dvc", "commit", "--force", "-q", "make", cwd=repo_dir)
    assert ours.read_bytes() == (repo_dir / "dvc.lock").read_bytes(), changed(
        "Stage.save / Stage.commit / dvc.dvcfile.Lockfile.dump_stages",
        "the bytes differ from what `dvc commit --force make` writes")
