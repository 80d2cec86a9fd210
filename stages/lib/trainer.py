"""The shared distributed training loop for DPO and reward models (one file, top to bottom).

Launch (the Snakemake rules do this; the same code runs on CPU with gloo and on GPUs with nccl):
    torchrun --nproc-per-node 2 -m stages.train_dpo -- --params params.yaml --identity ... --out-dir ...
    python -m stages.train_rm ...           # without torchrun: a single-process group of size 1

One optimizer step, on every rank:
  1. take this rank's micro-batches of the step from the deterministic global plan (packing.py);
  2. one small CPU (gloo) all_gather of (micro-batches, pairs, tokens) per rank: every rank learns
     the step's micro-batch count K and the GLOBAL pair count P; ranks with fewer micro-batches
     run zero-weight filler micro-batches so DDP/FSDP collectives always line up;
  3. forward/backward each micro-batch with loss = sum(per-pair loss) * world_size / P: DDP
     averages gradients over ranks, so the update equals the single-process one on the same global
     batch (gradients sync only on the last micro-batch: no_sync / set_requires_gradient_sync);
  4. clip, AdamW (fused on CUDA), LR schedule; device-side finiteness asserts, no host sync;
  5. one all_reduce of the step's summed metrics and ONE device->host read for the log row.
Probe evaluation (step 0 and final) runs every probe pair exactly once, spread over ranks, and
rank 0 writes the rows in manifest order.

Checkpoints (checkpoint.py): every `train.save_every` optimizer steps the log rows are flushed and
model, optimizer, scheduler, RNG (per rank), step, tokens and log rows are saved atomically. A
resumed run restores them and, the plan being a pure function of (lengths, seed, world size),
simply starts the loop and the batch prefetcher at `plans[state.step]`: same batches, same RNG, so
the same weights bit for bit on CPU.

Precision: `train.precision: autocast` keeps fp32 weights under bf16 autocast on GPU; `bf16` casts the
weights to bf16 and keeps fp32 masters in MasterWeightAdamW (FSDP2: MixedPrecisionPolicy instead).
CUDA graphs (`train.cuda_graphs`, one process on a GPU): the eager step is host-launch bound (the host
queues its kernels more slowly than the GPU runs them:
bench/results/step_profile_h200_before/summary_train_dpo_eager.json), so each micro-batch is padded
to one of a few shapes planned from the run and the step replays captured graphs (GraphedSteps below,
mechanics in graphs.py; under train.precision bf16 the optimizer step is flat_adamw.py's kernels).
Several processes, compile and activation checkpointing train eagerly (run_info's `cuda_graphs` says why).
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import math
import os
import random
import resource
import shutil
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from stages.lib.environment import check_against_record, environment_record, pin_portable_cpu_numerics
from stages.lib.checkpoint import (CheckpointOptions, agree_on_checkpoint, load_checkpoint,
                                   reference_of, run_header, save_checkpoint)
from stages.lib.io import MEASUREMENT, write_json, write_jsonl, write_text
from stages.lib.modeling import TOKENIZER_MARKERS, USED_BACKENDS, attention_backend, warm_up_fused_kernels
from stages.lib.packing import (BatchDims, MicroBatch, PackedBatch, StepPlan, TokenPairs, batch_dims, build_packed_batch,
                                pad_packed_batch, plan_inference, plan_padded_shapes, plan_training,
                                shared_prompt_flags)
from stages.lib.step_profiler import StepProfiler

log = logging.getLogger("trainer")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")


class TrainConfigError(ValueError):
    """A training knob is refused before anything is built."""


# ----------------------------------------------------------------------------------------------
# Settings (params.yaml `train` section)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainSettings:
    gpus: int = 0                      # 0 = CPU with gloo; N = one process per GPU with nccl
    cpu_procs: int = 1                 # processes torchrun starts on CPU (read by the rule)
    cpu_threads: int = 1               # intra-op threads per CPU process: fixed, so results do not depend on the runner
    portable_numerics: bool = True     # CPU: processor-independent kernels (stages/lib/environment.py)
    parallel: str = "ddp"              # ddp | fsdp2
    seed: int = 1234
    epochs: float = 1.0
    global_batch_pairs: int = 32       # pairs per optimizer step, over all ranks
    micro_batch_tokens: int = 4096     # token budget of one packed micro-batch
    inference_micro_batch_tokens: int = 65536   # the same for no-grad passes (reference, probe)
    lr: float = 1e-3
    weight_decay: float = 0.0          # applied to matrices only (not biases / norm weights), as HF Trainer
    adam_betas: tuple[float, float] = (0.9, 0.999)
    warmup_ratio: float = 0.1          # warmup steps = ceil(ratio * total steps)
    schedule: str = "cosine"           # cosine | linear | constant (after warmup)
    max_grad_norm: float = 1.0         # 0 = no clipping (the norm is still logged)
    logp_chunk_tokens: int = 2048      # LM-head chunk for log-probs
    temperature: float = 1.0           # must be exactly 1
    compile: bool = False              # torch.compile the log-prob chunk function
    precision: str = "autocast"        # GPU: autocast = fp32 weights + bf16 autocast; bf16 = bf16 weights, fp32 master
    share_prompt: bool = True          # compute a pair's shared prompt once (packing.PackedBatch)
    cuda_graphs: int = 8               # GPU, one process: at most N padded batch shapes replayed as CUDA graphs; 0 = eager
    activation_checkpointing: bool = False
    save_every: int = 0                # checkpoint every N optimizer steps (and after the last); 0 = never
    keep_checkpoints: int = 2          # complete checkpoints of a run kept on disk (the newest ones)

    def __post_init__(self):
        if self.temperature != 1.0:
            raise TrainConfigError(f"train.temperature = {self.temperature}: log-probs, DPO rewards and reference "
                                   "log-probs are defined at temperature 1; other values are refused")
        if self.parallel not in ("ddp", "fsdp2"):
            raise TrainConfigError(f"train.parallel = {self.parallel!r}: expected ddp or fsdp2")
        if self.precision not in ("autocast", "bf16"):
            raise TrainConfigError(f"train.precision = {self.precision!r}: expected autocast or bf16")
        if self.schedule not in ("cosine", "linear", "constant"):
            raise TrainConfigError(f"train.schedule = {self.schedule!r}: expected cosine, linear or constant")
        if self.cuda_graphs < 0:
            raise TrainConfigError(f"train.cuda_graphs = {self.cuda_graphs}: expected >= 0 (0 = no CUDA graphs)")
        if self.save_every < 0 or self.keep_checkpoints < 1:
            raise TrainConfigError(f"train.save_every = {self.save_every} (>= 0) / train.keep_checkpoints = "
                                   f"{self.keep_checkpoints} (>= 1) out of range")

    @classmethod
    def from_params(cls, params: dict) -> "TrainSettings":
        train = dict(params["train"])
        known = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in train.items() if k in known}
        if "adam_betas" in kw:
            kw["adam_betas"] = tuple(float(b) for b in kw["adam_betas"])
        return cls(**kw)


# ----------------------------------------------------------------------------------------------
# Distributed environment
# ----------------------------------------------------------------------------------------------

@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    control_group: object = None       # CPU gloo group for the per-step control exchange

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(settings: TrainSettings) -> DistEnv:
    """torchrun's env:// when launched by it; otherwise a one-process group, so the code path is the same."""
    use_cuda = settings.gpus > 0
    if not use_cuda and settings.portable_numerics:
        # Before this process's first tensor op: torch and MKL pick their CPU kernels once, at first use.
        pin_portable_cpu_numerics()
    if use_cuda and not torch.cuda.is_available():
        raise TrainConfigError(f"train.gpus = {settings.gpus} but CUDA is not available on this machine "
                               "(set train.gpus: 0 to train on CPU)")
    backend = "nccl" if use_cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    # The CPU reduction order depends on the intra-op thread count, and runners set it differently
    # (Snakemake exports OMP_NUM_THREADS=<rule threads>, DVC and torchrun with one process leave the
    # default): fix it from params so `snakemake` and `dvc repro` produce the same bytes.
    torch.set_num_threads(settings.cpu_threads)
    if not dist.is_initialized():
        timeout = timedelta(minutes=30)
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout, device_id=device if use_cuda else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return DistEnv(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=device,
                   backend=backend, control_group=control)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def control_exchange(env: DistEnv, n_micro: int, n_pairs: int, n_tokens: int) -> tuple[int, int, int]:
    """(max micro-batches, global pairs, global tokens) over ranks: one tiny CPU all_gather."""
    mine = torch.tensor([n_micro, n_pairs, n_tokens], dtype=torch.int64)
    if env.world_size == 1:
        return n_micro, n_pairs, n_tokens
    everyone = [torch.empty_like(mine) for _ in range(env.world_size)]
    dist.all_gather(everyone, mine, group=env.control_group)
    table = torch.stack(everyone)
    return int(table[:, 0].max()), int(table[:, 1].sum()), int(table[:, 2].sum())


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def autocast(env: DistEnv, settings: TrainSettings):
    """precision autocast: bf16 autocast on GPU over fp32 weights (plain fp32 on CPU). precision bf16:
    the weights are bf16 already (fp32 masters live in the optimizer), nothing to cast per op."""
    if env.device.type == "cuda" and settings.precision == "autocast":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def compute_dtype(settings: TrainSettings) -> torch.dtype:
    """dtype of the module's weights during forward/backward (FSDP2 casts its fp32 shards itself)."""
    return torch.bfloat16 if settings.precision == "bf16" and settings.parallel != "fsdp2" else torch.float32


