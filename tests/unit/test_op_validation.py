"""Op input validation: every bad input is a clear OpInputError before any computation.

Each bad input is tried through three doors: ``op.attention`` (the user entry point),
``torch.ops.flashgen.<name>`` called directly on CPU (the CPU impl validates itself), and
meta tensors (the fake impl, what ``torch.compile`` traces).  The message must name the
argument and carry "expected ... got ...".  The CPU reference is replaced by a tripwire,
so an error that only surfaced inside the computation would fail the test.

Also: stride-0 (expanded) k/v along batch, heads or sequence give the same result as
their contiguous copies, and FakeTensorMode shapes.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flashgen
from flashgen import OpInputError
from flashgen.ops.cpu import reference as reference_mod
from flashgen.ops.cpu.reference import attention_reference

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ops():
    return {
        n: flashgen.load(REPO / "specs" / f"{n}.yaml")
        for n in ("alibi", "mistral_swa", "gemma2_softcap", "causal_d128")
    }


def make(spec, b=2, hq=4, hkv=2, sq=9, sk=11, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[spec.dtype]
    q = torch.randn(b, hq, sq, spec.head_dim, generator=g).to(dt).to(device)
    k = torch.randn(b, hkv, sk, spec.head_dim, generator=g).to(dt).to(device)
    v = torch.randn(b, hkv, sk, spec.head_dim_v, generator=g).to(dt).to(device)
    params = {}
    if spec.param("slopes") is not None:
        params["slopes"] = torch.rand(hq, generator=g).to(device)
    return q, k, v, params


@pytest.fixture
def tripwire(monkeypatch):
    """Fail if the CPU impl gets as far as computing attention."""

    def boom(*a, **kw):
        raise AssertionError("attention was computed before the inputs were validated")

    monkeypatch.setattr(reference_mod, "attention_reference", boom)


def _noncontig_last(t):
    return t.transpose(2, 3).contiguous().transpose(2, 3)


# (id, mutate(q, k, v, params) -> (q, k, v, params), regex the message must match)
TENSOR_CASES = [
    ("q_dtype", lambda q, k, v, p: (q.half(), k, v, p), r"^q: expected dtype torch.bfloat16"),
    ("k_dtype", lambda q, k, v, p: (q, k.float(), v, p), r"^k: expected dtype .*got torch.float32"),
    ("v_dtype", lambda q, k, v, p: (q, k, v.half(), p), r"^v: expected dtype .*got torch.float16"),
    ("q_rank3", lambda q, k, v, p: (q[0], k, v, p), r"^q: expected a 4-D tensor.*got shape"),
    ("k_rank5", lambda q, k, v, p: (q, k[None], v, p), r"^k: expected a 4-D tensor.*got shape"),
    ("v_rank2", lambda q, k, v, p: (q, k, v[0, 0], p), r"^v: expected a 4-D tensor"),
    ("q_not_tensor", lambda q, k, v, p: (q.tolist(), k, v, p), r"^q: expected a torch.Tensor"),
    ("q_head_dim", lambda q, k, v, p: (q[..., :64], k, v, p), r"^q: expected head_dim 128.*got 64"),
    ("k_head_dim", lambda q, k, v, p: (q, k[..., :64], v, p), r"^k: expected head_dim 128.*got 64"),
    (
        "v_head_dim",
        lambda q, k, v, p: (q, k, v[..., :64], p),
        r"^v: expected head_dim_v 128.*got 64",
    ),
    (
        "q_stride",
        lambda q, k, v, p: (_noncontig_last(q), k, v, p),
        r"^q: expected stride\(-1\) == 1.*got strides",
    ),
    ("k_stride", lambda q, k, v, p: (q, _noncontig_last(k), v, p), r"^k: expected stride\(-1\)"),
    ("v_stride", lambda q, k, v, p: (q, k, _noncontig_last(v), p), r"^v: expected stride\(-1\)"),
    (
        "k_expanded_along_d",
        lambda q, k, v, p: (q, k[..., :1].expand(-1, -1, -1, 128), v, p),
        r"^k: expected stride\(-1\) == 1",
    ),
    (
        "hq_not_multiple",
        lambda q, k, v, p: (q[:, :3], k, v, {"slopes": p["slopes"][:3]}),
        r"^q: expected num_heads to be a multiple of .*2, got 3",
    ),
    (
        "v_length",
        lambda q, k, v, p: (q, k, v[:, :, :5], p),
        r"^v: expected \[batch, heads_kv, seqlen_k\] = \[2, 2, 11\].*got \[2, 2, 5\]",
    ),
    (
        "v_heads",
        lambda q, k, v, p: (q, k, v[:, :1], p),
        r"^v: expected \[batch, heads_kv, seqlen_k\]",
    ),
    ("k_batch", lambda q, k, v, p: (q, k[:1], v[:1], p), r"^k: expected batch 2.*got 1"),
    ("v_batch", lambda q, k, v, p: (q, k, v[:1], p), r"^v: expected \[batch, heads_kv"),
    ("zero_kv_heads", lambda q, k, v, p: (q, k[:, :0], v[:, :0], p), r"^k: expected at least one"),
    (
        "k_device",
        lambda q, k, v, p: (q, k.to("meta"), v, p),
        r"^k: expected device cpu.*got meta",
    ),
    ("v_device", lambda q, k, v, p: (q, k, v.to("meta"), p), r"^v: expected device cpu.*got meta"),
    ("param_missing", lambda q, k, v, p: (q, k, v, {}), r"^slopes: missing tensor param"),
    (
        "param_shape",
        lambda q, k, v, p: (q, k, v, {"slopes": torch.rand(3)}),
        r"^slopes: expected shape \[4\] \(\[num_heads\]\), got \[3\]",
    ),
    (
        "param_rank",
        lambda q, k, v, p: (q, k, v, {"slopes": torch.rand(1, 4)}),
        r"^slopes: expected shape \[4\].*got \[1, 4\]",
    ),
    (
        "param_int_dtype",
        lambda q, k, v, p: (q, k, v, {"slopes": torch.ones(4, dtype=torch.int32)}),
        r"^slopes: expected a floating-point tensor.*got torch.int32",
    ),
    (
        "param_bool_dtype",
        lambda q, k, v, p: (q, k, v, {"slopes": torch.ones(4, dtype=torch.bool)}),
        r"^slopes: expected a floating-point tensor.*got torch.bool",
    ),
    (
        "param_complex_dtype",
        lambda q, k, v, p: (q, k, v, {"slopes": torch.ones(4, dtype=torch.complex64)}),
        r"^slopes: expected a floating-point tensor",
    ),
    (
        "param_device",
        lambda q, k, v, p: (q, k, v, {"slopes": p["slopes"].to("meta")}),
        r"^slopes: expected device cpu.*got meta",
    ),
    (
        "param_not_tensor",
        lambda q, k, v, p: (q, k, v, {"slopes": [0.5] * 4}),
        r"^slopes: expected a torch.Tensor",
    ),
    (
        "unknown_kwarg",
        lambda q, k, v, p: (q, k, v, {**p, "slope": 1.0}),
        r"^slope: unknown param for op 'alibi'; valid params: slopes",
    ),
]

# cases the schema itself cannot express (not a tensor, unknown kwarg, missing tensor)
_ENTRY_ONLY = {"q_not_tensor", "param_not_tensor", "unknown_kwarg", "param_missing"}


@pytest.mark.parametrize("case", TENSOR_CASES, ids=[c[0] for c in TENSOR_CASES])
def test_bad_tensor_inputs_via_attention(ops, tripwire, case):
    _, mutate, match = case
    op = ops["alibi"]
    q, k, v, params = mutate(*make(op.spec))
    with pytest.raises(OpInputError, match=match):
        op.attention(q, k, v, **params)


@pytest.mark.parametrize(
    "case", [c for c in TENSOR_CASES if c[0] not in _ENTRY_ONLY], ids=lambda c: c[0]
)
def test_bad_tensor_inputs_via_cpu_impl(ops, tripwire, case):
    """torch.ops.flashgen.alibi(...) called directly: the CPU kernel validates first."""
    _, mutate, match = case
    op = ops["alibi"]
    q, k, v, params = mutate(*make(op.spec))
    with pytest.raises(OpInputError, match=match):
        op.torch_op(q, k, v, 0.125, params["slopes"])


@pytest.mark.parametrize(
    "case",
    [c for c in TENSOR_CASES if c[0] not in _ENTRY_ONLY and "device" not in c[0]],
    ids=lambda c: c[0],
)
def test_bad_tensor_inputs_via_meta(ops, case):
    """Meta tensors dispatch to the fake impl, which runs the same validation."""
    _, mutate, match = case
    op = ops["alibi"]
    q, k, v, params = mutate(*make(op.spec, device="meta"))
    params = {n: t.to("meta") for n, t in params.items()}
    with pytest.raises(OpInputError, match=match):
        op.torch_op(q, k, v, 0.125, params["slopes"])
    with pytest.raises(OpInputError, match=match):
        op.attention(q, k, v, **params)


class _OnDevice(torch.Tensor):
    """A tensor that claims another device (no backend needed): never dispatched."""

    @staticmethod
    def __new__(cls, shape, dtype, device):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise AssertionError(f"dispatched {func} before the device was checked")


def test_tensors_on_a_device_the_op_does_not_run_on_are_refused_naming_it(ops, tripwire):
    """``torch.empty(..., device="meta")`` (float32) was refused as a dtype problem ("float32 /
    float64 also on CPU"): float32 and float64 run on the CPU only, so a meta tensor of those
    is refused naming q and the device (a meta tensor of the spec's dtype still gives o and
    lse shapes: the fake kernel); a device the op has no kernel for (xpu, mps) is refused
    before dispatch.  op.attention, op.varlen and with_kvcache."""
    op = ops["alibi"]
    slopes = {"slopes": torch.rand(4, device="meta")}
    for dtype in (torch.float32, torch.float64):
        q = torch.empty(2, 4, 9, 128, device="meta", dtype=dtype)
        k = torch.empty(2, 2, 11, 128, device="meta", dtype=dtype)
        msg = (rf"^q: expected a CPU or CUDA tensor, got a {dtype} tensor on device 'meta' "
               rf"\({dtype} runs on the CPU only")  # fmt: skip
        with pytest.raises(OpInputError, match=msg):
            op.attention(q, k, k, **slopes)
        with pytest.raises(OpInputError, match=msg):
            op.varlen(q[0, 0], k[0, :, 0], k[0, :, 0], torch.zeros(2, dtype=torch.int32,
                      device="meta"), torch.zeros(2, dtype=torch.int32, device="meta"), 1, 1,
                      **slopes)  # fmt: skip
        lens = torch.zeros(2, dtype=torch.int32, device="meta")
        if dtype == torch.float32:  # decode takes float32 on the CPU, float64 nowhere
            with pytest.raises(OpInputError, match=msg):
                op.with_kvcache(q[:, :, :1], k, k, lens, **slopes)
    for device in ("xpu", "mps"):
        q = _OnDevice((2, 4, 9, 128), torch.bfloat16, device)
        k = _OnDevice((2, 2, 11, 128), torch.bfloat16, device)
        msg = rf"^q: expected a CPU or CUDA tensor, got a tensor on device '{device}'"
        with pytest.raises(OpInputError, match=msg):
            op.attention(q, k, k, slopes=_OnDevice((4,), torch.float32, device))


def _sparse_cases():
    q = torch.randn(2, 4, 3, 128).bfloat16()
    k = torch.randn(2, 2, 5, 128).bfloat16()
    s = torch.rand(4)
    kc = torch.randn(2, 2, 8, 128).bfloat16()
    lens = torch.tensor([3, 4], dtype=torch.int32)
    pq, pk = q[0].transpose(0, 1).contiguous(), k[0].transpose(0, 1).contiguous()
    cq, ck = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
    nested = torch.nested.nested_tensor(
        [torch.randn(4, 2, 128), torch.randn(4, 3, 128)], layout=torch.jagged
    ).bfloat16()
    return [  # (id, call, the argument named, its layout)
        ("q_coo", lambda op: op.attention(q.to_sparse(), k, k, slopes=s), "q", "sparse_coo"),
        ("q_coo_f32", lambda op: op.attention(q.float().to_sparse(), k.float(), k.float(),
                                              slopes=s), "q", "sparse_coo"),
        ("v_coo", lambda op: op.attention(q, k, k.to_sparse(), slopes=s), "v", "sparse_coo"),
        ("q_csr", lambda op: op.attention(q.float()[0, 0].to_sparse_csr(), k, k, slopes=s),
         "q", "sparse_csr"),
        ("q_nested", lambda op: op.attention(nested, nested, nested, slopes=s), "q", "jagged"),
        ("param_coo", lambda op: op.attention(q, k, k, slopes=s.to_sparse()),
         "slopes", "sparse_coo"),
        ("varlen_q_coo", lambda op: op.varlen(pq.to_sparse(), pk, pk, cq, ck, 3, 5, slopes=s),
         "q", "sparse_coo"),
        ("varlen_cu_coo", lambda op: op.varlen(pq, pk, pk, cq.to_sparse(), ck, 3, 5, slopes=s),
         "cu_seqlens_q", "sparse_coo"),
        ("decode_q_coo", lambda op: op.with_kvcache(q[:, :, :1].to_sparse(), kc, kc, lens,
                                                    slopes=s), "q", "sparse_coo"),
        ("decode_cache_coo", lambda op: op.with_kvcache(q[:, :, :1], kc, kc.to_sparse(), lens,
                                                        slopes=s), "v_cache", "sparse_coo"),
        ("decode_lens_coo", lambda op: op.with_kvcache(q[:, :, :1], kc, kc, lens.to_sparse(),
                                                       slopes=s), "cache_seqlens", "sparse_coo"),
        ("decode_param_coo", lambda op: op.with_kvcache(q[:, :, :1], kc, kc, lens,
                                                        slopes=s.to_sparse()),
         "slopes", "sparse_coo"),
    ]  # fmt: skip


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("case", _sparse_cases(), ids=lambda c: c[0])
def test_tensors_that_are_not_dense_are_refused_naming_the_layout(ops, tripwire, case):
    """A sparse q was refused as "expected stride(-1) == 1, got strides [0, 0, 0, 0]", a
    sparse tensor param or cu_seqlens reached the dispatcher (NotImplementedError: no
    'SparseCPU' kernel) and a nested (jagged) q passed the checks: every tensor argument must
    be dense (layout torch.strided), refused naming it and its layout."""
    _, call, name, layout = case
    msg = rf"^{name}: expected a dense tensor \(layout torch.strided\), got layout torch.{layout}"
    with pytest.raises(OpInputError, match=msg):
        call(ops["alibi"])


def test_meta_and_fake_tensor_shapes(ops):
    op = ops["alibi"]
    q, k, v, params = make(op.spec, hq=8, hkv=2, sq=7, sk=13, device="meta")
    o, lse = op.attention(q, k, v, **params)
    assert o.device.type == "meta" and o.shape == (2, 8, 7, 128) and lse.shape == (2, 8, 7)
    with FakeTensorMode():
        q = torch.empty(3, 4, 5, 128, dtype=torch.bfloat16)
        k = torch.empty(3, 1, 6, 128, dtype=torch.bfloat16)
        o, lse = op.attention(q, k, k, slopes=torch.empty(4))
        assert o.shape == (3, 4, 5, 128) and lse.dtype == torch.float32
        with pytest.raises(OpInputError, match=r"^slopes: expected shape \[4\]"):
            op.attention(q, k, k, slopes=torch.empty(5))


# ----------------------------------------------------------------------------- scalars
SCALAR_CASES = [
    ("gemma2_softcap", {"softcap": math.nan}, r"^softcap: expected a finite float.*nan"),
    ("gemma2_softcap", {"softcap": math.inf}, r"^softcap: expected a finite float.*inf"),
    ("gemma2_softcap", {"softcap": -math.inf}, r"^softcap: expected a finite float"),
    ("gemma2_softcap", {"softcap": 1e39}, r"^softcap: expected a float32 value.*out of"),
    ("gemma2_softcap", {"softcap": "50"}, r"^softcap: expected a float \(f32\), got '50'"),
    ("gemma2_softcap", {"softcap": True}, r"^softcap: expected a float \(f32\), got True"),
    ("mistral_swa", {"window": -1}, r"^window: expected a value >= 1 \(declared min\), got -1"),
    ("mistral_swa", {"window": 0}, r"^window: expected a value >= 1"),
    ("mistral_swa", {"window": 2.5}, r"^window: expected an int \(i32\), got 2.5"),
    ("mistral_swa", {"window": 2**31}, r"^window: expected an i32 value.*out of range"),
    (
        "mistral_swa",
        {"window": torch.tensor(3, device="meta")},
        r"^window: expected a Python number or a CPU scalar tensor.*meta",
    ),
    ("causal_d128", {"softmax_scale": math.nan}, r"^softmax_scale: expected a finite positive"),
    ("causal_d128", {"softmax_scale": math.inf}, r"^softmax_scale: expected a finite positive"),
    ("causal_d128", {"softmax_scale": 0.0}, r"^softmax_scale: expected a finite positive"),
    ("causal_d128", {"softmax_scale": -0.1}, r"^softmax_scale: expected a finite positive"),
    ("causal_d128", {"softmax_scale": 1e-45}, r"^softmax_scale: expected a finite positive"),
    ("causal_d128", {"softmax_scale": "big"}, r"^softmax_scale: expected a float"),
    ("causal_d128", {"softmax_scale": True}, r"^softmax_scale: expected a float"),
]


@pytest.mark.parametrize("name, kwargs, match", SCALAR_CASES)
def test_bad_scalars(ops, tripwire, name, kwargs, match):
    op = ops[name]
    q, k, v, params = make(op.spec)
    with pytest.raises(OpInputError, match=match):
        op.attention(q, k, v, **params, **kwargs)


def test_exclusive_bounds_are_named_as_declared(ops, tripwire, tmp_path):
    """gemma2_softcap's ``above: 0`` is held as the least float32 above 0, and a softcap of 0
    was refused as "expected a value >= 1.401298464324817e-45 (declared min)"; the message
    names the bound as declared (i32 and f32, above and below; min / max as before)."""
    q, k, v, _ = make(ops["gemma2_softcap"].spec)
    with pytest.raises(OpInputError, match=r"^softcap: expected a value > 0.0 \(declared "
                       r"above\), got 0.0$"):  # fmt: skip
        ops["gemma2_softcap"].attention(q, k, v, softcap=0.0)
    path = tmp_path / "bounded.yaml"
    path.write_text(
        "name: bounded_excl\nhead_dim: 64\ndtype: bf16\nmask: kv_idx < n\n"
        "score_mod: score * c\nparams:\n  n: {type: i32, default: 4, above: 0, below: 100}\n"
        "  c: {type: f32, default: 1.0, min: -2.0, below: 2.5}\n"
    )
    op = flashgen.load(path)
    q, k, v = (torch.randn(1, 2, 3, 64).to(torch.bfloat16) for _ in range(3))
    for kwargs, match in (
        ({"n": 0}, r"^n: expected a value > 0 \(declared above\), got 0$"),
        ({"n": 100}, r"^n: expected a value < 100 \(declared below\), got 100$"),
        ({"c": 2.5}, r"^c: expected a value < 2.5 \(declared below\), got 2.5$"),
        ({"c": -3.0}, r"^c: expected a value >= -2.0 \(declared min\), got -3.0$"),
    ):
        with pytest.raises(OpInputError, match=match):
            op.attention(q, k, v, **kwargs)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_bad_scalars_via_torch_op(ops, tripwire, device):
    """Direct calls bypass attention(): the impls still check scale and scalar params."""
    swa, cap = ops["mistral_swa"], ops["gemma2_softcap"]
    q, k, v, _ = make(swa.spec, device=device)
    with pytest.raises(OpInputError, match="^softmax_scale: expected a finite positive"):
        swa.torch_op(q, k, v, math.nan, 16)
    with pytest.raises(OpInputError, match="^window: expected a value >= 1"):
        swa.torch_op(q, k, v, 0.1, -5)
    q, k, v, _ = make(cap.spec, device=device)
    with pytest.raises(OpInputError, match="^softcap: expected a finite float"):
        cap.torch_op(q, k, v, 0.1, math.inf)


def test_good_scalar_forms_are_accepted(ops):
    op = ops["mistral_swa"]
    q, k, v, _ = make(op.spec)
    import numpy as np

    a, _ = op.attention(q, k, v, window=3)
    b, _ = op.attention(q, k, v, window=np.int64(3))
    c, _ = op.attention(q, k, v, window=torch.tensor(3))
    assert torch.equal(a, b) and torch.equal(a, c)
    cap = ops["gemma2_softcap"]
    q, k, v, _ = make(cap.spec)
    x, _ = cap.attention(q, k, v, softcap=20)  # an int for an f32 param is fine
    y, _ = cap.attention(q, k, v, softcap=20.0, softmax_scale=np.float32(0.05))
    z, _ = cap.attention(q, k, v, softcap=20.0, softmax_scale=float(np.float32(0.05)))
    w, _ = cap.attention(q, k, v, softcap=20.0)
    assert torch.equal(y, z) and torch.equal(x, w) and not torch.equal(x, z)


def test_float64_tensor_param_is_converted(ops):
    op = ops["alibi"]
    q, k, v, p = make(op.spec)
    a, _ = op.attention(q, k, v, slopes=p["slopes"])
    b, _ = op.attention(q, k, v, slopes=p["slopes"].double())
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------- stride 0
def _expanded(k, v, along):
    if along == "batch":
        return k[:1].expand(k.shape[0], -1, -1, -1), v[:1].expand(v.shape[0], -1, -1, -1)
    if along == "heads":
        return k[:, :1].expand(-1, k.shape[1], -1, -1), v[:, :1].expand(-1, v.shape[1], -1, -1)
    if along == "seq":
        return k[:, :, :1].expand(-1, -1, k.shape[2], -1), v[:, :, :1].expand(
            -1, -1, v.shape[2], -1
        )
    raise ValueError(along)


@pytest.mark.parametrize("along", ["batch", "heads", "seq"])
@pytest.mark.parametrize("name", ["alibi", "causal_d128"])
def test_stride0_expanded_kv_matches_reference(ops, along, name):
    op = ops[name]
    q, k, v, params = make(op.spec, b=2, hq=4, hkv=2, sq=9, sk=11, seed=3)
    ke, ve = _expanded(k, v, along)
    assert 0 in ke.stride()[:3] and ke.stride(-1) == 1
    o, lse = op.attention(q, ke, ve, **params)
    o2, lse2 = op.attention(q, ke.contiguous(), ve.contiguous(), **params)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    ref, ref_lse = attention_reference(op.spec, q, ke.contiguous(), ve.contiguous(), params=params)
    assert (o.double() - ref).abs().max() < 2e-2
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse[fin].double(), ref_lse[fin].double(), atol=1e-4, rtol=1e-4)


def test_mqa_by_expanding_one_kv_head(ops):
    """k/v of one head expanded to Hq heads (stride 0) == GQA with Hkv = 1."""
    op = ops["causal_d128"]
    q, k, v, _ = make(op.spec, hq=4, hkv=1)
    o1, _ = op.attention(q, k, v)
    o2, _ = op.attention(q, k.expand(-1, 4, -1, -1), v.expand(-1, 4, -1, -1))
    assert torch.equal(o1, o2)


# Inputs the full check accepts, some of which the fast path leaves to it.
_GOOD_CASES = [
    ("plain", lambda q, k, v, p: (q, k, v, p)),
    ("bshd_views", lambda q, k, v, p: tuple(
        x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)) + (p,)),
    ("mqa_expanded", lambda q, k, v, p: (q, k[:, :1].expand(-1, 2, -1, -1),
                                         v[:, :1].expand(-1, 2, -1, -1), p)),
    ("batch_expanded", lambda q, k, v, p: (q, k[:1].expand(2, -1, -1, -1),
                                           v[:1].expand(2, -1, -1, -1), p)),
    ("empty_q", lambda q, k, v, p: (q[:, :, :0], k, v, p)),
    ("empty_kv", lambda q, k, v, p: (q, k[:, :, :0], v[:, :, :0], p)),
    ("no_heads", lambda q, k, v, p: (q[:, :0], k[:, :0], v[:, :0], p)),
    ("empty_odd_stride", lambda q, k, v, p: (q.new_zeros(2, 4, 128, 3)[..., :0].transpose(2, 3),
                                             k, v, p)),  # stride(-1) == 3, but no elements
]  # fmt: skip


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize(
    "case",
    [c[:2] for c in TENSOR_CASES] + _GOOD_CASES,
    ids=[c[0] for c in TENSOR_CASES] + [c[0] for c in _GOOD_CASES],
)
def test_fast_check_accepts_only_what_the_full_check_accepts(ops, case, device):
    """``validate`` tries a few-read check first (:func:`flashgen.ops.op._dims_if_valid`) and
    runs every check in turn (:func:`flashgen.ops.op._check_qkv`) only when it says no: it must
    never accept what the full check refuses, and give the same Dims where both accept."""
    from flashgen.ops.op import _check_qkv, _dims_if_valid

    name, mutate = case
    spec = ops["alibi"].spec
    try:
        q, k, v, _ = mutate(*make(spec, device=device))
    except (NotImplementedError, RuntimeError):
        pytest.skip(f"{name} cannot be built from {device} tensors")  # .tolist() of meta
    fast = _dims_if_valid(spec, q, k, v)
    try:
        full = _check_qkv(spec, q, k, v)
    except OpInputError:
        full = None
    if fast is not None:
        assert fast == full
    if name in ("plain", "bshd_views", "mqa_expanded", "batch_expanded", "empty_q"):
        assert fast is not None, "the common case should take the fast path"
    if any(name == c[0] for c in _GOOD_CASES):
        assert full is not None


def test_fast_check_never_accepts_what_the_full_check_refuses_property(ops):
    """The same property as above over random geometry (hypothesis): valid q, k, v of
    sizes 0-3 (GQA head counts, any batch/head/sequence strides: 0, odd, over 2**32,
    storage offsets), then none, one or two of: a dim of one tensor off by one, q's heads
    not a multiple of k's, a rank of 3 or 5, a wrong head_dim, another dtype, a non-unit
    last stride, another device."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from flashgen.ops.op import _check_qkv, _dims_if_valid

    spec = ops["alibi"].spec  # bf16, head_dim 128
    size = st.sampled_from([0, 1, 2, 3])
    stride = st.sampled_from([0, 1, 3, 128, 384, 2**33 + 7])
    faults = st.lists(
        st.sampled_from(["dim", "heads", "rank", "head_dim", "dtype", "stride", "device"]),
        max_size=2,
    )

    def build(shape, strides, dtype, device, offset):
        if device == "cpu":  # a real tensor: every row aliases one (stride 0)
            strides = [0] * (len(shape) - 1) + [strides[-1]]
            need = (max(shape[-1], 1) - 1) * strides[-1] + 1  # the last row's span
            return torch.zeros(need, dtype=dtype).as_strided(shape, strides)
        base = torch.empty(2**40, dtype=dtype, device="meta")
        return base.as_strided(shape, strides, offset)

    @given(st.data(), size, size, size, size, st.sampled_from([1, 2, 3]))
    @settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
    def check(data, b, sq, sk, hkv, group):
        shapes = [[b, hkv * group, sq, 128], [b, hkv, sk, 128], [b, hkv, sk, 128]]
        dtypes = [torch.bfloat16] * 3
        devices = ["meta"] * 3
        last = [1, 1, 1]
        for fault in data.draw(faults):
            t = data.draw(st.integers(0, 2))
            if fault == "dim":
                dim = data.draw(st.integers(0, len(shapes[t]) - 1))
                shapes[t][dim] += data.draw(st.sampled_from([1, -1]))
                shapes[t] = [max(x, 0) for x in shapes[t]]
            elif fault == "heads":  # q's heads not a multiple of k's
                shapes[0][1] = hkv * group + data.draw(st.sampled_from([1, hkv + 1]))
            elif fault == "rank":
                shapes[t] = shapes[t][1:] if data.draw(st.booleans()) else [1, *shapes[t]]
            elif fault == "head_dim":
                shapes[t][-1] = data.draw(st.sampled_from([64, 127, 129, 256]))
            elif fault == "dtype":
                dtypes[t] = data.draw(st.sampled_from([torch.float16, torch.float32]))
            elif fault == "stride":
                last[t] = data.draw(st.sampled_from([0, 2, 128]))
            else:
                devices[t] = "cpu"
        q, k, v = (
            build(
                shape,
                [data.draw(stride) for _ in shape[:-1]] + [lst],
                dt,
                dev,
                data.draw(st.sampled_from([0, 1, 64])),
            )
            for shape, dt, dev, lst in zip(shapes, dtypes, devices, last, strict=True)
        )
        fast = _dims_if_valid(spec, q, k, v)
        try:
            full = _check_qkv(spec, q, k, v)
        except OpInputError:
            full = None
        if fast is not None:
            assert fast == full, (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride())

    check()


def test_a_scalar_param_tensor_that_requires_grad_gets_its_gradient(ops):
    """A 0-d tensor for a scalar param is read with .item() for the kernels; one that
    requires grad gets its gradient (tests/unit/test_param_grads.py checks the values), and a
    detached one computes what the plain float does."""
    op = ops["gemma2_softcap"]
    q, k, v, _ = make(op.spec)
    softcap = torch.tensor(30.0, requires_grad=True)
    o, _ = op.attention(q, k, v, softcap=softcap)
    o.float().sum().backward()
    assert softcap.grad is not None and torch.isfinite(softcap.grad) and softcap.grad != 0
    o, _ = op.attention(q, k, v, softcap=softcap.detach())
    o2, _ = op.attention(q, k, v, softcap=30.0)
    assert torch.equal(o, o2)


# ----------------------------------------------------------------------------- family_for: devices
@pytest.mark.parametrize("dev", [(9, "x"), ("9.0",), (90,), (None,), (9.0, 0), None, "sm_90", 90,
                                 (True, 0)])  # fmt: skip
def test_family_for_malformed_device(dev):
    """TypeError / RuntimeError from int() or torch.device before."""
    with pytest.raises(OpInputError, match=r"^device: expected"):
        flashgen.load("causal_d128").family_for(dev)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_family_for_cuda_without_gpu():
    """An AssertionError from torch ('Torch not compiled with CUDA enabled') before."""
    with pytest.raises(OpInputError, match=r"torch sees no CUDA GPU here"):
        flashgen.load("causal_d128").family_for("cuda")


@pytest.mark.parametrize("cap", [(8, 0), (10, 0), (12, 0)])
def test_family_for_fp8_off_hopper_names_the_capability(cap):
    """The message said 'got target sm_80' for a 10.0 / 12.0 GPU."""
    with pytest.raises(RuntimeError, match=rf"compute capability {cap[0]}\.{cap[1]}: .* 9\.0"):
        flashgen.load("llama3_fp8").family_for(cap)
    assert flashgen.load("llama3_fp8").family_for([9, 0]).forward == "hopper_fwd"
