#!/usr/bin/env python3
"""SASS of the Hopper forward with and without the column bound (``FLASHGEN_COL_BOUND``).

For each spec (default: mistral_swa and causal_d128 as the yardstick) and each scheduler
(``none``: non-persistent, ``static`` / ``dynamic`` persistent, ``sparse``: the op's
``fwd_sparse`` unit, :func:`flashgen.lower.compile_units`), renders the sm_90 forward with
the switch on and off, compiles it (nvcc through :func:`flashgen.build.compile.compile_source`,
no GPU) and prints registers, spill bytes, whether ptxas serialized the wgmmas, and the
counts of the opcodes a masked tile's element loop spends (ISETP, FSEL, VIADD, IADD3, SEL,
all instructions):

    python3 tools/colbound_sass.py
    python3 tools/colbound_sass.py --specs mistral_swa --persistent none static dynamic sparse

Needs nvcc and cuobjdump (see tools/sass_mma_distance.py).  Exit status 1 if a build spills
or serializes its wgmmas.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from sass_mma_distance import kernel_sass  # noqa: E402

from flashgen.build.compile import compile_source  # noqa: E402
from flashgen.build.render import render  # noqa: E402
from flashgen.families.registry import compile_units, plan_forward  # noqa: E402
from flashgen.frontend.spec import load_spec  # noqa: E402
from flashgen.options import Options  # noqa: E402

OPS = ("ISETP", "FSEL", "VIADD", "IADD3", "SEL")


def opcode_counts(sass: str) -> collections.Counter:
    """Base opcodes (``ISETP.GE.AND`` counts as ``ISETP``) of one kernel's SASS listing."""
    out: collections.Counter = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            out[m.group(1)] += 1
            out["total"] += 1
    return out


def build(spec_name: str, persistent, on: bool, tmp: Path) -> dict:
    spec = load_spec(REPO / "specs" / f"{spec_name}.yaml")
    options = Options().replace_path("hopper_fwd.col_bound", on)
    if persistent == "sparse":  # the forward the op runs for sparse calls
        plan = compile_units(spec, "sm_90", options)["fwd_sparse"]
    else:
        plan = plan_forward(spec, "sm_90", options, persistent=persistent)
    src = render(plan)
    cubin = tmp / f"{spec_name}_{persistent}_{int(on)}.cubin"
    report = compile_source(src, plan, cubin)
    k = next(k for k in report.kernels if k.name == plan.kernel_name)
    counts = opcode_counts(kernel_sass(str(cubin))[plan.kernel_name])
    return {
        "bound": bool(plan.context.get("col_bound")),
        "regs": k.registers,
        "spill": k.spill_bytes,
        "serialized": bool(k.wgmma_serialized),
        **{op: counts[op] for op in (*OPS, "total")},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specs", nargs="+", default=["mistral_swa", "causal_d128"])
    ap.add_argument("--persistent", nargs="+", default=["none", "static", "sparse"])
    args = ap.parse_args(argv)
    bad = False
    head = f"{'spec':<14} {'sched':<8} {'switch':<6} {'regs':>4} {'spill':>5} {'ser':>3} "
    print(head + " ".join(f"{op:>6}" for op in (*OPS, "total")))
    with tempfile.TemporaryDirectory(prefix="colbound-") as tmp:
        for name in args.specs:
            for sched in args.persistent:
                persistent = False if sched == "none" else sched
                for on in (False, True):
                    r = build(name, persistent, on, Path(tmp))
                    bad |= r["spill"] > 0 or r["serialized"]
                    switch = ("on" if on else "off") + ("*" if r["bound"] else "")
                    print(
                        f"{name:<14} {sched:<8} {switch:<6} {r['regs']:>4} {r['spill']:>5} "
                        f"{'yes' if r['serialized'] else 'no':>3} "
                        + " ".join(f"{r[op]:>6}" for op in (*OPS, "total"))
                    )
    print("(* the plan folds a column bound; FLASHGEN_COL_BOUND on/off)")
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("FLASHGEN_CACHE_DIR", tempfile.gettempdir() + "/flashgen-colbound")
    sys.exit(main())
