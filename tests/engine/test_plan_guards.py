"""Guards that speak before the run (issue 29): a run in which no optimizer step would train is refused before any
weight is loaded, naming the counts; too few steps, or every step inside the warmup, is a warning in the stage log
and in the report's summary; a loss setting far from its paper's (SimPO's beta) is a hint in the log."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from engine_helpers import make_tiny_model_dir, toy_task_rows, train_settings, write_token_parquet
from stages.engine.guards import check_plan
from stages.engine.optim import LRSchedule
from stages.engine.packing import plan_training, planned_steps
from stages.engine.settings import TrainConfigError
from stages.evidence.bundle import render_summary
from stages.lib.training_plan import MIN_OPTIMIZER_STEPS

from conftest import REPO_ROOT as REPO


@pytest.mark.parametrize("n,epochs,batch", [(1, 1, 32), (6, 1, 32), (37, 2, 16), (64, 0.25, 16), (100, 1.5, 7),
                                            (5, 3, 1)])
def test_planned_steps_is_the_plans_length(n, epochs, batch):
    assert planned_steps(n, epochs, batch) == len(plan_training(
        np.full(n, 10), epochs=epochs, global_batch_pairs=batch, world_size=2, micro_batch_tokens=64, seed=1))


def test_a_plan_that_trains_nothing_is_refused_naming_the_counts():
    # the run: 6 train pairs in one batch of 32, one epoch: one step, inside the warmup, at lr 0
    with pytest.raises(TrainConfigError, match=r"no optimizer step would train: 6 train pairs x train.epochs 1 in "
                                               r"batches of train.global_batch_pairs 32 on world size 2 make 1 "
                                               r"optimizer step, and train.warmup_ratio 0.1 puts it at learning rate 0"):
        check_plan(6, train_settings(epochs=1, global_batch_pairs=32, warmup_ratio=0.1), world_size=2)
    with pytest.raises(TrainConfigError, match=r"no optimizer step would run: 0 train pairs .* make 0 steps"):
        check_plan(0, train_settings(epochs=1, global_batch_pairs=32), world_size=1)
    # the same single step without a warmup trains: allowed, with the warning
    (warning,) = check_plan(6, train_settings(epochs=1, global_batch_pairs=32, warmup_ratio=0.0), world_size=1)
    assert warning.startswith("only 1 optimizer step (6 train pairs x train.epochs 1 in batches of "
                              "train.global_batch_pairs 32 on world size 1) (fewer than 10)")


def test_doubtful_plans_are_warned_about():
    settings = train_settings(epochs=1, global_batch_pairs=2, warmup_ratio=0.1)
    (few,) = check_plan(6, settings, world_size=1)                               # 3 steps, the first in warmup
    assert few.startswith("only 3 optimizer steps") and "too few" in few
    everything_warm = train_settings(epochs=1, global_batch_pairs=2, warmup_ratio=1.0)
    (warm,) = check_plan(40, everything_warm, world_size=1)                      # 20 steps, all warming up
    assert warm == "every optimizer step is inside the learning-rate warmup (train.warmup_ratio 1 of 20 steps): " \
                   "the run never reaches train.lr"
    steps = 20
    assert LRSchedule(everything_warm, steps).lr(steps - 1) < everything_warm.lr      # what the warning says
    assert check_plan(64 * MIN_OPTIMIZER_STEPS, train_settings(epochs=1, global_batch_pairs=64, warmup_ratio=0.1),
                      world_size=1) == []


def _stage_inputs(tmp_path: Path, n_train: int, weights: bool = True, **dpo) -> list[str]:
    make_tiny_model_dir(tmp_path / "model")
    if not weights:
        (tmp_path / "model/model.safetensors").unlink()
    write_token_parquet(tmp_path / "train.parquet", toy_task_rows(n_train, seed=1))
    write_token_parquet(tmp_path / "probe.parquet", toy_task_rows(5, seed=2, prefix="q"))
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["train"].update({"gpus": 0, "epochs": 1, "global_batch_pairs": 16, "micro_batch_tokens": 160,
                            "inference_micro_batch_tokens": 160, "lr": 3e-3, "warmup_ratio": 0.1,
                            "logp_chunk_tokens": 32, "seed": 5})
    params["dpo"].pop("loss_weights", None)
    params["dpo"].update({"objective": "dpo_ref_free", "loss": "sigmoid", **dpo})
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(params))
    return ["--params", str(tmp_path / "p.yaml"), "--model-dir", str(tmp_path / "model"),
            "--train-tokens", str(tmp_path / "train.parquet"), "--probe-tokens", str(tmp_path / "probe.parquet"),
            "--out-dir", str(tmp_path / "out"), "--log", str(tmp_path / "stage.log")]


@pytest.mark.parametrize("stage", ["train_dpo", "train_rm"])
def test_the_stage_refuses_before_any_weight_is_loaded(tmp_path, capsys, stage):
    """6 pairs: one step at lr 0. The model directory has no weights at all: the refusal is the plan's, so it came
    before the load (which would have refused the missing weights)."""
    module = __import__(f"stages.{stage}", fromlist=["main"])
    with pytest.raises(SystemExit) as e:
        module.main(_stage_inputs(tmp_path, 6, weights=False))
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert (f"{stage}: refused: no optimizer step would train: 6 train pairs x train.epochs 1 in batches of "
            "train.global_batch_pairs 16 on world size 1 make 1 optimizer step") in err, err
    assert not (tmp_path / "out").exists()


def test_the_log_warns_and_hints_before_the_model_is_built(tmp_path):
    from stages import train_dpo
    train_dpo.main(_stage_inputs(tmp_path, 32, loss="simpo", beta=0.1))           # 2 steps, SimPO at DPO's beta
    lines = (tmp_path / "stage.log").read_text().splitlines()
    hint = next(i for i, line in enumerate(lines) if line.startswith("train_dpo WARNING hint: dpo.beta = 0.1 is far "
                                                                     "from what dpo.loss simpo is usually trained"))
    few = next(i for i, line in enumerate(lines) if line.startswith("trainer WARNING only 2 optimizer steps (32 train "
                                                                    "pairs x train.epochs 1"))
    built = next(i for i, line in enumerate(lines) if line.startswith("trainer INFO objective dpo_ref_free: 32 train"))
    assert hint < few < built, lines


def _log(steps: int, lr: float, warm: bool) -> dict[str, list[float]]:
    return {"step": [float(s) for s in range(1, steps + 1)],
            "lr": [lr * (s / steps if warm else 1.0) for s in range(steps)]}


def test_the_summary_carries_the_plan_warnings_and_nothing_when_the_plan_is_sound():
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    metrics = {k: {"step0": {"accuracy": 0.5, "ties": 0, "mean_margin": 0.0},
                   "final": {"accuracy": 0.6, "accuracy_ci_low": 0.5, "accuracy_ci_high": 0.7, "ties": 0,
                             "mean_margin": 0.1},
                   "improvement": {"accuracy": 0.1, "accuracy_ci_low": -0.1, "accuracy_ci_high": 0.2}}
               for k in ("dpo", "rm")}
    lr = params["train"]["lr"]
    plain = render_summary(metrics, None, [], params)
    assert render_summary(metrics, None, [], params, {"dpo": _log(40, lr, False), "rm": _log(12, lr, False)}) == plain
    assert "Warnings" not in plain
    text = render_summary(metrics, None, [], params, {"dpo": _log(1, lr, False), "rm": _log(20, lr, True)})
    assert "## Warnings\n\n- dpo: only 1 optimizer step (fewer than 10): too few" in text
    assert "- rm: every optimizer step is inside the learning-rate warmup (train.warmup_ratio 0.1 of 20 steps)" in text
    mean = {**metrics, "dpo": {**metrics["dpo"], "implicit_reward": "mean_logp"}}
    assert "Implicit reward scored, as dpo.loss declares it: dpo: mean_logp" in render_summary(mean, None, [], params)


def test_max_steps_cuts_the_plan_and_the_schedule_is_the_cut_runs(tmp_path):
    """Issue 37 item 3 (max_steps only): `train.max_steps: 3` on a run train.epochs would make 8 steps of: 3 optimizer
    steps, the first 3 of the uncapped plan, at the learning rates of a 3-step schedule (warmup and cosine decay to
    the end of the cut run, not of the 8 steps); recorded in run_info.json and said in the log."""
    import csv

    from stages import train_dpo
    from stages.engine.settings import TrainSettings
    from stages.lib.io import read_json

    args = _stage_inputs(tmp_path, 64)
    params = yaml.safe_load((tmp_path / "p.yaml").read_text())
    params["train"].update({"epochs": 2, "max_steps": 3, "warmup_ratio": 0.34})
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(params))
    train_dpo.main(args)

    info = read_json(tmp_path / "out/run_info.json")
    assert (info["optimizer_steps"], info["steps_uncapped"], info["settings"]["max_steps"]) == (3, 8, 3)
    with open(tmp_path / "out/train_log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    settings = TrainSettings.from_params(params)
    capped, full = LRSchedule(settings, 3), LRSchedule(settings, 8)
    assert [float(r["lr"]) for r in rows] == pytest.approx([capped.lr(k) for k in range(3)], rel=1e-6)
    assert [capped.lr(k) for k in range(3)] != pytest.approx([full.lr(k) for k in range(3)])
    assert "train.max_steps 3: 3 of the 8 optimizer steps train.epochs 2 make" in (tmp_path / "stage.log").read_text()
    summary = render_summary({}, None, [], params, records={"run_info": {"dpo": info}})
    assert "| 3 (train.max_steps: of 8) | 1 |" in summary, summary
    # The steps are the uncapped plan's first three (a cap never reshuffles).
    tokens = np.full(64, 10)
    kw = dict(epochs=2, global_batch_pairs=16, world_size=1, micro_batch_tokens=160, seed=5)
    assert plan_training(tokens, max_steps=3, **kw) == plan_training(tokens, **kw)[:3]
    assert planned_steps(64, 2, 16, max_steps=3) == 3 and planned_steps(64, 2, 16, max_steps=100) == 8


def test_max_steps_below_one_is_refused_naming_the_key(tmp_path, capsys):
    from stages import train_dpo

    args = _stage_inputs(tmp_path, 32, weights=False)
    params = yaml.safe_load((tmp_path / "p.yaml").read_text())
    params["train"]["max_steps"] = 0
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(SystemExit) as e:
        train_dpo.main(args)
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "train_dpo: refused:" in err and "train.max_steps" in err, err
