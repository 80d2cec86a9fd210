"""Evaluate: prove the per-pair probe outputs are the frozen probe, score them, paired bootstrap.

    python -m stages.evaluate --params params.yaml \
        --probe-manifest results/probe/probe_manifest.json \
        --probe-token-manifest results/tokens/probe_token_manifest.json \
        --dpo-step0 results/train_dpo/probe_step0.jsonl --dpo-final results/train_dpo/probe_final.jsonl \
        --rm-step0 results/train_rm/probe_step0.jsonl --rm-final results/train_rm/probe_final.jsonl \
        --metrics-dpo metrics/dpo.json --metrics-rm metrics/rm.json \
        --bootstrap results/evaluate/bootstrap_summary.json --log logs/evaluate.log

Nothing is scored until every per-pair file is shown to be the frozen probe: the configured size,
the manifest's pair IDs in the manifest's order, and the tokenize record's token hash for every pair.
A different probe (a foreign pair, a reordering, a pair tokenized/truncated differently, 511 pairs)
fails with a message saying which, because comparing step 0 and final (or two commits) on
different pairs would be a silently wrong result. Probe pairs that tokenize truncated (`keep_end`,
`truncate_completion`) are listed in the token manifest's `truncated` record; each entry must name a
probe pair at its position, in order, with the token hash that is scored, and the counts by reason are
reported in the bootstrap summary (`probe_truncated`).

Per model and checkpoint (step 0, final): accuracy with ties counted as 0.5 (and the tie count), mean
margin; for DPO `accuracy` is the implicit reward accuracy (chosen_reward > rejected_reward), and
`logp_accuracy` (policy prefers chosen by raw summed log-prob) is reported beside it. The implicit reward is
the one dpo.loss declares (stages/engine/dpo_losses.py; docs/DPO_LOSSES.md "probe reward"), which train_dpo
writes into each probe row: beta * (policy - ref) summed over the completion, or, for the length-normalized
losses, divided by the completion's token count (rows with `implicit_reward: mean_logp` and the two counts,
checked against --probe-tokens when given); step 0 and final must score the same one, and metrics/dpo.json
records it when it is not the summed one. `correct` is recomputed from the scores; a file whose `correct`
disagrees is refused.

Paired bootstrap, FP64: one `Generator(PCG64(seed)).integers(0, n, (replicates, n))` index matrix
(the exact draw `scipy.stats.bootstrap(..., paired=True)` makes), applied to step 0 and final alike;
percentile intervals for the final accuracy and the improvement final - step0. The summary records
seed, numpy version, replicate count and the sha256 of the index matrix so a rerun proves it drew the
same replicates.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from stages.lib.contracts import (PROBE_MANIFEST_SCHEMA, PROBE_TOKEN_MANIFEST_SCHEMA, ContractError, check_shape,
                                  token_hash, token_hash_problem)
from stages.lib import record_formats
from stages.lib.cli import stage_main
from stages.lib.implicit_reward import SUMMED_REWARD
from stages.lib.io import read_json, read_jsonl, read_parquet, sha256_file, write_json
from stages.lib.params import ParamsError
from stages.lib.declared_params import load_stage_params
from stages.evidence.scoring import PerPairFileError, ProbeMismatchError, check_manifests, evaluate_model


def _probe_token_facts(probe_tokens_path: str | Path) -> tuple[dict[str, tuple[str, str]], dict[str, tuple[int, int]]]:
    """(pair_id -> (token_hash as recorded, token_hash with chosen and rejected exchanged), pair_id -> (chosen,
    rejected) completion token counts). The recorded hashes are first recomputed from the ids: a swap is named
    from them, so they must be the ids' own."""
    table = read_parquet(probe_tokens_path)
    if (problem := token_hash_problem(table, str(probe_tokens_path))) is not None:
        raise ProbeMismatchError(problem)
    table = table.to_pylist()
    swapped = {r["pair_id"]: (r["token_hash"], token_hash(r["rejected_ids"], r["rejected_prompt_len"],
                                                         r["chosen_ids"], r["chosen_prompt_len"]))
               for r in table}
    counts = {r["pair_id"]: (len(r["chosen_ids"]) - r["chosen_prompt_len"],
                             len(r["rejected_ids"]) - r["rejected_prompt_len"]) for r in table}
    return swapped, counts


def _read_manifest(path: str, schema: dict, what: str) -> dict:
    try:
        return check_shape(read_json(path), schema, what, path)
    except ContractError as e:
        raise ProbeMismatchError(str(e)) from None


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------

def _truncation_counts(token_manifest: dict) -> dict:
    by_reason: dict[str, int] = {}
    for t in token_manifest.get("truncated", []):
        by_reason[t["reason"]] = by_reason.get(t["reason"], 0) + 1
    return {"pairs": sum(by_reason.values()), "by_reason": dict(sorted(by_reason.items()))}


