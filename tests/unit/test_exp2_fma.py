"""2^x on the FMA pipe (``fg::exp2_fma`` in templates/common/mma_sm80.cuh) and the Hopper
forward's ``hopper_fwd.exp2_fma_every`` option that routes part of the softmax to it."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from flashgen.build import cache
from flashgen.build.render import render
from flashgen.families import registry
from flashgen.frontend.spec import load_spec
from flashgen.options import DEFAULT

REPO = Path(__file__).resolve().parents[2]
HEADER = REPO / "templates" / "common" / "mma_sm80.cuh"


def _constants() -> tuple[float, list[float]]:
    """The rounding constant and the polynomial's coefficients as the CUDA source has them."""
    src = HEADER.read_text()
    body = src[src.index("float exp2_fma(float x)") :]
    body = body[: body.index("\n}\n")]
    magic = float(re.search(r"__fadd_rd\(xc, ([0-9.]+)f\)", body).group(1))
    c3, c2 = map(float, re.search(r"fmaf\(f, ([0-9.]+)f, ([0-9.]+)f\)", body).groups())
    c1 = float(re.search(r"fmaf\(p, f, (0\.[0-9]+)f\)", body).group(1))
    return magic, [1.0, c1, c2, c3]


def exp2_fma(x: np.ndarray) -> np.ndarray:
    """The CUDA function step by step in float32 (fmaf: one rounding of the exact value)."""
    magic, (c0, c1, c2, c3) = _constants()
    f32 = np.float32
    x = x.astype(f32)
    xc = np.maximum(x, f32(-127.0))
    r = (np.floor(xc.astype(np.float64)) + magic).astype(f32)  # __fadd_rd: floor, exactly
    f = (xc - (r - f32(magic))).astype(f32)

    def fma(a, b, c):
        return (a.astype(np.float64) * b + c).astype(f32)

    p = fma(f, np.full_like(f, c3), f32(c2))
    p = fma(p, f, f32(c1))
    p = fma(p, f, f32(c0))
    bits = p.view(np.int32) + (r.view(np.int32) << np.int32(23))
    y = bits.view(f32)
    return np.where(x < -126.0, f32(0.0), y)


def test_exp2_fma_is_within_a_bf16_ulp_where_the_softmax_uses_it():
    x = np.concatenate([np.linspace(-126.0, 0.0, 2_000_001), -np.arange(127.0), [0.0, -1e-7]])
    got = exp2_fma(x).astype(np.float64)
    want = np.exp2(x.astype(np.float32).astype(np.float64))
    rel = np.abs(got - want) / want
    assert rel.max() < 8.8e-5, rel.max()  # a bf16 ulp is 2^-8 = 3.9e-3
    assert (got[x == 0.0] == 1.0).all()


def test_exp2_fma_gives_zero_for_masked_and_tiny_scores():
    """A masked score (-inf) and anything below 2^-126 give exactly 0, as ex2.approx.ftz,
    so a fully masked row's sum stays 0 (and its lse -inf)."""
    x = np.array([-np.inf, -1e30, -200.0, -127.0, -126.5], dtype=np.float32)
    assert (exp2_fma(x) == 0.0).all()


def test_exp2_fma_every_takes_its_values_only():
    from flashgen.families.hopper_fwd import EXP2_FMA_EVERY, Options

    assert DEFAULT.hopper_fwd.exp2_fma_every == 0 and 0 in EXP2_FMA_EVERY
    for bad in (1, 5, 2.0, True, "2"):
        with pytest.raises(ValueError, match="exp2_fma_every"):
            Options(exp2_fma_every=bad)


@pytest.mark.parametrize("name", ["causal_d128", "llama3_fp8", "gpt2_d64", "bidir_d256"])
def test_exp2_fma_every_renders_and_compiles_without_spills(requires_nvcc, name):
    """Default: every exp2 on the SFU (EXP2_FMA_EVERY = 0, the template's one switch); 4: one
    8-column tile in four by the polynomial, spill-free for bf16 and fp8 at every head dim."""
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    default = render(registry.plan_forward(spec, "sm_90", DEFAULT))
    assert "constexpr int EXP2_FMA_EVERY = 0;" in default
    opts = DEFAULT.replace_path("hopper_fwd.exp2_fma_every", 4)
    plan = registry.plan_forward(spec, "sm_90", opts)
    src = render(plan)
    assert "constexpr int EXP2_FMA_EVERY = 4;" in src and "fg::softmax_exp2<EXP2_FMA_EVERY>" in src
    _, report = cache.get_or_build(src, plan)
    assert report.spill_bytes == 0 and not report.wgmma_serialized, report
