"""The expression-lowering rules of ``lower.cuda_expr`` on the GPU, against the float64
reference (needs a GPU: ``pytest -m gpu``).

A float division whose value reaches a comparison must stay a division: the hoisted
reciprocal ``x * (1 / d)`` is within an ulp of ``x / d`` but a comparison turns that ulp
into a different decision (``21 * (1 / 7.0f)`` is 3.0000002, not 3), so a mask such as
``q_idx / f == kv_idx`` would drop pairs the reference keeps.  Each case runs with both
kernel families (the Hopper kernel takes head_dim 128 masks on an H200); the backward (which
divides in place) must keep the same pairs as the forward.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_options  # noqa: E402
from head_dim_cases import prebuild  # noqa: E402

from flashgen.bench.verify import error_bound, random_inputs  # noqa: E402
from flashgen.frontend.spec import loads_spec  # noqa: E402
from flashgen.ops.cpu.reference import attention_reference  # noqa: E402
from flashgen.ops.op import poison_outputs  # noqa: E402

pytestmark = pytest.mark.gpu

PARAMS = "params:\n  f: {type: f32, default: 7.0}\n"
SPECS = {
    # rows q_idx = 7 m keep exactly key m; every other row keeps nothing (o = 0, lse = -inf)
    "exprlow_cmp_mask": "mask: q_idx / f == kv_idx\n",
    # the pairs kv_idx == q_idx / f get +8 on their logit
    "exprlow_cmp_mod": "score_mod: 'q_idx / f == kv_idx ? score + 8.0 : score'\n",
    # both: a one-sided comparison, and the reciprocal where no comparison reads it
    "exprlow_cmp_both": "mask: kv_idx >= q_idx / f\nscore_mod: score / f + score\n",
}


def spec_of(name: str):
    return loads_spec(f"name: {name}\nhead_dim: 128\ndtype: bf16\n{SPECS[name]}{PARAMS}")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    """Every kernel of this module compiled in parallel up front (both families; the
    backward of the mask spec)."""
    dev = torch.device("cuda")
    for fam in ("auto", "fa2"):
        prebuild([spec_of(n) for n in sorted(SPECS)], dev, options=gpu_options.options(family=fam))
    prebuild([spec_of("exprlow_cmp_mask")], dev, backward=True)


@pytest.fixture(autouse=True, params=["auto", "fa2"])
def family(request, monkeypatch):
    """Ops bound to ``Options(family=...)`` (:mod:`gpu_options`)."""
    gpu_options.use(monkeypatch, family=request.param)
    return request.param


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("sq, sk", [(127, 127), (1000, 200), (17, 1000)])
def test_compared_float_division(name, sq, sk):
    spec = spec_of(name)
    op = gpu_options.build(spec)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v, params = random_inputs(spec, 2, 4, 2, sq, sk, dev, gen)
    params["f"] = 7.0
    with poison_outputs():
        o, lse = op.attention(q, k, v, **params)
    torch.cuda.synchronize()
    ref_o, ref_lse, bound = error_bound(spec, q, k, v, params)
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "rows with nothing to attend to differ"
    assert (o[empty] == 0).all()
    err = (o.double() - ref_o).abs().max().item()
    assert err <= bound, f"{name} Sq={sq} Sk={sk}: {err:.3e} > {bound:.3e}"


def _ref_grads(spec, q, k, v, do, params, dtype):
    qr, kr, vr = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    o, _ = attention_reference(spec, qr, kr, vr, params=params, compute_dtype=dtype)
    o.backward(do.to(dtype))
    return qr.grad, kr.grad, vr.grad


def test_compared_float_division_backward(family):
    """The backward (which divides in place) keeps the pairs the forward keeps: rows that
    attend to one key get its gradient, rows that attend to none get 0, not NaN."""
    if family != "auto":
        pytest.skip("the backward kernels are one family")
    name = "exprlow_cmp_mask"
    spec = spec_of(name)
    op = gpu_options.build(spec)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    q, k, v, params = random_inputs(spec, 2, 4, 2, 300, 200, dev, gen)
    params["f"] = 7.0
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o, _ = op.attention(q, k, v, deterministic=True, **params)
    do = torch.randn(o.shape, device=dev, generator=gen).to(o.dtype)
    o.backward(do)
    ref64 = _ref_grads(spec, q, k, v, do, params, torch.float64)
    low = _ref_grads(spec, q, k, v, do, params, q.dtype)
    for g, ours, r64, rlow in zip("qkv", (q.grad, k.grad, v.grad), ref64, low, strict=True):
        assert not ours.isnan().any(), f"d{g} has NaN"
        err = (ours.double() - r64).abs().max().item()
        bound = 2 * (rlow.double() - r64).abs().max().item() + 1e-3
        assert err <= bound, f"{name} d{g}: {err:.3e} > {bound:.3e}"
