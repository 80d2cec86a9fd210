"""The run's evidence: the metrics the stages compute and the bundle the report stage writes and `report verify`
checks. The metrics: the probe's checks, scores and paired bootstrap and the generation evaluation (scoring.py:
evaluate, judge, rounds_metrics), the iterative rounds' pairs and record (rounds.py: round_pairs, rounds_metrics).
The bundle: its format and members (bundle.py), the run's records packed whole and the summary's sections from them
(records.py), the generation evaluation's part (generation.py), the verification (verify.py) and the numeric
comparison both recompute with (compare.py). Verify recomputes the metrics with the same scoring.py the stages ran.
Only stage modules (and through report `prefpipe verify`) import this package; it imports stages.lib only."""
