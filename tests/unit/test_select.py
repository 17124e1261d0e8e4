"""Spill fallback (``flashgen.families.build``): a spec whose expressions need more registers than
the tile tables leave free still builds, with smaller tiles, and never spills."""

from __future__ import annotations

from plan_helpers import forward_tile_candidates, plan_forward

from flashgen.build import cache
from flashgen.build.render import render
from flashgen.codegen.plan import TileConfig
from flashgen.families.build import build_backward, build_forward
from flashgen.frontend.spec import loads_spec

RELPOS = """\
name: prefix_lm_relpos
head_dim: 64
dtype: fp16
mask: kv_idx < prefix || causal
score_mod: score + rel_bias[h, min(abs(q_idx - kv_idx), 31)]
params:
  prefix: {type: i32, default: 64}
  rel_bias: {type: f32, shape: [num_heads, 32]}
"""


def test_fallback_tiles_are_taken_when_the_chosen_ones_spill(requires_nvcc):
    spec = loads_spec(RELPOS, "relpos.yaml")
    first = forward_tile_candidates(spec, "sm_90")[0]
    plan0 = plan_forward(spec, "sm_90", tiles=first)
    _, rep0 = cache.get_or_build(render(plan0), plan0)
    plan, cubin, report = build_forward(spec, "sm_90")
    assert report.spill_bytes == 0 and cubin.stat().st_size > 0
    if rep0.spill_bytes:  # today's nvcc: the table's 128x64 spills on this score_mod
        assert plan.tiles != first
    else:
        assert plan.tiles == first
    bplan, _, breport = build_backward(spec, "sm_90")
    assert breport.spill_bytes == 0 and len(breport.kernels) == 3


def test_spec_tiles_disable_the_fallback():
    spec = loads_spec(RELPOS + "tiles: {block_m: 128, block_n: 64, num_warps: 4}\n", "t.yaml")
    assert forward_tile_candidates(spec, "sm_80") == [TileConfig(128, 64, 4)]
    plain = loads_spec(RELPOS, "relpos.yaml")
    cands = forward_tile_candidates(plain, "sm_80")
    assert len(cands) == len(set(cands)) > 1


D256_COND = """\
name: d256_cond
head_dim: 256
dtype: fp16
targets: [sm_80]
mask: "q_idx >= kv_idx ? true : kv_idx - q_idx < 4"
score_mod: max(score, -10.0) * 0.5
"""


def test_atomic_backward_splits_the_columns_further_when_narrow_steps_still_spill(requires_nvcc):
    """head_dim 256 with a score_mod and a conditional mask: the atomic-dQ unit spills at
    the table's dsplit 2 with either step width (104 and 148 bytes, nvcc 13.0); the third
    candidate (dsplit 4: 64 columns of dK/dV per CTA) does not."""
    spec = loads_spec(D256_COND, "d256_cond.yaml")
    plan, _, report = build_backward(spec, "sm_80", atomic_dq=True)
    assert report.spill_bytes == 0, report
    assert plan.dkdv.context["dkdv_dsplit"] == 4


HEAD_DIMS = (32, 64, 96, 128, 160, 192, 256)


def test_every_forward_candidate_lowers():
    """Each fallback candidate is a legal plan: the Hopper d256 step's 80 keys halved to 40
    (not a multiple of 16) raised ValueError, ending the fallback search at its first spill."""
    import itertools

    from flashgen.families.common import SMEM_LIMIT

    for d, dv, mod, varlen in itertools.product(HEAD_DIMS, HEAD_DIMS, (0, 1), (0, 1)):
        spec = loads_spec(
            f"name: x\nhead_dim: {d}\nhead_dim_v: {dv}\ndtype: bf16\nmask: kv_idx < q_idx + 7\n"
            + ("score_mod: score * 0.5\n" if mod else "")
            + ("varlen: true\n" if varlen else "")
        )
        for target in ("sm_80", "sm_90"):
            for tiles in forward_tile_candidates(spec, target):
                plan = plan_forward(spec, target, tiles=tiles)
                assert plan.smem_bytes <= SMEM_LIMIT[target]


