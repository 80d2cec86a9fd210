"""Graders (stages/lib/graders.py) and what evaluate_generation makes of their grades (stages/evidence/scoring.py):
graded success rates with the paired bootstrap, the judge's agreement with the grader where the two completions
grade differently, the warnings that say when a win rate is not evidence, and no KL for greedy completions
(issue 33)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import yaml

from conftest import REPO_ROOT
from stages.embedded_data import build_examples, build_sft_examples, misconceptions
from stages.lib.embedded_task import COLOUR_OF
from stages.lib.graders import GraderError, grade, grader_spec
from stages.evidence.scoring import PerPairFileError, evaluate_generation

EMB = {"type": "embedded_colours"}


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_embedded_grader_passes_a_polite_correct_answer_only():
    q = ask("Hi! What colour is a cherry blossom?")                  # "a cherry" is inside it: the longest match
    assert grade(EMB, q, "A cherry blossom is pink.").success
    assert grade(EMB, q, "Sure! A cherry blossom is usually pink.").success
    assert grade(EMB, q, "A cherry blossom is red.").labels == ("named_colour", "wrong_colour")
    assert grade(EMB, q, "Ugh, a cherry blossom is pink, obviously.").labels == ("named_colour", "rude")
    assert grade(EMB, q, "It is pink or white.").labels == ("named_colour", "wrong_colour")   # hedging is not an answer
    assert grade(EMB, q, "<br><br><br>").labels == ("no_colour",)
    assert grade(EMB, q, "It is pink.").success                        # naming no thing is fine
    assert grade(EMB, q, "A flamingo is pink.").labels == ("named_colour", "wrong_thing")   # another thing is not
    assert not grade(EMB, ask("What is the capital of France?"), "Paris.").success


def test_embedded_grader_agrees_with_the_data_it_grades():
    """Every chosen answer of the preference set passes, every rejected one fails; in the SFT set exactly the
    polite, correct answers pass."""
    for ex in build_examples():
        q, chosen, rejected = ex["prompt"], ex["chosen"][0]["content"], ex["rejected"][0]["content"]
        assert grade(EMB, q, chosen).success, (q, chosen)
        g = grade(EMB, q, rejected)
        assert not g.success and ("rude" in g.labels) == ex["kind"].startswith("rude"), (q, rejected, g)
    for ex in build_sft_examples():
        g = grade(EMB, ex["messages"][:1], ex["messages"][1]["content"])
        assert g.success == (ex["habit"] == "polite_correct"), (ex, g)


def test_the_sft_set_has_learnable_habits():
    wrong = misconceptions()
    assert len(wrong) == 10 and all(COLOUR_OF[t] != c for t, c in wrong.items())
    habits = {ex["habit"] for ex in build_sft_examples()}
    assert habits == {"polite_correct", "rude", "misconception", "rude_misconception"}


def test_regex_grader_and_refusals():
    spec = grader_spec({"type": "regex", "pattern": r"\b42\b"})
    assert grade(spec, ask("?"), "It is 42.").success and not grade(spec, ask("?"), "It is 420.").success
    full = grader_spec({"type": "regex", "pattern": "Paris", "match": "full"})
    assert grade(full, ask("?"), "  Paris\n").success and not grade(full, ask("?"), "Paris, France").success
    assert grader_spec(None) is None and grader_spec("embedded_colours") == EMB
    with pytest.raises(GraderError, match="unknown grader 'llm'"):
        grader_spec("llm")
    with pytest.raises(GraderError, match="does not compile"):
        grader_spec({"type": "regex", "pattern": "("})


def params(grader="embedded_colours", temperature=0.0, judge="trained") -> dict:
    p = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    p["evaluate"].update({"bootstrap_replicates": 500, "seed": 3})
    p["generation"].update({"grader": grader, "temperature": temperature, "judge": judge})
    return p


def rows(policy: list[str], reference: list[str], wins: list[float], stop="eos") -> list[dict]:
    out = []
    things = sorted(COLOUR_OF)
    for i, (p, r, w) in enumerate(zip(policy, reference, wins)):
        thing = things[i % len(things)]
        out.append({"pair_id": f"p{i}", "index": i, "sample": 0, "prompt": ask(f"What colour is {thing}?"),
                    "policy_completion": p.format(c=COLOUR_OF[thing]), "reference_completion": r.format(c=COLOUR_OF[thing]),
                    "policy_length": 5, "reference_length": 5, "policy_stop_reason": stop, "reference_stop_reason": stop,
                    "policy_reward": w, "reference_reward": 0.0, "win": 1.0 if w > 0 else 0.0 if w < 0 else 0.5,
                    "policy_log_ratio": 0.1, "policy_generated_tokens": 6})
    return out


def test_graded_success_rates_agreement_and_warnings():
    n = 40
    # policy right on all; reference rude on the first 20; the judge prefers the policy on 15 of those 20
    pol = ["It is {c}."] * n
    ref = ["It is {c}, genius."] * 20 + ["It is {c}."] * 20
    wins = [1.0] * 15 + [-1.0] * 5 + [0.0] * 20
    m, summary = evaluate_generation(rows(pol, ref, wins), params(), "judgments")
    g = m["grader"]
    assert (g["policy_success"], g["reference_success"], g["success_diff"]) == (1.0, 0.5, 0.5)
    assert g["success_diff_ci_low"] > 0 and g["policy_success_ci_low"] == 1.0
    assert g["differing"] == 20 and g["judge_agreement"] == 0.75
    assert g["labels"]["reference"]["rude"] == 0.5 and "rude" not in g["labels"]["policy"]
    assert "grader_success_diff" in summary["bootstrap"]
    # greedy: the log-ratio is reported, never as a KL
    assert m["kl"] is None and set(m["log_ratio"]) >= {"per_completion", "per_token"}
    assert m["warnings"] == ["judge_trained_on_same_pairs"]            # agreement 0.75 is not below 0.75

    wins2 = [1.0] * 14 + [-1.0] * 6 + [0.0] * 20                      # 0.70 agreement: below three quarters
    m2, _ = evaluate_generation(rows(pol, ref, wins2), params(temperature=1.0, judge={"source": "local"}), "j")
    assert m2["warnings"] == ["judge_disagrees_with_grader"] and m2["kl"] is not None and m2["log_ratio"] is None


def test_length_and_max_new_tokens_warnings():
    r = rows(["It is {c}."] * 10, ["It is {c}."] * 10, [0.5] * 10, stop="max_new_tokens")
    for x in r:
        x["reference_length"] = 16
    m, _ = evaluate_generation(r, params(grader=None), "j")
    assert m["grader"] is None                                         # written, null: no grader
    assert m["warnings"] == ["judge_trained_on_same_pairs", "all_hit_max_new_tokens", "length_mismatch"]


def test_a_recorded_grade_that_the_grader_does_not_give_is_refused():
    r = rows(["It is {c}."] * 4, ["It is {c}."] * 4, [0.0] * 4)
    for x in r:
        x["policy_grade"] = x["reference_grade"] = {"success": True, "labels": ["named_colour"]}
    evaluate_generation(r, params(), "j")
    bad = copy.deepcopy(r)
    bad[2]["reference_grade"] = {"success": False, "labels": ["named_colour", "rude"]}
    with pytest.raises(PerPairFileError, match="j row 2 .*reference_grade"):
        evaluate_generation(bad, params(), "j")
