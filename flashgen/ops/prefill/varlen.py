"""Varlen ops: packed variable-length sequences (FlashAttention's ``flash_attn_varlen_func``).

A spec with ``varlen: true`` registers ``torch.ops.flashgen.<name>`` with the schema::

    <name>(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k,
           int max_seqlen_q, int max_seqlen_k, float softmax_scale,
           <scalar params>, <tensor params>, *, bool deterministic=False) -> (Tensor, Tensor)

Op contract (FlashAttention 2's varlen interface, ``flash_attn_varlen_func``):

    q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv], the spec's dtype, one
    device, any strides with stride(-1) == 1; Hq % Hkv == 0.
    cu_seqlens_q, cu_seqlens_k: int32 [batch + 1] on q's device, nondecreasing from 0,
    ending at total_q / total_k; sequence i is rows cu_seqlens[i] .. cu_seqlens[i + 1].
    max_seqlen_q, max_seqlen_k: Python ints, at least every sequence's length (larger is
    fine: CTAs past a sequence's end exit at once, and the grid is clamped to total_q).
    o [total_q, Hq, Dv] in the input dtype; lse float32 [Hq, total_q] (FA2's varlen layout).

Within a sequence everything is as for the padded op: ``b`` is the sequence index,
``q_idx``/``kv_idx`` count from the sequence's first row, ``seqlen_q``/``seqlen_k`` are
its lengths, causal is bottom-right aligned per sequence.  Empty sequences are allowed; a
sequence with seqlen_k = 0 and seqlen_q > 0 gives o = 0, lse = -inf (zero gradients).

What is checked: shapes, dtypes, devices, strides, cu_seqlens' rank, length, dtype and
device, the max_seqlen types and ranges, and tensor params (``batch`` is the number of
sequences; seqlen_q/seqlen_k shape symbols are rejected by the spec checker) -- all
without reading device memory.  The *values* of cu_seqlens (start at 0, nondecreasing,
end at total, each length <= max_seqlen) cannot be checked on a CUDA device without a
host sync, so they are checked on CPU inputs always and on CUDA inputs only when the
debugging variable :data:`flashgen.env.VARLEN_CHECK` is set to 1.  Unchecked bad values give what
FlashAttention gives: out-of-bounds reads or writes for offsets past the tensors, rows a
too-small max_seqlen does not cover left unwritten (``torch.empty`` contents), rows past
``cu_seqlens_q[-1]`` unwritten.

The backward (``<name>__backward``, same kernels as the padded op: the deterministic
path, and the atomic-dQ path under ``Options(atomic_dq=True)``) returns dq, dk, dv packed like
q, k, v; autograd is registered as for the padded op (see :mod:`flashgen.ops.prefill.backward`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

import torch

from flashgen import env
from flashgen.frontend import ir
from flashgen.frontend.errors import OpInputError, SpecError
from flashgen.ops.calls import _kernel_aligned, current_stream_ptr, kernel_values
from flashgen.ops.prefill.attention import AttentionOp
from flashgen.ops.prefill.backward import (
    BACKWARD_TAIL,
    Backward,
    backward_name,
    dparam_buffers,
    param_shapes,
    run_backward_op,
    tensor_param_grads,
    uses_atomic_dq,
    wanted,
)
from flashgen.ops.prefill.fused_sink import FusedSinkVarlen
from flashgen.ops.sink import sink_arg_values, varlen_rows
from flashgen.ops.validation import (
    _SCHEMA_TYPE,
    CPU_DTYPES,
    Dims,
    _poison_enabled,
    _symbolic,
    check_enabled,
    check_heads_and_strides,
    check_input_device,
    check_input_dtype,
    check_layout,
    check_scalar,
    check_softmax_scale,
    default_softmax_scale,
    lse_dtype,
    out_dtype,
    resolve_params,
    validate_tensor_params,
)

#: Environment variable that makes CUDA calls check cu_seqlens' values (one host sync).
CHECK_ENV = env.VARLEN_CHECK
_INT32_MAX = 2**31 - 1


def varlen_spec(spec: ir.Spec) -> ir.Spec:
    """The varlen form of a padded spec: the same variant with ``varlen`` set, named
    ``<name>__varlen`` (its own op and kernels); a varlen spec is returned as is.

    Raises :class:`~flashgen.frontend.errors.SpecError` at the param when a tensor param's shape
    uses ``seqlen_q`` or ``seqlen_k`` (each packed sequence has its own length), as the
    spec checker does for a ``varlen: true`` spec, and at its ``dtype`` line for an fp8 spec
    (no varlen form).
    """
    if spec.varlen:
        return spec
    if spec.v_from_k:
        line = next(
            (i for i, text in enumerate(spec.source.splitlines(), 1)
             if text.startswith("v_from_k")),
            1,
        )  # fmt: skip
        raise SpecError.at(
            ir.Span(spec.path, line, 1),
            f"spec {spec.name!r} has no varlen form: v_from_k: true is decode only",
            spec.source,
        )
    if spec.dtype in ir.FP8_DTYPES:
        line = next(
            (i for i, text in enumerate(spec.source.splitlines(), 1) if text.startswith("dtype")),
            1,
        )
        raise SpecError.at(
            ir.Span(spec.path, line, 1),
            f"spec {spec.name!r} has no varlen form: dtype {spec.dtype} (the FP8 kernel takes "
            f"padded [B, H, S, D] inputs)",
            spec.source,
        )
    for p in spec.tensor_params:
        for d in p.shape:
            if d in ("seqlen_q", "seqlen_k"):
                raise SpecError.at(
                    p.span,
                    f"spec {spec.name!r} has no varlen form: tensor param '{p.name}' has shape "
                    f"entry '{d}', but each packed sequence has its own length",
                    spec.source,
                )
    return replace(spec, name=f"{spec.name}__varlen", varlen=True)


@dataclass(frozen=True)
class VarlenDims:
    """Problem sizes of a varlen call, read off validated inputs (no device reads)."""

    batch: int
    heads_q: int
    heads_kv: int
    total_q: int
    total_k: int
    max_seqlen_q: int
    max_seqlen_k: int
    head_dim_v: int

    def symbols(self) -> dict[str, int]:
        """Values of the shape symbols a varlen spec's tensor params may use."""
        return {"batch": self.batch, "num_heads": self.heads_q, "num_heads_kv": self.heads_kv}

    @property
    def grid_seqlen_q(self) -> int:
        """The query length the grid covers: max_seqlen_q, never more than total_q."""
        return min(self.max_seqlen_q, self.total_q)

    @property
    def grid_seqlen_k(self) -> int:
        return min(self.max_seqlen_k, self.total_k)

    def kernel_dims(self) -> Dims:
        """Dims for :func:`flashgen.ops.op.kernel_values` (its seqlen_q/k are the grid's)."""
        return Dims(
            self.batch,
            self.heads_q,
            self.heads_kv,
            self.grid_seqlen_q,
            self.grid_seqlen_k,
            self.head_dim_v,
        )


