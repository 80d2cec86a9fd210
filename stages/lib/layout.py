"""The stages' declarations: where each writes its artifacts, and which params.yaml keys it reads.

The rules take their outputs from here (workflow/rules/*.smk: `OUT["normalize"]["pairs"]`), the report rule
hands those outputs to the report stage, and `report verify` requires every artifact of the run to be in a
bundle's manifest (naming the stage to rerun for one that is missing). One list, so the DAG, the bundle and
the check cannot drift apart. Keys are the rules' output names. A stage's log (logs/<stage>.log) belongs to
its rule and is no artifact.

Declarations only, no logic (which stages run under given params: stages/lib/stage_plan.py). Everything here
reaches the rules as their outputs and params (workflow/rule_layout.py checks each rule against it at DAG build),
so an edit reruns exactly the stages whose outputs or params it changes; that is why workflow/code_deps.py does not
count this file as any stage's code (adding one stage's entry must not rerun the others).
"""
from __future__ import annotations

STAGE_OUTPUTS: dict[str, dict[str, str]] = {
    "environment": {"record": "results/env/environment.json"},
    "normalize": {"pairs": "results/normalize/pairs.parquet",
                  "rejections": "results/normalize/rejections.parquet",
                  "stats": "results/normalize/normalize_stats.json"},
    "freeze_probe": {"train": "results/probe/train.parquet",
                     "probe": "results/probe/probe.parquet",
                     "manifest": "results/probe/probe_manifest.json"},
    "verify_ref": {"identity": "results/ref/ref_identity.json"},
    "tokenize": {"train_tokens": "results/tokens/train_tokens.parquet",
                 "probe_tokens": "results/tokens/probe_tokens.parquet",
                 "probe_token_manifest": "results/tokens/probe_token_manifest.json",
                 "report": "results/tokens/tokenize_report.json",
                 "rejections": "results/tokens/token_rejections.parquet"},
    # Supervised fine-tuning of the reference (params `sft`; absent when null: uses_sft): its model/, pinned, is the
    # reference of every stage below (reference_identity).
    "sft": {"model": "results/sft/model",                            # a directory (the HF export, with its lock)
            "identity": "results/sft/ref_identity.json",
            "data_report": "results/sft/sft_data.json",
            "plots_train_log": "results/sft/train_log.csv",
            "live": "results/sft/dvclive",                           # a directory (DVCLive: stages/engine/live_log.py)
            "run_info": "results/sft/run_info.json",
            "probe_step0": "results/sft/probe_step0.jsonl",
            "probe_final": "results/sft/probe_final.jsonl"},
    "ref_logps": {"ref_logps": "results/ref_logps/ref_logps.parquet"},
    **{stage: {"model": f"results/{stage}/model",                  # a directory (the HF export)
               "plots_train_log": f"results/{stage}/train_log.csv",
               "live": f"results/{stage}/dvclive",                 # a directory (DVCLive's metrics.json, plots/)
               "run_info": f"results/{stage}/run_info.json",
               "probe_step0": f"results/{stage}/probe_step0.jsonl",
               "probe_final": f"results/{stage}/probe_final.jsonl"} for stage in ("train_dpo", "train_rm")},
    "evaluate": {"metrics_dpo": "metrics/dpo.json",
                 "metrics_rm": "metrics/rm.json",
                 "bootstrap": "results/evaluate/bootstrap_summary.json"},
    # A policy / judge not trained here: its pin proved as `ref`'s is (only when params pin one: pinned_models).
    "verify_policy": {"identity": "results/verify_policy/policy_identity.json"},
    "verify_judge": {"identity": "results/verify_judge/judge_identity.json"},
    "generate": {"generations": "results/generate/generations.parquet",
                 "info": "results/generate/generation_info.json"},
    "judge": {"judgments": "results/judge/judgments.jsonl",
              "metrics_generation": "metrics/generation.json",
              "summary": "results/judge/judge_summary.json"},
    "report": {"bundle": "results/report/evidence.tar.gz",
               "summary": "results/report/summary.md",
               "curves": "results/report/curves"},
}

# The dev split (probe.dev_size > 0; issue 37): outputs a stage adds to its STAGE_OUTPUTS only then (stages/lib/
# stage_plan.py stage_outputs), so a run without one declares, builds and bundles exactly what it did before.
# freeze_probe freezes it beside the probe, tokenize tokenizes it as the probe, ref_logps scores it into its table
# (split `dev`, no file of its own), the training stages score it during training (their dev curve, a dvc plot).
DEV_OUTPUTS: dict[str, dict[str, str]] = {
    "freeze_probe": {"dev": "results/probe/dev.parquet"},
    "tokenize": {"dev_tokens": "results/tokens/dev_tokens.parquet"},
    **{stage: {"plots_dev_log": f"results/{stage}/dev_log.csv"} for stage in ("train_dpo", "train_rm")},
}

