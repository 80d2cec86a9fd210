"""The embedded default dataset: byte-exact regeneration, its promised shape, and learnability."""
from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from collections import Counter

import pytest

from stages.embedded_data import (COLOURS, DEFAULT_OUT, DEFAULT_SFT_OUT, WORLD, build_examples, build_rows,
                                  build_sft_rows, encode)

from conftest import REPO_ROOT
COMMITTED = REPO_ROOT / DEFAULT_OUT
COMMITTED_SFT = REPO_ROOT / DEFAULT_SFT_OUT


@pytest.fixture(scope="module")
def examples() -> list[dict]:
    return build_examples()


def test_committed_file_is_the_regeneration():
    committed = COMMITTED.read_bytes()
    regenerated = encode(build_rows())
    # Content first (a clear failure if the generator changed), then the exact gzip bytes DVC hashes.
    assert gzip.decompress(committed) == gzip.decompress(regenerated)
    assert committed == regenerated
    assert len(committed) < 1_000_000
    assert COMMITTED_SFT.read_bytes() == encode(build_sft_rows())


def test_cli_writes_and_checks(tmp_path):
    out = tmp_path / "d" / "prefs.jsonl.gz"
    cli = [sys.executable, "-m", "stages.embedded_data", "--out", str(out), "--sft-out", str(tmp_path / "sft.jsonl.gz")]
    assert subprocess.run(cli, cwd=REPO_ROOT, capture_output=True).returncode == 0
    assert out.read_bytes() == COMMITTED.read_bytes()
    assert (tmp_path / "sft.jsonl.gz").read_bytes() == COMMITTED_SFT.read_bytes()
    assert subprocess.run(cli + ["--check"], cwd=REPO_ROOT, capture_output=True).returncode == 0
    out.write_bytes(gzip.compress(b'{"x": 1}\n', mtime=0))
    check = subprocess.run(cli + ["--check"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert check.returncode == 1 and "differs from the regenerated dataset" in check.stderr


def test_gzip_header_is_fixed():
    data = COMMITTED.read_bytes()
    assert data[:3] == b"\x1f\x8b\x08"
    assert data[3] == 0  # FLG: no FNAME, no FEXTRA, no comment
    assert data[4:8] == b"\x00\x00\x00\x00"  # MTIME 0


def test_rows_are_valid_trl_conversational(examples):
    rows = [json.loads(line) for line in gzip.decompress(COMMITTED.read_bytes()).decode("utf-8").splitlines()]
    assert len(rows) == len(examples) == 3000
    for i, r in enumerate(rows):
        assert set(r) == {"prompt", "chosen", "rejected"}, i
        for key, role in (("prompt", "user"), ("chosen", "assistant"), ("rejected", "assistant")):
            assert len(r[key]) == 1 and set(r[key][0]) == {"role", "content"}, (i, key)
            assert r[key][0]["role"] == role
            text = r[key][0]["content"]
            assert isinstance(text, str) and text.strip() == text and text, (i, key)
        assert r["chosen"] != r["rejected"], i
    assert len({json.dumps(r, sort_keys=True) for r in rows}) == 3000  # no duplicate pairs
    prompts = Counter(r["prompt"][0]["content"] for r in rows)
    assert len(prompts) == 2700
    assert max(prompts.values()) == 2


def test_the_task_is_what_the_docstring_says(examples):
    colour_of = {thing: colour for colour, things in WORLD.items() for thing in things}
    assert len(colour_of) == 50 and Counter(colour_of.values()) == Counter({c: 5 for c in COLOURS})
    per_thing = Counter()
    kinds = Counter(e["kind"] for e in examples)
    for e in examples:
        prompt = e["prompt"][0]["content"]
        [thing] = [t for t in colour_of if f" {t}" in f" {prompt}" and
                   not any(o != t and t in o and f" {o}" in f" {prompt}" for o in colour_of)]
        chosen, rejected = e["chosen"][0]["content"], e["rejected"][0]["content"]
        right = colour_of[thing]
        said = lambda text: [c for c in COLOURS if c in text.lower().replace(",", " ").replace(".", " ").split()]
        assert said(chosen) == [right], (prompt, chosen)
        if e["kind"] == "rude":
            assert said(rejected) == [right], (prompt, rejected)
        else:
            assert len(said(rejected)) == 1 and said(rejected) != [right], (prompt, rejected)
        if e["kind"] == "wrong_fact":  # one word apart: the fact is the only signal
            diff = [(a, b) for a, b in zip(chosen.split(), rejected.split()) if a != b]
            assert len(chosen.split()) == len(rejected.split()) and len(diff) == 1, (chosen, rejected)
        per_thing[thing] += 1
    assert set(per_thing) == set(colour_of)
    assert min(per_thing.values()) >= 54
    assert set(kinds) == {"wrong_fact", "rude", "rude_wrong"}
    assert all(abs(kinds[k] / 3000 - share) < 0.05 for k, share in
               (("wrong_fact", 0.4), ("rude", 0.3), ("rude_wrong", 0.3)))
    # Wrong colours are not biased towards any colour a model could learn as a prior.
    wrong = Counter(c for e in examples if e["kind"] != "rude" for c in COLOURS
                    if c in e["rejected"][0]["content"].lower())
    assert max(wrong.values()) / min(wrong.values()) < 1.6


def test_pairs_are_short(examples, gpt2_tokenizer_dir):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(gpt2_tokenizer_dir / "tokenizer.json"))
    lengths = [sum(len(tok.encode(e[k][0]["content"]).ids) for k in ("prompt", "chosen", "rejected"))
               for e in examples]
    assert max(lengths) < 60


@pytest.mark.slow
def test_tiny_reward_model_learns_it(examples):
    """A 2-layer, hidden-64 Qwen2 reward model on ~2.4k train pairs beats chance on held-out prompts,
    on the fact-only pairs too (so it learns object -> colour, not just rude vs polite)."""
    import torch
    import torch.nn.functional as F
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Config, Qwen2Model

    torch.manual_seed(0)
    prompts = sorted({e["prompt"][0]["content"] for e in examples})
    held_out = set(prompts[::5])
    probe = [e for e in examples if e["prompt"][0]["content"] in held_out]
    train = [e for e in examples if e["prompt"][0]["content"] not in held_out]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [e[k][0]["content"] for e in train for k in ("prompt", "chosen", "rejected")],
        trainers.BpeTrainer(vocab_size=1024, special_tokens=["<pad>", "<|user|>", "<|assistant|>", "<|end|>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    cfg = Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128)
    body, head = Qwen2Model(cfg), torch.nn.Linear(64, 1)

    def scores(batch):  # chosen, rejected interleaved; score on the last token of each
        seqs = [tok.encode(f"<|user|>{e['prompt'][0]['content']}<|assistant|>{e[k][0]['content']}<|end|>").ids
                for e in batch for k in ("chosen", "rejected")]
        ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, s in enumerate(seqs):
            ids[j, :len(s)], mask[j, :len(s)] = torch.tensor(s), 1
        hidden = body(input_ids=ids, attention_mask=mask).last_hidden_state
        s = head(hidden[torch.arange(len(seqs)), mask.sum(1) - 1])[:, 0]
        return s[0::2] - s[1::2]

    params = [*body.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    steps, batch_size = 3 * math.ceil(len(train) / 32), 32
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * (1 - s / steps))
    order = torch.Generator().manual_seed(0)
    for _ in range(3):
        perm = torch.randperm(len(train), generator=order).tolist()
        for k in range(0, len(perm), batch_size):
            loss = -F.logsigmoid(scores([train[i] for i in perm[k:k + batch_size]])).mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
    with torch.no_grad():
        margins = torch.cat([scores(probe[k:k + 128]) for k in range(0, len(probe), 128)])
    correct = (margins > 0).float()
    fact_only = torch.tensor([e["kind"] == "wrong_fact" for e in probe])
    assert correct.mean() > 0.8, correct.mean()
    assert correct[fact_only].mean() > 0.65, correct[fact_only].mean()
