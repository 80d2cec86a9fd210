"""The DPO losses: one registry, each loss declared next to its formula with what it needs.

Adding a loss is this file plus its test (docs/ARCHITECTURE.md "How to add a DPO loss"): a function under
`@dpo_loss(...)` that returns the per-pair loss, declaring what it reads. Everything else is derived from the
declarations: the name checks and refusals (check_dpo_loss), which inputs the objective computes (completion token
counts), the implicit reward the probe and evaluate score (`reward_kind`), the checkpoint fingerprint's knobs,
the log's hints, and, through `python -m stages.sync_losses`, the schema's `dpo.loss` enum and knob keys,
params.yaml's comment and docs/DPO_LOSSES.md's table (tests/engine/test_dpo_loss_registry.py fails until it has run).
Only train_dpo (and what reads its outputs) imports this file, so a new loss reruns train_dpo and what follows it.

Every formula reads a LossInputs `x`:
  x.pc, x.pr    policy log-probs of the chosen / rejected completion, summed over its tokens
  x.rc, x.rr    the same for the reference (0 when reference-free: dpo.objective dpo_ref_free)
  x.cr, x.rjr   the log-ratios pc - rc, pr - rr;  x.logits = cr - rjr (DPO's h)
  x.n_c, x.n_r  completion token counts, clamped to >= 1 as TRL (only for a loss declared `lengths=True`)
  x.beta, x.eps (dpo.label_smoothing; only a loss declared `smoothing=True` may read it), x.knobs[key] (its
                declared Knobs), x.valid (which pairs of the micro-batch are real; None: all)
and returns the per-pair loss [P]: device-side, fixed-shape, no host sync (it runs inside CUDA graphs; the loop
divides the sum by the global pair count and asserts finiteness on the device). A loss over the batch (aot's sort)
must leave the padding pairs (valid False) out. Anything beyond these sums and counts (per-token values, state
across steps) needs the model's outputs (DPOObjective.pair_terms) extended, and state must go into checkpoints.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from stages.lib.implicit_reward import MEAN_REWARD, SUMMED_REWARD


class DPOLossError(ValueError):
    """dpo.loss / loss_weights / label_smoothing / objective do not make a loss we can compute."""


@dataclass(frozen=True)
class Knob:
    """An extra `dpo.<key>` number a loss reads (a TRL config field)."""
    key: str
    default: float
    minimum: float
    exclusive: bool                    # True: value > minimum; False: value >= minimum
    description: str                   # for the schema and docs: what it is, TRL's name and default

    def check(self, value: float) -> None:
        ok = math.isfinite(value) and (value > self.minimum if self.exclusive else value >= self.minimum)
        if not ok:
            raise DPOLossError(f"dpo.{self.key} = {value}: must be {'>' if self.exclusive else '>='} {self.minimum:g}")


@dataclass(frozen=True)
class DPOLoss:
    """A loss and what it needs: the declarations every check, input, record and document is derived from."""
    name: str
    formula: Callable[["LossInputs"], torch.Tensor]
    summary: str                       # what it computes (docs/DPO_LOSSES.md notation), with its paper
    trl: str                           # TRL 1.16's counterpart; "none: ..." when TRL has none
    difference: str = "none"           # how ours differs from that counterpart
    reference_free: bool = False       # defined without a reference model: refused with dpo.objective dpo
    smoothing: bool = False            # reads dpo.label_smoothing (eps); eps > 0 is refused for the others
    requires_smoothing: str = ""       # non-empty: eps > 0 is required, and why
    lengths: bool = False              # reads the completion token counts n_c, n_r
    knobs: tuple[Knob, ...] = ()       # extra dpo.* numbers it reads
    # The reward whose chosen - rejected margin the loss acts on: what the probe, the train log and evaluate score
    # (stages/lib/implicit_reward.py). None: the loss has none of its own (sft), a list takes another's.
    implicit_reward: str | None = SUMMED_REWARD
    typical_beta: tuple[float, float, str] | None = None   # (low, high, where from): a far-off beta is hinted
    smoothing_note: str = ""           # added to the refusal of eps > 0 (why it means nothing here)


LOSSES: dict[str, DPOLoss] = {}


def dpo_loss(name: str, **declared) -> Callable:
    """Register the decorated formula as dpo.loss `name` with its declarations (DPOLoss's fields)."""
    def register(formula):
        if name in LOSSES:
            raise ValueError(f"DPO loss {name!r} is declared twice")
        LOSSES[name] = DPOLoss(name=name, formula=formula, **declared)
        return formula
    return register


@dataclass
class LossInputs:
    pc: torch.Tensor
    pr: torch.Tensor
    rc: torch.Tensor
    rr: torch.Tensor
    beta: float
    eps: float
    knobs: dict[str, float]
    valid: torch.Tensor | None = None
    n_c: torch.Tensor | None = None
    n_r: torch.Tensor | None = None
    cr: torch.Tensor = field(init=False)
    rjr: torch.Tensor = field(init=False)
    logits: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.cr, self.rjr = self.pc - self.rc, self.pr - self.rr
        self.logits = self.cr - self.rjr


def _cdpo(z: torch.Tensor, eps: float) -> torch.Tensor:
    """The (conservative) logistic loss of a margin z under label-flip rate eps (eps = 0: -logsigmoid(z))."""
    return -F.logsigmoid(z) * (1 - eps) - F.logsigmoid(-z) * eps


def _sorted_valid(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """x sorted ascending over the micro-batch, padding pairs (valid False) pushed to the end as the same
    large finite value in every sorted vector (their differences are 0, hence finite; pair_weight is 0 there,
    since a padded batch keeps its real pairs first: padded_shapes.pad_packed_batch). Fixed shape, no host sync."""
    if valid is not None:
        x = torch.where(valid, x, torch.finfo(x.dtype).max)
    return torch.sort(x, dim=0).values


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0 without cancellation (Maechler 2012: branch at -ln 2)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


DISCOPOP_TAU = Knob("discopop_tau", 0.05, 0.0, True,
                    "loss discopop: the temperature of its log-ratio modulation (TRL DPOConfig.discopop_tau, "
                    "default 0.05)")
SIMPO_GAMMA = Knob("simpo_gamma", 0.5, 0.0, False,
                   "loss simpo: the target reward margin gamma (TRL CPOConfig.simpo_gamma, default 0.5)")


# ----------------------------------------------------------------------------------------------
# The losses, in the order the docs list them
# ----------------------------------------------------------------------------------------------

@dpo_loss("sigmoid", smoothing=True,
          summary="DPO (Rafailov et al. 2023, Eq. 7): -logsig(beta h); eps > 0: cDPO (Mitchell 2023), "
                  "(1 - eps) -logsig(beta h) + eps -logsig(-beta h)",
          trl='`loss_type="sigmoid"` (eps = 0)',
          difference="none at eps = 0 (the default; agrees to fp32 noise). eps > 0: TRL 1.16's `sigmoid` ignores "
                     "`label_smoothing`; TRL <= 0.28's `sigmoid` applied this same cDPO formula")
def _sigmoid(x):
    # kept as written: the default run's bytes depend on this arithmetic
    return (-F.logsigmoid(x.beta * x.logits) * (1 - x.eps) - F.logsigmoid(-x.beta * x.logits) * x.eps)


@dpo_loss("robust", smoothing=True,
          summary="robust DPO (Chowdhury, Kini & Natarajan, ICML 2024, arXiv:2403.00409), unbiased under flip "
                  "rate eps: ((1 - eps) -logsig(beta h) - eps -logsig(-beta h)) / (1 - 2 eps)",
          trl='`loss_type="robust"`, same `label_smoothing`',
          difference="none; equals `sigmoid` at eps = 0 and, unlike cDPO, is unbounded below for eps > 0")
def _robust(x):
    return ((-F.logsigmoid(x.beta * x.logits) * (1 - x.eps) + F.logsigmoid(-x.beta * x.logits) * x.eps)
            / (1 - 2 * x.eps))


_IPO_NOTE = "IPO has no label smoothing; TRL ignores it there"


@dpo_loss("ipo", smoothing_note=_IPO_NOTE,
          summary="IPO (Azar et al. 2023, arXiv:2310.12036, Eq. 17; beta = tau): (h - 1/(2 beta))^2 on the "
                  "SUMMED log-ratios, as written in the paper",
          trl="none",
          difference="TRL's `ipo` is our `ipo_length_normalized`; ours scales with completion length (kept so "
                     "existing configs keep their meaning)")
def _ipo(x):
    return (x.logits - 1 / (2 * x.beta)) ** 2


@dpo_loss("ipo_length_normalized", lengths=True, implicit_reward=MEAN_REWARD, smoothing_note=_IPO_NOTE,
          summary="IPO Eq. 17 on the per-token MEAN log-ratios: (lr_w / n_w - lr_l / n_l - 1/(2 beta))^2",
          trl='`loss_type="ipo"` (TRL 0.x and 1.x; the IPO authors\' reported setting, per TRL\'s source)',
          difference="none in the loss. Probe reward: the per-token mean, as TRL 0.x's `ipo` logged it (it averaged "
                     "the log-probs first); TRL 1.16 logs summed rewards for every `loss_type`")
def _ipo_length_normalized(x):
    return ((x.pc - x.rc) / x.n_c - (x.pr - x.rr) / x.n_r - 1 / (2 * x.beta)) ** 2


@dpo_loss("hinge",
          summary="SLiC (Zhao et al. 2023, arXiv:2305.10425, Eq. 2 with delta = 1 / beta): relu(1 - beta h)",
          trl="`hinge`")
def _hinge(x):
    return torch.relu(1 - x.beta * x.logits)


@dpo_loss("exo_pair", smoothing=True,
          requires_smoothing="the target distribution [1 - eps, eps] has log(eps) = -inf at 0; the EXO paper and "
                             "TRL suggest 1e-3",
          summary="EXO (Ji et al., ICML 2024, arXiv:2402.00856, Eq. 16, K = 2): KL(softmax(beta lr) \\|\\| "
                  "[1 - eps, eps])",
          trl="`exo_pair`", difference="none; eps > 0 required (as TRL)")
def _exo_pair(x):
    # KL(p_theta || p_data), p_theta = softmax over {chosen, rejected} of beta * log-ratio, p_data = [1 - eps, eps]
    z = x.beta * x.logits
    return (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-x.eps))
            + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(x.eps)))


