"""Graders: a programmatic check of a generated completion that the judge is held to (issue 33).

A grader says of one completion of one prompt whether it succeeds, and which labels it earned (e.g. `rude`,
`wrong_colour`, `no_colour`); the judge stage grades the policy's and the reference's completions and
stages/evidence/scoring.py `grader_metrics` turns the grades into graded success rates (paired bootstrap) and the
judge's agreement with the grader on the prompts where the two completions grade differently. params `generation.grader`:

    embedded_colours                    the embedded task: the asked thing's colour named (and no other colour), no
                                        other thing named, no rude phrase (stages/lib/embedded_task.py: the truth)
    {type: regex, pattern: P}           success iff P is found in the completion (Python `re.search`)
    {type: regex, pattern: P, match: full}   ... iff the stripped completion matches P whole (an exact answer)
    null                                no grader: no graded rates, no agreement

A new grader: a function `(params, prompt_messages, completion) -> Grade` registered in GRADERS under its type name,
and its name added to the schema's `generation.grader` (workflow/schemas/params.schema.yaml).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from stages.lib import embedded_task


class GraderError(ValueError):
    """A grader setting that cannot grade (unknown type, a pattern that does not compile)."""


@dataclass(frozen=True)
class Grade:
    success: bool
    labels: tuple[str, ...] = ()       # why it failed, or what it did ("named_colour"); sorted, stable names


def _last_user(messages: list[dict]) -> str:
    users = [m["content"] for m in messages if m.get("role") == "user"]
    return users[-1] if users else ""


def grade_embedded_colours(spec: dict, prompt: list[dict], completion: str) -> Grade:
    thing = embedded_task.thing_in(_last_user(prompt))
    if thing is None:
        return Grade(False, ("unknown_question",))
    truth = embedded_task.COLOUR_OF[thing]
    named = embedded_task.colours_in(completion)
    labels = []
    if not named:
        labels.append("no_colour")
    else:
        labels.append("named_colour")
        if set(named) != {truth}:
            labels.append("wrong_colour")
    if any(t != thing for t in embedded_task.things_in(completion)):
        labels.append("wrong_thing")              # answers about another thing ("A canary is yellow." to a sunflower)
    if embedded_task.is_rude(completion):
        labels.append("rude")
    return Grade(bool(named) and set(named) == {truth} and not {"rude", "wrong_thing"} & set(labels),
                 tuple(sorted(labels)))


def _regex(spec: dict) -> re.Pattern:
    try:
        return re.compile(spec["pattern"])
    except re.error as e:
        raise GraderError(f"generation.grader.pattern {spec['pattern']!r} does not compile: {e}") from None


def grade_regex(spec: dict, prompt: list[dict], completion: str) -> Grade:
    pattern = _regex(spec)
    hit = (pattern.fullmatch(completion.strip()) if spec.get("match", "search") == "full"
           else pattern.search(completion))
    return Grade(hit is not None, () if hit is not None else ("no_match",))


GRADERS: dict[str, Callable[[dict, list[dict], str], Grade]] = {
    "embedded_colours": grade_embedded_colours,
    "regex": grade_regex,
}


def grader_spec(setting) -> dict | None:
    """params `generation.grader` as {type, ...} (a bare name is {type: name}); None = no grader."""
    if setting is None:
        return None
    spec = {"type": setting} if isinstance(setting, str) else dict(setting)
    if spec.get("type") not in GRADERS:
        raise GraderError(f"generation.grader: unknown grader {spec.get('type')!r} (known: {', '.join(GRADERS)})")
    if spec["type"] == "regex":
        if not isinstance(spec.get("pattern"), str):
            raise GraderError("generation.grader: a regex grader needs `pattern` (a string)")
        if spec.get("match", "search") not in ("search", "full"):
            raise GraderError(f"generation.grader.match {spec.get('match')!r}: search or full")
        _regex(spec)
    return spec


def grade(spec: dict, prompt: list[dict], completion: str) -> Grade:
    return GRADERS[spec["type"]](spec, prompt, completion)
