"""tokenize stage: real GPT-2 tokenizer on real HH-RLHF pairs, plain and chat-template renderings.

The HH transcripts are parsed here in the simplest way (prompt = turns before the last
"\\n\\nAssistant:"); the real parser is the normalize stage's.
"""
from __future__ import annotations

import functools
import gzip
import json
import logging
import os
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pytest

from conftest import REPO_ROOT
from stages.lib.io import read_json, read_parquet, sha256_json, write_json, write_parquet
from stages.lib.contracts import row_content_hash as content_hash, token_hash
from stages.tokenize import (TRUNCATION_REASONS, BranchRejected, PairTokenizer, TokenizeError, TokenizeLimits,
                             check_pairs, check_probe_complete, check_probe_matches_manifest,
                             completion_start, load_tokenizer, render_plain, run,
                             split_report, tokenize_pairs, tokenizer_identity, write_outputs)

LOG = logging.getLogger("test_tokenize")
UNLIMITED = TokenizeLimits(max_length=10**6, max_prompt_length=10**6 - 1, truncation="reject")
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Generation prompt ends with a space: byte-level BPE glues that space onto the answer's first word.
SPACE_ENDED = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}"
               "{% if add_generation_prompt %}assistant: {% endif %}")
# No end-of-turn marker after the assistant turn: the stage must append EOS itself.
NO_END_MARKER = ("{% for m in messages %}{{ m.role }}:\n{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:\n{% endif %}")


# ---------------------------------------------------------------------------------------------
# Real data helpers
# ---------------------------------------------------------------------------------------------

def parse_hh(chosen: str, rejected: str) -> dict | None:
    tag = "\n\nAssistant:"
    cut = chosen.rfind(tag)
    prefix = chosen[:cut]
    if cut < 0 or not rejected.startswith(prefix + tag):
        return None
    parts = re.split(r"\n\n(Human|Assistant):", prefix)
    if parts[0] != "":
        return None
    prompt = [{"role": "user" if parts[k] == "Human" else "assistant", "content": parts[k + 1].strip()}
              for k in range(1, len(parts), 2)]
    pair = {"prompt": prompt,
            "chosen": [{"role": "assistant", "content": chosen[cut + len(tag):].strip()}],
            "rejected": [{"role": "assistant", "content": rejected[cut + len(tag):].strip()}]}
    return pair


def as_pair(messages: dict, row: int) -> dict:
    h = content_hash(messages)
    return {"pair_id": h[:24], "content_hash": h, "source": "hh", **messages, "margin": None,
            "src_file": "harmless-base-test.jsonl.gz", "src_row": row}


def load_hh_pairs(path: Path, limit: int | None = None) -> list[dict]:
    pairs, seen = [], set()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for row, line in enumerate(f):
            rec = json.loads(line)
            messages = parse_hh(rec["chosen"], rec["rejected"])
            if messages is None or messages["chosen"] == messages["rejected"]:
                continue
            pair = as_pair(messages, row)
            if pair["pair_id"] in seen:
                continue
            seen.add(pair["pair_id"])
            pairs.append(pair)
            if limit is not None and len(pairs) == limit:
                break
    return pairs


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def gpt2_with_template(src: Path, dst: Path, template: str, extra_specials=()) -> Path:
    """A copy of the real GPT-2 tokenizer saved with a chat template (and extra special tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    if extra_specials:
        tok.add_special_tokens({"additional_special_tokens": list(extra_specials)})
    tok.chat_template = template
    tok.save_pretrained(str(dst))
    return dst


@pytest.fixture
def hh_pairs(hh_rlhf_path) -> list[dict]:
    return load_hh_pairs(hh_rlhf_path)


@functools.lru_cache(maxsize=None)
def _load_tokenizer_once(path: Path):
    return load_tokenizer(path)


@pytest.fixture
def gpt2(gpt2_tokenizer_dir):
    return _load_tokenizer_once(gpt2_tokenizer_dir)


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


# ---------------------------------------------------------------------------------------------
# Truncation policies
# ---------------------------------------------------------------------------------------------

def test_limits_validation():
    with pytest.raises(TokenizeError, match="max_prompt_length"):
        TokenizeLimits.from_params({"max_length": 64, "max_prompt_length": 64, "truncation": "reject"})
    with pytest.raises(TokenizeError, match="truncation"):
        TokenizeLimits.from_params({"max_length": 64, "max_prompt_length": 32, "truncation": "left"})


def _expected_reason(full_row: dict, limits: TokenizeLimits) -> str | None:
    prompt = max(full_row["chosen_prompt_len"], full_row["rejected_prompt_len"])
    if prompt > limits.max_prompt_length:
        return "prompt_too_long"
    if max(len(full_row["chosen_ids"]), len(full_row["rejected_ids"])) > limits.max_length:
        return "sequence_too_long"
    return None


def test_reject_policy_reason_codes(gpt2, hh_pairs):
    pair_tok = PairTokenizer(gpt2)
    full = {r["pair_id"]: r for r in tokenize_pairs(pair_tok, hh_pairs, UNLIMITED, "train").rows}
    limits = TokenizeLimits(max_length=160, max_prompt_length=100, truncation="reject")
    result = tokenize_pairs(pair_tok, hh_pairs, limits, "train")
    expected = {pid: _expected_reason(r, limits) for pid, r in full.items()}
    got = {r["pair_id"]: r["reason"] for r in result.rejections}
    assert got == {pid: reason for pid, reason in expected.items() if reason}
    assert set(got.values()) == {"prompt_too_long", "sequence_too_long"}  # both occur on real data
    assert [r["pair_id"] for r in result.rows] == [p["pair_id"] for p in hh_pairs if not expected[p["pair_id"]]]
    for row in result.rows:  # kept pairs are untouched
        assert row == full[row["pair_id"]]
    rej = next(r for r in result.rejections if r["reason"] == "sequence_too_long")
    assert rej["src_file"] == "harmless-base-test.jsonl.gz" and rej["chosen_tokens"] == len(full[rej["pair_id"]]["chosen_ids"])


def test_truncate_completion_policy(gpt2, hh_pairs):
    pair_tok = PairTokenizer(gpt2)
    full = {r["pair_id"]: r for r in tokenize_pairs(pair_tok, hh_pairs, UNLIMITED, "train").rows}
    limits = TokenizeLimits(max_length=160, max_prompt_length=100, truncation="truncate_completion")
    result = tokenize_pairs(pair_tok, hh_pairs, limits, "train")
    reasons = {pid: _expected_reason(r, limits) for pid, r in full.items()}
    assert {r["pair_id"]: r["reason"] for r in result.rejections} == {
        pid: "prompt_too_long" for pid, reason in reasons.items() if reason == "prompt_too_long"}
    assert result.truncated == sum(reason == "sequence_too_long" for reason in reasons.values()) > 0
    for row in result.rows:
        ref = full[row["pair_id"]]
        for side in ("chosen", "rejected"):
            ids = row[f"{side}_ids"]
            assert ids == ref[f"{side}_ids"][:limits.max_length]
            assert row[f"{side}_prompt_len"] == ref[f"{side}_prompt_len"] < len(ids) <= limits.max_length
        if reasons[row["pair_id"]] == "sequence_too_long":
            assert row != ref and row["token_hash"] != ref["token_hash"]
    assert [t["pair_id"] for t in result.truncations] == [
        p["pair_id"] for p in hh_pairs if reasons[p["pair_id"]] == "sequence_too_long"]
    assert {t["reason"] for t in result.truncations} == {"completion_cut"}
    assert split_report(result)["truncated_by_reason"] == {"completion_cut": result.truncated,
                                                           "prompt_turns_dropped": 0, "prompt_text_cut": 0}


# keep_end -------------------------------------------------------------------------------------

EMBEDDED_REF = REPO_ROOT / "models" / "tiny-qwen2"


def S(c):
    return {"role": "system", "content": c}


def U(c):
    return {"role": "user", "content": c}


def A(c):
    return {"role": "assistant", "content": c}


@pytest.fixture
def embedded():
    """The default reference's tokenizer (751 tokens, a ChatML template), always in the checkout."""
    return _load_tokenizer_once(EMBEDDED_REF)


