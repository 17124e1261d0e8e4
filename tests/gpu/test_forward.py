"""The CUDA kernels against the float64 reference (needs a GPU: ``pytest -m gpu``).

Every case runs on fresh ``torch.randn`` inputs with the outputs poisoned (NaN) before
launch, so an element the kernel forgets to write fails the test.  Accuracy bound:
max|ours - ref64| <= 2 * max|reference in the input dtype - ref64| + 1e-3; lse within
1e-2 relative on rows that attend to something, exactly -inf (and o == 0) elsewhere.

Each case runs with both kernel families (the ``family`` fixture).
The matrix is pragmatic rather than a full cross product: each shipped spec on
Sq == Sk, Sq < Sk and Sq > Sk with GQA; both dtypes; causal on and off at each head
dim; lengths 1, 17, 127, 1000, 4097; GQA 32/8 and 8/1; (B, S, H, D) views; empty sizes.
Head dims 32, 96, 160, 192 and the (head_dim, head_dim_v) pairs (192, 128) and (128, 256)
(``-k head_dim``): both dtypes x causal on/off, lengths 1 to 4097 with Sq != Sk and GQA,
softcap and ALiBi score_mods on (B, S, H, D) views.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_options  # noqa: E402
from head_dim_cases import NEW_HEAD_DIMS, dims_id, hdim_spec, prebuild  # noqa: E402

from flashgen.bench.verify import random_inputs  # noqa: E402
from flashgen.build import cache  # noqa: E402
from flashgen.frontend import ir  # noqa: E402
from flashgen.frontend.spec import load_spec  # noqa: E402
from flashgen.ops.op import poison_outputs  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, params=["auto", "fa2"])
def family(request, monkeypatch):
    """Every case runs twice: with the default kernel (on an H200, the Hopper TMA + wgmma
    kernel) and with the FA2-class kernel: ops bound to ``Options(family=...)``
    (:mod:`gpu_options`)."""
    gpu_options.use(monkeypatch, family=request.param)
    return request.param


REPO = Path(__file__).resolve().parents[2]
# (v_from_k specs are decode only: tests/gpu/test_decode_mla_gpu.py)
SPECS = {p.stem: p for p in sorted((REPO / "specs").glob("*.yaml")) if not load_spec(p).v_from_k}


def shipped(name: str) -> ir.Spec:
    return load_spec(SPECS[name])


def variant(spec: ir.Spec, *, dtype: str | None = None, causal: bool | None = None) -> ir.Spec:
    """``spec`` with another dtype and/or the mask replaced by plain causal / no mask."""
    changes, suffix = {}, ""
    if dtype is not None and dtype != spec.dtype:
        changes["dtype"], suffix = dtype, suffix + f"_{dtype}"
    if causal is not None:
        changes["mask"] = ir.Causal() if causal else None
        suffix += "_causal" if causal else "_nomask"
    return dataclasses.replace(spec, name=spec.name + suffix, **changes) if changes else spec


def check(spec: ir.Spec, b, hq, hkv, sq, sk, error_bound, *, bshd=False, seed=0, **kw):
    """Run ``spec``'s op on random inputs and compare with the fp64 reference."""
    op = gpu_options.build(spec)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    q, k, v, params = random_inputs(spec, b, hq, hkv, sq, sk, dev, gen)
    params.update(kw)
    if bshd:  # (B, S, H, D) storage viewed as (B, H, S, D)
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        assert q.stride(-1) == 1 and not q.is_contiguous()
    with poison_outputs():
        o, lse = op.attention(q, k, v, **params)
    torch.cuda.synchronize()
    assert o.shape == (b, hq, sq, spec.head_dim_v) and o.dtype == q.dtype
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    assert not o.isnan().any(), "o has NaN: an element was not written"
    assert not lse.isnan().any(), "lse has NaN: an element was not written"
    if o.numel() == 0:
        return
    ref_o, ref_lse, bound = error_bound(spec, q, k, v, params)
    err = (o.double() - ref_o).abs().max().item()
    assert err <= bound, f"{spec.name} {b}x{hq}/{hkv} Sq={sq} Sk={sk}: {err:.3e} > {bound:.3e}"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "rows with nothing to attend to differ"
    assert (o[empty] == 0).all()
    fin = ~empty
    if fin.any():  # a mask may drop every pair
        lse_err = ((lse[fin] - ref_lse[fin]).abs() / (1 + ref_lse[fin].abs())).max().item()
        assert lse_err <= 1e-2, f"lse off by {lse_err:.3e} (relative)"


