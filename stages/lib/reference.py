"""The reference model's verified identity, as every stage reads it (lib: no stage imports another).

The verify_ref stage (stages/verify_ref.py: `pin`, `verify`) proves a reference directory is the pinned
snapshot and writes ref_identity.json; the stages that load the reference (tokenize, ref_logps, training)
call `load_verified_dir(identity_path)` from here, which re-checks the identity file's own digest (and
shape), every file's size, the lock's hash (local) or metadata (hf), and that no loadable file appeared,
then returns the directory to load from. The shapes of the lock and of the identity are JSON Schemas
(LOCK_SCHEMA, IDENTITY_SCHEMA), checked where the files are read.
"""
from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Iterable

from stages.lib.contracts import TOKENIZER_FILES, TOKENIZER_VOCAB_FILES, shape_problem
from stages.lib.io import GIT_SHA1, SHA256, hash_file, read_json, sha256_bytes, sha256_json

LOCK_NAME = "prefpipe.lock.json"
LOCK_FORMAT = "prefpipe-ref-lock/1"
IDENTITY_FORMAT = "prefpipe-ref-identity/1"
HF_DIR = ".cache/huggingface"
HF_DOWNLOAD_DIR = HF_DIR + "/download"
HF_BOOKKEEPING_FILES = {HF_DIR + "/CACHEDIR.TAG", HF_DIR + "/.gitignore", HF_DIR + "/.gitignore.lock"}

# Hash algorithms (stages.lib.io): GIT_SHA1, the git blob SHA-1, is the hub's ETag for non-LFS files;
# SHA256 the hub's ETag for LFS files, and every hash in a local lock.

COMMIT_RE = re.compile(r"[0-9a-f]{40}")
SHA256_RE = re.compile(r"[0-9a-f]{64}")
DRIVE_RE = re.compile(r"^[A-Za-z]:")

SINGLE_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
WEIGHT_SUFFIXES = (".safetensors", ".bin")
CONFIG_FILE = "config.json"
# Root files transformers reads on from_pretrained (model or tokenizer): never allowed unverified.
LOADED_ROOT_FILES = frozenset({
    CONFIG_FILE, "generation_config.json", *SINGLE_WEIGHT_FILES, *TOKENIZER_VOCAB_FILES, *TOKENIZER_FILES,
    "preprocessor_config.json", "processor_config.json",
})
LOADED_DIRS = ("additional_chat_templates/",)


class RefIdentityError(ValueError):
    """The reference directory (or its identity file) is not what was pinned; the message names files."""


def _fail(header: str, problems: Iterable[str]) -> None:
    problems = list(dict.fromkeys(problems))  # dedupe, keep order
    if problems:
        raise RefIdentityError(header + "\n" + "\n".join(f"  - {p}" for p in problems))


def default_workers() -> int:
    return max(1, min(16, os.cpu_count() or 1))


# ========================================================================================= hashing

def hash_files(root: Path, jobs: dict[str, str], workers: int | None = None) -> dict[str, tuple[int, str] | str]:
    """Hash {relpath: algo} in parallel (largest first); value is (size, hex) or an error string."""
    def one(rel: str) -> tuple[int, str] | str:
        try:
            size, digests = hash_file(root / rel, (jobs[rel],))
            return size, digests[jobs[rel]]
        except OSError as e:
            return f"cannot read: {e.strerror or e}"

    def size_of(rel: str) -> int:
        try:
            return (root / rel).stat().st_size
        except OSError:
            return 0

    order = sorted(jobs, key=lambda r: (-size_of(r), r))
    with ThreadPoolExecutor(max_workers=workers or default_workers()) as pool:
        return dict(zip(order, pool.map(one, order)))


# ======================================================================================= inventory

