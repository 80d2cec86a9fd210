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
from stage_helpers import assert_identical_runs, checkpoint_at, ckpt_args, stage_args, torchrun, write_train_params

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
    params = write_train_params(assets / "p.yaml", train={"save_every": 2, "keep_checkpoints": 4, **MODES[mode]})
    full = train_rm.main(ckpt_args(assets, "full", params, assets / "ck"))
    assert full["settings"]["optimizer"]["state"] == MODES[mode]["optimizer"]["state"]
    plan = full["memory_plan"]
    assert plan["moments"] > 0 and plan["device_bytes"] is None and plan["fits"] is None
    assert (plan["masters"] > 0) == (mode == "fp32_master_8bit_bf16")
    resumed = train_rm.main(ckpt_args(assets, "resumed", params, assets / "ck2", resume=checkpoint_at(assets / "ck", 4)))
    assert resumed["perf"]["resumed_from_step"] == 4
    assert_identical_runs(assets / "full", assets / "resumed", same_record=True)
    log = pd.read_csv(assets / "full/train_log.csv")
    assert log.loss.iloc[-1] < log.loss.iloc[0]


def test_resuming_with_another_mode_is_refused_naming_both(assets):
    from stages import train_rm
    params = write_train_params(assets / "p.yaml", train={"save_every": 2, "epochs": 1, **MODES["bf16_sr_8bit"]})
    train_rm.main(ckpt_args(assets, "a", params, assets / "ck"))
    ckpt = checkpoint_at(assets / "ck", 2)
    for other, name in (({"precision": "bf16"}, "exact"), (MODES["fp32_master_8bit_bf16"], "fp32_master_8bit")):
        p2 = write_train_params(assets / f"{name}.yaml", train={"save_every": 2, "epochs": 1, **other})
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
    params = write_train_params(assets / "p.yaml", train=train)
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
        params = write_train_params(assets / f"p{fused}.yaml", train={
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
        params = write_train_params(assets / f"p{ac}.yaml", train={"activation_checkpointing": ac})
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
    params = write_train_params(assets / "p.yaml", train={"parallel": parallel, "save_every": 2, "keep_checkpoints": 4,
                                                    **MODES[mode]})
    one = write_train_params(assets / "p1.yaml", train={"parallel": "ddp", **MODES[mode]})
    torchrun(1, "stages.train_rm", stage_args(assets, "--out-dir", assets / "one", one))
    torchrun(2, "stages.train_rm", ckpt_args(assets, "two", params, assets / "ck"))
    info = read_json(assets / "two/run_info.json")
    assert info["world_size"] == 2 and info["parallel"] == parallel
    assert info["settings"]["optimizer"]["state"] == MODES[mode]["optimizer"]["state"]
    _equal_within(assets / "one", assets / "two", rtol=0.05)
    torchrun(2, "stages.train_rm", ckpt_args(assets, "resumed", params, assets / "ck2",
                                             resume=checkpoint_at(assets / "ck", 4)))
    assert read_json(assets / "resumed.perf.json")["resumed_from_step"] == 4
    assert_identical_runs(assets / "two", assets / "resumed", same_record=True)


LORA = {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0, "export": "adapter",
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


@pytest.mark.parametrize("mode", ["fp32_master_8bit_bf16", "bf16_sr_8bit"])
def test_lora_trains_and_resumes_bitwise_in_the_low_bit_modes(assets, mode):
    """train.adapter with each low-bit state: only the adapters (and the reward head) get 8-bit moments; the loss
    curve follows the exact state's on the same adapters (measured within 1e-3: 0.4997 vs 0.4999 at the end) and
    falls; a resume from its checkpoint (trainable state only) equals the whole run."""
    from stages import train_rm
    exact = write_train_params(assets / "exact.yaml", train={"adapter": LORA, "lr": 1e-2, "precision": "bf16"})
    train_rm.main(stage_args(assets, "--out-dir", assets / "exact", exact))
    params = write_train_params(assets / "p.yaml", train={"save_every": 2, "keep_checkpoints": 4, "adapter": LORA,
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


def _trained_one_step(assets, objective: str, train: dict):
    """build_run and one optimizer step of the loop (real engine, CPU, one-process group); returns the run (the
    caller shuts the process group down)."""
    from stages.engine.checkpoint import CheckpointOptions
    from stages.engine.cli import load_stage_tokens
    from stages.engine.data import prefetch_batches
    from stages.engine.dist import init_distributed
    from stages.engine.loop import build_run
    from stages.engine.dpo_objective import DPOObjective
    from stages.engine.reward_objective import RewardObjective
    from stages.engine.settings import TrainSettings
    from stages.engine.steps import make_steps
    from stages.lib.params import load_params
    params = load_params(write_train_params(assets / f"{objective}.yaml", train=train, dpo={"objective": "dpo_ref_free"}))
    settings = TrainSettings.from_params(params)
    env = init_distributed(settings)
    train_pairs, probe_pairs = load_stage_tokens(assets / "model", assets / "train.parquet", assets / "probe.parquet")
    obj = RewardObjective(params["rm"], train_pairs.margins) if objective == "rm" else DPOObjective(params["dpo"])
    run = build_run(obj, settings, env, assets / "model", train_pairs, probe_pairs, assets / "new",
                    CheckpointOptions(directory=None, resume="never"))
    mbs = list(run.plans[0].rank_micro_batches[0])
    steps = make_steps(run.model, run.module, run.hf, obj, run.optimizer, settings, env, run.train_pairs, mbs,
                       run.n_params)
    batches = prefetch_batches(run.train_pairs, mbs, pin=False, share_prompt=settings.share_prompt, pad_to=steps.pad_to)
    run.schedule.apply(run.optimizer, 1)             # step 1 of the warmup: a learning rate > 0
    steps.step(len(mbs), len(mbs), batches, 1.0 / sum(len(mb) for mb in mbs))
    steps.finish()
    return run


@pytest.mark.parametrize("objective,train", [
    ("rm", {"precision": "bf16"}),                                      # exact: MasterWeightAdamW
    ("rm", MODES["fp32_master_8bit_bf16"]),
    ("dpo", MODES["fp32_master_8bit_bf16"]),                            # tied embeddings: one tensor, two names
    ("rm", {**MODES["fp32_master_8bit_bf16"], "adapter": {**LORA, "export": "both"}}),
    ("dpo", {"precision": "bf16", "adapter": {**LORA, "export": "both"}}),
])
def test_the_masters_export_writes_an_fp32_models_bytes_without_converting_the_model(assets, objective, train):
    """A bf16 run with fp32 masters, one step trained: loop.export_trained writes, byte for byte, every file the
    former export wrote (the whole module cast to fp32 in place, the masters copied in, then export_model): the
    same tensor names, fp32 values, shards and config.json (dtype float32); for an adapter, the merged model and the
    adapter directory. And it leaves the trained module in bf16: no fp32 copy of the model was made on its device
    (the copies go to the host one tensor at a time)."""
    from stages.engine.dist import shutdown_distributed
    from stages.engine.export import export_model
    from stages.engine.loop import export_trained
    try:
        run = _trained_one_step(assets, objective, train)
        assert run.optimizer.master_params is not None
        # the masters differ from their bf16 copies somewhere (else the bytes could not tell the two apart)
        assert any(not torch.equal(m, p.float()) for p, m in zip(run.optimizer.model_params,
                                                                 run.optimizer.master_params))
        before = {n: p.detach().clone() for n, p in run.module.named_parameters()}
        export_trained(run, assets / "model")
        after = dict(run.module.named_parameters())
        assert all(p.dtype == torch.bfloat16 for p in after.values())
        assert all(torch.equal(before[n], p) for n, p in after.items())
        # the former export, as it was: the module to fp32 in place, the masters copied into it
        with torch.no_grad():
            run.module.float()
            torch._foreach_copy_(run.optimizer.model_params, run.optimizer.master_params)
        export_model(run.module, run.objective, run.settings, run.env, assets / "model", assets / "old" / "model",
                     run.adapter)
    finally:
        shutdown_distributed()
    new = assets / "new" / "model"
    _assert_same_files(assets / "old" / "model", new)
    if run.adapter is None:
        import json
        assert json.loads((new / "config.json").read_text())["dtype"] == "float32"


def _assert_same_files(old, new) -> None:
    import filecmp
    files = sorted(str(p.relative_to(old)) for p in old.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(new)) for p in new.rglob("*") if p.is_file())
    assert any(f.endswith(".safetensors") for f in files)
    match, mismatch, errors = filecmp.cmpfiles(old, new, files, shallow=False)
    assert (mismatch, errors) == ([], []), (mismatch, errors)


@pytest.mark.parametrize("train", [MODES["bf16_sr_8bit"], {**MODES["bf16_sr_8bit"], "adapter": {**LORA, "export": "both"}}])
def test_host_copies_of_a_master_free_run_export_the_modules_bytes(assets, train):
    """bf16_sr_8bit keeps no masters: the host copies a GPU run exports from (export.host_state_dict, one tensor at
    a time, so save_pretrained never sees the CUDA-graph path's flat buffer as shared storage to clone on the device)
    write the bytes the module's own state writes, in bf16."""
    import json
    from stages.engine.dist import shutdown_distributed
    from stages.engine.export import export_model, host_state_dict
    try:
        run = _trained_one_step(assets, "dpo", train)
        assert run.optimizer.master_params is None
        args = (run.module, run.objective, run.settings, run.env, assets / "model")
        export_model(*args, assets / "new" / "model", run.adapter,
                     state=host_state_dict(run.hf, run.optimizer, trained_only=run.adapter is not None))
        export_model(*args, assets / "old" / "model", run.adapter)
    finally:
        shutdown_distributed()
    _assert_same_files(assets / "old" / "model", assets / "new" / "model")
    if run.adapter is None:
        assert json.loads((assets / "new" / "model" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("train", [{"precision": "autocast"}, {"precision": "autocast", "adapter": LORA},
                                   {"precision": "bf16"}])
def test_host_copies_export_under_the_exact_state_of_any_optimizer_class(assets, train):
    """train.optimizer.state exact: precision autocast trains fp32 weights with torch's own AdamW, which has no
    `model_params` (only our optimizers have): the host copies every GPU run exports from took them from there and
    failed every autocast GPU run at its export (issue 40). They write the bytes the module's own export writes."""
    from stages.engine.dist import shutdown_distributed
    from stages.engine.export import export_model, host_state_dict
    from stages.engine.optim import trained_params
    try:
        run = _trained_one_step(assets, "dpo", train)
        if train["precision"] == "autocast":
            assert type(run.optimizer) is torch.optim.AdamW and not hasattr(run.optimizer, "model_params")
        assert {id(p) for p in trained_params(run.optimizer)} == {id(p) for p in run.module.parameters()
                                                                   if p.requires_grad}
        args = (run.module, run.objective, run.settings, run.env, assets / "model")
        state = host_state_dict(run.hf, run.optimizer, trained_only=run.adapter is not None)
        export_model(*args, assets / "new" / "model", run.adapter, state=state)
        if getattr(run.optimizer, "master_params", None) is None:
            export_model(*args, assets / "old" / "model", run.adapter)
            _assert_same_files(assets / "old" / "model", assets / "new" / "model")
    finally:
        shutdown_distributed()
