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

import hashlib
import logging
import sys
from dataclasses import dataclass

import pyarrow as pa

from stages.lib.cli import stage_main
from stages.lib.contracts import (PAIR_COLUMNS, content_hash_problem, missing_pair_columns, pair_id_problem,
                                  pair_problems, probe_digest, row_content_hash)
from stages.lib.io import (ParquetStreamWriter, canonical_json, iter_parquet_batches, open_parquet, read_parquet,
                           sha256_text, write_json, write_parquet)
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
    manifest = probe_manifest(size, seed, pair_ids, hashes, probe_rows, excluded_rows, len(train_rows))
    return ProbeSplit(train=train, probe=probe, manifest=manifest)


def probe_manifest(size: int, seed: int, pair_ids, hashes, probe_rows, excluded_rows, train_pairs: int) -> dict:
    """probe_manifest.json (docs/ARTIFACTS.md) from row indices into the pairs' IDs and content hashes; the one
    builder of both paths (in memory, streaming), so their manifests cannot drift apart."""
    probe_ids = [pair_ids[i] for i in probe_rows]
    probe_hashes = [hashes[i] for i in probe_rows]
    return {
        "size": size,
        "seed": seed,
        "selection": SELECTION,
        "pair_ids": probe_ids,
        "content_hashes": probe_hashes,
        "probe_digest": probe_digest(probe_ids, probe_hashes),
        "train_pairs": train_pairs,
        "excluded_from_train": [{"pair_id": pair_ids[i], "reason": LEAK} for i in excluded_rows],
    }


# ==================================================================================================
# Streaming: the same split from the parquet file in bounded memory
# ==================================================================================================

DEFAULT_CHUNK_ROWS = 4096


def _key_digest(prompt: list, where: str, row: int, pair_id: str) -> bytes:
    """16 bytes of sha256(prompt_key): what the streaming split keeps per row instead of the key."""
    if not prompt or any(not isinstance(m, dict) or not isinstance(m.get("content"), str)
                         or not isinstance(m.get("role"), str) for m in prompt):
        raise ProbeError(f"{where} row {row} (pair {pair_id}): prompt must be a non-empty "
                         f"list of {{role, content}} strings, got {prompt!r}")
    return hashlib.sha256(prompt_key(prompt).encode("utf-8")).digest()[:16]


