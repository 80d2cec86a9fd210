"""verify_ref: prove, offline, that the reference model directory is exactly the pinned snapshot.

    python -m stages.verify_ref verify --params params.yaml --identity results/ref/ref_identity.json --log L
    python -m stages.verify_ref verify --pin generation.judge --identity results/verify_judge/judge_identity.json
    python -m stages.verify_ref pin DIR [--repo-id NAME] [--write-params [PARAMS]]
        # writes DIR/prefpipe.lock.json, prints its sha256; --write-params also sets the four ref.* keys of
        # params.yaml (source local, repo_id, revision = that sha256, local_dir), editing only those lines

`--pin KEY` verifies another model pinned the same way (`generation.policy`, `generation.judge`: a policy or judge
that was not trained here), with the same rules; messages then name that key instead of `ref`.

Two kinds of snapshot (`ref.source` in params.yaml):

- `hf`: a directory made by `hf download REPO --revision SHA --local-dir DIR`. `ref.revision` must be the
  full 40-hex commit SHA. Every file needs `DIR/.cache/huggingface/download/<relpath>.metadata`
  (`commit_hash\\netag\\ntimestamp\\n`, parsed here: huggingface_hub's reader takes locks, creates
  folders and deletes metadata it cannot parse, so it must never run on a snapshot we are proving)
  whose commit is the pinned revision. Content is re-hashed, never trusted from metadata or mtimes:
  a 40-hex ETag is the git blob SHA-1 (`sha1(b"blob %d\\0" % size + data)` == `git hash-object`),
  a 64-hex ETag is the LFS SHA-256.
- `local`: any other directory (e.g. your own SFT checkpoint, or the embedded tiny model), pinned by
  `pin`, which writes `DIR/prefpipe.lock.json`: per-file size and SHA-256 plus `files_digest` (the
  SHA-256 of the canonical file list). The lock is not listed in itself. `pin` prints the lock's own
  SHA-256 (`sha256sum DIR/prefpipe.lock.json` gives the same); put it in `ref.revision` to pin the lock.

What each mode proves (and what it cannot):
- `local` with `ref.revision` = the lock's SHA-256, committed in params.yaml: git pins the lock, the lock
  pins every byte. Any edit to the lock (hand edit or a consistent re-pin) or to a file fails.
- `local` with `ref.revision: null`: only the lock's internal consistency is checked (a hand edit that
  does not recompute `files_digest` fails); a consistent re-pin by someone with write access cannot be
  detected offline. verify warns, and the identity records the lock's SHA-256 as `revision`
  (`revision_pinned: false`), so a re-pin shows up as a different identity_digest between runs.
- `hf`: content is proved equal to the ETags in the metadata, and the metadata claims the pinned
  commit. Offline nothing binds ETags to the commit cryptographically (that needs the hub's tree), so
  someone who rewrites weights *and* metadata consistently is not caught here; the identity lists every
  file's ETag-equivalent hash, which anyone online can compare with the hub at that revision.

Completeness: `model.safetensors`, `pytorch_model.bin`, or a weight index (`*.safetensors.index.json` /
`*.bin.index.json`) with a non-empty `weight_map` whose every shard path is relative, normalised (no
`..`, `.`, empty, absolute, drive or backslash parts), has the index's suffix, is present and verified;
`config.json` and at least one tokenizer vocabulary file are present and verified. Files outside the
metadata/lock are reported as unverified `extras` (warned, listed in the identity); an unverified file
that transformers would load (config, tokenizer, weights, chat templates, code) is an error instead.
`.cache/huggingface/` bookkeeping (CACHEDIR.TAG, .gitignore, *.metadata, *.lock) is accepted.

Symlinks (file or directory) are followed and their files inventoried like any other (a HF cache snapshot is
links into its blobs/); a link leading outside the snapshot, dangling or looping is refused (reference.list_files).

Nothing loads the model here; later stages call `stages.lib.reference.load_verified_dir(identity_path)`, which re-checks the
identity file's own digest, every file's size, the lock's hash (local) or metadata (hf), that no
loadable file appeared, and every file's content against the identity (through the file-hash cache this stage
fills: .prefpipe-cache/, keyed by device, inode, size, mtime and ctime), then returns the directory to load from.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable

from stages.lib.cli import Command, stage_main
from stages.lib.contracts import TOKENIZER_VOCAB_FILES, shape_problem
from stages.lib.io import GIT_SHA1, MEASUREMENT, SHA256, hash_bytes, sha256_bytes, sha256_json, write_json
from stages.lib.reference import (COMMIT_RE, CONFIG_FILE, HF_DOWNLOAD_DIR, IDENTITY_FORMAT, LOCK_FORMAT, LOCK_NAME,
                                  LOCK_SCHEMA, SHA256_RE, SINGLE_WEIGHT_FILES, FileHashCache, RefIdentityError, _fail,
                                  hash_files,
                                  identity_digest, index_shard_suffix, is_hf_bookkeeping, is_loaded_by_transformers,
                                  is_weight_index, list_files, parse_hf_metadata, unsafe_relpath_reason)

log = logging.getLogger("verify_ref")

# ======================================================================================= constants

MAX_INDEX_BYTES = 64 << 20  # weight indexes are read whole (hashed and parsed from the same bytes)


# ===================================================================================== expectations

@dataclass(frozen=True)
class Expected:
    """What one file must hash to, and where that claim came from (named in every error)."""
    path: str
    algo: str
    hash: str
    size: int | None  # known for local locks; hf metadata records no size
    claimed_by: str


def check_hf_revision(revision: object, key: str = "ref") -> str:
    if revision is None:
        raise RefIdentityError(f"{key}.revision is required for {key}.source hf: the full 40-hex commit SHA "
                               "the snapshot was downloaded at (hf download REPO --revision SHA)")
    if not isinstance(revision, str) or not COMMIT_RE.fullmatch(revision):
        n = len(revision) if isinstance(revision, str) else 0
        why = ("has non-hex or uppercase characters" if isinstance(revision, str) and n == 40
               else f"has {n} characters")
        raise RefIdentityError(f"{key}.revision {revision!r} is not a full 40-hex lowercase commit SHA ({why}); "
                               "a branch, tag or short SHA can move or be ambiguous")
    return revision


def hf_expectations(root: Path, revision: str, on_disk: set[str]) -> tuple[dict[str, Expected], list[str], set[str]]:
    """Read every metadata file; returns (expected hashes by relpath, problems, paths with a rejected claim)."""
    expected: dict[str, Expected] = {}
    problems: list[str] = []
    rejected: set[str] = set()
    for rel_meta in sorted(r for r in on_disk if r.startswith(HF_DOWNLOAD_DIR + "/") and r.endswith(".metadata")):
        rel = rel_meta[len(HF_DOWNLOAD_DIR) + 1: -len(".metadata")]
        where = f"{root / rel_meta}"
        try:
            commit, etag, _ = parse_hf_metadata((root / rel_meta).read_text(encoding="utf-8"), where)
        except (RefIdentityError, UnicodeDecodeError, OSError) as e:
            problems.append(str(e) if isinstance(e, RefIdentityError) else f"{where}: unreadable metadata: {e}")
            rejected.add(rel)
            continue
        if commit != revision:
            problems.append(f"{root / rel}: metadata {where} is for commit {commit}, not the pinned "
                            f"revision {revision} (snapshot mixes revisions or is another commit)")
            rejected.add(rel)
            continue
        if rel not in on_disk:
            problems.append(f"{root / rel}: listed in metadata {where} but the file is missing")
            continue
        algo = GIT_SHA1 if len(etag) == 40 else SHA256
        expected[rel] = Expected(rel, algo, etag, None, where)
    return expected, problems, rejected


# ========================================================================================= local lock

def build_lock(root: Path, repo_id: str, workers: int | None = None) -> dict:
    files = [r for r in list_files(root) if r != LOCK_NAME and not is_hf_bookkeeping(r)]
    for r in files:
        if (why := unsafe_relpath_reason(r)) is not None:
            raise RefIdentityError(f"{root / r}: cannot pin a file whose path {why}")
    hashed = hash_files(root, {r: SHA256 for r in files}, workers)
    errors = [f"{root / r}: {v}" for r, v in hashed.items() if isinstance(v, str)]
    _fail(f"cannot pin {root}:", errors)
    entries = [{"path": r, "size": hashed[r][0], "sha256": hashed[r][1]} for r in files]
    return {"format": LOCK_FORMAT, "repo_id": repo_id, "files": entries, "files_digest": sha256_json(entries)}


def pin(root: str | os.PathLike, repo_id: str | None = None, workers: int | None = None) -> str:
    """Write DIR/prefpipe.lock.json for a complete model directory; returns the lock's own SHA-256."""
    root = Path(root)
    if not root.is_dir():
        raise RefIdentityError(f"{root}: not a directory")
    lock = build_lock(root, repo_id or f"local/{root.resolve().name}", workers)
    expected = {e["path"]: Expected(e["path"], SHA256, e["sha256"], e["size"], "pin") for e in lock["files"]}
    on_disk = set(list_files(root))
    index_bytes, problems = read_weight_indexes(root, expected)
    problems += completeness_problems(root, expected, on_disk, index_bytes, lambda rel: "not pinned")
    _fail(f"refusing to pin {root}: it is not a complete model directory:", problems)
    write_json(root / LOCK_NAME, lock)
    return sha256_bytes((root / LOCK_NAME).read_bytes())


