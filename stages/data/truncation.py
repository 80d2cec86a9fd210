"""Pairs -> token rows under the limits: every truncation mode, reason-coded rejections, truncation records.

For a pair whose prompt has more than max_prompt_length tokens or whose longer branch has more than max_length
(stages/data/limits.py names the modes):
* `reject`: `prompt_too_long` (the prompt is over) or else `sequence_too_long`.
* `truncate_completion`: an over-long prompt is still `prompt_too_long`; otherwise the completions are cut to fit
  max_length (the cut completion then has no EOS: it did not end there). Reason `completion_cut`.
* `keep_end` (TRL's truncation_mode="keep_end", at turn boundaries): the completions stay whole and the prompt
  loses its oldest turns. The pair is re-rendered (and re-tokenized) with the prompt `[system?] + prompt[j:]` for
  the first user turn j that makes both branches fit both limits (reason `prompt_turns_dropped`; a leading system
  message is kept). When even the last user turn alone does not fit, that turn's text is cut from the left by as
  few characters as fit (bisection over the cut, each candidate re-tokenized and checked), moved on to the next
  word start where that still fits (reason `prompt_text_cut`). A pair that cannot fit even so (the completions
  leave no room, or the fixed part of the prompt is over max_prompt_length) is rejected as `sequence_too_long` /
  `prompt_too_long`.
* `keep_end_then_completion` (TRL's truncation_mode="keep_end" with max_prompt_length and max_completion_length):
  a prompt over max_prompt_length is cut from the left by keep_end's rule (oldest turns first, then the last user
  turn's leading text, re-rendered), but only until the prompt fits max_prompt_length; then each branch still over
  max_length keeps its first max_length tokens (its completion loses its end, and with it the EOS). Reasons
  `prompt_turns_dropped` / `prompt_text_cut` (prompt only), `completion_cut` (completions only),
  `prompt_and_completion_cut` (both: the record's messages/characters dropped say how the prompt was cut). Only a
  prompt that cannot get under max_prompt_length (a system message that alone is over it) is rejected
  (`prompt_too_long`), or a completion too long by its characters with no exact cut (`sequence_too_long`).
  Against TRL's code (trl/trainer/dpo_trainer.py: v0.11 `_truncate_tokens`; v0.12 to v0.28 `tokenize_row`, which
  keeps `prompt_input_ids[-max_prompt_length:]` and `completion_input_ids[:max_completion_length]`, then from
  v0.14 `concatenated_forward`'s keep_end keeps the last max_length tokens): the same order (prompt from the left, then
  completions from the right) and the same result when the prompt fits max_prompt_length, with
  max_completion_length = max_length - the prompt's tokens (TRL's last keep_end cut then removes nothing). Where it
  differs: (1) TRL cuts the prompt's token ids at any token, ours at a turn or a word start and re-renders it, so
  the chat template's headers stay whole and the prompt may keep a few tokens fewer than max_prompt_length; (2) the
  completion keeps what the kept prompt leaves of max_length, where TRL 0.11 keeps max_length - max_prompt_length
  whatever the prompt's length and TRL 0.12+ its separate max_completion_length (not a knob here); (3) TRL 0.11
  leaves a prompt over max_prompt_length alone when the whole pair fits max_length, here max_prompt_length always
  holds (as in TRL 0.12+); (4) TRL 0.29 and 1.x have no max_prompt_length or max_completion_length: the collator cuts
  the whole sequence (keep_start, or the deprecated keep_end from the left, which can cut into a completion).
Every truncated pair gets a record (`truncations`: reason, token counts before/after, messages and characters
dropped); the pair keeps its pair_id (the source pair), its token_hash is that of the truncated tokens. Pairs are
tokenized each on its own: a pair's row does not depend on the pairs beside it (only encode batches differ).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

import pyarrow as pa

from stages.data.limits import PROMPT_CUTTING, TokenizeLimits
from stages.data.pair_tokenizer import Branch, BranchRejected, NotTokenized, PairTokenizer
from stages.lib.contracts import TOKENS_SCHEMA, token_hash

ENCODE_BATCH_PAIRS = 1024

REJECTIONS_SCHEMA = pa.schema([
    ("split", pa.string()),
    ("pair_id", pa.string()),
    ("src_file", pa.string()),
    ("src_row", pa.int64()),
    ("reason", pa.string()),
    ("detail", pa.string()),
    ("prompt_tokens", pa.int32()),
    ("chosen_tokens", pa.int32()),
    ("rejected_tokens", pa.int32()),
])



@dataclass
class SplitResult:
    split: str
    rows: list[dict] = field(default_factory=list)
    rejections: list[dict] = field(default_factory=list)
    truncated: int = 0
    truncations: list[dict] = field(default_factory=list)  # one record per truncated pair, input order
    prompt_tokens_differ: int = 0
    pairs_in: int = 0


def _rejection(split: str, pair: dict, reason: str, detail: str, prompt_tokens=None,
               chosen_tokens=None, rejected_tokens=None) -> dict:
    return {"split": split, "pair_id": pair["pair_id"], "src_file": pair.get("src_file"),
            "src_row": pair.get("src_row"), "reason": reason, "detail": detail,
            "prompt_tokens": prompt_tokens, "chosen_tokens": chosen_tokens,
            "rejected_tokens": rejected_tokens}


def tokenize_pairs(pair_tokenizer: PairTokenizer, pairs: list[dict], limits: TokenizeLimits,
                   split: str) -> SplitResult:
    """Tokenize pairs (kept in input order); over-long or unfaithful pairs become rejections."""
    result = SplitResult(split=split, pairs_in=len(pairs))
    for lo in range(0, len(pairs), ENCODE_BATCH_PAIRS):
        batch = pairs[lo:lo + ENCODE_BATCH_PAIRS]
        rendered: list[tuple[str, str]] = []
        failed: dict[int, BranchRejected] = {}
        for i, pair in enumerate(batch):
            for side in ("chosen", "rejected"):
                try:
                    rendered.append(pair_tokenizer.render(pair["prompt"], pair[side]))
                except BranchRejected as e:
                    failed.setdefault(i, BranchRejected(e.reason, f"{side}: {e.detail}"))
                    rendered.append(("", ""))  # placeholder keeps positions; never used
        encoded = pair_tokenizer.encode(rendered, limits)
        for i, pair in enumerate(batch):
            if i in failed:
                result.rejections.append(_rejection(split, pair, failed[i].reason, failed[i].detail))
                continue
            branches = {"chosen": encoded[2 * i], "rejected": encoded[2 * i + 1]}
            bad = next(((s, b) for s, b in branches.items() if isinstance(b, BranchRejected)), None)
            if bad is not None:
                result.rejections.append(_rejection(split, pair, bad[1].reason, f"{bad[0]}: {bad[1].detail}"))
                continue
            row = _apply_limits(result, pair, branches["chosen"], branches["rejected"], limits,
                                pair_tokenizer)
            if row is not None:
                result.rows.append(row)
    return result


def _fits(branches: Iterable[Branch | NotTokenized], limits: TokenizeLimits) -> bool:
    return all(isinstance(b, Branch) and b.prompt_len <= limits.max_prompt_length and len(b.ids) <= limits.max_length
               for b in branches)


def _tokens(b: Branch | NotTokenized) -> int | None:
    """The branch's token count; None when it was not tokenized whole (bounded_text)."""
    return len(b.ids) if isinstance(b, Branch) and b.whole else None


