"""LoRA adapters (train.adapter, stages/engine/adapters.py) on a tiny real Qwen2 model and on the default pipeline:
parity of our steps with plain peft + torch, step 0 == reference, the merged and the adapter export reloaded by
transformers / peft, resume, DP=2 under torchrun, refusals, and that LoRA DPO and RM learn on the default data."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
import yaml

from engine_helpers import pair_seqs, probe_token_rows, reference_seq_logps
from stages.engine.settings import TrainConfigError, TrainSettings
from stages.lib.io import read_jsonl
from conftest import REPO_ROOT as REPO
from stage_helpers import checkpoint_at, ckpt_args, stage_args, torchrun, write_train_params as write_params

torch.set_num_threads(1)
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora(**kw) -> dict:
    return {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ALL_LINEAR, "export": "both", **kw}


def rows_of_step(assets: Path, params: Path, step: int) -> list[dict]:
    """The train rows of optimizer step `step` (0-based) of the engine's deterministic plan, one process."""
    from stages.engine.packing import load_token_pairs, plan_training
    settings = TrainSettings.from_params(yaml.safe_load(params.read_text()))
    pairs = load_token_pairs(assets / "train.parquet")
    plan = plan_training(pairs.pair_tokens, epochs=settings.epochs, world_size=1,
                         global_batch_pairs=settings.global_batch_pairs,
                         micro_batch_tokens=settings.micro_batch_tokens, seed=settings.seed)[step]
    rows = pd.read_parquet(assets / "train.parquet").to_dict("records")
    return [{k: (list(v) if hasattr(v, "tolist") else v) for k, v in rows[i].items()}
            for mb in plan.rank_micro_batches[0] for i in mb]


def plain_peft_model(base, adapter: dict, seed: int, head: str):
    """What a peft user writes: seed, then get_peft_model with the same LoRA config (the engine seeds with
    train.seed before loading, so lora_A draws the same numbers)."""
    from peft import LoraConfig, get_peft_model
    if seed is not None:
        torch.manual_seed(seed)
    config = LoraConfig(r=adapter["r"], lora_alpha=adapter["alpha"], lora_dropout=adapter["dropout"],
                        target_modules=adapter["target_modules"], bias="none",
                        modules_to_save=["score"] if head == "score" else None)
    return get_peft_model(base, config)


