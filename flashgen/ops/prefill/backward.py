"""Backward pass of a flashgen op and its autograd registration.

For every spec, ``flashgen::<name>__backward(dout, q, k, v, o, lse, dlse, softmax_scale,
deterministic, *params) -> (dq, dk, dv)`` is registered beside the forward op, with

- a CUDA implementation with two kernel sets, both from ``templates/sm_80/bwd.cu.j2``
  (FA2 backward, Dao 2023, Algorithm 2).  P is recomputed from the saved lse and never
  stored, so memory stays O(B*H*S*D).

  * deterministic (the default): dsum = rowsum(dO * O); dK, dV with KV outer / Q inner,
    summed over the query heads of each GQA group in registers; dQ with Q outer / KV
    inner.  No kernel uses atomics: gradients are bitwise reproducible run to run.  7
    matmuls per (query block, key block) pair.
  * atomic dQ (FA2's own scheme): the dK/dV kernel also computes dS K for every pair and
    adds it into an fp32 ``dq_accum`` [B, Hq, Sq, D] with float atomics; a small kernel
    writes dq = softmax_scale * dq_accum.  5 matmuls per pair, plus the fp32 buffer
    (4 bytes per dq element).  dq is not bitwise reproducible (dk, dv still are).

  * Hopper (sm_90, ``templates/sm_90/bwd.cu.j2``): the atomic-dQ scheme with a dK/dV
    kernel on wgmma and TMA (FlashAttention-3's backward), for the specs
    :func:`~flashgen.families.hopper_bwd.eligible` accepts (head_dim == head_dim_v in
    64/128/256, a mask that reads no tensor, no varlen; 256 splits the head dim of dK, dV
    and dQ over the CTA's two warpgroups).

  :func:`backward_path` picks one per call: ``deterministic=True`` always runs the
  deterministic kernels; ``deterministic=False`` runs the Hopper kernels where eligible
  (unless the op's ``Options.atomic_dq`` is False or ``Options.family`` is ``fa2``), else the
  FA2-class atomic kernels when ``Options.atomic_dq`` is True, else the deterministic
  kernels;
- a CPU implementation: the blocked float32 backward of :mod:`flashgen.ops.cpu.attention`
  against the saved o and lse (the flag changes nothing there);
- a fake implementation, so ``torch.compile`` traces the backward too.

``deterministic`` reaches the backward through the forward schema's keyword-only
``bool deterministic=False`` argument (ignored by the forward impls), which
``setup_context`` receives as a keyword-only input and stores on the autograd ctx: a
schema argument works the same in eager mode, under ``torch.compile(fullgraph=True)`` and
in ``torch.library.opcheck`` (a thread-local or context variable would not be traced).

The forward op's ``register_autograd`` calls it.  A gradient of ``lse`` folds into the row
term: dS = P * (dP - (dsum - dlse)).

Block tables: a spec whose mask reads tensors has a keyword-only ``Tensor? block_mask=None``
in both backward schemas (:data:`BLOCK_MASK_ARG`), the block table for the dK/dV kernel's
own tiles (the Hopper backward under ``hopper_bwd.tensor_masks``; the FA2-class kernels read
none and ignore it) as the tile-carrying view the forward takes, checked the same way
(:func:`flashgen.ops.prefill.blockmask.table_for_tiles`) before anything is allocated or
launched.  When the forward got ``block_mask=bm``, its autograd node keeps ``bm``
(``ctx.block_mask``) and :meth:`Backward.held_table` passes the table ``bm`` holds for those
tiles, built by the pre-pass on the first backward and held from then on; without one, the
CUDA backward runs the pre-pass for its tiles in every call.

Param gradients: the backward op's keyword-only ``bool[] param_grads`` (one flag per spec
param, spec order; empty: none) asks for ``dparam[idx] = sum over (b, h, q_idx, kv_idx) of
dS * d score_mod / d param[idx]`` (:func:`flashgen.analysis.derive.param_grad_terms`); the
op returns them as its fourth output, a list with one tensor per flag set (the param's
shape, 0-d for a scalar).  Autograd sets a tensor param's flag when it requires grad; a
0-d scalar tensor that requires grad goes through :class:`ScalarParamGrad`
(:meth:`~flashgen.ops.prefill.attention.AttentionOp.attention`).  A param with no gradient (i32,
or read only by the mask: :func:`flashgen.analysis.derive.grad_refusal`) that requires grad
is refused when the forward is called (:class:`~flashgen.frontend.errors.OpInputError`
naming it), so no gradient is ever silently zero.  The CPU op computes them
(:mod:`flashgen.ops.cpu.attention`); on CUDA the dK/dV kernel of the backward compiles in
``dparam`` code (templates/common/dparam.j2, a unit of its own: the units of a backward that
needs no param gradient are unchanged): fp32 sums reduced across the CTA, then one atomic
add per element and CTA into a buffer the op zeroes (:func:`dparam_buffers`); under
``deterministic=True`` each CTA adds into its own row of a ``[CTAs, numel]`` buffer, one
thread in a fixed order, and the op sums the rows (``torch.sum``, a fixed order).

Sink form: for a padded spec with a ``sink:``, ``flashgen::<name>__backward_sink(dout, q, k,
v, o, lse, sink, softmax_scale, deterministic, *params, *, bool[] param_grads=[]) -> (dq, dk,
dv, dparams, dsink)`` is registered too (:func:`backward_sink_schema`): the backward of a
forward whose kernel joined the sink (``o = o_keys * sigmoid(lse - sink)``, ``lse`` the keys'
alone, ``sink`` the float32 ``[B, Hq]`` logits it read; the autograd node
:class:`~flashgen.ops.prefill.fused_sink.FusedSinkAttention`), with no gradient of lse.  On
CUDA the pre kernel of the units' sink form (:func:`flashgen.families.bwd_common.backward_abi`)
writes ``logaddexp(lse, sink)`` into a workspace the dK/dV and dQ kernels read as their lse
(the saved lse is not touched), keeps ``dsum = rowsum(dO * O)`` as the row term and gives
``dsink[b, h] = -sum over rows of sigmoid(sink - lse) * dsum``: one atomic add per row into a
zeroed float32 [B, Hq] under ``deterministic=False``, else a float32 [B, Hq, Sq] of the
rows' terms summed by ``torch.sum`` (a fixed order).  The CPU implementation does the same
math in torch (:func:`flashgen.ops.sink.keys_backward_inputs`) around the CPU backward.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings

import torch

from flashgen.analysis.derive import grad_refusal, reads_param
from flashgen.codegen.abi import needs_block_table
from flashgen.codegen.plan import TileConfig
from flashgen.families import registry
from flashgen.frontend.errors import OpInputError
from flashgen.frontend.ir import Spec
from flashgen.ops.calls import _kernel_aligned, current_stream_ptr, kernel_values
from flashgen.ops.sink import keys_backward_inputs, sink_arg_values
from flashgen.ops.validation import _SCHEMA_TYPE, target_for_device, validate
from flashgen.options import DEFAULT, Options


def uses_atomic_dq(deterministic: bool, options: Options = DEFAULT) -> bool:
    """Whether a CUDA backward with this ``deterministic`` flag may run the FA2-class
    atomic-dQ kernels: only for ``deterministic=False`` with ``options.atomic_dq`` True (the
    Hopper kernels take precedence where eligible, see :func:`backward_path`)."""
    return not deterministic and options.atomic_dq is True


#: The backward kernel sets :func:`backward_path` chooses between.
BACKWARD_PATHS = ("deterministic", "atomic", "hopper", "hopper_ordered")


def backward_path(
    spec: Spec, target: str, deterministic: bool, options: Options = DEFAULT,
    param_grads: tuple[str, ...] = (),
) -> str:  # fmt: skip
    """Which kernels a CUDA backward of ``spec`` on ``target`` runs: ``"deterministic"``
    (pre, dkdv, dq), ``"atomic"`` (the FA2-class atomic-dQ kernels), ``"hopper"`` (the
    wgmma dK/dV kernel with atomic dQ) or ``"hopper_ordered"`` (the same with dQ added in a
    fixed order, for ``deterministic=True`` under ``hopper_bwd.ordered_dq``):
    :func:`flashgen.families.registry.select` for the ``"bwd"`` call with ``options``
    (``options.atomic_dq``, ``options.family``, ``options.hopper_bwd``; ``param_grads``: the
    params whose gradients the kernels accumulate)."""
    route = registry.select(
        spec, target, "bwd", options, deterministic=deterministic, param_grads=param_grads
    )
    if route.family == "hopper_bwd":
        return "hopper_ordered" if route.ordered_dq else "hopper"
    return "atomic" if route.atomic_dq else "deterministic"


def backward_name(spec: Spec) -> str:
    return f"{spec.name}__backward"


#: The backward ops' keyword-only tail and outputs: dq, dk, dv and the requested param
#: gradients (module docstring).
BACKWARD_TAIL = "*, bool[] param_grads=[]) -> (Tensor, Tensor, Tensor, Tensor[])"

#: The keyword-only argument of the backward ops of a spec whose mask reads tensors: the
#: table a ``BlockMask`` holds for the dK/dV kernel's tiles, as the tile-carrying view of
#: :func:`flashgen.ops.prefill.blockmask.table_arg` (None: the pre-pass runs in the call).
BLOCK_MASK_ARG = "Tensor? block_mask=None"


def _tail(spec: Spec, tail: str) -> str:
    """``tail`` (:data:`BACKWARD_TAIL`, :data:`BACKWARD_SINK_TAIL`) with :data:`BLOCK_MASK_ARG`
    where ``spec``'s mask reads tensors."""
    if not needs_block_table(spec):
        return tail
    return tail.replace("param_grads=[])", f"param_grads=[], {BLOCK_MASK_ARG})", 1)


