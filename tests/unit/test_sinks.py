"""Attention sinks in the language (issue 37): ``sink: sinks[h]`` joins every row's softmax
denominator and nothing else; lse is of the keys alone; partial results merge without the
sink and take it once.  CPU op against the float64 reference built from the same IR,
gradcheck in float64 on the op, the varlen, decode and merge paths."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import flashgen
from flashgen.frontend.errors import SpecError
from flashgen.frontend.spec import loads_spec
from flashgen.ops.cpu.reference import attention_reference, attention_reference_varlen
from flashgen.ops.op import build_op
from flashgen.ops.sink import apply_sink

REPO = Path(__file__).resolve().parents[2]
F64 = torch.float64


def _spec(name, sink, params="  sinks: {type: f32, shape: [num_heads]}", mask="causal",
          score_mod="null", varlen=False):  # fmt: skip
    return loads_spec(
        f"name: {name}\nhead_dim: 32\ndtype: bf16\nmask: {mask}\nscore_mod: {score_mod}\n"
        f"sink: {sink}\nvarlen: {str(varlen).lower()}\nparams:\n{params}\n",
        f"{name}.yaml",
    )


def _qkv(b=2, hq=4, hkv=2, sq=5, sk=7, d=32, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(b, h, s, d, dtype=F64, generator=g).to(dtype)
        for h, s in ((hq, sq), (hkv, sk), (hkv, sk))
    )


@pytest.mark.parametrize(
    ("text", "where", "match"),
    [
        ("sinks[h] + q_idx", (6, 18), "sink may read only b, h, h_kv and params.*not 'q_idx'"),
        ("sinks[kv_idx]", (6, 13), "not 'kv_idx'"),
        ("score", (6, 7), "'score' is only available in score_mod"),
        ("sinks[h] > 0.0", (6, 7), "sink must be a number"),
        ("sinkz[h]", (6, 7), "unknown identifier 'sinkz'"),
    ],
)
def test_a_bad_sink_is_a_spec_error_at_its_file_line_and_column(text, where, match):
    with pytest.raises(SpecError, match=match) as e:
        _spec("bad_sink", text)
    assert str(e.value).startswith(f"bad_sink.yaml:{where[0]}:{where[1]}:")


@pytest.mark.parametrize(
    ("sink", "params"),
    [
        ("sinks[h]", "  sinks: {type: f32, shape: [num_heads]}"),
        ("sinks[b, h]", "  sinks: {type: f32, shape: [batch, num_heads]}"),
        ("s0 + sinks[h_kv]", "  sinks: {type: f32, shape: [num_heads_kv]}\n"
                             "  s0: {type: f32, default: 0.5}"),
    ],
    ids=["per_head", "per_batch_head", "per_kv_head_and_scalar"],
)
def test_cpu_op_matches_the_float64_reference_and_lse_is_of_the_keys_alone(sink, params):
    spec = _spec("sk_" + str(abs(hash(sink)) % 10**6), sink, params)
    op = build_op(spec)
    q, k, v = _qkv(sq=17, sk=9)  # Sq > Sk under a bottom-right causal mask: 8 empty rows
    g = torch.Generator().manual_seed(3)
    shape = {"sinks[h]": (4,), "sinks[b, h]": (2, 4)}.get(sink, (2,))
    sinks = torch.randn(shape, dtype=F64, generator=g) * 2
    o, lse = op.attention(q, k, v, sinks=sinks)
    ro, rl = attention_reference(spec, q, k, v, params={"sinks": sinks})
    torch.testing.assert_close(o, ro)
    torch.testing.assert_close(lse, rl)
    # lse of the keys alone: the same spec without the sink
    _, keys_lse = op.attention(q, k, v, apply_sink=False, sinks=sinks)
    _, keys_ref = attention_reference(replace(spec, sink=None), q, k, v, params={"sinks": sinks})
    torch.testing.assert_close(lse, keys_lse)
    torch.testing.assert_close(lse, keys_ref)
    assert bool((o[:, :, :8] == 0).all()) and bool((lse[:, :, :8] == -math.inf).all())
    # the sink takes mass: every kept row's weights sum below 1
    ones = torch.ones_like(v)
    o1, _ = op.attention(q, k, ones, sinks=sinks)
    assert bool((o1[:, :, 8:] < 1).all()) and bool((o1[:, :, 8:] > 0).all())


def test_sink_in_float32_bf16_inputs_matches_the_reference():
    op = flashgen.load(REPO / "specs" / "gpt_oss_sink.yaml")
    q, k, v = _qkv(b=1, hq=8, hkv=2, sq=127, sk=1000, d=64, dtype=torch.bfloat16)
    sinks = torch.linspace(-2, 3, 8)
    o, lse = op.attention(q, k, v, sinks=sinks)
    ro, rl = attention_reference(op.spec, q, k, v, params={"sinks": sinks})
    assert (o.double() - ro).abs().max() < 2e-2
    torch.testing.assert_close(lse.double(), rl, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("sq,sk", [(5, 7), (1, 17), (17, 1)])
def test_gradcheck_of_the_sink_and_a_score_mod_param_on_the_op(sq, sk):
    spec = _spec("sk_grad", "sinks[h] * w", params="  sinks: {type: f32, shape: [num_heads]}\n"
                 "  w: {type: f32, default: 1.0}\n  t: {type: f32, shape: [num_heads]}",
                 score_mod="score * t[h]")  # fmt: skip
    op = build_op(spec)
    q, k, v = (x.requires_grad_() for x in _qkv(sq=sq, sk=sk))
    g = torch.Generator().manual_seed(1)
    sinks = torch.randn(4, dtype=F64, generator=g).requires_grad_()
    t = (torch.rand(4, dtype=F64, generator=g) + 0.5).requires_grad_()
    w = torch.tensor(0.8, dtype=F64, requires_grad=True)

    def f(q, k, v, sinks, t, w):
        o, lse = op.attention(q, k, v, sinks=sinks, t=t, w=w)
        return o, torch.where(torch.isfinite(lse), lse, 0.0)

    assert torch.autograd.gradcheck(f, (q, k, v, sinks, t, w), fast_mode=True)


def test_dsink_is_minus_the_row_sum_of_p_sink_times_rowsum_do_o():
    op = flashgen.load(REPO / "specs" / "gpt_oss_sink.yaml")
    q, k, v = _qkv(b=2, hq=4, hkv=2, sq=9, sk=9, d=64)
    sinks = torch.randn(4, dtype=F64).requires_grad_()
    o, lse = op.attention(q, k, v, sinks=sinks)
    do = torch.randn_like(o)
    (o * do).sum().backward()
    p_sink = torch.sigmoid(sinks.detach().view(1, 4, 1) - lse.detach())
    want = -(p_sink * (do * o.detach()).sum(-1)).sum(dim=(0, 2))
    torch.testing.assert_close(sinks.grad, want)


def test_varlen_sink_per_sequence_and_head_matches_the_reference():
    spec = _spec("sk_varlen", "sinks[b, h]", "  sinks: {type: f32, shape: [batch, num_heads]}",
                 varlen=True)  # fmt: skip
    op = build_op(spec)
    g = torch.Generator().manual_seed(0)
    cq = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    ck = torch.tensor([0, 4, 6, 13], dtype=torch.int32)
    q = torch.randn(8, 4, 32, dtype=F64, generator=g).requires_grad_()
    k = torch.randn(13, 2, 32, dtype=F64, generator=g).requires_grad_()
    v = torch.randn(13, 2, 32, dtype=F64, generator=g).requires_grad_()
    sinks = torch.randn(3, 4, dtype=F64, generator=g).requires_grad_()
    o, lse = op(q, k, v, cq, ck, 5, 7, sinks=sinks)
    ro, rl = attention_reference_varlen(spec, q, k, v, cq, ck, params={"sinks": sinks})
    torch.testing.assert_close(o, ro)
    torch.testing.assert_close(lse, rl)

    def f(q, k, v, sinks):
        o, lse = op(q, k, v, cq, ck, 5, 7, sinks=sinks)
        return o, torch.where(torch.isfinite(lse), lse, 0.0)

    assert torch.autograd.gradcheck(f, (q, k, v, sinks), fast_mode=True)


def test_partials_merge_without_the_sink_and_take_it_once():
    """Split-KV by hand: two key halves over the keys alone (apply_sink=False), merged with
    merge_attention, then the sink once: the whole call's o and lse."""
    op = flashgen.load(REPO / "specs" / "gpt_oss_sink.yaml")
    q, k, v = _qkv(b=1, hq=4, hkv=2, sq=6, sk=6, d=64, dtype=torch.float32)
    sinks = torch.randn(4)
    o, lse = op.attention(q, k, v, sinks=sinks)
    full = op.offsets  # global positions for the key halves
    parts = [
        full.attention(q, k[:, :, a:b], v[:, :, a:b], kv_offset=a, seqlen_k_global=6,
                       apply_sink=False, sinks=sinks)
        for a, b in ((0, 3), (3, 6))
    ]  # fmt: skip
    mo, ml = flashgen.merge_attention(*parts[0], *parts[1])
    torch.testing.assert_close(ml, lse)
    torch.testing.assert_close(apply_sink(mo, ml, sinks.view(1, 4, 1)), o)
    assert not torch.allclose(mo, o)  # the sink does change o


