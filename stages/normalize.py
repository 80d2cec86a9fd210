"""normalize: raw preference files -> one canonical pairs table, every bad row kept with a reason.

    python -m stages.normalize --params params.yaml \
        --pairs results/normalize/pairs.parquet \
        --rejections results/normalize/rejections.parquet \
        --stats results/normalize/normalize_stats.json --log logs/normalize.log

Reads every source under `data.sources` in params.yaml (`{name?, path, format, columns?}`; paths
relative to the working directory) and writes the artifacts described in docs/ARTIFACTS.md.

A source's `path` is a file, a glob (`*`, `?`, `[...]`; `**` spans directories) or a directory (every
file under it with a suffix below, recursively, skipping hidden entries such as `hf download`'s
`.cache/`), so shards as `hf download --repo-type dataset` leaves them (`data/train-*.parquet`,
`*.jsonl.gz`) are one source. Its files are read in sorted path order (`source_paths`, which the
Snakemake rule and so dvc.yaml use for the dependencies too). A source must name data: a path that is
no file, a glob or directory that names no such file (`resolve_source_files`: also checked by the
Snakefile at DAG build, so dvc.yaml never loses the stage), or a source that yields no pair at all (every
row rejected, or no row: `check_source_yield`, before anything is written) fails the stage naming the
source. Each pair's provenance is the file it came from (`src_file`)
and its row in that file (`src_row`). `name` defaults to the file name without its data suffix (for a
glob or directory: the last path component without wildcards), numbered `_2`, `_3`, ... where that
name is already taken; names given explicitly must be unique.

File types (by suffix): `.jsonl` / `.jsonl.gz` (one JSON object per line; src_row = 0-based line,
blank lines skipped and counted), `.json` / `.json.gz` (one JSON list of objects; src_row = element
index), `.parquet` (src_row = table row). A file that cannot be read at all (missing, unknown
suffix, corrupt) fails the stage naming the file; a bad *row* never does.

Formats (the `format` of a source):
- `hh`: `{"chosen": transcript, "rejected": transcript}` with "\\n\\nHuman: ..\\n\\nAssistant: .."
  turns. prompt = the shared prefix of the two transcripts up to and including the LAST
  "\\n\\nAssistant:" inside that shared prefix; completion = the rest. A turn's content is the
  text after its marker minus one leading space. A completion that itself holds a further turn
  marker is multi-turn and is rejected (`role`).
- `trl`: `chosen` / `rejected` (+ optional `prompt`) as strings (standard) or message lists
  (conversational). Without `prompt` the prompt is implicit: for message lists the common leading
  messages; for strings TRL's `extract_prompt` (longest common character prefix, backed off by one
  when the character before the split is a space, so the completions keep their leading space).
  Unlike TRL, when one string is a prefix of the other the split is at the end of the shorter one
  (whose completion is then empty -> `empty_completion`). A string prompt becomes one user message
  and a string completion one assistant message, content verbatim.
- `sharegpt`: `conversations` [{from, value}] (from: human/user, gpt/assistant, system) is the
  prompt; `chosen` / `rejected` are a {from, value} object, a list of them, or a string; an
  optional top-level `system` string becomes a leading system message.
- `openai`: `input.messages` (prompt), `preferred_output` / `non_preferred_output` (lists of
  assistant messages).
- `columns`: the source's `columns` mapping {prompt?, chosen, rejected, system?, margin?} names the
  row's column for each canonical field; values are strings or message lists as in `trl`
  (no prompt column -> implicit prompt); `system` (string, "" or null = none) is prepended;
  `margin` (finite number or null) is kept in the `margin` column.
- `auto`, decided per row from its keys, first match wins:
  `input` + `preferred_output` + `non_preferred_output` -> openai; `conversations` + `chosen` +
  `rejected` -> sharegpt; `chosen` + `rejected` without `prompt`, both strings containing
  "\\n\\nAssistant:" -> hh; `chosen` + `rejected` -> trl; anything else -> rejected (`schema`).
  Keys a format does not use are ignored.

Validation (every failure is a rejection with a stable reason code, set where it is raised):
a message is an object with string `role` in {system, user, assistant} and string `content`
(extra keys must be null); a system message only first; then user/assistant alternate starting
with user; the prompt ends with a user turn; each completion is exactly one assistant message;
prompt and completion contents are non-empty after strip; chosen and rejected differ after strip;
an exact duplicate (same content_hash) of an earlier pair, in (source order, row order), is
rejected. rows_in == pairs_out + rejected for every source (checked before anything is written).
"""
from __future__ import annotations

import glob
import gzip
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from stages.lib.cli import stage_main
from stages.lib.contracts import PAIRS_SCHEMA, content_hash, pair_id_of
from stages.lib.io import (ParquetStreamWriter, data_location, leaves_repository, workspace_root, write_json,
                          write_parquet)
from stages.lib.params import ParamsError, load_params

# ----------------------------------------------------------------------------------------------
# Reason codes and the row-level error

REASONS = (
    "json",              # the line is not valid JSON (or not UTF-8)
    "schema",            # not an object / null / missing or wrongly-typed field / format undetectable
    "role",              # bad, missing or misplaced role; no alternation; multi-turn completion
    "content_type",      # message content missing or not a string
    "empty_prompt",      # no prompt, or a prompt message empty after strip
    "empty_completion",  # a completion missing or empty after strip
    "identical_pair",    # chosen == rejected (after strip)
    "no_shared_prompt",  # implicit prompt: chosen and rejected share no prompt
    "contradicts",       # an earlier pair has the same prompt with chosen and rejected swapped
    "margin",            # margin present but not a finite number
    "duplicate",         # same content as an earlier pair
)
ROLES = ("system", "user", "assistant")
FORMATS = ("auto", "hh", "trl", "sharegpt", "openai", "columns")


