"""Hypothesis strategies for well-typed flashgen DSL expressions and the specs around them.

Shared by ``tests/unit/test_fuzz.py`` (checker, lowering, rendering, nvcc, CPU op) and
``tests/gpu/test_fuzz_gpu.py`` (CUDA kernel vs the float64 reference).

Every generated expression is fully parenthesized text over the index variables, the
params of :data:`PARAMS`, literals, calls, ternaries and int/float mixing.  Two flavours:

* ``wild=True``: anything well-typed (``exp``, ``log``, ``sqrt``, int * int, float
  division ...): for the checker, lowering and rendering, never evaluated.
* ``wild=False`` ("tame"): what the numeric tests evaluate.  Ints are multiplied only
  by small constants and divided only by positive constants (no overflow, no division by
  zero); the float terms added to ``score`` are bounded (literals in [-2, 2], params,
  ``tanh``, ``min``/``max``/``abs``, ternaries), so score_mod stays finite and moderate.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache

from hypothesis import strategies as st

#: Params every fuzz spec declares (``slopes[h]``, ``kv_slopes[h_kv]`` and ``ids[b]`` are
#: always in bounds).
PARAMS = {
    "w": {"type": "i32", "default": 5},
    "c": {"type": "f32", "default": 1.5},
    "slopes": {"type": "f32", "shape": ["num_heads"]},
    "kv_slopes": {"type": "f32", "shape": ["num_heads_kv"]},
    "ids": {"type": "i32", "shape": ["batch"]},
}
INT_LEAVES = ("b", "h", "h_kv", "q_idx", "kv_idx", "seqlen_q", "seqlen_k", "w", "ids[b]")
FLOAT_LEAVES = ("c", "slopes[h]", "kv_slopes[h_kv]")
MAX_DEPTH = 3


def _paren(*parts: str) -> str:
    return "(" + "".join(parts) + ")"


def _folds_to(text: str, value: float) -> bool:
    """Whether the expression ``text`` is made of literals only and equals ``value`` (the
    checker refuses a divisor that folds to 0, such as ``((-3) + 2) + 1``)."""
    from flashgen.frontend.check import _constant
    from flashgen.frontend.parse import parse_expr

    return _constant(parse_expr(text)) == value


@cache
def expr(ty: str, depth: int, score: bool, wild: bool) -> st.SearchStrategy[str]:
    """Strategy for expression text of DSL type ``ty`` (``"i32"``, ``"f32"``, ``"bool"``).

    ``score``: ``score`` may appear (score_mod only).  ``depth``: nesting budget.
    Memoized, so the strategy graph has one node per (ty, depth, score, wild).
    """
    sub = lambda t: expr(t, depth - 1, score, wild)  # noqa: E731
    if ty == "i32":
        leaves = st.one_of(
            st.sampled_from(INT_LEAVES), st.integers(0, 64).map(str), st.just("(-3)")
        )
        if depth == 0:
            return leaves
        opts = [
            leaves,
            st.tuples(sub("i32"), st.sampled_from(["+", "-"]), sub("i32")).map(
                lambda x: _paren(x[0], f" {x[1]} ", x[2])
            ),
            st.tuples(sub("i32"), st.integers(-3, 4)).map(lambda x: _paren(x[0], f" * {x[1]}")),
            st.tuples(sub("i32"), st.sampled_from(["/", "%"]), st.integers(1, 7)).map(
                lambda x: _paren(x[0], f" {x[1]} {x[2]}")
            ),
            sub("i32").map(lambda a: f"abs({a})"),
            sub("i32").map(lambda a: _paren("-", a)),
            st.tuples(st.sampled_from(["min", "max"]), sub("i32"), sub("i32")).map(
                lambda x: f"{x[0]}({x[1]}, {x[2]})"
            ),
            st.tuples(sub("bool"), sub("i32"), sub("i32")).map(
                lambda x: _paren(x[0], " ? ", x[1], " : ", x[2])
            ),
        ]
        if wild:
            opts.append(
                st.tuples(sub("i32"), st.sampled_from(["*", "/", "%"]), sub("i32"))
                .filter(lambda x: x[1] == "*" or _folds_to(x[2], -1) is False)
                .map(lambda x: _paren(x[0], f" {x[1]} (", x[2], " + 1)"))
            )
        return st.one_of(opts)
    if ty == "f32":
        lits = st.floats(-2.0, 2.0, allow_nan=False, allow_infinity=False).map(
            lambda f: repr(round(f, 3)) if "." in repr(round(f, 3)) else f"{round(f, 3)}.0"
        )
        leaf_opts = [st.sampled_from(FLOAT_LEAVES), lits.map(lambda s: _paren(s))]
        if score:
            leaf_opts.append(st.just("score"))
        leaves = st.one_of(leaf_opts)
        if depth == 0:
            return leaves
        num = st.one_of(sub("f32"), sub("i32")) if wild else sub("f32")
        # tame: an int only enters float math squashed into [-1, 1]
        squashed = sub("i32").map(lambda a: f"tanh({a} * 0.01)")
        opts = [
            leaves,
            squashed,
            st.tuples(num, st.sampled_from(["+", "-", "*"]), num).map(
                lambda x: _paren(x[0], f" {x[1]} ", x[2])
            ),
            st.tuples(sub("f32"), st.sampled_from(["+", "-"]), squashed).map(
                lambda x: _paren(x[0], f" {x[1]} ", x[2])
            ),
            st.tuples(st.sampled_from(["tanh", "abs"]), num).map(lambda x: f"{x[0]}({x[1]})"),
            st.tuples(st.sampled_from(["min", "max"]), num, num).map(
                lambda x: f"{x[0]}({x[1]}, {x[2]})"
            ),
            st.tuples(sub("bool"), num, num).map(lambda x: _paren(x[0], " ? ", x[1], " : ", x[2])),
            sub("f32").map(lambda a: _paren("-", a)),
            # int/float mixing with a bounded result: compare, then pick floats
            st.tuples(sub("i32"), sub("f32"), sub("f32")).map(
                lambda x: _paren(x[0], " < 10.5 ? ", x[1], " : ", x[2])
            ),
        ]
        if wild:
            opts += [
                st.tuples(st.sampled_from(["exp", "log", "sqrt"]), num).map(
                    lambda x: f"{x[0]}({x[1]})"
                ),
                # a divisor is never a constant 0 (the checker rejects that by design)
                st.tuples(num, num)
                .filter(lambda x: _folds_to(x[1], -0.5) is False)
                .map(lambda x: _paren(x[0], " / (", x[1], " + 0.5)")),
                st.tuples(num, sub("f32"))
                .filter(lambda x: _folds_to(x[1], -0.5) is False)
                .map(lambda x: _paren(x[0], " % (", x[1], " + 0.5)")),
            ]
        return st.one_of(opts)
    # bool
    leaves = st.sampled_from(["causal", "true", "false", "(q_idx >= kv_idx)"])
    if depth == 0:
        return leaves
    num_pair = st.one_of(
        st.tuples(sub("i32"), sub("i32")),
        st.tuples(sub("f32"), sub("i32")),
        st.tuples(sub("i32"), sub("f32")),
    )
    return st.one_of(
        leaves,
        st.tuples(num_pair, st.sampled_from(["<", "<=", ">", ">=", "==", "!="])).map(
            lambda x: _paren(x[0][0], f" {x[1]} ", x[0][1])
        ),
        st.tuples(sub("bool"), st.sampled_from(["&&", "||", "==", "!="]), sub("bool")).map(
            lambda x: _paren(x[0], f" {x[1]} ", x[2])
        ),
        sub("bool").map(lambda a: _paren("!", a)),
        st.tuples(sub("bool"), sub("bool"), sub("bool")).map(
            lambda x: _paren(x[0], " ? ", x[1], " : ", x[2])
        ),
    )


def may_be_true(mask: str) -> bool:
    """False for a mask the checker refuses as never true (``false``, ``q_idx < 0`` ...)."""
    from flashgen.frontend.errors import SpecError
    from flashgen.frontend.spec import loads_spec

    try:
        loads_spec(spec_text(mask, None), "fuzz.yaml")
    except SpecError as e:
        return "mask is never true" not in str(e)
    return True


def masks(wild: bool = False) -> st.SearchStrategy[str]:
    """Bool expressions for ``mask``.

    Tame masks are OR-ed with ``kv_idx % 3 == 0`` so that at least a third of every row is
    kept (no test becomes vacuous through all-empty rows), unless it is AND-ed with causal,
    which keeps the diagonal's neighbourhood by construction.
    """
    m = expr("bool", MAX_DEPTH, False, wild)
    if wild:  # the checker refuses a mask it proves never true (e.g. `false && ...`)
        return m.filter(may_be_true)
    return st.tuples(m, st.booleans()).map(
        lambda x: (
            f"causal && ({x[0]} || kv_idx % 3 == 0 || q_idx + seqlen_k - seqlen_q == kv_idx)"
            if x[1]
            else f"{x[0]} || kv_idx % 3 == 0"
        )
    )


def score_mods(wild: bool = False) -> st.SearchStrategy[str]:
    """Float expressions for ``score_mod``; tame ones are ``score`` plus/times bounded terms."""
    f = expr("f32", MAX_DEPTH, True, wild)
    if wild:
        return st.one_of(f, expr("i32", MAX_DEPTH, True, wild))
    bounded = expr("f32", 2, False, False).map(lambda a: f"tanh({a})")
    return st.one_of(
        st.tuples(f, bounded).map(lambda x: f"score + tanh({x[0]}) * {x[1]}"),
        st.tuples(f, bounded).map(lambda x: f"score * (1.25 + {x[1]}) - tanh({x[0]})"),
        bounded.map(lambda b: f"score + 2.0 * {b}"),
    )


def spec_text(
    mask: str | None, score_mod: str | None, *, dtype: str = "fp16", head_dim: int = 64
) -> str:
    """A spec (YAML text) using ``mask``/``score_mod`` and :data:`PARAMS`, with a unique
    name derived from its content (so each expression gets its own op and kernel)."""
    doc = {
        "head_dim": head_dim,
        "dtype": dtype,
        "mask": mask,
        "score_mod": score_mod,
        "params": PARAMS,
    }
    digest = hashlib.sha1(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:12]
    return json.dumps({"name": f"fz_{digest}", **doc}, indent=1)


def specs(wild: bool = False, dtypes=("fp16",)) -> st.SearchStrategy[str]:
    """Spec texts with a random mask and/or score_mod (at least one of them)."""
    return (
        st.tuples(
            st.one_of(st.none(), masks(wild)),
            st.one_of(st.none(), score_mods(wild)),
            st.sampled_from(list(dtypes)),
        )
        .filter(lambda x: x[0] is not None or x[1] is not None)
        .map(lambda x: spec_text(x[0], x[1], dtype=x[2]))
    )
