"""tokenize: render preference pairs with the verified reference tokenizer; split prompt/completion on tokens.

    python -m stages.tokenize --params params.yaml --identity results/ref/ref_identity.json \
        --train results/probe/train.parquet --probe results/probe/probe.parquet \
        --probe-manifest results/probe/probe_manifest.json \
        --train-tokens results/tokens/train_tokens.parquet \
        --probe-tokens results/tokens/probe_tokens.parquet \
        --probe-token-manifest results/tokens/probe_token_manifest.json \
        --report results/tokens/tokenize_report.json \
        --rejections results/tokens/token_rejections.parquet --log logs/tokenize.log

The data package does the work: rendering (stages/data/render.py), the pair tokenizer with its boundary and
cost bound (stages/data/pair_tokenizer.py), the truncation modes (stages/data/truncation.py; the modes and their
reason codes: stages/data/limits.py), the worker pool (stages/data/pool.py). This driver checks its inputs, runs
the one streaming path and writes the outputs (docs/ARTIFACTS.md):

* inputs: every pair still hashes to its content_hash / pair_id, pair IDs are unique, the probe is the frozen
  probe (its manifest's IDs, hashes and digest), frozen to fit this tokenizer under these limits (the manifest's
  `fit`: freeze_probe draws the probe from pairs tokenize keeps), no probe pair is in train;
* the probe must come through whole: any probe pair that would be rejected fails the stage, naming it (each
  truncated probe pair is recorded in the probe token manifest: `truncated`);
* scale: the probe in pieces, then the train pairs in chunks (at most --chunk-pairs), rendered and tokenized by up
  to `tokenize.workers` forked processes (0 = every core in the CPU affinity), written in input order as they
  come back. The pool is sized to the input (plan_pool); the outputs are the same bytes for any worker count and
  chunk size (row groups are cut at a fixed row count, never at a chunk boundary), and nothing is written on a
  refusal.
"""
from __future__ import annotations

import logging
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import numpy as np
import pyarrow as pa

from stages.data.limits import TRUNCATION_REASONS, TokenizeError, TokenizeLimits, load_limits
from stages.data.chat_templates import DEFAULT, ChatTemplate
from stages.data.pair_tokenizer import pair_tokenizer_for
from stages.data.pool import fork_pool, ordered_results, plan_pool, resolve_workers, worker_state
from stages.data.tokenizer import load_tokenizer, tokenizer_identity, tokenizers_only_process
from stages.data.truncation import REJECTIONS_SCHEMA, rejections_table, tokenize_pairs, tokens_table
from stages.lib.cli import stage_main
from stages.lib.contracts import (PROBE_MANIFEST_SCHEMA, TOKENS_SCHEMA, ContractError, check_shape,
                                  content_hash_problem, pair_id_problem, pair_problems, probe_digest,
                                  row_content_hash, token_digest)
from stages.lib import record_formats
from stages.lib.io import (ParquetStreamWriter, canonical_json, display_path, iter_parquet_batches, open_parquet,
                           read_json, read_parquet, write_json)
from stages.lib.params import ParamsError
from stages.lib.declared_params import load_stage_params

DEFAULT_CHUNK_PAIRS = 1024
LENGTH_KEYS = ("prompt", "chosen", "rejected", "chosen_completion", "rejected_completion")


# ---------------------------------------------------------------------------------------------
# Input integrity: pairs are what freeze_probe wrote, the probe is the frozen probe
# ---------------------------------------------------------------------------------------------

def check_pairs(pairs: list[dict], path: str) -> None:
    """Every pair's content still hashes to its content_hash / pair_id, and pair IDs are unique."""
    problems = pair_problems(pairs)
    if problems:
        raise TokenizeError(f"{path}: {len(problems)} pair(s) do not match their recorded hashes "
                            f"(edited after normalize?):\n  " + "\n  ".join(problems[:20]))