def _shape(t) -> list:
    return list(t.shape)


def _check_max_seqlen(name: str, value, total: int) -> None:
    if _symbolic(value):
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OpInputError(f"{name}: expected a Python int, got {value!r}")
    if not 0 <= int(value) <= _INT32_MAX:
        raise OpInputError(f"{name}: expected an int in [0, 2**31 - 1], got {value}")
    if total > 0 and int(value) == 0 and not _symbolic(total):
        raise OpInputError(
            f"{name}: expected at least the longest sequence's length (>= 1 when the packed "
            f"tensors hold {total} rows), got 0"
        )


def validate_varlen(
    spec: ir.Spec,
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    tensor_params: dict | None = None,
    *,
    softmax_scale=None,
    scalars=None,
) -> VarlenDims:
    """Check a varlen call's inputs against ``spec`` and the op contract (module docstring).

    Reads only shapes, strides, dtypes and devices (never tensor contents; see
    :func:`check_cu_seqlens` for the values).  Returns the :class:`VarlenDims`.  Raises
    :class:`OpInputError` naming the argument, the expected and the received value.
    """
    if softmax_scale is not None and not _symbolic(softmax_scale):
        check_softmax_scale(softmax_scale)
    if scalars is not None:
        for p, val in zip(spec.scalar_params, scalars, strict=True):
            if not _symbolic(val):
                check_scalar(p, val)
    named = (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q))
    for name, t in (*named, ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor):
            raise OpInputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        check_layout(name, t)
    check_input_device(spec, "q", q)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise OpInputError(
                f"{name}: expected a 3-D packed tensor [total_tokens, heads, head_dim] "
                f"(varlen spec {spec.name!r}), got shape {_shape(t)}"
            )
        check_input_dtype(spec, name, t, q)
    for name, t in (*named[1:], ("cu_seqlens_k", cu_seqlens_k)):
        if t.device != q.device:
            raise OpInputError(f"{name}: expected device {q.device} (q's device), got {t.device}")
    if q.shape[2] != spec.head_dim:
        raise OpInputError(f"q: expected head_dim {spec.head_dim} (shape[-1]), got {q.shape[2]}")
    if k.shape[2] != spec.head_dim:
        raise OpInputError(f"k: expected head_dim {spec.head_dim} (shape[-1]), got {k.shape[2]}")
    if v.shape[2] != spec.head_dim_v:
        raise OpInputError(
            f"v: expected head_dim_v {spec.head_dim_v} (shape[-1]), got {v.shape[2]}"
        )
    if tuple(v.shape[:2]) != tuple(k.shape[:2]):
        raise OpInputError(
            f"v: expected [total_k, heads_kv] = {_shape(k)[:2]} (k's), got {_shape(v)[:2]}"
        )
    hq, hkv = check_heads_and_strides(q, k, v)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t.dim() != 1 or t.shape[0] < 1:
            raise OpInputError(
                f"{name}: expected a 1-D tensor [batch + 1] of sequence offsets, got shape "
                f"{_shape(t)}"
            )
        if t.dtype != torch.int32:
            raise OpInputError(f"{name}: expected dtype torch.int32, got {t.dtype}")
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        raise OpInputError(
            f"cu_seqlens_k: expected shape [{cu_seqlens_q.shape[0]}] (cu_seqlens_q's, "
            f"batch + 1), got {_shape(cu_seqlens_k)}"
        )
    total_q, total_k = q.shape[0], k.shape[0]
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, total_q)
    _check_max_seqlen("max_seqlen_k", max_seqlen_k, total_k)
    for name, total in (("q", total_q), ("k", total_k)):
        if not _symbolic(total) and total > _INT32_MAX:
            raise OpInputError(
                f"{name}: expected at most 2**31 - 1 packed rows (int32 cu_seqlens), got {total}"
            )
    dims = VarlenDims(
        cu_seqlens_q.shape[0] - 1, hq, hkv, total_q, total_k, max_seqlen_q, max_seqlen_k,
        v.shape[2],
    )  # fmt: skip
    validate_tensor_params(spec, tensor_params, q.device, dims.symbols())
    return dims


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, dims: VarlenDims) -> None:
    """Check cu_seqlens' values: start at 0, nondecreasing, end at total_q / total_k, every
    length <= max_seqlen.  Reads the tensors (a host sync for CUDA ones).  Raises
    :class:`OpInputError` naming the first offending entry."""
    for name, t, total, mx in (
        ("cu_seqlens_q", cu_seqlens_q, dims.total_q, dims.max_seqlen_q),
        ("cu_seqlens_k", cu_seqlens_k, dims.total_k, dims.max_seqlen_k),
    ):
        vals = [int(x) for x in t.tolist()]
        if vals[0] != 0:
            raise OpInputError(f"{name}: expected cu_seqlens[0] == 0, got {vals[0]}")
        for i in range(1, len(vals)):
            n = vals[i] - vals[i - 1]
            if n < 0:
                raise OpInputError(
                    f"{name}: expected nondecreasing offsets, got cu_seqlens[{i - 1}] = "
                    f"{vals[i - 1]} > cu_seqlens[{i}] = {vals[i]}"
                )
            if n > mx:
                which = "max_seqlen_q" if name.endswith("q") else "max_seqlen_k"
                raise OpInputError(
                    f"{which}: expected at least every sequence's length, but sequence "
                    f"{i - 1} has {n} rows (> {mx})"
                )
        if vals[-1] != total:
            raise OpInputError(
                f"{name}: expected cu_seqlens[-1] == {total} (the packed tensor's rows), "
                f"got {vals[-1]}"
            )


