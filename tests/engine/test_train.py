"""The training engine end to end: objectives, schedule, loss/grad parity with an independent implementation,
refusals, determinism, and real torchrun runs (DP=2 vs DP=1, FSDP2, the stage CLIs)."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml

from conftest import REPO_ROOT as REPO
from engine_helpers import pair_seqs, reference_rm_scores, reference_seq_logps, train_settings
from stages.engine.optim import lr_factor
from stages.engine.settings import TrainConfigError, TrainSettings
from stages.lib.io import read_jsonl, read_parquet
from stages.engine.dpo_losses import dpo_pair_losses
from stages.engine.objectives import tie_aware_accuracy
from stages.engine.reward_objective import reward_pair_losses
from stages.lib.ref_logps_table import RefLogpsError, ref_logps_for, ref_logps_table
from stages.engine.packing import load_token_pairs, plan_training
from stage_helpers import assert_same_training, stage_args, torchrun, write_train_params

torch.set_num_threads(1)   # tiny models: extra intra-op threads only contend on a shared machine


# ----------------------------------------------------------------------------------------------
# Objectives and schedule (pure)
# ----------------------------------------------------------------------------------------------

def test_dpo_losses_match_the_paper_formulas():
    pc, pr, rc, rr = (torch.tensor(v, dtype=torch.float64) for v in ([-3.0, -1.0], [-2.0, -4.0], [-2.5, -1.5], [-2.5, -2.0]))
    z = (pc - rc) - (pr - rr)
    sig = dpo_pair_losses(pc, pr, rc, rr, beta=0.1)
    torch.testing.assert_close(sig, torch.log1p(torch.exp(-0.1 * z)))
    smooth = dpo_pair_losses(pc, pr, rc, rr, beta=0.1, label_smoothing=0.2)
    torch.testing.assert_close(smooth, 0.8 * torch.log1p(torch.exp(-0.1 * z)) + 0.2 * torch.log1p(torch.exp(0.1 * z)))
    torch.testing.assert_close(dpo_pair_losses(pc, pr, rc, rr, beta=0.1, loss_type="ipo"), (z - 5.0) ** 2)
    free = dpo_pair_losses(pc, pr, torch.zeros(2), torch.zeros(2), beta=0.5)
    torch.testing.assert_close(free, torch.log1p(torch.exp(-0.5 * (pc - pr))))


def test_reward_loss_matches_trl_reward_trainer():
    sc, sr, m = torch.tensor([1.0, -0.5, 0.2]), torch.tensor([0.0, 0.5, 0.2]), torch.tensor([0.5, 0.0, 1.0])
    torch.testing.assert_close(reward_pair_losses(sc, sr).mean(), -F.logsigmoid(sc - sr).mean())
    torch.testing.assert_close(reward_pair_losses(sc, sr, m, center_rewards_coefficient=0.01).mean(),
                               -F.logsigmoid(sc - sr - m).mean() + 0.01 * torch.mean((sc + sr) ** 2))
    assert tie_aware_accuracy(sc - sr).tolist() == [1.0, 0.0, 0.5]


def test_lr_schedules_follow_hf_warmup_semantics():
    assert [lr_factor(s, 2, 10, "cosine") for s in (0, 1, 2)] == [0.0, 0.5, 1.0]
    assert lr_factor(10, 2, 10, "cosine") == pytest.approx(0.0) and lr_factor(6, 2, 10, "cosine") == pytest.approx(0.5)
    assert lr_factor(6, 2, 10, "linear") == pytest.approx(0.5) and lr_factor(9, 2, 10, "constant") == 1.0


def test_lr_set_directly_equals_torch_lambdalr_bit_for_bit():
    """engine.optim.LRSchedule replaced LambdaLR: the same learning rates, bit for bit, at every step."""
    from stages.engine.optim import LRSchedule
    for schedule in ("cosine", "linear", "constant"):
        settings = train_settings(lr=3e-4, warmup_ratio=0.1, schedule=schedule)
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=settings.lr)
        ours = LRSchedule(settings, 37)
        warmup = math.ceil(settings.warmup_ratio * 37)
        theirs = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, warmup, 37, schedule))
        for step in range(37):
            assert ours.lr(step) == theirs.get_last_lr()[0], (schedule, step)
            opt.step()
            theirs.step()


def test_train_settings_take_the_schema_as_their_only_definition():
    with pytest.raises(TrainConfigError, match="train.precision: 'fp8' is not one of"):
        train_settings(precision="fp8")
    with pytest.raises(TrainConfigError, match="train.cuda_graphs: -1 is less than the minimum of 0"):
        train_settings(cuda_graphs=-1)
    assert train_settings().epochs == yaml.safe_load((REPO / "params.yaml").read_text())["train"]["epochs"]


def test_temperature_other_than_one_is_refused_before_anything_is_built(assets):
    params = write_train_params(assets / "p.yaml", train={"temperature": 0.7})
    with pytest.raises(TrainConfigError, match="temperature = 0.7"):
        TrainSettings.from_params(yaml.safe_load(params.read_text()))
    from stages import train_dpo
    with pytest.raises(SystemExit, match="train_dpo: refused: .*temperature") as e:   # one line, exit 1
        train_dpo.main(stage_args(assets, "--out-dir", assets / "out", params)[:-2] + ["--ref-logps", "x.parquet"])
    assert e.value.code == 1 and isinstance(e.value.__cause__, TrainConfigError)
    assert not dist.is_initialized() and not (assets / "out").exists()


def test_ref_logps_refuses_missing_and_stale_pairs(assets):
    pairs = load_token_pairs(assets / "probe.parquet")
    table = ref_logps_table([("probe", pairs, np.zeros((len(pairs), 2)))])
    np.testing.assert_array_equal(ref_logps_for(table, "probe", pairs, "r.parquet"), np.zeros((len(pairs), 2)))
    with pytest.raises(RefLogpsError, match="no train row for pair"):
        ref_logps_for(table, "train", pairs, "r.parquet")
    stale = table.set_column(4, "token_hash", [["0" * 64] * len(pairs)])
    with pytest.raises(RefLogpsError, match=f"pair {pairs.pair_ids[0]} was computed from other tokens"):
        ref_logps_for(stale, "probe", pairs, "r.parquet")


# ----------------------------------------------------------------------------------------------
# In-process runs (a one-process group): parity with the independent implementation, determinism
# ----------------------------------------------------------------------------------------------

def first_step_rows(assets: Path, params: Path) -> list[dict]:
    settings = TrainSettings.from_params(yaml.safe_load(params.read_text()))
    pairs = load_token_pairs(assets / "train.parquet")
    plan = plan_training(pairs.pair_tokens, epochs=settings.epochs, world_size=1,
                         global_batch_pairs=settings.global_batch_pairs,
                         micro_batch_tokens=settings.micro_batch_tokens, seed=settings.seed)[0]
    rows = pd.read_parquet(assets / "train.parquet").to_dict("records")
    return [{k: (list(v) if hasattr(v, "tolist") else v) for k, v in rows[i].items()}
            for mb in plan.rank_micro_batches[0] for i in mb]


def grad_norm(model) -> float:
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None))


def test_dpo_first_step_loss_grad_norm_and_ref_logps_match_independent_implementation(assets):
    from transformers import AutoModelForCausalLM
    from stages import ref_logps, train_dpo
    params = write_train_params(assets / "p.yaml", dpo={"objective": "dpo_ref_free", "beta": 0.5})
    ref_logps.main(stage_args(assets, "--out", assets / "ref.parquet", params))
    out = assets / "dpo"
    train_dpo.main(stage_args(assets, "--out-dir", out, params))

    model = AutoModelForCausalLM.from_pretrained(assets / "model", attn_implementation="eager", dtype=torch.float32)
    table = read_parquet(assets / "ref.parquet").to_pandas()
    probe_rows = pd.read_parquet(assets / "probe.parquet").to_dict("records")
    seqs, pls = pair_seqs([{k: (list(v) if hasattr(v, "tolist") else v) for k, v in r.items()} for r in probe_rows])
    with torch.no_grad():
        want = reference_seq_logps(model, seqs, pls).view(-1, 2).numpy()
    got = table[table.split == "probe"][["ref_chosen_logp", "ref_rejected_logp"]].to_numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert table[table.split == "probe"].pair_id.tolist() == [r["pair_id"] for r in probe_rows]

    step = first_step_rows(assets, params)
    seqs, pls = pair_seqs(step)
    logps = reference_seq_logps(model, seqs, pls).view(-1, 2)
    loss = -F.logsigmoid(0.5 * (logps[:, 0] - logps[:, 1])).mean()
    loss.backward()
    log = pd.read_csv(out / "train_log.csv")
    assert log.loss[0] == pytest.approx(loss.item(), rel=1e-6)
    assert log.grad_norm[0] == pytest.approx(grad_norm(model), rel=1e-5)
    assert log.pairs[0] == 16 and log.tokens[0] == sum(map(len, seqs))
    step0 = read_jsonl(out / "probe_step0.jsonl")
    np.testing.assert_allclose([[r["policy_chosen_logp"], r["policy_rejected_logp"]] for r in step0], want,
                               rtol=0, atol=1e-5)
    assert all(r["ref_chosen_logp"] == 0.0 for r in step0)      # reference-free
    # The start-up record (stages/engine/startup.py), in the perf JSON only: every phase up to the first
    # optimizer step, in order, each a duration, the total their sum.
    startup = json.loads((Path(str(out) + ".perf.json")).read_text())["startup"]
    # "plan" (packing, optimizer refusals, memory plan) comes before the model load: nothing is read in vain
    assert startup["order"] == ["imports", "process_group", "environment", "tokens", "plan", "model_load",
                                               "to_device", "kernel_warmup", "wrap", "optimizer", "resume",
                                               "probe_step0", "steps_setup", "first_step"]
    assert all(v >= 0 for v in startup["phases_seconds"].values()) and startup["from"] == "process start"
    assert startup["total_seconds"] == pytest.approx(sum(startup["phases_seconds"].values()), abs=0.01)
    ref_startup = json.loads(Path(str(assets / "ref.parquet") + ".perf.json").read_text())["startup"]
    assert ref_startup["order"] == ["imports", "process_group", "environment", "tokens", "model_load"]
    assert "startup" not in (out / "run_info.json").read_text()
    after = json.loads((Path(str(out) + ".perf.json")).read_text())["after_loop_seconds"]
    assert set(after) == {"probe_final", "export"} and all(v >= 0 for v in after.values())


def test_rm_first_step_loss_and_grad_norm_match_independent_implementation(assets):
    from transformers import AutoModelForSequenceClassification
    from stages import train_rm
    from stages.engine.modeling import load_reward_model
    params = write_train_params(assets / "p.yaml", rm={"center_rewards_coefficient": 0.05})
    out = assets / "rm"
    train_rm.main(stage_args(assets, "--out-dir", out, params))

    torch.manual_seed(5)                      # the trainer seeds with train.seed before creating the head
    load_reward_model(assets / "model").save_pretrained(assets / "rm_init")
    model = AutoModelForSequenceClassification.from_pretrained(assets / "rm_init", attn_implementation="eager",
                                                               dtype=torch.float32)
    seqs, _ = pair_seqs(first_step_rows(assets, params))
    scores = reference_rm_scores(model, seqs).view(-1, 2)
    sc, sr = scores[:, 0], scores[:, 1]
    loss = -F.logsigmoid(sc - sr).mean() + 0.05 * torch.mean((sc + sr) ** 2)
    loss.backward()
    log = pd.read_csv(out / "train_log.csv")
    assert log.loss[0] == pytest.approx(float(loss), rel=1e-5)
    assert log.grad_norm[0] == pytest.approx(grad_norm(model), rel=1e-5)

    # The export is a sequence-classification directory that scores like the trained model.
    exported = AutoModelForSequenceClassification.from_pretrained(out / "model")
    assert exported.config.num_labels == 1 and exported.config.pad_token_id is not None
    final = read_jsonl(out / "probe_final.jsonl")
    probe = pd.read_parquet(assets / "probe.parquet")
    with torch.no_grad():
        for k in (0, 36):
            ids = torch.tensor([list(probe.chosen_ids[k])])
            assert float(exported(input_ids=ids).logits[0, 0]) == pytest.approx(final[k]["chosen_score"], abs=1e-5)


def test_training_is_deterministic_on_cpu(assets):
    from stages import train_rm
    params = write_train_params(assets / "p.yaml", train={"epochs": 1})
    for name in ("a", "b"):
        train_rm.main(stage_args(assets, "--out-dir", assets / name, params))
    for f in ("probe_final.jsonl", "model/model.safetensors", "model/config.json"):
        assert (assets / "a" / f).read_bytes() == (assets / "b" / f).read_bytes(), f
    cols = ["step", "loss", "accuracy", "grad_norm", "lr"]
    pd.testing.assert_frame_equal(pd.read_csv(assets / "a/train_log.csv")[cols],
                                  pd.read_csv(assets / "b/train_log.csv")[cols])


def test_non_finite_model_fails_fast(assets):
    from safetensors.torch import load_file, save_file
    from stages import train_rm
    weights = load_file(assets / "model" / "model.safetensors")
    weights["model.norm.weight"][3] = float("nan")
    save_file(weights, assets / "model" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match="non-finite"):
        train_rm.main(stage_args(assets, "--out-dir", assets / "rm", write_train_params(assets / "p.yaml")))
    assert not (assets / "rm" / "model").exists()
    assert not dist.is_initialized()


# ----------------------------------------------------------------------------------------------
# Real torchrun (gloo on CPU)
# ----------------------------------------------------------------------------------------------

def assert_probe_rows(path: Path, probe: Path, keys: set[str]) -> list[dict]:
    rows = read_jsonl(path)
    want = pd.read_parquet(probe)
    assert [r["pair_id"] for r in rows] == want.pair_id.tolist()          # all pairs, manifest order
    assert [r["token_hash"] for r in rows] == want.token_hash.tolist()
    assert [r["index"] for r in rows] == list(range(len(want)))
    for r in rows:
        assert set(r) == keys
        assert r["correct"] == (1.0 if r["margin"] > 0 else 0.0 if r["margin"] < 0 else 0.5)
    return rows


DPO_KEYS = {"pair_id", "index", "token_hash", "policy_chosen_logp", "policy_rejected_logp", "ref_chosen_logp",
            "ref_rejected_logp", "chosen_reward", "rejected_reward", "margin", "correct",
            # every row says which implicit reward it scores and over how many tokens (versioned records)
            "implicit_reward", "chosen_tokens", "rejected_tokens"}
RM_KEYS = {"pair_id", "index", "token_hash", "chosen_score", "rejected_score", "margin", "correct"}


@pytest.mark.slow
def test_dpo_under_torchrun_dp2_equals_dp1_and_learns(assets):
    params = write_train_params(assets / "p.yaml", train={"lr": 1e-3})
    torchrun(2, "stages.ref_logps", stage_args(assets, "--out", assets / "ref.parquet", params))
    ref_args = ["--ref-logps", str(assets / "ref.parquet")]
    for n in (1, 2):
        torchrun(n, "stages.train_dpo", stage_args(assets, "--out-dir", assets / f"dp{n}", params) + ref_args)
    assert_same_training(assets / "dp1", assets / "dp2")

    # Longer and hotter, so the tiny policy visibly learns the toy preference.
    hot = write_train_params(assets / "hot.yaml", train={"lr": 1e-2, "epochs": 4})
    torchrun(2, "stages.train_dpo", stage_args(assets, "--out-dir", assets / "hot", hot) + ref_args)
    step0 = assert_probe_rows(assets / "hot/probe_step0.jsonl", assets / "probe.parquet", DPO_KEYS)
    final = assert_probe_rows(assets / "hot/probe_final.jsonl", assets / "probe.parquet", DPO_KEYS)
    assert all(r["margin"] == 0.0 and r["correct"] == 0.5 for r in step0)   # policy == reference at step 0
    assert np.mean([r["correct"] for r in final]) > 0.8
    ref = read_parquet(assets / "ref.parquet").to_pandas().query("split == 'probe'")
    np.testing.assert_array_equal([r["ref_chosen_logp"] for r in final], ref.ref_chosen_logp)
    info = json.loads((assets / "hot/run_info.json").read_text())
    assert info["world_size"] == 2 and info["backend"] == "gloo" and len(info["per_rank"]) == 2
    assert info["total_tokens"] == sum(r["tokens"] for r in info["per_rank"]) == pd.read_csv(
        assets / "hot/train_log.csv").tokens.sum()
    # The hashed outputs hold results only; what varies run to run (timings, throughput, memory) is in perf.
    text = json.dumps(info) + (assets / "hot/train_log.csv").read_text() + (assets / "hot.log").read_text()
    assert "seconds" not in text and "tokens_per_s" not in text and "tok/s" not in text and "peak_memory" not in text
    assert not re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d", (assets / "hot.log").read_text())     # no timestamps
    perf = json.loads((assets / "hot.perf.json").read_text())
    assert perf["tokens_per_s"] > 0 and len(perf["peak_memory_bytes_per_rank"]) == 2 and perf["throughput_windows"]
    assert info["environment"]["cpu_numerics"]["portable"] is True
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(assets / "hot/model")


@pytest.mark.slow
def test_rm_under_torchrun_dp2_equals_dp1_and_fsdp2_and_learns(assets):
    params = write_train_params(assets / "p.yaml", train={"lr": 1e-3})
    fsdp = write_train_params(assets / "fsdp.yaml", train={"lr": 1e-3, "parallel": "fsdp2"})
    for n, p, name in ((1, params, "dp1"), (2, params, "dp2"), (2, fsdp, "fsdp2")):
        torchrun(n, "stages.train_rm", stage_args(assets, "--out-dir", assets / name, p))
    assert_same_training(assets / "dp1", assets / "dp2")
    assert_same_training(assets / "dp1", assets / "fsdp2")
    step0 = assert_probe_rows(assets / "dp2/probe_step0.jsonl", assets / "probe.parquet", RM_KEYS)
    final = assert_probe_rows(assets / "dp2/probe_final.jsonl", assets / "probe.parquet", RM_KEYS)
    assert np.mean([r["correct"] for r in final]) > np.mean([r["correct"] for r in step0]) + 0.2


# ----------------------------------------------------------------------------------------------
# precision bf16: bf16 weights for compute, fp32 masters in the optimizer
# ----------------------------------------------------------------------------------------------

def test_master_weights_keep_updates_that_pure_bf16_loses_and_round_trip_exactly():
    from stages.engine.optim import MasterWeightAdamW
    torch.manual_seed(0)
    fp32 = torch.nn.Linear(16, 16)
    pure, mixed = torch.nn.Linear(16, 16).to(torch.bfloat16), torch.nn.Linear(16, 16)
    pure.load_state_dict(fp32.state_dict())
    mixed.load_state_dict(fp32.state_dict())
    masters = {id(p): p.detach().clone() for p in mixed.parameters()}
    mixed.to(torch.bfloat16)
    opt_mixed = MasterWeightAdamW([{"params": list(mixed.parameters())}], masters, lr=1e-5)
    opt_pure = torch.optim.AdamW(pure.parameters(), lr=1e-5)
    start = [p.detach().clone() for p in pure.parameters()]
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    for _ in range(5):
        for model, opt in ((pure, opt_pure), (mixed, opt_mixed)):
            model(x).square().sum().backward()
            if isinstance(opt, MasterWeightAdamW):
                opt.grads_to_master()
            opt.step()
            opt.zero_grad()
    # 5 steps of 1e-5 are below bf16's resolution for most weights: pure bf16 barely moves, the masters do.
    unchanged = sum(int((p == s).sum()) for p, s in zip(pure.parameters(), start)) / sum(s.numel() for s in start)
    assert unchanged > 0.9
    moved = torch.cat([(m - masters[id(p)].float()).abs().flatten()
                       for p, m in zip(opt_mixed.model_params, opt_mixed.master_params)])
    assert (moved > 0).float().mean() > 0.9 and opt_mixed.master_params[0].dtype == torch.float32
    for p, m in zip(opt_mixed.model_params, opt_mixed.master_params):
        assert p.dtype == torch.bfloat16 and torch.equal(p, m.to(torch.bfloat16))
    # state_dict carries the masters: a fresh optimizer (from other values) is restored exactly.
    sd = opt_mixed.state_dict()
    other = torch.nn.Linear(16, 16).to(torch.bfloat16)
    restored = MasterWeightAdamW([{"params": list(other.parameters())}],
                                 {id(p): p.detach().float() for p in other.parameters()}, lr=1e-5)
    restored.load_state_dict(sd)
    for a, b in zip(restored.master_params, opt_mixed.master_params):
        assert torch.equal(a, b)
    for a, b in zip(other.parameters(), mixed.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="no fp32 master weights"):
        restored.load_state_dict(torch.optim.AdamW(other.parameters()).state_dict())


def test_dpo_in_bf16_precision_ties_at_step0_learns_and_exports_fp32_masters(assets):
    from safetensors.torch import load_file
    from stages import ref_logps, train_dpo
    params = write_train_params(assets / "p.yaml", train={"precision": "bf16", "epochs": 2})
    ref_logps.main(stage_args(assets, "--out", assets / "ref.parquet", params))
    out = assets / "dpo"
    train_dpo.main([*stage_args(assets, "--out-dir", out, params), "--ref-logps", str(assets / "ref.parquet")])
    step0 = read_jsonl(out / "probe_step0.jsonl")
    assert all(r["margin"] == 0.0 for r in step0)     # the bf16 reference pass equals the bf16 policy's step 0
    final = read_jsonl(out / "probe_final.jsonl")
    assert np.mean([r["correct"] for r in final]) > 0.5 and np.mean([r["margin"] for r in final]) > 0
    assert pd.read_csv(out / "train_log.csv").accuracy.iloc[-1] == 1.0
    weights = load_file(out / "model" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}
    # the export holds the fp32 masters, which bf16 cannot represent exactly
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in weights.values())


@pytest.mark.slow
def test_fsdp2_bf16_mixed_precision_trains_and_exports_fp32(assets):
    """precision bf16 under FSDP2: the fp32 shards are the masters, MixedPrecisionPolicy computes in bf16."""
    from safetensors.torch import load_file
    params = write_train_params(assets / "p.yaml", train={"precision": "bf16", "parallel": "fsdp2", "epochs": 1})
    torchrun(2, "stages.train_rm", stage_args(assets, "--out-dir", assets / "rm", params))
    info = json.loads((assets / "rm" / "run_info.json").read_text())
    assert info["world_size"] == 2 and info["settings"]["precision"] == "bf16"
    log = pd.read_csv(assets / "rm" / "train_log.csv")
    assert np.isfinite(log.loss).all() and log.loss.iloc[-1] < log.loss.iloc[0]
    weights = load_file(assets / "rm" / "model" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}


# ----------------------------------------------------------------------------------------------
# The CUDA-graph step's optimizer body (capture itself is tested on a GPU: tests/engine/test_gpu.py)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("adapter", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("master", [False, True])
def test_graph_optimizer_step_equals_the_eager_step(master, adapter):
    """graphed_optimizer_step (device-tensor learning rate, persistent zeroed gradients, the metric row) updates
    as the eager path's clip + AdamW(fused).step() + zero_grad, step after step, with a changing LR. With LoRA
    adapters (peft) over a frozen base (under precision bf16 the MasterWeightAdamW it runs): the same update, and
    the frozen weights get neither a gradient nor an update."""
    from stages.engine.dist import DistEnv
    from stages.engine.optim import MasterWeightAdamW, build_optimizer, total_grad_norm
    from stages.engine.steps import graphed_optimizer_step
    settings = train_settings(max_grad_norm=0.05, weight_decay=0.1, precision="bf16" if master else "autocast")
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    models, opts = [], []
    for _ in range(2):
        torch.manual_seed(0)                   # both copies start equal (the adapters' random lora_A too)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        if adapter:
            from peft import LoraConfig, get_peft_model
            m = get_peft_model(m, LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"]))
        masters = None
        if master:
            masters = {id(p): p.detach() for p in m.parameters()}
            m.to(torch.bfloat16)
        opt = build_optimizer(m, settings, env, masters)
        for g in opt.param_groups:
            g["fused"] = True                  # the CUDA configuration (fused AdamW runs on CPU too)
        models.append(m)
        opts.append(opt)
    assert isinstance(opts[1], MasterWeightAdamW) == master
    frozen = {n: p.detach().clone() for n, p in models[1].named_parameters() if not p.requires_grad}
    if adapter:
        assert frozen and sum(len(g["params"]) for g in opts[1].param_groups) == 4      # A and B of two layers
    else:
        assert not frozen
    dtype = torch.bfloat16 if master else torch.float32
    lrs = [torch.zeros((), dtype=torch.float32) for _ in opts[1].param_groups]
    sums, row = torch.zeros(2, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for step, lr in enumerate([1e-2, 5e-3, 2e-2]):
        x = torch.randn(5, 8, dtype=dtype)
        for k, (m, opt) in enumerate(zip(models, opts)):
            for g in opt.param_groups:
                g["lr"] = lr
            m(x).float().square().mean().backward()
            if k == 0:                         # the eager trainer's step
                if master:
                    opt.grads_to_master()
                norm = total_grad_norm(opt.master_params if master else m.parameters(), settings.max_grad_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                for t, g in zip(lrs, opt.param_groups):
                    t.fill_(g["lr"])
                sums += torch.tensor([1.0, 2.0 * step], dtype=torch.float64)
                graphed_optimizer_step(opt, m, settings, lrs, sums, row)
                assert row[:2].tolist() == [1.0, 2.0 * step] and sums.abs().sum() == 0
                assert float(row[2]) == pytest.approx(float(norm), rel=1e-6)
                assert all(p.grad is not None and p.grad.abs().sum() == 0 for p in m.parameters() if p.requires_grad)
        # Equal up to the learning rate's float32 rounding (a tensor lr is float32, a Python lr float64).
        for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8, msg=lambda m: f"{name}: {m}")
        sa, sb = opts[0].state_dict(), opts[1].state_dict()
        assert set(sa["state"]) == set(sb["state"])
        for i, st in sa["state"].items():
            for key in ("step", "exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(st[key], sb["state"][i][key], rtol=1e-6, atol=1e-9, msg=key)
    assert all(torch.equal(p, frozen[n]) and p.grad is None
               for n, p in models[1].named_parameters() if not p.requires_grad)
    if adapter:
        assert all(p.abs().sum() > 0 for n, p in models[1].named_parameters() if "lora_B" in n)  # B moved off 0


def test_split_measurements_moves_every_timing_out_of_the_facts():
    from stages.engine.loop import split_measurements
    facts, times = split_measurements({"enabled": True, "capture_seconds": 0.4, "shapes": [{"tokens": 8}],
                                       "shapes_captured": 2, "captures": 3, "replays": 140,
                                       "optimizer": {"kind": "flat_triton_adamw", "warmup_seconds": 0.01}})
    assert facts == {"enabled": True, "shapes": [{"tokens": 8}], "optimizer": {"kind": "flat_triton_adamw"}}
    assert times == {"capture_seconds": 0.4, "shapes_captured": 2, "captures": 3, "replays": 140,
                     "optimizer": {"warmup_seconds": 0.01}}
