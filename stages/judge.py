"""judge: a reward model scores the policy's and the reference's completions; win rate with bootstrap bounds.

    python -m stages.judge --params params.yaml --identity results/ref/ref_identity.json \\
        --judge-model results/train_rm/model | --judge-identity results/verify_judge/judge_identity.json \\
        --generations results/generate/generations.parquet --judgments results/judge/judgments.jsonl \\
        --metrics metrics/generation.json --summary results/judge/judge_summary.json \\
        --environment results/env/environment.json --log logs/judge.log

What the judge reads: each completion as tokenize renders a pair's branch: the prompt's tokens, the completion's
content (its generated tokens without the stop token) and the tokens that close an assistant turn
(stages/data/pair_tokenizer.py turn_closing: a chat template's end-of-turn, else the EOS tokenize appends), the
sequence shape the reward model was trained and probed on; its score is read at the last token whose id != its
pad id, as transformers' sequence classification reads it. A completion without content (the model stopped at
once) is judged as the empty turn: its reward is recorded like any other. A completion cut by max_new_tokens is
closed the same way.

Outputs: judgments.jsonl, one row per (prompt, sample) in probe order: pair_id, index, sample, prompt (messages),
policy_completion / reference_completion (text), *_length (content tokens), *_stop_reason, *_reward, win (1, 0,
or 0.5 on a tie), policy_log_ratio (the policy completion's summed log p_policy - log p_reference over its generated
tokens, stop token included, both at temperature 1) and policy_generated_tokens; metrics/generation.json and
judge_summary.json from stages/evidence/scoring.py evaluate_generation (the numbers `report verify` recomputes):
  win_rate [CI]          the mean over prompts of the policy's wins over the reference (each prompt's samples
                         averaged), percentile bootstrap over prompts with evaluate's replicates, seed, confidence;
                         policy_better in the summary = the lower bound above 0.5
  reward_diff [CI]       mean policy reward - reference reward, the same bootstrap
  length                 mean content lengths; buckets of the length ratio (policy + 1) / (reference + 1) (below
                         0.8, 0.8 to 1.25, above) with their pairs, win rate and reward difference; the reward
                         difference at equal length [CI]: the intercept of a least-squares fit of the reward
                         difference on the length difference (slope: reward_diff_per_token). A win that is only
                         length shows as a large slope and an intercept near 0.
  kl                     per_completion [CI]: the mean over the policy's completions of sum_t (log p_policy(y_t) -
                         log p_reference(y_t)) over its generated tokens: a Monte-Carlo estimate of KL(policy ||
                         reference) per completion when the completions are samples at temperature 1 with top_p
                         1; under greedy or other sampling settings the same quantity on the outputs the policy
                         actually gives (beta times it is DPO's implicit reward of them). per_token: the summed
                         log-ratio over all completions divided by their generated tokens. Only for sampled
                         completions (generation.temperature > 0): greedy ones are no sample of the policy, so the
                         same numbers are `log_ratio` instead, and summary.md shows no KL.
  grader                 (generation.grader set: stages/lib/graders.py) each row's policy_grade / reference_grade
                         ({success, labels}); policy_success, reference_success and success_diff [CI] (the same
                         bootstrap), the share of each label per side, `differing` (rows whose two completions grade
                         differently) and judge_agreement on them (the judge prefers the one that succeeds; a tie 0.5)
  warnings               why the win rate is not evidence: judge_trained_on_same_pairs, all_hit_max_new_tokens,
                         length_mismatch (mean lengths apart by more than half the longer),
                         judge_disagrees_with_grader (agreement below 0.75)

Refused before the judge is loaded: a judge that is not a sequence-classification model with one label (its
config files), a judge whose tokenizer differs from the reference's (naming both), a generations file that is not
whole (each (prompt, sample) once per side, in order, sides on the same prompt tokens).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from stages.data.limits import TokenizeError
from stages.data.pair_tokenizer import pair_tokenizer_for, turn_closing
from stages.data.tokenizer import check_same_vocabulary, load_tokenizer
from stages.engine.cli import engine_stage_main, stage_environment
from stages.engine.dist import init_distributed, shutdown_distributed
from stages.engine.generation import (GenerationError, inference_dtype, judge_head_problem, load_judge, score_pairs,
                                      sequence_pairs)
from stages.engine.modeling import ModelLoadError, SequenceRewards
from stages.engine.settings import TrainSettings
from stages.lib.cli import exit_after_success
from stages.lib.contracts import ContractError, correct_label, generation_rows
from stages.lib.io import read_parquet, write_json, write_jsonl
from stages.lib.declared_params import load_stage_params
from stages.lib.reference import load_verified_dir, pinned_model_record
from stages.lib.graders import GraderError, grade, grader_spec
from stages.evidence.scoring import PerPairFileError, evaluate_generation

log = logging.getLogger("judge")

KL_DEFINITION = ("kl.per_completion: mean over the policy's completions of sum over their generated tokens (stop "
                 "token included) of log p_policy - log p_reference, both at temperature 1; an unbiased Monte-Carlo "
                 "estimate of KL(policy || reference) per completion only when sampled at temperature 1, top_p 1. "
                 "kl.per_token: the summed log-ratio divided by the generated tokens.")


def judged_sequences(rows: list[dict], closing: list[int]) -> tuple[list[np.ndarray], list[int]]:
    """Each row's sequence as the judge reads it (prompt + content + the turn's closing) and its prompt length."""
    seqs, prompt_lens = [], []
    for r in rows:
        content = r["tokens"] if r["stop_reason"] == "max_new_tokens" else r["tokens"][:-1]
        seqs.append(np.asarray(r["prompt_ids"] + content + closing, dtype=np.int64))
        prompt_lens.append(len(r["prompt_ids"]))
    return seqs, prompt_lens


def judgment_rows(rows: list[dict], rewards: np.ndarray) -> list[dict]:
    """One judgment per (prompt, sample): the generation rows (policy, reference) and the judge's two rewards."""
    out = []
    for k in range(len(rows) // 2):
        pol, ref = rows[2 * k], rows[2 * k + 1]
        rp, rr = float(rewards[k, 0]), float(rewards[k, 1])
        row = {"pair_id": pol["pair_id"], "index": pol["index"], "sample": pol["sample"],
               "prompt": json.loads(pol["prompt"])}
        for side, g, reward in (("policy", pol, rp), ("reference", ref, rr)):
            row |= {f"{side}_completion": g["text"],
                    f"{side}_length": g["n_tokens"] - (g["stop_reason"] != "max_new_tokens"),
                    f"{side}_stop_reason": g["stop_reason"], f"{side}_reward": reward}
        row |= {"win": correct_label(rp, rr), "policy_log_ratio": pol["policy_logp"] - pol["reference_logp"],
                "policy_generated_tokens": pol["n_tokens"]}
        out.append(row)
    return out


def _arguments(parser) -> None:
    parser.add_argument("--identity", required=True, help="the reference's ref_identity.json (verify_ref)")
    judge = parser.add_mutually_exclusive_group(required=True)
    judge.add_argument("--judge-model", help="the judge's directory (train_rm's export)")
    judge.add_argument("--judge-identity", help="a pinned judge's identity (verify_ref verify --pin generation.judge)")
    parser.add_argument("--generations", required=True, help="generate's generations.parquet")
    parser.add_argument("--judgments", required=True)
    parser.add_argument("--metrics", required=True, help="metrics/generation.json")
    parser.add_argument("--summary", required=True, help="judge_summary.json")
    parser.add_argument("--environment", help="environment.json: refuse to run in another environment")


def _run(args) -> None:
    params = load_stage_params(args.params, "judge")
    settings = TrainSettings.for_inference(params)
    env = init_distributed(settings)
    try:
        stage_environment(args, settings)
        ref_dir = Path(load_verified_dir(args.identity))
        judge_dir = Path(args.judge_model) if args.judge_model else Path(load_verified_dir(args.judge_identity))
        problem = judge_head_problem(judge_dir)
        if problem is not None:
            raise GenerationError(f"judge {problem}")
        tokenizer = load_tokenizer(ref_dir)
        check_same_vocabulary(tokenizer, load_tokenizer(judge_dir), "judge", judge_dir, ref_dir)
        rows = generation_rows(read_parquet(args.generations), args.generations)
        closing = turn_closing(pair_tokenizer_for(tokenizer, params.get("tokenize")))
        seqs, prompt_lens = judged_sequences(rows, closing)
        judge = load_judge(judge_dir, ref_dir, env.device, inference_dtype(env.device))
        pairs = sequence_pairs("judged completions", seqs[0::2], seqs[1::2], prompt_lens[0::2],
                               pad_token_id=judge.config.pad_token_id)
        rewards = score_pairs(SequenceRewards(judge), pairs, env, settings)
        if env.is_main:
            judgments = judgment_rows(rows, rewards)
            spec = grader_spec(params["generation"].get("grader"))
            if spec is not None:
                for row in judgments:
                    for side in ("policy", "reference"):
                        g = grade(spec, row["prompt"], row[f"{side}_completion"])
                        row[f"{side}_grade"] = {"success": g.success, "labels": list(g.labels)}
            metrics, summary = evaluate_generation(judgments, params, args.judgments)
            record = ({"kind": "trained", "model": str(judge_dir)} if args.judge_model
                      else {"kind": "pinned", **pinned_model_record(args.judge_identity)})
            summary = {**summary, "judge": record, "turn_closing": closing,
                       "scoring": {"position": "last_token_not_pad", "pad_token_id": judge.config.pad_token_id},
                       "kl_definition": KL_DEFINITION}
            write_jsonl(args.judgments, judgments)
            write_json(args.metrics, metrics)
            write_json(args.summary, summary)
            kl = metrics.get("kl") or metrics["log_ratio"]
            log.info("win rate %.4f [%.4f, %.4f] over %d prompts x %d samples (ties %d); reward difference %.4f "
                     "[%.4f, %.4f]; at equal length %.4f; %s per completion %.4f", metrics["win_rate"],
                     metrics["win_rate_ci_low"], metrics["win_rate_ci_high"], metrics["n_prompts"],
                     metrics["samples_per_prompt"], metrics["ties"], metrics["reward_diff"],
                     metrics["reward_diff_ci_low"], metrics["reward_diff_ci_high"],
                     metrics["length"]["reward_diff_at_equal_length"], "KL" if metrics["kl"] is not None else
                     "log-ratio (greedy: not a KL)", kl["per_completion"])
            if metrics["grader"] is not None:
                g = metrics["grader"]
                log.info("grader %s: success policy %.4f [%.4f, %.4f], reference %.4f [%.4f, %.4f], difference %.4f "
                         "[%.4f, %.4f]; judge agrees on %s of %d differing completions", g["name"],
                         g["policy_success"], g["policy_success_ci_low"], g["policy_success_ci_high"],
                         g["reference_success"], g["reference_success_ci_low"], g["reference_success_ci_high"],
                         g["success_diff"], g["success_diff_ci_low"], g["success_diff_ci_high"],
                         "-" if g["judge_agreement"] is None else f"{g['judge_agreement']:.4f}", g["differing"])
            for warning in metrics["warnings"]:
                log.warning("the win rate is not evidence: %s", warning)
    finally:
        shutdown_distributed()



def main(argv: list[str] | None = None) -> None:
    return engine_stage_main(argv, "judge", __doc__.split("\n")[0], _arguments, _run,
                             input_errors=(GenerationError, ModelLoadError, ContractError, TokenizeError,
                                           PerPairFileError, GraderError))


if __name__ == "__main__":
    main()
    exit_after_success()
