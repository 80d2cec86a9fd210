"""The reference model's verified identity, as every stage reads it (lib: no stage imports another).

The verify_ref stage (stages/verify_ref.py: `pin`, `verify`) proves a reference directory is the pinned
snapshot and writes ref_identity.json; the stages that load the reference (tokenize, ref_logps, training)
call `load_verified_dir(identity_path)` from here, which re-checks the identity file's own digest (and
shape), every file's size, the lock's hash (local) or metadata (hf), that no loadable file appeared, and every
listed file's content against the identity's hash (through FileHashCache, so an unchanged file is not re-read),
then returns the directory to load from. The shapes of the lock and of the identity are JSON Schemas
(LOCK_SCHEMA, IDENTITY_SCHEMA), checked where the files are read.

The inventory (list_files) follows symlinks, file and directory: a Hugging Face cache snapshot is made of links
into its blobs/, and transformers reads a linked directory (e.g. additional_chat_templates/) like any other. A link
that leaves the snapshot (the directory itself, or for a HF cache snapshot `.../snapshots/<rev>/` its repository's
blobs/), dangles, or loops is refused.
"""
from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Iterable

from stages.lib.contracts import TOKENIZER_FILES, TOKENIZER_VOCAB_FILES, shape_problem
from stages.lib.io import GIT_SHA1, SHA256, hash_file, read_json, sha256_bytes, sha256_json, write_text

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

# Where FileHashCache keeps its entries: under the checkout every stage runs in (its working directory, as every
# relative path in params.yaml), git-ignored (.gitignore), never a tracked output and never under HOME.
# PREFPIPE_HASH_CACHE names another file; "off" disables the cache (every load re-hashes).
HASH_CACHE_PATH = ".prefpipe-cache/file_hashes.json"
HASH_CACHE_ENV = "PREFPIPE_HASH_CACHE"
HASH_CACHE_FORMAT = "prefpipe-file-hashes/1"
# A file changed within this long before it was hashed is not cached: file times tick coarsely (a kernel tick, up to
# 2 s on some filesystems), so a write in the same tick as the hash could leave the key as it was (git's "racy"
# entries). Such a file is simply hashed again next time.
RACY_NS = 2_000_000_000


