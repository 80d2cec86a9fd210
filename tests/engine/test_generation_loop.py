"""The generation loop (stages/engine/generation.py) against the plainest possible decoder: greedy completions equal
an argmax loop that reruns transformers' own forward (its default attention, no cache) over the whole sequence at
every step. A KV cache the model never reads (passed under a name this transformers does not take), a wrong
position or a wrong key mask gives other tokens."""
from __future__ import annotations

import copy
import sys

import numpy as np
import torch

from conftest import REPO_ROOT
from stages.engine.generation import GenerationSettings, StopTokens, as_generation_model, cache_argument, generate

sys.path.insert(0, str(REPO_ROOT / "bench"))
import generation_bench  # noqa: E402


def test_greedy_generation_equals_an_uncached_argmax_loop_over_hf_forward():
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(generation_bench.qwen2_config("tiny", generation_bench.EOS_ID),
                                          dtype=torch.float32).eval()
    ours = as_generation_model(copy.deepcopy(hf), torch.device("cpu"), torch.float32)
    assert cache_argument(ours) in ("cache", "past_key_values")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 5000, size=int(n)) for n in (3, 17, 9, 30, 5)]
    settings = GenerationSettings(max_new_tokens=12, temperature=0.0, top_p=1.0, seed=0, n=1, batch_size=3)
    run = generate(ours, prompts, list(range(len(prompts))), settings, StopTokens(eos=(generation_bench.EOS_ID,)),
                   generation_bench.EOS_ID, torch.device("cpu"))
    with torch.no_grad():
        for c in run.completions:
            seq = list(prompts[c.prompt])
            for _ in range(settings.max_new_tokens):
                logits = hf(input_ids=torch.tensor([seq])).logits[0, -1]
                seq.append(int(torch.argmax(logits)))
            assert c.tokens == seq[len(prompts[c.prompt]):], c.prompt


def test_greedy_with_a_repetition_penalty_equals_hf_forward_under_hfs_own_penalty_processor():
    """generation.repetition_penalty (issue 37): the loop's greedy completions equal an uncached argmax loop over
    transformers' forward whose scores pass through transformers' RepetitionPenaltyLogitsProcessor over the prompt and
    the completion so far; without the penalty the completions differ (the tiny random model repeats itself)."""
    from transformers import AutoModelForCausalLM
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(generation_bench.qwen2_config("tiny", generation_bench.EOS_ID),
                                          dtype=torch.float32).eval()
    ours = as_generation_model(copy.deepcopy(hf), torch.device("cpu"), torch.float32)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 5000, size=int(n)) for n in (4, 11, 7)]
    stop = StopTokens(eos=(generation_bench.EOS_ID,))
    runs = {}
    for penalty in (1.0, 1.8):
        settings = GenerationSettings(max_new_tokens=16, temperature=0.0, top_p=1.0, seed=0, n=1, batch_size=2,
                                      repetition_penalty=penalty)
        runs[penalty] = generate(ours, prompts, list(range(len(prompts))), settings, stop, generation_bench.EOS_ID,
                                 torch.device("cpu"))
    processor = RepetitionPenaltyLogitsProcessor(1.8)
    with torch.no_grad():
        for c in runs[1.8].completions:
            seq = list(prompts[c.prompt])
            for _ in range(16):
                ids = torch.tensor([seq])
                seq.append(int(torch.argmax(processor(ids, hf(input_ids=ids).logits[:, -1].float())[0])))
            assert c.tokens == seq[len(prompts[c.prompt]):], c.prompt
    assert [c.tokens for c in runs[1.8].completions] != [c.tokens for c in runs[1.0].completions]


def test_sampling_with_top_k_and_top_p_draws_hfs_warped_distribution():
    """generation.top_k with top_p (issue 37): over evenly spaced u the inverse-CDF draws hit each token with the
    probability transformers' TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper leave it (within the
    1/N grid), and never a token those warpers remove; with a repetition penalty, after HF's penalty processor."""
    from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    from stages.engine.generation import sample_next
    g = torch.Generator().manual_seed(3)
    vocab, n = 50, 20000
    logits = torch.randn(1, vocab, generator=g) * 2
    seen_ids = torch.tensor([[3, 7, 7, 20]])
    seen = torch.zeros(1, vocab, dtype=torch.bool)
    seen[0, seen_ids[0]] = True
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    for top_k, top_p, penalty in ((5, 1.0, 1.0), (8, 0.7, 1.0), (0, 0.8, 1.0), (6, 0.9, 1.5)):
        scores = RepetitionPenaltyLogitsProcessor(penalty)(seen_ids, logits.clone()) if penalty != 1 else logits.clone()
        for warper in (TemperatureLogitsWarper(0.7), *( [TopKLogitsWarper(top_k)] if top_k else []),
                       *([TopPLogitsWarper(top_p)] if top_p < 1 else [])):
            scores = warper(seen_ids, scores)
        want = torch.softmax(scores[0].double(), dim=-1)
        tokens = sample_next(logits.expand(n, vocab), 0.7, top_p, u, top_k, seen.expand(n, vocab), penalty)
        got = torch.bincount(tokens, minlength=vocab).double() / n
        assert set(torch.nonzero(got).flatten().tolist()) <= set(torch.nonzero(want).flatten().tolist())
        torch.testing.assert_close(got, want, rtol=0, atol=2.0 / n)