@dpo_loss("nca_pair",
          summary="NCA (Chen et al., NeurIPS 2024, arXiv:2402.05369, pairwise): -logsig(beta lr_w) - 1/2 "
                  "logsig(-beta lr_w) - 1/2 logsig(-beta lr_l)",
          trl="`nca_pair`")
def _nca_pair(x):
    return (-F.logsigmoid(x.beta * x.cr) - 0.5 * F.logsigmoid(-x.beta * x.cr) - 0.5 * F.logsigmoid(-x.beta * x.rjr))


@dpo_loss("bco_pair",
          summary="BCO (Jung et al. 2024, arXiv:2404.04656, Eq. 8) with reward shift delta = 0: -logsig(beta lr_w) "
                  "- logsig(-beta lr_l)",
          trl="`bco_pair`",
          difference="none. The paper's (and TRL 0.x's) running-mean shift delta is not kept, as in TRL 1.16: no "
                     "state across steps")
def _bco_pair(x):
    return -F.logsigmoid(x.beta * x.cr) - F.logsigmoid(-x.beta * x.rjr)


@dpo_loss("sppo_hard",
          summary="SPPO (Wu et al. 2024, arXiv:2405.00675, Eq. 4.7, hard P = 1 / 0): (lr_w - 1/(2 beta))^2 + "
                  "(lr_l + 1/(2 beta))^2",
          trl="`sppo_hard`")