def expected_branch(tok, prompt: list[dict], completion: list[dict]) -> tuple[list[int], str]:
    """(ids, prompt text) of one branch, spelled with the HF tokenizer itself (module docstring's rendering)."""
    if tok.chat_template:
        prompt_text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        full_text = tok.apply_chat_template(prompt + completion, tokenize=False)
        return tok(full_text, add_special_tokens=False)["input_ids"], prompt_text
    prompt_text, full_text = render_plain(prompt, completion)
    return tok(full_text + tok.eos_token)["input_ids"], prompt_text


def kept_prompt(pair: dict, record: dict) -> list[dict]:
    """The prompt keep_end kept, rebuilt from its truncation record."""
    prompt = pair["prompt"]
    head = 1 if prompt[0]["role"] == "system" else 0
    kept = prompt[:head] + prompt[head + record["prompt_messages_dropped"]:]
    first = kept[head]
    return kept[:head] + [{**first, "content": first["content"][record["prompt_chars_dropped"]:]}] + kept[head + 1:]


def fits(pair_tok: PairTokenizer, prompt: list[dict], pair: dict, limits: TokenizeLimits) -> bool:
    [row] = tokenize_pairs(pair_tok, [dict(pair, prompt=prompt)], UNLIMITED, "train").rows
    return _expected_reason(row, limits) is None


def test_limits_accept_keep_end():
    limits = TokenizeLimits.from_params({"max_length": 64, "max_prompt_length": 32, "truncation": "keep_end"})
    assert limits.as_dict() == {"max_length": 64, "max_prompt_length": 32, "truncation": "keep_end"}


@pytest.mark.parametrize("tokenizer, limits", [
    ("gpt2", TokenizeLimits(max_length=256, max_prompt_length=128, truncation="keep_end")),
    ("embedded", TokenizeLimits(max_length=1024, max_prompt_length=256, truncation="keep_end")),
])
def test_keep_end_on_real_hh_rows_longer_than_the_limits(request, hh_pairs, tokenizer, limits):
    """Every pair over a limit is cut from the left (oldest turns first), keeps its whole completions and
    is exactly the tokenization of the kept conversation; what cannot fit is a reason-coded rejection."""
    tok = request.getfixturevalue(tokenizer)
    pair_tok = PairTokenizer(tok)
    full = {r["pair_id"]: r for r in tokenize_pairs(pair_tok, hh_pairs, UNLIMITED, "train").rows}
    result = tokenize_pairs(pair_tok, hh_pairs, limits, "train")
    over = {pid for pid, r in full.items() if _expected_reason(r, limits)}
    records = {t["pair_id"]: t for t in result.truncations}
    rejected = {r["pair_id"]: r for r in result.rejections}
    assert set(records) | set(rejected) == over and not set(records) & set(rejected)
    assert len(records) > 100
    assert {t["reason"] for t in records.values()} == {"prompt_turns_dropped", "prompt_text_cut"}
    assert {r["reason"] for r in rejected.values()} == {"sequence_too_long"}
    assert [r["pair_id"] for r in result.rows] == [p["pair_id"] for p in hh_pairs if p["pair_id"] not in rejected]
    pairs = {p["pair_id"]: p for p in hh_pairs}
    for row in result.rows:
        ref = full[row["pair_id"]]
        if row["pair_id"] not in records:
            assert row == ref  # pairs within the limits are untouched
            continue
        record, pair = records[row["pair_id"]], pairs[row["pair_id"]]
        kept = kept_prompt(pair, record)
        for side in ("chosen", "rejected"):
            ids, n = row[f"{side}_ids"], row[f"{side}_prompt_len"]
            want_ids, prompt_text = expected_branch(tok, kept, pair[side])
            assert ids == want_ids and decode(tok, ids[:n]) == prompt_text
            assert ids[n:] == ref[f"{side}_ids"][ref[f"{side}_prompt_len"]:]  # the whole completion
            assert n <= limits.max_prompt_length and len(ids) <= limits.max_length
            assert record[f"{side}_tokens"] == len(ids) and record[f"{side}_tokens_before"] == len(ref[f"{side}_ids"])
        assert record["prompt_tokens"] == row["chosen_prompt_len"] < record["prompt_tokens_before"]
        assert row["token_hash"] == token_hash(row["chosen_ids"], row["chosen_prompt_len"], row["rejected_ids"],
                                               row["rejected_prompt_len"]) != ref["token_hash"]
        dropped = record["prompt_messages_dropped"]
        if record["reason"] == "prompt_turns_dropped":
            # The newest turns, from a user turn on, whole; starting at the user turn before would not fit.
            assert record["prompt_chars_dropped"] == 0 and dropped > 0
            assert kept == pair["prompt"][dropped:] and kept[0]["role"] == "user"
            before = max(j for j in range(dropped) if pair["prompt"][j]["role"] == "user")
            assert not fits(pair_tok, pair["prompt"][before:], pair, limits)
        else:
            # Even the last user turn alone does not fit: its text is cut from the left, at a word start.
            text, cut = pair["prompt"][-1]["content"], record["prompt_chars_dropped"]
            assert dropped == len(pair["prompt"]) - 1 and kept == [U(text[cut:])]
            assert not fits(pair_tok, pair["prompt"][-1:], pair, limits)
            assert 0 < cut < len(text) and not text[cut].isspace()
            if not text[cut - 1].isspace():  # mid-word only when no later word start fits
                word = re.search(r"\s\S", text[cut:])
                assert word is None or not fits(pair_tok, [U(text[cut + word.start() + 1:])], pair, limits)
    for pid, rejection in rejected.items():
        ref = full[pid]
        completion = max(len(ref["chosen_ids"]) - ref["chosen_prompt_len"],
                         len(ref["rejected_ids"]) - ref["rejected_prompt_len"])
        assert completion > limits.max_length - 16, rejection  # the completion alone (nearly) fills max_length
        assert "keep_end cannot fit the pair" in rejection["detail"]
        assert rejection["chosen_tokens"] == len(ref["chosen_ids"])
    counts = split_report(result)["truncated_by_reason"]
    assert counts == {reason: sum(t["reason"] == reason for t in records.values()) for reason in TRUNCATION_REASONS}
    assert result.truncated == len(records) and counts["completion_cut"] == 0


