"""The sft stage (issue 33): completion-only SFT on real HH-RLHF rows rendered by the real GPT-2 tokenizer, trained
by the engine under a real torchrun on CPU: 2 processes equal to 1 within fp32 tolerance, with LoRA, a SIGKILL mid-run
resumed bit for bit; probe prompts refused; the export pinned and re-checked before each load; bad rows refused with
their file, row and reason."""
from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch
import yaml

from conftest import REPO_ROOT
from engine_helpers import make_tiny_model_dir, random_rows, write_token_parquet
from stages.data.formats import parse_row
from stages.data.messages import RowRejected
from stages.data.sft_sources import SFTDataError, Refusals, parse_sft_row, read_sft_sources
from stages.lib.contracts import prompt_key
from stages.lib.io import read_json, read_jsonl, write_parquet
from stages.lib.reference import RefIdentityError, load_verified_dir, lock_provenance
from stage_helpers import assert_identical_runs, assert_same_training, torchrun

torch.set_num_threads(1)

N_ROWS = 40            # HH rows turned into SFT rows
N_PROBE = 4            # of them, prompts that are also probe prompts (never trained on)


@pytest.fixture
def hh_sft(tmp_path, hh_rlhf_path, gpt2_tokenizer_dir):
    """A tiny Qwen2 on GPT-2's vocabulary with GPT-2's tokenizer beside it; SFT rows from real HH pairs (the chosen
    conversation, `messages` format); a probe whose first N_PROBE prompts are SFT rows' prompts."""
    from transformers import AutoTokenizer
    model = make_tiny_model_dir(tmp_path / "model", vocab=50257, hidden=16)
    for f in gpt2_tokenizer_dir.iterdir():
        shutil.copy(f, model / f.name)
    tok = AutoTokenizer.from_pretrained(model)
    rows, probe_prompts = [], []
    with gzip.open(hh_rlhf_path, "rt", encoding="utf-8") as f:
        for line in f:
            try:
                pair = parse_row(json.loads(line), "hh")
            except RowRejected:
                continue
            text = "".join(m["content"] for m in pair.prompt + pair.chosen)
            if len(tok(text)["input_ids"]) > 90:
                continue
            rows.append({"messages": pair.prompt + pair.chosen})
            if len(probe_prompts) < N_PROBE:
                probe_prompts.append(pair.prompt)
            if len(rows) == N_ROWS:
                break
    src = tmp_path / "sft.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_parquet(tmp_path / "probe.parquet", pa.table({"prompt": [json.loads(json.dumps(p)) for p in probe_prompts]}))
    write_token_parquet(tmp_path / "probe_tokens.parquet", random_rows(12, seed=3, vocab=50257, prefix="q"))
    return tmp_path


def sft_params(path: Path, src: Path, train: dict | None = None, sources=None) -> Path:
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["train"].update({"gpus": 0, "epochs": 2, "global_batch_pairs": 8, "micro_batch_tokens": 256,
                            "inference_micro_batch_tokens": 512, "lr": 3e-3, "warmup_ratio": 0.1,
                            "logp_chunk_tokens": 64, "seed": 5})
    params["tokenize"].update({"max_length": 128, "max_prompt_length": 112})
    params["sft"] = {"sources": sources if sources is not None else [{"name": "hh", "path": str(src),
                                                                      "format": "messages"}],
                     "train": train or {}}
    path.write_text(yaml.safe_dump(params))
    return path


def sft_args(a: Path, out: str, params: Path, extra: list[str] | None = None) -> list[str]:
    return ["--params", str(params), "--model-dir", str(a / "model"), "--probe-tokens", str(a / "probe_tokens.parquet"),
            "--probe", str(a / "probe.parquet"), "--out-dir", str(a / out), "--log", str(a / f"{out}.log"),
            "--perf", str(a / f"{out}.perf.json"), *(extra or [])]


@pytest.mark.slow
def test_sft_on_hh_with_gpt2_two_processes_equal_one(hh_sft):
    params = sft_params(hh_sft / "p.yaml", hh_sft / "sft.jsonl")
    torchrun(1, "stages.sft", sft_args(hh_sft, "dp1", params))
    torchrun(2, "stages.sft", sft_args(hh_sft, "dp2", params))
    assert_same_training(hh_sft / "dp1", hh_sft / "dp2", atol=2e-5)

    data = read_json(hh_sft / "dp1/sft_data.json")
    # the probe's prompts never reach SFT: exactly the rows that share one are refused, by name
    assert data["refused"]["by_reason"] == {"probe_prompt": N_PROBE}
    assert data["examples"] == N_ROWS - N_PROBE
    info = read_json(hh_sft / "dp1/run_info.json")
    assert (info["objective"], info["train_pairs"], info["world_size"]) == ("sft", N_ROWS - N_PROBE, 1)
    assert read_json(hh_sft / "dp2/run_info.json")["world_size"] == 2
    log = pd.read_csv(hh_sft / "dp1/train_log.csv")
    assert log.loss.iloc[-1] < log.loss.iloc[0]            # it learns the completions
    # the model is what the probe rows say it is: its completion log-probs moved from step 0
    step0, final = read_jsonl(hh_sft / "dp1/probe_step0.jsonl"), read_jsonl(hh_sft / "dp1/probe_final.jsonl")
    assert [r["pair_id"] for r in step0] == [r["pair_id"] for r in final]
    assert any(a["chosen_logp"] != b["chosen_logp"] for a, b in zip(step0, final))