def _sppo_hard(x):
    return (x.cr - 0.5 / x.beta) ** 2 + (x.rjr + 0.5 / x.beta) ** 2


_AOT_DIFFERENCE = ("none within a batch. The sort is over each **micro-batch** (TRL: each per-device batch; padding "
                   "pairs excluded), so the loss depends on how a step is split into micro-batches and processes")


@dpo_loss("aot", smoothing=True, trl="`aot`", difference=_AOT_DIFFERENCE,
          summary="AOT (Melnyk et al., NeurIPS 2024, arXiv:2406.05882; first-order stochastic dominance): the cDPO "
                  "loss on sorted (pc - pr) - sorted (rc - rr) over the batch")
def _aot(x):
    return _cdpo(x.beta * (_sorted_valid(x.pc - x.pr, x.valid) - _sorted_valid(x.rc - x.rr, x.valid)), x.eps)


@dpo_loss("aot_unpaired", smoothing=True, trl="`aot_unpaired`", difference=_AOT_DIFFERENCE,
          summary="AOT, unpaired: the cDPO loss on sorted lr_w - sorted lr_l over the batch")
def _aot_unpaired(x):
    return _cdpo(x.beta * (_sorted_valid(x.cr, x.valid) - _sorted_valid(x.rjr, x.valid)), x.eps)


