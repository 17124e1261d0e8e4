"""flashgen/analysis/colbound.py and the Hopper forward's column bounds (``hopper_fwd.col_bound``).

Exhaustive CPU checks: for every shipped mask the bound applies to and random small user
masks of the bound forms, the per-row range keeps exactly the pairs the expression keeps
(brute force over small grids with the reference semantics, flashgen/ops/cpu/reference.py), and the
masked tile's arithmetic as the template writes it (the range's offsets clamped into
``[-1, BLOCK_N]``, 64-bit) keeps exactly those columns of every tile.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from plan_helpers import plan_forward

from flashgen.analysis import colbound
from flashgen.build.render import render
from flashgen.codegen.cuda_expr import cuda_expr, split_causal
from flashgen.frontend import ir
from flashgen.frontend.errors import SpecError
from flashgen.frontend.spec import load_spec, loads_spec
from flashgen.ops.cpu.reference import eval_expr

#: Options without the column bound.
NO_BOUND = {"hopper_fwd.col_bound": False}

REPO = Path(__file__).resolve().parents[2]
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
PARAMS = "params:\n  w: {type: i32, default: 4}\n  p: {type: i32, default: 2}\n"
#: w and p bounded so that more of the user bounds below are provably exact in int32
BOUNDED = (
    "params:\n  w: {type: i32, default: 0, min: -2, max: 0}\n"
    "  p: {type: i32, default: 0, min: -1, max: 1}\n"
)


def _spec(mask: str, score_mod: str | None = None, params: str = PARAMS):
    mod = f"score_mod: '{score_mod}'\n" if score_mod else ""
    text = f"name: cb\nhead_dim: 128\ndtype: bf16\nmask: '{mask}'\n{mod}{params}"
    return loads_spec(text, "cb.yaml")


def _param_values(spec, rng: random.Random, n: int) -> list[dict]:
    """``n`` param sets over each i32 param's declared range (all of int32 where undeclared):
    its ends, int32's extremes and small values where inside, and uniform draws."""
    out = []
    for _ in range(n):
        vals = {}
        for p in spec.scalar_params:
            lo = I32_MIN if p.minimum is None else int(p.minimum)
            hi = I32_MAX if p.maximum is None else int(p.maximum)
            picks = [lo, hi, lo + 1, hi - 1, -1, 0, 1, 3, I32_MIN, I32_MAX, rng.randint(lo, hi)]
            vals[p.name] = min(max(rng.choice(picks), lo), hi)
        out.append(vals)
    return out


def _env(sq: int, sk: int, params: dict, b: int = 1, h: int = 2) -> dict:
    env = {
        "__float__": torch.float32,
        "__device__": "cpu",
        "b": torch.tensor(b),
        "h": torch.tensor(h),
        "h_kv": torch.tensor(h),
        "q_idx": torch.arange(sq).view(sq, 1),
        "kv_idx": torch.arange(sk).view(1, sk),
        "seqlen_q": torch.tensor(sq),
        "seqlen_k": torch.tensor(sk),
    }
    env.update({k: torch.tensor(v) for k, v in params.items()})
    return env


def _linear_value(v: colbound.Linear, env: dict, sq: int) -> torch.Tensor:
    """``v`` per row, in int64 (the bound's 64-bit sum; each term as the reference evaluates
    it, wrapped like int32); ``sq``: the number of rows in ``env["q_idx"]``."""
    out = torch.full((sq, 1), v.const, dtype=torch.int64)
    for sign, t in v.terms:
        out = out + sign * eval_expr(t, env).to(torch.int64).expand(sq, 1)
    return out