def local_expectations(root: Path, revision: object, repo_id: str,
                       key: str = "ref") -> tuple[dict[str, Expected], dict, list[str]]:
    """Read and check the lock; returns (expected by relpath, lock record for the identity, problems)."""
    lock_path = root / LOCK_NAME
    if not lock_path.is_file():
        raise RefIdentityError(f"{lock_path}: no lock file; pin the directory first: "
                               f"python -m stages.verify_ref pin {root} --repo-id {repo_id} --write-params "
                               "(also sets ref.revision)")
    raw = lock_path.read_bytes()
    lock_sha = sha256_bytes(raw)
    if revision is not None:
        if not isinstance(revision, str) or not SHA256_RE.fullmatch(revision):
            raise RefIdentityError(f"{key}.revision {revision!r}: for {key}.source local it must be the lock's "
                                   f"64-hex SHA-256 (printed by pin; sha256sum {lock_path})")
        if revision != lock_sha:
            raise RefIdentityError(f"{lock_path}: lock has SHA-256 {lock_sha} but {key}.revision pins {revision}: "
                                   "the lock was edited or re-pinned since params.yaml was committed")
    try:
        lock = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RefIdentityError(f"{lock_path}: not valid JSON ({e})") from None
    if (problem := shape_problem(lock, LOCK_SCHEMA)) is not None:
        raise RefIdentityError(f"{lock_path}: not a {LOCK_FORMAT} lock ({problem})")
    files = lock["files"]
    if lock["files_digest"] != sha256_json(files):
        raise RefIdentityError(f"{lock_path}: files_digest does not match the lock's file list: the lock was "
                               "edited by hand; re-pin it (python -m stages.verify_ref pin)")
    if lock["repo_id"] != repo_id:
        raise RefIdentityError(f"{lock_path}: pinned as repo_id {lock['repo_id']!r} but {key}.repo_id is "
                               f"{repo_id!r}: wrong directory, or set {key}.repo_id to match (`python -m "
                               f"stages.verify_ref pin {root} --write-params` pins it and sets all four ref keys)"
                               if key == "ref" else
                               f"{lock_path}: pinned as repo_id {lock['repo_id']!r} but {key}.repo_id is "
                               f"{repo_id!r}: wrong directory, or set {key}.repo_id to match")
    expected: dict[str, Expected] = {}
    problems: list[str] = []
    for e in files:
        rel, size, digest = e["path"], e["size"], e["sha256"]
        if (why := unsafe_relpath_reason(rel)) is not None:
            problems.append(f"{lock_path}: entry {rel!r} {why}")
        elif not isinstance(size, int) or size < 0 or not isinstance(digest, str) or not SHA256_RE.fullmatch(digest):
            problems.append(f"{lock_path}: entry {rel!r} has a bad size or sha256")
        elif not (root / rel).is_file():
            problems.append(f"{root / rel}: listed in lock {lock_path} but the file is missing")
        elif (actual := (root / rel).stat().st_size) != size:
            problems.append(f"{root / rel}: size {actual} differs from {size} in lock {lock_path}")
        else:
            expected[rel] = Expected(rel, SHA256, digest, size, str(lock_path))
    record = {"path": LOCK_NAME, "size": len(raw), "sha256": lock_sha}
    return expected, record, problems


