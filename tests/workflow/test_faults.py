"""Faults users meet, replayed on the real pipeline (issue 26): real snakemake, real DVC, real kills by PID.

One workspace is built once for this module: a fresh-clone copy of this checkout with `train.max_steps: 40`
(every stage runs, as users run them; the integrity mechanics hold for any amount of training, and each rebuild of
a trainer then costs seconds instead of a minute), run to its end with `snakemake --cores 2` and committed: that
run's dvc.lock is the record. Each scenario breaks it the way users do and checks that the next run rebuilds or
refuses naming the file, never reports success on wrong bytes, and leaves the record again: dvc.lock
byte-identical, `dvc status` clean, every recorded file read back with the bytes of the fixture's run (whose
bundle `report verify --workspace .` passed: the same bytes verify alike, so it is run once). The scenarios run in
file order on the one workspace (pytest-xdist's --dist loadfile keeps a file on one worker), each leaving it as it
found it. That the uncapped default reproduces the committed dvc.lock is test_pipeline_e2e's golden check.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline_helpers import (_descendants, _kill_when_running, _wait_for, cap_training_steps, commit,
                              copy_checkout, dvc_changed_stages, lock_outs, sh)

pytestmark = pytest.mark.slow


# The workspace's record: its committed run's dvc.lock and metrics (the fixture fills it).
RECORD: dict[str, bytes] = {}
RECORDED = ("dvc.lock", "metrics/generation.json")
RECORD_FILES: dict[str, str] = {}       # every recorded output file's md5 (recorded_file_hashes)
FAULTS_MAX_STEPS = 40       # a trainer still runs for seconds: long enough for the kills below to find it alive


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    repo = copy_checkout(tmp_path_factory.mktemp("faults") / "repo")
    cap_training_steps(repo, FAULTS_MAX_STEPS)
    sh(sys.executable, "workflow/sync_dvc.py", cwd=repo)
    sh("snakemake", "--cores", "2", cwd=repo)
    commit(repo, "the record the faults start from")
    RECORD.clear()
    RECORD.update({rel: (repo / rel).read_bytes() for rel in RECORDED})
    RECORD_FILES.clear()
    RECORD_FILES.update(recorded_file_hashes(repo))
    # The bundle checked against the workspace once, here: each scenario then checks that every recorded file has
    # these bytes again (assert_is_the_record), and the same bytes verify the same way (verify's own faults are
    # test_a_bundle_with_an_extra_huge_member's and tests/evidence').
    out = sh(sys.executable, "-m", "stages.report", "verify", "results/report/evidence.tar.gz", "--workspace", ".",
             cwd=repo)
    assert "DIFFERS" not in out, out
    assert_is_the_record(repo)
    return repo


def run(repo: Path, *cmd: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFPIPE_")}
    return subprocess.run(cmd, cwd=repo, capture_output=True, text=True, env=env, timeout=timeout)


def recorded_file_hashes(repo: Path) -> dict[str, str]:
    """md5 of every file dvc.lock records an output of (each file of a directory output, but for what .dvcignore
    keeps out of DVC's hash: Snakemake's .snakemake_timestamp markers, written by one tool and not the other), of
    params.yaml and of dvc.yaml, read from the bytes now: not DVC's state db, which trusts size, mtime and inode
    (issue 34 item 1)."""
    import hashlib
    outs = [key.split(":", 1)[1] for key in lock_outs((repo / "dvc.lock").read_text())]
    ignored = {line.strip() for line in (repo / ".dvcignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert ignored == {".snakemake_timestamp"}, f"a .dvcignore pattern this check does not follow: {ignored}"
    files = ["params.yaml", "dvc.yaml"]
    for rel in outs:
        path = repo / rel
        files += sorted(str(f.relative_to(repo)) for f in path.rglob("*") if f.is_file() and f.name not in ignored) \
            if path.is_dir() else [rel]
    return {rel: hashlib.md5((repo / rel).read_bytes()).hexdigest() if (repo / rel).is_file() else "missing"
            for rel in files}


def assert_is_the_record(repo: Path) -> None:
    """The workspace is the committed record: same dvc.lock bytes, DVC agrees, and every recorded output has the
    bytes the fixture's run wrote and its bundle verification passed on."""
    assert (repo / "dvc.lock").read_bytes() == RECORD["dvc.lock"], "dvc.lock is not the record"
    assert dvc_changed_stages(repo) == set()
    now = recorded_file_hashes(repo)
    changed = sorted(rel for rel in now.keys() | RECORD_FILES.keys() if now.get(rel) != RECORD_FILES.get(rel))
    assert not changed, f"not the record's bytes: {changed}"


