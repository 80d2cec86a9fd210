"""End to end on the embedded default: real Snakemake and real DVC in a temporary git repository.

One sequential story, as a user lives it: `snakemake --cores 2` reproduces the committed record (dvc.lock and
metrics/, byte for byte: the golden check of the portable CPU numerics), then DVC agrees nothing changed;
`dvc repro` twice does nothing; a dpo.beta change reruns exactly what depends on it (under
`dvc repro`), after which Snakemake agrees nothing is left to do; metrics diff between commits.
"""
from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import yaml

from conftest import REPO_ROOT
from pipeline_helpers import (assert_declarations_match_reads, commit, copy_finished_run, dvc_changed_stages,
                              finished_default_run, lock_outs, sh)

pytestmark = pytest.mark.slow


def test_snakemake_and_dvc_run_one_dag(tmp_path, tmp_path_factory):
    # A fresh-clone copy run with `snakemake --cores 2` and an empty HOME (no matplotlib font cache, no HF cache,
    # nothing from an earlier run): the session builds that once (finished_default_run, shared with test_faults);
    # this test gets its own copy, with the HOME that run left.
    repo, home = copy_finished_run(tmp_path_factory, tmp_path)
    # Each stage read only the params keys it declares, and needed each one (the shared run logged every read).
    assert_declarations_match_reads(finished_default_run(tmp_path_factory) / "params_reads.jsonl",
                                    set(yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]))
    # Golden: a clean checkout, run as README's first command runs it, gives exactly the committed record.
    # Every artifact of the CPU default is portable (docs/ARTIFACTS.md), so this holds on any x86-64 CPU
    # with the locked environment; a stale record (code changed, dvc.lock not regenerated) fails here too.
    committed, produced = (REPO_ROOT / "dvc.lock").read_text(), (repo / "dvc.lock").read_text()
    if produced != committed:
        a, b = lock_outs(committed), lock_outs(produced)
        outs = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        raise AssertionError("the run does not reproduce the committed dvc.lock; differing outs: "
                             f"{outs or 'none (deps/params differ: the record is stale)'}")
    for name in ("dpo", "rm"):
        assert (repo / f"metrics/{name}.json").read_bytes() == (REPO_ROOT / f"metrics/{name}.json").read_bytes(), name
    stages = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    for stage in stages.values():
        for out in stage.get("outs", []):
            path = next(iter(out)) if isinstance(out, dict) else out
            assert (repo / path).exists(), path

    # Snakemake -> DVC: the Snakemake run is recorded in dvc.lock, nothing is "changed".
    assert dvc_changed_stages(repo) == set()
    out = sh("dvc", "repro", cwd=repo)
    assert "Running stage" not in out, out

    assert "Nothing to be done" in sh("snakemake", "-n", "--cores", "2", cwd=repo)
    commit(repo, "first run")

    bundle = (repo / "results/report/evidence.tar.gz").read_bytes()
    report_log, lock = (repo / "logs/report.log").read_bytes(), (repo / "dvc.lock").read_text()
    # An unchanged rerun of the report, now with the caches the first run left in HOME (warm), gives a
    # byte-identical evidence bundle, log and dvc.lock entry.
    sh("dvc", "repro", "--force", "--single-item", "report", cwd=repo, home=home)
    assert (repo / "results/report/evidence.tar.gz").read_bytes() == bundle
    assert (repo / "logs/report.log").read_bytes() == report_log
    assert (repo / "dvc.lock").read_text() == lock
    assert dvc_changed_stages(repo) == set()

    # A training knob reruns train_dpo and what depends on it, nothing upstream of it. (A probe.seed change did the
    # same from freeze_probe down: everything but three stages, minutes of the suite for the same property.)
    params = (repo / "params.yaml").read_text()
    (repo / "params.yaml").write_text(params.replace("beta: 0.1", "beta: 0.2", 1))
    downstream = {"train_dpo", "generate", "judge", "evaluate", "report"}
    changed = dvc_changed_stages(repo)     # the stages reading dpo.beta; generate and judge follow from train_dpo
    assert "train_dpo" in changed and changed <= downstream, changed
    out = sh("dvc", "repro", cwd=repo)
    assert set(re.findall(r"Running stage '(\w+)'", out)) == downstream, out
    # DVC -> Snakemake: after DVC reran the stages, Snakemake agrees there is nothing to do. First with the start-up
    # guard off (PREFPIPE_INSIDE_DVC, as on a cluster node): the agreement is the records each DVC stage command
    # wrote (sync_dvc.py --record-for-snakemake), not the guard's refresh of them at the next start, which would hide
    # a record that was never written.
    unguarded = subprocess.run(["snakemake", "-n", "--cores", "2"], cwd=repo, capture_output=True, text=True,
                               env={**os.environ, "PREFPIPE_INSIDE_DVC": "1"})
    assert unguarded.returncode == 0 and "Nothing to be done" in unguarded.stdout + unguarded.stderr, \
        unguarded.stdout[-3000:] + unguarded.stderr[-3000:]
    assert "Nothing to be done" in sh("snakemake", "-n", "--cores", "2", cwd=repo)
    assert dvc_changed_stages(repo) == set()
    out = sh("dvc", "repro", cwd=repo)
    assert "Running stage" not in out, out

    # The environment is an input: a locked version changed names the environment stage, and only it (its
    # record is what the other stages depend on, and the installed packages have not changed).
    lock = repo / "requirements/lock.txt"
    text = lock.read_text()
    changed = re.sub(r"^tqdm==\S+", "tqdm==0.0.1", text, count=1, flags=re.M)
    assert changed != text
    lock.write_text(changed)
    assert dvc_changed_stages(repo) == {"environment"}
    lock.write_text(text)
    assert dvc_changed_stages(repo) == set()

    # Between commits: the metrics diff shows numbers, the training curves render.
    commit(repo, "beta changed")
    diff = json.loads(sh("dvc", "metrics", "diff", "HEAD~1", "--json", cwd=repo).strip().splitlines()[-1])
    margin = diff["metrics/dpo.json"]["final.mean_margin"]
    assert isinstance(margin["old"], float) and isinstance(margin["new"], float) and margin["diff"] != 0, diff
    assert "metrics/rm.json" not in diff, diff      # train_rm did not rerun: its metrics are unchanged
    sh("dvc", "plots", "diff", "HEAD~1", "--out", str(tmp_path / "plots"), cwd=repo)
    assert (tmp_path / "plots" / "index.html").exists()
