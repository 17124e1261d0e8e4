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

import itertools

from flashgen.build import cache
from flashgen.build.render import render
from flashgen.envflags import SIDE_TERMS_ENV, flag
from flashgen.lower import (
    BACKWARD_SIDE_TERM_KERNELS,
    HOPPER_BWD_DQ_A,
    BackwardPlan,
    KernelPlan,
    backward_tile_candidates,
    forward_tile_candidates,
    plan_backward,
    plan_forward,
    plan_hopper_backward,
    sparse_tiles,
)


def build_forward(
    spec,
    target: str,
    gpu: str | None = None,
    family: str = "auto",
    persistent: bool | str = False,
    sparse: bool = False,
) -> tuple[KernelPlan, object, object]:
    """``(plan, cubin path, CompileReport)`` of ``spec``'s forward kernel for ``target``
    (``family``: see :data:`flashgen.lower.FAMILIES`; ``persistent``: False or the Hopper
    kernel's persistent scheduler, see :func:`flashgen.lower.plan_hopper_forward`;
    ``sparse``: the tiles :func:`flashgen.lower.sparse_tiles` gives for the chosen ones
    are tried first, where it gives any).

    At each candidate's tiles, a kernel that spills (or whose wgmma instructions ptxas
    serialized: :attr:`flashgen.build.compile.CompileReport.wgmma_serialized`) is retried with
    fewer of
    ``plan_forward``'s register-hungry features before the next tiles, the last named
    dropped first: row / column terms (:mod:`flashgen.analysis.rowcol`; ``FLASHGEN_SIDE_TERMS=0``,
    read at each build, never uses them), the affine score_mod split (``affine``), the
    Hopper kernel's masked-tile reductions (``mask_tiles``), the CTA order's head groups
    (``head_groups``), the persistent producer's warp-wide walk (``warp_walk``: tried off
    right after each variant that spills, the producer's own registers, which the others
    barely touch; a mask whose classifier divides twice spills the producer with it at 128 x
    128).  A variant that renders the same source as one tried (the feature does not apply
    to this spec, e.g. ``warp_walk`` to a non-persistent kernel) is skipped.

    Raises :class:`~flashgen.build.compile.CompileError` if nvcc fails, ``ValueError`` if the
    spec cannot be lowered for ``target``.
    """
    ways = (True, False) if flag(SIDE_TERMS_ENV, True) else (False,)
    candidates = forward_tile_candidates(spec, target, gpu, family)
    alt = sparse_tiles(spec, candidates[0]) if sparse else None
    if alt is not None:
        candidates = [alt, *(t for t in candidates if t != alt)]
    for tiles in candidates:
        tried = set()
        for side_terms, affine, mask_tiles, head_groups, warp_walk in itertools.product(
            ways, (True, False), (True, False), (True, False), (True, False)
        ):
            plan = plan_forward(
                spec,
                target,
                gpu,
                tiles=tiles,
                persistent=persistent,
                side_terms=side_terms,
                affine=affine,
                mask_tiles=mask_tiles,
                head_groups=head_groups,
                warp_walk=warp_walk,
            )
            source = render(plan)
            if source in tried:
                continue
            tried.add(source)
            cubin, report = cache.get_or_build(source, plan)
            if not report.spill_bytes and not report.wgmma_serialized:
                return plan, cubin, report
    return plan, cubin, report


def build_backward(
    spec, target: str, *, atomic_dq: bool = False, hopper: bool = False
) -> tuple[BackwardPlan, object, object]:
    """``(BackwardPlan, cubin path, CompileReport)`` of ``spec``'s backward unit (every
    kernel of it spill-free if any candidate is).  ``hopper``: the wgmma unit of
    :func:`~flashgen.lower.plan_hopper_backward`, its dQ variant from the environment
    first, then the other one; when both spill (a score_mod or mask with more math than
    the kernel's registers hold) or ptxas serialized their wgmma instructions
    (:attr:`flashgen.build.compile.CompileReport.wgmma_serialized`, which ``flashgen build``
    fails), the FA2-class unit ``atomic_dq`` selects (check
    ``plan.atomic_dq`` and ``plan.dkdv.template``).  The FA2-class unit is tried at each
    candidate's tiles with row / column terms (:mod:`flashgen.analysis.rowcol`) in every kernel
    that can take them, then without them in the kernels that spilled, then in none,
    before the next tiles (``FLASHGEN_SIDE_TERMS=0``: never).  Raises like
    :func:`build_forward`."""
    if hopper:
        first = plan_hopper_backward(spec, target)
        variants = [first] + [
            plan_hopper_backward(spec, target, dq_a=v)
            for v in HOPPER_BWD_DQ_A
            if v != ("ldmatrix" if first.dkdv.context["dq_ldmatrix"] else "smem")
        ]
        for plan in variants:
            cubin, report = cache.get_or_build(render(plan.unit), plan.unit)
            if not report.spill_bytes and not report.wgmma_serialized:  # as build_forward
                return plan, cubin, report
    use_terms = flag(SIDE_TERMS_ENV, True)
    for tiles in backward_tile_candidates(spec, atomic_dq=atomic_dq):
        kernels = set(BACKWARD_SIDE_TERM_KERNELS) if use_terms else set()
        while True:
            plan = plan_backward(
                spec, target, atomic_dq=atomic_dq, tiles=tiles, side_terms=frozenset(kernels)
            )
            cubin, report = cache.get_or_build(render(plan.unit), plan.unit)
            if not report.spill_bytes:
                return plan, cubin, report
            spilled = {k for k in _term_kernels(plan) if report.kernel(k[1]).spill_bytes}
            if not spilled:
                break  # no kernel with terms spilled: the same kernels again
            kernels -= {role for role, _ in spilled}
    return plan, cubin, report


def _term_kernels(plan: BackwardPlan) -> set[tuple[str, str]]:
    """``(role, kernel name)`` of the kernels of an FA2-class backward unit that read row /
    column terms (role ``"dkdv"`` or ``"dq"``)."""
    ctx = plan.dkdv.context
    out = set()
    if ctx.get("dkdv_side_terms"):
        out.add(("dkdv", plan.dkdv.kernel_name))
    if ctx.get("dq_side_terms") and plan.dq is not None:
        out.add(("dq", plan.dq.kernel_name))
    return out
