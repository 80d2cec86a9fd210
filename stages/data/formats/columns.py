"""`columns`: any other layout. The source's `columns` mapping {prompt?, chosen, rejected, system?, margin?} names
the row's column for each canonical field, e.g. `columns: {prompt: question, chosen: good_answer, rejected:
bad_answer}`.

Values are strings or message lists as in `trl` (no prompt column -> implicit prompt); `system` (string, "" or
null = none) is prepended; `margin` (a finite number or null) is kept in the pair's `margin` column, anything
else is rejected (`margin`). Never detected by `auto`: the mapping is the source's, not the row's.
"""
from __future__ import annotations

import math
from typing import Any

from stages.data.messages import Format, Parsed, RowRejected, require_keys, trl_fields

FIELDS = ("prompt", "chosen", "rejected", "system", "margin")


def parse(row: dict, mapping: dict) -> Parsed:
    used = [mapping[k] for k in FIELDS if k in mapping]
    require_keys(row, tuple(used), "columns")
    prompt, c, r = trl_fields(row, mapping.get("prompt"), mapping["chosen"], mapping["rejected"],
                              mapping.get("system"), "columns")
    margin = None
    if "margin" in mapping:
        m = row[mapping["margin"]]
        if m is not None:
            if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m):
                raise RowRejected("margin", f"margin column {mapping['margin']!r} is {m!r}, expected a finite number")
            margin = float(m)
    return prompt, c, r, margin


def check_mapping(mapping: Any) -> str | None:
    if not isinstance(mapping, dict) or "chosen" not in mapping or "rejected" not in mapping:
        return "format 'columns' needs a columns mapping with at least chosen and rejected"
    return None


FORMAT = Format("columns", parse, reasons=("margin",),  # margin present but not a finite number
                options="columns", check_options=check_mapping)
