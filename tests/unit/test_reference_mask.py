"""The reference decides a mask's float math in float32, as the kernels do, whatever its
compute dtype: the float64 test reference and the float32 CPU op keep the same pairs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from flashgen.frontend.spec import loads_spec  # noqa: E402
from flashgen.ops.cpu.reference import attention_reference, eval_mask  # noqa: E402

SPEC = """name: f32mask
head_dim: 64
dtype: bf16
mask: 'kv_idx * 0.1 == 0.3 || kv_idx <= q_idx / 0.3 - 31.0 || kv_idx * f == 0.7'
params: {f: {type: f32, default: 0.1}}
"""


def test_float_mask_math_is_float32_in_every_reference():
    spec = loads_spec(SPEC)
    sq, sk = 13, 11
    q_idx = torch.arange(sq, dtype=torch.float32)[:, None]
    kv_idx = torch.arange(sk, dtype=torch.float32)[None, :]
    f = torch.tensor(0.1, dtype=torch.float32)
    want = (
        (kv_idx * torch.tensor(0.1, dtype=torch.float32) == torch.tensor(0.3))
        | (kv_idx <= q_idx / torch.tensor(0.3, dtype=torch.float32) - 31.0)
        | (kv_idx * f == torch.tensor(0.7, dtype=torch.float32))
    )
    # float64 would keep neither kv_idx 3 (3 * 0.1 != 0.3) nor 7 (7 * 0.1 != 0.7)
    assert bool(want[:, 3].all()) and bool(want[:, 7].all())
    assert torch.equal(eval_mask(spec, batch=1, heads_q=1, seqlen_q=sq, seqlen_k=sk)[0, 0], want)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, sq, 64, generator=g)
    k = torch.randn(1, 1, sk, 64, generator=g)
    v = torch.randn(1, 1, sk, 64, generator=g)
    for dt in (torch.float64, torch.float32):
        o, lse = attention_reference(spec, q, k, v, compute_dtype=dt)
        s = (q.double() @ k.double().transpose(-1, -2))[0, 0] / 8.0
        s = s.masked_fill(~want, float("-inf"))
        torch.testing.assert_close(lse[0, 0].double(), torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)
        ref_o = torch.softmax(s, -1) @ v[0, 0].double()
        torch.testing.assert_close(o[0, 0].double(), ref_o, rtol=1e-5, atol=1e-5)


def test_an_out_of_range_tensor_index_names_the_index_value_and_pair():
    """The CPU op / reference refuses an index the kernels would clamp; the message says
    which subscript, its value, the extent and where (it named only the param)."""
    spec = loads_spec(
        "name: relb\nhead_dim: 64\ndtype: bf16\n"
        "score_mod: score + bias[h, q_idx - kv_idx + off]\n"
        "params: {'off': {type: i32, default: 6}, bias: {type: f32, shape: [num_heads, 16]}}\n"
    )
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 9, 64, generator=g), torch.randn(2, 3, 7, 64, generator=g)
    bias = torch.randn(3, 16, generator=g)
    attention_reference(spec, q, k, k, params={"bias": bias})  # 0 .. 14: in range
    with pytest.raises(IndexError) as info:
        attention_reference(spec, q, k, k, params={"bias": bias, "off": 0})
    msg = str(info.value)
    assert "bias[., -1] at b=0, h=0, q_idx=0, kv_idx=1, but dim 1 has extent 16" in msg, msg
    with pytest.raises(IndexError, match=r"bias\[\., 16\] at b=0, h=0, q_idx=3, kv_idx=0"):
        attention_reference(spec, q, k, k, params={"bias": bias, "off": 13})
