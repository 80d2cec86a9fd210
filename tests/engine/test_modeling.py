"""Packed models against an independent padded/unpacked/full-logits implementation on tiny real models."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch

from engine_helpers import (make_tiny_model_dir, pair_seqs, random_rows, reference_rm_scores, reference_seq_logps,
                            token_row, write_token_parquet)
from stages.engine.modeling import (ModelLoadError, SequenceLogProbs, SequenceRewards, load_causal_lm,
                                 load_reward_model)
from stages.engine.packing import BatchDims, build_packed_batch, load_token_pairs, pack_micro_batches
from stages.engine.padded_shapes import pad_packed_batch
from stages.engine.data import model_inputs as batch_inputs   # the trainer's own batch -> forward mapping

torch.set_num_threads(1)   # tiny models: extra intra-op threads only contend on a shared machine




def eager_copy(model_dir, cls):
    return cls.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)


@pytest.mark.parametrize("share_prompt", [False, True])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packed_logps_and_grads_match_padded_full_logits(tmp_path, arch, share_prompt):
    from transformers import AutoModelForCausalLM
    model_dir = make_tiny_model_dir(tmp_path / "m", arch=arch, tie=arch == "qwen2")
    rows = random_rows(6, seed=5)
    pairs = load_token_pairs(write_token_parquet(tmp_path / "t.parquet", rows))
    batch = build_packed_batch(pairs, [3, 0, 5, 1, 4, 2], share_prompt=share_prompt)
    assert (batch.kv_index is not None) == share_prompt   # random_rows pairs share their prompt
    packed = SequenceLogProbs(load_causal_lm(model_dir), chunk_tokens=5)   # several chunks, last one ragged
    got = packed(**batch_inputs(batch))

    ref_model = eager_copy(model_dir, AutoModelForCausalLM)
    seqs, pls = pair_seqs([rows[i] for i in [3, 0, 5, 1, 4, 2]])
    want = reference_seq_logps(ref_model, seqs, pls)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    # A DPO-style loss through both paths: identical gradients on every parameter.
    weights = torch.linspace(-1, 1, len(seqs), dtype=torch.float64)
    torch.nn.functional.logsigmoid(0.1 * (got * weights).sum()).backward()
    torch.nn.functional.logsigmoid(0.1 * (want * weights).sum()).backward()
    ref_grads = dict(ref_model.named_parameters())
    for name, p in packed.lm.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_no_attention_across_packed_sequences(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "m")
    rows = random_rows(4, seed=6)
    packed = SequenceLogProbs(load_causal_lm(model_dir), chunk_tokens=64).eval()
    pairs = load_token_pairs(write_token_parquet(tmp_path / "a.parquet", rows))
    base = packed(**batch_inputs(build_packed_batch(pairs, [0, 1, 2, 3])))
    # Perturb pair 1's chosen sequence (prompt and completion tokens, same length).
    r = rows[1]
    changed = token_row(r["pair_id"], [(t * 7 + 3) % 125 + 3 for t in r["chosen_ids"]], r["chosen_prompt_len"],
                        r["rejected_ids"], r["rejected_prompt_len"])     # its own token_hash, as tokenize writes it
    pairs2 = load_token_pairs(write_token_parquet(tmp_path / "b.parquet", [rows[0], changed, rows[2], rows[3]]))
    after = packed(**batch_inputs(build_packed_batch(pairs2, [0, 1, 2, 3])))
    others = [s for s in range(8) if s != 2]
    torch.testing.assert_close(after[others], base[others], rtol=0, atol=1e-6)
    assert abs(after[2] - base[2]) > 1e-3


def test_outputs_stay_bound_to_pair_ids_under_shuffled_packing(tmp_path):
    from transformers import AutoModelForCausalLM
    model_dir = make_tiny_model_dir(tmp_path / "m")
    rows = random_rows(20, seed=7)
    pairs = load_token_pairs(write_token_parquet(tmp_path / "t.parquet", rows))
    packed = SequenceLogProbs(load_causal_lm(model_dir), chunk_tokens=16).eval()
    order = np.random.default_rng(0).permutation(20).tolist()
    by_pair: dict[str, tuple[float, float]] = {}
    with torch.no_grad():
        for mb in pack_micro_batches(order, pairs.pair_tokens, budget=60, sort=True):
            batch = build_packed_batch(pairs, mb, share_prompt=True)
            out = packed(**batch_inputs(batch)).view(-1, 2)
            for k, idx in enumerate(batch.pair_index.tolist()):
                by_pair[pairs.pair_ids[idx]] = tuple(out[k].tolist())
    ref_model = eager_copy(model_dir, AutoModelForCausalLM)
    with torch.no_grad():
        for r in rows:
            want = reference_seq_logps(ref_model, [r["chosen_ids"], r["rejected_ids"]],
                                       [r["chosen_prompt_len"], r["rejected_prompt_len"]])
            np.testing.assert_allclose(by_pair[r["pair_id"]], want.numpy(), rtol=0, atol=1e-5)


def hh_token_rows(hh_rlhf_path, tokenizer_dir, n: int) -> list[dict]:
    """Tokenize real HH-RLHF pairs: prompt = shared transcript up to and including the last
    "\\n\\nAssistant:"; prompt and completion tokenized separately so the boundary is exact."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = []
    with gzip.open(hh_rlhf_path, "rt", encoding="utf-8") as f:
        for line in f:
            ex = json.loads(line)
            cut = ex["chosen"].rfind("\n\nAssistant:") + len("\n\nAssistant:")
            prompt = ex["chosen"][:cut]
            if not ex["rejected"].startswith(prompt) or len(ex["chosen"]) > 600 or len(ex["rejected"]) > 600:
                continue
            p = tok(prompt)["input_ids"]
            c, r = tok(ex["chosen"][cut:])["input_ids"], tok(ex["rejected"][cut:])["input_ids"]
            if c and r and c != r:
                rows.append(token_row(f"hh{len(rows)}", p + c, len(p), p + r, len(p)))
            if len(rows) == n:
                return rows
    raise AssertionError("not enough short HH-RLHF pairs")


