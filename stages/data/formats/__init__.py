"""The format registry: every module in this package is one source format, found here (nothing lists them).

A format module `<name>.py` defines `FORMAT = Format("<name>", parse, ...)` (stages/data/messages.py says what
each field means): its parser, its `auto` detection and rank, its own reason codes, its source options. This
module imports every module of the package (pkgutil.iter_modules), so adding a format is adding its file;
workflow/code_deps.py counts every module of a package that discovers its modules this way as a dependency of
whoever imports the package, so a stage reruns when any format changes.

    FORMATS               name -> Format, sorted by name
    FORMAT_NAMES          the values of a source's `format`: "auto", then every registered name
                          (params.schema.yaml's enum, params.yaml's comment and README's format table list the
                          same names: tests/data/test_formats.py ties them to this registry)
    REASONS               every reason code a row's parse can end with: COMMON_REASONS, then each format's own
    detect_format(row)    the `auto` rule: formats by ascending auto_rank, the first whose detect(row) holds
    parse_row(row, fmt, options)   one row -> a validated Pair, or RowRejected
    options_of(spec)               a source entry's options for its format (columns: its mapping)
    check_format_options(spec)     a source entry's `format` and format options, or what is wrong with them
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any

from stages.data.messages import COMMON_REASONS, Format, Message, RowRejected, validate_pair
from stages.lib.contracts import content_hash, pair_id_of

AUTO = "auto"


def _discover() -> dict[str, Format]:
    found: dict[str, Format] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        fmt = getattr(module, "FORMAT", None)
        if not isinstance(fmt, Format) or fmt.name != info.name:
            raise TypeError(f"{module.__name__}: a format module defines FORMAT = Format({info.name!r}, ...)")
        if fmt.name == AUTO:
            raise TypeError(f"{module.__name__}: {AUTO!r} is the per-row detection, not a format name")
        if (fmt.detect is None) != (fmt.auto_rank is None):
            raise TypeError(f"{module.__name__}: detect and auto_rank go together")
        shared = set(fmt.reasons) & set(COMMON_REASONS)
        if shared:
            raise TypeError(f"{module.__name__}: reasons {sorted(shared)} are common ones (COMMON_REASONS)")
        found[fmt.name] = fmt
    ranks = [f.auto_rank for f in found.values() if f.auto_rank is not None]
    if len(ranks) != len(set(ranks)):
        raise TypeError(f"format auto_rank values must be distinct, got {sorted(ranks)}")
    return found


FORMATS: dict[str, Format] = _discover()
FORMAT_NAMES: tuple[str, ...] = (AUTO, *FORMATS)
REASONS: tuple[str, ...] = COMMON_REASONS + tuple(dict.fromkeys(r for f in FORMATS.values() for r in f.reasons))
_DETECTION = sorted((f for f in FORMATS.values() if f.detect is not None), key=lambda f: f.auto_rank)
# The key sets `auto` looks for, most general first, for the message of a row it cannot place.
_EXPECTED = list(dict.fromkeys("+".join(f.detect_keys) for f in reversed(_DETECTION)))
_EXPECTED_TEXT = ", ".join(_EXPECTED[:-1]) + (", or " if len(_EXPECTED) > 1 else "") + _EXPECTED[-1]


def detect_format(row: dict) -> str:
    """The `auto` rule, decided per row from its keys (and, for hh, its values); keys a format does not use are
    ignored. RowRejected (`schema`) when no format claims the row."""
    for fmt in _DETECTION:
        if fmt.detect(row):
            return fmt.name
    raise RowRejected("schema", f"cannot detect the format from keys {sorted(row)} (auto expects {_EXPECTED_TEXT})")


@dataclass(frozen=True)
class Pair:
    prompt: list[Message]
    chosen: list[Message]
    rejected: list[Message]
    margin: float | None
    content_hash: str
    fmt: str  # the format that parsed the row (the detected one under `auto`)

    @property
    def pair_id(self) -> str:
        return pair_id_of(self.content_hash)


def parse_row(row: Any, fmt: str, options: Any = None) -> Pair:
    """One parsed row -> a validated Pair, or RowRejected with the reason code. `options`: the source's options
    entry for a format that has one (columns: its mapping)."""
    if row is None:
        raise RowRejected("schema", "row is null, expected an object")
    if not isinstance(row, dict):
        raise RowRejected("schema", f"row is {type(row).__name__}, expected an object")
    if fmt == AUTO:
        fmt = detect_format(row)
    spec = FORMATS[fmt]
    if spec.options is not None and not options:
        raise ValueError(f"format {fmt!r} needs its {spec.options!r} options")
    try:
        prompt, chosen, rejected, margin = spec.parse(row, options)
        validate_pair(prompt, chosen, rejected)
    except RowRejected as e:
        if e.reason not in COMMON_REASONS and e.reason not in spec.reasons:
            # A code no one declared would be a key missing from every count: a bug in the format, not bad input.
            raise ValueError(f"format {fmt!r} raised reason code {e.reason!r}, which it does not declare "
                             f"(its reasons: {list(spec.reasons)}; common: {list(COMMON_REASONS)})") from e
        raise
    return Pair(prompt, chosen, rejected, margin, content_hash(prompt, chosen, rejected), fmt)


def options_of(spec: dict) -> Any:
    """A checked source entry's options for its format (columns: its `columns` mapping); None for a format
    without options and for `auto`."""
    key = FORMATS[spec["format"]].options if spec["format"] != AUTO else None
    return spec.get(key) if key is not None else None


def check_format_options(spec: dict, where: str) -> str | None:
    """What is wrong with a source entry's `format` and format options (None: nothing). `where` names the entry."""
    fmt = spec["format"]
    if fmt not in FORMAT_NAMES:
        return f"{where}: unknown format {fmt!r} (expected one of {FORMAT_NAMES})"
    own = FORMATS[fmt].options if fmt != AUTO else None
    for other in FORMATS.values():
        key = other.options
        if key is not None and key != own and spec.get(key) is not None:
            return f"{where}: a {key} mapping is only used with format {other.name!r} (format is {fmt!r})"
    if own is not None:
        problem = FORMATS[fmt].check_options(spec.get(own))
        if problem:
            return f"{where}: {problem}"
    return None
