"""The DPO loss registry (stages/engine/dpo_losses.py): every loss declares what it needs next to its formula, and
what copies the declarations is generated from them; a new loss is one file (plus its test) and reruns train_dpo
and what follows it, nothing before.

The declaration checks run over every registered loss, so a new loss that declares wrongly (reads a reference it
says it has none of, ignores label smoothing it claims to read, ...) fails here without a test of its own.
"""
from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml

from conftest import REPO_ROOT
from pipeline_helpers import copy_checkout, sh
from stages.engine.dpo_losses import (DPO_LOSSES, KNOBS, LOSSES, DPOLossError, check_dpo_loss, dpo_pair_losses,
                                      loss_hints, reward_kind)
from stages.lib.implicit_reward import MEAN_REWARD, SUMMED_REWARD
from stages.lib.params import ParamsError, load_params, validate_params
from stages import sync_losses

sys.path.insert(0, str(REPO_ROOT / "workflow"))
from code_deps import code_deps  # noqa: E402

torch.set_num_threads(1)
LOSSES_FILE = "stages/engine/dpo_losses.py"


def _inputs(seed: int, n: int = 12):
    g = torch.Generator().manual_seed(seed)
    pc, pr, rc, rr = (-torch.rand(n, generator=g, dtype=torch.float64) * 40 - 1 for _ in range(4))
    n_c, n_r = torch.randint(1, 30, (2, n), generator=g)
    return pc, pr, rc, rr, n_c, n_r


def _eps(loss) -> float:
    return 0.1 if loss.requires_smoothing else 0.0


# ----------------------------------------------------------------------------------------------
# The declarations say what each formula reads
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", DPO_LOSSES)
def test_each_loss_reads_exactly_what_it_declares(name):
    loss = LOSSES[name]
    pc, pr, rc, rr, n_c, n_r = _inputs(1)
    kw = dict(beta=0.3, loss_type=name, label_smoothing=_eps(loss), chosen_tokens=n_c, rejected_tokens=n_r)
    base = dpo_pair_losses(pc, pr, rc, rr, **kw)
    assert base.shape == pc.shape and base.dtype == pc.dtype and torch.isfinite(base).all()
    other_ref = dpo_pair_losses(pc, pr, rc * 0.5 - 3, rr * 2, **kw)
    if loss.reference_free:
        torch.testing.assert_close(base, other_ref)      # reference-free: the same under any reference
    other_len = dpo_pair_losses(pc, pr, rc, rr, **{**kw, "chosen_tokens": n_c + 7, "rejected_tokens": n_r * 3})
    if loss.lengths:
        assert not torch.allclose(base, other_len), f"{name} declares lengths but never reads them"
        with pytest.raises(DPOLossError, match=f"dpo.loss {name} needs the completion token counts"):
            dpo_pair_losses(pc, pr, rc, rr, beta=0.3, loss_type=name, label_smoothing=_eps(loss))
    else:
        torch.testing.assert_close(base, other_len)
    for key, knob in KNOBS.items():
        moved = dpo_pair_losses(pc, pr, rc, rr, **kw, **{key: knob.default * 3 + 0.7})
        if knob in loss.knobs:
            assert not torch.allclose(base, moved), f"{name} declares dpo.{key} but never reads it"
        else:
            torch.testing.assert_close(base, moved)
    if loss.smoothing:
        smoothed = dpo_pair_losses(pc, pr, rc, rr, **{**kw, "label_smoothing": 0.2})
        assert not torch.allclose(base, smoothed), f"{name} declares label smoothing but never reads it"
    else:
        with pytest.raises(DPOLossError, match=f"label_smoothing = 0.2 has no meaning for dpo.loss: {name}"):
            check_dpo_loss(name, 0.2)
    if loss.reference_free:
        with pytest.raises(DPOLossError, match=rf"dpo.loss \['{name}'\] is reference-free by definition"):
            check_dpo_loss(name, _eps(loss), objective="dpo")
    check_dpo_loss(name, _eps(loss), objective="dpo_ref_free")
    # a mean reward needs the completion counts the objective only computes for length losses
    assert loss.implicit_reward in (SUMMED_REWARD, MEAN_REWARD, None)
    assert loss.implicit_reward != MEAN_REWARD or loss.lengths


