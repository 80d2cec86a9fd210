"""round_pairs' own pure parts (stages/round_pairs.py, issue 36): the judge's pairing of a prompt's samples, the
grader as labeler, a round's sampling settings."""
from __future__ import annotations

import yaml

from conftest import REPO_ROOT
from stages.round_pairs import grader_rewards, judge_items, round_generation_settings


def test_judge_items_pair_samples_of_one_prompt_and_an_odd_last_with_itself():
    prompts = [[1, 2], [3]]
    seqs = [[1, 2, 10], [1, 2, 11], [1, 2, 12], [3, 20], [3, 21], [3, 22]]
    first, second, lens, where = judge_items(prompts, seqs, 3)
    assert where == [(0, 1), (2, 2), (3, 4), (5, 5)]
    assert lens == [2, 2, 1, 1]
    assert [list(f) for f in first] == [seqs[0], seqs[2], seqs[3], seqs[5]]
    assert [list(s) for s in second] == [seqs[1], seqs[2], seqs[4], seqs[5]]


def test_grader_labels_success_one_failure_zero():
    q = [{"role": "user", "content": "What colour is a banana?"}]
    r = grader_rewards({"type": "embedded_colours"}, [q, q, q], ["A banana is yellow.", "A banana is blue.", "Ugh."])
    assert list(r) == [1.0, 0.0, 0.0]


def test_each_round_samples_from_its_own_seed_with_the_rounds_knobs():
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    two, three = round_generation_settings(params, 2), round_generation_settings(params, 3)
    assert two.seed != three.seed and two.seed == round_generation_settings(params, 2).seed
    assert (two.n, two.temperature, two.top_p) == (params["rounds"]["n"], params["rounds"]["temperature"],
                                                     params["rounds"]["top_p"])
    assert two.max_new_tokens == params["generation"]["max_new_tokens"]
