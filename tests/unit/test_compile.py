"""nvcc compilation: every shipped spec compiles for sm_80 and sm_90 without spills and
without ptxas serializing its wgmma instructions (forward, sparse-mask forward and Hopper
backward units for every spec and target; deterministic and atomic-dQ FA2-class backward
units as a pairwise covering of spec x target x unit)."""

from __future__ import annotations

import difflib
import functools
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
from plan_helpers import plan_backward, plan_forward
from shipped_specs import FA2_TARGETS, distinct_code, fa2_backward_covering, twins

from flashgen.build import cache
from flashgen.build.compile import (
    NVCC_FLAGS,
    CompileError,
    CompileReport,
    NvccNotFoundError,
    compile_source,
    find_nvcc,
    nvcc_command,
    nvcc_version,
    parse_ptxas,
)
from flashgen.build.render import render
from flashgen.families.build import build_backward
from flashgen.families.registry import compile_units, grad_params
from flashgen.frontend.spec import load_spec

#: the shipped specs with a prefill (v_from_k specs are decode only: tests/unit/test_decode_mla.py)
SPECS = [
    p for p in sorted((Path(__file__).resolve().parents[2] / "specs").glob("*.yaml"))
    if not load_spec(p).v_from_k
]  # fmt: skip
#: those the nvcc sweeps compile: one spec per kernel code (tests/shipped_specs.py)
COMPILED = distinct_code(SPECS)

PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'bar' for 'sm_80'
ptxas info    : Function properties for bar
    256 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 24 registers, used 0 barriers, 256 bytes cumulative stack size
ptxas info    : Compile time = 11.116 ms
ptxas info    : Compiling entry function 'foo' for 'sm_80'
ptxas info    : Function properties for foo
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 1 barriers, 1024 bytes smem, 364 bytes cmem[0]
"""


def test_parse_ptxas_reads_every_kernel():
    bar, foo = parse_ptxas(PTXAS_LOG)
    assert (bar.name, bar.registers, bar.stack_frame) == ("bar", 24, 256)
    assert (bar.spill_stores, bar.spill_loads, bar.spill_bytes) == (8, 12, 20)
    assert (foo.name, foo.registers, foo.smem, foo.barriers, foo.spill_bytes) == (
        "foo",
        10,
        1024,
        1,
        0,
    )


SERIALIZED_LOG = """\
ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are \
serialized due to program dependence on compiler-inserted WG.AR in divergent path in the \
function 'k_fwd'
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k_fwd' for 'sm_90a'
ptxas info    : Function properties for k_fwd
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers
"""


def test_parse_ptxas_reads_wgmma_serialization():
    (k,) = parse_ptxas(SERIALIZED_LOG)
    assert (k.name, k.registers, k.spill_bytes) == ("k_fwd", 168, 0)
    assert k.wgmma_serialized.startswith("program dependence on compiler-inserted WG.AR")
    rep = CompileReport("sm_90", "sm_90a", (k,), 1.0, "13.0.88", (), SERIALIZED_LOG)
    assert rep.wgmma_serialized == ("k_fwd",)
    assert CompileReport.from_dict(rep.to_dict()) == rep
    # a report cached before the field existed: read from its log
    old = rep.to_dict()
    del old["kernels"][0]["wgmma_serialized"]
    assert CompileReport.from_dict(old).wgmma_serialized == ("k_fwd",)
    assert parse_ptxas(PTXAS_LOG)[0].wgmma_serialized == ""


def test_report_round_trips_through_json_dict():
    rep = CompileReport("sm_80", "sm_80", parse_ptxas(PTXAS_LOG), 1.5, "13.0.88", ("nvcc",), "x")
    again = CompileReport.from_dict(rep.to_dict())
    assert again == rep
    assert rep.registers == 24 and rep.spill_bytes == 20 and rep.smem == 1024


def test_command_has_no_fast_math_and_targets_the_plan():
    plan = plan_forward(load_spec(SPECS[0]), "sm_90")
    cmd = nvcc_command(plan, "k.cu", "k.cubin", nvcc="nvcc")
    assert "--use_fast_math" not in cmd and "-use_fast_math" not in cmd
    assert "-gencode=arch=compute_90a,code=sm_90a" in cmd
    assert set(NVCC_FLAGS) <= set(cmd) and cmd[-3:] == ["-o", "k.cubin", "k.cu"]


def test_missing_nvcc_is_reported_clearly(monkeypatch):
    monkeypatch.setenv("FLASHGEN_NVCC", "/nonexistent/nvcc")
    with pytest.raises(NvccNotFoundError, match="FLASHGEN_NVCC"):
        find_nvcc()


def test_nvcc_version(requires_nvcc):
    v = nvcc_version()
    assert v[0].isdigit() and "." in v


def test_compile_error_carries_nvcc_output(requires_nvcc, tmp_path):
    plan = SimpleNamespace(
        target="sm_80",
        arch="sm_80",
        kernel_name="broken",
        gencode="-gencode=arch=compute_80,code=sm_80",
    )
    with pytest.raises(CompileError) as ei:
        compile_source(
            'extern "C" __global__ void broken() { undeclared_thing(); }',
            plan,
            tmp_path / "x.cubin",
        )
    assert "undeclared_thing" in ei.value.output
    assert "broken" in str(ei.value)
    assert not (tmp_path / "x.cubin").exists()


def _build(path: Path, target: str, unit: str):
    """Compile ``unit`` as the op runs it: the Hopper backward units through
    :func:`build_backward`'s candidates (at head_dim 64 the 64-query steps where the 128-query
    ones spill), which must still be the wgmma kernels."""
    spec = load_spec(path)
    if unit.startswith("bwd_wgmma"):
        grads = grad_params(spec) if unit.endswith("_dparam") else ()
        plan, cubin, report = build_backward(spec, target, hopper=True, param_grads=grads)
        assert plan.wgmma, f"{spec.name}/{target}/{unit}: every Hopper candidate spills"
        return spec.name, target, unit, cubin, report
    plan = compile_units(spec, target)[unit]
    cubin, report = cache.get_or_build(render(plan), plan)
    return spec.name, target, unit, cubin, report


FA2_BWD = ("bwd", "bwd_atomic")
FA2_BWD_DPARAM = ("bwd_dparam", "bwd_atomic_dparam")


@functools.cache
def _units_of(path: Path, target: str) -> dict:
    """``compile_units`` of the spec at ``path`` for ``target`` (none for a target it lacks)."""
    spec = load_spec(path)
    return compile_units(spec, target) if target in spec.targets else {}


def _sweep() -> list[tuple[Path, str, str]]:
    """(spec path, target, unit) of the sweep below: every spec's forward on each of its
    targets (FA2-class on sm_80, Hopper on sm_90: different kernels), the sparse-mask forward,
    the Hopper backward and the Hopper dparam unit wherever there are, and the FA2-class
    backward units (deterministic and atomic-dQ, with and without param gradients) as the
    pairwise coverings of tests/shipped_specs.py's :func:`fa2_backward_covering`."""
    units = {(p, t): _units_of(p, t) for p in COMPILED for t in FA2_TARGETS}
    jobs = [(p, t, "fwd") for (p, t), us in units.items() if "fwd" in us]
    jobs += [
        (p, "sm_90", u)
        for p in COMPILED
        for u in ("fwd_sparse", "bwd_wgmma", "bwd_wgmma_dparam")
        if u in units[p, "sm_90"]
    ]
    by_name = {load_spec(p).name: p for p in COMPILED}
    for kinds in (FA2_BWD, FA2_BWD_DPARAM):
        names = [
            n for n, p in by_name.items() if all(kinds[0] in units[p, t] for t in FA2_TARGETS)
        ]
        jobs += [(by_name[n], t, u) for n, t, u in fa2_backward_covering(names, kinds)]
    return jobs


