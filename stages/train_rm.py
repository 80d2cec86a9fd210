"""train_rm: pairwise (Bradley-Terry) reward model = causal-LM body + scalar head, packed and data-parallel.

    torchrun --nproc-per-node N -m stages.train_rm -- --params params.yaml --identity results/ref/ref_identity.json \\
        --train-tokens results/tokens/train_tokens.parquet --probe-tokens results/tokens/probe_tokens.parquet \\
        --out-dir results/train_rm \\
        --checkpoint-dir checkpoints/train_rm [--resume auto|never|PATH] \\
        --environment results/env/environment.json --log logs/train_rm.log --perf logs/train_rm.perf.json

The body starts from the verified reference directory, the scalar `score` head from the seeded RNG.
Writes OUT_DIR/{model/ (AutoModelForSequenceClassification, num_labels=1), train_log.csv, run_info.json,
probe_step0.jsonl, probe_final.jsonl}, with --live-dir DIR DVCLive's step metrics there, and with --dev-tokens (probe.dev_size > 0) dev_log.csv (train_dpo's doc). The reward is read, in training, probes and the export alike, at each
sequence's last token whose id != pad_token_id: the token HF's sequence-classification pooling reads
(docs/ARTIFACTS.md, "Reward scoring position").
"""
from __future__ import annotations

from stages.data.limits import TokenizeError
from stages.data.pair_tokenizer import export_template_files
from stages.engine.reward_objective import RewardObjective
from stages.lib.cli import exit_after_success
from stages.lib.declared_params import load_stage_params
from stages.engine.cli import (add_checkpoint_args, add_common_args, add_dev_args, add_logger_args, checkpoint_options,
                               dev_settings, engine_stage_main, load_dev_tokens, load_stage_tokens, logger_dirs,
                               resolve_model_dir, stage_environment)
from stages.engine.dist import init_distributed, shutdown_distributed
from stages.engine.export import ExportError
from stages.engine.loop import train
from stages.engine.modeling import ModelLoadError
from stages.engine import startup
from stages.engine.settings import TrainSettings


def _arguments(parser) -> None:
    add_common_args(parser)
    add_dev_args(parser)
    parser.add_argument("--out-dir", required=True)
    add_checkpoint_args(parser)
    add_logger_args(parser)


def _run(args) -> dict:
    startup.CLOCK.reset()
    startup.mark("imports")                            # process start to here: interpreter, torch, the engine
    params = load_stage_params(args.params, "train_rm")
    settings = dev_settings(TrainSettings.from_params(params), args.dev_tokens)  # refuses temperature != 1 first
    env = init_distributed(settings)
    startup.mark("process_group")
    try:
        environment = stage_environment(args, settings)
        startup.mark("environment")
        model_dir = resolve_model_dir(args)
        train_pairs, probe_pairs = load_stage_tokens(model_dir, args.train_tokens, args.probe_tokens)
        dev_pairs = load_dev_tokens(model_dir, args.dev_tokens)
        startup.mark("tokens")
        objective = RewardObjective(params["rm"], train_pairs.margins, source=str(args.train_tokens))
        return train(objective, settings, env, model_dir=model_dir, train_pairs=train_pairs,
                     probe_pairs=probe_pairs, dev_pairs=dev_pairs, out_dir=args.out_dir,
                     checkpoint=checkpoint_options(args, env),
                     environment=environment, perf_path=args.perf,
                     export_files=export_template_files(model_dir, params.get("tokenize")), **logger_dirs(args))
    finally:
        shutdown_distributed()


def main(argv: list[str] | None = None) -> dict:
    return engine_stage_main(argv, "train_rm", __doc__.split("\n")[0], _arguments, _run,
                             input_errors=(ModelLoadError, ExportError, TokenizeError))


if __name__ == "__main__":
    main()
    exit_after_success()     # skip torch/CUDA/NCCL teardown (stages/lib/cli.py)