def test_derived_sets_and_knob_bounds():
    from stages.engine.dpo_losses import LENGTH_LOSSES, REFERENCE_FREE_LOSSES, SMOOTHING_LOSSES
    assert REFERENCE_FREE_LOSSES == ("simpo", "orpo")
    assert LENGTH_LOSSES == ("ipo_length_normalized", "sigmoid_norm", "sft", "simpo", "orpo")
    assert SMOOTHING_LOSSES == ("sigmoid", "robust", "exo_pair", "aot", "aot_unpaired", "simpo")
    assert sorted(KNOBS) == ["discopop_tau", "simpo_gamma"]
    with pytest.raises(DPOLossError, match=r"dpo.discopop_tau = 0.0: must be > 0"):
        check_dpo_loss("sigmoid", 0.0, discopop_tau=0.0)
    with pytest.raises(DPOLossError, match=r"dpo.simpo_gamma = -1.0: must be >= 0"):
        check_dpo_loss("sigmoid", 0.0, simpo_gamma=-1.0)
    with pytest.raises(TypeError, match="unknown DPO loss knob"):
        check_dpo_loss("sigmoid", 0.0, simpo_gama=1.0)


def test_implicit_reward_of_a_loss_list_and_the_simpo_beta_hint():
    assert reward_kind((("sigmoid", 1.0),)) == SUMMED_REWARD
    for name in ("simpo", "orpo", "sigmoid_norm", "ipo_length_normalized"):
        assert reward_kind(((name, 1.0),)) == MEAN_REWARD
    assert reward_kind((("sft", 1.0),)) == SUMMED_REWARD                       # sft has none: DPO's
    assert reward_kind((("sft", 0.5), ("simpo", 1.0))) == MEAN_REWARD          # the first that declares one
    assert reward_kind((("sigmoid", 1.0), ("sigmoid_norm", 1.0))) == SUMMED_REWARD
    dpo = {"loss": "simpo", "beta": 0.1}
    (hint,) = loss_hints(dpo)
    assert "dpo.beta = 0.1 is far from what dpo.loss simpo is usually trained with (beta 2-2.5" in hint
    assert loss_hints({"loss": "simpo", "beta": 2.0}) == [] and loss_hints({"loss": "sigmoid", "beta": 0.1}) == []
    assert len(loss_hints({"loss": ["sft", "simpo"], "beta": 40.0})) == 1


# ----------------------------------------------------------------------------------------------
# What copies the registry is generated from it
# ----------------------------------------------------------------------------------------------

def test_schema_params_comment_and_docs_table_are_generated_from_the_registry():
    assert sync_losses.stale_blocks() == [], "run python -m stages.sync_losses"
    params = load_params(REPO_ROOT / "params.yaml")
    for name in DPO_LOSSES:                     # the schema's enum is the registry: each name passes the pre-flight
        p = copy.deepcopy(params)
        p["dpo"].update(loss=name, objective="dpo_ref_free" if LOSSES[name].reference_free else "dpo",
                        label_smoothing=_eps(LOSSES[name]))
        validate_params(p)
    p = copy.deepcopy(params)
    p["dpo"]["loss"] = "kto"
    with pytest.raises(ParamsError, match=r"dpo\.loss"):
        validate_params(p)
    from stages.lib.params import load_schema
    dpo_keys = set(load_schema()["properties"]["dpo"]["properties"])
    assert set(KNOBS) <= dpo_keys
    text = (REPO_ROOT / "docs/DPO_LOSSES.md").read_text()
    assert all(f"| `{name}` |" in text for name in DPO_LOSSES)


