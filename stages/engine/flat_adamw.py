"""The CUDA-graph step's optimizer: clipped AdamW of MasterWeightAdamW as three Triton kernels over flat buffers.

Why: in the profile of the graphed 0.5B anchor step
(bench/results/step_profile_h200_before/step_profile_train_dpo_graphs_steady.txt) the optimizer
was a quarter of the GPU time: per-tensor foreach norms, a bf16 -> fp32 copy of every gradient into the
masters' gradients, torch's fused AdamW, a fp32 -> bf16 copy of every master back into the model and a
zeroing pass, each a full sweep (~22 GB of traffic per step for 0.5B parameters). Here the bf16
parameters and gradients, the fp32 masters and both moments are each ONE flat buffer (the tensors the
model and the optimizer see are views into them), and a step is
  1. _sumsq_kernel: per-block sums of squares of the flat bf16 gradient,
  2. _clip_kernel (one program): norm, clip divisor, step count + 1, in a fixed order (deterministic), and
     the bias corrections in double precision (as torch's fused AdamW: 1 - 0.999^t in fp32 cancels),
  3. _adamw_kernel per parameter group: read gradient / divisor, master, moments; write master, moments,
     the rounded bf16 parameter and a zeroed gradient: one pass (~15 GB).
The math is torch's AdamW (decoupled decay, bias correction) with clip_grad_norm_'s coefficient, per
element in fp32: equal to MasterWeightAdamW's own step to a few fp32 ulps (tests/test_kernels.py under
Triton's interpreter, tests/test_gpu.py against torch's fused CUDA kernel).

The flat layout is built at the run's first optimizer step (run eagerly by the graph path), from the
parameters that have a gradient then, exactly the ones torch's AdamW would update: existing optimizer
state (a resumed run) is copied in, and optimizer.state keeps per-parameter views, so state_dict() and
checkpoints are those of MasterWeightAdamW. The fp32 gradient copies of the masters are not needed: -2
bytes per parameter of memory.
"""
from __future__ import annotations

import time

import torch

from stages.engine import kernels

ALIGN = 128            # each group's range starts at, and spans, a multiple of this (aligned vector loads)
ADAM_BLOCK = 2048
NORM_BLOCK = 8192


