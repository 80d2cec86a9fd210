"""The GPU benchmark on CPU: workload builders, the patched TRL anchor, shapes / FLOPs / failure recording, and a
tiny LoRA smoke run."""
from __future__ import annotations

import gzip
import json
import sys

import pytest

from conftest import REPO_ROOT, SHARED_DATA

sys.path.insert(0, str(REPO_ROOT / "bench"))
import gpu_bench  # noqa: E402

ANCHOR = SHARED_DATA.parent / "bench" / "trl_anchor.py"


def test_long_concatenations_are_hh_dialogues_ending_in_each_rows_own_pair(tmp_path):
    rows = [{"chosen": f"\n\nHuman: q{i}\n\nAssistant: good{i}", "rejected": f"\n\nHuman: q{i}\n\nAssistant: bad{i}"}
            for i in range(6)]
    src = tmp_path / "hh.jsonl.gz"
    with gzip.open(src, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    assert gpu_bench.hh_lines(src, 1) == [json.dumps(r) for r in rows]
    out = [json.loads(line) for line in gpu_bench.hh_lines(src, 3)]
    assert len(out) == 4
    context = rows[1]["chosen"] + rows[2]["chosen"]
    assert out[1] == {"chosen": context + rows[3]["chosen"], "rejected": context + rows[3]["rejected"]}


def test_trl_anchor_patch_changes_only_the_workload(tmp_path):
    if not ANCHOR.exists():
        pytest.skip(f"TRL anchor not present at {ANCHOR}")
    data = tmp_path / "rows.jsonl.gz"
    patched = gpu_bench.patched_trl_anchor(ANCHOR, "qwen2.5-1.5b", 4096, data, tmp_path / "anchor.py").read_text()
    original = ANCHOR.read_text()
    changed = [(a, b) for a, b in zip(original.splitlines(), patched.splitlines()) if a != b]
    assert len(original.splitlines()) == len(patched.splitlines()) and len(changed) == 4
    assert "hidden_size=1536, intermediate_size=8960" in patched and "num_attention_heads=12" in patched
    assert "max_length=4096" in patched and ", 4096)" in patched and json.dumps(str(data)) in patched
    # the default workload leaves the anchor as it is; an anchor that no longer matches fails loudly
    assert gpu_bench.patched_trl_anchor(ANCHOR, "qwen2.5-0.5b", 1024, None, tmp_path / "same.py").read_text() == original
    # the anchor hard-codes 2 KV heads, vocab 151,936 and tied embeddings: 7B goes to trl_peft_runner instead
    with pytest.raises(SystemExit, match="hard-codes"):
        gpu_bench.patched_trl_anchor(ANCHOR, "qwen2.5-7b", 1024, None, tmp_path / "7b.py")
    other = tmp_path / "other_anchor.py"
    other.write_text(original.replace("max_length=1024", "max_length=2048"))
    with pytest.raises(SystemExit, match="cannot patch"):
        gpu_bench.patched_trl_anchor(other, "qwen2.5-0.5b", 4096, None, tmp_path / "x.py")


@pytest.mark.skipif(not (SHARED_DATA / "hh-rlhf").exists(), reason=f"shared data not present at {SHARED_DATA}")
def test_step_profile_profiles_the_real_stage_on_cpu(tmp_path):
    """bench/step_profile.py drives the train_dpo stage with PREFPIPE_PROFILE: the first-step, second-step and
    steady windows come back as tables and a summary, the first two also as Python profiles (--python), and the
    run itself completes (tiny shape, CPU). 32 pairs are the 4 optimizer steps the windows need (steps 0, 1;
    steps 2..3); 8 probe pairs, scored outside the windows, keep the
    probe passes (before and after training, and the reference pass) from being most of the test's time."""
    import step_profile
    out = tmp_path / "results" / "profile.json"
    step_profile.main(["--shared", str(SHARED_DATA.parent), "--out", str(out), "--shape", "tiny", "--pairs", "32",
                       "--probe-pairs", "8",
                       "--variants", "eager", "--profile-start", "2", "--profile-steps", "2", "--python",
                       "--work", str(tmp_path / "work")])
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert run["stage"] == "train_dpo" and run["cuda_graphs"]["enabled"] is False
    prof = run["profile"]
    assert prof["first_step"]["first_step"] == 0 and prof["first_step"]["steps"] == 1
    assert prof["steady"]["first_step"] == 2 and prof["steady"]["steps"] == 2
    assert prof["steady"]["ms_per_step"] > 0
    steady = (out.parent / "step_profile_train_dpo_eager_steady.txt").read_text()
    assert "optimizer steps 2..3" in steady and "aten::mm" in steady
    assert "aten::" in (out.parent / "step_profile_train_dpo_eager_first_step.txt").read_text()
    assert prof["second_step"]["first_step"] == 1 and prof["second_step"]["steps"] == 1
    assert "optimizer steps 1..1" in (out.parent / "step_profile_train_dpo_eager_second_step.txt").read_text()
    for name in ("first_step", "second_step"):     # cProfile's tables: the loop's own step function is in them
        text = (out.parent / f"step_profile_train_dpo_eager_{name}_py.txt").read_text()
        assert "cumulative" in text and "tottime" in text and "forward_backward" in text


def test_shapes_param_counts_and_lora_flops_match_transformers_and_peft():
    """param_counts against the real transformers model of every shape (built on the meta device, so 7B costs
    nothing), lora_parameters against peft's own adapter, and mode_flops's convention (full 6N; LoRA 4(N+A)+2T)
    on counts read from those models."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    for name, shape in gpu_bench.SHAPES.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(gpu_bench.qwen2_config(name, 50256))
        counts = gpu_bench.param_counts(shape)
        assert counts["total"] == sum(p.numel() for p in model.parameters()), name
        assert counts["lm_head"] == model.get_output_embeddings().weight.numel()
        assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == shape["tie_word_embeddings"]
        if name == "qwen2.5-7b":
            assert counts["total"] > 7.6e9 and shape["vocab_size"] == 152064 and not shape["tie_word_embeddings"]
    shape = gpu_bench.SHAPES["qwen2.5-7b"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(gpu_bench.qwen2_config("qwen2.5-7b", 50256))
    # N of the DPO policy: every matmul weight the forward runs = all parameters but the input embedding lookup
    n = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    lora = gpu_bench.LORA
    peft_model = get_peft_model(model, LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=0.0,
                                                  target_modules=lora["target_modules"], task_type="CAUSAL_LM"))
    a = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert a == gpu_bench.lora_parameters(shape, lora["r"], lora["target_modules"])
    tokens = 1000
    assert gpu_bench.mode_flops(shape, "dpo", tokens, 0) == 6 * n * tokens
    assert gpu_bench.mode_flops(shape, "dpo", tokens, 0, lora) == (4 * (n + a) + 2 * a) * tokens
    # plus DPO's reference pass: a forward of the base alone (the reference has no adapters)
    assert gpu_bench.mode_flops(shape, "dpo", tokens, 0, lora, reference_pass=True) == (4 * (n + a) + 2 * a + 2 * n) * tokens
    # the RM runs no LM head but a scalar score head, trained in full beside the adapters
    n_rm = n - shape["vocab_size"] * shape["hidden_size"] + shape["hidden_size"]
    assert gpu_bench.mode_flops(shape, "rm", tokens, 0) == 6 * n_rm * tokens
    t_rm = a + shape["hidden_size"]
    assert gpu_bench.mode_flops(shape, "rm", tokens, 0, lora) == (4 * (n_rm + a) + 2 * t_rm) * tokens
    with pytest.raises(SystemExit, match="not Qwen2 Linear"):
        gpu_bench.lora_parameters(shape, 16, ["qkv_proj"])


def test_a_failed_mode_is_recorded_as_oom_or_failed(tmp_path):
    """sh() raises StageFailed with the log's tail; failure_record says "oom" when the log names a CUDA
    out-of-memory (what torch raises), "failed" otherwise."""
    import sys as _sys
    oom = "import torch; raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 20.00 GiB')"
    with pytest.raises(gpu_bench.StageFailed) as e:
        gpu_bench.sh([_sys.executable, "-c", oom], log=tmp_path / "oom.out")
    rec = gpu_bench.failure_record(e.value)
    assert rec["status"] == "oom" and rec["returncode"] == 1 and "Tried to allocate 20.00 GiB" in rec["error"]
    with pytest.raises(gpu_bench.StageFailed) as e:
        gpu_bench.sh([_sys.executable, "-c", "raise ValueError('bad shard')"], log=tmp_path / "bad.out")
    rec = gpu_bench.failure_record(e.value)
    assert rec["status"] == "failed" and "bad shard" in rec["error"]
    assert gpu_bench.sh([_sys.executable, "-c", "pass"], log=tmp_path / "ok.out") > 0


def test_modes_expand_and_the_lora_mode_needs_the_adapter_param():
    assert gpu_bench.expand_modes("ours,trl_peft,ours_rm") == ["ours_dpo", "ours_rm", "trl_dpo_peft", "trl_rm_peft"]
    assert gpu_bench.expand_modes("ours_lora, trl_dpo") == ["ours_lora_dpo", "ours_lora_rm", "trl_dpo"]
    assert gpu_bench.expand_modes("ours_8bit,ours_sr_rm,ours_fused") == ["ours_8bit_dpo", "ours_8bit_rm", "ours_sr_rm",
                                                                     "ours_fused_dpo", "ours_fused_rm"]
    assert [gpu_bench.family_of(m) for m in ("ours_dpo", "ours_8bit_rm", "ours_sr_dpo", "ours_lora_rm", "trl_rm")] == [
        "ours", "ours_8bit", "ours_sr", "ours_lora", None]
    assert gpu_bench.expand_modes("ours_sr_dpo,trl_liger,trl_dpo_ckpt_liger") == ["ours_sr_dpo", "trl_dpo_liger",
                                                                                   "trl_dpo_ckpt_liger"]
    with pytest.raises(SystemExit, match="unknown mode 'lora'"):
        gpu_bench.expand_modes("ours,lora")
    import copy
    import yaml
    from stages.lib.params import load_schema
    schema, base = load_schema(), yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    if "adapter" in schema["properties"]["train"]["properties"]:
        adapter = gpu_bench.lora_adapter(schema, base)
        assert adapter == {**gpu_bench.LORA, "export": "adapter"}     # the cheapest export the schema offers
        assert gpu_bench.lora_adapter(schema, base, export="merged")["export"] == "merged"
        with pytest.raises(SystemExit, match="does not match"):
            gpu_bench.lora_adapter(schema, base, export="zip")
    without = copy.deepcopy(schema)
    without["properties"]["train"]["properties"].pop("adapter", None)
    with pytest.raises(SystemExit, match="no train.adapter"):
        gpu_bench.lora_adapter(without, base)


def test_ratio_to_trl_best_is_to_the_fastest_full_trl_row_that_ran():
    """Issue 38's comparison: each full-fine-tune family against TRL's fastest full DPO of the same invocation
    (here its Liger row, over the defaults and a failed row); PEFT rows are no full fine-tune and never the best."""
    rows = [{"mode": "ours_sr_dpo", "status": "ok", "tokens_per_s": 9000},
            {"mode": "ours_8bit_dpo", "status": "ok", "tokens_per_s": 6000},
            {"mode": "trl_dpo", "status": "ok", "tokens_per_s": 1500},
            {"mode": "trl_dpo_ckpt_liger", "status": "ok", "tokens_per_s": 2000},
            {"mode": "trl_dpo_liger", "status": "oom"},
            {"mode": "trl_dpo_peft", "status": "ok", "tokens_per_s": 5000}]
    result = {}
    gpu_bench.summarize(result, rows)
    assert result["trl_dpo_best"] == "trl_dpo_ckpt_liger"
    assert result["ratio_ours_sr_dpo_to_trl_best"] == 4.5 and result["ratio_ours_8bit_dpo_to_trl_best"] == 3.0
    assert rows[0]["ratio_to_trl_best"] == 4.5 and "trl_rm_best" not in result


@pytest.mark.skipif(not (SHARED_DATA / "hh-rlhf").exists(), reason=f"shared data not present at {SHARED_DATA}")
def test_lora_reward_model_mode_runs_on_cpu(tmp_path):
    """`--modes ours_lora_rm` end to end on the tiny shape: the model made once (then reused from the cache),
    the real train_rm stage under torchrun with train.adapter, its row and JSON. (The DPO modes add the
    LM head over every position, on CPU: not run here.)"""
    from stages.lib.params import load_schema
    if "adapter" not in load_schema()["properties"]["train"]["properties"]:
        pytest.skip("train.adapter (issue 20 part 1) is not in this tree's params schema")
    out = tmp_path / "results" / "bench.json"
    cache = tmp_path / "models"
    argv = ["--shared", str(SHARED_DATA.parent), "--out", str(out), "--shape", "tiny", "--pairs", "16",
            "--probe-pairs", "4", "--max-length", "128", "--modes", "ours_lora_rm", "--model-cache", str(cache),
            "--work", str(tmp_path / "work")]
    gpu_bench.main(argv)
    result = json.loads(out.read_text())
    assert result["model"]["cached"] is False
    (row,) = result["table"]
    assert row["mode"] == "ours_lora_rm" and row["status"] == "ok" and row["tokens"] == result["workload"]["train"]["tokens"]
    assert row["tokens_per_s"] > 0 and row["peak_mem_gib"] > 0
    assert result["overrides"]["ours_lora"]["train.adapter"]["type"] == "lora"
    info = result["ours_lora"]["train_rm"]
    assert info["settings"]["adapter"]["r"] == gpu_bench.LORA["r"]
    assert not (tmp_path / "work" / "ours_lora_train_rm" / "model").exists()    # the export is removed
    # a later invocation reuses the model the first one wrote
    model_dir, facts = gpu_bench.make_model("tiny", SHARED_DATA / "tokenizers" / "gpt2", cache)
    assert facts["cached"] is True and str(model_dir) == result["model"]["dir"]


@pytest.mark.skipif(not (SHARED_DATA / "hh-rlhf").exists(), reason=f"shared data not present at {SHARED_DATA}")
def test_optimizer_state_modes_run_side_by_side_on_cpu_and_merge(tmp_path):
    """`--modes ours_rm,ours_8bit_rm,ours_sr_rm` on the tiny shape: each optimizer state's row (its state, the
    memory plan's peak, the probe accuracy and final loss), the accuracy comparison against exact, the expected
    durations; a second invocation's JSON merges into one side-by-side table."""
    cache, shared = tmp_path / "models", str(SHARED_DATA.parent)
    common = ["--shared", shared, "--shape", "tiny", "--pairs", "16", "--probe-pairs", "4", "--max-length", "128",
              "--model-cache", str(cache), "--work", str(tmp_path / "work")]
    a, b = tmp_path / "a" / "r.json", tmp_path / "b" / "r.json"
    gpu_bench.main([*common, "--out", str(a), "--modes", "ours_rm,ours_8bit_rm"])
    gpu_bench.main([*common, "--out", str(b), "--modes", "ours_sr_rm,ours_fused_rm"])
    result = json.loads(a.read_text())
    assert set(result["expected_seconds"]) == {"ours_rm", "ours_8bit_rm"}
    rows = {r["mode"]: r for r in result["table"]}
    assert rows["ours_rm"]["optimizer_state"] == "exact" and rows["ours_8bit_rm"]["optimizer_state"] == "fp32_master_8bit"
    for r in rows.values():
        assert r["status"] == "ok" and r["planned_peak_gib"] > 0 and 0 <= r["probe_accuracy"] <= 1
    assert result["accuracy_vs_exact"]["ours_8bit_rm"]["exact_probe_accuracy"] == rows["ours_rm"]["probe_accuracy"]
    gpu_bench.main(["--merge", str(a), str(b), "--out", str(tmp_path / "merged.json")])
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert [r["mode"] for r in merged["table"]] == ["ours_rm", "ours_8bit_rm", "ours_sr_rm", "ours_fused_rm"]
    assert set(merged["accuracy_vs_exact"]) == {"ours_8bit_rm", "ours_sr_rm", "ours_fused_rm"}
    assert {r["mode"]: r["fused_backward"] for r in merged["table"]}["ours_fused_rm"] is True


def test_pipeline_bench_summary_splits_a_training_rule_into_start_up_loop_after_loop_and_outside():
    import pipeline_bench
    perf = {"train_dpo": {"train_seconds": 9.0, "wall_seconds": 15.0,
                          "startup": {"phases_seconds": {"imports": 3.0, "process_group": 0.5, "environment": 0.1,
                                                         "tokens": 1.4, "model_load": 0.7}, "total_seconds": 5.7},
                          "after_loop_seconds": {"probe_final": 0.4, "export": 1.6}},
            "ref_logps": {"probe": {"pass_seconds": 2.5, "tokens": 1000}, "train": {"pass_seconds": 2.5, "tokens": 5000,
                                                                                "tokens_per_s": 2000.0},
                          "startup": {"phases_seconds": {"imports": 3.0}, "total_seconds": 3.0}}}
    rules = {"train_dpo": 23.0, "ref_logps": 8.0, "tokenize": 4.0}
    summary = pipeline_bench.summarize(rules, 40.0, perf)
    # the probe split (run first: the process's first-use costs) counts at the train split's 2000 tok/s: 0.5 s
    assert summary["compute_seconds"] == {"train_dpo": 9.0, "ref_logps": 3.0}
    assert summary["ref_first_pass_warmup"] == 2.0
    assert summary["total_over_compute"] == round(40.0 / 12.0, 2)
    # 23 s of rule = 5 s before the loop's clock starts + the loop's 15 s wall + 3 s nobody inside measured
    assert summary["outside_process"] == {"train_dpo": 3.0}
    assert summary["after_loop"] == {"train_dpo": {"probe_final": 0.4, "export": 1.6}}
    text = pipeline_bench.table(summary)
    assert "after the loop train_dpo: probe_final 0.40, export 1.60; outside the process (torchrun, exit): 3.00" in text


def test_generation_bench_runs_the_stage_loop_and_hf_on_a_tiny_shape_on_cpu(tmp_path):
    """bench/generation_bench.py on CPU, tiny shape: both engines, both sides, every completion max_new_tokens
    long (no EOS is reachable), throughput rows written; the LoRA merge really changed the policy's weights."""
    import torch
    import generation_bench
    out = tmp_path / "generation.json"
    rows = generation_bench.main(["--shapes", "tiny", "--prompts", "5", "--prompt-lengths", "3:9",
                                  "--max-new-tokens", "4", "--batch-sizes", "2", "--engines", "ours,hf",
                                  "--device", "cpu", "--out", str(out)])
    assert [(r["engine"], r["side"]) for r in rows] == [("ours", "policy"), ("ours", "reference"),
                                                       ("hf", "policy"), ("hf", "reference")]
    for r in rows:
        assert r["completions"] == 5 and r["generated_tokens"] == 5 * 4
        assert r["completions_per_s"] > 0 and r["tokens_per_s"] > 0
    assert json.loads(out.read_text())["rows"] == rows
    models = generation_bench.build_models("tiny", torch.device("cpu"), torch.float32)
    ref_w = dict(models["reference"].named_parameters())
    changed = [n for n, p in models["policy"].named_parameters() if not torch.equal(p, ref_w[n])]
    assert changed and all(any(t in n for t in generation_bench.LORA["target_modules"]) for n in changed)


def test_memory_fit_table_is_the_plan_with_the_fewest_checkpointed_layers_that_fit():
    """bench/memory_fit.py's cells are the engine's own plan: a 'yes' plan fits its device and one fewer
    checkpointed layer would not; a 'no' means even every layer checkpointed does not fit."""
    from dataclasses import replace

    import memory_fit
    from stages.engine.memory_plan import estimate
    cfg = memory_fit.model_config(*memory_fit.SHAPES["Qwen2.5-7B"])
    rows = memory_fit.fit_rows(cfg, "lm_head", 4096)
    assert [r["mode"] for r in rows] == memory_fit.MODES
    for row in rows:
        settings = memory_fit.settings_for(row["mode"])
        for name, size in memory_fit.DEVICES.items():
            plan = row[name]
            if plan is None:
                everything = estimate(cfg, "lm_head", replace(settings, activation_checkpointing=True),
                                      4096, 1, size, "cuda", True)
                assert everything.total > size, (row["mode"], name)
                continue
            assert plan.total <= size
            if plan.checkpointed_layers:
                fewer = estimate(cfg, "lm_head", replace(
                    settings, activation_checkpointing=plan.checkpointed_layers - 1), 4096, 1, size, "cuda", True)
                assert fewer.total > size, (row["mode"], name)
    # exact AdamW at 7B does not fit 80 GB in any checkpointing; bf16_sr_8bit does without any
    assert rows[0]["80 GB (79.1 GiB)"] is None and rows[4]["80 GB (79.1 GiB)"].checkpointed_layers == 0
    assert "| `{state: bf16_sr_8bit}` |" in memory_fit.table("t", rows)


def test_gpu_check_refuses_without_a_gpu_and_copies_a_clean_checkout(tmp_path, capsys):
    """bench/gpu_check.py (the GPU gate) refuses on a machine without CUDA, writing no record; its pipeline part runs
    in a fresh git repository holding this checkout's files without any run output (results/, logs/, .snakemake/)."""
    import subprocess
    import torch
    import gpu_check
    if not torch.cuda.is_available():
        assert gpu_check.main(["--out", str(tmp_path / "rec"), "--parts", "suite"]) == 2
        assert "no CUDA device" in capsys.readouterr().err and not (tmp_path / "rec" / "record.txt").exists()
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path / "rec"), "--parts", "suite,typo"])
    dest = tmp_path / "copy"
    gpu_check.copy_checkout(dest)
    assert (dest / "Snakefile").exists() and (dest / "params.yaml").read_bytes() == (REPO_ROOT / "params.yaml").read_bytes()
    assert not any((dest / d).exists() for d in ("results", "logs", ".snakemake", ".venv"))
    status = subprocess.run(["git", "status", "--porcelain"], cwd=dest, capture_output=True, text=True, check=True)
    assert status.stdout == ""
    rendered = gpu_check.render({"commit": "abc", "date": "d", "command": "c", "ok": False,
                                 "machine": {"card": "NVIDIA H100 80GB HBM3", "card_memory_gib": 79.1},
                                 "parts": {"suite": {"ok": False, "seconds": 1, "failures": ["t::x"]}}})
    assert "NVIDIA H100 80GB HBM3" in rendered and "## suite: FAILED" in rendered and "t::x" in rendered


