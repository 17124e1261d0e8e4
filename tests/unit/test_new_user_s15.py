"""A new user's and an attacker's inputs to the FP8 forward, the FP8 KV cache, out= and
family_for (session 15): each once silently wrong, a crash from inside flashgen or an error
naming the wrong thing; now an OpInputError (or the documented error) naming the argument.
CPU only, no nvcc."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import flashgen
from flashgen.fp8 import dequantize, hadamard_matrix, quantize
from flashgen.frontend.errors import OpInputError

ROOT = Path(__file__).resolve().parents[2]
E4M3 = torch.float8_e4m3fn
F32_MIN_NORMAL = 2.0**-126


def _op(name):
    return flashgen.load(ROOT / "specs" / f"{name}.yaml")


def _ones(*shape):
    return torch.ones(*shape)


# ----------------------------------------------------------------------------- quantize
@pytest.mark.parametrize("amax", [1e-36, 1e-37, 1e-39])
def test_quantize_tiny_values_stay_finite_and_exact_enough(amax):
    """448 / amax overflowed to inf below amax ~5.3e-36: zeros became NaN (0 * inf) and every
    non-zero entry 448."""
    q = torch.zeros(1, 1, 1, 64)
    q[0, 0, 0, :3] = torch.tensor([amax, amax / 2, -amax / 4])
    q8, _, _, qd, _, _ = quantize(q, _ones(1, 1, 1, 64), _ones(1, 1, 1, 64))
    assert not q8.float().isnan().any()
    assert float(qd) >= F32_MIN_NORMAL
    back = dequantize(q8, qd).double()
    assert torch.allclose(back, q.double(), rtol=0.07, atol=0.0)
    assert float(back[0, 0, 0, 3:].abs().max()) == 0.0


def test_quantize_normal_values_unchanged():
    """The clamp leaves ordinary slices as before: amax maps onto 448 exactly."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 8, 64), torch.randn(2, 2, 8, 64), torch.randn(2, 2, 8, 64)
    q8, _, _, qd, _, _ = quantize(q, k, v)
    assert float(q8.float().abs().amax()) == 448.0
    assert torch.allclose(qd, q.abs().amax(dim=(2, 3)).view(2, 2, 2).amax(2) / 448)


def test_quantize_generator_not_a_generator():
    z, zk = torch.zeros(1, 2, 4, 64), torch.zeros(1, 1, 4, 64)
    with pytest.raises(OpInputError, match=r"generator: expected None or a torch.Generator"):
        quantize(z, zk, zk, hadamard=True, generator=0)


def test_quantize_hadamard_zero_head_dim_names_q():
    z = torch.zeros(1, 1, 4, 0)
    with pytest.raises(OpInputError, match=r"^q: hadamard=True needs a power-of-two head_dim"):
        quantize(z, z, z, hadamard=True)


def test_hadamard_matrix_float_size():
    with pytest.raises(OpInputError, match=r"hadamard: expected a power-of-two int size"):
        hadamard_matrix(2.0)


@pytest.mark.parametrize(
    "descale, match",
    [
        (0.5, r"descale: expected a float32 tensor"),
        (torch.ones(2), r"descale: expected shape \[batch, heads_kv\]"),
        (torch.ones(2, 3), r"descale: expected shape \[batch, heads_kv\]"),
        (torch.ones(3, 2), r"descale: expected shape \[batch, heads_kv\]"),
        (torch.ones(2, 2, dtype=torch.int32), r"descale: expected a float32 tensor on cpu"),
    ],
)
def test_dequantize_bad_descale(descale, match):
    with pytest.raises(OpInputError, match=match):
        dequantize(torch.zeros(2, 4, 8, 64), descale)


# ----------------------------------------------------------------------------- op.attention
def test_fp8_attention_subnormal_descale_tensor_refused_like_a_float():
    """A Python float descale below the smallest normal float32 was refused, the same value
    in a tensor accepted (and flushed to zero by the GPU kernel's arithmetic)."""
    op = _op("llama3_fp8")
    q8, k8, v8, qd, kd, vd = quantize(*(torch.randn(1, 2, 4, 128) for _ in range(3)))
    with pytest.raises(OpInputError, match=r"k_descale: expected finite positive descales"):
        op.attention(q8, k8, v8, q_descale=qd, k_descale=torch.full((1, 2), 1e-40),
                     v_descale=vd)  # fmt: skip