@pytest.mark.parametrize("share_prompt", [False, True])
def test_reward_score_read_at_last_completion_token_on_real_hh_rlhf(tmp_path, hh_rlhf_path, gpt2_tokenizer_dir,
                                                                    share_prompt):
    from transformers import AutoModelForSequenceClassification
    rows = hh_token_rows(hh_rlhf_path, gpt2_tokenizer_dir, n=4)
    model_dir = make_tiny_model_dir(tmp_path / "m", vocab=50257)
    torch.manual_seed(0)
    rm = load_reward_model(model_dir)
    assert rm.score.out_features == 1 and rm.config.pad_token_id is not None
    rm.save_pretrained(tmp_path / "rm")
    pairs = load_token_pairs(write_token_parquet(tmp_path / "t.parquet", rows), vocab_size=50257)
    batch = build_packed_batch(pairs, [2, 0, 3, 1], share_prompt=share_prompt)
    with torch.no_grad():
        got = SequenceRewards(rm).eval()(**batch_inputs(batch))
        eager = eager_copy(tmp_path / "rm", AutoModelForSequenceClassification).eval()
        seqs, _ = pair_seqs([rows[i] for i in [2, 0, 3, 1]])
        torch.testing.assert_close(got, reference_rm_scores(eager, seqs), rtol=0, atol=1e-5)
        # The exported directory scores each unpadded sequence the same through HF's own forward.
        hf = torch.cat([eager(input_ids=torch.tensor([s])).logits[:, 0] for s in seqs])
        torch.testing.assert_close(got, hf, rtol=0, atol=1e-5)
        # And it is the LAST token that is read: dropping it changes the score.
        shorter = eager(input_ids=torch.tensor([seqs[0][:-1]])).logits[0, 0]
        assert abs(shorter - got[0]) > 1e-6


def test_non_finite_logits_fail_fast(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "m")
    pairs = load_token_pairs(write_token_parquet(tmp_path / "t.parquet", random_rows(2, seed=8)))
    batch = build_packed_batch(pairs, [0, 1])
    lm = load_causal_lm(model_dir)
    with torch.no_grad():
        lm.model.norm.weight[0] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite log-probs"):
        SequenceLogProbs(lm, chunk_tokens=8)(**batch_inputs(batch))
    rm = load_reward_model(model_dir)
    with torch.no_grad():
        rm.score.weight[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite reward scores"):
        SequenceRewards(rm)(**batch_inputs(batch))


def test_loaders_refuse_the_wrong_head(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "m")
    rm = load_reward_model(model_dir)
    rm.save_pretrained(tmp_path / "rm")
    with pytest.raises(ModelLoadError, match="classification head"):
        load_causal_lm(tmp_path / "rm")
    from transformers import AutoModelForSequenceClassification
    AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=3).save_pretrained(tmp_path / "cls3")
    with pytest.raises(ModelLoadError, match="num_labels=3"):
        load_reward_model(tmp_path / "cls3")
    reloaded = load_reward_model(tmp_path / "rm")   # an RM directory reloads with its trained head
    torch.testing.assert_close(reloaded.score.weight, rm.score.weight)


