"""Every `dpo.loss` against an implementation written here from its paper (not a call into dpo_pair_losses),
the completion token counts ipo_length_normalized reads from packed batches (shared prompts, CUDA-graph padding),
the refusals, and a tiny end-to-end DPO training run per new option (first-step loss and gradient norm against
the independent padded-batch implementation of engine_helpers).

Papers (README "DPO loss conventions" relates each to TRL 1.16's DPOTrainer):
  DPO    Rafailov et al. 2023, arXiv:2305.18290, Eq. 7.
  cDPO   E. Mitchell, "A note on DPO with noisy preferences & relationship to IPO", 2023: the DPO loss averaged
         over the label being flipped with probability eps.
  robust Chowdhury, Kini & Natarajan, "Provably Robust DPO", ICML 2024, arXiv:2403.00409: the unbiased estimator
         ((1 - eps) L(w, l) - eps L(l, w)) / (1 - 2 eps).
  IPO    Azar et al. 2023, arXiv:2310.12036, Eq. 17 (tau = beta): (h - 1 / (2 tau))^2; TRL's `ipo` takes h on the
         per-token mean log-ratios.
"""
from __future__ import annotations

import copy
import math

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from engine_helpers import (make_tiny_model_dir, pair_seqs, random_rows, reference_seq_logps, toy_task_rows,
                            write_token_parquet)
from stages.engine.dpo_losses import dpo_pair_losses
from stages.engine.dpo_objective import DPOObjective
from stages.engine.packing import BatchDims, build_packed_batch, load_token_pairs, plan_training
from stages.engine.padded_shapes import pad_packed_batch
from stages.lib.params import ParamsError, load_params, validate_params

from conftest import REPO_ROOT as REPO
torch.set_num_threads(1)   # tiny tensors and model: extra intra-op threads only contend on a shared machine


# ----------------------------------------------------------------------------------------------
# Independent implementations, from the papers
# ----------------------------------------------------------------------------------------------

def paper_dpo(pw, pl, rw, rl, beta):
    """DPO (Eq. 7): -log sigma(beta * [(log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))])."""
    return -torch.log(torch.sigmoid(beta * ((pw - rw) - (pl - rl))))


def paper_cdpo(pw, pl, rw, rl, beta, eps):
    """cDPO: with probability eps the label is flipped, i.e. the DPO loss of the swapped pair."""
    return (1 - eps) * paper_dpo(pw, pl, rw, rl, beta) + eps * paper_dpo(pl, pw, rl, rw, beta)


def paper_robust(pw, pl, rw, rl, beta, eps):
    """Robust DPO (Chowdhury et al. 2024): ((1 - eps) L(w, l) - eps L(l, w)) / (1 - 2 eps)."""
    return ((1 - eps) * paper_dpo(pw, pl, rw, rl, beta) - eps * paper_dpo(pl, pw, rl, rw, beta)) / (1 - 2 * eps)


def paper_ipo(h, tau):
    """IPO, Eq. 17: (h - 1 / (2 tau))^2."""
    return (h - 1 / (2 * tau)) ** 2


