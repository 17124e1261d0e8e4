#!/usr/bin/env python3
"""Validate and time flashgen's varlen kernels on a GPU, in one command.

1. tests: ``pytest tests/gpu/test_varlen_gpu.py`` (forward and backward against the per-sequence
   fp64 reference), once on the default path and once with ``FLASHGEN_ATOMIC_DQ=1`` (the
   atomic-dQ backward);
2. sanitizer: ``compute-sanitizer --tool memcheck`` over a small varlen forward + backward
   with empty sequences, a sequence without keys and oversized max_seqlen (skipped when
   compute-sanitizer is not on PATH);
3. timing (``triton.testing.do_bench`` medians, else CUDA events): causal d128 bf16, H=16,
   16 sequences of random lengths up to ``--max-len`` (seeded), forward and forward+backward
   for the varlen op with exact max_seqlen, with max_seqlen 8x too large, and the padded op
   on the same batch padded to the longest sequence.  TFLOP/s count only the pairs the
   causal mask keeps in the real sequences (4*H*D per kept pair forward, 2.5x that
   backward), so padding shows up as lost throughput.

    python3 tools/varlen_bench.py                      # all three steps
    python3 tools/varlen_bench.py --skip-tests --skip-sanitizer --max-len 16384

Exit status: 0 if every step that ran passed, 1 otherwise, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SANITIZER_DRIVER = r"""
import torch, flashgen
op = flashgen.load("specs/causal_d128.yaml").varlen
lens = [(5, 7), (0, 4), (1, 0), (17, 17), (3, 1), (0, 0), (130, 65), (64, 200)]
cq = torch.tensor([0] + [sum(a for a, _ in lens[: i + 1]) for i in range(len(lens))],
                  dtype=torch.int32, device="cuda")
ck = torch.tensor([0] + [sum(b for _, b in lens[: i + 1]) for i in range(len(lens))],
                  dtype=torch.int32, device="cuda")
q = torch.randn(int(cq[-1]), 4, 128, device="cuda").to(torch.bfloat16).requires_grad_()
k = torch.randn(int(ck[-1]), 2, 128, device="cuda").to(torch.bfloat16).requires_grad_()
v = torch.randn(int(ck[-1]), 2, 128, device="cuda").to(torch.bfloat16).requires_grad_()
for det in (True, False):
    o, lse = op(q, k, v, cq, ck, 1000, 1000, deterministic=det)
    o.backward(torch.randn_like(o))
torch.cuda.synchronize()
assert not any(t.grad.isnan().any() for t in (q, k, v)), "NaN in gradients"
print("FLASHGEN DRIVER OK", flush=True)
"""


def run_tests() -> bool:
    ok = True
    for atomic in ("0", "1"):
        env = dict(os.environ, FLASHGEN_ATOMIC_DQ=atomic)
        cmd = [sys.executable, "-m", "pytest", "tests/gpu/test_varlen_gpu.py", "-q", "-m", "gpu"]
        print(f"$ FLASHGEN_ATOMIC_DQ={atomic} {' '.join(cmd)}", flush=True)
        ok &= subprocess.run(cmd, cwd=REPO, env=env).returncode == 0
    return ok


def run_sanitizer() -> bool | None:
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        print("compute-sanitizer not on PATH: sanitizer step skipped")
        return None
    env = dict(os.environ, FLASHGEN_ATOMIC_DQ="1")
    cmd = [exe, "--tool", "memcheck", "--error-exitcode", "9", sys.executable, "-c",
           SANITIZER_DRIVER]  # fmt: skip
    print("$ compute-sanitizer --tool memcheck <varlen driver>", flush=True)
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    tail = (r.stdout + r.stderr)[-3000:]
    print(tail)
    return r.returncode == 0 and "FLASHGEN DRIVER OK" in r.stdout


def kept_pairs(sq: int, sk: int) -> int:
    """Pairs a bottom-right causal mask keeps for one sequence."""
    return sum(max(0, min(sk, i + sk - sq + 1)) for i in range(sq))


def timer():
    try:
        from triton.testing import do_bench

        return lambda f: do_bench(f, warmup=25, rep=100)
    except ImportError:
        import torch

        def bench(f, n=20):
            f()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                f()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / n

        return bench


def run_timing(max_len: int, seed: int) -> None:
    import torch

    import flashgen

    pop = flashgen.load(REPO / "specs" / "causal_d128.yaml")
    op = pop.varlen
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (16,), generator=g).tolist()
    h, d, dev, dt = 16, 128, "cuda", torch.bfloat16
    total, mx = sum(lens), max(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    q, k, v = (torch.randn(total, h, d, device=dev).to(dt).requires_grad_() for _ in range(3))
    pad = [torch.zeros(16, h, mx, d, device=dev, dtype=dt) for _ in range(3)]
    for i, n in enumerate(lens):
        a = int(cu[i])
        for p, t in zip(pad, (q, k, v), strict=True):
            p[i, :, :n] = t.detach()[a : a + n].transpose(0, 1)
    pq, pk, pv = (p.requires_grad_() for p in pad)
    flops = 4 * h * d * sum(kept_pairs(n, n) for n in lens)
    bench = timer()
    rows = []

    def case(label, fwd):
        ms = bench(fwd)
        out = fwd()
        do = torch.randn_like(out)
        ms_fb = bench(lambda: torch.autograd.grad(fwd(), (q, k, v) if "padded" not in label
                                                  else (pq, pk, pv), do))  # fmt: skip
        rows.append((label, ms, flops / ms / 1e9, ms_fb, 3.5 * flops / ms_fb / 1e9))

    case("varlen, max_seqlen exact", lambda: op(q, k, v, cu, cu, mx, mx)[0])
    case("varlen, max_seqlen 8x", lambda: op(q, k, v, cu, cu, 8 * mx, 8 * mx)[0])
    case("padded op, padded to max", lambda: pop(pq, pk, pv)[0])
    print(f"\ncausal d128 bf16 H={h}, 16 sequences, lengths {lens} (total {total}, max {mx})")
    print(f"{'case':28s} {'fwd ms':>8s} {'TFLOP/s':>8s} {'f+b ms':>8s} {'TFLOP/s':>8s}")
    for label, ms, tf, ms_fb, tf_fb in rows:
        print(f"{label:28s} {ms:8.3f} {tf:8.1f} {ms_fb:8.3f} {tf_fb:8.1f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-sanitizer", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    ok = True
    if not args.skip_tests:
        ok &= run_tests()
    if not args.skip_sanitizer:
        ok &= run_sanitizer() is not False
    if not args.skip_timing:
        run_timing(args.max_len, args.seed)
    print("varlen_bench:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
