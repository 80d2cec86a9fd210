"""normalize: raw preference files -> one canonical pairs table, every bad row kept with a reason.

    python -m stages.normalize --params params.yaml \
        --pairs results/normalize/pairs.parquet \
        --rejections results/normalize/rejections.parquet \
        --stats results/normalize/normalize_stats.json --log logs/normalize.log

Reads every source under `data.sources` in params.yaml (`{name?, path, format, <format options>}`; paths
relative to the working directory) and writes the artifacts described in docs/ARTIFACTS.md. The data package
does the reading: a source's files and rows (stages/data/sources.py: files, globs, directories of shards, names),
each row's format (stages/data/formats/: one module per format, `auto` detection, reason codes), the
conversation rules (stages/data/messages.py) and the sort by pair_id (stages/data/spill.py). This driver
streams every row through them, in (source, file, row) order:

* each pair's provenance is the file it came from (`src_file`) and its row in that file (`src_row`);
* an exact duplicate (same content_hash) of an earlier pair is rejected (`duplicate`), and so is the same
  comparison with chosen and rejected swapped (`contradicts`): keeping both would train on a preference and its
  opposite;
* rows_in == pairs_out + rejected for every source (checked before anything is written), and a source that yields
  no pair at all (every row rejected, or no row: `check_source_yield`) fails the stage naming the source, before
  anything is written; a file that cannot be read at all fails the stage naming the file; a bad *row* never does.

Outputs are written as the rows stream (rejections in read order, pairs through the on-disk sort), atomically:
a refused run leaves no output.
"""
from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import pyarrow as pa

from stages.data import formats
from stages.data.formats import options_of, parse_row
from stages.data.messages import RowRejected
from stages.data.sources import BLANK, SourceError, SourceRow, iter_source_rows, resolve_source_files
from stages.data.spill import PairSpill, TableSink
from stages.lib.cli import stage_main
from stages.lib.contracts import PAIRS_SCHEMA, content_hash
from stages.lib import record_formats
from stages.lib.io import ParquetStreamWriter, data_location, write_json
from stages.lib.params import ParamsError
from stages.lib.declared_params import load_stage_params

# Every reason code of rejections.parquet: what a row's parse can end with (stages/data/formats), then this
# driver's own two, found across rows.
REASONS = (*formats.REASONS,
           "contradicts",       # an earlier pair has the same prompt with chosen and rejected swapped
           "duplicate")         # same content as an earlier pair
REJECTIONS_SCHEMA = pa.schema([
    ("source", pa.string()), ("src_file", pa.string()), ("src_row", pa.int64()),
    ("reason", pa.string()), ("detail", pa.string()), ("raw", pa.string()),
])


@dataclass
class Normalized:
    """Where normalize_sources puts what it finds: `.pairs.append(pair row)`, `.rejections.append(row)`. The
    default lists keep them in memory in read order (tests, benches); normalize_to_files passes the sinks that
    write pairs.parquet (sorted by pair_id) and rejections.parquet as they go."""
    pairs: list[dict] = field(default_factory=list)
    rejections: list[dict] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


