"""What the engine's stage CLIs share (train_dpo, train_rm, ref_logps): the scaffold call (stages.lib.cli, with
the engine's input errors), their common arguments, checkpoint options, the environment check, the reference
directory, token loading and the progress bar.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from stages.engine.dist import DistEnv
from stages.engine.settings import TrainConfigError, TrainSettings
from stages.engine.checkpoint import CheckpointError, CheckpointOptions, reference_of
from stages.lib.cli import stage_main
from stages.lib.environment import EnvironmentMismatch, check_against_record, environment_record
from stages.lib.params import ParamsError
from stages.lib.reference import RefIdentityError
from stages.engine.packing import TokenDataError, TokenPairs

# Bad input every engine stage may meet: refused in one line, exit 1 (stages.lib.cli), never a traceback.
ENGINE_INPUT_ERRORS = (ParamsError, TrainConfigError, EnvironmentMismatch, RefIdentityError, TokenDataError,
                       CheckpointError)
LOG_HELP = "log file (rank 0): results and decisions, no timings"


def engine_stage_main(argv, name: str, description: str, add_arguments, run, input_errors=()):
    """stages.lib.cli.stage_main for an engine stage: --params (default params.yaml) and --log (rank 0) come from
    the scaffold; ENGINE_INPUT_ERRORS plus the stage's own `input_errors` are refusals (rank 0 logs the line,
    every rank exits 1). `run(args)` owns init_distributed and its `finally: shutdown_distributed()`."""
    return stage_main(argv, name, description, add_arguments=add_arguments, run=run, log_help=LOG_HELP,
                      input_errors=(*ENGINE_INPUT_ERRORS, *input_errors))


def add_common_args(parser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--identity", help="ref_identity.json from verify_ref (the model directory is re-checked)")
    source.add_argument("--model-dir", help="a model directory used as is (tests, benchmarks)")
    parser.add_argument("--train-tokens", required=True, help="train_tokens.parquet")
    parser.add_argument("--probe-tokens", required=True, help="probe_tokens.parquet (manifest order)")
    parser.add_argument("--perf", help="JSON file for timings, throughput and memory (rank 0); they vary run to run, "
                        "so they stay out of --log and the outputs")
    parser.add_argument("--environment", help="the environment stage's environment.json: refuse to run when this "
                        "process's environment differs from it")


def add_dev_args(parser) -> None:
    parser.add_argument("--dev-tokens", help="dev_tokens.parquet (probe.dev_size > 0): the dev split, scored as the "
                        "probe is (train.eval_every, train.select_best; ref_logps: split `dev` of its table)")


def load_dev_tokens(model_dir: Path, dev_path) -> TokenPairs | None:
    """The dev split's token pairs, or None without --dev-tokens."""
    if not dev_path:
        return None
    from stages.engine.packing import load_token_pairs
    return load_token_pairs(dev_path, model_vocab_size(model_dir))


def add_logger_args(parser) -> None:
    """The training stages' experiment loggers (stages/engine/live_log.py)."""
    parser.add_argument("--live-dir", help="DVCLive's folder (metrics.json, plots/metrics/*.tsv; rank 0): the rule's "
                        "results/<stage>/dvclive, a hashed output (`dvc exp show`, `dvc plots`). Default: none")
    parser.add_argument("--tensorboard-dir", help="TensorBoard's folder when train.tensorboard is true (untracked; "
                        "emptied first). Default: logs/tensorboard/<--out-dir without its leading results/>")


def logger_dirs(args) -> dict:
    """train()'s live_dir and tensorboard_dir from add_logger_args' arguments."""
    from stages.engine.live_log import default_tensorboard_dir
    return {"live_dir": Path(args.live_dir) if args.live_dir else None,
            "tensorboard_dir": Path(args.tensorboard_dir) if args.tensorboard_dir
            else default_tensorboard_dir(args.out_dir)}


def add_checkpoint_args(parser) -> None:
    parser.add_argument("--checkpoint-dir", help="periodic checkpoints (train.save_every) go here and --resume auto "
                        "looks here; keep it outside the stage's declared outputs (e.g. checkpoints/train_dpo). "
                        "Default: none, or the parent of an explicit --resume PATH")
    parser.add_argument("--resume", default="auto", metavar="auto|never|PATH",
                        help="auto (default): the newest complete checkpoint of this exact run in --checkpoint-dir, "
                        "if any; never: start fresh; PATH: that checkpoint, refused unless it matches this run")


def checkpoint_options(args, env: DistEnv) -> CheckpointOptions:
    """Call after resolve_model_dir (the identity is verified first). The reference digest is only
    computed on rank 0, which owns the run header."""
    directory = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if directory is None and args.resume not in ("auto", "never"):
        directory = Path(args.resume).parent       # an explicit resume keeps saving beside its checkpoint
    needed = env.is_main and (directory is not None or args.resume not in ("auto", "never"))
    reference = reference_of(identity_path=args.identity, model_dir=args.model_dir) if needed else None
    return CheckpointOptions(directory=directory, resume=args.resume, reference=reference)


def stage_environment(args, settings: TrainSettings) -> dict:
    """This process's environment record, checked against the DAG's (--environment) when given."""
    train_params = asdict(settings)
    if args.environment:
        return check_against_record(args.environment, train_params)
    return environment_record(train_params)


def dev_settings(settings: TrainSettings, dev_tokens, rounds: bool = False) -> TrainSettings:
    """train.eval_every / train.select_best need the dev split (--dev-tokens: probe.dev_size > 0), refused without it;
    an iterative round (k >= 2) scores none, so they are off there."""
    if rounds:
        from dataclasses import replace
        return replace(settings, eval_every=0, select_best=False)
    if not dev_tokens and (settings.eval_every or settings.select_best):
        raise TrainConfigError(f"train.eval_every {settings.eval_every} / train.select_best {settings.select_best} "
                               "score the dev split: set probe.dev_size > 0 (and pass --dev-tokens)")
    return settings


def resolve_model_dir(args) -> Path:
    if args.identity:
        from stages.lib.reference import load_verified_dir
        return Path(load_verified_dir(args.identity))
    return Path(args.model_dir)


def model_vocab_size(model_dir: Path) -> int:
    """config.json's vocab_size, read as JSON: the token check needs only this number, and AutoConfig would
    import transformers (seconds; the model load imports it anyway) before the tokens can be read. A config
    without a top-level integer vocab_size (a composite model's text_config, a default) goes through AutoConfig,
    so the number is always AutoConfig's."""
    try:
        vocab = json.loads((Path(model_dir) / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        vocab = None
    if isinstance(vocab, int) and not isinstance(vocab, bool):
        return vocab
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(model_dir).vocab_size


def load_stage_tokens(model_dir: Path, train_path, probe_path) -> tuple[TokenPairs, TokenPairs]:
    from stages.engine.packing import load_token_pairs
    vocab = model_vocab_size(model_dir)
    return load_token_pairs(train_path, vocab), load_token_pairs(probe_path, vocab)


def _progress_bar(total: int, initial: int, env: DistEnv):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, desc="train", unit="step", file=sys.stderr,
                disable=not env.is_main, mininterval=1.0)

