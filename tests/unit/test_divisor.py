"""``fg::Divisor`` (templates/common/mma_sm80.cuh), the kernels' division by a kernel-invariant
integer (a DSL ``x / d`` or ``x % d`` with ``d`` a scalar param, hoisted by
:class:`flashgen.codegen.cuda_expr.Invariants`): checked against C's ``/`` and ``%`` (and 0 for a
zero divisor, like ``fg::idiv``) in a host program compiled with nvcc from the very header the
kernels include, over every divisor in [-1100, 1100], powers of two and their neighbours up to 2^31,
and dividends at the int32 edges, around multiples of the divisor and at random. ``div_nn`` /
``mod_nn`` (no sign handling) against the same where ``x >= 0`` and ``d >= 1``. Also: the lowering
hoists exactly the invariant divisors, and takes ``div_nn`` only where it proves both."""

from __future__ import annotations

import subprocess
from pathlib import Path

from flashgen.codegen.cuda_expr import Invariants, cuda_expr
from flashgen.frontend.spec import loads_spec

HEADER = Path(__file__).resolve().parents[2] / "templates" / "common" / "mma_sm80.cuh"

PROGRAM = r"""
#include "HEADER"
#include <climits>
#include <cstdio>
#include <vector>

static long long failures = 0;
static void check(int x, int d) {
    const fg::Divisor dv(d);
    const int q = d == 0 ? 0 : (int)((long long)x / d), r = d == 0 ? 0 : (int)((long long)x % d);
    if (dv.div(x) != q || dv.mod(x) != r) {
        if (failures++ < 20)
            printf("x %d d %d: div %d (want %d) mod %d (want %d)\n", x, d, dv.div(x), q,
                   dv.mod(x), r);
    }
    if (x >= 0 && d >= 1 && (dv.div_nn(x) != q || dv.mod_nn(x) != r)) {  // the proven case
        if (failures++ < 20)
            printf("x %d d %d: div_nn %d (want %d) mod_nn %d (want %d)\n", x, d, dv.div_nn(x),
                   q, dv.mod_nn(x), r);
    }
}

int main() {
    std::vector<int> divisors;
    for (int d = -1100; d <= 1100; ++d) divisors.push_back(d);
    for (int s = 10; s <= 31; ++s)
        for (long long e = -2; e <= 2; ++e) {
            const long long v = (1LL << s) + e;
            if (v <= INT_MAX) divisors.push_back((int)v);
            if (-v >= INT_MIN) divisors.push_back((int)-v);
        }
    divisors.push_back(INT_MAX);
    divisors.push_back(INT_MIN);
    unsigned long long state = 88172645463325252ULL;
    auto next = [&]() {
        state ^= state << 13; state ^= state >> 7; state ^= state << 17;
        return state;
    };
    for (int d : divisors) {
        for (int x = -2000; x <= 2000; ++x) check(x, d);
        const int edges[] = {INT_MAX, INT_MAX - 1, INT_MIN + 1, 1 << 30, -(1 << 30), 65535, 65536};
        for (int x : edges) check(x, d);
        if (d != 0 && d != INT_MIN) {
            const int ad = d < 0 ? -d : d;
            for (long long k = 1; k < 64; ++k) {  // around multiples of d, out to the int32 edge
                const long long m = (long long)ad * ((INT_MAX / ad) / k);
                for (long long e = -1; e <= 1; ++e) {
                    if (m + e <= INT_MAX) check((int)(m + e), d);
                    if (-(m + e) >= INT_MIN) check((int)-(m + e), d);
                }
            }
        }
        for (int i = 0; i < 2000; ++i) {
            const int x = (int)(unsigned)next();
            if (!(x == INT_MIN && d == -1)) check(x, d);  // C leaves INT_MIN / -1 undefined
        }
    }
    printf(failures ? "FAILED %lld\n" : "OK\n", failures);
    return failures != 0;
}
"""


def test_divisor_matches_c_division(host_exe):
    exe = host_exe(PROGRAM.replace("HEADER", str(HEADER)), "div", "-O2")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stdout[-3000:]


SPEC = """
name: hoist
head_dim: 64
dtype: bf16
mask: >-
  q_idx / chunk == kv_idx / chunk && q_idx % (chunk + 1) >= kv_idx % 7
  && q_idx / (kv_idx + 1) < 9
score_mod: score / cap + score / 2.0 + score / (score + 1.0) + slopes[h] / cap
params:
  chunk: {type: i32, default: 64}
  cap: {type: f32, default: 30.0}
  slopes: {type: f32, shape: [num_heads]}
"""


