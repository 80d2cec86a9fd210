"""One scoring position, everywhere (issue 17, item 1): the reward model trains, probes and exports the score
of the token transformers' AutoModelForSequenceClassification pools for the exported config with right
padding by the exported tokenizer's pad token: the last token whose id != pad_token_id.

Real GPT-2 tokenizer (../shared/data, skipped when absent) on real HH-RLHF pairs through the real tokenize
code, a tiny Qwen2 model built from a config, the real train_rm stage; the export is then batch-scored by
HF's own forward and must reproduce probe_final.jsonl. Tokenizer cases: pad == EOS, no pad token (the
trainer picks EOS and the export's tokenizer must carry it), a pad distinct from EOS, and a chat template
whose completion ends in a non-EOS token ("<|im_end|>\\n").
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_helpers import make_tiny_model_dir, token_row, toy_task_rows, write_token_parquet
from stages.lib.io import read_json, read_jsonl
from stages.engine.modeling import ModelLoadError, load_reward_model
from stages.engine.packing import TokenDataError, build_packed_batch, load_token_pairs
from stages.engine.export import ExportError, export_tokenizer_pad
from data_helpers import CHATML, UNLIMITED, gpt2_with_template, load_hh_pairs
from stages.data.pair_tokenizer import PairTokenizer
from stages.data.tokenizer import load_tokenizer
from stages.data.truncation import tokenize_pairs
from stage_helpers import stage_args, write_train_params as write_params

torch.set_num_threads(1)
GPT2_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
CASES = ("pad_is_eos", "no_pad", "pad_distinct", "chat_template")


def gpt2_variant(src: Path, dst: Path, case: str) -> Path:
    """The real GPT-2 tokenizer as each case needs it, saved in the reference directory `dst`."""
    from transformers import AutoTokenizer
    if case == "no_pad":                       # the files as released: no pad token
        dst.mkdir(parents=True)
        for name in GPT2_FILES:
            shutil.copy2(src / name, dst / name)
        return dst
    if case == "chat_template":                # no pad token either; completions end "<|im_end|>\n"
        return gpt2_with_template(src, dst, CHATML, ["<|im_start|>", "<|im_end|>"])
    tok = AutoTokenizer.from_pretrained(str(src))
    if case == "pad_is_eos":
        tok.pad_token = tok.eos_token          # the usual GPT-2 / Llama-3 / Qwen2.5-base set-up
    else:
        tok.add_special_tokens({"pad_token": "<|pad|>"})
    tok.save_pretrained(str(dst))
    return dst


def tiny_reference(model_dir: Path, tok) -> Path:
    """A tiny Qwen2 causal LM over the tokenizer's vocabulary, beside the tokenizer files in model_dir."""
    from transformers import AutoModelForCausalLM, Qwen2Config
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    return model_dir


def short_hh_pairs(hh_rlhf_path: Path, n: int) -> list[dict]:
    """n real HH pairs, short ones (the test stays fast)."""
    pairs = [p for p in load_hh_pairs(hh_rlhf_path, limit=200)
             if sum(len(m["content"]) for m in p["prompt"] + p["chosen"] + p["rejected"]) < 500]
    assert len(pairs) >= n, "not enough short HH-RLHF pairs"
    return pairs[:n]


def hh_token_rows(tok, hh_rlhf_path: Path, n: int) -> list[dict]:
    """n real HH pairs through the tokenize stage's own code."""
    result = tokenize_pairs(PairTokenizer(tok), short_hh_pairs(hh_rlhf_path, n), UNLIMITED, "train")
    assert result.rejections == [] and len(result.rows) == n
    return result.rows