def test_keep_end_keeps_the_system_message_and_cuts_at_turns_then_words(embedded):
    pair_tok = PairTokenizer(embedded)
    old = " ".join(f"old{i}" for i in range(150))
    pair = as_pair({"prompt": [S("Answer briefly."), U(old), A(old), U("And the sky?")],
                    "chosen": [A("Blue.")], "rejected": [A("Green, I think.")]}, 0)
    limits = TokenizeLimits(max_length=96, max_prompt_length=64, truncation="keep_end")
    result = tokenize_pairs(pair_tok, [pair], limits, "probe")
    [record] = result.truncations
    assert (record["reason"], record["prompt_messages_dropped"], record["exceeded"]) == (
        "prompt_turns_dropped", 2, ["max_prompt_length", "max_length"])
    [row] = result.rows
    n = row["chosen_prompt_len"]
    assert decode(embedded, row["chosen_ids"][:n]) == embedded.apply_chat_template(
        [S("Answer briefly."), U("And the sky?")], add_generation_prompt=True, tokenize=False)

    # One long user turn: its text is cut from the left at the latest word start that fits.
    words = [f"w{i}" for i in range(300)]
    pair = as_pair({"prompt": [S("Answer briefly."), U(" ".join(words))], "chosen": [A("Blue.")],
                    "rejected": [A("Green.")]}, 1)
    [record] = tokenize_pairs(pair_tok, [pair], limits, "probe").truncations
    assert record["reason"] == "prompt_text_cut" and record["prompt_messages_dropped"] == 0
    kept = kept_prompt(pair, record)
    k = words.index(kept[1]["content"].split(" ")[0])
    assert kept == [S("Answer briefly."), U(" ".join(words[k:]))]
    assert fits(pair_tok, kept, pair, limits)
    assert not fits(pair_tok, [S("Answer briefly."), U(" ".join(words[k - 1:]))], pair, limits)

    # Nothing can fit: a completion alone over max_length; a system message (kept) over max_prompt_length.
    long_answer = as_pair({"prompt": [U("Q?")], "chosen": [A(" ".join(words))], "rejected": [A("No.")]}, 2)
    long_system = as_pair({"prompt": [S(" ".join(words)), U("Q?")], "chosen": [A("Yes.")], "rejected": [A("No.")]}, 3)
    result = tokenize_pairs(pair_tok, [long_answer, long_system], limits, "probe")
    assert result.rows == [] and result.truncations == []
    assert [r["reason"] for r in result.rejections] == ["sequence_too_long", "prompt_too_long"]
    with pytest.raises(TokenizeError, match="2 of 2 probe pairs cannot be tokenized .*truncation=keep_end"):
        check_probe_complete(result, limits)


# ---------------------------------------------------------------------------------------------
# Probe integrity and the whole stage (run + write_outputs; main() needs verify_ref)
# ---------------------------------------------------------------------------------------------

