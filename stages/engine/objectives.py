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
    and every other paired loss of TRL 1.16 (hinge, exo_pair, nca_pair, bco_pair, sppo_hard, aot, aot_unpaired,
    apo_zero, apo_down, discopop, sigmoid_norm, sft) plus SimPO and ORPO (reference-free), one or a weighted
    list (dpo.loss_weights), each with its paper in _one_loss;
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

import math
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pac
import torch
import torch.nn.functional as F

from stages.lib.contracts import correct_label
from stages.lib.io import read_parquet, sha256_bytes, sha256_json, write_parquet
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

    def probe_rows(self, probe: TokenPairs, outputs: np.ndarray) -> list[dict]:
        """The probe JSONL rows (manifest order) from the inference pass's [pairs, 2] outputs."""


def tie_aware_accuracy(margin: torch.Tensor) -> torch.Tensor:
    return (margin > 0).to(torch.float64) + 0.5 * (margin == 0).to(torch.float64)


# Every paired loss of TRL 1.16's DPOTrainer `loss_type`, plus SimPO (TRL's CPOTrainer loss_type simpo) and ORPO
# (TRL's ORPOTrainer). Our names equal TRL's except: our `ipo` is the paper's summed form and TRL's `ipo` is our
# `ipo_length_normalized`. README "DPO loss conventions" is the table of conventions.
DPO_LOSSES = ("sigmoid", "robust", "ipo", "ipo_length_normalized", "hinge", "exo_pair", "nca_pair", "bco_pair",
              "sppo_hard", "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sigmoid_norm", "sft",
              "simpo", "orpo")
IPO_LOSSES = ("ipo", "ipo_length_normalized")
# Defined without a reference model (their papers and TRL's CPO/ORPO trainers have none): dpo_ref_free only.
REFERENCE_FREE_LOSSES = ("simpo", "orpo")
# Read each branch's completion token count (per-token means).
LENGTH_LOSSES = ("ipo_length_normalized", "sigmoid_norm", "sft", "simpo", "orpo")
# Read label_smoothing (eps); every other loss would silently ignore it, so eps > 0 needs one of these.
SMOOTHING_LOSSES = ("sigmoid", "robust", "exo_pair", "aot", "aot_unpaired", "simpo")
# TRL 1.16 defaults of the two extra knobs (DPOConfig.discopop_tau, CPOConfig.simpo_gamma).
DEFAULT_DISCOPOP_TAU = 0.05
DEFAULT_SIMPO_GAMMA = 0.5


class DPOLossError(ValueError):
    """dpo.loss / loss_weights / label_smoothing / objective do not make a loss we can compute."""


def loss_terms(loss, loss_weights=None) -> tuple[tuple[str, float], ...]:
    """dpo.loss (one name, or a list as TRL's loss_type) and dpo.loss_weights (default 1 each) -> ((name, w), ...)."""
    names = [loss] if isinstance(loss, str) else list(loss)
    if not names:
        raise DPOLossError("dpo.loss is an empty list: name at least one loss")
    for name in names:
        if name not in DPO_LOSSES:
            raise DPOLossError(f"unknown DPO loss {name!r} ({' | '.join(DPO_LOSSES)})")
    if len(set(names)) != len(names):
        raise DPOLossError(f"dpo.loss {names} names a loss twice: give it one entry and a weight in dpo.loss_weights")
    if loss_weights is None:
        weights = [1.0] * len(names)
    else:
        weights = [float(w) for w in loss_weights]
        if len(weights) != len(names):
            raise DPOLossError(f"dpo.loss_weights has {len(weights)} entries for {len(names)} losses {names}: "
                               "give one weight per loss, in the same order")
        if not all(math.isfinite(w) and w > 0 for w in weights):
            raise DPOLossError(f"dpo.loss_weights {weights}: every weight must be finite and > 0 "
                               "(drop a loss from dpo.loss instead of weighting it 0)")
    return tuple(zip(names, weights))