class RowRejected(Exception):
    """One row cannot become a pair. `reason` is a stable code from REASONS; `detail` says why."""

    def __init__(self, reason: str, detail: str):
        if reason not in REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}")
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class SourceError(RuntimeError):
    """A source file or its params entry is unusable as a whole; the stage fails."""


Message = dict  # {"role": str, "content": str}


def _type(x: Any) -> str:
    return "null" if x is None else type(x).__name__


def _preview(s: str, n: int = 60) -> str:
    return repr(s if len(s) <= n else s[:n] + "...")


# ----------------------------------------------------------------------------------------------
# Messages and conversation validation

def _check_extra_keys(obj: dict, allowed: tuple[str, ...], where: str) -> None:
    # Null extras are tolerated: parquet structs unify keys across rows and fill absent ones with
    # null. A non-null extra (name, tool_calls, ...) would be silently dropped, so it is refused.
    extra = sorted(k for k, v in obj.items() if k not in allowed and v is not None)
    if extra:
        raise RowRejected("schema", f"{where} has unsupported keys {extra} (only {list(allowed)})")


def to_message(obj: Any, where: str) -> Message:
    """A {role, content} object -> canonical message, or RowRejected naming what is wrong."""
    if not isinstance(obj, dict):
        raise RowRejected("schema", f"{where} is {_type(obj)}, expected an object with role and content")
    if "role" not in obj or obj["role"] is None:
        raise RowRejected("role", f"{where} has no role")
    role = obj["role"]
    if not isinstance(role, str):
        raise RowRejected("role", f"{where} role is {_type(role)}, expected a string")
    if role not in ROLES:
        raise RowRejected("role", f"{where} has role {role!r}, expected one of {'/'.join(ROLES)}")
    if "content" not in obj or obj["content"] is None:
        raise RowRejected("content_type", f"{where} has no content")
    if not isinstance(obj["content"], str):
        raise RowRejected("content_type", f"{where} content is {_type(obj['content'])}, expected a string")
    _check_extra_keys(obj, ("role", "content"), where)
    return {"role": role, "content": obj["content"]}


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}


def sharegpt_message(obj: Any, where: str) -> Message:
    if not isinstance(obj, dict):
        raise RowRejected("schema", f"{where} is {_type(obj)}, expected an object with from and value")
    speaker = obj.get("from")
    if speaker is None:
        raise RowRejected("role", f"{where} has no 'from'")
    if not isinstance(speaker, str):
        raise RowRejected("role", f"{where} 'from' is {_type(speaker)}, expected a string")
    if speaker not in SHAREGPT_ROLES:
        raise RowRejected("role", f"{where} has 'from' {speaker!r}, expected one of {sorted(SHAREGPT_ROLES)}")
    value = obj.get("value")
    if value is None:
        raise RowRejected("content_type", f"{where} has no 'value'")
    if not isinstance(value, str):
        raise RowRejected("content_type", f"{where} 'value' is {_type(value)}, expected a string")
    _check_extra_keys(obj, ("from", "value"), where)
    return {"role": SHAREGPT_ROLES[speaker], "content": value}


def to_messages(value: Any, where: str, string_role: str) -> list[Message]:
    """A field that is a string (-> one `string_role` message) or a list of message objects."""
    if isinstance(value, str):
        return [{"role": string_role, "content": value}]
    if isinstance(value, list):
        return [to_message(m, f"{where} message {i}") for i, m in enumerate(value)]
    raise RowRejected("schema", f"{where} is {_type(value)}, expected a string or a list of messages")


def validate_pair(prompt: list[Message], chosen: list[Message], rejected: list[Message]) -> None:
    """Conversation rules on already well-typed messages; raises RowRejected."""
    for name, msgs in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        for i, m in enumerate(msgs):
            try:  # JSON "\ud800" escapes decode to lone surrogates, which no UTF-8 artifact can hold
                m["content"].encode("utf-8")
            except UnicodeEncodeError:
                raise RowRejected("content_type", f"{name} message {i} content holds an unpaired "
                                                  f"surrogate (not valid Unicode text)") from None
    if not prompt:
        raise RowRejected("empty_prompt", "the prompt has no messages")
    for i, m in enumerate(prompt):
        if m["role"] == "system" and i != 0:
            raise RowRejected("role", f"prompt message {i} is a system message; system is only allowed first")
    turns = prompt[1:] if prompt[0]["role"] == "system" else prompt
    if not turns:
        raise RowRejected("role", "the prompt has only a system message; it must end with a user turn")
    for i, m in enumerate(turns):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            k = i + (len(prompt) - len(turns))
            raise RowRejected("role", f"prompt message {k} has role {m['role']!r} where {expected!r} "
                                      f"was expected (user/assistant must alternate, starting with user)")
    if turns[-1]["role"] != "user":
        raise RowRejected("role", "the prompt ends with an assistant turn; it must end with a user turn")
    for name, completion in (("chosen", chosen), ("rejected", rejected)):
        if not completion:
            raise RowRejected("empty_completion", f"{name} has no messages")
        for i, m in enumerate(completion):
            if m["role"] != "assistant":
                raise RowRejected("role", f"{name} message {i} has role {m['role']!r}; a completion is assistant only")
        if len(completion) > 1:
            raise RowRejected("role", f"{name} has {len(completion)} assistant messages; a completion is "
                                      f"one assistant turn (consecutive assistant turns do not alternate)")
    for i, m in enumerate(prompt):
        if not m["content"].strip():
            raise RowRejected("empty_prompt", f"prompt message {i} ({m['role']}) is empty")
    for name, completion in (("chosen", chosen), ("rejected", rejected)):
        if not completion[0]["content"].strip():
            raise RowRejected("empty_completion", f"{name} is empty")
    if [m["content"].strip() for m in chosen] == [m["content"].strip() for m in rejected]:
        raise RowRejected("identical_pair", "chosen and rejected are identical"
                          + ("" if chosen == rejected else " up to surrounding whitespace"))