PAIRS_SCHEMA = pa.schema([
    ("pair_id", pa.string()), ("content_hash", pa.string()), ("source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("chosen", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("rejected", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("margin", pa.float64()), ("src_file", pa.string()), ("src_row", pa.int64()),
])


def probe_manifest(probe: list[dict]) -> dict:
    ids, hashes = [p["pair_id"] for p in probe], [p["content_hash"] for p in probe]
    return {"size": len(probe), "seed": 1, "selection": "test", "pair_ids": ids, "content_hashes": hashes,
            "probe_digest": sha256_json([[i, h] for i, h in zip(ids, hashes)])}


def write_probe_inputs(d: Path, train: list[dict], probe: list[dict], manifest: dict | None = None) -> dict:
    d.mkdir(parents=True, exist_ok=True)
    write_parquet(d / "train.parquet", pa.Table.from_pylist(train, schema=PAIRS_SCHEMA))
    write_parquet(d / "probe.parquet", pa.Table.from_pylist(probe, schema=PAIRS_SCHEMA))
    write_json(d / "probe_manifest.json", manifest or probe_manifest(probe))
    return {"train_path": str(d / "train.parquet"), "probe_path": str(d / "probe.parquet"),
            "manifest_path": str(d / "probe_manifest.json")}


def run_and_write(limits, tok_dir, inputs: dict, out: Path) -> dict:
    results = run(limits, tok_dir, log=LOG, **inputs)
    paths = {"train_tokens": out / "train_tokens.parquet", "probe_tokens": out / "probe_tokens.parquet",
             "probe_token_manifest": out / "probe_token_manifest.json",
             "report_path": out / "tokenize_report.json", "rejections": out / "token_rejections.parquet"}
    write_outputs(*results, **paths)
    return paths


PROBE_FITS = TokenizeLimits(max_length=256, max_prompt_length=200, truncation="reject")


@pytest.fixture
def split_pairs(gpt2, hh_pairs):
    """(train, probe): 400 real pairs; the probe is 40 of those that fit PROBE_FITS, in a fixed shuffled order."""
    margins = [None, 0.5, 2.0]
    pairs = [dict(p, margin=margins[i % 3]) for i, p in enumerate(hh_pairs[:400])]
    fitting = {r["pair_id"] for r in tokenize_pairs(PairTokenizer(gpt2), pairs, PROBE_FITS, "probe").rows}
    probe_ids = {p["pair_id"] for p in pairs if p["pair_id"] in fitting}
    probe_ids = set(sorted(probe_ids)[:40])
    probe = sorted((p for p in pairs if p["pair_id"] in probe_ids), key=lambda p: sha256_json(["probe", p["pair_id"]]))
    return sorted((p for p in pairs if p["pair_id"] not in probe_ids), key=lambda p: p["pair_id"]), probe


def test_stage_outputs_are_deterministic_and_bind_the_probe(gpt2_tokenizer_dir, split_pairs, tmp_path):
    train, probe = split_pairs
    inputs = write_probe_inputs(tmp_path / "in", train, probe)
    limits = PROBE_FITS
    a = run_and_write(limits, gpt2_tokenizer_dir, inputs, tmp_path / "a")
    b = run_and_write(limits, gpt2_tokenizer_dir, inputs, tmp_path / "b")
    for key in a:
        assert Path(a[key]).read_bytes() == Path(b[key]).read_bytes(), key

    probe_tokens = read_parquet(a["probe_tokens"])
    assert probe_tokens.schema.field("chosen_ids").type == pa.list_(pa.int32())
    assert probe_tokens.schema.field("chosen_prompt_len").type == pa.int32()
    rows = probe_tokens.to_pylist()
    assert [r["pair_id"] for r in rows] == [p["pair_id"] for p in probe]
    assert [r["margin"] for r in rows] == [p["margin"] for p in probe]
    manifest, frozen = read_json(a["probe_token_manifest"]), read_json(inputs["manifest_path"])
    assert manifest["pair_ids"] == frozen["pair_ids"]
    assert manifest["probe_digest"] == frozen["probe_digest"]
    assert manifest["token_hashes"] == [token_hash(r["chosen_ids"], r["chosen_prompt_len"],
                                                   r["rejected_ids"], r["rejected_prompt_len"]) for r in rows]
    assert manifest["token_digest"] == sha256_json([[r["pair_id"], r["token_hash"]] for r in rows])
    assert manifest["tokenizer_identity"] == tokenizer_identity(gpt2_tokenizer_dir)

    report = read_json(a["report_path"])
    rejections = read_parquet(a["rejections"]).to_pylist()
    train_tokens = read_parquet(a["train_tokens"]).to_pylist()
    assert report["splits"]["probe"]["pairs_out"] == len(probe) and report["splits"]["probe"]["rejected"] == 0
    assert report["splits"]["train"]["pairs_out"] == len(train_tokens)
    assert report["splits"]["train"]["rejected"] == len(rejections) > 0
    assert len(train_tokens) + len(rejections) == len(train)
    assert {r["split"] for r in rejections} == {"train"}
    assert report["totals"]["rejected_by_reason"] == {
        reason: sum(r["reason"] == reason for r in rejections) for reason in {r["reason"] for r in rejections}}
    assert all(len(r["chosen_ids"]) <= 256 and r["chosen_prompt_len"] <= 200 for r in train_tokens)


def test_keep_end_probe_pairs_are_recorded_and_evaluate_checks_the_record(gpt2_tokenizer_dir, gpt2, hh_pairs,
                                                                          tmp_path):
    from stages.lib.scoring import ProbeMismatchError, check_manifests

    limits = TokenizeLimits(max_length=256, max_prompt_length=128, truncation="keep_end")
    pairs = hh_pairs[:400]
    first = tokenize_pairs(PairTokenizer(gpt2), pairs, limits, "probe")
    truncated = {t["pair_id"] for t in first.truncations}
    kept = [r["pair_id"] for r in first.rows]
    probe_ids = set([pid for pid in kept if pid in truncated][:20] + [pid for pid in kept if pid not in truncated][:20])
    probe = sorted((p for p in pairs if p["pair_id"] in probe_ids), key=lambda p: sha256_json(["probe", p["pair_id"]]))
    train = [p for p in pairs if p["pair_id"] not in probe_ids]
    inputs = write_probe_inputs(tmp_path / "in", train, probe)
    a = run_and_write(limits, gpt2_tokenizer_dir, inputs, tmp_path / "a")
    b = run_and_write(limits, gpt2_tokenizer_dir, inputs, tmp_path / "b")
    for key in a:
        assert Path(a[key]).read_bytes() == Path(b[key]).read_bytes(), key

    manifest = read_json(a["probe_token_manifest"])
    assert manifest["limits"] == limits.as_dict()
    assert [t["pair_id"] for t in manifest["truncated"]] == [p["pair_id"] for p in probe if p["pair_id"] in truncated]
    rows = read_parquet(a["probe_tokens"]).to_pylist()
    for t in manifest["truncated"]:
        assert manifest["pair_ids"][t["index"]] == t["pair_id"] == rows[t["index"]]["pair_id"]
        assert t["token_hash"] == manifest["token_hashes"][t["index"]] == rows[t["index"]]["token_hash"]
        assert t["reason"] in ("prompt_turns_dropped", "prompt_text_cut")
        assert len(rows[t["index"]]["chosen_ids"]) == t["chosen_tokens"] <= 256
    report = read_json(a["report_path"])
    for split in ("probe", "train"):
        counts = report["splits"][split]["truncated_by_reason"]
        assert set(counts) == set(TRUNCATION_REASONS) and counts["completion_cut"] == 0
        assert sum(counts.values()) == report["splits"][split]["truncated"]
    assert report["splits"]["probe"]["truncated"] == 20 and report["splits"]["probe"]["rejected"] == 0
    assert report["totals"]["truncated_by_reason"] == {
        k: report["splits"]["probe"]["truncated_by_reason"][k] + report["splits"]["train"]["truncated_by_reason"][k]
        for k in TRUNCATION_REASONS}

    # evaluate accepts the record as written and refuses one that does not describe the scored tokens.
    frozen = read_json(inputs["manifest_path"])
    check_manifests(frozen, manifest, len(probe))
    t0 = manifest["truncated"][0]
    bad = {
        "not of the tokens that are scored": [dict(t0, token_hash="0" * 64)] + manifest["truncated"][1:],
        "which is not that probe position": [dict(t0, index=t0["index"] + 1)] + manifest["truncated"][1:],
        "out of probe order or repeated": manifest["truncated"][::-1],
        "has no reason": [dict(t0, reason="")] + manifest["truncated"][1:],
    }
    for match, truncated_list in bad.items():
        with pytest.raises(ProbeMismatchError, match=match):
            check_manifests(frozen, dict(manifest, truncated=truncated_list), len(probe))
    with pytest.raises(ProbeMismatchError, match="recorded under truncation: reject"):
        check_manifests(frozen, dict(manifest, limits=dict(manifest["limits"], truncation="reject")), len(probe))


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


def test_probe_too_long_fails_listing_pairs_and_limits(gpt2_tokenizer_dir, split_pairs, tmp_path):
    train, probe = split_pairs
    inputs = write_probe_inputs(tmp_path / "in", train, probe)
    limits = TokenizeLimits(max_length=128, max_prompt_length=64, truncation="truncate_completion")
    pair_tok = PairTokenizer(load_tokenizer(gpt2_tokenizer_dir))
    too_long = [r["pair_id"] for r in tokenize_pairs(pair_tok, probe, limits, "probe").rejections]
    assert too_long  # real HH prompts exceed 64 tokens
    with pytest.raises(TokenizeError) as e:
        run(limits, gpt2_tokenizer_dir, log=LOG, **inputs)
    msg = str(e.value)
    assert f"{len(too_long)} of {len(probe)} probe pairs" in msg
    assert "max_length=128" in msg and "max_prompt_length=64" in msg and "truncation=truncate_completion" in msg
    assert all(f"{pid} (prompt_too_long" in msg for pid in too_long)


def test_check_probe_complete_passes_when_nothing_rejected(gpt2, split_pairs):
    _, probe = split_pairs
    check_probe_complete(tokenize_pairs(PairTokenizer(gpt2), probe, UNLIMITED, "probe"), UNLIMITED)


def test_probe_must_match_its_manifest(split_pairs):
    _, probe = split_pairs
    manifest = probe_manifest(probe)
    check_probe_matches_manifest(probe, manifest, "probe.parquet", "probe_manifest.json")

    swapped = [probe[1], probe[0], *probe[2:]]
    with pytest.raises(TokenizeError, match="does not hold the probe .*index 0"):
        check_probe_matches_manifest(swapped, manifest, "probe.parquet", "probe_manifest.json")
    with pytest.raises(TokenizeError, match="1 manifest IDs missing"):
        check_probe_matches_manifest(probe[:-1], manifest, "probe.parquet", "probe_manifest.json")
    with pytest.raises(TokenizeError, match="content hashes differ"):
        check_probe_matches_manifest(probe, dict(manifest, content_hashes=["0" * 64] * len(probe)),
                                     "probe.parquet", "probe_manifest.json")
    with pytest.raises(TokenizeError, match="probe digest"):
        check_probe_matches_manifest(probe, dict(manifest, probe_digest="0" * 64), "probe.parquet",
                                     "probe_manifest.json")


def test_run_refuses_edited_or_mismatched_inputs(gpt2_tokenizer_dir, split_pairs, tmp_path):
    train, probe = split_pairs
    # A probe parquet in another order than the frozen manifest.
    inputs = write_probe_inputs(tmp_path / "order", train, probe[::-1], manifest=probe_manifest(probe))
    with pytest.raises(TokenizeError, match="does not hold the probe"):
        run(UNLIMITED, gpt2_tokenizer_dir, log=LOG, **inputs)
    # A completion edited after normalize: its content no longer hashes to its pair ID.
    edited = [dict(p) for p in probe]
    edited[3]["chosen"] = [{"role": "assistant", "content": "something else"}]
    inputs = write_probe_inputs(tmp_path / "edit", train, edited, manifest=probe_manifest(probe))
    with pytest.raises(TokenizeError, match=f"(?s)probe.parquet: 1 pair.*row 3 \\(pair {edited[3]['pair_id']}\\): content_hash"):
        run(UNLIMITED, gpt2_tokenizer_dir, log=LOG, **inputs)
    # A probe pair also in train.
    inputs = write_probe_inputs(tmp_path / "leak", train + probe[:1], probe)
    with pytest.raises(TokenizeError, match="probe pairs are also in"):
        run(UNLIMITED, gpt2_tokenizer_dir, log=LOG, **inputs)
    # A manifest without freeze_probe's shape (contracts.PROBE_MANIFEST_SCHEMA): refused, naming the file.
    inputs = write_probe_inputs(tmp_path / "shape", train, probe, manifest={"size": 3, "pair_ids": "not a list"})
    with pytest.raises(TokenizeError, match=r"probe_manifest.json: not a valid probe manifest \("):
        run(UNLIMITED, gpt2_tokenizer_dir, log=LOG, **inputs)


def test_check_pairs_catches_duplicates(split_pairs):
    train, _ = split_pairs
    check_pairs(train, "train.parquet")
    with pytest.raises(TokenizeError, match="duplicate pair_id"):
        check_pairs(train + train[:1], "train.parquet")


# ---------------------------------------------------------------------------------------------
# Streaming (issues 19, 21): run_streaming, any worker count and chunk size, writes run() + write_outputs()'s bytes
# ---------------------------------------------------------------------------------------------

def test_streaming_stage_is_byte_identical_for_any_workers_and_chunks(gpt2_tokenizer_dir, split_pairs, tmp_path,
                                                                      monkeypatch):
    import stages.lib.io as io
    from stages.tokenize import run_streaming

    monkeypatch.setattr(io, "PARQUET_ROW_GROUP", 50)  # many row groups from 360 train pairs
    train, probe = split_pairs
    inputs = write_probe_inputs(tmp_path / "in", train, probe)
    limits = TokenizeLimits(max_length=256, max_prompt_length=200, truncation="truncate_completion")
    ref = run_and_write(limits, gpt2_tokenizer_dir, inputs, tmp_path / "ref")
    report = read_json(ref["report_path"])["splits"]["train"]
    assert report["rejected"] and report["truncated"] and report["pairs_out"] > 100  # every path is exercised
    # (16, 1000): more workers than the input keeps busy, so plan_pool hands out smaller chunks to fewer processes.
    for workers, chunk in ((1, 1000), (2, 37), (16, 1000)):
        out = tmp_path / f"w{workers}"
        paths = {k: out / Path(v).name for k, v in ref.items()}
        run_streaming(limits, gpt2_tokenizer_dir, log=LOG, workers=workers, chunk_pairs=chunk, **inputs, **paths)
        for key in ref:
            assert Path(paths[key]).read_bytes() == Path(ref[key]).read_bytes(), (workers, key)

    # Bad train rows are refused as run() refuses them, naming the row, and no output appears.
    edited = [dict(p) for p in train]
    edited[45]["chosen"] = [{"role": "assistant", "content": "something else"}]
    bad = write_probe_inputs(tmp_path / "edit", edited + train[:1], probe)
    out = tmp_path / "bad"
    with pytest.raises(TokenizeError, match=r"(?s)train.parquet: 2 pair.*row 45 \(pair .*rows 0 and 360: duplicate"):
        run_streaming(limits, gpt2_tokenizer_dir, log=LOG, workers=2, chunk_pairs=37, **bad,
                      **{k: out / Path(v).name for k, v in ref.items()})
    assert not out.exists() or not any(out.iterdir())


def test_plan_pool_sizes_the_pool_to_the_work():
    from stages.tokenize import MIN_CHUNK_PAIRS, plan_pool

    # HH on a 16-core GPU host: every worker gets train chunks, and the probe is split too.
    plan = plan_pool(1786, 512, 16, 1024)
    assert plan.processes == 16
    assert plan.train_chunk == -(-1786 // 16) and plan.probe_chunk == MIN_CHUNK_PAIRS
    # A tiny input is not worth a pool: one process, the whole input as one chunk of each split.
    plan = plan_pool(40, 20, 16, 1024)
    assert plan.processes == 1 and plan.train_chunk == MIN_CHUNK_PAIRS
    # A large input keeps the --chunk-pairs cap (bounded memory) and every worker.
    assert plan_pool(10**6, 512, 16, 1024) == type(plan)(16, 1024, MIN_CHUNK_PAIRS)
    assert plan_pool(1000, 10, 4, 7) == type(plan)(4, 7, 7)   # a chunk cap under MIN_CHUNK_PAIRS is kept
    for n_train, n_probe, workers, cap in ((0, 5, 8, 1024), (1, 0, 1, 1), (999, 3, 3, 50), (5000, 512, 64, 1024)):
        plan = plan_pool(n_train, n_probe, workers, cap)
        chunks = -(-n_train // plan.train_chunk) + -(-n_probe // plan.probe_chunk)
        assert 1 <= plan.processes <= max(1, min(workers, chunks, -(-(n_train + n_probe) // MIN_CHUNK_PAIRS)))
        assert 1 <= plan.train_chunk <= cap and 1 <= plan.probe_chunk <= cap
    with pytest.raises(TokenizeError, match="--chunk-pairs must be >= 1"):
        plan_pool(10, 10, 2, 0)


def test_streaming_refuses_an_incomplete_probe_tokenized_by_the_pool(gpt2_tokenizer_dir, split_pairs, tmp_path):
    """The probe's pieces run in the pool beside the train chunks: a probe pair that cannot fit still fails the
    stage before any output appears, naming the pair."""
    from stages.tokenize import run_streaming

    train, probe = split_pairs
    inputs = write_probe_inputs(tmp_path / "in", train, probe)
    limits = TokenizeLimits(max_length=40, max_prompt_length=30, truncation="reject")
    out = tmp_path / "out"
    paths = {"train_tokens": out / "train_tokens.parquet", "probe_tokens": out / "probe_tokens.parquet",
             "probe_token_manifest": out / "probe_token_manifest.json",
             "report_path": out / "tokenize_report.json", "rejections": out / "token_rejections.parquet"}
    with pytest.raises(TokenizeError, match=f"of {len(probe)} probe pairs cannot be tokenized under max_length=40"):
        run_streaming(limits, gpt2_tokenizer_dir, log=LOG, workers=2, chunk_pairs=16, **inputs, **paths)
    assert not out.exists() or not any(out.iterdir())


def pinned_gpt2_identity(gpt2_tokenizer_dir: Path, tmp_path: Path) -> Path:
    """ref_identity.json of the real GPT-2 tokenizer beside a tiny random GPT-2, pinned as a user's local
    reference is (tokenize reads the tokenizer through the verified identity)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from stages import verify_ref

    ref_dir = tmp_path / "gpt2"
    shutil.copytree(gpt2_tokenizer_dir, ref_dir)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=1024)).save_pretrained(str(ref_dir))
    revision = verify_ref.pin(ref_dir, "test/gpt2")
    identity = tmp_path / "ref_identity.json"
    write_json(identity, verify_ref.verify_reference({"source": "local", "repo_id": "test/gpt2", "revision": revision,
                                                      "local_dir": str(ref_dir)}))
    return identity


def test_stage_process_never_imports_torch_and_writes_the_same_bytes(gpt2_tokenizer_dir, split_pairs, tmp_path):
    """`python -m stages.tokenize` loads the tokenizer through transformers without torch (tokenizers_only_process):
    -X importtime lists every module the process imported, and torch is none of them; its outputs are the
    in-process stage's bytes (main() inside another program keeps torch available)."""
    import subprocess
    import sys

    import yaml

    identity = pinned_gpt2_identity(gpt2_tokenizer_dir, tmp_path)
    train, probe = split_pairs
    inputs = write_probe_inputs(tmp_path / "in", train, probe)
    limits = TokenizeLimits(max_length=256, max_prompt_length=200, truncation="keep_end")
    ref = run_and_write(limits, gpt2_tokenizer_dir, inputs, tmp_path / "ref")
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["tokenize"].update(limits.as_dict(), workers=2)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    out = tmp_path / "cli"
    flags = {"train_tokens": "--train-tokens", "probe_tokens": "--probe-tokens", "report_path": "--report",
             "probe_token_manifest": "--probe-token-manifest", "rejections": "--rejections"}
    outputs = [a for key, path in ref.items() for a in (flags[key], out / Path(path).name)]
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "stages.tokenize", "--params", tmp_path / "params.yaml",
                        "--identity", identity, "--train", inputs["train_path"], "--probe", inputs["probe_path"],
                        "--probe-manifest", inputs["manifest_path"], "--chunk-pairs", "50", *outputs,
                        "--log", tmp_path / "tokenize.log"],
                       cwd=REPO_ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    imported = [line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
    assert "transformers.models.gpt2.tokenization_gpt2" in imported or "tokenizers" in imported
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]
    for key, path in ref.items():
        assert (out / Path(path).name).read_bytes() == Path(path).read_bytes(), key


# ---------------------------------------------------------------------------------------------
# Bounded cost (issue 26 item 7): characters prove a text over a limit before it is tokenized
# ---------------------------------------------------------------------------------------------

def test_nfc_composes_at_most_nfc_max_composed_characters_into_one():
    import unicodedata

    from stages.tokenize import NFC_MAX_COMPOSED

    longest = max(len(unicodedata.normalize("NFD", chr(c))) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
    assert longest == NFC_MAX_COMPOSED


@pytest.mark.parametrize("tokenizer, ratio", [("gpt2", 128), ("embedded", 4 * 15)])
def test_characters_per_token_bound_holds_on_adversarial_and_real_text(request, hh_pairs, tokenizer, ratio):
    """R from the vocabulary (GPT-2's longest token is 128 bytes; the embedded tokenizer's 15 characters, under NFC)
    and no text of more than n * R characters has n tokens or fewer: the longest tokens repeated, decomposed
    accents NFC composes, real HH text. (A bound that failed would reject pairs that fit.)"""
    from stages.tokenize import max_chars_per_token

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


GUARD_LIMITS = {"max_length": 64, "max_prompt_length": 48}


def _long(text: str, chars: int) -> str:
    """`text` repeated past `chars` characters: real words, so spaces between letters to cut at."""
    return " ".join([text] * (chars // max(1, len(text)) + 2))


def _short_prompts(hh_pairs: list[dict]) -> list[dict]:
    """Real pairs whose one-turn prompt fits GUARD_LIMITS (so what decides is the long text added to them)."""
    return [p for p in hh_pairs if len(p["prompt"]) == 1 and len(p["prompt"][0]["content"]) < 120]


def _strip_before_counts(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.endswith("_tokens_before") and k != "prompt_tokens_before"}


def test_an_over_long_row_is_rejected_by_its_characters_without_tokenizing_it(gpt2, hh_pairs):
    """reject: a completion of 300,000 characters (over 64 tokens x 128 characters) is sequence_too_long, its
    token count null (only its first tokens were made: the prompt's count is exact); a prompt over 48 x 128
    characters is prompt_too_long without any token. Same reasons as tokenizing everything. Before: every row
    was tokenized whole (a 50 MB row: 4 minutes, 12.4 GB)."""
    limits = TokenizeLimits(truncation="reject", **GUARD_LIMITS)
    base = _short_prompts(hh_pairs)[0]
    long_completion = as_pair({"prompt": base["prompt"], "chosen": [A(_long(base["chosen"][0]["content"], 300_000))],
                               "rejected": base["rejected"]}, 1)
    long_prompt = as_pair({"prompt": [U(_long(base["prompt"][0]["content"], 10_000))],
                           "chosen": base["chosen"], "rejected": base["rejected"]}, 2)
    bounded = tokenize_pairs(PairTokenizer(gpt2), [long_completion, long_prompt], limits, "train")
    whole = tokenize_pairs(PairTokenizer(gpt2, bound_chars=False), [long_completion, long_prompt], limits, "train")
    assert [r["reason"] for r in bounded.rejections] == [r["reason"] for r in whole.rejections] == [
        "sequence_too_long", "prompt_too_long"]
    by_chars, prompt_over = bounded.rejections
    assert by_chars["chosen_tokens"] is None and by_chars["rejected_tokens"] == whole.rejections[0]["rejected_tokens"]
    assert by_chars["prompt_tokens"] == whole.rejections[0]["prompt_tokens"]
    assert re.match(r"chosen \d+\+ \(cut before tokenizing\) / rejected \d+ tokens; max_length 64$", by_chars["detail"])
    assert prompt_over["prompt_tokens"] is None and "not tokenized: its prompt has" in prompt_over["detail"]
    assert "more than max_prompt_length 48 tokens can hold (6144 characters" in prompt_over["detail"]


def test_truncate_completion_cuts_the_text_first_and_keeps_the_same_tokens(gpt2, hh_pairs):
    """truncate_completion: completions over 64 x 128 characters are cut at a space past that bound before
    tokenizing; the kept tokens are those of the whole text (the real GPT-2 tokenizer on the whole rendering),
    the records differ only in the untokenized branch's count (null)."""
    limits = TokenizeLimits(truncation="truncate_completion", **GUARD_LIMITS)
    pairs = [as_pair({"prompt": p["prompt"], "chosen": [A(_long(p["chosen"][0]["content"], 20_000))],
                      "rejected": [A(_long(p["rejected"][0]["content"], 9_000 + 1000 * k))]}, k)
             for k, p in enumerate(_short_prompts(hh_pairs)[:12])]
    bounded = tokenize_pairs(PairTokenizer(gpt2), pairs, limits, "train")
    whole = tokenize_pairs(PairTokenizer(gpt2, bound_chars=False), pairs, limits, "train")
    assert len(bounded.rows) == len(pairs) == 12 and bounded.rows == whole.rows
    for pair, row in zip(pairs, bounded.rows):
        want, prompt_text = expected_branch(gpt2, pair["prompt"], pair["chosen"])
        assert row["chosen_ids"] == want[:limits.max_length]
    for cut, ref in zip(bounded.truncations, whole.truncations):
        assert cut["chosen_tokens_before"] is None and ref["chosen_tokens_before"] > limits.max_length
        assert _strip_before_counts(cut) == _strip_before_counts(ref)


def test_keep_end_never_tokenizes_a_prompt_it_cannot_keep_and_keeps_the_same_tokens(gpt2, hh_pairs):
    """keep_end: a prompt over 64 x 128 characters (a huge last turn, or a huge older turn) is not tokenized,
    nor is any shorter candidate over the bound; the search makes the same choices, so the kept tokens equal
    those of tokenizing every candidate whole. A completion over the bound cannot fit: sequence_too_long."""
    limits = TokenizeLimits(truncation="keep_end", **GUARD_LIMITS)
    pairs = []
    for k, p in enumerate(hh_pairs[:10]):
        text = p["prompt"][-1]["content"]
        pairs.append(as_pair({"prompt": p["prompt"][:-1] + [U(_long(text, 12_000))], "chosen": p["chosen"],
                              "rejected": p["rejected"]}, 2 * k))
        pairs.append(as_pair({"prompt": [U(_long(text, 12_000)), A("Sure."), U("Shorter?")], "chosen": p["chosen"],
                              "rejected": p["rejected"]}, 2 * k + 1))
    base = _short_prompts(hh_pairs)[0]
    pairs.append(as_pair({"prompt": base["prompt"], "chosen": [A(_long("a b", 9_000))],
                          "rejected": base["rejected"]}, 99))
    bounded = tokenize_pairs(PairTokenizer(gpt2), pairs, limits, "train")
    whole = tokenize_pairs(PairTokenizer(gpt2, bound_chars=False), pairs, limits, "train")
    assert bounded.rows == whole.rows and len(bounded.rows) >= 10
    assert [r["reason"] for r in bounded.rejections] == [r["reason"] for r in whole.rejections]
    assert bounded.rejections[-1]["pair_id"] == pairs[-1]["pair_id"]
    assert {t["reason"] for t in bounded.truncations} == {"prompt_turns_dropped", "prompt_text_cut"}
    for cut, ref in zip(bounded.truncations, whole.truncations):
        assert cut["prompt_tokens_before"] is None and ref["prompt_tokens_before"] > limits.max_length
        assert _strip_before_counts(cut) == _strip_before_counts(ref)


def tokenize_cli(identity: Path, inputs: dict, out: Path, params: Path, *extra: str) -> list[str]:
    """The stage's command line (`python -m stages.tokenize`, as the Snakemake rule runs it)."""
    import sys

    return [sys.executable, "-m", "stages.tokenize", "--params", str(params), "--identity", str(identity),
            "--train", inputs["train_path"], "--probe", inputs["probe_path"], "--probe-manifest",
            inputs["manifest_path"], "--train-tokens", str(out / "train_tokens.parquet"), "--probe-tokens",
            str(out / "probe_tokens.parquet"), "--probe-token-manifest", str(out / "probe_token_manifest.json"),
            "--report", str(out / "tokenize_report.json"), "--rejections", str(out / "token_rejections.parquet"),
            "--log", str(out / "tokenize.log"), *extra]


def stage_params(tmp_path: Path, **tokenize) -> Path:
    import yaml

    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["tokenize"].update(tokenize)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    return tmp_path / "params.yaml"


def test_a_20_mb_row_costs_the_stage_what_a_small_one_does(gpt2_tokenizer_dir, split_pairs, tmp_path):
    """The real CLI, README's real-data limits: a pair whose completion is 20 MB of words is rejected
    (sequence_too_long, its count null) and the stage's largest process stays under 1 GB. Before: the row was
    tokenized whole (a 50 MB row: 4 minutes and 12.4 GB peak RSS)."""
    import subprocess
    import sys

    identity = pinned_gpt2_identity(gpt2_tokenizer_dir, tmp_path)
    train, probe = split_pairs
    base = _short_prompts(train)[0]
    huge = as_pair({"prompt": base["prompt"], "chosen": [A(_long(base["chosen"][0]["content"], 20_000_000))],
                    "rejected": base["rejected"]}, 10**6)
    inputs = write_probe_inputs(tmp_path / "in", sorted(train + [huge], key=lambda p: p["pair_id"]), probe)
    params = stage_params(tmp_path, max_length=1024, max_prompt_length=256, truncation="reject", workers=2)
    measure = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-c", measure, *tokenize_cli(identity, inputs, out, params)], cwd=REPO_ROOT,
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    peak_mb = int(r.stdout.split()[-1]) / 1024
    [rejection] = [x for x in read_parquet(out / "token_rejections.parquet").to_pylist()
                   if x["pair_id"] == huge["pair_id"]]
    assert rejection["reason"] == "sequence_too_long" and rejection["chosen_tokens"] is None, rejection
    assert peak_mb < 1024, peak_mb


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            pass
    return out


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a reaper that a container's PID 1 may never be)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux /proc")
def test_killed_tokenize_takes_its_workers_with_it(gpt2_tokenizer_dir, split_pairs, tmp_path):
    """kill -9 of the real tokenize process while its two pool workers are busy: both are gone within 5 s
    (PR_SET_PDEATHSIG). Before: they stayed blocked on the pool's queue (alive 35 minutes later)."""
    import signal
    import subprocess
    import time

    identity = pinned_gpt2_identity(gpt2_tokenizer_dir, tmp_path)
    train, probe = split_pairs
    # 360 real pairs x 40 unique copies: minutes of work for two workers.
    many = [as_pair({**{k: p[k] for k in ("prompt", "chosen", "rejected")},
                     "prompt": [U(f"[{k}] " + p["prompt"][0]["content"])] + p["prompt"][1:]}, k * 1000 + i)
            for k in range(40) for i, p in enumerate(train)]
    inputs = write_probe_inputs(tmp_path / "in", sorted(many, key=lambda p: p["pair_id"]), probe)
    params = stage_params(tmp_path, max_length=1024, max_prompt_length=256, truncation="keep_end", workers=2)
    proc = subprocess.Popen(tokenize_cli(identity, inputs, tmp_path / "out", params, "--chunk-pairs", "64"),
                            cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            workers = _children(proc.pid)
        assert len(workers) == 2 and proc.poll() is None, (workers, proc.poll())
        time.sleep(1.0)                      # the workers are tokenizing chunks now
        assert all(_alive(w) for w in workers)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 5
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [w for w in workers if _alive(w)]
        assert not survivors, f"workers {survivors} outlived their killed parent {proc.pid}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for w in workers:                    # only the workers this test's process started
            if _alive(w):
                os.kill(w, signal.SIGKILL)
