"""Time the CPU op (blocked, flashgen/ops/cpu/attention.py) against torch SDPA on the CPU.

    flashgen bench --cpu [--seqlen 4096] [--heads 8] [--head-dim 128] [--reps 3]
                         [--dtype float32 --dtype bfloat16]

Inputs [1, H, S, D] in each dtype (default float32); prints the median time of each and the
ratio, for a spec without a mask and a causal one (the two timed in alternation).
"""

from __future__ import annotations

import argparse
import statistics
import time

from flashgen.bench import helptext
from flashgen.bench.argtypes import positive_int
from flashgen.frontend import ir

SPEC = """
name: cpu_bench_{tag}_d{d}
head_dim: {d}
dtype: bf16
mask: {mask}
"""


def _alternating(fa, fb, reps: int) -> tuple[float, float]:
    """Medians of ``reps`` timings of ``fa`` and ``fb``, run in alternation (a shared
    machine's load hits both alike)."""
    fa(), fb()  # warm-up
    ta, tb = [], []
    for _ in range(reps):
        for fn, ts in ((fa, ta), (fb, tb)):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def main(argv=None, prog=None) -> int:
    import torch
    import torch.nn.functional as F

    from flashgen.frontend.spec import loads_spec
    from flashgen.ops.cpu import attention as cpu_attention
    from flashgen.ops.op import build_op

    ap = argparse.ArgumentParser(
        prog=prog, description=helptext.plain(__doc__), formatter_class=helptext.HelpFormatter
    )
    ap.add_argument("--seqlen", type=positive_int("seqlen"), default=4096)
    ap.add_argument("--heads", type=positive_int("heads"), default=8)
    ap.add_argument("--head-dim", type=int, default=128, choices=ir.SUPPORTED_HEAD_DIMS)
    ap.add_argument("--reps", type=positive_int("reps"), default=3)
    ap.add_argument("--chunk-elems", type=positive_int("chunk-elems"), default=None,
                    help="logits per query chunk")  # fmt: skip
    ap.add_argument("--dtype", action="append", choices=["float32", "bfloat16", "float16"])
    a = ap.parse_args(argv)
    if a.chunk_elems:
        cpu_attention._CHUNK_ELEMS = a.chunk_elems
    g = torch.Generator().manual_seed(0)
    shape = (1, a.heads, a.seqlen, a.head_dim)
    q32, k32, v32 = (torch.randn(shape, generator=g) for _ in range(3))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {list(shape)}")
    print("| dtype | mask | flashgen CPU (s) | SDPA CPU (s) | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for dtype in a.dtype or ["float32"]:
        q, k, v = (t.to(getattr(torch, dtype)) for t in (q32, k32, v32))
        for tag, mask, causal in (("none", "null", False), ("causal", "causal", True)):
            op = build_op(loads_spec(SPEC.format(tag=tag, d=a.head_dim, mask=mask)))
            with torch.no_grad():
                o, _ = op.attention(q, k, v)
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                err = (o.float() - ref.float()).abs().max().item()
                t_fg, t_sd = _alternating(
                    lambda op=op, q=q, k=k, v=v: op.attention(q, k, v),
                    lambda c=causal, q=q, k=k, v=v: F.scaled_dot_product_attention(
                        q, k, v, is_causal=c
                    ),
                    a.reps,
                )
            print(
                f"| {dtype} | {tag} | {t_fg:.3f} | {t_sd:.3f} | {t_fg / t_sd:.2f} |  "
                f"(max |diff| {err:.1e})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
