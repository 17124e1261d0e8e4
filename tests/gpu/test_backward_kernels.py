"""The backward kernels against the float64 reference's autograd (``pytest -m gpu``).

Bound per gradient: max|ours - ref64| <= 2 * max|reference autograd in the input dtype -
ref64| + 1e-3 (the FlashAttention test rule).  Fresh random inputs (and a random dO) per
case.  Causal on and off run in the same test, so a backward that ignores the flag fails.

Every accuracy test runs on both values of ``deterministic`` (the ``bwd_path`` fixture): True, the
deterministic kernels; False, whatever :func:`flashgen.ops.prefill.backward.backward_path` picks --
on an sm_90 GPU the Hopper wgmma kernels for the specs they take (d64/d128, causal or no mask, no
score_mod), else the deterministic ones again (so the False case is skipped unless the GPU is an
sm_90 one).  The FA2-class atomic-dQ kernels run for an op bound to
``Options(atomic_dq=True)`` (with ``family="fa2"`` on sm_90): ``test_fa2_atomic_dq``.  The other
GPU suites (big sizes, streams and graphs) use the default ``deterministic=False`` and so run
the same choice.

Head dims 32, 96, 160, 192 and the (head_dim, head_dim_v) pairs (192, 128) and (128, 256)
(``-k head_dim``): causal on/off, Sq != Sk both ways, lengths 1 to 1000, GQA, fp16 and
bf16, softcap and ALiBi score_mods on strided q/k/v views.
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
from flashgen.families.registry import has_backward  # noqa: E402
from flashgen.frontend import ir  # noqa: E402
from flashgen.frontend.spec import load_spec  # noqa: E402
from flashgen.ops.cpu.reference import attention_reference  # noqa: E402
from flashgen.ops.op import target_for_device  # noqa: E402
from flashgen.ops.prefill.backward import backward_path, uses_atomic_dq  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
#: the shipped specs with a backward (fp8 specs are forward only)
SPECS = sorted(p.stem for p in (REPO / "specs").glob("*.yaml") if has_backward(load_spec(p)))


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


#: deterministic=False runs other kernels than True under the default options only on sm_90
#: (the Hopper backward; an op with Options(atomic_dq=True) runs the FA2-class atomic-dQ ones).
NONDET_DIFFERS = uses_atomic_dq(False) or _sm90()
NONDET_REASON = "deterministic=False runs the deterministic kernels (no sm_90)"

PATHS = [
    pytest.param(True, id="deterministic"),
    pytest.param(
        False,
        id="atomic_dq",
        marks=pytest.mark.skipif(not NONDET_DIFFERS, reason=NONDET_REASON),
    ),
]


def expected_path(spec, deterministic: bool) -> str:
    """The backward path (:data:`flashgen.ops.prefill.backward.BACKWARD_PATHS`) a call should take
    (under the running test's options, :data:`gpu_options.CURRENT`)."""
    target = target_for_device(spec, torch.device("cuda"))
    return backward_path(spec, target, deterministic, gpu_options.CURRENT)


@pytest.fixture(params=PATHS)
def bwd_path(request) -> bool:
    """The ``deterministic`` flag of the backward path under test."""
    return request.param


def shipped(name: str) -> ir.Spec:
    return load_spec(REPO / "specs" / f"{name}.yaml")


def with_causal(spec: ir.Spec, causal: bool) -> ir.Spec:
    suffix = "_bwd_causal" if causal else "_bwd_nomask"
    return dataclasses.replace(spec, name=spec.name + suffix, mask=ir.Causal() if causal else None)


def ref_grads(spec, q, k, v, do, params, dtype):
    qr, kr, vr = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    o, _ = attention_reference(spec, qr, kr, vr, params=params, compute_dtype=dtype)
    o.backward(do.to(dtype))
    return qr.grad, kr.grad, vr.grad


def check_grads(spec, b, hq, hkv, sq, sk, *, seed=0, qkv=None, deterministic=True):
    """dq, dk, dv of ``spec``'s op on random inputs against the float64 reference (the 2x
    rule, as test_forward.py bounds the forward); asserts the expected backward path ran.
    Returns the op (bound to the running test's options, :mod:`gpu_options`)."""
    op = gpu_options.build(spec)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    q, k, v, params = random_inputs(spec, b, hq, hkv, sq, sk, dev, gen)
    if qkv is not None:
        q, k, v = qkv
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o, _ = op.attention(q, k, v, deterministic=deterministic, **params)
    do = torch.randn(o.shape, device=dev, generator=gen).to(o.dtype)
    o.backward(do)
    atomic = expected_path(spec, deterministic)
    ran = [key for key in op.backward._kernels if key[:2] == (torch.cuda.current_device(), atomic)]
    assert ran, f"{spec.name}: the {atomic} backward did not run"  # (a sink's key ends in "sink")
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    ref64 = ref_grads(spec, q, k, v, do, params, torch.float64)
    low = ref_grads(spec, q, k, v, do, params, q.dtype)
    for name, ours, r64, rlow in zip("qkv", (q.grad, k.grad, v.grad), ref64, low, strict=True):
        assert not ours.isnan().any(), f"d{name} has NaN"
        err = (ours.double() - r64).abs().max().item()
        bound = 2 * (rlow.double() - r64).abs().max().item() + 1e-3
        assert err <= bound, (
            f"{spec.name} d{name} B={b} H={hq}/{hkv} Sq={sq} Sk={sk} atomic={atomic}: "
            f"{err:.3e} > {bound:.3e}"
        )
    return op


@pytest.mark.parametrize("name", SPECS)
def test_shipped_spec_backward(name, bwd_path):
    check_grads(shipped(name), 2, 4, 2, 127, 257, seed=1, deterministic=bwd_path)
    check_grads(shipped(name), 1, 2, 1, 257, 127, seed=2, deterministic=bwd_path)


@pytest.mark.parametrize("sq, sk", [(1, 1), (17, 17), (127, 1025), (1025, 127), (4097, 4097)])
@pytest.mark.parametrize("base", ["gpt2_d64", "causal_d128"])
def test_lengths_causal_on_and_off(base, sq, sk, bwd_path):
    for causal in (True, False):
        spec = with_causal(shipped(base), causal)
        check_grads(spec, 1, 2, 1, sq, sk, seed=sq + sk, deterministic=bwd_path)


@pytest.mark.parametrize("causal", [True, False])
def test_head_dim_256_and_gqa(causal, bwd_path):
    spec = with_causal(shipped("bidir_d256"), causal)
    check_grads(spec, 1, 8, 2, 300, 511, seed=3, deterministic=bwd_path)


# ----------------------------------------------------------------------------- head dims
# 32, 96, 160, 192 and head_dim_v != head_dim: (192, 128) as in MLA, (128, 256).
HDIM_IDS = [dims_id(d, dv) for d, dv in NEW_HEAD_DIMS]


def _hdim_specs():
    for d, dv in NEW_HEAD_DIMS:
        yield hdim_spec(d, dv, "bf16", "none", True)
        yield hdim_spec(d, dv, "bf16", "none", False)
        yield hdim_spec(d, dv, "fp16", "none", True)
        yield hdim_spec(d, dv, "bf16", "softcap", True)
        yield hdim_spec(d, dv, "bf16", "alibi", True)


@pytest.fixture(scope="module")
def hdim_kernels():
    """Compile every kernel of the head-dim tests in parallel up front (the atomic-dQ unit
    only when that path is enabled)."""
    prebuild(
        list(_hdim_specs()), torch.device("cuda"), backward=True, atomic_dq=uses_atomic_dq(False)
    )


@pytest.mark.parametrize("d, dv", NEW_HEAD_DIMS, ids=HDIM_IDS)
def test_head_dim_backward(d, dv, bwd_path, hdim_kernels):
    """Causal on and off, Sq != Sk both ways with GQA, lengths 1 and 17, both dtypes."""
    for causal in (True, False):
        spec = hdim_spec(d, dv, "bf16", "none", causal)
        check_grads(spec, 2, 4, 2, 127, 257, seed=d + dv, deterministic=bwd_path)
        check_grads(spec, 1, 8, 2, 1000, 17, seed=d, deterministic=bwd_path)
        check_grads(spec, 1, 2, 1, 1, 17, seed=dv, deterministic=bwd_path)
    spec = hdim_spec(d, dv, "fp16", "none", True)
    check_grads(spec, 1, 8, 1, 300, 511, seed=3, deterministic=bwd_path)


@pytest.mark.parametrize("d, dv", NEW_HEAD_DIMS, ids=HDIM_IDS)
@pytest.mark.parametrize("score_mod", ["softcap", "alibi"])
def test_head_dim_backward_score_mod_strided_views(d, dv, score_mod, bwd_path, hdim_kernels):
    """q and k as views of one fused [B, S, 2, H, D] tensor, v a view of [B, S, H, Dv + 8]
    (strided, not contiguous)."""
    spec = hdim_spec(d, dv, "bf16", score_mod)
    b, s, h = 2, 257, 4
    qk = torch.randn(b, s, 2, h, d, device="cuda").to(torch.bfloat16)
    vbuf = torch.randn(b, s, h, dv + 8, device="cuda").to(torch.bfloat16)
    views = (
        qk[:, :, 0].transpose(1, 2),
        qk[:, :, 1].transpose(1, 2),
        vbuf[..., :dv].transpose(1, 2),
    )
    assert not any(t.is_contiguous() for t in views)
    check_grads(spec, b, h, h, s, s, seed=5, qkv=views, deterministic=bwd_path)
    check_grads(spec, 1, 4, 2, 17, 1000, seed=6, deterministic=bwd_path)


@pytest.mark.parametrize("hq, hkv", [(32, 8), (8, 1)])
def test_gqa_groups(hq, hkv, bwd_path):
    check_grads(shipped("llama3_gqa"), 1, hq, hkv, 200, 333, seed=hq, deterministic=bwd_path)


@pytest.mark.parametrize("name", ["llama3_gqa", "bidir_d256"])
def test_fused_qkv_views(name, bwd_path):
    """q, k, v as strided views of one fused [B, S, 3, H, D] tensor."""
    spec = shipped(name)
    b, s, h, d = 2, 257, 4, spec.head_dim
    qkv = torch.randn(b, s, 3, h, d, device="cuda").to(torch.bfloat16)
    views = tuple(qkv[:, :, i].transpose(1, 2) for i in range(3))
    check_grads(spec, b, h, h, s, s, seed=4, qkv=views, deterministic=bwd_path)


def _repeat_backward(deterministic: bool, n: int = 20):
    spec = shipped("llama3_gqa")
    op = gpu_options.build(spec)
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, _ = random_inputs(spec, 2, 8, 2, 1000, 1000, torch.device("cuda"), gen)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    do = torch.randn(2, 8, 1000, 128, device="cuda", generator=gen).to(q.dtype)
    grads = []
    for _ in range(n):
        q.grad = k.grad = v.grad = None
        op.attention(q, k, v, deterministic=deterministic)[0].backward(do)
        grads.append((q.grad.clone(), k.grad.clone(), v.grad.clone()))
    return grads


def test_deterministic_dq():
    """deterministic=True: 20 backwards are bitwise equal (also under Options(atomic_dq=True))."""
    grads = _repeat_backward(True)
    for g in grads[1:]:
        for a, b_ in zip(g, grads[0], strict=True):
            assert torch.equal(a, b_)


@pytest.mark.parametrize("name", ["causal_d128", "alibi", "document_mask", "bidir_d256"])
def test_fa2_atomic_dq(name, monkeypatch):
    """An op bound to ``Options(family="fa2", atomic_dq=True)`` (was ``FLASHGEN_ATOMIC_DQ=1``
    with ``FLASHGEN_KERNEL_FAMILY=fa2``): deterministic=False runs the FA2-class atomic-dQ
    kernels, deterministic=True the deterministic ones, both within the reference's bound."""
    gpu_options.use(monkeypatch, family="fa2", atomic_dq=True)
    spec = shipped(name)
    assert expected_path(spec, False) == "atomic" and expected_path(spec, True) == "deterministic"
    check_grads(spec, 2, 4, 2, 127, 257, seed=11, deterministic=False)
    check_grads(spec, 1, 2, 1, 257, 127, seed=12, deterministic=True)
    grads = _repeat_backward(True, n=3)  # the deterministic kernels stay bitwise reproducible
    assert all(torch.equal(a, b_) for g in grads[1:] for a, b_ in zip(g, grads[0], strict=True))


@pytest.mark.skipif(not NONDET_DIFFERS, reason=NONDET_REASON)
def test_atomic_dq_repeatability_and_agreement():
    """Atomic paths (the FA2-class one, or the Hopper one on sm_90): dk, dv are still
    bitwise reproducible (one owner per element); dq
    differs run to run only by the order of its fp32 adds before one rounding to bf16, so
    repeats, and the deterministic path's gradients, agree within a few bf16 ulps."""
    atomic = _repeat_backward(False, n=10)
    ref = _repeat_backward(True, n=1)[0]
    for g in atomic[1:]:
        assert torch.equal(g[1], atomic[0][1]) and torch.equal(g[2], atomic[0][2])
    for g in atomic:
        for ours, det in zip(g, ref, strict=True):
            scale = det.float().abs().max().item()
            torch.testing.assert_close(ours.float(), det.float(), atol=1e-2 * scale, rtol=1e-2)


def test_empty_rows_give_zero_gradients_and_no_nan(bwd_path):
    """Causal with Sq > Sk: the first Sq - Sk query rows attend to nothing."""
    spec = shipped("causal_d128")
    op = gpu_options.build(spec)
    q, k, v, _ = random_inputs(spec, 1, 2, 2, 300, 100, torch.device("cuda"))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, lse = op.attention(q, k, v, deterministic=bwd_path)
    (o.float().sum() + lse[torch.isfinite(lse)].sum()).backward()
    for g in (q.grad, k.grad, v.grad):
        assert not g.isnan().any()
    assert (q.grad[:, :, :200] == 0).all()
