"""environment: record the environment that decides the pipeline's numbers, as an input of every stage.

    python -m stages.environment --params params.yaml --lock requirements/lock.txt \\
        --out results/env/environment.json --log logs/environment.log

Writes the record of stages/lib/environment.py (python, the locked packages' installed versions, the
CPU dispatch and BLAS in force under `train.portable_numerics`, CUDA/cuDNN/GPU for GPU runs), plus
`lock`: whether every package pinned in the lock file is installed at its pinned version, and which
are not. Every stage takes the record as an input, so Snakemake and DVC rerun what it feeds when it
changes, and the numeric stages check at start that their own process still matches it.

A package installed at another version than the lock pins is refused unless
`PREFPIPE_ALLOW_UNLOCKED=1` is set (e.g. a GPU machine whose CUDA torch is not the CPU lock's); the
record then names every difference, so the evidence says exactly what ran.
"""
from __future__ import annotations

import logging
import os
import re
import sys
from importlib import metadata
from pathlib import Path

from stages.lib.cli import stage_main
from stages.lib.environment import environment_record
from stages.lib.io import write_json
from stages.lib.params import ParamsError
from stages.lib.declared_params import load_stage_params

ALLOW_UNLOCKED = "PREFPIPE_ALLOW_UNLOCKED"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)")


def canonical_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock_pins(lock_path: str | os.PathLike) -> dict[str, str]:
    """{canonical name: pinned version} of a pip requirements lock (`name==version \\` lines)."""
    pins = {}
    for line in Path(lock_path).read_text(encoding="utf-8").splitlines():
        m = _PIN.match(line.strip())
        if m:
            pins[canonical_name(m.group(1))] = m.group(2)
    return pins


def lock_differences(pins: dict[str, str]) -> list[dict]:
    """Packages of the lock that are missing or installed at another version, sorted by name."""
    out = []
    for name, want in sorted(pins.items()):
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if have != want:
            out.append({"package": name, "locked": want, "installed": have})
    return out


def build_record(params: dict, lock_path: str | os.PathLike) -> dict:
    record = environment_record(params["train"])
    diffs = lock_differences(read_lock_pins(lock_path))
    record["lock"] = {"file": Path(lock_path).as_posix(), "matches": not diffs, "differences": diffs}
    return record


class LockMismatch(ValueError):
    """Installed packages differ from the lock (and PREFPIPE_ALLOW_UNLOCKED is not set)."""


def _arguments(ap) -> None:
    ap.add_argument("--lock", required=True, help="the pip lock the environment is installed from")
    ap.add_argument("--out", required=True, help="environment.json to write")


def _run(args) -> int:
    log = logging.getLogger("environment")
    record = build_record(load_stage_params(args.params, "environment"), args.lock)
    diffs = record["lock"]["differences"]
    if diffs:
        listed = ", ".join(f"{d['package']} {d['installed'] or 'missing'} (lock: {d['locked']})" for d in diffs)
        if os.environ.get(ALLOW_UNLOCKED) != "1":
            raise LockMismatch(f"{args.lock}: {len(diffs)} installed package(s) differ from the lock: {listed}. "
                               f"Install from the lock (pip install --require-hashes -r {args.lock}), or set "
                               f"{ALLOW_UNLOCKED}=1 to record and run this environment")
        log.warning("%s: running outside the lock (%s=1): %s", args.lock, ALLOW_UNLOCKED, listed)
    write_json(args.out, record)
    cpu = record["cpu_numerics"]
    log.info("python %s, torch %s; CPU numerics: aten %s, %s (CNR %s), portable %s; GPU: %s; lock %s",
             record["python"], record["packages"]["torch"], cpu["aten_capability"], cpu["blas"], cpu.get("mkl_cbwr"),
             cpu["portable"], record["gpu_numerics"], "matches" if not diffs else f"{len(diffs)} difference(s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    return stage_main(argv, "environment", __doc__.split("\n")[0], add_arguments=_arguments, run=_run,
                      input_errors=(LockMismatch, ParamsError))


if __name__ == "__main__":
    sys.exit(main())