def check_dpo_loss(loss_type, label_smoothing: float, *, loss_weights=None, objective: str | None = None,
                   discopop_tau: float = DEFAULT_DISCOPOP_TAU,
                   simpo_gamma: float = DEFAULT_SIMPO_GAMMA) -> tuple[tuple[str, float], ...]:
    """Refuse a loss we do not know, a setting the chosen losses would silently ignore, and an impossible
    combination (SimPO / ORPO with a reference); returns the ((name, weight), ...) terms."""
    terms = loss_terms(loss_type, loss_weights)
    names = [n for n, _ in terms]
    if not 0.0 <= label_smoothing < 0.5:
        raise DPOLossError(f"dpo.label_smoothing = {label_smoothing}: must lie in [0, 0.5)")
    if label_smoothing and not any(n in SMOOTHING_LOSSES for n in names):
        which = f"dpo.loss: {names[0]}" if len(names) == 1 else f"dpo.loss: {names}"
        extra = " (IPO has no label smoothing; TRL ignores it there)" if set(names) & set(IPO_LOSSES) else ""
        raise DPOLossError(f"dpo.label_smoothing = {label_smoothing} has no meaning for {which}{extra}: set it to 0, "
                           f"or use a loss that reads it ({' | '.join(SMOOTHING_LOSSES)})")
    if "exo_pair" in names and label_smoothing == 0:
        raise DPOLossError("dpo.loss exo_pair needs dpo.label_smoothing > 0 (the target distribution "
                           "[1 - eps, eps] has log(eps) = -inf at 0; the EXO paper and TRL suggest 1e-3)")
    if objective == "dpo" and (set(names) & set(REFERENCE_FREE_LOSSES)):
        raise DPOLossError(f"dpo.loss {sorted(set(names) & set(REFERENCE_FREE_LOSSES))} is reference-free by "
                           "definition (SimPO, ORPO): set dpo.objective: dpo_ref_free (the reference log-probs "
                           "would be computed and never read)")
    if not (math.isfinite(discopop_tau) and discopop_tau > 0):
        raise DPOLossError(f"dpo.discopop_tau = {discopop_tau}: must be > 0")
    if not (math.isfinite(simpo_gamma) and simpo_gamma >= 0):
        raise DPOLossError(f"dpo.simpo_gamma = {simpo_gamma}: must be >= 0")
    return terms


def check_dpo_params(dpo: dict) -> tuple[tuple[str, float], ...]:
    """The params.yaml `dpo:` section's loss settings, checked before anything is built."""
    return check_dpo_loss(dpo["loss"], float(dpo["label_smoothing"]), loss_weights=dpo.get("loss_weights"),
                          objective=dpo.get("objective"),
                          discopop_tau=float(dpo.get("discopop_tau", DEFAULT_DISCOPOP_TAU)),
                          simpo_gamma=float(dpo.get("simpo_gamma", DEFAULT_SIMPO_GAMMA)))


