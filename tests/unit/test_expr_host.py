"""The kernels' lowered masks (``lower.cuda_expr`` with the forward's hoisted invariants and
float twins) evaluated on the host, pair by pair, against the reference's mask
(``reference.eval_mask``): a CPU check of the lowering rules that the GPU tests check
end to end.  The expressions run in a C++ program built with the host compiler, with the
kernels' own ``fg::idiv``/``imod``/``clamp_index``/``Divisor`` taken from
``templates/common/mma_sm80.cuh`` (``__device__`` defined away), ``q_idx_f``/``kv_idx_f``
as the kernels define them, and the prologue of hoisted divisors before the expression.

The cases are decided exactly in float32 and float64 alike (a comparison at an exact
quotient, such as ``q_idx / 7.0 == kv_idx`` at q_idx = 21), so any difference is the
lowering's: ``x * (1 / d)`` for ``x / d`` there was one (21 * (1 / 7.0f) = 3.0000002).
"""

from __future__ import annotations

import subprocess

import pytest

torch = pytest.importorskip("torch")

from host_cxx import preamble, scalar_params  # noqa: E402

from flashgen.codegen.cuda_expr import Invariants, cuda_expr  # noqa: E402
from flashgen.frontend.spec import loads_spec  # noqa: E402
from flashgen.ops.cpu.reference import eval_mask  # noqa: E402

SQ, SK = 150, 200

# (mask, params declaration, values of the scalar params)
CASES = [
    ("q_idx / f == kv_idx", "{f: {type: f32, default: 1.0}}", {"f": 7.0}),
    (
        "kv_idx >= q_idx / f && kv_idx * 1.0 <= q_idx / 3.0",
        "{f: {type: f32, default: 1.0}}",
        {"f": 7.0},
    ),
    (
        "(q_idx - kv_idx) / 1.5 < w && q_idx >= kv_idx",
        "{w: {type: f32, default: 1.0}}",
        {"w": 10.0},
    ),
    (
        "min(q_idx, kv_idx) * 2.5 / f > q_idx - kv_idx",
        "{f: {type: f32, default: 1.0}}",
        {"f": 0.75},
    ),
    ("(q_idx - kv_idx) / p >= 2.0 || kv_idx / p == 5", "{p: {type: i32, default: 1}}", {"p": 7}),
    ("q_idx / p == kv_idx / p || kv_idx % -p == 1", "{p: {type: i32, default: 1}}", {"p": 3}),
    ("q_idx / p == kv_idx / p || kv_idx % -p == 1", "{p: {type: i32, default: 1}}", {"p": -5}),
    ("q_idx / p == kv_idx / p || kv_idx % -p == 1", "{p: {type: i32, default: 1}}", {"p": 0}),
    (
        "causal && (q_idx + seqlen_k - seqlen_q) / chunk == kv_idx / chunk",
        "{chunk: {type: i32, default: 1}}",
        {"chunk": 8},
    ),
    (
        "q_idx % (p + 1) < kv_idx % (p * 2 + 1) || !(q_idx / (p - 3) > 2)",
        "{p: {type: i32, default: 1}}",
        {"p": 3},
    ),
    (
        "q_idx % (p + 1) < kv_idx % (p * 2 + 1) || !(q_idx / (p - 3) > 2)",
        "{p: {type: i32, default: 1}}",
        {"p": 7},
    ),
    # float twins with large params that cancel: the int terms are summed before converting
    ("q_idx - kv_idx + p - p < 2.5", "{p: {type: i32, default: 1}}", {"p": 2**26 + 1}),
    ("(q_idx + p) - (kv_idx + p) < 2.5", "{p: {type: i32, default: 1}}", {"p": 2**25 + 3}),
    (
        "kv_idx - q_idx + seqlen_q - seqlen_k + p - (p - 4) >= -3.5",
        "{p: {type: i32, default: 1}}",
        {"p": 2**27 + 5},
    ),
    # float math in a mask is float32 in the kernels and the reference alike (float64
    # decides these differently: 3 * 0.1 != 0.3, 9 / 0.3 > 30, 0.1 as a double param)
    ("q_idx * 0.1 == 0.3 || kv_idx * f == 0.3", "{f: {type: f32, default: 1.0}}", {"f": 0.1}),
    ("kv_idx <= q_idx / 0.3", "{}", {}),
    # int32 arithmetic wraps in the kernels' int and the reference alike (issue 22 item 9)
    ("q_idx * 100000000 >= kv_idx", "{}", {}),
    ("q_idx * p + p >= kv_idx - p", "{p: {type: i32, default: 1}}", {"p": 2**30 + 7}),
    # INT_MIN / -1 by a run-time divisor (fg::idiv, fg::imod): INT_MIN, remainder 0
    (
        "(q_idx + p) / (d - kv_idx) < 0 || (q_idx + p) % (d - kv_idx) != 0",
        "{p: {type: i32, default: 1}, d: {type: i32, default: 1}}",
        {"p": -(2**31), "d": 0},
    ),
    (
        "q_idx - kv_idx + seqlen_k - seqlen_q < 0.5 * f && kv_idx > q_idx / 9",
        "{f: {type: f32, default: 1.0}}",
        {"f": 33.0},
    ),
]


