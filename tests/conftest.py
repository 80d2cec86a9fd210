"""Shared test fixtures.

Real data lives beside the repository in ../shared/data (never copied in); tests that need it
skip with a reason when it is absent, so a fresh clone without it still passes.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from stages.lib.environment import PORTABLE_CPU_ENV

# In-process tests run the engine the way the pipeline's CPU stages do (train.portable_numerics): torch and
# MKL read these once, at their first use, so they are set before any test module imports torch.
os.environ.update(PORTABLE_CPU_ENV)

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("PREFPIPE_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
HH_RLHF = SHARED_DATA / "hh-rlhf" / "harmless-base-test.jsonl.gz"
GPT2_TOKENIZER = SHARED_DATA / "tokenizers" / "gpt2"


@pytest.fixture
def hh_rlhf_path() -> Path:
    if not HH_RLHF.exists():
        pytest.skip(f"real HH-RLHF data not present at {HH_RLHF}")
    return HH_RLHF


@pytest.fixture
def gpt2_tokenizer_dir() -> Path:
    if not (GPT2_TOKENIZER / "tokenizer.json").exists():
        pytest.skip(f"real GPT-2 tokenizer not present at {GPT2_TOKENIZER}")
    return GPT2_TOKENIZER


# The data side's real components (tests/data_helpers.py holds the helpers these use).
EMBEDDED_REF = REPO_ROOT / "models" / "tiny-qwen2"


@pytest.fixture
def hh_pairs(hh_rlhf_path) -> list[dict]:
    """The real HH-RLHF file's pairs, parsed simply (tests/data_helpers.py load_hh_pairs)."""
    from data_helpers import load_hh_pairs

    return load_hh_pairs(hh_rlhf_path)


@pytest.fixture
def gpt2(gpt2_tokenizer_dir):
    """The real GPT-2 tokenizer (plain rendering: no chat template), loaded once per session."""
    from data_helpers import load_tokenizer_once

    return load_tokenizer_once(gpt2_tokenizer_dir)


@pytest.fixture
def embedded():
    """The default reference's tokenizer (751 tokens, a ChatML template), always in the checkout."""
    from data_helpers import load_tokenizer_once

    return load_tokenizer_once(EMBEDDED_REF)


# The training side's real components (tests/engine_helpers.py builds them; tests/stage_helpers.py runs the stages).
@pytest.fixture
def assets(tmp_path):
    """A tiny Qwen2 model and a learnable toy preference task (37 probe pairs: the last chunk is partial)."""
    from engine_helpers import make_tiny_model_dir, toy_task_rows, write_token_parquet

    make_tiny_model_dir(tmp_path / "model")
    write_token_parquet(tmp_path / "train.parquet", toy_task_rows(64, seed=1))
    write_token_parquet(tmp_path / "probe.parquet", toy_task_rows(37, seed=2, prefix="q"))
    return tmp_path


# Files run longest first. README's command distributes whole files over two workers (`--dist loadfile`, since
# several files build a costly module fixture once); xdist's default order, most tests first, put the files of one
# or two end-to-end tests (minutes each: the real-data README run, the DVC comparison) last, where one worker ran
# them alone while the other idled. A file's cost is its measured seconds (MEASURED_COST_S: the end-to-end files,
# each a few minutes) or else a rough one (a slow-marked test counts as a minute, any other as a second): it is the
# ordering, not the measure, that matters (largest first keeps the tail short). A stale number costs speed, never
# a result.
SLOW_TEST_COST_S, TEST_COST_S = 60, 1
# Seconds per file, rounded, from a two-worker run of README's test command on 2 cores (each file's setup and calls,
# while the other worker ran too; the timeline of 8e0355f's run, less this session's cuts).
MEASURED_COST_S = {
    "tests/workflow/test_faults.py": 435,
    "tests/workflow/test_rounds_e2e.py": 300,
    "tests/workflow/test_dvc_compare.py": 215,
    "tests/bench/test_bench.py": 140,
    "tests/engine/test_checkpoint.py": 125,
    "tests/workflow/test_targeted_run.py": 125,
    "tests/engine/test_optimizer_modes.py": 120,
    "tests/workflow/test_dvclive_exp.py": 55,
    "tests/stages/test_report.py": 105,
    "tests/workflow/test_pipeline_e2e.py": 95,
    "tests/engine/test_portable_numerics.py": 95,
    "tests/stages/test_sft.py": 90,
    "tests/engine/test_train.py": 85,
    "tests/workflow/test_dvc_commit.py": 65,
    "tests/engine/test_lora.py": 60,
    "tests/engine/test_kernels.py": 60,
}
# Two files go first, whatever they cost. test_slurm's worker idles between the Slurm plugin's status checks (a core
# free for minutes), so it runs beside test_readme_real_data, a `snakemake --cores 2` whose training stages run two at
# a time for two minutes and take that core. (Before: rounds then slurm, beside test_faults' one-core scenarios:
# ~1.5 of 2 cores busy for those five minutes.) xdist gives a worker its next file once two of its tests are left,
# at once for those two files: test_slurm's worker takes test_rounds_e2e, which builds the session's finished default
# run (its first user), and the other takes test_faults, which builds its own: neither waits for the other.
FIRST = ("tests/workflow/test_slurm.py", "tests/workflow/test_readme_real_data.py")


def pytest_collection_modifyitems(config, items):
    file_of = {item: item.nodeid.split("::", 1)[0] for item in items}
    cost: dict[str, int] = {}
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        path = file_of[item]
        cost[path] = cost.get(path, 0) + (SLOW_TEST_COST_S if item.get_closest_marker("slow") else TEST_COST_S)
        first_seen.setdefault(path, i)
    for path in cost:
        cost[path] = 10**6 - FIRST.index(path) if path in FIRST else MEASURED_COST_S.get(path, cost[path])
    items.sort(key=lambda item: (-cost[file_of[item]], first_seen[file_of[item]]))
