"""The dev split scored during training (issue 37 item 3): dev_log.csv rows at step 0, every train.eval_every steps
and the end; train.select_best exports the best dev step's weights (recorded in run_info) and the final probe scores
them; a resumed run's dev log and selection are the uninterrupted run's; DP=2 equals DP=1; refused without a dev
split. Real components: the tiny model and toy task of conftest.py's `assets`, the stage CLIs."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
import torch.distributed as dist

from engine_helpers import token_row, toy_task_rows, write_token_parquet
from stages.lib.io import read_json, read_jsonl
from stage_helpers import checkpoint_at, ckpt_args, stage_args, torchrun, write_train_params

torch.set_num_threads(1)


def dev_args(assets, out: str, params, **kw) -> list[str]:
    return ckpt_args(assets, out, params, **kw) + ["--dev-tokens", str(assets / "dev.parquet")]


@pytest.fixture
def with_dev(assets):
    """A dev split of 24 pairs, its preference reversed (chosen uses the high half of the vocabulary): the more the
    model learns the toy task, the worse it does on dev, so the best dev step is not the last."""
    rows = [token_row(r["pair_id"], r["rejected_ids"], r["rejected_prompt_len"], r["chosen_ids"],
                      r["chosen_prompt_len"]) for r in toy_task_rows(24, seed=3, prefix="d")]
    write_token_parquet(assets / "dev.parquet", rows)
    return assets


def test_eval_every_writes_dev_log_rows_at_the_expected_steps_and_changes_no_training_byte(with_dev):
    from stages import train_rm
    a = with_dev
    params = write_train_params(a / "p.yaml", train={"eval_every": 3})     # 8 steps: scored at 0, 3, 6 and 8
    info = train_rm.main(dev_args(a, "dev", params))
    log = pd.read_csv(a / "dev/dev_log.csv")
    assert list(log.columns) == ["step", "accuracy", "margin", "sigmoid_loss", "pairs"]
    assert log.step.tolist() == [0, 3, 6, 8] and (log.pairs == 24).all()
    assert info["dev"] == {"pairs": 24, "eval_every": 3, "scored_steps": [0, 3, 6, 8], "selected_step": None,
                           "selected_accuracy": None}             # no select_best: written, null
    assert info["settings"]["eval_every"] == 3
    assert log.accuracy.iloc[-1] < log.accuracy.iloc[0]          # the reversed dev preference: learning hurts it
    assert ((log.accuracy >= 0) & (log.accuracy <= 1) & (log.sigmoid_loss > 0)).all()
    # Scoring the dev split changes nothing of the training: the same weights, log and probe as a run without it.
    train_rm.main(ckpt_args(a, "plain", write_train_params(a / "plain.yaml")))
    for f in ("model/model.safetensors", "train_log.csv", "probe_step0.jsonl", "probe_final.jsonl"):
        assert (a / "dev" / f).read_bytes() == (a / "plain" / f).read_bytes(), f
    plain = read_json(a / "plain/run_info.json")
    assert not (a / "plain/dev_log.csv").exists() and plain["dev"] is None        # written, null: no dev split
    assert plain["settings"]["eval_every"] == 0 and plain["settings"]["select_best"] is False


def test_select_best_exports_the_best_dev_steps_checkpoint_and_scores_the_probe_on_it(with_dev):
    from safetensors.torch import load_file
    from stages import train_rm
    a = with_dev
    params = write_train_params(a / "p.yaml", train={"eval_every": 1, "select_best": True, "save_every": 1,
                                                     "keep_checkpoints": 100})
    info = train_rm.main(dev_args(a, "best", params, ckpt=a / "ck"))
    log = pd.read_csv(a / "best/dev_log.csv")
    assert log.step.tolist() == list(range(9))
    scored = log[log.step >= 1]
    best = int(scored.step.iloc[int(np.argmax(scored.accuracy.to_numpy()))])     # argmax: the earliest of ties
    assert info["dev"]["selected_step"] == best < 8
    assert info["dev"]["selected_accuracy"] == scored.accuracy.max()
    exported = load_file(a / "best/model/model.safetensors")
    saved = torch.load(checkpoint_at(a / "ck", best) / "model.pt", weights_only=True)
    by_name = {k.split(".", 1)[1]: v for k, v in saved.items()}          # the objective's module wraps the HF model
    assert set(exported) <= set(by_name)
    for k, v in exported.items():
        assert torch.equal(v, by_name[k]), k
    # The final probe scores the exported model: it differs from the last step's, which a plain run exports.
    train_rm.main(ckpt_args(a, "last", write_train_params(a / "last.yaml")))
    assert (a / "best/probe_final.jsonl").read_bytes() != (a / "last/probe_final.jsonl").read_bytes()
    assert (a / "best/probe_step0.jsonl").read_bytes() == (a / "last/probe_step0.jsonl").read_bytes()
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(a / "best/model").eval()
    row = read_jsonl(a / "best/probe_final.jsonl")[0]
    probe = pd.read_parquet(a / "probe.parquet").iloc[0]
    with torch.no_grad():
        score = float(model(input_ids=torch.tensor([list(probe.chosen_ids)])).logits[0, 0])
    assert score == pytest.approx(row["chosen_score"], abs=1e-5)


def test_a_resumed_run_has_the_uninterrupted_runs_dev_log_and_selection(with_dev):
    from stages import train_dpo
    a = with_dev
    params = write_train_params(a / "p.yaml", train={"eval_every": 2, "select_best": True, "save_every": 2,
                                                     "keep_checkpoints": 10},
                                dpo={"objective": "dpo_ref_free"})
    full = train_dpo.main(dev_args(a, "full", params, ckpt=a / "ck"))
    resumed = train_dpo.main(dev_args(a, "resumed", params, ckpt=a / "ck2", resume=checkpoint_at(a / "ck", 4)))
    assert resumed["perf"]["resumed_from_step"] == 4
    assert resumed["dev"] == full["dev"] and full["dev"]["scored_steps"] == [0, 2, 4, 6, 8]
    for f in ("dev_log.csv", "train_log.csv", "model/model.safetensors", "probe_final.jsonl"):
        assert (a / "full" / f).read_bytes() == (a / "resumed" / f).read_bytes(), f


def test_eval_every_or_select_best_without_a_dev_split_is_refused(assets):
    from stages import train_rm
    for train in ({"eval_every": 2}, {"select_best": True}):
        with pytest.raises(SystemExit, match="train_rm: refused: .*set probe.dev_size > 0") as e:
            train_rm.main(stage_args(assets, "--out-dir", assets / "out", write_train_params(assets / "p.yaml", train)))
        assert e.value.code == 1 and not dist.is_initialized() and not (assets / "out").exists()


@pytest.mark.slow
def test_dev_scoring_and_selection_under_torchrun_dp2_equal_dp1(with_dev):
    a = with_dev
    params = write_train_params(a / "p.yaml", train={"eval_every": 2, "select_best": True})
    for n in (1, 2):
        torchrun(n, "stages.train_rm", dev_args(a, f"dp{n}", params))
    l1, l2 = pd.read_csv(a / "dp1/dev_log.csv"), pd.read_csv(a / "dp2/dev_log.csv")
    assert l1.step.tolist() == l2.step.tolist() == [0, 2, 4, 6, 8]
    np.testing.assert_allclose(l1[["accuracy", "margin", "sigmoid_loss"]], l2[["accuracy", "margin", "sigmoid_loss"]],
                               rtol=0, atol=1e-5)
    i1, i2 = read_json(a / "dp1/run_info.json"), read_json(a / "dp2/run_info.json")
    assert i1["dev"]["selected_step"] == i2["dev"]["selected_step"]
    f1, f2 = read_jsonl(a / "dp1/probe_final.jsonl"), read_jsonl(a / "dp2/probe_final.jsonl")
    np.testing.assert_allclose([r["margin"] for r in f1], [r["margin"] for r in f2], rtol=0, atol=1e-5)
    assert json.dumps(i2["dev"])
