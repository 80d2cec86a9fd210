# Reference stages: pinned snapshot -> verified identity -> token parquet rendered by its tokenizer.


rule verify_ref:
    input:
        environment=ENV_RECORD,
        ref_dir=config["ref"]["local_dir"],
        # A directory input only changes mtime when entries come or go; the lock changes with any file.
        lock=[f"{config['ref']['local_dir']}/prefpipe.lock.json"] if config["ref"]["source"] == "local" else [],
        code=code_deps("stages.verify_ref"),
    output:
        identity=OUT["verify_ref"]["identity"],
    params:
        **rule_params(config, "verify_ref"),
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/verify_ref.log",
    benchmark:
        f"{LOGS}/benchmarks/verify_ref.tsv"
    shell:
        "python -m stages.verify_ref verify --params params.yaml --identity {output.identity} --log {log}"


rule tokenize:
    input:
        environment=ENV_RECORD,
        identity=rules.verify_ref.output.identity,
        train=rules.freeze_probe.output.train,
        probe=rules.freeze_probe.output.probe,
        manifest=rules.freeze_probe.output.manifest,
        dev=DEV_OUTPUTS["freeze_probe"]["dev"] if DEV else [],
        chat_template=CHAT_TEMPLATE_FILE,
        code=code_deps("stages.tokenize"),
    output:
        train_tokens=OUT["tokenize"]["train_tokens"],
        probe_tokens=OUT["tokenize"]["probe_tokens"],
        probe_token_manifest=OUT["tokenize"]["probe_token_manifest"],
        report=OUT["tokenize"]["report"],
        rejections=OUT["tokenize"]["rejections"],
        **DEV_OUT["tokenize"],
    params:
        **rule_params(config, "tokenize"),
        cli_dev=(f" --dev {DEV_OUTPUTS['freeze_probe']['dev']} --dev-tokens {DEV_OUTPUTS['tokenize']['dev_tokens']}"
                 if DEV else ""),
    # The stage runs tokenize.workers processes (0 = all cores); Snakemake caps threads at --cores.
    threads: config["tokenize"].get("workers") or len(os.sched_getaffinity(0)),
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/tokenize.log",
    benchmark:
        f"{LOGS}/benchmarks/tokenize.tsv"
    shell:
        "python -m stages.tokenize --params params.yaml --identity {input.identity} --train {input.train}"
        " --probe {input.probe} --probe-manifest {input.manifest} --train-tokens {output.train_tokens}"
        " --probe-tokens {output.probe_tokens} --probe-token-manifest {output.probe_token_manifest}"
        " --report {output.report} --rejections {output.rejections} --log {log}{params.cli_dev}"