def test_optim_bench_bytes_model_counts_the_flat_buffers_and_its_dry_run_reports_bandwidth(tmp_path):
    """flat_adamw.step_bytes_per_param (what optim_bench divides by for GB/s) against the buffers a built flat step
    really holds: the norm pass reads the gradient, the update reads and writes each buffer once (the SR tables only
    read); and `optim_bench.py --dry-run` (CPU, Triton's interpreter, a shrunk shape) gives each row its bytes, GB/s
    and bound from that model, and skips a library that does not import with the reason."""
    import importlib.util
    import subprocess

    import torch
    from stages.engine.flat_adamw import FlatLowBitAdamW, FlatMasterAdamW, step_bytes_per_param
    from stages.engine.lowbit_adamw import LowBitAdamW
    from stages.engine.optim import MasterWeightAdamW

    for state, dtype, masters in (("exact", torch.bfloat16, True), ("fp32_master_8bit", torch.bfloat16, True),
                                  ("fp32_master_8bit", torch.float32, False), ("bf16_sr_8bit", torch.bfloat16, False)):
        params = [torch.nn.Parameter(torch.zeros(256, 128 + 3 * i, dtype=dtype)) for i in range(3)]
        for p in params:
            p.grad = torch.zeros_like(p)
        n = sum(p.numel() for p in params)
        groups = [{"params": params}]
        held = {id(p): p.detach().float() for p in params} if masters else None
        if state == "exact":
            flat = FlatMasterAdamW(MasterWeightAdamW(groups, held, lr=1e-3, betas=(0.9, 0.999)), 1.0)
            flat._build()
            state_bufs = [flat.master, flat.exp_avg, flat.exp_avg_sq]
        else:
            flat = FlatLowBitAdamW(LowBitAdamW(groups, state, seed=0, masters=held, lr=1e-3, betas=(0.9, 0.999)), 1.0)
            flat._build()
            state_bufs = [flat.m_codes, flat.s_codes, flat.m_scale, flat.s_scale] + ([flat.master] if masters else [])
        # times each buffer crosses memory in a step: the gradient read by the norm pass, read and zeroed by the
        # update; the state read and written; the model weight written (read too where it is the weight updated);
        # the stochastic-rounding tables read
        times = [(flat.grad, 3), (flat.param, 1 if masters else 2)] + [(b, 2) for b in state_bufs]
        times += [(flat.ordinal, 1), (flat.base, 1)] if getattr(flat, "sr", False) else []
        moved = sum(k * b.numel() * b.element_size() for b, k in times) / n
        # 256 x (128 + 3i) values: whole 128-value blocks, so the buffers hold no padding and the counts are exact
        assert step_bytes_per_param(state, weight_bytes=dtype.itemsize, masters=masters) == pytest.approx(
            moved, rel=1e-12), state
    assert step_bytes_per_param("fp32_master_8bit") < step_bytes_per_param("exact")

    out = tmp_path / "dry.json"
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    rows = "ours_fp32_master_8bit,ours_bf16_sr_8bit,torch_fused_fp32,bnb_adamw8bit"
    run = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "optim_bench.py"), "--out", str(out), "--dry-run",
                          "--params", "2e4", "--rows", rows, "--peak-gbps", "4800"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    got = {r["row"]: r for r in result["rows"]}
    assert result["peak_gbps"] == 4800 and list(got) == rows.split(",")
    for name, want in (("ours_fp32_master_8bit", 20.125), ("ours_bf16_sr_8bit", 14.1875), ("torch_fused_fp32", 28)):
        r = got[name]
        assert r["bytes_per_param"] == want and r["ms_median"] > 0, r
        gbps = want * r["parameters"] / (r["ms_median"] * 1e-3) / 1e9
        assert r["achieved_gbps"] == pytest.approx(gbps, rel=1e-3, abs=0.1)
        assert r["bound_ms"] == pytest.approx(want * r["parameters"] / 4800e9 * 1e3, rel=1e-2, abs=1e-3)
    if importlib.util.find_spec("bitsandbytes") is None:
        assert got["bnb_adamw8bit"]["skipped"].startswith("not importable: ModuleNotFoundError")
    assert "| ours_bf16_sr_8bit |" in run.stdout


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED_DATA / "hh-rlhf").exists() or not (SHARED_DATA / "tokenizers" / "gpt2").exists(),
                    reason=f"shared data not present at {SHARED_DATA}")
