"""Serving: attention against a KV cache (``op.with_kvcache``, FlashAttention's
``flash_attn_with_kvcache`` and FlashInfer's plan/run, in flashgen's axis order).

Status: the CPU path is tested in CI; the CUDA kernels (:mod:`flashgen.families.decode`,
``templates/sm_80/decode.cu.j2``) await GPU validation (tests/gpu/test_decode_gpu.py).

Op contract::

    o, lse = op.with_kvcache(q, k_cache, v_cache, cache_seqlens, *, block_table=None,
                             k_new=None, v_new=None, num_splits=None, plan=None,
                             softmax_scale=None, **params)

    q            [B, Hq, Sq_new, D], the spec's dtype, stride(-1) == 1 (BSHD views work)
    k_cache      dense [B, Hkv, S_cache, D], or paged [num_pages, page_size, Hkv, D] with
                 block_table (FlashInfer's [num_pages, Hkv, page_size, D] as a transposed
                 view); v_cache the same with Dv; stride(-1) == 1, on CUDA 16-byte aligned
                 with strides that are multiples of 8 elements
    cache_seqlens int32 [B]: request b's cache holds cache_seqlens[b] keys
    block_table  int32 [B, max_pages] (paged only), stride(-1) == 1
    k_new, v_new [B, Hkv, Sq_new, D / Dv]: written into the cache at cache_seqlens[b]
                 (in place) and attended: the live keys are cache_seqlens[b] + Sq_new
    o [B, Hq, Sq_new, Dv] (spec dtype), lse [B, Hq, Sq_new] float32 (natural log)

The queries are the last Sq_new of the live keys: the mask and score_mod see q_idx in
[0, Sq_new), kv_idx in [0, L), seqlen_q = Sq_new, seqlen_k = L (the padded op on the
gathered cache, bottom-right causal).  A request with no live key gives o = 0, lse = -inf.

Values (cache_seqlens >= 0, the live keys within the request's pages, page indices in [0,
num_pages)) are checked on CPU inputs always and on CUDA inputs when
:data:`flashgen.env.VARLEN_CHECK` is set to 1 (one host sync); unchecked, the kernels clamp the
live length to the request's pages, treat a page index outside [0, num_pages) as empty (its keys
are masked) and drop appends past the request's pages: they never read or write outside the cache
tensors.

Registered ops: ``flashgen::<name>__with_kvcache`` (no k_new) and
``flashgen::<name>__with_kvcache_append`` (declares that it mutates k_cache and v_cache),
each with CPU, CUDA and fake kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import threading
from dataclasses import dataclass

import torch

from flashgen import env
from flashgen.families import decode as family
from flashgen.families import registry
from flashgen.frontend import ir
from flashgen.frontend.errors import OpInputError
from flashgen.ops import calls as _calls
from flashgen.ops import validation as _validation
from flashgen.ops.calls import _kernel_aligned, _plain_eager, _sm_count, current_stream_ptr
from flashgen.ops.validation import (
    _SCHEMA_TYPE,
    PARAM_DTYPE,
    TORCH_DTYPE,
    _poison_enabled,
    check_enabled,
    check_scalar,
    check_softmax_scale,
    default_softmax_scale,
    out_dtype,
    resolve_params,
    target_for_device,
    validate_tensor_params,
)
from flashgen.runtime import tma as _tma  # ctypes only, no CuPy

_REG_LOCK = threading.RLock()


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


def append_reference(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table=None) -> None:
    """Write ``k_new``/``v_new`` ``[B, Hkv, Sq, D]`` into the cache at ``cache_seqlens[b]`` (in
    place; rows past the request's pages dropped, as the kernel does)."""
    batch, _, sq, _ = k_new.shape
    lens = cache_seqlens.to("cpu", torch.int64).tolist()
    for b in range(batch):
        for s in range(sq):
            pos = lens[b] + s
            if pos < 0:
                continue
            if block_table is None:
                if pos >= k_cache.shape[2]:
                    continue
                k_cache[b, :, pos] = k_new[b, :, s]
                v_cache[b, :, pos] = v_new[b, :, s]
            else:
                ps = k_cache.shape[1]
                pi = pos // ps
                if pi >= block_table.shape[1]:
                    continue
                pg = int(block_table[b, pi])
                if not 0 <= pg < k_cache.shape[0]:
                    continue
                k_cache[pg, pos % ps] = k_new[b, :, s]
                v_cache[pg, pos % ps] = v_new[b, :, s]


def decode_reference(
    spec: ir.Spec,
    q,
    k_cache,
    v_cache,
    live_lens,
    block_table=None,
    *,
    softmax_scale: float | None = None,
    params: dict | None = None,
    compute_dtype=torch.float64,
):
    """Attention of each request's queries over its first ``live_lens[b]`` cached keys, on
    the gathered keys (one request at a time, ``b`` its batch index): by
    :func:`flashgen.ops.reference.attention_reference` for a float64 ``compute_dtype`` (the
    test oracle) or a low-precision one (the error bound's torch math), for float32 by the
    padded op's CPU path
    (:func:`flashgen.ops.cpu_attention.attention_blocked`, so the decode op on CPU equals the
    padded op on the gathered cache bitwise).  o ``[B, Hq, Sq, Dv]`` in ``compute_dtype``, lse
    ``[B, Hq, Sq]`` (float32, float64 for a float64 reference); no live key: o = 0,
    lse = -inf."""
    from flashgen.ops.cpu_attention import attention_blocked
    from flashgen.ops.reference import attention_reference

    batch, hq, sq, _ = q.shape
    dv = v_cache.shape[-1]
    lse_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    o = torch.zeros(batch, hq, sq, dv, dtype=compute_dtype, device=q.device)
    lse = torch.full((batch, hq, sq), -math.inf, dtype=lse_dtype, device=q.device)
    lens = [int(x) for x in torch.as_tensor(live_lens).tolist()]
    for b in range(batch):
        if lens[b] <= 0 or sq == 0:
            continue
        k, v = gather_cache(k_cache, v_cache, b, lens[b], block_table)
        if compute_dtype != torch.float32:  # the float64 oracle, or torch's low-precision math
            ob, lb = attention_reference(
                spec, q[b : b + 1], k[None], v[None], softmax_scale=softmax_scale,
                params=params, compute_dtype=compute_dtype, batch_offset=b,
            )  # fmt: skip
        else:
            if softmax_scale is None:
                softmax_scale = default_softmax_scale(spec)
            ob, lb = attention_blocked(
                spec, q[b : b + 1], k[None], v[None], softmax_scale=softmax_scale,
                params=params, batch_offset=b,
            )  # fmt: skip
        o[b] = ob[0]
        lse[b] = lb[0].to(lse_dtype)
    return o, lse


# ----------------------------------------------------------------------------- merge
def merge_attention(o_a, lse_a, o_b, lse_b):
    """Exact merge of two attention results over disjoint key sets (FlashInfer's
    ``merge_state``; the combine of split-KV): ``lse = log(exp(lse_a) + exp(lse_b))``,
    ``o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b``, computed in float32.

    ``o_*`` ``[..., Dv]`` (float32, float16 or bfloat16), ``lse_*`` ``[...]`` float32 (natural
    log; -inf: no key, weight 0), one device.  Returns ``(o, lse)``: o in ``o_a``'s dtype
    (a caller that accumulates keeps float32), lse float32; both -inf gives o = 0, lse =
    -inf.  Raises :class:`OpInputError` for mismatched shapes, dtypes or devices."""
    for name, t in (("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b)):
        if not isinstance(t, torch.Tensor):
            raise OpInputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.device != o_a.device:
            raise OpInputError(f"{name}: expected device {o_a.device} (o_a's), got {t.device}")
    if o_a.shape != o_b.shape:
        raise OpInputError(f"o_b: expected shape {list(o_a.shape)} (o_a's), got {list(o_b.shape)}")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(t.shape) != tuple(o_a.shape[:-1]):
            raise OpInputError(
                f"{name}: expected shape {list(o_a.shape[:-1])} (o's without its last dim), got "
                f"{list(t.shape)}"
            )
        if t.dtype != torch.float32:
            raise OpInputError(f"{name}: expected dtype torch.float32, got {t.dtype}")
    for name, t in (("o_a", o_a), ("o_b", o_b)):
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise OpInputError(
                f"{name}: expected dtype float32, float16 or bfloat16, got {t.dtype}"
            )
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa = torch.exp(lse_a - m_safe)
    wb = torch.exp(lse_b - m_safe)
    total = wa + wb
    empty = total == 0
    lse = torch.where(empty, torch.full_like(m, -math.inf), m_safe + torch.log(total))
    inv = torch.where(empty, torch.zeros_like(total), 1.0 / torch.where(empty, 1.0, total))
    o = (wa * inv).unsqueeze(-1) * o_a.float() + (wb * inv).unsqueeze(-1) * o_b.float()
    return o.to(o_a.dtype), lse


# ----------------------------------------------------------------------------- plans
@dataclass
class DecodeCallPlan:
    """What :meth:`DecodeOp.plan_decode` precomputes for calls of one shape (FlashInfer's
    plan): the sizes it fixes (batch, heads, Sq_new, cache layout and capacity, append or
    not), the split count, the grids, the kernels, the workspace and the launch values
    that do not change between calls.  Cache lengths, block-table contents and the cache
    itself may change between calls and graph replays (read on the device).  Its
    workspace is used in stream order: one plan per concurrently used stream."""

    dims: DecodeDims
    num_splits: int
    geometry: family.Geometry
    device: torch.device
    kernels: dict
    fixed: dict
    o_part: torch.Tensor | None
    lse_part: torch.Tensor | None
    pack_gqa: bool = True
    #: int32 [tiles] split counters of the fused combine, zero between launches (the last
    #: CTA of a tile resets its own); None without splits or without a workspace
    counters: torch.Tensor | None = None
    #: the planned fast path (:class:`_FastPath`), CUDA plans from plan_decode only
    fast: object = None
    #: the unit's and the schedule's knobs (:class:`flashgen.families.decode.Options`)
    options: family.Options = family.Options()
    #: key blocks the mask keeps at the planned capacity (:func:`~flashgen.families.decode.
    #: live_key_blocks`; a sliding window's), None: the capacity's; sized the splits
    live_blocks: int | None = None


# ----------------------------------------------------------------------------- the op
class DecodeOp:
    """The serving entry points of one :class:`~flashgen.ops.op.AttentionOp` (``op.with_kvcache``,
    ``op.plan_decode``); built on first use."""

    def __init__(self, op):
        self.op = op
        self.spec = op.spec
        self.name = f"{op.spec.name}__with_kvcache"
        self.append_name = f"{op.spec.name}__with_kvcache_append"
        self._units: dict = {}
        self._live: dict = {}
        self._lock = threading.Lock()
        self._registered = False
        self.reason = family.unsupported_reason(self.spec)

    def _refuse(self) -> None:
        if self.reason is not None:
            raise OpInputError(f"with_kvcache: {self.reason}")

    # ------------------------------------------------------------------ registration
    def schema(self, append: bool) -> str:
        spec = self.spec
        kv = (
            "Tensor(a!) k_cache, Tensor(b!) v_cache" if append else "Tensor k_cache, Tensor v_cache"
        )
        args = ["Tensor q", kv, "Tensor cache_seqlens", "Tensor? block_table"]
        if append:
            args += ["Tensor k_new", "Tensor v_new"]
        args += ["float softmax_scale", "int num_splits"]
        args += [f"{_SCHEMA_TYPE[p.ty]} {p.name}" for p in spec.scalar_params]
        args += [f"Tensor {p.name}" for p in spec.tensor_params]
        name = self.append_name if append else self.name
        return f"{name}({', '.join(args)}) -> (Tensor, Tensor)"

    def register(self) -> None:
        """Register both torch ops (once per process)."""
        if self._registered:
            return
        with _REG_LOCK:
            if self._registered:
                return
            lib = self.op._lib  # the op's own library: a reload removes both
            for append in (False, True):
                name = self.append_name if append else self.name
                lib.define(self.schema(append))
                lib.impl(name, functools.partial(self._impl_cpu, append), "CPU")
                lib.impl(name, functools.partial(self._impl_cuda, append), "CUDA")
                torch.library.register_fake(
                    f"flashgen::{name}", functools.partial(self._impl_fake, append), lib=lib
                )
            self._registered = True

    def torch_op(self, append: bool):
        self.register()
        return getattr(torch.ops.flashgen, self.append_name if append else self.name).default

    def _unpack(self, append: bool, args):
        """Schema arguments -> (q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
        softmax_scale, num_splits, scalars, tensor map)."""
        q, kc, vc, lens, table = args[:5]
        rest = args[5:]
        k_new = v_new = None
        if append:
            k_new, v_new, rest = rest[0], rest[1], rest[2:]
        scale, splits, rest = rest[0], rest[1], rest[2:]
        n = len(self.spec.scalar_params)
        scalars = list(rest[:n])
        tensors = {p.name: t for p, t in zip(self.spec.tensor_params, rest[n:], strict=True)}
        return q, kc, vc, lens, table, k_new, v_new, scale, splits, scalars, tensors

    def _outputs(self, q, dims: DecodeDims):
        o = torch.empty(
            (dims.batch, dims.heads_q, dims.seqlen_q, dims.head_dim_v),
            dtype=out_dtype(self.spec), device=q.device,
        )  # fmt: skip
        lse = torch.empty(
            (dims.batch, dims.heads_q, dims.seqlen_q), dtype=torch.float32, device=q.device
        )
        return o, lse

    def _impl_fake(self, append, *args):
        q, kc, vc, lens, table, k_new, v_new, *_ = self._unpack(append, args)
        dims = validate_decode(self.spec, q, kc, vc, lens, table, k_new, v_new)
        return self._outputs(q, dims)

    def _impl_cpu(self, append, *args):
        q, kc, vc, lens, table, k_new, v_new, scale, splits, scalars, tensors = self._unpack(
            append, args
        )
        dims = validate_decode(self.spec, q, kc, vc, lens, table, k_new, v_new)
        self._check_params(scale, scalars, tensors, dims, q.device)
        check_values(dims, lens, table)
        if append:
            append_reference(kc, vc, lens, k_new, v_new, table)
        live = lens.to(torch.int64) + (dims.seqlen_q if append else 0)
        params = dict(zip((p.name for p in self.spec.scalar_params), scalars, strict=True))
        params.update({n: t.to(PARAM_DTYPE[self.spec.param(n).ty]) for n, t in tensors.items()})
        ro, rl = decode_reference(
            self.spec, q, kc, vc, live, table, softmax_scale=scale, params=params,
            compute_dtype=torch.float32,
        )  # fmt: skip
        o, lse = self._outputs(q, dims)
        o.copy_(ro)
        lse.copy_(rl)
        return o, lse

    def _impl_cuda(self, append, *args):
        q, kc, vc, lens, table, k_new, v_new, scale, splits, scalars, tensors = self._unpack(
            append, args
        )
        dims = validate_decode(self.spec, q, kc, vc, lens, table, k_new, v_new)
        self._check_params(scale, scalars, tensors, dims, q.device)
        if check_enabled():
            check_values(dims, lens, table)
        params = dict(zip([p.name for p in self.spec.scalar_params], scalars, strict=True))
        plan = self.plan_for(dims, q.device, splits or None, params=params)
        return self._launch(plan, q, kc, vc, lens, table, k_new, v_new, scale, scalars, tensors)

    def _check_params(self, scale, scalars, tensors, dims: DecodeDims, device) -> None:
        check_softmax_scale(scale)
        for p, val in zip(self.spec.scalar_params, scalars, strict=True):
            check_scalar(p, val)
        if self.spec.tensor_params:
            validate_tensor_params(self.spec, tensors, device, dims.symbols())

    # ------------------------------------------------------------------ user API
    def with_kvcache(
        self,
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        *,
        block_table=None,
        k_new=None,
        v_new=None,
        cu_seqlens_q=None,
        num_splits=None,
        plan: DecodeCallPlan | None = None,
        softmax_scale: float | None = None,
        out=None,
        **params,
    ):
        """Attention of ``q`` against a dense or paged KV cache (module doc); returns ``(o,
        lse)``.  ``num_splits``: None (the heuristic, or the plan's), or 1..128 (bitwise
        reproducible results for a fixed value, independent of the other requests).
        ``plan``: from :meth:`plan_decode` for this call's shapes (no host planning; CUDA
        graph capturable).  ``cu_seqlens_q`` (ragged Sq_new) is not supported yet.
        ``out``: ``(o, lse)`` to write instead of new tensors (contiguous, the shapes and
        dtypes above, on q's device; FlashInfer's ``out=``): a serving loop that reuses them
        saves the two allocations per call.  Returns ``out`` then.
        Raises :class:`OpInputError` for bad inputs or a spec decode does not support."""
        fast = getattr(plan, "fast", None)
        if fast is not None and cu_seqlens_q is None and num_splits is None:
            res = fast(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
                       softmax_scale, params, out)  # fmt: skip
            if res is not None:
                return res
        res = self._with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
                                 cu_seqlens_q, num_splits, plan, softmax_scale, params)  # fmt: skip
        if out is None:
            return res
        check_out(self.spec, out, res[0].shape, q.device)
        out[0].copy_(res[0])
        out[1].copy_(res[1])
        return out

    def _with_kvcache(self, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
                      cu_seqlens_q, num_splits, plan, softmax_scale, params):  # fmt: skip
        self._refuse()
        if cu_seqlens_q is not None:
            raise OpInputError(
                "cu_seqlens_q: ragged Sq_new is not supported yet by with_kvcache; pad q to "
                "[B, Hq, Sq_new, D]"
            )
        scalars, tensors = resolve_params(self.spec, params)
        tmap = {p.name: t for p, t in zip(self.spec.tensor_params, tensors, strict=True)}
        if softmax_scale is None:
            softmax_scale = default_softmax_scale(self.spec)
        softmax_scale = check_softmax_scale(softmax_scale)
        splits = check_num_splits(num_splits)
        dims = validate_decode(
            self.spec, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new
        )
        if self.spec.tensor_params:
            validate_tensor_params(self.spec, tmap, q.device, dims.symbols())
        if plan is not None:
            self._check_plan(plan, dims, q.device, splits)
        append = k_new is not None
        if q.is_cuda and _plain_eager(q, k_cache, v_cache):
            if check_enabled():
                check_values(dims, cache_seqlens, block_table)
            if plan is None:
                names = [p.name for p in self.spec.scalar_params]
                plan = self.plan_for(dims, q.device, splits or None,
                                     params=dict(zip(names, scalars, strict=True)))  # fmt: skip
            return self._launch(
                plan, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
                softmax_scale, scalars, tmap,
            )  # fmt: skip
        if plan is not None and not splits:
            splits = plan.num_splits
        args = [q, k_cache, v_cache, cache_seqlens, block_table]
        if append:
            args += [k_new, v_new]
        args += [softmax_scale, splits, *scalars, *tensors]
        return self.torch_op(append)(*args)

    def plan_decode(
        self,
        *,
        batch: int,
        num_heads: int,
        num_heads_kv: int,
        seqlen_q: int = 1,
        cache_capacity: int,
        page_size: int | None = None,
        num_pages: int | None = None,
        append: bool = False,
        num_splits: int | None = None,
        device=None,
        pack_gqa: bool = True,
        options: family.Options | None = None,
        **params,
    ) -> DecodeCallPlan:
        """Plan calls of one shape (FlashInfer's plan/run): ``batch`` requests, ``num_heads`` /
        ``num_heads_kv`` heads, ``seqlen_q`` new queries, ``cache_capacity`` keys per request
        (dense: S_cache; paged: max_pages * page_size, with ``page_size`` and ``num_pages``
        the paged cache's), ``append``: calls pass k_new/v_new.  ``num_splits`` None: the
        heuristic for this capacity on ``device``'s SM count.  ``pack_gqa`` False: one query
        head per CTA (for measurements).  ``options``: the unit's tiles and the split schedule
        (:class:`flashgen.families.decode.Options`; default: the op's ``Options.decode``;
        ``flashgen.bench.decode --sweep`` times a grid of them).  ``params``: values of the mask's
        scalar params the calls will pass (the spec's defaults otherwise): a mask that bounds the
        live keys (a sliding window) sizes the splits by its blocks, not the capacity's; calls may
        pass other values.
        Builds and loads the kernels and allocates the workspace on ``device`` (CUDA), so
        planned calls do no host planning and can be captured in a CUDA graph.  Raises
        :class:`OpInputError` for bad sizes, options or params."""
        self._refuse()
        if options is not None and not isinstance(options, family.Options):
            raise OpInputError(
                f"options: expected flashgen.families.decode.Options, got {type(options).__name__}"
            )
        scalar = {p.name: p for p in self.spec.scalar_params}
        for name, val in params.items():
            if name not in scalar:
                raise OpInputError(
                    f"{name}: not a scalar param of spec {self.spec.name!r} (expected one of "
                    f"{sorted(scalar)} or a plan_decode argument)"
                )
            check_scalar(scalar[name], val)
        for name, v in (("batch", batch), ("num_heads", num_heads), ("num_heads_kv", num_heads_kv),
                        ("seqlen_q", seqlen_q), ("cache_capacity", cache_capacity)):  # fmt: skip
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise OpInputError(f"{name}: expected a non-negative int, got {v!r}")
        if num_heads_kv == 0 or num_heads % num_heads_kv:
            raise OpInputError(
                f"num_heads: expected a multiple of num_heads_kv {num_heads_kv}, got {num_heads}"
            )
        paged = page_size is not None
        if paged:
            if not isinstance(page_size, int) or page_size < 1 or not isinstance(num_pages, int):
                raise OpInputError(
                    f"page_size, num_pages: expected ints >= 1 for a paged cache, got "
                    f"{page_size!r}, {num_pages!r}"
                )
            max_pages = -(-cache_capacity // page_size)
            dims = DecodeDims(batch, num_heads, num_heads_kv, seqlen_q, self.spec.head_dim_v,
                              True, num_pages, page_size, max_pages, append)  # fmt: skip
        else:
            dims = DecodeDims(batch, num_heads, num_heads_kv, seqlen_q, self.spec.head_dim_v,
                              False, batch, cache_capacity, 1, append)  # fmt: skip
        device = torch.device(device if device is not None else "cuda")
        if device.type == "cuda" and device.index is None:  # the current device, by index
            device = torch.device("cuda", torch.cuda.current_device())
        splits = check_num_splits(num_splits)
        return self.plan_for(dims, device, splits or None, pack_gqa=pack_gqa, own_workspace=True,
                             options=options, params=params)  # fmt: skip

    def _check_plan(self, plan, dims: DecodeDims, device, splits: int) -> None:
        if not isinstance(plan, DecodeCallPlan):
            raise OpInputError(
                f"plan: expected a plan from op.plan_decode, got {type(plan).__name__}"
            )
        p = plan.dims
        if (p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.paged, p.append) != (
            dims.batch, dims.heads_q, dims.heads_kv, dims.seqlen_q, dims.paged, dims.append,
        ):  # fmt: skip
            raise OpInputError(
                f"plan: planned for batch {p.batch}, heads {p.heads_q}/{p.heads_kv}, seqlen_q "
                f"{p.seqlen_q}, paged {p.paged}, append {p.append}; this call has batch "
                f"{dims.batch}, heads {dims.heads_q}/{dims.heads_kv}, seqlen_q {dims.seqlen_q}, "
                f"paged {dims.paged}, append {dims.append}"
            )
        if dims.capacity > p.capacity or (dims.paged and dims.page_size != p.page_size):
            raise OpInputError(
                f"plan: planned for a cache of {p.capacity} keys per request (page_size "
                f"{p.page_size}), this call has {dims.capacity} (page_size {dims.page_size})"
            )
        if plan.device != device:
            raise OpInputError(f"plan: planned for device {plan.device}, q is on {device}")
        if splits and splits != plan.num_splits:
            raise OpInputError(
                f"num_splits: the plan fixes {plan.num_splits}, this call asks for {splits}"
            )

    # ------------------------------------------------------------------ CUDA
    def kernels(self, device: torch.device, options: family.Options | None = None) -> dict:
        """The unit's loaded kernels on CUDA ``device`` (``attn``, ``append``) for the unit
        knobs of ``options`` (default: the head dim's), built through the cache on first use."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        options = options or self.op.options.decode
        key = (index, options.unit_key())
        hit = self._units.get(key)
        if hit is not None:
            return hit
        with self._lock:
            hit = self._units.get(key)
            if hit is None:
                from flashgen.build import cache
                from flashgen.build.render import render
                from flashgen.runtime import launch as runtime

                target = target_for_device(self.spec, torch.device("cuda", index))
                p = registry.plan_decode(
                    self.spec, target, dataclasses.replace(self.op.options, decode=options)
                )
                cubin, report = cache.get_or_build(render(p), p)
                hit = {r: runtime.load(cubin, p.kernel(r), index) for r in ("attn", "append")}
                hit["report"] = report
                self._units[key] = hit
        return hit

    def plan_for(
        self, dims: DecodeDims, device, num_splits: int | None, *, pack_gqa: bool = True,
        own_workspace: bool = False, options: family.Options | None = None,
        params: dict | None = None,
    ) -> DecodeCallPlan:  # fmt: skip
        """A :class:`DecodeCallPlan` for ``dims`` on ``device`` (see :meth:`plan_decode`);
        ``options`` None: the op's ``Options.decode``; ``params``: the mask's scalar params
        the split count is sized for (the spec's defaults where missing)."""
        options = options or self.op.options.decode
        pack_gqa = pack_gqa and options.pack_gqa
        if num_splits is None:
            num_splits = options.num_splits
        kern = self.kernels(device, options) if device.type == "cuda" else {}
        unit = kern["attn"].plan if kern else registry.plan_decode(
            self.spec, "sm_80", dataclasses.replace(self.op.options, decode=options)
        )
        heads = dims.heads_kv if pack_gqa else dims.heads_q
        live_blocks = None
        g0 = family.geometry(
            unit, batch=dims.batch, heads_q=dims.heads_q, heads_kv=dims.heads_kv,
            seqlen_q=dims.seqlen_q, num_splits=1, pack_gqa=pack_gqa,
        )  # fmt: skip
        if num_splits is None:
            sms = _sm_count(device.index if device.index is not None else 0) if kern else 132
            live_blocks = self._live_blocks(dims, unit.tiles.block_n, params)
            num_splits = family.choose_num_splits(
                unit, batch=dims.batch, heads_kv_ctas=heads, m_blocks=g0.m_blocks,
                max_seqlen_k=dims.capacity, num_sms=sms, live_blocks=live_blocks,
                split_waves=options.split_waves,
            )  # fmt: skip
        geo = family.geometry(
            unit, batch=dims.batch, heads_q=dims.heads_q, heads_kv=dims.heads_kv,
            seqlen_q=dims.seqlen_q, num_splits=num_splits, pack_gqa=pack_gqa,
        )  # fmt: skip
        rows = dims.batch * dims.heads_q * dims.seqlen_q
        o_part = lse_part = counters = None
        if own_workspace and num_splits > 1 and device.type == "cuda":
            o_part, lse_part, counters = _workspace(dims, geo, num_splits, device)
        fixed = {
            "max_pages": dims.max_pages, "num_pages": dims.num_pages, "page_size": dims.page_size,
            "batch": dims.batch, "heads_q": dims.heads_q, "heads_kv": dims.heads_kv,
            "seqlen_q": dims.seqlen_q, "num_splits": num_splits,
            "new_keys": dims.seqlen_q if dims.append else 0, "group": geo.group, "rows": rows,
        }  # fmt: skip
        plan = DecodeCallPlan(
            dims, num_splits, geo, device, kern, fixed, o_part, lse_part, pack_gqa, counters,
            options=options, live_blocks=live_blocks,
        )  # fmt: skip
        if own_workspace and kern and rows > 0:
            plan.fast = _FastPath(self, plan)
        return plan

    def _live_blocks(self, dims: DecodeDims, block_n: int, params: dict | None) -> int | None:
        """:func:`flashgen.families.decode.live_key_blocks`, memoized per op (an unplanned
        call plans on every call)."""
        key = (dims.capacity, dims.seqlen_q, block_n, tuple(sorted((params or {}).items())))
        hit = self._live.get(key, False)
        if hit is False:
            hit = family.live_key_blocks(
                self.spec, capacity=dims.capacity, seqlen_q=dims.seqlen_q, block_n=block_n,
                params=params,
            )  # fmt: skip
            if len(self._live) > 1024:
                self._live.clear()
            self._live[key] = hit
        return hit

    def launch_values(self, plan: DecodeCallPlan, q, kc, vc, lens, table, o, lse, scale,
                      scalars, tensors) -> dict:  # fmt: skip
        """Every argument of the attention kernel (name -> tensor / address / number) for
        this call; ``q`` already 16-byte aligned (``_kernel_aligned``), the workspace from
        the plan or allocated here."""
        dims = plan.dims
        paged = table is not None
        if paged:
            k_sp, k_ss, k_sh = kc.stride(0), kc.stride(1), kc.stride(2)
            v_sp, v_ss, v_sh = vc.stride(0), vc.stride(1), vc.stride(2)
            bt_sb = table.stride(0)
        else:
            k_sp, k_sh, k_ss = kc.stride(0), kc.stride(1), kc.stride(2)
            v_sp, v_sh, v_ss = vc.stride(0), vc.stride(1), vc.stride(2)
            bt_sb = 0
        values = dict(
            plan.fixed, q=q, k_cache=kc, v_cache=vc, o=o, lse=lse, cache_seqlens=lens,
            block_table=table if paged else 0, k_sp=k_sp, k_ss=k_ss, k_sh=k_sh, v_sp=v_sp,
            v_ss=v_ss, v_sh=v_sh, bt_sb=bt_sb, q_sb=q.stride(0), q_sh=q.stride(1),
            q_ss=q.stride(2), softmax_scale=scale,
        )  # fmt: skip
        # plan_decode fixes the capacity; a call passes its own cache's layout
        values["num_pages"] = kc.shape[0] if paged else dims.batch
        values["page_size"] = kc.shape[1] if paged else kc.shape[2]
        values["max_pages"] = table.shape[1] if paged else 1
        for p, val in zip(self.spec.scalar_params, scalars, strict=True):
            values[f"p_{p.name}"] = val
        for p in self.spec.tensor_params:
            values[f"t_{p.name}"] = tensors[p.name].to(PARAM_DTYPE[p.ty]).contiguous()
        if plan.num_splits > 1:
            o_part, lse_part, counters = plan.o_part, plan.lse_part, plan.counters
            if o_part is None:
                o_part, lse_part, counters = _workspace(
                    dims, plan.geometry, plan.num_splits, q.device
                )
            values.update(o_part=o_part, lse_part=lse_part, counters=counters)
        else:
            values.update(o_part=0, lse_part=0, counters=0)
        return values

    def append_values(self, values: dict, k_new, v_new) -> dict:
        """The append kernel's arguments: the attention kernel's ``values`` and the new rows
        (16-byte aligned)."""
        return dict(values, k_new=k_new, v_new=v_new, kn_sb=k_new.stride(0),
                    kn_sh=k_new.stride(1), kn_ss=k_new.stride(2), vn_sb=v_new.stride(0),
                    vn_sh=v_new.stride(1), vn_ss=v_new.stride(2))  # fmt: skip

    def _launch(self, plan: DecodeCallPlan, q, kc, vc, lens, table, k_new, v_new, scale,
                scalars, tensors):  # fmt: skip
        dims = plan.dims
        o, lse = self._outputs(q, dims)
        if _poison_enabled():
            o.fill_(math.nan)
            lse.fill_(math.nan)
        if o.numel() == 0 and not dims.append:
            return o, lse
        kern = plan.kernels
        stream = current_stream_ptr(q.device)
        q = _kernel_aligned(q)
        values = self.launch_values(plan, q, kc, vc, lens, table, o, lse, scale, scalars, tensors)
        if dims.append and k_new.numel() > 0:
            av = self.append_values(values, _kernel_aligned(k_new), _kernel_aligned(v_new))
            kern["append"].launch(plan.geometry.append_grid, av, stream)
        if o.numel() == 0:
            return o, lse
        kern["attn"].launch(plan.geometry.grid, values, stream)
        return o, lse


def _workspace(dims: DecodeDims, geo, num_splits: int, device):
    """The split workspace: fp32 partial o ``[num_splits, rows, Dv]`` and lse ``[num_splits,
    rows]`` (rows = B x Hq x Sq_new), and the zeroed int32 counters of the fused combine, one
    per attention tile (row block x kv head x request)."""
    rows = dims.batch * dims.heads_q * dims.seqlen_q
    o_part = torch.empty((num_splits, rows, dims.head_dim_v), dtype=torch.float32, device=device)
    lse_part = torch.empty((num_splits, rows), dtype=torch.float32, device=device)
    tiles = geo.m_blocks * geo.grid[1] * geo.grid[2]
    counters = torch.zeros((max(tiles, 1),), dtype=torch.int32, device=device)
    return o_part, lse_part, counters


_TENSOR = torch.Tensor
_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None)


def _debug_switches() -> bool:
    """Whether the poison or the value-check switch is on (those calls take the general
    path); the environment is read on every call, cheaply (:func:`flashgen.env.any_set`)."""
    if _validation._POISON:
        return True
    if env.any_set(env.POISON_OUTPUTS, env.VARLEN_CHECK):
        return _poison_enabled() or check_enabled()
    return False


_IS_COMPILING = torch.compiler.is_compiling
_TRACING_STATE = torch._C._get_tracing_state
_TF_MODE = torch._C._is_torch_function_mode_enabled
_DISPATCH_DEPTH = torch._C._len_torch_dispatch_stack
_FUNCTORCH = torch._C._are_functorch_transforms_active


def _eager_cuda(q, kc, vc) -> bool:
    """CUDA inputs in plain eager mode (:func:`_plain_eager_fast`): the planned fast path
    may launch directly instead of through the registered op."""
    return q.is_cuda and _plain_eager_fast(q, kc, vc)


def _plain_eager_fast(q, kc, vc) -> bool:
    """The checks of :func:`flashgen.ops.op._plain_eager` (plain tensors; no compile, trace,
    torch-function / dispatch mode or functorch transform) with the torch queries bound
    once (a dispatch mode is on exactly when the dispatch stack is not empty)."""
    return (
        type(q) is _TENSOR
        and type(kc) is _TENSOR
        and type(vc) is _TENSOR
        and not _IS_COMPILING()
        and _TRACING_STATE() is None
        and not _TF_MODE()
        and _DISPATCH_DEPTH() == 0
        and not _FUNCTORCH()
    )


class _FastPath:
    """The planned call's host path (issue 23: ``with_kvcache(..., plan=p)`` does no host
    planning): the kernels' argument blocks are packed once per call *layout* (shapes,
    strides, dtypes, devices, scale, params, ``out``'s layout: the key below) after the
    full validation, and a call whose layout matches the last one's rewrites only the
    leading pointers (q, caches, outputs, lengths, table: one ``struct.pack_into``),
    allocates o and lse (unless the caller passes ``out``) and enqueues the kernel with
    ``cuLaunchKernel``.  Validation is therefore from metadata only and done once per
    layout; nothing loops over the batch.  Returns None (the caller takes the general
    path) for anything but plain eager CUDA tensors on the plan's device (torch.compile,
    tracing, modes, subclasses go through the registered op), the debug / poison switches,
    0-d tensor scalars, or tensor params that would need a conversion.  Per thread state:
    concurrent threads keep their own blocks.  Everything a call reads is bound once here
    (no per-call module or attribute lookups beyond the tensors')."""

    def __init__(self, dop: DecodeOp, plan: DecodeCallPlan):
        from flashgen.runtime.launch import _function_ptr
        from flashgen.runtime.packed import ArgLayout

        self.dop, self.plan = dop, plan
        self.index = plan.device.index
        attn, app = plan.kernels["attn"], plan.kernels["append"]
        self.attn_layout, self.app_layout = ArgLayout(attn.plan.args), ArgLayout(app.plan.args)
        self.attn_head = self.attn_layout.head(family.CALL_POINTERS)
        self.app_head = self.app_layout.head(family.APPEND_CALL_POINTERS)
        self.attn_pack = self.attn_head.pack_into
        self.app_pack = self.app_head.pack_into
        self.attn_fn, self.app_fn = _function_ptr(attn.function), _function_ptr(app.function)
        self.attn_launch = (*plan.geometry.grid, attn.plan.threads, 1, 1, attn.plan.smem_bytes)
        self.app_launch = (*plan.geometry.append_grid, app.plan.threads, 1, 1, 0)
        d = plan.dims
        self.o_shape = (d.batch, d.heads_q, d.seqlen_q, d.head_dim_v)
        self.lse_shape = (d.batch, d.heads_q, d.seqlen_q)
        self.o_dtype = out_dtype(dop.spec)
        self.tensor_names = [p.name for p in dop.spec.tensor_params]
        self.tensor_dtypes = [PARAM_DTYPE[p.ty] for p in dop.spec.tensor_params]
        self._tls = threading.local()
        self._tls_dict = self._tls.__dict__
        self._empty = torch.empty
        self._f32 = torch.float32
        # resolved once: the driver's entry point and the raw-stream query (module globals
        # that tools/host_overhead.py --cpu replaces before planning)
        self._cu_launch = _tma.driver().cuLaunchKernel
        self._raw_stream = _calls._RAW_STREAM
        self._get_device = _GET_DEVICE
        self._eager = _eager_cuda

    def _state(self):
        st = self._tls_dict.get("st")
        if st is None:
            st = self._tls.st = _FastState(self.attn_layout, self.app_layout)
        return st

    def __call__(self, q, kc, vc, lens, table, k_new, v_new, scale, params, out=None):
        if not self._eager(q, kc, vc) or self._get_device is None:
            return None
        if self._get_device() != self.index or _debug_switches():
            return None
        # the call's layout: everything validation and the packed scalars depend on
        key = (
            q.shape, q.stride(), q.dtype, q.get_device(), kc.shape, kc.stride(), kc.dtype,
            kc.get_device(), vc.shape, vc.stride(), vc.dtype, vc.get_device(), lens.shape,
            lens.dtype, lens.get_device(), scale,
        )  # fmt: skip
        if table is not None:
            key += (table.shape, table.stride(), table.dtype, table.get_device())
        if k_new is not None:
            key += (k_new.shape, k_new.stride(), k_new.dtype, k_new.get_device(),
                    v_new.shape, v_new.stride(), v_new.dtype, v_new.get_device())  # fmt: skip
        if out is not None:
            if type(out) is not tuple or len(out) != 2:
                return None
            o, lse = out
            if type(o) is not _TENSOR or type(lse) is not _TENSOR:
                return None
            key += (o.shape, o.stride(), o.dtype, o.get_device(),
                    lse.shape, lse.stride(), lse.dtype, lse.get_device())  # fmt: skip
        tensors = ()
        if params:
            pk = []
            for n, v in params.items():
                if type(v) is _TENSOR:
                    if v.dim() == 0:
                        return None  # a 0-d scalar: resolve_params reads it each call
                    pk.append((n, v.shape, v.stride(), v.dtype, v.get_device()))
                else:
                    pk.append((n, v))
            key += (tuple(pk),)
            tensors = [params.get(n) for n in self.tensor_names]
        st = self._tls_dict.get("st") or self._state()
        if key != st.key:
            if not self._prepare(st, key, q, kc, vc, lens, table, k_new, v_new, scale, params,
                                 out):  # fmt: skip
                return None
        q_ptr, k_ptr, v_ptr = q.data_ptr(), kc.data_ptr(), vc.data_ptr()
        if (q_ptr | k_ptr | v_ptr) & 15:
            return None  # an unaligned base: the general path copies q or refuses the cache
        if out is None:
            dev = q.device
            o = self._empty(self.o_shape, dtype=self.o_dtype, device=dev)
            lse = self._empty(self.lse_shape, dtype=self._f32, device=dev)
            out = (o, lse)
        o_ptr, lse_ptr = o.data_ptr(), lse.data_ptr()
        if (o_ptr & 7) | (lse_ptr & 3):
            return None  # the kernel stores o 8 bytes at a time
        lens_ptr = lens.data_ptr()
        table_ptr = 0 if table is None else table.data_ptr()
        buf = st.attn_buf
        self.attn_pack(buf, 0, q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, lens_ptr, table_ptr)
        for name, t in zip(self.tensor_names, tensors, strict=False):
            self.attn_layout.field(buf, f"t_{name}", t.data_ptr())
        stream = self._raw_stream(self.index)
        launch = self._cu_launch
        if k_new is not None:
            kn_ptr, vn_ptr = k_new.data_ptr(), v_new.data_ptr()
            if (kn_ptr | vn_ptr) & 15:
                return None
            self.app_pack(st.app_buf, 0, kn_ptr, vn_ptr, k_ptr, v_ptr, lens_ptr, table_ptr)
            rc = launch(self.app_fn, *self.app_launch, stream, st.app_params, None)
            if rc != 0:
                raise RuntimeError(f"cuLaunchKernel(decode append) failed: CUresult {rc}")
        rc = launch(self.attn_fn, *self.attn_launch, stream, st.attn_params, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernel(decode attention) failed: CUresult {rc}")
        return out

    def _prepare(self, st, key, q, kc, vc, lens, table, k_new, v_new, scale, params,
                 out=None) -> bool:  # fmt: skip
        """Full validation of a new layout (raises what the general path raises) and the
        packing of its argument blocks; False when the fast path does not apply."""
        dop, spec, plan = self.dop, self.dop.spec, self.plan
        scalars, tensors = resolve_params(spec, params)
        tmap = {p.name: t for p, t in zip(spec.tensor_params, tensors, strict=True)}
        for p, t in tmap.items():
            if t.dtype != PARAM_DTYPE[spec.param(p).ty] or not t.is_contiguous():
                return False
        scale = check_softmax_scale(default_softmax_scale(spec) if scale is None else scale)
        dims = validate_decode(spec, q, kc, vc, lens, table, k_new, v_new)
        if spec.tensor_params:
            validate_tensor_params(spec, tmap, q.device, dims.symbols())
        dop._check_plan(plan, dims, q.device, 0)
        if out is not None:
            check_out(spec, out, self.o_shape, q.device)
        if k_new is not None and (
            _kernel_aligned(k_new) is not k_new or _kernel_aligned(v_new) is not v_new
        ):
            return False
        if _kernel_aligned(q) is not q:
            return False
        values = dop.launch_values(plan, q, kc, vc, lens, table, q, q, scale, scalars, tmap)
        self.attn_layout.pack(st.attn_buf, values)
        if k_new is not None:
            self.app_layout.pack(st.app_buf, dop.append_values(values, k_new, v_new))
        st.key = key
        return True


class _FastState:
    """One thread's argument blocks of a :class:`_FastPath` and the layout they hold."""

    def __init__(self, attn_layout, app_layout):
        self.key = None
        self.attn_buf, self.attn_params = attn_layout.new_block()
        self.app_buf, self.app_params = app_layout.new_block()


def decode_op(op) -> DecodeOp:
    """The :class:`DecodeOp` of ``op`` (built once, its torch ops registered with it)."""
    d = op.__dict__.get("_decode_op")
    if d is None:
        with _REG_LOCK:
            d = op.__dict__.get("_decode_op")
            if d is None:
                d = DecodeOp(op)
                if d.reason is None:
                    d.register()
                op.__dict__["_decode_op"] = d
    return d
