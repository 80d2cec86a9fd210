"""The data contracts between stages, each defined once (docs/ARTIFACTS.md describes the artifacts).

A stage that writes an artifact and a stage that checks it import the same definition from here:

* pairs (normalize -> freeze_probe -> tokenize): PAIRS_SCHEMA / PAIR_COLUMNS, `content_hash`, `pair_id_of`,
  and `pair_problems` (the integrity check: pair_id = first 24 hex of content_hash, which is the
  sha256 of the row's canonical prompt/chosen/rejected; pair IDs unique);
* the probe (freeze_probe -> tokenize, evaluate): `probe_digest`, PROBE_MANIFEST_SCHEMA;
* tokens (tokenize -> ref_logps, training, evaluate): TOKENS_SCHEMA, `token_hash`, `token_digest`,
  PROBE_TOKEN_MANIFEST_SCHEMA, and TOKENIZER_FILES (the files that make a tokenizer: its identity);
* probe rows (training -> evaluate): `correct_label`;
* generations (generate -> judge): GENERATIONS_SCHEMA, GENERATION_SIDES and `generation_rows` (the check).

Manifest shapes are JSON Schemas checked with jsonschema where a stage reads the file
(`check_shape`); the semantic checks (digests, order, counts) stay with the stage that owns them.
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stages.lib import record_formats
from stages.lib.io import canonical_json, sha256_json

# ==================================================================================== pairs

MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
PAIRS_SCHEMA = pa.schema([
    ("pair_id", pa.string()), ("content_hash", pa.string()), ("source", pa.string()),
    ("prompt", MESSAGES), ("chosen", MESSAGES), ("rejected", MESSAGES), ("margin", pa.float64()),
    ("src_file", pa.string()), ("src_row", pa.int64()),
])
PAIR_COLUMNS = PAIRS_SCHEMA.names
PAIR_ID_HEX = 24  # a pair_id is the first 24 hex of its content_hash


def content_hash(prompt: list[dict], chosen: list[dict], rejected: list[dict]) -> str:
    """sha256 of the pair's canonical JSON {prompt, chosen, rejected}, messages as {role, content}."""
    return sha256_json({"prompt": prompt, "chosen": chosen, "rejected": rejected})


def row_content_hash(pair: dict) -> str:
    """content_hash of a pairs-parquet row, over role/content only (a row's messages carry nothing else)."""
    def msgs(messages):
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    return content_hash(msgs(pair["prompt"]), msgs(pair["chosen"]), msgs(pair["rejected"]))


def pair_id_of(content_hash_hex: str) -> str:
    return content_hash_hex[:PAIR_ID_HEX]


def missing_pair_columns(column_names: list[str]) -> list[str]:
    return [c for c in PAIR_COLUMNS if c not in column_names]


def pair_problems(pairs: list[dict]) -> list[str]:
    """Integrity of pairs rows (normalize's schema), one line per problem naming the row, in row order:
    a pair_id that is not the first 24 hex of its content_hash, a duplicate pair_id, and a content_hash
    that the row's prompt/chosen/rejected no longer hash to (the content was edited after normalize)."""
    problems: list[str] = []
    seen: dict[str, int] = {}
    for row, pair in enumerate(pairs):
        pid, ch = pair.get("pair_id"), pair.get("content_hash")
        problem = pair_id_problem(row, pid, ch, seen)
        if problem is not None:
            problems.append(problem)
            continue
        actual = row_content_hash(pair)
        if actual != ch:
            problems.append(content_hash_problem(row, pid, ch, actual))
    return problems


def pair_id_problem(row: int, pid: Any, ch: Any, seen: dict[str, int]) -> str | None:
    """pair_problems' cheap per-row check (pair_id form and uniqueness; `seen` is updated), for a
    reader that streams the rows in chunks and recomputes the content hashes elsewhere
    (content_hash_problem), merging the two per row as pair_problems does."""
    if not isinstance(pid, str) or not isinstance(ch, str) or len(pid) != PAIR_ID_HEX or pid != pair_id_of(ch):
        return f"row {row}: pair_id {pid!r} is not the first {PAIR_ID_HEX} hex of content_hash {ch!r}"
    if pid in seen:
        return f"rows {seen[pid]} and {row}: duplicate pair_id {pid}"
    seen[pid] = row
    return None