def list_files(root: Path) -> list[str]:
    """Every regular file (or symlink to one) under root as a posix relpath, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = Path(dirpath).relative_to(root)
        for name in filenames:
            p = Path(dirpath) / name
            if p.is_file():
                out.append((rel_dir / name).as_posix())
    return sorted(out)


def is_hf_bookkeeping(rel: str) -> bool:
    if rel in HF_BOOKKEEPING_FILES:
        return True
    return rel.startswith(HF_DOWNLOAD_DIR + "/") and rel.endswith((".metadata", ".lock"))


def is_loaded_by_transformers(rel: str) -> bool:
    if "/" not in rel:
        return rel in LOADED_ROOT_FILES or rel.endswith(".py") or is_weight_index(rel)
    return rel.startswith(LOADED_DIRS)


def is_weight_index(rel: str) -> bool:
    return rel.endswith(".index.json") and index_shard_suffix(rel) is not None


def index_shard_suffix(rel: str) -> str | None:
    """`model.safetensors.index.json` -> `.safetensors`; None when the name implies no weight format."""
    base = PurePosixPath(rel).name[: -len(".index.json")]
    suffix = PurePosixPath(base).suffix
    return suffix if suffix in WEIGHT_SUFFIXES else None


def unsafe_relpath_reason(path: object) -> str | None:
    """Why `path` is not a safe, normalised, relative posix path inside the snapshot (None if it is)."""
    if not isinstance(path, str) or not path:
        return "not a non-empty string"
    if "\\" in path:
        return "contains a backslash"
    if path.startswith("/"):
        return "is absolute"
    if DRIVE_RE.match(path):
        return "has a drive letter"
    parts = path.split("/")
    if ".." in parts:
        return "contains '..'"
    if "" in parts or "." in parts:
        return "is not normalised (empty or '.' component)"
    if "\0" in path:
        return "contains a NUL byte"
    return None


def parse_hf_metadata(text: str, where: str) -> tuple[str, str, float]:
    """`commit_hash\\netag\\ntimestamp\\n` -> (commit, etag, timestamp); strict, never mutates anything."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines = lines[:-1]
    if len(lines) != 3:
        raise RefIdentityError(f"{where}: malformed metadata: expected 3 lines "
                               f"(commit_hash, etag, timestamp), got {len(lines)}")
    commit, etag, stamp = (s.strip() for s in lines)
    if not COMMIT_RE.fullmatch(commit):
        raise RefIdentityError(f"{where}: malformed metadata: commit_hash {commit!r} is not 40 lowercase hex")
    if not (COMMIT_RE.fullmatch(etag) or SHA256_RE.fullmatch(etag)):
        raise RefIdentityError(f"{where}: malformed metadata: etag {etag!r} is neither a 40-hex git blob "
                               f"SHA-1 nor a 64-hex SHA-256")
    try:
        ts = float(stamp)
    except ValueError:
        raise RefIdentityError(f"{where}: malformed metadata: timestamp {stamp!r} is not a number") from None
    return commit, etag, ts


# ======================================================================================== identity

_STR, _SIZE = {"type": "string"}, {"type": "integer", "minimum": 0}

# DIR/prefpipe.lock.json, written by `verify_ref pin`, read by `verify_ref verify`.
LOCK_SCHEMA = {
    "type": "object",
    "required": ["format", "repo_id", "files", "files_digest"],
    "properties": {
        "format": {"const": LOCK_FORMAT},
        "repo_id": _STR,
        "files": {"type": "array", "items": {
            "type": "object", "required": ["path", "size", "sha256"], "additionalProperties": False,
            "properties": {"path": _STR, "size": {"type": "integer"}, "sha256": _STR}}},
        "files_digest": _STR,
    },
}

IDENTITY_KEYS = {"format", "source", "repo_id", "revision", "revision_pinned", "local_dir", "lock", "files",
                 "extras", "identity_digest"}
# results/ref/ref_identity.json, written by `verify_ref verify`, read through read_identity.
IDENTITY_SCHEMA = {
    "type": "object",
    "required": sorted(IDENTITY_KEYS),
    "additionalProperties": False,
    "properties": {
        "format": {"const": IDENTITY_FORMAT},
        "source": {"enum": ["hf", "local"]},
        "repo_id": _STR,
        "revision": _STR,
        "revision_pinned": {"type": "boolean"},
        "local_dir": _STR,
        "lock": {"oneOf": [{"type": "null"}, {
            "type": "object", "required": ["path", "size", "sha256"], "additionalProperties": False,
            "properties": {"path": _STR, "size": _SIZE, "sha256": _STR}}]},
        "files": {"type": "array", "items": {
            "type": "object", "required": ["path", "size", "algo", "hash"], "additionalProperties": False,
            "properties": {"path": _STR, "size": _SIZE, "algo": {"enum": [GIT_SHA1, SHA256]}, "hash": _STR}}},
        "extras": {"type": "array", "items": {
            "type": "object", "required": ["path", "size"], "additionalProperties": False,
            "properties": {"path": _STR, "size": _SIZE}}},
        "identity_digest": _STR,
    },
    # a local snapshot is identified through its lock
    "if": {"properties": {"source": {"const": "local"}}},
    "then": {"properties": {"lock": {"type": "object"}}},
}