def schema(spec: ir.Spec) -> str:
    """The varlen operator schema (module docstring)."""
    args = [
        "Tensor q",
        "Tensor k",
        "Tensor v",
        "Tensor cu_seqlens_q",
        "Tensor cu_seqlens_k",
        "int max_seqlen_q",
        "int max_seqlen_k",
        "float softmax_scale",
    ]
    args += [f"{_SCHEMA_TYPE[p.ty]} {p.name}" for p in spec.scalar_params]
    args += [f"Tensor {p.name}" for p in spec.tensor_params]
    args += ["*", "bool deterministic=False"]
    return f"{spec.name}({', '.join(args)}) -> (Tensor, Tensor)"


def backward_schema(spec: ir.Spec) -> str:
    """Schema of the varlen backward op: the padded one's plus cu_seqlens and max_seqlen."""
    args = [
        "Tensor dout",
        "Tensor q",
        "Tensor k",
        "Tensor v",
        "Tensor o",
        "Tensor lse",
        "Tensor? dlse",
        "Tensor cu_seqlens_q",
        "Tensor cu_seqlens_k",
        "int max_seqlen_q",
        "int max_seqlen_k",
        "float softmax_scale",
        "bool deterministic",
    ]
    args += [f"{_SCHEMA_TYPE[p.ty]} {p.name}" for p in spec.scalar_params]
    args += [f"Tensor {p.name}" for p in spec.tensor_params]
    return f"{backward_name(spec)}({', '.join(args)}, {BACKWARD_TAIL}"


