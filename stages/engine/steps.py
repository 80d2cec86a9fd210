"""One optimizer step, two ways, behind one interface: `step(n_micro, n_mine, batches, scale)` -> the step's
[metric sums..., grad norm] on the device, `pad_to` (the shape each batch is padded to, or None),
`loop_context()`, `finish()` -> run_info's `cuda_graphs`.

- EagerSteps: forward/backward per micro-batch, clip, AdamW; what every run but one kind takes.
- GraphedSteps: one process on a GPU; every micro-batch padded to one of a few planned shapes, and the step
  replayed as CUDA graphs (StepGraphs below), the optimizer step included (graphed_optimizer_step; under
  train.precision bf16 the flat Triton AdamW of stages/engine/flat_adamw.py).

CUDA graphs, why and how (StepGraphs):
  Why: an eager DPO step on a 0.5B model issues thousands of small kernels and the host takes longer to
  queue them than the GPU takes to run them (bench/results/step_profile_h200_before/summary_train_dpo_eager.json,
  ~210 ms a step with the profiler on vs 28 ms of kernels): it is launch-bound.
  A replayed graph queues the whole forward + backward in one call.

  How (the trainer decides what runs; this module owns capture and replay):
    - every micro-batch is padded to one of a few shapes planned from the whole run
      (padded_shapes.plan_padded_shapes / pad_packed_batch), so each shape has static input buffers that
      the next batch is copied into (host->device, non-blocking) before a replay;
    - one graph per shape runs `fwd_bwd(static_batch)` (forward, loss, backward: gradients
      ACCUMULATE into the parameters' persistent .grad tensors, so several micro-batches per step
      work as in eager mode; the flat optimizer marks them, and the weight GEMMs then add into them
      directly: modeling.mark_grad_accumulators); one more graph runs `optimizer_step()` (clip, AdamW with the learning
      rate read from a device tensor, zero the gradients);
    - the first optimizer step of the run runs eagerly (it allocates the gradients and the optimizer
      state and warms up cuBLAS and the allocator on the capture stream), later ones replay;
    - all graphs share one memory pool: nothing a graph produces is read after another graph ran
      (gradients, metric sums and the log row live outside the pool, in tensors made before capture),
      so the pool holds about one step's activations, not one per shape;
    - capture uses thread-local error mode: the batch-prefetch thread pins host memory meanwhile.
  Everything runs on one side stream (`stream`), which the caller enters for the whole loop.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from stages.engine.data import filler_batch, model_inputs
from stages.engine.dist import DistEnv, autocast, gradient_sync
from stages.engine.lowbit_adamw import LowBitAdamW
from stages.engine.optim import (FusedBackwardStep, MasterWeightAdamW, adamw_step_lr_tensor, fp32_grad_norm,
                                 total_grad_norm)
from stages.engine.settings import TrainSettings
from stages.engine.packing import MicroBatch, PackedBatch, TokenPairs
from stages.engine.padded_shapes import batch_dims, capture_cost_batches, plan_padded_shapes, shared_prompt_flags


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
    # Activation checkpointing is captured: the layers recompute without saving or restoring RNG state
    # (loop.enable_activation_checkpointing; dropout is off, and adapter dropout is refused just below).
    if settings.fused_backward:
        return "train.optimizer.fused_backward (its per-parameter steps run in backward hooks, eagerly)"
    if settings.optimizer_state != "exact":
        from stages.engine import kernels
        if kernels.triton is None:
            return f"train.optimizer.state {settings.optimizer_state} graphs through Triton, which is not importable"
    if settings.adapter and settings.adapter["dropout"] > 0:
        return "train.adapter.dropout > 0 (the dropout masks' RNG is not captured)"
    return None


class EagerSteps:
    """The eager step (CPU, several processes, FSDP2, compile, activation checkpointing, or cuda_graphs 0):
    forward/backward per micro-batch (a rank with fewer micro-batches than others runs zero-weight fillers,
    so collectives line up; gradients sync on the last one), clip, AdamW, one all_reduce of the metric sums."""

    pad_to = None

    def __init__(self, model, objective, optimizer, settings: TrainSettings, env: DistEnv, filler: PackedBatch,
                 reason: str, module: nn.Module | None = None):
        self.model, self.objective, self.optimizer, self.settings, self.env = model, objective, optimizer, settings, env
        self.filler = filler
        self.info = {"enabled": False, "reason": reason}
        if isinstance(optimizer, LowBitAdamW) and env.device.type == "cuda":
            # its per-tensor kernel's variants compile here, not inside the first timed step
            self.info["optimizer"] = {"kind": "triton_adamw_8bit_per_tensor",
                                      "warmup_seconds": round(optimizer.warm_up_cuda(), 3)}
        # train.optimizer.fused_backward: the step runs inside backward (one micro-batch a step, no clip, one
        # process: optim.check_optimizer_settings refused the rest before the model was loaded)
        self.fused = FusedBackwardStep(optimizer, module if module is not None else model) if settings.fused_backward else None

    def loop_context(self):
        return contextlib.nullcontext()

    def step(self, n_micro: int, n_mine: int, batches: Iterator[PackedBatch], scale: float) -> torch.Tensor:
        """One optimizer step: this rank's n_mine batches (then fillers up to n_micro) -> [metric sums..., grad norm]."""
        env, settings, optimizer = self.env, self.settings, self.optimizer
        sums = torch.zeros(len(self.objective.metric_names), dtype=torch.float64, device=env.device)
        if self.fused is not None:
            self.fused.begin()
        for k in range(n_micro):
            batch = next(batches).to(env.device, non_blocking=True) if k < n_mine else self.filler
            with gradient_sync(self.model, settings, enabled=k == n_micro - 1):
                forward_backward(self.model, self.objective, settings, env, batch, scale, sums)
        if self.fused is not None:             # every parameter was stepped inside backward
            grad_norm = self.fused.grad_norm()
            torch._assert_async(torch.isfinite(grad_norm), "non-finite gradient norm")
        elif isinstance(optimizer, LowBitAdamW):
            # the norm of the model's gradients, unscaled (max_norm 0 = none); the clip divides inside the update
            grad_norm = fp32_grad_norm(list(self.model.parameters()))
            torch._assert_async(torch.isfinite(grad_norm), "non-finite gradient norm")
            divisor = (1.0 / torch.clamp(settings.max_grad_norm / (grad_norm + 1e-6), max=1.0)
                       if settings.max_grad_norm > 0 else None)
            optimizer.step(grad_divisor=divisor)
            optimizer.zero_grad(set_to_none=True)
        else:
            if isinstance(optimizer, MasterWeightAdamW):
                optimizer.grads_to_master()        # clip the fp32 master gradients
                grad_norm = total_grad_norm(optimizer.master_params, settings.max_grad_norm)
            else:
                grad_norm = total_grad_norm(self.model.parameters(), settings.max_grad_norm)
            torch._assert_async(torch.isfinite(grad_norm), "non-finite gradient norm")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(sums)
        return torch.cat([sums, grad_norm.detach().reshape(1).to(sums)])

    def finish(self) -> dict:
        if self.fused is not None:
            self.fused.remove()
        return self.info


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
    """The CUDA-graph step (one process on a GPU; StepGraphs below captures and replays).

    Pads every micro-batch of the run to one of at most train.cuda_graphs shapes planned from the run's
    own micro-batch sizes (the LM head's cost per log-prob token weighs log-prob padding), and runs each
    step as forward_backward per micro-batch + graphed_optimizer_step over static device tensors: the
    loss scale, the metric sums, the step's log row and one learning-rate tensor per parameter group."""

    def __init__(self, model, module, hf, objective, optimizer, settings: TrainSettings, env: DistEnv,
                 pairs: TokenPairs, micro_batches: list[MicroBatch], n_params: int):
        head = hf.get_output_embeddings() if objective.head == "lm_head" else None
        logp_weight = head.weight.numel() / max(1, n_params - head.weight.numel()) if head is not None else 0.0
        flags = shared_prompt_flags(pairs, settings.share_prompt)
        dims = [batch_dims(pairs, mb, flags) for mb in micro_batches]
        layers = getattr(hf.config, "num_hidden_layers", None) or 1
        shapes, shape_of = plan_padded_shapes(dims, settings.cuda_graphs, logp_weight,
                                              capture_cost_batches(n_params, layers))
        self.pad_to = [shapes[a] for a in shape_of]
        self.shape_ids = iter(shape_of)
        self.optimizer, self.module, self.env = optimizer, module, env
        device = env.device
        self.scale = torch.zeros((), dtype=torch.float64, device=device)
        self.sums = torch.zeros(len(objective.metric_names), dtype=torch.float64, device=device)
        self.row = torch.zeros(len(objective.metric_names) + 1, dtype=torch.float64, device=device)
        self.lrs = [torch.zeros((), dtype=torch.float32, device=device) for _ in optimizer.param_groups]
        from stages.engine.flat_adamw import FlatLowBitAdamW, FlatMasterAdamW
        if isinstance(optimizer, LowBitAdamW):      # the low-bit modes step only through their flat kernel
            why_not_flat = FlatLowBitAdamW.unsupported(optimizer)
            if why_not_flat is not None:
                raise RuntimeError(f"train.optimizer.state {optimizer.state_mode} under CUDA graphs: {why_not_flat}")
            self.flat = FlatLowBitAdamW(optimizer, settings.max_grad_norm)
            dtype = optimizer.model_params[0].dtype
            flat_warmup_s = FlatLowBitAdamW.warm_up(device, dtype, optimizer.master_params is not None,
                                                    optimizer.state_mode == "bf16_sr_8bit" and dtype == torch.bfloat16,
                                                    FlatLowBitAdamW.planned_sizes(optimizer))
            kind = "flat_triton_adamw_8bit"
        else:
            why_not_flat = FlatMasterAdamW.unsupported(optimizer)
            self.flat = FlatMasterAdamW(optimizer, settings.max_grad_norm) if why_not_flat is None else None
            flat_warmup_s = (FlatMasterAdamW.warm_up(device, optimizer.model_params[0].dtype,
                                                     FlatMasterAdamW.planned_sizes(optimizer)) if self.flat else 0.0)
            kind = "flat_triton_adamw"
        self.graphs = StepGraphs(
            device, fwd_bwd=lambda b: forward_backward(model, objective, settings, env, b, self.scale, self.sums),
            optimizer_step=lambda: graphed_optimizer_step(optimizer, module, settings, self.lrs, self.sums, self.row,
                                                          self.flat))
        self.info = {"enabled": True, "shapes": [asdict(s) for s in shapes],
                     "padded_tokens": int(sum(s.tokens for s in self.pad_to)),
                     "real_tokens": int(sum(d.tokens for d in dims)),
                     "optimizer": ({"kind": kind, "warmup_seconds": round(flat_warmup_s, 3)}
                                   if self.flat else {"kind": "torch_fused_adamw", "why_not_flat": why_not_flat})}
        self.graphs.stream.wait_stream(torch.cuda.current_stream(device))   # the model and state were made there

    def loop_context(self):
        """The loop runs on the graphs' side stream."""
        return torch.cuda.stream(self.graphs.stream)

    def step(self, n_micro: int, n_mine: int, batches: Iterator[PackedBatch], scale: float) -> torch.Tensor:
        """One optimizer step over the next n_micro (padded) batches -> [metric sums..., grad norm] (device).
        One process: n_mine == n_micro (no fillers)."""
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


