"""Over ~500 lines on purpose: the cache, the attention it feeds, the decode step (eager or graphed), the sampler and
the loaders share one batch layout; split, each part would need the others to be read.

Generation: completions of a causal LM for token prompts, batched over a KV cache, and the models that do it.

The loop (`generate`), per batch of `batch_size` (prompt, sample) items:
  prefill  the batch's prompts as ONE packed row (no padding; training's packed attention, each prompt attending
           only to itself); every layer's keys/values are written into the batch's cache [B, Hkv, L, D] at (row,
           position), and logits are taken at each prompt's last token only.
  decode   one token per row and step: input [B, 1] at the row's own position; its key/value go to that position
           of the cache and the query attends to the row's positions 0 .. position (the rest masked): two matmuls
           and a float32 softmax over the cache, the grouped query heads of a KV head sharing its keys (no copy).
           On CUDA one Triton kernel instead (kernels.decode_attention: each row reads its own keys only), once
           decode_kernel_problem has found it agreeing with the matmul form on that card.
  L = the longest prompt of the call + max_new_tokens, the same for every batch. A row stops at a stop token
  (an EOS id, or the rendering's end-of-turn token) or after max_new_tokens; the batch when every row has.
  A last batch with fewer items is padded with finished one-token rows. On CUDA with `cuda_graphs`, the decode step
  is captured once as a CUDA graph and replayed (the step of a 0.5B model is ~500 kernel launches; the host, not the
  GPU, would set the pace). A capture that fails falls back to the eager step, saying
  why (GenerationRun.cuda_graphs).

Sampling (`sample_next`), in transformers' order: the repetition penalty first (CTRL's, as HF's
RepetitionPenaltyLogitsProcessor: the logit of every token already in the row, prompt included, divided by it when
positive, multiplied when negative; 1 = off), then temperature 0 = greedy (argmax; a tie goes to the lowest token
id). Otherwise softmax(logits / T) in float32, the top_k most likely tokens (probabilities sorted descending,
stably; 0 = all), the top_p nucleus of those renormalized (the smallest prefix whose float64 cumulative sum
reaches top_p), and inverse-CDF sampling with u in [0, 1) from a counter-based hash of
(seed, the prompt's key, the sample's index, the step) (`uniforms`): a row's draws depend on neither the batch it
is in nor the model, so the policy and the reference sample with the same random numbers (common random numbers:
the comparison's noise cancels where the two distributions agree).

Batch invariance on CPU (`row_invariant_linears`): MKL's single-threaded sgemm under the portable pin
(stages/lib/environment.py) gives a row of x @ W.T the same bits for any number of rows as long as that number is
a multiple of 8 (fewer, or a remainder, take other kernels: tests/stages/test_generate.py checks both), so during
generation every nn.Linear runs on its rows padded with zeros to a multiple of 8. The rest is per row already
(norms, rotary tables, elementwise ops, each prompt's own attention in the prefill, the decode attention of one
(row, KV head) pair at a time over the fixed L), so on CPU a completion's tokens and the recorded outputs do not
depend on batch_size or on which prompts share its batch. On CUDA they may, in a near-tie (cuBLAS picks kernels by
shape); the environment record names the GPU and its libraries, as for training.

Loading (`load_policy_lm`, `load_judge`): an HF directory, or peft's adapter directory (train.adapter export
`adapter`) over the reference, merged at load. A judge must be a sequence-classification model with one label
and its trained `score` head: a head transformers would initialise is refused, never scored with.
"""
from __future__ import annotations

import contextlib
import json
import time
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from stages.engine import kernels
from stages.engine.lowbit_adamw import MASK32, mix32
from stages.engine.modeling import (load_causal_lm, make_grouped_weights_adjacent, packed_attention_forward,
                                    reward_pad_token_id, use_fused_kernels)
from stages.engine.packing import TokenPairs
from stages.lib.contracts import STOP_REASONS  # noqa: F401 - the reasons a Completion's stop_reason takes
from stages.lib.reference import is_adapter_dir, judge_head_problem  # noqa: F401 - the stages import it here

