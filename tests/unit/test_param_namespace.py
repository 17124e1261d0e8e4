"""The kernels' identifiers ``p_<name>`` and ``t_<name>`` belong to the spec's params
(``lower.cuda_expr``: a scalar param ``x`` is the kernel argument ``p_x``, a tensor param
``t`` is ``t_t``): no template or header may declare one of its own, or a param of that
name is shadowed or redeclared (a scalar param named ``frag`` met the Hopper kernels'
``uint32_t p_frag[...]`` and failed to compile).  Every rendered unit (forward, the three
backward units, the block-table pre-pass, varlen) of specs with params, with headers
inlined by the templates, on both targets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from plan_helpers import plan_forward

from flashgen.build.render import render
from flashgen.codegen.abi import needs_block_table
from flashgen.codegen.plan import TileConfig
from flashgen.families.registry import compile_units, plan_block_table
from flashgen.frontend.spec import load_spec, loads_spec

REPO = Path(__file__).resolve().parents[2]
PARAM_LIKE = re.compile(r"\b([pt])_([A-Za-z0-9_]+)")


FRAG = (
    "name: frag\nhead_dim: 128\ndtype: bf16\nmask: causal\nscore_mod: 'score * frag'\n"
    "params: {frag: {type: f32, default: 1.0}}\n"
)
SPECS = ("alibi", "document_mask", "gemma2_softcap", "chunked_local", "gpt2_d64", "t5_bias")
SPECS += ("mistral_swa", "prefix_lm")  # params the tile classifier reads (persistent sparse)


def _units(spec):
    for target in ("sm_80", "sm_90"):
        for name, plan in compile_units(spec, target).items():
            yield f"{target} {name}", render(plan)
        if needs_block_table(spec):
            plan = plan_block_table(spec, target, TileConfig(128, 64, 4))
            yield f"{target} block table", render(plan)
    from dataclasses import replace

    if not needs_block_table(spec):  # varlen masks read no tensor
        yield "sm_80 varlen fwd", render(plan_forward(replace(spec, varlen=True), "sm_80"))


@pytest.mark.parametrize("name", SPECS)
def test_no_template_identifier_in_the_param_namespace(name):
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    params = {("t" if p.kind == "tensor" else "p", p.name) for p in spec.params}
    for unit, src in _units(spec):
        foreign = {f"{k}_{n}" for k, n in PARAM_LIKE.findall(src) if (k, n) not in params}
        assert not foreign, f"{spec.name} [{unit}]: {sorted(foreign)} are not params"


def test_a_param_named_like_a_kernel_local_compiles(requires_nvcc):
    """The user-facing failure: ``frag`` on the Hopper forward (nvcc: "expression must
    have arithmetic or unscoped enum type")."""
    from flashgen.build import cache

    spec = loads_spec(FRAG)
    plan = plan_forward(spec, "sm_90")
    assert plan.template == "sm_90/fwd.cu.j2"
    _, report = cache.get_or_build(render(plan), plan)
    assert report.spill_bytes == 0


def test_the_persistent_classifier_copies_stay_out_of_the_param_namespace():
    """The persistent Hopper forward copies the classifier's scalars per tile (``opaque``):
    named ``<arg>_t`` they were ``p_w_t`` for a param ``w``, the kernel argument of a param
    ``w_t``, whose own copy then read the first one (``p_w_t_t = opaque(p_w_t)``: the
    classifier would get ``w`` for ``w_t``).  Each copy reads its own argument, and none is
    named like a param."""
    spec = loads_spec(
        "name: wt\nhead_dim: 128\ndtype: bf16\n"
        "mask: causal && q_idx - kv_idx < w && q_idx - kv_idx >= w_t\n"
        "params: {w: {type: i32, default: 256}, w_t: {type: i32, default: 0}}\n"
    )
    for scheduler in ("static", "dynamic"):
        src = render(plan_forward(spec, "sm_90", persistent=scheduler))
        copies = dict(re.findall(r"const int (\w+) = opaque\((\w+)\);", src))
        assert {"p_w", "p_w_t"} <= set(copies.values()), copies
        for local, arg in copies.items():
            assert not PARAM_LIKE.fullmatch(local), (scheduler, local, arg)
        assert len(set(copies.values())) == len(copies), copies
