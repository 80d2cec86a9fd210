"""Padding-free packing of preference pairs: token parquet -> per-rank, per-step micro-batch plans.

A micro-batch is ONE flat row of tokens holding whole pairs: chosen and rejected of a pair always
sit in the same micro-batch (sequence 2k is pair k's chosen, 2k+1 its rejected), position ids
restart at 0 for every sequence and `cu_seqlens` tells the attention kernel where sequences end,
so no token ever attends across a boundary and no padding is computed.

Planning is pure and deterministic (a function of lengths, seed and world size only), so every
rank computes the same global plan and takes its own share; the trainer still confirms the
per-step counts with a tiny CPU exchange (see stages/engine/loop.py) before entering collectives.

- Training plan: each epoch shuffles pair order with PCG64([seed, epoch]); consecutive groups of
  `global_batch_pairs` form one optimizer step; a step's pairs go to ranks by
  longest-processing-time-first on pair tokens (sequence-length balance), and each rank packs its
  pairs into micro-batches of at most `micro_batch_tokens` (first-fit decreasing).
- Inference plan (reference log-probs, probe evaluation): pairs packed sequentially in file order,
  micro-batches dealt round-robin to ranks. A micro-batch's contents then do not depend on the
  world size, so the step-0 probe pass of the policy reproduces the reference pass bit for bit
  (every DPO pair ties at step 0, as it must).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from stages.lib.contracts import token_hash_problem
from stages.lib.io import read_parquet

TOKEN_COLUMNS = ("pair_id", "chosen_ids", "chosen_prompt_len", "rejected_ids", "rejected_prompt_len",
                 "margin", "token_hash")


class TokenDataError(ValueError):
    """The token parquet violates the contract; the message names the file, row and reason."""


# ----------------------------------------------------------------------------------------------
# Token pairs (the tokenize stage's parquet, held as flat numpy arrays)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenPairs:
    """Rows of a token parquet. Sequence s = 2*i (chosen of pair i) or 2*i+1 (rejected of pair i)."""
    source: str
    pair_ids: list[str]
    token_hashes: list[str]
    margins: np.ndarray            # float64, NaN where the source had no margin
    seq_ids: list[np.ndarray]      # 2*n int64 arrays, interleaved chosen/rejected
    seq_prompt_lens: np.ndarray    # [2n] int64
    # [2n] int64: the index, within each sequence, of the token a reward model reads (with_score_positions);
    # None: the last token (a policy reads every completion token and never uses it).
    score_index: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.pair_ids)

    def with_score_positions(self, pad_token_id: int) -> "TokenPairs":
        """These pairs with `score_index` set as transformers' AutoModelForSequenceClassification pools: the
        last token whose id != pad_token_id (`(arange(T) * (input_ids != pad)).argmax(-1)`), so trailing
        tokens equal to the pad id (e.g. an EOS when pad == EOS) are not read, in training, in the probe or
        by whoever scores the export with right padding. Refuses a sequence whose completion holds no other
        token: the reward would be read in the prompt (or, with no such token at all, at position 0)."""
        out = np.empty(len(self.seq_ids), dtype=np.int64)
        for s, ids in enumerate(self.seq_ids):
            i = len(ids) - 1
            while i >= 0 and ids[i] == pad_token_id:
                i -= 1
            if i < self.seq_prompt_lens[s]:
                p = s // 2
                raise TokenDataError(
                    f"{self.source}: row {p} (pair {self.pair_ids[p]}) {('chosen', 'rejected')[s % 2]}: every "
                    f"completion token is the pad token {pad_token_id}, so a reward model has nothing to score "
                    "there (it reads the last token whose id != pad_token_id, as transformers' "
                    "AutoModelForSequenceClassification does). Drop the pair, or give the reference a pad token "
                    "that completions do not end with")
            out[s] = i
        return replace(self, score_index=out)

    @cached_property
    def seq_lens(self) -> np.ndarray:
        """Computed once per TokenPairs (the loop and the planner read it every step)."""
        return np.fromiter((len(s) for s in self.seq_ids), dtype=np.int64, count=len(self.seq_ids))

    @property
    def pair_tokens(self) -> np.ndarray:
        """Tokens of chosen + rejected per pair (the packing cost and the throughput unit)."""
        return self.seq_lens.reshape(-1, 2).sum(axis=1)

    @property
    def completion_tokens(self) -> int:
        return int((self.seq_lens - self.seq_prompt_lens).sum())


def _list_column(table: pa.Table, name: str, path: str) -> list[np.ndarray]:
    col = table.column(name).combine_chunks()
    if not pa.types.is_list(col.type) and not pa.types.is_large_list(col.type):
        raise TokenDataError(f"{path}: column {name} must be list<int>, got {col.type}")
    if col.null_count:
        row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
        raise TokenDataError(f"{path}: row {row}: {name} is null")
    values = col.flatten().to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    offsets = col.offsets.to_numpy()
    return [values[offsets[i]:offsets[i + 1]] for i in range(len(col))]


def load_token_pairs(path: str | Path, vocab_size: int | None = None) -> TokenPairs:
    """Read and validate a token parquet (docs/ARTIFACTS.md, tokenize): page CRCs (read_parquet), every row's
    token_hash recomputed from its ids (contracts.token_hash_problem), then the per-row checks below."""
    path = str(path)
    table = read_parquet(path)          # not pq.read_table: it imports pyarrow.dataset (~0.45 s a stage)
    missing = [c for c in TOKEN_COLUMNS if c not in table.column_names]
    if missing:
        raise TokenDataError(f"{path}: missing columns {missing} (have {table.column_names})")
    if (problem := token_hash_problem(table, path)) is not None:
        raise TokenDataError(problem)
    pair_ids = table.column("pair_id").to_pylist()
    token_hashes = table.column("token_hash").to_pylist()
    margins = np.array([np.nan if m is None else float(m) for m in table.column("margin").to_pylist()],
                       dtype=np.float64)
    chosen = _list_column(table, "chosen_ids", path)
    rejected = _list_column(table, "rejected_ids", path)
    chosen_pl = table.column("chosen_prompt_len").to_numpy(zero_copy_only=False)
    rejected_pl = table.column("rejected_prompt_len").to_numpy(zero_copy_only=False)

    seen: dict[str, int] = {}
    for row, pid in enumerate(pair_ids):
        if not pid:
            raise TokenDataError(f"{path}: row {row}: empty pair_id")
        if pid in seen:
            raise TokenDataError(f"{path}: row {row}: pair_id {pid} repeats row {seen[pid]}")
        seen[pid] = row
    seq_ids: list[np.ndarray] = []
    seq_prompt_lens = np.empty(2 * len(pair_ids), dtype=np.int64)
    for row in range(len(pair_ids)):
        for branch, ids, prompt_len in (("chosen", chosen[row], chosen_pl[row]),
                                        ("rejected", rejected[row], rejected_pl[row])):
            where = f"{path}: row {row} (pair {pair_ids[row]}) {branch}"
            if prompt_len is None or np.isnan(prompt_len):
                raise TokenDataError(f"{where}: prompt_len is null")
            prompt_len = int(prompt_len)
            # Token 0 is never predicted, so a completion must start at position >= 1 and be non-empty.
            if not 1 <= prompt_len < len(ids):
                raise TokenDataError(f"{where}: prompt_len {prompt_len} leaves no scoreable completion "
                                     f"in {len(ids)} tokens (need 1 <= prompt_len < length)")
            if len(ids) and (ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size)):
                raise TokenDataError(f"{where}: token id out of range [0, {vocab_size}) "
                                     f"(min {ids.min()}, max {ids.max()}): tokenizer/model mismatch?")
            seq_ids.append(ids)
            seq_prompt_lens[len(seq_ids) - 1] = prompt_len
    return TokenPairs(source=path, pair_ids=pair_ids, token_hashes=token_hashes, margins=margins,
                      seq_ids=seq_ids, seq_prompt_lens=seq_prompt_lens)


# ----------------------------------------------------------------------------------------------
# Planning (pure: integers in, lists of pair indices out)
# ----------------------------------------------------------------------------------------------

MicroBatch = list[int]             # pair indices (rows of TokenPairs), in packing order


@dataclass(frozen=True)
class StepPlan:
    step: int                      # 0-based optimizer step
    epoch: int
    epoch_progress: float          # epochs completed after this step (fractional)
    rank_micro_batches: list[list[MicroBatch]]   # [rank][micro-batch] -> pair indices


def pack_micro_batches(pair_indices: list[int], pair_tokens: np.ndarray, budget: int,
                       sort: bool = True) -> list[MicroBatch]:
    """Group pairs into micro-batches of at most `budget` tokens.

    sort=True: first-fit decreasing (dense packing for training); sort=False: sequential greedy
    in the given order (order-preserving, for inference). A pair longer than the budget on its
    own gets a micro-batch of its own rather than being dropped.
    """
    if not sort:
        out: list[MicroBatch] = []
        used = 0
        for i in pair_indices:
            t = int(pair_tokens[i])
            if out and used + t <= budget:
                out[-1].append(i)
                used += t
            else:
                out.append([i])
                used = t
        return out
    order = sorted(pair_indices, key=lambda i: (-int(pair_tokens[i]), i))
    bins: list[MicroBatch] = []
    free: list[int] = []
    for i in order:
        t = int(pair_tokens[i])
        for b, room in enumerate(free):
            if t <= room:
                bins[b].append(i)
                free[b] -= t
                break
        else:
            bins.append([i])
            free.append(budget - t)
    return bins


def assign_pairs_to_ranks(pair_indices: list[int], pair_tokens: np.ndarray, world_size: int) -> list[list[int]]:
    """Longest-processing-time-first: each pair (longest first) goes to the least-loaded rank."""
    heap = [(0, r) for r in range(world_size)]
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(pair_indices, key=lambda i: (-int(pair_tokens[i]), i)):
        load, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (load + int(pair_tokens[i]), r))
    return out


def epoch_order(n_pairs: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n_pairs)


def epoch_sizes(n_pairs: int, epochs: float) -> list[int]:
    """Pairs trained in each epoch: all of them, and a fractional last epoch's share (at least one)."""
    sizes = [n_pairs] * int(math.floor(epochs))
    if epochs > math.floor(epochs):
        sizes.append(max(1, math.ceil((epochs - math.floor(epochs)) * n_pairs)))
    return sizes


