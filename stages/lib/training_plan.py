"""What a training run's plan says about whether it can train, in words shared by the trainer's log and the report.

The engine checks the plan before any weight is loaded (stages/engine/guards.py: a run where no step would train
is refused there, naming the counts); what is only doubtful is a warning, written to the stage log and, from the
train log the run wrote, into the report's summary (stages/evidence/bundle.py render_summary), so `report verify`
remakes it from the bundle.
"""
from __future__ import annotations

# Below this many optimizer steps the schedule (warmup, decay) has no room and a probe change is mostly noise: a
# run this short is almost always data smaller than meant, or train.global_batch_pairs larger than the data.
MIN_OPTIMIZER_STEPS = 10


def plan_warnings(steps: int, all_in_warmup: bool, warmup_ratio: float, counts: str = "") -> list[str]:
    """The doubtful plans: too few optimizer steps, every step inside the warmup. counts: what made the steps
    (the trainer's log names the pairs, batch, epochs and world size; the summary has only the train log)."""
    out = []
    if steps < MIN_OPTIMIZER_STEPS:
        out.append(f"only {steps} optimizer step{'s' if steps != 1 else ''}{counts} (fewer than "
                   f"{MIN_OPTIMIZER_STEPS}): too few for the learning-rate schedule to matter or the probe to show "
                   "a change; use more pairs, a smaller train.global_batch_pairs or more train.epochs")
    if all_in_warmup:
        out.append(f"every optimizer step is inside the learning-rate warmup (train.warmup_ratio {warmup_ratio:g} "
                   f"of {steps} step{'s' if steps != 1 else ''}): the run never reaches train.lr")
    return out
