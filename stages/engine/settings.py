"""The engine's settings: params.yaml's `train` section as a frozen dataclass.

The schema (workflow/schemas/params.schema.yaml) is the one place that says which keys exist, their types,
enums and ranges; `from_params` validates the section against it, so the dataclass repeats no default and no
check. What the schema cannot say is refused here: a temperature other than 1.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import jsonschema


class TrainConfigError(ValueError):
    """A training knob is refused before anything is built."""


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
    activation_checkpointing: bool
    save_every: int                    # checkpoint every N optimizer steps (and after the last); 0 = never
    keep_checkpoints: int              # complete checkpoints of a run kept on disk (the newest ones)
    adapter: dict | None = None        # None = full fine-tuning; {type: lora, ...}: stages/engine/adapters.py

    def __post_init__(self):
        if self.temperature != 1.0:
            raise TrainConfigError(f"train.temperature = {self.temperature}: log-probs, DPO rewards and reference "
                                   "log-probs are defined at temperature 1; other values are refused")

    def record(self) -> dict:
        """The settings as a JSON-able dict (run_info, checkpoint header); `adapter` only when set, so a full
        fine-tune's record is what it was before adapters existed."""
        out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}
        if out["adapter"] is None:
            del out["adapter"]
        return out

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
        train = resolved_train(params["train"])   # adapter: absent = None; a LoRA block's omitted keys filled
        train["adam_betas"] = tuple(float(b) for b in train["adam_betas"])
        return cls(**{f.name: train[f.name] for f in fields(cls)})
