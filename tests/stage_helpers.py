"""What the tests of the stage CLIs share: running the train stages (train_dpo / train_rm) on the tiny assets
of conftest.py's `assets` fixture (their params, arguments, a real torchrun, comparing two runs, checkpoints) and
running evaluate over synthetic_probe.py's inputs."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from engine_helpers import REPO_ROOT
from stages import evaluate
from stages.engine.checkpoint import list_checkpoints

# ----------------------------------------------------------------------------------------------
# The train stages
# ----------------------------------------------------------------------------------------------

def write_train_params(path: Path, train: dict | None = None, dpo: dict | None = None, rm: dict | None = None) -> Path:
    """params.yaml for a tiny CPU training run on the `assets` (2 epochs of 16-pair steps), with overrides."""
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["train"].update({"gpus": 0, "epochs": 2, "global_batch_pairs": 16, "micro_batch_tokens": 160,
                            "inference_micro_batch_tokens": 160,
                            "lr": 3e-3, "warmup_ratio": 0.1, "logp_chunk_tokens": 32, "seed": 5, **(train or {})})
    params["dpo"].pop("loss_weights", None)
    params["dpo"].update({"loss": "sigmoid", **(dpo or {})})     # the loss these runs were written for
    params["rm"].update(rm or {})
    path.write_text(yaml.safe_dump(params))
    return path


def stage_args(a: Path, out_flag: str, out: Path, params: Path) -> list[str]:
    return ["--params", str(params), "--model-dir", str(a / "model"), "--train-tokens", str(a / "train.parquet"),
            "--probe-tokens", str(a / "probe.parquet"), out_flag, str(out), "--log", str(out) + ".log",
            "--perf", str(out) + ".perf.json"]


def torchrun(nproc: int, module: str, args: list[str], timeout: int = 240) -> None:
    # --standalone: a private rendezvous on a free port. `--` keeps torchrun's own parser away from
    # our flags (`--log` is an ambiguous prefix of its --log-dir).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", module, "--", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)      # the launcher and its workers, nothing else
        _, err = proc.communicate()
        pytest.fail(f"torchrun {module} timed out after {timeout}s:\n{err[-4000:]}")
    assert proc.returncode == 0, err[-4000:]


def assert_same_training(a: Path, b: Path, atol: float = 1e-6) -> None:
    la, lb = pd.read_csv(a / "train_log.csv"), pd.read_csv(b / "train_log.csv")
    assert len(la) == len(lb) > 1
    np.testing.assert_allclose(la.loss, lb.loss, rtol=0, atol=atol)
    from safetensors.torch import load_file
    wa, wb = load_file(a / "model/model.safetensors"), load_file(b / "model/model.safetensors")
    assert sorted(wa) == sorted(wb)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=atol, msg=k)


# The train log's columns that a resumed run reproduces bitwise (not the timing column).
LOG_COLUMNS = ["step", "epoch", "loss", "accuracy", "ties", "margin", "lr", "grad_norm", "pairs", "tokens"]


def ckpt_args(a: Path, out: str, params: Path, ckpt: Path | str | None = None, resume: str | None = None,
              extra: list[str] | None = None) -> list[str]:
    args = stage_args(a, "--out-dir", a / out, params) + (extra or [])
    if ckpt is not None:
        args += ["--checkpoint-dir", str(ckpt)]
    if resume is not None:
        args += ["--resume", str(resume)]
    return args


def checkpoint_at(directory: Path, step: int) -> Path:
    found = [p for s, p, _ in list_checkpoints(directory)[0] if s == step]
    assert len(found) == 1, (step, sorted(os.listdir(directory)))
    return found[0]


def assert_identical_runs(a: Path, b: Path, *, same_record: bool = False) -> None:
    """Bitwise: weights, every per-step log value (not the timing column), both probe files; with same_record
    (one run's settings, e.g. resumed against uninterrupted) run_info.json too: a resumed run's record is the
    uninterrupted run's bytes (its resume history is in the perf log), so dvc.lock records the same hash."""
    la, lb = pd.read_csv(a / "train_log.csv"), pd.read_csv(b / "train_log.csv")
    assert list(la.columns) == list(lb.columns)
    assert la.step.tolist() == lb.step.tolist() == list(range(1, len(la) + 1))     # no duplicates, no gaps
    pd.testing.assert_frame_equal(la[[c for c in LOG_COLUMNS if c in la]], lb[[c for c in LOG_COLUMNS if c in lb]],
                                  check_exact=True)
    for f in ("model/model.safetensors", "probe_step0.jsonl", "probe_final.jsonl") + (("run_info.json",) * same_record):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


# ----------------------------------------------------------------------------------------------
# evaluate
# ----------------------------------------------------------------------------------------------

def evaluate_params(**evaluate) -> dict:
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["evaluate"].update(evaluate)
    return params


def run_evaluate_cli(root: Path, params: dict, out: str, extra_dpo_final: str | None = None) -> dict[str, Path]:
    params_path = root / f"params_{out}.yaml"
    params_path.write_text(yaml.safe_dump(params))
    outs = {"metrics_dpo": root / out / "metrics/dpo.json", "metrics_rm": root / out / "metrics/rm.json",
            "bootstrap": root / out / "bootstrap_summary.json"}
    r = root / "results"
    argv = ["--params", str(params_path), "--probe-manifest", str(r / "probe/probe_manifest.json"),
            "--probe-token-manifest", str(r / "tokens/probe_token_manifest.json"),
            "--probe-tokens", str(r / "tokens/probe_tokens.parquet"),
            "--dpo-step0", str(r / "train_dpo/probe_step0.jsonl"),
            "--dpo-final", extra_dpo_final or str(r / "train_dpo/probe_final.jsonl"),
            "--rm-step0", str(r / "train_rm/probe_step0.jsonl"), "--rm-final", str(r / "train_rm/probe_final.jsonl"),
            "--metrics-dpo", str(outs["metrics_dpo"]), "--metrics-rm", str(outs["metrics_rm"]),
            "--bootstrap", str(outs["bootstrap"]), "--log", str(root / out / "evaluate.log")]
    assert evaluate.main(argv) == 0
    return outs
