"""Iterative DPO rounds (issue 36): pairs from the policy's own scored samples, and the record across rounds.

Round k+1 (k >= 1) trains on pairs the round-k policy wrote: `rounds.n` samples of each train prompt, scored by a
judge (the trained reward model); per prompt the best-scored sample is `chosen`, the worst `rejected`, when their
reward margin exceeds `rounds.min_margin`. Every prompt is accounted for: a pair, or a rejection with a reason code
(as normalize keeps its rejections):

    too_long   fewer than two samples are usable: a sample that hit max_new_tokens without a stop token is
               unfinished (DPO would teach the policy to ramble, and the judge scores a cut text), and one whose
               sequence (prompt + content + the turn's closing) is longer than tokenize.max_length would not be a
               pair tokenize could have made
    tie        the best and the worst usable samples score the same (identical completions included)
    margin     their reward margin is > 0 but not above rounds.min_margin

A pair's sequences are what tokenize makes of a pair and what the judge scored: the prompt's tokens (the train
pair's, as tokenize rendered them, generation prompt included), the completion's content (its generated tokens
without the stop token) and the tokens that close an assistant turn (stages/data/pair_tokenizer.py turn_closing;
the EOS tokenize appends when the rendering has no end-of-turn). Pair ids are content hashes of those tokens
(the first 24 hex, as contracts.pair_id_of cuts a content hash), so the same samples give the same ids.

`rounds_record` assembles metrics/rounds.json from each round's probe metrics, judgments and pair report.
Pure functions only (no model, no file): stages/round_pairs.py, stages/rounds_metrics.py and the report
(stages/evidence/bundle.py render_rounds_section) call them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from stages.lib import record_formats
from stages.lib.contracts import TOKENS_SCHEMA, pair_id_of, token_hash
from stages.lib.io import sha256_json
from stages.evidence.scoring import bootstrap_indices, percentile_interval

REJECT_REASONS = ("too_long", "tie", "margin")
STOPPED = ("eos", "end_of_turn")          # stop reasons of a finished completion (contracts.STOP_REASONS less the cut)

ROUND_REJECTIONS_SCHEMA = pa.schema([
    ("prompt_id", pa.string()),            # first 24 hex of the sha256 of the prompt's token ids
    ("index", pa.int64()),                 # the prompt's position in the round's prompts
    ("reason", pa.string()),
    ("detail", pa.string()),
    ("best_reward", pa.float64()),         # null when fewer than two samples were usable
    ("worst_reward", pa.float64()),
    ("usable", pa.int64()),                # samples left after the too_long filter
])


class RoundPairsError(ValueError):
    """Samples that cannot form a round's pairs (wrong count, a non-finite reward); the message names the row."""


@dataclass(frozen=True)
class Sample:
    tokens: tuple[int, ...]                # generated tokens, the stop token included when it stopped
    stop_reason: str                       # eos | end_of_turn | max_new_tokens
    reward: float                          # the judge's score of prompt + content + closing


def content_of(sample: Sample) -> list[int]:
    """The completion's content: its tokens without the stop token (a cut completion has none to drop)."""
    return list(sample.tokens) if sample.stop_reason == "max_new_tokens" else list(sample.tokens[:-1])


def sample_sequence(prompt_ids: list[int], sample: Sample, closing: list[int]) -> list[int]:
    """prompt + content + closing: the sequence the judge scores and a tokenized pair's branch holds."""
    return list(prompt_ids) + content_of(sample) + list(closing)


def prompt_id(prompt_ids: list[int]) -> str:
    return pair_id_of(sha256_json({"prompt_ids": [int(t) for t in prompt_ids]}))


def unique_prompts(chosen_ids: list[list[int]], prompt_lens: list[int]) -> list[list[int]]:
    """The distinct prompts of a token table's rows (each row's chosen branch's first prompt_len ids), in first
    appearance order: a prompt asked by several train pairs is sampled once."""
    seen, out = set(), []
    for ids, n in zip(chosen_ids, prompt_lens):
        p = tuple(int(t) for t in ids[:n])
        if p not in seen:
            seen.add(p)
            out.append(list(p))
    return out