@pytest.mark.parametrize("share_prompt", [False, True])
def test_padded_batch_gives_the_same_outputs_and_gradients(tmp_path, share_prompt):
    """What a CUDA-graph step computes (a batch padded to its shape) equals the unpadded batch: same log-probs and
    rewards for the real pairs, finite filler outputs, the same gradients under zero filler weights."""
    rows = random_rows(5, seed=21)
    pairs = load_token_pairs(write_token_parquet(tmp_path / "t.parquet", rows))
    batch = build_packed_batch(pairs, [4, 1, 3], share_prompt=share_prompt)
    t, c = batch.computed_tokens, int(batch.logp_positions.shape[0])
    k = int(batch.kv_index.shape[0]) if batch.kv_index is not None else t
    shape = BatchDims(tokens=t + 6, keys=k + 6 + (3 if share_prompt else 0), logp_tokens=c + 5, pairs=6,
                      max_q=max(batch.max_seqlen, 6) + 2, max_k=max(batch.max_seqlen_k, batch.max_seqlen, 6) + 2)
    padded = pad_packed_batch(batch, shape)
    model_dir = make_tiny_model_dir(tmp_path / "m")
    for module in (SequenceLogProbs(load_causal_lm(model_dir), chunk_tokens=7),
                   SequenceRewards(load_reward_model(model_dir))):
        module.zero_grad()
        want = module(**batch_inputs(batch))
        (want * torch.linspace(-1, 1, 6, dtype=want.dtype)).sum().backward()
        want_grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        module.zero_grad()
        got = module(**batch_inputs(padded))
        assert got.shape == (12,) and torch.isfinite(got).all()
        torch.testing.assert_close(got[:6], want, rtol=0, atol=1e-6)
        weights = torch.cat([torch.linspace(-1, 1, 6, dtype=got.dtype), torch.zeros(6, dtype=got.dtype)])
        (got * weights).sum().backward()
        for n, p in module.named_parameters():
            # Padding changes the GEMM shapes, so BLAS may sum in another order: fp32 rounding, scaled to the
            # gradient's magnitude (~8 ulps of its largest element), not a bitwise promise.
            scale = float(want_grads[n].abs().max())
            torch.testing.assert_close(p.grad, want_grads[n], rtol=1e-5, atol=1e-6 * max(scale, 1e-3),
                                       msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_rms_norms_are_routed_to_the_fused_kernel_and_unchanged_on_cpu(tmp_path, arch):
    from stages.engine.modeling import FUSABLE_RMS_NORMS
    model_dir = make_tiny_model_dir(tmp_path / "m", arch=arch)
    for model in (load_causal_lm(model_dir), load_reward_model(model_dir)):
        norms = [m for m in model.modules() if type(m).__name__ in FUSABLE_RMS_NORMS]
        assert len(norms) == 2 * model.config.num_hidden_layers + 1
        assert all("forward" in vars(m) for m in norms)            # the instance routes through the fused path
        x = torch.randn(5, model.config.hidden_size)
        for m in norms[:2]:                                         # CPU: HF's own forward, bit for bit
            assert torch.equal(m(x), type(m).forward(m, x))


def test_routing_and_cpu_outputs_do_not_depend_on_whether_triton_is_installed(tmp_path):
    """The runtime lock (README command 1) has no triton, the test lock has it: a CPU run must record the same
    routing (run_info's fused_kernels) and compute the same bits either way. A process where `import triton`
    fails (sys.modules entry None: how Python reports an absent package) against this one."""
    import subprocess
    import sys

    from conftest import REPO_ROOT
    model_dir = make_tiny_model_dir(tmp_path / "m")
    tokens = write_token_parquet(tmp_path / "t.parquet", random_rows(6, seed=5))
    code = ("import sys, json, hashlib, torch\n"
            "if sys.argv[1] == 'absent': sys.modules['triton'] = None\n"
            "from stages.engine import kernels\n"
            "from stages.engine.data import model_inputs\n"
            "from stages.engine.modeling import SequenceLogProbs, load_causal_lm, use_fused_kernels\n"
            "from stages.engine.packing import build_packed_batch, load_token_pairs\n"
            "torch.set_num_threads(1)\n"
            "lm = load_causal_lm(sys.argv[2]); counts = use_fused_kernels(lm)\n"
            "batch = build_packed_batch(load_token_pairs(sys.argv[3]), list(range(6)), share_prompt=True)\n"
            "out = SequenceLogProbs(lm, chunk_tokens=5)(**model_inputs(batch))\n"
            "print(json.dumps([kernels.triton is None, counts, hashlib.sha256(out.detach().numpy().tobytes()).hexdigest()]))")
    results = {}
    for mode in ("absent", "as_installed"):
        r = subprocess.run([sys.executable, "-c", code, mode, str(model_dir), str(tokens)], cwd=REPO_ROOT,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        results[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    assert results["absent"][0] is True
    assert results["absent"][1] == results["as_installed"][1] and results["absent"][1]["silu_mul"] == 2
    assert results["absent"][2] == results["as_installed"][2]


@pytest.mark.parametrize("bias", [True, False])
def test_grouped_linear_equals_the_separate_layers_with_and_without_a_copy(bias):
    """GroupedLinear (the fused q|k|v and gate|up projection): output and every gradient equal the separate
    nn.Linear layers'; adjacent_rows aliases weights that lie back to back (flat_adamw's buffer) and refuses
    anything else, which then takes the concatenating copy."""
    from stages.engine.modeling import adjacent_rows, grouped_linear
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, n, bias=bias, dtype=torch.float64) for n in (8, 2, 2)]
    x = torch.randn(3, 5, 6, dtype=torch.float64, requires_grad=True)
    ref = torch.cat([m(x) for m in layers], dim=-1)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, [x, *(p for m in layers for p in m.parameters())], g)
    assert adjacent_rows([m.weight for m in layers]) is None          # separate allocations

    def run():
        out = grouped_linear(x, layers)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        grads = torch.autograd.grad(out, [x, *(p for m in layers for p in m.parameters())], g)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)

    run()
    flat = torch.zeros(sum(m.weight.numel() for m in layers) + 4, dtype=torch.float64)
    offset = 2
    for m in layers:            # lay the weights back to back in one buffer, as flat_adamw does
        n = m.weight.numel()
        flat[offset:offset + n].copy_(m.weight.detach().reshape(-1))
        m.weight.data = flat[offset:offset + n].view_as(m.weight)
        offset += n
    alias = adjacent_rows([m.weight for m in layers])
    assert alias is not None and alias.shape == (12, 6) and alias.data_ptr() == layers[0].weight.data_ptr()
    torch.testing.assert_close(alias, torch.cat([m.weight for m in layers]))
    assert adjacent_rows([layers[0].weight, layers[2].weight]) is None            # a gap
    assert adjacent_rows([layers[1].weight, layers[0].weight]) is None            # out of order
    run()


