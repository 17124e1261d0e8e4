"""2^x on the FMA pipe (``fg::exp2_poly`` in templates/common/exp2_poly.cuh) and the Hopper
forward's ``hopper_fwd.exp2_poly`` option that routes sixteenths of the softmax's P to it:
the function compiled as host code and measured against ``std::exp2``; the option's range;
the default render untouched; spill-free sm_90a builds; and the SASS trade of MUFU.EX2 for
FFMA, per softmax, by the expected counts."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from flashgen.build import cache
from flashgen.build.render import render
from flashgen.families import hopper_fwd, registry
from flashgen.families.hopper_fwd import EXP2_POLY_SIXTEENTHS, Options
from flashgen.frontend.spec import load_spec
from flashgen.options import DEFAULT, UnknownOptionError
from flashgen.options import Options as FullOptions

REPO = Path(__file__).resolve().parents[2]
HEADER = REPO / "templates" / "common" / "exp2_poly.cuh"

#: Host stand-ins for the CUDA intrinsics the header uses.  __fadd_rd is exact: the float sum
#: rounded to nearest, its rounding error recovered exactly (Knuth's TwoSum), one ulp down where
#: the exact sum lies below it.
HOST_SHIMS = r"""
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#define __device__
#define __forceinline__ inline
static inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static inline float __fadd_rd(float a, float b) {
    volatile float s = a + b;
    volatile float bb = s - a;
    const float err = (a - (s - bb)) + (b - bb);
    return err < 0.f ? std::nextafter(float(s), -INFINITY) : float(s);
}
namespace fg { inline float exp2_approx(float x) { return std::exp2(x); } }
"""

PROGRAM = r"""
static double worst = 0.0, worst_x = 0.0;
static long count = 0, not_monotone = 0;
static void measure(float x, float prev_y_ok, float* prev) {
    const float y = fg::exp2_poly(x);
    const double want = std::exp2(double(x));
    const double rel = std::fabs(double(y) - want) / want;
    if (rel > worst) { worst = rel; worst_x = x; }
    if (prev_y_ok != 0.f && y > *prev) ++not_monotone;  // x decreasing: y must not grow
    *prev = y;
    ++count;
}
int main() {
    float prev = 0.f;
    // every 61st float in [-126, -0] (bit patterns 0x80000000 .. 0xC2FC0000: x decreasing)
    for (uint32_t u = 0x80000000u; u <= 0xC2FC0000u; u += 61)
        measure(__uint_as_float(u), u != 0x80000000u, &prev);
    // every float in [-2, -1] (all fractions f at 2^-22) and around each integer down to -126
    for (uint32_t u = 0xBF800000u; u <= 0xC0000000u; ++u)
        measure(__uint_as_float(u), u != 0xBF800000u, &prev);
    for (int n = 0; n >= -126; --n) {  // n and its neighbours inside [-126, 0]
        measure(float(n), 0, &prev);
        if (n < 0) measure(std::nextafter(float(n), 0.f), 0, &prev);
        if (n > -126) measure(std::nextafter(float(n), -INFINITY), 0, &prev);
    }
    printf("worst %.9g at %.9g over %ld, not monotone %ld\n", worst, worst_x, count, not_monotone);
    const float edges[] = {-INFINITY, -3.0e38f, -1.0e30f, -200.f, -127.5f, -127.f,
                           std::nextafter(-127.f, 0.f), -126.5f, -126.f, -1.f, -1e-30f, -0.f, 0.f,
                           std::numeric_limits<float>::quiet_NaN()};
    for (float x : edges) {
        const float y = fg::exp2_poly(x);
        printf("edge %.9g %08x %.9g\n", x, __float_as_uint(y), y);
    }
}
"""


def host_program() -> str:
    """The header verbatim after the host stand-ins, then :data:`PROGRAM`."""
    return HOST_SHIMS + HEADER.read_text() + PROGRAM


@pytest.fixture(scope="module")
def host_run(cxx_exe) -> tuple[float, float, int, int, dict]:
    """(worst relative error, its x, values measured, monotonicity breaks, {x: (bits, y)}
    at the edges) of the host build of ``fg::exp2_poly``."""
    exe = cxx_exe(host_program(), "exp2_poly", "-O2")
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300, check=True)
    lines = out.stdout.splitlines()
    m = re.match(r"worst (\S+) at (\S+) over (\d+), not monotone (\d+)", lines[0])
    edges = {}
    for line in lines[1:]:
        _, x, bits, y = line.split()
        edges[x] = (int(bits, 16), float(y))
    return float(m[1]), float(m[2]), int(m[3]), int(m[4]), edges


def test_exp2_poly_is_far_under_a_bf16_ulp_on_the_softmax_range(host_run):
    """Over [-126, 0] (26 million floats: every 61st, every one of [-2, -1], and each integer
    with its neighbours) the relative error against std::exp2 is below 8.8e-5 (about
    2^-13.5; measured 8.77e-5), 45x under a bf16 ulp (2^-8) and 11x under fp16's (2^-10),
    and the result never grows as x falls (also across the integers)."""
    worst, _, count, not_monotone, _ = host_run
    assert count > 25_000_000
    assert 1e-5 < worst < 8.8e-5, worst  # the minimax polynomial's own error, not a broken one
    assert worst < 2.0**-8 / 32
    assert not_monotone == 0


def test_exp2_poly_edges_masked_scores_are_exactly_zero(host_run):
    """x = 0 gives exactly 1.  x <= -127 (a masked score's -inf, very negative logits) gives
    +0.0 exactly, with no select: the clamp makes f = 0, p = 1 and the exponent add cancels
    1.0f's bits.  -127 < x <= -126 gives at most 2^-126 (ex2.approx.ftz: 0 below -126).  NaN
    gives 0 (fmaxf drops it)."""
    *_, edges = host_run

    def at(x: float) -> tuple[int, float]:
        return edges[f"{float(np.float32(x)):.9g}"]  # the program prints x with %.9g

    assert at(0.0) == (0x3F800000, 1.0) and edges["-0"] == (0x3F800000, 1.0)
    assert at(-1.0)[1] == 0.5
    assert abs(at(-1e-30)[1] - 1.0) < 8.8e-5  # f rounds to 1: p(1) = 1.99983 halved
    for x in (-np.inf, -3.0e38, -1.0e30, -200.0, -127.5, -127.0):
        assert at(x) == (0, 0.0), (x, at(x))
    assert edges["nan"] == (0, 0.0)
    assert 0.0 < at(np.nextafter(np.float32(-127.0), np.float32(0.0)))[1] < 2.0**-126
    assert 0.0 < at(-126.5)[1] <= 2.0**-126
    assert at(-126.0)[0] == 0x00800000  # 2^-126 exactly


# ----------------------------------------------------------------------------- the option
def test_exp2_poly_takes_sixteenths_only():
    assert DEFAULT.hopper_fwd.exp2_poly == 0 and EXP2_POLY_SIXTEENTHS == 16
    for ok in (0, 1, 3, 8, 16):
        assert Options(exp2_poly=ok).exp2_poly == ok
    for bad in (-1, 17, 32):
        with pytest.raises(ValueError, match=r"exp2_poly.*in \[0, 16\]"):
            Options(exp2_poly=bad)
    for bad in (2.0, True, "2", None):
        with pytest.raises(ValueError, match="exp2_poly"):
            Options(exp2_poly=bad)
    assert DEFAULT.replace_path("hopper_fwd.exp2_poly", "3").hopper_fwd.exp2_poly == 3
    with pytest.raises(ValueError, match=r"^hopper_fwd.exp2_poly: expected an int in 0..16, "
                       r"got -3$"):  # fmt: skip
        DEFAULT.replace_path("hopper_fwd.exp2_poly", "-3")


def test_exp2_poly_is_part_of_the_kernel_and_cache_keys():
    spec = load_spec(REPO / "specs" / "causal_d128.yaml")
    on = DEFAULT.replace_path("hopper_fwd.exp2_poly", 3)
    assert DEFAULT.key() == "" and on.key() == "hopper_fwd.exp2_poly=3"
    assert on.family_key("hopper_fwd") == "hopper_fwd.exp2_poly=3"
    assert on.family_key("fa2_fwd") == ""
    assert registry.plan_forward(spec, "sm_90", on).options_key == "hopper_fwd.exp2_poly=3"


def test_the_every_nth_tile_option_was_replaced():
    with pytest.raises(UnknownOptionError, match="exp2_poly"):
        DEFAULT.replace_path("hopper_fwd.exp2_fma_every", 4)


def _spec(name: str, dtype: str | None = None):
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    return spec if dtype is None else dataclasses.replace(spec, name=f"{name}_{dtype}", dtype=dtype)


def test_off_renders_the_default_source_and_on_includes_the_polynomial():
    """0 (the default) takes every P by ``fg::exp2_approx`` (no exp2_poly.cuh); on, the
    header and the split at the same sites."""
    spec = _spec("causal_d128")
    default = render(registry.plan_forward(spec, "sm_90", DEFAULT))
    sites = default.count("const float p = fg::exp2_approx(fmaf(acc_s[")
    assert sites >= 1
    assert "exp2_poly" not in default and "softmax_exp2_split" not in default
    on = render(
        registry.plan_forward(spec, "sm_90", DEFAULT.replace_path("hopper_fwd.exp2_poly", 5))
    )
    assert "constexpr int EXP2_POLY = 5;" in on and "float exp2_poly(float x)" in on
    assert on.count("fg::softmax_exp2_split<EXP2_POLY>(") == sites
    assert on.count("const float p = fg::exp2_approx(fmaf(acc_s[") == 0


def test_exp2_poly_with_exact_softmax_is_refused_not_dropped():
    """With ``exact_softmax`` the option was silently dropped (its exp2s stay on the SFU) while
    ``flashgen show`` listed it as in effect: Options refuses the pair, either way round, and
    so does the family's plan given both."""
    for first, second in (("exact_softmax", "hopper_fwd.exp2_poly"),
                          ("hopper_fwd.exp2_poly", "exact_softmax")):  # fmt: skip
        values = {"exact_softmax": "true", "hopper_fwd.exp2_poly": "5"}
        with pytest.raises(ValueError) as e:
            DEFAULT.replace_path(first, values[first]).replace_path(second, values[second])
        msg = str(e.value)
        assert msg.startswith("Options.hopper_fwd.exp2_poly=5 with Options.exact_softmax=True: "
                              "expected exp2_poly 0 with the exact softmax"), msg  # fmt: skip
    with pytest.raises(ValueError, match="exact_softmax"):
        FullOptions(exact_softmax=True, hopper_fwd=Options(exp2_poly=5))
    assert FullOptions(exact_softmax=True, hopper_fwd=Options(exp2_poly=0)).exact_softmax
    spec = _spec("causal_d128")
    with pytest.raises(ValueError, match=r"hopper_fwd.exp2_poly=5: expected 0 with exact_softmax"):
        hopper_fwd.plan(spec, "sm_90", Options(exp2_poly=5), exact_softmax=True)


@pytest.mark.parametrize("name", ["bidir_d256", "causal_d128", "gpt2_d64"])
def test_values_that_give_one_tile_count_render_one_source(name):
    """At BLOCK_N 80 (bidir_d256: NS = 10 tiles per row) 1 put no tile on the FMA pipe (the
    default SASS from another source) and 2 / 3, 5 / 6 built the same kernel from different
    sources.  The plan renders from the effective count ``NS * k // 16``: one source per count,
    the default one for 0, and that many tiles of the polynomial."""
    spec = _spec(name)
    default = render(registry.plan_forward(spec, "sm_90", DEFAULT))
    by_count: dict[int, str] = {}
    for k in range(17):
        plan = registry.plan_forward(spec, "sm_90", DEFAULT.replace_path("hopper_fwd.exp2_poly", k))
        ns = plan.tiles.block_n // 8
        count = ns * k // 16
        assert plan.context.exp2_poly_tiles == count
        src = render(plan)
        assert by_count.setdefault(count, src) == src, (k, count)
        if count == 0:
            assert src == default, k
        else:  # the rendered sixteenths put exactly `count` of the row's tiles on the FMA pipe
            s16 = plan.context.exp2_poly
            assert f"constexpr int EXP2_POLY = {s16};" in src and s16 <= k
            assert sum((j + 1) * s16 // 16 != j * s16 // 16 for j in range(ns)) == count
    if name == "bidir_d256":
        assert sorted(by_count) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]


# ----------------------------------------------------------------------------- builds and SASS
#: (spec, dtype) of the units built: bf16 at head_dim 64 / 128 / 256 (causal and not), fp8 d128
UNITS = [("gpt2_d64", "bf16"), ("causal_d128", None), ("bidir_d256", None), ("llama3_fp8", None)]


def _counts(text: str) -> dict[str, int]:
    ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+(?:\.[A-Z0-9_]+)*)",
                     text, re.M)  # fmt: skip
    names = ("MUFU.EX2", "FFMA", "FADD", "FSETP", "FSEL")
    return {n: sum(1 for o in ops if o == n or o.startswith(n + ".")) for n in names}


