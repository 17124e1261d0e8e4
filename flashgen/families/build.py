"""Build a family's kernels through the cache, picking tiles that compile without spills.

Lowering takes its tiles from tables measured on the shipped specs.  A user's score_mod
or mask can need more registers than those tiles leave free, and ptxas then spills to
local memory (slow, and refused by ``flashgen build``).  These functions compile the
candidates of :func:`flashgen.families.registry.forward_tile_candidates` /
:func:`flashgen.families.tiles.backward_tile_candidates` in order, through the on-disk cache (a
spilling candidate is compiled once and remembered there), and return the first one
without spills, or the last one tried when all spill.  No GPU needed: nvcc reports the
spills.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from flashgen.build import cache
from flashgen.build.render import render
from flashgen.codegen import dparam
from flashgen.codegen.plan import KernelPlan
from flashgen.families import registry
from flashgen.families.bwd_common import BackwardPlan
from flashgen.families.fa2_bwd import BACKWARD_SIDE_TERM_KERNELS
from flashgen.families.tiles import backward_tile_candidates
from flashgen.options import DEFAULT, Options


def build_forward(
    spec,
    target: str,
    gpu: str | None = None,
    options: Options = DEFAULT,
    persistent: bool | str = False,
    sparse: bool = False,
    block_descale: bool = False,
) -> tuple[KernelPlan, object, object]:
    """``(plan, cubin path, CompileReport)`` of ``spec``'s forward kernel for ``target``
    (``options``: :class:`flashgen.options.Options`, the family among them; ``persistent``:
    False or the Hopper kernel's persistent scheduler, see
    :func:`flashgen.families.hopper_fwd.plan`; ``sparse``: the tiles
    :func:`flashgen.families.registry.sparse_tiles` gives for the chosen ones are tried
    first, where it gives any; ``block_descale``: an fp8 spec's kernel that reads per-block
    descales, :func:`flashgen.families.hopper_fwd.plan`).

    At each candidate's tiles, a kernel that spills (or whose wgmma instructions ptxas
    serialized: :attr:`flashgen.build.compile.CompileReport.wgmma_serialized`) is retried with
    fewer of
    ``plan_forward``'s register-hungry features before the next tiles, the last named
    dropped first: row / column terms (:mod:`flashgen.analysis.rowcol`;
    ``options.side_terms`` False never uses them), the affine score_mod split (``affine``), the
    Hopper kernel's masked-tile reductions (``mask_tiles``), the CTA order's head groups
    (``head_groups``), the persistent producer's warp-wide walk (``warp_walk``: tried off
    right after each variant that spills, the producer's own registers, which the others
    barely touch; a mask whose classifier divides twice spills the producer with it at 128 x
    128), the float twins of integer index calls (``float_index_calls``: tried off right after
    each variant that spills).  A variant that renders the same source as one tried (the feature
    does not apply to this spec, e.g. ``warp_walk`` to a non-persistent kernel) is skipped.

    Raises :class:`~flashgen.build.compile.CompileError` if nvcc fails, ``ValueError`` if the
    spec cannot be lowered for ``target``.
    """
    ways = (True, False) if options.side_terms else (False,)
    candidates = registry.forward_tile_candidates(spec, target, gpu, options)
    alt = registry.sparse_tiles(spec, candidates[0], options) if sparse else None
    if alt is not None:
        candidates = [alt, *(t for t in candidates if t != alt)]
    for tiles in candidates:
        tried = set()
        for side_terms, affine, mask_tiles, head_groups, warp_walk, floats in itertools.product(
            ways, *[(True, False)] * 5
        ):
            opts = _forward_variant(options, affine, mask_tiles, head_groups, warp_walk, floats)
            plan = registry.plan_forward(
                spec, target, opts, gpu=gpu, tiles=tiles, persistent=persistent,
                side_terms=side_terms, block_descale=block_descale,
            )  # fmt: skip
            source = render(plan)
            if source in tried:
                continue
            tried.add(source)
            cubin, report = cache.get_or_build(source, plan)
            if not report.spill_bytes and not report.wgmma_serialized:
                return plan, cubin, report
    return plan, cubin, report


def _forward_variant(
    options: Options,
    affine: bool,
    mask_tiles: bool,
    head_groups: bool,
    warp_walk: bool,
    float_calls: bool = True,
) -> Options:
    """``options`` with the spill fallback's features turned off where False (never on)."""
    h, f = options.hopper_fwd, options.fa2_fwd
    h = replace(
        h,
        affine=h.affine and affine,
        causal_tiles=h.causal_tiles and mask_tiles,
        col_limit=h.col_limit and mask_tiles,
        col_bound=h.col_bound and mask_tiles,
        nonneg_div=h.nonneg_div and mask_tiles,
        head_groups=h.head_groups and head_groups,
        warp_walk=h.warp_walk and warp_walk,
        float_index_calls=h.float_index_calls and float_calls,
    )
    f = replace(f, affine=f.affine and affine, head_groups=f.head_groups and head_groups)
    return replace(options, hopper_fwd=h, fa2_fwd=f)


