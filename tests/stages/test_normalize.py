"""stages.normalize: readers, provenance, duplicates, accounting, real HH-RLHF, globs and shards, the streaming
writer, the CLI. Each format's rows: tests/data/test_format_<name>.py; the registry and the shared rules:
tests/data/test_formats.py."""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from data_helpers import A, U
from stages.data.formats import parse_row
from stages.data.sources import SourceError, default_source_name, iter_source_rows, resolve_sources, source_paths
from stages.normalize import REASONS, main, normalize_sources

from conftest import REPO_ROOT


HH_ROW = {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Capital of France?\n\nAssistant: Paris.",
          "rejected": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Capital of France?\n\nAssistant: Lyon."}


def write_jsonl(path: Path, rows, gz=False):
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    if gz:
        path.write_bytes(gzip.compress(text.encode("utf-8"), mtime=0))
    else:
        path.write_text(text, encoding="utf-8")
    return path


# ----------------------------------------------------------------------------------------------
# Sources: readers, provenance, duplicates, accounting

def test_jsonl_rows_bad_json_blank_lines_and_provenance(tmp_path):
    good = {"prompt": "Q1", "chosen": "a", "rejected": "b"}
    lines = [good, "{not json", "", "null", "[1, 2]", '"text"', {"prompt": "Q2", "chosen": "a", "rejected": "a"},
             good, {"prompt": "Q3", "chosen": "c", "rejected": "d"}]
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    res = normalize_sources([{"name": "s", "path": str(path), "format": "trl"}])
    got = {(r["src_row"], r["reason"]) for r in res.rejections}
    assert got == {(1, "json"), (3, "schema"), (4, "schema"), (5, "schema"), (6, "identical_pair"), (7, "duplicate")}
    assert sorted(p["src_row"] for p in res.pairs) == [0, 8]
    bad = next(r for r in res.rejections if r["src_row"] == 1)
    assert bad["raw"] == "{not json" and bad["source"] == "s" and bad["src_file"] == str(path)
    assert "row 1" in bad["detail"]
    dup = next(r for r in res.rejections if r["reason"] == "duplicate")
    assert "row 0" in dup["detail"]
    s = res.stats["sources"][0]
    assert (s["rows_in"], s["blank_lines"], s["pairs_out"], s["rejected_total"]) == (8, 1, 2, 6)
    assert s["rejected"]["schema"] == 3 and s["rejected"]["json"] == 1


def test_raw_is_the_untruncated_original_line(tmp_path):
    long = {"prompt": "Q" * 5000, "chosen": "same", "rejected": "same", "note": "é"}
    line = json.dumps(long, ensure_ascii=False)
    # one good row too: a source that yields no pair is refused (test_a_source_yielding_no_pair_is_refused)
    path = write_jsonl(tmp_path / "d.jsonl", [line, {"prompt": "Q", "chosen": "a", "rejected": "b"}])
    res = normalize_sources([{"name": "s", "path": str(path), "format": "trl"}])
    assert res.rejections[0]["raw"] == line


def test_duplicates_across_sources_keep_the_first_source(tmp_path):
    row = {"prompt": "Q", "chosen": "a", "rejected": "b"}
    first = write_jsonl(tmp_path / "one.jsonl", [row])
    conv = {"prompt": [U("Q")], "chosen": [A("a")], "rejected": [A("b")]}  # same content, other spelling
    own = {"prompt": "Q2", "chosen": "c", "rejected": "d"}  # a source that yields no pair is refused
    second = write_jsonl(tmp_path / "two.jsonl", [{"x": 1}, conv, own])
    res = normalize_sources([{"name": "one", "path": str(first), "format": "trl"},
                             {"name": "two", "path": str(second), "format": "trl"}])
    assert sorted((p["source"], p["src_row"]) for p in res.pairs) == [("one", 0), ("two", 2)]
    assert [(r["source"], r["src_row"], r["reason"]) for r in res.rejections] == [("two", 0, "schema"),
                                                                                   ("two", 1, "duplicate")]
    assert res.stats["totals"]["rows_in"] == 4 and res.stats["totals"]["rejected"]["duplicate"] == 1


def test_a_pair_with_chosen_and_rejected_swapped_contradicts_the_earlier_one(tmp_path):
    rows = [{"prompt": "Q", "chosen": "a", "rejected": "b"}, {"prompt": "Q", "chosen": "c", "rejected": "a"},
            {"prompt": "Q", "chosen": "b", "rejected": "a"}, {"prompt": "Q2", "chosen": "b", "rejected": "a"}]
    src = write_jsonl(tmp_path / "s.jsonl", rows)
    res = normalize_sources([{"name": "s", "path": str(src), "format": "trl"}])
    assert sorted(p["src_row"] for p in res.pairs) == [0, 1, 3]
    [rej] = res.rejections
    assert (rej["src_row"], rej["reason"]) == (2, "contradicts") and "row 0" in rej["detail"]
    assert res.stats["totals"]["rejected"]["contradicts"] == 1


def test_json_parquet_and_jsonl_gz_readers_agree(tmp_path):
    rows = [{"prompt": [U(f"Q{i}")], "chosen": [A(f"yes {i}")], "rejected": [A(f"no {i}")]} for i in range(5)]
    rows[2] = {"prompt": [U("Q2")], "chosen": [A("same")], "rejected": [A("same")]}
    (tmp_path / "d.json").write_text(json.dumps(rows), encoding="utf-8")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    write_jsonl(tmp_path / "d.jsonl.gz", rows, gz=True)
    results = {}
    for name in ("d.json", "d.parquet", "d.jsonl.gz"):
        results[name] = normalize_sources([{"name": "s", "path": name, "format": "auto"}], base_dir=tmp_path)
    for res in results.values():
        assert [p["src_row"] for p in sorted(res.pairs, key=lambda p: p["src_row"])] == [0, 1, 3, 4]
        assert [(r["src_row"], r["reason"]) for r in res.rejections] == [(2, "identical_pair")]
    ids = {name: [p["pair_id"] for p in res.pairs] for name, res in results.items()}
    assert ids["d.json"] == ids["d.parquet"] == ids["d.jsonl.gz"]
    # parquet structs with null extra fields (schema unification) are accepted; raw keeps the row
    assert json.loads(results["d.parquet"].rejections[0]["raw"])["chosen"] == [A("same")]


def test_parquet_null_extra_struct_fields_are_tolerated_but_values_are_not(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "Q", "name": None}], "chosen": "a", "rejected": "b"},
            {"prompt": [{"role": "user", "content": "Q2", "name": "bob"}], "chosen": "a", "rejected": "b"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    res = normalize_sources([{"name": "s", "path": "d.parquet", "format": "trl"}], base_dir=tmp_path)
    assert [p["src_row"] for p in res.pairs] == [0]
    assert [(r["src_row"], r["reason"]) for r in res.rejections] == [(1, "schema")]


@pytest.mark.parametrize("name, content, match", [
    ("missing.jsonl", None, "not found"),
    ("d.csv", "a,b\n", "unknown file type"),
    ("d.json", '{"chosen": "a"}', "must be a list"),
    ("d.json", "{broken", "not a valid JSON document"),
    ("d.jsonl.gz", b"not gzip at all", "cannot read"),
    ("d.parquet", b"PAR1 garbage", "cannot read"),
])
def test_unreadable_file_fails_naming_the_file(tmp_path, name, content, match):
    if isinstance(content, str):
        (tmp_path / name).write_text(content)
    elif isinstance(content, bytes):
        (tmp_path / name).write_bytes(content)
    with pytest.raises(SourceError, match=match) as e:
        list(iter_source_rows(tmp_path / name))
    assert name in str(e.value)


def test_source_spec_errors(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"a": "x", "b": "y"}])
    with pytest.raises(SourceError, match="needs a columns mapping"):
        normalize_sources([{"name": "s", "path": str(path), "format": "columns"}])
    with pytest.raises(SourceError, match="only used with format 'columns'"):
        normalize_sources([{"name": "s", "path": str(path), "format": "trl", "columns": {"chosen": "a", "rejected": "b"}}])


