"""``tools/energy_ablation.py`` leaves parts of the rendered Hopper forward out by text patches:
every variant's patterns must still match the template's output, and the patched source must
compile (a template change that moves a pattern fails here, not on the GPU)."""

from __future__ import annotations

import pytest
from patched_kernels import REPO, compile_source, load_tool
from plan_helpers import plan_forward

from flashgen.build.render import render
from flashgen.frontend.spec import load_spec


def _tool():
    return load_tool("energy_ablation")


TOOL = _tool()


@pytest.mark.parametrize("variant", sorted(TOOL.VARIANTS))
def test_each_variant_patches_and_compiles(variant, tmp_path, requires_nvcc):
    plan = plan_forward(load_spec(REPO / "specs" / "causal_d128.yaml"), "sm_90")
    src = render(plan)
    out = TOOL.patch(src, variant)
    assert (out == src) == (variant == "base")
    run = compile_source(plan, out, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("name", ["mistral_swa", "gpt2_d64", "gemma2_softcap"])
def test_patterns_match_other_shipped_specs(name):
    plan = plan_forward(load_spec(REPO / "specs" / f"{name}.yaml"), "sm_90")
    src = render(plan)
    for variant in TOOL.VARIANTS:
        TOOL.patch(src, variant)


def test_missing_pattern_is_named():
    plan = plan_forward(load_spec(REPO / "specs" / "causal_d128.yaml"), "sm_90")
    src = render(plan).replace(
        "acc_o[4 * j + i] *= alpha[i / 2];", "acc_o[4 * j + i] *= alpha[i >> 1];"
    )
    with pytest.raises(ValueError, match="no_o_rescale"):
        TOOL.patch(src, "no_o_rescale")