def test_rounds_bench_runs_a_round_of_the_real_stages_on_cpu(tmp_path):
    """bench/rounds_bench.py `--modes ours` on the tiny shape with 4 HH prompts: the policy is made to sample EOS at
    a set rate (a random-init model never ends a completion otherwise), round_pairs samples and labels every prompt (each
    becomes a pair or a rejection with its reason), ref_logps scores the new pairs and train_dpo trains them from
    --init-model; the result has every part's seconds and throughput and the record of the run."""
    import rounds_bench
    out = tmp_path / "out"
    result = rounds_bench.main(["--shared", str(SHARED_DATA.parent), "--out", str(out), "--shape", "tiny",
                                "--prompts", "4", "--probe-pairs", "4", "--n", "3", "--max-new-tokens", "8",
                                "--eos-every", "3", "--modes", "ours", "--work", str(tmp_path / "work")])
    assert json.loads((out / "result.json").read_text()) == json.loads(json.dumps(result))
    for key in ("command", "git_commit", "date", "machine", "transformers", "settings", "note", "differences_from_trl"):
        assert result[key], key
    assert result["machine"]["torch"] and result["settings"]["n"] == 3
    assert result["workload"]["round_prompts"] == 4
    assert result["workload"]["excluded_from_train"] == {"probe_prompt_leak": 0}
    eos = result["models"]["policy"]["eos"]
    assert eos["eos_row_norm_before"] == 0.0 and eos["eos_row_norm"] > 0
    assert eos["calibrated_stop_rate"] == pytest.approx(1 / 3, rel=1e-3)
    # the same rate at the first token as later (the v_proj bias makes the final hidden state nearly constant)
    assert eos["first_token_stop_rate"] == pytest.approx(1 / 3, rel=0.1) and eos["v_bias"]["scale"] > 0
    summary = result["ours_summary"]
    sl = summary["sample_and_label"]
    assert sl["samples"] == 4 * 3 and sl["generated_tokens"] > 0 and sl["generated_tokens_per_s"] > 0
    assert sl["pairs"] + sum(sl["rejected"].values()) == 4 and set(sl["rejected"]) == {"too_long", "tie", "margin"}
    assert sum(sl["stop_reasons"].values()) == 12 and sl["sampling_s"] > 0 and sl["labeling_s"] > 0
    assert sl["pairs"] > 0, sl                     # with EOS about every 3rd token, most samples end well inside 8
    assert summary["ref_logps"]["tokens"] > 0 and summary["ref_logps"]["pass_s"] > 0
    tr = summary["train_dpo"]
    assert tr["optimizer_steps"] > 0 and tr["tokens_per_s"] > 0 and tr["train_s"] > 0
    assert summary["round_wall_s"] == pytest.approx(sum(summary[k]["wall_s"] for k in ("sample_and_label", "ref_logps",
                                                                                       "train_dpo")), abs=0.05)
    assert tr["train_pairs"] == sl["pairs"] and f"--init-model {result['models']['policy']['dir']}" in (
        result["ours"]["train_dpo"]["launch"])
    assert result["ours"]["round_pairs"]["launch"].startswith("-m stages.round_pairs --params")
    assert result["params"]["rounds"]["judge"] == "trained" and result["params"]["dpo"]["loss"] == "sigmoid"
    for name in ("ours_round_pairs.perf.json", "ours_round_ref_logps.perf.json", "ours_round_train_dpo.perf.json",
                 "ours_pairs_report.json", "ours_round_train_dpo_train_log.csv"):
        assert (out / name).exists(), name
    rows = {r["part"]: r for r in result["side_by_side"]}
    assert rows["sampling"]["ours_samples"] == 12 and rows["sampling"]["trl_s"] is None
    assert "trl" not in result