def test_pair_id_is_the_content_hash_prefix():
    pair = parse_row({"prompt": "Q", "chosen": "a", "rejected": "b"}, "trl")
    blob = json.dumps({"prompt": [U("Q")], "chosen": [A("a")], "rejected": [A("b")]},
                      sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert pair.content_hash == hashlib.sha256(blob.encode()).hexdigest()
    assert pair.pair_id == pair.content_hash[:24]


# ----------------------------------------------------------------------------------------------
# Real HH-RLHF

def hh_render(messages):
    return "".join(f"\n\n{'Human' if m['role'] == 'user' else 'Assistant'}: {m['content']}" for m in messages)


def test_real_hh_rlhf_every_row_is_a_pair_or_a_reasoned_rejection(hh_rlhf_path):
    with gzip.open(hh_rlhf_path, "rt", encoding="utf-8") as f:
        originals = [json.loads(line) for line in f]
    res = normalize_sources([{"name": "hh", "path": str(hh_rlhf_path), "format": "hh"}])
    s = res.stats["sources"][0]
    assert s["rows_in"] == len(originals) == 2312
    pair_rows = [p["src_row"] for p in res.pairs]
    rej_rows = [r["src_row"] for r in res.rejections]
    assert sorted(pair_rows + rej_rows) == list(range(2312))  # each row exactly once
    assert s["pairs_out"] == len(pair_rows) and s["rejected_total"] == len(rej_rows)
    assert all(r["reason"] in REASONS and r["detail"] for r in res.rejections)
    assert len(res.pairs) > 2200
    for p in res.pairs:
        o = originals[p["src_row"]]
        # exact round trip: prompt + completion re-render each original transcript
        assert hh_render(p["prompt"] + p["chosen"]) == o["chosen"]
        assert hh_render(p["prompt"] + p["rejected"]) == o["rejected"]
        # and the split is at the LAST shared marker: the completions share no further marker
        c, r = " " + p["chosen"][0]["content"], " " + p["rejected"][0]["content"]
        n = 0
        while n < min(len(c), len(r)) and c[n] == r[n]:
            n += 1
        assert "\n\nAssistant:" not in c[:n]
    by_reason = {k: v for k, v in s["rejected"].items() if v}
    print(f"\nHH-RLHF: rows_in={s['rows_in']} pairs_out={s['pairs_out']} rejected={by_reason}")


# ----------------------------------------------------------------------------------------------
# CLI end to end, determinism

def make_project(tmp_path: Path) -> Path:
    """A tmp working dir with a params.yaml shaped like the repo's, sources in several formats."""
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "trl.jsonl", [{"prompt": f"Q{i}?", "chosen": f" yes{i}", "rejected": f" no{i}"} for i in range(6)]
                + ["{oops", {"prompt": "Q0?", "chosen": " yes0", "rejected": " no0"}])
    write_jsonl(data / "hh.jsonl.gz", [HH_ROW, {"chosen": "\n\nHuman: A\n\nAssistant: a",
                                              "rejected": "\n\nHuman: B\n\nAssistant: b"}], gz=True)
    (data / "sg.json").write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "Hi"}], "chosen": {"from": "gpt", "value": "Hello"},
         "rejected": {"from": "gpt", "value": "Bye"}}, None]), encoding="utf-8")
    pq.write_table(pa.Table.from_pylist([{"question": "2+2?", "good": "4", "bad": "5", "score": 0.5},
                                         {"question": "3+3?", "good": "6", "bad": "6", "score": 1.0}]),
                   data / "cols.parquet")
    with open(REPO_ROOT / "params.yaml", encoding="utf-8") as f:
        params = yaml.safe_load(f)
    params["data"]["sources"] = [
        {"name": "trl_src", "path": "data/trl.jsonl", "format": "trl"},
        {"name": "hh_src", "path": "data/hh.jsonl.gz", "format": "auto"},
        {"name": "sg_src", "path": "data/sg.json", "format": "sharegpt"},
        {"name": "col_src", "path": "data/cols.parquet", "format": "columns",
         "columns": {"prompt": "question", "chosen": "good", "rejected": "bad", "margin": "score"}},
    ]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    return tmp_path


