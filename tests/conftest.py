"""Shared test fixtures.

Real data lives beside the repository in ../shared/data (never copied in); tests that need it
skip with a reason when it is absent, so a fresh clone without it still passes.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

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
