"""Bad input is refused at DAG build, before any stage runs, in one line naming the key or the source (issue 26
items 3 and 6): real `snakemake` and real `python workflow/sync_dvc.py` on a copy of the checkout, and the same
pre-flight through a stage CLI's load_params."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT
from stages.lib.params import ParamsError, validate_params

PARAMS = (REPO_ROOT / "params.yaml").read_text()
# What normalize's old outputs look like to Snakemake: present, so a rule whose input vanished is dropped.
NORMALIZE_OUTPUTS = ("pairs.parquet", "rejections.parquet", "normalize_stats.json")


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """The files a fresh clone has, with normalize's outputs of an earlier run."""
    dst = tmp_path_factory.mktemp("checkout")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO_ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if (REPO_ROOT / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / rel, dst / rel)
    (dst / "results" / "normalize").mkdir(parents=True)
    for name in NORMALIZE_OUTPUTS:
        (dst / "results" / "normalize" / name).write_bytes(b"an earlier run's output")
    return dst


def with_params(checkout: Path, old: str, new: str) -> None:
    assert old in PARAMS, old
    (checkout / "params.yaml").write_text(PARAMS.replace(old, new, 1))


def run(checkout: Path, *cmd: str, env: dict | None = None) -> tuple[int, list[str]]:
    r = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True, env={**os.environ, **(env or {})})
    return r.returncode, [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]


def refused_in_one_line(checkout: Path, *cmd: str, env: dict | None = None) -> str:
    rc, lines = run(checkout, *cmd, env=env)
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("Snakefile: refused: "), (rc, lines[-40:])
    return lines[0]


SNAKEMAKE_DRY = ("snakemake", "--dry-run", "--cores", "1")
SYNC_DVC = (sys.executable, "workflow/sync_dvc.py")


# ---------------------------------------------------------------------------------------------
# Sources are inputs that must exist (item 3)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, why", [
    ("data/embedded/color_facts_prefs.jsonl.gx", "no such file"),                    # a typo
    ("data/embedded/*.parquet", "the glob matches no .jsonl, .jsonl.gz, .json, .json.gz or .parquet file"),
    ("workflow/rules", "the directory holds no .jsonl"),   # .smk only (schemas/ holds a .json now)
])
def test_a_source_naming_no_data_is_refused_by_sync_dvc_and_snakemake(checkout, path, why):
    """Before: a missing file gave `wrote dvc.yaml (9 stages)` (normalize silently gone: its old outputs stood
    in for it) and a dry run scheduling everything but normalize; a glob matching nothing, a traceback."""
    with_params(checkout, "path: data/embedded/color_facts_prefs.jsonl.gz", f"path: {path}")
    dvc_yaml = (checkout / "dvc.yaml").read_bytes()
    expect = f"Snakefile: refused: data.sources[0] (embedded): {path}: {why}"
    for cmd in (SYNC_DVC, SNAKEMAKE_DRY):
        line = refused_in_one_line(checkout, *cmd)
        assert line.startswith(expect) and f"(relative to {checkout.resolve()})" in line, line
    assert (checkout / "dvc.yaml").read_bytes() == dvc_yaml


# ---------------------------------------------------------------------------------------------
# Bad params fail first, naming the key (item 6)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("old, new, message", [
    ("lr: 3.0e-4", "lr: .nan", "params.yaml: numbers must be finite: train.lr = nan"),
    ("max_grad_norm: 1.0", "max_grad_norm: .inf", "params.yaml: numbers must be finite: train.max_grad_norm = inf"),
    ("  seed: 7\n", "  seed: -1\n", "params.yaml is invalid: evaluate.seed: -1 is less than the minimum of 0"),
    ("  seed: 1234\n", "  seed: 4294967296\n",
     "params.yaml is invalid: train.seed: 4294967296 is greater than the maximum of 4294967295"),
    ("  epochs: 2\n", "  epochs: 2\n  lr: 1.0\n",
     r"params.yaml: key train.lr is written twice \(lines \d+ and \d+\)"),
    ("  loss: [sigmoid, sft]\n", "  loss: sigmod\n", r"params.yaml is invalid: dpo.loss: 'sigmod' is not allowed: "
                                                     r"must be one of \['sigmoid', 'robust'.*or a list of those "
                                                     r"\(did you mean 'sigmoid'\?\)"),
    ("  adapter: null\n", "  adapter: {type: lora, r: 0, alpha: 32, dropout: 0.0, target_modules: [q_proj], "
                          "export: merged}\n", r"train.adapter.r: 0 is less than the minimum of 1"),
])
def test_bad_params_are_refused_at_dag_build_naming_the_key(checkout, old, new, message):
    """Before: NaN gave "config differs from params.yaml" (NaN != NaN) with a traceback, .inf and the seeds
    passed (and failed later in torch / numpy), the duplicated key was last-wins, dpo.loss's error named
    neither the key nor the allowed values."""
    with_params(checkout, old, new)
    line = refused_in_one_line(checkout, *SNAKEMAKE_DRY)
    assert re.search(message, line), line
    if "twice" in message:      # both line numbers, as the file has them
        first, second = map(int, re.search(r"lines (\d+) and (\d+)", line).groups())
        lines = (checkout / "params.yaml").read_text().splitlines()
        assert first < second and {lines[first - 1].strip(), lines[second - 1].strip()} == {"lr: 1.0", "lr: 3.0e-4"}