def test_decode_applies_the_sink_once_after_the_splits():
    op = flashgen.load(REPO / "specs" / "gpt_oss_sink.yaml")
    g = torch.Generator().manual_seed(0)
    lens = [0, 5, 40]
    kc = torch.randn(3, 2, 48, 64, generator=g).to(torch.bfloat16)
    vc = torch.randn(3, 2, 48, 64, generator=g).to(torch.bfloat16)
    q = torch.randn(3, 8, 1, 64, generator=g).to(torch.bfloat16)
    sinks = torch.randn(8, generator=g)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    for splits in (1, 3):
        o, lse = op.with_kvcache(q, kc, vc, lens_t, num_splits=splits, sinks=sinks)
        for b, n in enumerate(lens):
            if n == 0:
                assert bool((o[b] == 0).all())
                continue
            po, pl = op.attention(q[b : b + 1], kc[b : b + 1, :, :n], vc[b : b + 1, :, :n],
                                  sinks=sinks)  # fmt: skip
            torch.testing.assert_close(o[b : b + 1], po, atol=1e-2, rtol=1e-2)
            torch.testing.assert_close(lse[b : b + 1], pl, atol=1e-4, rtol=1e-4)


def test_apply_sink_must_be_a_bool():
    op = flashgen.load(REPO / "specs" / "gpt_oss_sink.yaml")
    q, k, v = _qkv(b=1, hq=2, hkv=2, sq=2, sk=2, d=64, dtype=torch.float32)
    with pytest.raises(flashgen.OpInputError, match="apply_sink"):
        op.attention(q, k, v, apply_sink=1, sinks=torch.zeros(2))


