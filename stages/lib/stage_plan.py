"""Which stages run under given params, and what follows from that: the logic over stages/lib/layout.py's
declarations (the rules, `report verify` and the report read it)."""
from __future__ import annotations

from stages.lib.layout import DEV_OUTPUTS, ROUND_OUTPUTS, ROUNDS_METRICS, STAGE_OUTPUTS

# The trained models by the label the report and evaluate give them (metrics/<label>.json, the bundle's
# curves/<label>_train_curves.png, `evaluation.<label>` of its manifest) -> the stage that trains it.
TRAINED: dict[str, str] = {"dpo": "train_dpo", "rm": "train_rm"}


def uses_ref_logps(params: dict) -> bool:
    """Only DPO with a frozen reference reads reference log-probs; `dpo_ref_free` has no ref_logps stage."""
    return params["dpo"]["objective"] == "dpo"


def uses_sft(params: dict) -> bool:
    """params `sft` set (not null, not absent): the sft stage runs, and its export is the reference."""
    return params.get("sft") is not None


def uses_dev(params: dict) -> bool:
    """probe.dev_size > 0 (absent = 0): a dev split is frozen beside the probe and scored during training."""
    return int(params["probe"].get("dev_size", 0)) > 0


def stage_outputs(params: dict, stage: str) -> dict[str, str]:
    """A stage's outputs under these params: its STAGE_OUTPUTS, plus its DEV_OUTPUTS when a dev split is on."""
    return {**STAGE_OUTPUTS[stage], **(DEV_OUTPUTS.get(stage, {}) if uses_dev(params) else {})}


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
    out = {path: stage for stage in stages(params) if stage != "report"
           for path in stage_outputs(params, stage).values()}
    if n_rounds(params) > 1:       # the rounds' record, packed (summary.md's rounds table); their models stay outside
        out[ROUNDS_METRICS] = "rounds_metrics"
    return out


def n_rounds(params: dict) -> int:
    """dpo.rounds (absent = 1: offline DPO only)."""
    return int(params["dpo"].get("rounds", 1))


def round_outputs(part: str, k: int) -> dict[str, str]:
    """Round k's (>= 2) outputs of one part (ROUND_OUTPUTS' keys)."""
    if k < 2:
        raise ValueError(f"round {k}: round 1 is the offline DPO's stages (train_dpo, generate, judge)")
    return {name: path.format(k=k) for name, path in ROUND_OUTPUTS[part].items()}


def round_rule(part: str, k: int) -> str:
    return f"round{k}_{part}"


# round{k}_<part> rules read params as these stages do (stages/lib/layout.py STAGE_PARAMS).
ROUND_DECLARATION = {"pairs": "round_pairs", "ref_logps": "ref_logps", "train_dpo": "round_train_dpo",
                     "generate": "generate", "judge": "judge"}


def rule_declaration(rule: str) -> str:
    """The STAGE_PARAMS entry a rule's params come from: its own name, or its part's for round{k}_<part>."""
    import re
    m = re.fullmatch(r"round\d+_(\w+)", rule)
    return ROUND_DECLARATION[m.group(1)] if m else rule
