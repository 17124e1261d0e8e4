"""Context parallelism: attention over a sequence split across the ranks of a process group.

:func:`ring_attention` runs any flashgen op on a sequence whose rows are spread over the
ranks of a ``torch.distributed`` group (NCCL on GPUs, gloo on CPUs).  Every rank holds
``S_local`` rows of q, k and v; the global length is ``world_size * S_local``.

Layouts (which global rows a rank holds, :func:`segments`):

- ``"contiguous"``: rank r holds rows ``[r * S_local, (r + 1) * S_local)``;
- ``"zigzag"`` (the default): the sequence is cut into ``2 * world_size`` chunks of
  ``S_local / 2`` rows and rank r holds chunks r and ``2 * world_size - 1 - r``, in that
  order (ring-flash-attention's zigzag, PyTorch context_parallel's head-tail layout), so
  under a causal mask every rank does the same work.

Modes:

- ``"ring"`` (Liu et al. 2023, Ring Attention; ring-flash-attention's schedule): K and V
  travel around the ring, one ``torch.distributed.batch_isend_irecv`` per step to the
  next rank while the current block computes; after ``world_size`` steps every query has
  met every key.  The backward sends K and V around again, with dK and dV (float32)
  accumulating as they travel, one step behind, and handed to their owner at the end.
- ``"allgather"``: K and V are gathered once (torch's context_parallel default); each of
  the rank's query chunks attends to the span of keys its mask can keep; the backward
  sums dK and dV over the ranks (reduce-scatter on NCCL, all-reduce elsewhere).

Each block is a call of the op's global-position form (:meth:`AttentionOp.offsets
<flashgen.ops.op.AttentionOp.offsets>`) with the block's ``q_offset`` / ``kv_offset``, so
masks and score_mods see global positions; a (query chunk, key chunk) pair whose mask is
empty at those offsets (the host's interval analysis,
:func:`flashgen.analysis.maskinfo.classify`: a causal chunk wholly in the future, a window
far behind) is never called, and inside a call the kernels skip the key blocks the mask
excludes.  Partial results merge by their log-sum-exp in float32
(:func:`flashgen.merge_attention`).  The backward of each block is the op's backward with
the merged ``o`` and ``lse`` (FA2's backward: P = exp(S - lse) against the global lse).

Tensor params: those declared with a ``seqlen_q`` dim are passed sharded like q (the
rank's rows, in the layout's order: :func:`shard_sequence`); those with a ``seqlen_k``
dim sharded like k and v, and they travel around the ring with K and V; other tensor
params are passed whole on every rank.  A tensor param with both dims is refused.

Param gradients: an f32 param that requires grad (a whole tensor, a q-sharded one, or a
0-d scalar tensor) gets its gradient: each block's backward returns its share
(:mod:`flashgen.ops.prefill.backward`), a q-sharded param's lands in this rank's rows, and the
shares of a whole param or a scalar are summed over the ranks (one all-reduce each).  A
k/v-sharded param that the score_mod reads and that requires grad is refused (its
gradient would have to travel back around the ring).  A spec's sink joins the merged
result once, at the end (:mod:`flashgen.ops.sink`).

Before any work the ranks exchange their shapes and arguments (one small all-gather), so
bad input -- ranks with different shapes, an odd ``S_local`` for zigzag, one rank
refusing its arguments -- raises :class:`~flashgen.frontend.errors.OpInputError` on
every rank instead of hanging in a later collective.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashgen.analysis.derive import reads_param
from flashgen.analysis.maskinfo import TileClass, classify
from flashgen.frontend import ir
from flashgen.frontend.errors import OpInputError
from flashgen.frontend.offsets import kv_sharded_params, q_sharded_params
from flashgen.ops.decode.op import merge_attention
from flashgen.ops.prefill.backward import backward_name, check_param_grad
from flashgen.ops.validation import (
    check_softmax_scale,
    default_softmax_scale,
    resolve_params,
    validate,
)

LAYOUTS = ("zigzag", "contiguous")
MODES = ("ring", "allgather")
_DTYPE_CODE = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_HEADER = (
    "ok", "batch", "heads_q", "S_local", "head_dim", "heads_kv", "k's S_local", "head_dim_v",
    "layout", "mode", "dtype", "op", "group", "requires_grad", "deterministic",
    "softmax_scale", "scalar params", "tensor params", "device",
)  # fmt: skip
_DEVICE_CODE = {"cpu": 1, "cuda": 2}


# ----------------------------------------------------------------------------- layouts
def segments(layout: str, rank: int, world_size: int, s_local: int) -> tuple[tuple, ...]:
    """The global rows rank ``rank`` holds: ``((local_start, length, global_start), ...)``
    in local order (module docstring).  ``ValueError`` for an unknown layout or an odd
    ``s_local`` under zigzag."""
    if layout == "contiguous":
        return ((0, s_local, rank * s_local),)
    if layout == "zigzag":
        if s_local % 2:
            raise ValueError(f"zigzag needs an even S_local, got {s_local}")
        c = s_local // 2
        return ((0, c, rank * c), (c, c, (2 * world_size - 1 - rank) * c))
    raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")


def shard_sequence(x, rank: int, world_size: int, *, dim: int = 2, layout: str = "zigzag"):
    """Rank ``rank``'s rows of a global tensor ``x`` along ``dim`` (q, k, v ``[B, H, S, D]``:
    dim 2; a ``[batch, seqlen]`` tensor param: dim 1) in ``layout`` (module docstring):
    a new contiguous tensor.  ``x.shape[dim]`` must be a multiple of ``world_size`` (zigzag:
    ``2 * world_size``); else :class:`OpInputError` naming the multiple.  ``world_size`` an
    int >= 1, ``rank`` an int in ``[0, world_size)``, ``dim`` one of x's dims, else
    :class:`OpInputError` naming the argument."""
    if not isinstance(x, torch.Tensor):
        raise OpInputError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise OpInputError(f"world_size: expected an int >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise OpInputError(
            f"rank: expected an int in [0, {world_size}) (world_size {world_size}), got {rank!r}"
        )
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise OpInputError(f"dim: expected one of x's {x.dim()} dims, got {dim!r}")
    if layout not in LAYOUTS:
        raise OpInputError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    n = x.shape[dim]
    mult = world_size * (2 if layout == "zigzag" else 1)
    if n % mult:
        raise OpInputError(
            f"x: expected a length along dim {dim} that is a multiple of {mult} "
            f"(world_size {world_size}{', two chunks per rank' if layout == 'zigzag' else ''}), "
            f"got {n}; pad the sequence"
        )
    segs = segments(layout, rank, world_size, n // world_size)
    return torch.cat([x.narrow(dim, g, ln) for _, ln, g in segs], dim=dim).contiguous()


def gather_sequence(x, *, group=None, dim: int = 2, layout: str = "zigzag"):
    """The inverse of :func:`shard_sequence` on every rank: all-gathers the ranks' shards
    of ``x`` (each ``S_local`` rows along ``dim``) and returns the global tensor in sequence
    order.  A collective: every rank of ``group`` must call it."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    del r
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    s = x.shape[dim]
    shape = list(x.shape)
    shape[dim] = n * s
    out = x.new_empty(shape)
    for j, part in enumerate(parts):
        for ls, ln, g in segments(layout, j, n, s):
            out.narrow(dim, g, ln).copy_(part.narrow(dim, ls, ln))
    return out


