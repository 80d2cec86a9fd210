"""TRL DPOTrainer / RewardTrainer throughput on a model DIRECTORY, optionally with a PEFT LoRA adapter.

    python bench/trl_peft_runner.py MODE N --model-dir DIR --data ROWS.jsonl.gz --tokenizer GPT2_DIR \
        [--max-length 1024] [--lora-r 16 --lora-alpha 32 --lora-dropout 0.0 --lora-targets q_proj,...]

Why not ../shared/bench/trl_anchor.py: the anchor builds its random model on the CPU from a hard-coded
Qwen2.5-0.5B-like config (tied embeddings, 2 KV heads, vocab 151,936); a 7B model built that way costs
minutes and 15-30 GB of host RAM, and the anchor has no PEFT mode. This runner keeps every TRL setting of
the anchor (batch 8 pairs, one epoch, bf16, SDPA, logging_steps 8, save_strategy no, dataloader_num_workers 2,
seed 0, DPO lr 5e-7 / beta 0.1, RM lr 1e-5, the same independent token count) and loads the model that
bench/gpu_bench.py wrote ONCE for every mode (ours and TRL), straight onto the GPU in bf16.

Modes (gradient checkpointing off in all but the TRL-default ones, as the anchor's *_tuned):
  dpo        TRL defaults (gradient checkpointing on, precompute_ref_log_probs off: the reference is a
             second copy of the model run live)
  dpo_tuned  precompute_ref_log_probs=True, gradient_checkpointing=False (TRL's fastest full fine-tune)
  rm         RewardTrainer defaults; rm_tuned: gradient_checkpointing=False
  dpo_peft   dpo_tuned + peft LoraConfig (task CAUSAL_LM): the reference is the base with the adapter
             disabled, precomputed before training as dpo_tuned's
  rm_peft    rm_tuned + peft LoraConfig (task SEQ_CLS, modules_to_save=["score"]: the scalar head trains in
             full beside the adapters, as ours)
  dpo_ckpt_peft, rm_ckpt_peft: dpo_peft / rm_peft with TRL's default gradient checkpointing on: TRL+PEFT's
             fit where the *_peft modes run out of memory (Qwen2.5-14B at 1024 tokens, batch 8, on an 80 GB H100)
  dpo_liger  dpo_tuned + use_liger_kernel=True: TRL's best full DPO (issue 38). TRL 1.16's DPOTrainer already
             computes log-probs through its own chunked, fused LM head (no full logits) and applies only Liger's
             layer kernels (RMSNorm, SwiGLU, RoPE; it refuses Liger's fused linear cross-entropy). padding_free is
             asked for too: TRL 1.16's DPOTrainer turns it off with a warning ("temporarily unavailable after a
             refactor"), and the JSON records what the trainer kept (padding_free_effective).
  dpo_ckpt_liger  dpo_liger with gradient checkpointing on: its fit where dpo_liger runs out of memory (7B, 80 GB)
The liger modes fail (exit 3) when no Liger kernel was applied to the model: a row named TRL+Liger that ran
without Liger would be a wrong baseline, not a slow one.
The timer is TRL's own train() (on_train_begin .. on_train_end): dpo_*'s precompute runs inside it.
Prints one JSON line: the anchor's keys (counted_tokens: the anchor's count over all N rows) plus trained_pairs /
trained_tokens (what TRL really trained, from its tokenized dataset: RewardTrainer drops pairs over max_length),
on which tokens_per_s and pairs_per_s are computed here; model_load_s, peak_reserved_gib, trainable_parameters, lora.
"""
from __future__ import annotations

import argparse
import gzip
import json
import tempfile
import time

MODES = ("dpo", "dpo_tuned", "dpo_peft", "dpo_ckpt_peft", "dpo_liger", "dpo_ckpt_liger", "rm", "rm_tuned", "rm_peft",
         "rm_ckpt_peft")
LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def lora_config(mode: str, r: int, alpha: int, dropout: float, targets: list[str]):
    from peft import LoraConfig
    if mode.startswith("dpo"):
        return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none",
                          task_type="CAUSAL_LM")
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none",
                      task_type="SEQ_CLS", modules_to_save=["score"])


def liger_kernels_applied(model) -> dict:
    """Which Liger kernels the model runs after Trainer applied them (at train()'s start): modules whose forward is
    Liger's RMSNorm / SwiGLU, and whether Qwen2's rotary function is Liger's. Empty counts without liger-kernel."""
    try:
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
        from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError:
        return {"rms_norm": 0, "swiglu": 0, "rope": False, "liger_kernel": None}
    from importlib.metadata import PackageNotFoundError, version
    from transformers.models.qwen2 import modeling_qwen2
    try:
        liger_version = version("liger-kernel")         # the package has no __version__
    except PackageNotFoundError:
        liger_version = None
    funcs = [getattr(getattr(m, "forward", None), "__func__", None) for m in model.modules()]
    return {"rms_norm": sum(f is LigerRMSNorm.forward for f in funcs),
            "swiglu": sum(f is LigerSwiGLUMLP.forward for f in funcs),
            "rope": modeling_qwen2.apply_rotary_pos_emb is liger_rotary_pos_emb,
            "liger_kernel": liger_version}