def cli_args(out: str) -> list[str]:
    return ["--params", "params.yaml", "--pairs", f"{out}/pairs.parquet", "--rejections", f"{out}/rejections.parquet",
            "--stats", f"{out}/normalize_stats.json", "--log", f"{out}/normalize.log"]


def test_cli_end_to_end(tmp_path):
    proj = make_project(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    run = subprocess.run([sys.executable, "-m", "stages.normalize", *cli_args("results/normalize")],
                         cwd=proj, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    out = proj / "results" / "normalize"
    pairs = pq.read_table(out / "pairs.parquet")
    assert pairs.schema.field("prompt").type == pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    assert pairs.schema.field("margin").type == pa.float64() and pairs.schema.field("src_row").type == pa.int64()
    rows = pairs.to_pylist()
    assert [r["pair_id"] for r in rows] == sorted(r["pair_id"] for r in rows)
    assert sorted((r["source"], r["src_row"]) for r in rows) == (
        [("col_src", 0), ("hh_src", 0), ("sg_src", 0)] + [("trl_src", i) for i in range(6)])
    col = next(r for r in rows if r["source"] == "col_src")
    assert col["margin"] == 0.5 and col["src_file"] == "data/cols.parquet"
    assert all(r["margin"] is None for r in rows if r["source"] != "col_src")
    rej = pq.read_table(out / "rejections.parquet").to_pylist()
    assert [(r["source"], r["src_row"], r["reason"]) for r in rej] == [
        ("trl_src", 6, "json"), ("trl_src", 7, "duplicate"), ("hh_src", 1, "no_shared_prompt"),
        ("sg_src", 1, "schema"), ("col_src", 1, "identical_pair")]
    stats = json.loads((out / "normalize_stats.json").read_text())
    for s in stats["sources"]:
        assert s["rows_in"] == s["pairs_out"] + sum(s["rejected"].values())
    assert stats["totals"]["rows_in"] == 14 and stats["totals"]["pairs_out"] == 9
    assert "trl_src" in (out / "normalize.log").read_text()


def test_cli_is_byte_deterministic(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    monkeypatch.chdir(proj)
    assert main(cli_args("run1")) == 0
    assert main(cli_args("run2")) == 0
    for name in ("pairs.parquet", "rejections.parquet", "normalize_stats.json"):
        assert (proj / "run1" / name).read_bytes() == (proj / "run2" / name).read_bytes(), name


def test_cli_fails_on_missing_source_and_writes_nothing(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    (proj / "data" / "sg.json").unlink()
    monkeypatch.chdir(proj)
    with pytest.raises(SystemExit, match="data/sg.json"):
        main(cli_args("out"))
    assert not (proj / "out" / "pairs.parquet").exists()
    assert not (proj / "out" / "normalize_stats.json").exists()


@pytest.mark.parametrize("rows, message", [
    (["{oops", {"prompt": "Q", "chosen": "a", "rejected": "a"}, None],
     r"data.sources\[4\] \(bad\): data/bad.jsonl yields 0 pairs: all 3 rows were rejected \(json 1, schema 1, "
     r"identical_pair 1\); the first: json: data/bad.jsonl row 0: invalid JSON"),
    (["", "   "], r"data.sources\[4\] \(bad\): data/bad.jsonl yields 0 pairs: its 1 file\(s\) hold no row "
                   r"\(2 blank lines\)"),
    ([{"prompt": "Q0?", "chosen": " yes0", "rejected": " no0"}],   # all duplicates of an earlier source
     r"yields 0 pairs: all 1 rows were rejected \(duplicate 1\)"),
])
def test_a_source_yielding_no_pair_is_refused_and_nothing_is_written(tmp_path, monkeypatch, capsys, rows, message):
    """A source that gives no pair stops normalize with one line naming it and its rejections by reason, before
    any output is written: rejections.parquet of a refused run would stand beside no pairs.parquet (or an old
    one) as if complete. Before: logged at INFO, exit 0, a run that claims data it never used."""
    proj = make_project(tmp_path)
    (proj / "data" / "bad.jsonl").write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                                                     for r in rows))
    params = yaml.safe_load((proj / "params.yaml").read_text())
    params["data"]["sources"].append({"name": "bad", "path": "data/bad.jsonl", "format": "trl"})
    (proj / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    monkeypatch.chdir(proj)
    with pytest.raises(SystemExit) as e:
        main(cli_args("out"))
    assert e.value.code == 1
    [line] = [x for x in capsys.readouterr().err.splitlines() if "normalize: refused:" in x]
    assert re.search(message, line), line
    assert not (proj / "out").exists() or not any(p.suffix in (".parquet", ".json") for p in (proj / "out").iterdir())


def test_a_missing_source_is_refused_before_any_source_is_read(tmp_path, monkeypatch, capsys):
    """The last source's typo is found before the first source is read, named with its index, name and what
    its path was resolved against."""
    proj = make_project(tmp_path)
    params = yaml.safe_load((proj / "params.yaml").read_text())
    params["data"]["sources"].append({"path": "data/typo.jsonl", "format": "trl"})
    (proj / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    monkeypatch.chdir(proj)
    with pytest.raises(SystemExit):
        main(cli_args("out"))
    [line] = [x for x in capsys.readouterr().err.splitlines() if "normalize: refused:" in x]
    assert line.endswith(f"normalize: refused: data.sources[4] (typo): data/typo.jsonl: no such file "
                         f"(relative to {proj.resolve()})"), line
    assert "source trl_src" not in (proj / "out" / "normalize.log").read_text()  # nothing was read


# ----------------------------------------------------------------------------------------------
# Sources as users have them: globs and directories of shards, default names

def _shard_rows() -> list[dict]:
    """Rows with bad ones and a duplicate across shards (so the read order decides what is kept)."""
    rows = [{"prompt": [U(f"Q{i}")], "chosen": [A(f"yes {i}")], "rejected": [A(f"no {i}")]} for i in range(20)]
    rows[4] = {"prompt": [U("Q4")], "chosen": [A("same")], "rejected": [A("same")]}     # identical_pair
    rows[9] = {"prompt": [U("Q9")], "chosen": [A("yes 9")], "rejected": None}           # schema
    rows[17] = dict(rows[2])                                                           # duplicate of row 2
    return rows


def _write_shards(root: Path, rows: list[dict], bounds: list[int], name: str = "train") -> list[Path]:
    """Shards named as `hf download` leaves them, written in reverse so the directory order is not the sort order."""
    n = len(bounds) - 1
    paths = [root / "data" / f"{name}-{k:05d}-of-{n:05d}.parquet" for k in range(n)]
    (root / "data").mkdir(parents=True, exist_ok=True)
    for k in reversed(range(n)):
        pq.write_table(pa.Table.from_pylist(rows[bounds[k]:bounds[k + 1]]), paths[k])
    return paths


def _content(res) -> list[tuple]:
    return sorted((p["pair_id"], p["content_hash"], json.dumps([p["prompt"], p["chosen"], p["rejected"]]), p["margin"])
                  for p in res.pairs)


def _assert_same_pairs_as_concatenated(sharded, whole, shards: list[str], bounds: list[int], whole_file: str):
    assert _content(sharded) == _content(whole)
    offset = {path: bounds[k] for k, path in enumerate(shards)}
    # Provenance: the shard file and the row in it, which is the concatenated file's row minus the offset.
    by_id = {p["pair_id"]: p for p in whole.pairs}
    for p in sharded.pairs:
        assert p["src_file"] in offset
        assert offset[p["src_file"]] + p["src_row"] == by_id[p["pair_id"]]["src_row"]
        assert by_id[p["pair_id"]]["src_file"] == whole_file
    assert [(offset[r["src_file"]] + r["src_row"], r["reason"], r["raw"]) for r in sharded.rejections] == \
        [(r["src_row"], r["reason"], r["raw"]) for r in whole.rejections]
    stat = sharded.stats["sources"][0]
    assert [f["path"] for f in stat["files"]] == shards
    assert [f["rows"] for f in stat["files"]] == [b - a for a, b in zip(bounds, bounds[1:])]
    for key in ("rows_in", "pairs_out", "rejected", "rejected_total", "parsed_as"):
        assert stat[key] == whole.stats["sources"][0][key], key


def test_glob_of_parquet_shards_normalizes_like_the_concatenated_file(tmp_path):
    rows, bounds = _shard_rows(), [0, 7, 8, 20]
    dl = tmp_path / "dl"
    _write_shards(dl, rows, bounds)
    _write_shards(dl, rows[:3], [0, 3], name="test")               # another split: not matched by the glob
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "all.parquet")
    shards = [f"dl/data/train-{k:05d}-of-00003.parquet" for k in range(3)]
    assert source_paths("dl/data/train-*.parquet", tmp_path) == shards

    whole = normalize_sources([{"path": "all.parquet", "format": "trl"}], base_dir=tmp_path)
    sharded = normalize_sources([{"path": "dl/data/train-*.parquet", "format": "trl"}], base_dir=tmp_path)
    _assert_same_pairs_as_concatenated(sharded, whole, shards, bounds, "all.parquet")
    assert [(r["reason"]) for r in whole.rejections] == ["identical_pair", "schema", "duplicate"]
    # The duplicate (row 17, shard 2) names the first occurrence by its shard file and row.
    dup = next(r for r in sharded.rejections if r["reason"] == "duplicate")
    assert dup["src_file"] == shards[2] and f"{shards[0]} row 2" in dup["detail"]
    assert sharded.stats["sources"][0]["name"] == "train" and whole.stats["sources"][0]["name"] == "all"


def test_real_hh_rows_as_jsonl_gz_and_parquet_shards_match_the_file(hh_rlhf_path, tmp_path):
    """The real HH-RLHF file split into .jsonl.gz and parquet shards, read through globs and a directory."""
    lines = gzip.decompress(hh_rlhf_path.read_bytes()).decode("utf-8").splitlines()
    bounds = [0, 500, 1000, 1700, len(lines)]
    (tmp_path / "gz").mkdir()
    (tmp_path / "pq" / "data").mkdir(parents=True)
    for k in reversed(range(4)):
        part = lines[bounds[k]:bounds[k + 1]]
        write_jsonl(tmp_path / "gz" / f"harmless-{k:02d}.jsonl.gz", part, gz=True)
        pq.write_table(pa.Table.from_pylist([json.loads(line) for line in part]),
                       tmp_path / "pq" / "data" / f"train-{k:05d}-of-00004.parquet")
    # What `hf download` leaves beside the shards: a card and its .cache/ bookkeeping, no data.
    (tmp_path / "pq" / "README.md").write_text("# card")
    (tmp_path / "pq" / ".cache" / "huggingface").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{"chosen": "x", "rejected": "y"}]),
                   tmp_path / "pq" / ".cache" / "huggingface" / "stale.parquet")

    whole = normalize_sources([{"name": "hh", "path": str(hh_rlhf_path), "format": "hh"}])
    assert len(whole.pairs) == 2299
    gz_shards = [f"gz/harmless-{k:02d}.jsonl.gz" for k in range(4)]
    pq_shards = [f"pq/data/train-{k:05d}-of-00004.parquet" for k in range(4)]
    assert source_paths("pq/", tmp_path) == pq_shards
    for path, shards in (("gz/*.jsonl.gz", gz_shards), ("pq", pq_shards), ("pq/**/*.parquet", pq_shards)):
        sharded = normalize_sources([{"name": "hh", "path": path, "format": "hh"}], base_dir=tmp_path)
        _assert_same_pairs_as_concatenated(sharded, whole, shards, bounds, str(hh_rlhf_path))


