"""The embedded default dataset: colour facts asked many ways, answered politely or not.

    python -m stages.embedded_data --out data/embedded/color_facts_prefs.jsonl.gz          # regenerate
    python -m stages.embedded_data --out data/embedded/color_facts_prefs.jsonl.gz --check  # verify

The task
--------
A fixed world of 50 everyday things, each with its real, unambiguous colour: 10 colours (red,
orange, yellow, green, blue, purple, pink, brown, white, black) with exactly 5 things each, so no
colour is a better guess than another (a model cannot beat chance by a colour prior). A user asks
the colour of one thing, in one of 12 question templates behind one of 10 openers ("Hi!", "Sorry to
bother you.", ...): 6,000 possible prompts, of which 2,700 distinct ones are used.

The chosen answer always states the correct colour politely. The rejected answer is one of:

- ``wrong_fact`` (40%): the same polite sentence with a wrong colour (only the colour word differs,
  so this signal needs the object -> colour fact, carried across the prompt by attention);
- ``rude`` (30%): the correct colour said rudely ("Ugh, ... obviously.");
- ``rude_wrong`` (30%): a wrong colour said rudely.

Wrong colours are drawn uniformly from the nine other colours. 300 prompts get a second pair with
a different rejected answer (3,000 pairs in all), so the probe's prompt-leak exclusion is exercised
on the default data too. Every thing appears in 54 distinct prompts, so a probe prompt's fact is
always also taught by train pairs phrased differently: a tiny causal LM (Qwen2 shape, hidden 64,
2 layers, BPE vocabulary of ~1k trained on these texts) learns both the style and the facts from
~2.4k train pairs in a few CPU minutes, with DPO and with a Bradley-Terry reward model, and its
accuracy on the frozen 512-pair probe rises far above 50%.

Format: gzip JSON lines, one TRL conversational explicit-prompt row per line,
``{"prompt": [{"role": "user", ...}], "chosen": [{"role": "assistant", ...}], "rejected": [...]}``
(``build_examples()`` also gives each pair's rejected kind, for tests and analysis). Deterministic: every
random choice is a keyed SHA-256 (no RNG whose algorithm could change between Python versions), rows
are canonical JSON, and the gzip header has mtime 0 and no file name, so regeneration is
byte-identical (tests/stages/test_embedded_data.py checks the committed file).
"""
from __future__ import annotations

import gzip
import hashlib
import io
import logging
import sys
from pathlib import Path

from stages.lib.cli import stage_main
from stages.lib.io import atomic_path, canonical_json, sha256_bytes

SEED = "color-facts-v1"
N_PROMPTS = 2700
N_SECOND_PAIRS = 300
DEFAULT_OUT = "data/embedded/color_facts_prefs.jsonl.gz"

# ==================================================================================================
# The world: 5 things per colour, each with its everyday colour
# ==================================================================================================

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

OPENERS = [
    "", "Hi! ", "Hello. ", "Hey there. ", "Good morning! ", "Sorry to bother you. ", "Quick one. ",
    "Please help. ", "I have a question. ", "Excuse me. ",
]
QUESTIONS = [
    "What colour is {thing}?",
    "What color is {thing}?",
    "Which colour is {thing}?",
    "Tell me the colour of {thing}.",
    "Can you tell me what colour {thing} is?",
    "Do you know the color of {thing}?",
    "I forgot what colour {thing} is. Can you remind me?",
    "Quick question: what color is {thing}?",
    "What is the usual colour of {thing}?",
    "If I picture {thing}, what colour should I see?",
    "My kid asked me what colour {thing} is. What should I say?",
    "Describe the colour of {thing} in one word.",
]
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
# Share of each rejected kind, in units of 1/10.
KIND_WEIGHTS = [("wrong_fact", 4), ("rude", 3), ("rude_wrong", 3)]

# ==================================================================================================
# Keyed hashing: every random choice is a pure function of (SEED, what is being chosen)
# ==================================================================================================


def _h(*key: object) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, (SEED, *key))).encode()).digest()[:8], "big")


def _pick(seq: list, *key: object):
    return seq[_h(*key) % len(seq)]


def _kind(*key: object) -> str:
    slot = _h("kind", *key) % sum(w for _, w in KIND_WEIGHTS)
    for kind, weight in KIND_WEIGHTS:
        if slot < weight:
            return kind
        slot -= weight
    raise AssertionError("unreachable")


