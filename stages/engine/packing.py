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


def planned_steps(n_pairs: int, epochs: float, global_batch_pairs: int, max_steps: int | None = None) -> int:
    """len(plan_training(...)) from the counts alone (no packing): known before anything is loaded."""
    steps = sum(math.ceil(size / global_batch_pairs) for size in epoch_sizes(n_pairs, epochs)) if n_pairs else 0
    return steps if max_steps is None else min(steps, max_steps)


def plan_training(pair_tokens: np.ndarray, *, epochs: float, global_batch_pairs: int, world_size: int,
                  micro_batch_tokens: int, seed: int, max_steps: int | None = None) -> list[StepPlan]:
    """Every optimizer step of the run. A fractional last epoch takes the first part of its shuffle;
    the last step of an epoch may hold fewer pairs (its loss is normalized by its own pair count).
    max_steps (train.max_steps): the first max_steps of those steps (the same steps as uncapped: a cap never
    reshuffles)."""
    n = len(pair_tokens)
    if n == 0:
        raise ValueError("no training pairs")
    steps: list[StepPlan] = []
    for epoch, size in enumerate(epoch_sizes(n, epochs)):
        order = epoch_order(n, seed, epoch)[:size].tolist()
        for start in range(0, size, global_batch_pairs):
            chunk = order[start:start + global_batch_pairs]
            per_rank = assign_pairs_to_ranks(chunk, pair_tokens, world_size)
            if max_steps is not None and len(steps) >= max_steps:
                return steps
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
# The sizes of a micro-batch or of a padded shape (padding and shape planning: stages/engine/padded_shapes.py)
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
