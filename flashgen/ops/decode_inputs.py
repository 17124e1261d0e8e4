"""Inputs of the decode op (:mod:`flashgen.ops.decode`): the call's sizes
(:class:`DecodeDims`), the metadata validation, the value checks, the page gather and the
host model of the keys the kernels attend for unchecked values (:func:`unchecked_key_mask`).

Moved out of :mod:`flashgen.ops.decode` unchanged; that module re-exports the public names."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from flashgen.families import decode as family
from flashgen.frontend import ir
from flashgen.frontend.errors import OpInputError
from flashgen.ops.validation import TORCH_DTYPE, out_dtype


# ----------------------------------------------------------------------------- validation
@dataclass(frozen=True)
class DecodeDims:
    """Sizes of a with_kvcache call, read off validated inputs (no device reads)."""

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int  # Sq_new
    head_dim_v: int
    paged: bool
    num_pages: int  # paged: pages in the cache; dense: batch
    page_size: int  # paged: keys per page; dense: S_cache
    max_pages: int  # paged: block_table.shape[1]; dense: 1
    append: bool

    @property
    def capacity(self) -> int:
        """Keys a request can hold: max_pages * page_size (paged) or S_cache (dense)."""
        return self.max_pages * self.page_size if self.paged else self.page_size

    def symbols(self) -> dict[str, int]:
        return {"batch": self.batch, "num_heads": self.heads_q, "num_heads_kv": self.heads_kv}


def _tensor(name: str, t, dims: int, what: str):
    if not isinstance(t, torch.Tensor):
        raise OpInputError(f"{name}: expected a torch.Tensor {what}, got {type(t).__name__}")
    if t.dim() != dims:
        raise OpInputError(f"{name}: expected a {dims}-D tensor {what}, got shape {list(t.shape)}")


def _aligned_16(t) -> bool:
    """Whether the kernels' 16-byte copies can address every row of ``t`` directly."""
    if t.numel() == 0:
        return True
    ok = t.data_ptr() % 16 == 0
    for n, s in zip(t.shape[:-1], t.stride()[:-1], strict=True):
        ok = ok and (n <= 1 or s % 8 == 0)
    return ok


