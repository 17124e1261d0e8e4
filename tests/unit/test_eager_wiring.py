"""The eager fast path's wiring (``flashgen.ops.prefill.attention._eager_cuda``,
``_EagerAttention``), on the CPU.

The fast path only runs for CUDA tensors; here it is forced on with the CPU reference in
place of the CUDA forward, so its autograd node must give the same outputs and gradients
as the dispatcher path (``torch.ops.flashgen.<name>`` with its registered autograd).
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from flashgen.bench.verify import random_inputs  # noqa: E402
from flashgen.frontend.spec import load_spec  # noqa: E402
from flashgen.ops.op import AttentionOp, build_op  # noqa: E402
from flashgen.ops.prefill import attention as op_mod  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_cpu_tensors_take_the_dispatcher_path():
    q = torch.zeros(1, 1, 1, 8)
    assert not op_mod._eager_cuda(q, q, q)


def test_a_tensor_subclass_takes_the_dispatcher_path():
    class Sub(torch.Tensor):
        pass

    q = torch.zeros(1, 1, 1, 8).as_subclass(Sub)
    assert not op_mod._eager_cuda(q, q, q)


@pytest.fixture
def forced(monkeypatch):
    """The fast path on, with the CPU reference as its forward; counts its calls."""
    calls = []

    def forward(self, q, k, v, dims, scale, scalars, tensors, table, descales=None, out=None):
        calls.append(self.spec.name)
        ordered = [tensors[p.name] for p in self.spec.tensor_params]
        return self._cpu_impl(q, k, v, scale, *scalars, *ordered, out=out)

    monkeypatch.setattr(op_mod, "_eager_cuda", lambda q, k, v: True)
    monkeypatch.setattr(AttentionOp, "_forward", forward)
    return calls


@pytest.mark.parametrize("name", ["causal_d128", "alibi", "mistral_swa"])
def test_autograd_node_matches_the_op_path(name, forced):
    op = build_op(load_spec(REPO / "specs" / f"{name}.yaml"))
    gen = torch.Generator().manual_seed(0)
    q, k, v, tensors = random_inputs(op.spec, 1, 2, 1, 19, 33, "cpu", gen)
    params = dict(tensors, **({"window": 7} if name == "mistral_swa" else {}))
    do = torch.randn(1, 2, 19, op.spec.head_dim_v, generator=gen).to(q.dtype)
    dl = torch.randn(1, 2, 19, generator=gen)
    scalars, tlist = op_mod.resolve_params(op.spec, params)
    scale = op_mod.default_softmax_scale(op.spec)
    runs = []
    for fast in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if fast:
            o, lse = op.attention(*leaves, **params)
            assert forced == [name]
            assert type(o.grad_fn).__name__.startswith("_EagerAttention")
        else:
            o, lse = op.torch_op(*leaves, scale, *scalars, *tlist)
        torch.autograd.backward((o, lse), (do, dl))
        runs.append([o.detach(), lse.detach(), *(t.grad for t in leaves)])
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("grad", [False, True])
def test_out_on_the_fast_path(forced, grad):
    """``out=`` reaches the fast path's forward: o is the caller's tensor itself (also as
    the output of the autograd node), and the gradients are those of a call without it."""
    op = build_op(load_spec(REPO / "specs" / "causal_d128.yaml"))
    q, k, v, _ = random_inputs(op.spec, 2, 3, 1, 7, 9, "cpu")
    runs = []
    for with_out in (True, False):
        leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
        buf = torch.empty(2, 7, 3, 128, dtype=q.dtype)
        o, lse = op.attention(*leaves, out=buf.transpose(1, 2) if with_out else None)
        if with_out:
            assert o._base is buf and o.stride() == buf.transpose(1, 2).stride()
            assert (o.grad_fn is not None) == grad
        if grad:
            o.float().square().sum().backward()
        runs.append([o.detach(), lse, *(t.grad for t in leaves if grad)])
    assert forced == ["causal_d128"] * 2
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_without_grad_no_node(forced):
    op = build_op(load_spec(REPO / "specs" / "causal_d128.yaml"))
    q, k, v, _ = random_inputs(op.spec, 1, 1, 1, 5, 5, "cpu")
    o, lse = op.attention(q, k, v)
    assert forced and o.grad_fn is None


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", ["alibi", "t5_bias"])
def test_a_tensor_param_that_requires_grad_takes_the_fast_path(name, deterministic, forced):
    """A tensor param that requires grad (trainable ALiBi slopes, a T5 bias table) takes the
    fast path's autograd node, whose backward gives its gradient too: o, lse and the
    gradients of q, k, v and the param equal the operator path's, bitwise."""
    op = build_op(load_spec(REPO / "specs" / f"{name}.yaml"))
    gen = torch.Generator().manual_seed(1)
    q, k, v, tensors = random_inputs(op.spec, 1, 2, 1, 9, 13, "cpu", gen)
    (pname,) = tensors
    do = torch.randn(1, 2, 9, op.spec.head_dim_v, generator=gen).to(q.dtype)
    scale = op_mod.default_softmax_scale(op.spec)
    runs = []
    for fast in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, tensors[pname])]
        if fast:
            o, lse = op.attention(*leaves[:3], deterministic=deterministic,
                                  **{pname: leaves[3]})  # fmt: skip
            assert forced == [name]
            assert type(o.grad_fn).__name__.startswith("_EagerAttention")
        else:
            o, lse = op.torch_op(*leaves[:3], scale, leaves[3], deterministic=deterministic)
        torch.autograd.backward(o, do)
        runs.append([o.detach(), lse.detach(), *(t.grad for t in leaves)])
    assert runs[0][-1].abs().max() > 0
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_nn_parameter_takes_the_fast_path_and_a_subclass_the_op_path(forced):
    """``nn.Parameter`` slopes (how a model holds them) take the fast path; a param of
    another tensor subclass that requires grad goes to the operator, whose dispatch sees it;
    both get the gradient."""

    class Sub(torch.Tensor):
        pass

    op = build_op(load_spec(REPO / "specs" / "alibi.yaml"))
    q, k, v, tensors = random_inputs(op.spec, 1, 2, 2, 5, 5, "cpu")
    slopes = torch.nn.Parameter(tensors["slopes"].clone())
    o, _ = op.attention(q, k, v, slopes=slopes)
    assert forced == ["alibi"] and type(o.grad_fn).__name__.startswith("_EagerAttention")
    o.float().sum().backward()
    assert slopes.grad is not None and slopes.grad.abs().max() > 0
    sub = tensors["slopes"].clone().as_subclass(Sub).requires_grad_()
    o, _ = op.attention(q, k, v, slopes=sub)
    assert forced == ["alibi"] and "_EagerAttention" not in type(o.grad_fn).__name__
    o.float().sum().backward()
    assert sub.grad is not None and sub.grad.abs().max() > 0


