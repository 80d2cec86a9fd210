"""Where an engine stage's start-up time goes: seconds from process start to the first optimizer step, by phase.

The stage and the loop call `mark(phase)` when a phase ends; the phase's time is the wall time since the
previous mark. The first phase, `imports`, runs from the process's own start (the kernel's record of it in
/proc, so the interpreter's start and every import before the stage's code runs count too) to the first mark.
Under torchrun that is the worker process's start: torchrun's own start-up comes before it and is not counted.

The record goes to the stage's perf JSON (`--perf`, logs/<stage>.perf.json), never to run_info.json: timings
vary run to run, and run_info.json is a hashed artifact that must stay byte-deterministic.
"""
from __future__ import annotations

import os
import time


def process_age_seconds() -> float | None:
    """Seconds since this process started, from /proc (Linux); None where that is not available."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (starttime, clock ticks after boot); the fields after the ")" of the command name start at 3.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """Phase durations in the order they ended. A phase marked twice adds up (e.g. one per split)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.last: float | None = None      # perf_counter() at the previous mark; None before the first
        self.phases: dict[str, float] = {}
        self.process_start_known = True

    def mark(self, phase: str) -> float:
        """End `phase` now; returns its seconds. The first mark's phase starts at the process's start."""
        now = time.perf_counter()
        if self.last is None:
            age = process_age_seconds()
            self.process_start_known = age is not None
            seconds = age or 0.0
        else:
            seconds = now - self.last
        self.last = now
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        return seconds

    def record(self) -> dict:
        """The perf record: each phase, and their sum (process start to the last mark)."""
        return {"phases_seconds": {k: round(v, 3) for k, v in self.phases.items()},
                "order": list(self.phases),    # the JSON writer sorts keys: the phases' order, kept here
                "total_seconds": round(sum(self.phases.values()), 3),
                "from": "process start" if self.process_start_known else "first mark (process start unknown)"}


# One per process: the stage's CLI and the training loop mark the same clock.
CLOCK = StartupClock()


def mark(phase: str) -> float:
    return CLOCK.mark(phase)
