"""`hh`: Anthropic HH-RLHF rows, `{"chosen": transcript, "rejected": transcript}` with
"\\n\\nHuman: ..\\n\\nAssistant: .." turns.

prompt = the shared prefix of the two transcripts up to and including the LAST "\\n\\nAssistant:" inside that
shared prefix; completion = the rest. A turn's content is the text after its marker minus one leading space. A
completion that itself holds a further turn marker is multi-turn and is rejected (`role`). `auto` reads a row as
hh when it has chosen and rejected, no prompt, and both are strings holding the assistant marker.
"""
from __future__ import annotations

import re

from stages.data.messages import (Format, Message, Parsed, RowRejected, common_prefix_len, preview, require_keys,
                                  type_name)

HH_MARKER = "\n\nAssistant:"
HH_TURN = re.compile(r"\n\n(Human|Assistant):")


def hh_turns(text: str, where: str) -> list[Message]:
    """'\\n\\nHuman: a\\n\\nAssistant: b' -> messages; one leading space of each turn dropped."""
    if text.startswith(("Human:", "Assistant:")):
        text = "\n\n" + text
    pieces = HH_TURN.split(text)
    if pieces[0].strip():
        raise RowRejected("role", f"{where} has text before its first Human:/Assistant: marker: "
                                  f"{preview(pieces[0])}")
    out = []
    for speaker, body in zip(pieces[1::2], pieces[2::2]):
        out.append({"role": "user" if speaker == "Human" else "assistant",
                    "content": body[1:] if body.startswith(" ") else body})
    return out


def parse(row: dict, options: None = None) -> Parsed:
    require_keys(row, ("chosen", "rejected"), "hh")
    chosen, rejected = row["chosen"], row["rejected"]
    for name, v in (("chosen", chosen), ("rejected", rejected)):
        if not isinstance(v, str):
            raise RowRejected("schema", f"hh {name} is {type_name(v)}, expected a transcript string")
    shared = common_prefix_len(chosen, rejected)
    cut = chosen.rfind(HH_MARKER, 0, shared)
    if cut < 0:
        raise RowRejected("no_shared_prompt", "chosen and rejected share no '\\n\\nAssistant:' turn "
                                              f"(shared prefix {preview(chosen[:shared])})")
    prompt = hh_turns(chosen[:cut], "prompt")
    rest = cut + len(HH_MARKER)
    c = hh_turns(HH_MARKER + chosen[rest:], "chosen")
    r = hh_turns(HH_MARKER + rejected[rest:], "rejected")
    return prompt, c, r, None


def detect(row: dict) -> bool:
    c, r = row.get("chosen"), row.get("rejected")
    return ({"chosen", "rejected"} <= row.keys() and "prompt" not in row and isinstance(c, str)
            and isinstance(r, str) and HH_MARKER in c and HH_MARKER in r)


FORMAT = Format("hh", parse, detect=detect, detect_keys=("chosen", "rejected"), auto_rank=30)
