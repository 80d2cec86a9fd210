"""The environment as an input of the numbers: one record, and the pin that makes CPU numerics portable.

Floating-point results depend on more than code, data and params: on the library versions, on which
CPU kernels torch dispatches to (its own vectorized kernels are compiled per instruction set, and
MKL picks a GEMM kernel per processor: different summation orders, different last bits), and on GPUs
on the CUDA/cuDNN versions and the device. Three epochs of training amplify last-bit differences into
visibly different metrics, so a record made on one machine was silently not what another machine
produced. Two remedies, both defined here and nowhere else:

* `environment_record()`: the facts that decide the numbers, written by the `environment` stage to
  results/env/environment.json. The numeric stages take that file as an input (Snakemake and DVC both
  rerun them when it changes) and check at start that their own process still matches it, so a
  changed package version or dispatch is named as a change instead of silently producing new hashes.
  Only facts that change results go in (python major.minor, package versions, the CPU dispatch actually
  in force, CUDA/cuDNN/GPU for GPU runs): the record is identical on every machine that computes
  identical bytes, so it never makes `dvc status` report a change nobody made.
* `pin_portable_cpu_numerics()` (`train.portable_numerics`, default on; CPU runs only): torch's
  baseline kernels (`ATEN_CPU_CAPABILITY=default`, the same x86-64 code on every CPU), MKL's
  Conditional Numerical Reproducibility branch COMPATIBLE (SSE2 code, fixed cache sizes, deterministic
  reductions, documented as giving the same results on all x86 processors) and oneDNN capped at SSE4.1.
  With one intra-op thread (train.cpu_threads), a CPU run gives the same bytes on any x86-64 machine
  with the locked torch build. GPU kernels are not portable: GPU runs record the device instead.

Both are read lazily by torch (at the first dispatched op and the first BLAS call), so the pin works
when applied before the process's first tensor op; `pin_portable_cpu_numerics` verifies that it took
effect and refuses otherwise.

The devices themselves: `gpu_numerics()` names the GPUs a GPU run's record holds (through torch), and
`visible_nvidia_gpus()` counts the NVIDIA GPUs this process can use without importing torch (the driver's
entries, CUDA_VISIBLE_DEVICES), which the Snakefile's pre-flight holds `train.gpus` to (stages/lib/params.py
check_gpus_here). Device selection itself (CUDA or CPU, the process group) is the engine's
(stages/engine/dist.py), which imports torch and which neither lib nor the workflow may import.
"""
from __future__ import annotations

import ctypes
import os
import platform
import re
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

RECORD_FORMAT = "prefpipe-environment/1"

# Every package whose version can change a number of the pipeline (or the tools that record it).
RECORDED_PACKAGES = ("torch", "transformers", "peft", "tokenizers", "numpy", "pandas", "pyarrow", "safetensors",
                     "matplotlib", "snakemake", "dvc")
# Packages that change numbers on GPUs only: Triton compiles the fused CUDA kernels (stages/engine/kernels.py) and
# never runs in a CPU run. Recorded for GPU runs only, so a CPU run's record is the same whether or not the install
# has them: the runtime lock (requirements/lock.txt, README command 1) has no triton, the test lock does.
GPU_PACKAGES = ("triton",)

# The portable CPU pin. ATen's "default" capability is its baseline build of the vectorized kernels;
# MKL_CBWR=COMPATIBLE is MKL's processor-independent CNR branch; oneDNN is capped to the same
# instruction-set level (oneDNN serves bf16/conv paths; capping it keeps any use of it portable too).
PORTABLE_CPU_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41"}

# MKL's CNR branch codes (mkl_service.h: MKL_CBWR_BRANCH = 1; branch values), as returned by mkl_cbwr_get.
_MKL_CBWR_BRANCH = 1
_MKL_BRANCH_NAMES = {1: "OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2",
                     9: "AVX", 10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1", 14: "AVX512_E1",
                     16: "AVX512_E2", 17: "AVX512_E3", 18: "AVX512_E4", 19: "AVX2_E1", 20: "AVX512_E5"}


class EnvironmentMismatch(RuntimeError):
    """The process's environment cannot give the numbers the run asks for (or that its record holds)."""


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _mkl_cbwr_branch() -> str | None:
    """MKL's CNR branch in force in this process (None when torch carries no MKL)."""
    import torch
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        fn = getattr(ctypes.CDLL(str(lib)), "mkl_serv_cbwr_get")
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int]
    code = int(fn(_MKL_CBWR_BRANCH))
    return _MKL_BRANCH_NAMES.get(code, f"code {code}")


def blas_of_torch() -> dict[str, str | None]:
    """The BLAS/LAPACK torch was built with, from its own build configuration."""
    import torch
    show = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=([^,\s]+)", show)
    mkl = re.search(r"Math Kernel Library Version ([^\n]+?) for", show)
    return {"blas": blas.group(1) if blas else None, "mkl_version": mkl.group(1).strip() if mkl else None}


def cpu_numerics() -> dict[str, Any]:
    """What decides CPU floating-point results in this process: the ATen dispatch level torch actually
    uses, the BLAS, and MKL's CNR branch (touching these initialises them, as the first op would)."""
    import torch
    info: dict[str, Any] = {"aten_capability": torch.backends.cpu.get_cpu_capability(), **blas_of_torch()}
    if info["blas"] == "mkl":
        info["mkl_cbwr"] = _mkl_cbwr_branch()
    info["onednn_max_isa"] = os.environ.get("ONEDNN_MAX_CPU_ISA", "native")
    return info


