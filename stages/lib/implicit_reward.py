"""The DPO implicit rewards a loss may declare (stages/engine/dpo_losses.py `implicit_reward`): one contract
between train_dpo, which writes them into the train log and the probe rows, and evaluate / `report verify`
(stages/evidence/scoring.py), which recompute them from the rows, so accuracy and margins mean what the loss optimizes.

SUMMED_REWARD: beta * (policy - reference) log-prob summed over the completion (DPO's reward); its probe rows carry
no `implicit_reward` field, as before other rewards existed. MEAN_REWARD: the same divided by the completion's token
count, for the length-normalized losses (SimPO's reward; TRL's CPO / ORPO trainers log rewards on average
log-probs); its rows carry `implicit_reward` and each branch's token count, and the metrics record it.
"""
from __future__ import annotations

SUMMED_REWARD, MEAN_REWARD = "summed_logp", "mean_logp"
IMPLICIT_REWARDS = (SUMMED_REWARD, MEAN_REWARD)


def implicit_reward(kind: str, beta: float, logp, ref_logp, tokens=None):
    """One completion's implicit reward (floats or tensors alike): beta * (logp - ref_logp), divided by its
    completion token count for MEAN_REWARD (reference-free: ref_logp = 0)."""
    if kind == SUMMED_REWARD:
        return beta * (logp - ref_logp)
    if kind == MEAN_REWARD:
        return beta * ((logp - ref_logp) / tokens)
    raise ValueError(f"unknown implicit reward {kind!r} ({' | '.join(IMPLICIT_REWARDS)})")
