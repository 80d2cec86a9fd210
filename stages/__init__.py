"""Stages of the preference-learning pipeline: one module per stage, each a CLI (python -m stages.X)."""