def test_the_sweep_covers_every_unit_kind_and_target_pairwise():
    """Every spec's forward on every target and every sm_90-only unit; every FA2-class backward
    unit kind of every spec, both targets for every spec, every (target, unit kind); the
    dparam forms for every trainable spec alike."""
    jobs = _sweep()
    assert len(jobs) == len(set(jobs))
    full = {(p, t, u) for p in COMPILED for t in FA2_TARGETS for u in _units_of(p, t)}
    fa2 = set(FA2_BWD + FA2_BWD_DPARAM)
    assert {j for j in full if j[2] not in fa2 and not j[2].endswith("_sink")} <= set(jobs)
    for kinds in (FA2_BWD, FA2_BWD_DPARAM):
        have = [j for j in full if j[2] in kinds]
        mine = [j for j in jobs if j[2] in kinds]
        assert {p for p, _, _ in have} == {p for p, _, _ in mine}
        assert {(p, u) for p, _, u in have} == {(p, u) for p, _, u in mine}
        assert {(p, t) for p, t, _ in have} == {(p, t) for p, t, _ in mine}
        assert {(t, u) for _, t, u in mine} == {(t, u) for t in FA2_TARGETS for u in kinds}


def test_the_fa2_backward_units_render_alike_for_both_targets():
    """What lets the sweep build a spec's FA2-class backward unit for one target: the sm_80
    and sm_90 units render the same CUDA but for the kernels' names and, for a window mask,
    the sm_90 tile classifier's causal bits (the atomic unit's vector reduction is an
    ``#if __CUDA_ARCH__ >= 900`` in both)."""

    def code(plan):
        src = render(plan)
        for name in sorted(set(re.findall(r"\bflashgen_\w+", src)), key=len, reverse=True):
            src = src.replace(name, "K")
        return src.splitlines()

    for p in COMPILED:
        a, b = (_units_of(p, t) for t in FA2_TARGETS)
        for u in set(a) & set(b) & set(FA2_BWD + FA2_BWD_DPARAM):
            diff = difflib.unified_diff(code(a[u]), code(b[u]), lineterm="", n=0)
            changed = [x[1:].strip() for x in diff if x[:1] in "+-" and x[:3] not in ("+++", "---")]
            assert all(
                x.startswith("const fg::iv::") or x.startswith("return fg::iv::")
                and "tile_class(" in x for x in changed
            ), (p.stem, u, changed)  # fmt: skip


