"""What a run's plan must hold, checked before any weight is loaded (issue 29: a 6-pair run made one optimizer
step, at learning rate 0, and succeeded).

The plan is known from the counts alone: the optimizer steps from the train pair count, train.epochs and
train.global_batch_pairs (packing.planned_steps, the length of plan_training's plan), each step's learning rate
from train.lr, warmup_ratio and schedule (optim.LRSchedule). No step at a learning rate above 0 is refused,
naming the counts; too few steps, or every step inside the warmup, is a warning (stages/lib/training_plan.py).
"""
from __future__ import annotations

from stages.engine.optim import LRSchedule
from stages.engine.packing import planned_steps
from stages.engine.settings import TrainConfigError, TrainSettings
from stages.lib.training_plan import plan_warnings


def check_plan(n_pairs: int, settings: TrainSettings, world_size: int) -> list[str]:
    """Refuse a plan in which no optimizer step would train; return the warnings for the log."""
    steps = planned_steps(n_pairs, settings.epochs, settings.global_batch_pairs, settings.max_steps)
    counts = (f"{n_pairs} train pair{'s' if n_pairs != 1 else ''} x train.epochs {settings.epochs:g} in batches of "
              f"train.global_batch_pairs {settings.global_batch_pairs} on world size {world_size}"
              + (f", capped at train.max_steps {settings.max_steps}" if settings.max_steps is not None else ""))
    if steps == 0:
        raise TrainConfigError(f"no optimizer step would run: {counts} make 0 steps (tokenize kept no train pairs?)")
    schedule = LRSchedule(settings, steps)
    # A warmup starts at learning rate 0 (HF's schedules); after it every schedule's factor is > 0 (the decay's
    # progress stays below 1), so only warmup steps can be at 0.
    at_zero = sum(1 for k in range(min(steps, schedule.warmup + 1)) if schedule.lr(k) == 0)
    if at_zero == steps:
        raise TrainConfigError(
            f"no optimizer step would train: {counts} make {steps} optimizer step{'s' if steps != 1 else ''}, and "
            f"train.warmup_ratio {settings.warmup_ratio:g} puts {'it' if steps == 1 else 'each'} at learning rate "
            "0 (the warmup starts at 0); use more pairs, a smaller train.global_batch_pairs, more train.epochs or "
            "train.warmup_ratio 0")
    return plan_warnings(steps, schedule.warmup >= steps, settings.warmup_ratio, f" ({counts})")
