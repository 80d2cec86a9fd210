"""The Snakefile's onsuccess record (`sync_dvc.py --commit-lock`): one DVC session instead of `dvc commit`'s
per-target passes, with the paths hashed in threads first. It must write the very dvc.lock that
`dvc commit --force <ready stages>` writes (DVC's own CLI is the reference), leave `dvc status` clean after a
Snakemake run, and keep the lock right when one rule reruns.

A small real workflow in a temporary git repository: real snakemake runs the rules, real DVC records them.
Its model-like directory holds two files over dvc-data's 2 MiB "large file" threshold (dvc-data hashes those
in its own thread pool) and is an out of one stage and a dep of another, as results/train_*/model is.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT
from test_pipeline_e2e import sh     # the same runner: stripped PREFPIPE_INSIDE_DVC, output tail on failure

sys.path.insert(0, str(REPO_ROOT / "workflow"))
import sync_dvc  # noqa: E402

SNAKEFILE = r'''
rule all:
    input: "out/report.txt", "out/other.txt"

rule make:
    input: "knob.txt"
    output: "out/made.txt"
    shell: "cat {input} {input} > {output}"

rule model:
    input: "out/made.txt"
    output: directory("out/model")
    shell: "mkdir -p {output} && python -c \"import sys, hashlib; s = open('{input}', 'rb').read(); [open(f'{output}/w{{i}}.bin', 'wb').write(hashlib.sha256(s + bytes([i])).digest() * 100000) for i in range(2)]\" && cp {input} {output}/config.txt"

rule report:
    input: model="out/model", made="out/made.txt"
    output: "out/report.txt"
    shell: "ls -l {input.model} | wc -l > {output} && cat {input.made} >> {output}"

rule other:
    input: "knob2.txt"
    output: "out/other.txt"
    shell: "cp {input} {output}"
'''

DVC_YAML = {"stages": {
    "make": {"cmd": "true", "deps": ["knob.txt"], "outs": ["out/made.txt"]},
    "model": {"cmd": "true", "deps": ["out/made.txt"], "outs": ["out/model"]},
    "report": {"cmd": "true", "deps": ["out/model", "out/made.txt"], "outs": ["out/report.txt"]},
    "other": {"cmd": "true", "deps": ["knob2.txt"], "outs": ["out/other.txt"]},
    # Never built by this workflow: not ready, so neither the CLI reference nor commit_lock records it.
    "unbuilt": {"cmd": "true", "deps": ["knob.txt"], "outs": ["out/never.txt"]},
}}


def git(repo: Path, *args: str) -> None:
    sh("git", "-c", "user.email=ci@example.com", "-c", "user.name=ci", *args, cwd=repo)


BUILT = ["make", "model", "report", "other"]


def dvc_changed(repo: Path) -> str:
    return sh("dvc", "status", *BUILT, cwd=repo)


def reference_lock(repo: Path, tmp: Path) -> str:
    """dvc.lock as DVC's CLI writes it: `dvc commit --force` of the ready stages, in a copy of the repo."""
    ref = tmp / "reference"
    if ref.exists():
        shutil.rmtree(ref)
    shutil.copytree(repo, ref, symlinks=True)
    sh("dvc", "commit", "--force", "--quiet", *sync_dvc.ready_stages(ref), cwd=ref)
    return (ref / "dvc.lock").read_text()


@pytest.mark.skipif(shutil.which("dvc") is None or shutil.which("snakemake") is None, reason="needs dvc and snakemake")
def test_commit_lock_writes_what_dvc_commit_writes_and_status_is_clean(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "Snakefile").write_text(SNAKEFILE)
    (repo / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML, sort_keys=False))
    (repo / "knob.txt").write_text("one\n")
    (repo / "knob2.txt").write_text("other\n")
    (repo / ".gitignore").write_text("/out/\n/.snakemake/\n")
    git(repo, "init", "-q")
    sh("dvc", "init", "-q", cwd=repo)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "init")

    sh("snakemake", "--cores", "2", cwd=repo)
    assert sync_dvc.ready_stages(repo) == ["make", "model", "report", "other"]
    want = reference_lock(repo, tmp_path)
    assert sync_dvc.commit_lock(repo) == ["make", "model", "report", "other"]
    assert (repo / "dvc.lock").read_text() == want
    lock = yaml.safe_load(want)["stages"]
    assert set(lock) == {"make", "model", "report", "other"}
    assert lock["model"]["outs"][0]["md5"].endswith(".dir") and lock["model"]["outs"][0]["size"] > 2 * 2**21
    out = dvc_changed(repo)
    assert "up to date" in out, out
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "first run")

    # One input changes: Snakemake reruns make, model and report (not other); the lock follows, other's entry
    # is the same, and DVC agrees nothing is left to do.
    (repo / "knob.txt").write_text("two\n")
    assert "make" in dvc_changed(repo)
    ran = sh("snakemake", "--cores", "2", cwd=repo)
    assert "rule other" not in ran and "rule model" in ran, ran
    want = reference_lock(repo, tmp_path)
    before = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    sync_dvc.commit_lock(repo)
    assert (repo / "dvc.lock").read_text() == want
    after = yaml.safe_load(want)["stages"]
    assert after["other"] == before["other"]
    assert after["model"]["outs"] != before["model"]["outs"]
    out = dvc_changed(repo)
    assert "up to date" in out, out
    # The outputs are in DVC's cache, as `dvc commit` leaves them: a deleted output comes back by checkout.
    shutil.rmtree(repo / "out" / "model")
    sh("dvc", "checkout", "model", cwd=repo)
    assert "up to date" in dvc_changed(repo)


def test_commit_lock_does_nothing_without_a_dvc_repository(tmp_path):
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML, sort_keys=False))
    assert sync_dvc.commit_lock(tmp_path) == []
    assert not (tmp_path / "dvc.lock").exists()
