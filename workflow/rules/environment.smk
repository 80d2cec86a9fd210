# The environment as an input: python, locked package versions, the CPU dispatch in force under
# train.portable_numerics, CUDA/GPU for GPU runs (stages/lib/environment.py defines the record).

from stages.lib.environment import installed_fingerprint


rule environment:
    input:
        lock=LOCK,
        code=code_deps("stages.environment"),
    output:
        record=ENV_RECORD,
    params:
        **rule_params(config, "environment"),
        # Snakemake-only rerun trigger (sync_dvc.py drops env_* params): a package upgraded outside the
        # lock reruns this rule; DVC sees only the lock file.
        env_installed=installed_fingerprint(config["train"]),
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/environment.log",
    benchmark:
        f"{LOGS}/benchmarks/environment.tsv"
    shell:
        "python -m stages.environment --params params.yaml --lock {input.lock} --out {output.record} --log {log}"