def check_probe_matches_manifest(probe_pairs: list[dict], manifest: dict, probe_path: str,
                                 manifest_path: str) -> None:
    ids = [p["pair_id"] for p in probe_pairs]
    want = list(manifest["pair_ids"])
    if ids != want:
        diffs = [f"index {i}: manifest {w} / parquet {g}"
                 for i, (w, g) in enumerate(zip(want, ids)) if w != g][:10]
        raise TokenizeError(f"{probe_path} does not hold the probe of {manifest_path}: "
                            f"{len(ids)} pairs vs {len(want)} in the manifest; "
                            f"{len(set(want) - set(ids))} manifest IDs missing, "
                            f"{len(set(ids) - set(want))} extra; first order differences: {diffs}")
    hashes = [p["content_hash"] for p in probe_pairs]
    if hashes != list(manifest["content_hashes"]):
        bad = [ids[i] for i, (a, b) in enumerate(zip(hashes, manifest["content_hashes"])) if a != b]
        raise TokenizeError(f"{probe_path}: content hashes differ from {manifest_path} for pairs {bad[:10]}")
    digest = probe_digest(ids, hashes)
    if digest != manifest["probe_digest"]:
        raise TokenizeError(f"{probe_path}: probe digest {digest} != {manifest_path} probe_digest "
                            f"{manifest['probe_digest']}")


def read_dev(manifest: dict, manifest_path: str, dev_path: str | None) -> list[dict]:
    """The dev split freeze_probe froze beside the probe (its manifest's `dev`), checked as the probe is; [] when
    there is none (then --dev must not be given)."""
    if manifest.get("dev") is None:
        if dev_path:
            raise TokenizeError(f"--dev {dev_path} is given but {manifest_path} freezes no dev split "
                                "(probe.dev_size 0)")
        return []
    if not dev_path:
        raise TokenizeError(f"{manifest_path} freezes a dev split (probe.dev_size {manifest['dev']['size']}): --dev "
                            "and --dev-tokens are required")
    d = manifest["dev"]
    if not isinstance(d, dict) or any(k not in d for k in ("pair_ids", "content_hashes", "dev_digest")):
        raise TokenizeError(f"{manifest_path}: not a valid probe manifest (its `dev` lacks pair_ids, content_hashes "
                            "or dev_digest)")
    dev = read_parquet(dev_path).to_pylist()
    check_pairs(dev, dev_path)
    check_probe_matches_manifest(dev, {"pair_ids": d["pair_ids"], "content_hashes": d["content_hashes"],
                                       "probe_digest": d["dev_digest"]}, dev_path, f"{manifest_path} (dev)")
    return dev


def check_probe_complete(rejections: list[dict], pairs_in: int, limits: TokenizeLimits, split: str = "probe") -> None:
    if rejections:
        listed = "\n  ".join(f"{r['pair_id']} ({r['reason']}: {r['detail']})" for r in rejections)
        raise TokenizeError(
            f"{len(rejections)} of {pairs_in} {split} pairs cannot be tokenized under "
            f"max_length={limits.max_length}, max_prompt_length={limits.max_prompt_length}, "
            f"truncation={limits.truncation}; the frozen probe must be scored whole, so raise the "
            f"limits (or re-freeze a probe from data that fits):\n  {listed}")


def check_probe_fit(manifest: dict, manifest_path: str, tok_identity: str, limits: TokenizeLimits,
                    chat_template: ChatTemplate | None = None) -> None:
    """The probe was drawn to fit this tokenizer under these limits and this rendering (its manifest's `fit`), or it
    may not fit."""
    fit = manifest.get("fit")
    if fit is not None and (fit["tokenizer_identity"], fit["limits"]) != (tok_identity, limits.as_dict()):
        raise TokenizeError(f"{manifest_path}: the probe was frozen to fit tokenizer {fit['tokenizer_identity']} "
                            f"under {canonical_json(fit['limits'])}, but tokenize runs tokenizer {tok_identity} under "
                            f"{canonical_json(limits.as_dict())}; rerun freeze_probe with these settings")
    want = chat_template.record() if chat_template is not None else None
    if fit is not None and want is not None and fit.get("chat_template") != want:
        raise TokenizeError(f"{manifest_path}: the probe was frozen to fit the rendering "
                            f"{canonical_json(fit.get('chat_template') or DEFAULT)}, but tokenize renders with "
                            f"{canonical_json(want or DEFAULT)}; rerun freeze_probe with these settings")