def flip_bit(path: Path, offset_fraction: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * offset_fraction)] ^= 0x04
    path.write_bytes(bytes(data))


def test_flipped_bits_in_outputs_are_rebuilt_not_recorded(workspace):
    """A bit flipped in a parquet output read by later stages, a JSON output and a file inside a directory output:
    the next run names each file, rebuilds it (and what depends on it), and the record is the committed one again.
    Before, Snakemake ran on the corrupted values and the onsuccess commit recorded their hashes (issue 26 flipped
    the reference log-probs, the train tokens and the reward model: the check is the same for every recorded file,
    so files of the cheap late stages are flipped here; a flipped model is test_a_dvc_lock_that_lost_a_stage's)."""
    repo = workspace
    flipped = ["results/generate/generations.parquet", "results/evaluate/bootstrap_summary.json",
               "results/report/curves/dpo_train_curves.png"]
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


# train_rm for the trainer (a torchrun stage like train_dpo, with fewer stages after it to rerun: judge, evaluate,
# report; the kill and the rebuild are the same), evaluate for a plain one.
@pytest.mark.parametrize("stage, after", [("train_rm", 3.0), ("evaluate", 0.5)])
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


# ---------------------------------------------------------------------------------------------------------------
# Issue 34: the faults the first pass still let through, each replayed as the issue writes it.
# ---------------------------------------------------------------------------------------------------------------

def prefpipe_status(repo: Path) -> subprocess.CompletedProcess:
    return run(repo, sys.executable, "-m", "prefpipe.cli", "status")


def lock_md5(repo: Path, stage: str, path: str) -> str:
    import yaml
    stages = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    return next(o["md5"] for o in stages[stage]["outs"] if o["path"] == path)


