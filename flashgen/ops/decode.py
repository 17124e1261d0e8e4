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

import functools
import math
import numbers
import threading
from dataclasses import dataclass

import torch

from flashgen.families import decode as family
from flashgen.families import registry
from flashgen.frontend import ir
from flashgen.frontend.errors import OpInputError
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
        plan = self.plan_for(dims, q.device, splits or None)
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
        **params,
    ):
        """Attention of ``q`` against a dense or paged KV cache (module doc); returns ``(o,
        lse)``.  ``num_splits``: None (the heuristic, or the plan's), or 1..128 (bitwise
        reproducible results for a fixed value, independent of the other requests).
        ``plan``: from :meth:`plan_decode` for this call's shapes (no host planning; CUDA
        graph capturable).  ``cu_seqlens_q`` (ragged Sq_new) is not supported yet.
        Raises :class:`OpInputError` for bad inputs or a spec decode does not support."""
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
                plan = self.plan_for(dims, q.device, splits or None)
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
        pack_gqa: bool | None = None,
    ) -> DecodeCallPlan:
        """Plan calls of one shape (FlashInfer's plan/run): ``batch`` requests, ``num_heads`` /
        ``num_heads_kv`` heads, ``seqlen_q`` new queries, ``cache_capacity`` keys per request
        (dense: S_cache; paged: max_pages * page_size, with ``page_size`` and ``num_pages`` the
        paged cache's), ``append``: calls pass k_new/v_new.  ``num_splits`` None: the heuristic for
        this capacity on ``device``'s SM count (or the op's
        ``Options.decode.num_splits``).  ``pack_gqa`` False: one query head per CTA (for
        measurements); None: the op's ``Options.decode.pack_gqa``.  Builds and loads the kernels and
        allocates the workspace on ``device`` (CUDA), so planned calls do no host planning and can
        be captured in a CUDA graph.  Raises :class:`OpInputError` for bad sizes."""
        self._refuse()
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
        if pack_gqa is None:
            pack_gqa = self.op.options.decode.pack_gqa
        return self.plan_for(dims, device, splits or None, pack_gqa=pack_gqa, own_workspace=True)

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
    def kernels(self, device: torch.device) -> dict:
        """The unit's loaded kernels on CUDA ``device`` (``attn``, ``combine``, ``append``),
        built through the cache on first use."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        hit = self._units.get(index)
        if hit is not None:
            return hit
        with self._lock:
            hit = self._units.get(index)
            if hit is None:
                from flashgen.build import cache
                from flashgen.build.render import render
                from flashgen.runtime import launch as runtime

                target = target_for_device(self.spec, torch.device("cuda", index))
                p = registry.plan_decode(self.spec, target, self.op.options)
                cubin, _report = cache.get_or_build(render(p), p)
                hit = {
                    r: runtime.load(cubin, p.kernel(r), index)
                    for r in ("attn", "combine", "append")
                }
                self._units[index] = hit
        return hit

    def plan_for(
        self, dims: DecodeDims, device, num_splits: int | None, *, pack_gqa: bool | None = None,
        own_workspace: bool = False,
    ) -> DecodeCallPlan:  # fmt: skip
        """A :class:`DecodeCallPlan` for ``dims`` on ``device`` (see :meth:`plan_decode`);
        ``num_splits`` / ``pack_gqa`` None: the op's ``Options.decode`` values (the split
        heuristic where those leave it open)."""
        if pack_gqa is None:
            pack_gqa = self.op.options.decode.pack_gqa
        kern = self.kernels(device) if device.type == "cuda" else {}
        unit = kern["attn"].plan if kern else registry.plan_decode(
            self.spec, "sm_80", self.op.options
        )
        if num_splits is None:  # the op's options may fix it (Options.decode.num_splits)
            num_splits = self.op.options.decode.num_splits
        heads = dims.heads_kv if pack_gqa else dims.heads_q
        g0 = family.geometry(
            unit, batch=dims.batch, heads_q=dims.heads_q, heads_kv=dims.heads_kv,
            seqlen_q=dims.seqlen_q, num_splits=1, pack_gqa=pack_gqa,
        )  # fmt: skip
        if num_splits is None:
            sms = _sm_count(device.index if device.index is not None else 0) if kern else 132
            num_splits = family.choose_num_splits(
                unit, batch=dims.batch, heads_kv_ctas=heads, m_blocks=g0.m_blocks,
                max_seqlen_k=dims.capacity, num_sms=sms,
            )  # fmt: skip
        geo = family.geometry(
            unit, batch=dims.batch, heads_q=dims.heads_q, heads_kv=dims.heads_kv,
            seqlen_q=dims.seqlen_q, num_splits=num_splits, pack_gqa=pack_gqa,
        )  # fmt: skip
        rows = dims.batch * dims.heads_q * dims.seqlen_q
        o_part = lse_part = None
        if own_workspace and num_splits > 1 and device.type == "cuda":
            o_part = torch.empty(
                (num_splits, rows, dims.head_dim_v), dtype=torch.float32, device=device
            )
            lse_part = torch.empty((num_splits, rows), dtype=torch.float32, device=device)
        fixed = {
            "max_pages": dims.max_pages, "num_pages": dims.num_pages, "page_size": dims.page_size,
            "batch": dims.batch, "heads_q": dims.heads_q, "heads_kv": dims.heads_kv,
            "seqlen_q": dims.seqlen_q, "num_splits": num_splits,
            "new_keys": dims.seqlen_q if dims.append else 0, "group": geo.group, "rows": rows,
        }  # fmt: skip
        return DecodeCallPlan(
            dims, num_splits, geo, device, kern, fixed, o_part, lse_part, pack_gqa
        )

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
        paged = table is not None
        if paged:
            k_sp, k_ss, k_sh = kc.stride(0), kc.stride(1), kc.stride(2)
            v_sp, v_ss, v_sh = vc.stride(0), vc.stride(1), vc.stride(2)
            bt_sb = table.stride(0)
        else:
            k_sp, k_sh, k_ss = kc.stride(0), kc.stride(1), kc.stride(2)
            v_sp, v_sh, v_ss = vc.stride(0), vc.stride(1), vc.stride(2)
            bt_sb = 0
        fx = plan.fixed
        values = dict(
            fx, q=q, k_cache=kc, v_cache=vc, o=o, lse=lse, cache_seqlens=lens,
            block_table=table if paged else 0, k_sp=k_sp, k_ss=k_ss, k_sh=k_sh, v_sp=v_sp,
            v_ss=v_ss, v_sh=v_sh, bt_sb=bt_sb, q_sb=q.stride(0), q_sh=q.stride(1),
            q_ss=q.stride(2), softmax_scale=scale,
        )  # fmt: skip
        # plan_decode fixes the capacity; a call passes its own cache's layout
        values["num_pages"] = kc.shape[0] if paged else dims.batch
        values["page_size"] = kc.shape[1] if paged else kc.shape[2]
        values["max_pages"] = table.shape[1] if paged else 1
        if dims.append and k_new.numel() > 0:
            k_new, v_new = _kernel_aligned(k_new), _kernel_aligned(v_new)
            av = dict(values, k_new=k_new, v_new=v_new, kn_sb=k_new.stride(0),
                      kn_sh=k_new.stride(1), kn_ss=k_new.stride(2), vn_sb=v_new.stride(0),
                      vn_sh=v_new.stride(1), vn_ss=v_new.stride(2))  # fmt: skip
            kern["append"].launch(plan.geometry.append_grid, av, stream)
        if o.numel() == 0:
            return o, lse
        for p, val in zip(self.spec.scalar_params, scalars, strict=True):
            values[f"p_{p.name}"] = val
        for p in self.spec.tensor_params:
            values[f"t_{p.name}"] = tensors[p.name].to(PARAM_DTYPE[p.ty]).contiguous()
        splits = plan.num_splits
        if splits > 1:
            rows = fx["rows"]
            o_part, lse_part = plan.o_part, plan.lse_part
            if o_part is None:
                o_part = torch.empty(
                    (splits, rows, dims.head_dim_v), dtype=torch.float32, device=q.device
                )
                lse_part = torch.empty((splits, rows), dtype=torch.float32, device=q.device)
            values["o_part"], values["lse_part"] = o_part, lse_part
        else:
            values["o_part"] = values["lse_part"] = 0
        kern["attn"].launch(plan.geometry.grid, values, stream)
        if splits > 1:
            kern["combine"].launch(plan.geometry.combine_grid, values, stream)
        return o, lse


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
