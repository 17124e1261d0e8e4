"""Head dims 32, 96, 160, 192 and head_dim_v != head_dim ((192, 128) as in MLA, (128, 256)).

* every (head dims, dtype, score_mod yes/no) variant lowers for sm_80 and sm_90 and fits
  sm_80's shared memory; every head-dim pair compiles with nvcc, forward, deterministic
  backward and atomic-dQ backward, with zero register spills, for both targets (one of them
  as bf16 with a softcap, the other as fp16 without a score_mod: a covering of the product,
  see the test; compiled in parallel);
* the tile tables have an entry for every supported head dim and the atomic-dQ warp grid
  keeps every warp busy with the tables' tiles;
* the CPU op (the float reference) and its autograd give o [.., Dv] and dv [.., Dv] and
  agree with PyTorch's math SDPA, also with head_dim_v != head_dim.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from covering import pairwise, uncovered_pairs  # noqa: E402
from head_dim_cases import NEW_HEAD_DIMS, dims_id, hdim_spec  # noqa: E402
from plan_helpers import plan_backward, plan_forward  # noqa: E402

from flashgen.build import cache  # noqa: E402
from flashgen.build.render import render  # noqa: E402
from flashgen.families.fa2_bwd import atomic_dq_warp_grid  # noqa: E402
from flashgen.families.registry import compile_units  # noqa: E402
from flashgen.families.tiles import (
    ATOMIC_BACKWARD_TILES,
    BACKWARD_TILES,
    DEFAULT_TILES,
    BackwardTiles,
    backward_tile_candidates,
)  # noqa: E402
from flashgen.frontend import ir

SM80_SMEM = 163 * 1024
VARIANTS = [
    (d, dv, dtype, mod)
    for d, dv in NEW_HEAD_DIMS
    for dtype in ("fp16", "bf16")
    for mod in ("none", "softcap")
]


#: the nvcc sweep: each head-dim pair with and without a score_mod (a softcap holds more
#: registers); fp16 and bf16 tiles and register counts are the same but for conversions
COMPILED = [(d, dv, dtype, mod) for d, dv, dtype, mod in VARIANTS
            if (dtype, mod) in (("bf16", "softcap"), ("fp16", "none"))]  # fmt: skip


def _vid(v) -> str:
    d, dv, dtype, mod = v
    return f"{dims_id(d, dv)}-{dtype}-{mod}"


# ----------------------------------------------------------------------------- tables and plans
def test_tables_cover_every_supported_head_dim():
    for d in ir.SUPPORTED_HEAD_DIMS:
        assert (d, False) in DEFAULT_TILES
        assert (d, False) in BACKWARD_TILES
        assert (d, False) in ATOMIC_BACKWARD_TILES


@pytest.mark.parametrize("key", sorted(ATOMIC_BACKWARD_TILES))
def test_atomic_warp_grid_uses_every_warp_with_the_table_tiles(key):
    t = ATOMIC_BACKWARD_TILES[key]
    wm, wn = atomic_dq_warp_grid(t, key[0])
    assert wm * wn == t.dkdv_warps
    assert (key[0] // t.dkdv_dsplit // 16) % wn == 0 and (t.dkdv_block_m // 16) % wm == 0


def test_atomic_warp_grid_choices():
    # the original head dims keep their column split: min(warps, columns / 16)
    assert atomic_dq_warp_grid(BackwardTiles(64, 64, 4, 1, 64, 64, 4), 64) == (1, 4)
    assert atomic_dq_warp_grid(BackwardTiles(32, 16, 2, 1, 64, 32, 4), 128) == (1, 2)
    # 96 columns = 6 tiles over 4 warps: 2 x 2
    assert atomic_dq_warp_grid(BackwardTiles(64, 32, 4, 1, 64, 32, 4), 96) == (2, 2)
    # 80 columns (160 split in two) = 5 tiles, 2 row tiles: only 2 warps can work
    assert atomic_dq_warp_grid(BackwardTiles(64, 32, 4, 2, 64, 32, 4), 160) == (2, 1)
    # 16-row steps at 96 columns: 3 column groups of 32, one warp idle
    assert atomic_dq_warp_grid(BackwardTiles(64, 16, 4, 1, 64, 32, 4), 96) == (1, 3)


@pytest.mark.parametrize("v", VARIANTS, ids=_vid)
def test_plans_fit_shared_memory_and_render(v):
    d, dv, dtype, mod = v
    spec = hdim_spec(d, dv, dtype, mod)
    for target in ("sm_80", "sm_90"):
        fwd = plan_forward(spec, target)
        det = plan_backward(spec, target)
        atomic = plan_backward(spec, target, atomic_dq=True)
        for plan in (fwd, *det.kernels, *atomic.kernels):
            assert plan.smem_bytes <= SM80_SMEM, f"{plan.kernel_name}: {plan.smem_bytes}"
        for unit in (fwd, det.unit, atomic.unit):
            src = render(unit)
            assert f"constexpr int HEAD_DIM = {d};" in src
            assert f"constexpr int HEAD_DIM_V = {dv};" in src


def test_forward_smem_stages_o_in_the_wider_of_q_and_v():
    """sQ also stages the [BLOCK_M x Dv] output: with Dv > D it is Dv wide (the kernels
    static_assert their layout against plan.smem_bytes, so nvcc catches a mismatch)."""
    plan = plan_forward(hdim_spec(128, 256), "sm_80")
    t = plan.tiles
    assert plan.smem_bytes == (t.block_m * 256 + t.block_n * 128 + t.block_n * 256) * 2
    assert f"== {plan.smem_bytes}," in render(plan)


@pytest.mark.parametrize("d, dv", NEW_HEAD_DIMS, ids=lambda x: str(x))
def test_backward_fallback_candidates_render(d, dv):
    """The spill fallback's narrow tiles are valid too (atomic: idle warps if need be)."""
    spec = hdim_spec(d, dv, "bf16", "softcap")
    for atomic in (False, True):
        for tiles in backward_tile_candidates(spec, atomic_dq=atomic):
            plan = plan_backward(spec, "sm_80", atomic_dq=atomic, tiles=tiles)
            assert "HEAD_DIM" in render(plan.unit)