# ===================================================================================== completeness

def read_weight_indexes(root: Path, expected: dict[str, Expected]) -> tuple[dict[str, bytes], list[str]]:
    """Verify and keep the bytes of every expected weight index, so parsing sees exactly what was hashed."""
    out: dict[str, bytes] = {}
    problems: list[str] = []
    for rel, exp in expected.items():
        if not is_weight_index(rel):
            continue
        p = root / rel
        if p.stat().st_size > MAX_INDEX_BYTES:
            problems.append(f"{p}: weight index larger than {MAX_INDEX_BYTES} bytes")
            continue
        data = p.read_bytes()
        got = hash_bytes(data, exp.algo)
        if got != exp.hash:
            problems.append(f"{p}: content hash mismatch: {exp.algo} is {got}, {exp.claimed_by} says {exp.hash}")
            continue
        out[rel] = data
    return out, problems


def _unverified(root: Path, rel: str, missing_claim: Callable[[str], str]) -> str:
    return f"{root / rel}: {missing_claim(rel)}: present but not covered, so it cannot be verified"


def completeness_problems(root: Path, expected: dict[str, Expected], on_disk: set[str],
                          index_bytes: dict[str, bytes], missing_claim: Callable[[str], str],
                          already_reported: frozenset[str] = frozenset()) -> list[str]:
    """Weight entry point, shards, config and tokenizer: present and covered by metadata/lock.

    `already_reported`: paths whose claim was rejected (e.g. metadata for another commit), so they are
    not reported a second time as uncovered.
    """
    problems: list[str] = []

    def require_covered(rel: str, what: str) -> None:
        if rel not in expected:
            problems.append(_unverified(root, rel, missing_claim) if rel in on_disk else f"{root / rel}: missing ({what})")

    # ---- weights: a single file, or an index whose every shard is safe, present and verified
    entry_points = [r for r in SINGLE_WEIGHT_FILES if r in on_disk or r in expected]
    entry_points += sorted(r for r in on_disk if "/" not in r and is_weight_index(r))
    if not entry_points:
        problems.append(f"{root}: no weight entry point: expected model.safetensors, pytorch_model.bin or a "
                        "*.safetensors.index.json / *.bin.index.json weight index")
    for rel in entry_points:
        require_covered(rel, "weights")
    for rel in sorted(r for r in set(on_disk) | set(expected) if is_weight_index(r)):
        if rel not in index_bytes:
            if rel not in expected:
                problems.append(_unverified(root, rel, missing_claim))
            continue  # an expected index that failed its hash is already reported
        problems += _index_problems(root, rel, index_bytes[rel], expected, on_disk, missing_claim)

    # ---- config and tokenizer
    require_covered(CONFIG_FILE, "model config")
    vocab = [r for r in TOKENIZER_VOCAB_FILES if r in on_disk]
    if not vocab:
        problems.append(f"{root}: no tokenizer files (need one of {', '.join(TOKENIZER_VOCAB_FILES)})")

    # ---- anything transformers would read must be covered (tokenizer files, chat templates, code...)
    shard_paths = _all_shard_paths(index_bytes)
    for rel in sorted(on_disk):
        if rel not in expected and (is_loaded_by_transformers(rel) or rel in shard_paths):
            problems.append(_unverified(root, rel, missing_claim))
    dupes = {_unverified(root, rel, missing_claim) for rel in already_reported}
    return [p for p in problems if p not in dupes]


