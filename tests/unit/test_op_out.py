"""``op.attention(..., out=)`` and the mutating overload ``torch.ops.flashgen.<name>.out`` on
the CPU: o written into the caller's tensor (any layout with stride(-1) == 1), its checks,
gradients, ``torch.compile`` and opcheck; ``flash_attn_func`` returning the (B, S, H, D)
tensor it allocated."""

from __future__ import annotations

from pathlib import Path

import pytest

import flashgen

torch = pytest.importorskip("torch")

from flashgen.bench.verify import random_inputs  # noqa: E402
from flashgen.frontend.errors import OpInputError  # noqa: E402
from flashgen.frontend.spec import load_spec  # noqa: E402
from flashgen.ops.op import build_op, out_schema  # noqa: E402
from flashgen.ops.out_arg import overlaps  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _op(name):
    return build_op(load_spec(REPO / "specs" / f"{name}.yaml"))


def _inputs(op, b=2, hq=4, hkv=2, sq=9, sk=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return random_inputs(op.spec, b, hq, hkv, sq, sk, "cpu", gen)


def test_out_schema():
    spec = load_spec(REPO / "specs" / "alibi.yaml")
    assert out_schema(spec) == (
        "alibi.out(Tensor q, Tensor k, Tensor v, float softmax_scale, Tensor slopes, *, "
        "Tensor(a!) o, bool deterministic=False) -> Tensor"
    )
    op = _op("alibi")
    assert str(torch.ops.flashgen.alibi.out._schema) == "flashgen::" + out_schema(spec)
    assert op.torch_op is torch.ops.flashgen.alibi.default


@pytest.mark.parametrize("name", ["causal_d128", "alibi"])
def test_out_is_written_in_any_layout(name):
    op = _op(name)
    q, k, v, tensors = _inputs(op)
    ref_o, ref_lse = op.attention(q, k, v, **tensors)
    bshd = torch.full((2, 9, 4, 128), float("nan"), dtype=q.dtype)
    o, lse = op.attention(q, k, v, out=bshd.transpose(1, 2), **tensors)
    assert o._base is bshd and lse.shape == (2, 4, 9) and lse.is_contiguous()
    torch.testing.assert_close(bshd.transpose(1, 2), ref_o, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    # a padded buffer: rows of 160 elements, o in the first 128
    wide = torch.zeros(2, 4, 9, 160, dtype=q.dtype)
    o, _ = op.attention(q, k, v, out=wide[..., :128], **tensors)
    torch.testing.assert_close(wide[..., :128], ref_o, rtol=0, atol=0)
    assert not wide[..., 128:].any()


def test_float32_inputs_take_a_float32_out():
    op = _op("causal_d128")
    q, k, v, _ = _inputs(op)
    q, k, v = q.float(), k.float(), v.float()
    out = torch.empty(2, 4, 9, 128)
    o, _ = op.attention(q, k, v, out=out)
    assert o is out
    torch.testing.assert_close(out, op.attention(q, k, v)[0], rtol=0, atol=0)


def _bad_outs(q, k):
    good = torch.empty(2, 4, 9, 128, dtype=q.dtype)
    return [
        ("a list", [1], r"out: expected a torch.Tensor .*got list"),
        ("shape", good[:, :3], r"out: expected shape \[2, 4, 9, 128\] .*got \[2, 3, 9, 128\]"),
        ("dtype", good.float(), r"out: expected dtype torch.bfloat16 .*got torch.float32"),
        ("device", good.to("meta"), r"out: expected device cpu \(q's device\), got meta"),
        (
            "stride",
            torch.empty(2, 4, 128, 9, dtype=q.dtype).transpose(2, 3),
            r"out: expected stride\(-1\) == 1 .*got strides \[4608, 1152, 1, 9\]",
        ),
        (
            "expanded",
            torch.empty(1, 4, 9, 128, dtype=q.dtype).expand(2, 4, 9, 128),
            r"out: expected every element at its own address .*strides \[0, 1152, 128, 1\]",
        ),
        ("requires grad", good.clone().requires_grad_(), r"out: expected a tensor that does not "),
        ("q itself", q, r"out: expected memory that no input shares, got a tensor overlapping q"),
        (
            "inside k",
            torch.cat([k.flatten(), torch.zeros(3 * 9 * 128, dtype=k.dtype)])[-2 * 4 * 9 * 128 :]
            .view(2, 4, 9, 128),
            None,  # a view of a fresh tensor: overlaps nothing
        ),
    ]


@pytest.mark.parametrize("case", range(9))
def test_bad_out_is_refused_naming_it(case):
    op = _op("causal_d128")
    q, k, v, _ = _inputs(op, hkv=4, sk=9)
    what, out, match = _bad_outs(q, k)[case]
    if match is None:
        op.attention(q, k, v, out=out)
        return
    with pytest.raises(OpInputError, match=match):
        op.attention(q, k, v, out=out)
    if isinstance(out, torch.Tensor) and what != "requires grad":
        with pytest.raises(OpInputError, match=match):  # the overload's kernel checks too
            torch.ops.flashgen.causal_d128.out(q, k, v, 0.1, o=out)


def test_out_overlapping_k_in_one_storage():
    op = _op("causal_d128")
    store = torch.zeros(3, 2, 4, 9, 128, dtype=torch.bfloat16)
    q, k, v = store[0], store[1], store[2]
    with pytest.raises(OpInputError, match="overlapping k"):
        op.attention(q, k, v, out=store[1, :, :, :, :])
    assert overlaps(store[1], store[1][:, :, 3:4]) and not overlaps(store[0], store[1])
    op.attention(q, k, v, out=torch.empty_like(q))


def test_gradients_through_out_match_the_functional_call():
    op = _op("alibi")
    q, k, v, tensors = _inputs(op)
    runs = []
    for with_out in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        buf = torch.empty(2, 9, 4, 128, dtype=q.dtype)
        o, lse = op.attention(*leaves, out=buf.transpose(1, 2) if with_out else None, **tensors)
        if with_out:
            assert o._base is buf and o.requires_grad
        (o.float().square().sum() + lse.sum()).backward()
        runs.append([o.detach(), lse.detach(), *(t.grad for t in leaves)])
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_overload_refuses_autograd():
    op = _op("causal_d128")
    q, k, v, _ = _inputs(op, hkv=4, sk=9)
    out = torch.empty(2, 4, 9, 128, dtype=q.dtype)
    with pytest.raises(RuntimeError, match="don't support automatic differentiation"):
        torch.ops.flashgen.causal_d128.out(q.requires_grad_(), k, v, 0.1, o=out)
    with torch.no_grad():
        lse = torch.ops.flashgen.causal_d128.out(q, k, v, 0.1, o=out)
    torch.testing.assert_close(lse, torch.ops.flashgen.causal_d128(q, k, v, 0.1)[1])


@pytest.mark.parametrize("name", ["causal_d128", "alibi", "mistral_swa"])
def test_opcheck_the_out_overload(name):
    op = _op(name)
    q, k, v, tensors = _inputs(op, b=1, hq=2, hkv=1, sq=9, sk=12)
    scalars = [p.default for p in op.spec.scalar_params]
    tlist = [tensors[p.name] for p in op.spec.tensor_params]
    out = torch.empty(1, 9, 2, 128, dtype=q.dtype).transpose(1, 2)
    overload = getattr(torch.ops.flashgen, name).out
    torch.library.opcheck(overload, (q, k, v, 0.1, *scalars, *tlist), {"o": out})


@pytest.mark.parametrize("grad", [False, True])
def test_torch_compile_fullgraph_with_out(grad):
    op = _op("alibi")
    q, k, v, tensors = _inputs(op)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm

    def f(q, k, v, slopes):
        buf = torch.empty(2, 9, 4, 128, dtype=q.dtype)
        o, lse = op.attention(q, k, v, slopes=slopes, out=buf.transpose(1, 2))
        return buf, o, lse

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    args = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    buf, o, lse = compiled(*args, tensors["slopes"])
    ref_o, ref_lse = op.attention(q, k, v, **tensors)
    torch.testing.assert_close(buf.transpose(1, 2), ref_o, rtol=0, atol=0)
    torch.testing.assert_close(o, ref_o, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    want = "flashgen.alibi.default" if grad else "flashgen.alibi.out"
    assert len(graphs) == 1 and want in graphs[0], graphs
    if grad:
        o.float().sum().backward()
        assert all(t.grad is not None for t in args)


@pytest.mark.parametrize("grad", [False, True])
def test_flash_attn_func_returns_the_tensor_it_allocated(monkeypatch, grad):
    from flashgen.flash_attn import flash_attn_func
    from flashgen.ops.prefill.attention import AttentionOp

    seen = []
    real = AttentionOp.attention

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("out"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(AttentionOp, "attention", spy)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 10, 4, 64, generator=gen).requires_grad_(grad)
    k, v = (torch.randn(2, 10, 2, 64, generator=gen) for _ in range(2))
    res = flash_attn_func(q, k, v, causal=True)
    (out,) = seen
    buf = out._base
    assert buf.shape == (2, 10, 4, 64) and buf.is_contiguous()
    assert res.shape == (2, 10, 4, 64) and res.is_contiguous()
    assert res.data_ptr() == buf.data_ptr()
    if grad:
        assert res.requires_grad
        res.sum().backward()
        assert q.grad is not None
    else:
        assert res is buf


# ------------------------------------------------------------------------- out=: aliasing and views
def _bf16_inputs(b=2, h=4, s=8, d=128):
    torch.manual_seed(0)
    return [torch.randn(b, h, s, d, dtype=torch.bfloat16) for _ in range(3)]


def test_out_with_overlapping_elements_refused():
    """An as_strided out whose rows share addresses passed (stride 0 only was caught): the
    kernels would race on the shared elements."""
    op = flashgen.load("causal_d128")
    q, k, v = _bf16_inputs()
    buf = torch.empty(2 * 4 * 8 * 128, dtype=torch.bfloat16)
    out = buf.as_strided((2, 4, 8, 128), (4 * 8 + 128, 8 + 128, 1, 1))
    with pytest.raises(OpInputError, match=r"out: expected every element at its own address"):
        op.attention(q, k, v, out=out)


def test_out_ordinary_layouts_still_accepted():
    op = flashgen.load("causal_d128")
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
    op = flashgen.load("causal_d128")
    q, k, v = _bf16_inputs()
    out = torch.empty(2, 4, 8, 128, dtype=torch.bfloat16)._neg_view()
    with pytest.raises(OpInputError, match=r"out: expected a tensor whose memory holds"):
        op.attention(q, k, v, out=out)
