"""Versioned records (issue 35 item 4): every record a stage writes carries its `format`, writes every field (null
where unset) instead of dropping unset ones to keep older hashes, and docs/ARTIFACTS.md "Record formats" lists every
format the code declares."""
from __future__ import annotations

import re
from dataclasses import fields

from conftest import REPO_ROOT


def _declared_formats() -> set[str]:
    """Every "prefpipe-<name>/<n>" string constant in stages/ (record_formats.py and the formats that predate it)."""
    out = set()
    for path in (REPO_ROOT / "stages").rglob("*.py"):
        out |= set(re.findall(r'^[A-Z_]+ = "(prefpipe-[a-z0-9-]+/\d+)"', path.read_text(), re.M))
    return out


def test_docs_list_every_record_format_and_no_other():
    text = (REPO_ROOT / "docs/ARTIFACTS.md").read_text()
    section = text[text.index("## Record formats"):]
    section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
    listed = set(re.findall(r"`(prefpipe-[a-z0-9-]+/\d+)`", section))
    assert listed == _declared_formats(), (listed ^ _declared_formats())


def test_train_settings_record_writes_every_field_null_where_unset():
    from engine_helpers import train_settings
    from stages.engine.settings import TrainSettings
    from stages.lib.params import TRAIN_DISPLAY_ONLY
    rec = train_settings().record()
    # no field dropped at its default; the display-only ones (train.tensorboard) are never a run's record
    assert set(rec) == {f.name for f in fields(TrainSettings)} - TRAIN_DISPLAY_ONLY
    assert train_settings(tensorboard=True).record() == rec
    assert rec["adapter"] is None and rec["optimizer"] is None and rec["max_steps"] is None
    assert rec["eval_every"] == 0 and rec["select_best"] is False
    # the default optimizer spelled out is the default: null, the same record
    assert train_settings(optimizer={"state": "exact", "fused_backward": False}).record() == rec


def test_dpo_fingerprint_names_every_knob_whatever_the_loss():
    from stages.engine.dpo_losses import KNOBS
    from stages.engine.dpo_objective import DPOObjective
    from stages.lib.implicit_reward import SUMMED_REWARD
    base = {"objective": "dpo_ref_free", "beta": 0.1, "loss": "sigmoid", "label_smoothing": 0.0}
    fp = DPOObjective(base).fingerprint()
    assert {"loss_weights", "implicit_reward", *KNOBS} <= set(fp)
    assert fp["loss_weights"] is None and fp["implicit_reward"] == SUMMED_REWARD
    assert all(fp[k] is None for k in KNOBS)               # sigmoid reads no knob
    simpo = DPOObjective({**base, "loss": "simpo"}).fingerprint()
    assert set(simpo) == set(fp) and simpo["simpo_gamma"] is not None


def test_checkpoint_of_an_older_format_is_refused_naming_the_format():
    from stages.engine.checkpoint import FORMAT, incompatibilities
    from stages.lib import record_formats
    assert FORMAT == record_formats.CHECKPOINT
    header = {"format": FORMAT}
    problems = incompatibilities({"format_version": 2, "objective": "dpo"}, header)
    assert len(problems) == 1 and "unversioned (format_version 2)" in problems[0] and FORMAT in problems[0]
    assert FORMAT in incompatibilities({"format": "prefpipe-checkpoint/2"}, header)[0]


def test_tokenize_records_carry_their_format_and_every_field():
    from stages.lib import record_formats
    from stages.tokenize import probe_token_manifest, tokenize_report
    m = probe_token_manifest([], "d" * 64, "t" * 64)
    assert m["format"] == record_formats.PROBE_TOKEN_MANIFEST and m["limits"] is None
    assert tokenize_report({}, _limits(), "plain", "t")["format"] == record_formats.TOKENIZE_REPORT


def _limits():
    from stages.data.limits import TokenizeLimits
    return TokenizeLimits(max_length=64, max_prompt_length=32, truncation="reject")
