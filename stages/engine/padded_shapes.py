"""Fixed shapes for CUDA graphs: a micro-batch's sizes without building it, padding a packed batch up to a shape,
and the grouping of a run's micro-batches into a few padded shapes (stages/engine/steps.py captures one graph per
shape). The batch layout itself (TokenPairs, PackedBatch, BatchDims) is stages/engine/packing.py's.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from stages.engine.packing import BatchDims, MicroBatch, PackedBatch, TokenPairs, shares_prompt


def shared_prompt_flags(pairs: TokenPairs, share_prompt: bool) -> np.ndarray:
    """[n_pairs] bool: pair p is laid out shared (see build_packed_batch)."""
    return np.array([share_prompt and shares_prompt(pairs, p) for p in range(len(pairs))], dtype=bool)


def batch_dims(pairs: TokenPairs, micro_batch: MicroBatch, shared: np.ndarray) -> BatchDims:
    """The sizes build_packed_batch(pairs, micro_batch, share_prompt) produces, without building it
    (`shared` from shared_prompt_flags)."""
    lens, prompt = pairs.seq_lens, pairs.seq_prompt_lens
    t = k = c = max_q = max_k = 0
    for p in micro_batch:
        lc, lr, pc, pr = int(lens[2 * p]), int(lens[2 * p + 1]), int(prompt[2 * p]), int(prompt[2 * p + 1])
        q_r = lr - pr if shared[p] else lr
        t += lc + q_r
        k += lc + lr
        c += (lc - pc) + (lr - pr)
        max_q, max_k = max(max_q, lc, q_r), max(max_k, lc, lr)
    any_shared = bool(shared[list(micro_batch)].any())
    return BatchDims(tokens=t, keys=k if any_shared else t, logp_tokens=c, pairs=len(micro_batch), max_q=max_q,
                     max_k=max_k if any_shared else max_q)


def pad_packed_batch(batch: PackedBatch, shape: BatchDims) -> PackedBatch:
    """Pad a micro-batch to exactly `shape`, so one captured CUDA graph serves every batch of that shape.

    Padding adds whole zero-weight pairs: first a "trash" pair whose chosen sequence is the pad tokens
    (position ids from 0, attending only to themselves) and whose rejected sequence is empty with the
    spare keys (pointing at token 0); then pairs with empty sequences. The padded log-prob positions are
    summed into the trash chosen sequence. Real sequences keep their tokens, boundaries and outputs, and
    the zero weights keep padding out of losses, metrics and gradients. kv_index is kept (an identity
    one if the batch shares nothing) whenever the shape has more keys than tokens.
    """
    dims = batch.dims()
    t, k, c, p = dims.tokens, dims.keys, dims.logp_tokens, dims.pairs
    if not shape.fits(dims):
        raise ValueError(f"micro-batch {dims} does not fit the padded shape {shape}")
    with_kv = shape.keys > shape.tokens
    if batch.kv_index is not None and not with_kv:
        raise ValueError(f"micro-batch shares prompts (kv_index) but the shape {shape} has no spare keys")
    pad, extra = shape.tokens - t, shape.pairs - p
    spare_keys = shape.keys - k - pad
    i64 = dict(dtype=torch.int64)
    q_extra = torch.tensor([pad, 0] + [0, 0] * (extra - 1), **i64)
    k_extra = torch.tensor([pad, spare_keys] + [0, 0] * (extra - 1), **i64)
    cu_k = batch.cu_seqlens_k if batch.kv_index is not None else batch.cu_seqlens
    kv = batch.kv_index if batch.kv_index is not None else torch.arange(t, **i64)
    n_logp = shape.logp_tokens - c
    return PackedBatch(
        input_ids=torch.cat([batch.input_ids[0], torch.zeros(pad, **i64)])[None],
        position_ids=torch.cat([batch.position_ids[0], torch.arange(pad, **i64)])[None],
        cu_seqlens=torch.cat([batch.cu_seqlens, (t + q_extra.cumsum(0)).to(torch.int32)]),
        max_seqlen=shape.max_q,
        logp_positions=torch.cat([batch.logp_positions, torch.full((n_logp,), shape.tokens - 1, **i64)]),
        logp_targets=torch.cat([batch.logp_targets, torch.zeros(n_logp, **i64)]),
        logp_seq=torch.cat([batch.logp_seq, torch.full((n_logp,), 2 * p, **i64)]),
        last_positions=torch.cat([batch.last_positions, torch.full((2 * extra,), shape.tokens - 1, **i64)]),
        pair_index=torch.cat([batch.pair_index, torch.zeros(extra, **i64)]),
        pair_weight=torch.cat([batch.pair_weight, torch.zeros(extra, dtype=batch.pair_weight.dtype)]),
        cu_seqlens_k=torch.cat([cu_k, (k + k_extra.cumsum(0)).to(torch.int32)]) if with_kv else None,
        max_seqlen_k=shape.max_k if with_kv else 0,
        kv_index=torch.cat([kv, torch.arange(t, shape.tokens, **i64), torch.zeros(spare_keys, **i64)])
        if with_kv else None,
        seq_lens=list(batch.seq_lens) + [pad, 0] + [0, 0] * (extra - 1),
    )


# What a capture costs, in average micro-batches of work (plan_padded_shapes' capture_cost_batches): host time (about
# one eager step's: Python, launches, allocator), against a replayed batch's GPU time, which grows with the FLOPs.
# Two measured points: 4 batches at the 0.5B shape (24 layers, 494M parameters: bench/results/h200.json), ~1 at 7B
# (28 layers, 7.6B: 0.11-0.30 s a capture on H100 hosts against a ~0.17 s replayed step,
# bench/results/h100_issue38_dd4ac83/). A power law in parameters a layer through both (exponent ~0.54), never above
# the 0.5B figure (smaller models plan as before). At 7B on 512 HH pairs: 7 shapes, 6.3% padding tokens, where 4
# batches gave 3 shapes and 19.5%.
CAPTURE_COST_BATCHES = 4.0
CAPTURE_COST_PARAMS_PER_LAYER = 494_032_768 / 24
CAPTURE_COST_EXPONENT = 0.54


def capture_cost_batches(n_params: int, layers: int) -> float:
    """A capture's cost in micro-batches for a model of n_params parameters in `layers` layers (above)."""
    ratio = CAPTURE_COST_PARAMS_PER_LAYER / max(1.0, n_params / max(1, layers))
    return min(CAPTURE_COST_BATCHES, CAPTURE_COST_BATCHES * ratio ** CAPTURE_COST_EXPONENT)


