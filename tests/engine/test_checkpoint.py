"""Checkpoints, resume and fault tolerance: atomic saves, exact resume after a real SIGKILL (torchrun,
DP=1 and DP=2, also mid-save), every refusal, and the reward-model export round trip."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.distributed as dist

from conftest import REPO_ROOT as REPO
from engine_helpers import make_tiny_model_dir, toy_task_rows, write_token_parquet
from stages.engine.checkpoint import META, TEST_HOOK_ENV, CheckpointError, list_checkpoints
from stages.lib.io import read_json, read_jsonl
from stage_helpers import assert_identical_runs, checkpoint_at, ckpt_args, stage_args, write_train_params

torch.set_num_threads(1)

# 64 train pairs, 16 per step, 2 epochs: 8 optimizer steps; checkpoints after steps 2, 4, 6, 8.
SAVE_EVERY = 2


# ----------------------------------------------------------------------------------------------
# In-process (one-process group): saving, exact resume, refusals
# ----------------------------------------------------------------------------------------------

def test_checkpoints_are_complete_self_describing_and_pruned(assets):
    from stages import train_rm
    params = write_train_params(assets / "p.yaml", train={"save_every": 3})
    info = train_rm.main(ckpt_args(assets, "rm", params, assets / "ck"))
    assert info["perf"]["checkpoints_saved"] == [3, 6, 8] and info["perf"]["resumed_from_step"] is None   # the last step too
    complete, incomplete = list_checkpoints(assets / "ck")
    assert [s for s, _, _ in complete] == [8, 6] and incomplete == []       # train.keep_checkpoints = 2
    step, path, meta = complete[0]
    assert (meta["objective"], meta["role"], meta["head"]) == ("reward_model", "reward_model", "score")
    assert meta["model_class"] == "Qwen2ForSequenceClassification" and meta["world_size"] == 1
    assert meta["format"] == "prefpipe-checkpoint/3" and meta["step"] == 8 and meta["reference"]["kind"] == "model_dir"
    assert path.name == f"step_00000008-{meta['fingerprint'][:12]}"
    assert set(meta["files"]) == {"model.pt", "optimizer.pt", "trainer_state.json",
                                  "probe_step0.jsonl", "rng/rank00000.pt"}
    state = json.loads((path / "trainer_state.json").read_text())
    assert [r["step"] for r in state["log_rows"]] == list(range(1, 9))
    assert state["log_rows"] == pd.read_csv(assets / "rm/train_log.csv").to_dict("records")


def test_resume_from_a_checkpoint_reproduces_the_uninterrupted_run_bitwise(assets):
    from stages import train_dpo
    params = write_train_params(assets / "p.yaml", train={"save_every": SAVE_EVERY}, dpo={"objective": "dpo_ref_free"})
    train_dpo.main(ckpt_args(assets, "full", params, assets / "ck"))
    step6 = checkpoint_at(assets / "ck", 6)
    info = train_dpo.main(ckpt_args(assets, "resumed", params, assets / "ck2", resume=step6))
    assert info["perf"]["resumed_from_step"] == 6 and info["perf"]["checkpoints_saved"] == [8]
    assert_identical_runs(assets / "full", assets / "resumed", same_record=True)
    # auto picks the newest complete checkpoint of this run (step 8): nothing left to train.
    info = train_dpo.main(ckpt_args(assets, "again", params, assets / "ck"))
    assert info["perf"]["resumed_from_step"] == 8 and info["perf"]["checkpoints_saved"] == []
    assert_identical_runs(assets / "full", assets / "again", same_record=True)


@pytest.fixture
def trained(assets):
    """One finished RM run and one reference-free DPO run, each with checkpoints at steps 2 and 4."""
    from stages import train_dpo, train_rm
    params = write_train_params(assets / "p.yaml", train={"save_every": SAVE_EVERY, "epochs": 1},
                          dpo={"objective": "dpo_ref_free"})
    train_rm.main(ckpt_args(assets, "rm", params, assets / "ck_rm"))
    train_dpo.main(ckpt_args(assets, "dpo", params, assets / "ck_dpo"))
    return assets, params


def refused(stage: str, args: list[str], match: str) -> str:
    import importlib
    main = importlib.import_module(f"stages.{stage}").main
    with pytest.raises(SystemExit, match=match) as e:       # the stage-CLI refusal: one line, exit 1
        main(args)
    assert not dist.is_initialized()
    assert e.value.code == 1 and str(e.value).startswith(f"{stage}: refused: ")
    assert isinstance(e.value.__cause__, CheckpointError)
    return str(e.value.__cause__)


def copy_checkpoint(src: Path, dst: Path, **meta_changes) -> Path:
    shutil.copytree(src, dst)
    if meta_changes:
        meta = read_json(dst / META)
        meta.update(meta_changes)
        (dst / META).write_text(json.dumps(meta))
    return dst


def test_objective_role_and_head_mismatches_are_refused_both_ways(trained):
    a, params = trained
    rm_ckpt, dpo_ckpt = checkpoint_at(a / "ck_rm", 4), checkpoint_at(a / "ck_dpo", 4)
    msg = refused("train_dpo", ckpt_args(a, "x", params, a / "ck_x", resume=rm_ckpt), "objective mismatch")
    assert "checkpoint trains reward_model (role reward_model, head score)" in msg and "dpo_ref_free" in msg
    msg = refused("train_rm", ckpt_args(a, "x", params, a / "ck_x", resume=dpo_ckpt), "objective mismatch")
    assert "checkpoint trains dpo_ref_free (role policy, head lm_head)" in msg and "score" in msg
    critic = copy_checkpoint(rm_ckpt, a / "critic", objective="value_model", role="critic", head="value_head")
    refused("train_rm", ckpt_args(a, "x", params, resume=critic), r"trains value_model \(role critic, head value_head\)")
    plain_lm = copy_checkpoint(rm_ckpt, a / "plain", objective="causal_lm", role="policy", head="lm_head")
    refused("train_rm", ckpt_args(a, "x", params, resume=plain_lm), r"trains causal_lm \(role policy, head lm_head\)")
    assert not (a / "x" / "probe_step0.jsonl").exists()          # refused before any work


def test_partial_corrupted_and_incomplete_checkpoints_are_refused(trained):
    a, params = trained
    good = checkpoint_at(a / "ck_rm", 4)
    no_optim = copy_checkpoint(good, a / "no_optim")
    (no_optim / "optimizer.pt").unlink()
    refused("train_rm", ckpt_args(a, "x", params, resume=no_optim), "partial checkpoint: optimizer state optimizer.pt")
    meta = read_json(good / META)
    parts = {k: v for k, v in meta["parts"].items() if k != "trainer_state"}
    no_state = copy_checkpoint(good, a / "no_state", parts=parts)
    refused("train_rm", ckpt_args(a, "x", params, resume=no_state), "partial checkpoint: no trainer_state state")
    no_rng = copy_checkpoint(good, a / "no_rng")
    (no_rng / "rng/rank00000.pt").unlink()
    refused("train_rm", ckpt_args(a, "x", params, resume=no_rng), "partial checkpoint: rng state rng/rank00000.pt")

    corrupt = copy_checkpoint(good, a / "corrupt")
    blob = bytearray((corrupt / "model.pt").read_bytes())
    blob[len(blob) // 2] ^= 0x01                                     # one flipped bit in the weights
    (corrupt / "model.pt").write_bytes(bytes(blob))
    refused("train_rm", ckpt_args(a, "x", params, resume=corrupt), "corrupted checkpoint: model.pt")
    # (under --resume auto a damaged checkpoint is skipped, saying so: test_auto_resume_falls_back_past_...)
    garbled = copy_checkpoint(good, a / "garbled")
    (garbled / META).write_text("{not json")
    refused("train_rm", ckpt_args(a, "x", params, resume=garbled), f"unreadable {META} .*: the checkpoint is damaged")

    interrupted = copy_checkpoint(good, a / ".tmp-step_00000004-x")
    refused("train_rm", ckpt_args(a, "x", params, resume=interrupted), "incomplete checkpoint")
    no_meta = copy_checkpoint(good, a / "no_meta")
    (no_meta / META).unlink()
    refused("train_rm", ckpt_args(a, "x", params, resume=no_meta), "incomplete checkpoint")


def flip_byte(path: Path) -> None:
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    path.write_bytes(bytes(blob))


def test_auto_resume_falls_back_past_a_damaged_newest_checkpoint(trained):
    """One flipped byte in the newest checkpoint of this run: --resume auto names it and why, resumes from the newest
    good one and ends as the uninterrupted run did, bitwise. With every checkpoint damaged (an unreadable meta.json,
    a truncated optimizer state) it starts fresh, saying so, and still ends the same. (--resume PATH of a damaged
    checkpoint is refused: test_partial_corrupted_and_incomplete_checkpoints_are_refused.)"""
    from stages import train_rm
    a, params = trained
    ck = a / "ck_fallback"
    shutil.copytree(a / "ck_rm", ck)
    step2, step4 = checkpoint_at(ck, 2), checkpoint_at(ck, 4)
    flip_byte(step4 / "model.pt")
    info = train_rm.main(ckpt_args(a, "fallback", params, ck))
    assert info["perf"]["resumed_from_step"] == 2 and info["perf"]["checkpoints_saved"] == [4]
    logged = (a / "fallback.log").read_text()
    assert (f"not resuming from {step4}: {step4}: corrupted checkpoint: model.pt has sha256" in logged
            and "trying the next older checkpoint of this run" in logged), logged
    assert (f"resuming from {step2} (step 2), the newest good checkpoint of this run; skipped as damaged: "
            f"{step4.name}") in logged, logged
    assert_identical_runs(a / "rm", a / "fallback", same_record=True)

    # The rerun replaced the damaged step 4 with its own; now damage both.
    (checkpoint_at(ck, 4) / META).write_text('{"step": 4, "fingerp')
    optimizer = step2 / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    info = train_rm.main(ckpt_args(a, "fresh", params, ck))
    assert info["perf"]["resumed_from_step"] is None and info["perf"]["checkpoints_saved"] == [2, 4]
    logged = (a / "fresh.log").read_text()
    assert f"ignoring checkpoint {step4}: its {META} is unreadable (damaged)" in logged, logged
    assert f"not resuming from {step2}: {step2}: corrupted checkpoint: optimizer.pt" in logged, logged
    assert (f"no good checkpoint of this run in {ck} (damaged: {step4.name}, {step2.name}): starting fresh"
            in logged), logged
    assert_identical_runs(a / "rm", a / "fresh", same_record=True)


def test_different_data_probe_reference_params_or_world_size_are_refused(trained):
    a, params = trained
    good = checkpoint_at(a / "ck_rm", 4)
    other = a / "other"
    other.mkdir()
    rows = toy_task_rows(64, seed=1)
    rows[5] = toy_task_rows(1, seed=99, prefix="z")[0]
    write_token_parquet(other / "train.parquet", rows)
    write_token_parquet(other / "probe.parquet", toy_task_rows(37, seed=3, prefix="q"))
    make_tiny_model_dir(other / "model", seed=1)                    # same shape, other weights

    base = ckpt_args(a, "x", params, resume=good)

    def swap(flag: str, path: Path) -> list[str]:
        i = base.index(flag)
        return base[:i + 1] + [str(path)] + base[i + 2:]

    refused("train_rm", swap("--train-tokens", other / "train.parquet"), r"train data \(train tokens\) differ")
    refused("train_rm", swap("--probe-tokens", other / "probe.parquet"), r"probe \(probe tokens\) differ")
    refused("train_rm", swap("--model-dir", other / "model"), "reference differs")
    hot = write_train_params(a / "hot.yaml", train={"save_every": SAVE_EVERY, "epochs": 1, "lr": 1e-2})
    refused("train_rm", ckpt_args(a, "x", hot, resume=good), "train settings differ: lr: 0.003 -> 0.01")
    centered = write_train_params(a / "c.yaml", train={"save_every": SAVE_EVERY, "epochs": 1},
                            rm={"center_rewards_coefficient": 0.1})
    refused("train_rm", ckpt_args(a, "x", centered, resume=good), "objective params differ: center_rewards")
    wide = copy_checkpoint(good, a / "wide", world_size=2)
    refused("train_rm", ckpt_args(a, "x", params, resume=wide), "world size 2 != this run's 1")


def test_auto_resume_skips_other_runs_checkpoints_with_a_warning(trained):
    """A rerun with new params must start fresh, not load the old run's state; the old ones stay."""
    from stages import train_rm
    a, _ = trained
    hot = write_train_params(a / "hot.yaml", train={"save_every": SAVE_EVERY, "epochs": 1, "lr": 1e-2})
    old = sorted(p.name for p in (a / "ck_rm").iterdir())
    info = train_rm.main(ckpt_args(a, "hot", hot, a / "ck_rm"))
    assert info["perf"]["resumed_from_step"] is None and info["perf"]["checkpoints_saved"] == [2, 4]
    logged = (a / "hot.log").read_text()
    assert "not resuming from" in logged and "train settings differ: lr: 0.003 -> 0.01" in logged
    now = sorted(p.name for p in (a / "ck_rm").iterdir())
    assert set(old) < set(now) and len(now) == 4                   # the other run's pair is left alone
    never = train_rm.main(ckpt_args(a, "never", hot, a / "ck_rm", resume="never"))
    assert never["perf"]["resumed_from_step"] is None


