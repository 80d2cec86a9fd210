"""The memory plan: a training run's peak device memory, estimated before any weight is read, from config.json
alone, the train settings and the packed plan's largest micro-batch; logged by part, recorded in run_info.json
(`memory_plan`), and a plan that cannot fit the device is refused naming settings that would fit.

Parameter count (Qwen2 / Qwen3 / Llama / Mistral configs; `tensor_shapes`), per decoder layer, with d = hidden,
H / K = attention / KV heads, h = head_dim (d / H by default), I = intermediate:
    q d.Hh, k and v d.Kh each, o Hh.d; gate, up d.I, down I.d; two RMSNorm weights d
    + biases: Qwen2 q/k/v (Hh + 2Kh); Llama/Mistral/Qwen3 with attention_bias q/k/v/o (Hh + 2Kh + d), mlp_bias
      (2I + d); Qwen3 q_norm and k_norm (2h)
  + embedding V.d + final norm d + the head: a causal LM's LM head V.d unless tied to the embedding; a reward
    model's scalar `score` d (no LM head). tests/engine/test_memory_plan.py checks it against real models' numel.

Bytes (n = trainable parameters, N = all; b = 2 under precision bf16 on one device, else 4):
  weights   N.b (FSDP2: fp32 shards, N.4 / world, plus one gathered bf16 block at a time)
  grads     n.b; exact mode's eager MasterWeightAdamW adds an fp32 copy (n.4) (the CUDA-graph path's flat AdamW
            reads the bf16 gradient directly); fused_backward: only the largest trainable tensor's gradient lives
  masters   n.4 for fp32_master_8bit and exact over bf16 weights; 0 for bf16_sr_8bit, autocast, FSDP2 (the fp32
            weights are the masters)
  moments   exact n.8; 8-bit modes: one byte each for m and sqrt(v) plus an fp32 scale per 128 values, per tensor
  activations, per token of the largest micro-batch (T tokens), in the compute dtype (a bytes):
            a layer that keeps its activations: a (7d + 2Kh + 3I) (its saved inputs: two norm inputs and outputs,
            q, k, v, the attention output, gate|up and silu(gate) * up; 4.6 MB a token at 7B in bf16, as measured
            in bench/results/h200_7b_ea0d2f0), a checkpointed one a d (its input) + a 2h (cos, sin), plus one
            layer's full set while it is recomputed in backward; the LM head's log-prob chunk (C = min(chunk,
            T) positions): C V (2a + 8) (bf16 logits, fp32 log-softmax and their gradients); the hidden states a T d.
  transient the largest of these moments, beyond static + activations (none of them has activations alive):
            - the model load (loop.build_run): N.4 read in fp32 (FSDP2: on every rank, before sharding), cast to bf16
              a tensor at a time; the trained tensors' fp32 values stay alive as the masters' source until the
              optimizer cloned them: max(N.4 + 2 x the largest tensor, N.2 + n.8 with masters);
            - the CUDA-graph path's flat-buffer build (after the first backward): the masters' new flat copy beside
              the old tensors (fp32_master_8bit with small micro-batches: weights + grads + 2 x masters);
            - the eager 8-bit step on a GPU over bf16 gradients: one fp32 copy of a gradient for the norm.
            The export allocates nothing on the device (host copies a tensor at a time: export.host_state_dict).
            8-bit modes on a GPU also keep 8 bytes per 128 values of kernel tables (counted in moments);
            fused_backward's hook takes an fp32 copy of the gradient for the norm (counted in grads).
  overhead  1 GiB (CUDA context, cuBLAS workspaces) + 5% of the rest (allocator fragmentation and the CUDA graphs'
            private pools). It holds because every engine process runs the allocator with expandable segments
            (dist.configure_cuda_allocator): without them a 7B bf16_sr_8bit run on an 80 GB card stranded 28.4 GiB
            reserved but unallocated and died in graph capture. tests/engine/test_gpu.py holds the plan to the
            allocator's reserved peak (what the card holds), not only to the allocated one.
The plan is an estimate: the fit test leaves the overhead margin; the GPU bench reports planned vs measured peaks
(the 7B preset on an H100 80GB: plan 66.3 GiB, 56.3 allocated, 60.3 reserved; bench/results/h100_issue40_a8a8a50).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from stages.engine.settings import TrainConfigError, TrainSettings

GIB = 2 ** 30
FAMILIES = ("qwen2", "qwen3", "llama", "mistral")
FIXED_OVERHEAD = GIB
FRAGMENTATION = 0.05
BLOCK = 128                       # stages/engine/lowbit_adamw.py's quantization block


class MemoryPlanError(TrainConfigError):
    """The plan cannot fit the device."""


def read_config(model_dir) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def _dims(cfg: dict) -> dict:
    d, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    hd = int(cfg.get("head_dim") or d // heads)
    kv = int(cfg.get("num_key_value_heads") or heads)
    return {"d": d, "H": heads, "K": kv, "h": hd, "I": int(cfg["intermediate_size"]),
            "L": int(cfg["num_hidden_layers"]), "V": int(cfg["vocab_size"])}


def tensor_shapes(cfg: dict, head: str) -> list[tuple[str, int]]:
    """(name, numel) of every parameter tensor of the model (config.json as a dict); head lm_head | score."""
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"no parameter count for model_type {family!r} (known: {', '.join(FAMILIES)})")
    x = _dims(cfg)
    d, hq, hk, inter = x["d"], x["H"] * x["h"], x["K"] * x["h"], x["I"]
    layer = [("q_proj", d * hq), ("k_proj", d * hk), ("v_proj", d * hk), ("o_proj", hq * d),
             ("gate_proj", d * inter), ("up_proj", d * inter), ("down_proj", inter * d),
             ("input_layernorm", d), ("post_attention_layernorm", d)]
    attention_bias = family == "qwen2" or bool(cfg.get("attention_bias"))
    if attention_bias:
        layer += [("q_proj.bias", hq), ("k_proj.bias", hk), ("v_proj.bias", hk)]
        if family != "qwen2":
            layer += [("o_proj.bias", d)]
    if family != "qwen2" and cfg.get("mlp_bias"):
        layer += [("gate_proj.bias", inter), ("up_proj.bias", inter), ("down_proj.bias", d)]
    if family == "qwen3":
        layer += [("q_norm", x["h"]), ("k_norm", x["h"])]
    shapes = [("embed_tokens", x["V"] * d)]
    for i in range(x["L"]):
        shapes += [(f"layers.{i}.{n}", k) for n, k in layer]
    shapes.append(("norm", d))
    if head == "score":
        shapes.append(("score", d))
    elif not cfg.get("tie_word_embeddings", family != "llama" and family != "mistral"):
        shapes.append(("lm_head", x["V"] * d))
    return shapes


def lora_shapes(cfg: dict, adapter: dict, head: str) -> list[tuple[str, int]]:
    """Trainable tensors under train.adapter (LoRA A and B per targeted Linear; a reward model's score head)."""
    x = _dims(cfg)
    d, hq, hk, inter = x["d"], x["H"] * x["h"], x["K"] * x["h"], x["I"]
    dims = {"q_proj": (d, hq), "k_proj": (d, hk), "v_proj": (d, hk), "o_proj": (hq, d), "gate_proj": (d, inter),
            "up_proj": (d, inter), "down_proj": (inter, d)}
    r = int(adapter["r"])
    out = []
    for i in range(x["L"]):
        for t in adapter["target_modules"]:
            if t in dims:
                fan_in, fan_out = dims[t]
                out += [(f"layers.{i}.{t}.lora_A", r * fan_in), (f"layers.{i}.{t}.lora_B", r * fan_out)]
    if head == "score":
        out.append(("score", d))
    return out


@dataclass(frozen=True)
class MemoryPlan:
    parameters: int
    trainable: int
    micro_batch_tokens: int           # the largest micro-batch of the plan
    checkpointed_layers: int
    layers: int
    weights: int                      # bytes, per device
    grads: int
    masters: int
    moments: int
    activations: int
    transient: int                    # the flat optimizer's build beyond the rest (fp32_master_8bit's masters copy)
    overhead: int
    device_bytes: int | None          # None: a CPU run (nothing to fit)

    @property
    def total(self) -> int:
        return (self.weights + self.grads + self.masters + self.moments + self.activations + self.transient
                + self.overhead)

    def record(self) -> dict:
        return {**asdict(self), "total": self.total, "fits": self.fits}

    @property
    def fits(self) -> bool | None:
        return None if self.device_bytes is None else self.total <= self.device_bytes

    def describe(self) -> str:
        unit, size = ("GiB", GIB) if self.total >= GIB else ("MiB", 2 ** 20)
        parts = ", ".join(f"{k} {getattr(self, k) / size:.2f}" for k in
                          ("weights", "grads", "masters", "moments", "activations", "transient", "overhead"))
        return f"{self.total / size:.2f} {unit} ({parts} {unit})"


def estimate(cfg: dict, head: str, settings: TrainSettings, micro_batch_tokens: int, world_size: int = 1,
             device_bytes: int | None = None, device_type: str = "cuda", graphed: bool = False) -> MemoryPlan:
    """The plan's parts (module docstring). graphed: the step runs as CUDA graphs (the flat AdamW: no fp32
    gradient copy in exact mode)."""
    shapes = tensor_shapes(cfg, head)
    trainable_shapes = lora_shapes(cfg, settings.adapter, head) if settings.adapter else shapes
    n_all = sum(k for _, k in shapes)
    n_train = sum(k for _, k in trainable_shapes)
    x = _dims(cfg)
    fsdp = settings.parallel == "fsdp2"
    state = settings.optimizer_state
    # the dtype the trained weights are held in (dist.compute_dtype; FSDP2 keeps fp32 shards, but casts them to
    # bf16 itself for bf16_sr_8bit, which has no master)
    b = 2 if settings.precision == "bf16" and (not fsdp or state == "bf16_sr_8bit") else 4
    shard = world_size if fsdp else 1
    if settings.adapter:                 # the frozen base plus the adapters, all in the compute dtype
        weights = (n_all + n_train - (x["d"] if head == "score" else 0)) * b
    else:
        weights = n_all * b
    weights = weights // shard
    if settings.fused_backward:
        grads = max(k for _, k in trainable_shapes) * (b + (4 if state == "exact" and b == 2 else 0))
    else:
        grads = n_train * b // shard + (n_train * 4 if state == "exact" and b == 2 and not graphed else 0)
    masters = n_train * 4 // shard if b == 2 and state in ("exact", "fp32_master_8bit") else 0
    if state == "exact":
        moments = n_train * 8 // shard
    else:
        moments = sum(2 * k + 2 * 4 * math.ceil(k / BLOCK) for _, k in trainable_shapes) // shard
    a = 2 if settings.precision == "bf16" or device_type == "cuda" else 4
    d, kv, inter, layers = x["d"], x["K"] * x["h"], x["I"], x["L"]
    t = micro_batch_tokens
    per_layer = a * (7 * d + 2 * kv + 3 * inter)
    ckpt = settings.checkpointed_layers(layers)
    act = t * ((layers - ckpt) * per_layer + ckpt * a * (d + 2 * x["h"]) + a * d)
    if ckpt:
        act += t * per_layer                     # the layer being recomputed
    if head == "lm_head":
        c = min(settings.logp_chunk_tokens, t)
        act += c * x["V"] * (2 * a + 8)
    big = max(k for _, k in trainable_shapes)
    if state != "exact" and device_type == "cuda":
        # the GPU kernel's per-block hash inputs (parameter ordinal, first index: two int32 a block; LowBitAdamW's
        # eager tables or FlatLowBitAdamW's), made at the first step and kept
        moments += sum(8 * math.ceil(k / BLOCK) for _, k in trainable_shapes) // shard
    if settings.fused_backward and b == 2:
        grads += big * 4                         # the hook's fp32 copy of the gradient, for the logged norm
    static = weights + grads + masters + moments
    # Transients beside the steady state (static + activations), each at a time no activation is alive:
    phases = [0]
    # The model load (loop.build_run): read in fp32 (FSDP2: the whole model on every rank, before fully_shard) and
    # cast to bf16 there one tensor at a time (a tensor's fp32 and bf16 values together), the trained tensors' fp32
    # values kept until the optimizer has cloned them into its masters (optim).
    n_model = weights * shard // b
    largest = max(k for _, k in shapes)
    if b == 2:
        phases.append(max(n_model * 4 + largest * 2, n_model * 2 + (n_train * 8 if masters else 0)))
    else:
        phases.append(n_model * 4)
    # The CUDA-graph path builds its flat buffers after the first backward (activations freed), one kind at a
    # time, each new buffer beside the tensors it replaces: the masters' copy is the largest (flat_adamw).
    if graphed and not settings.fused_backward:
        phases.append(weights + grads + masters + max(masters, weights))
    if state != "exact" and device_type == "cuda" and not graphed and b == 2 and not fsdp and not settings.fused_backward:
        # the eager step's gradient norm (optim.fp32_grad_norm) takes one fp32 copy of a gradient at a time
        phases.append(static + big * 4)
    transient = max(0, max(phases) - static - act)
    base = static + act + transient
    overhead = (FIXED_OVERHEAD if device_type == "cuda" else 0) + int(FRAGMENTATION * base)
    return MemoryPlan(parameters=n_all, trainable=n_train, micro_batch_tokens=t, checkpointed_layers=ckpt,
                      layers=layers, weights=weights, grads=grads, masters=masters, moments=moments, activations=act,
                      transient=transient, overhead=overhead, device_bytes=device_bytes)


def fewest_checkpointed(cfg: dict, head: str, settings: TrainSettings, micro_batch_tokens: int, world_size: int,
                        device_bytes: int | None, device_type: str, graphed: bool) -> MemoryPlan:
    """train.activation_checkpointing: auto -> the plan with the fewest checkpointed (first) layers that fits the
    device (none where nothing is to fit: CPU), or with every layer checkpointed when none fits (check_fits then
    refuses it)."""
    layers = _dims(cfg)["L"]
    for n in range(layers + 1):
        plan = estimate(cfg, head, replace(settings, activation_checkpointing=n), micro_batch_tokens, world_size,
                        device_bytes, device_type, graphed)
        if plan.fits is not False:
            return plan
    return plan


def alternatives(cfg: dict, head: str, settings: TrainSettings, micro_batch_tokens: int, world_size: int,
                 device_bytes: int, device_type: str, graphed: bool, limit: int = 4) -> list[tuple[str, MemoryPlan]]:
    """Settings that would fit, least change first: activation checkpointing of as few layers as needed, then each
    lower-precision optimizer state (with as few checkpointed layers as it needs), then fused_backward."""
    layers = _dims(cfg)["L"]
    found = []

    def first_fit(base: TrainSettings, label: str) -> None:
        for n in [settings.checkpointed_layers(layers)] + list(range(settings.checkpointed_layers(layers) + 1,
                                                                     layers + 1)):
            s = replace(base, activation_checkpointing=n if n < layers else True)
            plan = estimate(cfg, head, s, micro_batch_tokens, world_size, device_bytes, device_type, graphed)
            if plan.fits:
                extra = f"train.activation_checkpointing: {s.activation_checkpointing}" if n else ""
                found.append((", ".join(p for p in (label, extra) if p), plan))
                return

    first_fit(settings, "")
    for state in ("fp32_master_8bit", "bf16_sr_8bit"):
        if state != settings.optimizer_state:
            opt = {**(settings.optimizer or {}), "state": state}
            label = f"train.optimizer.state: {state}" + (", train.precision: bf16" if settings.precision != "bf16"
                                                         and state == "bf16_sr_8bit" else "")
            first_fit(replace(settings, optimizer=opt, precision="bf16" if state == "bf16_sr_8bit" else settings.precision),
                      label)
    if not settings.fused_backward and world_size == 1:
        opt = {**(settings.optimizer or {"state": "exact"}), "fused_backward": True}
        first_fit(replace(settings, optimizer=opt, max_grad_norm=0.0),
                  "train.optimizer.fused_backward: true, train.max_grad_norm: 0")
    return [f for f in found if f[0]][:limit]


def check_fits(plan: MemoryPlan, cfg: dict, head: str, settings: TrainSettings, world_size: int, device_type: str,
               graphed: bool, device_name: str = "the device") -> None:
    """Refuse a plan over the device's memory, naming settings that fit (one line)."""
    if plan.fits is not False:
        return
    alts = alternatives(cfg, head, settings, plan.micro_batch_tokens, world_size, plan.device_bytes, device_type,
                        graphed)
    fix = ("; would fit: " + "; ".join(f"{label} ({p.total / GIB:.1f} GiB)" for label, p in alts) if alts else
           "; no optimizer-state or checkpointing setting fits: lower train.micro_batch_tokens, use train.adapter "
           "or more GPUs with train.parallel: fsdp2")
    raise MemoryPlanError(f"memory plan {plan.describe()} exceeds {device_name}'s {plan.device_bytes / GIB:.1f} GiB "
                          f"(train.optimizer.state {settings.optimizer_state}, activation checkpointing "
                          f"{plan.checkpointed_layers}/{plan.layers} layers, micro-batch {plan.micro_batch_tokens} "
                          f"tokens){fix}")
