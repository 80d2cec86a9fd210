"""tokenize.chat_template (issue 37, item 2): "A tokenizer without one (GPT-2) renders 'plain', said in one INFO line.
Give it a setting (the tokenizer's, a named built-in such as chatml, or a Jinja file, recorded by hash), warn on the
fallback, and let the exports carry what was used."

The user's steps, on real components: the real GPT-2 tokenizer (../shared/data, skipped when absent) pinned as a local
reference, the `python -m stages.tokenize` command line as the rule runs it, real HH pairs, the real train_rm stage
on a tiny model, and the export loaded with transformers' AutoTokenizer.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from data_helpers import REPO_ROOT, UNLIMITED, load_hh_pairs, pinned_gpt2_identity, write_probe_inputs
from stages.data.chat_templates import CHATML, resolve_chat_template, template_input
from stages.data.limits import TokenizeError
from stages.data.pair_tokenizer import pair_tokenizer_for
from stages.data.tokenizer import load_tokenizer
from stages.data.truncation import tokenize_pairs
from stages.lib.io import read_json

# A template of the user's own (Llama-2-like tags): not a built-in, so only the file can have rendered it.
USER_TEMPLATE = ("{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")


@pytest.fixture
def hh_split(hh_pairs):
    """(train, probe): 40 short real HH pairs, 10 of them the probe."""
    pairs = [dict(p, margin=None) for p in hh_pairs
             if sum(len(m["content"]) for m in p["prompt"] + p["chosen"] + p["rejected"]) < 600][:40]
    assert len(pairs) == 40
    return sorted(pairs[:30], key=lambda p: p["pair_id"]), pairs[30:]


def run_tokenize(tmp_path: Path, identity: Path, split, **tokenize) -> tuple[subprocess.CompletedProcess, Path]:
    """`python -m stages.tokenize` with params.yaml's tokenize section updated by `tokenize`."""
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["tokenize"].update({"max_length": 1024, "max_prompt_length": 512, "truncation": "reject", **tokenize})
    if tokenize.get("chat_template") is None:
        params["tokenize"].pop("chat_template", None)       # a params.yaml of before the setting: the default
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    train, probe = split
    inputs = write_probe_inputs(tmp_path / "in", train, probe)
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([sys.executable, "-m", "stages.tokenize", "--params", str(tmp_path / "params.yaml"),
                        "--identity", str(identity), "--train", inputs["train_path"], "--probe", inputs["probe_path"],
                        "--probe-manifest", inputs["manifest_path"],
                        "--train-tokens", str(out / "train_tokens.parquet"),
                        "--probe-tokens", str(out / "probe_tokens.parquet"),
                        "--probe-token-manifest", str(out / "probe_token_manifest.json"),
                        "--report", str(out / "tokenize_report.json"),
                        "--rejections", str(out / "token_rejections.parquet"), "--log", str(out / "tokenize.log")],
                       cwd=REPO_ROOT, capture_output=True, text=True)
    return r, out


def test_a_tokenizer_without_a_template_is_a_warning_in_the_log_the_report_and_the_summary(
        gpt2_tokenizer_dir, hh_split, tmp_path):
    from stages.evidence.bundle import render_summary

    identity = pinned_gpt2_identity(gpt2_tokenizer_dir, tmp_path)
    for setting in (None, "tokenizer"):             # absent (the default) and asked for by name: the same
        r, out = run_tokenize(tmp_path / str(setting), identity, hh_split, chat_template=setting)
        assert r.returncode == 0, r.stderr[-3000:]
        log = (out / "tokenize.log").read_text()
        warned = [line for line in log.splitlines() if "WARNING" in line and "no chat template" in line]
        assert len(warned) == 1, log
        report = read_json(out / "tokenize_report.json")
        assert report["rendering"] == "plain"
        assert report["chat_template"] == {"setting": "tokenizer", "used": "plain", "sha256": None}
        assert [w for w in report["warnings"] if "has no chat template" in w and "tokenize.chat_template" in w]
        summary = render_summary({}, None, [], yaml.safe_load((tmp_path / str(setting) / "params.yaml").read_text()),
                                 records={"tokenize_report": report})
        warnings = summary[summary.index("## Warnings"):]
        assert "- tokenize: tokenize.chat_template is `tokenizer` but the tokenizer" in warnings

    # Chosen on purpose: the same bytes, no warning.
    r, out = run_tokenize(tmp_path / "plain", identity, hh_split, chat_template="plain")
    assert r.returncode == 0, r.stderr[-3000:]
    assert read_json(out / "tokenize_report.json")["warnings"] == []
    assert "WARNING" not in (out / "tokenize.log").read_text()
    assert (out / "train_tokens.parquet").read_bytes() == (tmp_path / "None/out/train_tokens.parquet").read_bytes()