def select_prompts(prompts: list[list[int]], limit: int | None) -> list[list[int]]:
    """rounds.prompts: null = every prompt; N = the N whose prompt_id sorts first (a content-addressed subset: the
    same prompts whatever order the train split lists them in, and a larger N keeps the smaller N's prompts)."""
    if limit is None or limit >= len(prompts):
        return prompts
    if limit < 1:
        raise RoundPairsError(f"rounds.prompts must be >= 1 or null, got {limit}")
    keep = set(sorted(range(len(prompts)), key=lambda i: prompt_id(prompts[i]))[:limit])
    return [p for i, p in enumerate(prompts) if i in keep]


def build_round_pairs(prompts: list[list[int]], samples: list[list[Sample]], closing: list[int], min_margin: float,
                      max_length: int, source: str = "samples") -> tuple[list[dict], list[dict]]:
    """(token rows as TOKENS_SCHEMA, rejections as ROUND_REJECTIONS_SCHEMA): one pair or one rejection per prompt,
    in prompt order. Best = the highest reward, worst = the lowest; among equal rewards the lowest sample index
    (deterministic)."""
    if len(samples) != len(prompts):
        raise RoundPairsError(f"{source}: {len(samples)} sample lists for {len(prompts)} prompts")
    rows, rejections = [], []
    for i, (prompt, group) in enumerate(zip(prompts, samples)):
        if len(group) < 2:
            raise RoundPairsError(f"{source} prompt {i}: {len(group)} samples; a round needs rounds.n >= 2")
        for s, smp in enumerate(group):
            if not isinstance(smp.reward, (int, float)) or not math.isfinite(smp.reward):
                raise RoundPairsError(f"{source} prompt {i} sample {s}: reward {smp.reward!r} is not a finite number")
        pid = prompt_id(prompt)
        unfinished = sum(smp.stop_reason not in STOPPED for smp in group)
        over = sum(smp.stop_reason in STOPPED and len(sample_sequence(prompt, smp, closing)) > max_length
                   for smp in group)
        usable = [(s, smp) for s, smp in enumerate(group) if smp.stop_reason in STOPPED
                  and len(sample_sequence(prompt, smp, closing)) <= max_length]

        def reject(reason, detail, best=None, worst=None):
            rejections.append({"prompt_id": pid, "index": i, "reason": reason, "detail": detail,
                               "best_reward": best, "worst_reward": worst, "usable": len(usable)})

        if len(usable) < 2:
            reject("too_long", f"{len(usable)} of {len(group)} samples usable: {unfinished} hit max_new_tokens, "
                               f"{over} longer than tokenize.max_length {max_length}")
            continue
        best = min(usable, key=lambda t: (-t[1].reward, t[0]))
        worst = min(usable, key=lambda t: (t[1].reward, t[0]))
        gap = float(best[1].reward) - float(worst[1].reward)
        if gap == 0.0 or content_of(best[1]) == content_of(worst[1]):
            reject("tie", f"best sample {best[0]} and worst sample {worst[0]} score {best[1].reward!r}"
                   + ("" if gap else f" (all {len(usable)} usable samples equal)"),
                   float(best[1].reward), float(worst[1].reward))
            continue
        if gap <= min_margin:
            reject("margin", f"margin {gap:.6g} <= rounds.min_margin {min_margin:g}",
                   float(best[1].reward), float(worst[1].reward))
            continue
        chosen = sample_sequence(prompt, best[1], closing)
        rejected = sample_sequence(prompt, worst[1], closing)
        th = token_hash(chosen, len(prompt), rejected, len(prompt))
        rows.append({"pair_id": pair_id_of(sha256_json({"prompt_ids": prompt, "chosen_ids": chosen,
                                                        "rejected_ids": rejected})),
                     "chosen_ids": chosen, "chosen_prompt_len": len(prompt),
                     "rejected_ids": rejected, "rejected_prompt_len": len(prompt),
                     # The judge's reward margin: what rm.use_margin would read; DPO's losses do not.
                     "margin": gap, "token_hash": th})
    ids = [r["pair_id"] for r in rows]
    if len(set(ids)) != len(ids):
        # Two prompts with equal tokens were deduplicated by unique_prompts; equal pairs mean a caller's bug.
        raise RoundPairsError(f"{source}: duplicate pair ids (the same prompt twice in the round's prompts)")
    return rows, rejections


def pairs_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=TOKENS_SCHEMA)


