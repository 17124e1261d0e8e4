#!/usr/bin/env python3
"""t5_bias's Hopper forward at each BLOCK_N, on the present H100/H200: which d64 tile the
``(64, True)`` row of ``flashgen/lower.py``'s HOPPER_TILES should hold.

The row is 128 x 96 because 128 x 192 spilled with the clamped 64-bit bias reads; with the
reads lowered as a hoisted row base plus an int offset (``lower._tensor_read``) ptxas
reports 0 spills at 96, 128, 160 and 192 (``tools/tile_spills.py fwd --specs
specs/t5_bias.yaml --targets sm_90 --tiles 128,96,12 128,192,12 ...``).  For each BLOCK_N:
build the kernel (``plan_hopper_forward``), check it on one odd-sized GQA-free case against
the fp64 reference (max |error| printed, must be under the bf16 bound the GPU tests use:
checked loosely here, 2e-2), and time it at the gallery's shape (batch * seqlen = 16384,
heads * head_dim = 2048, Sq = Sk = 8192, bf16; ``flashgen.bench.runner.do_bench_ms`` median).
Prints TFLOP/s (4 * B * H * S^2 * D) per BLOCK_N and the op's own (today's table) time.

    python3 tools/t5_tiles.py                 # about a minute on an H200
    python3 tools/t5_tiles.py --block-n 96 192 --seqlen 4096
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from flashgen.bench import runner as bench  # noqa: E402
from flashgen.build import cache
from flashgen.build.render import render  # noqa: E402
from flashgen.codegen.plan import TileConfig  # noqa: E402
from flashgen.families import hopper_fwd  # noqa: E402
from flashgen.frontend.spec import load_spec  # noqa: E402
from flashgen.ops.op import build_op, kernel_values, validate  # noqa: E402
from flashgen.ops.reference import attention_reference  # noqa: E402
from flashgen.runtime import launch as runtime

REPO = Path(__file__).resolve().parent.parent


def build(spec, block_n: int):
    plan = hopper_fwd.plan(spec, "sm_90", hopper_fwd.Options(), tiles=TileConfig(128, block_n, 12))
    cubin, report = cache.get_or_build(render(plan), plan)
    return runtime.load(cubin, plan, torch.cuda.current_device()), report


def launch(kern, spec, q, k, v, bias, o, lse):
    scale = spec.head_dim**-0.5
    dims = validate(spec, q, k, v, {"bias": bias})
    tensors = {"q": q, "k": k, "v": v, "o": o, "lse": lse}
    vals = kernel_values(spec, tensors, dims, scale, [], {"bias": bias})
    grid = kern.plan.grid(
        dims.batch, dims.heads_q, dims.seqlen_q, heads_kv=dims.heads_kv, seqlen_k=dims.seqlen_k
    )
    kern.launch(grid, vals, torch.cuda.current_stream().cuda_stream)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-n", type=int, nargs="+", default=[96, 128, 160, 192])
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("t5_tiles.py needs a compute capability 9.x GPU (H100/H200)", file=sys.stderr)
        return 2
    spec = load_spec(REPO / "specs" / "t5_bias.yaml")
    d, s = spec.head_dim, args.seqlen
    b, h = max(1, 16384 // s), 2048 // d
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=dev, generator=g).to(torch.bfloat16)

    # correctness case: odd lengths, Sq != Sk, |kv_idx - q_idx| past 128
    cq, ck, cv = randn(2, 3, 300, d), randn(2, 3, 517, d), randn(2, 3, 517, d)
    cbias = torch.randn(3, 257, device=dev, generator=g)
    ref_o, _ = attention_reference(spec, cq, ck, cv, params={"bias": cbias})
    # timing case
    q, k, v = randn(b, h, s, d), randn(b, h, s, d), randn(b, h, s, d)
    bias = torch.randn(h, 257, device=dev, generator=g)
    o = torch.empty(b, h, s, d, device=dev, dtype=torch.bfloat16)
    lse = torch.empty(b, h, s, device=dev)
    flops = 4 * b * h * s * s * d

    op = build_op(spec)
    ms = bench.do_bench_ms(lambda: op.attention(q, k, v, bias=bias), args.warmup, args.rep)
    print(f"t5_bias B={b} H={h} S={s} D={d}: op (table tiles) {flops / ms / 1e9:6.1f} TFLOP/s")
    for bn in args.block_n:
        try:
            kern, rep = build(spec, bn)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"BLOCK_N={bn}: {type(e).__name__}: {str(e)[:300]}")
            continue
        co = torch.full((2, 3, 300, d), math.nan, device=dev, dtype=torch.bfloat16)
        clse = torch.full((2, 3, 300), math.nan, device=dev)
        launch(kern, spec, cq, ck, cv, cbias, co, clse)
        torch.cuda.synchronize()
        err = (co.double() - ref_o).abs().max().item()
        ms = bench.do_bench_ms(
            lambda kern=kern: launch(kern, spec, q, k, v, bias, o, lse), args.warmup, args.rep
        )
        print(
            f"BLOCK_N={bn:3d}: {flops / ms / 1e9:6.1f} TFLOP/s  {ms:.3f} ms  err {err:.2e}"
            f"{'  BAD' if not err <= 2e-2 else ''}  regs {rep.registers} spills "
            f"{rep.spill_bytes}B",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
