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
    return template_renderer(chat_template_text(tokenizer), dict(tokenizer.special_tokens_map))


def normalize_messages(messages: list[dict]) -> list[dict]:
    """What apply_chat_template does to a conversation of dicts before rendering it: keys whose value is None
    dropped (templates render a present None as "None"). Ours, not transformers' private _normalize_chat_messages,
    which transformers 5.17 (the GPU image's) does not have: importing it failed freeze_probe and tokenize there."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TypeError(f"chat message {i} is a {type(message).__name__}, not a dict: {message!r}")
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def template_renderer(template: str, variables: dict):
    """render(messages, add_generation_prompt) -> text for any Jinja chat template (see chat_template_renderer)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        rendered, _ = render_jinja_template(
            conversations=[normalize_messages(messages)], tools=None, documents=None,
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
# The exported models' chat template: a consumer's apply_chat_template renders what tokenize rendered
# ---------------------------------------------------------------------------------------------

EXPORT_TEMPLATE_CHECKS = (
    ([{"role": "user", "content": "Hi"}], [{"role": "assistant", "content": "Yes."}]),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
      {"role": "assistant", "content": "b"}, {"role": "user", "content": "c?"}],
     [{"role": "assistant", "content": "d e"}]),
)


def _jinja_literal(text: str) -> str:
    import json
    return json.dumps(text)          # a JSON string is a valid Jinja string literal (same escapes)


def export_chat_template(own: str | None, eos_token: str | None, specials: list[str], prefix: str = "") -> str:
    """A Jinja chat template with which `apply_chat_template` renders a conversation as tokenize rendered a pair's
    branch (PairTokenizer.render): the template tokenize used (`own`: tokenize.chat_template's, the tokenizer's
    own by default), or the plain role tags (None: render_plain), and the EOS
    tokenize appends after an assistant turn whose rendering does not already end with a special token.
    `prefix`: the text of the special tokens the tokenizer's post-processor puts first (a BOS) in a plain rendering,
    which tokenize encodes with them and apply_chat_template without."""
    ends_turn = ("messages and messages[-1]['role'] == 'assistant' and not add_generation_prompt")
    if own is not None:
        # The own template's output captured whole (`+%}` / `{%+` keep Jinja's trim/lstrip from touching its edges).
        closing = "" if eos_token is None else (
            "{% if " + ends_turn + " and not prefpipe_rendered.rstrip().endswith((" +
            ", ".join(_jinja_literal(s) for s in specials) + ",)) %}{{ " + _jinja_literal(eos_token) + " }}{% endif %}")
        return "{% set prefpipe_rendered +%}" + own + "{%+ endset %}{{ prefpipe_rendered }}" + closing
    tags = ", ".join(f"{_jinja_literal(k)}: {_jinja_literal(v)}" for k, v in PLAIN_ROLE_TAGS.items())
    sep = _jinja_literal(PLAIN_TURN_SEPARATOR)
    return ("{{ " + _jinja_literal(prefix) + " }}{% for message in messages %}{% if not loop.first %}{{ " + sep +
            " }}{% endif %}{{ {" + tags + "}[message['role']] + ': ' + message['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}{{ " + sep + " + 'Assistant:' }}{% elif " + ends_turn.replace(
                " and not add_generation_prompt", "") + " %}{{ " + _jinja_literal(eos_token or "") + " }}{% endif %}")


def template_problem(pair_tokenizer, template: str) -> str | None:
    """None when `template` renders EXPORT_TEMPLATE_CHECKS' conversations (prompt with the generation prompt, and
    the whole) exactly as `pair_tokenizer` does; else the first difference."""
    render = template_renderer(template, dict(pair_tokenizer.tokenizer.special_tokens_map))
    prefix = pair_tokenizer.export_prefix
    for prompt, completion in EXPORT_TEMPLATE_CHECKS:
        try:
            want = pair_tokenizer.render(prompt, completion)
        except BranchRejected:
            continue                                    # tokenize never renders this conversation either
        got = (render(prompt, True), render(prompt + completion, False))
        want = (prefix + want[0], prefix + want[1])
        if got != want:
            which = 0 if got[0] != want[0] else 1
            return (f"{('prompt', 'conversation')[which]} of {len(prompt + completion)} messages renders "
                    f"{got[which][:160]!r}, tokenize renders {want[which][:160]!r}")
    return None
