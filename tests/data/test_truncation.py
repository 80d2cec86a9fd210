"""Truncation (stages/data/truncation.py): every mode on real HH-RLHF pairs with the real GPT-2 tokenizer and the
embedded reference's, reason codes and records; the cost bound's cuts keep the tokens of tokenizing everything."""
from __future__ import annotations

import re

import pytest

from conftest import REPO_ROOT

from data_helpers import UNLIMITED, A, S, U, as_pair, decode, long_text, short_prompt_pairs, truncated_by_reason
from stages.data.limits import TRUNCATION_REASONS, TokenizeError, TokenizeLimits, load_limits
from stages.data.pair_tokenizer import PairTokenizer
from stages.data.render import render_plain
from stages.data.truncation import tokenize_pairs
from stages.lib.contracts import token_hash
from stages.tokenize import check_probe_complete


# ---------------------------------------------------------------------------------------------
# Truncation policies
# ---------------------------------------------------------------------------------------------

def test_limits_validation():
    with pytest.raises(TokenizeError, match="max_prompt_length"):
        TokenizeLimits.from_params({"max_length": 64, "max_prompt_length": 64, "truncation": "reject"})
    with pytest.raises(TokenizeError, match="truncation"):
        TokenizeLimits.from_params({"max_length": 64, "max_prompt_length": 32, "truncation": "left"})


def test_max_length_over_the_references_positions_is_refused_naming_both_and_the_config(tmp_path):
    """Real configs: a tiny GPT-2 (its positions are `n_positions`), a tiny Qwen2 (`max_position_embeddings`), the
    embedded reference. max_length up to the positions passes; one more is refused, naming the key, both numbers
    and the config.json. Before: tokenize accepted any max_length."""
    from transformers import GPT2Config, Qwen2Config

    GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=64).save_pretrained(str(tmp_path / "gpt2"))
    Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                max_position_embeddings=128).save_pretrained(str(tmp_path / "qwen2"))
    for ref_dir, key, positions in ((tmp_path / "gpt2", "n_positions", 64),
                                    (tmp_path / "qwen2", "max_position_embeddings", 128),
                                    (REPO_ROOT / "models" / "tiny-qwen2", "max_position_embeddings", 1024)):
        params = {"max_length": positions, "max_prompt_length": 32, "truncation": "keep_end"}
        assert load_limits(params, ref_dir).max_length == positions
        with pytest.raises(TokenizeError) as e:
            load_limits(dict(params, max_length=positions + 1), ref_dir)
        assert str(e.value).startswith(f"tokenize.max_length {positions + 1} is more than the reference's {key} "
                                       f"{positions} ("), str(e.value)
        assert f"{ref_dir / 'config.json'}): " in str(e.value) or "(models/tiny-qwen2/config.json): " in str(e.value)
        assert str(e.value).endswith(f"set tokenize.max_length to at most {positions}")
    assert load_limits({"max_length": 10**6, "max_prompt_length": 32, "truncation": "reject"}, tmp_path)  # no config


_TOKENIZED: dict = {}


def tokenized(tok, pairs: list[dict], limits: TokenizeLimits):
    """tokenize_pairs(PairTokenizer(tok), pairs, limits, "train"), once per tokenizer, pairs and limits in this module:
    the whole real HH file untruncated is every real-data test's reference, and tokenizing it is most of their time.
    (The result is only read: a test that changed it would change the next one's reference.)"""
    key = (id(tok), tuple(p["pair_id"] for p in pairs), limits)
    if key not in _TOKENIZED:
        _TOKENIZED[key] = tokenize_pairs(PairTokenizer(tok), pairs, limits, "train")
    return _TOKENIZED[key]


def _expected_reason(full_row: dict, limits: TokenizeLimits) -> str | None:
    prompt = max(full_row["chosen_prompt_len"], full_row["rejected_prompt_len"])
    if prompt > limits.max_prompt_length:
        return "prompt_too_long"
    if max(len(full_row["chosen_ids"]), len(full_row["rejected_ids"])) > limits.max_length:
        return "sequence_too_long"
    return None


