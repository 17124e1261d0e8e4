"""``op.attention(..., out=)`` on a GPU: the kernel writes o into the caller's ``(B, S, H, D)``
storage through its strides (no copy), eagerly with and without gradients and through the
mutating overload ``torch.ops.flashgen.<name>.out``; ``flash_attn_func`` returns the
contiguous ``(B, S, H, D)`` tensor it allocated."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from flashgen.bench.verify import random_inputs  # noqa: E402
from flashgen.frontend.spec import load_spec  # noqa: E402
from flashgen.ops.op import build_op, poison_outputs  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.parametrize("name", ["causal_d128", "alibi"])
@pytest.mark.parametrize("grad", [False, True])
def test_out_is_written_in_place(name, grad):
    op = build_op(load_spec(REPO / "specs" / f"{name}.yaml"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, tensors = random_inputs(op.spec, 2, 4, 2, 300, 517, "cuda", gen)
    ref_o, ref_lse = op.attention(q, k, v, deterministic=True, **tensors)
    leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    buf = torch.empty(2, 300, 4, 128, dtype=q.dtype, device="cuda")
    with poison_outputs():  # NaN first: every element must be written
        o, lse = op.attention(*leaves, out=buf.transpose(1, 2), deterministic=True, **tensors)
    assert o._base is buf and o.requires_grad == grad
    torch.testing.assert_close(buf.transpose(1, 2), ref_o, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    if grad:
        o.float().sum().backward()
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        op.attention(*ref, deterministic=True, **tensors)[0].float().sum().backward()
        for a, b in zip(leaves, ref, strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    with torch.no_grad():
        buf2 = torch.empty_like(buf)
        scalars = [p.default for p in op.spec.scalar_params]
        tlist = [tensors[p.name] for p in op.spec.tensor_params]
        lse2 = getattr(torch.ops.flashgen, op.name).out(
            q, k, v, 128**-0.5, *scalars, *tlist, o=buf2.transpose(1, 2)
        )
    torch.testing.assert_close(buf2, buf, rtol=0, atol=0)
    torch.testing.assert_close(lse2, ref_lse, rtol=0, atol=0)


def test_flash_attn_func_output_is_contiguous_bshd():
    from flashgen.flash_attn import flash_attn_func

    q = torch.randn(2, 257, 8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 257, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = flash_attn_func(q, k, v, causal=True)
    assert out.shape == (2, 257, 8, 128) and out.is_contiguous()
