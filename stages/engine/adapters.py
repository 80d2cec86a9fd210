"""Parameter-efficient training: LoRA adapters (peft) on the HF model inside SequenceLogProbs / SequenceRewards.

`train.adapter: {type: lora, r, alpha, dropout, target_modules, export}` (null = full fine-tuning, the default);
only `type` is required, the other keys take the schema's defaults (stages.lib.params.resolved_train fills them
before the settings reach here). `target_modules: all-linear` is peft's keyword: every nn.Linear but the output
layer, expanded here (target_module_names) so the checks below see the modules it names and the reward head
`score` is left out too (peft's own expansion would target it on a model without output embeddings).

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
ALL_LINEAR = "all-linear"                  # peft's keyword (peft.utils.constants.INCLUDE_LINEAR_LAYERS_SHORTHAND)
PEFT_PREFIX = "base_model.model."          # where PeftModel.state_dict() puts the HF model's keys
ADAPTER_SUBDIR = "adapter"                 # export: both -> model/adapter/


@dataclass
class Adapter:
    settings: dict                          # train.adapter as validated by the schema, defaults filled
    config: object                          # peft.LoraConfig
    peft_model: object                      # peft.PeftModel around the (mutated in place) HF model
    trainable_parameters: int
    targets: list[str]                      # the module names LoRA is on (all-linear expanded)

    def info(self) -> dict:
        """run_info's `adapter` (with all-linear, also the module names it was expanded to)."""
        given = self.settings["target_modules"]
        return {**self.settings, "target_modules": given if isinstance(given, str) else list(given),
                **({"resolved_target_modules": list(self.targets)} if isinstance(given, str) else {}),
                "trainable_parameters": self.trainable_parameters}


def _head_names(hf: nn.Module, head: str) -> set[str]:
    """The module paths of the model's output layer: the LM head, or the reward model's `score` head."""
    names = dict(hf.named_modules())
    if head == "lm_head":
        return {n for n, m in names.items() if m is hf.get_output_embeddings()}
    return {n for n in names if n == "score" or n.endswith(".score")}


def target_module_names(adapter: dict, hf: nn.Module, head: str) -> list[str]:
    """train.adapter.target_modules as module names: a list as written; all-linear = every nn.Linear of `hf` but
    its output layer (peft's rule), as the sorted distinct last components of their paths (q_proj, ..., which
    peft matches as path suffixes), or as full paths where a last component is also the output layer's."""
    given = adapter["target_modules"]
    if not isinstance(given, str):
        return list(given)
    if given != ALL_LINEAR:
        raise TrainConfigError(f"train.adapter.target_modules: {given!r}: a list of module names, or {ALL_LINEAR}")
    heads = _head_names(hf, head)
    linear = sorted(n for n, m in hf.named_modules() if isinstance(m, nn.Linear) and n not in heads)
    if not linear:
        raise TrainConfigError(f"train.adapter.target_modules: {ALL_LINEAR} names no module of {type(hf).__name__} "
                               "(it has no nn.Linear besides its output layer)")
    last = {n.rsplit(".", 1)[-1] for n in heads}
    short = sorted({n.rsplit(".", 1)[-1] for n in linear})
    return linear if set(short) & last else short


def lora_config(adapter: dict, head: str, targets: list[str]):
    from peft import LoraConfig
    if adapter.get("type") != "lora":
        raise TrainConfigError(f"train.adapter.type = {adapter.get('type')!r}: only lora is supported")
    return LoraConfig(r=int(adapter["r"]), lora_alpha=float(adapter["alpha"]), lora_dropout=float(adapter["dropout"]),
                      target_modules=list(targets), bias="none",
                      modules_to_save=["score"] if head == "score" else None)


def check_adapter_settings(adapter: dict | None, settings, hf: nn.Module, head: str) -> None:
    """Refuse what the adapters cannot do here, naming the knob (before the model is changed)."""
    if adapter is None:
        return
    names = dict(hf.named_modules())
    head_names = {n for n, m in names.items() if m is hf.get_output_embeddings()} if head == "lm_head" else set()
    for target in target_module_names(adapter, hf, head):
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
    targets = target_module_names(adapter, hf, head)
    config = lora_config(adapter, head, targets)
    peft_model = get_peft_model(hf, config, adapter_name=ADAPTER_NAME)
    if peft_model.base_model.model is not hf:
        raise RuntimeError("peft did not inject the adapters into the model in place")
    trainable = sum(p.numel() for p in hf.parameters() if p.requires_grad)
    return Adapter(dict(adapter), config, peft_model, trainable, targets)


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
                                                  else "lm_head", adapter.targets), adapter_name=ADAPTER_NAME)
    result = set_peft_model_state_dict(peft_model, state, adapter_name=ADAPTER_NAME)
    bad = [k for k in result.unexpected_keys]
    missing = [k for k in result.missing_keys if "lora_" in k or "modules_to_save" in k]
    if bad or missing:
        raise RuntimeError(f"adapter state does not fit the base model: unexpected {bad[:4]}, missing {missing[:4]}")
    with torch.no_grad():
        return peft_model.merge_and_unload()
