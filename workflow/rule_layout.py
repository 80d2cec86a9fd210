"""The rules against stages/lib/layout.py, checked once every rule is defined (the Snakefile calls it).

stages/lib/layout.py is the list `report verify` holds a bundle to: every stage's outputs must be the layout's,
and the report must read every artifact of the stages before it. An output added to a rule by hand (or left out
of the report's inputs) stops the DAG build here instead of making bundles that verify refuses.
"""
from __future__ import annotations

from stages.lib.layout import ROUND_OUTPUTS, ROUNDS_METRICS, STAGE_OUTPUTS, bundle_artifacts, n_rounds, round_outputs, round_rule


def check_rules_follow_layout(rules, config: dict) -> None:
    expected = {stage: outputs for stage, outputs in STAGE_OUTPUTS.items()}
    expected |= {round_rule(part, k): round_outputs(part, k) for k in range(2, n_rounds(config) + 1)
                 for part in ROUND_OUTPUTS}
    expected["rounds_metrics"] = {"metrics_rounds": ROUNDS_METRICS}
    for stage, outputs in expected.items():
        declared = {str(f) for f in getattr(rules, stage).output}
        if declared != set(outputs.values()):
            raise ValueError(f"rule {stage}: outputs {sorted(declared)} are not stages/lib/layout.py's "
                             f"{sorted(outputs.values())}")
    missing = set(bundle_artifacts(config)) - {str(f) for f in rules.report.input}
    if missing:
        raise ValueError(f"rule report: the evidence bundle would miss {sorted(missing)} (stages/lib/layout.py)")
