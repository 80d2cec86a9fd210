"""Sources: `data.sources` entries -> their files, in read order -> rows as read (text, value, or why not).

A source's `path` is a file, a glob (`*`, `?`, `[...]`; `**` spans directories) or a directory (every file under
it with a data suffix, recursively, skipping hidden entries such as `hf download`'s `.cache/`), so shards as
`hf download --repo-type dataset` leaves them (`data/train-*.parquet`, `*.jsonl.gz`) are one source. Its files
are read in sorted path order (`source_paths`, which the Snakemake rule and so dvc.yaml use for the dependencies
too). A path that is no file, or a glob or directory that names no data file, is a SourceError naming the source
(`resolve_source_files`: also checked by the Snakefile at DAG build, so dvc.yaml never loses the stage). `name`
defaults to the file name without its data suffix (for a glob or directory: the last path component without
wildcards), numbered `_2`, `_3`, ... where that name is already taken; names given explicitly must be unique.

File kinds (by suffix): `.jsonl` / `.jsonl.gz` (one JSON object per line; src_row = 0-based line, blank lines
skipped and counted), `.json` / `.json.gz` (one JSON list of objects; src_row = element index), `.parquet`
(src_row = table row). A file that cannot be read at all (missing, unknown suffix, corrupt) is a SourceError
naming the file; a bad *row* never is: it is a SourceRow carrying its RowRejected (`json`).
"""
from __future__ import annotations

import glob
import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from stages.data.formats import check_format_options
from stages.data.messages import RowRejected, type_name
from stages.lib.io import leaves_repository, workspace_root


class SourceError(RuntimeError):
    """A source file or its params entry is unusable as a whole; the stage fails."""


FILE_KINDS = ((".jsonl.gz", "jsonl.gz"), (".jsonl", "jsonl"), (".json.gz", "json.gz"), (".json", "json"),
              (".parquet", "parquet"))
_KIND_LIST = ".jsonl, .jsonl.gz, .json, .json.gz or .parquet"
_GLOB_MAGIC = re.compile(r"[*?[]")
PARQUET_READ_ROWS = 4096


def file_kind(path: str) -> str:
    for suffix, kind in FILE_KINDS:
        if path.endswith(suffix):
            return kind
    raise SourceError(f"{path}: unknown file type (expected {_KIND_LIST})")


def is_data_file(path: str) -> bool:
    return any(path.endswith(suffix) for suffix, _ in FILE_KINDS)


# ----------------------------------------------------------------------------------------------
# Source entries and their files

def source_paths(path: str, base_dir: str | Path = ".") -> list[str]:
    """The files a source's `path` names, in the order they are read (see the module docstring).

    A plain file path is returned as is; SourceError when it is no file (a typo would otherwise leave the rule
    an input it cannot have, and Snakemake would silently keep the old outputs instead), or not of a data file
    type. Returned paths have the form of `path` (relative to base_dir when it is relative), with "/"
    separators. The one expansion of globs and directories: the Snakemake rule lists these files as its inputs,
    which dvc.yaml's deps are generated from (workflow/rules/data.smk, workflow/sync_dvc.py).
    """
    # A path leading outside the repository is relative to the workspace, wherever this runs (data_location).
    root = workspace_root(base_dir) if leaves_repository(path) else Path(base_dir)
    absolute = Path(path).is_absolute()
    where = "" if absolute else f" (relative to {root.resolve()})"
    if _GLOB_MAGIC.search(path):
        matched = (glob.glob(path, recursive=True) if absolute
                   else glob.glob(path, root_dir=root, recursive=True))
        matched = [m.replace("\\", "/") for m in matched
                   if (Path(m) if absolute else root / m).is_file()]
        files = sorted(m for m in matched if is_data_file(m))
        if not files:
            others = f"; it matches {len(matched)} file(s) of other types, e.g. {sorted(matched)[0]}" if matched else ""
            raise SourceError(f"{path}: the glob matches no {_KIND_LIST} file{where}{others}")
        return files
    full = Path(path) if absolute else root / path
    if full.is_dir():
        prefix = path.rstrip("/")
        files = sorted(f"{prefix}/{rel.as_posix()}" for rel in (f.relative_to(full) for f in full.rglob("*"))
                       if not any(part.startswith(".") for part in rel.parts)
                       and (full / rel).is_file() and is_data_file(rel.name))
        if not files:
            raise SourceError(f"{path}: the directory holds no {_KIND_LIST} file (hidden entries skipped){where}")
        return files
    if not full.is_file():
        raise SourceError(f"{path}: no such file{where}")
    file_kind(path)
    return [path]


def check_source_spec(spec: dict, index: int) -> None:
    """One source entry after resolve_sources (so `name` is filled in)."""
    where = f"data.sources[{index}] ({spec.get('name', '?')})"
    for key in ("name", "path", "format"):
        if not isinstance(spec.get(key), str) or not spec[key]:
            raise SourceError(f"{where}: '{key}' must be a non-empty string")
    problem = check_format_options(spec, where)
    if problem:
        raise SourceError(problem)


def resolve_source_files(sources: list[dict], base_dir: str | Path = ".") -> list[tuple[dict, list[str]]]:
    """Each source spec (names filled in, resolve_sources; checked, check_source_spec) with its files
    (source_paths), in params order; a source that names no data file is a SourceError naming it:
    `data.sources[i] (name): path: why`. What normalize reads, and what the Snakefile checks at DAG build."""
    out = []
    specs = resolve_sources(sources)
    for i, spec in enumerate(specs):
        check_source_spec(spec, i)
    for i, spec in enumerate(specs):
        try:
            out.append((spec, source_paths(spec["path"], base_dir)))
        except SourceError as e:
            raise SourceError(f"data.sources[{i}] ({spec.get('name', '?')}): {e}") from None
    return out


