"""The vocabulary a pair is made of: messages, the conversation rules, implicit prompts, shared reason codes.

A pair is (prompt, chosen, rejected): lists of `{"role", "content"}` messages. A format module
(stages/data/formats/) turns one source row into such lists with the helpers here and declares itself as a
`Format`; the registry validates what it returns with `validate_pair`.

Validation (every failure is a rejection with a stable reason code, set where it is raised): a message is an
object with string `role` in {system, user, assistant} and string `content` (extra keys must be null); a system
message only first; then user/assistant alternate starting with user; the prompt ends with a user turn; each
completion is exactly one assistant message; prompt and completion contents are non-empty after strip; chosen
and rejected differ after strip.

Implicit prompts (a row without a prompt): for strings TRL's `extract_prompt` (longest common character prefix,
backed off by one when the character before the split is a space, so the completions keep their leading space);
unlike TRL, when one string is a prefix of the other the split is at the end of the shorter one (whose
completion is then empty -> `empty_completion`). For message lists, the common leading messages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# Reason codes any format may raise (a format adds its own in `Format.reasons`; the normalize driver adds
# `contradicts` and `duplicate`). Stable: they are the keys of normalize_stats.json and rejections.parquet.
COMMON_REASONS = (
    "json",              # the line is not valid JSON (or not UTF-8)
    "schema",            # not an object / null / missing or wrongly-typed field / format undetectable
    "role",              # bad, missing or misplaced role; no alternation; multi-turn completion
    "content_type",      # message content missing or not a string
    "empty_prompt",      # no prompt, or a prompt message empty after strip
    "empty_completion",  # a completion missing or empty after strip
    "identical_pair",    # chosen == rejected (after strip)
    "no_shared_prompt",  # implicit prompt: chosen and rejected share no prompt
)
ROLES = ("system", "user", "assistant")

Message = dict  # {"role": str, "content": str}
# What a format's parser returns: prompt, chosen, rejected messages and the margin (None when the format has none).
Parsed = tuple[list[Message], list[Message], list[Message], "float | None"]


class RowRejected(Exception):
    """One row cannot become a pair. `reason` is a stable code (COMMON_REASONS or the raising format's own);
    `detail` says why."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Format:
    """What a format module declares as its `FORMAT` (stages/data/formats/<name>.py; the file name is `name`).

    parse(row, options) -> Parsed: the row (a dict) as prompt, chosen, rejected and margin, or RowRejected
        with a code from COMMON_REASONS or `reasons`; `options` is the source's `options` entry (None for a
        format without one). The registry validates the conversation (validate_pair) and hashes it.
    detect(row) -> bool: whether `auto` reads the row as this format; None = never detected (columns).
    detect_keys: the keys detect looks for, named in the message of a row `auto` cannot place.
    auto_rank: `auto` tries formats in ascending auto_rank, the first whose detect is true wins (the most
        specific first: a trl row's keys are a subset of a sharegpt row's).
    reasons: reason codes this format raises beyond COMMON_REASONS.
    options: the source key holding this format's settings (columns: "columns"); a source of another format
        may not set it. check_options(value) -> None, or what is wrong with the source's value.
    """
    name: str
    parse: Callable[[dict, Any], Parsed]
    detect: Callable[[dict], bool] | None = None
    detect_keys: tuple[str, ...] = ()
    auto_rank: int | None = None
    reasons: tuple[str, ...] = ()
    options: str | None = None
    check_options: Callable[[Any], str | None] | None = None


def type_name(x: Any) -> str:
    return "null" if x is None else type(x).__name__


def preview(s: str, n: int = 60) -> str:
    return repr(s if len(s) <= n else s[:n] + "...")


def require_keys(row: dict, keys: tuple[str, ...], fmt: str) -> None:
    missing = [k for k in keys if k not in row]
    if missing:
        raise RowRejected("schema", f"{fmt} row lacks {missing} (has {sorted(row)})")


# ----------------------------------------------------------------------------------------------
# Messages

def check_extra_keys(obj: dict, allowed: tuple[str, ...], where: str) -> None:
    # Null extras are tolerated: parquet structs unify keys across rows and fill absent ones with
    # null. A non-null extra (name, tool_calls, ...) would be silently dropped, so it is refused.
    extra = sorted(k for k, v in obj.items() if k not in allowed and v is not None)
    if extra:
        raise RowRejected("schema", f"{where} has unsupported keys {extra} (only {list(allowed)})")


def to_message(obj: Any, where: str) -> Message:
    """A {role, content} object -> canonical message, or RowRejected naming what is wrong."""
    if not isinstance(obj, dict):
        raise RowRejected("schema", f"{where} is {type_name(obj)}, expected an object with role and content")
    if "role" not in obj or obj["role"] is None:
        raise RowRejected("role", f"{where} has no role")
    role = obj["role"]
    if not isinstance(role, str):
        raise RowRejected("role", f"{where} role is {type_name(role)}, expected a string")
    if role not in ROLES:
        raise RowRejected("role", f"{where} has role {role!r}, expected one of {'/'.join(ROLES)}")
    if "content" not in obj or obj["content"] is None:
        raise RowRejected("content_type", f"{where} has no content")
    if not isinstance(obj["content"], str):
        raise RowRejected("content_type", f"{where} content is {type_name(obj['content'])}, expected a string")
    check_extra_keys(obj, ("role", "content"), where)
    return {"role": role, "content": obj["content"]}


def to_messages(value: Any, where: str, string_role: str) -> list[Message]:
    """A field that is a string (-> one `string_role` message) or a list of message objects."""
    if isinstance(value, str):
        return [{"role": string_role, "content": value}]
    if isinstance(value, list):
        return [to_message(m, f"{where} message {i}") for i, m in enumerate(value)]
    raise RowRejected("schema", f"{where} is {type_name(value)}, expected a string or a list of messages")


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

def common_prefix_len(a, b) -> int:
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
    i = common_prefix_len(chosen, rejected)
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
        n = common_prefix_len(cm, rm)
        if n == 0:
            raise RowRejected("no_shared_prompt", f"{where}: chosen and rejected share no leading message "
                                                  f"(implicit prompt)")
        return cm[:n], cm[n:], rm[n:]
    raise RowRejected("schema", f"{where}: without a prompt, chosen and rejected must both be strings or both "
                                f"message lists, got {type_name(chosen)} and {type_name(rejected)}")


def trl_fields(row: dict, prompt_key: str | None, chosen_key: str, rejected_key: str,
               system_key: str | None, fmt: str) -> tuple[list[Message], list[Message], list[Message]]:
    """TRL-shaped fields of a row: chosen / rejected as strings or message lists, the prompt explicit (a string
    becomes one user message) or implicit (prompt_key None), and an optional system string prepended."""
    chosen, rejected = row[chosen_key], row[rejected_key]
    for key in (chosen_key, rejected_key):
        if not isinstance(row[key], (str, list)):
            raise RowRejected("schema", f"{fmt} {key!r} is {type_name(row[key])}, expected a string or a message list")
    if prompt_key is None:
        prompt, c, r = split_implicit(chosen, rejected, fmt)
    else:
        prompt = to_messages(row[prompt_key], f"{fmt} {prompt_key!r}", "user")
        c = to_messages(chosen, "chosen", "assistant")
        r = to_messages(rejected, "rejected", "assistant")
    if system_key is not None:
        system = row[system_key]
        if system is not None and not isinstance(system, str):
            raise RowRejected("content_type", f"{fmt} system column {system_key!r} is {type_name(system)}, "
                                              f"expected a string")
        if system:  # "" / null: no system prompt
            prompt = [{"role": "system", "content": system}] + prompt
    return prompt, c, r