def test_source_name_defaults_to_the_file_stem_made_unique(tmp_path):
    assert default_source_name("../shared/data/hh-rlhf/harmless-base-test.jsonl.gz") == "harmless-base-test"
    assert default_source_name("data/train-*.parquet") == "train"
    assert default_source_name("data/raw/hh-rlhf/harmless-base/") == "harmless-base"
    assert default_source_name("data/raw/ultrafeedback/*.jsonl.gz") == "ultrafeedback"
    assert default_source_name("prefs v2.json") == "prefs_v2"
    assert default_source_name("**/*.parquet") == "source"

    specs = [{"path": "a/train.jsonl", "format": "trl"}, {"name": "train_2", "path": "x.jsonl", "format": "trl"},
             {"path": "b/train.jsonl.gz", "format": "trl"}, {"path": "c/train-*.parquet", "format": "trl"}]
    assert [s["name"] for s in resolve_sources(specs)] == ["train", "train_2", "train_3", "train_4"]
    assert "name" not in specs[0]  # the params are not modified
    with pytest.raises(SourceError, match=r"data.sources\[1\]: name 'x' is also the name of data.sources\[0\]"):
        resolve_sources([{"name": "x", "path": "a.jsonl", "format": "trl"},
                         {"name": "x", "path": "b.jsonl", "format": "trl"}])

    # Through the stage: the default name is every pair's `source` and the stats' name.
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        write_jsonl(tmp_path / d / "prefs.jsonl", [{"prompt": f"Q {d}", "chosen": "yes", "rejected": "no"}])
    res = normalize_sources([{"path": "a/prefs.jsonl", "format": "trl"}, {"path": "b/prefs.jsonl", "format": "trl"}],
                            base_dir=tmp_path)
    assert [s["name"] for s in res.stats["sources"]] == ["prefs", "prefs_2"]
    assert sorted((p["source"], p["src_file"]) for p in res.pairs) == [("prefs", "a/prefs.jsonl"),
                                                                       ("prefs_2", "b/prefs.jsonl")]