# ----------------------------------------------------------------------------- the plan
@dataclass
class _Plan:
    """What one ring_attention call fixes: the op's offsets form, the group, the layout."""

    op: object  # the offsets AttentionOp
    group: object
    rank: int
    world: int
    layout: str
    mode: str
    s_local: int
    scale: float
    deterministic: bool
    scalars: dict  # the spec's own scalar params by name
    q_tensors: dict  # tensor params sharded like q
    kv_tensors: dict  # tensor params sharded like k / v (travel with them)
    other_tensors: dict  # tensor params passed whole
    skip_ok: bool  # the host may skip pairs (mask reads neither b, h nor h_kv)
    grad_params: dict  # name -> the tensor (a tensor param or a 0-d scalar) that requires grad

    def param_grads(self) -> list[bool]:
        """The backward op's ``param_grads`` flags (the offsets spec's params)."""
        if not self.grad_params:
            return []
        return [p.name in self.grad_params for p in self.op.spec.params]

    @property
    def seqlen(self) -> int:
        return self.world * self.s_local

    def segs(self, rank: int) -> tuple[tuple, ...]:
        return segments(self.layout, rank, self.world, self.s_local)

    def pos(self, qseg, kseg) -> dict:
        return {
            "q_offset": qseg[2], "kv_offset": kseg[2],
            "seqlen_q_global": self.seqlen, "seqlen_k_global": self.seqlen,
        }  # fmt: skip

    def empty(self, qseg, kseg) -> bool:
        """Whether the mask keeps no pair of the q segment and the key segment (sound:
        False when unsure)."""
        spec = self.op.spec
        if spec.mask is None or not self.skip_ok or qseg[1] == 0 or kseg[1] == 0:
            return qseg[1] == 0 or kseg[1] == 0
        cls = classify(
            spec, (0, qseg[1] - 1), (0, kseg[1] - 1), b=0, h=0, seqlen_q=qseg[1],
            seqlen_k=kseg[1], params={**self.scalars, **self.pos(qseg, kseg)},
        )  # fmt: skip
        return cls == TileClass.EMPTY

    def params(self, qseg, kseg, kv_tensors: dict) -> dict:
        """The op params of the block (q segment, key segment): scalars, offsets, tensor
        params sliced to the segments (``kv_tensors``: the key owner's, in flight)."""
        spec = self.op.spec
        out = {**self.scalars, **self.pos(qseg, kseg), **self.other_tensors}
        for name, t in self.q_tensors.items():
            out[name] = t.narrow(spec.param(name).shape.index("seqlen_q"), qseg[0], qseg[1])
        for name, t in kv_tensors.items():
            out[name] = t.narrow(spec.param(name).shape.index("seqlen_k"), kseg[0], kseg[1])
        return out


