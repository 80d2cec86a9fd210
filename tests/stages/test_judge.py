"""The judge stage: the win-rate bootstrap and the length view against independent implementations, the stage
on a real tiny workspace (an empty completion is judged, not a crash), and its refusals."""
from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pytest
import scipy.stats
import yaml

from generation_helpers import generate_args, judge_args, make_judge, make_workspace, read_jsonl
from stages import generate, judge
from stages.lib.contracts import GENERATIONS_SCHEMA, correct_label
from stages.lib.io import read_parquet, write_parquet
from stages.evidence.scoring import PerPairFileError, evaluate_generation

PARAMS = {"evaluate": {"bootstrap_replicates": 2000, "seed": 7, "confidence": 0.95}}


def synthetic_rows(n_prompts: int, samples: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n_prompts):
        for s in range(samples):
            pl, rl = int(rng.integers(0, 30)), int(rng.integers(0, 30))
            rp = round(float(rng.normal(0.1 + 0.02 * (pl - rl), 1)), 1)
            rr = round(float(rng.normal(0, 1)), 1)
            if (i * samples + s) % 7 == 0:
                rp = rr                                # and some ties for certain
            rows.append({"pair_id": f"{i:024x}", "index": i, "sample": s, "policy_reward": rp,
                         "reference_reward": rr, "win": correct_label(rp, rr), "policy_length": pl,
                         "reference_length": rl, "policy_log_ratio": float(rng.normal(2, 1)),
                         "policy_generated_tokens": pl + 1})
    return rows


def percentile_ci(dist: np.ndarray, confidence: float) -> tuple[float, float]:
    alpha = (1 - confidence) / 2
    return float(np.percentile(dist, 100 * alpha)), float(np.percentile(dist, 100 * (1 - alpha)))


@pytest.mark.parametrize("samples", [1, 3])
def test_win_rate_and_reward_diff_bootstrap_match_scipy_and_a_plain_loop(samples):
    rows = synthetic_rows(40, samples)
    metrics, summary = evaluate_generation(rows, PARAMS, "synthetic")
    ev = PARAMS["evaluate"]
    win = np.array([r["win"] for r in rows]).reshape(40, samples).mean(axis=1)
    diff = np.array([r["policy_reward"] - r["reference_reward"] for r in rows]).reshape(40, samples).mean(axis=1)
    assert metrics["ties"] == sum(r["win"] == 0.5 for r in rows) > 0
    # scipy's percentile bootstrap over prompts, with the same seeded Generator
    for name, values in (("win_rate", win), ("reward_diff", diff)):
        ref = scipy.stats.bootstrap((values,), np.mean, vectorized=True, method="percentile",
                                    n_resamples=ev["bootstrap_replicates"], confidence_level=ev["confidence"],
                                    random_state=np.random.Generator(np.random.PCG64(ev["seed"])))
        assert abs(metrics[f"{name}_ci_low"] - ref.confidence_interval.low) <= 1e-12, name
        assert abs(metrics[f"{name}_ci_high"] - ref.confidence_interval.high) <= 1e-12, name
        assert abs(metrics[name] - values.mean()) <= 1e-12
    # a plain loop: one resample of prompts at a time (the same draws), each prompt's samples kept together
    rng = np.random.Generator(np.random.PCG64(ev["seed"]))
    draws = rng.integers(0, 40, size=(ev["bootstrap_replicates"], 40))
    loop = []
    for r in range(ev["bootstrap_replicates"]):
        total = 0.0
        for j in draws[r]:
            total += win[j]
        loop.append(total / 40)
    lo, hi = percentile_ci(np.array(loop), ev["confidence"])
    assert abs(metrics["win_rate_ci_low"] - lo) <= 1e-12 and abs(metrics["win_rate_ci_high"] - hi) <= 1e-12
    assert metrics["win_rate_ci_low"] < metrics["win_rate"] < metrics["win_rate_ci_high"]
    assert summary["policy_better"] == (metrics["win_rate_ci_low"] > 0.5)