def _all_shard_paths(index_bytes: dict[str, bytes]) -> set[str]:
    out: set[str] = set()
    for rel, data in index_bytes.items():
        try:
            wm = json.loads(data).get("weight_map")
        except (ValueError, AttributeError):
            continue
        if isinstance(wm, dict):
            parent = PurePosixPath(rel).parent
            out |= {(parent / v).as_posix() for v in wm.values() if isinstance(v, str) and unsafe_relpath_reason(v) is None}
    return out


def _index_problems(root: Path, rel: str, data: bytes, expected: dict[str, Expected], on_disk: set[str],
                    missing_claim: Callable[[str], str]) -> list[str]:
    where = root / rel
    try:
        index = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return [f"{where}: weight index is not valid JSON ({e})"]
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        return [f"{where}: weight index has no weight_map object"]
    if not weight_map:
        return [f"{where}: empty weight_map: the index names no shards"]
    suffix = index_shard_suffix(rel)
    parent = PurePosixPath(rel).parent
    problems = []
    shards: list = []
    for v in weight_map.values():  # many tensors share a shard; check each distinct value once
        if v not in shards:
            shards.append(v)
    for shard in sorted(shards, key=repr):
        if (why := unsafe_relpath_reason(shard)) is not None:
            problems.append(f"{where}: unsafe shard path {shard!r}: {why}")
            continue
        if not shard.endswith(suffix):
            problems.append(f"{where}: shard {shard!r} does not have the index's suffix {suffix}")
            continue
        shard_rel = (parent / shard).as_posix()
        if shard_rel in expected:
            continue
        if shard_rel in on_disk:
            problems.append(_unverified(root, shard_rel, missing_claim))
        else:
            problems.append(f"{root / shard_rel}: missing shard named by {where}")
    return problems


