"""Compatibility names for code written against the old single-module lowering: every name
here is re-exported from :mod:`flashgen.codegen` / :mod:`flashgen.families`, and the legacy
``plan_*`` signatures map their keyword knobs onto :class:`flashgen.options.Options`.  New
code imports the families and :mod:`flashgen.families.registry` directly."""

from __future__ import annotations

from dataclasses import replace

from flashgen.codegen.abi import (  # noqa: F401
    ARCH,
    GENCODE,
    TABLE_ROW_SMEM,
    KernelArg,
    TmaArg,
    block_table_dims,
    kernel_args,
    needs_block_table,
)
from flashgen.codegen.cuda_expr import (  # noqa: F401
    INDEX_F,
    Invariants,
    cuda_expr,
    index_in_bounds,
    split_causal,
)
from flashgen.codegen.dtypes import CTYPE  # noqa: F401
from flashgen.codegen.plan import KernelPlan, TileConfig, is_hopper_tiles  # noqa: F401
from flashgen.families import registry
from flashgen.families.blocktable import BLOCK_TABLE_THREADS, block_table_shape  # noqa: F401
from flashgen.families.bwd_common import (  # noqa: F401
    CONVERT_THREADS,
    HOPPER_BWD_TEMPLATE,
    PRE_WARPS,
    BackwardPlan,
)
from flashgen.families.common import (  # noqa: F401
    FAMILIES,
    GRID_GROUPS_MAX,
    HEAD_GROUP_L2_BYTES,
    HOPPER_SMEM_LIMIT,
    PERSISTENT_SCHEDULERS,
    SMEM_LIMIT,
    affine_context,
    grid_tile_coord,
    grouped_grid,
    head_group,
    tile_coord,
    tile_group_expr,
)
from flashgen.families.fa2_bwd import (  # noqa: F401
    BACKWARD_OPTIONS,
    BACKWARD_SIDE_TERM_KERNELS,
    atomic_dq_warp_grid,
)
from flashgen.families.fa2_fwd import (  # noqa: F401
    FORWARD_OPTIONS,
    HEAD_GROUP_FA2_HEAD_DIMS,
    LAZY_RESCALE_HEAD_DIMS,
    uses_load_chain,
)
from flashgen.families.hopper_bwd import HOPPER_BWD_DQ_A  # noqa: F401
from flashgen.families.hopper_bwd import eligible as hopper_bwd_eligible  # noqa: F401
from flashgen.families.hopper_fwd import (  # noqa: F401
    HOPPER_PERSISTENT_REGS,
    HOPPER_REGS,
    HOPPER_STAGES,
    persistent_tile_order,
)
from flashgen.families.hopper_fwd import eligible as hopper_eligible  # noqa: F401
from flashgen.families.registry import compile_units, plan_block_table  # noqa: F401
from flashgen.families.tiles import (  # noqa: F401
    ATOMIC_BACKWARD_TILES,
    BACKWARD_TILES,
    DEFAULT_TILES,
    FORWARD_FALLBACK_TILES,
    HOPPER_BWD_HEAD_DIMS,
    HOPPER_BWD_TILES,
    HOPPER_BWD_TILES_SPLIT_D,
    HOPPER_HEAD_DIMS,
    HOPPER_SPARSE_TILES,
    HOPPER_TABLE_TILES,
    HOPPER_TILES,
    MASK_TILES,
    SPARSE_KEYS_PER_ROW,
    VARLEN_TILES,
    BackwardTiles,
    backward_tile_candidates,
    default_tiles,
    hopper_tiles,
    sparse_tiles,
)
from flashgen.options import DEFAULT, Options


def _opts(family: str = "auto", fwd_switches: dict | None = None, **knobs) -> Options:
    """Options for the legacy keyword knobs (False turns a feature off)."""
    o = replace(DEFAULT, family=family)
    if fwd_switches:
        unknown = sorted(set(fwd_switches) - set(FORWARD_OPTIONS))
        if unknown:
            raise ValueError(
                f"unknown forward option {unknown[0]!r}; known: {', '.join(FORWARD_OPTIONS)}"
            )
        o = replace(o, fa2_fwd=replace(o.fa2_fwd, **{k: bool(v) for k, v in fwd_switches.items()}))
    from flashgen.families.build import _forward_variant

    return _forward_variant(
        o, knobs.get("affine", True), knobs.get("mask_tiles", True),
        knobs.get("head_groups", True), knobs.get("warp_walk", True),
    )  # fmt: skip


def plan_forward(
    spec, target, gpu=None, tiles=None, options=None, family="auto", persistent=False,
    side_terms=True, affine=True, mask_tiles=True, head_groups=True, warp_walk=True,
) -> KernelPlan:  # fmt: skip
    """Legacy form of :func:`flashgen.families.registry.plan_forward` (``options``: a dict of
    FA2-class template switches)."""
    o = _opts(family, options, affine=affine, mask_tiles=mask_tiles, head_groups=head_groups,
              warp_walk=warp_walk)  # fmt: skip
    return registry.plan_forward(
        spec, target, o, gpu=gpu, tiles=tiles, persistent=persistent, side_terms=side_terms
    )


def plan_hopper_forward(spec, target, tiles, *, persistent=False, side_terms=True, **knobs):
    """Legacy form of :func:`flashgen.families.hopper_fwd.plan` (knobs: its Options fields,
    ``stages``, ``m_major``)."""
    from flashgen.families import hopper_fwd

    extra = {k: knobs.pop(k) for k in ("stages", "m_major") if k in knobs}
    return hopper_fwd.plan(
        spec, target, hopper_fwd.Options(**knobs), tiles=tiles, persistent=persistent,
        side_terms=side_terms, **extra,
    )  # fmt: skip


def plan_backward(spec, target, *, atomic_dq=False, tiles=None, options=None, side_terms=True):
    """Legacy form of :func:`flashgen.families.registry.plan_backward` (``options``: a dict
    of FA2-class backward template switches)."""
    from flashgen.families import fa2_bwd

    o = DEFAULT
    if options:
        unknown = sorted(set(options) - set(BACKWARD_OPTIONS))
        if unknown:
            raise ValueError(
                f"unknown backward option {unknown[0]!r}; known: {', '.join(BACKWARD_OPTIONS)}"
            )
        o = replace(o, fa2_bwd=fa2_bwd.Options(**{k: bool(v) for k, v in options.items()}))
    return registry.plan_backward(
        spec, target, o, atomic_dq=atomic_dq, tiles=tiles, side_terms=side_terms
    )


def plan_hopper_backward(spec, target, *, dq_a=None):
    """Legacy form of :func:`flashgen.families.registry.plan_hopper_backward`."""
    o = DEFAULT
    if dq_a is not None:
        from flashgen.families import hopper_bwd

        if dq_a not in HOPPER_BWD_DQ_A:
            raise ValueError(
                f"dQ A operand {dq_a!r}: expected one of {', '.join(HOPPER_BWD_DQ_A)}"
            )
        o = replace(o, hopper_bwd=hopper_bwd.Options(dq_a=dq_a))
    return registry.plan_hopper_backward(spec, target, o)


def choose_tiles(spec, target, gpu=None, family="auto") -> TileConfig:
    """Legacy form of :func:`flashgen.families.registry.choose_tiles`."""
    return registry.choose_tiles(spec, target, gpu, replace(DEFAULT, family=family))


def forward_tile_candidates(spec, target, gpu=None, family="auto") -> list[TileConfig]:
    """Legacy form of :func:`flashgen.families.registry.forward_tile_candidates`."""
    return registry.forward_tile_candidates(spec, target, gpu, replace(DEFAULT, family=family))