@pytest.mark.parametrize("layout", ["adjacent", "gap", "unmarked"])
def test_marked_weights_get_their_gradient_added_into_grad_by_the_weight_gemm(layout):
    """flat_adamw's flat gradient under the CUDA-graph step: a marked weight's gradient is added into its existing
    .grad in place by GroupedLinear's weight GEMM (C += dy^T x), so autograd has nothing to add; the result is the
    sum AccumulateGrad would make. A gap between the gradients or an unmarked weight takes autograd's path, with
    the same sum. A one-weight GroupedLinear (o_proj / down_proj on the fused path) does the same."""
    from stages.engine.modeling import GroupedLinear, grouped_linear, mark_grad_accumulators
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, n, bias=True, dtype=torch.float64) for n in (8, 2, 2)]
    params = [p for m in layers for p in m.parameters()]
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    g = torch.randn(3, 5, 12, dtype=torch.float64)
    fresh = torch.autograd.grad(torch.cat([m(x) for m in layers], dim=-1), params, g)
    gap = 3 if layout == "gap" else 0
    grads = torch.randn(sum(m.weight.numel() for m in layers) + 2 * gap, dtype=torch.float64)   # a sum so far
    offset = 0
    for m in layers:            # back to back in one buffer, as flat_adamw lays out the gradients
        n = m.weight.numel()
        m.weight.grad = grads[offset:offset + n].view_as(m.weight)
        offset += n + gap
        m.bias.grad = torch.randn_like(m.bias)
    before = [p.grad.clone() for p in params]
    ptrs = [m.weight.grad.data_ptr() for m in layers]
    assert mark_grad_accumulators([m.weight for m in layers[:2]] if layout == "unmarked" else params, True) > 0
    handed = []                 # weight gradients autograd got to add (its hook sees None where there is none)
    for m in layers:
        m.weight.register_hook(lambda grad: handed.append(grad is not None))
    (grouped_linear(x, layers) * g).sum().backward()
    assert sum(handed) == (0 if layout == "adjacent" else 3), handed
    for p, b, f in zip(params, before, fresh):
        torch.testing.assert_close(p.grad, b + f, rtol=1e-12, atol=1e-12)
    assert [m.weight.grad.data_ptr() for m in layers] == ptrs          # still the buffer's views
    one = torch.nn.Linear(6, 4, dtype=torch.float64)
    one.weight.grad = torch.ones_like(one.weight)
    mark_grad_accumulators([one.weight], True)
    ref = torch.autograd.grad((one(x) * g[..., :4]).sum(), one.weight)[0]
    (GroupedLinear.apply(x, 1, one.weight, one.bias) * g[..., :4]).sum().backward()
    torch.testing.assert_close(one.weight.grad, 1 + ref, rtol=1e-12, atol=1e-12)
    assert mark_grad_accumulators(params + [one.weight], False) > 0
    assert not any(hasattr(p, "_prefpipe_backward_adds_into_grad") for p in params)