def _range(bound: colbound.ColBound, env: dict, sq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the smallest and largest kv_idx the bounds keep (int64, [sq, 1])."""
    lo = torch.full((sq, 1), -(2**62), dtype=torch.int64)
    hi = torch.full((sq, 1), 2**62, dtype=torch.int64)
    for v in bound.lo:
        lo = torch.maximum(lo, _linear_value(v, env, sq))
    for v in bound.hi:
        hi = torch.minimum(hi, _linear_value(v, env, sq))
    return lo, hi


def _check(bound: colbound.ColBound, conj: ir.Expr, sq: int, sk: int, params: dict) -> None:
    env = _env(sq, sk, params)
    want = eval_expr(conj, env).expand(sq, sk)
    lo, hi = _range(bound, env, sq)
    kv = torch.arange(sk).view(1, sk)
    got = (kv >= lo) & (kv <= hi)
    assert torch.equal(got, want), (sq, sk, params)
    _check_tiles(lo, hi, want, sk)


def _check_tiles(lo: torch.Tensor, hi: torch.Tensor, want: torch.Tensor, sk: int) -> None:
    """The template's bound_range on every tile (BLOCK_N 32, the four lane column pairs): the
    offsets clamped as the kernel clamps them keep exactly ``want`` (with lim = seqlen_k - 1)."""
    block_n = 32
    for n0 in range(0, sk, block_n):
        for lane4 in range(4):
            col0 = n0 + 2 * lane4
            lim = sk - 1
            hi_off = torch.clamp(torch.minimum(hi, torch.tensor(lim)) - col0, min=-1)
            lo_off = torch.clamp(lo - col0, 0, block_n)
            assert int(hi_off.max()) < 2**31 and int(hi_off.min()) >= -1
            for j in range(block_n // 8):
                for e in range(2):
                    off = j * 8 + e
                    kv = col0 + off
                    if kv >= sk:
                        continue
                    keep = (lo_off[:, 0] <= off) & (off <= hi_off[:, 0])
                    assert torch.equal(keep, want[:, kv]), (n0, lane4, off)


def _check_points(bound, conj, sq: int, sk: int, qs, kvs, params: dict) -> None:
    """The bound keeps exactly the pairs the reference keeps at rows ``qs`` and columns
    ``kvs`` of sizes ``sq`` x ``sk`` (any int32 sizes: only those rows and columns)."""
    env = _env(1, 1, params)
    env.update(
        q_idx=torch.tensor(qs).view(-1, 1),
        kv_idx=torch.tensor(kvs).view(1, -1),
        seqlen_q=torch.tensor(sq),
        seqlen_k=torch.tensor(sk),
    )
    want = eval_expr(conj, env).expand(len(qs), len(kvs))
    lo, hi = _range(bound, env, len(qs))
    kv = env["kv_idx"]
    assert torch.equal((kv >= lo) & (kv <= hi), want), (sq, sk, qs, kvs, params)


#: int32 sizes up to the largest, with rows and columns at their ends
BIG = [(I32_MAX, I32_MAX), (I32_MAX, 5), (7, I32_MAX), (2**30 + 3, 3 * 2**29), (2**16, 2**31 - 2)]


def _points(n: int, rng: random.Random) -> list[int]:
    return sorted({0, 1 % n, n // 2, max(n - 2, 0), n - 1, rng.randrange(n)})


def _conjuncts(mask: ir.Expr) -> list[ir.Expr]:
    _, residual = split_causal(mask)
    out = []

    def flat(e):
        if isinstance(e, ir.Binary) and e.op == "&&":
            flat(e.lhs)
            flat(e.rhs)
        else:
            out.append(e)

    flat(residual)
    return out


def test_mistral_window_is_a_lower_bound_over_every_small_grid():
    spec = load_spec(REPO / "specs" / "mistral_swa.yaml")
    _, residual = split_causal(spec.mask)
    bound = colbound.extract(residual, spec)
    assert bound is not None and bound.rest is None and len(bound.lo) == 1 and not bound.hi
    windows = list(range(-3, 12)) + [I32_MAX, I32_MIN, I32_MIN + 1, I32_MAX - 1, 4096]
    for sq in range(1, 10):
        for sk in range(1, 41, 3):
            for w in windows:
                _check(bound, residual, sq, sk, {"window": w})


@pytest.mark.parametrize(
    "name", ["chunked_local", "document_mask", "prefix_lm", "causal_d128", "alibi", "t5_bias"]
)
def test_other_shipped_masks_have_no_column_bound(name):
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    _, residual = split_causal(spec.mask)
    assert colbound.extract(residual, spec) is None
    plan = plan_forward(spec, "sm_90")
    assert plan.context["col_bound"] is None
    assert "col_lo" not in render(plan)


ROW_EXPRS = [
    "q_idx",
    "q_idx + seqlen_k - seqlen_q",
    "q_idx - w",
    "w",
    "2 * q_idx - p",
    "q_idx / 3",
    "min(q_idx, p) + 1",
    "q_idx % 4 == 1 ? w : p",
    "-q_idx",
    "seqlen_k - 1 - q_idx",
    "h + q_idx",
]
FORMS = [
    "{a} - kv_idx < {b}",
    "{a} - kv_idx <= {b}",
    "kv_idx > {a}",
    "kv_idx >= {a}",
    "{a} < kv_idx",
    "{a} <= kv_idx",
    "kv_idx < {a}",
    "kv_idx <= {a}",
    "{a} > kv_idx",
    "{a} >= kv_idx",
    "kv_idx == {a}",
    "!(kv_idx < {a})",
    "!({a} - kv_idx >= {b})",
    "-kv_idx + {a} < {b}",
    "{a} - (kv_idx - {b}) > 0",
    "kv_idx + {b} < {a} + 3",
]


@pytest.mark.parametrize("params", [PARAMS, BOUNDED], ids=["any_int32", "bounded"])
def test_random_user_bounds_keep_exactly_what_the_expression_keeps(params):
    """Each user bound folds only where it provably keeps what its int32 comparison keeps,
    and where it folds it keeps exactly what the reference (int32 wrapping) keeps: on small
    grids and at rows and columns of int32 sizes up to 2^31 - 1, with params anywhere in
    their declared ranges (all of int32 for ``any_int32``)."""
    rng = random.Random(1234)
    cases = [(f, a, rng.choice(ROW_EXPRS)) for f in FORMS for a in ROW_EXPRS]
    checked = folded = 0
    for form, a, b in cases:
        mask = form.format(a=f"({a})", b=f"({b})")
        try:
            spec = _spec(mask, params=params)
        except SpecError:  # the checker refuses a mask that is never true (kv_idx < -q_idx)
            continue
        checked += 1
        bound = colbound.extract(spec.mask, spec)
        if bound is None:  # not provable: the kernels evaluate it per element, as the reference
            continue
        folded += 1
        assert bound.rest is None, mask
        for vals in _param_values(spec, rng, 6):
            for sq, sk in ((1, 1), (5, 17), (9, 40), (13, 7)):
                _check(bound, spec.mask, sq, sk, vals)
            for sq, sk in BIG:
                _check_points(bound, spec.mask, sq, sk, _points(sq, rng), _points(sk, rng), vals)
    assert checked > 0.9 * len(cases)
    # which fold (any int32 params): every form with a lone kv_idx on one side, and those
    # whose kv_idx side cannot wrap; bounded params fold more of the ``a - kv_idx`` forms
    assert folded >= (0.5 if params == PARAMS else 0.75) * checked, (folded, checked)
    assert folded < checked


@pytest.mark.parametrize(
    "mask, folds",
    [
        ("kv_idx <= q_idx + p", True),  # a lone row expression: its int32 value, whatever p
        ("q_idx - kv_idx < w", True),  # q_idx - kv_idx lies in (-2^31, 2^31)
        ("q_idx + seqlen_k - seqlen_q - kv_idx < w", True),  # the index/size pairs
        ("kv_idx - q_idx > p - w", True),  # p - w wraps, but as one row value
        ("w - kv_idx >= q_idx / 3 - p", False),  # w - kv_idx wraps at w near -2^31
        ("-q_idx - kv_idx < w", False),  # down to -2^32 + 4
        ("q_idx + 1 - kv_idx < w", True),
        ("q_idx + 2 - kv_idx > w", False),  # q_idx + 2 reaches 2^31
        ("kv_idx + w < 5", False),
        ("kv_idx + seqlen_q - seqlen_k < 5", True),  # kv_idx - seqlen_k in [-seqlen_k, -1]
        ("kv_idx + seqlen_q < 5", False),  # up to 2^32 - 3
    ],
)
def test_a_conjunct_folds_only_where_provably_exact(mask, folds):
    spec = _spec(mask)
    bound = colbound.extract(spec.mask, spec)
    assert (bound is not None) == folds, mask
    plan = plan_forward(spec, "sm_90")
    assert (plan.context["col_bound"] is not None) == folds
    if not folds:  # the per-element mask keeps the conjunct
        assert "col_lo" not in render(plan)
        assert plan.context["tile_mask_expr"]["nc"] == cuda_expr(spec.mask, spec)


def test_an_unprovable_conjunct_stays_in_the_rest_and_a_bound_makes_it_provable():
    """``w - kv_idx >= q_idx / 3 - p`` with any int32 ``w`` is not folded (it stays in the
    per-element mask beside a provable bound); with ``w``'s declared ``min: -2`` it folds.
    Past that min the folded bound would be wrong: the per-element int32 comparison wraps
    at ``w = -2^31 + 1`` and the 64-bit bound does not, so the proof is needed."""
    mixed = _spec("w - kv_idx >= q_idx / 3 - p && kv_idx <= q_idx + p")
    bound = colbound.extract(mixed.mask, mixed)
    assert bound is not None and not bound.lo and len(bound.hi) == 1
    assert bound.rest is mixed.mask.lhs
    plan = plan_forward(mixed, "sm_90")
    assert plan.context["tile_mask_expr"]["nc"] == cuda_expr(mixed.mask.lhs, mixed)
    assert plan.context["col_bound"]["lo"] is None and plan.context["col_bound"]["hi"]

    text = "params:\n  w: {type: i32, default: 4, min: -2}\n  p: {type: i32, default: 2}\n"
    spec = _spec("w - kv_idx >= q_idx / 3 - p", params=text)
    bound = colbound.extract(spec.mask, spec)
    assert bound is not None and bound.rest is None
    rng = random.Random(5)
    for w in (-2, -1, 0, 7, I32_MAX):  # inside the declared range: exact at any size
        for p in (I32_MIN, -1, 0, 5, I32_MAX):
            for sq, sk in BIG + [(40, 70)]:
                _check_points(
                    bound, spec.mask, sq, sk, _points(sq, rng), _points(sk, rng), {"w": w, "p": p}
                )
    env = _env(1, 1, {"w": I32_MIN + 1, "p": 0})
    env.update(kv_idx=torch.tensor([[5]]))  # w - 5 wraps to 2^31 - 4: the pair is kept
    assert bool(eval_expr(spec.mask, env).all())
    lo, hi = _range(bound, env, 1)
    assert not bool(((5 >= lo) & (5 <= hi)).all())  # the 64-bit bound would drop it


def test_several_bounds_and_a_rest():
    spec = _spec(
        "causal && kv_idx > q_idx - w && kv_idx <= q_idx + p && (kv_idx / 4) != (q_idx / 4)"
    )
    _, residual = split_causal(spec.mask)
    bound = colbound.extract(residual, spec)
    assert len(bound.lo) == 1 and len(bound.hi) == 1 and bound.rest is not None
    conj = _conjuncts(spec.mask)
    for sq, sk in ((7, 30), (16, 16)):
        for w, p in ((3, 2), (0, 0), (20, -3)):
            env = _env(sq, sk, {"w": w, "p": p})
            lo, hi = _range(bound, env, sq)
            kv = torch.arange(sk).view(1, sk)
            got = (kv >= lo) & (kv <= hi) & eval_expr(bound.rest, env)
            assert torch.equal(got, eval_expr(residual, env).expand(sq, sk))
            assert len(conj) == 3


@pytest.mark.parametrize(
    "mask",
    [
        "kv_idx * 2 < q_idx",  # coefficient 2
        "kv_idx / 2 < q_idx",  # kv_idx under a division
        "kv_idx - kv_idx < q_idx",  # coefficient 0
        "kv_idx < q_idx * 0.5",  # float
        "kv_idx != q_idx",  # not a range
        "kv_idx < q_idx || q_idx < 3",  # under ||
        "abs(q_idx - kv_idx) < w",  # two-sided but not linear
        "(causal ? 1 : 0) + kv_idx < q_idx",  # causal reads kv_idx
    ],
)
def test_what_is_not_a_column_bound(mask):
    spec = _spec(mask)
    assert colbound.extract(spec.mask, spec) is None


def test_mistral_masked_tiles_test_a_column_range_and_the_switch(monkeypatch):
    spec = load_spec(REPO / "specs" / "mistral_swa.yaml")
    plan = plan_forward(spec, "sm_90")
    ctx = plan.context
    assert ctx["col_bound"]["lo"] is not None and ctx["col_bound"]["hi"] is None
    assert ctx["tile_mask_expr"] == {"mask": None, "nc": None, "causal": None}
    src = render(plan)
    body = src[src.index('extern "C" __global__') :]
    assert "p_window" in body and "- kv_idx) < p_window" not in body
    assert body.count("(col_lo[i / 2] <= j * 8 + i % 2) & (j * 8 + i % 2 <= col_lim[i / 2])") == 2
    off = plan_forward(spec, "sm_90", values=NO_BOUND)
    assert off.context["col_bound"] is None and "col_lo" not in render(off)
    assert render(off) == render(
        plan_forward(spec, "sm_90", mask_tiles=True, persistent=False, values=NO_BOUND)
    )
    # the bound rides on the column limit
    no_limit = plan_forward(spec, "sm_90", values={"hopper_fwd.col_limit": False})
    assert no_limit.context["col_bound"] is None


@pytest.mark.parametrize("persistent", [False, "static"])
def test_shipped_sources_without_a_bound_do_not_change(monkeypatch, persistent):
    """Every shipped spec but mistral_swa renders the same source with the switch on or off."""
    on = {}
    # (an fp8 spec has no persistent kernel: its plan refuses one; a v_from_k one no forward)
    paths = [p for p in sorted((REPO / "specs").glob("*.yaml"))
             if not (persistent and load_spec(p).dtype == "fp8_e4m3")
             and not load_spec(p).v_from_k]  # fmt: skip
    for path in paths:
        spec = load_spec(path)
        on[spec.name] = render(plan_forward(spec, "sm_90", persistent=persistent))
    for path in paths:
        spec = load_spec(path)
        off = render(plan_forward(spec, "sm_90", persistent=persistent, values=NO_BOUND))
        assert (off == on[spec.name]) == (spec.name != "mistral_swa"), spec.name


def test_score_mod_takes_a_bound_only_without_a_rest():
    alone = _spec("causal && q_idx - kv_idx < w", score_mod="score - 0.5 * (q_idx - kv_idx)")
    plan = plan_forward(alone, "sm_90")
    assert plan.context["col_bound"] is not None
    assert "j * 8 + e < lo" in render(plan)  # the limit pass after the score_mod loop
    mixed = _spec("q_idx - kv_idx < w && kv_idx % 3 != 0", score_mod="score * 0.5")
    assert plan_forward(mixed, "sm_90").context["col_bound"] is None


def test_bounds_render_as_64_bit_sums():
    """Each row sub-expression renders as the mask renders it (int32, as evaluated today);
    only the sum around kv_idx is 64-bit."""
    spec = _spec("kv_idx - q_idx > p - w && kv_idx < q_idx + 5 && kv_idx <= w")
    bound = colbound.extract(spec.mask, spec)
    code = colbound.bound_code(bound.lo, lambda e: cuda_expr(e, spec), "max")
    assert code == "((long long)((p_p - p_w)) + (long long)(q_idx) + 1LL)"
    code = colbound.bound_code(bound.hi, lambda e: cuda_expr(e, spec), "min")
    assert code == "min(((long long)((q_idx + 5)) - 1LL), ((long long)(p_w)))"


HOST = r"""
#include <cstdio>
#include <algorithm>
using std::max;
using std::min;
constexpr int BLOCK_N = 32;
// the rendered bound_range block, run on the host (int r = 0: one row)
static void range(int q_row, int seqlen_q, int seqlen_k, int n0, int lane, @PARAMS@,
                  int* col_lim, int* col_lo) {
    const int r = 0;
    int lim = seqlen_k - 1;
@BLOCK@
}
int main() {
    int sq, sk;
    while (scanf("%d %d", &sq, &sk) == 2) {
        @READ@
        for (int q = 0; q < sq; ++q)
            for (int kv = 0; kv < sk; ++kv) {
                const int n0 = kv / BLOCK_N * BLOCK_N, lane = ((kv - n0) % 8) / 2;
                const int off = kv - n0 - 2 * lane;  // j * 8 + e
                int col_lim[1], col_lo[1];
                range(q, sq, sk, n0, lane, @ARGS@, col_lim, col_lo);
                putchar(col_lo[0] <= off && off <= col_lim[0] ? '1' : '0');
                const int q_idx = q, kv_idx = kv, seqlen_q = sq, seqlen_k = sk;
                (void)q_idx; (void)kv_idx; (void)seqlen_q; (void)seqlen_k;
                putchar((@OLD@) ? '1' : '0');  // the kernel's per-element test today
            }
        putchar('\n');
    }
}
"""


@pytest.mark.parametrize(
    "mask, params",
    [
        (None, None),  # mistral_swa
        ("causal && kv_idx > q_idx - w && kv_idx <= q_idx + p", PARAMS),
        ("kv_idx == seqlen_k - 1 - q_idx", PARAMS),
        # w = 2^31 - 1: the bound w - q_idx / 3 + p passes INT_MAX (64-bit, exact)
        ("w - kv_idx >= q_idx / 3 - p", PARAMS.replace("default: 4}", "default: 4, min: -2}")),
        ("q_idx + seqlen_k - seqlen_q - kv_idx < w", PARAMS),
        ("kv_idx - q_idx > p - w && kv_idx <= w", PARAMS),
    ],
)
def test_rendered_bound_arithmetic_on_the_host(mask, params, host_exe, monkeypatch):
    """The bound_range block of the rendered kernel (nvcc, host code, int32 wrapping as on the
    GPU) keeps exactly the pairs the per-element expression keeps (``mask_expr_nc``, what
    ``hopper_fwd.col_bound=false`` renders) and the reference keeps, at params anywhere in
    their declared ranges (all of int32 where undeclared): a conjunct is folded only where its
    int32 form provably equals the 64-bit bound (flashgen/analysis/colbound.py), so no param
    value parts them."""
    import subprocess

    spec = (
        load_spec(REPO / "specs" / "mistral_swa.yaml")
        if mask is None
        else _spec(mask, None, params)
    )
    plan = plan_forward(spec, "sm_90")
    assert plan.context["col_bound"] is not None
    assert plan.context["tile_mask_expr"]["nc"] is None  # every conjunct folded
    src = render(plan)
    start = src.index("                {\n                    const int q_idx = min(q_row")
    block = src[start : src.index("\n                }\n", start) + 18]
    old = plan_forward(spec, "sm_90", values=NO_BOUND).context["tile_mask_expr"]["nc"]
    names = [p.name for p in spec.scalar_params]
    prog = (
        HOST.replace("@BLOCK@", block)
        .replace("@OLD@", old)
        .replace("@PARAMS@", ", ".join(f"int p_{n}" for n in names))
        .replace("@READ@", " ".join(f'int p_{n}; scanf("%d", &p_{n});' for n in names))
        .replace("@ARGS@", ", ".join(f"p_{n}" for n in names))
    )
    exe = host_exe(prog, "bound", "-Xcompiler=-O2,-fwrapv")
    rng = random.Random(7)
    cases = []
    for sq, sk in ((1, 1), (3, 70), (9, 33), (40, 40), (17, 5), (64, 100)):
        for vals in _param_values(spec, rng, 8):
            cases.append((sq, sk, [vals[n] for n in names]))
    text = "".join(f"{sq} {sk} {' '.join(map(str, vals))}\n" for sq, sk, vals in cases)
    out = subprocess.run([str(exe)], input=text, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    _, residual = split_causal(spec.mask)
    for (sq, sk, vals), line in zip(cases, out.stdout.split(), strict=True):
        env = _env(sq, sk, dict(zip(names, vals, strict=True)))
        got = torch.tensor([c == "1" for c in line[0::2]])
        today = torch.tensor([c == "1" for c in line[1::2]])
        want = eval_expr(residual, env).expand(sq, sk).reshape(-1)
        assert torch.equal(got, today) and torch.equal(got, want), (mask, sq, sk, vals)


GPU_TEST_MASKS = {  # tests/gpu/test_colbound_gpu.py's user specs
    "band": ("causal && kv_idx > q_idx - w && kv_idx <= q_idx + p", None),
    "rest": ("causal && q_idx + seqlen_k - seqlen_q - kv_idx < w && kv_idx % 3 != 1", None),
    "affine": (
        "causal && q_idx + seqlen_k - seqlen_q - kv_idx < w",
        "score - 0.01 * (q_idx - kv_idx)",
    ),
    "softcap": ("causal && q_idx + seqlen_k - seqlen_q - kv_idx < w", "30.0 * tanh(score / 30.0)"),
}


@pytest.mark.parametrize("key", sorted(GPU_TEST_MASKS))
@pytest.mark.parametrize("persistent", [False, "static"])
def test_bound_kernels_spill_no_more(key, persistent, requires_nvcc, monkeypatch):
    """0 spills and no wgmma serialization with the bound, except the softcap window, which
    spills without it too (20 B; 216 B persistent) and a little less with it (20 B; 164 B):
    the op's spill fallback (flashgen/families/build.py) takes other tiles for it either way.  (The
    affine window spills 696 B persistent without the bound, 0 with it.)"""
    from flashgen.build import cache

    mask, score_mod = GPU_TEST_MASKS[key]
    spills = {}
    for on in ("1", "0"):
        plan = plan_forward(
            _spec(mask, score_mod), "sm_90", persistent=persistent,
            values={"hopper_fwd.col_bound": on == "1"},
        )  # fmt: skip
        assert (plan.context["col_bound"] is not None) == (on == "1")
        if on == "0" and spills["1"] == 0:
            break  # 0 spills with the bound are no more than without it: no nvcc run for that
        _, report = cache.get_or_build(render(plan), plan)
        spills[on] = report.spill_bytes
        if on == "1":
            assert not report.wgmma_serialized, report.log
    assert spills["1"] <= spills.get("0", spills["1"])
    if key != "softcap":
        assert spills["1"] == 0