def _sorted_valid(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """x sorted ascending over the micro-batch, padding pairs (valid False) pushed to the end as the same
    large finite value in every sorted vector (their differences are 0, hence finite; pair_weight is 0 there,
    since a padded batch keeps its real pairs first: packing.pad_packed_batch). Fixed shape, no host sync."""
    if valid is not None:
        x = torch.where(valid, x, torch.finfo(x.dtype).max)
    return torch.sort(x, dim=0).values


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0 without cancellation (Maechler 2012: branch at -ln 2)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _one_loss(name: str, pc, pr, rc, rr, n_c, n_r, *, beta: float, eps: float, discopop_tau: float,
              simpo_gamma: float, valid) -> torch.Tensor:
    """One per-pair loss; see dpo_pair_losses for the papers and the relation to TRL."""
    if name in LENGTH_LOSSES and (n_c is None or n_r is None):
        raise DPOLossError(f"dpo.loss {name} needs the completion token counts of both branches")
    if name in LENGTH_LOSSES:
        # clamped to >= 1 as TRL, so the empty padding sequences of a packed batch stay finite
        n_c, n_r = n_c.clamp(min=1).to(pc.dtype), n_r.clamp(min=1).to(pc.dtype)
    if name == "ipo_length_normalized":
        return ((pc - rc) / n_c - (pr - rr) / n_r - 1 / (2 * beta)) ** 2
    cr, rjr = pc - rc, pr - rr                       # the chosen / rejected log-ratios
    logits = cr - rjr
    if name == "sigmoid":                            # kept as is: the default run's bytes depend on it
        return (-F.logsigmoid(beta * logits) * (1 - eps) - F.logsigmoid(-beta * logits) * eps)
    if name == "robust":
        return ((-F.logsigmoid(beta * logits) * (1 - eps) + F.logsigmoid(-beta * logits) * eps) / (1 - 2 * eps))
    if name == "ipo":
        return (logits - 1 / (2 * beta)) ** 2
    if name == "hinge":
        # SLiC (Zhao et al., "SLiC-HF: Sequence Likelihood Calibration with Human Feedback", arXiv:2305.10425,
        # Eq. 2 with delta = 1 / beta, as TRL): max(0, 1 - beta * h)
        return torch.relu(1 - beta * logits)
    if name == "exo_pair":
        # EXO (Ji et al., "Towards Efficient Exact Optimization of Language Model Alignment", ICML 2024,
        # arXiv:2402.00856, Eq. 16 with K = 2): KL(p_theta || p_data), p_theta = softmax over {chosen, rejected}
        # of beta * log-ratio, p_data = [1 - eps, eps].
        z = beta * logits
        return (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps))
                + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps)))
    if name == "nca_pair":
        # NCA (Chen et al., "Noise Contrastive Alignment of Language Models with Explicit Rewards", NeurIPS 2024,
        # arXiv:2402.05369, the pairwise NCA loss): -log s(r_w) - 1/2 log s(-r_w) - 1/2 log s(-r_l), r = beta * log-ratio
        return (-F.logsigmoid(beta * cr) - 0.5 * F.logsigmoid(-beta * cr) - 0.5 * F.logsigmoid(-beta * rjr))
    if name == "bco_pair":
        # BCO (Jung et al., "Binary Classifier Optimization for Large Language Model Alignment", arXiv:2404.04656,
        # Eq. 8) with the reward shift delta = 0, as TRL 1.16's bco_pair (TRL <= 0.x kept a running mean of the
        # rewards as delta; TRL 1.16 dropped it, and so do we: no state across steps).
        return -F.logsigmoid(beta * cr) - F.logsigmoid(-beta * rjr)
    if name == "sppo_hard":
        # SPPO (Wu et al., "Self-Play Preference Optimization for Language Model Alignment", arXiv:2405.00675,
        # Eq. 4.7) with the hard win probability P = 1 / 0, as TRL: (lr_w - 1/(2 beta))^2 + (lr_l + 1/(2 beta))^2
        return (cr - 0.5 / beta) ** 2 + (rjr + 0.5 / beta) ** 2
    if name in ("aot", "aot_unpaired"):
        # AOT (Melnyk et al., "Distributional Preference Alignment of LLMs via Optimal Transport", NeurIPS 2024,
        # arXiv:2406.05882): first-order stochastic dominance through the sorted (quantile) differences over the
        # batch, with the cDPO loss on them. aot (paired): sort(pc - pr) - sort(rc - rr); aot_unpaired: sort of the
        # chosen log-ratios - sort of the rejected ones. The batch is the micro-batch (TRL: the per-device batch).
        if name == "aot":
            delta = _sorted_valid(pc - pr, valid) - _sorted_valid(rc - rr, valid)
        else:
            delta = _sorted_valid(cr, valid) - _sorted_valid(rjr, valid)
        return -F.logsigmoid(beta * delta) * (1 - eps) - F.logsigmoid(-beta * delta) * eps
    if name == "apo_zero":
        # APO (D'Oosterlinck et al., "Anchored Preference Optimization and Contrastive Revisions", arXiv:2408.06266,
        # Eq. 7): raise the chosen likelihood, lower the rejected one
        return (1 - torch.sigmoid(beta * cr)) + torch.sigmoid(beta * rjr)
    if name == "apo_down":
        # APO, Eq. 8: lower both, the rejected more
        return torch.sigmoid(beta * cr) + (1 - torch.sigmoid(beta * logits))
    if name == "discopop":
        # DiscoPOP (Lu et al., "Discovering Preference Optimization Algorithms with and for Large Language Models",
        # NeurIPS 2024, arXiv:2406.08414, Eq. 5, the log-ratio modulated loss):
        # (1 - s(z / tau)) * -log s(z) + s(z / tau) * exp(-z), z = beta * h. The exp term is computed as
        # exp(-z + log s(z / tau)), the same value, so a very negative z gives 1 * e^|z| rather than inf * 0 = NaN.
        z = beta * logits
        m = torch.sigmoid(z / discopop_tau)
        return -F.logsigmoid(z) * (1 - m) + torch.exp(-z + F.logsigmoid(z / discopop_tau))
    if name == "sigmoid_norm":
        # DPO on the per-token mean log-ratios (TRL 1.16 sigmoid_norm; the length normalisation of SimPO,
        # arXiv:2405.14734, applied to the DPO reward): -log s(beta * (lr_w / n_w - lr_l / n_l))
        return -F.logsigmoid(beta * (cr / n_c - rjr / n_r))
    if name == "sft":
        # The NLL of the chosen completion (RPO, Pang et al., "Iterative Reasoning Preference Optimization",
        # arXiv:2404.19733, Eq. 1: -log pi(y_w | x) / |y_w|), as a per-pair token mean; TRL 1.16's sft is the
        # token mean over the whole batch (equal when the chosen completions have equal lengths).
        return -pc / n_c
    if name == "simpo":
        # SimPO (Meng, Xia & Chen, "SimPO: Simple Preference Optimization with a Reference-Free Reward",
        # NeurIPS 2024, arXiv:2405.14734, Eq. 6): -log s(beta / |y_w| log pi(y_w) - beta / |y_l| log pi(y_l) - gamma),
        # with TRL CPOTrainer's label smoothing eps (cDPO-style; 0 = the paper).
        z = beta * (pc / n_c - pr / n_r) - simpo_gamma
        return -F.logsigmoid(z) * (1 - eps) - F.logsigmoid(-z) * eps
    if name == "orpo":
        # ORPO (Hong, Lee & Thorne, "ORPO: Monolithic Preference Optimization without Reference Model", EMNLP 2024,
        # arXiv:2403.07691, Eqs. 6-7): L_SFT + lambda * L_OR, lambda = beta (TRL's ORPOConfig.beta);
        # L_SFT = -log P(y_w | x) / |y_w| (Eq. 2, the per-pair token mean; TRL: the batch token mean),
        # L_OR = -log s(log odds(y_w) - log odds(y_l)), odds(y) = P / (1 - P), P = exp(per-token mean log-prob).
        a_c, a_r = pc / n_c, pr / n_r
        if valid is not None:
            # a padding pair's empty sequences have a = 0, whose odds are infinite: give them a finite stand-in
            # BEFORE the log (torch.where after it would still pass NaN gradients back); they weigh 0
            a_c, a_r = torch.where(valid, a_c, -1.0), torch.where(valid, a_r, -1.0)
        log_odds = (a_c - a_r) - (_log1mexp(a_c) - _log1mexp(a_r))
        return -a_c - beta * F.logsigmoid(log_odds)
    raise DPOLossError(f"unknown DPO loss {name!r}")


