"""What the data-side tests share (tokenize, truncation, the pair tokenizer, RM scoring): real HH-RLHF pairs as
tokenize reads them, the real GPT-2 tokenizer saved with a chat template, the tokenize stage's input files.

The HH transcripts are parsed here in the simplest way (prompt = turns before the last "\\n\\nAssistant:"); the
real parser is stages/data/formats/hh.py.
"""
from __future__ import annotations

import functools
import gzip
import json
import re
import shutil
from pathlib import Path

import pyarrow as pa
import yaml

from stages.data.limits import TokenizeLimits
from stages.data.tokenizer import load_tokenizer
from stages.lib.contracts import PAIRS_SCHEMA
from stages.lib.contracts import row_content_hash as content_hash
from stages.lib.io import sha256_json, write_json, write_parquet

REPO_ROOT = Path(__file__).resolve().parents[1]
UNLIMITED = TokenizeLimits(max_length=10**6, max_prompt_length=10**6 - 1, truncation="reject")
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Generation prompt ends with a space: byte-level BPE glues that space onto the answer's first word.
SPACE_ENDED = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}"
               "{% if add_generation_prompt %}assistant: {% endif %}")
# No end-of-turn marker after the assistant turn: the stage must append EOS itself.
NO_END_MARKER = ("{% for m in messages %}{{ m.role }}:\n{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:\n{% endif %}")


def S(c):
    return {"role": "system", "content": c}


def U(c):
    return {"role": "user", "content": c}


def A(c):
    return {"role": "assistant", "content": c}


def triple(pair):
    """A parsed pair (stages.data.formats.Pair) as (prompt, chosen, rejected)."""
    return pair.prompt, pair.chosen, pair.rejected


def assert_rejected(row, fmt: str, reason: str, options=None) -> None:
    """The row is refused by the format registry's parse (stages.data.formats.parse_row) with exactly `reason`,
    and a detail saying why."""
    import pytest

    from stages.data.formats import parse_row
    from stages.data.messages import RowRejected

    with pytest.raises(RowRejected) as e:
        parse_row(row, fmt, options)
    assert e.value.reason == reason and e.value.detail, e.value.detail


def parse_hh(chosen: str, rejected: str) -> dict | None:
    tag = "\n\nAssistant:"
    cut = chosen.rfind(tag)
    prefix = chosen[:cut]
    if cut < 0 or not rejected.startswith(prefix + tag):
        return None
    parts = re.split(r"\n\n(Human|Assistant):", prefix)
    if parts[0] != "":
        return None
    prompt = [{"role": "user" if parts[k] == "Human" else "assistant", "content": parts[k + 1].strip()}
              for k in range(1, len(parts), 2)]
    return {"prompt": prompt,
            "chosen": [{"role": "assistant", "content": chosen[cut + len(tag):].strip()}],
            "rejected": [{"role": "assistant", "content": rejected[cut + len(tag):].strip()}]}


def as_pair(messages: dict, row: int) -> dict:
    h = content_hash(messages)
    return {"pair_id": h[:24], "content_hash": h, "source": "hh", **messages, "margin": None,
            "src_file": "harmless-base-test.jsonl.gz", "src_row": row}


