"""generate: the policy and the reference each write completions of every probe prompt, from the same seed.

    python -m stages.generate --params params.yaml --identity results/ref/ref_identity.json \\
        --policy-model results/train_dpo/model | --policy-identity results/verify_policy/policy_identity.json \\
        --probe results/probe/probe.parquet --probe-tokens results/tokens/probe_tokens.parquet \\
        --generations results/generate/generations.parquet --info results/generate/generation_info.json \\
        --environment results/env/environment.json --log logs/generate.log --perf logs/generate.perf.json

Prompts: each probe pair's prompt tokens as tokenize made them (its chosen branch's first chosen_prompt_len ids,
the generation prompt of a chat template included, truncated as tokenize truncated it), in probe order. Each of
the two models writes `generation.n` completions of each (stages/engine/generation.py: batched, KV-cached; greedy
at temperature 0, else sampled from counter-based streams of (seed, pair_id, sample, step), the same for both
models). A completion stops at an EOS id (the tokenizer's, config.json's, generation_config.json's), at the
rendering's end-of-turn token (the special token a rendered assistant turn closes with, when not an EOS), or
after max_new_tokens; each row records its tokens and why it stopped.

Then both models score every completion of both (training's inference pass, temperature 1): `policy_logp` and
`reference_logp` are the summed log-probs of a row's generated tokens (its stop token included) under each; the
judge stage turns the policy rows' difference into the KL estimate.

Refused before anything is generated: a policy whose tokenizer differs from the reference's (the two must give
every id the same token; named both, with the first difference), a prompt + max_new_tokens beyond a model's
positions, a probe token file that is not the frozen probe's. Deterministic: on CPU the same bytes for any
batch_size (stages/engine/generation.py, batch invariance); on GPU the record names the kernels, as training's.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from stages.data.limits import TokenizeError
from stages.data.pair_tokenizer import pair_tokenizer_for, turn_closing
from stages.data.tokenizer import check_same_vocabulary, load_tokenizer, special_token_strings, vocabulary_digest
from stages.engine import startup
from stages.engine.cli import engine_stage_main, model_vocab_size, stage_environment
from stages.engine.dist import init_distributed, shutdown_distributed
from stages.engine.generation import (GenerationError, GenerationSettings, StopTokens, generate,
                                      inference_dtype, is_adapter_dir, load_policy_lm, score_pairs, sequence_pairs,
                                      stop_tokens_of)
from stages.engine.modeling import ModelLoadError, SequenceLogProbs, USED_BACKENDS
from stages.engine.packing import load_token_pairs
from stages.engine.settings import TrainSettings
from stages.lib.cli import exit_after_success
from stages.lib.contracts import GENERATION_SIDES as SIDES, GENERATIONS_SCHEMA, STOP_REASONS, ContractError
from stages.lib import record_formats
from stages.lib.io import MEASUREMENT, canonical_json, read_parquet, write_json, write_parquet
from stages.lib.declared_params import load_stage_params
from stages.lib.reference import load_verified_dir, pinned_model_record

log = logging.getLogger("generate")

def stop_tokens(model_dirs: list[Path], tokenizer, closing: list[int]) -> StopTokens:
    specials = {tokenizer.convert_tokens_to_ids(t) for t in special_token_strings(tokenizer)}
    return stop_tokens_of(model_dirs, tokenizer, closing, specials)


def prompt_key(pair_id: str) -> int:
    """A prompt's random stream: from its pair_id (content-addressed), so not from its position."""
    return int(pair_id[:8], 16)


def model_record(kind: str, model_dir: Path, identity_path: str | None) -> dict:
    """What generation_info.json says of a model: trained here (its export's path in the DAG) or pinned."""
    pin = {"model": str(model_dir)} if identity_path is None else pinned_model_record(identity_path)
    return {"kind": kind, **pin, "adapter": is_adapter_dir(model_dir)}


