"""The stage-CLI scaffold (stages/lib/cli.py): one exit convention for bad input.

Bad input exits 1 with ONE line `<stage>: refused: <message>` naming the file/row, on stderr and in the
--log file, and no traceback; a bug keeps its traceback; under torchrun only rank 0 prints the line.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import yaml

from conftest import REPO_ROOT
from data_helpers import embedded_identity, leaky_rows, pairs_table, write_probe_params
from stages.lib.cli import StageRefused, one_line, refuse, stage_main
from stages.lib.contracts import PAIRS_SCHEMA
from stages.lib.io import write_parquet
from stages.lib.params import ParamsError


def run_stage(module: str, *args, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    full_env.pop("RANK", None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", f"stages.{module}", *map(str, args)], cwd=REPO_ROOT,
                          capture_output=True, text=True, env=full_env)


def assert_refused(r: subprocess.CompletedProcess, stage: str, *needles: str, log: Path | None = None) -> str:
    """Exit 1, exactly one stderr line holding `<stage>: refused: ` and every needle, no traceback."""
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if f"{stage}: refused: " in line]
    assert len(lines) == 1, r.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    if log is not None:
        logged = log.read_text(encoding="utf-8").splitlines()
        assert logged[-1].startswith(f"{stage} ERROR {stage}: refused: "), logged
        assert logged[-1].split(f"{stage}: refused: ", 1)[1] == lines[0].split(f"{stage}: refused: ", 1)[1]
    return lines[0]


def freeze_probe_args(tmp_path: Path, params: Path, pairs: Path) -> list:
    identity = tmp_path / "ref_identity.json"
    if not identity.exists():
        embedded_identity(tmp_path)
    return ["--params", params, "--pairs", pairs, "--identity", identity, "--train", tmp_path / "o/train.parquet",
            "--probe", tmp_path / "o/probe.parquet", "--manifest", tmp_path / "o/probe_manifest.json",
            "--log", tmp_path / "freeze_probe.log"]


def test_freeze_probe_too_few_prompts_and_a_bad_row_are_one_line_refusals(tmp_path):
    pairs = tmp_path / "pairs.parquet"
    write_parquet(pairs, pairs_table(leaky_rows()))
    r = run_stage("freeze_probe", *freeze_probe_args(tmp_path, write_probe_params(tmp_path, 512, 0), pairs))
    assert_refused(r, "freeze_probe", "60 distinct prompts (150 pairs) but probe.size is 512",
                   log=tmp_path / "freeze_probe.log")
    assert not (tmp_path / "o").exists()

    rows = pairs_table(leaky_rows()).to_pylist()
    rows[7]["chosen"] = [{"role": "assistant", "content": "edited after hashing"}]
    write_parquet(pairs, pa.Table.from_pylist(rows, schema=PAIRS_SCHEMA))
    r = run_stage("freeze_probe", *freeze_probe_args(tmp_path, write_probe_params(tmp_path, 20, 0), pairs))
    assert_refused(r, "freeze_probe", str(pairs), "row 7", "content_hash", log=tmp_path / "freeze_probe.log")


def test_a_missing_input_file_is_refused_not_a_traceback(tmp_path):
    r = run_stage("freeze_probe", *freeze_probe_args(tmp_path, write_probe_params(tmp_path, 20, 0), tmp_path / "nope.parquet"))
    assert_refused(r, "freeze_probe", "nope.parquet", log=tmp_path / "freeze_probe.log")


def test_a_bug_keeps_its_traceback(tmp_path):
    pairs = tmp_path / "pairs.parquet"
    # Messages stored as plain strings: the stage's code meets a shape no check of it names (a TypeError).
    table = pairs_table(leaky_rows())
    write_parquet(pairs, table.set_column(3, "prompt", pa.array([str(m) for m in table.column("prompt").to_pylist()])))
    r = run_stage("freeze_probe", *freeze_probe_args(tmp_path, write_probe_params(tmp_path, 20, 0), pairs))
    assert r.returncode == 1 and "Traceback" in r.stderr and "TypeError" in r.stderr and "refused" not in r.stderr


def test_a_damaged_parquet_is_refused_naming_it(tmp_path):
    """Not parquet (a truncated or overwritten file) where a parquet artifact is read: one refusal line naming it."""
    pairs = tmp_path / "pairs.parquet"
    pairs.write_text("not parquet")
    r = run_stage("freeze_probe", *freeze_probe_args(tmp_path, write_probe_params(tmp_path, 20, 0), pairs))
    assert_refused(r, "freeze_probe", f"{pairs}: unreadable parquet file", log=tmp_path / "freeze_probe.log")


def test_tokenize_refuses_a_bad_identity_file(tmp_path):
    identity = tmp_path / "ref_identity.json"
    identity.write_text("{}")
    outs = {name: tmp_path / name for name in ("train_tokens.parquet", "probe_tokens.parquet", "ptm.json",
                                              "report.json", "rejections.parquet")}
    r = run_stage("tokenize", "--params", REPO_ROOT / "params.yaml", "--identity", identity,
                  "--train", tmp_path / "train.parquet", "--probe", tmp_path / "probe.parquet",
                  "--probe-manifest", tmp_path / "probe_manifest.json",
                  "--train-tokens", outs["train_tokens.parquet"], "--probe-tokens", outs["probe_tokens.parquet"],
                  "--probe-token-manifest", outs["ptm.json"], "--report", outs["report.json"],
                  "--rejections", outs["rejections.parquet"], "--log", tmp_path / "tokenize.log")
    assert_refused(r, "tokenize", str(identity), "not a prefpipe-ref-identity/1 reference identity",
                   log=tmp_path / "tokenize.log")
    assert not any(p.exists() for p in outs.values())


def test_evaluate_refuses_a_misshapen_probe_manifest(tmp_path):
    manifest = tmp_path / "probe_manifest.json"
    manifest.write_text("{}")
    x = tmp_path / "x"
    r = run_stage("evaluate", "--params", REPO_ROOT / "params.yaml", "--probe-manifest", manifest,
                  "--probe-token-manifest", x, "--dpo-step0", x, "--dpo-final", x, "--rm-step0", x, "--rm-final", x,
                  "--metrics-dpo", tmp_path / "dpo.json", "--metrics-rm", tmp_path / "rm.json",
                  "--bootstrap", tmp_path / "b.json", "--log", tmp_path / "evaluate.log")
    assert_refused(r, "evaluate", str(manifest), "not a valid probe manifest", log=tmp_path / "evaluate.log")


def test_under_torchrun_only_rank_0_prints_the_refusal(tmp_path):
    # RANK as torchrun sets it: rank 1 exits 1 too, silently; the refusal line and the log file are rank 0's.
    r = run_stage("freeze_probe", *freeze_probe_args(tmp_path, write_probe_params(tmp_path, 20, 0), tmp_path / "nope.parquet"),
                  env={"RANK": "1"})
    assert r.returncode == 1 and "refused" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "freeze_probe.log").exists()


def bad_train_params(tmp_path: Path) -> Path:
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["train"]["lr"] = "fast"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def train_rm_args(tmp_path: Path, params: Path) -> list:
    return ["--params", params, "--model-dir", tmp_path / "model", "--train-tokens", tmp_path / "t.parquet",
            "--probe-tokens", tmp_path / "p.parquet", "--out-dir", tmp_path / "rm", "--log", tmp_path / "train_rm.log"]


def test_train_rm_refuses_a_bad_param_in_one_line(tmp_path):
    params = bad_train_params(tmp_path)
    r = run_stage("train_rm", *train_rm_args(tmp_path, params))
    line = assert_refused(r, "train_rm", f"{params} is invalid: train.lr: 'fast'", log=tmp_path / "train_rm.log")
    assert "\n" not in line
    assert not (tmp_path / "rm").exists()


# ------------------------------------------------------------------------------------------- in process

def test_in_process_a_refusal_is_a_system_exit_1_carrying_the_error(tmp_path):
    def run(args):
        raise ParamsError(f"{args.params} is invalid:\n  train.lr: 'fast' is not of type 'number'\n  train.x: y")

    with pytest.raises(StageRefused) as e:
        stage_main(["--params", "p.yaml", "--log", str(tmp_path / "s.log")], "demo", "demo stage",
                   add_arguments=lambda ap: None, run=run, input_errors=(ParamsError,))
    assert isinstance(e.value, SystemExit) and e.value.code == 1
    assert str(e.value) == "demo: refused: p.yaml is invalid: train.lr: 'fast' is not of type 'number'; train.x: y"
    assert isinstance(e.value.__cause__, ParamsError)
    assert (tmp_path / "s.log").read_text() == f"demo ERROR {e.value}\n"


def test_success_returns_run_value_and_adds_nothing_to_the_log(tmp_path):
    import logging

    def run(args):
        logging.getLogger("demo").info("did %s", args.params)
        return 0

    log = tmp_path / "s.log"
    assert stage_main(["--log", str(log)], "demo", None, add_arguments=lambda ap: None, run=run) == 0
    assert log.read_text() == "demo INFO did params.yaml\n"


def test_other_errors_propagate_unchanged():
    def run(args):
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        stage_main([], "demo", None, add_arguments=lambda ap: None, run=run, input_errors=(ParamsError,))


def test_one_line():
    assert one_line(ValueError("a:\n  b\n  c")) == "a: b; c"
    assert one_line(ValueError("")) == "ValueError"
    assert str(refuse("s", "msg")) == "s: refused: msg"


def test_exit_after_success_keeps_every_log_line_and_console_byte_and_exits_0(tmp_path):
    # The engine stages' `python -m` entry leaves through os._exit (no interpreter teardown): whatever was
    # logged or printed last, including buffered stdout with no newline, must still be on disk / the pipe.
    code = ("import logging, sys\n"
            "from stages.lib.io import setup_logging\n"
            "from stages.lib.cli import exit_after_success\n"
            f"setup_logging({str(tmp_path / 's.log')!r}, 's')\n"
            "logging.getLogger('s').info('last line')\n"
            "sys.stdout.write('no newline')\n"
            "exit_after_success()\n"
            "raise SystemExit(3)\n")       # never reached
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout == "no newline" and "last line" in r.stderr
    assert (tmp_path / "s.log").read_text().splitlines()[-1].endswith("last line")


def test_the_log_file_holds_what_our_code_logs_and_nothing_a_library_logs(tmp_path):
    """logs/<stage>.log is hashed: a library's first-run notice (matplotlib's "generated new fontManager" on a
    machine where it never ran, here a real first run: an empty MPLCONFIGDIR) reaches the console only, or a fresh
    machine records a different log than a warm one."""
    code = ("import logging\n"
            "from stages.lib.io import MEASUREMENT, setup_logging\n"
            "from stages.lib.cli import refuse\n"
            f"setup_logging({str(tmp_path / 's.log')!r}, 's')\n"
            "import matplotlib.font_manager\n"           # no font cache: matplotlib logs that it builds one
            "logging.getLogger('s').info('ours')\n"
            "refuse('s', 'bad input')\n"                 # logged by stages/lib/cli.py
            "logging.getLogger('s').info('a timing', extra=MEASUREMENT)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "MPLCONFIGDIR": str(tmp_path / "empty_mpl")}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "generated new fontManager" in r.stderr and "a timing" in r.stderr
    assert (tmp_path / "s.log").read_text() == "s INFO ours\ns ERROR s: refused: bad input\n"
