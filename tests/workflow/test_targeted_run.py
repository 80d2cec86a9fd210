"""Day two with the real pipeline (issue 37, items 6 and 7), in a temporary git repository, as README's "Comparing
runs" has a user do it (its lines are read from README.md and run as written):

- item 7: the recipe commits only the record (params.yaml, dvc.yaml, dvc.lock, metrics/), never `dvc_plots/` or a
  model folder the user put in the checkout (before: `git add -A` committed both); the documented `dvc exp show`
  invocation fits a terminal (80 to 120 columns wide, every chosen column shown) where `--only-changed` did not;
- item 6: a run interrupted after evaluate wrote its metrics (so dvc.lock never recorded them), then an eval-only
  `snakemake --cores 2 judge`: it does its work, records it, names the stages outside its targets whose outputs no
  longer match dvc.lock with the command that rebuilds them, and exits 0 (before: exit 1 after the work was done).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT
from pipeline_helpers import copy_finished_run, dvc_changed_stages, sh

pytestmark = pytest.mark.slow


def readme_recipe() -> list[str]:
    """The bash block under README's section Comparing runs, a command per line (comments dropped)."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Comparing runs"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("   #")[0].strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]


def bash(line: str, repo: Path, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PREFPIPE_")}
    who = {"GIT_AUTHOR_NAME": "ci", "GIT_AUTHOR_EMAIL": "ci@example.com", "GIT_COMMITTER_NAME": "ci",
           "GIT_COMMITTER_EMAIL": "ci@example.com"}
    return subprocess.run(["bash", "-c", line], cwd=repo, capture_output=True, text=True,
                          env={**clean, **who, **env}, timeout=1800)


def interrupted_run(repo: Path, log: Path) -> None:
    """`snakemake --cores 2` taken down whole (kill -9 of its process group: the OOM killer, a lost session) once
    evaluate has finished and report started: evaluate's new outputs are in the workspace and never recorded in
    dvc.lock. (A run stopped by SIGTERM or Ctrl-C reaches its onerror handler, which records the stages it finished.)"""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PREFPIPE_")}
    with open(log, "w") as f:
        proc = subprocess.Popen(["snakemake", "--cores", "2"], cwd=repo, stdout=f, stderr=subprocess.STDOUT,
                                env=clean, start_new_session=True)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1500:
        text = log.read_text()
        if "(Rule: evaluate)" in text and "rule report:" in text:
            break
        assert proc.poll() is None, f"the run ended before report started:\n{text[-3000:]}"
        time.sleep(0.5)
    else:
        raise AssertionError("report never started")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=300)
    assert proc.returncode != 0


def test_day_two_a_targeted_judge_run_and_comparing_runs_as_readme_says(tmp_path, tmp_path_factory):
    recipe = readme_recipe()
    baseline, second = recipe[:2]                            # a plain run, then `snakemake ... && git commit`
    exp_show = next(line for line in recipe if line.startswith("dvc exp show"))
    # A user's clone that has run the default (the session's finished run, copied): the recipe's first line, a plain
    # run, then has the committed record to reproduce and nothing to do.
    repo, _ = copy_finished_run(tmp_path_factory, tmp_path)
    (repo / "models/my-model").mkdir(parents=True)           # a model folder of the user's, untracked
    (repo / "models/my-model/config.json").write_text("{}\n")

    r = bash(baseline, repo)                                  # snakemake --cores 2: nothing to do
    assert r.returncode == 0, r.stderr[-4000:]

    # Item 6. A changed knob, a run interrupted after evaluate, then an eval-only run.
    params = yaml.safe_load((repo / "params.yaml").read_text())
    text = (repo / "params.yaml").read_text()
    assert f"  beta: {params['dpo']['beta']}" in text
    (repo / "params.yaml").write_text(text.replace(f"  beta: {params['dpo']['beta']}", "  beta: 0.2", 1))
    interrupted_run(repo, tmp_path / "interrupted.log")
    lock_before = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    judge = bash("snakemake --cores 2 judge", repo)
    assert judge.returncode == 0, judge.stderr[-4000:]
    said = judge.stdout + judge.stderr
    assert "(Rule: judge)" in said, said[-3000:]
    line = next(x for x in said.splitlines() if x.startswith("sync_dvc: not recorded in dvc.lock"))
    assert "metrics/dpo.json" in line and "(stage evaluate)" in line, line
    assert re.search(r"`snakemake --cores N --forcerun evaluate( report)?` rebuilds them", line), line
    lock_after = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    assert lock_after["judge"] != lock_before["judge"]        # what ran is recorded
    assert lock_after["evaluate"] == lock_before["evaluate"]  # what did not is not
    assert "evaluate" in dvc_changed_stages(repo) and "judge" not in dvc_changed_stages(repo)

    # Item 7. The second commit of the recipe (the rest of the pipeline runs first), then the comparisons.
    r = bash(second, repo)
    assert r.returncode == 0, r.stderr[-4000:]
    assert dvc_changed_stages(repo) == set()
    committed = set(sh("git", "show", "--name-only", "--format=", "HEAD", cwd=repo).split())
    assert committed and committed <= {"params.yaml", "dvc.yaml", "dvc.lock", "metrics/dpo.json", "metrics/rm.json",
                                       "metrics/generation.json"}, committed
    for line in recipe[2:]:
        if line != exp_show:
            r = bash(line, repo)
            assert r.returncode == 0, (line, r.stderr[-3000:])
    assert (repo / "dvc_plots").is_dir()
    assert sh("git", "status", "--porcelain", cwd=repo).split() == ["??", "models/my-model/"]  # the user's, untouched

    kept = ["Experiment", "metrics/dpo.json:final.accuracy", "win_rate", "grader.success_diff", "dpo.beta", "train.lr"]
    wide = bash(exp_show + " --no-pager", repo, COLUMNS="400")
    assert wide.returncode == 0, wide.stderr[-3000:]
    rows = [x.rstrip() for x in wide.stdout.splitlines() if x.strip() and not set(x.strip()) <= {"─"}]
    assert sorted(rows[0].split()) == sorted(kept), rows[0]
    width = max(len(x) for x in rows)
    assert 80 <= width <= 120, wide.stdout
    assert any(x.split()[0] == "workspace" for x in rows[1:]) and len(rows) >= 3
    fitted = bash(exp_show + " --no-pager", repo, COLUMNS="120")
    assert "…" not in fitted.stdout and fitted.stdout.splitlines() and all(
        name in fitted.stdout for name in kept), fitted.stdout
    # What it replaces: the columns that differ between the two commits, far wider than a terminal.
    changed = bash("dvc exp show --no-pager --only-changed -n 2", repo, COLUMNS="1000")
    assert changed.returncode == 0, changed.stderr[-3000:]
    assert max(len(x.rstrip()) for x in changed.stdout.splitlines()) > 2 * 120, changed.stdout