# ----------------------------------------------------------------------------------------------
# Model wrapping and optimizer
# ----------------------------------------------------------------------------------------------

def disable_dropout(module: nn.Module) -> None:
    """As TRL does for DPO and reward training: dropout off, so ranks and reruns agree exactly."""
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0


def wrap_model(module: nn.Module, hf_model: nn.Module, settings: TrainSettings, env: DistEnv) -> nn.Module:
    """DDP (replicated) or FSDP2 (fully_shard per transformer block, then the root). One DDP process
    has nothing to synchronise: the module runs unwrapped (DDP's per-step hooks and bucket copies cost
    time for nothing)."""
    if settings.parallel == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        blocks = [m for m in hf_model.modules() if type(m).__name__ in (hf_model._no_split_modules or [])]
        if not blocks:
            raise TrainConfigError(f"FSDP2: {type(hf_model).__name__} declares no transformer block classes")
        # precision bf16: the fp32 shards are the master weights; FSDP2 gathers them as bf16 for compute
        # and reduces gradients in fp32.
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if settings.precision == "bf16" else MixedPrecisionPolicy())
        for block in blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(module, mp_policy=mp)
        return module
    if env.world_size == 1:
        return module
    import inspect
    from torch.nn.parallel import DistributedDataParallel as DDP
    # Buffers (rotary tables) never change: skip the per-forward buffer broadcast (renamed in torch 2.13).
    no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                      else {"broadcast_buffers": False})
    return DDP(module, device_ids=[env.local_rank] if env.device.type == "cuda" else None, **no_buffer_sync)


