"""Freeze the evaluation probe: a seeded, order-independent split of the normalized pairs.

    python -m stages.freeze_probe --params params.yaml --pairs results/normalize/pairs.parquet \\
        --identity results/ref/ref_identity.json \\
        --train results/probe/train.parquet --probe results/probe/probe.parquet \\
        --manifest results/probe/probe_manifest.json --log logs/freeze_probe.log

Selection: every pair gets the rank sha256(f"{probe.seed}:{pair_id}"); pairs are walked in
ascending rank and a pair joins the probe unless a pair with the same normalized prompt already
did, or it does not fit, until probe.size pairs are taken. Normalized prompt = canonical JSON of the
prompt messages with each content's whitespace collapsed, so "What  colour?" and "What colour?\\n" are one
prompt. A pair fits when tokenize would keep it: the reference's tokenizer (--identity, verified) under
params.yaml's `tokenize` limits and truncation mode (stages/data/truncation.py; a truncated pair fits, and is
recorded as truncated by tokenize), so the frozen probe is never refused for length (it must be scored whole).
Whether a pair fits depends on the pair, the tokenizer and the limits only, so the result depends only on the
set of pairs, the seed, the tokenizer and the limits, never on row order; a pair walked over because it does not
fit stays in train (tokenize rejects or truncates it there), counted by reason in the manifest (`fit`).
Only the pairs the walk reaches are tokenized (about probe.size of them).

No probe prompt reaches train: every other pair whose normalized prompt equals a probe prompt is
excluded from train and listed in the manifest (`excluded_from_train`, reason `probe_prompt_leak`),
so train + probe + excluded == input, nothing lost silently. Fewer distinct prompts than
probe.size is an error naming both numbers. Outputs (docs/ARTIFACTS.md): train.parquet sorted by
pair_id, probe.parquet in manifest order, probe_manifest.json with the probe digest that later
stages check.

Dev split (probe.dev_size > 0; none by default, and then nothing here changes): the walk continued past the probe,
taking the next probe.dev_size pairs of new prompts that fit, so the probe is the same pairs with or without it and
no dev prompt is a probe prompt; every other pair sharing a dev prompt leaves train (`dev_prompt_leak`, listed in
the manifest's `dev`). Written to --dev in walk order; training scores it to choose checkpoints (train.eval_every,
train.select_best), so the probe stays untouched evidence. Fewer distinct prompts left after the probe than
probe.dev_size is an error naming both numbers.
"""
from __future__ import annotations

import hashlib
import logging
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import pyarrow as pa

from stages.data.limits import TokenizeError, load_limits
from stages.data.pair_tokenizer import pair_tokenizer_for
from stages.data.tokenizer import load_tokenizer, tokenizer_identity, tokenizers_only_process
from stages.data.truncation import tokenize_pairs
from stages.lib.cli import stage_main
from stages.lib.contracts import (PAIR_COLUMNS, content_hash_problem, missing_pair_columns, pair_id_problem,
                                  pair_problems, probe_digest, prompt_key, row_content_hash)
from stages.lib import record_formats
from stages.lib.io import (ParquetStreamWriter, canonical_json, iter_parquet_batches, open_parquet, read_parquet,
                           sha256_text, write_json, write_parquet)
from stages.lib.params import ParamsError
from stages.lib.declared_params import load_stage_params
from stages.lib.reference import RefIdentityError, load_verified_dir

SELECTION = ("ascending sha256(f'{seed}:{pair_id}'), at most one pair per normalized prompt "
             "(canonical JSON of messages, whitespace-collapsed content)")
FIT_SELECTION = ", only pairs tokenize keeps under the tokenize limits (fit)"
LEAK = "probe_prompt_leak"


class ProbeError(ValueError):
    """The pairs cannot give a valid probe (too few prompts, malformed or inconsistent rows)."""


