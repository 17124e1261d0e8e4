"""Tensor-param reads whose index may leave the tensor at a call's sizes.

The kernels clamp every tensor-param index into the declared extent (a read never leaves
the tensor), and the reference refuses an out-of-range index at a kept pair.  So a spec
whose index can pass its extent at some sizes computes with a clamped element on the GPU:
``w[h]`` on a ``[num_heads_kv]`` tensor under GQA reads ``w[num_heads_kv - 1]`` for every
head past the last KV head.  :func:`possible_violations` bounds each index by interval
arithmetic (:func:`flashgen.analysis.maskinfo.evaluate`, Cousot & Cousot's interval domain) over the
call's index ranges (``b < batch``, ``h < num_heads``, ``q_idx < seqlen_q``, ``kv_idx <
seqlen_k``) and scalar param values, and names the reads that may leave their tensor.  The
bound is sound but not tight: an index guarded by a condition (``q_idx < 5 ? t[q_idx] :
0.0``) is bounded without the condition, and an index that reads a tensor (``t[ids[b]]``)
is unknown and not reported.  The op warns (:class:`IndexBoundsWarning`), once per op and
sizes.  :func:`all_reads_inside` is the converse question (every read proven inside, none
unknown): where it is not, the CPU ``with_kvcache`` appends only after the reference ran.
"""

from __future__ import annotations

import math

from flashgen.analysis.maskinfo import Range, evaluate
from flashgen.frontend import ir
from flashgen.frontend.ir import Expr, Index, Spec, Ty


class IndexBoundsWarning(RuntimeWarning):
    """A tensor-param index may leave its tensor at these sizes (the kernels clamp it)."""


def _reads(e: Expr | None):
    return [n for n in ir.walk(e) if isinstance(n, Index)] if e is not None else []


def _extent(dim, sym: dict[str, int]) -> int:
    return dim if isinstance(dim, int) else sym[dim]


def _bounds(spec: Spec, sym: dict[str, int], scalars: dict):
    """``(read, subscript, Range, extent, declared extent)`` for each tensor-param subscript of
    ``spec``'s mask and score_mod (once per subscript), bounded at these sizes; nothing when
    nothing runs."""
    if min(sym["batch"], sym["num_heads"], sym["seqlen_q"], sym["seqlen_k"]) <= 0:
        return  # nothing runs
    env = {
        "b": Range(0, sym["batch"] - 1),
        "h": Range(0, sym["num_heads"] - 1),
        # the KV head query head h reads (num_heads_kv divides num_heads; h itself without GQA)
        "h_kv": Range(0, sym.get("num_heads_kv", sym["num_heads"]) - 1),
        "q_idx": Range(0, sym["seqlen_q"] - 1),
        "kv_idx": Range(0, sym["seqlen_k"] - 1),
        "seqlen_q": Range.exact(sym["seqlen_q"]),
        "seqlen_k": Range.exact(sym["seqlen_k"]),
        ir.SCORE_VAR: Range(-math.inf, math.inf),
    }
    for p in spec.scalar_params:
        env[p.name] = Range.exact(scalars.get(p.name, p.default))
    seen = set()
    for read in _reads(spec.mask) + _reads(spec.score_mod):
        param = spec.param(read.name)
        for i, ix in enumerate(read.indices):
            if ix.ty != Ty.I32 or (read.span, i) in seen:
                continue
            seen.add((read.span, i))
            yield read, i, evaluate(ix, env), _extent(param.shape[i], sym), param.shape[i]


def possible_violations(spec: Spec, sym: dict[str, int], scalars: dict) -> list[str]:
    """One line per tensor-param subscript of ``spec``'s mask and score_mod whose bound at
    these sizes leaves ``[0, extent)``.  ``sym``: the shape symbols' values (``batch``,
    ``num_heads``, ``num_heads_kv``, ``seqlen_q``, ``seqlen_k``, as
    :meth:`flashgen.ops.op.Dims.symbols` gives them); ``scalars``: scalar param values by name
    (spec defaults for missing ones).  Empty when every read stays inside."""
    out = []
    for read, i, r, n, declared in _bounds(spec, sym, scalars):
        if math.isinf(r.lo) or math.isinf(r.hi):
            continue  # data-dependent or unbounded: not decidable here
        if r.lo < 0 or r.hi > n - 1:
            out.append(
                f"{read.span}: {read.name}[...] subscript {i} ranges over "
                f"[{int(r.lo)}, {int(r.hi)}] at these sizes, but {read.name} has extent "
                f"{n} there (declared {declared}); the kernels clamp such reads into the tensor "
                "(the reference refuses them where the pair is kept)"
            )
    return out


def all_reads_inside(spec: Spec, sym: dict[str, int], scalars: dict) -> bool:
    """Whether every tensor-param subscript of ``spec`` is proven inside its extent at these
    sizes (:func:`possible_violations` reports none, and none is data-dependent, e.g.
    ``w[ids[b]]``, or unbounded): a call at these sizes cannot index outside a tensor."""
    return all(
        not (math.isinf(r.lo) or math.isinf(r.hi)) and 0 <= r.lo and r.hi <= n - 1
        for _, _, r, n, _ in _bounds(spec, sym, scalars)
    )