def planned_steps(n_pairs: int, epochs: float, global_batch_pairs: int) -> int:
    """len(plan_training(...)) from the counts alone (no packing): known before anything is loaded."""
    return sum(math.ceil(size / global_batch_pairs) for size in epoch_sizes(n_pairs, epochs)) if n_pairs else 0


def plan_training(pair_tokens: np.ndarray, *, epochs: float, global_batch_pairs: int, world_size: int,
                  micro_batch_tokens: int, seed: int) -> list[StepPlan]:
    """Every optimizer step of the run. A fractional last epoch takes the first part of its shuffle;
    the last step of an epoch may hold fewer pairs (its loss is normalized by its own pair count)."""
    n = len(pair_tokens)
    if n == 0:
        raise ValueError("no training pairs")
    steps: list[StepPlan] = []
    for epoch, size in enumerate(epoch_sizes(n, epochs)):
        order = epoch_order(n, seed, epoch)[:size].tolist()
        for start in range(0, size, global_batch_pairs):
            chunk = order[start:start + global_batch_pairs]
            per_rank = assign_pairs_to_ranks(chunk, pair_tokens, world_size)
            steps.append(StepPlan(
                step=len(steps), epoch=epoch, epoch_progress=epoch + (start + len(chunk)) / n,
                rank_micro_batches=[pack_micro_batches(p, pair_tokens, micro_batch_tokens) for p in per_rank]))
    return steps


