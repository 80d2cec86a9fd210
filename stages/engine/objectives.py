"""The two preference objectives: DPO (with a frozen reference, or reference-free) and a pairwise reward model.

Each objective tells the shared training loop (stages/engine/loop.py) four things: which model to build from the
reference directory, the per-pair loss and metrics from the model's per-sequence outputs, the
probe JSONL rows, and what to export. The formulas follow the papers / TRL line by line:

  DPO (Rafailov et al. 2023), logits = (pc - rc) - (pr - rr), p = policy, r = reference log-probs
  (summed over the completion tokens), eps = dpo.label_smoothing; `dpo.loss` selects (see
  dpo_pair_losses for each one's relation to TRL 1.16's DPOTrainer loss_type / label_smoothing):
    sigmoid: -logsigmoid(beta * logits) * (1 - eps) - logsigmoid(-beta * logits) * eps   (eps > 0: cDPO)
    robust:  (-logsigmoid(beta * logits) * (1 - eps) + logsigmoid(-beta * logits) * eps) / (1 - 2 * eps)
    ipo:     (logits - 1 / (2 * beta)) ** 2                                             (Azar et al. 2023)
    ipo_length_normalized: as ipo with each log-ratio divided by its completion's token count
    reference-free: rc = rr = 0.
    implicit rewards (metrics, probe rows; whatever the loss): chosen = beta * (pc - rc), rejected = beta * (pr - rr).
  Reward model (Bradley-Terry, as TRL's RewardTrainer):
    -logsigmoid(sc - sr [- margin]) + center_rewards_coefficient * (sc + sr) ** 2
    s = the score head on the last token whose id != the model's pad_token_id, the token HF's
    AutoModelForSequenceClassification (hence TRL) pools (SCORE_POSITION; the same in training, probe, export).

Per-pair losses are summed and divided by the GLOBAL pair count of the optimizer step in the
trainer; accuracy counts a tie (margin exactly 0) as 0.5 and ties are reported separately.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pac
import torch
import torch.nn.functional as F

from stages.lib.contracts import correct_label
from stages.lib.io import sha256_bytes, sha256_json
from stages.engine.modeling import SequenceLogProbs, SequenceRewards, load_causal_lm, load_reward_model
from stages.engine.packing import PackedBatch, TokenPairs


class RefLogpsError(ValueError):
    """ref_logps.parquet does not match the token data it is used with."""


class Objective(Protocol):
    """What the training loop (stages/engine/loop.py) asks of an objective; DPOObjective and RewardObjective
    implement it, and a new objective implements exactly this."""

    name: str                          # run_info's `objective`
    head: str                          # "lm_head" (exports a causal LM) | "score" (a sequence classifier)
    metric_names: tuple[str, ...]      # the per-pair terms pair_terms returns, "loss" and "accuracy" first

    def fingerprint(self) -> dict:
        """What of this objective shapes the trajectory (checkpoints resume only a run with the same one)."""

    def build_module(self, model_dir, train_settings) -> torch.nn.Module:
        """The module the loop trains: a model from the reference directory and how its outputs are read."""

    def hf_model(self, module: torch.nn.Module) -> torch.nn.Module:
        """The Hugging Face model inside `module` (what is exported)."""

    def prepare_pairs(self, hf: torch.nn.Module, pairs: TokenPairs) -> TokenPairs:
        """The token pairs as this objective reads them (e.g. a reward model's score positions)."""

    def to(self, device: torch.device) -> "Objective":
        """Move any tensors the objective holds (e.g. reference log-probs) to the device."""

    def pair_terms(self, seq_out: torch.Tensor, batch: PackedBatch, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-pair losses [P], per-pair metrics [P, len(metric_names)]) from the module's outputs; device-side,
        no host sync (it runs inside CUDA graphs)."""

    def probe_rows(self, probe: TokenPairs, outputs: np.ndarray) -> list[dict]:
        """The probe JSONL rows (manifest order) from the inference pass's [pairs, 2] outputs."""


def tie_aware_accuracy(margin: torch.Tensor) -> torch.Tensor:
    return (margin > 0).to(torch.float64) + 0.5 * (margin == 0).to(torch.float64)


DPO_LOSSES = ("sigmoid", "robust", "ipo", "ipo_length_normalized")
IPO_LOSSES = ("ipo", "ipo_length_normalized")


def check_dpo_loss(loss_type: str, label_smoothing: float) -> None:
    """Refuse a loss name we do not know, and a label_smoothing the chosen loss would silently ignore."""
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"unknown DPO loss {loss_type!r} ({' | '.join(DPO_LOSSES)})")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo.label_smoothing = {label_smoothing}: must lie in [0, 0.5)")
    if loss_type in IPO_LOSSES and label_smoothing:
        raise ValueError(f"dpo.label_smoothing = {label_smoothing} has no meaning for dpo.loss: {loss_type} "
                         "(IPO has no label smoothing; TRL ignores it there): set it to 0, or use sigmoid (cDPO) "
                         "or robust")