def plan_padded_shapes(dims: list[BatchDims], max_shapes: int, logp_weight: float,
                       capture_cost_batches: float = CAPTURE_COST_BATCHES,
                       max_distinct: int = 1024) -> tuple[list[BatchDims], list[int]]:
    """Group a run's micro-batches into at most `max_shapes` padded shapes -> (shapes, shape of each batch).

    Each shape is captured once as a CUDA graph and replayed for every batch padded to it, so fewer
    shapes mean fewer captures and more padding. Groups are contiguous in token count; the DP picks the
    grouping with the least padded work, work = tokens + logp_weight * log-prob tokens (logp_weight: the
    LM head's cost per log-prob token relative to the body's per token), and charges every shape
    `capture_cost_batches` average micro-batches of work (a capture takes about one eager step of host
    time, several replayed steps on a launch-bound model: bench/results/h200.json; less than one at 7B:
    capture_cost_batches()), so a short run captures fewer shapes than a long one. Pure and deterministic: every
    rerun pads the same way.
    """
    if not dims:
        return [], []
    if max_shapes < 1:
        raise ValueError(f"max_shapes = {max_shapes}: need at least one shape")
    tokens = np.array([d.tokens for d in dims], dtype=np.int64)
    # Many distinct lengths (long runs): round token counts up to a grid so the DP stays small.
    step = 1 if len(np.unique(tokens)) <= max_distinct else math.ceil((int(tokens.max()) + 1) / max_distinct)
    rounded = -(-tokens // step) * step
    values, inverse = np.unique(rounded, return_inverse=True)
    m = len(values)
    counts = np.bincount(inverse, minlength=m).astype(np.float64)
    logp = np.array([d.logp_tokens for d in dims], dtype=np.float64)
    max_c = np.zeros(m)
    np.maximum.at(max_c, inverse, logp)
    # cost[i, j]: the work of values i..j padded to one shape (i <= j); inf below the diagonal
    cost = np.full((m, m), np.inf)
    for i in range(m):
        run_c = np.maximum.accumulate(max_c[i:])
        cost[i, i:] = np.cumsum(counts[i:]) * (values[i:] + logp_weight * run_c)
    g_max = min(max_shapes, m)
    best = np.full((g_max + 1, m), np.inf)
    cut = np.zeros((g_max + 1, m), dtype=np.int64)       # first value index of the last group
    best[1] = cost[0]
    for g in range(2, g_max + 1):
        for j in range(m):
            cand = np.concatenate([[np.inf], best[g - 1, :j]]) + cost[:j + 1, j]   # last group = i..j
            cut[g, j] = int(np.argmin(cand))
            best[g, j] = cand[cut[g, j]]
    per_shape = capture_cost_batches * float(np.mean(tokens + logp_weight * logp))
    n_groups = min(range(1, g_max + 1), key=lambda g: (best[g, m - 1] + per_shape * g, g))
    starts, j = [], m - 1
    for g in range(n_groups, 0, -1):
        i = int(cut[g, j]) if g > 1 else 0
        starts.append(i)
        j = i - 1
    starts = sorted(starts)
    group_of_value = np.searchsorted(np.array(starts), np.arange(m), side="right") - 1
    assignment = group_of_value[inverse].tolist()
    shapes = []
    for g in range(n_groups):
        members = [d for d, a in zip(dims, assignment) if a == g]
        t_b = int(values[(starts + [m])[g + 1] - 1])
        k_b = t_b + max(d.keys - d.tokens for d in members)
        shapes.append(BatchDims(
            tokens=t_b, keys=k_b, logp_tokens=max(d.logp_tokens for d in members),
            pairs=max(d.pairs for d in members) + 1,
            max_q=max(max(d.max_q, t_b - d.tokens) for d in members),
            max_k=max(max(d.max_k, t_b - d.tokens, k_b - d.keys - (t_b - d.tokens)) for d in members)))
    return shapes, assignment
