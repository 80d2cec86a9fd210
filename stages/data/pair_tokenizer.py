"""One pair's branches (prompt + one completion each) rendered, bounded and encoded; the prompt/completion boundary.

Stop signal: when the completion part of full_text, right-stripped, does not already end with the EOS or another
special token (a template's end-of-turn such as <|im_end|>), the EOS text is appended, so the completion always
ends with a token that teaches the model to stop. Message content containing a special-token string is rejected
(`special_token_in_content`): the tokenizer would turn it into a control token and the pair would no longer say
what it says. A chat template is encoded without the tokenizer's own special tokens (the template already spells
BOS etc.), a plain rendering with them (a BOS where its post-processor adds one).

Boundary: full_text is encoded once, with character offsets; the completion starts at the first token whose
start offset is >= len(prompt_text). A token that straddles that position (starts before it, ends after it)
would either score prompt characters as completion or drop completion characters from the score, so such a pair
is rejected (`boundary_straddles_token`) rather than guessed. Offsets are taken with offset trimming off
(untrimmed_backend), so a trimmed leading space cannot hide a straddle.

Cost bound (bounded_text): a text of more than n * R characters has more than n tokens, R proven from the
tokenizer (max_chars_per_token: its longest token, times 4 under NFC; 128 for GPT-2), so a branch whose prompt or
completion alone is over a limit by characters is not tokenized whole: `reject` and `truncate_completion` tokenize
it up to a space past max_length * R characters (the tokens before such a cut are the whole text's:
cuts_at_spaces), keep_end (and `reject` for a prompt) not at all. Reasons are those of tokenizing everything;
counts not known are null. Without a proven R (another normalizer or model) texts are tokenized whole.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from stages.data.limits import TokenizeError, TokenizeLimits
from stages.data.chat_templates import DEFAULT, ChatTemplate, resolve_chat_template, setting_of
from stages.data.render import (BranchRejected, export_chat_template, render_chat, render_plain, template_problem,
                                template_renderer)
from stages.data.tokenizer import (SPACE_CUT, cuts_at_spaces, max_chars_per_token, special_token_strings,
                                   untrimmed_backend)


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
    cut = SPACE_CUT.search(text, bound + 1, 2 * bound + 2)
    if cut is None:
        return replace(over, why_uncut=f"no space between two letters/digits in its characters {bound + 1} to "
                                       f"{2 * bound} to cut it at exactly")
    return cut.start()


class PairTokenizer:
    """Renders and encodes branches with one tokenizer; holds the pieces that are fixed per tokenizer."""

    def __init__(self, tokenizer, bound_chars: bool = True, chat_template: ChatTemplate | None = None):
        """bound_chars=False: every text is tokenized whole (the reference bounded_text's cuts are tested against).
        chat_template: the rendering tokenize.chat_template resolved to (stages/data/chat_templates.py); None: the
        default setting (the tokenizer's own template, else plain)."""
        self.tokenizer = tokenizer
        self.chat_template = chat_template or resolve_chat_template(DEFAULT, tokenizer)
        template = self.chat_template.text
        self.uses_chat_template = template is not None
        if self.uses_chat_template and "add_generation_prompt" not in template:
            # Without a generation prompt the assistant header would land in the completion and be scored.
            raise TokenizeError(f"the chat template ({self.chat_template.name}) ignores add_generation_prompt, so the "
                                "prompt/completion boundary cannot be placed after the assistant header")
        self.backend = untrimmed_backend(tokenizer)
        self.chars_per_token = max_chars_per_token(self.backend) if bound_chars else None
        self.space_cuts = self.chars_per_token is not None and cuts_at_spaces(self.backend)
        self.eos_token = tokenizer.eos_token
        self.specials = special_token_strings(tokenizer)
        self._special_re = re.compile("|".join(map(re.escape, self.specials))) if self.specials else None
        self.add_special_tokens = not self.uses_chat_template
        self._render_template = (template_renderer(template, dict(tokenizer.special_tokens_map))
                                 if self.uses_chat_template else None)

    @property
    def rendering(self) -> str:
        return "chat_template" if self.uses_chat_template else "plain"

    @property
    def export_prefix(self) -> str:
        """The text of the special tokens tokenize's encoding puts before a rendering (a plain rendering is encoded
        with the tokenizer's special tokens: its post-processor's BOS, if any; a chat template spells its own)."""
        if not self.add_special_tokens:
            return ""
        bare = self.backend.encode("x", add_special_tokens=False).ids
        full = self.backend.encode("x", add_special_tokens=True).ids
        cut = next((i for i in range(len(full)) if full[i:i + len(bare)] == bare), 0)
        return "".join(self.backend.id_to_token(t) for t in full[:cut])

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


def turn_closing(pair_tokenizer: PairTokenizer) -> list[int]:
    """The token ids that close an assistant turn after its content, as tokenize renders a completion: a chat
    template's end-of-turn (ChatML: "<|im_end|>" "\\n"), else the EOS tokenize appends. A generated completion is
    judged as prompt + its content + these ids: the conversation as tokenize would have rendered it (the judge
    reads its last token, as it read the probe's). Taken from a rendered one-turn conversation, in context."""
    content = "Yes"
    _, full = pair_tokenizer.render([{"role": "user", "content": "Hi"}], [{"role": "assistant", "content": content}])
    end = full.rindex(content) + len(content)
    enc = pair_tokenizer.backend.encode(full, add_special_tokens=pair_tokenizer.add_special_tokens)
    return [int(i) for i, (start, _) in zip(enc.ids, enc.offsets) if start >= end]


def pair_tokenizer_for(tokenizer, tok_params: dict | None, **kwargs) -> PairTokenizer:
    """The pair tokenizer of params.yaml's `tokenize` section (its chat_template setting) for `tokenizer`: what every
    stage that renders a conversation builds, so they all render alike."""
    return PairTokenizer(tokenizer, chat_template=resolve_chat_template(setting_of(tok_params), tokenizer), **kwargs)


def exported_chat_template(tokenizer, tok_params: dict | None = None) -> str:
    """The chat template a trained model's export carries (chat_template.jinja): `apply_chat_template` renders a
    conversation with it exactly as tokenize rendered a pair's branch, prompt with the generation prompt and whole
    conversation alike (stages/data/render.py export_chat_template), under tokenize.chat_template (`tok_params`);
    checked on sample conversations here, and a template that would render otherwise refused (TokenizeError)
    before anything is trained."""
    pt = pair_tokenizer_for(tokenizer, tok_params)
    template = export_chat_template(pt.chat_template.text, pt.eos_token, pt.specials, pt.export_prefix)
    problem = template_problem(pt, template)
    if problem is not None:
        raise TokenizeError(f"the chat template the export would carry does not render as tokenize does: {problem}")
    return template


def export_template_files(model_dir, tok_params: dict | None = None) -> dict[str, str]:
    """{file name: text} a trained model's export writes beside the tokenizer it copies from `model_dir` (the
    reference): chat_template.jinja from exported_chat_template (tokenize.chat_template: `tok_params`); nothing when
    the directory has no tokenizer."""
    from pathlib import Path

    from stages.data.tokenizer import load_tokenizer
    from stages.lib.contracts import TOKENIZER_VOCAB_FILES
    if not any((Path(model_dir) / name).is_file() for name in TOKENIZER_VOCAB_FILES):
        return {}
    return {"chat_template.jinja": exported_chat_template(load_tokenizer(model_dir), tok_params)}