def normalize_sources(sources: list[dict], base_dir: str | Path = ".", out: Normalized | None = None) -> Normalized:
    """Read and normalize every source in order (its files in source_paths order); duplicates keep the first
    (source, file, row). Returns `out` with its stats."""
    out = Normalized() if out is None else out
    first_seen = _FirstSeen()
    per_source = []
    # Every source's files before any is read: a typo in the last source stops the stage at once.
    for index, (spec, files) in enumerate(resolve_source_files(sources, base_dir)):
        stat = {"name": spec["name"], "path": spec["path"], "format": spec["format"], "rows_in": 0, "blank_lines": 0,
                "pairs_out": 0, "rejected": dict.fromkeys(REASONS, 0), "parsed_as": {}, "files": []}
        first_rejection: list[str] = []
        for path in files:
            rows = iter_source_rows(Path(base_dir) / data_location(path, base_dir))
            file_stat = {"path": path, "rows": 0}
            stat["files"].append(file_stat)
            _normalize_file(rows, spec, path, stat, file_stat, out, first_seen, first_rejection)
        stat["rejected_total"] = sum(stat["rejected"].values())
        if stat["rows_in"] != stat["pairs_out"] + stat["rejected_total"]:  # nothing may be lost
            raise AssertionError(f"{spec['path']}: rows_in {stat['rows_in']} != pairs_out {stat['pairs_out']} "
                                 f"+ rejected {stat['rejected_total']}")
        check_source_yield(stat, index, first_rejection[0] if first_rejection else None)
        per_source.append(stat)

    totals = {"sources": len(per_source), "rows_in": 0, "blank_lines": 0, "pairs_out": 0,
              "rejected": dict.fromkeys(REASONS, 0), "rejected_total": 0}
    for s in per_source:
        for k in ("rows_in", "blank_lines", "pairs_out", "rejected_total"):
            totals[k] += s[k]
        for r, n in s["rejected"].items():
            totals["rejected"][r] += n
    out.stats = {"format": record_formats.NORMALIZE_STATS, "sources": per_source, "totals": totals}
    return out


def check_source_yield(stat: dict, index: int, first_rejection: str | None = None) -> None:
    """A source that gives no pair (an empty file, every row rejected, every row a duplicate of an earlier
    source's) is refused, naming it and its rejections by reason: a run that silently trains without the data
    a source names would claim data it never used. Raised before anything is written (normalize_to_files
    writes atomically), so no rejections.parquet of an incomplete run is left beside the old pairs; the rows
    are still where the source is, and the message carries the first rejection's detail."""
    if stat["pairs_out"]:
        return
    reasons = ", ".join(f"{r} {n}" for r, n in stat["rejected"].items() if n)
    if stat["rows_in"] == 0:
        what = f"its {len(stat['files'])} file(s) hold no row" + (f" ({stat['blank_lines']} blank lines)"
                                                                  if stat["blank_lines"] else "")
    else:
        what = f"all {stat['rows_in']} rows were rejected ({reasons})" + (
            f"; the first: {first_rejection}" if first_rejection else "")
    raise SourceError(f"data.sources[{index}] ({stat['name']}): {stat['path']} yields 0 pairs: {what}")


class _FirstSeen:
    """content_hash -> where it was first seen (source, file, row), compact for millions of pairs: the
    key is the digest's 32 bytes, the value one int (file number, row)."""

    def __init__(self):
        self._where: dict[bytes, int] = {}
        self._files: list[tuple[str, str]] = []
        self._file_ids: dict[tuple[str, str], int] = {}

    def get(self, content_hash: str) -> tuple[str, str, int] | None:
        v = self._where.get(bytes.fromhex(content_hash))
        if v is None:
            return None
        s, f = self._files[v >> 40]
        return s, f, v & ((1 << 40) - 1)

    def add(self, content_hash: str, source: str, path: str, row: int) -> None:
        fid = self._file_ids.setdefault((source, path), len(self._files))
        if fid == len(self._files):
            self._files.append((source, path))
        self._where[bytes.fromhex(content_hash)] = (fid << 40) | row


