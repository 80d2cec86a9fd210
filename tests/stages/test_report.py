"""report: DVC-compatible hashes, a deterministic leak-free evidence bundle, and a real `dvc repro`
in a temp git repo (synthetic inputs -> real evaluate CLI -> real report CLI) whose dvc.lock agrees
with the bundle's manifest, whose `dvc metrics diff` shows the changed numbers and whose
`dvc plots diff` renders."""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from stages import report as rp
from stages.evidence import bundle as ev
from stages.lib.stage_plan import bundle_artifacts
from synthetic_probe import write_all, write_sources

from conftest import REPO_ROOT as REPO

EVALUATE_CMD = (
    "python -m stages.evaluate --params params.yaml --probe-manifest results/probe/probe_manifest.json"
    " --probe-token-manifest results/tokens/probe_token_manifest.json"
    " --dpo-step0 results/train_dpo/probe_step0.jsonl --dpo-final results/train_dpo/probe_final.jsonl"
    " --rm-step0 results/train_rm/probe_step0.jsonl --rm-final results/train_rm/probe_final.jsonl"
    " --metrics-dpo metrics/dpo.json --metrics-rm metrics/rm.json"
    " --bootstrap results/evaluate/bootstrap_summary.json --log logs/evaluate.log")
PER_PAIR = [f"results/train_{m}/probe_{c}.jsonl" for m in ("dpo", "rm") for c in ("step0", "final")]
# The judge stage's outputs, packed (verify reruns the win-rate bootstrap from the judgments).
GENERATION_EVAL = ["results/judge/judgments.jsonl", "metrics/generation.json", "results/judge/judge_summary.json"]
SYNTH_OUTS = (["results/probe/probe_manifest.json", "results/tokens/probe_token_manifest.json",
               "results/tokens/probe_tokens.parquet", "results/env/environment.json"] + PER_PAIR
              + [f"results/train_{m}/{f}" for m in ("dpo", "rm") for f in ("train_log.csv", "run_info.json", "model")]
              + GENERATION_EVAL)
# What the report rule hashes without packing: every output of the data, reference and token stages and the
# models, from the pipeline's layout (the list `verify` requires in a manifest); the synthetic inputs stand them in.
ARTIFACTS = bundle_artifacts(yaml.safe_load((REPO / "params.yaml").read_text()))
# The sft stage's outputs (params `sft` set): synthetic_probe.py writes them, agreeing with the reference identity.
SYNTH_OUTS += [p for p, stage in ARTIFACTS.items() if stage == "sft"]
HASHED_ONLY = [p for p, stage in ARTIFACTS.items() if stage in ("normalize", "freeze_probe", "verify_ref", "tokenize",
                                                                "sft", "ref_logps", "generate")] + [
    f"results/{stage}/{out}" for stage in ("train_dpo", "train_rm") for out in ("model", "dvclive")]
STAND_INS = [p for p in HASHED_ONLY if p not in SYNTH_OUTS]
REPORT_ARGS = (["--params", "params.yaml", "--artifacts", *HASHED_ONLY,
                "--metrics", "metrics/dpo.json", "metrics/rm.json", "--per-pair", *PER_PAIR,
                "--bootstrap-summary", "results/evaluate/bootstrap_summary.json",
                "--generation-eval", *GENERATION_EVAL,
                "--train-log", "dpo=results/train_dpo/train_log.csv", "rm=results/train_rm/train_log.csv",
                "--run-info", "dpo=results/train_dpo/run_info.json", "rm=results/train_rm/run_info.json",
                "--environment", "results/env/environment.json",
                "--probe-manifests", "results/probe/probe_manifest.json", "results/tokens/probe_token_manifest.json",
                "--normalize-stats", "results/normalize/normalize_stats.json"])
REPORT_CMD = ("python -m stages.report " + " ".join(REPORT_ARGS) + " --bundle results/report/evidence.tar.gz"
              " --summary results/report/summary.md --curves-dir results/report/curves --log logs/report.log")


def small_params(**train) -> dict:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["probe"]["size"] = 64
    params["evaluate"]["bootstrap_replicates"] = 1000
    params["train"].update(train)
    return params


NORMALIZE_OUTS = [p for p, stage in ARTIFACTS.items() if stage == "normalize"]


def dvc_yaml(params: dict) -> dict:
    return {
        "stages": {
            # as the pipeline's: the source files are deps, data the params (verify holds the bundle to both)
            "normalize": {"cmd": "python -m synthetic_probe --params params.yaml --root . --part normalize",
                          "deps": [s["path"] for s in params["data"]["sources"]], "params": ["data"],
                          "outs": NORMALIZE_OUTS},
            "synth": {"cmd": "python -m synthetic_probe --params params.yaml --root . --part rest",
                      "params": ["probe", "train.seed", "dpo"],
                      "outs": SYNTH_OUTS + [p for p in STAND_INS if p not in NORMALIZE_OUTS]},
            "evaluate": {"cmd": EVALUATE_CMD, "params": ["evaluate", "probe.size", "dpo.beta", "dpo.objective"],
                         "deps": ["results/probe/probe_manifest.json", "results/tokens/probe_token_manifest.json",
                                  *PER_PAIR],
                         "outs": ["results/evaluate/bootstrap_summary.json"],
                         "metrics": [{"metrics/dpo.json": {"cache": False}}, {"metrics/rm.json": {"cache": False}}]},
            "report": {"cmd": REPORT_CMD,
                       "deps": [*HASHED_ONLY, *[s["path"] for s in params["data"]["sources"]],
                                "metrics/dpo.json", "metrics/rm.json", *PER_PAIR,
                                "results/evaluate/bootstrap_summary.json", *GENERATION_EVAL, "results/env/environment.json",
                                *[f"results/train_{m}/{f}" for m in ("dpo", "rm") for f in ("train_log.csv", "run_info.json")]],
                       "outs": ["results/report/evidence.tar.gz", "results/report/summary.md", "results/report/curves"]},
        },
        # The plots definition proposed for the pipeline's dvc.yaml (top-level `plots:`).
        "plots": [
            {"results/train_dpo/train_log.csv": {"x": "step", "y": ["loss", "accuracy", "margin"], "title": "DPO training"}},
            {"results/train_rm/train_log.csv": {"x": "step", "y": ["loss", "accuracy", "margin"], "title": "RM training"}},
        ],
    }


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    env.update(DVC_NO_ANALYTICS="1", GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.invalid",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.invalid")
    return env


def sh(cwd: Path, *cmd: str) -> str:
    r = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout


