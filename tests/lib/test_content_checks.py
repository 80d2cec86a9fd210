"""Content checks where bytes matter (issue 26 item 4): every stage that reads a token table recomputes each row's
token_hash from its ids; every parquet artifact carries page CRCs that its reader verifies; ref_logps also carries
a digest of its values in the footer, which the CRCs do not cover. A damaged file is one refusal line naming it,
never a traceback and never a silent read.

The damage is real bit flips in files the real stages wrote, at offsets found by reading the flipped file the way
every stage read it before (pyarrow with no CRC check): the flips chosen are ones that reader took silently.
"""
from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute
import pyarrow.parquet as pq
import pytest
import torch.distributed as dist

from engine_helpers import VOCAB, random_rows, token_row, write_token_parquet
from stages.lib.contracts import TOKENS_SCHEMA, token_hash, token_hash_problem, token_hashes_of
from stages.lib.io import VALUES_DIGEST_KEY, CorruptFileError, read_parquet
from stage_helpers import stage_args, write_train_params


# ---------------------------------------------------------------------------------------------- helpers

def footer_start(data: bytes) -> int:
    """Offset of the parquet footer (FileMetaData): the file ends with it, its 4-byte length and b"PAR1"."""
    assert data[-4:] == b"PAR1"
    return len(data) - 8 - int.from_bytes(data[-8:-4], "little")


def read_unverified(data: bytes) -> pa.Table | None:
    """What the stages read before this change: pyarrow with no page-CRC verification (None: it raises)."""
    try:
        return pq.ParquetFile(io.BytesIO(data)).read()
    except Exception:  # noqa: BLE001 - any failure to read is "not silent"
        return None


def flip(data: bytes, pos: int, bit: int = 2) -> bytes:
    d = bytearray(data)
    d[pos] ^= 1 << bit
    return bytes(d)


def silent_page_flip(path: Path, columns: tuple[str, ...] | None = None, plausible=lambda table: True) -> int:
    """An offset in the data pages (before the footer) where one flipped bit is read, without CRC checks, as other
    values and no error: the corruption the issue found trained on. `columns`: only these columns' values change;
    `plausible(table)`: the values read pass the reader's other checks (e.g. ids inside the vocabulary)."""
    data = path.read_bytes()
    original = pq.ParquetFile(path).read()
    for pos in range(4, footer_start(data)):
        got = read_unverified(flip(data, pos))
        if got is None or got.equals(original) or got.schema != original.schema:
            continue
        changed = {c for c in original.column_names if not got.column(c).equals(original.column(c))}
        if (columns is None or changed <= set(columns)) and plausible(got):
            return pos
    raise AssertionError(f"{path}: no silent page flip found")


def flip_file(path: Path, pos: int, bit: int = 2) -> None:
    path.write_bytes(flip(path.read_bytes(), pos, bit))


def refusal(main, argv: list[str], stage: str) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 1 and str(e.value).startswith(f"{stage}: refused: ") and "\n" not in str(e.value)
    assert not dist.is_initialized()
    return str(e.value)


# ---------------------------------------------------------------------------------------------- token_hash

def test_vectorised_token_hashes_are_token_hash_row_for_row():
    """One definition: token_hashes_of writes the very text token_hash hashes, edge cases included."""
    rng = np.random.default_rng(0)
    rows = [token_row("empty", [], 0, [], 0), token_row("extremes", [0, -1, 2**31 - 1, -2**31], 2**31 - 1,
                                                        [-2**31], -2**31)]
    for i in range(5000):
        c, r = rng.integers(0, 200_000, rng.integers(0, 40)), rng.integers(0, 200_000, rng.integers(0, 40))
        rows.append(token_row(f"r{i}", c.tolist(), int(rng.integers(0, 40)), r.tolist(), int(rng.integers(0, 40))))
    table = pa.Table.from_pylist(rows, schema=TOKENS_SCHEMA)
    want = [token_hash(r["chosen_ids"], r["chosen_prompt_len"], r["rejected_ids"], r["rejected_prompt_len"])
            for r in rows]
    assert token_hashes_of(table, threads=1) == want
    assert token_hashes_of(table, threads=3) == want
    chunked = pa.concat_tables([table.slice(0, 777), table.slice(777, 3000), table.slice(3777)])
    assert chunked.column("chosen_ids").num_chunks == 3 and token_hashes_of(chunked, threads=2) == want
    assert token_hash_problem(table, "t.parquet") is None


def _rewrite_with_changed_id(path: Path, row: int) -> str:
    """Rewrite a token parquet (valid file, page CRCs and all) with one id of `row` changed and its token_hash kept:
    what a flip the CRCs cannot see (a tool that rewrote the file, memory corruption before a write) leaves."""
    rows = pq.read_table(path).to_pylist()
    rows[row]["chosen_ids"][-1] ^= 1
    write_token_parquet(path, rows)
    return rows[row]["pair_id"]


