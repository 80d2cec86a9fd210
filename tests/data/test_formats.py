"""The format registry (stages/data/formats/__init__.py): discovery, `auto`, the conversation rules every format
shares (stages/data/messages.py), declared reason codes, and the format lists users read tied to the registry.

Each format's own rows are tested in tests/data/test_format_<name>.py."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import yaml

from conftest import REPO_ROOT
from data_helpers import A, S, U
from stages.data import formats
from stages.data.formats import FORMAT_NAMES, FORMATS, REASONS, detect_format, parse_row
from stages.data.messages import COMMON_REASONS, Format, RowRejected, common_prefix_len


HH_ROW = {"chosen": "\n\nHuman: Q?\n\nAssistant: yes", "rejected": "\n\nHuman: Q?\n\nAssistant: no"}


@pytest.mark.parametrize("row, fmt", [
    (HH_ROW, "hh"),
    ({"chosen": "The sky is blue.", "rejected": "The sky is green."}, "trl"),
    ({"prompt": "p", "chosen": "a", "rejected": "b", "x": HH_ROW["chosen"]}, "trl"),
    ({"prompt": "Q", "chosen": HH_ROW["chosen"], "rejected": HH_ROW["rejected"]}, "trl"),  # explicit prompt: not hh
    ({"conversations": [{"from": "human", "value": "Hi"}], "chosen": "a", "rejected": "b"}, "sharegpt"),
    ({"input": {"messages": [U("Hi")]}, "preferred_output": [A("a")], "non_preferred_output": [A("b")]}, "openai"),
])
def test_auto_detects_the_format_from_keys(row, fmt):
    pair = parse_row(row, "auto")
    assert pair.fmt == detect_format(row) == fmt
    assert (pair.prompt, pair.chosen, pair.rejected) == (lambda p: (p.prompt, p.chosen, p.rejected))(parse_row(row, fmt))


def test_auto_names_what_it_looks_for_when_no_format_claims_a_row():
    with pytest.raises(RowRejected) as e:
        parse_row({"question": "Q", "answer": "A"}, "auto")
    assert e.value.reason == "schema"
    assert e.value.detail.startswith("cannot detect the format from keys ['answer', 'question'] (auto expects ")
    expected = e.value.detail.split("(auto expects ", 1)[1]
    for keys in ("chosen+rejected", "conversations+chosen+rejected", "input+preferred_output+non_preferred_output"):
        assert keys in expected
    # auto tries the most specific first: openai, sharegpt, hh (its values), then trl (the most general, last);
    # columns never (its mapping is the source's)
    order = [f.name for f in formats._DETECTION]
    assert [name for name in order if name in ("openai", "sharegpt", "hh", "trl")] == ["openai", "sharegpt", "hh", "trl"]
    assert order[-1] == "trl" and "columns" not in order


# The conversation rules every format goes through (validate_pair, to_message), spelled as trl rows.
CONV = [U("Q?")]
BAD_ROWS = [
    (None, "schema"), ([1, 2], "schema"), ("just a string", "schema"), (42, "schema"),
    ({"prompt": CONV, "chosen": ["a"], "rejected": [A("b")]}, "schema"),
    ({"prompt": CONV, "chosen": [None], "rejected": [A("b")]}, "schema"),
    ({"prompt": [{"role": "user", "content": "Q", "name": "bob"}], "chosen": "a", "rejected": "b"}, "schema"),
    ({"prompt": [{"content": "Q"}], "chosen": "a", "rejected": "b"}, "role"),
    ({"prompt": [{"role": None, "content": "Q"}], "chosen": "a", "rejected": "b"}, "role"),
    ({"prompt": [{"role": 1, "content": "Q"}], "chosen": "a", "rejected": "b"}, "role"),
    ({"prompt": [{"role": "bot", "content": "Q"}], "chosen": "a", "rejected": "b"}, "role"),
    ({"prompt": [{"role": "tool", "content": "Q"}], "chosen": "a", "rejected": "b"}, "role"),
    ({"prompt": [U("Q"), S("late system")], "chosen": "a", "rejected": "b"}, "role"),
    ({"prompt": [U("Q"), U("Q again")], "chosen": "a", "rejected": "b"}, "role"),
    ({"prompt": [A("Hi"), U("Q")], "chosen": "a", "rejected": "b"}, "role"),
    ({"prompt": [U("Q"), A("partial")], "chosen": "a", "rejected": "b"}, "role"),
    ({"prompt": [S("only system")], "chosen": "a", "rejected": "b"}, "role"),
    ({"prompt": CONV, "chosen": [U("a")], "rejected": [A("b")]}, "role"),
    ({"prompt": CONV, "chosen": [A("a"), A("more")], "rejected": [A("b")]}, "role"),
    ({"prompt": [{"role": "user"}], "chosen": "a", "rejected": "b"}, "content_type"),
    ({"prompt": [{"role": "user", "content": None}], "chosen": "a", "rejected": "b"}, "content_type"),
    ({"prompt": [{"role": "user", "content": 5}], "chosen": "a", "rejected": "b"}, "content_type"),
    ({"prompt": [{"role": "user", "content": [{"type": "text", "text": "Q"}]}], "chosen": "a", "rejected": "b"},
     "content_type"),
    ({"prompt": CONV, "chosen": [{"role": "assistant", "content": {"t": 1}}], "rejected": "b"}, "content_type"),
    ({"prompt": "Q", "chosen": "a\ud800", "rejected": "b"}, "content_type"),
    ({"prompt": [], "chosen": "a", "rejected": "b"}, "empty_prompt"),
    ({"prompt": "   ", "chosen": "a", "rejected": "b"}, "empty_prompt"),
    ({"prompt": [U(""), A("x"), U("Q")], "chosen": "a", "rejected": "b"}, "empty_prompt"),
    ({"prompt": [S(" "), U("Q")], "chosen": "a", "rejected": "b"}, "empty_prompt"),
    ({"prompt": "Q", "chosen": "", "rejected": "b"}, "empty_completion"),
    ({"prompt": "Q", "chosen": "a", "rejected": " \n"}, "empty_completion"),
    ({"prompt": CONV, "chosen": [], "rejected": [A("b")]}, "empty_completion"),
    ({"prompt": "Q", "chosen": "same", "rejected": "same"}, "identical_pair"),
    ({"prompt": "Q", "chosen": "same", "rejected": "same  "}, "identical_pair"),
    ({"chosen": "apple", "rejected": "banana"}, "no_shared_prompt"),
    ({"question": "Q", "answer": "A"}, "schema"),
    ({}, "schema"),
]


@pytest.mark.parametrize("row, reason", BAD_ROWS, ids=[f"{i}-{r}" for i, (_, r) in enumerate(BAD_ROWS)])
def test_bad_row_is_rejected_with_exact_reason(row, reason):
    with pytest.raises(RowRejected) as e:
        parse_row(row, "auto" if isinstance(row, dict) and "chosen" not in row else "trl")
    assert e.value.reason == reason, e.value.detail
    assert e.value.detail


def test_every_common_reason_code_is_exercised():
    # `json` is the reader's (tests/stages/test_normalize.py: bad JSON lines)
    assert {r for _, r in BAD_ROWS} | {"json"} == set(COMMON_REASONS)
    # then each format's own, once (each format's test exercises them: tests/data/test_format_<name>.py)
    assert REASONS[:len(COMMON_REASONS)] == COMMON_REASONS and len(set(REASONS)) == len(REASONS)
    assert set(REASONS) == set(COMMON_REASONS).union(*(f.reasons for f in FORMATS.values())) >= {"margin"}


def test_a_format_may_raise_only_the_codes_it_declares(monkeypatch):
    """A code no format declares would be counted under no key of normalize_stats.json: the registry refuses it
    as the format's bug (ValueError), and accepts the same code once the format declares it."""
    def parse(row, options):
        raise RowRejected("too_shiny", "a code of its own")

    monkeypatch.setitem(FORMATS, "shiny", Format("shiny", parse))
    with pytest.raises(ValueError, match="format 'shiny' raised reason code 'too_shiny', which it does not declare"):
        parse_row({"x": 1}, "shiny")
    monkeypatch.setitem(FORMATS, "shiny", Format("shiny", parse, reasons=("too_shiny",)))
    with pytest.raises(RowRejected, match="too_shiny"):
        parse_row({"x": 1}, "shiny")