GENERATION_ATTENTION = "prefpipe_generation"
ROW_MULTIPLE = 8          # rows per GEMM call on CPU: a multiple of this keeps each row's bits (module docstring)


class GenerationError(ValueError):
    """A generation setting or model cannot give what was asked; the message names the knob or file."""


@dataclass(frozen=True)
class GenerationSettings:
    """params.yaml's `generation` sampling knobs (the schema validates them; see its descriptions)."""
    max_new_tokens: int
    temperature: float          # 0 = greedy
    top_p: float                # (0, 1]; 1 = the whole distribution
    seed: int
    n: int                      # completions per prompt and model
    batch_size: int             # (prompt, sample) items per batch
    top_k: int = 0              # the k most likely tokens only; 0 = every token
    repetition_penalty: float = 1.0   # > 0; 1 = off (CTRL / transformers' RepetitionPenaltyLogitsProcessor)

    KNOBS = ("max_new_tokens", "temperature", "top_p", "seed", "n", "batch_size", "top_k", "repetition_penalty")

    def __post_init__(self):
        if self.top_k < 0 or self.repetition_penalty <= 0:
            raise GenerationError(f"generation.top_k must be >= 0 (got {self.top_k}) and generation."
                                  f"repetition_penalty > 0 (got {self.repetition_penalty})")

    @classmethod
    def from_params(cls, section: dict) -> "GenerationSettings":
        missing = [k for k in cls.KNOBS if k not in section]
        if missing:
            raise GenerationError(f"params.yaml generation: missing {', '.join(missing)}")
        return cls(**{k: section[k] for k in cls.KNOBS})


@dataclass(frozen=True)
class StopTokens:
    """Where a completion ends: an EOS id of the tokenizer or model, or the rendering's end-of-turn token (the
    first token a rendered assistant turn closes with, when it is a special token other than EOS)."""
    eos: tuple[int, ...]
    end_of_turn: int | None = None

    @property
    def ids(self) -> list[int]:
        return sorted(set(self.eos) | ({self.end_of_turn} if self.end_of_turn is not None else set()))

    def reason(self, token: int) -> str | None:
        if token in self.eos:
            return "eos"
        if token == self.end_of_turn:
            return "end_of_turn"
        return None


@dataclass(frozen=True)
class Completion:
    prompt: int                 # index into the prompts
    sample: int                 # 0 .. n - 1
    tokens: list[int]           # generated ids, the stop token included when there is one
    stop_reason: str            # STOP_REASONS

    @property
    def content(self) -> list[int]:
        """The completion without its stop token (what a rendering would wrap in a closed turn)."""
        return self.tokens[:-1] if self.stop_reason != "max_new_tokens" else self.tokens


# ----------------------------------------------------------------------------------------------
# Counter-based uniforms and the sampler
# ----------------------------------------------------------------------------------------------

def row_keys(seed: int, prompt_keys: list[int], samples: list[int]) -> torch.Tensor:
    """One 32-bit stream key per (prompt, sample) row (int64 holding uint32 values)."""
    return torch.tensor([mix32(mix32(mix32(seed & MASK32) ^ (p & MASK32)) ^ (s & MASK32))
                         for p, s in zip(prompt_keys, samples)], dtype=torch.int64)


