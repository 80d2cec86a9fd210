"""Training checkpoints: periodic, atomic, self-describing, verified before anything is loaded.

One directory per checkpoint under `--checkpoint-dir` (e.g. checkpoints/train_dpo/, outside the
rule's declared outputs so Snakemake/DVC never delete it before a rerun):

    step_00000004-<fingerprint[:12]>/
        meta.json             run header + step + sha256 of every file; written LAST
        model.pt | model/     DDP: torch.save of the module state dict (replicas are identical, rank 0
                              writes); FSDP2: a torch.distributed.checkpoint (DCP) directory of shards
        optimizer.pt | optimizer/
        trainer_state.json    step, tokens, the train-log rows so far (flushed before the save)
        probe_step0.jsonl     step-0 probe rows: a resumed run rewrites its output from these
        best_model.pt         train.select_best only: the best dev step's weights so far (stages/engine/dev_eval.py;
                              trainer_state.json then holds the dev rows and that step)
        rng/rank00000.pt ...  python, numpy, torch CPU (+ CUDA) RNG states of every rank

Atomicity: every rank writes into `.tmp-<name>/`; rank 0 hashes the files, writes meta.json, fsyncs
and renames the directory into place. A checkpoint is complete iff its name has no `.tmp-` prefix
and it holds meta.json, so a crash mid-save leaves the previous checkpoint as the newest complete
one. The last `train.keep_checkpoints` complete checkpoints of the same run are kept. On
multi-node runs the directory must be on a filesystem every rank sees.

Run fingerprint = sha256 of the run header: objective, role, head, model config digest, reference
digest (ref_identity.json's identity_digest, or a content digest of --model-dir), train/probe
token digests, objective params (beta, loss, ..., the reference log-probs digest), the `train`
settings that shape the trajectory (all but save_every / keep_checkpoints), world size, parallel.

Resume (`--resume`):
  never  start from scratch (existing checkpoints are left alone);
  auto   the newest complete checkpoint whose fingerprint equals this run's; checkpoints of other
         runs (changed params, data, reference, world size, objective) are skipped with a logged
         warning that names every difference, so a rerun with new params starts fresh instead of
         loading something incompatible; a matching checkpoint that is partial or corrupted (a file
         missing or differing from its recorded sha256, an unreadable meta.json) is skipped with a
         warning naming it and why, and the next older one of this run is tried: a crash or a damaged
         disk costs the steps since the newest good checkpoint, never the run; with none good the run
         starts fresh, saying so;
  PATH   exactly that checkpoint; any difference from this run is refused with the reasons.
Resuming under another world size is refused: the deterministic data plan assigns pairs to ranks
by world size and the RNG state is per rank, so the trajectory would not be the same run's.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from stages.lib import record_formats
from stages.lib.io import read_json, sha256_file, sha256_json, write_jsonl

log = logging.getLogger("checkpoint")

# meta.json's `format` (stages/lib/record_formats.py CHECKPOINT). prefpipe-checkpoint/3: every field written, null
# where unset (train settings, objective params, dev_digest). Before it, an integer format_version: 1, and 2 (no
# scheduler.pt: the learning rate is a function of the step).
FORMAT = record_formats.CHECKPOINT
META = "meta.json"
TMP_PREFIX = ".tmp-"
# Every objective a checkpoint of ours can carry -> (role, head kind). A value-head critic or a plain
# causal LM is recognised so that loading one into the wrong trainer is refused by name.
OBJECTIVE_KINDS = {
    "causal_lm": ("policy", "lm_head"),
    "sft": ("policy", "lm_head"),
    "dpo": ("policy", "lm_head"),
    "dpo_ref_free": ("policy", "lm_head"),
    "reward_model": ("reward_model", "score"),
    "value_model": ("critic", "value_head"),
}
# `train` settings that do not change what is computed (only when state is written, or how many processes
# start, which the header records as world_size).
NOT_IN_FINGERPRINT = ("save_every", "keep_checkpoints", "cpu_procs")   # world_size is in the header
# Test-only: "before_rename:STEP" or "after_save:STEP" makes rank 0 sleep there, so a test can SIGKILL
# the process group at exactly that point of a real save.
TEST_HOOK_ENV = "PREFPIPE_CHECKPOINT_TEST_HOOK"


class CheckpointError(RuntimeError):
    """A checkpoint is refused (incompatible, partial, corrupted) or cannot be written."""


@dataclass(frozen=True)
class CheckpointOptions:
    directory: Path | None = None       # where periodic checkpoints go (None: no saving, auto finds nothing)
    resume: str = "auto"                # auto | never | PATH
    reference: dict | None = None       # {"kind": "identity" | "model_dir", "digest": ...}


# ----------------------------------------------------------------------------------------------
# Run header and fingerprint
# ----------------------------------------------------------------------------------------------

def pairs_digest(pairs) -> str:
    """Content digest of a TokenPairs (ids, token hashes, margins), independent of parquet encoding."""
    margins = [None if np.isnan(m) else float(m) for m in pairs.margins]
    return sha256_json({"pair_ids": pairs.pair_ids, "token_hashes": pairs.token_hashes, "margins": margins})


def model_config_digest(hf_model) -> str:
    config = json.loads(hf_model.config.to_json_string(use_diff=False))
    for volatile in ("transformers_version", "_name_or_path", "_attn_implementation_autoset"):
        config.pop(volatile, None)
    return sha256_json(config)


def directory_digest(root) -> str:
    """sha256 over (relative path, file sha256) of every file: the identity of a --model-dir source."""
    root = Path(root)
    files = sorted(p for p in root.rglob("*") if p.is_file() and ".cache" not in p.relative_to(root).parts)
    return sha256_json([[str(p.relative_to(root)), sha256_file(p)] for p in files])


def reference_of(identity_path=None, model_dir=None) -> dict:
    if identity_path:
        return {"kind": "identity", "digest": read_json(identity_path)["identity_digest"]}
    return {"kind": "model_dir", "digest": directory_digest(model_dir)}


def run_header(objective, settings, env, hf_model, train_pairs, probe_pairs, reference: dict | None,
               dev_pairs=None) -> dict:
    trajectory = {k: v for k, v in settings.record().items() if k not in NOT_IN_FINGERPRINT}
    role, head = OBJECTIVE_KINDS[objective.name]
    return {
        "format": FORMAT,
        "objective": objective.name,
        "role": role,
        "head": head,
        "model_class": type(hf_model).__name__,
        "model_config_digest": model_config_digest(hf_model),
        "reference": reference,
        "data_digest": pairs_digest(train_pairs),
        "probe_digest": pairs_digest(probe_pairs),
        "objective_params": objective.fingerprint(),
        "train_settings": trajectory,
        "world_size": env.world_size,
        "parallel": settings.parallel,
        # the dev split (probe.dev_size > 0; else null): its scorings and the selected step are part of the run's state
        "dev_digest": pairs_digest(dev_pairs) if dev_pairs is not None else None,
    }


def fingerprint(header: dict) -> str:
    return sha256_json(header)


def incompatibilities(meta: dict, header: dict) -> list[str]:
    """Every way a checkpoint differs from this run, most fundamental first (empty: compatible)."""
    if meta.get("format") != header["format"]:
        got = meta.get("format") or f"unversioned (format_version {meta.get('format_version')})"
        return [f"checkpoint format {got} is not this code's {header['format']} (written by another version of this "
                "code: another trajectory, not resumed)"]
    out = []
    got = (meta.get("objective"), meta.get("role"), meta.get("head"))
    want = (header["objective"], header["role"], header["head"])
    if got != want:
        if got[0] not in OBJECTIVE_KINDS:
            out.append(f"unknown objective {got[0]!r} in the checkpoint")
        hint = ""
        if got[2] != want[2]:
            hint = (f": its {got[2]} head cannot stand in for this run's {want[2]} head "
                    f"(model class {meta.get('model_class')} vs {header['model_class']})")
        out.append(f"objective mismatch: checkpoint trains {got[0]} (role {got[1]}, head {got[2]}), this run "
                   f"trains {want[0]} (role {want[1]}, head {want[2]}){hint}")
    if meta.get("world_size") != header["world_size"]:
        out.append(f"world size {meta.get('world_size')} != this run's {header['world_size']}: resuming under a "
                   "different world size is not supported (the data plan assigns pairs to ranks by world size and "
                   f"RNG state is per rank); rerun with {meta.get('world_size')} processes or --resume never")
    if meta.get("parallel") != header["parallel"]:
        out.append(f"parallel {meta.get('parallel')} != this run's {header['parallel']} (another state layout)")
    if meta.get("model_config_digest") != header["model_config_digest"]:
        out.append(f"model config differs (digest {str(meta.get('model_config_digest'))[:12]} != "
                   f"{header['model_config_digest'][:12]}): another architecture or size")
    if meta.get("reference") != header["reference"]:
        out.append(f"reference differs: checkpoint started from {meta.get('reference')}, this run from "
                   f"{header['reference']}")
    # The optimizer state's layout is the mode's (fp32 moments, 8-bit codes and scales, masters or none): named
    # first, both ways, before the generic settings difference below.
    saved_state = ((meta.get("train_settings") or {}).get("optimizer") or {}).get("state", "exact")
    this_state = (header["train_settings"].get("optimizer") or {}).get("state", "exact")
    if saved_state != this_state:
        out.append(f"optimizer state differs: the checkpoint holds train.optimizer.state {saved_state}, this run uses "
                   f"{this_state} (a state resumes only in its own mode)")
    for key, what in (("data_digest", "train data (train tokens)"), ("probe_digest", "probe (probe tokens)")):
        if meta.get(key) != header[key]:
            out.append(f"{what} differ: digest {str(meta.get(key))[:12]} != {header[key][:12]}")
    for key, what in (("objective_params", "objective params"), ("train_settings", "train settings")):
        a, b = meta.get(key) or {}, header[key]
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        if diff:
            out.append(f"{what} differ: " + ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in diff))
    return out


# ----------------------------------------------------------------------------------------------
# Finding and verifying checkpoints
# ----------------------------------------------------------------------------------------------

def checkpoint_name(step: int, fp: str) -> str:
    return f"step_{step:08d}-{fp[:12]}"


def list_checkpoints(directory) -> tuple[list[tuple[int, Path, dict]], list[Path]]:
    """(complete checkpoints newest first as (step, path, meta), incomplete directories)."""
    directory = Path(directory)
    complete, incomplete = [], []
    if not directory.is_dir():
        return complete, incomplete
    for p in sorted(directory.iterdir()):
        if not p.is_dir():
            continue
        if p.name.startswith(TMP_PREFIX) or not (p / META).is_file():
            incomplete.append(p)
            continue
        try:
            meta = read_json(p / META)
            step = int(meta.get("step", -1))
        except (OSError, ValueError, TypeError, AttributeError):
            incomplete.append(p)        # damaged meta.json: never a candidate (select_checkpoint says why)
            continue
        complete.append((step, p, meta))
    complete.sort(key=lambda t: (t[0], t[1].name), reverse=True)
    return complete, incomplete


def required_parts(meta: dict) -> dict[str, list[str]]:
    return {"model": [], "optimizer": [], "trainer_state": [], "probe_step0": [],
            "rng": [f"rng/rank{r:05d}.pt" for r in range(int(meta.get("world_size", 0)))]}


def verify_checkpoint(path: Path, meta: dict) -> None:
    """Refuse a partial checkpoint (a part missing from the metadata or the disk) or a corrupted one
    (any file whose sha256 differs from the one recorded when it was written)."""
    parts, files = meta.get("parts") or {}, meta.get("files") or {}
    for part, need in required_parts(meta).items():
        if part not in parts:
            raise CheckpointError(f"{path}: partial checkpoint: no {part} state recorded in {META}; refusing to "
                                  "resume from it")
        names = parts[part] if isinstance(parts[part], list) else [parts[part]]
        for name in {*names, *need}:
            covered = [f for f in files if f == name or f.startswith(name.rstrip("/") + "/")]
            if not covered:
                raise CheckpointError(f"{path}: partial checkpoint: {part} state {name} is not recorded in {META}")
            missing = [f for f in covered if not (path / f).is_file()]
            if missing:
                raise CheckpointError(f"{path}: partial checkpoint: {part} state {missing[0]} is missing")
    for rel, digest in sorted(files.items()):
        actual = sha256_file(path / rel) if (path / rel).is_file() else None
        if actual is None:
            raise CheckpointError(f"{path}: partial checkpoint: {rel} is missing")
        if actual != digest:
            raise CheckpointError(f"{path}: corrupted checkpoint: {rel} has sha256 {actual[:16]}..., {META} "
                                  f"recorded {digest[:16]}...; refusing to load it")


def select_checkpoint(options: CheckpointOptions, header: dict) -> tuple[Path, dict] | None:
    """Rank 0: the checkpoint to resume from (verified), or None. Raises CheckpointError on refusal."""
    resume = options.resume
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.is_dir():
            raise CheckpointError(f"--resume {path}: no such checkpoint directory")
        if path.name.startswith(TMP_PREFIX) or not (path / META).is_file():
            raise CheckpointError(f"--resume {path}: incomplete checkpoint (no {META}: its save was interrupted)")
        try:
            meta = read_json(path / META)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"--resume {path}: unreadable {META} ({e}): the checkpoint is damaged") from e
        problems = incompatibilities(meta, header)
        if problems:
            raise CheckpointError(f"--resume {path}: refusing an incompatible checkpoint:\n  - " + "\n  - ".join(problems))
        verify_checkpoint(path, meta)
        return path, meta
    if options.directory is None:
        return None
    complete, incomplete = list_checkpoints(options.directory)
    damaged: list[str] = []         # skipped as damaged, named again in the decision's log line
    for p in incomplete:
        if not p.name.startswith(TMP_PREFIX) and (p / META).is_file():
            log.warning("ignoring checkpoint %s: its %s is unreadable (damaged)", p, META)
            damaged.append(p.name)
        else:
            log.warning("ignoring incomplete checkpoint %s (its save was interrupted)", p)
    want = fingerprint(header)
    for step, path, meta in complete:
        problems = incompatibilities(meta, header)
        if problems:
            log.warning("not resuming from %s (another run):\n  - %s", path, "\n  - ".join(problems))
            continue
        if meta.get("fingerprint") != want:
            log.warning("not resuming from %s: run fingerprint %s != %s", path, str(meta.get("fingerprint"))[:12],
                        want[:12])
            continue
        try:
            verify_checkpoint(path, meta)
        except CheckpointError as e:
            # This run's own checkpoint, damaged (a crash mid-write on a filesystem without ordered writes, a bad
            # disk, a flipped bit): fall back to the one before it rather than refuse the whole run.
            log.warning("not resuming from %s: %s; trying the next older checkpoint of this run", path, e)
            damaged.append(path.name)
            continue
        if damaged:
            log.warning("resuming from %s (step %d), the newest good checkpoint of this run; skipped as damaged: %s",
                        path, step, ", ".join(damaged))
        return path, meta
    if damaged:
        log.warning("no good checkpoint of this run in %s (damaged: %s): starting fresh", options.directory,
                    ", ".join(damaged))
    return None


def agree_on_checkpoint(options: CheckpointOptions, header: dict, env) -> tuple[Path, dict] | None:
    """Rank 0 selects and verifies; every rank gets the same answer (or the same error)."""
    box = [None]
    if env.is_main:
        try:
            box[0] = ("ok", select_checkpoint(options, header))
        except Exception as e:  # noqa: BLE001 - every rank must raise, not only rank 0
            box[0] = ("error", f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e))
    if env.world_size > 1:
        dist.broadcast_object_list(box, src=0, group=env.control_group)
    status, value = box[0]
    if status == "error":
        raise CheckpointError(value)
    return value


# ----------------------------------------------------------------------------------------------
# RNG state (per rank)
# ----------------------------------------------------------------------------------------------

def rng_state(device: torch.device) -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state = {"python": [py_version, list(py_state), py_gauss],
             "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
             "torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["torch_cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    py_version, py_state, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch_cpu"])
    if device.type == "cuda":
        if "torch_cuda" not in state:
            raise CheckpointError("checkpoint has no CUDA RNG state (written on CPU) but this run is on CUDA")
        torch.cuda.set_rng_state(state["torch_cuda"], device)


# ----------------------------------------------------------------------------------------------
# Save
# ----------------------------------------------------------------------------------------------

def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _test_hook(point: str, step: int) -> None:
    hook = os.environ.get(TEST_HOOK_ENV, "")
    if hook == f"{point}:{step}":
        log.warning("%s=%s: sleeping so the test can kill the run here", TEST_HOOK_ENV, hook)
        time.sleep(3600)


def trainable_state_names(module) -> set[str] | None:
    """With part of the model frozen (train.adapter), the names of the state a checkpoint holds: the trainable
    parameters only (the frozen base is the reference the header identifies; saving it every time would cost
    the whole model per checkpoint). None: the whole state dict (full fine-tuning)."""
    named = list(module.named_parameters())
    if all(p.requires_grad for _, p in named):
        return None
    return {n for n, p in named if p.requires_grad}


def save_checkpoint(directory, *, header: dict, step: int, total_steps: int, trainer_state: dict,
                    probe_step0_rows: list[dict], module, optimizer, settings, env, keep: int,
                    extra_files: dict[str, dict] | None = None) -> Path:
    """Collective: every rank calls it after the same optimizer step. Returns the checkpoint path. extra_files
    {name: tensors}: rank 0's, saved beside the state and hashed with it (train.select_best's best_model.pt)."""
    directory = Path(directory)
    fp = fingerprint(header)
    name = checkpoint_name(step, fp)
    final, tmp = directory / name, directory / f"{TMP_PREFIX}{name}"
    if env.is_main:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    dist.barrier(group=env.control_group)

    if settings.parallel == "fsdp2":   # sharded: every rank writes its own shards (collective)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
        dcp.save({"model": get_model_state_dict(module)}, checkpoint_id=str(tmp / "model"))
        dcp.save({"optimizer": get_optimizer_state_dict(module, optimizer)}, checkpoint_id=str(tmp / "optimizer"))
        model_part, optim_part = "model/", "optimizer/"
    else:                              # DDP replicas are identical: one file from rank 0
        if env.is_main:
            keep_names = trainable_state_names(module)
            state = module.state_dict()
            torch.save(state if keep_names is None else {k: v for k, v in state.items() if k in keep_names},
                       tmp / "model.pt")
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        model_part, optim_part = "model.pt", "optimizer.pt"
    torch.save(rng_state(env.device), tmp / "rng" / f"rank{env.rank:05d}.pt")
    if env.is_main:
        # Not canonical_json: the log rows keep their column order (train_log.csv's header comes from it).
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, allow_nan=False) + "\n", encoding="utf-8")
        write_jsonl(tmp / "probe_step0.jsonl", probe_step0_rows)
        for name, tensors in (extra_files or {}).items():
            torch.save(tensors, tmp / name)
    dist.barrier(group=env.control_group)

    if env.is_main:
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        for rel in files:
            _fsync(tmp / rel)
        import transformers
        meta = {**header, "fingerprint": fp, "step": step, "total_steps": total_steps,
                "tokens": trainer_state["tokens"],
                "parts": {"model": model_part, "optimizer": optim_part,
                          "trainer_state": "trainer_state.json", "probe_step0": "probe_step0.jsonl",
                          "rng": [f"rng/rank{r:05d}.pt" for r in range(env.world_size)]},
                "files": {rel: sha256_file(tmp / rel) for rel in files},
                "torch_version": torch.__version__, "transformers_version": transformers.__version__}
        (tmp / META).write_text(json.dumps(meta, sort_keys=True, indent=2) + "\n", encoding="utf-8")
        _fsync(tmp / META)
        _fsync(tmp)
        _test_hook("before_rename", step)
        if final.exists():             # e.g. an explicit --resume of an older step replays this one
            log.warning("replacing existing checkpoint %s", final)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(directory)
        log.info("checkpoint step %d -> %s", step, final)
        complete, _ = list_checkpoints(directory)
        mine = [p for _, p, m in complete if m.get("fingerprint") == fp]
        for old in mine[max(1, keep):]:
            shutil.rmtree(old, ignore_errors=True)
            log.info("removed old checkpoint %s (train.keep_checkpoints = %d)", old, keep)
        _test_hook("after_save", step)
    dist.barrier(group=env.control_group)
    return final


# ----------------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------------

def load_checkpoint(path: Path, meta: dict, *, module, optimizer, settings, env) -> tuple[dict, list[dict]]:
    """Restore model, optimizer and this rank's RNG in place (collective under FSDP2); the learning rate is a
    function of the step (engine/optim.LRSchedule), so nothing else is needed.
    Returns (trainer_state {step, tokens, log_rows}, step-0 probe rows)."""
    path = Path(path)
    try:
        if settings.parallel == "fsdp2":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                                 set_model_state_dict, set_optimizer_state_dict)
            model_sd = {"model": get_model_state_dict(module)}
            dcp.load(model_sd, checkpoint_id=str(path / "model"))
            set_model_state_dict(module, model_sd["model"])
            optim_sd = {"optimizer": get_optimizer_state_dict(module, optimizer)}
            dcp.load(optim_sd, checkpoint_id=str(path / "optimizer"))
            set_optimizer_state_dict(module, optimizer, optim_sd["optimizer"])
        else:
            saved = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
            keep_names = trainable_state_names(module)
            if keep_names is not None and set(saved) != keep_names:
                raise KeyError(f"the checkpoint's model state holds {sorted(set(saved) - keep_names)[:4]} not trained "
                               f"here and lacks {sorted(keep_names - set(saved))[:4]}")
            module.load_state_dict(saved, strict=keep_names is None)
            optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: state does not fit this run's model/optimizer: {e}") from e
    trainer_state = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
    if trainer_state["step"] != meta["step"]:
        raise CheckpointError(f"{path}: trainer_state step {trainer_state['step']} != {META} step {meta['step']}")
    with open(path / "probe_step0.jsonl", encoding="utf-8") as f:
        probe_rows = [json.loads(line) for line in f if line.strip()]
    set_rng_state(torch.load(path / "rng" / f"rank{env.rank:05d}.pt", weights_only=True), env.device)
    return trainer_state, probe_rows
