"""Synthetic inputs for evaluate/report tests, in the exact contract format of docs/ARTIFACTS.md:
probe_manifest.json, probe_token_manifest.json (+ probe_tokens.parquet), the probe pairs' ids and sources
(probe.parquet), per-pair probe JSONL at step 0 and final for DPO and RM, train_log.csv, run_info.json and a
stand-in model directory, the run records the bundle packs (tokenize_report.json, ref_identity.json,
normalize_stats.json naming the data source files); the judge stage's outputs (judgments.jsonl,
metrics/generation.json, judge_summary.json) from seeded judgment rows through the judge's own
evaluate_generation; every other artifact of the pipeline (stages/lib/layout.py) as a stand-in file. A mixture's
probe pairs are dealt to its sources in turn.

Not a trainer: scores are drawn from a seeded generator so that the final checkpoint prefers chosen
more often than step 0 (by `quality`). Also a script, so a DVC stage in a temp repo can run it:

    python tests/synthetic_probe.py --params params.yaml --root .
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import yaml

from stages.engine.settings import TrainSettings
from stages.lib import record_formats
from stages.lib.environment import environment_record
from stages.lib.io import sha256_json, write_json, write_jsonl, write_parquet
from stages.lib.stage_plan import bundle_artifacts


TRAIN_PAIRS = 100


def make_probe(n: int, seed: int = 0) -> tuple[dict, dict, list[dict]]:
    """(probe_manifest, probe_token_manifest, probe token rows) for n synthetic pairs."""
    rng = np.random.default_rng(seed)
    pair_ids, content_hashes, token_rows = [], [], []
    for i in range(n):
        content = {"prompt": [{"role": "user", "content": f"q{seed}-{i}"}],
                   "chosen": [{"role": "assistant", "content": f"good {i}"}],
                   "rejected": [{"role": "assistant", "content": f"bad {i}"}]}
        ch = sha256_json(content)
        pair_ids.append(ch[:24])
        content_hashes.append(ch)
        plen = int(rng.integers(3, 10))
        prompt = rng.integers(0, 1000, plen).tolist()
        chosen = prompt + rng.integers(0, 1000, int(rng.integers(1, 8))).tolist()
        rejected = prompt + rng.integers(0, 1000, int(rng.integers(1, 8))).tolist()
        token_rows.append({"pair_id": ch[:24], "chosen_ids": chosen, "chosen_prompt_len": plen,
                           "rejected_ids": rejected, "rejected_prompt_len": plen, "margin": None,
                           "token_hash": sha256_json([chosen, plen, rejected, plen])})
    probe_digest = sha256_json([[p, h] for p, h in zip(pair_ids, content_hashes)])
    probe_manifest = {"size": n, "seed": seed, "selection": "synthetic", "pair_ids": pair_ids,
                      "content_hashes": content_hashes, "probe_digest": probe_digest, "train_pairs": TRAIN_PAIRS,
                      "excluded_from_train": []}
    token_hashes = [r["token_hash"] for r in token_rows]
    token_manifest = {"pair_ids": pair_ids, "token_hashes": token_hashes,
                      "token_digest": sha256_json(token_hashes), "probe_digest": probe_digest,
                      "tokenizer_identity": {"name": "synthetic"}}
    return probe_manifest, token_manifest, token_rows


def _correct(c: float, r: float) -> float:
    return 1.0 if c > r else 0.0 if c < r else 0.5


def dpo_rows(token_manifest: dict, beta: float, seed: int, quality: float, step0: bool,
             reference_free: bool = False) -> list[dict]:
    rng = np.random.default_rng([seed, 1])
    rows = []
    for i, (pid, th) in enumerate(zip(token_manifest["pair_ids"], token_manifest["token_hashes"])):
        rc, rr = (0.0, 0.0) if reference_free else (float(-rng.uniform(20, 80)), float(-rng.uniform(20, 80)))
        base_c, base_r = float(-rng.uniform(20, 80)), float(-rng.uniform(20, 80))
        shift = float(rng.normal(quality, 1.0))  # drawn at step 0 too: same stream, same reference
        pc, pr = (base_c, base_r) if reference_free else (rc, rr)  # policy == reference at step 0
        if not step0:
            pc, pr = pc + shift / 2, pr - shift / 2
        cr, rj = beta * (pc - rc), beta * (pr - rr)
        rows.append({"pair_id": pid, "index": i, "token_hash": th, "policy_chosen_logp": pc,
                     "policy_rejected_logp": pr, "ref_chosen_logp": rc, "ref_rejected_logp": rr,
                     "chosen_reward": cr, "rejected_reward": rj, "margin": cr - rj, "correct": _correct(cr, rj)})
    return rows


def rm_rows(token_manifest: dict, seed: int, quality: float, step0: bool) -> list[dict]:
    rng = np.random.default_rng([seed, 2])
    rows = []
    for i, (pid, th) in enumerate(zip(token_manifest["pair_ids"], token_manifest["token_hashes"])):
        cs, rs, shift = float(rng.normal()), float(rng.normal()), float(rng.normal(quality, 0.5))
        if not step0:
            cs += shift
        rows.append({"pair_id": pid, "index": i, "token_hash": th, "chosen_score": cs, "rejected_score": rs,
                     "margin": cs - rs, "correct": _correct(cs, rs)})
    return rows


def write_train_dir(out: Path, seed: int, record: dict, objective: str, settings: dict, probe_pairs: int,
                    steps: int = 12) -> None:
    rng = np.random.default_rng([seed, 3])
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train_log.csv", "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["step", "loss", "accuracy", "margin", "lr", "grad_norm"])
        for s in range(1, steps + 1):
            w.writerow([s, round(0.69 * np.exp(-s / 8) + rng.uniform(0, 0.02), 6), round(min(1, 0.5 + s / 30), 6),
                        round(s / 10, 6), 1e-3, round(float(rng.uniform(0.5, 2)), 6)])
    # DVCLive's folder as the loop writes it (stages/engine/live_log.py): the summary and one history per metric.
    live = out / "dvclive"
    (live / "plots" / "metrics").mkdir(parents=True, exist_ok=True)
    (live / "metrics.json").write_text(json.dumps({"loss": 0.5, "step": steps}, indent=4, sort_keys=True) + "\n")
    (live / "plots" / "metrics" / "loss.tsv").write_text("step\tloss\n" + "".join(f"{s}\t0.5\n"
                                                                                 for s in range(1, steps + 1)))
    # run_info as the trainer writes it (a hashed output: deterministic, no host, path or timing), plus the per-rank
    # plan that environment.json's whitelist leaves out.
    write_json(out / "run_info.json", {
        "format": record_formats.RUN_INFO, "world_size": 1, "backend": "gloo", "environment": record, "objective": objective, "settings": settings,
        "train_pairs": TRAIN_PAIRS, "probe_pairs": probe_pairs, "optimizer_steps": steps,
        "per_rank": [{"rank": 0, "pairs": TRAIN_PAIRS, "micro_batches": steps}]})
    model = out / "model"
    (model / "sub").mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({"seed": seed}))
    (model / "model.safetensors").write_bytes(hashlib.sha256(str(seed).encode()).digest() * 64)
    (model / "sub" / "optimizer.pt").write_bytes(b"optimizer-state" * 10)


def write_all(root: Path, params: dict, quality: float = 0.8, normalize: bool = True) -> None:
    """Every synthetic artifact; `normalize`: also the data source files and normalize's outputs (a DVC test runs
    those as a stage of their own, with the sources as its deps)."""
    root = Path(root)
    n, seed, beta = params["probe"]["size"], params["train"]["seed"], params["dpo"]["beta"]
    probe_manifest, token_manifest, token_rows = make_probe(n, params["probe"]["seed"])
    write_json(root / "results/probe/probe_manifest.json", probe_manifest)
    write_json(root / "results/tokens/probe_token_manifest.json", token_manifest)
    write_parquet(root / "results/tokens/probe_tokens.parquet", pa.Table.from_pylist(token_rows))
    ref_free = params["dpo"]["objective"] == "dpo_ref_free"
    for step0, name in ((True, "probe_step0.jsonl"), (False, "probe_final.jsonl")):
        write_jsonl(root / "results/train_dpo" / name, dpo_rows(token_manifest, beta, seed, quality, step0, ref_free))
        write_jsonl(root / "results/train_rm" / name, rm_rows(token_manifest, seed, quality, step0))
    # The real environment record of this process, as the environment stage writes it.
    record = environment_record(params["train"])
    write_json(root / "results/env/environment.json", record)
    # The settings record the engine writes into run_info.json, from the same params.
    settings = TrainSettings.from_params(params).record()
    write_train_dir(root / "results/train_dpo", seed, record, params["dpo"]["objective"], settings, n)
    write_train_dir(root / "results/train_rm", seed + 1, record, "reward_model", settings, n)
    names = source_names(params)
    write_parquet(root / "results/probe/probe.parquet", pa.Table.from_pylist(
        [{"pair_id": pid, "source": names[i % len(names)]} for i, pid in enumerate(probe_manifest["pair_ids"])]))
    write_tokenize_report(root, params, token_manifest)
    write_ref_identity(root, params)
    if params.get("sft") is not None:
        write_sft(root, params, record, seed, n)
    if normalize:
        write_sources(root, params)
        write_normalize(root, params)
    write_judge(root, params, token_manifest, seed)
    for rel, stage in bundle_artifacts(params).items():
        if stage in ("freeze_probe", "verify_ref", "tokenize", "ref_logps", "generate") and not (root / rel).exists():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(f"stand-in for {rel} (seed {seed})\n")


def source_names(params: dict) -> list[str]:
    return [src.get("name", f"source{k}") for k, src in enumerate(params["data"]["sources"])]


def write_tokenize_report(root: Path, params: dict, token_manifest: dict) -> None:
    """tokenize_report.json in its contract shape: nothing truncated or rejected."""
    def split(n: int) -> dict:
        return {"pairs_in": n, "pairs_out": n, "rejected": 0, "rejected_by_reason": {}, "truncated": 0,
                "truncated_by_reason": {"completion_cut": 0, "prompt_text_cut": 0, "prompt_turns_dropped": 0}}
    splits = {"probe": split(params["probe"]["size"]), "train": split(TRAIN_PAIRS)}
    write_json(root / "results/tokens/tokenize_report.json", {
        "limits": {k: params["tokenize"][k] for k in ("max_length", "max_prompt_length", "truncation")},
        "rendering": "plain", "tokenizer_identity": token_manifest["tokenizer_identity"], "splits": splits,
        "totals": {k: splits["probe"][k] + splits["train"][k] for k in ("pairs_in", "pairs_out", "rejected",
                                                                         "truncated")}})


def write_ref_identity(root: Path, params: dict) -> None:
    """ref_identity.json in its contract shape for params' ref (as verify_ref writes it; no files are read)."""
    from stages.lib.reference import IDENTITY_FORMAT, identity_digest
    ref = params["ref"]
    revision = ref.get("revision") or "0" * 64
    identity = {"format": IDENTITY_FORMAT, "source": ref["source"], "repo_id": ref["repo_id"], "revision": revision,
                "revision_pinned": ref.get("revision") is not None, "local_dir": ref["local_dir"],
                "lock": {"path": "prefpipe.lock.json", "size": 10, "sha256": revision} if ref["source"] == "local"
                else None, "files": [{"path": "config.json", "size": 2, "algo": "sha256", "hash": "1" * 64}],
                "extras": []}
    identity["identity_digest"] = identity_digest(identity)
    write_json(root / "results/ref/ref_identity.json", identity)