def gradient_sync(model: nn.Module, settings: TrainSettings, enabled: bool):
    """Context for one micro-batch's backward: reduce gradients only on the step's last micro-batch."""
    if settings.parallel == "fsdp2":
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    return model.no_sync() if not enabled and hasattr(model, "no_sync") else contextlib.nullcontext()


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW over fp32 master copies of a module's bf16 parameters (train.precision bf16 without FSDP2).

    Forward and backward run on the bf16 parameters (no per-op casts); before the step the bf16
    gradients are copied into the fp32 masters' gradients (`grads_to_master`, where clipping then
    happens), AdamW updates the masters in fp32, and the masters are copied back to bf16. So an update
    smaller than bf16's resolution still accumulates (pure bf16 AdamW, as a bf16 model under HF Trainer,
    silently drops it). state_dict() carries the masters: a resume restores them exactly.
    """

    def __init__(self, groups: list[dict], masters: dict[int, torch.Tensor], **kw):
        """masters: id(param) -> its fp32 value, taken BEFORE the module was cast to bf16."""
        self.model_params = [p for g in groups for p in g["params"]]
        masters = {id(p): masters[id(p)].detach().float().clone().requires_grad_(True) for p in self.model_params}
        super().__init__([{**g, "params": [masters[id(p)] for p in g["params"]]} for g in groups], **kw)
        self.master_params = [masters[id(p)] for p in self.model_params]

    @torch.no_grad()
    def grads_to_master(self) -> None:
        dst, src = [], []                      # one foreach copy (few launches) instead of one per tensor
        for p, m in zip(self.model_params, self.master_params):
            if p.grad is None:
                m.grad = None
            elif m.grad is None:
                m.grad = p.grad.float()
            else:
                dst.append(m.grad)
                src.append(p.grad)
        if dst:
            torch._foreach_copy_(dst, src)

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        torch._foreach_copy_(self.model_params, self.master_params)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:            # the masters' gradient buffers are reused, overwritten each step
            p.grad = None

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["master_params"] = [m.detach().clone() for m in self.master_params]
        # flat_adamw shares one step tensor between all parameters: a state_dict loaded back on the same
        # device would keep that sharing, and torch's AdamW, which increments each parameter's own step,
        # would count one step per parameter.
        sd["state"] = {i: {**st, "step": st["step"].clone()} if "step" in st else st for i, st in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_params", None)
        if masters is None or len(masters) != len(self.master_params):
            raise ValueError("optimizer state has no fp32 master weights for this model (saved with another "
                             "train.precision?)")
        with torch.no_grad():
            for m, saved in zip(self.master_params, masters):
                m.copy_(saved)
            torch._foreach_copy_(self.model_params, self.master_params)
        super().load_state_dict(state_dict)


def build_optimizer(module: nn.Module, settings: TrainSettings, env: DistEnv,
                    masters: dict[int, torch.Tensor] | None = None) -> torch.optim.AdamW:
    decay = [p for p in module.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in module.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kw = dict(lr=settings.lr, betas=settings.adam_betas, fused=env.device.type == "cuda")
    if masters is not None:
        return MasterWeightAdamW(groups, masters, **kw)
    return torch.optim.AdamW(groups, **kw)


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """HF-style schedules (get_{cosine,linear,constant}_schedule_with_warmup): `step` counts
    completed optimizer steps, so the first step of a warmup runs at factor 0."""
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def build_scheduler(optimizer, settings: TrainSettings, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = math.ceil(settings.warmup_ratio * total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warmup, total_steps, settings.schedule))


def total_grad_norm(params, max_norm: float) -> torch.Tensor:
    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm if max_norm > 0 else float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


# ----------------------------------------------------------------------------------------------
# Batches: built (and pinned) on a background thread, off the step's critical path
# ----------------------------------------------------------------------------------------------

def prefetch_batches(pairs: TokenPairs, micro_batches: Iterable[MicroBatch], pin: bool, share_prompt: bool,
                     depth: int = 8, pad_to: Iterable[BatchDims] | None = None) -> Iterator[PackedBatch]:
    """pad_to: one shape per micro-batch (CUDA graphs): each batch is padded to it here, off the critical path."""
    def build(mb: MicroBatch, shape: BatchDims | None) -> PackedBatch:
        batch = build_packed_batch(pairs, mb, share_prompt=share_prompt)
        if shape is not None:
            batch = pad_packed_batch(batch, shape)
        return batch.pin_memory() if pin else batch
    shapes = iter(pad_to) if pad_to is not None else None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pack") as pool:
        pending = []
        for mb in micro_batches:
            pending.append(pool.submit(build, mb, next(shapes) if shapes is not None else None))
            if len(pending) > depth:
                yield pending.pop(0).result()
        for fut in pending:
            yield fut.result()


def filler_batch(pairs: TokenPairs, share_prompt: bool) -> PackedBatch:
    """A zero-weight micro-batch (pair 0) a rank runs when it has fewer micro-batches than others."""
    return build_packed_batch(pairs, [0], weight=0.0, share_prompt=share_prompt)


def model_inputs(batch: PackedBatch) -> dict:
    return dict(input_ids=batch.input_ids, position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens,
                max_seqlen=batch.max_seqlen, logp_positions=batch.logp_positions, logp_targets=batch.logp_targets,
                logp_seq=batch.logp_seq, last_positions=batch.last_positions, n_seqs=batch.n_seqs,
                cu_seqlens_k=batch.cu_seqlens_k, max_seqlen_k=batch.max_seqlen_k, kv_index=batch.kv_index)


# ----------------------------------------------------------------------------------------------
# Inference pass (reference log-probs, probe evaluation)
# ----------------------------------------------------------------------------------------------

@torch.no_grad()
def run_inference(model: nn.Module, pairs: TokenPairs, env: DistEnv, settings: TrainSettings,
                  desc: str = "inference") -> np.ndarray | None:
    """Per-pair model outputs [n_pairs, 2] (chosen, rejected) as float64, on rank 0 (None elsewhere).
    Every pair is scored exactly once; results are placed by pair index, never by arrival order."""
    plan = plan_inference(pairs.pair_tokens, micro_batch_tokens=settings.inference_micro_batch_tokens,
                          world_size=env.world_size)
    mine = plan[env.rank]
    n_micro, _, _ = control_exchange(env, len(mine), sum(map(len, mine)), 0)
    was_training = model.training
    model.eval()
    filler = filler_batch(pairs, settings.share_prompt).to(env.device)
    outputs, indices = [], []
    batches = prefetch_batches(pairs, mine, pin=env.device.type == "cuda", share_prompt=settings.share_prompt)
    for k in range(n_micro):
        batch = next(batches).to(env.device, non_blocking=True) if k < len(mine) else filler
        with autocast(env, settings):
            out = model(**model_inputs(batch))
        if k < len(mine):
            outputs.append(out.view(-1, 2).double())
            indices.extend(mine[k])
    model.train(was_training)
    local = (np.asarray(indices, dtype=np.int64),
             torch.cat(outputs).cpu().numpy() if outputs else np.zeros((0, 2)))
    gathered = [None] * env.world_size
    dist.all_gather_object(gathered, local, group=env.control_group)
    if not env.is_main:
        return None
    result = np.full((len(pairs), 2), np.nan)
    seen = np.zeros(len(pairs), dtype=np.int64)
    for idx, out in gathered:
        result[idx] = out
        np.add.at(seen, idx, 1)
    if not (seen == 1).all():
        raise RuntimeError(f"{desc}: pairs scored {seen.min()}..{seen.max()} times; every pair must be scored once")
    return result


# ----------------------------------------------------------------------------------------------
# One micro-batch's forward/backward, and the optimizer step of the CUDA-graph path
# ----------------------------------------------------------------------------------------------

def forward_backward(model: nn.Module, objective, settings: TrainSettings, env: DistEnv, batch: PackedBatch,
                     scale: float | torch.Tensor, sums: torch.Tensor) -> None:
    """loss = sum(pair losses * weight) * scale; backward (gradients accumulate); sums += weighted metrics.
    scale is world_size / global pairs: a float eagerly, a 0-dim device tensor inside a CUDA graph."""
    with autocast(env, settings):
        seq_out = model(**model_inputs(batch))
    losses, metrics = objective.pair_terms(seq_out, batch, "train")
    loss = (losses * batch.pair_weight.to(losses.dtype)).sum() * (
        scale.to(losses.dtype) if isinstance(scale, torch.Tensor) else scale)
    torch._assert_async(torch.isfinite(loss), "non-finite loss")
    loss.backward()
    sums += (metrics * batch.pair_weight[:, None].to(metrics.dtype)).sum(0)


def cuda_graphs_unavailable(settings: TrainSettings, env: DistEnv) -> str | None:
    """Why this run trains eagerly (None: the step runs as CUDA graphs)."""
    if settings.cuda_graphs == 0:
        return "train.cuda_graphs is 0"
    if env.device.type != "cuda":
        return "not a CUDA run"
    if env.world_size > 1:
        return "more than one process (DDP collectives are not captured)"
    if settings.parallel != "ddp":
        return f"train.parallel is {settings.parallel} (its collectives are not captured)"
    if settings.compile:
        return "train.compile is on"
    if settings.activation_checkpointing:
        return "train.activation_checkpointing is on"
    return None


@torch.no_grad()
def adamw_step_lr_tensor(optimizer: torch.optim.AdamW, lrs: list[torch.Tensor],
                         grad_divisor: torch.Tensor | None = None) -> None:
    """The fused AdamW update of every group, reading each group's learning rate from a device tensor
    (a captured graph cannot take a new Python float each step). Same kernel and state layout as
    optimizer.step() with fused=True, so checkpoints are interchangeable. grad_divisor: the kernel divides
    every gradient by it on the fly (its AMP unscale input), which is how the clip is applied here."""
    from torch.optim.adamw import adamw as functional_adamw
    for group, lr in zip(optimizer.param_groups, lrs):
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        if group.get("amsgrad") or group.get("maximize"):
            raise TrainConfigError("CUDA-graph AdamW supports neither amsgrad nor maximize")
        for p in params:
            state = optimizer.state[p]
            if not state:       # what AdamW(fused=True) creates on its first step
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [optimizer.state[p] for p in params]
        functional_adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                                [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
                         foreach=False, capturable=True, differentiable=False, fused=True, grad_scale=grad_divisor,
                         found_inf=None, has_complex=False, amsgrad=False, beta1=group["betas"][0],
                         beta2=group["betas"][1], lr=lr, weight_decay=group["weight_decay"], eps=group["eps"],
                         maximize=False)


def graphed_optimizer_step(optimizer, module: nn.Module, settings: TrainSettings, lrs: list[torch.Tensor],
                           sums: torch.Tensor, row: torch.Tensor, flat=None) -> None:
    """The optimizer step of the CUDA-graph path (capturable: no host syncs, no allocation that outlives it):
    row = [metric sums, grad norm], clipped AdamW, zero the persistent gradients.

    flat (a flat_adamw.FlatMasterAdamW): all of that in three Triton kernels over flat buffers. Otherwise:

    The norm is that of the model's own gradients (bf16 under precision bf16: the fp32 master copies hold
    the same values, and reading half the bytes is faster), and the clip coefficient of clip_grad_norm_
    (max_norm / (norm + 1e-6), at most 1) is applied inside the fused AdamW kernel as a gradient divisor
    instead of a separate multiply pass over every gradient; equal to the eager step up to rounding."""
    if flat is not None:
        grad_norm = flat.step(lrs)
        torch._assert_async(torch.isfinite(grad_norm), "non-finite gradient norm")
        with torch.no_grad():
            row[:-1].copy_(sums)
            row[-1:].copy_(grad_norm.reshape(1))
            sums.zero_()
        return
    master = isinstance(optimizer, MasterWeightAdamW)
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    # per-tensor norms accumulated and returned in fp32 (a bf16 result would keep 3 significant digits)
    grad_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))
    torch._assert_async(torch.isfinite(grad_norm), "non-finite gradient norm")
    if master:
        optimizer.grads_to_master()
    divisor = None
    with torch.no_grad():
        if settings.max_grad_norm > 0:
            divisor = 1.0 / torch.clamp(settings.max_grad_norm / (grad_norm + 1e-6), max=1.0)
        row[:-1].copy_(sums)
        row[-1:].copy_(grad_norm.reshape(1))
        sums.zero_()
    adamw_step_lr_tensor(optimizer, lrs, divisor)
    with torch.no_grad():
        if master:
            torch._foreach_copy_(optimizer.model_params, optimizer.master_params)
        torch._foreach_zero_(grads)


class GraphedSteps:
    """The training loop's CUDA-graph path (one process on a GPU; see stages/lib/graphs.py).

    Pads every micro-batch of the run to one of at most train.cuda_graphs shapes planned from the run's
    own micro-batch sizes (the LM head's cost per log-prob token weighs log-prob padding), and runs each
    step as forward_backward per micro-batch + graphed_optimizer_step over static device tensors: the
    loss scale, the metric sums, the step's log row and one learning-rate tensor per parameter group."""

    def __init__(self, model, module, hf, objective, optimizer, settings: TrainSettings, env: DistEnv,
                 pairs: TokenPairs, micro_batches: list[MicroBatch], n_params: int):
        from stages.lib.graphs import StepGraphs
        head = hf.get_output_embeddings() if objective.head == "lm_head" else None
        logp_weight = head.weight.numel() / max(1, n_params - head.weight.numel()) if head is not None else 0.0
        flags = shared_prompt_flags(pairs, settings.share_prompt)
        dims = [batch_dims(pairs, mb, flags) for mb in micro_batches]
        shapes, shape_of = plan_padded_shapes(dims, settings.cuda_graphs, logp_weight)
        self.pad_to = [shapes[a] for a in shape_of]
        self.shape_ids = iter(shape_of)
        self.optimizer, self.module, self.env = optimizer, module, env
        device = env.device
        self.scale = torch.zeros((), dtype=torch.float64, device=device)
        self.sums = torch.zeros(len(objective.metric_names), dtype=torch.float64, device=device)
        self.row = torch.zeros(len(objective.metric_names) + 1, dtype=torch.float64, device=device)
        self.lrs = [torch.zeros((), dtype=torch.float32, device=device) for _ in optimizer.param_groups]
        from stages.lib.flat_adamw import FlatMasterAdamW
        why_not_flat = FlatMasterAdamW.unsupported(optimizer)
        self.flat = FlatMasterAdamW(optimizer, settings.max_grad_norm) if why_not_flat is None else None
        flat_warmup_s = FlatMasterAdamW.warm_up(device, optimizer.model_params[0].dtype) if self.flat else 0.0
        self.graphs = StepGraphs(
            device, fwd_bwd=lambda b: forward_backward(model, objective, settings, env, b, self.scale, self.sums),
            optimizer_step=lambda: graphed_optimizer_step(optimizer, module, settings, self.lrs, self.sums, self.row,
                                                          self.flat))
        self.info = {"enabled": True, "shapes": [asdict(s) for s in shapes],
                     "padded_tokens": int(sum(s.tokens for s in self.pad_to)),
                     "real_tokens": int(sum(d.tokens for d in dims)),
                     "optimizer": ({"kind": "flat_triton_adamw", "warmup_seconds": round(flat_warmup_s, 3)}
                                   if self.flat else {"kind": "torch_fused_adamw", "why_not_flat": why_not_flat})}
        self.graphs.stream.wait_stream(torch.cuda.current_stream(device))   # the model and state were made there

    def step(self, n_micro: int, batches: Iterator[PackedBatch], scale: float) -> torch.Tensor:
        """One optimizer step over the next n_micro (padded) batches -> [metric sums..., grad norm] (device)."""
        self.scale.fill_(scale)
        for _ in range(n_micro):
            self.graphs.micro_batch(next(self.shape_ids), next(batches))
        for t, group in zip(self.lrs, self.optimizer.param_groups):
            t.fill_(group["lr"])
        self.graphs.optimizer_step()
        return self.row.clone()

    def finish(self) -> dict:
        """Back to the default stream; free the graphs and the persistent gradients -> run_info's cuda_graphs."""
        torch.cuda.current_stream(self.env.device).wait_stream(self.graphs.stream)
        self.info.update(self.graphs.summary())
        self.graphs.release()
        if self.flat is not None:
            self.flat.release()
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.module.parameters():
            p.grad = None
        return self.info


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------

@dataclass
class TrainState:
    step: int = 0                      # optimizer steps completed
    tokens: int = 0                    # real tokens trained on (all ranks)
    log_rows: list[dict] = field(default_factory=list)


def plan_summary(plans: list[StepPlan], pairs: TokenPairs, world_size: int) -> list[dict]:
    tokens = pairs.pair_tokens
    out = []
    for r in range(world_size):
        mbs = [mb for s in plans for mb in s.rank_micro_batches[r]]
        fillers = sum(max(len(x) for x in s.rank_micro_batches) - len(s.rank_micro_batches[r]) for s in plans)
        out.append({"rank": r, "pairs": sum(map(len, mbs)), "tokens": int(sum(tokens[mb].sum() for mb in mbs)),
                    "micro_batches": len(mbs), "filler_micro_batches": fillers})
    return out


def write_train_log(path: Path, rows: list[dict]) -> None:
    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    write_text(path, buf.getvalue())


class ExportError(ValueError):
    """The model to export does not carry the head its objective trained."""


def check_export_head(hf: nn.Module, head: str) -> None:
    """A reward model exports only as a sequence-classification model with its scalar `score` head (a
    causal-LM export would silently drop the head) and a pad_token_id (HF's pooling reads the last token
    != it, as training did); a policy only as a causal LM with its LM head."""
    cls = type(hf).__name__
    if head == "score":
        score = getattr(hf, "score", None)
        if not cls.endswith("ForSequenceClassification") or not isinstance(score, nn.Linear) or score.out_features != 1:
            raise ExportError(f"refusing to export a reward model as {cls}: only a sequence-classification model "
                              "with a scalar `score` head (num_labels=1) keeps the trained head")
        if hf.config.pad_token_id is None:
            raise ExportError("refusing to export a reward model without config.pad_token_id: HF's pooling would "
                              "read another token than the one trained (the last token != the pad id)")
    elif head == "lm_head":
        if cls.endswith(("ForSequenceClassification", "ForTokenClassification")) or hf.get_output_embeddings() is None:
            raise ExportError(f"refusing to export a policy as {cls}: a DPO policy exports as a causal LM with its "
                              "LM head")
    else:
        raise ExportError(f"refusing to export: unknown head kind {head!r}")


def export_tokenizer_pad(export_dir: Path, pad_token_id: int) -> None:
    """A reward model's exported tokenizer pads with config.pad_token_id, the id HF's pooling skips, so a
    batch right-padded by the tokenizer scores as trained. A tokenizer without a pad token (GPT-2, Llama)
    gets the token of that id (EOS, as the trainer chose) written into tokenizer_config.json (and
    special_tokens_map.json, if any); every other tokenizer file stays as copied. Checked by loading it back."""
    export_dir = Path(export_dir)
    if not any((export_dir / name).exists() for name in TOKENIZER_MARKERS):
        return                                     # no tokenizer to export: the config alone decides
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(export_dir))
    if tok.pad_token_id is None:
        token = tok.convert_ids_to_tokens(int(pad_token_id))
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            path = export_dir / name
            if path.exists() or name == "tokenizer_config.json":
                cfg = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
                cfg["pad_token"] = token
                path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        tok = AutoTokenizer.from_pretrained(str(export_dir))
    if tok.pad_token_id != pad_token_id:
        raise ExportError(f"refusing to export a reward model whose tokenizer pads with id {tok.pad_token_id} "
                          f"({tok.pad_token!r}) while config.pad_token_id = {pad_token_id}: a padded batch would "
                          "be scored at another token than the one trained")


