"""`openai`: OpenAI's preference fine-tuning JSONL, `input.messages` (the prompt), `preferred_output` /
`non_preferred_output` (lists of assistant messages). Other keys of `input` (tools, ...) are ignored.
"""
from __future__ import annotations

from stages.data.messages import Format, Parsed, RowRejected, require_keys, to_message, type_name


def parse(row: dict, options: None = None) -> Parsed:
    require_keys(row, ("input", "preferred_output", "non_preferred_output"), "openai")
    inp = row["input"]
    if not isinstance(inp, dict) or "messages" not in inp:
        raise RowRejected("schema", f"openai input is {type_name(inp)}"
                                    f"{'' if not isinstance(inp, dict) else ' without messages'}, "
                                    f"expected an object with a messages list")
    out = []
    for key in ("messages", "preferred_output", "non_preferred_output"):
        v = inp["messages"] if key == "messages" else row[key]
        if not isinstance(v, list):
            raise RowRejected("schema", f"openai {key} is {type_name(v)}, expected a list of messages")
        out.append([to_message(m, f"{key} message {i}") for i, m in enumerate(v)])
    return out[0], out[1], out[2], None


def detect(row: dict) -> bool:
    return {"input", "preferred_output", "non_preferred_output"} <= row.keys()


FORMAT = Format("openai", parse, detect=detect, detect_keys=("input", "preferred_output", "non_preferred_output"),
                auto_rank=10)
