"""A training run's experiment loggers (issue 37 item 4): DVCLive into the stage's outputs, TensorBoard if asked.

DVCLive (--live-dir, the rule's results/<stage>/dvclive; rank 0 writes):
    metrics.json                   the latest step, loss, accuracy and margin (SFT: loss, completion_logp) and, with
                                   a dev split, dev/{accuracy, margin, sigmoid_loss}: top-level `metrics` in dvc.yaml,
                                   so `dvc exp show` (and the VS Code extension) show them while `dvc exp run` trains
    plots/metrics/<name>.tsv       one row per optimizer step (step, value): the objective's metrics, lr, grad_norm;
                                   plots/metrics/dev/<name>.tsv one row per dev scoring: the top-level `plots`

Written as the train log's windows reach the host (stages/engine/loop.py TrainLog.flush, about 20 a run) and at each
dev scoring. No timestamps, host or wall-clock values (dvclive's log_metric writes a timestamp column only when
asked), keys sorted: the same run writes the same bytes, so the folder is an ordinary hashed output of the stage.
A resumed run starts the folder afresh from the checkpoint's rows (Live(resume=False) clears it, the rows are
replayed): an interrupted run's folder is an uninterrupted one's.

Files only: no DVC repository is opened (dvclive would `dvc init` a plain git checkout it ran in, and name a random
experiment), nothing is sent to DVC Studio whatever its token or config says, no report, no dvc.yaml, no experiment
saved (`dvc exp run` saves the experiment itself), no system monitor. The one file outside the folder is dvclive's
step signal for the VS Code extension (.dvc/tmp/exps/run/DVCLIVE_STEP_COMPLETED), only under `dvc repro`/`dvc exp
run` (DVC_ROOT set), removed at the end.

TensorBoard (train.tensorboard: true; --tensorboard-dir, default logs/tensorboard/<out dir under results/>): the
same scalars as train/<name> and dev/<name>, through torch.utils.tensorboard; untracked (event files carry wall
times and the host name). The folder is emptied when a run starts, so it holds this run's curve once.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from stages.engine.settings import TrainConfigError

# metrics.json's keys (those of the objective's metrics it has): the few `dvc exp show` columns that say how training
# goes. Every metric, lr and grad_norm are plotted (plots/metrics/*.tsv) and in train_log.csv.
SUMMARY_METRICS = ("loss", "accuracy", "margin", "completion_logp")
DEV_METRICS = ("accuracy", "margin", "sigmoid_loss")


def tensorboard_writer_class():
    """torch.utils.tensorboard's SummaryWriter, or a TrainConfigError naming the setting (checked on every rank before
    any weight is read)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise TrainConfigError(f"train.tensorboard is true but TensorBoard cannot be imported ({e}): "
                               "`pip install tensorboard`, or set train.tensorboard: false (DVCLive's curves, "
                               "results/<stage>/dvclive, are written either way)") from None
    return SummaryWriter


def default_tensorboard_dir(out_dir: str | os.PathLike) -> Path:
    """logs/tensorboard/<out_dir without its leading results/> (results/train_dpo -> logs/tensorboard/train_dpo)."""
    parts = Path(out_dir).parts
    rest = parts[1:] if parts and parts[0] == "results" and len(parts) > 1 else (Path(out_dir).name,)
    return Path("logs", "tensorboard", *rest)


def _file_only_live(directory: Path):
    from dvclive import Live
    from dvclive.serialize import dump_json

    class FileOnlyLive(Live):
        def _init_dvc(self):                   # no Repo(): no `dvc init`, no git calls, no random experiment name
            pass

        def _init_studio(self):                # never any network, whatever DVC_STUDIO_TOKEN or `studio` config say
            self._dvc_studio_config = {}
            self._studio_events_to_skip.update({"start", "data", "done"})

        def post_data_to_studio(self):
            pass

        def make_summary(self):
            if self._step is not None:
                self.summary["step"] = self.step
            dump_json(self.summary, self.metrics_file, sort_keys=True)

    return FileOnlyLive(dir=str(directory), resume=False, report=None, save_dvc_exp=False, dvcyaml=None,
                        monitor_system=False)


class LiveLog:
    """Rank 0's loggers of one run (a no-op elsewhere, or without --live-dir and train.tensorboard)."""

    def __init__(self, live_dir: Path | None, tensorboard_dir: Path | None, metric_names: tuple[str, ...],
                 is_main: bool):
        self.names = tuple(metric_names)
        self.live = _file_only_live(Path(live_dir)) if is_main and live_dir is not None else None
        self.tb = None
        if is_main and tensorboard_dir is not None:
            writer = tensorboard_writer_class()
            shutil.rmtree(tensorboard_dir, ignore_errors=True)
            self.tb = writer(log_dir=str(tensorboard_dir))
        self._signal = self.live is not None and bool(os.environ.get("DVC_ROOT"))

    @property
    def active(self) -> bool:
        return self.live is not None or self.tb is not None

    def _step_done(self, step: int) -> None:
        self.live.make_summary()
        if self._signal:                       # the VS Code extension's "a step is done" file (dvc exp runs only)
            from dvclive.vscode import mark_dvclive_step_completed
            mark_dvclive_step_completed(step)

    def train_rows(self, rows: list[dict]) -> None:
        """train_log.csv rows, in step order (a flushed window, or a resumed run's saved rows)."""
        if not rows or not self.active:
            return
        for row in rows:
            values = {**{n: row[n] for n in self.names}, "lr": row["lr"], "grad_norm": row["grad_norm"]}
            if self.live is not None:
                self.live.step = row["step"]
                for name, value in values.items():
                    self.live.log_metric(name, float(value))
                for name in [n for n in values if n not in SUMMARY_METRICS]:
                    self.live.summary.pop(name, None)      # plotted, not a `dvc exp show` column
            if self.tb is not None:
                for name, value in values.items():
                    self.tb.add_scalar(f"train/{name}", float(value), row["step"])
        if self.live is not None:
            self._step_done(rows[-1]["step"])

    def dev_rows(self, rows: list[dict]) -> None:
        """dev_log.csv rows (stages/engine/dev_eval.py), in step order."""
        if not rows or not self.active:
            return
        for row in rows:
            if self.live is not None:
                self.live.step = row["step"]
                for name in DEV_METRICS:
                    self.live.log_metric(f"dev/{name}", float(row[name]))
            if self.tb is not None:
                for name in DEV_METRICS:
                    self.tb.add_scalar(f"dev/{name}", float(row[name]), row["step"])
        if self.live is not None:
            self._step_done(rows[-1]["step"])

    def close(self, last_step: int) -> None:
        """The final metrics.json (step = the run's last step), whichever row came last."""
        if self.live is not None:
            self.live.step = last_step
            self.live.make_summary()
            if self._signal:
                from dvclive.vscode import cleanup_dvclive_step_completed
                cleanup_dvclive_step_completed()
        if self.tb is not None:
            self.tb.close()
