#!/usr/bin/env python3
"""Registers and spills of candidate tiles, per head dims, score_mod and target (no GPU).

Renders and compiles (nvcc, in parallel, through the kernel cache) one kernel unit per
(head dims, dtype, score_mod, target, tiles) and prints ptxas' registers and spill bytes
for each kernel in it: how the head-dim rows of ``flashgen/lower.py``'s tile tables were
picked.  score_mods: ``none`` (plain causal), ``softcap`` (causal + tanh soft-capping) and
``alibi`` (causal + a per-head slope tensor).

    python3 tools/tile_spills.py fwd --dims 96 160 --tiles 128,64,4 64,64,4
    python3 tools/tile_spills.py bwd --dims 192 --tiles 64,32,4,2,64,32,4
    python3 tools/tile_spills.py atomic --dims 192:128 --mods alibi --tiles 64,64,4,2,64,16,4
    python3 tools/tile_spills.py bwd --dims 160          # the table's own tiles
    python3 tools/tile_spills.py fwd --family fa2 --specs specs/*.yaml --varlen

``--specs`` compiles those spec files instead of the generated causal specs (``--dims``,
``--mods`` and ``--dtypes`` then do not apply); ``--varlen`` adds each spec's varlen form
where it has one; ``--family fa2`` plans the FA2-class forward on sm_90 too.
Forward tiles are BLOCK_M,BLOCK_N,WARPS; backward ones KV_N,KV_M,WARPS,DSPLIT,DQ_M,DQ_N,
DQ_WARPS (the atomic path ignores the last three).  ``--dims D`` or ``D:DV``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashgen.build import cache  # noqa: E402
from flashgen.build.render import render  # noqa: E402
from flashgen.codegen.plan import TileConfig  # noqa: E402
from flashgen.families.registry import plan_backward, plan_forward  # noqa: E402
from flashgen.families.tiles import BackwardTiles  # noqa: E402
from flashgen.frontend.spec import load_spec, loads_spec  # noqa: E402
from flashgen.ops.varlen import varlen_spec  # noqa: E402
from flashgen.options import Options  # noqa: E402

MODS = {
    "none": "",
    "softcap": "score_mod: 'softcap * tanh(score / softcap)'\n"
    "params:\n  softcap: {type: f32, default: 30.0}\n",
    "alibi": "score_mod: 'score - slopes[h] * (q_idx + seqlen_k - seqlen_q - kv_idx)'\n"
    "params:\n  slopes: {type: f32, shape: [num_heads]}\n",
}


def spec_for(d: int, dv: int, dtype: str, mod: str):
    text = f"name: t_{d}_{dv}_{dtype}_{mod}\nhead_dim: {d}\nhead_dim_v: {dv}\ndtype: {dtype}\n"
    return loads_spec(text + "mask: causal\n" + MODS[mod], path="<tile_spills>")


def has_varlen_form(spec) -> bool:
    try:
        varlen_spec(spec)
    except Exception:  # noqa: BLE001 - e.g. masks that read tensors have none
        return False
    return True


def run(job):
    kind, (d, dv), dtype, mod, target, tiles, family = job
    spec = mod if not isinstance(mod, str) else spec_for(d, dv, dtype, mod)
    if kind == "fwd":
        t = TileConfig(*tiles) if tiles else None
        plan = plan_forward(spec, target, Options(family=family), tiles=t, persistent=False)
    else:
        t = BackwardTiles(*tiles) if tiles else None
        plan = plan_backward(spec, target, atomic_dq=kind == "atomic", tiles=t).unit
    _, report = cache.get_or_build(render(plan), plan)
    kernels = "  ".join(
        f"{k.name.rsplit('_', 1)[-1]} {k.registers}r/{k.spill_bytes}B" for k in report.kernels
    )
    return job, kernels, plan.smem_bytes, report.spill_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("kind", choices=("fwd", "bwd", "atomic"))
    ap.add_argument("--dims", nargs="+", default=["32", "96", "160", "192"])
    ap.add_argument("--tiles", nargs="*", default=[], help="comma-separated; default: the table's")
    ap.add_argument("--mods", nargs="+", default=list(MODS), choices=list(MODS))
    ap.add_argument("--dtypes", nargs="+", default=["bf16"], choices=("fp16", "bf16"))
    ap.add_argument("--targets", nargs="+", default=["sm_80", "sm_90"])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--specs", nargs="+", default=[], help="spec files instead of --dims/--mods")
    ap.add_argument("--varlen", action="store_true", help="also the specs' varlen forms")
    ap.add_argument("--family", default="auto", choices=("auto", "fa2"), help="forward family")
    args = ap.parse_args(argv)
    dims = [
        tuple(int(x) for x in s.split(":")) if ":" in s else (int(s), int(s)) for s in args.dims
    ]
    tiles = [tuple(int(x) for x in t.split(",")) for t in args.tiles] or [None]
    if args.specs:
        specs = [load_spec(p) for p in args.specs]
        if args.varlen:
            specs += [varlen_spec(s) for s in specs if has_varlen_form(s)]
        jobs = [
            (args.kind, (s.head_dim, s.head_dim_v), s.dtype, s, tg, t, args.family)
            for s in specs
            for t in tiles
            for tg in args.targets
        ]
    else:
        jobs = [
            (args.kind, dd, dt, m, tg, t, args.family)
            for dd in dims
            for t in tiles
            for dt in args.dtypes
            for m in args.mods
            for tg in args.targets
        ]
    spills = 0
    with cf.ThreadPoolExecutor(args.jobs) as pool:
        for (kind, (d, dv), dt, m, tg, t, _), kernels, smem, spill in pool.map(run, jobs):
            spills += spill > 0
            tl = ",".join(map(str, t)) if t else "table"
            name = m if isinstance(m, str) else m.name
            print(f"{kind} {d}/{dv} {dt} {name:8s} {tg} tiles {tl:20s} smem {smem:6d}  {kernels}")
    print(f"{spills} of {len(jobs)} units spill")
    return 0


if __name__ == "__main__":
    sys.exit(main())
