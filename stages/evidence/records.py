"""The run records an evidence bundle packs whole, and the summary's account of what ran, made from them.

A reviewer holding only the bundle must see what was trained on what. So the small JSON records of the run are
packed (no weights, no data): normalize_stats.json (each source, its rows, pairs and rejections by reason),
tokenize_report.json (limits, pairs in/out, truncated and rejected by reason), ref_identity.json (the reference's
repo, revision and files), and each trainer's run_info.json (objective, settings, pairs trained, steps). A record
that names an absolute path (a data source or a reference outside the checkout) is packed with that path written
portably (stages.evidence.bundle.portable_path): the bundle never carries a machine's layout.

Beside them the bundle holds `probe_sources.json`, the source of every probe pair in probe order (from
results/probe/probe.parquet), the join that per-source accuracy needs.

summary.md's "What ran" sections are made here from those members alone (summary_sections), so `report verify`
remakes them from the bundle; per-source accuracy uses evaluate's own scoring and paired bootstrap
(stages/evidence/scoring.py) on each source's probe pairs, for mixtures (more than one source). record_problems is what
verify holds the records to: their own arithmetic, one another, the probe manifests and the params.
"""
from __future__ import annotations

import copy
import json
from collections import Counter
from typing import Any, Callable

from stages.lib.layout import STAGE_OUTPUTS
from stages.lib.stage_plan import TRAINED

NORMALIZE_STATS = STAGE_OUTPUTS["normalize"]["stats"]
TOKENIZE_REPORT = STAGE_OUTPUTS["tokenize"]["report"]
REF_IDENTITY = STAGE_OUTPUTS["verify_ref"]["identity"]
RUN_INFO = {label: STAGE_OUTPUTS[stage]["run_info"] for label, stage in TRAINED.items()}
# Artifact path -> the role it has in the manifest: packed whole (as the per-pair rows and metrics are).
SFT_DATA = STAGE_OUTPUTS["sft"]["data_report"]
SFT_IDENTITY = STAGE_OUTPUTS["sft"]["identity"]
SFT_RUN_INFO = STAGE_OUTPUTS["sft"]["run_info"]
RECORDS: dict[str, str] = {NORMALIZE_STATS: "normalize_stats", TOKENIZE_REPORT: "tokenize_report",
                           REF_IDENTITY: "ref_identity", **{p: "run_info" for p in RUN_INFO.values()},
                           SFT_DATA: "sft_data", SFT_IDENTITY: "sft_identity", SFT_RUN_INFO: "sft_run_info"}
PROBE_SOURCES = "probe_sources.json"        # a member under the bundle root


