"""The DPO objective (with a frozen reference, or reference-free), what train_dpo trains.

The policy is a causal LM initialised from the reference directory; its per-sequence outputs are the summed
completion log-probs. The reference's come precomputed from the ref_logps stage (stages/lib/ref_logps_table.py);
reference-free: rc = rr = 0. The per-pair loss is dpo.loss from the registry (stages/engine/dpo_losses.py, papers
and TRL relations there), and the implicit rewards of the train log and the probe rows are the one the loss
declares (stages/lib/implicit_reward.py): beta * (policy - reference), summed over the completion tokens,
or their per-token mean for the length-normalized losses (SimPO, ORPO, sigmoid_norm, ipo_length_normalized).
"""
from __future__ import annotations

import numpy as np
import torch

from stages.engine.dpo_losses import (KNOBS, LOSSES, check_dpo_params, dpo_knobs, dpo_pair_losses,
                                      reward_kind)
from stages.engine.modeling import SequenceLogProbs, load_causal_lm
from stages.engine.objectives import tie_aware_accuracy
from stages.engine.packing import PackedBatch, TokenPairs
from stages.lib.contracts import correct_label
from stages.lib.io import sha256_bytes, sha256_json
from stages.lib.ref_logps_table import RefLogpsError
from stages.lib.implicit_reward import SUMMED_REWARD, implicit_reward


