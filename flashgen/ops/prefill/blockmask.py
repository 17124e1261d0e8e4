"""Block tables for masks that read tensor params (document masking and the like).

A mask such as ``causal && doc_q[b, q_idx] == doc_kv[b, kv_idx]`` cannot be classified
per tile from indices alone (:mod:`flashgen.analysis.maskinfo` leaves it PARTIAL).  Like
FlexAttention's ``create_block_mask``, a pre-pass evaluates the mask over every
(BLOCK_M x BLOCK_N) tile of the forward kernel and records one byte per tile:

    0 EMPTY    no in-range pair is kept: the forward kernel never loads the tile
    1 PARTIAL  the kernel evaluates the mask per element
    2 FULL     every in-range pair is kept: the kernel skips the mask expression

The table is uint8 ``[tab_b, tab_h, ceil(seqlen_q / BLOCK_M), ceil(seqlen_k / BLOCK_N)]``
(``tab_b`` = batch when the mask reads ``b``, else 1; ``tab_h`` likewise for ``h``), so
it costs O(tiles) memory.  On a GPU it is built by the generated kernel of
:func:`flashgen.families.registry.plan_block_table`; :func:`block_table_reference` is the
brute-force torch version (CPU ``op.block_mask`` and the tests).

Users build one with ``bm = op.block_mask(seqlen_q, seqlen_k, doc_q=..., doc_kv=...)``
and pass it to ``op.attention(..., block_mask=bm)`` for as long as the tensor params'
contents do not change: the op refuses other tensors and tensors written in place since
(their ``_version``, :meth:`TableInputs.changed`), but cannot compare contents without a
device sync; without ``block_mask`` the op builds a fresh table on every call.  A table
holds only for the tiles it was built for (the kernel that ``op.block_mask`` found: the
Hopper kernel's on sm_90, the FA2-class kernel's for an op bound to
``Options(family="fa2")``); an op refuses it with a kernel of other tiles
(:func:`table_for_tiles`).

A :class:`BlockMask` also holds the tables of other tiles that a call needs, FlexAttention's
BlockMask holding both the forward's and the backward's: the Hopper backward classifies its
own BLOCK_M x BLOCK_N tiles (not the forward's), so the first backward of a call given
``block_mask=bm`` builds that table once, from the tensor and scalar params ``bm`` was built
with (:class:`TableInputs`), and ``bm`` keeps it under :func:`table_key` (the tiles and the
table's layout) for every later backward of any op of the spec whose backward runs those
tiles (:meth:`BlockMask.held`).  The forward's table is held under its own key, so a
backward of the forward's tiles builds nothing.  The held tables are a cache: a pickled or
copied ``bm`` holds the forward's table only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

import torch

from flashgen.codegen.abi import block_table_dims
from flashgen.codegen.plan import TileConfig
from flashgen.families.blocktable import block_table_shape
from flashgen.frontend.errors import OpInputError
from flashgen.frontend.ir import Spec
from flashgen.ops.cpu.reference import eval_mask

EMPTY, PARTIAL, FULL = 0, 1, 2

#: The layout of every block table the kernels read: uint8 ``[tab_b, tab_h, m_blocks,
#: n_blocks]``, contiguous, a row per query block (the forward's walk and the Hopper
#: backward's ``fg::table_class`` / ``fg::table_hull_lane`` index it so).  Part of
#: :func:`table_key`, so a table of another layout would never be taken for one of this.
TABLE_LAYOUT = "b,h,m,n"


def table_key(block_m: int, block_n: int) -> tuple[int, int, str]:
    """The key a :class:`BlockMask` holds a table under: the ``block_m`` x ``block_n`` tiles
    it classifies and :data:`TABLE_LAYOUT`."""
    return (block_m, block_n, TABLE_LAYOUT)


def table_arg(table: torch.Tensor, block_m: int, block_n: int) -> torch.Tensor:
    """``table`` as an op's ``block_mask`` argument: a broadcast view (no copy) ``[tab_b, tab_h,
    m_blocks, n_blocks, block_m, block_n]`` with zero strides on the last two axes, so the
    tiles it classifies travel with it into the CUDA impl, which refuses a table built for
    other tiles than its kernel's (see :func:`table_for_tiles`)."""
    return table[..., None, None].expand(*table.shape, block_m, block_n)


