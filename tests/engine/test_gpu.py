"""GPU-only checks (marked `gpu`, skipped without CUDA; run through the device tool):
    python -m pytest -q -m gpu tests/engine/test_gpu.py
The fast path's kernels and the shared-prompt layout on real CUDA kernels, in bf16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_helpers import make_tiny_model_dir, random_rows, write_token_parquet
from stages.engine.modeling import USED_BACKENDS, SequenceLogProbs, load_causal_lm, packed_attention_forward
from stages.engine.packing import build_packed_batch, load_token_pairs
from stages.engine.data import model_inputs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")]


def test_packed_attention_with_gathered_keys_is_causal_bottom_right():
    """Query segments shorter than their key segments (the rejected completion over [prompt; itself])."""
    torch.manual_seed(0)
    hq, hkv, d = 14, 2, 64
    lq, lk = [37, 200, 5], [100, 333, 64]
    q = torch.randn(1, hq, sum(lq), d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, hkv, sum(lk), d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, hkv, sum(lk), d, device="cuda", dtype=torch.bfloat16)
    cq = torch.tensor([0, 37, 237, 242], dtype=torch.int32, device="cuda")
    ck = torch.tensor([0, 100, 433, 497], dtype=torch.int32, device="cuda")
    index = torch.arange(sum(lk), device="cuda")          # identity gather: keys already in segment order
    out, _ = packed_attention_forward(None, q, k, v, None, scaling=d ** -0.5, cu_seq_lens_q=cq, cu_seq_lens_k=ck,
                                      max_length_q=200, max_length_k=333, kv_index=index)
    ref = []
    for i in range(3):
        qs = q[0, :, cq[i]:cq[i + 1]].float()
        ks = k[0, :, ck[i]:ck[i + 1]].float().repeat_interleave(hq // hkv, 0)
        vs = v[0, :, ck[i]:ck[i + 1]].float().repeat_interleave(hq // hkv, 0)
        mask = torch.arange(lk[i], device="cuda")[None] <= torch.arange(lq[i], device="cuda")[:, None] + lk[i] - lq[i]
        ref.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1))
    torch.testing.assert_close(out[0].float(), torch.cat(ref), rtol=0, atol=2e-2)
    assert USED_BACKENDS & {"torch_varlen", "flash_attn"}


def test_shared_prompt_logps_match_unshared_on_gpu_in_bf16(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "m")
    pairs = load_token_pairs(write_token_parquet(tmp_path / "t.parquet", random_rows(16, seed=3)))
    model = SequenceLogProbs(load_causal_lm(model_dir), chunk_tokens=64).to("cuda", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        outs = [model(**model_inputs(build_packed_batch(pairs, list(range(16)), share_prompt=s).to(torch.device("cuda"))))
                for s in (False, True)]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0.05 * float(outs[0].abs().mean()))


GRAPH_CASES = [("dpo", "bf16", {}), ("dpo", "autocast", {}), ("rm", "bf16", {}),
               ("dpo", "bf16", {"optimizer": {"state": "fp32_master_8bit"}}),
               ("rm", "autocast", {"optimizer": {"state": "fp32_master_8bit"}}),
               ("dpo", "bf16", {"optimizer": {"state": "bf16_sr_8bit"}}),
               ("rm", "bf16", {"optimizer": {"state": "bf16_sr_8bit"}, "activation_checkpointing": 1}),
               ("dpo", "bf16", {"activation_checkpointing": True})]


@pytest.mark.parametrize("objective,precision,extra", GRAPH_CASES)
def test_cuda_graph_training_matches_eager_training(assets, objective, precision, extra):
    """The whole stage with train.cuda_graphs on (padded shapes, captured forward/backward and optimizer step,
    several micro-batches per step) against the same run eager: same losses, gradient norms and probe results.
    In each train.optimizer.state (graphed: the flat Triton kernels; eager: LowBitAdamW's torch ops) and with
    activation checkpointing captured in the graphs."""
    import json
    import numpy as np
    import pandas as pd
    from stages import ref_logps, train_dpo, train_rm
    from stages.lib.io import read_jsonl
    from stage_helpers import stage_args, write_train_params as write_params
    tmp_path = assets
    runs = {}
    for graphs in (0, 8):
        params = write_params(tmp_path / f"p{graphs}.yaml", train={"gpus": 1, "precision": precision,
                                                                    "cuda_graphs": graphs, **extra})
        out = tmp_path / f"run{graphs}"
        if objective == "dpo":
            if not (tmp_path / "ref.parquet").exists():
                ref_logps.main(stage_args(tmp_path, "--out", tmp_path / "ref.parquet", params))
            train_dpo.main([*stage_args(tmp_path, "--out-dir", out, params), "--ref-logps", str(tmp_path / "ref.parquet")])
        else:
            train_rm.main(stage_args(tmp_path, "--out-dir", out, params))
        runs[graphs] = (pd.read_csv(out / "train_log.csv"), json.loads((out / "run_info.json").read_text()),
                        read_jsonl(out / "probe_final.jsonl"),
                        json.loads((tmp_path / f"run{graphs}.perf.json").read_text()))
    (eager_log, eager_info, eager_probe, _), (graph_log, graph_info, graph_probe, graph_perf) = runs[0], runs[8]
    assert eager_info["cuda_graphs"]["enabled"] is False
    info = graph_info["cuda_graphs"]
    counts = graph_perf["cuda_graphs"]           # the process's own counts: in the perf log, not run_info.json
    assert info["enabled"] and counts["replays"] > 0 and counts["shapes_captured"] >= 1, (info, counts)
    assert not {"replays", "captures", "shapes_captured"} & set(info), info
    # Kernels this process launched before can hide a warm-up miss here, never make one up: a variant first
    # launched inside the graphed loop is a miss (the fresh-process test below is the strict form).
    assert counts["triton_first_launches"] == [], counts["triton_first_launches"]
    lowbit = (extra.get("optimizer") or {}).get("state", "exact") != "exact"
    assert info["optimizer"]["kind"] == ("flat_triton_adamw_8bit" if lowbit else
                                         "flat_triton_adamw" if precision == "bf16" else "torch_fused_adamw")
    assert graph_log.pairs.tolist() == eager_log.pairs.tolist() and graph_log.tokens.tolist() == eager_log.tokens.tolist()
    np.testing.assert_allclose(graph_log.loss[0], eager_log.loss[0], rtol=2e-3)
    np.testing.assert_allclose(graph_log.grad_norm[0], eager_log.grad_norm[0], rtol=2e-2)
    np.testing.assert_allclose(graph_log.loss, eager_log.loss, rtol=5e-2, atol=1e-3)
    assert graph_log.loss.iloc[-1] < graph_log.loss.iloc[0]            # it learns
    np.testing.assert_allclose([r["margin"] for r in graph_probe], [r["margin"] for r in eager_probe],
                               rtol=0.1, atol=0.05 * float(np.abs([r["margin"] for r in eager_probe]).mean()))


def test_fused_rms_norm_matches_hf_on_gpu_in_bf16(tmp_path):
    from stages.engine.modeling import FUSABLE_RMS_NORMS
    model = load_causal_lm(make_tiny_model_dir(tmp_path / "m")).to("cuda", dtype=torch.bfloat16)
    norm = next(m for m in model.modules() if type(m).__name__ in FUSABLE_RMS_NORMS)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(300, model.config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fused, hf = norm(x), type(norm).forward(norm, x)
    torch.testing.assert_close(fused.float(), hf.float(), rtol=2e-2, atol=2e-2)   # bf16 rounding order only
    g = torch.randn_like(fused)
    gx_fused, gw_fused = torch.autograd.grad(fused, (x, norm.weight), g)
    gx_hf, gw_hf = torch.autograd.grad(hf, (x, norm.weight), g)
    torch.testing.assert_close(gx_fused.float(), gx_hf.float(), rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(gw_fused.float(), gw_hf.float(), rtol=5e-2, atol=0.5)


def test_fused_rotary_and_silu_mul_match_hf_on_gpu_in_bf16():
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb as hf_rope
    from stages.engine import kernels
    torch.manual_seed(0)
    t, hq, hk, d = 700, 14, 2, 64
    qp = torch.randn(1, t, hq * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kp = torch.randn(1, t, hk * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ang = torch.rand(t, d // 2, device="cuda") * t
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    q, k = qp.view(1, t, hq, d).transpose(1, 2), kp.view(1, t, hk, d).transpose(1, 2)
    ref = hf_rope(q.float(), k.float(), cos.float()[None], sin.float()[None])      # fp32 reference
    out = kernels.rotary_qk(q[0].transpose(0, 1), k[0].transpose(0, 1), cos, sin)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o.float(), r[0].transpose(0, 1), rtol=1e-2, atol=1e-2)   # one bf16 rounding
    grads = [torch.randn_like(o) for o in out]
    got = torch.autograd.grad(out, (qp, kp), grads)
    want = torch.autograd.grad(ref, (qp, kp), [g.float().transpose(0, 1)[None] for g in grads])
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    gate = torch.randn(t, 4864, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn_like(gate, requires_grad=True)
    out = kernels.silu_mul(gate, up)
    ref = F.silu(gate.float()) * up.float()
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (gate, up), g), torch.autograd.grad(ref, (gate, up), g.float())):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_fused_model_matches_hf_code_path_on_gpu_in_bf16(tmp_path, monkeypatch):
    """Whole packed model, bf16 on CUDA: routed through the fused kernels vs HF's code (routing switched off)."""
    from stages.engine import kernels
    model_dir = make_tiny_model_dir(tmp_path / "m", hidden=128)
    pairs = load_token_pairs(write_token_parquet(tmp_path / "t.parquet", random_rows(16, seed=5)))
    batch = build_packed_batch(pairs, list(range(16)), share_prompt=True).to(torch.device("cuda"))
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(kernels, "available", lambda *t: False)
        torch.manual_seed(0)
        lm = load_causal_lm(model_dir)
        assert lm.prefpipe_fused_kernels["silu_mul"] == lm.prefpipe_fused_kernels["rotary"] == 2
        model = SequenceLogProbs(lm, chunk_tokens=64).to("cuda", dtype=torch.bfloat16)
        logps = model(**model_inputs(batch))
        logps.sum().backward()
        results.append((logps.detach(), torch.cat([p.grad.float().flatten() for p in model.parameters()])))
    (lp_f, g_f), (lp_h, g_h) = results
    torch.testing.assert_close(lp_f, lp_h, rtol=0, atol=0.02 * float(lp_h.abs().mean()))
    assert F.cosine_similarity(g_f, g_h, dim=0) > 0.99


def test_models_loaded_straight_onto_the_gpu_equal_cpu_loads_moved_there(tmp_path):
    """The training stages load their weights straight into GPU memory (fp32, cast there): the same values,
    buffers included, as the CPU load moved to the GPU; a reward model's new seeded head too (made from the CPU
    RNG, not the GPU's), and neither RNG is left where the CPU load would not leave it."""
    from stages.engine.modeling import load_reward_model
    model_dir = make_tiny_model_dir(tmp_path / "m")
    cuda = torch.device("cuda")
    for load in (load_causal_lm, load_reward_model):
        states = []
        for device in (None, cuda):
            torch.manual_seed(3)
            torch.cuda.manual_seed(3)
            model = load(model_dir, device=device).to(cuda)
            states.append((dict(model.state_dict(), **dict(model.named_buffers())), torch.get_rng_state(),
                           torch.cuda.get_rng_state(cuda)))
        (moved, cpu_rng_a, cuda_rng_a), (direct, cpu_rng_b, cuda_rng_b) = states
        assert moved.keys() == direct.keys()
        assert all(direct[k].device.type == "cuda" and torch.equal(moved[k], direct[k]) for k in moved), load
        assert torch.equal(cpu_rng_a, cpu_rng_b) and torch.equal(cuda_rng_a, cuda_rng_b)


def test_flat_adamw_equals_the_eager_master_weight_step_on_gpu():
    """The graph path's flat Triton AdamW against MasterWeightAdamW's fused step on CUDA (the same check the
    CPU suite runs under Triton's interpreter; here the bf16 weights must be the masters rounded to nearest)."""
    from triton_interpret_checks import check_flat_adamw
    check_flat_adamw("cuda")


def test_decode_attention_kernel_equals_the_masked_matmul_attention_on_gpu():
    """Generation's decode-attention kernel in bf16 on CUDA against the masked two-matmul form in float64 (the
    check the CPU suite runs under Triton's interpreter in fp32)."""
    from triton_interpret_checks import check_decode_attention, check_decode_rotary
    check_decode_attention("cuda")
    check_decode_rotary("cuda")


def test_flat_lowbit_adamw_equals_the_eager_lowbit_step_on_gpu():
    """The low-bit modes' flat Triton kernel against LowBitAdamW's torch ops on CUDA (the interpreter check of
    tests/engine/test_kernels.py, on the GPU's own rounding: FMA contraction, round-to-nearest bf16)."""
    from triton_interpret_checks import check_flat_lowbit
    check_flat_lowbit("cuda")


def test_lowbit_kernel_fast_paths_and_geometry_are_bitwise_the_reference_form_on_gpu():
    """kernels._adamw8_kernel's vectorized one-launch-per-buffer form with its branch-free divisions and square root
    (MUFU + FFMA) against one masked launch per tensor with div_rn / sqrt_rn, bitwise, on decayed, zero and tiny
    moments too, and a launch whose every tile reruns in the reference form (triton_interpret_checks)."""
    from triton_interpret_checks import check_lowbit_geometry
    check_lowbit_geometry("cuda")


@pytest.mark.parametrize("state", ["fp32_master_8bit", "bf16_sr_8bit"])
def test_lowbit_codec_and_hash_are_bitwise_the_cpu_ones_on_gpu(state):
    """One flat step from zero state on the GPU: the codes and scales it writes for m and sqrt(v) decode to what
    the CPU codec gives for the same fp32 moments (the integer encoding is the same), and the stochastic rounding
    uses the CPU hash's bits (the bf16 weights equal the CPU's but where the fp32 update differs by an ulp)."""
    from stages.engine.flat_adamw import FlatLowBitAdamW
    from stages.engine.lowbit_adamw import LowBitAdamW
    from stages.engine.steps import graphed_optimizer_step
    from engine_helpers import train_settings
    torch.manual_seed(0)
    settings = train_settings(max_grad_norm=0.0, precision="bf16", optimizer={"state": state})
    w0 = torch.randn(1000, 70)
    g = torch.randn(1000, 70) * torch.exp(torch.randn(1000, 1) * 3)
    out = {}
    for device in ("cpu", "cuda", "cuda_eager"):       # cuda: the flat kernel; cuda_eager: one tensor's launch
        dev = device.split("_")[0]
        p = torch.nn.Parameter(w0.to(dev, torch.bfloat16))
        masters = {id(p): w0.to(dev)} if state == "fp32_master_8bit" else None
        opt = LowBitAdamW([{"params": [p], "weight_decay": 0.0}], state, seed=9, masters=masters, lr=1e-3,
                          betas=(0.9, 0.999))
        p.grad = g.to(dev, torch.bfloat16)
        if device != "cuda":
            opt.step()
        else:
            lrs = [torch.full((), 1e-3, device="cuda")]
            sums, row = torch.zeros(1, dtype=torch.float64, device="cuda"), torch.zeros(2, dtype=torch.float64, device="cuda")
            graphed_optimizer_step(opt, p, settings, lrs, sums, row, FlatLowBitAdamW(opt, 0.0))
        out[device] = ({k: v.cpu() for k, v in opt.state_dict()["state"][0].items()}, p.detach().cpu())
    sc, pc = out["cpu"]
    for gpu in ("cuda", "cuda_eager"):
        sg, pg = out[gpu]
        for key in ("m_codes", "s_codes"):
            assert float((sc[key] != sg[key]).double().mean()) < 1e-3, key      # fp32 rounding at a code boundary
        for key in ("m_scale", "s_scale"):
            torch.testing.assert_close(sc[key], sg[key], rtol=1e-6, atol=0)
        assert float((pc != pg).double().mean()) < 1e-3


@pytest.mark.parametrize("stage", ["train_dpo", "train_rm"])
def test_resume_under_cuda_graphs_continues_the_run(assets, stage):
    """Checkpoint every 2 steps with the graphed step, resume from step 4 (its first step eager, the rest
    replayed, the shapes planned from the remaining batches): the restored log rows are the saved ones and
    the continued steps and final probe agree with the uninterrupted run (not bitwise: the resumed run
    pads its batches to its own shape plan)."""
    import importlib
    import numpy as np
    import pandas as pd
    from stages.lib.io import read_jsonl
    from stage_helpers import checkpoint_at, ckpt_args, write_train_params as write_params
    tmp_path = assets
    params = write_params(tmp_path / "p.yaml", dpo={"objective": "dpo_ref_free"},
                          train={"gpus": 1, "precision": "bf16", "cuda_graphs": 8, "save_every": 2,
                                 "keep_checkpoints": 4})
    main = importlib.import_module(f"stages.{stage}").main
    full = main(ckpt_args(tmp_path, "full", params, tmp_path / "ck"))
    resumed = main(ckpt_args(tmp_path, "resumed", params, tmp_path / "ck2", resume=checkpoint_at(tmp_path / "ck", 4)))
    assert full["cuda_graphs"]["enabled"] and resumed["cuda_graphs"]["enabled"]
    assert full["cuda_graphs"]["optimizer"]["kind"] == resumed["cuda_graphs"]["optimizer"]["kind"] == "flat_triton_adamw"
    assert resumed["perf"]["resumed_from_step"] == 4 and resumed["perf"]["checkpoints_saved"] == [6, 8]
    a, b = pd.read_csv(tmp_path / "full/train_log.csv"), pd.read_csv(tmp_path / "resumed/train_log.csv")
    assert a.step.tolist() == b.step.tolist() == list(range(1, 9))
    cols = ["loss", "grad_norm", "lr", "pairs", "tokens"]
    pd.testing.assert_frame_equal(a[cols][:4], b[cols][:4], check_exact=True)     # restored, not recomputed
    np.testing.assert_allclose(b.loss[4:], a.loss[4:], rtol=2e-2, atol=1e-3)
    np.testing.assert_allclose(b.grad_norm[4:], a.grad_norm[4:], rtol=5e-2)
    pa, pb = read_jsonl(tmp_path / "full/probe_final.jsonl"), read_jsonl(tmp_path / "resumed/probe_final.jsonl")
    np.testing.assert_allclose([r["margin"] for r in pb], [r["margin"] for r in pa], rtol=0.1,
                               atol=0.05 * float(np.abs([r["margin"] for r in pa]).mean()))


@pytest.mark.parametrize("state", ["exact", "fp32_master_8bit", "bf16_sr_8bit"])
def test_memory_plan_bounds_the_measured_peak_on_gpu(tmp_path, state):
    """A 0.2B-parameter model (hidden 1024, 8 layers, vocab 32,000), full fine-tune in each optimizer state, graphed:
    the stage's measured peak (torch.cuda.max_memory_allocated) is below the plan's total and above its static parts
    (weights, gradients, masters, moments), and within the plan minus its fixed 1 GiB margin plus 25%."""
    import json
    import os
    import subprocess
    import sys
    from conftest import REPO_ROOT
    from stage_helpers import write_train_params as write_params
    from engine_helpers import toy_task_rows
    from stages.engine.dist import ALLOCATOR_ENV, CUDA_ALLOCATOR_CONF
    model_dir = tmp_path / "m"
    from transformers import AutoModelForCausalLM, Qwen2Config
    cfg = Qwen2Config(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, max_position_embeddings=512)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(model_dir)
    write_token_parquet(tmp_path / "train.parquet", toy_task_rows(256, seed=1, vocab=32000))
    write_token_parquet(tmp_path / "probe.parquet", toy_task_rows(16, seed=2, vocab=32000, prefix="q"))
    params = write_params(tmp_path / "p.yaml", train={"gpus": 1, "precision": "bf16", "epochs": 1,
                                                      "micro_batch_tokens": 4096, "global_batch_pairs": 64,
                                                      "optimizer": {"state": state}})
    # In a process of its own: max_memory_allocated counts whatever earlier tests of this process left allocated
    # (a pytest run of this file measured 2.6 GiB here against bench/memory_phases.py's 1.07 GiB for the same run).
    subprocess.run([sys.executable, "-m", "stages.train_rm", "--params", str(params), "--model-dir", str(model_dir),
                    "--train-tokens", str(tmp_path / "train.parquet"), "--probe-tokens", str(tmp_path / "probe.parquet"),
                    "--out-dir", str(tmp_path / "out"), "--log", str(tmp_path / "log"),
                    "--perf", str(tmp_path / "perf.json")], check=True, cwd=REPO_ROOT,
                   env={**{k: v for k, v in os.environ.items() if k not in ALLOCATOR_ENV},   # none set by hand
                        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])})
    plan = json.loads((tmp_path / "out" / "run_info.json").read_text())["memory_plan"]
    perf = json.loads((tmp_path / "perf.json").read_text())
    peak = max(perf["peak_memory_bytes_per_rank"])
    static = plan["weights"] + plan["grads"] + plan["masters"] + plan["moments"]
    assert static < peak < plan["total"], (static, peak, plan)
    assert peak < 1.25 * (plan["total"] - 2 ** 30), (peak, plan)
    # What the card held (allocated + cached + the graphs' pools), with the allocator the stage configures itself
    # (dist.configure_cuda_allocator): within the plan, whose overhead is meant to cover it.
    assert perf["cuda_allocator_conf"] == CUDA_ALLOCATOR_CONF
    reserved = max(perf["peak_reserved_bytes_per_rank"])
    assert peak <= reserved < plan["total"], (reserved, plan)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generation_decode_graphs_equal_eager_decode_on_gpu(temperature):
    """The generate stage's loop on CUDA in bf16 (bench/generation_bench.py's tiny shape with a merged LoRA policy):
    decode steps replayed as CUDA graphs give the same completions, to the token, as eager decode steps, greedy and
    sampled (the counter-based draws do not depend on the path), and a second graphed run gives them again."""
    import sys

    import numpy as np
    from conftest import REPO_ROOT
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    import generation_bench
    from stages.engine.generation import GenerationSettings, StopTokens, generate
    device = torch.device("cuda")
    model = generation_bench.build_models("tiny", device, torch.bfloat16)["policy"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 1000, size=int(n)) for n in rng.integers(3, 40, size=10)]
    settings = GenerationSettings(max_new_tokens=24, temperature=temperature, top_p=0.9, seed=7, n=2, batch_size=8)
    stop = StopTokens(eos=(generation_bench.EOS_ID,))

    def run(graphs: bool):
        out = generate(model, prompts, list(range(len(prompts))), settings, stop, generation_bench.EOS_ID, device,
                       cuda_graphs=graphs)
        return out, [(c.prompt, c.sample, c.tokens, c.stop_reason) for c in out.completions]

    graphed, tokens = run(True)
    assert graphed.cuda_graphs["enabled"] is True, graphed.cuda_graphs
    assert run(False)[1] == tokens
    assert run(True)[1] == tokens


