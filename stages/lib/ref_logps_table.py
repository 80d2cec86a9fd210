"""The ref_logps table: the reference's summed completion log-probs, written by the ref_logps stage and read by
train_dpo (the one contract between the two; docs/ARTIFACTS.md "ref_logps").

It lives here, not beside the DPO losses, so that a change to a loss reruns train_dpo only: ref_logps imports this
module and the engine's inference pass, never stages/engine/dpo_losses.py (workflow/code_deps.py computes each
rule's code dependencies from its imports).

`pairs` below is the engine's TokenPairs (stages/engine/packing.py); only its `pair_ids`, `token_hashes` and `source`
are read (lib imports no engine module).
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pac

from stages.lib.io import read_parquet, write_parquet


class RefLogpsError(ValueError):
    """ref_logps.parquet does not match the token data it is used with."""


REF_LOGPS_SCHEMA = pa.schema([("pair_id", pa.string()), ("split", pa.string()), ("ref_chosen_logp", pa.float64()),
                              ("ref_rejected_logp", pa.float64()), ("token_hash", pa.string())])


def ref_logps_table(splits: list[tuple[str, object, np.ndarray]]) -> pa.Table:
    """(split, pairs, logps [n, 2]) -> the ref_logps parquet table, rows in split then file order."""
    cols = {name: [] for name in REF_LOGPS_SCHEMA.names}
    for split, pairs, logps in splits:
        cols["pair_id"] += pairs.pair_ids
        cols["split"] += [split] * len(pairs)
        cols["ref_chosen_logp"] += logps[:, 0].astype(np.float64).tolist()
        cols["ref_rejected_logp"] += logps[:, 1].astype(np.float64).tolist()
        cols["token_hash"] += pairs.token_hashes
    return pa.Table.from_pydict(cols, schema=REF_LOGPS_SCHEMA)


def write_ref_logps(path, table: pa.Table) -> None:
    """The ref_logps parquet, with the digest of its values in the footer (stages.lib.io.VALUES_DIGEST_KEY): the
    log-probs have no content hash of their own, and the page CRCs do not cover the footer."""
    write_parquet(path, table, values_digest=True)


def read_ref_logps(path) -> pa.Table:
    """write_ref_logps's table; a damaged file (page CRC, values digest) is refused naming it (CorruptFileError)."""
    return read_parquet(path, values_digest=True)


def ref_logps_for(table: pa.Table, split: str, pairs, source: str) -> np.ndarray:
    """[n, 2] reference log-probs aligned to `pairs`; refuses missing, duplicated, stale or non-finite rows."""
    rows = table.filter(pac.equal(table.column("split"), split)).to_pydict()
    index: dict[str, int] = {}
    for i, pid in enumerate(rows["pair_id"]):
        if pid in index:
            raise RefLogpsError(f"{source}: pair {pid} appears twice in split {split}")
        index[pid] = i
    out = np.empty((len(pairs), 2), dtype=np.float64)
    for k, (pid, token_hash) in enumerate(zip(pairs.pair_ids, pairs.token_hashes)):
        i = index.get(pid)
        if i is None:
            raise RefLogpsError(f"{source}: no {split} row for pair {pid} (from {pairs.source}); rerun ref_logps")
        if "token_hash" in rows and rows["token_hash"][i] != token_hash:
            raise RefLogpsError(f"{source}: pair {pid} was computed from other tokens (token_hash "
                                f"{rows['token_hash'][i][:12]} != {token_hash[:12]} in {pairs.source}); rerun ref_logps")
        out[k] = (rows["ref_chosen_logp"][i], rows["ref_rejected_logp"][i])
    if not np.isfinite(out).all():
        bad = pairs.pair_ids[int(np.flatnonzero(~np.isfinite(out).all(axis=1))[0])]
        raise RefLogpsError(f"{source}: non-finite reference log-prob for pair {bad}")
    return out
