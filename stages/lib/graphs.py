"""CUDA graphs for the training step: capture once per padded batch shape, replay for every batch.

Why: an eager DPO step on a 0.5B model issues thousands of small kernels and the host takes longer to
queue them than the GPU takes to run them (bench/results/step_profile_h200_before/summary_train_dpo_eager.json,
~210 ms a step with the profiler on vs 28 ms of kernels): it is launch-bound.
A replayed graph queues the whole forward + backward in one call.

How (the trainer decides what runs; this module owns capture and replay):
  - every micro-batch is padded to one of a few shapes planned from the whole run
    (packing.plan_padded_shapes / pad_packed_batch), so each shape has static input buffers that
    the next batch is copied into (host->device, non-blocking) before a replay;
  - one graph per shape runs `fwd_bwd(static_batch)` (forward, loss, backward: gradients
    ACCUMULATE into the parameters' persistent .grad tensors, so several micro-batches per step
    work as in eager mode); one more graph runs `optimizer_step()` (clip, AdamW with the learning
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

import time
from typing import Callable

import torch

from stages.lib.packing import PackedBatch


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
                graph.capture_end()
        self.captures += 1
        self.capture_seconds += time.perf_counter() - t0
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
                "capture_seconds": round(self.capture_seconds, 3), "eager_step_seconds": round(self.eager_step_seconds, 3)}