def _members(bundle: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(bundle), mode="r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def _leak_scan(members: dict[str, bytes], repo: Path) -> None:
    needles = [socket.gethostname(), str(repo.resolve()), str(REPO), os.environ.get("HOME", "")]
    needles = [n for n in needles if len(n) >= 4]
    credential = re.compile(rb"hf_[A-Za-z0-9]{30,}|gh[pousr]_[A-Za-z0-9]{36}|AKIA[0-9A-Z]{16}|PRIVATE KEY-----|sk-[A-Za-z0-9]{20,}")
    for name, data in members.items():
        for n in needles:
            assert n.encode() not in data, f"{name} leaks {n!r}"
        assert not credential.search(data), f"{name} holds a credential-like string"
        assert not name.startswith("/") and ".." not in name.split("/")
        assert not name.endswith((".safetensors", ".bin", ".pt", ".pth", ".ckpt"))


# --------------------------------------------------------------------------------------------------
# Unit: DVC hash algorithm, tar determinism, leak refusal
# --------------------------------------------------------------------------------------------------

def test_dvc_hash_matches_dvc_data_for_file_and_dir(tmp_path):
    from dvc_data.hashfile.build import build
    from dvc_data.hashfile.db import HashFileDB
    from dvc_objects.fs import LocalFileSystem

    d = tmp_path / "d"
    (d / "a" / "b").mkdir(parents=True)
    (d / "x.txt").write_text("hello\r\nworld\n")  # CRLF: DVC 3 hashes raw bytes (no dos2unix)
    (d / "a" / "y.bin").write_bytes(bytes(range(256)))
    (d / "a" / "b" / "z").write_bytes(b"")
    (d / "a-b").write_text("sorts between a/ and b")
    fs = LocalFileSystem()
    odb = HashFileDB(fs, str(tmp_path / "odb"))
    for target in (d, d / "x.txt"):
        _, meta, obj = build(odb, str(target), fs, "md5")
        ours = rp.dvc_hash(target)
        assert ours["md5"] == obj.hash_info.value and ours["size"] == meta.size
        if target.is_dir():
            assert ours["nfiles"] == meta.nfiles == 4 and ours["md5"].endswith(".dir")
    # The bundle's way: every file of every path hashed at once in a thread pool; the same digests.
    assert rp.dvc_hashes([d, d / "x.txt", d / "a"]) == [rp.dvc_hash(d), rp.dvc_hash(d / "x.txt"), rp.dvc_hash(d / "a")]


def test_tar_is_deterministic_and_normalized():
    members = {"evidence/b.txt": b"b", "evidence/a/z.json": b"{}", "evidence/a.txt": b"a" * 1000}
    one, two = rp.deterministic_targz(members), rp.deterministic_targz(dict(reversed(members.items())))
    assert one == two
    assert one[4:8] == b"\0\0\0\0"  # gzip mtime 0
    with tarfile.open(fileobj=io.BytesIO(one), mode="r:gz") as tar:
        infos = tar.getmembers()
    assert [i.name for i in infos] == sorted(members)
    assert {(i.mtime, i.uid, i.gid, i.uname, i.gname, i.mode) for i in infos} == {(0, 0, 0, "", "", 0o644)}


def _inputs(tmp_path: Path, params: dict) -> Path:
    write_all(tmp_path, params)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    r = subprocess.run([sys.executable, *EVALUATE_CMD.split()[1:]], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return tmp_path


def _report(repo: Path, out: str) -> tuple[bytes, str]:
    # the report rule's arguments under this repo's params (reference-free DPO has no ref_logps)
    produced = bundle_artifacts(yaml.safe_load((repo / "params.yaml").read_text()))
    args = [a for a in REPORT_ARGS if a not in ARTIFACTS or a in produced]
    r = subprocess.run([sys.executable, "-m", "stages.report", *args, "--bundle", f"{out}/evidence.tar.gz",
                        "--summary", f"{out}/summary.md", "--log", f"{out}/report.log"],
                       cwd=repo, env=_env(), capture_output=True, text=True)
    return r.returncode, r.stderr


def test_bundle_byte_identical_contents_and_no_leaks(tmp_path):
    repo = _inputs(tmp_path, small_params())
    for out in ("o1", "o2"):
        rc, err = _report(repo, out)
        assert rc == 0, err
    bundle = (repo / "o1/evidence.tar.gz").read_bytes()
    assert bundle == (repo / "o2/evidence.tar.gz").read_bytes()
    members = _members(bundle)
    _leak_scan(members, repo)

    manifest = json.loads(members["evidence/manifest.json"])
    for name, data in members.items():
        if name != "evidence/manifest.json":
            assert manifest["members"][name]["sha256"] == hashlib.sha256(data).hexdigest()
    assert {f"evidence/artifacts/{p}" for p in PER_PAIR} <= set(members)
    assert members["evidence/params.yaml"] == (repo / "params.yaml").read_bytes()
    assert members["evidence/curves/dpo_train_curves.png"].startswith(b"\x89PNG")
    by_path = {a["path"]: a for a in manifest["artifacts"]}
    assert by_path["results/train_dpo/model"]["packed"] is False and by_path["results/train_dpo/model"]["nfiles"] == 3
    env = json.loads(members["evidence/environment.json"])
    record = json.loads((repo / "results/env/environment.json").read_text())
    assert env["record"] == record and env["training"]["dpo"]["record"] == record
    assert env["record"]["python"] == ".".join(map(str, sys.version_info[:2]))
    # no hostname, paths, timings: the whitelisted layout, objective and settings only
    assert set(env["training"]["dpo"]) == {"world_size", "backend", "record", "objective", "settings"}
    assert members["evidence/artifacts/results/env/environment.json"] == (repo / "results/env/environment.json").read_bytes()
    summary = members["evidence/summary.md"].decode()
    assert "| dpo | 0.5000 |" in summary and "![dpo_train_curves.png](curves/dpo_train_curves.png)" in summary
    # What ran names the split's arithmetic and each run's batch, schedule, warmup and seed (issue 37)
    stats = json.loads((repo / "results/normalize/normalize_stats.json").read_text())
    tok = json.loads((repo / "results/tokens/tokenize_report.json").read_text())["splits"]
    pairs, probe, train = stats["totals"]["pairs_out"], tok["probe"]["pairs_in"], tok["train"]["pairs_in"]
    # (this synthetic workspace's records do not add up: its normalize stats are not the tokenized splits' source,
    # so the line is left out rather than printing a negative count)
    line = f"{pairs} pairs = {probe} probe + {train} train + {pairs - probe - train} excluded from train"
    assert (line in summary) == (pairs >= probe + train) and ("excluded from train" in summary) == (pairs >= probe + train)
    st = json.loads((repo / "results/train_dpo/run_info.json").read_text())["settings"]
    assert (f"| {st['lr']} | {st['schedule']} ({st['warmup_ratio']}) | {st['global_batch_pairs']} | {st['epochs']} | "
            f"{st['seed']} |") in summary


def test_leaks_refuse_the_bundle(tmp_path):
    repo = _inputs(tmp_path, small_params())
    log = repo / "results/train_rm/train_log.csv"
    lines = log.read_text().splitlines()
    token = "hf_" + "a1B2" * 9
    log.write_text("\n".join([lines[0] + ",note"] + [ln + "," + token for ln in lines[1:]]) + "\n")
    rc, err = _report(repo, "o")
    assert rc != 0 and "evidence/artifacts/results/train_rm/train_log.csv contains what looks like a huggingface token" in err
    assert token not in err and not (repo / "o/evidence.tar.gz").exists()

    log.write_text("\n".join(lines) + "\n")
    # params.yaml's path values are written portably (test_absolute_source_paths_...); anything else is scanned
    text = (repo / "params.yaml").read_text()
    (repo / "params.yaml").write_text(f"# copied from {repo.resolve() / 'elsewhere/params.yaml'}\n" + text)
    rc, err = _report(repo, "o")
    assert rc != 0 and "evidence/params.yaml contains the absolute repository path" in err


def test_absolute_artifact_paths_refused(tmp_path):
    with pytest.raises(rp.ReportError, match="must be relative"):
        rp.relative_artifact_path(str(tmp_path / "x.json"))
    with pytest.raises(rp.ReportError, match="must be relative"):
        rp.relative_artifact_path("results/../../etc/passwd")


# --------------------------------------------------------------------------------------------------
# A real dvc repro in a temp git repo
# --------------------------------------------------------------------------------------------------

def _lock_entries(lock: dict) -> dict[str, dict]:
    out = {}
    for name, stage in lock["stages"].items():
        for key in ("deps", "outs"):
            for e in stage.get(key, []):
                out.setdefault(e["path"], e)
    return out


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("dvc") is None or shutil.which("git") is None, reason="needs dvc and git")
def test_dvc_repro_lock_agrees_metrics_diff_plots_diff_and_rerun_identical(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    sh(repo, "git", "init", "-q")
    sh(repo, "dvc", "init", "-q")
    params = small_params(seed=1)
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    write_sources(repo, params)
    (repo / "dvc.yaml").write_text(yaml.safe_dump(dvc_yaml(params), sort_keys=False))
    (repo / ".gitignore").write_text("logs/\n")
    sh(repo, "dvc", "repro", "-q")

    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    bundle = (repo / "results/report/evidence.tar.gz").read_bytes()
    members = _members(bundle)
    _leak_scan(members, repo)
    manifest = {a["path"]: a for a in json.loads(members["evidence/manifest.json"])["artifacts"]}
    entries = _lock_entries(lock)
    compared = 0
    for path, a in manifest.items():
        e = entries[path]
        assert a["md5"] == e["md5"] and a["size"] == e["size"], path
        if a["kind"] == "dir":
            assert a["nfiles"] == e["nfiles"], path
        compared += 1
    assert compared == len(manifest) and {"results/train_dpo/model", "metrics/dpo.json"} <= set(manifest)
    assert manifest["results/train_rm/model"]["md5"].endswith(".dir")

    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-qm", "run 1")
    (repo / "params.yaml").write_text(yaml.safe_dump(small_params(seed=2)))  # a training param
    sh(repo, "dvc", "repro", "-q")
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-qm", "run 2")

    diff = json.loads(sh(repo, "dvc", "metrics", "diff", "HEAD~1", "--json"))
    dpo = diff["metrics/dpo.json"]
    changed = dpo["final.accuracy"]
    assert isinstance(changed["old"], float) and isinstance(changed["new"], float) and changed["old"] != changed["new"]
    assert "improvement.accuracy_ci_low" in dpo
    sh(repo, "dvc", "plots", "diff", "HEAD~1", "-o", str(tmp_path / "plots"))
    assert "vegaEmbed('#results_train_dpo_train_log_csv'" in (tmp_path / "plots" / "index.html").read_text()
    plots = json.loads(sh(repo, "dvc", "plots", "diff", "HEAD~1", "--json"))["data"]
    for log in ("results/train_dpo/train_log.csv", "results/train_rm/train_log.csv"):
        (spec,) = plots[log]
        assert set(spec["revisions"]) == {"workspace", "HEAD~1"}
        rows = spec["content"]["data"]["values"]
        loss = {rev: [r["loss"] for r in rows if r["rev"] == rev and r["field"] == "loss"] for rev in spec["revisions"]}
        assert len(loss["HEAD~1"]) == len(loss["workspace"]) == 12 and loss["HEAD~1"] != loss["workspace"]

    before = (repo / "results/report/evidence.tar.gz").read_bytes()
    sh(repo, "dvc", "repro", "-q", "--force")
    assert (repo / "results/report/evidence.tar.gz").read_bytes() == before
    assert sh(repo, "git", "status", "--porcelain") == ""  # dvc.lock and metrics unchanged by the rerun


# --------------------------------------------------------------------------------------------------
# verify: a reviewer checks someone else's bundle; tampered bundles are refused, naming the file
# --------------------------------------------------------------------------------------------------

def _verify(repo: Path, bundle: Path, *extra: str, workspace: bool = True, cli: bool = False) -> tuple[int, str]:
    """`report verify` on `bundle` from `repo`: (exit status, output). In this process (the verdicts, the lines and
    the status are main()'s), or with `cli`, as `python -m stages.report verify` in its own, as users run it: each
    new process pays torch's and matplotlib's imports (~4 CPU-seconds), for ~30 verifies in this file."""
    argv = ["verify", str(bundle), *(["--workspace", str(repo)] if workspace else []), *extra]
    if cli:
        r = subprocess.run([sys.executable, "-m", "stages.report", *argv], cwd=repo, env=_env(), capture_output=True,
                           text=True)
        return r.returncode, r.stdout + r.stderr
    out, cwd = io.StringIO(), os.getcwd()
    os.chdir(repo)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                rc = rp.main(argv)
            except SystemExit as e:            # a refusal (stage_main's refuse): its status
                rc = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(cwd)
    return rc, out.getvalue()


def _rewrite(bundle: Path, out: Path, change, consistent: bool) -> Path:
    """Apply `change(members)` (a member dict, the manifest parsed as "manifest") and, when `consistent`, re-hash
    the manifest as a careful forger would, so only the recomputations (derived members, metrics, the layout,
    params against the runs, workspace, environment) can catch it."""
    members = _members(bundle.read_bytes())
    members["manifest"] = json.loads(members["evidence/manifest.json"])
    change(members)
    manifest = members.pop("manifest")
    members["evidence/manifest.json"] = ev.json_bytes(manifest)
    if consistent:
        for e in manifest["artifacts"]:
            data = members.get(f"evidence/artifacts/{e['path']}")
            if e["packed"] and data is not None:
                e.update(md5=hashlib.md5(data).hexdigest(), sha256=hashlib.sha256(data).hexdigest(), size=len(data))
        manifest["params_sha256"] = hashlib.sha256(members["evidence/params.yaml"]).hexdigest()
        manifest["members"] = {n: {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d)}
                               for n, d in sorted(members.items()) if n != "evidence/manifest.json"}
        members["evidence/manifest.json"] = ev.json_bytes(manifest)
    out.write_bytes(rp.deterministic_targz(members))
    return out


def _edit_json(members: dict, name: str, edit) -> None:
    doc = json.loads(members[name])
    edit(doc)
    members[name] = ev.json_bytes(doc)


def test_verify_accepts_a_genuine_bundle_and_names_every_tampered_file(tmp_path):
    repo = _inputs(tmp_path, small_params())
    rc, err = _report(repo, "o")
    assert rc == 0, err
    bundle = repo / "o/evidence.tar.gz"
    rc, out = _verify(repo, bundle, cli=True)
    assert rc == 0, out
    assert "MATCH    metrics/dpo.json: recomputed from" in out and "MATCH    metrics/rm.json" in out
    assert "MATCH    results/train_dpo/model: workspace md5" in out
    assert "MATCH    environment: same as this machine's" in out and " 0 differ," in out

    metrics = "evidence/artifacts/metrics/dpo.json"
    cases = {
        # bytes changed in place (same size), manifest left alone: the member's hash names it
        "member": (lambda m: m.__setitem__(metrics, m[metrics].replace(b'"n_pairs"', b'"n_pairZ"')), False,
                   "DIFFERS  evidence/artifacts/metrics/dpo.json: sha256"),
        # a byte added, manifest left alone: the member is not read past the size the manifest gives it
        "grown": (lambda m: m.__setitem__(metrics, m[metrics].replace(b'"n_pairs"', b'"n_pairs" ')), False,
                  "bytes in the bundle, the manifest says"),
        "missing": (lambda m: m.pop("evidence/summary.md"), False,
                    "DIFFERS  evidence/summary.md: listed in the manifest, missing from the bundle"),
        "extra": (lambda m: m.__setitem__("evidence/extra.txt", b"x"), False,
                  "DIFFERS  evidence/extra.txt: in the bundle, not listed in the manifest"),
        # a consistent forgery of a headline number: only recomputing from the per-pair rows catches it
        "metric": (lambda m: _edit_json(m, metrics, lambda d: d["final"].__setitem__("accuracy", 0.99)), True,
                   "DIFFERS  metrics/dpo.json: metrics/dpo.json.final.accuracy: bundle 0.99, recomputed"),
        "bootstrap": (lambda m: _edit_json(m, "evidence/artifacts/results/evaluate/bootstrap_summary.json",
                                           lambda d: d["models"]["rm"]["bootstrap"]["accuracy"]["final"]
                                           .__setitem__("ci_low", 0.0)), True,
                      "DIFFERS  results/evaluate/bootstrap_summary.json (rm): bootstrap_summary.models.rm.bootstrap"),
        # a per-pair row whose label disagrees with its scores: evaluate's own check refuses it
        "per_pair": (lambda m: m.__setitem__("evidence/artifacts/results/train_rm/probe_final.jsonl",
                                             _flip_first_correct(m["evidence/artifacts/results/train_rm/probe_final.jsonl"])),
                     True, "DIFFERS  metrics (rm): per-pair rows refused by evaluate: results/train_rm/probe_final.jsonl row 0"),
    }
    for name, (change, consistent, expect) in cases.items():
        rc, out = _verify(repo, _rewrite(bundle, tmp_path / f"{name}.tar.gz", change, consistent))
        assert rc == 1 and expect in out, (name, out)

    # the workspace's model no longer is the one the bundle hashed
    weights = repo / "results/train_dpo/model/model.safetensors"
    weights.write_bytes(weights.read_bytes()[::-1])
    rc, out = _verify(repo, bundle)
    assert rc == 1 and "DIFFERS  results/train_dpo/model: workspace md5" in out, out


def _flip_first_correct(data: bytes) -> bytes:
    lines = data.decode().splitlines()
    row = json.loads(lines[0])
    row["correct"] = 1.0 - row["correct"] if row["correct"] != 0.5 else 1.0
    return ("\n".join([rp.json.dumps(row, sort_keys=True, separators=(",", ":"))] + lines[1:]) + "\n").encode()


def test_verify_reports_another_environment_and_can_require_the_same(tmp_path):
    repo = _inputs(tmp_path, small_params())
    rc, err = _report(repo, "o")
    assert rc == 0, err

    def torch(record):
        record["packages"].update(torch="2.11.0+cu130", matplotlib="3.0.0")

    def other_torch(m):     # a bundle made elsewhere: its record, the runs' records and the packed records agree
        _edit_json(m, "evidence/environment.json",
                   lambda d: [torch(r) for r in (d["record"], *(run["record"] for run in d["training"].values()))])
        _edit_json(m, "evidence/artifacts/results/env/environment.json", torch)
        for label in ("dpo", "rm"):
            _edit_json(m, f"evidence/artifacts/results/train_{label}/run_info.json", lambda d: torch(d["environment"]))
    forged = _rewrite(repo / "o/evidence.tar.gz", tmp_path / "env.tar.gz", other_torch, True)
    # the reviewer holds the bundle only (this workspace's run_info.json are this machine's)
    rc, out = _verify(repo, forged, workspace=False)
    assert rc == 0 and "ENV-DIFF environment: packages.matplotlib: recorded '3.0.0', here " in out, out
    assert "; packages.torch: recorded '2.11.0+cu130', here " in out, out
    # another matplotlib draws other pixels: the curves are not redrawn, and never said to match
    assert "SKIPPED  evidence/curves/dpo_train_curves.png: drawn with matplotlib 3.0.0, this machine has " in out, out
    assert "MATCH    evidence/curves/dpo_train_curves.png: redrawn" not in out, out
    rc, out = _verify(repo, forged, "--require-same-environment", workspace=False)
    assert rc == 1 and "environment differs from this machine's" in out, out
    rc, out = _verify(repo, tmp_path / "absent.tar.gz")
    assert rc == 1 and "not a readable evidence bundle" in out, out


# --------------------------------------------------------------------------------------------------
# verify checks meaning (issue 26): consistent forgeries of derived members, a workspace missing an artifact,
# absolute source paths
# --------------------------------------------------------------------------------------------------

def _genuine(root: Path, params: dict | None = None) -> tuple[Path, Path]:
    root.mkdir(parents=True, exist_ok=True)
    repo = _inputs(root, params or small_params())
    rc, err = _report(repo, "o")
    assert rc == 0, err
    return repo, repo / "o/evidence.tar.gz"


def _replace_text(members: dict, name: str, old: str, new: str) -> None:
    text = members[name].decode()
    assert old in text, (name, old)
    members[name] = text.replace(old, new, 1).encode()


def test_verify_refuses_consistent_forgeries_of_what_the_members_say(tmp_path):
    """Each forgery's manifest is re-hashed as a forger would, so every hash matches: only remaking the derived
    members, holding the manifest to the pipeline's layout and params.yaml to the runs catches them. They are caught
    from the bundle alone (no --workspace): a reviewer needs nothing else."""
    from stages.evidence.verify import verify_bundle

    repo, bundle = _genuine(tmp_path)
    for workspace in (True, False):
        rc, out = _verify(repo, bundle, workspace=workspace)
        assert rc == 0 and " 0 differ," in out, out
        for line in ("MATCH    evidence/summary.md: remade from the packed metrics",
                     "MATCH    evidence/curves/dpo_train_curves.png: redrawn from results/train_dpo/train_log.csv",
                     "MATCH    evidence/params.yaml (dpo run): the train settings",
                     "MATCH    evidence/manifest.json artifacts: every artifact of the 12 stages before report",
                     "MATCH    evidence/manifest.json evaluation", "MATCH    evidence/manifest.json curves",
                     "MATCH    results/evaluate/bootstrap_summary.json (header)"):
            assert line in out, (line, out)
    for workspace in (True, False):      # the runs' run_info.json are packed: no workspace needed
        assert "MATCH    evidence/environment.json: remade from the packed environment record and run_info.json" \
            in _verify(repo, bundle, workspace=workspace)[1]

    dpo_row = next(r for r in (repo / "o/summary.md").read_text().splitlines() if r.startswith("| dpo |"))
    final = dpo_row.split(" | ")[2].split(" [")[0]          # the final accuracy cell
    cases = {
        "summary": (lambda m: _replace_text(m, "evidence/summary.md", f"{dpo_row.split(' | ')[1]} | {final} [",
                                            f"{dpo_row.split(' | ')[1]} | 0.9900 ["),
                    "DIFFERS  evidence/summary.md: not what report writes from the bundle's metrics, bootstrap "
                    f"summary, train logs, run records and params: line 8: bundle '| dpo | "),
        "params": (lambda m: _replace_text(m, "evidence/params.yaml", "lr: 0.0003", "lr: 0.001"),
                   "DIFFERS  evidence/params.yaml (dpo run): train.lr: params.yaml 0.001, the dpo run trained with 0.0003"),
        # a knob the runs do not record, but the probe manifests do
        "probe_seed": (lambda m: _replace_text(m, "evidence/params.yaml", "seed: 20261202", "seed: 7777"),
                       "DIFFERS  evidence/params.yaml (probe manifests): probe.seed: params.yaml 7777, the probe "
                       "manifests record 20261202"),
        "curve": (lambda m: m.__setitem__("evidence/curves/dpo_train_curves.png", m["evidence/curves/rm_train_curves.png"]),
                  "DIFFERS  evidence/curves/dpo_train_curves.png: not the curves of results/train_dpo/train_log.csv"),
        "model": (lambda m: m["manifest"].__setitem__("artifacts", [e for e in m["manifest"]["artifacts"]
                                                                    if e["path"] != "results/train_dpo/model"]),
                  "DIFFERS  evidence/manifest.json artifacts: missing: results/train_dpo/model (an artifact of train_dpo)"),
        "evaluation": (lambda m: m["manifest"]["evaluation"].pop("dpo"),
                       "DIFFERS  evidence/manifest.json evaluation: evaluation.dpo: manifest None, the packed files give "
                       "{'metrics': 'metrics/dpo.json', 'final': 'results/train_dpo/probe_final.jsonl'"),
    }
    for name, (change, expect) in cases.items():
        forged = _rewrite(bundle, tmp_path / f"{name}.tar.gz", change, consistent=True)
        verdicts = verify_bundle(forged)
        hashes = [r for r in verdicts.rows if r[1].startswith("evidence/") and r[2].startswith("sha256")]
        assert hashes and all(status == "MATCH" for status, _, _ in hashes), (name, hashes)    # a careful forger's
        out = "\n".join(verdicts.lines())
        assert expect in out and verdicts.failed, (name, out)
    rc, out = _verify(repo, tmp_path / "summary.tar.gz", workspace=False, cli=True)     # the CLI's verdict: exit 1
    assert rc == 1 and " 1 differ," in out, out


def test_verify_with_a_workspace_refuses_a_missing_artifact(tmp_path):
    """A crashed rerun or --forcerun deletes outputs: with --workspace that is a DIFFERS naming the stage to
    rerun, not an unchecked artifact; SKIPPED only without --workspace."""
    repo, bundle = _genuine(tmp_path)
    shutil.rmtree(repo / "results/train_dpo/model")
    (repo / "metrics/dpo.json").unlink()
    rc, out = _verify(repo, bundle)
    assert rc == 1, out
    assert "DIFFERS  results/train_dpo/model: missing: rerun train_dpo" in out
    assert "DIFFERS  metrics/dpo.json (workspace): missing: rerun evaluate" in out
    rc, out = _verify(repo, bundle, workspace=False)
    assert rc == 0 and "SKIPPED  results/train_dpo/model: hashed only" in out, out


def test_summary_warns_of_a_run_too_short_to_train_and_verify_remakes_it(tmp_path):
    """A train log of 3 steps (a plan the trainer warned about): the summary says so, from the packed train log, so
    `report verify` remakes it from the bundle alone, and a summary with the warning removed is refused."""
    repo = _inputs(tmp_path / "r", small_params())
    log = repo / "results/train_dpo/train_log.csv"
    log.write_text("\n".join(log.read_text().splitlines()[:4]) + "\n")         # header + 3 steps
    rc, err = _report(repo, "o")
    assert rc == 0, err
    summary = (repo / "o/summary.md").read_text()
    assert "## Warnings\n\n- dpo: only 3 optimizer steps (fewer than 10): too few" in summary and "- rm:" not in summary
    rc, out = _verify(repo, repo / "o/evidence.tar.gz", workspace=False)
    assert rc == 0 and "MATCH    evidence/summary.md: remade from the packed metrics" in out, out
    forged = _rewrite(repo / "o/evidence.tar.gz", tmp_path / "quiet.tar.gz",
                      lambda m: _replace_text(m, "evidence/summary.md", "## Warnings", "## Notes"), consistent=True)
    rc, out = _verify(repo, forged, workspace=False)
    assert rc == 1 and "DIFFERS  evidence/summary.md: not what report writes" in out, out


def test_verify_requires_the_artifacts_the_objective_implies(tmp_path):
    """Reference-free DPO has no ref_logps stage: its bundle verifies without one, and one listed is refused."""
    params = small_params()
    params["dpo"]["objective"] = "dpo_ref_free"
    repo, bundle = _genuine(tmp_path, params)
    rc, out = _verify(repo, bundle)
    assert rc == 0 and "MATCH    evidence/manifest.json artifacts: every artifact of the 11 stages before report" in out, out
    rel = "results/ref_logps/ref_logps.parquet"
    (repo / rel).parent.mkdir(parents=True)
    (repo / rel).write_bytes(b"PAR1")
    entry = {"path": rel, "role": "artifact", "packed": False, **rp.dvc_hash(repo / rel)}
    forged = _rewrite(bundle, tmp_path / "ref.tar.gz", lambda m: m["manifest"]["artifacts"].append(entry), True)
    rc, out = _verify(repo, forged)
    assert rc == 1 and (f"DIFFERS  evidence/manifest.json artifacts: {rel}: not an artifact of the pipeline under "
                        "these params (dpo.objective dpo_ref_free)") in out, out


def test_report_refuses_sources_normalize_did_not_read(tmp_path):
    """The manifest pins the files normalize read; params naming other sources (a typo'd path whose stage was
    dropped, issue 26 item 1) would pin data the run never read: refused, naming the record."""
    repo = _inputs(tmp_path, small_params())
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["data"]["sources"][0]["path"] = "data/typo.jsonl"
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    rc, err = _report(repo, "o")
    assert rc == 1 and ("report: refused: results/normalize/normalize_stats.json: normalize read the sources "
                        "['data/embedded/color_facts_prefs.jsonl.gz'], params.yaml names ['data/typo.jsonl']: "
                        "rerun normalize") in err, err
    assert not (repo / "o/evidence.tar.gz").exists()


def test_portable_paths():
    assert ev.portable_path("data/x.jsonl") == "data/x.jsonl"
    assert ev.portable_path("../shared/data/x.jsonl.gz") == "../shared/data/x.jsonl.gz"     # relative: as written
    assert ev.portable_path("/srv/hh/test.jsonl.gz") == "external:test.jsonl.gz"
    assert ev.portable_path("/srv/hh/") == "external:hh"
    assert ev.portable_path("/srv/hh/*/train-*.parquet") == "external:hh/*/train-*.parquet"
    assert ev.portable_path("/srv/hh/a/train-0.parquet", "/srv/hh/*/train-*.parquet") == "external:hh/a/train-0.parquet"
    assert ev.portable_path("/srv/hh/sub/x.jsonl", "/srv/hh") == "external:hh/sub/x.jsonl"
    params = {"data": {"sources": [{"path": "/srv/a.jsonl", "format": "hh"}, {"path": "b.jsonl", "format": "hh"}]},
              "ref": {"local_dir": "/models/tiny"}, "train": {"seed": 1}}
    assert ev.portable_params(params) == {"data": {"sources": [{"path": "external:a.jsonl", "format": "hh"},
                                                               {"path": "b.jsonl", "format": "hh"}]},
                                          "ref": {"local_dir": "external:tiny"}, "train": {"seed": 1}}
    assert ev.portable_params({"ref.local_dir": "x", "data": {"sources": []}}) == {"ref.local_dir": "x",
                                                                                  "data": {"sources": []}}
    with pytest.raises(ev.EvidenceError, match="could not be rewritten"):   # an escaped spelling is refused, not kept
        ev.portable_params_text('ref: {local_dir: "/mod\\u0065ls/tiny"}\n', {"ref": {"local_dir": "/models/tiny"}})


def test_absolute_source_paths_leave_the_bundle_named_by_their_pin(tmp_path):
    """A data source (and a reference directory) outside the checkout, by absolute path: the bundle carries
    `external:<name>` in params.yaml and pins the file by md5/sha256 in the manifest; no member holds the path."""
    outside = tmp_path / "elsewhere" / "hh-test.jsonl"
    params = small_params()
    params["data"]["sources"] = [{"path": str(outside), "format": "trl"}]
    params["ref"]["local_dir"] = str(tmp_path / "models" / "tiny")
    repo, bundle = _genuine(tmp_path / "repo", params)
    members = _members(bundle.read_bytes())
    _leak_scan(members, repo)
    for name, data in members.items():
        assert str(tmp_path).encode() not in data, f"{name} carries an absolute path"
    text = (repo / "params.yaml").read_text()
    assert members["evidence/params.yaml"].decode() == ev.PORTABLE_NOTE + text.replace(
        str(outside), "external:hh-test.jsonl").replace(str(tmp_path / "models" / "tiny"), "external:tiny")
    data = outside.read_bytes()
    (source,) = json.loads(members["evidence/manifest.json"])["sources"]
    assert source == {"name": "source0", "path": "external:hh-test.jsonl",
                      "files": [{"path": "external:hh-test.jsonl", "md5": hashlib.md5(data).hexdigest(),
                                 "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}]}
    rc, out = _verify(repo, bundle)
    assert rc == 0 and "MATCH    evidence/manifest.json sources: 1 file(s) of 1 source(s)" in out, out
    # without dvc.lock nothing says where external:hh-test.jsonl lives on this machine
    assert "SKIPPED  source external:hh-test.jsonl: not in the workspace" in out, out

    # the pin and params.yaml's path must agree: a forged name is refused
    forged = _rewrite(bundle, tmp_path / "renamed.tar.gz",
                      lambda m: _replace_text(m, "evidence/params.yaml", "external:hh-test.jsonl", "external:other.jsonl"),
                      consistent=True)
    rc, out = _verify(repo, forged, workspace=False)
    assert rc == 1 and "DIFFERS  evidence/manifest.json sources: not params.yaml's data.sources" in out, out


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("dvc") is None or shutil.which("git") is None, reason="needs dvc and git")
def test_verify_holds_params_and_sources_to_the_workspace_dvc_lock(tmp_path):
    """A real `dvc repro` records params and the absolute source path in dvc.lock; verify --workspace compares them
    with the bundle's portable params.yaml and pins, and catches what the bundle alone cannot: a params.yaml forged
    together with the runs' settings, and a source file changed since the run."""
    outside = tmp_path / "elsewhere" / "hh-test.jsonl"
    repo = tmp_path / "repo"
    repo.mkdir()
    sh(repo, "git", "init", "-q")
    sh(repo, "dvc", "init", "-q")
    params = small_params()
    params["data"]["sources"] = [{"path": str(outside), "format": "trl"}]
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    write_sources(repo, params)
    (repo / "dvc.yaml").write_text(yaml.safe_dump(dvc_yaml(params), sort_keys=False))
    (repo / ".gitignore").write_text("logs/\n")
    sh(repo, "dvc", "repro", "-q")
    bundle = repo / "results/report/evidence.tar.gz"
    rc, out = _verify(repo, bundle)
    assert rc == 0, out
    assert "MATCH    source external:hh-test.jsonl (dvc.lock): dvc.lock md5" in out
    assert "MATCH    source external:hh-test.jsonl: workspace md5" in out
    assert "MATCH    evidence/params.yaml (dvc.lock): the " in out
    assert "MATCH    results/train_dpo/model (dvc.lock)" in out

    def reseeded(m):        # params.yaml and the runs' recorded settings (both places), consistently
        _replace_text(m, "evidence/params.yaml", "seed: 1234", "seed: 99")
        _edit_json(m, "evidence/environment.json",
                   lambda d: [run["settings"].__setitem__("seed", 99) for run in d["training"].values()])
        for label in ("dpo", "rm"):
            _edit_json(m, f"evidence/artifacts/results/train_{label}/run_info.json",
                       lambda d: d["settings"].__setitem__("seed", 99))
            _replace_text(m, "evidence/summary.md", "| 1234 |", "| 99 |")    # summary.md's What ran names it
    forged = _rewrite(bundle, tmp_path / "seed.tar.gz", reseeded, consistent=True)
    assert _verify(repo, forged, workspace=False)[0] == 0       # the bundle alone cannot tell
    rc, out = _verify(repo, forged)
    assert rc == 1 and "DIFFERS  evidence/params.yaml (dvc.lock): train.seed: params.yaml 99, dvc.lock (synth) 1234" in out
    assert "DIFFERS  results/train_dpo/run_info.json (workspace): workspace md5" in out

    outside.write_text(outside.read_text() + json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"}) + "\n")
    rc, out = _verify(repo, bundle)
    assert rc == 1 and "DIFFERS  source external:hh-test.jsonl: workspace md5" in out and "the data changed" in out


def test_verify_reruns_the_win_rate_bootstrap_from_the_packed_judgments(tmp_path):
    """summary.md carries the generation section; a judgment row's reward changed (manifest re-hashed, win kept
    consistent) is caught by the recomputed metrics, and a forged lower bound by the recomputed bootstrap."""
    repo, bundle = _genuine(tmp_path)
    summary = _members(bundle.read_bytes())["evidence/summary.md"].decode()
    assert "## Generation: policy against reference" in summary and "| win rate [CI] |" in summary
    assert "with &#124; a pipe" in summary and "<i>(empty)</i>" in summary       # escaped; the empty completion
    judgments = "evidence/artifacts/results/judge/judgments.jsonl"

    def lose_row_0(m):
        rows = [json.loads(line) for line in m[judgments].decode().splitlines()]
        rows[0]["policy_reward"] = rows[0]["reference_reward"] - 5.0
        rows[0]["win"] = 0.0
        m[judgments] = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()

    rc, out = _verify(repo, _rewrite(bundle, tmp_path / "j.tar.gz", lose_row_0, True), workspace=False)
    assert rc == 1 and "DIFFERS  metrics/generation.json" in out, out
    rc, out = _verify(repo, _rewrite(bundle, tmp_path / "m.tar.gz", lambda m: _edit_json(
        m, "evidence/artifacts/metrics/generation.json", lambda d: d.update(win_rate_ci_low=0.9)), True),
        workspace=False)
    assert rc == 1 and "DIFFERS  metrics/generation.json" in out and "win_rate_ci_low" in out, out


# --------------------------------------------------------------------------------------------------
# A self-describing bundle (issue 29, item 5): the run records packed, summary.md says what ran, per-source
# accuracy for mixtures, and verify holds the records to one another
# --------------------------------------------------------------------------------------------------

RECORD_FILES = ("results/normalize/normalize_stats.json", "results/tokens/tokenize_report.json",
                "results/ref/ref_identity.json", "results/train_dpo/run_info.json", "results/train_rm/run_info.json")


def test_the_bundle_packs_the_run_records_and_the_summary_says_what_ran(tmp_path):
    """Before: the four records were only hashed, and summary.md held the metrics table and the curves only."""
    repo, bundle = _genuine(tmp_path)
    members = _members(bundle.read_bytes())
    manifest = json.loads(members["evidence/manifest.json"])
    by_path = {a["path"]: a for a in manifest["artifacts"]}
    for rel in RECORD_FILES:
        assert members[f"evidence/artifacts/{rel}"] == (repo / rel).read_bytes(), rel
        assert by_path[rel]["packed"] is True and "portable" not in by_path[rel], rel
    assert not any(name.endswith((".parquet", ".safetensors")) for name in members)      # no data, no weights
    params = yaml.safe_load((repo / "params.yaml").read_text())
    sources = json.loads(members["evidence/probe_sources.json"])
    assert sources["probe_digest"] == json.loads((repo / "results/probe/probe_manifest.json").read_text())["probe_digest"]
    assert len(sources["sources"]) == params["probe"]["size"]

    summary = (repo / "o/summary.md").read_text()
    assert summary == members["evidence/summary.md"].decode()
    src = params["data"]["sources"][0]
    ref = params["ref"]
    st = json.loads((repo / "results/train_dpo/run_info.json").read_text())["settings"]
    plan, seed = f"{st['schedule']} ({st['warmup_ratio']}) | {st['global_batch_pairs']}", st["seed"]
    for line in (
            "## What ran",
            f"| {src['name']} | `{src['path']}` | {src['format']} | 3 | 3 | 0 | - |",
            "| train | 100 | 100 | 0 | 0 | - |", f"| probe | 64 | 64 | 0 | 0 | - |",
            f"Reference: `{ref['repo_id']}` ({ref['source']}, `{ref['local_dir']}`) at revision `{ref['revision']}` "
            "(pinned), 1 files verified.",
            f"| dpo | dpo | {' + '.join(params['dpo']['loss'])} | 0.1 | 0.0003 | {plan} | 2 | {seed} | none (full "
            "fine-tuning) | 100 | 12 | 1 |",
            f"| rm | reward_model | pairwise logistic | - | 0.0003 | {plan} | 2 | {seed} | none (full fine-tuning) | 100 | "
            "12 | 1 |"):
        assert line in summary.splitlines(), (line, summary)
    assert "Per-source" not in summary                       # one source: the table above is per source already
    # the SFT run and its pinned export, named from the packed records
    sft_line = next(line for line in summary.splitlines() if line.startswith("SFT (completion-only, stage `sft`)"))
    sft_identity = json.loads((repo / "results/sft/ref_identity.json").read_text())
    assert f"`{sft_identity['repo_id']}`" in sft_line and sft_identity["revision"] in sft_line


def test_a_mixture_gets_per_source_accuracy_from_the_evaluate_bootstrap(tmp_path):
    """Two sources: each model's accuracy per source, from the per-pair rows joined to their source
    (probe_sources.json, from the probe pairs) and evaluate's paired bootstrap, which equals scipy's."""
    import numpy as np
    import scipy.stats
    from stages.evidence import scoring
    params = small_params()
    params["data"]["sources"] = [{"name": "alpha", "path": "data/a.jsonl", "format": "trl"},
                                 {"name": "beta", "path": "data/b.jsonl", "format": "trl"}]
    repo, bundle = _genuine(tmp_path, params)
    summary = (repo / "o/summary.md").read_text().splitlines()
    assert "## Per-source probe accuracy" in summary
    sources = json.loads(_members(bundle.read_bytes())["evidence/probe_sources.json"])["sources"]
    rows = {w: [json.loads(x) for x in (repo / f"results/train_rm/probe_{w}.jsonl").read_text().splitlines()]
            for w in ("step0", "final")}
    ev_params = params["evaluate"]
    for name in ("alpha", "beta"):
        idx = [i for i, s in enumerate(sources) if s == name]
        s0, fi = (np.asarray([scoring.correct_label(rows[w][i]["chosen_score"], rows[w][i]["rejected_score"])
                              for i in idx]) for w in ("step0", "final"))
        ci = scipy.stats.bootstrap((s0, fi), lambda a, b, axis: np.mean(b, axis=axis) - np.mean(a, axis=axis),
                                   paired=True, vectorized=True, method="percentile",
                                   n_resamples=ev_params["bootstrap_replicates"],
                                   confidence_level=ev_params["confidence"],
                                   random_state=np.random.Generator(np.random.PCG64(ev_params["seed"]))).confidence_interval
        row = next(r for r in summary if r.startswith(f"| rm | {name} | "))
        want = (f"| rm | {name} | {len(idx)} | {s0.mean():.4f} | {fi.mean():.4f} [") 
        assert row.startswith(want), (row, want)
        assert row.endswith(f"| {fi.mean() - s0.mean():.4f} [{ci.low:.4f}, {ci.high:.4f}] |"), (row, ci)
    assert len([r for r in summary if r.startswith("| dpo | alpha | ") or r.startswith("| dpo | beta | ")]) == 2
    rc, out = _verify(repo, bundle)
    assert rc == 0 and "MATCH    evidence/summary.md: remade" in out, out


def test_verify_holds_the_run_records_to_one_another_and_the_workspace(tmp_path):
    """A careful forger's edit of a record (every hash recomputed) contradicts the other records, the probe
    manifests or params: DIFFERS naming the record; with --workspace, probe_sources.json is remade from the probe
    pairs. Before: the records were not in the bundle, so nothing held them to anything."""
    from stages.evidence.verify import verify_bundle
    repo, bundle = _genuine(tmp_path)
    rc, out = _verify(repo, bundle)
    assert rc == 0, out
    for rel in (*RECORD_FILES, "probe_sources.json"):
        assert f"MATCH    {rel} (record): consistent" in out, (rel, out)
    assert "MATCH    probe_sources.json (workspace): remade from results/probe/probe.parquet" in out

    cases = {
        "stats": (lambda m: _edit_json(m, "evidence/artifacts/results/normalize/normalize_stats.json",
                                       lambda d: d["sources"][0].__setitem__("pairs_out", 2)),
                  "DIFFERS  results/normalize/normalize_stats.json (record): source embedded: rows_in 3 != pairs_out 2"),
        "tokenize": (lambda m: _edit_json(m, "evidence/artifacts/results/tokens/tokenize_report.json",
                                          lambda d: d["limits"].__setitem__("max_length", 4096)),
                     "DIFFERS  results/tokens/tokenize_report.json (record): limits"),
        "trained": (lambda m: _edit_json(m, "evidence/artifacts/results/train_dpo/run_info.json",
                                         lambda d: d.__setitem__("train_pairs", 7)),
                    "the dpo run trained 7 pairs and scored 64; tokenize wrote 100 and 64"),
        "identity": (lambda m: _edit_json(m, "evidence/artifacts/results/ref/ref_identity.json",
                                          lambda d: d["files"][0].__setitem__("size", 3)),
                     "DIFFERS  results/ref/ref_identity.json (record): identity_digest is not the digest of its fields"),
        "sources": (lambda m: m.__setitem__("evidence/probe_sources.json", ev.json_bytes(
            {**json.loads(m["evidence/probe_sources.json"]), "sources": ["other"] * 64})),
                    "DIFFERS  probe_sources.json (record): names sources normalize did not read: ['other']"),
    }
    for name, (change, expect) in cases.items():
        forged = _rewrite(bundle, tmp_path / f"{name}.tar.gz", change, consistent=True)
        out = "\n".join(verify_bundle(forged, repo).lines())
        assert expect in out, (name, out)
    out = "\n".join(verify_bundle(tmp_path / "sources.tar.gz", repo).lines())
    assert "DIFFERS  probe_sources.json (workspace): not the sources of results/probe/probe.parquet's pairs" in out


def test_a_record_naming_an_absolute_path_is_packed_portably(tmp_path):
    """normalize_stats.json of a source outside the checkout names its absolute path: the bundle packs it with the
    path written `external:...` (no machine layout in the bundle), flagged `portable`, and verify with the
    workspace compares it with the file's own portable form."""
    outside = tmp_path / "elsewhere" / "hh-test.jsonl"
    params = small_params()
    params["data"]["sources"] = [{"path": str(outside), "format": "trl"}]
    repo, bundle = _genuine(tmp_path / "w", params)
    members = _members(bundle.read_bytes())
    rel = "results/normalize/normalize_stats.json"
    packed = json.loads(members[f"evidence/artifacts/{rel}"])
    assert packed["sources"][0]["path"] == "external:hh-test.jsonl" == packed["sources"][0]["files"][0]["path"]
    assert str(tmp_path) not in members[f"evidence/artifacts/{rel}"].decode()
    entry = next(a for a in json.loads(members["evidence/manifest.json"])["artifacts"] if a["path"] == rel)
    assert entry["portable"] is True and entry["md5"] == hashlib.md5((repo / rel).read_bytes()).hexdigest()
    rc, out = _verify(repo, bundle)
    assert rc == 0 and f"MATCH    {rel}: the workspace's file, its absolute paths written portably" in out, out
    rc, out = _verify(repo, bundle, workspace=False)
    assert rc == 0 and f"SKIPPED  {rel}: packed with absolute paths written portably" in out, out
