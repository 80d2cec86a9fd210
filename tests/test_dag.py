"""The Snakefile and dvc.yaml describe one DAG, and every rule follows the house rules."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "workflow"))
import sync_dvc  # noqa: E402


def test_dvc_yaml_is_generated_from_the_snakefile():
    r = subprocess.run([sys.executable, "workflow/sync_dvc.py", "--check"], cwd=REPO_ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_check_mode_catches_a_hand_edit(tmp_path):
    for name in ["Snakefile", "params.yaml", "dvc.yaml", "workflow", "stages", "data", "models", "requirements"]:
        src = REPO_ROOT / name
        if src.is_dir():
            shutil.copytree(src, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.exists():
            shutil.copy2(src, tmp_path / name)
    dvc = yaml.safe_load((tmp_path / "dvc.yaml").read_text())
    first = next(iter(dvc["stages"]))
    dvc["stages"][first]["cmd"] += " --extra"
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(dvc, sort_keys=False))
    r = subprocess.run([sys.executable, "workflow/sync_dvc.py", "--check"], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 1
    assert "out of date" in r.stderr and "--extra" in r.stderr


def test_every_rule_logs_and_gpu_rules_launch_torchrun():
    jobs, config = sync_dvc.snakemake_jobs()
    dvc = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())["stages"]
    assert [j["name"] for j in jobs] == list(dvc)
    for job in jobs:
        assert " --log logs/" in job["cmd"], f"{job['name']} has no log"
    rules_text = "".join(p.read_text() for p in (REPO_ROOT / "workflow" / "rules").glob("*.smk"))
    for block in rules_text.split("\nrule ")[1:]:
        name = block.split(":", 1)[0]
        assert "\n    log:" in block, f"rule {name} has no log:"
        assert "\n    benchmark:" in block, f"rule {name} has no benchmark:"
        if "gpu=" in block:
            assert "torchrun --standalone --nproc-per-node {resources.nproc}" in block, f"GPU rule {name} does not launch torchrun"


def test_params_section_names_map_to_dvc_params():
    config = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    assert sync_dvc._param_key("train__lr", config["train"]["lr"], config) == "train.lr"
    assert sync_dvc._param_key("probe", config["probe"], config) == "probe"
    with pytest.raises(SystemExit, match="names no params.yaml key"):
        sync_dvc._param_key("nope", 1, config)
    with pytest.raises(SystemExit, match="passed through unchanged"):
        sync_dvc._param_key("probe__seed", config["probe"]["seed"] + 1, config)


def test_snakemake_lint_is_clean():
    r = subprocess.run(["snakemake", "--lint"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _stage_imports(module: str) -> set[str]:
    """The repository files a `stages.*` module imports, transitively (what its results depend on)."""
    import ast
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        path = REPO_ROOT / (name.replace(".", "/") + ".py")
        if not path.exists() or path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stages"):
                todo.append(node.module)
                todo += [f"{node.module}.{a.name}" for a in node.names]     # `from stages.lib import kernels`
            elif isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.startswith("stages")]
    return {str(p.relative_to(REPO_ROOT)) for p in seen}


def test_every_stage_depends_on_all_the_code_it_imports():
    """A code file a stage imports (directly or not) is one of its DVC/Snakemake deps, so editing it reruns
    the stage (stages/lib/graphs.py was once missing from the training rules)."""
    import re
    dvc = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())
    for name, stage in dvc["stages"].items():
        modules = re.findall(r"-m (stages\.\w+)", stage["cmd"])
        assert modules, name
        missing = set().union(*(_stage_imports(m) for m in modules)) - set(stage["deps"])
        assert not missing, f"dvc stage {name}: imports {sorted(missing)} but does not depend on them"
