# The pipeline's DAG. dvc.yaml is generated from this file (python workflow/sync_dvc.py; tests run
# its --check), so `snakemake --cores N` and `dvc repro` run the same stages with the same commands.
#
#   snakemake --cores 2            # run everything on the embedded default
#   dvc repro                      # the same DAG, hash-tracked in dvc.lock
import os
import subprocess
import sys
from pathlib import Path

from snakemake.utils import min_version

min_version("9.0")

if os.path.join(workflow.basedir, "workflow") not in sys.path:
    sys.path.insert(0, os.path.join(workflow.basedir, "workflow"))
from preflight import dag_preflight, params_readable

# Snakemake's own config load raises a traceback on bytes that are not UTF-8: they are refused first, in one line.
params_readable("params.yaml")


configfile: "params.yaml"


# Pre-flight, before any rule exists (workflow/preflight.py): params.yaml read strictly and checked by the
# check every stage runs (stages/lib/params.py: a key written twice, a non-finite number, the schema; and
# train.gpus against this machine's GPUs when the jobs run here), config equal to params.yaml (DVC reads
# only that), every data source naming data files. A failure is one `Snakefile: refused:` line, exit 1.
dag_preflight(workflow, config)


include: "workflow/rules/common.smk"


# Hashes decide what is up to date (workflow/integrity.py): before the DAG is built, every stage dvc.lock records is
# compared with the workspace in one DVC session, and a stage whose recorded bytes, params or command changed reruns
# (Snakemake's --forcerun: this command starts itself again with it), with everything downstream, saying why; DVC's
# repository lock is held for the run, so `dvc repro` cannot run beside it. Only in Snakemake's main process of a
# user's run (not on cluster nodes, not inside DVC, not for sync_dvc.py's DAG read).
from integrity import IntegrityError, RunGuard, guards_this_process, requested_targets
from preflight import refuse

RUN_GUARD = None
if guards_this_process(workflow):
    try:
        RUN_GUARD = RunGuard(Path(workflow.basedir), requested_targets())
        if RUN_GUARD.unforced or RUN_GUARD.rerun_incomplete:
            RUN_GUARD.rerun_forcing()       # this command again, with --forcerun / --rerun-incomplete: replaces this process
    except IntegrityError as _e:
        refuse(f"integrity: {_e}")
    RUN_GUARD.watch_jobs()                  # a stage's processes die with this run, kill -9 included


include: "workflow/rules/environment.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/reference.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/generation.smk"
include: "workflow/rules/rounds.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/slurm.smk"


# A new stage's rule file needs no line here: every other workflow/rules/*.smk is included after the ones above (its
# rules may use theirs), in name order. Adding a stage is four files (docs/ARCHITECTURE.md, "How to add a stage").
for _extra in sorted(set(Path(workflow.basedir, "workflow/rules").glob("*.smk")) - {
        Path(workflow.basedir, "workflow/rules", f"{_name}.smk") for _name in (
            "common", "environment", "data", "reference", "train", "generation", "rounds", "evaluate", "slurm")}):

    include: str(_extra)

# Every rule's outputs are stages/lib/layout.py's, and the report reads them all (what `report verify` requires).
from rule_layout import check_rules_follow_layout

check_rules_follow_layout(rules, config)


rule all:
    input:
        FINAL_TARGETS,
    default_target: True


onsuccess:
    # Record in dvc.lock what this run built, and only that, so `dvc status` agrees with it (sync_dvc.py refuses to
    # record an output of another stage of the DAG that changed on disk, printing why; one outside it is reported). Not for `dvc repro`'s own calls (DVC
    # records those) nor for --touch (nothing was built). A run must never end with a declared output missing.
    # DVC's lock is shared with the commit's process (never free between the run and its record: a `dvc repro`
    # started in that gap ran beside this run), and given back after it.
    if RUN_GUARD is not None:
        _dag = sorted({job.rule.name for job in workflow.dag.jobs} - {"all"})
        _missing = sorted({str(f) for job in workflow.dag.jobs for f in job.output if not os.path.exists(f)})
        if _missing:
            RUN_GUARD.release()
            refuse(f"integrity: declared outputs missing after the run: {', '.join(_missing)}")
        if not workflow.touch:
            _rc = RUN_GUARD.commit_stages(
                sorted({job.rule.name for job in workflow.dag.needrun_jobs(exclude_finished=False)} - {"all"}), _dag)
            RUN_GUARD.release()
            if _rc != 0:
                raise SystemExit(_rc)
        RUN_GUARD.release()


onerror:
    # A failed run records what it finished: Snakemake removes only the failed jobs' outputs, so each finished job's
    # are whole, and the next run starts at the failure instead of rebuilding every output that no dvc.lock entry
    # vouches for (issue 34 item 2: such an output is rebuilt). The same commit as onsuccess, checks included; a run
    # killed outright (kill -9 of snakemake) reaches no handler, and its unrecorded outputs are rebuilt.
    if RUN_GUARD is not None:
        _dag = sorted({job.rule.name for job in workflow.dag.jobs} - {"all"})
        if not workflow.touch:
            _needrun = {job.rule.name for job in workflow.dag.needrun_jobs(exclude_finished=False)} - {"all"}
            _finished = sorted({job.rule.name for job in workflow.dag.needrun_jobs(exclude_finished=False)
                                if workflow.dag.finished(job)} - {"all"})
            # The stages that did not finish (the failed one: a stage log it appended to, outputs it half wrote)
            # are left out of the record's DAG: their changed outputs are reported, never a reason to refuse
            # recording the stages that did finish (as for a stage outside a targeted run's DAG).
            _dag = sorted(set(_dag) - (_needrun - set(_finished)))
            if _finished and RUN_GUARD.commit_stages(_finished, _dag) == 0:
                print(f"integrity: the run failed; recorded in dvc.lock the stages it finished: "
                      f"{', '.join(_finished)}", file=sys.stderr)
        RUN_GUARD.release()
