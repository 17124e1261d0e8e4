"""Big and odd sizes on the GPU (``pytest -m gpu``): 64-bit offsets, grid limits, extremes.

* seqlen > 65536 on either side, checked against a row-wise float64 reference;
* B * H > 65535 (the grid must not put B or H alone on gridDim.y/z);
* q/o and k/v with more than 2**31 elements (64-bit offsets), checked on the rows that sit
  past the 2**31 element boundary; a backward over tensors of more than 2**31 elements;
* seqlen 1; logits far beyond the fp16 range (fp32 accumulation must keep them finite).

The reference here is computed only for the rows checked, chunked over keys with an
online log-sum-exp in float64, so it never materializes [Sq, Sk].  Memory stays under
~20 GB.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from flashgen.frontend.spec import load_spec  # noqa: E402
from flashgen.ops.op import build_op, poison_outputs  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
DEV = "cuda"


def spec_of(name: str, causal: bool):
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    if causal:
        return spec
    return dataclasses.replace(spec, name=f"{spec.name}_big_nomask", mask=None)


def rows_reference(q, k, v, rows, scale, causal, chunk=1 << 20):
    """float64 o, lse for query rows ``rows`` of (q [B,Hq,Sq,D], k, v [B,Hkv,Sk,*]).

    Plain softmax attention (no score_mod), optional bottom-right causal mask; keys are
    processed ``chunk`` at a time with an online log-sum-exp.
    """
    B, Hq, Sq, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    rows = torch.as_tensor(rows, device=q.device)
    qr = q[:, :, rows].double()  # [B, Hq, R, D]
    m = torch.full(qr.shape[:3], -math.inf, dtype=torch.float64, device=q.device)
    s_sum = torch.zeros_like(m)
    acc = torch.zeros(*qr.shape[:3], v.shape[3], dtype=torch.float64, device=q.device)
    for j0 in range(0, Sk, chunk):
        j1 = min(Sk, j0 + chunk)
        kc = k[:, :, j0:j1].double().repeat_interleave(g, dim=1)
        vc = v[:, :, j0:j1].double().repeat_interleave(g, dim=1)
        s = torch.matmul(qr, kc.transpose(-1, -2)) * scale  # [B, Hq, R, c]
        if causal:
            kv = torch.arange(j0, j1, device=q.device)
            keep = kv[None, :] <= rows[:, None] + Sk - Sq
            s = s.masked_fill(~keep, -math.inf)
        m_new = torch.maximum(m, s.amax(-1))
        base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - base[..., None])
        alpha = torch.exp(m - base)
        s_sum = s_sum * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.matmul(p, vc)
        m = m_new
        del kc, vc, s, p
    empty = s_sum == 0
    o = torch.where(
        empty[..., None], torch.zeros_like(acc), acc / s_sum.clamp_min(1e-300)[..., None]
    )
    lse = torch.where(empty, torch.full_like(m, -math.inf), m + torch.log(s_sum))
    return o, lse


def check_rows(spec, q, k, v, o, lse, rows, causal, atol=2e-2, lse_rtol=1e-3):
    scale = 1.0 / math.sqrt(spec.head_dim)
    ref_o, ref_lse = rows_reference(q, k, v, rows, scale, causal)
    got_o = o[:, :, rows].double()
    got_lse = lse[:, :, rows].double()
    assert torch.isfinite(got_o).all(), "non-finite output"
    err = (got_o - ref_o).abs().max().item()
    assert err <= atol, f"max |o - ref| = {err:.3e} on rows {rows[:4]}..."
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(got_lse), empty)
    fin = ~empty
    lse_err = ((got_lse[fin] - ref_lse[fin]).abs() / (1 + ref_lse[fin].abs())).max().item()
    assert lse_err <= lse_rtol, f"lse off by {lse_err:.3e}"


def randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, device=DEV, generator=g) * scale).to(dtype)


@pytest.mark.parametrize(
    "name, causal, b, hq, hkv, sq, sk",
    [
        ("gpt2_d64", False, 1, 2, 1, 70000, 100),
        ("gpt2_d64", True, 1, 2, 1, 70000, 100),
        ("causal_d128", False, 1, 2, 2, 1, 70000),
        ("causal_d128", True, 1, 2, 1, 3, 70000),
        ("causal_d128", True, 1, 1, 1, 70000, 70000),
    ],
)
def test_seqlen_above_65536(name, causal, b, hq, hkv, sq, sk):
    spec = spec_of(name, causal)
    op = build_op(spec)
    dt = torch.float16 if spec.dtype == "fp16" else torch.bfloat16
    q = randn(b, hq, sq, spec.head_dim, dtype=dt, seed=1)
    k = randn(b, hkv, sk, spec.head_dim, dtype=dt, seed=2)
    v = randn(b, hkv, sk, spec.head_dim_v, dtype=dt, seed=3)
    with poison_outputs():
        o, lse = op.attention(q, k, v)
    torch.cuda.synchronize()
    assert not o.isnan().any() and not lse.isnan().any(), "an output element was not written"
    rows = sorted(r for r in {0, 1, sq // 2, 65535 % sq, 65536 % sq, sq - 2, sq - 1} if 0 <= r < sq)
    check_rows(spec, q, k, v, o, lse, rows, causal)


@pytest.mark.parametrize("b, hq, hkv, s", [(70000, 1, 1, 16), (1, 70000, 1, 5), (35000, 2, 1, 1)])
def test_batch_times_heads_above_65535(b, hq, hkv, s):
    spec = spec_of("gpt2_d64", True)
    op = build_op(spec)
    q = randn(b, hq, s, 64, dtype=torch.float16, seed=4)
    k = randn(b, hkv, s, 64, dtype=torch.float16, seed=5)
    v = randn(b, hkv, s, 64, dtype=torch.float16, seed=6)
    with poison_outputs():
        o, lse = op.attention(q, k, v)
    torch.cuda.synchronize()
    assert not o.isnan().any() and not lse.isnan().any(), "an output element was not written"
    # every (b, h) against the materialized reference, in chunks over batch
    from flashgen.ops.cpu.reference import attention_reference

    for b0 in range(0, b, 8192):
        sl = slice(b0, b0 + 8192)
        ref_o, ref_lse = attention_reference(spec, q[sl], k[sl], v[sl])
        assert (o[sl].double() - ref_o).abs().max().item() <= 2e-2
        assert torch.equal(torch.isneginf(lse[sl]), torch.isneginf(ref_lse))


@pytest.mark.device_memory(16)
def test_q_and_o_with_more_than_2_31_elements():
    """q/o [1, 1, 2**24 + 300, 128]: rows past element 2**31 need 64-bit offsets."""
    spec = spec_of("causal_d128", False)
    op = build_op(spec)
    sq, sk = (1 << 24) + 300, 48
    q = randn(1, 1, sq, 128, dtype=torch.bfloat16, seed=7)
    k = randn(1, 1, sk, 128, dtype=torch.bfloat16, seed=8)
    v = randn(1, 1, sk, 128, dtype=torch.bfloat16, seed=9)
    assert q.numel() > 2**31
    o, lse = op.attention(q, k, v)
    torch.cuda.synchronize()
    boundary = 2**31 // 128
    rows = [0, boundary - 1, boundary, boundary + 1, sq - 129, sq - 1]
    check_rows(spec, q, k, v, o, lse, rows, causal=False)
    del q, o


@pytest.mark.device_memory(16)
def test_k_and_v_with_more_than_2_31_elements():
    """k/v [1, 1, 2**24 + 300, 128]: key rows past element 2**31 need 64-bit offsets."""
    spec = spec_of("causal_d128", True)
    op = build_op(spec)
    sq, sk = 40, (1 << 24) + 300
    q = randn(1, 2, sq, 128, dtype=torch.bfloat16, seed=10)
    k = randn(1, 1, sk, 128, dtype=torch.bfloat16, seed=11)
    v = randn(1, 1, sk, 128, dtype=torch.bfloat16, seed=12)
    assert k.numel() > 2**31
    # make the last keys dominate so an offset bug (reading wrapped rows) cannot hide
    k[:, :, -64:] *= 4
    o, lse = op.attention(q, k, v)
    torch.cuda.synchronize()
    # atol: with 2**24 keys and 64 dominant ones processed first, fp32 tensor-core
    # accumulation of the 2**24 small terms costs ~3e-2 absolute on outputs of magnitude ~1
    # (measured on the H200: 6e-3 at 2**20 keys, 1e-2 at 2**23, 3e-2 at 2**24 + 300; without
    # the boost the error is 3e-5 at every size, so no offset bug).  Reading wrapped rows
    # would replace the dominant keys and give O(1) errors.  The same fp32 row sum sets lse's
    # error: 1.9e-3 relative on the Hopper kernel (2**24 small terms added to a sum the 64
    # boosted keys dominate), so 1e-2 here; an offset bug moves lse by O(1).
    check_rows(spec, q, k, v, o, lse, list(range(sq)), causal=True, atol=6e-2, lse_rtol=1e-2)


def _sdpa_grads(q, k, v, dout, dtype, causal):
    """dq, dk, dv of PyTorch's math SDPA in ``dtype`` (float64: the reference; bf16: the
    low-precision error the 2x rule compares against)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    o.backward(dout.to(dtype))
    return q.grad, k.grad, v.grad


