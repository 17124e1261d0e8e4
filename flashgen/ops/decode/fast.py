"""The planned decode call (:mod:`flashgen.ops.decode.op`): :class:`DecodeCallPlan`, its split
workspace and its fast host path (:class:`_FastPath`: argument blocks packed once per call
layout, the eager and debug-switch checks, the direct ``cuLaunchKernel``).

Moved out of :mod:`flashgen.ops.decode.op` unchanged; that module re-exports the public names."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import torch

from flashgen import env
from flashgen.families import decode as family
from flashgen.frontend import ir
from flashgen.ops import calls as _calls
from flashgen.ops import validation as _validation
from flashgen.ops.calls import _kernel_aligned
from flashgen.ops.decode.fp8 import resolve_scales
from flashgen.ops.decode.inputs import (
    DecodeDims,
    _aligned_16,
    check_out,
    validate_decode,
    validate_decode_ragged,
)
from flashgen.ops.validation import (
    PARAM_DTYPE,
    TORCH_DTYPE,
    _poison_enabled,
    check_enabled,
    check_softmax_scale,
    default_softmax_scale,
    out_dtype,
    resolve_params,
    validate_tensor_params,
)
from flashgen.runtime import tma as _tma  # ctypes only, no CuPy


class PlanOwner(Protocol):
    """What a planned call uses of the op that planned it (a
    :class:`~flashgen.ops.decode.op.DecodeOp`): its spec, the ragged ``max_seqlen_q`` rule, the
    check of a plan against a call and the launch values.  A protocol, so that this module
    names no module above it (:mod:`.op` imports :mod:`.planning`, which imports this one)."""

    spec: ir.Spec

    def max_seqlen_q_of(self, q, cu_seqlens_q, max_seqlen_q, plan) -> int: ...

    def _check_plan(self, plan, dims: DecodeDims, device, splits: int,
                    k_cache_dtype: torch.dtype | None = None) -> None: ...  # fmt: skip

    def launch_values(self, plan: DecodeCallPlan, q, kc, vc, lens, table, o, lse, scale,
                      scalars, tensors, scales=None, call: DecodeDims | None = None,
                      sink=None) -> dict: ...  # fmt: skip

    def sink_values(self, params: dict, dims: DecodeDims, device) -> dict: ...

    def append_values(self, values: dict, k_new, v_new) -> dict: ...


# ----------------------------------------------------------------------------- plans
@dataclass
class DecodeCallPlan:
    """What :meth:`DecodeOp.plan_decode` precomputes for calls of one shape (FlashInfer's
    plan): the sizes it fixes (batch, heads, Sq_new, cache layout and capacity, append or
    not; a ragged plan, ``dims.total_q`` set: max_seqlen_q and the most q rows), the split
    count, the grids, the kernels, the workspace and the launch values that do not change
    between calls.  Cache lengths, block-table contents, ``cu_seqlens_q`` and the cache
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
    #: the unit's and the schedule's knobs (:class:`flashgen.families.decode.Options`; a
    #: ``v_from_k`` spec's ``mla_unit`` the unit this plan runs, ``"auto"`` resolved)
    options: family.Options = family.Options()
    #: key blocks the mask keeps at the planned capacity (:func:`~flashgen.families.decode.
    #: live_key_blocks`; a sliding window's), None: the capacity's; sized the splits
    live_blocks: int | None = None
    #: the :class:`~flashgen.ops.decode.op.DecodeOp` that planned it: another op's calls refuse
    #: the plan (its kernels, sizes and params are this op's)
    owner: object = None
    #: a ``v_from_k`` spec's decode unit for this shape, ``"wgmma"`` (the Hopper unit) or
    #: ``"mma_sync"`` (:func:`flashgen.families.decode.mla_unit_for_call`: ``Options.decode.
    #: mla_unit``'s ``"auto"`` picks it at plan time); None for any other spec
    mla_unit: str | None = None

    @property
    def fused_sink(self) -> bool:
        """Whether the plan's attention kernel joins the spec's sink (``Options.decode.
        fused_sink`` on a spec with a sink): its calls pass the sink logits (or null for the
        keys alone) instead of applying the sink after it."""
        attn = self.kernels.get("attn")
        return attn is not None and attn.plan.fused_sink