def test_a_changed_token_id_is_refused_by_every_stage_that_reads_the_table(assets, tmp_path):
    from stages import evaluate, ref_logps, train_dpo, train_rm
    from stages.engine.packing import TokenDataError, load_token_pairs

    params = write_train_params(assets / "p.yaml", train={"epochs": 1})
    pid = _rewrite_with_changed_id(assets / "train.parquet", 17)
    where = rf"{assets / 'train.parquet'}: row 17 \(pair {pid}\): token_hash .* is not the hash of the row's ids"
    with pytest.raises(TokenDataError, match=where):
        load_token_pairs(assets / "train.parquet")
    for stage, main, flag, out in (("ref_logps", ref_logps.main, "--out", "ref.parquet"),
                                   ("train_rm", train_rm.main, "--out-dir", "rm"),
                                   ("train_dpo", train_dpo.main, "--out-dir", "dpo")):
        extra = ["--ref-logps", str(assets / "absent.parquet")] if stage == "train_dpo" else []
        line = refusal(main, stage_args(assets, flag, assets / out, params) + extra, stage)
        assert f"train.parquet: row 17 (pair {pid}): token_hash" in line and "rerun tokenize" in line, line
        assert not (assets / out).exists()

    # evaluate reads the probe's ids (to name a chosen/rejected swap): the same check.
    from synthetic_probe import write_all
    from stage_helpers import evaluate_params, run_evaluate_cli
    eval_params = evaluate_params(bootstrap_replicates=100)
    write_all(tmp_path, eval_params)
    probe_tokens = tmp_path / "results/tokens/probe_tokens.parquet"
    pid = _rewrite_with_changed_id(probe_tokens, 5)
    with pytest.raises(SystemExit, match=rf"evaluate: refused: .*probe_tokens\.parquet: row 5 \(pair {pid}\): "
                                         "token_hash"):
        run_evaluate_cli(tmp_path, eval_params, "x")
    assert not (tmp_path / "x/metrics").exists()


# ---------------------------------------------------------------------------------------------- page CRCs

def test_a_bit_flipped_in_a_page_is_refused_not_read(tmp_path):
    path = write_token_parquet(tmp_path / "t.parquet", random_rows(300, seed=4, margins=True))
    pos = silent_page_flip(path)          # read silently as other values without the CRC check
    flip_file(path, pos)
    with pytest.raises(CorruptFileError, match=rf"{tmp_path / 't.parquet'}: unreadable parquet file "
                                               r"\(.*CRC checksum verification"):
        read_parquet(path)
    from stages.lib.io import iter_parquet_batches
    with pytest.raises(CorruptFileError, match="t.parquet: unreadable parquet file"):
        list(iter_parquet_batches(path, 64))


def test_a_flipped_token_table_is_one_refusal_line(assets):
    """The issue's tokens scenario: one bit of train tokens flipped; training refuses instead of training on it."""
    from stages import train_rm
    params = write_train_params(assets / "p.yaml", train={"epochs": 1})
    def in_vocabulary(table: pa.Table) -> bool:
        ids = [pa.compute.list_flatten(table.column(c)).to_numpy() for c in ("chosen_ids", "rejected_ids")]
        return all(((x >= 0) & (x < VOCAB)).all() for x in ids)
    flip_file(assets / "train.parquet", silent_page_flip(assets / "train.parquet", ("chosen_ids", "rejected_ids"),
                                                         in_vocabulary))
    line = refusal(train_rm.main, stage_args(assets, "--out-dir", assets / "rm", params), "train_rm")
    assert f"{assets / 'train.parquet'}: unreadable parquet file" in line, line
    assert not (assets / "rm").exists()


def test_ref_logps_flips_in_pages_and_footer_are_refused(assets):
    """The issue's ref_logps scenario: the real stage's file, one bit flipped, in a page (page CRC) or in the footer
    (the values digest: the CRCs do not cover the footer, where flips rename columns, retype them or drop rows)."""
    from stages import ref_logps, train_dpo
    from stages.lib.ref_logps_table import read_ref_logps
    params = write_train_params(assets / "p.yaml", train={"epochs": 1})
    ref_logps.main(stage_args(assets, "--out", assets / "ref.parquet", params))
    good = (assets / "ref.parquet").read_bytes()
    assert VALUES_DIGEST_KEY.encode() in pq.ParquetFile(assets / "ref.parquet").metadata.metadata
    table = read_ref_logps(assets / "ref.parquet")
    dpo_args = stage_args(assets, "--out-dir", assets / "dpo", params) + ["--ref-logps", str(assets / "ref.parquet")]

    # a flip the old reader took as other log-probs (the DPO margin 1.94743 -> 1.94710)
    flip_file(assets / "ref.parquet", silent_page_flip(assets / "ref.parquet", ("ref_chosen_logp", "ref_rejected_logp")))
    line = refusal(train_dpo.main, dpo_args, "train_dpo")
    assert f"{assets / 'ref.parquet'}: unreadable parquet file" in line and "CRC" in line, line

    # Footer flips that a CRC-verifying reader still reads, as another table: the values digest refuses each.
    silent = []
    for pos in range(footer_start(good), len(good) - 8):
        data = flip(good, pos)
        try:
            got = pq.ParquetFile(io.BytesIO(data), page_checksum_verification=True).read()
        except Exception:  # noqa: BLE001 - refused by pyarrow itself
            continue
        if not got.replace_schema_metadata(None).equals(table):
            silent.append(pos)
    assert silent, "no footer flip changes what is read: the test lost its subject"
    for pos in silent:
        (assets / "ref.parquet").write_bytes(flip(good, pos))
        with pytest.raises(CorruptFileError, match=rf"{assets / 'ref.parquet'}: "):
            read_ref_logps(assets / "ref.parquet")
    line = refusal(train_dpo.main, dpo_args, "train_dpo")
    assert f"{assets / 'ref.parquet'}:" in line and "footer" in line, line
    assert not (assets / "dpo").exists()

    (assets / "ref.parquet").write_bytes(good)                  # the undamaged file trains
    shutil.rmtree(assets / "dpo", ignore_errors=True)
    assert train_dpo.main(dpo_args)["perf"]["resumed_from_step"] is None
