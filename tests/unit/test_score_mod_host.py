"""The forward kernels' lowered score_mods (``lower.cuda_expr`` with the forward's
``Invariants(raw_score="score_raw")``: hoisted divisors and the softmax_scale fold, where
``score / d`` and ``c * score`` become ``score_raw * (softmax_scale / d)``) evaluated on the
host against the reference's ``eval_expr`` in float64, for random and for exact raw scores.

The expressions run in a C++ program built with the host compiler exactly as the
templates define their locals (``score_raw`` = q.k, ``score = score_raw * softmax_scale``,
``q_idx_f``/``kv_idx_f``, the hoisted prologue before the main loop), with the kernels'
``fg::`` helpers from ``templates/common/mma_sm80.cuh`` (``tanh_approx``, inline PTX, is
replaced by ``tanhf``: these tests check the lowering, not the approximation).

Continuous score_mods must agree within a few float32 ulps of their terms.  Where a
quotient reaches a discontinuity (float ``%``), a reciprocal or folded product may sit an
ulp below an exact multiple (``41 * (1 / 41.0f)`` = 0.99999994), and ``% 1.0`` turns that
ulp into a whole unit: there the division must stay a division.
"""

from __future__ import annotations

import math
import random
import subprocess

import pytest

torch = pytest.importorskip("torch")

from host_cxx import preamble, scalar_params  # noqa: E402

from flashgen.codegen.cuda_expr import Invariants, cuda_expr  # noqa: E402
from flashgen.frontend import ir  # noqa: E402
from flashgen.frontend.spec import loads_spec  # noqa: E402
from flashgen.ops.cpu.reference import _env, eval_expr  # noqa: E402

SQ, SK = 97, 131
N = 600  # (q_idx, kv_idx, raw score) triples per case and scale
SCALES = (1.0, 0.125, 1.0 / math.sqrt(128.0))

# (score_mod, params declaration, values of the scalar params, exact raw scores to add)
# fmt: off
CASES = [
    ("score / d", "{d: {type: f32, default: 1.0}}", {"d": 41.0}, ()),
    ("c * score", "{c: {type: f32, default: 1.0}}", {"c": -0.3}, ()),
    ("score * c", "{c: {type: i32, default: 1}}", {"c": 3}, ()),
    ("score / n", "{n: {type: i32, default: 1}}", {"n": 7}, ()),
    ("score / n", "{n: {type: i32, default: 1}}", {"n": 0}, ()),
    ("score / (n / 2 + 1)", "{n: {type: i32, default: 1}}", {"n": 9}, ()),
    ("score / d / e", "{d: {type: f32, default: 1.0}, e: {type: f32, default: 1.0}}",
     {"d": 3.0, "e": -0.7}, ()),
    ("-score / d", "{d: {type: f32, default: 1.0}}", {"d": 2.5}, ()),
    ("score * -c", "{c: {type: f32, default: 1.0}}", {"c": 1.5}, ()),
    ("c * tanh(score / c)", "{c: {type: f32, default: 1.0}}", {"c": 50.0}, ()),
    ("score / 4", "{}", {}, ()),
    ("score / (c > 1.0 ? c : 2.0) + score * (n > 2 ? 1 : -1)",
     "{c: {type: f32, default: 1.0}, n: {type: i32, default: 1}}", {"c": -3.0, "n": 1}, ()),
    ("2.5 * score + score / d", "{d: {type: f32, default: 1.0}}", {"d": 0.3}, ()),
    ("score * (q_idx - kv_idx)", "{}", {}, ()),
    ("score / (seqlen_k + c)", "{c: {type: i32, default: 1}}", {"c": 2}, ()),
    ("q_idx >= kv_idx ? score / d : score * d", "{d: {type: f32, default: 1.0}}",
     {"d": 3.0}, ()),
    ("score / d > 1.0 ? score : 0.0", "{d: {type: f32, default: 1.0}}", {"d": 7.0},
     (7.0, 14.0, 21.0, 49.0)),
    ("score + (score / d >= 1.0 ? 1.0 : 0.0)", "{d: {type: f32, default: 1.0}}", {"d": 41.0},
     (41.0, 82.0, 287.0)),
    # a float % turns an ulp below a multiple into a whole unit: no reciprocal, no fold
    ("(score / d) % 1.0", "{d: {type: f32, default: 1.0}}", {"d": 41.0},
     (41.0, 82.0, 164.0, -41.0, 287.0)),
    ("score + (kv_idx / 41.0) % 1.0", "{}", {}, ()),
    ("score + (q_idx / f) % 2.0", "{f: {type: f32, default: 1.0}}", {"f": 41.0}, ()),
]
# fmt: on


def _samples(extra_raw, seed: int):
    """(q_idx, kv_idx, raw q.k) triples: random raw scores, the exact ones at every scale
    (divided by it so score = raw * scale lands on them), and the edges of the ranges."""
    rng = random.Random(seed)
    out = []
    for i in range(N):
        q, kv = rng.randrange(SQ), rng.randrange(SK)
        if i < 2 * len(extra_raw) * len(SCALES):
            out.append((q, kv, None, extra_raw[i % len(extra_raw)]))  # score itself exact
        else:
            out.append((q, kv, rng.uniform(-60.0, 60.0), None))
    out += [(0, 0, 1.0, None), (SQ - 1, SK - 1, -1.0, None), (41, 41, 0.0, None)]
    return out


