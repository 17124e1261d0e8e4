#!/usr/bin/env python3
"""Where a CTA of the Hopper forward (non-persistent) spends its time: ``clock64`` stamps
patched into the rendered source at fixed points, one row of 32 int64 per CTA in a
``__device__`` buffer, read back after one launch.

    flashgen bench --timeline causal_d128 mistral_swa   # B=2 H=16 S=8k
    flashgen bench --timeline causal_d128 --shape 1 16 16384
    flashgen bench --timeline mistral_swa --shape 1 16 16384 --param window=256

Prints, per spec, the mean cycles of each phase of a CTA: entry to the tile decoded, Q
issued, the first live key block found, its K and V issued, the barrier, ``setmaxnreg``
(thread 0); entry to Q and the first K landed, the first S + softmax, the main loop (and
cycles per key block), the last P V, the epilogue (consumer warpgroup 0); the gap between a
CTA's end and the next CTA's start on the same SM; and these by key blocks per CTA.  Cycles
are one SM's ``clock64`` (the SM clock; under the card's power limit it runs at 1.4-1.7 GHz,
see docs/perf-notes.md).

The stamps are the probe point ``timeline`` of ``templates/sm_90/fwd.cu.j2``
(``flashgen.build.render.PROBES``; nothing is rendered without it), and
``tests/unit/test_bench_timeline.py`` checks that every slot of :data:`STAMPS` is stamped and
compiles the probed source.  The kernel is built through ``flashgen.families.build`` with the probed
renderer (its own cache entry: the source differs); the op runs as usual.  Needs a GPU (sm_90),
torch and CuPy.
"""

from __future__ import annotations

import argparse
import sys

from flashgen.bench import helptext

#: int64 slots per CTA in ``fg_prof``
SLOTS = 32
#: CTAs the buffer holds
MAX_CTAS = 1 << 16

#: The stamps' slots (``templates/sm_90/fwd.cu.j2``, probe ``timeline``): 0 entry (consumer 0),
#: 1 Q and first K landed, 2 first S + softmax done, 3 main loop done, 4 / 5 epilogue done
#: (consumer 0 / 1), 6 Q issued, 7 SM id, 8 key blocks, 11 last P V done, 12 / 13 consumer 1's
#: 1 / 2, 14 tile decoded, 15 first block found (single walk), 16 barrier passed, 17 setmaxnreg
#: done, 18 entry (thread 0), 19 first K / V issued, 20 Q landed (consumer 0), 21 the next live
#: block found.
STAMPS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21)


def timeline_source(plan) -> str:
    """The CUDA of ``plan`` (a non-persistent Hopper forward) with the stamps (probe
    ``timeline``; other kernels render unchanged)."""
    from flashgen.build.render import render

    return render(plan, probes=frozenset({"timeline"}))


def launch_ctas(plan, b: int, h: int, s: int) -> int:
    """CTAs in the launch grid of ``plan`` at B=b, H=h (no GQA), S=s: the stamp rows the run
    needs (a grouped grid's holes have rows too, :func:`flashgen.families.common.grouped_grid`)."""
    gx, gy, gz = plan.grid(b, h, s, heads_kv=h, seqlen_k=s)
    return gx * gy * gz