def test_common_prefix_len_matches_a_plain_scan():
    import random
    rng = random.Random(0)
    for _ in range(500):
        a = "".join(rng.choice("ab") for _ in range(rng.randint(0, 9)))
        b = "".join(rng.choice("ab") for _ in range(rng.randint(0, 9)))
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix_len(a, b) == n == common_prefix_len(list(a), list(b))


# ---------------------------------------------------------------------------------------------
# The lists users read are the registry's


def readme_format_table() -> list[str]:
    """The first column of the format table under README's "Using real data"."""
    section = (REPO_ROOT / "README.md").read_text(encoding="utf-8").split("\n## Using real data\n", 1)[1]
    table = re.search(r"^\| `format` \|.*\n\|[-| ]+\|\n((?:\|.*\n)+)", section, flags=re.M)
    assert table, "README's Using real data section has no table headed `format`"
    return re.findall(r"^\| `([^`]+)` \|", table.group(1), flags=re.M)


def test_format_lists_in_schema_params_comment_and_readme_are_the_registry():
    schema = yaml.safe_load((REPO_ROOT / "workflow/schemas/params.schema.yaml").read_text())
    enum = schema["properties"]["data"]["properties"]["sources"]["items"]["properties"]["format"]["enum"]
    [comment] = re.findall(r"format \(([a-z_|]+)\)", (REPO_ROOT / "params.yaml").read_text())
    registry = set(FORMAT_NAMES)
    assert set(enum) == registry, f"params.schema.yaml's format enum {enum} != the registry {sorted(registry)}"
    assert set(comment.split("|")) == registry, f"params.yaml's comment lists {comment}, the registry {sorted(registry)}"
    assert set(readme_format_table()) == registry, f"README's format table: {readme_format_table()}"
    assert len(enum) == len(set(enum)) and len(readme_format_table()) == len(registry)


