"""A conversation rendered as text, the same rule for chosen and rejected (each branch whole).

* Chat template (the tokenizer has one):
      prompt_text = apply_chat_template(prompt, add_generation_prompt=True)
      full_text   = apply_chat_template(prompt + completion)
  full_text must start with prompt_text (else `template_not_prefix`), and every completion message's
  (stripped) content must appear, in order, after it (else `template_drops_completion`); a template that
  raises is `template_error`.
* Plain (no template): role-tagged turns joined by a blank line,
      prompt_text = "User: q1\\n\\nAssistant: a1\\n\\nUser: q2\\n\\nAssistant:"
      full_text   = "User: q1\\n\\nAssistant: a1\\n\\nUser: q2\\n\\nAssistant: answer"
  (tags: System, User, Assistant; "Assistant:" ends the prompt, so the space before the answer is the
  completion's first character and byte-level BPE keeps it in the answer's first token).
The stop signal (EOS) and special-token checks are the pair tokenizer's (stages/data/pair_tokenizer.py).
"""
from __future__ import annotations

from stages.data.tokenizer import chat_template_text

PLAIN_ROLE_TAGS = {"system": "System", "user": "User", "assistant": "Assistant"}
PLAIN_TURN_SEPARATOR = "\n\n"


class BranchRejected(Exception):
    """One branch of a pair cannot be tokenized faithfully; `reason` is a stable code."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


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

    template = chat_template_text(tokenizer)
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

