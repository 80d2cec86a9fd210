"""Which stages run under given params, and what follows from that: the logic over stages/lib/layout.py's
declarations (the rules, `report verify` and the report read it)."""
from __future__ import annotations

from stages.lib.layout import STAGE_OUTPUTS

# The trained models by the label the report and evaluate give them (metrics/<label>.json, the bundle's
# curves/<label>_train_curves.png, `evaluation.<label>` of its manifest) -> the stage that trains it.
TRAINED: dict[str, str] = {"dpo": "train_dpo", "rm": "train_rm"}


def uses_ref_logps(params: dict) -> bool:
    """Only DPO with a frozen reference reads reference log-probs; `dpo_ref_free` has no ref_logps stage."""
    return params["dpo"]["objective"] == "dpo"


def uses_sft(params: dict) -> bool:
    """params `sft` set (not null, not absent): the sft stage runs, and its export is the reference."""
    return params.get("sft") is not None


def reference_identity(params: dict) -> str:
    """The identity every stage after tokenize loads the reference through: the sft stage's pinned export when SFT
    runs, else verify_ref's identity of the pinned snapshot (the tokenizer, the same in both, is verify_ref's)."""
    return STAGE_OUTPUTS["sft"]["identity"] if uses_sft(params) else STAGE_OUTPUTS["verify_ref"]["identity"]


def pinned_models(params: dict) -> list[str]:
    """The generation models params pin instead of taking them from training ("policy", "judge")."""
    return [role for role in ("policy", "judge") if isinstance(params["generation"][role], dict)]


def pinned_model_inputs(params: dict, role: str) -> dict[str, str | list[str]]:
    """verify_<role>'s inputs for a pinned model: its directory, and a local pin's lock (which changes with any
    file); empty lists when `role` is trained here."""
    if role not in pinned_models(params):
        return {"model_dir": [], "lock": []}
    pin = params["generation"][role]
    return {"model_dir": pin["local_dir"],
            "lock": [f"{pin['local_dir']}/prefpipe.lock.json"] if pin["source"] == "local" else []}

def stages(params: dict) -> list[str]:
    """The pipeline's stages under these params, in the order above."""
    optional = {"ref_logps": uses_ref_logps(params), "sft": uses_sft(params),
                **{f"verify_{role}": role in pinned_models(params) for role in ("policy", "judge")}}
    return [s for s in STAGE_OUTPUTS if optional.get(s, True)]


def bundle_artifacts(params: dict) -> dict[str, str]:
    """{path: stage} of every artifact an evidence bundle's manifest hashes: the outputs of every stage
    before report (report's own outputs are the bundle)."""
    return {path: stage for stage in stages(params) if stage != "report"
            for path in STAGE_OUTPUTS[stage].values()}
