"""The offsets form (flashgen.frontend.offsets) of representative shipped specs compiles
spill-free for sm_80 and sm_90a: every unit of flashgen.families.registry.compile_units (forward,
both backward units, and the sparse forward and Hopper backward where the spec has them; the
FA2-class backward units for one target per spec, see FA2_BWD_TARGET), the Hopper backward
as the op builds it (:func:`flashgen.families.build.build_backward`: its offsets form is a
residual mask, whose 80-query steps spill, so it takes 64).
causal_d128 stands for the plain-causal specs (its causal becomes an explicit mask) and
document_mask for the tensor-reading masks with a block table; ``flashgen build --offsets
specs/*.yaml`` compiles every shipped spec's offsets form (about 70 nvcc runs, too many for CI
here), the way the op builds it (smaller tiles where the first choice spills)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flashgen.build import cache
from flashgen.build.render import render
from flashgen.families.build import build_backward
from flashgen.families.registry import compile_units
from flashgen.frontend.offsets import offsets_spec
from flashgen.frontend.spec import load_spec

SPECS = Path(__file__).resolve().parents[2] / "specs"


#: the target each spec builds its FA2-class backward units (bwd, bwd_atomic) for: they render
#: the same CUDA for sm_80 and sm_90 but for the kernels' names (and the atomic unit's sm_90
#: vector reduction), so the two specs share the targets out (both units meet both targets;
#: causal_d128's sm_80 ones are also the next test's).  The forwards (FA2-class on sm_80,
#: Hopper on sm_90) and the sm_90-only units build for every spec.
FA2_BWD_TARGET = {"causal_d128": "sm_80", "document_mask": "sm_90"}


@pytest.mark.parametrize("name", ["causal_d128", "document_mask"])
def test_offsets_units_compile_without_spills(name, requires_nvcc):
    spec = offsets_spec(load_spec(SPECS / f"{name}.yaml"))
    jobs = [(t, u) for t in ("sm_80", "sm_90") for u in compile_units(spec, t)
            if u not in ("bwd", "bwd_atomic") or t == FA2_BWD_TARGET[name]]  # fmt: skip

    def build(tu):
        if tu[1] == "bwd_wgmma":  # as the op builds it: 64-query steps where 80 spill
            return tu, build_backward(spec, tu[0], hopper=True)[2]
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


def test_build_offsets_compiles_the_offsets_form_and_writes_nothing(
    tmp_path, capsys, requires_nvcc
):
    """``flashgen build --offsets``: the ``<name>__offsets`` units, reported (the units of the
    test above, cached by then); no generated/ folder, no decode units, no verification."""
    import json

    from flashgen.cli.commands import main

    out = tmp_path / "gen"
    rc = main(["build", "--offsets", "causal_d128", "--target", "sm_80", "--json",
               "--no-verify", "--out", str(out), "--jobs", "2"])  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["ok"], doc
    kernels = doc["kernels"]
    assert {k["spec"] for k in kernels} == {"causal_d128__offsets"}
    assert {k["unit"] for k in kernels} >= {"fwd", "bwd", "bwd_atomic"}
    assert not any(k["unit"].startswith("decode") for k in kernels)
    assert doc["generated"] == [] and not out.exists()


def test_build_offsets_of_a_decode_only_spec_says_why_nothing_was_built(
    tmp_path, capsys, monkeypatch
):
    """``flashgen build mla_decode --offsets`` printed an empty table and exited 0 with no
    word: a decode-only spec (v_from_k) has no offsets form.  A note says so, once per spec,
    as a target a spec does not list is noted as skipped; no empty table."""
    from flashgen.build import compile as fgcompile
    from flashgen.cli.commands import main

    class Toolkit:  # nothing is compiled: no nvcc needed
        key = "nvcc test"

    monkeypatch.setattr(fgcompile, "find_compiler", lambda: Toolkit())
    rc = main(["build", "--offsets", "mla_decode", "--no-verify", "--out", str(tmp_path)])
    cap = capsys.readouterr()
    assert rc == 0 and "┃ spec" not in cap.out, cap.out
    notes = [x for x in cap.err.splitlines() if x.startswith("note: ")]
    assert notes == [
        "note: mla_decode: nothing built: --offsets builds the prefill units that ring "
        "attention and q_offset= / kv_offset= calls run, and a decode-only spec (v_from_k) "
        "has none"
    ], cap.err
