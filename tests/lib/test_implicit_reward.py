"""The probe's implicit reward is the loss's own (issue 29): a length-normalized loss (SimPO, ORPO, sigmoid_norm,
ipo_length_normalized) is scored on beta * the per-token mean log-prob ratio, in the train log, the probe rows,
evaluate and `report verify`, and the metrics record it; every other loss keeps the summed reward and its bytes.

The issue's symptom, reproduced on a real tiny model: when the chosen completions are much longer than the rejected
ones, summed log-probs rank every pair by length, so a SimPO run that learns the preference shows no change at
all on them; on the loss's own reward the probe accuracy moves where the loss moves.
"""
from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from engine_helpers import make_tiny_model_dir, token_row, write_token_parquet
from stages.evidence import scoring
from stages.lib.contracts import correct_label
from stages.lib.implicit_reward import MEAN_REWARD, SUMMED_REWARD, implicit_reward
from stages.lib.io import read_jsonl
from synthetic_probe import dpo_rows, make_probe

from conftest import REPO_ROOT as REPO
torch.set_num_threads(1)


def _params(**dpo) -> dict:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    if "loss" in dpo and "loss_weights" not in dpo:      # the default's weights belong to its own loss list
        params["dpo"].pop("loss_weights", None)
    params["dpo"].update(dpo)
    params["evaluate"]["bootstrap_replicates"] = 1000
    return params


def _as_mean_rows(rows: list[dict], token_rows: list[dict], beta: float) -> list[dict]:
    """dpo_rows' rows as a length-normalized loss's train_dpo writes them."""
    out = []
    for r, t in zip(copy.deepcopy(rows), token_rows):
        n_c, n_r = len(t["chosen_ids"]) - t["chosen_prompt_len"], len(t["rejected_ids"]) - t["rejected_prompt_len"]
        c = implicit_reward(MEAN_REWARD, beta, r["policy_chosen_logp"], r["ref_chosen_logp"], n_c)
        j = implicit_reward(MEAN_REWARD, beta, r["policy_rejected_logp"], r["ref_rejected_logp"], n_r)
        r.update(chosen_tokens=n_c, rejected_tokens=n_r, implicit_reward=MEAN_REWARD, chosen_reward=c,
                 rejected_reward=j, margin=c - j, correct=correct_label(c, j))
        out.append(r)
    return out


def test_mean_reward_rows_are_scored_on_their_reward_and_recorded():
    pm, tm, token_rows = make_probe(64, seed=5)
    params = _params(objective="dpo_ref_free", loss="simpo", beta=2.0)
    params["probe"]["size"] = 64
    s0, fi = (_as_mean_rows(dpo_rows(tm, 2.0, 3, 0.6, step0, True), token_rows, 2.0) for step0 in (True, False))
    counts = {t["pair_id"]: (len(t["chosen_ids"]) - t["chosen_prompt_len"],
                             len(t["rejected_ids"]) - t["rejected_prompt_len"]) for t in token_rows}
    metrics, summary = scoring.evaluate_model("dpo", s0, fi, pm, tm, params, "s0", "final", completion_tokens=counts)
    assert metrics["implicit_reward"] == MEAN_REWARD == summary["implicit_reward"]
    want = np.mean([r["correct"] for r in fi])
    assert metrics["final"]["accuracy"] == want
    # the summed rows of the same run: the metrics name the summed reward (every field written, whatever the loss)
    plain = [dpo_rows(tm, 2.0, 3, 0.6, step0, True) for step0 in (True, False)]
    assert scoring.evaluate_model("dpo", *plain, pm, tm, params, "s0", "final")[0]["implicit_reward"] == SUMMED_REWARD

    def refused(step0, final, match, **kw):
        with pytest.raises(scoring.PerPairFileError, match=match):
            scoring.evaluate_model("dpo", step0, final, pm, tm, params, "s0", "final", **kw)

    refused(plain[0], fi, "final: scores the mean_logp implicit reward, s0 the summed_logp: step 0 and final "
                          "must compare one")
    bad = copy.deepcopy(fi)
    bad[7]["chosen_tokens"] += 1                         # a count that is not the probe tokens'
    refused(s0, bad, r"final row 7 .*completion token counts .* are not the probe tokens'", completion_tokens=counts)
    refused(s0, bad, r"final row 7 .*rewards .* are not beta\*\(policy-ref\)/completion tokens")
    bad = copy.deepcopy(fi)
    del bad[3]["implicit_reward"]
    refused(s0, bad, "final row 3: implicit_reward summed_logp where row 0 has mean_logp")
    bad = copy.deepcopy(fi)
    bad[2]["rejected_tokens"] = 0
    refused(s0, bad, "final row 2: rejected_tokens must be a token count >= 1")


