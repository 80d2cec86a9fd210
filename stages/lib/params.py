"""Load params.yaml and check it before anything runs: the one pre-flight of the pipeline's knobs.

`load_params` (every stage CLI) and the Snakefile (at DAG build, before any rule is defined) run the same
`preflight_params`, so a bad knob is refused with the same message whichever tool meets it first:

* the file is read by a strict YAML loader: a key written twice in one mapping is refused, naming the key and
  both lines (PyYAML and Snakemake keep the last silently, while DVC refuses the file);
* every number must be finite (`.nan`, `.inf` pass the schema's bounds: NaN compares false with every bound);
* workflow/schemas/params.schema.yaml, each error naming the key path and what is allowed there;
* with `gpus_here=True` (the Snakefile, when jobs run on this machine), `train.gpus` must not exceed the NVIDIA
  GPUs this machine shows, counted without importing torch (stages/lib/environment.py `visible_nvidia_gpus`).
"""
from __future__ import annotations

import copy
import math
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from stages.lib.environment import visible_nvidia_gpus

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "workflow" / "schemas" / "params.schema.yaml"
# The schema's defaults alone, {dotted key: default} (generated from the schema by workflow/sync_params_doc.py; its
# --check fails when they drift): what a stage reads of the schema beyond validation, so this file, not the whole
# schema, is the input of the stages that read a defaulted key (a new loss name in the schema's enum reruns none).
DEFAULTS_PATH = SCHEMA_PATH.with_name("params.defaults.json")


class ParamsError(ValueError):
    """params.yaml does not satisfy the schema; the message names the key path and the reason."""


# libyaml's parser where PyYAML has it: the schema (680 lines) is read by every stage, Snakemake and sync_dvc
# process, some twice (0.085 -> 0.009 s a read, the same dict). params.yaml keeps UniqueKeyLoader (its
# duplicate-key check).
_SCHEMA_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_schema() -> dict:
    with open(SCHEMA_PATH, encoding="utf-8") as f:
        return yaml.load(f, Loader=_SCHEMA_LOADER)


# ---------------------------------------------------------------------------------------------
# Strict YAML: no key twice in a mapping
# ---------------------------------------------------------------------------------------------

