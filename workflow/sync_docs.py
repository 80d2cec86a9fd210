"""The documents' stage lists, generated from the code (issue 35 item 2), as sync_losses writes the loss lists and
sync_params_doc.py docs/PARAMS.md. A maintainer's tool, no rule:

    python workflow/sync_docs.py            # rewrite the generated blocks
    python workflow/sync_docs.py --check    # exit 1 naming each stale block (tests/workflow/test_docs_sync.py)

Generated, between `<!-- >>> NAME ... -->` and `<!-- <<< NAME -->` markers:
* README.md `stages`: the stage table, one row per stages/lib/layout.py STAGE_OUTPUTS entry in DAG order: what
  it writes (the layout's paths) and what it does (the first paragraph of its module's docstring);
* docs/ARCHITECTURE.md `stage-modules`: the stage modules, in the same order.
A new stage appears in both by its layout entry and its module; nothing is listed by hand.
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from stages.lib.layout import STAGE_OUTPUTS  # noqa: E402

# A stage whose rule runs another stage's module (verify_ref's check of a pinned policy or judge).
SHARED_MODULE = {"verify_policy": "verify_ref", "verify_judge": "verify_ref"}
NOTE = {"verify_policy": "The proof verify_ref gives `ref`, for a policy params pin (`generation.policy`); only then",
        "verify_judge": "The proof verify_ref gives `ref`, for a judge params pin (`generation.judge`); only then"}


def stage_module(stage: str) -> str:
    return SHARED_MODULE.get(stage, stage)


def summary(stage: str) -> str:
    """The first paragraph of the stage module's docstring, without its leading `name:` label, on one line."""
    path = ROOT / "stages" / f"{stage_module(stage)}.py"
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    if not first:
        raise SystemExit(f"{path.relative_to(ROOT)}: no module docstring (its first paragraph is the stage's summary)")
    first = re.sub(rf"^{re.escape(stage_module(stage))}:\s*", "", first, flags=re.I)
    return first[0].upper() + first[1:]


def _writes(outputs: dict[str, str]) -> str:
    """The stage's paths, grouped by folder: `results/train_dpo/` (model/, train_log.csv, ...)."""
    by_dir: dict[str, list[str]] = {}
    for path in outputs.values():
        folder, name = os.path.split(path)
        by_dir.setdefault(folder, []).append(name)
    parts = []
    for folder, names in by_dir.items():
        parts.append(f"`{folder}/{names[0]}`" if len(names) == 1 else f"`{folder}/` ({', '.join(names)})")
    return "; ".join(parts)


def stage_table() -> str:
    rows = ["| stage | writes | what it does |", "|---|---|---|"]
    for stage, outputs in STAGE_OUTPUTS.items():
        what = NOTE[stage] + "." if stage in NOTE else summary(stage)
        rows.append(f"| {stage} | {_writes(outputs)} | {what.replace('|', '/')} |")
    return "\n".join(rows)


def stage_modules() -> str:
    mods = list(dict.fromkeys(f"`stages/{stage_module(s)}.py`" for s in STAGE_OUTPUTS))
    return "The stage modules, in DAG order: " + ", ".join(mods) + "."


BLOCKS = {ROOT / "README.md": {"stages": stage_table}, ROOT / "docs" / "ARCHITECTURE.md": {"stage-modules": stage_modules}}


def render(text: str, name: str, body: str, path: Path) -> str:
    pattern = re.compile(rf"(<!-- >>> {re.escape(name)}\b[^\n]*-->\n)(.*?)(<!-- <<< {re.escape(name)} -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path.relative_to(ROOT)}: no `<!-- >>> {name} -->` ... `<!-- <<< {name} -->` block")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(3), text, count=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 naming each stale generated block")
    args = ap.parse_args(argv)
    stale = []
    for path, blocks in BLOCKS.items():
        text = new = path.read_text(encoding="utf-8")
        for name, make in blocks.items():
            new = render(new, name, make(), path)
        if new != text:
            if args.check:
                stale.append(str(path.relative_to(ROOT)))
            else:
                path.write_text(new, encoding="utf-8")
                print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"stale generated blocks in {', '.join(stale)}: run `python workflow/sync_docs.py`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
