"""What fits on one GPU: the memory plan (stages/engine/memory_plan.py) of full fine-tuning for real model shapes in
each optimizer-state mode, against an 80 GB and a 141 GB device, with the fewest activation-checkpointed layers that
fit (what `train.activation_checkpointing: auto` picks). It reads no weights and needs no GPU: the plan comes from
config.json's shape alone. The plan is an estimate checked against measured peaks by tests/engine/test_gpu.py and the
7B runs in docs/PERFORMANCE.md.

    python bench/memory_fit.py [--micro-batch-tokens 4096] [--head lm_head|score] [--out fit.md]
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

# Published config.json shapes (the Hub repositories' own files), Qwen2 and Llama families.
SHAPES = {
    "Qwen2.5-7B": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 tie_word_embeddings=False)),
    "Llama-3.1-8B": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                   tie_word_embeddings=False)),
    "Qwen2.5-14B": ("qwen2", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                                  num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                                  tie_word_embeddings=False)),
}
GIB = 2 ** 30
# What torch.cuda.get_device_properties().total_memory reports: an 80 GB card (H100/A100) 79.1 GiB, an H200 139.8 GiB.
DEVICES = {"80 GB (79.1 GiB)": int(79.1 * GIB), "141 GB (139.8 GiB)": int(139.8 * GIB)}
MODES = [{"state": "exact"}, {"state": "exact", "fused_backward": True},
         {"state": "fp32_master_8bit"}, {"state": "fp32_master_8bit", "fused_backward": True},
         {"state": "bf16_sr_8bit"}, {"state": "bf16_sr_8bit", "fused_backward": True}]


def model_config(family: str, shape: dict) -> dict:
    import transformers
    cls = transformers.Qwen2Config if family == "qwen2" else transformers.LlamaConfig
    return cls(**shape).to_dict()


def settings_for(mode: dict):
    import yaml
    from stages.engine.settings import TrainSettings
    params = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    train = {**params["train"], "precision": "bf16", "gpus": 1, "optimizer": dict(mode),
             "activation_checkpointing": False}
    if mode.get("fused_backward"):
        train["max_grad_norm"] = 0.0          # fused_backward steps each tensor in backward: no global clip
    return TrainSettings.from_params({**params, "train": train})


def fit_rows(cfg: dict, head: str, micro_batch_tokens: int, graphed: bool = True) -> list[dict]:
    from stages.engine.memory_plan import estimate, fewest_checkpointed
    rows = []
    for mode in MODES:
        settings = settings_for(mode)
        row = {"mode": mode, "plan": estimate(cfg, head, settings, micro_batch_tokens, graphed=graphed)}
        for name, size in DEVICES.items():
            plan = fewest_checkpointed(cfg, head, replace(settings), micro_batch_tokens, 1, size, "cuda", graphed)
            row[name] = plan if plan.fits else None
        rows.append(row)
    return rows


def table(title: str, rows: list[dict]) -> str:
    out = [title, "", "| train.optimizer | plan, no checkpointing | " + " | ".join(DEVICES) + " |",
           "|---|---|" + "---|" * len(DEVICES)]
    for row in rows:
        cells = []
        for name in DEVICES:
            plan = row[name]
            if plan is None:
                cells.append("no")
            elif plan.checkpointed_layers:
                cells.append(f"yes, {plan.checkpointed_layers}/{plan.layers} layers checkpointed "
                             f"({plan.total / GIB:.0f} GiB)")
            else:
                cells.append(f"yes ({plan.total / GIB:.0f} GiB)")
        mode = ", ".join(f"{k}: {str(v).lower()}" for k, v in row["mode"].items())
        out.append(f"| `{{{mode}}}` | {row['plan'].total / GIB:.0f} GiB | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--head", choices=["lm_head", "score"], default="lm_head",
                    help="lm_head: DPO's policy; score: the reward model")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    from stages.engine.memory_plan import tensor_shapes
    what = "DPO" if args.head == "lm_head" else "reward model"
    parts = []
    for name in args.shapes:
        cfg = model_config(*SHAPES[name])
        n = sum(k for _, k in tensor_shapes(cfg, args.head))
        parts.append(table(f"{name} ({n / 1e9:.2f}B), full {what}, one GPU, precision bf16, CUDA graphs, "
                           f"{args.micro_batch_tokens}-token micro-batches", fit_rows(cfg, args.head,
                                                                                  args.micro_batch_tokens)))
    text = "\n\n".join(parts) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    return text


if __name__ == "__main__":
    main()
