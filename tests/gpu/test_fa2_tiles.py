"""FlashAttention-2's own forward tiles in flashgen's FA2-class kernel (needs a GPU:
``pytest -m gpu``): d64 at 128x128x4 and d256 at 128x64x8, candidates of the FA2-class
tile sweeps against FA2 (docs/perf-notes.md), on the FA2-class kernel
(ops bound to ``Options(family="fa2")``) through the op, against the float64 reference.

Each spec gets the tiles through its ``tiles:`` override (no spill fallback then), and
the first test checks that the device's target compiles them spill-free.  Cases: both
dtypes x causal on/off, lengths 1 to 4097 with Sq != Sk and GQA, (B, S, H, D) views; the
bound and the helpers are tests/gpu/test_forward.py's.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_options  # noqa: E402
from test_forward import check, shipped, variant  # noqa: E402

from flashgen.codegen.plan import TileConfig  # noqa: E402
from flashgen.families import build as family_build  # noqa: E402
from flashgen.frontend import ir  # noqa: E402
from flashgen.ops.op import target_for_device  # noqa: E402
from flashgen.options import Options  # noqa: E402

pytestmark = pytest.mark.gpu

#: shipped spec -> FA2's forward tile for its head dim (gemma2_softcap: the d256 tile with
#: a score_mod, not timed by the sweep; correctness only).
CANDIDATES = {
    "gpt2_d64": TileConfig(128, 128, 4),
    "bidir_d256": TileConfig(128, 64, 8),
    "gemma2_softcap": TileConfig(128, 64, 8),
}


@pytest.fixture(autouse=True)
def fa2_family(monkeypatch):
    """Ops bound to ``Options(family="fa2")`` (:mod:`gpu_options`)."""
    gpu_options.use(monkeypatch, family="fa2")


def tiled(name: str, **kw) -> ir.Spec:
    """Shipped spec ``name`` (optionally another dtype / mask, see ``variant``) with its
    candidate tiles fixed by a ``tiles:`` override."""
    t = CANDIDATES[name]
    spec = variant(shipped(name), **kw)
    over = ir.TileOverride(t.block_m, t.block_n, t.num_warps)
    suffix = f"_t{t.block_m}x{t.block_n}x{t.num_warps}"
    return dataclasses.replace(spec, name=spec.name + suffix, tiles=over)


@pytest.mark.parametrize("name", sorted(CANDIDATES))
def test_candidate_tiles_compile_spill_free(name):
    spec = tiled(name)
    target = target_for_device(spec, torch.device("cuda"))
    plan, _, report = family_build.build_forward(spec, target, options=Options(family="fa2"))
    assert plan.template == "sm_80/fwd.cu.j2"
    assert plan.tiles == CANDIDATES[name]
    assert report.spill_bytes == 0, f"{name} at {plan.tiles} spills {report.spill_bytes} B"


@pytest.mark.parametrize("name", sorted(CANDIDATES))
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [True, False])
def test_dtype_and_causal(name, dtype, causal, error_bound):
    if name == "gemma2_softcap" and not causal:
        pytest.skip("the score_mod tile is checked with its own (causal) mask")
    check(tiled(name, dtype=dtype, causal=causal), 2, 4, 2, 1000, 1000, error_bound)


@pytest.mark.parametrize("name", sorted(CANDIDATES))
@pytest.mark.parametrize("sq, sk", [(1, 1), (17, 1000), (1000, 17), (127, 4097), (4097, 127)])
def test_lengths_and_gqa(name, sq, sk, error_bound):
    check(tiled(name), 1, 8, 2, sq, sk, error_bound, seed=sq + sk)


@pytest.mark.parametrize("name", sorted(CANDIDATES))
def test_bshd_views(name, error_bound):
    check(tiled(name), 2, 4, 4, 777, 1037, error_bound, bshd=True)
