"""Faults users meet, replayed on the real pipeline (issue 26): real snakemake, real DVC, real kills by PID.

One workspace is built once (a fresh-clone copy of this checkout, `snakemake --cores 2`: the committed record),
then each scenario breaks it the way users do and checks that the next run rebuilds or refuses naming the file,
never reports success on wrong bytes, and leaves the committed record again: dvc.lock byte-identical to this
checkout's, `dvc status` clean, `report verify --workspace .` passing. The scenarios run in file order on the one
workspace (pytest-xdist's --dist loadfile keeps a file on one worker), each leaving it as it found it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from pipeline_helpers import copy_checkout, dvc_changed_stages, sh

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    repo = copy_checkout(tmp_path_factory.mktemp("faults") / "repo")
    sh("snakemake", "--cores", "2", cwd=repo)
    assert_is_the_record(repo)
    return repo


def run(repo: Path, *cmd: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFPIPE_")}
    return subprocess.run(cmd, cwd=repo, capture_output=True, text=True, env=env, timeout=timeout)


def assert_is_the_record(repo: Path) -> None:
    """The workspace is the committed record: same dvc.lock bytes, DVC agrees, the bundle verifies."""
    assert (repo / "dvc.lock").read_text() == (REPO_ROOT / "dvc.lock").read_text(), "dvc.lock is not the record"
    assert dvc_changed_stages(repo) == set()
    out = sh(sys.executable, "-m", "stages.report", "verify", "results/report/evidence.tar.gz", "--workspace", ".",
             cwd=repo)
    assert "DIFFERS" not in out, out


def flip_bit(path: Path, offset_fraction: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * offset_fraction)] ^= 0x04
    path.write_bytes(bytes(data))


def test_flipped_bits_in_outputs_are_rebuilt_not_recorded(workspace):
    """A bit flipped in the reference log-probs, the train tokens and the exported reward model: the next run
    names each file, rebuilds it (and what depends on it), and the record is the committed one again. Before,
    Snakemake retrained on the corrupted values and the onsuccess commit recorded their hashes."""
    repo = workspace
    flipped = ["results/ref_logps/ref_logps.parquet", "results/tokens/train_tokens.parquet",
               "results/train_rm/model/model.safetensors"]
    for rel in flipped:
        flip_bit(repo / rel)
    dry = run(repo, "snakemake", "-n", "--cores", "2")
    assert dry.returncode == 0, dry.stderr[-3000:]
    for rel in flipped:
        assert f"{rel} modified" in dry.stderr, dry.stderr[-3000:]
    assert "--forcerun" in dry.stderr
    done = run(repo, "snakemake", "--cores", "2")
    assert done.returncode == 0, done.stderr[-4000:]
    assert_is_the_record(repo)


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


@pytest.mark.parametrize("stage, after", [("train_dpo", 3.0), ("evaluate", 0.5)])
def test_a_stage_killed_mid_rerun_is_rebuilt_by_the_next_run(workspace, stage, after):
    """kill -9 of a stage's process during a rerun (an OOM, a node lost): Snakemake deletes the partial outputs and
    fails; the next plain run rebuilds them (metrics/*.json included, for evaluate) and the record is whole."""
    repo = workspace
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFPIPE_")}
    proc = subprocess.Popen(["snakemake", "--cores", "2", "--forcerun", stage], cwd=repo, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _kill_when_running(proc, f"stages[.]{stage} ", after)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    done = run(repo, "snakemake", "--cores", "2")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Nothing to be done" not in done.stdout + done.stderr
    assert_is_the_record(repo)


def test_an_in_place_edit_of_the_reference_is_refused_naming_the_file(workspace):
    """A same-size in-place edit of the pinned reference's weights (the directory's mtime does not change, so
    Snakemake never saw it): verify_ref reruns and refuses, naming the file; restoring it gives the record back."""
    repo = workspace
    weights = repo / "models/tiny-qwen2/model.safetensors"
    identity, log = repo / "results/ref/ref_identity.json", repo / "logs/verify_ref.log"
    saved = {p: (p.read_bytes(), p.stat()) for p in (weights, identity, log)}
    flip_bit(weights, 0.9)
    try:
        out = run(repo, "snakemake", "--cores", "2")
        assert out.returncode != 0
        # The start-up check names the directory (a dep's listing is not in DVC's cache); verify_ref names the file.
        assert "integrity: verify_ref must rerun" in out.stderr and "models/tiny-qwen2" in out.stderr, out.stderr[-3000:]
        assert "models/tiny-qwen2/model.safetensors: content hash mismatch" in log.read_text()
        assert not identity.exists()          # the refused stage left no identity for later stages to trust
    finally:
        # Back as it was, mtimes included (a rerun of verify_ref would rebuild everything after it: minutes).
        for path, (data, st) in saved.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    dry = run(repo, "snakemake", "-n", "--cores", "2")
    assert "Nothing to be done" in dry.stdout + dry.stderr
    assert_is_the_record(repo)


def test_an_empty_dvc_lock_is_refused_naming_it(workspace):
    """What a crash mid-write used to leave (dvc.lock at 0 bytes): the next run refuses, naming it and the fix,
    instead of saying "Nothing to be done"."""
    repo = workspace
    lock = (repo / "dvc.lock").read_bytes()
    (repo / "dvc.lock").write_bytes(b"")
    try:
        out = run(repo, "snakemake", "--cores", "2")
        assert out.returncode != 0
        assert "dvc.lock is empty" in out.stderr and "git checkout dvc.lock" in out.stderr, out.stderr[-2000:]
    finally:
        (repo / "dvc.lock").write_bytes(lock)
    assert_is_the_record(repo)


def test_snakemake_and_dvc_repro_never_run_at_once(workspace):
    """Whichever starts second is refused, naming the lock, and runs nothing (before, DVC retrained beside
    Snakemake and then failed with a traceback)."""
    repo = workspace
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFPIPE_")}
    first = subprocess.Popen(["snakemake", "--cores", "1", "--forcerun", "train_rm"], cwd=repo, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(first, "stages[.]train_rm ")
        second = run(repo, "dvc", "repro", timeout=120)
        assert second.returncode != 0
        assert "Unable to acquire lock" in second.stderr + second.stdout
        assert "Running stage" not in second.stdout
        third = run(repo, "snakemake", "--cores", "1", timeout=120)
        assert third.returncode != 0 and ".dvc/tmp/lock" in third.stderr, third.stderr[-2000:]
    finally:
        first.wait(timeout=600)
    assert first.returncode == 0, first.stderr.read()[-3000:]
    assert_is_the_record(repo)
