# Training stages, launched by torchrun: one process per GPU (nccl), or train.cpu_procs processes
# on CPU (gloo) when train.gpus is 0, on each of slurm.nodes Slurm nodes (workflow/launch.py).
# The reference is read only through its verified identity.
# Checkpoints (train.save_every) go to checkpoints/<stage>/, NOT a declared output: Snakemake and DVC
# delete outputs before rerunning a rule, and a rerun after a crash must find them (--resume auto
# resumes only a checkpoint of this exact run: same params, data, reference, world size). A completed
# run leaves its last checkpoints there (train.keep_checkpoints of them); delete the folder to reclaim disk.

import os

from launch import torchrun_launch, train_resources
from stages.data.sft_sources import resolve_sft_source_files
from stages.lib.stage_plan import reference_identity, uses_sft

TRAIN = config["train"]
NPROC = TRAIN["gpus"] if TRAIN["gpus"] > 0 else TRAIN["cpu_procs"]
SLURM = config["slurm"]
# One node: `torchrun --standalone --nproc-per-node NPROC` (unchanged); slurm.nodes > 1: srun + c10d
# rendezvous inside one Slurm allocation (workflow/launch.py). A `cli_` param: it shows in dvc.yaml's cmd.
LAUNCH = torchrun_launch(NPROC, nodes=SLURM["nodes"], rdzv_port=SLURM["rdzv_port"])
TRAIN_RESOURCES = train_resources(TRAIN["gpus"], NPROC, TRAIN["cpu_threads"], SLURM)
TOKENS = rules.tokenize.output
# Reference-free DPO never reads reference log-probs, so it does not wait for (or rerun with) them.
USES_REF_LOGPS = uses_ref_logps(config)


# The reference of every stage below: the sft stage's pinned export when params `sft` is set, else verify_ref's.
USES_SFT = uses_sft(config)
REF_IDENTITY = reference_identity(config)
SFT = config.get("sft") or {}
SFT_SOURCES = SFT.get("sources")


rule sft:
    input:
        environment=ENV_RECORD,
        identity=rules.verify_ref.output.identity,
        # Preferred-FT (sft.sources null) trains on the train split's chosen completions as tokenize wrote them;
        # sources of its own are read here, probe prompts refused against the frozen probe.
        train_tokens=TOKENS.train_tokens if SFT_SOURCES is None else [],
        probe_tokens=TOKENS.probe_tokens,
        probe=rules.freeze_probe.output.probe if SFT_SOURCES is not None else [],
        sources=[data_location(f) for _, files in resolve_sft_source_files(SFT_SOURCES) for f in files]
        if SFT_SOURCES
        else [],
        chat_template=CHAT_TEMPLATE_FILE,
        code=code_deps("stages.sft"),
        defaults=defaults_input("sft"),
    output:
        model=directory(OUT["sft"]["model"]),
        identity=OUT["sft"]["identity"],
        data_report=OUT["sft"]["data_report"],
        plots_train_log=OUT["sft"]["plots_train_log"],
        live=directory(OUT["sft"]["live"]),
        run_info=OUT["sft"]["run_info"],
        probe_step0=OUT["sft"]["probe_step0"],
        probe_final=OUT["sft"]["probe_final"],
    params:
        cli_launch=LAUNCH,
        **rule_params(config, "sft"),
        cli_out_dir=lambda w, output: os.path.dirname(output.run_info),
        cli_data=lambda w, input: (f"--train-tokens {input.train_tokens}" if SFT_SOURCES is None
                                   else f"--probe {input.probe}"),
    resources:
        **TRAIN_RESOURCES,
    conda:
        "../envs/pipeline.yaml"
    log:
        main=f"{LOGS}/sft.log",
        # Timings, throughput, memory: they vary run to run, so they stay out of the hashed record.
        perf=f"{LOGS}/sft.perf.json",
    benchmark:
        f"{LOGS}/benchmarks/sft.tsv"
    shell:
        "{params.cli_launch} -m stages.sft -- --params params.yaml"
        " --identity {input.identity} {params.cli_data} --probe-tokens {input.probe_tokens}"
        " --out-dir {params.cli_out_dir} --checkpoint-dir checkpoints/sft"
        " --environment {input.environment} --log {log.main} --perf {log.perf}"
        " --live-dir {output.live}"


