"""The pairwise reward-model objective (Bradley-Terry, as TRL's RewardTrainer), what train_rm trains.

    loss = -logsigmoid(sc - sr [- margin]) + center_rewards_coefficient * (sc + sr) ** 2
    s = the score head on the last token whose id != the model's pad_token_id, the token HF's
    AutoModelForSequenceClassification (hence TRL) pools (SCORE_POSITION; the same in training, probe, export).

Kept apart from the DPO objective and its losses (stages/engine/dpo_objective.py, dpo_losses.py) so that a change
there does not rerun train_rm (workflow/code_deps.py follows imports).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from stages.engine.modeling import SequenceRewards, load_reward_model
from stages.engine.objectives import tie_aware_accuracy
from stages.engine.packing import PackedBatch, TokenPairs
from stages.lib.contracts import correct_label

# Where a reward model reads its score (TokenPairs.with_score_positions): transformers' sequence-classification
# pooling for right-padded input, `(arange(T) * (input_ids != pad_token_id)).argmax(-1)`.
SCORE_POSITION = "last_token_not_pad"


def reward_pair_losses(sc: torch.Tensor, sr: torch.Tensor, margin: torch.Tensor | None = None, *,
                       center_rewards_coefficient: float = 0.0) -> torch.Tensor:
    diff = sc - sr if margin is None else sc - sr - margin
    loss = -F.logsigmoid(diff)
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * (sc + sr) ** 2
    return loss


class RewardObjective:
    """Reward model = causal-LM body + scalar `score` head; outputs = one score per sequence."""

    metric_names = ("loss", "accuracy", "ties", "margin", "chosen_score", "rejected_score")
    head = "score"
    role = "reward_model"
    name = "reward_model"

    def __init__(self, rm_params: dict, train_margins: np.ndarray | None = None, source: str = "train tokens"):
        self.center = float(rm_params["center_rewards_coefficient"])
        self.use_margin = bool(rm_params["use_margin"])
        self.margins_cpu = None
        if self.use_margin:
            if train_margins is None or not np.isfinite(train_margins).all():
                raise ValueError(f"{source}: rm.use_margin is set but the margin column is null or non-finite "
                                 "for some pairs")
            self.margins_cpu = train_margins
        self.margins_device: torch.Tensor | None = None

    def fingerprint(self) -> dict:
        return {"objective": self.name, "center_rewards_coefficient": self.center, "use_margin": self.use_margin,
                "score_position": SCORE_POSITION}

    def build_module(self, model_dir, train_settings, device: torch.device | None = None) -> SequenceRewards:
        return SequenceRewards(load_reward_model(model_dir, device=device))

    @staticmethod
    def hf_model(module: SequenceRewards):
        return module.seq_cls

    @staticmethod
    def prepare_pairs(hf, pairs: TokenPairs) -> TokenPairs:
        """Score each sequence where transformers' AutoModelForSequenceClassification pools for the exported
        config (the last token != config.pad_token_id); refuses a completion with no such token."""
        return pairs.with_score_positions(hf.config.pad_token_id)

    @staticmethod
    def scoring_info(hf) -> dict:
        """run_info's `reward_scoring`: where the reward is read, and with which pad id."""
        eos = hf.config.eos_token_id
        return {"position": SCORE_POSITION, "pad_token_id": hf.config.pad_token_id,
                "pad_token_source": getattr(hf, "prefpipe_pad_source", None),
                "eos_token_id": list(eos) if isinstance(eos, (list, tuple)) else eos}

    def to(self, device: torch.device) -> "RewardObjective":
        if self.margins_cpu is not None:
            self.margins_device = torch.from_numpy(self.margins_cpu).float().to(device)
        return self

    def pair_terms(self, seq_out: torch.Tensor, batch: PackedBatch, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        sc, sr = seq_out.view(-1, 2).unbind(-1)
        margin_in = self.margins_device.index_select(0, batch.pair_index) if (
            self.use_margin and split == "train") else None
        losses = reward_pair_losses(sc, sr, margin_in, center_rewards_coefficient=self.center)
        margin = (sc - sr).detach().double()
        metrics = torch.stack([losses.detach().double(), tie_aware_accuracy(margin), (margin == 0).double(), margin,
                               sc.detach().double(), sr.detach().double()], dim=-1)
        return losses, metrics

    def probe_rows(self, probe: TokenPairs, outputs: np.ndarray, split: str = "probe") -> list[dict]:
        rows = []
        for i, pid in enumerate(probe.pair_ids):
            sc, sr = float(outputs[i, 0]), float(outputs[i, 1])
            rows.append({"pair_id": pid, "index": i, "token_hash": probe.token_hashes[i],
                         "chosen_score": sc, "rejected_score": sr, "margin": sc - sr,
                         "correct": correct_label(sc, sr)})
        return rows