def export_model(model: nn.Module, module: nn.Module, objective, settings: TrainSettings, env: DistEnv,
                 src_dir: Path, out_dir: Path) -> None:
    """HF directory: a causal LM (DPO) or a sequence-classification model with its scalar head (RM).
    Tokenizer files are copied from the source directory so the export is usable on its own; a reward
    model's tokenizer pads with its config.pad_token_id (export_tokenizer_pad)."""
    hf = objective.hf_model(module)
    check_export_head(hf, objective.head)
    state = None
    if settings.parallel == "fsdp2":   # collective: every rank takes part
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        prefix = next(name for name, child in module.named_children() if child is hf) + "."
        state = {k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}
        # The gathered copies no longer share storage: drop the aliases of tied weights (lm_head = embeddings)
        # so the export has the same tensors as a DDP run's.
        first_name: dict[int, str] = {}
        for name, p in hf.named_parameters(remove_duplicate=False):
            if first_name.setdefault(id(p), name) != name:
                state.pop(name, None)
    if env.is_main:
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        hf.save_pretrained(tmp, state_dict=state)
        for name in TOKENIZER_FILES:
            if (Path(src_dir) / name).exists() and not (tmp / name).exists():
                shutil.copy2(Path(src_dir) / name, tmp / name)
        if objective.head == "score":
            export_tokenizer_pad(tmp, hf.config.pad_token_id)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    dist.barrier(group=env.control_group)