class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping holding one key twice (ParamsError naming the key path and both
    lines). `source` names the file in the message."""

    source = "params.yaml"

    def construct_document(self, node):
        self._paths: dict[int, str] = {}
        self._index_paths(node, "")
        return super().construct_document(node)

    def _index_paths(self, node, path: str) -> None:
        """Key path of every mapping node, for the message (`train`, `data.sources[0]`)."""
        if isinstance(node, yaml.MappingNode):
            self._paths[id(node)] = path
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    self._index_paths(value, f"{path}.{key.value}" if path else str(key.value))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._index_paths(item, f"{path}[{i}]")

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":   # `<<: *anchor` overrides by design
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.setdefault(key, line)
                except TypeError:           # an unhashable key: SafeLoader's own error names it
                    continue
                if first != line:
                    parent = self._paths.get(id(node), "")
                    raise ParamsError(f"{self.source}: key {parent + '.' if parent else ''}{key} is written twice "
                                      f"(lines {first} and {line}); YAML keeps only one of them: delete the other")
        return super().construct_mapping(node, deep=deep)


def load_yaml_unique(text: str, source: str = "params.yaml") -> Any:
    loader = UniqueKeyLoader(text)
    loader.source = source
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        raise ParamsError(f"{source}: not valid YAML: {e}") from None
    finally:
        loader.dispose()


# ---------------------------------------------------------------------------------------------
# Values: finite numbers, the schema
# ---------------------------------------------------------------------------------------------

def non_finite_keys(node: Any, path: str = "") -> list[str]:
    """Key paths (`train.lr`, `train.adam_betas[1]`) of every NaN or infinite number under `node`."""
    if isinstance(node, float) and not math.isfinite(node):
        return [f"{path or '<top level>'} = {node}"]
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in non_finite_keys(v, f"{path}.{k}" if path else str(k))]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in non_finite_keys(v, f"{path}[{i}]")]
    return []


def _key_path(error: jsonschema.ValidationError) -> str:
    out = ""
    for part in error.absolute_path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top level>"


def _join(path: str, key: str) -> str:
    return key if path == "<top level>" else f"{path}.{key}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_TYPE_WORDS = {"null": "null", "object": "a mapping", "array": "a list", "string": "a string",
               "integer": "an integer", "number": "a number", "boolean": "true or false"}


def _expected(schema: dict) -> str:
    """What one alternative of a oneOf/anyOf accepts, in words (for "must be X or Y")."""
    if "const" in schema:
        return repr(schema["const"])
    if "enum" in schema:
        return f"one of {schema['enum']}"
    kind = schema.get("type")
    if kind == "object" and schema.get("properties"):
        return f"a mapping of {', '.join(schema['properties'])}"
    if kind == "array" and isinstance(schema.get("items"), dict) and "enum" in schema["items"]:
        return "a list of those"
    if kind == "array" and isinstance(schema.get("items"), dict) and schema["items"].get("type"):
        return f"a list of {_TYPE_WORDS.get(schema['items']['type'], schema['items']['type'])[2:].lstrip()}s"
    return _TYPE_WORDS.get(kind, "something else") if isinstance(kind, str) else "something else"


def _json_type(value: Any) -> str:
    return ("null" if value is None else "boolean" if isinstance(value, bool) else "number"
            if isinstance(value, (int, float)) else "string" if isinstance(value, str) else "array"
            if isinstance(value, list) else "object")


def _type_fits(schema: dict, value: Any) -> bool:
    """Whether `value` has the JSON type an alternative declares (by `type`, or by its enum's / const's values)."""
    if isinstance(schema.get("type"), str):
        kind = schema["type"]
        return _json_type(value) == ("number" if kind == "integer" else kind)
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    return values is None or _json_type(value) in {_json_type(v) for v in values}


def _did_you_mean(value: Any, choices) -> str:
    import difflib
    close = (difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.7)
             if isinstance(value, str) else [])
    return f" (did you mean {close[0]!r}?)" if close else ""


def _describe(error: jsonschema.ValidationError) -> list[tuple[str, str]]:
    """(key path, message) lines for one schema error, each naming the key and what is allowed there:
    an unknown key with the allowed ones (and the closest), a missing key, an enum value with the closest
    allowed one; a oneOf/anyOf through the alternative the value's type picks (its own errors, at their own key
    paths), else "must be X or Y" over every alternative."""
    where = _key_path(error)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        allowed = list((error.schema or {}).get("properties") or {})
        return [(_join(where, str(key)), f"unknown key{_did_you_mean(key, allowed)}; the keys of "
                 f"{where} are {', '.join(allowed)}") for key in error.instance if key not in allowed]
    if error.validator == "required" and isinstance(error.instance, dict):
        return [(_join(where, str(key)), "missing (a required key)")
                for key in error.validator_value if key not in error.instance]
    if error.validator == "enum":
        return [(where, f"{_short(error.instance)} is not one of {error.validator_value}"
                        f"{_did_you_mean(error.instance, error.validator_value)}")]
    if error.validator == "const":
        return [(where, f"{_short(error.instance)} is not allowed: must be {error.validator_value!r}")]
    if error.validator not in ("oneOf", "anyOf"):
        return [(where, error.message)]
    alternatives = error.validator_value
    by_branch: dict[int, list[jsonschema.ValidationError]] = {}
    for sub in error.context or ():
        by_branch.setdefault(sub.schema_path[0], []).append(sub)
    # An alternative the value is not even the type of says only "not of type X" (or, for a list of names, that a
    # list is none of them); one it is the type of says why.
    right_type = {b: errs for b, errs in by_branch.items() if _type_fits(alternatives[b], error.instance)}
    value_level = ("const", "enum")
    if len(right_type) == 1:
        (errs,) = right_type.values()
        deeper = [e for e in errs if not (e.validator in value_level and not e.relative_path)]
        if deeper:
            return [line for e in deeper for line in _describe(e)]
    choices = [v for alt in alternatives for v in alt.get("enum", [alt["const"]] if "const" in alt else [])]
    return [(where, f"{_short(error.instance)} is not allowed: must be "
                    f"{' or '.join(_expected(alt) for alt in alternatives)}{_did_you_mean(error.instance, choices)}")]


def validate_params(params: dict, source: str = "params.yaml") -> dict:
    validator = jsonschema.Draft202012Validator(load_schema())
    errors = sorted(validator.iter_errors(params), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        lines = dict.fromkeys(f"  {where}: {message}" for e in errors for where, message in _describe(e))
        raise ParamsError(f"{source} is invalid:\n" + "\n".join(lines))
    return params


# ---------------------------------------------------------------------------------------------
# Defaults the schema declares
# ---------------------------------------------------------------------------------------------

def defaults_of_schema(schema: dict) -> dict[str, Any]:
    """{dotted key path: default} of every key the schema gives a default, inside a oneOf alternative too
    (train.adapter's LoRA block: `train.adapter.r`)."""
    found: dict[str, Any] = {}

    def walk(node, path: str) -> None:
        if not isinstance(node, dict):
            return
        if "default" in node and path:
            found[path] = copy.deepcopy(node["default"])
        for key, sub in (node.get("properties") or {}).items():
            walk(sub, f"{path}.{key}" if path else key)
        for alt in node.get("oneOf", []) + node.get("anyOf", []):
            walk(alt, path)
    walk(schema, "")
    return dict(sorted(found.items()))


def load_defaults() -> dict[str, Any]:
    """The schema's defaults as stages read them: DEFAULTS_PATH (generated from the schema)."""
    import json
    with open(DEFAULTS_PATH, encoding="utf-8") as f:
        return json.load(f)


# train.optimizer's default: exact AdamW state, stepped after backward (engine/settings.py TrainSettings.optimizer).
DEFAULT_OPTIMIZER = {"state": "exact", "fused_backward": False}
# The optional `train` keys and what their absence means: no adapter (full fine-tuning), the default optimizer, every
# step train.epochs make, no dev scoring between step 0 and the end, the last step's weights exported.
TRAIN_OPTIONAL = {"adapter": None, "optimizer": None, "max_steps": None, "eval_every": 0, "select_best": False,
                  "tensorboard": False}
# `train` keys that only choose where a run's curves are also shown: no run record carries them (TrainSettings.record),
# so report verify does not compare them.
TRAIN_DISPLAY_ONLY = frozenset({"tensorboard"})


def resolved_optimizer(optimizer: dict | None) -> dict | None:
    """train.optimizer normalized: None for the default (absent or spelled out), else both keys."""
    if optimizer is None:
        return None
    opt = {**DEFAULT_OPTIMIZER, **optimizer}
    return None if opt == DEFAULT_OPTIMIZER else opt


def resolved_train(train: dict) -> dict:
    """params.yaml's `train` as a run uses it (engine/settings.py TrainSettings; what run_info records and report
    verify compares): every optional key present (TRAIN_OPTIONAL's value when absent), train.optimizer normalized
    (resolved_optimizer), a LoRA block's omitted keys taking the schema's defaults (workflow/schemas/
    params.schema.yaml train.adapter, the one place they are written; read from their generated copy,
    DEFAULTS_PATH, the rules' input)."""
    out = {**TRAIN_OPTIONAL, **train}
    out["optimizer"] = resolved_optimizer(out["optimizer"])
    adapter = out["adapter"]
    if adapter is not None:
        lora = {key.removeprefix("train.adapter."): value for key, value in load_defaults().items()
                if key.startswith("train.adapter.")}
        out["adapter"] = {**lora, **adapter}
    return out


# ---------------------------------------------------------------------------------------------
# Writing keys into params.yaml, keeping its comments and layout
# ---------------------------------------------------------------------------------------------

def _yaml_scalar(value: Any) -> str:
    """`value` as one plain YAML scalar (quoted only where YAML needs it)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10 ** 9).strip()
    return text[:-len("\n...")].strip() if text.endswith("\n...") else text


def set_section_keys(text: str, section: str, values: dict[str, Any], source: str = "params.yaml") -> str:
    """params.yaml's text with `section`'s keys set to `values`, edited in place: every other line, comment and
    the order of keys stay as they are (a key the block lacks is added after its last key; a section the file
    lacks is appended). Refused (ParamsError) when the result does not parse to exactly that change, e.g. a
    section written in flow style or a value spread over several lines."""
    lines = text.splitlines(keepends=True)
    before = yaml.safe_load(text) or {}
    refusal = ParamsError(f"{source}: could not set {section}.{{{', '.join(values)}}} by editing the file in place "
                          f"(is `{section}:` written in flow style, or a value over several lines?): set them by "
                          "hand: " + ", ".join(f"{section}.{k}: {_yaml_scalar(v)}" for k, v in values.items()))
    head = next((i for i, line in enumerate(lines) if re.match(rf"{re.escape(section)}:\s*(#.*)?$", line.rstrip("\n"))),
                None)
    if head is None and section in before:
        raise refusal
    if head is None:
        block = [f"{section}:\n"] + [f"  {k}: {_yaml_scalar(v)}\n" for k, v in values.items()]
        out = text + ("" if not text or text.endswith("\n") else "\n") + "\n" + "".join(block)
    else:
        end = head + 1
        while end < len(lines) and (not lines[end].strip() or lines[end][0] in " \t#"):
            end += 1
        keyed = {}
        for i in range(head + 1, end):
            m = re.match(r"([ \t]+)([A-Za-z0-9_]+):(\s*)(.*?)(\s+#.*)?$", lines[i].rstrip("\n"))
            if m and (not keyed or m.group(1) == next(iter(keyed.values()))[1].group(1)):
                keyed[m.group(2)] = (i, m)
        indent = next(iter(keyed.values()))[1].group(1) if keyed else "  "
        last = max((i for i, _ in keyed.values()), default=head)
        added = []
        for key, value in values.items():
            if key in keyed:
                i, m = keyed[key]
                lines[i] = f"{m.group(1)}{key}: {_yaml_scalar(value)}{m.group(5) or ''}\n"
            else:
                added.append(f"{indent}{key}: {_yaml_scalar(value)}\n")
        lines[last + 1:last + 1] = added
        out = "".join(lines)
    if yaml.safe_load(out) != {**before, section: {**(before.get(section) or {}), **values}}:
        raise refusal
    return out


def write_params_keys(path: str | os.PathLike, section: str, values: dict[str, Any]) -> None:
    """set_section_keys on the file at `path`, written atomically with its permissions kept; the result must
    pass the pre-flight (preflight_params), else the file is left as it was."""
    from stages.lib.io import atomic_path
    path = Path(path)
    text = set_section_keys(path.read_text(encoding="utf-8"), section, values, str(path))
    load_yaml_unique(text, str(path))
    mode = path.stat().st_mode & 0o7777
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
        os.chmod(tmp, mode)
        preflight_params(tmp)


# ---------------------------------------------------------------------------------------------
# GPUs on this machine (counted by stages/lib/environment.py, beside the record's GPU facts)
# ---------------------------------------------------------------------------------------------

def check_gpus_here(params: dict, source: str = "params.yaml", counted: tuple[int, str] | None = None) -> None:
    asked = params["train"]["gpus"]
    if asked <= 0:
        return
    have, how = counted if counted is not None else visible_nvidia_gpus()
    if asked > have:
        raise ParamsError(f"{source}: train.gpus is {asked} but this machine can use {have} GPU(s) ({how}): set "
                          f"train.gpus to at most {have} (0 = a CPU run), or run where the GPUs are "
                          f"(snakemake --executor slurm --workflow-profile workflow/profiles/slurm)")


# ---------------------------------------------------------------------------------------------
# The pre-flight
# ---------------------------------------------------------------------------------------------

def preflight_params(path: str | os.PathLike = "params.yaml", *, gpus_here: bool = False) -> dict[str, Any]:
    """params.yaml, read strictly and checked (module docstring), or ParamsError naming the key."""
    source = str(path)
    with open(path, encoding="utf-8") as f:
        params = load_yaml_unique(f.read(), source)
    if not isinstance(params, dict):
        raise ParamsError(f"{source}: expected a mapping at the top level, got {type(params).__name__}")
    bad = non_finite_keys(params)
    if bad:
        raise ParamsError(f"{source}: numbers must be finite: " + ", ".join(bad))
    validate_params(params, source)
    if gpus_here:
        check_gpus_here(params, source)
    return params


ABSENT = object()       # dotted_lookup's answer for a key the tree does not hold (None is a value params can hold)


def dotted_lookup(tree: Any, dotted: str) -> Any:
    """The value at a dotted key path (`train.lr`) of params-like nested mappings, or ABSENT."""
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return ABSENT
        tree = tree[part]
    return tree


def load_params(path: str | os.PathLike = "params.yaml") -> dict[str, Any]:
    """What every stage reads its knobs with: preflight_params without the GPU count (a stage runs where its
    rule sends it; the engine checks the devices it is given)."""
    return preflight_params(path)