def plain_adamw_steps(model, losses_of_step, n_steps: int, lr: float, weight_decay: float, max_grad_norm: float):
    """n AdamW steps over the trainable parameters (decay on matrices only, as HF Trainer), clipped; returns the
    (loss, grad norm) of each step."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": weight_decay},
                             {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.999))
    out = []
    for step in range(n_steps):
        loss = losses_of_step(step)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm)
        opt.step()
        opt.zero_grad()
        out.append((float(loss), float(norm)))
    return out


def assert_adapter_equals(export_dir: Path, peft_model, atol: float = 2e-5) -> None:
    """atol: 0.2% of one AdamW step at lr 1e-2. Adam divides each element's moment by its own gradient scale, so
    where a gradient is near zero (or two steps' gradients nearly cancel) the fp32 rounding of the gradients
    (different summation order: packed micro-batches vs one padded batch) shows up magnified in that element."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file
    got = load_file(export_dir / "adapter_model.safetensors")
    want = get_peft_model_state_dict(peft_model)
    assert set(got) == set(want) and len(got) > 0
    for k in want:
        torch.testing.assert_close(got[k], want[k].detach().float(), rtol=1e-4, atol=atol, msg=lambda m: f"{k}: {m}")


PARITY_TRAIN = {"epochs": 1, "global_batch_pairs": 32, "schedule": "constant", "warmup_ratio": 0.0, "lr": 1e-2,
                "weight_decay": 0.01, "adapter": lora()}        # 64 pairs: 2 optimizer steps


def test_lora_dpo_steps_equal_plain_peft_and_step0_is_the_reference(assets):
    """Two steps (the first moves only lora_B, B being 0 at init; the second lora_A too), with the reference's
    log-probs precomputed by ref_logps from the base: our engine vs peft + eager padded forward + torch AdamW."""
    from transformers import AutoModelForCausalLM
    from stages import ref_logps, train_dpo
    params = write_params(assets / "p.yaml", train=PARITY_TRAIN, dpo={"beta": 0.5})
    ref_logps.main(stage_args(assets, "--out", assets / "ref.parquet", params))
    out = assets / "dpo"
    info = train_dpo.main(stage_args(assets, "--out-dir", out, params) + ["--ref-logps", str(assets / "ref.parquet")])
    assert info["adapter"]["trainable_parameters"] < info["model_parameters"] / 4

    # Step 0: B = 0, so the policy is the reference exactly (the rewards are 0, not merely small).
    step0 = read_jsonl(out / "probe_step0.jsonl")
    assert all(r["chosen_reward"] == 0.0 and r["rejected_reward"] == 0.0 for r in step0)

    base = AutoModelForCausalLM.from_pretrained(assets / "model", attn_implementation="eager", dtype=torch.float32)
    model = plain_peft_model(base, PARITY_TRAIN["adapter"], seed=5, head="lm_head")

    def loss_of_step(step):
        seqs, pls = pair_seqs(rows_of_step(assets, params, step))
        with torch.no_grad(), model.disable_adapter():
            ref = reference_seq_logps(model, seqs, pls).view(-1, 2)
        pol = reference_seq_logps(model, seqs, pls).view(-1, 2)
        return -F.logsigmoid(0.5 * ((pol[:, 0] - ref[:, 0]) - (pol[:, 1] - ref[:, 1]))).mean()

    want = plain_adamw_steps(model, loss_of_step, 2, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)
    log = pd.read_csv(out / "train_log.csv")
    assert len(log) == 2
    np.testing.assert_allclose(log.loss, [w[0] for w in want], rtol=1e-5)
    np.testing.assert_allclose(log.grad_norm, [w[1] for w in want], rtol=1e-4)
    assert_adapter_equals(out / "model" / "adapter", model)


def test_lora_rm_step_equals_plain_peft_with_the_score_head_trained_in_full(assets):
    from safetensors.torch import load_file
    from stages import train_rm
    from stages.engine.modeling import load_reward_model
    params = write_params(assets / "p.yaml", train=PARITY_TRAIN)
    out = assets / "rm"
    train_rm.main(stage_args(assets, "--out-dir", out, params))

    torch.manual_seed(5)                      # the trainer seeds with train.seed before creating the head
    base = load_reward_model(assets / "model")
    base.set_attn_implementation("eager")      # a plain padded forward, not our packed attention
    model = plain_peft_model(base, PARITY_TRAIN["adapter"], seed=None, head="score")   # the RNG continues
    hf = model.base_model.model

    def loss_of_step(step):
        seqs, _ = pair_seqs(rows_of_step(assets, params, step))
        from engine_helpers import padded
        ids, mask = padded(seqs)
        hidden = hf.model(input_ids=ids, attention_mask=mask).last_hidden_state
        last = torch.tensor([len(s) - 1 for s in seqs])
        scores = hf.score(hidden[torch.arange(len(seqs)), last]).squeeze(-1).view(-1, 2)
        return -F.logsigmoid(scores[:, 0] - scores[:, 1]).mean()

    want = plain_adamw_steps(model, loss_of_step, 2, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)
    log = pd.read_csv(out / "train_log.csv")
    np.testing.assert_allclose(log.loss, [w[0] for w in want], rtol=1e-5)
    np.testing.assert_allclose(log.grad_norm, [w[1] for w in want], rtol=1e-4)
    assert_adapter_equals(out / "model" / "adapter", model)     # its keys include the trained score head
    assert "base_model.model.score.weight" in load_file(out / "model/adapter/adapter_model.safetensors")


def test_merged_and_adapter_exports_reload_and_reproduce_probe_scores(assets):
    """export: both -> model/ (merged; transformers) and model/adapter/ (peft) each reproduce probe_final."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from stages import train_dpo, train_rm
    params = write_params(assets / "p.yaml", train={"epochs": 1, "adapter": lora(r=8, alpha=16)},
                          dpo={"objective": "dpo_ref_free"})
    train_dpo.main(stage_args(assets, "--out-dir", assets / "dpo", params))
    train_rm.main(stage_args(assets, "--out-dir", assets / "rm", params))
    probe = probe_token_rows(assets)
    seqs, pls = pair_seqs(probe)

    final = read_jsonl(assets / "dpo/probe_final.jsonl")
    want = np.array([[r["policy_chosen_logp"], r["policy_rejected_logp"]] for r in final])
    step0 = np.array([[r["policy_chosen_logp"], r["policy_rejected_logp"]] for r in
                      read_jsonl(assets / "dpo/probe_step0.jsonl")])
    assert np.abs(want - step0).max() > 1e-2                 # it trained: a reload of the base would fail below
    kw = dict(attn_implementation="eager", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(assets / "dpo/model", **kw)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(assets / "model", **kw),
                                        assets / "dpo/model/adapter")
    with torch.no_grad():
        for m in (merged, adapted):
            np.testing.assert_allclose(reference_seq_logps(m, seqs, pls).view(-1, 2).numpy(), want, rtol=0, atol=1e-4)

    final = read_jsonl(assets / "rm/probe_final.jsonl")
    merged = AutoModelForSequenceClassification.from_pretrained(assets / "rm/model", **kw)
    assert merged.config.pad_token_id is not None
    base = AutoModelForSequenceClassification.from_pretrained(assets / "model", num_labels=1, **kw)
    base.config.pad_token_id = merged.config.pad_token_id   # the pad id the export carries (docs/ARTIFACTS.md)
    adapted = PeftModel.from_pretrained(base, assets / "rm/model/adapter")
    with torch.no_grad():
        for m in (merged, adapted):
            for k in (0, 17, 36):
                for branch in ("chosen", "rejected"):
                    ids = torch.tensor([probe[k][f"{branch}_ids"]])
                    assert float(m(input_ids=ids).logits[0, 0]) == pytest.approx(final[k][f"{branch}_score"],
                                                                                 abs=1e-5)
    cfg = json.loads((assets / "rm/model/adapter/adapter_config.json").read_text())
    assert cfg["modules_to_save"] == ["score"] and cfg["target_modules"] == sorted(ALL_LINEAR)
    assert cfg["base_model_name_or_path"] is None                       # no machine path in a hashed artifact


def test_adapter_only_export_is_a_peft_directory_with_the_tokenizer_files(assets):
    from stages import train_dpo
    params = write_params(assets / "p.yaml", train={"epochs": 0.5, "adapter": lora(export="adapter")},
                          dpo={"objective": "dpo_ref_free"})
    train_dpo.main(stage_args(assets, "--out-dir", assets / "dpo", params))
    files = {p.name for p in (assets / "dpo/model").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert "model.safetensors" not in files and "adapter" not in files


def test_lora_resume_equals_uninterrupted_and_checkpoints_hold_only_the_trained_state(assets):
    from stages import train_rm
    params = write_params(assets / "p.yaml", train={"save_every": 2, "keep_checkpoints": 4,
                                                    "adapter": lora(dropout=0.1)})
    train_rm.main(ckpt_args(assets, "full", params, assets / "ck"))
    step2 = checkpoint_at(assets / "ck", 2)
    saved = torch.load(step2 / "model.pt", weights_only=True)
    assert saved and all("lora_" in k or "modules_to_save" in k for k in saved)   # the frozen base is not copied
    info = train_rm.main(ckpt_args(assets, "resumed", params, assets / "ck2", resume=step2))
    assert info["perf"]["resumed_from_step"] == 2
    a, b = assets / "full", assets / "resumed"
    pd.testing.assert_frame_equal(pd.read_csv(a / "train_log.csv"), pd.read_csv(b / "train_log.csv"), check_exact=True)
    for f in ("model/model.safetensors", "model/adapter/adapter_model.safetensors", "model/adapter/adapter_config.json",
              "probe_final.jsonl"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    # Another adapter config is another run: auto resume does not pick these checkpoints up.
    other = write_params(assets / "p2.yaml", train={"save_every": 2, "keep_checkpoints": 4, "adapter": lora(r=2)})
    info = train_rm.main(ckpt_args(assets, "other", other, assets / "ck"))
    assert info["perf"]["resumed_from_step"] is None


def test_lora_rm_under_torchrun_ddp_and_fsdp2_dp2_equal_dp1(assets):
    """DDP over the adapters and the head only (the frozen base has no gradient to reduce); FSDP2 shards the
    frozen base with them and gathers the adapter state for the export."""
    from safetensors.torch import load_file
    from stages import train_rm
    params = write_params(assets / "p.yaml", train={"epochs": 1, "adapter": lora(export="adapter")})
    fsdp2 = write_params(assets / "f.yaml", train={"epochs": 1, "parallel": "fsdp2", "adapter": lora(export="adapter")})
    train_rm.main(stage_args(assets, "--out-dir", assets / "dp1", params))       # one process, in this one
    torchrun(2, "stages.train_rm", stage_args(assets, "--out-dir", assets / "ddp", params))
    torchrun(2, "stages.train_rm", stage_args(assets, "--out-dir", assets / "fsdp2", fsdp2))
    one = load_file(assets / "dp1/model/adapter_model.safetensors")
    l1 = pd.read_csv(assets / "dp1/train_log.csv")
    for name in ("ddp", "fsdp2"):
        two = load_file(assets / f"{name}/model/adapter_model.safetensors")
        assert set(one) == set(two)
        for k in one:
            torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=2e-5, msg=lambda m: f"{name} {k}: {m}")
        np.testing.assert_allclose(pd.read_csv(assets / f"{name}/train_log.csv").loss, l1.loss, rtol=1e-5)
        info = json.loads((assets / f"{name}/run_info.json").read_text())
        assert info["world_size"] == 2 and info["parallel"] == name


def test_lora_in_bf16_precision_trains_and_merges_into_the_fp32_base(assets):
    """train.precision bf16: the frozen base runs in bf16, the adapters have fp32 masters; the merged export is
    made from the fp32 base weights (not their bf16 copies), so untouched tensors are the base's exactly."""
    from safetensors.torch import load_file
    from stages import train_dpo
    params = write_params(assets / "p.yaml", train={"precision": "bf16", "lr": 1e-2,
                                                    "adapter": lora(target_modules=["q_proj", "v_proj", "up_proj"])},
                          dpo={"objective": "dpo_ref_free"})
    train_dpo.main(stage_args(assets, "--out-dir", assets / "dpo", params))
    base, merged = load_file(assets / "model/model.safetensors"), load_file(assets / "dpo/model/model.safetensors")
    assert set(merged) == set(base) and all(v.dtype == torch.float32 for v in merged.values())
    for k, v in base.items():
        if any(f"{t}.weight" in k for t in ("q_proj", "v_proj", "up_proj")):
            assert not torch.equal(merged[k], v), k                           # B A merged in
        else:
            assert torch.equal(merged[k], v), k                               # not rounded through bf16
    s0, fin = (np.array([r["policy_chosen_logp"] for r in read_jsonl(assets / f"dpo/probe_{x}.jsonl")])
               for x in ("step0", "final"))
    assert np.abs(fin - s0).max() > 1e-3                                      # the adapters (fp32 masters) moved


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_fused_kernel_routing_keeps_the_adapters(tmp_path):
    """The CUDA routing (q|k|v and gate|up as one GEMM, rotary and silu-mul kernels; run by Triton's interpreter
    on CPU, tests/engine/test_kernels.py) with LoRA on every linear layer equals the plain CPU run: the q|k|v GEMM runs
    on the base layers under lora.Linear, and gate|up is not grouped (a lora.Linear's .weight is its base
    weight: one GEMM over it would drop the adapter)."""
    from engine_helpers import make_tiny_model_dir, random_rows, write_token_parquet
    from stages.engine.data import model_inputs
    from stages.engine.modeling import SequenceLogProbs
    from stages.engine.packing import build_packed_batch, load_token_pairs
    from engine_helpers import interpret
    from triton_interpret_checks import lora_model
    model_dir = make_tiny_model_dir(tmp_path / "m")
    parquet = write_token_parquet(tmp_path / "t.parquet", random_rows(2, seed=4))     # interpreted kernels: slow
    interpret("model_lora", str(model_dir), str(parquet), str(tmp_path / "fused.pt"))
    fused = torch.load(tmp_path / "fused.pt")
    assert fused["calls"] == {"rotary_qk": 2, "silu_mul_halves": 0, "grouped_linear": 2}   # q|k|v only

    torch.manual_seed(0)
    model = SequenceLogProbs(lora_model(str(model_dir)), chunk_tokens=16)
    pairs = load_token_pairs(parquet)
    logps = model(**model_inputs(build_packed_batch(pairs, list(range(len(pairs))), share_prompt=True)))
    logps.sum().backward()
    torch.testing.assert_close(fused["logps"], logps.detach(), rtol=1e-6, atol=1e-5)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == fused["grads"].keys() and all("lora_" in n for n in grads)
    for n, g in grads.items():
        torch.testing.assert_close(fused["grads"][n], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_lora_defaults_and_all_linear_train_as_the_block_spelled_out(assets):
    """What a peft user writes, `adapter: {type: lora, target_modules: all-linear}` with every other key omitted,
    trains exactly as the block spelled out with the documented defaults (r 16, alpha 32, dropout 0, export
    merged) on the seven projections: the modules peft's own all-linear picks on the causal LM. On the reward model
    all-linear leaves the `score` head out (it trains in full). Before: the schema refused the block."""
    from transformers import AutoModelForCausalLM
    from stages import train_dpo
    from stages.engine.adapters import target_module_names
    from stages.engine.modeling import load_reward_model
    short = {"type": "lora", "target_modules": "all-linear"}
    spelled = {"type": "lora", "r": 16, "alpha": 32, "dropout": 0.0, "target_modules": ALL_LINEAR, "export": "merged"}
    infos = {}
    for name, adapter in (("short", short), ("spelled", spelled)):
        params = write_params(assets / f"{name}.yaml", train={**PARITY_TRAIN, "adapter": adapter},
                              dpo={"objective": "dpo_ref_free"})
        infos[name] = train_dpo.main(stage_args(assets, "--out-dir", assets / name, params))
    assert infos["short"]["adapter"] == {**spelled, "target_modules": "all-linear",
                                         "resolved_target_modules": sorted(ALL_LINEAR),
                                         "trainable_parameters": infos["spelled"]["adapter"]["trainable_parameters"]}
    assert (assets / "short/train_log.csv").read_bytes() == (assets / "spelled/train_log.csv").read_bytes()
    assert (assets / "short/model/model.safetensors").read_bytes() == \
        (assets / "spelled/model/model.safetensors").read_bytes()

    base = AutoModelForCausalLM.from_pretrained(assets / "model", dtype=torch.float32)
    peft_own = plain_peft_model(base, {**spelled, "target_modules": "all-linear"}, seed=5, head="lm_head")
    assert {n.rsplit(".", 1)[-1] for n, m in peft_own.named_modules() if hasattr(m, "lora_A")} == set(ALL_LINEAR)
    assert target_module_names(short, load_reward_model(assets / "model"), "score") == sorted(ALL_LINEAR)


@pytest.mark.parametrize("adapter, parallel, match", [
    (lora(target_modules=["lm_head"]), "ddp", "matches the LM head"),
    (lora(target_modules=["q_proj", "nope_proj"]), "ddp", "'nope_proj' names no module"),
    (lora(target_modules=["embed_tokens"]), "ddp", "not nn.Linear"),
])
def test_adapter_refusals_name_the_knob(assets, adapter, parallel, match):
    from stages import train_dpo
    params = write_params(assets / "p.yaml", train={"adapter": adapter, "parallel": parallel},
                          dpo={"objective": "dpo_ref_free"})
    with pytest.raises(SystemExit, match=f"train_dpo: refused: .*{match}") as e:
        train_dpo.main(stage_args(assets, "--out-dir", assets / "out", params))
    assert e.value.code == 1 and isinstance(e.value.__cause__, TrainConfigError)


def test_adapter_settings_schema_and_cuda_graph_fallback():
    from engine_helpers import train_settings
    from stages.engine.dist import DistEnv
    from stages.engine.steps import cuda_graphs_unavailable
    with pytest.raises(TrainConfigError, match="train.adapter"):
        train_settings(adapter=lora(export="zip"))
    # Omitted keys take the schema's documented defaults (before: "is not valid under any of the given schemas").
    assert train_settings(adapter={"type": "lora", "r": 4}).adapter == {
        "type": "lora", "r": 4, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear", "export": "merged"}
    assert train_settings().record()["adapter"] is None       # a full fine-tune's record says so: null
    gpu = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"), backend="nccl")
    assert cuda_graphs_unavailable(train_settings(adapter=lora()), gpu) is None
    assert "dropout" in cuda_graphs_unavailable(train_settings(adapter=lora(dropout=0.05)), gpu)


# ----------------------------------------------------------------------------------------------
# "Done when": LoRA DPO and LoRA RM of the default pipeline, switched on by params, beat step 0 on the probe
# ----------------------------------------------------------------------------------------------

def default_pipeline_inputs(root: Path) -> dict[str, Path]:
    """The default pipeline's tokens, reference identity and reference log-probs, made by the stage CLIs from
    params.yaml (the embedded data and the tiny reference), in `root`."""
    from stages import freeze_probe, normalize, ref_logps, tokenize, verify_ref
    r = {name: root / name for name in ("pairs.parquet", "ref_identity.json", "train.parquet", "probe.parquet",
                                        "manifest.json", "train_tokens.parquet", "probe_tokens.parquet")}
    p = ["--params", str(REPO / "params.yaml")]
    normalize.main(p + ["--pairs", str(r["pairs.parquet"]), "--rejections", str(root / "rej.parquet"),
                        "--stats", str(root / "stats.json"), "--log", str(root / "normalize.log")])
    verify_ref.main(["verify"] + p + ["--identity", str(r["ref_identity.json"]), "--log", str(root / "v.log")])
    freeze_probe.main(p + ["--pairs", str(r["pairs.parquet"]), "--identity", str(r["ref_identity.json"]),
                           "--train", str(r["train.parquet"]),
                           "--probe", str(r["probe.parquet"]), "--manifest", str(r["manifest.json"]),
                           "--log", str(root / "f.log")])
    tokenize.main(p + ["--identity", str(r["ref_identity.json"]), "--train", str(r["train.parquet"]),
                       "--probe", str(r["probe.parquet"]), "--probe-manifest", str(r["manifest.json"]),
                       "--train-tokens", str(r["train_tokens.parquet"]),
                       "--probe-tokens", str(r["probe_tokens.parquet"]),
                       "--probe-token-manifest", str(root / "ptm.json"), "--report", str(root / "tr.json"),
                       "--rejections", str(root / "tokrej.parquet"), "--log", str(root / "t.log")])
    r["ref_logps.parquet"] = root / "ref_logps.parquet"
    ref_logps.main(p + ["--identity", str(r["ref_identity.json"]), "--train-tokens", str(r["train_tokens.parquet"]),
                        "--probe-tokens", str(r["probe_tokens.parquet"]), "--out", str(r["ref_logps.parquet"]),
                        "--log", str(root / "r.log")])
    return r


def test_lora_dpo_and_rm_on_the_default_pipeline_beat_step0(tmp_path, monkeypatch):
    """params.yaml with only train.adapter (the r / alpha of its comment), train.lr (LoRA's) and train.epochs (a
    quarter epoch, to stay cheap) changed; the probe is the default 512-pair probe."""
    from stages import train_dpo, train_rm
    monkeypatch.chdir(REPO)                  # params.yaml's data and reference paths are relative to the repo
    r = default_pipeline_inputs(tmp_path)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["dpo"].pop("loss_weights", None)
    params["dpo"]["loss"] = "sigmoid"        # the loss the r / alpha / lr of params.yaml's LoRA comment were measured with
    params["train"].update({"lr": 2e-3, "epochs": 0.25, "adapter": {
        "type": "lora", "r": 16, "alpha": 32, "dropout": 0.0, "target_modules": ALL_LINEAR, "export": "merged"}})
    (tmp_path / "lora.yaml").write_text(yaml.safe_dump(params))
    common = ["--params", str(tmp_path / "lora.yaml"), "--identity", str(r["ref_identity.json"]),
              "--train-tokens", str(r["train_tokens.parquet"]), "--probe-tokens", str(r["probe_tokens.parquet"])]
    train_dpo.main(common + ["--ref-logps", str(r["ref_logps.parquet"]), "--out-dir", str(tmp_path / "dpo"),
                             "--log", str(tmp_path / "dpo.log")])
    train_rm.main(common + ["--out-dir", str(tmp_path / "rm"), "--log", str(tmp_path / "rm.log")])
    for kind in ("dpo", "rm"):
        s0, fin = (read_jsonl(tmp_path / kind / f"probe_{x}.jsonl") for x in ("step0", "final"))
        acc0, acc = (np.mean([row["correct"] for row in rows]) for rows in (s0, fin))
        m0, m = (np.mean([row["margin"] for row in rows]) for rows in (s0, fin))
        assert len(fin) == 512 and acc > acc0 + 0.15 and m > m0, (kind, acc0, acc, m0, m)
        assert json.loads((tmp_path / kind / "run_info.json").read_text())["adapter"]["r"] == 16