def stat_key(path: str | os.PathLike) -> list[int]:
    """What FileHashCache trusts a digest by: device, inode, size, mtime and ctime (ns) of the file a path reaches
    (links followed). Any write through the kernel (write, truncate, mmap, a rename onto the path) changes mtime and
    ctime or the inode; restoring the mtime (os.utime, touch -d, cp -p) sets ctime to now, and no user process can
    set ctime back, so a same-size in-place edit with the mtime put back is caught too. Not caught: bytes changed
    beneath the filesystem (disk or controller bit rot, a raw block-device write, an offline edit of the disk image),
    which leave every inode field as it was; `load_verified_dir(deep=True)` or `verify_ref verify` re-hash those."""
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class FileHashCache:
    """{real path: stat_key + digests}, persisted as JSON at HASH_CACHE_PATH. A digest is used only while the file's
    stat_key is unchanged; any change of it re-hashes. Several processes may share it (torchrun ranks, parallel
    stages): each save re-reads the file and merges, and writes atomically, so the worst a race does is drop an
    entry (re-hashed next time)."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = Path(path) if path is not None else None
        self.entries: dict[str, dict] = self._read() if self.path is not None else {}
        self.added: dict[str, dict] = {}

    @classmethod
    def default(cls) -> "FileHashCache":
        where = os.environ.get(HASH_CACHE_ENV, HASH_CACHE_PATH)
        return cls(None if where == "off" else where)

    def _read(self) -> dict[str, dict]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}       # absent or unreadable: a cache, not a record; everything is hashed again
        if not isinstance(data, dict) or data.get("format") != HASH_CACHE_FORMAT or not isinstance(
                data.get("files"), dict):
            return {}
        return {k: v for k, v in data["files"].items() if isinstance(v, dict) and isinstance(v.get("key"), list)}

    def lookup(self, path: Path, key: list[int], algo: str) -> str | None:
        entry = self.entries.get(os.path.realpath(path))
        if entry is None or entry["key"] != key or not isinstance(entry.get(algo), str):
            return None
        return entry[algo]

    def record(self, path: Path, key: list[int], algo: str, digest: str, started_ns: int) -> None:
        if self.path is None or max(key[3], key[4]) >= started_ns - RACY_NS:
            return
        real = os.path.realpath(path)
        entry = self.entries.get(real)
        entry = dict(entry) if entry is not None and entry["key"] == key else {"key": key}
        entry[algo] = digest
        self.entries[real] = self.added[real] = entry

    def save(self) -> None:
        """Merge what this process added into the file; entries whose file is gone or changed are dropped."""
        if self.path is None or not self.added:
            return
        merged = {**self._read(), **self.added}
        live = {}
        for real, entry in sorted(merged.items()):
            try:
                if stat_key(real) == entry["key"]:
                    live[real] = entry
            except OSError:
                pass
        try:
            write_text(self.path, json.dumps({"format": HASH_CACHE_FORMAT, "files": live}, sort_keys=True) + "\n")
        except OSError:
            pass            # a read-only checkout: the check itself ran; the next one hashes again
        self.added = {}


def hash_files(root: Path, jobs: dict[str, str], workers: int | None = None, cache: FileHashCache | None = None,
               use_cached: bool = True) -> dict[str, tuple[int, str] | str]:
    """Hash {relpath: algo} in parallel (largest first); value is (size, hex) or an error string.
    cache: take a digest from it while the file's stat_key holds (`use_cached`), and record every digest computed
    from a file whose stat_key did not change while it was read (so verify_ref, which never trusts a cache, fills it
    for the stages after it)."""
    def one(rel: str) -> tuple[int, str] | str:
        algo = jobs[rel]
        try:
            key = stat_key(root / rel) if cache is not None else None
            if cache is not None and use_cached and (digest := cache.lookup(root / rel, key, algo)) is not None:
                return key[2], digest
            started = time.time_ns()
            size, digests = hash_file(root / rel, (algo,))
            if cache is not None and stat_key(root / rel) == key:
                cache.record(root / rel, key, algo, digests[algo], started)
            return size, digests[algo]
        except OSError as e:
            return f"cannot read: {e.strerror or e}"

    def size_of(rel: str) -> int:
        try:
            return (root / rel).stat().st_size
        except OSError:
            return 0

    order = sorted(jobs, key=lambda r: (-size_of(r), r))
    with ThreadPoolExecutor(max_workers=workers or default_workers()) as pool:
        out = dict(zip(order, pool.map(one, order)))
    if cache is not None:
        cache.save()
    return out


# ======================================================================================= inventory

def snapshot_trees(root: Path) -> list[Path]:
    """Where a link in the snapshot at `root` may lead: the snapshot itself (resolved), and for a Hugging Face cache
    snapshot (`models--org--name/snapshots/<rev>/`, whose files are links to `../../blobs/<sha>`) that repository's
    blobs/."""
    real = root.resolve()
    trees = [real]
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        trees.append((real.parent.parent / "blobs").resolve())
    return trees


def list_files(root: Path) -> list[str]:
    """Every regular file under root as a posix relpath, sorted, symlinks to files and directories followed (the
    paths are the ones transformers opens). Refuses (RefIdentityError) a link that leads outside snapshot_trees(root),
    dangles or loops: an inventory that skipped it would let unverified files reach the model."""
    root = Path(root)
    trees = snapshot_trees(root)
    out: list[str] = []

    def refuse(path: Path, why: str) -> None:
        raise RefIdentityError(f"{path}: symlink {why}; a reference snapshot must hold every file it loads (copy the "
                               f"target in, or point ref.local_dir at a snapshot that does)")

    def walk(directory: Path, rel: PurePosixPath, ancestors: tuple[Path, ...]) -> None:
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            path, entry_rel = Path(entry.path), rel / entry.name
            if entry.is_symlink():
                try:
                    target = path.resolve(strict=True)
                except FileNotFoundError:
                    refuse(path, f"to {os.readlink(path)!r} points to nothing")
                except (OSError, RuntimeError):          # ELOOP (3.13) / "Symlink loop" (3.11)
                    refuse(path, "loops")
                if not any(target == t or t in target.parents for t in trees):
                    refuse(path, f"leads outside the snapshot, to {target} (allowed: "
                                 f"{', '.join(str(t) for t in trees)})")
                if target.is_dir():
                    if target in ancestors:
                        refuse(path, f"loops (to {target}, a directory above it)")
                    walk(path, entry_rel, (*ancestors, target))
                elif target.is_file():
                    out.append(entry_rel.as_posix())
            elif entry.is_dir():
                walk(path, entry_rel, (*ancestors, path.resolve()))
            elif entry.is_file():
                out.append(entry_rel.as_posix())

    walk(root, PurePosixPath(), (root.resolve(),))
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
    """The re-check between stages, before anything is loaded; returns the directory to load the reference from.

    Checks the identity's own digest, every file present with its recorded size, the lock's SHA-256
    (local) or each file's metadata commit and ETag (hf), that no file transformers would load has
    appeared since verification, and every listed file's content against the identity's hash: through the
    FileHashCache, which verify_ref filled, so an unchanged file costs a stat and a changed one (any change of
    stat_key: an in-place edit even with its size and mtime kept) is re-hashed. `expect_digest`: the
    identity_digest an upstream artifact recorded (e.g. the tokenizer identity in the token manifest), so a valid
    identity of *another* snapshot swapped in is refused too. `deep=True` re-hashes every file whatever the cache
    holds (full verify cost; what the cache cannot see, bytes changed beneath the filesystem, see stat_key).
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
    if not problems:
        hashed = hash_files(root, {rel: f["algo"] for rel, f in listed.items()}, workers,
                            cache=FileHashCache.default(), use_cached=not deep)
        for rel, f in sorted(listed.items()):
            got = hashed[rel]
            if isinstance(got, str):
                problems.append(f"{root / rel}: {got}")
            elif got[1] != f["hash"]:
                problems.append(f"{root / rel}: content differs from {identity_path} ({f['algo']} {got[1][:16]}... "
                                f"!= {f['hash'][:16]}...): the file changed since verification; rerun verify_ref "
                                "(python -m stages.verify_ref verify)")
    _fail(f"reference {root} no longer matches {identity_path}:", problems)
    return root.resolve()




