"""A stage's params view (stages/lib/declared_params.py): only declared keys can be read, each refusal names the key
and the stage; and the declarations held to what the stages really read (the e2e run's access log)."""
from __future__ import annotations

import copy
import json

import pytest

from stages.lib.declared_params import ACCESS_LOG_ENV, UndeclaredParamError, declared_view
from pipeline_helpers import declaration_gaps

PARAMS = {"train": {"lr": 0.1, "epochs": 2, "adapter": None}, "dpo": {"beta": 0.1}, "sft": None,
          "generation": {"policy": "trained", "grader": {"type": "regex", "pattern": "x"}}}


def test_a_declared_section_reads_whole_and_a_declared_key_reads_alone():
    p = declared_view(copy.deepcopy(PARAMS), "demo", ("dpo", "train.lr"))
    assert p["dpo"] == {"beta": 0.1} and json.dumps(p["dpo"])
    assert p["train"]["lr"] == 0.1
    assert p["train"].get("lr") == 0.1 and "lr" in p["train"]


@pytest.mark.parametrize("read, key", [
    (lambda p: p["train"]["epochs"], "train.epochs"),
    (lambda p: p["train"].get("epochs"), "train.epochs"),
    (lambda p: "adapter" in p["train"], "train.adapter"),
    (lambda p: p.get("sft"), "sft"),                # absent or null, its presence decides: still a read
    (lambda p: p["rm"], "rm"),                      # not in the file at all
    (lambda p: p["generation"]["grader"]["type"], "generation"),   # refused at the first undeclared level
])
def test_an_undeclared_key_raises_naming_it_and_the_stage(read, key):
    p = declared_view(copy.deepcopy(PARAMS), "demo", ("dpo", "train.lr"))
    with pytest.raises(UndeclaredParamError, match=rf"stage demo reads|stage demo tests for") as e:
        read(p)
    assert f"`{key}`" in str(e.value) and "STAGE_PARAMS['demo']" in str(e.value)


@pytest.mark.parametrize("whole", [dict, lambda t: dict(**t), lambda t: list(t), lambda t: t.items(), len, bool,
                                   json.dumps, copy.deepcopy, lambda t: {**t}, lambda t: t == {}])
def test_reading_a_partly_declared_section_whole_raises(whole):
    """Copying, iterating, dumping or truth-testing `train` would read epochs and adapter, which are not declared."""
    p = declared_view(copy.deepcopy(PARAMS), "demo", ("train.lr",))
    with pytest.raises(UndeclaredParamError, match=r"reads every key of `train`.*\['train.lr'\]"):
        whole(p["train"])


def test_star_declares_the_whole_file_and_views_are_read_only():
    assert declared_view(PARAMS, "report", ("*",)) is PARAMS
    p = declared_view(copy.deepcopy(PARAMS), "demo", ("dpo",))
    with pytest.raises(TypeError, match="read-only"):
        p["dpo"] = {}


def test_the_access_log_records_each_read_once(tmp_path, monkeypatch):
    log = tmp_path / "reads.jsonl"
    monkeypatch.setenv(ACCESS_LOG_ENV, str(log))
    p = declared_view(copy.deepcopy(PARAMS), "demo", ("dpo", "train.lr"))
    p["train"]["lr"], p["train"]["lr"], p["dpo"]["beta"]
    assert [json.loads(line) for line in log.read_text().splitlines()] == [
        {"stage": "demo", "read": "train.lr"}, {"stage": "demo", "read": "dpo"}]


def test_declaration_gaps_names_the_key_whose_deletion_goes_unnoticed():
    reads = {"a": {"train.lr", "dpo"}}
    assert declaration_gaps(reads, {"a": ("train.lr", "dpo")}) == []
    assert declaration_gaps(reads, {"a": ("train.lr", "dpo", "rm")}) == [
        "a: deleting `rm` from its declaration fails nothing: no run read it"]
    assert declaration_gaps(reads, {"a": ("dpo",)}) == ["a read `train.lr`, undeclared"]
