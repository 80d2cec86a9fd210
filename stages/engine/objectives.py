"""What the shared training loop (stages/engine/loop.py) asks of an objective, and what the objectives share.

Two objectives implement `Objective`: DPO (stages/engine/dpo_objective.py, its losses in
stages/engine/dpo_losses.py) and the pairwise reward model (stages/engine/reward_objective.py). Each tells the loop
which model to build from the reference directory, the per-pair loss and metrics from the model's per-sequence
outputs, the probe JSONL rows, and what to export. They live in separate files so that each stage's code
dependencies (workflow/code_deps.py: its imports) hold only its own objective: a new DPO loss reruns train_dpo, not
train_rm or ref_logps.

Per-pair losses are summed and divided by the GLOBAL pair count of the optimizer step in the trainer; accuracy
counts a tie (margin exactly 0) as 0.5 and ties are reported separately.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from stages.engine.packing import PackedBatch, TokenPairs


class Objective(Protocol):
    """What the training loop (stages/engine/loop.py) asks of an objective; DPOObjective and RewardObjective
    implement it, and a new objective implements exactly this."""

    name: str                          # run_info's `objective`
    head: str                          # "lm_head" (exports a causal LM) | "score" (a sequence classifier)
    metric_names: tuple[str, ...]      # the per-pair terms pair_terms returns, "loss" and "accuracy" first

    def fingerprint(self) -> dict:
        """What of this objective shapes the trajectory (checkpoints resume only a run with the same one)."""

    def build_module(self, model_dir, train_settings, device: torch.device | None = None) -> torch.nn.Module:
        """The module the loop trains: a model from the reference directory and how its outputs are read.
        device: where to load the weights (CUDA: read straight into GPU memory); None: the CPU."""

    def hf_model(self, module: torch.nn.Module) -> torch.nn.Module:
        """The Hugging Face model inside `module` (what is exported)."""

    def prepare_pairs(self, hf: torch.nn.Module, pairs: TokenPairs) -> TokenPairs:
        """The token pairs as this objective reads them (e.g. a reward model's score positions)."""

    def to(self, device: torch.device) -> "Objective":
        """Move any tensors the objective holds (e.g. reference log-probs) to the device."""

    def pair_terms(self, seq_out: torch.Tensor, batch: PackedBatch, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-pair losses [P], per-pair metrics [P, len(metric_names)]) from the module's outputs; device-side,
        no host sync (it runs inside CUDA graphs)."""

    def probe_rows(self, probe: TokenPairs, outputs: np.ndarray, split: str = "probe") -> list[dict]:
        """The probe JSONL rows (manifest order) from the inference pass's [pairs, 2] outputs. split: which split's
        precomputed values to read (DPO's reference log-probs): "probe", or "dev" for the dev split (dev_eval.py)."""


def tie_aware_accuracy(margin: torch.Tensor) -> torch.Tensor:
    return (margin > 0).to(torch.float64) + 0.5 * (margin == 0).to(torch.float64)