def _normalize_file(rows: Iterable[SourceRow], spec: dict, path: str, stat: dict, file_stat: dict,
                    out: Normalized, first_seen: _FirstSeen, first_rejection: list[str]) -> None:
    """One file of a source: pairs and rejections appended to `out`, counts to the source's `stat`, the
    source's first rejection (reason: detail) to `first_rejection`."""
    name, fmt = spec["name"], spec["format"]
    options = options_of(spec)

    def reject(row: SourceRow, err: RowRejected) -> None:
        stat["rejected"][err.reason] += 1
        detail = f"{path} row {row.src_row}: {err.detail}"
        if not first_rejection:
            first_rejection.append(f"{err.reason}: {detail}")
        out.rejections.append({"source": name, "src_file": path, "src_row": row.src_row, "reason": err.reason,
                               "detail": detail, "raw": row.raw})

    for row in rows:
        if row.value is BLANK:
            stat["blank_lines"] += 1
            continue
        file_stat["rows"] += 1
        stat["rows_in"] += 1
        try:
            if row.error is not None:
                raise row.error
            pair = parse_row(row.value, fmt, options)
            earlier = first_seen.get(pair.content_hash)
            if earlier is not None:
                s, f, r = earlier
                raise RowRejected("duplicate", f"same prompt, chosen and rejected as {s} {f} row {r}")
            earlier = first_seen.get(content_hash(pair.prompt, pair.rejected, pair.chosen))
            if earlier is not None:
                s, f, r = earlier
                raise RowRejected("contradicts", f"{s} {f} row {r} has this prompt with chosen and rejected swapped")
        except RowRejected as err:
            reject(row, err)
            continue
        first_seen.add(pair.content_hash, name, path, row.src_row)
        stat["parsed_as"][pair.fmt] = stat["parsed_as"].get(pair.fmt, 0) + 1
        stat["pairs_out"] += 1
        out.pairs.append({"pair_id": pair.pair_id, "content_hash": pair.content_hash, "source": name,
                          "prompt": pair.prompt, "chosen": pair.chosen, "rejected": pair.rejected,
                          "margin": pair.margin, "src_file": path, "src_row": row.src_row})


def normalize_to_files(sources: list[dict], pairs_path: str, rejections_path: str,
                       base_dir: str | Path = ".") -> dict:
    """The stage: normalize_sources writing pairs.parquet (sorted by pair_id through the on-disk sort) and
    rejections.parquet (read order) as it goes; returns the stats. Nothing appears on a refusal."""
    Path(pairs_path).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".normalize_spill.", dir=Path(pairs_path).parent) as tmp, \
            ParquetStreamWriter(rejections_path, REJECTIONS_SCHEMA) as rejections_out:
        spill = PairSpill(Path(tmp))
        out = Normalized(pairs=spill, rejections=TableSink(rejections_out, REJECTIONS_SCHEMA))
        normalize_sources(sources, base_dir, out)
        out.rejections.flush()
        with ParquetStreamWriter(pairs_path, PAIRS_SCHEMA) as pairs_out:
            spill.write_sorted(pairs_out)
    return out.stats


def _arguments(ap) -> None:
    ap.add_argument("--pairs", required=True, help="output pairs.parquet")
    ap.add_argument("--rejections", required=True, help="output rejections.parquet")
    ap.add_argument("--stats", required=True, help="output normalize_stats.json")


def _run(args) -> int:
    log = logging.getLogger("normalize")
    params = load_stage_params(args.params, "normalize")
    stats = normalize_to_files(params["data"]["sources"], args.pairs, args.rejections)
    for s in stats["sources"]:
        reasons = {r: n for r, n in s["rejected"].items() if n}
        log.info("source %s (%s, %s): rows_in=%d pairs_out=%d rejected=%d %s", s["name"], s["path"], s["format"],
                 s["rows_in"], s["pairs_out"], s["rejected_total"], reasons or "")
    # The stats file last: it is the summary of outputs that already exist in full.
    write_json(args.stats, stats)
    t = stats["totals"]
    log.info("wrote %d pairs to %s, %d rejections to %s", t["pairs_out"], args.pairs, t["rejected_total"],
             args.rejections)
    return 0


def main(argv: list[str] | None = None) -> int:
    return stage_main(argv, "normalize", __doc__.split("\n")[0], add_arguments=_arguments, run=_run,
                      input_errors=(SourceError, ParamsError))


if __name__ == "__main__":
    raise SystemExit(main())
