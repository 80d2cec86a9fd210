"""The tokenize stage (stages/tokenize.py): its one streaming path on real GPT-2 tokenizer and real HH-RLHF pairs:
deterministic bytes for any worker count and chunk size, the probe bound and recorded, inputs refused, the CLI
without torch, a huge row, a killed stage. (The pair tokenizer and the truncation modes:
tests/data/test_pair_tokenizer.py, tests/data/test_truncation.py; the default pipeline's bytes against the committed
record: tests/workflow/test_pipeline_e2e.py.)
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pyarrow as pa
import pytest

from conftest import REPO_ROOT
from data_helpers import (UNLIMITED, A, U, as_pair, long_text, pinned_gpt2_identity, probe_manifest, short_prompt_pairs,
                          write_probe_inputs)
from stages.data.limits import TRUNCATION_REASONS, TokenizeError, TokenizeLimits
from stages.data.pair_tokenizer import PairTokenizer
from stages.data.tokenizer import load_tokenizer, tokenizer_identity
from stages.data.truncation import tokenize_pairs
from stages.lib.contracts import token_hash
from stages.lib.io import read_json, read_parquet, sha256_json
from stages.tokenize import (TokenizeOutputs, check_pairs, check_probe_complete, check_probe_matches_manifest,
                             tokenize_to_files)

LOG = logging.getLogger("test_tokenize")
OUTPUT_NAMES = {"train_tokens": "train_tokens.parquet", "probe_tokens": "probe_tokens.parquet",
                "probe_token_manifest": "probe_token_manifest.json", "report": "tokenize_report.json",
                "rejections": "token_rejections.parquet"}


def run_stage(limits, tok_dir, inputs: dict, out: Path, workers: int = 1, chunk_pairs: int = 1024) -> dict:
    """tokenize_to_files into `out`; returns {output name: path}."""
    paths = {key: out / name for key, name in OUTPUT_NAMES.items()}
    out.mkdir(parents=True, exist_ok=True)
    tokenize_to_files(limits, tok_dir, inputs["train_path"], inputs["probe_path"], inputs["manifest_path"],
                      TokenizeOutputs(**paths), LOG, workers=workers, chunk_pairs=chunk_pairs)
    return paths


PROBE_FITS = TokenizeLimits(max_length=256, max_prompt_length=200, truncation="reject")


@pytest.fixture
def split_pairs(gpt2, hh_pairs):
    """(train, probe): 400 real pairs; the probe is 40 of those that fit PROBE_FITS, in a fixed shuffled order."""
    margins = [None, 0.5, 2.0]
    pairs = [dict(p, margin=margins[i % 3]) for i, p in enumerate(hh_pairs[:400])]
    fitting = {r["pair_id"] for r in tokenize_pairs(PairTokenizer(gpt2), pairs, PROBE_FITS, "probe").rows}
    probe_ids = {p["pair_id"] for p in pairs if p["pair_id"] in fitting}
    probe_ids = set(sorted(probe_ids)[:40])
    probe = sorted((p for p in pairs if p["pair_id"] in probe_ids), key=lambda p: sha256_json(["probe", p["pair_id"]]))
    return sorted((p for p in pairs if p["pair_id"] not in probe_ids), key=lambda p: p["pair_id"]), probe


def test_stage_outputs_are_deterministic_and_bind_the_probe(gpt2_tokenizer_dir, split_pairs, tmp_path):
    train, probe = split_pairs
    inputs = write_probe_inputs(tmp_path / "in", train, probe)
    limits = PROBE_FITS
    a = run_stage(limits, gpt2_tokenizer_dir, inputs, tmp_path / "a")
    b = run_stage(limits, gpt2_tokenizer_dir, inputs, tmp_path / "b")
    for key in a:
        assert Path(a[key]).read_bytes() == Path(b[key]).read_bytes(), key

    probe_tokens = read_parquet(a["probe_tokens"])
    assert probe_tokens.schema.field("chosen_ids").type == pa.list_(pa.int32())
    assert probe_tokens.schema.field("chosen_prompt_len").type == pa.int32()
    rows = probe_tokens.to_pylist()
    assert [r["pair_id"] for r in rows] == [p["pair_id"] for p in probe]
    assert [r["margin"] for r in rows] == [p["margin"] for p in probe]
    manifest, frozen = read_json(a["probe_token_manifest"]), read_json(inputs["manifest_path"])
    assert manifest["pair_ids"] == frozen["pair_ids"]
    assert manifest["probe_digest"] == frozen["probe_digest"]
    assert manifest["token_hashes"] == [token_hash(r["chosen_ids"], r["chosen_prompt_len"],
                                                   r["rejected_ids"], r["rejected_prompt_len"]) for r in rows]
    assert manifest["token_digest"] == sha256_json([[r["pair_id"], r["token_hash"]] for r in rows])
    assert manifest["tokenizer_identity"] == tokenizer_identity(gpt2_tokenizer_dir)

    report = read_json(a["report"])
    rejections = read_parquet(a["rejections"]).to_pylist()
    train_tokens = read_parquet(a["train_tokens"]).to_pylist()
    assert report["splits"]["probe"]["pairs_out"] == len(probe) and report["splits"]["probe"]["rejected"] == 0
    assert report["splits"]["train"]["pairs_out"] == len(train_tokens)
    assert report["splits"]["train"]["rejected"] == len(rejections) > 0
    assert len(train_tokens) + len(rejections) == len(train)
    assert {r["split"] for r in rejections} == {"train"}
    assert report["totals"]["rejected_by_reason"] == {
        reason: sum(r["reason"] == reason for r in rejections) for reason in {r["reason"] for r in rejections}}
    assert all(len(r["chosen_ids"]) <= 256 and r["chosen_prompt_len"] <= 200 for r in train_tokens)


def test_keep_end_probe_pairs_are_recorded_and_evaluate_checks_the_record(gpt2_tokenizer_dir, gpt2, hh_pairs,
                                                                          tmp_path):
    from stages.evidence.scoring import ProbeMismatchError, check_manifests

    limits = TokenizeLimits(max_length=256, max_prompt_length=128, truncation="keep_end")
    pairs = hh_pairs[:400]
    first = tokenize_pairs(PairTokenizer(gpt2), pairs, limits, "probe")
    truncated = {t["pair_id"] for t in first.truncations}
    kept = [r["pair_id"] for r in first.rows]
    probe_ids = set([pid for pid in kept if pid in truncated][:20] + [pid for pid in kept if pid not in truncated][:20])
    probe = sorted((p for p in pairs if p["pair_id"] in probe_ids), key=lambda p: sha256_json(["probe", p["pair_id"]]))
    train = [p for p in pairs if p["pair_id"] not in probe_ids]
    inputs = write_probe_inputs(tmp_path / "in", train, probe)
    a = run_stage(limits, gpt2_tokenizer_dir, inputs, tmp_path / "a")
    b = run_stage(limits, gpt2_tokenizer_dir, inputs, tmp_path / "b")
    for key in a:
        assert Path(a[key]).read_bytes() == Path(b[key]).read_bytes(), key

    manifest = read_json(a["probe_token_manifest"])
    assert manifest["limits"] == limits.as_dict()
    assert [t["pair_id"] for t in manifest["truncated"]] == [p["pair_id"] for p in probe if p["pair_id"] in truncated]
    rows = read_parquet(a["probe_tokens"]).to_pylist()
    for t in manifest["truncated"]:
        assert manifest["pair_ids"][t["index"]] == t["pair_id"] == rows[t["index"]]["pair_id"]
        assert t["token_hash"] == manifest["token_hashes"][t["index"]] == rows[t["index"]]["token_hash"]
        assert t["reason"] in ("prompt_turns_dropped", "prompt_text_cut")
        assert len(rows[t["index"]]["chosen_ids"]) == t["chosen_tokens"] <= 256
    report = read_json(a["report"])
    for split in ("probe", "train"):
        counts = report["splits"][split]["truncated_by_reason"]
        assert set(counts) == set(TRUNCATION_REASONS) and counts["completion_cut"] == 0
        assert sum(counts.values()) == report["splits"][split]["truncated"]
    assert report["splits"]["probe"]["truncated"] == 20 and report["splits"]["probe"]["rejected"] == 0
    assert report["totals"]["truncated_by_reason"] == {
        k: report["splits"]["probe"]["truncated_by_reason"][k] + report["splits"]["train"]["truncated_by_reason"][k]
        for k in TRUNCATION_REASONS}

    # evaluate accepts the record as written and refuses one that does not describe the scored tokens.
    frozen = read_json(inputs["manifest_path"])
    check_manifests(frozen, manifest, len(probe))
    t0 = manifest["truncated"][0]
    bad = {
        "not of the tokens that are scored": [dict(t0, token_hash="0" * 64)] + manifest["truncated"][1:],
        "which is not that probe position": [dict(t0, index=t0["index"] + 1)] + manifest["truncated"][1:],
        "out of probe order or repeated": manifest["truncated"][::-1],
        "has no reason": [dict(t0, reason="")] + manifest["truncated"][1:],
    }
    for match, truncated_list in bad.items():
        with pytest.raises(ProbeMismatchError, match=match):
            check_manifests(frozen, dict(manifest, truncated=truncated_list), len(probe))
    with pytest.raises(ProbeMismatchError, match="recorded under truncation: reject"):
        check_manifests(frozen, dict(manifest, limits=dict(manifest["limits"], truncation="reject")), len(probe))


def test_probe_too_long_fails_listing_pairs_and_limits(gpt2_tokenizer_dir, split_pairs, tmp_path):
    train, probe = split_pairs
    inputs = write_probe_inputs(tmp_path / "in", train, probe)
    limits = TokenizeLimits(max_length=128, max_prompt_length=64, truncation="truncate_completion")
    pair_tok = PairTokenizer(load_tokenizer(gpt2_tokenizer_dir))
    too_long = [r["pair_id"] for r in tokenize_pairs(pair_tok, probe, limits, "probe").rejections]
    assert too_long  # real HH prompts exceed 64 tokens
    with pytest.raises(TokenizeError) as e:
        run_stage(limits, gpt2_tokenizer_dir, inputs, tmp_path / "out")
    msg = str(e.value)
    assert f"{len(too_long)} of {len(probe)} probe pairs" in msg
    assert "max_length=128" in msg and "max_prompt_length=64" in msg and "truncation=truncate_completion" in msg
    assert all(f"{pid} (prompt_too_long" in msg for pid in too_long)


def test_check_probe_complete_passes_when_nothing_rejected(gpt2, split_pairs):
    _, probe = split_pairs
    result = tokenize_pairs(PairTokenizer(gpt2), probe, UNLIMITED, "probe")
    check_probe_complete(result.rejections, result.pairs_in, UNLIMITED)


def test_probe_must_match_its_manifest(split_pairs):
    _, probe = split_pairs
    manifest = probe_manifest(probe)
    check_probe_matches_manifest(probe, manifest, "probe.parquet", "probe_manifest.json")

    swapped = [probe[1], probe[0], *probe[2:]]
    with pytest.raises(TokenizeError, match="does not hold the probe .*index 0"):
        check_probe_matches_manifest(swapped, manifest, "probe.parquet", "probe_manifest.json")
    with pytest.raises(TokenizeError, match="1 manifest IDs missing"):
        check_probe_matches_manifest(probe[:-1], manifest, "probe.parquet", "probe_manifest.json")
    with pytest.raises(TokenizeError, match="content hashes differ"):
        check_probe_matches_manifest(probe, dict(manifest, content_hashes=["0" * 64] * len(probe)),
                                     "probe.parquet", "probe_manifest.json")
    with pytest.raises(TokenizeError, match="probe digest"):
        check_probe_matches_manifest(probe, dict(manifest, probe_digest="0" * 64), "probe.parquet",
                                     "probe_manifest.json")


def test_run_refuses_edited_or_mismatched_inputs(gpt2_tokenizer_dir, split_pairs, tmp_path):
    train, probe = split_pairs
    # A probe parquet in another order than the frozen manifest.
    inputs = write_probe_inputs(tmp_path / "order", train, probe[::-1], manifest=probe_manifest(probe))
    with pytest.raises(TokenizeError, match="does not hold the probe"):
        run_stage(UNLIMITED, gpt2_tokenizer_dir, inputs, tmp_path / "out")
    # A completion edited after normalize: its content no longer hashes to its pair ID.
    edited = [dict(p) for p in probe]
    edited[3]["chosen"] = [{"role": "assistant", "content": "something else"}]
    inputs = write_probe_inputs(tmp_path / "edit", train, edited, manifest=probe_manifest(probe))
    with pytest.raises(TokenizeError, match=f"(?s)probe.parquet: 1 pair.*row 3 \\(pair {edited[3]['pair_id']}\\): content_hash"):
        run_stage(UNLIMITED, gpt2_tokenizer_dir, inputs, tmp_path / "out")
    # A probe pair also in train.
    inputs = write_probe_inputs(tmp_path / "leak", train + probe[:1], probe)
    with pytest.raises(TokenizeError, match="probe pairs are also in"):
        run_stage(UNLIMITED, gpt2_tokenizer_dir, inputs, tmp_path / "out")
    # A manifest without freeze_probe's shape (contracts.PROBE_MANIFEST_SCHEMA): refused, naming the file.
    inputs = write_probe_inputs(tmp_path / "shape", train, probe, manifest={"size": 3, "pair_ids": "not a list"})
    with pytest.raises(TokenizeError, match=r"probe_manifest.json: not a valid probe manifest \("):
        run_stage(UNLIMITED, gpt2_tokenizer_dir, inputs, tmp_path / "out")


def test_check_pairs_catches_duplicates(split_pairs):
    train, _ = split_pairs
    check_pairs(train, "train.parquet")
    with pytest.raises(TokenizeError, match="duplicate pair_id"):
        check_pairs(train + train[:1], "train.parquet")


# ---------------------------------------------------------------------------------------------
# The one streaming path: the same bytes for any worker count and chunk size (issues 19, 21, 27)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("truncation", ["truncate_completion", "keep_end", "keep_end_then_completion"])
def test_the_stage_writes_the_same_bytes_for_any_workers_and_chunks(gpt2_tokenizer_dir, split_pairs, tmp_path,
                                                                    monkeypatch, truncation):
    """One worker with every pair in one chunk, against 2 workers with 37-pair chunks, 3 with 7-pair chunks (the
    probe split in pieces too) and 16 with 1000 (more workers than the input keeps busy: plan_pool hands out
    smaller chunks to fewer processes): every output file is the same bytes."""
    import stages.lib.io as io

    monkeypatch.setattr(io, "PARQUET_ROW_GROUP", 50)  # many row groups from 360 train pairs
    train, probe = split_pairs
    inputs = write_probe_inputs(tmp_path / "in", train, probe)
    limits = TokenizeLimits(max_length=256, max_prompt_length=200, truncation=truncation)
    ref = run_stage(limits, gpt2_tokenizer_dir, inputs, tmp_path / "ref", workers=1, chunk_pairs=10_000)
    report = read_json(ref["report"])["splits"]["train"]
    assert report["truncated"] and report["pairs_out"] > 100  # the truncation paths are exercised
    assert report["rejected"] or truncation != "truncate_completion"  # the prompt-cutting modes may keep all
    for workers, chunk in ((2, 37), (3, 7), (16, 1000)):
        paths = run_stage(limits, gpt2_tokenizer_dir, inputs, tmp_path / f"w{workers}", workers=workers,
                          chunk_pairs=chunk)
        for key in ref:
            assert paths[key].read_bytes() == ref[key].read_bytes(), (workers, chunk, key)


def test_bad_train_rows_are_refused_naming_the_row_and_nothing_is_written(gpt2_tokenizer_dir, split_pairs,
                                                                          tmp_path):
    train, probe = split_pairs
    edited = [dict(p) for p in train]
    edited[45]["chosen"] = [{"role": "assistant", "content": "something else"}]
    bad = write_probe_inputs(tmp_path / "edit", edited + train[:1], probe)
    out = tmp_path / "bad"
    with pytest.raises(TokenizeError, match=r"(?s)train.parquet: 2 pair.*row 45 \(pair .*rows 0 and 360: duplicate"):
        run_stage(UNLIMITED, gpt2_tokenizer_dir, bad, out, workers=2, chunk_pairs=37)
    assert not any(out.iterdir())


def test_plan_pool_sizes_the_pool_to_the_work():
    from stages.data.pool import MIN_CHUNK_PAIRS, plan_pool

    # HH on a 16-core GPU host: every worker gets train chunks, and the probe is split too.
    plan = plan_pool(1786, 512, 16, 1024)
    assert plan.processes == 16
    assert plan.train_chunk == -(-1786 // 16) and plan.probe_chunk == MIN_CHUNK_PAIRS
    # A tiny input is not worth a pool: one process, the whole input as one chunk of each split.
    plan = plan_pool(40, 20, 16, 1024)
    assert plan.processes == 1 and plan.train_chunk == MIN_CHUNK_PAIRS
    # A large input keeps the --chunk-pairs cap (bounded memory) and every worker.
    assert plan_pool(10**6, 512, 16, 1024) == type(plan)(16, 1024, MIN_CHUNK_PAIRS)
    assert plan_pool(1000, 10, 4, 7) == type(plan)(4, 7, 7)   # a chunk cap under MIN_CHUNK_PAIRS is kept
    for n_train, n_probe, workers, cap in ((0, 5, 8, 1024), (1, 0, 1, 1), (999, 3, 3, 50), (5000, 512, 64, 1024)):
        plan = plan_pool(n_train, n_probe, workers, cap)
        chunks = -(-n_train // plan.train_chunk) + -(-n_probe // plan.probe_chunk)
        assert 1 <= plan.processes <= max(1, min(workers, chunks, -(-(n_train + n_probe) // MIN_CHUNK_PAIRS)))
        assert 1 <= plan.train_chunk <= cap and 1 <= plan.probe_chunk <= cap
    with pytest.raises(TokenizeError, match="--chunk-pairs must be >= 1"):
        plan_pool(10, 10, 2, 0)


def test_streaming_refuses_an_incomplete_probe_tokenized_by_the_pool(gpt2_tokenizer_dir, split_pairs, tmp_path):
    """The probe's pieces run in the pool beside the train chunks: a probe pair that cannot fit still fails the
    stage before any output appears, naming the pair."""
    train, probe = split_pairs
    inputs = write_probe_inputs(tmp_path / "in", train, probe)
    limits = TokenizeLimits(max_length=40, max_prompt_length=30, truncation="reject")
    out = tmp_path / "out"
    with pytest.raises(TokenizeError, match=f"of {len(probe)} probe pairs cannot be tokenized under max_length=40"):
        run_stage(limits, gpt2_tokenizer_dir, inputs, out, workers=2, chunk_pairs=16)
    assert not any(out.iterdir())


def test_stage_process_never_imports_torch_and_writes_the_same_bytes(gpt2_tokenizer_dir, split_pairs, tmp_path):
    """`python -m stages.tokenize` loads the tokenizer through transformers without torch (tokenizers_only_process):
    -X importtime lists every module the process imported, and torch is none of them; its outputs are the
    in-process stage's bytes (main() inside another program keeps torch available)."""
    import subprocess
    import sys

    import yaml

    identity = pinned_gpt2_identity(gpt2_tokenizer_dir, tmp_path)
    train, probe = split_pairs
    inputs = write_probe_inputs(tmp_path / "in", train, probe)
    limits = TokenizeLimits(max_length=256, max_prompt_length=200, truncation="keep_end")
    ref = run_stage(limits, gpt2_tokenizer_dir, inputs, tmp_path / "ref")
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["tokenize"].update(limits.as_dict(), workers=2)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    out = tmp_path / "cli"
    flags = {"train_tokens": "--train-tokens", "probe_tokens": "--probe-tokens", "report": "--report",
             "probe_token_manifest": "--probe-token-manifest", "rejections": "--rejections"}
    outputs = [a for key, path in ref.items() for a in (flags[key], out / Path(path).name)]
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "stages.tokenize", "--params", tmp_path / "params.yaml",
                        "--identity", identity, "--train", inputs["train_path"], "--probe", inputs["probe_path"],
                        "--probe-manifest", inputs["manifest_path"], "--chunk-pairs", "50", *outputs,
                        "--log", tmp_path / "tokenize.log"],
                       cwd=REPO_ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    imported = [line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
    assert "transformers.models.gpt2.tokenization_gpt2" in imported or "tokenizers" in imported
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]
    for key, path in ref.items():
        assert (out / Path(path).name).read_bytes() == Path(path).read_bytes(), key


