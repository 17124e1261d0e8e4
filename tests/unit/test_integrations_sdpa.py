"""flashgen as SDPA's flash backend (torch.nn.attention's registry): registration and the
kernels' dispatch logic on CPU; the end-to-end run through F.scaled_dot_product_attention
needs a CUDA device (marked gpu)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention as tna
import torch.nn.functional as F

from flashgen.integrations import sdpa as fg_sdpa

HAS_REGISTRY = hasattr(tna, "register_flash_attention_impl")


def rnd(*shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def math_sdpa(q, k, v, is_causal, scale):
    return F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=is_causal, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # fmt: skip


@pytest.mark.skipif(not HAS_REGISTRY, reason="torch without the flash attention registry")
def test_register_lists_flashgen():
    fg_sdpa.register()
    assert "flashgen" in tna.list_flash_attention_impls()


def test_register_says_when_torch_lacks_the_registry(monkeypatch):
    monkeypatch.delattr(tna, "register_flash_attention_impl", raising=False)
    with pytest.raises(RuntimeError, match="has no torch.nn.attention.register_flash_attention"):
        fg_sdpa.register()


@pytest.mark.parametrize("is_causal, sq, sk, hkv, scale", [
    (False, 17, 17, 4, None), (True, 17, 17, 2, None), (True, 9, 21, 1, 0.2),
    (True, 21, 9, 4, None),
])  # fmt: skip
def test_forward_and_backward_kernels_match_sdpa_math(is_causal, sq, sk, hkv, scale):
    q, k, v = rnd(2, 4, sq, 64, seed=1), rnd(2, hkv, sk, 64, seed=2), rnd(2, hkv, sk, 64, seed=3)
    outs = fg_sdpa.sdpa_flash_forward(q, k, v, 0.0, is_causal, scale=scale, require_cuda=False)
    assert len(outs) == 9
    o, lse = outs[0], outs[1]
    assert o.shape == (2, 4, sq, 64) and lse.shape == (2, 4, sq) and lse.dtype == torch.float32
    qd, kd, vd = (t.double().requires_grad_(True) for t in (q, k, v))
    ref = math_sdpa(qd, kd, vd, is_causal, scale)
    ok = torch.isfinite(lse)  # top-left causal with Sq > Sk: SDPA's math gives NaN rows there
    torch.testing.assert_close(o.double()[ok], ref[ok], rtol=0, atol=2e-2)
    dout = rnd(2, 4, sq, 64, seed=4)
    dq, dk, dv = fg_sdpa.sdpa_flash_backward(
        dout, q, k, v, o, lse, None, None, sq, sk, 0.0, is_causal, None, None, scale=scale,
        require_cuda=False,
    )  # fmt: skip
    if not ok.all():
        return
    ref.backward(dout.double())
    for a, b in ((dq, qd), (dk, kd), (dv, vd)):
        assert a.shape == b.shape and a.dtype == torch.bfloat16
        torch.testing.assert_close(a.double(), b.grad, rtol=0, atol=5e-2)


@pytest.mark.parametrize("change, reason", [
    (dict(dropout_p=0.1), "dropout_p"),
    (dict(dtype=torch.float32), "dtype"),
    (dict(d=80), "head dims"),
    (dict(debug=True), "return_debug_mask"),
    (dict(cuda=True), "CUDA device"),
])  # fmt: skip
def test_calls_flashgen_cannot_serve_fall_back(change, reason):
    d = change.get("d", 64)
    dt = change.get("dtype", torch.bfloat16)
    q, k, v = (rnd(1, 2, 5, d, dtype=dt, seed=s) for s in (1, 2, 3))
    seen = []

    def fallback(*args, **kw):
        seen.append((args, kw))
        return "torch's kernel"

    got = fg_sdpa.sdpa_flash_forward(
        q, k, v, change.get("dropout_p", 0.0), True, change.get("debug", False), scale=0.5,
        fallback=fallback, require_cuda=change.get("cuda", False),
    )  # fmt: skip
    assert got == "torch's kernel" and seen[0][1] == {"scale": 0.5}
    assert reason in fg_sdpa.unsupported_reason(
        q, k, v, change.get("dropout_p", 0.0), change.get("debug", False),
        require_cuda=change.get("cuda", False),
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="cannot serve this call"):
        fg_sdpa.sdpa_flash_forward(
            q, k, v, change.get("dropout_p", 0.0), True, change.get("debug", False),
            require_cuda=change.get("cuda", False),
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not HAS_REGISTRY, reason="torch without the flash attention registry")
def test_sdpa_flash_backend_runs_flashgen_end_to_end(monkeypatch):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    calls = []
    real = fg_sdpa.sdpa_flash_forward

    def counting(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)

    monkeypatch.setattr(fg_sdpa, "sdpa_flash_forward", counting)
    fg_sdpa.register()
    tna.activate_flash_attention_impl("flashgen")
    try:
        dev = "cuda"
        q, k, v = (rnd(2, 8, 300, 128, seed=s).to(dev).requires_grad_(True) for s in (1, 2, 3))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.backward(torch.ones_like(o))
        assert calls, "SDPA did not reach flashgen's kernel"
        qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
        ref = math_sdpa(qd, kd, vd, True, None)
        ref.backward(torch.ones_like(ref))
        assert (o.double() - ref).abs().max() < 2e-2
        for a, b in ((q, qd), (k, kd), (v, vd)):
            assert (a.grad.double() - b.grad).abs().max() < 5e-2
        # dropout: torch's own kernel, not an error
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    finally:
        tna.restore_flash_attention_impl()
