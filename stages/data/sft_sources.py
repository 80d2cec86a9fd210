"""SFT data: the rows of `sft.sources` as (prompt, completion) conversations, with reason codes for the rows refused,
and a tokenized example per row (stages/sft.py trains on them; completion tokens only are scored).

Formats (`format` of a source; `auto` picks by keys, in this order):

    messages            TRL conversational: {"messages": [{role, content}, ...]}; the last message is the completion
                        (an assistant turn), everything before it the prompt
    conversations       ShareGPT: {"conversations": [{from, value}, ...], "system"?: str}; the same split
    prompt_completion   TRL prompt-completion: {"prompt": str | messages, "completion": str | messages}

Reason codes (sft_data.json counts them): the preference formats' shared ones that apply (`json`, `schema`, `role`,
`content_type`, `empty_prompt`, `empty_completion`) and `probe_prompt` (the row's prompt is a probe prompt: probe
prompts never reach SFT, judged as freeze_probe judges a leak, stages/lib/contracts.py prompt_key), `duplicate`
(the same prompt and completion as an earlier row), `too_long` (over tokenize.max_length tokens, or a prompt over
max_prompt_length: SFT rows are not truncated), and the tokenizer's (`special_token_in_content`,
`boundary_straddles_token`, `empty_completion_tokens`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable

from stages.data.formats.sharegpt import sharegpt_message
from stages.data.limits import TokenizeLimits
from stages.data.messages import ROLES, RowRejected, require_keys, to_messages, type_name
from stages.data.render import BranchRejected
from stages.data.sources import BLANK, SourceError, iter_source_rows, resolve_sources, source_paths
from stages.lib.contracts import prompt_key
from stages.lib.io import sha256_json

SFT_FORMATS = ("auto", "messages", "conversations", "prompt_completion")
SFT_REASONS = ("json", "schema", "role", "content_type", "empty_prompt", "empty_completion", "probe_prompt",
               "duplicate", "too_long", "special_token_in_content", "boundary_straddles_token",
               "empty_completion_tokens")
EXAMPLES_KEPT = 5          # refused rows named per reason in sft_data.json


class SFTDataError(ValueError):
    """The SFT data as a whole cannot train (no source file, no row left); the message names the source."""


@dataclass(frozen=True)
class SFTExample:
    example_id: str        # sha256 of the conversation (first 32 hex), as a pair_id is of a pair
    source: str
    src_row: int
    prompt: list[dict]
    completion: list[dict]


def detect_sft_format(row: dict) -> str:
    for fmt, keys in (("messages", ("messages",)), ("conversations", ("conversations",)),
                      ("prompt_completion", ("prompt", "completion"))):
        if all(k in row for k in keys):
            return fmt
    raise RowRejected("schema", f"no SFT format fits keys {sorted(row)} (messages, conversations, or "
                                "prompt + completion)")


def _split_last(messages: list[dict], fmt: str) -> tuple[list[dict], list[dict]]:
    if len(messages) < 2:
        raise RowRejected("empty_prompt", f"{fmt}: {len(messages)} message(s); need a prompt and a completion")
    return messages[:-1], messages[-1:]


def parse_sft_row(row: Any, fmt: str) -> tuple[list[dict], list[dict]]:
    """One row -> (prompt messages, [the assistant completion]), or RowRejected(code, why)."""
    if not isinstance(row, dict):
        raise RowRejected("schema", f"row is {type_name(row)}, expected an object")
    fmt = detect_sft_format(row) if fmt == "auto" else fmt
    if fmt == "messages":
        require_keys(row, ("messages",), "messages")
        if not isinstance(row["messages"], list):
            raise RowRejected("schema", f"messages is {type_name(row['messages'])}, expected a list")
        prompt, completion = _split_last(to_messages(row["messages"], "messages", "user"), fmt)
    elif fmt == "conversations":
        require_keys(row, ("conversations",), "conversations")
        conv = row["conversations"]
        if not isinstance(conv, list):
            raise RowRejected("schema", f"conversations is {type_name(conv)}, expected a list")
        msgs = [sharegpt_message(m, f"conversations message {i}") for i, m in enumerate(conv)]
        system = row.get("system")
        if system is not None and not isinstance(system, str):
            raise RowRejected("content_type", f"system is {type_name(system)}, expected a string")
        prompt, completion = _split_last(([{"role": "system", "content": system}] if system else []) + msgs, fmt)
    elif fmt == "prompt_completion":
        require_keys(row, ("prompt", "completion"), "prompt_completion")
        prompt = to_messages(row["prompt"], "prompt", "user")
        completion = to_messages(row["completion"], "completion", "assistant")
    else:
        raise SFTDataError(f"unknown SFT format {fmt!r} (one of {', '.join(SFT_FORMATS)})")
    check_conversation(prompt, completion)
    return prompt, completion


def check_conversation(prompt: list[dict], completion: list[dict]) -> None:
    if not prompt:
        raise RowRejected("empty_prompt", "no prompt message")
    if len(completion) != 1 or completion[0]["role"] != "assistant":
        raise RowRejected("role", f"the completion must be one assistant message, got roles "
                                  f"{[m['role'] for m in completion]}")
    if prompt[-1]["role"] != "user":
        raise RowRejected("role", f"the prompt must end with a user message, got {prompt[-1]['role']!r}")
    for i, m in enumerate(prompt):
        if m["role"] not in ROLES or (m["role"] == "system" and i != 0):
            raise RowRejected("role", f"prompt message {i} has role {m['role']!r} (a system message only first)")
        if not m["content"].strip():
            raise RowRejected("empty_prompt", f"prompt message {i} is empty")
    if not completion[0]["content"].strip():
        raise RowRejected("empty_completion", "the completion is empty")


class Refusals:
    """Counts by reason and the first EXAMPLES_KEPT rows of each (source, row, why)."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.examples: dict[str, list[dict]] = {}

    def add(self, reason: str, source: str, src_row: int, detail: str) -> None:
        self.counts[reason] += 1
        kept = self.examples.setdefault(reason, [])
        if len(kept) < EXAMPLES_KEPT:
            kept.append({"source": source, "row": src_row, "detail": detail})

    def record(self) -> dict:
        return {"by_reason": {r: self.counts[r] for r in sorted(self.counts)},
                "examples": {r: self.examples[r] for r in sorted(self.examples)}}