def test_reject_policy_reason_codes(gpt2, hh_pairs):
    full = {r["pair_id"]: r for r in tokenized(gpt2, hh_pairs, UNLIMITED).rows}
    limits = TokenizeLimits(max_length=160, max_prompt_length=100, truncation="reject")
    result = tokenized(gpt2, hh_pairs, limits)
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
    full = {r["pair_id"]: r for r in tokenized(gpt2, hh_pairs, UNLIMITED).rows}
    limits = TokenizeLimits(max_length=160, max_prompt_length=100, truncation="truncate_completion")
    result = tokenized(gpt2, hh_pairs, limits)
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
    assert truncated_by_reason(result.truncations) == dict.fromkeys(TRUNCATION_REASONS, 0) | {
        "completion_cut": result.truncated}


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


@pytest.mark.parametrize("truncation", ["keep_end", "keep_end_then_completion"])
def test_limits_accept_the_prompt_cutting_modes(truncation):
    limits = TokenizeLimits.from_params({"max_length": 64, "max_prompt_length": 32, "truncation": truncation})
    assert limits.as_dict() == {"max_length": 64, "max_prompt_length": 32, "truncation": truncation}


@pytest.mark.parametrize("tokenizer, limits", [
    ("gpt2", TokenizeLimits(max_length=256, max_prompt_length=128, truncation="keep_end")),
    ("embedded", TokenizeLimits(max_length=1024, max_prompt_length=256, truncation="keep_end")),
])
def test_keep_end_on_real_hh_rows_longer_than_the_limits(request, hh_pairs, tokenizer, limits):
    """Every pair over a limit is cut from the left (oldest turns first), keeps its whole completions and
    is exactly the tokenization of the kept conversation; what cannot fit is a reason-coded rejection."""
    tok = request.getfixturevalue(tokenizer)
    pair_tok = PairTokenizer(tok)
    full = {r["pair_id"]: r for r in tokenized(tok, hh_pairs, UNLIMITED).rows}
    result = tokenized(tok, hh_pairs, limits)
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
    counts = truncated_by_reason(result.truncations)
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
        check_probe_complete(result.rejections, result.pairs_in, limits)


GUARD_LIMITS = {"max_length": 64, "max_prompt_length": 48}


def _strip_before_counts(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.endswith("_tokens_before") and k != "prompt_tokens_before"}


