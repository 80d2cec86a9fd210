"""The GPU benchmark's workload builders, on CPU: long concatenations and the patched TRL anchor."""
from __future__ import annotations

import gzip
import json
import sys

import pytest

from conftest import REPO_ROOT, SHARED_DATA

sys.path.insert(0, str(REPO_ROOT / "bench"))
import gpu_bench  # noqa: E402

ANCHOR = SHARED_DATA.parent / "bench" / "trl_anchor.py"


def test_long_concatenations_are_hh_dialogues_ending_in_each_rows_own_pair(tmp_path):
    rows = [{"chosen": f"\n\nHuman: q{i}\n\nAssistant: good{i}", "rejected": f"\n\nHuman: q{i}\n\nAssistant: bad{i}"}
            for i in range(6)]
    src = tmp_path / "hh.jsonl.gz"
    with gzip.open(src, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    assert gpu_bench.hh_lines(src, 1) == [json.dumps(r) for r in rows]
    out = [json.loads(line) for line in gpu_bench.hh_lines(src, 3)]
    assert len(out) == 4
    context = rows[1]["chosen"] + rows[2]["chosen"]
    assert out[1] == {"chosen": context + rows[3]["chosen"], "rejected": context + rows[3]["rejected"]}


def test_trl_anchor_patch_changes_only_the_workload(tmp_path):
    if not ANCHOR.exists():
        pytest.skip(f"TRL anchor not present at {ANCHOR}")
    data = tmp_path / "rows.jsonl.gz"
    patched = gpu_bench.patched_trl_anchor(ANCHOR, "qwen2.5-1.5b", 4096, data, tmp_path / "anchor.py").read_text()
    original = ANCHOR.read_text()
    changed = [(a, b) for a, b in zip(original.splitlines(), patched.splitlines()) if a != b]
    assert len(original.splitlines()) == len(patched.splitlines()) and len(changed) == 4
    assert "hidden_size=1536, intermediate_size=8960" in patched and "num_attention_heads=12" in patched
    assert "max_length=4096" in patched and ", 4096)" in patched and json.dumps(str(data)) in patched
    # the default workload leaves the anchor as it is; an anchor that no longer matches fails loudly
    assert gpu_bench.patched_trl_anchor(ANCHOR, "qwen2.5-0.5b", 1024, None, tmp_path / "same.py").read_text() == original
    other = tmp_path / "other_anchor.py"
    other.write_text(original.replace("max_length=1024", "max_length=2048"))
    with pytest.raises(SystemExit, match="cannot patch"):
        gpu_bench.patched_trl_anchor(other, "qwen2.5-0.5b", 4096, None, tmp_path / "x.py")


@pytest.mark.skipif(not (SHARED_DATA / "hh-rlhf").exists(), reason=f"shared data not present at {SHARED_DATA}")
def test_step_profile_profiles_the_real_stage_on_cpu(tmp_path):
    """bench/step_profile.py drives the train_dpo stage with PREFPIPE_PROFILE: the first-step and steady
    windows come back as tables and a summary, and the run itself completes (tiny shape, CPU)."""
    import step_profile
    out = tmp_path / "results" / "profile.json"
    step_profile.main(["--shared", str(SHARED_DATA.parent), "--out", str(out), "--shape", "tiny", "--pairs", "40",
                       "--variants", "eager", "--profile-start", "2", "--profile-steps", "2",
                       "--work", str(tmp_path / "work")])
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert run["stage"] == "train_dpo" and run["cuda_graphs"]["enabled"] is False
    prof = run["profile"]
    assert prof["first_step"]["first_step"] == 0 and prof["first_step"]["steps"] == 1
    assert prof["steady"]["first_step"] == 2 and prof["steady"]["steps"] == 2
    assert prof["steady"]["ms_per_step"] > 0
    steady = (out.parent / "step_profile_train_dpo_eager_steady.txt").read_text()
    assert "optimizer steps 2..3" in steady and "aten::mm" in steady
    assert "aten::" in (out.parent / "step_profile_train_dpo_eager_first_step.txt").read_text()