@pytest.mark.device_memory(50)
@pytest.mark.parametrize("deterministic", [True, False])
def test_backward_with_more_than_2_31_elements(deterministic):
    """Backward of q/k/v/o/dO [1, 65540, 256, 128] (> 2**31 elements each, B*H > 65535 too):
    the gradients of the heads on both sides of element 2**31 match a float64 reference of
    those heads alone (an int32 offset would read or write wrapped rows).  Both backward
    paths: the deterministic kernels and deterministic=False (the Hopper wgmma backward on
    sm_90).  ~45 GB of device memory."""
    spec = spec_of("causal_d128", True)
    op = build_op(spec)
    h, s, d = 2**31 // (256 * 128) + 4, 256, 128
    q, k, v = (randn(1, h, s, d, dtype=torch.bfloat16, seed=20 + i) for i in range(3))
    assert q.numel() > 2**31
    dout = randn(1, h, s, d, dtype=torch.bfloat16, seed=23)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, _ = op.attention(q, k, v, deterministic=deterministic)
    o.backward(dout)
    torch.cuda.synchronize()
    boundary = 2**31 // (s * d)  # the first head past element 2**31
    heads = [0, boundary - 1, boundary, h - 1]
    sl = (slice(None), heads)
    ours = (q.grad[sl], k.grad[sl], v.grad[sl])
    ref = _sdpa_grads(q[sl], k[sl], v[sl], dout[sl], torch.float64, causal=True)
    low = _sdpa_grads(q[sl], k[sl], v[sl], dout[sl], torch.bfloat16, causal=True)
    for name, g, r, lo in zip(("dq", "dk", "dv"), ours, ref, low, strict=True):
        assert torch.isfinite(g).all(), f"non-finite {name}"
        err = (g.double() - r).abs().max().item()
        low_err = (lo.double() - r).abs().max().item()
        assert err <= 2 * low_err + 1e-3, f"{name}: max err {err:.3e} vs math bf16 {low_err:.3e}"
    del q, k, v, o, dout


