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