@pytest.mark.skipif(not (SHARED_DATA / "tokenizers" / "gpt2").exists(), reason=f"shared data not present at {SHARED_DATA}")
def test_rounds_bench_drops_train_pairs_that_ask_a_probe_prompt(tmp_path):
    """The round's prompts leave out every probe prompt as freeze_probe does: a train pair whose normalized prompt
    (whitespace collapsed) is a probe pair's leaves the train tokens; the other train prompts stay, each once."""
    import rounds_bench
    rows = [{"chosen": f"\n\nHuman: question {i}?\n\nAssistant: yes {i}", "rejected": f"\n\nHuman: question {i}?"
             f"\n\nAssistant: no {i}"} for i in range(4)]
    rows.append({"chosen": "\n\nHuman: question   1?\n\nAssistant: sure", "rejected": "\n\nHuman: question   1?"
                 "\n\nAssistant: never"})                      # the probe asks train row 1's question again
    hh = tmp_path / "hh.jsonl.gz"
    with gzip.open(hh, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    work = tmp_path / "work"
    work.mkdir()
    gpu_bench.prepare_tokens(hh, SHARED_DATA / "tokenizers" / "gpt2", 4, 1, 128, work)
    assert rounds_bench.drop_probe_prompt_leaks(work) == {"probe_prompt_leak": 1}
    prompts = rounds_bench.round_prompts(work, gpu_bench.SHAPES["tiny"]["vocab_size"])
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(SHARED_DATA / "tokenizers" / "gpt2")
    texts = sorted(tok.decode(p) for p in prompts)
    assert len(texts) == 3 and not any("question 1?" in t for t in texts)
    assert all(f"question {i}?" in t for i, t in zip((0, 2, 3), texts))


def test_kernel_sass_walks_the_fast_path_and_counts_the_real_kernel(tmp_path):
    """bench/kernel_sass.py: the walk takes a conditional branch over a slow-path CALL or a long region (a tier's
    rerun), falls through a short one, follows unconditional branches, stops at EXIT; on the real kernel, compiled
    for sm_90 by the installed Triton, each state's fast path is a part of its static code."""
    import kernel_sass
    sass = "\n".join([
        "        /*0000*/                   FADD R1, R1, R2 ;",
        "        /*0010*/               @P0 BRA `(.L_x_1) ;",                  # over a CALL: taken
        "        /*0020*/                   CALL.REL.NOINC `($slow) ;",
        ".L_x_1:",
        "        /*0030*/              @!P1 BRA `(.L_x_2) ;",                  # over one instruction: not taken
        "        /*0040*/                   FMUL R1, R1, R1 ;",
        ".L_x_2:",
        "        /*0050*/                   BRA `(.L_x_3) ;",                   # unconditional: followed
        "        /*0060*/                   FFMA R1, R1, R1, R1 ;",
        ".L_x_3:",
        "        /*0070*/               @P2 EXIT ;",
        "        /*0080*/                   EXIT ;",
    ])
    ins, labels = kernel_sass.parse(sass)
    assert len(ins) == 9 and labels == {".L_x_1": 3, ".L_x_2": 5, ".L_x_3": 7}
    assert [kernel_sass.opcode(t) for t in kernel_sass.fast_path(ins, labels)] == \
        ["FADD", "BRA", "BRA", "FMUL", "BRA", "EXIT", "EXIT"]
    triton = pytest.importorskip("triton")
    from pathlib import Path
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm").exists():
        pytest.skip("this Triton bundles no nvdisasm")
    assert kernel_sass.main(["--out", str(tmp_path / "k.json")]) == 0
    record = json.loads((tmp_path / "k.json").read_text())
    assert set(record["rows"]) == {"fp32_master_8bit", "bf16_sr_8bit"} and record["values_per_thread"] == 8
    for row in record["rows"].values():
        assert 0 < row["fast_path"] < row["static"] and row["per_value"] == round(row["fast_path"] / 8, 1)
