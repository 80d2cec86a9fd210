"""The tokenizer the pairs are rendered with: loading it, its identity, and what its parts prove.

    load_tokenizer / tokenizer_identity   a fast (Rust-backed) tokenizer from a directory; sha256 of its files
    untrimmed_backend                     its backend with offsets never trimmed (the prompt/completion boundary
                                          is placed on character offsets: stages/data/pair_tokenizer.py)
    chat_template_text, special_token_strings
    max_chars_per_token, cuts_at_spaces   the cost bound: a text of more than n * R characters has more than n
                                          tokens (R proven from the vocabulary), and a cut at a space between two
                                          letters/digits leaves the tokens before it as they are in the whole text
    tokenizers_only_process               keep `python -m stages.<stage>` from importing torch
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from stages.data.limits import TokenizeError
from stages.lib.contracts import TOKENIZER_FILES
from stages.lib.io import sha256_file, sha256_json


def tokenizer_identity(tokenizer_dir: str | Path) -> str:
    """sha256 over (name, size, sha256) of every tokenizer file present in the directory."""
    tokenizer_dir = Path(tokenizer_dir)
    files = [[name, (tokenizer_dir / name).stat().st_size, sha256_file(tokenizer_dir / name)]
             for name in sorted(TOKENIZER_FILES) if (tokenizer_dir / name).is_file()]
    if not files:
        raise TokenizeError(f"{tokenizer_dir}: no tokenizer files (looked for {', '.join(TOKENIZER_FILES)})")
    return sha256_json(files)


def load_tokenizer(tokenizer_dir: str | Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if not getattr(tokenizer, "is_fast", False):
        raise TokenizeError(f"{tokenizer_dir}: tokenizer {type(tokenizer).__name__} is not a fast "
                            "(tokenizers-backed) tokenizer; character offsets are needed for the "
                            "prompt/completion boundary")
    return tokenizer


def _sets_trim_offsets(node: Any) -> bool:
    if isinstance(node, dict):
        return node.get("trim_offsets") is True or any(_sets_trim_offsets(v) for v in node.values())
    if isinstance(node, list):
        return any(_sets_trim_offsets(v) for v in node)
    return False


def untrimmed_backend(tokenizer):
    """The tokenizer's Rust backend with offsets never trimmed, no truncation and no padding.

    Trimming (ByteLevel / RoBERTa post-processors) moves a token's start past its leading space,
    which would make a token straddling the boundary look as if it started on it. Ids are unchanged.
    A backend that already is so (GPT-2's TemplateProcessing post-processor, for one) is returned itself
    (never modified here); otherwise a copy: a JSON round trip of the whole backend, vocabulary included,
    ~0.4 s for GPT-2's, so it is made only when something must change.
    """
    from tokenizers import Tokenizer

    backend = tokenizer.backend_tokenizer
    post = backend.post_processor
    # __getstate__: the post-processor's own JSON (what pickling it writes), without serializing the vocabulary.
    trims = post is not None and _sets_trim_offsets(json.loads(post.__getstate__()))
    if not trims and backend.truncation is None and backend.padding is None:
        return backend
    spec = json.loads(backend.to_str())

    def untrim(node: Any) -> None:
        if isinstance(node, dict):
            if "trim_offsets" in node:
                node["trim_offsets"] = False
            for value in node.values():
                untrim(value)
        elif isinstance(node, list):
            for value in node:
                untrim(value)

    untrim(spec.get("post_processor"))
    copy = Tokenizer.from_str(json.dumps(spec))
    copy.no_truncation()
    copy.no_padding()
    copy.encode_special_tokens = backend.encode_special_tokens
    return copy


def chat_template_text(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template or None


def special_token_strings(tokenizer) -> list[str]:
    specials = set(tokenizer.all_special_tokens)
    specials.update(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)
    return sorted(s for s in specials if s)


# ---------------------------------------------------------------------------------------------
# Bounded cost: a text's characters bound its token count from below, so a row too long to fit is known to be
# too long before it is tokenized (a 50 MB row took 4 minutes and 12 GB to tokenize, only to be rejected).
# ---------------------------------------------------------------------------------------------

# NFC composes at most this many characters into one: the longest canonical decomposition of any code point
# (U+1F82 and the like; tests/stages/test_tokenize.py recomputes it from unicodedata). len(NFD(x)) == sum of
# len(NFD(c)) over NFC(x)'s characters <= 4 * len(NFC(x)), and NFD never shortens: len(x) <= 4 * len(NFC(x)).
NFC_MAX_COMPOSED = 4
# Pre-tokenizer regexes after which a cut is exact (bounded_text); GPT-2's is ByteLevel's own (use_regex).
# Qwen2 (and the embedded reference), Llama-3:
SPACE_CUT_SPLIT_PATTERNS = frozenset({
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
})
# A space between two letters/digits (Python's [^\W_]: Unicode L* and N*, never whitespace in any regex engine).
SPACE_CUT = re.compile(r"(?<=[^\W_]) (?=[^\W_])")


def _state(component) -> Any:
    """A tokenizers component's own JSON (what pickling it writes), without serializing the vocabulary."""
    return None if component is None else json.loads(component.__getstate__())


def _nfc_factor(normalizer: Any) -> int | None:
    """Original characters per normalized character, at most: 1 without a normalizer, NFC_MAX_COMPOSED under NFC
    (alone or in a Sequence); None for any other normalizer (it may delete characters: no bound is proven)."""
    if normalizer is None:
        return 1
    parts = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
    return NFC_MAX_COMPOSED if parts and all(p.get("type") == "NFC" for p in parts) else None


def max_chars_per_token(backend) -> int | None:
    """R such that a text of more than n * R characters has more than n tokens under `backend` (a
    tokenizers.Tokenizer), or None when that is not provable from its parts (texts are then tokenized whole).

    Proven for byte-level BPE (GPT-2, Llama-3, Qwen2): its tokens spell the UTF-8 bytes of the normalized text,
    none dropped (every byte of the byte-level alphabet is in the vocabulary, so no byte is left without a token);
    a vocabulary token spells at most as many bytes as it has characters (one character per byte in that
    alphabet), an added token matches its own content; a character is at least one byte. So tokens >=
    normalized characters / L, L the longest vocabulary entry, and normalized characters >= characters / the
    normalizer's factor (_nfc_factor). R = L * factor: 128 for GPT-2 (its longest token is 128 bytes)."""
    from tokenizers import models, pre_tokenizers

    model = backend.model
    if not isinstance(model, models.BPE) or model.dropout not in (None, 0.0):
        return None
    if '"ByteLevel"' not in json.dumps(_state(backend.pre_tokenizer)):
        return None
    factor = _nfc_factor(_state(backend.normalizer))
    vocab = backend.get_vocab(with_added_tokens=True)
    if factor is None or not all(ch in vocab for ch in pre_tokenizers.ByteLevel.alphabet()):
        return None
    return factor * max(len(token) for token in vocab)


def cuts_at_spaces(backend) -> bool:
    """Whether cutting a text just before a space that stands between two letters/digits (SPACE_CUT) leaves
    every token before the cut as it is in the whole text. True for GPT-2's ByteLevel regex and the Split
    patterns of SPACE_CUT_SPLIT_PATTERNS (then ByteLevel without regex), with no normalizer or NFC: no
    alternative of those regexes matches across such a space from the left (letter, number and punctuation runs
    exclude whitespace; a whitespace run cannot start before it, the character before is no space; an optional
    leading character starts a match), runs ending before it look at most at it, so the pre-tokens before it are
    those of the whole text, and BPE encodes each pre-token alone. NFC does not compose across a space; no added
    token holds a space, so none spans the cut."""
    if max_chars_per_token(backend) is None:
        return False
    pre = _state(backend.pre_tokenizer)
    if pre.get("type") == "ByteLevel":
        proven = pre.get("use_regex", True)
    else:
        parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
        proven = (len(parts) == 2 and parts[0].get("type") == "Split" and parts[0].get("behavior") == "Isolated"
                  and not parts[0].get("invert") and parts[0].get("pattern", {}).get("Regex") in SPACE_CUT_SPLIT_PATTERNS
                  and parts[1].get("type") == "ByteLevel" and not parts[1].get("use_regex", True))
    return bool(proven) and not any(" " in t.content for t in backend.get_added_tokens_decoder().values())


def tokenizers_only_process() -> None:
    """Keep this process's `import transformers` from importing torch (~40% of the stage's wall time: torch is
    4-5 s to import on a GPU host, and every forked worker would carry it). transformers supports running without
    torch (its tokenizers-only install: tokenizers, chat templates and configs work, models do not), and decides
    it by whether `torch` can be found. `sys.modules["torch"] = None` is Python's own way to say it cannot
    (importlib.util.find_spec returns None, `import torch` raises ModuleNotFoundError); it also makes transformers
    cache "no torch" for the process's lifetime, so it is done only when a stage that tokenizes runs as its own
    process (`python -m stages.tokenize`, `python -m stages.freeze_probe`), never by main() called inside another
    program. The tokenizer is the same: its
    files, classes, special tokens and chat template do not depend on torch (tensors only come into
    `return_tensors`, which tokenize never asks for). Of transformers 5's tokenizer classes only Pop2Piano's MIDI
    tokenizer requires torch, and it is no fast tokenizer, which load_tokenizer refuses anyway."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None
        # transformers' one-line advice that models are unavailable (stderr, never the log file): expected here.
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")



# ---------------------------------------------------------------------------------------------
# What ids mean: two tokenizers that give every id the same token can exchange token ids (generation, judging)
# ---------------------------------------------------------------------------------------------

def vocabulary(tokenizer) -> dict[str, tuple[int, bool]]:
    """token -> (id, special) over the whole vocabulary, added tokens included. Pad-token choice, chat template
    and model_max_length are not part of it: they do not change what an id means."""
    specials = set(special_token_strings(tokenizer))
    return {tok: (int(i), tok in specials) for tok, i in tokenizer.get_vocab().items()}


def vocabulary_digest(tokenizer) -> str:
    return sha256_json(sorted([tok, i, special] for tok, (i, special) in vocabulary(tokenizer).items()))


def vocabulary_difference(a, b) -> str | None:
    """None when the two tokenizers' vocabularies are the same (vocabulary()); else the first difference, in words."""
    va, vb = vocabulary(a), vocabulary(b)
    if va == vb:
        return None
    for tok in sorted(set(va) | set(vb)):
        if va.get(tok) != vb.get(tok):
            def say(v):
                return "absent" if v is None else f"id {v[0]}" + (" (special)" if v[1] else "")
            return f"{len(va)} vs {len(vb)} tokens; token {tok!r}: {say(va.get(tok))} vs {say(vb.get(tok))}"
    return f"{len(va)} vs {len(vb)} tokens"


def check_same_vocabulary(reference, other, what: str, other_dir, reference_dir) -> None:
    """`what`'s tokenizer gives every id the reference's token, else TokenizeError naming both (a policy or judge
    that reads the reference's token ids must)."""
    problem = vocabulary_difference(reference, other)
    if problem is not None:
        raise TokenizeError(f"the {what}'s tokenizer ({other_dir}, vocabulary {vocabulary_digest(other)[:12]}) "
                            f"differs from the reference's ({reference_dir}, vocabulary "
                            f"{vocabulary_digest(reference)[:12]}): {problem}; their token ids do not mean the same "
                            "text")
