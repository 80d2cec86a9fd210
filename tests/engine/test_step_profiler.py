"""stages/engine/step_profiler.py's environment: a typo in a PREFPIPE_PROFILE_* variable is refused, naming it."""
from __future__ import annotations

import pytest
import torch

from stages.engine.step_profiler import StepProfiler


@pytest.mark.parametrize("name,value,message", [("PREFPIPE_PROFILE_PY", "yes", "expected 1 \\(on\\) or 0"),
                                                ("PREFPIPE_PROFILE_PY", "true", "expected 1 \\(on\\) or 0"),
                                                ("PREFPIPE_PROFILE_START", "1O", "not an integer"),
                                                ("PREFPIPE_PROFILE_STEPS", "six", "not an integer")])
def test_a_typo_in_a_profile_variable_is_refused_naming_it(tmp_path, monkeypatch, name, value, message):
    monkeypatch.setenv("PREFPIPE_PROFILE", str(tmp_path / "prof"))
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}='{value}': {message}"):
        StepProfiler.from_env(torch.device("cpu"), True, 0)


def test_profile_variables_read_as_documented(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFPIPE_PROFILE", str(tmp_path / "prof"))
    for name in ("PREFPIPE_PROFILE_PY", "PREFPIPE_PROFILE_START", "PREFPIPE_PROFILE_STEPS"):
        monkeypatch.delenv(name, raising=False)
    prof = StepProfiler.from_env(torch.device("cpu"), True, 0)
    assert not prof.python and prof.windows[10] == ("steady", 6)
    monkeypatch.setenv("PREFPIPE_PROFILE_PY", "1")
    monkeypatch.setenv("PREFPIPE_PROFILE_START", "4")
    monkeypatch.setenv("PREFPIPE_PROFILE_STEPS", "2")
    prof = StepProfiler.from_env(torch.device("cpu"), True, 3)        # resumed at step 3: no first-use windows
    assert prof.python and prof.windows == {7: ("steady", 2)}
    monkeypatch.setenv("PREFPIPE_PROFILE_PY", "0")
    assert not StepProfiler.from_env(torch.device("cpu"), True, 0).python
    assert StepProfiler.from_env(torch.device("cpu"), False, 0) is None          # rank 0 only


def test_a_stage_refuses_a_profile_typo_in_one_line_before_loading_the_model(assets):
    """The check runs first in the loop (StepProfiler.request): the refusal names the variable, exit 1 without a
    traceback, and no weight was read (no step-0 probe in the log)."""
    import os
    import subprocess
    import sys
    from stage_helpers import REPO_ROOT, stage_args, write_train_params
    params = write_train_params(assets / "p.yaml")
    out = assets / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PREFPIPE_PROFILE": str(assets / "prof"),
           "PREFPIPE_PROFILE_PY": "yes"}
    r = subprocess.run([sys.executable, "-m", "stages.train_rm", *stage_args(assets, "--out-dir", out, params)],
                       cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "PREFPIPE_PROFILE_PY='yes'" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "probe step0" not in r.stderr and not (assets / "prof").exists()