def _as4d(t):
    """Packed [total, heads, d] as the kernels' [1, heads, total, d] view (no copy)."""
    return t.unsqueeze(0).transpose(1, 2)


def _packed_values(spec, tensors: dict, dims: VarlenDims, softmax_scale, scalars, tparams,
                   cu_seqlens_q, cu_seqlens_k) -> dict:  # fmt: skip
    """Launch values of a varlen kernel: the packed tensors go in as 4-D views with their
    batch stride set to 0 (the kernel offsets each sequence by cu_seqlens itself)."""
    views = {n: (_as4d(t) if t is not None and t.dim() == 3 else t) for n, t in tensors.items()}
    values = kernel_values(spec, views, dims.kernel_dims(), softmax_scale, scalars, tparams)
    for n, t in views.items():
        if t is not None and t.dim() == 4:
            values[f"{n}_sb"] = 0
    values.update(
        cu_seqlens_q=cu_seqlens_q.contiguous(),
        cu_seqlens_k=cu_seqlens_k.contiguous(),
        max_seqlen_q=dims.grid_seqlen_q,
        max_seqlen_k=dims.grid_seqlen_k,
        total_q=dims.total_q,
    )
    return values


def _reference_params(spec: ir.Spec, scalars, tensors: dict, dtype) -> dict:
    from flashgen.ops.cpu.attention import cpu_params

    return cpu_params(spec, scalars, tensors, dtype)


