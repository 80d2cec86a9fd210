"""The embedded colour task's ground truth, shared by its data generator (stages/embedded_data.py) and its grader
(stages/lib/graders.py `embedded_colours`): the world of things and their colours, and the answer templates, polite
and rude. One home, so the grader judges exactly the task the data teaches.
"""
from __future__ import annotations

import re

# 5 things per colour, each with its everyday colour.
WORLD: dict[str, list[str]] = {
    "red": ["a strawberry", "a ripe tomato", "a fire truck", "a ruby", "a cherry"],
    "orange": ["a carrot", "a pumpkin", "a tangerine", "a basketball", "a goldfish"],
    "yellow": ["a banana", "a lemon", "a sunflower", "a school bus", "a canary"],
    "green": ["fresh grass", "a frog", "a cucumber", "an emerald", "broccoli"],
    "blue": ["the clear sky", "a sapphire", "a blueberry", "a cornflower", "the deep sea"],
    "purple": ["an eggplant", "lavender", "an amethyst", "a plum", "a mulberry"],
    "pink": ["a flamingo", "bubblegum", "a piglet", "a cherry blossom", "cotton candy"],
    "brown": ["chocolate", "coffee", "a walnut", "cinnamon", "an acorn"],
    "white": ["snow", "milk", "a swan", "chalk", "a polar bear"],
    "black": ["coal", "a crow", "tar", "a raven", "licorice"],
}
COLOURS = list(WORLD)
FACTS: list[tuple[str, str]] = [(thing, colour) for colour, things in WORLD.items() for thing in things]
COLOUR_OF: dict[str, str] = dict(FACTS)

POLITE = [
    "{Thing} is {colour}.",
    "{Thing} is usually {colour}.",
    "Good question! {Thing} is {colour}.",
    "Sure! {Thing} is {colour}.",
    "It is {colour}. Hope that helps!",
    "Happy to help: {thing} is {colour}.",
]
RUDE = [
    "Ugh, {thing} is {colour}, obviously.",
    "Everyone knows it is {colour}. Stop asking.",
    "{Colour}. Look it up yourself next time.",
    "Seriously? It is {colour}. Do not waste my time.",
    "Whatever. {Thing} is {colour}.",
    "It is {colour}, genius.",
]
# What makes an answer rude: the words of the rude templates that no polite one has (case-insensitive).
RUDE_MARKERS = ("ugh", "obviously", "everyone knows", "stop asking", "look it up", "seriously", "waste my time",
                "whatever", "genius")

_COLOUR_RE = re.compile(r"\b(" + "|".join(COLOURS) + r")\b", re.IGNORECASE)
_RUDE_RE = re.compile(r"\b(" + "|".join(re.escape(m) for m in RUDE_MARKERS) + r")\b", re.IGNORECASE)
# Longest first, so "a cherry blossom" is found before "a cherry".
_THINGS_RE = re.compile(r"\b(" + "|".join(re.escape(t) for t in sorted(COLOUR_OF, key=len, reverse=True)) + r")\b",
                        re.IGNORECASE)


def thing_in(text: str) -> str | None:
    """The thing a question asks about (the first named, longest match), or None."""
    hit = _THINGS_RE.search(text)
    return hit.group(1).lower() if hit else None


def things_in(text: str) -> list[str]:
    """The things a text names, in order, lower case (longest match: "a cherry blossom" is not "a cherry")."""
    return [m.group(1).lower() for m in _THINGS_RE.finditer(text)]


def colours_in(text: str) -> list[str]:
    """Colour words an answer names, in order, lower case (a thing's own name is not a colour: "a cherry blossom"
    names no colour, "the clear sky" neither)."""
    return [m.group(1).lower() for m in _COLOUR_RE.finditer(text)]


def is_rude(text: str) -> bool:
    return _RUDE_RE.search(text) is not None
