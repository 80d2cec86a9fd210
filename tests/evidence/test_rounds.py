"""Iterative DPO rounds' pure parts (stages/evidence/rounds.py, issue 36): pairs from scored samples with a reason for
every prompt without one, the token rows train_dpo reads, and metrics/rounds.json's per-round record."""
from __future__ import annotations

import numpy as np
import pytest

from stages.lib.contracts import TOKENS_SCHEMA, token_hash, token_hash_problem
from stages.evidence.rounds import (REJECT_REASONS, RoundPairsError, Sample, build_round_pairs, content_of, head_to_head,
                                    pairs_report, pairs_table, prompt_id, rejections_table, render_rounds_section,
                                    rounds_record, select_prompts, unique_prompts)
from stages.evidence.scoring import bootstrap_indices

EOS = 2
CLOSING = [EOS]               # a rendering without an end-of-turn: tokenize appends the EOS


def s(tokens, reward, stop="eos"):
    return Sample(tuple(tokens), stop, reward)


def test_best_against_worst_forms_the_pair_as_tokenize_would_write_it():
    prompt = [5, 6, 7]
    group = [s([10, 11, EOS], 0.5), s([12, EOS], 2.0), s([13, 14, 15, EOS], -1.0), s([16, EOS], 2.0)]
    rows, rejections = build_round_pairs([prompt], [group], CLOSING, 0.0, 128)
    assert rejections == []
    (row,) = rows
    # chosen = the highest reward (a tie to the lowest sample index: sample 1, not 3), rejected = the lowest; the
    # stop token is replaced by the turn's closing (content + closing, what the judge scored)
    assert row["chosen_ids"] == [5, 6, 7, 12, EOS] and row["rejected_ids"] == [5, 6, 7, 13, 14, 15, EOS]
    assert row["chosen_prompt_len"] == row["rejected_prompt_len"] == 3
    assert row["margin"] == 3.0
    assert row["token_hash"] == token_hash(row["chosen_ids"], 3, row["rejected_ids"], 3)
    table = pairs_table(rows)
    assert table.schema == TOKENS_SCHEMA and token_hash_problem(table, "round pairs") is None
    # content-addressed: the same samples in another order give the same pair id
    again, _ = build_round_pairs([prompt], [[group[2], group[1], group[0], group[3]]], CLOSING, 0.0, 128)
    assert again[0]["pair_id"] == row["pair_id"] and len(row["pair_id"]) == 24


def test_an_end_of_turn_rendering_closes_with_its_own_tokens():
    # A chat template closes a turn with <|im_end|> "\n" (ids 3, 4); the completion stopped at 3.
    rows, _ = build_round_pairs([[1]], [[s([9, 3], 1.0, "end_of_turn"), s([8, 3], 0.0, "end_of_turn")]], [3, 4],
                                0.0, 128)
    assert rows[0]["chosen_ids"] == [1, 9, 3, 4] and rows[0]["rejected_ids"] == [1, 8, 3, 4]
    assert content_of(s([9, 10], 0.0, "max_new_tokens")) == [9, 10]       # a cut completion keeps every token


def test_every_prompt_is_a_pair_or_a_rejection_with_its_reason():
    prompts = [[1], [2], [3], [4], [5]]
    groups = [
        [s([9, EOS], 1.0), s([8, EOS], 0.0)],                                     # pair
        [s([9, EOS], 1.0), s([8, EOS], 1.0)],                                     # tie: equal rewards
        [s([9, EOS], 1.0), s([9, EOS], 0.5)],                                     # tie: the same completion
        [s([9, EOS], 1.0), s([8, EOS], 0.7)],                                     # margin 0.3 <= 0.5
        [s([9, 9], 3.0, "max_new_tokens"), s([8] * 7 + [EOS], 0.0), s([7, EOS], 1.0)],   # too_long: 1 usable
    ]
    rows, rejections = build_round_pairs(prompts, groups, CLOSING, 0.5, 8)
    assert len(rows) == 1 and rows[0]["chosen_ids"][0] == 1
    assert [(r["index"], r["reason"]) for r in rejections] == [(1, "tie"), (2, "tie"), (3, "margin"), (4, "too_long")]
    assert rejections[3]["usable"] == 1 and "1 hit max_new_tokens, 1 longer than tokenize.max_length 8" in \
        rejections[3]["detail"]
    assert rejections[2]["best_reward"] == 1.0 and rejections[3]["best_reward"] is None
    assert rejections_table(rejections).num_rows == 4
    report = pairs_report(rows, rejections, groups)
    assert report["prompts"] == 5 and report["pairs"] == 1
    assert report["rejected"] == {"too_long": 1, "tie": 2, "margin": 1} and set(report["rejected"]) == set(REJECT_REASONS)
    assert report["stop_reasons"] == {"eos": 10, "max_new_tokens": 1}


def test_a_cut_sample_never_wins_even_with_the_best_reward():
    rows, _ = build_round_pairs([[1]], [[s([9, 9], 5.0, "max_new_tokens"), s([8, EOS], 1.0), s([7, EOS], 0.0)]],
                                CLOSING, 0.0, 128)
    assert rows[0]["chosen_ids"] == [1, 8, EOS]


