#!/usr/bin/env python3
"""A/B of the sparse calls' kernels on a GPU, masks that divide first: the non-persistent
128 x 128 Hopper forward against the persistent dynamic one, whose producer walks the live key
blocks warp-wide (``fg::iv::WarpWalk``, ``lower.plan_hopper_forward(warp_walk=True)``) or one
classifier call at a time (``fg::iv::prev_live``, ``FLASHGEN_PERSISTENT_WARP_WALK=0``), with
windows (no division) for contrast.

    python3 tools/sparse_walk_ab.py                      # on an H200: under 2 minutes
    python3 tools/sparse_walk_ab.py --cases chunked_local:chunk=512 --seqlen 8192

Modes (environment while each op plans, builds and is called; ``FLASHGEN_SPARSE_PERSISTENT``
is read at every call, ``FLASHGEN_PERSISTENT_WARP_WALK`` when the kernel is planned, so each
mode has an op of its own):

- ``nonpers``: ``FLASHGEN_SPARSE_PERSISTENT=0`` (the non-persistent kernel);
- ``warp``: ``FLASHGEN_SPARSE_PERSISTENT=dynamic`` (the default) with the warp-wide walk;
- ``serial``: the same with ``FLASHGEN_PERSISTENT_WARP_WALK=0`` (the walk before this change).

Shape: batch 1, 16 heads, seqlen 16384 (``--seqlen``), head_dim 128, bf16.  Times: device time
per call from CUDA graphs of 10 calls each (no host work, no L2 flush), one graph per mode,
replayed in alternating rounds (``--rounds``; drift hits every mode alike), the median over
rounds.  Every case checks which kernel each mode ran (tiles 128 x 128; scheduler; walk), and
that the outputs (o and lse, poisoned first) of ``warp`` and ``serial`` are bitwise equal to
``nonpers`` (same per-tile arithmetic, same blocks and classes): exit status 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_CASES = [
    "chunked_local:chunk=1024",
    "chunked_local:chunk=2048",
    "mistral_swa:window=256",
    "mistral_swa:window=1024",
]

#: mode -> environment while its op is planned, built and called
MODES = {
    "nonpers": {"FLASHGEN_SPARSE_PERSISTENT": "0"},
    "warp": {
        "FLASHGEN_SPARSE_PERSISTENT": "dynamic",
        "FLASHGEN_PERSISTENT_WARP_WALK": "1",
    },
    "serial": {
        "FLASHGEN_SPARSE_PERSISTENT": "dynamic",
        "FLASHGEN_PERSISTENT_WARP_WALK": "0",
    },
}
#: mode -> (scheduler, warp_walk) its sparse kernel's plan must have
EXPECT = {"nonpers": (None, False), "warp": ("dynamic", True), "serial": ("dynamic", False)}
#: the switches every mode leaves at their defaults (the op's sparse tiles, no FLASHGEN_PERSISTENT)
BASE_ENV = {
    "FLASHGEN_SPARSE_TILES": "1",
    "FLASHGEN_PERSISTENT": "0",
    "FLASHGEN_KERNEL_FAMILY": "auto",
}


_SPIED: dict[str, tuple] = {}


def spied_op(spec) -> tuple:
    """``(op, ran)``: ``spec``'s op (one per name in this process) and the list of the plans
    of the kernels its calls ran (appended per call)."""
    from flashgen.ops.op import build_op

    if spec.name not in _SPIED:
        op = build_op(spec)
        ran, kernel = [], op.kernel

        def spy(device, sparse=False):
            kern = kernel(device, sparse=sparse)
            ran.append(kern.plan)
            return kern

        op.kernel = spy
        _SPIED[spec.name] = op, ran
    return _SPIED[spec.name]


def run_case(item: str, args) -> bool:
    """Time and compare the modes on one case; True if the outputs are bitwise equal."""
    import torch
    from flashgen.envflags import scoped_env

    from flashgen.bench.runner import capture_graph, graph_replay_ms, parse_spec_item
    from flashgen.frontend.spec import load_spec
    from flashgen.ops.op import poison_outputs

    name, params = parse_spec_item(item)
    base = load_spec(REPO / "specs" / f"{name}.yaml")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    shape = (args.batch, args.heads, args.seqlen, base.head_dim)
    q, k, v = (torch.randn(shape, device=dev, generator=g).bfloat16() for _ in "qkv")
    outs, graphs = {}, {}
    for mode, env in MODES.items():
        op, ran = spied_op(dataclasses.replace(base, name=f"{base.name}_walk_ab_{mode}"))
        with scoped_env(env):
            with poison_outputs():
                outs[mode] = op.attention(q, k, v, **params)  # plans and builds under env
            torch.cuda.synchronize()
            plan = ran[-1]
            got = (plan.context.get("scheduler"), bool(plan.context.get("warp_walk")))
            if plan.tiles.block_n != 128 or got != EXPECT[mode]:
                raise RuntimeError(
                    f"{item} {mode}: ran tiles {plan.tiles} (scheduler, warp_walk) {got}, "
                    f"expected 128 x 128 {EXPECT[mode]} (is the call sparse?)"
                )
            call = lambda op=op: op.attention(q, k, v, **params)  # noqa: E731
            graphs[mode] = capture_graph(call, args.reps)
    times = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            times[mode].append(graph_replay_ms(graphs[mode], args.reps, args.iters))
    ms = {m: statistics.median(t) for m, t in times.items()}
    ref_o, ref_lse = outs["nonpers"]
    equal = {}
    for mode in ("warp", "serial"):
        o, lse = outs[mode]
        equal[mode] = torch.equal(o, ref_o) and torch.equal(lse, ref_lse)
        if not equal[mode]:
            d = (o.float() - ref_o.float()).abs().nan_to_num(float("inf")).max().item()
            print(f"  {item} {mode}: NOT bitwise equal to nonpers (max |do| {d:.3e})")
    cols = "".join(f" {ms[m]:10.4f}" for m in MODES)
    print(
        f"{item:28}{cols} {ms['warp'] / ms['nonpers']:10.3f} {ms['serial'] / ms['nonpers']:10.3f}"
        f" {ms['warp'] / ms['serial']:10.3f}   {'yes' if all(equal.values()) else 'NO'}",
        flush=True,
    )
    del graphs
    return all(equal.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=DEFAULT_CASES, help="spec:param=value")
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds (median)")
    ap.add_argument("--reps", type=int, default=10, help="calls per CUDA graph")
    ap.add_argument("--iters", type=int, default=5, help="replays per round (median)")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU (sm_90)", file=sys.stderr)
        return 2
    os.environ.update(BASE_ENV)
    print(f"{torch.cuda.get_device_name()}; B={args.batch} H={args.heads} S={args.seqlen} "
          f"d128 bf16; graph device ms per call, median of {args.rounds} rounds")  # fmt: skip
    modes = "".join(f" {m + ' ms':>10}" for m in MODES)
    print(f"{'case':28}{modes} {'warp/np':>10} {'serial/np':>10} {'warp/ser':>10}   bit-equal")
    ok = True
    for item in args.cases:
        ok &= run_case(item, args)
    print("all outputs bitwise equal" if ok else "SOME OUTPUTS DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
