"""Gradients of f32 params through the CPU op (issue 37): ``dparam[idx] = sum over (b, h,
q_idx, kv_idx) of dS * d score_mod / d param[idx]``, checked with
``torch.autograd.gradcheck`` in float64 on the op itself, for every shipped spec with an f32
param and a test spec of each index form, and against the float64 reference's autograd."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import flashgen
from flashgen import OpInputError
from flashgen.analysis.derive import differentiable_params, grad_refusal, param_grad_terms
from flashgen.frontend.spec import load_spec, loads_spec
from flashgen.ops.cpu.reference import attention_reference, attention_reference_varlen
from flashgen.ops.op import build_op

REPO = Path(__file__).resolve().parents[2]
F64 = torch.float64


def _spec(name: str, score_mod: str, params: str, mask: str = "null", head_dim: int = 32):
    return loads_spec(
        f"name: {name}\nhead_dim: {head_dim}\ndtype: fp16\nmask: {mask}\n"
        f"score_mod: \"{score_mod}\"\nparams:\n{params}",
        f"<{name}>",
    )


#: One test spec per index form of a param read: (spec, sizes).
INDEX_FORMS = {
    "per_head": ("score - s[h] * abs(q_idx - kv_idx)", "  s: {type: f32, shape: [num_heads]}"),
    "per_batch_head": ("score + bb[b, h]", "  bb: {type: f32, shape: [batch, num_heads]}"),
    "per_query": ("score * qs[b, q_idx]", "  qs: {type: f32, shape: [batch, seqlen_q]}"),
    "per_key": ("score + kb[h_kv, kv_idx]", "  kb: {type: f32, shape: [num_heads_kv, seqlen_k]}"),
    "relative_table": (
        "score + rel[h, min(max(q_idx - kv_idx, -4), 4) + 4]",
        "  rel: {type: f32, shape: [num_heads, 9]}",
    ),
    "two_reads": ("score + t[q_idx % 3] - 2.0 * t[kv_idx % 3]", "  t: {type: f32, shape: [3]}"),
    "scalars": (
        "temp * score + g * tanh(score / temp)",
        "  temp: {type: f32, default: 1.0, above: 0}\n  g: {type: f32, default: 0.5}",
    ),
}


def _qkv(spec, b=2, hq=4, hkv=2, sq=5, sk=7, seed=0, grad=True, transposed=False):
    g = torch.Generator().manual_seed(seed)
    if transposed:  # (B, S, H, D) storage viewed as [B, H, S, D]: non-contiguous
        q = torch.randn(b, sq, hq, spec.head_dim, dtype=F64, generator=g).transpose(1, 2)
        k = torch.randn(b, sk, hkv, spec.head_dim, dtype=F64, generator=g).transpose(1, 2)
        v = torch.randn(b, sk, hkv, spec.head_dim_v, dtype=F64, generator=g).transpose(1, 2)
    else:
        q = torch.randn(b, hq, sq, spec.head_dim, dtype=F64, generator=g)
        k = torch.randn(b, hkv, sk, spec.head_dim, dtype=F64, generator=g)
        v = torch.randn(b, hkv, sk, spec.head_dim_v, dtype=F64, generator=g)
    sym = {"batch": b, "num_heads": hq, "num_heads_kv": hkv, "seqlen_q": sq, "seqlen_k": sk}
    params = {}
    for p in spec.params:
        if p.kind == "tensor":
            shape = [d if isinstance(d, int) else sym[d] for d in p.shape]
            params[p.name] = (torch.rand(shape, dtype=F64, generator=g) * 0.5 + 0.25)
        elif p.ty.value == "f32":
            params[p.name] = torch.tensor(float(p.default) + 0.3, dtype=F64)
    if grad:
        for t in (q, k, v, *params.values()):
            t.requires_grad_()
    return q, k, v, params


def _gradcheck(op, q, k, v, params, **kw):
    names = list(params)

    def f(q, k, v, *vals):
        o, lse = op.attention(q, k, v, **dict(zip(names, vals, strict=True)), **kw)
        return o, torch.where(torch.isfinite(lse), lse, 0.0)  # -inf: fully masked rows

    assert torch.autograd.gradcheck(f, (q, k, v, *params.values()), fast_mode=True)


@pytest.mark.parametrize("form", sorted(INDEX_FORMS))
def test_gradcheck_of_each_param_index_form_on_the_cpu_op(form):
    """GQA (4 query heads on 2 KV heads), Sq != Sk, float64, on the op itself."""
    spec = _spec(f"pg_{form}", *INDEX_FORMS[form])
    op = build_op(spec)
    _gradcheck(op, *_qkv(spec))


@pytest.mark.parametrize(("sq", "sk"), [(1, 17), (17, 1)])
def test_gradcheck_of_a_relative_table_at_odd_lengths_and_transposed_views(sq, sk):
    spec = _spec("pg_rel_odd", *INDEX_FORMS["relative_table"], mask="causal")
    op = build_op(spec)
    _gradcheck(op, *_qkv(spec, b=1, hq=2, hkv=1, sq=sq, sk=sk, transposed=True))


SHIPPED = ["alibi", "alibi_learned", "gemma2_softcap", "gpt_oss_sink", "t5_bias"]


@pytest.mark.parametrize("name", SHIPPED)
def test_gradcheck_of_every_shipped_spec_with_an_f32_param(name):
    op = flashgen.load(REPO / "specs" / f"{name}.yaml")
    assert differentiable_params(op.spec)
    _gradcheck(op, *_qkv(op.spec, b=1, hq=2, hkv=1, sq=3, sk=4))


def test_every_shipped_spec_with_an_f32_param_is_in_the_gradcheck():
    shipped = {
        p.stem for p in (REPO / "specs").glob("*.yaml")
        if differentiable_params(load_spec(p))
    }  # fmt: skip
    assert shipped == set(SHIPPED)


def test_param_gradients_match_the_float64_reference_at_real_sizes():
    """t5_bias at 127 x 1000 (several query chunks and key blocks), GQA: dbias of the CPU op
    against autograd through the materialized float64 reference."""
    op = flashgen.load(REPO / "specs" / "t5_bias.yaml")
    q, k, v, params = _qkv(op.spec, b=1, hq=4, hkv=2, sq=127, sk=1000, grad=False)
    bias = params["bias"].requires_grad_()
    o, lse = op.attention(q, k, v, bias=bias)
    g = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=g, dtype=F64)
    dl = torch.randn(lse.shape, generator=g, dtype=F64)
    (got,) = torch.autograd.grad((o * do).sum() + (lse * dl).sum(), bias)
    b2 = bias.detach().clone().requires_grad_()
    ro, rl = attention_reference(op.spec, q, k, v, params={"bias": b2})
    (want,) = torch.autograd.grad((ro * do).sum() + (rl * dl).sum(), b2)
    assert got.abs().max() > 0
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8)


def test_gradcheck_of_a_per_batch_param_on_the_varlen_op():
    spec = _spec("pg_varlen", "score + bb[b, h] * (q_idx - kv_idx)",
                 "  bb: {type: f32, shape: [batch, num_heads]}", mask="causal")  # fmt: skip
    op = build_op(spec).varlen
    g = torch.Generator().manual_seed(0)
    cq = torch.tensor([0, 3, 3, 8], dtype=torch.int32)  # an empty sequence in the middle
    ck = torch.tensor([0, 4, 6, 13], dtype=torch.int32)
    q = torch.randn(8, 4, 32, dtype=F64, generator=g).requires_grad_()
    k = torch.randn(13, 2, 32, dtype=F64, generator=g).requires_grad_()
    v = torch.randn(13, 2, 32, dtype=F64, generator=g).requires_grad_()
    bb = torch.rand(3, 4, dtype=F64, generator=g).requires_grad_()

    def f(q, k, v, bb):
        return op(q, k, v, cq, ck, 5, 7, bb=bb)

    assert torch.autograd.gradcheck(f, (q, k, v, bb), fast_mode=True)
    o, lse = f(q, k, v, bb)
    (got,) = torch.autograd.grad(o.sum() + lse.sum(), bb)
    b2 = bb.detach().clone().requires_grad_()
    ro, rl = attention_reference_varlen(spec, q.detach(), k.detach(), v.detach(), cq, ck,
                                        params={"bb": b2})  # fmt: skip
    (want,) = torch.autograd.grad(ro.sum() + rl.sum(), b2)
    torch.testing.assert_close(got, want)
    assert got[1].abs().max() == 0  # the empty sequence's row


def test_scalar_param_gradient_on_the_varlen_op():
    spec = _spec("pg_varlen_scalar", *INDEX_FORMS["scalars"])
    op = build_op(spec).varlen
    g = torch.Generator().manual_seed(0)
    cq = torch.tensor([0, 2, 5], dtype=torch.int32)
    q = torch.randn(5, 2, 32, dtype=F64, generator=g).requires_grad_()
    k = torch.randn(5, 2, 32, dtype=F64, generator=g).requires_grad_()
    v = torch.randn(5, 2, 32, dtype=F64, generator=g).requires_grad_()
    temp = torch.tensor(1.3, dtype=F64, requires_grad=True)

    def f(q, k, v, temp):
        return op(q, k, v, cq, cq, 3, 3, temp=temp)

    assert torch.autograd.gradcheck(f, (q, k, v, temp), fast_mode=True)


def test_a_param_read_only_by_the_mask_refuses_requires_grad_naming_it():
    spec = _spec("pg_mask_only", "score + w * 0.5",
                 "  frac: {type: f32, default: 1.0}\n  w: {type: f32, default: 1.0}",
                 mask="kv_idx <= q_idx * frac")  # fmt: skip
    op = build_op(spec)
    q, k, v, _ = _qkv(spec, grad=False)
    assert differentiable_params(spec) == ("w",)
    with pytest.raises(OpInputError, match="frac: requires_grad .* read only by the mask"):
        op.attention(q, k, v, frac=torch.tensor(1.0, dtype=F64, requires_grad=True))
    op.attention(q, k, v, frac=torch.tensor(1.0, dtype=F64))  # fine without grad


def test_a_tensor_param_read_only_by_the_mask_refuses_requires_grad():
    spec = _spec("pg_mask_only_t", "score", "  lim: {type: f32, shape: [num_heads]}",
                 mask="kv_idx <= q_idx * lim[h]")  # fmt: skip
    op = build_op(spec)
    q, k, v, params = _qkv(spec, grad=False)
    with pytest.raises(OpInputError, match="lim: requires_grad"):
        op.attention(q, k, v, lim=params["lim"].requires_grad_())


def test_param_grad_checks_run_once_per_spec_and_names(monkeypatch):
    """``param_grad_flags`` and ``wanted`` (asked by every trained call, in its forward and
    its backward) check the params against the spec once per spec object and arguments; a
    refusal raises on every call, and a new spec object (a reload, ``dataclasses.replace``)
    is checked anew.  The kept answers change neither equality nor hashing of the spec."""
    import dataclasses

    from flashgen.ops.prefill import backward as bwd_mod

    checked = []
    check = bwd_mod.check_param_grad

    def counting(spec, name):
        checked.append(name)
        check(spec, name)

    monkeypatch.setattr(bwd_mod, "check_param_grad", counting)
    spec = _spec("pg_memo", "score + s[h]",
                 "  s: {type: f32, shape: [num_heads]}\n  lim: {type: f32, shape: [num_heads]}",
                 mask="kv_idx <= q_idx * lim[h]")  # fmt: skip
    twin = dataclasses.replace(spec)
    for _ in range(3):
        assert bwd_mod.param_grad_flags(spec, {"s": True}) == [True, False]
        assert bwd_mod.wanted(spec, [True, False]) == ("s",)
    assert checked == ["s", "s"]
    for _ in range(2):
        with pytest.raises(OpInputError, match="lim: requires_grad"):
            bwd_mod.param_grad_flags(spec, {"lim": True})
        with pytest.raises(OpInputError, match="lim: requires_grad"):
            bwd_mod.wanted(spec, [False, True])
    assert checked == ["s", "s", *["lim"] * 4]
    assert bwd_mod.param_grad_flags(twin, {"s": True}) == [True, False]
    assert checked[-1] == "s" and len(checked) == 7
    assert twin == spec and hash(twin) == hash(spec)


def test_an_i32_param_has_no_gradient():
    spec = load_spec(REPO / "specs" / "document_mask.yaml")
    assert "i32" in grad_refusal(spec, "doc_q")
    assert differentiable_params(spec) == ()


def test_param_grad_terms_group_equal_reads_and_keep_distinct_ones():
    spec = _spec("pg_terms", "score + t[h] * 2.0 + t[h] + t[0]", "  t: {type: f32, shape: [4]}")
    terms = param_grad_terms(spec.score_mod, "t")
    assert len(terms) == 2  # t[h] (read twice: one element, partial 3) and t[0]


def test_without_requires_grad_no_param_gradient_is_computed(monkeypatch):
    """Only the flags of params that require grad reach the backward op."""
    op = flashgen.load(REPO / "specs" / "alibi.yaml")
    q, k, v, params = _qkv(op.spec, b=1, hq=2, hkv=1, sq=3, sk=4, grad=False)
    q.requires_grad_()
    seen = []
    real = torch.ops.flashgen.alibi__backward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("param_grads"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.ops.flashgen, "alibi__backward", spy)
    op.attention(q, k, v, slopes=params["slopes"].detach())[0].sum().backward()
    op.attention(q, k, v, slopes=params["slopes"].requires_grad_())[0].sum().backward()
    assert seen == [None, [True]]


class _SlopesAttention(torch.nn.Module):
    """A small attention module with trainable per-head ALiBi slopes (an ``nn.Parameter``)
    built on the op (``fn=None``) or on a float64 eager implementation of the same math."""

    def __init__(self, op, dim=128, heads=2, fn=None):
        super().__init__()
        self.op, self.heads, self.fn = op, heads, fn
        g = torch.Generator().manual_seed(0)
        self.qkv = torch.nn.Parameter(torch.randn(dim, 3 * dim, generator=g, dtype=F64) / 8)
        self.slopes = torch.nn.Parameter(torch.tensor([0.5, 0.125], dtype=F64))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (x @ self.qkv).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.fn is not None:
            return self.fn(q, k, v, self.slopes)
        return self.op.attention(q, k, v, slopes=self.slopes)[0]


def _eager_alibi(q, k, v, slopes):
    """The alibi_learned spec's math in float64 torch: score - slopes[h] * |q_idx - kv_idx|."""
    i = torch.arange(q.shape[2]).view(-1, 1)
    j = torch.arange(k.shape[2]).view(1, -1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    s = s - slopes.view(1, -1, 1, 1) * (i - j).abs()
    return torch.softmax(s, -1) @ v


def test_an_nn_parameter_slopes_module_trains_20_steps_like_float64_eager():
    op = flashgen.load(REPO / "specs" / "alibi_learned.yaml")
    mods = {"op": _SlopesAttention(op), "eager": _SlopesAttention(op, fn=_eager_alibi)}
    opts = {n: torch.optim.SGD(m.parameters(), lr=0.5) for n, m in mods.items()}
    g = torch.Generator().manual_seed(1)
    start = mods["op"].slopes.detach().clone()
    for _ in range(20):
        x = torch.randn(2, 13, 128, generator=g, dtype=F64)
        target = torch.randn(2, 2, 13, 64, generator=g, dtype=F64)
        for n, m in mods.items():
            opts[n].zero_grad()
            ((m(x) - target) ** 2).mean().backward()
            opts[n].step()
    torch.testing.assert_close(mods["op"].slopes, mods["eager"].slopes, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(mods["op"].qkv, mods["eager"].qkv, rtol=1e-9, atol=1e-12)
    assert (mods["op"].slopes.detach() - start).abs().max() > 1e-3  # the slopes did train


def test_opcheck_and_torch_compile_with_a_param_requiring_grad():
    """The backward op's fake impl returns the requested gradients' shapes: opcheck (autograd
    registration, AOT dispatch) and torch.compile(fullgraph) give the eager op's dslopes."""
    op = flashgen.load(REPO / "specs" / "alibi.yaml")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 128, generator=g).to(torch.bfloat16).requires_grad_()
               for _ in range(3))  # fmt: skip
    slopes = torch.rand(2, generator=g).requires_grad_()
    torch.library.opcheck(op.torch_op, (q, k, v, 0.125, slopes))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(q, k, v, s):
        return op.torch_op(q, k, v, 0.125, s)[0].float().sum()

    f(q, k, v, slopes).backward()
    compiled = slopes.grad.clone()
    slopes.grad = None
    op.torch_op(q, k, v, 0.125, slopes)[0].float().sum().backward()
    assert compiled.abs().max() > 0
    torch.testing.assert_close(compiled, slopes.grad)
