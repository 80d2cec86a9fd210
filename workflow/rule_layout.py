"""The rules against stages/lib/layout.py, checked once every rule is defined (the Snakefile calls it); and the
rule params each stage's declaration gives (`rule_params`).

stages/lib/layout.py is the list `report verify` holds a bundle to: every stage's outputs must be the layout's,
and the report must read every artifact of the stages before it. An output added to a rule by hand (or left out
of the report's inputs) stops the DAG build here instead of making bundles that verify refuses.

It also declares the params.yaml keys each stage reads (STAGE_PARAMS; a stage can read no other:
stages/lib/declared_params.py). A rule's params are exactly those keys (`**rule_params(config, stage)`, plus
`cli_`/`env_` values that are no params.yaml key), so Snakemake and DVC (dvc.yaml is generated from the rules)
rerun a stage when a key it reads changes, and only then. A stage that reads a key whose value the schema may
supply (a default) has the schema's defaults (their generated file) as an input too.
"""
from __future__ import annotations

from pathlib import Path

from stages.lib.layout import ROUND_OUTPUTS, ROUNDS_METRICS, STAGE_OUTPUTS, STAGE_PARAMS
from stages.lib.stage_plan import (bundle_artifacts, n_rounds, round_outputs, round_rule, rule_declaration,
                                   stage_outputs)
from stages.lib.params import ABSENT, DEFAULTS_PATH, dotted_lookup, load_defaults

DEFAULTS = str(DEFAULTS_PATH.relative_to(Path(__file__).resolve().parents[1]))


def rule_params(config: dict, stage: str) -> dict:
    """{rule param name: value} of every params.yaml key `stage` declares that params.yaml sets (`train__lr` is
    train.lr: workflow/sync_dvc.py maps `__` to the dot). A declared key params.yaml leaves out (an optional one)
    is not listed: setting it later changes the rule's params, so the stage reruns."""
    keys = [k for k in config] if STAGE_PARAMS[stage] == ("*",) else STAGE_PARAMS[stage]
    out = {}
    for key in keys:
        value = dotted_lookup(config, key)
        if value is not ABSENT:
            out[key.replace(".", "__")] = value
    return out


def reads_schema_defaults(stage: str) -> bool:
    """Whether a key `stage` declares can take its value from a schema default (then the defaults are its input)."""
    declared = STAGE_PARAMS[stage]
    return any(d == "*" or p == d or p.startswith(d + ".") or d.startswith(p + ".")
               for d in declared for p in load_defaults())


def defaults_input(stage: str) -> list[str]:
    """The schema's defaults (their generated file) as `stage`'s input when it reads a defaulted key, else nothing."""
    return [DEFAULTS] if reads_schema_defaults(stage) else []


def check_rules_follow_layout(rules, config: dict) -> None:
    expected = {stage: stage_outputs(config, stage) for stage in STAGE_OUTPUTS}
    expected |= {round_rule(part, k): round_outputs(part, k) for k in range(2, n_rounds(config) + 1)
                 for part in ROUND_OUTPUTS}
    if n_rounds(config) > 1:
        expected["rounds_metrics"] = {"metrics_rounds": ROUNDS_METRICS}
    for name, outputs in expected.items():
        rule = getattr(rules, name)
        stage = rule_declaration(name)
        declared = {str(f) for f in rule.output}
        if declared != set(outputs.values()):
            raise ValueError(f"rule {name}: outputs {sorted(declared)} are not stages/lib/layout.py's "
                             f"{sorted(outputs.values())}")
        listed = {p for p in rule.params.keys() if not p.startswith(("cli_", "env_"))}
        wanted = set(rule_params(config, stage))
        if listed != wanted:
            raise ValueError(f"rule {name}: params {sorted(listed)} are not its declaration's {sorted(wanted)} "
                             f"(stages/lib/layout.py STAGE_PARAMS[{stage!r}]; rules take "
                             f"`**rule_params(config, {stage!r})`)")
        if reads_schema_defaults(stage) and DEFAULTS not in {str(f) for f in rule.input}:
            raise ValueError(f"rule {name}: reads a key the schema may default; {DEFAULTS} must be an input "
                             f"(`defaults=defaults_input({stage!r})`)")
    missing = set(bundle_artifacts(config)) - {str(f) for f in rules.report.input}
    if missing:
        raise ValueError(f"rule report: the evidence bundle would miss {sorted(missing)} (stages/lib/layout.py)")
