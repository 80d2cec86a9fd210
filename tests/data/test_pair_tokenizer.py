"""The pair tokenizer (stages/data/pair_tokenizer.py, render.py, tokenizer.py): the real GPT-2 tokenizer on real
HH-RLHF pairs, plain and chat-template renderings, the prompt/completion boundary, template and content failures,
the tokenizer's identity, and the characters-per-token bound."""
from __future__ import annotations

import json
import shutil

import pytest

from data_helpers import (CHATML, NO_END_MARKER, SPACE_ENDED, UNLIMITED, as_pair, decode, gpt2_with_template,
                          load_hh_pairs)
from stages.data.limits import TokenizeError
from stages.data.pair_tokenizer import BranchRejected, PairTokenizer, completion_start
from stages.data.render import render_plain
from stages.data.tokenizer import load_tokenizer, tokenizer_identity
from stages.data.truncation import tokenize_pairs
from stages.lib.contracts import token_hash


# ---------------------------------------------------------------------------------------------
# Boundary correctness on real text
# ---------------------------------------------------------------------------------------------

def test_plain_rendering_boundary_on_real_hh_pairs(gpt2, hh_pairs):
    assert len(hh_pairs) > 2000
    pair_tok = PairTokenizer(gpt2)
    assert pair_tok.rendering == "plain"
    result = tokenize_pairs(pair_tok, hh_pairs, UNLIMITED, "train")
    assert result.rejections == [] and len(result.rows) == len(hh_pairs)
    for pair, row in zip(hh_pairs, result.rows):
        assert row["pair_id"] == pair["pair_id"]
        for side in ("chosen", "rejected"):
            ids, n = row[f"{side}_ids"], row[f"{side}_prompt_len"]
            prompt_text, full_text = render_plain(pair["prompt"], pair[side])
            full_text += gpt2.eos_token
            # One encoding of the whole rendering, identical to what the HF tokenizer itself gives.
            assert ids == gpt2(full_text)["input_ids"]
            assert decode(gpt2, ids[:n]) == prompt_text
            assert decode(gpt2, ids[n:]) == " " + pair[side][0]["content"] + "<|endoftext|>"
            assert decode(gpt2, ids[:n]) + decode(gpt2, ids[n:]) == full_text
            assert ids[-1] == gpt2.eos_token_id and ids.count(gpt2.eos_token_id) == 1
        assert row["token_hash"] == token_hash(row["chosen_ids"], row["chosen_prompt_len"],
                                               row["rejected_ids"], row["rejected_prompt_len"])
    assert result.prompt_tokens_differ == 0


def test_plain_rendering_format():
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Sky colour?"}]
    prompt_text, full_text = render_plain(prompt, [{"role": "assistant", "content": "Blue."}])
    assert prompt_text == "System: Be brief.\n\nUser: Hi\n\nAssistant: Hello.\n\nUser: Sky colour?\n\nAssistant:"
    assert full_text == prompt_text + " Blue."


def test_chat_template_boundary_on_real_hh_pairs(gpt2_tokenizer_dir, hh_rlhf_path, tmp_path):
    tok = load_tokenizer(gpt2_with_template(gpt2_tokenizer_dir, tmp_path / "chatml", CHATML,
                                            ["<|im_start|>", "<|im_end|>"]))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    pairs = load_hh_pairs(hh_rlhf_path, limit=300)
    pair_tok = PairTokenizer(tok)
    assert pair_tok.rendering == "chat_template"
    result = tokenize_pairs(pair_tok, pairs, UNLIMITED, "train")
    assert result.rejections == [] and len(result.rows) == len(pairs)
    for pair, row in zip(pairs, result.rows):
        for side in ("chosen", "rejected"):
            ids, n = row[f"{side}_ids"], row[f"{side}_prompt_len"]
            prompt_text = tok.apply_chat_template(pair["prompt"], add_generation_prompt=True, tokenize=False)
            full_text = tok.apply_chat_template(pair["prompt"] + pair[side], tokenize=False)
            assert ids == tok(full_text, add_special_tokens=False)["input_ids"]
            assert decode(tok, ids[:n]) == prompt_text
            # The template's end-of-turn is the stop signal: no EOS appended after it.
            assert decode(tok, ids[n:]) == pair[side][0]["content"] + "<|im_end|>\n"
            assert decode(tok, ids[:n]) + decode(tok, ids[n:]) == full_text
            assert im_end in ids[n:] and tok.eos_token_id not in ids


