"""Iterative DPO end to end (issue 36): the embedded default with dpo.rounds 3, real Snakemake and DVC in a temporary
git repository. Round 3's graded probe success (the embedded_colours grader, on the frozen probe no round samples
from) beats round 1's with the lower 95% bound of the paired difference above 0; every round's parts are DVC stages
recorded in dvc.lock; a second run does nothing; kill -9 of round 2's trainer, then a plain run: round 1 is not
run again and the record is the uninterrupted run's, byte for byte."""
from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import yaml

from pipeline_helpers import _kill_when_running, commit, copy_finished_run, dvc_changed_stages, sh

pytestmark = pytest.mark.slow

ROUND_PARTS = ("pairs", "ref_logps", "train_dpo", "generate", "judge")


def set_rounds(repo, n: int) -> None:
    """dpo.rounds: n in params.yaml (a text edit, so the file's comments stay), then dvc.yaml regenerated from the
    Snakefile (it gains round n's stages)."""
    path = repo / "params.yaml"
    text = path.read_text()
    text, count = re.subn(r"(?m)^(  beta: .*\n)(  rounds: \d+\n)?", rf"\1  rounds: {n}\n", text, count=1)
    assert count == 1
    path.write_text(text)
    sh("python", "workflow/sync_dvc.py", cwd=repo)


@pytest.fixture(scope="module")
def three_rounds(tmp_path_factory):
    # From the session's finished default run (round 1 is that run's train_dpo / generate / judge): only rounds 2
    # and 3 and what reads them (rounds_metrics, report) run here.
    repo, home = copy_finished_run(tmp_path_factory, tmp_path_factory.mktemp("rounds"))
    set_rounds(repo, 3)
    commit(repo, "dpo.rounds 3")
    sh("snakemake", "--cores", "2", cwd=repo, home=home)
    return repo


def test_three_rounds_beat_one_by_the_grader(three_rounds):
    repo = three_rounds

    record = json.loads((repo / "metrics/rounds.json").read_text())
    rounds = record["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    # Round 1 is the offline DPO the default DAG runs: its graded success is metrics/generation.json's.
    generation = json.loads((repo / "metrics/generation.json").read_text())
    assert rounds[0]["graded_success"]["point"] == generation["grader"]["policy_success"]
    diff = rounds[2]["graded_success_diff_vs_round1"]
    assert rounds[2]["graded_success"]["point"] > rounds[0]["graded_success"]["point"]
    assert diff["ci_low"] > 0, diff
    assert record["improved_over_round1"] is True
    for r in rounds[1:]:
        pairs = r["pairs"]
        assert pairs["pairs"] + sum(pairs["rejected"].values()) == pairs["prompts"] > 0

    stages = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    for k in (2, 3):
        for part in ROUND_PARTS:
            assert f"round{k}_{part}" in stages and f"round{k}_{part}" in lock, (k, part)
    assert "rounds_metrics" in lock
    assert dvc_changed_stages(repo) == set()
    assert "Nothing to be done" in sh("snakemake", "-n", "--cores", "2", cwd=repo)


def test_a_kill_in_round_two_reruns_from_round_two_and_ends_with_the_same_bytes(three_rounds):
    repo = three_rounds
    lock, record = (repo / "dvc.lock").read_text(), (repo / "metrics/rounds.json").read_bytes()
    round1 = (repo / "results/train_dpo/model/model.safetensors").stat().st_mtime_ns
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFPIPE_")}
    proc = subprocess.Popen(["snakemake", "--cores", "2", "--forcerun", "round2_train_dpo"], cwd=repo, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # round 2's trainer: the train_dpo process whose command line starts from round 1's export
        _kill_when_running(proc, r"stages[.]train_dpo .*--init-model results/train_dpo/model ", 3.0)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    done = sh("snakemake", "--cores", "2", cwd=repo)
    ran = set(re.findall(r"(?m)^(?:local)?rule (\w+):", done))
    assert ran and all(r.startswith(("round2_", "round3_")) or r in ("rounds_metrics", "report", "all") for r in ran), ran
    assert (repo / "results/train_dpo/model/model.safetensors").stat().st_mtime_ns == round1
    assert (repo / "dvc.lock").read_text() == lock
    assert (repo / "metrics/rounds.json").read_bytes() == record
    assert dvc_changed_stages(repo) == set()
