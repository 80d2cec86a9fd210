"""sft: completion-only supervised fine-tuning of the verified reference; its export becomes the reference.

    torchrun --nproc-per-node N -m stages.sft -- --params params.yaml --identity results/ref/ref_identity.json \\
        --train-tokens results/tokens/train_tokens.parquet --probe-tokens results/tokens/probe_tokens.parquet \\
        --probe results/probe/probe.parquet --out-dir results/sft --checkpoint-dir checkpoints/sft \\
        --environment results/env/environment.json --log logs/sft.log --perf logs/sft.perf.json

Data (params `sft.sources`):
  null   Preferred-FT (the DPO paper's baseline when no SFT model exists): the train split's chosen completions, as
         tokenize rendered them (results/tokens/train_tokens.parquet: the probe's pairs and prompts are not in it);
         a (prompt, completion) repeated by several pairs is trained once.
  [...]  sources of their own, as data.sources lists them ({path, format, name}), in the SFT formats (messages,
         conversations, prompt_completion, auto: stages/data/sft_sources.py), rendered and tokenized with the
         reference's tokenizer and the tokenize limits (no truncation: a row over them is refused `too_long`); a row
         whose prompt is a probe prompt is refused `probe_prompt` (the probe stays unseen), repeats `duplicate`.
Training: the engine of train_dpo and train_rm (stages/engine/loop.py; objective stages/engine/sft_objective.py):
packing, LoRA or full, DDP/FSDP2, checkpoints and exact resume, optimizer modes, under `train` with `sft.train`'s
keys over it (e.g. more epochs, another lr).
Outputs: OUT_DIR/{model/, ref_identity.json, sft_data.json, train_log.csv, run_info.json, probe_step0.jsonl,
probe_final.jsonl}, and with --live-dir DIR DVCLive's step metrics there (OUT_DIR/dvclive). model/ is pinned as a local snapshot (its prefpipe.lock.json lists every file's SHA-256 and the
`provenance`: the base reference's identity_digest, the SFT data's digest and the settings' digest); ref_identity.json
is its identity in verify_ref's format, which ref_logps, train_dpo, train_rm, generate and judge load it through
(stages/lib/reference.py load_verified_dir re-checks every file before each load).
"""
from __future__ import annotations

import logging
from pathlib import Path

from stages.data.limits import TokenizeError, TokenizeLimits
from stages.data.pair_tokenizer import export_template_files, pair_tokenizer_for
from stages.data.sft_sources import (Refusals, SFTDataError, examples_digest, probe_prompt_keys, read_sft_sources,
                                     tokenize_examples)
from stages.data.sources import SourceError
from stages.data.tokenizer import load_tokenizer
from stages.engine import startup
from stages.engine.cli import (add_logger_args, checkpoint_options, engine_stage_main, logger_dirs, model_vocab_size,
                               stage_environment)
from stages.engine.dist import init_distributed, shutdown_distributed
from stages.engine.export import ExportError
from stages.engine.loop import train
from stages.engine.modeling import ModelLoadError
from stages.engine.packing import TokenPairs, load_token_pairs
from stages.engine.settings import TrainConfigError, TrainSettings
from stages.engine.sft_objective import SFTObjective, sft_token_pairs
from stages.lib.cli import exit_after_success
from stages.lib import record_formats
from stages.lib.io import read_parquet, sha256_json, write_json
from stages.lib.declared_params import load_stage_params
from stages.lib.reference import pin_own_model, read_identity

log = logging.getLogger("sft")


DEV_KEYS = ("eval_every", "select_best")


def sft_train_params(params: dict) -> dict:
    """`train` as the sft stage runs it (`sft.train`'s keys over `train`'s), the one section TrainSettings reads."""
    overrides = (params.get("sft") or {}).get("train") or {}
    # SFT examples have no pair to score a dev split with: train.eval_every / select_best are the preference stages'.
    return {"train": {k: v for k, v in {**params["train"], **overrides}.items() if k not in DEV_KEYS}}


def sft_settings(params: dict) -> TrainSettings:
    try:
        return TrainSettings.from_params(sft_train_params(params))
    except TrainConfigError as e:
        raise TrainConfigError(f"sft.train over train: {e}") from None


def preferred_ft(train: TokenPairs, refusals: Refusals) -> tuple[list[str], list[list[int]], list[int]]:
    """The chosen branch of every train pair, in file order; a (prompt, completion) already taken is `duplicate`."""
    ids_out, seqs, plens, seen = [], [], [], set()
    for i, pid in enumerate(train.pair_ids):
        seq, n = train.seq_ids[2 * i], int(train.seq_prompt_lens[2 * i])
        key = sha256_json([seq.tolist(), n])
        if key in seen:
            refusals.add("duplicate", "train split", i, f"pair {pid}: its chosen completion repeats an earlier pair's")
            continue
        seen.add(key)
        ids_out.append(pid)
        seqs.append(seq.tolist())
        plens.append(n)
    return ids_out, seqs, plens


def probe_prompts(probe_path: str) -> set[str]:
    """The leakage keys of the probe's prompts (probe.parquet's `prompt` column: a list of messages per pair)."""
    return probe_prompt_keys(read_parquet(probe_path).column("prompt").to_pylist())