def tokenize_cli(identity: Path, inputs: dict, out: Path, params: Path, *extra: str) -> list[str]:
    """The stage's command line (`python -m stages.tokenize`, as the Snakemake rule runs it)."""
    import sys

    return [sys.executable, "-m", "stages.tokenize", "--params", str(params), "--identity", str(identity),
            "--train", inputs["train_path"], "--probe", inputs["probe_path"], "--probe-manifest",
            inputs["manifest_path"], "--train-tokens", str(out / "train_tokens.parquet"), "--probe-tokens",
            str(out / "probe_tokens.parquet"), "--probe-token-manifest", str(out / "probe_token_manifest.json"),
            "--report", str(out / "tokenize_report.json"), "--rejections", str(out / "token_rejections.parquet"),
            "--log", str(out / "tokenize.log"), *extra]


def stage_params(tmp_path: Path, **tokenize) -> Path:
    import yaml

    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["tokenize"].update(tokenize)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    return tmp_path / "params.yaml"


def test_a_20_mb_row_costs_the_stage_what_a_small_one_does(gpt2_tokenizer_dir, split_pairs, tmp_path):
    """The real CLI, README's real-data limits: a pair whose completion is 20 MB of words is rejected
    (sequence_too_long, its count null) and the stage's largest process stays under 1 GB. Before: the row was
    tokenized whole (a 50 MB row: 4 minutes and 12.4 GB peak RSS)."""
    import subprocess
    import sys

    identity = pinned_gpt2_identity(gpt2_tokenizer_dir, tmp_path)
    train, probe = split_pairs
    base = short_prompt_pairs(train)[0]
    huge = as_pair({"prompt": base["prompt"], "chosen": [A(long_text(base["chosen"][0]["content"], 20_000_000))],
                    "rejected": base["rejected"]}, 10**6)
    inputs = write_probe_inputs(tmp_path / "in", sorted(train + [huge], key=lambda p: p["pair_id"]), probe)
    params = stage_params(tmp_path, max_length=1024, max_prompt_length=256, truncation="reject", workers=2)
    measure = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-c", measure, *tokenize_cli(identity, inputs, out, params)], cwd=REPO_ROOT,
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    peak_mb = int(r.stdout.split()[-1]) / 1024
    [rejection] = [x for x in read_parquet(out / "token_rejections.parquet").to_pylist()
                   if x["pair_id"] == huge["pair_id"]]
    assert rejection["reason"] == "sequence_too_long" and rejection["chosen_tokens"] is None, rejection
    assert peak_mb < 1024, peak_mb