# ----------------------------------------------------------------------------------------------
# Implicit prompts (common prefix of chosen and rejected)

def _common_prefix_len(a, b) -> int:
    """Length of the common prefix of two strings or two lists."""
    if isinstance(a, str):
        # bisect on slice equality: C-speed compares instead of a Python loop per character
        lo, hi = 0, min(len(a), len(b))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if a[:mid] == b[:mid]:
                lo = mid
            else:
                hi = mid - 1
        return lo
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def split_implicit_strings(chosen: str, rejected: str) -> tuple[str, str, str]:
    """TRL extract_prompt on strings: (prompt, chosen_rest, rejected_rest)."""
    i = _common_prefix_len(chosen, rejected)
    if i < min(len(chosen), len(rejected)) and i > 0 and chosen[i - 1] == " ":
        i -= 1  # keep the space with the completions, as TRL does
    return chosen[:i], chosen[i:], rejected[i:]


def split_implicit(chosen: Any, rejected: Any, where: str) -> tuple[list[Message], list[Message], list[Message]]:
    if chosen == rejected:
        raise RowRejected("identical_pair", f"{where}: chosen and rejected are identical")
    if isinstance(chosen, str) and isinstance(rejected, str):
        prompt, c, r = split_implicit_strings(chosen, rejected)
        if not prompt:
            raise RowRejected("no_shared_prompt", f"{where}: chosen and rejected share no leading text "
                                                  f"(implicit prompt)")
        return ([{"role": "user", "content": prompt}], [{"role": "assistant", "content": c}],
                [{"role": "assistant", "content": r}])
    if isinstance(chosen, list) and isinstance(rejected, list):
        cm = to_messages(chosen, "chosen", "assistant")
        rm = to_messages(rejected, "rejected", "assistant")
        n = _common_prefix_len(cm, rm)
        if n == 0:
            raise RowRejected("no_shared_prompt", f"{where}: chosen and rejected share no leading message "
                                                  f"(implicit prompt)")
        return cm[:n], cm[n:], rm[n:]
    raise RowRejected("schema", f"{where}: without a prompt, chosen and rejected must both be strings or both "
                                f"message lists, got {_type(chosen)} and {_type(rejected)}")


# ----------------------------------------------------------------------------------------------
# Format adapters: row (dict) -> (prompt, chosen, rejected, margin)

def _require(row: dict, keys: tuple[str, ...], fmt: str) -> None:
    missing = [k for k in keys if k not in row]
    if missing:
        raise RowRejected("schema", f"{fmt} row lacks {missing} (has {sorted(row)})")


HH_MARKER = "\n\nAssistant:"
HH_TURN = re.compile(r"\n\n(Human|Assistant):")


def hh_turns(text: str, where: str) -> list[Message]:
    """'\\n\\nHuman: a\\n\\nAssistant: b' -> messages; one leading space of each turn dropped."""
    if text.startswith(("Human:", "Assistant:")):
        text = "\n\n" + text
    pieces = HH_TURN.split(text)
    if pieces[0].strip():
        raise RowRejected("role", f"{where} has text before its first Human:/Assistant: marker: "
                                  f"{_preview(pieces[0])}")
    out = []
    for speaker, body in zip(pieces[1::2], pieces[2::2]):
        out.append({"role": "user" if speaker == "Human" else "assistant",
                    "content": body[1:] if body.startswith(" ") else body})
    return out


def from_hh(row: dict) -> tuple[list[Message], list[Message], list[Message], None]:
    _require(row, ("chosen", "rejected"), "hh")
    chosen, rejected = row["chosen"], row["rejected"]
    for name, v in (("chosen", chosen), ("rejected", rejected)):
        if not isinstance(v, str):
            raise RowRejected("schema", f"hh {name} is {_type(v)}, expected a transcript string")
    shared = _common_prefix_len(chosen, rejected)
    cut = chosen.rfind(HH_MARKER, 0, shared)
    if cut < 0:
        raise RowRejected("no_shared_prompt", "chosen and rejected share no '\\n\\nAssistant:' turn "
                                              f"(shared prefix {_preview(chosen[:shared])})")
    prompt = hh_turns(chosen[:cut], "prompt")
    rest = cut + len(HH_MARKER)
    c = hh_turns(HH_MARKER + chosen[rest:], "chosen")
    r = hh_turns(HH_MARKER + rejected[rest:], "rejected")
    return prompt, c, r, None


def _trl_like(row: dict, prompt_key: str | None, chosen_key: str, rejected_key: str,
              system_key: str | None, fmt: str) -> tuple[list[Message], list[Message], list[Message]]:
    chosen, rejected = row[chosen_key], row[rejected_key]
    for key in (chosen_key, rejected_key):
        if not isinstance(row[key], (str, list)):
            raise RowRejected("schema", f"{fmt} {key!r} is {_type(row[key])}, expected a string or a message list")
    if prompt_key is None:
        prompt, c, r = split_implicit(chosen, rejected, fmt)
    else:
        prompt = to_messages(row[prompt_key], f"{fmt} {prompt_key!r}", "user")
        c = to_messages(chosen, "chosen", "assistant")
        r = to_messages(rejected, "rejected", "assistant")
    if system_key is not None:
        system = row[system_key]
        if system is not None and not isinstance(system, str):
            raise RowRejected("content_type", f"{fmt} system column {system_key!r} is {_type(system)}, "
                                              f"expected a string")
        if system:  # "" / null: no system prompt
            prompt = [{"role": "system", "content": system}] + prompt
    return prompt, c, r


