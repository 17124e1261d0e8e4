"""The fp8 Hopper forward with per-block descales (``*_fwd_sm_90_bd``), emulated on the CPU
tile by tile at its plan's tiles, and what the GPU per-block tests' inputs do to it.

The model follows ``templates/sm_90/fwd.cu.j2`` with ``fp8_block_descale``: one query tile
of BLOCK_M rows per CTA (q's descale of its 128-row block folded into the softmax scale), key
blocks of BLOCK_N keys visited last to first, k's descale of the key block's 128 rows folded
into the block max and the exp2's FFMA, P rounded to e4m3, v's ratio folded into alpha (the
running output kept in the last added block's v units) and the epilogue's ``vd_prev / sum``;
its float32 roundings are the kernel's.  Its two GEMMs either multiply exactly or as the FP8
wgmma does on the H100: a k = 32 instruction sums the accumulator and its 32 exact products
aligned to the largest of them, truncated 13 bits below it (FP22 accumulation; the H100's
results at a near tie of huge logits agreed with this model to 0.03 of a logit).

Found on the H100 (tests/gpu/test_fp8_gpu.py, per-block tests, 14 failures): the per-block
arithmetic is right (exact products: within issue 24's bound at every shape, at logits of
1e3 too), but the inputs the GPU tests used (each 128-row block of q and k scaled by
10^U(-1.5, 1.5), k by 3) put logits at 1e3 to 1e4, where the tensor core's Q K^T is 0.1 to
1 off; rows whose two largest logits are closer than that weigh their keys wrongly (errors
of the size of v), in the [B, Hkv] kernel as in the per-block one, and issue 24's bound (a
float32 emulation with exact products) does not model it.  ``fp8_inputs.BLOCKY`` scales q
down by 1e-3 (logits O(10), descales still 1000x apart within a head): the model meets the
bound there.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from fp8_inputs import BLOCKY, quantized  # noqa: E402  (tests/fp8_inputs.py)

from flashgen import fp8  # noqa: E402
from flashgen.bench.verify import fp8_error_bound  # noqa: E402
from flashgen.families import registry  # noqa: E402
from flashgen.frontend import ir  # noqa: E402
from flashgen.frontend.spec import load_spec  # noqa: E402
from flashgen.ops.validation import default_softmax_scale  # noqa: E402

SPECS = Path(__file__).resolve().parents[2] / "specs"
BASES = {64: "gpt2_d64", 128: "causal_d128", 256: "bidir_d256"}
#: The inputs of the GPU per-block tests before the fix (tests/gpu/test_fp8_gpu.py's check():
#: k scaled by 3, v by 0.5; each 128-row block by 10^U(-1.5, 1.5)).
OLD_BLOCKY = {"block_rows": 128, "spreads": (1.5, 1.5, 1.5), "scales": (1.0, 3.0, 0.5)}
F32 = torch.float32


def as_fp8(d: int, causal: bool) -> ir.Spec:
    spec = load_spec(SPECS / f"{BASES[d]}.yaml")
    name = f"{spec.name}_fp8_{'causal' if causal else 'nomask'}"
    return dataclasses.replace(
        spec, name=name, dtype="fp8_e4m3", targets=ir.FP8_TARGETS,
        mask=ir.Causal() if causal else None,
    )  # fmt: skip


def f32(x):
    """x rounded to float32, kept in float64 (the kernel's registers)."""
    return x.to(F32).double()


def wgmma(a, b, c, tensor_core: bool):
    """``c + a @ b.T`` as the FP8 wgmma accumulates it, in float32: ``a`` [M, K], ``b``
    [N, K] (e4m3 values), ``c`` [M, N].  ``tensor_core`` False: exact products and sums,
    rounded once; True: per k = 32 step, c and the 32 products aligned to the largest and
    truncated 13 bits below it, then summed (the H100's FP22 accumulation)."""
    if not tensor_core:
        return f32(c + a @ b.T)
    for k0 in range(0, a.shape[1], 32):
        terms = torch.cat([c[..., None], a[:, None, k0 : k0 + 32] * b[None, :, k0 : k0 + 32]], -1)
        top = terms.abs().amax(-1, keepdim=True)
        ulp = torch.where(top > 0, torch.exp2(torch.floor(torch.log2(top)) - 13), 1.0)
        c = f32((torch.trunc(terms / ulp) * ulp).sum(-1))
    return c


def emulate_bd_kernel(spec, q8, k8, v8, descales, tiles, *, tensor_core: bool):
    """(o [B, Hq, Sq, Dv] float64, lse [B, Hq, Sq]) of the per-block kernel at ``tiles``
    (BLOCK_M, BLOCK_N of its plan), per-block ``descales`` ``(q [B, Hq, nq], k, v [B, Hkv,
    nk])``; no mask or the causal one (bottom-right), no score_mod."""
    qd, kd, vd = (d.double() for d in descales)
    q, k, v = (x.double() for x in (q8, k8, v8))
    bsz, hq, sq, _ = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    bm, bn, rows = tiles.block_m, tiles.block_n, ir.FP8_DESCALE_BLOCK
    assert bm == rows and rows % bn == 0  # as the plan checks: one descale per tile
    causal = isinstance(spec.mask, ir.Causal)
    o = torch.zeros(bsz, hq, sq, dv, dtype=torch.float64)
    lse = torch.full((bsz, hq, sq), -math.inf, dtype=torch.float64)
    log2e = f32(torch.tensor(1.4426950408889634, dtype=torch.float64))
    for b in range(bsz):
        for h in range(hq):
            hk = h // (hq // hkv)
            for mb in range(-(-sq // bm)):
                r = torch.arange(mb * bm, min(mb * bm + bm, sq))
                scale = f32(torch.tensor(default_softmax_scale(spec)) * qd[b, h, mb])
                scale_log2 = f32(scale * log2e)
                last = (int(r[-1]) + sk - sq) if causal else sk - 1  # the last key any row keeps
                row_max = torch.full((len(r),), -math.inf, dtype=torch.float64)
                row_sum = torch.zeros(len(r), dtype=torch.float64)
                acc = torch.zeros(len(r), dv, dtype=torch.float64)
                vd_prev = torch.tensor(1.0, dtype=torch.float64)
                alpha = None
                p8 = vblk = None
                for nb in range(min(last, sk - 1) // bn, -1, -1):  # last to first
                    n = torch.arange(nb * bn, min(nb * bn + bn, sk))
                    blk_kd, blk_vd = kd[b, hk, nb * bn // rows], vd[b, hk, nb * bn // rows]
                    s = wgmma(q[b, h, r], k[b, hk, n], torch.zeros(len(r), len(n)), tensor_core)
                    if causal:
                        s = s.masked_fill(n[None, :] > r[:, None] + sk - sq, -math.inf)
                    # softmax(): k's descale in the block max and the FFMA, v's ratio in alpha
                    c_blk = f32(scale_log2 * blk_kd)
                    blk_vr = f32(vd_prev / blk_vd)
                    vd_prev = blk_vd
                    mx = torch.maximum(row_max, f32(s.amax(-1) * blk_kd))
                    base = torch.where(mx == -math.inf, 0.0, f32(mx * scale_log2))
                    alpha_new = f32(torch.exp2(f32(row_max * scale_log2) - base))
                    row_max = mx
                    p = f32(torch.exp2(f32(s * c_blk - base[:, None])))
                    row_sum = f32(row_sum * alpha_new + p.sum(-1))
                    if p8 is not None:  # issue_pv of the previous block, with its alpha
                        acc = wgmma(p8, vblk, f32(acc * alpha[:, None]), tensor_core)
                    alpha = f32(alpha_new * blk_vr)
                    p8, vblk = fp8.round_e4m3(p), v[b, hk, n].T
                if p8 is not None:
                    acc = wgmma(p8, vblk, f32(acc * alpha[:, None]), tensor_core)
                live = row_sum > 0
                inv = torch.where(live, vd_prev / torch.where(live, row_sum, 1.0), 0.0)
                o[b, h, r] = f32(acc * f32(inv)[:, None])
                lse[b, h, r] = torch.where(
                    live, row_max * scale + torch.log(torch.where(live, row_sum, 1.0)), -math.inf
                )
    return o, lse


def case(d, causal, sq, sk, recipe, *, hq=2, hkv=1, seed=None, per_block=True):
    """``(error, bound, max |logit|)`` of the tensor-core model and ``(error, bound)`` of the
    exact-product one on ``recipe``'s inputs (``per_block`` False: the same float inputs
    quantized per [B, Hkv], run as per-block descales that repeat it: the [B, Hkv] kernel's
    arithmetic)."""
    spec = as_fp8(d, causal)
    tiles = registry.plan_forward(spec, "sm_90", block_descale=True).tiles
    kw = dict(recipe, block_rows=128 if per_block else None)
    seed = sq + sk + 1 if seed is None else seed
    q8, k8, v8, ds, _ = quantized(spec, 1, hq, hkv, sq, sk, seed, device="cpu", **kw)
    ref_o, _, bound = fp8_error_bound(spec, q8, k8, v8, {}, ds)
    if not per_block:  # [B, Hkv] descales as the per-block form that repeats them
        rep = (ds[0].repeat_interleave(hq // hkv, 1)[..., None].expand(1, hq, -(-sq // 128)),
               ds[1][..., None].expand(1, hkv, -(-sk // 128)),
               ds[2][..., None].expand(1, hkv, -(-sk // 128)))  # fmt: skip
        ds = rep
    qf, kf = fp8.dequantize(q8, ds[0], torch.float64), fp8.dequantize(k8, ds[1], torch.float64)
    logit = (qf @ kf.repeat_interleave(hq // hkv, 1).transpose(-1, -2)).abs().max().item()
    logit *= default_softmax_scale(spec)
    out = []
    for tc in (True, False):
        o, _ = emulate_bd_kernel(spec, q8, k8, v8, ds, tiles, tensor_core=tc)
        out.append((o.to(torch.bfloat16).double() - ref_o).abs().max().item())
    return out[0], out[1], bound, logit


# A near tie at logits of 4e3 (seed 5: 16 heads of 128 rows, d256), where the H100 failed
# the per-block tests at 128 x 129: the tensor-core model is 10x past the bound with per-block
# descales and with the [B, Hkv] ones alike, the exact model within it.  Rows of one query or
# 17 keys passed on the H100 (few rows, few keys: no near tie) and pass here.
PASSED_ON_H100 = [(64, True, 1, 1), (128, False, 1000, 17), (256, True, 17, 1000),
                  (64, False, 128, 129)]  # fmt: skip


@pytest.mark.parametrize("causal", [False, True])
def test_old_inputs_huge_logits_break_the_tensor_core_qk_not_the_block_folding(causal):
    for per_block in (True, False):
        tc_err, exact_err, bound, logit = case(
            256, causal, 128, 129, OLD_BLOCKY, hq=16, hkv=2, seed=5, per_block=per_block
        )
        assert logit > 1000, logit
        assert exact_err <= bound, (per_block, exact_err, bound)  # the kernel's arithmetic
        assert tc_err > 5 * bound, (per_block, tc_err, bound)  # the tensor core at huge logits


@pytest.mark.parametrize("d, causal, sq, sk", PASSED_ON_H100)
def test_old_inputs_short_rows_stay_within_the_bound(d, causal, sq, sk):
    tc_err, exact_err, bound, _ = case(d, causal, sq, sk, OLD_BLOCKY)
    assert exact_err <= bound and tc_err <= bound, (tc_err, exact_err, bound)


@pytest.mark.parametrize(
    "d, causal, sq, sk",
    [(64, True, 1, 1), (64, False, 128, 129), (128, False, 128, 129), (128, True, 257, 300),
     (128, False, 1000, 17), (256, True, 128, 129), (256, False, 128, 129),
     (256, False, 257, 300), (256, True, 17, 1000)],
)  # fmt: skip
def test_gpu_block_descale_inputs_keep_the_tensor_core_within_the_bound(d, causal, sq, sk):
    """tests/gpu/test_fp8_gpu.py's per-block inputs (``fp8_inputs.BLOCKY``): descales 1000x
    apart within a head, logits below 100, and the kernel with the tensor core's
    accumulation within issue 24's bound, at the shapes the H100 failed (128 x 129, 257 x
    300) and others."""
    assert BLOCKY["block_rows"] == 128 and min(BLOCKY["spreads"]) >= 1.5
    for seed in (None, 5):
        tc_err, exact_err, bound, logit = case(d, causal, sq, sk, BLOCKY, hq=8, hkv=2, seed=seed)
        assert logit < 100, logit
        assert exact_err <= bound and tc_err <= bound, (tc_err, exact_err, bound)
