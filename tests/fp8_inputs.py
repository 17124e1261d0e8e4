"""Random fp8 attention inputs of the fp8 tests (tests/gpu/test_fp8_gpu.py, and the CPU
emulation of the per-block kernel in tests/unit/test_fp8_block_emulation.py, which checks
that these inputs suit the FP8 tensor cores: :data:`BLOCKY`).

Test modules import this by module name (tests/ is on ``sys.path``: conftest's folder)."""

from __future__ import annotations

import torch

from flashgen import fp8
from flashgen.bench.verify import random_tensor_params

#: Issue 41: per-block descales (``fp8.quantize(block_rows=128)``), each 128-row block of q, k
#: and v scaled by 10^U(-1.5, 1.5) first: descales 1000x apart within a head.  q's values are
#: scaled by 1e-2 first (k's by 3 and v's by 0.5, as tests/gpu/test_fp8_gpu.py's check()
#: does), so the logits stay below about 50 (where a q block and a k block both come out 30x
#: up; near 0 where both come out 30x down).  Without it they reached 1e3 to 1e4, where the
#: FP8 wgmma's Q K^T (its k = 32 products summed 13 bits below the largest one, truncated:
#: FP22 accumulation) is off by 1e-4 to 1e-3 of the logit, 0.1 to 1 in absolute terms: a row
#: whose two largest logits are that close weighs its two keys wrongly, errors of the size of
#: v, in the [B, Hkv] kernel as much as in the per-block one.  No fp8 kernel avoids that, and
#: issue 24's bound (a float32 emulation with exact products) does not model it
#: (tests/unit/test_fp8_block_emulation.py).
BLOCKY = {"block_rows": 128, "spreads": (1.5, 1.5, 1.5), "scales": (1e-2, 3.0, 0.5)}


def quantized(spec, b, hq, hkv, sq, sk, seed, *, scales=(1.0, 1.0, 1.0), block_rows=None,
              spreads=(0.0, 0.0, 0.0), device="cuda"):  # fmt: skip
    """Random inputs quantized to e4m3: (q8, k8, v8, (q_descale, k_descale, v_descale),
    tensor params), on ``device`` (its generator seeded with ``seed``).  ``scales`` multiply
    the float q, k, v first (so descales differ).  ``block_rows=128``: per-block descales
    (issue 41); ``spreads``: each 128-row block of q, k, v is multiplied by 10^U(-spread,
    spread) first, so per-block descales differ within a head by orders of magnitude."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    d, dv = spec.head_dim, spec.head_dim_v
    q = torch.randn(b, hq, sq, d, device=dev, generator=g) * scales[0]
    k = torch.randn(b, hkv, sk, d, device=dev, generator=g) * scales[1]
    v = torch.randn(b, hkv, sk, dv, device=dev, generator=g) * scales[2]
    if any(spreads):
        rows = fp8.BLOCK_ROWS

        def spread(x, e):
            n = fp8.block_count(x.shape[2])
            f = 10.0 ** ((torch.rand(*x.shape[:2], n, device=dev, generator=g) * 2 - 1) * e)
            return x * f.repeat_interleave(rows, dim=2)[:, :, : x.shape[2], None]

        q, k, v = (spread(x, e) for x, e in zip((q, k, v), spreads, strict=True))
    q8, k8, v8, qd, kd, vd = fp8.quantize(q, k, v, block_rows=block_rows)
    sym = {"batch": b, "num_heads": hq, "num_heads_kv": hkv, "seqlen_q": sq, "seqlen_k": sk}
    return q8, k8, v8, (qd, kd, vd), random_tensor_params(spec, sym, dev, g)
