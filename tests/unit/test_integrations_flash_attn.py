"""flashgen.flash_attn against FlashAttention's documented semantics, implemented here
independently in float64 (after ``attention_ref`` of flash-attention's test_flash_attn.py)."""

from __future__ import annotations

import math

import pytest
import torch

from flashgen import OpInputError
from flashgen.flash_attn import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func


def ref_fa(q, k, v, causal=False, window=(-1, -1), softcap=0.0, slopes=None, scale=None):
    """FlashAttention 2 semantics in float64: q (B, Sq, H, D), k/v (B, Sk, Hkv, D)."""
    q, k, v = (t.double() for t in (q, k, v))
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(h // hkv, dim=2)
    v = v.repeat_interleave(h // hkv, dim=2)
    scale = 1 / math.sqrt(d) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q * scale, k)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq).view(-1, 1)
    j = torch.arange(sk).view(1, -1)
    diag = i + sk - sq
    left, right = window
    if causal:
        right = 0
    drop = torch.zeros(sq, sk, dtype=torch.bool)
    if left >= 0:
        drop |= j < diag - left
    if right >= 0:
        drop |= j > diag + right
    if slopes is not None:
        sl = slopes.double().reshape(-1, h) if slopes.dim() == 2 else slopes.double().view(1, h)
        s = s - sl.view(-1, h, 1, 1) * (diag - j).abs().double()
    s = s.masked_fill(drop, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no key: 0, as FlashAttention
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def rnd(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


CASES = [
    dict(),
    dict(causal=True),
    dict(window=(3, 2)),
    dict(window=(4, -1)),
    dict(window=(-1, 1)),
    dict(causal=True, window=(5, -1)),
    dict(causal=True, window=(5, 3)),  # causal pins right to 0
    dict(softcap=2.5),
    dict(causal=True, softcap=1.0),
    dict(alibi=(4,)),
    dict(causal=True, alibi=(2, 4)),
    dict(window=(6, 6), softcap=3.0, alibi=(4,)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("sq, sk", [(11, 11), (7, 19), (19, 7)])
def test_flash_attn_func_matches_reference(case, sq, sk):
    q, k, v = rnd(2, sq, 4, 32, seed=1), rnd(2, sk, 2, 32, seed=2), rnd(2, sk, 2, 32, seed=3)
    slopes = rnd(*case["alibi"], seed=4).abs() if "alibi" in case else None
    kw = dict(causal=case.get("causal", False), window_size=case.get("window", (-1, -1)),
              softcap=case.get("softcap", 0.0), alibi_slopes=slopes)  # fmt: skip
    o = flash_attn_func(q, k, v, **kw)
    assert o.shape == (2, sq, 4, 32) and o.dtype == q.dtype
    ref = ref_fa(q, k, v, kw["causal"], kw["window_size"], kw["softcap"], slopes)
    torch.testing.assert_close(o.double(), ref, rtol=1e-5, atol=1e-5)


def test_bf16_scale_gradients_and_qkvpacked():
    q, k, v = (rnd(1, 13, 2, 64, seed=s).requires_grad_(True) for s in (5, 6, 7))
    o = flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, window_size=(4, 0))
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = ref_fa(qd, kd, vd, True, (4, 0), scale=0.3)
    torch.testing.assert_close(o.double(), ref, rtol=1e-5, atol=1e-5)
    g = rnd(*o.shape, seed=8)
    o.backward(g)
    ref.backward(g.double())
    for a, b in ((q, qd), (k, kd), (v, vd)):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-4)
    qb, kb, vb = (t.detach().bfloat16() for t in (q, k, v))
    ob = flash_attn_func(qb, kb, vb, causal=True)
    assert ob.dtype == torch.bfloat16
    err = (ob.double() - ref_fa(qb, kb, vb, True)).abs().max()
    assert err < 2e-2
    qkv = torch.stack([qb, kb, vb], dim=2)
    torch.testing.assert_close(flash_attn_qkvpacked_func(qkv, causal=True), ob)


@pytest.mark.parametrize("shape", [(4,), (2, 4)], ids=["per_head", "per_batch_head"])
def test_alibi_slopes_gradient_matches_the_float64_reference(shape):
    """Trainable ``alibi_slopes`` (FlashAttention's (H,) and (B, H) forms), GQA, Sq != Sk."""
    q, k, v = rnd(2, 7, 4, 32, seed=1), rnd(2, 19, 2, 32, seed=2), rnd(2, 19, 2, 32, seed=3)
    slopes = rnd(*shape, seed=4).abs().requires_grad_(True)
    o = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    g = rnd(*o.shape, seed=5)
    o.backward(g)
    sd = slopes.detach().double().requires_grad_(True)
    ref = ref_fa(q.double(), k.double(), v.double(), True, slopes=sd)
    ref.backward(g.double())
    assert slopes.grad.shape == slopes.shape and slopes.grad.abs().max() > 0
    torch.testing.assert_close(slopes.grad.double(), sd.grad, rtol=1e-4, atol=1e-4)


def test_varlen_with_empty_sequences_gqa_and_window():
    lens_q = [5, 0, 3, 8, 1]
    lens_k = [5, 4, 0, 11, 1]
    cq = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    ck = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = rnd(sum(lens_q), 4, 32, seed=9), rnd(sum(lens_k), 2, 32, seed=10), rnd(
        sum(lens_k), 2, 32, seed=11)  # fmt: skip
    slopes = rnd(5, 4, seed=12).abs()
    for kw in (dict(causal=True), dict(window_size=(2, 1), softcap=2.0, alibi_slopes=slopes)):
        o = flash_attn_varlen_func(q, k, v, cq, ck, max(lens_q), max(lens_k), **kw)
        assert o.shape == (sum(lens_q), 4, 32)
        for i in range(5):
            q0, q1, k0, k1 = int(cq[i]), int(cq[i + 1]), int(ck[i]), int(ck[i + 1])
            if q1 == q0:
                continue
            if k1 == k0:
                assert (o[q0:q1] == 0).all()
                continue
            sl = kw.get("alibi_slopes")
            ref = ref_fa(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], kw.get("causal", False),
                         kw.get("window_size", (-1, -1)), kw.get("softcap", 0.0),
                         None if sl is None else sl[i])  # fmt: skip
            torch.testing.assert_close(o[q0:q1].double(), ref[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(dropout_p=0.1), r"dropout_p: flashgen has no attention dropout"),
        (dict(return_attn_probs=True), r"return_attn_probs"),
        (dict(window_size=(1,)), r"window_size: expected a pair"),
        (dict(window_size=(-2, 0)), r"window_size: expected left"),
        (dict(softcap=-1.0), r"softcap: expected None or a finite number >= 0"),
        (dict(alibi_slopes=torch.ones(3)), r"alibi_slopes: expected shape \(4,\)"),
        (dict(causal=1), r"causal: expected a bool"),
    ],
)
def test_clear_errors(kw, match):
    q, k, v = rnd(1, 5, 4, 32), rnd(1, 5, 4, 32), rnd(1, 5, 4, 32)
    with pytest.raises(OpInputError, match=match):
        flash_attn_func(q, k, v, **kw)


