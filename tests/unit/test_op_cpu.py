"""The torch op on CPU: reference semantics, input validation, torch.library integration."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashgen
from flashgen import OpInputError
from flashgen.bench.verify import random_tensor_params
from flashgen.frontend.spec import load_spec
from flashgen.ops.cpu.reference import attention_reference
from flashgen.ops.op import build_op, out_dtype, schema

REPO = Path(__file__).resolve().parents[2]
#: the shipped specs with a prefill (v_from_k specs are decode only: tests/unit/test_decode_mla.py)
SPECS = [p for p in sorted((REPO / "specs").glob("*.yaml")) if not load_spec(p).v_from_k]
DT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}


def inputs(spec, b=2, hq=4, hkv=2, sq=33, sk=47, seed=0):
    g = torch.Generator().manual_seed(seed)
    dt = DT[spec.dtype]
    q = torch.randn(b, hq, sq, spec.head_dim, generator=g).to(dt)
    k = torch.randn(b, hkv, sk, spec.head_dim, generator=g).to(dt)
    v = torch.randn(b, hkv, sk, spec.head_dim_v, generator=g).to(dt)
    sym = {"batch": b, "num_heads": hq, "num_heads_kv": hkv, "seqlen_q": sq, "seqlen_k": sk}
    return q, k, v, random_tensor_params(spec, sym, "cpu", g)


@pytest.fixture(scope="module")
def ops():
    return {p.stem: flashgen.load(p) for p in SPECS}


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_cpu_op_matches_reference(ops, path):
    op = ops[path.stem]
    spec = op.spec
    q, k, v, params = inputs(spec, hq=8, hkv=2, sq=40, sk=29)  # GQA 8/2, Sq > Sk
    o, lse = op.attention(q, k, v, **params)  # fp8: e4m3 inputs with descales 1
    out = out_dtype(spec)  # the input dtype, bf16 for fp8
    assert o.shape == (2, 8, 40, spec.head_dim_v) and o.dtype == out and o.is_contiguous()
    assert lse.shape == (2, 8, 40) and lse.dtype == torch.float32
    ref_o, ref_lse = attention_reference(spec, q, k, v, params=params, compute_dtype=torch.float32)
    # the blocked CPU path (cpu_attention) rounds differently from the materialized one
    torch.testing.assert_close(o, ref_o.to(out))
    torch.testing.assert_close(lse, ref_lse)
    ref64, _ = attention_reference(spec, q, k, v, params=params)
    assert (o.double() - ref64).abs().max() < 2e-2


def test_alibi_slopes_and_scalar_params_are_used(ops):
    op = ops["alibi"]
    q, k, v, params = inputs(op.spec)
    o1, _ = op.attention(q, k, v, slopes=params["slopes"])
    o2, _ = op.attention(q, k, v, slopes=params["slopes"] * 4)
    assert not torch.equal(o1, o2)
    swa = ops["mistral_swa"]
    q, k, v, _ = inputs(swa.spec, sq=64, sk=64)
    w4, _ = swa.attention(q, k, v, window=4)
    wdef, _ = swa.attention(q, k, v)
    ref, _ = attention_reference(
        swa.spec, q, k, v, params={"window": 4}, compute_dtype=torch.float32
    )
    torch.testing.assert_close(w4, ref.to(q.dtype))
    assert not torch.equal(w4, wdef)


def test_softmax_scale_and_strided_views(ops):
    op = ops["causal_d128"]
    g = torch.Generator().manual_seed(1)
    # (B, S, H, D) storage viewed as (B, H, S, D): no copy needed
    qs = torch.randn(2, 33, 4, 128, generator=g).bfloat16()
    ks = torch.randn(2, 40, 2, 128, generator=g).bfloat16()
    vs = torch.randn(2, 40, 2, 128, generator=g).bfloat16()
    q, k, v = (t.transpose(1, 2) for t in (qs, ks, vs))
    o, lse = op.attention(q, k, v, softmax_scale=0.05)
    o2, lse2 = op.attention(q.contiguous(), k.contiguous(), v.contiguous(), softmax_scale=0.05)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    o3, _ = op.attention(q, k, v)
    assert not torch.equal(o, o3)
    # stride 0 in the batch dimension (a broadcast k/v) is fine
    kb, vb = k[:1].expand(2, -1, -1, -1), v[:1].expand(2, -1, -1, -1)
    o4, _ = op.attention(q, kb, vb)
    o5, _ = op.attention(q, kb.contiguous(), vb.contiguous())
    assert torch.equal(o4, o5)


def test_empty_problems(ops):
    op = ops["causal_d128"]
    q, k, v, _ = inputs(op.spec)
    o, lse = op.attention(q[:0], k[:0], v[:0])
    assert o.shape == (0, 4, 33, 128) and lse.shape == (0, 4, 33)
    o, lse = op.attention(q[:, :, :0], k, v)
    assert o.shape == (2, 4, 0, 128) and lse.shape == (2, 4, 0)
    o, lse = op.attention(q, k[:, :, :0], v[:, :, :0])
    assert o.shape == (2, 4, 33, 128) and torch.equal(o, torch.zeros_like(o))
    assert torch.isneginf(lse).all()


def test_fully_masked_rows_give_zero_and_neg_inf(ops):
    op = ops["causal_d128"]
    q, k, v, _ = inputs(op.spec, sq=10, sk=4)  # bottom-right causal: first 6 rows see nothing
    o, lse = op.attention(q, k, v)
    assert torch.isneginf(lse[:, :, :6]).all() and (o[:, :, :6] == 0).all()
    assert torch.isfinite(lse[:, :, 6:]).all()


@pytest.mark.parametrize(
    "mutate, match",
    [
        (
            lambda q, k, v, p: (q.half(), k, v, p),
            r"q: expected dtype torch.bfloat16.*got torch.float16",
        ),
        (lambda q, k, v, p: (q, k.float(), v, p), r"k: expected dtype"),
        (lambda q, k, v, p: (q[0], k, v, p), r"q: expected a 4-D tensor.*got shape \[4, 33, 128\]"),
        (lambda q, k, v, p: (q[..., :64], k, v, p), r"q: expected head_dim 128.*got 64"),
        (lambda q, k, v, p: (q, k[..., :64], v, p), r"k: expected head_dim 128.*got 64"),
        (lambda q, k, v, p: (q, k, v[..., :64], p), r"v: expected head_dim_v 128.*got 64"),
        (lambda q, k, v, p: (q, k, v[:, :, :5], p), r"v: expected \[batch, heads_kv, seqlen_k\]"),
        (lambda q, k, v, p: (q, k[:1], v[:1], p), r"k: expected batch 2.*got 1"),
        (
            lambda q, k, v, p: (q[:, :3], k, v, p),
            r"q: expected num_heads to be a multiple of .* 2, got 3",
        ),
        (lambda q, k, v, p: (q, k.to("meta"), v, p), r"k: expected device cpu.*got meta"),
        (
            lambda q, k, v, p: (q.transpose(2, 3).contiguous().transpose(2, 3), k, v, p),
            r"q: expected stride\(-1\) == 1",
        ),
        (lambda q, k, v, p: (q, k, v, {}), r"slopes: missing tensor param"),
        (
            lambda q, k, v, p: (q, k, v, {"slopes": torch.rand(3)}),
            r"slopes: expected shape \[4\].*got \[3\]",
        ),
        (
            lambda q, k, v, p: (q, k, v, {**p, "slope": 1.0}),
            r"slope: unknown param.*valid params: slopes",
        ),
    ],
)
def test_validation_errors_name_the_argument(ops, mutate, match):
    op = ops["alibi"]
    q, k, v, params = mutate(*inputs(op.spec))
    with pytest.raises(OpInputError, match=match):
        op.attention(q, k, v, **params)


def test_scalar_param_type_errors(ops):
    op = ops["mistral_swa"]
    q, k, v, _ = inputs(op.spec)
    with pytest.raises(OpInputError, match="window: expected an int"):
        op.attention(q, k, v, window=2.5)
    with pytest.raises(OpInputError, match="softmax_scale: expected a float"):
        op.attention(q, k, v, softmax_scale="big")
    with pytest.raises(OpInputError, match="valid params: window"):
        op.attention(q, k, v, windw=3)


def test_impl_validates_too(ops):
    op = ops["causal_d128"]
    q, k, v, _ = inputs(op.spec)
    with pytest.raises(OpInputError, match="q: expected dtype"):
        torch.ops.flashgen.causal_d128(q.half(), k, v, 0.1)


def test_schema_and_registry():
    spec = load_spec(REPO / "specs" / "alibi.yaml")
    assert schema(spec) == (
        "alibi(Tensor q, Tensor k, Tensor v, float softmax_scale, Tensor slopes, "
        "*, bool deterministic=False) -> (Tensor, Tensor)"
    )
    swa = load_spec(REPO / "specs" / "mistral_swa.yaml")
    assert "float softmax_scale, int window, *, bool deterministic=False)" in schema(swa)
    # same spec twice (even from another path): same op, no error
    assert build_op(spec) is build_op(dataclasses.replace(spec, path="elsewhere.yaml"))
    # a different spec under a registered name is refused
    with pytest.raises(ValueError, match="already registered"):
        build_op(dataclasses.replace(spec, head_dim=64, head_dim_v=64))


def test_opcheck(ops):
    for name in ("causal_d128", "alibi", "mistral_swa"):
        op = ops[name]
        q, k, v, params = inputs(op.spec, b=1, hq=2, hkv=1, sq=9, sk=12)
        scalars = [p.default for p in op.spec.scalar_params]
        tensors = [params[p.name] for p in op.spec.tensor_params]
        torch.library.opcheck(op.torch_op, (q, k, v, 0.1, *scalars, *tensors))


def test_torch_compile_fullgraph(ops):
    op = ops["alibi"]
    q, k, v, params = inputs(op.spec)

    def f(q, k, v, slopes):
        o, lse = op.attention(q, k, v, slopes=slopes)
        return o.float().sum(-1) + lse

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, params["slopes"]), f(q, k, v, params["slopes"]))


def test_load_is_cached_and_import_needs_no_torch():
    a = flashgen.load(REPO / "specs" / "gpt2_d64.yaml")
    assert flashgen.load(str(REPO / "specs" / "gpt2_d64.yaml")) is a
    assert a.spec.name == "gpt2_d64" and math.isclose(
        flashgen.ops.op.default_softmax_scale(a.spec), 1 / 8
    )
    code = "import sys, flashgen; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_torch_compile_with_changing_float_scalars_and_varlen():
    """A float param or softmax_scale that changes between calls becomes symbolic under
    torch.compile: the op must trace (its impls check the real value); op.varlen must work
    inside a compiled function (it is registered with the op, not on first access)."""
    op = flashgen.load(REPO / "specs" / "gemma2_softcap.yaml")
    q = torch.randn(1, 2, 33, 256, dtype=torch.bfloat16)
    f = torch.compile(lambda q, s: op.attention(q, q, q, softcap=s)[0], fullgraph=True)
    g = torch.compile(lambda q, sc: op.attention(q, q, q, softmax_scale=sc)[0], fullgraph=True)
    for s in (30.0, 40.0, 50.0):
        assert torch.equal(f(q, s), op.attention(q, q, q, softcap=s)[0])
    for sc in (0.1, 0.2):
        assert torch.equal(g(q, sc), op.attention(q, q, q, softmax_scale=sc)[0])
    with pytest.raises(OpInputError, match="softcap"):
        f(q, math.inf)  # still refused: by the CPU implementation
    plain = flashgen.load(REPO / "specs" / "causal_d128.yaml")
    qp = torch.randn(10, 2, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    h = torch.compile(lambda q: plain.varlen(q, q, q, cu, cu, 6, 6)[0], fullgraph=True)
    assert torch.equal(h(qp), plain.varlen(qp, qp, qp, cu, cu, 6, 6)[0])


FUSED_MASKS = {
    "causal": "causal",  # chunks FULL up to their diagonal
    "window": "causal && q_idx + seqlen_k - seqlen_q - kv_idx < 100",  # a band, empty blocks
    "per_head": "h % 2 == 0 || kv_idx < q_idx",  # the mask differs by head: per-head bias
    "none": "null",
}


@pytest.mark.parametrize("mask", FUSED_MASKS, ids=str)
def test_fused_cpu_path_forward_and_backward_match_float64(mask):
    """Specs without a score_mod run torch's fused CPU kernels per query chunk
    (flashgen/ops/cpu/attention.py): several chunks, GQA 4/2, Sq > Sk (rows with no key),
    forward and backward against the float64 materialized reference."""
    spec = flashgen.loads_spec(
        f"name: fused_{mask}\nhead_dim: 64\ndtype: bf16\nmask: {FUSED_MASKS[mask]}\n"
    )
    op = build_op(spec)
    g = torch.Generator().manual_seed(7)
    sq, sk = 1100, 1000  # more query rows than one chunk holds
    q = torch.randn(1, 4, sq, 64, generator=g, requires_grad=True)
    k = torch.randn(1, 2, sk, 64, generator=g, requires_grad=True)
    v = torch.randn(1, 2, sk, 64, generator=g, requires_grad=True)
    o, lse = op.attention(q, k, v)
    do = torch.randn(o.shape, generator=g)
    o.backward(do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_o, ref_lse = attention_reference(spec, q64, k64, v64)
    ref_o.backward(do.double())
    torch.testing.assert_close(o.double(), ref_o, atol=2e-5, rtol=2e-5)
    live = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), live)
    torch.testing.assert_close(lse.double()[live], ref_lse[live], atol=2e-5, rtol=2e-5)
    for ours, ref in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        torch.testing.assert_close(ours.double(), ref, atol=5e-5, rtol=5e-5)
