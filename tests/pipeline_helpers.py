"""Helpers of the tests that run the real pipeline: a fresh-clone copy of this checkout in a temporary git
repository, and a command runner that shows the output's tail when a command fails."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import yaml

from conftest import REPO_ROOT
from stages.lib.declared_params import ACCESS_LOG_ENV

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


def cap_training_steps(repo: Path, steps: int = 4) -> None:
    """train.max_steps: `steps` in the repo's params.yaml (sft, train_dpo and train_rm each stop after that many
    optimizer steps; every stage still runs): for the tests of the workflow's mechanics (executors, DVC's plots and
    experiments), whose assertions hold for any amount of training, so they do not pay minutes of it. The caller
    runs sync_dvc.py after it, as after any params edit."""
    path = repo / "params.yaml"
    text = path.read_text()
    assert "\ntrain:\n" in text and "max_steps:" not in text.split("\ntrain:\n", 1)[1].split("\n\n", 1)[0]
    path.write_text(text.replace("\ntrain:\n", f"\ntrain:\n  max_steps: {steps}\n", 1))


def shrink_probe(repo: Path, size: int = 64) -> None:
    """probe.size: `size` in the repo's params.yaml (512 by default): for the same tests as cap_training_steps,
    which check how the workflow runs, not what the probe measures. The probe passes of every training stage,
    generate, judge and evaluate scale with it (a capped run's stages took ~16 s less at 64). The caller runs
    sync_dvc.py after it."""
    path = repo / "params.yaml"
    text = path.read_text()
    assert "\nprobe:\n  size: 512\n" in text
    path.write_text(text.replace("\nprobe:\n  size: 512\n", f"\nprobe:\n  size: {size}\n", 1))


def dvc_changed_stages(repo: Path) -> set[str]:
    status = json.loads(sh("dvc", "status", "--json", cwd=repo).strip().splitlines()[-1] or "{}")
    return {name.split(":")[-1] for name in status}


def lock_outs(text: str) -> dict[str, str]:
    doc = yaml.safe_load(text)
    return {f"{name}:{o['path']}": o.get("md5") for name, st in doc["stages"].items() for o in st.get("outs", [])}


def declaration_gaps(reads: dict[str, set[str]], declarations: dict[str, tuple[str, ...]]) -> list[str]:
    """What is wrong with the declarations given the keys each stage read in a run: a read no declared key covers
    (the guard raised), and, deleting each declared key in turn, one whose deletion no read would notice (declared
    for nothing: its changes rerun the stage, and a test could not tell it is needed)."""

    def covered(key: str, declared) -> bool:
        return "*" in declared or any(key == d or key.startswith(d + ".") for d in declared)

    problems = []
    for stage, declared in declarations.items():
        seen = reads.get(stage, set())
        problems += [f"{stage} read `{r}`, undeclared" for r in sorted(seen) if not covered(r, declared)]
        for key in declared:
            rest = [d for d in declared if d != key]
            if seen and all(covered(r, rest) for r in seen) and key != "*":
                problems += [f"{stage}: deleting `{key}` from its declaration fails nothing: no run read it"]
    return problems


def read_access_log(path) -> dict[str, set[str]]:
    reads: dict[str, set[str]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        reads.setdefault(row["stage"], set()).add(row["read"])
    return reads


def assert_declarations_match_reads(log_path, stages_run: set[str]) -> None:
    """Every stage of a run read only declared keys and needed each one (tests/workflow/test_pipeline_e2e.py)."""
    from stages.lib.layout import STAGE_PARAMS

    reads = read_access_log(log_path)
    assert set(reads) >= stages_run - {"report"}, f"stages that never read params: {stages_run - set(reads)}"
    problems = declaration_gaps(reads, {s: STAGE_PARAMS[s] for s in reads})
    assert not problems, "\n".join(problems)


# Killing a stage's process by PID, under one run's own process tree (test_faults.py, test_rounds_e2e.py).

def _descendants(root: int) -> list[int]:
    """The PIDs below `root` in the process tree (from /proc), oldest first: other tests' processes, which a
    pgrep over the machine would also find (pytest-xdist runs two files at once), are never touched."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in sorted(children.get(todo.pop(), [])):
            out.append(child)
            todo.append(child)
    return sorted(out)


def _newest(proc: subprocess.Popen, pattern: str) -> int | None:
    """The newest process under `proc` whose command line matches the regular expression `pattern`."""
    import re
    found = None
    for pid in _descendants(proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if re.search(pattern, cmdline):
            found = pid
    return found


def _wait_for(proc: subprocess.Popen, pattern: str, timeout: float = 300) -> int:
    """The PID of the newest process under `proc` whose command line matches `pattern`, once there is one."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        pid = _newest(proc, pattern)
        if pid is not None:
            return pid
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {pattern!r} started:\n{proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"{pattern!r} never started")


def _kill_when_running(proc: subprocess.Popen, pattern: str, after: float) -> None:
    """kill -9, `after` seconds after it appears, the newest process matching `pattern` (under torchrun: the
    stage's worker, started after its launcher)."""
    pid = _wait_for(proc, pattern)
    time.sleep(after)
    try:
        os.kill(_newest(proc, pattern) or pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def finished_default_run(tmp_path_factory) -> Path:
    """A folder holding `repo` (a fresh-clone copy of this checkout, run to its end with `snakemake --cores 2` as
    README's first command runs it) and `home` (the empty HOME it ran with, holding the caches that run left), built
    once per pytest session: the tests that need a finished run to extend (the e2e story, the rounds, the targeted run)
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
            # Every params key each stage reads is logged (outside the run's outputs): the e2e story holds each
            # stage's declaration to them (assert_declarations_match_reads).
            reads = shared / "params_reads.jsonl"
            reads.unlink(missing_ok=True)
            os.environ[ACCESS_LOG_ENV] = str(reads)
            try:
                copy_checkout(repo)
                sh("snakemake", "--cores", "2", cwd=repo, home=shared / "home")
            except AssertionError as e:
                failed.write_text(str(e))
                raise
            finally:
                os.environ.pop(ACCESS_LOG_ENV, None)
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
