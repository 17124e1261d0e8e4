"""``tools/cta_timeline.py`` patches ``clock64`` stamps into the rendered Hopper forward at
anchor lines: every anchor must still be in the template's output, and the patched source
must compile (a template change that moves an anchor fails here, not on the GPU)."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

from flashgen.compile import nvcc_command
from flashgen.lower import plan_forward
from flashgen.render import render
from flashgen.spec import load_spec

REPO = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location(
        "cta_timeline", REPO / "tools" / "cta_timeline.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["causal_d128", "mistral_swa"])
def test_patched_source_compiles(name, tmp_path, requires_nvcc):
    tool = _tool()
    plan = plan_forward(load_spec(REPO / "specs" / f"{name}.yaml"), "sm_90")
    src = tool.patch(render(plan), plan.context["producer_regs"])
    assert src.count("clock64()") >= 12 and "fg_prof" in src
    (tmp_path / "k.cu").write_text(src)
    run = subprocess.run(
        nvcc_command(plan, tmp_path / "k.cu", tmp_path / "k.cubin"),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]


def test_missing_anchor_is_named():
    tool = _tool()
    plan = plan_forward(load_spec(REPO / "specs" / "causal_d128.yaml"), "sm_90")
    src = render(plan).replace("int it = 1;\n", "int it = 1; \n")
    with pytest.raises(ValueError, match="int it = 1;"):
        tool.patch(src, plan.context["producer_regs"])