def _prompt_tokens(*branches: Branch | NotTokenized) -> int | None:
    return None if any(isinstance(b, NotTokenized) for b in branches) else max(b.prompt_len for b in branches)


def _over(b: Branch | NotTokenized, limits: TokenizeLimits) -> tuple[bool, bool]:
    """(over max_prompt_length, over max_length) of an untruncated branch, also when it was not tokenized whole:
    a NotTokenized completion is over max_length, a NotTokenized prompt over max_prompt_length, and over
    max_length too when its characters prove that as well (more than max_length * R; always under keep_end, whose
    prompts are bounded by max_length)."""
    if isinstance(b, NotTokenized):
        chars_per_token = b.bound // b.tokens
        return b.part == "prompt", b.part == "completion" or b.chars > limits.max_length * chars_per_token
    return b.prompt_len > limits.max_prompt_length, not b.whole or len(b.ids) > limits.max_length


def _truncation_record(pair: dict, reason: str, before: tuple[Branch, Branch], after: tuple[Branch, Branch],
                       limits: TokenizeLimits, messages_dropped: int = 0, chars_dropped: int = 0) -> dict:
    (c0, r0), (c1, r1) = before, after
    over = [_over(c0, limits), _over(r0, limits)]
    exceeded = [name for k, name in enumerate(("max_prompt_length", "max_length")) if any(o[k] for o in over)]
    # Counts of what was not tokenized whole (bounded_text) are null: only its limits are known to be exceeded.
    return {"pair_id": pair["pair_id"], "reason": reason, "exceeded": exceeded,
            "prompt_tokens_before": _prompt_tokens(c0, r0),
            "prompt_tokens": max(c1.prompt_len, r1.prompt_len),
            "chosen_tokens_before": _tokens(c0), "chosen_tokens": len(c1.ids),
            "rejected_tokens_before": _tokens(r0), "rejected_tokens": len(r1.ids),
            "prompt_messages_dropped": messages_dropped, "prompt_chars_dropped": chars_dropped}


