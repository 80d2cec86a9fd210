"""GPU benchmark: our DPO (ref_logps + one epoch) and reward-model training vs TRL, full fine-tune and LoRA, one GPU.

    python bench/gpu_bench.py --shared ../shared --out bench/results/h200.json [--trl-site pylib] \
        [--pairs 512] [--modes ours,trl] [--shape qwen2.5-0.5b] [--max-length 1024] [--model-cache DIR]

Modes (--modes, comma-separated; a group name expands to its rows, in this order):
  ours       = ours_dpo, ours_rm            full fine-tune (train.precision from --set / the shape preset)
  ours_lora  = ours_lora_dpo, ours_lora_rm  train.adapter = LORA (below); needs the train.adapter param of
                                            issue 20 part 1 in the params schema, else refused before any work
  trl        = trl_dpo_tuned, trl_rm_tuned  TRL's fastest: precompute_ref_log_probs, no gradient checkpointing
  trl_peft   = trl_dpo_peft, trl_rm_peft    the same + peft LoraConfig with LORA's r / alpha / dropout / targets
  trl_ckpt_peft = trl_dpo_ckpt_peft, trl_rm_ckpt_peft   trl_peft with TRL's default gradient checkpointing: its fit
               where trl_peft runs out of memory (14B on 80 GB); ours_lora's ratio is to trl_peft, else to this
  trl_liger  = trl_dpo_liger                 trl_dpo_tuned + use_liger_kernel (and padding_free, which TRL 1.16's
                                            DPOTrainer turns off): TRL's best full DPO, needs liger-kernel in --trl-site
  also trl_dpo, trl_rm                      TRL defaults (gradient checkpointing on; trl_dpo: live reference)
       trl_dpo_ckpt_liger                   trl_dpo_liger with gradient checkpointing: its fit at 7B on 80 GB
The trl rows run ../shared/bench/trl_anchor.py (patched to --shape / --max-length / --concat) when the shape is
one the anchor's config can express (tied embeddings, 2 KV heads, vocab 151,936), else bench/trl_peft_runner.py
(the anchor's TRL settings on our model directory); the peft and liger rows always run the runner. Each full DPO
family's ratio_to_trl_best is to the fastest TRL full DPO row that ran in the same invocation.

Workload (the anchor's): a random-init Qwen2.5-shape model (GPT-2 tokenizer; vocab and tied embeddings per
shape), the first N HH-RLHF harmless pairs, 8 pairs per optimizer step, max_length 1024, bf16, one epoch. Ours
runs the real stage CLIs under torchrun (`torchrun --nproc-per-node 1 -m stages.ref_logps`, `stages.train_dpo`,
`stages.train_rm`, as the Snakemake rules launch them) on token parquet made by our normalize + tokenize code.
Tokens = chosen + rejected sequence tokens, as TRL's num_tokens (TRL rows from bench/trl_peft_runner.py count
what TRL trained: its RewardTrainer drops pairs over max_length). DPO end-to-end time = reference pass +
training epoch (TRL's dpo_tuned precomputes inside its timer too). The LoRA DPO's reference is the frozen
base, the same ref_logps as the full fine-tune's (reused when `ours` ran first in the same invocation).

The model is made ONCE per shape: random init directly on the GPU in bf16 (seed 0; on CPU in fp32 when there
is no GPU), saved as safetensors in --model-cache (reused by later invocations with the same shape: the
marker file bench_model.json must match) and loaded from there by every mode, ours and TRL. Its creation and
save are timed apart (result "model").

A mode that fails is recorded, not hidden, and the other modes still run: table row and result entry
{"status": "oom" | "failed", "error": <log tail>} ("oom": the log names a CUDA out-of-memory).

FLOPs (MFU = FLOPs / seconds / measured bf16 matmul peak, 8192^3 products in this process). Per token, with
N = the matmul parameters the objective runs (decoder layers + norms, plus the LM head V*d for DPO or the
scalar score head d for the RM; an input-embedding lookup does no multiply, so an untied embedding table
is not counted; a tied one is counted once, as the LM head):
  full fine-tune: forward 2N + backward 4N (input gradients 2N, weight gradients 2N)  = 6N
  LoRA:           forward 2(N + A) + input gradients 2(N + A) + weight gradients 2T = 4(N + A) + 2T,
                  A = adapter parameters (r * (in + out) per targeted Linear), T = trainable ones (A, plus the
                  RM's score head, trained in full): the frozen base has no weight gradients, ~4N not 6N
  reference pass (DPO): 2N;  causal attention: forward 2 * 2 * L * d * sum(len^2) / 2, x3 when trained.
  mfu: on the workload tokens; mfu_hw: on the tokens actually computed (ours: a pair's shared prompt once,
  attention term unchanged; TRL: every counted token). Before issue 20 the RM used the causal LM's N (LM head
  included): its mfu read higher than it was.
Memory: peak_mem_gib = torch.cuda.max_memory_allocated of the stage process (its perf record; TRL: the
runner's); device_peak_gib = the device-wide peak of used memory (cudaMemGetInfo, total - free, sampled every
20 ms from this process while the mode runs, minus what was in use when it started): every allocator's
reserve and the CUDA context, what nvidia-smi would show, without nvidia-smi.

7B on one H200 (issue 20 part 3). Bring the TRL wheels as ../shared/bench/trl_anchor.py says (peft is on the
machine), fetched elsewhere with
  pip download --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
      -d wheels trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
then, three device commands of < 10 min each, sharing the model made by the first (--model-cache, kept while
the machine stays warm; a fresh machine makes it again, ~1 min). --out's folder also gets every stage's
log, perf record and train log: give each command its own, under the device's $OUT so they come back:
  pip install --no-deps -t pylib wheels/*.whl
  timeout 570 python bench/gpu_bench.py --shape qwen2.5-7b --pairs 128 --probe-pairs 32 --max-length 1024 \
      --model-cache /tmp/prefpipe_models --modes ours --out $OUT/h200_7b_ours/result.json
  timeout 570 python bench/gpu_bench.py --shape qwen2.5-7b --pairs 128 --probe-pairs 32 --max-length 1024 \
      --model-cache /tmp/prefpipe_models --modes ours_lora --out $OUT/h200_7b_ours_lora/result.json
  timeout 570 python bench/gpu_bench.py --shape qwen2.5-7b --pairs 128 --probe-pairs 32 --max-length 1024 \
      --model-cache /tmp/prefpipe_models --modes trl,trl_peft --trl-site pylib --out $OUT/h200_7b_trl/result.json
(timeout: the JSON is saved after every mode, so a command cut short still returns what it measured)
(or all of --modes ours,ours_lora,trl,trl_peft in one, where the time limit allows; a TRL full fine-tune
that does not fit without gradient checkpointing is recorded "oom": add trl_dpo,trl_rm, TRL's defaults with
checkpointing, for the TRL full fine-tune that fits). The 7B preset
(SHAPE_PRESETS) sets train.precision bf16 (bf16 weights, fp32 masters, the flat Triton AdamW of the CUDA-graph
step: 16 bytes/parameter, ~114 GiB) with micro_batch_tokens 2048 for the full fine-tune (activations, about
4.6 MB per token at 7B, must fit in the ~25 GiB left), 8192 for LoRA; --set / --set-lora override it.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Qwen2.5 shapes (their config.json): vocab and embedding tying are per shape (7B has its own LM head). The GPT-2
# tokenizer's ids (< 50,257) fit every vocab; make_model checks it.
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    # A CPU smoke test of the scripts, not a benchmark: GPT-2's 50,257 ids (padded to 64) rather than Qwen's
    # 151,936, which made the LM head nearly all of every tiny run's time and the bench tests the suite's slowest.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=50304, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}
# Per-shape params defaults per mode family, under --set / --set-lora. 7B: 16 bytes/parameter of weights and
# optimizer state (bf16 weights + gradients, fp32 masters + 2 moments in the flat AdamW of the CUDA-graph
# step) is ~114 GiB of the H200's ~139: activations (~4.6 MB per token at 7B without checkpointing, and
# activation checkpointing turns the CUDA graphs, hence the flat AdamW, off: +4 bytes/parameter) must fit
# the rest, so 2048-token micro-batches. LoRA keeps only the bf16 base (~15 GB): larger ones.
# The low-bit optimizer states (issue 30) at 7B: ~10 (fp32_master_8bit) and ~6 (bf16_sr_8bit) bytes a parameter.
# 4096-token micro-batches: the memory plan (stages/engine/memory_plan.py) puts them at 98 and 68 GiB, at or below
# TRL's full DPO (94 GiB tuned, 72 GiB with its default gradient checkpointing); ours_fused (exact state, the step
# inside backward) needs one micro-batch a step (16384 tokens >= 8 pairs of <= 2 x 1024) and checkpoints as many
# layers as the plan needs to fit (auto). The plan refuses before the load where a preset would not fit.
SHAPE_PRESETS = {
    "qwen2.5-7b": {"ours": {"train.precision": "bf16", "train.micro_batch_tokens": 2048},
                   "ours_8bit": {"train.micro_batch_tokens": 4096},
                   "ours_sr": {"train.micro_batch_tokens": 4096},
                   "ours_lora": {"train.precision": "bf16", "train.micro_batch_tokens": 8192}},
    "qwen2.5-14b": {"ours_lora": {"train.precision": "bf16", "train.micro_batch_tokens": 8192}},
}
# Our full fine-tune families (precision bf16 for all but `ours`, whose precision is --set's / the preset's: the
# optimizer modes are about bf16 weights): train overrides of each.
STATE_FAMILIES = {
    "ours": {},
    "ours_8bit": {"train.precision": "bf16", "train.optimizer": {"state": "fp32_master_8bit"}},
    "ours_sr": {"train.precision": "bf16", "train.optimizer": {"state": "bf16_sr_8bit"}},
    "ours_fused": {"train.precision": "bf16", "train.optimizer": {"state": "exact", "fused_backward": True},
                   "train.max_grad_norm": 0.0, "train.micro_batch_tokens": 16384,
                   "train.activation_checkpointing": "auto"},
}
# The adapter of issue 20 part 1 (the agreed param shape); TRL's LoraConfig gets the same r / alpha / targets.
LORA = {"type": "lora", "r": 16, "alpha": 32, "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "export": "merged"}
MODE_GROUPS = {"ours": ["ours_dpo", "ours_rm"], "ours_8bit": ["ours_8bit_dpo", "ours_8bit_rm"],
               "ours_sr": ["ours_sr_dpo", "ours_sr_rm"], "ours_fused": ["ours_fused_dpo", "ours_fused_rm"],
               "ours_lora": ["ours_lora_dpo", "ours_lora_rm"],
               "trl": ["trl_dpo_tuned", "trl_rm_tuned"], "trl_peft": ["trl_dpo_peft", "trl_rm_peft"],
               "trl_ckpt_peft": ["trl_dpo_ckpt_peft", "trl_rm_ckpt_peft"], "trl_liger": ["trl_dpo_liger"]}
MODES = ["ours_dpo", "ours_rm", "ours_8bit_dpo", "ours_8bit_rm", "ours_sr_dpo", "ours_sr_rm", "ours_fused_dpo",
         "ours_fused_rm", "ours_lora_dpo", "ours_lora_rm", "trl_dpo_tuned", "trl_rm_tuned", "trl_dpo_peft",
         "trl_rm_peft", "trl_dpo_ckpt_peft", "trl_rm_ckpt_peft", "trl_dpo_liger", "trl_dpo_ckpt_liger", "trl_dpo",
         "trl_rm"]
NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
OOM_MARKERS = ("CUDA out of memory", "OutOfMemoryError", "CUBLAS_STATUS_ALLOC_FAILED", "CUDA error: out of memory")


def expand_modes(spec: str) -> list[str]:
    """'ours,trl_peft' -> the row modes in run order (groups expanded, duplicates dropped); unknown names refused."""
    out = []
    for name in (n.strip() for n in spec.split(",") if n.strip()):
        if name not in MODE_GROUPS and name not in MODES:
            raise SystemExit(f"gpu_bench: refused: unknown mode {name!r} (groups {sorted(MODE_GROUPS)}, "
                             f"modes {MODES})")
        out += [m for m in MODE_GROUPS.get(name, [name]) if m not in out]
    return out


class StageFailed(RuntimeError):
    """A benchmarked command exited non-zero; `tail` is the end of its log."""

    def __init__(self, cmd: list[str], returncode: int, tail: str):
        super().__init__(f"{' '.join(cmd)} failed ({returncode}):\n{tail}")
        self.returncode, self.tail = returncode, tail


def failure_record(exc: StageFailed) -> dict:
    """What a failed mode leaves in the results: "oom" when its log names a CUDA out-of-memory (a run that does
    not fit), else "failed"; the log's tail either way."""
    status = ("refused_by_memory_plan" if "refused: memory plan" in exc.tail else
              "oom" if any(m in exc.tail for m in OOM_MARKERS) else "failed")
    return {"status": status, "returncode": exc.returncode, "error": exc.tail[-3000:]}


