"""Launch the fp8 Hopper forward of a shipped spec a few times, for a profiler
(``ncu -k regex:fwd_sm_90 python tools/fp8_profile.py causal_d128``), with the bf16 build of the
same spec for comparison (``--bf16``).  Inputs: B=2, H=32 (Hkv as the spec's GQA test shape:
32), S=8192 unless given.  Needs an sm_90 GPU."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
import test_fp8_kernel as t  # noqa: E402

import flashgen  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("spec")
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--probes", default="")
    a = ap.parse_args()
    spec = t.fp8_spec(a.spec)
    b, h, s, d = 2, a.heads, a.seqlen, spec.head_dim
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if a.bf16:
        op = flashgen.load(t.SPECS / f"{a.spec}.yaml")
        for _ in range(a.reps):
            op.attention(q, k, v)
    else:
        q8, qd = t.quantize(q.float(), (b, h), 1)
        k8, kd = t.quantize(k.float(), (b, h), 1)
        v8, vd = t.quantize(v.float(), (b, h), 1)
        probes = frozenset(p for p in a.probes.split(",") if p)
        params = {p.name: p.default for p in spec.scalar_params}
        for _ in range(a.reps):
            t.run_fp8(spec, q8, k8, v8, qd, kd, vd, d**-0.5, params, sync=False, probes=probes)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