def test_every_shipped_spec_compiles_without_spills(requires_nvcc):
    """The units of :func:`_sweep`, compiled in parallel through the (session) cache (forward,
    sparse-mask forward and Hopper backward units of every spec, the FA2-class deterministic
    and atomic-dQ backward units as a pairwise covering of spec x target x unit, with and
    without param gradients); every kernel in them (each backward unit holds three) is
    checked.  A spec whose kernels are an earlier one's but for their names (llama3_gqa:
    causal_d128's) is not compiled twice (the next test)."""
    assert SPECS, "no specs shipped"
    names = ("fwd", "bwd", "bwd_atomic")
    # (COMPILED[0], alibi, has a trainable param: its dparam units follow, checked below)
    first = tuple(compile_units(load_spec(COMPILED[0]), "sm_80"))
    assert first[:3] == names and all(u.endswith("_dparam") for u in first[3:])
    units = _sweep()
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda ptu: _build(*ptu), units))
    problems = []
    for name, target, unit, cubin, report in results:
        assert cubin.stat().st_size > 0
        expected = 1 if unit.startswith("fwd") else 3
        assert len(report.kernels) == expected, f"{name}/{target}/{unit}: {report.kernels}"
        for k in report.kernels:
            assert 0 < k.registers <= 255
            if k.spill_bytes or k.wgmma_serialized:
                problems.append(f"{name}/{target}/{unit}: {k}")
    assert not problems, "kernels spill or serialize their wgmmas:\n" + "\n".join(problems)


def test_a_spec_left_out_of_the_sweeps_renders_its_twins_units():
    """The shipped specs the nvcc sweeps leave out (tests/shipped_specs.py: llama3_gqa) render,
    on every target, the same units as the spec of the same code they compile (the forward,
    backward and decode units), but for the spec's name."""
    from flashgen.families import decode

    left_out = twins(sorted(SPECS[0].parent.glob("*.yaml")))
    assert {p.stem for p in left_out} == {"llama3_gqa"}
    for path, first in left_out.items():
        spec, twin = load_spec(path), load_spec(first)

        def units(s, target):
            out = {u: render(plan) for u, plan in compile_units(s, target).items()}
            for ragged in (False, True):
                out[f"decode_{ragged}"] = render(decode.plan(s, target, ragged=ragged))
            return {u: src.replace(s.name, "NAME") for u, src in out.items()}

        for target in spec.targets:
            mine, theirs = units(spec, target), units(twin, target)
            assert mine.keys() == theirs.keys() and len(mine) >= 5
            for u in mine:
                assert mine[u] == theirs[u], (spec.name, twin.name, target, u)


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_shared_memory_fits_the_smallest_target(path):
    """Dynamic + static shared memory of every kernel stays under sm_80's 163 KiB per CTA."""
    spec = load_spec(path)
    if "sm_80" not in spec.targets:
        pytest.skip(f"{spec.name} does not target sm_80 (fp8)")
    fwd = plan_forward(spec, "sm_80")
    bwd = plan_backward(spec, "sm_80")
    atomic = plan_backward(spec, "sm_80", atomic_dq=True)
    for plan in (fwd, *bwd.kernels, *atomic.kernels):
        assert plan.smem_bytes <= 163 * 1024, f"{plan.kernel_name}: {plan.smem_bytes}"


def test_atomic_unit_kernels_and_vector_reduction(requires_nvcc):
    """The atomic-dQ unit holds pre, dkdv_atomic and convert (no dq kernel) and compiles
    for both targets; its source has the vector reduction red.global.add.v2.f32 (taken
    where __CUDA_ARCH__ >= 900) and the scalar atomicAdd fallback."""
    spec = load_spec(SPECS[0])
    for target in ("sm_80", "sm_90"):
        bwd = plan_backward(spec, target, atomic_dq=True)
        names = [kp.kernel_name for kp in bwd.kernels]
        assert names[1].endswith("_dkdv_atomic") and names[2].endswith("_convert")
        src = render(bwd.unit)
        assert all(f" {n}(" in src for n in names)
        assert "red.global.add.v2.f32" in src and "atomicAdd" in src
        assert f"_bwd_{target}_dq(" not in src  # no dq kernel on this path
        _, report = cache.get_or_build(src, bwd.unit)
        assert sorted(k.name for k in report.kernels) == sorted(names)
