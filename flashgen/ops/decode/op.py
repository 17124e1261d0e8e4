"""Serving: attention against a KV cache (``op.with_kvcache``, FlashAttention's
``flash_attn_with_kvcache`` and FlashInfer's plan/run, in flashgen's axis order).

Status: the CPU path is tested in CI; the CUDA kernels (:mod:`flashgen.families.decode`,
``templates/sm_80/decode.cu.j2``) are validated on the H200 (tests/gpu/test_decode_gpu.py),
the ragged form's await that run.

Op contract::

    o, lse = op.with_kvcache(q, k_cache, v_cache, cache_seqlens, *, block_table=None,
                             k_new=None, v_new=None, cu_seqlens_q=None, max_seqlen_q=None,
                             num_splits=None, plan=None, softmax_scale=None, out=None,
                             **params)

    q            [B, Hq, Sq_new, D], the spec's dtype, stride(-1) == 1 (BSHD views work)
    k_cache      dense [B, Hkv, S_cache, D], or paged [num_pages, page_size, Hkv, D] with
                 block_table (FlashInfer's [num_pages, Hkv, page_size, D] as a transposed
                 view); v_cache the same with Dv; stride(-1) == 1, on CUDA 16-byte aligned
                 with strides that are multiples of 8 elements
    cache_seqlens int32 [B], contiguous: request b's cache holds cache_seqlens[b] keys
    block_table  int32 [B, max_pages] (paged only), stride(-1) == 1
    k_new, v_new [B, Hkv, Sq_new, D / Dv]: written into the cache at cache_seqlens[b]
                 (in place) and attended: the live keys are cache_seqlens[b] + Sq_new
    o [B, Hq, Sq_new, Dv] (spec dtype), lse [B, Hq, Sq_new] float32 (natural log)

FP8 cache (:mod:`flashgen.ops.decode.fp8`): k_cache / v_cache (and k_new / v_new) of dtype
``torch.float8_e4m3fn`` for an fp16 / bf16 spec, with ``k_descale`` / ``v_descale`` (float32
``[B, Hkv]``, one element or a Python float; default 1.0; the true K is ``k_descale[b, h_kv] *
k_cache``); q in the spec's dtype, or e4m3 with ``q_descale``.  Its own units (the cache dtype
is part of the plan: ``plan_decode(..., cache_dtype=torch.float8_e4m3fn)``) and torch ops
``flashgen::<name>__with_kvcache[_ragged]_kv8[_append]``; padded and ragged alike.

MLA's one latent cache (a ``v_from_k: true`` spec, e.g. specs/mla_decode.yaml: head_dim 576,
head_dim_v 512): ``v_cache`` is None and the values are the first head_dim_v columns of
``k_cache`` (num_heads_kv 1); ``k_new`` alone appends (``v_new`` None); an e4m3 cache's
``k_descale`` scales keys and values (``v_descale`` None).  Its registered ops take no
``v_cache`` / ``v_new``.

Tensor params (a mask or score_mod that reads them, e.g. specs/spec_tree.yaml's ancestor
matrix): their ``seqlen_q`` extent is Sq_new (ragged: the call's ``max_seqlen_q``), their
``seqlen_k`` extent the cache's capacity (:meth:`DecodeDims.symbols`).

Ragged Sq_new (``cu_seqlens_q=``, ``max_seqlen_q=``): q ``[total_q, Hq, D]`` with int32
``cu_seqlens_q`` ``[B + 1]`` (contiguous, as the varlen op); request b's Sq_b =
cu_seqlens_q[b + 1] - cu_seqlens_q[b] queries are its live keys' last (seqlen_q = Sq_b for its
mask); k_new / v_new ``[total_q, Hkv, D]`` append Sq_b rows per request; o ``[total_q, Hq,
Dv]``, lse ``[Hq, total_q]``.  ``max_seqlen_q`` (the grid's rows; None: the plan's, else read
from cu_seqlens_q) bounds every Sq_b; its values are checked as cache_seqlens' are.  The same
API as the padded form: ``plan=`` (``plan_decode(..., total_q=)``), ``out=``, registered ops.

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
``flashgen::<name>__with_kvcache_append`` (declares that it mutates k_cache and v_cache), and
their ragged forms ``__with_kvcache_ragged`` and ``__with_kvcache_ragged_append``, each with
CPU, CUDA and fake kernels (and the ``_kv8`` forms of all four for an e4m3 cache, where the
spec can read one); registered with the op (``flashgen.load``), so ``op.with_kvcache``
traces under ``torch.compile(fullgraph=True)``.

This module holds :class:`DecodeOp` (the user API, the registered ops' impls, the launch);
planning a call is :mod:`flashgen.ops.decode.planning`'s, the planned call and its fast path
:mod:`flashgen.ops.decode.fast`'s, the inputs' checks :mod:`flashgen.ops.decode.inputs`',
the references :mod:`flashgen.ops.decode.reference`'s, an e4m3 cache's descales
:mod:`flashgen.ops.decode.fp8`'s.
"""

from __future__ import annotations

import functools
import math
import re
import threading
from typing import NamedTuple

import torch