def test_fp8_attention_matches_float64_on_dequantized_inputs():
    """An independent float64 computation on inputs dequantized here (GQA, Sq != Sk, causal
    bottom-right, arbitrary descales)."""
    op = _op("llama3_fp8")
    torch.manual_seed(3)
    b, hq, hkv, sq, sk, d = 2, 6, 3, 5, 19, 128
    q8, k8, v8, _, _, _ = quantize(torch.randn(b, hq, sq, d), torch.randn(b, hkv, sk, d),
                                   torch.randn(b, hkv, sk, d))  # fmt: skip
    qd, kd, vd = (torch.rand(b, hkv) * 0.01 + 0.001 for _ in range(3))
    o, lse = op.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    g = hq // hkv
    qf = q8.double() * qd.double().repeat_interleave(g, 1)[:, :, None, None]
    kf = (k8.double() * kd.double()[:, :, None, None]).repeat_interleave(g, 1)
    vf = (v8.double() * vd.double()[:, :, None, None]).repeat_interleave(g, 1)
    s = qf @ kf.transpose(-1, -2) / math.sqrt(d)
    keep = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
    s = s.masked_fill(~keep, float("-inf"))
    ref_lse = torch.logsumexp(s, -1)
    ref = torch.softmax(s, -1) @ vf
    assert o.dtype == torch.bfloat16
    assert torch.allclose(o.double(), ref, atol=2e-2, rtol=1e-2)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


def test_mixed_input_dtypes_name_qs_dtype():
    """q float32 (CPU), k e4m3: the error said 'expected float8_e4m3fn, got float8_e4m3fn'."""
    op = _op("llama3_fp8")
    q8, k8, v8, *_ = quantize(*(torch.randn(1, 2, 4, 128) for _ in range(3)))
    with pytest.raises(OpInputError, match=r"^k: expected dtype torch.float32 \(q's dtype"):
        op.attention(q8.float(), k8, v8)


# ----------------------------------------------------------------------------- out=
def _bf16_inputs(b=2, h=4, s=8, d=128):
    torch.manual_seed(0)
    return [torch.randn(b, h, s, d, dtype=torch.bfloat16) for _ in range(3)]


def test_out_with_overlapping_elements_refused():
    """An as_strided out whose rows share addresses passed (stride 0 only was caught): the
    kernels would race on the shared elements."""
    op = _op("causal_d128")
    q, k, v = _bf16_inputs()
    buf = torch.empty(2 * 4 * 8 * 128, dtype=torch.bfloat16)
    out = buf.as_strided((2, 4, 8, 128), (4 * 8 + 128, 8 + 128, 1, 1))
    with pytest.raises(OpInputError, match=r"out: expected every element at its own address"):
        op.attention(q, k, v, out=out)


def test_out_ordinary_layouts_still_accepted():
    op = _op("causal_d128")
    q, k, v = _bf16_inputs()
    ref, _ = op.attention(q, k, v)
    for out in (torch.empty(2, 4, 8, 128, dtype=torch.bfloat16),
                torch.empty(2, 8, 4, 128, dtype=torch.bfloat16).transpose(1, 2),
                torch.empty(2, 4, 8, 256, dtype=torch.bfloat16)[..., 64:192],
                torch.empty(1, 4, 8, 128, dtype=torch.bfloat16).expand(1, 4, 8, 128)):  # fmt: skip
        qq, kk, vv = (t[: out.shape[0]] for t in (q, k, v))
        o, _ = op.attention(qq, kk, vv, out=out)
        assert o is out
        assert torch.equal(out, ref[: out.shape[0]])


def test_out_negated_view_refused():
    """A lazily negated view crashed inside torch (INTERNAL ASSERT in MathBitsFallback)."""
    op = _op("causal_d128")
    q, k, v = _bf16_inputs()
    out = torch.empty(2, 4, 8, 128, dtype=torch.bfloat16)._neg_view()
    with pytest.raises(OpInputError, match=r"out: expected a tensor whose memory holds"):
        op.attention(q, k, v, out=out)


# ----------------------------------------------------------------------------- with_kvcache
def _kv8_call(b=2, hq=4, hkv=2, d=128, cap=32):
    torch.manual_seed(0)
    q = torch.randn(b, hq, 1, d, dtype=torch.bfloat16)
    kc = (torch.randn(b, hkv, cap, d) * 40).to(E4M3)
    vc = (torch.randn(b, hkv, cap, d) * 40).to(E4M3)
    lens = torch.tensor([10, 32], dtype=torch.int32)
    return q, kc, vc, lens


@pytest.mark.parametrize("kd", [1e39, 1e-50])
def test_kvcache_float_descale_outside_float32(kd):
    """1e39 crashed in torch.full (overflow); 1e-50 was reported as '0.0 at [0, 0]'."""
    op = _op("causal_d128")
    q, kc, vc, lens = _kv8_call()
    with pytest.raises(OpInputError, match=r"k_descale: expected a finite descale > 0, got"):
        op.with_kvcache(q, kc, vc, lens, k_descale=kd, v_descale=0.01)


