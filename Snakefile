# The pipeline's DAG. dvc.yaml is generated from this file (python workflow/sync_dvc.py; tests run
# its --check), so `snakemake --cores N` and `dvc repro` run the same stages with the same commands.
#
#   snakemake --cores 2            # run everything on the embedded default
#   dvc repro                      # the same DAG, hash-tracked in dvc.lock
import os

import yaml
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
include: "workflow/rules/environment.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/reference.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/slurm.smk"

# Every rule's outputs are stages/lib/layout.py's, and the report reads them all (what `report verify` requires).
from rule_layout import check_rules_follow_layout

check_rules_follow_layout(rules, config)


rule all:
    input:
        FINAL_TARGETS,
    default_target: True


onsuccess:
    # Record what Snakemake just built in dvc.lock, so `dvc status` agrees with this run (not when
    # `dvc repro` itself called us through sync_dvc.py --record-for-snakemake: DVC holds its lock).
    if not os.environ.get("PREFPIPE_INSIDE_DVC"):
        shell("python workflow/sync_dvc.py --commit-lock")
