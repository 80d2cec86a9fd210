"""TRL 1.16's OnlineDPOTrainer for one epoch over a prompt file: the TRL row of bench/rounds_bench.py.

    python bench/trl_online_dpo_runner.py --policy DIR --judge DIR --prompts PROMPTS.jsonl \
        [--batch-prompts 16] [--max-new-tokens 64] [--max-length 1024] [--temperature 1.0] [--top-p 1.0] \
        [--beta 0.1] [--lr 5e-7]

Not run by hand: bench/rounds_bench.py starts it in a subprocess with TRL's wheels on PYTHONPATH (--trl-site), on
the policy and judge directories it made for its own round (the same files), and reads the one JSON line it prints.

TRL's online DPO samples 2 completions per prompt (hard-coded: num_generations = 2), labels them with the reward
model (`reward_funcs`, loaded here as an AutoModelForSequenceClassification with one label, as TRL itself loads a
path), trains DPO on the better against the worse at once, and does so per training step: a step's
`--batch-prompts` prompts are sampled by transformers' `generate` (2 x batch rows), scored, and trained on, with a
live reference (a frozen copy of the policy, run forward each step). Settings: bf16 weights on the GPU (as
bench/trl_peft_runner.py and the TRL anchor load them), gradient_checkpointing False (TRL's default True also
turns the KV cache off in its sampling: use_cache = not gradient_checkpointing), sigmoid loss, missing_eos_penalty
None (TRL's default: a completion that never ends still trains), top_k 0, seed 0, one epoch.

Timing: TRL's own train() (a callback's on_train_begin .. on_train_end). Inside it, this runner's subclass times
the two methods TRL calls for sampling and labeling (`_generate`, `_calculate_rewards_from_functions`; CUDA
synchronised around each) and counts what they did: completions, generated tokens (TRL's completion_mask: up to
and with the first EOS), completions that reached an EOS, and the prompt + completion tokens its DPO forwards
read (the masks' real tokens; the padded widths too). `dpo_s` = train_s - generate_s - reward_s: the policy's and
the reference's forwards, the backward and the optimizer step. A JSON line with "progress": true every
--progress-every steps carries the counts so far (the caller's time limit may stop the epoch).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", required=True, help="the causal LM directory (with its tokenizer)")
    ap.add_argument("--judge", required=True, help="the reward model directory (sequence classification, 1 label)")
    ap.add_argument("--prompts", required=True, help="JSONL of {\"prompt\": text}, one epoch over them")
    ap.add_argument("--batch-prompts", type=int, default=16, help="prompts per step (per_device_train_batch_size)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=5e-7)
    ap.add_argument("--progress-every", type=int, default=8, help="print a progress line every this many steps")
    args = ap.parse_args(argv)
    progress_every = max(1, args.progress_every)

    t_start = time.time()
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
    t_imported = time.time()

    cuda = torch.cuda.is_available()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    counts = {"generate_s": 0.0, "reward_s": 0.0, "generate_calls": 0, "completions": 0, "generated_tokens": 0,
              "completions_with_eos": 0, "forward_tokens": 0, "forward_padded_tokens": 0}

    class TimedOnlineDPOTrainer(OnlineDPOTrainer):
        """OnlineDPOTrainer with its sampling and labeling timed and counted; nothing else changed."""

        def _generate(self, model, prompts, images=None):
            sync()
            t0 = time.perf_counter()
            out = super()._generate(model, prompts, images)
            sync()
            counts["generate_s"] += time.perf_counter() - t0
            prompt_ids, prompt_mask, completion_ids, completion_mask = out[:4]
            counts["generate_calls"] += 1
            counts["completions"] += int(completion_ids.shape[0])
            counts["generated_tokens"] += int(completion_mask.sum())
            eos = torch.tensor(self.eos_token_ids, device=completion_ids.device)
            counts["completions_with_eos"] += int(torch.isin(completion_ids, eos).any(dim=-1).sum())
            # what _forward reads (policy with gradients, reference without): prompt + completion, real and padded
            width = min(prompt_ids.shape[1] + completion_ids.shape[1], self.max_length)
            counts["forward_tokens"] += int(prompt_mask.sum() + completion_mask.sum())
            counts["forward_padded_tokens"] += int(prompt_ids.shape[0] * width)
            return out

        def _calculate_rewards_from_functions(self, *a, **k):
            sync()
            t0 = time.perf_counter()
            out = super()._calculate_rewards_from_functions(*a, **k)
            sync()
            counts["reward_s"] += time.perf_counter() - t0
            return out

    class Timer(TrainerCallback):
        """TRL's train() from its first to its last callback; every --progress-every steps a progress line (the
        counts so far), so a run stopped by a time limit still says how far it got and at what rates."""

        def on_train_begin(self, *a, **k):
            self.t0 = time.time()

        def on_step_end(self, args_, state, control, **k):
            if state.global_step % progress_every == 0:
                print(json.dumps({"progress": True, "step": state.global_step, "max_steps": state.max_steps,
                                  "train_elapsed_s": round(time.time() - self.t0, 2),
                                  **{key: round(v, 2) if isinstance(v, float) else v for key, v in counts.items()}}),
                      flush=True)

        def on_train_end(self, *a, **k):
            sync()
            self.t1 = time.time()

    prompts = [json.loads(line)["prompt"] for line in open(args.prompts) if line.strip()]
    tok = AutoTokenizer.from_pretrained(args.policy)
    tok.pad_token = tok.eos_token
    load = dict(dtype=torch.bfloat16 if cuda else torch.float32, attn_implementation="sdpa",
                device_map="cuda" if cuda else None)
    model = AutoModelForCausalLM.from_pretrained(args.policy, **load)
    judge = AutoModelForSequenceClassification.from_pretrained(args.judge, num_labels=1, **load)
    judge_tok = AutoTokenizer.from_pretrained(args.judge)
    t_loaded = time.time()
    timer = Timer()
    scratch = tempfile.mkdtemp()
    cfg = OnlineDPOConfig(output_dir=f"{scratch}/out", per_device_train_batch_size=args.batch_prompts,
                          num_train_epochs=1, bf16=cuda, use_cpu=not cuda, learning_rate=args.lr, beta=args.beta,
                          loss_type="sigmoid", max_new_tokens=args.max_new_tokens, max_length=args.max_length,
                          temperature=args.temperature, top_p=args.top_p, top_k=0, gradient_checkpointing=False,
                          missing_eos_penalty=None, logging_steps=8, report_to=[], save_strategy="no", seed=0,
                          dataloader_num_workers=0)
    trainer = TimedOnlineDPOTrainer(model=model, reward_funcs=judge, args=cfg,
                                    train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                                    processing_class=tok, reward_processing_classes=judge_tok, callbacks=[timer])
    t_setup = time.time()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    sync()
    train_s = timer.t1 - timer.t0
    dpo_s = train_s - counts["generate_s"] - counts["reward_s"]
    hist = trainer.state.log_history
    print(json.dumps({
        "trainer": "trl.experimental.online_dpo.OnlineDPOTrainer", "trl": trl.__version__,
        "transformers": transformers.__version__, "torch": torch.__version__,
        "prompts": len(prompts), "samples_per_prompt": trainer.num_generations, "steps": trainer.state.global_step,
        "settings": {"per_device_train_batch_size": args.batch_prompts, "num_train_epochs": 1, "bf16": cuda,
                     "learning_rate": args.lr, "beta": args.beta, "loss_type": "sigmoid",
                     "max_new_tokens": args.max_new_tokens, "max_length": args.max_length,
                     "temperature": args.temperature, "top_p": args.top_p, "top_k": 0,
                     "gradient_checkpointing": False, "missing_eos_penalty": None, "reference": "live copy",
                     "sampler": "transformers generate"},
        "import_s": round(t_imported - t_start, 1), "model_load_s": round(t_loaded - t_imported, 1),
        "setup_s": round(t_setup - t_loaded, 1), "train_s": round(train_s, 2),
        "generate_s": round(counts["generate_s"], 2), "reward_s": round(counts["reward_s"], 2),
        "dpo_s": round(dpo_s, 2),
        **{k: counts[k] for k in ("generate_calls", "completions", "generated_tokens", "completions_with_eos",
                                  "forward_tokens", "forward_padded_tokens")},
        "generated_tokens_per_s": round(counts["generated_tokens"] / counts["generate_s"], 1)
        if counts["generate_s"] else None,
        "completions_per_s": round(counts["completions"] / counts["generate_s"], 2) if counts["generate_s"] else None,
        # the DPO part: prompt + completion tokens (2 per prompt, real tokens) over the seconds outside sampling and
        # labeling
        "dpo_tokens_per_s": round(counts["forward_tokens"] / dpo_s) if dpo_s > 0 else None,
        "prompts_per_s": round(len(prompts) / train_s, 2),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None,
        "last_log": hist[-2] if len(hist) > 1 else hist}))


if __name__ == "__main__":
    main()