def validate_decode(
    spec: ir.Spec,
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    block_table=None,
    k_new=None,
    v_new=None,
) -> DecodeDims:
    """Check a with_kvcache call's tensors against ``spec`` and the op contract (module
    doc): metadata only, never tensor contents.  Returns :class:`DecodeDims`; raises
    :class:`OpInputError` naming the argument, the expected and the received value."""
    want = TORCH_DTYPE[spec.dtype]
    _tensor("q", q, 4, "[batch, heads, seqlen_q_new, head_dim]")
    paged = block_table is not None
    layout = (
        "[num_pages, page_size, heads_kv, head_dim]"
        if paged
        else "[batch, heads_kv, seqlen_cache, head_dim]"
    )
    _tensor("k_cache", k_cache, 4, layout)
    _tensor("v_cache", v_cache, 4, layout)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != want:
            raise OpInputError(
                f"{name}: expected dtype {want} (spec {spec.name!r} has dtype {spec.dtype}), "
                f"got {t.dtype}"
            )
        if t.device != q.device:
            raise OpInputError(f"{name}: expected device {q.device} (q's device), got {t.device}")
        if t.numel() > 0 and t.stride(-1) != 1:
            raise OpInputError(
                f"{name}: expected stride(-1) == 1 (head_dim contiguous), got strides "
                f"{list(t.stride())}"
            )
    batch, hq, sq, d = q.shape
    if d != spec.head_dim:
        raise OpInputError(f"q: expected head_dim {spec.head_dim} (shape[-1]), got {d}")
    if k_cache.shape[3] != spec.head_dim:
        raise OpInputError(
            f"k_cache: expected head_dim {spec.head_dim} (shape[-1]), got {k_cache.shape[3]}"
        )
    if v_cache.shape[3] != spec.head_dim_v:
        raise OpInputError(
            f"v_cache: expected head_dim_v {spec.head_dim_v} (shape[-1]), got {v_cache.shape[3]}"
        )
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        raise OpInputError(
            f"v_cache: expected the leading dims {list(k_cache.shape[:3])} of k_cache, got "
            f"{list(v_cache.shape[:3])}"
        )
    if paged:
        _tensor("block_table", block_table, 2, "[batch, max_pages] of int32")
        num_pages, page_size, hkv = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
        if block_table.dtype != torch.int32:
            raise OpInputError(f"block_table: expected dtype torch.int32, got {block_table.dtype}")
        if block_table.device != q.device:
            raise OpInputError(
                f"block_table: expected device {q.device} (q's device), got {block_table.device}"
            )
        if block_table.shape[0] != batch:
            raise OpInputError(
                f"block_table: expected {batch} rows (q's batch), got shape "
                f"{list(block_table.shape)}"
            )
        if block_table.numel() > 0 and block_table.stride(-1) != 1:
            raise OpInputError(
                f"block_table: expected stride(-1) == 1, got strides {list(block_table.stride())}"
            )
        if page_size < 1:
            raise OpInputError(f"k_cache: expected page_size (shape[1]) >= 1, got {page_size}")
        max_pages = block_table.shape[1]
    else:
        if k_cache.shape[0] != batch:
            raise OpInputError(
                f"k_cache: expected batch {batch} (q's batch; a paged cache needs block_table), "
                f"got shape {list(k_cache.shape)}"
            )
        hkv, page_size, num_pages, max_pages = k_cache.shape[1], k_cache.shape[2], batch, 1
    if hkv == 0 or hq % hkv:
        raise OpInputError(
            f"q: expected num_heads to be a multiple of the cache's num_heads_kv {hkv}, got {hq}"
        )
    _tensor("cache_seqlens", cache_seqlens, 1, "[batch] of int32")
    if cache_seqlens.dtype != torch.int32:
        raise OpInputError(f"cache_seqlens: expected dtype torch.int32, got {cache_seqlens.dtype}")
    if cache_seqlens.device != q.device:
        raise OpInputError(
            f"cache_seqlens: expected device {q.device} (q's device), got {cache_seqlens.device}"
        )
    if cache_seqlens.shape[0] != batch:
        raise OpInputError(
            f"cache_seqlens: expected shape [{batch}] (q's batch), got {list(cache_seqlens.shape)}"
        )
    if (k_new is None) != (v_new is None):
        raise OpInputError("k_new, v_new: expected both or neither, got only one")
    if k_new is not None:
        for name, t, dd in (("k_new", k_new, spec.head_dim), ("v_new", v_new, spec.head_dim_v)):
            _tensor(name, t, 4, "[batch, heads_kv, seqlen_q_new, head_dim]")
            if t.dtype != want:
                raise OpInputError(f"{name}: expected dtype {want}, got {t.dtype}")
            if t.device != q.device:
                raise OpInputError(
                    f"{name}: expected device {q.device} (q's device), got {t.device}"
                )
            if list(t.shape) != [batch, hkv, sq, dd]:
                raise OpInputError(
                    f"{name}: expected shape {[batch, hkv, sq, dd]} ([batch, heads_kv, "
                    f"seqlen_q_new, head_dim]), got {list(t.shape)}"
                )
            if t.numel() > 0 and t.stride(-1) != 1:
                raise OpInputError(f"{name}: expected stride(-1) == 1, got {list(t.stride())}")
    if q.numel() > 0 and q.stride(-1) != 1:
        raise OpInputError(f"q: expected stride(-1) == 1, got strides {list(q.stride())}")
    if q.is_cuda:
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not _aligned_16(t):
                raise OpInputError(
                    f"{name}: expected a 16-byte aligned base and strides that are multiples "
                    f"of 8 elements (the kernels copy 16-byte chunks and the cache is updated "
                    f"in place, so it is not copied), got strides {list(t.stride())}"
                )
    return DecodeDims(
        batch, hq, hkv, sq, spec.head_dim_v, paged, num_pages, page_size, max_pages,
        k_new is not None,
    )  # fmt: skip