def test_grouped_weights_laid_out_adjacent_keep_every_value_and_output(tmp_path):
    """make_grouped_weights_adjacent (generation's and the judge's models on CUDA): every q/k/v and gate/up group,
    weights and biases, becomes one storage that adjacent_rows aliases (no per-forward copy), with the same values,
    so the model's logits are bitwise what they were; a second call finds nothing to move."""
    from transformers import AutoModelForCausalLM
    from stages.engine.modeling import GROUPED_PROJECTIONS, adjacent_rows, make_grouped_weights_adjacent
    model = AutoModelForCausalLM.from_pretrained(make_tiny_model_dir(tmp_path / "m")).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[3, 5, 7, 11, 13, 17]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    groups = make_grouped_weights_adjacent(model)
    layers = model.config.num_hidden_layers
    assert groups == 2 * layers                        # q/k/v and gate/up in each decoder layer
    for module in model.modules():
        for names in GROUPED_PROJECTIONS:
            if all(hasattr(module, n) for n in names):
                group = [getattr(module, n) for n in names]
                assert adjacent_rows([m.weight for m in group]) is not None
                if group[0].bias is not None:          # Qwen2's q/k/v carry biases
                    assert adjacent_rows([m.bias for m in group]) is not None
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, logits)
    assert make_grouped_weights_adjacent(model) == 2 * layers     # idempotent: already adjacent, nothing copied


def test_model_vocab_size_is_autoconfigs_without_importing_it_for_a_plain_config(tmp_path):
    """The token check's vocab comes from config.json directly (no transformers import before the tokens are
    read) and is AutoConfig's number; a config without a top-level vocab_size goes through AutoConfig."""
    from transformers import AutoConfig
    from stages.engine.cli import model_vocab_size
    for arch, vocab in (("qwen2", 128), ("llama", 301)):
        model_dir = make_tiny_model_dir(tmp_path / arch, arch=arch, vocab=vocab)
        assert model_vocab_size(model_dir) == AutoConfig.from_pretrained(model_dir).vocab_size == vocab
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"model_type": "qwen2"}))   # vocab_size: the class default
    assert model_vocab_size(bare) == AutoConfig.from_pretrained(bare).vocab_size


def test_a_reward_model_loaded_through_a_device_map_gets_the_cpu_loads_seeded_head(tmp_path):
    """On a GPU the reward model is loaded straight onto the device (a device map), where transformers would
    initialise a new `score` head from the device's RNG; the loader makes the head again from the CPU RNG.
    Run here with a CPU device map (the same code path): the weights, buffers and the CPU RNG state after
    the load are those of the plain CPU load, so the seeded head does not depend on where the model loads."""
    from stages.engine.modeling import _load_reward_model
    model_dir = make_tiny_model_dir(tmp_path / "m")
    loaded, rng_after = [], []
    for placement in ({}, {"device_map": {"": torch.device("cpu")}}):
        torch.manual_seed(7)
        loaded.append(_load_reward_model(model_dir, torch.float32, placement))
        rng_after.append(torch.get_rng_state())
    plain, mapped = (dict(m.state_dict(), **dict(m.named_buffers())) for m in loaded)
    assert plain.keys() == mapped.keys() and "score.weight" in plain
    assert all(torch.equal(plain[k], mapped[k]) for k in plain)
    assert torch.equal(*rng_after)
    assert plain["score.weight"].abs().sum() > 0          # a drawn head, not an untouched (empty) tensor
