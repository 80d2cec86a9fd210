"""One iterative-DPO round (issue 36) timed per part, beside TRL's OnlineDPOTrainer on the same prompts.

    python bench/rounds_bench.py --shared ../shared --out DIR [--prompts 2000] [--n 4] [--shape qwen2.5-0.5b] \
        [--modes ours,trl] [--trl-site DIR] [--max-new-tokens 64] [--batch-pairs 16] [--gen-batch 256]
    python bench/rounds_bench.py --shared ../shared --out /tmp/rb --shape tiny --prompts 4 --probe-pairs 4 \
        --max-new-tokens 8 --eos-every 3 --modes ours                         # a CPU smoke run (tests/bench)

Writes DIR/result.json (saved after every part, so a run cut short keeps what it measured), and beside it every
stage's log and perf record, the round's pairs report and TRL's output.

Ours (`ours`): a round k = 2 through the real stage CLIs, launched as workflow/rules/rounds.smk launches them:
  1. `python -m stages.round_pairs --round 2 --identity .. --policy-model P --judge-model J ..`: the policy samples
     rounds.n completions of every distinct train prompt (rounds.temperature / top_p from params.yaml's `rounds`,
     generation.max_new_tokens, generation.batch_size = --gen-batch), the judge scores them, best vs worst form
     the pairs, every other prompt is rejected with its reason;
  2. `torchrun --nproc-per-node 1 -m stages.ref_logps` on the new pairs (rounds.reference initial: the reference);
  3. `torchrun --nproc-per-node 1 -m stages.train_dpo --init-model P` for one epoch on them.
Each part's wall seconds (process start to exit, from here) and its own measurements: sampling and judging
seconds, generated tokens/s and the pairs built / rejected by reason (round_pairs' perf and pairs report; its
sampling seconds include loading the policy, its judging seconds loading the judge), the reference pass, the
training loop's seconds and tokens/s, peak memory (the stage's torch peak; device_peak_gib: the device-wide peak,
gpu_bench.DevicePeak). Steps 2-3 run through gpu_bench.run_stage, which names the model with --model-dir where the
rule names it with --identity (the same directory; the identity re-check is skipped there); round_pairs takes
--identity, as its rule.

TRL (`trl`): trl 1.16.0's trl.experimental.online_dpo.OnlineDPOTrainer, one epoch over the same prompts (their
token ids decoded to text with the same tokenizer; how many re-encode to other ids is recorded), the same policy
and judge files as its model and reward model (`reward_funcs`), in bench/trl_online_dpo_runner.py (its docstring has
its settings and how it is timed), in a subprocess with --trl-site first on PYTHONPATH. Differences that stay:
TRL samples 2 completions per prompt (fixed in 1.16), ours rounds.n; TRL samples with transformers' `generate` per
training step (--batch-pairs prompts at a time), ours the whole round first with the generation engine
(--gen-batch rows at a time); TRL's reference is a live copy of the policy, ours a precomputed pass; TRL trains a
pair from every prompt (no too_long / tie rejection; its missing_eos_penalty is off by default), ours only the pairs
the round built; TRL's reward model reads the completions decoded to text and re-tokenized, ours scores the token
ids. Both train --batch-pairs (16) pairs per optimizer step, lr 5e-7 (linear, no warmup), beta 0.1, sigmoid loss,
max_length 1024, bf16 on a GPU (ours: train.precision bf16, bf16 weights with fp32 masters; TRL: bf16 weights). The
result's `differences_from_trl` lists these; `side_by_side` puts the parts next to each other.

Models (random init, so labels and losses mean nothing: the figures are throughput only): the policy is
gpu_bench.make_model's model of --shape (seed 0; bf16 on a GPU, fp32 on the CPU) with the GPT-2 tokenizer's files
beside it; it is also the round's reference (round 2 from an untrained round 1). The judge: a sequence-classification
model of the same shape with one label (seed 1). A random-init policy never ends a completion (the EOS row of its
tied embedding is the zero padding row: p(EOS) = 1/~180,000 a token), so every sample would be cut at
max_new_tokens, and round_pairs, rightly, would make no pair (too_long). So set_eos_rate gives the last layer's
v_proj bias a constant (its final hidden state then points almost the same way at every position) and the EOS row
the direction of that state, scaled on the model's own samples so that each sampled token is EOS with probability
1/--eos-every (default max_new_tokens / 2) at every step: completion lengths as a geometric law's, most ending
before the cap. No shape changes, so no FLOP does. Both rows sample from this model; the stop reasons each saw are
in the result.
The policy samples ids over the shape's whole vocabulary (151,936 rows at the Qwen2.5 shapes: two thirds beyond
GPT-2's 50,257): TRL's text round trip drops those before its reward model (tokenizers skip unknown ids), so its
labeling reads fewer tokens than ours.

Prompts: the first --prompts HH-RLHF rows (../shared/data/hh-rlhf/harmless-base-test.jsonl.gz) made into token
pairs by gpu_bench.prepare_tokens (our normalize and tokenize code, GPT-2, truncate_completion at --max-length),
the probe = the last --probe-pairs rows; a train pair whose normalized prompt is a probe prompt is dropped, as
freeze_probe drops it (probe_prompt_leak); round_pairs samples the distinct prompts left.

On a GPU machine with ../shared at .device/shared and TRL's wheels (trl 1.16.0, datasets 5.2.0, dill 0.4.1,
multiprocess 0.70.19; gpu_bench's docstring says how to fetch them) installed to a folder, e.g.

    pip install --no-deps -t /tmp/trl_site WHEELS/*.whl
    python3 bench/rounds_bench.py --shared .device/shared --out /tmp/rounds --trl-site /tmp/trl_site

(--out holds ~20 files: tar it into the device's $OUT, which takes 8). On an H100 the defaults take about 5-7 minutes
(ours ~2, TRL ~3-4.5: its transformers `generate` runs max_new_tokens steps for each of its 125 steps);
--deadline-s keeps the whole run inside a 10-minute call.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from gpu_bench import (SHAPES, DevicePeak, StageFailed, bench_params, failure_record, make_model,  # noqa: E402
                       param_counts, prepare_tokens, qwen2_config, run_stage, sh)
from gpu_check import commit, machine  # noqa: E402

MODES = ("ours", "trl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json")
NOTE = ("random-init policy and judge: the judge's labels, the pairs' chosen/rejected and the losses mean nothing; "
        "the figures are throughput only. The policy's last-layer v_proj bias and EOS row are set so that it samples "
        "EOS at a fixed rate a token (models.policy.eos; completions end as in a geometric law); its sampled ids "
        "spread over the shape's whole vocabulary (151,936 rows at the Qwen2.5 shapes)")
DIFFERENCES = [
    "TRL 1.16's OnlineDPOTrainer samples 2 completions a prompt (num_generations = 2, not an option); ours rounds.n",
    "TRL samples with transformers' generate inside each training step (--batch-pairs prompts, 2 rows each); ours "
    "samples the whole round first with the generation engine (--gen-batch rows at a time, CUDA graphs on a GPU)",
    "TRL's reference is a live frozen copy run each step; ours is one precomputed pass (ref_logps)",
    "TRL trains a pair from every prompt (its missing_eos_penalty is off by default, nothing is rejected); ours trains "
    "only the pairs the round built (unfinished / over-long samples, ties and small margins are rejected by reason)",
    "TRL's reward model reads the completion decoded to text and re-tokenized (ids beyond the tokenizer's 50,257 "
    "are dropped by the decode); ours scores the sampled token ids",
    "TRL: bf16 weights and bf16 AdamW state (the model loaded in bf16); ours: train.precision bf16 (bf16 weights, "
    "fp32 master weights and AdamW state)",
    "TRL: gradient_checkpointing False (its default True also turns the KV cache off in its sampling)",
]


# ------------------------------------------------------------------------------------------------
# Workload: the prompts, the policy (make_model + tokenizer + an EOS it can sample), the judge
# ------------------------------------------------------------------------------------------------

def drop_probe_prompt_leaks(work: Path) -> dict:
    """freeze_probe's rule on prepare_tokens' splits: a train pair whose normalized prompt (contracts.prompt_key) is
    a probe prompt leaves train. Rewrites work/train_tokens.parquet without them."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from stages.lib.contracts import prompt_key
    from stages.lib.io import read_parquet, write_parquet
    from stages.normalize import normalize_sources

    def keys(split: str) -> dict[str, str]:
        norm = normalize_sources([{"name": "hh", "path": str(work / f"hh_{split}.jsonl"), "format": "hh"}])
        return {p["pair_id"]: prompt_key(p["prompt"]) for p in norm.pairs}

    probe = set(keys("probe").values())
    leaked = sorted(pid for pid, key in keys("train").items() if key in probe)
    if leaked:
        table = read_parquet(work / "train_tokens.parquet")
        keep = pc.invert(pc.is_in(table.column("pair_id"), value_set=pa.array(leaked)))
        write_parquet(work / "train_tokens.parquet", table.filter(keep))
    return {"probe_prompt_leak": len(leaked)}


