"""README "Using real data" runs as written: its YAML block applied to a copy of the checkout's params.yaml (and
training capped: cap_training_steps, to keep CI short), then its command (`python workflow/sync_dvc.py && snakemake
--cores 2`), on the real HH-RLHF file beside the checkout and the default (embedded) reference, offline. The numbers
the section states are checked too.

Skips when ../shared/data is absent (a fresh clone without it).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from conftest import HH_RLHF, REPO_ROOT, SHARED_DATA
from pipeline_helpers import cap_training_steps, copy_checkout, sh


def readme_real_data_blocks() -> tuple[str, str]:
    """(the YAML block, the shell command that follows it) of README's "Using real data" section."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Using real data\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)
    i = next(k for k, (lang, body) in enumerate(blocks) if lang == "yaml" and "harmless-base-test" in body)
    lang, command = blocks[i + 1]
    assert lang == "bash", "the YAML block must be followed by the command that runs it"
    return blocks[i][1], command.strip()


def apply_block(params: dict, block: dict) -> dict:
    """README: "each replaces the key of the same name; everything else stays as it is"."""
    for section, keys in block.items():
        assert section in params and isinstance(keys, dict), section
        for key, value in keys.items():
            assert key in params[section], f"README sets {section}.{key}, which params.yaml does not have"
            params[section][key] = value
    return params


def test_readme_block_is_valid_params():
    from stages.lib.params import validate_params

    block, command = readme_real_data_blocks()
    assert command == "python workflow/sync_dvc.py && snakemake --cores 2"
    params = apply_block(yaml.safe_load((REPO_ROOT / "params.yaml").read_text()), yaml.safe_load(block))
    assert params["tokenize"]["truncation"] == "keep_end"
    assert "name" not in params["data"]["sources"][0]  # the name defaults to the file stem
    validate_params(params)  # the schema the stages and the Snakefile validate with


@pytest.mark.slow
def test_readme_real_data_section_runs_as_written(tmp_path):
    if not HH_RLHF.exists():
        pytest.skip(f"real HH-RLHF data not present at {HH_RLHF}")
    block, command = readme_real_data_blocks()
    # The checkout's sibling ../shared/data, as the README's relative path expects.
    repo = tmp_path / "repo"
    repo.mkdir()
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "data").symlink_to(SHARED_DATA.resolve(), target_is_directory=True)
    copy_checkout(repo)
    params = apply_block(yaml.safe_load((repo / "params.yaml").read_text()), yaml.safe_load(block))
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    # Training capped at a few optimizer steps: what this checks is the data path on real rows, the stages' chain and
    # what the section states, none of which depends on how long it trains. Uncapped, the whole run cost ~280 CPU-s,
    # two thirds of it training (capped: ~160-180, much of it the probe and reference log-prob passes); the suite is
    # CPU-bound on 2 cores.
    cap_training_steps(repo)

    sh("bash", "-euo", "pipefail", "-c", command, cwd=repo)

    stats = json.loads((repo / "results/normalize/normalize_stats.json").read_text())
    [source] = stats["sources"]
    assert source["name"] == "harmless-base-test"
    assert (source["rows_in"], source["pairs_out"], source["rejected_total"]) == (2312, 2299, 13)
    report = json.loads((repo / "results/tokens/tokenize_report.json").read_text())
    probe = report["splits"]["probe"]
    assert probe["pairs_in"] == probe["pairs_out"] == 512 and probe["rejected"] == 0
    assert report["splits"]["train"]["rejected_by_reason"] == {"sequence_too_long": 5}
    manifest = json.loads((repo / "results/tokens/probe_token_manifest.json").read_text())
    assert len(manifest["truncated"]) == probe["truncated"] == 215
    assert {t["reason"] for t in manifest["truncated"]} == {"prompt_turns_dropped"}
    assert all(t["chosen_tokens"] <= 1024 and t["prompt_tokens"] <= 256 for t in manifest["truncated"])
    summary = json.loads((repo / "results/evaluate/bootstrap_summary.json").read_text())
    assert summary["probe_truncated"] == {"pairs": 215, "by_reason": {"prompt_turns_dropped": 215}}
    for kind in ("dpo", "rm"):
        assert json.loads((repo / f"metrics/{kind}.json").read_text())["n_pairs"] == 512
    assert (repo / "results/report/evidence.tar.gz").is_file()
    # The run is recorded for DVC too: dvc.yaml lists the real file as normalize's dep (a source outside the
    # repository by its absolute path, so a queued DVC experiment's copy finds it), and Snakemake has nothing left
    # to do.
    dvc = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]["normalize"]
    source = (repo / "../shared/data/hh-rlhf/harmless-base-test.jsonl.gz").resolve()
    assert any(Path(dep).is_absolute() and Path(dep).resolve() == source for dep in dvc["deps"]), dvc["deps"]
    assert "Nothing to be done" in sh("snakemake", "-n", "--cores", "2", cwd=repo)
