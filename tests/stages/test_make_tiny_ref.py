"""The embedded default reference: byte-deterministic, small, pinned, loadable through verify_ref.

The corpus is generated here in the embedded dataset's format (TRL conversational jsonl.gz), so the
test does not depend on the committed dataset.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import random
from pathlib import Path

import pytest

from stages import make_tiny_ref
from stages.lib.io import write_json
from stages.lib.reference import load_verified_dir
from stages.verify_ref import LOCK_NAME, verify_reference


def write_trl_corpus(path: Path, n: int = 150, seed: int = 3) -> Path:
    rng = random.Random(seed)
    colors = ["crimson", "teal", "ochre", "lilac", "sage green", "navy"]
    things = ["barn door", "teapot", "kite", "lantern", "scarf", "bicycle"]
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for i in range(n):
            t, good, bad = rng.choice(things), rng.choice(colors), rng.choice(colors)
            prompt = [{"role": "user", "content": f"What color is my {t}? It's item {i}."}]
            if i % 5 == 0:
                prompt = [{"role": "system", "content": "Answer briefly."}] + prompt
            row = {"prompt": prompt,
                   "chosen": [{"role": "assistant", "content": f"Your {t} is {good}."}],
                   "rejected": [{"role": "assistant", "content": f"Probably {bad}? Café naïve {i * 7}."}]}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_trl_corpus(tmp_path_factory.mktemp("corpus") / "prefs.jsonl.gz")


@pytest.fixture(scope="module")
def tiny(corpus, tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("models") / "tiny-qwen2"
    return out, make_tiny_ref.build(corpus, out)


def test_build_is_byte_deterministic_small_and_pinned(corpus, tiny, tmp_path):
    out, lock_sha = tiny
    again = tmp_path / "again"
    assert make_tiny_ref.main(["--data", str(corpus), "--out", str(again)]) == 0
    first, second = tree_bytes(out), tree_bytes(again)
    assert first == second
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", LOCK_NAME} <= set(first)
    assert sum(map(len, first.values())) < 3_000_000
    assert lock_sha == hashlib.sha256(first[LOCK_NAME]).hexdigest()
    # rebuilding over an existing directory replaces it (no stale files survive)
    (again / "stale.txt").write_text("old")
    make_tiny_ref.build(corpus, again)
    assert tree_bytes(again) == first


def test_different_data_gives_a_different_model(corpus, tiny, tmp_path):
    other = make_tiny_ref.build(write_trl_corpus(tmp_path / "other.jsonl.gz", seed=99), tmp_path / "other")
    assert other != tiny[1]


def test_verifies_pinned_and_loads_from_verified_dir(tiny, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, lock_sha = tiny
    ref = {"source": "local", "repo_id": make_tiny_ref.REPO_ID, "revision": lock_sha, "local_dir": str(out)}
    identity = verify_reference(ref)
    assert identity["revision_pinned"] and identity["extras"] == []
    write_json(tmp_path / "ref_identity.json", identity)
    ref_dir = load_verified_dir(tmp_path / "ref_identity.json")

    tok = AutoTokenizer.from_pretrained(ref_dir)
    model = AutoModelForCausalLM.from_pretrained(ref_dir)
    cfg = model.config
    assert cfg.model_type == "qwen2" and cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert cfg.vocab_size == len(tok)
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == (make_tiny_ref.EOS, make_tiny_ref.PAD, make_tiny_ref.BOS)
    assert (cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id) == (tok.eos_token_id, tok.pad_token_id,
                                                                       tok.bos_token_id)

    messages = [{"role": "user", "content": "What color is my kite?"}, {"role": "assistant", "content": "Teal."}]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>user\nWhat color is my kite?<|im_end|>\n<|im_start|>assistant\nTeal.<|im_end|>\n"
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert text.startswith(prompt) and prompt.endswith("<|im_start|>assistant\n")
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and ids.count(tok.eos_token_id) == 2
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg.vocab_size) and torch.isfinite(logits).all()


def test_autotokenizer_matches_tokenizer_json_on_every_text(corpus, tiny):
    """transformers forces Qwen2Tokenizer for qwen2 and rebuilds its pipeline: it must agree id for id."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    out, _ = tiny
    auto = AutoTokenizer.from_pretrained(out)
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    texts = list(make_tiny_ref.iter_texts(corpus)) + [
        "It's 12345 colors!  Café  naïve \u212b\n\n\tok", "<|im_start|>user\nhi<|im_end|>\n", "emoji 🎨 ✓"]
    for t in texts:
        assert auto(t)["input_ids"] == raw.encode(t).ids, t
        assert auto.decode(auto(t)["input_ids"]) == raw.normalizer.normalize_str(t)


def test_bad_corpus_row_names_file_and_row(tmp_path):
    p = tmp_path / "bad.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write(json.dumps({"prompt": [{"role": "user", "content": "x"}], "chosen": [], "rejected": []}) + "\n")
        f.write(json.dumps({"prompt": "not messages"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl\.gz: row 1: not a TRL conversational row"):
        make_tiny_ref.build(p, tmp_path / "m")
    assert not (tmp_path / "m").exists()