def random_token_logps(n_pairs: int, seed: int, dtype: torch.dtype):
    """Per-token policy / reference log-probs of n pairs with unequal chosen / rejected completion lengths."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 24, (n_pairs, 2), generator=g)
    while (lens[:, 0] == lens[:, 1]).all():
        lens[:, 1] += 1
    tokens = []
    for c_len, r_len in lens.tolist():
        branch = []
        for n in (c_len, r_len):
            ref = -torch.rand(n, generator=g, dtype=torch.float64) * 4 - 0.05
            policy = ref + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
            branch.append((policy.to(dtype), ref.to(dtype)))
        tokens.append(branch)
    return lens, tokens


def summed(tokens, which: int, branch: int, dtype) -> torch.Tensor:
    return torch.stack([pair[branch][which].sum() for pair in tokens]).to(dtype)


# ----------------------------------------------------------------------------------------------
# The formulas
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_each_dpo_loss_matches_its_paper(dtype, beta):
    lens, tokens = random_token_logps(40, seed=3, dtype=dtype)
    pc, pr = summed(tokens, 0, 0, dtype), summed(tokens, 0, 1, dtype)     # policy chosen / rejected, summed
    rc, rr = summed(tokens, 1, 0, dtype), summed(tokens, 1, 1, dtype)
    tol = dict(rtol=1.3e-6, atol=1e-5)                                    # fp32 tolerance, either dtype

    def ours(loss, **kw):
        got = dpo_pair_losses(pc, pr, rc, rr, beta=beta, loss_type=loss, **kw)
        assert got.dtype == dtype and got.shape == (40,)
        return got

    torch.testing.assert_close(ours("sigmoid"), paper_dpo(pc, pr, rc, rr, beta), **tol)
    for eps in (0.1, 0.3):
        torch.testing.assert_close(ours("sigmoid", label_smoothing=eps), paper_cdpo(pc, pr, rc, rr, beta, eps), **tol)
        torch.testing.assert_close(ours("robust", label_smoothing=eps), paper_robust(pc, pr, rc, rr, beta, eps), **tol)
    torch.testing.assert_close(ours("robust"), paper_dpo(pc, pr, rc, rr, beta), **tol)
    torch.testing.assert_close(ours("ipo"), paper_ipo((pc - rc) - (pr - rr), beta), **tol)

    # TRL's ipo: h on the per-token mean log-ratios of each completion (unequal chosen / rejected lengths)
    assert (lens[:, 0] != lens[:, 1]).any()
    h_mean = torch.stack([(pol_c - ref_c).mean() - (pol_r - ref_r).mean()
                          for (pol_c, ref_c), (pol_r, ref_r) in tokens])
    got = ours("ipo_length_normalized", chosen_tokens=lens[:, 0], rejected_tokens=lens[:, 1])
    torch.testing.assert_close(got, paper_ipo(h_mean, beta), **tol)
    assert not torch.allclose(got, ours("ipo"), rtol=1e-3)             # a different loss from the summed ipo
    # token counts as float (what the objective passes) give the same
    torch.testing.assert_close(
        ours("ipo_length_normalized", chosen_tokens=lens[:, 0].to(dtype), rejected_tokens=lens[:, 1].to(dtype)), got)


def test_robust_is_unbiased_and_cdpo_is_the_expected_flipped_loss():
    """The defining properties (Chowdhury et al. 2024, Lemma 3.1; Mitchell 2023): averaged over a flip with
    probability eps, the robust loss gives the clean DPO loss, and cDPO is that average of the DPO loss."""
    pc, pr, rc, rr = (torch.randn(16, generator=torch.Generator().manual_seed(k), dtype=torch.float64) * 3
                      for k in range(4))
    beta, eps = 0.4, 0.2

    def robust(a, b, c, d):
        return dpo_pair_losses(a, b, c, d, beta=beta, loss_type="robust", label_smoothing=eps)
    torch.testing.assert_close((1 - eps) * robust(pc, pr, rc, rr) + eps * robust(pr, pc, rr, rc),
                               dpo_pair_losses(pc, pr, rc, rr, beta=beta))
    torch.testing.assert_close(dpo_pair_losses(pc, pr, rc, rr, beta=beta, label_smoothing=eps),
                               (1 - eps) * dpo_pair_losses(pc, pr, rc, rr, beta=beta)
                               + eps * dpo_pair_losses(pr, pc, rr, rc, beta=beta))


def test_meaningless_settings_are_refused():
    x = torch.zeros(2, dtype=torch.float64)
    for loss in ("ipo", "ipo_length_normalized"):
        with pytest.raises(ValueError, match=f"label_smoothing = 0.1 has no meaning for dpo.loss: {loss}"):
            dpo_pair_losses(x, x, x, x, beta=0.1, loss_type=loss, label_smoothing=0.1,
                            chosen_tokens=x + 1, rejected_tokens=x + 1)
        with pytest.raises(ValueError, match="has no meaning"):
            DPOObjective({"objective": "dpo_ref_free", "beta": 0.1, "loss": loss, "label_smoothing": 0.1})
    with pytest.raises(ValueError, match="needs the completion token counts"):
        dpo_pair_losses(x, x, x, x, beta=0.1, loss_type="ipo_length_normalized")
    with pytest.raises(ValueError, match="unknown DPO loss 'kto'"):
        dpo_pair_losses(x, x, x, x, beta=0.1, loss_type="kto")
    with pytest.raises(ValueError, match="names a loss twice"):          # the schema's uniqueItems, in Python too
        dpo_pair_losses(x, x, x, x, beta=0.1, loss_type=["hinge", "hinge"])
    for loss in ("sigmoid_norm", "sft", "simpo", "orpo"):
        with pytest.raises(ValueError, match=f"dpo.loss {loss} needs the completion token counts"):
            dpo_pair_losses(x, x, x, x, beta=0.1, loss_type=loss)

    params = load_params(REPO / "params.yaml")
    params["dpo"].pop("loss_weights", None)      # each case sets its own loss (the default is a weighted list)
    for loss, eps, ok in (("ipo", 0.1, False), ("ipo_length_normalized", 0.1, False), ("ipo_length_normalized", 0.0, True),
                          ("robust", 0.1, True), ("sigmoid", 0.2, True), ("robust", 0.5, False), ("hinge", 0.0, True),
                          ("kto", 0.0, False), (["sigmoid", "sft"], 0.0, True), ([], 0.0, False),
                          (["sigmoid", "sigmoid"], 0.0, False), (["sigmoid", "kto"], 0.0, False)):
        p = copy.deepcopy(params)
        p["dpo"].update(loss=loss, label_smoothing=eps)
        if ok:
            validate_params(p)
        else:
            with pytest.raises(ParamsError, match=r"dpo\.(label_smoothing|loss)"):
                validate_params(p)


@pytest.mark.parametrize("dpo,message", [
    ({"loss": "simpo"}, r"dpo.loss \['simpo'\] is reference-free by definition .*set dpo.objective: dpo_ref_free"),
    ({"loss": ["sigmoid", "orpo"]}, r"\['orpo'\] is reference-free"),
    ({"loss": "exo_pair"}, "exo_pair needs dpo.label_smoothing > 0"),
    ({"loss": ["ipo", "hinge"], "label_smoothing": 0.1},
     r"label_smoothing = 0.1 has no meaning for dpo.loss: \['ipo', 'hinge'\] \(IPO has no label smoothing"),
    ({"loss": ["sigmoid", "sft"], "loss_weights": [1.0]}, "dpo.loss_weights has 1 entries for 2 losses"),
    ({"loss": "sft", "label_smoothing": 0.2}, r"has no meaning for dpo.loss: sft: set it to 0, or use a loss"),
])
def test_impossible_loss_settings_are_refused_by_the_stage(tmp_path, capsys, dpo, message):
    """Refused before anything is loaded, with the stage's one-line refusal (the paths need not exist)."""
    from stages import train_dpo
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["dpo"].pop("loss_weights", None)
    params["dpo"].update({"objective": "dpo", "label_smoothing": 0.0, "loss": "sigmoid", **dpo})
    validate_params(params)                      # the schema allows each; the combination is what is refused
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(SystemExit) as exit_info:
        train_dpo.main(["--params", str(tmp_path / "p.yaml"), "--model-dir", str(tmp_path / "absent"),
                        "--train-tokens", "absent.parquet", "--probe-tokens", "absent.parquet",
                        "--ref-logps", "absent.parquet", "--out-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    refusals = [line for line in err.splitlines() if "train_dpo: refused: " in line]
    assert refusals and __import__("re").search(message, refusals[-1]), err


def test_new_losses_keep_their_defining_properties():
    """Checks from the papers' definitions (TRL parity: tests/engine/test_trl_parity.py)."""
    g = torch.Generator().manual_seed(4)
    pc, pr, rc, rr = (-torch.rand(12, generator=g, dtype=torch.float64) * 40 for _ in range(4))
    n_c, n_r = torch.randint(1, 30, (2, 12), generator=g)
    kw = dict(chosen_tokens=n_c, rejected_tokens=n_r)
    beta = 0.3

    def loss(name, *args, **extra):
        return dpo_pair_losses(*(args or (pc, pr, rc, rr)), beta=beta, loss_type=name, **kw, **extra)
    # SimPO and ORPO never read a reference: the same loss under any reference log-probs
    for name in ("simpo", "orpo"):
        torch.testing.assert_close(loss(name), loss(name, pc, pr, rc * 0, rr * 0))
    # SimPO, Eq. 6; ORPO, Eq. 6-7 (odds from the per-token mean probability)
    a_c, a_r = pc / n_c, pr / n_r
    torch.testing.assert_close(loss("simpo", simpo_gamma=0.7), -torch.log(torch.sigmoid(beta * (a_c - a_r) - 0.7)))
    odds = lambda a: torch.exp(a) / (1 - torch.exp(a))          # noqa: E731
    torch.testing.assert_close(loss("orpo"), -a_c - beta * torch.log(torch.sigmoid(torch.log(odds(a_c) / odds(a_r)))))
    # SPPO (hard): zero exactly at log-ratios +-1/(2 beta)
    half = torch.full((12,), 0.5 / beta, dtype=torch.float64)
    assert loss("sppo_hard", half, -half, half * 0, half * 0).abs().max() < 1e-12
    # AOT: one pair, or a batch the sort leaves in order, is the cDPO loss of each pair
    one = [t[:1] for t in (pc, pr, rc, rr)]
    torch.testing.assert_close(dpo_pair_losses(*one, beta=beta, loss_type="aot", label_smoothing=0.1),
                               dpo_pair_losses(*one, beta=beta, label_smoothing=0.1))
    # DiscoPOP: its exp term blended to 0 where the logistic term rules (a very negative margin): finite
    z = torch.tensor([-2000.0, -5.0, 0.0, 5.0], dtype=torch.float64)
    got = dpo_pair_losses(z, z * 0, z * 0, z * 0, beta=1.0, loss_type="discopop", discopop_tau=0.05)
    m = torch.sigmoid(z / 0.05)
    want = -torch.nn.functional.logsigmoid(z) * (1 - m) + torch.exp(-z) * m
    assert torch.isfinite(got).all() and not torch.isfinite(want[0])          # the literal form is inf * 0
    torch.testing.assert_close(got[1:], want[1:])
    torch.testing.assert_close(got[0], torch.tensor(2000.0, dtype=torch.float64))
    # the implicit rewards stay beta * log-ratio for every loss (reference-free: beta * log-prob)
    objective = DPOObjective({"objective": "dpo_ref_free", "beta": beta, "loss": ["simpo", "sft"],
                              "loss_weights": [1.0, 0.1], "label_smoothing": 0.0})
    assert objective.needs_lengths and objective.fingerprint()["loss_weights"] == [1.0, 0.1]


# ----------------------------------------------------------------------------------------------
# The token counts ipo_length_normalized takes from a packed batch
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("share_prompt", [True, False])
@pytest.mark.parametrize("pad", [False, True])
def test_length_normalized_ipo_counts_each_branch_completion_tokens_in_packed_batches(tmp_path, share_prompt, pad):
    rows = random_rows(9, seed=11, max_prompt=8, max_completion=12)
    pairs = load_token_pairs(write_token_parquet(tmp_path / "t.parquet", rows))
    micro = [4, 0, 7, 2, 8]
    batch = unpadded = build_packed_batch(pairs, micro, share_prompt=share_prompt)
    if pad:                                   # a CUDA-graph shape: a trash pair and empty pairs of weight 0
        d = batch.dims()
        shape = BatchDims(tokens=d.tokens + 6, keys=d.keys + 6 + 3, logp_tokens=d.logp_tokens + 5,
                          pairs=d.pairs + 3, max_q=max(d.max_q, 6), max_k=max(d.max_k, 6, 3))
        assert shape.fits(d)
        batch = pad_packed_batch(batch, shape)
    n_seq = batch.n_seqs
    g = torch.Generator().manual_seed(5)
    seq_out = -torch.rand(n_seq, generator=g, dtype=torch.float64) * 30
    ref = -torch.rand(len(rows), 2, generator=g, dtype=torch.float64).numpy() * 30
    beta = 0.2
    objective = DPOObjective({"objective": "dpo", "beta": beta, "loss": "ipo_length_normalized",
                              "label_smoothing": 0.0}, {"train": ref}).to(torch.device("cpu"))
    losses, metrics = objective.pair_terms(seq_out, batch, "train")
    assert torch.isfinite(losses).all() and torch.isfinite(metrics).all()

    want = []
    for k, p in enumerate(micro):
        r = rows[p]
        n_c = len(r["chosen_ids"]) - r["chosen_prompt_len"]
        n_r = len(r["rejected_ids"]) - r["rejected_prompt_len"]
        h = (float(seq_out[2 * k]) - ref[p, 0]) / n_c - (float(seq_out[2 * k + 1]) - ref[p, 1]) / n_r
        want.append((h - 1 / (2 * beta)) ** 2)
    assert any(len(rows[p]["chosen_ids"]) != len(rows[p]["rejected_ids"]) for p in micro)
    torch.testing.assert_close(losses[:len(micro)], torch.tensor(want, dtype=torch.float64))
    # the implicit rewards (metrics, probe rows, evaluate) are the loss's own: beta * the per-token MEAN log-ratio
    # (issue 29: the length-normalized losses are scored on what they optimize)
    pc, pr = seq_out[0:2 * len(micro):2], seq_out[1:2 * len(micro):2]
    idx = torch.tensor(micro)
    n = torch.tensor([[len(rows[p]["chosen_ids"]) - rows[p]["chosen_prompt_len"],
                       len(rows[p]["rejected_ids"]) - rows[p]["rejected_prompt_len"]] for p in micro], dtype=torch.float64)
    torch.testing.assert_close(metrics[:len(micro), 4], beta * (pc - torch.from_numpy(ref[:, 0])[idx]) / n[:, 0])
    torch.testing.assert_close(metrics[:len(micro), 5], beta * (pr - torch.from_numpy(ref[:, 1])[idx]) / n[:, 1])
    assert (batch.pair_weight[len(micro):] == 0).all()

    # aot sorts over the micro-batch: the padding pairs of a CUDA-graph shape stay out of the sort, so the
    # weighted sum is that of the unpadded batch (and the same for the length-normalised sigmoid_norm beside it)
    mixed = DPOObjective({"objective": "dpo", "beta": beta, "loss": ["aot", "sigmoid_norm"], "label_smoothing": 0.1},
                         {"train": ref}).to(torch.device("cpu"))
    seq_unpadded = seq_out[:unpadded.n_seqs] if pad else seq_out
    want_sum = (mixed.pair_terms(seq_unpadded, unpadded, "train")[0] * unpadded.pair_weight).sum()
    got = mixed.pair_terms(seq_out, batch, "train")[0]
    assert torch.isfinite(got).all()
    torch.testing.assert_close((got * batch.pair_weight).sum(), want_sum.to(got.dtype))
    # ORPO's odds of a padding pair's empty sequences (mean log-prob 0) are infinite: loss and gradient stay finite
    free = DPOObjective({"objective": "dpo_ref_free", "beta": beta, "loss": ["orpo", "simpo", "sft"],
                         "label_smoothing": 0.0}).to(torch.device("cpu"))
    seq_grad = seq_out.clone()
    seq_grad[unpadded.n_seqs:] = 0.0                  # what the model sums for an empty sequence
    seq_grad.requires_grad_(True)
    got = free.pair_terms(seq_grad, batch, "train")[0]
    (got * batch.pair_weight).sum().backward()
    assert torch.isfinite(got).all() and torch.isfinite(seq_grad.grad).all()
    want_sum = (free.pair_terms(seq_unpadded, unpadded, "train")[0] * unpadded.pair_weight).sum()
    torch.testing.assert_close((got * batch.pair_weight).sum().detach(), want_sum.to(got.dtype))


# ----------------------------------------------------------------------------------------------
# End to end: the tiny model trains with each new option; first step = the independent implementation
# ----------------------------------------------------------------------------------------------

def write_params(path, dpo: dict):
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["train"].update({"gpus": 0, "epochs": 1, "global_batch_pairs": 16, "micro_batch_tokens": 160,
                            "inference_micro_batch_tokens": 160, "lr": 3e-3, "warmup_ratio": 0.1,
                            "logp_chunk_tokens": 32, "seed": 5})
    params["dpo"].pop("loss_weights", None)
    params["dpo"].update({"loss": "sigmoid", **dpo})
    path.write_text(yaml.safe_dump(params))
    return path


def first_step_rows(train_path, params: dict) -> list[dict]:
    t = params["train"]
    pairs = load_token_pairs(train_path)
    plan = plan_training(pairs.pair_tokens, epochs=t["epochs"], world_size=1, global_batch_pairs=t["global_batch_pairs"],
                         micro_batch_tokens=t["micro_batch_tokens"], seed=t["seed"])[0]
    rows = pd.read_parquet(train_path).to_dict("records")
    return [{k: (list(v) if hasattr(v, "tolist") else v) for k, v in rows[i].items()}
            for mb in plan.rank_micro_batches[0] for i in mb]


@pytest.mark.parametrize("loss,eps", [("ipo_length_normalized", 0.0), ("robust", 0.1), ("sigmoid", 0.2),
                                      ("simpo", 0.0), ("orpo", 0.0), (["sigmoid", "sft"], 0.0)])
def test_dpo_trains_end_to_end_with_each_convention(tmp_path, loss, eps):
    from transformers import AutoModelForCausalLM
    from stages import train_dpo
    from stages.evidence.scoring import score_dpo_rows
    from stages.lib.io import read_jsonl
    make_tiny_model_dir(tmp_path / "model")
    write_token_parquet(tmp_path / "train.parquet", toy_task_rows(32, seed=1))
    write_token_parquet(tmp_path / "probe.parquet", toy_task_rows(9, seed=2, prefix="q"))
    beta = 0.5
    weights = [1.0, 0.5] if isinstance(loss, list) else None       # a TRL-style weighted list (RPO-like)
    params_path = write_params(tmp_path / "p.yaml", {"objective": "dpo_ref_free", "beta": beta, "loss": loss,
                                                     "label_smoothing": eps,
                                                     **({"loss_weights": weights} if weights else {})})
    out = tmp_path / "dpo"
    train_dpo.main(["--params", str(params_path), "--model-dir", str(tmp_path / "model"),
                    "--train-tokens", str(tmp_path / "train.parquet"), "--probe-tokens", str(tmp_path / "probe.parquet"),
                    "--out-dir", str(out), "--log", str(out) + ".log"])

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", attn_implementation="eager", dtype=torch.float32)
    step = first_step_rows(tmp_path / "train.parquet", yaml.safe_load(params_path.read_text()))
    seqs, pls = pair_seqs(step)
    logps = reference_seq_logps(model, seqs, pls).view(-1, 2)       # reference-free: the log-ratio is the log-prob
    pw, pl = logps[:, 0], logps[:, 1]
    zero = torch.zeros_like(pw)
    n = torch.tensor([len(s) - p for s, p in zip(seqs, pls)], dtype=torch.float64).view(-1, 2)
    assert (n[:, 0] != n[:, 1]).any()
    if loss == "ipo_length_normalized":
        want = paper_ipo(pw / n[:, 0] - pl / n[:, 1], beta)
    elif loss == "simpo":              # SimPO Eq. 6, gamma = 0.5 (the default)
        want = -torch.log(torch.sigmoid(beta * (pw / n[:, 0] - pl / n[:, 1]) - 0.5))
    elif loss == "orpo":               # ORPO Eq. 6-7, lambda = beta
        a_c, a_r = pw / n[:, 0], pl / n[:, 1]
        log_odds = (a_c - torch.log(-torch.expm1(a_c))) - (a_r - torch.log(-torch.expm1(a_r)))
        want = -a_c - beta * torch.log(torch.sigmoid(log_odds))
    elif isinstance(loss, list):       # sigmoid + 0.5 * the chosen NLL per token
        want = paper_dpo(pw, pl, zero, zero, beta) + 0.5 * (-pw / n[:, 0])
    elif loss == "robust":
        want = paper_robust(pw, pl, zero, zero, beta, eps)
    else:
        want = paper_cdpo(pw, pl, zero, zero, beta, eps)
    want.mean().backward()
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None))

    log = pd.read_csv(out / "train_log.csv")
    assert log.loss[0] == pytest.approx(want.mean().item(), rel=1e-6)
    assert log.grad_norm[0] == pytest.approx(norm, rel=1e-5)
    assert len(log) == 2 and np.isfinite(log.loss).all()
    # probe rows keep their meaning (beta * summed log-ratio) and evaluate accepts them
    for name in ("probe_step0.jsonl", "probe_final.jsonl"):
        rows = read_jsonl(out / name)
        assert len(rows) == 9
        score_dpo_rows(rows, beta, True, name)
