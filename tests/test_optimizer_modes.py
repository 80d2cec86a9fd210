"""train.optimizer and per-layer activation checkpointing through the real stages on CPU: exact resume in each
mode, the refusals (another mode's checkpoint, fused_backward's limits, bf16_sr_8bit without bf16), fused_backward
equal to the step after backward, checkpointed layers equal to none, and multi-process DDP / FSDP2 in each mode."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch.distributed as dist

from stages.engine.checkpoint import CheckpointError
from stages.engine.settings import TrainConfigError
from stages.lib.io import read_json
from test_checkpoint import assert_identical_runs, checkpoint_at, ckpt_args
from test_train import assets, stage_args, torchrun, write_params  # noqa: F401 - `assets` is a fixture

torch.set_num_threads(1)

MODES = {  # name -> train overrides (CPU: precision bf16 keeps bf16 weights, autocast fp32 ones)
    "fp32_master_8bit_bf16": {"optimizer": {"state": "fp32_master_8bit"}, "precision": "bf16"},
    "fp32_master_8bit_fp32": {"optimizer": {"state": "fp32_master_8bit"}},
    "bf16_sr_8bit": {"optimizer": {"state": "bf16_sr_8bit"}, "precision": "bf16"},
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_each_mode_checkpoints_and_resumes_bitwise(assets, mode):
    """Train 8 steps with checkpoints, resume from step 4 in a new run: every log value, the exported weights and
    both probe files equal the uninterrupted run's bytes. The run learns (loss falls) and records its mode and
    memory plan."""
    from stages import train_rm
    params = write_params(assets / "p.yaml", train={"save_every": 2, "keep_checkpoints": 4, **MODES[mode]})
    full = train_rm.main(ckpt_args(assets, "full", params, assets / "ck"))
    assert full["settings"]["optimizer"]["state"] == MODES[mode]["optimizer"]["state"]
    plan = full["memory_plan"]
    assert plan["moments"] > 0 and plan["device_bytes"] is None and plan["fits"] is None
    assert (plan["masters"] > 0) == (mode == "fp32_master_8bit_bf16")
    resumed = train_rm.main(ckpt_args(assets, "resumed", params, assets / "ck2", resume=checkpoint_at(assets / "ck", 4)))
    assert resumed["resumed_from_step"] == 4
    assert_identical_runs(assets / "full", assets / "resumed")
    log = pd.read_csv(assets / "full/train_log.csv")
    assert log.loss.iloc[-1] < log.loss.iloc[0]


def test_resuming_with_another_mode_is_refused_naming_both(assets):
    from stages import train_rm
    params = write_params(assets / "p.yaml", train={"save_every": 2, "epochs": 1, **MODES["bf16_sr_8bit"]})
    train_rm.main(ckpt_args(assets, "a", params, assets / "ck"))
    ckpt = checkpoint_at(assets / "ck", 2)
    for other, name in (({"precision": "bf16"}, "exact"), (MODES["fp32_master_8bit_bf16"], "fp32_master_8bit")):
        p2 = write_params(assets / f"{name}.yaml", train={"save_every": 2, "epochs": 1, **other})
        with pytest.raises(SystemExit, match="train_rm: refused: ") as e:
            train_rm.main(ckpt_args(assets, "b", p2, resume=ckpt))
        assert isinstance(e.value.__cause__, CheckpointError)
        assert (f"the checkpoint holds train.optimizer.state bf16_sr_8bit, this run uses {name}"
                in str(e.value)), str(e.value)
        assert not dist.is_initialized()


@pytest.mark.parametrize("train,match", [
    ({"optimizer": {"fused_backward": True}}, "set train.max_grad_norm: 0"),
    ({"optimizer": {"fused_backward": True}, "max_grad_norm": 0.0, "micro_batch_tokens": 40},
     r"packs up to \d+ micro-batches into an optimizer step; set train.micro_batch_tokens >= \d+"),
    ({"optimizer": {"state": "bf16_sr_8bit"}}, "needs train.precision: bf16 .this run: autocast."),
])
def test_what_a_mode_cannot_do_is_refused_before_the_model_is_read(assets, train, match):
    from stages import train_rm
    params = write_params(assets / "p.yaml", train=train)
    (assets / "model" / "model.safetensors").rename(assets / "hidden.safetensors")   # never read
    with pytest.raises(SystemExit, match="train_rm: refused: .*" + match) as e:
        train_rm.main(stage_args(assets, "--out-dir", assets / "x", params))
    assert e.value.code == 1 and isinstance(e.value.__cause__, TrainConfigError)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("state", ["exact", "fp32_master_8bit"])
def test_fused_backward_equals_the_step_after_backward(assets, state):
    """One micro-batch a step and no clip: stepping each parameter inside backward gives the bytes of the
    ordinary step (exact: torch's fused AdamW on each parameter; 8-bit: the same per-tensor update)."""
    from stages import train_rm
    out = {}
    for fused in (False, True):
        params = write_params(assets / f"p{fused}.yaml", train={
            "max_grad_norm": 0.0, "micro_batch_tokens": 4096, "precision": "bf16",
            "optimizer": {"state": state, "fused_backward": fused}})
        info = train_rm.main(stage_args(assets, "--out-dir", assets / f"run{fused}", params))
        out[fused] = info
    assert out[True]["memory_plan"]["grads"] < out[False]["memory_plan"]["grads"]
    assert_identical_runs(assets / "runFalse", assets / "runTrue")


def test_checkpointing_some_layers_changes_no_bit_and_counts_them(assets):
    """train.activation_checkpointing: 1 (of 2 layers) and true recompute exactly what was kept: the same bytes."""
    from stages import train_rm
    from stages.engine.loop import enable_activation_checkpointing
    from stages.engine.modeling import load_reward_model
    from engine_helpers import train_settings
    hf = load_reward_model(assets / "model")
    assert enable_activation_checkpointing(hf, train_settings(activation_checkpointing=1)) == 1
    flags = [m.gradient_checkpointing for m in hf.model.layers]
    assert flags == [True, False]
    for ac in (False, 1, True, "auto"):
        params = write_params(assets / f"p{ac}.yaml", train={"activation_checkpointing": ac})
        info = train_rm.main(stage_args(assets, "--out-dir", assets / f"ac{ac}", params))
        assert info["memory_plan"]["checkpointed_layers"] == (2 if ac is True else 0 if ac == "auto" else int(ac))
        assert info["settings"]["activation_checkpointing"] == ac
    assert_identical_runs(assets / "acFalse", assets / "ac1")
    assert_identical_runs(assets / "acFalse", assets / "acTrue")
    assert_identical_runs(assets / "acFalse", assets / "acauto")     # CPU: nothing to fit, no layer checkpointed


def _equal_within(a, b, rtol):
    la, lb = pd.read_csv(a / "train_log.csv"), pd.read_csv(b / "train_log.csv")
    assert la.pairs.tolist() == lb.pairs.tolist() and la.tokens.tolist() == lb.tokens.tolist()
    np.testing.assert_allclose(lb.loss, la.loss, rtol=rtol, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("parallel,mode", [("ddp", "fp32_master_8bit_bf16"), ("fsdp2", "fp32_master_8bit_fp32"),
                                           ("fsdp2", "bf16_sr_8bit")])
def test_two_processes_train_each_mode_like_one(assets, parallel, mode):
    """torchrun --nproc-per-node 2 (gloo): DDP and FSDP2 in the low-bit modes. The loss curve follows the
    one-process run's (the world size is part of the result: gradients are reduced in another order, and 8-bit
    codes or stochastic rounding may then fall the other way, so within a tolerance, not bitwise), and an
    FSDP2 run resumes from its sharded (DCP) checkpoint with the same bytes as when uninterrupted."""
    params = write_params(assets / "p.yaml", train={"parallel": parallel, "save_every": 2, "keep_checkpoints": 4,
                                                    **MODES[mode]})
    one = write_params(assets / "p1.yaml", train={"parallel": "ddp", **MODES[mode]})
    torchrun(1, "stages.train_rm", stage_args(assets, "--out-dir", assets / "one", one))
    torchrun(2, "stages.train_rm", ckpt_args(assets, "two", params, assets / "ck"))
    info = read_json(assets / "two/run_info.json")
    assert info["world_size"] == 2 and info["parallel"] == parallel
    assert info["settings"]["optimizer"]["state"] == MODES[mode]["optimizer"]["state"]
    _equal_within(assets / "one", assets / "two", rtol=0.05)
    torchrun(2, "stages.train_rm", ckpt_args(assets, "resumed", params, assets / "ck2",
                                             resume=checkpoint_at(assets / "ck", 4)))
    assert read_json(assets / "resumed/run_info.json")["resumed_from_step"] == 4
    assert_identical_runs(assets / "two", assets / "resumed")


LORA = {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0, "export": "adapter",
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


@pytest.mark.parametrize("mode", ["fp32_master_8bit_bf16", "bf16_sr_8bit"])
def test_lora_trains_and_resumes_bitwise_in_the_low_bit_modes(assets, mode):
    """train.adapter with each low-bit state: only the adapters (and the reward head) get 8-bit moments; the loss
    curve follows the exact state's on the same adapters (measured within 1e-3: 0.4997 vs 0.4999 at the end) and
    falls; a resume from its checkpoint (trainable state only) equals the whole run."""
    from stages import train_rm
    exact = write_params(assets / "exact.yaml", train={"adapter": LORA, "lr": 1e-2, "precision": "bf16"})
    train_rm.main(stage_args(assets, "--out-dir", assets / "exact", exact))
    params = write_params(assets / "p.yaml", train={"save_every": 2, "keep_checkpoints": 4, "adapter": LORA,
                                                    "lr": 1e-2, **MODES[mode]})
    full = train_rm.main(ckpt_args(assets, "full", params, assets / "ck"))
    assert full["adapter"]["trainable_parameters"] == full["memory_plan"]["trainable"]
    assert full["memory_plan"]["trainable"] < full["memory_plan"]["parameters"] / 5
    train_rm.main(ckpt_args(assets, "resumed", params, assets / "ck2", resume=checkpoint_at(assets / "ck", 4)))
    la, lb = pd.read_csv(assets / "full/train_log.csv"), pd.read_csv(assets / "resumed/train_log.csv")
    pd.testing.assert_frame_equal(la, lb, check_exact=True)
    for f in ("probe_final.jsonl", "model/adapter_model.safetensors"):
        assert (assets / "full" / f).read_bytes() == (assets / "resumed" / f).read_bytes(), f
    assert la.loss.iloc[-1] < 0.8 * la.loss.iloc[0]
    np.testing.assert_allclose(la.loss, pd.read_csv(assets / "exact/train_log.csv").loss, rtol=0.02)