def sft_examples(params: dict, model_dir: Path, args, refusals: Refusals) -> tuple[TokenPairs, dict]:
    """The SFT examples as TokenPairs and what sft_data.json says of them (before the refusal counts)."""
    sources = (params.get("sft") or {}).get("sources")
    if sources is None:
        if not args.train_tokens:
            raise SFTDataError("sft.sources is null (Preferred-FT): --train-tokens is required")
        train = load_token_pairs(args.train_tokens, model_vocab_size(model_dir))
        ids, seqs, plens = preferred_ft(train, refusals)
        data = {"mode": "preferred_ft", "from": args.train_tokens, "rows_read": len(train), "sources": None,
                "examples_by_source": None}
    else:
        if not args.probe:
            raise SFTDataError("sft.sources is set: --probe (probe.parquet) is required to keep probe prompts out")
        examples = read_sft_sources(sources, probe_prompts(args.probe), refusals)
        limits = TokenizeLimits.from_params(params["tokenize"])
        tokenized = tokenize_examples(examples, pair_tokenizer_for(load_tokenizer(model_dir), params["tokenize"]),
                                      limits, refusals)
        ids = [ex.example_id for ex, _, _ in tokenized]
        seqs = [s for _, s, _ in tokenized]
        plens = [n for _, _, n in tokenized]
        by_source: dict[str, int] = {}
        for ex, _, _ in tokenized:
            by_source[ex.source] = by_source.get(ex.source, 0) + 1
        data = {"mode": "sources", "from": None, "rows_read": None, "sources": sources, "examples_by_source": by_source}
    if not ids:
        raise SFTDataError(f"no SFT example left to train on (refused: {refusals.record()['by_reason']})")
    digest = examples_digest(list(zip(ids, seqs, plens)))
    data |= {"examples": len(ids), "completion_tokens": int(sum(len(s) - n for s, n in zip(seqs, plens))),
             "data_digest": digest}
    return sft_token_pairs("sft examples", ids, seqs, plens), data


def _arguments(parser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--identity", help="the base reference's ref_identity.json from verify_ref (re-checked)")
    source.add_argument("--model-dir", help="a base model directory used as is (tests, benchmarks)")
    parser.add_argument("--train-tokens", help="train_tokens.parquet (Preferred-FT: sft.sources null)")
    parser.add_argument("--probe-tokens", required=True, help="probe_tokens.parquet (the probe rows at step 0 and end)")
    parser.add_argument("--probe", help="probe.parquet (sft.sources: rows with a probe prompt are refused)")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--checkpoint-dir", help="periodic checkpoints (train.save_every); e.g. checkpoints/sft")
    parser.add_argument("--resume", default="auto", metavar="auto|never|PATH")
    parser.add_argument("--perf", help="JSON file for timings (rank 0), kept out of the hashed record")
    parser.add_argument("--environment", help="environment.json: refuse to run in another environment")
    add_logger_args(parser)


def _run(args) -> dict:
    startup.CLOCK.reset()
    startup.mark("imports")
    params = load_stage_params(args.params, "sft")
    if params.get("sft") is None:
        raise SFTDataError("params sft is null: the sft stage does not run (the pinned reference is the reference)")
    settings = sft_settings(params)
    env = init_distributed(settings)
    startup.mark("process_group")
    try:
        environment = stage_environment(args, settings)
        startup.mark("environment")
        if args.identity:
            from stages.lib.reference import load_verified_dir
            model_dir = Path(load_verified_dir(args.identity))
        else:
            model_dir = Path(args.model_dir)
        refusals = Refusals()
        train_pairs, data = sft_examples(params, model_dir, args, refusals)
        probe_pairs = load_token_pairs(args.probe_tokens, model_vocab_size(model_dir))
        startup.mark("tokens")
        if env.is_main:
            log.info("SFT data (%s): %d examples, %d completion tokens; refused %s", data["mode"], data["examples"],
                     data["completion_tokens"], refusals.record()["by_reason"] or "none")
        out_dir = Path(args.out_dir)
        result = train(SFTObjective(), settings, env, model_dir=model_dir, train_pairs=train_pairs,
                       probe_pairs=probe_pairs, out_dir=out_dir, checkpoint=checkpoint_options(args, env),
                       environment=environment, perf_path=args.perf,
                       export_files=export_template_files(model_dir, params.get("tokenize")), **logger_dirs(args))
        if env.is_main:
            base = (read_identity(args.identity) if args.identity else None)
            provenance = {"stage": "sft",
                          "base": ({k: base[k] for k in ("repo_id", "revision", "identity_digest")} if base
                                   else {"model_dir": str(model_dir)}),
                          "data_digest": data["data_digest"],
                          "settings_digest": sha256_json(settings.record()),
                          "objective": SFTObjective().fingerprint()}
            repo_id = f"sft/{base['repo_id'] if base else model_dir.name}"
            identity = pin_own_model(out_dir / "model", repo_id, provenance)
            write_json(out_dir / "ref_identity.json", identity)
            write_json(out_dir / "sft_data.json", {"format": record_formats.SFT_DATA, **data, "refused": refusals.record(),
                                                   "provenance": provenance,
                                                   "identity_digest": identity["identity_digest"]})
            log.info("pinned %s as %s: identity_digest %s", out_dir / "model", repo_id, identity["identity_digest"])
        return result
    finally:
        shutdown_distributed()


def main(argv: list[str] | None = None) -> dict:
    return engine_stage_main(argv, "sft", __doc__.split("\n")[0], _arguments, _run,
                             input_errors=(SFTDataError, SourceError, ModelLoadError, ExportError, TokenizeError))


if __name__ == "__main__":
    main()
    exit_after_success()     # skip torch/CUDA/NCCL teardown (stages/lib/cli.py)