class ProbeFit:
    """Whether tokenize would keep a pair: the reference's pair tokenizer under the tokenize limits (the probe is
    scored whole, so a pair it would reject cannot be a probe pair). `reasons(pairs)`: None for a pair that fits,
    else tokenize's rejection reason."""

    def __init__(self, tokenizer, limits, tokenizer_identity: str, tok_params: dict | None = None):
        """`tokenizer`: a loaded tokenizer, or a directory to load it from when it is first needed (after the pairs
        are checked: bad pairs are refused without loading one). `tok_params`: params.yaml's tokenize section, for
        its chat_template (the rendering decides the lengths; None: the default)."""
        self.tokenizer, self.limits, self.tokenizer_identity = tokenizer, limits, tokenizer_identity
        self.tok_params = tok_params
        self._pair_tokenizer = None

    def pair_tokenizer(self):
        if self._pair_tokenizer is None:
            tok = self.tokenizer
            self._pair_tokenizer = pair_tokenizer_for(load_tokenizer(tok) if isinstance(tok, (str, Path)) else tok,
                                                      self.tok_params)
        return self._pair_tokenizer

    def reasons(self, pairs: list[dict]) -> list[str | None]:
        rejected = {r["pair_id"]: r["reason"] for r in
                    tokenize_pairs(self.pair_tokenizer(), pairs, self.limits, "probe").rejections}
        return [rejected.get(p["pair_id"]) for p in pairs]

    def record(self, skipped: Counter) -> dict:
        """The manifest's `fit`: what fitting meant and the pairs the walk passed over for not fitting."""
        record = {"tokenizer_identity": self.tokenizer_identity, "limits": self.limits.as_dict(),
                  "skipped": sum(skipped.values()), "skipped_by_reason": dict(sorted(skipped.items()))}
        # The rendering decides the lengths: tokenize holds a probe frozen under another template to it.
        record["chat_template"] = self.pair_tokenizer().chat_template.record()
        return record


@dataclass(frozen=True)
class ProbeSplit:
    train: pa.Table
    probe: pa.Table
    manifest: dict
    dev: pa.Table | None = None        # probe.dev_size > 0: the dev split (manifest `dev`), else None


# ==================================================================================================
# Pure functions
# ==================================================================================================


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


def select_probe(order: Iterable[int], keys: Sequence, size: int,
                 fit_reasons: Callable[[list[int]], list[str | None]] | None) -> tuple[list[int], Counter]:
    """The walk (module doc): rows in `order` (ascending rank), each taken unless its key (normalized prompt) is
    taken or it does not fit, until `size` rows are. `fit_reasons(rows)`: None per row that fits, else why not
    (None: every row fits). Rows are asked about in windows of as many as are still missing, so about `size`
    rows are tokenized when most fit. Returns (probe rows in walk order, the reasons of the rows passed over)."""
    probe_rows: list[int] = []
    probe_keys: set = set()
    skipped: Counter = Counter()
    order = iter(order)
    while len(probe_rows) < size:
        window = []
        for i in order:
            if keys[i] not in probe_keys:
                window.append(i)
                if len(window) == size - len(probe_rows):
                    break
        if not window:
            break
        reasons = fit_reasons(window) if fit_reasons is not None else [None] * len(window)
        for i, reason in zip(window, reasons):
            if keys[i] in probe_keys:       # an earlier row of this window took the prompt
                continue
            if reason is not None:
                skipped[reason] += 1
                continue
            probe_rows.append(i)
            probe_keys.add(keys[i])
            if len(probe_rows) == size:
                break
    return probe_rows, skipped


def _cached(fit_reasons):
    """fit_reasons remembering each row's answer: the dev walk repeats the probe's (module doc), tokenizing nothing
    twice."""
    if fit_reasons is None:
        return None
    known: dict[int, str | None] = {}

    def reasons(rows: list[int]) -> list[str | None]:
        new = [i for i in rows if i not in known]
        if new:
            known.update(zip(new, fit_reasons(new)))
        return [known[i] for i in rows]
    return reasons