def _program(cases) -> str:
    funcs = []
    for i, (spec, values, _) in enumerate(cases):
        inv = Invariants(raw_score="score_raw")
        code = cuda_expr(spec.score_mod, spec, inv)
        decl, args = scalar_params(spec, values)
        funcs.append(
            f"static float mod_{i}(float score_raw, float softmax_scale, int q_idx, int kv_idx, "
            f"int seqlen_q, int seqlen_k{decl}) {{\n"
            "    (void)seqlen_q; (void)seqlen_k;\n"
            "    const float q_idx_f = (float)q_idx, kv_idx_f = (float)kv_idx;\n"
            "    (void)q_idx_f; (void)kv_idx_f;\n"
            f"    {inv.prologue}\n"
            "    const float score = score_raw * softmax_scale;\n"
            "    (void)score_raw; (void)score;\n"
            f"    return (float)({code});\n}}\n"
            f"static void run_{i}(float s, int q, int k, float raw) {{\n"
            f'    printf("%.9g\\n", mod_{i}(raw, s, q, k, {SQ}, {SK}{args}));\n}}\n'
        )
    # the samples as data, one table per case (a call statement per sample made a main of
    # 38,000 lines that took the host compiler 7 s)
    tables, loops = ["struct Sample { float s; int q, k; float raw; };\n"], []
    for i, (_, _, samples) in enumerate(cases):
        rows = []
        for s in SCALES:
            for q, kv, raw, exact in samples:
                r = raw if exact is None else float(torch.tensor(exact / s, dtype=torch.float32))
                rows.append(f"{{{s!r}f, {q}, {kv}, {r!r}f}},")
        tables.append(f"static const Sample samples_{i}[] = {{\n" + "\n".join(rows) + "\n};\n")
        loops.append(f"    for (const Sample& x : samples_{i}) run_{i}(x.s, x.q, x.k, x.raw);\n")
    return preamble() + "".join(funcs) + "".join(tables) + "int main() {\n" + "".join(
        loops) + "}\n"  # fmt: skip


def _reference(spec, values, s: float, samples) -> torch.Tensor:
    """eval_expr of the score_mod in float64 at each sample, from the score the kernel
    sees: float32(raw) * float32(scale) rounded to float32."""
    env = _env(spec, 1, 1, SQ, SK, values, "cpu", torch.float64, Hkv=1)
    qi = torch.tensor([q for q, _, _, _ in samples])
    ki = torch.tensor([k for _, k, _, _ in samples])
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731
    raws = [f32(r if e is None else e / s) for _, _, r, e in samples]
    env["q_idx"], env["kv_idx"] = qi, ki
    env["score"] = torch.tensor([f32(r * f32(s)) for r in raws], dtype=torch.float64)
    out = eval_expr(spec.score_mod, env)
    return out.to(torch.float64).expand(len(samples))


def _tolerance(want: torch.Tensor) -> torch.Tensor:
    """A few float32 ulps of the larger of the result and the largest score (60)."""
    return 64 * 2.0**-24 * (want.abs() + 60.0)


@pytest.fixture(scope="module")
def results(cxx_exe):
    cases = []
    for i, (mod, params, values, exact) in enumerate(CASES):
        spec = loads_spec(
            f"name: s{i}\nhead_dim: 64\ndtype: bf16\nscore_mod: '{mod}'\nparams: {params}\n"
        )
        cases.append((spec, values, _samples(exact, seed=i)))
    exe = cxx_exe(_program(cases), "mods")
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120).stdout.split()
    vals = torch.tensor([float(x) for x in out], dtype=torch.float64)
    per = [len(SCALES) * len(samples) for _, _, samples in cases]
    assert len(vals) == sum(per)
    return cases, vals.split(per)


@pytest.mark.parametrize("i", range(len(CASES)), ids=[c[0] for c in CASES])
def test_lowered_score_mod_matches_the_reference(results, i):
    cases, got_all = results
    spec, values, samples = cases[i]
    got_all = got_all[i].view(len(SCALES), len(samples))
    for j, s in enumerate(SCALES):
        want = _reference(spec, values, s, samples)
        got = got_all[j]
        same_nan = torch.isnan(got) & torch.isnan(want)
        same_inf = torch.isinf(want) & (got == want)
        ok = same_nan | same_inf | ((got - want).abs() <= _tolerance(want))
        bad = (~ok).nonzero().flatten()
        assert len(bad) == 0, (
            f"score_mod {CASES[i][0]!r} {values} at softmax_scale {s}: {len(bad)} of "
            f"{len(samples)} differ; first (q_idx, kv_idx, score) = "
            f"{samples[bad[0]][:2]}: kernel {float(got[bad[0]])!r}, "
            f"reference {float(want[bad[0]])!r}"
        )


def test_the_fold_is_taken():
    """The forward's score / d and c * score are the raw logit times one hoisted value."""
    spec = loads_spec(
        "name: f\nhead_dim: 64\ndtype: bf16\nscore_mod: 'c * tanh(score / c)'\n"
        "params: {c: {type: f32, default: 1.0}}\n"
    )
    inv = Invariants(raw_score="score_raw")
    code = cuda_expr(spec.score_mod, spec, inv)
    assert "score_raw * fg_inv" in code and "softmax_scale / p_c" in inv.prologue
    assert ir.SCORE_VAR not in code.replace("score_raw", "")
