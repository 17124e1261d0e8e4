"""The Hopper backward (``templates/sm_90/bwd.cu.j2``): the atomic-dQ scheme with a dK/dV
kernel on wgmma and TMA.  :func:`plan` lowers a spec; :class:`Options` holds its knobs."""

from __future__ import annotations

from dataclasses import dataclass

from flashgen.codegen.abi import KernelArg, TmaArg, needs_block_table
from flashgen.codegen.dtypes import DTYPES, dtype
from flashgen.codegen.plan import KernelPlan, TileConfig
from flashgen.families.bwd_common import (
    CONVERT_THREADS,
    HOPPER_BWD_TEMPLATE,
    PRE_WARPS,
    BackwardContext,
    BackwardPlan,
    backward_abi,
    base_fields,
)
from flashgen.families.common import FAMILIES, tile_group_expr
from flashgen.families.tiles import HOPPER_BWD_HEAD_DIMS, HOPPER_BWD_TILES, HOPPER_BWD_TILES_SPLIT_D
from flashgen.frontend.ir import Spec

#: The template this family renders.
TEMPLATE = HOPPER_BWD_TEMPLATE
#: How the dQ = dS K GEMM gets its A operand (dS, stored transposed in shared memory):
#: ``"smem"`` reads it there through an M-major (transposed) wgmma descriptor; ``"ldmatrix"``
#: loads it into registers with ldmatrix.trans and runs the register-A form (as P in the
#: forward's P V).  Default "smem" (:attr:`Options.dq_a`).
HOPPER_BWD_DQ_A = ("smem", "ldmatrix")


@dataclass(frozen=True)
class Options:
    """Knobs of the Hopper backward: ``dq_a`` (:data:`HOPPER_BWD_DQ_A`) and ``head_groups``
    (the CTAs take (batch, KV head) pairs in L2 head groups; False: in order)."""

    dq_a: str = "smem"
    head_groups: bool = True


@dataclass(frozen=True)
class Context(BackwardContext):
    """The template context of the Hopper backward unit."""

    block_m: int
    block_n: int
    threads: int
    mma_t: str
    wgmma_ns: list
    dq_ldmatrix: bool
    split_d: bool
    dkv_n: int
    tt_ns: list
    bwd_tile_group: str


