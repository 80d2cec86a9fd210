"""params.yaml as one stage may read it: only the keys its declaration lists (stages/lib/layout.py STAGE_PARAMS).

A stage's rule lists its params from the same declaration (workflow/rules: `**rule_params(config, stage)`), and
Snakemake and DVC rerun the stage when one of them changes. A key the stage reads but does not declare would be a
stale output both tools call up to date. So a stage never sees such a key: reading it raises
UndeclaredParamError, naming the key and the stage, and the first test or run that takes that code path fails.

A declaration is a tuple of dotted key paths; a path covers its whole subtree (`train` covers `train.lr`), and `*`
covers the whole file (the report, which packs params.yaml). Reading a covered path returns its value as loaded
(plain dicts and lists). Reading a path that only leads to declared keys (`train` when `train.lr` is declared)
returns another view. Anything else raises, and so does reading a view whole (iterating it, copying it, dumping
it): that would read keys the stage does not declare. Presence tests (`in`, `.get`) are reads too: whether `sft`
is set decides what a stage does.

PREFPIPE_PARAMS_ACCESS_LOG=FILE appends each key a stage reads (a JSON line, at its first read) to FILE, outside
every tracked output: tests/workflow/test_stage_params.py holds each declaration to what the stages really read.
"""
from __future__ import annotations

import json
import os
from typing import Any

from stages.lib.params import ParamsError, load_params

ACCESS_LOG_ENV = "PREFPIPE_PARAMS_ACCESS_LOG"


class UndeclaredParamError(ParamsError):
    """A stage read a params key its declaration does not list (a stale output waiting to happen)."""


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


class _Declaration:
    """One stage's declared keys, and the reads seen so far (for the access log)."""

    def __init__(self, stage: str, declared: tuple[str, ...], log_path: str | None = None):
        self.stage = stage
        self.declared = frozenset(declared)
        self.reads: set[str] = set()
        self.log_path = log_path

    def note(self, path: str) -> None:
        """Remember a read; with the access log on, append it at once (a stage process ends with os._exit,
        stages.lib.cli.exit_after_success: no exit hook would run). One short line per write: appends stay whole."""
        if path in self.reads:
            return
        self.reads.add(path)
        if self.log_path:
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"stage": self.stage, "read": path}) + "\n")

    def covers(self, path: str) -> bool:
        if "*" in self.declared:
            return True
        parts = path.split(".")
        return any(".".join(parts[:i]) in self.declared for i in range(1, len(parts) + 1))

    def leads_to(self, path: str) -> bool:
        return any(key.startswith(path + ".") for key in self.declared)

    def under(self, path: str) -> list[str]:
        return sorted(k for k in self.declared if not path or k.startswith(path + "."))

    def refuse(self, path: str, how: str) -> UndeclaredParamError:
        return UndeclaredParamError(
            f"stage {self.stage} {how} params key `{path}`, which its declaration does not list "
            f"(stages/lib/layout.py STAGE_PARAMS[{self.stage!r}]: {sorted(self.declared)}): add it there, so the "
            f"stage's rule reruns it when the key changes")


class ParamsView(dict):
    """A mapping of params.yaml (or one of its sections) that lets a stage read only its declared keys."""

    def __init__(self, data: dict, path: str, declaration: _Declaration):
        super().__init__(data)
        self._path = path
        self._declaration = declaration

    def _read(self, key: Any, how: str):
        """The value at `key` as the stage may see it; raises for an undeclared key, present or not."""
        path = _join(self._path, key)
        decl = self._declaration
        if decl.covers(path):
            decl.note(path)
            return dict.get(self, key, _ABSENT)
        value = dict.get(self, key, _ABSENT)
        if decl.leads_to(path):
            if isinstance(value, dict):
                return ParamsView(value, path, decl)
            # Absent or not a mapping (a null section): no key under it exists to hide, and whether it is set is
            # what a declared key under it says.
            decl.note(path)
            return value
        raise decl.refuse(path, how)

    def __getitem__(self, key):
        value = self._read(key, "reads")
        if value is _ABSENT:
            raise KeyError(key)
        return value

    def get(self, key, default=None):
        value = self._read(key, "reads")
        return default if value is _ABSENT else value

    def __contains__(self, key) -> bool:
        return self._read(key, "tests for") is not _ABSENT

    def _whole(self) -> None:
        """Reading this mapping whole: allowed only where the declaration covers all of it (`*` at the top)."""
        decl = self._declaration
        if "*" in decl.declared or (self._path and decl.covers(self._path)):
            decl.note(self._path or "*")
            return
        raise UndeclaredParamError(
            f"stage {self._declaration.stage} reads every key of `{self._path or 'params.yaml'}`, but declares only "
            f"{self._declaration.under(self._path)} there (stages/lib/layout.py STAGE_PARAMS): declare "
            f"`{self._path or '*'}`, or read the keys one by one")

    def __iter__(self):
        self._whole()
        return dict.__iter__(self)

    def keys(self):
        self._whole()
        return dict.keys(self)

    def values(self):
        self._whole()
        return dict.values(self)

    def items(self):
        self._whole()
        return dict.items(self)

    def __len__(self) -> int:
        self._whole()
        return dict.__len__(self)

    def copy(self) -> dict:
        self._whole()
        return dict(dict.items(self))

    def __deepcopy__(self, memo) -> dict:
        import copy
        self._whole()
        return copy.deepcopy(dict(dict.items(self)), memo)

    def __reduce_ex__(self, protocol):
        self._whole()
        return (dict, (dict(dict.items(self)),))

    def __eq__(self, other) -> bool:
        self._whole()
        return dict.__eq__(self, other)

    __hash__ = None

    def __setitem__(self, key, value):
        raise TypeError(f"params are read-only in stage {self._declaration.stage} (`{_join(self._path, key)}`)")

    def __repr__(self) -> str:
        return f"ParamsView(stage={self._declaration.stage!r}, path={self._path!r})"


class _Absent:
    pass


_ABSENT = _Absent()


def declared_view(params: dict, stage: str, declared: tuple[str, ...]) -> dict:
    """`params` as `stage` may read it. A declaration of `*` alone returns `params` itself (nothing to guard)."""
    if tuple(declared) == ("*",) and not os.environ.get(ACCESS_LOG_ENV):
        return params
    return ParamsView(params, "", _Declaration(stage, tuple(declared), os.environ.get(ACCESS_LOG_ENV)))


def load_stage_params(path, stage: str) -> dict:
    """What a stage CLI reads its knobs with: params.yaml checked as load_params checks it, seen through the
    stage's declaration."""
    from stages.lib.layout import STAGE_PARAMS
    return declared_view(load_params(path), stage, STAGE_PARAMS[stage])
