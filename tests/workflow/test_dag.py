"""The Snakefile and dvc.yaml describe one DAG, and every rule follows the house rules."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "workflow"))
import sync_dvc  # noqa: E402
from integrity import DAG_ONLY  # noqa: E402
from code_deps import code_deps  # noqa: E402


def test_dvc_yaml_is_generated_from_the_snakefile():
    r = subprocess.run([sys.executable, "workflow/sync_dvc.py", "--check"], cwd=REPO_ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_check_mode_catches_a_hand_edit(tmp_path):
    _copy_workflow(tmp_path, (*WORKFLOW_FILES, "dvc.yaml"))
    dvc = yaml.safe_load((tmp_path / "dvc.yaml").read_text())
    first = next(iter(dvc["stages"]))
    dvc["stages"][first]["cmd"] += " --extra"
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(dvc, sort_keys=False))
    r = subprocess.run([sys.executable, "workflow/sync_dvc.py", "--check"], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 1
    assert "out of date" in r.stderr and "--extra" in r.stderr


def test_every_rule_logs_and_is_benchmarked():
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


# What Snakemake reads to build the DAG.
WORKFLOW_FILES = ("Snakefile", "params.yaml", "workflow", "stages", "data", "models", "requirements")


def _copy_workflow(dst: Path, names=WORKFLOW_FILES) -> Path:
    """`names` of the checkout copied to `dst` (so a test may edit params or rules there)."""
    for name in names:
        src = REPO_ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.exists():
            shutil.copy2(src, dst / name)
    return dst


def _dry_run(root: Path, *args: str) -> dict[str, tuple[dict, str]]:
    """rule -> (resources, shell command) of each job of a real `snakemake --dry-run --printshellcmds` of the DAG."""
    r = subprocess.run(["snakemake", "--dry-run", "--printshellcmds", "--forceall", *args], cwd=root,
                       env={**os.environ, DAG_ONLY: "1"}, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    jobs = {}
    for name, body in re.findall(r"^(?:local)?rule (\w+):\n(.*?)(?=^\[|^(?:local)?rule |^Job stats|\Z)", r.stdout,
                                 re.M | re.S):
        resources = re.search(r"^    resources: (.*)$", body, re.M)
        shell = re.search(r"^Shell command: (.*)$", body, re.M)
        jobs[name] = (dict(kv.split("=", 1) for kv in resources.group(1).split(", ")) if resources else {},
                      shell.group(1) if shell else "")
    return jobs


# (params.yaml edits, snakemake's executor arguments): the committed CPU run, more CPU processes, one GPU node, and
# two GPU nodes. GPU runs go through --executor slurm: a local dry run is refused on a machine without the GPUs
# (workflow/preflight.py), while a Slurm submit host need not have them; a dry run submits nothing and needs no
# Slurm installed.
LAUNCH_VARIANTS = {
    "committed_cpu": ({}, ["--cores", "1"]),
    "cpu_procs_3": ({"train": {"cpu_procs": 3}}, ["--cores", "1"]),
    "gpus_2": ({"train": {"gpus": 2, "cpu_procs": 3}}, ["--executor", "slurm", "--jobs", "1"]),
    "gpus_2_nodes_2": ({"train": {"gpus": 2}, "slurm": {"nodes": 2}}, ["--executor", "slurm", "--jobs", "1"]),
}


@pytest.mark.parametrize("variant", LAUNCH_VARIANTS)
def test_training_rules_launch_torchrun_with_the_resolved_process_count(tmp_path, variant):
    """The rules of workflow/rules/train.smk run `torchrun` with one process per GPU (train.gpus), or
    train.cpu_procs processes when train.gpus is 0, and ask Snakemake/Slurm for what they start; generate and judge
    run one process on at most one GPU; no other rule starts torchrun or asks for a GPU. Checked on the command Snakemake really runs, for each variant's params."""
    edits, executor = LAUNCH_VARIANTS[variant]
    root = _copy_workflow(tmp_path)
    params = yaml.safe_load((root / "params.yaml").read_text())
    for section, values in edits.items():
        params[section].update(values)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    gpus, nodes = params["train"]["gpus"], params["slurm"]["nodes"]
    nproc = gpus if gpus > 0 else params["train"]["cpu_procs"]

    jobs = _dry_run(root, *executor)
    training = re.findall(r"^rule (\w+):", (REPO_ROOT / "workflow/rules/train.smk").read_text(), re.M)
    assert set(training) == {"sft", "ref_logps", "train_dpo", "train_rm"} <= set(jobs), (training, sorted(jobs))
    generation = re.findall(r"^rule (\w+):", (REPO_ROOT / "workflow/rules/generation.smk").read_text(), re.M)
    assert {"generate", "judge"} <= set(generation) and {"generate", "judge"} <= set(jobs), (generation, sorted(jobs))
    for name, (resources, shell) in jobs.items():
        if name == "all":
            continue
        stage_args = f"-m stages.{name} -- --params params.yaml "
        if name in generation:        # one process on at most one GPU, on one node, whatever training uses
            assert "torchrun" not in shell and shell.startswith(f"python -m stages.{name} "), (name, shell)
            assert resources["gpu"] == str(min(gpus, 1)) and resources["nproc"] == "1", (name, resources)
            assert resources.get("nodes", "1") == "1", (name, resources)
            continue
        if name not in training:
            assert "torchrun" not in shell and shell.startswith(f"python -m stages.{name} "), (name, shell)
            assert "gpu" not in resources and "gres" not in resources, (name, resources)
            continue
        assert resources["nproc"] == str(nproc), (name, resources)
        if nodes == 1:
            assert shell.startswith(f"torchrun --standalone --nproc-per-node {nproc} {stage_args}"), (name, shell)
            assert resources["gpu"] == str(gpus), (name, resources)
        else:
            # srun starts one torchrun agent per node; they meet at a c10d rendezvous (workflow/launch.py).
            assert f" srun --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1 " in shell, (name, shell)
            assert f" torchrun --nnodes {nodes} --nproc-per-node {nproc} --rdzv-backend c10d " in shell, (name, shell)
            assert f' --rdzv-id "$SLURM_JOB_ID" {stage_args}' in shell, (name, shell)
            assert resources["nodes"] == str(nodes) and resources["gres"] == f"gpu:{gpus}", (name, resources)


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


