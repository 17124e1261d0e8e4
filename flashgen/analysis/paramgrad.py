"""How a backward kernel may accumulate a param's gradient: the reduction form of each
:class:`~flashgen.analysis.derive.ParamGradTerm`, from the index variables its subscripts
read.  Pure IR analysis (no torch, no CUDA text); the FA2-class and Hopper backward plans
key their dparam code on :func:`grad_plan`.

A dK/dV CTA owns one (batch, kv head, key block) and walks the query blocks of the query
heads of its GQA group; the forms say how many distinct elements its pairs touch, so the
sum over them can be reduced on chip (fp32 registers, warp shuffles, shared memory) before
one global atomic per element per CTA:

- ``cta``: the subscripts read only ``b``, ``h``, ``h_kv``, ``seqlen_q``, ``seqlen_k``,
  scalar params and constants (ALiBi's ``slopes[h]``, a per-(batch, head) bias): one
  element per query head of the CTA;
- ``key``: they read ``kv_idx`` but not ``q_idx`` (a per-key bias): one element per key of
  the CTA's block, fixed for the whole walk;
- ``query``: ``q_idx`` but not ``kv_idx``: one element per query row of each step;
- ``diagonal``: ``q_idx`` and ``kv_idx`` only through ``c * (q_idx - kv_idx)`` (T5's
  relative table, clamped or not): at most ``BLOCK_M + BLOCK_N - 1`` elements per step;
- ``general``: anything else: an atomic per (element, pair).
"""

from __future__ import annotations

from flashgen.analysis.affine import through_difference
from flashgen.analysis.derive import ParamGradTerm, param_grad_terms
from flashgen.frontend.ir import Expr, Spec, Var, walk

FORMS = ("cta", "key", "query", "diagonal", "general")


def _reads(e: Expr) -> set[str]:
    return {n.name for n in walk(e) if isinstance(n, Var)}


def reduction_form(term: ParamGradTerm, spec: Spec) -> str:
    """The reduction form (:data:`FORMS`, module docstring) of one term's subscripts; a
    scalar param's term (no subscripts) is ``cta``."""
    reads = set().union(*(_reads(i) for i in term.indices)) if term.indices else set()
    q, kv = "q_idx" in reads, "kv_idx" in reads
    if not q and not kv:
        return "cta"
    if kv and not q:
        return "key"
    if q and not kv:
        return "query"
    if all(through_difference(i, spec) for i in term.indices):
        return "diagonal"
    return "general"


def grad_plan(spec: Spec, names) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``((param, (form of each term, ...)), ...)`` for the params ``names`` (spec order)
    whose gradient a backward computes: hashable, part of a backward plan's key, so the
    dparam code is compiled in only when a param requires grad."""
    wanted = set(names)
    return tuple(
        (p.name, tuple(reduction_form(t, spec) for t in param_grad_terms(spec.score_mod, p.name)))
        for p in spec.params
        if p.name in wanted
    )