def _arguments(parser) -> None:
    parser.add_argument("--identity", required=True, help="the reference's ref_identity.json (verify_ref)")
    policy = parser.add_mutually_exclusive_group(required=True)
    policy.add_argument("--policy-model", help="the policy's directory (train_dpo's export)")
    policy.add_argument("--policy-identity", help="a pinned policy's identity (verify_ref verify --pin "
                        "generation.policy)")
    parser.add_argument("--probe", required=True, help="probe.parquet (the prompts' messages, for display)")
    parser.add_argument("--probe-tokens", required=True, help="probe_tokens.parquet (the prompts' tokens)")
    parser.add_argument("--generations", required=True)
    parser.add_argument("--info", required=True, help="generation_info.json")
    parser.add_argument("--environment", help="environment.json: refuse to run in another environment")
    parser.add_argument("--perf", help="timings and throughput (JSON; not a hashed output)")


def _run(args) -> None:
    startup.CLOCK.reset()
    params = load_stage_params(args.params, "generate")
    settings = TrainSettings.for_inference(params)
    gen = GenerationSettings.from_params(params["generation"])
    env = init_distributed(settings)
    try:
        record = stage_environment(args, settings)
        ref_dir = Path(load_verified_dir(args.identity))
        policy_dir = Path(args.policy_model) if args.policy_model else Path(load_verified_dir(args.policy_identity))
        tokenizer = load_tokenizer(ref_dir)
        check_same_vocabulary(tokenizer, load_tokenizer(policy_dir), "policy", policy_dir, ref_dir)
        probe = load_token_pairs(args.probe_tokens, model_vocab_size(ref_dir))
        messages = _prompt_messages(args.probe, probe.pair_ids)
        prompts = [probe.seq_ids[2 * i][:int(probe.seq_prompt_lens[2 * i])] for i in range(len(probe))]
        closing = turn_closing(pair_tokenizer_for(tokenizer, params.get("tokenize")))
        stop = stop_tokens([ref_dir, policy_dir], tokenizer, closing)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop.eos[0]
        keys = [prompt_key(p) for p in probe.pair_ids]
        dtype = inference_dtype(env.device)
        models, runs, perf = {}, {}, {}
        for side, model_dir in (("reference", ref_dir), ("policy", policy_dir)):
            t0 = time.perf_counter()
            models[side] = load_policy_lm(model_dir, ref_dir, env.device, dtype)
            loaded = time.perf_counter()
            runs[side] = generate(models[side], prompts, keys, gen, stop, pad, env.device,
                                  cuda_graphs=settings.cuda_graphs > 0 and env.device.type == "cuda")
            _sync(env.device)
            perf[side] = _throughput(side, runs[side], time.perf_counter() - loaded, loaded - t0)
        scores = _score(models, runs, prompts, env, settings)
        if env.is_main:
            rows = _rows(probe.pair_ids, messages, prompts, runs, scores, tokenizer)
            write_parquet(args.generations, pa.Table.from_pylist(rows, schema=GENERATIONS_SCHEMA))
            info = _info(params, gen, stop, closing, tokenizer, runs, record, ref_dir, policy_dir, args)
            write_json(args.info, info)
            for side in SIDES:
                log.info("%s: %d completions, stop reasons %s", side, len(runs[side].completions),
                         info["stop_reasons"][side])
            log.info("wrote %s (%d rows) and %s", args.generations, len(rows), args.info)
            if args.perf:
                write_json(args.perf, perf)
    finally:
        shutdown_distributed()



def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompt_messages(probe_path: str, pair_ids: list[str]) -> list[str]:
    """Each probe pair's prompt messages as canonical JSON, in the token file's order (which must be the probe's)."""
    table = read_parquet(probe_path)
    by_id = dict(zip(table.column("pair_id").to_pylist(), table.column("prompt").to_pylist()))
    missing = [p for p in pair_ids if p not in by_id]
    if missing or len(by_id) != len(pair_ids):
        raise ContractError(f"{probe_path}: not the probe the token file was made from ({len(by_id)} pairs, "
                            f"{len(missing)} of the token file's {len(pair_ids)} missing, e.g. {missing[:1]})")
    return [canonical_json(by_id[p]) for p in pair_ids]


