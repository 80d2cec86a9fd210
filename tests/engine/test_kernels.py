"""The fused kernels (stages/engine/kernels.py) and their routing (modeling.use_fused_kernels).

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess so this process's
kernels stay compiled-for-GPU); tests/engine/test_gpu.py runs the same checks on CUDA in bf16."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from engine_helpers import interpret, make_tiny_model_dir, random_rows, write_token_parquet
from stages.engine.modeling import SequenceLogProbs, load_causal_lm, load_reward_model
from stages.engine.packing import build_packed_batch, load_token_pairs
from stages.engine.data import model_inputs

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@needs_triton
def test_kernels_match_hf_math_forward_and_backward_under_the_interpreter():
    assert "kernels ok" in interpret("kernels")


@needs_triton
def test_decode_attention_kernel_equals_the_masked_matmul_attention_under_the_interpreter():
    """Generation's CUDA decode step: its attention kernel (kernels.decode_attention) reads only each row's own keys
    and equals the masked two-matmul form the CPU path runs; its rotary embedding (the rows as the rotary kernel's
    tokens) equals HF's (tests/triton_interpret_checks.py check_decode_attention, check_decode_rotary)."""
    out = interpret("decode_attention")
    assert "decode attention ok" in out and "decode rotary ok" in out


@needs_triton
def test_flat_adamw_equals_the_eager_master_weight_step_under_the_interpreter():
    """stages/engine/flat_adamw.py's three kernels through graphed_optimizer_step: the masters, moments and step
    counts of MasterWeightAdamW's own clipped step, the model's weights its rounded masters, a parameter
    without gradient untouched, and a state_dict that continues as MasterWeightAdamW's. Both flat optimizers'
    planned_sizes (the warm-up's) equal the layout their first step builds, and a warm-up at 7B sizes (i64) stays
    inside its scratch buffers."""
    out = interpret("flat_adamw")
    assert "flat adamw ok" in out and "flat warm-up ok" in out


@needs_triton
def test_flat_lowbit_adamw_equals_the_eager_lowbit_step_under_the_interpreter():
    """stages/engine/flat_adamw.py's FlatLowBitAdamW (kernels._adamw8_kernel: 8-bit moments, stochastic rounding
    by the counter hash) against LowBitAdamW's torch-ops step, in each low-bit mode, and its state_dict continuing
    as LowBitAdamW's (bounds in triton_interpret_checks.check_flat_lowbit)."""
    assert "flat lowbit ok" in interpret("flat_lowbit")


@needs_triton
def test_lowbit_kernel_launch_geometry_under_the_interpreter():
    """kernels._adamw8_kernel over one flat buffer of several tensors (padded last blocks, a partial last tile)
    with its vectorized path (EVEN) equals bitwise one masked launch per tensor, in each low-bit mode; the padding
    stays zero and nothing past the range is written (triton_interpret_checks.check_lowbit_geometry)."""
    assert "lowbit geometry ok" in interpret("lowbit_geometry")


@needs_triton
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_routed_model_matches_hf_code_path(tmp_path, arch):
    """The whole packed model with rotary and SiLU-mul through the (interpreted) kernels equals this process's
    CPU run, which takes HF's code: same log-probs and gradients up to fp32 rounding."""
    model_dir = make_tiny_model_dir(tmp_path / "m", arch=arch)
    parquet = write_token_parquet(tmp_path / "t.parquet", random_rows(6, seed=4))
    interpret("model", str(model_dir), str(parquet), str(tmp_path / "fused.pt"))
    fused = torch.load(tmp_path / "fused.pt")
    layers = 2
    assert fused["routed"] == {"rms_norm": 2 * layers + 1, "silu_mul": layers, "rotary": layers, "qkv_gemm": layers}
    # per layer: q|k|v and gate|up as one GEMM each, the rotary and silu(gate) * up kernels
    assert fused["calls"] == {"rotary_qk": layers, "silu_mul_halves": layers, "grouped_linear": 2 * layers}

    torch.manual_seed(0)
    model = SequenceLogProbs(load_causal_lm(model_dir), chunk_tokens=16)
    pairs = load_token_pairs(parquet)
    logps = model(**model_inputs(build_packed_batch(pairs, list(range(len(pairs))), share_prompt=True)))
    logps.sum().backward()
    torch.testing.assert_close(fused["logps"], logps.detach(), rtol=1e-6, atol=1e-5)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == fused["grads"].keys()
    for n, g in grads.items():
        torch.testing.assert_close(fused["grads"][n], g, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_cpu_calls_keep_hf_code_bit_for_bit(tmp_path, arch):
    import sys as _sys
    model_dir = make_tiny_model_dir(tmp_path / "m", arch=arch)
    for model in (load_causal_lm(model_dir), load_reward_model(model_dir)):
        counts = model.prefpipe_fused_kernels
        assert counts["rms_norm"] == 2 * model.config.num_hidden_layers + 1
        if importlib.util.find_spec("triton") is None:
            assert counts["silu_mul"] == counts["rotary"] == counts["qkv_gemm"] == 0
            continue
        assert counts["silu_mul"] == counts["rotary"] == counts["qkv_gemm"] == model.config.num_hidden_layers
        mlp = model.base_model.layers[0].mlp
        x = torch.randn(5, model.config.hidden_size)
        assert "forward" in vars(mlp) and torch.equal(mlp(x), type(mlp).forward(mlp, x))
        attn = model.base_model.layers[0].self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):      # routed, and on CPU nn.Linear's own result
            assert "forward" in vars(proj) and torch.equal(proj(x), torch.nn.Linear.forward(proj, x))
        routed = _sys.modules[type(attn).__module__].apply_rotary_pos_emb
        q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
        cos, sin = torch.rand(1, 5, 8), torch.rand(1, 5, 8)
        for a, b in zip(routed(q, k, cos, sin), routed.prefpipe_original(q, k, cos, sin)):
            assert torch.equal(a, b)


def test_first_launches_is_none_where_triton_cannot_report_and_restores_the_hook(monkeypatch):
    """kernels.FirstLaunches (the loop's record of warm-up misses): with Triton's hook available it starts an empty
    list and puts back the hook it found; with no Triton (or one without knobs) it records None, never an empty
    list, which would claim that no kernel was missed when nothing was observed. (Its firing is GPU-only:
    tests/engine/test_gpu.py.)"""
    from stages.engine import kernels
    triton = pytest.importorskip("triton")
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs.runtime, "jit_cache_hook"):
        before = knobs.runtime.jit_cache_hook
        with kernels.FirstLaunches() as seen:
            assert knobs.runtime.jit_cache_hook == seen._hook
        assert seen.names == [] and knobs.runtime.jit_cache_hook is before
    monkeypatch.setattr(kernels, "triton", None)
    with kernels.FirstLaunches() as seen:
        pass
    assert seen.names is None
