"""Which kernels a GPU gets (``op.family_for``, ``target_for_device``) from its compute
capability, faked on the CPU; the sm_80 units embed compute_80 PTX beside their SASS (checked
with cuobjdump) so newer GPUs JIT them, and the sm_90a units stay SASS-only."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from flashgen.build import compile as fcompile
from flashgen.build.compile import nvcc_command
from flashgen.build.render import render
from flashgen.codegen.abi import GENCODE, target_for_capability
from flashgen.families import registry
from flashgen.frontend.spec import load_spec
from flashgen.options import Options

REPO = Path(__file__).resolve().parents[2]
SPEC = load_spec(REPO / "specs" / "gpt2_d64.yaml")


@pytest.mark.parametrize(
    "cap, target",
    [((8, 0), "sm_80"), ((8, 6), "sm_80"), ((8, 9), "sm_80"), ((9, 0), "sm_90"),
     ((10, 0), "sm_80"), ((10, 3), "sm_80"), ((12, 0), "sm_80")],
)  # fmt: skip
def test_target_for_capability(cap, target):
    assert target_for_capability(*cap) == target


@pytest.mark.parametrize("cap", [(7, 5), (7, 0), (6, 1)])
def test_below_8_is_refused_naming_the_minimum(cap):
    with pytest.raises(ValueError, match=rf"compute capability {cap[0]}\.{cap[1]}: .*8\.0"):
        target_for_capability(*cap)


def test_family_per_capability():
    spec = load_spec(REPO / "specs" / "causal_d128.yaml")
    ampere = registry.for_capability(spec, (8, 6))
    assert (ampere.target, ampere.family, ampere.forward, ampere.ptx_jit) == (
        "sm_80", "FA2-class", "fa2_fwd", False
    )
    assert "FA2-class kernels, sm_80 SASS" in str(ampere)
    hopper = registry.for_capability(spec, (9, 0))
    assert (hopper.target, hopper.family, hopper.forward, hopper.backward) == (
        "sm_90", "Hopper", "hopper_fwd", "hopper_bwd"
    )
    forced = registry.for_capability(spec, (9, 0), Options(family="fa2"))
    assert (forced.target, forced.family, forced.forward) == ("sm_90", "FA2-class", "fa2_fwd")
    assert "FA2-class kernels compiled for sm_90a" in str(forced)
    for cap in ((10, 0), (12, 0)):
        newer = registry.for_capability(spec, cap)
        assert (newer.target, newer.family, newer.forward, newer.ptx_jit) == (
            "sm_80", "FA2-class", "fa2_fwd", True
        )
        assert "through PTX JIT" in str(newer) and "9.0 only" in str(newer)


def test_op_family_for_fake_devices(monkeypatch):
    torch = pytest.importorskip("torch")
    import flashgen
    from flashgen.ops import validation

    op = flashgen.load(REPO / "specs" / "causal_d128.yaml")
    assert op.family_for((10, 0)).ptx_jit and op.family_for((9, 0)).family == "Hopper"
    with pytest.raises(RuntimeError, match=r"compute capability 7\.5"):
        op.family_for((7, 5))
    with pytest.raises(ValueError, match="CUDA device"):
        op.family_for("cpu")
    caps = {"cap": (12, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: caps["cap"])
    dev = torch.device("cuda", 0)
    assert op.family_for(dev).ptx_jit and op.family_for("cuda:0").target == "sm_80"
    assert validation.target_for_device(op.spec, dev) == "sm_80"
    caps["cap"] = (9, 0)
    assert validation.target_for_device(op.spec, dev) == "sm_90"
    caps["cap"] = (7, 5)
    with pytest.raises(RuntimeError, match=r"cuda:0: compute capability 7\.5"):
        validation.target_for_device(op.spec, dev)


def test_sm_80_units_ask_for_ptx_and_a_fatbin():
    assert GENCODE["sm_80"] == "-gencode=arch=compute_80,code=[sm_80,compute_80]"
    for unit, plan in registry.compile_units(SPEC, "sm_80").items():
        plans = plan.kernels if hasattr(plan, "kernels") else [plan]
        for p in [getattr(plan, "unit", plan), *plans]:
            assert p.gencode == GENCODE["sm_80"], unit
        cmd = nvcc_command(getattr(plan, "unit", plan), "k.cu", "k.bin", nvcc="nvcc")
        assert cmd[1] == "-fatbin" and GENCODE["sm_80"] in cmd, cmd
    hopper = registry.compile_units(SPEC, "sm_90")["fwd"]
    assert nvcc_command(hopper, "k.cu", "k.bin", nvcc="nvcc")[1:2] == ["-cubin"]
    assert not fcompile.embeds_ptx(GENCODE["sm_90"])


def test_a_compiled_sm_80_unit_holds_ptx(requires_nvcc):
    """cuobjdump (``pip install nvidia-cuda-cuobjdump``) lists the sm_80 SASS and the
    compute_80 PTX in the forward unit nvcc builds for sm_80."""
    import shutil

    cuobjdump = fcompile.wheel_tool("cuobjdump") or shutil.which("cuobjdump")
    if cuobjdump is None:
        pytest.skip("no cuobjdump (pip install nvidia-cuda-cuobjdump)")
    from flashgen.build import cache

    plan = registry.compile_units(SPEC, "sm_80")["fwd"]
    out, report = cache.get_or_build(render(plan), plan)  # (test_compile.py builds it too)
    assert report.kernel(plan.kernel_name).spill_bytes == 0
    listing = subprocess.run([cuobjdump, "--list-elf", "--list-ptx", str(out)],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert ".sm_80.cubin" in listing and ".sm_80.ptx" in listing, listing
    ptx = subprocess.run([cuobjdump, "--dump-ptx", str(out)], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    assert ".target sm_80" in ptx and f".entry {plan.kernel_name}" in ptx