def uniforms(keys: torch.Tensor, step: int) -> torch.Tensor:
    """[rows] float64 in [0, 1) with 53 random bits: two hashed 32-bit words of (row key, step). Integer operations
    and one exact float64 division: the same values on any CPU or GPU."""
    hi = mix32(keys ^ ((2 * step) & MASK32))
    lo = mix32(keys ^ ((2 * step + 1) & MASK32))
    return ((hi >> 11) * (2 ** 32) + lo).to(torch.float64) / float(2 ** 53)


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor | None, top_k: int = 0,
                seen: torch.Tensor | None = None, repetition_penalty: float = 1.0) -> torch.Tensor:
    """[rows, V] float32 logits -> [rows] int64 token ids (module docstring). seen: [rows, V] bool, the tokens already
    in each row (prompt and completion so far), read only under a repetition penalty."""
    if repetition_penalty != 1.0:
        penalized = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1, dtype=torch.float32)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass = sorted_p.double()
    if 0 < top_k < mass.shape[-1]:
        mass[:, top_k:] = 0
        if top_p < 1:                                       # the nucleus of the top-k, renormalized (as HF)
            mass = mass / mass.sum(dim=-1, keepdim=True)
    if top_p < 1:
        before = torch.cumsum(mass, dim=-1) - mass          # the mass of the tokens ranked above each one
        mass = torch.where(before < top_p, mass, torch.zeros_like(mass))
    cdf = torch.cumsum(mass, dim=-1)
    target = u.to(cdf.device)[:, None] * cdf[:, -1:]
    pick = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)
    # A zero-mass token past the nucleus is never picked: u * total < total = the last kept cdf value.
    return order.gather(-1, pick).squeeze(-1)


# ----------------------------------------------------------------------------------------------
# The KV cache and the attention that reads it
# ----------------------------------------------------------------------------------------------

class GenerationCache:
    """The keys and values of one batch, [B, Hkv, L, D] per layer, in the model's dtype. transformers' attention
    layers call `update` with their new keys/values: in the prefill (a packed row [1, Hkv, T, D]) they are
    scattered to (row, position) and returned as they are, for the packed attention; in a decode step ([B, Hkv, 1,
    D]) each row's goes to its `step_pos` and the whole cache is returned. Allocated once per call, so the CUDA
    graph of a decode step reads fixed addresses."""

    def __init__(self, n_layers: int, batch: int, kv_heads: int, length: int, head_dim: int, dtype, device):
        shape = (batch, kv_heads, length, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.rows = torch.arange(batch, device=device)
        self.step_pos = torch.zeros(batch, dtype=torch.int64, device=device)
        self.prefill: tuple[torch.Tensor, torch.Tensor] | None = None

    def reset(self) -> None:
        for t in (*self.k, *self.v):
            t.zero_()

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.prefill is not None:
            rows, pos = self.prefill
            self.k[layer_idx][rows, :, pos, :] = key[0].transpose(0, 1)
            self.v[layer_idx][rows, :, pos, :] = value[0].transpose(0, 1)
            return key, value
        self.k[layer_idx][self.rows, :, self.step_pos, :] = key[:, :, 0, :]
        self.v[layer_idx][self.rows, :, self.step_pos, :] = value[:, :, 0, :]
        return self.k[layer_idx], self.v[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0                # never used for positions: every forward passes its position_ids


def generation_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attention_mask, scaling: float | None = None, dropout: float = 0.0,
                                 sliding_window: int | None = None, prefpipe_key_mask: torch.Tensor | None = None,
                                 prefpipe_key_count: torch.Tensor | None = None, **kwargs):
    """A decode step (prefpipe_key_mask [B, L] bool: the keys each row may read, its first prefpipe_key_count[b]):
    query [B, Hq, 1, D] against the cache [B, Hkv, L, D] -> ([B, 1, Hq, D], None). Anything else (the prefill, the
    scoring passes) is training's packed attention. On CUDA (the decode step passes prefpipe_key_count there
    only) one Triton kernel reads each row's own keys (kernels.decode_attention); elsewhere two matmuls over the
    whole cache, masked, as the module docstring says."""
    if prefpipe_key_mask is None:
        return packed_attention_forward(module, query, key, value, attention_mask, scaling, dropout,
                                        sliding_window, **kwargs)
    if sliding_window is not None:
        raise NotImplementedError("sliding-window attention layers are not supported by generation")
    b, hq, _, d = query.shape
    if prefpipe_key_count is not None and kernels.decode_attention_supported(query, key):
        return kernels.decode_attention(query, key, value, prefpipe_key_count,
                                        scaling if scaling is not None else d ** -0.5), None
    hkv = key.shape[1]
    q = query.reshape(b, hkv, hq // hkv, d)                    # the query heads of each KV head, in HF's order
    scores = torch.matmul(q, key.transpose(-1, -2)).float()    # [B, Hkv, G, L]
    scores = scores * (scaling if scaling is not None else d ** -0.5)
    scores = scores.masked_fill(~prefpipe_key_mask[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)   # [B, Hkv, G, D]
    return out.reshape(b, hq, 1, d).transpose(1, 2), None


def register_generation_attention() -> str:
    from transformers import AttentionInterface
    AttentionInterface.register(GENERATION_ATTENTION, generation_attention_forward)
    return GENERATION_ATTENTION


# ----------------------------------------------------------------------------------------------
# Batch-invariant linears on CPU
# ----------------------------------------------------------------------------------------------

def _row_invariant_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    pad = (-rows) % ROW_MULTIPLE
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[1])])
    return F.linear(flat, self.weight, self.bias)[:rows].reshape(*x.shape[:-1], -1)


