"""``Options.exact_softmax`` (issue 38, item 15: huge finite logits gave NaN on the GPU): a
typed option, off by default, part of the kernel keys of the families it changes, and what it
renders into each of them.  Off, every unit renders byte-identical CUDA
(``test_unit_hashes.py``); the GPU behaviour is ``tests/gpu/test_huge_logits_gpu.py``.  Pure
Python (rendering only)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flashgen.build.render import render
from flashgen.families import registry
from flashgen.families.decode import unsupported_reason
from flashgen.frontend.spec import load_spec
from flashgen.options import DEFAULT, Options

REPO = Path(__file__).resolve().parents[2]
EXACT = Options(exact_softmax=True)


def _units(spec, target, options):
    """``{name: rendered CUDA}`` of ``spec``'s compile units and decode unit on ``target``."""
    out = {
        key: render(getattr(plan, "unit", plan))
        for key, plan in registry.compile_units(spec, target, options).items()
    }
    if unsupported_reason(spec) is None:
        out["decode"] = render(registry.plan_decode(spec, target, options))
    return out


def test_the_option_is_a_typed_bool_off_by_default():
    assert DEFAULT.exact_softmax is False
    assert "exact_softmax" in Options.paths()
    assert Options.describe("exact_softmax").startswith("bool")
    assert Options().replace_path("exact_softmax", "true").exact_softmax is True
    for bad in ("true", 1, None):
        with pytest.raises(ValueError, match=r"Options\.exact_softmax="):
            Options(exact_softmax=bad)


def test_the_option_keys_the_kernels_it_changes():
    """Part of the plan's options key (so of the kernel cache key) of every family it changes,
    not of the block-table pre-pass, which has no softmax."""
    for name in ("fa2_fwd", "hopper_fwd", "fa2_bwd", "hopper_bwd", "decode"):
        assert EXACT.family_key(name) == "exact_softmax=True", name
    assert EXACT.family_key("blocktable") == ""
    spec = load_spec(REPO / "specs" / "causal_d128.yaml")
    for key, plan in registry.compile_units(spec, "sm_90", EXACT).items():
        unit = getattr(plan, "unit", plan)
        assert unit.options_key == "exact_softmax=True", key
    assert registry.plan_decode(spec, "sm_80", EXACT).options_key == "exact_softmax=True"


@pytest.mark.parametrize("name", ["causal_d128", "gpt2_d64", "alibi", "gemma2_softcap"])
def test_what_the_option_renders(name):
    """On: the forwards round the scaled score as the row max was (``__fmul_rn``; the Hopper
    forward from |max| = 2^24 on), the backwards cap P's exponent (``fg::capped_exponent``),
    decode merges its splits normalized by their sum.  Off: none of it."""
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    for target in ("sm_80", "sm_90"):
        on, off = _units(spec, target, EXACT), _units(spec, target, DEFAULT)
        assert on.keys() == off.keys()
        for key, src in on.items():
            assert src != off[key], (name, target, key)
            for word in ("capped_exponent", "merge_stats", "EXACT_SOFTMAX_BASE"):
                assert word not in off[key], (name, target, key, word)
            if key.startswith("bwd"):
                assert "fg::capped_exponent(" in src, (name, target, key)
            elif key == "decode":
                assert "fg::dec::merge_stats(" in src and "fg::dec::normalized_weight(" in src
                assert "fg::dec::merge_weight(" not in src
            else:
                assert "__fmul_rn(" in src, (name, target, key)
                hopper = registry.compile_units(spec, target, EXACT)[key].template
                assert ("EXACT_SOFTMAX_BASE" in src) == (hopper == "sm_90/fwd.cu.j2")


@pytest.mark.parametrize("name", ["alibi", "document_mask", "gemma2_softcap", "t5_bias"])
def test_no_identifier_of_the_option_in_the_param_namespace(name):
    """``p_<name>`` / ``t_<name>`` are the params' kernel arguments
    (``test_param_namespace.py``): the helpers the option renders take none of them (the
    capped exponent was first written ``p_arg``)."""
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    params = {("t" if p.kind == "tensor" else "p", p.name) for p in spec.params}
    for target in ("sm_80", "sm_90"):
        for key, src in _units(spec, target, EXACT).items():
            found = re.findall(r"\b([pt])_([A-Za-z0-9_]+)", src)
            foreign = {f"{k}_{n}" for k, n in found if (k, n) not in params}
            assert not foreign, f"{name} [{target} {key}]: {sorted(foreign)} are not params"