def test_save_every_without_a_checkpoint_dir_is_refused(assets):
    from stages import train_rm
    from stages.engine.settings import TrainConfigError
    params = write_train_params(assets / "p.yaml", train={"save_every": 2})
    with pytest.raises(SystemExit, match="train_rm: refused: .*needs a checkpoint directory") as e:
        train_rm.main(ckpt_args(assets, "x", params))
    assert not dist.is_initialized()
    assert e.value.code == 1 and isinstance(e.value.__cause__, TrainConfigError)


# ----------------------------------------------------------------------------------------------
# Export: a reward model is a sequence-classification model with its scalar head, never a causal LM
# ----------------------------------------------------------------------------------------------

def test_rm_export_loads_back_with_identical_scores_and_the_head_guard(assets):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from stages import train_rm
    from stages.engine.modeling import ModelLoadError, SequenceRewards, load_causal_lm, load_reward_model
    from stages.engine.packing import load_token_pairs
    import yaml
    from stages.engine.data import run_inference
    from stages.engine.dist import DistEnv
    from stages.engine.export import ExportError, check_export_head
    from stages.engine.settings import TrainSettings
    params = write_train_params(assets / "p.yaml", train={"epochs": 1})
    train_rm.main(ckpt_args(assets, "rm", params))
    final = read_jsonl(assets / "rm/probe_final.jsonl")
    want = np.array([[r["chosen_score"], r["rejected_score"]] for r in final])

    exported = AutoModelForSequenceClassification.from_pretrained(assets / "rm/model", dtype=torch.float32)
    assert type(exported).__name__ == "Qwen2ForSequenceClassification" and exported.score.out_features == 1
    # The trained packed path over the reloaded export: the same scores to fp32 precision (rtol/atol 1e-6,
    # atol scaled to the scores' magnitude). Not bitwise: issue 16's fresh install differed by 1.5e-8, and
    # fp32 agreement is what the export promises.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo",
                      control_group=dist.group.WORLD)
        reloaded = load_reward_model(assets / "rm/model")
        probe = load_token_pairs(assets / "probe.parquet").with_score_positions(reloaded.config.pad_token_id)
        got = run_inference(SequenceRewards(reloaded), probe, env,
                            TrainSettings.from_params(yaml.safe_load(params.read_text())))
    finally:
        dist.destroy_process_group()
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * scale)
    # HF's own forward (its attention kernel, its last-token pooling) agrees to float precision.
    with torch.no_grad():
        for i, k in enumerate(probe.seq_ids[:10]):
            score = float(exported(input_ids=torch.as_tensor(k)[None]).logits[0, 0])
            assert score == pytest.approx(want[i // 2, i % 2], abs=1e-5)

    # Never a causal-LM export that drops the head: the guard refuses it, the loader refuses the reverse.
    lm = AutoModelForCausalLM.from_pretrained(assets / "model")
    with pytest.raises(ExportError, match="refusing to export a reward model as Qwen2ForCausalLM"):
        check_export_head(lm, "score")
    with pytest.raises(ExportError, match="refusing to export a policy as Qwen2ForSequenceClassification"):
        check_export_head(exported, "lm_head")
    check_export_head(exported, "score")
    check_export_head(lm, "lm_head")
    with pytest.raises(ModelLoadError, match="classification head"):
        load_causal_lm(assets / "rm/model")


# ----------------------------------------------------------------------------------------------
# Real torchrun: SIGKILL the process group after a checkpoint and during one, resume, compare
# ----------------------------------------------------------------------------------------------

def launch(nproc: int, module: str, args: list[str], hook: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", module, "--", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop(TEST_HOOK_ENV, None)
    if hook:
        env[TEST_HOOK_ENV] = hook
    err = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True,
                            start_new_session=True)
    proc.err = err
    return proc


def stderr_of(proc: subprocess.Popen) -> str:
    proc.err.seek(0)
    return proc.err.read()


def descendants(pid: int) -> list[int]:
    out = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            kids = [int(k) for k in children.read_text().split()]
        except OSError:
            continue
        for kid in kids:
            out += [kid, *descendants(kid)]
    return out


def kill_run(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every worker, as a preemption would. By pid: torchrun starts each worker
    in a session of its own, so killing the launcher's process group alone would orphan them."""
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def finish(proc: subprocess.Popen, timeout: int = 240) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_run(proc)
        proc.wait()
        pytest.fail(f"torchrun timed out:\n{stderr_of(proc)[-4000:]}")
    err = stderr_of(proc)
    assert proc.returncode == 0, err[-4000:]
    return err


def kill_when(proc: subprocess.Popen, ready, timeout: int = 240) -> None:
    """SIGKILL torchrun and all its workers at once when `ready()` holds (stderr goes to a file, so a
    chatty run never blocks on a full pipe while we poll)."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"run ended (rc {proc.returncode}) before the kill point:\n{stderr_of(proc)[-4000:]}")
        if time.monotonic() > deadline:
            kill_run(proc)
            pytest.fail("kill point never reached")
        time.sleep(0.05)
    kill_run(proc)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


def complete_steps(directory: Path) -> list[int]:
    return sorted(s for s, _, _ in list_checkpoints(directory)[0])


def interrupted_saves(directory: Path, step: int | None = None) -> list[Path]:
    pattern = ".tmp-step_*" if step is None else f".tmp-step_{step:08d}-*"
    return [p for p in directory.glob(pattern) if (p / META).is_file()] if directory.is_dir() else []


@pytest.mark.slow
def test_sigkill_after_a_checkpoint_then_resume_equals_uninterrupted_dp1(assets):
    params = write_train_params(assets / "p.yaml", train={"save_every": SAVE_EVERY})
    finish(launch(1, "stages.train_rm", ckpt_args(assets, "full", params, assets / "ck_full")))
    ck = assets / "ck"
    proc = launch(1, "stages.train_rm", ckpt_args(assets, "run", params, ck), hook="after_save:4")
    kill_when(proc, lambda: 4 in complete_steps(ck))
    assert complete_steps(ck) == [2, 4] and not (assets / "run/probe_final.jsonl").exists()
    err = finish(launch(1, "stages.train_rm", ckpt_args(assets, "run", params, ck)))
    assert "resuming from" in err and "4 of 8 optimizer steps done" in err
    assert read_json(assets / "run.perf.json")["resumed_from_step"] == 4
    assert_identical_runs(assets / "full", assets / "run", same_record=True)


@pytest.mark.slow
def test_sigkill_after_and_during_checkpoint_saves_then_resume_equals_uninterrupted_dp2(assets):
    from stages import ref_logps, train_dpo
    params = write_train_params(assets / "p.yaml", train={"save_every": SAVE_EVERY})
    ref_logps.main(stage_args(assets, "--out", assets / "ref.parquet", params))
    ref = ["--ref-logps", str(assets / "ref.parquet")]
    finish(launch(2, "stages.train_dpo", ckpt_args(assets, "full", params, assets / "ck_full", extra=ref)))

    ck = assets / "ck"
    run = ckpt_args(assets, "run", params, ck, extra=ref)
    kill_when(launch(2, "stages.train_dpo", run, hook="after_save:2"), lambda: 2 in complete_steps(ck))
    # Resume, then die DURING the save of step 6: its files and meta.json are written, the rename is not.
    # Wait for step 6's own temp directory: step 4's exists with its meta.json for a moment before its rename.
    kill_when(launch(2, "stages.train_dpo", run, hook="before_rename:6"), lambda: interrupted_saves(ck, 6))
    assert complete_steps(ck) == [2, 4] and len(interrupted_saves(ck)) == 1
    err = finish(launch(2, "stages.train_dpo", run))
    assert "ignoring incomplete checkpoint" in err and "4 of 8 optimizer steps done" in err
    assert read_json(assets / "run.perf.json")["resumed_from_step"] == 4
    assert_identical_runs(assets / "full", assets / "run", same_record=True)
    assert complete_steps(ck) == [6, 8] and not interrupted_saves(ck)

    # A DP=2 checkpoint under one process is refused, naming the world sizes.
    with pytest.raises(SystemExit, match="world size 2 != this run's 1") as e:
        train_dpo.main(ckpt_args(assets, "dp1", params, resume=checkpoint_at(ck, 8), extra=ref))
    assert e.value.code == 1 and isinstance(e.value.__cause__, CheckpointError)


@pytest.mark.slow
def test_fsdp2_dcp_checkpoint_resume_equals_uninterrupted(assets):
    params = write_train_params(assets / "p.yaml", train={"save_every": SAVE_EVERY, "parallel": "fsdp2"})
    finish(launch(2, "stages.train_rm", ckpt_args(assets, "full", params, assets / "ck_full")))
    ck = assets / "ck"
    proc = launch(2, "stages.train_rm", ckpt_args(assets, "run", params, ck), hook="after_save:4")
    kill_when(proc, lambda: 4 in complete_steps(ck))
    meta = read_json(checkpoint_at(ck, 4) / META)
    assert meta["parts"]["model"] == "model/" and any(f.endswith(".distcp") for f in meta["files"])
    finish(launch(2, "stages.train_rm", ckpt_args(assets, "run", params, ck)))
    assert read_json(assets / "run.perf.json")["resumed_from_step"] == 4
    assert_identical_runs(assets / "full", assets / "run", same_record=True)