def test_chat_template_without_end_marker_gets_eos(gpt2_tokenizer_dir, hh_rlhf_path, tmp_path):
    tok = load_tokenizer(gpt2_with_template(gpt2_tokenizer_dir, tmp_path / "plain_tpl", NO_END_MARKER))
    pairs = load_hh_pairs(hh_rlhf_path, limit=50)
    result = tokenize_pairs(PairTokenizer(tok), pairs, UNLIMITED, "train")
    assert result.rejections == []
    for pair, row in zip(pairs, result.rows):
        ids, n = row["chosen_ids"], row["chosen_prompt_len"]
        assert decode(tok, ids[n:]) == pair["chosen"][0]["content"] + "\n<|endoftext|>"
        assert ids[-1] == tok.eos_token_id


# ---------------------------------------------------------------------------------------------
# Straddling tokens
# ---------------------------------------------------------------------------------------------

def test_completion_start_semantics():
    # Zero-width BOS and a token ending exactly at the boundary are prompt; a token starting at it is completion.
    assert completion_start([(0, 0), (0, 4), (4, 10), (10, 12), (12, 13)], 10) == 3
    assert completion_start([(0, 4), (4, 10)], 10) == 2  # nothing after the prompt
    with pytest.raises(BranchRejected) as e:
        completion_start([(0, 4), (4, 9), (9, 12)], 10)
    assert e.value.reason == "boundary_straddles_token" and "[9, 12)" in e.value.detail


def test_straddling_token_is_rejected_on_real_tokenizer(gpt2_tokenizer_dir, hh_rlhf_path, tmp_path):
    tok = load_tokenizer(gpt2_with_template(gpt2_tokenizer_dir, tmp_path / "space", SPACE_ENDED))
    pairs = load_hh_pairs(hh_rlhf_path, limit=20)
    prompt_text = tok.apply_chat_template(pairs[0]["prompt"], add_generation_prompt=True, tokenize=False)
    assert prompt_text.endswith("assistant: ")
    result = tokenize_pairs(PairTokenizer(tok), pairs, UNLIMITED, "train")
    # " Word" is one GPT-2 token starting on the prompt's trailing space: every pair straddles.
    assert result.rows == []
    assert {r["reason"] for r in result.rejections} == {"boundary_straddles_token"}
    assert [r["pair_id"] for r in result.rejections] == [p["pair_id"] for p in pairs]
    assert result.rejections[0]["detail"].startswith("chosen: token ")