def check_dev_prompts(n_prompts: int, size: int, dev_size: int, n_pairs: int, where: str) -> None:
    if dev_size and n_prompts - size < dev_size:
        raise ProbeError(f"{where}: probe.dev_size is {dev_size} but only {n_prompts - size} distinct prompts remain "
                         f"after the probe's {size} ({n_prompts} distinct prompts, {n_pairs} pairs); the dev split "
                         f"takes at most one pair per prompt and no probe prompt (lower probe.dev_size or probe.size, "
                         f"or add data)")


def select_dev(order: Sequence[int], keys: Sequence, size: int, dev_size: int, fit_reasons, probe_rows: list[int],
               skipped: Counter, n_prompts: int, fit: "ProbeFit | None", where: str) -> tuple[list[int], Counter]:
    """The dev split: the walk of select_probe continued past the probe (the same walk for size + dev_size rows, whose
    first `size` are the probe), so the probe is the same pairs with or without a dev split and no dev prompt is a
    probe prompt. Returns (dev rows in walk order, the reasons of the rows passed over after the probe's)."""
    rows, all_skipped = select_probe(order, keys, size + dev_size, fit_reasons)
    assert rows[:size] == probe_rows, "the dev walk must continue the probe's"
    dev_rows, dev_skipped = rows[size:], all_skipped - skipped
    if len(dev_rows) < dev_size:
        limits = fit.limits.as_dict() if fit is not None else {}
        raise ProbeError(f"{where}: only {len(dev_rows)} of the {n_prompts - size} distinct prompts left after the "
                         f"probe have a pair that fits the tokenize limits "
                         f"({', '.join(f'{k} {v}' for k, v in limits.items())}) but probe.dev_size is {dev_size}: "
                         f"lower probe.dev_size or raise the tokenize limits")
    return dev_rows, dev_skipped


def _check_filled(probe_rows: list[int], skipped: Counter, n_prompts: int, size: int, fit: ProbeFit | None,
                  where: str) -> None:
    if len(probe_rows) < size:
        limits = fit.limits.as_dict() if fit is not None else {}
        raise ProbeError(f"{where}: only {len(probe_rows)} of the {n_prompts} distinct prompts have a pair that fits "
                         f"the tokenize limits ({', '.join(f'{k} {v}' for k, v in limits.items())}) but probe.size is "
                         f"{size}; {sum(skipped.values())} pairs do not fit ({', '.join(f'{r} {n}' for r, n in sorted(skipped.items()))}): "
                         f"raise tokenize.max_length / max_prompt_length, let tokenize cut them "
                         f"(tokenize.truncation: keep_end_then_completion) or lower probe.size")


def freeze_probe(pairs: pa.Table, size: int, seed: int, where: str = "pairs", fit: ProbeFit | None = None,
                 dev_size: int = 0) -> ProbeSplit:
    """Split `pairs` (normalize's schema) into train and a `size`-pair probe; see the module doc. `fit`: the
    probe takes only pairs tokenize keeps (None: every pair counts as fitting). dev_size > 0: a dev split of that
    many pairs beside it (select_dev), its prompts out of train too."""
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
    check_dev_prompts(n_prompts, size, dev_size, len(pair_ids), where)

    order = sorted(range(len(pair_ids)), key=lambda i: (selection_rank(seed, pair_ids[i]), pair_ids[i]))
    fit_reasons = _cached(None if fit is None else (lambda rows: fit.reasons(pairs.take(pa.array(rows, pa.int64())).select(
        ["pair_id", "prompt", "chosen", "rejected"]).to_pylist())))
    probe_rows, skipped = select_probe(order, keys, size, fit_reasons)
    _check_filled(probe_rows, skipped, n_prompts, size, fit, where)
    dev_rows, dev_skipped = (select_dev(order, keys, size, dev_size, fit_reasons, probe_rows, skipped, n_prompts, fit,
                                        where) if dev_size else ([], Counter()))
    probe_keys = {keys[i] for i in probe_rows}
    dev_keys = {keys[i] for i in dev_rows}
    probe_set, dev_set = set(probe_rows), set(dev_rows)
    excluded_rows = sorted((i for i in range(len(pair_ids)) if i not in probe_set and keys[i] in probe_keys),
                           key=lambda i: pair_ids[i])
    dev_excluded = sorted((i for i in range(len(pair_ids)) if i not in dev_set and keys[i] in dev_keys),
                          key=lambda i: pair_ids[i])
    train_rows = sorted((i for i in range(len(pair_ids)) if keys[i] not in probe_keys and keys[i] not in dev_keys),
                        key=lambda i: pair_ids[i])
    assert (len(train_rows) + len(probe_rows) + len(excluded_rows) + len(dev_rows) + len(dev_excluded)
            == len(pair_ids))

    probe = pairs.take(pa.array(probe_rows, pa.int64()))
    train = pairs.take(pa.array(train_rows, pa.int64()))
    manifest = probe_manifest(size, seed, pair_ids, hashes, probe_rows, excluded_rows, len(train_rows),
                              None if fit is None else fit.record(skipped))
    if dev_size:
        manifest["dev"] = dev_manifest(dev_size, pair_ids, hashes, dev_rows, dev_excluded, dev_skipped, fit)
    return ProbeSplit(train=train, probe=probe, manifest=manifest,
                      dev=pairs.take(pa.array(dev_rows, pa.int64())) if dev_size else None)


