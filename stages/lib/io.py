"""Deterministic, atomic artifact I/O and hashing shared by every stage.

Every artifact is written to a temporary sibling and renamed into place, so a crash never leaves a
partial file under the final name (a partial output must never masquerade as complete). JSON is
canonical (sorted keys, fixed separators) and parquet carries no pandas/timestamp metadata, so the
same inputs give byte-identical outputs.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import site
import sys
import sysconfig
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

HASH_CHUNK = 4 << 20  # per-call read buffer: memory stays bounded however large the file

# Digest names hash_file / hash_bytes accept (hashlib names, plus git's blob hash).
SHA256 = "sha256"
MD5 = "md5"              # DVC's file hash (dvc.lock), not a security hash
GIT_SHA1 = "git-sha1"    # git blob SHA-1, sha1(b"blob %d\0" % size + data): `git hash-object`, the hub's non-LFS ETag


def canonical_json(obj: Any) -> str:
    """One spelling per value: sorted keys, no whitespace, UTF-8 kept (not \\u-escaped)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def sha256_bytes(data: bytes) -> str:
    return hash_bytes(data, SHA256)


def sha256_text(text: str) -> str:
    return sha256_bytes(text.encode("utf-8"))


def sha256_json(obj: Any) -> str:
    return sha256_text(canonical_json(obj))


def _hasher(algo: str, size: int):
    if algo == GIT_SHA1:
        return hashlib.sha1(b"blob %d\0" % size)
    if algo == MD5:
        return hashlib.md5(usedforsecurity=False)
    if algo == SHA256:
        return hashlib.sha256()
    raise ValueError(f"unknown digest {algo!r} (expected {SHA256}, {MD5} or {GIT_SHA1})")


def hash_bytes(data: bytes, algo: str = SHA256) -> str:
    h = _hasher(algo, len(data))
    h.update(data)
    return h.hexdigest()


def hash_file(path: str | os.PathLike, algos: tuple[str, ...] = (SHA256,),
              chunk: int = HASH_CHUNK) -> tuple[int, dict[str, str]]:
    """The one file hasher: stream `path` once through every digest in `algos`, in bounded memory.
    Returns (size, {algo: hex digest}).

    hashlib releases the GIL on large updates, so several calls run truly in parallel in threads.
    A file that changes size while being read raises OSError (git's prefix committed to the size,
    and a moving file proves nothing).
    """
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        hashers = [_hasher(a, size) for a in algos]
        buf = bytearray(min(chunk, max(size, 1)))
        view = memoryview(buf)
        total = 0
        while n := f.readinto(buf):
            for h in hashers:
                h.update(view[:n])
            total += n
    if total != size:
        raise OSError(f"changed size while being hashed ({size} -> {total} bytes)")
    return size, {a: h.hexdigest() for a, h in zip(algos, hashers)}