def trained_workload(dataset, mode: str, max_length: int) -> tuple[int, int]:
    """(pairs, chosen + rejected sequence tokens) that TRL trains, from its own tokenized train dataset:
    RewardTrainer filters out pairs with a sequence over max_length (chosen_ids / rejected_ids are whole
    sequences); DPOTrainer drops prompts of max_length or more and truncates prompt + completion to it."""
    if mode.startswith("dpo"):
        tokens = sum(min(len(p) + len(c), max_length) + min(len(p) + len(r), max_length)
                     for p, c, r in zip(dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"]))
    else:
        tokens = sum(len(c) + len(r) for c, r in zip(dataset["chosen_ids"], dataset["rejected_ids"]))
    return len(dataset), tokens


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=MODES)
    ap.add_argument("pairs", type=int)
    ap.add_argument("--model-dir", required=True, help="a causal-LM directory (safetensors), e.g. gpu_bench's")
    ap.add_argument("--data", required=True, help="HH-RLHF rows (jsonl.gz); the first N are trained")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lora-alpha", type=int, default=32)
    ap.add_argument("--lora-dropout", type=float, default=0.0)
    ap.add_argument("--lora-targets", default=LORA_TARGETS)
    args = ap.parse_args(argv)

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer

    mode, n, max_length = args.mode, args.pairs, args.max_length
    cuda = torch.cuda.is_available()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    tok.pad_token = tok.eos_token
    rows = [json.loads(line) for line in gzip.open(args.data, "rt")][:n]
    if len(rows) < n:
        raise SystemExit(f"trl_peft_runner: refused: {args.data} has {len(rows)} rows, {n} asked for")
    ds = Dataset.from_list([{"chosen": r["chosen"], "rejected": r["rejected"]} for r in rows])

    class Timer(TrainerCallback):
        def on_train_begin(self, *a, **k): self.t0 = time.time()
        def on_train_end(self, *a, **k): self.t1 = time.time()
    timer = Timer()
    scratch = tempfile.mkdtemp()
    common = dict(output_dir=f"{scratch}/out", per_device_train_batch_size=8, num_train_epochs=1, bf16=cuda,
                  logging_steps=8, report_to=[], save_strategy="no", max_length=max_length,
                  dataloader_num_workers=2, seed=0, use_cpu=not cuda)
    peft = mode.endswith("_peft")
    targets = [t for t in args.lora_targets.split(",") if t]
    peft_config = lora_config(mode, args.lora_r, args.lora_alpha, args.lora_dropout, targets) if peft else None
    # Loaded straight onto the GPU in bf16 (no CPU fp32 copy of a 7B model); a CPU run (tests) stays fp32.
    load = dict(dtype=torch.bfloat16 if cuda else torch.float32, attn_implementation="sdpa",
                device_map="cuda" if cuda else None)
    torch.manual_seed(0)                      # the RM's new score head
    t_start = time.time()
    if mode.startswith("dpo"):
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, **load)
        t_loaded = time.time()
        extra = (dict(precompute_ref_log_probs=True, gradient_checkpointing="_ckpt" in mode) if mode != "dpo"
                 else {})
        if mode.endswith("_liger"):
            extra.update(use_liger_kernel=True, padding_free=True)
        cfg = DPOConfig(learning_rate=5e-7, beta=0.1, **common, **extra)
        tr = DPOTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[timer],
                        peft_config=peft_config)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(args.model_dir, num_labels=1, **load)
        t_loaded = time.time()
        model.config.pad_token_id = tok.pad_token_id
        extra = dict(gradient_checkpointing="_ckpt" in mode) if mode != "rm" else {}
        cfg = RewardConfig(learning_rate=1e-5, **common, **extra)
        tr = RewardTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[timer],
                           peft_config=peft_config)
    t_setup = time.time()
    trainable = sum(p.numel() for p in tr.model.parameters() if p.requires_grad)
    trained_pairs, trained_tokens = trained_workload(tr.train_dataset, mode, max_length)
    tr.train()
    if cuda:
        torch.cuda.synchronize()
    liger = liger_kernels_applied(tr.model) if mode.endswith("_liger") else None
    if liger is not None and not (liger["rms_norm"] and liger["swiglu"] and liger["rope"]):
        print(json.dumps({"mode": mode, "error": "Liger kernels were not applied", "liger": liger}))
        raise SystemExit(3)
    hist = tr.state.log_history
    ntok = max([h.get("num_tokens", 0) for h in hist] or [0])
    # the anchor's independent count: chosen + rejected tokens (+ EOS), each truncated to max_length
    cnt = sum(min(len(tok(r["chosen"]).input_ids) + 1, max_length) + min(len(tok(r["rejected"]).input_ids) + 1,
                                                                        max_length) for r in rows)
    train_s = timer.t1 - timer.t0
    print(json.dumps({
        "mode": mode, "pairs": n, "max_length": max_length, "model_dir": str(args.model_dir),
        "model_load_s": round(t_loaded - t_start, 1), "setup_s": round(t_setup - t_start, 1),
        "train_s": round(train_s, 2), "trl_num_tokens": ntok, "counted_tokens": cnt,
        "trained_pairs": trained_pairs, "trained_tokens": trained_tokens,
        # on what TRL trained: its RewardTrainer DROPS pairs over max_length (the anchor's count keeps them)
        "tokens_per_s": round(trained_tokens / train_s), "pairs_per_s": round(trained_pairs / train_s, 2),
        "anchor_count_tokens_per_s": round(cnt / train_s),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 1) if cuda else None,
        "trainable_parameters": trainable,
        "liger": liger, "padding_free_effective": getattr(tr, "padding_free", None) if mode.startswith("dpo") else None,
        "lora": ({"r": args.lora_r, "alpha": args.lora_alpha, "dropout": args.lora_dropout, "target_modules": targets}
                 if peft else None),
        "last_log": hist[-2] if len(hist) > 1 else hist}))


if __name__ == "__main__":
    main()
