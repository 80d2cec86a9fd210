"""The environment record and the portable CPU pin (stages/lib/environment.py) and the environment stage."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from stages import environment as env_stage
from stages.lib import environment as envlib

NATIVE = {k: v for k, v in os.environ.items() if k not in envlib.PORTABLE_CPU_ENV}


def run_py(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**(env or NATIVE), "PYTHONPATH": str(REPO_ROOT)})


def test_the_pin_takes_effect_before_the_first_op_and_is_refused_after_it():
    r = run_py("from stages.lib.environment import pin_portable_cpu_numerics as p; import json, torch; "
               "print(json.dumps(p()))")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["aten_capability"] == "DEFAULT" and info["onednn_max_isa"] == "SSE41"
    if info["blas"] == "mkl":
        assert info["mkl_cbwr"] == "COMPATIBLE"
    # A process that already dispatched natively cannot be pinned any more: refused, with the fix named.
    r = run_py("import torch; (torch.ones(64, 64) @ torch.ones(64, 64)).sum().item(); torch.log_softmax(torch.ones(9), 0)\n"
               "from stages.lib.environment import pin_portable_cpu_numerics as p; p()")
    native = run_py("import torch; print(torch.backends.cpu.get_cpu_capability())").stdout.strip()
    if native == "DEFAULT":
        pytest.skip("this CPU's native dispatch is already the baseline")
    assert r.returncode != 0 and "train.portable_numerics" in r.stderr and "ATEN_CPU_CAPABILITY=default" in r.stderr


def test_portable_results_do_not_depend_on_the_dispatch_the_machine_offers():
    """The emulated 'other CPU': torch forced to each capability, MKL's own dispatch capped. Under the pin a
    small fp32 network's forward/backward gives the same bits in every case; natively it does not have to."""
    code = ("import os, sys, torch, hashlib\n"
            "from stages.lib.environment import pin_portable_cpu_numerics as pin\n"
            "if sys.argv[1] == 'pin': pin()\n"
            "torch.manual_seed(0); torch.set_num_threads(1)\n"
            "x = torch.randn(96, 257); w1 = torch.randn(257, 193, requires_grad=True); w2 = torch.randn(193, 1, requires_grad=True)\n"
            "y = torch.log_softmax(torch.tanh(x @ w1), -1) @ w2; y.sum().backward()\n"
            "print(hashlib.sha256(y.detach().numpy().tobytes() + w1.grad.numpy().tobytes()).hexdigest())")
    results = {}
    for forced in ({}, {"ATEN_CPU_CAPABILITY": "default"}, {"ATEN_CPU_CAPABILITY": "avx2"},
                   {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}, {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}):
        r = subprocess.run([sys.executable, "-c", code, "pin"], cwd=REPO_ROOT, capture_output=True, text=True,
                           env={**NATIVE, **forced, "PYTHONPATH": str(REPO_ROOT)})
        assert r.returncode == 0, r.stderr
        results[tuple(forced.items())] = r.stdout.strip()
    assert len(set(results.values())) == 1, results
    # Without the pin the same code gives other bits when torch dispatches to another instruction set.
    native = {}
    for capability in ("default", "avx2"):
        r = subprocess.run([sys.executable, "-c", code, "native"], cwd=REPO_ROOT, capture_output=True, text=True,
                           env={**NATIVE, "ATEN_CPU_CAPABILITY": capability, "PYTHONPATH": str(REPO_ROOT)})
        native[capability] = r.stdout.strip()
    if run_py("import torch; print(torch.backends.cpu.get_cpu_capability())").stdout.strip() != "DEFAULT":
        assert native["default"] != native["avx2"], native


def test_record_holds_what_decides_the_numbers_and_no_machine_trivia():
    record = envlib.environment_record({"gpus": 0, "portable_numerics": True, "cpu_threads": 1})
    assert record["python"] == f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert set(record["packages"]) == set(envlib.RECORDED_PACKAGES)     # no triton: it never runs on CPU
    assert "triton" not in record["packages"]
    import torch
    assert record["packages"]["torch"] == torch.__version__
    assert record["cpu_numerics"]["aten_capability"] == "DEFAULT" and record["cpu_numerics"]["portable"] is True
    assert record["gpu_numerics"] is None                     # a CPU run's numbers do not depend on a GPU
    text = json.dumps(record)
    import platform, socket
    for trivia in (socket.gethostname(), platform.python_version() if platform.python_version().count(".") == 2 else "",
                   str(REPO_ROOT)):
        assert not trivia or f'"{trivia}"' not in text


def test_compare_records_names_each_difference():
    a = {"packages": {"torch": "2.13.0+cpu", "numpy": "2.4.6"}, "python": "3.11"}
    b = {"packages": {"torch": "2.11.0+cu130", "numpy": "2.4.6"}, "python": "3.12"}
    assert envlib.compare_records(a, b) == ["packages.torch: recorded '2.13.0+cpu', here '2.11.0+cu130'",
                                            "python: recorded '3.11', here '3.12'"]
    assert envlib.compare_records(a, a) == []


