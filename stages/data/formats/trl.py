"""`trl`: TRL's preference format, `chosen` / `rejected` (+ optional `prompt`) as strings (standard) or message
lists (conversational).

Without `prompt` the prompt is implicit (stages/data/messages.py: the common leading messages, or TRL's
`extract_prompt` on strings). A string prompt becomes one user message and a string completion one assistant
message, content verbatim. `auto` reads any row with chosen and rejected as trl (the most general format, so
tried last).
"""
from __future__ import annotations

from stages.data.messages import Format, Parsed, require_keys, trl_fields


def parse(row: dict, options: None = None) -> Parsed:
    require_keys(row, ("chosen", "rejected"), "trl")
    prompt_key = "prompt" if "prompt" in row else None
    return (*trl_fields(row, prompt_key, "chosen", "rejected", None, "trl"), None)


def detect(row: dict) -> bool:
    return {"chosen", "rejected"} <= row.keys()


FORMAT = Format("trl", parse, detect=detect, detect_keys=("chosen", "rejected"), auto_rank=90)