@pytest.mark.slow
def test_sft_export_is_pinned_and_rechecked_before_each_load(hh_sft, monkeypatch):
    monkeypatch.setenv("PREFPIPE_HASH_CACHE", "off")
    params = sft_params(hh_sft / "p.yaml", hh_sft / "sft.jsonl", train={"epochs": 1})
    torchrun(1, "stages.sft", sft_args(hh_sft, "run", params))
    identity = read_json(hh_sft / "run/ref_identity.json")
    model = hh_sft / "run/model"
    assert Path(identity["local_dir"]) == model and identity["revision_pinned"]
    assert load_verified_dir(hh_sft / "run/ref_identity.json") == model.resolve()
    prov = lock_provenance(hh_sft / "run/ref_identity.json")
    data = read_json(hh_sft / "run/sft_data.json")
    assert prov["data_digest"] == data["data_digest"] and prov["base"] == {"model_dir": str(hh_sft / "model")}
    assert data["identity_digest"] == identity["identity_digest"]
    # the export is what DPO, the RM and generation start from: a changed weight is refused before any load
    weights = model / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1
    weights.write_bytes(bytes(raw))
    with pytest.raises(RefIdentityError, match="content differs"):
        load_verified_dir(hh_sft / "run/ref_identity.json")


@pytest.mark.slow
def test_sft_with_lora_on_hh(hh_sft):
    params = sft_params(hh_sft / "p.yaml", hh_sft / "sft.jsonl",
                        train={"adapter": {"type": "lora", "r": 4, "alpha": 8}, "lr": 2e-2})
    torchrun(1, "stages.sft", sft_args(hh_sft, "lora", params))
    info = read_json(hh_sft / "lora/run_info.json")
    assert info["objective"] == "sft" and info["adapter"]["type"] == "lora"
    assert info["settings"]["adapter"]["r"] == 4
    log = pd.read_csv(hh_sft / "lora/train_log.csv")
    assert log.loss.iloc[-1] < log.loss.iloc[0]
    # merged export: loadable as a plain causal LM, with weights other than the base's
    from safetensors.torch import load_file
    base, tuned = load_file(hh_sft / "model/model.safetensors"), load_file(hh_sft / "lora/model/model.safetensors")
    assert sorted(base) == sorted(tuned)
    assert any(not torch.equal(base[k], tuned[k]) for k in base)


@pytest.mark.slow
def test_sigkill_mid_sft_then_resume_equals_uninterrupted_bitwise(hh_sft):
    import importlib.util                    # the real-SIGKILL helpers of tests/engine/test_checkpoint.py
    spec = importlib.util.spec_from_file_location("ckpt_helpers", REPO_ROOT / "tests/engine/test_checkpoint.py")
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    complete_steps, finish, kill_when, launch = helpers.complete_steps, helpers.finish, helpers.kill_when, helpers.launch
    params = sft_params(hh_sft / "p.yaml", hh_sft / "sft.jsonl", train={"save_every": 2})
    finish(launch(1, "stages.sft", sft_args(hh_sft, "full", params, ["--checkpoint-dir", str(hh_sft / "ck_full")])))
    ck = hh_sft / "ck"
    run = sft_args(hh_sft, "run", params, ["--checkpoint-dir", str(ck)])
    kill_when(launch(1, "stages.sft", run, hook="after_save:4"), lambda: 4 in complete_steps(ck))
    assert not (hh_sft / "run/probe_final.jsonl").exists()
    err = finish(launch(1, "stages.sft", run))
    assert "resuming from" in err
    assert read_json(hh_sft / "run.perf.json")["resumed_from_step"] == 4
    assert_identical_runs(hh_sft / "full", hh_sft / "run", same_record=True)
    assert (hh_sft / "full/model/prefpipe.lock.json").read_bytes() == (hh_sft / "run/model/prefpipe.lock.json").read_bytes()


# ----------------------------------------------------------------------------------------------
# The data side: formats, reason codes, leakage
# ----------------------------------------------------------------------------------------------

def test_sft_formats_parse_to_prompt_and_completion():
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    want = (conv[:1], conv[1:])
    assert parse_sft_row({"messages": conv}, "messages") == want
    assert parse_sft_row({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]},
                         "conversations") == want
    assert parse_sft_row({"prompt": "Hi", "completion": "Hello."}, "prompt_completion") == want
    assert parse_sft_row({"prompt": "Hi", "completion": "Hello."}, "auto") == want
    sys_conv = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}], "system": "S"}
    assert parse_sft_row(sys_conv, "auto")[0][0] == {"role": "system", "content": "S"}


