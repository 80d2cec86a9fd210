"""The training loop, top to bottom: build the run, probe at step 0, the steps, probe at the end, export.

    run = build_run(...)            model, precision, fused kernels, wrapping, optimizer, plan, resume
    probe(run, "step0")             every probe pair scored once, rows in manifest order (rank 0 writes)
    for each planned step:          lr set, steps.step() (eager or CUDA graphs), log row, checkpoint
    probe(run, "final"); export     the HF directory others load
    run_info.json / perf            the hashed record, and the timings that stay out of it

One optimizer step, on every rank (stages/engine/steps.py):
  1. take this rank's micro-batches of the step from the deterministic global plan (packing.py);
  2. one small CPU (gloo) all_gather of (micro-batches, pairs, tokens) per rank: every rank learns the step's
     micro-batch count K and the GLOBAL pair count P; ranks with fewer micro-batches run zero-weight
     fillers so DDP/FSDP collectives always line up;
  3. forward/backward each micro-batch with loss = sum(per-pair loss) * world_size / P: DDP averages
     gradients over ranks, so the update equals the single-process one on the same global batch;
  4. clip, AdamW, device-side finiteness asserts, no host sync;
  5. one all_reduce of the step's summed metrics, read on the host once per log window.

Checkpoints (stages/engine/checkpoint.py) hold model, optimizer, RNG (per rank), step, tokens and log rows; the
plan and the learning rate being pure functions of the step, a resumed run starts the loop at
`plans[state.step]` with the same batches and RNG: the same weights bit for bit on CPU.
"""
from __future__ import annotations

import csv
import io
import logging
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from stages.engine.adapters import Adapter, attach_adapter, check_adapter_settings
from stages.engine.cli import _progress_bar
from stages.engine.data import prefetch_batches, run_inference
from stages.engine.dev_eval import BEST_STATE_FILE, DEV_LOG_COLUMNS, DevEval, is_due
from stages.engine.dist import (DistEnv, compute_dtype, control_exchange, disable_dropout, peak_memory_bytes,
                                peak_reserved_bytes, seed_everything, wrap_model)
from stages.engine.export import export_model, host_state_dict
from stages.engine.guards import check_plan
from stages.engine.live_log import LiveLog, tensorboard_writer_class
from stages.engine.objectives import Objective
from stages.engine.memory_plan import check_fits, estimate as estimate_memory, fewest_checkpointed, read_config
from stages.engine.optim import LRSchedule, build_optimizer, check_optimizer_settings
from stages.engine.settings import TrainConfigError, TrainSettings
from stages.engine import kernels
from stages.engine.steps import make_steps
from stages.engine.checkpoint import (CheckpointOptions, agree_on_checkpoint, load_checkpoint, run_header,
                                   save_checkpoint)
from stages.lib.environment import environment_record
from stages.lib import record_formats
from stages.lib.io import MEASUREMENT, write_json, write_jsonl, write_text
from stages.engine.modeling import USED_BACKENDS, attention_backend, warm_up_fused_kernels
from stages.engine.packing import StepPlan, TokenPairs, plan_training, planned_steps
from stages.engine.step_profiler import StepProfiler
from stages.engine import startup

log = logging.getLogger("trainer")


@dataclass
class TrainState:
    step: int = 0                      # optimizer steps completed
    tokens: int = 0                    # real tokens trained on (all ranks)
    log_rows: list[dict] = field(default_factory=list)


def plan_summary(plans: list[StepPlan], pairs: TokenPairs, world_size: int) -> list[dict]:
    tokens = pairs.pair_tokens
    out = []
    for r in range(world_size):
        mbs = [mb for s in plans for mb in s.rank_micro_batches[r]]
        fillers = sum(max(len(x) for x in s.rank_micro_batches) - len(s.rank_micro_batches[r]) for s in plans)
        out.append({"rank": r, "pairs": sum(map(len, mbs)), "tokens": int(sum(tokens[mb].sum() for mb in mbs)),
                    "micro_batches": len(mbs), "filler_micro_batches": fillers})
    return out


