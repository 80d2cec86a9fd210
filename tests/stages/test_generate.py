"""The generate stage on a real tiny workspace (tests/generation_helpers.py): bitwise determinism across runs and
batch sizes on CPU, the sampler against a plain implementation, and its refusals."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from generation_helpers import copy_tokenizer, generate_args, make_workspace
from stages import generate
from stages.engine.generation import row_invariant_linears, row_keys, sample_next, uniforms
from stages.lib.contracts import generation_rows
from stages.lib.io import read_parquet


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("gen"))


def run_generate(ws, out, **kw):
    generate.main(generate_args(ws, out, **kw))
    return out / "generations.parquet", out / "generation_info.json"


def test_two_runs_give_the_same_bytes_and_batch_size_does_not_change_them(ws, tmp_path):
    """Sampled (temperature 1, top_p 0.9, n 2): the same bytes twice; batch_size 4 and 1 (one-row
    decode GEMMs) give the same completions and log-probs to the bit."""
    a_gen, a_info = run_generate(ws, tmp_path / "a")
    b_gen, b_info = run_generate(ws, tmp_path / "b")
    assert a_gen.read_bytes() == b_gen.read_bytes() and a_info.read_bytes() == b_info.read_bytes()
    rows = generation_rows(read_parquet(a_gen), str(a_gen))
    assert len(rows) == 6 * 2 * 2                      # prompts x samples x sides
    assert len({tuple(r["tokens"]) for r in rows}) > len(rows) // 2    # really sampled: the completions differ
    params_text = ws["params"].read_text()
    try:
        ws["params"].write_text(params_text.replace("batch_size: 4", "batch_size: 1"))
        c_gen, _ = run_generate(ws, tmp_path / "c")
    finally:
        ws["params"].write_text(params_text)
    assert c_gen.read_bytes() == a_gen.read_bytes()
    info = json.loads(a_info.read_text())
    # ChatML: the turn closes "<|im_end|>" "\n", and <|im_end|> (this tokenizer's EOS) stops a completion
    assert info["stop"]["turn_closing"][0] in info["stop"]["eos"] + [info["stop"]["end_of_turn"]]
    assert sum(info["stop_reasons"]["policy"].values()) == 12


def test_sampler_matches_a_plain_inverse_cdf_with_nucleus():
    """sample_next against numpy: softmax(logits / T), the smallest prefix of the sorted probabilities whose mass
    reaches top_p, the token where u * kept mass falls in the cumulative sum; greedy ties to the lowest id."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=gen) * 3
    keys = row_keys(11, list(range(64)), [0] * 64)
    u = uniforms(keys, 3)
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    assert torch.equal(uniforms(keys[10:20], 3), u[10:20])          # a row's draw does not depend on its batch
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9), (1.3, 0.5)):
        got = sample_next(logits, temperature, top_p, u).numpy()
        for r in range(64):
            z = logits[r].double().numpy() / temperature
            p = np.exp(z - z.max())
            p /= p.sum()
            order = np.argsort(-p, kind="stable")
            sp = p[order]
            keep = (np.cumsum(sp) - sp) < top_p
            mass = np.where(keep, sp, 0.0)
            want = order[np.searchsorted(np.cumsum(mass), u[r].item() * mass.sum(), side="right")]
            assert got[r] == want, (temperature, top_p, r)
    tie = torch.tensor([[0.0, 2.0, 2.0, 1.0]])
    assert sample_next(tie, 0.0, 1.0, None).item() == 1


def test_a_policy_whose_tokenizer_differs_is_refused_naming_both(ws, tmp_path):
    other = tmp_path / "other_policy"
    other.mkdir()
    for f in ws["policy"].iterdir():
        if f.is_file():
            (other / f.name).write_bytes(f.read_bytes())
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]            # two ids swapped: same size, other meaning
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(SystemExit) as refused:
        run_generate(ws, tmp_path / "out", policy=other)
    msg = str(refused.value)
    assert refused.value.code == 1 and msg.startswith("generate: refused: ")
    assert str(other) in msg and str(ws["ref"]) in msg and "differs from the reference's" in msg
    assert not (tmp_path / "out" / "generations.parquet").exists()


def test_prompt_plus_max_new_tokens_beyond_the_positions_is_refused(ws, tmp_path):
    params_text = ws["params"].read_text()
    try:
        ws["params"].write_text(params_text.replace("max_new_tokens: 6", "max_new_tokens: 100000"))
        with pytest.raises(SystemExit) as refused:
            run_generate(ws, tmp_path / "out")
    finally:
        ws["params"].write_text(params_text)
    assert refused.value.code == 1 and "max_position_embeddings" in str(refused.value)
    assert not (tmp_path / "out" / "generations.parquet").exists()


def test_row_invariant_linears_give_a_row_the_same_bits_for_any_row_count():
    """On CPU a row of x @ W.T takes other bits with fewer rows (other kernels: checked here, so the test means
    something on this machine); inside row_invariant_linears every row count gives the 16-row bits."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 1024)
    x = torch.randn(16, 256)
    with torch.no_grad():
        full = lin(x)
        plain = [m for m in range(1, 16) if not torch.equal(lin(x[:m]), full[:m])]
        assert plain, "this CPU gives every row count the same bits: nothing to check"
        with row_invariant_linears(lin):
            assert all(torch.equal(lin(x[:m]), full[:m]) for m in range(1, 17))
            assert torch.equal(lin(x[None, :3]), full[None, :3])       # any leading shape
        assert "forward" not in lin.__dict__                            # restored


def test_top_k_and_repetition_penalty_are_recorded_and_change_the_completions(ws, tmp_path):
    """A user sets generation.top_k and generation.repetition_penalty in params.yaml (issue 37): generate records
    both in generation_info.json's settings and samples other completions than without them; a value the schema
    refuses stops the stage naming the key."""
    base_gen, base_info = run_generate(ws, tmp_path / "base")
    params_text = ws["params"].read_text()
    try:
        ws["params"].write_text(params_text.replace("top_k: 0", "top_k: 3").replace("repetition_penalty: 1.0",
                                                                                  "repetition_penalty: 1.3"))
        gen, info = run_generate(ws, tmp_path / "knobs")
        settings = json.loads(info.read_text())["settings"]
        assert settings["top_k"] == 3 and settings["repetition_penalty"] == 1.3
        assert json.loads(base_info.read_text())["settings"]["top_k"] == 0
        tokens = [tuple(r["tokens"]) for r in generation_rows(read_parquet(gen), str(gen))]
        assert tokens != [tuple(r["tokens"]) for r in generation_rows(read_parquet(base_gen), str(base_gen))]
        ws["params"].write_text(params_text.replace("repetition_penalty: 1.0", "repetition_penalty: 0"))
        with pytest.raises(SystemExit) as refused:
            run_generate(ws, tmp_path / "bad")
        assert "repetition_penalty" in str(refused.value)
    finally:
        ws["params"].write_text(params_text)
