"""The offsets form (flashgen.frontend.offsets) of representative shipped specs compiles
spill-free for sm_80 and sm_90a: every unit of flashgen.families.registry.compile_units (forward,
both backward units, and the sparse forward and Hopper backward where the spec has them).
causal_d128 stands for the plain-causal specs (its causal becomes an explicit mask) and
document_mask for the tensor-reading masks with a block table; ``tools/offsets_compile.py``
compiles every shipped spec's offsets form (about 70 nvcc runs, too many for CI here)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flashgen.build import cache
from flashgen.build.render import render
from flashgen.families.registry import compile_units
from flashgen.frontend.offsets import offsets_spec
from flashgen.frontend.spec import load_spec

SPECS = Path(__file__).resolve().parents[2] / "specs"


@pytest.mark.parametrize("name", ["causal_d128", "document_mask"])
def test_offsets_units_compile_without_spills(name, requires_nvcc):
    spec = offsets_spec(load_spec(SPECS / f"{name}.yaml"))
    jobs = [(t, u) for t in ("sm_80", "sm_90") for u in compile_units(spec, t)]

    def build(tu):
        plan = compile_units(spec, tu[0])[tu[1]]
        return tu, cache.get_or_build(render(plan), plan)[1]

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(build, jobs))
    problems = [
        f"{spec.name}/{t}/{u}: {k}"
        for (t, u), rep in results
        for k in rep.kernels
        if k.spill_bytes or k.wgmma_serialized
    ]
    assert not problems, "\n".join(problems)