def peak_memory_bytes(env: DistEnv) -> int:
    if env.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(env.device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024   # CPU: peak RSS of the process


def split_measurements(info: dict) -> tuple[dict, dict]:
    """(facts, measurements), at any depth: keys ending in `_seconds` are timings, which vary run to run."""
    facts, times = {}, {}
    for k, v in info.items():
        if k.endswith("_seconds"):
            times[k] = v
        elif isinstance(v, dict):
            facts[k], inner = split_measurements(v)
            if inner:
                times[k] = inner
        else:
            facts[k] = v
    return facts, times


def train(objective, settings: TrainSettings, env: DistEnv, *, model_dir: Path, train_pairs: TokenPairs,
          probe_pairs: TokenPairs, out_dir: Path, checkpoint: CheckpointOptions | None = None,
          environment: dict | None = None, perf_path: Path | None = None) -> dict:
    """Train (resuming from a checkpoint when one fits), evaluate the probe at step 0 and at the end,
    export; returns run_info plus its `perf` (rank 0 writes files).

    run_info.json holds only what the same commit, params, data and environment reproduce byte for byte
    (it is an artifact hashed in dvc.lock and the evidence); timings, throughput and memory go to
    `perf_path` (the rule's `*.perf.json` log, outside the hashed record)."""
    t_start = time.perf_counter()
    out_dir = Path(out_dir)
    ckpt = checkpoint or CheckpointOptions(directory=None, resume="never")
    if settings.save_every and ckpt.directory is None:
        raise TrainConfigError(f"train.save_every = {settings.save_every} needs a checkpoint directory "
                               "(--checkpoint-dir, outside the stage's declared outputs)")
    if env.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)

    # -- model, optimizer, plan ------------------------------------------------------------------
    seed_everything(settings.seed)                 # same init on every rank (e.g. the new reward head)
    module = objective.build_module(model_dir, settings)
    hf = objective.hf_model(module)
    # A reward model's score positions follow its pad id (HF's pooling): set, or refused, before any work.
    train_pairs, probe_pairs = objective.prepare_pairs(hf, train_pairs), objective.prepare_pairs(hf, probe_pairs)
    disable_dropout(module)
    if settings.activation_checkpointing:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    module.to(env.device)
    masters = None
    if compute_dtype(settings) != torch.float32:
        # The fp32 values become the optimizer's masters (it makes its own copies). `.to(dtype)` gives each
        # parameter new bf16 data and these views keep the old fp32 storage alive until then: no extra copy.
        masters = {id(p): p.detach() for p in module.parameters()}
        module.to(dtype=compute_dtype(settings))
    objective.to(env.device)
    # Triton compiles a kernel on its first launch: do it now, not inside the timed loop's first step.
    mixed = env.device.type == "cuda" and settings.precision in ("bf16", "autocast")
    kernel_warmup_s = warm_up_fused_kernels(hf, env.device, torch.bfloat16 if mixed else torch.float32,
                                            torch.float32 if settings.precision == "autocast" else None)
    model = wrap_model(module, hf, settings, env)
    optimizer = build_optimizer(module, settings, env, masters)
    del masters
    plans = plan_training(train_pairs.pair_tokens, epochs=settings.epochs, world_size=env.world_size,
                          global_batch_pairs=settings.global_batch_pairs,
                          micro_batch_tokens=settings.micro_batch_tokens, seed=settings.seed)
    scheduler = build_scheduler(optimizer, settings, len(plans))
    state = TrainState()
    header = None
    if ckpt.directory is not None or ckpt.resume not in ("auto", "never"):
        # Rank 0's header (the reference digest is computed there only); every rank names files by it.
        box = [run_header(objective, settings, env, hf, train_pairs, probe_pairs, ckpt.reference)
               if env.is_main else None]
        if env.world_size > 1:
            dist.broadcast_object_list(box, src=0, group=env.control_group)
        header = box[0]
    resumed = agree_on_checkpoint(ckpt, header, env) if header is not None else None
    step0_rows = None
    if resumed is not None:
        resume_path, resume_meta = resumed
        saved, step0_rows = load_checkpoint(resume_path, resume_meta, module=module, optimizer=optimizer,
                                            scheduler=scheduler, settings=settings, env=env)
        state = TrainState(step=saved["step"], tokens=saved["tokens"], log_rows=saved["log_rows"])
        log.info("resuming from %s: %d of %d optimizer steps done", resume_path, state.step, len(plans))
    n_params = sum(p.numel() for p in module.parameters())
    log.info("objective %s: %d train pairs, %d probe pairs, %d optimizer steps, world %d (%s, %s), %.2fM params, "
             "attention %s", objective.name, len(train_pairs), len(probe_pairs), len(plans), env.world_size,
             env.backend, settings.parallel, n_params / 1e6,
             attention_backend(env.device, torch.bfloat16 if env.device.type == "cuda" else torch.float32))

    # -- step-0 probe ----------------------------------------------------------------------------
    def evaluate_probe(name: str) -> list[dict] | None:
        outputs = run_inference(model, probe_pairs, env, settings, desc=f"probe {name}")
        if not env.is_main:
            return None
        rows = objective.probe_rows(probe_pairs, outputs)
        write_jsonl(out_dir / f"probe_{name}.jsonl", rows)
        log.info("probe %s: accuracy %.4f over %d pairs", name, float(np.mean([r["correct"] for r in rows])), len(rows))
        return rows

    if resumed is None:
        step0_rows = evaluate_probe("step0")
    elif env.is_main:   # the step-0 model is gone; its probe rows were saved with the checkpoint
        write_jsonl(out_dir / "probe_step0.jsonl", step0_rows)

    # -- the loop ----------------------------------------------------------------------------------
    model.train()
    filler = filler_batch(train_pairs, settings.share_prompt).to(env.device)
    my_micro_batches = [mb for s in plans[state.step:] for mb in s.rank_micro_batches[env.rank]]
    reason = cuda_graphs_unavailable(settings, env)
    graphed = (GraphedSteps(model, module, hf, objective, optimizer, settings, env, train_pairs, my_micro_batches,
                            n_params) if reason is None else None)
    batches = prefetch_batches(train_pairs, my_micro_batches, pin=env.device.type == "cuda",
                               share_prompt=settings.share_prompt, pad_to=graphed.pad_to if graphed else None)
    metric_names = objective.metric_names
    progress = _progress_bar(len(plans), state.step, env)
    t_train = time.perf_counter()
    pair_tokens = train_pairs.pair_tokens
    log_every = max(1, len(plans) // 20)
    # Log values stay on the device until a flush (every `log_every` steps and at the end): one
    # device->host read per window instead of one per step, so the host keeps queueing work ahead of
    # the GPU. Rows are complete once flushed.
    pending: list[tuple[dict, torch.Tensor]] = []
    window = {"t": time.perf_counter(), "tokens": 0}
    throughput: list[dict] = []
    saved_checkpoints: list[int] = []

    def flush_log() -> None:
        if not pending:
            return
        values = torch.stack([v for _, v in pending]).tolist()
        now = time.perf_counter()
        tok_s = round(window["tokens"] / max(now - window["t"], 1e-9), 1)
        for (row, _), vals in zip(pending, values):
            pairs = row["pairs"]
            row.update({name: vals[i] / pairs for i, name in enumerate(metric_names)})
            row["grad_norm"] = vals[-1]
            state.log_rows.append({k: row[k] for k in ["step", "epoch", *metric_names, "lr", "grad_norm", "pairs",
                                                       "tokens"]})
        last = state.log_rows[-1]
        # Throughput is a measurement, not a result: it goes to the perf record and the console, never
        # into train_log.csv or the stage log, whose bytes are part of the hashed record.
        throughput.append({"step": last["step"], "tokens_per_s": tok_s})
        progress.set_postfix(loss=f"{last['loss']:.4f}", acc=f"{last['accuracy']:.3f}", refresh=False)
        if env.is_main:
            log.info("step %d/%d epoch %.3f loss %.5f accuracy %.4f margin %.4g lr %.3g grad_norm %.4g",
                     last["step"], len(plans), last["epoch"], last["loss"], last["accuracy"], last["margin"],
                     last["lr"], last["grad_norm"])
            log.info("step %d tok/s %.0f", last["step"], tok_s, extra=MEASUREMENT)
        pending.clear()
        window.update(t=now, tokens=0)

    profiler = StepProfiler.from_env(env.device, env.is_main, state.step)   # PREFPIPE_PROFILE: off by default
    loop_stream = torch.cuda.stream(graphed.graphs.stream) if graphed is not None else contextlib.nullcontext()
    with loop_stream:
        for plan in plans[state.step:]:
            if profiler is not None:
                profiler.before_step(state.step)
            mine = plan.rank_micro_batches[env.rank]
            n_micro, global_pairs, global_tokens = control_exchange(
                env, len(mine), sum(map(len, mine)), int(sum(pair_tokens[mb].sum() for mb in mine)))
            scale = env.world_size / global_pairs
            lr = scheduler.get_last_lr()[0]
            if graphed is not None:          # one process: no fillers, no collectives
                values = graphed.step(n_micro, batches, scale)
                with warnings.catch_warnings():   # the step ran, just not through optimizer.step()
                    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
                    scheduler.step()
            else:
                sums = torch.zeros(len(metric_names), dtype=torch.float64, device=env.device)
                for k in range(n_micro):
                    batch = next(batches).to(env.device, non_blocking=True) if k < len(mine) else filler
                    with gradient_sync(model, settings, enabled=k == n_micro - 1):
                        forward_backward(model, objective, settings, env, batch, scale, sums)
                if isinstance(optimizer, MasterWeightAdamW):
                    optimizer.grads_to_master()        # clip the fp32 master gradients
                    grad_norm = total_grad_norm(optimizer.master_params, settings.max_grad_norm)
                else:
                    grad_norm = total_grad_norm(model.parameters(), settings.max_grad_norm)
                torch._assert_async(torch.isfinite(grad_norm), "non-finite gradient norm")
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                dist.all_reduce(sums)
                values = torch.cat([sums, grad_norm.detach().reshape(1).to(sums)])

            state.step += 1
            if profiler is not None:
                profiler.after_step(state.step - 1)
            state.tokens += global_tokens
            window["tokens"] += global_tokens
            pending.append(({"step": state.step, "epoch": round(plan.epoch_progress, 6), "lr": lr,
                             "pairs": global_pairs, "tokens": global_tokens}, values))
            progress.update(1)
            if state.step == len(plans) or state.step % log_every == 0:
                flush_log()
            if settings.save_every and (state.step % settings.save_every == 0 or state.step == len(plans)):
                flush_log()                # the saved log rows must reach exactly this step
                save_checkpoint(ckpt.directory, header=header, step=state.step, total_steps=len(plans),
                                trainer_state={"step": state.step, "tokens": state.tokens, "log_rows": state.log_rows},
                                probe_step0_rows=step0_rows, module=module, optimizer=optimizer, scheduler=scheduler,
                                settings=settings, env=env, keep=settings.keep_checkpoints)
                saved_checkpoints.append(state.step)
    if profiler is not None:
        profiler.finish(state.step)
    graph_info = graphed.finish() if graphed is not None else {"enabled": False, "reason": reason}
    flush_log()
    progress.close()
    train_seconds = time.perf_counter() - t_train

    # -- final probe, export, records ---------------------------------------------------------------
    evaluate_probe("final")
    if isinstance(optimizer, MasterWeightAdamW):
        # Export the fp32 masters (what was trained), not their bf16 working copies.
        with torch.no_grad():
            module.float()
            torch._foreach_copy_(optimizer.model_params, optimizer.master_params)
    export_model(model, module, objective, settings, env, Path(model_dir), out_dir / "model")
    peaks = [None] * env.world_size
    dist.all_gather_object(peaks, peak_memory_bytes(env), group=env.control_group)
    graph_facts, graph_times = split_measurements(graph_info)
    kernel_facts = dict(getattr(hf, "prefpipe_fused_kernels", {}))
    run_info = {
        "objective": objective.name,
        "head": objective.head,
        "world_size": env.world_size,
        "backend": env.backend,
        "device": env.device.type,
        "parallel": settings.parallel,
        "attention": sorted(USED_BACKENDS),
        "cuda_graphs": graph_facts,
        "fused_kernels": kernel_facts,
        **({"reward_scoring": objective.scoring_info(hf)} if objective.head == "score" else {}),
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(settings).items()},
        "model_parameters": n_params,
        "train_pairs": len(train_pairs),
        "probe_pairs": len(probe_pairs),
        "optimizer_steps": len(plans),
        "resumed_from_step": resumed[1]["step"] if resumed is not None else None,
        "checkpoints_saved": saved_checkpoints,
        "per_rank": plan_summary(plans, train_pairs, env.world_size),
        "total_tokens": state.tokens,
        # The record the numbers were made under (stages/lib/environment.py): versions, CPU dispatch, GPU.
        "environment": environment if environment is not None else environment_record(asdict(settings)),
    }
    perf = {
        "train_seconds": round(train_seconds, 3),
        "wall_seconds": round(time.perf_counter() - t_start, 3),
        "tokens_per_s": round(state.tokens / max(train_seconds, 1e-9), 1),
        "throughput_windows": throughput,
        "peak_memory_bytes_per_rank": peaks,
        "peak_memory_kind": "cuda_max_allocated" if env.device.type == "cuda" else "cpu_max_rss",
        "kernel_warmup_seconds": round(kernel_warmup_s, 3),
        "cuda_graphs": graph_times,
    }
    if env.is_main:
        write_train_log(out_dir / "train_log.csv", state.log_rows)
        write_json(out_dir / "run_info.json", run_info)
        if perf_path is not None:
            write_json(perf_path, perf)
        log.info("trained %d tokens in %.1f s (%.0f tok/s); peak memory %.2f GiB per rank (%s)", state.tokens,
                 train_seconds, perf["tokens_per_s"], max(peaks) / 2**30, perf["peak_memory_kind"], extra=MEASUREMENT)
    return {**run_info, "perf": perf}


