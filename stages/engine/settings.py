"""The engine's settings: params.yaml's `train` section as a frozen dataclass.

The schema (workflow/schemas/params.schema.yaml) is the one place that says which keys exist, their types,
enums and ranges; `from_params` validates the section against it, so the dataclass repeats no default and no
check. What the schema cannot say is refused here: a temperature other than 1.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import jsonschema

from stages.lib.params import TRAIN_DISPLAY_ONLY, resolved_optimizer


class TrainConfigError(ValueError):
    """A training knob is refused before anything is built."""


# The `train` keys a no-grad pass reads (TrainSettings.for_inference): where it runs, in which dtype and batches,
# sharded or not (fsdp2 with bf16_sr_8bit holds the weights in bf16: `optimizer`). ref_logps, generate and judge
# declare exactly these (stages/lib/layout.py ENGINE_INFERENCE_KEYS); their params view refuses any other.
INFERENCE_FIELDS = frozenset({"gpus", "cpu_threads", "portable_numerics", "parallel", "precision", "optimizer",
                              "inference_micro_batch_tokens", "logp_chunk_tokens", "temperature", "compile",
                              "share_prompt", "cuda_graphs"})


@dataclass(frozen=True)
class TrainSettings:
    gpus: int                          # 0 = CPU with gloo; N = one process per GPU with nccl
    cpu_procs: int                     # processes torchrun starts on CPU (read by the rule)
    cpu_threads: int                   # intra-op threads per CPU process: fixed, so results do not depend on the runner
    portable_numerics: bool            # CPU: processor-independent kernels (stages/lib/environment.py)
    parallel: str                      # ddp | fsdp2
    seed: int
    epochs: float
    global_batch_pairs: int            # pairs per optimizer step, over all ranks
    micro_batch_tokens: int            # token budget of one packed micro-batch
    inference_micro_batch_tokens: int  # the same for no-grad passes (reference, probe)
    lr: float
    weight_decay: float                # applied to matrices only (not biases / norm weights), as HF Trainer
    adam_betas: tuple[float, float]
    warmup_ratio: float                # warmup steps = ceil(ratio * total steps)
    schedule: str                      # cosine | linear | constant (after warmup)
    max_grad_norm: float               # 0 = no clipping (the norm is still logged)
    logp_chunk_tokens: int             # LM-head chunk for log-probs
    temperature: float                 # must be exactly 1
    compile: bool                      # torch.compile the log-prob chunk function
    precision: str                     # GPU: autocast = fp32 weights + bf16 autocast; bf16 = bf16 weights, fp32 master
    share_prompt: bool                 # compute a pair's shared prompt once (packing.PackedBatch)
    cuda_graphs: int                   # GPU, one process: at most N padded batch shapes replayed as CUDA graphs
    activation_checkpointing: bool | int | str   # false / true / the first N decoder layers / auto (memory plan)
    save_every: int                    # checkpoint every N optimizer steps (and after the last); 0 = never
    keep_checkpoints: int              # complete checkpoints of a run kept on disk (the newest ones)
    adapter: dict | None = None        # None = full fine-tuning; {type: lora, ...}: stages/engine/adapters.py
    max_steps: int | None = None       # cap on optimizer steps (None: train.epochs decide); the schedule is the cap's
    # None = {state: exact, fused_backward: false}; else normalized to both keys (__post_init__).
    optimizer: dict | None = None
    eval_every: int = 0                # score the dev split every N steps too (0: at step 0 and the end only)
    select_best: bool = False          # export the best dev-accuracy step's weights instead of the last
    tensorboard: bool = False          # also log to TensorBoard (untracked; stages/engine/live_log.py)

    def __post_init__(self):
        if self.temperature != 1.0:
            raise TrainConfigError(f"train.temperature = {self.temperature}: log-probs, DPO rewards and reference "
                                   "log-probs are defined at temperature 1; other values are refused")
        if self.select_best and self.parallel == "fsdp2":
            raise TrainConfigError("train.select_best keeps the best step's full weights on rank 0: not under "
                                   "parallel fsdp2 (use ddp)")
        object.__setattr__(self, "optimizer", resolved_optimizer(self.optimizer))

    @property
    def optimizer_state(self) -> str:
        """train.optimizer.state: exact | fp32_master_8bit | bf16_sr_8bit."""
        return (self.optimizer or {}).get("state", "exact")

    @property
    def fused_backward(self) -> bool:
        return bool((self.optimizer or {}).get("fused_backward", False))

    def checkpointed_layers(self, n_layers: int) -> int:
        """How many of the model's n_layers decoder layers (the first ones) recompute their activations (auto: 0
        here; the loop resolves it from the memory plan, loop.plan_memory)."""
        ac = self.activation_checkpointing
        if ac == "auto":
            return 0
        if isinstance(ac, bool):
            return n_layers if ac else 0
        return min(int(ac), n_layers)

    def record(self) -> dict:
        """The settings as a JSON-able dict (run_info, checkpoint header): every field, null where unset, but for
        the display-only ones (TRAIN_DISPLAY_ONLY: where curves are also shown decides no byte of the run)."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()
                if k not in TRAIN_DISPLAY_ONLY}

    @classmethod
    def for_inference(cls, params: dict) -> "TrainSettings":
        """The settings of a no-grad pass (ref_logps, generate, judge): only the `train` keys such a pass reads
        (INFERENCE_FIELDS; those stages declare them: stages/lib/layout.py ENGINE_INFERENCE_KEYS), so a new learning rate or epoch
        count leaves their outputs, and their rules, alone. The training-only fields are None: a no-grad path that
        used one would fail on it, never run on a value its rule does not rerun for. The values were validated
        with the whole file when it was loaded (stages.lib.params.load_params)."""
        train = params["train"]
        return cls(**{f.name: (train.get(f.name) if f.name in INFERENCE_FIELDS else None) for f in fields(cls)})

    @classmethod
    def from_params(cls, params: dict) -> "TrainSettings":
        """params.yaml's `train` section, validated against the schema's (a dict not loaded through
        stages.lib.params, e.g. a test's, is checked too)."""
        from stages.lib.params import load_schema
        try:
            jsonschema.validate(params["train"], load_schema()["properties"]["train"])
        except jsonschema.ValidationError as e:
            where = ".".join(str(p) for p in e.absolute_path)
            raise TrainConfigError(f"train{'.' + where if where else ''}: {e.message}") from None
        from stages.lib.params import resolved_train
        train = resolved_train(params["train"])   # every optional key filled (adapter, optimizer, max_steps, ...)
        train["adam_betas"] = tuple(float(b) for b in train["adam_betas"])
        return cls(**{f.name: train[f.name] for f in fields(cls)})
