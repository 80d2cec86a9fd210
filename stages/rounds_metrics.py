"""rounds_metrics: metrics/rounds.json, every iterative DPO round side by side (issue 36).

    python -m stages.rounds_metrics --params params.yaml \\
        --probe-manifest results/probe/probe_manifest.json --probe-token-manifest results/tokens/probe_token_manifest.json \\
        --probe-step0 results/train_dpo/probe_step0.jsonl results/rounds/2/train_dpo/probe_step0.jsonl ... \\
        --probe-final results/train_dpo/probe_final.jsonl results/rounds/2/train_dpo/probe_final.jsonl ... \\
        --judgments results/judge/judgments.jsonl results/rounds/2/judge/judgments.jsonl ... \\
        --generation metrics/generation.json results/rounds/2/judge/generation.json ... \\
        --pairs-report results/rounds/2/pairs/pairs_report.json ... \\
        --metrics metrics/rounds.json --log logs/rounds_metrics.log

One entry per round, round 1 first (the offline DPO of train_dpo / judge); each list names the rounds in order and
--pairs-report every round after the first. Per round (stages/evidence/rounds.py rounds_record): the probe accuracy of its
train_dpo (scored as evaluate scores it, the frozen probe checked first: against the round's reference, so with
rounds.reference previous against the previous policy), the win rate against the initial reference (the round's
judge metrics), against the previous round and round 1 (the judge's rewards of the two policies' probe completions,
the same prompts and streams), graded success [CI] and its paired differences from round 1 and the previous round
(evaluate's bootstrap over the probe prompts), the KL estimate (or greedy log-ratio) to the initial reference, and the
pairs it trained on (built, rejected by reason). `improved_over_round1`: the last round's graded success above
round 1's with the lower bound of the difference above 0.
"""
from __future__ import annotations

import json
import logging

from stages.lib.cli import stage_main
from stages.lib.contracts import PROBE_MANIFEST_SCHEMA, PROBE_TOKEN_MANIFEST_SCHEMA, ContractError, check_shape
from stages.lib.io import read_json, read_jsonl, write_json
from stages.lib.declared_params import load_stage_params
from stages.lib.params import ParamsError
from stages.evidence.rounds import RoundPairsError, rounds_record
from stages.evidence.scoring import PerPairFileError, ProbeMismatchError, check_manifests, evaluate_model

log = logging.getLogger("rounds_metrics")


def _arguments(ap) -> None:
    ap.add_argument("--probe-manifest", required=True)
    ap.add_argument("--probe-token-manifest", required=True)
    for name in ("probe-step0", "probe-final", "judgments", "generation"):
        ap.add_argument(f"--{name}", nargs="+", required=True, help="one per round, round 1 first")
    ap.add_argument("--pairs-report", nargs="*", default=[], help="one per round after the first")
    ap.add_argument("--metrics", required=True, help="metrics/rounds.json")


def _run(args) -> int:
    params = load_stage_params(args.params, "rounds_metrics")
    n = len(args.judgments)
    lists = {"--probe-step0": args.probe_step0, "--probe-final": args.probe_final, "--generation": args.generation}
    for flag, paths in lists.items():
        if len(paths) != n:
            raise RoundPairsError(f"{flag}: {len(paths)} files for the {n} rounds --judgments names")
    if len(args.pairs_report) != n - 1:
        raise RoundPairsError(f"--pairs-report: {len(args.pairs_report)} files; the rounds after the first are {n - 1}")
    probe_manifest = check_shape(read_json(args.probe_manifest), PROBE_MANIFEST_SCHEMA, "probe manifest",
                                 args.probe_manifest)
    token_manifest = check_shape(read_json(args.probe_token_manifest), PROBE_TOKEN_MANIFEST_SCHEMA,
                                 "probe token manifest", args.probe_token_manifest)
    check_manifests(probe_manifest, token_manifest, params["probe"]["size"])
    rounds = []
    for k in range(n):
        dpo, _ = evaluate_model("dpo", read_jsonl(args.probe_step0[k]), read_jsonl(args.probe_final[k]), probe_manifest,
                                token_manifest, params, args.probe_step0[k], args.probe_final[k])
        with open(args.generation[k], encoding="utf-8") as f:
            generation = json.load(f)
        rounds.append({"round": k + 1, "judgments": read_jsonl(args.judgments[k]), "generation": generation,
                       "dpo": dpo, "pairs": read_json(args.pairs_report[k - 1]) if k else None})
    record = rounds_record(rounds, params["evaluate"])
    write_json(args.metrics, record)
    for r in record["rounds"]:
        g = r["graded_success"]
        d = r.get("graded_success_diff_vs_round1")
        log.info("round %d: probe accuracy %.4f, graded success %.4f [%.4f, %.4f]%s", r["round"], r["probe_accuracy"],
                 g["point"], g["ci_low"], g["ci_high"],
                 "" if d is None else f", vs round 1 {d['point']:+.4f} [{d['ci_low']:+.4f}, {d['ci_high']:+.4f}]")
    log.info("improved over round 1: %s", record["improved_over_round1"])
    return 0


def main(argv: list[str] | None = None) -> int:
    return stage_main(argv, "rounds_metrics", __doc__.split("\n")[0], add_arguments=_arguments, run=_run,
                      input_errors=(ProbeMismatchError, PerPairFileError, ParamsError, RoundPairsError, ContractError))


if __name__ == "__main__":
    raise SystemExit(main())
