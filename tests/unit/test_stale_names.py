"""Comments, docstrings and templates under flashgen/ and templates/ name files that exist
and no removed environment switch: a file path (``flashgen/analysis/rowcol.py``,
``templates/common/decode.cuh``, ``tests/unit/test_decode.py``) is looked up from the
repository root, a bare file name (``maskinfo.py``) anywhere in the checkout's code.

``RENDERED`` lists the stale names left in text that reaches the rendered CUDA (``//``
comments of templates and the ``.cuh`` headers they include, comments the classifier
emits): changing them changes every unit hash of ``tests/fixtures/unit_hashes.json``, so
they are fixed together with its next regeneration, and this list only shrinks."""

from __future__ import annotations

import re
from pathlib import Path

from flashgen import env

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    p for d in ("flashgen", "templates") for p in (REPO / d).rglob("*")
    if p.suffix in (".py", ".j2", ".cuh", ".lark") and p.is_file()
)  # fmt: skip
PATH = re.compile(
    r"(?<![\w/.])((?:flashgen|templates|tests|tools)/[\w/.-]*\.(?:py|j2|cuh|lark|json))"
)
BARE = re.compile(r"(?<![\w/.`-])([a-z_][a-z0-9_]*\.(?:py|j2|cuh|lark))\b")
SWITCH = re.compile(r"\bFLASHGEN_[A-Z0-9_]+\b")

#: (file, stale name): in rendered CUDA text, see the module docstring
RENDERED = {
    ("flashgen/analysis/masktiles.py", "flashgen/masktiles.py"),
    ("templates/common/mma_sm80.cuh", "flashgen/lower.py"),
    ("templates/common/mma_sm80.cuh", "FLASHGEN_NONNEG_DIV"),
    ("templates/common/masktiles.cuh", "flashgen/masktiles.py"),
    ("templates/common/masktiles.cuh", "flashgen/maskinfo.py"),
    ("templates/common/decode.cuh", "tests/unit/test_decode_host.py"),
    ("templates/sm_90/fwd.cu.j2", "flashgen/masktiles.py"),
    ("templates/sm_90/fwd.cu.j2", "flashgen/rowcol.py"),
    ("templates/sm_90/fwd.cu.j2", "lower.py"),
    ("templates/sm_90/bwd.cu.j2", "flashgen/masktiles.py"),
    ("templates/sm_80/fwd.cu.j2", "flashgen/masktiles.py"),
    ("templates/sm_80/fwd.cu.j2", "flashgen/affine.py"),
    ("templates/sm_80/fwd.cu.j2", "flashgen/rowcol.py"),
    ("templates/sm_80/bwd.cu.j2", "flashgen/masktiles.py"),
    ("templates/sm_80/bwd.cu.j2", "flashgen/rowcol.py"),
    ("templates/sm_80/blockmask.cu.j2", "flashgen/rowcol.py"),
}


def _code_file_names() -> set[str]:
    return {
        p.name for d in ("flashgen", "templates", "tests", "tools") for p in (REPO / d).rglob("*")
        if p.is_file()
    }  # fmt: skip


def _exists(ref: str) -> bool:
    packaged = ref.replace("flashgen/templates/", "templates/")  # the wheel's name for templates/
    return (REPO / ref).exists() or (REPO / packaged).exists()


def stale_names() -> set[tuple[str, str]]:
    names, found = _code_file_names(), set()
    for src in SOURCES:
        rel, text = str(src.relative_to(REPO)), src.read_text(errors="replace")
        found |= {(rel, m) for m in PATH.findall(text) if not _exists(m)}
        found |= {(rel, m) for m in BARE.findall(text) if m not in names}
        if rel != "flashgen/env.py":
            found |= {(rel, m) for m in SWITCH.findall(text) if m in env.REMOVED}
    return found


def test_comments_and_templates_name_files_and_switches_that_exist():
    stale = stale_names() - RENDERED
    assert not stale, "stale names:\n" + "\n".join(f"{f}: {n}" for f, n in sorted(stale))


def test_the_rendered_exceptions_are_still_there():
    """An entry of RENDERED that was fixed leaves the list (it only shrinks)."""
    assert RENDERED <= stale_names(), sorted(RENDERED - stale_names())


def test_the_check_finds_a_stale_name(tmp_path):
    text = "# see flashgen/lower.py and masktilez.py, and FLASHGEN_NONNEG_DIV\n"
    assert PATH.findall(text) == ["flashgen/lower.py"] and not _exists("flashgen/lower.py")
    assert "masktilez.py" in BARE.findall(text) and "masktilez.py" not in _code_file_names()
    assert SWITCH.findall(text)[0] in env.REMOVED