def test_sink_under_torch_compile_fullgraph_matches_eager():
    op = flashgen.load(REPO / "specs" / "gpt_oss_sink.yaml")
    q, k, v = (t.requires_grad_() for t in _qkv(b=1, hq=2, hkv=2, sq=5, sk=5, d=64,
                                                dtype=torch.bfloat16))  # fmt: skip
    sinks = torch.randn(2).requires_grad_()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(q, k, v, s):
        return op.attention(q, k, v, sinks=s)[0].float().sum()

    f(q, k, v, sinks).backward()
    compiled = sinks.grad.clone()
    sinks.grad = None
    op.attention(q, k, v, sinks=sinks)[0].float().sum().backward()
    assert compiled.abs().max() > 0
    torch.testing.assert_close(compiled, sinks.grad)


def test_sink_with_out_checks_it_and_writes_the_sunk_o():
    op = flashgen.load(REPO / "specs" / "gpt_oss_sink.yaml")
    q, k, v = _qkv(b=1, hq=2, hkv=2, sq=3, sk=4, d=64, dtype=torch.float32)
    sinks = torch.ones(2)
    want, _ = op.attention(q, k, v, sinks=sinks)
    for grad in (False, True):
        qg = q.clone().requires_grad_(grad)
        with pytest.raises(flashgen.OpInputError, match="out: expected shape"):
            op.attention(qg, k, v, sinks=sinks, out=torch.empty(1, 2, 3, 32))
        out = torch.empty(1, 3, 2, 64).transpose(1, 2)  # (B, S, H, D) storage
        o, _ = op.attention(qg, k, v, sinks=sinks, out=out)
        assert o is out
        torch.testing.assert_close(out, want)