def dpo_pair_losses(pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor, *, beta: float,
                    loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                    chosen_tokens: torch.Tensor | None = None,
                    rejected_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pair DPO losses from summed completion log-probs (policy pc/pr, reference rc/rr; 0 when reference-free).

    chosen_tokens / rejected_tokens: each branch's completion token count (the tokens summed into pc / pr),
    needed by ipo_length_normalized only. Relation to TRL 1.16 DPOTrainer (`loss_type`, `label_smoothing`):
      sigmoid, eps = 0: TRL `sigmoid`, the same loss.
      sigmoid, eps > 0: conservative DPO (cDPO; E. Mitchell, "A note on DPO with noisy preferences &
        relationship to IPO", 2023): the expected DPO loss when each label is flipped with probability eps.
        TRL 1.16's `sigmoid` ignores label_smoothing; TRL <= 0.28's `sigmoid` applied this same formula.
      robust: TRL `robust` (same formula, label_smoothing = eps): the unbiased loss of Chowdhury, Kini &
        Natarajan, "Provably Robust DPO: Aligning Language Models with Noisy Feedback", ICML 2024
        (arXiv:2403.00409), ((1 - eps) * l(beta * logits) - eps * l(-beta * logits)) / (1 - 2 * eps), l = -logsigmoid.
        Equal to sigmoid at eps = 0; unlike cDPO it is unbounded below for eps > 0.
      ipo: Azar et al., "A General Theoretical Paradigm to Understand Learning from Human Preferences", 2023
        (arXiv:2310.12036), Eq. 17 with beta = tau, on the SUMMED sequence log-ratios, as written in the paper.
        Differs from TRL `ipo`, whose log-ratios are divided by the completion length first.
      ipo_length_normalized: TRL `ipo` (TRL 0.x and 1.x): Eq. 17 on the per-token MEAN log-ratios,
        ((pc - rc) / n_c - (pr - rr) / n_r - 1 / (2 * beta)) ** 2, n = completion tokens (clamped to >= 1, as TRL,
        so the empty padding sequences of a packed batch stay finite).
      IPO has no label smoothing: eps > 0 is refused with either (TRL ignores it).
    """
    check_dpo_loss(loss_type, label_smoothing)
    if loss_type == "ipo_length_normalized":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("dpo.loss ipo_length_normalized needs the completion token counts of both branches")
        n_c, n_r = chosen_tokens.clamp(min=1).to(pc.dtype), rejected_tokens.clamp(min=1).to(pc.dtype)
        return ((pc - rc) / n_c - (pr - rr) / n_r - 1 / (2 * beta)) ** 2
    logits = (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":
        return (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
                - F.logsigmoid(-beta * logits) * label_smoothing)
    if loss_type == "robust":
        return ((-F.logsigmoid(beta * logits) * (1 - label_smoothing)
                 + F.logsigmoid(-beta * logits) * label_smoothing) / (1 - 2 * label_smoothing))
    return (logits - 1 / (2 * beta)) ** 2          # ipo


def reward_pair_losses(sc: torch.Tensor, sr: torch.Tensor, margin: torch.Tensor | None = None, *,
                       center_rewards_coefficient: float = 0.0) -> torch.Tensor:
    diff = sc - sr if margin is None else sc - sr - margin
    loss = -F.logsigmoid(diff)
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * (sc + sr) ** 2
    return loss


# Where a reward model reads its score (TokenPairs.with_score_positions): transformers' sequence-classification
# pooling for right-padded input, `(arange(T) * (input_ids != pad_token_id)).argmax(-1)`.
SCORE_POSITION = "last_token_not_pad"


# ----------------------------------------------------------------------------------------------
# Reference log-probs (the ref_logps stage's parquet)
# ----------------------------------------------------------------------------------------------

REF_LOGPS_SCHEMA = pa.schema([("pair_id", pa.string()), ("split", pa.string()), ("ref_chosen_logp", pa.float64()),
                              ("ref_rejected_logp", pa.float64()), ("token_hash", pa.string())])


def ref_logps_table(splits: list[tuple[str, TokenPairs, np.ndarray]]) -> pa.Table:
    """(split, pairs, logps [n, 2]) -> the ref_logps parquet table, rows in split then file order."""
    cols = {name: [] for name in REF_LOGPS_SCHEMA.names}
    for split, pairs, logps in splits:
        cols["pair_id"] += pairs.pair_ids
        cols["split"] += [split] * len(pairs)
        cols["ref_chosen_logp"] += logps[:, 0].astype(np.float64).tolist()
        cols["ref_rejected_logp"] += logps[:, 1].astype(np.float64).tolist()
        cols["token_hash"] += pairs.token_hashes
    return pa.Table.from_pydict(cols, schema=REF_LOGPS_SCHEMA)


def ref_logps_for(table: pa.Table, split: str, pairs: TokenPairs, source: str) -> np.ndarray:
    """[n, 2] reference log-probs aligned to `pairs`; refuses missing, duplicated, stale or non-finite rows."""
    rows = table.filter(pac.equal(table.column("split"), split)).to_pydict()
    index: dict[str, int] = {}
    for i, pid in enumerate(rows["pair_id"]):
        if pid in index:
            raise RefLogpsError(f"{source}: pair {pid} appears twice in split {split}")
        index[pid] = i
    out = np.empty((len(pairs), 2), dtype=np.float64)
    for k, (pid, token_hash) in enumerate(zip(pairs.pair_ids, pairs.token_hashes)):
        i = index.get(pid)
        if i is None:
            raise RefLogpsError(f"{source}: no {split} row for pair {pid} (from {pairs.source}); rerun ref_logps")
        if "token_hash" in rows and rows["token_hash"][i] != token_hash:
            raise RefLogpsError(f"{source}: pair {pid} was computed from other tokens (token_hash "
                                f"{rows['token_hash'][i][:12]} != {token_hash[:12]} in {pairs.source}); rerun ref_logps")
        out[k] = (rows["ref_chosen_logp"][i], rows["ref_rejected_logp"][i])
    if not np.isfinite(out).all():
        bad = pairs.pair_ids[int(np.flatnonzero(~np.isfinite(out).all(axis=1))[0])]
        raise RefLogpsError(f"{source}: non-finite reference log-prob for pair {bad}")
    return out


# ----------------------------------------------------------------------------------------------
# Objectives
# ----------------------------------------------------------------------------------------------

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
        check_dpo_loss(self.loss_type, self.label_smoothing)
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
        return {"objective": self.name, "beta": self.beta, "loss": self.loss_type,
                "label_smoothing": self.label_smoothing, "ref_logps_digest": ref}

    def build_module(self, model_dir, train_settings) -> SequenceLogProbs:
        return SequenceLogProbs(load_causal_lm(model_dir), chunk_tokens=train_settings.logp_chunk_tokens,
                                compile_chunks=train_settings.compile)

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
        if self.loss_type == "ipo_length_normalized":
            # Completion tokens per sequence: logp_seq names the sequence of every log-prob summed into seq_out
            # (device-side, no host sync, fixed shape: CUDA-graph safe). A padded batch's empty sequences count 0
            # (clamped to 1 in the loss) and its trash sequence the padding's log-prob slots; both weigh 0.
            counts = seq_out.new_zeros(seq_out.shape).index_add_(0, batch.logp_seq,
                                                                 seq_out.new_ones(batch.logp_seq.shape))
            n_c, n_r = counts.view(-1, 2).unbind(-1)
        losses = dpo_pair_losses(pc, pr, rc, rr, beta=self.beta, loss_type=self.loss_type,
                                 label_smoothing=self.label_smoothing, chosen_tokens=n_c, rejected_tokens=n_r)
        chosen_reward, rejected_reward = self.beta * (pc - rc).detach(), self.beta * (pr - rr).detach()
        margin = chosen_reward - rejected_reward
        metrics = torch.stack([losses.detach(), tie_aware_accuracy(margin), (margin == 0).double(), margin,
                               chosen_reward, rejected_reward], dim=-1)
        return losses, metrics

    def probe_rows(self, probe: TokenPairs, outputs: np.ndarray) -> list[dict]:
        ref = self.ref_cpu["probe"] if self.ref_cpu is not None else np.zeros_like(outputs)
        rows = []
        for i, pid in enumerate(probe.pair_ids):
            pc, pr = float(outputs[i, 0]), float(outputs[i, 1])
            rc, rr = float(ref[i, 0]), float(ref[i, 1])
            chosen_reward, rejected_reward = self.beta * (pc - rc), self.beta * (pr - rr)
            margin = chosen_reward - rejected_reward
            rows.append({"pair_id": pid, "index": i, "token_hash": probe.token_hashes[i],
                         "policy_chosen_logp": pc, "policy_rejected_logp": pr,
                         "ref_chosen_logp": rc, "ref_rejected_logp": rr,
                         "chosen_reward": chosen_reward, "rejected_reward": rejected_reward,
                         "margin": margin, "correct": correct_label(chosen_reward, rejected_reward)})
        return rows


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

    def build_module(self, model_dir, train_settings) -> SequenceRewards:
        return SequenceRewards(load_reward_model(model_dir))

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

    def probe_rows(self, probe: TokenPairs, outputs: np.ndarray) -> list[dict]:
        rows = []
        for i, pid in enumerate(probe.pair_ids):
            sc, sr = float(outputs[i, 0]), float(outputs[i, 1])
            rows.append({"pair_id": pid, "index": i, "token_hash": probe.token_hashes[i],
                         "chosen_score": sc, "rejected_score": sr, "margin": sc - sr,
                         "correct": correct_label(sc, sr)})
        return rows