@pytest.mark.parametrize("pattern, match", [
    ("data/train-*.parquet", r"data/train-\*.parquet: the glob matches no .jsonl"),
    ("data/*.md", r"data/\*.md: the glob matches no .jsonl.*; it matches 1 file\(s\) of other types, e.g. data/README.md"),
    ("empty", r"empty: the directory holds no .jsonl"),
    ("meta", r"meta: the directory holds no .jsonl.*hidden entries skipped"),
])
def test_a_glob_or_directory_naming_no_data_file_is_an_error(tmp_path, monkeypatch, pattern, match):
    proj = make_project(tmp_path)
    (proj / "data" / "README.md").write_text("# card")
    (proj / "empty").mkdir()
    (proj / "meta" / ".cache").mkdir(parents=True)
    write_jsonl(proj / "meta" / ".cache" / "x.jsonl", [{"prompt": "Q", "chosen": "a", "rejected": "b"}])
    with pytest.raises(SourceError, match=match):
        source_paths(pattern, proj)
    params = yaml.safe_load((proj / "params.yaml").read_text())
    params["data"]["sources"].append({"path": pattern, "format": "trl"})
    (proj / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    monkeypatch.chdir(proj)
    with pytest.raises(SystemExit, match=match):
        main(cli_args("out"))
    assert not (proj / "out" / "pairs.parquet").exists()


def test_cli_reads_a_nameless_glob_source(tmp_path, monkeypatch):
    """params.yaml without `name` passes the schema; the shards' provenance reaches pairs.parquet."""
    proj = make_project(tmp_path)
    rows, bounds = _shard_rows(), [0, 10, 20]
    _write_shards(proj / "raw", rows, bounds)
    params = yaml.safe_load((proj / "params.yaml").read_text())
    params["data"]["sources"] = [{"path": "raw/data/train-*.parquet", "format": "auto"}]
    (proj / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    monkeypatch.chdir(proj)
    assert main(cli_args("out")) == 0
    pairs = pq.read_table(proj / "out" / "pairs.parquet").to_pylist()
    assert {p["source"] for p in pairs} == {"train"}
    assert {p["src_file"] for p in pairs} == {f"raw/data/train-{k:05d}-of-00002.parquet" for k in range(2)}
    stats = json.loads((proj / "out" / "normalize_stats.json").read_text())
    assert stats["sources"][0]["path"] == "raw/data/train-*.parquet"
    assert [f["path"] for f in stats["sources"][0]["files"]] == [
        f"raw/data/train-{k:05d}-of-00002.parquet" for k in range(2)]


def test_snakemake_and_dvc_list_every_shard_as_a_dependency(tmp_path):
    """The rule's inputs (and so dvc.yaml's deps) are source_paths' files, whatever the path's form."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO_ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):  # the files a fresh clone has
        if (REPO_ROOT / rel).is_file():
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / rel, tmp_path / rel)
    rows = _shard_rows()
    _write_shards(tmp_path / "raw", rows, [0, 5, 10, 20])
    write_jsonl(tmp_path / "extra.jsonl.gz", rows[:2], gz=True)
    params = yaml.safe_load((tmp_path / "params.yaml").read_text())
    params["data"]["sources"] = [{"path": "raw/data/train-*.parquet", "format": "trl"},
                                 {"path": "extra.jsonl.gz", "format": "trl"}]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    r = subprocess.run([sys.executable, "workflow/sync_dvc.py"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    deps = yaml.safe_load((tmp_path / "dvc.yaml").read_text())["stages"]["normalize"]["deps"]
    data_deps = [d for d in deps if not d.startswith(("stages/", "results/"))]
    assert data_deps == [f"raw/data/train-{k:05d}-of-00003.parquet" for k in range(3)] + ["extra.jsonl.gz"]
    assert data_deps == [f for s in params["data"]["sources"] for f in source_paths(s["path"], tmp_path)]


# ----------------------------------------------------------------------------------------------
# Streaming (issue 19): normalize_to_files writes what the in-memory path writes, byte for byte

def _old_read_jsonl(data: bytes) -> list[tuple[int, str, bool]]:
    """The pre-streaming jsonl splitter (whole file in memory), kept as the reference."""
    out = []
    for i, line in enumerate(data.split(b"\n")):
        if i == 0 and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]
        if line.endswith(b"\r"):
            line = line[:-1]
        text = line.decode("utf-8", "backslashreplace")
        out.append((i, text, not text.strip()))
    if out and out[-1][2] and out[-1][1] == "":
        out.pop()
    return out


@pytest.mark.parametrize("data", [b"", b"\n", b"\n\n", b"{}", b"{}\n", b"{}\r", b"{}\n\r", b"\xef\xbb\xbf{}\r\n \n",
                                  b"{}\n  ", b"\xef\xbb\xbf", b"a\n\xff\n{}\n\n\r\n"])
def test_streaming_jsonl_lines_match_the_whole_file_split(data, tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(data)
    from stages.data.sources import BLANK

    got = [(r.src_row, r.raw, r.value is BLANK) for r in iter_source_rows(path)]
    assert got == _old_read_jsonl(data)


def test_the_streaming_writer_gives_the_same_bytes_for_any_piece_size(hh_rlhf_path, tmp_path, monkeypatch):
    """normalize_to_files, the stage's one path: pieces of 64, 1000 or 4096 rows (stages/data/spill.py) give the
    same bytes, and the files hold what the reader finds, pairs sorted by pair_id, rejections in read order. (The
    default pipeline's bytes are the committed record: tests/workflow/test_pipeline_e2e.py.)"""
    import stages.data.spill as spill
    import stages.lib.io as io
    from stages.lib.io import read_parquet
    from stages.normalize import normalize_to_files

    # Small row groups so that the real HH file spans many (the contract's row-group size is 65536; what is
    # tested is that pieces never show in the bytes).
    monkeypatch.setattr(io, "PARQUET_ROW_GROUP", 700)
    dup = tmp_path / "dup.jsonl"  # duplicates and bad rows: rejections span pieces too
    lines = gzip.open(hh_rlhf_path, "rt").read().splitlines()[:300]
    own = json.dumps({"prompt": "own", "chosen": "a", "rejected": "b"})  # a source must yield a pair
    dup.write_text("\n".join(lines + ["not json", "{}", own]) + "\n")
    sources = [{"name": "hh", "path": str(hh_rlhf_path), "format": "hh"}, {"name": "dup", "path": str(dup),
                                                                            "format": "auto"}]
    found = normalize_sources(sources)
    assert len(found.pairs) > 1400 and len(found.rejections) > 300
    outputs = {}
    for rows in (64, 1000, 4096):
        monkeypatch.setattr(spill, "SINK_ROWS", rows)
        out = tmp_path / f"out{rows}"
        stats = normalize_to_files(sources, str(out / "pairs.parquet"), str(out / "rej.parquet"))
        assert stats == found.stats
        assert sorted(p.name for p in out.iterdir()) == ["pairs.parquet", "rej.parquet"]  # no spill left
        outputs[rows] = [(out / name).read_bytes() for name in ("pairs.parquet", "rej.parquet")]
    assert outputs[64] == outputs[1000] == outputs[4096]
    assert read_parquet(tmp_path / "out64" / "pairs.parquet").to_pylist() == sorted(found.pairs,
                                                                                   key=lambda p: p["pair_id"])
    assert read_parquet(tmp_path / "out64" / "rej.parquet").to_pylist() == found.rejections


def test_a_source_outside_the_repository_is_found_from_a_dvc_experiment_copy(tmp_path, monkeypatch):
    """`dvc exp run --queue` runs the stages in a copy of the repository (.dvc/tmp/exps/...) with DVC_ROOT naming
    the workspace: a source written `../ext/...` is the file beside the workspace, read from there and named by
    its absolute path in the rule's inputs (dvc.yaml's deps), while pairs keep the path as written."""
    from stages.lib.io import data_location, leaves_repository
    workspace, copy, ext = tmp_path / "ws", tmp_path / "ws/.dvc/tmp/exps/tmp1", tmp_path / "ext"
    for d in (workspace, copy, ext):
        d.mkdir(parents=True, exist_ok=True)
    (ext / "p.jsonl").write_text(json.dumps({"prompt": "q?", "chosen": "yes", "rejected": "no"}) + "\n")
    source = {"path": "../ext/p.jsonl", "format": "trl"}
    assert leaves_repository("../ext/p.jsonl") and not leaves_repository("data/../data/x.jsonl")
    monkeypatch.setenv("DVC_ROOT", str(workspace))
    assert data_location("../ext/p.jsonl", copy) == str(ext / "p.jsonl")
    assert data_location("data/x.jsonl", copy) == "data/x.jsonl"
    result = normalize_sources([source], base_dir=copy)
    assert [p["src_file"] for p in result.pairs] == ["../ext/p.jsonl"]
    monkeypatch.delenv("DVC_ROOT")
    with pytest.raises(SourceError, match=r"\.\./ext/p\.jsonl: no such file"):    # the copy is not beside ext/
        normalize_sources([source], base_dir=copy)