def test_a_new_format_is_one_file(tmp_path):
    """A toy format dropped into a copy of stages/data/formats/ is found by the registry (auto detection
    included), reads a source through normalize, and is a code dependency of normalize (workflow/code_deps.py):
    nothing else in stages/ or workflow/ names it."""
    shutil.copytree(REPO_ROOT / "stages", tmp_path / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO_ROOT / "workflow", tmp_path / "workflow", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "stages/data/formats/qa.py").write_text(textwrap.dedent('''\
        """`qa`: {"q": question, "good": answer, "bad": answer}."""
        from stages.data.messages import Format, RowRejected, require_keys


        def parse(row, options=None):
            require_keys(row, ("q", "good", "bad"), "qa")
            if not row["good"].strip():
                raise RowRejected("no_good_answer", "good is empty")
            return ([{"role": "user", "content": row["q"]}], [{"role": "assistant", "content": row["good"]}],
                    [{"role": "assistant", "content": row["bad"]}], None)


        FORMAT = Format("qa", parse, detect=lambda row: {"q", "good", "bad"} <= row.keys(), detect_keys=("q", "good", "bad"),
                        auto_rank=50, reasons=("no_good_answer",))
        '''))
    (tmp_path / "qa.jsonl").write_text('{"q": "2+2?", "good": "4", "bad": "5"}\n{"q": "3+3?", "good": " ", "bad": "5"}\n')
    (tmp_path / "mixed.jsonl").write_text('{"q": "4+4?", "good": "8", "bad": "9"}\n{"prompt": "Q", "chosen": "a", "rejected": "b"}\n')
    script = textwrap.dedent('''\
        import json, sys
        sys.path.insert(0, "workflow")
        from code_deps import code_deps
        from stages.normalize import REASONS, normalize_sources
        res = normalize_sources([{"name": "a", "path": "qa.jsonl", "format": "qa"},
                                 {"name": "b", "path": "mixed.jsonl", "format": "auto"}])
        print(json.dumps({"reasons": REASONS, "stats": res.stats["sources"], "rejections": res.rejections,
                          "deps": code_deps("stages.normalize")}))
        ''')
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    out = yaml.safe_load(r.stdout)
    assert "no_good_answer" in out["reasons"]
    assert [(s["pairs_out"], s["rejected"]["no_good_answer"]) for s in out["stats"]] == [(1, 1), (2, 0)]
    assert [s["parsed_as"] for s in out["stats"]] == [{"qa": 1}, {"qa": 1, "trl": 1}]
    assert [(r["src_row"], r["reason"]) for r in out["rejections"]] == [(1, "no_good_answer")]
    assert "stages/data/formats/qa.py" in out["deps"]
