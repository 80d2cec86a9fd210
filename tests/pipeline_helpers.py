"""Helpers of the tests that run the real pipeline: a fresh-clone copy of this checkout in a temporary git
repository, and a command runner that shows the output's tail when a command fails."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import yaml

from conftest import REPO_ROOT

# Where libraries keep first-run caches (matplotlib's font list, HF, Triton, DVC's site cache): dropped when a
# command runs with its own `home`, so HOME decides them all. The e2e story runs with an empty HOME, as a stranger's
# first run does: a stage whose tracked output depends on such a cache (matplotlib once logged "generated new
# fontManager" into logs/report.log) fails the golden check, and a warm rerun must then change nothing.
CACHE_VARS = ("MPLCONFIGDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "HF_HOME", "HF_HUB_CACHE", "TRITON_CACHE_DIR",
              "TORCHINDUCTOR_CACHE_DIR", "TORCH_HOME")


def sh(*cmd: str, cwd: Path, home: Path | None = None) -> str:
    """Run `cmd` in `cwd` (as a user would: no PREFPIPE_INSIDE_DVC), return stdout + stderr; a failure raises
    with the output's tail. `home`: an own HOME, with the cache variables above unset."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFPIPE_INSIDE_DVC")}
    if home is not None:
        home.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in env.items() if k not in CACHE_VARS} | {"HOME": str(home)}
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}")
    return r.stdout + r.stderr


def copy_checkout(dst: Path) -> Path:
    """The files a fresh clone has (tracked + untracked-but-not-ignored), in a new git repository."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO_ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = REPO_ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    sh("git", "init", "-q", cwd=dst)
    sh("git", "-c", "user.email=ci@example.com", "-c", "user.name=ci", "add", "-A", cwd=dst)
    sh("git", "-c", "user.email=ci@example.com", "-c", "user.name=ci", "commit", "-qm", "clone", cwd=dst)
    return dst


def commit(repo: Path, msg: str) -> None:
    sh("git", "-c", "user.email=ci@example.com", "-c", "user.name=ci", "add", "-A", cwd=repo)
    # --allow-empty: a run that reproduces the committed record changes no tracked file (the golden check).
    sh("git", "-c", "user.email=ci@example.com", "-c", "user.name=ci", "commit", "--allow-empty", "-qm", msg, cwd=repo)


def dvc_changed_stages(repo: Path) -> set[str]:
    status = json.loads(sh("dvc", "status", "--json", cwd=repo).strip().splitlines()[-1] or "{}")
    return {name.split(":")[-1] for name in status}


def lock_outs(text: str) -> dict[str, str]:
    doc = yaml.safe_load(text)
    return {f"{name}:{o['path']}": o.get("md5") for name, st in doc["stages"].items() for o in st.get("outs", [])}


def finished_default_run(tmp_path_factory) -> Path:
    """A folder holding `repo` (a fresh-clone copy of this checkout, run to its end with `snakemake --cores 2` as
    README's first command runs it) and `home` (the empty HOME it ran with, holding the caches that run left), built
    once per pytest session: the tests that need a finished run to break or extend (test_faults, the e2e story)
    copy it (copy_finished_run) instead of running the whole default again each (minutes each on 2 cores).

    Under pytest-xdist both workers share it: it lives beside their own temp folders (the session's), and a file
    lock makes the second worker wait for the first one's build rather than run the default a second time beside
    it. A failed build is remembered (its output) and raised again to every test that asks, not retried."""
    import fcntl
    import time
    base = tmp_path_factory.getbasetemp()
    # With xdist, getbasetemp() is this worker's folder inside the session's; without, it is the session's own
    # (its parent is shared by every earlier session: a run built by older code must never be found there).
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "finished_default_run"
    shared.mkdir(exist_ok=True)
    with open(shared / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # held while building; the other worker waits here
        done, failed = shared / ".built", shared / ".failed"
        if failed.exists():
            raise AssertionError(f"the shared default run failed to build (in another test):\n{failed.read_text()}")
        if not done.exists():
            repo = shared / "repo"
            shutil.rmtree(repo, ignore_errors=True)
            repo.mkdir()
            t0 = time.monotonic()
            try:
                copy_checkout(repo)
                sh("snakemake", "--cores", "2", cwd=repo, home=shared / "home")
            except AssertionError as e:
                failed.write_text(str(e))
                raise
            done.write_text(f"built in {time.monotonic() - t0:.0f} s\n")
    return shared


def copy_finished_run(tmp_path_factory, dst: Path) -> tuple[Path, Path]:
    """This test's own copy of the session's finished default run (finished_default_run): (repo, home) under `dst`.
    copytree keeps every file's mtime (Snakemake decides by them) and the links DVC may have made; the copy has new
    inodes, so DVC's state db (keyed by inode, mtime and size) re-hashes each file once."""
    shared = finished_default_run(tmp_path_factory)
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("repo", "home"):
        shutil.copytree(shared / name, dst / name, symlinks=True)
    return dst / "repo", dst / "home"
