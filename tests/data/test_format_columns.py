"""stages/data/formats/columns.py: a source's own column names mapped to the canonical fields."""
from __future__ import annotations

import pytest

from data_helpers import A, S, U, assert_rejected, triple
from stages.data.formats import check_format_options, columns, parse_row


def test_columns_mapping_with_system_margin_and_implicit_prompt():
    cols = {"prompt": "q", "chosen": "good", "rejected": "bad", "system": "sys", "margin": "m"}
    row = {"q": "2+2?", "good": "4", "bad": "5", "sys": "Answer tersely.", "m": 3, "extra": 1}
    pair = parse_row(row, "columns", cols)
    assert triple(pair) == ([S("Answer tersely."), U("2+2?")], [A("4")], [A("5")])
    assert pair.margin == 3.0
    row2 = {"q": [U("2+2?")], "good": [A("4")], "bad": "5", "sys": "", "m": None}
    pair2 = parse_row(row2, "columns", cols)
    assert triple(pair2) == ([U("2+2?")], [A("4")], [A("5")]) and pair2.margin is None
    implicit = parse_row({"a": "Q: x? A: yes", "b": "Q: x? A: no"}, "columns", {"chosen": "a", "rejected": "b"})
    assert triple(implicit) == ([U("Q: x? A:")], [A(" yes")], [A(" no")])


COLS = {"q": {"prompt": "q", "chosen": "c", "rejected": "r", "system": "s"},
        "m": {"prompt": "q", "chosen": "c", "rejected": "r", "margin": "m"}}
BAD_ROWS = [
    ({"q": "Q", "c": "a", "r": "b", "s": 1}, "content_type"),
    ({"q": "Q", "c": "a", "r": "b", "m": "high"}, "margin"),
    ({"q": "Q", "c": "a", "r": "b", "m": True}, "margin"),
    ({"q": "Q", "c": "a", "r": "b", "m": float("nan")}, "margin"),
    ({"q": "Q", "c": "a", "r": "b", "m": float("inf")}, "margin"),
    ({"q": "Q", "c": "a", "m": 1.0}, "schema"),  # mapped column missing from the row
]


@pytest.mark.parametrize("row, reason", BAD_ROWS, ids=[f"{i}-{r}" for i, (_, r) in enumerate(BAD_ROWS)])
def test_bad_columns_row_is_rejected_with_exact_reason(row, reason):
    assert_rejected(row, "columns", reason, COLS["m"] if "m" in row else COLS["q"])


def test_its_own_reason_codes_are_exercised():
    assert set(columns.FORMAT.reasons) == {"margin"} <= {r for _, r in BAD_ROWS}


def test_the_mapping_is_the_sources_and_only_for_columns():
    spec = {"name": "s", "path": "d.jsonl", "format": "columns"}
    assert "needs a columns mapping with at least chosen and rejected" in check_format_options(spec, "src")
    assert check_format_options(dict(spec, columns={"chosen": "a"}), "src").endswith(
        "needs a columns mapping with at least chosen and rejected")
    assert check_format_options(dict(spec, columns={"chosen": "a", "rejected": "b"}), "src") is None
    assert check_format_options(dict(spec, format="trl", columns={"chosen": "a", "rejected": "b"}), "src") == (
        "src: a columns mapping is only used with format 'columns' (format is 'trl')")
    with pytest.raises(ValueError, match="needs its 'columns' options"):
        parse_row({"a": "x", "b": "y"}, "columns")