# ----------------------------------------------------------------------------------------------
# Stage CLI helpers (train_dpo, train_rm, ref_logps)
# ----------------------------------------------------------------------------------------------

def add_common_args(parser) -> None:
    parser.add_argument("--params", required=True, help="params.yaml")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--identity", help="ref_identity.json from verify_ref (the model directory is re-checked)")
    source.add_argument("--model-dir", help="a model directory used as is (tests, benchmarks)")
    parser.add_argument("--train-tokens", required=True, help="train_tokens.parquet")
    parser.add_argument("--probe-tokens", required=True, help="probe_tokens.parquet (manifest order)")
    parser.add_argument("--log", help="log file (rank 0): results and decisions, no timings")
    parser.add_argument("--perf", help="JSON file for timings, throughput and memory (rank 0); they vary run to run, "
                        "so they stay out of --log and the outputs")
    parser.add_argument("--environment", help="the environment stage's environment.json: refuse to run when this "
                        "process's environment differs from it")


def add_checkpoint_args(parser) -> None:
    parser.add_argument("--checkpoint-dir", help="periodic checkpoints (train.save_every) go here and --resume auto "
                        "looks here; keep it outside the stage's declared outputs (e.g. checkpoints/train_dpo). "
                        "Default: none, or the parent of an explicit --resume PATH")
    parser.add_argument("--resume", default="auto", metavar="auto|never|PATH",
                        help="auto (default): the newest complete checkpoint of this exact run in --checkpoint-dir, "
                        "if any; never: start fresh; PATH: that checkpoint, refused unless it matches this run")


