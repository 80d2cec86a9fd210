"""Scoring the frozen probe: prove per-pair rows are the frozen probe, score them, paired bootstrap.

The evaluate stage (stages/evaluate.py) runs this on the training stages' probe files, the judge stage
(evaluate_generation) on its judgments and rounds_metrics on each round's; the report stage's `verify` recomputes
a bundle's metrics with the same functions, so they live here, in the evidence package, once (no stage imports
another). stages/evaluate.py's docstring describes the checks, the scores and the bootstrap.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from stages.lib.contracts import correct_label, probe_digest
from stages.lib.graders import grade, grader_spec
from stages.lib import record_formats
from stages.lib.implicit_reward import IMPLICIT_REWARDS, MEAN_REWARD, SUMMED_REWARD, implicit_reward
from stages.lib.io import sha256_bytes


class ProbeMismatchError(ValueError):
    """The per-pair outputs are not the frozen probe; the message says which check failed."""


class PerPairFileError(ValueError):
    """A per-pair JSONL row is malformed or internally inconsistent (names file and row)."""


# --------------------------------------------------------------------------------------------------
# Proving the inputs are the frozen probe
# --------------------------------------------------------------------------------------------------

def check_manifests(probe_manifest: dict, token_manifest: dict, probe_size: int) -> None:
    """The probe manifest, the tokenize record and params agree on one probe of `probe_size` pairs."""
    ids = probe_manifest.get("pair_ids")
    hashes = probe_manifest.get("content_hashes")
    if not isinstance(ids, list) or not isinstance(hashes, list) or len(ids) != len(hashes):
        raise ProbeMismatchError("probe manifest: pair_ids and content_hashes must be lists of equal length")
    if len(ids) != probe_size or probe_manifest.get("size") != probe_size:
        raise ProbeMismatchError(
            f"wrong count: probe manifest holds {len(ids)} pairs (size field {probe_manifest.get('size')}), "
            f"params probe.size is {probe_size}")
    if len(set(ids)) != len(ids):
        raise ProbeMismatchError("probe manifest: duplicate pair_ids")
    digest = probe_digest(ids, hashes)
    if probe_manifest.get("probe_digest") != digest:
        raise ProbeMismatchError(
            f"probe manifest: probe_digest {probe_manifest.get('probe_digest')} does not match its pair_ids/"
            f"content_hashes ({digest}); the manifest was edited")
    if token_manifest.get("probe_digest") != digest:
        raise ProbeMismatchError(
            f"tokenize record was made from another probe: probe_token_manifest probe_digest "
            f"{token_manifest.get('probe_digest')} != probe manifest {digest}")
    t_ids, t_hashes = token_manifest.get("pair_ids"), token_manifest.get("token_hashes")
    if not isinstance(t_ids, list) or not isinstance(t_hashes, list) or len(t_ids) != len(t_hashes):
        raise ProbeMismatchError("probe token manifest: pair_ids and token_hashes must be lists of equal length")
    if t_ids != ids:
        raise ProbeMismatchError(
            f"probe token manifest lists {len(t_ids)} pairs that differ from the probe manifest's {len(ids)} "
            f"(order or membership); tokenize did not tokenize the frozen probe")
    check_truncation_record(token_manifest)


def check_truncation_record(token_manifest: dict) -> list[dict]:
    """The probe token manifest's `truncated` list (tokenize's record of every truncated probe pair) names
    probe pairs at their positions, in probe order, each with the token hash that is scored; a record
    made under `truncation: reject` lists none. A record without the key (older tokenize) lists none."""
    truncated = token_manifest.get("truncated", [])
    if not isinstance(truncated, list):
        raise ProbeMismatchError("probe token manifest: truncated must be a list")
    ids, hashes = token_manifest["pair_ids"], token_manifest["token_hashes"]
    policy = (token_manifest.get("limits") or {}).get("truncation")
    if truncated and policy == "reject":
        raise ProbeMismatchError(f"probe token manifest: {len(truncated)} truncated pairs recorded under "
                                 f"truncation: reject")
    last = -1
    for k, t in enumerate(truncated):
        i = t.get("index") if isinstance(t, dict) else None
        if not isinstance(i, int) or not 0 <= i < len(ids) or t.get("pair_id") != ids[i]:
            raise ProbeMismatchError(f"probe token manifest: truncated[{k}] names pair "
                                     f"{t.get('pair_id') if isinstance(t, dict) else t!r} at index {i!r}, "
                                     f"which is not that probe position")
        if i <= last:
            raise ProbeMismatchError(f"probe token manifest: truncated[{k}] (index {i}) is out of probe order "
                                     f"or repeated")
        last = i
        if t.get("token_hash") != hashes[i]:
            raise ProbeMismatchError(f"probe token manifest: truncated[{k}] records token hash "
                                     f"{t.get('token_hash')} for pair {ids[i]}, but the probe's token hash is "
                                     f"{hashes[i]}: the record is not of the tokens that are scored")
        if not isinstance(t.get("reason"), str) or not t["reason"]:
            raise ProbeMismatchError(f"probe token manifest: truncated[{k}] (pair {ids[i]}) has no reason")
    return truncated


def check_probe_rows(rows: list[dict], probe_manifest: dict, token_manifest: dict, probe_size: int,
                     source: str, swapped_hashes: dict[str, tuple[str, str]] | None = None) -> None:
    """Rows are the frozen probe: count, membership, order, index and token hash, in that order of checks."""
    ids = probe_manifest["pair_ids"]
    token_hashes = token_manifest["token_hashes"]
    if len(rows) != probe_size:
        raise ProbeMismatchError(
            f"{source}: wrong count: {len(rows)} pairs, the frozen probe (probe.size) has {probe_size}")
    for i, row in enumerate(rows):
        for key in ("pair_id", "index", "token_hash"):
            if key not in row:
                raise PerPairFileError(f"{source} row {i}: missing field {key!r}")
    row_ids = [r["pair_id"] for r in rows]
    known = set(ids)
    for i, pid in enumerate(row_ids):
        if pid not in known:
            raise ProbeMismatchError(
                f"{source} row {i}: swapped pair: pair_id {pid} is not in the frozen probe "
                f"(manifest expects {ids[i]} here)")
    if len(set(row_ids)) != len(row_ids):
        dup = next(p for p in row_ids if row_ids.count(p) > 1)
        raise ProbeMismatchError(f"{source}: pair_id {dup} appears more than once (a probe pair is missing)")
    if row_ids != ids:
        i = next(k for k, (a, b) in enumerate(zip(row_ids, ids)) if a != b)
        raise ProbeMismatchError(
            f"{source} row {i}: reordered: pair_id {row_ids[i]} where the frozen probe has {ids[i]} "
            f"(same pairs, different order; manifest position of {row_ids[i]} is {ids.index(row_ids[i])})")
    for i, row in enumerate(rows):
        if row["index"] != i:
            raise ProbeMismatchError(f"{source} row {i}: index field is {row['index']!r}, expected {i}")
        if row["token_hash"] != token_hashes[i]:
            why = "it was tokenized or truncated differently from the tokenize record"
            if swapped_hashes and row["pair_id"] in swapped_hashes:
                recorded, swapped = swapped_hashes[row["pair_id"]]
                if row["token_hash"] == swapped:
                    why = "its chosen and rejected were swapped"
            raise ProbeMismatchError(
                f"{source} row {i}: token hash differs for pair {row['pair_id']}: file {row['token_hash']}, "
                f"tokenize record {token_hashes[i]}; {why}")


# --------------------------------------------------------------------------------------------------
# Scores -> correct, accuracy, margins
# --------------------------------------------------------------------------------------------------

def _num(row: dict, key: str, source: str, i: int) -> float:
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise PerPairFileError(f"{source} row {i}: {key} must be a finite number, got {v!r}")
    return float(v)


def _count(row: dict, key: str, source: str, i: int) -> int:
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise PerPairFileError(f"{source} row {i}: {key} must be a token count >= 1, got {v!r}")
    return v


def _close(a: float, b: float) -> bool:
    # The trainer may compute rewards on device in fp32; a wrong beta or a stale reference is far off.
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)


def rows_reward(rows: list[dict], source: str) -> str:
    """The implicit reward a DPO probe file scores: every row's `implicit_reward` (absent: SUMMED_REWARD), one
    for the whole file."""
    kind = rows[0].get("implicit_reward", SUMMED_REWARD) if rows else SUMMED_REWARD
    for i, r in enumerate(rows):
        k = r.get("implicit_reward", SUMMED_REWARD)
        if k not in IMPLICIT_REWARDS:
            raise PerPairFileError(f"{source} row {i}: implicit_reward {k!r} is not one of "
                                   f"{' | '.join(IMPLICIT_REWARDS)}")
        if k != kind:
            raise PerPairFileError(f"{source} row {i}: implicit_reward {k} where row 0 has {kind} (a file scores one "
                                   "reward)")
    return kind


def score_dpo_rows(rows: list[dict], beta: float, reference_free: bool, source: str,
                   completion_tokens: dict[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    """Recompute rewards, margin and correct from the log-probs (and, for MEAN_REWARD, the token counts) under the
    implicit reward the rows declare (train_dpo writes the one dpo.loss declares); refuse a file that disagrees.
    completion_tokens: pair_id -> (chosen, rejected) completion token counts from the probe tokens, when known."""
    kind = rows_reward(rows, source)
    correct, margin, logp_correct = [], [], []
    for i, r in enumerate(rows):
        pc, pr = _num(r, "policy_chosen_logp", source, i), _num(r, "policy_rejected_logp", source, i)
        if reference_free and r.get("ref_chosen_logp") is None and r.get("ref_rejected_logp") is None:
            rc = rr = 0.0
        else:
            rc, rr = _num(r, "ref_chosen_logp", source, i), _num(r, "ref_rejected_logp", source, i)
        if reference_free and (rc != 0.0 or rr != 0.0):
            raise PerPairFileError(f"{source} row {i}: dpo_ref_free but reference log-probs are {rc}, {rr} (must be 0)")
        n_c = n_r = None
        if kind == MEAN_REWARD:
            n_c, n_r = _count(r, "chosen_tokens", source, i), _count(r, "rejected_tokens", source, i)
            want = (completion_tokens or {}).get(r["pair_id"])
            if want is not None and (n_c, n_r) != tuple(want):
                raise PerPairFileError(f"{source} row {i} (pair {r['pair_id']}): completion token counts {n_c}, {n_r} "
                                       f"are not the probe tokens' {want[0]}, {want[1]}")
        cr, rj = _num(r, "chosen_reward", source, i), _num(r, "rejected_reward", source, i)
        m = _num(r, "margin", source, i)
        want_c, want_r = implicit_reward(kind, beta, pc, rc, n_c), implicit_reward(kind, beta, pr, rr, n_r)
        if not _close(cr, want_c) or not _close(rj, want_r):
            form = "beta*(policy-ref)" if kind == SUMMED_REWARD else "beta*(policy-ref)/completion tokens"
            raise PerPairFileError(
                f"{source} row {i} (pair {r['pair_id']}): rewards {cr}, {rj} are not {form} with "
                f"beta={beta} ({want_c}, {want_r})")
        if not _close(m, cr - rj):
            raise PerPairFileError(f"{source} row {i} (pair {r['pair_id']}): margin {m} != chosen_reward - rejected_reward {cr - rj}")
        c = correct_label(cr, rj)
        if r.get("correct") != c:
            raise PerPairFileError(
                f"{source} row {i} (pair {r['pair_id']}): correct is {r.get('correct')!r} but the rewards "
                f"{cr} vs {rj} give {c}")
        correct.append(c)
        margin.append(cr - rj)
        logp_correct.append(correct_label(pc, pr))
    return {"correct": np.asarray(correct, np.float64), "margin": np.asarray(margin, np.float64),
            "logp_correct": np.asarray(logp_correct, np.float64), "implicit_reward": kind}


def score_rm_rows(rows: list[dict], source: str) -> dict[str, np.ndarray]:
    correct, margin = [], []
    for i, r in enumerate(rows):
        cs, rs = _num(r, "chosen_score", source, i), _num(r, "rejected_score", source, i)
        m = _num(r, "margin", source, i)
        if not _close(m, cs - rs):
            raise PerPairFileError(f"{source} row {i} (pair {r['pair_id']}): margin {m} != chosen_score - rejected_score {cs - rs}")
        c = correct_label(cs, rs)
        if r.get("correct") != c:
            raise PerPairFileError(
                f"{source} row {i} (pair {r['pair_id']}): correct is {r.get('correct')!r} but the scores "
                f"{cs} vs {rs} give {c}")
        correct.append(c)
        margin.append(cs - rs)
    return {"correct": np.asarray(correct, np.float64), "margin": np.asarray(margin, np.float64)}


def point_metrics(scored: dict[str, np.ndarray]) -> dict[str, Any]:
    out = {"accuracy": float(scored["correct"].mean()),
           "ties": int((scored["correct"] == 0.5).sum()),
           "mean_margin": float(scored["margin"].mean())}
    if "logp_correct" in scored:
        out["logp_accuracy"] = float(scored["logp_correct"].mean())
    return out


# --------------------------------------------------------------------------------------------------
# Paired bootstrap (matches scipy.stats.bootstrap(paired=True, method='percentile'))
# --------------------------------------------------------------------------------------------------

def bootstrap_indices(n: int, replicates: int, seed: int) -> np.ndarray:
    """The (replicates, n) int64 index matrix: one resample of pair indices per replicate, drawn in
    one call exactly as scipy.stats.bootstrap does (rng_integers(rng, 0, n, (n_resamples, n)))."""
    rng = np.random.Generator(np.random.PCG64(seed))
    return rng.integers(0, n, size=(replicates, n), dtype=np.int64)


def index_matrix_digest(idx: np.ndarray) -> str:
    return sha256_bytes(np.ascontiguousarray(idx, dtype="<i8").tobytes())


def _array_digest(a: np.ndarray) -> str:
    return sha256_bytes(np.ascontiguousarray(a, dtype="<f8").tobytes())


def percentile_interval(dist: np.ndarray, confidence: float) -> tuple[float, float]:
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(dist, [alpha, 1 - alpha], method="linear")
    return float(lo), float(hi)


def _describe(dist: np.ndarray, point: float, confidence: float) -> dict[str, Any]:
    lo, hi = percentile_interval(dist, confidence)
    qs = [0.005, 0.025, 0.05, 0.5, 0.95, 0.975, 0.995]
    return {"point": point, "ci_low": lo, "ci_high": hi,
            "standard_error": float(np.std(dist, ddof=1)),
            "quantiles": {f"{q:g}": float(v) for q, v in zip(qs, np.quantile(dist, qs))},
            "distribution_sha256": _array_digest(dist)}


def paired_bootstrap(step0: dict[str, np.ndarray], final: dict[str, np.ndarray], replicates: int, seed: int,
                     confidence: float) -> dict[str, Any]:
    """Bootstrap distributions of final accuracy, step-0 accuracy, improvement (final - step0) and the
    same for mean margin, all from ONE index matrix applied to step 0 and final alike."""
    n = len(final["correct"])
    if len(step0["correct"]) != n:
        raise ValueError("paired bootstrap needs step 0 and final on the same pairs")
    idx = bootstrap_indices(n, replicates, seed)
    out: dict[str, Any] = {
        "n_pairs": n,
        "index_matrix": {"shape": [replicates, n], "dtype": "int64 little-endian, C order",
                         "sha256": index_matrix_digest(idx)},
    }
    for name, key in (("accuracy", "correct"), ("mean_margin", "margin")):
        s0 = np.asarray(step0[key], np.float64)
        f = np.asarray(final[key], np.float64)
        s0_b = s0[idx].mean(axis=-1)
        f_b = f[idx].mean(axis=-1)
        out[name] = {
            "step0": _describe(s0_b, float(s0.mean()), confidence),
            "final": _describe(f_b, float(f.mean()), confidence),
            "improvement": _describe(f_b - s0_b, float(f.mean() - s0.mean()), confidence),
        }
    return out


# --------------------------------------------------------------------------------------------------
# One model: validate, score, bootstrap -> (metrics, summary)
# --------------------------------------------------------------------------------------------------

def evaluate_model(kind: str, step0_rows: list[dict], final_rows: list[dict], probe_manifest: dict,
                   token_manifest: dict, params: dict, step0_source: str, final_source: str,
                   swapped_hashes: dict | None = None,
                   completion_tokens: dict[str, tuple[int, int]] | None = None) -> tuple[dict, dict]:
    """One model's metrics and bootstrap summary. DPO: completion_tokens as score_dpo_rows; step 0 and final must
    score the same implicit reward, which the metrics record (null for the reward model)."""
    size = params["probe"]["size"]
    for rows, src in ((step0_rows, step0_source), (final_rows, final_source)):
        check_probe_rows(rows, probe_manifest, token_manifest, size, src, swapped_hashes)
    reward = None
    if kind == "dpo":
        beta = float(params["dpo"]["beta"])
        ref_free = params["dpo"]["objective"] == "dpo_ref_free"
        s0 = score_dpo_rows(step0_rows, beta, ref_free, step0_source, completion_tokens)
        fi = score_dpo_rows(final_rows, beta, ref_free, final_source, completion_tokens)
        if s0["implicit_reward"] != fi["implicit_reward"]:
            raise PerPairFileError(f"{final_source}: scores the {fi['implicit_reward']} implicit reward, "
                                   f"{step0_source} the {s0['implicit_reward']}: step 0 and final must compare one")
        reward = s0["implicit_reward"]
    else:
        s0 = score_rm_rows(step0_rows, step0_source)
        fi = score_rm_rows(final_rows, final_source)
    ev = params["evaluate"]
    boot = paired_bootstrap(s0, fi, ev["bootstrap_replicates"], ev["seed"], ev["confidence"])
    p0, pf = point_metrics(s0), point_metrics(fi)
    acc = boot["accuracy"]
    metrics = {
        "format": record_formats.PROBE_METRICS,
        "implicit_reward": reward,         # DPO: the implicit reward the probe rows score; the reward model: null
        "n_pairs": len(final_rows),
        "confidence": ev["confidence"],
        "step0": p0,
        "final": {**pf, "accuracy_ci_low": acc["final"]["ci_low"], "accuracy_ci_high": acc["final"]["ci_high"]},
        "improvement": {"accuracy": acc["improvement"]["point"],
                        "accuracy_ci_low": acc["improvement"]["ci_low"],
                        "accuracy_ci_high": acc["improvement"]["ci_high"],
                        "mean_margin": boot["mean_margin"]["improvement"]["point"]},
    }
    summary = {"kind": kind, "implicit_reward": reward, "step0": p0, "final": pf,
               "bootstrap": boot,
               "training_helped": acc["improvement"]["ci_low"] > 0}
    return metrics, summary


# --------------------------------------------------------------------------------------------------
# Generation: the policy's completions against the reference's, scored by a judge (stages/judge.py writes the
# rows and metrics, `report verify` recomputes them from the bundle's rows with these functions)
# --------------------------------------------------------------------------------------------------

SIDES = ("policy", "reference")
# Length ratio (policy content tokens + 1) / (reference content tokens + 1): +1 so an empty completion has a ratio.
LENGTH_BUCKETS = (("policy_shorter", 0.0, 0.8), ("similar", 0.8, 1.25), ("policy_longer", 1.25, math.inf))
JUDGMENT_NUMBERS = ("policy_reward", "reference_reward", "policy_log_ratio")
JUDGMENT_COUNTS = ("policy_length", "reference_length", "policy_generated_tokens")


def judgment_arrays(rows: list[dict], source: str) -> dict[str, np.ndarray]:
    """The judge's rows (one per prompt and sample, in (index, sample) order, every prompt with the same samples)
    as float64 arrays, plus `prompt` (each row's prompt position); `win` recomputed from the rewards and a row
    whose `win` disagrees refused, as evaluate refuses a `correct` that disagrees with its scores."""
    if not rows:
        raise PerPairFileError(f"{source}: no rows")
    prompts, samples = [], []
    out: dict[str, list] = {k: [] for k in (*JUDGMENT_NUMBERS, *JUDGMENT_COUNTS, "win")}
    for i, r in enumerate(rows):
        for key in ("index", "sample"):
            if not isinstance(r.get(key), int) or isinstance(r.get(key), bool) or r[key] < 0:
                raise PerPairFileError(f"{source} row {i}: {key} must be an integer >= 0, got {r.get(key)!r}")
        prompts.append(r["index"])
        samples.append(r["sample"])
        for key in JUDGMENT_NUMBERS:
            out[key].append(_num(r, key, source, i))
        for key in JUDGMENT_COUNTS:
            v = r.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if key == "policy_generated_tokens" else 0):
                raise PerPairFileError(f"{source} row {i}: {key} must be a token count, got {v!r}")
            out[key].append(v)
        win = correct_label(out["policy_reward"][-1], out["reference_reward"][-1])
        if r.get("win") != win:
            raise PerPairFileError(f"{source} row {i} (pair {r.get('pair_id')}): win is {r.get('win')!r} but the "
                                   f"rewards {out['policy_reward'][-1]} vs {out['reference_reward'][-1]} give {win}")
        out["win"].append(win)
    n = len(set(prompts))
    per = -(-len(rows) // n)
    want = [(p, s) for p in range(n) for s in range(per)]
    got = list(zip(prompts, samples))
    if got != want:
        k = next((j for j, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
        raise PerPairFileError(f"{source} row {k}: (index, sample) {got[k] if k < len(got) else 'missing'} where "
                               f"{want[k] if k < len(want) else 'nothing'} belongs: rows must be every prompt "
                               "position 0 .. n-1, each with samples 0 .. n_samples-1, in that order")
    arrays = {k: np.asarray(v, np.float64) for k, v in out.items()}
    arrays["prompt"] = np.asarray(prompts, np.int64)
    return arrays


def _per_prompt(values: np.ndarray, n_prompts: int) -> np.ndarray:
    """Mean over each prompt's samples (rows are in prompt order, the same count each)."""
    return values.reshape(n_prompts, -1).mean(axis=1)


def length_regression(diff: np.ndarray, dlen: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted least squares of the reward difference on the length difference, per row of `weights` ([R, pairs]:
    how often each pair is in a resample): (intercept [R], slope [R]). The intercept is the reward difference
    predicted at equal length. No spread in the length difference: slope 0, intercept the weighted mean."""
    sw = weights.sum(axis=1)
    sx, sy = weights @ dlen, weights @ diff
    sxx, sxy = weights @ (dlen * dlen), weights @ (dlen * diff)
    det = sw * sxx - sx * sx
    flat = det <= 1e-12 * np.maximum(sw * sxx, 1.0)
    slope = np.where(flat, 0.0, (sw * sxy - sx * sy) / np.where(flat, 1.0, det))
    return (sy - slope * sx) / sw, slope


def length_bucket_of(policy_length: np.ndarray, reference_length: np.ndarray) -> np.ndarray:
    ratio = (policy_length + 1) / (reference_length + 1)
    return np.array([next(k for k, (_, lo, hi) in enumerate(LENGTH_BUCKETS) if lo <= r < hi) for r in ratio])


def evaluate_generation(rows: list[dict], params: dict, source: str) -> tuple[dict, dict]:
    """(metrics, summary) of the judged completions: win rate of the policy over the reference (a tie counts 0.5)
    and the mean reward difference, each with the paired percentile bootstrap of evaluate (one index matrix over
    prompts, `evaluate` params; a prompt's samples resampled together); the length-controlled view (win rate and
    reward difference by length-ratio bucket; the reward difference at equal length from a least-squares fit on
    the length difference, with its bootstrap interval); the KL estimate (see docs/ARTIFACTS.md, judge)."""
    a = judgment_arrays(rows, source)
    n = int(a["prompt"][-1]) + 1
    ev = params["evaluate"]
    idx = bootstrap_indices(n, ev["bootstrap_replicates"], ev["seed"])
    diff = a["policy_reward"] - a["reference_reward"]
    per_prompt = {"win_rate": _per_prompt(a["win"], n),
                  "reward_diff": _per_prompt(diff, n),
                  "kl_per_completion": _per_prompt(a["policy_log_ratio"], n)}
    boot = {name: _describe(v[idx].mean(axis=-1), float(v.mean()), ev["confidence"]) for name, v in per_prompt.items()}
    # Pair-level views weight each pair by how often its prompt is in a resample (the same index matrix).
    counts = np.stack([np.bincount(row, minlength=n) for row in idx]).astype(np.float64)[:, a["prompt"]]
    dlen = a["policy_length"] - a["reference_length"]
    ones = np.ones((1, len(diff)))
    (a0,), (b0,) = length_regression(diff, dlen, ones)
    lc, _ = length_regression(diff, dlen, counts)
    boot["reward_diff_at_equal_length"] = _describe(lc, float(a0), ev["confidence"])
    buckets = length_bucket_of(a["policy_length"], a["reference_length"])
    by_bucket = {}
    for k, (name, lo, hi) in enumerate(LENGTH_BUCKETS):
        sel = buckets == k
        by_bucket[name] = {"pairs": int(sel.sum()),        # an empty bucket's means are null
                           "win_rate": float(a["win"][sel].mean()) if sel.any() else None,
                           "reward_diff": float(diff[sel].mean()) if sel.any() else None}
    log_ratio_tokens = float(a["policy_log_ratio"].sum() / a["policy_generated_tokens"].sum())

    def bounded(name: str) -> dict:
        b = boot[name]
        return {name: b["point"], f"{name}_ci_low": b["ci_low"], f"{name}_ci_high": b["ci_high"]}

    metrics = {
        "format": record_formats.GENERATION_METRICS,
        "n_prompts": n, "samples_per_prompt": len(rows) // n, "confidence": ev["confidence"],
        **bounded("win_rate"), "ties": int((a["win"] == 0.5).sum()),
        **bounded("reward_diff"),
        "policy_reward_mean": float(a["policy_reward"].mean()),
        "reference_reward_mean": float(a["reference_reward"].mean()),
        "length": {"policy_mean": float(a["policy_length"].mean()),
                   "reference_mean": float(a["reference_length"].mean()),
                   **bounded("reward_diff_at_equal_length"), "reward_diff_per_token": float(b0),
                   "buckets": by_bucket},
        "kl": {**{k.replace("kl_", ""): v for k, v in bounded("kl_per_completion").items()},
               "per_token": log_ratio_tokens},
    }
    gen = params.get("generation")               # absent for a caller that passes evaluate's params only
    if gen is None:                              # (not `or {}`: truth-testing a stage's params view reads it whole)
        gen = {}
    # Greedy completions are no sample of the policy: their log-ratio is not a KL estimate (issue 33); `kl` is then
    # null and `log_ratio` holds the numbers (else `log_ratio` is null).
    greedy = gen.get("temperature") == 0
    metrics["log_ratio"] = metrics["kl"] if greedy else None
    if greedy:
        metrics["kl"] = None
    spec = grader_spec(gen.get("grader"))
    metrics["grader"] = None                     # generation.grader unset
    if spec is not None:
        graded, boot_graded = grader_metrics(rows, a, spec, idx, n, ev["confidence"], source)
        metrics["grader"] = graded
        boot.update(boot_graded)
    metrics["warnings"] = evidence_warnings(rows, metrics, gen)
    summary = {"format": record_formats.JUDGE_SUMMARY, "n_prompts": n, "samples_per_prompt": len(rows) // n,
               "index_matrix": {"shape": [ev["bootstrap_replicates"], n], "dtype": "int64 little-endian, C order",
                                "sha256": index_matrix_digest(idx)},
               "bootstrap": boot, "length_buckets": {name: [lo, hi if math.isfinite(hi) else None]
                                                     for name, lo, hi in LENGTH_BUCKETS},
               "policy_better": boot["win_rate"]["ci_low"] > 0.5}
    return metrics, summary


# When the win rate is not evidence (issue 33): the judge's disagreement with the grader on the prompts where the two
# completions grade differently above this share, or the two sides' mean lengths apart by more than this share of
# the longer.
DISAGREEMENT_LIMIT = 0.25
LENGTH_MISMATCH_LIMIT = 0.5


def grade_rows(rows: list[dict], spec: dict, source: str) -> dict[str, list]:
    """Each judgment row's two completions graded (stages/lib/graders.py); a row that records grades must hold these
    (the judge writes them; `report verify` regrades the packed rows and refuses a row that differs)."""
    out: dict[str, list] = {"policy": [], "reference": []}
    for i, r in enumerate(rows):
        for side in out:
            g = grade(spec, r["prompt"], r[f"{side}_completion"])
            recorded = r.get(f"{side}_grade")
            if recorded is not None and recorded != {"success": g.success, "labels": list(g.labels)}:
                raise PerPairFileError(f"{source} row {i} (pair {r.get('pair_id')}): {side}_grade {recorded} is not "
                                       f"what grader {spec['type']} gives its completion ({g})")
            out[side].append(g)
    return out


def grader_metrics(rows: list[dict], a: dict[str, np.ndarray], spec: dict, idx: np.ndarray, n: int, confidence: float,
                   source: str) -> tuple[dict, dict]:
    """(metrics["grader"], bootstrap entries): graded success rate of policy and reference and their difference, each
    with the paired percentile bootstrap over prompts (the win rate's index matrix); the share of each label per
    side; and the judge's agreement with the grader on the rows whose two completions grade differently (the judge
    agrees when it prefers the one that succeeds; a tie counts 0.5)."""
    grades = grade_rows(rows, spec, source)
    success = {side: np.array([g.success for g in gs], np.float64) for side, gs in grades.items()}
    per_prompt = {"policy_success": _per_prompt(success["policy"], n),
                  "reference_success": _per_prompt(success["reference"], n),
                  "success_diff": _per_prompt(success["policy"] - success["reference"], n)}
    boot = {f"grader_{k}": _describe(v[idx].mean(axis=-1), float(v.mean()), confidence) for k, v in per_prompt.items()}
    differ = success["policy"] != success["reference"]
    agree = np.where(success["policy"] > success["reference"], a["win"], 1.0 - a["win"])[differ]
    labels = {side: sorted({lab for g in gs for lab in g.labels}) for side, gs in grades.items()}

    def bounded(key: str) -> dict:
        b = boot[f"grader_{key}"]
        return {key: b["point"], f"{key}_ci_low": b["ci_low"], f"{key}_ci_high": b["ci_high"]}

    metrics = {"name": spec["type"], **bounded("policy_success"), **bounded("reference_success"),
               **bounded("success_diff"),
               "labels": {side: {lab: float(np.mean([lab in g.labels for g in gs])) for lab in labels[side]}
                          for side, gs in grades.items()},
               "differing": int(differ.sum()),
               "judge_agreement": float(agree.mean()) if differ.any() else None}
    return metrics, boot


def evidence_warnings(rows: list[dict], metrics: dict, gen: dict) -> list[str]:
    """Why the win rate is not evidence, as codes (stages/evidence/generation.py says each in words):
    judge_trained_on_same_pairs, all_hit_max_new_tokens, length_mismatch, judge_disagrees_with_grader."""
    out = []
    if gen.get("judge") == "trained":
        out.append("judge_trained_on_same_pairs")
    if all(r.get(f"{side}_stop_reason") == "max_new_tokens" for r in rows for side in ("policy", "reference")):
        out.append("all_hit_max_new_tokens")
    lp, lr = metrics["length"]["policy_mean"], metrics["length"]["reference_mean"]
    if abs(lp - lr) > LENGTH_MISMATCH_LIMIT * max(lp, lr):
        out.append("length_mismatch")
    agreement = (metrics.get("grader") or {}).get("judge_agreement")
    if agreement is not None and agreement < 1 - DISAGREEMENT_LIMIT:
        out.append("judge_disagrees_with_grader")
    return out