def test_a_trained_call_validates_its_inputs_once(monkeypatch):
    """On the fast path a call whose params require grad validates once (the operator's
    kernel validated a second time); the backward op validates its own inputs."""
    calls = []
    validate = op_mod.validate

    def counting(*args, **kwargs):
        calls.append(args[0].name)
        return validate(*args, **kwargs)

    def forward(self, q, k, v, dims, scale, scalars, tensors, table, descales=None, out=None):
        o, lse = self._empty_outputs(q, dims)
        return o.zero_(), lse.zero_()

    monkeypatch.setattr(op_mod, "validate", counting)
    monkeypatch.setattr(op_mod, "_eager_cuda", lambda q, k, v: True)
    monkeypatch.setattr(AttentionOp, "_forward", forward)
    op = build_op(load_spec(REPO / "specs" / "alibi.yaml"))
    q, k, v, tensors = random_inputs(op.spec, 1, 2, 2, 5, 5, "cpu")
    o, _ = op.attention(q.requires_grad_(), k, v, slopes=tensors["slopes"].requires_grad_())
    assert calls == ["alibi"] and type(o.grad_fn).__name__.startswith("_EagerAttention")


def test_a_mask_only_param_that_requires_grad_is_refused_on_the_fast_path(forced):
    """The fast path refuses a param without a gradient that requires grad with the
    operator path's error, naming it, on every call (the check's answers are kept, its
    refusals are not)."""
    from flashgen.frontend.errors import OpInputError
    from flashgen.frontend.spec import loads_spec

    spec = loads_spec(
        "name: fast_mask_only\nhead_dim: 64\ndtype: bf16\nscore_mod: score\n"
        "mask: kv_idx <= q_idx * lim[h]\nparams:\n  lim: {type: f32, shape: [num_heads]}\n",
        "fast_mask_only.yaml",
    )
    op = build_op(spec)
    q = torch.randn(1, 2, 3, 64).to(torch.bfloat16)
    lim = torch.ones(2, requires_grad=True)
    for _ in range(2):
        with pytest.raises(OpInputError, match="lim: requires_grad .* read only by the mask"):
            op.attention(q, q, q, lim=lim)
    assert forced == ["fast_mask_only"] * 2
    o, _ = op.attention(q.clone().requires_grad_(), q, q, lim=lim.detach())
    assert type(o.grad_fn).__name__.startswith("_EagerAttention")