def test_chatml_and_a_jinja_file_render_the_pairs_and_are_recorded_by_hash(gpt2_tokenizer_dir, hh_split, tmp_path):
    identity = pinned_gpt2_identity(gpt2_tokenizer_dir, tmp_path)
    tok = load_tokenizer(gpt2_tokenizer_dir)
    template_file = tmp_path / "my_template.jinja"
    template_file.write_text(USER_TEMPLATE)
    for setting, text, first in (("chatml", CHATML, "<|im_start|>user\n"), (str(template_file), USER_TEMPLATE,
                                                                            "[USER] ")):
        r, out = run_tokenize(tmp_path / f"run_{Path(setting).stem}", identity, hh_split, chat_template=setting)
        assert r.returncode == 0, r.stderr[-3000:]
        report = read_json(out / "tokenize_report.json")
        assert report["rendering"] == "chat_template" and report["warnings"] == []
        assert report["chat_template"] == {"setting": setting, "used": setting,
                                           "sha256": hashlib.sha256(text.encode()).hexdigest()}
        assert f"chat template: {setting}" in (out / "tokenize.log").read_text()
        import pyarrow.parquet as pq
        row = pq.read_table(out / "probe_tokens.parquet").to_pylist()[0]
        assert tok.decode(row["chosen_ids"][:row["chosen_prompt_len"]]).startswith(first)
    # The file is an input of the stages that render (the rules take template_input): editing it reruns them.
    assert template_input({"chat_template": str(template_file)}) == [str(template_file)]
    assert template_input({"chat_template": "chatml"}) == template_input({}) == []


def test_a_bad_setting_is_refused_naming_the_key_or_the_file(gpt2_tokenizer_dir, hh_split, tmp_path):
    identity = pinned_gpt2_identity(gpt2_tokenizer_dir, tmp_path)
    r, out = run_tokenize(tmp_path / "missing", identity, hh_split, chat_template="templates/chatlm.jinja")
    assert r.returncode == 1
    assert ("tokenize: refused: params.yaml tokenize.chat_template: 'templates/chatlm.jinja' is neither one of "
            "tokenizer, chatml, plain nor a file (no such file)") in r.stderr
    assert not (out / "train_tokens.parquet").exists()
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }}")
    with pytest.raises(TokenizeError, match=f"{broken} \\(tokenize.chat_template\\): not a Jinja template: line 1"):
        resolve_chat_template(str(broken), load_tokenizer(gpt2_tokenizer_dir))
    no_generation_prompt = tmp_path / "nogen.jinja"
    no_generation_prompt.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    with pytest.raises(TokenizeError, match="nogen.jinja\\) ignores add_generation_prompt"):
        pair_tokenizer_for(load_tokenizer(gpt2_tokenizer_dir), {"chat_template": str(no_generation_prompt)})