@pytest.mark.parametrize(
    ("subs", "shape"), [("h", (4,)), ("h_kv", (2,)), ("b, h", (3, 4)), ("b, h_kv", (3, 2))]
)
def test_a_direct_sink_read_equals_the_evaluated_expression(subs, shape):
    """sink_logits reads sinks[h] (and the other direct forms) as a view of the tensor; the
    same values as the evaluator gives for sinks[...] * 1.0, gradients included."""
    from flashgen.ops.sink import sink_logits

    decl = {"h": "[num_heads]", "h_kv": "[num_heads_kv]", "b, h": "[batch, num_heads]",
            "b, h_kv": "[batch, num_heads_kv]"}[subs]  # fmt: skip
    params = f"  sinks: {{type: f32, shape: {decl}}}"
    direct = _spec("sd", f"sinks[{subs}]", params)
    evaluated = _spec("se", f"sinks[{subs}] * 1.0", params)
    t = torch.randn(shape, dtype=F64).requires_grad_()
    kw = dict(batch=3, heads_q=4, heads_kv=2, device="cpu", dtype=F64)
    a = sink_logits(direct, {"sinks": t}, **kw)
    b = sink_logits(evaluated, {"sinks": t}, **kw)
    torch.testing.assert_close(a, b)
    (ga,) = torch.autograd.grad(a.sum(), t)
    (gb,) = torch.autograd.grad(b.sum(), t)
    torch.testing.assert_close(ga, gb)


def test_apply_sink_takes_the_params_own_shape_whatever_the_row_count():
    """``apply_sink(o, lse, sinks)`` with the sink param's ``[H]`` (or ``[B, H]``) is one
    logit per head for every row, also when the row count equals H (it broadcast along the
    rows there once); other shapes raise naming ``sink``."""
    from flashgen.frontend.errors import OpInputError

    gen = torch.Generator().manual_seed(3)
    for sq in (4, 7):
        o = torch.randn(2, 4, sq, 8, generator=gen)
        lse = torch.randn(2, 4, sq, generator=gen)
        sinks = torch.randn(4, generator=gen)
        want = apply_sink(o, lse, sinks.view(1, 4, 1))
        torch.testing.assert_close(apply_sink(o, lse, sinks), want)
        torch.testing.assert_close(apply_sink(o, lse, sinks.expand(2, 4)), want)
        with pytest.raises(OpInputError, match="sink: expected one logit per head"):
            apply_sink(o, lse, torch.randn(3))


def test_apply_sink_refuses_an_integer_tensor_naming_it():
    """An int32 sink (a logit rounded by mistake, or an index tensor passed in its place) was
    taken and cast: it must be a float like the scores it joins."""
    from flashgen.frontend.errors import OpInputError

    o, lse = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5)
    with pytest.raises(OpInputError, match=r"sink: expected a floating-point tensor .* got "
                       r"dtype torch\.int32"):  # fmt: skip
        apply_sink(o, lse, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(OpInputError, match=r"lse: expected a floating-point tensor"):
        apply_sink(o, lse.to(torch.int64), torch.zeros(4))


def test_apply_sink_refuses_an_o_and_lse_that_do_not_pair_naming_them():
    """``apply_sink`` checked only the sink's shape: a varlen result as the op returns it (o
    ``[total_q, H, Dv]``, lse ``[H, total_q]``) died in torch's broadcast ("The size of tensor
    a (4) must match ..."), an o of another rank broadcast silently into a bigger result, and
    a list or None for o or sink raised AttributeError from inside."""
    from flashgen.frontend.errors import OpInputError

    gen = torch.Generator().manual_seed(4)
    o = torch.randn(10, 4, 8, generator=gen)  # varlen: [total_q, H, Dv]
    lse = torch.randn(4, 10, generator=gen)  # [H, total_q]
    sinks = torch.randn(4, 1, generator=gen)
    with pytest.raises(OpInputError, match=r"lse: expected shape \[10, 4\] \(o's without its "
                       r"last dim\), got \[4, 10\].*o\.transpose\(0, 1\)"):  # fmt: skip
        apply_sink(o, lse, sinks)
    torch.testing.assert_close(  # the varlen layout, transposed as the docstring says
        apply_sink(o.transpose(0, 1), lse, sinks).transpose(0, 1),
        o * torch.sigmoid(lse - sinks).transpose(0, 1).unsqueeze(-1),
    )
    with pytest.raises(OpInputError, match=r"lse: expected shape \[2, 4, 5\]"):
        apply_sink(torch.randn(2, 4, 5, 8), torch.randn(1, 4, 5), torch.randn(4))
    for args, name, got in (
        (([0.0], lse, sinks), "o", "list"),
        ((o.transpose(0, 1), None, sinks), "lse", "NoneType"),
        ((o.transpose(0, 1), lse, [0.0] * 4), "sink", "list"),
    ):
        with pytest.raises(OpInputError, match=rf"{name}: expected a torch.Tensor.*got {got}"):
            apply_sink(*args)