def write_sft(root: Path, params: dict, record: dict, seed: int, probe_pairs: int) -> None:
    """The sft stage's outputs in their contract shapes: its run, its pinned export's identity (provenance naming the
    synthetic reference's identity) and sft_data.json agreeing with both."""
    from stages.lib.reference import IDENTITY_FORMAT, identity_digest
    from stages.lib.io import read_json
    from stages.sft import sft_settings
    out = root / "results/sft"
    write_train_dir(out, seed + 1, record, "sft", sft_settings(params).record(), probe_pairs)
    for name in ("probe_step0.jsonl", "probe_final.jsonl"):
        (out / name).write_text(f"stand-in for sft {name} (seed {seed})\n")
    base = read_json(root / "results/ref/ref_identity.json")
    identity = {"format": IDENTITY_FORMAT, "source": "local", "repo_id": f"sft/{base['repo_id']}", "revision": "2" * 64,
                "revision_pinned": True, "local_dir": "results/sft/model",
                "lock": {"path": "prefpipe.lock.json", "size": 10, "sha256": "2" * 64},
                "files": [{"path": "config.json", "size": 2, "algo": "sha256", "hash": "3" * 64}], "extras": []}
    identity["identity_digest"] = identity_digest(identity)
    write_json(out / "ref_identity.json", identity)
    provenance = {"stage": "sft", "base": {k: base[k] for k in ("repo_id", "revision", "identity_digest")},
                  "data_digest": "4" * 64, "settings_digest": "5" * 64, "objective": {"objective": "sft"}}
    sources = params["sft"].get("sources")
    write_json(out / "sft_data.json", {
        "format": record_formats.SFT_DATA, "mode": "preferred_ft" if sources is None else "sources",
        **({"from": "results/tokens/train_tokens.parquet", "rows_read": TRAIN_PAIRS, "sources": None,
            "examples_by_source": None} if sources is None else
           {"from": None, "rows_read": None, "sources": sources, "examples_by_source": {"embedded_sft": TRAIN_PAIRS}}),
        "examples": TRAIN_PAIRS, "completion_tokens": 10 * TRAIN_PAIRS, "data_digest": "4" * 64,
        "refused": {"by_reason": {}, "examples": {}}, "provenance": provenance,
        "identity_digest": identity["identity_digest"]})