def tensor_version(t) -> int | None:
    """``t._version`` (torch's count of in-place writes to ``t`` and the views sharing its
    version counter: host metadata, no device sync), or None where there is none (not a
    tensor, an inference tensor: those track no version)."""
    if not isinstance(t, torch.Tensor) or t.is_inference():
        return None
    try:
        return t._version
    except RuntimeError:  # a tensor subclass without a version counter
        return None


@dataclass(frozen=True)
class TableInputs:
    """What a :class:`BlockMask`'s tables are built from: the problem sizes (a
    :class:`~flashgen.ops.validation.Dims`), the scalar params' values in spec order and the
    tensor params the mask reads by name, as ``op.block_mask`` got them (the tensors are
    held, not copied).  ``versions``: each tensor's :func:`tensor_version` when the table
    was built (filled in at construction), so a tensor written in place since is told by
    :meth:`changed` (its contents may no longer match the tables).

    Pickled or copied, the tensors come back with new version counters: the count of
    writes since the build goes along instead, so the copy's :meth:`changed` says what the
    original's said."""

    dims: object
    scalars: tuple
    tensors: dict
    versions: dict | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.versions is None:
            versions = {n: tensor_version(t) for n, t in self.tensors.items()}
            object.__setattr__(self, "versions", versions)

    def changed(self) -> list[tuple[str, int, int]]:
        """``(name, version at the build, version now)`` of each held tensor written in
        place since the build (host metadata only)."""
        out = []
        for name, built in self.versions.items():
            if built is not None:
                now = tensor_version(self.tensors[name])
                if now is not None and now != built:
                    out.append((name, built, now))
        return out

    def __getstate__(self) -> dict:
        written = {
            n: None if v is None or tensor_version(self.tensors[n]) is None
            else tensor_version(self.tensors[n]) - v
            for n, v in self.versions.items()
        }  # fmt: skip
        return {"dims": self.dims, "scalars": self.scalars, "tensors": self.tensors,
                "written": written}  # fmt: skip

    def __setstate__(self, state: dict) -> None:
        tensors = state["tensors"]
        versions = {}
        for n, w in state["written"].items():
            now = tensor_version(tensors[n])
            versions[n] = None if w is None or now is None else now - w
        for name in ("dims", "scalars", "tensors"):
            object.__setattr__(self, name, state[name])
        object.__setattr__(self, "versions", versions)