# ==================================================================================================
# Rows
# ==================================================================================================


def _answer(templates: list[str], template_key: tuple, thing: str, colour: str) -> str:
    return _pick(templates, *template_key).format(
        thing=thing, Thing=thing[0].upper() + thing[1:], colour=colour, Colour=colour.capitalize())


def _pair(prompt_text: str, thing: str, colour: str, kind: str, key: tuple) -> dict:
    wrong = _pick([c for c in COLOURS if c != colour], "wrong", *key)
    # wrong_fact reuses the chosen sentence's template, so chosen and rejected differ in one word.
    chosen = _answer(POLITE, ("polite", *key), thing, colour)
    if kind == "wrong_fact":
        rejected = _answer(POLITE, ("polite", *key), thing, wrong)
    else:
        rejected = _answer(RUDE, ("rude", *key), thing, colour if kind == "rude" else wrong)
    return {
        "prompt": [{"role": "user", "content": prompt_text}],
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
        "kind": kind,
    }


def build_examples() -> list[dict]:
    """3,000 pairs over 2,700 distinct prompts, in a fixed (hash-shuffled) order, with their `kind`."""
    per_thing = N_PROMPTS // len(FACTS)
    prompts: list[tuple[str, str, str]] = []  # (prompt text, thing, colour)
    for thing, colour in FACTS:
        # Stratified by thing: each fact gets the same number of distinct phrasings.
        combos = [(o, q) for o in range(len(OPENERS)) for q in range(len(QUESTIONS))]
        combos.sort(key=lambda oq: _h("prompt", thing, *oq))
        for o, q in combos[:per_thing]:
            prompts.append((OPENERS[o] + QUESTIONS[q].format(thing=thing), thing, colour))
    prompts.sort(key=lambda p: _h("order", p[0]))

    rows = [_pair(text, thing, colour, _kind(text), (text,)) for text, thing, colour in prompts]
    # Second pairs: same prompt, a different rejected answer (a different kind, so never a duplicate).
    for text, thing, colour in sorted(prompts, key=lambda p: _h("second", p[0]))[:N_SECOND_PAIRS]:
        first = _kind(text)
        kind = _pick([k for k, _ in KIND_WEIGHTS if k != first], "second-kind", text)
        rows.append(_pair(text, thing, colour, kind, (text, "second")))
    rows.sort(key=lambda r: _h("row", canonical_json(r)))
    return rows


def build_rows() -> list[dict]:
    """The rows as written: TRL conversational explicit-prompt keys only."""
    return [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in build_examples()]


def encode(rows: list[dict]) -> bytes:
    """gzip(JSON lines) with a fixed header (mtime 0, no file name): same rows, same bytes."""
    raw = "".join(canonical_json(r) + "\n" for r in rows).encode("utf-8")
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        gz.write(raw)
    return buf.getvalue()


# ==================================================================================================
# CLI
# ==================================================================================================


class CheckFailed(ValueError):
    """--check: the file is missing or differs from the regenerated dataset."""


def _arguments(ap) -> None:
    ap.add_argument("--out", default=DEFAULT_OUT, help="path of the .jsonl.gz to write")
    ap.add_argument("--check", action="store_true",
                    help="do not write; exit 1 unless --out already holds exactly the regenerated bytes")


def _run(args) -> int:
    log = logging.getLogger("embedded_data")
    rows = build_rows()
    data = encode(rows)
    out = Path(args.out)
    if args.check:
        if not out.exists():
            raise CheckFailed(f"{out} does not exist")
        if out.read_bytes() != data:
            raise CheckFailed(f"{out} differs from the regenerated dataset (sha256 {sha256_bytes(data)}); "
                              "rerun without --check")
        log.info("%s matches the regenerated dataset (sha256 %s)", out, sha256_bytes(data))
        return 0
    with atomic_path(out) as tmp:
        tmp.write_bytes(data)
    log.info("wrote %s: %d pairs, %d distinct prompts, %d bytes, sha256 %s", out, len(rows),
             len({r["prompt"][0]["content"] for r in rows}), len(data), sha256_bytes(data))
    return 0


def main(argv: list[str] | None = None) -> int:
    return stage_main(argv, "embedded_data", __doc__.split("\n")[0], add_arguments=_arguments, run=_run,
                      params=None, input_errors=(CheckFailed,))


if __name__ == "__main__":
    sys.exit(main())
