"""The inputs that tie one iterative DPO round's rules to the previous round's (workflow/rules/rounds.smk), called while
the rules are defined. Rule names and paths: stages/lib/stage_plan.py round_rule, stages/lib/layout.py ROUND_OUTPUTS."""
from __future__ import annotations

from stages.lib.stage_plan import round_rule


def round_policy(rules, k: int):
    """The policy round k starts from and samples with: round k-1's export (round 1: train_dpo's)."""
    return rules.train_dpo.output.model if k == 2 else getattr(rules, round_rule("train_dpo", k - 1)).output.model


def later_rounds(rules, part: str, name: str, n: int) -> list:
    """Rounds 2 .. n's output `name` of `part`, in round order."""
    return [getattr(rules, round_rule(part, k)).output[name] for k in range(2, n + 1)]
