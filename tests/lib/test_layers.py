"""What may import what (docs/ARCHITECTURE.md "Layers"), read from the source with `ast` (nothing is imported):
workflow -> stages -> data / engine / evidence -> lib, no import circle anywhere, and stages/lib/ holding only code that
two or more of the data package, the engine and the stages use (issue 35 item 3)."""
from __future__ import annotations

import ast

from conftest import REPO_ROOT


# Imports that cross the layers (workflow -> stages -> engine/lib), to be removed, never added to:
# make_tiny_ref (a maintainer's tool, no rule) pins with verify_ref's `pin`.
LAYERING_EXCEPTIONS = {("stages/make_tiny_ref.py", "stages.verify_ref")}


def _imported_names(path):
    """Every module name (and `module.name` of a from-import) a Python file or a Snakemake rule file imports."""
    text = path.read_text()
    if path.suffix == ".smk" or path.name == "Snakefile":   # only their Python import lines parse as Python
        text = "\n".join(line for line in text.splitlines() if line.startswith(("import ", "from ")))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield from [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_layers_lib_and_engine_never_import_a_stage_and_stages_import_no_other_stage():
    """workflow -> stages -> data / engine / evidence -> lib: stages/data imports stages.lib only (never a stage,
    never the engine), the engine never imports the data package (the two meet only through lib's contracts),
    stages/evidence imports stages.lib only, lib imports none of them and no stage module."""
    stage_modules = {f"stages.{p.stem}" for p in (REPO_ROOT / "stages").glob("*.py") if p.stem != "__init__"}
    bad = []
    for path in sorted((REPO_ROOT / "stages").rglob("*.py")):
        rel = path.relative_to(REPO_ROOT).as_posix()
        for name in _imported_names(path):
            if name in stage_modules and name != f"stages.{path.stem}" and (rel, name) not in LAYERING_EXCEPTIONS:
                bad.append(f"{rel} imports {name}")
            if rel.startswith("stages/lib/") and name.startswith(("stages.engine", "stages.data")):   # lib is below
                bad.append(f"{rel} imports {name}")
            if rel.startswith("stages/data/") and name.startswith("stages.") and not name.startswith(
                    ("stages.lib", "stages.data")):
                bad.append(f"{rel} imports {name}")
            if rel.startswith("stages/engine/") and name.startswith("stages.data"):
                bad.append(f"{rel} imports {name}")
            # The evidence package (the stages' metrics, the report's bundle) reads lib only; nothing below a
            # stage reads it.
            if rel.startswith("stages/evidence/") and name.startswith("stages.") and not name.startswith(
                    ("stages.lib", "stages.evidence")):
                bad.append(f"{rel} imports {name}")
            if rel.startswith(("stages/lib/", "stages/data/", "stages/engine/")) and name.startswith("stages.evidence"):
                bad.append(f"{rel} imports {name}")
    # The console command (prefpipe/) sits above stages/ and workflow/; nothing below imports it, and stages/ never
    # imports workflow/'s modules (the Snakefile puts workflow/ on sys.path; a stage must not depend on that).
    workflow_modules = {p.stem for p in (REPO_ROOT / "workflow").glob("*.py")}
    for path in sorted([*(REPO_ROOT / "stages").rglob("*.py"), *(REPO_ROOT / "workflow").rglob("*.py")]):
        rel = path.relative_to(REPO_ROOT).as_posix()
        for name in _imported_names(path):
            if name.split(".")[0] == "prefpipe" or (rel.startswith("stages/") and name in workflow_modules):
                bad.append(f"{rel} imports {name}")
    assert not bad, bad


def test_the_workflow_uses_only_public_names_of_the_data_package_and_no_stage_internals():
    """The Snakefile's rules and pre-flight read sources through stages.data's public functions, never a stage
    module's (a stage is a CLI; what the DAG needs of it lives below it) nor an underscored name."""
    bad = []
    for path in sorted([*(REPO_ROOT / "workflow").rglob("*.py"), *(REPO_ROOT / "workflow").rglob("*.smk"),
                        REPO_ROOT / "Snakefile"]):
        for name in _imported_names(path):
            last = name.rsplit(".", 1)[-1]
            if name.startswith("stages.") and not name.startswith(("stages.lib", "stages.data")):
                bad.append(f"{path.relative_to(REPO_ROOT)} imports {name}")
            elif name.startswith("stages.data") and last.startswith("_"):
                bad.append(f"{path.relative_to(REPO_ROOT)} imports the private {name}")
    assert not bad, bad


def import_circles(graph: dict[str, set[str]]) -> list[str]:
    """Every circle a depth-first walk of {module: modules it imports} closes, as `a -> b -> a`."""
    circles, state = [], {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(trail[trail.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return circles


def test_no_import_circle_anywhere():
    """Issue 35: no module of stages/, workflow/, prefpipe/ or bench/ reaches itself through imports (lazy ones
    inside functions count: they run too). The one there was, evidence -> evidence_generation -> evidence_verify ->
    evidence through a private helper, is gone (stages/evidence/compare.py)."""
    files = {}
    for top in ("stages", "prefpipe"):
        for path in (REPO_ROOT / top).rglob("*.py"):
            name = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__")
            files[name] = path
    for top in ("workflow", "bench"):                # each put on sys.path by its users: imported by stem
        for path in (REPO_ROOT / top).glob("*.py"):
            assert path.stem not in files, f"{path} and {files[path.stem]} are both module {path.stem}"
            files[path.stem] = path
    graph = {name: {m for m in _imported_names(path) if m in files and m != name} for name, path in files.items()}
    circles = import_circles(graph)
    assert not circles, circles


def test_the_circle_finder_names_each_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a", "e2"}, "e2": {"e"}}
    assert import_circles(graph) == ["a -> b -> c -> a", "e -> e2 -> e"]


def test_imports_are_absolute():
    """The checks above read `stages.x.y` names; a relative import (`from . import y`) would slip past them."""
    relative = [f"{path.relative_to(REPO_ROOT)}: from {'.' * node.level}{node.module or ''} import ..."
                for top in ("stages", "workflow", "prefpipe", "bench")
                for path in sorted((REPO_ROOT / top).rglob("*.py"))
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and node.level]
    assert not relative, relative


# --------------------------------------------------------------------------------------------------
# stages/lib/ holds only shared code
# --------------------------------------------------------------------------------------------------

# The users lib exists for: a module of stages/ belongs to the data package, the engine, or the stages (the stage
# modules and maintainers' tools, stages/*.py, and the evidence package they share).
USERS = ("data", "engine", "stages")

# Lib modules fewer than two of USERS use, each with the reason it is lib's all the same. The workflow imports
# stages.lib and stages.data only (test_the_workflow_uses_only_public_names_...), so a module it reads, and what that
# module imports, cannot live in a stage's package: these entries are checked to be read by the workflow.
READ_BY_THE_WORKFLOW = {
    "layout": "the stages' declarations: the rules' outputs and params (workflow/rules/*.smk, rule_layout.py, "
              "sync_docs.py), what the report bundles and each stage may read",
    "stage_plan": "which stages run under given params: the rules (common.smk, train.smk, generation.smk, "
                  "evaluate.smk, rounds.smk) and report verify's artifact list",
    "graders": "generation.grader is refused at DAG build (workflow/preflight.py grader_spec); the judge and "
               "round_pairs grade with it, the evidence's scoring rates the grades",
    "embedded_task": "the embedded task's truth, read by graders (its grader) and stages/embedded_data.py",
}
LIB_EXCEPTIONS = {
    "declared_params": "every stage module's params loader (load_stage_params): the stages' half of layout.py's "
                       "STAGE_PARAMS, whose rules' half is workflow/rule_layout.py; stage modules may not import "
                       "one another, and the engine receives the loaded params without importing it",
}


def _user(rel: str) -> str | None:
    """Which user a repository file is: data, engine, stages, lib (stages/lib/ itself) or workflow; None otherwise."""
    for prefix, user in (("stages/lib/", "lib"), ("stages/data/", "data"), ("stages/engine/", "engine"),
                         ("stages/", "stages"), ("workflow/", "workflow"), ("Snakefile", "workflow")):
        if rel.startswith(prefix):
            return user
    return None


def lib_users(root=REPO_ROOT) -> dict[str, dict[str, set[str]]]:
    """{lib module: {user: files}}: a file uses every lib module it imports and every lib module those import in
    turn (lazy imports too)."""
    lib = sorted(p.stem for p in (root / "stages/lib").glob("*.py") if p.stem != "__init__")

    def lib_imports(path) -> set[str]:
        names = set(_imported_names(path))
        return {m for m in lib if f"stages.lib.{m}" in names}

    inside = {m: lib_imports(root / "stages/lib" / f"{m}.py") for m in lib}

    def reach(m: str, seen: set[str]) -> set[str]:
        if m not in seen:
            seen.add(m)
            for n in inside[m]:
                reach(n, seen)
        return seen

    users: dict[str, dict[str, set[str]]] = {m: {} for m in lib}
    files = [*(root / "stages").rglob("*.py"), *(root / "workflow").rglob("*.py"),
             *(root / "workflow").rglob("*.smk"), root / "Snakefile"]
    for path in sorted(files):
        rel = path.relative_to(root).as_posix()
        user = _user(rel)
        if user in (None, "lib"):
            continue
        for m in lib_imports(path):
            for used in reach(m, set()):
                users[used].setdefault(user, set()).add(rel)
    return users


def test_lib_holds_only_code_two_of_data_engine_and_the_stages_use():
    """Issue 35: stages/lib/ is below the data package, the engine and the stages, for what two or more of them use.
    A module only one of them uses belongs in that one's package (stages/evidence/ for the stages' own), unless it
    is named above with its reason; a named module that no longer needs its entry fails too."""
    users = lib_users()
    shared = {m for m, by in users.items() if len(by.keys() & set(USERS)) >= 2}
    named = {**READ_BY_THE_WORKFLOW, **LIB_EXCEPTIONS}
    lone = [f"stages/lib/{m}.py is used by {' and '.join(sorted(by.keys() & set(USERS))) or 'none of them'} only "
            f"({', '.join(sorted(f for u in USERS for f in by.get(u, ())))}): move it into that package, or name it "
            "in READ_BY_THE_WORKFLOW / LIB_EXCEPTIONS with the reason"
            for m, by in sorted(users.items()) if m not in shared and m not in named]
    assert not lone, lone
    stale = [f"{m}: {'no such module in stages/lib/' if m not in users else 'used by ' + ', '.join(sorted(users[m]))}"
             for m in named if m not in users or m in shared]
    assert not stale, f"entries no longer needed: {stale}"
    unread = [m for m in READ_BY_THE_WORKFLOW if "workflow" not in users[m]]
    assert not unread, f"named as read by the workflow, which does not import them: {unread}"


def test_the_lib_audit_sees_a_module_only_one_package_uses(tmp_path):
    """The audit above on a scratch tree: a lib module only the engine imports is flagged, one the data package
    imports through another lib module counts for data, and lazy imports count."""
    for rel, text in {"stages/lib/shared.py": "from stages.lib import deep\n",
                      "stages/lib/deep.py": "",
                      "stages/lib/engine_only.py": "",
                      "stages/data/reader.py": "def f():\n    from stages.lib.shared import X\n",
                      "stages/engine/loop.py": "import stages.lib.engine_only\nfrom stages.lib import shared\n",
                      "workflow/rules/a.smk": "from stages.lib.deep import Y\n",
                      "Snakefile": ""}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    users = lib_users(tmp_path)
    assert {m: sorted(by) for m, by in users.items()} == {"deep": ["data", "engine", "workflow"],
                                                         "engine_only": ["engine"], "shared": ["data", "engine"]}
    assert users["deep"]["data"] == {"stages/data/reader.py"}