def rejections_table(rejections: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rejections, schema=ROUND_REJECTIONS_SCHEMA)


def pairs_report(rows: list[dict], rejections: list[dict], samples: list[list[Sample]]) -> dict:
    """What a round's pair building did: prompts, pairs, rejections by reason, the samples' stop reasons and mean
    reward margin of the pairs (rounds.json carries it)."""
    stops: dict[str, int] = {}
    for group in samples:
        for smp in group:
            stops[smp.stop_reason] = stops.get(smp.stop_reason, 0) + 1
    return {"prompts": len(rows) + len(rejections), "pairs": len(rows),
            "rejected": {r: sum(x["reason"] == r for x in rejections) for r in REJECT_REASONS},
            "samples": sum(len(g) for g in samples), "stop_reasons": dict(sorted(stops.items())),
            "mean_margin": float(np.mean([r["margin"] for r in rows])) if rows else None}


# --------------------------------------------------------------------------------------------------
# metrics/rounds.json
# --------------------------------------------------------------------------------------------------

def _by_position(judgments: list[dict], source: str) -> dict[tuple[int, int], dict]:
    out = {}
    for i, r in enumerate(judgments):
        key = (r.get("index"), r.get("sample"))
        if key in out:
            raise RoundPairsError(f"{source} row {i}: (index, sample) {key} twice")
        out[key] = r
    return out


def _success(rows: list[dict], source: str) -> np.ndarray:
    """Per prompt position: the mean graded success of the policy's samples (rows in (index, sample) order)."""
    by: dict[int, list[float]] = {}
    for i, r in enumerate(rows):
        g = r.get("policy_grade")
        if not isinstance(g, dict) or not isinstance(g.get("success"), bool):
            raise RoundPairsError(f"{source} row {i}: no policy_grade.success (generation.grader must be set for "
                                  "graded success across rounds)")
        by.setdefault(r["index"], []).append(float(g["success"]))
    return np.array([np.mean(by[k]) for k in sorted(by)], np.float64)


def _bounded(dist: np.ndarray, point: float, confidence: float) -> dict:
    lo, hi = percentile_interval(dist, confidence)
    return {"point": float(point), "ci_low": float(lo), "ci_high": float(hi)}


def head_to_head(a: list[dict], b: list[dict], idx: np.ndarray, confidence: float, source: str) -> dict:
    """Win rate of a's policy completions over b's on the same probe positions, by the judge's rewards (a tie
    counts 0.5; the same judge must have scored both): mean over prompts, bootstrap over prompts (idx)."""
    pa_, pb = _by_position(a, source), _by_position(b, source)
    if pa_.keys() != pb.keys():
        raise RoundPairsError(f"{source}: the two rounds' judgments cover different (index, sample) positions")
    wins: dict[int, list[float]] = {}
    for key in sorted(pa_):
        ra, rb = float(pa_[key]["policy_reward"]), float(pb[key]["policy_reward"])
        wins.setdefault(key[0], []).append(1.0 if ra > rb else 0.0 if ra < rb else 0.5)
    per = np.array([np.mean(wins[k]) for k in sorted(wins)], np.float64)
    return _bounded(per[idx].mean(axis=-1), float(per.mean()), confidence)


