# Shared by every rule file: artifact paths (one place, so rules and tests agree on names).

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

RESULTS = "results"
LOGS = "logs"

# Final artifacts requested by `rule all`; extended as stages land.
FINAL_TARGETS = [
    f"{RESULTS}/report/evidence.tar.gz",
]


# The environment record (rule `environment`): an input of every stage, since every artifact's bytes
# depend on library versions (parquet writers, tokenizers, RNGs, kernels) and the numeric ones on the
# CPU dispatch / GPU as well. The lock is the environment the README installs.
ENV_RECORD = f"{RESULTS}/env/environment.json"
LOCK = "requirements/lock.txt"
