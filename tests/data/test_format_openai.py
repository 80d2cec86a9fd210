"""stages/data/formats/openai.py: OpenAI preference fine-tuning rows."""
from __future__ import annotations

import pytest

from data_helpers import A, U, assert_rejected
from stages.data.formats import openai, parse_row


def test_openai_preference_row():
    row = {"input": {"messages": [U("Hello")], "tools": [], "parallel_tool_calls": True},
           "preferred_output": [A("Hi there!")], "non_preferred_output": [A("Go away.")]}
    pair = parse_row(row, "openai")
    assert (pair.prompt, pair.chosen, pair.rejected) == ([U("Hello")], [A("Hi there!")], [A("Go away.")])


CONV = [U("Q?")]
BAD_ROWS = [
    ({"input": [U("Q")], "preferred_output": [A("a")], "non_preferred_output": [A("b")]}, "schema"),
    ({"input": {"messages": CONV}, "preferred_output": A("a"), "non_preferred_output": [A("b")]}, "schema"),
    ({"input": {"messages": CONV}, "preferred_output": [U("a")], "non_preferred_output": [A("b")]}, "role"),
    ({"input": {"messages": CONV}, "preferred_output": [], "non_preferred_output": [A("b")]}, "empty_completion"),
]


@pytest.mark.parametrize("row, reason", BAD_ROWS, ids=[f"{i}-{r}" for i, (_, r) in enumerate(BAD_ROWS)])
def test_bad_openai_row_is_rejected_with_exact_reason(row, reason):
    assert_rejected(row, "openai", reason)


def test_declares_no_reason_of_its_own():
    assert openai.FORMAT.reasons == ()
