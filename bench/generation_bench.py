"""Generation throughput (issue 28): completions/s and tokens/s of the generate stage's loop on one device.

    python bench/generation_bench.py --shapes qwen2.5-0.5b,qwen2.5-7b --out bench/results/generation.json
    python bench/generation_bench.py --shapes tiny --prompts 6 --max-new-tokens 4 --batch-sizes 4 --device cpu  # smoke

Per shape (gpu_bench.SHAPES, Qwen2.5 configs), a model is built from its config with random weights (no hub, no
download: seed 0, in bf16 on CUDA, fp32 on CPU) and stands for the reference; the policy is that model with a LoRA
adapter (gpu_bench.LORA: r 16 on every Linear of every layer, its B matrices random so the merge changes the
weights) merged in, as load_policy_lm merges a train.adapter export. Both are made ready by
stages/engine/generation.py as_generation_model and run through `generate`, the stage's loop (packed prefill,
KV cache, decode step as a CUDA graph with --cuda-graphs), greedy, on `--prompts` prompts of random token ids whose
lengths are drawn uniformly from --prompt-lengths (the probe's prompts are 20-300 tokens). No EOS is ever hit
(the stop id is one past the vocabulary), so every completion is max_new_tokens long and the work is the same for
every engine.

--engines hf adds transformers' own `generate` (left-padded batches, static cache, sdpa attention) on the same
models, prompts and batch sizes: the other way issue 28 names, measured the same way.

Each row: shape, engine, side, batch_size, completions, generated tokens, seconds (generation only: after a
warm-up batch, model load excluded), completions/s, tokens/s, peak GPU memory. The rows are printed as a table and
written as JSON (--out).

Ours also gets its two phases timed apart (generate's phase_seconds: the device synchronized around each prefill
and each decode loop) and set against their rooflines (`roofline`, printed): a decode step must read every weight
once and each row's keys and values up to its position, and do 2 FLOPs a weight a row plus the attention's; a
prefill does 2 FLOPs a weight a prompt token plus causal attention. The bound of a phase is the larger of
bytes / --peak-gbps and FLOPs / --peak-tflops (defaults from the card's name: H100 SXM 3350 GB/s, H200 4800 GB/s,
989 dense bf16 TFLOPs for both). "decode tokens/s" = rows x decode steps / decode seconds, the figure the decode
roofline bounds.

--hf-best: transformers' `generate` at its best, as issue 38 asks: dynamo's recompile limit raised (the static
cache's per-layer guards otherwise hit it and run uncompiled) and the warm-up a full batch at full length, so the
compile is paid before the clock starts.

--profile-out DIR: torch.profiler over one batch of ours with the decode step eager (kernels named one by one;
a CUDA graph replays the same kernels), the CUDA kernels' time grouped by name, written as DIR/<shape>_b<batch>.txt.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from gpu_bench import LORA, SHAPES, qwen2_config  # noqa: E402

EOS_ID = 0          # the config's eos/pad id (the models never see a tokenizer: the prompts are random ids)


def build_models(shape: str, device, dtype, lora_seed: int = 1) -> dict:
    """{"reference": model, "policy": the reference with a random LoRA adapter merged} made ready for `generate`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from stages.engine.generation import as_generation_model
    from stages.engine.modeling import use_fused_kernels
    models = {}
    for side in ("reference", "policy"):
        torch.manual_seed(0)                   # the same base weights for both sides
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(qwen2_config(shape, EOS_ID), dtype=dtype)
        if side == "policy":
            cfg = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                             target_modules=LORA["target_modules"])
            peft_model = get_peft_model(model, cfg)
            gen = torch.Generator(device="cpu").manual_seed(lora_seed)
            with torch.no_grad():
                for name, p in peft_model.named_parameters():
                    if "lora_B" in name:       # peft starts B at zero: the merge would be the identity
                        p.copy_(torch.randn(p.shape, generator=gen).mul_(1e-3).to(p.device, p.dtype))
            model = peft_model.merge_and_unload()
        model.prefpipe_fused_kernels = use_fused_kernels(model)
        models[side] = as_generation_model(model, device, dtype)
    return models


