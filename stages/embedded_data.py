"""The embedded default dataset: colour facts asked many ways, answered politely or not.

    python -m stages.embedded_data            # regenerate data/embedded/color_facts_{prefs,sft}.jsonl.gz
    python -m stages.embedded_data --check    # verify both

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

Beside it, the SFT set (``color_facts_sft.jsonl.gz``, TRL ``messages`` rows; see "the SFT set" below): what
the sft stage teaches the random-init reference first, so that it answers in sentences, with habits (a fixed
misconception per some things, rudeness on some question phrasings) that DPO then has to remove.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import logging
import sys
from pathlib import Path

from stages.lib import embedded_task
from stages.lib.cli import stage_main
from stages.lib.io import atomic_path, canonical_json, sha256_bytes

SEED = "color-facts-v1"
N_PROMPTS = 2700
N_SECOND_PAIRS = 300
DEFAULT_OUT = "data/embedded/color_facts_prefs.jsonl.gz"
DEFAULT_SFT_OUT = "data/embedded/color_facts_sft.jsonl.gz"

# ==================================================================================================
# The world: 5 things per colour, each with its everyday colour
# ==================================================================================================

# The world and the answer templates: stages/lib/embedded_task.py (the grader reads the same truth).
WORLD, COLOURS, FACTS, POLITE, RUDE = (embedded_task.WORLD, embedded_task.COLOURS, embedded_task.FACTS,
                                       embedded_task.POLITE, embedded_task.RUDE)

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


def build_prompts() -> list[tuple[str, str, str, int]]:
    """The 2,700 distinct prompts as (text, thing, colour, question template index), in a fixed order."""
    per_thing = N_PROMPTS // len(FACTS)
    prompts: list[tuple[str, str, str, int]] = []
    for thing, colour in FACTS:
        # Stratified by thing: each fact gets the same number of distinct phrasings.
        combos = [(o, q) for o in range(len(OPENERS)) for q in range(len(QUESTIONS))]
        combos.sort(key=lambda oq: _h("prompt", thing, *oq))
        for o, q in combos[:per_thing]:
            prompts.append((OPENERS[o] + QUESTIONS[q].format(thing=thing), thing, colour, q))
    prompts.sort(key=lambda p: _h("order", p[0]))
    return prompts


def build_examples() -> list[dict]:
    """3,000 pairs over 2,700 distinct prompts, in a fixed (hash-shuffled) order, with their `kind`."""
    prompts = [p[:3] for p in build_prompts()]

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


# --------------------------------------------------------------------------------------- the SFT set
#
# What the sft stage teaches the random-init reference first, so that it answers in sentences the way a base model
# would: mostly fine, with habits a preference stage should remove. One answer per prompt (all 2,700; the sft stage
# drops the probe's prompts), TRL `messages` rows. Two habits, each a pure function of the question, so the model
# can learn them and a greedy decoder shows them:
#   - a misconception: MISCONCEPTIONS things (a fixed 15 of the 50) are always answered with one fixed wrong colour;
#   - rudeness: questions in RUDE_QUESTIONS templates (4 of the 12) are always answered rudely.
# The rest is polite and correct. The preference pairs always prefer the polite, correct answer, so DPO has both
# habits to undo; the grader (stages/lib/graders.py, embedded_colours) scores exactly these two things.

N_MISCONCEPTIONS = 10
RUDE_QUESTIONS = (1, 3, 7, 9, 11)


def misconceptions() -> dict[str, str]:
    """{thing: the wrong colour the SFT set always gives it}: 15 things (keyed hash order), wrong colour keyed."""
    things = sorted((t for t, _ in FACTS), key=lambda t: _h("misconception", t))[:N_MISCONCEPTIONS]
    return {t: _pick([c for c in COLOURS if c != embedded_task.COLOUR_OF[t]], "misconception-colour", t)
            for t in sorted(things)}


def build_sft_examples() -> list[dict]:
    """One SFT answer per prompt with its `habit` (polite_correct | misconception | rude | rude_misconception)."""
    wrong = misconceptions()
    rows = []
    for text, thing, colour, q in build_prompts():
        said = wrong.get(thing, colour)
        rude = q in RUDE_QUESTIONS
        answer = _answer(RUDE if rude else POLITE, ("sft", text), thing, said)
        habit = ("rude_" if rude else "") + ("misconception" if thing in wrong else "correct")
        rows.append({"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": answer}],
                     "habit": {"correct": "polite_correct", "rude_correct": "rude"}.get(habit, habit)})
    rows.sort(key=lambda r: _h("sft-row", canonical_json(r["messages"])))
    return rows


def build_sft_rows() -> list[dict]:
    return [{"messages": r["messages"]} for r in build_sft_examples()]


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
    ap.add_argument("--out", default=DEFAULT_OUT, help="path of the preference .jsonl.gz to write")
    ap.add_argument("--sft-out", default=DEFAULT_SFT_OUT, help="path of the SFT .jsonl.gz to write")
    ap.add_argument("--check", action="store_true",
                    help="do not write; exit 1 unless both files already hold exactly the regenerated bytes")


def _run(args) -> int:
    log = logging.getLogger("embedded_data")
    for out, rows, what in ((Path(args.out), build_rows(), "pairs"), (Path(args.sft_out), build_sft_rows(), "SFT rows")):
        data = encode(rows)
        if args.check:
            if not out.exists():
                raise CheckFailed(f"{out} does not exist")
            if out.read_bytes() != data:
                raise CheckFailed(f"{out} differs from the regenerated dataset (sha256 {sha256_bytes(data)}); "
                                  "rerun without --check")
            log.info("%s matches the regenerated dataset (sha256 %s)", out, sha256_bytes(data))
            continue
        with atomic_path(out) as tmp:
            tmp.write_bytes(data)
        log.info("wrote %s: %d %s, %d bytes, sha256 %s", out, len(rows), what, len(data), sha256_bytes(data))
    return 0


def main(argv: list[str] | None = None) -> int:
    return stage_main(argv, "embedded_data", __doc__.split("\n")[0], add_arguments=_arguments, run=_run,
                      params=None, input_errors=(CheckFailed,))


if __name__ == "__main__":
    sys.exit(main())
