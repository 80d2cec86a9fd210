# The pipeline's DAG. dvc.yaml is generated from this file (python workflow/sync_dvc.py; tests run
# its --check), so `snakemake --cores N` and `dvc repro` run the same stages with the same commands.
#
#   snakemake --cores 2            # run everything on the embedded default
#   dvc repro                      # the same DAG, hash-tracked in dvc.lock
import os
import sys

from snakemake.utils import min_version

min_version("9.0")


configfile: "params.yaml"


# Pre-flight, before any rule exists (workflow/preflight.py): params.yaml read strictly and checked by the
# check every stage runs (stages/lib/params.py: a key written twice, a non-finite number, the schema; and
# train.gpus against this machine's GPUs when the jobs run here), config equal to params.yaml (DVC reads
# only that), every data source naming data files. A failure is one `Snakefile: refused:` line, exit 1.
if os.path.join(workflow.basedir, "workflow") not in sys.path:
    sys.path.insert(0, os.path.join(workflow.basedir, "workflow"))
from preflight import dag_preflight

dag_preflight(workflow, config)


include: "workflow/rules/common.smk"
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
    # Record what Snakemake just built in dvc.lock, so `dvc status` agrees with this run (not when
    # `dvc repro` itself called us through sync_dvc.py --record-for-snakemake: DVC holds its lock).
    if not os.environ.get("PREFPIPE_INSIDE_DVC"):
        shell("python workflow/sync_dvc.py --commit-lock")