@pytest.mark.parametrize("grad", [False, True])
def test_index_bounds_warning_points_at_the_callers_line(monkeypatch, grad):
    """IndexBoundsWarning names the user's ``op.attention`` line on the fast path, with and
    without its autograd node (not a frame inside flashgen or torch.autograd)."""
    import warnings

    from flashgen.analysis.indexbounds import IndexBoundsWarning
    from flashgen.frontend.spec import loads_spec

    def forward(self, q, k, v, dims, scale, scalars, tensors, table, descales=None, out=None):
        self._check_index_bounds(dims, scalars)  # what the CUDA _forward does first
        o, lse = self._empty_outputs(q, dims)
        return o.zero_(), lse.zero_()

    monkeypatch.setattr(op_mod, "_eager_cuda", lambda q, k, v: True)
    monkeypatch.setattr(AttentionOp, "_forward", forward)
    spec = loads_spec(
        "name: ib_eager\nhead_dim: 64\ndtype: bf16\nscore_mod: score + w[h]\n"
        "params:\n  w: {type: f32, shape: [num_heads_kv]}\n",
        "ib.yaml",
    )
    op = build_op(spec)
    op._bounds_seen.clear()  # build_op caches the op: warn again
    q = torch.randn(1, 4, 3, 64).to(torch.bfloat16).requires_grad_(grad)
    k = torch.randn(1, 2, 3, 64).to(torch.bfloat16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        op.attention(q, k, k, w=torch.zeros(2))
    (w,) = [x for x in seen if issubclass(x.category, IndexBoundsWarning)]
    assert w.filename == __file__, w.filename


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")
def test_plain_eager_conditions_on_the_cpu():
    """``_plain_eager`` (everything ``_eager_cuda`` asks but the device): plain tensors in
    eager mode yes; a ``torch.jit.trace`` (which must record ``flashgen::<name>``, not the
    fast path's raw launch), a dispatch mode and vmap no."""
    from torch.utils._python_dispatch import TorchDispatchMode

    q = torch.zeros(1, 1, 1, 8)
    assert op_mod._plain_eager(q, q, q)
    seen = []

    def f(x):
        seen.append(op_mod._plain_eager(x, x, x))
        return x * 2

    torch.jit.trace(f, (q,), check_trace=False)
    assert seen == [False]

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert not op_mod._plain_eager(q, q, q)
    seen.clear()
    torch.vmap(f)(torch.zeros(2, 1, 1, 1, 8))
    assert seen == [False]


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")
def test_jit_trace_records_the_op():
    """Under ``torch.jit.trace`` ``op.attention`` goes through ``torch.ops.flashgen``."""
    op = build_op(load_spec(REPO / "specs" / "causal_d128.yaml"))
    q, k, v, _ = random_inputs(op.spec, 1, 1, 1, 5, 5, "cpu")
    traced = torch.jit.trace(lambda q, k, v: op.attention(q, k, v)[0], (q, k, v), check_trace=False)
    assert "flashgen::causal_d128" in str(traced.graph)


def test_torch_compile_fullgraph_traces_the_op_through_plain_eager(monkeypatch):
    """Dynamo traces ``_plain_eager`` without a graph break (``is_compiling`` short-circuits
    the mode checks) and records ``flashgen::<name>``, as on CUDA (here the device test is
    skipped so the CPU reaches it)."""
    op = build_op(load_spec(REPO / "specs" / "causal_d128.yaml"))
    q, k, v, _ = random_inputs(op.spec, 1, 1, 1, 5, 5, "cpu")
    ref = op.attention(q, k, v)[0]
    monkeypatch.setattr(op_mod, "_eager_cuda", lambda q, k, v: op_mod._plain_eager(q, k, v))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm

    f = torch.compile(lambda q, k, v: op.attention(q, k, v)[0], fullgraph=True, backend=backend)
    torch.testing.assert_close(f(q, k, v), ref, rtol=0, atol=0)
    assert len(graphs) == 1 and "flashgen.causal_d128" in graphs[0], graphs
