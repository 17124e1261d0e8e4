"""Autograd of the calls whose forward kernel joins the spec's sink (the fused sink:
``Options.fa2_fwd.fused_sink`` / ``hopper_fwd.fused_sink``; math in :mod:`flashgen.ops.sink`).

The kernel returns ``O = o_keys * sigmoid(lse - sink)`` and the keys' lse.  The backward is
the keys' backward with P rebuilt against the sink-inclusive normaliser ``logaddexp(lse,
sink)`` and the row term ``rowsum(dO * O)``, plus ``d sink = -sum over rows of sigmoid(sink -
lse) * rowsum(dO * O)`` (:mod:`flashgen.ops.sink`); autograd carries d sink from the logits to
the params the spec's ``sink:`` reads.  The gradients of q, k, v and of the params are those
of the unfused path (the keys' kernels, then :func:`~flashgen.ops.sink.apply_sink`).

- :class:`FusedSinkAttention` without a gradient of lse (the usual training step): one call
  of the backward op's sink form (``<name>__backward_sink``,
  :mod:`flashgen.ops.prefill.backward`), whose pre kernel computes the sink-inclusive lse and
  d sink beside ``rowsum(dO * O)``: no torch op over ``[B, H, S, D]``.
- with a gradient of lse, or when only the sink needs a gradient, and :class:`FusedSinkVarlen`
  always: :func:`flashgen.ops.sink.keys_backward_inputs` in torch turns ``(O, lse, sink, dO,
  dlse)`` into the inputs of the registered backward op (with dlse: ``dO * sigmoid(lse -
  sink)`` against the keys' lse, exact whatever the keys' share, which the kernels' one
  normaliser could not give without dividing by that share) and gives d sink.

:class:`FusedSinkAttention` is the padded op's node (:meth:`AttentionOp._forward
<flashgen.ops.prefill.attention.AttentionOp._forward>` with the logits), :class:`FusedSinkVarlen`
the varlen op's (:meth:`VarlenOp._launch_forward
<flashgen.ops.prefill.varlen.VarlenOp._launch_forward>`).  Imports no other op module but
:mod:`~flashgen.ops.prefill.backward` and :mod:`flashgen.ops.sink`.
"""

from __future__ import annotations

import torch

from flashgen.ops.prefill.backward import (
    backward_name,
    backward_sink_name,
    run_backward_op,
    tensor_param_grads,
)
from flashgen.ops.sink import keys_backward_inputs


def _keys_grads(ctx, n_inputs: int, dout, q, k, v, o, lse, dlse, tensors, layout: tuple):
    """dq, dk, dv and the tensor params' gradients (spec order) from one call of the op's
    backward op, or Nones where no input of the keys' backward wants a gradient.
    ``layout``: the arguments the backward op takes between ``dlse`` and ``softmax_scale``
    (the varlen op's offsets and lengths; none for the padded op)."""
    op = ctx.op
    tensor_params = op.spec.tensor_params
    if not _wants_keys_grads(ctx, n_inputs):
        return None, None, None, [None] * len(tensor_params)
    bwd = getattr(torch.ops.flashgen, backward_name(op.spec))
    args = (dout, q, k, v, o, lse, dlse, *layout, ctx.softmax_scale, ctx.deterministic,
            *ctx.scalars, *tensors)  # fmt: skip
    table = op.backward.held_table(getattr(ctx, "block_mask", None), q, ctx.deterministic,
                                   ctx.param_grads)  # fmt: skip
    dq, dk, dv, dparams = run_backward_op(op.spec, bwd, args, ctx.param_grads, tensors, table)
    return dq, dk, dv, [dparams.get(p.name) for p in tensor_params]


def _wants_keys_grads(ctx, n_inputs: int) -> bool:
    """Whether q, k, v (inputs ``n_inputs`` .. + 3 of the node) or a tensor param the
    score_mod reads need a gradient: the keys' backward runs."""
    return any(ctx.needs_input_grad[n_inputs : n_inputs + 3]) or bool(ctx.param_grads)


def _save(ctx, op, softmax_scale, scalars, deterministic, tensors) -> None:
    ctx.set_materialize_grads(False)  # dlse None when lse is not used: P against the sink's lse
    ctx.op, ctx.softmax_scale, ctx.deterministic = op, softmax_scale, deterministic
    ctx.scalars = list(scalars)
    ctx.param_grads = tensor_param_grads(op.spec, tensors)


