# Slurm allocations of every rule from params.yaml's `slurm` section, read only by
# `snakemake --executor slurm` (snakemake-executor-plugin-slurm); local runs and `dvc repro` ignore them.
# Included last: it fills in what a rule did not declare itself (the training rules declare theirs through
# workflow/launch.py train_resources), so the data and evaluation rules stay free of scheduler details.
# Resources are no rerun trigger and no part of dvc.yaml: changing them reruns nothing.

_SLURM_DEFAULTS = {
    "slurm_partition": config["slurm"]["partition"],
    "slurm_account": config["slurm"]["account"],
    "runtime": config["slurm"]["cpu_runtime_min"],
    "mem_mb": config["slurm"]["cpu_mem_mb"],
    # No cpus_per_task here: the plugin then asks for the rule's `threads` (1 unless the rule says more).
}
for _rule in workflow.rules:
    for _name, _value in _SLURM_DEFAULTS.items():
        # "" = let the cluster (or the plugin's guess) decide: the plugin treats a set resource as a request.
        if _value != "" and _name not in _rule.resources:
            _rule.resources[_name] = _value

# tokenize declares `threads:` from the CPUs of the machine that builds the DAG (tokenize.workers: 0), which on a
# cluster is the login node: the plugin would ask a compute node for that many CPUs. Ask for slurm.data_cpus.
for _rule in workflow.rules:
    if _rule.name == "tokenize" and "cpus_per_task" not in _rule.resources:
        _rule.resources["cpus_per_task"] = config["slurm"]["data_cpus"]
