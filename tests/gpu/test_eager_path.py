"""The eager fast path of ``op.attention`` against the dispatcher path (needs a GPU).

``AttentionOp.attention`` launches the CUDA forward itself for plain CUDA tensors in eager
mode (``flashgen.ops.prefill.attention._eager_cuda``), with its own autograd node
(``_EagerAttention``), and goes through ``torch.ops.flashgen.<name>`` otherwise.  Both run
the same kernels, so the outputs and the (deterministic) gradients must be bitwise equal, a
tensor param's that requires grad too (it takes the fast path as well); a dispatch mode must
see the op.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from flashgen.bench.verify import random_inputs  # noqa: E402
from flashgen.frontend.spec import load_spec  # noqa: E402
from flashgen.ops.op import build_op, default_softmax_scale, poison_outputs  # noqa: E402
from flashgen.ops.prefill import attention as op_mod  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
SPECS = ["causal_d128", "alibi", "mistral_swa", "document_mask", "t5_bias"]


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _problem(name, seed=0, sq=300, sk=517, b=2, hq=4, hkv=2):
    op = build_op(load_spec(REPO / "specs" / f"{name}.yaml"))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, tensors = random_inputs(op.spec, b, hq, hkv, sq, sk, "cuda", gen)
    params = dict(tensors)
    if name == "mistral_swa":
        params["window"] = 100
    return op, q, k, v, params


def _via_op(op, q, k, v, params, deterministic=False):
    """The dispatcher path: ``torch.ops.flashgen.<name>`` with the schema's arguments."""
    scalars, tensors = op_mod.resolve_params(op.spec, params)
    extra = [None] if op._block_table else []
    scale = default_softmax_scale(op.spec)
    return op.torch_op(q, k, v, scale, *scalars, *tensors, *extra, deterministic=deterministic)