def sh(cmd: list[str], env: dict | None = None, cwd: Path | None = None, log: Path | None = None) -> float:
    t0 = time.perf_counter()
    with open(log, "w") if log else open(os.devnull, "w") as f:
        r = subprocess.run(cmd, env={**os.environ, **NCCL_SAFE_ENV, **(env or {})}, cwd=cwd, stdout=f,
                           stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise StageFailed(cmd, r.returncode, Path(log).read_text()[-6000:] if log else "")
    return time.perf_counter() - t0


class DevicePeak:
    """Device-wide peak of used GPU memory while a block runs: cudaMemGetInfo (total - free) sampled every
    20 ms on a thread of this process, minus the use when the block began. It sees the stage subprocess's
    whole reserve and CUDA context (what nvidia-smi shows, without nvidia-smi); None without a GPU."""

    def __init__(self, interval_s: float = 0.02):
        self.interval_s, self.peak_gib = interval_s, None

    def __enter__(self):
        import threading
        import torch
        self._stop = None
        if not torch.cuda.is_available():
            return self
        torch.cuda.empty_cache()                    # this process's own cached blocks are no stage's memory

        def used() -> int:
            free, total = torch.cuda.mem_get_info()
            return total - free
        self._base, self._peak, self._stop = used(), 0, threading.Event()

        def sample():
            while not self._stop.is_set():
                self._peak = max(self._peak, used())
                self._stop.wait(self.interval_s)
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._stop is not None:
            self._stop.set()
            self._thread.join()
            self.peak_gib = round(max(0, self._peak - self._base) / 2**30, 2)
        return False


def matmul_peak_tflops() -> float | None:
    import torch
    if not torch.cuda.is_available():
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * 8192 ** 3 * 10 / (start.elapsed_time(end) / 1e3) / 1e12


# ------------------------------------------------------------------------------------------------
# Workload: HH pairs -> our token parquet; a random-init model directory
# ------------------------------------------------------------------------------------------------

def hh_lines(hh: Path, concat: int = 1) -> list[str]:
    """HH-RLHF rows as JSONL lines. concat K > 1: "long concatenations": row j becomes rows j..j+K-1 as one
    dialogue, the chosen transcripts of the first K-1 as shared context, then row j+K-1's chosen / rejected
    (still HH format: the last Assistant turn is the completion)."""
    lines = gzip.open(hh, "rt").read().splitlines()
    if concat <= 1:
        return lines
    rows = [json.loads(l) for l in lines]
    out = []
    for j in range(len(rows) - concat + 1):
        context = "".join(r["chosen"] for r in rows[j:j + concat - 1])
        last = rows[j + concat - 1]
        out.append(json.dumps({"chosen": context + last["chosen"], "rejected": context + last["rejected"]}))
    return out


def prepare_tokens(hh: Path, gpt2: Path, n_pairs: int, n_probe: int, max_length: int, work: Path,
                   concat: int = 1) -> dict:
    from stages.lib.io import write_parquet
    from stages.engine.packing import load_token_pairs, shares_prompt
    from stages.data.limits import TokenizeLimits
    from stages.data.pair_tokenizer import PairTokenizer
    from stages.data.tokenizer import load_tokenizer
    from stages.data.truncation import tokenize_pairs, tokens_table
    from stages.normalize import normalize_sources

    lines = hh_lines(hh, concat)
    subsets = {"train": lines[:n_pairs], "probe": lines[-n_probe:]}   # probe far from the train rows
    with gzip.open(work / "trl_train.jsonl.gz", "wt") as f:          # exactly the train rows, for the TRL runner
        f.write("\n".join(subsets["train"]) + "\n")
    tok = PairTokenizer(load_tokenizer(gpt2))
    # TRL truncates sequences to max_length; ours keeps the prompt and cuts the completion to fit.
    limits = TokenizeLimits(max_length, max_length - 64, "truncate_completion")
    out = {}
    for split, rows in subsets.items():
        src = work / f"hh_{split}.jsonl"
        src.write_text("\n".join(rows) + "\n")
        norm = normalize_sources([{"name": "hh", "path": str(src), "format": "hh"}])
        pairs = sorted(norm.pairs, key=lambda p: p["pair_id"])    # pairs.parquet's order, as normalize writes it
        result = tokenize_pairs(tok, pairs, limits, split)
        write_parquet(work / f"{split}_tokens.parquet", tokens_table(result.rows))
        seq_tokens = sum(len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in result.rows)
        # what the shared-prompt layout actually runs: each pair's common prompt once (packing's own test)
        pairs = load_token_pairs(work / f"{split}_tokens.parquet")
        shared = sum(int(pairs.seq_prompt_lens[2 * p]) for p in range(len(pairs)) if shares_prompt(pairs, p))
        sq = sum(len(r["chosen_ids"]) ** 2 + len(r["rejected_ids"]) ** 2 for r in result.rows)
        out[split] = {"rows_in": len(rows), "pairs": len(result.rows), "normalize_rejected": len(norm.rejections),
                      "tokenize_rejected": len(result.rejections), "tokens": seq_tokens, "shared_prompt_tokens": shared, "sum_len_sq": sq}
    return out


def qwen2_config(shape: str, eos_id: int):
    from transformers import Qwen2Config
    return Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1e6, pad_token_id=eos_id,
                       eos_token_id=eos_id, bos_token_id=eos_id)


