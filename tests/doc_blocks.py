"""The code blocks of the README and docs/ that the tests run: ```python cpu blocks
(tests/unit/test_docs.py, on any machine) and ```python gpu blocks (tests/gpu/test_docs_gpu.py,
on a CUDA device)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def blocks(kind: str) -> list[tuple[Path, int, str]]:
    """``(page, line, code)`` of every ```python KIND block (``kind``: "cpu" or "gpu"), its
    line the fence's, 1-based."""
    fence = re.compile(rf"^```python {kind}\n(.*?)^```", re.S | re.M)
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in fence.finditer(text):
            found.append((page, text[: m.start()].count("\n") + 1, m.group(1)))
    return found