def test_max_length_over_the_references_positions_is_refused_at_dag_build(checkout):
    """tokenize.max_length 2048 on the embedded reference (max_position_embeddings 1024 in its config.json): one
    line naming both numbers and the file, from snakemake and from sync_dvc.py. Before: accepted silently
    (issue 29: sequences of 3,060 tokens trained on a 1,024-position model)."""
    with_params(checkout, "  max_length: 128\n", "  max_length: 2048\n")
    for cmd in (SNAKEMAKE_DRY, SYNC_DVC):
        line = refused_in_one_line(checkout, *cmd)
        assert line == ("Snakefile: refused: tokenize.max_length 2048 is more than the reference's "
                        "max_position_embeddings 1024 (models/tiny-qwen2/config.json): the model has no position past "
                        "1023; set tokenize.max_length to at most 1024"), line
    with_params(checkout, "  max_length: 128\n", "  max_length: 1024\n")   # as many as it has: fine
    rc, lines = run(checkout, *SNAKEMAKE_DRY)
    assert rc == 0, lines[-20:]


def test_gpus_missing_here_are_refused_for_local_runs_only(checkout):
    """train.gpus: 1 where CUDA shows none: a local run (a dry run of one too) stops at DAG build saying what was
    found; `--executor slurm` builds the DAG (its jobs run where the GPUs are), and sync_dvc.py only writes
    dvc.yaml. Before: the data stages ran and train_* refused afterwards."""
    with_params(checkout, "  gpus: 0\n", "  gpus: 1\n")
    no_gpus = {"CUDA_VISIBLE_DEVICES": ""}
    line = refused_in_one_line(checkout, *SNAKEMAKE_DRY, env=no_gpus)
    assert "train.gpus is 1 but this machine can use 0 GPU(s) (" in line
    assert "CUDA_VISIBLE_DEVICES='' leaves 0" in line, line
    rc, lines = run(checkout, "snakemake", "--dry-run", "--executor", "slurm", "--jobs", "2", env=no_gpus)
    assert rc == 0 and not [x for x in lines if "refused" in x], lines[-20:]
    assert any("train_dpo" in x for x in lines)
    rc, lines = run(checkout, *SYNC_DVC, "--check", env=no_gpus)
    assert rc == 0, lines[-20:]


def test_a_stage_refuses_bad_params_with_the_same_preflight(tmp_path, capsys):
    """Every stage's load_params runs preflight_params: one `<stage>: refused:` line naming the key, before the
    stage reads anything (here its inputs do not even exist). Before: the stage went on to its inputs."""
    from stages import freeze_probe

    (tmp_path / "params.yaml").write_text(PARAMS.replace("lr: 3.0e-4", "lr: .nan"))
    with pytest.raises(SystemExit) as e:
        freeze_probe.main(["--params", str(tmp_path / "params.yaml"), "--pairs", "absent.parquet", "--identity",
                           str(tmp_path / "absent.json"), "--train",
                           str(tmp_path / "t.parquet"), "--probe", str(tmp_path / "p.parquet"), "--manifest",
                           str(tmp_path / "m.json")])
    assert e.value.code == 1
    refusals = [x for x in capsys.readouterr().err.splitlines() if "freeze_probe: refused:" in x]
    assert refusals and refusals[-1].endswith("params.yaml: numbers must be finite: train.lr = nan"), refusals


# ---------------------------------------------------------------------------------------------
# The pieces, in-process
# ---------------------------------------------------------------------------------------------

