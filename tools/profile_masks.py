#!/usr/bin/env python3
"""Run each gallery mask's Hopper forward once at the gallery's shape, for ncu.

Why chunked_local (chunk 8192 = plain causal at seqlen 8192) ran 25% slower than
causal_d128 on the same mask in session 4's gallery, and prefix_lm / mistral_swa 10-18%
slower per kept FLOP, while their FULL-tile SASS is no longer than causal's: profile them
side by side.

    ncu --kernel-name regex:fwd_sm_90 --section SpeedOfLight --section WarpStateStats \\
        --section SchedulerStats --section InstructionStats --csv --page details \\
        python3 tools/profile_masks.py > ncu_masks.csv

Each kernel runs once (B=2, H=16, S=8192, bf16, default params; document_mask with a
BlockMask built first).  Without ncu it just prints each run's time (one launch, cold).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SPECS = ("causal_d128", "chunked_local", "prefix_lm", "mistral_swa", "document_mask")


def main() -> int:
    import torch

    from flashgen.bench import runner as bench
    from flashgen.codegen.abi import needs_block_table
    from flashgen.frontend.spec import load_spec
    from flashgen.ops.op import TORCH_DTYPE, build_op

    if not torch.cuda.is_available():
        print("profile_masks needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    b, s = 2, 8192
    for name in SPECS:
        spec = load_spec(REPO / "specs" / f"{name}.yaml")
        h = 2048 // spec.head_dim
        params = bench.spec_params(spec, h, b, s, s, dev, doc_len=1024)
        for p in spec.scalar_params:
            params.setdefault(p.name, p.default)
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (
            torch.randn(b, h, s, spec.head_dim, device=dev, generator=g).to(TORCH_DTYPE[spec.dtype])
            for _ in range(3)
        )
        op = build_op(spec)
        op.kernel(dev)  # build before the timed launch
        if needs_block_table(spec):
            params["block_mask"] = op.block_mask(s, s, batch=b, num_heads=h, **params)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        op.attention(q, k, v, **params)
        torch.cuda.synchronize()
        print(f"{name}: {1e3 * (time.perf_counter() - t0):.3f} ms (one cold launch)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
