#!/usr/bin/env python3
"""A/B sweep of the Hopper forward kernel's knobs on the present GPU, in one command.

For head_dim 64/128/256, causal off/on, bf16, at the FlashAttention papers' shape
(B * S = 16384 tokens, hidden 2048, so H = 2048 / head_dim) and S = 16384 unless --seqlen:
builds each variant (BLOCK_N, ring stages, CTA order) with ``plan_hopper_forward``,
checks it on one odd-sized case against SDPA's math backend in fp32, and times it with
``triton.testing.do_bench`` (median; inputs rotated over 4 buffers) next to SDPA's
CUDNN_ATTENTION and FLASH_ATTENTION backends in the same process.  Prints a table of
TFLOP/s (4 * B * H * S^2 * D, halved for causal) and the ratio to cuDNN; --json writes
the rows.

    python3 tools/hopper_sweep.py --dims 128 --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from flashgen.build import cache  # noqa: E402
from flashgen.build.render import render  # noqa: E402
from flashgen.codegen.plan import TileConfig  # noqa: E402
from flashgen.families import hopper_fwd  # noqa: E402
from flashgen.frontend import ir
from flashgen.frontend.spec import loads_spec  # noqa: E402
from flashgen.ops.op import kernel_values, validate  # noqa: E402
from flashgen.runtime import launch as runtime

SPEC = """
name: sweep_d{d}_{c}
head_dim: {d}
dtype: bf16
{mask}
"""

#: head_dim -> variants: (BLOCK_N, stages, CTA order: None = the default, "flip" = the other)
VARIANTS = {
    64: [(128, 2, None), (192, 2, None), (96, 2, None)],
    128: [(128, 2, None), (160, 2, None), (176, 2, None), (128, 2, "flip")],
    256: [(64, 2, None), (80, 2, None)],
}


def build(spec: ir.Spec, bn: int, stages: int, m_major):
    if m_major == "flip":
        m_major = True  # the default is head-major
    plan = hopper_fwd.plan(
        spec, "sm_90", hopper_fwd.Options(), tiles=TileConfig(128, bn, 12), stages=stages,
        m_major=m_major,
    )
    cubin, report = cache.get_or_build(render(plan), plan)
    return runtime.load(cubin, plan, torch.cuda.current_device()), report


def launch(kern, spec, q, k, v, o, lse, scale):
    dims = validate(spec, q, k, v, {})
    vals = kernel_values(spec, {"q": q, "k": k, "v": v, "o": o, "lse": lse}, dims, scale, [], {})
    grid = kern.plan.grid(
        dims.batch, dims.heads_q, dims.seqlen_q, heads_kv=dims.heads_kv, seqlen_k=dims.seqlen_k
    )
    kern.launch(grid, vals, torch.cuda.current_stream().cuda_stream)


def check(kern, spec, causal: bool) -> float:
    b, h, sq, sk, d = 2, 3, 300, 517, spec.head_dim
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for s in (sq, sk, sk))
    o = torch.full((b, h, sq, d), math.nan, device="cuda", dtype=torch.bfloat16)
    lse = torch.full((b, h, sq), math.nan, device="cuda")
    launch(kern, spec, q, k, v, o, lse, d**-0.5)
    mask = None
    if causal:  # bottom-right aligned
        mask = torch.ones(sq, sk, dtype=torch.bool, device="cuda").tril(sk - sq)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    ref = torch.nan_to_num(ref)  # rows with nothing to attend to: 0
    return (o.float() - ref).abs().max().item()


def median_ms(fn, bufs) -> float:
    """do_bench median (ms) of ``fn(*bufs[i % 4])``, rotating the input buffers."""
    from triton.testing import do_bench

    it = iter(range(1 << 30))
    return do_bench(lambda: fn(*bufs[next(it) % 4]), warmup=50, rep=300, return_mode="median")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("hopper_sweep.py needs a compute capability 9.x GPU (H100/H200)", file=sys.stderr)
        return 2
    rows = []
    s = args.seqlen
    for d in args.dims:
        h, b = 2048 // d, max(1, 16384 // s)
        bufs = [
            tuple(torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            for _ in range(4)
        ]
        o = torch.empty(b, h, s, d, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(b, h, s, device="cuda")
        for causal in (False, True):
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            mask = "mask: causal" if causal else ""
            spec = loads_spec(SPEC.format(d=d, c="causal" if causal else "full", mask=mask))
            peers = {}
            for name, be in (
                ("cudnn", SDPBackend.CUDNN_ATTENTION),
                ("fa2", SDPBackend.FLASH_ATTENTION),
            ):
                with sdpa_kernel(be):
                    ms = median_ms(
                        functools.partial(F.scaled_dot_product_attention, is_causal=causal), bufs
                    )
                peers[name] = flops / ms / 1e9
            for bn, stages, m_major in VARIANTS[d]:
                try:
                    kern, rep = build(spec, bn, stages, m_major)
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"d{d} causal={causal} bn={bn} st={stages}: {type(e).__name__}: {e}")
                    continue
                err = check(kern, spec, causal)
                run = functools.partial(_launch_into, kern, spec, o, lse, d**-0.5)
                tflops = flops / median_ms(run, bufs) / 1e9
                row = dict(d=d, causal=causal, block_n=bn, stages=stages, err=err, tflops=tflops,
                           m_major=kern.plan.context["m_major"], spills=rep.spill_bytes,
                           cudnn=peers["cudnn"], fa2=peers["fa2"])  # fmt: skip
                rows.append(row)
                print(
                    f"d{d:3d} {'causal' if causal else 'full  '} BN={bn:3d} st={stages} "
                    f"m_major={row['m_major']!s:5} err={err:.2e} {tflops:6.1f} TFLOP/s  "
                    f"cudnn {peers['cudnn']:6.1f} ({tflops / peers['cudnn']:.2f}x)  "
                    f"fa2 {peers['fa2']:6.1f}",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def _launch_into(kern, spec, o, lse, scale, q, k, v):
    launch(kern, spec, q, k, v, o, lse, scale)


if __name__ == "__main__":
    sys.exit(main())