@pytest.mark.parametrize("row,reason", [
    ({"messages": [{"role": "user", "content": "Hi"}]}, "empty_prompt"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Again"}]}, "role"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  "}]}, "empty_completion"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": 3}]}, "content_type"),
    ({"messages": "Hi"}, "schema"),
    ({"question": "Hi", "answer": "Yes"}, "schema"),
    ({"conversations": [{"from": "bot", "value": "x"}, {"from": "gpt", "value": "y"}]}, "role"),
])
def test_bad_sft_rows_get_a_reason_code(row, reason):
    with pytest.raises(RowRejected) as e:
        parse_sft_row(row, "auto")
    assert e.value.reason == reason


def test_sft_sources_refuse_probe_prompts_repeats_and_bad_rows_by_file_and_row(tmp_path):
    good = {"messages": [{"role": "user", "content": "What colour is snow?"}, {"role": "assistant", "content": "White."}]}
    probe = {"messages": [{"role": "user", "content": "What  colour is coal?"},
                          {"role": "assistant", "content": "Black."}]}
    src = tmp_path / "s.jsonl"
    src.write_text("\n".join([json.dumps(good), json.dumps(good), "{not json", json.dumps(probe),
                              json.dumps({"messages": [{"role": "user", "content": "x"}]})]) + "\n")
    refusals = Refusals()
    probe_keys = {prompt_key([{"role": "user", "content": "What colour is coal?"}])}   # whitespace-normalized
    out = read_sft_sources([{"path": str(src), "format": "messages"}], probe_keys, refusals)
    assert [(e.src_row, e.completion[0]["content"]) for e in out] == [(0, "White.")]
    rec = refusals.record()
    assert rec["by_reason"] == {"duplicate": 1, "json": 1, "probe_prompt": 1, "empty_prompt": 1}
    assert rec["examples"]["json"][0]["detail"].startswith(f"{src} row 2: invalid JSON")
    assert rec["examples"]["probe_prompt"][0]["row"] == 3


def test_an_sft_source_of_another_format_or_without_files_is_refused_by_name(tmp_path):
    with pytest.raises(SFTDataError, match=r"sft.sources\[0\] \(x\): format 'trl' is not an SFT format"):
        read_sft_sources([{"name": "x", "path": str(tmp_path), "format": "trl"}], set(), Refusals())
    with pytest.raises(SFTDataError, match=r"sft.sources\[0\] \(y\): .*no such file"):
        read_sft_sources([{"name": "y", "path": str(tmp_path / "none.jsonl"), "format": "messages"}], set(), Refusals())


def test_sft_token_pairs_score_the_completion_only():
    from stages.engine.sft_objective import sft_token_pairs
    pairs = sft_token_pairs("t", ["a", "b"], [[5, 6, 7, 8], [5, 9]], [2, 1])
    assert [s.tolist() for s in pairs.seq_ids] == [[5, 6, 7, 8], [5, 6, 7], [5, 9], [5, 9]]
    assert pairs.seq_prompt_lens.tolist() == [2, 2, 1, 1]
    assert (pairs.seq_lens - pairs.seq_prompt_lens).tolist() == [2, 1, 1, 1]
    with pytest.raises(ValueError, match="example 0 \\(a\\): prompt length 4 leaves no completion"):
        sft_token_pairs("t", ["a"], [[5, 6, 7, 8]], [4])


def test_sft_loss_is_the_completion_nll_per_token_and_ignores_the_placeholder(tmp_path):
    """The objective's loss on a real model equals an independent computation: mean over completion tokens of
    -log p(token | prefix), from the model's logits, per example."""
    from stages.engine.packing import build_packed_batch
    from stages.engine.sft_objective import SFTObjective, sft_token_pairs
    from stages.engine.settings import TrainSettings
    model_dir = make_tiny_model_dir(tmp_path / "m", vocab=64)
    seqs, plens = [[3, 4, 5, 6, 7], [8, 9, 10, 11]], [2, 3]
    pairs = sft_token_pairs("t", ["a", "b"], seqs, plens)
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["train"].update({"gpus": 0})
    settings = TrainSettings.from_params(params)
    obj = SFTObjective()
    module = obj.build_module(model_dir, settings).eval()
    batch = build_packed_batch(pairs, [0, 1], share_prompt=False)
    with torch.no_grad():
        losses, _ = obj.pair_terms(module(**_inputs(batch)), batch, "train")
        from transformers import AutoModelForCausalLM
        lm = AutoModelForCausalLM.from_pretrained(model_dir).double().eval()     # plain transformers, independent
        want = []
        for s, n in zip(seqs, plens):
            logp = torch.log_softmax(lm(torch.tensor([s])).logits[0], -1)
            want.append(-np.mean([logp[t - 1, s[t]].item() for t in range(n, len(s))]))
    np.testing.assert_allclose(losses.double().numpy(), want, rtol=1e-5)


def _inputs(batch):
    from stages.engine.data import model_inputs
    return model_inputs(batch)