def _reads_batch_or_head(spec: ir.Spec) -> bool:
    return spec.mask is not None and any(
        isinstance(n, ir.Var) and n.name in ("b", "h", "h_kv") for n in ir.walk(spec.mask)
    )


def _group_id(group) -> int:
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    return zlib.crc32(",".join(map(str, sorted(ranks))).encode())


def _plan(op, q, k, v, group, layout, mode, softmax_scale, deterministic, params) -> _Plan:
    """Check the call on this rank, exchange a header with the other ranks, and raise the
    same :class:`OpInputError` on every rank if any rank's input is bad or differs."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention needs torch.distributed (call init_process_group)")
    rank = dist.get_rank(group)
    if rank < 0:
        raise OpInputError(
            f"group: this process (global rank {dist.get_rank()}) is not a member of the group "
            f"(ranks {dist.get_process_group_ranks(group)})"
        )
    world = dist.get_world_size(group)
    error: Exception | None = None
    plan = None
    try:  # every local check in here: a rank that raises still joins the all-gather below
        if not hasattr(op, "offsets") or not hasattr(op, "spec"):
            raise OpInputError(
                f"op: expected a flashgen op (flashgen.load's AttentionOp), got "
                f"{type(op).__name__}"
            )
        if layout not in LAYOUTS:
            raise OpInputError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        if mode not in MODES:
            raise OpInputError(f"mode: expected one of {MODES}, got {mode!r}")
        off = op.offsets
        spec = off.spec
        both = set(q_sharded_params(spec)) & set(kv_sharded_params(spec))
        if both:
            raise OpInputError(
                f"{sorted(both)[0]}: a tensor param with both a seqlen_q and a seqlen_k dim "
                "cannot be sharded for ring_attention"
            )
        for name in ("q_offset", "kv_offset", "seqlen_q_global", "seqlen_k_global"):
            if name in params:
                raise OpInputError(f"{name}: ring_attention sets it per block; do not pass it")
        s_local = q.shape[2] if isinstance(q, torch.Tensor) and q.dim() == 4 else 0
        pos = {"q_offset": 0, "kv_offset": 0, "seqlen_q_global": world * s_local,
               "seqlen_k_global": world * s_local}  # fmt: skip
        scalar_grads: dict = {}
        scalars_l, tensors_l = resolve_params(spec, {**params, **pos}, scalar_grads)
        tmap = off._tensor_map(tensors_l)
        grad_params = dict(scalar_grads) if torch.is_grad_enabled() else {}
        if torch.is_grad_enabled():
            grad_params.update({n: t for n, t in tmap.items() if t.requires_grad})
        for n in grad_params:
            check_param_grad(spec, n)
            if n in kv_sharded_params(spec) and reads_param(spec.score_mod, n):
                raise OpInputError(
                    f"{n}: requires_grad is set, but ring_attention does not differentiate a "
                    "param sharded like k and v; pass it detached"
                )
        for name, t in (("q", q), ("k", k), ("v", v)):
            if isinstance(t, torch.Tensor) and t.device.type not in _DEVICE_CODE:
                raise OpInputError(
                    f"{name}: expected a tensor on cpu or cuda (ring_attention sends it to the "
                    f"other ranks), got device {t.device}"
                )
        dims = validate(spec, q, k, v, tmap)
        if dims.seqlen_k != dims.seqlen_q:
            raise OpInputError(
                f"k: expected S_local {dims.seqlen_q} (q's: every rank holds the same rows of "
                f"q, k and v), got {dims.seqlen_k}"
            )
        if not isinstance(deterministic, bool):
            raise OpInputError(f"deterministic: expected a bool, got {deterministic!r}")
        scale = check_softmax_scale(
            default_softmax_scale(spec) if softmax_scale is None else softmax_scale
        )
        own = {p.name for p in op.spec.scalar_params}
        names = [p.name for p in spec.scalar_params]
        qn, kn = set(q_sharded_params(spec)), set(kv_sharded_params(spec))
        plan = _Plan(
            op=off, group=group, rank=rank, world=world, layout=layout, mode=mode,
            s_local=s_local, scale=float(scale), deterministic=deterministic,
            scalars={n: s for n, s in zip(names, scalars_l, strict=True) if n in own},
            q_tensors={n: t for n, t in tmap.items() if n in qn},
            kv_tensors={n: t.contiguous() for n, t in tmap.items() if n in kn},
            other_tensors={n: t for n, t in tmap.items() if n not in qn | kn},
            skip_ok=not _reads_batch_or_head(spec),
            grad_params={n: t for n, t in grad_params.items() if reads_param(spec.score_mod, n)},
        )  # fmt: skip
    except Exception as e:  # noqa: BLE001 -- raised after the exchange, on every rank
        error = e
    header = _header(error is None, q, k, v, layout, mode, op, group, deterministic, plan)
    if dist.get_backend(group) != "nccl":
        device = torch.device("cpu")
    elif isinstance(q, torch.Tensor) and q.is_cuda:
        device = q.device
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    local = torch.tensor(header, dtype=torch.int64, device=device)
    rows = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(rows, local, group=group)
    table = [r.tolist() for r in rows]
    bad = [j for j, row in enumerate(table) if not row[0]]
    if bad:
        if error is not None:
            raise error
        raise OpInputError(
            f"ring_attention: rank(s) {bad} of the group refused their inputs (see the error "
            "raised there); nothing was computed"
        )
    for i, field in enumerate(_HEADER[1:], start=1):
        vals = [row[i] for row in table]
        if len(set(vals)) > 1:
            j = next(j for j, x in enumerate(vals) if x != vals[0])
            hint = ""
            if field in ("S_local", "k's S_local"):
                hint = (
                    f"; the global length is world_size * S_local, so pad the sequence to a "
                    f"multiple of {world * (2 if layout == 'zigzag' else 1)} and shard it evenly"
                )
            raise OpInputError(
                f"{_describe(field)}: expected the same value on every rank of the group, but "
                f"rank 0 has {_show(field, vals[0])} and rank {j} has {_show(field, vals[j])}"
                f"{hint}"
            )
    if layout == "zigzag" and plan.s_local % 2:
        raise OpInputError(
            f"q: layout='zigzag' needs an even S_local (two chunks of S_local / 2 per rank, "
            f"global length a multiple of 2 * world_size = {2 * world}), got S_local "
            f"{plan.s_local}; pad the sequence or use layout='contiguous'"
        )
    return plan


def _describe(field: str) -> str:
    return {"layout": "layout", "mode": "mode", "op": "op", "group": "group",
            "deterministic": "deterministic",
            "requires_grad": "q/k/v requires_grad (1) + a param requires_grad (2)",
            "dtype": "q.dtype", "softmax_scale": "softmax_scale", "device": "q.device's type",
            "scalar params": "params (the spec's scalar params)",
            "tensor params": "params (the spec's tensor params passed whole, their shapes "
                             "and values; the sharded ones' shapes)"}.get(
        field, f"q/k/v shape ({field})")  # fmt: skip


def _show(field: str, value: int):
    if field == "layout":
        return repr(LAYOUTS[value]) if 0 <= value < len(LAYOUTS) else "an unknown layout"
    if field == "mode":
        return repr(MODES[value]) if 0 <= value < len(MODES) else "an unknown mode"
    if field == "dtype":
        return next((str(d) for d, c in _DTYPE_CODE.items() if c == value), "another dtype")
    if field == "group":
        return f"a group with member hash {value}"
    if field == "device":
        return next((repr(d) for d, c in _DEVICE_CODE.items() if c == value), "another device")
    if field == "softmax_scale":
        return struct.unpack("<d", struct.pack("<q", value))[0]
    if field in ("scalar params", "tensor params"):
        return f"values with hash {value:#x}"
    return value


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _params_hashes(plan: _Plan | None) -> tuple[int, int]:
    """crc32 of the scalar params' values and of the tensor params (the whole ones' shapes,
    dtypes and bytes; the sharded ones' shapes and dtypes): what every rank must agree on."""
    if plan is None:
        return 0, 0
    scalars = repr(sorted((n, float(v) if not isinstance(v, torch.Tensor) else float(v.item()))
                          for n, v in plan.scalars.items()))  # fmt: skip
    h = zlib.crc32(scalars.encode())
    t = 0
    for kind, tensors in (("q", plan.q_tensors), ("kv", plan.kv_tensors),
                          ("whole", plan.other_tensors)):  # fmt: skip
        for name in sorted(tensors):
            x = tensors[name]
            t = zlib.crc32(f"{kind} {name} {list(x.shape)} {x.dtype}".encode(), t)
            if kind == "whole" and x.numel():  # one host read: the params every rank shares
                raw = x.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
                t = zlib.crc32(raw.numpy(), t)
    return h, t