def _arguments(ap) -> None:
    ap.add_argument("--probe-manifest", required=True)
    ap.add_argument("--probe-token-manifest", required=True)
    ap.add_argument("--probe-tokens", help="optional probe_tokens.parquet: names a chosen/rejected swap precisely")
    ap.add_argument("--dpo-step0", required=True)
    ap.add_argument("--dpo-final", required=True)
    ap.add_argument("--rm-step0", required=True)
    ap.add_argument("--rm-final", required=True)
    ap.add_argument("--metrics-dpo", required=True)
    ap.add_argument("--metrics-rm", required=True)
    ap.add_argument("--bootstrap", required=True, help="full bootstrap summary (artifact)")


def _run(args) -> int:
    log = logging.getLogger("evaluate")
    params = load_stage_params(args.params, "evaluate")
    probe_manifest = _read_manifest(args.probe_manifest, PROBE_MANIFEST_SCHEMA, "probe manifest")
    token_manifest = _read_manifest(args.probe_token_manifest, PROBE_TOKEN_MANIFEST_SCHEMA, "probe token manifest")
    check_manifests(probe_manifest, token_manifest, params["probe"]["size"])
    swapped, counts = _probe_token_facts(args.probe_tokens) if args.probe_tokens else (None, None)
    truncated = _truncation_counts(token_manifest)
    if truncated["pairs"]:
        log.info("probe: %d of %d pairs were truncated by tokenize %s (scored as truncated; listed in %s)",
                 truncated["pairs"], len(probe_manifest["pair_ids"]), truncated["by_reason"],
                 args.probe_token_manifest)

    inputs = {"probe_manifest": args.probe_manifest, "probe_token_manifest": args.probe_token_manifest,
              "dpo_step0": args.dpo_step0, "dpo_final": args.dpo_final,
              "rm_step0": args.rm_step0, "rm_final": args.rm_final}
    models = {}
    for kind, s0_path, f_path, out_path in (("dpo", args.dpo_step0, args.dpo_final, args.metrics_dpo),
                                           ("rm", args.rm_step0, args.rm_final, args.metrics_rm)):
        metrics, summary = evaluate_model(kind, read_jsonl(s0_path), read_jsonl(f_path), probe_manifest,
                                          token_manifest, params, s0_path, f_path, swapped, completion_tokens=counts)
        models[kind] = (metrics, summary, out_path)
        if metrics["implicit_reward"] not in (None, SUMMED_REWARD):
            log.info("%s: scored on the %s implicit reward the probe rows declare (dpo.loss's own)", kind,
                     metrics["implicit_reward"])
        log.info("%s: accuracy step0 %.4f -> final %.4f [%.4f, %.4f], improvement %.4f [%.4f, %.4f]", kind,
                 metrics["step0"]["accuracy"], metrics["final"]["accuracy"], metrics["final"]["accuracy_ci_low"],
                 metrics["final"]["accuracy_ci_high"], metrics["improvement"]["accuracy"],
                 metrics["improvement"]["accuracy_ci_low"], metrics["improvement"]["accuracy_ci_high"])

    ev = params["evaluate"]
    bootstrap_summary = {
        "format": record_formats.BOOTSTRAP_SUMMARY,
        "method": "paired percentile bootstrap (scipy.stats.bootstrap paired=True, method='percentile')",
        "replicates": ev["bootstrap_replicates"],
        "seed": ev["seed"],
        "confidence": ev["confidence"],
        "generator": "numpy.random.Generator(numpy.random.PCG64(seed)).integers(0, n, (replicates, n))",
        "numpy_version": np.__version__,
        "dtype": "float64",
        "probe_digest": probe_manifest["probe_digest"],
        "token_digest": token_manifest.get("token_digest"),
        # How many of the scored probe pairs tokenize truncated, by reason (per pair: the token manifest).
        "probe_truncated": _truncation_counts(token_manifest),
        # Content hashes only: the summary is packed into the evidence bundle, which holds no paths.
        "inputs_sha256": {name: sha256_file(p) for name, p in sorted(inputs.items())},
        "models": {kind: s for kind, (_, s, _) in models.items()},
    }
    for kind, (metrics, _, out_path) in models.items():
        write_json(out_path, metrics)
    write_json(args.bootstrap, bootstrap_summary)
    log.info("bootstrap: %d replicates, seed %d, index matrix sha256 %s", ev["bootstrap_replicates"], ev["seed"],
             models["dpo"][1]["bootstrap"]["index_matrix"]["sha256"])
    return 0


def main(argv: list[str] | None = None) -> int:
    # A refusal is one line naming the file/row and the failed check, not a traceback; nothing was written.
    return stage_main(argv, "evaluate", __doc__, add_arguments=_arguments, run=_run,
                      input_errors=(ProbeMismatchError, PerPairFileError, ParamsError))


if __name__ == "__main__":
    raise SystemExit(main())
