"""Iterative DPO end to end (issue 36): the embedded default with dpo.rounds 3, real Snakemake and DVC in a temporary
git repository. Round 3's graded probe success (the embedded_colours grader, on the frozen probe no round samples
from) beats round 1's with the lower 95% bound of the paired difference above 0; every round's parts are DVC stages
recorded in dvc.lock; raising dpo.rounds from 2 to 3 runs round 3 only; the rounds' outputs and metrics are the
committed rounds:3 record, bit for bit; a second run does nothing; kill -9 of round 2's trainer, then a plain run:
round 1 and round 2's finished stages are not run again, and the record is the uninterrupted run's, byte for byte. The kill is part of the module's one dpo.rounds 2 run (the rounds are the suite's costliest story)."""
from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from pipeline_helpers import CACHE_VARS, _kill_when_running, commit, copy_finished_run, dvc_changed_stages, sh

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


# The rounds:3 record (tests/workflow/rounds3_record.json): metrics/rounds.json and the outs dvc.lock records for
# every round stage, as a fresh-clone run of the embedded default with dpo.rounds 3 gives them, bit for bit (the
# CPU numerics are portable, docs/ARTIFACTS.md). `PREFPIPE_WRITE_ROUNDS_RECORD=1` rewrites it from this test's run
# (after a change that alters the rounds' bytes, as dvc.lock is regenerated for the default).
ROUNDS_RECORD = Path(__file__).with_name("rounds3_record.json")


def rounds_record(repo) -> dict:
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    outs = {out["path"]: out.get("md5") for name, entry in sorted(lock.items())
            if name.startswith("round") for out in entry.get("outs", [])}
    return {"metrics/rounds.json": json.loads((repo / "metrics/rounds.json").read_text()), "outs": outs}


def ran_rules(output: str) -> set[str]:
    return set(re.findall(r"(?m)^(?:local)?rule (\w+):", output)) - {"all"}


ROUND2_TRAINER = r"stages[.]train_dpo .*--init-model results/train_dpo/model "   # round 2 starts from round 1's


@dataclass
class ThreeRounds:
    repo: Path
    killed: set[str]         # rules of the dpo.rounds 2 run whose round-2 trainer was killed
    killed_said: str         # that run's output
    resumed: set[str]        # rules of the plain run after it
    three: set[str]          # rules of the run after dpo.rounds was raised to 3
    killed_rc: int
    round1_untouched: bool   # round 1's policy export kept its mtime through all three runs


@pytest.fixture(scope="module")
def three_rounds(tmp_path_factory) -> ThreeRounds:
    # From the session's finished default run (round 1 is that run's train_dpo / generate / judge): dpo.rounds 2,
    # whose round-2 trainer is killed (kill -9) 3 s after it starts, then a plain run; then dpo.rounds raised to
    # 3, as a user adds a round. Only the rounds' stages and what reads them (rounds_metrics, report) run.
    repo, home = copy_finished_run(tmp_path_factory, tmp_path_factory.mktemp("rounds"))
    round1 = (repo / "results/train_dpo/model/model.safetensors").stat().st_mtime_ns
    set_rounds(repo, 2)
    commit(repo, "dpo.rounds 2")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFPIPE_") and k not in CACHE_VARS}
    env["HOME"] = str(home)                              # as sh(..., home=home) runs the others
    log = repo.parent / "killed_run.log"
    with open(log, "w") as out:      # a file, not a pipe: a full pipe would stall the run before the kill
        proc = subprocess.Popen(["snakemake", "--cores", "2"], cwd=repo, env=env, stdout=out,
                                stderr=subprocess.STDOUT, text=True)
        try:
            _kill_when_running(proc, ROUND2_TRAINER, 3.0)
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    killed_said = log.read_text()
    resumed = ran_rules(sh("snakemake", "--cores", "2", cwd=repo, home=home))
    set_rounds(repo, 3)
    commit(repo, "dpo.rounds 3")
    three = ran_rules(sh("snakemake", "--cores", "2", cwd=repo, home=home))
    return ThreeRounds(repo, ran_rules(killed_said), killed_said, resumed, three, proc.returncode,
                       (repo / "results/train_dpo/model/model.safetensors").stat().st_mtime_ns == round1)