def build_backward(
    spec, target: str, *, atomic_dq: bool = False, hopper: bool = False,
    ordered_dq: bool = False, options: Options = DEFAULT, param_grads: tuple[str, ...] = (),
    sink: bool = False,
) -> tuple[BackwardPlan, object, object]:  # fmt: skip
    """``(BackwardPlan, cubin path, CompileReport)`` of ``spec``'s backward unit (every
    kernel of it spill-free if any candidate is).  ``hopper``: the wgmma unit of
    :func:`~flashgen.families.hopper_bwd.plan` (``ordered_dq``: its deterministic form); when
    it spills (a score_mod or mask with more
    math than the consumers' registers hold) or ptxas serialized its wgmma instructions
    (:attr:`flashgen.build.compile.CompileReport.wgmma_serialized`, which ``flashgen build``
    fails), the FA2-class unit ``atomic_dq`` selects (check
    ``plan.atomic_dq`` and ``plan.dkdv.template``).  The FA2-class unit is tried at each
    candidate's tiles with row / column terms (:mod:`flashgen.analysis.rowcol`) in every kernel
    that can take them, then without them in the kernels that spilled, then in none,
    before the next tiles (``options.side_terms`` False: never).  ``param_grads``: the
    params whose gradients the unit accumulates (:func:`flashgen.codegen.dparam.fields`;
    the Hopper unit only where :func:`flashgen.codegen.dparam.hopper_forms_ok`, else the
    FA2-class one).  ``sink``: the sink form of every unit tried (its pre kernel joins the
    sink: :func:`flashgen.families.bwd_common.backward_abi`).  Raises like
    :func:`build_forward`."""
    param_grads = tuple(param_grads)
    diagonal = options.hopper_bwd.dparam_diagonal
    if hopper and param_grads and not dparam.hopper_forms_ok(spec, param_grads, diagonal):
        hopper = False
    if hopper:
        for o in _hopper_backward_candidates(spec, options, param_grads):
            plan = registry.plan_hopper_backward(
                spec, target, o, ordered_dq=ordered_dq, param_grads=param_grads, sink=sink
            )
            cubin, report = cache.get_or_build(render(plan.unit), plan.unit)
            if not report.spill_bytes and not report.wgmma_serialized:  # as build_forward
                return plan, cubin, report
    use_terms = options.side_terms
    for tiles in backward_tile_candidates(spec, atomic_dq=atomic_dq, dparam=bool(param_grads)):
        kernels = set(BACKWARD_SIDE_TERM_KERNELS) if use_terms else set()
        while True:
            plan = registry.plan_backward(
                spec, target, options, atomic_dq=atomic_dq, tiles=tiles,
                side_terms=frozenset(kernels), param_grads=param_grads, sink=sink,
            )  # fmt: skip
            cubin, report = cache.get_or_build(render(plan.unit), plan.unit)
            if not report.spill_bytes:
                return plan, cubin, report
            spilled = {k for k in _term_kernels(plan) if report.kernel(k[1]).spill_bytes}
            if not spilled:
                break  # no kernel with terms spilled: the same kernels again
            kernels -= {role for role, _ in spilled}
    if atomic_dq and param_grads:
        # every atomic-dQ dparam unit spills: the deterministic kernels with the same dparam
        # code (their atomic adds when the call is not deterministic) before a spilling unit
        det = build_backward(spec, target, options=options, param_grads=param_grads, sink=sink)
        if not det[2].spill_bytes:
            return det
    return plan, cubin, report


def _hopper_backward_candidates(
    spec, options: Options, param_grads: tuple[str, ...] = ()
) -> list[Options]:
    """The Hopper backward's options to try in order: ``options``, then with 64-query steps
    at head_dim 64 (``hopper_bwd.d64_block_m``: the 128-query steps hold S^T and dP^T of 128
    queries in registers, which a score_mod reading a table can push past the consumers'
    240) and at head_dim 128 (``hopper_bwd.d128_block_m``: likewise the 80-query steps);
    with ``hopper_bwd.dparam_affine`` and ``param_grads`` it takes
    (:func:`flashgen.codegen.dparam.affine_fields`), then each of those without it (a unit
    the option does not shape is not tried twice)."""
    out = [options]
    hb = options.hopper_bwd
    if spec.head_dim == 64 and hb.d64_block_m != 64:
        out.append(replace(options, hopper_bwd=replace(hb, d64_block_m=64)))
    if spec.head_dim == 128 and hb.d128_block_m != 64:
        out.append(replace(options, hopper_bwd=replace(hb, d128_block_m=64)))
    if hb.dparam_affine and param_grads and dparam.affine_fields(spec, param_grads):
        # then each without it (the per-pair form in the P^T pass)
        out += [replace(o, hopper_bwd=replace(o.hopper_bwd, dparam_affine=False)) for o in out]
    return out


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
