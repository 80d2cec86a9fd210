"""The one stage-CLI scaffold: every stage's `main(argv)` is `stage_main(...)`.

    def main(argv=None) -> int:
        return stage_main(argv, "freeze_probe", __doc__.split("\n")[0], add_arguments=_arguments, run=_run,
                          input_errors=(ProbeError, ParamsError))

`stage_main` builds the ArgumentParser (the stage's own arguments, plus `--params`, default params.yaml, and
`--log`), sets up logging (stages.lib.io.setup_logging: stderr with timestamps; the log file, a hashed output,
without timestamps or MEASUREMENT lines), runs the stage and returns what it returns (0 on success).

One exit convention for bad input: an exception of one of the stage's `input_errors` (the ValueError
subclasses its checks raise, e.g. ProbeError, ParamsError, TokenizeError, CheckpointError; plus
FileNotFoundError, a missing input, and stages.lib.io.CorruptFileError, a damaged one) is logged as ONE line, `<stage>: refused: <message>` (stderr and the log
file), and the process exits with status 1 (`StageRefused`, a SystemExit). No traceback: the message names
the file/row and the failed check. Anything else is a bug and keeps its traceback.

Under torchrun only rank 0 (RANK unset or 0) logs, to the log file and the refusal line; every rank exits 1.
A stage with subcommands (verify_ref pin|verify) passes `commands={name: Command(...)}` instead.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from stages.lib.io import CorruptFileError, setup_logging

DEFAULT_PARAMS = "params.yaml"
REQUIRED = object()         # `params=REQUIRED`: --params has no default
REFUSED_EXIT = 1

# Always input errors: a missing input file is bad input, not a bug; so is a damaged one (a parquet page failing
# its CRC, a values digest that differs: stages.lib.io.CorruptFileError, which names the file).
BASE_INPUT_ERRORS: tuple[type[BaseException], ...] = (FileNotFoundError, CorruptFileError)

LOG_HELP = ("log file: the run's results and decisions, no timestamps and no timings (a hashed output); "
            "also logged to stderr")


class StageRefused(SystemExit):
    """Bad input refused: exit status 1; str() is the one-line message `<stage>: refused: <message>`."""

    def __init__(self, stage: str, message: str):
        super().__init__(REFUSED_EXIT)
        self.stage, self.message = stage, message

    def __str__(self) -> str:
        return f"{self.stage}: refused: {self.message}"


@dataclass(frozen=True)
class Command:
    """One (sub)command: its arguments, its body and the scaffold's options for it.

    add_arguments(parser): the command's own arguments. run(args): the command; its return value is main's.
    params: the --params default (DEFAULT_PARAMS), REQUIRED, or None for no --params.
    log: whether the command takes --log (without it, logging goes to stderr only).
    """
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], Any]
    help: str | None = None
    params: Any = DEFAULT_PARAMS
    log: bool = True
    log_help: str = LOG_HELP


def is_main_rank() -> bool:
    """Rank 0 of a torchrun launch, or a plain process (torchrun sets RANK before the process starts)."""
    return int(os.environ.get("RANK", "0") or 0) == 0


def one_line(error: BaseException) -> str:
    """The error's message on one line: its lines joined ("a:" + "b" -> "a: b", others with "; ")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    out = lines[0]
    for line in lines[1:]:
        out += (" " if out.endswith(":") else "; ") + line
    return out


def refuse(stage: str, error: BaseException | str) -> StageRefused:
    """Log the refusal line (rank 0) and return the StageRefused to raise."""
    message = error if isinstance(error, str) else one_line(error)
    if is_main_rank():
        logging.getLogger(stage).error("%s: refused: %s", stage, message)
    return StageRefused(stage, message)


def _add_common(parser: argparse.ArgumentParser, command: Command) -> None:
    command.add_arguments(parser)
    if command.params is REQUIRED:
        parser.add_argument("--params", required=True, help="params.yaml")
    elif command.params is not None:
        parser.add_argument("--params", default=command.params, help=f"params file (default: {command.params})")
    if command.log:
        parser.add_argument("--log", default=None, help=command.log_help)


def build_parser(prog: str, description: str | None, command: Command | None = None,
                 commands: dict[str, Command] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if commands:
        sub = parser.add_subparsers(dest="command", required=True)
        for name, cmd in commands.items():
            _add_common(sub.add_parser(name, help=cmd.help, description=cmd.help), cmd)
    else:
        assert command is not None
        _add_common(parser, command)
    return parser


def stage_main(argv: list[str] | None, name: str, description: str | None, *,
               add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
               run: Callable[[argparse.Namespace], Any] | None = None,
               params: Any = DEFAULT_PARAMS, log: bool = True, log_help: str = LOG_HELP,
               commands: dict[str, Command] | None = None,
               input_errors: tuple[type[BaseException], ...] = (),
               prog: str | None = None) -> Any:
    """Parse argv, set up logging, run the stage; bad input (`input_errors`) -> one refusal line, exit 1.

    name: the stage's name (its logger, and the refusal line's prefix). description: --help's text (the module
    docstring, or its first line). Either add_arguments + run (+ params, log) or commands={name: Command}.
    Returns run's return value.
    """
    if commands is None:
        if add_arguments is None or run is None:
            raise TypeError("stage_main needs add_arguments and run, or commands")
        command = Command(add_arguments, run, params=params, log=log, log_help=log_help)
    parser = build_parser(prog or f"python -m stages.{name}", description, None if commands else command, commands)
    args = parser.parse_args(argv)
    if commands:
        command = commands[args.command]
    log_file = getattr(args, "log", None) if command.log else None
    setup_logging(log_file if is_main_rank() else None, name)
    if not is_main_rank():
        logging.getLogger().setLevel(logging.WARNING)     # rank 0 reports; the others only warn
    try:
        return command.run(args)
    except (*BASE_INPUT_ERRORS, *input_errors) as e:
        raise refuse(name, e) from e


def exit_after_success() -> None:
    """End a stage process whose main() returned: flush the logs and the console, then leave without the
    interpreter's teardown (os._exit). Every output is written and closed by then; what teardown would still do
    is free torch's, CUDA's and NCCL's state one object at a time, which the pipeline measured at seconds per
    GPU stage under torchrun (bench/pipeline_bench.py's `outside_process`). Only for `python -m stages.<stage>`:
    a failure raises before this and exits the normal way, with its status and traceback."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)