def round_prompts(work: Path, vocab: int) -> list[list[int]]:
    """The prompts round_pairs samples: the distinct prompts of the train tokens (rounds.prompts null = all)."""
    from stages.engine.packing import load_token_pairs
    from stages.evidence.rounds import unique_prompts
    train = load_token_pairs(work / "train_tokens.parquet", vocab)
    return unique_prompts(train.seq_ids[0::2], [int(x) for x in train.seq_prompt_lens[0::2]])


def copy_tokenizer(gpt2: Path, model_dir: Path) -> None:
    for name in TOKENIZER_FILES:
        if (gpt2 / name).exists():
            shutil.copy(gpt2 / name, model_dir / name)


def solve_eos_scale(a, others, target: float) -> float:
    """r with mean(sigmoid(r * a - others)) = target (bisection; the mean grows with r while target is below the
    share of positive a): a = each position's hidden state . u, others = the log-sum-exp of the other logits."""
    import torch

    def rate(r: float) -> float:
        return float(torch.sigmoid(r * a - others).mean())
    lo, hi = 0.0, 1.0
    while rate(hi) < target:
        hi *= 2
        if hi > 1e4:
            raise SystemExit(f"rounds_bench: no EOS scale reaches a stop rate of {target}")
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) < target else (lo, mid)
    return hi


