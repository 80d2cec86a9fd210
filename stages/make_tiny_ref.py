"""make_tiny_ref: build the embedded default reference model (tokenizer + tiny Qwen2), then pin it.

    python -m stages.make_tiny_ref --data data/embedded/color_facts_prefs.jsonl.gz --out models/tiny-qwen2

The default pipeline must verify and load a real snapshot on a fresh clone, without the network and
without copying third-party tokenizer files in. So the project makes its own: a byte-level BPE
tokenizer trained with `tokenizers` on the texts of the embedded dataset, saved as a transformers
fast tokenizer with a ChatML-style chat template (so tokenize takes the chat-template path), and a
randomly initialised Qwen2ForCausalLM (seeded) saved as safetensors. The directory is then pinned with
`stages.verify_ref pin` (DIR/prefpipe.lock.json); the SHA-256 printed at the end is the value for
`ref.revision` in params.yaml.

Byte-deterministic: the same data gives identical files (BPE training is single-threaded here, the
weights come from a seeded CPU generator, every JSON is written with sorted keys). The output is
built in a temporary sibling and renamed into place, so a failed build never leaves a half model.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

# Single-threaded BPE training: the merge order must not depend on thread scheduling.
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("RAYON_NUM_THREADS", "1")

from stages import verify_ref  # noqa: E402
from stages.lib.cli import stage_main  # noqa: E402
from stages.lib.io import write_json  # noqa: E402

# ========================================================================================== settings

REPO_ID = "embedded/tiny-qwen2"
VOCAB_SIZE = 1536
SEED = 20261202

BOS, EOS, PAD = "<|startoftext|>", "<|im_end|>", "<|endoftext|>"
IM_START = "<|im_start|>"
SPECIAL_TOKENS = [PAD, BOS, IM_START, EOS]  # ids 0..3, in this order

# transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX (identical in 5.17 and 5.24), copied so the
# trained tokenizer does not change when transformers does.
QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                           r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

# ChatML, as Qwen2 uses: each turn `<|im_start|>{role}\n{content}<|im_end|>\n`; the generation prompt
# opens an assistant turn, so a completion is `{content}<|im_end|>\n` and ends on EOS.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

MODEL_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    initializer_range=0.02,
)


# ========================================================================================= corpus

class CorpusError(ValueError):
    """The --data corpus cannot train the tokenizer (a row that is not TRL conversational, or no rows)."""


def iter_texts(data_path: str | os.PathLike) -> Iterator[str]:
    """Each message of each row as it appears inside the chat template (`role\\ncontent`), file order."""
    opener = gzip.open if str(data_path).endswith(".gz") else open
    with opener(data_path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                for key in ("prompt", "chosen", "rejected"):
                    for m in row[key]:
                        yield f"{m['role']}\n{m['content']}"
            except (ValueError, KeyError, TypeError) as e:
                raise CorpusError(f"{data_path}: row {lineno}: not a TRL conversational row ({e})") from None


# ====================================================================================== tokenizer

def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """Byte-level BPE with exactly Qwen2's normaliser and pre-tokeniser; every byte is in the alphabet.

    transformers 5 forces Qwen2Tokenizer for model_type qwen2 whatever tokenizer_class says, and that
    class rebuilds the pipeline (NFC + QWEN2_PRETOKENIZE_REGEX + ByteLevel) around the saved vocab and
    merges. Training under the same pipeline makes AutoTokenizer and tokenizer.json agree id for id.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=[IM_START], chat_template=CHAT_TEMPLATE,
                                   model_max_length=MODEL_CONFIG["max_position_embeddings"],
                                   clean_up_tokenization_spaces=False)


# ========================================================================================== model

def build_model(tokenizer):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         **MODEL_CONFIG)
    torch.manual_seed(SEED)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(config)
    return model.to(torch.float32).eval()


# =========================================================================================== build

def build(data_path: str | os.PathLike, out: str | os.PathLike, repo_id: str = REPO_ID,
          vocab_size: int = VOCAB_SIZE) -> str:
    """Write the pinned tiny reference to `out` (replacing it); returns the lock's SHA-256."""
    out = Path(out)
    texts = list(iter_texts(data_path))
    if not texts:
        raise CorpusError(f"{data_path}: no rows to train a tokenizer on")
    tokenizer = train_tokenizer(texts, vocab_size)
    model = build_model(tokenizer)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _canonicalise_json_files(tmp)
        lock_sha = verify_ref.pin(tmp, repo_id)
        for p in tmp.iterdir():  # mkdtemp/safetensors create 0700/0600; a committed model is world-readable
            p.chmod(0o644)
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return lock_sha


def _canonicalise_json_files(root: Path) -> None:
    """Sorted keys everywhere, so file bytes do not depend on dict insertion order inside transformers."""
    for p in sorted(root.glob("*.json")):
        write_json(p, json.loads(p.read_text(encoding="utf-8")))


def _arguments(ap) -> None:
    ap.add_argument("--data", default="data/embedded/color_facts_prefs.jsonl.gz")
    ap.add_argument("--out", default="models/tiny-qwen2")
    ap.add_argument("--repo-id", default=REPO_ID)
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)


def _run(args) -> int:
    lock_sha = build(args.data, args.out, args.repo_id, args.vocab_size)
    size = sum(p.stat().st_size for p in Path(args.out).rglob("*") if p.is_file())
    print(f"wrote {args.out} ({size / 1e6:.2f} MB), pinned as {args.repo_id}; ref.revision: {lock_sha}",
          file=sys.stderr)
    print(lock_sha)
    return 0


def main(argv: list[str] | None = None) -> int:
    return stage_main(argv, "make_tiny_ref", __doc__.split("\n")[0], add_arguments=_arguments, run=_run,
                      params=None, log=False, input_errors=(CorpusError,))


if __name__ == "__main__":
    sys.exit(main())
