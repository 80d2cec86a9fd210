"""The trained model as a Hugging Face directory others load: a causal LM (DPO) or a sequence-classification
model with its scalar head (RM), tokenizer files beside it, a reward model's tokenizer padding with the id
its pooling skips. Refuses an export that would not carry the head its objective trained.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from stages.engine.adapters import ADAPTER_SUBDIR, Adapter, adapter_state_dict, merged_model, save_adapter_dir
from stages.engine.dist import DistEnv
from stages.engine.optim import trained_params
from stages.engine.settings import TrainSettings
from stages.lib.contracts import TOKENIZER_FILES
from stages.engine.modeling import TOKENIZER_MARKERS


class ExportError(ValueError):
    """The model to export does not carry the head its objective trained."""


def check_export_head(hf: nn.Module, head: str) -> None:
    """A reward model exports only as a sequence-classification model with its scalar `score` head (a
    causal-LM export would silently drop the head) and a pad_token_id (HF's pooling reads the last token
    != it, as training did); a policy only as a causal LM with its LM head."""
    cls = type(hf).__name__
    if head == "score":
        score = getattr(hf, "score", None)
        if not cls.endswith("ForSequenceClassification") or not isinstance(score, nn.Linear) or score.out_features != 1:
            raise ExportError(f"refusing to export a reward model as {cls}: only a sequence-classification model "
                              "with a scalar `score` head (num_labels=1) keeps the trained head")
        if hf.config.pad_token_id is None:
            raise ExportError("refusing to export a reward model without config.pad_token_id: HF's pooling would "
                              "read another token than the one trained (the last token != the pad id)")
    elif head == "lm_head":
        if cls.endswith(("ForSequenceClassification", "ForTokenClassification")) or hf.get_output_embeddings() is None:
            raise ExportError(f"refusing to export a policy as {cls}: a DPO policy exports as a causal LM with its "
                              "LM head")
    else:
        raise ExportError(f"refusing to export: unknown head kind {head!r}")


def export_tokenizer_pad(export_dir: Path, pad_token_id: int) -> None:
    """A reward model's exported tokenizer pads with config.pad_token_id, the id HF's pooling skips, so a
    batch right-padded by the tokenizer scores as trained. A tokenizer without a pad token (GPT-2, Llama)
    gets the token of that id (EOS, as the trainer chose) written into tokenizer_config.json (and
    special_tokens_map.json, if any); every other tokenizer file stays as copied. Checked by loading it back."""
    export_dir = Path(export_dir)
    if not any((export_dir / name).exists() for name in TOKENIZER_MARKERS):
        return                                     # no tokenizer to export: the config alone decides
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(export_dir))
    if tok.pad_token_id is None:
        token = tok.convert_ids_to_tokens(int(pad_token_id))
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            path = export_dir / name
            if path.exists() or name == "tokenizer_config.json":
                cfg = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
                cfg["pad_token"] = token
                path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        tok = AutoTokenizer.from_pretrained(str(export_dir))
    if tok.pad_token_id != pad_token_id:
        raise ExportError(f"refusing to export a reward model whose tokenizer pads with id {tok.pad_token_id} "
                          f"({tok.pad_token!r}) while config.pad_token_id = {pad_token_id}: a padded batch would "
                          "be scored at another token than the one trained")


def export_adapter(adapter: Adapter, hf_state: dict, objective, settings: TrainSettings, src_dir: Path,
                   tmp: Path) -> list[Path]:
    """train.adapter's export into `tmp`: merged (the HF model, W + (alpha / r) B A folded into a fresh fp32 load of
    the base weights, so a bf16 run's frozen base is not rounded into it), adapter (peft's directory) or both
    (merged, and the adapter directory in ADAPTER_SUBDIR). Returns the directories that get the tokenizer."""
    state = adapter_state_dict(adapter, hf_state)
    kind = adapter.settings["export"]
    dirs = [tmp]
    if kind in ("merged", "both"):
        merged = merged_model(adapter, objective.hf_model(objective.build_module(src_dir, settings)), state)
        check_export_head(merged, objective.head)
        merged.save_pretrained(tmp)
    if kind == "adapter":
        save_adapter_dir(adapter, state, tmp)
    elif kind == "both":
        save_adapter_dir(adapter, state, tmp / ADAPTER_SUBDIR)
        dirs.append(tmp / ADAPTER_SUBDIR)
    return dirs


def host_state_dict(hf: nn.Module, optimizer: torch.optim.Optimizer, trained_only: bool = False) -> dict:
    """`hf.state_dict()` as CPU tensors copied one tensor at a time, so an export allocates nothing on the device.
    Where the optimizer keeps fp32 masters (`master_params`): what `hf.float()` followed by copying the masters into
    their parameters would make it, the masters (what was trained, not their rounded bf16 working copies) for the
    optimizer's parameters and every other floating tensor upcast (exactly) to fp32 -- converting the model itself
    held an fp32 copy of it on the device beside the optimizer state (+4 bytes a parameter, 28 GiB at 7B, past the
    memory plan's peak). Each parameter is its own tensor here: the CUDA-graph path's parameters are views of one
    flat buffer, which save_pretrained would take for shared storage and clone on the device. A parameter under
    several names (tied embeddings) stays one tensor, so save_pretrained drops the same alias. trained_only: only
    the optimizer's parameters (an adapter's export reads only those; the frozen base would cost host memory)."""
    params = trained_params(optimizer)
    masters = getattr(optimizer, "master_params", None)
    master_of = dict(zip(map(id, params), masters)) if masters is not None else {}
    trained = {id(p) for p in params}
    copies: dict[int, torch.Tensor] = {}
    state = {}
    for name, t in hf.state_dict(keep_vars=True).items():
        if trained_only and id(t) not in trained:
            continue
        if id(t) not in copies:
            value = master_of.get(id(t), t).detach().to("cpu", copy=True)
            copies[id(t)] = value.float() if masters is not None and value.is_floating_point() else value
        state[name] = copies[id(t)]
    return state


def save_state_dtype(hf: nn.Module, state: dict | None, directory: Path) -> None:
    """save_pretrained records the model's own dtype in config.json; a saved state of another (one) floating dtype
    (fp32 masters of a bf16 model) is recorded as that dtype, the config a model in that dtype would write."""
    dtypes = {v.dtype for v in (state or {}).values() if v.is_floating_point()}
    if len(dtypes) == 1 and (dtype := dtypes.pop()) != hf.dtype:
        hf.config.dtype = str(dtype).split(".")[1]      # as save_pretrained writes it
        hf.config.save_pretrained(directory)


def export_model(module: nn.Module, objective, settings: TrainSettings, env: DistEnv, src_dir: Path,
                 out_dir: Path, adapter: Adapter | None = None, state: dict | None = None,
                 extra_files: dict[str, str] | None = None) -> None:
    """HF directory: a causal LM (DPO) or a sequence-classification model with its scalar head (RM); with
    train.adapter, as its `export` says (export_adapter). Tokenizer files are copied from the source directory so
    the export is usable on its own; a reward model's tokenizer pads with its config.pad_token_id
    (export_tokenizer_pad). state: the tensors to save instead of the module's own (rank 0's; host_state_dict),
    config.json recording their dtype. extra_files {name: text}: written beside the tokenizer, over a copied file
    of that name (the stage's chat_template.jinja, which renders as tokenize did: stages/data/pair_tokenizer.py); a
    legacy chat_template.json is then left out, so the one template is the loaded one."""
    hf = objective.hf_model(module)
    if adapter is None:                # with adapters the head is checked on the merged model
        check_export_head(hf, objective.head)
    if settings.parallel == "fsdp2":   # collective: every rank takes part
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        prefix = next(name for name, child in module.named_children() if child is hf) + "."
        state = {k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}
        # The gathered copies no longer share storage: drop the aliases of tied weights (lm_head = embeddings)
        # so the export has the same tensors as a DDP run's.
        first_name: dict[int, str] = {}
        for name, p in hf.named_parameters(remove_duplicate=False):
            if first_name.setdefault(id(p), name) != name:
                state.pop(name, None)
    if env.is_main:
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if adapter is None:
            hf.save_pretrained(tmp, state_dict=state)
            save_state_dtype(hf, state, tmp)
            dirs = [tmp]
        else:
            # FSDP2: the full state gathered above (the adapters' weights are sharded like the rest).
            dirs = export_adapter(adapter, hf.state_dict() if state is None else state, objective, settings,
                                  Path(src_dir), tmp)
        for d in dirs:
            # The tokenizer (every file contracts.TOKENIZER_FILES names) and the generation defaults beside it.
            for name in (*TOKENIZER_FILES, "generation_config.json"):
                if (Path(src_dir) / name).exists() and not (d / name).exists():
                    shutil.copy2(Path(src_dir) / name, d / name)
            for name, text in (extra_files or {}).items():
                (d / name).write_text(text, encoding="utf-8")
                if name == "chat_template.jinja":
                    (d / "chat_template.json").unlink(missing_ok=True)
            if objective.head == "score":
                export_tokenizer_pad(d, hf.config.pad_token_id)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    dist.barrier(group=env.control_group)

