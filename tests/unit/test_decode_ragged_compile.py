"""The ragged-Sq_new decode units (flashgen.families.decode.plan(..., ragged=True)): every
shipped spec that supports decode compiles for sm_80 and sm_90a with its two kernels (attn,
append) spill-free (20 nvcc runs, in parallel), as tests/unit/test_decode_compile.py does for
the padded units; and the padded units do not change with the ragged flag's presence."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flashgen.build import cache
from flashgen.build.render import render
from flashgen.families import decode as family
from flashgen.frontend.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]


def _specs():
    out = []
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        spec = load_spec(path)
        if family.unsupported_reason(spec) is None:
            out.append(spec)
    return out


def _compile(job):
    spec, target = job
    plan = family.plan(spec, target, ragged=True)
    _, report = cache.get_or_build(render(plan), plan)
    return job, plan, report


def test_ragged_and_padded_units_differ_only_when_asked():
    for spec in _specs():
        padded = family.plan(spec, "sm_80")
        assert render(padded) == render(family.plan(spec, "sm_80", ragged=False))
        ragged = family.plan(spec, "sm_80", ragged=True)
        src = render(ragged)
        assert "cu_seqlens_q" in src and "cu_seqlens_q" not in render(padded)
        assert ragged.kernel_name != padded.kernel_name
        assert [a.name for a in ragged.args][-1] == "cu_seqlens_q"
        assert [a.name for a in ragged.kernel("append").args][-1] == "cu_seqlens_q"


def test_every_ragged_decode_unit_compiles_without_spills(requires_nvcc):
    jobs = [(s, t) for s in _specs() for t in ("sm_80", "sm_90")]
    assert len(jobs) == 20
    workers = int(os.environ.get("FLASHGEN_TEST_JOBS", (os.cpu_count() or 1) + 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(_compile, jobs))
    problems = []
    for (spec, target), plan, report in results:
        names = {k.name for k in report.kernels}
        assert names == {plan.kernel("attn").kernel_name, plan.kernel("append").kernel_name}
        for k in report.kernels:
            assert 0 < k.registers <= 255
            if k.spill_bytes:
                problems.append(f"{spec.name} {target}: {k}")
    assert not problems, "ragged decode kernels spill:\n" + "\n".join(problems)
