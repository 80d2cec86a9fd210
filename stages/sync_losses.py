"""Rewrite what copies the DPO loss registry (stages/engine/dpo_losses.py) from it, as workflow/sync_dvc.py does
dvc.yaml from the rules. A maintainer's tool, no rule (as stages/embedded_data.py): no stage imports it.

    python -m stages.sync_losses            # rewrite the generated blocks
    python -m stages.sync_losses --check    # exit 1 naming each stale block (tests/engine/test_dpo_loss_registry.py)

The blocks, each between a `>>> NAME:` and a `<<< NAME` marker line:
  workflow/schemas/params.schema.yaml  `dpo.loss names` (the dpo.loss enum: params pre-flight refuses an unknown
                                       name at DAG build, before any stage runs) and `dpo loss knobs` (the extra
                                       dpo.* keys the losses declare, with their bounds);
  params.yaml                          `dpo.loss names` (the comment above `loss:`);
  docs/DPO_LOSSES.md                   `dpo.loss table`.
None of them is a code dependency of a stage (DVC tracks params.yaml by key), so regenerating them after adding a
loss reruns nothing beyond what the new loss itself reruns: train_dpo and what follows it.
"""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from stages.engine.dpo_losses import KNOBS, LOSSES, REFERENCE_FREE_LOSSES
from stages.lib.implicit_reward import MEAN_REWARD

ROOT = Path(__file__).resolve().parents[1]

WIDTH = 118


def _schema_enum(indent: str) -> list[str]:
    lead = f"{indent}enum: ["
    return textwrap.wrap(", ".join(LOSSES) + "]", WIDTH, initial_indent=lead,
                         subsequent_indent=" " * len(lead), break_on_hyphens=False)


def _schema_knobs(indent: str) -> list[str]:
    lines = []
    for key, knob in KNOBS.items():
        bound = "exclusiveMinimum" if knob.exclusive else "minimum"
        lines += [f"{indent}{key}:", f"{indent}  type: number", f"{indent}  {bound}: {knob.minimum:g}",
                  f"{indent}  description: {json.dumps('Optional, ' + knob.description)}"]
    return lines


def _params_comment(indent: str) -> list[str]:
    paired = [n for n in LOSSES if n not in REFERENCE_FREE_LOSSES]
    knobs = ", ".join(f"{k} ({knob.default:g}, {', '.join(n for n, d in LOSSES.items() if knob in d.knobs)})"
                      for k, knob in KNOBS.items())
    text = (f"dpo.loss: one of {' | '.join(paired)}; reference-free (objective dpo_ref_free): "
            f"{' | '.join(REFERENCE_FREE_LOSSES)}; or a list of them with optional `loss_weights: [...]` (TRL's "
            f"loss_type list + loss_weights). Optional knobs: {knobs}.")
    return textwrap.wrap(text, WIDTH, initial_indent=f"{indent}# ", subsequent_indent=f"{indent}# ",
                         break_on_hyphens=False)


def _reads(loss) -> str:
    parts = ["**no reference** (dpo_ref_free only)"] if loss.reference_free else []
    if loss.smoothing:
        parts.append("label_smoothing" + (" (> 0 required)" if loss.requires_smoothing else ""))
    if loss.lengths:
        parts.append("lengths")
    parts += [f"`dpo.{k.key}` ({k.default:g})" for k in loss.knobs]
    return ", ".join(parts) or "-"


def _docs_table(indent: str) -> list[str]:
    lines = ["| `dpo.loss` | loss | reads | probe reward | TRL 1.16 equivalent | difference |",
             "|---|---|---|---|---|---|"]
    for name, loss in LOSSES.items():
        reward = {None: "none of its own", MEAN_REWARD: "mean"}.get(loss.implicit_reward, "summed")
        cells = [f"`{name}`", loss.summary, _reads(loss), reward, loss.trl, loss.difference]
        lines.append("| " + " | ".join(c.replace("\n", " ") for c in cells) + " |")
    return lines


# (file, block name, renderer of the lines between the markers, given the begin marker's indentation)
BLOCKS = [
    ("workflow/schemas/params.schema.yaml", "dpo.loss names", _schema_enum),
    ("workflow/schemas/params.schema.yaml", "dpo loss knobs", _schema_knobs),
    ("params.yaml", "dpo.loss names", _params_comment),
    ("docs/DPO_LOSSES.md", "dpo.loss table", _docs_table),
]


def synced(text: str, name: str, render, where: str) -> str:
    """`text` with the lines between block `name`'s markers rendered anew."""
    lines = text.split("\n")
    begins = [i for i, line in enumerate(lines) if f">>> {name}:" in line]
    ends = [i for i, line in enumerate(lines) if f"<<< {name}" in line]
    if len(begins) != 1 or len(ends) != 1 or ends[0] < begins[0]:
        raise SystemExit(f"sync_losses: {where}: needs exactly one '>>> {name}:' line followed by one "
                         f"'<<< {name}' line")
    b, e = begins[0], ends[0]
    indent = lines[b][:len(lines[b]) - len(lines[b].lstrip())]
    return "\n".join(lines[:b + 1] + render(indent) + lines[e:])


def stale_blocks(root: Path = ROOT) -> list[str]:
    """'file: block' for every generated block that differs from the registry."""
    out = []
    for rel, name, render in BLOCKS:
        text = (root / rel).read_text(encoding="utf-8")
        if synced(text, name, render, rel) != text:
            out.append(f"{rel}: {name}")
    return out


def write_blocks(root: Path = ROOT) -> list[str]:
    """Rewrite every stale block; returns the files written."""
    written = []
    for rel, name, render in BLOCKS:
        path = root / rel
        text = path.read_text(encoding="utf-8")
        new = synced(text, name, render, rel)
        if new != text:
            path.write_text(new, encoding="utf-8")
            written.append(rel)
    return sorted(set(written))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--check"]:
        stale = stale_blocks()
        for block in stale:
            print(f"sync_losses: stale: {block} (run python -m stages.sync_losses)", file=sys.stderr)
        return 1 if stale else 0
    if argv:
        print("usage: python -m stages.sync_losses [--check]", file=sys.stderr)
        return 2
    for rel in write_blocks():
        print(f"sync_losses: wrote {rel}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