def content_hash_problem(row: int, pid: str, ch: str, actual: str) -> str:
    return (f"row {row} (pair {pid}): content_hash {ch} does not match the row's "
            f"prompt/chosen/rejected (sha256 of their canonical JSON is {actual})")


# ==================================================================================== probe

def prompt_key(prompt: list[dict]) -> str:
    """The prompt as leakage is judged (freeze_probe's split; the sft stage's exclusion of probe prompts): same roles,
    same words in the same order."""
    return canonical_json([{"role": m["role"], "content": " ".join(m["content"].split())} for m in prompt])


def probe_digest(pair_ids: list[str], content_hashes: list[str]) -> str:
    """The frozen probe's identity: sha256 of [[pair_id, content_hash], ...] in probe order."""
    return sha256_json([[p, c] for p, c in zip(pair_ids, content_hashes, strict=True)])


_HEX_LIST = {"type": "array", "items": {"type": "string"}}

PROBE_MANIFEST_SCHEMA = {
    "type": "object",
    "required": ["size", "seed", "pair_ids", "content_hashes", "probe_digest"],
    "properties": {
        "format": {"const": record_formats.PROBE_MANIFEST},
        "size": {"type": "integer", "minimum": 0},
        "seed": {"type": "integer"},
        "selection": {"type": "string"},
        "pair_ids": _HEX_LIST,
        "content_hashes": _HEX_LIST,
        "probe_digest": {"type": "string"},
        "train_pairs": {"type": "integer", "minimum": 0},
        "excluded_from_train": {"type": "array", "items": {
            "type": "object", "required": ["pair_id", "reason"],
            "properties": {"pair_id": {"type": "string"}, "reason": {"type": "string"}}}},
        # The tokenizer and limits the probe was drawn to fit (tokenize holds its own to them), and the pairs the
        # walk passed over for not fitting.
        "fit": {"type": ["object", "null"], "required": ["tokenizer_identity", "limits", "skipped", "skipped_by_reason"],
                "properties": {"tokenizer_identity": {"type": "string"}, "limits": {"type": "object"},
                               "skipped": {"type": "integer", "minimum": 0},
                               "skipped_by_reason": {"type": "object"}}},
    },
}


# ==================================================================================== tokens

TOKENS_SCHEMA = pa.schema([
    ("pair_id", pa.string()),
    ("chosen_ids", pa.list_(pa.int32())),
    ("chosen_prompt_len", pa.int32()),
    ("rejected_ids", pa.list_(pa.int32())),
    ("rejected_prompt_len", pa.int32()),
    ("margin", pa.float64()),
    ("token_hash", pa.string()),
])
TOKEN_COLUMNS = TOKENS_SCHEMA.names


def token_hash(chosen_ids: list[int], chosen_prompt_len: int, rejected_ids: list[int],
               rejected_prompt_len: int) -> str:
    """What a pair is scored on: sha256 of [chosen_ids, chosen_prompt_len, rejected_ids, rejected_prompt_len]."""
    return sha256_json([chosen_ids, chosen_prompt_len, rejected_ids, rejected_prompt_len])


# Rows per piece of token_hashes_of: bounds the memory of the decimal texts (a few MB a piece) and gives the
# threads their work units.
TOKEN_HASH_PIECE_ROWS = 2048