def test_invariant_divisors_are_hoisted_once():
    spec = loads_spec(SPEC)
    inv = Invariants()
    mask = cuda_expr(spec.mask, spec, inv)
    mod = cuda_expr(spec.score_mod, spec, inv)
    assert inv.decls == [
        "const fg::Divisor fg_inv0(p_chunk);",
        "const fg::Divisor fg_inv1((p_chunk + 1));",
        "const float fg_inv2(1.0f / p_cap);",
        "const float fg_inv3(1.0f / 2.0f);",
    ]
    assert "fg_inv0.div(q_idx) == fg_inv0.div(kv_idx)" in mask
    assert "fg_inv1.mod(q_idx)" in mask and "(kv_idx % 7)" in mask  # a constant stays C's %
    assert "fg::idiv(q_idx, (kv_idx + 1))" in mask  # not invariant: the run-time division
    assert "(score * fg_inv2)" in mod and "(score / (score + 1.0f))" in mod
    assert "(t_slopes[" in mod and "* fg_inv2)" in mod
    # without a collector, nothing is hoisted (plain C division)
    assert "fg::idiv(q_idx, p_chunk)" in cuda_expr(spec.mask, spec)


def test_compared_float_division_is_not_a_reciprocal():
    """``x * (1 / d)`` is within an ulp of ``x / d`` but not always equal (21 * (1 / 7.0f) is
    3.0000002): a float division whose value reaches a comparison stays a division, so a
    mask such as ``kv_idx >= q_idx / f`` keeps the pairs the reference keeps."""
    spec = loads_spec(
        "name: cmp\nhead_dim: 64\ndtype: bf16\n"
        "mask: kv_idx >= q_idx / f && q_idx / p == kv_idx / p\n"
        "score_mod: 'score / f + (q_idx / 7.0 == kv_idx ? score / f : 0.0)'\n"
        "params:\n  f: {type: f32, default: 7.0}\n  p: {type: i32, default: 4}\n"
    )
    inv = Invariants()
    mask = cuda_expr(spec.mask, spec, inv)
    mod = cuda_expr(spec.score_mod, spec, inv)
    assert "(kv_idx_f >= (q_idx_f / p_f))" in mask
    assert "fg_inv0.div(q_idx) == fg_inv0.div(kv_idx)" in mask  # exact: still hoisted
    assert "((q_idx_f / 7.0f) == kv_idx_f)" in mod  # compared: a division
    assert mod.count("(score * fg_inv1)") == 2  # not compared: the reciprocal
    assert inv.decls == ["const fg::Divisor fg_inv0(p_p);", "const float fg_inv1(1.0f / p_f);"]


def test_softmax_scale_folds_into_score_products():
    """With a raw logit in the kernel, ``score / d`` and ``c * score`` (d, c invariant) cost
    one multiply per element: softmax_scale is folded into the hoisted value.  A compared
    quotient and a product with a per-element factor keep the scaled ``score``."""
    spec = loads_spec(
        "name: fold\nhead_dim: 64\ndtype: bf16\n"
        "score_mod: 'cap * tanh(score / cap) + 2.0 * score + score * kv_idx"
        " + (score / cap > 1.0 ? 1.0 : 0.0)'\n"
        "params:\n  cap: {type: f32, default: 30.0}\n"
    )
    inv = Invariants(raw_score="score_raw")
    mod = cuda_expr(spec.score_mod, spec, inv)
    assert "fg::tanh_approx((score_raw * fg_inv0))" in mod
    assert "(score_raw * fg_inv1)" in mod
    assert "(score * kv_idx_f)" in mod  # not invariant: unchanged
    assert "((score / p_cap) > 1.0f)" in mod  # compared: the division of the scaled score
    assert inv.decls == [
        "const float fg_inv0(softmax_scale / p_cap);",
        "const float fg_inv1(softmax_scale * 2.0f);",
    ]
    # the backward (no raw logit) keeps the scaled score and the reciprocal
    plain = Invariants()
    assert "(score * fg_inv0)" in cuda_expr(spec.score_mod, spec, plain)


