"""The memory plan (stages/engine/memory_plan.py): the parameter count from config.json against real transformers
models, the plan's parts against the exact bytes of the tensors a built run holds, and the refusal naming settings
that fit."""
from __future__ import annotations

import sys

import pytest
import torch

from engine_helpers import REPO_ROOT, make_tiny_model_dir, train_settings
from stages.engine.dist import DistEnv
from stages.engine.lowbit_adamw import state_bytes
from stages.engine.memory_plan import MemoryPlanError, check_fits, estimate, lora_shapes, read_config, tensor_shapes
from stages.engine.optim import build_optimizer

sys.path.insert(0, str(REPO_ROOT / "bench"))

CONFIGS = {
    "qwen2_tied": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen2_untied": ("Qwen2Config", {"tie_word_embeddings": False}),
    "llama": ("LlamaConfig", {}),
    "llama_biases": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 24}),
}


def _model(kind: str, head: str):
    import transformers
    cls, extra = CONFIGS[kind]
    config = getattr(transformers, cls)(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=300, **extra)
    auto = transformers.AutoModelForSequenceClassification if head == "score" else transformers.AutoModelForCausalLM
    config.num_labels = 1
    with torch.device("meta"):
        model = auto.from_config(config)
    return config.to_dict(), model


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("head", ["lm_head", "score"])
def test_parameter_count_from_config_equals_the_models_numel(kind, head):
    """Every tensor's size (as a multiset) and the total, from config.json alone, equal the real model's."""
    cfg, model = _model(kind, head)
    got = sorted(k for _, k in tensor_shapes(cfg, head))
    want = sorted(p.numel() for p in model.parameters())
    assert got == want, (kind, head)


def test_the_7b_and_14b_shapes_count_as_transformers_builds_them():
    import gpu_bench
    from transformers import Qwen2Config
    for shape in ("qwen2.5-7b", "qwen2.5-0.5b"):
        cfg = gpu_bench.qwen2_config(shape, 0).to_dict()
        assert sum(k for _, k in tensor_shapes(cfg, "lm_head")) == gpu_bench.param_counts(gpu_bench.SHAPES[shape])["total"]
    cfg14 = Qwen2Config(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False).to_dict()
    assert sum(k for _, k in tensor_shapes(cfg14, "lm_head")) == 14_770_033_664      # Qwen2.5-14B's published count


@pytest.mark.parametrize("state,precision", [("exact", "bf16"), ("exact", "autocast"), ("fp32_master_8bit", "bf16"),
                                             ("fp32_master_8bit", "autocast"), ("bf16_sr_8bit", "bf16")])
def test_plan_parts_are_the_bytes_a_built_run_holds(tmp_path, state, precision):
    """Build the module and optimizer as the loop does (CPU, eager step), run one step, and compare the plan's
    weights, gradients, masters and moments with the exact bytes of the tensors then alive."""
    from stages.engine.modeling import load_reward_model
    from stages.engine.optim import MasterWeightAdamW
    model_dir = make_tiny_model_dir(tmp_path / "m", hidden=64, tie=False)
    settings = train_settings(precision=precision, optimizer={"state": state})
    hf = load_reward_model(model_dir)
    masters = None
    if precision == "bf16":
        if state != "bf16_sr_8bit":
            masters = {id(p): p.detach() for p in hf.parameters()}
        hf.to(torch.bfloat16)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    opt = build_optimizer(hf, settings, env, masters)
    del masters
    sum(p.float().square().sum() for p in hf.parameters()).backward()     # a gradient for every tensor
    if isinstance(opt, MasterWeightAdamW):
        opt.grads_to_master()
    opt.step()
    plan = estimate(read_config(model_dir), "score", settings, micro_batch_tokens=20, device_type="cpu")
    weights = sum(p.numel() * p.element_size() for p in hf.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in hf.parameters())
    grads += sum(m.grad.numel() * m.grad.element_size() for m in getattr(opt, "master_params", None) or []
                 if m.grad is not None)
    held = state_bytes(opt)            # the moments (or their codes and scales); the step counts are not planned
    assert (plan.weights, plan.grads, plan.masters, plan.moments) == (weights, grads, held["masters"],
                                                                       held["moments"])
    assert plan.parameters == sum(p.numel() for p in hf.parameters())


def test_lora_trainable_count_is_peft_s(tmp_path):
    from stages.engine.adapters import attach_adapter
    from stages.engine.modeling import load_reward_model
    model_dir = make_tiny_model_dir(tmp_path / "m", hidden=64)
    adapter = {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0, "export": "merged",
               "target_modules": ["q_proj", "v_proj", "down_proj"]}
    hf = load_reward_model(model_dir)
    info = attach_adapter(hf, adapter, "score")
    assert sum(k for _, k in lora_shapes(read_config(model_dir), adapter, "score")) == info.trainable_parameters


