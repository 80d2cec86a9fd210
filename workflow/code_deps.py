"""A stage's code dependencies, computed from its imports (no rule lists them by hand).

`code_deps("stages.tokenize")` is every repository source file the stage module imports, directly or
through other modules, found by walking the `import` / `from ... import` statements of the files
themselves (ast; nothing is imported or run). Rules use it as their `code` input, so Snakemake and
DVC (dvc.yaml is generated from the rules) rerun a stage when any file it runs changes, and only then:
a new module under stages/engine/ is picked up by the rules whose code imports it.

    python workflow/code_deps.py stages.train_dpo      # prints the files, one a line

Imports inside functions count (a lazy import still runs). A package's `__init__.py` counts when it
holds code beyond its docstring. A package that finds its own modules at import (its `__init__.py` calls
`pkgutil.iter_modules`, as the format registry stages/data/formats/ does: a new format is a new file, listed
nowhere) imports every module in its directory, so each counts. Only modules under `stages` are followed
(third-party code is the environment record's business).
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "stages"


# What each file says, by the hash of its bytes, kept between invocations in CACHE_FILE under the repository: parsing
# the ~80 files the stages import took ~1.4 s of every Snakemake start (each `snakemake` and `snakemake -n`, and on a
# cluster each job twice). Keyed by content, never by path or mtime, so an edited file is parsed again and the result
# is exactly what parsing now would give; a missing, unreadable or foreign cache file is just rebuilt.
CACHE_FILE = Path(".snakemake/prefpipe_code_deps.json")
CACHE_FORMAT = "prefpipe-code-deps/1"
_cache: dict[Path, dict] = {}          # root -> {"entries": {sha1: summary}, "dirty": bool}


def _summarize(text: str, filename: str) -> dict:
    """The file's imports of PACKAGE modules (anywhere in it), whether it holds code beyond a docstring, and
    whether it calls pkgutil.iter_modules (a package that lists its own directory)."""
    tree = ast.parse(text, filename=filename)
    names: list[str] = []
    lists_directory = False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]   # `from stages.lib import kernels`
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name == PACKAGE or a.name.startswith(PACKAGE + ".")]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr",
                                                    getattr(node.func, "id", None)) == "iter_modules":
            lists_directory = True
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]  # the docstring
    return {"imports": names, "has_code": bool(body), "lists_directory": lists_directory}


def _cache_for(root: Path) -> dict:
    if root not in _cache:
        entries = {}
        try:
            doc = json.loads((root / CACHE_FILE).read_text(encoding="utf-8"))
            if doc.get("format") == CACHE_FORMAT and isinstance(doc.get("entries"), dict):
                entries = doc["entries"]
        except (OSError, ValueError, AttributeError):
            pass
        _cache[root] = {"entries": entries, "dirty": False}
    return _cache[root]


def _save_cache(root: Path) -> None:
    cache = _cache.get(root)
    if not cache or not cache["dirty"]:
        return
    path = root / CACHE_FILE
    try:
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"format": CACHE_FORMAT, "entries": cache["entries"]}), encoding="utf-8")
        os.replace(tmp, path)      # atomic: two Snakemake processes at once leave one whole file
        cache["dirty"] = False
    except OSError:
        pass                       # a read-only checkout: parse again next time


@lru_cache(maxsize=None)
def _summary(path: Path, root: Path) -> dict:
    data = path.read_bytes()
    key = hashlib.sha1(data).hexdigest()
    cache = _cache_for(root)
    if key not in cache["entries"]:
        cache["entries"][key] = _summarize(data.decode("utf-8"), str(path))
        cache["dirty"] = True
    return cache["entries"][key]


@lru_cache(maxsize=None)
def _module_file(name: str, root: Path) -> Path | None:
    """The file that defines module `name`: name.py, or a package's __init__.py when it has code."""
    base = root / Path(*name.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    init = base / "__init__.py"
    if init.is_file():
        return init if _summary(init, root)["has_code"] else None
    return None


def _imported_modules(path: Path, root: Path) -> tuple[str, ...]:
    """Module names (under PACKAGE) that the file imports, anywhere in it."""
    return tuple(_summary(path, root)["imports"])


def _discovered_modules(path: Path, root: Path) -> tuple[Path, ...]:
    """The files of the modules a package's __init__.py imports by listing its directory (a call to
    pkgutil.iter_modules in it): every other .py file there. Empty for any other file."""
    if path.name != "__init__.py" or not _summary(path, root)["lists_directory"]:
        return ()
    return tuple(sorted(p for p in path.parent.glob("*.py") if p.name != "__init__.py"))


# Declarations whose every entry reaches the rules themselves (a stage's outputs and params: workflow/rule_layout.py
# holds each rule to them at DAG build), so an edit reruns exactly the stages whose outputs or params change. As code
# they would rerun every stage that imports them: adding one stage's entry would rerun the whole pipeline.
DECLARATIONS = frozenset({"stages/lib/layout.py"})


@lru_cache(maxsize=None)
def _code_deps(module: str, root: Path) -> tuple[str, ...]:
    first = _module_file(module, root)
    if first is None:
        raise ValueError(f"code_deps: no module {module!r} under {root}")
    seen: set[Path] = set()
    todo = [module]
    while todo:
        path = _module_file(todo.pop(), root)
        if path is None or path in seen or path.relative_to(root).as_posix() in DECLARATIONS:
            continue
        seen.add(path)
        todo += _imported_modules(path, root)
        todo += [".".join(p.relative_to(root).with_suffix("").parts) for p in _discovered_modules(path, root)]
    rel = lambda p: p.relative_to(root).as_posix()  # noqa: E731
    return (rel(first), *sorted(rel(p) for p in seen if p != first))


def code_deps(*modules: str, root: str | Path = ROOT) -> list[str]:
    """The source files `modules` run, as repo-relative posix paths: each module's own file first, then
    the files it imports (sorted), without repeats."""
    out: dict[str, None] = {}
    root = Path(root).resolve()
    for module in modules:
        out.update(dict.fromkeys(_code_deps(module, root)))
    _save_cache(root)
    return list(out)


if __name__ == "__main__":
    print("\n".join(code_deps(*sys.argv[1:])))