def dpo_pair_losses(pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor, *, beta: float,
                    loss_type="sigmoid", label_smoothing: float = 0.0, loss_weights=None,
                    chosen_tokens: torch.Tensor | None = None, rejected_tokens: torch.Tensor | None = None,
                    discopop_tau: float = DEFAULT_DISCOPOP_TAU, simpo_gamma: float = DEFAULT_SIMPO_GAMMA,
                    valid: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pair DPO-family losses from summed completion log-probs (policy pc/pr, reference rc/rr; 0 when
    reference-free): sum_k loss_weights[k] * loss_k, as TRL's loss_type list + loss_weights.

    chosen_tokens / rejected_tokens: each branch's completion token count (the tokens summed into pc / pr),
    needed by the LENGTH_LOSSES. valid: which pairs are real (pair_weight > 0); aot / aot_unpaired sort over the
    real pairs only. Relation to TRL 1.16 (`loss_type`, `label_smoothing`; the rest in _one_loss and README):
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
      hinge, exo_pair, nca_pair, bco_pair (delta = 0, as TRL 1.16), sppo_hard, aot, aot_unpaired, apo_zero,
      apo_down, discopop, sigmoid_norm: TRL's loss of that name; sft: the chosen NLL as a per-pair token mean
      (TRL: a batch token mean); simpo: TRL CPOTrainer loss_type simpo (cpo_alpha = 0); orpo: TRL ORPOTrainer
      with its NLL as a per-pair token mean (TRL: a batch token mean). Each pair's loss is later summed and
      divided by the GLOBAL pair count of the step (TRL: the mean over the per-device batch).
    """
    terms = check_dpo_loss(loss_type, label_smoothing, loss_weights=loss_weights, discopop_tau=discopop_tau,
                           simpo_gamma=simpo_gamma)
    kw = dict(beta=beta, eps=label_smoothing, discopop_tau=discopop_tau, simpo_gamma=simpo_gamma, valid=valid)
    if len(terms) == 1 and terms[0][1] == 1.0:       # one loss, unweighted: exactly that loss's arithmetic
        return _one_loss(terms[0][0], pc, pr, rc, rr, chosen_tokens, rejected_tokens, **kw)
    total = None
    for name, weight in terms:
        part = _one_loss(name, pc, pr, rc, rr, chosen_tokens, rejected_tokens, **kw) * weight
        total = part if total is None else total + part
    return total


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


def write_ref_logps(path, table: pa.Table) -> None:
    """The ref_logps parquet, with the digest of its values in the footer (stages.lib.io.VALUES_DIGEST_KEY): the
    log-probs have no content hash of their own, and the page CRCs do not cover the footer."""
    write_parquet(path, table, values_digest=True)


def read_ref_logps(path) -> pa.Table:
    """write_ref_logps's table; a damaged file (page CRC, values digest) is refused naming it (CorruptFileError)."""
    return read_parquet(path, values_digest=True)


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
        self.loss_weights = dpo_params.get("loss_weights")
        self.discopop_tau = float(dpo_params.get("discopop_tau", DEFAULT_DISCOPOP_TAU))
        self.simpo_gamma = float(dpo_params.get("simpo_gamma", DEFAULT_SIMPO_GAMMA))
        self.terms = check_dpo_params(dpo_params)
        self.needs_lengths = any(n in LENGTH_LOSSES for n, _ in self.terms)
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
        fp = {"objective": self.name, "beta": self.beta, "loss": self.loss_type,
              "label_smoothing": self.label_smoothing, "ref_logps_digest": ref}
        # the newer knobs only where a run uses them, so the runs (and checkpoints) of the earlier options keep
        # their fingerprint
        if self.loss_weights is not None:
            fp["loss_weights"] = [float(w) for w in self.loss_weights]
        names = {n for n, _ in self.terms}
        if "discopop" in names:
            fp["discopop_tau"] = self.discopop_tau
        if "simpo" in names:
            fp["simpo_gamma"] = self.simpo_gamma
        return fp

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
                                 chosen_tokens=n_c, rejected_tokens=n_r, discopop_tau=self.discopop_tau,
                                 simpo_gamma=self.simpo_gamma, valid=batch.pair_weight > 0)
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

    def probe_rows(self, probe: TokenPairs, outputs: np.ndarray) -> list[dict]:
        rows = []
        for i, pid in enumerate(probe.pair_ids):
            sc, sr = float(outputs[i, 0]), float(outputs[i, 1])
            rows.append({"pair_id": pid, "index": i, "token_hash": probe.token_hashes[i],
                         "chosen_score": sc, "rejected_score": sr, "margin": sc - sr,
                         "correct": correct_label(sc, sr)})
        return rows