def checkpoint_options(args, env: DistEnv) -> CheckpointOptions:
    """Call after resolve_model_dir (the identity is verified first). The reference digest is only
    computed on rank 0, which owns the run header."""
    directory = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if directory is None and args.resume not in ("auto", "never"):
        directory = Path(args.resume).parent       # an explicit resume keeps saving beside its checkpoint
    needed = env.is_main and (directory is not None or args.resume not in ("auto", "never"))
    reference = reference_of(identity_path=args.identity, model_dir=args.model_dir) if needed else None
    return CheckpointOptions(directory=directory, resume=args.resume, reference=reference)


def stage_environment(args, settings: TrainSettings) -> dict:
    """This process's environment record, checked against the DAG's (--environment) when given."""
    train_params = asdict(settings)
    if args.environment:
        return check_against_record(args.environment, train_params)
    return environment_record(train_params)


def resolve_model_dir(args) -> Path:
    if args.identity:
        from stages.verify_ref import load_verified_dir
        return Path(load_verified_dir(args.identity))
    return Path(args.model_dir)


def stage_logging(log_file, name: str, env: DistEnv) -> logging.Logger:
    from stages.lib.io import setup_logging
    logger = setup_logging(log_file if env.is_main else None, name)
    if not env.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    return logger


def load_stage_tokens(model_dir: Path, train_path, probe_path) -> tuple[TokenPairs, TokenPairs]:
    from transformers import AutoConfig
    from stages.lib.packing import load_token_pairs
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    return load_token_pairs(train_path, vocab), load_token_pairs(probe_path, vocab)


def _progress_bar(total: int, initial: int, env: DistEnv):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, desc="train", unit="step", file=sys.stderr,
                disable=not env.is_main, mininterval=1.0)