def gpu_numerics() -> dict[str, Any]:
    import torch
    if not torch.cuda.is_available():
        return {"cuda": None}
    return {"cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "gpus": sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})}


def _cuda_visible(found: int, visible: str | None) -> int:
    """How many of `found` GPUs CUDA_VISIBLE_DEVICES leaves visible: its entries up to the first invalid one
    (CUDA's own rule; an index out of range or "-1" ends the list), UUIDs (GPU-..., MIG-...) taken as valid."""
    if visible is None:
        return found
    n = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if entry.startswith(("GPU-", "MIG-")) or (entry.isdigit() and int(entry) < found):
            n += 1
        else:
            break
    return min(n, found)


def visible_nvidia_gpus(proc_dir: str | os.PathLike = "/proc/driver/nvidia/gpus") -> tuple[int, str]:
    """(NVIDIA GPUs this process can use, how they were counted), without importing torch (seconds, and a
    CUDA context): the driver's /proc/driver/nvidia/gpus entries, else `nvidia-smi -L`; then
    CUDA_VISIBLE_DEVICES."""
    proc = Path(proc_dir)
    if proc.is_dir():
        found = len([p for p in proc.iterdir() if p.is_dir()])
        how = f"{proc} lists {found}"
    elif shutil.which("nvidia-smi"):
        try:
            r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
            found = sum(line.startswith("GPU ") for line in r.stdout.splitlines()) if r.returncode == 0 else 0
        except (OSError, subprocess.TimeoutExpired):
            found = 0
        how = f"`nvidia-smi -L` lists {found}"
    else:
        found, how = 0, f"no NVIDIA driver: {proc} absent, no nvidia-smi"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    n = _cuda_visible(found, visible)
    if visible is not None:
        how += f"; CUDA_VISIBLE_DEVICES={visible!r} leaves {n}"
    return n, how


def pin_portable_cpu_numerics() -> dict[str, Any]:
    """Pin the CPU kernels to their processor-independent variants (see the module docstring) and
    verify that the pin took effect; refuses when this process already dispatched on another level."""
    for key, value in PORTABLE_CPU_ENV.items():
        os.environ[key] = value
    info = cpu_numerics()
    wrong = []
    if info["aten_capability"] != "DEFAULT":
        wrong.append(f"torch dispatches to {info['aten_capability']} kernels, not DEFAULT")
    if info["blas"] == "mkl" and info.get("mkl_cbwr") not in ("COMPATIBLE", None):
        wrong.append(f"MKL runs CNR branch {info['mkl_cbwr']}, not COMPATIBLE")
    if wrong:
        env = " ".join(f"{k}={v}" for k, v in PORTABLE_CPU_ENV.items())
        raise EnvironmentMismatch("train.portable_numerics: " + "; ".join(wrong) + ". This process ran tensor ops "
                                f"before the pin could apply; start it with {env} set (or set "
                                "train.portable_numerics: false to accept machine-specific CPU results)")
    return info


def wants_portable_cpu(train: dict) -> bool:
    """The one rule of when the pin applies: CPU runs with train.portable_numerics on."""
    return int(train.get("gpus", 0)) == 0 and bool(train.get("portable_numerics", True))


def environment_record(train: dict) -> dict[str, Any]:
    """The environment facts that decide the numbers of a run with these `train` params, in this
    process (applying the portable pin first when the params ask for it, as the numeric stages do)."""
    cpu = pin_portable_cpu_numerics() if wants_portable_cpu(train) else cpu_numerics()
    record: dict[str, Any] = {
        "format": RECORD_FORMAT,
        "python": ".".join(platform.python_version_tuple()[:2]),
        "python_implementation": platform.python_implementation(),
        "machine": platform.machine(),
        "packages": {name: _version(name) for name in recorded_packages(train)},
        "cpu_numerics": {**cpu, "portable": wants_portable_cpu(train)},
        "threads_per_process": int(train.get("cpu_threads", 1)),
    }
    # GPU facts only for GPU runs: a CPU run's numbers do not depend on whether the machine has a GPU.
    record["gpu_numerics"] = gpu_numerics() if int(train.get("gpus", 0)) > 0 else None
    return record


def recorded_packages(train: dict) -> tuple[str, ...]:
    """The packages whose versions a run with these `train` params records (GPU_PACKAGES for GPU runs only)."""
    return RECORDED_PACKAGES + (GPU_PACKAGES if int(train.get("gpus", 0)) > 0 else ())


def installed_fingerprint(train: dict) -> str:
    """The recorded packages' installed versions, cheaply (no torch import): the workflow's rerun
    trigger for the environment rule, which DVC cannot see (it hashes files, not installs)."""
    return " ".join(f"{name}=={_version(name)}" for name in recorded_packages(train))


def compare_records(recorded: dict, actual: dict, prefix: str = "") -> list[str]:
    """Human-readable differences between two environment records (empty when they agree)."""
    out: list[str] = []
    for key in sorted(set(recorded) | set(actual)):
        a, b = recorded.get(key), actual.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(compare_records(a, b, name + "."))
        elif a != b:
            out.append(f"{name}: recorded {a!r}, here {b!r}")
    return out


def check_against_record(record_path: str | os.PathLike, train: dict) -> dict[str, Any]:
    """In a numeric stage: this process's record must equal the one the DAG declared as its input,
    else the stage would write numbers the record does not describe."""
    from stages.lib.io import read_json
    actual = environment_record(train)
    # The stage's record also says how the install relates to its lock; only the facts are compared.
    recorded = {k: v for k, v in read_json(record_path).items() if k in actual}
    diffs = compare_records(recorded, actual)
    if diffs:
        raise EnvironmentMismatch(f"{record_path}: this process's environment differs from the recorded one "
                                "(rerun the environment stage, e.g. `snakemake --cores N`, or `dvc repro`): "
                                + "; ".join(diffs))
    return actual