def rounds_record(rounds: list[dict], evaluate: dict) -> dict:
    """metrics/rounds.json from each round's parts, in round order; rounds[k] = {round, judgments (the probe's
    judge rows), generation (metrics/generation.json of that round), dpo (its metrics/dpo.json),
    pairs (pairs_report of the pairs it trained on, None for round 1: the offline pairs)}. Per round: probe accuracy,
    win rate against the initial reference (generation's), against the previous round and the first (head_to_head),
    graded success [CI] and its difference from round 1 and from the previous round [CI] (paired bootstrap over
    probe prompts, evaluate's index matrix), pairs, KL (or greedy log-ratio) to the initial reference."""
    if not rounds:
        raise RoundPairsError("rounds.json needs at least one round")
    n = len({r["index"] for r in rounds[0]["judgments"]})
    idx = bootstrap_indices(n, evaluate["bootstrap_replicates"], evaluate["seed"])
    conf = evaluate["confidence"]
    success = [_success(r["judgments"], f"round {r['round']} judgments") for r in rounds]
    out = []
    for k, r in enumerate(rounds):
        if len(success[k]) != n:
            raise RoundPairsError(f"round {r['round']}: judgments over {len(success[k])} probe prompts, round 1 over {n}")
        gen = r["generation"]
        kl = gen.get("kl") or gen.get("log_ratio") or {}
        entry = {
            "round": r["round"],
            "probe_accuracy": r["dpo"]["final"]["accuracy"],
            "probe_accuracy_ci_low": r["dpo"]["final"].get("accuracy_ci_low"),
            "probe_accuracy_ci_high": r["dpo"]["final"].get("accuracy_ci_high"),
            "win_rate_vs_reference": {"point": gen["win_rate"], "ci_low": gen["win_rate_ci_low"],
                                      "ci_high": gen["win_rate_ci_high"]},
            "graded_success": _bounded(success[k][idx].mean(axis=-1), float(success[k].mean()), conf),
            "kl_to_reference": {"kind": "kl" if gen.get("kl") is not None else "log_ratio",
                                "per_completion": kl.get("per_completion"), "per_token": kl.get("per_token")},
            "pairs": r.get("pairs"),
            # round 1 has no earlier round to compare with: null
            **dict.fromkeys(("win_rate_vs_previous", "win_rate_vs_round1", "graded_success_diff_vs_previous",
                             "graded_success_diff_vs_round1")),
        }
        if k > 0:
            prev = rounds[k - 1]
            entry["win_rate_vs_previous"] = head_to_head(r["judgments"], prev["judgments"], idx, conf,
                                                         f"round {r['round']} vs {prev['round']}")
            entry["win_rate_vs_round1"] = head_to_head(r["judgments"], rounds[0]["judgments"], idx, conf,
                                                       f"round {r['round']} vs {rounds[0]['round']}")
            for name, j in (("graded_success_diff_vs_previous", k - 1), ("graded_success_diff_vs_round1", 0)):
                d = success[k] - success[j]
                entry[name] = _bounded(d[idx].mean(axis=-1), float(d.mean()), conf)
        out.append(entry)
    last = out[-1]
    return {"format": record_formats.ROUNDS_METRICS, "rounds": out, "n_probe_prompts": n, "confidence": conf,
            "improved_over_round1": bool(len(out) > 1 and last["graded_success_diff_vs_round1"]["ci_low"] > 0)}


def render_rounds_section(record: dict | None) -> list[str]:
    """summary.md's lines on the rounds (metrics/rounds.json); [] when the run had one round."""
    if not record:
        return []

    def ci(b: dict | None, signed: bool = False) -> str:
        if b is None:
            return ""
        f = "{:+.4f}" if signed else "{:.4f}"
        return f"{f.format(b['point'])} [{f.format(b['ci_low'])}, {f.format(b['ci_high'])}]"

    lines = ["## Iterative DPO rounds", "",
             f"Graded success on the {record['n_probe_prompts']} probe prompts, paired bootstrap "
             f"({int(round(record['confidence'] * 100))}% intervals); win rates by the judge; pairs: built "
             "(rejected tie / margin / too_long).", "",
             "| round | probe accuracy | win rate vs reference [CI] | vs previous round | graded success [CI] | "
             "vs round 1 [CI] | KL / log-ratio per completion | pairs |",
             "|---|---|---|---|---|---|---|---|"]
    for r in record["rounds"]:
        p = r.get("pairs")
        pairs = "" if p is None else (f"{p['pairs']} ({p['rejected']['tie']} / {p['rejected']['margin']} / "
                                      f"{p['rejected']['too_long']})")
        kl = r["kl_to_reference"]["per_completion"]
        lines.append(f"| {r['round']} | {r['probe_accuracy']:.4f} | {ci(r['win_rate_vs_reference'])} | "
                     f"{ci(r.get('win_rate_vs_previous'))} | {ci(r['graded_success'])} | "
                     f"{ci(r.get('graded_success_diff_vs_round1'), signed=True)} | "
                     f"{'' if kl is None else f'{kl:.4f}'} | {pairs} |")
    lines += ["", "The last round " + ("beats" if record["improved_over_round1"] else "does not beat") +
              " round 1 (the lower bound of the graded-success difference " +
              ("above" if record["improved_over_round1"] else "not above") + " 0).", ""]
    return lines