def make_steps(model, module, hf, objective, optimizer, settings: TrainSettings, env: DistEnv, pairs: TokenPairs,
               micro_batches: list[MicroBatch], n_params: int) -> EagerSteps | GraphedSteps:
    """The step this run takes: graphed when it can be (cuda_graphs_unavailable says why not), else eager."""
    reason = cuda_graphs_unavailable(settings, env)
    if reason is None:
        return GraphedSteps(model, module, hf, objective, optimizer, settings, env, pairs, micro_batches, n_params)
    return EagerSteps(model, objective, optimizer, settings, env, filler_batch(pairs, settings.share_prompt).to(env.device),
                      reason, module)


# ----------------------------------------------------------------------------------------------
# Capture and replay
# ----------------------------------------------------------------------------------------------

class StepGraphs:
    def __init__(self, device: torch.device, fwd_bwd: Callable[[PackedBatch], None], optimizer_step: Callable[[], None]):
        self.device = device
        self.fwd_bwd = fwd_bwd
        self.optimizer_step_fn = optimizer_step
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.static: dict[int, PackedBatch] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.optimizer_graph: torch.cuda.CUDAGraph | None = None
        self.steps_done = 0
        self.captures = 0
        self.replays = 0
        self.capture_seconds = 0.0          # host time spent capturing (the graphs' one-off cost)
        self.instantiate_seconds = 0.0      # the part of it in capture_end: ending the capture, instantiating
        self.eager_step_seconds = 0.0       # the first (eager) step, first-use costs of the backward included
        self._t_first = None

    def _capture(self, fn, *args) -> torch.cuda.CUDAGraph:
        # capture_begin/end directly: torch.cuda.graph() would also synchronize the device and empty the
        # device and pinned-host caches before every capture, which costs each capture a full pipeline
        # drain and re-allocation, and empties the prefetch thread's pinned buffers for nothing.
        t0 = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                fn(*args)
            finally:
                t1 = time.perf_counter()
                graph.capture_end()
        t2 = time.perf_counter()
        self.captures += 1
        self.capture_seconds += t2 - t0
        self.instantiate_seconds += t2 - t1
        return graph

    def micro_batch(self, shape_id: int, host_batch: PackedBatch) -> None:
        """Copy a padded batch into its shape's static buffers, then run (eager on the first step, else
        replay; the first batch of a shape after the first step is captured, then replayed)."""
        static = self.static.get(shape_id)
        if static is None:
            static = self.static[shape_id] = host_batch.to(self.device, non_blocking=True)
        else:
            for name in PackedBatch._TENSORS:
                dst, src = getattr(static, name), getattr(host_batch, name)
                if (dst is None) != (src is None) or (dst is not None and dst.shape != src.shape):
                    raise RuntimeError(f"batch does not match graph shape {shape_id}: {name}")
                if dst is not None:
                    dst.copy_(src, non_blocking=True)
        del host_batch
        if self.steps_done == 0:
            if self._t_first is None:
                self._t_first = time.perf_counter()
            self.fwd_bwd(static)
            return
        if shape_id not in self.graphs:
            self.graphs[shape_id] = self._capture(self.fwd_bwd, static)
        self.graphs[shape_id].replay()
        self.replays += 1

    def optimizer_step(self) -> None:
        if self.steps_done == 0:
            self.optimizer_step_fn()
            # One sync, once: the eager step is host-bound, so the GPU is nearly done anyway.
            torch.cuda.current_stream(self.device).synchronize()
            self.eager_step_seconds = time.perf_counter() - (self._t_first or time.perf_counter())
        else:
            if self.optimizer_graph is None:
                self.optimizer_graph = self._capture(self.optimizer_step_fn)
            self.optimizer_graph.replay()
        self.steps_done += 1

    def release(self) -> None:
        """Drop graphs and static buffers (their pool memory returns to the allocator)."""
        self.graphs.clear()
        self.optimizer_graph = None
        self.static.clear()

    def summary(self) -> dict:
        return {"shapes_captured": len(self.graphs), "captures": self.captures, "replays": self.replays,
                "capture_seconds": round(self.capture_seconds, 3),
                "instantiate_seconds": round(self.instantiate_seconds, 3),
                "eager_step_seconds": round(self.eager_step_seconds, 3)}