# ========================================================================================= positions

# The config.json keys that give a causal LM's number of positions: `max_position_embeddings` (Llama, Qwen2,
# Mistral, ...; transformers maps GPT-2's to `n_positions`, which GPT-2, GPT-J and CodeGen configs spell); a
# multimodal config holds its language model's in `text_config`.
POSITION_KEYS = ("max_position_embeddings", "n_positions")


def max_positions(ref_dir: str | os.PathLike) -> tuple[int, str, Path] | None:
    """(positions, the key they were read from, the config file) of the reference model in ref_dir; None when
    the directory has no readable config.json or it names no POSITION_KEYS (then nothing bounds max_length: a
    missing or broken config is verify_ref's and the loaders' to refuse)."""
    path = Path(ref_dir) / CONFIG_FILE
    try:
        config = read_json(path)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text_config = config.get("text_config")
    for node, prefix in ((config, ""), (text_config if isinstance(text_config, dict) else {}, "text_config.")):
        for key in POSITION_KEYS:
            value = node.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, prefix + key, path
    return None


def pinned_model_record(identity_path: str | os.PathLike) -> dict:
    """What a stage's record says of a pinned model: its source, repo_id, revision and identity digest (no path)."""
    identity = read_identity(identity_path)
    return {k: identity[k] for k in ("source", "repo_id", "revision", "identity_digest")}


ADAPTER_CONFIG = "adapter_config.json"          # peft's adapter directory (train.adapter export `adapter`)


def is_adapter_dir(model_dir) -> bool:
    return (Path(model_dir) / ADAPTER_CONFIG).is_file()


