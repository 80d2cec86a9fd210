"""The data contracts between stages, each defined once (docs/ARTIFACTS.md describes the artifacts).

A stage that writes an artifact and a stage that checks it import the same definition from here:

* pairs (normalize -> freeze_probe -> tokenize): PAIRS_SCHEMA / PAIR_COLUMNS, `content_hash`, `pair_id_of`,
  and `pair_problems` (the integrity check: pair_id = first 24 hex of content_hash, which is the
  sha256 of the row's canonical prompt/chosen/rejected; pair IDs unique);
* the probe (freeze_probe -> tokenize, evaluate): `probe_digest`, PROBE_MANIFEST_SCHEMA;
* tokens (tokenize -> ref_logps, training, evaluate): TOKENS_SCHEMA, `token_hash`, `token_digest`,
  PROBE_TOKEN_MANIFEST_SCHEMA, and TOKENIZER_FILES (the files that make a tokenizer: its identity);
* probe rows (training -> evaluate): `correct_label`.

Manifest shapes are JSON Schemas checked with jsonschema where a stage reads the file
(`check_shape`); the semantic checks (digests, order, counts) stay with the stage that owns them.
"""
from __future__ import annotations

from typing import Any

import pyarrow as pa

from stages.lib.io import sha256_json

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

def probe_digest(pair_ids: list[str], content_hashes: list[str]) -> str:
    """The frozen probe's identity: sha256 of [[pair_id, content_hash], ...] in probe order."""
    return sha256_json([[p, c] for p, c in zip(pair_ids, content_hashes, strict=True)])


_HEX_LIST = {"type": "array", "items": {"type": "string"}}

PROBE_MANIFEST_SCHEMA = {
    "type": "object",
    "required": ["size", "seed", "pair_ids", "content_hashes", "probe_digest"],
    "properties": {
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
        "limits": {"type": "object"},
        # Per entry (index, pair_id, reason, token_hash) evaluate.check_truncation_record says what is wrong.
        "truncated": {"type": "array"},
    },
}


# ==================================================================================== probe rows

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