def token_hashes_of(table: pa.Table, threads: int | None = None) -> list[str | None]:
    """token_hash of every row of a token table (TOKENS_SCHEMA's four id columns), recomputed from its ids: the
    same sha256 of the same canonical JSON text as token_hash, built by Arrow's kernels instead of json.dumps.
    canonical_json writes a list of ints as `[` + the decimal ints joined by `,` + `]` (no spaces), which is what
    the cast to strings and the joins below write, so the text is byte for byte the one token_hash hashes
    (tests/lib/test_content_checks.py checks them against each other, edge cases included). About 4x faster than
    token_hash row by row on one core (bench/token_hash_bench.py: 9.6 s for 1M pairs of 340 tokens, against 38 s),
    and the pieces run in `threads` threads (Arrow's kernels and hashlib's sha256 release the GIL). None for a row
    with a null value (it has no canonical JSON)."""
    def decimal_lists(ids: pa.Array) -> pa.Array:
        """`1,2,3` per row. Only the slice's own values are cast: casting the sliced list array itself converts the
        whole child array beneath the slice, every piece again."""
        offsets = ids.offsets.to_numpy()
        values = ids.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        return pc.binary_join(pa.ListArray.from_arrays(pa.array(offsets - offsets[0], pa.int32()),
                                                       pc.cast(values, pa.string()), mask=ids.is_null()), ",")

    def piece(start: int) -> list[str | None]:
        t = table.slice(start, TOKEN_HASH_PIECE_ROWS).combine_chunks()
        joined = [decimal_lists(t.column(c).chunk(0)) for c in ("chosen_ids", "rejected_ids")]
        lens = [pc.cast(t.column(c).chunk(0), pa.string()) for c in ("chosen_prompt_len", "rejected_prompt_len")]
        text = pc.binary_join_element_wise("[[", joined[0], "],", lens[0], ",[", joined[1], "],", lens[1], "]", "")
        valid = text.is_valid().to_numpy(zero_copy_only=False)
        offsets = np.frombuffer(text.buffers()[1], dtype=np.int32)[text.offset: text.offset + len(text) + 1]
        data = memoryview(text.buffers()[2] or b"")
        return [hashlib.sha256(data[offsets[i]: offsets[i + 1]]).hexdigest() if valid[i] else None
                for i in range(len(text))]

    starts = range(0, table.num_rows, TOKEN_HASH_PIECE_ROWS)
    if threads is None:
        threads = default_hash_threads()
    if threads <= 1 or len(starts) <= 1:
        return [h for start in starts for h in piece(start)]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return [h for hashes in pool.map(piece, starts) for h in hashes]


def default_hash_threads() -> int:
    """The cores this process may use, shared among the processes torchrun started on this node (each rank
    checks the table it reads)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))


def token_hash_problem(table: pa.Table, source: str, threads: int | None = None) -> str | None:
    """None when every row's token_hash is the hash of its ids (token_hashes_of); else one line naming the file,
    the first row that differs and its pair_id: the ids were changed (or damaged) after tokenize wrote them."""
    recorded = table.column("token_hash").to_pylist()
    actual = token_hashes_of(table, threads)
    if recorded == actual and None not in actual:
        return None
    row = next(i for i, (r, a) in enumerate(zip(recorded, actual)) if a is None or r != a)
    pid = table.column("pair_id")[row].as_py()
    bad = sum(a is None or r != a for r, a in zip(recorded, actual))
    if actual[row] is None:
        return f"{source}: row {row} (pair {pid}): null token ids or prompt length, so no token_hash can be computed"
    return (f"{source}: row {row} (pair {pid}): token_hash {recorded[row]} is not the hash of the row's ids "
            f"({actual[row]}); {bad} row(s) differ: the token ids were changed or damaged after tokenize wrote them; "
            "rerun tokenize")


def token_digest(pair_ids: list[str], token_hashes: list[str]) -> str:
    """The tokenized probe's identity: sha256 of [[pair_id, token_hash], ...] in probe order."""
    return sha256_json([[p, h] for p, h in zip(pair_ids, token_hashes, strict=True)])


# Files that decide how text becomes token ids (or how it is rendered): the tokenizer identity hashes
# those present, and an exported model carries them. The union of every vocabulary format transformers
# reads (BPE vocab.json + merges.txt, WordPiece vocab.txt, SentencePiece *.model) and the config, special
# and added tokens and chat template files. generation_config.json is not here: it changes no token id
# (verify_ref covers it as a file transformers loads; export copies it beside these).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model",
                   "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja",
                   "chat_template.json")
# One of these must be present for there to be a tokenizer at all (the vocabulary).
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt",
                         "sentencepiece.bpe.model")