def load_hh_pairs(path: Path, limit: int | None = None) -> list[dict]:
    pairs, seen = [], set()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for row, line in enumerate(f):
            rec = json.loads(line)
            messages = parse_hh(rec["chosen"], rec["rejected"])
            if messages is None or messages["chosen"] == messages["rejected"]:
                continue
            pair = as_pair(messages, row)
            if pair["pair_id"] in seen:
                continue
            seen.add(pair["pair_id"])
            pairs.append(pair)
            if limit is not None and len(pairs) == limit:
                break
    return pairs


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def gpt2_with_template(src: Path, dst: Path, template: str, extra_specials=()) -> Path:
    """A copy of the real GPT-2 tokenizer saved with a chat template (and extra special tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    if extra_specials:
        tok.add_special_tokens({"additional_special_tokens": list(extra_specials)})
    tok.chat_template = template
    tok.save_pretrained(str(dst))
    return dst


@functools.lru_cache(maxsize=None)
def load_tokenizer_once(path: Path):
    return load_tokenizer(path)


def truncated_by_reason(truncations: list[dict]) -> dict[str, int]:
    from stages.data.limits import TRUNCATION_REASONS

    return {reason: sum(t["reason"] == reason for t in truncations) for reason in TRUNCATION_REASONS}


def long_text(text: str, chars: int) -> str:
    """`text` repeated past `chars` characters: real words, so spaces between letters to cut at."""
    return " ".join([text] * (chars // max(1, len(text)) + 2))


def short_prompt_pairs(hh_pairs: list[dict]) -> list[dict]:
    """Real pairs whose one-turn prompt is short (under 120 characters: what decides is the long text added to
    them)."""
    return [p for p in hh_pairs if len(p["prompt"]) == 1 and len(p["prompt"][0]["content"]) < 120]


# ---------------------------------------------------------------------------------------------
# The tokenize stage's input files

def probe_manifest(probe: list[dict]) -> dict:
    ids, hashes = [p["pair_id"] for p in probe], [p["content_hash"] for p in probe]
    return {"size": len(probe), "seed": 1, "selection": "test", "pair_ids": ids, "content_hashes": hashes,
            "probe_digest": sha256_json([[i, h] for i, h in zip(ids, hashes)])}


def write_probe_inputs(d: Path, train: list[dict], probe: list[dict], manifest: dict | None = None) -> dict:
    d.mkdir(parents=True, exist_ok=True)
    write_parquet(d / "train.parquet", pa.Table.from_pylist(train, schema=PAIRS_SCHEMA))
    write_parquet(d / "probe.parquet", pa.Table.from_pylist(probe, schema=PAIRS_SCHEMA))
    write_json(d / "probe_manifest.json", manifest or probe_manifest(probe))
    return {"train_path": str(d / "train.parquet"), "probe_path": str(d / "probe.parquet"),
            "manifest_path": str(d / "probe_manifest.json")}


# ---------------------------------------------------------------------------------------------
# Verified references (tokenize and freeze_probe read the tokenizer through ref_identity.json)

def pinned_gpt2_identity(gpt2_tokenizer_dir: Path, tmp_path: Path) -> Path:
    """ref_identity.json of the real GPT-2 tokenizer beside a tiny random GPT-2 (1024 positions), pinned as a
    user's local reference is."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from stages import verify_ref

    ref_dir = tmp_path / "gpt2"
    shutil.copytree(gpt2_tokenizer_dir, ref_dir)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=1024)).save_pretrained(str(ref_dir))
    revision = verify_ref.pin(ref_dir, "test/gpt2")
    identity = tmp_path / "ref_identity.json"
    write_json(identity, verify_ref.verify_reference({"source": "local", "repo_id": "test/gpt2", "revision": revision,
                                                      "local_dir": str(ref_dir)}))
    return identity


def embedded_identity(tmp_path: Path) -> Path:
    """ref_identity.json of the embedded reference (models/tiny-qwen2, as params.yaml pins it), by absolute path."""
    from stages import verify_ref

    ref = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())["ref"]
    identity = tmp_path / "ref_identity.json"
    write_json(identity, verify_ref.verify_reference(dict(ref, local_dir=str(REPO_ROOT / ref["local_dir"]))))
    return identity


# freeze_probe's inputs: pairs.parquet tables in the normalize contract, params with a `probe` section.

def pairs_table(rows: list[dict], source: str = "test") -> pa.Table:
    """Rows {prompt, chosen, rejected} -> a pairs.parquet table in the normalize contract's schema."""
    records = []
    for i, r in enumerate(rows):
        content = {"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]}
        h = sha256_json(content)
        records.append({"pair_id": h[:24], "content_hash": h, "source": source, **content,
                        "margin": None, "src_file": f"{source}.jsonl", "src_row": i})
    records.sort(key=lambda r: r["pair_id"])
    return pa.Table.from_pylist(records, schema=PAIRS_SCHEMA)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def bot(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def leaky_rows() -> list[dict]:
    """60 prompts, most with several pairs; some repeats differ only in whitespace."""
    rows = []
    for p in range(60):
        for k in range(1 + p % 4):
            text = f"Question {p}: what is   the answer?" if k == 2 else f"Question {p}: what is the answer?"
            if k == 3:
                text = f"  Question {p}:\nwhat is the answer? "
            rows.append({"prompt": user(text), "chosen": bot(f"Answer {p}."), "rejected": bot(f"Wrong {p} {k}.")})
    return rows


def write_probe_params(tmp_path: Path, size: int, seed: int) -> Path:
    """tmp_path/params.yaml: the repository's params with freeze_probe's `probe` section set."""
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["probe"] = {"size": size, "seed": seed}
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path
