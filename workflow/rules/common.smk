# Shared by every rule file. Artifact paths come from stages/lib/layout.py (OUT[stage][output name]): one
# list that the rules, the evidence bundle and `report verify` read, so they cannot disagree.

import sys
from pathlib import Path

# Rule files import the stage modules that own a rule-time question (which files a source names, the
# installed environment): the repository root must be importable whatever the working directory.
_REPO = str(Path(workflow.main_snakefile).resolve().parent)
for _path in (_REPO, str(Path(_REPO) / "workflow")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

# A rule's code inputs are computed from its stage module's imports (workflow/code_deps.py): every
# stages/ file the stage runs, so editing one reruns exactly the stages that import it.
from code_deps import code_deps
from stages.lib.layout import STAGE_OUTPUTS as OUT
from stages.lib.stage_plan import uses_dev, uses_ref_logps
from stages.lib.layout import DEV_OUTPUTS
# A rule's params are the params.yaml keys its stage declares (stages/lib/layout.py STAGE_PARAMS; the stage can read
# no other), plus `cli_` values; the schema is an input of a stage that reads a key it may default.
from rule_layout import defaults_input, rule_params

LOGS = "logs"

# Final artifacts requested by `rule all`; extended as stages land.
FINAL_TARGETS = [
    OUT["report"]["bundle"],
]


# The environment record (rule `environment`): an input of every stage, since every artifact's bytes
# depend on library versions (parquet writers, tokenizers, RNGs, kernels) and the numeric ones on the
# CPU dispatch / GPU as well. The lock is the environment the README installs.
ENV_RECORD = OUT["environment"]["record"]
LOCK = "requirements/lock.txt"

# tokenize.chat_template (stages/data/chat_templates.py): every stage that renders a conversation (freeze_probe's fit,
# tokenize, sft, the exports of train_dpo / train_rm, generate and judge's turn closing) reads the setting (each declares
# tokenize.chat_template: stages/lib/layout.py) and, when it is a Jinja file, the file (CHAT_TEMPLATE_FILE, an input).
from stages.data.chat_templates import template_input

CHAT_TEMPLATE_FILE = template_input(config["tokenize"])


# The dev split (probe.dev_size > 0, issue 37): its outputs (stages/lib/layout.py DEV_OUTPUTS) join their stages'
# outputs, and their flags the shell lines (`cli_dev*` params, empty without one), only then; without one every
# rule's outputs, shell line and dvc.yaml entry is as it was.
DEV = uses_dev(config)
DEV_OUT = {stage: outputs if DEV else {} for stage, outputs in DEV_OUTPUTS.items()}
DEV_TOKENS = DEV_OUTPUTS["tokenize"]["dev_tokens"] if DEV else []
# The training stages' and ref_logps' flag (a `cli_` param, set next to the line's last word: "" leaves it unchanged).
CLI_DEV_TOKENS = f" --dev-tokens {DEV_TOKENS}" if DEV else ""