# ========================================================================================== verify

def verify_reference(ref: dict, workers: int | None = None, key: str = "ref") -> dict:
    """Check the snapshot described by params `ref` (the pin at params key `key`: `ref`, or a model pinned the same
    way, e.g. generation.judge); return the identity record (raises RefIdentityError)."""
    source, repo_id, revision, local_dir = ref["source"], ref["repo_id"], ref.get("revision"), ref["local_dir"]
    root = Path(local_dir)
    if source == "hf":
        revision = check_hf_revision(revision, key)  # before touching the disk: a moving ref proves nothing
    if not root.is_dir():
        raise RefIdentityError(f"{key}.local_dir {root}: not a directory")
    on_disk = set(list_files(root))
    lock_record = None
    rejected: set[str] = set()
    if source == "hf":
        expected, problems, rejected = hf_expectations(root, revision, on_disk)
        missing_claim = lambda rel: f"missing metadata {HF_DOWNLOAD_DIR}/{rel}.metadata"  # noqa: E731
        effective_revision, pinned = revision, True
    elif source == "local":
        expected, lock_record, problems = local_expectations(root, revision, repo_id, key)
        missing_claim = lambda rel: f"not in lock {root / LOCK_NAME}"  # noqa: E731
        effective_revision, pinned = lock_record["sha256"], revision is not None
        if not pinned:
            log.warning("%s.revision is null: %s is checked for internal consistency only; set %s.revision: %s "
                        "to pin it (a consistent re-pin is otherwise undetectable)", key, root / LOCK_NAME, key,
                        lock_record["sha256"])
    else:
        raise RefIdentityError(f"{key}.source {source!r}: expected hf or local")

    # ---- cheap checks first (names, metadata, index content): fail before hashing gigabytes
    index_bytes, index_problems = read_weight_indexes(root, expected)
    problems += index_problems
    problems += completeness_problems(root, expected, on_disk, index_bytes, missing_claim, frozenset(rejected))
    _fail(f"reference {root} ({source} {repo_id}) failed verification:", problems)

    # ---- content: every covered file re-hashed in parallel; metadata and mtimes are never trusted
    t0 = time.perf_counter()
    # Never from the cache (use_cached=False), but recorded in it: the stages after this one check the same files
    # against the identity through it (stages.lib.reference.load_verified_dir) without reading them again.
    hashed = hash_files(root, {rel: e.algo for rel, e in expected.items() if rel not in index_bytes}, workers,
                        cache=FileHashCache.default(), use_cached=False)
    for rel in index_bytes:
        hashed[rel] = (len(index_bytes[rel]), expected[rel].hash)  # verified from these bytes above
    for rel, e in sorted(expected.items()):
        got = hashed[rel]
        if isinstance(got, str):
            problems.append(f"{root / rel}: {got}")
        elif got[1] != e.hash:
            problems.append(f"{root / rel}: content hash mismatch: {e.algo} is {got[1]}, {e.claimed_by} says "
                            f"{e.hash} (file replaced or corrupted; mtimes are not trusted)")
        elif e.size is not None and got[0] != e.size:
            problems.append(f"{root / rel}: size {got[0]} differs from {e.size} in {e.claimed_by}")
    _fail(f"reference {root} ({source} {repo_id}) failed verification:", problems)
    seconds = time.perf_counter() - t0
    total = sum(v[0] for v in hashed.values())
    log.info("hashed %d files, %.1f MB", len(hashed), total / 1e6)
    log.info("hashing took %.2fs (%.0f MB/s)", seconds, total / 1e6 / max(seconds, 1e-9), extra=MEASUREMENT)

    # ---- extras: reported, never loaded (loadable ones were refused above)
    extras = [{"path": r, "size": (root / r).stat().st_size} for r in sorted(on_disk)
              if r not in expected and not is_hf_bookkeeping(r) and not (source == "local" and r == LOCK_NAME)]
    for x in extras:
        log.warning("unverified extra file (not covered by %s, not loaded): %s",
                    "metadata" if source == "hf" else "the lock", root / x["path"])

    identity = {
        "format": IDENTITY_FORMAT,
        "source": source,
        "repo_id": repo_id,
        "revision": effective_revision,
        "revision_pinned": pinned,
        "local_dir": local_dir,
        "lock": lock_record,
        "files": [{"path": rel, "size": hashed[rel][0], "algo": expected[rel].algo, "hash": expected[rel].hash}
                  for rel in sorted(expected)],
        "extras": extras,
    }
    identity["identity_digest"] = identity_digest(identity)
    return identity