def eligible(spec: Spec, target: str, family: str = "auto") -> bool:
    """Whether ``spec``'s non-deterministic backward on ``target`` runs the wgmma dK/dV
    kernel (:func:`plan`): sm_90, ``family`` not ``"fa2"``, head_dim ==
    head_dim_v in :data:`HOPPER_BWD_HEAD_DIMS`, fp16/bf16, no varlen, and a mask that reads
    no tensor (no block table; causal, none, or an index-only mask walked with the tile
    classifier).  A score_mod is fine (its derivative comes from :mod:`flashgen.analysis.derive`).
    Everything else keeps the FA2-class kernels."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; known: {', '.join(FAMILIES)}")
    return (
        family != "fa2"
        and target == "sm_90"
        and spec.dtype in DTYPES
        and not DTYPES[spec.dtype].scaled  # fp8 specs have no backward
        and not spec.varlen
        and spec.head_dim == spec.head_dim_v
        and spec.head_dim in HOPPER_BWD_HEAD_DIMS
        and not needs_block_table(spec)
    )


def plan(
    spec: Spec,
    target: str,
    options: Options = Options(),
    *,
    causal_bits: bool = False,
    options_key: str = "",
) -> BackwardPlan:
    """The Hopper backward (``templates/sm_90/bwd.cu.j2``): an atomic-dQ :class:`BackwardPlan`
    whose dK/dV kernel runs its five GEMMs on wgmma (FlashAttention-3's backward, Shah et al.
    2024, without warp specialization), Q/dO/K/V by TMA.  ``pre`` and ``convert`` are the
    FA2-class path's (the same macros, templates/common/bwd_rowops.j2, and the same ABI,
    :func:`~flashgen.families.bwd_common.backward_abi`), rendered in this unit.

    The dkdv ABI is the atomic path's plus four ``CUtensorMap`` arguments (``tma_q``,
    ``tma_k``, ``tma_v``, ``tma_do``, built at launch from the named tensors).  head_dim
    256 takes the split layout (:data:`~flashgen.families.tiles.HOPPER_BWD_TILES_SPLIT_D`,
    context ``split_d``): 64-key CTAs whose warpgroups split dK, dV, dQ by head-dim columns.
    ``options.dq_a``: one of :data:`HOPPER_BWD_DQ_A`.  ``causal_bits``: see
    :func:`~flashgen.families.bwd_common.tile_classifier`.  Raises ``ValueError`` unless
    :func:`eligible` (family "auto"), or for an unknown ``dq_a``.
    """
    dq_a = options.dq_a
    if dq_a not in HOPPER_BWD_DQ_A:
        raise ValueError(
            f"dQ A operand {dq_a!r} (hopper_bwd.dq_a): expected one of "
            f"{', '.join(HOPPER_BWD_DQ_A)}"
        )
    if not eligible(spec, target):
        raise ValueError(
            f"spec {spec.name!r} on {target}: the Hopper backward needs sm_90, head_dim == "
            f"head_dim_v in {list(HOPPER_BWD_HEAD_DIMS)}, no varlen, and a mask that reads no "
            "tensor"
        )
    d = spec.head_dim
    rec = dtype(spec.dtype)
    elt = rec.elem_bytes
    split_d = d > 128  # see HOPPER_BWD_TILES_SPLIT_D
    t = HOPPER_BWD_TILES_SPLIT_D if split_d else HOPPER_BWD_TILES
    abi = backward_abi(spec, atomic_dq=True)
    block_m, block_n, threads = t.dkdv_block_m, t.dkdv_block_n, 32 * t.dkdv_warps
    tma = (TmaArg("tma_q", "q", block_m), TmaArg("tma_k", "k", block_n),
           TmaArg("tma_v", "v", block_n), TmaArg("tma_do", "dout", block_m))  # fmt: skip
    dkdv_args = abi["dkdv_args"] + tuple(KernelArg(m.name, "CUtensorMap") for m in tma)
    # 1 KiB alignment slack, K and V, two stages of Q and dO, dS^T (and P^T when split_d),
    # lse/dsum (2 stages, fp32), mbarriers
    smem = 1024 + 2 * block_n * d * elt + 4 * block_m * d * elt
    smem += (2 if split_d else 1) * block_n * block_m * elt
    smem += 4 * block_m * 4 + 3 * 8
    base = f"flashgen_{spec.name}_bwd_{target}_wgmma"
    ctx = base_fields(spec, causal_bits)
    ctx.update(
        atomic_dq=True,
        pre_args=abi["pre_args"],
        convert_args=abi["convert_args"],
        convert_threads=CONVERT_THREADS,
        pre_warps=PRE_WARPS,
        block_m=block_m,
        block_n=block_n,
        threads=threads,
        kernel_pre=f"{base}_pre",
        kernel_dkdv=f"{base}_dkdv",
        kernel_convert=f"{base}_convert",
        dkdv_args=dkdv_args,
        dkdv_smem_bytes=smem,
        mma_t=rec.mma_t,
        wgmma_ns=sorted({block_m // 2, d // 2}) if split_d else sorted({block_m, d}),
        dq_ldmatrix=dq_a == "ldmatrix",
        split_d=split_d,
        dkv_n=d // 2 if split_d else d,  # N of the dV, dK (and dQ) wgmmas of one warpgroup
        tt_ns=[d // 2] if split_d else [64],  # N of the transposed-A dQ wgmma
        # CTA order: (batch, KV head) pairs in L2-sized groups (common/tile_order.cuh)
        bwd_tile_group=tile_group_expr(spec, backward=True) if options.head_groups else "1",
    )
    context = Context(**ctx)

    def kp(name: str, warps: int, smem_bytes: int, args, tma_args=()) -> KernelPlan:
        return KernelPlan(
            spec_name=spec.name,
            target=target,
            template=HOPPER_BWD_TEMPLATE,
            kernel_name=name,
            tiles=TileConfig(16 * warps, 16, warps),
            smem_bytes=smem_bytes,
            args=tuple(args),
            context=context,
            tma=tma_args,
            options_key=options_key,
        )

    pre = kp(context.kernel_pre, PRE_WARPS, 0, abi["pre_args"])
    dkdv = kp(context.kernel_dkdv, t.dkdv_warps, smem, dkdv_args, tma)
    convert = kp(context.kernel_convert, CONVERT_THREADS // 32, 0, abi["convert_args"])
    return BackwardPlan(spec.name, target, t, pre, dkdv, None, convert, atomic_dq=True)