@dpo_loss("apo_zero", trl="`apo_zero`",
          summary="APO-zero (D'Oosterlinck et al. 2024, arXiv:2408.06266, Eq. 7): raise the chosen likelihood, "
                  "lower the rejected: (1 - sig(beta lr_w)) + sig(beta lr_l)")
def _apo_zero(x):
    return (1 - torch.sigmoid(x.beta * x.cr)) + torch.sigmoid(x.beta * x.rjr)


@dpo_loss("apo_down", trl="`apo_down`",
          summary="APO-down (same paper, Eq. 8): lower both, the rejected more: sig(beta lr_w) + (1 - sig(beta h))")
def _apo_down(x):
    return torch.sigmoid(x.beta * x.cr) + (1 - torch.sigmoid(x.beta * x.logits))


@dpo_loss("discopop", knobs=(DISCOPOP_TAU,), trl="`discopop`, `discopop_tau`",
          summary="DiscoPOP (Lu et al., NeurIPS 2024, arXiv:2406.08414, Eq. 5, log-ratio modulated): (1 - "
                  "sig(z / tau)) -logsig(z) + sig(z / tau) exp(-z), z = beta h, tau = `dpo.discopop_tau`",
          difference="none; its exp term is computed as exp(-z + logsig(z / tau)), finite where TRL's exp(-z) * "
                     "sig(z / tau) gives inf * 0")
def _discopop(x):
    # exp(-z) * s(z / tau) as exp(-z + log s(z / tau)): the same value, and a very negative z gives 1 * e^|z|
    # rather than inf * 0 = NaN
    z = x.beta * x.logits
    tau = x.knobs["discopop_tau"]
    m = torch.sigmoid(z / tau)
    return -F.logsigmoid(z) * (1 - m) + torch.exp(-z + F.logsigmoid(z / tau))


@dpo_loss("sigmoid_norm", lengths=True, implicit_reward=MEAN_REWARD, trl="`sigmoid_norm`",
          summary="DPO on the per-token mean log-ratios (SimPO's length normalisation, arXiv:2405.14734, applied to "
                  "the DPO reward): -logsig(beta (lr_w / n_w - lr_l / n_l))",
          difference="none in the loss. Probe reward: the per-token mean log-ratio the loss compares; TRL 1.16 logs "
                     "summed rewards for every `loss_type`")
def _sigmoid_norm(x):
    return -F.logsigmoid(x.beta * (x.cr / x.n_c - x.rjr / x.n_r))


@dpo_loss("sft", lengths=True, implicit_reward=None, trl="`sft`",
          summary="the chosen completion's NLL (RPO, Pang et al. 2024, arXiv:2404.19733, Eq. 1): -pc / n_w **per "
                  "pair**; no preference reward of its own (in a list, the probe scores another loss's)",
          difference="TRL: the token mean over the whole batch, sum(-pc) / sum(n_w); equal when the chosen lengths "
                     "are equal")
def _sft(x):
    return -x.pc / x.n_c


@dpo_loss("simpo", reference_free=True, smoothing=True, lengths=True, knobs=(SIMPO_GAMMA,),
          implicit_reward=MEAN_REWARD,
          typical_beta=(2.0, 2.5, "the SimPO paper's runs (TRL's CPOConfig default 0.1 is DPO's)"),
          summary="SimPO (Meng, Xia & Chen, NeurIPS 2024, arXiv:2405.14734, Eq. 6): -logsig(beta (a_w - a_l) - "
                  "gamma), gamma = `dpo.simpo_gamma`, eps as cDPO (TRL CPOTrainer's label smoothing; 0 = the paper)",
          trl='`CPOTrainer`, `loss_type="simpo"`, `cpo_alpha=0`',
          difference="none; reward beta * a, as CPOTrainer logs it")
def _simpo(x):
    z = x.beta * (x.pc / x.n_c - x.pr / x.n_r) - x.knobs["simpo_gamma"]
    return -F.logsigmoid(z) * (1 - x.eps) - F.logsigmoid(-z) * x.eps