class VarlenOp(AttentionOp):
    """The op of a ``varlen: true`` spec (module docstring); built by
    :func:`flashgen.ops.op.build_op`.  Call :meth:`attention`."""

    def attention(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                  apply_sink: bool = True, **kwargs):  # fmt: skip
        """Varlen attention: returns ``(o, lse)``, o [total_q, Hq, Dv], lse float32
        [Hq, total_q].  Arguments follow ``flash_attn_varlen_func`` (module docstring);
        ``softmax_scale``, ``deterministic``, ``apply_sink`` and ``params`` are as for the
        padded op (a sink per sequence and head).  Param gradients as for the padded op
        (tensor params and 0-d scalar tensors that require grad).  Raises
        :class:`OpInputError` for bad inputs."""
        args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        return self._with_sink(self._varlen, args, q, k, cu_seqlens_q, apply_sink, None, kwargs)

    def _varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                softmax_scale: float | None = None, deterministic: bool = False, out=None,
                join_sink: bool = False, **params):  # fmt: skip
        """:meth:`attention` over the keys alone (no sink applied); ``out`` must be None.
        ``join_sink`` (a call :meth:`_fuses_sink` accepted): with the sink, joined by the
        forward kernel (launched here, :class:`~flashgen.ops.prefill.fused_sink.FusedSinkVarlen`
        where gradients are wanted)."""
        self._check_live()
        if params.pop("block_mask", None) is not None:
            raise OpInputError(_no_block_mask(self))
        scalar_grads: dict = {}
        scalars, tensors = resolve_params(self.spec, params, scalar_grads)
        dims = validate_varlen(
            self.spec, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            self._tensor_map(tensors),
        )  # fmt: skip
        if softmax_scale is None:
            softmax_scale = default_softmax_scale(self.spec)
        softmax_scale = check_softmax_scale(softmax_scale)
        if not isinstance(deterministic, bool):
            raise OpInputError(f"deterministic: expected a bool, got {deterministic!r}")
        if join_sink:  # plain eager CUDA (_fuses_sink): the kernel joins each sequence's sink
            sink = self._sink_logits(params, dims.batch, dims.heads_q, dims.heads_kv, q.device)
            if not torch.is_grad_enabled() or not any(
                t.requires_grad for t in (q, k, v, sink, *tensors)
            ):
                return self._launch_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, dims,
                                            softmax_scale, scalars, self._tensor_map(tensors),
                                            sink=sink)  # fmt: skip
            rows = varlen_rows(sink, cu_seqlens_q, dims.total_q)
            return FusedSinkVarlen.apply(
                self, dims, softmax_scale, scalars, deterministic, q, k, v, cu_seqlens_q,
                cu_seqlens_k, sink.detach(), rows, *tensors,
            )  # fmt: skip
        args = (q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                softmax_scale, *scalars, *tensors)  # fmt: skip
        if scalar_grads:
            from flashgen.ops.prefill.attention import ScalarParamGrad

            return ScalarParamGrad.apply(
                self, args, deterministic, tuple(scalar_grads), None, q, k, v, *tensors,
                *scalar_grads.values(),
            )  # fmt: skip
        return self.torch_op(*args, deterministic=deterministic)

    __call__ = attention

    def block_mask(self, *args, **kwargs):
        """A varlen op has no block mask: :class:`OpInputError` (:func:`_no_block_mask`)."""
        self._check_live()
        raise OpInputError(_no_block_mask(self))

    def _validate(self, q, k, v, cq, ck, mq, mk, softmax_scale, rest):
        scalars, tensors = self._split(rest)
        dims = validate_varlen(
            self.spec, q, k, v, cq, ck, mq, mk, tensors, softmax_scale=softmax_scale,
            scalars=scalars,
        )  # fmt: skip
        return dims, scalars, tensors

    def _packed_outputs(self, q, dims: VarlenDims):
        o = torch.empty(
            (dims.total_q, dims.heads_q, dims.head_dim_v),
            dtype=q.dtype if q.dtype in CPU_DTYPES else out_dtype(self.spec),
            device=q.device,
        )  # fmt: skip
        lse = torch.empty((dims.heads_q, dims.total_q), dtype=lse_dtype(q.dtype), device=q.device)
        return o, lse

    def _fake_impl(self, q, k, v, cq, ck, mq, mk, softmax_scale, *rest, deterministic=False):
        dims, _, _ = self._validate(q, k, v, cq, ck, mq, mk, softmax_scale, rest)
        return self._packed_outputs(q, dims)

    def _cpu_impl(self, q, k, v, cq, ck, mq, mk, softmax_scale, *rest, deterministic=False):
        from flashgen.ops.cpu.attention import varlen_blocked

        dims, scalars, tensors = self._validate(q, k, v, cq, ck, mq, mk, softmax_scale, rest)
        check_cu_seqlens(cq, ck, dims)
        o, lse = self._packed_outputs(q, dims)
        if o.numel() == 0 and lse.numel() == 0:
            return o, lse
        ref_o, ref_lse = varlen_blocked(
            self.spec, q, k, v, cq, ck, softmax_scale=softmax_scale,
            params=_reference_params(self.spec, scalars, tensors, q.dtype),
        )  # fmt: skip
        o.copy_(ref_o)
        lse.copy_(ref_lse)
        return o, lse

    def _cuda_impl(self, q, k, v, cq, ck, mq, mk, softmax_scale, *rest, deterministic=False):
        dims, scalars, tensors = self._validate(q, k, v, cq, ck, mq, mk, softmax_scale, rest)
        return self._launch_forward(q, k, v, cq, ck, dims, softmax_scale, scalars, tensors)

    def _launch_forward(self, q, k, v, cq, ck, dims: VarlenDims, softmax_scale, scalars,
                        tensors: dict, sink=None):  # fmt: skip
        """The CUDA forward of validated varlen inputs (``dims``: :func:`validate_varlen`'s
        answer; ``scalars`` in spec order, ``tensors`` by name), launched on the current
        stream of q's device: fresh ``(o, lse)``.  ``sink``: float32 ``[num_seqs, Hq]`` logits
        the kernel joins to o (a fused-sink op, :meth:`_joins_sink`), None: the keys alone.
        cu_seqlens' values are checked first under :func:`check_enabled` (a host sync)."""
        if check_enabled():
            check_cu_seqlens(cq, ck, dims)
        o, lse = self._packed_outputs(q, dims)
        if _poison_enabled():
            o.fill_(math.nan)
            lse.fill_(math.nan)
        if lse.numel() == 0 or dims.batch == 0:
            return o, lse
        if dims.total_k == 0:  # every sequence has seqlen_k = 0
            return o.zero_(), lse.fill_(-math.inf)
        kern = self.kernel(q.device)
        grid, values = forward_launch(
            self.spec, kern.plan, q, k, v, o, lse, cq, ck, dims, softmax_scale, scalars, tensors,
            sink=sink,
        )
        kern.launch(grid, values, current_stream_ptr(q.device))
        return o, lse