def random_prompts(n: int, lengths: tuple[int, int], vocab: int, seed: int = 0) -> list:
    import numpy as np
    rng = np.random.default_rng(seed)
    # ids from 1: 0 is the eos/pad id
    return [rng.integers(1, min(vocab, 50257), size=int(rng.integers(lengths[0], lengths[1] + 1)), dtype=np.int64)
            for _ in range(n)]


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CARD_PEAKS = {"H200": (4800.0, 989.0), "H100": (3350.0, 989.0)}   # GB/s, dense bf16 TFLOP/s (SXM datasheets)


def card_peaks(name: str) -> tuple[float, float] | None:
    for key, peaks in CARD_PEAKS.items():
        if key in name:
            return peaks
    return None


def roofline(shape: str, batch: int, prompt_lengths: list[int], new_tokens: int, peak_gbps: float,
             peak_tflops: float, weight_bytes: int = 2) -> dict:
    """The bounds of one batch's two phases (module docstring) for the Qwen2.5 shape `shape`, `batch` rows with the
    given prompt lengths (their mean is used), new_tokens decode steps: seconds, and the tokens/s they allow."""
    sh = SHAPES[shape]
    h, layers, inter, vocab = sh["hidden_size"], sh["num_hidden_layers"], sh["intermediate_size"], sh["vocab_size"]
    hq, hkv = sh["num_attention_heads"], sh["num_key_value_heads"]
    d = h // hq
    per_layer = h * (hq * d) + 2 * h * (hkv * d) + (hq * d) * h + 3 * h * inter     # q, k, v, o, gate/up/down
    matmul_weights = layers * per_layer + vocab * h                                # + lm_head (the embedding: a gather)
    kv_per_position = layers * 2 * hkv * d * weight_bytes
    prompt = sum(prompt_lengths) / len(prompt_lengths)
    context = prompt + (new_tokens - 1) / 2                                        # a decode step's mean keys
    decode_bytes = matmul_weights * weight_bytes + batch * context * kv_per_position
    decode_flops = 2 * matmul_weights * batch + 4 * layers * hq * d * context * batch
    decode_s = max(decode_bytes / (peak_gbps * 1e9), decode_flops / (peak_tflops * 1e12))
    prefill_tokens = prompt * batch
    prefill_flops = 2 * (layers * per_layer) * prefill_tokens + 2 * vocab * h * batch \
        + 2 * layers * hq * d * prompt * prefill_tokens                            # causal: half of 4 * T^2 a head
    prefill_s = max(prefill_flops / (peak_tflops * 1e12), matmul_weights * weight_bytes / (peak_gbps * 1e9))
    steps = new_tokens - 1                # the first token is sampled from the prefill's logits
    return {"peak_gbps": peak_gbps, "peak_tflops": peak_tflops, "matmul_weights": matmul_weights,
            "decode_step_gb": round(decode_bytes / 1e9, 3), "decode_step_tflop": round(decode_flops / 1e12, 3),
            "decode_step_ms": round(decode_s * 1e3, 3),
            "decode_bound": "memory" if decode_bytes / (peak_gbps * 1e9) >= decode_flops / (peak_tflops * 1e12)
            else "compute",
            "decode_tokens_per_s": round(batch / decode_s, 1),
            "prefill_ms": round(prefill_s * 1e3, 2),
            "batch_tokens_per_s": round(batch * new_tokens / (prefill_s + steps * decode_s), 1)}


def run_ours(model, prompts, settings, stop, device, cuda_graphs: bool) -> tuple[float, int, dict, dict]:
    from stages.engine.generation import generate
    phases: dict = {}
    _sync(device)
    t0 = time.perf_counter()
    run = generate(model, prompts, list(range(len(prompts))), settings, stop, EOS_ID, device, cuda_graphs=cuda_graphs,
                   phase_seconds=phases)
    _sync(device)
    seconds = time.perf_counter() - t0
    return seconds, sum(len(c.tokens) for c in run.completions), run.cuda_graphs, phases