def test_the_stage_refuses_max_length_over_the_references_positions(gpt2_tokenizer_dir, split_pairs, tmp_path):
    """The real CLI on a pinned GPT-2 reference (n_positions 1024): tokenize.max_length 2048 is refused in one line
    naming both and the verified directory's config.json, before anything is tokenized or written. Before:
    accepted, and longer sequences than the model has positions were trained."""
    import subprocess

    identity = pinned_gpt2_identity(gpt2_tokenizer_dir, tmp_path)
    train, probe = split_pairs
    inputs = write_probe_inputs(tmp_path / "in", train, probe)
    params = stage_params(tmp_path, max_length=2048, max_prompt_length=256, truncation="keep_end")
    out = tmp_path / "out"
    r = subprocess.run(tokenize_cli(identity, inputs, out, params), cwd=REPO_ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert r.returncode == 1
    [line] = [x for x in r.stderr.splitlines() if "refused" in x]
    assert line.endswith(f"tokenize: refused: tokenize.max_length 2048 is more than the reference's n_positions 1024 "
                         f"({tmp_path / 'gpt2' / 'config.json'}): the model has no position past 1023; set "
                         f"tokenize.max_length to at most 1024"), line
    assert not [p for p in out.iterdir() if p.suffix in (".parquet", ".json")]


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            pass
    return out


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a reaper that a container's PID 1 may never be)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux /proc")
def test_killed_tokenize_takes_its_workers_with_it(gpt2_tokenizer_dir, split_pairs, tmp_path):
    """kill -9 of the real tokenize process while its two pool workers are busy: both are gone within 5 s
    (PR_SET_PDEATHSIG). Before: they stayed blocked on the pool's queue (alive 35 minutes later)."""
    import signal
    import subprocess
    import time

    identity = pinned_gpt2_identity(gpt2_tokenizer_dir, tmp_path)
    train, probe = split_pairs
    # 360 real pairs x 40 unique copies: minutes of work for two workers.
    many = [as_pair({**{k: p[k] for k in ("prompt", "chosen", "rejected")},
                     "prompt": [U(f"[{k}] " + p["prompt"][0]["content"])] + p["prompt"][1:]}, k * 1000 + i)
            for k in range(40) for i, p in enumerate(train)]
    inputs = write_probe_inputs(tmp_path / "in", sorted(many, key=lambda p: p["pair_id"]), probe)
    params = stage_params(tmp_path, max_length=1024, max_prompt_length=256, truncation="keep_end", workers=2)
    proc = subprocess.Popen(tokenize_cli(identity, inputs, tmp_path / "out", params, "--chunk-pairs", "64"),
                            cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            workers = _children(proc.pid)
        assert len(workers) == 2 and proc.poll() is None, (workers, proc.poll())
        time.sleep(1.0)                      # the workers are tokenizing chunks now
        assert all(_alive(w) for w in workers)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 5
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [w for w in workers if _alive(w)]
        assert not survivors, f"workers {survivors} outlived their killed parent {proc.pid}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for w in workers:                    # only the workers this test's process started
            if _alive(w):
                os.kill(w, signal.SIGKILL)


def test_a_split_losing_over_a_tenth_of_its_pairs_to_length_is_said_loudly_with_the_fix():
    """Issue 37: 176 of 231 ShareGPT pairs rejected as sequence_too_long went by with a count in the report. Over a
    tenth lost to length, the report's `warnings` (the log and summary.md's Warnings read them) name the loss, the
    limits and the settings that would keep the pairs; a tenth or less says nothing."""
    import numpy as np
    from stages.data.limits import TokenizeLimits
    from stages.tokenize import SplitTally, length_loss_warnings, tokenize_report
    import pyarrow as pa
    from stages.data.truncation import REJECTIONS_SCHEMA
    from stages.tokenize import ChunkResult

    def chunk(n_in, rejected):
        rows = [{"split": "train", "pair_id": f"p{i}", "src_file": "f", "src_row": i, "reason": reason,
                 "detail": "", "prompt_tokens": p, "chosen_tokens": c, "rejected_tokens": r}
                for i, (reason, p, c, r) in enumerate(rejected)]
        return ChunkResult(n_in, pa.table({"pair_id": pa.array([], pa.string())}).slice(0, 0),
                           pa.Table.from_pylist(rows, schema=REJECTIONS_SCHEMA), [], 0,
                           {k: np.zeros(0, np.int64) for k in ("prompt", "chosen", "rejected", "chosen_completion",
                                                               "rejected_completion")}, {})
    limits = TokenizeLimits(max_length=1024, max_prompt_length=256, truncation="keep_end")
    lossy = SplitTally()
    lossy.add(chunk(231, [("sequence_too_long", 100, 1100 + i, 1050) for i in range(170)]
                    + [("prompt_too_long", 300 + i, None, None) for i in range(6)]))
    fine = SplitTally()
    fine.add(chunk(100, [("sequence_too_long", 10, 2000, 30)] * 10))      # exactly a tenth: quiet
    report = tokenize_report({"train": lossy.report(), "probe": fine.report()}, limits, "plain", "id")
    assert len(report["warnings"]) == 1
    w = report["warnings"][0]
    assert w.startswith("train: 176 of 231 pairs (76%) rejected for length (prompt_too_long 6, sequence_too_long 170)")
    assert "max_length 1024, max_prompt_length 256, truncation keep_end" in w
    assert "tokenize.max_length >= 1253" in w and "tokenize.truncation: keep_end_then_completion" in w
    assert "tokenize.max_prompt_length >= 305" in w
    assert report["splits"]["train"]["length_rejected_needs"] == {"max_length_p90": 1253, "max_prompt_length_p90": 305}
    assert length_loss_warnings({"probe": fine.report()}, limits) == []