def sha256_file(path: str | os.PathLike) -> str:
    return hash_file(path)[1][SHA256]


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Human-readable but still canonical: sorted keys, 2-space indent, trailing newline."""
    text = json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    write_text(path, text)


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_jsonl(path: str | os.PathLike, rows: list[dict]) -> None:
    write_text(path, "".join(canonical_json(r) + "\n" for r in rows))


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# Part of the artifact contract: the bytes of a parquet file depend on its row-group layout, so
# every writer (whole-table or streaming) cuts row groups at this many rows, never at a chunk or
# worker boundary.
PARQUET_ROW_GROUP = 1 << 16
_PARQUET_OPTIONS = dict(compression="zstd", compression_level=3, use_dictionary=True, write_statistics=True,
                        store_schema=False)


def write_parquet(path: str | os.PathLike, table: pa.Table) -> None:
    """Byte-deterministic parquet: schema metadata dropped, one fixed compression and layout."""
    table = table.replace_schema_metadata(None)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, row_group_size=PARQUET_ROW_GROUP, **_PARQUET_OPTIONS)


class ParquetStreamWriter:
    """write_parquet's bytes, written as rows arrive: buffers to PARQUET_ROW_GROUP rows and writes each
    full row group as one contiguous table (pq.write_table does the same slicing), so the file is the
    same bytes as write_parquet(path, concat of everything written) whatever the pieces were.
    Atomic like write_parquet: the file appears at `path` only when the `with` block succeeds."""

    def __init__(self, path: str | os.PathLike, schema: pa.Schema):
        self.path, self.schema = path, schema.remove_metadata()
        self.rows = 0
        self._pending: list[pa.Table] = []
        self._pending_rows = 0

    def __enter__(self) -> "ParquetStreamWriter":
        self._atomic = atomic_path(self.path)
        tmp = self._atomic.__enter__()
        self._writer = pq.ParquetWriter(tmp, self.schema, **_PARQUET_OPTIONS)
        return self

    def write(self, table: pa.Table | pa.RecordBatch) -> None:
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        table = table.replace_schema_metadata(None)
        if table.schema != self.schema:
            table = table.cast(self.schema)
        if table.num_rows == 0:
            return
        self._pending.append(table)
        self._pending_rows += table.num_rows
        while self._pending_rows >= PARQUET_ROW_GROUP:
            self._flush(PARQUET_ROW_GROUP)

    def _flush(self, n: int) -> None:
        # One contiguous chunk per column: page boundaries depend on how a column chunk is fed.
        whole = pa.concat_tables(self._pending).combine_chunks()
        self._writer.write_table(whole.slice(0, n), row_group_size=PARQUET_ROW_GROUP)
        rest = whole.slice(n)
        self._pending, self._pending_rows = ([rest] if rest.num_rows else []), rest.num_rows
        self.rows += n

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc_type is None:
                if self._pending_rows:
                    self._flush(self._pending_rows)
                elif self.rows == 0:  # pq.write_table writes one empty row group for an empty table
                    self._writer.write_table(self.schema.empty_table(), row_group_size=PARQUET_ROW_GROUP)
            self._writer.close()
        finally:
            self._atomic.__exit__(exc_type, exc, tb)
        return False


def read_parquet(path: str | os.PathLike) -> pa.Table:
    """One parquet file, whole (the same table as pq.read_table). Through ParquetFile, not read_table: read_table
    goes through pyarrow.dataset, whose import alone is ~0.45 s of every stage that reads a parquet."""
    with pq.ParquetFile(path) as f:
        return f.read()


def display_path(path: str | os.PathLike) -> str:
    """A path as logs show it: relative to the working directory when inside it, so the same run in another
    checkout writes the same log bytes (logs are hashed outputs)."""
    rel = os.path.relpath(Path(path).resolve(), Path.cwd().resolve())
    return Path(path).as_posix() if rel.startswith("..") else Path(rel).as_posix()


# `log.info(..., extra=MEASUREMENT)`: a timing/throughput line. It reaches the console, never the log file.
MEASUREMENT = {"measurement": True}


class _NoMeasurements(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "measurement", False)


# Where a library's code lives (the venv's and the user's site-packages, the standard library), and where ours does.
_OUR_CODE = str(Path(__file__).resolve().parents[1]) + os.sep      # stages/ (this file is stages/lib/io.py)
_LIBRARY_ROOTS = tuple(sorted({os.path.realpath(p) + os.sep for p in (
    *(sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")), site.getusersitepackages())}))


class _NoLibraries(logging.Filter):
    """Records logged by library code (site-packages, the standard library) do not reach the hashed log file.
    Libraries log what depends on the machine's caches and first runs (matplotlib's "generated new fontManager"
    where it never ran, transformers', torch's and dvc's notices), which would make the same run write different
    log bytes on a fresh machine; they still reach the console. Decided by the calling file, not the logger's
    name, so any logger name our modules choose is kept (stages/ itself may be installed into site-packages)."""

    def filter(self, record: logging.LogRecord) -> bool:
        path = os.path.realpath(record.pathname)
        return path.startswith(_OUR_CODE) or not path.startswith(_LIBRARY_ROOTS)


def setup_logging(log_file: str | os.PathLike | None, name: str) -> logging.Logger:
    """Log to stderr (with timestamps) and, when given, to the rule's log file (Snakemake `log:` / DVC
    cmd). The log file is a hashed output of its stage (dvc.lock), so it holds the run's results and
    decisions only: no timestamps, no MEASUREMENT lines and nothing third-party code logs, and the same run
    writes the same bytes on a warm machine and a fresh one."""
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    handlers: list[logging.Handler] = [console]
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file, mode="w", encoding="utf-8")
        file_handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        file_handler.addFilter(_NoMeasurements())
        file_handler.addFilter(_NoLibraries())
        handlers.append(file_handler)
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True)
    return logging.getLogger(name)