def judgment_rows(pair_ids: list[str], seed: int) -> list[dict]:
    """One judged (prompt, sample) per probe pair, as the judge stage writes them; the policy wins more often."""
    from stages.lib.contracts import correct_label
    rng = np.random.default_rng(seed + 28)
    rows = []
    for i, pair_id in enumerate(pair_ids):
        pl, rl = int(rng.integers(0, 16)), int(rng.integers(0, 16))
        rp, rr = float(rng.normal(0.3, 1)), float(rng.normal(0, 1))
        rows.append({"pair_id": pair_id, "index": i, "sample": 0,
                     "prompt": [{"role": "user", "content": f"question {i} <b>|</b>"}],
                     "policy_completion": f"answer {i}\nwith | a pipe", "policy_length": pl,
                     "policy_stop_reason": "eos", "policy_reward": rp,
                     "reference_completion": "" if i == 1 else f"ref {i}", "reference_length": rl,
                     "reference_stop_reason": "max_new_tokens", "reference_reward": rr, "win": correct_label(rp, rr),
                     "policy_log_ratio": float(rng.normal(1, 0.5)), "policy_generated_tokens": pl + 1})
    return rows


def write_judge(root: Path, params: dict, token_manifest: dict, seed: int) -> None:
    from stages.lib.layout import STAGE_OUTPUTS
    from stages.evidence.scoring import evaluate_generation
    out = STAGE_OUTPUTS["judge"]
    rows = judgment_rows(token_manifest["pair_ids"], seed)
    metrics, summary = evaluate_generation(rows, params, out["judgments"])
    write_jsonl(root / out["judgments"], rows)
    write_json(root / out["metrics_generation"], metrics)
    write_json(root / out["summary"], {**summary, "judge": {"kind": "trained", "model": "results/train_rm/model"}})


