"""Streaming table writers: rows appended one at a time reach a parquet file in pieces, never all held.

    TableSink   `.append(row)`; pieces of SINK_ROWS rows go to a ParquetStreamWriter (rows in append order)
    PairSpill   `.append(pair)`; `write_sorted(writer)` writes every pair sorted by pair_id: an on-disk sort
                holding one 1/16 bucket of the pairs at a time, refusing two pairs with one pair_id

The bytes do not depend on SINK_ROWS or the buckets: ParquetStreamWriter cuts row groups at a fixed row count
(stages/lib/io.py), never at a piece boundary.
"""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stages.lib.contracts import PAIRS_SCHEMA
from stages.lib.io import ParquetStreamWriter

SINK_ROWS = 4096  # rows buffered per table piece (memory only: the files' row groups are io.PARQUET_ROW_GROUP)


class TableSink:
    """`.append(row dict)`; pieces of SINK_ROWS rows go to a ParquetStreamWriter; `flush()` at the end."""

    def __init__(self, writer: ParquetStreamWriter, schema: pa.Schema):
        self.writer, self.schema, self.rows = writer, schema, []

    def append(self, row: dict) -> None:
        self.rows.append(row)
        if len(self.rows) >= SINK_ROWS:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            self.writer.write(pa.Table.from_pylist(self.rows, schema=self.schema))
            self.rows = []


class PairSpill:
    """pairs.parquet is sorted by pair_id: pairs are spilled to 16 bucket files by the pair_id's first
    hex digit (pair IDs are hash prefixes, so buckets are even), then each bucket is sorted in memory and
    written in bucket order: an external sort holding one bucket (1/16 of the pairs) at a time."""

    BUCKETS = "0123456789abcdef"

    def __init__(self, tmp_dir: Path):
        self.tmp_dir = tmp_dir
        self.rows: dict[str, list[dict]] = {b: [] for b in self.BUCKETS}
        self.writers: dict[str, pq.ParquetWriter] = {}

    def append(self, pair: dict) -> None:
        bucket = self.rows[pair["pair_id"][0]]
        bucket.append(pair)
        if len(bucket) >= SINK_ROWS // 4:
            self._spill(pair["pair_id"][0])

    def _spill(self, b: str) -> None:
        if not self.rows[b]:
            return
        if b not in self.writers:  # scratch files: fast, uncompressed
            self.writers[b] = pq.ParquetWriter(self.tmp_dir / f"bucket_{b}.parquet", PAIRS_SCHEMA, compression="none")
        self.writers[b].write_table(pa.Table.from_pylist(self.rows[b], schema=PAIRS_SCHEMA))
        self.rows[b] = []

    def write_sorted(self, writer: ParquetStreamWriter) -> None:
        import pyarrow.compute as pc

        for b in self.BUCKETS:
            self._spill(b)
        for w in self.writers.values():
            w.close()
        for b in self.BUCKETS:
            if b not in self.writers:
                continue
            table = pq.read_table(self.tmp_dir / f"bucket_{b}.parquet")
            table = table.take(pc.sort_indices(table, [("pair_id", "ascending")]))
            ids = table.column("pair_id").to_pylist()
            for i in range(1, len(ids)):
                if ids[i] == ids[i - 1]:  # distinct content, same 96-bit prefix: refuse, never merge
                    hashes = table.column("content_hash").slice(i - 1, 2).to_pylist()
                    raise AssertionError(f"pair_id collision {ids[i]}: {hashes[0]} vs {hashes[1]}")
            writer.write(table.combine_chunks())
            (self.tmp_dir / f"bucket_{b}.parquet").unlink()