from flashgen.families import decode as family
from flashgen.frontend.errors import OpInputError
from flashgen.ops.calls import _kernel_aligned, _plain_eager, current_stream_ptr
from flashgen.ops.decode.fast import DecodeCallPlan, _workspace
from flashgen.ops.decode.fp8 import KvScales, check_scale_values, resolve_scales
from flashgen.ops.decode.inputs import (
    FP8_CACHE,
    DecodeDims,
    _aligned_16,
    check_num_splits,
    check_out,
    check_values,
    cpu_float32,
    gather_cache,
    unchecked_key_mask,
    validate_decode,
    validate_decode_ragged,
)
from flashgen.ops.decode.planning import DecodePlanning
from flashgen.ops.decode.reference import (
    append_reference,
    append_reference_ragged,
    decode_reference,
    decode_reference_ragged,
    merge_attention,
)
from flashgen.ops.sink import SinkRead, fused_sink_values, sink_arg_values, sink_logits
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
    validate_tensor_params,
)

__all__ = [
    "DecodeCallPlan",
    "DecodeDims",
    "DecodeOp",
    "append_reference",
    "append_reference_ragged",
    "check_num_splits",
    "check_out",
    "check_values",
    "decode_op",
    "decode_reference",
    "decode_reference_ragged",
    "gather_cache",
    "merge_attention",
    "unchecked_key_mask",
    "validate_decode",
    "validate_decode_ragged",
]

_REG_LOCK = threading.RLock()


# ----------------------------------------------------------------------------- the op
class _Args(NamedTuple):
    """The schema arguments of one registered decode op call, by name."""

    q: torch.Tensor
    kc: torch.Tensor
    vc: torch.Tensor
    lens: torch.Tensor
    table: torch.Tensor | None
    cu: torch.Tensor | None  # ragged: cu_seqlens_q
    k_new: torch.Tensor | None
    v_new: torch.Tensor | None
    max_seqlen_q: int | None  # ragged
    scale: float
    splits: int
    scalars: list
    tensors: dict
    scales: KvScales | None  # the _kv8 ops: k_descale / v_descale


