"""Inputs of the decode op (:mod:`flashgen.ops.decode.op`): the call's sizes
(:class:`DecodeDims`), the metadata validation, the value checks, the page gather and the
host model of the keys the kernels attend for unchecked values (:func:`unchecked_key_mask`).

Moved out of :mod:`flashgen.ops.decode.op` unchanged; that module re-exports the public names."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, replace

import torch
from torch._subclasses.fake_tensor import is_fake

from flashgen.families import decode as family
from flashgen.frontend import ir
from flashgen.frontend.errors import OpInputError
from flashgen.ops.validation import TORCH_DTYPE, check_input_device, check_layout, out_dtype


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
    total_q: int | None = None  # ragged Sq_new: q's rows (seqlen_q is then max_seqlen_q)
    #: the cache's element type when it is not the spec's (a flashgen.codegen.dtypes name:
    #: "fp8_e4m3" for a float8_e4m3fn cache); part of the plan and the unit key
    cache_dtype: str | None = None

    @property
    def ragged(self) -> bool:
        """Whether the call is ragged (q ``[total_q, Hq, D]`` with ``cu_seqlens_q``)."""
        return self.total_q is not None

    @property
    def capacity(self) -> int:
        """Keys a request can hold: max_pages * page_size (paged) or S_cache (dense)."""
        return self.max_pages * self.page_size if self.paged else self.page_size

    def symbols(self) -> dict[str, int]:
        """A tensor param's shape symbols in decode (:data:`flashgen.families.decode.
        TENSOR_EXTENTS`): ``seqlen_q`` is Sq_new (ragged: ``max_seqlen_q``), ``seqlen_k`` the
        cache's :attr:`capacity`."""
        return {"batch": self.batch, "num_heads": self.heads_q, "num_heads_kv": self.heads_kv,
                "seqlen_q": self.seqlen_q, "seqlen_k": self.capacity}  # fmt: skip

    def out_shapes(self) -> tuple[tuple, tuple]:
        """``(o shape, lse shape)`` of the call: padded ``[B, Hq, Sq_new, Dv]`` and ``[B, Hq,
        Sq_new]``; ragged ``[total_q, Hq, Dv]`` and ``[Hq, total_q]`` (the varlen op's)."""
        if self.ragged:
            return (self.total_q, self.heads_q, self.head_dim_v), (self.heads_q, self.total_q)
        return (
            (self.batch, self.heads_q, self.seqlen_q, self.head_dim_v),
            (self.batch, self.heads_q, self.seqlen_q),
        )


def _tensor(name: str, t, dims: int, what: str):
    if not isinstance(t, torch.Tensor):
        raise OpInputError(f"{name}: expected a torch.Tensor {what}, got {type(t).__name__}")
    check_layout(name, t)
    if t.dim() != dims:
        raise OpInputError(f"{name}: expected a {dims}-D tensor {what}, got shape {list(t.shape)}")


def _addresses_readable(t) -> bool:
    """Whether :func:`validate_decode` reads ``t``'s address (the cache alignment check):
    not while ``torch.compile`` traces the call (Dynamo cannot trace ``data_ptr()``; the
    traced call runs the registered op, whose CUDA kernel validates the real tensors again
    and so checks their addresses at run time), and not for a fake tensor (the registered
    op's fake kernel: no storage, no address)."""
    return not torch.compiler.is_compiling() and not is_fake(t)


def _aligned_16(t) -> bool:
    """Whether the kernels' 16-byte copies can address every row of ``t`` directly (a
    16-byte aligned base and strides of whole 16-byte chunks: 8 elements of 2 bytes, 16 of
    an e4m3 cache)."""
    if t.numel() == 0:
        return True
    ok = t.data_ptr() % 16 == 0
    size = t.element_size()
    for n, s in zip(t.shape[:-1], t.stride()[:-1], strict=True):
        ok = ok and (n <= 1 or (s * size) % 16 == 0)
    return ok


#: torch dtype of an e4m3 KV cache (None where torch lacks it).
FP8_CACHE = getattr(torch, "float8_e4m3fn", None)


def cache_dtype_of(spec: ir.Spec, k_cache) -> str | None:
    """The :mod:`flashgen.codegen.dtypes` name of ``k_cache``'s dtype when it is a cache
    dtype the spec's decode can read besides its own (``"fp8_e4m3"`` for float8_e4m3fn with
    an fp16 / bf16 spec), else None (the spec's dtype, or a dtype validation refuses)."""
    if FP8_CACHE is not None and isinstance(k_cache, torch.Tensor) and k_cache.dtype == FP8_CACHE:
        if family.cache_dtype_reason(spec, "fp8_e4m3") is None:
            return "fp8_e4m3"
    return None


def cpu_float32(q, cache_dtype: str | None = None) -> bool:
    """Whether a call runs in float32 on the CPU: a float32 ``q`` there (with float32 caches
    and outputs), as ``op.attention`` takes it; not with an e4m3 cache."""
    return (
        isinstance(q, torch.Tensor) and q.dtype == torch.float32 and q.device.type == "cpu"
        and cache_dtype is None
    )  # fmt: skip


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
    :class:`OpInputError` naming the argument, the expected and the received value.
    The CUDA caches' alignment (their addresses) is checked on real tensors only, not while
    ``torch.compile`` traces nor on fake tensors (:func:`_addresses_readable`): the registered
    op's CUDA kernel checks it when the compiled call runs.

    An e4m3 cache (float8_e4m3fn ``k_cache`` and ``v_cache`` for an fp16 / bf16 spec whose head
    dims are multiples of 64) gives ``dims.cache_dtype = "fp8_e4m3"``; k_new / v_new must then
    be e4m3 too and q may be (its descale is the caller's: :mod:`flashgen.ops.decode.fp8`).
    A ``v_from_k`` spec (MLA) takes ``v_cache`` / ``v_new`` as views of k_cache / k_new (the
    op makes them) and a cache of num_heads_kv 1.  A float32 q on the CPU takes float32
    caches and gives a float32 o, as ``op.attention`` does."""
    cache_dtype = cache_dtype_of(spec, k_cache)
    want = torch.float32 if cpu_float32(q, cache_dtype) else TORCH_DTYPE[spec.dtype]
    kv_want = FP8_CACHE if cache_dtype else want
    _tensor("q", q, 4, "[batch, heads, seqlen_q_new, head_dim]")
    check_input_device(spec, "q", q, (torch.float32,))
    paged = block_table is not None
    layout = (
        "[num_pages, page_size, heads_kv, head_dim]"
        if paged
        else "[batch, heads_kv, seqlen_cache, head_dim]"
    )
    _tensor("k_cache", k_cache, 4, layout)
    _tensor("v_cache", v_cache, 4, layout)
    if q.dtype != want and not (cache_dtype and q.dtype == FP8_CACHE):
        also = f" or {FP8_CACHE} with q_descale (the cache is e4m3)" if cache_dtype else ""
        cpu = "; float32 also on the CPU" if q.device.type == "cpu" and not cache_dtype else ""
        raise OpInputError(
            f"q: expected dtype {want}{also} (spec {spec.name!r} has dtype {spec.dtype}{cpu}), "
            f"got {q.dtype}"
        )
    if k_cache.dtype != kv_want and want == torch.float32:
        raise OpInputError(f"k_cache: expected dtype {want} (q's: a float32 call on the CPU), "
                           f"got {k_cache.dtype}")  # fmt: skip
    if k_cache.dtype != kv_want:
        raise OpInputError(f"k_cache: expected dtype {want} (spec {spec.name!r} has dtype "
                           f"{spec.dtype}){_fp8_note(spec)}, got {k_cache.dtype}")  # fmt: skip
    if v_cache.dtype != k_cache.dtype:
        raise OpInputError(
            f"v_cache: expected dtype {k_cache.dtype} (k_cache's dtype), got {v_cache.dtype}"
        )
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
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
        dense_hkv = k_cache.shape[1]
        if (hkv == 0 or hq % hkv) and num_pages == batch and dense_hkv and hq % dense_hkv == 0:
            raise OpInputError(  # a dense cache [B, Hkv, S_cache, D] with a block table
                f"block_table: needs a paged cache, k_cache [num_pages, page_size, heads_kv, "
                f"head_dim], got k_cache of shape {list(k_cache.shape)} (num_heads_kv {hkv} "
                f"does not divide q's {hq} heads); it looks like a dense cache [batch, "
                f"heads_kv, seqlen_cache, head_dim], which takes block_table=None"
            )
    else:
        if k_cache.shape[0] != batch:
            raise OpInputError(
                f"k_cache: expected batch {batch} (q's batch; a paged cache needs block_table), "
                f"got shape {list(k_cache.shape)}"
            )
        hkv, page_size, num_pages, max_pages = k_cache.shape[1], k_cache.shape[2], batch, 1
    if spec.v_from_k and hkv != 1:
        raise OpInputError(
            f"k_cache: expected num_heads_kv 1 (spec {spec.name!r} has v_from_k: true: one "
            f"latent cache for every query head; shape[{2 if paged else 1}]), got {hkv}"
        )
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
    if batch > 1 and cache_seqlens.stride(0) != 1:  # the kernels read cache_seqlens[b]
        raise OpInputError(
            f"cache_seqlens: expected a contiguous tensor (stride 1), got strides "
            f"{list(cache_seqlens.stride())}"
        )
    if (k_new is None) != (v_new is None):
        raise OpInputError("k_new, v_new: expected both or neither, got only one")
    if k_new is not None:
        for name, t, dd in (("k_new", k_new, spec.head_dim), ("v_new", v_new, spec.head_dim_v)):
            _tensor(name, t, 4, "[batch, heads_kv, seqlen_q_new, head_dim]")
            if t.dtype != kv_want:
                what = " (the cache's: quantized with its descales)" if cache_dtype else ""
                raise OpInputError(f"{name}: expected dtype {kv_want}{what}, got {t.dtype}")
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
    # a v_from_k spec's v_cache / v_new are views of k_cache / k_new: its append writes K alone
    check_aliasing(k_cache, v_cache, k_new, None if spec.v_from_k else v_new)
    if q.is_cuda:
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if _addresses_readable(t) and not _aligned_16(t):
                raise OpInputError(
                    f"{name}: expected a 16-byte aligned base and strides that are multiples "
                    f"of {16 // t.element_size()} elements (the kernels copy 16-byte chunks "
                    f"and the cache is updated in place, so it is not copied), got strides "
                    f"{list(t.stride())}"
                )
    return DecodeDims(
        batch, hq, hkv, sq, spec.head_dim_v, paged, num_pages, page_size, max_pages,
        k_new is not None, cache_dtype=cache_dtype,
    )  # fmt: skip


def check_aliasing(k_cache, v_cache, k_new=None, v_new=None) -> None:
    """Refuse, from metadata, memory that an append would write through twice or read while
    writing (issue 38): with ``k_new`` / ``v_new``, a cache whose elements share memory (an
    expanded, stride-0 cache: :func:`~flashgen.ops.out_arg.self_overlapping`), ``k_cache``
    and ``v_cache`` sharing memory (``k_cache is v_cache``, :func:`~flashgen.ops.out_arg.
    shares_memory`: two views of one combined KV buffer that interleave without sharing are
    fine), and ``k_new`` / ``v_new`` sharing memory with a cache.  Without an append nothing
    is written and any of it is fine (``k_cache is v_cache`` reads one buffer twice); an
    append of ``k_new`` alone (no ``v_new``: values that are a prefix of the keys' columns,
    MLA) writes ``k_cache`` only, so ``v_cache`` may be a view of it.
    Not while ``torch.compile`` traces nor on fake tensors (:func:`_addresses_readable`).
    :class:`OpInputError` naming the tensor."""
    from flashgen.ops.out_arg import self_overlapping, shares_memory

    given = [t for t in (k_cache, v_cache, k_new, v_new) if t is not None]
    if k_new is None or not all(
        isinstance(t, torch.Tensor) and _addresses_readable(t) for t in given
    ):
        return
    written = [("k_cache", k_cache)] + ([("v_cache", v_cache)] if v_new is not None else [])
    for name, t in written:
        if t.numel() and self_overlapping(t):
            raise OpInputError(
                f"{name}: expected a cache whose elements have their own memory (the append "
                f"writes into it), got shape {list(t.shape)} with strides {list(t.stride())}, "
                f"whose elements alias (an expanded or overlapping view); pass a real buffer"
            )
    if v_new is not None and shares_memory(k_cache, v_cache):
        raise OpInputError(
            "v_cache: expected memory apart from k_cache (the append writes k_new into one and "
            "v_new into the other), got a tensor sharing memory with k_cache"
            + (" (k_cache is v_cache)" if k_cache is v_cache else "")
        )
    news = [("k_new", k_new)] + ([("v_new", v_new)] if v_new is not None else [])
    for name, t in news:
        for cname, c in written:
            if shares_memory(t, c):
                raise OpInputError(
                    f"{name}: expected memory apart from {cname} (the append writes into "
                    f"{cname} while reading {name}), got a tensor sharing memory with it"
                )


def check_slots(dims: DecodeDims, lens, new, block_table) -> None:
    """The slot rule of an append through a block table (issue 38), from values: the cache
    slots the call writes (request b's keys ``[lens[b], lens[b] + new[b])`` through its table
    row) are pairwise distinct and no other key the call reads (any request's ``[0, lens[b']
    + new[b'])``) lives in one of them.  Pages shared read-only (a common prefix) and requests
    with nothing to append are fine.  ``lens``, ``new``: int64 ``[B]`` on the CPU, checked
    (live keys within the table, page indices in range).  Reads ``block_table`` (a host sync
    on CUDA).  :class:`OpInputError` naming the requests, the key and the page."""
    if not (dims.append and dims.paged) or lens.numel() == 0 or int(new.max()) <= 0:
        return
    ps = dims.page_size
    table = block_table.detach().to("cpu", torch.int64)
    live = lens + new
    cols = torch.arange(dims.max_pages).view(1, -1)
    used = cols < ((live + ps - 1) // ps).view(-1, 1)
    first, last = (lens // ps).view(-1, 1), ((live - 1) // ps).view(-1, 1)
    writes_to = used & (cols >= first) & (cols <= last) & (new > 0).view(-1, 1)
    pages = torch.unique(table[writes_to])  # sorted: the only pages a conflict can be in
    # every key the call reads that lives in one of those pages: (request, column) entries
    hit = used & torch.isin(table, pages)
    b_idx, j_idx = hit.nonzero(as_tuple=True)
    offs = torch.arange(ps).view(1, -1)
    pos = j_idx.view(-1, 1) * ps + offs  # [E, ps] key positions
    keep = pos < live[b_idx].view(-1, 1)
    slot = torch.searchsorted(pages, table[b_idx, j_idx]).view(-1, 1) * ps + offs
    counts = torch.bincount(slot[keep], minlength=pages.numel() * ps)
    writing = keep & (pos >= lens[b_idx].view(-1, 1))
    bad = writing & (counts[slot] > 1)
    if not bool(bad.any()):
        return
    e, off = (int(x) for x in bad.nonzero()[0])
    b, p, s = int(b_idx[e]), int(pos[e, off]), int(slot[e, off])
    page = int(table[b, p // ps])
    others = [(int(b_idx[i]), int(pos[i, o])) for i, o in (keep & (slot == s)).nonzero().tolist()]
    b2, p2 = next(x for x in others if x != (b, p))
    how = "appends" if p2 >= int(lens[b2]) else "reads"
    raise OpInputError(
        f"block_table: request {b} appends its key {p} to page {page} slot {p % ps}, where "
        f"request {b2} {how} its key {p2}; the slots a call appends to must be used by no "
        f"other key of the call (pages shared read-only, a common prefix, are fine)"
    )


def _fp8_note(spec: ir.Spec) -> str:
    """What the k_cache dtype error adds about e4m3 caches for ``spec``."""
    why = family.cache_dtype_reason(spec, "fp8_e4m3")
    if FP8_CACHE is None:
        return ""
    if why is None:
        return f" or {FP8_CACHE} (an e4m3 cache, with k_descale / v_descale)"
    return f" ({FP8_CACHE} caches: {why})"


def check_values(dims: DecodeDims, cache_seqlens, block_table, cu_seqlens_q=None) -> None:
    """The value checks (module doc): ``cache_seqlens >= 0``, the live keys within the
    request's pages (``block_table`` long enough) or the dense cache, page indices of the
    live pages in ``[0, num_pages)``; ragged (``cu_seqlens_q``), first the offsets
    (:func:`check_cu_seqlens_q`), each request appending its own Sq_b.  An append
    (``dims.append``) that would run past the request's pages (which the kernels drop) is
    refused naming the request and its append, and so is an append through the table that
    breaks the slot rule (:func:`check_slots`: two requests' keys in one slot).  Reads the
    tensors (a host sync on CUDA).  :class:`OpInputError` naming the first bad request."""
    lens = cache_seqlens.detach().to("cpu", torch.int64)
    if lens.numel() and int(lens.min()) < 0:
        b = int((lens < 0).nonzero()[0])
        raise OpInputError(
            f"cache_seqlens: expected values >= 0, got {int(lens[b])} at request {b}"
        )
    if cu_seqlens_q is not None:
        new = check_cu_seqlens_q(dims, cu_seqlens_q)
    else:
        new = torch.full_like(lens, dims.seqlen_q)
    if not dims.append:
        new = torch.zeros_like(lens)
    live = lens + new
    cap = dims.capacity
    if dims.append and live.numel() and int(live.max()) > cap:
        b = int((live > cap).nonzero()[0])
        where = (
            f"its {dims.max_pages} pages of {dims.page_size} (block_table row {b})"
            if dims.paged
            else f"the dense cache's {cap} slots"
        )
        raise OpInputError(
            f"k_new: the append of request {b} would run past its pages: cache_seqlens[{b}] = "
            f"{int(lens[b])} + {int(new[b])} new keys = {int(live[b])} keys, more than {where} "
            f"(the kernel would drop the keys past them)"
        )
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
    if dims.append and dims.paged:
        check_slots(dims, lens, new, block_table)


def check_cu_seqlens_q(dims: DecodeDims, cu_seqlens_q):
    """Check a ragged call's ``cu_seqlens_q`` values (as the varlen op's
    :func:`flashgen.ops.prefill.varlen.check_cu_seqlens`): start at 0, nondecreasing, end at
    ``total_q``, every Sq_b <= ``max_seqlen_q`` (``dims.seqlen_q``).  Returns Sq_b ``[B]``
    int64 (CPU).  Reads the tensor (a host sync on CUDA); :class:`OpInputError` naming the
    first offending entry."""
    cu = cu_seqlens_q.detach().to("cpu", torch.int64)
    if int(cu[0]) != 0:
        raise OpInputError(f"cu_seqlens_q: expected cu_seqlens_q[0] == 0, got {int(cu[0])}")
    n = cu[1:] - cu[:-1]
    if n.numel() and int(n.min()) < 0:
        i = int((n < 0).nonzero()[0]) + 1
        raise OpInputError(
            f"cu_seqlens_q: expected nondecreasing offsets, got cu_seqlens_q[{i - 1}] = "
            f"{int(cu[i - 1])} > cu_seqlens_q[{i}] = {int(cu[i])}"
        )
    if int(cu[-1]) != dims.total_q:
        raise OpInputError(
            f"cu_seqlens_q: expected cu_seqlens_q[-1] == {dims.total_q} (q's rows), got "
            f"{int(cu[-1])}"
        )
    if n.numel() and int(n.max()) > dims.seqlen_q:
        b = int((n > dims.seqlen_q).nonzero()[0])
        raise OpInputError(
            f"max_seqlen_q: expected at least every request's Sq_b, but request {b} has "
            f"{int(n[b])} queries (> {dims.seqlen_q})"
        )
    return n


def validate_decode_ragged(
    spec: ir.Spec, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
    cu_seqlens_q, max_seqlen_q,
) -> DecodeDims:  # fmt: skip
    """Metadata checks of a ragged with_kvcache call (module doc of
    :mod:`flashgen.ops.decode.op`): q ``[total_q, Hq, D]``, ``cu_seqlens_q`` int32 ``[B + 1]``
    on q's device, ``max_seqlen_q`` an int in ``[0, total_q]`` (>= 1 when total_q > 0),
    k_new / v_new ``[total_q, Hkv, D / Dv]``; the cache, lengths and table as
    :func:`validate_decode`.  Never reads tensor contents.  Returns :class:`DecodeDims` with
    ``seqlen_q = max_seqlen_q`` and ``total_q``; raises :class:`OpInputError`."""
    want = TORCH_DTYPE[spec.dtype]
    if cpu_float32(q, cache_dtype_of(spec, k_cache)):
        want = torch.float32
    _tensor("q", q, 3, "[total_q, heads, head_dim] (ragged, with cu_seqlens_q)")
    check_input_device(spec, "q", q, (torch.float32,))
    if q.dtype != want and not (cache_dtype_of(spec, k_cache) and q.dtype == FP8_CACHE):
        raise OpInputError(
            f"q: expected dtype {want} (spec {spec.name!r} has dtype {spec.dtype}), got {q.dtype}"
        )
    if q.numel() > 0 and q.stride(-1) != 1:
        raise OpInputError(f"q: expected stride(-1) == 1, got strides {list(q.stride())}")
    _tensor("cu_seqlens_q", cu_seqlens_q, 1, "[batch + 1] of int32")
    if cu_seqlens_q.dtype != torch.int32:
        raise OpInputError(f"cu_seqlens_q: expected dtype torch.int32, got {cu_seqlens_q.dtype}")
    if cu_seqlens_q.device != q.device:
        raise OpInputError(
            f"cu_seqlens_q: expected device {q.device} (q's device), got {cu_seqlens_q.device}"
        )
    if cu_seqlens_q.shape[0] < 1:
        raise OpInputError(
            f"cu_seqlens_q: expected shape [batch + 1] (>= 1 entry), got {list(cu_seqlens_q.shape)}"
        )
    if cu_seqlens_q.shape[0] > 1 and cu_seqlens_q.stride(0) != 1:  # the kernels read cu[b]
        raise OpInputError(
            f"cu_seqlens_q: expected a contiguous tensor (stride 1), got strides "
            f"{list(cu_seqlens_q.stride())}"
        )
    total_q, hq, d = q.shape
    if isinstance(max_seqlen_q, bool) or not isinstance(
        max_seqlen_q, (numbers.Integral, torch.SymInt)
    ):  # a SymInt: the fake kernel under torch.compile's dynamic shapes
        raise OpInputError(f"max_seqlen_q: expected a Python int, got {max_seqlen_q!r}")
    if not 0 <= int(max_seqlen_q) <= max(total_q, 0) or (total_q > 0 and max_seqlen_q == 0):
        raise OpInputError(
            f"max_seqlen_q: expected an int in [1, {total_q}] (q's rows; 0 only when q is "
            f"empty), got {max_seqlen_q}"
        )
    batch = cu_seqlens_q.shape[0] - 1
    # The padded checks of q (on a row-free stand-in: no allocation), the cache, the lengths
    # and the table; then k_new / v_new against the cache, named in their own ragged shapes.
    q4 = q.new_empty((batch, hq, 0, d))
    if (k_new is None) != (v_new is None):
        raise OpInputError("k_new, v_new: expected both or neither, got only one")
    for name, t in (("k_new", k_new), ("v_new", v_new)) if k_new is not None else ():
        _tensor(name, t, 3, "[total_q, heads_kv, head_dim] (ragged)")
        if t.shape[0] != total_q:
            raise OpInputError(
                f"{name}: expected {total_q} rows (q's total_q), got shape {list(t.shape)}"
            )
    if (
        isinstance(cache_seqlens, torch.Tensor)
        and cache_seqlens.dim() == 1
        and cache_seqlens.shape[0] != batch
    ):  # the batch is cu_seqlens_q's: name it, not q (validate_decode's "q's batch")
        raise OpInputError(
            f"cu_seqlens_q: expected shape [{cache_seqlens.shape[0] + 1}] (batch + 1: "
            f"cache_seqlens has {cache_seqlens.shape[0]} requests), got {list(cu_seqlens_q.shape)}"
        )
    dims = validate_decode(spec, q4, k_cache, v_cache, cache_seqlens, block_table)
    if k_new is not None:
        kv_want = FP8_CACHE if dims.cache_dtype else k_cache.dtype  # the spec's, or float32
        for name, t, dd in (("k_new", k_new, spec.head_dim), ("v_new", v_new, spec.head_dim_v)):
            want = [total_q, dims.heads_kv, dd]
            if list(t.shape) != want:
                raise OpInputError(
                    f"{name}: expected shape {want} ([total_q, heads_kv, head_dim]: q's rows, "
                    f"the cache's heads), got {list(t.shape)}"
                )
            if t.dtype != kv_want:
                what = " (the cache's: quantized with its descales)" if dims.cache_dtype else ""
                raise OpInputError(f"{name}: expected dtype {kv_want}{what}, got {t.dtype}")
            if t.device != q.device:
                raise OpInputError(
                    f"{name}: expected device {q.device} (q's device), got {t.device}"
                )
            if t.numel() > 0 and t.stride(-1) != 1:
                raise OpInputError(f"{name}: expected stride(-1) == 1, got {list(t.stride())}")
        check_aliasing(k_cache, v_cache, k_new, None if spec.v_from_k else v_new)
    return replace(dims, seqlen_q=int(max_seqlen_q), total_q=total_q, append=k_new is not None)


def check_out(spec: ir.Spec, out, o_shape, device, lse_shape=None, inputs=None) -> None:
    """Check ``out = (o, lse)`` of a with_kvcache call: o of shape ``o_shape`` (``[B, Hq,
    Sq_new, Dv]``; ragged ``[total_q, Hq, Dv]``) in the spec's output dtype, lse of shape
    ``lse_shape`` (None: ``o_shape[:-1]``, the padded ``[B, Hq, Sq_new]``; ragged ``[Hq,
    total_q]``) float32, both contiguous on ``device``, not requiring grad nor lazily negated
    (``torch._neg_view``), sharing no memory with each other nor with any of ``inputs`` (name
    -> tensor or None: q, the caches, k_new, ...; :func:`flashgen.ops.out_arg.overlaps`,
    metadata only; not while Dynamo traces).
    :class:`OpInputError` naming the tensor, the expected and the received value otherwise."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise OpInputError(f"out: expected a pair (o, lse) of tensors, got {type(out).__name__}")
    o_shape = tuple(o_shape)
    lse_shape = o_shape[:-1] if lse_shape is None else tuple(lse_shape)
    q = (inputs or {}).get("q")
    o_dtype = torch.float32 if cpu_float32(q) and q.device == device else out_dtype(spec)
    for name, t, shape, dtype in (("out[0]", out[0], o_shape, o_dtype),
                                  ("out[1]", out[1], lse_shape, torch.float32)):  # fmt: skip
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
        if t.requires_grad:
            raise OpInputError(
                f"{name}: expected a tensor that does not require grad (the op overwrites it), "
                f"got one with requires_grad=True"
            )
        if t.is_neg():  # the kernels write its memory: the values read back would be negated
            raise OpInputError(
                f"{name}: expected a tensor whose memory holds its values, got a lazily "
                f"negated view (pass .resolve_neg() of it, or a fresh tensor)"
            )
    if torch.compiler.is_compiling():
        return
    from flashgen.ops.out_arg import overlaps

    if overlaps(out[0], out[1]):
        raise OpInputError("out[1]: expected memory apart from out[0] (o), got one overlapping it")
    for name, t in (inputs or {}).items():
        for oname, o in (("out[0]", out[0]), ("out[1]", out[1])):
            if isinstance(t, torch.Tensor) and overlaps(o, t):
                raise OpInputError(
                    f"{oname}: expected memory that no input shares, got a tensor overlapping "
                    f"{name}"
                )


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
