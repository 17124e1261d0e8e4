"""The import graph of the ``flashgen`` package, read from the source (no module is
imported): no cycles among flashgen modules, counting imports inside functions and type-only
imports (``if TYPE_CHECKING:`` blocks) too; the pipeline's planning stages (frontend,
analysis, codegen, families, build) import neither torch nor CuPy (type-only imports, which
never run, left out there); and ``flashgen/ops/``'s subpackages depend one way (op ->
prefill -> decode -> the shared modules -> cpu).

An edge goes from a module to each flashgen module an ``import`` names: ``from flashgen.<a>
import <b>`` to ``flashgen.<a>.<b>`` where that is a module, else to ``flashgen.<a>``; ``import
flashgen`` / ``from flashgen import __version__`` to the package's ``__init__``.  The
packages a dotted name passes through are not edges (their ``__init__`` runs first, but
what it imports lazily does not run then)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "flashgen"
#: Stages that plan and render kernels on any machine: no torch, no CuPy.
PURE = ("flashgen.frontend", "flashgen.analysis", "flashgen.codegen", "flashgen.families",
        "flashgen.build")  # fmt: skip


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, type_only: bool = False):
    """Every Import / ImportFrom node, in functions too; under ``if TYPE_CHECKING:`` only
    with ``type_only``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_only:
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _resolve(module: str, node) -> tuple[set[str], set[str]]:
    """(flashgen modules, top-level third-party names) that ``node`` in ``module`` imports."""
    inside, outside = set(), set()
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the module's package
            pkg = module.split(".")
            if not MODULES[module].name == "__init__.py":
                pkg = pkg[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    for name in names:
        if name == "flashgen" or name.startswith("flashgen."):
            while name not in MODULES:  # an attribute of a module
                name = name.rsplit(".", 1)[0]
            inside.add(name)
        else:
            outside.add(name.split(".")[0])
    return inside, outside


#: every module's syntax tree, parsed once for both graphs
TREES = {mod: ast.parse(path.read_text(), str(path)) for mod, path in MODULES.items()}


def _graph(type_only: bool = False):
    edges, third = {}, {}
    for mod, tree in TREES.items():
        edges[mod], third[mod] = set(), set()
        for node in _imports(tree, type_only):
            inside, outside = _resolve(mod, node)
            edges[mod] |= inside - {mod}
            third[mod] |= outside
    return edges, third


#: the imports that run (what torch-freedom is about)
EDGES, THIRD_PARTY = _graph()
#: with the type-only ones: a cycle through a type annotation is a cycle of the design too
ALL_EDGES, _ = _graph(type_only=True)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _path(a: str, b: str, edges=None) -> list[str]:
    """A shortest import path from ``a`` to ``b`` (for the failure message)."""
    edges = ALL_EDGES if edges is None else edges
    prev, todo = {a: None}, [a]
    while todo:
        nxt = []
        for v in todo:
            for w in sorted(edges[v]):
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        todo = nxt
    out, v = [], b
    while v is not None:
        out.append(v)
        v = prev.get(v)
    return out[::-1]


def test_the_graph_sees_the_package():
    assert "flashgen.ops.op" in EDGES and "flashgen.families.registry" in EDGES
    assert "flashgen.ops.prefill.attention" in EDGES["flashgen.ops.op"]
    # a function-level import counts (decode's CPU reference imports the blocked attention there)
    assert "flashgen.ops.cpu.attention" in EDGES["flashgen.ops.decode.reference"]


def test_a_type_only_import_makes_a_cycle():
    """The cycle check sees a cycle that closes through ``if TYPE_CHECKING:`` (decode's fast
    path once named ``DecodeOp`` that way while the op's module imported it)."""
    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from flashgen.ops.decode.op import DecodeOp\n"
    )
    mod = "flashgen.ops.decode.fast"
    extra = set()
    for node in _imports(ast.parse(src), type_only=True):
        extra |= _resolve(mod, node)[0]
    assert len(list(_imports(ast.parse(src)))) == 1  # only the typing import runs
    edges = {**ALL_EDGES, mod: ALL_EDGES[mod] | extra}
    assert any(mod in c and "flashgen.ops.decode.op" in c for c in _cycles(edges))


#: ``flashgen/ops/``'s layers, top first: a module may import its own layer's and the later
#: layers' modules only (module or package prefixes; the shared modules sit in ops/ itself)
OPS_LAYERS = (
    ("flashgen.ops.op",),
    ("flashgen.ops.prefill",),
    ("flashgen.ops.decode",),
    ("flashgen.ops.validation", "flashgen.ops.calls", "flashgen.ops.out_arg", "flashgen.ops.sink"),
    ("flashgen.ops.cpu",),
)


def _layer(mod: str) -> int | None:
    for i, names in enumerate(OPS_LAYERS):
        if any(mod == n or mod.startswith(n + ".") for n in names):
            return i
    return None


def test_ops_subpackages_depend_one_way():
    """op -> prefill -> decode -> shared (validation, calls, out_arg, sink) -> cpu: no
    import (type-only ones included) goes up this list.  Every ops module has a layer."""
    ops = [m for m in MODULES if m.startswith("flashgen.ops.") and MODULES[m].name != "__init__.py"]
    assert not [m for m in ops if _layer(m) is None], "a flashgen.ops module outside OPS_LAYERS"
    up = sorted(
        f"{m} -> {w}"
        for m in ops
        for w in ALL_EDGES[m]
        if _layer(w) is not None and _layer(w) < _layer(m)
    )
    assert not up, "imports against the ops layers:\n" + "\n".join(up)


def test_no_import_cycles():
    cycles = _cycles(ALL_EDGES)
    msgs = [" -> ".join(_path(c[0], c[1]) + _path(c[1], c[0])[1:]) for c in cycles]
    assert not cycles, "import cycles:\n" + "\n".join(msgs)


def test_the_planning_stages_import_neither_torch_nor_cupy():
    bad = {
        m: sorted(THIRD_PARTY[m] & {"torch", "cupy"})
        for m in MODULES
        if m.startswith(PURE) and THIRD_PARTY[m] & {"torch", "cupy"}
    }
    assert not bad, bad
    # nor through another flashgen module
    for m in MODULES:
        if not m.startswith(PURE):
            continue
        seen, todo = set(), [m]
        while todo:
            v = todo.pop()
            for w in EDGES[v]:
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        heavy = sorted(w for w in seen if THIRD_PARTY[w] & {"torch", "cupy"})
        assert not heavy, f"{m} imports torch or CuPy through {heavy}"


def test_families_do_not_import_each_other():
    """The registry chooses; a family module imports the shared ones only."""
    fams = {m for m in MODULES if m.startswith("flashgen.families.")}
    shared = {"flashgen.families.common", "flashgen.families.tiles",
              "flashgen.families.bwd_common", "flashgen.families.registry",
              "flashgen.families.build", "flashgen.families.fields"}  # fmt: skip
    for m in sorted(fams - shared):
        others = sorted(EDGES[m] & (fams - shared))
        assert not others, f"{m} imports {others}"


def test_every_subpackage_is_in_the_wheel():
    """pyproject.toml's ``packages`` lists every flashgen package (a missing one is left out
    of the wheel: ``import flashgen.codegen`` would fail after ``pip install``)."""
    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ])  # fmt: skip
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    assert packages <= listed, sorted(packages - listed)