class _TrainIntegrity:
    """The train pairs' checks, as their chunks come back: unique pair IDs, content still hashing to them, no
    probe pair; raised once the whole file was seen (every problem counted, the first 20 named)."""

    def __init__(self, path: str, probe_ids: set[str]):
        self.path, self.probe_ids = path, probe_ids
        self.seen: dict[str, int] = {}
        self.rows, self.count, self.problems, self.overlap = 0, 0, [], []

    def add(self, batch: pa.RecordBatch, mismatches: dict[int, str]) -> None:
        ids, hashes = batch.column("pair_id").to_pylist(), batch.column("content_hash").to_pylist()
        for i, (pid, ch) in enumerate(zip(ids, hashes)):
            problem = pair_id_problem(self.rows + i, pid, ch, self.seen)
            if problem is None and i in mismatches:
                problem = content_hash_problem(self.rows + i, pid, ch, mismatches[i])
            if problem is not None:
                self.count += 1
                if len(self.problems) < 20:
                    self.problems.append(problem)
            if pid in self.probe_ids:
                self.overlap.append(pid)
        self.rows += batch.num_rows

    def check(self) -> None:
        if self.count:
            raise TokenizeError(f"{self.path}: {self.count} pair(s) do not match their recorded hashes "
                                f"(edited after normalize?):\n  " + "\n  ".join(self.problems))
        if self.overlap:
            raise TokenizeError(f"{len(self.overlap)} probe pairs are also in {self.path}: {sorted(self.overlap)[:10]}")


# ---------------------------------------------------------------------------------------------
# One chunk of pairs (run in a pool worker or here), and what a split's chunks add up to
# ---------------------------------------------------------------------------------------------

@dataclass
class ChunkResult:
    pairs_in: int
    tokens: pa.Table
    rejections: pa.Table
    truncations: list[dict]         # one record per truncated pair, input order
    prompt_tokens_differ: int
    lengths: dict[str, np.ndarray]  # LENGTH_KEYS -> per-row token counts
    content_mismatches: dict[int, str]  # row in the chunk -> the hash its content has now


def row_lengths(rows: list[dict]) -> dict[str, np.ndarray]:
    """The per-row token counts the report summarises (LENGTH_KEYS), as compact arrays."""
    c = np.fromiter((len(r["chosen_ids"]) for r in rows), np.int64, len(rows))
    r_ = np.fromiter((len(r["rejected_ids"]) for r in rows), np.int64, len(rows))
    cp = np.fromiter((r["chosen_prompt_len"] for r in rows), np.int64, len(rows))
    rp = np.fromiter((r["rejected_prompt_len"] for r in rows), np.int64, len(rows))
    return {"prompt": cp, "chosen": c, "rejected": r_, "chosen_completion": c - cp, "rejected_completion": r_ - rp}


def tokenize_chunk(pairs: pa.RecordBatch | list[dict], limits: TokenizeLimits, split: str) -> ChunkResult:
    """Tokenize one chunk with the pool's pair tokenizer (worker_state); recompute each pair's content hash."""
    pairs = pairs.to_pylist() if isinstance(pairs, pa.RecordBatch) else pairs
    mismatches = {}
    for i, pair in enumerate(pairs):
        actual = row_content_hash(pair)
        if actual != pair["content_hash"]:
            mismatches[i] = actual
    result = tokenize_pairs(worker_state("pair_tokenizer"), pairs, limits, split)
    return ChunkResult(len(pairs), tokens_table(result.rows), rejections_table(result.rejections), result.truncations,
                       result.prompt_tokens_differ, row_lengths(result.rows), mismatches)


def _length_stats(a: np.ndarray) -> dict:
    if a.size == 0:
        return {"count": 0}
    return {"count": int(a.size), "min": int(a.min()), "max": int(a.max()), "sum": int(a.sum()),
            "mean": round(float(a.mean()), 4), "p50": round(float(np.percentile(a, 50)), 4),
            "p95": round(float(np.percentile(a, 95)), 4)}