def identity_digest(identity: dict) -> str:
    return sha256_json({k: v for k, v in identity.items() if k != "identity_digest"})


def read_identity(identity_path: str | os.PathLike) -> dict:
    """Read ref_identity.json, check its shape (IDENTITY_SCHEMA) and its own digest (an edited identity
    file fails here)."""
    identity_path = Path(identity_path)
    try:
        identity = read_json(identity_path)
    except FileNotFoundError:
        raise RefIdentityError(f"{identity_path}: no reference identity; run the verify_ref stage") from None
    except (ValueError, OSError) as e:
        raise RefIdentityError(f"{identity_path}: unreadable reference identity ({e})") from None
    if (problem := shape_problem(identity, IDENTITY_SCHEMA)) is not None:
        raise RefIdentityError(f"{identity_path}: not a {IDENTITY_FORMAT} reference identity ({problem})")
    if identity_digest(identity) != identity["identity_digest"]:
        raise RefIdentityError(f"{identity_path}: identity_digest does not match the file's content: the "
                               "identity was edited or swapped; re-run verify_ref")
    return identity


def load_verified_dir(identity_path: str | os.PathLike, expect_digest: str | None = None, deep: bool = False,
                      workers: int | None = None) -> Path:
    """Cheap re-check between stages; returns the directory to load the reference from.

    Checks the identity's own digest, every file present with its recorded size, the lock's SHA-256
    (local) or each file's metadata commit and ETag (hf), and that no file transformers would load has
    appeared since verification. `expect_digest`: the identity_digest an upstream artifact recorded
    (e.g. the tokenizer identity in the token manifest), so a valid identity of *another* snapshot
    swapped in is refused too. `deep=True` also re-hashes every file (full verify cost).
    """
    identity_path = Path(identity_path)
    identity = read_identity(identity_path)
    if expect_digest is not None and identity["identity_digest"] != expect_digest:
        raise RefIdentityError(f"{identity_path}: identity_digest {identity['identity_digest']} is not the "
                               f"{expect_digest} recorded upstream: a different reference was verified since")
    root = Path(identity["local_dir"])
    if not root.is_dir():
        raise RefIdentityError(f"{root}: reference directory named by {identity_path} is missing")
    problems: list[str] = []
    listed = {f["path"]: f for f in identity["files"]}
    for rel, f in listed.items():
        p = root / rel
        try:
            size = p.stat().st_size
        except OSError:
            problems.append(f"{p}: missing since verification ({identity_path})")
            continue
        if size != f["size"]:
            problems.append(f"{p}: size {size} differs from {f['size']} recorded in {identity_path}: swapped since "
                            "verification")
    if identity["source"] == "local":
        lock_path = root / LOCK_NAME
        try:
            lock_sha = sha256_bytes(lock_path.read_bytes())
        except OSError:
            lock_sha = None
        if lock_sha != identity["lock"]["sha256"]:
            problems.append(f"{lock_path}: lock changed since verification ({identity_path})")
    else:
        for rel, f in listed.items():
            meta = root / HF_DOWNLOAD_DIR / f"{rel}.metadata"
            try:
                commit, etag, _ = parse_hf_metadata(meta.read_text(encoding="utf-8"), str(meta))
            except (RefIdentityError, OSError, UnicodeDecodeError):
                commit = etag = None
            if commit != identity["revision"] or etag != f["hash"]:
                problems.append(f"{root / rel}: metadata {meta} changed since verification ({identity_path})")
    known = set(listed) | {x["path"] for x in identity["extras"]}
    for rel in list_files(root):
        if rel not in known and is_loaded_by_transformers(rel) and not (
                identity["source"] == "local" and rel == LOCK_NAME):
            problems.append(f"{root / rel}: appeared since verification ({identity_path}) and would be loaded")
    if deep and not problems:
        hashed = hash_files(root, {rel: f["algo"] for rel, f in listed.items()}, workers)
        for rel, f in listed.items():
            got = hashed[rel]
            if isinstance(got, str) or got[1] != f["hash"]:
                problems.append(f"{root / rel}: content differs from {identity_path}")
    _fail(f"reference {root} no longer matches {identity_path}:", problems)
    return root.resolve()