def plan_inference(pair_tokens: np.ndarray, *, micro_batch_tokens: int, world_size: int) -> list[list[MicroBatch]]:
    """[rank][micro-batch] for one pass over all pairs (every pair exactly once)."""
    mbs = pack_micro_batches(list(range(len(pair_tokens))), pair_tokens, micro_batch_tokens, sort=False)
    return [mbs[r::world_size] for r in range(world_size)]


# ----------------------------------------------------------------------------------------------
# PackedBatch: one micro-batch as tensors
# ----------------------------------------------------------------------------------------------

@dataclass
class PackedBatch:
    """One packed micro-batch. Shapes: T tokens, S = 2P sequences, C completion tokens.

    input_ids / position_ids [1, T]; cu_seqlens [S+1] int32 over query tokens; max_seqlen (host int);
    logp_positions [C]: hidden-state positions whose next token is a completion token,
    logp_targets [C]: that next token, logp_seq [C]: its sequence; last_positions [S]: the last
    completion token of each sequence, or its `TokenPairs.score_index` token when set (the reward model's score
    position: the last token that is not the pad token, see TokenPairs.with_score_positions);
    pair_index [P]: row in TokenPairs (binds every output to its pair_id); pair_weight [P]: 1, or 0
    for the filler micro-batches that keep collectives aligned across ranks.

    Shared-prompt layout (share_prompt=True, a pair whose chosen and rejected start with the same
    prompt tokens): the pair is laid out once as [prompt, chosen completion, rejected completion].
    Query segment 2k = prompt + chosen completion (causal over itself); query segment 2k+1 = the
    rejected completion alone, attending to the keys [prompt, rejected completion]: `kv_index` [K]
    gathers those keys (K = the unshared token count) and `cu_seqlens_k` [S+1] / `max_seqlen_k`
    delimit them, with the causal mask aligned bottom-right (the last query sees every key of its
    segment). Rejected positions restart at the prompt length, so every token sees exactly the
    context it has in its own sequence and the log-probs equal the unshared ones; the prompt is
    computed once instead of twice. kv_index is None when no pair shares (then keys = queries).
    """
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    logp_positions: torch.Tensor
    logp_targets: torch.Tensor
    logp_seq: torch.Tensor
    last_positions: torch.Tensor
    pair_index: torch.Tensor
    pair_weight: torch.Tensor
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_k: int = 0
    kv_index: torch.Tensor | None = None
    seq_lens: list[int] = field(default_factory=list)   # full sequence lengths (prompt + completion)

    _TENSORS = ("input_ids", "position_ids", "cu_seqlens", "logp_positions", "logp_targets", "logp_seq",
                "last_positions", "pair_index", "pair_weight", "cu_seqlens_k",
                "kv_index")

    def map_tensors(self, fn) -> "PackedBatch":
        kw = {name: (None if getattr(self, name) is None else fn(getattr(self, name))) for name in self._TENSORS}
        return PackedBatch(**kw, max_seqlen=self.max_seqlen, max_seqlen_k=self.max_seqlen_k, seq_lens=self.seq_lens)

    def pin_memory(self) -> "PackedBatch":
        return self.map_tensors(lambda t: t.pin_memory())

    def to(self, device: torch.device, non_blocking: bool = False) -> "PackedBatch":
        return self.map_tensors(lambda t: t.to(device, non_blocking=non_blocking))

    @property
    def n_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def computed_tokens(self) -> int:
        """Tokens the model actually runs (a shared prompt counts once)."""
        return int(self.input_ids.shape[1])

    def dims(self) -> "BatchDims":
        """This batch's sizes (what batch_dims predicts from the lengths alone)."""
        shared = self.kv_index is not None
        return BatchDims(tokens=self.computed_tokens, keys=int(self.kv_index.shape[0]) if shared else self.computed_tokens,
                         logp_tokens=int(self.logp_positions.shape[0]), pairs=int(self.pair_index.shape[0]),
                         max_q=self.max_seqlen, max_k=self.max_seqlen_k if shared else self.max_seqlen)