rule ref_logps:
    input:
        environment=ENV_RECORD,
        train_tokens=TOKENS.train_tokens,
        probe_tokens=TOKENS.probe_tokens,
        dev_tokens=DEV_TOKENS,
        identity=REF_IDENTITY,
        code=code_deps("stages.ref_logps"),
    output:
        ref_logps=OUT["ref_logps"]["ref_logps"],
    params:
        cli_launch=LAUNCH,
        # Only the knobs that change reference log-probs: a new learning rate must not recompute them.
        **rule_params(config, "ref_logps"),
        cli_dev=CLI_DEV_TOKENS,
    resources:
        **TRAIN_RESOURCES,
    conda:
        "../envs/pipeline.yaml"
    log:
        main=f"{LOGS}/ref_logps.log",
        # Timings, throughput, memory: they vary run to run, so they stay out of the hashed record.
        perf=f"{LOGS}/ref_logps.perf.json",
    benchmark:
        f"{LOGS}/benchmarks/ref_logps.tsv"
    shell:
        # cli_launch (workflow/launch.py): one node = torchrun --standalone, a private rendezvous on a free local
        # port, so concurrent torchrun jobs never collide; several = srun + c10d inside a Slurm allocation.
        # `--` keeps torchrun from reading our flags (`--log` is an ambiguous prefix of its --log-dir).
        "{params.cli_launch} -m stages.ref_logps -- --params params.yaml"
        " --identity {input.identity}"
        " --train-tokens {input.train_tokens} --probe-tokens {input.probe_tokens}"
        " --out {output.ref_logps} --environment {input.environment} --log {log.main}"
        " --perf {log.perf}{params.cli_dev}"


rule train_dpo:
    input:
        environment=ENV_RECORD,
        train_tokens=TOKENS.train_tokens,
        probe_tokens=TOKENS.probe_tokens,
        identity=REF_IDENTITY,
        ref_logps=rules.ref_logps.output.ref_logps if USES_REF_LOGPS else [],
        dev_tokens=DEV_TOKENS,
        chat_template=CHAT_TEMPLATE_FILE,
        code=code_deps("stages.train_dpo"),
        defaults=defaults_input("train_dpo"),
    output:
        model=directory(OUT["train_dpo"]["model"]),
        plots_train_log=OUT["train_dpo"]["plots_train_log"],
        live=directory(OUT["train_dpo"]["live"]),
        run_info=OUT["train_dpo"]["run_info"],
        probe_step0=OUT["train_dpo"]["probe_step0"],
        probe_final=OUT["train_dpo"]["probe_final"],
        **DEV_OUT["train_dpo"],
    params:
        cli_launch=LAUNCH,
        **rule_params(config, "train_dpo"),
        cli_dev=CLI_DEV_TOKENS,
        cli_out_dir=lambda w, output: os.path.dirname(output.run_info),
        cli_ref_logps=lambda w, input: f"--ref-logps {input.ref_logps}" if USES_REF_LOGPS else "",
    resources:
        **TRAIN_RESOURCES,
    conda:
        "../envs/pipeline.yaml"
    log:
        main=f"{LOGS}/train_dpo.log",
        # Timings, throughput, memory: they vary run to run, so they stay out of the hashed record.
        perf=f"{LOGS}/train_dpo.perf.json",
    benchmark:
        f"{LOGS}/benchmarks/train_dpo.tsv"
    shell:
        "{params.cli_launch} -m stages.train_dpo -- --params params.yaml"
        " --identity {input.identity} --train-tokens {input.train_tokens} --probe-tokens {input.probe_tokens}"
        " {params.cli_ref_logps} --out-dir {params.cli_out_dir} --checkpoint-dir checkpoints/train_dpo"
        " --environment {input.environment} --log {log.main} --perf {log.perf}{params.cli_dev}"
        " --live-dir {output.live}"


rule train_rm:
    input:
        environment=ENV_RECORD,
        train_tokens=TOKENS.train_tokens,
        probe_tokens=TOKENS.probe_tokens,
        identity=REF_IDENTITY,
        dev_tokens=DEV_TOKENS,
        chat_template=CHAT_TEMPLATE_FILE,
        code=code_deps("stages.train_rm"),
        defaults=defaults_input("train_rm"),
    output:
        model=directory(OUT["train_rm"]["model"]),
        plots_train_log=OUT["train_rm"]["plots_train_log"],
        live=directory(OUT["train_rm"]["live"]),
        run_info=OUT["train_rm"]["run_info"],
        probe_step0=OUT["train_rm"]["probe_step0"],
        probe_final=OUT["train_rm"]["probe_final"],
        **DEV_OUT["train_rm"],
    params:
        cli_launch=LAUNCH,
        **rule_params(config, "train_rm"),
        cli_dev=CLI_DEV_TOKENS,
        cli_out_dir=lambda w, output: os.path.dirname(output.run_info),
    resources:
        **TRAIN_RESOURCES,
    conda:
        "../envs/pipeline.yaml"
    log:
        main=f"{LOGS}/train_rm.log",
        # Timings, throughput, memory: they vary run to run, so they stay out of the hashed record.
        perf=f"{LOGS}/train_rm.perf.json",
    benchmark:
        f"{LOGS}/benchmarks/train_rm.tsv"
    shell:
        "{params.cli_launch} -m stages.train_rm -- --params params.yaml"
        " --identity {input.identity} --train-tokens {input.train_tokens} --probe-tokens {input.probe_tokens}"
        " --out-dir {params.cli_out_dir} --checkpoint-dir checkpoints/train_rm"
        " --environment {input.environment} --log {log.main} --perf {log.perf}{params.cli_dev}"
        " --live-dir {output.live}"