@dpo_loss("orpo", reference_free=True, lengths=True, implicit_reward=MEAN_REWARD,
          summary="ORPO (Hong, Lee & Thorne, EMNLP 2024, arXiv:2403.07691, Eqs. 6-7): -a_w - beta logsig(log "
                  "odds(a_w) - log odds(a_l)), odds(a) = e^a / (1 - e^a), beta = lambda",
          trl="`ORPOTrainer`, `beta`",
          difference="the odds-ratio term is TRL's; the NLL is the paper's L_SFT on the chosen **completion**, per "
                     "pair; TRL 1.16 averages the NLL over prompt **and** completion tokens of the whole batch. Reward "
                     "beta * a, as ORPOTrainer logs it")
def _orpo(x):
    # L_SFT + lambda * L_OR, lambda = beta (TRL's ORPOConfig.beta); L_SFT = -log P(y_w | x) / |y_w| (Eq. 2, the
    # per-pair token mean); L_OR = -log s(log odds(y_w) - log odds(y_l)), P = exp(per-token mean log-prob).
    a_c, a_r = x.pc / x.n_c, x.pr / x.n_r
    if x.valid is not None:
        # a padding pair's empty sequences have a = 0, whose odds are infinite: give them a finite stand-in
        # BEFORE the log (torch.where after it would still pass NaN gradients back); they weigh 0
        a_c, a_r = torch.where(x.valid, a_c, -1.0), torch.where(x.valid, a_r, -1.0)
    log_odds = (a_c - a_r) - (_log1mexp(a_c) - _log1mexp(a_r))
    return -a_c - x.beta * F.logsigmoid(log_odds)


# ----------------------------------------------------------------------------------------------
# Derived from the declarations
# ----------------------------------------------------------------------------------------------

DPO_LOSSES = tuple(LOSSES)
REFERENCE_FREE_LOSSES = tuple(n for n, loss in LOSSES.items() if loss.reference_free)
LENGTH_LOSSES = tuple(n for n, loss in LOSSES.items() if loss.lengths)
SMOOTHING_LOSSES = tuple(n for n, loss in LOSSES.items() if loss.smoothing)
KNOBS: dict[str, Knob] = {k.key: k for loss in LOSSES.values() for k in loss.knobs}


def loss_terms(loss, loss_weights=None) -> tuple[tuple[str, float], ...]:
    """dpo.loss (one name, or a list as TRL's loss_type) and dpo.loss_weights (default 1 each) -> ((name, w), ...)."""
    names = [loss] if isinstance(loss, str) else list(loss)
    if not names:
        raise DPOLossError("dpo.loss is an empty list: name at least one loss")
    for name in names:
        if name not in LOSSES:
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


def knob_values(knobs: dict) -> dict[str, float]:
    """Every declared knob's value: the given ones (checked), the others at their defaults."""
    unknown = sorted(set(knobs) - set(KNOBS))
    if unknown:
        raise TypeError(f"unknown DPO loss knob(s) {unknown} (declared: {sorted(KNOBS)})")
    values = {key: float(knobs.get(key, knob.default)) for key, knob in KNOBS.items()}
    for key, value in values.items():
        KNOBS[key].check(value)
    return values


def check_dpo_loss(loss_type, label_smoothing: float, *, loss_weights=None, objective: str | None = None,
                   **knobs) -> tuple[tuple[str, float], ...]:
    """Refuse a loss we do not know, a setting the chosen losses would silently ignore, and an impossible
    combination (a reference-free loss with a reference); returns the ((name, weight), ...) terms."""
    terms = loss_terms(loss_type, loss_weights)
    declared = [LOSSES[n] for n, _ in terms]
    if not 0.0 <= label_smoothing < 0.5:
        raise DPOLossError(f"dpo.label_smoothing = {label_smoothing}: must lie in [0, 0.5)")
    if label_smoothing and not any(d.smoothing for d in declared):
        which = f"dpo.loss: {declared[0].name}" if len(declared) == 1 else f"dpo.loss: {[d.name for d in declared]}"
        notes = sorted({d.smoothing_note for d in declared if d.smoothing_note})
        extra = f" ({'; '.join(notes)})" if notes else ""
        raise DPOLossError(f"dpo.label_smoothing = {label_smoothing} has no meaning for {which}{extra}: set it to 0, "
                           f"or use a loss that reads it ({' | '.join(SMOOTHING_LOSSES)})")
    for d in declared:
        if d.requires_smoothing and label_smoothing == 0:
            raise DPOLossError(f"dpo.loss {d.name} needs dpo.label_smoothing > 0 ({d.requires_smoothing})")
    free = sorted(d.name for d in declared if d.reference_free)
    if objective == "dpo" and free:
        raise DPOLossError(f"dpo.loss {free} is reference-free by definition (its paper has no reference model): "
                           "set dpo.objective: dpo_ref_free (the reference log-probs would be computed and never read)")
    knob_values(knobs)
    return terms


