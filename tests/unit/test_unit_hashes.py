"""Every rendered compile unit of every shipped spec, hashed: the back end's refactors must
render byte-identical CUDA (or prove identical SASS, ``tools/sass_identity.py``).

The fixture ``tests/fixtures/unit_hashes.json`` was recorded at 3257e40, before the
kernel-families redesign.  Each key names one unit and the knobs it was planned with; the
enumeration below builds the same unit through today's API
(:mod:`flashgen.families.registry` and :class:`flashgen.options.Options`; the old
environment switches as the options that replace them).  The sink spec's forward units are
the fused-sink ones (``fa2_fwd.fused_sink`` / ``hopper_fwd.fused_sink``, on by default);
``tests/fixtures/unit_hashes_unfused_sink.json`` keeps the hashes of those units with both
options off (:func:`unfused_sink_options`).  Regenerate only on purpose (a template change
whose SASS was checked): ``python tests/unit/test_unit_hashes.py --write``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "unit_hashes.json"
FIXTURE_UNFUSED_SINK = ROOT / "tests" / "fixtures" / "unit_hashes_unfused_sink.json"
GPU = "NVIDIA H200"

#: Plan-time switches of 3257e40, the value that flipped each one from its default, and the
#: options that do the same now (``FLASHGEN_SIDE_TERMS`` was read by the spill fallback only,
#: never by planning: its fixture entries are the default plans).
SWITCHES = {
    "FLASHGEN_AFFINE": ("0", {"fa2_fwd.affine": False, "hopper_fwd.affine": False}),
    "FLASHGEN_CAUSAL_TILES": ("0", {"hopper_fwd.causal_tiles": False}),
    "FLASHGEN_COL_LIMIT": ("0", {"hopper_fwd.col_limit": False}),
    "FLASHGEN_COL_BOUND": ("0", {"hopper_fwd.col_bound": False}),
    "FLASHGEN_SINGLE_WALK": ("0", {"hopper_fwd.single_walk": False}),
    "FLASHGEN_WALK_FROM_DIAGONAL": ("0", {"hopper_fwd.walk_from_diagonal": False}),
    "FLASHGEN_PERSISTENT_WARP_WALK": ("0", {"hopper_fwd.warp_walk": False}),
    "FLASHGEN_HEAD_GROUPS": (
        "0",
        {"fa2_fwd.head_groups": False, "hopper_fwd.head_groups": False,
         "hopper_bwd.head_groups": False},
    ),  # fmt: skip
    "FLASHGEN_NONNEG_DIV": ("0", {"hopper_fwd.nonneg_div": False}),
    "FLASHGEN_SIDE_TERMS": ("0", {}),
}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def units(options=None, specs=None) -> dict[str, str]:
    """``{key: sha256 of the rendered CUDA}`` for every unit of every shipped spec (of those
    named in ``specs``, file stems, if given), planned from ``options`` (default: the
    defaults)."""
    return {
        key: src if src.startswith("error: ") else _sha(src)
        for key, src in unit_sources(options, specs).items()
    }


def unit_sources(options=None, specs=None) -> dict[str, str]:
    """``{key: rendered CUDA}`` for every unit of every shipped spec (of those named in
    ``specs``, file stems, if given), planned from ``options`` (default: the defaults;
    ``tools/sass_identity.py`` compiles them: the key names the target as its second ``/``
    field)."""
    from dataclasses import replace

    from flashgen.build.render import render
    from flashgen.families import registry as reg
    from flashgen.families import tiles as tt
    from flashgen.families.build import _forward_variant
    from flashgen.families.hopper_bwd import eligible as hopper_bwd_eligible
    from flashgen.frontend.spec import load_spec
    from flashgen.ops.prefill.varlen import varlen_spec
    from flashgen.options import DEFAULT, Options

    base_options = options or DEFAULT

    def knobs(family: str, **off) -> Options:
        """Options of ``family`` with the spill fallback's knobs off where named."""
        flags = {k: off.get(k, True) for k in ("affine", "mask_tiles", "head_groups", "warp_walk")}
        return _forward_variant(replace(base_options, family=family), **flags)

    out: dict[str, str] = {}

    def put(key: str, plan) -> None:
        out[key] = render(getattr(plan, "unit", plan))

    for path in sorted((ROOT / "specs").glob("*.yaml")):
        if specs is not None and path.stem not in specs:
            continue
        spec = load_spec(path)
        if spec.v_from_k:  # decode only (its units: tests/unit/test_decode_mla.py)
            continue
        if reg.is_fp8(spec):  # forward only, the Hopper kernel only, never persistent
            for t in spec.targets:
                for gpu in (None, GPU):
                    pre = f"{spec.name}/{t}/{'gpu/' if gpu else ''}auto"
                    for key, o in (("fwd", knobs("auto")), ("fwd/side_terms=0", None)):
                        kw = {"side_terms": False} if o is None else {}
                        put(f"{pre}/{key}", reg.plan_forward(spec, t, knobs("auto"), gpu=gpu, **kw))
                    for knob in ("affine", "mask_tiles", "head_groups"):
                        o = knobs("auto", **{knob: False})
                        put(f"{pre}/fwd/{knob}=0", reg.plan_forward(spec, t, o, gpu=gpu))
            continue
        forms = [("", spec)]
        try:
            forms.append(("varlen:", varlen_spec(spec)))
        except Exception:
            pass
        for form, s in forms:
            for t in s.targets:
                base = f"{s.name}/{t}/{form}"
                for gpu in (None, GPU):
                    g = "gpu/" if gpu else ""
                    for family in ("auto", "fa2"):
                        o = knobs(family)
                        pre = f"{base}{g}{family}"
                        try:
                            fwd = reg.plan_forward(s, t, o, gpu=gpu, persistent=False)
                        except ValueError as e:
                            out[f"{pre}/fwd"] = f"error: {e}"
                            continue
                        put(f"{pre}/fwd", fwd)
                        for p in ("static", "m_major", "dynamic"):
                            put(
                                f"{pre}/fwd/persistent={p}",
                                reg.plan_forward(s, t, o, gpu=gpu, persistent=p),
                            )
                        put(
                            f"{pre}/fwd/side_terms=0",
                            reg.plan_forward(s, t, o, gpu=gpu, persistent=False, side_terms=False),
                        )
                        for knob in ("affine", "mask_tiles", "head_groups"):
                            put(
                                f"{pre}/fwd/{knob}=0",
                                reg.plan_forward(
                                    s, t, knobs(family, **{knob: False}), gpu=gpu,
                                    persistent=False,
                                ),
                            )  # fmt: skip
                        put(
                            f"{pre}/fwd/persistent=dynamic/warp_walk=0",
                            reg.plan_forward(
                                s, t, knobs(family, warp_walk=False), gpu=gpu, persistent="dynamic"
                            ),
                        )
                        for i, tiles in enumerate(reg.forward_tile_candidates(s, t, gpu, o)):
                            put(
                                f"{pre}/fwd/candidate{i}",
                                reg.plan_forward(s, t, o, gpu=gpu, tiles=tiles, persistent=False),
                            )
                        alt = tt.sparse_tiles(s, fwd.tiles)
                        if alt is not None:
                            for p in (False, "static", "dynamic"):
                                put(
                                    f"{pre}/fwd_sparse/persistent={p or 0}",
                                    reg.plan_forward(s, t, o, gpu=gpu, tiles=alt, persistent=p),
                                )
                        if fwd.context["block_table"]:
                            put(f"{pre}/blockmask", reg.plan_block_table(s, t, fwd.tiles))
                backward = reg.has_backward(s)  # fp8 specs: forward only
                for atomic in (False, True) if backward else ():
                    kind = "bwd_atomic" if atomic else "bwd"
                    for i, bt in enumerate(tt.backward_tile_candidates(s, atomic_dq=atomic)):
                        put(
                            f"{base}{kind}/candidate{i}",
                            reg.plan_backward(s, t, atomic_dq=atomic, tiles=bt),
                        )
                        put(
                            f"{base}{kind}/candidate{i}/side_terms=0",
                            reg.plan_backward(
                                s, t, atomic_dq=atomic, tiles=bt, side_terms=frozenset()
                            ),
                        )
                if hopper_bwd_eligible(s, t):
                    put(f"{base}bwd_wgmma", reg.plan_hopper_backward(s, t, base_options))
                for name, (value, values) in SWITCHES.items():
                    pre = f"{base}env/{name.removeprefix('FLASHGEN_')}={value}"
                    o = base_options.with_values(values)
                    put(f"{pre}/fwd", reg.plan_forward(s, t, o, persistent=False))
                    put(
                        f"{pre}/fwd/persistent=dynamic",
                        reg.plan_forward(s, t, o, persistent="dynamic"),
                    )
                    if backward:
                        put(f"{pre}/bwd", reg.plan_backward(s, t, o))
                        put(f"{pre}/bwd_atomic", reg.plan_backward(s, t, o, atomic_dq=True))
                for key, plan in reg.compile_units(s, t, base_options).items():
                    put(f"{base}compile_units/{key}", plan)
    return out