def _header(ok, q, k, v, layout, mode, op, group, deterministic, plan=None) -> list[int]:
    def dims(t, n):
        return list(t.shape) if isinstance(t, torch.Tensor) and t.dim() == n else [-1] * n

    qd, kd, vd = dims(q, 4), dims(k, 4), dims(v, 4)
    grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)
    )  # under no_grad no backward follows: ranks must agree on that too
    param_grad = plan is not None and bool(plan.grad_params)
    grad = int(grad) + 2 * int(param_grad)  # a param's gradient is all-reduced: all or none
    return [
        int(ok), qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], vd[3],
        LAYOUTS.index(layout) if layout in LAYOUTS else -1,
        MODES.index(mode) if mode in MODES else -1,
        _DTYPE_CODE.get(getattr(q, "dtype", None), 0),
        zlib.crc32(str(getattr(op, "name", "")).encode()),
        _group_id(group), int(grad), int(bool(deterministic)),
        _float_bits(plan.scale) if plan is not None else 0, *_params_hashes(plan),
        _DEVICE_CODE.get(getattr(getattr(q, "device", None), "type", None), 0),
    ]  # fmt: skip


# ----------------------------------------------------------------------------- p2p
def _exchange(plan: _Plan, send: list, recv: list):
    """Post sends of ``send`` to the next rank and receives into ``recv`` from the previous
    one (one ``batch_isend_irecv``); returns the requests."""
    if plan.world == 1:
        for a, b in zip(send, recv, strict=True):
            b.copy_(a)
        return []
    nxt, prv = (plan.rank + 1) % plan.world, (plan.rank - 1) % plan.world
    if plan.group is not None:  # P2POp takes global ranks
        nxt, prv = dist.get_global_rank(plan.group, nxt), dist.get_global_rank(plan.group, prv)
    ops = [dist.P2POp(dist.isend, t, nxt, plan.group) for t in send]
    ops += [dist.P2POp(dist.irecv, t, prv, plan.group) for t in recv]
    return dist.batch_isend_irecv(ops)


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