def from_trl(row: dict) -> tuple[list[Message], list[Message], list[Message], None]:
    _require(row, ("chosen", "rejected"), "trl")
    prompt_key = "prompt" if "prompt" in row else None
    return (*_trl_like(row, prompt_key, "chosen", "rejected", None, "trl"), None)


def from_sharegpt(row: dict) -> tuple[list[Message], list[Message], list[Message], None]:
    _require(row, ("conversations", "chosen", "rejected"), "sharegpt")
    conv = row["conversations"]
    if not isinstance(conv, list):
        raise RowRejected("schema", f"sharegpt conversations is {_type(conv)}, expected a list")
    prompt = [sharegpt_message(m, f"conversations message {i}") for i, m in enumerate(conv)]
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise RowRejected("content_type", f"sharegpt system is {_type(system)}, expected a string")
    if system:
        prompt = [{"role": "system", "content": system}] + prompt

    def completion(v: Any, name: str) -> list[Message]:
        if isinstance(v, str):
            return [{"role": "assistant", "content": v}]
        if isinstance(v, dict):
            return [sharegpt_message(v, name)]
        if isinstance(v, list):
            return [sharegpt_message(m, f"{name} message {i}") for i, m in enumerate(v)]
        raise RowRejected("schema", f"sharegpt {name} is {_type(v)}, expected a {{from, value}} object or a string")

    return prompt, completion(row["chosen"], "chosen"), completion(row["rejected"], "rejected"), None


def from_openai(row: dict) -> tuple[list[Message], list[Message], list[Message], None]:
    _require(row, ("input", "preferred_output", "non_preferred_output"), "openai")
    inp = row["input"]
    if not isinstance(inp, dict) or "messages" not in inp:
        raise RowRejected("schema", f"openai input is {_type(inp)}"
                                    f"{'' if not isinstance(inp, dict) else ' without messages'}, "
                                    f"expected an object with a messages list")
    out = []
    for key in ("messages", "preferred_output", "non_preferred_output"):
        v = inp["messages"] if key == "messages" else row[key]
        if not isinstance(v, list):
            raise RowRejected("schema", f"openai {key} is {_type(v)}, expected a list of messages")
        out.append([to_message(m, f"{key} message {i}") for i, m in enumerate(v)])
    return out[0], out[1], out[2], None


def from_columns(row: dict, mapping: dict) -> tuple[list[Message], list[Message], list[Message], float | None]:
    used = [mapping[k] for k in ("prompt", "chosen", "rejected", "system", "margin") if k in mapping]
    _require(row, tuple(used), "columns")
    prompt, c, r = _trl_like(row, mapping.get("prompt"), mapping["chosen"], mapping["rejected"],
                             mapping.get("system"), "columns")
    margin = None
    if "margin" in mapping:
        m = row[mapping["margin"]]
        if m is not None:
            if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m):
                raise RowRejected("margin", f"margin column {mapping['margin']!r} is {m!r}, expected a finite number")
            margin = float(m)
    return prompt, c, r, margin


def detect_format(row: dict) -> str:
    """The `auto` rule (see module docstring)."""
    if {"input", "preferred_output", "non_preferred_output"} <= row.keys():
        return "openai"
    if {"conversations", "chosen", "rejected"} <= row.keys():
        return "sharegpt"
    if {"chosen", "rejected"} <= row.keys():
        c, r = row["chosen"], row["rejected"]
        if ("prompt" not in row and isinstance(c, str) and isinstance(r, str)
                and HH_MARKER in c and HH_MARKER in r):
            return "hh"
        return "trl"
    raise RowRejected("schema", f"cannot detect the format from keys {sorted(row)} (auto expects "
                                f"chosen+rejected, conversations+chosen+rejected, or "
                                f"input+preferred_output+non_preferred_output)")


ADAPTERS = {"hh": from_hh, "trl": from_trl, "sharegpt": from_sharegpt, "openai": from_openai}


@dataclass(frozen=True)
class Pair:
    prompt: list[Message]
    chosen: list[Message]
    rejected: list[Message]
    margin: float | None
    content_hash: str
    fmt: str  # the format that parsed the row (the detected one under `auto`)

    @property
    def pair_id(self) -> str:
        return pair_id_of(self.content_hash)


def normalize_row(row: Any, fmt: str, columns: dict | None = None) -> Pair:
    """One parsed row -> a validated Pair, or RowRejected with the reason code."""
    if row is None:
        raise RowRejected("schema", "row is null, expected an object")
    if not isinstance(row, dict):
        raise RowRejected("schema", f"row is {_type(row)}, expected an object")
    if fmt == "auto":
        fmt = detect_format(row)
    if fmt == "columns":
        if not columns:
            raise ValueError("format 'columns' needs a columns mapping")
        prompt, chosen, rejected, margin = from_columns(row, columns)
    else:
        prompt, chosen, rejected, margin = ADAPTERS[fmt](row)
    validate_pair(prompt, chosen, rejected)
    return Pair(prompt, chosen, rejected, margin, content_hash(prompt, chosen, rejected), fmt)


# ----------------------------------------------------------------------------------------------
# Readers: file -> (src_row, raw text, parsed value or RowRejected)

@dataclass(frozen=True)
class SourceRow:
    src_row: int
    raw: str
    value: Any = None
    error: RowRejected | None = None