def test_every_stage_depends_on_all_the_code_it_imports():
    """A code file a stage imports (directly or not) is one of its DVC/Snakemake deps, so editing it reruns
    the stage (graphs.py, now stages/engine/steps.py, was once missing from the training rules)."""
    import re
    dvc = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())
    for name, stage in dvc["stages"].items():
        modules = re.findall(r"-m (stages\.\w+)", stage["cmd"])
        assert modules, name
        missing = set(code_deps(*modules)) - set(stage["deps"])
        assert not missing, f"dvc stage {name}: imports {sorted(missing)} but does not depend on them"


def test_no_rule_lists_its_code_by_hand():
    """Every rule's `code` input is computed from its stage's imports (workflow/code_deps.py)."""
    for path in sorted((REPO_ROOT / "workflow" / "rules").glob("*.smk")):
        for block in path.read_text().split("\nrule ")[1:]:
            name = block.split(":", 1)[0]
            code = re.findall(r"\n        code=(.*)", block)
            assert code and all(c.startswith('code_deps("stages.') for c in code), f"{path.name} rule {name}: {code}"


def test_code_deps_follow_imports_lazy_ones_too(tmp_path):
    pkg = tmp_path / "stages"
    (pkg / "lib").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""docstring only: not a dependency"""\n')
    (pkg / "lib" / "__init__.py").write_text("from stages.lib.c import X  # code: a dependency\n")
    (pkg / "a.py").write_text("import json\nfrom stages.lib import b\n")
    (pkg / "lib" / "b.py").write_text("def f():\n    import stages.lib.c\n")
    (pkg / "lib" / "c.py").write_text("X = 1\n")
    (pkg / "lonely.py").write_text("")
    assert code_deps("stages.a", root=tmp_path) == ["stages/a.py", "stages/lib/__init__.py", "stages/lib/b.py",
                                                    "stages/lib/c.py"]
    assert code_deps("stages.lonely", "stages.a", root=tmp_path)[:2] == ["stages/lonely.py", "stages/a.py"]
    with pytest.raises(ValueError, match="no module"):
        code_deps("stages.nope", root=tmp_path)
    # A package that finds its own modules (the format registry) depends on every module in it, listed nowhere.
    (pkg / "plug").mkdir()
    (pkg / "plug" / "__init__.py").write_text("import pkgutil\nNAMES = [m.name for m in pkgutil.iter_modules(__path__)]\n")
    (pkg / "plug" / "one.py").write_text("from stages.lib import c\n")
    (pkg / "plug" / "two.py").write_text("")
    (pkg / "uses_plug.py").write_text("from stages.plug import NAMES\n")
    assert code_deps("stages.uses_plug", root=tmp_path) == ["stages/uses_plug.py", "stages/lib/__init__.py",
                                                             "stages/lib/c.py", "stages/plug/__init__.py",
                                                             "stages/plug/one.py", "stages/plug/two.py"]


def _code_deps_in_a_new_process(root: Path, module: str) -> list[str]:
    """code_deps as a fresh Snakemake start computes it: a new process, only the on-disk cache carried over."""
    r = subprocess.run([sys.executable, "-c", "import sys, json; sys.path.insert(0, sys.argv[1]); "
                        "from code_deps import code_deps; print(json.dumps(code_deps(sys.argv[2], root=sys.argv[3])))",
                        str(REPO_ROOT / "workflow"), module, str(root)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_code_deps_cache_is_keyed_by_content_so_an_edit_is_seen(tmp_path):
    """The parse results kept between Snakemake starts (.snakemake/prefpipe_code_deps.json) never stand in for a
    file's current bytes: an import added to a file whose size and mtime are kept shows up at the next start, and a
    corrupt cache file is rebuilt, not trusted."""
    pkg = tmp_path / "stages"
    (pkg / "lib").mkdir(parents=True)
    (pkg / "a.py").write_text("from stages.lib import b  #\n")
    (pkg / "lib" / "b.py").write_text("X = 1\n")
    (pkg / "lib" / "c.py").write_text("Y = 2\n")
    assert _code_deps_in_a_new_process(tmp_path, "stages.a") == ["stages/a.py", "stages/lib/b.py"]
    cache = tmp_path / ".snakemake/prefpipe_code_deps.json"
    assert cache.is_file()
    st = (pkg / "a.py").stat()
    (pkg / "a.py").write_text("from stages.lib import c  #\n")        # same size
    os.utime(pkg / "a.py", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert _code_deps_in_a_new_process(tmp_path, "stages.a") == ["stages/a.py", "stages/lib/c.py"]
    cache.write_text('{"format": "prefpipe-code-deps/1", "entries": []}')
    assert _code_deps_in_a_new_process(tmp_path, "stages.a") == ["stages/a.py", "stages/lib/c.py"]
    cache.write_bytes(b"\xff not json")
    assert _code_deps_in_a_new_process(tmp_path, "stages.a") == ["stages/a.py", "stages/lib/c.py"]


def test_rule_outputs_are_the_layout_report_verify_requires(tmp_path):
    """stages/lib/layout.py is the one list of artifact paths: the rules take their outputs from it, and an output
    added to a rule by hand (which the evidence bundle would never vouch for) stops the DAG build, naming the rule."""
    from stages.lib.layout import STAGE_OUTPUTS
    from stages.lib.stage_plan import bundle_artifacts

    jobs, config = sync_dvc.snakemake_jobs()
    dvc = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())["stages"]
    for stage, outputs in STAGE_OUTPUTS.items():
        if stage in dvc:
            outs = {next(iter(o)) if isinstance(o, dict) else o
                    for key in ("outs", "metrics", "plots") for o in dvc[stage].get(key, [])}
            assert set(outputs.values()) <= outs, stage
    assert set(bundle_artifacts(config)) <= set(re.findall(r"[^\s=]+", dvc["report"]["cmd"]))

    _copy_workflow(tmp_path)
    rules = tmp_path / "workflow/rules/data.smk"
    text = rules.read_text()
    assert '        stats=OUT["normalize"]["stats"],\n' in text
    rules.write_text(text.replace('        stats=OUT["normalize"]["stats"],\n',
                                  '        stats=OUT["normalize"]["stats"],\n        extra="results/normalize/extra.json",\n'))
    r = subprocess.run(["snakemake", "-n", "--quiet"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode != 0 and "rule normalize: outputs" in r.stdout + r.stderr, r.stdout + r.stderr
    assert "are not stages/lib/layout.py's" in r.stdout + r.stderr


def test_rule_params_are_the_stage_declaration_and_a_hand_listed_one_stops_the_dag(tmp_path):
    """A rule's params are exactly the keys its stage declares (stages/lib/layout.py STAGE_PARAMS): a key listed by
    hand beside them (which the stage cannot read) stops the DAG build naming the rule; each rule's params in
    dvc.yaml are its declaration's keys that params.yaml sets."""
    from stages.lib.layout import STAGE_PARAMS
    from rule_layout import rule_params

    jobs, config = sync_dvc.snakemake_jobs()
    dvc = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())["stages"]
    for stage in dvc:
        want = sorted(k.replace("__", ".") for k in rule_params(config, stage))
        assert sorted(dvc[stage].get("params", [])) == want, stage
        assert STAGE_PARAMS[stage]

    _copy_workflow(tmp_path)
    rules = tmp_path / "workflow/rules/evaluate.smk"
    text = rules.read_text()
    anchor = '        **rule_params(config, "evaluate"),\n'
    assert anchor in text
    rules.write_text(text.replace(anchor, anchor + '        train__lr=config["train"]["lr"],\n'))
    r = subprocess.run(["snakemake", "-n", "--quiet"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode != 0 and "rule evaluate: params" in r.stdout + r.stderr, r.stdout + r.stderr
    assert "train__lr" in r.stdout + r.stderr


SCRATCH_STAGE = '''"""scratch: a throwaway stage (tests/workflow/test_dag.py counts the files adding it costs)."""
from stages.lib.cli import stage_main
from stages.lib.declared_params import load_stage_params
from stages.lib.io import write_json


def _arguments(parser):
    parser.add_argument("--probe", required=True)
    parser.add_argument("--out", required=True)


def _run(args):
    write_json(args.out, {"probe_size": load_stage_params(args.params, "scratch")["probe"]["size"]})
    return 0


def main(argv=None):
    return stage_main(argv, "scratch", __doc__.split("\\n")[0], add_arguments=_arguments, run=_run)


if __name__ == "__main__":
    raise SystemExit(main())
'''
SCRATCH_RULE = '''rule scratch:
    input:
        environment=ENV_RECORD,
        probe=rules.freeze_probe.output.probe,
        code=code_deps("stages.scratch"),
    output:
        table=OUT["scratch"]["table"],
    params:
        **rule_params(config, "scratch"),
    log:
        f"{LOGS}/scratch.log",
    benchmark:
        f"{LOGS}/benchmarks/scratch.tsv"
    shell:
        "python -m stages.scratch --params params.yaml --probe {input.probe} --out {output.table} --log {log}"
'''


def test_a_scratch_stage_costs_four_hand_written_files(tmp_path):
    """Issue 35: adding a stage is its module, its test, its rule file and its layout entry. The Snakefile includes
    the new rule file by itself, the report bundles its outputs by the layout, dvc.yaml and the docs' stage lists
    are generated (sync_dvc.py, sync_docs.py). Measured here in a scratch copy; the count is in ARCHITECTURE.md."""
    root = _copy_workflow(tmp_path, (*WORKFLOW_FILES, "README.md", "docs"))
    written = {
        "stages/scratch.py": SCRATCH_STAGE,
        "tests/stages/test_scratch.py": "def test_scratch():\n    import stages.scratch  # noqa: F401\n",
        "workflow/rules/scratch.smk": SCRATCH_RULE,
    }
    for rel, text in written.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    layout = root / "stages/lib/layout.py"
    text = layout.read_text()
    for old, new in (('    "report": {"bundle"', '    "scratch": {"table": "results/scratch/table.json"},\n'
                                                '    "report": {"bundle"'),
                     ('    "report": ("*",),', '    "scratch": ("probe.size",),\n    "report": ("*",),')):
        assert old in text
        text = text.replace(old, new, 1)
    layout.write_text(text)
    hand_written = [*written, "stages/lib/layout.py"]
    assert len(hand_written) == 4

    jobs = _dry_run(root)
    assert jobs["scratch"][1].startswith("python -m stages.scratch --params params.yaml")
    assert "results/scratch/table.json" in jobs["report"][1]      # bundled, with no edit of the report rule
    for tool in ("workflow/sync_dvc.py", "workflow/sync_docs.py"):
        subprocess.run([sys.executable, tool], cwd=root, check=True, capture_output=True)
    stage = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]["scratch"]
    assert stage["params"] == ["probe.size"] and "stages/scratch.py" in stage["deps"]
    assert "| scratch | `results/scratch/table.json` | A throwaway stage" in (root / "README.md").read_text()
