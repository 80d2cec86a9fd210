"""verify_ref on genuine hub-layout snapshots and local locks, built at test time.

The hub layout is written by huggingface_hub's own `write_download_metadata` (so CACHEDIR.TAG,
.gitignore and *.lock bookkeeping are what a real `hf download --local-dir` leaves); non-LFS ETags
come from `git hash-object`, LFS ETags from hashlib, so the verifier's hashing is cross-checked against
independent implementations. The model is a real tiny Qwen2 made by stages.make_tiny_ref.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import random
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from stages import make_tiny_ref, verify_ref
from stages.lib.io import GIT_SHA1, MD5, SHA256, hash_bytes, hash_file, sha256_file
from stages.lib.reference import LOCK_NAME, RefIdentityError, hash_files, identity_digest, load_verified_dir
from stages.verify_ref import verify_reference

from conftest import REPO_ROOT
REV = hashlib.sha1(b"pinned commit").hexdigest()
OTHER_REV = hashlib.sha1(b"another commit").hexdigest()
META = ".cache/huggingface/download"


# ========================================================================================= helpers

def write_trl_corpus(path: Path, n: int = 120, seed: int = 0) -> Path:
    rng = random.Random(seed)
    colors, things = ["red", "green", "blue", "amber", "violet"], ["sky", "leaf", "lemon", "sea", "plum"]
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for i in range(n):
            t, good, bad = rng.choice(things), rng.choice(colors), rng.choice(colors)
            row = {"prompt": [{"role": "user", "content": f"What color is the {t}? #{i}"}],
                   "chosen": [{"role": "assistant", "content": f"The {t} is {good}."}],
                   "rejected": [{"role": "assistant", "content": f"I'd say {bad}, maybe 42 times."}]}
            f.write(json.dumps(row) + "\n")
    return path


def git_hash_object(path: Path) -> str:
    return subprocess.run(["git", "hash-object", str(path)], capture_output=True, text=True,
                          check=True).stdout.strip()


def sign(snap: Path, rel: str, revision: str = REV) -> str:
    """Write hub metadata for snap/rel the way `hf download` does; LFS ETag for weights."""
    from huggingface_hub._local_folder import write_download_metadata

    p = snap / rel
    etag = hashlib.sha256(p.read_bytes()).hexdigest() if rel.endswith((".safetensors", ".bin")) else git_hash_object(p)
    write_download_metadata(snap, rel, revision, etag)
    return etag


def make_hf_snapshot(src: Path, dst: Path, revision: str = REV) -> Path:
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src).as_posix()
        if p.is_file() and rel != LOCK_NAME:
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, dst / rel)
            sign(dst, rel, revision)
    return dst


def hf_ref(snap: Path, revision=REV) -> dict:
    return {"source": "hf", "repo_id": "someone/tiny", "revision": revision, "local_dir": str(snap)}


def local_ref(d: Path, revision=None, repo_id="embedded/tiny-qwen2") -> dict:
    return {"source": "local", "repo_id": repo_id, "revision": revision, "local_dir": str(d)}


def tree_state(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def flip_last_byte_keep_mtime(p: Path) -> None:
    st = p.stat()
    data = bytearray(p.read_bytes())
    data[-1] ^= 0x01
    p.write_bytes(bytes(data))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert p.stat().st_mtime_ns == st.st_mtime_ns and p.stat().st_size == st.st_size


def rewrite_index(snap: Path, weight_map: dict) -> None:
    rel = "model.safetensors.index.json"
    index = json.loads((snap / rel).read_text())
    index["weight_map"] = weight_map
    (snap / rel).write_text(json.dumps(index))
    sign(snap, rel)  # the index itself verifies: the failure must come from its content


# ======================================================================================== fixtures

@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """A real tiny model (single file, pinned) and the same weights saved as shards with an index."""
    from transformers import AutoModelForCausalLM

    base = tmp_path_factory.mktemp("built")
    corpus = write_trl_corpus(base / "corpus.jsonl.gz")
    single = base / "single"
    make_tiny_ref.build(corpus, single)
    sharded = base / "sharded"
    model = AutoModelForCausalLM.from_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="150KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy2(single / name, sharded / name)
    assert len(list(sharded.glob("model-*.safetensors"))) >= 2
    return {"single": single, "sharded": sharded}


@pytest.fixture
def snap(built, tmp_path) -> Path:
    return make_hf_snapshot(built["single"], tmp_path / "snap")


@pytest.fixture
def sharded_snap(built, tmp_path) -> Path:
    return make_hf_snapshot(built["sharded"], tmp_path / "sharded")


@pytest.fixture
def local_dir(built, tmp_path) -> Path:
    d = tmp_path / "local"
    shutil.copytree(built["single"], d)
    (d / LOCK_NAME).unlink()  # each test pins (or not) for itself
    return d


# ========================================================================================= hashing

def test_hashes_match_git_hash_object_and_sha256_streamed(tmp_path):
    rng = random.Random(1)
    for name, data in [("empty", b""), ("text", b"hello\n"), ("bin", bytes(rng.randrange(256) for _ in range(10_007)))]:
        p = tmp_path / name
        p.write_bytes(data)
        assert hash_bytes(data, GIT_SHA1) == git_hash_object(p)
        # chunk=7 forces many streamed updates, including a short last one; one read serves every digest
        assert hash_file(p, (GIT_SHA1, SHA256, MD5), chunk=7) == (
            len(data), {GIT_SHA1: git_hash_object(p), SHA256: hashlib.sha256(data).hexdigest(),
                        MD5: hashlib.md5(data).hexdigest()})
        assert sha256_file(p) == hashlib.sha256(data).hexdigest()
    jobs = {n: GIT_SHA1 for n in ("empty", "text", "bin")}
    assert hash_files(tmp_path, jobs, workers=1) == hash_files(tmp_path, jobs, workers=3)

# ================================================================================ hf: passing cases

def test_hf_snapshot_verifies_with_lfs_and_git_etags(snap, tmp_path):
    assert (snap / ".cache/huggingface/CACHEDIR.TAG").is_file()  # written by huggingface_hub itself
    before = tree_state(snap)
    identity = verify_reference(hf_ref(snap))
    assert tree_state(snap) == before  # verification never writes into the snapshot
    files = {f["path"]: f for f in identity["files"]}
    assert set(files) == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                          "tokenizer_config.json", "chat_template.jinja"}
    assert files["model.safetensors"]["algo"] == "sha256"
    assert files["model.safetensors"]["hash"] == hashlib.sha256((snap / "model.safetensors").read_bytes()).hexdigest()
    assert files["config.json"]["algo"] == "git-sha1"
    assert files["config.json"]["hash"] == git_hash_object(snap / "config.json")
    assert files["config.json"]["size"] == (snap / "config.json").stat().st_size
    assert identity["revision"] == REV and identity["revision_pinned"] is True and identity["extras"] == []
    assert identity["identity_digest"] == identity_digest(identity)
    assert verify_reference(hf_ref(snap)) == identity  # deterministic


def test_sharded_index_verifies_every_shard(sharded_snap):
    identity = verify_reference(hf_ref(sharded_snap))
    paths = {f["path"] for f in identity["files"]}
    index = json.loads((sharded_snap / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) <= paths and "model.safetensors.index.json" in paths


def test_cli_verify_writes_identity_and_load_verified_dir_returns_dir(snap, tmp_path):
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["ref"] = hf_ref(snap)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    out, log_file = tmp_path / "results/ref/ref_identity.json", tmp_path / "logs/verify_ref.log"
    rc = verify_ref.main(["verify", "--params", str(tmp_path / "params.yaml"), "--identity", str(out),
                          "--log", str(log_file)])
    assert rc == 0
    identity = json.loads(out.read_text())
    assert identity == verify_reference(hf_ref(snap))
    assert "identity_digest" in log_file.read_text()
    assert load_verified_dir(out) == snap.resolve()
    # a failed re-run removes the stale identity instead of leaving it looking current
    (snap / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as refused:       # the stage-CLI convention: one refusal line, exit 1
        verify_ref.main(["verify", "--params", str(tmp_path / "params.yaml"), "--identity", str(out)])
    assert refused.value.code == 1 and str(refused.value).startswith("verify_ref: refused: ")
    assert not out.exists()


def test_extras_are_reported_and_listed_not_verified(snap, caplog):
    (snap / "README.md").write_text("notes\n")
    (snap / "docs").mkdir()
    (snap / "docs/eval.txt").write_text("numbers\n")
    with caplog.at_level(logging.WARNING, logger="verify_ref"):
        identity = verify_reference(hf_ref(snap))
    assert identity["extras"] == [{"path": "README.md", "size": 6}, {"path": "docs/eval.txt", "size": 8}]
    assert "README.md" not in {f["path"] for f in identity["files"]}
    assert "unverified extra" in caplog.text and "README.md" in caplog.text


def test_unverified_file_that_transformers_would_load_is_refused(snap):
    (snap / "special_tokens_map.json").write_text("{}")
    with pytest.raises(RefIdentityError, match=r"special_tokens_map\.json: missing metadata"):
        verify_reference(hf_ref(snap))


# ============================================================================== hf: failure modes

@pytest.mark.parametrize("revision, reason", [
    (None, "required for ref.source hf"),
    ("abc1234", "has 7 characters"),
    (REV[:39], "has 39 characters"),
    ("g" * 40, "non-hex"),
    (REV.upper(), "non-hex or uppercase"),
    ("main", "has 4 characters"),
])
def test_revision_must_be_full_40_hex(snap, revision, reason):
    with pytest.raises(RefIdentityError, match=reason) as e:
        verify_reference(hf_ref(snap, revision))
    assert "ref.revision" in str(e.value)


def test_missing_metadata_names_the_file(snap):
    (snap / META / "model.safetensors.metadata").unlink()
    with pytest.raises(RefIdentityError, match=r"model\.safetensors: missing metadata"):
        verify_reference(hf_ref(snap))


def test_metadata_for_another_commit(snap):
    sign(snap, "tokenizer.json", OTHER_REV)
    with pytest.raises(RefIdentityError, match=rf"tokenizer\.json: metadata .* is for commit {OTHER_REV}, not the "
                                                rf"pinned revision {REV}"):
        verify_reference(hf_ref(snap))


def test_whole_snapshot_of_another_commit(built, tmp_path):
    other = make_hf_snapshot(built["single"], tmp_path / "other", OTHER_REV)
    with pytest.raises(RefIdentityError, match="is for commit"):
        verify_reference(hf_ref(other))


def test_malformed_metadata_is_reported_and_left_in_place(snap):
    meta = snap / META / "config.json.metadata"
    meta.write_text("not a commit\n")
    before = tree_state(snap)
    with pytest.raises(RefIdentityError, match=r"config\.json\.metadata: malformed metadata"):
        verify_reference(hf_ref(snap))
    assert tree_state(snap) == before  # huggingface_hub's reader would have deleted it


@pytest.mark.parametrize("rel", ["model.safetensors", "config.json"])
def test_hash_mismatch_even_with_original_mtime_restored(snap, tmp_path, rel):
    from huggingface_hub._local_folder import read_download_metadata

    flip_last_byte_keep_mtime(snap / rel)
    # huggingface_hub itself trusts such a file (metadata newer than mtime): metadata alone proves nothing
    probe = shutil.copytree(snap, tmp_path / "probe", copy_function=shutil.copy2)
    assert read_download_metadata(probe, rel) is not None
    with pytest.raises(RefIdentityError, match=re.escape(rel) + ": content hash mismatch"):
        verify_reference(hf_ref(snap))


def test_missing_shard(sharded_snap):
    shard = sorted(sharded_snap.glob("model-*.safetensors"))[0]
    shard.unlink()
    (sharded_snap / META / f"{shard.name}.metadata").unlink()
    with pytest.raises(RefIdentityError, match=rf"{shard.name}: missing shard named by .*index\.json"):
        verify_reference(hf_ref(sharded_snap))


def test_file_listed_in_metadata_but_missing(sharded_snap):
    shard = sorted(sharded_snap.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(RefIdentityError, match=rf"{shard.name}: listed in metadata .* but the file is missing"):
        verify_reference(hf_ref(sharded_snap))


def test_shard_present_without_metadata(sharded_snap):
    shard = sorted(sharded_snap.glob("model-*.safetensors"))[0]
    (sharded_snap / META / f"{shard.name}.metadata").unlink()
    with pytest.raises(RefIdentityError, match=rf"{shard.name}: missing metadata"):
        verify_reference(hf_ref(sharded_snap))


@pytest.mark.parametrize("shard, reason", [
    ("../outside.safetensors", "contains '..'"),
    ("sub/../../x.safetensors", "contains '..'"),
    ("/etc/model.safetensors", "is absolute"),
    ("C:/models/x.safetensors", "drive letter"),
    ("sub\\x.safetensors", "backslash"),
    ("./model-00001.safetensors", "not normalised"),
])
def test_unsafe_shard_path(sharded_snap, shard, reason):
    index = json.loads((sharded_snap / "model.safetensors.index.json").read_text())
    wm = dict(index["weight_map"])
    wm[next(iter(wm))] = shard
    rewrite_index(sharded_snap, wm)
    with pytest.raises(RefIdentityError, match=r"index\.json: unsafe shard path .*" + reason):
        verify_reference(hf_ref(sharded_snap))


def test_shard_with_wrong_suffix(sharded_snap):
    index = json.loads((sharded_snap / "model.safetensors.index.json").read_text())
    wm = {k: "model-00001.bin" for k in index["weight_map"]}
    rewrite_index(sharded_snap, wm)
    with pytest.raises(RefIdentityError, match=r"shard 'model-00001.bin' does not have the index's suffix "
                                                r"\.safetensors"):
        verify_reference(hf_ref(sharded_snap))


def test_empty_weight_map(sharded_snap):
    rewrite_index(sharded_snap, {})
    with pytest.raises(RefIdentityError, match=r"model\.safetensors\.index\.json: empty weight_map"):
        verify_reference(hf_ref(sharded_snap))


def test_no_weight_entry_point(snap):
    (snap / "model.safetensors").unlink()
    (snap / META / "model.safetensors.metadata").unlink()
    with pytest.raises(RefIdentityError, match="no weight entry point"):
        verify_reference(hf_ref(snap))


def test_config_and_tokenizer_required(snap):
    (snap / "config.json").unlink()
    (snap / META / "config.json.metadata").unlink()
    (snap / "tokenizer.json").unlink()
    (snap / META / "tokenizer.json.metadata").unlink()
    with pytest.raises(RefIdentityError) as e:
        verify_reference(hf_ref(snap))
    assert "config.json: missing (model config)" in str(e.value)
    assert "no tokenizer files" in str(e.value)


# ======================================================================================= local lock

def test_pin_verify_round_trip(local_dir, caplog):
    lock_sha = verify_ref.pin(local_dir, "embedded/tiny-qwen2")
    assert lock_sha == hashlib.sha256((local_dir / LOCK_NAME).read_bytes()).hexdigest()
    lock = json.loads((local_dir / LOCK_NAME).read_text())
    assert LOCK_NAME not in {e["path"] for e in lock["files"]}
    with caplog.at_level(logging.WARNING, logger="verify_ref"):
        unpinned = verify_reference(local_ref(local_dir))
    assert "ref.revision is null" in caplog.text
    pinned = verify_reference(local_ref(local_dir, lock_sha))
    for identity in (unpinned, pinned):
        assert identity["revision"] == lock_sha and identity["lock"]["sha256"] == lock_sha
        assert {f["path"]: f["hash"] for f in identity["files"]} == {e["path"]: e["sha256"] for e in lock["files"]}
        assert all(f["algo"] == "sha256" for f in identity["files"])
    assert (unpinned["revision_pinned"], pinned["revision_pinned"]) == (False, True)


def test_cli_pin_prints_lock_sha(local_dir, capsys):
    assert verify_ref.main(["pin", str(local_dir), "--repo-id", "embedded/tiny-qwen2"]) == 0
    assert capsys.readouterr().out.strip() == hashlib.sha256((local_dir / LOCK_NAME).read_bytes()).hexdigest()


def test_pin_write_params_sets_the_four_ref_keys_and_the_first_run_verifies(local_dir, tmp_path, capsys):
    """Your own model: `pin DIR --write-params` sets ref.source, ref.repo_id (the lock's), ref.revision (the lock's
    sha256) and ref.local_dir in params.yaml, changing no other line (comments kept), and the first verify passes.
    Before: only the lock was written; with ref.repo_id set to anything else than pin's default name (local/<dir>)
    and the revision copied by hand, the first run was refused on repo_id."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    model = checkout / "models" / "my-sft"
    shutil.copytree(local_dir, model)
    original = (REPO_ROOT / "params.yaml").read_text()
    (checkout / "params.yaml").write_text(original)
    assert verify_ref.main(["pin", str(model), "--write-params", str(checkout / "params.yaml")]) == 0
    digest = capsys.readouterr().out.strip()
    assert digest == hashlib.sha256((model / LOCK_NAME).read_bytes()).hexdigest()
    written = (checkout / "params.yaml").read_text()
    changed = [(a, b) for a, b in zip(original.splitlines(), written.splitlines()) if a != b]
    assert len(original.splitlines()) == len(written.splitlines())
    assert changed == [("  repo_id: embedded/tiny-qwen2", "  repo_id: local/my-sft"),
                       (f"  revision: {yaml.safe_load(original)['ref']['revision']}", f"  revision: {digest}"),
                       ("  local_dir: models/tiny-qwen2", "  local_dir: models/my-sft")]
    params = yaml.safe_load(written)
    assert params["ref"] == {"source": "local", "repo_id": "local/my-sft", "revision": digest,
                             "local_dir": "models/my-sft"}
    identity = checkout / "ref_identity.json"
    cwd = os.getcwd()
    os.chdir(checkout)                 # local_dir is relative to the checkout, as the stages run
    try:
        assert verify_ref.main(["verify", "--params", "params.yaml", "--identity", str(identity)]) == 0
    finally:
        os.chdir(cwd)
    assert json.loads(identity.read_text())["revision_pinned"] is True