class DPOObjective:
    """Policy = causal LM initialised from the reference directory; outputs = summed completion log-probs."""

    metric_names = ("loss", "accuracy", "ties", "margin", "chosen_reward", "rejected_reward")
    head = "lm_head"
    role = "policy"

    def __init__(self, dpo_params: dict, ref_logps: dict[str, np.ndarray] | None = None):
        self.name = dpo_params["objective"]
        self.beta = float(dpo_params["beta"])
        self.loss_type = dpo_params["loss"]
        self.label_smoothing = float(dpo_params["label_smoothing"])
        self.loss_weights = dpo_params.get("loss_weights")
        self.knobs = dpo_knobs(dpo_params)
        self.terms = check_dpo_params(dpo_params)
        self.reward = reward_kind(self.terms)
        self.needs_lengths = self.reward != SUMMED_REWARD or any(LOSSES[n].lengths for n, _ in self.terms)
        if self.name == "dpo" and ref_logps is None:
            raise RefLogpsError("objective dpo needs reference log-probs (--ref-logps from the ref_logps stage)")
        if self.name == "dpo_ref_free":
            ref_logps = None      # reference-free never reads them
        self.ref_cpu = ref_logps
        self.ref_device: dict[str, torch.Tensor] = {}

    def fingerprint(self) -> dict:
        """What changes this objective's trajectory (checkpoints of another setting are not resumed)."""
        ref = None
        if self.ref_cpu is not None:
            ref = sha256_json({k: sha256_bytes(np.ascontiguousarray(v, dtype=np.float64).tobytes())
                               for k, v in sorted(self.ref_cpu.items())})
        # Every knob, null where the loss uses none (a knob no term reads changes nothing, so it is not recorded).
        used = {k.key for n, _ in self.terms for k in LOSSES[n].knobs}
        return {"objective": self.name, "beta": self.beta, "loss": self.loss_type,
                "label_smoothing": self.label_smoothing, "ref_logps_digest": ref,
                "loss_weights": None if self.loss_weights is None else [float(w) for w in self.loss_weights],
                **{key: (self.knobs[key] if key in used else None) for key in KNOBS},
                "implicit_reward": self.reward}     # the probe rows saved with a checkpoint score this reward

    def build_module(self, model_dir, train_settings, device: torch.device | None = None) -> SequenceLogProbs:
        return SequenceLogProbs(load_causal_lm(model_dir, device=device),
                                chunk_tokens=train_settings.logp_chunk_tokens, compile_chunks=train_settings.compile)

    @staticmethod
    def hf_model(module: SequenceLogProbs):
        return module.lm

    @staticmethod
    def prepare_pairs(hf, pairs: TokenPairs) -> TokenPairs:
        """A policy reads every completion token: the pairs as they are."""
        return pairs

    def to(self, device: torch.device) -> "DPOObjective":
        if self.ref_cpu is not None:
            self.ref_device = {k: torch.from_numpy(v).to(device) for k, v in self.ref_cpu.items()}
        return self

    def _ref(self, split: str, pair_index: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.name == "dpo_ref_free":
            return torch.zeros_like(like), torch.zeros_like(like)
        ref = self.ref_device[split].index_select(0, pair_index)
        return ref[:, 0], ref[:, 1]

    def pair_terms(self, seq_out: torch.Tensor, batch: PackedBatch, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        pc, pr = seq_out.view(-1, 2).unbind(-1)
        rc, rr = self._ref(split, batch.pair_index, pc)
        n_c = n_r = None
        if self.needs_lengths:
            # Completion tokens per sequence: logp_seq names the sequence of every log-prob summed into seq_out
            # (device-side, no host sync, fixed shape: CUDA-graph safe). A padded batch's empty sequences count 0
            # (clamped to 1 in the loss) and its trash sequence the padding's log-prob slots; both weigh 0.
            counts = seq_out.new_zeros(seq_out.shape).index_add_(0, batch.logp_seq,
                                                                 seq_out.new_ones(batch.logp_seq.shape))
            n_c, n_r = counts.view(-1, 2).unbind(-1)
        losses = dpo_pair_losses(pc, pr, rc, rr, beta=self.beta, loss_type=self.loss_type,
                                 label_smoothing=self.label_smoothing, loss_weights=self.loss_weights,
                                 chosen_tokens=n_c, rejected_tokens=n_r, valid=batch.pair_weight > 0, **self.knobs)
        if self.reward != SUMMED_REWARD:
            n_c, n_r = n_c.clamp(min=1), n_r.clamp(min=1)     # the padding's empty sequences weigh 0
        chosen_reward = implicit_reward(self.reward, self.beta, pc.detach(), rc, n_c)
        rejected_reward = implicit_reward(self.reward, self.beta, pr.detach(), rr, n_r)
        margin = chosen_reward - rejected_reward
        metrics = torch.stack([losses.detach(), tie_aware_accuracy(margin), (margin == 0).double(), margin,
                               chosen_reward, rejected_reward], dim=-1)
        return losses, metrics

    def completion_tokens(self, pairs: TokenPairs) -> np.ndarray:
        """[n, 2] completion token counts (the tokens summed into each branch's log-prob)."""
        return (pairs.seq_lens - pairs.seq_prompt_lens).reshape(-1, 2)

    def probe_rows(self, probe: TokenPairs, outputs: np.ndarray, split: str = "probe") -> list[dict]:
        ref = self.ref_cpu[split] if self.ref_cpu is not None else np.zeros_like(outputs)
        counts = self.completion_tokens(probe)
        rows = []
        for i, pid in enumerate(probe.pair_ids):
            pc, pr = float(outputs[i, 0]), float(outputs[i, 1])
            rc, rr = float(ref[i, 0]), float(ref[i, 1])
            row = {"pair_id": pid, "index": i, "token_hash": probe.token_hashes[i],
                   "policy_chosen_logp": pc, "policy_rejected_logp": pr,
                   "ref_chosen_logp": rc, "ref_rejected_logp": rr}
            n_c, n_r = int(counts[i, 0]), int(counts[i, 1])
            row.update({"chosen_tokens": n_c, "rejected_tokens": n_r, "implicit_reward": self.reward})
            chosen_reward = implicit_reward(self.reward, self.beta, pc, rc, n_c)
            rejected_reward = implicit_reward(self.reward, self.beta, pr, rr, n_r)
            margin = chosen_reward - rejected_reward
            row.update({"chosen_reward": chosen_reward, "rejected_reward": rejected_reward,
                        "margin": margin, "correct": correct_label(chosen_reward, rejected_reward)})
            rows.append(row)
        return rows
