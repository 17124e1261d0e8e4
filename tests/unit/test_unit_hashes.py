"""Every rendered compile unit of every shipped spec, hashed: the back end's refactors must
render byte-identical CUDA (or prove identical SASS, ``tools/sass_identity.py``).

The fixture ``tests/fixtures/unit_hashes.json`` was recorded at 3257e40, before the
kernel-families redesign.  Each key names one unit and the knobs it was planned with; the
enumeration below builds the same unit through today's API.  Regenerate only on purpose
(a template change whose SASS was checked): ``python tests/unit/test_unit_hashes.py --write``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "unit_hashes.json"
GPU = "NVIDIA H200"

#: Plan-time switches of 3257e40 and the value that flips each one from its default.
SWITCHES = {
    "FLASHGEN_AFFINE": "0",
    "FLASHGEN_CAUSAL_TILES": "0",
    "FLASHGEN_COL_LIMIT": "0",
    "FLASHGEN_COL_BOUND": "0",
    "FLASHGEN_SINGLE_WALK": "0",
    "FLASHGEN_WALK_FROM_DIAGONAL": "0",
    "FLASHGEN_PERSISTENT_WARP_WALK": "0",
    "FLASHGEN_HEAD_GROUPS": "0",
    "FLASHGEN_NONNEG_DIV": "0",
    "FLASHGEN_SIDE_TERMS": "0",
}


@contextlib.contextmanager
def _env(name: str | None, value: str | None):
    old = os.environ.get(name) if name else None
    if name:
        os.environ[name] = value
    try:
        yield
    finally:
        if name:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def units() -> dict[str, str]:
    """``{key: sha256 of the rendered CUDA}`` for every unit of every shipped spec."""
    return {
        key: src if src.startswith("error: ") else _sha(src) for key, src in unit_sources().items()
    }


def unit_sources() -> dict[str, str]:
    """``{key: rendered CUDA}`` for every unit of every shipped spec (``tools/sass_identity.py``
    compiles them: the key names the target as its second ``/`` field)."""
    from flashgen import lower
    from flashgen.build.render import render
    from flashgen.frontend.spec import load_spec
    from flashgen.ops.varlen import varlen_spec

    out: dict[str, str] = {}

    def put(key: str, plan) -> None:
        out[key] = render(getattr(plan, "unit", plan))

    for path in sorted((ROOT / "specs").glob("*.yaml")):
        spec = load_spec(path)
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
                        try:
                            fwd = lower.plan_forward(s, t, gpu, family=family)
                        except ValueError as e:
                            out[f"{base}{g}{family}/fwd"] = f"error: {e}"
                            continue
                        put(f"{base}{g}{family}/fwd", fwd)
                        for p in ("static", "m_major", "dynamic"):
                            put(
                                f"{base}{g}{family}/fwd/persistent={p}",
                                lower.plan_forward(s, t, gpu, family=family, persistent=p),
                            )
                        for knob in ("side_terms", "affine", "mask_tiles", "head_groups"):
                            put(
                                f"{base}{g}{family}/fwd/{knob}=0",
                                lower.plan_forward(s, t, gpu, family=family, **{knob: False}),
                            )
                        put(
                            f"{base}{g}{family}/fwd/persistent=dynamic/warp_walk=0",
                            lower.plan_forward(
                                s, t, gpu, family=family, persistent="dynamic", warp_walk=False
                            ),
                        )
                        for i, tiles in enumerate(
                            lower.forward_tile_candidates(s, t, gpu, family)
                        ):
                            put(
                                f"{base}{g}{family}/fwd/candidate{i}",
                                lower.plan_forward(s, t, gpu, family=family, tiles=tiles),
                            )
                        alt = lower.sparse_tiles(s, fwd.tiles)
                        if alt is not None:
                            for p in (False, "static", "dynamic"):
                                put(
                                    f"{base}{g}{family}/fwd_sparse/persistent={p or 0}",
                                    lower.plan_forward(
                                        s, t, gpu, family=family, tiles=alt, persistent=p
                                    ),
                                )
                        if lower.needs_block_table(s):
                            put(
                                f"{base}{g}{family}/blockmask",
                                lower.plan_block_table(s, t, fwd.tiles),
                            )
                for atomic in (False, True):
                    kind = "bwd_atomic" if atomic else "bwd"
                    for i, bt in enumerate(lower.backward_tile_candidates(s, atomic_dq=atomic)):
                        put(
                            f"{base}{kind}/candidate{i}",
                            lower.plan_backward(s, t, atomic_dq=atomic, tiles=bt),
                        )
                        put(
                            f"{base}{kind}/candidate{i}/side_terms=0",
                            lower.plan_backward(
                                s, t, atomic_dq=atomic, tiles=bt, side_terms=frozenset()
                            ),
                        )
                if lower.hopper_bwd_eligible(s, t):
                    for dq_a in lower.HOPPER_BWD_DQ_A:
                        plan = lower.plan_hopper_backward(s, t, dq_a=dq_a)
                        put(f"{base}bwd_wgmma/dq_a={dq_a}", plan)
                for name, value in SWITCHES.items():
                    short = name.removeprefix("FLASHGEN_")
                    with _env(name, value):
                        put(f"{base}env/{short}={value}/fwd", lower.plan_forward(s, t))
                        put(
                            f"{base}env/{short}={value}/fwd/persistent=dynamic",
                            lower.plan_forward(s, t, persistent="dynamic"),
                        )
                        put(f"{base}env/{short}={value}/bwd", lower.plan_backward(s, t))
                        put(
                            f"{base}env/{short}={value}/bwd_atomic",
                            lower.plan_backward(s, t, atomic_dq=True),
                        )
                for key, plan in lower.compile_units(s, t).items():
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


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # this checkout's flashgen, not an installed one
    if "--write" not in sys.argv:
        pytest.main([__file__, "-q"])
    else:
        FIXTURE.write_text(json.dumps(units(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {FIXTURE}")
