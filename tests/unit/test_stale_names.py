"""Comments, docstrings, strings and templates name files and modules that exist and no
removed environment switch.  Read: flashgen/ and templates/ (everything below), tests/
(paths and module names) and flashgen/tuning/*.json (paths):

- a file path (``flashgen/analysis/rowcol.py``, ``templates/common/decode.cuh``,
  ``tests/unit/test_decode.py``, ``tools/sanitize.py``; in the JSON also a benchmark run's
  ``benchmarks/results/<run>/<file>``) is looked up from the repository root, a template
  path as templates name each other (``common/decode.cuh``, ``sm_90/fwd.cu.j2``) under
  templates/;
- a bare file name (``maskinfo.py``, ``fwd.cu.j2``) must be some file's name in flashgen/,
  templates/, tests/ or tools/ (flashgen/ and templates/ only: tests name scratch files);
- a dotted module name (``flashgen.ops.decode.fast``) must reach a module or package, and a
  name after it (``flashgen.analysis.rowcol.row_terms``, ``flashgen.ops.op.AttentionOp``)
  must be one that module defines, assigns or imports at its top level (or lists in
  ``__all__``; a module with a ``__getattr__`` may export any name its text mentions);
  a template is read whole (comments, ``static_assert`` messages), Python whole;
  ``flashgen.<spec>.<overload>`` is a torch op's name (``torch.ops.flashgen.alibi.out``).

What follows the first name after a module (``AttentionOp.attention``) is not checked.  Not
read: benchmarks/results/ and docs/ (dated records of their runs: a run's README names the
scripts of its day), and this file (its examples are stale on purpose).  There is no list
of exceptions otherwise: a stale name in a template is fixed there (the rendered CUDA
changes: regenerate ``generated/`` and ``tests/fixtures/unit_hashes.json``)."""
from __future__ import annotations

import ast
import functools
import json
import re
from pathlib import Path

from flashgen import env

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    p for d in ("flashgen", "templates") for p in (REPO / d).rglob("*")
    if p.suffix in (".py", ".j2", ".cuh", ".lark") and p.is_file()
)  # fmt: skip
#: tests: their paths and module names (not bare names: tests name scratch files), and the
#: tuning table's JSON (an entry's "source" names the run it came from)
TESTS = sorted(p for p in (REPO / "tests").rglob("*.py") if p.name != Path(__file__).name)
DATA = sorted((REPO / "flashgen" / "tuning").glob("*.json"))
PATH = re.compile(
    r"(?<![\w/.])((?:flashgen|templates|tests|tools)/[\w/.-]*\.(?:py|j2|cuh|lark|json))"
)
#: a benchmark run's file, as the tuning table cites it (in code such a path is an output)
RUN = re.compile(r"(?<![\w/.])(benchmarks/results/[\w.-]+/[\w/.-]+)")
#: a template's name for another template (``{% include "common/x.cuh" %}``, comments)
TEMPLATE = re.compile(r"(?<![\w/.-])((?:common|sm_80|sm_90)/[\w.-]+\.(?:j2|cuh))\b")
BARE = re.compile(r"(?<![\w/.`-])([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)*\.(?:py|j2|cuh|lark))\b")
DOTTED = re.compile(r"(?<![\w.])(flashgen(?:\.\w+)+)")
#: ``flashgen.<spec>.<overload>``: a torch op's name (``torch.ops.flashgen.alibi.default``)
OPS = {p.stem for p in (REPO / "specs").glob("*.yaml")}
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


@functools.cache
def _top_names(module: Path) -> tuple[frozenset[str], bool]:
    """The names module file ``module`` binds at its top level (in ``if`` / ``try`` blocks
    too: ``TYPE_CHECKING`` imports) and lists in ``__all__``, and whether it defines a
    module ``__getattr__`` (lazy exports)."""
    tree = ast.parse(module.read_text())
    names: set[str] = set()
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                names |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            stack += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            stack += [s for h in getattr(node, "handlers", []) for s in h.body]
    return frozenset(names), "__getattr__" in names


def _module_exists(dotted: str) -> bool:
    """Whether ``dotted`` reaches a flashgen module or package and, where a name follows it,
    whether that module binds the name (:func:`_top_names`; any name its text mentions if it
    has a module ``__getattr__``).  What follows that first name is not checked."""
    for pkg, folder in PACKAGE_DIRS.items():
        if dotted == pkg or dotted.startswith(pkg + "."):
            return (REPO / folder).is_dir()
    parts = dotted.split(".")
    path, i = REPO / parts[0], 1
    while i < len(parts) and (path / parts[i] / "__init__.py").is_file():
        path, i = path / parts[i], i + 1
    if i < len(parts) and (path / f"{parts[i]}.py").is_file():
        module, i = path / f"{parts[i]}.py", i + 1
    else:
        module = path / "__init__.py"
    if i == len(parts):
        return True
    names, lazy = _top_names(module)
    if parts[i] in names:
        return True
    return lazy and re.search(rf"\b{re.escape(parts[i])}\b", module.read_text()) is not None


