# Data stages: raw sources -> canonical pairs -> frozen probe + train split (the probe fitting the tokenize limits).

# The data package owns the expansion of a source's glob / directory into its files: these inputs
# (and so dvc.yaml's deps, generated from them) are exactly the files normalize reads. (common.smk puts
# the repository on sys.path; the Snakefile's pre-flight has refused a source naming no data file.)
from stages.lib.io import data_location
from stages.data.sources import resolve_source_files


rule normalize:
    input:
        environment=ENV_RECORD,
        # A source outside the repository (../shared/...) by its absolute path: dvc.yaml's dep must exist from DVC's
        # experiment copy too (`dvc exp run --queue` runs in .dvc/tmp/exps/..., where ../ is elsewhere).
        sources=[data_location(f) for _, files in resolve_source_files(config["data"]["sources"]) for f in files],
        code=code_deps("stages.normalize"),
    output:
        pairs=OUT["normalize"]["pairs"],
        rejections=OUT["normalize"]["rejections"],
        stats=OUT["normalize"]["stats"],
    params:
        **rule_params(config, "normalize"),
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/normalize.log",
    benchmark:
        f"{LOGS}/benchmarks/normalize.tsv"
    shell:
        "python -m stages.normalize --params params.yaml --pairs {output.pairs}"
        " --rejections {output.rejections} --stats {output.stats} --log {log}"


# The probe is drawn from pairs that fit the tokenize limits under the reference's tokenizer (the probe is scored
# whole), so freeze_probe reads the verified identity (verify_ref, reference.smk) and the limits tokenize uses.
rule freeze_probe:
    input:
        environment=ENV_RECORD,
        pairs=rules.normalize.output.pairs,
        identity=OUT["verify_ref"]["identity"],
        chat_template=CHAT_TEMPLATE_FILE,
        code=code_deps("stages.freeze_probe"),
    output:
        train=OUT["freeze_probe"]["train"],
        probe=OUT["freeze_probe"]["probe"],
        manifest=OUT["freeze_probe"]["manifest"],
        **DEV_OUT["freeze_probe"],
    params:
        **rule_params(config, "freeze_probe"),
        cli_dev=f" --dev {DEV_OUTPUTS['freeze_probe']['dev']}" if DEV else "",
    conda:
        "../envs/pipeline.yaml"
    log:
        f"{LOGS}/freeze_probe.log",
    benchmark:
        f"{LOGS}/benchmarks/freeze_probe.tsv"
    shell:
        "python -m stages.freeze_probe --params params.yaml --pairs {input.pairs} --identity {input.identity}"
        " --train {output.train}"
        " --probe {output.probe} --manifest {output.manifest} --log {log}{params.cli_dev}"
