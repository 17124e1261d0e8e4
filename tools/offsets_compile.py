"""Compile every unit of the offsets form (``<name>__offsets``, flashgen.frontend.offsets) of
every shipped spec for sm_80 and sm_90a and report spills.

    python tools/offsets_compile.py [--jobs 4] [spec names...]

Each (spec, target, unit) of :func:`flashgen.families.registry.compile_units` is rendered and
compiled
through the kernel cache (parallel nvcc runs); a unit whose first-choice tiles spill is
then built the way the op builds it (:func:`flashgen.families.build.build_forward` /
``build_backward``, smaller tiles as fallback) and reported with the tiles that fit.
Exit status 1 if any unit still spills.  tests/unit/test_offsets_compile.py compiles a
representative subset in CI; this script covers the rest (about 70 nvcc runs).
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashgen.build import cache  # noqa: E402
from flashgen.build.render import render  # noqa: E402
from flashgen.families.registry import compile_units  # noqa: E402
from flashgen.frontend.offsets import offsets_spec  # noqa: E402
from flashgen.frontend.spec import load_spec  # noqa: E402


def _build(spec, target, unit):
    plan = compile_units(spec, target)[unit]
    _, report = cache.get_or_build(render(plan), plan)
    return spec, target, unit, report


def _fallback(spec, target, unit) -> str:
    from flashgen.families.build import build_backward, build_forward

    if unit.startswith("fwd"):
        plan, _, rep = build_forward(spec, target, sparse=unit == "fwd_sparse")
    else:
        plan, _, rep = build_backward(
            spec, target, atomic_dq=unit != "bwd", hopper=unit == "bwd_wgmma"
        )
    return f"op build: tiles {plan.tiles}, spill {rep.spill_bytes} B"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="spec names (default: every shipped spec)")
    ap.add_argument("--jobs", type=int, default=4)
    args = ap.parse_args(argv)
    paths = sorted((ROOT / "specs").glob("*.yaml"))
    if args.names:
        paths = [p for p in paths if p.stem in args.names]
    jobs = []
    for p in paths:
        spec = offsets_spec(load_spec(p))
        for target in ("sm_80", "sm_90"):
            jobs += [(spec, target, u) for u in compile_units(spec, target)]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda j: _build(*j), jobs))
    bad = 0
    for spec, target, unit, rep in results:
        spill = rep.spill_bytes
        line = f"{spec.name:32s} {target} {unit:11s} spill {spill} B"
        if spill or rep.wgmma_serialized:
            fb = _fallback(spec, target, unit)
            bad += "spill 0 B" not in fb
            line += f"  -> {fb}"
        print(line, flush=True)
    print(f"{len(results)} units, {bad} still spilling after the op's fallback")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