def test_pin_write_params_refuses_what_it_cannot_edit_in_place(local_dir, tmp_path):
    params = tmp_path / "params.yaml"
    text = (REPO_ROOT / "params.yaml").read_text()
    block = text[text.index("ref:\n"):text.index("tokenize:")]
    flow = text.replace(block, "ref: {source: local, repo_id: x, revision: null, local_dir: y}\n\n")
    params.write_text(flow)
    with pytest.raises(SystemExit, match=r"verify_ref: refused: .*could not set ref.\{source, repo_id, revision, "
                                         r"local_dir\} by editing the file in place .*set them by hand: ref.source: local"):
        verify_ref.main(["pin", str(local_dir), "--write-params", str(params)])
    assert params.read_text() == flow              # left as it was


def test_local_hash_mismatch_with_mtime_restored(local_dir):
    verify_ref.pin(local_dir, "embedded/tiny-qwen2")
    flip_last_byte_keep_mtime(local_dir / "model.safetensors")
    with pytest.raises(RefIdentityError, match=r"model\.safetensors: content hash mismatch"):
        verify_reference(local_ref(local_dir))


def test_local_size_change_and_missing_file(local_dir):
    verify_ref.pin(local_dir, "embedded/tiny-qwen2")
    with open(local_dir / "tokenizer.json", "a") as f:
        f.write(" ")
    (local_dir / "generation_config.json").unlink()
    with pytest.raises(RefIdentityError) as e:
        verify_reference(local_ref(local_dir))
    assert "tokenizer.json: size" in str(e.value)
    assert "generation_config.json: listed in lock" in str(e.value)