def judge_head_problem(model_dir) -> str | None:
    """Config files only (no torch), so the Snakefile's pre-flight refuses a pinned judge before any job runs.
    Why `model_dir` cannot judge (not a sequence-classification model with one label), read from its config
    files before any weight is loaded; None when it can. An adapter directory must be peft's SEQ_CLS task with
    the `score` head saved beside it."""
    model_dir = Path(model_dir)
    if is_adapter_dir(model_dir):
        cfg = json.loads((model_dir / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        saved = cfg.get("modules_to_save") or []
        if cfg.get("task_type") != "SEQ_CLS" or "score" not in saved:
            return (f"{model_dir / ADAPTER_CONFIG}: task_type {cfg.get('task_type')!r}, modules_to_save {saved}: not "
                    "a reward model's adapter (a SEQ_CLS adapter with its trained `score` head)")
        return None
    path = model_dir / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return f"{path}: not readable ({e})"
    archs = cfg.get("architectures") or []
    labels = cfg.get("num_labels", len(cfg.get("id2label") or {}) or 2)
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        return f"{path}: architectures {archs} is not a sequence-classification model (a reward model has a scalar head)"
    if labels != 1:
        return f"{path}: a sequence-classification model with {labels} labels, not a scalar reward (num_labels 1)"
    return None


# ===================================================================================== a model made here

def pin_own_model(root: str | os.PathLike, repo_id: str, provenance: dict, workers: int | None = None) -> dict:
    """Pin a model directory this pipeline made (the sft stage's export) and return its identity, the record every
    later stage re-checks before loading it (load_verified_dir), as verify_ref's is for the pinned reference.

    Writes ROOT/prefpipe.lock.json (the local lock: every file's size and SHA-256) with `provenance` inside (what
    the model was made from, by hash: the base reference's identity_digest, the training data's digest, the
    settings), so the lock's own SHA-256, the identity's `revision`, names the files and their making at once."""
    root = Path(root)
    files = [r for r in list_files(root) if r != LOCK_NAME and not is_hf_bookkeeping(r)]
    for r in files:
        if (why := unsafe_relpath_reason(r)) is not None:
            raise RefIdentityError(f"{root / r}: cannot pin a file whose path {why}")
    hashed = hash_files(root, {r: SHA256 for r in files}, workers, cache=FileHashCache.default(), use_cached=False)
    _fail(f"cannot pin {root}:", [f"{root / r}: {v}" for r, v in hashed.items() if isinstance(v, str)])
    if not any(r == CONFIG_FILE for r in files):
        raise RefIdentityError(f"cannot pin {root}: no {CONFIG_FILE} (not a model export)")
    entries = [{"path": r, "size": hashed[r][0], "sha256": hashed[r][1]} for r in files]
    lock = {"format": LOCK_FORMAT, "repo_id": repo_id, "files": entries, "files_digest": sha256_json(entries),
            "provenance": provenance}
    from stages.lib.io import write_json
    write_json(root / LOCK_NAME, lock)
    lock_bytes = (root / LOCK_NAME).read_bytes()
    lock_sha = sha256_bytes(lock_bytes)
    identity = {
        "format": IDENTITY_FORMAT, "source": "local", "repo_id": repo_id, "revision": lock_sha,
        "revision_pinned": True, "local_dir": str(root),
        "lock": {"path": LOCK_NAME, "size": len(lock_bytes), "sha256": lock_sha},
        "files": [{"path": e["path"], "size": e["size"], "algo": SHA256, "hash": e["sha256"]} for e in entries],
        "extras": [],
    }
    identity["identity_digest"] = identity_digest(identity)
    return identity


def lock_provenance(identity_path: str | os.PathLike) -> dict | None:
    """The `provenance` a model made here carries in its lock (pin_own_model), read through its verified identity;
    None for a snapshot pinned from outside."""
    identity = read_identity(identity_path)
    if identity["source"] != "local":
        return None
    lock = read_json(Path(identity["local_dir"]) / LOCK_NAME)
    return lock.get("provenance") if isinstance(lock, dict) else None
