# The pipeline's DAG. dvc.yaml is generated from this file (python workflow/sync_dvc.py; tests run
# its --check), so `snakemake --cores N` and `dvc repro` run the same stages with the same commands.
#
#   snakemake --cores 2            # run everything on the embedded default
#   dvc repro                      # the same DAG, hash-tracked in dvc.lock
import os
from pathlib import Path

import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version, validate

min_version("9.0")


configfile: "params.yaml"


validate(config, "workflow/schemas/params.schema.yaml")

# DVC reads params.yaml and nothing else: a --config/--configfile override would make the two tools
# disagree about what ran, so refuse it instead of recording a run nobody can reproduce.
with open("params.yaml") as _f:
    if yaml.safe_load(_f) != config:
        raise ValueError(
            "config differs from params.yaml: edit params.yaml instead of passing --config/--configfile "
            "(DVC tracks params.yaml only)"
        )


include: "workflow/rules/common.smk"


# Hashes decide what is up to date (workflow/integrity.py): before the DAG is built, every stage dvc.lock records is
# compared with the workspace in one DVC session, and a stage with a changed or missing output or a changed dep
# reruns (and everything downstream), saying why; DVC's repository lock is held for the run, so `dvc repro`
# cannot run beside it. Only in Snakemake's main process of a user's run (not on cluster nodes, not inside DVC).
from integrity import IntegrityError, RunGuard, guards_this_process

RUN_GUARD = None
if guards_this_process(workflow):
    try:
        RUN_GUARD = RunGuard(Path(workflow.basedir))
        if RUN_GUARD.unforced:
            RUN_GUARD.rerun_forcing()       # this command again, with --forcerun: replaces this process
    except IntegrityError as _e:
        raise WorkflowError(f"integrity: refused: {_e}") from None
include: "workflow/rules/environment.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/reference.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/slurm.smk"


rule all:
    input:
        FINAL_TARGETS,
    default_target: True


onsuccess:
    # Record in dvc.lock what this run built, and only that, so `dvc status` agrees with it (sync_dvc.py refuses to
    # record an output of another stage that changed on disk). Not for `dvc repro`'s own calls (DVC records those)
    # nor for --touch (nothing was built). A run must never end with a declared output missing.
    if RUN_GUARD is not None:
        RUN_GUARD.release()
        _missing = sorted({str(f) for job in workflow.dag.jobs for f in job.output if not os.path.exists(f)})
        if _missing:
            raise WorkflowError(f"integrity: declared outputs missing after the run: {', '.join(_missing)}")
        if not workflow.touch:
            _ran = sorted({job.rule.name for job in workflow.dag.needrun_jobs(exclude_finished=False)} - {"all"})
            shell("python workflow/sync_dvc.py --commit-lock --ran " + " ".join(_ran))


onerror:
    if RUN_GUARD is not None:
        RUN_GUARD.release()