def write_train_log(path: Path, rows: list[dict]) -> None:
    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    write_text(path, buf.getvalue())


# Counts of what this process did (the CUDA-graph shapes it met, captured and replayed): a run resumed after a kill
# does less of it, so like the timings they go to the perf log, and run_info.json stays the uninterrupted run's bytes.
# triton_first_launches: the Triton kernel variants this process first launched inside the timed loop (each a compile
# or a disk-cache load that the warm-ups before the loop missed; None where Triton cannot report them: not importable,
# or without its jit_cache_hook).
PROCESS_HISTORY = frozenset({"shapes_captured", "captures", "replays", "triton_first_launches"})


def split_measurements(info: dict) -> tuple[dict, dict]:
    """(facts, measurements), at any depth: keys ending in `_seconds` are timings, which vary run to run, and
    PROCESS_HISTORY's counts vary with where a run was resumed."""
    facts, times = {}, {}
    for k, v in info.items():
        if k.endswith("_seconds") or k in PROCESS_HISTORY:
            times[k] = v
        elif isinstance(v, dict):
            facts[k], inner = split_measurements(v)
            if inner:
                times[k] = inner
        else:
            facts[k] = v
    return facts, times



@dataclass
class Run:
    """Everything one training run holds between its phases."""
    objective: Objective
    settings: TrainSettings
    env: DistEnv
    module: nn.Module                  # the objective's module (HF model + how outputs are read)
    hf: nn.Module                      # the Hugging Face model inside it (what is exported)
    model: nn.Module                   # the module as wrapped for the run (DDP / FSDP2 / itself)
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    plans: list[StepPlan]
    train_pairs: TokenPairs
    probe_pairs: TokenPairs
    out_dir: Path
    n_params: int
    kernel_warmup_s: float
    state: TrainState
    header: dict | None = None         # the run's identity for checkpoints (None: none are read or written)
    resumed: tuple | None = None       # (path, meta) of the checkpoint resumed from
    step0_rows: list[dict] | None = None
    saved_checkpoints: list[int] = field(default_factory=list)
    adapter: Adapter | None = None     # LoRA (train.adapter); None = full fine-tuning
    memory_plan: dict | None = None    # stages/engine/memory_plan.py's estimate, made before the model load
    dev_pairs: TokenPairs | None = None  # the dev split (probe.dev_size > 0), scored by `dev`
    dev: DevEval | None = None
    live: LiveLog | None = None        # DVCLive / TensorBoard (stages/engine/live_log.py; rank 0 writes)


def plan_memory(objective: Objective, settings: TrainSettings, env: DistEnv, model_dir: Path, train_pairs: TokenPairs,
                plans: list[StepPlan]) -> tuple[dict | None, int | None]:
    """The memory plan (stages/engine/memory_plan.py) from config.json alone: logged by part, refused when it cannot
    fit this GPU (naming settings that would). -> (its record, or None for a model family it cannot count (logged);
    the number of layers to checkpoint when train.activation_checkpointing is auto: the fewest that fit, else None)."""
    from stages.engine.steps import cuda_graphs_unavailable
    cfg = read_config(model_dir)
    tokens = max((int(train_pairs.pair_tokens[mb].sum()) for s in plans for r in s.rank_micro_batches for mb in r),
                 default=0)
    cuda = env.device.type == "cuda"
    device_bytes = torch.cuda.get_device_properties(env.device).total_memory if cuda else None
    graphed = cuda_graphs_unavailable(settings, env) is None
    auto = settings.activation_checkpointing == "auto"
    try:
        plan = (fewest_checkpointed(cfg, objective.head, settings, tokens, env.world_size, device_bytes,
                                    env.device.type, graphed) if auto else
                estimate_memory(cfg, objective.head, settings, tokens, env.world_size, device_bytes, env.device.type,
                                graphed))
    except (ValueError, KeyError) as e:
        log.info("memory plan: none (%s)", e)
        return None, 0 if auto else None
    log.info("memory plan per %s: %s, %d parameters (%d trained), largest micro-batch %d tokens, %d of %d layers "
             "checkpointed", "GPU" if cuda else "process", plan.describe(), plan.parameters, plan.trainable,
             plan.micro_batch_tokens, plan.checkpointed_layers, plan.layers)
    check_fits(plan, cfg, objective.head, settings, env.world_size, env.device.type, graphed,
               torch.cuda.get_device_name(env.device) if cuda else "the device")
    return plan.record(), plan.checkpointed_layers if auto else None