def shares_prompt(pairs: TokenPairs, p: int) -> bool:
    """Chosen and rejected of pair p start with the same prompt tokens (always true for our tokenize stage's
    output, which tokenizes the prompt once; checked anyway, a pair that does not is laid out unshared)."""
    c, r = pairs.seq_ids[2 * p], pairs.seq_ids[2 * p + 1]
    pl = int(pairs.seq_prompt_lens[2 * p])
    return (pl == int(pairs.seq_prompt_lens[2 * p + 1]) and len(c) > pl and len(r) > pl
            and np.array_equal(c[:pl], r[:pl]))


def build_packed_batch(pairs: TokenPairs, micro_batch: MicroBatch, weight: float = 1.0,
                       share_prompt: bool = False) -> PackedBatch:
    """Flatten whole pairs into one row, in micro_batch order: chosen then rejected of each pair, or
    [prompt, chosen completion, rejected completion] with share_prompt (see PackedBatch)."""
    if not micro_batch:
        raise ValueError("empty micro-batch")
    ids_parts, pos_parts, kv_parts = [], [], []
    q_lens, k_lens, last_positions = [], [], []
    logp_positions, logp_targets, logp_seq = [], [], []
    any_shared = False
    start = 0                       # query-token offset of the current pair
    for k, p in enumerate(micro_batch):
        c, r = pairs.seq_ids[2 * p], pairs.seq_ids[2 * p + 1]
        pc, pr = int(pairs.seq_prompt_lens[2 * p]), int(pairs.seq_prompt_lens[2 * p + 1])
        s_c, s_r = 2 * k, 2 * k + 1
        # The rejected sequence's first `s` tokens are read from the chosen segment: its prompt when the
        # pair shares it (laid out once), none otherwise (then the two sequences are simply concatenated).
        s = pr if share_prompt and shares_prompt(pairs, p) else 0
        any_shared |= s > 0
        n_c, n_r = len(c), len(r) - s
        ids_parts += [c, r[s:]]
        pos_parts += [np.arange(n_c), np.arange(s, len(r))]
        # keys: chosen attends to itself; rejected to [its shared prefix in the chosen segment; itself]
        kv_parts += [np.arange(start, start + n_c), np.arange(start, start + s),
                     np.arange(start + n_c, start + n_c + n_r)]
        q_lens += [n_c, n_r]
        k_lens += [n_c, len(r)]
        # completion token j is predicted by the hidden state of token j - 1 of the same sequence; rejected
        # token i sits at start + i inside the shared prefix, else at start + n_c + (i - s)
        pos_c = np.arange(start + pc - 1, start + n_c - 1)
        prev_r = np.arange(pr - 1, len(r) - 1)
        pos_r = np.where(prev_r < s, start + prev_r, start + n_c + prev_r - s)
        logp_positions += [pos_c, pos_r]
        logp_targets += [c[pc:], r[pr:]]
        # score positions: the last token, or score_index (>= the prompt length >= s, so never in a shared prefix)
        score_c, score_r = ((len(c) - 1, len(r) - 1) if pairs.score_index is None
                            else (int(pairs.score_index[2 * p]), int(pairs.score_index[2 * p + 1])))
        last_positions += [start + score_c, start + n_c + score_r - s]
        start += n_c + n_r
        logp_seq += [np.full(len(pos_c), s_c), np.full(len(pos_r), s_r)]
    seq_lens = [len(pairs.seq_ids[2 * p + b]) for p in micro_batch for b in (0, 1)]
    n_pairs = len(micro_batch)
    t = torch.from_numpy

    def cumsum32(lens):
        return t(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    return PackedBatch(
        input_ids=t(np.concatenate(ids_parts).astype(np.int64))[None],
        position_ids=t(np.concatenate(pos_parts).astype(np.int64))[None],
        cu_seqlens=cumsum32(q_lens),
        max_seqlen=int(max(q_lens)),
        logp_positions=t(np.concatenate(logp_positions).astype(np.int64)),
        logp_targets=t(np.concatenate(logp_targets).astype(np.int64)),
        logp_seq=t(np.concatenate(logp_seq).astype(np.int64)),
        last_positions=torch.tensor(last_positions, dtype=torch.int64),
        pair_index=torch.tensor(micro_batch, dtype=torch.int64),
        pair_weight=torch.full((n_pairs,), float(weight), dtype=torch.float32),
        cu_seqlens_k=cumsum32(k_lens) if any_shared else None,
        max_seqlen_k=int(max(k_lens)),
        kv_index=t(np.concatenate(kv_parts).astype(np.int64)) if any_shared else None,
        seq_lens=seq_lens,
    )


# ----------------------------------------------------------------------------------------------
# Fixed shapes for CUDA graphs: a micro-batch's sizes, and padding a batch up to a shape
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchDims:
    """The sizes of a packed micro-batch, or of a padded shape that several micro-batches share.

    tokens: query tokens T (input_ids); keys: gathered keys K (= T without kv_index); logp_tokens: C;
    pairs: P; max_q / max_k: the longest query / key segment (the attention kernel's grid bound).
    """
    tokens: int
    keys: int
    logp_tokens: int
    pairs: int
    max_q: int
    max_k: int

    def fits(self, dims: "BatchDims") -> bool:
        """Can a batch of `dims` be padded to this shape (see pad_packed_batch)?"""
        pad = self.tokens - dims.tokens
        spare_keys = self.keys - dims.keys - pad     # keys of the trash pair's empty rejected segment
        return (pad >= 0 and spare_keys >= 0 and self.logp_tokens >= dims.logp_tokens
                and self.pairs >= dims.pairs + 1 and self.max_q >= max(dims.max_q, pad)
                and self.max_k >= max(dims.max_k, pad, spare_keys))


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


def plan_padded_shapes(dims: list[BatchDims], max_shapes: int, logp_weight: float, capture_cost_batches: float = 4.0,
                       max_distinct: int = 1024) -> tuple[list[BatchDims], list[int]]:
    """Group a run's micro-batches into at most `max_shapes` padded shapes -> (shapes, shape of each batch).

    Each shape is captured once as a CUDA graph and replayed for every batch padded to it, so fewer
    shapes mean fewer captures and more padding. Groups are contiguous in token count; the DP picks the
    grouping with the least padded work, work = tokens + logp_weight * log-prob tokens (logp_weight: the
    LM head's cost per log-prob token relative to the body's per token), and charges every shape
    `capture_cost_batches` average micro-batches of work (a capture takes about one eager step of host
    time, several replayed steps on a launch-bound model: bench/results/h200.json), so a short run
    captures fewer shapes than a long one. Pure and deterministic: every rerun pads the same way.
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
