"""DVCLive and TensorBoard from the training loop (issue 37 item 4; stages/engine/live_log.py), through the stage CLI
as the rules run it (`--live-dir`): the files DVC reads (metrics.json, plots/metrics/*.tsv) with the step, loss,
accuracy, margin and the dev split's metrics, no timestamp; the same bytes on a second run and on a run resumed from a
checkpoint (over a killed run's leftovers); no DVC repository opened or made, nothing sent to Studio whatever its
token says; train.tensorboard refused without TensorBoard, naming the key, and its scalars written with it.
Real components: the tiny model and toy task of conftest.py's `assets`, the stage CLIs."""
from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pandas as pd
import pytest
import torch

from engine_helpers import token_row, toy_task_rows, write_token_parquet
from stage_helpers import checkpoint_at, ckpt_args, write_train_params

torch.set_num_threads(1)


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def with_dev(assets):
    rows = [token_row(r["pair_id"], r["rejected_ids"], r["rejected_prompt_len"], r["chosen_ids"],
                      r["chosen_prompt_len"]) for r in toy_task_rows(24, seed=3, prefix="d")]
    write_token_parquet(assets / "dev.parquet", rows)
    return assets


def live_args(a: Path, out: str, params: Path, **kw) -> list[str]:
    return ckpt_args(a, out, params, **kw) + ["--dev-tokens", str(a / "dev.parquet"),
                                              "--live-dir", str(a / out / "dvclive")]


def test_dvclive_files_hold_the_step_metrics_and_are_the_same_bytes_run_resumed_or_not(with_dev, monkeypatch):
    from stages import train_dpo
    a = with_dev
    # A DVC Studio token in the environment: a logger that would post to Studio fails here (nothing is reachable).
    monkeypatch.setenv("DVC_STUDIO_TOKEN", "isat_not_a_real_token")
    monkeypatch.setenv("DVC_STUDIO_URL", "http://127.0.0.1:9")
    import dvc_studio_client.post_live_metrics as studio
    monkeypatch.setattr(studio, "post_live_metrics", lambda *x, **k: pytest.fail("posted to DVC Studio"))
    # The run's working directory: a git checkout that is no DVC repository (dvclive's own Live() would `dvc init` it).
    work = a / "work"
    work.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    monkeypatch.chdir(work)
    params = write_train_params(a / "p.yaml", train={"eval_every": 3, "save_every": 2, "keep_checkpoints": 10},
                                dpo={"objective": "dpo_ref_free"})
    train_dpo.main(live_args(a, "full", params, ckpt=a / "ck"))
    assert not (work / ".dvc").exists() and not (a / ".dvc").exists()
    full = files(a / "full/dvclive")
    dev = ["dev/accuracy.tsv", "dev/margin.tsv", "dev/sigmoid_loss.tsv"]
    assert sorted(full) == sorted(["metrics.json", *(f"plots/metrics/{n}.tsv" for n in (
        "loss", "accuracy", "ties", "margin", "chosen_reward", "rejected_reward", "lr", "grad_norm")),
        *(f"plots/metrics/{d}" for d in dev)])
    summary = json.loads(full["metrics.json"])
    log = pd.read_csv(a / "full/train_log.csv")
    dev_log = pd.read_csv(a / "full/dev_log.csv")
    assert summary == {"step": 8, "loss": log.loss.iloc[-1], "accuracy": log.accuracy.iloc[-1],
                       "margin": log.margin.iloc[-1], "dev": {k: dev_log[k].iloc[-1] for k in
                                                             ("accuracy", "margin", "sigmoid_loss")}}
    assert list(summary) == sorted(summary)                         # keys sorted: the bytes do not hang on order
    loss = pd.read_csv(a / "full/dvclive/plots/metrics/loss.tsv", sep="\t")
    assert list(loss.columns) == ["step", "loss"]                    # no timestamp column
    pd.testing.assert_frame_equal(loss, log[["step", "loss"]], check_exact=True)
    dev_acc = pd.read_csv(a / "full/dvclive/plots/metrics/dev/accuracy.tsv", sep="\t")
    assert dev_acc.step.tolist() == [0, 3, 6, 8] and dev_acc.accuracy.tolist() == dev_log.accuracy.tolist()

    # Again: the same bytes. Resumed at step 4 into a folder a killed run left half written: the same bytes.
    train_dpo.main(live_args(a, "again", params, ckpt=a / "ck3"))
    assert files(a / "again/dvclive") == full
    stale = a / "resumed/dvclive/plots/metrics"
    stale.mkdir(parents=True)
    (stale / "loss.tsv").write_text("step\tloss\n1\t0.5\n2\t0.4\n")
    (stale.parent.parent / "metrics.json").write_text('{"step": 2}')
    train_dpo.main(live_args(a, "resumed", params, ckpt=a / "ck2", resume=checkpoint_at(a / "ck", 4)))
    assert files(a / "resumed/dvclive") == full
    assert not (a / "work/.dvc/tmp/exps/run/DVCLIVE_STEP_COMPLETED").exists()


def test_train_tensorboard_is_refused_without_tensorboard_naming_the_key(assets):
    from stages import train_rm
    from stage_helpers import stage_args
    try:
        import torch.utils.tensorboard  # noqa: F401
        pytest.skip("TensorBoard is installed here: the refusal cannot be shown")
    except ImportError:
        pass
    params = write_train_params(assets / "p.yaml", train={"tensorboard": True})
    with pytest.raises(SystemExit, match="train_rm: refused: train.tensorboard is true .*pip install tensorboard"):
        train_rm.main(stage_args(assets, "--out-dir", assets / "rm", params))
    assert not (assets / "rm/model").exists()                      # refused before anything was trained


def test_train_tensorboard_writes_the_same_scalars_to_the_tensorboard_dir(assets, monkeypatch):
    """TensorBoard is not in the lock: a stand-in SummaryWriter records what the loop hands it."""
    from stages import train_rm
    from stage_helpers import stage_args
    written: list[tuple] = []

    class Writer:
        def __init__(self, log_dir):
            written.append(("dir", log_dir))

        def add_scalar(self, tag, value, step):
            written.append((tag, value, step))

        def close(self):
            written.append(("closed",))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    tb = assets / "tb/train_rm"
    (tb / "old").mkdir(parents=True)                               # an earlier run's events: emptied first
    params = write_train_params(assets / "p.yaml", train={"tensorboard": True})
    info = train_rm.main(stage_args(assets, "--out-dir", assets / "rm", params) + ["--tensorboard-dir", str(tb)])
    assert "tensorboard" not in info["settings"]                   # no byte of the record hangs on it
    assert written[0] == ("dir", str(tb)) and written[-1] == ("closed",) and not (tb / "old").exists()
    log = pd.read_csv(assets / "rm/train_log.csv")
    assert [(s, v) for t, v, s in (w for w in written if w[0] == "train/loss")] == list(zip(log.step, log.loss))
    assert {w[0] for w in written if len(w) == 3} == {f"train/{n}" for n in (
        "loss", "accuracy", "ties", "margin", "chosen_score", "rejected_score", "lr", "grad_norm")}