@contextlib.contextmanager
def row_invariant_linears(model: nn.Module):
    """Every nn.Linear of `model` on rows padded to a multiple of ROW_MULTIPLE while the block runs (CPU only:
    on CUDA the model is left as it is)."""
    linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.device.type == "cpu"]
    saved = [m.__dict__.get("forward") for m in linears]
    for m in linears:
        m.forward = types.MethodType(_row_invariant_linear, m)
    try:
        yield
    finally:
        for m, fwd in zip(linears, saved):
            if fwd is None:
                del m.forward
            else:
                m.forward = fwd


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------

@dataclass
class GenerationRun:
    """What a call did: the completions (in (prompt, sample) order) and facts for the stage's records.
    decode_attention: "kernel" (kernels.decode_attention) or "matmul: <why not the kernel>" (a measurement: the
    stages put it in their perf log, not in a record)."""
    completions: list[Completion]
    batches: int
    cache_length: int
    cuda_graphs: dict
    decode_attention: str = "matmul: not CUDA"


def decode_kernel_problem(q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                          device: torch.device) -> str | None:
    """Why kernels.decode_attention must not serve this call's decode steps; None when it may. It must be able to
    run here, and it must agree with the masked two-matmul form (the CPU path, in float64) on this device for this
    head geometry: three random rows of 1, 70 and 33 keys, to the dtype's rounding. Checked at every call, on the
    machine it runs on: the GPU suite (bench/gpu_check.py) runs per commit, on one card, and a kernel that is wrong
    on another would write wrong completions without a word. On failure the call runs the matmul form."""
    b, length = 3, 70
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(b, 1, q_heads, head_dim, generator=gen).to(device, dtype).transpose(1, 2)
    k, v = (torch.randn(b, kv_heads, length, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    if not kernels.decode_attention_supported(q, k):
        return "the kernel does not take this head geometry or dtype, or Triton cannot run here"
    count = torch.tensor([1, length, 33], device=device)
    mask = torch.arange(length, device=device)[None, :] < count[:, None]
    try:
        out = kernels.decode_attention(q, k, v, count, head_dim ** -0.5).double()
    except Exception as e:  # noqa: BLE001 - any launch failure: the matmul form, with the reason
        return f"the kernel failed to run: {type(e).__name__}: {e}"[:300]
    ref, _ = generation_attention_forward(None, q.double(), k.double(), v.double(), None, head_dim ** -0.5,
                                          prefpipe_key_mask=mask)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    worst = float((out - ref).abs().max())
    if not worst <= tol:                      # NaN fails too
        return f"the kernel disagrees with the matmul form on this device (max difference {worst:.3g} > {tol})"
    return None


def _model_dims(model: nn.Module) -> tuple[int, int, int]:
    cfg = model.config
    heads = cfg.num_attention_heads
    return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads, \
        getattr(cfg, "head_dim", None) or cfg.hidden_size // heads


def max_positions(model: nn.Module) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


def cache_argument(model: nn.Module) -> str:
    """The name the model's forward takes its KV cache by: transformers renamed `past_key_values` to `cache` within
    the versions we support (>= 5.17). Passed under the other name the cache would go unused into **kwargs (every
    decode step then attends to its own token only), so the name is read from the forward's signature."""
    import inspect
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise GenerationError(f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`: this "
                          "transformers version's cache interface is not supported by generation")


class _DecodeStep:
    """The decode forward over fixed tensors (token, position, key mask, cache), eager or as a CUDA graph."""

    def __init__(self, model: nn.Module, cache: GenerationCache, batch: int, length: int, device, graphs: bool,
                 attention_kernel: bool = False):
        self.model, self.cache = model, cache
        self.cache_kw = {cache_argument(model): cache}
        self.tokens = torch.zeros(batch, 1, dtype=torch.int64, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.int64, device=device)
        self.key_mask = torch.zeros(batch, length, dtype=torch.bool, device=device)
        self.key_index = torch.arange(length, device=device)
        # the keys each row reads, as a count, for the decode-attention kernel (generation_attention_forward):
        # on CUDA, where the kernel passed decode_kernel_problem's check
        self.key_count = torch.zeros(batch, dtype=torch.int64, device=device) if attention_kernel else None
        self.graph = None
        self.logits: torch.Tensor | None = None
        self.want_graph = graphs
        self.graph_state: dict = {"enabled": False, "reason": "off" if not graphs else "not captured yet"}

    def _forward(self) -> torch.Tensor:
        counts = {} if self.key_count is None else {"prefpipe_key_count": self.key_count}
        out = self.model(input_ids=self.tokens, position_ids=self.positions, **self.cache_kw, use_cache=True,
                         prefpipe_key_mask=self.key_mask, **counts)
        return out.logits[:, -1]

    def __call__(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        self.tokens[:, 0].copy_(tokens)
        self.positions[:, 0].copy_(lengths)
        self.cache.step_pos.copy_(lengths)
        torch.le(self.key_index[None, :], lengths[:, None], out=self.key_mask)
        if self.key_count is not None:
            torch.add(lengths, 1, out=self.key_count)
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        if self.want_graph:
            self.want_graph = False
            try:
                return self._capture()
            except Exception as e:  # noqa: BLE001 - any capture failure: the eager step, with the reason recorded
                self.graph = None
                self.graph_state = {"enabled": False, "reason": f"capture failed: {type(e).__name__}: {e}"[:300]}
                torch.cuda.synchronize()
        return self._forward()

    def _capture(self) -> torch.Tensor:
        # Warm-up on a side stream (allocator, lazy kernel loading), then the capture. Writing the step's keys and
        # values twice is harmless: the same values go to the same positions.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self._forward()
        self.graph = graph
        self.graph_state = {"enabled": True, "reason": "one decode graph per call, batches padded to batch_size"}
        graph.replay()
        return self.logits


@torch.no_grad()
def generate(model: nn.Module, prompts: list[np.ndarray], prompt_keys: list[int], settings: GenerationSettings,
             stop: StopTokens, pad_token_id: int, device: torch.device, cuda_graphs: bool = False,
             on_batch=None, phase_seconds: dict | None = None) -> GenerationRun:
    """`settings.n` completions of every prompt (token id arrays), in (prompt, sample) order. prompt_keys: one
    integer per prompt naming its random stream (the same prompt gets the same draws in every call). The model
    must use GENERATION_ATTENTION (load_policy_lm). on_batch(done_items, total_items): progress. phase_seconds: a
    dict that gets the seconds of the prefills ("prefill") and of the decode loops ("decode") and the decode steps run
    ("decode_steps") added to it; it synchronizes the device around each phase, so only benches pass one."""
    if settings.max_new_tokens < 1:
        raise GenerationError("generation.max_new_tokens must be at least 1")
    items = [(i, k) for i in range(len(prompts)) for k in range(settings.n)]
    length = max((len(p) for p in prompts), default=1) + settings.max_new_tokens
    limit = max_positions(model)
    if limit is not None and length > limit:
        raise GenerationError(f"the longest prompt ({length - settings.max_new_tokens} tokens) plus "
                              f"generation.max_new_tokens ({settings.max_new_tokens}) is {length} positions, more "
                              f"than the model's max_position_embeddings {limit}")
    batch = max(1, min(settings.batch_size, len(items)))
    n_layers, kv_heads, head_dim = _model_dims(model)
    dtype = next(model.parameters()).dtype
    cache = GenerationCache(n_layers, batch, kv_heads, length, head_dim, dtype, device)
    graphs = cuda_graphs and device.type == "cuda"
    attention = "matmul: not CUDA"
    if device.type == "cuda":
        problem = decode_kernel_problem(model.config.num_attention_heads, kv_heads, head_dim, dtype, device)
        attention = "kernel" if problem is None else f"matmul: {problem}"
    step = _DecodeStep(model, cache, batch, length, device, graphs, attention_kernel=attention == "kernel")
    keys_all = row_keys(settings.seed, [prompt_keys[i] for i, _ in items], [k for _, k in items])
    stop_ids = torch.tensor(stop.ids, dtype=torch.int64, device=device)
    invariant = row_invariant_linears(model) if device.type == "cpu" else contextlib.nullcontext()
    out: list[Completion] = []
    n_batches = 0
    with invariant:
        for start in range(0, len(items), batch):
            chunk = items[start:start + batch]
            # Every batch has `batch` rows (the cache and a decode graph are made for that many): the missing ones
            # are a one-token filler, finished at once.
            rows = batch
            seqs = [prompts[i] for i, _ in chunk] + [np.array([pad_token_id])] * (rows - len(chunk))
            keys = torch.cat([keys_all[start:start + len(chunk)], torch.zeros(rows - len(chunk), dtype=torch.int64)])
            tokens = _generate_batch(model, cache, step, seqs, keys.to(device), len(chunk), settings, stop_ids,
                                     pad_token_id, device, phase_seconds)
            for (i, k), row in zip(chunk, tokens):
                out.append(_completion(i, k, row, stop))
            n_batches += 1
            if on_batch is not None:
                on_batch(min(start + batch, len(items)), len(items))
    return GenerationRun(out, n_batches, length, step.graph_state, attention)


def _completion(prompt: int, sample: int, row: list[int], stop: StopTokens) -> Completion:
    for j, t in enumerate(row):
        reason = stop.reason(t)
        if reason is not None:
            return Completion(prompt, sample, row[:j + 1], reason)
    return Completion(prompt, sample, row, "max_new_tokens")


def _generate_batch(model, cache: GenerationCache, step: _DecodeStep, seqs: list[np.ndarray], keys: torch.Tensor,
                    real_rows: int, settings: GenerationSettings, stop_ids: torch.Tensor, pad_token_id: int,
                    device, phases: dict | None = None) -> list[list[int]]:
    clock = _PhaseClock(phases, device)
    rows = len(seqs)
    lens = [len(s) for s in seqs]
    cache.reset()
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=device)
    cache.prefill = (torch.repeat_interleave(torch.arange(rows), torch.tensor(lens)).to(device),
                     torch.cat([torch.arange(n) for n in lens]).to(device))
    try:
        out = model(input_ids=torch.as_tensor(np.concatenate(seqs), dtype=torch.int64, device=device)[None],
                    position_ids=cache.prefill[1][None], **step.cache_kw, use_cache=True, cu_seq_lens_q=cu,
                    cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens),
                    logits_to_keep=(cu[1:] - 1).to(torch.int64))
    finally:
        cache.prefill = None
    logits = out.logits[0].float()
    clock.lap("prefill")
    lengths = torch.tensor(lens, dtype=torch.int64, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    done[real_rows:] = True
    generated = torch.full((rows, settings.max_new_tokens), pad_token_id, dtype=torch.int64, device=device)
    seen = None
    if settings.repetition_penalty != 1.0:       # the tokens in each row so far: its prompt's, then its own
        seen = torch.zeros(logits.shape, dtype=torch.bool, device=device)
        seen[torch.repeat_interleave(torch.arange(rows), torch.tensor(lens)).to(device),
             torch.as_tensor(np.concatenate(seqs), dtype=torch.int64, device=device)] = True
    steps = 0
    for t in range(settings.max_new_tokens):
        u = uniforms(keys, t) if settings.temperature > 0 else None
        token = sample_next(logits, settings.temperature, settings.top_p, u, settings.top_k, seen,
                            settings.repetition_penalty)
        token = torch.where(done, torch.full_like(token, pad_token_id), token)
        generated[:, t] = token
        if seen is not None:
            seen[torch.arange(rows, device=device), token] = True
        done |= torch.isin(token, stop_ids)
        if t == settings.max_new_tokens - 1 or bool(done.all()):
            break
        logits = step(token, lengths).float()
        lengths += 1
        steps += 1
    clock.lap("decode", decode_steps=steps)
    return generated[:real_rows].cpu().tolist()


class _PhaseClock:
    """Adds each phase's seconds to `phases` (generate's phase_seconds), synchronizing the device at each lap so a
    phase's queued kernels count in it; a no-op when phases is None (the stages: no extra syncs)."""

    def __init__(self, phases: dict | None, device):
        self.phases, self.device = phases, device
        self.t = self._now() if phases is not None else 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, name: str, **counts: int) -> None:
        if self.phases is None:
            return
        now = self._now()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.t
        for key, n in counts.items():
            self.phases[key] = self.phases.get(key, 0) + n
        self.t = now


# ----------------------------------------------------------------------------------------------
# Loading the models
# ----------------------------------------------------------------------------------------------

def inference_dtype(device: torch.device) -> torch.dtype:
    """Generation and judging weights: bf16 on CUDA (inference only), fp32 on CPU (the portable record)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_policy_lm(model_dir, reference_dir, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A causal LM for generation and scoring: `model_dir` (HF), or peft's adapter directory over the reference,
    merged. Eval mode, no gradients, GENERATION_ATTENTION, on `device` in `dtype`."""
    # Loaded in `dtype` on `device` (a 7B reference is not built in fp32 on the host first); on CPU that dtype is
    # fp32, what load_causal_lm always used there.
    if is_adapter_dir(model_dir):
        from peft import PeftModel
        base = load_causal_lm(reference_dir, dtype=dtype, device=device)
        model = PeftModel.from_pretrained(base, str(model_dir)).merge_and_unload()
        model.prefpipe_fused_kernels = use_fused_kernels(model)
    else:
        model = load_causal_lm(model_dir, dtype=dtype, device=device)
    return as_generation_model(model, device, dtype)


def as_generation_model(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A loaded causal LM made ready for `generate` and the scoring passes: GENERATION_ATTENTION, eval mode, no
    gradients, on `device` in `dtype` (bench/generation_bench.py calls it on models built from a config)."""
    model.set_attn_implementation(register_generation_attention())
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if device.type == "cuda":           # the grouped GEMMs (CUDA only) read their weights in place
        make_grouped_weights_adjacent(model)
    return model


def load_judge(model_dir, reference_dir, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The judge: a sequence-classification model with one label and its trained `score` head, the pad id its
    pooling reads by (modeling.reward_pad_token_id). Refuses (GenerationError) anything else, and a checkpoint
    whose head transformers would have to initialise."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging
    from stages.engine.modeling import register_packed_attention
    problem = judge_head_problem(model_dir)
    if problem is not None:
        raise GenerationError(f"judge {problem}")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        if is_adapter_dir(model_dir):
            from peft import PeftModel
            base = AutoModelForSequenceClassification.from_pretrained(
                reference_dir, num_labels=1, dtype=torch.float32, attn_implementation=register_packed_attention())
            model = PeftModel.from_pretrained(base, str(model_dir)).merge_and_unload()
            missing: list[str] = []
        else:
            model, info = AutoModelForSequenceClassification.from_pretrained(
                model_dir, dtype=torch.float32, attn_implementation=register_packed_attention(),
                output_loading_info=True)
            missing = list(info.get("missing_keys") or [])
    finally:
        hf_logging.set_verbosity(verbosity)
    if missing:
        raise GenerationError(f"judge {model_dir}: weights missing from the checkpoint ({sorted(missing)[:6]}): "
                              "a reward head that was never trained cannot judge")
    if not isinstance(getattr(model, "score", None), nn.Linear) or model.score.out_features != 1:
        raise GenerationError(f"judge {model_dir}: {type(model).__name__} has no scalar `score` head")
    pad_dir = reference_dir if is_adapter_dir(model_dir) else model_dir
    model.config.pad_token_id, model.prefpipe_pad_source = reward_pad_token_id(pad_dir, model.config)
    model.prefpipe_fused_kernels = use_fused_kernels(model)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if device.type == "cuda":
        make_grouped_weights_adjacent(model)
    return model


def stop_tokens_of(model_dirs: list, tokenizer, closing: list[int], special_ids: set[int]) -> StopTokens:
    """Where completions of these models stop: every EOS id any of them names, and the rendering's end-of-turn token
    (closing[0], the first token an assistant turn closes with) when it is a special token (special_ids: the
    tokenizer's, stages.data.tokenizer special_token_strings) other than an EOS. generate and round_pairs share it."""
    eos = tuple(sorted({i for d in model_dirs for i in eos_token_ids(d, tokenizer)}))
    end_of_turn = closing[0] if closing and closing[0] in special_ids and closing[0] not in eos else None
    return StopTokens(eos, end_of_turn)


def eos_token_ids(model_dir, tokenizer) -> tuple[int, ...]:
    """Every EOS id the tokenizer, config.json and generation_config.json name (instruct models list several)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
            for v in (value if isinstance(value, list) else [value]):
                if isinstance(v, int) and not isinstance(v, bool):
                    ids.add(v)
    if not ids:
        raise GenerationError(f"{model_dir}: no EOS token in the tokenizer, config.json or generation_config.json: "
                              "a completion could never stop before max_new_tokens")
    return tuple(sorted(ids))


# ----------------------------------------------------------------------------------------------
# Scoring what was generated: log-probs (the KL estimate) and a judge's rewards, by training's inference pass
# ----------------------------------------------------------------------------------------------

def sequence_pairs(source: str, first: list[np.ndarray], second: list[np.ndarray], prompt_lens: list[int],
                   pad_token_id: int | None = None) -> TokenPairs:
    """Pairs of sequences sharing a prompt (item k: first[k], second[k], both starting with its prompt_lens[k]
    prompt tokens) as the engine's TokenPairs, so run_inference scores them as it scores the probe. pad_token_id:
    also the judge's score positions, where transformers' sequence classification reads: the last token whose id
    != pad (in the prompt when the completion is only pad tokens: the reward of the empty completion)."""
    seq_ids = [np.asarray(s, dtype=np.int64) for pair in zip(first, second) for s in pair]
    prompt = np.repeat(np.asarray(prompt_lens, dtype=np.int64), 2)
    score = None
    if pad_token_id is not None:
        score = np.array([int(np.flatnonzero(s != pad_token_id)[-1]) if (s != pad_token_id).any() else 0
                          for s in seq_ids], dtype=np.int64)
    n = len(first)
    return TokenPairs(source=source, pair_ids=[str(k) for k in range(n)], token_hashes=[""] * n,
                      margins=np.full(n, np.nan), seq_ids=seq_ids, seq_prompt_lens=prompt, score_index=score)


def score_pairs(module: nn.Module, pairs: TokenPairs, env, settings) -> np.ndarray:
    """[pairs, 2] float64 from training's inference pass: SequenceLogProbs (summed completion log-probs at
    temperature 1) or SequenceRewards (the judge's score). A score position inside a shared prompt cannot be read
    from the shared layout: such a batch runs unshared."""
    from dataclasses import replace
    from stages.engine.data import run_inference
    if pairs.score_index is not None and (pairs.score_index < pairs.seq_prompt_lens).any():
        settings = replace(settings, share_prompt=False)
    return run_inference(module, pairs, env, settings, desc=pairs.source)