# ----------------------------------------------------------------------------- blocks
def _forward_block(plan: _Plan, q, qseg, k, v, kseg, kv_tensors, o_acc, lse_acc) -> None:
    a, n = qseg[0], qseg[1]
    kb = k.narrow(2, kseg[0], kseg[1])
    vb = v.narrow(2, kseg[0], kseg[1])
    o, lse = plan.op.attention(
        q.narrow(2, a, n), kb, vb, softmax_scale=plan.scale, deterministic=plan.deterministic,
        apply_sink=False, **plan.params(qseg, kseg, kv_tensors),
    )  # fmt: skip
    oa, la = o_acc.narrow(2, a, n), lse_acc.narrow(2, a, n)
    mo, ml = merge_attention(oa, la, o.float(), lse)  # o_acc is float32
    oa.copy_(mo)
    la.copy_(ml)


def _backward_block(plan: _Plan, dout, q, o, lse, dlse, qseg, k, v, kseg, kv_tensors,
                    dq_acc, dk_acc, dv_acc, dp_acc) -> None:  # fmt: skip
    """Add the block's share of dq, dk, dv and of the param gradients (``dp_acc``, by
    name): the op's backward with the merged o and lse."""
    spec = plan.op.spec
    a, n = qseg[0], qseg[1]
    scalars, tensors = resolve_params(spec, plan.params(qseg, kseg, kv_tensors))
    bwd = getattr(torch.ops.flashgen, backward_name(spec))
    args = (
        dout.narrow(2, a, n), q.narrow(2, a, n), k.narrow(2, kseg[0], kseg[1]),
        v.narrow(2, kseg[0], kseg[1]), o.narrow(2, a, n), lse.narrow(2, a, n).contiguous(),
        None if dlse is None else dlse.narrow(2, a, n).contiguous(), plan.scale,
        plan.deterministic, *scalars, *tensors,
    )  # fmt: skip
    flags = plan.param_grads()
    dq, dk, dv, dps = bwd(*args, param_grads=flags) if flags else bwd(*args)
    dq_acc.narrow(2, a, n).add_(dq)
    dk_acc.narrow(2, kseg[0], kseg[1]).add_(dk)
    dv_acc.narrow(2, kseg[0], kseg[1]).add_(dv)
    names = [p.name for p, f in zip(spec.params, flags, strict=False) if f]
    for name, g in zip(names, dps, strict=True):
        acc = dp_acc[name]
        if name in plan.q_tensors:  # this block's rows of a q-sharded param
            acc = acc.narrow(spec.param(name).shape.index("seqlen_q"), a, n)
        acc.add_(g)


