"""What the token-hash check costs the stages that read a token table (issue 26 item 4), at 1M pairs.

    python bench/token_hash_bench.py [--pairs 1000000] [--threads 1,2] [--shared ../shared] [--out FILE.json]

Every stage that reads a token table (ref_logps, train_dpo, train_rm through engine.packing.load_token_pairs; evaluate
for the probe) recomputes each row's token_hash from its ids (stages.lib.contracts.token_hashes_of). The table here
has --pairs synthetic pairs whose chosen/rejected lengths are drawn from the real HH-RLHF harmless test file's,
tokenized by the real GPT-2 tokenizer (ids uniform in GPT-2's vocabulary), written by the real writer
(stages.lib.io.write_parquet, page CRCs). Timed, each once: read_parquet (CRCs verified), token_hashes_of at each
--threads, token_hash row by row (json.dumps) on 20,000 rows, scaled to the table, and load_token_pairs whole.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stages.lib.contracts import TOKENS_SCHEMA, token_hash, token_hashes_of  # noqa: E402
from stages.lib.io import read_parquet, write_parquet  # noqa: E402


def hh_lengths(shared: Path) -> np.ndarray:
    """[n, 2] GPT-2 token counts of the HH file's chosen and rejected transcripts."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(shared / "data" / "tokenizers" / "gpt2")
    with gzip.open(shared / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    ids = tok([r["chosen"] for r in rows] + [r["rejected"] for r in rows])["input_ids"]
    return np.array([len(x) for x in ids]).reshape(2, -1).T


def token_table(n: int, lengths: np.ndarray, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    pick = lengths[rng.integers(0, len(lengths), n)]
    columns = {}
    for k, name in enumerate(("chosen_ids", "rejected_ids")):
        offsets = np.concatenate([[0], np.cumsum(pick[:, k])]).astype(np.int32)
        values = rng.integers(0, 50257, int(offsets[-1]), dtype=np.int32)
        columns[name] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    prompt = np.maximum(1, pick.min(axis=1) // 2).astype(np.int32)
    sample = 20_000
    hashes = [None] * n      # filled below by the vectorised path, checked against token_hash on a sample
    table = pa.table({"pair_id": [f"{i:024x}" for i in range(n)], "chosen_ids": columns["chosen_ids"],
                      "chosen_prompt_len": prompt, "rejected_ids": columns["rejected_ids"],
                      "rejected_prompt_len": prompt, "margin": pa.nulls(n, pa.float64()),
                      "token_hash": pa.array(hashes, pa.string())}, schema=TOKENS_SCHEMA)
    hashes = token_hashes_of(table)
    head = table.slice(0, sample).to_pylist()
    assert hashes[:sample] == [token_hash(r["chosen_ids"], r["chosen_prompt_len"], r["rejected_ids"],
                                          r["rejected_prompt_len"]) for r in head]
    return table.set_column(6, "token_hash", pa.array(hashes, pa.string()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=1_000_000)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--shared", type=Path, default=REPO.parent / "shared")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lengths = hh_lengths(args.shared)
    table = token_table(args.pairs, lengths)
    tokens = int(sum(pc.list_value_length(table.column(c)).to_numpy().sum()
                     for c in ("chosen_ids", "rejected_ids")))
    result = {"command": " ".join(["python", *sys.argv]), "pairs": args.pairs, "tokens": tokens,
              "mean_tokens_per_pair": round(tokens / args.pairs, 1), "cpu_count": os.cpu_count(),
              "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train_tokens.parquet"
        write_parquet(path, table)
        result["file_mb"] = round(path.stat().st_size / 1e6, 1)
        t0 = time.perf_counter()
        table = read_parquet(path)
        result["read_parquet_s"] = round(time.perf_counter() - t0, 2)
        for threads in (int(t) for t in args.threads.split(",")):
            t0 = time.perf_counter()
            assert token_hashes_of(table, threads) == table.column("token_hash").to_pylist()
            result[f"token_hashes_of_{threads}_threads_s"] = round(time.perf_counter() - t0, 2)
        sample = table.slice(0, 20_000)
        t0 = time.perf_counter()
        cols = [sample.column(c).to_pylist() for c in ("chosen_ids", "chosen_prompt_len", "rejected_ids",
                                                       "rejected_prompt_len")]
        for row in zip(*cols):
            token_hash(*row)
        result["token_hash_row_by_row_s_scaled"] = round((time.perf_counter() - t0) * args.pairs / 20_000, 1)
        del table
        from stages.engine.packing import load_token_pairs
        t0 = time.perf_counter()
        load_token_pairs(path)
        result["load_token_pairs_s"] = round(time.perf_counter() - t0, 2)
    result["load_average_after"] = os.getloadavg()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