class DecodeOp(DecodePlanning):
    """The serving entry points of one :class:`~flashgen.ops.op.AttentionOp` (``op.with_kvcache``,
    ``op.plan_decode``); built with the op (:func:`decode_op`).  Its planning
    (:meth:`plan_decode`, :meth:`plan_for`, :meth:`kernels`) comes from
    :class:`~flashgen.ops.decode.planning.DecodePlanning`."""

    def __init__(self, op):
        self.op = op
        self.spec = op.spec
        self.name = f"{op.spec.name}__with_kvcache"
        self.append_name = f"{op.spec.name}__with_kvcache_append"
        self.ragged_name = f"{op.spec.name}__with_kvcache_ragged"
        self.ragged_append_name = f"{op.spec.name}__with_kvcache_ragged_append"
        self.kv8 = family.cache_dtype_reason(op.spec, "fp8_e4m3") is None and FP8_CACHE is not None
        #: MLA's one latent cache (spec ``v_from_k``): its ops take no v_cache / v_new
        self.v_from_k = op.spec.v_from_k
        self._units: dict = {}
        self._live: dict = {}
        self._mla: dict = {}  # planning's MLA unit choice: device targets, the Hopper unit's plan
        self._bounds: dict = {}  # _reads_inside's memo
        self._lock = threading.Lock()
        self._registered = False
        self.reason = family.unsupported_reason(self.spec)
        #: the spec's sink as the calls read it (:class:`~flashgen.ops.sink.SinkRead`: its IR
        #: walked once here, not per call); None without a sink
        self.sink_read = SinkRead(self.spec) if self.spec.sink is not None else None

    def _refuse(self) -> None:
        if self.reason is not None:
            raise OpInputError(f"with_kvcache: {self.reason}")

    # ------------------------------------------------------------------ registration
    def op_name(self, append: bool, ragged: bool = False, kv8: bool = False) -> str:
        """The registered name (without ``flashgen::``) of the padded or ragged, plain or
        appending op, for a cache of the spec's dtype or (``kv8``) an e4m3 one:
        ``<spec>__with_kvcache[_ragged][_kv8][_append]``."""
        base = self.ragged_name if ragged else self.name
        if kv8:
            base += "_kv8"
        return base + "_append" if append else base

    def schema(self, append: bool, ragged: bool = False, kv8: bool = False) -> str:
        """The op's schema: ``append`` declares that it mutates ``k_cache`` / ``v_cache``
        (``Tensor(a!)``); ``ragged`` adds ``cu_seqlens_q`` after ``block_table`` and ``int
        max_seqlen_q`` before ``softmax_scale``; ``kv8`` (an e4m3 cache) adds ``k_descale``
        and ``v_descale`` (float32 ``[B, Hkv]``) before ``softmax_scale``.  A ``v_from_k``
        spec's ops have no ``v_cache`` nor ``v_new`` (the values are k_cache's first
        head_dim_v columns; its ``v_descale`` is ``k_descale``)."""
        spec = self.spec
        kv = (
            "Tensor(a!) k_cache, Tensor(b!) v_cache" if append else "Tensor k_cache, Tensor v_cache"
        )
        if self.v_from_k:
            kv = "Tensor(a!) k_cache" if append else "Tensor k_cache"
        args = ["Tensor q", kv, "Tensor cache_seqlens", "Tensor? block_table"]
        if ragged:
            args.append("Tensor cu_seqlens_q")
        if append:
            args += ["Tensor k_new"] if self.v_from_k else ["Tensor k_new", "Tensor v_new"]
        if ragged:
            args.append("int max_seqlen_q")
        if kv8:
            args += ["Tensor k_descale", "Tensor v_descale"]
        args += ["float softmax_scale", "int num_splits"]
        args += [f"{_SCHEMA_TYPE[p.ty]} {p.name}" for p in spec.scalar_params]
        args += [f"Tensor {p.name}" for p in spec.tensor_params]
        return f"{self.op_name(append, ragged, kv8)}({', '.join(args)}) -> (Tensor, Tensor)"

    def register(self) -> None:
        """Register the torch ops (padded / ragged, with / without append, and the same for
        an e4m3 cache where the spec can read one (:attr:`kv8`); once per process), each with
        CPU, CUDA and fake kernels."""
        if self._registered:
            return
        with _REG_LOCK:
            if self._registered:
                return
            lib = self.op._lib  # the op's own library: a reload removes them
            for kv8 in (False, True) if self.kv8 else (False,):
                for ragged in (False, True):
                    for append in (False, True):
                        name = self.op_name(append, ragged, kv8)
                        form = (append, ragged, kv8)
                        lib.define(self.schema(*form))
                        lib.impl(name, functools.partial(self._impl_cpu, *form), "CPU")
                        lib.impl(name, functools.partial(self._impl_cuda, *form), "CUDA")
                        torch.library.register_fake(
                            f"flashgen::{name}", functools.partial(self._impl_fake, *form),
                            lib=lib,
                        )  # fmt: skip
                        target = getattr(torch.ops.flashgen, name).default
                        names = tuple(a.name for a in target._schema.arguments)
                        lib.impl(name, functools.partial(_refuse_grad_autograd, target, names),
                                 "Autograd", with_keyset=True)  # fmt: skip
            self._registered = True

    def torch_op(self, append: bool, ragged: bool = False, kv8: bool = False):
        """The registered op (``torch.ops.flashgen.<op_name>.default``); ``RuntimeError`` if a
        reload replaced :attr:`op` (that name is the new spec's op then)."""
        self.op._check_live()
        self.register()
        return getattr(torch.ops.flashgen, self.op_name(append, ragged, kv8)).default

    def _unpack(self, append: bool, ragged: bool, kv8: bool, args) -> _Args:
        """Schema arguments (:meth:`schema`) -> :class:`_Args` (``v_from_k``: v_cache and
        v_new as views of k_cache and k_new)."""
        if self.v_from_k:
            q, kc, lens, table = args[:4]
            vc, rest = latent_values(self.spec, kc), list(args[4:])
        else:
            q, kc, vc, lens, table = args[:5]
            rest = list(args[5:])
        cu = rest.pop(0) if ragged else None
        k_new = v_new = None
        if append:
            k_new = rest.pop(0)
            v_new = latent_values(self.spec, k_new) if self.v_from_k else rest.pop(0)
        max_seqlen_q = rest.pop(0) if ragged else None
        scales = None
        if kv8:
            scales = KvScales(rest.pop(0), 1.0, rest.pop(0), 1.0)
        scale, splits, rest = rest[0], rest[1], rest[2:]
        n = len(self.spec.scalar_params)
        scalars = list(rest[:n])
        tensors = {p.name: t for p, t in zip(self.spec.tensor_params, rest[n:], strict=True)}
        return _Args(q, kc, vc, lens, table, cu, k_new, v_new, max_seqlen_q, scale, splits,
                     scalars, tensors, scales)  # fmt: skip

    def _validate(self, a: _Args) -> DecodeDims:
        if a.cu is None:
            return validate_decode(self.spec, a.q, a.kc, a.vc, a.lens, a.table, a.k_new, a.v_new)
        return validate_decode_ragged(self.spec, a.q, a.kc, a.vc, a.lens, a.table, a.k_new,
                                      a.v_new, a.cu, a.max_seqlen_q)  # fmt: skip

    def _outputs(self, q, dims: DecodeDims):
        """Fresh ``(o, lse)`` of the call (:meth:`DecodeDims.out_shapes`) on q's device."""
        o_shape, lse_shape = dims.out_shapes()
        dtype = torch.float32 if cpu_float32(q) else out_dtype(self.spec)
        o = torch.empty(o_shape, dtype=dtype, device=q.device)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        return o, lse

    def _impl_fake(self, append, ragged, kv8, *args):
        a = self._unpack(append, ragged, kv8, args)
        return self._outputs(a.q, self._validate(a))

    def _scales_of_op(self, dims: DecodeDims, q, scales: KvScales | None) -> KvScales | None:
        """The registered op's descale tensors (its ``_kv8`` ops take them), checked against
        the call's cache: the ``_kv8`` ops take an e4m3 cache, the others the spec's dtype."""
        if (dims.cache_dtype is None) != (scales is None):
            want = FP8_CACHE if scales is not None else TORCH_DTYPE[self.spec.dtype]
            raise OpInputError(
                f"k_cache: this torch op ({self.op_name(False, dims.ragged, scales is not None)}"
                f"[_append]) takes a {want} cache, got "
                f"{FP8_CACHE if dims.cache_dtype else TORCH_DTYPE[self.spec.dtype]}"
            )
        if scales is None:
            return None
        return resolve_scales(self.spec, dims, q, scales.k, scales.v, None)[1]

    def _impl_cpu(self, append, ragged, kv8, *args):
        a = self._unpack(append, ragged, kv8, args)
        dims = self._validate(a)
        self._check_params(a.scale, a.scalars, a.tensors, dims, a.q.device)
        scales = self._scales_of_op(dims, a.q, a.scales)
        check_values(dims, a.lens, a.table, a.cu)
        check_scale_values(scales)
        params = dict(zip((p.name for p in self.spec.scalar_params), a.scalars, strict=True))
        params.update({n: t.to(PARAM_DTYPE[self.spec.param(n).ty]) for n, t in a.tensors.items()})
        kd, vd = (None, None) if scales is None else scales.tensors(dims.batch, dims.heads_kv,
                                                                     a.q.device)  # fmt: skip
        def write(kc, vc):
            if ragged:
                append_reference_ragged(kc, vc, a.lens, a.cu, a.k_new, a.v_new, a.table)
            else:
                append_reference(kc, vc, a.lens, a.k_new, a.v_new, a.table)

        def run(kc, vc):
            live = a.lens.to(torch.int64)
            if append:
                write(kc, vc)
                cu = a.cu.to(torch.int64) if ragged else None
                live = live + (cu[1:] - cu[:-1] if ragged else dims.seqlen_q)
            try:
                if ragged:  # each request appends (and attends) its own Sq_b rows
                    return decode_reference_ragged(
                        self.spec, a.q, kc, vc, live, a.cu, a.table, softmax_scale=a.scale,
                        params=params, compute_dtype=torch.float32, k_descale=kd, v_descale=vd,
                    )  # fmt: skip
                return decode_reference(
                    self.spec, a.q, kc, vc, live, a.table, softmax_scale=a.scale,
                    params=params, compute_dtype=torch.float32, k_descale=kd, v_descale=vd,
                )  # fmt: skip
            except IndexError as e:  # a tensor param indexed outside its shape (reference)
                m = re.search(r"tensor param '(\w+)'", str(e))
                raise OpInputError(f"{m.group(1) if m else 'params'}: {e}") from None

        if append and not self._reads_inside(dims, a.scalars):
            # a read may leave its tensor at these sizes (or its index reads a tensor), and
            # only the reference can tell whether a kept pair does: run the call on copies of
            # the caches first, so a refused call writes nothing (issue 38, item 5), then
            # append for real
            ro, rl = run(a.kc.clone(), a.vc.clone())
            write(a.kc, a.vc)
        else:
            ro, rl = run(a.kc, a.vc)
        o, lse = self._outputs(a.q, dims)
        o.copy_(ro)
        lse.copy_(rl)
        return o, lse

    def _impl_cuda(self, append, ragged, kv8, *args):
        a = self._unpack(append, ragged, kv8, args)
        dims = self._validate(a)
        self._check_params(a.scale, a.scalars, a.tensors, dims, a.q.device)
        scales = self._scales_of_op(dims, a.q, a.scales)
        if check_enabled():
            check_values(dims, a.lens, a.table, a.cu)
            check_scale_values(scales)
        params = dict(zip([p.name for p in self.spec.scalar_params], a.scalars, strict=True))
        plan = self.plan_for(dims, a.q.device, a.splits or None, params=params)
        return self._launch(plan, a.q, a.kc, a.vc, a.lens, a.table, a.k_new, a.v_new, a.scale,
                            a.scalars, a.tensors, cu_seqlens_q=a.cu, dims=dims,
                            scales=scales)  # fmt: skip

    def _reads_inside(self, dims: DecodeDims, scalars) -> bool:
        """Whether every tensor-param read of the spec is proven inside its tensor at the
        call's sizes (Sq_new queries, at most the cache's capacity of keys) and scalar
        values (:func:`~flashgen.analysis.indexbounds.all_reads_inside`: none may leave it,
        none is indexed by a tensor's values).  Memoized per sizes and values; True (and
        free) for a spec without tensor params."""
        if not self.spec.tensor_params:
            return True
        values = tuple(v.item() if isinstance(v, torch.Tensor) else v for v in scalars)
        key = (dims.batch, dims.heads_q, dims.heads_kv, dims.seqlen_q, dims.capacity, values)
        hit = self._bounds.get(key)
        if hit is None:
            from flashgen.analysis.indexbounds import all_reads_inside

            sym = {**dims.symbols(), "seqlen_q": dims.seqlen_q, "seqlen_k": dims.capacity}
            named = {p.name: v for p, v in zip(self.spec.scalar_params, values, strict=True)}
            hit = all_reads_inside(self.spec, sym, named)
            if len(self._bounds) >= 1024:
                self._bounds.clear()
            self._bounds[key] = hit
        return hit

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
        max_seqlen_q: int | None = None,
        num_splits=None,
        plan: DecodeCallPlan | None = None,
        softmax_scale: float | None = None,
        out=None,
        k_descale=None,
        v_descale=None,
        q_descale=None,
        apply_sink: bool = True,
        **params,
    ):
        """Attention of ``q`` against a dense or paged KV cache (module doc); returns ``(o,
        lse)``.  ``num_splits``: None (the heuristic, or the plan's), or 1..128 (bitwise
        reproducible results for a fixed value, independent of the other requests).
        ``plan``: from :meth:`plan_decode` for this call's shapes (no host planning; CUDA
        graph capturable); a plan for other shapes raises :class:`OpInputError` naming what
        differs.  ``cu_seqlens_q`` (ragged Sq_new): q ``[total_q, Hq, D]``, int32 ``[B +
        1]`` offsets; ``max_seqlen_q`` its longest Sq_b, at most total_q (None: the plan's,
        capped at total_q, or else read from ``cu_seqlens_q``, a host sync on CUDA, refused
        under ``torch.compile``).  ``out``: ``(o, lse)`` to write instead of new tensors
        (contiguous, the shapes and dtypes above, on q's device; FlashInfer's ``out=``): a
        serving loop that reuses them saves the two allocations per call.  Returns ``out``
        then.  ``k_descale`` / ``v_descale`` / ``q_descale``: an e4m3
        (``torch.float8_e4m3fn``) cache's and q's descales (module doc,
        :mod:`flashgen.ops.decode.fp8`), padded or ragged.

        Aliasing (issue 38): with ``k_new`` / ``v_new``, the caches must not share memory with
        each other (``k_cache is v_cache``) nor with ``k_new`` / ``v_new``, and a cache's
        elements must have their own memory (no expanded, stride-0 cache): refused from
        metadata on every device, on every call (a planned call's fast path compares the
        addresses).  The slot rule: the cache slots the call appends to
        (request b's keys ``[cache_seqlens[b], cache_seqlens[b] + Sq_b)`` through its
        ``block_table`` row) are pairwise distinct and hold no other key the call reads
        (any request's ``[0, cache_seqlens[b'] + Sq_b')``); pages shared read-only (a common
        prefix) are fine.  Checked from values with the other value checks (always on CPU;
        on CUDA under :func:`~flashgen.ops.validation.check_enabled`); a planned call's fast
        path (``plan=``, graph capturable) reads no values: there the slot rule is the
        caller's contract.  Nothing is written
        before every check of the call has passed (on CPU a tensor param indexed outside
        its shape at a kept pair is an :class:`OpInputError` naming it, the cache as it was).

        Raises :class:`OpInputError` for bad inputs, an argument that requires grad (no
        backward: serving only) or a spec decode does not support, ``RuntimeError`` if a
        reload of the edited spec replaced the op (its registered decode ops are the new
        spec's then).

        A ``v_from_k`` spec (MLA, module doc): ``v_cache`` None, ``k_new`` alone appends
        (``v_new`` None), ``v_descale`` None (k_descale scales the values too);
        ``num_heads_kv`` 1.

        A spec's sink joins o's denominator, applied once after the splits merge (lse: the
        keys alone; ``apply_sink=False``: o over the keys alone too, as
        :meth:`AttentionOp.attention <flashgen.ops.prefill.attention.AttentionOp.attention>`):
        by the attention kernel's epilogue where the unit has the fused sink
        (``Options.decode.fused_sink``) and the call launches it directly (plain eager CUDA
        tensors), else by torch ops after the kernels (:func:`flashgen.ops.sink.apply_sink`;
        CPU, ``torch.compile``, modes)."""
        if not isinstance(apply_sink, bool):
            raise OpInputError(f"apply_sink: expected a bool, got {apply_sink!r}")
        join_sink = apply_sink and self.spec.sink is not None
        self.op._check_live()
        res = None
        # a plan's fast path runs the kernels of the op that planned it: only this op's; it
        # takes no call that _kvcache refuses (a tensor that requires grad, an MLA call's
        # v_cache / v_new / v_descale) and returns None for any call it does not take
        fast = getattr(plan, "fast", None) if getattr(plan, "owner", None) is self else None
        if fast is not None and num_splits is None and q_descale is None:
            vc, vn, vd = v_cache, v_new, v_descale
            if self.v_from_k:  # the values: k_cache's / k_new's first columns
                given = vc is not None or vn is not None or vd is not None
                vc = None if given else latent_values(self.spec, k_cache)
                vn, vd = latent_values(self.spec, k_new), k_descale
            if vc is not None:
                res = fast(q, k_cache, vc, cache_seqlens, block_table, k_new, vn, softmax_scale,
                           params, out, cu_seqlens_q, max_seqlen_q, k_descale, vd,
                           join_sink)  # fmt: skip
        if res is not None:
            joined = join_sink and fast.sink
        else:
            res, joined = self._kvcache(q, k_cache, v_cache, cache_seqlens, block_table, k_new,
                                        v_new, cu_seqlens_q, max_seqlen_q, num_splits, plan,
                                        softmax_scale, out, k_descale, v_descale, q_descale,
                                        params, join_sink)  # fmt: skip
        if joined or not join_sink:
            return res
        from flashgen.ops.sink import apply_sink as join
        from flashgen.ops.sink import varlen_rows

        o, lse = res
        batch = cache_seqlens.shape[0]
        heads_kv = k_cache.shape[1 if block_table is None else 2]  # dense or paged cache
        sink = sink_logits(self.spec, params, batch=batch, heads_q=o.shape[1], heads_kv=heads_kv,
                           device=o.device, dtype=lse.dtype, read=self.sink_read)  # fmt: skip
        if cu_seqlens_q is None:
            o.copy_(join(o, lse, sink.unsqueeze(-1)))
        else:
            rows = varlen_rows(sink, cu_seqlens_q, lse.shape[1])
            o.copy_(join(o.transpose(0, 1), lse, rows).transpose(0, 1))
        return o, lse

    def _kvcache(self, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
                 cu_seqlens_q, max_seqlen_q, num_splits, plan, softmax_scale, out, k_descale,
                 v_descale, q_descale, params, join_sink=False):  # fmt: skip
        """:meth:`with_kvcache` but for the planned fast path and the sink's torch epilogue:
        the refusal of inputs that require grad, an MLA call's latent values, then
        :meth:`_with_kvcache`.  ``((o, lse), joined)``, ``joined`` whether the kernel joined
        the sink (``join_sink`` and a fused-sink unit launched directly by
        :meth:`_with_kvcache`'s eager CUDA branch); else o is over the keys alone."""
        if torch.is_grad_enabled():
            _refuse_grad(q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache,
                         **params)  # fmt: skip
        if self.v_from_k:
            v_cache, v_new, v_descale = self._latent_args(k_cache, v_cache, k_new, v_new,
                                                          v_descale, k_descale)  # fmt: skip
        return self._with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
                                  cu_seqlens_q, max_seqlen_q, num_splits, plan, softmax_scale,
                                  params, out, (k_descale, v_descale, q_descale),
                                  join_sink)  # fmt: skip

    def _latent_args(self, k_cache, v_cache, k_new, v_new, v_descale, k_descale):
        """A ``v_from_k`` call's ``(v_cache, v_new, v_descale)``: views of the first
        head_dim_v columns of ``k_cache`` / ``k_new`` and ``k_descale``; the caller's must be
        None (:class:`OpInputError` naming the argument otherwise)."""
        dv = self.spec.head_dim_v
        for name, x in (("v_cache", v_cache), ("v_new", v_new), ("v_descale", v_descale)):
            if x is not None:
                got = f"shape {list(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)
                raise OpInputError(
                    f"{name}: expected None (spec {self.spec.name!r} has v_from_k: true: the "
                    f"values are the first {dv} columns of k_cache"
                    f"{', scaled by k_descale' if name == 'v_descale' else ''}), got {got}"
                )
        return latent_values(self.spec, k_cache), latent_values(self.spec, k_new), k_descale

    def max_seqlen_q_of(self, q, cu_seqlens_q, max_seqlen_q, plan) -> int:
        """A ragged call's ``max_seqlen_q``: the caller's; else a ragged plan's, capped at q's
        rows (no host read); else the longest Sq_b of ``cu_seqlens_q`` (a host read: a sync
        on CUDA; refused under ``torch.compile``, where it would break the graph, and for a
        meta ``cu_seqlens_q``, which has no values: :class:`OpInputError`)."""
        if not isinstance(cu_seqlens_q, torch.Tensor):
            raise OpInputError(
                f"cu_seqlens_q: expected a torch.Tensor [batch + 1] of int32, got "
                f"{type(cu_seqlens_q).__name__}"
            )
        if max_seqlen_q is not None:
            return max_seqlen_q
        if isinstance(plan, DecodeCallPlan) and plan.dims.ragged:
            rows = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 3 else 0
            return min(plan.dims.seqlen_q, rows)
        if torch.compiler.is_compiling():
            raise OpInputError(
                "max_seqlen_q: required with cu_seqlens_q under torch.compile (reading it from "
                "cu_seqlens_q would break the graph); pass max_seqlen_q= or plan="
            )
        if cu_seqlens_q.device.type == "meta":
            raise OpInputError(
                "max_seqlen_q: required with a meta cu_seqlens_q (it has no values to read it "
                "from); pass max_seqlen_q= or plan="
            )
        cu = cu_seqlens_q.detach().to("cpu", torch.int64).reshape(-1)
        longest = max(int((cu[1:] - cu[:-1]).max()), 0) if cu.numel() > 1 else 0
        # at most q's rows: offsets that claim more are wrong, and the value checks name them
        # (cu_seqlens_q's), not a max_seqlen_q the caller never passed
        rows = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 3 else longest
        return min(longest, rows)

    def _with_kvcache(self, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
                      cu_seqlens_q, max_seqlen_q, num_splits, plan, softmax_scale, params,
                      out=None, descales=(None, None, None), join_sink=False):  # fmt: skip
        """The general path of :meth:`with_kvcache` (padded, or ragged with ``cu_seqlens_q``:
        request b's queries are rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`` of q
        ``[total_q, Hq, D]``, the last Sq_b of its live keys; k_new / v_new ``[total_q, Hkv,
        D]`` append each request's own Sq_b rows; ``descales``: ``(k_descale, v_descale,
        q_descale)`` of an e4m3 cache): full validation, then on plain eager CUDA tensors the
        kernels directly, else the registered op (CPU, torch.compile, modes; the ``_kv8`` ones
        for an e4m3 cache).  ``((o, lse), joined)``: ``joined`` when ``join_sink`` and the
        kernels launched directly are a fused-sink unit's, which joined the sink."""
        self._refuse()
        ragged = cu_seqlens_q is not None
        if ragged:
            max_seqlen_q = self.max_seqlen_q_of(q, cu_seqlens_q, max_seqlen_q, plan)
        elif max_seqlen_q is not None:
            raise OpInputError("max_seqlen_q: only with cu_seqlens_q (ragged Sq_new)")
        scalars, tensors = resolve_params(self.spec, params)
        tmap = {p.name: t for p, t in zip(self.spec.tensor_params, tensors, strict=True)}
        if softmax_scale is None:
            softmax_scale = default_softmax_scale(self.spec)
        softmax_scale = check_softmax_scale(softmax_scale)
        splits = check_num_splits(num_splits)
        if ragged:
            dims = validate_decode_ragged(
                self.spec, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
                cu_seqlens_q, max_seqlen_q,
            )  # fmt: skip
        else:
            dims = validate_decode(
                self.spec, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new
            )
        inputs = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k_new": k_new,
                  "v_new": v_new, "cache_seqlens": cache_seqlens, "block_table": block_table,
                  "cu_seqlens_q": cu_seqlens_q, **tmap}  # fmt: skip
        q, scales = resolve_scales(self.spec, dims, q, *descales)
        if self.spec.tensor_params:
            validate_tensor_params(self.spec, tmap, q.device, dims.symbols())
        if plan is not None:
            self._check_plan(plan, dims, q.device, splits, k_cache.dtype)
        if out is not None:
            o_shape, lse_shape = dims.out_shapes()
            check_out(self.spec, out, o_shape, q.device, lse_shape, inputs)
        append = k_new is not None
        sink = None  # the sink arguments of a fused-sink unit that joins it
        if _direct_cuda(q, k_cache, v_cache):
            if check_enabled():
                check_values(dims, cache_seqlens, block_table, cu_seqlens_q)
                check_scale_values(scales)
            if plan is None:
                names = [p.name for p in self.spec.scalar_params]
                plan = self.plan_for(dims, q.device, splits or None,
                                     params=dict(zip(names, scalars, strict=True)))  # fmt: skip
            if join_sink and plan.fused_sink:
                sink = self.sink_values(params, dims, q.device)
            res = self._launch(
                plan, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
                softmax_scale, scalars, tmap, cu_seqlens_q=cu_seqlens_q, dims=dims,
                scales=scales, sink=sink,
            )  # fmt: skip
        else:
            if plan is not None and not splits:
                splits = plan.num_splits
            args = [q, k_cache, cache_seqlens, block_table]
            if not self.v_from_k:
                args.insert(2, v_cache)
            if ragged:
                args.append(cu_seqlens_q)
            if append:
                args += [k_new] if self.v_from_k else [k_new, v_new]
            if ragged:
                args.append(max_seqlen_q)
            if scales is not None:
                if q.device.type == "cpu" and not torch.compiler.is_compiling():
                    check_scale_values(scales)  # before the factors multiply in (names them)
                args += list(scales.tensors(dims.batch, dims.heads_kv, q.device))
            args += [softmax_scale, splits, *scalars, *tensors]
            res = self.torch_op(append, ragged, scales is not None)(*args)
        if out is None:
            return res, sink is not None
        out[0].copy_(res[0])
        out[1].copy_(res[1])
        return out, sink is not None

    # ------------------------------------------------------------------ CUDA
    def sink_values(self, params: dict, dims: DecodeDims, device) -> dict:
        """A fused-sink unit's sink arguments for a call's ``params``
        (:func:`~flashgen.ops.sink.fused_sink_values`: a float32 ``sinks[h]`` param itself,
        with its strides; else the logits computed for the call)."""
        return fused_sink_values(self.sink_read, params, batch=dims.batch, heads_q=dims.heads_q,
                                 heads_kv=dims.heads_kv, device=device)  # fmt: skip

    def launch_values(self, plan: DecodeCallPlan, q, kc, vc, lens, table, o, lse, scale,
                      scalars, tensors, scales: KvScales | None = None,
                      call: DecodeDims | None = None, sink=None) -> dict:  # fmt: skip
        """Every argument of the attention kernel (name -> tensor / address / number) for
        this call; ``q`` already 16-byte aligned (``_kernel_aligned``), the workspace from
        the plan or allocated here; ``scales``: an e4m3 cache's descales (None: 1.0);
        ``call``: the call's validated sizes (None: the plan's), whose ``max_seqlen_q`` a
        ragged unit's ``params_seqlen_q`` (the tensor params' extent) takes; ``sink``: a
        fused-sink unit's (:attr:`DecodeCallPlan.fused_sink`) sink arguments
        (:meth:`sink_values`), or float32 ``[B, Hq]`` logits (None: null, the keys
        alone)."""
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
        if dims.ragged:  # q [total_q, Hq, D]: the token stride is q_ss, request b starts at
            values.update(q_sb=0, q_sh=q.stride(1), q_ss=q.stride(0))  # cu_seqlens_q[b]
        if dims.cache_dtype is not None:
            values.update((scales or KvScales()).launch_values())
        if plan.fused_sink:
            values.update(sink if type(sink) is dict else sink_arg_values(sink))
        for p, val in zip(self.spec.scalar_params, scalars, strict=True):
            values[f"p_{p.name}"] = val
        for p in self.spec.tensor_params:
            values[f"t_{p.name}"] = tensors[p.name].to(PARAM_DTYPE[p.ty]).contiguous()
        if dims.ragged and family.params_seqlen_q(self.spec):
            values["params_seqlen_q"] = (call or dims).seqlen_q
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
        (16-byte aligned; ragged ``[total_q, Hkv, D]``: the token stride as ``kn_ss``)."""
        if k_new.dim() == 3:
            return dict(values, k_new=k_new, v_new=v_new, kn_sb=0, kn_sh=k_new.stride(1),
                        kn_ss=k_new.stride(0), vn_sb=0, vn_sh=v_new.stride(1),
                        vn_ss=v_new.stride(0))  # fmt: skip
        return dict(values, k_new=k_new, v_new=v_new, kn_sb=k_new.stride(0),
                    kn_sh=k_new.stride(1), kn_ss=k_new.stride(2), vn_sb=v_new.stride(0),
                    vn_sh=v_new.stride(1), vn_ss=v_new.stride(2))  # fmt: skip

    def _launch(self, plan: DecodeCallPlan, q, kc, vc, lens, table, k_new, v_new, scale,
                scalars, tensors, cu_seqlens_q=None, dims: DecodeDims | None = None,
                scales: KvScales | None = None, sink=None):  # fmt: skip
        """Enqueue the append (with k_new) and attention kernels of ``plan`` for this call
        (``dims``: the call's sizes, None: the plan's; a ragged call's q may have fewer rows
        than its plan's ``total_q``; ``scales``: an e4m3 cache's descales; ``sink``: the
        sink arguments of a fused-sink unit that joins it (:meth:`launch_values`), None: the
        keys alone); returns fresh ``(o, lse)``."""
        call = dims or plan.dims
        o, lse = self._outputs(q, call)
        dims = plan.dims
        if _poison_enabled():
            o.fill_(math.nan)
            lse.fill_(math.nan)
        if o.numel() == 0 and not dims.append:
            return o, lse
        kern = plan.kernels
        stream = current_stream_ptr(q.device)
        q = _aligned_any(q)
        values = self.launch_values(plan, q, kc, vc, lens, table, o, lse, scale, scalars, tensors,
                                    scales, call, sink)  # fmt: skip
        if cu_seqlens_q is not None:
            values["cu_seqlens_q"] = cu_seqlens_q
        if dims.append and k_new.numel() > 0:
            av = self.append_values(values, _aligned_any(k_new), _aligned_any(v_new))
            kern["append"].launch(plan.geometry.append_grid, av, stream)
        if o.numel() == 0:
            return o, lse
        kern["attn"].launch(plan.geometry.grid, values, stream)
        return o, lse


def _direct_cuda(q, k_cache, v_cache) -> bool:
    """Plain eager CUDA inputs (:func:`~flashgen.ops.calls._plain_eager`): an unplanned call
    launches the kernels directly, else it runs the registered op.  Looked up per call (a
    module global that ``tools/host_overhead.py --decode --cpu`` replaces to time that
    branch on CPU tensors)."""
    return q.is_cuda and _plain_eager(q, k_cache, v_cache)


def _refuse_grad(**tensors) -> None:
    """:class:`OpInputError` naming the first argument that requires grad: ``with_kvcache``
    has no backward (serving), and a result that looked differentiable would leave
    ``q.grad`` None after ``backward()`` (issue 38, item 4)."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise OpInputError(
                f"{name}: expected a tensor that does not require grad (with_kvcache has no "
                f"backward: it serves inference), got one with requires_grad=True; detach it "
                f"or call under torch.no_grad() / torch.inference_mode()"
            )