def default_source_name(path: str) -> str:
    """A source's default name: its file name without the data suffix; for a glob or directory the
    last path component left after removing wildcards (e.g. `data/train-*.parquet` -> `train`,
    `raw/hh-rlhf/harmless-base/` -> `harmless-base`); characters outside [A-Za-z0-9_.-] become `_`."""
    parts = [p for p in path.replace("\\", "/").split("/") if p not in ("", ".", "..")]
    for k, part in enumerate(reversed(parts)):
        if k == 0:
            for suffix, _ in FILE_KINDS:
                if part.endswith(suffix):
                    part = part[:-len(suffix)]
                    break
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", _GLOB_MAGIC.sub("", re.sub(r"\[[^]]*]", "", part))).strip("_.-")
        if name:
            return name
    return "source"


def resolve_sources(sources: list[dict]) -> list[dict]:
    """Copies of the source specs with every `name` filled in (defaults made unique, in params order)."""
    explicit: dict[str, int] = {}
    for i, spec in enumerate(sources):
        name = spec.get("name")
        if name is not None:
            if name in explicit:
                raise SourceError(f"data.sources[{i}]: name {name!r} is also the name of data.sources"
                                  f"[{explicit[name]}]; source names must be unique (they label every pair)")
            explicit[name] = i
    taken, out = set(explicit), []
    for spec in sources:
        spec = dict(spec)
        if spec.get("name") is None and isinstance(spec.get("path"), str) and spec["path"]:
            base = default_source_name(spec["path"])
            name, k = base, 2
            while name in taken:
                name, k = f"{base}_{k}", k + 1
            taken.add(name)
            spec["name"] = name
        out.append(spec)
    return out


# ----------------------------------------------------------------------------------------------
# Readers: file -> (src_row, raw text, parsed value or RowRejected)

BLANK = object()  # SourceRow.value of a whitespace-only jsonl line: skipped and counted, never a row


@dataclass(frozen=True)
class SourceRow:
    src_row: int
    raw: str
    value: Any = None
    error: RowRejected | None = None


def raw_json(obj: Any) -> str:
    """The original text of a json/parquet element: JSON with sorted keys; non-JSON values (bytes, timestamps
    from parquet) spelled by str so nothing is lost."""
    text = json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: keep them, \u-escaped
        text = json.dumps(obj, sort_keys=True, ensure_ascii=True, default=str)
    return text


def read_jsonl(lines: Iterable[bytes]) -> Iterator[SourceRow]:
    """Rows of a jsonl stream: `lines` as a binary file iterates them (each with its b"\\n", except
    perhaps the last). Lines split on "\\n" only; a trailing "\\r" is dropped, a BOM on line 0 too.
    A last line without "\\n" that is empty is no line (the final newline does not start another)."""
    for i, line in enumerate(lines):
        terminated = line.endswith(b"\n")
        if terminated:
            line = line[:-1]
        if i == 0 and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]
        if line.endswith(b"\r"):
            line = line[:-1]
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            yield SourceRow(i, line.decode("utf-8", "backslashreplace"),
                            error=RowRejected("json", f"line is not valid UTF-8 ({e.reason} at byte {e.start})"))
            continue
        if not text.strip():
            if terminated or text:
                yield SourceRow(i, text, error=None, value=BLANK)
            continue
        try:
            yield SourceRow(i, text, value=json.loads(text))
        except json.JSONDecodeError as e:
            yield SourceRow(i, text, error=RowRejected("json", f"invalid JSON: {e.msg} at column {e.colno}"))


def iter_source_rows(path: str | Path) -> Iterator[SourceRow]:
    """Every row of one source file, read as it is consumed (jsonl line by line, parquet by record
    batch; a .json document is one JSON value, parsed whole). Raises SourceError when the file as a
    whole is unreadable (also part-way: a truncated .gz or corrupt parquet page)."""
    path = str(path)
    kind = file_kind(path)
    p = Path(path)
    if not p.is_file():
        raise SourceError(f"{path}: source file not found (cwd-relative paths; cwd = {Path.cwd()})")
    try:
        if kind == "parquet":
            i = 0
            for batch in pq.ParquetFile(p).iter_batches(batch_size=PARQUET_READ_ROWS):
                for r in batch.to_pylist():
                    yield SourceRow(i, raw_json(r), value=r)
                    i += 1
            return
        if kind.startswith("jsonl"):
            with (gzip.open(p, "rb") if kind.endswith(".gz") else open(p, "rb")) as f:
                yield from read_jsonl(f)
            return
        data = gzip.decompress(p.read_bytes()) if kind.endswith(".gz") else p.read_bytes()
    except (OSError, EOFError, pa.ArrowException) as e:
        raise SourceError(f"{path}: cannot read {kind} file: {e}") from e
    try:
        doc = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(f"{path}: not a valid JSON document ({e}); one object per line needs a .jsonl name") from e
    if not isinstance(doc, list):
        raise SourceError(f"{path}: a .json source must be a list of row objects, got {type_name(doc)}")
    del data
    for i, v in enumerate(doc):
        yield SourceRow(i, raw_json(v), value=v)