def backward_schema(spec: Spec) -> str:
    """Schema of the backward op, e.g. ``alibi__backward(Tensor dout, ..., float
    softmax_scale, bool deterministic, Tensor slopes, *, bool[] param_grads=[]) -> (Tensor,
    Tensor, Tensor, Tensor[])``; a spec whose mask reads tensors has ``Tensor? block_mask=None``
    after ``param_grads`` (:data:`BLOCK_MASK_ARG`)."""
    args = ", ".join(_schema_args(spec, "Tensor? dlse"))
    return f"{backward_name(spec)}({args}, {_tail(spec, BACKWARD_TAIL)}"


def _schema_args(spec: Spec, row_grad: str) -> list[str]:
    """The positional arguments of the padded backward ops, ``row_grad`` after ``lse``."""
    args = ["Tensor dout", "Tensor q", "Tensor k", "Tensor v", "Tensor o", "Tensor lse", row_grad,
            "float softmax_scale", "bool deterministic"]  # fmt: skip
    args += [f"{_SCHEMA_TYPE[p.ty]} {p.name}" for p in spec.scalar_params]
    args += [f"Tensor {p.name}" for p in spec.tensor_params]
    return args


def backward_sink_name(spec: Spec) -> str:
    return f"{spec.name}__backward_sink"


