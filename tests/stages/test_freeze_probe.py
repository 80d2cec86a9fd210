"""freeze_probe: order-independent seeded selection, prompt-leak exclusion, errors, the CLI."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import yaml

from conftest import REPO_ROOT
from data_helpers import bot, embedded_identity, leaky_rows, pairs_table, user, write_probe_params
from stages.embedded_data import build_rows
from stages.freeze_probe import LEAK, ProbeError, freeze_probe, probe_digest, prompt_key, selection_rank
from stages.lib.contracts import PAIRS_SCHEMA
from stages.lib.io import read_json, read_parquet, sha256_file, sha256_json, write_parquet


def shuffled(table: pa.Table, seed: int) -> pa.Table:
    idx = list(range(table.num_rows))
    random.Random(seed).shuffle(idx)
    return table.take(pa.array(idx))


@pytest.fixture(scope="module")
def embedded_pairs() -> pa.Table:
    return pairs_table(build_rows(), source="embedded")


# ==================================================================================================
# Selection
# ==================================================================================================


def test_probe_is_independent_of_row_order(embedded_pairs, tmp_path):
    outputs = []
    for seed in (0, 1, 2):
        split = freeze_probe(shuffled(embedded_pairs, seed), size=512, seed=20261202)
        d = tmp_path / str(seed)
        write_parquet(d / "train.parquet", split.train)
        write_parquet(d / "probe.parquet", split.probe)
        outputs.append((json.dumps(split.manifest, sort_keys=True),
                        sha256_file(d / "train.parquet"), sha256_file(d / "probe.parquet")))
    assert outputs[0] == outputs[1] == outputs[2]


def test_embedded_default_split(embedded_pairs):
    split = freeze_probe(embedded_pairs, size=512, seed=20261202)
    m = split.manifest
    assert split.probe.num_rows == len(m["pair_ids"]) == 512
    assert split.probe.column("pair_id").to_pylist() == m["pair_ids"]
    assert split.probe.column("content_hash").to_pylist() == m["content_hashes"]
    assert m["probe_digest"] == sha256_json([[p, c] for p, c in zip(m["pair_ids"], m["content_hashes"])])
    assert split.train.num_rows == m["train_pairs"] >= 2000
    # The embedded data repeats 300 prompts, so some probe prompts must have dragged a pair out of train.
    assert len(m["excluded_from_train"]) > 0
    assert split.train.num_rows + 512 + len(m["excluded_from_train"]) == embedded_pairs.num_rows
    train_ids = split.train.column("pair_id").to_pylist()
    assert train_ids == sorted(train_ids)
    assert split.train.schema == split.probe.schema == embedded_pairs.schema


def test_distinct_prompts_probe_is_lowest_ranks():
    """With one pair per prompt the probe is exactly the `size` lowest keyed-hash ranks, in order."""
    table = pairs_table([{"prompt": user(f"prompt {i}"), "chosen": bot("yes"), "rejected": bot("no")}
                         for i in range(300)])
    split = freeze_probe(table, size=40, seed=99)
    expected = sorted(table.column("pair_id").to_pylist(), key=lambda p: selection_rank(99, p))[:40]
    assert split.manifest["pair_ids"] == expected
    assert split.manifest["excluded_from_train"] == []
    assert split.train.num_rows == 260


def test_seed_changes_probe(embedded_pairs):
    a = freeze_probe(embedded_pairs, size=512, seed=1).manifest
    b = freeze_probe(embedded_pairs, size=512, seed=2).manifest
    assert a["probe_digest"] != b["probe_digest"]
    assert set(a["pair_ids"]) != set(b["pair_ids"])
    assert a["seed"] == 1 and b["seed"] == 2


def test_no_probe_prompt_in_train():
    table = pairs_table(leaky_rows())
    assert len({prompt_key(p) for p in table.column("prompt").to_pylist()}) == 60
    split = freeze_probe(shuffled(table, 3), size=25, seed=5)
    probe_keys = [prompt_key(p) for p in split.probe.column("prompt").to_pylist()]
    train_keys = {prompt_key(p) for p in split.train.column("prompt").to_pylist()}
    assert len(set(probe_keys)) == 25  # one pair per prompt
    assert not set(probe_keys) & train_keys
    # Every pair that shares a probe prompt (whitespace variants included) is listed, none other.
    excluded = split.manifest["excluded_from_train"]
    by_id = {r["pair_id"]: prompt_key(r["prompt"]) for r in table.to_pylist()}
    expected = sorted(pid for pid, key in by_id.items() if key in set(probe_keys)
                      and pid not in split.manifest["pair_ids"])
    assert [e["pair_id"] for e in excluded] == expected and expected
    assert {e["reason"] for e in excluded} == {LEAK}
    accounted = (split.train.column("pair_id").to_pylist() + split.manifest["pair_ids"]
                 + [e["pair_id"] for e in excluded])
    assert sorted(accounted) == sorted(by_id)


def test_prompt_key_normalizes_whitespace_only():
    assert prompt_key(user(" a  b\nc ")) == prompt_key(user("a b c"))
    assert prompt_key(user("a b c")) != prompt_key(user("A b c"))
    assert prompt_key(user("a b c")) != prompt_key([{"role": "system", "content": "a b c"}])


# ==================================================================================================
# Errors
# ==================================================================================================


def test_too_few_distinct_prompts():
    table = pairs_table(leaky_rows())  # 150 pairs, 60 distinct prompts
    with pytest.raises(ProbeError, match=r"60 distinct prompts \(150 pairs\) but probe.size is 61"):
        freeze_probe(table, size=61, seed=0)
    split = freeze_probe(table, size=60, seed=0)  # every prompt in the probe: train is empty
    assert split.train.num_rows == 0 and split.probe.num_rows == 60


def test_tampered_content_hash_is_refused():
    rows = pairs_table(leaky_rows()).to_pylist()
    rows[7]["chosen"] = bot("edited after hashing")
    with pytest.raises(ProbeError, match=r"row 7 .*content_hash .* does not match"):
        freeze_probe(pa.Table.from_pylist(rows, schema=PAIRS_SCHEMA), size=5, seed=0)


def test_duplicate_pair_id_is_refused():
    table = pairs_table(leaky_rows())
    with pytest.raises(ProbeError, match="duplicate pair_id"):
        freeze_probe(pa.concat_tables([table, table.slice(0, 1)]), size=5, seed=0)


def test_missing_column_is_refused():
    with pytest.raises(ProbeError, match=r"missing column\(s\) \['content_hash'\]"):
        freeze_probe(pairs_table(leaky_rows()).drop_columns(["content_hash"]), size=5, seed=0)


# ==================================================================================================
# CLI
# ==================================================================================================


def run_cli(tmp_path: Path, params: Path, pairs: Path, out: str) -> subprocess.CompletedProcess:
    d = tmp_path / out
    identity = tmp_path / "ref_identity.json"
    if not identity.exists():
        embedded_identity(tmp_path)
    cmd = [sys.executable, "-m", "stages.freeze_probe", "--params", str(params), "--pairs", str(pairs),
           "--identity", str(identity), "--train", str(d / "train.parquet"), "--probe", str(d / "probe.parquet"),
           "--manifest", str(d / "probe_manifest.json"), "--log", str(d / "freeze_probe.log")]
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)


def test_cli_end_to_end(tmp_path):
    table = pairs_table(leaky_rows())
    pairs = tmp_path / "pairs.parquet"
    write_parquet(pairs, table)
    params = write_probe_params(tmp_path, size=20, seed=11)

    first = run_cli(tmp_path, params, pairs, "a")
    assert first.returncode == 0, first.stderr
    write_parquet(pairs, shuffled(table, 1))  # same pairs, other row order
    assert run_cli(tmp_path, params, pairs, "b").returncode == 0
    for name in ("train.parquet", "probe.parquet", "probe_manifest.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name

    m = read_json(tmp_path / "a" / "probe_manifest.json")
    assert set(m) == {"format", "size", "seed", "selection", "pair_ids", "content_hashes", "probe_digest",
                      "train_pairs", "excluded_from_train", "fit", "dev"}
    assert m["format"] == "prefpipe-probe-manifest/1" and m["dev"] is None
    # The limits (not the workers, nor tokenize.chat_template: the rendering is not a limit, and recording it would
    # change the default's manifest bytes)
    assert m["fit"]["limits"] == {k: v for k, v in yaml.safe_load(params.read_text())["tokenize"].items()
                                  if k not in ("workers", "chat_template")}
    assert m["fit"]["skipped"] == 0 and m["selection"].endswith("(fit)")
    assert (m["size"], m["seed"]) == (20, 11)
    assert m["probe_digest"] == probe_digest(m["pair_ids"], m["content_hashes"])
    probe = read_parquet(tmp_path / "a" / "probe.parquet")
    train = read_parquet(tmp_path / "a" / "train.parquet")
    assert probe.column("pair_id").to_pylist() == m["pair_ids"]
    assert train.num_rows == m["train_pairs"]
    assert probe.schema == train.schema == table.schema
    assert "probe 20" in (tmp_path / "a" / "freeze_probe.log").read_text()


def test_cli_too_few_prompts_fails_clearly(tmp_path):
    pairs = tmp_path / "pairs.parquet"
    write_parquet(pairs, pairs_table(leaky_rows()))
    result = run_cli(tmp_path, write_probe_params(tmp_path, size=512, seed=0), pairs, "out")
    assert result.returncode != 0
    assert "60 distinct prompts (150 pairs) but probe.size is 512" in result.stderr
    assert not (tmp_path / "out" / "probe_manifest.json").exists()
    assert not (tmp_path / "out" / "train.parquet").exists()


# ==================================================================================================
# Streaming (issue 19): freeze_probe_file writes what freeze_probe() + write_parquet write
# ==================================================================================================


def test_streaming_split_is_byte_identical_to_in_memory(hh_rlhf_path, tmp_path, monkeypatch):
    import stages.lib.io as io
    from stages.freeze_probe import freeze_probe_file
    from stages.normalize import normalize_sources

    monkeypatch.setattr(io, "PARQUET_ROW_GROUP", 300)  # many row groups from ~2k real pairs
    hh = normalize_sources([{"name": "hh", "path": str(hh_rlhf_path), "format": "hh"}]).pairs
    # Second answers to 400 of the real prompts, so that probe prompts leak and are excluded from train.
    leaks = [{"prompt": p["prompt"], "chosen": p["chosen"],
              "rejected": [{"role": "assistant", "content": p["rejected"][0]["content"] + " (again)"}]} for p in hh[:400]]
    table = pairs_table([{k: p[k] for k in ("prompt", "chosen", "rejected")} for p in hh] + leaks)
    write_parquet(tmp_path / "pairs.parquet", table)
    ref = freeze_probe(table, size=200, seed=11)
    assert ref.manifest["excluded_from_train"]  # HH repeats prompts: the leak exclusion is exercised
    write_parquet(tmp_path / "ref_train.parquet", ref.train)
    write_parquet(tmp_path / "ref_probe.parquet", ref.probe)
    for chunk_rows in (97, 5000):
        manifest = freeze_probe_file(str(tmp_path / "pairs.parquet"), 200, 11, chunk_rows=chunk_rows,
                                     train_path=str(tmp_path / "train.parquet"),
                                     probe_path=str(tmp_path / "probe.parquet"))
        assert manifest == ref.manifest
        for name in ("train", "probe"):
            assert (tmp_path / f"{name}.parquet").read_bytes() == (tmp_path / f"ref_{name}.parquet").read_bytes()

    # Rows not in normalize's pair_id order (a hand-made file): the same split all the same.
    write_parquet(tmp_path / "shuffled.parquet", shuffled(table, 4))
    manifest = freeze_probe_file(str(tmp_path / "shuffled.parquet"), 200, 11, chunk_rows=97,
                                 train_path=str(tmp_path / "train.parquet"), probe_path=str(tmp_path / "probe.parquet"))
    assert manifest == ref.manifest
    assert (tmp_path / "train.parquet").read_bytes() == (tmp_path / "ref_train.parquet").read_bytes()
    # A row edited after normalize is named by its row, as freeze_probe() names it.
    rows = table.to_pylist()
    rows[250]["rejected"] = [{"role": "assistant", "content": "edited"}]
    write_parquet(tmp_path / "edited.parquet", pa.Table.from_pylist(rows, schema=table.schema))
    with pytest.raises(ProbeError, match=r"1 pair\(s\) do not match.*\n  row 250 \(pair "):
        freeze_probe_file(str(tmp_path / "edited.parquet"), 200, 11, chunk_rows=97,
                          train_path=str(tmp_path / "t.parquet"), probe_path=str(tmp_path / "p.parquet"))
    assert not (tmp_path / "t.parquet").exists()


# ==================================================================================================
# Length-aware (issue 29 item 1): the probe is drawn from pairs tokenize keeps
# ==================================================================================================

HH_TIGHT = {"max_length": 192, "max_prompt_length": 128, "truncation": "keep_end"}


@pytest.fixture
def hh_table(hh_rlhf_path) -> pa.Table:
    """The real HH-RLHF file as normalize makes its pairs, in the pairs contract's schema."""
    from stages.normalize import normalize_sources

    hh = normalize_sources([{"name": "hh", "path": str(hh_rlhf_path), "format": "hh"}]).pairs
    return pairs_table([{k: p[k] for k in ("prompt", "chosen", "rejected")} for p in hh])


