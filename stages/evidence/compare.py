"""A bundle's numbers against the same numbers recomputed (report verify: the metrics, the bootstrap bounds, the
generation evaluation). Its own module: verify.py and generation.py both use it, and neither imports the other for
it (the import circle bundle -> generation -> verify -> bundle it was part of)."""
from __future__ import annotations

import math
from typing import Any

FLOAT_REL_TOL = 1e-9     # recomputed float64 metrics: same numpy reduction order, only last-bit slack


def numbers_agree(a: Any, b: Any, where: str, out: list[str], skip=("distribution_sha256",)) -> None:
    """Append to `out` a line per difference between `a` (the bundle's) and `b` (recomputed), by key path `where`:
    floats within FLOAT_REL_TOL, everything else equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k in skip:
                continue
            if k not in a or k not in b:
                out.append(f"{where}.{k}: {'missing in the bundle' if k not in a else 'not recomputed'}")
            else:
                numbers_agree(a[k], b[k], f"{where}.{k}", out, skip)
    elif isinstance(a, float) or isinstance(b, float):
        ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and \
            math.isclose(a, b, rel_tol=FLOAT_REL_TOL, abs_tol=1e-12)
        if not ok:
            out.append(f"{where}: bundle {a!r}, recomputed {b!r}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            numbers_agree(x, y, f"{where}[{i}]", out, skip)
    elif a != b:
        out.append(f"{where}: bundle {a!r}, recomputed {b!r}")
