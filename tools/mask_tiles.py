#!/usr/bin/env python3
"""The gallery's head_dim-128 specs on the Hopper forward at each BLOCK_N, on the present
H100/H200: is the d128 tile of ``flashgen/families/tiles.py``'s HOPPER_TILES (128 x 160, picked on
dense attention; HOPPER_TABLE_TILES for masks that read tensors) the best tile for the masks?

A mask's partial tiles cost more than full ones (the mask is evaluated per element), and
how many there are depends on BLOCK_N: with BLOCK_M = BLOCK_N = 128 and Sq = Sk the
causal diagonal is one tile per query block; at 160 it straddles two in most of them.
For each spec and each ``--block-n``: the op's plan with that BLOCK_N in place of the
table's (every other choice the same), built for all candidates first (nvcc in
parallel), checked against the op at the spec's own tile on the timing inputs (max |diff|,
must be under 2e-2 in bf16), then timed at the gallery's shape (batch * seqlen = 16384,
heads * head_dim = 2048, Sq = Sk = ``--seqlen``; ``flashgen.bench.runner.do_bench_ms`` medians
over ``--rounds`` rounds that alternate the candidates).  A spec whose mask reads
tensors runs with a block table built once for each candidate's tiles.  Prints ms,
TFLOP/s over the kept pairs, and the ratio to the spec's own tile.

    python3 tools/mask_tiles.py                          # about two minutes on an H200
    python3 tools/mask_tiles.py --block-n 128 160 --specs prefix_lm --json out.json

Needs a compute capability 9.x GPU.  Exit status 0, or 2 without one.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

SPECS = ("causal_d128", "prefix_lm", "chunked_local", "mistral_swa", "document_mask", "alibi")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specs", nargs="+", default=list(SPECS))
    ap.add_argument("--block-n", type=int, nargs="+", default=[128, 160, 176])
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("mask_tiles.py needs a compute capability 9.x GPU (H100/H200)", file=sys.stderr)
        return 2

    from flashgen.MISSING import SPARSE_TILES_ENV
    from gallery import gallery_params

    from flashgen.bench import runner as bench
    from flashgen.codegen.abi import needs_block_table
    from flashgen.codegen.plan import TileConfig
    from flashgen.families.registry import plan_forward
    from flashgen.families.tiles import (
        HOPPER_TABLE_TILES,
        HOPPER_TILES,
        hopper_tiles,
    )
    from flashgen.frontend.spec import load_spec
    from flashgen.ops.op import build_op

    # each candidate's BLOCK_N in every call: a call whose mask keeps few keys per row would
    # run HOPPER_SPARSE_TILES instead (the op's per-call choice), whatever BLOCK_N is set
    os.environ[SPARSE_TILES_ENV] = "0"
    dev = torch.device("cuda", torch.cuda.current_device())
    gpu = torch.cuda.get_device_name(dev)
    table_tile = HOPPER_TILES[(128, False)]
    block_table_tile = HOPPER_TABLE_TILES.get(128)

    def with_block_n(bn: int | None):
        """HOPPER_TILES' d128 row (no score_mod: alibi's affine split keeps it) and the
        block-table row at ``bn`` (None: as they were)."""
        if bn is None:
            HOPPER_TILES[(128, False)] = table_tile
            if block_table_tile is not None:
                HOPPER_TABLE_TILES[128] = block_table_tile
            return
        tile = TileConfig(128, bn, table_tile.num_warps)
        HOPPER_TILES[(128, False)] = tile
        if block_table_tile is not None:
            HOPPER_TABLE_TILES[128] = tile

    ops = {}
    for name in args.specs:
        spec = load_spec(REPO / "specs" / f"{name}.yaml")
        if spec.head_dim != 128:
            print(f"{name}: head_dim {spec.head_dim}, skipped (d128 row only)", file=sys.stderr)
            continue
        ops[name] = build_op(spec)

    # build every (spec, BLOCK_N) kernel first, nvcc in parallel (the op's builds below then
    # find them in the cache)
    from flashgen.build import cache
    from flashgen.build.render import render

    def prebuild(spec, bn):
        tiles = TileConfig(128, bn, table_tile.num_warps)
        plan = plan_forward(spec, "sm_90", gpu=gpu, tiles=tiles, persistent=False)
        return cache.get_or_build(render(plan), plan)[1]

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        jobs = {
            (name, bn): pool.submit(prebuild, op.spec, bn)
            for bn in args.block_n
            for name, op in ops.items()
        }
        for (name, bn), fut in jobs.items():
            try:
                rep = fut.result()
                print(f"{name} BLOCK_N={bn}: {rep.registers} registers, {rep.spill_bytes} B "
                      "spilled", file=sys.stderr)  # fmt: skip
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{name} BLOCK_N={bn}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)

    rows = []
    for name, op in ops.items():
        spec = op.spec
        b, h = bench.problem(args.seqlen, spec.head_dim)
        s = args.seqlen
        params = gallery_params(spec, b, h, s, dev, 1024)
        kept = bench.kept_pairs(spec, b, h, s, params, dev)
        flops = 2 * (spec.head_dim + spec.head_dim_v) * kept
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (
            torch.randn(b, h, s, 128, device=dev, generator=g).to(torch.bfloat16) for _ in range(3)
        )
        ref = None
        variants = {}  # BLOCK_N -> (the op's kernel cache with that kernel, call, max diff)
        default_bn = hopper_tiles(spec).block_n  # the spec's tile in the tables
        order = [default_bn, *[x for x in args.block_n if x != default_bn]]
        for bn in order:
            with_block_n(bn)
            op._kernels.clear()
            try:
                kern = op.kernel(dev)
                if kern.plan.tiles.block_n != bn:  # select fell back (spills)
                    print(f"{name} BLOCK_N={bn}: built {kern.plan.tiles}", file=sys.stderr)
                    continue
                extra = {}
                if needs_block_table(spec):
                    extra["block_mask"] = op.block_mask(s, s, batch=b, num_heads=h, **params)

                def call(extra=extra, op=op, params=params, qkv=(q, k, v)):
                    return op.attention(*qkv, **params, **extra)

                o, _ = call()
                torch.cuda.synchronize()
                if ref is None:
                    ref = o.float()
                variants[bn] = (dict(op._kernels), call, (o.float() - ref).abs().max().item())
            except Exception as e:  # noqa: BLE001
                print(f"{name} BLOCK_N={bn}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
            finally:
                with_block_n(None)
        times: dict[int, list] = {bn: [] for bn in variants}
        for _ in range(args.rounds):
            for bn, (kernels, call, _) in variants.items():
                op._kernels.clear()
                op._kernels.update(kernels)  # the op runs this variant's kernel
                times[bn].append(bench.do_bench_ms(call, args.warmup, args.rep))
        op._kernels.clear()
        base = statistics.median(times[default_bn]) if default_bn in times else None
        for bn, ts in times.items():
            ms = statistics.median(ts)
            row = {
                "spec": name,
                "block_n": bn,
                "ms": ms,
                "tflops": flops / (ms * 1e-3) / 1e12,
                "vs_table": base / ms if base else None,
                "max_diff": variants[bn][2],
                "rounds_ms": ts,
            }
            rows.append(row)
            bad = "  BAD" if not row["max_diff"] <= 2e-2 else ""
            print(
                f"{name:14s} BLOCK_N={bn:3d}: {ms:.3f} ms {row['tflops']:6.1f} TFLOP/s  "
                f"x{row['vs_table'] or 0:.3f} vs {default_bn}  diff "
                f"{row['max_diff']:.1e}{bad}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