def test_every_rendered_unit_matches_the_fixture():
    want = json.loads(FIXTURE.read_text())
    got = units()
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    changed = sorted(k for k in want.keys() & got.keys() if want[k] != got[k])
    assert not missing and not changed, (
        f"{len(changed)} units render different CUDA, {len(missing)} are gone "
        f"(first: {(changed + missing)[:8]}); extra (new, not in the fixture): {extra[:8]}"
    )


def unfused_sink_options():
    """The default options with the prefill forward families' fused sink off
    (``fa2_fwd.fused_sink`` and ``hopper_fwd.fused_sink`` False)."""
    from flashgen.options import Options

    return Options().with_values({"fa2_fwd.fused_sink": False, "hopper_fwd.fused_sink": False})


def test_unfused_sink_units_render_as_recorded():
    """With ``fa2_fwd.fused_sink`` and ``hopper_fwd.fused_sink`` off, the sink spec's units
    whose fused form is the default render as recorded in ``FIXTURE_UNFUSED_SINK`` (the
    units of gpt_oss_sink and its varlen form: only that spec's are planned)."""
    want = json.loads(FIXTURE_UNFUSED_SINK.read_text())
    assert {k.split("/")[0] for k in want} == {"gpt_oss_sink", "gpt_oss_sink__varlen"}
    got = units(unfused_sink_options(), specs={"gpt_oss_sink"})
    assert want and set(want) <= set(got), "the set of unfused sink units changed"
    changed = sorted(k for k in want if got[k] != want[k])
    assert not changed, f"{len(changed)} unfused sink units render differently: {changed[:8]}"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # this checkout's flashgen, not an installed one
    if "--write" not in sys.argv:
        pytest.main([__file__, "-q"])
    else:
        FIXTURE.write_text(json.dumps(units(), indent=1, sort_keys=True) + "\n")
        sink_keys = json.loads(FIXTURE_UNFUSED_SINK.read_text())
        unfused = units(unfused_sink_options(), specs={"gpt_oss_sink"})
        FIXTURE_UNFUSED_SINK.write_text(
            json.dumps({k: unfused[k] for k in sink_keys}, indent=1, sort_keys=True) + "\n"
        )
        print(f"wrote {FIXTURE} and {FIXTURE_UNFUSED_SINK}")
