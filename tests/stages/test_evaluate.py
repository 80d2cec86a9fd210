"""evaluate: probe identity checks, scoring, and the paired bootstrap against scipy."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import scipy.stats

from stages.evidence import scoring as ev
from stages.lib.io import sha256_json
from stage_helpers import evaluate_params, run_evaluate_cli
from synthetic_probe import dpo_rows, make_probe, rm_rows, write_all

N = 512


@pytest.fixture(scope="module")
def probe():
    return make_probe(N, seed=3)


@pytest.fixture(scope="module")
def scored(probe):
    _, tm, _ = probe
    beta = 0.1
    return {
        "dpo": (ev.score_dpo_rows(dpo_rows(tm, beta, 11, 0.6, True), beta, False, "s0"),
                ev.score_dpo_rows(dpo_rows(tm, beta, 11, 0.6, False), beta, False, "final")),
        "rm": (ev.score_rm_rows(rm_rows(tm, 11, 0.4, True), "s0"), ev.score_rm_rows(rm_rows(tm, 11, 0.4, False), "final")),
    }


# --------------------------------------------------------------------------------------------------
# Bootstrap == scipy.stats.bootstrap(paired=True, method='percentile') with the same Generator
# --------------------------------------------------------------------------------------------------

def _scipy(step0, final, statistic, replicates, seed, confidence):
    return scipy.stats.bootstrap((step0, final), statistic, paired=True, vectorized=True, method="percentile",
                                 n_resamples=replicates, confidence_level=confidence,
                                 random_state=np.random.Generator(np.random.PCG64(seed)))


@pytest.mark.parametrize("model", ["dpo", "rm"])
def test_bootstrap_equals_scipy_paired_percentile(scored, model):
    s0, fi = scored[model]
    replicates, seed, confidence = 10_000, 7, 0.95
    ours = ev.paired_bootstrap(s0, fi, replicates, seed, confidence)
    stats = {
        "final": lambda a, b, axis: np.mean(b, axis=axis),
        "step0": lambda a, b, axis: np.mean(a, axis=axis),
        "improvement": lambda a, b, axis: np.mean(b, axis=axis) - np.mean(a, axis=axis),
    }
    for metric, key in (("accuracy", "correct"), ("mean_margin", "margin")):
        for name, stat in stats.items():
            ref = _scipy(s0[key], fi[key], stat, replicates, seed, confidence)
            got = ours[metric][name]
            assert abs(got["ci_low"] - ref.confidence_interval.low) <= 1e-12, (metric, name)
            assert abs(got["ci_high"] - ref.confidence_interval.high) <= 1e-12, (metric, name)
            assert abs(got["standard_error"] - ref.standard_error) <= 1e-12, (metric, name)
    # the interval is not degenerate: a test that cannot tell a wrong draw apart would prove nothing
    assert ours["accuracy"]["final"]["ci_low"] < ours["accuracy"]["final"]["ci_high"]


def test_bootstrap_is_fp64_and_one_matrix_for_both_checkpoints(scored):
    s0, fi = scored["rm"]
    idx = ev.bootstrap_indices(N, 500, 7)
    assert idx.shape == (500, N) and idx.dtype == np.int64
    out = ev.paired_bootstrap(s0, fi, 500, 7, 0.95)
    assert out["index_matrix"]["sha256"] == ev.index_matrix_digest(idx)
    # improvement distribution is exactly final - step0 resampled with the same indices
    imp = fi["correct"][idx].mean(-1) - s0["correct"][idx].mean(-1)
    assert out["accuracy"]["improvement"]["distribution_sha256"] == ev._array_digest(imp)


# --------------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------------

def test_accuracy_counts_ties_as_half_and_reports_them():
    rows = [{"pair_id": f"p{i}", "chosen_score": c, "rejected_score": r, "margin": c - r,
             "correct": 1.0 if c > r else 0.0 if c < r else 0.5}
            for i, (c, r) in enumerate([(2.0, 1.0), (0.0, 1.0), (1.5, 1.5), (3.0, -1.0)])]
    m = ev.point_metrics(ev.score_rm_rows(rows, "rm.jsonl"))
    assert m == {"accuracy": (1 + 0 + 0.5 + 1) / 4, "ties": 1, "mean_margin": (1 - 1 + 0 + 4) / 4}


def test_dpo_step0_all_ties_and_implicit_reward_accuracy(probe):
    _, tm, _ = probe
    s0 = ev.point_metrics(ev.score_dpo_rows(dpo_rows(tm, 0.1, 5, 0.6, True), 0.1, False, "s0"))
    assert s0["ties"] == N and s0["accuracy"] == 0.5 and s0["mean_margin"] == 0.0
    rows = dpo_rows(tm, 0.1, 5, 0.6, False)
    fi = ev.point_metrics(ev.score_dpo_rows(rows, 0.1, False, "final"))
    expected = np.mean([1.0 if r["chosen_reward"] > r["rejected_reward"] else 0.0 for r in rows])
    assert fi["accuracy"] == expected and fi["ties"] == 0
    assert fi["logp_accuracy"] == np.mean([r["policy_chosen_logp"] > r["policy_rejected_logp"] for r in rows])


def test_correct_is_recomputed_and_a_disagreeing_file_refused(probe):
    _, tm, _ = probe
    rows = rm_rows(tm, 5, 0.4, False)
    rows[9]["correct"] = 1.0 - rows[9]["correct"]
    with pytest.raises(ev.PerPairFileError, match=r"rm.jsonl row 9 .*correct is"):
        ev.score_rm_rows(rows, "rm.jsonl")
    d = dpo_rows(tm, 0.1, 5, 0.6, False)
    with pytest.raises(ev.PerPairFileError, match=r"row 0 .*beta\*\(policy-ref\) with beta=0.5"):
        ev.score_dpo_rows(d, 0.5, False, "dpo.jsonl")  # written with beta 0.1
    d[3]["margin"] += 1.0
    with pytest.raises(ev.PerPairFileError, match=r"row 3 .*margin"):
        ev.score_dpo_rows(d, 0.1, False, "dpo.jsonl")
    d = dpo_rows(tm, 0.1, 5, 0.6, False)
    d[4]["chosen_reward"] = float("nan")
    with pytest.raises(ev.PerPairFileError, match=r"row 4: chosen_reward must be a finite number"):
        ev.score_dpo_rows(d, 0.1, False, "dpo.jsonl")


def test_reference_free_rows(probe):
    _, tm, _ = probe
    rows = dpo_rows(tm, 0.1, 5, 0.6, True, reference_free=True)
    m = ev.point_metrics(ev.score_dpo_rows(rows, 0.1, True, "s0"))
    assert m["ties"] == 0  # reference-free: step 0 rewards are the policy's own log-probs
    with pytest.raises(ev.PerPairFileError, match="dpo_ref_free but reference log-probs"):
        ev.score_dpo_rows(dpo_rows(tm, 0.1, 5, 0.6, True), 0.1, True, "s0")


# --------------------------------------------------------------------------------------------------
# Wrong probe: each case rejected with a message naming it
# --------------------------------------------------------------------------------------------------

def _foreign_pair(rows):
    rows[17]["pair_id"] = "f" * 24


def _reordered(rows):
    rows[3], rows[40] = rows[40], rows[3]
    rows[3]["index"], rows[40]["index"] = 3, 40


def _truncated_differently(rows):
    rows[100]["token_hash"] = "0" * 64


def _511(rows):
    del rows[-1]


@pytest.mark.parametrize("mutate, message", [
    (_foreign_pair, r"row 17: swapped pair: pair_id f{24} is not in the frozen probe"),
    (_reordered, r"row 3: reordered: .*same pairs, different order"),
    (_truncated_differently, r"row 100: token hash differs .*tokenized or truncated differently"),
    (_511, r"wrong count: 511 pairs, the frozen probe \(probe.size\) has 512"),
])
@pytest.mark.parametrize("kind", ["dpo", "rm"])
def test_wrong_probe_rejected_with_reason(probe, kind, mutate, message):
    pm, tm, _ = probe
    params = evaluate_params(bootstrap_replicates=100)
    good = dpo_rows(tm, 0.1, 5, 0.6, False) if kind == "dpo" else rm_rows(tm, 5, 0.4, False)
    ev.evaluate_model(kind, good, good, pm, tm, params, "s0.jsonl", "final.jsonl")  # the unmutated probe passes
    bad = copy.deepcopy(good)
    mutate(bad)
    with pytest.raises(ev.ProbeMismatchError, match=r"final.jsonl " + message if mutate is not _511 else message):
        ev.evaluate_model(kind, good, bad, pm, tm, params, "s0.jsonl", "final.jsonl")


def test_chosen_rejected_swap_named_when_probe_tokens_given(probe):
    pm, tm, token_rows = probe
    swapped = {r["pair_id"]: (r["token_hash"], sha256_json([r["rejected_ids"], r["rejected_prompt_len"],
                                                               r["chosen_ids"], r["chosen_prompt_len"]]))
               for r in token_rows}
    rows = rm_rows(tm, 5, 0.4, False)
    rows[8]["token_hash"] = swapped[rows[8]["pair_id"]][1]
    with pytest.raises(ev.ProbeMismatchError, match="row 8: token hash differs .*chosen and rejected were swapped"):
        ev.check_probe_rows(rows, pm, tm, N, "final.jsonl", swapped)


def test_manifest_level_mismatches(probe):
    pm, tm, _ = probe
    ev.check_manifests(pm, tm, N)
    with pytest.raises(ev.ProbeMismatchError, match=r"wrong count: probe manifest holds 512 pairs .*probe.size is 511"):
        ev.check_manifests(pm, tm, 511)
    small_pm, small_tm, _ = make_probe(511, seed=3)
    with pytest.raises(ev.ProbeMismatchError, match="wrong count: probe manifest holds 511"):
        ev.check_manifests(small_pm, small_tm, N)
    _, other_tm, _ = make_probe(N, seed=4)
    with pytest.raises(ev.ProbeMismatchError, match="tokenize record was made from another probe"):
        ev.check_manifests(pm, other_tm, N)
    edited = copy.deepcopy(pm)
    edited["pair_ids"][0], edited["pair_ids"][1] = edited["pair_ids"][1], edited["pair_ids"][0]
    with pytest.raises(ev.ProbeMismatchError, match="probe_digest .* does not match"):
        ev.check_manifests(edited, tm, N)


# --------------------------------------------------------------------------------------------------
# CLI: outputs, determinism, seed sensitivity, refusal writes nothing
# --------------------------------------------------------------------------------------------------

def _leaves(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    else:
        yield obj


def test_cli_deterministic_seeded_and_small_metrics(tmp_path):
    params = evaluate_params(bootstrap_replicates=2000)
    write_all(tmp_path, params)
    a = run_evaluate_cli(tmp_path, params, "a")
    b = run_evaluate_cli(tmp_path, params, "b")
    for key in a:
        assert a[key].read_bytes() == b[key].read_bytes(), key

    for key in ("metrics_dpo", "metrics_rm"):
        m = json.loads(a[key].read_text())
        assert a[key].stat().st_size < 2048
        # numbers, but the record's format and the implicit reward's name (null for the reward model)
        assert m["format"] == "prefpipe-probe-metrics/1"
        assert m["implicit_reward"] == ("summed_logp" if key == "metrics_dpo" else None)
        assert all(isinstance(v, (int, float)) and not isinstance(v, bool)
                   for v in _leaves({k: v for k, v in m.items() if k not in ("format", "implicit_reward")}))
        assert m["n_pairs"] == N and m["final"]["accuracy_ci_low"] <= m["final"]["accuracy"] <= m["final"]["accuracy_ci_high"]
    dpo = json.loads(a["metrics_dpo"].read_text())
    assert dpo["step0"]["ties"] == N and dpo["improvement"]["accuracy_ci_low"] > 0

    summary = json.loads(a["bootstrap"].read_text())
    assert summary["seed"] == 7 and summary["replicates"] == 2000 and summary["numpy_version"] == np.__version__
    digest = summary["models"]["dpo"]["bootstrap"]["index_matrix"]["sha256"]
    assert digest == ev.index_matrix_digest(ev.bootstrap_indices(N, 2000, 7))
    assert str(tmp_path) not in a["bootstrap"].read_text()  # content hashes, never paths

    c = run_evaluate_cli(tmp_path, evaluate_params(bootstrap_replicates=2000, seed=8), "c")
    other = json.loads(c["bootstrap"].read_text())
    assert other["models"]["dpo"]["bootstrap"]["index_matrix"]["sha256"] != digest
    assert (other["models"]["rm"]["bootstrap"]["accuracy"]["final"]["distribution_sha256"]
            != summary["models"]["rm"]["bootstrap"]["accuracy"]["final"]["distribution_sha256"])
    # point estimates do not depend on the bootstrap seed
    assert other["models"]["rm"]["final"] == summary["models"]["rm"]["final"]


def test_cli_refuses_511_pairs_and_writes_nothing(tmp_path):
    params = evaluate_params(bootstrap_replicates=100)
    write_all(tmp_path, params)
    rows = (tmp_path / "results/train_dpo/probe_final.jsonl").read_text().splitlines(True)
    short = tmp_path / "short.jsonl"
    short.write_text("".join(rows[:511]))
    with pytest.raises(SystemExit, match=r"evaluate: refused: .*short.jsonl: wrong count: 511 pairs"):
        run_evaluate_cli(tmp_path, params, "x", extra_dpo_final=str(short))
    assert not (tmp_path / "x/metrics").exists() and not (tmp_path / "x/bootstrap_summary.json").exists()
    assert "wrong count: 511" in (tmp_path / "x/evaluate.log").read_text()


def test_cli_reports_truncated_probe_pairs_and_refuses_a_record_of_other_tokens(tmp_path):
    """tokenize's `truncated` record (keep_end / truncate_completion) is checked, and counted in the summary."""
    params = evaluate_params(bootstrap_replicates=100)
    write_all(tmp_path, params)
    tm_path = tmp_path / "results/tokens/probe_token_manifest.json"
    tm = json.loads(tm_path.read_text())
    tm["limits"] = {"max_length": 1024, "max_prompt_length": 256, "truncation": "keep_end"}
    tm["truncated"] = [{"index": i, "pair_id": tm["pair_ids"][i], "reason": reason, "token_hash": tm["token_hashes"][i]}
                       for i, reason in ((3, "prompt_turns_dropped"), (40, "prompt_text_cut"), (41, "prompt_turns_dropped"))]
    tm_path.write_text(json.dumps(tm))
    summary = json.loads(run_evaluate_cli(tmp_path, params, "a")["bootstrap"].read_text())
    assert summary["probe_truncated"] == {"pairs": 3, "by_reason": {"prompt_text_cut": 1, "prompt_turns_dropped": 2}}
    assert "3 of 512 pairs were truncated" in (tmp_path / "a/evaluate.log").read_text()

    tm["truncated"][1]["token_hash"] = tm["token_hashes"][0]
    tm_path.write_text(json.dumps(tm))
    with pytest.raises(SystemExit, match=r"refused: probe token manifest: truncated\[1\] .*not of the tokens that are scored"):
        run_evaluate_cli(tmp_path, params, "x")
    assert not (tmp_path / "x/bootstrap_summary.json").exists()