def _no_block_mask(op) -> str:
    """Why varlen op ``op`` takes no ``block_mask`` and builds none (its ``block_mask``
    method and a call given one raise it)."""
    return (
        f"block_mask: op {op.spec.name!r} is a varlen op, which takes no block mask (a block "
        f"table is per padded batch and sequence length; its kernels read none, and a varlen "
        f"mask reading tensor params runs on CPU only, evaluated per pair); call it without "
        f"block_mask, or use op.block_mask(...) with the padded op.attention"
    )


def forward_launch(spec, plan, q, k, v, o, lse, cq, ck, dims: VarlenDims, softmax_scale,
                   scalars, tensors, sink=None) -> tuple:  # fmt: skip
    """``(grid, values)`` of the varlen forward kernel ``plan`` on packed q, k, v (3-D),
    outputs o [total_q, Hq, Dv] and lse [Hq, total_q]; a fused-sink kernel takes ``sink``
    (float32 ``[num_seqs, Hq]`` logits, or None: null, the keys alone).  Pure (no launch):
    the CPU tests pack it against the kernel ABI.  Raises :class:`OpInputError` for a grid
    too large, ``RuntimeError`` for logits given to a kernel without the fused sink."""
    q, k, v = (_kernel_aligned(_as4d(t)) for t in (q, k, v))
    values = _packed_values(
        spec, {"q": q, "k": k, "v": v, "o": o, "lse": lse}, dims, softmax_scale, scalars,
        tensors, cq, ck,
    )  # fmt: skip
    if plan.context["sink"]:
        values.update(sink_arg_values(sink))
    elif sink is not None:
        raise RuntimeError(f"{plan.kernel_name} has no fused sink to take the sink logits")
    grid = plan.grid(dims.batch, dims.heads_q, dims.grid_seqlen_q)
    _check_grids(grid)
    return grid, values


