"""Load params.yaml and validate it against workflow/schemas/params.schema.yaml.

The same schema is used by the Snakefile (snakemake.utils.validate) and by every stage CLI, so a
stage run by hand or by `dvc repro` refuses a bad knob with the same message.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "workflow" / "schemas" / "params.schema.yaml"


class ParamsError(ValueError):
    """params.yaml does not satisfy the schema; the message names the key path and the reason."""


def load_schema() -> dict:
    with open(SCHEMA_PATH, encoding="utf-8") as f:
        return yaml.safe_load(f)


def validate_params(params: dict, source: str = "params.yaml") -> dict:
    validator = jsonschema.Draft202012Validator(load_schema())
    errors = sorted(validator.iter_errors(params), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        lines = []
        for e in errors:
            where = ".".join(str(p) for p in e.absolute_path) or "<top level>"
            lines.append(f"  {where}: {e.message}")
        raise ParamsError(f"{source} is invalid:\n" + "\n".join(lines))
    return params


def load_params(path: str | os.PathLike = "params.yaml") -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        params = yaml.safe_load(f)
    if not isinstance(params, dict):
        raise ParamsError(f"{path}: expected a mapping at the top level, got {type(params).__name__}")
    return validate_params(params, str(path))