def check_values(dims: DecodeDims, cache_seqlens, block_table) -> None:
    """The value checks (module doc): ``cache_seqlens >= 0``, the live keys within the
    request's pages (``block_table`` long enough) or the dense cache, page indices of the
    live pages in ``[0, num_pages)``.  Reads the tensors (a host sync on CUDA).
    :class:`OpInputError` naming the first bad request."""
    lens = cache_seqlens.detach().to("cpu", torch.int64)
    if lens.numel() and int(lens.min()) < 0:
        b = int((lens < 0).nonzero()[0])
        raise OpInputError(
            f"cache_seqlens: expected values >= 0, got {int(lens[b])} at request {b}"
        )
    live = lens + (dims.seqlen_q if dims.append else 0)
    cap = dims.capacity
    if live.numel() and int(live.max()) > cap:
        b = int((live > cap).nonzero()[0])
        what = (
            f"block_table: too short: request {b} needs {int(live[b])} keys "
            f"({-(-int(live[b]) // dims.page_size)} pages of {dims.page_size}), the table has "
            f"{dims.max_pages} pages per request"
            if dims.paged
            else f"cache_seqlens: request {b} needs {int(live[b])} keys, the cache holds {cap}"
        )
        raise OpInputError(what)
    if dims.paged and live.numel():
        table = block_table.detach().to("cpu", torch.int64)
        need = (live + dims.page_size - 1) // dims.page_size
        cols = torch.arange(dims.max_pages).view(1, -1)
        used = cols < need.view(-1, 1)
        bad = used & ((table < 0) | (table >= dims.num_pages))
        if bool(bad.any()):
            b, j = (int(x) for x in bad.nonzero()[0])
            raise OpInputError(
                f"block_table: expected page indices in [0, {dims.num_pages}) (k_cache.shape[0]), "
                f"got {int(table[b, j])} at [{b}, {j}]"
            )


def check_out(spec: ir.Spec, out, o_shape, device) -> None:
    """Check ``out = (o, lse)`` of a with_kvcache call: o of shape ``o_shape`` ``[B, Hq,
    Sq_new, Dv]`` in the spec's output dtype, lse ``[B, Hq, Sq_new]`` float32, both
    contiguous on ``device``.  :class:`OpInputError` naming the tensor otherwise."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise OpInputError(f"out: expected a pair (o, lse) of tensors, got {type(out).__name__}")
    o_shape = tuple(o_shape)
    for name, t, shape, dtype in (("out[0]", out[0], o_shape, out_dtype(spec)),
                                  ("out[1]", out[1], o_shape[:-1], torch.float32)):  # fmt: skip
        if not isinstance(t, torch.Tensor):
            raise OpInputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise OpInputError(
                f"{name}: expected shape {list(shape)} and dtype {dtype}, got "
                f"{list(t.shape)} {t.dtype}"
            )
        if t.device != device:
            raise OpInputError(f"{name}: expected device {device} (q's device), got {t.device}")
        if not t.is_contiguous():
            raise OpInputError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def check_num_splits(num_splits) -> int:
    """``num_splits`` as an int: None -> 0 (the heuristic), else an int in [1, 128]."""
    if num_splits is None:
        return 0
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise OpInputError(f"num_splits: expected None or an int in [1, 128], got {num_splits!r}")
    n = int(num_splits)
    if not 1 <= n <= family.MAX_SPLITS:
        raise OpInputError(f"num_splits: expected an int in [1, {family.MAX_SPLITS}], got {n}")
    return n


# ----------------------------------------------------------------------------- reference
def unchecked_key_mask(dims: DecodeDims, cache_seqlens, block_table=None):
    """The keys the CUDA kernels attend for values the debug check would refuse (module doc),
    as host tensors: ``(live [B] int64, mask [B, capacity] bool)``.  ``live`` is
    ``cache_seqlens + new keys`` clamped to ``[0, capacity]`` (the request's pages, or the
    dense cache); ``mask[b, kv]`` is ``kv < live[b]`` and, paged, its page index in ``[0,
    num_pages)`` (a bad page is empty, the request's other keys are attended).  The host
    mirror of the attention kernel's ``live`` / ``locate`` (templates/sm_80/decode.cu.j2),
    the oracle of the GPU tests that pass such values; reads the tensors."""
    lens = cache_seqlens.detach().to("cpu", torch.int64)
    cap = dims.capacity
    live = (lens + (dims.seqlen_q if dims.append else 0)).clamp(0, cap)
    kv = torch.arange(cap).view(1, -1)
    mask = kv < live.view(-1, 1)
    if dims.paged:
        table = block_table.detach().to("cpu", torch.int64)
        pages = table[:, kv[0] // dims.page_size]
        mask &= (pages >= 0) & (pages < dims.num_pages)
    return live, mask


def gather_cache(k_cache, v_cache, b: int, live: int, block_table=None):
    """Request ``b``'s first ``live`` keys as ``(k [Hkv, live, D], v [Hkv, live, Dv])``."""
    if block_table is None:
        return k_cache[b, :, :live], v_cache[b, :, :live]
    ps = k_cache.shape[1]
    pages = block_table[b, : (live + ps - 1) // ps].long()
    k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:live]
    v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:live]
    return k.transpose(0, 1), v.transpose(0, 1)
