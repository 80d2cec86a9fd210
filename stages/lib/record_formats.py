"""The format version of every JSON record a stage writes: the one place each is declared.

A record carries its version in its `format` field ("prefpipe-<record>/<n>"); a record written before the field
existed has none. Every field of a record is written every time (null where unset): a record's bytes change
with its format, never with whether an option happens to be set. Changing a record's fields bumps its version
here, so a reader (a checkpoint resume, `report verify`) names the version it got and the one it reads instead of
taking one record for the other.

The formats that predate this module stay beside their readers and writers, one place each:
stages/lib/environment.py RECORD_FORMAT, stages/lib/reference.py LOCK_FORMAT / IDENTITY_FORMAT /
HASH_CACHE_FORMAT, stages/evidence/bundle.py FORMAT (the evidence bundle's manifest). docs/ARTIFACTS.md
"Record formats" lists them all (tests/lib/test_record_formats.py checks the list).
"""
from __future__ import annotations

NORMALIZE_STATS = "prefpipe-normalize-stats/1"            # results/normalize/normalize_stats.json
PROBE_MANIFEST = "prefpipe-probe-manifest/1"              # results/probe/probe_manifest.json
PROBE_TOKEN_MANIFEST = "prefpipe-probe-token-manifest/1"  # results/tokens/probe_token_manifest.json
TOKENIZE_REPORT = "prefpipe-tokenize-report/1"            # results/tokens/tokenize_report.json
SFT_DATA = "prefpipe-sft-data/2"                          # results/sft/sft_data.json (2: both modes' fields)
RUN_INFO = "prefpipe-run-info/1"                          # results/{sft,train_dpo,train_rm}/run_info.json
CHECKPOINT = "prefpipe-checkpoint/3"                      # checkpoints/<stage>/step_*/meta.json (was format_version 2)
PROBE_METRICS = "prefpipe-probe-metrics/1"                # metrics/dpo.json, metrics/rm.json
BOOTSTRAP_SUMMARY = "prefpipe-bootstrap-summary/1"        # results/evaluate/bootstrap_summary.json
GENERATION_INFO = "prefpipe-generation-info/1"            # results/generate/generation_info.json
GENERATION_METRICS = "prefpipe-generation-metrics/1"      # metrics/generation.json (a round's judge/generation.json)
JUDGE_SUMMARY = "prefpipe-judge-summary/1"                # results/judge/judge_summary.json
ROUND_PAIRS_REPORT = "prefpipe-round-pairs-report/1"      # results/rounds/<k>/pairs/pairs_report.json
ROUNDS_METRICS = "prefpipe-rounds-metrics/1"              # metrics/rounds.json
