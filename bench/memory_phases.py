"""Where a GPU run's peak memory is reached: runs train_rm (or train_dpo) once on the 0.2B shape of
tests/engine/test_gpu.py::test_memory_plan_bounds_the_measured_peak_on_gpu and prints, per phase, the peak of
torch.cuda.max_memory_allocated() inside it and the bytes allocated after it, beside the memory plan's parts.
A diagnostic (wraps engine functions to read the allocator between phases), not part of any stage:

    python bench/memory_phases.py --state bf16_sr_8bit [--objective rm] [--workdir /tmp/phases]
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

ROWS: list[tuple[str, float, float]] = []


def _gib(x: int) -> float:
    return round(x / 2 ** 30, 3)


def _phase(name: str) -> None:
    ROWS.append((name, _gib(torch.cuda.max_memory_allocated()), _gib(torch.cuda.memory_allocated())))
    torch.cuda.reset_peak_memory_stats()


def _wrap(owner, attr: str, label: str) -> None:
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def wrapped(*a, **k):
        torch.cuda.synchronize()
        _phase(f"(before {label})")
        out = fn(*a, **k)
        torch.cuda.synchronize()
        _phase(label)
        return out
    setattr(owner, attr, wrapped)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state", default="bf16_sr_8bit")
    ap.add_argument("--objective", default="rm", choices=["rm", "dpo"])
    ap.add_argument("--workdir", default="/tmp/memory_phases")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, Qwen2Config
    from engine_helpers import toy_task_rows, write_token_parquet
    from stage_helpers import write_train_params
    from stages.engine import flat_adamw, loop, startup, steps
    tmp = Path(args.workdir) / args.state
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = Qwen2Config(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, max_position_embeddings=512)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp / "m")
    write_token_parquet(tmp / "train.parquet", toy_task_rows(256, seed=1, vocab=32000))
    write_token_parquet(tmp / "probe.parquet", toy_task_rows(16, seed=2, vocab=32000, prefix="q"))
    params = write_train_params(tmp / "p.yaml", train={"gpus": 1, "precision": "bf16", "epochs": 1,
                                                       "micro_batch_tokens": 4096, "global_batch_pairs": 64,
                                                       "optimizer": {"state": args.state}},
                                dpo={"objective": "dpo_ref_free"})
    mark = startup.mark

    def marked(name):
        torch.cuda.synchronize()
        _phase(f"startup: {name}")
        return mark(name)
    startup.mark = marked
    _wrap(loop, "probe", "probe")
    _wrap(loop, "export_trained", "export")
    _wrap(flat_adamw.FlatLowBitAdamW, "_build", "flat 8-bit build")
    _wrap(flat_adamw.FlatMasterAdamW, "_build", "flat exact build")
    _wrap(steps.StepGraphs, "micro_batch", "micro-batch (eager, capture or replay)")
    _wrap(steps.StepGraphs, "optimizer_step", "optimizer step")
    stage = __import__(f"stages.train_{args.objective}", fromlist=["main"])
    info = stage.main(["--params", str(params), "--model-dir", str(tmp / "m"), "--train-tokens",
                       str(tmp / "train.parquet"), "--probe-tokens", str(tmp / "probe.parquet"),
                       "--out-dir", str(tmp / "out"), "--log", str(tmp / "log"), "--perf", str(tmp / "perf.json")])
    _phase("end")
    plan = info["memory_plan"]
    print(json.dumps({k: (_gib(v) if isinstance(v, int) and k not in ("parameters", "trainable", "micro_batch_tokens",
                                                                       "checkpointed_layers", "layers") else v)
                      for k, v in plan.items()}))
    print(f"{'phase':45s} {'peak GiB':>9s} {'after GiB':>9s}")
    for name, peak, after in ROWS:          # "(before X)": the peak since the previous phase ended
        print(f"{name:45s} {peak:9.3f} {after:9.3f}")
    print("overall peak GiB:", max(p for _, p, _ in ROWS), "plan total GiB:", _gib(plan["total"]),
          "graphs:", info["cuda_graphs"].get("enabled"), info["cuda_graphs"].get("optimizer"))


if __name__ == "__main__":
    main()