def test_trimmed_offsets_cannot_hide_a_straddle(gpt2_tokenizer_dir, hh_rlhf_path, tmp_path):
    """A ByteLevel post-processor with trim_offsets moves " Word" to start after its space."""
    d = gpt2_with_template(gpt2_tokenizer_dir, tmp_path / "trim", SPACE_ENDED)
    spec = json.loads((d / "tokenizer.json").read_text())
    spec["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                              "use_regex": True}
    (d / "tokenizer.json").write_text(json.dumps(spec))
    tok = load_tokenizer(d)
    pair = load_hh_pairs(hh_rlhf_path, limit=1)[0]
    prompt_text = tok.apply_chat_template(pair["prompt"], add_generation_prompt=True, tokenize=False)
    full_text = tok.apply_chat_template(pair["prompt"] + pair["chosen"], tokenize=False)
    trimmed = tok(full_text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    # With the tokenizer's own (trimmed) offsets the straddle is invisible ...
    completion_start(trimmed, len(prompt_text))
    # ... the stage encodes with trimming off and sees it.
    result = tokenize_pairs(PairTokenizer(tok), [pair], UNLIMITED, "train")
    assert [r["reason"] for r in result.rejections] == ["boundary_straddles_token"]


# ---------------------------------------------------------------------------------------------
# Template and content failures
# ---------------------------------------------------------------------------------------------

def _one_pair(prompt_text="What colour is the sky?", chosen="Blue.", rejected="Green."):
    return as_pair({"prompt": [{"role": "user", "content": prompt_text}],
                    "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}]}, 0)


@pytest.mark.parametrize("template, pair_kwargs, reason", [
    # The header counts the messages, so the prompt rendering is not a prefix of the full one.
    ("{{ messages|length }} turns\n" + CHATML, {}, "template_not_prefix"),
    # Assistant content is replaced by the template: the completion would not be what is scored.
    ("{% for m in messages %}{% if m.role == 'user' %}User: {{ m.content }}\n{% else %}"
     "Assistant: [redacted]\n{% endif %}{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}",
     {}, "template_drops_completion"),
    ("{% for m in messages %}{% if m.role == 'user' and 'forbidden' in m.content %}"
     "{{ raise_exception('no forbidden words') }}{% endif %}{{ m.content }}\n{% endfor %}"
     "{% if add_generation_prompt %}A:{% endif %}", {"prompt_text": "a forbidden question"}, "template_error"),
    (CHATML, {"chosen": "Blue.<|endoftext|>User: more"}, "special_token_in_content"),
])
def test_template_and_content_rejections(gpt2_tokenizer_dir, tmp_path, template, pair_kwargs, reason):
    tok = load_tokenizer(gpt2_with_template(gpt2_tokenizer_dir, tmp_path / "t", template,
                                            ["<|im_start|>", "<|im_end|>"]))
    result = tokenize_pairs(PairTokenizer(tok), [_one_pair(**pair_kwargs)], UNLIMITED, "train")
    assert [r["reason"] for r in result.rejections] == [reason]
    assert result.rows == []


def test_special_token_in_plain_content_is_rejected(gpt2):
    pair = _one_pair(prompt_text="say <|endoftext|> twice")
    result = tokenize_pairs(PairTokenizer(gpt2), [pair, _one_pair()], UNLIMITED, "train")
    assert [(r["pair_id"], r["reason"]) for r in result.rejections] == [(pair["pair_id"], "special_token_in_content")]
    assert len(result.rows) == 1


def test_template_without_generation_prompt_is_refused(gpt2_tokenizer_dir, tmp_path):
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    tok = load_tokenizer(gpt2_with_template(gpt2_tokenizer_dir, tmp_path / "nogen", template))
    with pytest.raises(TokenizeError, match="add_generation_prompt"):
        PairTokenizer(tok)


def test_empty_completion_tokens(gpt2):
    [out] = PairTokenizer(gpt2).encode([("User: hi\n\nAssistant:", "User: hi\n\nAssistant:")])
    assert isinstance(out, BranchRejected) and out.reason == "empty_completion_tokens"


def test_tokenizer_identity_tracks_tokenizer_files(gpt2_tokenizer_dir, tmp_path):
    copy = tmp_path / "gpt2"
    shutil.copytree(gpt2_tokenizer_dir, copy)
    assert tokenizer_identity(copy) == tokenizer_identity(gpt2_tokenizer_dir)
    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHATML
    (copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert tokenizer_identity(copy) != tokenizer_identity(gpt2_tokenizer_dir)
    with pytest.raises(TokenizeError, match="no tokenizer files"):
        tokenizer_identity(tmp_path)


# ---------------------------------------------------------------------------------------------
# Bounded cost (issue 26 item 7): characters prove a text over a limit before it is tokenized
# ---------------------------------------------------------------------------------------------

def test_nfc_composes_at_most_nfc_max_composed_characters_into_one():
    import unicodedata

    from stages.data.tokenizer import NFC_MAX_COMPOSED

    longest = max(len(unicodedata.normalize("NFD", chr(c))) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
    assert longest == NFC_MAX_COMPOSED


@pytest.mark.parametrize("tokenizer, ratio", [("gpt2", 128), ("embedded", 4 * 15)])
def test_characters_per_token_bound_holds_on_adversarial_and_real_text(request, hh_pairs, tokenizer, ratio):
    """R from the vocabulary (GPT-2's longest token is 128 bytes; the embedded tokenizer's 15 characters, under NFC)
    and no text of more than n * R characters has n tokens or fewer: the longest tokens repeated, decomposed
    accents NFC composes, real HH text. (A bound that failed would reject pairs that fit.)"""
    from stages.data.tokenizer import max_chars_per_token

    backend = PairTokenizer(request.getfixturevalue(tokenizer)).backend
    assert max_chars_per_token(backend) == ratio
    vocab = backend.get_vocab()
    longest = sorted(vocab, key=len)[-20:]
    texts = [backend.decode([vocab[t]] * 50) for t in longest]
    texts += ["e\u0301" * 5000, "\u1100\u1161\u11a8" * 3000, "\u03b1\u0313\u0300\u0345" * 3000]
    texts += [m["content"] for p in hh_pairs[:200] for m in p["prompt"] + p["chosen"]]
    for text in texts:
        n = len(backend.encode(text, add_special_tokens=False).ids)
        assert len(text) <= n * ratio, (text[:40], n)