def param_counts(shape: dict) -> dict:
    """Qwen2 parameter counts from the shape (q/k/v carry biases, o and the MLP none): total (a tied
    embedding once), the input embedding, the decoder body (layers + final norm) and the LM head's matrix."""
    d, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * (d // shape["num_attention_heads"])
    layer = (d * d + d) + 2 * (d * kv + kv) + d * d + 3 * d * inter + 2 * d
    body = layers * layer + d
    emb = shape["vocab_size"] * d
    return {"total": emb + body + (0 if shape["tie_word_embeddings"] else emb), "embedding": emb, "body": body,
            "lm_head": emb}


def lora_parameters(shape: dict, r: int, targets: list[str]) -> int:
    """Adapter parameters of LoRA rank r on these Linear layers of every decoder layer: r * (in + out) each."""
    d, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * (d // shape["num_attention_heads"])
    dims = {"q_proj": (d, d), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (d, d), "gate_proj": (d, inter),
            "up_proj": (d, inter), "down_proj": (inter, d)}
    unknown = sorted(set(targets) - set(dims))
    if unknown:
        raise SystemExit(f"gpu_bench: refused: LoRA target modules {unknown} are not Qwen2 Linear layers {sorted(dims)}")
    return shape["num_hidden_layers"] * sum(r * sum(dims[t]) for t in targets)


def make_model(shape: str, gpt2: Path, cache: Path) -> tuple[Path, dict]:
    """The benchmark's random-init model as a safetensors directory `cache/model-<shape>`, made once: on the
    GPU directly in bf16 (a 7B model built on the CPU in fp32 costs ~30 GB of host RAM and minutes), on the
    CPU in fp32 without one. Reused when its marker (shape, dtype, seed) matches. -> (dir, facts + timings)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(gpt2)
    if len(tok) > SHAPES[shape]["vocab_size"]:
        raise SystemExit(f"gpu_bench: refused: the tokenizer at {gpt2} has {len(tok)} ids, more than shape "
                         f"{shape}'s vocab {SHAPES[shape]['vocab_size']}")
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    out = cache / f"model-{shape}"
    marker = {"shape": SHAPES[shape], "dtype": str(dtype), "seed": 0, "eos": tok.eos_token_id}
    facts = {"dir": str(out), "device": device, "dtype": str(dtype), **param_counts(SHAPES[shape])}
    if (out / "bench_model.json").exists() and json.loads((out / "bench_model.json").read_text()) == marker:
        return out, {**facts, "cached": True}
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(qwen2_config(shape, tok.eos_token_id), dtype=dtype)
    if cuda:
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    n_params = sum(p.numel() for p in model.parameters())
    if n_params != facts["total"]:
        raise SystemExit(f"gpu_bench: shape {shape}: the model has {n_params} parameters, param_counts says "
                         f"{facts['total']}: update param_counts")
    model.save_pretrained(out)                 # safetensors
    (out / "bench_model.json").write_text(json.dumps(marker))
    t2 = time.perf_counter()
    del model
    if cuda:
        torch.cuda.empty_cache()
    return out, {**facts, "cached": False, "create_s": round(t1 - t0, 2), "save_s": round(t2 - t1, 2),
                 "bytes": sum(f.stat().st_size for f in out.iterdir())}


def bench_params(base: dict, overrides: dict) -> dict:
    params = json.loads(json.dumps(base))
    for dotted, value in overrides.items():
        node = params
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return params


def run_stage(stage: str, params_file: Path, model_dir: Path, work: Path, extra: list[str], logs: Path,
              env: dict | None = None, prefix: str = "ours") -> dict:
    """One stage CLI under torchrun, as the Snakemake rules launch it -> its perf record (timings, throughput,
    memory: logs/<prefix>_<stage>.perf.json) with "wall_s" and "device_peak_gib" added, and for a training
    stage (extra has --out-dir) its run_info.json too. Logs go to logs/<prefix>_<stage>.{log,out}."""
    common = ["--params", str(params_file), "--model-dir", str(model_dir),
              "--train-tokens", str(work / "train_tokens.parquet"), "--probe-tokens", str(work / "probe_tokens.parquet")]
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m"]
    perf = logs / f"{prefix}_{stage}.perf.json"
    with DevicePeak() as mem:
        wall = sh(run + [f"stages.{stage}", "--", *common, *extra, "--log", str(logs / f"{prefix}_{stage}.log"),
                         "--perf", str(perf)],
                  env={"PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}", **(env or {})}, cwd=REPO,
                  log=logs / f"{prefix}_{stage}.out")
    res = {**json.loads(perf.read_text()), "wall_s": round(wall, 2), "device_peak_gib": mem.peak_gib}
    if "--out-dir" not in extra:
        return res
    out_dir = Path(extra[extra.index("--out-dir") + 1])
    info = json.loads((out_dir / "run_info.json").read_text())
    # what the mode learned (the accuracy comparison between optimizer states): the final probe's tie-aware
    # accuracy and mean margin, the last logged training loss
    probe_rows = [json.loads(line) for line in (out_dir / "probe_final.jsonl").read_text().splitlines() if line]
    res["probe_accuracy"] = round(sum(float(r["correct"]) for r in probe_rows) / max(1, len(probe_rows)), 4)
    res["probe_mean_margin"] = round(sum(float(r["margin"]) for r in probe_rows) / max(1, len(probe_rows)), 5)
    log_lines = (out_dir / "train_log.csv").read_text().splitlines()
    if len(log_lines) > 1:
        header, last = log_lines[0].split(","), log_lines[-1].split(",")
        res["final_train_loss"] = float(last[header.index("loss")])
    # The export is not measured and a 7B one is 15-30 GB: gone before the next stage writes its own.
    shutil.rmtree(out_dir / "model", ignore_errors=True)
    # run_info's cuda_graphs holds the facts (shapes, optimizer), perf's the capture and first-step seconds.
    return {**info, **res, "cuda_graphs": {**info.get("cuda_graphs", {}), **res.get("cuda_graphs", {})}}


def run_ours(prefix: str, objectives: list[str], work: Path, model_dir: Path, params: dict, logs: Path,
             ref_logps: tuple[Path, dict] | None = None) -> dict:
    """Our stages for one mode family (prefix ours / ours_lora): ref_logps + train_dpo for "dpo", train_rm for
    "rm". A failed stage is recorded (failure_record) and the others still run; train_dpo needs its reference
    pass. ref_logps: (parquet, its record) of an earlier run of the same base model, reused."""
    params_file = work / f"params_{prefix}.yaml"
    params_file.write_text(yaml.safe_dump(params))
    res = {}
    if "dpo" in objectives:
        if ref_logps is None:
            ref_path = work / f"{prefix}_ref_logps.parquet"
            try:
                rec = run_stage("ref_logps", params_file, model_dir, work, ["--out", str(ref_path)], logs, prefix=prefix)
                # The stage's perf record has each pass's compute time: the train split's is the reference pass.
                res["ref_logps"] = {**rec, "train_seconds": rec["train"]["pass_seconds"]}
            except StageFailed as e:
                res["ref_logps"] = failure_record(e)
        else:
            ref_path, rec = ref_logps
            res["ref_logps"] = {**rec, "reused": str(ref_path)}
        if res["ref_logps"].get("status") in ("oom", "failed"):
            res["train_dpo"] = {"status": "failed", "error": "no reference log-probs (ref_logps failed)"}
        else:
            try:
                res["train_dpo"] = run_stage("train_dpo", params_file, model_dir, work,
                                             ["--ref-logps", str(ref_path), "--out-dir", str(work / f"{prefix}_train_dpo")],
                                             logs, prefix=prefix)
                shutil.copy(work / f"{prefix}_train_dpo" / "train_log.csv", logs / f"{prefix}_train_dpo_train_log.csv")
            except StageFailed as e:
                res["train_dpo"] = failure_record(e)
        res["ref_logps_path"] = str(ref_path)
    if "rm" in objectives:
        try:
            res["train_rm"] = run_stage("train_rm", params_file, model_dir, work,
                                        ["--out-dir", str(work / f"{prefix}_train_rm")], logs, prefix=prefix)
            shutil.copy(work / f"{prefix}_train_rm" / "train_log.csv", logs / f"{prefix}_train_rm_train_log.csv")
        except StageFailed as e:
            res["train_rm"] = failure_record(e)
    return res


def lora_adapter(schema: dict, params: dict, export: str | None = None) -> dict:
    """LORA as a train.adapter value this tree's params schema accepts, with the cheapest export it offers
    (the export is not measured). Refused, before any device work, where the schema has no train.adapter yet
    (issue 20 part 1 not in this tree) or rejects the value in `params` (validated whole: the schema may refer
    to its own definitions)."""
    import jsonschema
    sub = schema["properties"]["train"]["properties"].get("adapter")
    if sub is None:
        raise SystemExit("gpu_bench: refused: modes ours_lora* need params train.adapter (LoRA, issue 20 part 1), "
                         "and workflow/schemas/params.schema.yaml has no train.adapter in this tree")
    # "adapter" first: a few MB, where "merged" writes the whole model again (the export is not measured)
    errors = []
    for exp in ([export] if export is not None else ["adapter", LORA["export"]]):
        adapter = {**LORA, "export": exp}
        try:
            jsonschema.validate(bench_params(params, {"train.adapter": adapter}), schema)
            return adapter
        except jsonschema.ValidationError as e:
            where = ".".join(str(k) for k in e.absolute_path)
            errors.append(f"export {exp}: {where}: {e.message}")
    raise SystemExit(f"gpu_bench: refused: train.adapter {LORA} does not match this tree's params schema: "
                     + "; ".join(errors))


ANCHOR_SHAPE = "hidden_size=896, intermediate_size=4864, num_hidden_layers=layers, num_attention_heads=14"
ANCHOR_DATA = '"../shared/data/hh-rlhf/harmless-base-test.jsonl.gz"'
# What the anchor's Qwen2Config hard-codes and patched_trl_anchor does not change.
ANCHOR_FIXED = {"num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}


def anchor_expresses(shape: str) -> bool:
    """Whether the TRL anchor, patched, builds this shape (else the trl rows run bench/trl_peft_runner.py)."""
    return all(SHAPES[shape][k] == v for k, v in ANCHOR_FIXED.items())


def patched_trl_anchor(anchor: Path, shape: str, max_length: int, data: Path | None, dest: Path) -> Path:
    """The TRL anchor with only its workload changed: model shape, max_length (and its token-count cap),
    and the train rows file, written to `dest`; the anchor itself when nothing changes. Every substitution
    must hit, so a changed anchor fails loudly here."""
    if not anchor_expresses(shape):
        raise SystemExit(f"gpu_bench: the TRL anchor hard-codes {ANCHOR_FIXED}; shape {shape} differs: use "
                         "bench/trl_peft_runner.py")
    text = anchor.read_text()
    subs = []
    if shape != "qwen2.5-0.5b":
        sh = SHAPES[shape]
        subs.append((ANCHOR_SHAPE, f"hidden_size={sh['hidden_size']}, intermediate_size={sh['intermediate_size']}, "
                                   f"num_hidden_layers=layers, num_attention_heads={sh['num_attention_heads']}"))
    if max_length != 1024:
        subs += [("max_length=1024", f"max_length={max_length}"), (", 1024)", f", {max_length})"),
                 ("max_position_embeddings=4096", f"max_position_embeddings={max(4096, max_length)}")]
    if data is not None:
        subs.append((ANCHOR_DATA, json.dumps(str(data))))
    if not subs:
        return anchor                        # the anchor's own workload: run the anchor itself
    for old, new in subs:
        if old not in text:
            raise SystemExit(f"{anchor}: cannot patch the TRL anchor (no {old!r}); update bench/gpu_bench.py")
        text = text.replace(old, new)
    dest.write_text(text)
    return dest


def run_trl(mode: str, n_pairs: int, shared: Path, wheels_site: str | None, out: Path, script: Path | None = None,
            layers: int | None = None) -> dict:
    """The TRL anchor (or a patched copy) in one mode -> its JSON line."""
    # trl_anchor.py reads ../shared/data relative to its cwd: give it a sibling of `shared`.
    cwd = shared.parent / "trl_cwd"
    cwd.mkdir(exist_ok=True)
    env = {"HF_HUB_OFFLINE": "1"}
    if wheels_site:
        env["PYTHONPATH"] = wheels_site
    if layers:
        env["LAYERS"] = str(layers)
    with DevicePeak() as mem:
        sh([sys.executable, str(script or shared / "bench" / "trl_anchor.py"), mode, str(n_pairs)], env=env, cwd=cwd,
           log=out / f"trl_{mode}.out")
    last = [l for l in (out / f"trl_{mode}.out").read_text().splitlines() if l.startswith("{")][-1]
    return {**json.loads(last), "runner": "trl_anchor", "device_peak_gib": mem.peak_gib}


def run_trl_runner(mode: str, n_pairs: int, model_dir: Path, data: Path, tokenizer: Path, max_length: int,
                   wheels_site: str | None, out: Path) -> dict:
    """bench/trl_peft_runner.py in one mode on our model directory (LoRA: LORA's r / alpha / dropout / targets)
    -> its JSON line."""
    env = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": ":".join(p for p in (wheels_site, os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, str(REPO / "bench" / "trl_peft_runner.py"), mode, str(n_pairs), "--model-dir", str(model_dir),
           "--data", str(data), "--tokenizer", str(tokenizer), "--max-length", str(max_length),
           "--lora-r", str(LORA["r"]), "--lora-alpha", str(LORA["alpha"]), "--lora-dropout", str(LORA["dropout"]),
           "--lora-targets", ",".join(LORA["target_modules"])]
    with DevicePeak() as mem:
        sh(cmd, env=env, cwd=REPO, log=out / f"trl_{mode}.out")
    last = [l for l in (out / f"trl_{mode}.out").read_text().splitlines() if l.startswith("{")][-1]
    return {**json.loads(last), "runner": "trl_peft_runner", "device_peak_gib": mem.peak_gib}


def attention_flops(shape: dict, sum_len_sq: int) -> float:
    """Causal attention's forward (QK^T and PV over the lower triangle)."""
    return 2 * 2 * shape["num_hidden_layers"] * shape["hidden_size"] * sum_len_sq / 2


def mode_flops(shape: dict, objective: str, tokens: int, sum_len_sq: int, lora: dict | None = None,
               reference_pass: bool = False) -> float:
    """Model FLOPs of one training epoch over `tokens` (the module docstring's convention): objective dpo (LM
    head) or rm (scalar head); lora: the train.adapter (None = full fine-tune); reference_pass: plus a
    forward of the frozen base (DPO's precomputed reference)."""
    counts = param_counts(shape)
    head = counts["lm_head"] if objective == "dpo" else shape["hidden_size"]
    n = counts["body"] + head
    attn = attention_flops(shape, sum_len_sq)
    if lora is None:
        train = 6 * n * tokens + 3 * attn
    else:
        a = lora_parameters(shape, lora["r"], lora["target_modules"])
        trainable = a + (head if objective == "rm" else 0)     # the RM's score head trains in full
        train = (4 * (n + a) + 2 * trainable) * tokens + 3 * attn
    return train + ((2 * n * tokens + attn) if reference_pass else 0.0)


def ours_row(name: str, stages: dict, objective: str, shape: dict, w: dict, lora: dict | None, share_prompt: bool,
             peak: float | None) -> dict:
    """The table row of one of our modes from its stages' records (or their failure)."""
    names = ["ref_logps", "train_dpo"] if objective == "dpo" else ["train_rm"]
    failed = [stages[s] for s in names if stages[s].get("status") in ("oom", "failed")]
    if failed:
        return {"mode": name, "status": failed[0]["status"]}
    train = stages[names[-1]]
    secs = train["train_seconds"] + (stages["ref_logps"]["train_seconds"] if objective == "dpo" else 0.0)
    computed = w["tokens"] - (w["shared_prompt_tokens"] if share_prompt else 0)
    fl = mode_flops(shape, objective, w["tokens"], w["sum_len_sq"], lora, reference_pass=objective == "dpo")
    fl_hw = mode_flops(shape, objective, computed, w["sum_len_sq"], lora, reference_pass=objective == "dpo")
    windows = [t["tokens_per_s"] for t in train.get("throughput_windows", [])]
    mems = [train["device_peak_gib"]] + ([stages["ref_logps"].get("device_peak_gib")] if objective == "dpo" else [])
    return {"mode": name, "status": "ok", "seconds": round(secs, 2), "tokens": w["tokens"],
            "tokens_per_s": round(w["tokens"] / secs), "pairs_per_s": round(w["pairs"] / secs, 2),
            # the training loop alone, middle throughput window: without the first steps' graph captures
            "train_window_median_tokens_per_s": sorted(windows)[len(windows) // 2] if windows else None,
            "mfu": round(fl / secs / peak, 4) if peak else None, "mfu_hw": round(fl_hw / secs / peak, 4) if peak else None,
            "computed_tokens": computed, "peak_mem_gib": round(max(train["peak_memory_bytes_per_rank"]) / 2**30, 2),
            # the allocator's reserved peak (allocated + cached + the graphs' pools: what the card had to hold)
            "reserved_peak_gib": (round(max(train["peak_reserved_bytes_per_rank"]) / 2**30, 2)
                                  if train.get("peak_reserved_bytes_per_rank") else None),
            "cuda_allocator_conf": train.get("cuda_allocator_conf"),
            "device_peak_gib": max((m for m in mems if m is not None), default=None),
            # the stage's wall time outside its timed loop: start-up, model load, probes, export
            "outside_train_s": round(train["wall_s"] - train["train_seconds"], 1),
            "optimizer_state": (train.get("settings", {}).get("optimizer") or {}).get("state", "exact"),
            "fused_backward": bool((train.get("settings", {}).get("optimizer") or {}).get("fused_backward")),
            "checkpointed_layers": (train.get("memory_plan") or {}).get("checkpointed_layers"),
            "micro_batch_tokens": train.get("settings", {}).get("micro_batch_tokens"),
            "planned_peak_gib": (round(train["memory_plan"]["total"] / 2**30, 2) if train.get("memory_plan") else None),
            "probe_accuracy": train.get("probe_accuracy"), "probe_mean_margin": train.get("probe_mean_margin"),
            "final_train_loss": train.get("final_train_loss")}


def trl_row(name: str, t: dict, objective: str, shape: dict, w: dict, lora: dict | None, peak: float | None) -> dict:
    """The table row of a TRL mode from its JSON line; FLOPs on the tokens TRL trained (the runner's
    trained_tokens; the anchor's own count for anchor runs), every one computed, with our workload's sum of
    squared lengths for the attention term."""
    # the reference forward is the same FLOPs precomputed (dpo_tuned, dpo_peft) or live (dpo); gradient
    # checkpointing's recomputation (TRL defaults) is not model FLOPs
    tokens = t.get("trained_tokens", t["counted_tokens"])    # the runner's: what TRL trained; the anchor's count
    fl = mode_flops(shape, objective, tokens, w["sum_len_sq"], lora, reference_pass=objective == "dpo")
    mfu = round(fl / t["train_s"] / peak, 4) if peak else None
    return {"mode": name, "status": "ok", "seconds": t["train_s"], "tokens": tokens,
            "tokens_per_s": t["tokens_per_s"], "pairs_per_s": t["pairs_per_s"], "mfu": mfu, "mfu_hw": mfu,
            "computed_tokens": tokens, "peak_mem_gib": t["peak_mem_gib"],
            "device_peak_gib": t.get("device_peak_gib"), "setup_s": t.get("setup_s")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shared", default=str(REPO.parent / "shared"))
    ap.add_argument("--out", required=True, help="results JSON (a table is printed too)")
    ap.add_argument("--pairs", type=int, default=512)
    ap.add_argument("--probe-pairs", type=int, default=64)
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--modes", default="ours,trl", help=f"comma-separated: groups {sorted(MODE_GROUPS)} or rows {MODES}")
    ap.add_argument("--trl-site", help="a directory with trl/datasets installed (pip --target)")
    ap.add_argument("--trl-script", help="another TRL runner than ../shared/bench/trl_anchor.py (default: the anchor, "
                    "patched to --shape / --max-length / --concat when they differ from its own)")
    ap.add_argument("--concat", type=int, default=1, help="long concatenations: each pair = K consecutive HH dialogues")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="params overrides, e.g. train.compile=true")
    ap.add_argument("--set-lora", nargs="*", default=[], metavar="KEY=VALUE", help="params overrides of ours_lora "
                    "only (after --set), e.g. train.cuda_graphs=0")
    ap.add_argument("--model-cache", help="where the random-init model is written once and reused (default: --work)")
    ap.add_argument("--work", default="/tmp/prefpipe_bench")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="only merge these results into --out (no run)")
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    modes = expand_modes(args.modes)

    import torch
    shared = Path(args.shared).resolve()
    hh = shared / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"
    gpt2 = shared / "data" / "tokenizers" / "gpt2"
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    from stages.lib.params import load_schema
    # Refused now, not after minutes of device time: the LoRA param must exist in this tree.
    lora = lora_adapter(load_schema(), base) if any(m.startswith("ours_lora") for m in modes) else None
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out_json = Path(args.out)
    logs = out_json.parent
    logs.mkdir(parents=True, exist_ok=True)

    cuda = torch.cuda.is_available()
    result = {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "shape": args.shape,
              "shape_config": SHAPES[args.shape], "pairs": args.pairs, "probe_pairs": args.probe_pairs,
              "max_length": args.max_length, "concat": args.concat, "modes": modes,
              "command": "python bench/gpu_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    import transformers
    result["transformers"] = transformers.__version__
    peak_tflops = matmul_peak_tflops()
    result["matmul_peak_tflops"] = round(peak_tflops, 1) if peak_tflops else None
    result["workload"] = prepare_tokens(hh, gpt2, args.pairs, args.probe_pairs, args.max_length, work, args.concat)
    model_dir, result["model"] = make_model(args.shape, gpt2, Path(args.model_cache) if args.model_cache else work)
    result["model_parameters"] = result["model"]["total"]
    shape = SHAPES[args.shape]
    overrides = {"train.gpus": 1 if cuda else 0, "train.epochs": 1, "train.global_batch_pairs": 8, "train.lr": 5e-7,
                 "train.warmup_ratio": 0.0, "train.micro_batch_tokens": 16384, "tokenize.max_length": args.max_length,
                 "rm.center_rewards_coefficient": 0.0}
    preset = SHAPE_PRESETS.get(args.shape, {})
    user = dict(kv.split("=", 1) for kv in args.set)
    user_lora = dict(kv.split("=", 1) for kv in args.set_lora)
    family_overrides = {
        family: {**overrides, **family_set, **preset.get(family, {}), **{k: yaml.safe_load(v) for k, v in user.items()}}
        for family, family_set in STATE_FAMILIES.items()}
    family_overrides["ours_lora"] = {**overrides, **preset.get("ours_lora", {}), "train.adapter": lora,
                                     **{k: yaml.safe_load(v) for k, v in {**user, **user_lora}.items()}}
    families = [f for f in OUR_FAMILIES if any(family_of(m) == f for m in modes)]
    result["expected_seconds"] = expected_seconds(args.shape, modes, args.pairs)
    print(f"gpu_bench: {args.shape}, {args.pairs} pairs; expected seconds per mode (a rough guide): "
          f"{result['expected_seconds']}, total ~{sum(result['expected_seconds'].values())} s", flush=True)
    result["overrides"] = {f: family_overrides[f] for f in families}
    w = result["workload"]["train"]
    peak = peak_tflops * 1e12 if peak_tflops else None
    rows = []

    def save_partial() -> None:   # a run cut short by its time limit still leaves what it measured
        out_json.write_text(json.dumps({**result, "table": rows}, indent=2, sort_keys=True) + "\n")

    save_partial()
    ref_reuse = None
    for family in families:
        objectives = [o for o in ("dpo", "rm") if f"{family}_{o}" in modes]
        params = bench_params(base, family_overrides[family])
        stages = run_ours(family, objectives, work, model_dir, params, logs, ref_reuse)
        result[family] = stages
        ref = stages.get("ref_logps", {})
        if ref_reuse is None and "train_seconds" in ref:
            # every family's reference is the same base model in bf16: one reference pass, reused (its time
            # counts in each DPO row)
            ref_reuse = (Path(stages["ref_logps_path"]), ref)
        for o in objectives:
            row = ours_row(f"{family}_{o}", stages, o, shape, w, lora if family == "ours_lora" else None,
                           params["train"]["share_prompt"], peak)
            rows.append(row)
        save_partial()
    for mode in [m for m in modes if m.startswith("trl_")]:
        trl_mode = mode[len("trl_"):]
        objective = "dpo" if trl_mode.startswith("dpo") else "rm"
        try:
            if trl_mode.endswith(("_peft", "_liger")) or not anchor_expresses(args.shape) and not args.trl_script:
                t = run_trl_runner(trl_mode, args.pairs, model_dir, work / "trl_train.jsonl.gz", gpt2, args.max_length,
                                   args.trl_site, logs)
            else:
                script = Path(args.trl_script).resolve() if args.trl_script else patched_trl_anchor(
                    shared / "bench" / "trl_anchor.py", args.shape, args.max_length,
                    work / "trl_train.jsonl.gz" if args.concat > 1 else None, work / "trl_anchor_patched.py")
                t = run_trl(trl_mode, args.pairs, shared, args.trl_site, logs, script, shape["num_hidden_layers"])
        except StageFailed as e:              # e.g. TRL out of memory at 7B or a long max_length: record it, go on
            result[mode] = failure_record(e)
            rows.append({"mode": mode, "status": result[mode]["status"]})
            save_partial()
            continue
        result[mode] = t
        rows.append(trl_row(mode, t, objective, shape, w, lora_for_trl(trl_mode), peak))
        save_partial()
    summarize(result, rows)
    out_json.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print_table(result)


def summarize(result: dict, rows: list[dict]) -> None:
    """Ratios to TRL (each full fine-tune family to TRL's fastest fit and to its defaults; LoRA to TRL+PEFT), each
    optimizer state's accuracy against the exact one, MFU; result["table"] = rows."""
    by = {r["mode"]: r for r in rows if r.get("status") == "ok"}
    for kind in ("dpo", "rm"):
        pairs = [(f"{f}_{kind}", f"trl_{kind}_tuned", "ratio_to_trl") for f in STATE_FAMILIES]
        pairs += [(f"{f}_{kind}", f"trl_{kind}", "ratio_to_trl_defaults") for f in STATE_FAMILIES]
        # TRL+PEFT's fastest fit: without gradient checkpointing, else with it (out of memory without)
        peft_fit = f"trl_{kind}_peft" if f"trl_{kind}_peft" in by else f"trl_{kind}_ckpt_peft"
        pairs += [(f"ours_lora_{kind}", peft_fit, "ratio_to_trl")]
        for ours_name, trl_name, label in pairs:
            if ours_name in by and trl_name in by:
                ratio = round(by[ours_name]["tokens_per_s"] / by[trl_name]["tokens_per_s"], 2)
                suffix = "" if label == "ratio_to_trl" else "_defaults"
                result[f"ratio_{ours_name[len('ours_'):]}{suffix}"] = ratio
                by[ours_name][label] = ratio
                by[trl_name].setdefault("ratio_to_trl", 1.0)
        # TRL's best full fine-tune of this objective in this invocation (defaults, tuned, Liger; not PEFT)
        trl_full = [r for m, r in by.items() if m.startswith(f"trl_{kind}") and "_peft" not in m]
        if trl_full:
            best = max(trl_full, key=lambda r: r["tokens_per_s"])
            result[f"trl_{kind}_best"] = best["mode"]
            for f in STATE_FAMILIES:
                if f"{f}_{kind}" in by:
                    ratio = round(by[f"{f}_{kind}"]["tokens_per_s"] / best["tokens_per_s"], 2)
                    by[f"{f}_{kind}"]["ratio_to_trl_best"] = result[f"ratio_{f}_{kind}_to_trl_best"] = ratio
        if f"ours_{kind}" in by:
            result[f"mfu_{kind}"] = by[f"ours_{kind}"]["mfu"]
        exact = by.get(f"ours_{kind}")
        for f in ("ours_8bit", "ours_sr", "ours_fused"):
            row = by.get(f"{f}_{kind}")
            if exact and row and exact.get("probe_accuracy") is not None:
                result.setdefault("accuracy_vs_exact", {})[f"{f}_{kind}"] = {
                    "probe_accuracy": row["probe_accuracy"], "exact_probe_accuracy": exact["probe_accuracy"],
                    "difference": round(row["probe_accuracy"] - exact["probe_accuracy"], 4),
                    "final_train_loss": row.get("final_train_loss"), "exact_final_train_loss": exact.get("final_train_loss")}
    result["table"] = rows


def print_table(result: dict) -> None:
    rows = result["table"]
    cols = ["mode", "status", "seconds", "tokens", "tokens_per_s", "pairs_per_s", "ratio_to_trl",
            "ratio_to_trl_defaults", "ratio_to_trl_best", "mfu", "mfu_hw", "peak_mem_gib", "planned_peak_gib",
            "device_peak_gib", "probe_accuracy", "final_train_loss"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    print(json.dumps({k: v for k, v in result.items() if k.startswith(("ratio_", "mfu_", "accuracy_vs_exact"))
                      or k.endswith("_best")
                      or k in ("gpu", "matmul_peak_tflops", "model")}))


def merge(paths: list[str], out: str) -> None:
    """Several invocations' JSONs (e.g. one per --modes group, each under the device's 10-minute limit) as one
    side-by-side result: their rows in order, ratios and the accuracy comparison recomputed across them."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    shapes = {p["shape"] for p in parts}
    if len(shapes) != 1:
        raise SystemExit(f"gpu_bench: refused: --merge of different shapes {sorted(shapes)}")
    result = {"merged_from": paths, "shape": parts[0]["shape"], "gpu": parts[0].get("gpu"),
              "matmul_peak_tflops": parts[0].get("matmul_peak_tflops"), "model": parts[0].get("model"),
              "pairs": [p["pairs"] for p in parts], "commands": [p.get("command") for p in parts]}
    summarize(result, [r for p in parts for r in p["table"]])
    Path(out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print_table(result)


def family_of(mode: str) -> str | None:
    """Which of our params families a row mode runs under (None: a TRL mode)."""
    for family in ("ours_lora", "ours_8bit", "ours_sr", "ours_fused", "ours"):
        if mode.startswith(family + "_"):
            return family
    return None


OUR_FAMILIES = ("ours", "ours_8bit", "ours_sr", "ours_fused", "ours_lora")
# Rough rates for the expected-duration print (tokens/s of a training loop; seconds a stage spends starting, loading
# and exporting), from bench/results (0.5B, 7B) and scaled by parameters for the rest: a planning aid, not a result.
RATE_PER_BPARAM = {"ours": 36_000, "ours_lora": 80_000, "trl": 26_000, "trl_default": 17_000, "trl_peft": 14_000}


def expected_seconds(shape: str, modes: list[str], pairs: int, tokens_per_pair: float = 321.0) -> dict:
    """Each mode's expected seconds (train loop + start-up, load and export per stage), for the printout."""
    billions = param_counts(SHAPES[shape])["total"] / 1e9
    tokens = pairs * tokens_per_pair
    per_stage = 10 + 8 * billions                   # start-up + the model read from the cache (+ export, full)
    out = {}
    for m in modes:
        fam = family_of(m)
        if fam is not None:
            rate = RATE_PER_BPARAM["ours_lora" if fam == "ours_lora" else "ours"] / billions
            stages = 2 if m.endswith("_dpo") else 1
            export = 0 if fam == "ours_lora" else 4 * billions
            out[m] = round(stages * per_stage + export + tokens / rate * (1.33 if m.endswith("_dpo") else 1))
        else:
            key = "trl_peft" if m.endswith("_peft") else "trl" if m.endswith(("_tuned", "_liger")) else "trl_default"
            out[m] = round(30 + 6 * billions + tokens / (RATE_PER_BPARAM[key] / billions))
    return out


def lora_for_trl(trl_mode: str) -> dict | None:
    """The adapter a TRL mode trains (for its FLOPs): LORA for the peft modes, none otherwise."""
    return LORA if trl_mode.endswith("_peft") else None


if __name__ == "__main__":
    main()