def gpt2_fit(gpt2_tokenizer_dir: Path, limits: dict):
    from stages.data.limits import TokenizeLimits
    from stages.data.tokenizer import tokenizer_identity
    from stages.freeze_probe import ProbeFit

    return ProbeFit(gpt2_tokenizer_dir, TokenizeLimits.from_params(limits), tokenizer_identity(gpt2_tokenizer_dir))


def test_the_probe_is_drawn_from_pairs_that_fit_so_tokenize_takes_it_whole(gpt2_tokenizer_dir, hh_table, tmp_path):
    """Real HH pairs, the real GPT-2 tokenizer, limits real chat data does not all fit (keep_end at 192 / 128: a
    completion alone over 192 tokens cannot be kept). A probe frozen without the tokenizer's view holds pairs
    tokenize refuses (before: the stage failed, 'the frozen probe must be scored whole'). Length-aware: every probe
    pair fits; it is the walk over the pairs that fit (a pair that does not fit neither joins nor takes its prompt);
    each pair passed over does not fit and is counted by reason; no probe prompt reaches train; the streaming path
    and any row order give the same split."""
    from stages.data.limits import TokenizeLimits
    from stages.data.pair_tokenizer import PairTokenizer
    from stages.data.tokenizer import load_tokenizer
    from stages.data.truncation import tokenize_pairs
    from stages.freeze_probe import freeze_probe_file

    limits, size, seed = TokenizeLimits.from_params(HH_TIGHT), 64, 20261202
    pair_tok = PairTokenizer(load_tokenizer(gpt2_tokenizer_dir))
    rejected = {r["pair_id"]: r["reason"]
                for r in tokenize_pairs(pair_tok, hh_table.to_pylist(), limits, "probe").rejections}
    unaware = freeze_probe(hh_table, size=size, seed=seed)
    refused = [pid for pid in unaware.manifest["pair_ids"] if pid in rejected]
    assert refused, "the fit-unaware probe should hold pairs tokenize refuses under these limits"

    fit = gpt2_fit(gpt2_tokenizer_dir, HH_TIGHT)
    split = freeze_probe(hh_table, size=size, seed=seed, fit=fit)
    m = split.manifest
    assert len(m["pair_ids"]) == size and not set(m["pair_ids"]) & set(rejected)
    assert tokenize_pairs(pair_tok, split.probe.to_pylist(), limits, "probe").rejections == []
    fits_only = hh_table.filter(pa.array([pid not in rejected for pid in hh_table.column("pair_id").to_pylist()]))
    assert m["pair_ids"] == freeze_probe(fits_only, size=size, seed=seed).manifest["pair_ids"]
    assert (m["fit"]["tokenizer_identity"], m["fit"]["limits"]) == (fit.tokenizer_identity, HH_TIGHT)
    # The pairs passed over are exactly the non-fitting ones ranked before the probe's last pair.
    last = max(selection_rank(seed, pid) for pid in m["pair_ids"])
    walked_over = [pid for pid in rejected if selection_rank(seed, pid) < last]
    assert m["fit"]["skipped"] == len(walked_over) >= len(refused)
    assert m["fit"]["skipped_by_reason"] == {"sequence_too_long": len(walked_over)}
    probe_prompts = {prompt_key(p) for p in split.probe.column("prompt").to_pylist()}
    assert not probe_prompts & {prompt_key(p) for p in split.train.column("prompt").to_pylist()}
    assert split.train.num_rows + size + len(m["excluded_from_train"]) == hh_table.num_rows

    write_parquet(tmp_path / "pairs.parquet", hh_table)
    write_parquet(tmp_path / "shuffled.parquet", shuffled(hh_table, 3))
    write_parquet(tmp_path / "ref_train.parquet", split.train)
    write_parquet(tmp_path / "ref_probe.parquet", split.probe)
    for name, chunk_rows in (("pairs.parquet", 97), ("pairs.parquet", 5000), ("shuffled.parquet", 300)):
        manifest = freeze_probe_file(str(tmp_path / name), size, seed, chunk_rows=chunk_rows, fit=fit,
                                     train_path=str(tmp_path / "train.parquet"), probe_path=str(tmp_path / "probe.parquet"))
        assert manifest == m, (name, chunk_rows)
        for part in ("train", "probe"):
            assert (tmp_path / f"{part}.parquet").read_bytes() == (tmp_path / f"ref_{part}.parquet").read_bytes()