def test_hand_edited_lock_is_caught(local_dir):
    verify_ref.pin(local_dir, "embedded/tiny-qwen2")
    lock = json.loads((local_dir / LOCK_NAME).read_text())
    lock["files"][0]["sha256"] = "0" * 64
    (local_dir / LOCK_NAME).write_text(json.dumps(lock))
    with pytest.raises(RefIdentityError, match="files_digest does not match .* edited by hand"):
        verify_reference(local_ref(local_dir))


def test_consistent_repin_caught_only_when_params_pin_the_lock(local_dir):
    original = verify_ref.pin(local_dir, "embedded/tiny-qwen2")
    before = verify_reference(local_ref(local_dir, original))
    flip_last_byte_keep_mtime(local_dir / "model.safetensors")
    repinned = verify_ref.pin(local_dir, "embedded/tiny-qwen2")  # someone re-pins the swapped weights
    with pytest.raises(RefIdentityError, match=rf"lock has SHA-256 {repinned} but ref.revision pins {original}"):
        verify_reference(local_ref(local_dir, original))
    # Unpinned, a consistent re-pin cannot be proved wrong offline; the identity still changes.
    after = verify_reference(local_ref(local_dir))
    assert after["identity_digest"] != before["identity_digest"] and after["revision"] == repinned


