"""Every `dpo.loss` against TRL 1.16's OWN loss code on the same batch (TRL is a test-only dependency).

TRL's trainers are instantiated on a tiny real causal LM (built from a config) with a real word-level tokenizer,
and their real loss methods run on a real collated batch: DPOTrainer._compute_loss (every DPOTrainer
loss_type, alone and as a weighted list), CPOTrainer.get_batch_loss_metrics (loss_type simpo) and
ORPOTrainer.get_batch_loss_metrics. Ours, stages.engine.dpo_losses.dpo_pair_losses, gets the summed completion
log-probs and token counts of the same model on the same sequences, and the same reference log-probs (DPOTrainer
with precompute_ref_log_probs reads them from the batch). TRL averages over the batch; ours returns per-pair losses
that the trainer sums and divides by the global pair count: for one process and one micro-batch that is the same
mean, so the test compares ours.mean() with TRL's loss.

Where a convention differs, the test compares the same quantity and checks the difference (README "DPO loss
conventions"):
  ipo          ours = the paper's summed form; TRL's ipo = our ipo_length_normalized.
  sigmoid eps  ours = cDPO; TRL 1.16's sigmoid ignores label_smoothing (compared at eps = 0).
  sft          ours = the chosen completion's NLL as a per-pair token mean, TRL = the token mean over the
               batch; equal when the chosen completions have equal lengths (the main batch); the unequal case
               is checked against both definitions.
  orpo         the odds-ratio term is TRL's; the NLL: ours = the paper's L_SFT on the chosen completion as a
               per-pair token mean, TRL 1.16 = the token mean over prompt AND completion of the whole batch.
  bco_pair     TRL 1.16 has no running-mean reward shift; neither do we.
"""
from __future__ import annotations

import math

import pytest
import torch

from engine_helpers import make_tiny_model_dir
from stages.engine.dpo_losses import DPO_LOSSES, dpo_pair_losses

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore")
torch.set_num_threads(1)

VOCAB = 128
TOL = dict(rtol=2e-6, atol=2e-6)                 # fp32: the model's log-probs and TRL's loss are fp32


SPECIAL = {0: "<pad>", 1: "<s>", 2: "</s>", 3: "<unk>"}


