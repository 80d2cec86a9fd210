"""Freeze the evaluation probe: a seeded, order-independent split of the normalized pairs.

    python -m stages.freeze_probe --params params.yaml --pairs results/normalize/pairs.parquet \\
        --train results/probe/train.parquet --probe results/probe/probe.parquet \\
        --manifest results/probe/probe_manifest.json --log logs/freeze_probe.log

Selection: every pair gets the rank sha256(f"{probe.seed}:{pair_id}"); pairs are walked in
ascending rank and a pair joins the probe unless a pair with the same normalized prompt already
did, until probe.size pairs are taken. The result depends only on the set of pairs and the seed,
never on row order. Normalized prompt = canonical JSON of the prompt messages with each content's
whitespace collapsed, so "What  colour?" and "What colour?\\n" are one prompt.

No probe prompt reaches train: every other pair whose normalized prompt equals a probe prompt is
excluded from train and listed in the manifest (`excluded_from_train`, reason `probe_prompt_leak`),
so train + probe + excluded == input, nothing lost silently. Fewer distinct prompts than
probe.size is an error naming both numbers. Outputs (docs/ARTIFACTS.md): train.parquet sorted by
pair_id, probe.parquet in manifest order, probe_manifest.json with the probe digest that later
stages check.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import pyarrow as pa

from stages.lib.cli import stage_main
from stages.lib.contracts import PAIR_COLUMNS, missing_pair_columns, pair_problems, probe_digest
from stages.lib.io import canonical_json, read_parquet, sha256_text, write_json, write_parquet
from stages.lib.params import ParamsError, load_params

SELECTION = ("ascending sha256(f'{seed}:{pair_id}'), at most one pair per normalized prompt "
             "(canonical JSON of messages, whitespace-collapsed content)")
LEAK = "probe_prompt_leak"


class ProbeError(ValueError):
    """The pairs cannot give a valid probe (too few prompts, malformed or inconsistent rows)."""


@dataclass(frozen=True)
class ProbeSplit:
    train: pa.Table
    probe: pa.Table
    manifest: dict


# ==================================================================================================
# Pure functions
# ==================================================================================================


def prompt_key(prompt: list[dict]) -> str:
    """The prompt as leakage is judged: same roles, same words in the same order."""
    return canonical_json([{"role": m["role"], "content": " ".join(m["content"].split())} for m in prompt])


def selection_rank(seed: int, pair_id: str) -> str:
    return sha256_text(f"{seed}:{pair_id}")


def _check_pairs(pairs: pa.Table, where: str) -> None:
    missing = missing_pair_columns(pairs.column_names)
    if missing:
        raise ProbeError(f"{where}: missing column(s) {missing}; expected normalize's pairs schema "
                         f"{PAIR_COLUMNS} (docs/ARTIFACTS.md)")
    # The manifest vouches for content by content_hash: recompute it rather than trust it.
    problems = pair_problems(pairs.select(["pair_id", "content_hash", "prompt", "chosen", "rejected"]).to_pylist())
    if problems:
        raise ProbeError(f"{where}: {len(problems)} pair(s) do not match their recorded hashes:\n  "
                         + "\n  ".join(problems[:20]))


def freeze_probe(pairs: pa.Table, size: int, seed: int, where: str = "pairs") -> ProbeSplit:
    """Split `pairs` (normalize's schema) into train and a `size`-pair probe; see the module doc."""
    _check_pairs(pairs, where)
    pair_ids = pairs.column("pair_id").to_pylist()
    hashes = pairs.column("content_hash").to_pylist()
    keys = []
    for row, prompt in enumerate(pairs.column("prompt").to_pylist()):
        if not prompt or any(not isinstance(m, dict) or not isinstance(m.get("content"), str)
                             or not isinstance(m.get("role"), str) for m in prompt):
            raise ProbeError(f"{where} row {row} (pair {pair_ids[row]}): prompt must be a non-empty "
                             f"list of {{role, content}} strings, got {prompt!r}")
        keys.append(prompt_key(prompt))

    n_prompts = len(set(keys))
    if n_prompts < size:
        raise ProbeError(f"{where}: {n_prompts} distinct prompts ({len(pair_ids)} pairs) but probe.size "
                         f"is {size}; the probe takes at most one pair per prompt, so it needs at least "
                         f"{size} distinct prompts (lower probe.size or add data)")

    order = sorted(range(len(pair_ids)), key=lambda i: (selection_rank(seed, pair_ids[i]), pair_ids[i]))
    probe_rows: list[int] = []
    probe_keys: set[str] = set()
    for i in order:
        if keys[i] not in probe_keys:
            probe_rows.append(i)
            probe_keys.add(keys[i])
            if len(probe_rows) == size:
                break
    probe_set = set(probe_rows)
    excluded_rows = sorted((i for i in range(len(pair_ids)) if i not in probe_set and keys[i] in probe_keys),
                           key=lambda i: pair_ids[i])
    excluded_set = set(excluded_rows)
    train_rows = sorted((i for i in range(len(pair_ids)) if i not in probe_set and i not in excluded_set),
                        key=lambda i: pair_ids[i])
    assert len(train_rows) + len(probe_rows) + len(excluded_rows) == len(pair_ids)

    probe = pairs.take(pa.array(probe_rows, pa.int64()))
    train = pairs.take(pa.array(train_rows, pa.int64()))
    probe_ids = [pair_ids[i] for i in probe_rows]
    probe_hashes = [hashes[i] for i in probe_rows]
    manifest = {
        "size": size,
        "seed": seed,
        "selection": SELECTION,
        "pair_ids": probe_ids,
        "content_hashes": probe_hashes,
        "probe_digest": probe_digest(probe_ids, probe_hashes),
        "train_pairs": len(train_rows),
        "excluded_from_train": [{"pair_id": pair_ids[i], "reason": LEAK} for i in excluded_rows],
    }
    return ProbeSplit(train=train, probe=probe, manifest=manifest)


# ==================================================================================================
# CLI
# ==================================================================================================


def _arguments(ap) -> None:
    ap.add_argument("--pairs", required=True, help="normalize's pairs.parquet")
    ap.add_argument("--train", required=True, help="train.parquet to write")
    ap.add_argument("--probe", required=True, help="probe.parquet to write")
    ap.add_argument("--manifest", required=True, help="probe_manifest.json to write")


def _run(args) -> int:
    log = logging.getLogger("freeze_probe")
    cfg = load_params(args.params)["probe"]
    pairs = read_parquet(args.pairs)
    split = freeze_probe(pairs, size=cfg["size"], seed=cfg["seed"], where=args.pairs)
    write_parquet(args.train, split.train)
    write_parquet(args.probe, split.probe)
    write_json(args.manifest, split.manifest)  # last: its presence means the split is complete
    m = split.manifest
    log.info("%d pairs in: probe %d (seed %d, digest %s), train %d, excluded from train %d (%s)",
             pairs.num_rows, len(m["pair_ids"]), m["seed"], m["probe_digest"], m["train_pairs"],
             len(m["excluded_from_train"]), LEAK)
    return 0


def main(argv: list[str] | None = None) -> int:
    return stage_main(argv, "freeze_probe", __doc__.split("\n")[0], add_arguments=_arguments, run=_run,
                      input_errors=(ProbeError, ParamsError))


if __name__ == "__main__":
    sys.exit(main())
