"""The dev split (issue 37 item 3, probe.dev_size): frozen beside the probe by freeze_probe, disjoint from the probe
and from train by normalized prompt, seeded and order-independent, refused when too big; the probe is the same with
or without it."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pyarrow as pa
import pytest
import yaml

from conftest import REPO_ROOT
from data_helpers import bot, embedded_identity, leaky_rows, pairs_table, user
from stages.freeze_probe import (DEV_LEAK, LEAK, ProbeError, freeze_probe, freeze_probe_file, probe_digest,
                                 prompt_key, selection_rank)
from stages.lib.io import read_json, read_parquet, sha256_file, write_parquet


def shuffled(table: pa.Table, seed: int) -> pa.Table:
    idx = list(range(table.num_rows))
    random.Random(seed).shuffle(idx)
    return table.take(pa.array(idx))


def keys(table: pa.Table) -> list[str]:
    return [prompt_key(p) for p in table.column("prompt").to_pylist()]


def test_dev_is_disjoint_from_probe_and_train_and_every_pair_is_accounted_for():
    table = pairs_table(leaky_rows())            # 150 pairs, 60 prompts, whitespace variants among the repeats
    split = freeze_probe(shuffled(table, 3), size=20, seed=5, dev_size=15)
    m, dev = split.manifest, split.dev
    assert dev.num_rows == 15 == len(set(keys(dev)))                     # one pair per prompt
    assert not set(keys(dev)) & set(keys(split.probe))
    assert not set(keys(dev)) & set(keys(split.train))
    assert not set(keys(split.probe)) & set(keys(split.train))
    d = m["dev"]
    assert dev.column("pair_id").to_pylist() == d["pair_ids"]
    assert d["dev_digest"] == probe_digest(d["pair_ids"], d["content_hashes"])
    by_id = {r["pair_id"]: prompt_key(r["prompt"]) for r in table.to_pylist()}
    expected = sorted(pid for pid, k in by_id.items() if k in set(keys(dev)) and pid not in d["pair_ids"])
    assert [e["pair_id"] for e in d["excluded_from_train"]] == expected and expected
    assert {e["reason"] for e in d["excluded_from_train"]} == {DEV_LEAK}
    assert {e["reason"] for e in m["excluded_from_train"]} == {LEAK}
    accounted = (split.train.column("pair_id").to_pylist() + m["pair_ids"] + d["pair_ids"]
                 + [e["pair_id"] for e in m["excluded_from_train"] + d["excluded_from_train"]])
    assert sorted(accounted) == sorted(by_id)
    assert m["train_pairs"] == split.train.num_rows


def test_the_probe_is_the_same_with_or_without_a_dev_split_and_dev_continues_its_walk():
    table = pairs_table([{"prompt": user(f"prompt {i}"), "chosen": bot("yes"), "rejected": bot("no")}
                         for i in range(300)])
    without, with_dev = freeze_probe(table, size=40, seed=99), freeze_probe(table, size=40, seed=99, dev_size=30)
    assert with_dev.probe.equals(without.probe)
    assert {k: v for k, v in with_dev.manifest.items() if k not in ("dev", "train_pairs")} == {
        k: v for k, v in without.manifest.items() if k not in ("dev", "train_pairs")}
    ranked = sorted(table.column("pair_id").to_pylist(), key=lambda p: selection_rank(99, p))
    assert with_dev.manifest["dev"]["pair_ids"] == ranked[40:70]
    assert with_dev.train.num_rows == 230 and without.manifest["dev"] is None and without.dev is None


def test_dev_split_is_seeded_and_independent_of_row_order(tmp_path):
    table = pairs_table(leaky_rows())
    outputs = []
    for order in (0, 1, 2):
        split = freeze_probe(shuffled(table, order), size=20, seed=8, dev_size=12)
        d = tmp_path / str(order)
        for name in ("train", "probe", "dev"):
            write_parquet(d / f"{name}.parquet", getattr(split, name))
        outputs.append((json.dumps(split.manifest, sort_keys=True),
                        *(sha256_file(d / f"{n}.parquet") for n in ("train", "probe", "dev"))))
    assert outputs[0] == outputs[1] == outputs[2]
    other = freeze_probe(table, size=20, seed=9, dev_size=12).manifest["dev"]["pair_ids"]
    assert other != json.loads(outputs[0][0])["dev"]["pair_ids"]


def test_a_dev_split_larger_than_the_prompts_left_after_the_probe_is_refused_naming_the_numbers(tmp_path):
    table = pairs_table(leaky_rows())            # 60 distinct prompts
    with pytest.raises(ProbeError, match=r"probe.dev_size is 41 but only 40 distinct prompts remain after the "
                                         r"probe's 20 \(60 distinct prompts, 150 pairs\)"):
        freeze_probe(table, size=20, seed=0, dev_size=41)
    write_parquet(tmp_path / "pairs.parquet", table)
    with pytest.raises(ProbeError, match=r"probe.dev_size is 41 but only 40 distinct prompts remain"):
        freeze_probe_file(str(tmp_path / "pairs.parquet"), 20, 0, train_path=str(tmp_path / "t.parquet"),
                          probe_path=str(tmp_path / "p.parquet"), dev_size=41, dev_path=str(tmp_path / "d.parquet"))
    split = freeze_probe(table, size=20, seed=0, dev_size=40)  # every prompt left: train is empty
    assert split.dev.num_rows == 40 and split.train.num_rows == 0


def test_streaming_dev_split_is_byte_identical_to_in_memory(tmp_path, monkeypatch):
    import stages.lib.io as io
    monkeypatch.setattr(io, "PARQUET_ROW_GROUP", 16)
    table = pairs_table(leaky_rows())
    order = sorted(range(table.num_rows), key=lambda i: table.column("pair_id")[i].as_py())
    write_parquet(tmp_path / "pairs.parquet", table.take(pa.array(order)))    # normalize's order: the streaming path
    ref = freeze_probe(table, size=20, seed=3, dev_size=10)
    for name in ("train", "probe", "dev"):
        write_parquet(tmp_path / f"ref_{name}.parquet", getattr(ref, name))
    for chunk_rows in (7, 5000):
        manifest = freeze_probe_file(str(tmp_path / "pairs.parquet"), 20, 3, chunk_rows=chunk_rows,
                                     train_path=str(tmp_path / "train.parquet"),
                                     probe_path=str(tmp_path / "probe.parquet"), dev_size=10,
                                     dev_path=str(tmp_path / "dev.parquet"))
        assert manifest == ref.manifest
        for name in ("train", "probe", "dev"):
            assert (tmp_path / f"{name}.parquet").read_bytes() == (tmp_path / f"ref_{name}.parquet").read_bytes()


def test_cli_writes_the_dev_split_and_refuses_a_missing_dev_path(tmp_path):
    pairs = tmp_path / "pairs.parquet"
    write_parquet(pairs, pairs_table(leaky_rows()))
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["probe"] = {"size": 20, "seed": 11, "dev_size": 10}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    embedded_identity(tmp_path)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "stages.freeze_probe", "--params", str(tmp_path / "params.yaml"), "--pairs",
           str(pairs), "--identity", str(tmp_path / "ref_identity.json"), "--train", str(out / "train.parquet"),
           "--probe", str(out / "probe.parquet"), "--manifest", str(out / "probe_manifest.json"),
           "--log", str(out / "freeze_probe.log")]
    refused = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    assert refused.returncode == 1 and "--dev (the dev split's parquet) is required" in refused.stderr
    done = subprocess.run(cmd + ["--dev", str(out / "dev.parquet")], cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    m = read_json(out / "probe_manifest.json")
    assert read_parquet(out / "dev.parquet").column("pair_id").to_pylist() == m["dev"]["pair_ids"]
    assert len(m["dev"]["pair_ids"]) == 10 and m["dev"]["fit_skipped"] == 0
    assert "dev split 10 pairs" in (out / "freeze_probe.log").read_text()
