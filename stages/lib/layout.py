"""Where the pipeline writes each artifact, by stage: the one list of artifact paths.

The rules take their outputs from here (workflow/rules/*.smk: `OUT["normalize"]["pairs"]`), the report rule
hands those outputs to the report stage, and `report verify` requires every artifact of the run to be in a
bundle's manifest (naming the stage to rerun for one that is missing). One list, so the DAG, the bundle and
the check cannot drift apart. Keys are the rules' output names. A stage's log (logs/<stage>.log) belongs to
its rule and is no artifact.
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
            "run_info": "results/sft/run_info.json",
            "probe_step0": "results/sft/probe_step0.jsonl",
            "probe_final": "results/sft/probe_final.jsonl"},
    "ref_logps": {"ref_logps": "results/ref_logps/ref_logps.parquet"},
    **{stage: {"model": f"results/{stage}/model",                  # a directory (the HF export)
               "plots_train_log": f"results/{stage}/train_log.csv",
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

# Iterative DPO (issue 36): round k >= 2's stages, one set of rules per round (workflow/rules/rounds.smk generates
# round{k}_<stage> rules for k = 2 .. dpo.rounds, each a DVC stage of that name); "{k}" is the round. Round 1 is the
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


def n_rounds(params: dict) -> int:
    """dpo.rounds (absent = 1: offline DPO only)."""
    return int(params["dpo"].get("rounds", 1))


def round_outputs(part: str, k: int) -> dict[str, str]:
    """Round k's (>= 2) outputs of one part (ROUND_OUTPUTS' keys)."""
    if k < 2:
        raise ValueError(f"round {k}: round 1 is the offline DPO's stages (train_dpo, generate, judge)")
    return {name: path.format(k=k) for name, path in ROUND_OUTPUTS[part].items()}


def round_rule(part: str, k: int) -> str:
    return f"round{k}_{part}"


# The trained models by the label the report and evaluate give them (metrics/<label>.json, the bundle's
# curves/<label>_train_curves.png, `evaluation.<label>` of its manifest) -> the stage that trains it.
TRAINED: dict[str, str] = {"dpo": "train_dpo", "rm": "train_rm"}


def uses_ref_logps(params: dict) -> bool:
    """Only DPO with a frozen reference reads reference log-probs; `dpo_ref_free` has no ref_logps stage."""
    return params["dpo"]["objective"] == "dpo"


def uses_sft(params: dict) -> bool:
    """params `sft` set (not null, not absent): the sft stage runs, and its export is the reference."""
    return params.get("sft") is not None


def reference_identity(params: dict) -> str:
    """The identity every stage after tokenize loads the reference through: the sft stage's pinned export when SFT
    runs, else verify_ref's identity of the pinned snapshot (the tokenizer, the same in both, is verify_ref's)."""
    return STAGE_OUTPUTS["sft"]["identity"] if uses_sft(params) else STAGE_OUTPUTS["verify_ref"]["identity"]


def pinned_models(params: dict) -> list[str]:
    """The generation models params pin instead of taking them from training ("policy", "judge")."""
    return [role for role in ("policy", "judge") if isinstance(params["generation"][role], dict)]



def pinned_model_inputs(params: dict, role: str) -> dict[str, str | list[str]]:
    """verify_<role>'s inputs for a pinned model: its directory, and a local pin's lock (which changes with any
    file); empty lists when `role` is trained here."""
    if role not in pinned_models(params):
        return {"model_dir": [], "lock": []}
    pin = params["generation"][role]
    return {"model_dir": pin["local_dir"],
            "lock": [f"{pin['local_dir']}/prefpipe.lock.json"] if pin["source"] == "local" else []}

def stages(params: dict) -> list[str]:
    """The pipeline's stages under these params, in the order above."""
    optional = {"ref_logps": uses_ref_logps(params), "sft": uses_sft(params),
                **{f"verify_{role}": role in pinned_models(params) for role in ("policy", "judge")}}
    return [s for s in STAGE_OUTPUTS if optional.get(s, True)]


def bundle_artifacts(params: dict) -> dict[str, str]:
    """{path: stage} of every artifact an evidence bundle's manifest hashes: the outputs of every stage
    before report (report's own outputs are the bundle)."""
    out = {path: stage for stage in stages(params) if stage != "report"
           for path in STAGE_OUTPUTS[stage].values()}
    if n_rounds(params) > 1:       # the rounds' record, packed (summary.md's rounds table); their models stay outside
        out[ROUNDS_METRICS] = "rounds_metrics"
    return out
