# Preference evaluation by generation: the policy and the reference write completions of the probe prompts
# (generate), a judge scores both (judge) into metrics/generation.json. A policy or judge not trained here is pinned
# as `ref` is and proved by verify_policy / verify_judge (stages.verify_ref verify --pin generation.<role>); with
# both pinned, `snakemake --cores 2 judge` evaluates them without training anything (no train_* job in its DAG).

from stages.lib.stage_plan import pinned_model_inputs, pinned_models

GEN = config["generation"]
PINNED = pinned_models(config)
# One process; on GPU runs one GPU (generation is not data-parallel).
GEN_RESOURCES = train_resources(min(TRAIN["gpus"], 1), 1, TRAIN["cpu_threads"], {**SLURM, "nodes": 1})


rule verify_policy:
    input:
        environment=ENV_RECORD,
        **pinned_model_inputs(config, "policy"),
        code=code_deps("stages.verify_ref"),
    output:
        identity=OUT["verify_policy"]["identity"],
    params:
        **rule_params(config, "verify_policy"),
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/verify_policy.log",
    benchmark:
        f"{LOGS}/benchmarks/verify_policy.tsv"
    shell:
        "python -m stages.verify_ref verify --params params.yaml --pin generation.policy --identity {output.identity}"
        " --log {log}"


rule verify_judge:
    input:
        environment=ENV_RECORD,
        **pinned_model_inputs(config, "judge"),
        code=code_deps("stages.verify_ref"),
    output:
        identity=OUT["verify_judge"]["identity"],
    params:
        **rule_params(config, "verify_judge"),
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/verify_judge.log",
    benchmark:
        f"{LOGS}/benchmarks/verify_judge.tsv"
    shell:
        "python -m stages.verify_ref verify --params params.yaml --pin generation.judge --identity {output.identity}"
        " --log {log}"


rule generate:
    input:
        environment=ENV_RECORD,
        identity=REF_IDENTITY,
        policy=rules.verify_policy.output.identity if "policy" in PINNED else rules.train_dpo.output.model,
        probe=rules.freeze_probe.output.probe,
        probe_tokens=rules.tokenize.output.probe_tokens,
        chat_template=CHAT_TEMPLATE_FILE,
        code=code_deps("stages.generate"),
    output:
        generations=OUT["generate"]["generations"],
        info=OUT["generate"]["info"],
    params:
        # Every generation knob but the judge: a new judge must not generate again.
        **rule_params(config, "generate"),
        cli_policy=lambda w, input: ("--policy-identity " if "policy" in PINNED else "--policy-model ") + input.policy,
    resources:
        **GEN_RESOURCES,
    conda:
        "../envs/pipeline.yaml"
    log:
        main=f"{LOGS}/generate.log",
        # Timings and throughput (completions/s, tokens/s): they vary run to run, so no hashed output holds them.
        perf=f"{LOGS}/generate.perf.json",
    benchmark:
        f"{LOGS}/benchmarks/generate.tsv"
    shell:
        "python -m stages.generate --params params.yaml --identity {input.identity} {params.cli_policy}"
        " --probe {input.probe} --probe-tokens {input.probe_tokens}"
        " --generations {output.generations} --info {output.info}"
        " --environment {input.environment} --log {log.main} --perf {log.perf}"


rule judge:
    input:
        environment=ENV_RECORD,
        identity=REF_IDENTITY,
        judge=rules.verify_judge.output.identity if "judge" in PINNED else rules.train_rm.output.model,
        generations=rules.generate.output.generations,
        chat_template=CHAT_TEMPLATE_FILE,
        code=code_deps("stages.judge"),
    output:
        judgments=OUT["judge"]["judgments"],
        metrics_generation=OUT["judge"]["metrics_generation"],
        summary=OUT["judge"]["summary"],
    params:
        **rule_params(config, "judge"),
        cli_judge=lambda w, input: ("--judge-identity " if "judge" in PINNED else "--judge-model ") + input.judge,
    resources:
        **GEN_RESOURCES,
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/judge.log",
    benchmark:
        f"{LOGS}/benchmarks/judge.tsv"
    shell:
        "python -m stages.judge --params params.yaml --identity {input.identity} {params.cli_judge}"
        " --generations {input.generations} --judgments {output.judgments} --metrics {output.metrics_generation}"
        " --summary {output.summary} --environment {input.environment} --log {log}"