def enable_activation_checkpointing(hf: nn.Module, settings: TrainSettings) -> int:
    """train.activation_checkpointing: recompute the first N decoder layers in backward (all: true). Without RNG
    state saving (dropout is off; LoRA dropout keeps it), so a checkpointed step can be captured as a CUDA graph.
    Returns N."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    layers = [m for m in hf.modules() if isinstance(m, GradientCheckpointingLayer)]
    n = settings.checkpointed_layers(len(layers))
    if n:
        keep_rng = bool(settings.adapter and settings.adapter["dropout"] > 0)
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                        "preserve_rng_state": keep_rng})
        for layer in layers[n:]:
            layer.gradient_checkpointing = False
    return n


def cast_to_compute_dtype(module: nn.Module, settings: TrainSettings) -> dict[int, torch.Tensor] | None:
    """The module's weights to the compute dtype (bf16 under precision bf16 without FSDP2), in place. Returns the
    trained parameters' fp32 values (id(param) -> tensor), the source of the optimizer's masters, or None where
    there are none (fp32 weights; bf16_sr_8bit, whose bf16 weights are the only copy)."""
    dtype = compute_dtype(settings)
    if dtype == torch.float32:
        return None
    if settings.optimizer_state == "bf16_sr_8bit":
        module.to(dtype=dtype)
        return None
    # The fp32 values become the optimizer's masters (it makes its own copies). `.to(dtype)` gives each parameter
    # new bf16 data and these views keep the old fp32 storage alive until then: no extra copy. Only the trained
    # parameters': a frozen base (train.adapter) has no master, and keeping its fp32 load alive through the cast
    # held 6 bytes a base parameter on the device (memory_plan's load phase counts 4 and a tensor's cast).
    masters = {id(p): p.detach() for p in module.parameters() if p.requires_grad}
    module.to(dtype=dtype)
    return masters


def uncapped_steps(run: "Run") -> int:
    """The optimizer steps train.epochs make without train.max_steps."""
    s = run.settings
    return planned_steps(len(run.train_pairs), s.epochs, s.global_batch_pairs)


def build_run(objective: Objective, settings: TrainSettings, env: DistEnv, model_dir: Path, train_pairs: TokenPairs,
              probe_pairs: TokenPairs, out_dir: Path, ckpt: CheckpointOptions,
              dev_pairs: TokenPairs | None = None) -> Run:
    """Model (seeded head), precision, fused kernels compiled, wrapping, optimizer, plan; resumed when a
    checkpoint of this exact run exists."""
    # The plan first (a pure function of the tokens and settings): the optimizer refusals and the memory plan
    # need its micro-batches, and both must come before any weight is read.
    # train.max_steps cuts the plan; LRSchedule below is then computed for the cut length (len(plans)).
    plans = plan_training(train_pairs.pair_tokens, epochs=settings.epochs, world_size=env.world_size,
                          global_batch_pairs=settings.global_batch_pairs,
                          micro_batch_tokens=settings.micro_batch_tokens, seed=settings.seed,
                          max_steps=settings.max_steps)
    step_tokens = [int(sum(train_pairs.pair_tokens[mb].sum() for mb in s.rank_micro_batches[r]))
                   for s in plans for r in range(env.world_size)]
    check_optimizer_settings(settings, env.world_size,
                             max((len(x) for s in plans for x in s.rank_micro_batches), default=0),
                             max(step_tokens, default=0))
    memory, auto_layers = plan_memory(objective, settings, env, model_dir, train_pairs, plans)
    startup.mark("plan")
    seed_everything(settings.seed)                 # same init on every rank (e.g. the new reward head)
    # fp32 weights read straight into GPU memory (no CPU copy; the cast to bf16 below happens there, as before):
    # the same values as a CPU load moved over. Not with an adapter: peft would create the LoRA weights on the
    # GPU, from the GPU's RNG, where they are now made from the CPU's.
    module = objective.build_module(model_dir, settings, device=env.device if settings.adapter is None else None)
    startup.mark("model_load")
    hf = objective.hf_model(module)
    # A reward model's score positions follow its pad id (HF's pooling): set, or refused, before any work.
    train_pairs, probe_pairs = objective.prepare_pairs(hf, train_pairs), objective.prepare_pairs(hf, probe_pairs)
    dev_pairs = objective.prepare_pairs(hf, dev_pairs) if dev_pairs is not None else None
    disable_dropout(module)
    # After disable_dropout: train.adapter.dropout is the adapters' own, asked for explicitly.
    check_adapter_settings(settings.adapter, settings, hf, objective.head)
    adapter = attach_adapter(hf, settings.adapter, objective.head) if settings.adapter else None
    enable_activation_checkpointing(hf, settings if auto_layers is None
                                    else replace(settings, activation_checkpointing=auto_layers))
    module.to(env.device)
    masters = cast_to_compute_dtype(module, settings)
    objective.to(env.device)
    startup.mark("to_device")
    # Triton compiles a kernel on its first launch: do it now, not inside the timed loop's first step.
    mixed = env.device.type == "cuda" and settings.precision in ("bf16", "autocast")
    kernel_warmup_s = warm_up_fused_kernels(hf, env.device, torch.bfloat16 if mixed else torch.float32,
                                            torch.float32 if settings.precision == "autocast" else None)
    startup.mark("kernel_warmup")
    model = wrap_model(module, hf, settings, env)
    startup.mark("wrap")
    optimizer = build_optimizer(module, settings, env, masters)   # after wrapping: FSDP2 replaces the parameters
    startup.mark("optimizer")
    del masters
    run = Run(objective, settings, env, module, hf, model, optimizer,
              LRSchedule(settings, len(plans)), plans, train_pairs, probe_pairs, Path(out_dir),
              sum(p.numel() for p in module.parameters()), kernel_warmup_s, TrainState(), adapter=adapter,
              memory_plan=memory, dev_pairs=dev_pairs)
    if dev_pairs is not None:
        run.dev = DevEval(run)
    if ckpt.directory is not None or ckpt.resume not in ("auto", "never"):
        # Rank 0's header (the reference digest is computed there only); every rank names files by it.
        box = [run_header(objective, settings, env, hf, train_pairs, probe_pairs, ckpt.reference, dev_pairs)
               if env.is_main else None]
        if env.world_size > 1:
            dist.broadcast_object_list(box, src=0, group=env.control_group)
        run.header = box[0]
        run.resumed = agree_on_checkpoint(ckpt, run.header, env)
    if run.resumed is not None:
        saved, run.step0_rows = load_checkpoint(*run.resumed, module=module, optimizer=optimizer, settings=settings,
                                                env=env)
        run.state = TrainState(step=saved["step"], tokens=saved["tokens"], log_rows=saved["log_rows"])
        if run.dev is not None:
            run.dev.restore(saved, run.resumed[0])
        log.info("resuming from %s: %d of %d optimizer steps done", run.resumed[0], run.state.step, len(plans))
    startup.mark("resume")
    log.info("objective %s: %d train pairs, %d probe pairs, %d optimizer steps, world %d (%s, %s), %.2fM params, "
             "attention %s", objective.name, len(train_pairs), len(probe_pairs), len(plans), env.world_size,
             env.backend, settings.parallel, run.n_params / 1e6,
             attention_backend(env.device, torch.bfloat16 if env.device.type == "cuda" else torch.float32))
    if settings.max_steps is not None:
        log.info("train.max_steps %d: %d of the %d optimizer steps train.epochs %g make (through epoch %.4f); the "
                 "learning-rate schedule is computed for %d steps", settings.max_steps, len(plans), uncapped_steps(run),
                 settings.epochs, plans[-1].epoch_progress, len(plans))
    if adapter is not None:
        log.info("adapter %s r=%d alpha=%g dropout=%g on %s: %d trainable parameters", adapter.settings["type"],
                 adapter.settings["r"], adapter.settings["alpha"], adapter.settings["dropout"],
                 ",".join(adapter.targets), adapter.trainable_parameters)
    return run


def probe(run: Run, name: str) -> list[dict] | None:
    """Score every probe pair once (all ranks); rank 0 writes probe_<name>.jsonl and returns the rows."""
    outputs = run_inference(run.model, run.probe_pairs, run.env, run.settings, desc=f"probe {name}")
    if not run.env.is_main:
        return None
    rows = run.objective.probe_rows(run.probe_pairs, outputs)
    write_jsonl(run.out_dir / f"probe_{name}.jsonl", rows)
    log.info("probe %s: accuracy %.4f over %d pairs", name, float(np.mean([r["correct"] for r in rows])), len(rows))
    return rows


class TrainLog:
    """The per-step log rows. Values stay on the device until a flush (every `every` steps and at the end):
    one device->host read per window instead of one per step, so the host keeps queueing work ahead of the GPU.
    Throughput is a measurement, not a result: it goes to the perf record and the console, never into
    train_log.csv or the stage log, whose bytes are part of the hashed record."""

    def __init__(self, run: Run):
        self.run, self.rows = run, run.state.log_rows
        self.every = max(1, len(run.plans) // 20)
        self.pending: list[tuple[dict, torch.Tensor]] = []
        self.window_start, self.window_tokens = time.perf_counter(), 0
        self.throughput: list[dict] = []
        self.progress = _progress_bar(len(run.plans), run.state.step, run.env)

    def add(self, row: dict, values: torch.Tensor) -> None:
        self.pending.append((row, values))
        self.window_tokens += row["tokens"]
        self.progress.update(1)
        if row["step"] == len(self.run.plans) or row["step"] % self.every == 0:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        names = self.run.objective.metric_names
        values = torch.stack([v for _, v in self.pending]).tolist()
        now = time.perf_counter()
        tok_s = round(self.window_tokens / max(now - self.window_start, 1e-9), 1)
        first = len(self.rows)
        for (row, _), vals in zip(self.pending, values):
            row.update({name: vals[i] / row["pairs"] for i, name in enumerate(names)})
            row["grad_norm"] = vals[-1]
            self.rows.append({k: row[k] for k in ["step", "epoch", *names, "lr", "grad_norm", "pairs", "tokens"]})
        if self.run.live is not None:
            self.run.live.train_rows(self.rows[first:])   # DVCLive's files, as the rows reach the host
        last = self.rows[-1]
        self.throughput.append({"step": last["step"], "tokens_per_s": tok_s})
        if "accuracy" in names:           # a preference objective (DPO, reward model)
            self.progress.set_postfix(loss=f"{last['loss']:.4f}", acc=f"{last['accuracy']:.3f}", refresh=False)
            if self.run.env.is_main:
                log.info("step %d/%d epoch %.3f loss %.5f accuracy %.4f margin %.4g lr %.3g grad_norm %.4g",
                         last["step"], len(self.run.plans), last["epoch"], last["loss"], last["accuracy"],
                         last["margin"], last["lr"], last["grad_norm"])
        else:                               # another objective (SFT): its own metrics by name
            self.progress.set_postfix(loss=f"{last['loss']:.4f}", refresh=False)
            if self.run.env.is_main:
                log.info("step %d/%d epoch %.3f %s lr %.3g grad_norm %.4g", last["step"], len(self.run.plans),
                         last["epoch"], " ".join(f"{n} {last[n]:.5g}" for n in names), last["lr"], last["grad_norm"])
            log.info("step %d tok/s %.0f", last["step"], tok_s, extra=MEASUREMENT)
        self.pending.clear()
        self.window_start, self.window_tokens = now, 0

    def close(self) -> None:
        self.flush()
        self.progress.close()


def save(run: Run, ckpt: CheckpointOptions) -> None:
    state = run.state
    dev = run.dev.trainer_state() if run.dev is not None else {}
    extra = ({BEST_STATE_FILE: run.dev.best_state} if run.dev is not None and run.dev.best_state is not None else {})
    save_checkpoint(ckpt.directory, header=run.header, step=state.step, total_steps=len(run.plans),
                    trainer_state={"step": state.step, "tokens": state.tokens, "log_rows": state.log_rows, **dev},
                    probe_step0_rows=run.step0_rows, module=run.module, optimizer=run.optimizer,
                    settings=run.settings, env=run.env, keep=run.settings.keep_checkpoints, extra_files=extra)
    run.saved_checkpoints.append(state.step)


def export_trained(run: Run, model_dir: Path, extra_files: dict[str, str] | None = None) -> None:
    """run.out_dir/model: the trained model. Where the optimizer keeps fp32 masters of bf16 weights, the masters
    (what was trained, not their bf16 working copies) are exported in fp32. Those, and every GPU run's weights
    (FSDP2 gathers its own), are copied to the host tensor by tensor (export.host_state_dict): the export allocates
    nothing on the device, so it stays under the training peak the memory plan bounds. Rank 0 makes the copies
    (only it writes). extra_files: written beside the tokenizer (export_model)."""
    state = None
    masters = getattr(run.optimizer, "master_params", None) is not None
    on_gpu = run.env.device.type == "cuda" and run.settings.parallel != "fsdp2"
    if run.dev is not None and run.dev.best_state is not None:     # train.select_best: the selected step's weights
        state = run.dev.best_state if run.env.is_main else None
    elif (masters or on_gpu) and run.env.is_main:
        with torch.no_grad():
            state = host_state_dict(run.hf, run.optimizer, trained_only=run.adapter is not None)
    export_model(run.module, run.objective, run.settings, run.env, Path(model_dir), run.out_dir / "model",
                 run.adapter, state=state, extra_files=extra_files)


def train(objective: Objective, settings: TrainSettings, env: DistEnv, *, model_dir: Path, train_pairs: TokenPairs,
          probe_pairs: TokenPairs, out_dir: Path, checkpoint: CheckpointOptions | None = None,
          dev_pairs: TokenPairs | None = None,
          environment: dict | None = None, perf_path: Path | None = None,
          export_files: dict[str, str] | None = None, live_dir: Path | None = None,
          tensorboard_dir: Path | None = None) -> dict:
    """Train (resuming from a checkpoint when one fits), evaluate the probe at step 0 and at the end,
    export (with `export_files` written beside the tokenizer: export_model); returns run_info plus its `perf`
    (rank 0 writes files).

    run_info.json holds only what the same commit, params, data and environment reproduce byte for byte
    (it is an artifact hashed in dvc.lock and the evidence); timings, throughput and memory go to
    `perf_path` (the rule's `*.perf.json` log, outside the hashed record).

    live_dir: DVCLive's folder (metrics.json, plots/metrics/*.tsv; stages/engine/live_log.py), a hashed output of
    the stage like train_log.csv; None: none. tensorboard_dir: TensorBoard's (untracked), written only when
    train.tensorboard is true."""
    t_start = time.perf_counter()
    StepProfiler.request()                      # a PREFPIPE_PROFILE_* typo is refused before any weight is read
    if settings.tensorboard:
        tensorboard_writer_class()              # refused on every rank before any weight is read, naming the key
    ckpt = checkpoint or CheckpointOptions(directory=None, resume="never")
    if settings.save_every and ckpt.directory is None:
        raise TrainConfigError(f"train.save_every = {settings.save_every} needs a checkpoint directory "
                               "(--checkpoint-dir, outside the stage's declared outputs)")
    # The plan from the counts, before any weight is loaded: refused when no step would train, else its warnings.
    for warning in check_plan(len(train_pairs), settings, env.world_size):
        if env.is_main:
            log.warning("%s", warning)
    if env.is_main:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    run = build_run(objective, settings, env, model_dir, train_pairs, probe_pairs, out_dir, ckpt, dev_pairs)
    state, plans, pair_tokens = run.state, run.plans, run.train_pairs.pair_tokens
    run.live = LiveLog(live_dir, tensorboard_dir if settings.tensorboard else None, objective.metric_names,
                       env.is_main)
    if run.resumed is not None:                  # the folders afresh from the checkpoint's rows: an uninterrupted run's
        run.live.train_rows(state.log_rows)
        if run.dev is not None:
            run.live.dev_rows(run.dev.rows)

    if run.resumed is None:
        run.step0_rows = probe(run, "step0")
    elif env.is_main:   # the step-0 model is gone; its probe rows were saved with the checkpoint
        write_jsonl(run.out_dir / "probe_step0.jsonl", run.step0_rows)
    if run.dev is not None and run.resumed is None:
        run.dev.score(0)
    startup.mark("probe_step0")

    run.model.train()
    my_micro_batches = [mb for s in plans[state.step:] for mb in s.rank_micro_batches[env.rank]]
    steps = make_steps(run.model, run.module, run.hf, objective, run.optimizer, settings, env, run.train_pairs,
                       my_micro_batches, run.n_params)
    batches = prefetch_batches(run.train_pairs, my_micro_batches, pin=env.device.type == "cuda",
                               share_prompt=settings.share_prompt, pad_to=steps.pad_to)
    train_log = TrainLog(run)
    profiler = StepProfiler.from_env(env.device, env.is_main, state.step)   # PREFPIPE_PROFILE: off by default
    startup.mark("steps_setup")
    t_train = time.perf_counter()
    first_step = True
    with steps.loop_context(), kernels.FirstLaunches() as first_launches:
        for plan in plans[state.step:]:
            if profiler is not None:
                profiler.before_step(state.step)
            mine = plan.rank_micro_batches[env.rank]
            n_micro, global_pairs, global_tokens = control_exchange(
                env, len(mine), sum(map(len, mine)), int(sum(pair_tokens[mb].sum() for mb in mine)))
            lr = run.schedule.apply(run.optimizer, state.step)
            values = steps.step(n_micro, len(mine), batches, env.world_size / global_pairs)
            if first_step:
                # The start-up record ends when the first optimizer step has run on the device (one sync, once).
                if env.device.type == "cuda":
                    torch.cuda.synchronize(env.device)
                startup.mark("first_step")
                first_step = False
            state.step += 1
            state.tokens += global_tokens
            if profiler is not None:
                profiler.after_step(state.step - 1)
            train_log.add({"step": state.step, "epoch": round(plan.epoch_progress, 6), "lr": lr,
                           "pairs": global_pairs, "tokens": global_tokens}, values)
            if run.dev is not None and is_due(state.step, len(plans), settings.eval_every):
                run.dev.score(state.step)        # before a checkpoint of this step, which holds its row
            if settings.save_every and (state.step % settings.save_every == 0 or state.step == len(plans)):
                train_log.flush()                # the saved log rows must reach exactly this step
                save(run, ckpt)
    if profiler is not None:
        profiler.finish(state.step)
    graph_info = {**steps.finish(), "triton_first_launches": first_launches.names}
    train_log.close()
    run.live.close(state.step)
    train_seconds = time.perf_counter() - t_train

    # What the stage's wall time holds after the loop (pipeline_bench reads it): the last probe and the export.
    t_probe = time.perf_counter()
    if run.dev is not None:
        run.dev.select()                        # train.select_best: the final probe scores the exported weights
    probe(run, "final")
    t_export = time.perf_counter()
    export_trained(run, Path(model_dir), export_files)
    after_loop = {"probe_final": round(t_export - t_probe, 3), "export": round(time.perf_counter() - t_export, 3)}
    return write_records(run, graph_info, environment, perf_path, train_log.throughput, train_seconds,
                         time.perf_counter() - t_start, after_loop)


def write_records(run: Run, graph_info: dict, environment: dict | None, perf_path: Path | None,
                  throughput: list[dict], train_seconds: float, wall_seconds: float,
                  after_loop: dict | None = None) -> dict:
    """run_info.json (facts only, hashed) and the perf record (measurements); returns both."""
    env, settings, state = run.env, run.settings, run.state
    peaks = [None] * env.world_size
    dist.all_gather_object(peaks, peak_memory_bytes(env), group=env.control_group)
    reserved = [None] * env.world_size
    dist.all_gather_object(reserved, peak_reserved_bytes(env), group=env.control_group)
    graph_facts, graph_times = split_measurements(graph_info)
    run_info = {
        "format": record_formats.RUN_INFO,
        "objective": run.objective.name,
        "head": run.objective.head,
        "world_size": env.world_size,
        "backend": env.backend,
        "device": env.device.type,
        "parallel": settings.parallel,
        "attention": sorted(USED_BACKENDS),
        "cuda_graphs": graph_facts,
        "fused_kernels": dict(getattr(run.hf, "prefpipe_fused_kernels", {})),
        # Every field, null where it does not apply: the reward model's scoring position, the memory plan (GPU), the
        # adapter (LoRA), the uncapped step count (train.max_steps), the dev split (probe.dev_size > 0).
        "reward_scoring": run.objective.scoring_info(run.hf) if run.objective.head == "score" else None,
        "settings": settings.record(),
        "memory_plan": run.memory_plan,
        "adapter": run.adapter.info() if run.adapter is not None else None,
        "model_parameters": run.n_params,
        "train_pairs": len(run.train_pairs),
        "probe_pairs": len(run.probe_pairs),
        "optimizer_steps": len(run.plans),
        # train.max_steps: the steps train.epochs alone would have made (the record of what the cap cut)
        "steps_uncapped": uncapped_steps(run) if settings.max_steps is not None else None,
        # probe.dev_size > 0: the dev split's scorings (dev_log.csv) and, with train.select_best, the exported step
        "dev": run.dev.record() if run.dev is not None else None,
        "per_rank": plan_summary(run.plans, run.train_pairs, env.world_size),
        "total_tokens": state.tokens,
        # The record the numbers were made under (stages/lib/environment.py): versions, CPU dispatch, GPU.
        "environment": environment if environment is not None else environment_record(asdict(settings)),
    }
    perf = {
        "train_seconds": round(train_seconds, 3),
        "wall_seconds": round(wall_seconds, 3),
        "tokens_per_s": round(state.tokens / max(train_seconds, 1e-9), 1),
        "throughput_windows": throughput,
        "peak_memory_bytes_per_rank": peaks,
        "peak_memory_kind": "cuda_max_allocated" if env.device.type == "cuda" else "cpu_max_rss",
        # CUDA: the allocator's reserved peak (what the card held) and its configuration (dist.configure_cuda_allocator)
        **({"peak_reserved_bytes_per_rank": reserved,
            "cuda_allocator_conf": os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
           if env.device.type == "cuda" else {}),
        "kernel_warmup_seconds": round(run.kernel_warmup_s, 3),
        "cuda_graphs": graph_times,
        # Process start to the first optimizer step, by phase (stages/engine/startup.py).
        "startup": startup.CLOCK.record(),
        # Seconds after the loop, by phase: the final probe pass, the model export (fp32 masters to the host, save).
        "after_loop_seconds": after_loop or {},
        # How this process got its result, not what the result is: a run resumed after a kill writes run_info.json
        # byte for byte as an uninterrupted one (dvc.lock records the same hash), so its history lives here.
        "resumed_from_step": run.resumed[1]["step"] if run.resumed is not None else None,
        "checkpoints_saved": run.saved_checkpoints,
    }
    if env.is_main:
        write_train_log(run.out_dir / "train_log.csv", state.log_rows)
        if run.dev is not None:
            write_train_log(run.out_dir / "dev_log.csv", [{k: r[k] for k in DEV_LOG_COLUMNS} for r in run.dev.rows])
        write_json(run.out_dir / "run_info.json", run_info)
        if perf_path is not None:
            write_json(perf_path, perf)
        log.info("trained %d tokens in %.1f s (%.0f tok/s); peak memory %.2f GiB per rank (%s)", state.tokens,
                 train_seconds, perf["tokens_per_s"], max(peaks) / 2**30, perf["peak_memory_kind"], extra=MEASUREMENT)
    return {**run_info, "perf": perf}