LENGTH_REASONS = ("prompt_too_long", "sequence_too_long")
LOUD_LENGTH_LOSS = 0.1            # a split losing more than this fraction of its pairs to length is said loudly


def length_loss_warnings(splits: dict[str, dict], limits: TokenizeLimits) -> list[str]:
    """One line per split that lost more than LOUD_LENGTH_LOSS of its pairs to the length limits, naming the settings
    that would keep them (tokenize_report.json `warnings`, the stage's log, summary.md's Warnings). A ShareGPT set at
    1024 / 256 with keep_end lost 76% of its training pairs with nothing but a count in the report (issue 37)."""
    out = []
    for split, rep in splits.items():
        lost = sum(rep["rejected_by_reason"].get(r, 0) for r in LENGTH_REASONS)
        if not rep["pairs_in"] or lost / rep["pairs_in"] <= LOUD_LENGTH_LOSS:
            continue
        by = ", ".join(f"{r} {rep['rejected_by_reason'][r]}" for r in LENGTH_REASONS if rep["rejected_by_reason"].get(r))
        need = rep.get("length_rejected_needs") or {}
        fixes = []
        if need.get("max_length_p90"):
            fixes.append(f"tokenize.max_length >= {need['max_length_p90']} (90% of them)")
        if need.get("max_prompt_length_p90") and rep["rejected_by_reason"].get("prompt_too_long"):
            fixes.append(f"tokenize.max_prompt_length >= {need['max_prompt_length_p90']} (90% of the long prompts)")
        if limits.truncation != "keep_end_then_completion":
            fixes.append("tokenize.truncation: keep_end_then_completion (cuts the oldest prompt turns, then the "
                         "completions, to fit: keeps every pair whose last prompt turn fits)")
        out.append(f"{split}: {lost} of {rep['pairs_in']} pairs ({100 * lost / rep['pairs_in']:.0f}%) rejected for "
                   f"length ({by}) at max_length {limits.max_length}, max_prompt_length {limits.max_prompt_length}, "
                   f"truncation {limits.truncation}; would keep them: {'; or '.join(fixes)}")
    return out


@dataclass
class SplitTally:
    """A split's chunks added up, in order: its report (tokenize_report.json `splits.<split>`). With
    keep_records, also its rejections and truncation records (the probe: refused or recorded pair by pair)."""
    keep_records: bool = False
    pairs_in: int = 0
    pairs_out: int = 0
    reasons: Counter = field(default_factory=Counter)
    truncated_by_reason: dict = field(default_factory=lambda: dict.fromkeys(TRUNCATION_REASONS, 0))
    prompt_tokens_differ: int = 0
    lengths: dict = field(default_factory=lambda: {k: [] for k in LENGTH_KEYS})
    rejections: list = field(default_factory=list)
    truncations: list = field(default_factory=list)
    # The pairs rejected for length: the longer branch's tokens; the prompt's of those rejected for their prompt
    length_rejected: dict = field(default_factory=lambda: {"sequence": [], "prompt": []})

    def add(self, chunk: ChunkResult) -> None:
        self.pairs_in += chunk.pairs_in
        self.pairs_out += chunk.tokens.num_rows
        self.reasons.update(chunk.rejections.column("reason").to_pylist())
        for r in chunk.rejections.select(["reason", "prompt_tokens", "chosen_tokens", "rejected_tokens"]).to_pylist():
            if r["reason"] in LENGTH_REASONS:
                branches = [t for t in (r["chosen_tokens"], r["rejected_tokens"]) if t is not None]
                if branches:
                    self.length_rejected["sequence"].append(max(branches))
                if r["reason"] == "prompt_too_long" and r["prompt_tokens"] is not None:
                    self.length_rejected["prompt"].append(r["prompt_tokens"])
        for t in chunk.truncations:
            self.truncated_by_reason[t["reason"]] += 1
        self.prompt_tokens_differ += chunk.prompt_tokens_differ
        for k in LENGTH_KEYS:
            self.lengths[k].append(chunk.lengths[k])
        if self.keep_records:
            self.rejections += chunk.rejections.to_pylist()
            self.truncations += chunk.truncations

    def report(self) -> dict:
        return {"pairs_in": self.pairs_in, "pairs_out": self.pairs_out, "rejected": sum(self.reasons.values()),
                "rejected_by_reason": dict(sorted(self.reasons.items())),
                "truncated": sum(self.truncated_by_reason.values()),
                "truncated_by_reason": dict(self.truncated_by_reason),
                "prompt_tokens_differ": self.prompt_tokens_differ,
                "lengths": {k: _length_stats(np.concatenate(v) if v else np.zeros(0, np.int64))
                            for k, v in self.lengths.items()},
                # what would have kept the pairs rejected for length: 90th percentiles of their token counts
                "length_rejected_needs": {
                    f"max_{k}_length_p90".replace("max_sequence_length", "max_length"):
                        (int(np.ceil(np.percentile(v, 90))) if v else None)
                    for k, v in self.length_rejected.items()}}


