"""Tiny real assets for the training-engine tests: models built from a config, token parquet per the contract.

Also the independent reference implementation the engine is checked against: padded batches,
eager attention, full-vocabulary logits, no packing, no chunking.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F

from stages.lib.contracts import token_hash
from stages.lib.io import write_parquet

REPO_ROOT = Path(__file__).resolve().parents[1]


def train_settings(**overrides):
    """The repository's params.yaml `train` section as the engine's TrainSettings, with overrides (the
    schema is the one home of the defaults, so tests take them from params.yaml too)."""
    import yaml
    from stages.engine.settings import TrainSettings
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["train"].update(overrides)
    return TrainSettings.from_params(params)

VOCAB = 128


def make_tiny_model_dir(path: Path, arch: str = "qwen2", vocab: int = VOCAB, seed: int = 0,
                        hidden: int = 32, tie: bool = True) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
    common = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=512,
                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    config = Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return path


def token_row(pair_id: str, chosen: list[int], chosen_pl: int, rejected: list[int], rejected_pl: int,
              margin: float | None = None) -> dict:
    return {"pair_id": pair_id, "chosen_ids": [int(t) for t in chosen], "chosen_prompt_len": int(chosen_pl),
            "rejected_ids": [int(t) for t in rejected], "rejected_prompt_len": int(rejected_pl), "margin": margin,
            "token_hash": token_hash([int(t) for t in chosen], int(chosen_pl), [int(t) for t in rejected],
                                     int(rejected_pl))}


def write_token_parquet(path: Path, rows: list[dict]) -> Path:
    schema = pa.schema([("pair_id", pa.string()), ("chosen_ids", pa.list_(pa.int32())),
                        ("chosen_prompt_len", pa.int32()), ("rejected_ids", pa.list_(pa.int32())),
                        ("rejected_prompt_len", pa.int32()), ("margin", pa.float64()), ("token_hash", pa.string())])
    write_parquet(path, pa.Table.from_pylist(rows, schema=schema))
    return path


def random_rows(n: int, seed: int, vocab: int = VOCAB, prefix: str = "p", max_prompt: int = 12,
                max_completion: int = 10, margins: bool = False) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        prompt = rng.integers(3, vocab, rng.integers(1, max_prompt + 1)).tolist()
        c = rng.integers(3, vocab, rng.integers(1, max_completion + 1)).tolist()
        r = rng.integers(3, vocab, rng.integers(1, max_completion + 1)).tolist()
        rows.append(token_row(f"{prefix}{i:04d}", prompt + c, len(prompt), prompt + r, len(prompt),
                              float(rng.normal()) if margins else None))
    return rows


def toy_task_rows(n: int, seed: int, vocab: int = VOCAB, prefix: str = "t") -> list[dict]:
    """A learnable preference: chosen completions use the low half of the vocabulary, rejected the high half."""
    rng = np.random.default_rng(seed)
    half = vocab // 2
    rows = []
    for i in range(n):
        prompt = rng.integers(3, vocab, rng.integers(2, 8)).tolist()
        c = rng.integers(3, half, rng.integers(2, 6)).tolist()
        r = rng.integers(half, vocab, rng.integers(2, 6)).tolist()
        rows.append(token_row(f"{prefix}{i:04d}", prompt + c, len(prompt), prompt + r, len(prompt)))
    return rows


# ----------------------------------------------------------------------------------------------
# Independent reference implementation
# ----------------------------------------------------------------------------------------------

def padded(seqs: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask


def reference_seq_logps(model, seqs: list[list[int]], prompt_lens: list[int]) -> torch.Tensor:
    """Sum of log p(token) over completion tokens, from full padded logits (model in eager attention)."""
    ids, mask = padded(seqs)
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    logp = F.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    pos = torch.arange(1, ids.shape[1])[None]
    completion = (pos >= torch.tensor(prompt_lens)[:, None]) & (mask[:, 1:] == 1)
    return (logp * completion).sum(-1).double()


def reference_rm_scores(model, seqs: list[list[int]]) -> torch.Tensor:
    """Scalar head on the hidden state of each sequence's last token (padded batch, eager)."""
    ids, mask = padded(seqs)
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    last = torch.tensor([len(s) - 1 for s in seqs])
    return model.score(hidden[torch.arange(len(seqs)), last]).squeeze(-1).float()


def probe_token_rows(assets: Path) -> list[dict]:
    """The `assets` fixture's probe token rows as plain lists (what HF's forward takes)."""
    import pandas as pd
    return [{k: (list(v) if hasattr(v, "tolist") else v) for k, v in r.items()}
            for r in pd.read_parquet(assets / "probe.parquet").to_dict("records")]


def pair_seqs(rows: list[dict]) -> tuple[list[list[int]], list[int]]:
    seqs, pls = [], []
    for r in rows:
        seqs += [r["chosen_ids"], r["rejected_ids"]]
        pls += [r["chosen_prompt_len"], r["rejected_prompt_len"]]
    return seqs, pls


# The fused kernels' checks under Triton's interpreter (tests/engine/test_kernels.py on CPU, tests/engine/test_lora.py's
# LoRA path): in a subprocess, so the calling process's kernels stay compiled-for-GPU.
INTERPRET_CHECKS = Path(__file__).resolve().parent / "triton_interpret_checks.py"


def interpret(*args: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, str(INTERPRET_CHECKS), *args], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r.stdout
