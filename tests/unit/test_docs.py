"""The README and docs/: every code block marked ```python cpu runs as written on a CPU
machine (each in a fresh interpreter, from an empty directory, so shipped specs by name and
files it writes work as a user's would), and every relative link points at a file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNABLE = re.compile(r"^```python cpu\n(.*?)^```", re.S | re.M)


def _blocks():
    for page in PAGES:
        text = page.read_text()
        for m in RUNNABLE.finditer(text):
            line = text[: m.start()].count("\n") + 1
            yield pytest.param(page, m.group(1), id=f"{page.relative_to(REPO)}:{line}")


def test_the_readme_and_docs_mark_runnable_blocks():
    assert len(list(_blocks())) >= 6


@pytest.mark.parametrize("page, code", _blocks())
def test_a_runnable_block_runs_as_written(page, code, tmp_path):
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO)  # this checkout's flashgen, as an installed one would be
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, f"{page.name}:\n{code}\n{done.stdout}\n{done.stderr}"


def test_the_readme_stays_a_front_door():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 220
    for phrase in ("since fixed", "awaiting", "Awaiting", "validated on", "session "):
        assert phrase not in text, phrase


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_point_at_files(page):
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
        path = (page.parent / target).resolve()
        assert path.exists(), f"{page.name} links to missing {target}"