def stale_in(rel: str, text: str, names: set[str]) -> set[tuple[str, str]]:
    """The stale names of one source ``rel`` (its path from the repository root) with
    ``text``; ``names``: every file name of the checkout's code (:func:`_code_file_names`).
    A test (``tests/``) is read for paths and module names, a JSON file for paths."""
    found = {(rel, m) for m in PATH.findall(text) if not _exists(m)}
    if rel.endswith(".json"):
        return found | {(rel, m) for m in RUN.findall(text) if not (REPO / m).exists()}
    found |= {
        (rel, m) for m in DOTTED.findall(text)
        if m.split(".")[1] not in OPS and not _module_exists(m)
    }  # fmt: skip
    if rel.startswith("tests/"):
        return found
    found |= {(rel, m) for m in TEMPLATE.findall(text) if not (REPO / "templates" / m).is_file()}
    found |= {(rel, m) for m in BARE.findall(text) if m not in names}
    if rel != "flashgen/env.py":
        found |= {(rel, m) for m in SWITCH.findall(text) if m in env.REMOVED}
    return found


def stale_names() -> set[tuple[str, str]]:
    names, found = _code_file_names(), set()
    for src in [*SOURCES, *TESTS, *DATA]:
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


def test_the_check_reads_templates_whole_and_module_names():
    """A template's comment or string (a ``static_assert``'s message) that names a template, a
    bare multi-dot file or a flashgen module that is not there is found; names that exist
    pass, and a Python file's text is read whole."""
    text = (
        "// see common/masktilez.cuh, fwd.cu.j3.j2 and flashgen.ops.decode_fast\n"
        "{# flashgen.lower.atomic_dq_warp_grid #}\n"
        'static_assert(true, "flashgen.lower");  // flashgen.ops.decode.fast is fine\n'
        "// flashgen.load, flashgen.templates, flashgen.ops.prefill.attention.AttentionOp,\n"
        "// common/masktiles.cuh, sm_90/fwd.cu.j2, fwd.cu.j2\n"
    )
    found = {n for _, n in stale_in("templates/common/x.cuh", text, _code_file_names())}
    assert found == {"common/masktilez.cuh", "fwd.cu.j3.j2", "flashgen.ops.decode_fast",
                     "flashgen.lower.atomic_dq_warp_grid", "flashgen.lower"}  # fmt: skip
    found = {n for _, n in stale_in("flashgen/x.py", text, _code_file_names())}
    assert "flashgen.lower" in found


def test_the_check_finds_a_name_its_module_does_not_define():
    """A module that exists with a name it no longer defines is stale
    (``flashgen.ops.op._tile_counter`` moved to ``flashgen.ops.prefill.attention``); names
    a module imports, assigns, lists in ``__all__`` or defines under ``TYPE_CHECKING`` pass,
    and so do torch op names."""
    text = (
        "one per captured call, ``flashgen.ops.op._tile_counter``; "
        "``flashgen.ops.prefill.attention._tile_counter``, flashgen.ops.op.AttentionOp, "
        "flashgen.AttentionOp, flashgen.load, flashgen.env.REMOVED, flashgen.__version__, "
        "flashgen.families.fa2_fwd.plan, flashgen.families.fa2_fwd.TEMPLATE.split, "
        'want = "flashgen.alibi.default"  # torch.ops.flashgen.alibi.default\n'
    )
    found = {n for _, n in stale_in("flashgen/x.py", text, _code_file_names())}
    assert found == {"flashgen.ops.op._tile_counter"}
    assert not _module_exists("flashgen.families.fa2_fwd.lower")
    assert _module_exists("flashgen.families.fa2_fwd")


def test_the_check_reads_tests_and_the_tuning_table():
    """Tests are read for paths and module names (``tests/gpu/conftest.py`` moved to
    ``tests/conftest.py``; ``flashgen.ops.op._eager_cuda``), not bare names or switches; the
    tuning table's JSON for paths (a removed tool) and the benchmark run it cites."""
    text = (
        '"""(``tests/gpu/conftest.py``), ``flashgen.ops.op._eager_cuda``, scratch.py, '
        'FLASHGEN_NONNEG_DIV, tests/conftest.py, flashgen.ops.prefill.attention._eager_cuda"""'
    )
    found = {n for _, n in stale_in("tests/gpu/x.py", text, _code_file_names())}
    assert found == {"tests/gpu/conftest.py", "flashgen.ops.op._eager_cuda"}
    run = "benchmarks/results/h200-2026-11-30-s7/d128_sweep.json"
    text = json.dumps({"entries": {"k": {"source": "tools/perf_sweep.py --write-table"},
                                   "j": {"source": f"the sweep in {run}"},
                                   "i": {"source": f"{run.replace('s7', 's99')}"}}})  # fmt: skip
    found = {n for _, n in stale_in("flashgen/tuning/x.json", text, _code_file_names())}
    assert found == {"tools/perf_sweep.py", run.replace("s7", "s99")}
