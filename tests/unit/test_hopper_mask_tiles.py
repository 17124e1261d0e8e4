"""The Hopper forward's masked-tile reductions (``flashgen/families/hopper_fwd.py``:
``causal_tiles``, ``col_limit``, ``walk_from_diagonal``) as rendered: which specs get which,
the options that turn each off, and every shipped mask spec spill-free with them (nvcc, no GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
from plan_helpers import plan_forward

from flashgen.build import cache
from flashgen.build.render import render
from flashgen.frontend.spec import load_spec

REPO = Path(__file__).resolve().parents[2]


def _plan(name: str, **values):
    """The sm_90 forward of shipped spec ``name`` with ``hopper_fwd.<field>=value`` options."""
    values = {f"hopper_fwd.{k}": v for k, v in values.items()}
    return plan_forward(load_spec(REPO / "specs" / f"{name}.yaml"), "sm_90", values=values)


def _kernel(src: str) -> str:
    return src[src.index('extern "C" __global__') :]


@pytest.mark.parametrize(
    "name, causal_tiles, col_limit, walk",
    [
        ("chunked_local", True, True, True),
        ("mistral_swa", True, True, True),
        ("prefix_lm", True, True, False),  # causal under ||: no walk from the diagonal
        ("causal_d128", False, True, True),  # plain causal: its masked loop is causal alone
        ("document_mask", False, True, True),  # a block table: the table's classes only
        ("alibi", False, True, True),
        ("gemma2_softcap", False, False, True),  # head_dim 256 with a score_mod: no col_limit
        ("bidir_d256", False, True, False),
    ],
)
def test_which_specs_take_which_reduction(name, causal_tiles, col_limit, walk):
    plan = _plan(name)
    ctx = plan.context
    assert (ctx["causal_tiles"], ctx["col_limit"], ctx["walk_from_diagonal"]) == (
        causal_tiles,
        col_limit,
        walk,
    )
    body = _kernel(render(plan))
    assert ("fg::iv::CAUSAL_ONLY" in body) == causal_tiles
    assert ("fg::iv::NO_CAUSAL" in body) == causal_tiles
    assert ("const int diag_k" in body) == (walk and not ctx["block_table"])
    if causal_tiles:
        assert "fg::iv::causal_bits(" in render(plan)


def test_switches_turn_each_reduction_off(monkeypatch):
    on = _kernel(render(_plan("chunked_local")))
    assert "col_lim[" in on and "fg::iv::CAUSAL_ONLY" in on and "diag_k" in on
    src = render(_plan("chunked_local", causal_tiles=False))
    assert "fg::iv::CAUSAL_ONLY" not in _kernel(src) and "col_lim[" in src
    assert "fg::iv::causal_bits(" not in src  # the plain classifier
    off = dict(causal_tiles=False, col_limit=False)
    assert "col_lim[" not in render(_plan("chunked_local", **off))
    off = _kernel(render(_plan("chunked_local", **off, walk_from_diagonal=False)))
    assert "diag_k" not in off and "walk_start = n_kv_blocks - 1;" in off


def test_chunk_columns_divide_unsigned_in_the_hopper_forward_only(monkeypatch):
    spec = load_spec(REPO / "specs" / "chunked_local.yaml")
    assert "fg_inv0.div_nn(kv_idx)" in _kernel(render(plan_forward(spec, "sm_90")))
    fa2 = plan_forward(spec, "sm_90", family="fa2")  # spilled with div_nn (4 bytes)
    assert "div_nn(kv_idx)" not in _kernel(render(fa2))
    off = plan_forward(spec, "sm_90", values={"hopper_fwd.nonneg_div": False})
    assert "div_nn(kv_idx)" not in _kernel(render(off))


def test_warp_zero_alone_finds_the_first_block(monkeypatch):
    """single_walk: the non-persistent kernel without a block table hands warp 0's first block
    to the other warps through 8 more bytes of shared memory."""
    spec = load_spec(REPO / "specs" / "chunked_local.yaml")
    plan = plan_forward(spec, "sm_90")
    body = _kernel(render(plan))
    assert plan.context["single_walk"] and "first_block = *first_slot" in body
    assert "if (threadIdx.x < 32) {\n        first_block = prev_live(walk_start, cls);" in body
    persistent = plan_forward(spec, "sm_90", persistent="static")
    assert not persistent.context["single_walk"] and "first_slot" not in render(persistent)
    doc = plan_forward(load_spec(REPO / "specs" / "document_mask.yaml"), "sm_90")
    assert not doc.context["single_walk"] and "first_slot" not in render(doc)
    off = plan_forward(spec, "sm_90", values={"hopper_fwd.single_walk": False})
    assert not off.context["single_walk"] and "first_slot" not in render(off)
    assert off.smem_bytes == plan.smem_bytes - 8


def test_causal_only_tiles_run_the_causal_test_alone():
    """chunked_local's CAUSAL_ONLY branch has no division (the chunk test), its NO_CAUSAL one
    no causal test; the generic branch both."""
    body = _kernel(render(_plan("chunked_local")))
    start = body.index("if (tile_cls & fg::iv::CAUSAL_ONLY)")
    nc = body.index("} else if (tile_cls & fg::iv::NO_CAUSAL)", start)
    generic = body.index("} else {", nc)
    end = body.index("// online", generic) if "// online" in body[generic:] else generic + 4000
    causal_only, no_causal, rest = body[start:nc], body[nc:generic], body[generic:end]
    assert ".div(" not in causal_only and "seqlen_k - seqlen_q" in causal_only
    assert ".div(" in no_causal and "min(lim, q_row + seqlen_k - seqlen_q)" not in no_causal
    assert ".div(" in rest and "IS_CAUSAL" in rest


@pytest.mark.parametrize("name", ["chunked_local", "mistral_swa", "prefix_lm", "alibi"])
@pytest.mark.parametrize("persistent", [False, "static"])
def test_mask_specs_compile_without_spills(name, persistent, requires_nvcc):
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    plan = plan_forward(spec, "sm_90", persistent=persistent)
    assert plan.context["col_limit"]
    _, report = cache.get_or_build(render(plan), plan)
    assert report.spill_bytes == 0, report.log
