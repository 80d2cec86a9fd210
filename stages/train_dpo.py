"""train_dpo: DPO (frozen reference via precomputed log-probs) or reference-free DPO, packed and data-parallel.

    torchrun --nproc-per-node N -m stages.train_dpo -- --params params.yaml --identity results/ref/ref_identity.json \\
        --train-tokens results/tokens/train_tokens.parquet --probe-tokens results/tokens/probe_tokens.parquet \\
        --ref-logps results/ref_logps/ref_logps.parquet --out-dir results/train_dpo \\
        --checkpoint-dir checkpoints/train_dpo [--resume auto|never|PATH] \\
        --environment results/env/environment.json --log logs/train_dpo.log --perf logs/train_dpo.perf.json

The policy starts from the verified reference directory; the reference model itself is never loaded
(its log-probs come from the ref_logps stage). dpo.objective: dpo_ref_free never reads --ref-logps.
--init-model DIR (an iterative DPO round k >= 2, issue 36): the policy starts from DIR instead (the previous round's
export), trained with `rounds.train`'s keys over `train`'s; the checkpoints' run identity names DIR's digest beside
the reference's, so a resume never takes another round's state.
Writes OUT_DIR/{model/, train_log.csv, run_info.json, probe_step0.jsonl, probe_final.jsonl}, with --live-dir DIR
DVCLive's step metrics there (the rule's OUT_DIR/dvclive: stages/engine/live_log.py), and with --dev-tokens
(probe.dev_size > 0) OUT_DIR/dev_log.csv: the dev split scored at step 0, every train.eval_every steps and at the end
(train.select_best: the best of those steps is exported). A round k >= 2 scores no dev split.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from stages.data.limits import TokenizeError
from stages.data.pair_tokenizer import export_template_files
from stages.data.tokenizer import check_same_vocabulary, load_tokenizer
from stages.engine.checkpoint import directory_digest
from stages.engine.dpo_losses import DPOLossError, check_dpo_params, loss_hints
from stages.engine.dpo_objective import DPOObjective
from stages.lib.ref_logps_table import RefLogpsError, read_ref_logps, ref_logps_for
from stages.lib.cli import exit_after_success
from stages.lib.declared_params import load_stage_params
from stages.engine.cli import (add_checkpoint_args, add_common_args, add_dev_args, add_logger_args,
                               checkpoint_options, dev_settings, engine_stage_main, load_dev_tokens, load_stage_tokens,
                               logger_dirs, resolve_model_dir, stage_environment)
from stages.engine.dist import init_distributed, shutdown_distributed
from stages.engine.export import ExportError
from stages.engine.loop import train
from stages.engine.modeling import ModelLoadError
from stages.engine import startup
from stages.engine.settings import TrainConfigError, TrainSettings


def _arguments(parser) -> None:
    add_common_args(parser)
    add_dev_args(parser)
    parser.add_argument("--ref-logps", help="ref_logps.parquet (required for dpo.objective: dpo)")
    parser.add_argument("--out-dir", required=True)
    add_checkpoint_args(parser)
    add_logger_args(parser)
    parser.add_argument("--init-model", help="start the policy from this export (an iterative round's previous "
                        "policy) instead of the reference; `rounds.train` applies")


def round_train_params(params: dict) -> dict:
    """`train` as a round after the first trains it (`rounds.train`'s keys over `train`'s), the one section
    TrainSettings reads."""
    rounds = params.get("rounds")       # (not `or {}`: truth-testing the params view reads all of `rounds`)
    overrides = (rounds.get("train") if rounds is not None else None) or {}
    return {"train": {**params["train"], **overrides}}


def _run(args) -> dict:
    startup.CLOCK.reset()
    startup.mark("imports")                            # process start to here: interpreter, torch, the engine
    # A round after the first (--init-model) also reads `rounds.train`: its own declaration.
    params = load_stage_params(args.params, "round_train_dpo" if args.init_model else "train_dpo")
    # refuses temperature != 1 before anything is built
    settings = dev_settings(TrainSettings.from_params(round_train_params(params) if args.init_model else params),
                            args.dev_tokens, rounds=bool(args.init_model))
    dpo = params["dpo"]
    check_dpo_params(dpo)                               # refuse an impossible loss setting before anything is built
    if dpo["objective"] == "dpo" and not args.ref_logps:
        raise TrainConfigError("dpo.objective is dpo: --ref-logps is required (run the ref_logps stage)")
    env = init_distributed(settings)
    startup.mark("process_group")
    try:
        log = logging.getLogger("train_dpo")
        if env.is_main:
            for hint in loss_hints(dpo):                # a setting far from the loss's paper, said before the run
                log.warning("%s", hint)
        environment = stage_environment(args, settings)
        startup.mark("environment")
        model_dir = resolve_model_dir(args)
        start_dir = model_dir
        if args.init_model:
            start_dir = Path(args.init_model)
            check_same_vocabulary(load_tokenizer(model_dir), load_tokenizer(start_dir), "--init-model", start_dir,
                                  model_dir)
        train_pairs, probe_pairs = load_stage_tokens(model_dir, args.train_tokens, args.probe_tokens)
        dev_pairs = load_dev_tokens(model_dir, args.dev_tokens)
        ref = None
        if dpo["objective"] == "dpo":
            table = read_ref_logps(args.ref_logps)
            ref = {"train": ref_logps_for(table, "train", train_pairs, args.ref_logps),
                   "probe": ref_logps_for(table, "probe", probe_pairs, args.ref_logps),
                   **({"dev": ref_logps_for(table, "dev", dev_pairs, args.ref_logps)} if dev_pairs is not None
                      else {})}
        elif args.ref_logps:
            log.info("dpo_ref_free: --ref-logps %s is not read", args.ref_logps)
        startup.mark("tokens")                         # (and the reference log-probs)
        checkpoint = checkpoint_options(args, env)
        if args.init_model and checkpoint.reference is not None:
            checkpoint = replace(checkpoint, reference={**checkpoint.reference,
                                                        "init_model": directory_digest(start_dir)})
        return train(DPOObjective(dpo, ref), settings, env, model_dir=start_dir, train_pairs=train_pairs,
                     probe_pairs=probe_pairs, dev_pairs=dev_pairs, out_dir=args.out_dir, checkpoint=checkpoint,
                     environment=environment, perf_path=args.perf, export_files=export_template_files(model_dir, params.get("tokenize")),
                     **logger_dirs(args))
    finally:
        shutdown_distributed()


def main(argv: list[str] | None = None) -> dict:
    return engine_stage_main(argv, "train_dpo", __doc__.split("\n")[0], _arguments, _run,
                             input_errors=(RefLogpsError, DPOLossError, ModelLoadError, ExportError, TokenizeError))


if __name__ == "__main__":
    main()
    exit_after_success()     # skip torch/CUDA/NCCL teardown (stages/lib/cli.py)
