# Iterative DPO (issue 36): rounds 2 .. dpo.rounds, each its own set of rules (and so its own DVC stages, named
# alike): round{k}_pairs (the round k-1 policy samples train prompts, the judge labels, best vs worst),
# round{k}_ref_logps (the round's reference: initial or the previous policy), round{k}_train_dpo (from the previous
# policy), round{k}_generate and round{k}_judge (the frozen probe, as round 1's generate/judge). One rule per round
# rather than a wildcard: a rule's name is its DVC stage's, which the integrity guard reruns by name
# (workflow/integrity.py), and raising dpo.rounds adds rules without touching the earlier rounds' (no rule below
# reads dpo.rounds). rounds_metrics writes metrics/rounds.json across every round. Paths: stages/lib/layout.py.

from round_rules import later_rounds, round_policy
from stages.lib.layout import ROUNDS_METRICS
from stages.lib.stage_plan import n_rounds, round_outputs, round_rule

N_ROUNDS = n_rounds(config)
ROUNDS = config.get("rounds") or {}
ROUND_LABELER = ROUNDS.get("judge", "trained")
if N_ROUNDS > 1 and not ROUNDS:
    refuse(f"dpo.rounds is {N_ROUNDS}: the rounds after the first need params `rounds` (n, temperature, top_p, "
           "prompts, min_margin, reference, seed; docs/PARAMS.md)")
if N_ROUNDS > 1 and not USES_REF_LOGPS:
    refuse("dpo.rounds > 1 with dpo.objective dpo_ref_free: the rounds train against a reference's log-probs "
           "(not supported yet)")



for _k in range(2, N_ROUNDS + 1):

    rule:
        name:
            round_rule("pairs", _k)
        input:
            environment=ENV_RECORD,
            identity=REF_IDENTITY,
            policy=round_policy(rules, _k),
            judge=[] if ROUND_LABELER == "grader" else
            (rules.verify_judge.output.identity if "judge" in PINNED else rules.train_rm.output.model),
            train=rules.freeze_probe.output.train if ROUND_LABELER == "grader" else [],
            train_tokens=TOKENS.train_tokens,
            code=code_deps("stages.round_pairs"),
            chat_template=CHAT_TEMPLATE_FILE,
        output:
            **round_outputs("pairs", _k),
        params:
            **rule_params(config, "round_pairs"),
            cli_round=_k,
            cli_judge=lambda w, input: ("" if ROUND_LABELER == "grader" else
                                        ("--judge-identity " if "judge" in PINNED else "--judge-model ") + input.judge)
            + (f" --train {input.train}" if ROUND_LABELER == "grader" else ""),
        resources:
            **GEN_RESOURCES,
        conda:
            "../envs/pipeline.yaml"
        benchmark:
            f"{LOGS}/benchmarks/rounds/{_k}/round_pairs.tsv"
        log:
            main=f"{LOGS}/rounds/{_k}/round_pairs.log",
            perf=f"{LOGS}/rounds/{_k}/round_pairs.perf.json",
        shell:
            "python -m stages.round_pairs --params params.yaml --round {params.cli_round} --identity {input.identity}"
            " --policy-model {input.policy} {params.cli_judge} --train-tokens {input.train_tokens}"
            " --pairs {output.pairs} --rejections {output.rejections} --report {output.report}"
            " --environment {input.environment} --log {log.main} --perf {log.perf}"

    rule:
        name:
            round_rule("ref_logps", _k)
        input:
            environment=ENV_RECORD,
            train_tokens=getattr(rules, round_rule("pairs", _k)).output.pairs,
            probe_tokens=TOKENS.probe_tokens,
            identity=REF_IDENTITY,
            # rounds.reference previous: the previous round's policy is the reference (scored as a model dir).
            reference=round_policy(rules, _k) if ROUNDS.get("reference") == "previous" else [],
            code=code_deps("stages.ref_logps"),
        output:
            **round_outputs("ref_logps", _k),
        params:
            cli_launch=LAUNCH,
            # rounds.reference decides the command (cli_reference) and the inputs, not what ref_logps reads.
            **rule_params(config, "ref_logps"),
            cli_reference=lambda w, input: (f"--model-dir {input.reference}" if ROUNDS.get("reference") == "previous"
                                            else f"--identity {input.identity}"),
        resources:
            **TRAIN_RESOURCES,
        conda:
            "../envs/pipeline.yaml"
        benchmark:
            f"{LOGS}/benchmarks/rounds/{_k}/ref_logps.tsv"
        log:
            main=f"{LOGS}/rounds/{_k}/ref_logps.log",
            perf=f"{LOGS}/rounds/{_k}/ref_logps.perf.json",
        shell:
            "{params.cli_launch} -m stages.ref_logps -- --params params.yaml {params.cli_reference}"
            " --train-tokens {input.train_tokens} --probe-tokens {input.probe_tokens}"
            " --out {output.ref_logps} --environment {input.environment} --log {log.main} --perf {log.perf}"

    rule:
        name:
            round_rule("train_dpo", _k)
        input:
            environment=ENV_RECORD,
            train_tokens=getattr(rules, round_rule("pairs", _k)).output.pairs,
            probe_tokens=TOKENS.probe_tokens,
            identity=REF_IDENTITY,
            init=round_policy(rules, _k),
            ref_logps=getattr(rules, round_rule("ref_logps", _k)).output.ref_logps,
            code=code_deps("stages.train_dpo"),
            chat_template=CHAT_TEMPLATE_FILE,
            defaults=defaults_input("round_train_dpo"),
        output:
            model=directory(round_outputs("train_dpo", _k)["model"]),
            **{n: p for n, p in round_outputs("train_dpo", _k).items() if n != "model"},
        params:
            cli_launch=LAUNCH,
            **rule_params(config, "round_train_dpo"),
            cli_out_dir=lambda w, output: os.path.dirname(output.run_info),
            cli_checkpoints=f"checkpoints/rounds/{_k}/train_dpo",
        resources:
            **TRAIN_RESOURCES,
        conda:
            "../envs/pipeline.yaml"
        benchmark:
            f"{LOGS}/benchmarks/rounds/{_k}/train_dpo.tsv"
        log:
            main=f"{LOGS}/rounds/{_k}/train_dpo.log",
            perf=f"{LOGS}/rounds/{_k}/train_dpo.perf.json",
        shell:
            "{params.cli_launch} -m stages.train_dpo -- --params params.yaml"
            " --identity {input.identity} --init-model {input.init} --train-tokens {input.train_tokens}"
            " --probe-tokens {input.probe_tokens} --ref-logps {input.ref_logps} --out-dir {params.cli_out_dir}"
            " --checkpoint-dir {params.cli_checkpoints}"
            " --environment {input.environment} --log {log.main} --perf {log.perf}"

    rule:
        name:
            round_rule("generate", _k)
        input:
            environment=ENV_RECORD,
            identity=REF_IDENTITY,
            policy=getattr(rules, round_rule("train_dpo", _k)).output.model,
            probe=rules.freeze_probe.output.probe,
            probe_tokens=rules.tokenize.output.probe_tokens,
            code=code_deps("stages.generate"),
            chat_template=CHAT_TEMPLATE_FILE,
        output:
            **round_outputs("generate", _k),
        params:
            **rule_params(config, "generate"),
        resources:
            **GEN_RESOURCES,
        conda:
            "../envs/pipeline.yaml"
        benchmark:
            f"{LOGS}/benchmarks/rounds/{_k}/generate.tsv"
        log:
            main=f"{LOGS}/rounds/{_k}/generate.log",
            perf=f"{LOGS}/rounds/{_k}/generate.perf.json",
        shell:
            "python -m stages.generate --params params.yaml --identity {input.identity} --policy-model {input.policy}"
            " --probe {input.probe} --probe-tokens {input.probe_tokens}"
            " --generations {output.generations} --info {output.info}"
            " --environment {input.environment} --log {log.main} --perf {log.perf}"

    rule:
        name:
            round_rule("judge", _k)
        input:
            environment=ENV_RECORD,
            identity=REF_IDENTITY,
            judge=rules.verify_judge.output.identity if "judge" in PINNED else rules.train_rm.output.model,
            generations=getattr(rules, round_rule("generate", _k)).output.generations,
            code=code_deps("stages.judge"),
            chat_template=CHAT_TEMPLATE_FILE,
        output:
            **round_outputs("judge", _k),
        params:
            **rule_params(config, "judge"),
            cli_judge=lambda w, input: ("--judge-identity " if "judge" in PINNED else "--judge-model ") + input.judge,
        resources:
            **GEN_RESOURCES,
        conda:
            "../envs/pipeline.yaml"
        benchmark:
            f"{LOGS}/benchmarks/rounds/{_k}/judge.tsv"
        log:
            f"{LOGS}/rounds/{_k}/judge.log",
        shell:
            "python -m stages.judge --params params.yaml --identity {input.identity} {params.cli_judge}"
            " --generations {input.generations} --judgments {output.judgments} --metrics {output.generation}"
            " --summary {output.summary} --environment {input.environment} --log {log}"


