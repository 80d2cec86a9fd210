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
import sys
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "stages"


# Both cached per file: the rules share most of their modules (every stage imports stages/lib/*), and Snakemake
# evaluates code_deps for every rule on every invocation, at parse time (the 10 rules: 122 parses before, 0.68 s;
# 0.51 s cached per file, on a 2-core CPU).
@lru_cache(maxsize=None)
def _module_file(name: str, root: Path) -> Path | None:
    """The file that defines module `name`: name.py, or a package's __init__.py when it has code."""
    base = root / Path(*name.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    init = base / "__init__.py"
    if init.is_file():
        body = ast.parse(init.read_text(encoding="utf-8")).body
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
            body = body[1:]  # the docstring
        return init if body else None
    return None


@lru_cache(maxsize=None)
def _imported_modules(path: Path) -> tuple[str, ...]:
    """Module names (under PACKAGE) that the file imports, anywhere in it."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]   # `from stages.lib import kernels`
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name == PACKAGE or a.name.startswith(PACKAGE + ".")]
    return tuple(names)


@lru_cache(maxsize=None)
def _discovered_modules(path: Path) -> tuple[Path, ...]:
    """The files of the modules a package's __init__.py imports by listing its directory (a call to
    pkgutil.iter_modules in it): every other .py file there. Empty for any other file."""
    if path.name != "__init__.py":
        return ()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "iter_modules":
            return tuple(sorted(p for p in path.parent.glob("*.py") if p.name != "__init__.py"))
    return ()


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
        todo += _imported_modules(path)
        todo += [".".join(p.relative_to(root).with_suffix("").parts) for p in _discovered_modules(path)]
    rel = lambda p: p.relative_to(root).as_posix()  # noqa: E731
    return (rel(first), *sorted(rel(p) for p in seen if p != first))


def code_deps(*modules: str, root: str | Path = ROOT) -> list[str]:
    """The source files `modules` run, as repo-relative posix paths: each module's own file first, then
    the files it imports (sorted), without repeats."""
    out: dict[str, None] = {}
    for module in modules:
        out.update(dict.fromkeys(_code_deps(module, Path(root).resolve())))
    return list(out)


if __name__ == "__main__":
    print("\n".join(code_deps(*sys.argv[1:])))