def _refuse_grad_autograd(op, names: tuple, keyset, *args):
    """The Autograd kernel of the registered decode op ``op`` (no backward: serving; ``names``:
    its schema's argument names): with grad enabled, an argument that requires grad is
    refused at the call, naming it (:func:`_refuse_grad`), before anything runs or is
    written; torch's fallback would give a result that looks differentiable and a
    ``q.grad`` of None after ``backward()``.  Else the call goes on below autograd."""
    if torch.is_grad_enabled():
        _refuse_grad(**dict(zip(names, args, strict=False)))
    with torch._C._AutoDispatchBelowAutograd():
        return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)


def latent_values(spec, t):
    """The values of a ``v_from_k`` spec: the first ``head_dim_v`` columns of a 4-D or 3-D
    ``t`` (k_cache, k_new) as a view; ``t`` itself when it is not such a tensor (None, a
    wrong rank or width: the validation names ``k_cache`` / ``k_new`` then)."""
    ok = isinstance(t, torch.Tensor) and t.dim() in (3, 4) and t.shape[-1] >= spec.head_dim_v
    return t[..., : spec.head_dim_v] if ok else t


def _aligned_any(t):
    """``t`` when the kernels' 16-byte copies can address it (4-D 2-byte: ``_kernel_aligned``;
    the ragged 3-D q / k_new / v_new and e4m3 k_new / v_new: the same rule on their dims and
    bytes), else a contiguous copy."""
    if t.dim() == 4 and t.element_size() == 2:
        return _kernel_aligned(t)
    return t if _aligned_16(t) else t.clone(memory_format=torch.contiguous_format)


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