def _pairs(plan: _Plan, j: int):
    """(q segment, key segment of rank j) pairs whose mask is not empty."""
    return [
        (qs, ks)
        for qs in plan.segs(plan.rank)
        for ks in plan.segs(j)
        if not plan.empty(qs, ks)
    ]


def _outputs(plan: _Plan, q, v):
    b, hq, s, _ = q.shape
    o = torch.zeros((b, hq, s, v.shape[3]), dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq, s), float("-inf"), dtype=torch.float32, device=q.device)
    return o, lse


def _ring_forward(plan: _Plan, q, k, v):
    o_acc, lse_acc = _outputs(plan, q, v)
    names = list(plan.kv_tensors)
    kv = [k.contiguous(), v.contiguous(), *plan.kv_tensors.values()]
    for step in range(plan.world):
        j = (plan.rank - step) % plan.world
        reqs, nxt = [], None
        if step < plan.world - 1:
            nxt = [torch.empty_like(t) for t in kv]
            reqs = _exchange(plan, kv, nxt)
        tensors = dict(zip(names, kv[2:], strict=True))
        for qs, ks in _pairs(plan, j):
            _forward_block(plan, q, qs, kv[0], kv[1], ks, tensors, o_acc, lse_acc)
        _wait(reqs)
        if nxt is not None:
            kv = nxt
    return o_acc, lse_acc


def _param_accumulators(plan: _Plan, device) -> dict:
    """float32 zeros shaped like each param that requires grad (0-d for a scalar)."""
    return {
        n: torch.zeros(tuple(t.shape), dtype=torch.float32, device=device)
        for n, t in plan.grad_params.items()
    }


def _reduce_params(plan: _Plan, dp: dict) -> dict:
    """Sum the ranks' shares of each whole or scalar param's gradient (q-sharded ones are
    this rank's rows already)."""
    for n, g in dp.items():
        if n not in plan.q_tensors and plan.world > 1:
            dist.all_reduce(g, group=plan.group)
    return dp