def test_a_numeric_stage_refuses_a_process_that_differs_from_the_record(tmp_path):
    train = {"gpus": 0, "portable_numerics": True, "cpu_threads": 1}
    record = envlib.environment_record(train)
    record["packages"]["transformers"] = "4.0.0"
    path = tmp_path / "environment.json"
    path.write_text(json.dumps({**record, "lock": {"matches": True}}))
    with pytest.raises(envlib.EnvironmentMismatch, match=r"packages.transformers: recorded '4.0.0', here"):
        envlib.check_against_record(path, train)
    record["packages"]["transformers"] = envlib.environment_record(train)["packages"]["transformers"]
    path.write_text(json.dumps(record))
    assert envlib.check_against_record(path, train)["packages"] == record["packages"]


def test_lock_pins_are_read_and_differences_named(tmp_path):
    lock = tmp_path / "lock.txt"
    import numpy
    lock.write_text(f"numpy=={numpy.__version__} \\\n    --hash=sha256:00\n    # via x\n"
                    "pyyaml==0.0.1 \\\n    --hash=sha256:11\nnot-installed-pkg==1.0\n")
    pins = env_stage.read_lock_pins(lock)
    assert pins == {"numpy": numpy.__version__, "pyyaml": "0.0.1", "not-installed-pkg": "1.0"}
    diffs = env_stage.lock_differences(pins)
    assert [d["package"] for d in diffs] == ["not-installed-pkg", "pyyaml"]
    assert diffs[0]["installed"] is None and diffs[1]["locked"] == "0.0.1"


def test_environment_stage_refuses_an_unlocked_install_unless_allowed(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text("pyyaml==0.0.1 \\\n    --hash=sha256:11\n")
    out = tmp_path / "environment.json"
    cmd = [sys.executable, "-m", "stages.environment", "--params", str(REPO_ROOT / "params.yaml"), "--lock", str(lock),
           "--out", str(out), "--log", str(tmp_path / "environment.log")]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop(env_stage.ALLOW_UNLOCKED, None)
    r = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, env=env)
    assert r.returncode == 1 and not out.exists()
    assert "1 installed package(s) differ from the lock: pyyaml" in r.stderr and "(lock: 0.0.1)" in r.stderr
    r = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, env={**env, env_stage.ALLOW_UNLOCKED: "1"})
    assert r.returncode == 0, r.stderr
    record = json.loads(out.read_text())
    assert record["lock"]["matches"] is False and record["lock"]["differences"][0]["package"] == "pyyaml"
    # The stage log is a hashed output: no timestamps.
    assert (tmp_path / "environment.log").read_text().startswith("environment WARNING ")


RUNTIME_LOCK, TEST_LOCK = REPO_ROOT / "requirements/lock.txt", REPO_ROOT / "requirements/test-lock.txt"
TEST_ONLY = ("pytest", "pytest-xdist", "trl", "scipy", "triton")


def lock_entries(path) -> dict[str, str]:
    """{canonical name: the pin's whole entry (the `name==version` line and its --hash lines)}."""
    entries, name = {}, None
    for line in path.read_text().splitlines():
        if line and not line[0].isspace() and "==" in line:
            name = env_stage.canonical_name(line.split("==")[0])
            entries[name] = line
        elif name and line.lstrip().startswith("--hash="):
            entries[name] += "\n" + line
        else:
            name = None
    return entries


def test_the_repository_locks_pin_every_recorded_package_and_the_cpu_torch():
    """README command 1 installs the runtime lock, command 2 the test lock: both hash-pinned, the same CPU torch,
    every recorded package; the runtime lock without the test extra (pytest, trl, scipy and triton's 286 MB)."""
    for path, recorded in ((RUNTIME_LOCK, envlib.RECORDED_PACKAGES),
                           (TEST_LOCK, envlib.RECORDED_PACKAGES + envlib.GPU_PACKAGES)):
        pins = env_stage.read_lock_pins(path)
        for name in recorded:
            assert env_stage.canonical_name(name) in pins, (path.name, name)
        assert pins["torch"] == "2.13.0+cpu", path.name
        text = path.read_text()
        entries = [line for line in text.splitlines() if "==" in line and not line.lstrip().startswith("#")]
        assert entries and all(line.rstrip().endswith("\\") for line in entries)   # every pin carries hashes
    runtime = env_stage.read_lock_pins(RUNTIME_LOCK)
    assert not [name for name in TEST_ONLY if name in runtime]
    assert all(name in env_stage.read_lock_pins(TEST_LOCK) for name in TEST_ONLY)


def test_an_install_from_either_lock_matches_the_runtime_lock():
    """The environment stage checks the install against requirements/lock.txt: every package of it is in the test
    lock at the same version with the same hashes (requirements/refresh resolves one under the other), so an
    install from the test lock matches too; and a CPU record names no package the runtime lock lacks."""
    runtime, full = lock_entries(RUNTIME_LOCK), lock_entries(TEST_LOCK)
    assert runtime and set(runtime) < set(full)
    assert [name for name in runtime if runtime[name] != full[name]] == []
    cpu = {"gpus": 0, "portable_numerics": True, "cpu_threads": 1}
    assert set(envlib.recorded_packages(cpu)) <= set(env_stage.read_lock_pins(RUNTIME_LOCK))
    assert "triton" in envlib.recorded_packages({**cpu, "gpus": 1})
