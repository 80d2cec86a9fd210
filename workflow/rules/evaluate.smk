# Evaluation on the frozen probe, and the evidence bundle of the whole run.

from stages.lib.stage_plan import bundle_artifacts

DPO_OUT = rules.train_dpo.output
RM_OUT = rules.train_rm.output


rule evaluate:
    input:
        environment=ENV_RECORD,
        probe_manifest=rules.freeze_probe.output.manifest,
        probe_token_manifest=rules.tokenize.output.probe_token_manifest,
        probe_tokens=rules.tokenize.output.probe_tokens,
        dpo_step0=DPO_OUT.probe_step0,
        dpo_final=DPO_OUT.probe_final,
        rm_step0=RM_OUT.probe_step0,
        rm_final=RM_OUT.probe_final,
        code=code_deps("stages.evaluate"),
    output:
        metrics_dpo=OUT["evaluate"]["metrics_dpo"],
        metrics_rm=OUT["evaluate"]["metrics_rm"],
        bootstrap=OUT["evaluate"]["bootstrap"],
    params:
        **rule_params(config, "evaluate"),
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/evaluate.log",
    benchmark:
        f"{LOGS}/benchmarks/evaluate.tsv"
    shell:
        "python -m stages.evaluate --params params.yaml --probe-manifest {input.probe_manifest}"
        " --probe-token-manifest {input.probe_token_manifest} --probe-tokens {input.probe_tokens}"
        " --dpo-step0 {input.dpo_step0} --dpo-final {input.dpo_final}"
        " --rm-step0 {input.rm_step0} --rm-final {input.rm_final}"
        " --metrics-dpo {output.metrics_dpo} --metrics-rm {output.metrics_rm}"
        " --bootstrap {output.bootstrap} --log {log}"


# Every upstream artifact the bundle's manifest hashes (never packs): data, tokens, models.
# Every artifact of the stages before report (stages/lib/stage_plan.py bundle_artifacts, from the layout), but those
# the report reads in a role of its own below: a new stage's outputs reach the bundle with no edit here.
OWN_ROLES = {*(o for out in (DPO_OUT, RM_OUT) for o in (out.plots_train_log, out.run_info, out.probe_step0,
                                                       out.probe_final)),
             *rules.evaluate.output, *rules.judge.output, ENV_RECORD}
HASHED_ARTIFACTS = [path for path in bundle_artifacts(config) if path not in OWN_ROLES]


rule report:
    input:
        environment=ENV_RECORD,
        # The bundle packs params.yaml byte for byte, comments included (stages/evidence/bundle.py): its bytes are a
        # dependency, beside its values (params below). Values alone let a comment edit leave a recorded bundle that
        # no rerun reproduces (dvc status clean, a fresh clone's bundle another hash).
        params_file="params.yaml",
        artifacts=HASHED_ARTIFACTS,
        metrics=[rules.evaluate.output.metrics_dpo, rules.evaluate.output.metrics_rm],
        per_pair=[DPO_OUT.probe_step0, DPO_OUT.probe_final, RM_OUT.probe_step0, RM_OUT.probe_final],
        bootstrap=rules.evaluate.output.bootstrap,
        # The judged completions and their metrics: packed, so `verify` reruns the win-rate bootstrap from the rows.
        generation_eval=list(rules.judge.output),
        # dpo.rounds > 1: metrics/rounds.json, packed, and summary.md's rounds table (rounds.smk).
        rounds_metrics=[rules.rounds_metrics.output.metrics_rounds] if N_ROUNDS > 1 else [],
        dpo_log=DPO_OUT.plots_train_log,
        rm_log=RM_OUT.plots_train_log,
        dpo_run_info=DPO_OUT.run_info,
        rm_run_info=RM_OUT.run_info,
        probe_manifests=[rules.freeze_probe.output.manifest, rules.tokenize.output.probe_token_manifest],
        # The source files normalize read: the manifest names each by its hashes (normalize_stats.json says
        # which files each source named), so the bundle is rebuilt when a source's bytes change.
        normalize_stats=rules.normalize.output.stats,
        sources=rules.normalize.input.sources,
        # report's `verify` recomputes metrics with evidence/scoring.py (evaluate's code) and the environment with lib's.
        code=code_deps("stages.report"),
        defaults=defaults_input("report"),
    output:
        bundle=OUT["report"]["bundle"],
        summary=OUT["report"]["summary"],
        curves=directory(OUT["report"]["curves"]),
    params:
        # The bundle carries params.yaml itself, so every section is a dependency.
        **rule_params(config, "report"),
        cli_rounds=lambda w, input: f"--rounds-metrics {input.rounds_metrics}" if N_ROUNDS > 1 else "",
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/report.log",
    benchmark:
        f"{LOGS}/benchmarks/report.tsv"
    shell:
        "python -m stages.report --params params.yaml --artifacts {input.artifacts}"
        " --metrics {input.metrics} --per-pair {input.per_pair} --bootstrap-summary {input.bootstrap}"
        " --generation-eval {input.generation_eval}"
        " --train-log dpo={input.dpo_log} rm={input.rm_log}"
        " --run-info dpo={input.dpo_run_info} rm={input.rm_run_info}"
        " --environment {input.environment} --probe-manifests {input.probe_manifests}"
        " --normalize-stats {input.normalize_stats} {params.cli_rounds}"
        " --bundle {output.bundle} --summary {output.summary} --curves-dir {output.curves} --log {log}"