def _ring_backward(plan: _Plan, dout, q, k, v, o, lse, dlse):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dp = _param_accumulators(plan, q.device)
    names = list(plan.kv_tensors)
    kv = [k.contiguous(), v.contiguous(), *plan.kv_tensors.values()]
    incoming, dkv_reqs = None, []
    for step in range(plan.world):
        j = (plan.rank - step) % plan.world
        reqs, nxt = [], None
        if step < plan.world - 1:
            nxt = [torch.empty_like(t) for t in kv]
            reqs = _exchange(plan, kv, nxt)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        tensors = dict(zip(names, kv[2:], strict=True))
        for qs, ks in _pairs(plan, j):
            _backward_block(plan, dout, q, o, lse, dlse, qs, kv[0], kv[1], ks, tensors, dq, dk,
                            dv, dp)  # fmt: skip
        if incoming is not None:  # dk, dv of block j from the ranks before this one
            _wait(dkv_reqs)
            dk += incoming[0]
            dv += incoming[1]
        incoming = [torch.empty_like(dk), torch.empty_like(dv)]
        dkv_reqs = _exchange(plan, [dk, dv], incoming)  # on to the next rank (last: the owner)
        _wait(reqs)
        if nxt is not None:
            kv = nxt
    _wait(dkv_reqs)
    return dq, incoming[0], incoming[1], _reduce_params(plan, dp)


def _gather_kv(plan: _Plan, t, dim: int):
    """The whole sequence of a K/V-sharded tensor, in sequence order along ``dim``."""
    return gather_sequence(t, group=plan.group, dim=dim, layout=plan.layout)


def _span(plan: _Plan, qseg) -> tuple[int, int]:
    """[first, last) global key rows the mask may keep for the q segment (whole chunks)."""
    chunks = [s for j in range(plan.world) for s in plan.segs(j)]
    live = [s for s in chunks if not plan.empty(qseg, s)]
    if not live:
        return 0, 0
    return min(s[2] for s in live), max(s[2] + s[1] for s in live)


def _allgather_full(plan: _Plan, k, v):
    fk, fv = _gather_kv(plan, k, 2), _gather_kv(plan, v, 2)
    spec = plan.op.spec
    full_t = {
        n: _gather_kv(plan, t, spec.param(n).shape.index("seqlen_k"))
        for n, t in plan.kv_tensors.items()
    }
    return fk, fv, full_t


def _allgather_forward(plan: _Plan, q, k, v):
    o_acc, lse_acc = _outputs(plan, q, v)
    fk, fv, full_t = _allgather_full(plan, k, v)
    for qs in plan.segs(plan.rank):
        k0, k1 = _span(plan, qs)
        if k1 > k0:
            _forward_block(plan, q, qs, fk, fv, (k0, k1 - k0, k0), full_t, o_acc, lse_acc)
    return o_acc, lse_acc


def _allgather_backward(plan: _Plan, dout, q, k, v, o, lse, dlse):
    fk, fv, full_t = _allgather_full(plan, k, v)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(fk.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(fv.shape, dtype=torch.float32, device=v.device)
    dp = _param_accumulators(plan, q.device)
    for qs in plan.segs(plan.rank):
        k0, k1 = _span(plan, qs)
        if k1 > k0:
            _backward_block(plan, dout, q, o, lse, dlse, qs, fk, fv, (k0, k1 - k0, k0), full_t,
                            dq, dk, dv, dp)  # fmt: skip
    dk, dv = _reduce_to_owner(plan, dk), _reduce_to_owner(plan, dv)
    return dq, dk, dv, _reduce_params(plan, dp)


def _reduce_to_owner(plan: _Plan, full):
    """Sum the ranks' ``full`` [B, H, L, D] gradients and return this rank's rows."""
    segs = plan.segs(plan.rank)
    if dist.get_backend(plan.group) == "nccl":
        stacked = torch.stack(
            [torch.cat([full.narrow(2, g, ln) for _, ln, g in plan.segs(j)], dim=2)
             for j in range(plan.world)]
        )  # fmt: skip
        out = torch.empty_like(stacked[0])
        dist.reduce_scatter_tensor(out, stacked, group=plan.group)
        return out
    dist.all_reduce(full, group=plan.group)
    return torch.cat([full.narrow(2, g, ln) for _, ln, g in segs], dim=2)


# ----------------------------------------------------------------------------- autograd
class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, q, k, v, *grad_params):
        # grad_params: plan.grad_params' tensors, inputs here only for their gradients
        fwd = _ring_forward if plan.mode == "ring" else _allgather_forward
        o, lse = fwd(plan, q, k, v)
        o = o.to(q.dtype)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, o, lse)
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        q, k, v, o, lse = ctx.saved_tensors
        plan = ctx.plan
        # before any collective: a reload of the edited spec replaced the op on every rank
        # that loaded it alike (its backward operator is the new spec's)
        plan.op._check_live()
        if grad_o is None:
            grad_o = torch.zeros_like(o)
        bwd = _ring_backward if plan.mode == "ring" else _allgather_backward
        dq, dk, dv, dp = bwd(plan, grad_o.contiguous(), q, k, v, o, lse, grad_lse)
        dparams = [dp[n].to(t.dtype) for n, t in plan.grad_params.items()]
        return None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *dparams