def set_eos_rate(model_dir: Path, every: float, prompts: list[list[int]], temperature: float, top_p: float,
                 seed: int = 0, n_ctx: int = 16, ctx_prompt: int = 192, ctx_sampled: int = 48,
                 bias_ratio: float = 10.0) -> dict:
    """Make the random-init policy end its completions: EOS about once every `every` sampled tokens, at every step
    alike (lengths as a geometric law's, capped at max_new_tokens). Two changes, saved in place:

    1. The last layer's v_proj bias gets a vector b (a seeded direction): attention weights sum to 1, so its
       output gains the constant o_proj(b) at every position; b is scaled so that constant is bias_ratio times the
       median norm of the residual stream entering the final norm. The final hidden state h then points almost the
       same way at every position. Without this, h follows the current token and a random direction's EOS logit
       is large at a few positions and tiny at most: a mean stop rate that a handful of samples spend and the rest
       never reach (measured: 6 of 24 samples of 64 tokens ended at a calibrated 1/32).
    2. The EOS row of the tied embedding (a zero padding row: p(EOS) ~ 1/180,000 a token) becomes r * m, m the
       unit mean of h, r solved on the model's own samples: n_ctx round prompts (their last ctx_prompt tokens), each
       continued by ctx_sampled tokens the generation engine samples at the round's temperature / top_p (the
       other tokens' odds do not depend on the EOS row, so these are the trajectories the round samples until it
       stops), so that the mean of sigmoid(r * h.m - logsumexp(the other logits)) is 1 / every.
    The shapes, and so every FLOP the round and TRL spend, are unchanged. -> the facts."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    from stages.engine.generation import GenerationSettings, StopTokens, generate, load_policy_lm
    cuda = torch.cuda.is_available()
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(seed)
    ctx = [np.asarray(p[-ctx_prompt:], np.int64) for p in prompts[:n_ctx]]

    # 1. the constant direction
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval().requires_grad_(False)
    cfg = plain.config
    eos, vocab, d = int(cfg.eos_token_id), int(cfg.vocab_size), int(cfg.hidden_size)
    norms = []
    hook = plain.model.norm.register_forward_hook(lambda mod, inp, out: norms.append(inp[0][0].float().norm(dim=-1)))
    with torch.no_grad():
        for p in ctx:
            plain.model(input_ids=torch.as_tensor(p, device=device)[None])
    hook.remove()
    residual = float(torch.cat(norms).median())
    attn = plain.model.layers[-1].self_attn
    kv_heads, heads = int(cfg.num_key_value_heads), int(cfg.num_attention_heads)
    b = torch.randn(attn.v_proj.out_features, generator=g)
    b = b / b.norm()
    # transformers' repeat_kv: KV head i serves query heads i * group .. (i + 1) * group - 1
    per_head = b.view(kv_heads, -1).repeat_interleave(heads // kv_heads, dim=0).reshape(-1)
    const = attn.o_proj.weight.float().cpu() @ per_head
    scale = bias_ratio * residual / float(const.norm())
    attn.v_proj.bias += (scale * b).to(device=device, dtype=attn.v_proj.bias.dtype)
    plain.save_pretrained(model_dir)

    # 2. the EOS row, on the model's own samples
    model = load_policy_lm(model_dir, model_dir, device, dtype)
    settings = GenerationSettings(max_new_tokens=ctx_sampled, temperature=temperature, top_p=top_p, seed=seed, n=1,
                                  batch_size=len(ctx))
    run = generate(model, ctx, list(range(len(ctx))), settings, StopTokens((vocab,)), eos, device)
    model.set_attn_implementation("sdpa")          # a plain forward over each prompt + its sample
    hs, others, is_end = [], [], []
    with torch.no_grad():
        head32 = model.get_output_embeddings().weight.float()
        was = float(head32[eos].norm())
        for p, c in zip(ctx, run.completions):
            ids = torch.as_tensor(np.concatenate([p, np.asarray(c.tokens, np.int64)]), device=device)
            # the positions that predict the sampled tokens: the prompt's last (the first token), then each sample's
            h = model.model(input_ids=ids[None]).last_hidden_state[0, len(p) - 1:-1].float()
            logits = h @ head32.T
            logits[:, eos] = float("-inf")
            others.append(torch.logsumexp(logits, dim=-1).cpu())
            hs.append(h.cpu())
            is_end += [True] + [False] * (len(h) - 1)
        del head32
    del model
    h, others, is_end = torch.cat(hs), torch.cat(others), torch.tensor(is_end)
    m = h.mean(dim=0)
    m = m / m.norm()
    a = h @ m
    target = 1.0 / every
    r = solve_eos_scale(a[~is_end], others[~is_end], target)
    plain.get_output_embeddings().weight[eos] = (r * m).to(device=device, dtype=dtype)   # tied: the input row too
    plain.save_pretrained(model_dir)
    marker = model_dir / "bench_model.json"
    if marker.exists():        # make_model's cache marker: this is no longer its plain seed-0 model
        marker.write_text(json.dumps({**json.loads(marker.read_text()), "eos": {
            "every": every, "seed": seed, "bias_ratio": bias_ratio, "v_bias_scale": scale, "eos_row_norm": r}}))
    del plain
    if cuda:
        torch.cuda.empty_cache()
    logit = r * a - others

    def rate(mask) -> float:
        return round(float(torch.sigmoid(logit[mask]).mean()), 6)
    return {"eos_id": eos, "eos_row_norm_before": round(was, 6), "eos_row_norm": round(r, 4),
            "v_bias": {"layer": len(cfg.layer_types) - 1 if getattr(cfg, "layer_types", None) else
                       cfg.num_hidden_layers - 1, "scale": round(scale, 4), "bias_ratio": bias_ratio,
                       "residual_norm_median": round(residual, 4)},
            "hidden_cos_to_mean": round(float((h @ m / h.norm(dim=-1)).mean()), 4),
            "eos_logit_minus_others_std": round(float(logit.std()), 4),
            "target_stop_rate_per_token": round(target, 6), "calibration_positions": int((~is_end).sum()),
            "calibrated_stop_rate": rate(~is_end), "first_token_stop_rate": rate(is_end),
            "others_logsumexp_mean": round(float(others.mean()), 4), "calibration_temperature": temperature,
            "calibration_top_p": top_p}


def make_judge(shape: str, gpt2: Path, out: Path, seed: int = 1) -> dict:
    """A random-init reward model of the policy's shape: Qwen2ForSequenceClassification, one label (the `score`
    head load_judge and TRL want), pad = EOS, with the GPT-2 tokenizer's files; bf16 on a GPU, fp32 on the CPU."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(gpt2)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    cfg = qwen2_config(shape, tok.eos_token_id)
    cfg.num_labels = 1
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForSequenceClassification.from_config(cfg, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    copy_tokenizer(gpt2, out)
    del model
    if cuda:
        torch.cuda.empty_cache()
    return {"dir": str(out), "device": device, "dtype": str(dtype), "seed": seed, "total": n_params,
            "create_and_save_s": round(time.perf_counter() - t0, 2)}


# ------------------------------------------------------------------------------------------------
# Ours: round_pairs, ref_logps, train_dpo as the round's rules launch them
# ------------------------------------------------------------------------------------------------

def pin_and_verify(model_dir: Path, params: dict, params_file: Path, identity: Path, logs: Path) -> float:
    """The reference's identity for round_pairs' --identity, as the pipeline makes one for a local reference:
    verify_ref's `pin` CLI (its printed lock digest becomes ref.revision in params_file), then its `verify` CLI as
    the verify_ref rule runs it. -> seconds."""
    env = {"PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    secs = sh([sys.executable, "-m", "stages.verify_ref", "pin", str(model_dir), "--repo-id", params["ref"]["repo_id"]],
              env=env, cwd=REPO, log=logs / "ours_verify_ref_pin.out")
    digest = re.findall(r"^([0-9a-f]{64})$", (logs / "ours_verify_ref_pin.out").read_text(), re.M)[-1]
    params["ref"] = {"source": "local", "repo_id": params["ref"]["repo_id"], "revision": digest,
                     "local_dir": str(model_dir)}
    params_file.write_text(yaml.safe_dump(params))
    secs += sh([sys.executable, "-m", "stages.verify_ref", "verify", "--params", str(params_file), "--identity",
                str(identity), "--log", str(logs / "ours_verify_ref.log")], env=env, cwd=REPO,
               log=logs / "ours_verify_ref.out")
    return round(secs, 2)


def run_round_pairs(params_file: Path, identity: Path, policy: Path, judge: Path, work: Path, rw: Path,
                    logs: Path) -> dict:
    perf = logs / "ours_round_pairs.perf.json"
    cmd = [sys.executable, "-m", "stages.round_pairs", "--params", str(params_file), "--round", "2",
           "--identity", str(identity), "--policy-model", str(policy), "--judge-model", str(judge),
           "--train-tokens", str(work / "train_tokens.parquet"), "--pairs", str(rw / "train_tokens.parquet"),
           "--rejections", str(rw / "pair_rejections.parquet"), "--report", str(rw / "pairs_report.json"),
           "--log", str(logs / "ours_round_pairs.log"), "--perf", str(perf)]
    with DevicePeak() as mem:
        wall = sh(cmd, env={"PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}, cwd=REPO,
                  log=logs / "ours_round_pairs.out")
    rec, report = json.loads(perf.read_text()), json.loads((rw / "pairs_report.json").read_text())
    shutil.copy(rw / "pairs_report.json", logs / "ours_pairs_report.json")
    return {"wall_s": round(wall, 2), "device_peak_gib": mem.peak_gib, "launch": " ".join(cmd[1:]), **rec,
            "generated_tokens_per_s": round(rec["generated_tokens"] / rec["sampling_seconds"], 1),
            "samples_per_s": round(rec["samples"] / rec["sampling_seconds"], 2),
            "pairs": report["pairs"], "rejected": report["rejected"], "prompts": report["prompts"],
            "stop_reasons": report["stop_reasons"], "report": report}


def run_ours(params_file: Path, identity: Path, policy: Path, judge: Path, work: Path, logs: Path,
             save) -> dict:
    """The round's three stages in order; a failed one is recorded (gpu_bench.failure_record) and ends the round."""
    rw = work / "round2"
    rw.mkdir()
    shutil.copy(work / "probe_tokens.parquet", rw / "probe_tokens.parquet")   # run_stage reads <work>/probe_tokens
    extra = {"ref_logps": ["--out", str(rw / "ref_logps.parquet")],
             "train_dpo": ["--ref-logps", str(rw / "ref_logps.parquet"), "--out-dir", str(rw / "train_dpo"),
                           "--init-model", str(policy)]}
    res: dict = {}
    for name in ("round_pairs", "ref_logps", "train_dpo"):
        try:
            if name == "round_pairs":
                res[name] = run_round_pairs(params_file, identity, policy, judge, work, rw, logs)
            else:
                res[name] = {**run_stage(name, params_file, policy, rw, extra[name], logs, prefix="ours_round"),
                             "launch": f"torchrun --standalone --nproc-per-node 1 -m stages.{name} -- --params .. "
                                       f"--model-dir {policy} --train-tokens {rw / 'train_tokens.parquet'} "
                                       f"--probe-tokens {rw / 'probe_tokens.parquet'} " + " ".join(extra[name])}
        except StageFailed as e:
            res[name] = failure_record(e)
            save()
            break
        if name == "train_dpo":
            shutil.copy(rw / "train_dpo" / "train_log.csv", logs / "ours_round_train_dpo_train_log.csv")
        save()
    return res


def ours_summary(ours: dict) -> dict:
    """Per part: seconds (wall, and the stage's own inner timing), throughput, memory."""
    out = {}
    rp = ours.get("round_pairs", {})
    if "wall_s" in rp:
        out["sample_and_label"] = {
            "wall_s": rp["wall_s"], "sampling_s": rp["sampling_seconds"], "labeling_s": rp["judging_seconds"],
            "samples": rp["samples"], "generated_tokens": rp["generated_tokens"],
            "generated_tokens_per_s": rp["generated_tokens_per_s"], "pairs": rp["pairs"], "rejected": rp["rejected"],
            "stop_reasons": rp["stop_reasons"], "device_peak_gib": rp["device_peak_gib"]}
    ref = ours.get("ref_logps", {})
    if "wall_s" in ref:
        out["ref_logps"] = {"wall_s": ref["wall_s"], "pass_s": ref["train"]["pass_seconds"],
                            "tokens": ref["train"].get("tokens"), "tokens_per_s": ref["train"].get("tokens_per_s"),
                            "device_peak_gib": ref["device_peak_gib"]}
    tr = ours.get("train_dpo", {})
    if "wall_s" in tr:
        out["train_dpo"] = {"wall_s": tr["wall_s"], "train_s": tr["train_seconds"], "tokens_per_s": tr["tokens_per_s"],
                            "optimizer_steps": tr.get("optimizer_steps"), "train_pairs": tr.get("train_pairs"),
                            "peak_mem_gib": round(max(tr["peak_memory_bytes_per_rank"]) / 2**30, 2),
                            "device_peak_gib": tr["device_peak_gib"], "final_train_loss": tr.get("final_train_loss")}
    if len(out) == 3:
        out["round_wall_s"] = round(sum(out[k]["wall_s"] for k in ("sample_and_label", "ref_logps", "train_dpo")), 2)
    return out


# ------------------------------------------------------------------------------------------------
# TRL
# ------------------------------------------------------------------------------------------------

def write_trl_prompts(prompts: list[list[int]], gpt2: Path, path: Path) -> dict:
    """The round's prompts as text for TRL (decoded with the same tokenizer); how many do not re-encode to the same
    ids (TRL tokenizes the text, without special tokens, as OnlineDPOTrainer._generate does)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(gpt2)
    texts = [tok.decode(p, clean_up_tokenization_spaces=False) for p in prompts]
    differ = sum(tok(t, add_special_tokens=False)["input_ids"] != list(p) for t, p in zip(texts, prompts))
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return {"prompts": len(texts), "reencode_differs": differ}


def json_lines(text: str) -> list[dict]:
    """The runner's JSON lines in its output (transformers' Trainer prints Python dicts too: not JSON, skipped)."""
    out = []
    for line in text.splitlines():
        if line.startswith('{"'):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def run_trl(policy: Path, judge: Path, prompts_file: Path, args, params: dict, logs: Path, timeout_s: float) -> dict:
    """bench/trl_online_dpo_runner.py in a subprocess (TRL's wheels first on PYTHONPATH) -> its JSON line, with the
    wall seconds and the device-wide peak memory. Stopped after timeout_s (what is left of --deadline-s): then
    {"status": "timeout"} with its last progress line (steps done, the seconds and counts so far)."""
    import subprocess
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": ":".join(p for p in (args.trl_site, str(REPO), os.environ.get("PYTHONPATH")) if p)}
    r = params["rounds"]
    cmd = [sys.executable, str(REPO / "bench" / "trl_online_dpo_runner.py"), "--policy", str(policy), "--judge",
           str(judge), "--prompts", str(prompts_file), "--batch-prompts", str(args.batch_pairs),
           "--max-new-tokens", str(args.max_new_tokens), "--max-length", str(args.max_length),
           "--temperature", str(r["temperature"]), "--top-p", str(r["top_p"]),
           "--beta", str(params["dpo"]["beta"]), "--lr", str(params["train"]["lr"])]
    log = logs / "trl_online_dpo.out"
    t0 = time.perf_counter()
    with DevicePeak() as mem, open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                timeout=max(1.0, timeout_s)).returncode
        except subprocess.TimeoutExpired:
            rc = None
    wall = round(time.perf_counter() - t0, 2)
    lines = json_lines(log.read_text(errors="replace"))
    done = [x for x in lines if not x.get("progress")]
    if rc == 0 and done:
        return {**done[-1], "wall_s": wall, "device_peak_gib": mem.peak_gib}
    progress = [x for x in lines if x.get("progress")]
    tail = log.read_text(errors="replace")[-3000:]
    if rc is None:
        return {"status": "timeout", "timeout_s": round(timeout_s, 1), "wall_s": wall,
                "device_peak_gib": mem.peak_gib, "progress": progress[-1] if progress else None, "error": tail}
    return {**failure_record(StageFailed(cmd, rc, tail)), "wall_s": wall,
            "progress": progress[-1] if progress else None}


def side_by_side(result: dict) -> list[dict]:
    """One row per part, ours beside TRL: seconds and throughput (None where a side did not run it or has no such
    part; a TRL row stopped by the deadline gives its figures so far, marked partial)."""
    o = result.get("ours_summary", {})
    t = result.get("trl") or {}
    partial = t.get("status") == "timeout"
    if t.get("status") is not None:        # failed or stopped: its progress so far, no whole-run figures
        prog = t.get("progress") or {}
        dpo_s = (round(prog["train_elapsed_s"] - prog["generate_s"] - prog["reward_s"], 2)
                 if "train_elapsed_s" in prog else None)
        t = {**prog, "dpo_s": dpo_s, "dpo_tokens_per_s": round(prog["forward_tokens"] / dpo_s) if dpo_s else None,
             "wall_s": None, "device_peak_gib": t.get("device_peak_gib")}
    sl, ref, tr = o.get("sample_and_label", {}), o.get("ref_logps", {}), o.get("train_dpo", {})

    def ratio(a, b):
        return round(a / b, 2) if a and b else None
    ours_dpo = round(tr["train_s"] + ref["pass_s"], 2) if tr and ref else None
    rows = [
        {"part": "sampling", "ours_s": sl.get("sampling_s"), "trl_s": t.get("generate_s"),
         "ours_samples": sl.get("samples"), "trl_samples": t.get("completions"),
         "ours_generated_tokens": sl.get("generated_tokens"), "trl_generated_tokens": t.get("generated_tokens"),
         "ours_generated_tokens_per_s": sl.get("generated_tokens_per_s"),
         "trl_generated_tokens_per_s": (round(t["generated_tokens"] / t["generate_s"], 1)
                                        if t.get("generate_s") else None),
         "note": "ours: rounds.n samples a prompt, its seconds include loading the policy; TRL: 2 a prompt"},
        {"part": "labeling", "ours_s": sl.get("labeling_s"), "trl_s": t.get("reward_s"),
         "note": "ours: scores token ids, its seconds include loading the judge; TRL: decoded text, re-tokenized"},
        {"part": "reference + DPO", "ours_s": ours_dpo, "trl_s": t.get("dpo_s"),
         "ours_reference_s": ref.get("pass_s"), "ours_train_s": tr.get("train_s"),
         "ours_train_tokens_per_s": tr.get("tokens_per_s"), "trl_dpo_tokens_per_s": t.get("dpo_tokens_per_s"),
         "note": "ours: the reference pass (ref_logps) + the training loop; TRL: train() less sampling and labeling "
                 "(its live reference inside)"},
        {"part": "whole round, wall (start-ups, loads included)", "ours_s": o.get("round_wall_s"),
         "trl_s": t.get("wall_s"), "ours_peak_gib": max([v for v in (sl.get("device_peak_gib"),
                                                                      ref.get("device_peak_gib"),
                                                                      tr.get("device_peak_gib")) if v is not None],
                                                         default=None),
         "trl_peak_gib": t.get("device_peak_gib"),
         "prompts": result.get("workload", {}).get("round_prompts"),
         "trl_to_ours_wall": ratio(t.get("wall_s"), o.get("round_wall_s"))},
    ]
    if partial:
        for row in rows:
            row["trl_partial"] = (f"stopped by --deadline-s after {t['step']} of {t['max_steps']} steps"
                                  if t.get("step") is not None else "stopped by --deadline-s before a progress line")
    return rows


# ------------------------------------------------------------------------------------------------

def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shared", default=str(REPO.parent / "shared"))
    ap.add_argument("--out", required=True, help="a folder: result.json, logs and perf records")
    ap.add_argument("--prompts", type=int, default=2000, help="the first N HH-RLHF rows give the round's prompts")
    ap.add_argument("--probe-pairs", type=int, default=64, help="the last rows: the probe (train_dpo scores it)")
    ap.add_argument("--n", type=int, default=4, help="rounds.n: samples per prompt (ours; TRL's is fixed at 2)")
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--modes", default="ours,trl", help="comma-separated: ours, trl")
    ap.add_argument("--trl-site", help="a folder with trl / datasets / dill / multiprocess installed (pip --target)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="generation.max_new_tokens / TRL's max_new_tokens")
    ap.add_argument("--eos-every", type=float, help="the policy samples EOS about once every this many tokens "
                    "(default max_new_tokens / 2)")
    ap.add_argument("--max-length", type=int, default=1024, help="tokenize.max_length / TRL's max_length")
    ap.add_argument("--batch-pairs", type=int, default=16, help="pairs per optimizer step (train.global_batch_pairs; "
                    "TRL's per_device_train_batch_size, prompts per step)")
    ap.add_argument("--gen-batch", type=int, default=256, help="generation.batch_size: rows ours samples together")
    ap.add_argument("--deadline-s", type=float, default=560, help="the TRL row is stopped when the whole bench has "
                    "run this long (a device command's limit is 600 s): it is recorded as a timeout with its progress")
    ap.add_argument("--work", default="/tmp/prefpipe_rounds_bench")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        raise SystemExit(f"rounds_bench: refused: --modes {args.modes!r} (known: {', '.join(MODES)})")
    if args.n < 2:
        raise SystemExit("rounds_bench: refused: --n must be >= 2 (best vs worst)")
    every = args.eos_every or args.max_new_tokens / 2

    import torch
    import transformers
    shared = Path(args.shared).resolve()
    hh = shared / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"
    gpt2 = shared / "data" / "tokenizers" / "gpt2"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs, out_json = out, out / "result.json"
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cuda = torch.cuda.is_available()
    t_all = time.perf_counter()
    result: dict = {
        "bench": "rounds_bench", "issue": 36, "note": NOTE, "differences_from_trl": DIFFERENCES,
        "command": "python bench/rounds_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "git_commit": commit(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(), "transformers": transformers.__version__, "modes": modes,
        "shape": args.shape, "shape_config": SHAPES[args.shape],
        "parameters": param_counts(SHAPES[args.shape])["total"]}

    def save() -> None:
        result["total_s"] = round(time.perf_counter() - t_all, 1)
        out_json.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")

    # -- the workload: prompts, policy (+ EOS), judge, the reference's identity, params
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    t0 = time.perf_counter()
    workload = prepare_tokens(hh, gpt2, args.prompts, args.probe_pairs, args.max_length, work)
    workload["excluded_from_train"] = drop_probe_prompt_leaks(work)
    t_tokens = time.perf_counter() - t0
    policy, policy_facts = make_model(args.shape, gpt2, work)
    copy_tokenizer(gpt2, policy)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = round_prompts(work, vocab)
    workload["round_prompts"] = len(prompts)
    workload["round_prompt_tokens"] = sum(len(p) for p in prompts)
    t1 = time.perf_counter()
    policy_facts["eos"] = set_eos_rate(policy, every, prompts, float(base["rounds"]["temperature"]),
                                       float(base["rounds"]["top_p"]))
    policy_facts["eos"]["seconds"] = round(time.perf_counter() - t1, 2)
    judge = work / f"judge-{args.shape}"
    judge_facts = make_judge(args.shape, gpt2, judge)
    rounds = {**base["rounds"], "n": args.n, "prompts": None, "min_margin": 0.0, "reference": "initial",
              "judge": "trained"}
    rounds.pop("train", None)
    params = bench_params(base, {
        "ref": {"source": "local", "repo_id": "bench/rounds-policy", "revision": None, "local_dir": str(policy)},
        "train.gpus": 1 if cuda else 0, "train.epochs": 1, "train.global_batch_pairs": args.batch_pairs,
        "train.lr": 5e-7, "train.warmup_ratio": 0.0, "train.schedule": "linear", "train.micro_batch_tokens": 16384,
        "train.precision": "bf16" if cuda else "autocast",
        "tokenize.max_length": args.max_length, "tokenize.max_prompt_length": args.max_length - 64,
        "tokenize.truncation": "truncate_completion",
        "dpo": {"objective": "dpo", "loss": "sigmoid", "beta": 0.1, "label_smoothing": 0.0, "rounds": 2},
        "rounds": rounds, "generation.max_new_tokens": args.max_new_tokens, "generation.batch_size": args.gen_batch})
    params_file = work / "params_rounds.yaml"
    identity = work / "ref_identity.json"
    result.update(workload=workload, models={"policy": policy_facts, "judge": judge_facts},
                  settings={"prompts_rows": args.prompts, "probe_pairs": args.probe_pairs, "n": args.n,
                            "temperature": rounds["temperature"], "top_p": rounds["top_p"],
                            "max_new_tokens": args.max_new_tokens, "eos_every": every, "max_length": args.max_length,
                            "batch_pairs": args.batch_pairs, "gen_batch": args.gen_batch, "lr": 5e-7, "beta": 0.1,
                            "loss": "sigmoid", "precision": params["train"]["precision"]},
                  setup={"tokens_s": round(t_tokens, 2)})
    save()
    print(f"rounds_bench: {len(prompts)} prompts, {args.shape}, policy EOS row {policy_facts['eos']['eos_row_norm']} "
          f"(stop rate {policy_facts['eos']['calibrated_stop_rate']} a token)", flush=True)

    if "ours" in modes:
        # the pinned identity names the policy directory as it is now, EOS row included
        result["setup"]["pin_and_verify_s"] = pin_and_verify(policy, params, params_file, identity, logs)
        result["params"] = {k: params[k] for k in ("train", "tokenize", "dpo", "rounds", "generation")}
        save()
        result["ours"] = run_ours(params_file, identity, policy, judge, work, logs, save)
        result["ours_summary"] = ours_summary(result["ours"])
        save()
    if "trl" in modes:
        prompts_file = work / "trl_prompts.jsonl"
        result["trl_prompts"] = write_trl_prompts(prompts, gpt2, prompts_file)
        result["trl"] = run_trl(policy, judge, prompts_file, args, params, logs,
                                args.deadline_s - (time.perf_counter() - t_all))
        save()
    result["side_by_side"] = side_by_side(result)
    save()
    for row in result["side_by_side"]:
        print(json.dumps(row), flush=True)
    return result


if __name__ == "__main__":
    main()