def freeze_probe_file(pairs_path: str, size: int, seed: int, *, train_path: str, probe_path: str,
                      chunk_rows: int = DEFAULT_CHUNK_ROWS) -> dict:
    """freeze_probe() on the parquet at `pairs_path`, written to train_path / probe_path as it goes;
    returns the manifest. Two passes over the file; between them only per-row pair IDs, 16-byte prompt
    key digests and selection ranks are held. The same bytes as write_parquet(freeze_probe(...)):
    normalize writes pairs sorted by pair_id, so train is the input filtered in place (an input in
    another order is split through freeze_probe() in memory)."""
    import numpy as np

    where = pairs_path
    # A missing file is an input error (FileNotFoundError), a damaged one too (CorruptFileError, page CRCs verified).
    pf = open_parquet(pairs_path)
    missing = missing_pair_columns(pf.schema_arrow.names)
    if missing:
        raise ProbeError(f"{where}: missing column(s) {missing}; expected normalize's pairs schema "
                         f"{PAIR_COLUMNS} (docs/ARTIFACTS.md)")
    pair_ids: list[str] = []
    hashes: list[str] = []
    keys: list[bytes] = []
    seen: dict[str, int] = {}
    problems: list[str] = []
    n_problems, rows = 0, 0
    in_order = True
    bad_prompt: ProbeError | None = None  # raised after the integrity check, as freeze_probe() orders them
    for batch in iter_parquet_batches(pairs_path, chunk_rows, ["pair_id", "content_hash", "prompt", "chosen",
                                                              "rejected"], parquet_file=pf):
        start, rows = rows, rows + batch.num_rows
        for i, pair in enumerate(batch.to_pylist()):
            row, pid, ch = start + i, pair["pair_id"], pair["content_hash"]
            problem = pair_id_problem(row, pid, ch, seen)
            if problem is None:
                actual = row_content_hash(pair)
                if actual != ch:
                    problem = content_hash_problem(row, pid, ch, actual)
            if problem is not None:
                n_problems += 1
                if len(problems) < 20:
                    problems.append(problem)
                continue
            if pair_ids and not pid > pair_ids[-1]:
                in_order = False
            pair_ids.append(pid)
            hashes.append(ch)
            try:
                keys.append(_key_digest(pair["prompt"], where, row, pid))
            except ProbeError as e:
                bad_prompt = bad_prompt or e
                keys.append(b"")
    if n_problems:
        raise ProbeError(f"{where}: {n_problems} pair(s) do not match their recorded hashes:\n  "
                         + "\n  ".join(problems))
    if bad_prompt is not None:
        raise bad_prompt
    seen.clear()
    if not in_order:  # not normalize's order: the in-memory split sorts it (inputs a person made)
        split = freeze_probe(read_parquet(pairs_path), size=size, seed=seed, where=where)
        write_parquet(train_path, split.train)
        write_parquet(probe_path, split.probe)
        return split.manifest

    key_array = np.array(keys, dtype="S16")
    del keys
    n_prompts = int(np.unique(key_array).size)
    if n_prompts < size:
        raise ProbeError(f"{where}: {n_prompts} distinct prompts ({len(pair_ids)} pairs) but probe.size "
                         f"is {size}; the probe takes at most one pair per prompt, so it needs at least "
                         f"{size} distinct prompts (lower probe.size or add data)")
    # Ranks are sha256 hex digests: their bytes sort as the hex strings do; pair IDs are unique here.
    ranks = np.array([hashlib.sha256(f"{seed}:{pid}".encode()).digest() for pid in pair_ids], dtype="S32")
    probe_rows: list[int] = []
    probe_keys: set[bytes] = set()
    for i in np.argsort(ranks, kind="stable"):
        k = key_array[i]
        if k not in probe_keys:
            probe_rows.append(int(i))
            probe_keys.add(k)
            if len(probe_rows) == size:
                break
    del ranks
    probe_pos = {row: k for k, row in enumerate(probe_rows)}
    train_mask = ~np.isin(key_array, np.array(sorted(probe_keys), dtype="S16"))
    excluded_rows = [int(i) for i in np.flatnonzero(~train_mask) if int(i) not in probe_pos]
    assert int(train_mask.sum()) + len(probe_rows) + len(excluded_rows) == len(pair_ids)

    probe_parts: list[tuple[list[int], pa.Table]] = []  # (probe positions, their rows) per batch
    start = 0
    with ParquetStreamWriter(train_path, pf.schema_arrow) as train_out:
        for batch in iter_parquet_batches(pairs_path, chunk_rows, parquet_file=pf):
            n = batch.num_rows
            train_out.write(batch.filter(pa.array(train_mask[start:start + n])))
            local = [r - start for r in range(start, start + n) if r in probe_pos]
            if local:
                probe_parts.append(([probe_pos[start + r] for r in local],
                                    pa.Table.from_batches([batch.take(pa.array(local, pa.int64()))])))
            start += n
    positions = [p for ps, _ in probe_parts for p in ps]
    probe = pa.concat_tables([t for _, t in probe_parts]) if probe_parts else pf.schema_arrow.empty_table()
    order = sorted(range(len(positions)), key=positions.__getitem__)
    write_parquet(probe_path, probe.take(pa.array(order, pa.int64())).combine_chunks())

    return probe_manifest(size, seed, pair_ids, hashes, probe_rows, excluded_rows, int(train_mask.sum()))


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
    m = freeze_probe_file(args.pairs, size=cfg["size"], seed=cfg["seed"], train_path=args.train,
                          probe_path=args.probe)
    write_json(args.manifest, m)  # last: its presence means the split is complete
    n = m["train_pairs"] + len(m["pair_ids"]) + len(m["excluded_from_train"])
    log.info("%d pairs in: probe %d (seed %d, digest %s), train %d, excluded from train %d (%s)",
             n, len(m["pair_ids"]), m["seed"], m["probe_digest"], m["train_pairs"],
             len(m["excluded_from_train"]), LEAK)
    return 0


def main(argv: list[str] | None = None) -> int:
    return stage_main(argv, "freeze_probe", __doc__.split("\n")[0], add_arguments=_arguments, run=_run,
                      input_errors=(ProbeError, ParamsError))


if __name__ == "__main__":
    sys.exit(main())