def _length_biased_rows(n: int, seed: int, prefix: str) -> list[dict]:
    """Chosen completions from the low half of the vocabulary and 5-7x longer than the rejected ones (the high
    half): summed log-probs rank every pair by length, per-token means by the preference."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        prompt = rng.integers(3, 128, rng.integers(2, 5)).tolist()
        chosen = rng.integers(3, 64, rng.integers(10, 15)).tolist()
        rejected = rng.integers(64, 128, 2).tolist()
        rows.append(token_row(f"{prefix}{i:04d}", prompt + chosen, len(prompt), prompt + rejected, len(prompt)))
    return rows


def test_simpo_probe_accuracy_moves_where_the_loss_moves(tmp_path):
    from stages import train_dpo
    make_tiny_model_dir(tmp_path / "model")
    write_token_parquet(tmp_path / "train.parquet", _length_biased_rows(64, seed=1, prefix="t"))
    probe_rows = _length_biased_rows(48, seed=2, prefix="q")
    write_token_parquet(tmp_path / "probe.parquet", probe_rows)
    params = _params(objective="dpo_ref_free", loss="simpo", beta=2.0, simpo_gamma=0.5)
    params["train"].update({"gpus": 0, "epochs": 2, "global_batch_pairs": 8, "micro_batch_tokens": 256,
                            "inference_micro_batch_tokens": 512, "lr": 1e-2, "warmup_ratio": 0.1,
                            "logp_chunk_tokens": 64, "seed": 5})
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(params))
    out = tmp_path / "dpo"
    train_dpo.main(["--params", str(tmp_path / "p.yaml"), "--model-dir", str(tmp_path / "model"),
                    "--train-tokens", str(tmp_path / "train.parquet"), "--probe-tokens", str(tmp_path / "probe.parquet"),
                    "--out-dir", str(out), "--log", str(tmp_path / "dpo.log")])

    log = pd.read_csv(out / "train_log.csv")
    assert len(log) == 16
    assert log.loss.tail(4).mean() < log.loss.head(4).mean() - 0.2              # the loss moved
    assert log.accuracy.tail(4).mean() > log.accuracy.head(4).mean() + 0.2      # and the train log's reward with it
    step0, final = read_jsonl(out / "probe_step0.jsonl"), read_jsonl(out / "probe_final.jsonl")
    for rows in (step0, final):
        assert {r["implicit_reward"] for r in rows} == {MEAN_REWARD}
        assert [(r["chosen_tokens"], r["rejected_tokens"]) for r in rows] == [
            (len(t["chosen_ids"]) - t["chosen_prompt_len"], len(t["rejected_ids"]) - t["rejected_prompt_len"])
            for t in probe_rows]
    acc0, acc1 = (np.mean([r["correct"] for r in rows]) for rows in (step0, final))
    assert acc1 >= acc0 + 0.3 and acc1 >= 0.9, (acc0, acc1)
    # what the summed reward (the old probe) showed for the same run: no change at all, every pair ranked by length
    summed = [[correct_label(r["policy_chosen_logp"], r["policy_rejected_logp"]) for r in rows] for rows in (step0, final)]
    assert summed[0] == summed[1] == [0.0] * len(probe_rows)

    # evaluate's scoring of the same files: the loss's reward, recorded, and an improvement whose interval is above 0
    ids = [t["pair_id"] for t in probe_rows]
    pm, tm = {"pair_ids": ids}, {"token_hashes": [t["token_hash"] for t in probe_rows]}
    params["probe"]["size"] = len(ids)
    metrics, _ = scoring.evaluate_model("dpo", step0, final, pm, tm, params, "step0", "final")
    assert metrics["implicit_reward"] == MEAN_REWARD and metrics["improvement"]["accuracy_ci_low"] > 0
    assert metrics["final"]["logp_accuracy"] == 0.0