def test_unsupported_head_dim_and_dtype():
    with pytest.raises(OpInputError, match=r"q: expected head_dim .* got 40"):
        flash_attn_func(rnd(1, 5, 2, 40), rnd(1, 5, 2, 40), rnd(1, 5, 2, 40))
    with pytest.raises(OpInputError, match=r"q: expected dtype torch.float16 or"):
        t = rnd(1, 5, 2, 32, dtype=torch.float64)
        flash_attn_func(t, t, t)
    with pytest.raises(OpInputError, match=r"block_table"):
        cu = torch.tensor([0, 5], dtype=torch.int32)
        t = rnd(5, 2, 32)
        flash_attn_varlen_func(t, t, t, cu, cu, 5, 5, block_table=torch.zeros(1, 1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_attn_on_cuda_matches_reference():
    q, k, v = (rnd(2, 200, 8, 128, dtype=torch.bfloat16, seed=s).cuda() for s in (1, 2, 3))
    k, v = k[:, :, :2], v[:, :, :2]
    slopes = rnd(8, seed=4).abs().cuda()
    for kw in (dict(causal=True), dict(window_size=(33, 7), softcap=20.0, alibi_slopes=slopes)):
        o = flash_attn_func(q, k, v, **kw)
        ref = ref_fa(q.cpu(), k.cpu(), v.cpu(), kw.get("causal", False),
                     kw.get("window_size", (-1, -1)), kw.get("softcap", 0.0),
                     None if "alibi_slopes" not in kw else slopes.cpu())  # fmt: skip
        assert (o.double().cpu() - ref).abs().max() < 2e-2


def test_the_integrations_internal_specs_raise_no_spec_warning():
    """The specs flashgen builds for a call (flashgen/integrations/_specs.py) declare the
    bounds that silence their own warnings: a user never sees a SpecWarning about a spec
    they did not write."""
    import itertools
    import warnings

    from flashgen.frontend.errors import SpecWarning
    from flashgen.frontend.spec import loads_spec
    from flashgen.integrations._specs import SpecKey

    for causal, wl, wr, cap, alibi in itertools.product(
        ("none", "bottom_right", "top_left"), *[(False, True)] * 4
    ):
        key = SpecKey(64, 64, "bf16", causal, wl, wr, cap, alibi)
        with warnings.catch_warnings():
            warnings.simplefilter("error", SpecWarning)
            loads_spec(key.text(), f"{key.name}.yaml")