# ============================================================================================= CLI

def _verify_arguments(ap) -> None:
    ap.add_argument("--identity", default="results/ref/ref_identity.json")
    ap.add_argument("--pin", default="ref", metavar="KEY",
                    help="the params key of the pin to verify (default ref; also generation.policy, generation.judge: "
                         "a model pinned the same way)")
    ap.add_argument("--workers", type=int, default=None, help="hashing threads (default: min(16, cpus))")


def _verify(args) -> int:
    from stages.lib.declared_params import load_stage_params

    # A failed verification must not leave a previous run's identity looking current.
    Path(args.identity).unlink(missing_ok=True)
    # One module, three rules: the reference's pin, or a pinned policy / judge (their declarations differ).
    stage = {"ref": "verify_ref", "generation.policy": "verify_policy", "generation.judge": "verify_judge"}.get(args.pin)
    if stage is None:
        raise RefIdentityError(f"--pin {args.pin}: must be ref, generation.policy or generation.judge")
    params = load_stage_params(args.params, stage)
    pin = params
    for part in args.pin.split("."):
        pin = pin.get(part) if isinstance(pin, dict) else None
    if not isinstance(pin, dict):
        raise RefIdentityError(f"{args.pin}: params.yaml pins no model there ({pin!r}); a pin is "
                               "{source, repo_id, revision, local_dir}")
    identity = verify_reference(pin, args.workers, args.pin)
    write_json(args.identity, identity)
    log.info("verified %s %s @ %s: %d files, %d extras; identity_digest %s -> %s", identity["source"],
             identity["repo_id"], identity["revision"], len(identity["files"]), len(identity["extras"]),
             identity["identity_digest"], args.identity)
    return 0


def _pin_arguments(ap) -> None:
    ap.add_argument("dir")
    ap.add_argument("--repo-id", default=None, help="name recorded in the lock (must equal ref.repo_id; default "
                    "local/<the directory's name>)")
    ap.add_argument("--write-params", nargs="?", const="params.yaml", default=None, metavar="PARAMS",
                    help="also set ref.source, ref.repo_id, ref.revision and ref.local_dir in PARAMS (default "
                         "params.yaml) to this pin, editing only those lines (comments and layout kept)")
    ap.add_argument("--workers", type=int, default=None)


def ref_params_of_pin(root: str | os.PathLike, digest: str, params_path: str | os.PathLike) -> dict:
    """The four ref.* keys that select the directory just pinned: source local, the lock's repo_id, its SHA-256 as
    revision, and local_dir as given, or relative to the params file's directory when it lies below it (a path in
    the checkout means the same on every machine)."""
    root = Path(root)
    lock = json.loads((root / LOCK_NAME).read_text(encoding="utf-8"))
    base = Path(params_path).resolve().parent
    try:
        local_dir = root.resolve().relative_to(base).as_posix()
    except ValueError:
        local_dir = root.as_posix()
    return {"source": "local", "repo_id": lock["repo_id"], "revision": digest, "local_dir": local_dir}


def _pin(args) -> int:
    from stages.lib.params import write_params_keys
    digest = pin(args.dir, args.repo_id, args.workers)
    print(digest)
    if args.write_params is None:
        log.info("pinned %s; to pin the lock itself set ref.revision: %s (or pin with --write-params to set the "
                 "four ref keys)", Path(args.dir) / LOCK_NAME, digest)
        return 0
    ref = ref_params_of_pin(args.dir, digest, args.write_params)
    write_params_keys(args.write_params, "ref", ref)
    log.info("pinned %s; %s now selects it: %s", Path(args.dir) / LOCK_NAME, args.write_params,
             ", ".join(f"ref.{k}: {v}" for k, v in ref.items()))
    return 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """prog: the command's name in --help (`prefpipe` for `prefpipe pin`)."""
    from stages.lib.params import ParamsError

    return stage_main(argv, "verify_ref", __doc__.split("\n")[0], input_errors=(RefIdentityError, ParamsError),
                      prog=prog,
                      commands={
                          "verify": Command(_verify_arguments, _verify, help="verify ref.local_dir against its pin; "
                                            "write ref_identity.json"),
                          "pin": Command(_pin_arguments, _pin, help=f"write DIR/{LOCK_NAME} (per-file SHA-256) for "
                                         "a local reference", params=None, log=False)})


if __name__ == "__main__":
    sys.exit(main())
