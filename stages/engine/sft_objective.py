"""The SFT objective (completion-only supervised fine-tuning, as TRL's SFTTrainer with completion_only_loss), what the
sft stage trains.

The model is a causal LM initialised from the reference directory; its per-sequence outputs are the summed
completion log-probs (the prompt tokens are masked: they are never scored, exactly as every DPO sequence's prompt).
The loss of an example is its completion's mean negative log-likelihood per token, -logp / n; the loop sums the
examples' losses and divides by the global example count of the step (a per-example token mean, TRL's
`average_tokens_across_devices=False` per-sequence view; TRL's default averages over the batch's tokens, equal
when the completions are equally long).

Through the engine's pair plan: an SFT example is a token "pair" whose first sequence is the example and whose
second is its prompt plus the first completion token (sft_token_pairs), so packing, data parallelism, LoRA,
checkpoints and exact resume, the optimizer modes and CUDA graphs are the ones DPO and the reward model use; the
second sequence is never part of the loss and costs one token beyond the prompt the pair shares (train.share_prompt).
The probe is the preference probe: each probe row holds the model's summed and per-token log-probs of both
completions, and `correct` says whether it prefers the chosen one per token (the SFT model's own preference, before
any preference training).
"""
from __future__ import annotations

import numpy as np
import torch

from stages.engine.modeling import SequenceLogProbs, load_causal_lm
from stages.engine.packing import PackedBatch, TokenPairs
from stages.lib.contracts import correct_label
from stages.lib.io import sha256_json


def sft_token_pairs(source: str, example_ids: list[str], ids: list[list[int]], prompt_lens: list[int]) -> TokenPairs:
    """SFT examples as the engine's TokenPairs: sequence 2i the example, 2i+1 its prompt and first completion
    token (a placeholder that no loss reads). Refuses an example without a scoreable completion token."""
    seqs, plens = [], []
    for i, (seq, n) in enumerate(zip(ids, prompt_lens)):
        if not 1 <= n < len(seq):
            raise ValueError(f"{source}: example {i} ({example_ids[i]}): prompt length {n} leaves no completion "
                             f"token in {len(seq)} tokens")
        arr = np.asarray(seq, dtype=np.int64)
        seqs += [arr, arr[:n + 1]]
        plens += [n, n]
    hashes = [sha256_json([[int(t) for t in seq], int(n)]) for seq, n in zip(ids, prompt_lens)]
    return TokenPairs(source=source, pair_ids=list(example_ids), token_hashes=hashes,
                      margins=np.full(len(example_ids), np.nan), seq_ids=seqs,
                      seq_prompt_lens=np.asarray(plens, dtype=np.int64))


class SFTObjective:
    """Causal LM initialised from the reference directory; loss = the example's completion NLL per token."""

    name = "sft"
    head = "lm_head"
    role = "policy"
    metric_names = ("loss", "completion_logp", "completion_tokens")

    def fingerprint(self) -> dict:
        return {"objective": self.name, "loss": "completion_nll_per_token"}

    def build_module(self, model_dir, train_settings, device: torch.device | None = None) -> SequenceLogProbs:
        return SequenceLogProbs(load_causal_lm(model_dir, device=device),
                                chunk_tokens=train_settings.logp_chunk_tokens, compile_chunks=train_settings.compile)

    @staticmethod
    def hf_model(module: SequenceLogProbs):
        return module.lm

    @staticmethod
    def prepare_pairs(hf, pairs: TokenPairs) -> TokenPairs:
        return pairs

    def to(self, device: torch.device) -> "SFTObjective":
        return self

    def pair_terms(self, seq_out: torch.Tensor, batch: PackedBatch, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        pc = seq_out.view(-1, 2)[:, 0]
        # Completion tokens per sequence, device-side (as DPOObjective counts them): a padded batch's empty sequences
        # count 0, clamped to 1, and weigh 0 (their pair_weight).
        counts = seq_out.new_zeros(seq_out.shape).index_add_(0, batch.logp_seq, seq_out.new_ones(batch.logp_seq.shape))
        n = counts.view(-1, 2)[:, 0].clamp(min=1)
        losses = -pc / n
        metrics = torch.stack([losses.detach(), pc.detach(), n], dim=-1)     # the loop weighs them by pair_weight
        return losses, metrics

    def probe_rows(self, probe: TokenPairs, outputs: np.ndarray) -> list[dict]:
        counts = (probe.seq_lens - probe.seq_prompt_lens).reshape(-1, 2)
        rows = []
        for i, pid in enumerate(probe.pair_ids):
            pc, pr = float(outputs[i, 0]), float(outputs[i, 1])
            n_c, n_r = int(counts[i, 0]), int(counts[i, 1])
            rows.append({"pair_id": pid, "index": i, "token_hash": probe.token_hashes[i],
                         "chosen_logp": pc, "rejected_logp": pr, "chosen_tokens": n_c, "rejected_tokens": n_r,
                         "chosen_logp_per_token": pc / n_c, "rejected_logp_per_token": pr / n_r,
                         "correct": correct_label(pc / n_c, pr / n_r)})
        return rows