def test_first_launches_names_a_kernel_variant_first_launched_inside_it():
    """kernels.FirstLaunches (the loop's record of warm-up misses) sees Triton's in-process cache miss: a new
    specialization is named once, its relaunch is not, and the kernel still computes (the hook never skips it)."""
    import triton
    import triton.language as tl
    from stages.engine import kernels

    @triton.jit
    def _scale_kernel(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

    x = torch.ones(100, device="cuda")
    with kernels.FirstLaunches() as seen:
        _scale_kernel[(1,)](x, 100, BLOCK=128)
        _scale_kernel[(1,)](x, 100, BLOCK=128)
    assert seen.names == ["_scale_kernel"], seen.names
    assert torch.equal(x, torch.full_like(x, 4.0))
    with kernels.FirstLaunches() as seen:               # the hook is removed on exit: a new variant after it is
        pass                                            # not recorded by the old context
    _scale_kernel[(1,)](x, 100, BLOCK=256)
    assert seen.names == []


@pytest.mark.parametrize("stage,state,graphs", [("train_dpo", "exact", 8), ("train_dpo", "bf16_sr_8bit", 8),
                                                ("train_rm", "fp32_master_8bit", 8),
                                                ("train_dpo", "bf16_sr_8bit", 0), ("train_rm", "fp32_master_8bit", 0)])
def test_a_gpu_run_launches_no_kernel_variant_its_warm_ups_missed(assets, stage, state, graphs):
    """A fresh process (no kernel launched before the stage's own warm-ups): the timed loop of a run, graphed or
    eager, first launches no Triton kernel variant. Each miss would be a compile (or a disk-cache load) inside the
    first timed step: at 7B on an H100 two such compiles cost ~1.1 s of a 2.0-s eager step (issue 38). The reward
    model's head once put the 8-bit optimizer's second segment at an odd block, an unaligned pointer no warm-up had
    launched. The eager 8-bit step (graphs 0; also every DDP and FSDP2 run) launches one kernel per tensor: EVEN
    True and False there were first launched in the loop until LowBitAdamW.warm_up_cuda."""
    import json
    import os
    import subprocess
    import sys
    from stage_helpers import REPO_ROOT, stage_args, write_train_params as write_params
    tmp_path = assets
    params = write_params(tmp_path / "p.yaml", dpo={"objective": "dpo_ref_free"},
                          train={"gpus": 1, "precision": "bf16", "cuda_graphs": graphs, "optimizer": {"state": state}})
    out = tmp_path / "run"
    subprocess.run([sys.executable, "-m", f"stages.{stage}", *stage_args(tmp_path, "--out-dir", out, params)],
                   cwd=REPO_ROOT, check=True, timeout=600,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])})
    perf = json.loads((tmp_path / "run.perf.json").read_text())
    if graphs:
        assert perf["cuda_graphs"]["replays"] > 0
    else:
        assert perf["cuda_graphs"]["optimizer"]["warmup_seconds"] > 0, perf["cuda_graphs"]
    assert perf["cuda_graphs"]["triton_first_launches"] == [], perf["cuda_graphs"]["triton_first_launches"]
