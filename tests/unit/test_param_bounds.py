"""Declared f32 param bounds reach the interval analysis (issue 22, item 10).

:func:`flashgen.analysis.maskinfo.static_env` used to give every f32 param the whole real
line, so a bound (``softcap: {type: f32, default: 50.0, above: 0}``) proved nothing about
the expressions that read it.  Now an f32 param lies within its declared ``min`` / ``max``,
widened to the float32 rounding of the bound: the op checks the value in double and the
kernel receives it rounded (``min: 0.5000000001`` admits 0.5000000001, which arrives as
0.5).
"""

from __future__ import annotations

import math
import warnings

import pytest

from flashgen.analysis.maskinfo import Range, f32_bound, static_env
from flashgen.codegen.cuda_expr import cuda_expr, index_in_bounds
from flashgen.frontend.errors import SpecError, SpecWarning
from flashgen.frontend.spec import loads_spec

HEAD = "name: t\nhead_dim: 64\ndtype: fp16\n"


def _spec(score_mod: str, decl: str, extra: str = ""):
    return loads_spec(
        f"{HEAD}score_mod: '{score_mod}'\nparams:\n  c: {{type: f32, default: 1.0{decl}}}\n{extra}"
    )


def test_f32_bounds_are_in_the_static_env():
    assert static_env(_spec("score * c", ", min: 0.25, max: 4.0"))["c"] == Range(0.25, 4.0)
    assert static_env(_spec("score * c", ""))["c"] == Range(-math.inf, math.inf)
    above = static_env(_spec("score * c", ", above: 0"))["c"]
    assert above.lo == 2.0**-149 and above.hi == math.inf  # the smallest float32 above 0
    # 0.7 is no float32: a value >= 0.7 may arrive as float32(0.7) = 0.699999988...
    r = static_env(_spec("score * c", ", min: 0.7, max: 1.1"))["c"]
    assert r.lo == 0.699999988079071 < 0.7 and r.hi == 1.100000023841858  # both widen
    assert f32_bound(0.1, lower=False) == 0.10000000149011612  # rounds up: the upper widens
    assert f32_bound(1e39, lower=True) == -math.inf  # beyond float32: no bound


def test_a_float_bound_proves_a_subscript_in_range():
    """``c > 0.0 ? i : -1`` selects the in-range column wherever ``c`` is above 0: the
    read needs no clamp (it did: an f32 param was any value)."""
    mod = "score + bias[h, c > 0.0 ? min(kv_idx, 256) : -1]"
    table = "  bias: {type: f32, shape: [num_heads, 257]}\n"
    bounded = _spec(mod, ", above: 0", table)
    free = _spec(mod, "", table)
    ix = bounded.score_mod.rhs.indices[1]
    assert index_in_bounds(ix, 257, bounded)
    assert "clamp_index" not in cuda_expr(bounded.score_mod, bounded)
    assert not index_in_bounds(free.score_mod.rhs.indices[1], 257, free)
    assert "clamp_index" in cuda_expr(free.score_mod, free)


def test_the_zero_divisor_warning_sees_the_float32_value():
    """``min: 0.5000000001`` admits a value the kernel receives as 0.5: ``c - 0.5`` is then
    0 (the warning was missing: the bound was read in double)."""
    with pytest.warns(SpecWarning, match="can be 0"):
        _spec("score / (c - 0.5)", ", min: 0.5000000001")
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpecWarning)
        _spec("score / (c - 0.5)", ", min: 0.5000001")  # float32(0.5000001) > 0.5
        _spec("score / c", ", above: 0")


def test_never_true_masks_are_judged_on_the_float32_value():
    """``c <= 0.5`` holds in the kernel for ``c`` = 0.5000000001 (it arrives as 0.5): not a
    never-true mask (it was refused as one); ``c < 0.5`` still is."""
    decl = "params:\n  c: {type: f32, default: 1.0, min: 0.5000000001}\n"
    loads_spec(f"{HEAD}mask: c <= 0.5\n{decl}")
    with pytest.raises(SpecError, match="never true"):
        loads_spec(f"{HEAD}mask: c < 0.5\n{decl}")