def dpo_knobs(dpo: dict) -> dict[str, float]:
    """The params.yaml `dpo:` section's knob values (absent = the declared default)."""
    return knob_values({key: dpo[key] for key in KNOBS if key in dpo})


def check_dpo_params(dpo: dict) -> tuple[tuple[str, float], ...]:
    """The params.yaml `dpo:` section's loss settings, checked before anything is built."""
    return check_dpo_loss(dpo["loss"], float(dpo["label_smoothing"]), loss_weights=dpo.get("loss_weights"),
                          objective=dpo.get("objective"), **dpo_knobs(dpo))


def reward_kind(terms) -> str:
    """The reward the probe, the train log and evaluate score for these terms: the first listed loss's that
    declares one (stages/lib/implicit_reward.py SUMMED_REWARD | MEAN_REWARD); SUMMED_REWARD (DPO's) when none does."""
    declared = [LOSSES[n].implicit_reward for n, _ in terms if LOSSES[n].implicit_reward is not None]
    return declared[0] if declared else SUMMED_REWARD


def loss_hints(dpo: dict) -> list[str]:
    """Lines for the log where a setting is far (over 4x) from what a loss's paper uses (typical_beta)."""
    hints, beta = [], float(dpo["beta"])
    for name, _ in loss_terms(dpo["loss"], dpo.get("loss_weights")):
        typical = LOSSES[name].typical_beta
        if typical is not None and not typical[0] / 4 <= beta <= typical[1] * 4:
            hints.append(f"hint: dpo.beta = {beta:g} is far from what dpo.loss {name} is usually trained with "
                         f"(beta {typical[0]:g}-{typical[1]:g}: {typical[2]}); its loss may barely move")
    return hints


def dpo_pair_losses(pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor, *, beta: float,
                    loss_type="sigmoid", label_smoothing: float = 0.0, loss_weights=None,
                    chosen_tokens: torch.Tensor | None = None, rejected_tokens: torch.Tensor | None = None,
                    valid: torch.Tensor | None = None, **knobs) -> torch.Tensor:
    """Per-pair DPO-family losses from summed completion log-probs (policy pc/pr, reference rc/rr; 0 when
    reference-free): sum_k loss_weights[k] * loss_k, as TRL's loss_type list + loss_weights.

    chosen_tokens / rejected_tokens: each branch's completion token count (the tokens summed into pc / pr), needed
    by the losses declared `lengths=True`. valid: which pairs are real (pair_weight > 0); aot / aot_unpaired sort
    over the real pairs only. knobs: the declared extra numbers by key (discopop_tau=..., simpo_gamma=...; absent:
    their defaults). Each loss's relation to TRL 1.16 is its declaration above (docs/DPO_LOSSES.md's table).
    """
    terms = check_dpo_loss(loss_type, label_smoothing, loss_weights=loss_weights, **knobs)
    for name, _ in terms:
        if LOSSES[name].lengths and (chosen_tokens is None or rejected_tokens is None):
            raise DPOLossError(f"dpo.loss {name} needs the completion token counts of both branches")
    n_c = n_r = None
    if chosen_tokens is not None and rejected_tokens is not None:
        # clamped to >= 1 as TRL, so the empty padding sequences of a packed batch stay finite
        n_c, n_r = chosen_tokens.clamp(min=1).to(pc.dtype), rejected_tokens.clamp(min=1).to(pc.dtype)
    x = LossInputs(pc, pr, rc, rr, beta=beta, eps=label_smoothing, knobs=knob_values(knobs), valid=valid,
                   n_c=n_c, n_r=n_r)
    if len(terms) == 1 and terms[0][1] == 1.0:       # one loss, unweighted: exactly that loss's arithmetic
        return LOSSES[terms[0][0]].formula(x)
    total = None
    for name, weight in terms:
        part = LOSSES[name].formula(x) * weight
        total = part if total is None else total + part
    return total
