"""The documents' generated stage lists (workflow/sync_docs.py) agree with the code: a stage added to the layout, or a
module docstring changed, fails here until `python workflow/sync_docs.py` is run."""
from __future__ import annotations

import shutil
import subprocess
import sys

from conftest import REPO_ROOT


def test_generated_stage_lists_are_current():
    r = subprocess.run([sys.executable, "workflow/sync_docs.py", "--check"], cwd=REPO_ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr


def test_a_new_layout_entry_makes_the_check_fail_naming_the_document(tmp_path):
    for rel in ("workflow/sync_docs.py", "README.md", "docs/ARCHITECTURE.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / rel, tmp_path / rel)
    shutil.copytree(REPO_ROOT / "stages", tmp_path / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    layout = tmp_path / "stages/lib/layout.py"
    layout.write_text(layout.read_text().replace(
        '    "report": {"bundle"', '    "scratch": {"table": "results/scratch/table.json"},\n    "report": {"bundle"', 1))
    (tmp_path / "stages/scratch.py").write_text('"""scratch: a throwaway stage."""\n')
    r = subprocess.run([sys.executable, "workflow/sync_docs.py", "--check"], cwd=tmp_path, capture_output=True,
                       text=True)
    assert r.returncode == 1 and "README.md" in r.stderr and "docs/ARCHITECTURE.md" in r.stderr, r.stderr
    subprocess.run([sys.executable, "workflow/sync_docs.py"], cwd=tmp_path, check=True, capture_output=True)
    assert "| scratch | `results/scratch/table.json` | A throwaway stage. |" in (tmp_path / "README.md").read_text()