# ----------------------------------------------------------------------------- nvcc, 0 spills
TARGETS = ("sm_80", "sm_90")


def _compile(job):
    (d, dv, dtype, mod), target, unit = job
    spec = hdim_spec(d, dv, dtype, mod)
    plan = compile_units(spec, target)[unit]
    _, report = cache.get_or_build(render(plan), plan)
    return job, report


def _covering() -> list:
    """(variant, target, unit) jobs: pairwise coverings (tests/covering.py) of head-dim pair x
    variant kind (fp16 without a score_mod, bf16 with a softcap) x target for the forwards
    (FA2-class on sm_80, Hopper on sm_90: every pair builds both, one kind each) and of pair
    x kind x target x unit for the FA2-class backward units (every pair builds bwd and
    bwd_atomic, one for each target and kind; every (kind, target, unit) occurs): 24 nvcc
    runs, not the product's 72 (nor 36, every pair's every unit for both targets, before).
    The sm_80 and sm_90 FA2-class backward units of a variant render the same CUDA but for
    the kernels' names (ptxas allocates registers per arch, so the other target of a pair's
    unit is covered by the other pairs, not proven for it; ``pytest --full-product``
    builds the product); the shipped specs compile every forward and a pairwise covering of
    their FA2-class backward units (tests/unit/test_compile.py)."""
    pairs = [v[:2] for v in COMPILED[::2]]
    kinds = [v[2:] for v in COMPILED[:2]]
    variant = {v[:2] + k: v for v in COMPILED for k in kinds if v[2:] == k}
    fwd = pairwise(pairs, kinds, TARGETS)
    bwd = pairwise(pairs, kinds, TARGETS, ("bwd", "bwd_atomic"))
    return [(variant[p + k], t, "fwd") for p, k, t in fwd] + [
        (variant[p + k], t, u) for p, k, t, u in bwd
    ]


