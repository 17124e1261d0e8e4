"""The shipped specs the nvcc tests compile: each kernel code once.

Two shipped specs may differ in their name and description only (``llama3_gqa`` is
``causal_d128``: grouped-query attention is a property of the call, not of the spec).  Their
units render the same CUDA but for the kernels' names (tests/unit/test_compile.py checks
that, unit by unit), so the spill sweeps compile the first of them only: ptxas allocates
registers the same way whatever a kernel is called."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from covering import pairwise

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


#: the targets of the FA2-class kernels
FA2_TARGETS = ("sm_80", "sm_90")


def fa2_backward_covering(names, units) -> list[tuple[str, str, str]]:
    """(spec name, target, unit) rows covering ``names`` (in sorted order) x
    :data:`FA2_TARGETS` x ``units`` pairwise (tests/covering.py): the FA2-class backward units
    (``bwd`` and ``bwd_atomic``, or their ``_dparam`` forms) of the shipped specs that the
    nvcc sweeps build.  A spec's sm_80 and sm_90 FA2-class backward units render the same
    CUDA but for the kernels' names and, for the window masks, the sm_90 causal-bits tile
    classifier (tests/unit/test_compile.py checks that; the atomic unit's vector reduction is
    an ``#if __CUDA_ARCH__ >= 900`` in both), so each spec builds each unit for one target
    and both targets across its units, and every (target, unit) is built by some specs:
    ptxas allocates registers per arch, so a spec's other target is covered by the other
    specs, not proven for it.  tests/unit/test_compile.py and test_dparam_kernels.py ask for
    the same coverings (the same units: cache hits in a full run)."""
    return pairwise(sorted(names), FA2_TARGETS, tuple(units))
