"""The dev split scored during training (issue 37; probe.dev_size > 0): dev_log.csv, and the best step's weights.

The dev split is frozen beside the probe and disjoint from it and from train by prompt (stages/freeze_probe.py), so
choosing a checkpoint on it leaves the probe untouched evidence. It is scored with the probe's inference pass
(stages/engine/data.py run_inference, the objective's probe rows with the dev split's precomputed values) at step 0,
every train.eval_every optimizer steps and after the last; each scoring is one dev_log.csv row:

    step, accuracy (ties count 0.5), margin (mean implicit-reward / score margin), sigmoid_loss (mean
    -log sigmoid(margin): the Bradley-Terry loss of the scored margin, DPO's sigmoid loss on its implicit rewards,
    whatever dpo.loss trains), pairs

train.select_best: the scored step >= 1 with the highest dev accuracy (ties: the earliest) is kept (every rank holds
its own copy of the weights, replicas being identical under ddp; rank 0 decides and tells the others), exported
instead of the last step's and scored on the probe as the final model; run_info.json records it (`dev`).
Checkpoints carry the rows, the best step and its weights (best_model.pt), so a resumed run's dev log and selection
are an uninterrupted run's.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from stages.engine.data import run_inference
from stages.engine.export import host_state_dict

log = logging.getLogger("trainer")

DEV_LOG_COLUMNS = ("step", "accuracy", "margin", "sigmoid_loss", "pairs")
BEST_STATE_FILE = "best_model.pt"


def dev_row(step: int, rows: list[dict]) -> dict:
    """One dev_log.csv row from the objective's probe rows of the dev split."""
    margins = np.array([r["margin"] for r in rows], dtype=np.float64)
    correct = np.array([r["correct"] for r in rows], dtype=np.float64)
    return {"step": step, "accuracy": float(correct.mean()), "margin": float(margins.mean()),
            "sigmoid_loss": float(np.mean(np.logaddexp(0.0, -margins))), "pairs": len(rows)}


def is_due(step: int, total: int, eval_every: int) -> bool:
    return step == 0 or step == total or (eval_every > 0 and step % eval_every == 0)


class DevEval:
    """The dev scorings of one run: rows (rank 0), the best step (rank 0's choice, known on every rank) and its
    weights (each rank's own copy)."""

    def __init__(self, run):
        self.run = run
        self.rows: list[dict] = []
        self.best: dict | None = None            # {"step", "accuracy"} of the selected step (select_best)
        self.best_state: dict | None = None      # its weights, as export takes them (host_state_dict)

    def _snapshot(self) -> dict:
        run = self.run
        with torch.no_grad():
            return host_state_dict(run.hf, run.optimizer, trained_only=run.adapter is not None)

    def score(self, step: int) -> None:
        """Score the dev split now (collective: every rank calls it at the same step)."""
        run = self.run
        env = run.env
        outputs = run_inference(run.model, run.dev_pairs, env, run.settings, desc=f"dev step {step}")
        new_best = None
        if env.is_main:
            row = dev_row(step, run.objective.probe_rows(run.dev_pairs, outputs, split="dev"))
            self.rows.append(row)
            if run.live is not None:
                run.live.dev_rows([row])
            log.info("dev step %d: accuracy %.4f margin %.4g sigmoid_loss %.5f over %d pairs", step, row["accuracy"],
                     row["margin"], row["sigmoid_loss"], row["pairs"])
            if (run.settings.select_best and step >= 1
                    and (self.best is None or row["accuracy"] > self.best["accuracy"])):
                new_best = {"step": step, "accuracy": row["accuracy"]}
        if env.world_size > 1 and run.settings.select_best:
            box = [new_best]
            dist.broadcast_object_list(box, src=0, group=env.control_group)
            new_best = box[0]
        if new_best is not None:
            self.best, self.best_state = new_best, self._snapshot()

    # -- checkpoints -------------------------------------------------------------------------------------------
    def trainer_state(self) -> dict:
        """The keys a checkpoint's trainer_state.json gains (rank 0's rows; the best step)."""
        return {"dev_rows": self.rows, "dev_best": self.best}

    def restore(self, trainer_state: dict, checkpoint: Path) -> None:
        self.rows = list(trainer_state.get("dev_rows") or [])
        self.best = trainer_state.get("dev_best")
        if self.best is not None:
            self.best_state = torch.load(Path(checkpoint) / BEST_STATE_FILE, map_location="cpu", weights_only=True)

    # -- the end -----------------------------------------------------------------------------------------------
    def select(self) -> None:
        """select_best: the selected step's weights into the model (every rank), before the final probe."""
        if self.best_state is None:
            return
        missing, _ = self.run.hf.load_state_dict(self.best_state, strict=False)
        if self.run.adapter is None and missing:
            raise RuntimeError(f"select_best: the kept weights lack {missing[:4]}")
        if self.run.env.is_main:
            log.info("select_best: exporting step %d (dev accuracy %.4f) instead of step %d", self.best["step"],
                     self.best["accuracy"], self.run.state.step)

    def record(self) -> dict:
        """run_info.json's `dev` (the selected step null without train.select_best)."""
        s = self.run.settings
        best = self.best if s.select_best else None
        return {"pairs": len(self.run.dev_pairs), "eval_every": s.eval_every,
                "scored_steps": [r["step"] for r in self.rows],
                "selected_step": best["step"] if best else None,
                "selected_accuracy": best["accuracy"] if best else None}