def _encode_prompts(pair_tokenizer: PairTokenizer, pair: dict, prompts: list[list[dict]],
                    limits: TokenizeLimits | None = None) -> list[tuple[Branch, Branch] | None]:
    """(chosen, rejected) branches of the pair with each candidate prompt; None where one cannot be tokenized.
    With `limits`, a candidate whose characters prove it over them is not tokenized (None, as one that does not
    fit: cut_prompt only keeps candidates that fit). keep_end bounds a candidate by its own bounds (max_length * R
    characters of prompt and of completion: what is over cannot fit); keep_end_then_completion by
    max_prompt_length * R characters of prompt, its completions cut before tokenizing as truncate_completion's."""
    rendered, ok = [], []
    for prompt in prompts:
        try:
            rendered += [pair_tokenizer.render(prompt, pair["chosen"]), pair_tokenizer.render(prompt, pair["rejected"])]
            ok.append(True)
        except BranchRejected:
            rendered += [("", ""), ("", "")]  # placeholders keep positions; never used
            ok.append(False)
    encoded = pair_tokenizer.encode(rendered, limits)
    out: list[tuple[Branch, Branch] | None] = []
    for k, good in enumerate(ok):
        c, r = encoded[2 * k], encoded[2 * k + 1]
        out.append((c, r) if good and isinstance(c, Branch) and isinstance(r, Branch) else None)
    return out


def _prompt_fits(branches: Iterable[Branch | NotTokenized], limits: TokenizeLimits) -> bool:
    return all(isinstance(b, Branch) and b.prompt_len <= limits.max_prompt_length for b in branches)