def test_proven_nonnegative_divisions_take_div_nn(monkeypatch):
    """With ``Invariants(nonneg_div=True)`` (the Hopper forward): ``kv_idx / chunk`` with
    ``chunk`` declared ``min: 1`` is ``div_nn``; a dividend that may be negative, a divisor
    that may be 0 or negative, or ``hopper_fwd.nonneg_div=False`` keep the signed ``div``."""
    spec = loads_spec(
        "name: nn\nhead_dim: 64\ndtype: bf16\n"
        "mask: (q_idx + seqlen_k - seqlen_q) / c == kv_idx / c && kv_idx % c < q_idx / w + 1\n"
        "params:\n  c: {type: i32, default: 64, min: 1}\n  w: {type: i32, default: 8}\n"
    )
    from plan_helpers import plan_forward

    from flashgen.build.render import render

    inv = Invariants(nonneg_div=True)
    mask = cuda_expr(spec.mask, spec, inv)
    assert "fg_inv0.div_nn(kv_idx)" in mask and "fg_inv0.mod_nn(kv_idx)" in mask
    assert "fg_inv0.div(((q_idx + seqlen_k) - seqlen_q))" in mask  # may be negative
    assert "fg_inv1.div(q_idx)" in mask  # w may be 0 or negative
    assert "_nn" not in cuda_expr(spec.mask, spec, Invariants())  # the default: off
    on = plan_forward(spec, "sm_90")
    off = plan_forward(spec, "sm_90", values={"hopper_fwd.nonneg_div": False})
    assert ".div_nn(kv_idx)" in render(on) and ".div_nn(" not in render(off)


def test_div_nn_proof_holds_by_brute_force():
    """Where the lowering proves ``x >= 0`` and ``d >= 1`` (``_nonneg_by_positive``), every
    call on small grids (seqlen_k < seqlen_q and >, params at and near their declared
    bounds) has them; and the cases it must not claim (a divisor with ``min: 0``, a
    dividend shifted by ``seqlen_k - seqlen_q`` or a negative offset, a product that may
    wrap in int32) keep the signed division."""
    import itertools

    from flashgen.analysis.maskinfo import Range, evaluate
    from flashgen.codegen.cuda_expr import _nonneg_by_positive
    from flashgen.frontend.ir import Binary, Ty, walk

    cases = [  # (mask, params, proven)
        ("kv_idx / c == 0", "c: {type: i32, default: 1, min: 0}", False),
        ("(q_idx + seqlen_k - seqlen_q) / c == 0", "c: {type: i32, default: 1, min: 1}", False),
        ("(q_idx - 3) / c == 0", "c: {type: i32, default: 1, min: 1}", False),
        ("(kv_idx - q_idx + seqlen_q) / c == 0", "c: {type: i32, default: 1, min: 1}", False),
        ("(kv_idx + c) / c == 0", "c: {type: i32, default: 1, min: 0}", False),
        ("q_idx * c / c == 0", "c: {type: i32, default: 1, min: 1, max: 100}", False),
        ("(kv_idx + c) / (c + 1) == 0", "c: {type: i32, default: 1, min: 0, max: 9}", False),
        ("kv_idx / (c + 1) == 0", "c: {type: i32, default: 1, min: 0, max: 1000}", True),
        ("max(q_idx - 3, 0) / c == 1", "c: {type: i32, default: 2, min: 2}", True),
        ("abs(q_idx - kv_idx) % c == 1", "c: {type: i32, default: 2, min: 1}", True),
        ("kv_idx / c == q_idx / c", "c: {type: i32, default: 2, min: 1}", True),
        ("kv_idx / (c - 1) == 0", "c: {type: i32, default: 2, min: 2, max: 9}", True),
    ]
    for mask, param, proven in cases:
        spec = loads_spec(
            f"name: nnb\nhead_dim: 64\ndtype: bf16\nmask: '{mask}'\nparams:\n  {param}\n"
        )
        (p,) = spec.scalar_params
        divs = [
            n for n in walk(spec.mask)
            if isinstance(n, Binary) and n.op in ("/", "%") and n.ty == Ty.I32
        ]  # fmt: skip
        claims = [_nonneg_by_positive(n, spec) for n in divs]
        assert any(claims) == proven, (mask, claims)
        lo = int(p.minimum)
        values = {lo, lo + 1, lo + 3} | ({int(p.maximum)} if p.maximum is not None else set())
        for n, claim in zip(divs, claims, strict=True):
            if not claim:
                continue
            for c, (sq, sk) in itertools.product(values, [(1, 1), (9, 3), (3, 9), (17, 17)]):
                for q, kv in itertools.product(range(sq), range(sk)):
                    env = {
                        "q_idx": Range.exact(q), "kv_idx": Range.exact(kv),
                        "seqlen_q": Range.exact(sq), "seqlen_k": Range.exact(sk),
                        p.name: Range.exact(c),
                    }  # fmt: skip
                    x, d = evaluate(n.lhs, env), evaluate(n.rhs, env)
                    assert x.lo >= 0 and d.lo >= 1, (mask, c, sq, sk, q, kv, x, d)