def resolve_sft_source_files(sources: list[dict], base_dir=".") -> list[tuple[dict, list[str]]]:
    """Each `sft.sources` entry (name filled in as data.sources names it) with its files; SFTDataError naming the
    entry for an unknown format or a path that names no data file. What the sft rule lists as inputs."""
    out = []
    for i, spec in enumerate(resolve_sources(sources)):
        where = f"sft.sources[{i}] ({spec.get('name', '?')})"
        if spec.get("format") not in SFT_FORMATS:
            raise SFTDataError(f"{where}: format {spec.get('format')!r} is not an SFT format ({', '.join(SFT_FORMATS)})")
        try:
            out.append((spec, source_paths(spec["path"], base_dir)))
        except SourceError as e:
            raise SFTDataError(f"{where}: {e}") from None
    return out


def read_sft_sources(sources: list[dict], probe_prompts: set[str], refusals: Refusals) -> list[SFTExample]:
    """Every row of every source (params order, file order), parsed; probe prompts and repeats refused."""
    out: list[SFTExample] = []
    seen: set[str] = set()
    for spec, files in resolve_sft_source_files(sources):
        fmt = spec["format"]
        for path in files:
            for r in iter_source_rows(path):
                where = f"{path} row {r.src_row}"
                if r.error is not None:
                    refusals.add(r.error.reason, spec["name"], r.src_row, f"{where}: {r.error.detail}")
                    continue
                if r.value is BLANK:
                    continue                                     # a blank line: no row
                try:
                    prompt, completion = parse_sft_row(r.value, fmt)
                except RowRejected as e:
                    refusals.add(e.reason, spec["name"], r.src_row, f"{where}: {e.detail}")
                    continue
                if prompt_key(prompt) in probe_prompts:
                    refusals.add("probe_prompt", spec["name"], r.src_row,
                                 f"{where}: its prompt is a probe prompt (probe prompts never reach SFT)")
                    continue
                digest = sha256_json({"prompt": prompt, "completion": completion})
                if digest in seen:
                    refusals.add("duplicate", spec["name"], r.src_row, f"{where}: repeats an earlier row")
                    continue
                seen.add(digest)
                out.append(SFTExample(digest[:32], spec["name"], r.src_row, prompt, completion))
    return out


def tokenize_examples(examples: list[SFTExample], pair_tokenizer, limits: TokenizeLimits,
                      refusals: Refusals) -> list[tuple[SFTExample, list[int], int]]:
    """(example, token ids, prompt length) of each example that renders and fits the limits, in order."""
    rendered, kept = [], []
    for ex in examples:
        try:
            rendered.append(pair_tokenizer.render(ex.prompt, ex.completion))
            kept.append(ex)
        except BranchRejected as e:
            refusals.add(e.reason, ex.source, ex.src_row, e.detail)
    out = []
    for ex, branch in zip(kept, pair_tokenizer.encode(rendered, limits)):
        if isinstance(branch, BranchRejected):
            refusals.add(branch.reason, ex.source, ex.src_row, branch.detail)
        elif not hasattr(branch, "ids"):                      # NotTokenized: over a limit by its characters
            refusals.add("too_long", ex.source, ex.src_row, branch.detail)
        elif branch.prompt_len > limits.max_prompt_length or len(branch.ids) > limits.max_length:
            refusals.add("too_long", ex.source, ex.src_row,
                         f"{len(branch.ids)} tokens (prompt {branch.prompt_len}); tokenize.max_length "
                         f"{limits.max_length}, max_prompt_length {limits.max_prompt_length}")
        else:
            out.append((ex, list(branch.ids), branch.prompt_len))
    return out


def probe_prompt_keys(prompts: Iterable[list[dict]]) -> set[str]:
    return {prompt_key(p) for p in prompts}


def examples_digest(rows: list[tuple[str, list[int], int]]) -> str:
    """The SFT data's identity: sha256 over (example id, token ids, prompt length) in training order."""
    return sha256_json([[i, ids, n] for i, ids, n in rows])
