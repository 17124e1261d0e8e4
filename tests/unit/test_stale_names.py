"""Comments, docstrings and templates under flashgen/ and templates/ name files and modules
that exist and no removed environment switch:

- a file path (``flashgen/analysis/rowcol.py``, ``templates/common/decode.cuh``,
  ``tests/unit/test_decode.py``) is looked up from the repository root, a template path as
  templates name each other (``common/decode.cuh``, ``sm_90/fwd.cu.j2``) under templates/;
- a bare file name (``maskinfo.py``, ``fwd.cu.j2``) must be some file's name in flashgen/,
  templates/, tests/ or tools/;
- a dotted module name (``flashgen.ops.decode.fast``, ``flashgen.analysis.rowcol.row_terms``)
  must reach a module (what follows it is an attribute, not checked) or a name its package's
  ``__init__`` defines; in templates only their comments (``//``, ``{# #}``) are read for these,
  in Python everything.

There is no list of exceptions: a stale name in a template's comment is fixed there (the
rendered CUDA changes in its comments only: regenerate ``generated/`` and
``tests/fixtures/unit_hashes.json``)."""

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
#: a template's name for another template (``{% include "common/x.cuh" %}``, comments)
TEMPLATE = re.compile(r"(?<![\w/.-])((?:common|sm_80|sm_90)/[\w.-]+\.(?:j2|cuh))\b")
BARE = re.compile(r"(?<![\w/.`-])([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)*\.(?:py|j2|cuh|lark))\b")
DOTTED = re.compile(r"(?<![\w.])(flashgen(?:\.\w+)+)")
SWITCH = re.compile(r"\bFLASHGEN_[A-Z0-9_]+\b")
#: a template's comments: ``// ...`` and ``{# ... #}``
COMMENT = re.compile(r"//[^\n]*|\{#.*?#\}", re.S)
#: packages that the wheel maps to other folders (pyproject's package-dir)
PACKAGE_DIRS = {"flashgen.templates": "templates", "flashgen.specs": "specs"}


def _code_file_names() -> set[str]:
    return {
        p.name for d in ("flashgen", "templates", "tests", "tools") for p in (REPO / d).rglob("*")
        if p.is_file()
    }  # fmt: skip


def _exists(ref: str) -> bool:
    packaged = ref.replace("flashgen/templates/", "templates/")  # the wheel's name for templates/
    return (REPO / ref).exists() or (REPO / packaged).exists()


def _module_exists(dotted: str) -> bool:
    """Whether ``dotted`` reaches a flashgen module, or a name its package's ``__init__.py``
    defines or imports (``flashgen.load``, lazily exported too); the rest of the name is an
    attribute of that module, which this does not check."""
    parts = dotted.split(".")
    for pkg, folder in PACKAGE_DIRS.items():
        if dotted == pkg or dotted.startswith(pkg + "."):
            return (REPO / folder).is_dir()
    path = REPO / parts[0]
    for part in parts[1:]:
        if (path / part / "__init__.py").is_file():
            path = path / part
            continue
        if (path / f"{part}.py").is_file():
            return True
        return re.search(rf"\b{re.escape(part)}\b", (path / "__init__.py").read_text()) is not None
    return True


def stale_in(rel: str, text: str, names: set[str]) -> set[tuple[str, str]]:
    """The stale names of one source ``rel`` (its path from the repository root) with
    ``text``; ``names``: every file name of the checkout's code (:func:`_code_file_names`)."""
    found = set()
    found |= {(rel, m) for m in PATH.findall(text) if not _exists(m)}
    found |= {(rel, m) for m in TEMPLATE.findall(text) if not (REPO / "templates" / m).is_file()}
    found |= {(rel, m) for m in BARE.findall(text) if m not in names}
    prose = text if rel.endswith(".py") else "\n".join(COMMENT.findall(text))
    found |= {(rel, m) for m in DOTTED.findall(prose) if not _module_exists(m)}
    if rel != "flashgen/env.py":
        found |= {(rel, m) for m in SWITCH.findall(text) if m in env.REMOVED}
    return found


def stale_names() -> set[tuple[str, str]]:
    names, found = _code_file_names(), set()
    for src in SOURCES:
        found |= stale_in(str(src.relative_to(REPO)), src.read_text(errors="replace"), names)
    return found


def test_comments_and_templates_name_files_and_switches_that_exist():
    stale = stale_names()
    assert not stale, "stale names:\n" + "\n".join(f"{f}: {n}" for f, n in sorted(stale))


def test_the_check_finds_a_stale_name():
    text = "# see flashgen/lower.py and masktilez.py, and FLASHGEN_NONNEG_DIV\n"
    assert PATH.findall(text) == ["flashgen/lower.py"] and not _exists("flashgen/lower.py")
    assert "masktilez.py" in BARE.findall(text) and "masktilez.py" not in _code_file_names()
    assert SWITCH.findall(text)[0] in env.REMOVED


def test_the_check_reads_template_comments_and_module_names():
    """A template's comment that names a template, a bare multi-dot file or a flashgen module
    that is not there is found; a module name in its code is not read (a static_assert's
    message is kernel code), names that exist pass, and a Python file's text is read whole."""
    text = (
        "// see common/masktilez.cuh, fwd.cu.j3.j2 and flashgen.ops.decode_fast\n"
        "{# flashgen.lower.atomic_dq_warp_grid #}\n"
        'static_assert(true, "flashgen.lower");  // flashgen.ops.decode.fast is fine\n'
        "// flashgen.load, flashgen.templates, flashgen.ops.prefill.attention.AttentionOp,\n"
        "// common/masktiles.cuh, sm_90/fwd.cu.j2, fwd.cu.j2\n"
    )
    found = {n for _, n in stale_in("templates/common/x.cuh", text, _code_file_names())}
    assert found == {"common/masktilez.cuh", "fwd.cu.j3.j2", "flashgen.ops.decode_fast",
                     "flashgen.lower.atomic_dq_warp_grid"}  # fmt: skip
    found = {n for _, n in stale_in("flashgen/x.py", text, _code_file_names())}
    assert "flashgen.lower" in found
