#!/usr/bin/env python3
"""A/B of the affine score_mod split (flashgen/analysis/affine.py) on a GPU: each spec's forward with
the split (default) and without it (``FLASHGEN_AFFINE=0`` while that op plans its kernel),
timed in the same process on the same inputs, with the largest difference between the two
outputs.

    python3 tools/affine_ab.py                      # alibi + two affine user specs, S = 8192
    python3 tools/affine_ab.py --specs alibi --seqlen 16384

Shape as tools/gallery.py: batch * seqlen = 16384 tokens, heads * head_dim = 2048, bf16
(the user specs keep their own dtype), Sq = Sk; ALiBi's slopes 2^(-8i/H).  TFLOP/s count
kept pairs only (``2 * (D + Dv) * kept``, causal: S (S + 1) / 2 per head).  Kernel family
and persistence follow the environment (``FLASHGEN_KERNEL_FAMILY``, ``FLASHGEN_PERSISTENT``).
About a minute on an H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

USER_SPECS = {
    "affine_linear_causal": """\
name: affine_linear_causal
head_dim: 128
dtype: bf16
mask: causal
score_mod: score + 0.125 * (kv_idx - q_idx)
""",
    "affine_slope_param": """\
name: affine_slope_param
head_dim: 64
dtype: fp16
score_mod: score - w[h] * (q_idx - kv_idx) + p
params:
  w: {type: f32, shape: [num_heads]}
  p: {type: f32, default: 0.25}
""",
}


def load(name: str):
    from flashgen.frontend.spec import load_spec, loads_spec

    if name in USER_SPECS:
        return loads_spec(USER_SPECS[name], f"{name}.yaml")
    return load_spec(REPO / "specs" / f"{name}.yaml")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--specs", nargs="*", default=["alibi", *USER_SPECS])
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    args = ap.parse_args(argv)

    import torch
    from flashgen.MISSING import AFFINE_ENV

    from flashgen.analysis import affine
    from flashgen.bench.runner import do_bench_ms
    from flashgen.cli.commands import random_inputs
    from flashgen.codegen.cuda_expr import split_causal
    from flashgen.ops.op import build_op

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    s = args.seqlen
    print(f"{'spec':24} {'affine ms':>10} {'TFLOP/s':>8} {'plain ms':>10} {'TFLOP/s':>8} "
          f"{'speedup':>8} {'max|do|':>10} {'max|dlse|':>10}")  # fmt: skip
    for name in args.specs:
        spec = load(name)
        if affine.decompose(spec.score_mod, spec) is None:
            print(f"{name:24} (no affine score_mod: skipped)")
            continue
        d, dv = spec.head_dim, spec.head_dim_v
        b, h = max(1, 16384 // s), max(1, 2048 // d)
        gen = torch.Generator(device=dev).manual_seed(0)
        q, k, v, params = random_inputs(spec, b, h, h, s, s, dev, gen)
        for p in spec.tensor_params:  # slopes as ALiBi's 2^(-8i/H), signed for the user spec
            if tuple(p.shape) == ("num_heads",):
                sl = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device=dev)
                sign = 2.0 * (torch.arange(h, device=dev) % 2) - 1.0
                params[p.name] = sl if name == "alibi" else sl * sign
        causal, residual = split_causal(spec.mask)
        kept = (s * (s + 1) // 2 if causal else s * s) if residual is None else None
        outs, times = {}, {}
        for mode in ("affine", "plain"):
            op = build_op(dataclasses.replace(spec, name=f"{spec.name}_ab_{mode}"))
            old = os.environ.get(AFFINE_ENV)
            os.environ[AFFINE_ENV] = "1" if mode == "affine" else "0"
            try:
                outs[mode] = op.attention(q, k, v, **params)  # plans and builds under the flag
                torch.cuda.synchronize()
            finally:
                if old is None:
                    os.environ.pop(AFFINE_ENV)
                else:
                    os.environ[AFFINE_ENV] = old
            call = lambda op=op, q=q, k=k, v=v, kw=params: op.attention(q, k, v, **kw)  # noqa: E731
            times[mode] = do_bench_ms(call, args.warmup, args.rep)
        flops = [
            2 * (d + dv) * kept * b * h / (times[m] * 1e-3) / 1e12 if kept else float("nan")
            for m in ("affine", "plain")
        ]
        do = (outs["affine"][0].float() - outs["plain"][0].float()).abs().max().item()
        fin = torch.isfinite(outs["plain"][1])
        dl = (outs["affine"][1][fin] - outs["plain"][1][fin]).abs().max().item()
        speedup = times["plain"] / times["affine"]
        print(f"{name:24} {times['affine']:10.3f} {flops[0]:8.1f} {times['plain']:10.3f} "
              f"{flops[1]:8.1f} {speedup:7.3f}x {do:10.2e} {dl:10.2e}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
