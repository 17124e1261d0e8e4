"""Backward pass on the CPU: the reference's gradients vs finite differences, the symbolic
d score_mod / d score vs autograd, and the op's autograd registration (eager, opcheck,
torch.compile, checkpoint, clear errors for tensor params that require grad)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from flashgen.analysis.derive import d_dscore  # noqa: E402
from flashgen.bench.verify import random_tensor_params  # noqa: E402
from flashgen.frontend import ir  # noqa: E402
from flashgen.frontend.spec import load_spec, loads_spec  # noqa: E402
from flashgen.ops.cpu.reference import attention_reference, eval_expr  # noqa: E402
from flashgen.ops.op import build_op  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
#: the shipped specs with a prefill (v_from_k specs are decode only: tests/unit/test_decode_mla.py)
SPECS = [p for p in sorted((REPO / "specs").glob("*.yaml")) if not load_spec(p).v_from_k]


def _inputs(spec, b=1, hq=2, hkv=1, sq=5, sk=7, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, spec.head_dim, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, sk, spec.head_dim, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, sk, spec.head_dim_v, generator=g, dtype=dtype)
    sym = {"batch": b, "num_heads": hq, "num_heads_kv": hkv, "seqlen_q": sq, "seqlen_k": sk}
    params = {n: t * 0.5 if t.is_floating_point() else t
              for n, t in random_tensor_params(spec, sym, "cpu", g).items()}  # fmt: skip
    for p in spec.scalar_params:
        if p.name == "window":
            params[p.name] = 3  # small enough to mask something at these sizes
    return q, k, v, params


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_reference_gradients_match_finite_differences(path):
    """Autograd through the float64 reference equals central differences (gradcheck), for
    every shipped mask/score_mod, with Sq != Sk, GQA, and a row with nothing to attend to
    (causal with Sq > Sk)."""
    spec = load_spec(path)
    spec = dataclasses.replace(spec, head_dim=8, head_dim_v=8)  # small for gradcheck
    q, k, v, params = _inputs(spec, sq=6, sk=4)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        o, lse = attention_reference(spec, q, k, v, params=params, softmax_scale=0.7)
        return o, torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-6)


def _typed(text: str, params: str = "") -> ir.Expr:
    spec = loads_spec(
        f"name: t\nhead_dim: 64\ndtype: bf16\nscore_mod: '{text}'\n{params}", "t.yaml"
    )
    return spec, spec.score_mod


@pytest.mark.parametrize(
    "text",
    [
        "score",
        "-score * 2.5 + 1",
        "softcap * tanh(score / softcap)",
        "exp(score / 4.0)",
        "log(abs(score) + 1.0)",
        "sqrt(score * score + 1.0)",
        "abs(score - 0.25)",
        "min(score, 1.5) + max(score, -0.5)",
        "score > 0.0 ? score * score : score / 3.0",
        "(score * 3.0) % 1.7",
        "score - slopes[h] * (q_idx - kv_idx)",
        "score / (1.0 + score * score)",
    ],
)
def test_symbolic_derivative_matches_autograd(text):
    params = (
        "params:\n  softcap: {type: f32, default: 30.0}\n"
        "  slopes: {type: f32, shape: [num_heads]}\n"
    )
    spec, e = _typed(text, params)
    g = torch.Generator().manual_seed(1)
    score = (torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64) * 3).requires_grad_()
    env = {
        "b": torch.zeros(1, 1, 1, 1, dtype=torch.int64),
        "h": torch.arange(2).view(1, 2, 1, 1),
        "q_idx": torch.arange(3).view(1, 1, 3, 1),
        "kv_idx": torch.arange(4).view(1, 1, 1, 4),
        "seqlen_q": torch.tensor(3),
        "seqlen_k": torch.tensor(4),
        "softcap": torch.tensor(30.0, dtype=torch.float64),
        "slopes": torch.tensor([0.25, 0.5], dtype=torch.float64),
        "score": score,
        "__float__": torch.float64,
        "__device__": torch.device("cpu"),
    }
    out = eval_expr(e, env).expand_as(score)
    (auto,) = torch.autograd.grad(out.sum(), score)
    sym = eval_expr(d_dscore(e), env)
    torch.testing.assert_close(torch.as_tensor(sym, dtype=torch.float64).expand_as(auto), auto)


@pytest.mark.parametrize("name", ["causal_d128", "gemma2_softcap", "mistral_swa"])
def test_op_backward_matches_reference_autograd(name):
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    op = build_op(spec)
    q, k, v, params = _inputs(spec, b=2, hq=4, hkv=2, sq=9, sk=6, dtype=torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, lse = op.attention(q, k, v, **params)
    do = torch.randn_like(o)
    (o.float() * do.float()).sum().backward()
    q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ro, _ = attention_reference(spec, q2, k2, v2, params=params, compute_dtype=torch.float32)
    (ro * do.float()).sum().backward()
    for a, b_ in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(a.float(), b_, atol=2e-2, rtol=2e-2)


def test_lse_gradient_flows():
    spec = load_spec(REPO / "specs" / "causal_d128.yaml")
    op = build_op(spec)
    q, k, v, _ = _inputs(spec, sq=5, sk=5, dtype=torch.bfloat16)
    q.requires_grad_()
    _, lse = op.attention(q, k, v)
    lse.sum().backward()
    q2 = q.detach().float().requires_grad_()
    _, rl = attention_reference(spec, q2, k.float(), v.float(), compute_dtype=torch.float32)
    rl.sum().backward()
    torch.testing.assert_close(q.grad.float(), q2.grad, atol=2e-2, rtol=2e-2)


def test_opcheck_with_gradients():
    spec = load_spec(REPO / "specs" / "alibi.yaml")
    op = build_op(spec)
    q, k, v, params = _inputs(spec, sq=5, sk=7, dtype=torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    slopes = params["slopes"].float()
    torch.library.opcheck(op.torch_op, (q, k, v, 0.125, slopes))


def test_torch_compile_backward_and_checkpoint():
    spec = load_spec(REPO / "specs" / "gpt2_d64.yaml")
    op = build_op(spec)
    q, k, v, _ = _inputs(spec, sq=5, sk=5, dtype=torch.float16)
    q.requires_grad_()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(q, k, v):
        return op.torch_op(q, k, v, 0.125)[0].float().sum()

    f(q, k, v).backward()
    g_compiled = q.grad.clone()
    q.grad = None
    torch.utils.checkpoint.checkpoint(
        lambda q: op.attention(q, k, v)[0].float().sum(), q, use_reentrant=False
    ).backward()
    torch.testing.assert_close(q.grad, g_compiled)


def test_out_of_range_tensor_index_is_refused_only_where_kept():
    """A bias read outside its shape is clamped (as in the kernels) where the mask drops
    the pair, and refused with a clear error where the pair is kept."""
    text = (
        "name: relb\nhead_dim: 64\ndtype: bf16\nmask: causal\n"
        "score_mod: score + tb[q_idx + seqlen_k - seqlen_q - kv_idx]\n"
        "params:\n  tb: {type: f32, shape: [8]}\n"
    )
    spec = loads_spec(text, "relb.yaml")
    q, k, v, _ = _inputs(spec, sq=8, sk=8)
    tb = torch.randn(8, dtype=torch.float64)
    o, _ = attention_reference(spec, q, k, v, params={"tb": tb})  # distances 0..7 when kept
    assert torch.isfinite(o).all()
    q2, k2, v2, _ = _inputs(spec, sq=9, sk=9)
    with pytest.raises(IndexError, match="tensor param 'tb' is indexed outside its shape"):
        attention_reference(spec, q2, k2, v2, params={"tb": tb})  # distance 8 is kept


def test_double_backward_raises_instead_of_returning_zeros():
    """create_graph=True gives the same first-order gradients, differentiable; a gradient of
    them (a gradient penalty, a Hessian-vector product) has no kernels and raises
    NotImplementedError naming the op (torch's fallback would return zeros silently)."""
    import flashgen

    op = flashgen.load("causal_d128")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 128, dtype=torch.float64, generator=g) for _ in range(3))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    plain = torch.autograd.grad((op.attention(q, k, v)[0] ** 2).sum(), (q, k, v))
    first = torch.autograd.grad((op.attention(q, k, v)[0] ** 2).sum(), (q, k, v),
                                create_graph=True)  # fmt: skip
    for a, b in zip(plain, first, strict=True):
        assert torch.equal(a, b) and b.requires_grad
    with pytest.raises(NotImplementedError, match="causal_d128: no double backward"):
        torch.autograd.grad(first[0].sum(), q)