def _throughput(side: str, run, seconds: float, load_seconds: float) -> dict:
    tokens = sum(len(c.tokens) for c in run.completions)
    out = {"completions": len(run.completions), "generated_tokens": tokens, "seconds": round(seconds, 3),
           "load_seconds": round(load_seconds, 3), "completions_per_s": round(len(run.completions) / seconds, 2),
           "tokens_per_s": round(tokens / seconds, 1), "batches": run.batches, "cuda_graphs": run.cuda_graphs,
           "decode_attention": run.decode_attention}
    log.info("%s: %d completions, %d tokens in %.2f s: %.1f completions/s, %.0f tokens/s", side,
             len(run.completions), tokens, seconds, out["completions_per_s"], out["tokens_per_s"], extra=MEASUREMENT)
    if run.decode_attention not in ("kernel", "matmul: not CUDA"):     # the kernel refused on this GPU: slower
        log.warning("%s: decode attention ran as %s", side, run.decode_attention, extra=MEASUREMENT)
    return out


def _score(models: dict, runs: dict, prompts: list, env, settings) -> dict[str, np.ndarray]:
    """{model: [items, 2]}: each model's summed log-probs of (the policy's completion, the reference's) of every
    (prompt, sample) item."""
    items = runs["policy"].completions
    full = {side: [np.concatenate([prompts[c.prompt], c.tokens]) for c in runs[side].completions] for side in SIDES}
    pairs = sequence_pairs("generations", full["policy"], full["reference"], [len(prompts[c.prompt]) for c in items])
    return {side: score_pairs(SequenceLogProbs(models[side], settings.logp_chunk_tokens), pairs, env, settings)
            for side in SIDES}


def _rows(pair_ids, messages, prompts, runs, scores, tokenizer) -> list[dict]:
    rows = []
    for k, pol in enumerate(runs["policy"].completions):
        for j, side in enumerate(SIDES):
            c = runs[side].completions[k]
            assert (c.prompt, c.sample) == (pol.prompt, pol.sample)
            rows.append({"pair_id": pair_ids[c.prompt], "index": c.prompt, "sample": c.sample, "side": side,
                         "prompt": messages[c.prompt], "prompt_ids": [int(t) for t in prompts[c.prompt]],
                         "tokens": c.tokens, "n_tokens": len(c.tokens), "stop_reason": c.stop_reason,
                         "text": tokenizer.decode(c.content, skip_special_tokens=False,
                                                  clean_up_tokenization_spaces=False),
                         "policy_logp": float(scores["policy"][k, j]), "reference_logp": float(scores["reference"][k, j])})
    return rows


def _info(params, gen, stop, closing, tokenizer, runs, record, ref_dir, policy_dir, args) -> dict:
    pinned = params["generation"]["policy"] != "trained"
    return {
        "format": record_formats.GENERATION_INFO,
        # The sampling knobs the engine ran with (generate's rule reruns it for each): the grader and the judge
        # decide nothing here, and a record naming them would go stale when they change.
        "settings": {k: params["generation"][k] for k in GenerationSettings.KNOBS},
        "policy": model_record("pinned" if pinned else "trained", policy_dir, args.policy_identity),
        "reference": model_record("reference", ref_dir, args.identity),
        "vocabulary_digest": vocabulary_digest(tokenizer),
        "stop": {"eos": list(stop.eos), "end_of_turn": stop.end_of_turn, "turn_closing": closing},
        "stop_reasons": {side: {r: sum(c.stop_reason == r for c in runs[side].completions)
                                for r in STOP_REASONS} for side in SIDES},
        "cache_length": runs["policy"].cache_length,
        "attention": sorted(USED_BACKENDS),
        "cuda_graphs": {side: runs[side].cuda_graphs for side in SIDES},
        "environment": record,
    }


def main(argv: list[str] | None = None) -> None:
    return engine_stage_main(argv, "generate", __doc__.split("\n")[0], _arguments, _run,
                             input_errors=(GenerationError, ModelLoadError, ContractError, TokenizeError))


if __name__ == "__main__":
    main()
    exit_after_success()
