"""``tools/cta_timeline.py`` patches ``clock64`` stamps into the rendered Hopper forward at
anchor lines: every anchor must still be in the template's output, and the patched source
must compile (a template change that moves an anchor fails here, not on the GPU)."""

from __future__ import annotations

import pytest
from patched_kernels import REPO, compile_source, load_tool
from plan_helpers import plan_forward

from flashgen.build.render import render
from flashgen.frontend.spec import load_spec


def _tool():
    return load_tool("cta_timeline")


@pytest.mark.parametrize("name", ["causal_d128", "mistral_swa"])
def test_patched_source_compiles(name, tmp_path, requires_nvcc):
    tool = _tool()
    plan = plan_forward(load_spec(REPO / "specs" / f"{name}.yaml"), "sm_90")
    src = tool.patch(render(plan), plan.context["producer_regs"])
    assert src.count("clock64()") >= 12 and "fg_prof" in src
    run = compile_source(plan, src, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]


def test_missing_anchor_is_named():
    tool = _tool()
    plan = plan_forward(load_spec(REPO / "specs" / "causal_d128.yaml"), "sm_90")
    src = render(plan).replace("int it = 1;\n", "int it = 1; \n")
    with pytest.raises(ValueError, match="int it = 1;"):
        tool.patch(src, plan.context["producer_regs"])


def test_stamp_rows_count_the_grids_holes():
    """The stamp buffer is indexed by the CTA's place in the launch grid, holes included: a
    grouped grid with holes has more CTAs than tiles, and the size check must count them
    (B=1, H=1680, S=4992: 65520 tiles fit the buffer's 65536 rows, the grid's 65910 do not)."""
    tool = _tool()
    plan = plan_forward(load_spec(REPO / "specs" / "causal_d128.yaml"), "sm_90")
    b, h, s = 1, 1680, 4992
    assert b * h * plan.num_m_blocks(s) <= tool.MAX_CTAS
    gx, gy, gz = plan.grid(b, h, s, heads_kv=h, seqlen_k=s)
    assert tool.launch_ctas(plan, b, h, s) == gx * gy * gz > tool.MAX_CTAS