def cut_prompt(pair_tokenizer: PairTokenizer, pair: dict, chosen: Branch | NotTokenized,
               rejected: Branch | NotTokenized, limits: TokenizeLimits) -> tuple[Branch, Branch, dict] | tuple[str, str]:
    """Cut the prompt from the left (module docstring): keep_end until the whole pair fits both limits,
    keep_end_then_completion until the prompt fits max_prompt_length (its completions are cut after).

    Returns (chosen, rejected, truncation record), or (reason, detail) when nothing fits.
    """
    mode = limits.truncation
    fits = _fits if mode == "keep_end" else _prompt_fits
    prompt = list(pair["prompt"])
    head = 1 if prompt and prompt[0]["role"] == "system" else 0
    # Turn boundaries: the prompt may start at any later user turn (user/assistant keep alternating).
    starts = [j for j in range(head + 1, len(prompt)) if prompt[j]["role"] == "user"]
    candidates = [prompt[:head] + prompt[j:] for j in starts]
    for j, branches in zip(starts, _encode_prompts(pair_tokenizer, pair, candidates, limits)):
        if branches is not None and fits(branches, limits):
            return (*branches, _truncation_record(pair, "prompt_turns_dropped", (chosen, rejected), branches,
                                                  limits, messages_dropped=j - head))

    # No turn boundary fits: cut the last user turn's text from the left.
    last = prompt[-1]
    text = last["content"]
    dropped = len(prompt) - 1 - head

    def attempt(cut: int) -> tuple[Branch, Branch] | None:
        if not text[cut:].strip():
            return None
        message = {**last, "content": text[cut:]}
        [branches] = _encode_prompts(pair_tokenizer, pair, [prompt[:head] + [message]], limits)
        return branches if branches is not None and fits(branches, limits) else None

    # The last character alone is the least prompt this rule can keep; if even that does not fit, reject.
    smallest = max(i for i, ch in enumerate(text) if not ch.isspace()) if text.strip() else 0
    best = attempt(smallest)
    if best is None:
        [minimal] = _encode_prompts(pair_tokenizer, pair, [prompt[:head] + [{**last, "content": text[smallest:]}]],
                                    limits)
        completions = (None if isinstance(chosen, NotTokenized) or isinstance(rejected, NotTokenized) else
                       max(len(chosen.ids) - chosen.prompt_len, len(rejected.ids) - rejected.prompt_len))
        least_prompt = max(b.prompt_len for b in minimal) if minimal else None
        detail = (f"{mode} cannot fit the pair: the least prompt it can keep (the last turn's last character) "
                  f"is {least_prompt} tokens and the longer completion {completions} tokens, under "
                  f"max_prompt_length {limits.max_prompt_length} and max_length {limits.max_length}")
        if least_prompt is not None and least_prompt > limits.max_prompt_length:
            return "prompt_too_long", detail
        return "sequence_too_long", detail
    # Binary search for the smallest cut that fits: the candidate that keeps the most text (a longer
    # text never has fewer tokens here except by BPE accident; what is kept is always a verified fit).
    lo, hi = 0, smallest  # invariant: hi fits; cuts <= lo are known not to fit (0 = the whole turn)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        found = attempt(mid)
        if found is not None:
            hi, best = mid, found
        else:
            lo = mid
    cut = hi
    # Prefer a word start (a non-space character after a space) at or after the cut, if that still fits.
    word = re.compile(r"\s\S").search(text, cut)
    if cut > 0 and not text[cut - 1].isspace() and word is not None and word.start() + 1 <= smallest:
        at_word = attempt(word.start() + 1)
        if at_word is not None:
            cut, best = word.start() + 1, at_word
    return (*best, _truncation_record(pair, "prompt_text_cut", (chosen, rejected), best, limits,
                                      messages_dropped=dropped, chars_dropped=cut))


def keep_end_then_completion(pair_tokenizer: PairTokenizer, pair: dict, chosen: Branch | NotTokenized,
                             rejected: Branch | NotTokenized,
                             limits: TokenizeLimits) -> tuple[Branch, Branch, dict] | tuple[str, str]:
    """The prompt cut from the left to max_prompt_length (cut_prompt), then each branch cut to its first
    max_length tokens (module docstring). Returns (chosen, rejected, truncation record), or (reason, detail)."""
    c, r, prompt_cut = chosen, rejected, None
    if not _prompt_fits((c, r), limits):
        kept = cut_prompt(pair_tokenizer, pair, c, r, limits)
        if len(kept) == 2:
            return kept
        c, r, prompt_cut = kept
    if _fits((c, r), limits):
        reason = prompt_cut["reason"]
    else:  # prompt <= max_prompt_length < max_length: at least one completion token survives
        c, r = Branch(c.ids[:limits.max_length], c.prompt_len), Branch(r.ids[:limits.max_length], r.prompt_len)
        reason = "completion_cut" if prompt_cut is None else "prompt_and_completion_cut"
    dropped = {} if prompt_cut is None else {"messages_dropped": prompt_cut["prompt_messages_dropped"],
                                             "chars_dropped": prompt_cut["prompt_chars_dropped"]}
    return c, r, _truncation_record(pair, reason, (chosen, rejected), (c, r), limits, **dropped)