# ----------------------------------------------------------------------------- every shipped spec
#: fp8 specs run the Hopper kernel only, with descales: tests/gpu/test_fp8_gpu.py
BF16_FP16 = sorted(n for n, p in SPECS.items() if load_spec(p).dtype in ("fp16", "bf16"))


@pytest.mark.parametrize("name", BF16_FP16)
@pytest.mark.parametrize("sq, sk", [(127, 127), (17, 1000), (1000, 17)])
def test_shipped_spec(name, sq, sk, error_bound):
    spec = shipped(name)
    extra = {"window": 37} if spec.param("window") is not None else {}
    check(spec, 2, 4, 2, sq, sk, error_bound, seed=sq * 7 + sk, **extra)


# ----------------------------------------------------------------------------- dtype x causal
@pytest.mark.parametrize("base", ["gpt2_d64", "causal_d128", "gemma2_softcap"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [True, False])
def test_dtype_and_causal(base, dtype, causal, error_bound):
    spec = variant(shipped(base), dtype=dtype, causal=causal)
    check(spec, 1, 2, 2, 257, 300, error_bound, seed=3)


# ----------------------------------------------------------------------------- lengths, GQA, views
@pytest.mark.parametrize(
    "sq, sk",
    [(1, 1), (1, 4097), (17, 17), (4097, 1), (127, 4097), (4097, 4097), (1000, 1000)],
)
@pytest.mark.parametrize("causal", [True, False])
def test_lengths(sq, sk, causal, error_bound):
    spec = variant(shipped("causal_d128"), causal=causal)
    check(spec, 1, 2, 1, sq, sk, error_bound, seed=sq + sk)


@pytest.mark.parametrize("hq, hkv, sq, sk", [(32, 8, 1000, 1000), (8, 1, 127, 1000)])
def test_gqa(hq, hkv, sq, sk, error_bound):
    check(shipped("llama3_gqa"), 1, hq, hkv, sq, sk, error_bound, seed=hq)


@pytest.mark.parametrize("name", ["llama3_gqa", "alibi", "bidir_d256"])
def test_bshd_views(name, error_bound):
    check(shipped(name), 2, 8, 2, 300, 257, error_bound, bshd=True, seed=5)


def test_larger_batch_and_heads(error_bound):
    check(shipped("gpt2_d64"), 3, 12, 12, 333, 333, error_bound, seed=11)


# ----------------------------------------------------------------------------- head dims
# 32, 96, 160, 192 and head_dim_v != head_dim: (192, 128) as in MLA, (128, 256).
HDIM_IDS = [dims_id(d, dv) for d, dv in NEW_HEAD_DIMS]


@pytest.fixture(scope="module")
def hdim_kernels():
    """Compile every forward kernel of the head-dim tests in parallel up front."""
    dev = torch.device("cuda")
    specs = [
        hdim_spec(d, dv, dtype, "none", causal)
        for d, dv in NEW_HEAD_DIMS
        for dtype in ("fp16", "bf16")
        for causal in (True, False)
    ]
    specs += [hdim_spec(d, dv, "bf16", m) for d, dv in NEW_HEAD_DIMS for m in ("softcap", "alibi")]
    prebuild(specs, dev)


@pytest.mark.parametrize("d, dv", NEW_HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [True, False])
def test_head_dim_dtype_causal(d, dv, dtype, causal, error_bound, hdim_kernels):
    spec = hdim_spec(d, dv, dtype, "none", causal)
    check(spec, 2, 4, 2, 257, 300, error_bound, seed=d + dv)


@pytest.mark.parametrize("d, dv", NEW_HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize(
    "hq, hkv, sq, sk", [(2, 2, 1, 1), (8, 2, 17, 1000), (8, 1, 1000, 17), (4, 2, 4097, 127)]
)
def test_head_dim_lengths_and_gqa(d, dv, hq, hkv, sq, sk, error_bound, hdim_kernels):
    for causal in (True, False):
        check(hdim_spec(d, dv, "bf16", "none", causal), 1, hq, hkv, sq, sk, error_bound, seed=sq)


@pytest.mark.parametrize("d, dv", NEW_HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("score_mod", ["softcap", "alibi"])
def test_head_dim_score_mod_and_bshd_views(d, dv, score_mod, error_bound, hdim_kernels):
    spec = hdim_spec(d, dv, "bf16", score_mod)
    check(spec, 2, 8, 2, 300, 257, error_bound, bshd=True, seed=d)
    check(spec, 1, 4, 4, 127, 1000, error_bound, seed=dv)


# ----------------------------------------------------------------------------- empty sizes
@pytest.mark.parametrize("b, sq, sk", [(0, 17, 17), (2, 0, 17), (2, 17, 0)])
def test_empty(b, sq, sk):
    op = gpu_options.build(shipped("causal_d128"))
    dev = torch.device("cuda")
    q, k, v, _ = random_inputs(op.spec, b, 4, 2, sq, sk, dev)
    with poison_outputs():
        o, lse = op.attention(q, k, v)
    assert o.shape == (b, 4, sq, 128) and lse.shape == (b, 4, sq)
    if sk == 0:
        assert (o == 0).all() and torch.isneginf(lse).all()


# ----------------------------------------------------------------------------- torch integration
def test_warm_calls_do_not_rebuild_and_use_the_current_stream(error_bound):
    spec = shipped("causal_d128")
    check(spec, 1, 2, 2, 64, 64, error_bound)
    builds = cache.builds
    op = gpu_options.build(spec)
    q, k, v, _ = random_inputs(spec, 1, 2, 2, 64, 64, torch.device("cuda"))
    ref, _ = op.attention(q, k, v)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        o, _ = op.attention(q, k, v)
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(o, ref)
    assert cache.builds == builds


def test_opcheck_cuda():
    op = gpu_options.build(shipped("alibi"))
    q, k, v, params = random_inputs(op.spec, 1, 2, 1, 33, 40, torch.device("cuda"))
    torch.library.opcheck(op.torch_op, (q, k, v, 0.1, params["slopes"]))


def test_torch_compile_cuda():
    op = gpu_options.build(shipped("mistral_swa"))
    q, k, v, _ = random_inputs(op.spec, 1, 2, 2, 100, 100, torch.device("cuda"))
    f = torch.compile(lambda q, k, v: op.attention(q, k, v, window=16), fullgraph=True)
    o, lse = f(q, k, v)
    o2, lse2 = op.attention(q, k, v, window=16)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


@pytest.mark.parametrize("offset", [0, 1])
def test_fused_qkv_views(offset, error_bound):
    """q, k, v as views of one fused [B, S, 3, H, D(+1)] tensor: aligned (offset 0, no copy)
    and misaligned by one element (offset 1: strides not multiples of 8, base not 16-byte
    aligned), which the op must still get right."""
    spec = shipped("bidir_d256")
    b, h, s, d = 2, 4, 129, spec.head_dim
    op = gpu_options.build(spec)
    qkv = torch.randn(b, s, 3, h, d + offset, device="cuda", dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i, :, offset:].transpose(1, 2) for i in range(3))
    assert q.stride(-1) == 1
    with poison_outputs():
        o, _ = op.attention(q, k, v)
    ref_o, _, bound = error_bound(spec, q, k, v, {})
    assert not o.isnan().any()
    err = (o.double() - ref_o).abs().max().item()
    assert err <= bound, f"offset {offset}: {err:.3e} > {bound:.3e}"