def backward_launches(spec, plan, tensors_in: dict, cq, ck, dims: VarlenDims, softmax_scale,
                      scalars, tensors) -> dict:  # fmt: skip
    """``{role: (grid, values)}`` for the varlen backward kernels of ``plan`` (a
    :class:`~flashgen.families.bwd_common.BackwardPlan`): ``pre`` (and ``convert``) see the packed
    rows as one batch of total_q rows; ``dkdv`` and ``dq`` walk the sequences.  ``tensors_in``: the
    kernels' tensors by name, packed ones 3-D or already as 4-D views.  Pure (no launch). Raises
    :class:`OpInputError` for a grid too large."""
    values = _packed_values(spec, tensors_in, dims, softmax_scale, scalars, tensors, cq, ck)
    flat = dict(values, batch=1, seqlen_q=dims.total_q)
    grids = plan.grids(
        dims.batch, dims.heads_q, dims.heads_kv, dims.grid_seqlen_q, dims.grid_seqlen_k
    )
    flat_grids = plan.grids(1, dims.heads_q, dims.heads_kv, dims.total_q, dims.total_k)
    _check_grids(*grids.values(), *flat_grids.values())
    out = {"pre": (flat_grids["pre"], flat), "dkdv": (grids["dkdv"], values)}
    if plan.atomic_dq:
        out["convert"] = (flat_grids["convert"], flat)
    else:
        out["dq"] = (grids["dq"], values)
    return out


def _check_grids(*grids) -> None:
    """Refuse a launch whose 1-D grid exceeds CUDA's gridDim.x limit (2**31 - 1): the grid
    is batch * heads * blocks of max_seqlen (clamped to the packed total), so only a
    max_seqlen far above the longest sequence gets there."""
    for g in grids:
        if g[0] > _INT32_MAX:
            raise OpInputError(
                f"max_seqlen_q / max_seqlen_k: the launch grid needs {g[0]} blocks (more than "
                "2**31 - 1); pass the longest sequence's real length"
            )


