"""round_pairs: a DPO round's pairs from its policy's own samples, labeled by the judge (issue 36).

    python -m stages.round_pairs --params params.yaml --round 2 --identity results/sft/ref_identity.json \\
        --policy-model results/train_dpo/model --judge-model results/train_rm/model \\
        --train-tokens results/tokens/train_tokens.parquet \\
        --pairs results/rounds/2/train_tokens.parquet --rejections results/rounds/2/pair_rejections.parquet \\
        --report results/rounds/2/pairs_report.json --environment results/env/environment.json \\
        --log logs/rounds/2/round_pairs.log --perf logs/rounds/2/round_pairs.perf.json

Round k (>= 2) trains on pairs the round k-1 policy (--policy-model) writes: the distinct prompts of the train split
(their tokens as tokenize made them; `rounds.prompts` a content-addressed subset; freeze_probe keeps every probe
prompt out of train), `rounds.n` samples each at `rounds.temperature` / `rounds.top_p`, generation.max_new_tokens and
generation.batch_size (stages/engine/generation.py: batched, KV-cached, the counter-based streams of a seed derived
from rounds.seed and k, so each round draws afresh and a rerun draws the same). The judge (--judge-model, train_rm's
export, or a pinned one) scores every sample as the judge stage does (prompt + content + the turn's closing, read at
the last non-pad token). stages/evidence/rounds.py makes the pairs (best vs worst above rounds.min_margin) and a
rejection with a reason code for every other prompt.

Outputs: --pairs (TOKENS_SCHEMA, what ref_logps and train_dpo read), --rejections (one row per prompt without a pair),
--report (pairs_report: counts by reason, stop reasons, mean margin; the round's settings).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from stages.data.limits import TokenizeError
from stages.data.pair_tokenizer import pair_tokenizer_for, turn_closing
from stages.data.tokenizer import check_same_vocabulary, load_tokenizer, special_token_strings
from stages.engine import startup
from stages.engine.cli import engine_stage_main, model_vocab_size, stage_environment
from stages.engine.dist import init_distributed, shutdown_distributed
from stages.engine.generation import (GenerationError, GenerationSettings, generate, inference_dtype, load_judge,
                                      load_policy_lm, score_pairs, sequence_pairs, stop_tokens_of)
from stages.engine.modeling import ModelLoadError, SequenceRewards
from stages.engine.packing import load_token_pairs
from stages.engine.settings import TrainSettings
from stages.lib.cli import exit_after_success
from stages.lib.contracts import ContractError
from stages.lib.graders import GraderError, grade, grader_spec
from stages.lib import record_formats
from stages.lib.io import MEASUREMENT, read_parquet, sha256_json, write_json, write_parquet
from stages.lib.declared_params import load_stage_params
from stages.lib.reference import load_verified_dir
from stages.evidence.rounds import (RoundPairsError, Sample, build_round_pairs, pairs_report, pairs_table, prompt_id,
                                    rejections_table, sample_sequence, select_prompts, unique_prompts)

log = logging.getLogger("round_pairs")


def round_generation_settings(params: dict, k: int) -> GenerationSettings:
    """The round's sampling: rounds.n / temperature / top_p, generation's max_new_tokens and batch_size (the probe's
    completions and the round's samples end alike), no top_k, no repetition penalty; the seed derived from
    rounds.seed and k (each round its own draws)."""
    r, g = params["rounds"], params["generation"]
    seed = int(sha256_json({"rounds.seed": r["seed"], "round": k})[:15], 16)
    return GenerationSettings(max_new_tokens=g["max_new_tokens"], temperature=float(r["temperature"]),
                              top_p=float(r["top_p"]), seed=seed, n=int(r["n"]), batch_size=g["batch_size"])


def judge_items(prompts: list[list[int]], seqs: list[list[int]], n: int) -> tuple[list, list, list, list[tuple]]:
    """The samples as pairs of one prompt for the judge's pass (its packing shares a pair's prompt): (s0, s1), (s2,
    s3), ... of each prompt, an odd last sample paired with itself. Returns first, second, prompt lens and, per
    pair, the two (item, item) positions its two rewards belong to."""
    first, second, lens, where = [], [], [], []
    for i, p in enumerate(prompts):
        items = list(range(i * n, (i + 1) * n))
        for a in range(0, n, 2):
            x, y = items[a], items[min(a + 1, n - 1)]
            first.append(np.asarray(seqs[x], np.int64))
            second.append(np.asarray(seqs[y], np.int64))
            lens.append(len(p))
            where.append((x, y))
    return first, second, lens, where


def prompt_messages(train, table, path: str) -> dict[tuple, list[dict]]:
    """prompt tokens -> the prompt's messages (the grader reads the question), from the train split's rows by
    pair_id."""
    by_id = dict(zip(table.column("pair_id").to_pylist(), table.column("prompt").to_pylist()))
    out = {}
    for i, pid in enumerate(train.pair_ids):
        if pid not in by_id:
            raise RoundPairsError(f"{path}: train token pair {pid} (row {i}) is not in the train split")
        out.setdefault(tuple(int(t) for t in train.seq_ids[2 * i][:int(train.seq_prompt_lens[2 * i])]), by_id[pid])
    return out


def grader_rewards(spec: dict, prompts: list[list[dict]], texts: list[str]) -> np.ndarray:
    """rounds.judge grader: a sample's reward is 1 when the grader passes it, else 0 (best vs worst: a success
    against a failure; a prompt whose samples all grade alike is a tie)."""
    return np.array([float(grade(spec, p, t).success) for p, t in zip(prompts, texts)], np.float64)


def _arguments(parser) -> None:
    parser.add_argument("--round", type=int, required=True, help="k >= 2: the round these pairs train")
    parser.add_argument("--identity", required=True, help="the reference's ref_identity.json (its tokenizer)")
    parser.add_argument("--policy-model", required=True, help="the previous round's policy export")
    judge = parser.add_mutually_exclusive_group()
    judge.add_argument("--judge-model", help="the judge's directory (train_rm's export); rounds.judge trained")
    judge.add_argument("--judge-identity", help="a pinned judge's identity (verify_judge); rounds.judge trained")
    parser.add_argument("--train-tokens", required=True, help="tokenize's train_tokens.parquet (the prompts)")
    parser.add_argument("--train", help="freeze_probe's train.parquet (the prompts' messages): needed when "
                        "rounds.judge is grader")
    parser.add_argument("--pairs", required=True, help="the round's token pairs (TOKENS_SCHEMA)")
    parser.add_argument("--rejections", required=True, help="one row per prompt without a pair, with its reason")
    parser.add_argument("--report", required=True, help="pairs_report.json")
    parser.add_argument("--environment", help="environment.json: refuse to run in another environment")
    parser.add_argument("--perf", help="timings and throughput (JSON; not a hashed output)")


def _run(args) -> None:
    startup.CLOCK.reset()
    if args.round < 2:
        raise RoundPairsError(f"--round {args.round}: round 1 trains on the data's pairs; round_pairs makes round >= 2's")
    params = load_stage_params(args.params, "round_pairs")
    if params.get("rounds") is None:
        raise RoundPairsError(f"{args.params}: no `rounds` section (dpo.rounds > 1 needs one)")
    settings = TrainSettings.for_inference(params)
    gen = round_generation_settings(params, args.round)
    max_length = params["tokenize"]["max_length"]
    env = init_distributed(settings)
    try:
        stage_environment(args, settings)
        ref_dir = Path(load_verified_dir(args.identity))
        policy_dir = Path(args.policy_model)
        tokenizer = load_tokenizer(ref_dir)
        check_same_vocabulary(tokenizer, load_tokenizer(policy_dir), "policy", policy_dir, ref_dir)
        judge_dir = None
        if params["rounds"].get("judge", "trained") == "trained":
            if not (args.judge_model or args.judge_identity):
                raise RoundPairsError("rounds.judge is trained: --judge-model or --judge-identity is required")
            judge_dir = Path(args.judge_model) if args.judge_model else Path(load_verified_dir(args.judge_identity))
            check_same_vocabulary(tokenizer, load_tokenizer(judge_dir), "judge", judge_dir, ref_dir)
        train = load_token_pairs(args.train_tokens, model_vocab_size(ref_dir))
        prompts = unique_prompts(train.seq_ids[0::2], [int(x) for x in train.seq_prompt_lens[0::2]])
        prompts = select_prompts(prompts, params["rounds"]["prompts"])
        labeler = params["rounds"].get("judge", "trained")
        if labeler == "grader":
            spec = grader_spec(params["generation"].get("grader"))
            if spec is None:
                raise RoundPairsError("rounds.judge is grader but generation.grader is null")
            if not args.train:
                raise RoundPairsError("rounds.judge is grader: --train (the prompts' messages) is required")
            messages = prompt_messages(train, read_parquet(args.train), args.train)
        closing = turn_closing(pair_tokenizer_for(tokenizer, params.get("tokenize")))
        specials = {tokenizer.convert_tokens_to_ids(t) for t in special_token_strings(tokenizer)}
        stop = stop_tokens_of([ref_dir, policy_dir], tokenizer, closing, specials)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop.eos[0]
        dtype = inference_dtype(env.device)
        t0 = time.perf_counter()
        policy = load_policy_lm(policy_dir, ref_dir, env.device, dtype)
        run = generate(policy, [np.asarray(p, np.int64) for p in prompts], [int(prompt_id(p)[:8], 16) for p in prompts],
                       gen, stop, pad, env.device,
                       cuda_graphs=settings.cuda_graphs > 0 and env.device.type == "cuda")
        del policy
        t_gen = time.perf_counter() - t0
        seqs = [sample_sequence(prompts[c.prompt], Sample(tuple(c.tokens), c.stop_reason, 0.0), closing)
                for c in run.completions]
        if labeler == "grader":
            texts = [tokenizer.decode(c.content,
                                      skip_special_tokens=False, clean_up_tokenization_spaces=False)
                     for c in run.completions]
            item_reward = grader_rewards(spec, [messages[tuple(prompts[c.prompt])] for c in run.completions], texts)
        else:
            judge = load_judge(judge_dir, ref_dir, env.device, dtype)
            first, second, lens, where = judge_items(prompts, seqs, gen.n)
            rewards = score_pairs(SequenceRewards(judge), sequence_pairs(
                "round samples", first, second, lens, pad_token_id=judge.config.pad_token_id), env, settings)
            item_reward = np.full(len(seqs), np.nan)
            for (x, y), (rx, ry) in zip(where, rewards):
                item_reward[x], item_reward[y] = rx, ry
        t_judge = time.perf_counter() - t0 - t_gen
        samples = [[Sample(tuple(c.tokens), c.stop_reason, float(item_reward[i * gen.n + s]))
                    for s, c in enumerate(run.completions[i * gen.n:(i + 1) * gen.n])] for i in range(len(prompts))]
        rows, rejections = build_round_pairs(prompts, samples, closing, float(params["rounds"]["min_margin"]),
                                             max_length, source=f"round {args.round} samples")
        if not rows:
            raise RoundPairsError(f"round {args.round}: no prompt gave a pair ({len(rejections)} rejected: "
                                  f"{pairs_report(rows, rejections, samples)['rejected']}); raise rounds.n or "
                                  "rounds.temperature, or lower rounds.min_margin")
        if env.is_main:
            write_parquet(args.pairs, pairs_table(rows))
            write_parquet(args.rejections, rejections_table(rejections))
            report = {"format": record_formats.ROUND_PAIRS_REPORT, "round": args.round, **pairs_report(rows, rejections, samples),
                      "settings": {"n": gen.n, "temperature": gen.temperature, "top_p": gen.top_p,
                                   "max_new_tokens": gen.max_new_tokens, "seed": gen.seed,
                                   "min_margin": params["rounds"]["min_margin"], "prompts": params["rounds"]["prompts"],
                                   "max_length": max_length},
                      "policy": str(policy_dir), "judge": "grader" if labeler == "grader" else str(judge_dir)}
            write_json(args.report, report)
            log.info("round %d: %d prompts x %d samples -> %d pairs, rejected %s; stop reasons %s", args.round,
                     report["prompts"], gen.n, report["pairs"], report["rejected"], report["stop_reasons"])
            log.info("sampling %.2f s, judging %.2f s", t_gen, t_judge, extra=MEASUREMENT)
            if args.perf:
                write_json(args.perf, {"sampling_seconds": round(t_gen, 3), "judging_seconds": round(t_judge, 3),
                                       "samples": len(seqs),
                                       "generated_tokens": sum(len(c.tokens) for c in run.completions)})
    finally:
        shutdown_distributed()


def main(argv: list[str] | None = None) -> None:
    return engine_stage_main(argv, "round_pairs", __doc__.split("\n")[0], _arguments, _run,
                             input_errors=(GenerationError, ModelLoadError, ContractError, TokenizeError,
                                           RoundPairsError, GraderError))


if __name__ == "__main__":
    main()
    exit_after_success()