def _raw_json(obj: Any) -> str:
    # The original text of a json/parquet element: JSON with sorted keys; non-JSON values
    # (bytes, timestamps from parquet) spelled by str so nothing is lost.
    text = json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: keep them, \u-escaped
        text = json.dumps(obj, sort_keys=True, ensure_ascii=True, default=str)
    return text


FILE_KINDS = ((".jsonl.gz", "jsonl.gz"), (".jsonl", "jsonl"), (".json.gz", "json.gz"), (".json", "json"),
              (".parquet", "parquet"))


def file_kind(path: str) -> str:
    for suffix, kind in FILE_KINDS:
        if path.endswith(suffix):
            return kind
    raise SourceError(f"{path}: unknown file type (expected .jsonl, .jsonl.gz, .json, .json.gz or .parquet)")


def _is_data_file(path: str) -> bool:
    return any(path.endswith(suffix) for suffix, _ in FILE_KINDS)


_GLOB_MAGIC = re.compile(r"[*?[]")


def source_paths(path: str, base_dir: str | Path = ".") -> list[str]:
    """The files a source's `path` names, in the order they are read (see the module docstring).

    A plain file path is returned as is; SourceError when it is no file (a typo would otherwise leave the rule
    an input it cannot have, and Snakemake would silently keep the old outputs instead), or not of a data file
    type. Returned paths have the form of `path` (relative to base_dir when it is relative), with "/"
    separators. The one expansion of globs and directories: the Snakemake rule lists these files as its inputs,
    which dvc.yaml's deps are generated from (workflow/rules/data.smk, workflow/sync_dvc.py).
    """
    # A path leading outside the repository is relative to the workspace, wherever this runs (data_location).
    root = workspace_root(base_dir) if leaves_repository(path) else Path(base_dir)
    absolute = Path(path).is_absolute()
    where = "" if absolute else f" (relative to {root.resolve()})"
    if _GLOB_MAGIC.search(path):
        matched = (glob.glob(path, recursive=True) if absolute
                   else glob.glob(path, root_dir=root, recursive=True))
        matched = [m.replace("\\", "/") for m in matched
                   if (Path(m) if absolute else root / m).is_file()]
        files = sorted(m for m in matched if _is_data_file(m))
        if not files:
            others = f"; it matches {len(matched)} file(s) of other types, e.g. {sorted(matched)[0]}" if matched else ""
            raise SourceError(f"{path}: the glob matches no .jsonl, .jsonl.gz, .json, .json.gz or .parquet "
                              f"file{where}{others}")
        return files
    full = Path(path) if absolute else root / path
    if full.is_dir():
        prefix = path.rstrip("/")
        files = sorted(f"{prefix}/{rel.as_posix()}" for rel in (f.relative_to(full) for f in full.rglob("*"))
                       if not any(part.startswith(".") for part in rel.parts)
                       and (full / rel).is_file() and _is_data_file(rel.name))
        if not files:
            raise SourceError(f"{path}: the directory holds no .jsonl, .jsonl.gz, .json, .json.gz or .parquet "
                              f"file (hidden entries skipped){where}")
        return files
    if not full.is_file():
        raise SourceError(f"{path}: no such file{where}")
    file_kind(path)
    return [path]


def resolve_source_files(sources: list[dict], base_dir: str | Path = ".") -> list[tuple[dict, list[str]]]:
    """Each source spec (names filled in, resolve_sources; checked, check_source_spec) with its files
    (source_paths), in params order; a source that names no data file is a SourceError naming it:
    `data.sources[i] (name): path: why`. What normalize reads, and what the Snakefile checks at DAG build."""
    out = []
    specs = resolve_sources(sources)
    for i, spec in enumerate(specs):
        check_source_spec(spec, i)
    for i, spec in enumerate(specs):
        try:
            out.append((spec, source_paths(spec["path"], base_dir)))
        except SourceError as e:
            raise SourceError(f"data.sources[{i}] ({spec.get('name', '?')}): {e}") from None
    return out


def default_source_name(path: str) -> str:
    """A source's default name: its file name without the data suffix; for a glob or directory the
    last path component left after removing wildcards (e.g. `data/train-*.parquet` -> `train`,
    `raw/hh-rlhf/harmless-base/` -> `harmless-base`); characters outside [A-Za-z0-9_.-] become `_`."""
    parts = [p for p in path.replace("\\", "/").split("/") if p not in ("", ".", "..")]
    for k, part in enumerate(reversed(parts)):
        if k == 0:
            for suffix, _ in FILE_KINDS:
                if part.endswith(suffix):
                    part = part[:-len(suffix)]
                    break
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", _GLOB_MAGIC.sub("", re.sub(r"\[[^]]*]", "", part))).strip("_.-")
        if name:
            return name
    return "source"


def resolve_sources(sources: list[dict]) -> list[dict]:
    """Copies of the source specs with every `name` filled in (defaults made unique, in params order)."""
    explicit: dict[str, int] = {}
    for i, spec in enumerate(sources):
        name = spec.get("name")
        if name is not None:
            if name in explicit:
                raise SourceError(f"data.sources[{i}]: name {name!r} is also the name of data.sources"
                                  f"[{explicit[name]}]; source names must be unique (they label every pair)")
            explicit[name] = i
    taken, out = set(explicit), []
    for spec in sources:
        spec = dict(spec)
        if spec.get("name") is None and isinstance(spec.get("path"), str) and spec["path"]:
            base = default_source_name(spec["path"])
            name, k = base, 2
            while name in taken:
                name, k = f"{base}_{k}", k + 1
            taken.add(name)
            spec["name"] = name
        out.append(spec)
    return out