def test_local_revision_must_be_a_sha256(local_dir):
    verify_ref.pin(local_dir, "embedded/tiny-qwen2")
    with pytest.raises(RefIdentityError, match="64-hex SHA-256"):
        verify_reference(local_ref(local_dir, REV))


def test_local_repo_id_and_missing_lock(local_dir):
    with pytest.raises(RefIdentityError, match="no lock file"):
        verify_reference(local_ref(local_dir))
    verify_ref.pin(local_dir, "someone/else")
    with pytest.raises(RefIdentityError, match="pinned as repo_id 'someone/else'"):
        verify_reference(local_ref(local_dir))


def test_local_extras_and_unlocked_loadable_file(local_dir):
    verify_ref.pin(local_dir, "embedded/tiny-qwen2")
    (local_dir / "NOTES.md").write_text("x")
    assert verify_reference(local_ref(local_dir))["extras"] == [{"path": "NOTES.md", "size": 1}]
    (local_dir / "added_tokens.json").write_text("{}")
    with pytest.raises(RefIdentityError, match=r"added_tokens\.json: not in lock"):
        verify_reference(local_ref(local_dir))


def test_pin_refuses_incomplete_directory(local_dir):
    (local_dir / "model.safetensors").unlink()
    with pytest.raises(RefIdentityError, match="(?s)refusing to pin .*no weight entry point"):
        verify_ref.pin(local_dir, "embedded/tiny-qwen2")
    assert not (local_dir / LOCK_NAME).exists()