def test_raising_rounds_from_two_to_three_runs_round_three_only(three_rounds):
    r = three_rounds
    two = r.killed | r.resumed
    assert two == {f"round2_{part}" for part in ROUND_PARTS} | {"rounds_metrics", "report"}, two
    assert r.three == {f"round3_{part}" for part in ROUND_PARTS} | {"rounds_metrics", "report"}, r.three


def test_the_rounds_record_reproduces_bit_for_bit(three_rounds):
    repo = three_rounds.repo
    got = rounds_record(repo)
    if os.environ.get("PREFPIPE_WRITE_ROUNDS_RECORD") == "1":
        ROUNDS_RECORD.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(ROUNDS_RECORD.read_text())
    differing = sorted(path for path in set(want["outs"]) | set(got["outs"])
                       if want["outs"].get(path) != got["outs"].get(path))
    assert not differing, f"round outputs differ from {ROUNDS_RECORD.name}: {differing}"
    assert got["metrics/rounds.json"] == want["metrics/rounds.json"]


def test_three_rounds_beat_one_by_the_grader(three_rounds):
    repo = three_rounds.repo

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


def test_a_kill_in_round_two_reruns_round_two_from_its_trainer_and_ends_with_the_uninterrupted_bytes(three_rounds):
    """kill -9 of round 2's trainer, then a plain run: the failed run recorded the round-2 stages it finished (pairs,
    reference log-probs), so the next run starts at round 2's trainer: round 1 and those are not run again, and the
    record is the uninterrupted run's byte for byte (test_the_rounds_record_reproduces_bit_for_bit: the committed
    record was made without a kill). The trainer itself starts over: rounds.train.save_every (absent: train's, 0)
    would let it resume from its last checkpoint, as every trainer does (tests/engine/test_checkpoint.py)."""
    r = three_rounds
    assert r.killed_rc != 0 and "round2_train_dpo" in r.killed, r.killed
    assert "integrity: the run failed; recorded in dvc.lock the stages it finished: round2_pairs, round2_ref_logps" \
        in r.killed_said, r.killed_said[-3000:]
    assert r.resumed == {"round2_train_dpo", "round2_generate", "round2_judge", "rounds_metrics", "report"}, r.resumed
    assert r.round1_untouched
    assert dvc_changed_stages(r.repo) == set()


def test_dvc_exp_run_with_more_rounds_than_dvc_yaml_has_is_refused_not_recorded(tmp_path, tmp_path_factory):
    """`dvc exp run -S dpo.rounds=N` cannot add round stages: dvc.yaml is generated from the Snakefile for the params
    it was written with, and DVC only reruns the stages whose params changed (report: it reads all of params.yaml).
    Before, that experiment succeeded and recorded dpo.rounds 2 beside one round's results; now the first stage that
    reruns fails, naming the stages dvc.yaml lacks and the command that makes them, and dvc.lock stays as it was."""
    repo, _ = copy_finished_run(tmp_path_factory, tmp_path)
    lock = (repo / "dvc.lock").read_text()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFPIPE_")}
    done = subprocess.run(["dvc", "exp", "run", "-S", "+dpo.rounds=2"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=900)
    said = done.stdout + done.stderr
    assert done.returncode != 0, said[-3000:]
    assert "sync_dvc: refused: dvc.yaml was generated for other params than params.yaml's (stages it lacks: " \
           "round2_generate, round2_judge, round2_pairs, round2_ref_logps, round2_train_dpo, rounds_metrics" in said, \
        said[-3000:]
    assert "run `python workflow/sync_dvc.py`" in said
    assert (repo / "dvc.lock").read_text() == lock