def test_a_stale_block_is_named(tmp_path):
    for rel, *_ in sync_losses.BLOCKS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((REPO_ROOT / rel).read_text())
    doc = tmp_path / "docs/DPO_LOSSES.md"
    doc.write_text(doc.read_text().replace("| `hinge` |", "| `hinge2` |"))
    assert sync_losses.stale_blocks(tmp_path) == ["docs/DPO_LOSSES.md: dpo.loss table"]
    assert sync_losses.write_blocks(tmp_path) == ["docs/DPO_LOSSES.md"]
    assert sync_losses.stale_blocks(tmp_path) == []


# ----------------------------------------------------------------------------------------------
# A new loss reruns train_dpo and what follows it, nothing before
# ----------------------------------------------------------------------------------------------

def test_only_train_dpo_runs_the_loss_files():
    for module in ("stages.environment", "stages.normalize", "stages.freeze_probe", "stages.verify_ref",
                   "stages.tokenize", "stages.ref_logps", "stages.train_rm"):
        deps = code_deps(module)
        assert LOSSES_FILE not in deps and "stages/engine/dpo_objective.py" not in deps, module
    assert {LOSSES_FILE, "stages/engine/dpo_objective.py"} <= set(code_deps("stages.train_dpo"))


# What docs/ARCHITECTURE.md "How to add a DPO loss" says to write: one declared formula, above the derived section.
TOY_LOSS = '''
@dpo_loss("toy_square", summary="toy: (1 - beta h)^2", trl="none", difference="not a TRL loss")
def _toy_square(x):
    return (1 - x.beta * x.logits) ** 2


'''


def test_adding_a_loss_touches_one_code_file_and_reruns_train_dpo_and_the_report(tmp_path):
    repo = copy_checkout(tmp_path / "repo")
    losses = repo / LOSSES_FILE
    text = losses.read_text()
    banner = "# ----------------------------------------------------------------------------------------------\n" \
             "# Derived from the declarations"
    assert text.count(banner) == 1
    losses.write_text(text.replace(banner, TOY_LOSS.lstrip("\n") + banner))
    before = yaml.safe_load((repo / "params.yaml").read_text())
    sh(sys.executable, "-m", "stages.sync_losses", cwd=repo)                 # the generated copies
    changed = set(sh("git", "diff", "--name-only", cwd=repo).split())
    assert changed == {LOSSES_FILE, "workflow/schemas/params.schema.yaml", "params.yaml", "docs/DPO_LOSSES.md"}
    assert yaml.safe_load((repo / "params.yaml").read_text()) == before          # comments only: no DVC param moved
    # dvc.yaml (generated from the rules, checked by tests/workflow/test_dag.py) is still the DAG's, and the stages
    # that list a changed file as a dependency are train_dpo (the code) and report (it packs params.yaml byte for
    # byte, and the loss list in its comments changed): evaluate follows from train_dpo's outputs.
    sh(sys.executable, "workflow/sync_dvc.py", "--check", cwd=repo)
    dvc = yaml.safe_load((repo / "dvc.yaml").read_text())
    direct = {name: changed & set(st.get("deps", [])) for name, st in dvc["stages"].items()}
    assert {name: files for name, files in direct.items() if files} == {"train_dpo": {LOSSES_FILE},
                                                                        "report": {"params.yaml"}}
    # the loss works: the pre-flight accepts it, the objective computes it
    probe = textwrap.dedent('''
        import copy, torch
        from stages.lib.params import load_params, validate_params
        from stages.engine.dpo_losses import dpo_pair_losses, LOSSES
        p = load_params("params.yaml"); p["dpo"]["loss"] = ["sigmoid", "toy_square"]; validate_params(p)
        x = torch.tensor([-3.0, -1.0]); z = torch.zeros(2)
        got = dpo_pair_losses(x, z - 2, z, z, beta=0.5, loss_type="toy_square")
        assert torch.allclose(got, (1 - 0.5 * (x + 2)) ** 2), got
        assert not LOSSES["toy_square"].reference_free and not LOSSES["toy_square"].lengths
        print("ok")
    ''')
    out = subprocess.run([sys.executable, "-c", probe], cwd=repo, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