def ring_attention(
    op, q, k, v, *, group=None, layout: str = "zigzag", mode: str = "ring",
    softmax_scale: float | None = None, deterministic: bool = False, **params,
):  # fmt: skip
    """Attention of flashgen op ``op`` over a sequence sharded across ``group`` (module
    docstring): returns ``(o, lse)`` for this rank's rows, differentiable in q, k, v.

    q ``[B, Hq, S_local, D]``, k ``[B, Hkv, S_local, D]``, v ``[B, Hkv, S_local, Dv]`` as the
    op takes them (dtype, strides; GQA with Hkv < Hq is kept unexpanded), holding this
    rank's rows in ``layout`` (``"zigzag"`` or ``"contiguous"``; :func:`shard_sequence`
    cuts a global tensor so).  The global sequence is ``world_size * S_local`` rows; a
    length that does not divide must be padded (zigzag: to a multiple of
    ``2 * world_size``).  ``mode``: ``"ring"`` or ``"allgather"``.  ``group``: the process
    group (default: the world).  ``softmax_scale``, ``deterministic`` and ``params`` (the
    spec's params; tensor params sharded as the module docstring says) are as for
    :meth:`~flashgen.ops.op.AttentionOp.attention`; an f32 param that requires grad gets
    its gradient (module docstring).

    Returns o ``[B, Hq, S_local, Dv]`` in q's dtype and lse float32 ``[B, Hq, S_local]``
    (natural log), this rank's rows in the same layout.  A collective: every rank of the
    group must call it with the same shapes and arguments.

    Raises :class:`OpInputError` on every rank of the group when any rank's input is bad
    or the ranks disagree (shapes, dtype, layout, mode, op, group membership, whether q,
    k, v require grad, ``softmax_scale``, the params' values); a process outside ``group``
    gets it at once.  Every local check runs before the one exchange: a rank whose input
    raises anything (``op=None``, a scale that is no number) raises it there, and the
    others raise an :class:`OpInputError` saying that rank refused; none waits in a
    collective.
    """
    plan = _plan(op, q, k, v, group, layout, mode, softmax_scale, deterministic, params)
    o, lse = _RingAttention.apply(plan, q, k, v, *plan.grad_params.values())
    spec = plan.op.spec
    if spec.sink is None:
        return o, lse
    from flashgen.ops.sink import apply_sink, sink_logits

    sink = sink_logits(spec, params, batch=q.shape[0], heads_q=q.shape[1], heads_kv=k.shape[1],
                       device=q.device, dtype=lse.dtype)  # fmt: skip
    if sink.requires_grad and plan.world > 1:  # every rank's rows take the same sink
        sink = _SumGradOverRanks.apply(sink, plan)
    return apply_sink(o, lse, sink.unsqueeze(-1)), lse  # once, on the merged keys


class _SumGradOverRanks(torch.autograd.Function):
    """Identity whose backward sums the gradient over the ranks (a value every rank uses
    for its own rows, like a whole param: the sink logits)."""

    @staticmethod
    def forward(ctx, x, plan: _Plan):
        ctx.plan = plan
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.plan.group)
        return g, None