def _workspace(dims: DecodeDims, geo, num_splits: int, device):
    """The split workspace: fp32 partial o ``[num_splits, rows, Dv]`` and lse ``[num_splits,
    rows]`` (rows = B x Hq x Sq_new; ragged: total_q x Hq), and the zeroed int32 counters of
    the fused combine, one per attention tile (row block x kv head x request)."""
    rows = dims.heads_q * (dims.total_q if dims.ragged else dims.batch * dims.seqlen_q)
    o_part = torch.empty((num_splits, rows, dims.head_dim_v), dtype=torch.float32, device=device)
    lse_part = torch.empty((num_splits, rows), dtype=torch.float32, device=device)
    tiles = geo.m_blocks * geo.grid[1] * geo.grid[2]
    counters = torch.zeros((max(tiles, 1),), dtype=torch.int32, device=device)
    return o_part, lse_part, counters


_TENSOR = torch.Tensor
_F32 = torch.float32
_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None)
_GRAD_ENABLED = torch.is_grad_enabled


_DEBUG_SET = env.any_set_test(env.POISON_OUTPUTS, env.VARLEN_CHECK)


def _debug_switches() -> bool:
    """Whether the poison or the value-check switch is on (those calls take the general
    path); the environment is read on every call, cheaply (:func:`flashgen.env.any_set_test`:
    whether either variable is set, then its value)."""
    if _validation._POISON:
        return True
    if _DEBUG_SET():
        return _poison_enabled() or check_enabled()
    return False


def _strided_allocator(device: torch.device):
    """``alloc(size, stride, dtype)``: an uninitialized tensor on ``device`` (CUDA: the
    current device, which the fast path checked is the plan's).  Inductor's
    ``_empty_strided_cuda`` / ``_empty_strided_cpu`` (``torch._C._dynamo.guards``, what its
    generated code allocates buffers with: the device's allocator, without the dispatcher
    and the argument parsing of ``torch.empty``) where this torch build has it, else
    ``torch.empty_strided``."""
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    alloc = getattr(guards, f"_empty_strided_{device.type}", None)
    if alloc is not None:
        return alloc
    return lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype,
                                                           device=device)  # fmt: skip


def _contiguous_strides(shape: tuple) -> tuple:
    """The strides ``torch.empty(shape)`` gives (a meta tensor's: no memory)."""
    return torch.empty(shape, device="meta").stride()


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
    return (type(q) is _TENSOR and type(kc) is _TENSOR and type(vc) is _TENSOR
            and _plain_eager_state())  # fmt: skip


def _plain_eager_state() -> bool:
    """The global part of :func:`_plain_eager_fast` (no compile, trace, torch-function /
    dispatch mode or functorch transform): what a call whose tensors pass the layout's
    guard (their exact types included) still asks."""
    return (
        not _IS_COMPILING()
        and _TRACING_STATE() is None
        and not _TF_MODE()
        and _DISPATCH_DEPTH() == 0
        and not _FUNCTORCH()
    )


#: the form's mark of an argument passed as a tensor (its metadata: the guard's)
_A_TENSOR = object()
_TENSOR_GUARDS = getattr(getattr(getattr(torch._C, "_dynamo", None), "guards", None),
                         "TensorGuards", None)  # fmt: skip


def _never(*tensors) -> bool:
    return False


