"""The `prefpipe` console command (prefpipe/cli.py): pin, verify and status, for the things users run by hand.

`status` runs on a small real DVC repository (real dvc repro, the repository's own workflow/integrity.py and
dvc_adapter.py copied in, as the command loads them from the checkout it reports on): every stage up to date, then a
changed param, a changed dependency and a deleted output, each named, with the stages downstream of them.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT
from pipeline_helpers import sh

DVC_YAML = {"stages": {
    "make": {"cmd": "python -c \"import yaml; open('made.txt', 'w').write(str(yaml.safe_load(open('params.yaml'))['k']))\"",
             "deps": ["knob.txt"], "params": ["k"], "outs": ["made.txt"]},
    "use": {"cmd": "cat made.txt knob.txt > used.txt", "deps": ["made.txt", "knob.txt"], "outs": ["used.txt"]},
    "other": {"cmd": "cp other.txt copied.txt", "deps": ["other.txt"], "outs": ["copied.txt"]},
}}


def prefpipe(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefpipe.cli", *args], cwd=cwd, capture_output=True, text=True)


def test_prefpipe_is_an_installed_console_command():
    """pyproject's [project.scripts] entry, installed by `pip install -e .` (README's commands)."""
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"] == {"prefpipe": "prefpipe.cli:main"}
    found = [ep for ep in metadata.entry_points(group="console_scripts") if ep.name == "prefpipe"]
    assert found and found[0].value == "prefpipe.cli:main", "reinstall: pip install --no-deps -e ."
    out = prefpipe("--help", cwd=REPO_ROOT)
    assert out.returncode == 0 and all(c in out.stdout for c in ("pin", "verify", "status"))


@pytest.mark.skipif(shutil.which("dvc") is None, reason="needs dvc")
def test_status_names_each_stage_up_to_date_or_why_it_reruns(tmp_path):
    repo = tmp_path / "repo"
    (repo / "workflow").mkdir(parents=True)
    for name in ("integrity.py", "dvc_adapter.py"):        # integrity.py reaches DVC through the adapter
        shutil.copy2(REPO_ROOT / "workflow" / name, repo / "workflow" / name)
    (repo / "Snakefile").write_text("# a prefpipe checkout is found by its Snakefile and dvc.yaml\n")
    (repo / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML, sort_keys=False))
    (repo / "params.yaml").write_text("k: 1\n")
    (repo / "knob.txt").write_text("one\n")
    (repo / "other.txt").write_text("other\n")
    sh("git", "init", "-q", cwd=repo)
    sh("dvc", "init", "-q", cwd=repo)
    sh("dvc", "repro", "-q", cwd=repo)

    done = prefpipe("status", cwd=repo / "workflow")          # found from a subdirectory of the checkout
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["make   up to date", "use    up to date", "other  up to date",
                                        "all 3 stages up to date: the workspace is what dvc.lock records"]

    (repo / "params.yaml").write_text("k: 2\n")
    (repo / "other.txt").write_text("changed\n")
    (repo / "copied.txt").unlink()
    out = prefpipe("status", "--repo", str(repo), cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "make   must rerun: params k modified"
    assert lines[1] == "use    rerun after: make"
    assert lines[2] == "other  must rerun: other.txt modified; copied.txt deleted"
    assert lines[3] == "0 of 3 stages up to date; `snakemake --cores N` reruns the rest"

    (repo / "params.yaml").write_text("k: 1\n")
    (repo / "other.txt").write_text("other\n")
    out = prefpipe("status", "--repo", str(repo), cwd=tmp_path)
    assert out.stdout.splitlines()[2] == "other  outputs missing: copied.txt", out.stdout
    assert "`dvc checkout` restores missing outputs" in out.stdout.splitlines()[-1]
    sh("dvc", "checkout", "-q", cwd=repo)
    assert prefpipe("status", cwd=repo).returncode == 0


def test_status_outside_a_checkout_is_refused_in_one_line(tmp_path):
    out = prefpipe("status", cwd=tmp_path)
    assert out.returncode == 1
    assert out.stderr.strip().startswith("prefpipe status: refused:") and len(out.stderr.strip().splitlines()) == 1


def test_pin_and_verify_are_the_stages_own_commands(tmp_path):
    """`prefpipe pin` is `python -m stages.verify_ref pin` (its refusals too), `prefpipe verify` is report verify."""
    out = prefpipe("pin", str(tmp_path / "absent"), cwd=tmp_path)
    assert out.returncode == 1 and "verify_ref: refused:" in out.stderr and "not a directory" in out.stderr
    (tmp_path / "bundle.tar.gz").write_bytes(b"not a bundle")
    out = prefpipe("verify", str(tmp_path / "bundle.tar.gz"), cwd=tmp_path)
    assert out.returncode == 1 and out.stdout.startswith("DIFFERS") and "not a readable evidence bundle" in out.stdout
    assert "usage: prefpipe verify" in prefpipe("verify", "--help", cwd=tmp_path).stdout