# ================================================================================= load_verified_dir

def _write_identity(ref: dict, path: Path) -> Path:
    from stages.lib.io import write_json

    write_json(path, verify_reference(ref))
    return path


def test_identity_and_lock_shapes_are_checked_where_read(local_dir, tmp_path):
    verify_ref.pin(local_dir, "embedded/tiny-qwen2")
    ident = _write_identity(local_ref(local_dir), tmp_path / "ref_identity.json")
    obj = json.loads(ident.read_text())
    obj["files"][0]["size"] = "big"
    (tmp_path / "bad.json").write_text(json.dumps(obj))
    with pytest.raises(RefIdentityError, match=r"bad\.json: not a prefpipe-ref-identity/1 reference identity "
                                               r"\(files/0/size: 'big' is not of type 'integer'\)"):
        load_verified_dir(tmp_path / "bad.json")
    lock = json.loads((local_dir / LOCK_NAME).read_text())
    del lock["files"][0]["sha256"]
    (local_dir / LOCK_NAME).write_text(json.dumps(lock))
    with pytest.raises(RefIdentityError, match=r"prefpipe\.lock\.json: not a prefpipe-ref-lock/1 lock \(files/0: "
                                               r"'sha256' is a required property\)"):
        verify_reference(local_ref(local_dir))


