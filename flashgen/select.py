"""Pick tiles whose kernels compile without register spills.

Lowering takes its tiles from tables measured on the shipped specs.  A user's score_mod
or mask can need more registers than those tiles leave free, and ptxas then spills to
local memory (slow, and refused by ``flashgen build``).  These functions compile the
candidates of :func:`flashgen.lower.forward_tile_candidates` /
:func:`~flashgen.lower.backward_tile_candidates` in order, through the on-disk cache (a
spilling candidate is compiled once and remembered there), and return the first one
without spills, or the last one tried when all spill.  No GPU needed: nvcc reports the
spills.
"""

from __future__ import annotations

from . import cache
from .envflags import flag
from .lower import (
    HOPPER_BWD_DQ_A,
    BackwardPlan,
    KernelPlan,
    backward_tile_candidates,
    forward_tile_candidates,
    plan_backward,
    plan_forward,
    plan_hopper_backward,
)
from .render import render

#: Set to ``0``: forward kernels keep the mask's tensor reads per element (no row / column terms).
SIDE_TERMS_ENV = "FLASHGEN_SIDE_TERMS"


def build_forward(
    spec,
    target: str,
    gpu: str | None = None,
    family: str = "auto",
    persistent: bool | str = False,
) -> tuple[KernelPlan, object, object]:
    """``(plan, cubin path, CompileReport)`` of ``spec``'s forward kernel for ``target``
    (``family``: see :data:`flashgen.lower.FAMILIES`; ``persistent``: False or the Hopper
    kernel's persistent scheduler, see :func:`flashgen.lower.plan_hopper_forward`).  At
    each candidate's tiles a Hopper kernel with row / column terms (:mod:`flashgen.rowcol`)
    that spills is retried with them per element before the next tiles;
    ``FLASHGEN_SIDE_TERMS=0`` (read at each build) never uses them (to compare).

    Raises :class:`~flashgen.compile.CompileError` if nvcc fails, ``ValueError`` if the
    spec cannot be lowered for ``target``.
    """
    ways = (True, False) if flag(SIDE_TERMS_ENV, True) else (False,)
    for tiles in forward_tile_candidates(spec, target, gpu, family):
        for side_terms in ways:
            plan = plan_forward(
                spec,
                target,
                gpu,
                tiles=tiles,
                persistent=persistent,
                side_terms=side_terms,
            )
            cubin, report = cache.get_or_build(render(plan), plan)
            if not report.spill_bytes:
                return plan, cubin, report
            if not (plan.context.get("row_terms") or plan.context.get("col_terms")):
                break  # no terms: the same kernel again
    return plan, cubin, report


def build_backward(
    spec, target: str, *, atomic_dq: bool = False, hopper: bool = False
) -> tuple[BackwardPlan, object, object]:
    """``(BackwardPlan, cubin path, CompileReport)`` of ``spec``'s backward unit (every
    kernel of it spill-free if any candidate is).  ``hopper``: the wgmma unit of
    :func:`~flashgen.lower.plan_hopper_backward`, its dQ variant from the environment
    first, then the other one; when both spill (a score_mod or mask with more math than
    the kernel's registers hold), the FA2-class unit ``atomic_dq`` selects (check
    ``plan.atomic_dq`` and ``plan.dkdv.template``).  Raises like :func:`build_forward`."""
    if hopper:
        first = plan_hopper_backward(spec, target)
        variants = [first] + [
            plan_hopper_backward(spec, target, dq_a=v)
            for v in HOPPER_BWD_DQ_A
            if v != ("ldmatrix" if first.dkdv.context["dq_ldmatrix"] else "smem")
        ]
        for plan in variants:
            cubin, report = cache.get_or_build(render(plan.unit), plan.unit)
            if not report.spill_bytes:
                return plan, cubin, report
    for tiles in backward_tile_candidates(spec, atomic_dq=atomic_dq):
        plan = plan_backward(spec, target, atomic_dq=atomic_dq, tiles=tiles)
        cubin, report = cache.get_or_build(render(plan.unit), plan.unit)
        if not report.spill_bytes:
            break
    return plan, cubin, report