def test_duplicate_keys_are_found_at_any_depth_and_merge_keys_still_override():
    from stages.lib.params import load_yaml_unique
    with pytest.raises(ParamsError, match=r"key data.sources\[0\].path is written twice \(lines 3 and 4\)"):
        load_yaml_unique("data:\n  sources:\n    - path: a\n      path: b\n")
    with pytest.raises(ParamsError, match=r"key probe is written twice \(lines 1 and 2\)"):
        load_yaml_unique("probe: 1\nprobe: 2\n")
    assert load_yaml_unique("base: &b {x: 1, y: 2}\nover:\n  <<: *b\n  x: 3\n") == {
        "base": {"x": 1, "y": 2}, "over": {"x": 3, "y": 2}}


def test_non_finite_numbers_are_named_by_key_path():
    from stages.lib.params import non_finite_keys
    assert non_finite_keys({"train": {"lr": float("nan"), "adam_betas": [0.9, float("inf")], "seed": 1}}) == [
        "train.lr = nan", "train.adam_betas[1] = inf"]


def test_one_of_errors_name_what_is_allowed():
    params = yaml.safe_load(PARAMS)
    params["train"]["adapter"] = "lora"
    with pytest.raises(ParamsError, match=r"train.adapter: 'lora' is not allowed: must be null or a mapping of type, "
                                          r"r, alpha, dropout, target_modules, export$"):
        validate_params(params)
    params["train"]["adapter"] = None
    params["dpo"]["loss"] = ["sigmoid", "kto"]
    with pytest.raises(ParamsError, match=r"dpo.loss\[1\]: 'kto' is not one of \['sigmoid'"):
        validate_params(params)


@pytest.mark.parametrize("adapter, message", [
    # Before, each of these was "... is not valid under any of the given schemas" / a dump of the whole block.
    ({"type": "lora", "target_modules": "all-linears"},
     r"train.adapter.target_modules: 'all-linears' is not allowed: must be 'all-linear' or a list of strings "
     r"\(did you mean 'all-linear'\?\)"),
    ({"type": "lora", "rank": 8}, r"train.adapter.rank: unknown key; the keys of train.adapter are type, r, alpha, "
                                  r"dropout, target_modules, export"),
    ({"type": "lora", "export": "merge"},
     r"train.adapter.export: 'merge' is not one of \['merged', 'adapter', 'both'\] \(did you mean 'merged'\?\)"),
    ({"r": 8}, r"train.adapter.type: missing \(a required key\)"),
])
def test_schema_errors_name_the_key_and_the_allowed_values(adapter, message):
    params = yaml.safe_load(PARAMS)
    params["train"]["adapter"] = adapter
    with pytest.raises(ParamsError) as e:
        validate_params(params)
    assert re.search(message, str(e.value)), str(e.value)
    params["train"]["adapter"] = None
    params["train"]["lrr"] = 1e-3
    with pytest.raises(ParamsError, match=r"train.lrr: unknown key \(did you mean 'lr'\?\); the keys of train are "
                                          r"gpus, cpu_procs"):
        validate_params(params)


def test_a_lora_block_may_omit_keys_and_name_all_linear():
    from stages.lib.params import resolved_train
    params = yaml.safe_load(PARAMS)
    params["train"]["adapter"] = {"type": "lora", "target_modules": "all-linear", "r": 8}
    validate_params(params)
    assert resolved_train(params["train"])["adapter"] == {"type": "lora", "r": 8, "alpha": 32, "dropout": 0.0,
                                                          "target_modules": "all-linear", "export": "merged"}
    assert resolved_train({k: v for k, v in params["train"].items() if k != "adapter"})["adapter"] is None


def test_gpu_count_reads_the_driver_and_cuda_visible_devices(tmp_path, monkeypatch):
    from stages.lib.environment import _cuda_visible, visible_nvidia_gpus
    for bus in ("0000:01:00.0", "0000:41:00.0"):
        (tmp_path / bus).mkdir()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_nvidia_gpus(tmp_path) == (2, f"{tmp_path} lists 2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert visible_nvidia_gpus(tmp_path)[0] == 1
    # CUDA's rule: the list ends at the first invalid entry
    assert [_cuda_visible(2, v) for v in ("", "0,1", "0,-1,1", "2", "GPU-8c1e,0")] == [0, 2, 1, 0, 2]


def test_the_repository_params_pass_the_preflight():
    from stages.lib.params import preflight_params
    assert preflight_params(REPO_ROOT / "params.yaml") == yaml.safe_load(PARAMS)