def summarize(P, name: str) -> list[str]:
    """Lines of the report for the stamp rows ``P`` (numpy int64 [CTAs, SLOTS])."""
    import numpy as np

    P = P[P[:, 0] != 0]
    t0, t1, t2, t3, t4, t5 = (P[:, i] for i in range(6))
    steps, tpv, smid = P[:, 8], P[:, 11], P[:, 7]
    end = np.maximum(t4, t5)
    span = end - t0
    out = [f"{name}: {len(P)} CTAs, mean {span.mean():.0f} cycles, {steps.mean():.1f} key blocks"]
    e0 = P[:, 18]
    marks = (("decoded", 14), ("Q issued", 6), ("first block", 15), ("K/V issued", 19),
             ("next block", 21), ("barrier", 16), ("setmaxnreg", 17))  # fmt: skip
    out.append(
        "  thread 0 since entry: " + ", ".join(f"{m} {np.mean(P[:, i] - e0):.0f}" for m, i in marks)
    )
    phases = {
        "entry -> Q landed": P[:, 20] - t0,
        "entry -> Q, first K landed": t1 - t0,
        "first S + softmax": t2 - t1,
        "main loop": t3 - t2,
        "last P V": tpv - t3,
        "epilogue": t4 - tpv,
        "consumer 1 after 0": t5 - t4,
    }
    for k, x in phases.items():
        out.append(f"  {k:28s} mean {x.mean():9.0f}  share {x.sum() / span.sum():6.3f}")
    per = (t3 - t2) / np.maximum(steps - 1, 1)
    out.append(f"  main loop per key block: median {np.median(per):.0f} cycles")
    gaps, spans = [], []
    for sm in np.unique(smid):
        idx = np.where(smid == sm)[0]
        idx = idx[np.argsort(t0[idx])]
        gaps += list(t0[idx[1:]] - end[idx[:-1]])
        spans.append(end[idx[-1]] - t0[idx[0]])
    gaps = np.array(gaps)
    share = gaps.sum() / np.sum(spans)
    out.append(
        f"  gap to the next CTA on the SM: mean {gaps.mean():.0f}, share {share:.3f}; "
        f"{len(np.unique(smid))} SMs ran CTAs"
    )
    for lo, hi in ((0, 8), (8, 16), (16, 32), (32, 48), (48, 1 << 30)):
        sel = (steps >= lo) & (steps < hi)
        if sel.any():
            out.append(
                f"  key blocks [{lo}, {hi if hi < 1 << 30 else 'inf'}): {sel.sum()} CTAs, span "
                f"{span[sel].mean():.0f}, to first softmax {(t2 - t0)[sel].mean():.0f}, per block "
                f"{per[sel].mean():.0f}, after the loop {(end - t3)[sel].mean():.0f}"
            )
    return out


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(
        prog=prog, description=helptext.plain(__doc__), formatter_class=helptext.HelpFormatter
    )
    ap.add_argument("specs", nargs="+", help="spec files or shipped spec names (no block table)")
    ap.add_argument("--shape", nargs=3, type=int, metavar=("B", "H", "S"), default=(2, 16, 8192))
    ap.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a scalar param of the specs (repeatable), e.g. window=256",
    )
    args = ap.parse_args(argv)
    params = {}
    for item in args.param:
        name, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--param {item!r}: expected NAME=VALUE")
        try:
            params[name.strip()] = int(value)
        except ValueError:
            try:
                params[name.strip()] = float(value)
            except ValueError:
                ap.error(f"--param {item!r}: {value!r} is not a number")

    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("flashgen bench --timeline needs an sm_90 GPU", file=sys.stderr)
        return 2

    import cupy

    import flashgen
    import flashgen.families.build as family_build
    import flashgen.ops.op as op_mod
    from flashgen.options import Options

    # the stamps go into the non-persistent kernel: sparse calls must run it too, not the
    # persistent one Options.sparse_persistent names (dynamic by default, off here)
    from flashgen.runtime import launch as runtime

    family_build.render = timeline_source  # the probe renders nothing in the other kernels
    off = Options(sparse_persistent="off")
    specs = {n: flashgen.load(n, options=off) for n in args.specs}
    unknown = [p for p in params if all(op.spec.param(p) is None for op in specs.values())]
    if unknown:
        ap.error(f"--param {', '.join(unknown)}: no such param in {', '.join(args.specs)}")
    b, h, s = args.shape
    dev = torch.device("cuda")
    for name in args.specs:
        op = specs[name]
        spec = op.spec
        q = torch.randn(b, h, s, spec.head_dim, device=dev, dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        mine = {k_: v_ for k_, v_ in params.items() if spec.param(k_) is not None}
        op.attention(q, k, v, **mine)
        torch.cuda.synchronize()
        # the kernel the call ran: the op picks its tiles per call (registry.sparse_tiles)
        dims = op_mod.validate(spec, q, k, v, {})
        kern = op.kernel(dev, sparse=op._sparse_call(dims, op_mod.resolve_params(spec, mine)[0]))
        if launch_ctas(kern.plan, b, h, s) > MAX_CTAS:
            print(f"{name}: more than {MAX_CTAS} CTAs", file=sys.stderr)
            return 2
        key = next(key for key, val in runtime._loaded.items() if val is kern)
        buf = cupy.ndarray((MAX_CTAS, SLOTS), cupy.int64, kern.module.get_global("fg_prof"))
        buf[:] = 0
        op.attention(q, k, v, **mine)
        torch.cuda.synchronize()
        label = f"{name} B={b} H={h} S={s} {mine or ''} ({key[1]})"
        print("\n".join(summarize(cupy.asnumpy(buf), label)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
