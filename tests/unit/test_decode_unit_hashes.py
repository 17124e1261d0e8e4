"""Every decode unit of every shipped spec under the default decode options, hashed: an option
that is off must render byte-identical CUDA (tests/unit/test_unit_hashes.py covers the other
families; its fixture predates decode).

The fixture ``tests/fixtures/decode_unit_hashes.json`` was recorded at 822d945 (the base of
the fused-sink work, ``Options.decode.fused_sink``), its sink specs' units again at 6b7e33b
(the fused sink on by default); ``decode_unit_hashes_unfused_sink.json`` keeps those units'
822d945 hashes, which they must still have with the option off.  Each key names one unit:
spec, target, ``padded`` / ``ragged``, the cache (``spec`` dtype or ``fp8_e4m3``) and
``exact`` for ``Options.exact_softmax``.  Regenerate only on purpose (a template change whose
SASS was checked): ``python tests/unit/test_decode_unit_hashes.py --write``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "decode_unit_hashes.json"
FIXTURE_UNFUSED_SINK = ROOT / "tests" / "fixtures" / "decode_unit_hashes_unfused_sink.json"


def units(options=None) -> dict[str, str]:
    """``{key: sha256 of the rendered CUDA}`` for every decode unit of every shipped spec
    that decode supports, planned through the registry with ``options`` (default: the
    defaults) and ``exact_softmax`` off and on."""
    from dataclasses import replace

    from flashgen.build.render import render
    from flashgen.families import decode as family
    from flashgen.families import registry
    from flashgen.frontend.spec import load_spec
    from flashgen.options import DEFAULT

    base = options or DEFAULT
    out: dict[str, str] = {}
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        spec = load_spec(path)
        if family.unsupported_reason(spec) is not None:
            continue
        for target in family.TARGETS:
            for ragged in (False, True):
                for cache in (None, "fp8_e4m3"):
                    if family.cache_dtype_reason(spec, cache) is not None:
                        continue
                    for exact in (False, True):
                        opts = replace(base, exact_softmax=exact)
                        plan = registry.plan_decode(spec, target, opts, ragged=ragged,
                                                    cache_dtype=cache)  # fmt: skip
                        key = "/".join((spec.name, target, "ragged" if ragged else "padded",
                                        cache or "spec", "exact" if exact else "default"))
                        out[key] = hashlib.sha256(render(plan).encode()).hexdigest()
    return out


def test_default_decode_units_render_as_recorded():
    want = json.loads(FIXTURE.read_text())
    got = units()
    assert sorted(got) == sorted(want), "the set of decode units changed"
    changed = [k for k in want if got[k] != want[k]]
    assert not changed, f"{len(changed)} decode units render differently: {changed[:8]}"


def test_unfused_sink_units_render_as_at_the_base():
    """``decode.fused_sink`` went on by default (6b7e33b) and the fixture took the fused units
    of the sink specs: their unfused units (the option off) must still render as at the base
    of the fused-sink work, recorded in ``FIXTURE_UNFUSED_SINK``."""
    from flashgen.options import Options

    want = json.loads(FIXTURE_UNFUSED_SINK.read_text())
    got = units(Options().replace_path("decode.fused_sink", False))
    assert want and set(want) <= set(got), "the set of sink decode units changed"
    changed = [k for k in want if got[k] != want[k]]
    assert not changed, f"{len(changed)} unfused sink units render differently: {changed[:8]}"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/unit/test_decode_unit_hashes.py --write")
    sys.path.insert(0, str(ROOT))
    from flashgen.options import Options

    FIXTURE.write_text(json.dumps(units(), indent=1, sort_keys=True) + "\n")
    sink_keys = json.loads(FIXTURE_UNFUSED_SINK.read_text())
    unfused = units(Options().replace_path("decode.fused_sink", False))
    FIXTURE_UNFUSED_SINK.write_text(
        json.dumps({k: unfused[k] for k in sink_keys}, indent=1, sort_keys=True) + "\n"
    )
    print(f"wrote {FIXTURE} and {FIXTURE_UNFUSED_SINK}")