def _apply_limits(result: SplitResult, pair: dict, chosen: Branch | NotTokenized, rejected: Branch | NotTokenized,
                  limits: TokenizeLimits, pair_tokenizer: PairTokenizer | None = None) -> dict | None:
    prompt_tokens = _prompt_tokens(chosen, rejected)
    lengths = {"prompt_tokens": prompt_tokens, "chosen_tokens": _tokens(chosen), "rejected_tokens": _tokens(rejected)}
    # A branch not tokenized (bounded_text): its prompt or completion alone is over a limit, by characters. Only
    # the modes that cut prompts can still keep such a pair when it is the prompt that is over (shorter prompts are
    # tried): keep_end (its prompt over max_length * R characters), keep_end_then_completion (over
    # max_prompt_length * R; a completion it would cut is cut before tokenizing, so one left untokenized had no
    # exact cut).
    untokenized = sorted((b for b in (chosen, rejected) if isinstance(b, NotTokenized)), key=lambda b: b.part != "prompt")
    cuts_the_prompt = (untokenized and limits.truncation == "keep_end" and untokenized[0].part == "prompt") or (
        limits.truncation == "keep_end_then_completion" and all(b.part == "prompt" for b in untokenized))
    if untokenized and not cuts_the_prompt:
        over = untokenized[0]
        side = "chosen" if over is chosen else "rejected"
        result.rejections.append(_rejection(result.split, pair, "prompt_too_long" if over.part == "prompt"
                                            else "sequence_too_long", f"{side}: {over.detail}", **lengths))
        return None
    longest = None if untokenized else max(len(chosen.ids), len(rejected.ids))
    if limits.truncation in PROMPT_CUTTING and not _fits((chosen, rejected), limits):
        if pair_tokenizer is None:
            raise TypeError(f"{limits.truncation} truncation re-renders the pair: pass the PairTokenizer")
        cut = cut_prompt if limits.truncation == "keep_end" else keep_end_then_completion
        kept = cut(pair_tokenizer, pair, chosen, rejected, limits)
        if len(kept) == 2:
            result.rejections.append(_rejection(result.split, pair, kept[0], kept[1], **lengths))
            return None
        chosen, rejected, record = kept
        result.truncated += 1
        result.truncations.append(record)
    elif prompt_tokens > limits.max_prompt_length:
        result.rejections.append(_rejection(
            result.split, pair, "prompt_too_long",
            f"prompt has {prompt_tokens} tokens > max_prompt_length {limits.max_prompt_length}", **lengths))
        return None
    elif longest > limits.max_length:
        if limits.truncation == "reject":
            counts = " / ".join(f"{side} {len(b.ids)}{'' if b.whole else '+ (cut before tokenizing)'}"
                                for side, b in (("chosen", chosen), ("rejected", rejected)))
            result.rejections.append(_rejection(
                result.split, pair, "sequence_too_long",
                f"{counts} tokens; max_length {limits.max_length}", **lengths))
            return None
        # Prompt <= max_prompt_length < max_length, so at least one completion token survives.
        cut = (Branch(chosen.ids[:limits.max_length], chosen.prompt_len),
               Branch(rejected.ids[:limits.max_length], rejected.prompt_len))
        result.truncated += 1
        result.truncations.append(_truncation_record(pair, "completion_cut", (chosen, rejected), cut, limits))
        chosen, rejected = cut
    if chosen.ids[:chosen.prompt_len] != rejected.ids[:rejected.prompt_len]:
        result.prompt_tokens_differ += 1
    return {"pair_id": pair["pair_id"], "chosen_ids": chosen.ids, "chosen_prompt_len": chosen.prompt_len,
            "rejected_ids": rejected.ids, "rejected_prompt_len": rejected.prompt_len,
            "margin": pair.get("margin"),
            "token_hash": token_hash(chosen.ids, chosen.prompt_len, rejected.ids, rejected.prompt_len)}


def tokens_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=TOKENS_SCHEMA)


def rejections_table(rejections: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rejections, schema=REJECTIONS_SCHEMA)

