"""stages/data/formats/trl.py: TRL's standard and conversational rows, explicit and implicit prompts."""
from __future__ import annotations

import pytest

from data_helpers import A, S, U, assert_rejected, triple
from stages.data.formats import parse_row, trl
from stages.data.messages import split_implicit_strings


def test_trl_standard_explicit_prompt():
    row = {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    assert triple(parse_row(row, "trl")) == ([U("The sky is")], [A(" blue.")], [A(" green.")])


def test_trl_standard_implicit_prompt_follows_extract_prompt():
    row = {"chosen": "The sky is blue.", "rejected": "The sky is green."}
    assert triple(parse_row(row, "trl")) == ([U("The sky is")], [A(" blue.")], [A(" green.")])
    # divergence not after a space: no back-off
    assert split_implicit_strings("abcX", "abcY") == ("abc", "X", "Y")


def test_trl_conversational_explicit_and_implicit():
    prompt = [S("Be brief."), U("Sky colour?")]
    explicit = {"prompt": prompt, "chosen": [A("Blue.")], "rejected": [A("Green.")]}
    implicit = {"chosen": prompt + [A("Blue.")], "rejected": prompt + [A("Green.")]}
    want = (prompt, [A("Blue.")], [A("Green.")])
    assert triple(parse_row(explicit, "trl")) == want
    assert triple(parse_row(implicit, "trl")) == want
    # same content -> same pair id, whatever the spelling
    assert parse_row(explicit, "trl").content_hash == parse_row(implicit, "trl").content_hash


CONV = [U("Q?")]
BAD_ROWS = [
    ({"prompt": "p", "chosen": "a"}, "schema"),
    ({"prompt": "p", "chosen": 1, "rejected": "b"}, "schema"),
    ({"prompt": None, "chosen": "a", "rejected": "b"}, "schema"),
    ({"prompt": {"role": "user", "content": "Q"}, "chosen": "a", "rejected": "b"}, "schema"),
    ({"chosen": "abc", "rejected": [A("x")]}, "schema"),
    ({"chosen": [U("Q"), A("a")], "rejected": [U("Q"), U("b")]}, "role"),
    ({"chosen": "Same start", "rejected": "Same start and more"}, "empty_completion"),
    ({"chosen": "Q? yes", "rejected": "Q? yes"}, "identical_pair"),
    ({"chosen": [U("Q"), A("a")], "rejected": [U("Q"), A("a")]}, "identical_pair"),
    ({"chosen": "apple", "rejected": "banana"}, "no_shared_prompt"),
    ({"chosen": [U("Q1"), A("a")], "rejected": [U("Q2"), A("b")]}, "no_shared_prompt"),
]


@pytest.mark.parametrize("row, reason", BAD_ROWS, ids=[f"{i}-{r}" for i, (_, r) in enumerate(BAD_ROWS)])
def test_bad_trl_row_is_rejected_with_exact_reason(row, reason):
    assert_rejected(row, "trl", reason)


def test_declares_no_reason_of_its_own():
    assert trl.FORMAT.reasons == ()
