"""The DSL's integer ``/`` and ``%`` by a run-time divisor: C truncation, and 0 for a zero
divisor, identically in the CUDA lowering and the reference (never C's undefined
behaviour, never a ZeroDivisionError from the reference)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from flashgen.codegen.cuda_expr import cuda_expr  # noqa: E402
from flashgen.frontend.spec import loads_spec  # noqa: E402
from flashgen.ops.cpu.reference import attention_reference  # noqa: E402

SPEC = """
name: divs
head_dim: 64
dtype: bf16
mask: "kv_idx % w == 0 || q_idx / (w - 3) < 1"
params:
  w: {type: i32, default: 3}
"""


def test_lowering_guards_runtime_divisors_only():
    spec = loads_spec(SPEC)
    code = cuda_expr(spec.mask, spec)
    assert "fg::imod(kv_idx, p_w)" in code and "fg::idiv(q_idx, (p_w - 3))" in code
    const = loads_spec('name: c\nhead_dim: 64\ndtype: bf16\nmask: "q_idx / 4 == kv_idx % 4"\n')
    assert "fg::" not in cuda_expr(const.mask, const)  # a nonzero constant divides plainly


@pytest.mark.parametrize("w", [0, 3, -2, 5])
def test_reference_semantics(w):
    spec = loads_spec(SPEC)
    sq = sk = 9
    q = torch.randn(1, 1, sq, 64, dtype=torch.float64)
    o, lse = attention_reference(spec, q, q, q, softmax_scale=0.125, params={"w": w},
                                 compute_dtype=torch.float64)  # fmt: skip

    def c_div(a, b):  # C truncation, 0 for a zero divisor
        return 0 if b == 0 else int(a / b)

    def c_mod(a, b):
        return 0 if b == 0 else a - b * int(a / b)

    keep = torch.tensor(
        [[c_mod(j, w) == 0 or c_div(i, w - 3) < 1 for j in range(sk)] for i in range(sq)]
    )
    s = (q[0, 0] @ q[0, 0].T) * 0.125
    s = s.masked_fill(~keep, float("-inf"))
    ref_lse = torch.logsumexp(s, -1)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse[0, 0]), fin)
    assert torch.allclose(lse[0, 0][fin], ref_lse[fin])
    ref_o = torch.softmax(s[fin], -1) @ q[0, 0]
    assert torch.allclose(o[0, 0][fin], ref_o)