def test_a_plan_that_cannot_fit_is_refused_naming_settings_that_fit():
    """The Qwen2.5-7B shape, full fine-tune, exact state: 16 bytes a parameter do not fit an 80 GB GPU; the one-line
    refusal names the parts and the settings that would fit (each re-planned under that device)."""
    import gpu_bench
    cfg = gpu_bench.qwen2_config("qwen2.5-7b", 0).to_dict()
    settings = train_settings(gpus=1, precision="bf16", micro_batch_tokens=8192)
    plan = estimate(cfg, "lm_head", settings, 8192, device_bytes=80 * 10 ** 9, graphed=True)
    assert plan.fits is False and plan.weights == 2 * plan.parameters and plan.moments == 8 * plan.parameters
    with pytest.raises(MemoryPlanError) as e:
        check_fits(plan, cfg, "lm_head", settings, 1, "cuda", True, "NVIDIA H100")
    msg = str(e.value)
    assert "\n" not in msg and "exceeds NVIDIA H100's 74.5 GiB" in msg and "moments 56.74" in msg
    assert "would fit: train.optimizer.state: fp32_master_8bit" in msg or "would fit: train.optimizer.state: bf16_sr_8bit" in msg
    for part in msg.split("would fit: ")[1].split("; "):
        assert float(part.rsplit("(", 1)[1].split(" GiB")[0]) <= 74.5
    # the same run fits a 141 GB H200 in fp32_master_8bit without any checkpointing
    s8 = train_settings(gpus=1, precision="bf16", micro_batch_tokens=8192, optimizer={"state": "fp32_master_8bit"})
    assert estimate(cfg, "lm_head", s8, 8192, device_bytes=141 * 10 ** 9, graphed=True).fits is True


def test_auto_checkpointing_takes_the_fewest_layers_that_fit():
    """train.activation_checkpointing: auto: none on CPU (nothing to fit) or where the plan fits as is; else the
    smallest N whose plan fits (N - 1 does not); every layer when nothing fits (then refused by check_fits)."""
    import gpu_bench
    from dataclasses import replace
    from stages.engine.memory_plan import fewest_checkpointed
    cfg = gpu_bench.qwen2_config("qwen2.5-7b", 0).to_dict()
    s = train_settings(gpus=1, precision="bf16", activation_checkpointing="auto", max_grad_norm=0.0,
                       optimizer={"state": "exact", "fused_backward": True})
    assert fewest_checkpointed(cfg, "lm_head", s, 8192, 1, None, "cpu", False).checkpointed_layers == 0
    h200 = int(139.8 * 2 ** 30)
    plan = fewest_checkpointed(cfg, "lm_head", s, 8192, 1, h200, "cuda", False)
    n = plan.checkpointed_layers
    assert 0 < n < 28 and plan.fits
    assert estimate(cfg, "lm_head", replace(s, activation_checkpointing=n - 1), 8192, 1, h200, "cuda").fits is False
    tiny = fewest_checkpointed(cfg, "lm_head", s, 8192, 1, 10 * 2 ** 30, "cuda", False)
    assert tiny.checkpointed_layers == 28 and tiny.fits is False


LORA = {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0, "export": "merged",
        "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.mark.parametrize("state,adapter", [("exact", None), ("fp32_master_8bit", None), ("bf16_sr_8bit", None),
                                           ("exact", LORA), ("fp32_master_8bit", LORA), ("bf16_sr_8bit", LORA)])
def test_the_plan_bounds_the_bytes_alive_when_the_optimizer_clones_its_masters(tmp_path, state, adapter):
    """The loop's cast to bf16 (loop.cast_to_compute_dtype) and optimizer build, on a reward model: when the optimizer
    has cloned its masters and their fp32 sources are still alive (the load's peak, before any activation), every
    distinct storage then held (the module's weights, the masters' sources, the optimizer's masters) fits in the
    plan's static parts + transient. With an adapter that moment is the run's peak (the plan's transient is the
    load's); a frozen base whose fp32 load stayed alive through the cast held 6 bytes a parameter, not planned."""
    from stages.engine.adapters import attach_adapter
    from stages.engine.loop import cast_to_compute_dtype
    from stages.engine.modeling import load_reward_model
    model_dir = make_tiny_model_dir(tmp_path / "m", hidden=64, tie=False)
    settings = train_settings(precision="bf16", optimizer={"state": state}, adapter=adapter)
    hf = load_reward_model(model_dir)
    if adapter is not None:
        attach_adapter(hf, adapter, "score")
    masters = cast_to_compute_dtype(hf, settings)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    opt = build_optimizer(hf, settings, env, masters)
    held = {}
    for t in [*hf.parameters(), *(masters or {}).values(), *(getattr(opt, "master_params", None) or [])]:
        held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    plan = estimate(read_config(model_dir), "score", settings, micro_batch_tokens=0, device_type="cpu")
    assert plan.activations == 0
    static = plan.weights + plan.grads + plan.masters + plan.moments
    assert sum(held.values()) <= static + plan.transient, (sum(held.values()), plan)
    assert (plan.transient > 0) == (adapter is not None)
