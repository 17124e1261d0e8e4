"""Attention sinks (gpt-oss; a spec's ``sink:``): one logit per (batch, head) that joins
every row's softmax denominator and nothing else,

    o = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink - m)),

in the units of the scaled logits (not multiplied by ``softmax_scale``, not seen by the
score_mod or the mask).  The lse the ops return is the log-sum-exp of the keys alone, so
partial results (split-KV, :func:`flashgen.merge_attention`, ring attention) merge without
the sink, and the sink is applied once at the end: with ``o_keys`` the attention over the
keys alone, ``o = o_keys * sigmoid(lse - sink)`` (:func:`apply_sink`), since
``sum_j exp(s_j) / (sum_j exp(s_j) + exp(sink)) = sigmoid(lse - sink)``.  A row with nothing
to attend to (lse = -inf) gives o = 0.

Its gradient, by autograd through :func:`apply_sink`, is ``d sink = -sum over rows of p_sink *
rowsum(dO * O)`` with ``p_sink = sigmoid(sink - lse)``, and the keys' backward sees
``dO * (1 - p_sink)``: P rebuilt with the sink-inclusive normaliser.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from flashgen.analysis.derive import reads_param
from flashgen.frontend import ir
from flashgen.ops.cpu.reference import _as, _env, eval_expr

#: the indices of a sink that reads a tensor param as is (:attr:`SinkRead.subs`)
_DIRECT = {("h",), ("h_kv",), ("b", "h"), ("b", "h_kv")}


class SinkRead:
    """What :func:`sink_logits` and :func:`fused_sink_values` need of a spec's sink, worked
    out once (an op keeps one, so that a call walks no IR): the tensor param and indices of
    a direct read (``name``, ``subs``: ``sinks[h]``, ``sinks[h_kv]``, ``sinks[b, h]`` or
    ``sinks[b, h_kv]``; else None, None) and, on first use, the spec reduced to the params
    the sink reads (:attr:`read_spec`, for evaluating it).  ``ValueError`` for a spec
    without a sink."""

    __slots__ = ("spec", "name", "subs", "_read_spec")

    def __init__(self, spec: ir.Spec):
        if spec.sink is None:
            raise ValueError(f"spec {spec.name!r} has no sink")
        self.spec = spec
        self.name = self.subs = None
        e = spec.sink
        if isinstance(e, ir.Index) and all(isinstance(i, ir.Var) for i in e.indices):
            subs = tuple(i.name for i in e.indices)
            if subs in _DIRECT:
                self.name, self.subs = e.name, subs
        self._read_spec = None

    @property
    def read_spec(self) -> ir.Spec:
        """The spec with only the params its sink reads (:func:`reads_param`)."""
        if self._read_spec is None:
            spec = self.spec
            self._read_spec = replace(
                spec, params=tuple(p for p in spec.params if reads_param(spec.sink, p.name))
            )
        return self._read_spec

    def view(self, params: dict, heads_q: int, heads_kv: int, batch_offset: int = 0):
        """The sink as a view of its tensor, broadcastable to ``[batch, heads_q]``, when it is
        a direct read of a tensor in ``params`` (the common forms; the host time of a decode
        step counts), else None."""
        subs = self.subs
        if subs is None or ("b" in subs and batch_offset):
            return None
        t = params.get(self.name)
        if not isinstance(t, torch.Tensor):
            return None
        if "h_kv" in subs:
            t = t.repeat_interleave(heads_q // heads_kv, dim=-1)
        return t if len(subs) == 2 else t.view(1, heads_q)


def sink_logits(spec: ir.Spec, params: dict, *, batch: int, heads_q: int, heads_kv: int,
                device, dtype=torch.float32, batch_offset: int = 0,
                read: SinkRead | None = None) -> torch.Tensor:  # fmt: skip
    """``spec.sink`` for every (b, h): ``[batch, heads_q]`` in ``dtype`` (float32 or float64),
    differentiable in the params it reads (tensors, or 0-d scalar tensors, by name in
    ``params``; missing scalars take their default).  ``b`` counts from ``batch_offset``.
    ``read``: ``spec``'s :class:`SinkRead` where the caller keeps one (else made here).
    ``ValueError`` for a spec without a sink."""
    if read is None:
        read = SinkRead(spec)
    direct = read.view(params, heads_q, heads_kv, batch_offset)
    if direct is not None:  # sinks[h], sinks[b, h], ...: the tensor itself, no evaluation
        return direct.to(device, dtype).expand(batch, heads_q)
    spec = read.read_spec
    values = {}
    for p in spec.params:
        v = params.get(p.name, p.default)
        values[p.name] = v.to(device) if isinstance(v, torch.Tensor) else v
    env = _env(spec, batch, heads_q, 1, 1, values, device, dtype, batch_offset, Hkv=heads_kv)
    s = _as(eval_expr(spec.sink, env), ir.Ty.F32, env)
    return s.reshape(s.shape[:2] if s.dim() == 4 else ()).expand(batch, heads_q)


def fused_sink_values(read: SinkRead, params: dict, *, batch: int, heads_q: int,
                      heads_kv: int, device: torch.device) -> dict:  # fmt: skip
    """The fused-sink kernel arguments (``sink``, ``sink_sb``, ``sink_sh``: the kernel reads
    ``sink[b * sink_sb + h * sink_sh]``) for the spec of ``read`` and a call's ``params``.
    A float32 tensor on ``device`` that the sink reads as is (``sinks[h]`` of shape
    ``[heads_q]``, ``sinks[b, h]`` of ``[batch, heads_q]``) is passed itself with its own
    strides (a stride-0 batch for ``[h]``): no view, no copy, no IR walk; anything else
    goes through :func:`sink_logits` (float32 ``[batch, heads_q]`` on ``device``:
    :func:`sink_arg_values`), which raises what it raises for bad params."""
    subs = read.subs
    if subs == ("h",) or subs == ("b", "h"):
        t = params.get(read.name)
        if isinstance(t, torch.Tensor) and t.dtype is torch.float32 and t.device == device:
            if len(subs) == 1:
                if t.dim() == 1 and t.shape[0] == heads_q:
                    return {"sink": t, "sink_sb": 0, "sink_sh": t.stride(0)}
            elif t.dim() == 2 and t.shape[0] == batch and t.shape[1] == heads_q:
                sb, sh = t.stride()
                return {"sink": t, "sink_sb": sb, "sink_sh": sh}
    return sink_arg_values(sink_logits(read.spec, params, batch=batch, heads_q=heads_q,
                                       heads_kv=heads_kv, device=device, read=read))  # fmt: skip


def apply_sink(o: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """``o * sigmoid(lse - sink)``: the attention over the keys alone (``o``, ``lse``) with
    the sink joined to its denominator, in o's dtype (computed in lse's float32 / float64).

    ``o [..., S, Dv]`` with ``lse [..., S]``; ``sink`` one logit per head or per (batch,
    head), the spec param's own shape (``[H]``, ``[B, H]``; 0-d: one for all), applied to
    every row; or lse's rank, broadcastable to it (``[B, H, 1]``; per row ``[H, total_q]``
    for the varlen layout, whose o ``[total_q, H, Dv]`` goes in as ``o.transpose(0, 1)``).
    Differentiable in all three.  Raises :class:`OpInputError` naming the argument for one
    that is not a tensor or not floating-point, an lse whose shape is not o's without its
    last dim, and a sink whose shape fits none of these."""
    from flashgen.frontend.errors import OpInputError

    for name, t in (("o", o), ("lse", lse), ("sink", sink)):
        if not isinstance(t, torch.Tensor):
            raise OpInputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise OpInputError(
                f"{name}: expected a floating-point tensor (the sink is a logit, in the units "
                f"of the scaled scores), got dtype {t.dtype}"
            )
    if o.dim() < 1 or lse.shape != o.shape[:-1]:
        raise OpInputError(
            f"lse: expected shape {list(o.shape[:-1])} (o's without its last dim), got "
            f"{list(lse.shape)} (a varlen result, o [total_q, H, Dv] with lse [H, total_q]: "
            f"pass o.transpose(0, 1))"
        )
    s = sink if sink.dim() == lse.dim() else sink.reshape(*sink.shape, 1)
    try:
        ok = sink.dim() <= lse.dim() and torch.broadcast_shapes(s.shape, lse.shape) == lse.shape
    except RuntimeError:
        ok = False
    if not ok:
        raise OpInputError(
            f"sink: expected one logit per head or (batch, head) ([H], [B, H]) or a shape "
            f"broadcastable to lse {list(lse.shape)}, got {list(sink.shape)}"
        )
    scale = torch.sigmoid(lse - s.to(lse.dtype))
    return (o.to(lse.dtype) * scale.unsqueeze(-1)).to(o.dtype)


def varlen_rows(sink: torch.Tensor, cu_seqlens_q: torch.Tensor, total_q: int) -> torch.Tensor:
    """A varlen op's per-sequence sink ``[num_seqs, H]`` as ``[H, total_q]`` (the layout of
    its lse): row r takes its sequence's; rows past the last sequence take the last one's
    (their o is 0).  No host sync."""
    rows = torch.arange(total_q, device=cu_seqlens_q.device)
    seq = torch.searchsorted(cu_seqlens_q[1:].to(torch.int64), rows, right=True)
    seq = seq.clamp(max=max(sink.shape[0] - 1, 0)).to(sink.device)
    return sink[seq].transpose(0, 1)


def sink_arg_values(sink: torch.Tensor | None) -> dict:
    """The fused-sink kernel arguments (:func:`flashgen.codegen.abi.sink_args`) for the logits
    ``sink``: a float32 ``[B, Hq]`` tensor on the kernel's device (per sequence for varlen;
    any strides, a stride-0 broadcast included), read at ``b * sink_sb + h * sink_sh``; None:
    a null pointer (the keys alone).  Raises :class:`OpInputError` naming ``sink`` for another
    dtype or rank."""
    if sink is None:
        return {"sink": 0, "sink_sb": 0, "sink_sh": 0}
    if sink.dtype != torch.float32 or sink.dim() != 2:
        from flashgen.frontend.errors import OpInputError

        raise OpInputError(
            f"sink: expected float32 logits [batch, heads_q] for the kernel, got {sink.dtype} "
            f"{list(sink.shape)}"
        )
    sb, sh = sink.stride()
    return {"sink": sink, "sink_sb": sb, "sink_sh": sh}


def keys_backward_inputs(o, lse, rows, grad_o, grad_lse) -> tuple:
    """What the keys' backward kernels take for an output ``o`` with the sink joined (the fused
    forward's), and the sink's gradient: ``(dout, lse_arg, dlse, d_rows)``.

    ``o [..., S, Dv]`` (o's rows in lse's layout), ``lse [..., S]`` float32 (the keys' alone),
    ``rows`` the float32 sink logits broadcastable to lse (``[B, H, 1]``; varlen ``[H,
    total_q]``), ``grad_o`` like o or None (zero), ``grad_lse`` like lse or None.  With
    ``D = rowsum(dO * O)``: ``d_rows = -sum of sigmoid(sink - lse) * D`` summed to rows' shape
    (0 for a row with no key).  The keys' backward is the standard one with ``dsum = D``: for
    ``grad_lse`` None, P rebuilt against the sink-inclusive normaliser ``lse_arg =
    logaddexp(lse, sink)`` and ``dout = grad_o``; else (exact whatever the share) ``dout =
    grad_o * sigmoid(lse - sink)`` against the keys' ``lse_arg = lse`` with ``dlse =
    grad_lse``, whose row term ``sigmoid(lse - sink) * D - grad_lse`` is the same."""
    if grad_o is None:
        grad_o = torch.zeros_like(o)
    empty = lse == -math.inf  # no key: o = 0, and no share of the sink to differentiate
    zero = lse.new_zeros(())
    d = (grad_o.to(lse.dtype) * o.to(lse.dtype)).sum(-1)
    p_sink = torch.where(empty, zero, torch.sigmoid(rows - lse))
    d_rows = (-(p_sink * d)).sum_to_size(rows.shape)
    if grad_lse is None:
        return grad_o, torch.logaddexp(lse, rows), None, d_rows
    share = torch.where(empty, zero, torch.sigmoid(lse - rows))
    dout = (grad_o.to(lse.dtype) * share.unsqueeze(-1)).to(grad_o.dtype)
    return dout, lse, grad_lse, d_rows
