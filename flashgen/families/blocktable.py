"""The block-table pre-pass (``templates/sm_80/blockmask.cu.j2``): for a mask that reads
tensor params, a per-tile class table the forward kernels read in place of the tile
classifier.  :func:`plan` lowers it for the forward's tiles; :func:`block_table_shape` is
the table's shape."""

from __future__ import annotations

from dataclasses import dataclass

from flashgen.analysis import masktiles, rowcol
from flashgen.codegen.abi import (
    KernelArg,
    block_table_dims,
    check_target,
    needs_block_table,
    param_args,
)
from flashgen.codegen.cuda_expr import Invariants, cuda_expr, side_terms
from flashgen.codegen.plan import KernelPlan, TemplateContext, TileConfig
from flashgen.frontend.ir import Spec

#: The template this family renders.
TEMPLATE = "sm_80/blockmask.cu.j2"


@dataclass(frozen=True)
class Options:
    """Knobs of the block-table pre-pass: none yet."""


@dataclass(frozen=True)
class Context(TemplateContext):
    """The template context of the pre-pass: the whole mask (row / column terms split out),
    its tile classifier and the table's axes.  Its grid is 1-D over the tiles
    (:meth:`TemplateContext.grid` over ``tab_b * tab_h`` slices: the op passes those)."""

    spec_name: str
    kernel_name: str
    block_m: int
    block_n: int
    threads: int
    mask_expr: str
    row_terms: list
    col_terms: list
    tile_classifier: str
    tile_class_args: str
    prologue: str
    args: tuple[KernelArg, ...]
    per_batch: bool
    per_head: bool


BLOCK_TABLE_THREADS = 128


def plan(spec: Spec, target: str, tiles: TileConfig, options: Options = Options()) -> KernelPlan:
    """Lower the block-table pre-pass of ``spec`` (a mask that reads tensor params).

    The kernel (``templates/sm_80/blockmask.cu.j2``) evaluates the whole mask, causal
    included, from the same IR as the forward kernel over the in-range (q_idx, kv_idx) pairs
    of each (BLOCK_M x BLOCK_N) tile of ``tiles`` (the forward kernel's), and writes one
    byte per tile: 0 EMPTY (no pair kept), 2 FULL (every in-range pair kept), 1 PARTIAL.
    Tiles the interval analysis (:mod:`flashgen.analysis.masktiles`, tensor reads unknown) already
    calls EMPTY or FULL evaluate no pair; the others read the mask's one-sided tensor reads
    once per row and column (:mod:`flashgen.analysis.rowcol`) and stop, thread by thread, once a
    kept
    and a dropped pair are seen. This is FlexAttention's BlockMask idea (create_block_mask),
    built on the GPU in O(tiles) memory. One CTA per tile, a 1-D grid over tab_b * tab_h *
    m_blocks * n_blocks (:meth:`Context.grid`).

    ABI: ``tab`` (unsigned char*, contiguous [tab_b, tab_h, m_blocks, n_blocks]);
    ``batch heads_q heads_kv seqlen_q seqlen_k tab_b tab_h`` (int); then the scalar and
    tensor params as in the forward ABI.  ``tab_b`` is ``batch`` when the mask reads ``b``
    else 1 (the kernel then evaluates at b = 0); ``tab_h`` likewise for ``h``.
    Raises ``ValueError`` when the mask reads no tensor param.
    """
    if not needs_block_table(spec):
        raise ValueError(f"spec {spec.name!r}: the mask reads no tensor param; no block table")
    check_target(target)
    dims = [KernelArg(n, "int") for n in ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k")]
    args = (
        KernelArg("tab", "unsigned char*"),
        *dims,
        KernelArg("tab_b", "int"),
        KernelArg("tab_h", "int"),
        *param_args(spec),
    )
    per_b, per_h = block_table_dims(spec)
    name = f"flashgen_{spec.name}_blockmask_{target}_{tiles.block_m}x{tiles.block_n}"
    inv = Invariants()
    parts = rowcol.split(spec.mask, spec)
    ctx = {
        "spec_name": spec.name,
        "kernel_name": name,
        "block_m": tiles.block_m,
        "block_n": tiles.block_n,
        "threads": BLOCK_TABLE_THREADS,
        "mask_expr": cuda_expr(parts.expr, spec, inv),
        "row_terms": side_terms(parts.rows, spec, inv),
        "col_terms": side_terms(parts.cols, spec, inv),
        "tile_classifier": masktiles.classifier_source(spec),
        "tile_class_args": ", ".join(n for _, n in masktiles.classifier_params(spec)[4:]),
        "prologue": inv.prologue,
        "args": args,
        "per_batch": per_b,
        "per_head": per_h,
    }
    return KernelPlan(
        spec_name=spec.name,
        target=target,
        template=TEMPLATE,
        kernel_name=name,
        tiles=TileConfig(tiles.block_m, tiles.block_n, BLOCK_TABLE_THREADS // 32),
        smem_bytes=0,
        args=args,
        context=Context(**ctx),
    )


def block_table_shape(
    spec: Spec, tiles: TileConfig, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int
) -> tuple[int, int, int, int]:
    """``(tab_b, tab_h, m_blocks, n_blocks)``: the block table's shape for a problem."""
    per_b, per_h = block_table_dims(spec)
    return (
        batch if per_b else 1,
        heads_q if per_h else 1,
        -(-seqlen_q // tiles.block_m),
        -(-seqlen_k // tiles.block_n),
    )

