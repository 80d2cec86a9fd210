"""A small real workspace for the generate and judge stages: a pinned tiny reference (the embedded tiny-qwen2, or
the real GPT-2 tokenizer over a tiny Qwen2), its identity from verify_ref, probe prompts tokenized by tokenize's
own code, a policy (the reference's weights perturbed) and a judge (a 1-label sequence classifier), each with the
reference's tokenizer files."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pyarrow as pa
import torch
import yaml

from conftest import EMBEDDED_REF, REPO_ROOT
from engine_helpers import write_token_parquet
from stages import verify_ref
from data_helpers import UNLIMITED
from stages.data.pair_tokenizer import PairTokenizer
from stages.data.tokenizer import load_tokenizer
from stages.data.truncation import tokenize_pairs
from stages.lib.contracts import TOKENIZER_FILES
from stages.lib.io import write_parquet

QUESTIONS = ["What colour is a plum?", "Name a fruit that is yellow.", "Is the sky green?", "Say hi.",
             "What colour is grass in summer?", "Which is darker, navy or sky blue?"]


def probe_pairs() -> list[dict]:
    pairs = []
    for i, q in enumerate(QUESTIONS):
        prompt = [{"role": "user", "content": q}]
        if i % 3 == 2:                         # a multi-turn prompt too
            prompt = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."}] + prompt
        pairs.append({"pair_id": hashlib.sha256(q.encode()).hexdigest()[:24], "prompt": prompt,
                      "chosen": [{"role": "assistant", "content": f"A good answer {i}."}],
                      "rejected": [{"role": "assistant", "content": f"bad {i}"}]})
    return pairs


def copy_tokenizer(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in (*TOKENIZER_FILES, "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)


def make_policy(ref: Path, dst: Path, scale: float = 0.05) -> Path:
    """The reference's weights plus seeded noise: a causal LM that writes other completions."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    model.save_pretrained(dst)
    copy_tokenizer(ref, dst)
    return dst


def make_judge(ref: Path, dst: Path, num_labels: int = 1) -> Path:
    """A sequence-classification model over the reference's config, its head seeded (a stand-in reward model)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification
    config = AutoConfig.from_pretrained(ref, num_labels=num_labels)
    tok = load_tokenizer(ref)
    config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    torch.manual_seed(5)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(dst)
    copy_tokenizer(ref, dst)
    return dst


def make_workspace(root: Path, reference: Path = EMBEDDED_REF, **generation) -> dict[str, Path]:
    """Everything generate and judge read, under `root`; generation: params overrides."""
    ref = root / "ref"
    shutil.copytree(reference, ref, ignore=shutil.ignore_patterns("prefpipe.lock.json"))
    revision = verify_ref.pin(ref, repo_id="test/tiny")
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["ref"] = {"source": "local", "repo_id": "test/tiny", "revision": revision, "local_dir": str(ref)}
    params["generation"].update({"max_new_tokens": 6, "n": 2, "temperature": 1.0, "top_p": 0.9, "batch_size": 4,
                                 **generation})
    params["evaluate"]["bootstrap_replicates"] = 500
    ws = {"root": root, "ref": ref, "params": root / "params.yaml", "identity": root / "ref_identity.json",
          "probe": root / "probe.parquet", "probe_tokens": root / "probe_tokens.parquet"}
    write_params(ws, params)
    assert verify_ref.main(["verify", "--params", str(ws["params"]), "--identity", str(ws["identity"])]) == 0
    pairs = probe_pairs()
    tok = load_tokenizer(ref)
    result = tokenize_pairs(PairTokenizer(tok), pairs, UNLIMITED, "probe")
    assert result.rejections == [] and len(result.rows) == len(pairs)
    write_token_parquet(ws["probe_tokens"], result.rows)
    write_parquet(ws["probe"], pa.Table.from_pylist([{"pair_id": p["pair_id"], "prompt": p["prompt"]} for p in pairs]))
    ws["policy"] = make_policy(ref, root / "policy")
    ws["judge"] = make_judge(ref, root / "judge")
    return ws


def write_params(ws: dict, params: dict) -> None:
    ws["params"].write_text(yaml.safe_dump(params, sort_keys=False))


def generate_args(ws: dict, out: Path, policy: Path | None = None) -> list[str]:
    return ["--params", str(ws["params"]), "--identity", str(ws["identity"]),
            "--policy-model", str(policy or ws["policy"]), "--probe", str(ws["probe"]),
            "--probe-tokens", str(ws["probe_tokens"]), "--generations", str(out / "generations.parquet"),
            "--info", str(out / "generation_info.json")]


def judge_args(ws: dict, generations: Path, out: Path, judge: Path | None = None) -> list[str]:
    return ["--params", str(ws["params"]), "--identity", str(ws["identity"]), "--judge-model",
            str(judge or ws["judge"]), "--generations", str(generations), "--judgments", str(out / "judgments.jsonl"),
            "--metrics", str(out / "generation.json"), "--summary", str(out / "judge_summary.json")]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
