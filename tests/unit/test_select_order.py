"""The order in which :func:`flashgen.families.build.build_forward` tries a tile candidate's
feature variants (row / column terms, affine split, Hopper masked-tile reductions, head groups,
the persistent producer's warp-wide walk), with nvcc replaced by a recorder whose every kernel
spills (so every variant is tried): the distinct kernel sources it builds, in order, are those of
the nested loops with ``break`` it replaced (session 8; here with head groups, inside them the
persistent producer's warp-wide walk and inside that the float twins of integer index calls as
their innermost loops), so for any spill outcome both return the same plan; the source-level
dedupe builds no source twice and skips none; and when every variant spills, the plan returned is
the one whose kernel was built last (its cubin and report belong to it).  No nvcc:
tests/unit/test_select.py has the real spills.  Both sides render through :func:`_render`, which
renders each distinct (template, context) once: build_forward plans 32 or 64 variants per tile
candidate, most of them rendering a source already tried."""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
from covering import pairwise, uncovered_pairs
from plan_helpers import forward_tile_candidates, plan_forward

from flashgen.build import cache
from flashgen.build.render import render
from flashgen.families import build as family_build
from flashgen.frontend.spec import load_spec, loads_spec
from flashgen.options import DEFAULT

REPO = Path(__file__).resolve().parents[2]
#: the shipped specs with a prefill (v_from_k specs are decode only: tests/unit/test_decode_mla.py)
SPECS = [p for p in sorted((REPO / "specs").glob("*.yaml")) if not load_spec(p).v_from_k]

#: Specs of tests/unit that spill somewhere (test_affine.SPILLS_WITH_SPLIT,
#: test_select.RELPOS / D256_COND / NOT_CAUSAL_OR): they take the fallback for real.
USER_SPECS = {
    "affine_spill": "head_dim: 128\ndtype: bf16\nmask: causal && q_idx - kv_idx < win\n"
    "score_mod: q_idx - kv_idx + score\nparams:\n  win: {type: i32, default: 256}\n",
    "relpos": "head_dim: 64\ndtype: fp16\nmask: kv_idx < prefix || causal\n"
    "score_mod: score + rel_bias[h, min(abs(q_idx - kv_idx), 31)]\nparams:\n"
    "  prefix: {type: i32, default: 64}\n  rel_bias: {type: f32, shape: [num_heads, 32]}\n",
    "d256_cond": 'head_dim: 256\ndtype: fp16\nmask: "q_idx >= kv_idx ? true : '
    'kv_idx - q_idx < 4"\nscore_mod: max(score, -10.0) * 0.5\n',
    "not_causal_or": 'head_dim: 128\ndtype: bf16\nmask: "!causal || kv_idx % 7 == 0"\n',
    "varlen_causal": "head_dim: 128\ndtype: bf16\nmask: causal\nvarlen: true\n",
}

BUILDS = [
    ("sm_80", "auto", False),
    ("sm_90", "auto", False),
    ("sm_90", "fa2", False),
    ("sm_90", "auto", "static"),
    ("sm_90", "auto", "m_major"),
    ("sm_90", "auto", "dynamic"),
]


def _specs():
    out = [load_spec(p) for p in SPECS]
    out += [loads_spec(f"name: {n}\n{t}", f"{n}.yaml") for n, t in USER_SPECS.items()]
    return out


#: the sources :func:`_render` made in the running test (cleared by each)
_SOURCES: dict = {}


def _render(plan) -> str:
    """``render(plan)``, once per distinct template and context (render reads nothing else)."""
    key = (plan.template, pickle.dumps(plan.context.fields()))
    if key not in _SOURCES:
        _SOURCES[key] = render(plan)
    return _SOURCES[key]


