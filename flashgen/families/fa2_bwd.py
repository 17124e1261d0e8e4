"""The FA2-class backward (``templates/sm_80/bwd.cu.j2``): deterministic (pre, dK/dV, dQ
kernels) and atomic-dQ (pre, dK/dV with float atomics into dQ, convert) forms, every target.
:func:`plan` lowers a spec; :class:`Options` holds its template switches."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from flashgen.analysis import rowcol
from flashgen.codegen import dparam
from flashgen.codegen.abi import KernelArg, check_target
from flashgen.codegen.cuda_expr import cuda_expr, split_causal
from flashgen.codegen.cuda_expr import side_terms as side_term_entries
from flashgen.codegen.plan import KernelPlan, TileConfig
from flashgen.families.bwd_common import (
    CONVERT_THREADS,
    PRE_WARPS,
    BackwardContext,
    BackwardPlan,
    backward_abi,
    base_fields,
)
from flashgen.families.common import mma16_dtype
from flashgen.families.fields import check_fields
from flashgen.families.tiles import BackwardTiles, table_backward_tiles
from flashgen.frontend.ir import Spec

#: The template this family renders.
TEMPLATE = "sm_80/bwd.cu.j2"

#: Code-generation switches of the backward template (``templates/sm_80/bwd.cu.j2``), like
#: :data:`FORWARD_OPTIONS`.  ``bwd_unrolled_loads``: tile loads with a compile-time trip
#: count (as the forward's ``fwd_unrolled_loads``).  ``bwd_async_stats``: the dK/dV kernel
#: fetches each step's lse and dsum with cp.async along with Q and dO (they were plain
#: global loads, a full memory latency inside every step); not with a score_mod, whose
#: math leaves no registers for it (alibi's dK/dV kernels spill 8-16 bytes).
#: ``bwd_hoisted_swizzle``: ldmatrix addresses as in the forward's ``fwd_hoisted_swizzle``.
BACKWARD_OPTIONS: dict[str, bool] = {
    "bwd_unrolled_loads": True,
    "bwd_async_stats": True,
    "bwd_hoisted_swizzle": True,
}


def atomic_dq_warp_grid(tiles: BackwardTiles, head_dim: int) -> tuple[int, int]:
    """``(AQ_WM, AQ_WN)``: how the atomic dkdv kernel's warps split the step's dQ tile
    [dkdv_block_m x head_dim / dkdv_dsplit] into AQ_WM row groups x AQ_WN column groups of
    whole 16 x 16 mma tiles, one warp each.

    The grid that keeps the most warps busy wins, then the one with the most column groups
    (each warp then reads a disjoint slice of K, the larger operand, once).  Head dims 64,
    128 and 256 with the table's tiles split min(warps, columns / 16) ways by columns, as
    before; 96 and 192 (6 and 12 column tiles over 4 warps) take 2 x 2.  When no grid uses
    every warp (e.g. 80 columns = 5 tiles and 2 row tiles over 4 warps) the remaining warps
    sit out the dQ product (the kernel skips it for warp >= AQ_WM * AQ_WN).
    """
    warps = tiles.dkdv_warps
    col_tiles = head_dim // tiles.dkdv_dsplit // 16
    row_tiles = tiles.dkdv_block_m // 16
    grids = [
        (wm, wn)
        for wn in range(1, warps + 1)
        for wm in range(1, warps // wn + 1)
        if col_tiles % wn == 0 and row_tiles % wm == 0
    ]
    return max(grids, key=lambda g: (g[0] * g[1], g[1]))


#: Static shared memory the dparam code of the dK/dV kernel may take (its tiles, slots and
#: per-warp sums: templates/common/dparam.j2), under the 48 KiB of static shared memory.
DPARAM_STATIC_SMEM = 40 * 1024

#: The backward kernels that can take row / column terms (:func:`plan`'s ``side_terms``):
#: the dK/dV kernel (deterministic or atomic) and the deterministic dQ kernel.
BACKWARD_SIDE_TERM_KERNELS = frozenset({"dkdv", "dq"})



@dataclass(frozen=True)
class Options:
    """Template switches of the FA2-class backward (:data:`BACKWARD_OPTIONS`); ``None`` keeps
    the default, a bool wins over it."""

    bwd_unrolled_loads: bool | None = None
    bwd_async_stats: bool | None = None
    bwd_hoisted_swizzle: bool | None = None

    def __post_init__(self) -> None:
        check_fields(self, "Options.fa2_bwd")

    def switches(self) -> dict[str, bool]:
        """The template switches set explicitly (not None)."""
        return {k: getattr(self, k) for k in BACKWARD_OPTIONS if getattr(self, k) is not None}


@dataclass(frozen=True)
class Context(BackwardContext):
    """The template context of the FA2-class backward unit (all three kernels)."""

    kernel_dq: str
    dq_args: tuple[KernelArg, ...]
    bwd_unrolled_loads: bool
    bwd_async_stats: bool
    bwd_hoisted_swizzle: bool
    async_stats: bool
    dkdv_block_n: int
    dkdv_block_m: int
    dkdv_warps: int
    dkdv_dsplit: int
    dq_block_m: int
    dq_block_n: int
    dq_warps: int
    aq_wm: int
    aq_wn: int
    mask_expr_split: str | None
    row_terms: list
    col_terms: list
    dkdv_side_terms: bool
    dq_side_terms: bool
    dq_smem_bytes: int


def plan(
    spec: Spec,
    target: str,
    options: Options = Options(),
    *,
    atomic_dq: bool = False,
    tiles: BackwardTiles | None = None,
    side_terms: bool | Iterable[str] = True,
    causal_bits: bool = False,
    exact_softmax: bool = False,
    options_key: str = "",
    param_grads: tuple[str, ...] = (),
    sink: bool = False,
) -> BackwardPlan:
    """Lower ``spec`` to its FA2-class backward kernels for ``target`` (template
    ``sm_80/bwd.cu.j2``; FA2 backward, Dao 2023, Algorithm 2).

    ``atomic_dq`` False: the deterministic kernels (pre, dkdv, dq; tiles from
    :data:`~flashgen.families.tiles.BACKWARD_TILES`).  True: the atomic-dQ kernels (pre, dkdv
    with the dQ product and float atomics into ``dq_accum``, convert; tiles from
    :data:`~flashgen.families.tiles.ATOMIC_BACKWARD_TILES`); see :class:`BackwardPlan`.  The
    score_mod derivative comes from :func:`flashgen.analysis.derive.d_dscore`.  ``tiles``
    replaces the table's choice (the spill fallback).  ``options``: the template switches
    (:class:`Options`).  ``side_terms``: the kernels (of :data:`BACKWARD_SIDE_TERM_KERNELS`;
    True all, False none) that read the mask's one-sided tensor reads once per side of a
    masked tile instead of per element (:mod:`flashgen.analysis.rowcol`): the side the
    kernel holds per CTA (dkdv: its keys, dq: its query rows) two values per thread and
    step, the side it steps over coalesced by lanes and shuffled to the elements.
    ``causal_bits``: see :func:`~flashgen.families.bwd_common.tile_classifier`.
    ``exact_softmax``: P's exponent capped at 0
    (:func:`~flashgen.families.bwd_common.base_fields`).
    ``param_grads``: names of params whose gradients the dK/dV kernel accumulates
    (templates/common/dparam.j2; the kernel is named ``..._dkdv[_atomic]_dparam`` and takes
    :func:`flashgen.codegen.dparam.kernel_args` last); empty: the unit without that code.
    ``sink``: the sink form, the backward of a fused-sink forward (the pre kernel, named
    ``..._pre_sink``, takes the sink and writes ``lse`` and ``dsink``:
    :func:`~flashgen.families.bwd_common.backward_abi`); a spec with a sink only.
    Raises ``ValueError`` for a target or dtype this version cannot lower, unknown kernels
    in ``side_terms``, dparam tiles that do not fit static shared memory, or ``sink`` for a
    spec without one.
    """
    check_target(target)
    elt = mma16_dtype(spec, "the FA2-class backward").elem_bytes
    opts = dict(BACKWARD_OPTIONS)
    opts.update(options.switches())
    if side_terms is True or side_terms is False:
        term_kernels = BACKWARD_SIDE_TERM_KERNELS if side_terms else frozenset()
    else:
        term_kernels = frozenset(side_terms)
        unknown = sorted(term_kernels - BACKWARD_SIDE_TERM_KERNELS)
        if unknown:
            raise ValueError(
                f"side_terms names unknown kernels {unknown}; "
                f"known: {', '.join(sorted(BACKWARD_SIDE_TERM_KERNELS))}"
            )
    t = tiles or table_backward_tiles(spec, atomic_dq, dparam=bool(param_grads))
    d, dv = spec.head_dim, spec.head_dim_v
    abi = backward_abi(spec, atomic_dq, sink)
    grid = atomic_dq_warp_grid(t, d) if atomic_dq else (0, 0)  # unused by the deterministic unit
    base = f"flashgen_{spec.name}_bwd_{target}"
    ctx = base_fields(spec, causal_bits, exact_softmax, param_grads, sink)
    if param_grads:
        abi = dict(abi, dkdv_args=abi["dkdv_args"] + dparam.kernel_args(spec, param_grads))
        tile = t.dkdv_block_n * (t.dkdv_block_m + 1) * 4
        tiles_bytes = dparam.tile_terms(spec, param_grads) * tile
        if tiles_bytes + 4 * (t.dkdv_block_m + t.dkdv_block_n + t.dkdv_warps) > DPARAM_STATIC_SMEM:
            raise ValueError(
                f"spec {spec.name!r}: the gradients of {', '.join(param_grads)} need {tiles_bytes} "
                f"bytes of shared-memory tiles in the dK/dV kernel (at most {DPARAM_STATIC_SMEM})"
            )
    grad = "_dparam" if param_grads else ""
    ctx.update(
        abi,
        **opts,
        async_stats=opts["bwd_async_stats"] and spec.score_mod is None,
        atomic_dq=atomic_dq,
        kernel_pre=f"{base}_pre{'_sink' if sink else ''}",
        kernel_dkdv=(f"{base}_dkdv_atomic" if atomic_dq else f"{base}_dkdv") + grad,
        kernel_dq=f"{base}_dq",
        kernel_convert=f"{base}_convert",
        convert_threads=CONVERT_THREADS,
        pre_warps=PRE_WARPS,
        dkdv_block_n=t.dkdv_block_n,
        dkdv_block_m=t.dkdv_block_m,
        dkdv_warps=t.dkdv_warps,
        dkdv_dsplit=t.dkdv_dsplit,
        dq_block_m=t.dq_block_m,
        dq_block_n=t.dq_block_n,
        dq_warps=t.dq_warps,
        aq_wm=grid[0],
        aq_wn=grid[1],
    )
    residual = split_causal(spec.mask)[1]
    parts = rowcol.Split(residual, (), ())
    if term_kernels and residual is not None and not spec.varlen:
        parts = rowcol.split(residual, spec)
    has_terms = bool(parts.rows or parts.cols)
    ctx.update(
        mask_expr_split=cuda_expr(parts.expr, spec) if has_terms else None,
        row_terms=side_term_entries(parts.rows, spec, None),
        col_terms=side_term_entries(parts.cols, spec, None),
        dkdv_side_terms=has_terms and "dkdv" in term_kernels,
        dq_side_terms=has_terms and "dq" in term_kernels and not atomic_dq,
    )
    dkdv_smem = (t.dkdv_block_n * (d + dv) + 2 * t.dkdv_block_m * (d + dv)) * elt
    dkdv_smem += 2 * 2 * t.dkdv_block_m * 4  # lse and dsum (fp32) of both stages
    if atomic_dq:
        dkdv_smem += t.dkdv_block_n * (t.dkdv_block_m * elt + 16)  # dS^T, padded rows
    dq_smem = (t.dq_block_m * (d + dv) + 2 * t.dq_block_n * (d + dv)) * elt
    ctx.update(dkdv_smem_bytes=dkdv_smem, dq_smem_bytes=dq_smem)  # static_asserted in the kernels
    context = Context(**ctx)

    def kp(name: str, warps: int, smem: int, args) -> KernelPlan:
        return KernelPlan(
            spec_name=spec.name,
            target=target,
            template=TEMPLATE,
            kernel_name=name,
            tiles=TileConfig(16 * warps, 16, warps),
            smem_bytes=smem,
            args=tuple(args),
            context=context,
            options_key=options_key,
        )

    pre = kp(context.kernel_pre, PRE_WARPS, 0, abi["pre_args"])
    dkdv = kp(context.kernel_dkdv, t.dkdv_warps, dkdv_smem, abi["dkdv_args"])
    if atomic_dq:
        convert = kp(context.kernel_convert, CONVERT_THREADS // 32, 0, abi["convert_args"])
        return BackwardPlan(spec.name, target, t, pre, dkdv, None, convert, atomic_dq=True)
    dq = kp(context.kernel_dq, t.dq_warps, dq_smem, abi["dq_args"])
    return BackwardPlan(spec.name, target, t, pre, dkdv, dq)
