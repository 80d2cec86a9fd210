"""README.md is a guide that starts with the two commands CI and users run, and the documentation's links hold.

- README stays short (the measurements live in docs/PERFORMANCE.md) and opens with the two set-up commands; the
  second is the line `.ci/run` greps and runs, so it must be the first line that grep finds.
- Every relative Markdown link in README.md, docs/*.md and bench/README.md names a file that exists, and a
  `#section` link a heading of that file (GitHub's anchors).
- A reference to a README section by name anywhere in the repository (`README "Using real data"`,
  `README: Running on a Slurm cluster`) names a heading README has.
"""
from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from conftest import REPO_ROOT

README = REPO_ROOT / "README.md"
MAX_README_LINES = 260
# Command 1 installs the runtime lock, command 2 the test lock (the runtime plus the `test` extra): requirements/refresh.
INSTALL = "pip install --require-hashes -r requirements/{} && pip install --no-deps -e . && "
COMMANDS = (INSTALL.format("lock.txt") + "snakemake --cores 2",
            INSTALL.format("test-lock.txt") + "python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder")

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def doc_files() -> list[Path]:
    return [README, *sorted((REPO_ROOT / "docs").glob("*.md")), REPO_ROOT / "bench" / "README.md"]


def prose(text: str) -> str:
    """The text outside code: fenced blocks and inline code spans hold commands, not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def heading_texts(text: str) -> list[str]:
    return [m.group(1) for m in HEADING.finditer(FENCE.sub("", text))]


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: the rendered text (code marks and link targets dropped), lower case, without
    punctuation other than '-' and '_', spaces as '-'."""
    rendered = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", rendered.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor; a repeated one gets -1, -2, ... as on GitHub."""
    seen: Counter = Counter()
    out = set()
    for heading in heading_texts(path.read_text(encoding="utf-8")):
        slug = github_anchor(heading)
        out.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return out


def broken_links(path: Path) -> list[str]:
    problems = []
    for target in LINK.findall(prose(path.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):     # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(REPO_ROOT)}: ({target})"
        if not dest.exists():
            problems.append(f"{where}: no such file {dest}")
        elif anchor and anchor not in anchors(dest):
            problems.append(f"{where}: {dest.name} has no heading with anchor #{anchor}")
    return problems


# ------------------------------------------------------------------------------------------------- README's shape

def test_readme_is_a_short_guide():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): measurements go to " \
                                  "docs/PERFORMANCE.md"


def test_readme_starts_with_the_two_commands():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("# "), "the title line comes first"
    body = [line for line in lines[1:] if line.strip()]
    assert body[0] == "```bash" and body[3] == "```", "right after the title: one bash block with the two commands"
    assert tuple(body[1:3]) == COMMANDS


def test_ci_runs_readmes_second_command():
    """.ci/run takes the first README line its grep matches as the test command: it must be command 2."""
    ci = (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8")
    m = re.search(r"grep -m1 -E '([^']+)' README\.md", ci)
    assert m, ".ci/run no longer greps README.md for its test command: update this test"
    first = next(line for line in README.read_text(encoding="utf-8").splitlines() if re.search(m.group(1), line))
    assert first == COMMANDS[1]


# ------------------------------------------------------------------------------------------------- links

@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_relative_links_point_at_files_and_headings(path):
    assert path.exists(), path
    assert broken_links(path) == []


def test_link_checker_catches_a_missing_file_and_a_missing_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO_ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# Other\n\n## The 0.5B run, ours\n\n## Twice\n\n## Twice\n")
    good = tmp_path / "good.md"
    good.write_text("[a](other.md) [b](other.md#the-05b-run-ours) [c](other.md#twice-1) [d](#self) "
                    "[e](https://example.com/x.md) `[f](missing.md)`\n\n```\n[g](missing.md)\n```\n\n# Self\n")
    assert broken_links(good) == []
    bad = tmp_path / "bad.md"
    bad.write_text("[a](missing.md) [b](other.md#nowhere) [c](#nothing)\n")
    problems = broken_links(bad)
    assert len(problems) == 3
    assert "no such file" in problems[0] and "#nowhere" in problems[1] and "#nothing" in problems[2]


# ------------------------------------------------------------------------------------------------- section names

def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT, capture_output=True, check=True).stdout
    paths = [REPO_ROOT / p for p in out.decode().split("\0") if p]
    return [p for p in paths if p.is_file() and p.suffix in {"", ".md", ".py", ".yaml", ".yml", ".txt", ".smk"}
            and p not in (README, Path(__file__).resolve()) and p.stat().st_size < 1_000_000]   # this file: examples


def readme_section_references(text: str) -> list[str]:
    """Section names that `text` cites: README "Name", README's "Name" or README: Name (a comment may wrap it over
    lines). For the colon form the name is the text that follows, which must start with a heading."""
    flat = re.sub(r"\s*\n\s*(?:#+\s*)?", " ", text)
    refs = re.findall(r"README(?:\.md)?(?:'s)? \"([^\"]+)\"", flat)
    refs += [m + "\0" for m in re.findall(r"README(?:\.md)?: ([A-Z][^\"\n]{0,80})", flat)]
    return refs


def test_references_to_readme_sections_name_its_headings():
    headings = heading_texts(README.read_text(encoding="utf-8"))
    problems = []
    for path in tracked_text_files():
        for ref in readme_section_references(path.read_text(encoding="utf-8", errors="replace")):
            if ref.endswith("\0"):
                ok = any(ref[:-1].startswith(h) for h in headings)
            else:
                ok = ref in headings
            if not ok:
                problems.append(f"{path.relative_to(REPO_ROOT)}: README section {ref.rstrip(chr(0))[:60]!r}")
    assert problems == [], f"README has no such heading (its headings: {headings})"


def test_section_reference_parser():
    text = 'see README "DPO loss conventions", and (README: Running\n  # on a Slurm cluster) or README: "a quote"'
    assert readme_section_references(text) == ["DPO loss conventions", "Running on a Slurm cluster) or README: \0"]
