"""Block tables for masks that read tensor params (document masking and the like).

A mask such as ``causal && doc_q[b, q_idx] == doc_kv[b, kv_idx]`` cannot be classified
per tile from indices alone (:mod:`flashgen.maskinfo` leaves it PARTIAL).  Like
FlexAttention's ``create_block_mask``, a pre-pass evaluates the mask over every
(BLOCK_M x BLOCK_N) tile of the forward kernel and records one byte per tile:

    0 EMPTY    no in-range pair is kept: the forward kernel never loads the tile
    1 PARTIAL  the kernel evaluates the mask per element
    2 FULL     every in-range pair is kept: the kernel skips the mask expression

The table is uint8 ``[tab_b, tab_h, ceil(seqlen_q / BLOCK_M), ceil(seqlen_k / BLOCK_N)]``
(``tab_b`` = batch when the mask reads ``b``, else 1; ``tab_h`` likewise for ``h``), so
it costs O(tiles) memory.  On a GPU it is built by the generated kernel of
:func:`flashgen.lower.plan_block_table`; :func:`block_table_reference` is the brute-force
torch version (CPU ``op.block_mask`` and the tests).

Users build one with ``bm = op.block_mask(seqlen_q, seqlen_k, doc_q=..., doc_kv=...)``
and pass it to ``op.attention(..., block_mask=bm)`` for as long as the tensor params'
contents do not change (the op cannot check contents without a device sync); without
``block_mask`` the op builds a fresh table on every call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .ir import Spec
from .lower import TileConfig, block_table_dims, block_table_shape
from .reference import eval_mask

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class BlockMask:
    """A block table built for one op and problem size (see the module docstring).

    ``table``: uint8 ``[tab_b, tab_h, m_blocks, n_blocks]`` on the device it was built
    on; ``block_m`` / ``block_n``: the forward kernel's tiles it classifies;
    ``scalars``: the values of the scalar params the mask was evaluated with (the op
    refuses a call with different ones).
    """

    spec_name: str
    table: torch.Tensor
    block_m: int
    block_n: int
    batch: int
    heads_q: int
    seqlen_q: int
    seqlen_k: int
    scalars: dict = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.table.shape)

    def counts(self) -> dict[str, int]:
        """Number of EMPTY / PARTIAL / FULL tiles (reads the table: syncs its device)."""
        t = self.table
        return {
            "empty": int((t == EMPTY).sum()),
            "partial": int((t == PARTIAL).sum()),
            "full": int((t == FULL).sum()),
        }

    def __repr__(self) -> str:
        return (
            f"BlockMask({self.spec_name}, table {list(self.table.shape)} on "
            f"{self.table.device}, tiles {self.block_m}x{self.block_n}, "
            f"seqlen_q {self.seqlen_q}, seqlen_k {self.seqlen_k})"
        )


def block_table_reference(
    spec: Spec,
    tiles: TileConfig,
    *,
    batch: int,
    heads_q: int,
    seqlen_q: int,
    seqlen_k: int,
    params: dict,
    device=None,
) -> torch.Tensor:
    """Brute-force block table: the mask materialized with :func:`flashgen.reference.eval_mask`
    over every in-range pair, reduced per tile.  uint8 ``[tab_b, tab_h, m_blocks, n_blocks]``
    (:func:`flashgen.lower.block_table_shape`).  Memory O(tab_b * tab_h * seqlen_q *
    seqlen_k): for tests and the CPU op, not for long sequences.
    """
    tb, th, mb, nb = block_table_shape(spec, tiles, batch, heads_q, seqlen_q, seqlen_k)
    keep = eval_mask(
        spec, batch=tb, heads_q=th, seqlen_q=seqlen_q, seqlen_k=seqlen_k, params=params,
        device=device,
    )  # fmt: skip
    # Pad to whole tiles: padding counts as kept for "all" and as dropped for "any".
    pm, pn = mb * tiles.block_m - seqlen_q, nb * tiles.block_n - seqlen_k
    shape = (tb, th, mb, tiles.block_m, nb, tiles.block_n)
    any_ = torch.nn.functional.pad(keep, (0, pn, 0, pm), value=False).view(shape)
    all_ = torch.nn.functional.pad(keep, (0, pn, 0, pm), value=True).view(shape)
    any_t = any_.any(dim=5).any(dim=3)
    all_t = all_.all(dim=5).all(dim=3)
    out = torch.full((tb, th, mb, nb), PARTIAL, dtype=torch.uint8, device=keep.device)
    out[~any_t] = EMPTY
    out[all_t & any_t] = FULL
    return out


def table_strides(spec: Spec, table: torch.Tensor) -> tuple[int, int]:
    """``(blk_sb, blk_sh)``: element strides of the table's batch / head axes for the
    forward kernel, 0 where the mask does not depend on ``b`` / ``h``."""
    per_b, per_h = block_table_dims(spec)
    return (table.stride(0) if per_b else 0, table.stride(1) if per_h else 0)