def test_bad_samples_are_refused_naming_the_prompt_and_sample():
    with pytest.raises(RoundPairsError, match="prompt 0 sample 1: reward nan"):
        build_round_pairs([[1]], [[s([9, EOS], 1.0), s([8, EOS], float("nan"))]], CLOSING, 0.0, 128)
    with pytest.raises(RoundPairsError, match="prompt 0: 1 samples"):
        build_round_pairs([[1]], [[s([9, EOS], 1.0)]], CLOSING, 0.0, 128)
    with pytest.raises(RoundPairsError, match="2 sample lists for 1 prompts"):
        build_round_pairs([[1]], [[], []], CLOSING, 0.0, 128)


def test_prompts_are_distinct_and_the_subset_is_content_addressed():
    chosen = [[1, 2, 9, 9], [1, 2, 8], [3, 9], [4, 5, 9]]
    prompts = unique_prompts(chosen, [2, 2, 1, 2])
    assert prompts == [[1, 2], [3], [4, 5]]
    two = select_prompts(prompts, 2)
    assert two == select_prompts(prompts[::-1], 2)[::-1]          # the same prompts whatever the order
    assert set(map(tuple, two)) <= set(map(tuple, prompts)) and len(two) == 2
    assert sorted(prompt_id(p) for p in prompts)[:2] == sorted(prompt_id(p) for p in two)
    assert select_prompts(prompts, None) == prompts and select_prompts(prompts, 10) == prompts


def judgments(success: list[bool], rewards: list[float]) -> list[dict]:
    return [{"index": i, "sample": 0, "policy_reward": float(r), "policy_grade": {"success": bool(ok), "labels": []}}
            for i, (ok, r) in enumerate(zip(success, rewards))]


def round_parts(k, success, rewards, pairs=None):
    gen = {"win_rate": 0.6, "win_rate_ci_low": 0.5, "win_rate_ci_high": 0.7,
           "log_ratio": {"per_completion": 1.5, "per_token": 0.2}}
    return {"round": k, "judgments": judgments(success, rewards), "generation": gen,
            "dpo": {"final": {"accuracy": 0.9, "accuracy_ci_low": 0.85, "accuracy_ci_high": 0.95}}, "pairs": pairs}


PAIRS = {"pairs": 10, "rejected": {"tie": 3, "margin": 1, "too_long": 0}}
EVAL = {"bootstrap_replicates": 2000, "seed": 7, "confidence": 0.95}


def test_rounds_record_differences_are_paired_over_probe_prompts():
    rng = np.random.default_rng(0)
    n = 200
    first = rng.random(n) < 0.5
    better = first | (rng.random(n) < 0.4)          # round 2 keeps every success of round 1 and gains more
    rec = rounds_record([round_parts(1, list(first), list(rng.random(n))),
                         round_parts(2, list(better), list(rng.random(n) + 1.0), PAIRS)], EVAL)
    r1, r2 = rec["rounds"]
    assert r1["graded_success"]["point"] == pytest.approx(first.mean())
    d = r2["graded_success_diff_vs_round1"]
    assert d["point"] == pytest.approx(better.mean() - first.mean()) and d["ci_low"] > 0
    assert rec["improved_over_round1"] is True
    # every round-2 reward is higher: it wins every head-to-head against round 1
    assert r2["win_rate_vs_previous"] == {"point": 1.0, "ci_low": 1.0, "ci_high": 1.0}
    assert r2["kl_to_reference"] == {"kind": "log_ratio", "per_completion": 1.5, "per_token": 0.2}
    assert r1["win_rate_vs_previous"] is None and r1["graded_success_diff_vs_round1"] is None and r2["pairs"] == PAIRS
    table = render_rounds_section(rec)
    assert table[0] == "## Iterative DPO rounds" and render_rounds_section(None) == []
    row2 = next(line for line in table if line.startswith("| 2 |"))
    assert f"{d['point']:+.4f} [{d['ci_low']:+.4f}, {d['ci_high']:+.4f}]" in row2 and "1.0000 [1.0000, 1.0000]" in row2
    assert "The last round beats round 1" in table[-2]
    # the same rounds the other way round: no improvement
    rec_down = rounds_record([round_parts(1, list(better), [0.0] * n), round_parts(2, list(first), [0.0] * n)], EVAL)
    assert rec_down["improved_over_round1"] is False
    assert rec_down["rounds"][1]["win_rate_vs_previous"]["point"] == 0.5          # all ties


def test_head_to_head_and_record_refuse_rounds_of_other_prompts():
    idx = bootstrap_indices(2, 100, 1)
    with pytest.raises(RoundPairsError, match="different \\(index, sample\\) positions"):
        head_to_head(judgments([True, False], [1, 2]), judgments([True], [1]), idx, 0.95, "r2 vs r1")
    with pytest.raises(RoundPairsError, match="no policy_grade.success"):
        rounds_record([{"round": 1, "judgments": [{"index": 0, "sample": 0, "policy_reward": 1.0}]}], EVAL)