def tokenize_report(splits: dict[str, dict], limits: TokenizeLimits, rendering: str, tok_identity: str,
                    chat_template: ChatTemplate | None = None) -> dict:
    """`chat_template`: what tokenize.chat_template resolved to (its record: setting, template used, SHA-256; its
    warning, a silent fallback to the plain rendering, among the warnings)."""
    totals = {"pairs_in": 0, "pairs_out": 0, "rejected": 0, "rejected_by_reason": Counter(), "truncated": 0,
              "truncated_by_reason": dict.fromkeys(TRUNCATION_REASONS, 0)}
    for s in splits.values():
        for k in ("pairs_in", "pairs_out", "rejected", "truncated"):
            totals[k] += s[k]
        totals["rejected_by_reason"].update(s["rejected_by_reason"])
        for k, v in s["truncated_by_reason"].items():
            totals["truncated_by_reason"][k] += v
    totals["rejected_by_reason"] = dict(sorted(totals["rejected_by_reason"].items()))
    template_warnings = [chat_template.warning] if chat_template is not None and chat_template.warning else []
    return {"format": record_formats.TOKENIZE_REPORT, "limits": limits.as_dict(), "rendering": rendering,
            "tokenizer_identity": tok_identity, "splits": splits, "totals": totals,
            "warnings": template_warnings + length_loss_warnings(splits, limits),
            "chat_template": chat_template.record() if chat_template is not None else None}


def probe_token_manifest(probe_rows: list[dict], probe_digest: str, tok_identity: str,
                         truncations: list[dict] = (), limits: TokenizeLimits | None = None) -> dict:
    """The tokenize record evaluate checks. `truncated` lists every truncated probe pair, in probe
    order, with its index and the token_hash of the (truncated) tokens that are scored."""
    pair_ids = [r["pair_id"] for r in probe_rows]
    hashes = [r["token_hash"] for r in probe_rows]
    index = {pid: i for i, pid in enumerate(pair_ids)}
    truncated = sorted(({"index": index[t["pair_id"]], **t, "token_hash": hashes[index[t["pair_id"]]]}
                        for t in truncations), key=lambda t: t["index"])
    return {"format": record_formats.PROBE_TOKEN_MANIFEST, "pair_ids": pair_ids, "token_hashes": hashes,
            "token_digest": token_digest(pair_ids, hashes), "probe_digest": probe_digest,
            "tokenizer_identity": tok_identity, "limits": limits.as_dict() if limits is not None else None,
            "truncated": truncated}


# ---------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenizeOutputs:
    train_tokens: str | Path
    probe_tokens: str | Path
    probe_token_manifest: str | Path
    report: str | Path
    rejections: str | Path
    dev_tokens: str | Path | None = None   # probe.dev_size > 0: the dev split's tokens (the manifest's `dev`)


def read_probe_manifest(manifest_path: str) -> dict:
    try:
        return check_shape(read_json(manifest_path), PROBE_MANIFEST_SCHEMA, "probe manifest", manifest_path)
    except ContractError as e:
        raise TokenizeError(str(e)) from None