def portable_record(rel: str, data: bytes, portable_path: Callable[..., str]) -> bytes:
    """A record as the bundle packs it: its own bytes, unless it names an absolute path; then the same JSON (the
    form stages.lib.io.write_json writes) with each such path written portably."""
    obj = json.loads(data)
    out = copy.deepcopy(obj)
    if rel == NORMALIZE_STATS:
        for src in out.get("sources") or []:
            path = src.get("path")
            for f in src.get("files") or []:
                if isinstance(f.get("path"), str) and isinstance(path, str):
                    f["path"] = portable_path(f["path"], path)
            if isinstance(path, str):
                src["path"] = portable_path(path)
    elif rel == REF_IDENTITY and isinstance(out.get("local_dir"), str):
        out["local_dir"] = portable_path(out["local_dir"])
    if out == obj:
        return data
    return (json.dumps(out, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


def probe_sources_record(probe_manifest: dict, pair_ids: list[str], sources: list[str]) -> dict:
    """probe_sources.json from the probe pairs (pair_id, source in the probe parquet's order), which must be the
    manifest's probe in its order."""
    if pair_ids != probe_manifest.get("pair_ids"):
        raise ValueError("the probe pairs are not the probe manifest's pairs in its order: rerun freeze_probe")
    return {"probe_digest": probe_manifest.get("probe_digest"), "sources": list(sources)}


# --------------------------------------------------------------------------------------------------
# Reading them back from a bundle's members
# --------------------------------------------------------------------------------------------------

def bundle_records(members: dict[str, bytes], root: str) -> dict[str, Any]:
    """The records, probe_sources and per-pair rows a bundle packs ({} / None where absent), by role."""
    def packed(rel: str) -> Any:
        data = members.get(f"{root}/artifacts/{rel}")
        return json.loads(data) if data is not None else None

    def rows(rel: str) -> list[dict] | None:
        data = members.get(f"{root}/artifacts/{rel}")
        return None if data is None else [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]

    sources = members.get(f"{root}/{PROBE_SOURCES}")
    return {
        "normalize_stats": packed(NORMALIZE_STATS), "tokenize_report": packed(TOKENIZE_REPORT),
        "ref_identity": packed(REF_IDENTITY),
        "sft": {"data": packed(SFT_DATA), "identity": packed(SFT_IDENTITY), "run_info": packed(SFT_RUN_INFO)},
        "run_info": {label: info for label, rel in RUN_INFO.items() if (info := packed(rel)) is not None},
        "probe_sources": json.loads(sources) if sources is not None else None,
        "per_pair": {label: {which: rows(STAGE_OUTPUTS[stage][f"probe_{which}"]) for which in ("step0", "final")}
                     for label, stage in TRAINED.items()},
    }


# --------------------------------------------------------------------------------------------------
# Per-source accuracy: evaluate's scores and paired bootstrap on each source's probe pairs
# --------------------------------------------------------------------------------------------------

def per_source_accuracy(records: dict, params: dict) -> dict[str, dict[str, dict]]:
    """{model: {source: {n_pairs, step0, final, final_ci, improvement, improvement_ci}}} for a mixture (more than
    one source), {} otherwise; a source with no probe pair gets {n_pairs: 0}. The same bootstrap as evaluate
    (replicates, seed, confidence of params.evaluate) over each source's pairs."""
    import numpy as np

    from stages.evidence import scoring
    stats, probe = records.get("normalize_stats") or {}, records.get("probe_sources") or {}
    names = [s.get("name") for s in stats.get("sources") or []]
    sources = probe.get("sources") or []
    if len(names) < 2 or not sources:
        return {}
    ev, out = params["evaluate"], {}
    for label, rows in sorted((records.get("per_pair") or {}).items()):
        if not rows.get("step0") or not rows.get("final"):
            continue
        if label == "dpo":
            beta, free = float(params["dpo"]["beta"]), params["dpo"]["objective"] == "dpo_ref_free"
            scored = [scoring.score_dpo_rows(rows[w], beta, free, w) for w in ("step0", "final")]
        else:
            scored = [scoring.score_rm_rows(rows[w], w) for w in ("step0", "final")]
        if any(len(s["correct"]) != len(sources) for s in scored):
            raise ValueError(f"{label}: {len(scored[1]['correct'])} per-pair rows, probe_sources has {len(sources)}")
        out[label] = {}
        for name in names:
            idx = np.asarray([i for i, s in enumerate(sources) if s == name], dtype=np.int64)
            if not len(idx):
                out[label][name] = {"n_pairs": 0}
                continue
            # (the arrays; a DPO score also names its implicit reward, one string for the file)
            s0, fi = ({k: v[idx] for k, v in s.items() if isinstance(v, np.ndarray)} for s in scored)
            acc = scoring.paired_bootstrap(s0, fi, ev["bootstrap_replicates"], ev["seed"], ev["confidence"])["accuracy"]
            out[label][name] = {"n_pairs": int(len(idx)), "step0": acc["step0"]["point"], "final": acc["final"]["point"],
                                "final_ci": [acc["final"]["ci_low"], acc["final"]["ci_high"]],
                                "improvement": acc["improvement"]["point"],
                                "improvement_ci": [acc["improvement"]["ci_low"], acc["improvement"]["ci_high"]]}
    return out


# --------------------------------------------------------------------------------------------------
# summary.md: what ran
# --------------------------------------------------------------------------------------------------

def _f(x: float) -> str:
    return f"{x:.4f}"


def _by_reason(counts: dict | None) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in sorted((counts or {}).items()) if n)


def _adapter(settings: dict) -> str:
    a = settings.get("adapter")
    if not a:
        return "none (full fine-tuning)"
    targets = a.get("target_modules")
    return (f"{a.get('type')} r {a.get('r')}, alpha {a.get('alpha')}, dropout {a.get('dropout')}, on "
            f"{targets if isinstance(targets, str) else ', '.join(targets or [])}")


def _loss(label: str, params: dict) -> tuple[str, str]:
    """(loss, beta) of a model as params name them (report verify holds params to dvc.lock and the runs)."""
    if label == "dpo":
        loss = params["dpo"]["loss"]
        return (loss if isinstance(loss, str) else " + ".join(loss)), str(params["dpo"]["beta"])
    rm = params.get("rm") or {}
    extra = [f"center {rm['center_rewards_coefficient']}" if rm.get("center_rewards_coefficient") else "",
             "minus the pair's margin" if rm.get("use_margin") else ""]
    return "pairwise logistic" + "".join(f", {e}" for e in extra if e), "-"


def sft_lines(sft: dict, params: dict) -> list[str]:
    """What ran of the sft stage: its data, its run, the pinned export every later stage used as the reference."""
    if params.get("sft") is None:
        return ["SFT: none (params `sft` is null): the pinned reference is the reference of every stage.", ""]
    data, identity, info = sft.get("data") or {}, sft.get("identity") or {}, sft.get("run_info") or {}
    st = info.get("settings") or {}
    mode = ("Preferred-FT: the train split's chosen completions" if data.get("mode") == "preferred_ft" else
            "sources " + ", ".join(f"{s.get('name') or s.get('path')} (`{s.get('path')}`, {s.get('format')})"
                                   for s in data.get("sources") or []))
    refused = _by_reason((data.get("refused") or {}).get("by_reason")) or "none"
    base = (data.get("provenance") or {}).get("base") or {}
    return [f"SFT (completion-only, stage `sft`): {mode}; {data.get('examples')} examples, "
            f"{data.get('completion_tokens')} completion tokens; refused: {refused}. lr {st.get('lr')}, epochs "
            f"{st.get('epochs')}, adapter {_adapter(st)}, {info.get('optimizer_steps')} optimizer steps, world size "
            f"{info.get('world_size')}. Its export `{identity.get('repo_id')}` (`{identity.get('local_dir')}`, "
            f"revision `{identity.get('revision')}`, from base `{base.get('repo_id')}` identity "
            f"`{base.get('identity_digest')}`, data digest `{data.get('data_digest')}`) is the reference of "
            "ref_logps, train_dpo, train_rm and generate.", ""]


def _steps(info: dict) -> str:
    """The optimizer steps, and what train.max_steps cut them from (absent: uncapped, the cell as it always was)."""
    capped = info.get("steps_uncapped")
    return f"{info.get('optimizer_steps')}" + (f" (train.max_steps: of {capped})" if capped is not None else "")


def summary_sections(records: dict, params: dict) -> list[str]:
    """The summary's "What ran" and (mixtures) "Per-source probe accuracy" lines."""
    lines = ["## What ran", ""]
    stats = records.get("normalize_stats")
    if stats:
        lines += ["Data (normalize: every row is a pair or a reason-coded rejection):", "",
                  "| source | path | format | rows | pairs | rejected | rejected by reason |", "|---|---|---|---|---|---|---|"]
        for s in stats.get("sources") or []:
            lines.append(f"| {s.get('name')} | `{s.get('path')}` | {s.get('format')} | {s.get('rows_in')} | "
                         f"{s.get('pairs_out')} | {s.get('rejected_total')} | {_by_reason(s.get('rejected')) or '-'} |")
        lines.append("")
    tok = records.get("tokenize_report")
    if stats and tok:
        # Where the normalized pairs went (freeze_probe): the probe, train, and the train pairs sharing a probe prompt.
        pairs = (stats.get("totals") or {}).get("pairs_out")
        train_in = ((tok.get("splits") or {}).get("train") or {}).get("pairs_in")
        probe_in = ((tok.get("splits") or {}).get("probe") or {}).get("pairs_in")
        if None not in (pairs, train_in, probe_in) and pairs >= probe_in + train_in:
            lines += [f"Split (freeze_probe, seed {params['probe']['seed']}): {pairs} pairs = {probe_in} probe + "
                      f"{train_in} train + {pairs - probe_in - train_in} excluded from train because their prompt is "
                      "a probe prompt (probe_manifest.json `excluded_from_train`).", ""]
    if tok:
        lim = tok.get("limits") or {}
        lines += [f"Tokenize (max_length {lim.get('max_length')}, max_prompt_length {lim.get('max_prompt_length')}, "
                  f"truncation {lim.get('truncation')}):", "",
                  "| split | pairs in | pairs out | truncated | rejected | by reason |", "|---|---|---|---|---|---|"]
        for split in ("train", "probe"):
            s = (tok.get("splits") or {}).get(split) or {}
            reasons = "; ".join(f"{what}: {text}" for what, text in (
                ("truncated", _by_reason(s.get("truncated_by_reason"))),
                ("rejected", _by_reason(s.get("rejected_by_reason")))) if text)
            lines.append(f"| {split} | {s.get('pairs_in')} | {s.get('pairs_out')} | {s.get('truncated')} | "
                         f"{s.get('rejected')} | {reasons or '-'} |")
        lines.append("")
    ref = records.get("ref_identity")
    if ref:
        pinned = "pinned" if ref.get("revision_pinned") else "not pinned in params (the lock's own sha256)"
        lines += [f"Reference: `{ref.get('repo_id')}` ({ref.get('source')}, `{ref.get('local_dir')}`) at revision "
                  f"`{ref.get('revision')}` ({pinned}), {len(ref.get('files') or [])} files verified.", ""]
    lines += sft_lines(records.get("sft") or {}, params)
    infos = records.get("run_info") or {}
    if infos:
        lines += ["Training (each run's record, run_info.json):", "",
                  "| model | objective | loss | beta | lr | schedule (warmup) | pairs a step | epochs | seed | adapter "
                  "| pairs trained | optimizer steps | world size |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for label, info in sorted(infos.items()):
            st = info.get("settings") or {}
            loss, beta = _loss(label, params)
            lines.append(f"| {label} | {info.get('objective')} | {loss} | {beta} | {st.get('lr')} | "
                         f"{st.get('schedule')} ({st.get('warmup_ratio')}) | {st.get('global_batch_pairs')} | "
                         f"{st.get('epochs')} | {st.get('seed')} | {_adapter(st)} | {info.get('train_pairs')} | "
                         f"{_steps(info)} | {info.get('world_size')} |")
        lines.append("")
    per_source = per_source_accuracy(records, params)
    if per_source:
        ci = int(round(params["evaluate"]["confidence"] * 100))
        lines += ["## Per-source probe accuracy", "",
                  f"Each source's probe pairs, the same paired bootstrap as above ({ci}% intervals).", "",
                  "| model | source | probe pairs | step-0 accuracy | final accuracy [CI] | improvement [CI] |",
                  "|---|---|---|---|---|---|"]
        for label, by_source in sorted(per_source.items()):
            for name, m in by_source.items():
                if not m["n_pairs"]:
                    lines.append(f"| {label} | {name} | 0 | - | - | - |")
                    continue
                lines.append(f"| {label} | {name} | {m['n_pairs']} | {_f(m['step0'])} | {_f(m['final'])} "
                             f"[{_f(m['final_ci'][0])}, {_f(m['final_ci'][1])}] | {_f(m['improvement'])} "
                             f"[{_f(m['improvement_ci'][0])}, {_f(m['improvement_ci'][1])}] |")
        lines.append("")
    return lines


# --------------------------------------------------------------------------------------------------
# What verify holds the records to
# --------------------------------------------------------------------------------------------------

def record_problems(records: dict, params: dict, probe_manifest: dict | None, token_manifest: dict | None,
                    sources: list[dict] | None, portable_path: Callable[..., str]) -> dict[str, list[str]]:
    """{record: problems} for each packed record: its own arithmetic, the other records, the packed probe
    manifests, the manifest's `sources` and params. An absent record is a problem of its own."""
    from stages.lib.reference import identity_digest
    out: dict[str, list[str]] = {}
    stats, tok, ref = records.get("normalize_stats"), records.get("tokenize_report"), records.get("ref_identity")
    infos, probe = records.get("run_info") or {}, records.get("probe_sources")
    pm, tm = probe_manifest or {}, token_manifest or {}

    p: list[str] = out.setdefault(NORMALIZE_STATS, [])
    if not isinstance(stats, dict):
        p.append("not packed")
    else:
        srcs = stats.get("sources") or []
        for s in srcs:
            rejected = sum((s.get("rejected") or {}).values())
            if s.get("rows_in") != (s.get("pairs_out") or 0) + (s.get("rejected_total") or 0) or rejected != s.get("rejected_total"):
                p.append(f"source {s.get('name')}: rows_in {s.get('rows_in')} != pairs_out {s.get('pairs_out')} + "
                         f"rejected {s.get('rejected_total')} (by reason {rejected})")
        totals = stats.get("totals") or {}
        for key in ("rows_in", "pairs_out", "rejected_total"):
            if totals.get(key) != sum(s.get(key) or 0 for s in srcs):
                p.append(f"totals.{key} {totals.get(key)} is not the sources' sum")
        if sources is not None and [(s.get("name"), s.get("path"), [f.get("path") for f in s.get("files") or []])
                                    for s in srcs] != [(s.get("name"), s.get("path"), [f.get("path") for f in s["files"]])
                                                       for s in sources]:
            p.append("its sources (names, paths, files) are not the manifest's `sources`")
        if [s.get("path") for s in srcs] != [portable_path(s["path"]) for s in params["data"]["sources"]]:
            p.append("its sources are not params.yaml's data.sources")

    p = out.setdefault(TOKENIZE_REPORT, [])
    if not isinstance(tok, dict):
        p.append("not packed")
    else:
        limits = {k: params["tokenize"][k] for k in ("max_length", "max_prompt_length", "truncation")}
        if {k: (tok.get("limits") or {}).get(k) for k in limits} != limits:
            p.append(f"limits {tok.get('limits')} are not params.yaml's tokenize {limits}")
        if "limits" in tm and tok.get("limits") != tm["limits"]:
            p.append("limits differ from the probe token manifest's")
        if tm and tok.get("tokenizer_identity") != tm.get("tokenizer_identity"):
            p.append("tokenizer_identity differs from the probe token manifest's")
        splits = tok.get("splits") or {}
        pr, tr = splits.get("probe") or {}, splits.get("train") or {}
        if pr.get("pairs_out") != params["probe"]["size"]:
            p.append(f"probe pairs_out {pr.get('pairs_out')} is not probe.size {params['probe']['size']}")
        if tm:
            reasons = Counter(t.get("reason") for t in tm.get("truncated") or [])
            if pr.get("truncated") != sum(reasons.values()) or \
                    {k: v for k, v in (pr.get("truncated_by_reason") or {}).items() if v} != dict(reasons):
                p.append(f"probe truncated {pr.get('truncated')} {pr.get('truncated_by_reason')} is not the probe "
                         f"token manifest's record {dict(reasons)}")
        dev_size = params["probe"].get("dev_size", 0)
        if dev_size and (splits.get("dev") or {}).get("pairs_out") != dev_size:
            p.append(f"dev pairs_out {(splits.get('dev') or {}).get('pairs_out')} is not probe.dev_size {dev_size}")
        if pm and tr.get("pairs_in") != pm.get("train_pairs"):
            p.append(f"train pairs_in {tr.get('pairs_in')} is not the probe manifest's train_pairs {pm.get('train_pairs')}")
        for key in ("pairs_in", "pairs_out", "rejected", "truncated"):
            # every split: train, probe and (probe.dev_size > 0) dev
            if (tok.get("totals") or {}).get(key) != sum((s.get(key) or 0) for s in splits.values()
                                                         if isinstance(s, dict)):
                p.append(f"totals.{key} is not the splits' sum")
        for label, info in sorted(infos.items()):
            if info.get("train_pairs") != tr.get("pairs_out") or info.get("probe_pairs") != pr.get("pairs_out"):
                p.append(f"the {label} run trained {info.get('train_pairs')} pairs and scored {info.get('probe_pairs')}; "
                         f"tokenize wrote {tr.get('pairs_out')} and {pr.get('pairs_out')}")

    p = out.setdefault(REF_IDENTITY, [])
    if not isinstance(ref, dict):
        p.append("not packed")
    else:
        want = params["ref"]
        if (ref.get("source"), ref.get("repo_id")) != (want["source"], want["repo_id"]):
            p.append(f"{ref.get('source')} {ref.get('repo_id')!r} is not params.yaml's ref {want['source']} "
                     f"{want['repo_id']!r}")
        if want.get("revision") is not None and ref.get("revision") != want["revision"]:
            p.append(f"revision {ref.get('revision')} is not params.yaml's ref.revision {want['revision']}")
        if ref.get("local_dir") != portable_path(want["local_dir"]):
            p.append(f"local_dir {ref.get('local_dir')!r} is not params.yaml's ref.local_dir")
        elif not str(ref.get("local_dir")).startswith("external:") and ref.get("identity_digest") != identity_digest(ref):
            # (a record packed with its local_dir written portably is not the one its digest was taken over)
            p.append("identity_digest is not the digest of its fields: the record was edited")

    if params.get("sft") is not None:
        sft = records.get("sft") or {}
        data, sid, sinfo = sft.get("data"), sft.get("identity"), sft.get("run_info")
        p = out.setdefault(SFT_IDENTITY, [])
        if not isinstance(sid, dict):
            p.append("not packed")
        elif sid.get("identity_digest") != identity_digest(sid):
            p.append("identity_digest is not the digest of its fields: the record was edited")
        p = out.setdefault(SFT_DATA, [])
        if not isinstance(data, dict):
            p.append("not packed")
        else:
            if isinstance(sid, dict) and data.get("identity_digest") != sid.get("identity_digest"):
                p.append("its identity_digest is not the packed SFT identity's")
            base = (data.get("provenance") or {}).get("base") or {}
            if isinstance(ref, dict) and base.get("identity_digest") != ref.get("identity_digest"):
                p.append(f"SFT started from identity {base.get('identity_digest')}, not the verified reference's "
                         f"{ref.get('identity_digest')}")
            want = (params["sft"].get("sources") is None, data.get("mode") == "preferred_ft")
            if want[0] != want[1]:
                p.append(f"mode {data.get('mode')!r} is not what params sft.sources make it")
        p = out.setdefault(SFT_RUN_INFO, [])
        if not isinstance(sinfo, dict):
            p.append("not packed")
        else:
            if sinfo.get("objective") != "sft":
                p.append(f"objective {sinfo.get('objective')!r}, not sft")
            if isinstance(data, dict) and sinfo.get("train_pairs") != data.get("examples"):
                p.append(f"trained {sinfo.get('train_pairs')} examples; sft_data.json lists {data.get('examples')}")

    for label, rel in RUN_INFO.items():
        p = out.setdefault(rel, [])
        info = infos.get(label)
        if not isinstance(info, dict):
            p.append("not packed")
            continue
        want = params["dpo"]["objective"] if label == "dpo" else "reward_model"
        if info.get("objective") != want:
            p.append(f"objective {info.get('objective')!r}, params make it {want!r}")

    p = out.setdefault(PROBE_SOURCES, [])
    names = {s.get("name") for s in (stats or {}).get("sources") or []}
    if not isinstance(probe, dict):
        p.append("not in the bundle")
    else:
        if pm and probe.get("probe_digest") != pm.get("probe_digest"):
            p.append("its probe_digest is not the probe manifest's")
        if len(probe.get("sources") or []) != len(pm.get("pair_ids") or []):
            p.append(f"{len(probe.get('sources') or [])} sources for {len(pm.get('pair_ids') or [])} probe pairs")
        if names and not set(probe.get("sources") or []) <= names:
            p.append(f"names sources normalize did not read: {sorted(set(probe.get('sources') or []) - names)}")
    return out
