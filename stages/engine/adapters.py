"""Parameter-efficient training: LoRA adapters (peft) on the HF model inside SequenceLogProbs / SequenceRewards.

`train.adapter: {type: lora, r, alpha, dropout, target_modules, export}` (null = full fine-tuning, the default).

- peft injects its lora.Linear layers into the HF model in place (`get_peft_model`), so our wrappers, the packed
  attention and the chunked log-probs run unchanged; the PeftModel that peft returns is kept here, outside the
  module tree (it holds the HF model, which holds no reference back, so module traversal sees no cycle).
- Only the adapters train; the base stays frozen and is therefore the reference: lora_B is zero at init, so
  the step-0 policy IS the reference and the precomputed ref_logps stay valid. A reward model's new scalar
  head `score` trains in full beside the adapters (peft's modules_to_save: it is saved in the adapter
  directory, since the base model a user loads has no trained head).
- Refused (TrainConfigError, before anything is built): LoRA on the LM head (the chunked log-probs read the
  head's weight directly, so an adapter there would be skipped), on `score` (it trains in full already),
  target modules the model does not have, modules that are not nn.Linear.
- Export (`export`): `merged` = the usual HF directory with W + (alpha / r) B A folded in, made from a fresh
  load of the base weights (so a bf16 run's frozen base is not rounded into the export); `adapter` = peft's
  layout (adapter_config.json + adapter_model.safetensors, loadable by `PeftModel.from_pretrained(base, dir)`)
  with the tokenizer; `both` = merged in model/, the adapter directory in model/adapter/.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from stages.engine.settings import TrainConfigError

ADAPTER_NAME = "default"
PEFT_PREFIX = "base_model.model."          # where PeftModel.state_dict() puts the HF model's keys
ADAPTER_SUBDIR = "adapter"                 # export: both -> model/adapter/


@dataclass
class Adapter:
    settings: dict                          # train.adapter as validated by the schema
    config: object                          # peft.LoraConfig
    peft_model: object                      # peft.PeftModel around the (mutated in place) HF model
    trainable_parameters: int

    def info(self) -> dict:
        """run_info's `adapter`."""
        return {**self.settings, "target_modules": list(self.settings["target_modules"]),
                "trainable_parameters": self.trainable_parameters}


def lora_config(adapter: dict, head: str):
    from peft import LoraConfig
    if adapter.get("type") != "lora":
        raise TrainConfigError(f"train.adapter.type = {adapter.get('type')!r}: only lora is supported")
    return LoraConfig(r=int(adapter["r"]), lora_alpha=float(adapter["alpha"]), lora_dropout=float(adapter["dropout"]),
                      target_modules=list(adapter["target_modules"]), bias="none",
                      modules_to_save=["score"] if head == "score" else None)


def check_adapter_settings(adapter: dict | None, settings, hf: nn.Module, head: str) -> None:
    """Refuse what the adapters cannot do here, naming the knob (before the model is changed)."""
    if adapter is None:
        return
    names = dict(hf.named_modules())
    head_names = {n for n, m in names.items() if m is hf.get_output_embeddings()} if head == "lm_head" else set()
    for target in adapter["target_modules"]:
        hits = [n for n in names if n == target or n.endswith("." + target)]
        if not hits:
            raise TrainConfigError(f"train.adapter.target_modules: {target!r} names no module of "
                                   f"{type(hf).__name__}")
        if set(hits) & head_names:
            raise TrainConfigError(f"train.adapter.target_modules: {target!r} matches the LM head, whose weight the "
                                   "chunked log-probs read directly (an adapter there would be skipped)")
        if head == "score" and any(h == "score" for h in hits):
            raise TrainConfigError("train.adapter.target_modules: 'score' is the reward head, which trains in full "
                                   "beside the adapters")
        if not all(isinstance(names[h], nn.Linear) for h in hits):
            raise TrainConfigError(f"train.adapter.target_modules: {target!r} matches modules that are not "
                                   f"nn.Linear ({sorted({type(names[h]).__name__ for h in hits})})")


def attach_adapter(hf: nn.Module, adapter: dict, head: str) -> Adapter:
    """Inject LoRA into `hf` in place (the base frozen, a reward head trainable); torch RNG initialises lora_A
    (seed first: same init on every rank)."""
    from peft import get_peft_model
    config = lora_config(adapter, head)
    peft_model = get_peft_model(hf, config, adapter_name=ADAPTER_NAME)
    if peft_model.base_model.model is not hf:
        raise RuntimeError("peft did not inject the adapters into the model in place")
    trainable = sum(p.numel() for p in hf.parameters() if p.requires_grad)
    return Adapter(dict(adapter), config, peft_model, trainable)


def adapter_state_dict(adapter: Adapter, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft's saved form (adapter name removed, `base_model.model.` keys) of the adapter weights (and the reward
    head) in `hf_state` (the HF model's state dict, keys as hf.state_dict()), as contiguous fp32 CPU copies."""
    from peft import get_peft_model_state_dict
    state = get_peft_model_state_dict(adapter.peft_model, state_dict={PEFT_PREFIX + k: v for k, v in hf_state.items()},
                                      adapter_name=ADAPTER_NAME)
    return {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in state.items()}


def save_adapter_dir(adapter: Adapter, state: dict[str, torch.Tensor], out_dir: Path) -> None:
    """peft's save_pretrained layout, written without its model card and with no machine-specific base path
    (the directory is a hashed artifact): adapter_config.json + adapter_model.safetensors."""
    import copy

    from safetensors.torch import save_file
    out_dir.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(adapter.config)
    config.base_model_name_or_path = None
    config.inference_mode = True
    config.save_pretrained(str(out_dir))
    # peft keeps target_modules as a set, written in hash order: sort it, so the same run writes the same bytes.
    path = out_dir / "adapter_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    for key in ("target_modules", "modules_to_save"):
        if isinstance(cfg.get(key), list):
            cfg[key] = sorted(cfg[key])
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    save_file(state, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})


def merged_model(adapter: Adapter, base: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """`base` (a fresh load of the base weights) with the trained adapter loaded and merged: W + (alpha / r) B A,
    the reward head replaced by the trained one. Returns the plain HF model."""
    from peft import get_peft_model, set_peft_model_state_dict
    peft_model = get_peft_model(base, lora_config(adapter.settings, "score" if adapter.config.modules_to_save
                                                  else "lm_head"), adapter_name=ADAPTER_NAME)
    result = set_peft_model_state_dict(peft_model, state, adapter_name=ADAPTER_NAME)
    bad = [k for k in result.unexpected_keys]
    missing = [k for k in result.missing_keys if "lora_" in k or "modules_to_save" in k]
    if bad or missing:
        raise RuntimeError(f"adapter state does not fit the base model: unexpected {bad[:4]}, missing {missing[:4]}")
    with torch.no_grad():
        return peft_model.merge_and_unload()