DEV_SELECTION = ("the pairs the probe's walk takes next, after the probe's size: one per normalized prompt, no probe "
                 "prompt")
DEV_LEAK = "dev_prompt_leak"


def dev_manifest(dev_size: int, pair_ids, hashes, dev_rows, excluded_rows, skipped: Counter,
                 fit: "ProbeFit | None") -> dict:
    """probe_manifest.json's `dev` (probe.dev_size > 0 only, so a manifest without a dev split is as it was)."""
    ids = [pair_ids[i] for i in dev_rows]
    content = [hashes[i] for i in dev_rows]
    return {"size": dev_size, "selection": DEV_SELECTION + (FIT_SELECTION if fit is not None else ""),
            "pair_ids": ids, "content_hashes": content, "dev_digest": probe_digest(ids, content),
            **({"fit_skipped": sum(skipped.values()), "fit_skipped_by_reason": dict(sorted(skipped.items()))}
               if fit is not None else {}),
            "excluded_from_train": [{"pair_id": pair_ids[i], "reason": DEV_LEAK} for i in excluded_rows]}


def probe_manifest(size: int, seed: int, pair_ids, hashes, probe_rows, excluded_rows, train_pairs: int,
                   fit_record: dict | None = None) -> dict:
    """probe_manifest.json (docs/ARTIFACTS.md) from row indices into the pairs' IDs and content hashes; the one
    builder of both paths (in memory, streaming), so their manifests cannot drift apart."""
    probe_ids = [pair_ids[i] for i in probe_rows]
    probe_hashes = [hashes[i] for i in probe_rows]
    return {
        "format": record_formats.PROBE_MANIFEST,
        "fit": fit_record,
        "size": size,
        "seed": seed,
        "selection": SELECTION + (FIT_SELECTION if fit_record is not None else ""),
        "pair_ids": probe_ids,
        "content_hashes": probe_hashes,
        "probe_digest": probe_digest(probe_ids, probe_hashes),
        "train_pairs": train_pairs,
        "excluded_from_train": [{"pair_id": pair_ids[i], "reason": LEAK} for i in excluded_rows],
        "dev": None,                  # the dev split's record (probe.dev_size > 0): dev_manifest
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


def _rows_at(pairs_path: str, pf, rows: list[int], chunk_rows: int) -> list[dict]:
    """The pairs at `rows` (file row numbers), in that order: one pass over the file, keeping only those."""
    wanted = set(rows)
    found: dict[int, dict] = {}
    start = 0
    for batch in iter_parquet_batches(pairs_path, chunk_rows, ["pair_id", "prompt", "chosen", "rejected"],
                                      parquet_file=pf):
        local = [r - start for r in range(start, start + batch.num_rows) if r in wanted]
        if local:
            found.update(zip((start + r for r in local), batch.take(pa.array(local, pa.int64())).to_pylist()))
        start += batch.num_rows
    return [found[r] for r in rows]


def freeze_probe_file(pairs_path: str, size: int, seed: int, *, train_path: str, probe_path: str,
                      chunk_rows: int = DEFAULT_CHUNK_ROWS, fit: ProbeFit | None = None, dev_size: int = 0,
                      dev_path: str | None = None) -> dict:
    """freeze_probe() on the parquet at `pairs_path`, written to train_path / probe_path as it goes;
    returns the manifest. Two passes over the file (and one more per window of candidates `fit` is asked
    about: one when most fit); between them only per-row pair IDs, 16-byte prompt key digests and selection
    ranks are held. The same bytes as write_parquet(freeze_probe(...)): normalize writes pairs sorted by
    pair_id, so train is the input filtered in place (an input in another order is split through
    freeze_probe() in memory)."""
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
        split = freeze_probe(read_parquet(pairs_path), size=size, seed=seed, where=where, fit=fit, dev_size=dev_size)
        write_parquet(train_path, split.train)
        write_parquet(probe_path, split.probe)
        if dev_size:
            write_parquet(dev_path, split.dev)
        return split.manifest

    key_array = np.array(keys, dtype="S16")
    del keys
    n_prompts = int(np.unique(key_array).size)
    if n_prompts < size:
        raise ProbeError(f"{where}: {n_prompts} distinct prompts ({len(pair_ids)} pairs) but probe.size "
                         f"is {size}; the probe takes at most one pair per prompt, so it needs at least "
                         f"{size} distinct prompts (lower probe.size or add data)")
    check_dev_prompts(n_prompts, size, dev_size, len(pair_ids), where)
    # Ranks are sha256 hex digests: their bytes sort as the hex strings do; pair IDs are unique here.
    ranks = np.array([hashlib.sha256(f"{seed}:{pid}".encode()).digest() for pid in pair_ids], dtype="S32")
    fit_reasons = _cached(None if fit is None else (lambda rows: fit.reasons(_rows_at(pairs_path, pf, rows, chunk_rows))))
    order = [int(i) for i in np.argsort(ranks, kind="stable")]
    probe_rows, skipped = select_probe(order, key_array, size, fit_reasons)
    _check_filled(probe_rows, skipped, n_prompts, size, fit, where)
    dev_rows, dev_skipped = (select_dev(order, key_array, size, dev_size, fit_reasons, probe_rows, skipped, n_prompts,
                                        fit, where) if dev_size else ([], Counter()))
    probe_keys = {key_array[i] for i in probe_rows}
    dev_keys = {key_array[i] for i in dev_rows}
    del ranks, order
    probe_pos = {row: k for k, row in enumerate(probe_rows)}
    dev_pos = {row: k for k, row in enumerate(dev_rows)}
    in_probe = np.isin(key_array, np.array(sorted(probe_keys), dtype="S16"))
    in_dev = np.isin(key_array, np.array(sorted(dev_keys), dtype="S16"))
    train_mask = ~(in_probe | in_dev)
    excluded_rows = [int(i) for i in np.flatnonzero(in_probe) if int(i) not in probe_pos]
    dev_excluded = [int(i) for i in np.flatnonzero(in_dev) if int(i) not in dev_pos]
    assert (int(train_mask.sum()) + len(probe_rows) + len(excluded_rows) + len(dev_rows) + len(dev_excluded)
            == len(pair_ids))

    parts: dict[str, list[tuple[list[int], pa.Table]]] = {"probe": [], "dev": []}  # (positions, their rows) per batch
    start = 0
    with ParquetStreamWriter(train_path, pf.schema_arrow) as train_out:
        for batch in iter_parquet_batches(pairs_path, chunk_rows, parquet_file=pf):
            n = batch.num_rows
            train_out.write(batch.filter(pa.array(train_mask[start:start + n])))
            for split, pos in (("probe", probe_pos), ("dev", dev_pos)):
                local = [r - start for r in range(start, start + n) if r in pos]
                if local:
                    parts[split].append(([pos[start + r] for r in local],
                                         pa.Table.from_batches([batch.take(pa.array(local, pa.int64()))])))
            start += n
    for split, path in (("probe", probe_path), ("dev", dev_path if dev_size else None)):
        if path is None:
            continue
        positions = [p for ps, _ in parts[split] for p in ps]
        table = pa.concat_tables([t for _, t in parts[split]]) if parts[split] else pf.schema_arrow.empty_table()
        order = sorted(range(len(positions)), key=positions.__getitem__)
        write_parquet(path, table.take(pa.array(order, pa.int64())).combine_chunks())

    manifest = probe_manifest(size, seed, pair_ids, hashes, probe_rows, excluded_rows, int(train_mask.sum()),
                              None if fit is None else fit.record(skipped))
    if dev_size:
        manifest["dev"] = dev_manifest(dev_size, pair_ids, hashes, dev_rows, dev_excluded, dev_skipped, fit)
    return manifest


# ==================================================================================================
# CLI
# ==================================================================================================


def load_fit(identity_path: str, tok_params: dict) -> ProbeFit:
    """The fit of tokenize's own settings: the verified reference's tokenizer, params.yaml's `tokenize` limits
    (checked against the reference's positions)."""
    ref_dir = load_verified_dir(identity_path)
    return ProbeFit(ref_dir, load_limits(tok_params, ref_dir), tokenizer_identity(ref_dir), tok_params)


def _arguments(ap) -> None:
    ap.add_argument("--pairs", required=True, help="normalize's pairs.parquet")
    ap.add_argument("--identity", required=True,
                    help="results/ref/ref_identity.json from verify_ref: the tokenizer the probe must fit under")
    ap.add_argument("--train", required=True, help="train.parquet to write")
    ap.add_argument("--probe", required=True, help="probe.parquet to write")
    ap.add_argument("--manifest", required=True, help="probe_manifest.json to write")
    ap.add_argument("--dev", help="dev.parquet to write (required when probe.dev_size > 0, refused otherwise)")


def _run(args) -> int:
    log = logging.getLogger("freeze_probe")
    params = load_stage_params(args.params, "freeze_probe")
    cfg = params["probe"]
    dev_size = cfg.get("dev_size", 0)
    if bool(dev_size) != bool(args.dev):
        raise ProbeError(f"probe.dev_size is {dev_size}: " + ("--dev (the dev split's parquet) is required" if dev_size
                                                                else "--dev is given but there is no dev split"))
    fit = load_fit(args.identity, params["tokenize"])
    m = freeze_probe_file(args.pairs, size=cfg["size"], seed=cfg["seed"], train_path=args.train,
                          probe_path=args.probe, fit=fit, dev_size=dev_size, dev_path=args.dev)
    write_json(args.manifest, m)  # last: its presence means the split is complete
    if m["fit"]["skipped"]:
        log.info("probe: %d pairs reached in rank order do not fit the tokenize limits %s and stay in train: %s",
                 m["fit"]["skipped"], canonical_json(m["fit"]["limits"]), canonical_json(m["fit"]["skipped_by_reason"]))
    n = m["train_pairs"] + len(m["pair_ids"]) + len(m["excluded_from_train"])
    if dev_size:
        n += len(m["dev"]["pair_ids"]) + len(m["dev"]["excluded_from_train"])
    log.info("%d pairs in: probe %d (seed %d, digest %s), train %d, excluded from train %d (%s)",
             n, len(m["pair_ids"]), m["seed"], m["probe_digest"], m["train_pairs"],
             len(m["excluded_from_train"]), LEAK)
    if dev_size:
        d = m["dev"]
        log.info("dev split %d pairs (digest %s), excluded from train %d (%s)", len(d["pair_ids"]), d["dev_digest"],
                 len(d["excluded_from_train"]), DEV_LEAK)
    return 0


def main(argv: list[str] | None = None) -> int:
    return stage_main(argv, "freeze_probe", __doc__.split("\n")[0], add_arguments=_arguments, run=_run,
                      input_errors=(ProbeError, ParamsError, TokenizeError, RefIdentityError))


if __name__ == "__main__":
    tokenizers_only_process()   # the stage loads a tokenizer, never a model
    sys.exit(main())
