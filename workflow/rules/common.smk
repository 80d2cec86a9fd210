# Shared by every rule file: artifact paths (one place, so rules and tests agree on names).

RESULTS = "results"
LOGS = "logs"

# Final artifacts requested by `rule all`; extended as stages land.
FINAL_TARGETS = [
    f"{RESULTS}/report/evidence.tar.gz",
]


# A stage module's source file: a code dependency in both Snakemake and DVC.
py = "stages/{}.py".format


LIB = ["stages/lib/io.py", "stages/lib/params.py"]