_BLANK = object()  # sentinel: a whitespace-only jsonl line, skipped and counted


def _read_jsonl(lines: Iterable[bytes]) -> Iterator[SourceRow]:
    """Rows of a jsonl stream: `lines` as a binary file iterates them (each with its b"\\n", except
    perhaps the last). Lines split on "\\n" only; a trailing "\\r" is dropped, a BOM on line 0 too.
    A last line without "\\n" that is empty is no line (the final newline does not start another)."""
    for i, line in enumerate(lines):
        terminated = line.endswith(b"\n")
        if terminated:
            line = line[:-1]
        if i == 0 and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]
        if line.endswith(b"\r"):
            line = line[:-1]
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            yield SourceRow(i, line.decode("utf-8", "backslashreplace"),
                            error=RowRejected("json", f"line is not valid UTF-8 ({e.reason} at byte {e.start})"))
            continue
        if not text.strip():
            if terminated or text:
                yield SourceRow(i, text, error=None, value=_BLANK)
            continue
        try:
            yield SourceRow(i, text, value=json.loads(text))
        except json.JSONDecodeError as e:
            yield SourceRow(i, text, error=RowRejected("json", f"invalid JSON: {e.msg} at column {e.colno}"))


PARQUET_READ_ROWS = 4096


def iter_source_rows(path: str | Path) -> Iterator[SourceRow]:
    """Every row of one source file, read as it is consumed (jsonl line by line, parquet by record
    batch; a .json document is one JSON value, parsed whole). Raises SourceError when the file as a
    whole is unreadable (also part-way: a truncated .gz or corrupt parquet page)."""
    path = str(path)
    kind = file_kind(path)
    p = Path(path)
    if not p.is_file():
        raise SourceError(f"{path}: source file not found (cwd-relative paths; cwd = {Path.cwd()})")
    try:
        if kind == "parquet":
            i = 0
            for batch in pq.ParquetFile(p).iter_batches(batch_size=PARQUET_READ_ROWS):
                for r in batch.to_pylist():
                    yield SourceRow(i, _raw_json(r), value=r)
                    i += 1
            return
        if kind.startswith("jsonl"):
            with (gzip.open(p, "rb") if kind.endswith(".gz") else open(p, "rb")) as f:
                yield from _read_jsonl(f)
            return
        data = gzip.decompress(p.read_bytes()) if kind.endswith(".gz") else p.read_bytes()
    except (OSError, EOFError, pa.ArrowException) as e:
        raise SourceError(f"{path}: cannot read {kind} file: {e}") from e
    try:
        doc = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(f"{path}: not a valid JSON document ({e}); one object per line needs a .jsonl name") from e
    if not isinstance(doc, list):
        raise SourceError(f"{path}: a .json source must be a list of row objects, got {_type(doc)}")
    del data
    for i, v in enumerate(doc):
        yield SourceRow(i, _raw_json(v), value=v)


def read_source_rows(path: str | Path) -> list[SourceRow]:
    """Every row of one source file. Raises SourceError when the file as a whole is unreadable."""
    return list(iter_source_rows(path))


# ----------------------------------------------------------------------------------------------
# Driver: sources -> pairs, rejections, stats

@dataclass
class Normalized:
    pairs: list[dict] = field(default_factory=list)       # pairs.parquet rows, sorted by pair_id
    rejections: list[dict] = field(default_factory=list)  # rejections.parquet rows, source then row order
    stats: dict = field(default_factory=dict)


def check_source_spec(spec: dict, index: int) -> None:
    """One source entry after resolve_sources (so `name` is filled in)."""
    where = f"data.sources[{index}] ({spec.get('name', '?')})"
    for key in ("name", "path", "format"):
        if not isinstance(spec.get(key), str) or not spec[key]:
            raise SourceError(f"{where}: '{key}' must be a non-empty string")
    if spec["format"] not in FORMATS:
        raise SourceError(f"{where}: unknown format {spec['format']!r} (expected one of {FORMATS})")
    cols = spec.get("columns")
    if spec["format"] == "columns":
        if not isinstance(cols, dict) or "chosen" not in cols or "rejected" not in cols:
            raise SourceError(f"{where}: format 'columns' needs a columns mapping with at least chosen and rejected")
    elif cols is not None:
        raise SourceError(f"{where}: a columns mapping is only used with format 'columns' (format is "
                          f"{spec['format']!r})")


