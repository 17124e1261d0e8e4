"""The shipped specs the nvcc tests compile: each kernel code once.

Two shipped specs may differ in their name and description only (``llama3_gqa`` is
``causal_d128``: grouped-query attention is a property of the call, not of the spec).  Their
units render the same CUDA but for the kernels' names (tests/unit/test_compile.py checks
that, unit by unit), so the spill sweeps compile the first of them only: ptxas allocates
registers the same way whatever a kernel is called."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from flashgen.frontend.spec import load_spec

SPEC_DIR = Path(__file__).resolve().parent.parent / "specs"


def _code(spec):
    """``spec`` without what its kernels do not depend on (its name, description and file)."""
    return dataclasses.replace(spec, name="", description="", path="", source="")


def twins(paths) -> dict[Path, Path]:
    """``{path: the earlier path of the same code}`` for the specs of ``paths`` (in order)
    that equal an earlier one but for name and description."""
    seen: list[tuple[object, Path]] = []
    out = {}
    for p in paths:
        code = _code(load_spec(p))
        first = next((q for c, q in seen if c == code), None)
        if first is None:
            seen.append((code, p))
        else:
            out[Path(p)] = Path(first)
    return out


def distinct_code(paths) -> list[Path]:
    """``paths`` (in order) without the specs :func:`twins` finds: one spec per kernel code."""
    dup = twins(paths)
    return [Path(p) for p in paths if Path(p) not in dup]


#: every shipped spec file, and those of distinct kernel code
ALL = sorted(SPEC_DIR.glob("*.yaml"))
DISTINCT = distinct_code(ALL)
