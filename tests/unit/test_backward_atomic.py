"""The atomic-dQ backward path on the CPU: lowering (plans, kernels, grids, rendered
source), the ``deterministic`` flag's plumbing (schemas, env gate, autograd ctx in eager
mode, under torch.compile and in opcheck).  The kernels themselves are exercised by
tests/gpu/test_backward_kernels.py (with ``Options(atomic_dq=True)``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from plan_helpers import plan_backward

from flashgen.build.render import render
from flashgen.families.bwd_common import CONVERT_THREADS, PRE_WARPS
from flashgen.families.registry import has_backward
from flashgen.families.tiles import ATOMIC_BACKWARD_TILES, BACKWARD_TILES
from flashgen.frontend.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
#: the shipped specs with a backward (fp8 specs are forward only)
SPECS = [p for p in sorted((REPO / "specs").glob("*.yaml")) if has_backward(load_spec(p))]


# ----------------------------------------------------------------------------- lowering
def test_atomic_tiles_cover_every_deterministic_key():
    assert set(ATOMIC_BACKWARD_TILES) == set(BACKWARD_TILES)


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_atomic_plan_kernels_args_and_source(path):
    spec = load_spec(path)
    det = plan_backward(spec, "sm_90")
    atom = plan_backward(spec, "sm_90", atomic_dq=True)
    assert not det.atomic_dq and det.convert is None and det.unit is det.dq
    assert atom.atomic_dq and atom.dq is None and atom.unit is atom.dkdv
    names = [kp.kernel_name for kp in atom.kernels]
    base = f"flashgen_{spec.name}_bwd_sm_90"
    assert names == [f"{base}_pre", f"{base}_dkdv_atomic", f"{base}_convert"]
    # dq_accum reaches pre (zeroes it), dkdv (adds into it) and convert (reads it)
    for kp in atom.kernels:
        assert "dq_accum" in [a.name for a in kp.args], kp.kernel_name
    assert "dq_accum" not in [a.name for kp in det.kernels for a in kp.args]
    assert atom.convert.threads == CONVERT_THREADS
    # the dS^T tile: KV_N rows of KV_M elements plus 16 bytes of padding
    t = atom.tiles
    extra = t.dkdv_block_n * (2 * t.dkdv_block_m + 16)
    if t == det.tiles:
        assert atom.dkdv.smem_bytes == det.dkdv.smem_bytes + extra
    assert atom.config()["deterministic"] is False and det.config()["deterministic"] is True
    assert atom.config()["kernels"] == names
    src = render(atom.unit)
    assert all(f" {n}(" in src for n in names) and f"{base}_dq(" not in src
    assert "red.global.add.v2.f32" in src and "__CUDA_ARCH__ >= 900" in src
    det_src = render(det.unit)
    assert "atomicAdd(" not in det_src and "red.global.add" not in det_src
    assert "dq_accum" not in det_src


def test_atomic_grids():
    spec = load_spec(REPO / "specs" / "llama3_gqa.yaml")
    atom = plan_backward(spec, "sm_80", atomic_dq=True)
    det = plan_backward(spec, "sm_80")
    b, hq, hkv, sq, sk = 2, 8, 2, 1000, 777
    g = atom.grids(b, hq, hkv, sq, sk)
    assert set(g) == {"pre", "dkdv", "convert"}
    assert g["pre"] == (-(-b * hq * sq // PRE_WARPS), 1, 1)
    t = atom.tiles
    assert g["dkdv"] == (-(-sk // t.dkdv_block_n) * b * hkv * t.dkdv_dsplit, 1, 1)
    chunks = b * hq * sq * spec.head_dim // 4
    assert g["convert"] == (-(-chunks // CONVERT_THREADS), 1, 1)
    assert set(det.grids(b, hq, hkv, sq, sk)) == {"pre", "dkdv", "dq"}


# ----------------------------------------------------------------------------- plumbing
torch = pytest.importorskip("torch")

from flashgen.frontend.errors import OpInputError  # noqa: E402
from flashgen.ops.op import build_op  # noqa: E402
from flashgen.ops.prefill.backward import (  # noqa: E402
    backward_schema,
    uses_atomic_dq,
)
from flashgen.options import Options  # noqa: E402


def _qkv(spec, sq=5, sk=7, hq=2, hkv=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    dt = torch.float16 if spec.dtype == "fp16" else torch.bfloat16
    q = torch.randn(1, hq, sq, spec.head_dim, generator=g).to(dt).requires_grad_()
    k = torch.randn(1, hkv, sk, spec.head_dim, generator=g).to(dt).requires_grad_()
    v = torch.randn(1, hkv, sk, spec.head_dim_v, generator=g).to(dt).requires_grad_()
    return q, k, v


def _spy_backward(monkeypatch, spec) -> list:
    """Wrap ``torch.ops.flashgen.<name>__backward`` (as Backward.backward looks it up) and
    return the list its ``deterministic`` arguments are appended to."""
    name = f"{spec.name}__backward"
    real = getattr(torch.ops.flashgen, name)
    flags: list = []

    def spy(*args):
        flags.append(args[8])
        return real(*args)

    monkeypatch.setattr(torch.ops.flashgen, name, spy)
    return flags


def test_schemas_carry_the_flag():
    spec = load_spec(REPO / "specs" / "alibi.yaml")
    assert "float softmax_scale, bool deterministic, Tensor slopes, *" in backward_schema(spec)
    op = build_op(spec)
    fwd = op.torch_op._schema
    arg = [a for a in fwd.arguments if a.name == "deterministic"][0]
    assert arg.kwarg_only and arg.default_value is False


@pytest.mark.parametrize(
    ("atomic_dq", "deterministic", "atomic"),
    [(None, False, False), (None, True, False), (True, False, True), (True, True, False)]
    + [(False, False, False), (False, True, False)],
)
def test_atomic_dq_option_gate(atomic_dq, deterministic, atomic):
    assert uses_atomic_dq(deterministic, Options(atomic_dq=atomic_dq)) is atomic


def test_the_removed_switch_raises_naming_its_option(monkeypatch, tmp_path):
    import flashgen
    from flashgen.env import RemovedVariableError

    monkeypatch.setenv("FLASHGEN_ATOMIC_DQ", "1")
    with pytest.raises(RemovedVariableError, match="FLASHGEN_ATOMIC_DQ: use .*atomic_dq=True"):
        flashgen.load(REPO / "specs" / "gpt2_d64.yaml")


@pytest.mark.parametrize("deterministic", [None, False, True])
def test_flag_reaches_the_backward_op_in_eager_mode(deterministic):
    spec = load_spec(REPO / "specs" / "gpt2_d64.yaml")
    op = build_op(spec)
    q, k, v = _qkv(spec)
    kw = {} if deterministic is None else {"deterministic": deterministic}
    o, _ = op.attention(q, k, v, **kw)
    assert o.grad_fn.deterministic is bool(deterministic)  # set by setup_context
    with pytest.MonkeyPatch.context() as mp:
        flags = _spy_backward(mp, spec)
        o.float().sum().backward()
    assert flags == [bool(deterministic)]
    # the flag does not change the CPU gradients
    g = q.grad.clone()
    q.grad = None
    op.attention(q, k, v, deterministic=not deterministic)[0].float().sum().backward()
    torch.testing.assert_close(q.grad, g, atol=0, rtol=0)


def test_flag_must_be_a_bool():
    spec = load_spec(REPO / "specs" / "gpt2_d64.yaml")
    op = build_op(spec)
    q, k, v = _qkv(spec)
    with pytest.raises(OpInputError, match="deterministic: expected a bool"):
        op.attention(q, k, v, deterministic=1)


@pytest.mark.parametrize("deterministic", [False, True])
def test_torch_compile_fullgraph_passes_the_flag_to_the_backward_graph(deterministic):
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    spec = load_spec(REPO / "specs" / "causal_d128.yaml")
    op = build_op(spec)
    q, k, v = _qkv(spec, seed=3)
    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend=backend)
    def f(q, k, v):
        return op.attention(q, k, v, deterministic=deterministic)[0].float().sum()

    f(q, k, v).backward()
    g_compiled = [t.grad.clone() for t in (q, k, v)]
    flags = [
        n.args[8]
        for gm in graphs
        for n in gm.graph.nodes
        if n.op == "call_function" and "__backward" in str(n.target)
    ]
    assert flags == [deterministic]
    for t in (q, k, v):
        t.grad = None
    op.attention(q, k, v, deterministic=deterministic)[0].float().sum().backward()
    for a, t in zip(g_compiled, (q, k, v), strict=True):
        torch.testing.assert_close(a, t.grad)


@pytest.mark.parametrize("deterministic", [False, True])
def test_opcheck_with_the_flag(deterministic):
    spec = load_spec(REPO / "specs" / "mistral_swa.yaml")
    op = build_op(spec)
    q, k, v = _qkv(spec, sq=6, sk=6)
    torch.library.opcheck(op.torch_op, (q, k, v, 0.125, 3), {"deterministic": deterministic})