def test_an_edit_keeping_size_mtime_and_inode_is_refused_not_packed_and_recorded(workspace):
    """Item 1: with DVC's state db filled (`prefpipe status`), one digit of normalize_stats.json changed in place,
    its mtime restored: `snakemake --forcerun report` packed the edited file and recorded the new bundle against the
    old dep hash, rc 0. Now the commit re-reads the inputs report read, refuses naming the file and the fix, dvc.lock
    stays the record, and `prefpipe status` says normalize must rerun."""
    repo = workspace
    assert prefpipe_status(repo).returncode == 0
    stats = repo / "results/normalize/normalize_stats.json"
    original, st = stats.read_bytes(), stats.stat()
    data = bytearray(original)
    i = next(i for i, c in enumerate(data) if chr(c).isdigit())
    data[i] = ord(str((int(chr(data[i])) + 1) % 10))
    with open(stats, "r+b") as f:              # in place: same inode, same size
        f.write(bytes(data))
    os.utime(stats, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (stats.stat().st_ino, stats.stat().st_size, stats.stat().st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    try:
        out = run(repo, "snakemake", "--cores", "1", "--forcerun", "report")
        assert out.returncode != 0, out.stderr[-3000:]
        refusal = [line for line in out.stderr.splitlines() if "refused" in line]
        assert len(refusal) == 1 and "results/normalize/normalize_stats.json" in refusal[0], out.stderr[-3000:]
        assert "snakemake --cores N" in refusal[0] and "normalize" in refusal[0]
        assert (repo / "dvc.lock").read_bytes() == RECORD["dvc.lock"], "the misread run was recorded"
        status = prefpipe_status(repo)
        assert status.returncode == 1, status.stdout
        assert any(line.startswith("normalize ") and "must rerun" in line and "normalize_stats.json" in line
                   for line in status.stdout.splitlines()), status.stdout
    finally:
        stats.write_bytes(original)            # the right bytes, a new mtime: report (which packed the edit) reruns
    done = run(repo, "snakemake", "--cores", "1")
    assert done.returncode == 0, done.stderr[-4000:]
    assert_is_the_record(repo)


def test_a_dvc_lock_that_lost_a_stage_rebuilds_it_instead_of_trusting_its_outputs(workspace):
    """Item 2: train_rm's entry deleted from dvc.lock (a bad merge) and a bit of its model flipped: judge scored with
    the corrupted model and metrics/generation.json changed, rc 0. Now train_rm is rebuilt (said so), and the run
    ends with the committed record: the same entries, metrics/generation.json unchanged."""
    import yaml
    repo = workspace
    lock = (repo / "dvc.lock").read_text()
    doc = yaml.safe_load(lock)
    kept, skipping = [], False
    for line in lock.splitlines(True):         # the entry cut out as text, as a merge leaves the file
        if line.startswith("  ") and not line.startswith("   ") and line.rstrip().endswith(":"):
            skipping = line.strip() == "train_rm:"
        if not skipping:
            kept.append(line)
    (repo / "dvc.lock").write_text("".join(kept))
    assert "train_rm" not in yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    flip_bit(repo / "results/train_rm/model/model.safetensors")
    status = prefpipe_status(repo)
    assert status.returncode == 1 and "train_rm      not recorded" in status.stdout, status.stdout
    done = run(repo, "snakemake", "--cores", "1")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "integrity: train_rm must rerun" in done.stderr and "no entry" in done.stderr, done.stderr[-3000:]
    assert yaml.safe_load((repo / "dvc.lock").read_text()) == doc, "the rebuilt record differs"
    assert (repo / "metrics/generation.json").read_bytes() == RECORD["metrics/generation.json"]
    # DVC appends a re-added entry at the end: the same record, another order; the committed bytes back.
    sh("git", "checkout", "--", "dvc.lock", cwd=repo)
    assert_is_the_record(repo)


def test_a_corrupt_cache_object_restored_by_dvc_checkout_is_not_called_up_to_date(workspace):
    """Item 3: one byte of summary.md's object in .dvc/cache edited, the workspace file deleted, `dvc checkout`:
    `prefpipe status` said all 12 stages up to date. Now status names the file and the corrupt object, the next run
    rebuilds report, and the cache holds the right bytes under that name again."""
    repo = workspace
    md5 = lock_md5(repo, "report", "results/report/summary.md")
    obj = repo / ".dvc/cache/files/md5" / md5[:2] / md5[2:]
    os.chmod(obj, 0o644)
    flip_bit(obj)
    (repo / "results/report/summary.md").unlink()
    sh("dvc", "checkout", "results/report/summary.md", cwd=repo)
    status = prefpipe_status(repo)
    assert status.returncode == 1, status.stdout
    assert "report        must rerun: results/report/summary.md modified: restored from a corrupt cache object" \
        in status.stdout, status.stdout
    done = run(repo, "snakemake", "--cores", "1")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "integrity: report must rerun" in done.stderr
    import hashlib
    assert hashlib.md5(obj.read_bytes()).hexdigest() == md5
    assert_is_the_record(repo)


def _dvc_lock_free(repo: Path) -> bool:
    """Whether DVC's repository lock (flock on .dvc/tmp/lock) could be taken now (given back at once)."""
    import fcntl
    fd = os.open(repo / ".dvc/tmp/lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)                           # closing the only descriptor gives a taken flock back
    return True


def test_dvc_repro_cannot_start_at_any_moment_of_a_snakemake_run(workspace):
    """Item 4: generation.seed changed, `snakemake --cores 1` started, `dvc repro` 12 s later: both ran generate. The
    lock was free while the guard started Snakemake again with --forcerun and before the onsuccess commit. Now DVC's
    lock, probed 20 times a second, is never free from the run's first check until its record is written, and
    whichever starts second is refused, naming the lock, and runs nothing: a second `snakemake`, started as soon as the
    run holds the lock, and the `dvc repro` (before, DVC retrained beside Snakemake and then failed with a traceback).
    The second `snakemake` starts early, beside the wait: started after the `dvc repro`, ~20 s in, it could find a run
    of ~20-25 s already finished (a suite run of aa9bcfb did), and then rightly ran nothing and was not refused."""
    import threading
    repo = workspace
    params = (repo / "params.yaml").read_text()
    gen = params.index("\ngeneration:")
    seed_at = params.index("  seed: ", gen)
    line_end = params.index("\n", seed_at)
    (repo / "params.yaml").write_text(params[:seed_at] + "  seed: 12345" + params[line_end:])
    lock_inode = (repo / "dvc.lock").stat().st_ino
    free_seen: list[float] = []
    proc = subprocess.Popen(["snakemake", "--cores", "1"], cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={k: v for k, v in os.environ.items() if not k.startswith("PREFPIPE_")})
    t0 = time.monotonic()

    def probe() -> None:
        held_once = False
        while proc.poll() is None and (repo / "dvc.lock").stat().st_ino == lock_inode:
            free = _dvc_lock_free(repo)
            held_once = held_once or not free
            if held_once and free and (repo / "dvc.lock").stat().st_ino == lock_inode and proc.poll() is None:
                free_seen.append(time.monotonic() - t0)
            time.sleep(0.05)

    prober = threading.Thread(target=probe)
    prober.start()
    third = None
    try:
        while _dvc_lock_free(repo) and proc.poll() is None and time.monotonic() - t0 < 300:
            time.sleep(0.1)
        assert proc.poll() is None, "the run ended before it was seen holding DVC's lock: nothing was checked"
        third = subprocess.Popen(["snakemake", "--cores", "1"], cwd=repo, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True,
                                 env={k: v for k, v in os.environ.items() if not k.startswith("PREFPIPE_")})
        # 12 s in, as the user did, and once the run holds DVC's lock: on a loaded machine Snakemake's own
        # start-up (before its first check takes the lock) can take longer than 12 s, and a `dvc repro` started
        # before it would rightly win the lock and make this run the one refused.
        while (time.monotonic() - t0 < 12 or _dvc_lock_free(repo)) and proc.poll() is None \
                and time.monotonic() - t0 < 300:
            time.sleep(0.1)
        second = run(repo, "dvc", "repro", timeout=120)
        assert second.returncode != 0, second.stdout[-2000:]
        assert "Unable to acquire lock" in second.stderr + second.stdout
        assert "Running stage" not in second.stdout
        third_out, third_err = third.communicate(timeout=120)
        # refused naming DVC's lock: only a run holding it refuses so (a finished one would let it run)
        assert third.returncode != 0 and ".dvc/tmp/lock" in third_err, third_err[-2000:]
        assert "Job stats" not in third_out + third_err
        proc.wait(timeout=600)
    finally:
        for p in (proc, third):
            if p is not None and p.poll() is None:
                p.kill()
        prober.join()
        (repo / "params.yaml").write_text(params)
    assert proc.returncode == 0, proc.stderr.read()[-3000:]
    assert not free_seen, f"DVC's lock was free during the run at {free_seen[:5]} s"
    done = run(repo, "snakemake", "--cores", "1")
    assert done.returncode == 0, done.stderr[-4000:]
    assert_is_the_record(repo)


def test_snakemake_is_refused_while_a_dvc_repro_stage_command_runs(workspace):
    """Item 4, the other way round: DVC gives its repository lock back while a stage's command runs, so a Snakemake
    run started then took it and ran beside `dvc repro`. Now it is refused naming DVC's rwlock, and runs nothing."""
    repo = workspace
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFPIPE_")}
    first = subprocess.Popen(["dvc", "repro", "--force", "--single-item", "report"], cwd=repo, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(first, "stages[.]report ")
        second = run(repo, "snakemake", "--cores", "1", "--forcerun", "report", timeout=120)
        assert second.returncode != 0
        assert ".dvc/tmp/rwlock" in second.stderr and "dvc repro" in second.stderr, second.stderr[-2000:]
        assert "Job stats" not in second.stdout + second.stderr
    finally:
        first.wait(timeout=600)
    assert first.returncode == 0, first.stderr.read()[-3000:]
    assert_is_the_record(repo)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# Both signals on train_rm (a torchrun stage: the orphaned-trainer case; train_dpo's reruns add generate).
@pytest.mark.parametrize("stage, sig", [("train_rm", signal.SIGKILL), ("train_rm", signal.SIGINT)])
def test_a_killed_snakemake_takes_its_stage_down_and_the_next_run_recovers(workspace, stage, sig):
    """Items 5 and 6: kill -9 (or Ctrl-C) of snakemake itself during a rerun. The orphaned torchrun trainer wrote
    every output after its snakemake was gone, and the next run stopped (LockException, IncompleteFilesException)
    until --unlock and --rerun-incomplete. Now every process the run started is gone within seconds, and the next
    plain run clears the stale lock, reruns the incomplete job, saying so, and ends with the record."""
    repo = workspace
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFPIPE_")}
    # Its own session, as a terminal's foreground job: Ctrl-C reaches its process group (and Snakemake, cancelling,
    # signals its jobs' group), never the test runner's.
    proc = subprocess.Popen(["snakemake", "--cores", "2", "--forcerun", stage], cwd=repo, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for(proc, f"stages[.]{stage} ")
        time.sleep(3)
        started = _descendants(proc.pid)
        assert any("torchrun" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
                   for p in started if _running(p))
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)           # Ctrl-C: the terminal signals the foreground process group
        else:
            os.kill(proc.pid, sig)             # kill -9 PID: snakemake alone
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 30
    while any(_running(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in started if _running(p)]
    assert not left, f"processes of the killed run still running: {left}"
    done = run(repo, "snakemake", "--cores", "2")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Nothing to be done" not in done.stdout + done.stderr
    if sig == signal.SIGKILL:
        assert "removed Snakemake's lock left by a killed run" in done.stderr, done.stderr[-3000:]
    assert f"integrity: {stage} must rerun" in done.stderr, done.stderr[-3000:]
    assert_is_the_record(repo)


def test_a_params_yaml_that_is_not_utf8_is_refused_in_one_line(workspace):
    """Item 8: a Latin-1 byte in params.yaml gave a UnicodeDecodeError traceback from Snakemake's config load."""
    repo = workspace
    params = (repo / "params.yaml").read_bytes()
    (repo / "params.yaml").write_bytes(params.replace(b"\n", "\n# caf\xe9\n".encode("latin-1"), 1))
    try:
        out = run(repo, "snakemake", "-n", "--cores", "1")
    finally:
        (repo / "params.yaml").write_bytes(params)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and "UnicodeDecodeError" not in out.stderr, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith("Snakefile: refused: params.yaml: not UTF-8 text (byte 0xe9"), \
        out.stderr[-2000:]
    assert_is_the_record(repo)


def test_a_probe_larger_than_the_data_is_refused_before_anything_trains(workspace):
    """Item 10: `probe.size: 100000000` passed the dry run. freeze_probe refuses it in one line naming the numbers and
    the fix (it counts the distinct prompts before the walk) and no later stage runs; with the size back, the
    record is rebuilt."""
    repo = workspace
    params = (repo / "params.yaml").read_text()
    probe_at = params.index("\nprobe:")
    size_at = params.index("  size: ", probe_at)
    end = params.index("\n", size_at)
    kept = [repo / "logs/freeze_probe.log", *sorted((repo / "results/probe").iterdir())]
    saved = {p: (p.read_bytes(), p.stat()) for p in kept}
    later = {p: p.stat().st_mtime_ns for p in (repo / "results/tokens").iterdir()}
    (repo / "params.yaml").write_text(params[:size_at] + "  size: 100000000" + params[end:])
    try:
        out = run(repo, "snakemake", "--cores", "1")
        assert out.returncode != 0
        log = (repo / "logs/freeze_probe.log").read_text()
        assert "freeze_probe: refused:" in log and "probe.size is 100000000" in log and "lower probe.size" in log, log
        assert {p: p.stat().st_mtime_ns for p in (repo / "results/tokens").iterdir()} == later, "tokenize ran"
    finally:
        # Back as it was, mtimes included: the bytes dvc.lock records.
        (repo / "params.yaml").write_text(params)
        for path, (data, st) in saved.items():
            path.parent.mkdir(parents=True, exist_ok=True)      # Snakemake removed the failed job's outputs
            path.write_bytes(data)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    done = run(repo, "snakemake", "--cores", "1")
    assert done.returncode == 0, done.stderr[-4000:]
    # The refused job rewrote Snakemake's record of freeze_probe (its params: the refused size); dvc.lock still
    # vouches for the restored outputs, so the records are refreshed and nothing reruns (before: everything from
    # freeze_probe on, minutes).
    assert "Nothing to be done" in done.stdout + done.stderr, done.stderr[-4000:]
    assert "Snakemake's records refreshed" in done.stderr, done.stderr[-4000:]
    assert_is_the_record(repo)


def _bundle_with_extra_member(src: Path, dst: Path, name: str, size: int, listed_size: int | None = None) -> None:
    """`src`'s members (a bundle the report stage wrote) plus `name`: `size` zero bytes, written and hashed as a
    stream, and the manifest recomputed as a careful forger would (the new member listed with its sha256 and
    `listed_size`, its true size unless given), so every hash adds up."""
    import hashlib
    import io
    import json
    import tarfile

    class Zeros(io.RawIOBase):
        def __init__(self, n: int) -> None:
            self.left = n

        def readable(self) -> bool:
            return True

        def readinto(self, buf) -> int:
            n = min(len(buf), self.left)
            buf[:n] = bytes(n)
            self.left -= n
            return n

    with tarfile.open(src, mode="r:gz") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    manifest = json.loads(members["evidence/manifest.json"])
    sha = hashlib.sha256()
    chunk = bytes(2**20)
    for _ in range(size // len(chunk)):
        sha.update(chunk)
    sha.update(bytes(size % len(chunk)))
    manifest["members"][name] = {"sha256": sha.hexdigest(), "size": size if listed_size is None else listed_size}
    members["evidence/manifest.json"] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    with tarfile.open(dst, mode="w:gz", compresslevel=1) as tar:
        for member in sorted([*members, name]):
            info = tarfile.TarInfo(member)
            if member == name:
                info.size = size
                tar.addfile(info, io.BufferedReader(Zeros(size)))
            else:
                info.size = len(members[member])
                tar.addfile(info, io.BytesIO(members[member]))


def _verify_with_peak_rss(repo: Path, bundle: Path) -> tuple[int, str, int]:
    """`prefpipe verify BUNDLE` in its own process: (rc, output, its peak RSS in bytes, from getrusage)."""
    script = ("import resource, sys\nfrom prefpipe.cli import main\ntry:\n    rc = main(['verify', sys.argv[1]])\n"
              "except SystemExit as e:\n    rc = e.code\nsys.stdout.flush()\n"
              "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
              "sys.exit(rc)\n")
    out = run(repo, sys.executable, "-c", script, str(bundle))
    peak = int(next(line.split()[1] for line in out.stderr.splitlines() if line.startswith("PEAK_RSS_KB")))
    return out.returncode, out.stdout + out.stderr, peak * 1024


def test_a_bundle_with_an_extra_huge_member_differs_naming_it_and_is_streamed(workspace, tmp_path):
    """Item 9: the real bundle with an extra 1.5 GB member of zeros (a few MB gzipped), the manifest recomputed:
    `prefpipe verify` passed (rc 0) at 1.84 GB RSS. Now the member DIFFERS as one no stage writes, it is hashed as a
    stream (peak RSS far below its size), and a member larger than the manifest says is not read past that size."""
    repo = workspace
    genuine = repo / "results/report/evidence.tar.gz"
    rc, out, baseline = _verify_with_peak_rss(repo, genuine)
    assert rc == 0 and "DIFFERS" not in out, out[-3000:]
    size = 1_500_000_000
    padded = tmp_path / "padded.tar.gz"
    _bundle_with_extra_member(genuine, padded, "evidence/padding.bin", size)
    assert padded.stat().st_size < 20 * 2**20
    rc, out, peak = _verify_with_peak_rss(repo, padded)
    assert rc == 1, out[-3000:]
    differs = [line for line in out.splitlines() if line.startswith("DIFFERS")]
    assert differs == ["DIFFERS  evidence/padding.bin: a member no stage writes (report packs params.yaml, "
                       "environment.json, summary.md, probe_sources.json, the curves and the packed artifacts of "
                       "the pipeline's layout)"], out[-3000:]
    # read in 1 MB pieces: the peak is the genuine bundle's verify's, give or take 100 MB, never grown by the member's
    # 1.5 GB (the genuine verify's own peak varies with the environment: 318 MB in one venv, 743 MB in another)
    assert peak < baseline + 100 * 2**20, (peak, baseline)
    # The same member listed at 1 MB: refused once the bound is passed (the tar header already says more).
    lying = tmp_path / "lying.tar.gz"
    _bundle_with_extra_member(genuine, lying, "evidence/padding.bin", 64 * 2**20, listed_size=2**20)
    rc, out, _ = _verify_with_peak_rss(repo, lying)
    assert rc == 1
    assert f"DIFFERS  evidence/padding.bin: {64 * 2**20} bytes in the bundle, the manifest says {2**20}: not read " \
           "past the manifest's size" in out, out[-3000:]


def test_restoring_an_older_committed_run_reruns_nothing(workspace):
    """Item 7: a committed run, a params change run and committed, then `git checkout HEAD~1 -- . && dvc checkout`:
    status and verify said the workspace was right, yet `snakemake -n` planned reruns ("Params have changed"), from
    the records of Snakemake's own last run. Now the start-up check, finding every stage as dvc.lock records it,
    refreshes Snakemake's records of the restored stages: the dry run and the run do nothing, and the workspace
    stays the older record."""
    repo = workspace
    commit(repo, "the committed run")
    params = (repo / "params.yaml").read_text()
    gen = params.index("\ngeneration:")
    seed_at = params.index("  seed: ", gen)
    line_end = params.index("\n", seed_at)
    (repo / "params.yaml").write_text(params[:seed_at] + "  seed: 12345" + params[line_end:])
    second = run(repo, "snakemake", "--cores", "2")
    assert second.returncode == 0, second.stderr[-4000:]
    assert (repo / "dvc.lock").read_bytes() != RECORD["dvc.lock"]
    commit(repo, "generation.seed 12345, run")
    sh("git", "checkout", "HEAD~1", "--", ".", cwd=repo)
    sh("dvc", "checkout", cwd=repo)
    status = prefpipe_status(repo)
    assert status.returncode == 0 and "up to date" in status.stdout.splitlines()[-1], status.stdout
    verify = run(repo, sys.executable, "-m", "prefpipe.cli", "verify", "results/report/evidence.tar.gz",
                 "--workspace", ".")
    assert verify.returncode == 0, verify.stdout[-3000:]
    dry = run(repo, "snakemake", "-n", "--cores", "2")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "Nothing to be done" in dry.stdout + dry.stderr, (dry.stdout + dry.stderr)[-3000:]
    assert "Params have changed" not in dry.stdout + dry.stderr
    assert "Snakemake's records refreshed" in dry.stderr, dry.stderr[-3000:]
    done = run(repo, "snakemake", "--cores", "2")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Nothing to be done" in done.stdout + done.stderr, (done.stdout + done.stderr)[-3000:]
    assert_is_the_record(repo)
    sh("git", "reset", "-q", "--soft", "HEAD~1", cwd=repo)    # HEAD back to the record the other tests restore
    assert sh("git", "status", "--porcelain", cwd=repo) == ""
