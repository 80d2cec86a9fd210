"""The evidence the report stage writes and `report verify` checks: the bundle's format and members (bundle.py), the
run's records packed whole and the summary's sections from them (records.py), the generation evaluation's part
(generation.py), the verification (verify.py) and the numeric comparison both recompute with (compare.py). Only the
report stage (and through it `prefpipe verify`) imports this package; it imports stages.lib only."""
