"""``tools/energy_ablation.py`` leaves parts of the rendered Hopper forward out by text patches:
every variant's patterns must still match the template's output, and the patched source must
compile (a template change that moves a pattern fails here, not on the GPU)."""

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
        "energy_ablation", REPO / "tools" / "energy_ablation.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TOOL = _tool()


@pytest.mark.parametrize("variant", sorted(TOOL.VARIANTS))
def test_each_variant_patches_and_compiles(variant, tmp_path, requires_nvcc):
    plan = plan_forward(load_spec(REPO / "specs" / "causal_d128.yaml"), "sm_90")
    src = render(plan)
    out = TOOL.patch(src, variant)
    assert (out == src) == (variant == "base")
    (tmp_path / "k.cu").write_text(out)
    run = subprocess.run(
        nvcc_command(plan, tmp_path / "k.cu", tmp_path / "k.cubin"),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
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