def write_sources(root: Path, params: dict) -> None:
    """A few rows for each data source file that does not exist (an absolute path is used as is)."""
    for k, src in enumerate(params["data"]["sources"]):
        path = Path(src["path"]) if Path(src["path"]).is_absolute() else root / src["path"]
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps({"prompt": f"q{k}-{i}", "chosen": "a", "rejected": "b"}) + "\n"
                                    for i in range(3)))


def write_normalize(root: Path, params: dict) -> None:
    """normalize's outputs as stand-ins, but for normalize_stats.json in its contract shape, naming each source's
    file as normalize records it (the path as params.yaml writes it)."""
    sources = [{"name": name, "path": src["path"], "format": src["format"],
                "files": [{"path": src["path"], "rows": 3}], "rows_in": 3, "pairs_out": 3, "rejected_total": 0,
                "rejected": {"json": 0}} for name, src in zip(source_names(params), params["data"]["sources"])]
    write_json(root / "results/normalize/normalize_stats.json", {"sources": sources, "totals": {
        "rows_in": 3 * len(sources), "pairs_out": 3 * len(sources), "rejected_total": 0}})
    for name in ("pairs.parquet", "rejections.parquet"):
        (root / "results/normalize" / name).write_text(f"stand-in for normalize's {name}\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", required=True)
    ap.add_argument("--root", default=".")
    ap.add_argument("--part", choices=["all", "normalize", "rest"], default="all",
                    help="normalize: normalize's outputs only; rest: everything else")
    a = ap.parse_args()
    with open(a.params) as f:
        params = yaml.safe_load(f)
    if a.part == "normalize":
        write_normalize(Path(a.root), params)
    else:
        write_all(Path(a.root), params, normalize=a.part == "all")
