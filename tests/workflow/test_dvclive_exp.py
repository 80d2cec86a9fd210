"""DVCLive in `dvc exp run` (issue 37 item 4), as a user runs it: on a copy of the session's finished default run
(committed, as a user's last run is), `dvc exp run --name live -S dpo.beta=0.2 train_dpo` under an empty HOME; while
it runs, `dvc exp show --json` shows train_dpo's step and loss in the workspace row (results/train_dpo/dvclive/
metrics.json, a top-level metric); the finished experiment shows train_dpo's last step and loss (read from DVC's
cache: results/ is git-ignored); rerunning train_dpo (`dvc repro -f -s train_dpo`, another empty HOME) writes the
same dvclive bytes, and dvc.lock records the same hash. Before: no step or loss column existed at all.

(It once ran the whole capped pipeline from scratch inside the experiment: ~110 CPU-s, two thirds of them stages this
check does not look at. Only the changed stage runs now, as in a user's experiment.)"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from pipeline_helpers import CACHE_VARS, commit, copy_finished_run, sh

pytestmark = pytest.mark.slow

LIVE = "results/{}/dvclive/metrics.json"


def exp_show(repo: Path, env: dict) -> list | None:
    r = subprocess.run(["dvc", "exp", "show", "--json"], cwd=repo, env=env, capture_output=True, text=True)
    lines = r.stdout.strip().splitlines()
    return json.loads(lines[-1]) if r.returncode == 0 and lines else None


def live_metrics(row: dict) -> dict:
    return {k: (v or {}).get("data") for k, v in ((row.get("data") or {}).get("metrics") or {}).items()
            if "/dvclive/" in k}


def test_dvc_exp_show_shows_step_and_loss_while_dvc_exp_run_trains(tmp_path, tmp_path_factory):
    repo, _ = copy_finished_run(tmp_path_factory, tmp_path)
    commit(repo, "the finished default run")
    home = tmp_path / "empty_home"          # not the build's (the copy's `home` holds that run's caches)
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFPIPE_INSIDE_DVC") and k not in CACHE_VARS}
    env["HOME"] = str(home)

    log = tmp_path / "exp_run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["dvc", "exp", "run", "--name", "live", "-S", "dpo.beta=0.2", "train_dpo"], cwd=repo,
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    seen_running = None
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            shown = exp_show(repo, env)
            running = proc.poll() is None          # the experiment was still running after the table was read
            if shown and running and seen_running is None:
                [ws] = [row for row in shown if row["rev"] == "workspace"]
                for path, data in live_metrics(ws).items():
                    if data and "step" in data and "loss" in data:
                        seen_running = (path, data)
            # Each `dvc exp show` is ~2 CPU-s the experiment then lacks; train_dpo's dvclive file is there from its
            # first step to the end of the run (the default's steps: tens of seconds to catch it).
            time.sleep(3)
        assert proc.wait(timeout=max(1, deadline - time.monotonic())) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert seen_running is not None, "dvc exp show never showed a step and a loss while the experiment ran"
    path, data = seen_running
    assert path == LIVE.format("train_dpo") and data["step"] >= 1, seen_running
    ran = log.read_text()
    assert "Running stage 'train_dpo'" in ran and "Running stage 'sft'" not in ran, ran[-3000:]

    # The finished experiment: train_dpo's last step and loss, from DVC's cache.
    shown = exp_show(repo, env)
    revs = [rev for base in shown for exp in base.get("experiments") or [] for rev in exp.get("revs") or []]
    [live] = [rev for rev in revs if rev.get("name") == "live"]
    final = live_metrics(live)[LIVE.format("train_dpo")]
    last = (repo / "results/train_dpo/train_log.csv").read_text().splitlines()
    header, row = last[0].split(","), last[-1].split(",")
    assert final["step"] == int(row[header.index("step")]) >= data["step"], (final, data)
    assert final["loss"] == float(row[header.index("loss")]), final

    # The same bytes again, under another empty HOME; dvc.lock records the same hash.
    live_dir = repo / "results/train_dpo/dvclive"
    # Snakemake's .snakemake_timestamp marker is outside DVC's hash (.dvcignore): the experiment's outputs, restored
    # from DVC's cache, lack it; the repro's `snakemake --touch` writes it.
    def live_files() -> dict:
        return {p.relative_to(live_dir): p.read_bytes() for p in sorted(live_dir.rglob("*"))
                if p.is_file() and p.name != ".snakemake_timestamp"}
    before = live_files()

    def recorded() -> str:
        outs = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["train_dpo"]["outs"]
        return next(o["md5"] for o in outs if o["path"] == "results/train_dpo/dvclive")
    lock_hash = recorded()
    sh("dvc", "repro", "-f", "-s", "train_dpo", cwd=repo, home=tmp_path / "home2")
    after = live_files()
    assert after == before and recorded() == lock_hash
    assert {str(p) for p in before} >= {"metrics.json", "plots/metrics/loss.tsv"}
