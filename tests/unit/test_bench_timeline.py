"""``flashgen bench --timeline`` (:mod:`flashgen.bench.timeline`) reads ``clock64`` stamps that
the probe point ``timeline`` of ``templates/sm_90/fwd.cu.j2`` renders: every slot the report
reads must be stamped, nothing may be rendered without the probe, and the probed source must
compile."""

from __future__ import annotations

import re

import pytest
from patched_kernels import REPO, compile_source
from plan_helpers import plan_forward

from flashgen.bench import timeline
from flashgen.build.render import render
from flashgen.frontend.spec import load_spec

TOOL = timeline


def _plan(name: str, **kw):
    return plan_forward(load_spec(REPO / "specs" / f"{name}.yaml"), "sm_90", **kw)


def _slots(src: str) -> set[int]:
    """The fgp slots the source stamps (``fgp[i] = ``, ``fgp[c ? i : j] = ``)."""
    out = set()
    for m in re.finditer(r"fgp\[([^\]]+)\] = ", src):
        out |= {int(x) for x in re.findall(r"\b\d+\b", m.group(1)) if x != "128"}
    return out


@pytest.mark.parametrize("name", ["causal_d128", "mistral_swa", "document_mask"])
def test_every_slot_is_stamped_only_with_the_probe(name):
    plan = _plan(name)
    base = render(plan)
    assert "fgp" not in base and "fg_prof" not in base
    src = TOOL.timeline_source(plan)
    assert f"fg_prof[{TOOL.MAX_CTAS} * {TOOL.SLOTS}]" in src
    want = set(TOOL.STAMPS)
    if not plan.context["single_walk"] or plan.context["block_table"]:
        want -= {15}  # the single walk's first block
    if plan.context["block_table"]:
        want -= {19, 21}  # the first K / V go out after the barrier there
    assert _slots(src) == want
    assert max(want) < TOOL.SLOTS


def test_persistent_kernel_renders_no_stamps():
    plan = _plan("causal_d128", persistent="dynamic")
    assert TOOL.timeline_source(plan) == render(plan)


@pytest.mark.parametrize("name", ["causal_d128", "mistral_swa"])
def test_probed_source_compiles(name, tmp_path, requires_nvcc):
    plan = _plan(name)
    run = compile_source(plan, TOOL.timeline_source(plan), tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]


def test_stamp_rows_count_the_grids_holes():
    """The stamp buffer is indexed by the CTA's place in the launch grid, holes included: a
    grouped grid with holes has more CTAs than tiles, and the size check must count them
    (B=1, H=1680, S=4992: 65520 tiles fit the buffer's 65536 rows, the grid's 65910 do not)."""
    plan = _plan("causal_d128")
    b, h, s = 1, 1680, 4992
    assert b * h * plan.num_m_blocks(s) <= TOOL.MAX_CTAS
    gx, gy, gz = plan.grid(b, h, s, heads_kv=h, seqlen_k=s)
    assert TOOL.launch_ctas(plan, b, h, s) == gx * gy * gz > TOOL.MAX_CTAS
