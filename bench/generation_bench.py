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


def run_ours(model, prompts, settings, stop, device, cuda_graphs: bool) -> tuple[float, int, dict]:
    from stages.engine.generation import generate
    _sync(device)
    t0 = time.perf_counter()
    run = generate(model, prompts, list(range(len(prompts))), settings, stop, EOS_ID, device, cuda_graphs=cuda_graphs)
    _sync(device)
    seconds = time.perf_counter() - t0
    return seconds, sum(len(c.tokens) for c in run.completions), run.cuda_graphs


def run_hf(model, prompts, settings, device) -> tuple[float, int, dict]:
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
    return time.perf_counter() - t0, tokens, {"enabled": False, "reason": "transformers generate"}


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
    for batch_size in args.batch_sizes:
        settings = GenerationSettings(max_new_tokens=args.max_new_tokens, temperature=0.0, top_p=1.0, seed=0, n=1,
                                      batch_size=batch_size)
        warm = GenerationSettings(**{**settings.__dict__, "max_new_tokens": min(4, args.max_new_tokens)})
        for engine in args.engines:
            for side in ("policy", "reference"):
                model = models[side]
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                try:
                    if engine == "ours":
                        run_ours(model, prompts[:batch_size], warm, stop, device, args.cuda_graphs)   # warm-up
                        seconds, tokens, graphs = run_ours(model, prompts, settings, stop, device, args.cuda_graphs)
                    else:
                        run_hf(model, prompts[:batch_size], warm, device)
                        seconds, tokens, graphs = run_hf(model, prompts, settings, device)
                except torch.OutOfMemoryError as e:
                    rows.append({"shape": shape, "engine": engine, "side": side, "batch_size": batch_size,
                                 "error": f"OOM: {str(e)[:200]}"})
                    torch.cuda.empty_cache()
                    continue
                rows.append({
                    "shape": shape, "engine": engine, "side": side, "batch_size": batch_size,
                    "completions": len(prompts), "generated_tokens": tokens, "seconds": round(seconds, 3),
                    "completions_per_s": round(len(prompts) / seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
                    "cuda_graphs": graphs, "build_s": round(build_s, 1),
                    "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2)
                    if device.type == "cuda" else None})
                print(_line(rows[-1]), flush=True)
    del models
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['shape']:>13} {r['engine']:>4} {r['side']:>9} batch {r['batch_size']:>4}  {r['error']}"
    return (f"{r['shape']:>13} {r['engine']:>4} {r['side']:>9} batch {r['batch_size']:>4}  {r['completions']:>5} "
            f"completions {r['generated_tokens']:>7} tokens {r['seconds']:>8.2f} s  {r['completions_per_s']:>8.2f} "
            f"completions/s {r['tokens_per_s']:>9.1f} tokens/s  graphs {r['cuda_graphs'].get('enabled')}"
            + (f"  peak {r['peak_gib']} GiB" if r["peak_gib"] is not None else ""))


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