def test_when_every_pair_fits_the_probe_is_the_same_pairs(embedded_pairs):
    """The default pipeline: every embedded pair fits the embedded tokenizer at the default limits, so the
    length-aware probe is the probe of before, pair for pair (only the manifest gains `fit`)."""
    from stages.data.limits import TokenizeLimits
    from stages.data.tokenizer import tokenizer_identity
    from stages.freeze_probe import ProbeFit

    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    ref_dir = REPO_ROOT / params["ref"]["local_dir"]
    fit = ProbeFit(ref_dir, TokenizeLimits.from_params(params["tokenize"]), tokenizer_identity(ref_dir))
    size, seed = params["probe"]["size"], params["probe"]["seed"]
    aware, unaware = (freeze_probe(embedded_pairs, size=size, seed=seed, fit=f) for f in (fit, None))
    assert aware.manifest["fit"]["skipped"] == 0
    assert {k: v for k, v in aware.manifest.items() if k not in ("fit", "selection")} == {
        k: v for k, v in unaware.manifest.items() if k not in ("fit", "selection")} and unaware.manifest["fit"] is None
    assert aware.probe.equals(unaware.probe) and aware.train.equals(unaware.train)


def test_too_few_fitting_prompts_is_refused_naming_the_limits(gpt2_tokenizer_dir, hh_table):
    tight = {"max_length": 48, "max_prompt_length": 32, "truncation": "reject"}
    with pytest.raises(ProbeError, match=r"only \d+ of the \d+ distinct prompts have a pair that fits the tokenize "
                                         r"limits \(max_length 48, max_prompt_length 32, truncation reject\) but "
                                         r"probe.size is 512; \d+ pairs do not fit \(prompt_too_long \d+, "
                                         r"sequence_too_long \d+\).*keep_end_then_completion"):
        freeze_probe(hh_table, size=512, seed=1, fit=gpt2_fit(gpt2_tokenizer_dir, tight))