def _program(cases, float_calls: bool = False) -> str:
    funcs = []
    for i, (spec, values) in enumerate(cases):
        inv = Invariants(float_calls=float_calls)
        code = cuda_expr(spec.mask, spec, inv)
        decl, args = scalar_params(spec, values)
        funcs.append(
            f"static bool mask_{i}(int q_idx, int kv_idx, int seqlen_q, int seqlen_k{decl}) {{\n"
            "    const float q_idx_f = (float)q_idx, kv_idx_f = (float)kv_idx;\n"
            "    (void)q_idx_f; (void)kv_idx_f;\n"
            f"    {inv.prologue}\n"
            f"    return {code};\n}}\n"
            f"static void run_{i}() {{\n"
            f"    for (int q = 0; q < {SQ}; ++q)\n"
            f"        for (int k = 0; k < {SK}; ++k)\n"
            f"            putchar(mask_{i}(q, k, {SQ}, {SK}{args}) ? '1' : '0');\n"
            "    putchar('\\n');\n}\n"
        )
    main = "int main() {\n" + "".join(f"    run_{i}();\n" for i in range(len(cases))) + "}\n"
    return preamble() + "".join(funcs) + main


def test_lowered_masks_match_the_reference(cxx_exe):
    cases = []
    for i, (mask, params, values) in enumerate(CASES):
        spec = loads_spec(
            f"name: h{i}\nhead_dim: 64\ndtype: bf16\nmask: '{mask}'\nparams: {params}\n"
        )
        cases.append((spec, values))
    exe = cxx_exe(_program(cases), "masks")
    rows = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60).stdout.split()
    assert len(rows) == len(cases)
    for (spec, values), row in zip(cases, rows, strict=True):
        want = eval_mask(spec, batch=1, heads_q=1, seqlen_q=SQ, seqlen_k=SK, params=values)
        got = torch.tensor([c == "1" for c in row]).view(SQ, SK)
        bad = (got != want[0, 0]).nonzero()
        assert len(bad) == 0, (
            f"mask {spec.source.splitlines()[3]} {values}: {len(bad)} pairs differ, first "
            f"(q_idx, kv_idx) = {tuple(bad[0].tolist())}, kernel {bool(got[tuple(bad[0])])}"
        )


#: Integer abs / min / max of index expressions in float contexts (Invariants' float_calls:
#: computed on the float twins), at values where a rounding would flip the comparison.
FLOAT_CALL_CASES = [
    ("abs(q_idx - kv_idx) * 0.5 < w", "{w: {type: f32, default: 1.0}}", {"w": 20.0}),
    ("abs(q_idx + seqlen_k - seqlen_q - kv_idx) * f <= 40.0", "{f: {type: f32, default: 1.0}}",
     {"f": 0.5}),
    ("min(q_idx, kv_idx + p) * 1.5 >= max(kv_idx, 3) * 0.75", "{p: {type: i32, default: 1}}",
     {"p": 7}),
    ("abs(q_idx - kv_idx + p - p) * 0.25 == 10.0", "{p: {type: i32, default: 1}}",
     {"p": 2**26 + 1}),
    ("max(q_idx - 100, kv_idx - 150) * 1.0 > min(q_idx, 40) * 2.0", "{}", {}),
]  # fmt: skip


@pytest.mark.parametrize("float_calls", [False, True], ids=["converted", "twins"])
def test_int_calls_on_float_twins_match_the_reference(cxx_exe, float_calls):
    """``Invariants(float_calls=True)`` lowers ``abs(q_idx - kv_idx)`` in a float context as
    ``fabsf(q_idx_f - kv_idx_f)`` (and min / max alike): exact, so every pair decides as the
    reference does, as the per-element conversion does."""
    cases = []
    for i, (mask, params, values) in enumerate(FLOAT_CALL_CASES):
        spec = loads_spec(
            f"name: fc{i}\nhead_dim: 64\ndtype: bf16\nmask: '{mask}'\nparams: {params}\n"
        )
        code = cuda_expr(spec.mask, spec, Invariants(float_calls=float_calls))
        assert ("fabsf(" in code or "fminf(" in code or "fmaxf(" in code) == float_calls, code
        cases.append((spec, values))
    exe = cxx_exe(_program(cases, float_calls), f"float_calls_{int(float_calls)}")
    rows = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60).stdout.split()
    assert len(rows) == len(cases)
    for (spec, values), row in zip(cases, rows, strict=True):
        want = eval_mask(spec, batch=1, heads_q=1, seqlen_q=SQ, seqlen_k=SK, params=values)
        got = torch.tensor([c == "1" for c in row]).view(SQ, SK)
        assert torch.equal(got, want[0, 0]), spec.source.splitlines()[3]
        assert got.any() and not got.all(), spec.source.splitlines()[3]  # the cases decide