def _old_loops(spec, target, family, persistent, build, values):
    """build_forward's loops before session 8 (f2ba365), head groups added innermost the
    same way: a feature that leaves no trace in the plan is not retried without.  ``values``:
    the options (by dotted name) every plan starts from."""
    ways = (True, False) if DEFAULT.with_values(values).side_terms else (False,)
    for tiles in forward_tile_candidates(spec, target, None, family):
        for side_terms in ways:
            for affine in (True, False):
                for mask_tiles in (True, False):
                    for head_groups in (True, False):
                        for warp_walk in (True, False):
                            sources = []
                            for floats in (True, False):  # float_index_calls, innermost
                                vals = {**values, "hopper_fwd.float_index_calls": floats}
                                plan = plan_forward(
                                    spec, target, None, tiles=tiles, persistent=persistent,
                                    side_terms=side_terms, affine=affine, mask_tiles=mask_tiles,
                                    head_groups=head_groups, warp_walk=warp_walk, family=family,
                                    values=vals,
                                )  # fmt: skip
                                source = _render(plan)
                                if source in sources:  # no such call: no trace
                                    break
                                sources.append(source)
                                build(source, plan)
                            if not plan.context.get("warp_walk"):
                                break
                        if plan.context["tile_group"] == "1":
                            break
                    reductions = ("causal_tiles", "col_limit", "nonneg_div")
                    if not any(plan.context.get(r) for r in reductions):
                        break
                if plan.context.get("affine") is None:
                    break
            if not (plan.context.get("row_terms") or plan.context.get("col_terms")):
                break


def _recorder(log: list):
    def build(source, plan):
        log.append((source, plan))
        return Path(f"/nonexistent/{len(log)}.cubin"), SimpleNamespace(spill_bytes=4)

    return build


SPEC_LIST = _specs()
#: (spec name, head groups on, index in BUILDS): a pairwise covering (tests/covering.py) of
#: spec x head groups x build, half the product's 240 build_forward comparisons
COVERING = pairwise([s.name for s in SPEC_LIST], (True, False), range(len(BUILDS)))


def test_the_covering_takes_every_build_of_every_spec_with_and_without_head_groups():
    names = [s.name for s in SPEC_LIST]
    factors = (names, (True, False), range(len(BUILDS)))
    assert not uncovered_pairs(COVERING, *factors)
    assert len(set(names)) == len(names)
    assert {(n, b) for n, _, b in COVERING} == {(n, b) for n in names for b in range(len(BUILDS))}


@pytest.mark.parametrize("head_groups", [True, False])
@pytest.mark.parametrize("spec", SPEC_LIST, ids=lambda s: s.name)
def test_build_order_is_the_old_loops(spec, head_groups, monkeypatch):
    """Also with the head groups off in the options (``hopper_fwd.head_groups`` and
    ``fa2_fwd.head_groups``, what ``FLASHGEN_HEAD_GROUPS=0`` was).  The builds of
    :data:`COVERING` for ``spec`` and ``head_groups``: every (spec, build) with the head groups
    on or off, both for every spec and for every build, each with half the specs (about three
    of the six builds a test; ``pytest --full-product``: all six)."""
    values = {"hopper_fwd.head_groups": head_groups, "fa2_fwd.head_groups": head_groups}
    mine = [BUILDS[b] for n, on, b in COVERING if n == spec.name and on == head_groups]
    for target, family, persistent in mine:
        options = DEFAULT.with_values({**values, "family": family})
        if target not in spec.targets:
            continue
        new: list = []
        monkeypatch.setattr(cache, "get_or_build", _recorder(new))
        monkeypatch.setattr(family_build, "render", _render)
        _SOURCES.clear()
        try:
            plan, cubin, report = family_build.build_forward(
                spec, target, options=options, persistent=persistent
            )
        except ValueError:  # not lowerable for this target / family (e.g. varlen Hopper)
            continue
        old: list = []
        _old_loops(spec, target, family, persistent, _recorder(old), values)
        new_sources = [s for s, _ in new]
        assert len(set(new_sources)) == len(new_sources), "a source built twice"
        old_sources = list(dict.fromkeys(s for s, _ in old))  # first builds, in order
        assert new_sources == old_sources, (spec.name, target, family, persistent)
        # every variant spilled: the plan returned is the last one built, with its cubin
        assert render(plan) == new_sources[-1] and cubin == Path(f"/nonexistent/{len(new)}.cubin")
