"""Both optimizers and the learning rate.

- AdamW (torch's fused kernel, on CUDA and CPU) over the module's parameters, weight decay on matrices only;
- MasterWeightAdamW: AdamW over fp32 master copies of bf16 weights (train.precision bf16);
- the flat Triton AdamW of the CUDA-graph path lives in stages/engine/flat_adamw.py (it takes one of these over);
- the low-precision modes of train.optimizer.state (LowBitAdamW, stages/engine/lowbit_adamw.py), built here;
- fused_backward: each parameter's step inside backward (FusedBackwardStep), and the refusals of what it cannot do;
- LRSchedule: HF-style warmup + cosine/linear/constant, set directly on the groups each step;
- adamw_step_lr_tensor: the fused AdamW update reading its learning rate from a device tensor (capturable).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from stages.engine.dist import DistEnv
from stages.engine.lowbit_adamw import LowBitAdamW
from stages.engine.settings import TrainConfigError, TrainSettings


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW over fp32 master copies of a module's bf16 parameters (train.precision bf16 without FSDP2).

    Forward and backward run on the bf16 parameters (no per-op casts); before the step the bf16
    gradients are copied into the fp32 masters' gradients (`grads_to_master`, where clipping then
    happens), AdamW updates the masters in fp32, and the masters are copied back to bf16. So an update
    smaller than bf16's resolution still accumulates (pure bf16 AdamW, as a bf16 model under HF Trainer,
    silently drops it). state_dict() carries the masters: a resume restores them exactly.
    """

    def __init__(self, groups: list[dict], masters: dict[int, torch.Tensor], **kw):
        """masters: id(param) -> its fp32 value, taken BEFORE the module was cast to bf16."""
        self.model_params = [p for g in groups for p in g["params"]]
        masters = {id(p): masters[id(p)].detach().float().clone().requires_grad_(True) for p in self.model_params}
        super().__init__([{**g, "params": [masters[id(p)] for p in g["params"]]} for g in groups], **kw)
        self.master_params = [masters[id(p)] for p in self.model_params]

    @torch.no_grad()
    def grads_to_master(self) -> None:
        dst, src = [], []                      # one foreach copy (few launches) instead of one per tensor
        for p, m in zip(self.model_params, self.master_params):
            if p.grad is None:
                m.grad = None
            elif m.grad is None:
                m.grad = p.grad.float()
            else:
                dst.append(m.grad)
                src.append(p.grad)
        if dst:
            torch._foreach_copy_(dst, src)

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        torch._foreach_copy_(self.model_params, self.master_params)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:            # the masters' gradient buffers are reused, overwritten each step
            p.grad = None

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["master_params"] = [m.detach().clone() for m in self.master_params]
        # flat_adamw shares one step tensor between all parameters: a state_dict loaded back on the same
        # device would keep that sharing, and torch's AdamW, which increments each parameter's own step,
        # would count one step per parameter.
        sd["state"] = {i: {**st, "step": st["step"].clone()} if "step" in st else st for i, st in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_params", None)
        if masters is None or len(masters) != len(self.master_params):
            raise ValueError("optimizer state has no fp32 master weights for this model (saved with another "
                             "train.precision?)")
        with torch.no_grad():
            for m, saved in zip(self.master_params, masters):
                m.copy_(saved)
            torch._foreach_copy_(self.model_params, self.master_params)
        super().load_state_dict(state_dict)


def trained_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The model parameters an optimizer trains, in its groups' order: our optimizers' `model_params` (the bf16
    working weights where it keeps fp32 masters), else the parameters of its groups (torch's AdamW, which the exact
    mode over fp32 or autocast weights uses, has no `model_params`: an export that assumed one failed at the end of
    every `precision: autocast` GPU run)."""
    own = getattr(optimizer, "model_params", None)
    return list(own) if own is not None else [p for g in optimizer.param_groups for p in g["params"]]


def build_optimizer(module: nn.Module, settings: TrainSettings, env: DistEnv,
                    masters: dict[int, torch.Tensor] | None = None) -> torch.optim.AdamW:
    decay = [p for p in module.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in module.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # Fused on the CPU too, not only for speed: torch's unfused CPU AdamW takes exp_avg_sq.sqrt() through MKL's
    # vector math (VML), whose float sqrt is not correctly rounded and differs between Intel and AMD processors
    # even under the portable pin (MKL_CBWR covers BLAS, not VML): the same run trained different bytes on an
    # AMD EPYC and an Intel Xeon. The fused kernel is an ATen kernel, the same on every x86-64 CPU
    # under ATEN_CPU_CAPABILITY=default (tests/engine/test_portable_numerics.py replays it under an emulated AMD CPU).
    kw = dict(lr=settings.lr, betas=settings.adam_betas, fused=env.device.type in ("cuda", "cpu"))
    if settings.optimizer_state != "exact":
        # masters: only fp32_master_8bit over bf16 weights keeps them (bf16_sr_8bit is master-free; FSDP2's fp32
        # shards and autocast's fp32 weights are the masters themselves)
        return LowBitAdamW(groups, settings.optimizer_state, settings.seed, rank=env.rank,
                           masters=masters if settings.optimizer_state == "fp32_master_8bit" else None, **kw)
    if masters is not None:
        return MasterWeightAdamW(groups, masters, **kw)
    return torch.optim.AdamW(groups, **kw)


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """HF-style schedules (get_{cosine,linear,constant}_schedule_with_warmup): `step` counts
    completed optimizer steps, so the first step of a warmup runs at factor 0."""
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


class LRSchedule:
    """The learning rate as a pure function of the optimizer steps done, set directly on every parameter group
    before each step (as nanoGPT's get_lr): lr = train.lr * lr_factor(step). Being a function of the step,
    a resumed run needs nothing saved but the step."""

    def __init__(self, settings: TrainSettings, total_steps: int):
        self.base_lr, self.total, self.schedule = settings.lr, total_steps, settings.schedule
        self.warmup = math.ceil(settings.warmup_ratio * total_steps)

    def lr(self, step: int) -> float:
        return self.base_lr * lr_factor(step, self.warmup, self.total, self.schedule)

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        lr = self.lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr


def fp32_grad_norm(params) -> torch.Tensor:
    """The gradients' 2-norm, each tensor's accumulated in fp32 whatever its dtype (a bf16 norm keeps 3 digits),
    combined as clip_grad_norm_ does; sharded (DTensor) gradients through clip_grad_norm_ itself, unscaled."""
    grads = [p.grad for p in params if p.grad is not None]
    if any(hasattr(g, "to_local") for g in grads):
        return total_grad_norm([p for p in params if p.grad is not None], 0)
    return torch.linalg.vector_norm(torch.stack([torch._foreach_norm([g.float()], 2)[0] for g in grads]), 2)


def total_grad_norm(params, max_norm: float) -> torch.Tensor:
    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm if max_norm > 0 else float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


@torch.no_grad()
def adamw_step_lr_tensor(optimizer: torch.optim.AdamW, lrs: list[torch.Tensor],
                         grad_divisor: torch.Tensor | None = None) -> None:
    """The fused AdamW update of every group, reading each group's learning rate from a device tensor
    (a captured graph cannot take a new Python float each step). Same kernel and state layout as
    optimizer.step() with fused=True, so checkpoints are interchangeable. grad_divisor: the kernel divides
    every gradient by it on the fly (its AMP unscale input), which is how the clip is applied here."""
    from torch.optim.adamw import adamw as functional_adamw
    for group, lr in zip(optimizer.param_groups, lrs):
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        for p in params:
            state = optimizer.state[p]
            if not state:       # what AdamW(fused=True) creates on its first step
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [optimizer.state[p] for p in params]
        functional_adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                                [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
                         foreach=False, capturable=True, differentiable=False, fused=True, grad_scale=grad_divisor,
                         found_inf=None, has_complex=False, amsgrad=False, beta1=group["betas"][0],
                         beta2=group["betas"][1], lr=lr, weight_decay=group["weight_decay"], eps=group["eps"],
                         maximize=False)


def check_optimizer_settings(settings: TrainSettings, world_size: int, max_micro_batches: int,
                             largest_step_tokens: int) -> None:
    """Refuse, before any weight is read, what train.optimizer cannot do (one line naming the settings)."""
    state = settings.optimizer_state
    if state == "bf16_sr_8bit" and settings.precision != "bf16":
        raise TrainConfigError(f"train.optimizer.state bf16_sr_8bit updates the bf16 weights themselves (no fp32 "
                               f"master): it needs train.precision: bf16 (this run: {settings.precision})")
    if not settings.fused_backward:
        return
    if settings.max_grad_norm > 0:
        raise TrainConfigError(f"train.optimizer.fused_backward steps each parameter as soon as its gradient is "
                               f"complete, before the global gradient norm exists: set train.max_grad_norm: 0 "
                               f"(now {settings.max_grad_norm}) or fused_backward: false")
    if world_size > 1:
        raise TrainConfigError(f"train.optimizer.fused_backward needs the reduced gradient inside backward, and "
                               f"{settings.parallel} reduces after the whole backward ({world_size} processes): "
                               "use one process or fused_backward: false")
    if max_micro_batches > 1:
        raise TrainConfigError(f"train.optimizer.fused_backward consumes each gradient at once, so it cannot "
                               f"accumulate micro-batches: this plan packs up to {max_micro_batches} micro-batches "
                               f"into an optimizer step; set train.micro_batch_tokens >= {largest_step_tokens} (the "
                               "largest step's tokens), lower train.global_batch_pairs, or fused_backward: false")


class FusedBackwardStep:
    """train.optimizer.fused_backward: a post-accumulate-grad hook on every trainable model parameter runs that
    parameter's AdamW step as soon as its gradient is complete and frees the gradient, so no gradient outlives
    its step (no persistent gradient buffer). The same per-element update as the optimizer's own step: exact mode
    through torch's fused AdamW on the one parameter (bitwise what optimizer.step() does with no clip and one
    micro-batch), the low-bit modes through LowBitAdamW.step_param. grad_norm(): the gradients' norm for the log
    (no clip: refused by check_optimizer_settings)."""

    def __init__(self, optimizer: torch.optim.Optimizer, module: nn.Module):
        self.optimizer = optimizer
        params = [p for p in module.parameters() if p.requires_grad]
        # the order the unfused step combines the norms in: the masters' (group) order, else the module's
        order = optimizer.model_params if isinstance(optimizer, MasterWeightAdamW) else params
        self._index = {id(p): i for i, p in enumerate(order)}
        self._norms: dict[int, torch.Tensor] = {}
        self._target, self._group = {}, {}
        masters = getattr(optimizer, "master_params", None)
        model_params = getattr(optimizer, "model_params", None)
        if isinstance(optimizer, LowBitAdamW):
            optimizer.prepare_fused()
        else:
            to_opt = dict(zip(map(id, model_params), masters)) if masters is not None else {}
            for g in optimizer.param_groups:
                for t in g["params"]:
                    self._group[id(t)] = g
            for p in params:
                self._target[id(p)] = to_opt.get(id(p), p)
        self.handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params]

    def begin(self) -> None:
        self._norms.clear()
        if isinstance(self.optimizer, LowBitAdamW):
            self.optimizer.begin_step()

    @torch.no_grad()
    def _hook(self, p: torch.Tensor) -> None:
        # per-tensor fp32 norms, combined in parameter order at the end: clip_grad_norm_'s arithmetic, so the logged
        # norm is the unfused step's to the bit
        g32 = p.grad.float()
        self._norms[self._index[id(p)]] = (torch._foreach_norm([g32], 2)[0] if isinstance(self.optimizer, LowBitAdamW)
                                           else torch.nn.utils.get_total_norm([g32], 2.0))
        if isinstance(self.optimizer, LowBitAdamW):
            self.optimizer.step_param(p)
        else:
            target = self._target[id(p)]
            if target is not p:
                target.grad = p.grad.float()
            _adamw_one(self.optimizer, target, self._group[id(target)])
            if target is not p:
                p.copy_(target)
                target.grad = None
        p.grad = None

    def grad_norm(self) -> torch.Tensor:
        return torch.linalg.vector_norm(torch.stack([self._norms[i] for i in sorted(self._norms)]), 2)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _adamw_one(optimizer: torch.optim.AdamW, p: torch.Tensor, group: dict) -> None:
    """torch's fused AdamW step of one parameter, with the state AdamW(fused=True) creates."""
    from torch.optim.adamw import adamw as functional_adamw
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    functional_adamw([p], [p.grad], [state["exp_avg"]], [state["exp_avg_sq"]], [], [state["step"]], foreach=False,
                     capturable=False, differentiable=False, fused=True, grad_scale=None, found_inf=None,
                     has_complex=False, amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"],
                     weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