def test_the_covering_meets_every_pair_unit_and_target():
    jobs = _covering()
    assert len(jobs) == len(set(jobs))
    assert [v[:2] for v in COMPILED[::2]] == [v[:2] for v in COMPILED[1::2]]  # pairs adjacent
    pairs, kinds = {v[:2] for v in COMPILED}, {v[2:] for v in COMPILED}
    fwd = [(v[:2], v[2:], t) for v, t, u in jobs if u == "fwd"]
    bwd = [(v[:2], v[2:], t, u) for v, t, u in jobs if u != "fwd"]
    assert not uncovered_pairs(fwd, pairs, kinds, TARGETS)
    assert not uncovered_pairs(bwd, pairs, kinds, TARGETS, ("bwd", "bwd_atomic"))
    # every pair: both forwards, both backward units, both kinds and both targets among them
    assert {(p, t) for p, _, t in fwd} == {(p, t) for p in pairs for t in TARGETS}
    assert {(p, u) for p, _, _, u in bwd} == {(p, u) for p in pairs for u in ("bwd", "bwd_atomic")}
    assert {(p, t) for p, _, t, _ in bwd} == {(p, t) for p in pairs for t in TARGETS}
    assert {(p, k) for p, k, _, _ in bwd} == {(p, k) for p in pairs for k in kinds}


def test_every_head_dim_variant_compiles_without_spills(requires_nvcc):
    """The jobs of :func:`_covering` (FLASHGEN_TEST_JOBS sets the parallelism, default the
    CPU count + 1)."""
    jobs = _covering()
    workers = int(os.environ.get("FLASHGEN_TEST_JOBS", (os.cpu_count() or 1) + 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(_compile, jobs))
    problems = []
    for ((d, dv, dtype, mod), target, unit), report in results:
        assert len(report.kernels) == (1 if unit == "fwd" else 3)
        for k in report.kernels:
            assert 0 < k.registers <= 255
            if k.spill_bytes:
                problems.append(f"{dims_id(d, dv)} {dtype} {mod} {target} {unit}: {k}")
    assert not problems, "kernels spill:\n" + "\n".join(problems)


# ----------------------------------------------------------------------------- CPU op and reference
@pytest.mark.parametrize("d, dv", [(192, 128), (128, 256), (32, 32), (96, 96)], ids=str)
def test_cpu_op_and_autograd_match_sdpa(d, dv):
    torch = pytest.importorskip("torch")
    from flashgen.ops.op import build_op

    spec = hdim_spec(d, dv, "bf16", "none", causal=True)
    op = build_op(spec)
    g = torch.Generator().manual_seed(d + dv)
    b, hq, hkv, sq, sk = 1, 4, 2, 17, 33
    q = torch.randn(b, hq, sq, d, generator=g).bfloat16().requires_grad_()
    k = torch.randn(b, hkv, sk, d, generator=g).bfloat16().requires_grad_()
    v = torch.randn(b, hkv, sk, dv, generator=g).bfloat16().requires_grad_()
    o, lse = op.attention(q, k, v)
    assert o.shape == (b, hq, sq, dv) and o.dtype == torch.bfloat16
    assert lse.shape == (b, hq, sq)
    do = torch.randn(o.shape, generator=g).bfloat16()
    o.backward(do)
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == (b, hkv, sk, dv)

    # PyTorch's math SDPA in float64 (bottom-right causal, GQA by repeating k/v heads)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    rep = hq // hkv
    kk, vv = k64.repeat_interleave(rep, 1), v64.repeat_interleave(rep, 1)
    keep = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq)
    ref = torch.nn.functional.scaled_dot_product_attention(q64, kk, vv, attn_mask=keep)
    ref.backward(do.double())
    torch.testing.assert_close(o.double(), ref, atol=3e-2, rtol=3e-2)
    for ours, r in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        torch.testing.assert_close(ours.double(), r, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("d, dv", [(192, 128), (128, 256)], ids=str)
def test_cpu_op_rejects_wrong_v_head_dim(d, dv):
    torch = pytest.importorskip("torch")
    from flashgen.frontend.errors import OpInputError
    from flashgen.ops.op import build_op

    op = build_op(hdim_spec(d, dv))
    q = torch.zeros(1, 2, 5, d, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 5, d, dtype=torch.bfloat16)
    msg = rf"v: expected head_dim_v {dv} \(shape\[-1\]\), got {d}"
    with pytest.raises(OpInputError, match=msg):
        op.attention(q, k, torch.zeros(1, 2, 5, d, dtype=torch.bfloat16))