@pytest.mark.parametrize("setting", ["chatml", "file"])
def test_the_export_carries_the_template_tokenize_used(setting, gpt2_tokenizer_dir, hh_rlhf_path, tmp_path):
    """A user's apply_chat_template on the exported reward model renders the probe pairs into exactly the token ids
    tokenize made under tokenize.chat_template (before the setting the export carried the plain tags GPT-2 fell
    back to, whatever was asked)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from engine_helpers import write_token_parquet
    from stage_helpers import stage_args, write_train_params
    from stages import train_rm

    if setting == "file":
        setting = str(tmp_path / "my_template.jinja")
        Path(setting).write_text(USER_TEMPLATE)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy2(gpt2_tokenizer_dir / name, model_dir / name)
    tok = load_tokenizer(model_dir)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)

    pairs = [p for p in load_hh_pairs(hh_rlhf_path, limit=200)
             if sum(len(m["content"]) for m in p["prompt"] + p["chosen"] + p["rejected"]) < 500][:16]
    result = tokenize_pairs(pair_tokenizer_for(tok, {"chat_template": setting}), pairs, UNLIMITED, "train")
    assert result.rejections == [] and len(result.rows) == 16
    write_token_parquet(tmp_path / "train.parquet", result.rows[:12])
    write_token_parquet(tmp_path / "probe.parquet", result.rows[12:])
    params = write_train_params(tmp_path / "p.yaml", train={"epochs": 1, "global_batch_pairs": 4,
                                                            "micro_batch_tokens": 1024,
                                                            "inference_micro_batch_tokens": 512})
    doc = yaml.safe_load(params.read_text())
    doc["tokenize"]["chat_template"] = setting
    params.write_text(yaml.safe_dump(doc))
    train_rm.main(stage_args(tmp_path, "--out-dir", tmp_path / "rm", params))

    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path / "rm/model"))
    for p, row in zip(pairs[12:], result.rows[12:]):
        for branch in ("chosen", "rejected"):
            assert hf_tok.apply_chat_template(p["prompt"] + p[branch], tokenize=True,
                                              return_dict=False) == list(row[f"{branch}_ids"])
        assert hf_tok.apply_chat_template(p["prompt"], add_generation_prompt=True, tokenize=True,
                                          return_dict=False) == list(row["chosen_ids"][:row["chosen_prompt_len"]])


def test_a_probe_frozen_under_another_template_is_refused_by_tokenize(tmp_path):
    """freeze_probe draws the probe from pairs that fit under the rendering; tokenize holds a probe frozen under
    another tokenize.chat_template to it (the manifest's fit records a setting other than the default; the
    default's manifest has no such key, as before)."""
    from data_helpers import embedded_identity, leaky_rows, pairs_table, write_probe_params
    from stages.lib.io import write_parquet

    identity = embedded_identity(tmp_path)
    pairs = tmp_path / "pairs.parquet"
    write_parquet(pairs, pairs_table(leaky_rows()))

    def stage(module: str, setting: str | None, out: Path, *args: str) -> subprocess.CompletedProcess:
        params = write_probe_params(tmp_path, size=10, seed=3)
        doc = yaml.safe_load(params.read_text())
        if setting is None:
            doc["tokenize"].pop("chat_template")
        else:
            doc["tokenize"]["chat_template"] = setting
        params.write_text(yaml.safe_dump(doc))
        out.mkdir(parents=True, exist_ok=True)
        return subprocess.run([sys.executable, "-m", module, "--params", str(params), "--identity", str(identity),
                               *args, "--log", str(out / f"{module}.log")], cwd=REPO_ROOT, capture_output=True,
                              text=True)

    def freeze(setting, out: Path) -> None:
        r = stage("stages.freeze_probe", setting, out, "--pairs", str(pairs), "--train", str(out / "train.parquet"),
                  "--probe", str(out / "probe.parquet"), "--manifest", str(out / "probe_manifest.json"))
        assert r.returncode == 0, r.stderr[-3000:]

    def tokenize(setting, frozen: Path, out: Path) -> subprocess.CompletedProcess:
        return stage("stages.tokenize", setting, out, "--train", str(frozen / "train.parquet"),
                     "--probe", str(frozen / "probe.parquet"), "--probe-manifest", str(frozen / "probe_manifest.json"),
                     "--train-tokens", str(out / "t.parquet"), "--probe-tokens", str(out / "p.parquet"),
                     "--probe-token-manifest", str(out / "m.json"), "--report", str(out / "r.json"),
                     "--rejections", str(out / "j.parquet"))

    freeze("tokenizer", tmp_path / "default")
    freeze(None, tmp_path / "absent")
    assert read_json(tmp_path / "default/probe_manifest.json")["fit"]["chat_template"]["setting"] == "tokenizer"
    assert (tmp_path / "default/probe_manifest.json").read_bytes() == \
        (tmp_path / "absent/probe_manifest.json").read_bytes()
    freeze("plain", tmp_path / "plain")
    assert read_json(tmp_path / "plain/probe_manifest.json")["fit"]["chat_template"] == \
        {"setting": "plain", "used": "plain", "sha256": None}

    r = tokenize("tokenizer", tmp_path / "plain", tmp_path / "tok_mismatch")
    assert r.returncode == 1
    assert ("the probe was frozen to fit the rendering {\"setting\":\"plain\",\"sha256\":null,\"used\":\"plain\"}, "
            "but tokenize renders with {\"setting\":\"tokenizer\",") in r.stderr, r.stderr
    assert tokenize("plain", tmp_path / "plain", tmp_path / "tok_plain").returncode == 0
    assert tokenize("tokenizer", tmp_path / "default", tmp_path / "tok_default").returncode == 0
