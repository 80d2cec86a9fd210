"""ref_logps: the frozen reference's summed completion log-probs for every train and probe pair, once.

    torchrun --nproc-per-node N -m stages.ref_logps -- --params params.yaml --identity results/ref/ref_identity.json \\
        --train-tokens results/tokens/train_tokens.parquet --probe-tokens results/tokens/probe_tokens.parquet \\
        --out results/ref_logps/ref_logps.parquet --environment results/env/environment.json \\
        --log logs/ref_logps.log --perf logs/ref_logps.perf.json

Columns: pair_id, split (train|probe, and dev with --dev-tokens: probe.dev_size > 0), ref_chosen_logp, ref_rejected_logp (float64, temperature 1),
token_hash (of the token row scored, so DPO training refuses log-probs of stale tokens); the footer carries a digest
of the values (stages/lib/ref_logps_table.py write_ref_logps), checked where train_dpo reads them.
Packing, prompt sharing, chunking, precision and compile follow params `train` exactly as train_dpo's probe pass
does, so the policy's step-0 probe log-probs reproduce these and every step-0 pair ties.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from stages.lib.io import MEASUREMENT, write_json
from stages.engine.modeling import ModelLoadError, SequenceLogProbs, load_causal_lm
from stages.lib.ref_logps_table import ref_logps_table, write_ref_logps
from stages.lib.cli import exit_after_success
from stages.lib.declared_params import load_stage_params
from stages.engine.cli import (add_common_args, add_dev_args, engine_stage_main, load_dev_tokens, load_stage_tokens,
                               resolve_model_dir, stage_environment)
from stages.engine.data import run_inference
from stages.engine.dist import compute_dtype, disable_dropout, init_distributed, shutdown_distributed
from stages.engine import startup
from stages.engine.settings import TrainSettings

log = logging.getLogger("ref_logps")


def _arguments(parser) -> None:
    add_common_args(parser)
    add_dev_args(parser)
    parser.add_argument("--out", required=True, help="ref_logps.parquet")


def _run(args) -> None:
    startup.CLOCK.reset()
    startup.mark("imports")                            # process start to here: interpreter, torch, the engine
    params = load_stage_params(args.params, "ref_logps")
    settings = TrainSettings.for_inference(params)       # refuses temperature != 1 before anything is built
    env = init_distributed(settings)
    startup.mark("process_group")
    try:
        stage_environment(args, settings)
        startup.mark("environment")
        model_dir = resolve_model_dir(args)
        train_pairs, probe_pairs = load_stage_tokens(model_dir, args.train_tokens, args.probe_tokens)
        dev_pairs = load_dev_tokens(model_dir, args.dev_tokens)     # probe.dev_size > 0 only
        startup.mark("tokens")
        # Loaded in fp32 (on the GPU directly when there is one) and cast there: the same values, buffers
        # included, as the policy's fp32 load and cast, so every step-0 pair ties exactly.
        reference = SequenceLogProbs(load_causal_lm(model_dir, device=env.device),
                                     chunk_tokens=settings.logp_chunk_tokens, compile_chunks=settings.compile)
        disable_dropout(reference)
        # The same weights dtype as the policy's step-0 probe pass, so every step-0 pair ties exactly.
        reference.requires_grad_(False).to(env.device, dtype=compute_dtype(settings))
        if settings.parallel == "fsdp2":      # shard a reference too large to replicate
            from stages.engine.dist import wrap_model
            reference = wrap_model(reference, reference.lm, settings, env)
        startup.mark("model_load")
        splits, perf = {}, {}
        # The probe split first: like train_dpo's step-0 probe pass before its timed loop, it takes the
        # process's first-use costs (CUDA kernel loading, GEMM heuristics, allocator growth), so the train
        # split's logged pass time is the reference pass itself. The table keeps train, then probe rows.
        dev = [("dev", dev_pairs)] if dev_pairs is not None else []
        for split, pairs in (("probe", probe_pairs), ("train", train_pairs), *dev):
            t0 = time.perf_counter()
            logps = run_inference(reference, pairs, env, settings, desc=f"ref_logps {split}")
            seconds = time.perf_counter() - t0      # run_inference ends with a host read: the GPU is done
            splits[split] = (split, pairs, logps)
            if env.is_main:
                tokens = int(pairs.pair_tokens.sum())
                log.info("%s: %d pairs, %d completion tokens, %d tokens", split, len(pairs),
                         pairs.completion_tokens, tokens)
                log.info("%s: pass %.3f s, %.0f tokens/s", split, seconds, tokens / max(seconds, 1e-9),
                         extra=MEASUREMENT)
                perf[split] = {"pass_seconds": round(seconds, 3), "tokens": tokens,
                               "tokens_per_s": round(tokens / max(seconds, 1e-9), 1)}
        if env.is_main:
            # A dev split's rows after the probe's (a table without one is as it was).
            write_ref_logps(Path(args.out), ref_logps_table([splits["train"], splits["probe"],
                                                             *([splits["dev"]] if dev else [])]))
            log.info("wrote %s", args.out)
            if args.perf:
                # Process start to the first pass, by phase (stages/engine/startup.py).
                write_json(args.perf, {**perf, "startup": startup.CLOCK.record()})
    finally:
        shutdown_distributed()


def main(argv: list[str] | None = None) -> None:
    return engine_stage_main(argv, "ref_logps", __doc__.split("\n")[0], _arguments, _run,
                             input_errors=(ModelLoadError,))


if __name__ == "__main__":
    main()
    exit_after_success()     # skip torch/CUDA/NCCL teardown (stages/lib/cli.py)