# The params.yaml keys each stage reads (dotted paths; a path covers its subtree; `*` the whole file). A stage sees
# only these (stages/lib/declared_params.py: reading any other key raises, naming it), and its rule lists exactly
# these as its params (workflow/rules: `**rule_params(config, stage)`), so Snakemake and DVC rerun the stage when
# one of them changes and never otherwise. A key that decides no byte of a stage's outputs stays out (a new
# learning rate must not recompute the reference log-probs).
# The engine's no-grad passes (reference log-probs, generation, judging) read these `train` keys and no other
# (stages/engine/settings.py TrainSettings.for_inference): where they run, in which dtype and batches, sharded or not.
ENGINE_INFERENCE_KEYS = tuple(f"train.{k}" for k in (
    "gpus", "cpu_threads", "portable_numerics", "parallel", "precision", "optimizer", "inference_micro_batch_tokens",
    "logp_chunk_tokens", "temperature", "compile", "share_prompt", "cuda_graphs"))
DPO_TRAIN_KEYS = tuple(f"dpo.{k}" for k in ("objective", "loss", "loss_weights", "discopop_tau", "simpo_gamma", "beta",
                                             "label_smoothing"))
STAGE_PARAMS: dict[str, tuple[str, ...]] = {
    "environment": ("train.gpus", "train.cpu_threads", "train.portable_numerics"),
    "normalize": ("data",),
    "freeze_probe": ("probe", "tokenize.max_length", "tokenize.max_prompt_length", "tokenize.truncation",
                     "tokenize.chat_template"),
    "verify_ref": ("ref",),
    "tokenize": ("tokenize",),
    "sft": ("sft", "train", "tokenize"),
    "ref_logps": ENGINE_INFERENCE_KEYS,
    # dpo's keys but `rounds` (how many rounds run decides nothing of round 1's training).
    "train_dpo": ("train", *DPO_TRAIN_KEYS, "tokenize.chat_template"),
    "train_rm": ("train", "rm", "tokenize.chat_template"),
    "evaluate": ("evaluate", "probe.size", "dpo.beta", "dpo.objective"),
    "verify_policy": ("generation.policy",),
    "verify_judge": ("generation.judge",),
    "generate": ("generation.policy", "generation.max_new_tokens", "generation.temperature", "generation.top_p",
                 "generation.top_k", "generation.repetition_penalty", "generation.seed", "generation.n",
                 "generation.batch_size", "tokenize.chat_template", *ENGINE_INFERENCE_KEYS),
    # generation.temperature: greedy completions (0) get a log-ratio, not a KL estimate, in metrics/generation.json.
    "judge": ("generation.judge", "generation.grader", "generation.temperature", "evaluate", "tokenize.chat_template",
              *ENGINE_INFERENCE_KEYS),
    "report": ("*",),
    # The rounds' own stages (round{k}_ref_logps, _generate and _judge read as ref_logps, generate and judge do).
    "round_pairs": ("rounds.n", "rounds.temperature", "rounds.top_p", "rounds.prompts", "rounds.min_margin",
                    "rounds.judge", "rounds.seed", "generation.max_new_tokens", "generation.batch_size",
                    "generation.grader", "generation.judge", "tokenize.max_length", "tokenize.chat_template",
                    *ENGINE_INFERENCE_KEYS),
    "round_train_dpo": ("train", *DPO_TRAIN_KEYS, "tokenize.chat_template", "rounds.train"),
    "rounds_metrics": ("evaluate", "probe.size", "dpo.beta", "dpo.objective", "generation.grader"),
}

# Iterative DPO (issue 36): round k >= 2's stages, one set of rules per round (workflow/rules/rounds.smk generates
# round{k}_<part> rules for k = 2 .. dpo.rounds, each a DVC stage of that name); "{k}" is the round. Round 1 is the
# offline DPO above (train_dpo, generate, judge).
ROUND_OUTPUTS: dict[str, dict[str, str]] = {
    "pairs": {"pairs": "results/rounds/{k}/pairs/train_tokens.parquet",
              "rejections": "results/rounds/{k}/pairs/rejections.parquet",
              "report": "results/rounds/{k}/pairs/pairs_report.json"},
    "ref_logps": {"ref_logps": "results/rounds/{k}/ref_logps/ref_logps.parquet"},
    "train_dpo": {"model": "results/rounds/{k}/train_dpo/model",
                  "train_log": "results/rounds/{k}/train_dpo/train_log.csv",
                  "run_info": "results/rounds/{k}/train_dpo/run_info.json",
                  "probe_step0": "results/rounds/{k}/train_dpo/probe_step0.jsonl",
                  "probe_final": "results/rounds/{k}/train_dpo/probe_final.jsonl"},
    "generate": {"generations": "results/rounds/{k}/generate/generations.parquet",
                 "info": "results/rounds/{k}/generate/generation_info.json"},
    "judge": {"judgments": "results/rounds/{k}/judge/judgments.jsonl",
              "generation": "results/rounds/{k}/judge/generation.json",
              "summary": "results/rounds/{k}/judge/judge_summary.json"},
}
ROUNDS_METRICS = "metrics/rounds.json"