def _zero_grads(q, k, v):
    return tuple(torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


class VarlenBackward(Backward):
    """Backward implementations and autograd of a :class:`VarlenOp` (module docstring)."""

    def fake(self, dout, q, k, v, o, lse, dlse, cq, ck, mq, mk, scale, deterministic, *rest,
             param_grads=()):  # fmt: skip
        _, tensors = self.op._split(rest)
        grads = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        return (*grads, self._empty_param_grads(param_grads, tensors, q))

    def cpu(self, dout, q, k, v, o, lse, dlse, cq, ck, mq, mk, scale, deterministic, *rest,
            param_grads=()):  # fmt: skip
        """The blocked CPU backward per sequence (:mod:`flashgen.ops.cpu.attention`) against
        the saved ``o`` and ``lse`` (P and the row term from them, as the kernels take them),
        with the requested param gradients summed over the sequences."""
        from flashgen.ops.cpu.attention import varlen_blocked_backward

        dims, scalars, tensors = self.op._validate(q, k, v, cq, ck, mq, mk, scale, rest)
        check_cu_seqlens(cq, ck, dims)
        names = wanted(self.spec, param_grads)
        dq, dk, dv, dparams = varlen_blocked_backward(
            self.spec, dout, q, k, v, dlse, cq, ck, softmax_scale=scale,
            params=_reference_params(self.spec, scalars, tensors, q.dtype), param_grads=names,
            o=o, lse=lse,
        )  # fmt: skip
        return dq, dk, dv, [dparams[n] for n in names]

    def cuda(self, dout, q, k, v, o, lse, dlse, cq, ck, mq, mk, scale, deterministic, *rest,
             param_grads=()):  # fmt: skip
        """The padded op's backward kernels in their varlen form: pre (over the packed rows
        as one batch), dkdv and dq (or dkdv_atomic and convert); see
        :meth:`flashgen.ops.prefill.backward.Backward.cuda`.  dq, dk, dv are contiguous and
        packed."""
        dims, scalars, tensors = self.op._validate(q, k, v, cq, ck, mq, mk, scale, rest)
        if check_enabled():
            check_cu_seqlens(cq, ck, dims)
        names = wanted(self.spec, param_grads)
        shapes = param_shapes(names, tensors)
        if q.numel() == 0 or k.numel() == 0 or dims.batch == 0:
            return (*_zero_grads(q, k, v),
                    [torch.zeros(shapes[n], dtype=torch.float32, device=q.device)
                     for n in names])  # fmt: skip
        atomic = uses_atomic_dq(deterministic, self.op.options)
        plan, pre, dkdv, last = self.kernels(q.device, atomic_dq=atomic, param_grads=names)
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        q4, k4, v4, o4, dout4 = (_kernel_aligned(_as4d(t)) for t in (q, k, v, o, dout))
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        dsum = torch.empty(lse.shape, dtype=torch.float32, device=q.device)  # [Hq, total_q]
        # fp32 dQ accumulator of the atomic path: contiguous [Hq, total_q, D], zeroed by `pre`
        dq_accum = (
            torch.empty((dims.heads_q, dims.total_q, q.shape[2]), dtype=torch.float32,
                        device=q.device) if atomic else None
        )  # fmt: skip
        tensors_in = {
            "q": q4, "k": k4, "v": v4, "o": o4, "dout": dout4, "lse": lse, "dsum": dsum,
            "dq": _as4d(dq), "dk": _as4d(dk), "dv": _as4d(dv), "dq_accum": dq_accum,
        }  # fmt: skip
        launches = backward_launches(
            self.spec, plan, tensors_in, cq, ck, dims, scale, scalars, tensors
        )
        finish = None
        if names:  # the dK/dV kernel's CTAs, one row each under deterministic=True
            grid, values = launches["dkdv"]
            rows = grid[0] // plan.tiles.dkdv_dsplit
            extra, finish = dparam_buffers(names, shapes, rows, deterministic, q.device)
            launches["dkdv"] = (grid, {**values, **extra})
        stream = current_stream_ptr(q.device)
        pre.launch(*launches["pre"], stream)
        if dlse is not None:
            dsum.sub_(dlse)
        dkdv.launch(*launches["dkdv"], stream)
        last.launch(*launches["convert" if atomic else "dq"], stream)
        return dq, dk, dv, finish() if finish is not None else []

    # ------------------------------------------------------------------ autograd
    def setup_context(self, ctx, inputs, output, keyword_only_inputs=None):
        q, k, v, cq, ck, mq, mk, softmax_scale, *rest = inputs
        n = len(self.spec.scalar_params)
        tensors = rest[n:]
        ctx.param_grads = tensor_param_grads(self.spec, tensors)
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse, cq, ck, *tensors)
        ctx.max_seqlen = (mq, mk)
        ctx.softmax_scale = softmax_scale
        ctx.scalars = list(rest[:n])
        ctx.deterministic = bool((keyword_only_inputs or {}).get("deterministic", False))

    def grads(self, ctx, grad_o, grad_lse) -> tuple:
        """dq, dk, dv and ``{param: gradient}`` of the saved forward (as the padded op's;
        ``RuntimeError`` for a replaced op)."""
        self.op._check_live()
        q, k, v, o, lse, cq, ck, *tensors = ctx.saved_tensors
        if grad_o is None:
            grad_o = torch.zeros_like(o)
        bwd = getattr(torch.ops.flashgen, backward_name(self.spec))
        args = (grad_o, q, k, v, o, lse, grad_lse, cq, ck, *ctx.max_seqlen, ctx.softmax_scale,
                ctx.deterministic, *ctx.scalars, *tensors)  # fmt: skip
        return run_backward_op(self.spec, bwd, args, ctx.param_grads, tensors)

    def backward(self, ctx, grad_o, grad_lse):
        dq, dk, dv, dparams = self.grads(ctx, grad_o, grad_lse)
        tensor_grads = [dparams.get(p.name) for p in self.spec.tensor_params]
        return (dq, dk, dv, None, None, None, None, None, *([None] * len(ctx.scalars)),
                *tensor_grads)  # fmt: skip

    def schema(self) -> str:
        """The varlen backward op's schema (:func:`backward_schema` of this module)."""
        return backward_schema(self.spec)