def profile_ours(model, prompts, settings, stop, device, out: Path) -> None:
    """One batch, decode eager, under torch.profiler: CUDA kernel time by name (module docstring)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from stages.engine.generation import generate
    run_ours(model, prompts, settings, stop, device, False)                    # warm-up, uncaptured
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate(model, prompts, list(range(len(prompts))), settings, stop, EOS_ID, device, cuda_graphs=False)
        torch.cuda.synchronize(device)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90))
    print(f"profile: {out}", flush=True)


def raise_recompile_limit(limit: int = 256) -> None:
    """transformers' static-cache generate compiles its forward; dynamo guards each attention layer's layer_idx and
    stops compiling (running the rest eager) past its recompile limit (8): raised, the compile covers every layer."""
    import torch._dynamo
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, limit)
    if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
        torch._dynamo.config.accumulated_recompile_limit = max(limit * 4, torch._dynamo.config.accumulated_recompile_limit)


def run_hf(model, prompts, settings, device) -> tuple[float, int, dict, dict]:
    """transformers' generate: left-padded batches of batch_size, static cache, greedy, exactly max_new_tokens."""
    import torch
    model.set_attn_implementation("sdpa")
    tokens = 0
    _sync(device)
    t0 = time.perf_counter()
    for start in range(0, len(prompts), settings.batch_size):
        chunk = prompts[start:start + settings.batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), EOS_ID, dtype=torch.int64)
        mask = torch.zeros((len(chunk), width), dtype=torch.int64)
        for i, p in enumerate(chunk):
            ids[i, width - len(p):] = torch.as_tensor(p)
            mask[i, width - len(p):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                             max_new_tokens=settings.max_new_tokens, min_new_tokens=settings.max_new_tokens,
                             cache_implementation="static", pad_token_id=EOS_ID)
        tokens += (out.shape[1] - width) * len(chunk)
    _sync(device)
    from stages.engine.generation import register_generation_attention
    model.set_attn_implementation(register_generation_attention())
    return time.perf_counter() - t0, tokens, {"enabled": False, "reason": "transformers generate"}, {}