def test_pinned_tiles_beyond_the_targets_shared_memory_are_refused():
    """180 KB of shared memory fits sm_90 (227 KB) but not sm_80 (A100: 163 KB): once it
    compiled and reported success, to fail at launch on the GPU; then the build refused it.
    The checker refuses it when the spec loads, at the ``tiles:`` line, naming the need, the
    limit and the target (a spec for sm_90 alone loads and plans)."""
    import pytest

    from flashgen.frontend.errors import SpecError

    text = (
        "name: big\nhead_dim: 192\nhead_dim_v: 256\ndtype: fp16\n{targets}"
        "tiles: {{block_m: 128, block_n: 128, num_warps: 8}}\n"
    )
    with pytest.raises(SpecError) as err:
        loads_spec(text.format(targets=""), "big.yaml")
    msg = str(err.value)
    assert msg.startswith("big.yaml:5:"), msg
    assert "need at least 180224 B of shared memory" in msg
    assert "the limit of a CTA on sm_80 is 166912 B" in msg
    assert "tiles: {block_m: 128" in msg  # the line, echoed
    spec = loads_spec(text.format(targets="targets: [sm_90]\n"), "big.yaml")
    assert plan_forward(spec, "sm_90").smem_bytes == 180224


NOT_CAUSAL_OR = """\
name: not_causal_or
head_dim: 128
dtype: bf16
mask: "!causal || kv_idx % 7 == 0"
"""


def test_hopper_mask_tiles_are_dropped_when_they_spill(requires_nvcc):
    """The Hopper forward's masked-tile reductions (causal_tiles, col_limit) cost registers:
    with them this mask's kernel spilled (52 bytes, nvcc 13.0; none with the templates of
    session 8); the fallback keeps the table's tiles and drops the reductions before anything
    but the head groups (dropped first, see tests/unit/test_select_order.py)."""
    spec = loads_spec(NOT_CAUSAL_OR, "not_causal_or.yaml")
    first = plan_forward(spec, "sm_90")
    assert first.context["causal_tiles"] and first.context["col_limit"]
    _, rep0 = cache.get_or_build(render(first), first)
    plan, _, report = build_forward(spec, "sm_90")
    assert report.spill_bytes == 0 and plan.tiles == first.tiles
    if rep0.spill_bytes:
        assert not plan.context["causal_tiles"] and not plan.context["col_limit"]
    else:
        assert plan.context["causal_tiles"]


TWO_CHUNKS = """\
name: two_chunks
head_dim: 128
dtype: bf16
targets: [sm_90]
mask: >-
  causal && (q_idx + seqlen_k - seqlen_q) / chunk == kv_idx / chunk
  && (q_idx + seqlen_k - seqlen_q) / chunk2 == kv_idx / chunk2
params:
  chunk: {type: i32, default: 8192, min: 1}
  chunk2: {type: i32, default: 4096, min: 1}
"""


def test_the_persistent_warp_walk_is_dropped_when_the_producer_spills(requires_nvcc):
    """A mask whose classifier divides twice (chunked_local's test at two chunk sizes): the
    persistent producer's warp-wide walk spills at the sparse calls' 128 x 128 tiles (20
    bytes, nvcc 13.0; no other feature frees the producer's registers), ``fg::iv::prev_live``
    does not.  The sparse calls' default kernel (persistent ``dynamic``,
    ``Options.sparse_persistent``) keeps the 128 x 128 Hopper tiles with the serial walk, not the
    FA2-class 64 x 64 ones every warp-walk variant fell back to."""
    from flashgen.families.tiles import sparse_tiles
    from flashgen.options import DEFAULT

    spec = loads_spec(TWO_CHUNKS, "two_chunks.yaml")
    alt = sparse_tiles(spec, forward_tile_candidates(spec, "sm_90")[0])
    assert alt == TileConfig(128, 128, 12)
    walk = plan_forward(spec, "sm_90", tiles=alt, persistent="dynamic")
    assert walk.context["warp_walk"]
    _, rep = cache.get_or_build(render(walk), walk)
    assert rep.spill_bytes  # today's nvcc (else this test checks nothing)
    assert DEFAULT.sparse_persistent == "dynamic" and DEFAULT.hopper_fwd.warp_walk
    plan, _, report = build_forward(spec, "sm_90", sparse=True, persistent="dynamic")
    assert report.spill_bytes == 0 and not report.wgmma_serialized
    assert plan.tiles == alt and plan.context["scheduler"] == "dynamic"
    assert not plan.context["warp_walk"]