@pytest.mark.parametrize("name", SPECS)
def test_forward_matches_the_op_path(name, monkeypatch):
    op, q, k, v, params = _problem(name)
    calls = []
    real = op_mod.validate
    monkeypatch.setattr(op_mod, "validate", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with poison_outputs():
        o, lse = op.attention(q, k, v, **params)
        # the dispatcher path validates twice: in attention() and in the CUDA impl
        assert len(calls) == 1, "plain CUDA tensors in eager mode should skip the dispatcher"
        o2, lse2 = _via_op(op, q, k, v, params)
        assert len(calls) == 2
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    assert not o.isnan().any() and not lse.isnan().any()


@pytest.mark.parametrize("name", SPECS)
def test_gradients_match_the_op_path(name):
    op, q, k, v, params = _problem(name, seed=1)
    # non-contiguous (B, S, H, D) views for q, as users pass them
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    gen = torch.Generator(device="cuda").manual_seed(2)
    do = torch.randn(q.shape[:3] + (op.spec.head_dim_v,), device="cuda", generator=gen).to(q.dtype)
    dl = torch.randn(q.shape[:3], device="cuda", generator=gen)
    grads = []
    for fn in (
        lambda *t: op.attention(*t, deterministic=True, **params),
        lambda *t: _via_op(op, *t, params, deterministic=True),
    ):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o, lse = fn(*leaves)
        assert o.grad_fn is not None and lse.grad_fn is not None
        torch.autograd.backward((o, lse), (do, dl))
        grads.append([t.grad for t in leaves] + [o.detach(), lse.detach()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["alibi", "t5_bias"])
def test_trained_param_gradients_match_the_op_path(name, monkeypatch):
    """A tensor param that requires grad (trainable slopes, a bias table) takes the fast
    path's node and validates once; under ``deterministic=True`` o, lse and the gradients of
    q, k, v and the param equal the operator path's bitwise."""
    op, q, k, v, params = _problem(name, seed=7)
    (pname,) = params
    gen = torch.Generator(device="cuda").manual_seed(8)
    do = torch.randn(q.shape[:3] + (op.spec.head_dim_v,), device="cuda", generator=gen).to(q.dtype)
    calls = []
    real = op_mod.validate
    monkeypatch.setattr(op_mod, "validate", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    runs = []
    for fast in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, params[pname])]
        kw = {pname: leaves[3]}
        if fast:
            o, lse = op.attention(*leaves[:3], deterministic=True, **kw)
            assert type(o.grad_fn).__name__.startswith("_EagerAttention") and len(calls) == 1
        else:
            o, lse = _via_op(op, *leaves[:3], kw, deterministic=True)
        o.backward(do)
        runs.append([o.detach(), lse.detach(), *(t.grad for t in leaves)])
    assert bool(runs[0][-1].abs().sum() > 0)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_only_k_requires_grad():
    op, q, k, v, params = _problem("causal_d128", seed=3)
    k = k.clone().requires_grad_()
    o, _ = op.attention(q, k, v)
    o.float().square().sum().backward()
    assert k.grad is not None and k.grad.isfinite().all() and k.grad.abs().sum() > 0


def test_no_grad_mode_builds_no_graph():
    op, q, k, v, params = _problem("causal_d128", seed=4)
    q.requires_grad_()
    with torch.no_grad():
        o, lse = op.attention(q, k, v)
    assert o.grad_fn is None and lse.grad_fn is None


def test_a_dispatch_mode_sees_the_op():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    op, q, k, v, params = _problem("causal_d128", seed=5)
    with Record():
        op.attention(q, k, v)
    assert any("flashgen" in s and "causal_d128" in s for s in seen), seen


@pytest.mark.parametrize("q_grad", [True, False])
def test_tensor_param_requiring_grad_gets_its_gradient(q_grad):
    """A tensor param that requires grad makes the output differentiable (alone or with q)
    and the backward fills its gradient, finite and of its shape (values: the dparam tests
    in test_param_grads_sinks_gpu.py)."""
    op, q, k, v, params = _problem("alibi", seed=6)
    slopes = params["slopes"].requires_grad_()
    q.requires_grad_(q_grad)
    o, _ = op.attention(q, k, v, **params)
    assert o.requires_grad
    o.float().square().sum().backward()
    assert slopes.grad is not None and slopes.grad.shape == slopes.shape
    assert bool(torch.isfinite(slopes.grad).all()) and bool(slopes.grad.abs().sum() > 0)
    assert (q.grad is not None) == q_grad


def test_jit_trace_records_the_op_on_cuda():
    """``torch.jit.trace`` of ``op.attention`` on CUDA tensors records
    ``flashgen::<name>`` (the fast path stays off while tracing), and the trace reruns it."""
    op, q, k, v, params = _problem("causal_d128", sq=65, sk=65, b=1, hq=2, hkv=2)
    traced = torch.jit.trace(lambda q, k, v: op.attention(q, k, v)[0], (q, k, v), check_trace=False)
    assert "flashgen::causal_d128" in str(traced.graph)
    q2 = torch.randn_like(q)
    torch.testing.assert_close(traced(q2, k, v), op.attention(q2, k, v)[0], rtol=0, atol=0)


@pytest.mark.parametrize("how", ["fast", "fast_grad", "op"])
def test_index_bounds_warning_names_the_callers_line(how):
    """IndexBoundsWarning on CUDA names this file's line, on the fast path without and with
    its autograd node, and through ``torch.ops`` (the dispatcher)."""
    import warnings

    from flashgen.analysis.indexbounds import IndexBoundsWarning
    from flashgen.frontend.spec import loads_spec

    spec = loads_spec(
        f"name: ib_gpu_{how}\nhead_dim: 64\ndtype: bf16\nscore_mod: score + w[h]\n"
        "params:\n  w: {type: f32, shape: [num_heads_kv]}\n",
        "ib.yaml",
    )
    op = build_op(spec)
    q = torch.randn(1, 4, 33, 64, device="cuda").to(torch.bfloat16)
    k = torch.randn(1, 2, 33, 64, device="cuda").to(torch.bfloat16)
    w = torch.zeros(2, device="cuda")
    q.requires_grad_(how == "fast_grad")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if how == "op":
            _via_op(op, q, k, k, {"w": w})
        else:
            op.attention(q, k, k, w=w)
    (hit,) = [x for x in seen if issubclass(x.category, IndexBoundsWarning)]
    assert hit.filename == __file__, hit.filename