#: The sink form's keyword-only tail and outputs: those of :data:`BACKWARD_TAIL` and d sink.
BACKWARD_SINK_TAIL = "*, bool[] param_grads=[]) -> (Tensor, Tensor, Tensor, Tensor[], Tensor)"


def backward_sink_schema(spec: Spec) -> str:
    """Schema of the sink form of the backward op (module docstring), e.g.
    ``gpt_oss_sink__backward_sink(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor o, Tensor
    lse, Tensor sink, float softmax_scale, bool deterministic, Tensor sinks, *, bool[]
    param_grads=[]) -> (Tensor, Tensor, Tensor, Tensor[], Tensor)``: the backward op's
    arguments with ``Tensor sink`` (float32 [B, Hq] logits) in place of ``dlse``, and d sink
    (float32 [B, Hq]; float64 from the CPU op's float64 inputs) last."""
    args = ", ".join(_schema_args(spec, "Tensor sink"))
    return f"{backward_sink_name(spec)}({args}, {_tail(spec, BACKWARD_SINK_TAIL)}"


def _grads_like(q, k, v, fill_zero: bool):
    make = torch.zeros if fill_zero else torch.empty
    return tuple(make(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _memo(spec: Spec) -> dict:
    """The answers of :func:`wanted` and :func:`param_grad_flags` for ``spec``, by their
    arguments: both walk the spec's expressions (:func:`check_param_grad`,
    :func:`~flashgen.analysis.derive.reads_param`), 10 to 30 us of host time that every
    trained call paid in its forward and again in its backward.  Kept in the spec's instance
    ``__dict__``, as ``functools.cached_property`` keeps its values (a frozen dataclass; no
    field, so equality, hashing and ``dataclasses.replace`` ignore it); only answers, never
    a refusal, are kept."""
    memo = spec.__dict__.get("_param_grad_memo")
    if memo is None:
        memo = spec.__dict__["_param_grad_memo"] = {}
    return memo


def wanted(spec: Spec, param_grads) -> tuple[str, ...]:
    """The names whose flag is set in a backward op's ``param_grads`` (spec order; empty:
    none); ``OpInputError`` for a list of the wrong length or a param without a gradient.
    Worked out once per spec and flags (:func:`_memo`)."""
    if not param_grads:
        return ()
    key = ("wanted", *param_grads)
    memo = _memo(spec)
    hit = memo.get(key)
    if hit is not None:
        return hit
    if len(param_grads) != len(spec.params):
        raise OpInputError(
            f"param_grads: expected {len(spec.params)} flags (one per param of "
            f"{spec.name!r}, spec order), got {len(param_grads)}"
        )
    names = tuple(p.name for p, f in zip(spec.params, param_grads, strict=True) if f)
    for n in names:
        check_param_grad(spec, n)
    memo[key] = names
    return names


def check_param_grad(spec: Spec, name: str) -> None:
    """:class:`OpInputError` naming param ``name`` when it has no gradient
    (:func:`flashgen.analysis.derive.grad_refusal`)."""
    why = grad_refusal(spec, name)
    if why is not None:
        raise OpInputError(
            f"{name}: requires_grad is set, but in flashgen::{spec.name} {why}; pass "
            f"{name}.detach()"
        )


def param_grad_flags(spec: Spec, requires: dict) -> list[bool]:
    """The ``param_grads`` flags of a backward for the params named in ``requires`` (those
    whose input requires grad), each checked (:func:`check_param_grad`): set for those the
    score_mod reads (a param read only by the sink gets its gradient through
    :func:`flashgen.ops.sink.apply_sink`'s autograd).  Worked out once per spec and names
    (:func:`_memo`); a new list each call."""
    key = ("flags", *requires)
    memo = _memo(spec)
    hit = memo.get(key)
    if hit is None:
        for n in requires:
            check_param_grad(spec, n)
        flagged = [n for n in requires if reads_param(spec.score_mod, n)]
        hit = memo[key] = tuple(p.name in flagged for p in spec.params) if flagged else ()
    return list(hit)


def dparam_buffers(names, shapes: dict, rows: int, deterministic: bool, device) -> tuple:
    """``(values, finish)`` for the dparam code of a backward unit: ``values`` maps the
    kernel arguments ``dp_<name>`` / ``dps_<name>`` of each param in ``names`` to a zeroed
    fp32 buffer and its row stride, ``finish()`` returns the gradients shaped as ``shapes``
    (float32).  ``deterministic=False``: one buffer of the param's ``numel`` elements that
    every CTA adds into (atomics; row stride 0).  True: a ``[rows, numel]`` buffer, ``rows``
    the dK/dV kernel's CTAs, each adding into its own row in a fixed order (row stride
    ``numel``), summed over the rows by ``torch.sum`` (a fixed order): bitwise reproducible,
    ``rows * numel * 4`` bytes."""
    values, bufs = {}, []
    for n in names:
        shape = tuple(shapes[n])
        numel = math.prod(shape)
        size = (rows, numel) if deterministic else (numel,)
        buf = torch.zeros(size, dtype=torch.float32, device=device)
        values[f"dp_{n}"] = buf
        values[f"dps_{n}"] = numel if deterministic else 0
        bufs.append((buf, shape))

    def finish() -> list:
        return [(b.sum(0) if deterministic else b).view(shape) for b, shape in bufs]

    return values, finish


def param_shapes(names, tensors: dict) -> dict:
    """The gradient shape of each param in ``names``: its tensor's (``tensors`` by name), or
    ``()`` for a scalar."""
    return {n: tuple(tensors[n].shape) if n in tensors else () for n in names}


def tensor_param_grads(spec: Spec, tensors) -> list[bool]:
    """:func:`param_grad_flags` for the op's tensor-param inputs ``tensors``
    (``spec.tensor_params`` order) that require grad."""
    req = {
        p.name: True
        for p, t in zip(spec.tensor_params, tensors, strict=True)
        if isinstance(t, torch.Tensor) and t.requires_grad
    }
    return param_grad_flags(spec, req)


def run_backward_op(spec: Spec, bwd, args: tuple, param_grads, tensors, table=None) -> tuple:
    """``(dq, dk, dv, {param: gradient}, *rest)`` from one call of the backward op ``bwd`` on
    ``args`` (``param_grads``: the flags of :func:`param_grad_flags`, empty: no dparam unit;
    ``tensors``: the call's tensor params in spec order; ``rest``: the op's outputs after
    the param gradients, none for the backward op, d sink for its sink form; ``table``: its
    ``block_mask`` argument, :meth:`Backward.held_table`, or None).  Under
    ``create_graph=True`` (grad mode on in a backward) the gradients come out
    differentiable, and differentiating them
    raises ``NotImplementedError`` (:class:`NoDoubleBackward`): there are no double-backward
    kernels, and torch's fallback would return zeros silently."""
    graph = torch.is_grad_enabled()
    kw = {} if table is None else {"block_mask": table}
    with torch.no_grad() if graph else contextlib.nullcontext():
        if not param_grads:
            dq, dk, dv, _, *rest = bwd(*args, **kw)
            dparams = {}
        else:
            dq, dk, dv, raw, *rest = bwd(*args, param_grads=param_grads, **kw)
            named = {p.name: t for p, t in zip(spec.tensor_params, tensors, strict=True)}
            dparams = param_grad_outputs(spec, param_grads, raw, named)
    if not graph:
        return dq, dk, dv, dparams, *rest
    inputs = [t for t in args if isinstance(t, torch.Tensor) and t.requires_grad]
    inputs += [t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad]
    if not inputs:
        return dq, dk, dv, dparams, *rest
    names = list(dparams)
    outs = NoDoubleBackward.apply(spec.name, len(inputs), *inputs, dq, dk, dv,
                                  *(dparams[n] for n in names), *rest)  # fmt: skip
    n = 3 + len(names)
    return (outs[0], outs[1], outs[2], dict(zip(names, outs[3:n], strict=True)),
            *outs[n:])  # fmt: skip


def table_tiles(plan) -> TileConfig | None:
    """The tiles a backward ``plan``'s dK/dV kernel reads a block table for (its BLOCK_M x
    BLOCK_N: ``hopper_bwd.tensor_masks``), or None where it reads none."""
    ctx = plan.dkdv.context
    if not ctx.get("block_table"):
        return None
    return TileConfig(ctx["block_m"], ctx["block_n"], plan.dkdv.tiles.num_warps)


def _cuda_call(q) -> bool:
    """Whether a backward of ``q`` runs the CUDA kernels (the only ones that read a table)."""
    return q.is_cuda


class NoDoubleBackward(torch.autograd.Function):
    """The gradients of a backward run with ``create_graph=True``, passed through unchanged
    but tied to the forward's inputs, so that a gradient of them (a gradient penalty, a
    Hessian-vector product) reaches :meth:`backward`, which raises ``NotImplementedError``
    naming the op, instead of torch's silent zeros."""

    @staticmethod
    def forward(ctx, name, n_inputs, *tensors):
        ctx.name = name
        return tuple(t.clone() for t in tensors[n_inputs:])

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"flashgen::{ctx.name}: no double backward (a gradient of its gradients: gradient "
            f"penalties, Hessian-vector products); differentiate a torch reference for those "
            f"terms, or detach the gradients before they enter the loss"
        )


def param_grad_outputs(spec: Spec, flags, dparams, inputs: dict) -> dict:
    """``{name: gradient}`` from a backward op's fourth output ``dparams`` (one tensor per
    set flag), each cast to the dtype of its input in ``inputs`` (by name)."""
    names = [p.name for p, f in zip(spec.params, flags, strict=False) if f]
    out = {}
    for n, g in zip(names, dparams, strict=True):
        t = inputs.get(n)
        out[n] = g.to(t.dtype) if isinstance(t, torch.Tensor) else g
    return out


class Backward:
    """The backward implementations of one :class:`~flashgen.ops.op.AttentionOp`."""

    def __init__(self, op):
        self.op = op
        self.spec = op.spec
        # (device index, backward_path), and the param names last for a unit that accumulates
        # param gradients (kernels() keeps the two-field key of the units without them)
        self._kernels: dict[tuple, tuple] = {}
        # (target, deterministic, param names) -> backward_path (:meth:`path`)
        self._paths: dict[tuple, str] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ op impls
    def fake(self, dout, q, k, v, o, lse, dlse, softmax_scale, deterministic, *rest,
             param_grads=(), block_mask=None):  # fmt: skip
        scalars, tensors = self.op._split(rest)
        return (*_grads_like(q, k, v, fill_zero=False),
                self._empty_param_grads(param_grads, tensors, q))  # fmt: skip

    def _empty_param_grads(self, param_grads, tensors: dict, q) -> list:
        """Uninitialized tensors shaped like the requested param gradients (fake impls)."""
        dt = torch.float64 if q.dtype == torch.float64 else torch.float32
        return [
            torch.empty(tuple(tensors[n].shape) if n in tensors else (), dtype=dt,
                        device=q.device)
            for n in wanted(self.spec, param_grads)
        ]  # fmt: skip

    def fake_sink(self, dout, q, k, v, o, lse, sink, softmax_scale, deterministic, *rest,
                  param_grads=(), block_mask=None):  # fmt: skip
        dq, dk, dv, dparams = self.fake(dout, q, k, v, o, lse, None, softmax_scale,
                                        deterministic, *rest, param_grads=param_grads)  # fmt: skip
        dt = torch.float64 if q.dtype == torch.float64 else torch.float32
        return dq, dk, dv, dparams, torch.empty(tuple(lse.shape[:2]), dtype=dt, device=q.device)

    def cpu_sink(self, dout, q, k, v, o, lse, sink, softmax_scale, deterministic, *rest,
                 param_grads=(), block_mask=None):  # fmt: skip
        """The sink form on the CPU (module docstring): the sink's math in torch
        (:func:`flashgen.ops.sink.keys_backward_inputs`: P against ``logaddexp(lse, sink)``,
        d sink from ``rowsum(dO * O)``) around :meth:`cpu`; d sink ``[B, Hq]`` in lse's dtype
        (float64 for float64 inputs).  ``OpInputError`` naming ``sink`` for a shape that is
        not lse's ``[B, Hq]``."""
        if tuple(sink.shape) != tuple(lse.shape[:2]):
            raise OpInputError(
                f"sink: expected logits [batch, heads_q] = {list(lse.shape[:2])}, got "
                f"{list(sink.shape)}"
            )
        dout, lse_arg, _, d_rows = keys_backward_inputs(o, lse, sink.unsqueeze(-1), dout, None)
        dq, dk, dv, dparams = self.cpu(dout, q, k, v, o, lse_arg, None, softmax_scale,
                                       deterministic, *rest, param_grads=param_grads)  # fmt: skip
        return dq, dk, dv, dparams, d_rows.squeeze(-1).to(lse.dtype)

    def cpu(self, dout, q, k, v, o, lse, dlse, softmax_scale, deterministic, *rest,
            param_grads=(), block_mask=None):  # fmt: skip
        """The blocked CPU backward (:mod:`flashgen.ops.cpu.attention`: each query chunk's
        forward recomputed under autograd, P taken against the saved ``lse`` and the row
        term from the saved ``o``, as the kernels do); dq, dk, dv in the input dtype (the
        same for either ``deterministic``) and the requested param gradients (float32,
        float64 for float64 inputs).  ``block_mask`` is ignored (the mask is evaluated per
        pair), as by the CPU forward."""
        from flashgen.ops.cpu.attention import attention_blocked_backward, cpu_params

        scalars, tensors = self.op._split(rest)
        validate(self.spec, q, k, v, tensors)
        names = wanted(self.spec, param_grads)
        params = cpu_params(self.spec, scalars, tensors, q.dtype)
        dq, dk, dv, dparams = attention_blocked_backward(
            self.spec, dout, q, k, v, dlse, softmax_scale=softmax_scale, params=params, o=o,
            lse=lse, param_grads=names,
        )  # fmt: skip
        return dq, dk, dv, [dparams[n] for n in names]

    def cuda(self, dout, q, k, v, o, lse, dlse, softmax_scale, deterministic, *rest,
             param_grads=(), block_mask=None):  # fmt: skip
        """The backward kernels on the current stream of q's device: (pre, dkdv, dq), or
        (pre, dkdv with atomic dQ, convert) on the atomic and Hopper paths
        (:func:`backward_path`).

        dout [B, Hq, Sq, Dv], o like dout, lse / dlse float32 [B, Hq, Sq]; returns dq, dk,
        dv shaped and typed like q, k, v (contiguous).  The atomic path also allocates an
        fp32 [B, Hq, Sq, D] buffer (zeroed by the pre kernel, not by a memset).
        ``block_mask`` (a spec whose mask reads tensors): the block table for the dK/dV
        kernel's tiles (:meth:`held_table`), refused (:class:`OpInputError` naming it) before
        anything is allocated or launched unless built for those tiles and this call's sizes;
        None: a dK/dV kernel that reads a table gets one from the pre-pass, run in this call;
        a kernel that reads none ignores it."""
        return self._launch(dout, q, k, v, o, lse, dlse, softmax_scale, deterministic, rest,
                            param_grads, table=block_mask)[:4]  # fmt: skip

    def cuda_sink(self, dout, q, k, v, o, lse, sink, softmax_scale, deterministic, *rest,
                  param_grads=(), block_mask=None):  # fmt: skip
        """The sink form (module docstring) on the current stream of q's device: the units'
        sink form (:func:`flashgen.families.bwd_common.backward_abi`), launched as
        :meth:`cuda`'s.  ``o`` the fused forward's (the sink joined), ``lse`` its keys' alone
        (float32 [B, Hq, Sq], read only), ``sink`` float32 [B, Hq] logits (any strides);
        returns dq, dk, dv, the param gradients and d sink, float32 [B, Hq].  Allocates a
        float32 [B, Hq, Sq] lse workspace, and d sink's buffer: [B, Hq] zeroed
        (``deterministic=False``: atomic adds) or [B, Hq, Sq] (summed by ``torch.sum``).
        ``OpInputError`` naming ``sink`` for another dtype or shape."""
        return self._launch(dout, q, k, v, o, lse, None, softmax_scale, deterministic, rest,
                            param_grads, sink=sink, table=block_mask)  # fmt: skip

    def _launch(self, dout, q, k, v, o, lse, dlse, softmax_scale, deterministic, rest,
                param_grads, sink=None, table=None) -> tuple:  # fmt: skip
        """:meth:`cuda` (``sink`` None) or :meth:`cuda_sink`: ``(dq, dk, dv, dparams,
        dsink)``, dsink None without ``sink``; ``table``: their ``block_mask`` argument."""
        scalars, tensors = self.op._split(rest)
        dims = validate(self.spec, q, k, v, tensors)
        names = wanted(self.spec, param_grads)
        shapes = param_shapes(names, tensors)
        if sink is not None and tuple(sink.shape) != (dims.batch, dims.heads_q):
            raise OpInputError(
                f"sink: expected float32 logits [batch, heads_q] = "
                f"{[dims.batch, dims.heads_q]}, got {list(sink.shape)}"
            )
        sink_values = sink_arg_values(sink) if sink is not None else {}
        if q.numel() == 0 or k.numel() == 0:  # no key: every row's term of d sink is 0
            dsink = None if sink is None else lse.new_zeros(dims.batch, dims.heads_q)
            return (*_grads_like(q, k, v, fill_zero=True),
                    [torch.zeros(shapes[n], dtype=torch.float32, device=q.device)
                     for n in names], dsink)  # fmt: skip
        plan, pre, dkdv, last = self._kernels_for(q.device, deterministic, names, sink is not None)
        tiles = table_tiles(plan)
        table_values = {}
        if tiles is not None:  # hopper_bwd.tensor_masks: the tile classes of the dK/dV kernel's
            # tiles (not the forward's): the held table, checked first, or the pre-pass's
            table_values = self.op._table_values(table, tiles, dims, scalars, tensors, q.device)
        atomic = plan.atomic_dq  # a "hopper" path whose kernels spill built the FA2-class ones
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        q, k, v, o, dout = (_kernel_aligned(t) for t in (q, k, v, o, dout))
        dq, dk, dv = _grads_like(q, k, v, fill_zero=False)
        dsum = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
        # fp32 dQ accumulator of the atomic path: contiguous [B, Hq, Sq (rounded up to the
        # plan's tiles in fragment order), D], zeroed by `pre`
        dq_accum = None
        if atomic:
            acc_shape = (*q.shape[:2], plan.dq_accum_seqlen(dims.seqlen_q), q.shape[3])
            dq_accum = torch.empty(acc_shape, dtype=torch.float32, device=q.device)
        # the ordered dQ's semaphores, one per (batch, query head, query block of the plan's
        # steps); under a residual mask also the key blocks' hulls, all ones until published
        dq_sem = dq_hull = None
        if plan.dkdv.context.get("ordered_dq"):
            m_blocks = -(-dims.seqlen_q // plan.tiles.dkdv_block_m)
            dq_sem = torch.zeros((dims.batch, dims.heads_q, m_blocks), dtype=torch.int32,
                                 device=q.device)  # fmt: skip
        if plan.dkdv.context.get("ordered_hull"):
            n_blocks = -(-dims.seqlen_k // plan.tiles.dkdv_block_n)
            dq_hull = torch.full((dims.batch, dims.heads_kv, n_blocks), -1, dtype=torch.int64,
                                 device=q.device)  # fmt: skip
        values = kernel_values(
            self.spec,
            {"q": q, "k": k, "v": v, "o": o, "dout": dout, "lse": lse, "dsum": dsum, "dq": dq,
             "dk": dk, "dv": dv, "dq_accum": dq_accum, "dq_sem": dq_sem, "dq_hull": dq_hull},
            dims, softmax_scale, scalars, tensors,
        )  # fmt: skip
        values.update(table_values)
        grids = plan.grids(dims.batch, dims.heads_q, dims.heads_kv, dims.seqlen_q, dims.seqlen_k)
        finish = None
        if names:  # the dK/dV kernel's CTAs, one row each under deterministic=True
            rows = grids["dkdv"][0] // plan.tiles.dkdv_dsplit
            extra, finish = dparam_buffers(names, shapes, rows, deterministic, q.device)
            values.update(extra)
        dsink = None
        if sink is not None:  # pre writes lse (sink joined) from lse_keys, and d sink's terms
            make = torch.empty if deterministic else torch.zeros
            dsink = make(lse.shape if deterministic else lse.shape[:2], dtype=torch.float32,
                         device=q.device)  # fmt: skip
            lse_arg = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
            values.update(sink_values, lse_keys=lse.contiguous(), lse=lse_arg, dsink=dsink,
                          dsink_rows=int(deterministic))  # fmt: skip
        stream = current_stream_ptr(q.device)
        pre.launch(grids["pre"], values, stream)
        if dlse is not None:
            dsum.sub_(dlse)
        dkdv.launch(grids["dkdv"], values, stream)
        last.launch(grids["convert" if atomic else "dq"], values, stream)
        if dsink is not None and deterministic:
            dsink = dsink.sum(-1)  # the rows' terms in a fixed order
        return dq, dk, dv, finish() if finish is not None else [], dsink

    def path(self, target: str, deterministic: bool, names: tuple[str, ...] = ()) -> str:
        """:func:`backward_path` of this op's spec and options for a call on ``target``
        (``names``: the params whose gradients it accumulates), worked out once per
        (target, deterministic, names): with param gradients the route derives their kernel
        forms (:func:`flashgen.codegen.dparam.hopper_forms_ok`), about 50 us of host time,
        which every trained call paid before its launches."""
        key = (target, bool(deterministic), tuple(names))
        hit = self._paths.get(key)
        if hit is None:
            hit = self._paths[key] = backward_path(
                self.spec, target, deterministic, self.op.options, key[2]
            )
        return hit

    def _kernels_for(
        self, device: torch.device, deterministic: bool, names: tuple, sink: bool
    ) -> tuple:
        """:meth:`kernels` of a call on ``device`` (:func:`backward_path` of its
        ``deterministic`` and param gradients ``names``; ``sink``: the sink form): what
        :meth:`_launch` runs and :meth:`held_table` builds a table for."""
        target = target_for_device(self.spec, device)
        path = self.path(target, deterministic, names)
        return self.kernels(device, path=path, param_grads=names, sink=sink)

    def held_table(self, block_mask, q, deterministic: bool, param_grads=(), sink: bool = False):
        """The ``block_mask`` argument of a backward op call on ``q``'s device whose forward
        was given ``block_mask`` (a checked :class:`~flashgen.ops.prefill.blockmask.BlockMask`,
        or None): the table it holds for the tiles of the dK/dV kernel that call runs
        (``deterministic``, ``param_grads``: the op's flags, ``sink``: its sink form), built by
        the pre-pass on the first such call (:meth:`AttentionOp._held_table_arg
        <flashgen.ops.prefill.attention_blockmask.BlockMaskMethods._held_table_arg>`).  None
        (the call runs the pre-pass itself, if its kernel reads a table) without
        ``block_mask``, for a kernel that reads no table, off CUDA (:func:`_cuda_call`: the CPU
        backward reads none) and under ``torch.compile`` tracing."""
        if (
            block_mask is None or not _cuda_call(q) or q.numel() == 0
            or torch.compiler.is_compiling()
        ):  # fmt: skip
            return None
        names = wanted(self.spec, param_grads)
        tiles = table_tiles(self._kernels_for(q.device, deterministic, names, sink)[0])
        return None if tiles is None else self.op._held_table_arg(block_mask, tiles)

    def kernels(self, device: torch.device, atomic_dq: bool = False, path: str | None = None,
                param_grads: tuple[str, ...] = (), sink: bool = False):  # fmt: skip
        """(BackwardPlan, pre, dkdv, dq) loaded on ``device`` -- (BackwardPlan, pre,
        dkdv_atomic, convert) for ``atomic_dq`` or a ``path`` (:data:`BACKWARD_PATHS`,
        overrides ``atomic_dq``) other than "deterministic" -- built and cached on first use.
        ``param_grads``: the params whose gradients the dK/dV kernel accumulates (their own
        unit); ``sink``: the units' sink form (their own units, ``"sink"`` last in the key)."""
        if path is None:
            path = "atomic" if atomic_dq else "deterministic"
        if path not in BACKWARD_PATHS:
            raise ValueError(f"unknown backward path {path!r}; known: {', '.join(BACKWARD_PATHS)}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        param_grads = tuple(param_grads)
        key = (index, path, param_grads) if param_grads else (index, path)
        if sink:
            key += ("sink",)
        hit = self._kernels.get(key)
        if hit is not None:
            return hit
        with self._lock:
            hit = self._kernels.get(key)
            if hit is None:
                from flashgen.families.build import build_backward
                from flashgen.runtime import launch as runtime

                target = target_for_device(self.spec, device)
                # "hopper" falls back to the FA2-class kernels if every Hopper variant spills:
                # the atomic ones where Options.atomic_dq allows them, else deterministic
                options = self.op.options
                atomic = path == "atomic" or (path == "hopper" and options.atomic_dq is True)
                hopper = path in ("hopper", "hopper_ordered")
                plan, cubin, _ = build_backward(
                    self.spec, target, atomic_dq=atomic, hopper=hopper,
                    ordered_dq=path == "hopper_ordered", options=options,
                    param_grads=param_grads, sink=sink,
                )  # fmt: skip
                if hopper and not plan.wgmma:
                    kind = "atomic-dQ" if plan.atomic_dq else "deterministic"
                    warnings.warn(
                        f"flashgen op {self.spec.name!r}: the Hopper (wgmma) backward spills "
                        f"registers on {target}; running the FA2-class "
                        f"{kind} backward kernels instead (correct, slower)",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                hit = (plan, *(runtime.load(cubin, kp, index) for kp in plan.kernels))
                self._kernels[key] = hit
        return hit

    # ------------------------------------------------------------------ autograd
    def setup_context(self, ctx, inputs, output, keyword_only_inputs=None):
        """Save what the backward needs; ``keyword_only_inputs`` carries the forward's
        ``deterministic`` flag (torch passes it because the schema has a kwarg-only arg)."""
        q, k, v, softmax_scale, *rest = inputs
        ctx.block_mask_input = needs_block_table(self.spec)  # last input; no gradient
        if ctx.block_mask_input:
            rest = rest[:-1]
        n = len(self.spec.scalar_params)
        tensors = rest[n:]
        ctx.param_grads = tensor_param_grads(self.spec, tensors)
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse, *tensors)
        ctx.softmax_scale = softmax_scale
        ctx.scalars = list(rest[:n])
        ctx.deterministic = bool((keyword_only_inputs or {}).get("deterministic", False))

    def grads(self, ctx, grad_o, grad_lse) -> tuple:
        """dq, dk, dv and ``{param: gradient}`` (the flags in ``ctx.param_grads``) of the
        saved forward: one call of the backward op.  ``RuntimeError`` if a reload of the
        edited spec replaced the op since its forward (that operator is the new spec's)."""
        self.op._check_live()
        q, k, v, o, lse, *tensors = ctx.saved_tensors
        if grad_o is None:
            grad_o = torch.zeros_like(o)
        bwd = getattr(torch.ops.flashgen, backward_name(self.spec))
        args = (grad_o, q, k, v, o, lse, grad_lse, ctx.softmax_scale, ctx.deterministic,
                *ctx.scalars, *tensors)  # fmt: skip
        table = self.held_table(getattr(ctx, "block_mask", None), q, ctx.deterministic,
                                ctx.param_grads)  # fmt: skip
        return run_backward_op(self.spec, bwd, args, ctx.param_grads, tensors, table)

    def backward(self, ctx, grad_o, grad_lse):
        dq, dk, dv, dparams = self.grads(ctx, grad_o, grad_lse)
        tensor_grads = [dparams.get(p.name) for p in self.spec.tensor_params]
        extra = [None] * int(ctx.block_mask_input)
        return (dq, dk, dv, None, *([None] * len(ctx.scalars)), *tensor_grads, *extra)

    def schema(self) -> str:
        """The backward op's schema (:func:`backward_schema`; the varlen form has its own)."""
        return backward_schema(self.spec)

    def has_sink_form(self) -> bool:
        """Whether :meth:`register` defines the sink form (module docstring): a padded spec
        with a sink (the varlen op keeps its torch path)."""
        return self.spec.sink is not None and not self.spec.varlen

    def register(self, lib) -> None:
        """Define the backward op (and, :meth:`has_sink_form`, its sink form) on ``lib`` and
        attach autograd to the forward op."""
        name = backward_name(self.spec)
        lib.define(self.schema())
        lib.impl(name, self.cuda, "CUDA")
        lib.impl(name, self.cpu, "CPU")
        torch.library.register_fake(f"flashgen::{name}", self.fake, lib=lib)
        if self.has_sink_form():
            name = backward_sink_name(self.spec)
            lib.define(backward_sink_schema(self.spec))
            lib.impl(name, self.cuda_sink, "CUDA")
            lib.impl(name, self.cpu_sink, "CPU")
            torch.library.register_fake(f"flashgen::{name}", self.fake_sink, lib=lib)
        torch.library.register_autograd(
            self.op.qualname, self.backward, setup_context=self.setup_context, lib=lib
        )


class ForwardOnly:
    """The autograd registration of an op without backward kernels (fp8_e4m3 specs: the FP8
    attention of FlashAttention-3 is an inference forward, and so is flashgen's): the forward
    runs on inputs that require grad, and ``backward`` raises ``NotImplementedError`` naming
    the op.  No ``<name>__backward`` op is registered."""

    def __init__(self, op):
        self.op = op
        self.spec = op.spec

    def setup_context(self, ctx, inputs, output, keyword_only_inputs=None):
        pass

    def backward(self, ctx, grad_o, grad_lse):
        raise NotImplementedError(
            f"flashgen::{self.spec.name}: dtype {self.spec.dtype} ops have no backward (the "
            f"FP8 kernel is forward only); run it under torch.no_grad() or on detached "
            f"inputs, and train with a bf16 / fp16 spec"
        )

    def register(self, lib) -> None:
        """Attach the raising autograd to the forward op on ``lib``."""
        torch.library.register_autograd(
            self.op.qualname, self.backward, setup_context=self.setup_context, lib=lib
        )