@dataclass(frozen=True)
class BlockMask:
    """A block table built for one op and problem size (see the module docstring).

    ``table``: uint8 ``[tab_b, tab_h, m_blocks, n_blocks]`` on the device it was built
    on; ``block_m`` / ``block_n``: the forward kernel's tiles it classifies;
    ``scalars``: the values of the scalar params the mask was evaluated with (the op
    refuses a call with different ones); ``heads_kv``: the KV heads it was built for when
    the mask reads ``h_kv`` (the op refuses a call with another count), else None.
    ``inputs``: what its tables are built from (:class:`TableInputs`; None: it holds the
    forward's table only and a backward builds its own per call); ``tables``: the tables
    it holds by :func:`table_key`, the forward's first, each with the fence of its build or
    None (:meth:`held`).

    Picklable and copyable (``copy``, ``torch.save``, a DataLoader worker's result): the
    copy has a fresh lock and holds the forward's table only (the others are built again
    on first use), as one from ``dataclasses.replace``; its :attr:`inputs` keep the count
    of in-place writes since the build.
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
    heads_kv: int | None = None
    inputs: TableInputs | None = field(default=None, repr=False, compare=False)
    tables: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.tables.setdefault(table_key(self.block_m, self.block_n), (self.table, None))

    # The held tables and the lock are a cache: a pickled or copied BlockMask (copy.copy,
    # copy.deepcopy, torch.save, a DataLoader worker's result) gets a fresh lock and holds
    # the forward's table only, as one from dataclasses.replace does.
    def __getstate__(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "tables", {})
        object.__setattr__(self, "_lock", threading.Lock())
        self.__post_init__()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.table.shape)

    def op_arg(self) -> torch.Tensor:
        """The forward's table as the op's ``block_mask`` argument (:func:`table_arg`)."""
        return table_arg(self.table, self.block_m, self.block_n)

    def held(self, block_m: int, block_n: int, build) -> tuple:
        """``(table, fence)`` for ``block_m`` x ``block_n`` tiles: the pair held under
        :func:`table_key`, else ``build()``'s (a uint8 table for those tiles built from
        :attr:`inputs`, and what a later user on another stream must wait for, or None),
        held from then on.  Built once even when threads ask at the same time."""
        key = table_key(block_m, block_n)
        hit = self.tables.get(key)
        if hit is None:
            with self._lock:
                hit = self.tables.get(key)
                if hit is None:
                    hit = build()
                    self.tables[key] = hit
        return hit

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
    heads_kv: int | None = None,
) -> torch.Tensor:
    """Brute-force block table: the mask materialized with
    :func:`flashgen.ops.cpu.reference.eval_mask` over every in-range pair, reduced per tile.  uint8
    ``[tab_b, tab_h, m_blocks, n_blocks]`` (:func:`flashgen.families.blocktable.block_table_shape`).
     ``heads_kv``: the KV heads (``h_kv``; default ``heads_q``).  Memory O(tab_b * tab_h * seqlen_q
    * seqlen_k): for tests and the CPU op, not for long sequences.
    """
    tb, th, mb, nb = block_table_shape(spec, tiles, batch, heads_q, seqlen_q, seqlen_k)
    hkv = th if th != heads_q or heads_kv is None else heads_kv  # th == 1: h, h_kv unread
    keep = eval_mask(
        spec, batch=tb, heads_q=th, seqlen_q=seqlen_q, seqlen_k=seqlen_k, params=params,
        device=device, heads_kv=hkv,
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


def table_for_tiles(arg: torch.Tensor, shape: tuple[int, ...], tiles: TileConfig) -> torch.Tensor:
    """The uint8 ``shape`` table behind an op ``block_mask`` argument (:meth:`BlockMask.op_arg`)
    built for ``tiles`` (``shape``: :func:`flashgen.families.blocktable.block_table_shape`
    for them).

    Raises :class:`~flashgen.frontend.errors.OpInputError` when ``arg`` is not such a view, or was
    built for other tiles or sizes: a table's classes hold only for the tiles it was built
    for, so one built for another kernel (an op of other options, ``Options.family``, or
    another GPU) must be built again, never reinterpreted.
    """
    built = tuple(arg.shape[4:]) if arg.dim() == 6 else None
    want = (tiles.block_m, tiles.block_n)
    if built is not None and built != want:
        raise OpInputError(
            f"block_mask: built for {built[0]}x{built[1]} tiles, but this call runs a kernel "
            f"with {want[0]}x{want[1]} tiles (built by an op of other options, Options.family, "
            f"or on another GPU?); build it again with this op's op.block_mask(...)"
        )
    table = arg[..., 0, 0] if built is not None else None
    if (
        table is None
        or tuple(arg.stride()[4:]) != (0, 0)
        or tuple(table.shape) != shape
        or table.dtype != torch.uint8
        or not table.is_contiguous()
    ):
        raise OpInputError(
            f"block_mask: expected the uint8 table view of op.block_mask(...).op_arg() of shape "
            f"{[*shape, *want]} for this kernel's {want[0]}x{want[1]} tiles, got "
            f"{arg.dtype} {list(arg.shape)}; build it with op.block_mask(...) on the same device"
        )
    return table
