"""Issue 22, items 8 and 9: the CPU reference (and so the CPU op, its backward and the varlen
op) keeps the softmax normalized where many large logits tie, and does integer arithmetic
in 32-bit two's complement like the kernels."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from flashgen import loads_spec  # noqa: E402
from flashgen.ops.cpu.reference import (  # noqa: E402
    attention_reference,
    attention_reference_varlen,
    eval_mask,
)

HEAD = "name: r\nhead_dim: 64\ndtype: bf16\n"


def _tied(spec, value: float, s: int = 64):
    g = torch.Generator().manual_seed(0)
    q = torch.full((1, 2, s, 64), value, dtype=torch.bfloat16)
    k = torch.full((1, 2, s, 64), value, dtype=torch.bfloat16)
    v = torch.randn(1, 2, s, 64, generator=g).to(torch.bfloat16)
    return q, k, v


@pytest.mark.parametrize(
    "score_mod, value", [(None, 1e4), ("score * 0.0 - 3.0e38", 1.0), ("score * 0.0 + 3.0e38", 1.0)]
)
def test_tied_large_logits_stay_normalized(score_mod, value):
    spec = loads_spec(HEAD + (f"score_mod: {score_mod}\n" if score_mod else ""))
    q, k, v = _tied(spec, value)
    want = v.double().mean(dim=2, keepdim=True).expand(-1, -1, q.shape[2], -1)
    o, lse = attention_reference(spec, q, k, v, compute_dtype=torch.float32)
    assert (o.double() - want).abs().max().item() < 1e-2
    assert torch.isfinite(lse).all()
    # the varlen reference (the varlen CPU op) shares it
    pack = lambda t: t[0].transpose(0, 1).contiguous()  # noqa: E731
    cu = torch.tensor([0, q.shape[2]], dtype=torch.int32)
    ov, _ = attention_reference_varlen(
        spec, pack(q), pack(k), pack(v), cu, cu, compute_dtype=torch.float32
    )
    assert (ov.double() - pack(want)).abs().max().item() < 1e-2


def test_tied_large_logits_backward_is_finite_and_right():
    spec = loads_spec(HEAD)
    q, k, v = _tied(spec, 1e4, s=32)
    vv = v.float().requires_grad_()
    o, _ = attention_reference(spec, q, k, vv, compute_dtype=torch.float32)
    o.sum().backward()
    # uniform attention: each key's dv is the number of queries over the number of keys
    assert torch.allclose(vv.grad, torch.ones_like(vv.grad), atol=1e-3)


def test_integer_arithmetic_wraps_like_int32():
    spec = loads_spec(HEAD + "mask: q_idx * 1000000 >= kv_idx\n")
    sq, sk = 4096, 8
    keep = eval_mask(spec, batch=1, heads_q=1, seqlen_q=sq, seqlen_k=sk)[0, 0]
    q = torch.arange(sq, dtype=torch.int64).view(-1, 1)
    wrapped = ((q * 1000000 + 2**31) % 2**32) - 2**31
    want = wrapped >= torch.arange(sk).view(1, -1)
    assert torch.equal(keep, want)
    assert int((~keep).any(dim=1).sum()) == 1948 + 1  # row 0 masks kv_idx > 0 as well