def tokenize_to_files(limits: TokenizeLimits, tokenizer_dir: Path, train_path: str, probe_path: str,
                      manifest_path: str, out: TokenizeOutputs, log, *, workers: int = 1,
                      chunk_pairs: int = DEFAULT_CHUNK_PAIRS, tok_params: dict | None = None,
                      dev_path: str | None = None) -> dict:
    """The stage, from its input files to its outputs; returns the report. `workers` is the most processes to use
    (plan_pool sizes the pool to the input); `chunk_pairs` the most train pairs per work unit; `tok_params`:
    params.yaml's tokenize section, for its chat_template (None: the default, the tokenizer's own)."""
    manifest = read_probe_manifest(manifest_path)
    probe = read_parquet(probe_path).to_pylist()  # the probe is small (probe.size pairs) and is scored whole
    check_pairs(probe, probe_path)
    check_probe_matches_manifest(probe, manifest, probe_path, manifest_path)
    dev = read_dev(manifest, manifest_path, dev_path)    # probe.dev_size > 0 only; scored whole like the probe

    tok_identity = tokenizer_identity(tokenizer_dir)
    pair_tokenizer = pair_tokenizer_for(load_tokenizer(tokenizer_dir), tok_params)
    chat_template = pair_tokenizer.chat_template
    log.info("tokenizer %s (identity %s), rendering: %s", display_path(tokenizer_dir), tok_identity,
             pair_tokenizer.rendering)
    if chat_template.name != "tokenizer":   # (the default's log line is unchanged: the log is hashed)
        log.info("chat template: %s (tokenize.chat_template %s, sha256 %s)", chat_template.name,
                 chat_template.setting, chat_template.sha256)
    if chat_template.warning:
        log.warning("%s", chat_template.warning)
    check_probe_fit(manifest, manifest_path, tok_identity, limits, chat_template)
    train_file = open_parquet(train_path)
    plan = plan_pool(train_file.metadata.num_rows, len(probe), resolve_workers(workers), chunk_pairs)
    integrity = _TrainIntegrity(train_path, {p["pair_id"] for p in probe + dev})
    tally = {"train": SplitTally(), "probe": SplitTally(keep_records=True),
             **({"dev": SplitTally(keep_records=True)} if dev else {})}
    probe_rows: list[dict] = []
    # The probe's pieces first (they share the pool with the first train chunks): an incomplete probe is refused
    # before any train chunk is written.
    jobs = chain(((probe[lo:lo + plan.probe_chunk], limits, "probe") for lo in range(0, len(probe), plan.probe_chunk)),
                 ((dev[lo:lo + plan.probe_chunk], limits, "dev") for lo in range(0, len(dev), plan.probe_chunk)),
                 ((batch, limits, "train") for batch in iter_parquet_batches(train_path, plan.train_chunk,
                                                                              parquet_file=train_file)))
    probe_checked = False
    with fork_pool(plan.processes, pair_tokenizer=pair_tokenizer) as pool, \
            ParquetStreamWriter(out.train_tokens, TOKENS_SCHEMA) as tokens_out, \
            ParquetStreamWriter(out.rejections, REJECTIONS_SCHEMA) as rejections_out, \
            ParquetStreamWriter(out.probe_tokens, TOKENS_SCHEMA) as probe_out, \
            (ParquetStreamWriter(out.dev_tokens, TOKENS_SCHEMA) if dev else nullcontext()) as dev_out:
        for (pairs, _, split), chunk in ordered_results(pool, tokenize_chunk, jobs, plan.processes):
            tally[split].add(chunk)
            if split == "probe":
                probe_out.write(chunk.tokens)
                probe_rows += chunk.tokens.select(["pair_id", "token_hash"]).to_pylist()
                continue
            if split == "dev":
                dev_out.write(chunk.tokens)
                continue
            if not probe_checked:
                check_probe_complete(tally["probe"].rejections, len(probe), limits)
                if dev:
                    check_probe_complete(tally["dev"].rejections, len(dev), limits, "dev")
                probe_checked = True
            integrity.add(pairs, chunk.content_mismatches)
            tokens_out.write(chunk.tokens)
            rejections_out.write(chunk.rejections)
        # Raised inside the writers' block: on bad input no output file appears.
        check_probe_complete(tally["probe"].rejections, len(probe), limits)
        if dev:
            check_probe_complete(tally["dev"].rejections, len(dev), limits, "dev")
        integrity.check()

    truncations = tally["probe"].truncations
    if truncations:
        counts = {k: v for k, v in tally["probe"].truncated_by_reason.items() if v}
        log.info("probe: %d pairs truncated %s (each recorded in the probe token manifest)", len(truncations),
                 canonical_json(counts))
    report = tokenize_report({split: t.report() for split, t in tally.items()}, limits, pair_tokenizer.rendering,
                             tok_identity, chat_template)
    write_json(out.probe_token_manifest, probe_token_manifest(probe_rows, manifest["probe_digest"], tok_identity,
                                                              truncations, limits))
    write_json(out.report, report)
    return report