def test_kvcache_folded_q_k_descale_overflow():
    """An e4m3 q's q_descale folds into k's: 1e20 * 1e20 overflowed float32 inside torch."""
    op = _op("causal_d128")
    q, kc, vc, lens = _kv8_call()
    with pytest.raises(OpInputError, match=r"q_descale, k_descale: their product"):
        op.with_kvcache(q.to(E4M3), kc, vc, lens, q_descale=1e20, k_descale=1e20)
    with pytest.raises(OpInputError, match=r"q_descale \* k_descale: expected finite .* got inf"):
        op.with_kvcache(q.to(E4M3), kc, vc, lens, q_descale=torch.tensor(1e30),
                        k_descale=torch.tensor(1e30))  # fmt: skip


def test_kvcache_out_overlapping_an_input_refused():
    op = _op("causal_d128")
    q, kc, vc, lens = _kv8_call()
    lse = torch.empty(2, 4, 1)
    with pytest.raises(OpInputError, match=r"out\[0\]: expected memory that no input shares, "
                                           r"got a tensor overlapping q"):  # fmt: skip
        op.with_kvcache(q, kc, vc, lens, k_descale=0.01, v_descale=0.01, out=(q, lse))
    o = torch.empty(2, 4, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(OpInputError, match=r"out\[1\]: expected memory apart from out\[0\]"):
        op.with_kvcache(q, kc, vc, lens, k_descale=0.01, v_descale=0.01,
                        out=(o, o.view(-1).view(torch.float32)[:8].view(2, 4, 1)))  # fmt: skip
    with pytest.raises(OpInputError, match=r"out\[0\]: expected a tensor that does not require"):
        op.with_kvcache(q, kc, vc, lens, k_descale=0.01, v_descale=0.01,
                        out=(torch.zeros_like(o).requires_grad_(), lse))  # fmt: skip
    res = op.with_kvcache(q, kc, vc, lens, k_descale=0.01, v_descale=0.01, out=(o, lse))
    assert res[0] is o


def test_ragged_bad_last_offset_named_not_max_seqlen_q():
    """cu_seqlens_q whose last offset runs past q's rows: the error blamed a max_seqlen_q the
    caller never passed (derived from the bad offsets)."""
    op = _op("llama3_gqa")
    torch.manual_seed(0)
    kc = torch.randn(3, 2, 48, 128, dtype=torch.bfloat16)
    q = torch.randn(6, 4, 128, dtype=torch.bfloat16)
    lens = torch.tensor([5, 20, 48], dtype=torch.int32)
    cu = torch.tensor([0, 1, 4, 2**31 - 1], dtype=torch.int32)
    with pytest.raises(OpInputError, match=r"^cu_seqlens_q: expected cu_seqlens_q\[-1\] == 6"):
        op.with_kvcache(q, kc, kc, lens, cu_seqlens_q=cu)


# ----------------------------------------------------------------------------- family_for
@pytest.mark.parametrize("dev", [(9, "x"), ("9.0",), (90,), (None,), (9.0, 0), None, "sm_90", 90,
                                 (True, 0)])  # fmt: skip
def test_family_for_malformed_device(dev):
    """TypeError / RuntimeError from int() or torch.device before."""
    with pytest.raises(OpInputError, match=r"^device: expected"):
        _op("causal_d128").family_for(dev)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_family_for_cuda_without_gpu():
    """An AssertionError from torch ('Torch not compiled with CUDA enabled') before."""
    with pytest.raises(OpInputError, match=r"torch sees no CUDA GPU here"):
        _op("causal_d128").family_for("cuda")


@pytest.mark.parametrize("cap", [(8, 0), (10, 0), (12, 0)])
def test_family_for_fp8_off_hopper_names_the_capability(cap):
    """The message said 'got target sm_80' for a 10.0 / 12.0 GPU."""
    with pytest.raises(RuntimeError, match=rf"compute capability {cap[0]}\.{cap[1]}: .* 9\.0"):
        _op("llama3_fp8").family_for(cap)
    assert _op("llama3_fp8").family_for([9, 0]).forward == "hopper_fwd"


# ----------------------------------------------------------------------------- CLI
def test_cli_build_fp8_with_family_fa2_is_an_error(capsys):
    """A ValueError traceback from the registry before."""
    from flashgen.cli.commands import main

    rc = main(["build", "--option", "family=fa2", "--json", str(ROOT / "specs/llama3_fp8.yaml")])
    assert rc != 0
    assert "no FP8 form" in capsys.readouterr().out
