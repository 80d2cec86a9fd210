"""Deterministic, atomic artifact I/O and hashing shared by every stage.

Every artifact is written to a temporary sibling and renamed into place, so a crash never leaves a
partial file under the final name (a partial output must never masquerade as complete). JSON is
canonical (sorted keys, fixed separators) and parquet carries no pandas/timestamp metadata, so the
same inputs give byte-identical outputs.

Parquet artifacts carry a CRC-32 of every page (written by the one writer here, verified by the one reader), so a
flipped bit in the data is refused, naming the file (CorruptFileError), never read as other values. A file whose
values have no content hash of their own (ref_logps) also carries a digest of its decoded values in the footer
(`values_digest=True`): the CRCs do not cover the footer (see VALUES_DIGEST_KEY).
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

import numpy as np
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


# ----------------------------------------------------------------------------------------------
# Data paths outside the repository
# ----------------------------------------------------------------------------------------------

# DVC runs a queued or temporary experiment (`dvc exp run --queue`, `--temp`) in a copy of the repository under
# .dvc/tmp/exps/, and sets DVC_ROOT, in the stage commands' environment, to the workspace it was queued from (in
# the workspace itself DVC_ROOT is the workspace). A relative path that leads outside the repository (README's
# `../shared/data/...`) means a place beside the workspace, which the copy is not beside.
DVC_ROOT = "DVC_ROOT"


def leaves_repository(path: str) -> bool:
    """A relative path whose normal form starts with `..`: it names a place outside the repository."""
    p = path.replace("\\", "/")
    return not os.path.isabs(p) and os.path.normpath(p).split(os.sep)[0] == os.pardir


def workspace_root(base_dir: str | os.PathLike = ".") -> Path:
    """The workspace this repository copy stands for: DVC_ROOT inside a DVC experiment's copy, else base_dir."""
    root = os.environ.get(DVC_ROOT)
    return Path(root) if root and Path(root).is_dir() else Path(base_dir)


def data_location(path: str, base_dir: str | os.PathLike = ".") -> str:
    """Where a data path of params.yaml is on disk: a path inside the repository as written (relative to base_dir,
    the repository root); one that leads outside it as its absolute location beside the workspace (workspace_root),
    so it is the same file from the workspace and from DVC's experiment copy, and dvc.yaml names it by a path
    that exists from both (the rules' inputs, hence dvc.yaml's deps, come from here)."""
    if not leaves_repository(path):
        return path
    return os.path.normpath(os.path.join(os.path.abspath(workspace_root(base_dir)), path))


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
# write_page_checksum: a CRC-32 of every data and dictionary page, which read_parquet / iter_parquet_batches verify.
_PARQUET_OPTIONS = dict(compression="zstd", compression_level=3, use_dictionary=True, write_statistics=True,
                        store_schema=False, write_page_checksum=True)

# The footer key of a parquet file's values digest (write_parquet(values_digest=True)). Why a digest beyond the page
# CRCs: a CRC covers a page's data only, not the page headers nor the footer (schema, column names and types, row
# counts, page offsets), and flipping single bits of a real ref_logps file's footer found reads that succeed with
# other column names, string columns turned binary and fewer rows. A digest of the *decoded* values catches every
# corruption that changes what a reader gets, whichever byte it hit, with no sidecar file for the DAG to carry (a
# flip in the digest itself is refused too). For ref_logps it is the only content check there is: its
# log-probs have no hash of their own, unlike the token tables (token_hash, recomputed on read) and the pairs
# (content_hash).
VALUES_DIGEST_KEY = "prefpipe.values_sha256"


class CorruptFileError(ValueError):
    """An artifact's bytes are not what was written (a page fails its CRC, the file is not readable parquet, its
    values digest differs); the message names the file. A refusal (stages.lib.cli), never a traceback."""


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


@contextmanager
def _parquet_read_errors(path: str | os.PathLike) -> Iterator[None]:
    """What pyarrow raises on a damaged file (CRC mismatch, undecodable thrift or pages, bad UTF-8 in the schema)
    becomes one CorruptFileError naming the file; a missing file stays FileNotFoundError."""
    try:
        yield
    except FileNotFoundError:
        raise
    except (pa.ArrowException, OSError, ValueError, EOFError) as e:
        if isinstance(e, CorruptFileError):
            raise
        raise CorruptFileError(f"{path}: unreadable parquet file ({type(e).__name__}: {_first_line(e)}): damaged, "
                               "truncated or not parquet; rerun the stage that writes it") from e


