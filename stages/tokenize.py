"""tokenize: render preference pairs with the verified reference tokenizer; split prompt/completion on tokens.

    python -m stages.tokenize --params params.yaml --identity results/ref/ref_identity.json \
        --train results/probe/train.parquet --probe results/probe/probe.parquet \
        --probe-manifest results/probe/probe_manifest.json \
        --train-tokens results/tokens/train_tokens.parquet \
        --probe-tokens results/tokens/probe_tokens.parquet \
        --probe-token-manifest results/tokens/probe_token_manifest.json \
        --report results/tokens/tokenize_report.json \
        --rejections results/tokens/token_rejections.parquet --log logs/tokenize.log

Rendering (the same rule for chosen and rejected; each branch is rendered and tokenized whole):

* Chat template (the tokenizer has one):
      prompt_text = apply_chat_template(prompt, add_generation_prompt=True)
      full_text   = apply_chat_template(prompt + completion)
  full_text must start with prompt_text (else `template_not_prefix`), and every completion message's
  (stripped) content must appear, in order, after it (else `template_drops_completion`). Encoded
  without the tokenizer's own special tokens: the template already spells BOS etc.
* Plain (no template): role-tagged turns joined by a blank line,
      prompt_text = "User: q1\\n\\nAssistant: a1\\n\\nUser: q2\\n\\nAssistant:"
      full_text   = "User: q1\\n\\nAssistant: a1\\n\\nUser: q2\\n\\nAssistant: answer<EOS>"
  (tags: System, User, Assistant; "Assistant:" ends the prompt, so the space before the answer is
  the completion's first character and byte-level BPE keeps it in the answer's first token).
  Encoded with the tokenizer's own special tokens (a BOS where its post-processor adds one).
* Stop signal: when the completion part of full_text, right-stripped, does not already end with the
  EOS or another special token (a template's end-of-turn such as <|im_end|>), the EOS text is
  appended, so the completion always ends with a token that teaches the model to stop.
* Message content containing a special-token string is rejected (`special_token_in_content`): the
  tokenizer would turn it into a control token and the pair would no longer say what it says.

Boundary: full_text is encoded once, with character offsets; the completion starts at the first
token whose start offset is >= len(prompt_text). A token that straddles that position (starts
before it, ends after it) would either score prompt characters as completion or drop completion
characters from the score, so such a pair is rejected (`boundary_straddles_token`) rather than
guessed. Offsets are taken with offset trimming off, so a trimmed leading space cannot hide a straddle.

Truncation (params `tokenize`), for a pair whose prompt has more than max_prompt_length tokens or
whose longer branch has more than max_length:
* `reject`: `prompt_too_long` (the prompt is over) or else `sequence_too_long`.
* `truncate_completion`: an over-long prompt is still `prompt_too_long`; otherwise the completions
  are cut to fit max_length (the cut completion then has no EOS: it did not end there). Reason
  `completion_cut`.
* `keep_end` (TRL's truncation_mode="keep_end", at turn boundaries): the completions stay whole and
  the prompt loses its oldest turns. The pair is re-rendered (and re-tokenized) with the prompt
  `[system?] + prompt[j:]` for the first user turn j that makes both branches fit both limits
  (reason `prompt_turns_dropped`; a leading system message is kept). When even the last user turn
  alone does not fit, that turn's text is cut from the left by as few characters as fit (bisection
  over the cut, each candidate re-tokenized and checked), moved on to the next word start where that
  still fits (reason `prompt_text_cut`). A pair that
  cannot fit even so (the completions leave no room, or the fixed part of the prompt is over
  max_prompt_length) is rejected as `sequence_too_long` / `prompt_too_long`.
Every truncated pair is counted per reason in the report (`truncated_by_reason`); each truncated
probe pair is recorded in the probe token manifest (`truncated`: index, pair_id, reason, token counts
before/after, messages and characters dropped, and the token hash of what is scored). The pair keeps
its pair_id (the source pair); its token_hash is that of the truncated tokens.
The probe must come through whole: any probe pair that would be rejected fails the stage.

Cost bound (bounded_text): a text of more than n * R characters has more than n tokens, R proven from the
tokenizer (max_chars_per_token: its longest token, times 4 under NFC; 128 for GPT-2), so a branch whose
prompt or completion alone is over a limit by characters is not tokenized whole: `reject` and
`truncate_completion` tokenize it up to a space past max_length * R characters (the tokens before such a cut
are the whole text's: cuts_at_spaces), keep_end (and `reject` for a prompt) not at all. Reasons are those of
tokenizing everything; counts not known are null (token_rejections.parquet, the `_before` counts of a
truncation record). Without a proven R (another normalizer or model) texts are tokenized whole.

Scale (run_streaming): train pairs are read in chunks (at most --chunk-pairs) and rendered + tokenized by
up to `tokenize.workers` forked processes (0 = every core in the CPU affinity), written in input order as they
come back; the probe is tokenized in pieces by the same pool. The pool is sized to the input (plan_pool: no
more processes than chunks, none for a small input); the outputs are the same bytes for any worker count and
chunk size. The workers die with the stage (die_with_parent: a killed tokenize leaves none behind).
"""
from __future__ import annotations

import json
import logging
import os
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import pyarrow as pa

from stages.lib.contracts import (PROBE_MANIFEST_SCHEMA, TOKENIZER_FILES, TOKENS_SCHEMA, ContractError, check_shape,
                                  content_hash_problem, pair_id_problem, pair_problems, probe_digest,
                                  row_content_hash, token_digest, token_hash)
from stages.lib.cli import stage_main
from stages.lib.io import (ParquetStreamWriter, canonical_json, display_path, iter_parquet_batches, open_parquet,
                           read_json, read_parquet, sha256_file, sha256_json, write_json, write_parquet)
from stages.lib.params import ParamsError, load_params

TRUNCATION_POLICIES = ("reject", "truncate_completion", "keep_end")
# How a kept pair was cut (probe token manifest `truncated[].reason`, report `truncated_by_reason`).
TRUNCATION_REASONS = ("completion_cut", "prompt_turns_dropped", "prompt_text_cut")
PLAIN_ROLE_TAGS = {"system": "System", "user": "User", "assistant": "Assistant"}
PLAIN_TURN_SEPARATOR = "\n\n"
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


class TokenizeError(ValueError):
    """The stage cannot produce a correct output; the message names the file / pairs and the reason."""