@pytest.mark.parametrize("case", CASES)
def test_export_batch_scored_by_hf_reproduces_the_probe(case, tmp_path, gpt2_tokenizer_dir, hh_rlhf_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from stages import train_rm
    ref = gpt2_variant(gpt2_tokenizer_dir, tmp_path / "model", case)
    tiny_reference(ref, load_tokenizer(ref))
    # Loaded as tokenize loads the reference, its config.json beside it (transformers picks the tokenizer class by
    # the model type: Qwen2's pre-tokenizer here, which splits "OK!" otherwise than GPT-2's own class does).
    tok = load_tokenizer(ref)
    rows = hh_token_rows(tok, hh_rlhf_path, 20)
    write_token_parquet(tmp_path / "train.parquet", rows[:12])
    write_token_parquet(tmp_path / "probe.parquet", rows[12:])
    params = write_params(tmp_path / "p.yaml", train={"epochs": 1, "global_batch_pairs": 4, "micro_batch_tokens": 1024,
                                                      "inference_micro_batch_tokens": 512})
    info = train_rm.main(stage_args(tmp_path, "--out-dir", tmp_path / "rm", params))

    eos = tok.eos_token_id
    pad, source = {"pad_is_eos": (eos, "tokenizer pad_token"), "no_pad": (eos, "eos_token (no pad token)"),
                   "pad_distinct": (tok.convert_tokens_to_ids("<|pad|>"), "tokenizer pad_token"),
                   "chat_template": (eos, "eos_token (no pad token)")}[case]
    assert info["reward_scoring"] == {"position": "last_token_not_pad", "pad_token_id": pad,
                                      "pad_token_source": source, "eos_token_id": eos}
    assert read_json(tmp_path / "rm/run_info.json")["reward_scoring"] == info["reward_scoring"]
    seqs = [ids for r in rows[12:] for ids in (r["chosen_ids"], r["rejected_ids"])]
    last = {s[-1] for s in seqs}
    if case in ("pad_is_eos", "no_pad"):        # plain rendering ends on EOS == pad: the token before it is read
        assert last == {eos}
    elif case == "pad_distinct":                # ends on EOS, which is not padding: EOS itself is read
        assert last == {eos} and pad != eos
    else:                                       # "<|im_end|>" "\n": the newline is read, no EOS anywhere
        assert tok.convert_ids_to_tokens(sorted(last)) == ["Ċ"] and not any(eos in s for s in seqs)

    # The export, as a user loads it: its tokenizer pads with the pad id its config pools by, and its chat template
    # renders each probe conversation into exactly the token ids tokenize made (issue 28 item 5; plain GPT-2 had no
    # template at all, so a consumer such as RewardBench fell back to one of its own).
    export = tmp_path / "rm/model"
    hf_tok = AutoTokenizer.from_pretrained(str(export))
    model = AutoModelForSequenceClassification.from_pretrained(export, dtype=torch.float32).eval()
    assert hf_tok.pad_token_id == model.config.pad_token_id == pad
    assert hf_tok.padding_side == "right"
    probe_pairs = short_hh_pairs(hh_rlhf_path, 20)[12:]
    rendered = [hf_tok.apply_chat_template(p["prompt"] + p[branch], tokenize=True, return_dict=False)
                for p in probe_pairs for branch in ("chosen", "rejected")]
    assert rendered == [list(map(int, s)) for s in seqs]
    for p, r in zip(probe_pairs, rows[12:]):
        assert hf_tok.apply_chat_template(p["prompt"], add_generation_prompt=True, tokenize=True,
                                          return_dict=False) == list(r["chosen_ids"][:r["chosen_prompt_len"]])
    batch = hf_tok.pad({"input_ids": rendered}, padding=True, return_tensors="pt")
    assert (batch["input_ids"] == pad).any()                  # some rows really are padded
    with torch.no_grad():
        got = model(**batch).logits[:, 0].view(-1, 2).double().numpy()
    final = read_jsonl(tmp_path / "rm/probe_final.jsonl")
    want = np.array([[r["chosen_score"], r["rejected_score"]] for r in final])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)

    if case == "pad_is_eos":
        # The old position (the trailing EOS) gives another score: the check above would have caught it.
        model.config.pad_token_id = None                      # one unpadded sequence: HF then reads the last token
        with torch.no_grad():
            at_eos = float(model(input_ids=torch.tensor([seqs[0]])).logits[0, 0])
        assert abs(at_eos - want[0, 0]) > 1e-4


def test_score_positions_skip_trailing_pads_in_both_layouts(tmp_path):
    pad = 2
    rows = [token_row("a", [5, 6, 7, 8, pad], 2, [5, 6, 9, pad, pad], 2),      # trailing pads are skipped
            token_row("b", [5, 6, pad, 10], 2, [5, 6, 11, 12], 2)]             # a pad before the end counts not
    pairs = load_token_pairs(write_token_parquet(tmp_path / "t.parquet", rows)).with_score_positions(pad)
    assert pairs.score_index.tolist() == [3, 2, 3, 3]
    for share_prompt in (False, True):
        batch = build_packed_batch(pairs, [1, 0], share_prompt=share_prompt)
        assert batch.input_ids[0, batch.last_positions].tolist() == [10, 12, 8, 9]


def test_a_completion_of_only_pad_tokens_is_refused_naming_the_pair(tmp_path):
    from stages import train_rm
    make_tiny_model_dir(tmp_path / "model")                   # eos 2, no pad, no tokenizer: pad = EOS = 2
    write_token_parquet(tmp_path / "train.parquet", toy_task_rows(8, seed=1))
    probe = toy_task_rows(3, seed=2, prefix="q")
    probe[1] = token_row("q_only_eos", probe[1]["chosen_ids"], probe[1]["chosen_prompt_len"],
                         probe[1]["rejected_ids"][:probe[1]["rejected_prompt_len"]] + [2, 2],
                         probe[1]["rejected_prompt_len"])
    write_token_parquet(tmp_path / "probe.parquet", probe)
    # 2 steps: one batch of all 8 pairs would be a single step at lr 0, which the plan check refuses first
    params = write_params(tmp_path / "p.yaml", train={"epochs": 1, "global_batch_pairs": 4})
    with pytest.raises(SystemExit, match=r"train_rm: refused: .*probe\.parquet: row 1 \(pair q_only_eos\) rejected: "
                                         r"every completion token is the pad token 2") as e:
        train_rm.main(stage_args(tmp_path, "--out-dir", tmp_path / "rm", params))
    assert e.value.code == 1 and isinstance(e.value.__cause__, TokenDataError)
    assert not (tmp_path / "rm/model").exists()


def test_no_pad_and_no_eos_is_refused(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    config.update(eos_token_id=None, pad_token_id=None)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="no pad token and no EOS token"):
        load_reward_model(model_dir)


def test_export_refuses_a_tokenizer_padding_with_another_id(tmp_path, gpt2_tokenizer_dir):
    export = gpt2_variant(gpt2_tokenizer_dir, tmp_path / "export", "pad_distinct")
    with pytest.raises(ExportError, match="tokenizer pads with id 50257"):
        export_tokenizer_pad(export, 50256)
    export_tokenizer_pad(export, 50257)                       # agrees: nothing to change