def bench_shape(shape: str, args, device, dtype) -> list[dict]:
    import torch
    from stages.engine.generation import GenerationSettings, StopTokens
    t0 = time.perf_counter()
    models = build_models(shape, device, dtype)
    build_s = time.perf_counter() - t0
    vocab = SHAPES[shape]["vocab_size"]
    stop = StopTokens((vocab,))                # never generated: every completion runs max_new_tokens
    prompts = random_prompts(args.prompts, args.prompt_lengths, vocab)
    rows = []
    if args.hf_best and "hf" in args.engines:
        raise_recompile_limit()
    for batch_size in args.batch_sizes:
        settings = GenerationSettings(max_new_tokens=args.max_new_tokens, temperature=0.0, top_p=1.0, seed=0, n=1,
                                      batch_size=batch_size)
        warm = GenerationSettings(**{**settings.__dict__, "max_new_tokens": min(4, args.max_new_tokens)})
        bound = None
        if args.peak_gbps and args.peak_tflops:
            bound = roofline(shape, batch_size, [len(p) for p in prompts], args.max_new_tokens, args.peak_gbps,
                             args.peak_tflops, weight_bytes=2 if dtype == torch.bfloat16 else 4)
            print(f"{shape:>13} roofline batch {batch_size:>4}: {bound}", flush=True)
        if args.profile_out and device.type == "cuda" and batch_size == args.batch_sizes[0]:
            profile_ours(models["policy"], prompts[:batch_size], settings, stop, device,
                         Path(args.profile_out) / f"{shape}_b{batch_size}.txt")
        for engine in args.engines:
            for side in ("policy", "reference"):
                model = models[side]
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                try:
                    if engine == "ours":
                        run_ours(model, prompts[:batch_size], warm, stop, device, args.cuda_graphs)   # warm-up
                        seconds, tokens, graphs, phases = run_ours(model, prompts, settings, stop, device,
                                                                   args.cuda_graphs)
                    else:
                        # at its best: the warm-up is a full batch at full length (the compile, before the clock)
                        run_hf(model, prompts[:batch_size], settings if args.hf_best else warm, device)
                        seconds, tokens, graphs, phases = run_hf(model, prompts, settings, device)
                except torch.OutOfMemoryError as e:
                    rows.append({"shape": shape, "engine": engine, "side": side, "batch_size": batch_size,
                                 "error": f"OOM: {str(e)[:200]}"})
                    torch.cuda.empty_cache()
                    continue
                rows.append({
                    "shape": shape, "engine": engine, "side": side, "batch_size": batch_size,
                    "completions": len(prompts), "generated_tokens": tokens, "seconds": round(seconds, 3),
                    "completions_per_s": round(len(prompts) / seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
                    "cuda_graphs": graphs, "build_s": round(build_s, 1), **phase_figures(phases, batch_size, bound),
                    "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2)
                    if device.type == "cuda" else None})
                print(_line(rows[-1]), flush=True)
    del models
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def phase_figures(phases: dict, batch: int, bound: dict | None) -> dict:
    """prefill/decode seconds, decode tokens/s (rows x steps / decode seconds) and its fraction of the roofline."""
    if not phases:
        return {}
    out = {"prefill_s": round(phases["prefill"], 3), "decode_s": round(phases["decode"], 3),
           "decode_tokens_per_s": round(batch * phases["decode_steps"] / phases["decode"], 1)}
    if bound is not None:
        out["decode_roofline_fraction"] = round(out["decode_tokens_per_s"] / bound["decode_tokens_per_s"], 3)
    return out


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['shape']:>13} {r['engine']:>4} {r['side']:>9} batch {r['batch_size']:>4}  {r['error']}"
    return (f"{r['shape']:>13} {r['engine']:>4} {r['side']:>9} batch {r['batch_size']:>4}  {r['completions']:>5} "
            f"completions {r['generated_tokens']:>7} tokens {r['seconds']:>8.2f} s  {r['completions_per_s']:>8.2f} "
            f"completions/s {r['tokens_per_s']:>9.1f} tokens/s  graphs {r['cuda_graphs'].get('enabled')}"
            + (f"  peak {r['peak_gib']} GiB" if r["peak_gib"] is not None else "")
            + (f"  prefill {r['prefill_s']} s decode {r['decode_s']} s = {r['decode_tokens_per_s']} decode tokens/s"
               if "decode_s" in r else "")
            + (f" ({r['decode_roofline_fraction']:.0%} of its roofline)" if "decode_roofline_fraction" in r else ""))


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(":"))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LO:HI with 1 <= LO <= HI")
    return lo, hi


def main(argv=None) -> list[dict]:
    import torch
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-7b")
    ap.add_argument("--prompts", type=int, default=512, help="prompts (one completion each), as the probe's 512")
    ap.add_argument("--prompt-lengths", type=_pair, default=(32, 256), metavar="LO:HI")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="64,256")
    ap.add_argument("--engines", default="ours,hf", help="ours (the stage's loop) and/or hf (transformers generate)")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="capture the decode step as a CUDA graph (the stage's default on GPU: train.cuda_graphs)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--peak-gbps", type=float, help="memory bandwidth for the roofline (default: by card name)")
    ap.add_argument("--peak-tflops", type=float, help="dense bf16 TFLOP/s for the roofline (default: by card name)")
    ap.add_argument("--hf-best", action="store_true", help="transformers generate at its best (module docstring)")
    ap.add_argument("--profile-out", help="a folder for the decode profile of ours (CUDA only)")
    ap.add_argument("--out", help="JSON file for the rows")
    args = ap.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    args.engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(args.shapes) - set(SHAPES)) + sorted(set(args.engines) - {"ours", "hf"})
    if unknown:
        raise SystemExit(f"generation_bench: refused: unknown shape or engine {unknown} (shapes {sorted(SHAPES)})")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32   # as the stage: inference_dtype
    peaks = card_peaks(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if peaks is not None:
        args.peak_gbps = args.peak_gbps or peaks[0]
        args.peak_tflops = args.peak_tflops or peaks[1]
    rows = []
    for shape in args.shapes:
        rows += bench_shape(shape, args, device, dtype)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": str(dtype),
              "settings": {k: v for k, v in vars(args).items() if k not in ("out",)}, "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