@pytest.mark.parametrize("sq, sk", [(1, 1), (1, 2), (2, 1), (1, 300)])
@pytest.mark.parametrize("causal", [True, False])
def test_seqlen_one(sq, sk, causal):
    spec = spec_of("llama3_gqa", causal)
    op = build_op(spec)
    q = randn(3, 8, sq, 128, dtype=torch.bfloat16, seed=13)
    k = randn(3, 2, sk, 128, dtype=torch.bfloat16, seed=14)
    v = randn(3, 2, sk, 128, dtype=torch.bfloat16, seed=15)
    with poison_outputs():
        o, lse = op.attention(q, k, v)
    torch.cuda.synchronize()
    assert not o.isnan().any() and not lse.isnan().any()
    check_rows(spec, q, k, v, o, lse, list(range(sq)), causal)


@pytest.mark.parametrize(
    "name, scale", [("gpt2_d64", 300.0), ("causal_d128", 1e4), ("gemma2_softcap", 1e4)]
)
def test_extreme_logits_stay_finite_and_correct(name, scale):
    """|q.k| far beyond fp16's 65504: fp32 accumulation keeps o finite and right."""
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    op = build_op(spec)
    dt = torch.float16 if spec.dtype == "fp16" else torch.bfloat16
    d = spec.head_dim
    q = randn(1, 2, 160, d, dtype=dt, seed=16, scale=scale)
    k = randn(1, 2, 160, d, dtype=dt, seed=17, scale=scale)
    v = randn(1, 2, 160, spec.head_dim_v, dtype=dt, seed=18)
    assert (q.double() @ k.double().transpose(-1, -2)).abs().max() > 65504
    o, lse = op.attention(q, k, v)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all(), "extreme logits produced inf/nan"
    assert not lse.isnan().any()
    from flashgen.ops.cpu.reference import attention_reference

    ref_o, ref_lse = attention_reference(spec, q, k, v)  # float64
    assert (o.double() - ref_o).abs().max().item() <= 2e-2
    fin = torch.isfinite(ref_lse)
    rel = (lse.double()[fin] - ref_lse.double()[fin]).abs() / (1 + ref_lse.double()[fin].abs())
    assert rel.max().item() <= 1e-4