@pytest.mark.parametrize("sixteenths", [3, 8])
@pytest.mark.parametrize("name, dtype", UNITS)
def test_exp2_poly_builds_without_spills_and_trades_mufu_for_ffma(requires_nvcc, name, dtype,
                                                                  sixteenths):  # fmt: skip
    """sm_90a builds of the bf16 d64 / d128 / d256 and fp8 d128 forwards with the option on:
    no spills, no serialized wgmma.  SASS against the default unit: each softmax (one per
    tile kind: a kernel has S = MUFU.EX2 // (4 NS) of them, NS = BLOCK_N / 8 tiles per row
    and thread, plus fewer than 4 NS other ex2s for the rescale) moves 4 * (NS * k // 16)
    exponentials (k sixteenths) off the SFU: MUFU.EX2 falls by S times that, FFMA and FADD
    (the rounding add and two exact subtractions) each grow by 3 per moved element, and no
    compare or select is added (the -inf case needs none)."""
    from sass_helpers import sass

    spec = _spec(name, dtype)
    plans = {
        k: registry.plan_forward(spec, "sm_90", DEFAULT.replace_path("hopper_fwd.exp2_poly", k))
        for k in (0, sixteenths)
    }
    _, report = cache.get_or_build(render(plans[sixteenths]), plans[sixteenths])
    assert report.spill_bytes == 0 and not report.wgmma_serialized, report
    base, on = (_counts(sass(plans[k])) for k in (0, sixteenths))
    ns = plans[0].tiles.block_n // 8
    softmaxes = base["MUFU.EX2"] // (4 * ns)
    moved = softmaxes * 4 * (ns * sixteenths // 16)
    assert softmaxes >= 2 and moved > 0
    assert base["MUFU.EX2"] - on["MUFU.EX2"] == moved, (base, on, ns)
    assert on["FFMA"] - base["FFMA"] == 3 * moved, (base, on, ns)
    assert on["FADD"] - base["FADD"] == 3 * moved, (base, on, ns)
    assert (on["FSETP"], on["FSEL"]) == (base["FSETP"], base["FSEL"]), (base, on)


def test_all_sixteenths_leave_only_the_rescale_on_the_sfu(requires_nvcc):
    """16: every P on the FMA pipe; the SFU keeps the running max's rescale factors alone."""
    from sass_helpers import sass

    spec = _spec("causal_d128")
    plan = registry.plan_forward(spec, "sm_90", DEFAULT.replace_path("hopper_fwd.exp2_poly", 16))
    _, report = cache.get_or_build(render(plan), plan)
    assert report.spill_bytes == 0 and not report.wgmma_serialized, report
    assert 0 < _counts(sass(plan))["MUFU.EX2"] < plan.tiles.block_n // 2