def test_length_view_matches_polyfit_and_buckets_by_hand():
    rows = synthetic_rows(60, 2, seed=1)
    metrics, _ = evaluate_generation(rows, PARAMS, "synthetic")
    diff = np.array([r["policy_reward"] - r["reference_reward"] for r in rows])
    dlen = np.array([r["policy_length"] - r["reference_length"] for r in rows], dtype=float)
    slope, intercept = np.polyfit(dlen, diff, 1)
    length = metrics["length"]
    assert math.isclose(length["reward_diff_at_equal_length"], intercept, rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(length["reward_diff_per_token"], slope, rel_tol=1e-9, abs_tol=1e-12)
    assert length["reward_diff_at_equal_length_ci_low"] < intercept < length["reward_diff_at_equal_length_ci_high"]
    ratio = [(r["policy_length"] + 1) / (r["reference_length"] + 1) for r in rows]
    for name, lo, hi in (("policy_shorter", 0, 0.8), ("similar", 0.8, 1.25), ("policy_longer", 1.25, math.inf)):
        sel = [r for r, q in zip(rows, ratio) if lo <= q < hi]
        assert length["buckets"][name]["pairs"] == len(sel)
        assert math.isclose(length["buckets"][name]["win_rate"], np.mean([r["win"] for r in sel]))
    kl = metrics["kl"]
    assert math.isclose(kl["per_completion"], np.mean([r["policy_log_ratio"] for r in rows]))
    assert math.isclose(kl["per_token"], sum(r["policy_log_ratio"] for r in rows)
                        / sum(r["policy_generated_tokens"] for r in rows))


def test_a_row_whose_win_disagrees_with_its_rewards_is_refused():
    rows = synthetic_rows(5, 1)
    rows[2]["win"] = 1.0 - rows[2]["win"] if rows[2]["win"] != 0.5 else 1.0
    with pytest.raises(PerPairFileError, match="row 2"):
        evaluate_generation(rows, PARAMS, "synthetic")


# ------------------------------------------------------------------------------------------------------
# The stage on a real tiny workspace
# ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge")
    ws = make_workspace(root, max_new_tokens=4, n=1, temperature=0.0)
    generate.main(generate_args(ws, root / "gen"))
    return ws, root / "gen" / "generations.parquet"


def with_empty_policy_completion(generations, dst, eos: int):
    """Row 0's policy completion replaced by a completion that stopped at once (only its EOS)."""
    rows = read_parquet(generations).to_pylist()
    rows[0].update(tokens=[eos], n_tokens=1, stop_reason="eos", text="")
    write_parquet(dst, pa.Table.from_pylist(rows, schema=GENERATIONS_SCHEMA))
    return dst


def test_judge_scores_an_empty_completion_and_matches_hf_forward(judged, tmp_path):
    """The empty completion is a recorded outcome: its reward is HF's score of prompt + the closed empty turn."""
    import torch
    from transformers import AutoModelForSequenceClassification
    ws, generations = judged
    info = json.loads((generations.parent / "generation_info.json").read_text())
    src = with_empty_policy_completion(generations, tmp_path / "generations.parquet", info["stop"]["eos"][0])
    judge.main(judge_args(ws, src, tmp_path))
    rows = read_jsonl(tmp_path / "judgments.jsonl")
    assert len(rows) == 6
    assert rows[0]["policy_completion"] == "" and rows[0]["policy_length"] == 0
    assert math.isfinite(rows[0]["policy_reward"])
    metrics = json.loads((tmp_path / "generation.json").read_text())
    assert metrics["n_prompts"] == 6 and 0 <= metrics["win_rate"] <= 1
    # HF's own forward on the sequences as a consumer renders them: prompt + content + turn closing
    model = AutoModelForSequenceClassification.from_pretrained(ws["judge"], dtype=torch.float32).eval()
    gen_rows = read_parquet(src).to_pylist()
    closing = info["stop"]["turn_closing"]
    for k in (0, 3):
        for j, side in enumerate(("policy", "reference")):
            g = gen_rows[2 * k + j]
            content = g["tokens"] if g["stop_reason"] == "max_new_tokens" else g["tokens"][:-1]
            with torch.no_grad():
                want = model(torch.tensor([g["prompt_ids"] + content + closing])).logits[0, 0].item()
            assert abs(rows[k][f"{side}_reward"] - want) <= 1e-4 * max(1.0, abs(want)), (k, side)


@pytest.mark.parametrize("labels", [None, 2])
def test_a_judge_that_is_not_a_one_label_classifier_is_refused(judged, tmp_path, labels):
    ws, generations = judged
    bad = ws["policy"] if labels is None else make_judge(ws["ref"], tmp_path / "judge2", num_labels=labels)
    with pytest.raises(SystemExit) as refused:
        judge.main(judge_args(ws, generations, tmp_path / "out", judge=bad))
    msg = str(refused.value)
    assert refused.value.code == 1 and msg.startswith("judge: refused: judge ")
    assert ("not a sequence-classification model" if labels is None else "2 labels") in msg
    assert not (tmp_path / "out" / "judgments.jsonl").exists()


def test_a_judge_whose_tokenizer_differs_is_refused_naming_both(judged, tmp_path):
    ws, generations = judged
    other = tmp_path / "judge"
    other.mkdir()
    for f in ws["judge"].iterdir():
        if f.is_file():
            (other / f.name).write_bytes(f.read_bytes())
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["added_tokens"].append({"id": max(t["id"] for t in tok["added_tokens"]) + 1000, "content": "<|extra|>",
                                "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                                "special": True})
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(SystemExit) as refused:
        judge.main(judge_args(ws, generations, tmp_path / "out", judge=other))
    msg = str(refused.value)
    assert refused.value.code == 1 and "judge's tokenizer" in msg and str(other) in msg and str(ws["ref"]) in msg
    assert not (tmp_path / "out" / "judgments.jsonl").exists()


def test_snakefile_preflight_refuses_a_pinned_judge_that_cannot_judge(judged, tmp_path):
    """A pinned causal LM as the judge: refused at the DAG's pre-flight, before generate runs."""
    import sys
    from conftest import REPO_ROOT
    sys.path.insert(0, str(REPO_ROOT / "workflow"))
    import preflight
    ws, _ = judged
    with pytest.raises(Exception, match="generation.judge: .*not a sequence-classification model"):
        preflight._check_pinned_judge({"source": "local", "repo_id": "x/y", "revision": None,
                                       "local_dir": str(ws["policy"])})
    preflight._check_pinned_judge({"source": "local", "repo_id": "x/y", "revision": None,
                                   "local_dir": str(ws["judge"])})
    preflight._check_pinned_judge("trained")