def test_functorch_reverse_mode_raises_naming_the_op_and_what_works():
    """torch.func.grad / vjp / jacrev through op.attention or op.varlen (q, k, v or a trained
    tensor param such as alibi_learned's slopes) raise NotImplementedError naming the op and
    torch.autograd.grad: torch.library's generated autograd.Function has no setup_context,
    so torch raised 'must override the setup_context staticmethod' (pytorch/pytorch#168393),
    and the forward-mode refusal recommended torch.func.jacrev, which failed the same way.
    vmap without a gradient transform still runs."""
    import flashgen

    op = flashgen.load("alibi_learned")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 64, dtype=torch.float64, generator=g) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)
    match = r"alibi_learned(__varlen)?: no torch\.func reverse mode .*torch\.autograd\.grad"
    with pytest.raises(NotImplementedError, match=match):
        torch.func.grad(lambda x: op.attention(x, k, v, slopes=slopes)[0].sum())(q)
    with pytest.raises(NotImplementedError, match=match):
        torch.func.grad(lambda s: op.attention(q, k, v, slopes=s)[0].sum())(slopes)
    with pytest.raises(NotImplementedError, match=match):
        torch.func.jacrev(lambda s: op.attention(q, k, v, slopes=s)[0].sum())(slopes)
    with pytest.raises(NotImplementedError, match=match):
        torch.func.vjp(lambda x: op.attention(x, k, v, slopes=slopes)[0], q)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    qv, kv, vv = (t[0].transpose(0, 1) for t in (q, k, v))
    with pytest.raises(NotImplementedError, match=match):
        torch.func.grad(
            lambda x: op.varlen(x, kv, vv, cu, cu, 3, 3, slopes=slopes)[0].sum())(qv)  # fmt: skip
    with pytest.raises(NotImplementedError, match=r"forward-mode AD.*torch\.autograd\.grad"):
        torch.func.jacfwd(lambda s: op.attention(q, k, v, slopes=s)[0].sum())(slopes)
    batched = torch.func.vmap(lambda s: op.attention(q, k, v, slopes=s)[0].sum())(
        torch.stack([slopes, 2 * slopes]))  # fmt: skip
    assert batched[0] == op.attention(q, k, v, slopes=slopes)[0].sum()
    s = slopes.clone().requires_grad_()
    (grad,) = torch.autograd.grad(op.attention(q, k, v, slopes=s)[0].sum(), s)
    assert grad.shape == (2,)


def test_forward_mode_ad_raises_instead_of_zero_tangents():
    """torch.func.jvp / jacfwd and forward_ad dual tensors through an op raise
    NotImplementedError naming it (no forward-mode formula; torch gave zero tangents
    silently); reverse mode and plain calls inside a vmap are unaffected."""
    import torch.autograd.forward_ad as fwad

    import flashgen

    op = flashgen.load("causal_d128")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, 5, 128, dtype=torch.float64, generator=g) for _ in range(3))
    match = "causal_d128: no forward-mode AD"
    with pytest.raises(NotImplementedError, match=match):
        torch.func.jvp(lambda x: op.attention(x, k, v)[0], (q,), (torch.randn_like(q),))
    with pytest.raises(NotImplementedError, match=match):
        torch.func.jacfwd(lambda x: op.attention(x, k, v)[0])(q)
    with fwad.dual_level(), pytest.raises(NotImplementedError, match=match):
        op.attention(q, fwad.make_dual(k, torch.randn_like(k)), v)
    with fwad.dual_level():  # a dual level with no dual input: an ordinary call
        assert op.attention(q, k, v)[0].shape == (1, 1, 5, 128)
