"""stages/data/formats/hh.py: Anthropic HH-RLHF transcripts, on written rows and a real one."""
from __future__ import annotations

import gzip
import json

import pytest

from data_helpers import A, U, assert_rejected, triple
from stages.data.formats import hh, parse_row

HH_ROW = {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Capital of France?\n\nAssistant: Paris.",
          "rejected": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Capital of France?\n\nAssistant: Lyon."}


def test_hh_splits_at_last_shared_assistant_marker():
    assert triple(parse_row(HH_ROW, "hh")) == ([U("Hi"), A("Hello!"), U("Capital of France?")], [A("Paris.")],
                                               [A("Lyon.")])


def test_hh_shared_text_after_the_marker_stays_in_the_completion():
    # Both completions start with "I think": the split is still at the marker, not the divergence.
    row = {"chosen": "\n\nHuman: Q?\n\nAssistant: I think yes.", "rejected": "\n\nHuman: Q?\n\nAssistant: I think no."}
    assert triple(parse_row(row, "hh")) == ([U("Q?")], [A("I think yes.")], [A("I think no.")])


def test_hh_only_one_leading_space_is_dropped():
    row = {"chosen": "\n\nHuman: Q\n\nAssistant:  two spaces", "rejected": "\n\nHuman: Q\n\nAssistant: one"}
    assert triple(parse_row(row, "hh"))[1:] == ([A(" two spaces")], [A("one")])


BAD_ROWS = [
    ({"chosen": None, "rejected": "x"}, "schema"),
    ({"chosen": ["\n\nHuman: a"], "rejected": "x"}, "schema"),
    ({"chosen": "Preamble\n\nHuman: Q\n\nAssistant: a", "rejected": "Preamble\n\nHuman: Q\n\nAssistant: b"}, "role"),
    ({"chosen": "\n\nHuman: Q\n\nAssistant: a\n\nHuman: more", "rejected": "\n\nHuman: Q\n\nAssistant: b"}, "role"),
    ({"chosen": "\n\nHuman: Q\n\nHuman: Q2\n\nAssistant: a", "rejected": "\n\nHuman: Q\n\nHuman: Q2\n\nAssistant: b"},
     "role"),
    ({"chosen": "\n\nAssistant: a", "rejected": "\n\nAssistant: b"}, "empty_prompt"),
    ({"chosen": "\n\nHuman: Q\n\nAssistant: ", "rejected": "\n\nHuman: Q\n\nAssistant: b"}, "empty_completion"),
    ({"chosen": HH_ROW["chosen"], "rejected": HH_ROW["chosen"]}, "identical_pair"),
    ({"chosen": "\n\nHuman: Q1\n\nAssistant: a", "rejected": "\n\nHuman: Q2\n\nAssistant: b"}, "no_shared_prompt"),
    ({"chosen": "no markers a", "rejected": "no markers b"}, "no_shared_prompt"),
]


@pytest.mark.parametrize("row, reason", BAD_ROWS, ids=[f"{i}-{r}" for i, (_, r) in enumerate(BAD_ROWS)])
def test_bad_hh_row_is_rejected_with_exact_reason(row, reason):
    assert_rejected(row, "hh", reason)


def test_declares_no_reason_of_its_own():
    assert hh.FORMAT.reasons == ()


def test_real_hh_row_prompt_split(hh_rlhf_path):
    with gzip.open(hh_rlhf_path, "rt", encoding="utf-8") as f:
        row = json.loads(f.readline())
    pair = parse_row(row, "hh")
    assert pair.prompt[:3] == [U("what are some pranks with a pen i can do?"),
                               A("Are you looking for practical joke ideas?"), U("yep")]
    assert pair.prompt[-1]["role"] == "user"
    last_user = pair.prompt[-1]["content"]
    head = f"\n\nHuman: {last_user}\n\nAssistant: "
    assert row["chosen"].endswith(head + pair.chosen[0]["content"])
    assert row["rejected"].endswith(head + pair.rejected[0]["content"])
    assert pair.chosen != pair.rejected