def _arguments(ap) -> None:
    ap.add_argument("--identity", required=True, help="results/ref/ref_identity.json from verify_ref")
    ap.add_argument("--train", required=True)
    ap.add_argument("--probe", required=True)
    ap.add_argument("--probe-manifest", required=True)
    ap.add_argument("--train-tokens", required=True)
    ap.add_argument("--probe-tokens", required=True)
    ap.add_argument("--probe-token-manifest", required=True)
    ap.add_argument("--report", required=True)
    ap.add_argument("--rejections", required=True)
    ap.add_argument("--dev", help="dev.parquet (probe.dev_size > 0: the manifest freezes a dev split)")
    ap.add_argument("--dev-tokens", help="dev_tokens.parquet to write (with --dev)")
    ap.add_argument("--chunk-pairs", type=int, default=DEFAULT_CHUNK_PAIRS,
                    help="train pairs per work unit (memory / parallelism only; the outputs do not depend on it)")


def _run(args) -> None:
    from stages.lib.reference import load_verified_dir

    log = logging.getLogger("tokenize")
    params = load_stage_params(args.params, "tokenize")["tokenize"]
    tokenizer_dir = load_verified_dir(args.identity)
    limits = load_limits(params, tokenizer_dir)
    workers = resolve_workers(params.get("workers", 0))
    if bool(args.dev) != bool(args.dev_tokens):
        raise TokenizeError("--dev and --dev-tokens go together (the dev split and its tokens)")
    out = TokenizeOutputs(args.train_tokens, args.probe_tokens, args.probe_token_manifest, args.report,
                          args.rejections, args.dev_tokens)
    report = tokenize_to_files(limits, Path(tokenizer_dir), args.train, args.probe, args.probe_manifest, out, log,
                               workers=workers, chunk_pairs=args.chunk_pairs, tok_params=params, dev_path=args.dev)
    train, probe = report["splits"]["train"], report["splits"]["probe"]
    for warning in length_loss_warnings(report["splits"], limits):
        log.warning("data lost to length: %s", warning)
    # No worker count or timing here: the log is hashed with the outputs.
    log.info("train: %d pairs in, %d out, %d rejected %s, %d truncated; probe: %d pairs, digest %s",
             train["pairs_in"], train["pairs_out"], train["rejected"], canonical_json(train["rejected_by_reason"]),
             train["truncated"], probe["pairs_out"], read_json(args.probe_token_manifest)["token_digest"])
    if "dev" in report["splits"]:
        log.info("dev: %d pairs, %d truncated", report["splits"]["dev"]["pairs_out"], report["splits"]["dev"]["truncated"])


def main(argv: list[str] | None = None) -> None:
    from stages.lib.reference import RefIdentityError

    return stage_main(argv, "tokenize", __doc__.split("\n")[0], add_arguments=_arguments, run=_run,
                      input_errors=(TokenizeError, ParamsError, RefIdentityError))


if __name__ == "__main__":
    tokenizers_only_process()
    main()
