"""`sharegpt`: `conversations` [{from, value}] (from: human/user, gpt/assistant, system) is the prompt; `chosen`
/ `rejected` are a {from, value} object, a list of them, or a string; an optional top-level `system` string
becomes a leading system message (LLaMA-Factory's ShareGPT preference layout).
"""
from __future__ import annotations

from typing import Any

from stages.data.messages import (Format, Message, Parsed, RowRejected, check_extra_keys, require_keys,
                                  type_name)

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}


def sharegpt_message(obj: Any, where: str) -> Message:
    if not isinstance(obj, dict):
        raise RowRejected("schema", f"{where} is {type_name(obj)}, expected an object with from and value")
    speaker = obj.get("from")
    if speaker is None:
        raise RowRejected("role", f"{where} has no 'from'")
    if not isinstance(speaker, str):
        raise RowRejected("role", f"{where} 'from' is {type_name(speaker)}, expected a string")
    if speaker not in SHAREGPT_ROLES:
        raise RowRejected("role", f"{where} has 'from' {speaker!r}, expected one of {sorted(SHAREGPT_ROLES)}")
    value = obj.get("value")
    if value is None:
        raise RowRejected("content_type", f"{where} has no 'value'")
    if not isinstance(value, str):
        raise RowRejected("content_type", f"{where} 'value' is {type_name(value)}, expected a string")
    check_extra_keys(obj, ("from", "value"), where)
    return {"role": SHAREGPT_ROLES[speaker], "content": value}


def _completion(v: Any, name: str) -> list[Message]:
    if isinstance(v, str):
        return [{"role": "assistant", "content": v}]
    if isinstance(v, dict):
        return [sharegpt_message(v, name)]
    if isinstance(v, list):
        return [sharegpt_message(m, f"{name} message {i}") for i, m in enumerate(v)]
    raise RowRejected("schema", f"sharegpt {name} is {type_name(v)}, expected a {{from, value}} object or a string")


def parse(row: dict, options: None = None) -> Parsed:
    require_keys(row, ("conversations", "chosen", "rejected"), "sharegpt")
    conv = row["conversations"]
    if not isinstance(conv, list):
        raise RowRejected("schema", f"sharegpt conversations is {type_name(conv)}, expected a list")
    prompt = [sharegpt_message(m, f"conversations message {i}") for i, m in enumerate(conv)]
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise RowRejected("content_type", f"sharegpt system is {type_name(system)}, expected a string")
    if system:
        prompt = [{"role": "system", "content": system}] + prompt
    return prompt, _completion(row["chosen"], "chosen"), _completion(row["rejected"], "rejected"), None


def detect(row: dict) -> bool:
    return {"conversations", "chosen", "rejected"} <= row.keys()


FORMAT = Format("sharegpt", parse, detect=detect, detect_keys=("conversations", "chosen", "rejected"), auto_rank=20)
