"""Processes and devices: the process group (torchrun's or a one-process one), the CPU control exchange,
seeding, precision contexts, and model wrapping (DDP / FSDP2) with its gradient-sync context.

CPU runs pin their kernels to processor-independent variants first (train.portable_numerics,
stages/lib/environment.py): torch and MKL choose their CPU kernels once, at the process's first op.
"""
from __future__ import annotations

import contextlib
import os
import random
import resource
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from stages.engine.settings import TrainConfigError, TrainSettings
from stages.lib.environment import pin_portable_cpu_numerics

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


# The CUDA caching allocator's setting for every engine process (training, reference passes, generation, judging).
# Without expandable segments a 7B bf16_sr_8bit run on an 80 GB card ran out of memory inside CUDA-graph capture
# with 49.3 GiB allocated and 28.4 GiB reserved but unallocated (blocks of the eager first steps, cut to other
# sizes, that the graphs' private pool could not reuse); with them it peaked at 59.0 GiB. Segments that grow in
# place leave nothing stranded, so the memory plan's 5% fragmentation allowance holds (tests/engine/test_gpu.py).
CUDA_ALLOCATOR_CONF = "expandable_segments:True"
ALLOCATOR_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")     # torch >= 2.9's name, then the older one


def configure_cuda_allocator() -> str:
    """Give this process's CUDA allocator CUDA_ALLOCATOR_CONF, unless the user set one (theirs is kept as given).
    Must run before the first CUDA allocation: the allocator reads its configuration once, at its first use.
    The variable is exported too, so processes this one starts inherit it. Returns the configuration in force."""
    for name in ALLOCATOR_ENV:
        if os.environ.get(name):
            return f"{name}={os.environ[name]} (set by the user)"
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = CUDA_ALLOCATOR_CONF
    if torch.cuda.is_initialized():
        # A process that used CUDA before this call (a test running several stages in one process): new segments
        # follow the setting from here on.
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
        setter(CUDA_ALLOCATOR_CONF)
    return f"PYTORCH_CUDA_ALLOC_CONF={CUDA_ALLOCATOR_CONF}"


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
        configure_cuda_allocator()          # before set_device and any allocation
        torch.cuda.set_device(device)
    # The CPU reduction order depends on the intra-op thread count, and runners set it differently
    # (Snakemake exports OMP_NUM_THREADS=<rule threads>, DVC and torchrun with one process leave the
    # default): fix it from params so `snakemake` and `dvc repro` produce the same bytes.
    torch.set_num_threads(settings.cpu_threads)
    if not dist.is_initialized():
        timeout = timedelta(minutes=30)
        if "RANK" in os.environ:
            # device_id makes NCCL build its communicator now (eager init, a fraction of a second at start-up).
            # One process (torchrun --nproc-per-node 1, the usual single-GPU run) may never use it: no DDP, the
            # control exchange is gloo's, the CUDA-graph step has no collective. Without device_id it is built
            # at the first NCCL collective, if any (the eager step's metric all_reduce, FSDP2), never inside a
            # graph capture (graphed runs have none).
            eager = use_cuda and int(os.environ.get("WORLD_SIZE", 1)) > 1
            dist.init_process_group(backend, timeout=timeout, device_id=device if eager else None)
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
        if settings.optimizer_state == "bf16_sr_8bit":
            # No master: the shards are the bf16 weights themselves (updated with stochastic rounding); gradients
            # are still reduced in fp32, then held in the shards' dtype.
            module.to(dtype=torch.bfloat16)
            mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
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


def peak_memory_bytes(env: DistEnv) -> int:
    if env.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(env.device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024   # CPU: peak RSS of the process


def peak_reserved_bytes(env: DistEnv) -> int | None:
    """What the card had to hold at the peak: the allocator's reserved segments (allocated + cached + graph pools),
    the figure the memory plan must bound for a run to fit. None on the CPU."""
    return int(torch.cuda.max_memory_reserved(env.device)) if env.device.type == "cuda" else None