PROBE_TOKEN_MANIFEST_SCHEMA = {
    "type": "object",
    "required": ["pair_ids", "token_hashes", "token_digest", "probe_digest", "tokenizer_identity"],
    "properties": {
        "pair_ids": _HEX_LIST,
        "token_hashes": _HEX_LIST,
        "token_digest": {"type": "string"},
        "probe_digest": {"type": "string"},
        "format": {"const": record_formats.PROBE_TOKEN_MANIFEST},
        "limits": {"type": ["object", "null"]},
        # Per entry (index, pair_id, reason, token_hash) evaluate.check_truncation_record says what is wrong.
        "truncated": {"type": "array"},
    },
}


# ==================================================================================== probe rows

# ==================================================================================== generations

GENERATION_SIDES = ("policy", "reference")
GENERATIONS_SCHEMA = pa.schema([
    ("pair_id", pa.string()), ("index", pa.int32()), ("sample", pa.int32()), ("side", pa.string()),
    ("prompt", pa.string()),                       # the probe pair's prompt messages, canonical JSON (for display)
    ("prompt_ids", pa.list_(pa.int32())), ("tokens", pa.list_(pa.int32())),
    ("n_tokens", pa.int32()), ("stop_reason", pa.string()), ("text", pa.string()),
    ("policy_logp", pa.float64()), ("reference_logp", pa.float64()),
])
STOP_REASONS = ("eos", "end_of_turn", "max_new_tokens")


def generation_rows(table: pa.Table, path: str) -> list[dict]:
    """generations.parquet's rows, checked whole: its schema; for every (index, sample) in order a policy row
    then a reference row on the same pair and prompt tokens; indexes 0 .. n-1 with the same samples each; a
    token count and stop reason that fit the tokens. Raises ContractError naming the file and row."""
    if table.schema.remove_metadata() != GENERATIONS_SCHEMA:
        raise ContractError(f"{path}: schema {table.schema.remove_metadata()} is not generate's {GENERATIONS_SCHEMA}")
    rows = table.to_pylist()
    if not rows or len(rows) % 2:
        raise ContractError(f"{path}: {len(rows)} rows; generate writes a policy and a reference row per item")
    samples = 1 + max(r["sample"] for r in rows)
    for k, r in enumerate(rows):
        item, side = divmod(k, 2)
        want = (item // samples, item % samples, GENERATION_SIDES[side])
        if (r["index"], r["sample"], r["side"]) != want:
            raise ContractError(f"{path} row {k}: (index, sample, side) {(r['index'], r['sample'], r['side'])}, "
                                f"expected {want}: rows must be every probe position and sample, policy then "
                                "reference")
        if side and (r["pair_id"], r["prompt_ids"]) != (rows[k - 1]["pair_id"], rows[k - 1]["prompt_ids"]):
            raise ContractError(f"{path} row {k}: the reference's prompt is not the policy's (row {k - 1})")
        if r["stop_reason"] not in STOP_REASONS or r["n_tokens"] != len(r["tokens"]) or not r["tokens"]:
            raise ContractError(f"{path} row {k}: stop_reason {r['stop_reason']!r} / n_tokens {r['n_tokens']} do "
                                f"not fit its {len(r['tokens'])} tokens")
    return rows


def correct_label(chosen: float, rejected: float) -> float:
    """A probe row's `correct`: 1 when chosen scores higher, 0 when lower, 0.5 on an exact tie."""
    return 1.0 if chosen > rejected else 0.0 if chosen < rejected else 0.5


# ==================================================================================== shapes

def shape_problem(obj: Any, schema: dict) -> str | None:
    """None when `obj` has the JSON Schema's shape; else one line saying where and what is wrong."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import best_match

    error = best_match(Draft202012Validator(schema).iter_errors(obj))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{where or 'top level'}: {error.message}"


class ContractError(ValueError):
    """A file does not have its contract's shape; the message names the file."""


def check_shape(obj: Any, schema: dict, what: str, path: str | Any) -> Any:
    """Return `obj` if it has `schema`'s shape, else raise ContractError naming `path` and the problem."""
    problem = shape_problem(obj, schema)
    if problem is not None:
        raise ContractError(f"{path}: not a valid {what} ({problem})")
    return obj
