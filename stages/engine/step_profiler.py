"""Opt-in torch.profiler view of the real training loop: where a step's time goes.

    PREFPIPE_PROFILE=DIR torchrun ... -m stages.train_dpo ...      # or train_rm; rank 0 writes DIR

A diagnostic, not a parameter: it changes no result (only timing: the profiled steps synchronize), so
it is an environment variable and not part of params.yaml / the stage hashes. Three windows:
  first_step.txt    the run's first optimizer step (CUDA-graph path: the eager step that allocates the
                    gradients and optimizer state), ops by host (CPU) time: the one-off costs;
  second_step.txt   the second (CUDA-graph path: the step that captures its shapes' graphs), by host time;
  steady.txt        PREFPIPE_PROFILE_STEPS (default 6) later steps from PREFPIPE_PROFILE_START (default
                    10), ops and kernels by GPU time (kernels replayed from CUDA graphs included);
  summary.json      per window: host seconds, GPU kernel ms per step, kernels per step.
PREFPIPE_PROFILE_PY=1 adds <window>_py.txt for the first two windows: Python's cProfile (host time by
Python function, cumulative and own), which shows what torch.profiler's op table cannot (Triton's compile
and launch path, autograd's Python, the allocator's first-use time inside an op). A value these variables
cannot mean (PREFPIPE_PROFILE_PY other than 0 or 1, a START or STEPS that is not an integer) is refused, naming it.
"""
from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import time
from pathlib import Path

import torch

from stages.engine.settings import TrainConfigError

PROFILE_ENV = "PREFPIPE_PROFILE"


def kernel_summary(events, steps: int) -> dict:
    """GPU kernel time and count per step from a profiler's key_averages()."""
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    return {"gpu_kernel_ms_per_step": round(sum(e.self_device_time_total for e in kernels) / 1e3 / steps, 3),
            "kernels_per_step": round(sum(e.count for e in kernels) / steps, 1)}


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw.strip() else default
    except ValueError:
        raise TrainConfigError(f"{name}={raw!r}: not an integer") from None


def _env_flag(name: str) -> bool:
    """"1" on, "0" or unset off; anything else is refused: a typo must not silently turn the profile off."""
    raw = os.environ.get(name, "").strip()
    if raw not in ("", "0", "1"):
        raise TrainConfigError(f"{name}={raw!r}: expected 1 (on) or 0 (off)")
    return raw == "1"


class StepProfiler:
    """Wraps optimizer steps 0, 1 and [start, start + steps) of the loop in torch.profiler (rank 0)."""

    def __init__(self, out_dir: Path, device: torch.device, start: int = 10, steps: int = 6, python: bool = False):
        # start >= 2 and steps >= 1: request() refused anything else, before the model was loaded
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.device = device
        self.windows = {0: ("first_step", 1), 1: ("second_step", 1), start: ("steady", steps)}
        self.python = python
        self.active: tuple[str, int, int, float, object, cProfile.Profile | None] | None = None
        self.summary: dict = {}

    @staticmethod
    def request() -> tuple[Path, int, int, bool] | None:
        """(folder, steady start, steady steps, Python profile) that PREFPIPE_PROFILE and its companions ask for,
        None without PREFPIPE_PROFILE; a typo in any of them is refused (TrainConfigError naming it: one line, exit
        1). The loop calls this before the model is loaded, on every rank, so a typo costs seconds, not a load and a
        step-0 probe."""
        out = os.environ.get(PROFILE_ENV)
        if not out:
            return None
        start, steps = _env_int("PREFPIPE_PROFILE_START", 10), _env_int("PREFPIPE_PROFILE_STEPS", 6)
        python = _env_flag("PREFPIPE_PROFILE_PY")
        if start < 2 or steps < 1:
            raise TrainConfigError(f"PREFPIPE_PROFILE_START={start}, PREFPIPE_PROFILE_STEPS={steps}: the steady "
                                   "window must start after the second step (at step >= 2) and hold >= 1 step")
        return Path(out), start, steps, python

    @classmethod
    def from_env(cls, device: torch.device, is_main: bool, first_step: int) -> "StepProfiler | None":
        asked = cls.request()
        if asked is None or not is_main:
            return None
        out, start, steps, python = asked
        prof = cls(out, device, start + first_step, steps, python)
        if first_step:                      # a resumed run's first steps are not the run's first-use steps
            prof.windows.pop(0, None)
            prof.windows.pop(1, None)
        return prof

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before_step(self, step: int) -> None:
        if self.active is None and step in self.windows:
            from torch.profiler import ProfilerActivity, profile
            name, n = self.windows[step]
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._sync()
            prof = profile(activities=activities)
            prof.__enter__()
            py = cProfile.Profile() if self.python and name != "steady" else None
            if py is not None:
                py.enable()
            self.active = (name, step, n, time.perf_counter(), prof, py)

    def after_step(self, step: int) -> None:
        """`step`: the index of the step just done (0-based)."""
        if self.active is not None and step + 1 >= self.active[1] + self.active[2]:
            self._close(step + 1 - self.active[1])

    def finish(self, steps_done: int) -> None:
        """After the loop: a window the run ended inside is written with the steps it holds."""
        if self.active is not None:
            self._close(steps_done - self.active[1])

    def _close(self, n: int) -> None:
        name, start, _, t0, prof, py = self.active
        self._sync()
        host_s = time.perf_counter() - t0
        if py is not None:
            py.disable()
            text = io.StringIO()
            for key in ("cumulative", "tottime"):
                pstats.Stats(py, stream=text).sort_stats(key).print_stats(50)
            (self.out_dir / f"{name}_py.txt").write_text(text.getvalue())
        prof.__exit__(None, None, None)
        self.active = None
        events = prof.key_averages()
        sort = "self_cpu_time_total" if name != "steady" else (
            "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total")
        (self.out_dir / f"{name}.txt").write_text(
            f"# optimizer steps {start}..{start + n - 1}, {host_s:.3f} s host (synchronized), sorted by {sort}\n"
            + events.table(sort_by=sort, row_limit=60, max_name_column_width=90) + "\n")
        self.summary[name] = {"first_step": start, "steps": n, "seconds": round(host_s, 4),
                              "ms_per_step": round(host_s / n * 1e3, 3), **kernel_summary(events, n)}
        (self.out_dir / "summary.json").write_text(json.dumps(self.summary, indent=2) + "\n")