def test_an_over_long_row_is_rejected_by_its_characters_without_tokenizing_it(gpt2, hh_pairs):
    """reject: a completion of 300,000 characters (over 64 tokens x 128 characters) is sequence_too_long, its
    token count null (only its first tokens were made: the prompt's count is exact); a prompt over 48 x 128
    characters is prompt_too_long without any token. Same reasons as tokenizing everything. Before: every row
    was tokenized whole (a 50 MB row: 4 minutes, 12.4 GB)."""
    limits = TokenizeLimits(truncation="reject", **GUARD_LIMITS)
    base = short_prompt_pairs(hh_pairs)[0]
    long_completion = as_pair({"prompt": base["prompt"], "chosen": [A(long_text(base["chosen"][0]["content"], 300_000))],
                               "rejected": base["rejected"]}, 1)
    long_prompt = as_pair({"prompt": [U(long_text(base["prompt"][0]["content"], 10_000))],
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


@pytest.mark.parametrize("truncation", ["truncate_completion", "keep_end_then_completion"])
def test_truncate_completion_cuts_the_text_first_and_keeps_the_same_tokens(gpt2, hh_pairs, truncation):
    """truncate_completion (and keep_end_then_completion, whose prompts fit here): completions over 64 x 128
    characters are cut at a space past that bound before tokenizing; the kept tokens are those of the whole text
    (the real GPT-2 tokenizer on the whole rendering), the records differ only in the untokenized branch's count."""
    limits = TokenizeLimits(truncation=truncation, **GUARD_LIMITS)
    pairs = [as_pair({"prompt": p["prompt"], "chosen": [A(long_text(p["chosen"][0]["content"], 20_000))],
                      "rejected": [A(long_text(p["rejected"][0]["content"], 9_000 + 1000 * k))]}, k)
             for k, p in enumerate(short_prompt_pairs(hh_pairs)[:12])]
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
        pairs.append(as_pair({"prompt": p["prompt"][:-1] + [U(long_text(text, 12_000))], "chosen": p["chosen"],
                              "rejected": p["rejected"]}, 2 * k))
        pairs.append(as_pair({"prompt": [U(long_text(text, 12_000)), A("Sure."), U("Shorter?")], "chosen": p["chosen"],
                              "rejected": p["rejected"]}, 2 * k + 1))
    base = short_prompt_pairs(hh_pairs)[0]
    pairs.append(as_pair({"prompt": base["prompt"], "chosen": [A(long_text("a b", 9_000))],
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


# keep_end_then_completion ---------------------------------------------------------------------

def trl_keep_end(prompt_ids: list[int], completion_ids: list[int], max_prompt_length: int, max_completion_length: int,
                 max_length: int) -> list[int]:
    """One branch as TRL's DPOTrainer (v0.14 to v0.28) truncates it, written from its code: tokenize_row keeps
    prompt_input_ids[-max_prompt_length:] and completion_input_ids[:max_completion_length], then
    concatenated_forward under truncation_mode="keep_end" keeps the last max_length tokens of the sequence."""
    ids = prompt_ids[-max_prompt_length:] + completion_ids[:max_completion_length]
    return ids[-max_length:]


@pytest.mark.parametrize("tokenizer, limits", [
    ("gpt2", TokenizeLimits(max_length=256, max_prompt_length=128, truncation="keep_end_then_completion")),
    ("embedded", TokenizeLimits(max_length=1024, max_prompt_length=256, truncation="keep_end_then_completion")),
])
def test_keep_end_then_completion_keeps_the_pairs_keep_end_rejects(request, hh_pairs, tokenizer, limits):
    """Real HH rows over the limits: the prompt is cut from the left (keep_end's rule) only as far as
    max_prompt_length, then each branch keeps its first max_length tokens. Every pair keep_end must reject (a
    completion alone over max_length) is kept; each kept pair is exactly the tokenization of the kept conversation,
    cut; where the prompt needed no cut the tokens are TRL's keep_end + max_completion_length (= max_length - the
    prompt's tokens), and where it did (plain rendering) they end as TRL's do, a suffix of its max_prompt_length
    prompt tokens. Before: no such mode (tokenize.truncation refused it)."""
    tok = request.getfixturevalue(tokenizer)
    pair_tok = PairTokenizer(tok)
    full = {r["pair_id"]: r for r in tokenized(tok, hh_pairs, UNLIMITED).rows}
    keep_end = tokenized(tok, hh_pairs, TokenizeLimits(limits.max_length, limits.max_prompt_length, "keep_end"))
    result = tokenized(tok, hh_pairs, limits)
    assert {r["reason"] for r in keep_end.rejections} == {"sequence_too_long"} and result.rejections == []
    records = {t["pair_id"]: t for t in result.truncations}
    assert set(records) == {pid for pid, r in full.items() if _expected_reason(r, limits)}
    counts = truncated_by_reason(result.truncations)
    assert counts["completion_cut"] and counts["prompt_and_completion_cut"] and counts["prompt_turns_dropped"]
    assert sum(counts.values()) == result.truncated == len(records)
    pairs = {p["pair_id"]: p for p in hh_pairs}
    for row in result.rows:
        ref, record = full[row["pair_id"]], records.get(row["pair_id"])
        if record is None:
            assert row == ref  # pairs within the limits are untouched
            continue
        pair = pairs[row["pair_id"]]
        kept = kept_prompt(pair, record)
        prompt_cut = record["reason"] != "completion_cut"
        assert prompt_cut == (ref["chosen_prompt_len"] > limits.max_prompt_length) == (kept != pair["prompt"])
        completion_cut = record["reason"] in ("completion_cut", "prompt_and_completion_cut")
        for side in ("chosen", "rejected"):
            ids, n = row[f"{side}_ids"], row[f"{side}_prompt_len"]
            want_ids, prompt_text = expected_branch(tok, kept, pair[side])
            assert ids == want_ids[:limits.max_length] and decode(tok, ids[:n]) == prompt_text
            assert n <= limits.max_prompt_length and n < len(ids) <= limits.max_length
            ref_ids, ref_n = ref[f"{side}_ids"], ref[f"{side}_prompt_len"]
            if not prompt_cut:
                assert ids == trl_keep_end(ref_ids[:ref_n], ref_ids[ref_n:], limits.max_prompt_length,
                                           limits.max_length - ref_n, limits.max_length)
            elif not tok.chat_template and record["reason"] != "prompt_text_cut" and record["prompt_chars_dropped"] == 0:
                # whole turns dropped: the kept prompt's tokens are the last ones of the whole prompt's
                assert ids[:n] == ref_ids[:ref_n][-n:] and n <= len(ref_ids[:ref_n][-limits.max_prompt_length:])
        if prompt_cut:
            # the least cut: starting one user turn earlier (when there is one) would leave the prompt over
            dropped = record["prompt_messages_dropped"]
            earlier = [j for j in range(dropped) if pair["prompt"][j]["role"] == "user"]
            if earlier and record["prompt_chars_dropped"] == 0:
                [longer] = tokenize_pairs(pair_tok, [dict(pair, prompt=pair["prompt"][max(earlier):])], UNLIMITED,
                                          "train").rows
                assert longer["chosen_prompt_len"] > limits.max_prompt_length
        assert completion_cut == (max(len(row["chosen_ids"]), len(row["rejected_ids"])) == limits.max_length
                                  and max(len(want) for want in (expected_branch(tok, kept, pair["chosen"])[0],
                                                                 expected_branch(tok, kept, pair["rejected"])[0]))
                                  > limits.max_length)
        assert record["chosen_tokens_before"] == len(ref["chosen_ids"]) and record["chosen_tokens"] == len(
            row["chosen_ids"])


def test_keep_end_then_completion_rejects_only_what_no_cut_can_fit(embedded):
    """A system message over max_prompt_length is kept by every prompt cut: prompt_too_long, named as this mode's."""
    limits = TokenizeLimits(max_length=96, max_prompt_length=64, truncation="keep_end_then_completion")
    words = " ".join(f"w{i}" for i in range(300))
    long_system = as_pair({"prompt": [S(words), U("Q?")], "chosen": [A("Yes.")], "rejected": [A("No.")]}, 3)
    long_answer = as_pair({"prompt": [U("Q?")], "chosen": [A(words)], "rejected": [A("No.")]}, 4)
    result = tokenize_pairs(PairTokenizer(embedded), [long_system, long_answer], limits, "probe")
    [rejection] = result.rejections
    assert (rejection["pair_id"], rejection["reason"]) == (long_system["pair_id"], "prompt_too_long")
    assert rejection["detail"].startswith("keep_end_then_completion cannot fit the pair")
    [record] = result.truncations
    assert (record["pair_id"], record["reason"], record["exceeded"]) == (long_answer["pair_id"], "completion_cut",
                                                                         ["max_length"])


def test_keep_end_then_completion_bounds_the_cost_and_keeps_the_same_tokens(gpt2, hh_pairs):
    """A prompt over 48 x 128 characters and a completion over 64 x 128: neither is tokenized whole (the prompt's
    candidates over the bound not at all, the completion up to a space past the bound), and the kept tokens and
    choices are those of tokenizing everything."""
    limits = TokenizeLimits(truncation="keep_end_then_completion", **GUARD_LIMITS)
    pairs = []
    for k, p in enumerate(hh_pairs[:8]):
        text = p["prompt"][-1]["content"]
        pairs.append(as_pair({"prompt": [U(long_text(text, 12_000)), A("Sure."), U(text)],
                              "chosen": [A(long_text(p["chosen"][0]["content"], 20_000))],
                              "rejected": p["rejected"]}, k))
        pairs.append(as_pair({"prompt": [U(long_text(text, 12_000))], "chosen": p["chosen"],
                              "rejected": p["rejected"]}, 100 + k))
    bounded = tokenize_pairs(PairTokenizer(gpt2), pairs, limits, "train")
    whole = tokenize_pairs(PairTokenizer(gpt2, bound_chars=False), pairs, limits, "train")
    assert bounded.rows == whole.rows and len(bounded.rows) == len(pairs) and bounded.rejections == []
    # both cut, the prompt by whole turns (the huge old turn) or by its text (one huge turn)
    assert {t["reason"] for t in bounded.truncations} == {"prompt_and_completion_cut"}
    assert {t["prompt_chars_dropped"] > 0 for t in bounded.truncations} == {True, False}
    for cut, ref in zip(bounded.truncations, whole.truncations):
        assert cut["prompt_tokens_before"] is None and ref["prompt_tokens_before"] > limits.max_prompt_length
        assert "max_prompt_length" in cut["exceeded"]
        assert _strip_before_counts(cut) == _strip_before_counts(ref)