class FlatMasterAdamW:
    """Owns the flat buffers of a MasterWeightAdamW (see the module docstring); `step` replaces
    grads_to_master + clip + optimizer.step() + zero_grad for the graph path."""

    def __init__(self, optimizer, max_grad_norm: float):
        self.optimizer = optimizer
        self.max_grad_norm = float(max_grad_norm)
        device = optimizer.master_params[0].device
        self.norm = torch.zeros((), dtype=torch.float32, device=device)
        self.divisor = torch.ones((), dtype=torch.float32, device=device)
        self.step_count: torch.Tensor | None = None
        self.segments: list[tuple[int, int, int]] | None = None     # (group index, start, end)
        self.hyper: list[tuple[float, float, float, float]] = []    # per segment: beta1, beta2, eps, weight decay
        self.grad = self.param = self.master = self.exp_avg = self.exp_avg_sq = self.partials = self.bias = None

    @staticmethod
    def unsupported(optimizer) -> str | None:
        """Why this optimizer cannot run flat (None: it can)."""
        if not hasattr(optimizer, "master_params"):
            return "not a MasterWeightAdamW (train.precision is not bf16)"
        if not kernels.available(*optimizer.master_params[:1]):
            return "Triton unavailable on this device"
        for g in optimizer.param_groups:
            if g.get("amsgrad") or g.get("maximize") or g.get("differentiable"):
                return "amsgrad / maximize / differentiable AdamW"
        return None

    @staticmethod
    def warm_up(device: torch.device, dtype: torch.dtype) -> float:
        """Compile the three kernels (Triton compiles on first launch) on scratch buffers with the same
        dtypes and specialisations as a run's; returns the seconds spent."""
        t0 = time.perf_counter()
        n = 2 * ALIGN
        g = torch.zeros(n, dtype=dtype, device=device)
        w = torch.zeros(n, dtype=torch.float32, device=device)
        # separate allocations, as a run's scalars are (Triton specialises on pointer alignment)
        norm, divisor, step, lr = (torch.ones((), dtype=torch.float32, device=device) for _ in range(4))
        partials = torch.zeros(1, dtype=torch.float32, device=device)
        bias = torch.tensor([[1.0, 1.0, 0.9, 0.999, 0.0, 0.0]], dtype=torch.float64, device=device)
        for clip in (True, False):
            _launch(g, g.clone(), w, w.clone(), w.clone(), partials, norm, divisor, step, bias, [(0, 0, n)], [lr],
                    [(0.9, 0.999, 1e-8, 0.0)], 1.0 if clip else 0.0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    @torch.no_grad()
    def _build(self) -> None:
        opt = self.optimizer
        model_of = {id(m): p for p, m in zip(opt.model_params, opt.master_params)}
        entries, segments, offset = [], [], 0
        for gi, group in enumerate(opt.param_groups):
            start = offset
            for m in group["params"]:
                p = model_of[id(m)]
                if p.grad is None:           # torch's AdamW skips it too: it stays outside, untouched
                    continue
                entries.append((p, m, offset, p.numel()))
                offset += p.numel()
            offset = -(-offset // ALIGN) * ALIGN
            if offset > start:
                segments.append((gi, start, offset))
        if not entries:
            raise RuntimeError("flat AdamW: no parameter has a gradient at the first optimizer step")
        steps = {float(opt.state[m]["step"]) for _, m, _, _ in entries if opt.state[m]}
        if len(steps) > 1 or (steps and any(not opt.state[m] for _, m, _, _ in entries)):
            raise RuntimeError("flat AdamW: the parameters' optimizer step counts differ (resumed state from "
                               "another run?); one shared step count is required")
        p0, m0 = entries[0][0], entries[0][1]
        self.param = torch.zeros(offset, dtype=p0.dtype, device=p0.device)
        self.grad = torch.zeros(offset, dtype=p0.dtype, device=p0.device)
        self.master = torch.zeros(offset, dtype=torch.float32, device=m0.device)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.step_count = torch.full((), steps.pop() if steps else 0.0, dtype=torch.float32, device=m0.device)
        for p, m, o, n in entries:
            # `.data =` re-points the tensor the model / optimizer already hold (identity, leaf status and
            # the tie of shared weights kept); the old storage is freed as soon as it is copied.
            self.param[o:o + n].copy_(p.reshape(-1))
            p.data = self.param[o:o + n].view_as(p)
            self.grad[o:o + n].copy_(p.grad.reshape(-1))
            p.grad = self.grad[o:o + n].view_as(p)      # backward accumulates in place into this view
            self.master[o:o + n].copy_(m.reshape(-1))
            m.data = self.master[o:o + n].view_as(m)
            m.grad = None
            state = opt.state[m]
            if state:
                self.exp_avg[o:o + n].copy_(state["exp_avg"].reshape(-1))
                self.exp_avg_sq[o:o + n].copy_(state["exp_avg_sq"].reshape(-1))
            state["exp_avg"] = self.exp_avg[o:o + n].view_as(m)
            state["exp_avg_sq"] = self.exp_avg_sq[o:o + n].view_as(m)
            state["step"] = self.step_count
        self.partials = torch.zeros(-(-offset // NORM_BLOCK), dtype=torch.float32, device=m0.device)
        # per segment: beta1^t, beta2^t (t = the step count so far, host doubles), beta1, beta2, and the two
        # bias corrections _clip_kernel writes each step
        groups = [opt.param_groups[gi] for gi, _, _ in segments]
        self.hyper = [(*g["betas"], g["eps"], g["weight_decay"]) for g in groups]
        t = float(self.step_count)
        self.bias = torch.tensor([[b1 ** t, b2 ** t, b1, b2, 0.0, 0.0] for b1, b2, _, _ in self.hyper],
                                 dtype=torch.float64, device=m0.device)
        self.segments = segments

    def step(self, lrs: list[torch.Tensor]) -> torch.Tensor:
        """Clip + AdamW + zero the gradients, no host sync, capturable; returns the (unclipped) gradient
        norm as a 0-dim fp32 device tensor. lrs: one device tensor per parameter group."""
        if self.segments is None:
            self._build()
        _launch(self.grad, self.param, self.master, self.exp_avg, self.exp_avg_sq, self.partials, self.norm,
                self.divisor, self.step_count, self.bias, self.segments, [lrs[gi] for gi, _, _ in self.segments],
                self.hyper, self.max_grad_norm)
        return self.norm

    def release(self) -> None:
        """Drop the gradient views and the flat gradient (the parameters, masters and moments stay views)."""
        opt = self.optimizer
        for p in opt.model_params:
            p.grad = None
        self.grad = None


def _launch(grad, param, master, exp_avg, exp_avg_sq, partials, norm, divisor, step_count, bias, segments, lrs,
            hyper, max_grad_norm: float) -> None:
    n = grad.numel()
    kernels._sumsq_kernel[(partials.numel(),)](grad, partials, n, BLOCK=NORM_BLOCK)
    kernels._clip_kernel[(1,)](partials, partials.numel(), norm, divisor, step_count, bias, bias.shape[0],
                               max_grad_norm, CLIP=max_grad_norm > 0, BLOCK=1024)
    for i, ((_, start, end), lr, (beta1, beta2, eps, wd)) in enumerate(zip(segments, lrs, hyper)):
        sl = slice(start, end)
        kernels._adamw_kernel[(-(-(end - start) // ADAM_BLOCK),)](
            grad[sl], param[sl], master[sl], exp_avg[sl], exp_avg_sq[sl], end - start, lr, bias[i], divisor,
            beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps, wd, BLOCK=ADAM_BLOCK)