def _values_digest(table: pa.Table) -> str:
    """sha256 of a table's decoded values, independent of its parquet encoding and chunking: the schema (names,
    types), the row count, then per column its nulls and its values (fixed-width: little-endian bytes with nulls
    as 0; strings/binary: every value's length as int64, then the bytes). Flat columns only."""
    h = hashlib.sha256(canonical_json([[f.name, str(f.type)] for f in table.schema] + [table.num_rows]).encode())
    for field, column in zip(table.schema, table.columns):
        arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
        t = arr.type
        text = pa.types.is_string(t) or pa.types.is_binary(t)
        if not (text or pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
            raise TypeError(f"values digest: column {field.name} has type {t}; only flat columns are digested")
        if arr.null_count:
            h.update(b"N" + np.packbits(arr.is_null().to_numpy(zero_copy_only=False)).tobytes())
            fill = "" if pa.types.is_string(t) else b"" if text else False if pa.types.is_boolean(t) else 0
            arr = arr.fill_null(pa.scalar(fill, t))
        else:
            h.update(b"V")
        if not len(arr):
            continue
        if text:
            offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset: arr.offset + len(arr) + 1]
            h.update(np.diff(offsets).astype("<i8").tobytes())
            if offsets[-1] > offsets[0]:
                h.update(memoryview(arr.buffers()[2])[offsets[0]: offsets[-1]])
        else:
            values = arr.to_numpy(zero_copy_only=False)
            h.update(values.astype(values.dtype.newbyteorder("<"), copy=False).tobytes())
    return h.hexdigest()


def write_parquet(path: str | os.PathLike, table: pa.Table, *, values_digest: bool = False) -> None:
    """Byte-deterministic parquet: schema metadata dropped, one fixed compression and layout, page CRCs.
    values_digest: also record the values' digest in the footer (VALUES_DIGEST_KEY), for read_parquet to check."""
    table = table.replace_schema_metadata(None)
    with atomic_path(path) as tmp:
        if not values_digest:
            pq.write_table(table, tmp, row_group_size=PARQUET_ROW_GROUP, **_PARQUET_OPTIONS)
            return
        digest = _values_digest(table)
        with pq.ParquetWriter(tmp, table.schema, **_PARQUET_OPTIONS) as writer:
            writer.write_table(table, row_group_size=PARQUET_ROW_GROUP)
            writer.add_key_value_metadata({VALUES_DIGEST_KEY: digest})


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


def open_parquet(path: str | os.PathLike) -> pq.ParquetFile:
    """A parquet file opened for reading with its page CRCs verified as pages are read (a page written without one,
    e.g. by another tool, is read as is). Read it through read_parquet or iter_parquet_batches, which turn a damaged
    page into CorruptFileError."""
    with _parquet_read_errors(path):
        return pq.ParquetFile(path, page_checksum_verification=True)


def read_parquet(path: str | os.PathLike, *, values_digest: bool = False) -> pa.Table:
    """One parquet file, whole (the same table as pq.read_table), page CRCs verified. Through ParquetFile, not
    read_table: read_table goes through pyarrow.dataset, whose import alone is ~0.45 s of every stage that reads a
    parquet. values_digest: the file must carry write_parquet's values digest, and the values read must match it.
    A damaged file raises CorruptFileError naming it."""
    with _parquet_read_errors(path), open_parquet(path) as f:
        table = f.read()
        recorded = (f.metadata.metadata or {}).get(VALUES_DIGEST_KEY.encode())
    table = table.replace_schema_metadata(None)
    if values_digest:
        if recorded is None:
            raise CorruptFileError(f"{path}: no values digest ({VALUES_DIGEST_KEY}) in the parquet footer: written by "
                                   "an older version, or the footer is damaged; rerun the stage that writes it")
        try:
            actual = _values_digest(table)
        except TypeError as e:        # a damaged schema can turn a column into a type the digest does not take
            raise CorruptFileError(f"{path}: {e}; the footer is damaged; rerun the stage that writes it") from e
        if actual != recorded.decode("utf-8", "replace"):
            raise CorruptFileError(f"{path}: the values read do not match the values digest in its footer "
                                   f"({actual[:16]}... != {recorded[:16].decode('utf-8', 'replace')}...): the file "
                                   "is corrupted; rerun the stage that writes it")
    return table


def iter_parquet_batches(path: str | os.PathLike, batch_size: int, columns: list[str] | None = None,
                         parquet_file: pq.ParquetFile | None = None) -> Iterator[pa.RecordBatch]:
    """The file's record batches, page CRCs verified; a damaged page raises CorruptFileError naming the file.
    `parquet_file`: the file already opened by open_parquet (e.g. to read its row count first)."""
    with _parquet_read_errors(path):
        f = parquet_file if parquet_file is not None else open_parquet(path)
        yield from f.iter_batches(batch_size=batch_size, columns=columns)


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
