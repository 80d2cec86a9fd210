"""stages/data/formats/sharegpt.py: ShareGPT conversations with chosen / rejected."""
from __future__ import annotations

import pytest

from data_helpers import A, S, U, assert_rejected
from stages.data.formats import parse_row, sharegpt


def test_sharegpt_object_string_and_system():
    row = {"system": "Be nice.",
           "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hey"},
                             {"from": "user", "value": "2+2?"}],
           "chosen": {"from": "gpt", "value": "4"}, "rejected": "5"}
    pair = parse_row(row, "sharegpt")
    assert (pair.prompt, pair.chosen, pair.rejected) == ([S("Be nice."), U("Hi"), A("Hey"), U("2+2?")], [A("4")],
                                                         [A("5")])


BAD_ROWS = [
    ({"conversations": "hi", "chosen": "a", "rejected": "b"}, "schema"),
    ({"conversations": [{"from": "human", "value": "Q"}], "chosen": 7, "rejected": "b"}, "schema"),
    ({"conversations": [{"from": "robot", "value": "Q"}], "chosen": "a", "rejected": "b"}, "role"),
    ({"conversations": [{"value": "Q"}], "chosen": "a", "rejected": "b"}, "role"),
    ({"conversations": [{"from": "human", "value": "Q"}], "chosen": {"from": "human", "value": "a"}, "rejected": "b"},
     "role"),
    ({"conversations": [{"from": "human", "value": 3}], "chosen": "a", "rejected": "b"}, "content_type"),
    ({"conversations": [{"from": "human", "value": "Q"}], "chosen": "a", "rejected": {"from": "gpt", "value": "a"}},
     "identical_pair"),
]


@pytest.mark.parametrize("row, reason", BAD_ROWS, ids=[f"{i}-{r}" for i, (_, r) in enumerate(BAD_ROWS)])
def test_bad_sharegpt_row_is_rejected_with_exact_reason(row, reason):
    assert_rejected(row, "sharegpt", reason)


def test_declares_no_reason_of_its_own():
    assert sharegpt.FORMAT.reasons == ()