def normalize_sources(sources: list[dict], base_dir: str | Path = ".", out: Normalized | None = None) -> Normalized:
    """Read and normalize every source in order (its files in source_paths order); duplicates keep the
    first (source, file, row). `out` (default: lists in memory) receives pairs and rejections through
    `.pairs.append` / `.rejections.append`; normalize_to_files passes sinks that write as they go."""
    out = Normalized() if out is None else out
    first_seen = _FirstSeen()
    per_source = []
    # Every source's files before any is read: a typo in the last source stops the stage at once.
    for index, (spec, files) in enumerate(resolve_source_files(sources, base_dir)):
        name, pattern, fmt = spec["name"], spec["path"], spec["format"]
        stat = {"name": name, "path": pattern, "format": fmt, "rows_in": 0, "blank_lines": 0, "pairs_out": 0,
                "rejected": {r: 0 for r in REASONS}, "parsed_as": {}, "files": []}
        first_rejection: list[str] = []
        for path in files:
            rows = iter_source_rows(Path(base_dir) / data_location(path, base_dir))
            file_stat = {"path": path, "rows": 0}
            stat["files"].append(file_stat)
            _normalize_file(rows, spec, path, stat, file_stat, out, first_seen, first_rejection)
        stat["rejected_total"] = sum(stat["rejected"].values())
        if stat["rows_in"] != stat["pairs_out"] + stat["rejected_total"]:  # nothing may be lost
            raise AssertionError(f"{pattern}: rows_in {stat['rows_in']} != pairs_out {stat['pairs_out']} "
                                 f"+ rejected {stat['rejected_total']}")
        check_source_yield(stat, index, first_rejection[0] if first_rejection else None)
        per_source.append(stat)

    if isinstance(out.pairs, list):  # in memory; a streaming sink sorts when it writes (_PairSpill)
        out.pairs.sort(key=lambda p: p["pair_id"])
        for a, b in zip(out.pairs, out.pairs[1:]):
            if a["pair_id"] == b["pair_id"]:  # distinct content, same 96-bit prefix: refuse, never merge
                raise AssertionError(f"pair_id collision {a['pair_id']}: {a['content_hash']} vs {b['content_hash']}")
    totals = {"sources": len(per_source), "rows_in": 0, "blank_lines": 0, "pairs_out": 0,
              "rejected": {r: 0 for r in REASONS}, "rejected_total": 0}
    for s in per_source:
        for k in ("rows_in", "blank_lines", "pairs_out", "rejected_total"):
            totals[k] += s[k]
        for r, n in s["rejected"].items():
            totals["rejected"][r] += n
    out.stats = {"sources": per_source, "totals": totals}
    return out


def check_source_yield(stat: dict, index: int, first_rejection: str | None = None) -> None:
    """A source that gives no pair (an empty file, every row rejected, every row a duplicate of an earlier
    source's) is refused, naming it and its rejections by reason: a run that silently trains without the data
    a source names would claim data it never used. Raised before anything is written (normalize_to_files
    writes atomically), so no rejections.parquet of an incomplete run is left beside the old pairs; the rows
    are still where the source is, and the message carries the first rejection's detail."""
    if stat["pairs_out"]:
        return
    reasons = ", ".join(f"{r} {n}" for r, n in stat["rejected"].items() if n)
    if stat["rows_in"] == 0:
        what = f"its {len(stat['files'])} file(s) hold no row" + (f" ({stat['blank_lines']} blank lines)"
                                                                  if stat["blank_lines"] else "")
    else:
        what = f"all {stat['rows_in']} rows were rejected ({reasons})" + (
            f"; the first: {first_rejection}" if first_rejection else "")
    raise SourceError(f"data.sources[{index}] ({stat['name']}): {stat['path']} yields 0 pairs: {what}")


class _FirstSeen:
    """content_hash -> where it was first seen (source, file, row), compact for millions of pairs: the
    key is the digest's 32 bytes, the value one int (file number, row)."""

    def __init__(self):
        self._where: dict[bytes, int] = {}
        self._files: list[tuple[str, str]] = []
        self._file_ids: dict[tuple[str, str], int] = {}

    def get(self, content_hash: str) -> tuple[str, str, int] | None:
        v = self._where.get(bytes.fromhex(content_hash))
        if v is None:
            return None
        s, f = self._files[v >> 40]
        return s, f, v & ((1 << 40) - 1)

    def add(self, content_hash: str, source: str, path: str, row: int) -> None:
        fid = self._file_ids.setdefault((source, path), len(self._files))
        if fid == len(self._files):
            self._files.append((source, path))
        self._where[bytes.fromhex(content_hash)] = (fid << 40) | row


def _normalize_file(rows: Iterable[SourceRow], spec: dict, path: str, stat: dict, file_stat: dict,
                    out: Normalized, first_seen: _FirstSeen, first_rejection: list[str]) -> None:
    """One file of a source: pairs and rejections appended to `out`, counts to the source's `stat`, the
    source's first rejection (reason: detail) to `first_rejection`."""
    name, fmt = spec["name"], spec["format"]

    def reject(row: SourceRow, err: RowRejected) -> None:
        stat["rejected"][err.reason] += 1
        detail = f"{path} row {row.src_row}: {err.detail}"
        if not first_rejection:
            first_rejection.append(f"{err.reason}: {detail}")
        out.rejections.append({"source": name, "src_file": path, "src_row": row.src_row, "reason": err.reason,
                               "detail": detail, "raw": row.raw})

    for row in rows:
        if row.value is _BLANK:
            stat["blank_lines"] += 1
            continue
        file_stat["rows"] += 1
        stat["rows_in"] += 1
        try:
            if row.error is not None:
                raise row.error
            pair = normalize_row(row.value, fmt, spec.get("columns"))
            earlier = first_seen.get(pair.content_hash)
            if earlier is not None:
                s, f, r = earlier
                raise RowRejected("duplicate", f"same prompt, chosen and rejected as {s} {f} row {r}")
            # Keeping both orders of one comparison would train on a preference and its opposite.
            earlier = first_seen.get(content_hash(pair.prompt, pair.rejected, pair.chosen))
            if earlier is not None:
                s, f, r = earlier
                raise RowRejected("contradicts", f"{s} {f} row {r} has this prompt with chosen and rejected swapped")
        except RowRejected as err:
            reject(row, err)
            continue
        first_seen.add(pair.content_hash, name, path, row.src_row)
        stat["parsed_as"][pair.fmt] = stat["parsed_as"].get(pair.fmt, 0) + 1
        stat["pairs_out"] += 1
        out.pairs.append({"pair_id": pair.pair_id, "content_hash": pair.content_hash, "source": name,
                          "prompt": pair.prompt, "chosen": pair.chosen, "rejected": pair.rejected,
                          "margin": pair.margin, "src_file": path, "src_row": row.src_row})


# ----------------------------------------------------------------------------------------------
# Tables and CLI