rule rounds_metrics:
    input:
        environment=ENV_RECORD,
        probe_manifest=rules.freeze_probe.output.manifest,
        probe_token_manifest=rules.tokenize.output.probe_token_manifest,
        probe_step0=[rules.train_dpo.output.probe_step0, *later_rounds(rules, "train_dpo", "probe_step0", N_ROUNDS)],
        probe_final=[rules.train_dpo.output.probe_final, *later_rounds(rules, "train_dpo", "probe_final", N_ROUNDS)],
        judgments=[rules.judge.output.judgments, *later_rounds(rules, "judge", "judgments", N_ROUNDS)],
        generation=[rules.judge.output.metrics_generation, *later_rounds(rules, "judge", "generation", N_ROUNDS)],
        pairs_report=later_rounds(rules, "pairs", "report", N_ROUNDS),
        code=code_deps("stages.rounds_metrics"),
    output:
        metrics_rounds=ROUNDS_METRICS,
    params:
        **rule_params(config, "rounds_metrics"),
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/rounds_metrics.log",
    benchmark:
        f"{LOGS}/benchmarks/rounds_metrics.tsv"
    shell:
        "python -m stages.rounds_metrics --params params.yaml --probe-manifest {input.probe_manifest}"
        " --probe-token-manifest {input.probe_token_manifest} --probe-step0 {input.probe_step0}"
        " --probe-final {input.probe_final} --judgments {input.judgments} --generation {input.generation}"
        " --pairs-report {input.pairs_report} --metrics {output.metrics_rounds} --log {log}"


if N_ROUNDS > 1:
    FINAL_TARGETS.append(ROUNDS_METRICS)
