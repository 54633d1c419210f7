"""The documentation: the README stays short, docs/ builds with MkDocs in strict mode (no broken link or
anchor), and every Python block says whether a test runs it."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.components import require_module

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md"))
MARK = re.compile(r"<!-- (not run: .+|runs in (\S+)) -->")


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_docs_build_in_strict_mode(tmp_path):
    """Every page in mkdocs.yml's nav, every link and anchor between pages resolves (MkDocs' validation
    settings warn, and --strict fails on a warning)."""
    require_module("mkdocs")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_the_readmes_links_lead_to_pages():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    assert links and [link for link in links if not (ROOT / link).exists()] == []


@pytest.mark.parametrize("page", [ROOT / "README.md", *PAGES], ids=lambda p: p.name)
def test_every_python_block_is_run_by_a_test_or_marked_not_run(page):
    """A ```python block follows ``<!-- runs in tests/X.py -->`` (that test reads the page) or
    ``<!-- not run: why -->``."""
    lines = page.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("```python"):
            mark = MARK.fullmatch(lines[i - 1].strip()) if i else None
            assert mark, f"{page.name}:{i + 1}: a Python block without <!-- runs in ... --> or <!-- not run: ... -->"
            if mark.group(2):
                test = ROOT / mark.group(2)
                assert test.is_file() and page.name in test.read_text(), f"{page.name}:{i + 1}: {mark.group(2)}"


@pytest.mark.parametrize("page", [ROOT / "README.md", *PAGES], ids=lambda p: p.name)
def test_every_code_block_is_closed(page):
    """An unpaired fence turns the rest of the page into one code block (MkDocs builds it without a word)."""
    fences = [i + 1 for i, line in enumerate(page.read_text().splitlines()) if line.lstrip().startswith("```")]
    assert len(fences) % 2 == 0, f"{page.name}: fences at lines {fences}"
