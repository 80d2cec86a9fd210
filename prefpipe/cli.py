"""`prefpipe`: the few commands users run by hand, one console entry point ([project.scripts] in pyproject.toml).

    prefpipe pin DIR [--repo-id NAME] [--write-params [PARAMS]]   # python -m stages.verify_ref pin ...
    prefpipe verify BUNDLE [--workspace DIR] [--require-same-environment]   # python -m stages.report verify ...
    prefpipe status [--repo DIR]       # each stage up to date or not, by hash (workflow/integrity.py)

Where this sits: above both workflow/ and stages/. `pin` and `verify` are the stages' own CLIs (stages.verify_ref,
stages.report), called with the same arguments, so the two spellings cannot drift apart. `status` needs
workflow/integrity.py (the hash comparison RunGuard runs at a Snakemake run's start-up), and stages/ must not import
workflow/ (tests/workflow/test_dag.py); workflow/ is no installed package either (the Snakefile puts it on
sys.path), so this module loads it from the checkout it reports on: the status is that checkout's own code's
verdict. Nothing below imports this package.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

COMMANDS = {
    "pin": "pin a local reference directory (writes DIR/prefpipe.lock.json; --write-params sets ref.* in params.yaml)",
    "verify": "check an evidence bundle (report verify): hashes, recomputed metrics, params, environment",
    "status": "which stages are up to date by hash, which must rerun and why (dvc.lock against the workspace)",
}


def find_checkout(start: Path) -> Path | None:
    """The nearest directory at or above `start` holding a Snakefile and dvc.yaml (a prefpipe checkout)."""
    for d in (start, *start.parents):
        if (d / "Snakefile").is_file() and (d / "dvc.yaml").is_file():
            return d
    return None


def status(root: Path) -> int:
    """Print pipeline_status's rows and a last line; 0 when every stage is up to date, else 1 (as `git diff
    --exit-code`: scripts can test it)."""
    sys.path.insert(0, str(root / "workflow"))
    try:
        from integrity import IntegrityError, pipeline_status
    finally:
        sys.path.remove(str(root / "workflow"))
    import logging
    logging.getLogger("dvc").setLevel(logging.WARNING)
    try:
        rows = pipeline_status(root)
    except IntegrityError as e:
        print(f"prefpipe status: refused: {e}", file=sys.stderr)
        return 1
    width = max(len(name) for name, _, _ in rows)
    for name, state, detail in rows:
        shown = "; ".join(detail[:4]) + (f"; and {len(detail) - 4} more" if len(detail) > 4 else "")
        print(f"{name:<{width}}  {state}" + (f": {shown}" if shown else ""))
    stale = [name for name, state, _ in rows if state != "up to date"]
    if not stale:
        print(f"all {len(rows)} stages up to date: the workspace is what dvc.lock records")
        return 0
    hint = ("`dvc checkout` restores missing outputs from DVC's cache; " if any(s == "outputs missing" for _, s, _ in rows)
            else "")
    print(f"{len(rows) - len(stale)} of {len(rows)} stages up to date; {hint}`snakemake --cores N` reruns the rest")
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="prefpipe", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(f"  {name:<8}{what}" for name, what in COMMANDS.items()))
    parser.add_argument("command", choices=list(COMMANDS), help="see below; `prefpipe COMMAND --help` for its options")
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv or ["--help"])          # --help, or an error naming the choices
        return 2
    command, rest = argv[0], argv[1:]
    if command == "pin":
        from stages import verify_ref
        return verify_ref.main(["pin", *rest], prog="prefpipe")
    if command == "verify":
        from stages import report
        return report.verify_main(rest, prog="prefpipe verify")
    sub = argparse.ArgumentParser(prog="prefpipe status", description=COMMANDS["status"])
    sub.add_argument("--repo", default=None, help="the checkout (default: the one the working directory is in)")
    args = sub.parse_args(rest)
    root = Path(args.repo).resolve() if args.repo else find_checkout(Path.cwd().resolve())
    if root is None or not (root / "workflow" / "integrity.py").is_file():
        print(f"prefpipe status: refused: {args.repo or Path.cwd()} is not in a prefpipe checkout (no Snakefile, "
              "dvc.yaml and workflow/integrity.py): run it inside one, or pass --repo DIR", file=sys.stderr)
        return 1
    return status(root)


if __name__ == "__main__":
    sys.exit(main())