def test_load_verified_dir_catches_swapped_file(local_dir, tmp_path):
    verify_ref.pin(local_dir, "embedded/tiny-qwen2")
    ident = _write_identity(local_ref(local_dir), tmp_path / "ref_identity.json")
    assert load_verified_dir(ident) == local_dir.resolve()
    (local_dir / "model.safetensors").write_bytes(b"\0" * 100)
    with pytest.raises(RefIdentityError, match=r"model\.safetensors: size 100 differs .* swapped since verification"):
        load_verified_dir(ident)


def test_load_verified_dir_catches_edited_or_swapped_identity(local_dir, snap, tmp_path):
    verify_ref.pin(local_dir, "embedded/tiny-qwen2")
    ident = _write_identity(local_ref(local_dir), tmp_path / "ref_identity.json")
    for edit in ({"local_dir": str(snap)}, {"revision": "f" * 64}):
        obj = json.loads(ident.read_text())
        obj.update(edit)
        (tmp_path / "edited.json").write_text(json.dumps(obj))
        with pytest.raises(RefIdentityError, match="identity_digest does not match"):
            load_verified_dir(tmp_path / "edited.json")
    with pytest.raises(RefIdentityError, match="no reference identity"):
        load_verified_dir(tmp_path / "absent.json")
    # a *valid* identity of another snapshot swapped in: caught against the digest recorded upstream
    recorded = json.loads(ident.read_text())["identity_digest"]
    other = _write_identity(hf_ref(snap), tmp_path / "other.json")
    assert load_verified_dir(ident, expect_digest=recorded) == local_dir.resolve()
    with pytest.raises(RefIdentityError, match=f"is not the {recorded} recorded upstream"):
        load_verified_dir(other, expect_digest=recorded)


def test_load_verified_dir_catches_repin_and_hf_redownload(local_dir, snap, built, tmp_path):
    verify_ref.pin(local_dir, "embedded/tiny-qwen2")
    ident = _write_identity(local_ref(local_dir), tmp_path / "local.json")
    flip_last_byte_keep_mtime(local_dir / "model.safetensors")  # same size: the size check alone misses it
    verify_ref.pin(local_dir, "embedded/tiny-qwen2")
    with pytest.raises(RefIdentityError, match="lock changed since verification"):
        load_verified_dir(ident)

    hf_ident = _write_identity(hf_ref(snap), tmp_path / "hf.json")
    flip_last_byte_keep_mtime(snap / "model.safetensors")   # same size, same metadata: the content check finds it
    for deep in (False, True):
        with pytest.raises(RefIdentityError, match=r"model\.safetensors: content differs .* rerun verify_ref"):
            load_verified_dir(hf_ident, deep=deep)
    sign(snap, "model.safetensors", OTHER_REV)  # re-downloaded at another commit between stages
    with pytest.raises(RefIdentityError, match=r"model\.safetensors: metadata .* changed since verification"):
        load_verified_dir(hf_ident)