REJECTIONS_SCHEMA = pa.schema([
    ("source", pa.string()), ("src_file", pa.string()), ("src_row", pa.int64()),
    ("reason", pa.string()), ("detail", pa.string()), ("raw", pa.string()),
])


def pairs_table(pairs: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(pairs, schema=PAIRS_SCHEMA)


def rejections_table(rejections: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rejections, schema=REJECTIONS_SCHEMA)


# Streaming sinks: normalize_sources appends to these; rows are written as they go, never all held.

SINK_ROWS = 4096  # rows buffered per table piece (memory only: the files' row groups are io.PARQUET_ROW_GROUP)


class _TableSink:
    """`.append(row dict)`; pieces of SINK_ROWS rows go to a ParquetStreamWriter."""

    def __init__(self, writer: ParquetStreamWriter, schema: pa.Schema):
        self.writer, self.schema, self.rows = writer, schema, []

    def append(self, row: dict) -> None:
        self.rows.append(row)
        if len(self.rows) >= SINK_ROWS:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            self.writer.write(pa.Table.from_pylist(self.rows, schema=self.schema))
            self.rows = []


class _PairSpill:
    """pairs.parquet is sorted by pair_id: pairs are spilled to 16 bucket files by the pair_id's first
    hex digit (pair IDs are hash prefixes, so buckets are even), then each bucket is sorted in memory and
    written in bucket order: an external sort holding one bucket (1/16 of the pairs) at a time."""

    BUCKETS = "0123456789abcdef"

    def __init__(self, tmp_dir: Path):
        self.tmp_dir = tmp_dir
        self.rows: dict[str, list[dict]] = {b: [] for b in self.BUCKETS}
        self.writers: dict[str, pq.ParquetWriter] = {}

    def append(self, pair: dict) -> None:
        bucket = self.rows[pair["pair_id"][0]]
        bucket.append(pair)
        if len(bucket) >= SINK_ROWS // 4:
            self._spill(pair["pair_id"][0])

    def _spill(self, b: str) -> None:
        if not self.rows[b]:
            return
        if b not in self.writers:  # scratch files: fast, uncompressed
            self.writers[b] = pq.ParquetWriter(self.tmp_dir / f"bucket_{b}.parquet", PAIRS_SCHEMA, compression="none")
        self.writers[b].write_table(pa.Table.from_pylist(self.rows[b], schema=PAIRS_SCHEMA))
        self.rows[b] = []

    def write_sorted(self, writer: ParquetStreamWriter) -> None:
        import pyarrow.compute as pc

        for b in self.BUCKETS:
            self._spill(b)
        for w in self.writers.values():
            w.close()
        for b in self.BUCKETS:
            if b not in self.writers:
                continue
            table = pq.read_table(self.tmp_dir / f"bucket_{b}.parquet")
            table = table.take(pc.sort_indices(table, [("pair_id", "ascending")]))
            ids = table.column("pair_id").to_pylist()
            for i in range(1, len(ids)):
                if ids[i] == ids[i - 1]:  # distinct content, same 96-bit prefix: refuse, never merge
                    hashes = table.column("content_hash").slice(i - 1, 2).to_pylist()
                    raise AssertionError(f"pair_id collision {ids[i]}: {hashes[0]} vs {hashes[1]}")
            writer.write(table.combine_chunks())
            (self.tmp_dir / f"bucket_{b}.parquet").unlink()


def normalize_to_files(sources: list[dict], pairs_path: str, rejections_path: str,
                       base_dir: str | Path = ".") -> dict:
    """normalize_sources writing pairs.parquet and rejections.parquet as it goes (the same bytes as
    write_parquet of the in-memory tables); returns the stats."""
    import tempfile

    Path(pairs_path).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".normalize_spill.", dir=Path(pairs_path).parent) as tmp, \
            ParquetStreamWriter(rejections_path, REJECTIONS_SCHEMA) as rejections_out:
        spill = _PairSpill(Path(tmp))
        out = Normalized(pairs=spill, rejections=_TableSink(rejections_out, REJECTIONS_SCHEMA))
        normalize_sources(sources, base_dir, out)
        out.rejections.flush()
        with ParquetStreamWriter(pairs_path, PAIRS_SCHEMA) as pairs_out:
            spill.write_sorted(pairs_out)
    return out.stats


def _arguments(ap) -> None:
    ap.add_argument("--pairs", required=True, help="output pairs.parquet")
    ap.add_argument("--rejections", required=True, help="output rejections.parquet")
    ap.add_argument("--stats", required=True, help="output normalize_stats.json")


def _run(args) -> int:
    log = logging.getLogger("normalize")
    params = load_params(args.params)
    stats = normalize_to_files(params["data"]["sources"], args.pairs, args.rejections)
    for s in stats["sources"]:
        reasons = {r: n for r, n in s["rejected"].items() if n}
        log.info("source %s (%s, %s): rows_in=%d pairs_out=%d rejected=%d %s", s["name"], s["path"], s["format"],
                 s["rows_in"], s["pairs_out"], s["rejected_total"], reasons or "")
    # The stats file last: it is the summary of outputs that already exist in full.
    write_json(args.stats, stats)
    t = stats["totals"]
    log.info("wrote %d pairs to %s, %d rejections to %s", t["pairs_out"], args.pairs, t["rejected_total"],
             args.rejections)
    return 0


def main(argv: list[str] | None = None) -> int:
    return stage_main(argv, "normalize", __doc__.split("\n")[0], add_arguments=_arguments, run=_run,
                      input_errors=(SourceError, ParamsError))


if __name__ == "__main__":
    raise SystemExit(main())
