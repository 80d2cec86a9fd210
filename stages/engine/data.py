"""Batches for the step and the no-grad passes: packed micro-batches built (and pinned) on a background
thread, off the step's critical path; the zero-weight filler; the batch -> forward keyword mapping; and the
inference pass that scores every pair exactly once over all ranks (reference log-probs, probes).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from stages.engine.dist import DistEnv, autocast, control_exchange
from stages.engine.settings import TrainSettings
from stages.engine.packing import (BatchDims, MicroBatch, PackedBatch, TokenPairs, build_packed_batch,
                                plan_inference)
from stages.engine.padded_shapes import pad_packed_batch


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

