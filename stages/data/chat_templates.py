"""`tokenize.chat_template`: which rendering turns a conversation into text (issue 37, item 2).

* `tokenizer` (the default): the tokenizer's own chat template; a tokenizer without one (GPT-2) falls back to the
  plain role tags, with a warning (the stage's log, tokenize_report.json `warnings`, summary.md's Warnings): before
  this setting that fallback was one INFO line.
* a built-in by name: `chatml` (<|im_start|>role ... <|im_end|>) or `plain` (stages/data/render.py render_plain:
  the role tags, chosen on purpose: no warning).
* any other value: a path to a Jinja file (relative to the repository root, as params.yaml's data paths are),
  recorded by its SHA-256; the file is an input of every stage that renders (template_input).

Every stage that renders a conversation (freeze_probe's fit, tokenize, sft with its own sources, generate and judge's
turn closing, the exports' chat_template.jinja) resolves the same setting here, so they cannot disagree.
Nothing here imports transformers: the rules import template_input at DAG build.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from stages.data.limits import TokenizeError

DEFAULT = "tokenizer"
# ChatML as Qwen2 / the embedded reference render it (no default system message: a conversation renders as given).
CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
BUILTINS: dict[str, str | None] = {"chatml": CHATML, "plain": None}     # None: render_plain, no Jinja
NAMES = (DEFAULT, *BUILTINS)


def setting_of(tok_params: dict | None) -> str:
    """params.yaml's tokenize.chat_template (absent: the default)."""
    # (not `tok_params or {}`: truth-testing a stage's params view reads the whole section)
    value = DEFAULT if tok_params is None else tok_params.get("chat_template", DEFAULT)
    return DEFAULT if value is None else str(value)


def template_input(tok_params: dict | None) -> list[str]:
    """The rules' input for the setting: [the Jinja file] for a path, [] for a name (its text is in the code)."""
    from stages.lib.io import data_location

    setting = setting_of(tok_params)
    return [] if setting in NAMES else [data_location(setting)]


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class ChatTemplate:
    """The rendering a setting resolved to for one tokenizer. `text` None: the plain role tags."""
    setting: str             # params.yaml's value
    name: str                # what was used: "tokenizer", "chatml", "plain" or the Jinja file's path
    text: str | None
    warning: str | None = None

    @property
    def sha256(self) -> str | None:
        """The template text's SHA-256 (a file's: of its bytes as UTF-8 text); None for the plain rendering (code,
        stages/data/render.py render_plain, not a template)."""
        return None if self.text is None else _sha256(self.text)

    def record(self) -> dict:
        """tokenize_report.json `chat_template`."""
        return {"setting": self.setting, "used": self.name, "sha256": self.sha256}


def resolve_chat_template(setting: str | None, tokenizer) -> ChatTemplate:
    """The rendering `setting` means for `tokenizer`; a bad setting is a TokenizeError naming the key and why."""
    from stages.data.tokenizer import chat_template_text

    setting = DEFAULT if setting is None else str(setting)
    if setting == DEFAULT:
        own = chat_template_text(tokenizer)
        if own is not None:
            return ChatTemplate(setting, DEFAULT, own)
        # The tokenizer by its identity (tokenize_report.json's tokenizer_identity), not its path: the report is
        # hashed and must not depend on where the reference sits.
        return ChatTemplate(setting, "plain", None, warning=(
            "tokenize.chat_template is `tokenizer` but the tokenizer has no chat template: the pairs are "
            "rendered with the plain role tags (\"User: ...\\n\\nAssistant: ...\"), which a chat model was not "
            "trained on; set tokenize.chat_template to `plain` to choose that, `chatml`, or a Jinja file"))
    if setting in BUILTINS:
        return ChatTemplate(setting, setting, BUILTINS[setting])
    from stages.lib.io import data_location

    path = Path(data_location(setting))       # a path outside the repository: the same file from DVC's copy
    if not path.is_file():
        raise TokenizeError(f"params.yaml tokenize.chat_template: {setting!r} is neither one of {', '.join(NAMES)} "
                            f"nor a file ({'a directory' if path.is_dir() else 'no such file'})")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TokenizeError(f"{setting} (tokenize.chat_template): not UTF-8 text ({e})") from None
    from jinja2 import Environment, TemplateSyntaxError
    try:
        Environment().parse(text)
    except TemplateSyntaxError as e:
        raise TokenizeError(f"{setting} (tokenize.chat_template): not a Jinja template: line {e.lineno}: "
                            f"{e.message}") from None
    if not text.strip():
        raise TokenizeError(f"{setting} (tokenize.chat_template): the file is empty")
    return ChatTemplate(setting, setting, text)