class BranchRejected(Exception):
    """One branch of a pair cannot be tokenized faithfully; `reason` is a stable code."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# ---------------------------------------------------------------------------------------------
# Limits
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenizeLimits:
    max_length: int
    max_prompt_length: int
    truncation: str

    @classmethod
    def from_params(cls, tok_params: dict) -> "TokenizeLimits":
        limits = cls(int(tok_params["max_length"]), int(tok_params["max_prompt_length"]),
                     str(tok_params["truncation"]))
        if limits.truncation not in TRUNCATION_POLICIES:
            raise TokenizeError(f"tokenize.truncation must be one of {TRUNCATION_POLICIES}, "
                                f"got {limits.truncation!r}")
        # A prompt of max_prompt_length must leave room for at least one completion token.
        if not 1 <= limits.max_prompt_length < limits.max_length:
            raise TokenizeError(f"tokenize.max_prompt_length ({limits.max_prompt_length}) must be "
                                f">= 1 and < tokenize.max_length ({limits.max_length})")
        return limits

    def as_dict(self) -> dict:
        return {"max_length": self.max_length, "max_prompt_length": self.max_prompt_length,
                "truncation": self.truncation}


# ---------------------------------------------------------------------------------------------
# Tokenizer loading and identity
# ---------------------------------------------------------------------------------------------

def tokenizer_identity(tokenizer_dir: str | Path) -> str:
    """sha256 over (name, size, sha256) of every tokenizer file present in the directory."""
    tokenizer_dir = Path(tokenizer_dir)
    files = [[name, (tokenizer_dir / name).stat().st_size, sha256_file(tokenizer_dir / name)]
             for name in sorted(TOKENIZER_FILES) if (tokenizer_dir / name).is_file()]
    if not files:
        raise TokenizeError(f"{tokenizer_dir}: no tokenizer files (looked for {', '.join(TOKENIZER_FILES)})")
    return sha256_json(files)


def load_tokenizer(tokenizer_dir: str | Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if not getattr(tokenizer, "is_fast", False):
        raise TokenizeError(f"{tokenizer_dir}: tokenizer {type(tokenizer).__name__} is not a fast "
                            "(tokenizers-backed) tokenizer; character offsets are needed for the "
                            "prompt/completion boundary")
    return tokenizer


def _sets_trim_offsets(node: Any) -> bool:
    if isinstance(node, dict):
        return node.get("trim_offsets") is True or any(_sets_trim_offsets(v) for v in node.values())
    if isinstance(node, list):
        return any(_sets_trim_offsets(v) for v in node)
    return False


def _untrimmed_backend(tokenizer):
    """The tokenizer's Rust backend with offsets never trimmed, no truncation and no padding.

    Trimming (ByteLevel / RoBERTa post-processors) moves a token's start past its leading space,
    which would make a token straddling the boundary look as if it started on it. Ids are unchanged.
    A backend that already is so (GPT-2's TemplateProcessing post-processor, for one) is returned itself
    (never modified here); otherwise a copy: a JSON round trip of the whole backend, vocabulary included,
    ~0.4 s for GPT-2's, so it is made only when something must change.
    """
    from tokenizers import Tokenizer

    backend = tokenizer.backend_tokenizer
    post = backend.post_processor
    # __getstate__: the post-processor's own JSON (what pickling it writes), without serializing the vocabulary.
    trims = post is not None and _sets_trim_offsets(json.loads(post.__getstate__()))
    if not trims and backend.truncation is None and backend.padding is None:
        return backend
    spec = json.loads(backend.to_str())

    def untrim(node: Any) -> None:
        if isinstance(node, dict):
            if "trim_offsets" in node:
                node["trim_offsets"] = False
            for value in node.values():
                untrim(value)
        elif isinstance(node, list):
            for value in node:
                untrim(value)

    untrim(spec.get("post_processor"))
    copy = Tokenizer.from_str(json.dumps(spec))
    copy.no_truncation()
    copy.no_padding()
    copy.encode_special_tokens = backend.encode_special_tokens
    return copy


def _chat_template_text(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template or None


def _special_token_strings(tokenizer) -> list[str]:
    specials = set(tokenizer.all_special_tokens)
    specials.update(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)
    return sorted(s for s in specials if s)


# ---------------------------------------------------------------------------------------------
# Rendering: one branch (prompt + one completion) -> (prompt_text, full_text)
# ---------------------------------------------------------------------------------------------

def render_plain(prompt: list[dict], completion: list[dict]) -> tuple[str, str]:
    """Role-tagged turns; the prompt ends with "Assistant:" (see module docstring). No EOS here."""
    def turns(messages: list[dict]) -> list[str]:
        return [f"{PLAIN_ROLE_TAGS[m['role']]}: {m['content']}" for m in messages]

    prompt_text = PLAIN_TURN_SEPARATOR.join(turns(prompt) + ["Assistant:"])
    full_text = PLAIN_TURN_SEPARATOR.join(turns(prompt + completion))
    return prompt_text, full_text


def chat_template_renderer(tokenizer):
    """render(messages, add_generation_prompt) -> text: exactly tokenizer.apply_chat_template(messages,
    add_generation_prompt=..., tokenize=False), without its per-call overhead (argument handling,
    template lookup), which was most of tokenize's rendering time. Same steps as apply_chat_template:
    messages normalized (None-valued keys dropped), the template rendered by transformers' own
    sandboxed Jinja with the special tokens as template variables. Needs only
    transformers.utils.chat_template_utils (no torch), so forked workers render with it too."""
    from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

    template = _chat_template_text(tokenizer)
    variables = dict(tokenizer.special_tokens_map)

    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        rendered, _ = render_jinja_template(
            conversations=[_normalize_chat_messages(messages)], tools=None, documents=None,
            chat_template=template, return_assistant_tokens_mask=False, continue_final_message=False,
            add_generation_prompt=add_generation_prompt, **variables)
        return rendered[0]

    return render


def render_chat(render, prompt: list[dict], completion: list[dict]) -> tuple[str, str]:
    """`render` from chat_template_renderer (or a tokenizer: its apply_chat_template is used)."""
    if hasattr(render, "apply_chat_template"):  # a tokenizer (itself callable: test the method, not callable())
        tokenizer = render
        render = lambda messages, add_generation_prompt: tokenizer.apply_chat_template(  # noqa: E731
            messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    try:
        prompt_text = render(prompt, True)
        full_text = render(prompt + completion, False)
    except Exception as e:  # a template may refuse a role order (raise_exception in Jinja)
        raise BranchRejected("template_error", f"{type(e).__name__}: {e}") from e
    if not full_text.startswith(prompt_text):
        at = next((i for i, (a, b) in enumerate(zip(prompt_text, full_text)) if a != b),
                  min(len(prompt_text), len(full_text)))
        raise BranchRejected("template_not_prefix",
                             f"rendered prompt is not a prefix of the rendered conversation; they "
                             f"differ at character {at}: prompt {prompt_text[at:at + 40]!r} vs "
                             f"full {full_text[at:at + 40]!r}")
    tail, pos = full_text[len(prompt_text):], 0
    for m in completion:
        found = tail.find(m["content"].strip(), pos)
        if found < 0:
            raise BranchRejected("template_drops_completion",
                                 f"completion content {m['content'][:60]!r} does not appear in the "
                                 "rendered completion")
        pos = found + len(m["content"].strip())
    return prompt_text, full_text


# ---------------------------------------------------------------------------------------------
# Boundary on tokens of the full rendering
# ---------------------------------------------------------------------------------------------

def completion_start(offsets: list[tuple[int, int]], prompt_chars: int) -> int:
    """Index of the first token starting at/after `prompt_chars`; tokens before it are the prompt.

    Zero-width special tokens a post-processor adds (BOS at (0, 0)) fall on the prompt side.
    A token with start < prompt_chars < end straddles the boundary: BranchRejected.
    """
    for i, (start, end) in enumerate(offsets):
        if start >= prompt_chars:
            return i
        if end > prompt_chars:
            raise BranchRejected("boundary_straddles_token",
                                 f"token {i} spans characters [{start}, {end}) across the prompt "
                                 f"end at {prompt_chars}")
    return len(offsets)


@dataclass
class Branch:
    ids: list[int]
    prompt_len: int
    # False: `ids` are the first tokens of the branch only: its text was cut before tokenizing, at a place where
    # the tokens before the cut are the whole text's (bounded_text), so the branch has more than max_length.
    whole: bool = True


# ---------------------------------------------------------------------------------------------
# Bounded cost: a text's characters bound its token count from below, so a row too long to fit is known to be
# too long before it is tokenized (a 50 MB row took 4 minutes and 12 GB to tokenize, only to be rejected).
# ---------------------------------------------------------------------------------------------

# NFC composes at most this many characters into one: the longest canonical decomposition of any code point
# (U+1F82 and the like; tests/test_tokenize.py recomputes it from unicodedata). len(NFD(x)) == sum of
# len(NFD(c)) over NFC(x)'s characters <= 4 * len(NFC(x)), and NFD never shortens: len(x) <= 4 * len(NFC(x)).
NFC_MAX_COMPOSED = 4
# Pre-tokenizer regexes after which a cut is exact (bounded_text); GPT-2's is ByteLevel's own (use_regex).
# Qwen2 (and the embedded reference), Llama-3:
SPACE_CUT_SPLIT_PATTERNS = frozenset({
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
})
# A space between two letters/digits (Python's [^\W_]: Unicode L* and N*, never whitespace in any regex engine).
_SPACE_CUT = re.compile(r"(?<=[^\W_]) (?=[^\W_])")


def _state(component) -> Any:
    """A tokenizers component's own JSON (what pickling it writes), without serializing the vocabulary."""
    return None if component is None else json.loads(component.__getstate__())


def _nfc_factor(normalizer: Any) -> int | None:
    """Original characters per normalized character, at most: 1 without a normalizer, NFC_MAX_COMPOSED under NFC
    (alone or in a Sequence); None for any other normalizer (it may delete characters: no bound is proven)."""
    if normalizer is None:
        return 1
    parts = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
    return NFC_MAX_COMPOSED if parts and all(p.get("type") == "NFC" for p in parts) else None


def max_chars_per_token(backend) -> int | None:
    """R such that a text of more than n * R characters has more than n tokens under `backend` (a
    tokenizers.Tokenizer), or None when that is not provable from its parts (texts are then tokenized whole).

    Proven for byte-level BPE (GPT-2, Llama-3, Qwen2): its tokens spell the UTF-8 bytes of the normalized text,
    none dropped (every byte of the byte-level alphabet is in the vocabulary, so no byte is left without a token);
    a vocabulary token spells at most as many bytes as it has characters (one character per byte in that
    alphabet), an added token matches its own content; a character is at least one byte. So tokens >=
    normalized characters / L, L the longest vocabulary entry, and normalized characters >= characters / the
    normalizer's factor (_nfc_factor). R = L * factor: 128 for GPT-2 (its longest token is 128 bytes)."""
    from tokenizers import models, pre_tokenizers

    model = backend.model
    if not isinstance(model, models.BPE) or model.dropout not in (None, 0.0):
        return None
    if '"ByteLevel"' not in json.dumps(_state(backend.pre_tokenizer)):
        return None
    factor = _nfc_factor(_state(backend.normalizer))
    vocab = backend.get_vocab(with_added_tokens=True)
    if factor is None or not all(ch in vocab for ch in pre_tokenizers.ByteLevel.alphabet()):
        return None
    return factor * max(len(token) for token in vocab)


def cuts_at_spaces(backend) -> bool:
    """Whether cutting a text just before a space that stands between two letters/digits (_SPACE_CUT) leaves
    every token before the cut as it is in the whole text. True for GPT-2's ByteLevel regex and the Split
    patterns of SPACE_CUT_SPLIT_PATTERNS (then ByteLevel without regex), with no normalizer or NFC: no
    alternative of those regexes matches across such a space from the left (letter, number and punctuation runs
    exclude whitespace; a whitespace run cannot start before it, the character before is no space; an optional
    leading character starts a match), runs ending before it look at most at it, so the pre-tokens before it are
    those of the whole text, and BPE encodes each pre-token alone. NFC does not compose across a space; no added
    token holds a space, so none spans the cut."""
    if max_chars_per_token(backend) is None:
        return False
    pre = _state(backend.pre_tokenizer)
    if pre.get("type") == "ByteLevel":
        proven = pre.get("use_regex", True)
    else:
        parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
        proven = (len(parts) == 2 and parts[0].get("type") == "Split" and parts[0].get("behavior") == "Isolated"
                  and not parts[0].get("invert") and parts[0].get("pattern", {}).get("Regex") in SPACE_CUT_SPLIT_PATTERNS
                  and parts[1].get("type") == "ByteLevel" and not parts[1].get("use_regex", True))
    return bool(proven) and not any(" " in t.content for t in backend.get_added_tokens_decoder().values())


@dataclass(frozen=True)
class NotTokenized:
    """A branch left untokenized: its characters alone prove it over a limit."""
    part: str       # "prompt": the rendered prompt is over `bound` characters; "completion": the rest of the text is
    chars: int
    bound: int      # the most characters that part can have and be within `limit` tokens
    limit: str      # "max_prompt_length" | "max_length"
    tokens: int     # that limit's value
    why_uncut: str = ""  # a completion a truncation policy would cut: why no exact cut was made

    @property
    def detail(self) -> str:
        return (f"not tokenized: its {self.part} has {self.chars} characters, more than {self.limit} {self.tokens} "
                f"tokens can hold ({self.bound} characters: the tokenizer's longest token is "
                f"{self.bound // self.tokens} characters)" + (f"; {self.why_uncut}" if self.why_uncut else ""))


def bounded_text(prompt_chars: int, text: str, limits: TokenizeLimits, chars_per_token: int | None,
                 space_cuts: bool) -> int | NotTokenized:
    """How much of a rendered branch (`text`, its first `prompt_chars` characters the prompt) to tokenize: all
    of it (len(text)), a prefix, or nothing (NotTokenized). The cost of a row is bounded before tokenization:
    what is tokenized is at most about (max_prompt_length + 2 * max_length) * chars_per_token characters.

    * The prompt is over max_prompt_length * R characters (keep_end: max_length * R, so both limits are known to
      be exceeded): its tokens exceed that limit; not tokenized (keep_end tries shorter prompts without it).
    * The completion is over max_length * R characters: the branch is over max_length whatever the prompt.
      keep_end keeps completions whole: not tokenized (rejected). reject / truncate_completion: the text is cut
      at the first space between two letters/digits past max_length * R (and within another max_length * R),
      dropping its end, the side truncation drops; the tokens before such a cut are the whole text's
      (cuts_at_spaces), and there are more than max_length of them, so the prompt's tokens and the first
      max_length tokens, all that is scored or counted, are exact. No such space, or no proven cut: not tokenized.
    """
    if chars_per_token is None:
        return len(text)
    keep_end = limits.truncation == "keep_end"
    limit, tokens = ("max_length", limits.max_length) if keep_end else ("max_prompt_length", limits.max_prompt_length)
    if prompt_chars > tokens * chars_per_token:
        return NotTokenized("prompt", prompt_chars, tokens * chars_per_token, limit, tokens)
    bound = limits.max_length * chars_per_token
    completion = len(text) - prompt_chars
    if completion <= bound:
        return len(text)
    over = NotTokenized("completion", completion, bound, "max_length", limits.max_length)
    if keep_end:
        return over
    if not space_cuts:
        return replace(over, why_uncut="no exact cut is proven for this tokenizer's pre-tokenizer")
    # A cut past `bound` characters leaves more than max_length tokens before it; the prompt ends before it.
    cut = _SPACE_CUT.search(text, bound + 1, 2 * bound + 2)
    if cut is None:
        return replace(over, why_uncut=f"no space between two letters/digits in its characters {bound + 1} to "
                                       f"{2 * bound} to cut it at exactly")
    return cut.start()


class PairTokenizer:
    """Renders and encodes branches with one tokenizer; holds the pieces that are fixed per tokenizer."""

    def __init__(self, tokenizer, bound_chars: bool = True):
        """bound_chars=False: every text is tokenized whole (the reference bounded_text's cuts are tested against)."""
        self.tokenizer = tokenizer
        template = _chat_template_text(tokenizer)
        self.uses_chat_template = template is not None
        if self.uses_chat_template and "add_generation_prompt" not in template:
            # Without a generation prompt the assistant header would land in the completion and be scored.
            raise TokenizeError("the tokenizer's chat template ignores add_generation_prompt, so the "
                                "prompt/completion boundary cannot be placed after the assistant header")
        self.backend = _untrimmed_backend(tokenizer)
        self.chars_per_token = max_chars_per_token(self.backend) if bound_chars else None
        self.space_cuts = self.chars_per_token is not None and cuts_at_spaces(self.backend)
        self.eos_token = tokenizer.eos_token
        self.specials = _special_token_strings(tokenizer)
        self._special_re = re.compile("|".join(map(re.escape, self.specials))) if self.specials else None
        self.add_special_tokens = not self.uses_chat_template
        self._render_template = chat_template_renderer(tokenizer) if self.uses_chat_template else None

    @property
    def rendering(self) -> str:
        return "chat_template" if self.uses_chat_template else "plain"

    def render(self, prompt: list[dict], completion: list[dict]) -> tuple[str, str]:
        if self._special_re is not None:
            for m in prompt + completion:
                hit = self._special_re.search(m["content"])
                if hit:
                    raise BranchRejected("special_token_in_content",
                                         f"{m['role']} message contains the special token {hit.group()!r}")
        if self.uses_chat_template:
            prompt_text, full_text = render_chat(self._render_template, prompt, completion)
        else:
            prompt_text, full_text = render_plain(prompt, completion)
        tail = full_text[len(prompt_text):].rstrip()
        if not any(tail.endswith(s) for s in self.specials):
            if not self.eos_token:
                raise TokenizeError("the tokenizer has no EOS token and its rendering has no "
                                    "end-of-turn token: a completion could not teach the model to stop")
            full_text += self.eos_token
        return prompt_text, full_text

    def encode(self, rendered: list[tuple[str, str]],
               limits: TokenizeLimits | None = None) -> list[Branch | BranchRejected | NotTokenized]:
        """Encode full renderings in one batch; split each at its prompt's character length. With `limits`, each
        text is first bounded (bounded_text): a prefix of it, or nothing (NotTokenized) when its characters
        already prove it over a limit."""
        spans = [len(full) if limits is None else
                 bounded_text(len(prompt_text), full, limits, self.chars_per_token, self.space_cuts)
                 for prompt_text, full in rendered]
        todo = [k for k, span in enumerate(spans) if not isinstance(span, NotTokenized)]
        encodings = self.backend.encode_batch([rendered[k][1][:spans[k]] for k in todo],
                                              add_special_tokens=self.add_special_tokens)
        out: list[Branch | BranchRejected | NotTokenized] = list(spans)
        for k, enc in zip(todo, encodings):
            prompt_text, full = rendered[k]
            try:
                start = completion_start(enc.offsets, len(prompt_text))
                if start == len(enc.ids):
                    raise BranchRejected("empty_completion_tokens", "no token after the prompt")
                out[k] = Branch(list(enc.ids), start, whole=spans[k] == len(full))
            except BranchRejected as e:
                out[k] = e
        return out


# ---------------------------------------------------------------------------------------------
# Pairs -> token rows
# ---------------------------------------------------------------------------------------------

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
    """(over max_prompt_length, over max_length) of an untruncated branch, also when it was not tokenized whole
    (a NotTokenized prompt that reaches a truncation record is keep_end's: over max_length * R characters)."""
    if isinstance(b, NotTokenized):
        return b.part == "prompt", True
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
    fit: keep_end's callers only keep candidates that fit)."""
    rendered, ok = [], []
    for prompt in prompts:
        try:
            rendered += [pair_tokenizer.render(prompt, pair["chosen"]), pair_tokenizer.render(prompt, pair["rejected"])]
            ok.append(True)
        except BranchRejected:
            rendered += [("", ""), ("", "")]  # placeholders keep positions; never used
            ok.append(False)
    if limits is not None:
        # A candidate within keep_end's own bounds (max_length * R characters of prompt and of completion) is
        # tokenized whole; one over them cannot fit, so it is not tokenized at all.
        limits = replace(limits, truncation="keep_end")
    encoded = pair_tokenizer.encode(rendered, limits)
    out: list[tuple[Branch, Branch] | None] = []
    for k, good in enumerate(ok):
        c, r = encoded[2 * k], encoded[2 * k + 1]
        out.append((c, r) if good and isinstance(c, Branch) and isinstance(r, Branch) else None)
    return out


def keep_end(pair_tokenizer: PairTokenizer, pair: dict, chosen: Branch, rejected: Branch,
             limits: TokenizeLimits) -> tuple[Branch, Branch, dict] | tuple[str, str]:
    """Cut the prompt from the left so the pair fits (module docstring, `keep_end`).

    Returns (chosen, rejected, truncation record), or (reason, detail) when nothing fits.
    """
    prompt = list(pair["prompt"])
    head = 1 if prompt and prompt[0]["role"] == "system" else 0
    # Turn boundaries: the prompt may start at any later user turn (user/assistant keep alternating).
    starts = [j for j in range(head + 1, len(prompt)) if prompt[j]["role"] == "user"]
    candidates = [prompt[:head] + prompt[j:] for j in starts]
    for j, branches in zip(starts, _encode_prompts(pair_tokenizer, pair, candidates, limits)):
        if branches is not None and _fits(branches, limits):
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
        return branches if branches is not None and _fits(branches, limits) else None

    # The last character alone is the least prompt this rule can keep; if even that does not fit, reject.
    smallest = max(i for i, ch in enumerate(text) if not ch.isspace()) if text.strip() else 0
    best = attempt(smallest)
    if best is None:
        [minimal] = _encode_prompts(pair_tokenizer, pair, [prompt[:head] + [{**last, "content": text[smallest:]}]],
                                    limits)
        completions = (None if isinstance(chosen, NotTokenized) or isinstance(rejected, NotTokenized) else
                       max(len(chosen.ids) - chosen.prompt_len, len(rejected.ids) - rejected.prompt_len))
        least_prompt = max(b.prompt_len for b in minimal) if minimal else None
        detail = (f"keep_end cannot fit the pair: the least prompt it can keep (the last turn's last character) "
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


def _apply_limits(result: SplitResult, pair: dict, chosen: Branch | NotTokenized, rejected: Branch | NotTokenized,
                  limits: TokenizeLimits, pair_tokenizer: PairTokenizer | None = None) -> dict | None:
    prompt_tokens = _prompt_tokens(chosen, rejected)
    lengths = {"prompt_tokens": prompt_tokens, "chosen_tokens": _tokens(chosen), "rejected_tokens": _tokens(rejected)}
    # A branch not tokenized (bounded_text): its prompt or completion alone is over a limit, by characters. Only
    # keep_end can still keep such a pair (its prompt over max_length * R characters: shorter prompts are tried).
    untokenized = sorted((b for b in (chosen, rejected) if isinstance(b, NotTokenized)), key=lambda b: b.part != "prompt")
    if untokenized and not (limits.truncation == "keep_end" and untokenized[0].part == "prompt"):
        over = untokenized[0]
        side = "chosen" if over is chosen else "rejected"
        result.rejections.append(_rejection(result.split, pair, "prompt_too_long" if over.part == "prompt"
                                            else "sequence_too_long", f"{side}: {over.detail}", **lengths))
        return None
    longest = None if untokenized else max(len(chosen.ids), len(rejected.ids))
    if limits.truncation == "keep_end" and not _fits((chosen, rejected), limits):
        if pair_tokenizer is None:
            raise TypeError("keep_end truncation re-renders the pair: pass the PairTokenizer")
        kept = keep_end(pair_tokenizer, pair, chosen, rejected, limits)
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


# ---------------------------------------------------------------------------------------------
# Input integrity: pairs are what freeze_probe wrote, the probe is the frozen probe
# ---------------------------------------------------------------------------------------------

def check_pairs(pairs: list[dict], path: str) -> None:
    """Every pair's content still hashes to its content_hash / pair_id, and pair IDs are unique."""
    problems = pair_problems(pairs)
    if problems:
        raise TokenizeError(f"{path}: {len(problems)} pair(s) do not match their recorded hashes "
                            f"(edited after normalize?):\n  " + "\n  ".join(problems[:20]))


def check_probe_matches_manifest(probe_pairs: list[dict], manifest: dict, probe_path: str,
                                 manifest_path: str) -> None:
    ids = [p["pair_id"] for p in probe_pairs]
    want = list(manifest["pair_ids"])
    if ids != want:
        diffs = [f"index {i}: manifest {w} / parquet {g}"
                 for i, (w, g) in enumerate(zip(want, ids)) if w != g][:10]
        raise TokenizeError(f"{probe_path} does not hold the probe of {manifest_path}: "
                            f"{len(ids)} pairs vs {len(want)} in the manifest; "
                            f"{len(set(want) - set(ids))} manifest IDs missing, "
                            f"{len(set(ids) - set(want))} extra; first order differences: {diffs}")
    hashes = [p["content_hash"] for p in probe_pairs]
    if hashes != list(manifest["content_hashes"]):
        bad = [ids[i] for i, (a, b) in enumerate(zip(hashes, manifest["content_hashes"])) if a != b]
        raise TokenizeError(f"{probe_path}: content hashes differ from {manifest_path} for pairs {bad[:10]}")
    digest = probe_digest(ids, hashes)
    if digest != manifest["probe_digest"]:
        raise TokenizeError(f"{probe_path}: probe digest {digest} != {manifest_path} probe_digest "
                            f"{manifest['probe_digest']}")


def check_probe_complete(result: SplitResult, limits: TokenizeLimits) -> None:
    if result.rejections:
        listed = "\n  ".join(f"{r['pair_id']} ({r['reason']}: {r['detail']})" for r in result.rejections)
        raise TokenizeError(
            f"{len(result.rejections)} of {result.pairs_in} probe pairs cannot be tokenized under "
            f"max_length={limits.max_length}, max_prompt_length={limits.max_prompt_length}, "
            f"truncation={limits.truncation}; the frozen probe must be scored whole, so raise the "
            f"limits (or re-freeze a probe from data that fits):\n  {listed}")


# ---------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------

def tokens_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=TOKENS_SCHEMA)


def rejections_table(rejections: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rejections, schema=REJECTIONS_SCHEMA)


def probe_token_manifest(probe_rows: list[dict], probe_digest: str, tok_identity: str,
                         truncations: list[dict] = (), limits: TokenizeLimits | None = None) -> dict:
    """The tokenize record evaluate checks. `truncated` lists every truncated probe pair, in probe
    order, with its index and the token_hash of the (truncated) tokens that are scored."""
    pair_ids = [r["pair_id"] for r in probe_rows]
    hashes = [r["token_hash"] for r in probe_rows]
    index = {pid: i for i, pid in enumerate(pair_ids)}
    truncated = sorted(({"index": index[t["pair_id"]], **t, "token_hash": hashes[index[t["pair_id"]]]}
                        for t in truncations), key=lambda t: t["index"])
    manifest = {"pair_ids": pair_ids, "token_hashes": hashes,
                "token_digest": token_digest(pair_ids, hashes),
                "probe_digest": probe_digest, "tokenizer_identity": tok_identity}
    if limits is not None:
        manifest["limits"] = limits.as_dict()
    manifest["truncated"] = truncated
    return manifest


_token_manifest = probe_token_manifest  # run_streaming's keyword argument of that name is the output path


def _length_stats(values: Iterable[int] | np.ndarray) -> dict:
    a = values.astype(np.int64) if isinstance(values, np.ndarray) else np.asarray(list(values), dtype=np.int64)
    if a.size == 0:
        return {"count": 0}
    return {"count": int(a.size), "min": int(a.min()), "max": int(a.max()), "sum": int(a.sum()),
            "mean": round(float(a.mean()), 4), "p50": round(float(np.percentile(a, 50)), 4),
            "p95": round(float(np.percentile(a, 95)), 4)}


LENGTH_KEYS = ("prompt", "chosen", "rejected", "chosen_completion", "rejected_completion")


def row_lengths(rows: list[dict]) -> dict[str, np.ndarray]:
    """The per-row token counts the report summarises (LENGTH_KEYS), as compact arrays."""
    c = np.fromiter((len(r["chosen_ids"]) for r in rows), np.int64, len(rows))
    r_ = np.fromiter((len(r["rejected_ids"]) for r in rows), np.int64, len(rows))
    cp = np.fromiter((r["chosen_prompt_len"] for r in rows), np.int64, len(rows))
    rp = np.fromiter((r["rejected_prompt_len"] for r in rows), np.int64, len(rows))
    return {"prompt": cp, "chosen": c, "rejected": r_, "chosen_completion": c - cp, "rejected_completion": r_ - rp}


def split_report(result: SplitResult) -> dict:
    reasons: dict[str, int] = {}
    for r in result.rejections:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    truncated = {reason: sum(t["reason"] == reason for t in result.truncations) for reason in TRUNCATION_REASONS}
    return _split_report(result.pairs_in, len(result.rows), reasons, result.truncated, truncated,
                         result.prompt_tokens_differ, row_lengths(result.rows))


def _split_report(pairs_in: int, pairs_out: int, reasons: dict[str, int], truncated: int,
                  truncated_by_reason: dict[str, int], prompt_tokens_differ: int,
                  lengths: dict[str, np.ndarray]) -> dict:
    return {
        "pairs_in": pairs_in, "pairs_out": pairs_out, "rejected": sum(reasons.values()),
        "rejected_by_reason": dict(sorted(reasons.items())), "truncated": truncated,
        "truncated_by_reason": truncated_by_reason,
        "prompt_tokens_differ": prompt_tokens_differ,
        "lengths": {k: _length_stats(lengths[k]) for k in LENGTH_KEYS},
    }


def tokenize_report(results: list[SplitResult], limits: TokenizeLimits, rendering: str,
                    tok_identity: str) -> dict:
    return _tokenize_report({r.split: split_report(r) for r in results}, limits, rendering, tok_identity)


def _tokenize_report(splits: dict[str, dict], limits: TokenizeLimits, rendering: str, tok_identity: str) -> dict:
    reasons: dict[str, int] = {}
    for s in splits.values():
        for k, v in s["rejected_by_reason"].items():
            reasons[k] = reasons.get(k, 0) + v
    return {"limits": limits.as_dict(), "rendering": rendering, "tokenizer_identity": tok_identity,
            "splits": splits,
            "totals": {"pairs_in": sum(s["pairs_in"] for s in splits.values()),
                       "pairs_out": sum(s["pairs_out"] for s in splits.values()),
                       "rejected": sum(s["rejected"] for s in splits.values()),
                       "rejected_by_reason": dict(sorted(reasons.items())),
                       "truncated": sum(s["truncated"] for s in splits.values()),
                       "truncated_by_reason": {k: sum(s["truncated_by_reason"][k] for s in splits.values())
                                               for k in TRUNCATION_REASONS}}}


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def write_outputs(train_result: SplitResult, probe_result: SplitResult, token_manifest: dict,
                  report: dict, *, train_tokens, probe_tokens, probe_token_manifest, report_path,
                  rejections) -> None:
    write_parquet(train_tokens, tokens_table(train_result.rows))
    write_parquet(probe_tokens, tokens_table(probe_result.rows))
    write_parquet(rejections, rejections_table(train_result.rejections + probe_result.rejections))
    write_json(probe_token_manifest, token_manifest)
    write_json(report_path, report)


def read_pairs(path: str) -> list[dict]:
    return read_parquet(path).to_pylist()


def _read_probe_manifest(manifest_path: str) -> dict:
    try:
        return check_shape(read_json(manifest_path), PROBE_MANIFEST_SCHEMA, "probe manifest", manifest_path)
    except ContractError as e:
        raise TokenizeError(str(e)) from None


def _load_pair_tokenizer(tokenizer_dir: Path, log) -> tuple["PairTokenizer", str]:
    tok_identity = tokenizer_identity(tokenizer_dir)
    pair_tokenizer = PairTokenizer(load_tokenizer(tokenizer_dir))
    log.info("tokenizer %s (identity %s), rendering: %s", display_path(tokenizer_dir), tok_identity,
             pair_tokenizer.rendering)
    return pair_tokenizer, tok_identity


def _log_probe_truncations(probe_result: "SplitResult", log) -> None:
    if probe_result.truncations:
        counts = {k: v for k, v in split_report(probe_result)["truncated_by_reason"].items() if v}
        log.info("probe: %d pairs truncated %s (each recorded in the probe token manifest)",
                 len(probe_result.truncations), canonical_json(counts))


def run(limits: TokenizeLimits, tokenizer_dir: Path, train_path: str, probe_path: str,
        manifest_path: str, log) -> tuple[SplitResult, SplitResult, dict, dict]:
    """Everything but writing: returns (train result, probe result, probe token manifest, report)."""
    manifest = _read_probe_manifest(manifest_path)
    train, probe = read_pairs(train_path), read_pairs(probe_path)
    check_pairs(train, train_path)
    check_pairs(probe, probe_path)
    check_probe_matches_manifest(probe, manifest, probe_path, manifest_path)
    overlap = {p["pair_id"] for p in train} & {p["pair_id"] for p in probe}
    if overlap:
        raise TokenizeError(f"{len(overlap)} probe pairs are also in {train_path}: {sorted(overlap)[:10]}")

    pair_tokenizer, tok_identity = _load_pair_tokenizer(tokenizer_dir, log)

    probe_result = tokenize_pairs(pair_tokenizer, probe, limits, "probe")
    check_probe_complete(probe_result, limits)
    train_result = tokenize_pairs(pair_tokenizer, train, limits, "train")
    token_manifest = probe_token_manifest(probe_result.rows, manifest["probe_digest"], tok_identity,
                                          probe_result.truncations, limits)
    _log_probe_truncations(probe_result, log)
    report = tokenize_report([train_result, probe_result], limits, pair_tokenizer.rendering, tok_identity)
    return train_result, probe_result, token_manifest, report


# ---------------------------------------------------------------------------------------------
# The stage, streaming: train pairs in chunks, tokenized by a pool of forked workers, written in input
# order as they come back. Bounded memory: at most 2 chunks per worker in flight, plus compact per-row
# arrays (pair IDs for the uniqueness check, token counts for the report). The bytes are those of run()
# + write_outputs() above (the reference the tests compare with), whatever `workers` and `chunk_pairs`:
# row groups are cut by ParquetStreamWriter at a fixed row count, never at a chunk boundary.
# ---------------------------------------------------------------------------------------------

DEFAULT_CHUNK_PAIRS = 1024
_WORKER: dict = {}  # the forked workers' PairTokenizer (inherited from the parent, never pickled)


def resolve_workers(workers: int) -> int:
    """tokenize.workers: 0 = every core this process may run on (its CPU affinity), else that many."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise TokenizeError(f"tokenize.workers must be an integer >= 0 (0 = all cores), got {workers!r}")
    return workers or len(os.sched_getaffinity(0))


# The least pairs a pool worker is handed at once: ~0.1 s of rendering + encoding, against a few ms to fork and
# feed a worker, so small inputs do not start (or wait on) more processes than they can keep busy.
MIN_CHUNK_PAIRS = 64


@dataclass(frozen=True)
class PoolPlan:
    """How run_streaming spreads the work: `processes` forked workers (1 = none, all in this process), the train
    pairs in chunks of `train_chunk`, the probe in pieces of `probe_chunk`. Memory and speed only: the outputs
    are the same bytes for any plan."""
    processes: int
    train_chunk: int
    probe_chunk: int


def plan_pool(n_train: int, n_probe: int, workers: int, chunk_pairs: int) -> PoolPlan:
    """Size the pool to the work: chunks no larger than chunk_pairs, small enough that every worker gets one
    (never under MIN_CHUNK_PAIRS), no more workers than chunks nor than one per MIN_CHUNK_PAIRS pairs (so a
    small input runs in this process, without a pool). tokenize.workers 0 = all 16 cores of a GPU
    host used to fork 16 workers for 2 chunks of HH's 1.8k train pairs, with the 512 probe pairs tokenized
    alone before them; now the probe's 64-pair pieces and 112-pair train chunks keep all 16 busy."""
    if chunk_pairs < 1:
        raise TokenizeError(f"--chunk-pairs must be >= 1, got {chunk_pairs}")
    workers = max(1, workers)

    def per_worker(n: int) -> int:
        return max(1, min(chunk_pairs, max(MIN_CHUNK_PAIRS, -(-n // workers))))

    train_chunk, probe_chunk = per_worker(n_train), per_worker(n_probe)
    chunks = -(-n_train // train_chunk) + -(-n_probe // probe_chunk)
    return PoolPlan(max(1, min(workers, chunks, -(-(n_train + n_probe) // MIN_CHUNK_PAIRS))), train_chunk, probe_chunk)


@dataclass
class ChunkResult:
    tokens: pa.Table
    rejections: pa.Table
    reasons: dict[str, int]
    truncated_by_reason: dict[str, int]
    prompt_tokens_differ: int
    lengths: dict[str, np.ndarray]
    content_mismatches: dict[int, str]  # row in the chunk -> the hash its content has now


def tokenize_chunk(pair_tokenizer: PairTokenizer, batch: pa.RecordBatch, limits: TokenizeLimits,
                   split: str) -> ChunkResult:
    pairs = batch.to_pylist()
    mismatches = {}
    for i, pair in enumerate(pairs):
        actual = row_content_hash(pair)
        if actual != pair["content_hash"]:
            mismatches[i] = actual
    result = tokenize_pairs(pair_tokenizer, pairs, limits, split)
    reasons: dict[str, int] = {}
    for r in result.rejections:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    return ChunkResult(tokens_table(result.rows), rejections_table(result.rejections), reasons,
                       {k: sum(t["reason"] == k for t in result.truncations) for k in TRUNCATION_REASONS},
                       result.prompt_tokens_differ, row_lengths(result.rows), mismatches)


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux prctl PR_SET_PDEATHSIG): a killed
    tokenize (kill -9, the OOM killer, a cancelled job) otherwise leaves its forked workers blocked on the pool's
    queue for good (found alive 35 minutes later). The signal follows the parent *thread* that forked: the fork
    pool starts all its workers at once from the thread that first submits (the stage's main thread), and never
    replaces one. If the parent is already gone (it died between fork and here), exit now: no signal would come."""
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)


def _worker_init(parent_pid: int) -> None:
    # The pool already uses every core it is given: the Rust tokenizer's own thread pool inside each
    # worker would only oversubscribe them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if sys.platform == "linux":
        die_with_parent(parent_pid)


def _worker_chunk(batch: pa.RecordBatch, limits: TokenizeLimits, split: str) -> ChunkResult:
    return tokenize_chunk(_WORKER["pair_tokenizer"], batch, limits, split)


def _worker_pairs(pairs: list[dict], limits: TokenizeLimits, split: str) -> SplitResult:
    return tokenize_pairs(_WORKER["pair_tokenizer"], pairs, limits, split)


def merge_split_results(split: str, parts: Iterable[SplitResult]) -> SplitResult:
    """The SplitResult of consecutive pieces of a split, in order: what tokenize_pairs returns for the whole
    (each pair is tokenized on its own; only the encode batches differ, and a text's ids do not depend on them)."""
    out = SplitResult(split=split)
    for part in parts:
        out.rows += part.rows
        out.rejections += part.rejections
        out.truncations += part.truncations
        out.truncated += part.truncated
        out.prompt_tokens_differ += part.prompt_tokens_differ
        out.pairs_in += part.pairs_in
    return out


@contextmanager
def _fork_pool(pair_tokenizer: PairTokenizer, processes: int):
    """A fork pool of `processes` workers holding pair_tokenizer, or None for processes <= 1 (all in-process)."""
    if processes <= 1:
        yield None
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    _WORKER["pair_tokenizer"] = pair_tokenizer
    # fork: the workers inherit the loaded tokenizer instead of importing transformers again. (A fork pool starts
    # all its workers at once, so plan_pool never asks for more than there are chunks.)
    pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork"), initializer=_worker_init,
                               initargs=(os.getpid(),))
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)  # refused input: do not finish the queued chunks
        raise
    else:
        pool.shutdown(wait=True)
    finally:
        _WORKER.clear()


def _chunk_results(pool, pair_tokenizer: PairTokenizer, batches: Iterator[pa.RecordBatch], limits: TokenizeLimits,
                   split: str, processes: int) -> Iterator[tuple[pa.RecordBatch, ChunkResult]]:
    """(batch, result) in input order; with a pool, at most 2 * processes chunks in flight."""
    if pool is None:
        for batch in batches:
            yield batch, tokenize_chunk(pair_tokenizer, batch, limits, split)
        return
    from collections import deque

    pending: deque = deque()
    for batch in batches:
        pending.append((batch, pool.submit(_worker_chunk, batch, limits, split)))
        if len(pending) >= 2 * processes:
            b, f = pending.popleft()
            yield b, f.result()
    while pending:
        b, f = pending.popleft()
        yield b, f.result()


def _probe_tokenizer(pool, pair_tokenizer: PairTokenizer, probe: list[dict], limits: TokenizeLimits, piece: int):
    """Start tokenizing the probe (in pieces on the pool, queued before any train chunk; or here, now); returns a
    function giving the whole probe's SplitResult, checked complete (check_probe_complete)."""
    if pool is None:
        parts = [tokenize_pairs(pair_tokenizer, probe, limits, "probe")]
    else:
        parts = [pool.submit(_worker_pairs, probe[lo:lo + piece], limits, "probe")
                 for lo in range(0, len(probe), piece)]
    done: list[SplitResult] = []

    def result() -> SplitResult:
        if not done:
            done.append(merge_split_results("probe", (p if pool is None else p.result() for p in parts)))
            check_probe_complete(done[0], limits)
        return done[0]

    if pool is None:
        result()  # nothing to overlap with: refuse an incomplete probe before reading any train pair
    return result


def run_streaming(limits: TokenizeLimits, tokenizer_dir: Path, train_path: str, probe_path: str,
                  manifest_path: str, log, *, train_tokens, probe_tokens, probe_token_manifest, report_path,
                  rejections, workers: int = 1, chunk_pairs: int = DEFAULT_CHUNK_PAIRS) -> dict:
    """The stage: the outputs of run() + write_outputs(), train pairs streamed. Returns the report.

    `workers` is the most processes to use (plan_pool sizes the pool to the input); `chunk_pairs` the most train
    pairs per work unit."""
    manifest = _read_probe_manifest(manifest_path)
    probe = read_pairs(probe_path)  # the probe is small (probe.size pairs) and is scored whole
    check_pairs(probe, probe_path)
    check_probe_matches_manifest(probe, manifest, probe_path, manifest_path)
    probe_ids = {p["pair_id"] for p in probe}

    pair_tokenizer, tok_identity = _load_pair_tokenizer(tokenizer_dir, log)
    train_file = open_parquet(train_path)
    plan = plan_pool(train_file.metadata.num_rows, len(probe), resolve_workers(workers), chunk_pairs)

    pairs_in, pairs_out, differ = 0, 0, 0
    reasons: dict[str, int] = {}
    truncated_by_reason = dict.fromkeys(TRUNCATION_REASONS, 0)
    lengths: dict[str, list[np.ndarray]] = {k: [] for k in LENGTH_KEYS}
    seen: dict[str, int] = {}
    problems: list[str] = []
    n_problems, overlap = 0, []
    with _fork_pool(pair_tokenizer, plan.processes) as pool:
        probe_pending = _probe_tokenizer(pool, pair_tokenizer, probe, limits, plan.probe_chunk)
        with ParquetStreamWriter(train_tokens, TOKENS_SCHEMA) as tokens_out, \
                ParquetStreamWriter(rejections, REJECTIONS_SCHEMA) as rejections_out:
            batches = iter_parquet_batches(train_path, plan.train_chunk, parquet_file=train_file)
            for batch, chunk in _chunk_results(pool, pair_tokenizer, batches, limits, "train", plan.processes):
                # The probe's pieces were queued first, so they are back by now: an incomplete probe is refused
                # before any train chunk is written.
                probe_pending()
                ids, hashes = batch.column("pair_id").to_pylist(), batch.column("content_hash").to_pylist()
                for i, (pid, ch) in enumerate(zip(ids, hashes)):
                    problem = pair_id_problem(pairs_in + i, pid, ch, seen)
                    if problem is None and i in chunk.content_mismatches:
                        problem = content_hash_problem(pairs_in + i, pid, ch, chunk.content_mismatches[i])
                    if problem is not None:
                        n_problems += 1
                        if len(problems) < 20:
                            problems.append(problem)
                    if pid in probe_ids:
                        overlap.append(pid)
                pairs_in += batch.num_rows
                pairs_out += chunk.tokens.num_rows
                differ += chunk.prompt_tokens_differ
                for k, v in chunk.reasons.items():
                    reasons[k] = reasons.get(k, 0) + v
                for k, v in chunk.truncated_by_reason.items():
                    truncated_by_reason[k] += v
                for k in LENGTH_KEYS:
                    lengths[k].append(chunk.lengths[k])
                tokens_out.write(chunk.tokens)
                rejections_out.write(chunk.rejections)
            probe_result = probe_pending()
            # Raised inside the writers' block: on bad input no output file appears.
            if n_problems:
                raise TokenizeError(f"{train_path}: {n_problems} pair(s) do not match their recorded hashes "
                                    f"(edited after normalize?):\n  " + "\n  ".join(problems))
            if overlap:
                raise TokenizeError(f"{len(overlap)} probe pairs are also in {train_path}: {sorted(overlap)[:10]}")
            rejections_out.write(rejections_table(probe_result.rejections))

    write_parquet(probe_tokens, tokens_table(probe_result.rows))
    token_manifest = _token_manifest(probe_result.rows, manifest["probe_digest"], tok_identity,
                                     probe_result.truncations, limits)
    _log_probe_truncations(probe_result, log)
    train_lengths = {k: (np.concatenate(v) if v else np.zeros(0, np.int64)) for k, v in lengths.items()}
    train_report = _split_report(pairs_in, pairs_out, reasons, sum(truncated_by_reason.values()),
                                 truncated_by_reason, differ, train_lengths)
    splits = {"train": train_report, "probe": split_report(probe_result)}
    report = _tokenize_report(splits, limits, pair_tokenizer.rendering, tok_identity)
    write_json(probe_token_manifest, token_manifest)
    write_json(report_path, report)
    return report


def _arguments(ap) -> None:
    ap.add_argument("--identity", required=True, help="results/ref/ref_identity.json from verify_ref")
    ap.add_argument("--train", required=True)
    ap.add_argument("--probe", required=True)
    ap.add_argument("--probe-manifest", required=True)
    ap.add_argument("--train-tokens", required=True)
    ap.add_argument("--probe-tokens", required=True)
    ap.add_argument("--probe-token-manifest", required=True)
    ap.add_argument("--report", required=True)
    ap.add_argument("--rejections", required=True)
    ap.add_argument("--chunk-pairs", type=int, default=DEFAULT_CHUNK_PAIRS,
                    help="train pairs per work unit (memory / parallelism only; the outputs do not depend on it)")


def _run(args) -> None:
    from stages.lib.reference import load_verified_dir

    log = logging.getLogger("tokenize")
    params = load_params(args.params)["tokenize"]
    limits = TokenizeLimits.from_params(params)
    workers = resolve_workers(params.get("workers", 0))
    tokenizer_dir = load_verified_dir(args.identity)
    report = run_streaming(limits, Path(tokenizer_dir), args.train, args.probe, args.probe_manifest, log,
                           train_tokens=args.train_tokens, probe_tokens=args.probe_tokens,
                           probe_token_manifest=args.probe_token_manifest, report_path=args.report,
                           rejections=args.rejections, workers=workers, chunk_pairs=args.chunk_pairs)
    train, probe = report["splits"]["train"], report["splits"]["probe"]
    # No worker count or timing here: the log is hashed with the outputs.
    log.info("train: %d pairs in, %d out, %d rejected %s, %d truncated; probe: %d pairs, digest %s",
             train["pairs_in"], train["pairs_out"], train["rejected"], canonical_json(train["rejected_by_reason"]),
             train["truncated"], probe["pairs_out"], read_json(args.probe_token_manifest)["token_digest"])


def main(argv: list[str] | None = None) -> None:
    from stages.lib.reference import RefIdentityError

    return stage_main(argv, "tokenize", __doc__.split("\n")[0], add_arguments=_arguments, run=_run,
                      input_errors=(TokenizeError, ParamsError, RefIdentityError))


def tokenizers_only_process() -> None:
    """Keep this process's `import transformers` from importing torch (~40% of the stage's wall time: torch is
    4-5 s to import on a GPU host, and every forked worker would carry it). transformers supports running without
    torch (its tokenizers-only install: tokenizers, chat templates and configs work, models do not), and decides
    it by whether `torch` can be found. `sys.modules["torch"] = None` is Python's own way to say it cannot
    (importlib.util.find_spec returns None, `import torch` raises ModuleNotFoundError); it also makes transformers
    cache "no torch" for the process's lifetime, so it is done only when the stage runs as its own process
    (`python -m stages.tokenize`), never by main() called inside another program. The tokenizer is the same: its
    files, classes, special tokens and chat template do not depend on torch (tensors only come into
    `return_tensors`, which tokenize never asks for). Of transformers 5's tokenizer classes only Pop2Piano's MIDI
    tokenizer requires torch, and it is no fast tokenizer, which load_tokenizer refuses anyway."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None
        # transformers' one-line advice that models are unavailable (stderr, never the log file): expected here.
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


if __name__ == "__main__":
    tokenizers_only_process()
    main()