def test_the_stages_freeze_a_probe_tokenize_takes_whole(gpt2_tokenizer_dir, hh_table, tmp_path):
    """The real CLIs on a pinned GPT-2 reference: freeze_probe (with the identity and tokenize's limits) then
    tokenize under the same params: the probe comes through whole, every pair passed over is in train. A manifest
    frozen under other limits is refused by tokenize (rerun freeze_probe)."""
    from data_helpers import pinned_gpt2_identity

    identity = pinned_gpt2_identity(gpt2_tokenizer_dir, tmp_path)
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["probe"] = {"size": 64, "seed": 20261202}
    params["tokenize"].update(HH_TIGHT, workers=1)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    write_parquet(tmp_path / "pairs.parquet", hh_table)
    r = tmp_path / "r"
    common = ["--params", str(tmp_path / "params.yaml")]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    run = lambda *args: subprocess.run([sys.executable, "-m", *map(str, args)], cwd=REPO_ROOT, capture_output=True,  # noqa: E731
                                       text=True, env=env)
    frozen = run("stages.freeze_probe", *common, "--pairs", tmp_path / "pairs.parquet", "--identity", identity,
                 "--train", r / "train.parquet", "--probe", r / "probe.parquet", "--manifest", r / "manifest.json",
                 "--log", r / "freeze_probe.log")
    assert frozen.returncode == 0, frozen.stderr[-3000:]
    assert "do not fit the tokenize limits" in (r / "freeze_probe.log").read_text()
    tokenize_args = ["stages.tokenize", *common, "--identity", identity, "--train", r / "train.parquet",
                     "--probe", r / "probe.parquet", "--probe-manifest", r / "manifest.json",
                     "--train-tokens", r / "train_tokens.parquet", "--probe-tokens", r / "probe_tokens.parquet",
                     "--probe-token-manifest", r / "ptm.json", "--report", r / "report.json",
                     "--rejections", r / "rej.parquet", "--log", r / "tokenize.log"]
    done = run(*tokenize_args)
    assert done.returncode == 0, done.stderr[-3000:]
    report = read_json(r / "report.json")["splits"]
    assert report["probe"]["pairs_out"] == 64 and report["probe"]["rejected"] == 0
    assert report["train"]["rejected_by_reason"]["sequence_too_long"] >= read_json(r / "manifest.json")["fit"]["skipped"]

    params["tokenize"]["max_length"] = 256        # tokenize's limits now differ from those the probe was drawn under
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    refused = run(*tokenize_args)
    assert refused.returncode == 1 and "rerun freeze_probe with these settings" in refused.stderr, refused.stderr[-2000:]