def word_tokenizer():
    """A real fast tokenizer whose word 'w<k>' is token k (so a test can write token ids as text). The special
    tokens are no prefix of a word: added tokens are matched inside words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {SPECIAL.get(k, f"w{k}"): k for k in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")


def text(ids) -> str:
    return " ".join(SPECIAL.get(k, f"w{k}") for k in ids)


def preference_rows(n: int, seed: int, equal_chosen_len: bool) -> list[dict]:
    """Prompt / chosen / rejected texts; every completion ends in EOS (so TRL appends none); unequal lengths."""
    g = torch.Generator().manual_seed(seed)

    def ids(k):
        return torch.randint(4, VOCAB, (k,), generator=g).tolist()
    rows = []
    for i in range(n):
        n_chosen = 6 if equal_chosen_len else 3 + i % 5
        n_rejected = 2 + (3 * i) % 7
        rows.append({"prompt": text(ids(2 + i % 4)), "chosen": " " + text(ids(n_chosen) + [2]),
                     "rejected": " " + text(ids(n_rejected) + [2])})
    return rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    path = make_tiny_model_dir(tmp_path_factory.mktemp("trl_parity") / "model", seed=3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return path, model.eval(), word_tokenizer()


def completion_logps(model, input_ids, attention_mask, completion_mask):
    """Summed completion log-probs and completion token counts per row (plain torch, full logits)."""
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    mask = completion_mask[:, 1:].bool()
    return (logp * mask).sum(-1), mask.sum(-1)


# ----------------------------------------------------------------------------------------------
# DPOTrainer: every loss_type
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dpo_trainer(tiny, tmp_path_factory):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    path, model, tok = tiny
    out = tmp_path_factory.mktemp("trl_dpo")
    args = DPOConfig(output_dir=str(out), report_to="none", bf16=False, fp16=False, use_cpu=True,
                     per_device_train_batch_size=8, precompute_ref_log_probs=True, max_length=None,
                     dataset_num_proc=None, beta=0.1, label_smoothing=0.0, save_strategy="no", logging_strategy="no")
    datasets = {name: Dataset.from_list(preference_rows(8, seed, equal))
                for name, seed, equal in (("equal", 1, True), ("unequal", 2, False))}
    trainer = DPOTrainer(model=model, args=args, train_dataset=datasets["equal"], processing_class=tok)
    trainer.model.eval()
    unequal = trainer._prepare_dataset(datasets["unequal"], tok, args, "unequal")
    return trainer, {"equal": list(trainer.train_dataset), "unequal": list(unequal)}


def dpo_batch(trainer, examples, seed: int):
    """TRL's collated batch with our reference log-probs (policy + N(0, 1) per sequence) put in; and ours."""
    batch = trainer.data_collator([{k: e[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
                                   for e in examples])
    logps, n_tokens = completion_logps(trainer.model, batch["input_ids"], batch["attention_mask"],
                                       batch["completion_mask"])
    pc, pr = logps.chunk(2)
    n_c, n_r = n_tokens.chunk(2)
    g = torch.Generator().manual_seed(seed)
    rc = pc + torch.randn(pc.shape, generator=g)
    rr = pr + torch.randn(pr.shape, generator=g)
    batch["ref_chosen_logps"], batch["ref_rejected_logps"] = rc, rr
    return batch, dict(pc=pc.double(), pr=pr.double(), rc=rc.double(), rr=rr.double(), chosen_tokens=n_c,
                       rejected_tokens=n_r)


def trl_dpo_loss(trainer, batch, loss_types, weights=None, *, beta, eps=0.0, discopop_tau=0.05) -> torch.Tensor:
    """DPOTrainer's own loss code (_compute_loss) under these settings (the attributes it reads them from)."""
    trainer.loss_types, trainer.loss_weights = list(loss_types), list(weights or [1.0] * len(loss_types))
    trainer.beta, trainer.label_smoothing = beta, eps
    trainer.args.discopop_tau = discopop_tau
    with torch.no_grad():
        return trainer._compute_loss(trainer.model, dict(batch), return_outputs=False).double()


# (our name, TRL's loss_type, label_smoothing): every DPOTrainer loss_type; ours ipo_length_normalized = TRL ipo
TRL_NAMES = {"ipo_length_normalized": "ipo"}
DPO_CASES = [("sigmoid", 0.0), ("hinge", 0.0), ("ipo_length_normalized", 0.0), ("exo_pair", 1e-3),
             ("exo_pair", 0.2), ("nca_pair", 0.0), ("robust", 0.0), ("robust", 0.2), ("bco_pair", 0.0),
             ("sppo_hard", 0.0), ("aot", 0.0), ("aot", 0.1), ("aot_unpaired", 0.0), ("aot_unpaired", 0.1),
             ("apo_zero", 0.0), ("apo_down", 0.0), ("discopop", 0.0), ("sigmoid_norm", 0.0), ("sft", 0.0)]


def test_every_trl_dpo_loss_type_is_covered():
    from trl.trainer import dpo_trainer
    import inspect
    src = inspect.getsource(dpo_trainer.DPOTrainer._compute_loss)
    trl_types = set(__import__("re").findall(r'loss_type == "(\w+)"', src))
    assert trl_types == {TRL_NAMES.get(name, name) for name, _ in DPO_CASES}
    assert trl_types | {"ipo_length_normalized", "simpo", "orpo"} == set(DPO_LOSSES)


@pytest.mark.parametrize("beta", [0.1, 0.7])
@pytest.mark.parametrize("name,eps", DPO_CASES)
def test_dpo_loss_matches_trl(dpo_trainer, name, eps, beta):
    trainer, data = dpo_trainer
    batch, ours_in = dpo_batch(trainer, data["equal"], seed=11)
    assert (ours_in["chosen_tokens"] != ours_in["rejected_tokens"]).any()     # length conventions matter
    want = trl_dpo_loss(trainer, batch, [TRL_NAMES.get(name, name)], beta=beta, eps=eps)
    got = dpo_pair_losses(**ours_in, beta=beta, loss_type=name, label_smoothing=eps)
    assert got.shape == (8,) and torch.isfinite(got).all()
    torch.testing.assert_close(got.mean(), want, **TOL)


def test_weighted_loss_list_matches_trl(dpo_trainer):
    """TRL's loss_type list + loss_weights (e.g. MPO's sigmoid + bco_pair + sft) = ours with the same lists."""
    trainer, data = dpo_trainer
    batch, ours_in = dpo_batch(trainer, data["equal"], seed=12)
    for names, weights in ((["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0]),
                           (["ipo_length_normalized", "hinge", "apo_zero", "discopop"], [0.5, 2.0, 1.0, 0.25])):
        want = trl_dpo_loss(trainer, batch, [TRL_NAMES.get(n, n) for n in names], weights, beta=0.3,
                            discopop_tau=0.2)
        got = dpo_pair_losses(**ours_in, beta=0.3, loss_type=names, loss_weights=weights, discopop_tau=0.2)
        torch.testing.assert_close(got.mean(), want, **TOL)
        singles = sum(w * dpo_pair_losses(**ours_in, beta=0.3, loss_type=n, discopop_tau=0.2)
                      for n, w in zip(names, weights))
        torch.testing.assert_close(got, singles)


def test_conventions_that_differ_from_trl(dpo_trainer):
    trainer, data = dpo_trainer
    batch, ours_in = dpo_batch(trainer, data["unequal"], seed=13)
    n_c = ours_in["chosen_tokens"].double()
    assert len(set(n_c.tolist())) > 1
    # sft: TRL = the token mean over the batch's chosen completions; ours = the mean over pairs of per-pair means
    trl_sft = trl_dpo_loss(trainer, batch, ["sft"], beta=0.1)
    ours_sft = dpo_pair_losses(**ours_in, beta=0.1, loss_type="sft")
    torch.testing.assert_close(trl_sft, -ours_in["pc"].sum() / n_c.sum(), **TOL)
    torch.testing.assert_close(ours_sft, -ours_in["pc"] / n_c)
    assert abs(float(ours_sft.mean() - trl_sft)) > 1e-3
    # ipo: TRL's ipo is our ipo_length_normalized, not the paper's summed ipo
    trl_ipo = trl_dpo_loss(trainer, batch, ["ipo"], beta=0.1)
    torch.testing.assert_close(dpo_pair_losses(**ours_in, beta=0.1, loss_type="ipo_length_normalized").mean(),
                               trl_ipo, **TOL)
    assert abs(float(dpo_pair_losses(**ours_in, beta=0.1, loss_type="ipo").mean() - trl_ipo)) > 1e-2
    # sigmoid with label smoothing: TRL 1.16 ignores it, ours is cDPO (equal at eps = 0, above)
    trl_sig = trl_dpo_loss(trainer, batch, ["sigmoid"], beta=0.1, eps=0.2)
    torch.testing.assert_close(trl_sig, trl_dpo_loss(trainer, batch, ["sigmoid"], beta=0.1), **TOL)
    assert abs(float(dpo_pair_losses(**ours_in, beta=0.1, label_smoothing=0.2).mean() - trl_sig)) > 1e-3


def test_aot_sorts_only_the_real_pairs_of_a_padded_batch(dpo_trainer):
    """A packed micro-batch padded for CUDA graphs carries weight-0 pairs at its end: they must not enter the
    sort (ours sorts the valid pairs only), so the real pairs' sum equals TRL's loss on the unpadded batch."""
    trainer, data = dpo_trainer
    batch, ours_in = dpo_batch(trainer, data["equal"], seed=14)
    for name in ("aot", "aot_unpaired"):
        want = trl_dpo_loss(trainer, batch, [name], beta=0.5, eps=0.1)
        padded = {k: torch.cat([v, torch.full((3,), 50.0 if k[0] in "pr" else 1, dtype=v.dtype)])
                  for k, v in ours_in.items()}
        valid = torch.arange(11) < 8
        got = dpo_pair_losses(**padded, beta=0.5, loss_type=name, label_smoothing=0.1, valid=valid)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got[:8].sum() / 8, want, **TOL)


# ----------------------------------------------------------------------------------------------
# SimPO (CPOTrainer) and ORPO (ORPOTrainer): reference-free, per-token mean log-probs
# ----------------------------------------------------------------------------------------------

def experimental_trainer(kind, tiny, tmp_path, rows, **config):
    from datasets import Dataset
    path, model, tok = tiny
    if kind == "cpo":
        from trl.experimental.cpo import CPOConfig as Config, CPOTrainer as Trainer
    else:
        from trl.experimental.orpo import ORPOConfig as Config, ORPOTrainer as Trainer
    args = Config(output_dir=str(tmp_path), report_to="none", bf16=False, fp16=False, use_cpu=True,
                  per_device_train_batch_size=len(rows), save_strategy="no", logging_strategy="no",
                  max_length=512, **config)
    trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    trainer.model.eval()
    batch = trainer.data_collator(list(trainer.train_dataset))
    ours = {}
    for branch in ("chosen", "rejected"):
        labels = batch[f"{branch}_labels"]
        logps, n = completion_logps(trainer.model, batch[f"{branch}_input_ids"], batch[f"{branch}_attention_mask"],
                                    (labels != -100).long())
        ours[branch] = (logps.double(), n)
    with torch.no_grad():
        loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
    full = {"input_ids": batch["chosen_input_ids"], "attention_mask": batch["chosen_attention_mask"]}
    return loss.double(), float(metrics["nll_loss"]), full, dict(pc=ours["chosen"][0], pr=ours["rejected"][0], rc=torch.zeros_like(ours["chosen"][0]),
                               rr=torch.zeros_like(ours["chosen"][0]), chosen_tokens=ours["chosen"][1],
                               rejected_tokens=ours["rejected"][1])


@pytest.mark.parametrize("beta,gamma,eps", [(2.0, 0.5, 0.0), (0.3, 1.2, 0.1)])
def test_simpo_matches_trl_cpo_trainer(tiny, tmp_path, beta, gamma, eps):
    """SimPO = CPOTrainer(loss_type simpo, cpo_alpha 0), reference-free on per-token mean log-probs."""
    want, _, _, ours_in = experimental_trainer("cpo", tiny, tmp_path, preference_rows(6, 4, equal_chosen_len=False),
                                               loss_type="simpo", cpo_alpha=0.0, beta=beta, simpo_gamma=gamma,
                                               label_smoothing=eps)
    assert (ours_in["chosen_tokens"] != ours_in["rejected_tokens"]).any()
    got = dpo_pair_losses(**ours_in, beta=beta, loss_type="simpo", simpo_gamma=gamma, label_smoothing=eps)
    torch.testing.assert_close(got.mean(), want, **TOL)


def test_orpo_matches_trl_orpo_trainer(tiny, tmp_path):
    """ORPO = ORPOTrainer: NLL + beta * the odds-ratio loss on per-token mean completion log-probs.
    The odds-ratio term is compared exactly (TRL's loss minus its reported nll_loss). The NLL differs:
    ours = the paper's L_SFT, -log P(y_w | x) / |y_w| per pair (the completion tokens; the engine sums only
    those); TRL 1.16's = the token mean over prompt AND completion of the whole batch ("computed over the full
    prompt and response"), checked here against that definition."""
    beta = 0.25
    want, trl_nll, full, ours_in = experimental_trainer("orpo", tiny, tmp_path,
                                                        preference_rows(6, 5, equal_chosen_len=False), beta=beta)
    got = dpo_pair_losses(**ours_in, beta=beta, loss_type="orpo")
    our_nll = -ours_in["pc"] / ours_in["chosen_tokens"].double()
    torch.testing.assert_close((got - our_nll).mean(), want - trl_nll, **TOL)
    # TRL's NLL, recomputed: every non-pad token after the first, prompt included, pooled over the batch
    logps, n = completion_logps(tiny[1], full["input_ids"], full["attention_mask"], full["attention_mask"])
    torch.testing.assert_close(torch.tensor(trl_nll, dtype=torch.float64), -logps.sum().double() / n.sum(), **TOL)
    assert abs(float(our_nll.mean()) - trl_nll) > 1e-3
