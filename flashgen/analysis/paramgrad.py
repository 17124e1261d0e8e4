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

A ``cta`` term whose d score_mod / d param is affine in ``q_idx`` and ``kv_idx``
(:func:`affine_partial`: ALiBi's ``-(q_idx + seqlen_k - seqlen_q - kv_idx)``) can be summed
from three sums of dS per thread and step instead of the partial at every pair
(``hopper_bwd.dparam_affine``).
"""

from __future__ import annotations

from flashgen.analysis.affine import Linear, linear, through_difference
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


def affine_partial(term: ParamGradTerm, spec: Spec) -> Linear | None:
    """``{"q_idx": alpha, "kv_idx": beta, "1": gamma}`` (typed coefficients, None for 0) where
    ``term`` is a ``cta`` term whose partial is ``alpha * q_idx + beta * kv_idx + gamma`` with
    coefficients that read no pair index (:func:`flashgen.analysis.affine.linear`: constants,
    params, ``b``, ``h``, ``h_kv``, the lengths): constant over one (batch, query head) step
    of a dK/dV CTA, so the sum of ``dS * partial`` over a step's pairs is ``alpha * sum(dS *
    q_idx) + beta * sum(dS * kv_idx) + gamma * sum(dS)``; None for any other term (``abs``,
    ``min``, a comparison, ``score``, a read indexed by a position)."""
    if reduction_form(term, spec) != "cta":
        return None
    return linear(term.partial, spec)