class FusedSinkAttention(torch.autograd.Function):
    """A padded call's node: ``apply(op, dims, softmax_scale, scalars, block_mask,
    deterministic, (out,), q, k, v, sink, *tensors) -> (o, lse)``, ``sink`` float32 ``[B, Hq]``
    logits (a view of the param or computed from the params: its gradient flows back through
    them), ``tensors`` the tensor params in spec order, ``out`` o's tensor or None (out of
    autograd's sight, as in ``_EagerAttention``), ``block_mask`` the call's checked
    ``BlockMask`` or None (the backward takes the table it holds for its tiles).  o has the
    sink joined, lse is the keys'."""

    @staticmethod
    def forward(ctx, op, dims, softmax_scale, scalars, block_mask, deterministic, out, q, k, v,
                sink, *tensors):  # fmt: skip
        table = None if block_mask is None else block_mask.op_arg()
        o, lse = op._forward(q, k, v, dims, softmax_scale, scalars, op._tensor_map(tensors),
                             table, out=out[0], sink=sink.detach())  # fmt: skip
        _save(ctx, op, softmax_scale, scalars, deterministic, tensors)
        ctx.block_mask = block_mask
        ctx.save_for_backward(q, k, v, o, lse, sink, *tensors)
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        ctx.op._check_live()
        q, k, v, o, lse, sink, *tensors = ctx.saved_tensors
        if grad_lse is None and _wants_keys_grads(ctx, 7):  # the backward op's sink form
            op = ctx.op
            bwd = getattr(torch.ops.flashgen, backward_sink_name(op.spec))
            dout = torch.zeros_like(o) if grad_o is None else grad_o
            args = (dout, q, k, v, o, lse, sink, ctx.softmax_scale, ctx.deterministic,
                    *ctx.scalars, *tensors)  # fmt: skip
            table = op.backward.held_table(ctx.block_mask, q, ctx.deterministic,
                                           ctx.param_grads, sink=True)  # fmt: skip
            dq, dk, dv, dparams, d_sink = run_backward_op(op.spec, bwd, args, ctx.param_grads,
                                                          tensors, table)  # fmt: skip
            tensor_grads = [dparams.get(p.name) for p in op.spec.tensor_params]
            return (None,) * 7 + (dq, dk, dv, d_sink, *tensor_grads)
        dout, lse_arg, dlse, d_rows = keys_backward_inputs(o, lse, sink.unsqueeze(-1), grad_o,
                                                           grad_lse)  # fmt: skip
        dq, dk, dv, tensor_grads = _keys_grads(ctx, 7, dout, q, k, v, o, lse_arg, dlse, tensors,
                                               ())  # fmt: skip
        return (None,) * 7 + (dq, dk, dv, d_rows.squeeze(-1), *tensor_grads)


class FusedSinkVarlen(torch.autograd.Function):
    """A varlen call's node: ``apply(op, dims, softmax_scale, scalars, deterministic, q, k, v,
    cu_seqlens_q, cu_seqlens_k, sink, rows, *tensors) -> (o, lse)``: ``sink`` the kernel's
    float32 ``[num_seqs, Hq]`` logits (no gradient taken through it), ``rows`` the same per
    packed query row, float32 ``[Hq, total_q]`` (:func:`flashgen.ops.sink.varlen_rows`: the
    sink's gradient flows back through it), ``dims`` the call's
    :class:`~flashgen.ops.prefill.varlen.VarlenDims`."""

    @staticmethod
    def forward(ctx, op, dims, softmax_scale, scalars, deterministic, q, k, v, cq, ck, sink, rows,
                *tensors):  # fmt: skip
        o, lse = op._launch_forward(q, k, v, cq, ck, dims, softmax_scale, scalars,
                                    op._tensor_map(tensors), sink=sink)  # fmt: skip
        _save(ctx, op, softmax_scale, scalars, deterministic, tensors)
        ctx.max_seqlen = (dims.max_seqlen_q, dims.max_seqlen_k)
        ctx.save_for_backward(q, k, v, o, lse, cq, ck, rows, *tensors)
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        ctx.op._check_live()
        q, k, v, o, lse, cq, ck, rows, *tensors = ctx.saved_tensors
        g = None if grad_o is None else grad_o.transpose(0, 1)  # rows in lse's [Hq, total_q]
        dout, lse_arg, dlse, d_rows = keys_backward_inputs(o.transpose(0, 1), lse, rows, g,
                                                           grad_lse)  # fmt: skip
        dq, dk, dv, tensor_grads = _keys_grads(
            ctx, 5, dout.transpose(0, 1), q, k, v, o, lse_arg, dlse, tensors,
            (cq, ck, *ctx.max_seqlen),
        )  # fmt: skip
        return (None,) * 5 + (dq, dk, dv, None, None, None, d_rows, *tensor_grads)