def _metadata_guard(tensors: tuple):
    """``check(*tensors)``: whether tensors in the same positions have the Python type,
    dispatch keys (device type, negative / conjugate views, the thread's dispatch state),
    dtype, device index, requires_grad, shape and strides of ``tensors`` (Dynamo's
    ``TensorGuards``, one C call; it fails a tensor passed twice).  :func:`_never` where
    this torch build has no ``TensorGuards``, ``tensors`` repeats one or holds a tensor that
    requires grad (the guard then passes none that does) or one that is not a tensor."""
    if _TENSOR_GUARDS is None or len({id(t) for t in tensors}) != len(tensors):
        return _never
    try:
        if any(t.requires_grad for t in tensors):
            return _never
        guard = _TENSOR_GUARDS(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    except (AttributeError, TypeError):
        return _never
    return guard.check


class _FastPath:
    """The planned call's host path (issue 23: ``with_kvcache(..., plan=p)`` does no host
    planning): the kernels' argument blocks are packed once per call *layout* (shapes,
    strides, dtypes, devices, scale, params, ``out``'s layout: :meth:`_layout_key`) after the
    full validation, and a call whose layout matches the last one's rewrites only the
    leading pointers (q, caches, outputs, lengths, table: one ``struct.pack_into``),
    allocates o and lse (unless the caller passes ``out``) and enqueues the kernel with
    ``cuLaunchKernel``.  Validation is therefore from metadata only and done once per
    layout; nothing loops over the batch.  Returns None (the caller takes the general
    path) for anything but plain eager CUDA tensors on the plan's device (torch.compile,
    tracing, modes, subclasses go through the registered op), the debug / poison switches,
    an argument that is not a tensor where one is expected, a tensor that requires grad
    (q, the caches, k_new, v_new, tensor params while grad mode is on; ``out`` always: the
    general path refuses each), 0-d tensor scalars, tensor params that would need a
    conversion, or a call of the other form (padded / ragged) than the plan's.  A ragged
    plan's calls pass ``cu_seqlens_q`` (packed per call; q's rows, hence o's and lse's
    shapes, are part of the layout) and ``max_seqlen_q`` None (the plan's) or at most the
    plan's.  Per thread state: concurrent threads keep their own blocks.

    Checked on every call: the conditions above, the layout, the addresses' alignment, and
    memory apart between the caches, k_new / v_new and ``out`` from the addresses
    (:meth:`_apart`: a few comparisons; the layout fixes the extents).  The layout check is
    one tuple of the call's scalars and form (which arguments are given, ``k_cache is
    v_cache``, the params' names and values) compared with the last layout's, and that
    layout's guard of the tensors' metadata (:func:`_metadata_guard`: one C call); a call
    either does not pass takes the long way (:meth:`_revalidate`: the layout key, then, for
    a new layout, the full validation).  Cached per layout (:class:`_FastState`): the
    validated sizes, the packed scalars and strides, o's and lse's shapes and strides, the
    extents and pairs of the memory check, the guard.  Bound once here: everything a call
    reads besides the tensors (the driver's entry point without argument conversion:
    :func:`~flashgen.runtime.packed.raw_launcher`, the kernels' handles, the raw-stream and
    current-device queries, the field writers, the allocator: :func:`_strided_allocator`);
    per thread, the last stream's handle.  The caller's contract (it would
    read values: not checked per call, so that a call stays capturable and cheap): the
    slot rule of an append (see ``DecodeOp.with_kvcache``).

    A fused-sink plan (:attr:`DecodeCallPlan.fused_sink`) with ``join_sink``: the kernel
    joins the sink, whose strides the layout fixes; its address per call is the sink's
    tensor param's own when it is read as is (``sinks[h]`` of a float32 tensor on the
    device: :func:`~flashgen.ops.sink.fused_sink_values` passes the param itself), else the
    logits computed for the call.  Without ``join_sink``: null (the keys alone)."""

    def __init__(self, dop: PlanOwner, plan: DecodeCallPlan):
        from flashgen.runtime.launch import _function_ptr
        from flashgen.runtime.packed import ArgLayout, raw_launcher

        self.dop, self.plan = dop, plan
        self.index = plan.device.index
        attn, app = plan.kernels["attn"], plan.kernels["append"]
        self.attn_layout, self.app_layout = ArgLayout(attn.plan.args), ArgLayout(app.plan.args)
        #: an e4m3-cache plan: k_descale / v_descale are per-call pointers too
        self.kv8 = attn.plan.kv8
        self.attn_head = self.attn_layout.head(
            family.CALL_POINTERS_KV8 if self.kv8 else family.CALL_POINTERS
        )
        self.app_head = self.app_layout.head(family.APPEND_CALL_POINTERS)
        self.attn_pack = self.attn_head.pack_into
        self.app_pack = self.app_head.pack_into
        #: a fused-sink unit: the sink logits' address is a per-call argument too
        self.sink = attn.plan.fused_sink
        # the driver's entry point without per-argument conversion (raw_launcher), resolved
        # once (a module global that tools/host_overhead.py --cpu replaces before planning)
        self._cu_launch, self._handle = raw_launcher(_tma.driver().cuLaunchKernel)
        self.attn_fn = self._handle(_function_ptr(attn.function))
        self.app_fn = self._handle(_function_ptr(app.function))
        self.attn_launch = (*plan.geometry.grid, attn.plan.threads, 1, 1, attn.plan.smem_bytes)
        self.app_launch = (*plan.geometry.append_grid, app.plan.threads, 1, 1, 0)
        d = plan.dims
        self.ragged = d.ragged
        self.v_from_k = dop.spec.v_from_k
        # a padded plan's outputs (a ragged plan's follow q's rows: the layout's, in _prepare)
        self.o_shape = (d.batch, d.heads_q, d.seqlen_q, d.head_dim_v)
        self.lse_shape = (d.batch, d.heads_q, d.seqlen_q)
        self.o_dtype = out_dtype(dop.spec)
        self.device = plan.device  # a matching layout's (_prepare checked q's against it)
        self.tensor_names = tuple(p.name for p in dop.spec.tensor_params)
        self._tls = threading.local()
        self._tls_dict = self._tls.__dict__
        self._alloc = _strided_allocator(plan.device)
        # resolved once: the raw-stream query (as the driver above)
        self._raw_stream = _calls._RAW_STREAM
        self._get_device = _GET_DEVICE
        self._eager = _eager_cuda

    def _state(self):
        st = self._tls_dict.get("st")
        if st is None:
            st = self._tls.st = _FastState(self.attn_layout, self.app_layout, self.tensor_names)
        return st

    def __call__(self, q, kc, vc, lens, table, k_new, v_new, scale, params, out=None, cu=None,
                 max_seqlen_q=None, k_descale=None, v_descale=None,
                 join_sink=False):  # fmt: skip
        if (cu is None) is self.ragged or self._get_device is None or not _plain_eager_state():
            return None
        if self._get_device() != self.index or _debug_switches():
            return None
        # the layout check (class doc): the call's scalars and form, compared as one tuple,
        # and every tensor's metadata, checked by the last layout's guard in one C call
        if out is None:
            o = lse = None
        elif type(out) is tuple and len(out) == 2:
            o, lse = out
        else:
            return None  # the general path names the argument
        form = (scale, max_seqlen_q, table is None, k_new is None, o is None, vc is kc)
        ts = (q, kc, lens) if vc is kc else (q, kc, vc, lens)  # a guard takes no repeats
        if table is not None:
            ts += (table,)
        if k_new is not None:
            ts += (k_new, v_new)
        if cu is not None:
            ts += (cu,)
        if o is not None:
            ts += out
        if params or self.kv8 or k_descale is not None or v_descale is not None:
            more = self._call_extras(params, k_descale, v_descale)
            if more is None:
                return None
            ts += more[0]
            form += more[1]
        st = self._tls_dict.get("st") or self._state()
        if form != st.form or not st.guard(*ts):
            if not self._revalidate(st, form, ts, q, kc, vc, lens, table, k_new, v_new, scale,
                                    params, out, cu, max_seqlen_q, k_descale,
                                    v_descale):  # fmt: skip
                return None
        q_ptr, k_ptr, v_ptr = q.data_ptr(), kc.data_ptr(), vc.data_ptr()
        if (q_ptr | k_ptr | v_ptr) & 15:
            return None  # an unaligned base: the general path copies q or refuses the cache
        lens_ptr = lens.data_ptr()
        table_ptr = 0 if table is None else table.data_ptr()
        kn_ptr = vn_ptr = 0
        if k_new is not None:
            kn_ptr, vn_ptr = k_new.data_ptr(), v_new.data_ptr()
            if (kn_ptr | vn_ptr) & 15:
                return None
        if o is None:  # fresh buffers: aligned, apart from every input
            o = self._alloc(st.o_shape, st.o_stride, self.o_dtype)
            lse = self._alloc(st.lse_shape, st.lse_stride, _F32)
            o_ptr, lse_ptr = o.data_ptr(), lse.data_ptr()
            out = (o, lse)
            out_o = out_lse = 0  # the caller's out (_apart): none
        else:
            o_ptr, lse_ptr = out_o, out_lse = o.data_ptr(), lse.data_ptr()
            if (o_ptr & 7) | (lse_ptr & 3):
                return None  # the kernel stores o 8 bytes at a time
        cu_ptr = 0 if cu is None else cu.data_ptr()
        # the tensor params' addresses (the layout fixed their names, dtypes and strides)
        t_ptrs = [params[n].data_ptr() for n in self.tensor_names] if self.tensor_names else ()
        if st.pairs:  # an append or out=: the addresses must keep the memory apart
            ptrs = (q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, lens_ptr, table_ptr, cu_ptr, out_o,
                    out_lse)  # fmt: skip
            if t_ptrs:
                ptrs += tuple(t_ptrs)
            if ptrs != st.apart and not self._apart(st, kc, vc, ptrs):
                return None  # memory that may overlap: the general path names it (or runs it)
        buf = st.attn_buf
        if self.kv8:
            kd_ptr = k_descale.data_ptr() if type(k_descale) is _TENSOR else 0
            vd_ptr = v_descale.data_ptr() if type(v_descale) is _TENSOR else 0
            self.attn_pack(buf, 0, q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, lens_ptr, table_ptr,
                           kd_ptr, vd_ptr)  # fmt: skip
        else:
            self.attn_pack(buf, 0, q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, lens_ptr, table_ptr)
        if t_ptrs:
            for set_field, ptr in zip(st.set_tensors, t_ptrs, strict=True):
                set_field(ptr)
        if self.sink:
            sink = None  # the call's logits, alive until the launch is enqueued
            if not join_sink:
                sink_ptr = 0
            elif st.sink_param is not None:
                sink_ptr = params[st.sink_param].data_ptr()
            else:
                sink = self.dop.sink_values(params, st.dims, self.device)["sink"]
                sink_ptr = sink.data_ptr()
            st.set_sink(sink_ptr)
        if cu is not None:
            st.set_cu(cu_ptr)
        stream = self._raw_stream(self.index)
        if stream != st.stream:  # its handle as the launcher takes it, made once per stream
            st.stream, st.stream_arg = stream, self._handle(stream)
        stream = st.stream_arg
        launch = self._cu_launch
        if k_new is not None:
            self.app_pack(st.app_buf, 0, kn_ptr, vn_ptr, k_ptr, v_ptr, lens_ptr, table_ptr)
            if cu is not None:
                st.set_app_cu(cu_ptr)
            rc = launch(self.app_fn, *self.app_launch, stream, st.app_params, None)
            if rc != 0:
                raise RuntimeError(f"cuLaunchKernel(decode append) failed: CUresult {rc}")
        rc = launch(self.attn_fn, *self.attn_launch, stream, st.attn_params, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernel(decode attention) failed: CUresult {rc}")
        return out

    def _call_extras(self, params, k_descale, v_descale):
        """``(tensors, form)`` a call adds to the layout check for its descales (an e4m3
        plan's: a tensor's metadata or a number) and its params (a tensor's name and metadata,
        or the name and value), in the call's order; None when the fast path does not take
        the call (descales for a plan without them: the general path names the argument)."""
        ts, form = [], []
        if self.kv8:
            for x in (k_descale, v_descale):
                if type(x) is _TENSOR:
                    ts.append(x)
                    form.append(_A_TENSOR)
                else:
                    form.append(x)
        elif k_descale is not None or v_descale is not None:
            return None
        for n, v in params.items():
            if type(v) is _TENSOR:
                ts.append(v)
                form.append((n, _A_TENSOR))
            else:
                form.append((n, v))
        return tuple(ts), tuple(form)

    def _revalidate(self, st, form, ts, q, kc, vc, lens, table, k_new, v_new, scale, params,
                    out, cu, max_seqlen_q, k_descale, v_descale) -> bool:  # fmt: skip
        """The layout check the long way, for a call the last layout's guard did not pass (a
        new layout, or one the guard cannot hold): the layout key (:meth:`_layout_key`),
        compared with the validated one; a new layout is validated and packed
        (:meth:`_prepare`).  Then the guard of this call's tensors (:func:`_metadata_guard`)
        and its ``form`` stand for the layout.  False: the fast path does not take the
        call."""
        if not self._eager(q, kc, vc):
            return False
        key = self._layout_key(q, kc, vc, lens, table, k_new, v_new, scale, params, out, cu,
                               max_seqlen_q, k_descale, v_descale)  # fmt: skip
        if key is None:
            return False
        if key != st.key:
            if not self._prepare(st, key, q, kc, vc, lens, table, k_new, v_new, scale, params,
                                 out, cu, max_seqlen_q, k_descale, v_descale):  # fmt: skip
                return False
        st.form, st.guard = form, _metadata_guard(ts)
        return True

    def _layout_key(self, q, kc, vc, lens, table, k_new, v_new, scale, params, out, cu,
                    max_seqlen_q, k_descale, v_descale):  # fmt: skip
        """The call's layout: every tensor's shape, strides, dtype and device (and ``out``'s
        negative bit: refused), and the scale, max_seqlen_q, the descales' and the params'
        values (all that validation and the packed scalars depend on); None for a call the
        fast path does not take: a tensor that requires grad is the general path's to refuse
        (q, the caches, k_new, v_new, tensor params: in grad mode; out: always), as is an
        argument that is not a tensor, a 0-d tensor param (resolve_params reads it each
        call) and descales for a plan without them."""
        grad = _GRAD_ENABLED()
        try:
            if grad and (q.requires_grad or kc.requires_grad or vc.requires_grad):
                return None
            key = (
                q.shape, q.stride(), q.dtype, q.get_device(), kc.shape, kc.stride(), kc.dtype,
                kc.get_device(), vc.shape, vc.stride(), vc.dtype, vc.get_device(), lens.shape,
                lens.stride(), lens.dtype, lens.get_device(), scale,
            )  # fmt: skip
            if table is not None:
                key += (table.shape, table.stride(), table.dtype, table.get_device())
            if cu is not None:
                if type(cu) is not _TENSOR:
                    return None
                key += (cu.shape, cu.stride(), cu.dtype, cu.get_device(), max_seqlen_q)
            if k_new is not None:
                if grad and (k_new.requires_grad or v_new.requires_grad):
                    return None
                key += (k_new.shape, k_new.stride(), k_new.dtype, k_new.get_device(),
                        v_new.shape, v_new.stride(), v_new.dtype, v_new.get_device())  # fmt: skip
        except AttributeError:
            return None  # an argument that is not a tensor: the general path names it
        if self.kv8:  # the descales: a tensor's layout (its address per call) or a number
            for x in (k_descale, v_descale):
                if type(x) is _TENSOR:
                    key += (x.shape, x.stride(), x.dtype, x.get_device())
                else:
                    key += (x,)
        elif k_descale is not None or v_descale is not None:
            return None  # the general path names the argument
        if out is not None:
            o, lse = out
            if type(o) is not _TENSOR or type(lse) is not _TENSOR:
                return None
            if o.requires_grad or lse.requires_grad:
                return None
            key += (o.shape, o.stride(), o.dtype, o.get_device(), o.is_neg(),
                    lse.shape, lse.stride(), lse.dtype, lse.get_device(), lse.is_neg())  # fmt: skip
        if params:
            pk = []
            for n, v in params.items():
                if type(v) is _TENSOR:
                    if v.dim() == 0 or (grad and v.requires_grad):
                        return None
                    pk.append((n, v.shape, v.stride(), v.dtype, v.get_device()))
                else:
                    pk.append((n, v))
            key += (tuple(pk),)
        return key

    def _apart(self, st, kc, vc, ptrs: tuple) -> bool:
        """Whether this call's memory is apart as the general path requires (issue 38, item
        3; :func:`~flashgen.ops.decode.inputs.check_aliasing` and ``check_out``), from the
        addresses alone: the layout fixes every extent (``st.spans``, bytes from each
        tensor's address), so the test is a few comparisons per call.  ``ptrs``: q, k_cache,
        v_cache, k_new, v_new, cache_seqlens, block_table, cu_seqlens_q, o, lse, then the
        tensor params (0 for an absent one).  An append's k_cache and v_cache are compared
        exactly (:func:`~flashgen.ops.out_arg.shares_memory`: the interleaved halves of one
        KV buffer are apart) once per pair of addresses; the other pairs
        (``st.pairs``: k_new / v_new with the caches they are written into, ``out`` with
        every input) by their hulls, as ``check_out``.  False: the general path checks the
        call exactly and raises or runs it."""
        if st.kv_exact and (ptrs[1], ptrs[2]) != st.kv_apart:
            from flashgen.ops.out_arg import shares_memory

            if shares_memory(kc, vc):
                return False
            st.kv_apart = (ptrs[1], ptrs[2])
        spans = st.spans
        for i, j in st.pairs:
            a, b = ptrs[i], ptrs[j]
            if a < b + spans[j] and b < a + spans[i]:
                return False
        st.apart = ptrs  # the next call with these addresses skips the comparisons
        return True

    def _guard(self, st, q, kc, vc, lens, table, k_new, v_new, out, cu, tensors) -> None:
        """Set ``st``'s per-call memory check (:meth:`_apart`) for a layout just validated:
        the byte extent of each tensor from its address and the pairs to compare (those of
        non-empty tensors only); ``kv_apart``: the cache addresses the validation found
        apart."""
        from flashgen.ops.out_arg import _span

        o, lse = (None, None) if out is None else out
        ts = (q, kc, vc, k_new, v_new, lens, table, cu, o, lse, *tensors)
        st.spans = tuple(
            0 if t is None or _span(t) is None else _span(t)[1] - _span(t)[0] for t in ts
        )
        pairs = []
        if k_new is not None:  # what the append writes, against what it reads from
            written = (1,) if self.v_from_k else (1, 2)
            news = (3,) if self.v_from_k else (3, 4)
            pairs += [(n, c) for n in news for c in written]
        if out is not None:  # o and lse, against each other and every input
            ins = [0, 1, 2, 3, 4, 5, 6, 7, *range(10, len(ts))]
            pairs += [(8, 9)] + [(x, i) for x in (8, 9) for i in ins]
        st.pairs = tuple((i, j) for i, j in pairs if st.spans[i] and st.spans[j])
        st.kv_exact = k_new is not None and not self.v_from_k
        st.kv_apart = (kc.data_ptr(), vc.data_ptr())
        st.apart = None

    def _prepare(self, st, key, q, kc, vc, lens, table, k_new, v_new, scale, params,
                 out=None, cu=None, max_seqlen_q=None, k_descale=None,
                 v_descale=None) -> bool:  # fmt: skip
        """Full validation of a new layout (raises what the general path raises) and the
        packing of its argument blocks; False when the fast path does not apply."""
        dop, spec, plan = self.dop, self.dop.spec, self.plan
        st.key = st.form = None  # what follows changes the state: no layout until it passes
        scalars, tensors = resolve_params(spec, params)
        tmap = {p.name: t for p, t in zip(spec.tensor_params, tensors, strict=True)}
        for p, t in tmap.items():  # another form (a list, None ...): the general path names it
            if not isinstance(t, torch.Tensor):
                return False
            if t.dtype != PARAM_DTYPE[spec.param(p).ty] or not t.is_contiguous():
                return False
        scale = check_softmax_scale(default_softmax_scale(spec) if scale is None else scale)
        if cu is not None:
            msq = dop.max_seqlen_q_of(q, cu, max_seqlen_q, plan)
            dims = validate_decode_ragged(spec, q, kc, vc, lens, table, k_new, v_new, cu, msq)
        else:
            dims = validate_decode(spec, q, kc, vc, lens, table, k_new, v_new)
        if q.dtype != TORCH_DTYPE[spec.dtype]:
            return False  # an e4m3 q: the general path converts it
        _, scales = resolve_scales(spec, dims, q, k_descale, v_descale, None)
        if spec.tensor_params:
            validate_tensor_params(spec, tmap, q.device, dims.symbols())
        dop._check_plan(plan, dims, q.device, 0, kc.dtype)
        o_shape, lse_shape = dims.out_shapes()
        if out is not None:
            inputs = {"q": q, "k_cache": kc, "v_cache": vc, "k_new": k_new, "v_new": v_new,
                      "cache_seqlens": lens, "block_table": table, "cu_seqlens_q": cu, **tmap}
            check_out(spec, out, o_shape, q.device, lse_shape, inputs)
        aligned = _aligned_16 if cu is not None else (lambda t: _kernel_aligned(t) is t)
        if k_new is not None and not (_aligned_16(k_new) and _aligned_16(v_new)):
            return False
        if not aligned(q):
            return False
        sink = None
        st.dims, st.sink_param = dims, None
        if self.sink:  # the sink's strides are the layout's; is it a param itself?
            sink = dop.sink_values(params, dims, q.device)
            st.sink_param = next((n for n in self.tensor_names if params[n] is sink["sink"]),
                                 None)  # fmt: skip
        values = dop.launch_values(plan, q, kc, vc, lens, table, q, q, scale, scalars, tmap,
                                   scales, dims, sink)  # fmt: skip
        if cu is not None:
            values["cu_seqlens_q"] = cu
        st.o_shape, st.lse_shape = o_shape, lse_shape
        st.o_stride, st.lse_stride = _contiguous_strides(o_shape), _contiguous_strides(lse_shape)
        self._guard(st, q, kc, vc, lens, table, k_new, v_new, out, cu, list(tmap.values()))
        self.attn_layout.pack(st.attn_buf, values)
        if k_new is not None:
            self.app_layout.pack(st.app_buf, dop.append_values(values, k_new, v_new))
        st.key = key
        return True


class _FastState:
    """One thread's argument blocks of a :class:`_FastPath` and the layout they hold; the
    writers of the per-call fields after the leading pointers (``cu_seqlens_q``, ``sink``,
    the tensor params' ``t_<name>``), bound to the blocks (None where the kernel has no such
    argument)."""

    def __init__(self, attn_layout, app_layout, tensor_names=()):
        self.key = None
        # the outputs of the layout in ``key`` (contiguous)
        self.o_shape = self.lse_shape = self.o_stride = self.lse_stride = None
        self.dims = None  # its validated sizes
        self.sink_param = None  # a fused sink: the tensor param whose address is the logits
        # the per-call memory check of that layout (_FastPath._guard, _FastPath._apart)
        self.spans, self.pairs, self.kv_exact, self.kv_apart = (), (), False, None
        self.apart = None  # the last addresses _apart passed
        # the guard of that layout (_FastPath._revalidate): the call's form and its tensors'
        # metadata check (_metadata_guard)
        self.form, self.guard = None, _never
        self.stream = self.stream_arg = None  # the last raw stream and its launcher handle
        self.attn_buf, self.attn_params = attn_layout.new_block()
        self.app_buf, self.app_params = app_layout.new_block()
        self.set_cu = attn_layout.setter(self.attn_buf, "cu_seqlens_q")
        self.set_app_cu = app_layout.setter(self.app_buf, "cu_seqlens_q")
        self.set_sink = attn_layout.setter(self.attn_buf, "sink")
        self.set_tensors = tuple(attn_layout.setter(self.attn_buf, f"t_{n}") for n in tensor_names)
