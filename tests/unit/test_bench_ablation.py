"""``flashgen bench --ablation`` (:mod:`flashgen.bench.ablation`) leaves parts of the Hopper
forward out through probe points of ``templates/sm_90/fwd.cu.j2``
(``flashgen.build.render.PROBES``): each variant's points must exist (the source changes where
expected), render nothing unless asked for, and compile."""

from __future__ import annotations

import re

import pytest
from patched_kernels import REPO, compile_source
from plan_helpers import plan_forward

from flashgen.bench import ablation
from flashgen.build import cache
from flashgen.build.render import PROBES, render
from flashgen.frontend.spec import load_spec

TOOL = ablation

#: variant -> (pattern of a probed line, how many the non-persistent kernel has)
SITES = {
    "no_softmax": (r"auto softmax = \[&\]\(int n0, int tile_cls\) \{\n\s+return;", 1),
    "no_s_gemm": (r"if \(false\) fg::wgmma_ss_n\d+\(acc_s, da, db, kk > 0\);", 1),
    "no_pv_gemm": (r"if \(false\) fg::wgmma_rs_n\d+\(acc_o, frag_p\[kk\]", 1),
    "no_o_rescale": (r"if \(false\) acc_o\[4 \* j \+ i\] \*= alpha\[i / 2\];", 1),
    "vote_o_rescale": (r"if \(__any_sync\(~0u, alpha\[0\] != 1\.f \|\| alpha\[1\] != 1\.f\)\)", 1),
    # the steady state's K and V (tx and loads) and the first block's (prologue)
    "no_kv_loads": (r"(expect_tx\([kv]_full\([s0]\), 0\)|if \(false\) fg::tma_load_4d\(s[KV] )", 8),
    "half_kv_loads": (
        r"(expect_tx\([kv]_full\([s0]\), SKV_BYTES / DCB\)|if \(c == 0\) fg::tma_load_4d\(s[KV] )",
        8,
    ),
}


def _plan(name: str, **kw):
    return plan_forward(load_spec(REPO / "specs" / f"{name}.yaml"), "sm_90", **kw)


def test_variants_are_probes():
    assert TOOL.VARIANTS["base"] == frozenset()
    assert set(TOOL.VARIANTS) - {"base"} == set(SITES)
    assert all(v <= PROBES.keys() for v in TOOL.VARIANTS.values())


@pytest.mark.parametrize("name", ["causal_d128", "mistral_swa", "gpt2_d64", "gemma2_softcap"])
def test_each_probe_site_exists_and_renders_only_when_enabled(name):
    plan = _plan(name)
    base = render(plan)
    assert TOOL.variant_source(plan, "base") == base
    for variant, (pattern, count) in SITES.items():
        assert not re.search(pattern, base), variant
        src = TOOL.variant_source(plan, variant)
        assert len(re.findall(pattern, src)) == count, variant
    # the persistent producer loads K and V too
    persistent = _plan(name, persistent="dynamic")
    src = TOOL.variant_source(persistent, "no_kv_loads")
    assert len(re.findall(SITES["no_kv_loads"][0], src)) == 4


@pytest.mark.parametrize("variant", sorted(TOOL.VARIANTS))
def test_each_variant_compiles(variant, tmp_path, requires_nvcc):
    plan = _plan("causal_d128")
    out = TOOL.variant_source(plan, variant)
    assert (out == render(plan)) == (variant == "base")
    if variant == "base":  # causal_d128's forward, which test_compile.py builds: the cache's
        cache.get_or_build(out, plan)
        return
    run = compile_source(plan, out, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]


def test_unknown_probe_is_named():
    with pytest.raises(ValueError, match="no_such_probe"):
        render(_plan("causal_d128"), probes={"no_such_probe"})
