"""The Snakefile's pre-flight: what must hold before Snakemake builds the DAG, refused in one line.

The Snakefile calls `dag_preflight(workflow, config)` right after `configfile:`, before any rule exists, so
`snakemake` (any executor, dry runs included) and `python workflow/sync_dvc.py` (which builds the DAG through
the Snakemake API) stop before anything runs or dvc.yaml is written:

* params.yaml through stages/lib/params.py's preflight_params, the one check every stage's load_params runs
  too (a key written twice, a non-finite number, a schema error), plus `train.gpus` against this machine's
  GPUs when the jobs run on this machine (`jobs_run_here`);
* Snakemake's config equal to params.yaml (DVC reads params.yaml only: a --config override would make the two
  tools disagree about what ran);
* every data source names data files (stages/data/sources.py resolve_source_files): a missing file would
  otherwise leave normalize an input nothing can make, and Snakemake, finding normalize's old outputs, drops
  the rule from the DAG instead of failing: dvc.yaml lost the stage and the run claimed data it never read;
* every `sft.sources` entry an SFT format naming data files (stages/data/sft_sources.py), for the same reason;
  `generation.grader` a registered grader (stages/lib/graders.py);
* tokenize.max_length within the reference's positions (`max_position_embeddings` of ref.local_dir/config.json,
  stages/data/limits.py check_fits_reference), when that directory is already there (an `hf` reference not yet
  downloaded is verify_ref's to refuse; tokenize checks again on the verified directory).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn


def refuse(message: str) -> NoReturn:
    """`Snakefile: refused: <message>` on stderr, exit status 1. An exception raised while Snakemake parses the
    Snakefile is printed as `<Type> in file "...", line N:`, the message and one `File ...` line per frame (a
    WorkflowError too), and through the API (sync_dvc.py) as a full traceback; SystemExit passes through both
    untouched, so this line is all that is printed."""
    sys.stderr.write(f"Snakefile: refused: {message}\n")
    sys.stderr.flush()
    raise SystemExit(1)


def jobs_run_here(workflow) -> bool:
    """Whether this Snakemake invocation runs its jobs on this machine: the local executor (a real run, a dry
    run or --touch of one), not `--executor slurm` (the DAG-building host need not have the GPUs its jobs ask
    for), not a job's own Snakemake on a cluster node (exec mode REMOTE), not an API user that only builds the
    DAG (sync_dvc.py). Snakemake tells a Snakefile nothing about its executor while parsing it: the API parses
    it when the DAG is asked for, before any executor is chosen, and workflow.executor_plugin is set only when
    jobs are scheduled (to the dry-run pseudo-executor for --dry-run). Snakemake's CLI has resolved the intended
    executor (from --executor or the profile) before it parses (cli.py args_to_api, its local
    `executor_plugin`), so it is read from that frame. No such frame (an API user): False, the check is left
    to the engine, which refuses GPUs it is not given."""
    from snakemake_interface_executor_plugins.settings import ExecMode

    if workflow.exec_mode != ExecMode.DEFAULT:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        settings = getattr(frame.f_locals.get("executor_plugin"), "common_settings", None)
        if settings is not None:
            return bool(settings.local_exec)
        frame = frame.f_back
    return False


def params_readable(params_path: str = "params.yaml") -> None:
    """Before Snakemake's `configfile:` reads params.yaml: text that is not UTF-8 is refused in one line (Snakemake
    would raise a UnicodeDecodeError traceback from its config load)."""
    try:
        data = Path(params_path).read_bytes()
    except FileNotFoundError:
        return              # Snakemake's own message names the missing config file
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        refuse(f"{params_path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}, line {line}): save it "
               "as UTF-8, e.g. `iconv -f latin1 -t utf-8 params.yaml > p && mv p params.yaml`")


def dag_preflight(workflow, config: dict, params_path: str = "params.yaml") -> dict:
    """The checks above; returns params.yaml as read, or refuses (one line, exit 1)."""
    from stages.lib.cli import one_line
    from stages.lib.params import ParamsError, preflight_params
    from stages.data.limits import TokenizeError, check_fits_reference
    from stages.data.sources import SourceError, resolve_source_files
    from stages.data.sft_sources import SFTDataError, resolve_sft_source_files
    from stages.lib.graders import GraderError, grader_spec

    try:
        params = preflight_params(params_path, gpus_here=jobs_run_here(workflow))
        if params != config:
            raise ParamsError("config differs from params.yaml: edit params.yaml instead of passing "
                              "--config/--configfile (DVC tracks params.yaml only)")
        resolve_source_files(params["data"]["sources"])
        if (params.get("sft") or {}).get("sources"):
            resolve_sft_source_files(params["sft"]["sources"])
        grader_spec(params["generation"].get("grader"))
        check_fits_reference(params["tokenize"]["max_length"], params["ref"]["local_dir"])
        _check_pinned_judge(params["generation"]["judge"])
        _check_dev_split(params)
    except (ParamsError, SourceError, TokenizeError, SFTDataError, GraderError) as e:
        refuse(one_line(e))
    return params


def _check_dev_split(params: dict) -> None:
    """train.eval_every / train.select_best score the dev split: refused before the DAG without one (probe.dev_size);
    the training stages refuse it too (stages/engine/cli.py dev_settings), after the upstream stages ran."""
    from stages.lib.params import ParamsError
    train = params["train"]
    if not params["probe"].get("dev_size", 0) and (train.get("eval_every") or train.get("select_best")):
        raise ParamsError(f"train.eval_every {train.get('eval_every', 0)} / train.select_best "
                          f"{train.get('select_best', False)} score the dev split, but probe.dev_size is "
                          f"{params['probe'].get('dev_size', 0)}: set probe.dev_size > 0")


def _check_pinned_judge(judge) -> None:
    """A pinned judge that cannot judge (not a sequence-classification model with one label: its config files)
    is refused here, before generate spends anything; a missing directory is verify_judge's to report."""
    from stages.lib.params import ParamsError
    from stages.lib.reference import judge_head_problem
    if isinstance(judge, dict) and Path(judge["local_dir"]).is_dir():
        problem = judge_head_problem(judge["local_dir"])
        if problem is not None:
            raise ParamsError(f"generation.judge: {problem}")