def test_load_verified_dir_catches_new_loadable_file(snap, tmp_path):
    ident = _write_identity(hf_ref(snap), tmp_path / "hf.json")
    (snap / "README.md").write_text("harmless\n")
    assert load_verified_dir(ident) == snap.resolve()
    (snap / "special_tokens_map.json").write_text("{}")
    with pytest.raises(RefIdentityError, match=r"special_tokens_map\.json: appeared since verification"):
        load_verified_dir(ident)


# ============================================================ content before loading: the file-hash cache

def _in_place_edit_keep_mtime(p: Path) -> None:
    """One byte of the file changed through the same inode, the size kept and the mtime put back."""
    st = p.stat()
    with open(p, "r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    now = p.stat()
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    assert now.st_ctime_ns != st.st_ctime_ns          # what no user process can put back


def _local_identity_via_cli(local_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    revision = verify_ref.pin(local_dir, "embedded/tiny-qwen2")
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["ref"] = local_ref(local_dir, revision=revision)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    ident = tmp_path / "results/ref/ref_identity.json"
    assert verify_ref.main(["verify", "--params", str(tmp_path / "params.yaml"), "--identity", str(ident)]) == 0
    return ident, tmp_path / "params.yaml"


def test_engine_refuses_weights_edited_in_place_with_size_inode_and_mtime_kept(local_dir, tmp_path, monkeypatch):
    """The issue's scenario: a real tiny model pinned and verified by the real CLI, then model.safetensors edited
    in place, same size, same inode, mtime restored. A (size, mtime, inode) cache would call it unchanged; the
    ctime in the key does not, and the engine stage refuses before loading, naming the file and verify_ref."""
    from stages import train_rm
    from stages.lib.reference import HASH_CACHE_ENV, FileHashCache, stat_key
    cache = tmp_path / "repo/.prefpipe-cache/file_hashes.json"
    monkeypatch.setenv(HASH_CACHE_ENV, str(cache))
    time.sleep(2.1)                   # files older than the racy window (reference.RACY_NS), so verify caches them
    ident, params = _local_identity_via_cli(local_dir, tmp_path)
    weights = local_dir / "model.safetensors"
    entries = FileHashCache(cache).entries
    assert entries[os.path.realpath(weights)]["key"] == stat_key(weights)     # verify_ref filled the cache
    assert load_verified_dir(ident) == local_dir.resolve()                    # and a load is checked through it

    _in_place_edit_keep_mtime(weights)
    with pytest.raises(RefIdentityError, match=r"model\.safetensors: content differs .* rerun verify_ref"):
        load_verified_dir(ident)
    with pytest.raises(SystemExit) as e:
        train_rm.main(["--params", str(params), "--identity", str(ident), "--train-tokens", str(tmp_path / "t.parquet"),
                       "--probe-tokens", str(tmp_path / "p.parquet"), "--out-dir", str(tmp_path / "rm")])
    line = str(e.value)
    assert e.value.code == 1 and line.startswith("train_rm: refused: reference ") and "\n" not in line
    assert f"{weights}: content differs from {ident}" in line and "rerun verify_ref" in line, line
    assert not (tmp_path / "rm").exists()


def test_the_cache_is_trusted_only_while_the_key_holds_and_deep_rehashes(local_dir, tmp_path, monkeypatch):
    """What the cache cannot see (bytes changed beneath the filesystem, which leave every inode field as it was) is
    stood in for by a cache entry that lies for an unchanged key: the default load believes it, deep=True does not."""
    from stages.lib.reference import HASH_CACHE_ENV, FileHashCache, stat_key
    cache = tmp_path / "cache.json"
    monkeypatch.setenv(HASH_CACHE_ENV, str(cache))
    time.sleep(2.1)
    ident, _ = _local_identity_via_cli(local_dir, tmp_path)
    config = local_dir / "config.json"
    data = json.loads(cache.read_text())
    data["files"][os.path.realpath(config)]["sha256"] = "0" * 64
    cache.write_text(json.dumps(data))
    with pytest.raises(RefIdentityError, match=r"config\.json: content differs"):
        load_verified_dir(ident)
    assert load_verified_dir(ident, deep=True) == local_dir.resolve()        # re-hashed, and the cache corrected
    assert FileHashCache(cache).lookup(config, stat_key(config), SHA256) == sha256_file(config)
    assert load_verified_dir(ident) == local_dir.resolve()
    monkeypatch.setenv(HASH_CACHE_ENV, "off")                                 # no cache: every load re-hashes
    _in_place_edit_keep_mtime(config)
    with pytest.raises(RefIdentityError, match=r"config\.json: content differs"):
        load_verified_dir(ident)


# ======================================================================================= symlinks

def test_a_symlinked_directory_is_inventoried_by_pin_and_verify(local_dir, tmp_path):
    """additional_chat_templates/ as a link to a directory inside the snapshot: transformers loads its files, so
    pin locks them, verify hashes them, and one appearing after the pin is refused as unverified."""
    store = local_dir / "templates_store"
    store.mkdir()
    (store / "tool_use.jinja").write_text("{{ messages }}\n")
    verify_ref.pin(local_dir, "embedded/tiny-qwen2")          # the store alone: an extra, never loaded
    (local_dir / "additional_chat_templates").symlink_to("templates_store", target_is_directory=True)
    with pytest.raises(RefIdentityError, match=r"additional_chat_templates/tool_use\.jinja: not in lock .*present "
                                               "but not covered"):
        verify_reference(local_ref(local_dir))

    verify_ref.pin(local_dir, "embedded/tiny-qwen2")
    lock = json.loads((local_dir / LOCK_NAME).read_text())
    assert "additional_chat_templates/tool_use.jinja" in {f["path"] for f in lock["files"]}
    identity = verify_reference(local_ref(local_dir))
    assert "additional_chat_templates/tool_use.jinja" in {f["path"] for f in identity["files"]}
    ident = tmp_path / "ident.json"
    ident.write_text(json.dumps(identity))
    assert load_verified_dir(ident) == local_dir.resolve()
    (store / "tool_use.jinja").write_text("{{ evil }}\n\n")            # edited through the link's target
    with pytest.raises(RefIdentityError, match=r"additional_chat_templates/tool_use\.jinja: size"):
        verify_reference(local_ref(local_dir))
    with pytest.raises(RefIdentityError, match=r"additional_chat_templates/tool_use\.jinja: size .* swapped"):
        load_verified_dir(ident)


def test_links_leaving_the_snapshot_dangling_or_looping_are_refused(local_dir, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "tool_use.jinja").write_text("{{ messages }}\n")
    verify_ref.pin(local_dir, "embedded/tiny-qwen2")
    ident = _write_identity(local_ref(local_dir), tmp_path / "ident.json")
    link = local_dir / "additional_chat_templates"
    cases = [(lambda: link.symlink_to(outside, target_is_directory=True), "leads outside the snapshot"),
             (lambda: link.symlink_to(local_dir, target_is_directory=True), "loops"),
             (lambda: link.symlink_to("additional_chat_templates"), "loops"),
             (lambda: link.symlink_to(tmp_path / "absent"), "points to nothing")]
    for make, why in cases:
        make()
        for check in (lambda: verify_ref.pin(local_dir, "embedded/tiny-qwen2"),
                      lambda: verify_reference(local_ref(local_dir)), lambda: load_verified_dir(ident)):
            with pytest.raises(RefIdentityError, match=rf"additional_chat_templates: symlink .*{why}"):
                check()
        link.unlink()
    assert load_verified_dir(ident) == local_dir.resolve()


def test_a_hub_cache_snapshot_of_links_into_blobs_pins_and_verifies(built, tmp_path):
    """`models--org--name/snapshots/<rev>/` holds links to `../../blobs/<sha256>`, as huggingface_hub's cache does:
    followed (the blobs are inside the repository's tree) and verified by content."""
    repo = tmp_path / "hub/models--someone--tiny"
    snapshot, blobs = repo / "snapshots" / REV, repo / "blobs"
    blobs.mkdir(parents=True)
    for p in sorted(built["single"].rglob("*")):
        rel = p.relative_to(built["single"]).as_posix()
        if p.is_file() and rel != LOCK_NAME:
            blob = blobs / hashlib.sha256(p.read_bytes()).hexdigest()
            shutil.copy2(p, blob)
            (snapshot / rel).parent.mkdir(parents=True, exist_ok=True)
            (snapshot / rel).symlink_to(os.path.relpath(blob, (snapshot / rel).parent))
    assert all((snapshot / f).is_symlink() for f in ("config.json", "model.safetensors"))
    revision = verify_ref.pin(snapshot, "someone/tiny")
    identity = verify_reference(local_ref(snapshot, revision=revision, repo_id="someone/tiny"))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {f["path"] for f in identity["files"]}
    blob = (snapshot / "tokenizer.json").resolve()
    blob.write_bytes(blob.read_bytes().replace(b'"', b"'", 1))             # the blob behind the link, same size
    with pytest.raises(RefIdentityError, match=r"tokenizer\.json: content hash mismatch"):
        verify_reference(local_ref(snapshot, revision=revision, repo_id="someone/tiny"))
