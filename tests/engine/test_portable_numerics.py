"""The portable CPU record holds across processor vendors: the real train stages, run natively and under an
emulated AMD EPYC (qemu-user's `-cpu EPYC-Rome`: another CPUID vendor and feature set, so MKL, oneDNN, glibc and
ATen pick their code paths as on an AMD machine), write the same bytes.

This is how the committed record broke once: torch's unfused CPU AdamW took `exp_avg_sq.sqrt()` through MKL's
vector math, whose float sqrt differed between an AMD EPYC and an Intel Xeon under the pin, so the same commit
trained different weights on the two (stages/engine/optim.py). The optimizer-state tensors here are large enough
(over 8k elements) for that path to be taken.

qemu-user comes from Debian's `qemu-user` (.ci/run installs it); without it the test skips, saying so.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from engine_helpers import REPO_ROOT, make_tiny_model_dir, toy_task_rows, write_token_parquet

QEMU = shutil.which("qemu-x86_64")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(platform.machine() != "x86_64", reason="emulates an x86-64 CPU"),
    pytest.mark.skipif(QEMU is None, reason="qemu-x86_64 not installed (Debian: apt-get install qemu-user)"),
]


def _params(path: Path, **train) -> Path:
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["train"].update(epochs=1, global_batch_pairs=16, warmup_ratio=0.0, **train)
    params["dpo"].update(objective="dpo_ref_free", loss="sigmoid")   # the loss these runs were written for
    params["dpo"].pop("loss_weights", None)
    path.write_text(yaml.safe_dump(params))
    return path


def _run_stage(module: str, args: list[str], prefix: list[str], out: Path) -> None:
    """One engine stage as torchrun would start its only process (torchrun's own child would not run under
    qemu-user: it starts a native interpreter)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *sys.path[1:]]), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29000 + os.getpid() % 1000 + len(prefix)),
           "TORCHELASTIC_RUN_ID": "portable", "OMP_NUM_THREADS": "1"}
    python = os.path.realpath(sys.executable)   # under qemu, the interpreter itself, with the venv on PYTHONPATH
    proc = subprocess.run([*prefix, python, "-m", module, *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _digests(out: Path) -> dict[str, str]:
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and p.suffix in (".jsonl", ".csv", ".safetensors")}


# train_dpo with the default AdamW (the path that broke), train_rm with the 8-bit state (its own square root). A
# third case, train_rm with the default AdamW, repeated the first one's optimizer and model math for two more minutes
# of emulation (the objectives differ only in a linear head and the loss).
@pytest.mark.parametrize("stage,optimizer", [("train_dpo", None), ("train_rm", {"state": "fp32_master_8bit"})])
def test_train_stage_bytes_do_not_depend_on_the_cpu_vendor(tmp_path, stage, optimizer):
    """Also the 8-bit optimizer state's torch-ops path (stages/engine/lowbit_adamw.py: its one square root in
    double precision, never float32 torch.sqrt)."""
    make_tiny_model_dir(tmp_path / "model", hidden=64, vocab=256)       # AdamW state tensors of 8k-16k elements
    write_token_parquet(tmp_path / "train.parquet", toy_task_rows(48, seed=1))
    write_token_parquet(tmp_path / "probe.parquet", toy_task_rows(8, seed=2, prefix="q"))
    params = _params(tmp_path / "params.yaml", **({"optimizer": optimizer} if optimizer else {}))
    results = {}
    for name, prefix in (("native", []), ("amd_epyc", [QEMU, "-cpu", "EPYC-Rome"])):
        out = tmp_path / name
        _run_stage(f"stages.{stage}", ["--params", str(params), "--model-dir", str(tmp_path / "model"),
                                       "--train-tokens", str(tmp_path / "train.parquet"),
                                       "--probe-tokens", str(tmp_path / "probe.parquet"), "--out-dir", str(out),
                                       "--log", str(out / "stage.log"), "--perf", str(tmp_path / f"{name}.perf")],
                   prefix, out)
        results[name] = _digests(out)
    assert "model/model.safetensors" in results["native"] and "probe_final.jsonl" in results["native"]
    differing = sorted(k for k in results["native"] if results["native"][k] != results["amd_epyc"].get(k))
    assert not differing, f"{stage} wrote different bytes under an emulated AMD EPYC: {differing}"
