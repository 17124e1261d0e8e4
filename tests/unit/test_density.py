"""The host estimate of kept keys per query row (``flashgen.ops.prefill.density``) and the choice of
the Hopper forward's sparse-mask tiles (``sparse_tiles``,
``family_build.build_forward(sparse=)``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from flashgen.codegen.plan import TileConfig  # noqa: E402
from flashgen.families.registry import compile_units  # noqa: E402
from flashgen.families.tiles import sparse_tiles  # noqa: E402
from flashgen.frontend import ir  # noqa: E402
from flashgen.frontend.spec import load_spec, loads_spec  # noqa: E402
from flashgen.ops.prefill import density  # noqa: E402
from flashgen.options import DEFAULT  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _spec(name: str):
    return load_spec(REPO / "specs" / f"{name}.yaml")


def _exact(spec, sq: int, sk: int, scalars: tuple) -> float:
    keep = density.mask_keep(spec, torch.arange(sq), torch.arange(sk), sq, sk, scalars)
    return keep.float().sum().item() / sq


@pytest.mark.parametrize(
    "name, scalars",
    [("causal_d128", ()), ("mistral_swa", (300,)), ("mistral_swa", (2000,)),
     ("chunked_local", (333,)), ("prefix_lm", (700,))],
)  # fmt: skip
@pytest.mark.parametrize("sq, sk", [(3000, 3000), (1000, 4097), (4097, 1000), (1, 777)])
def test_estimate_is_close_to_the_exact_count(name, scalars, sq, sk):
    spec = _spec(name)
    est = density.mean_keys_per_row(spec, sq, sk, scalars)
    exact = _exact(spec, sq, sk, scalars)
    # 16 rows and 2048 columns sampled: a few percent of seqlen_k either way
    assert abs(est - exact) <= 0.06 * sk + 2, (est, exact)


def test_no_mask_keeps_every_key_and_empty_lengths():
    spec = _spec("bidir_d256")
    assert density.mean_keys_per_row(spec, 100, 333, ()) == 333
    assert density.mean_keys_per_row(_spec("causal_d128"), 0, 10, ()) == 10
    assert density.mean_keys_per_row(_spec("causal_d128"), 10, 0, ()) == 0


def test_a_mask_that_reads_tensors_has_no_estimate():
    with pytest.raises(ValueError, match="reads tensors"):
        density.mean_keys_per_row(_spec("document_mask"), 64, 64, ())


def test_bucket():
    assert [density.bucket(n) for n in range(9)] == list(range(9))
    prev = 0
    for n in range(9, 5000):
        b = density.bucket(n)
        assert n <= b < n * 1.19 + 1 and b >= prev
        prev = b
    assert density.bucket(1 << 14) == 1 << 14


def test_estimate_uses_buckets(monkeypatch):
    spec = _spec("mistral_swa")
    calls = _count_estimates(monkeypatch)
    a = density.keys_per_row(spec, 16000, 16000, (1024,))
    b = density.keys_per_row(spec, 16100, 16100, (1024,))
    # one quarter octave: the same lengths evaluated (the op caches that answer once)
    assert a == b and [c[1:3] for c in calls] == [(16384, 16384)] * 2


def test_sparse_tiles_rules():
    dense = TileConfig(128, 160, 12)
    assert sparse_tiles(_spec("mistral_swa"), dense) == TileConfig(128, 128, 12)
    assert sparse_tiles(_spec("causal_d128"), dense) == TileConfig(128, 128, 12)
    assert sparse_tiles(_spec("bidir_d256"), TileConfig(128, 80, 12)) is None  # no mask
    assert sparse_tiles(_spec("document_mask"), TileConfig(128, 128, 12)) is None
    assert sparse_tiles(_spec("gemma2_softcap"), TileConfig(128, 80, 12)) is None  # d256
    assert sparse_tiles(_spec("causal_d128"), TileConfig(128, 64, 4)) is None  # FA2-class
    pinned = dataclasses.replace(_spec("causal_d128"), tiles=ir.TileOverride(128, 160, 12))
    assert sparse_tiles(pinned, dense) is None
    assert sparse_tiles(_spec("causal_d128"), TileConfig(128, 128, 12)) is None


def test_build_forward_takes_the_sparse_tiles_first(requires_nvcc):
    from flashgen.families.build import build_forward

    spec = loads_spec(
        "name: dens_window\nhead_dim: 128\ndtype: bf16\n"
        "mask: 'causal && q_idx + seqlen_k - seqlen_q - kv_idx < 256'\n",
        "dens_window.yaml",
    )
    plan, _, report = build_forward(spec, "sm_90", gpu="NVIDIA H200", sparse=True)
    assert plan.tiles == TileConfig(128, 128, 12) and not report.spill_bytes
    plan, _, _ = build_forward(spec, "sm_90", gpu="NVIDIA H200")
    assert plan.tiles == TileConfig(128, 160, 12)


def test_op_asks_for_sparse_tiles_per_call():
    from flashgen.ops.op import Dims, build_op

    spec = dataclasses.replace(_spec("mistral_swa"), name="dens_op_window")
    op = build_op(spec)
    assert op._sparse_possible
    long = Dims(1, 4, 4, 16384, 16384, 128)
    assert op._sparse_call(long, [256]) and not op._sparse_call(long, [4096])
    assert op._sparse_calls[(16384, 16384, 256)] is True
    off = op.with_options(DEFAULT.replace_path("sparse_tiles", False))
    assert not off._sparse_possible and not off._sparse_call(long, [256])
    assert op._sparse_call(long, [256])  # the default op's calls still do
    assert not build_op(
        dataclasses.replace(_spec("bidir_d256"), name="dens_op_bidir")
    )._sparse_possible
    assert not build_op(
        dataclasses.replace(_spec("document_mask"), name="dens_op_doc")
    )._sparse_possible


def test_the_estimate_stays_on_the_cpu_whatever_the_default_device_and_dtype():
    """Under ``torch.set_default_device("cuda")`` (or ``with torch.device("cuda")``, or the old
    ``set_default_tensor_type(torch.cuda.HalfTensor)``) the estimate must not make CUDA
    tensors: ``.item()`` would sync the device at every new length and fail inside a CUDA-graph
    capture.  The meta device stands in for CUDA here (``.item()`` raises there); a float16
    default dtype must not overflow ``linspace`` at long lengths either."""
    spec = _spec("mistral_swa")
    want = density.mean_keys_per_row(spec, 1000, 100_000, (256,))
    with torch.device("meta"):
        assert density.mean_keys_per_row(spec, 1000, 100_000, (256,)) == want
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        assert density.mean_keys_per_row(spec, 1000, 100_000, (256,)) == want
    finally:
        torch.set_default_dtype(old)


def test_op_estimate_under_a_default_device():
    from flashgen.ops.op import Dims, build_op

    op = build_op(dataclasses.replace(_spec("causal_d128"), name="dens_op_meta"))
    with torch.device("meta"):
        assert op._sparse_call(Dims(1, 4, 4, 1000, 1000, 128), [])


def _count_estimates(monkeypatch) -> list:
    calls = []
    real = density.mean_keys_per_row

    def counted(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(density, "mean_keys_per_row", counted)
    return calls


def test_a_scalar_the_mask_does_not_read_is_no_part_of_the_key(monkeypatch):
    """A float param only the score_mod reads (a soft-cap, a temperature) may change at every
    call: it must not cost an estimate (0.5 ms) per value, nor fill the op's cache."""
    from flashgen.ops.op import Dims, build_op

    spec = loads_spec(
        "name: dens_softcap\nhead_dim: 128\ndtype: bf16\nmask: causal\n"
        "score_mod: softcap * tanh(score / softcap)\n"
        "params:\n  softcap: {type: f32, default: 50.0}\n",
        "dens_softcap.yaml",
    )
    op = build_op(spec)
    assert op._sparse_possible
    calls = _count_estimates(monkeypatch)
    dims = Dims(1, 4, 4, 4096, 4096, 128)
    assert all(op._sparse_call(dims, [10.0 + i / 7]) for i in range(50))
    assert len(calls) == 1 and len(op._sparse_calls) == 1


def test_a_decoding_loop_hits_the_op_cache(monkeypatch):
    """Growing lengths (decoding: seqlen_q 1, seqlen_k + 1 per call) evaluate a few masks per
    doubling: one per quarter octave, not one per length."""
    from flashgen.ops.op import Dims, build_op

    op = build_op(dataclasses.replace(_spec("mistral_swa"), name="dens_op_decode"))
    calls = _count_estimates(monkeypatch)
    for sk in range(1, 3001):
        op._sparse_call(Dims(1, 4, 4, 1, sk, 128), [1024])
    assert len(calls) <= 4 * 12 + 9 and len(op._sparse_buckets) == len(calls)


def test_first_use_loads_both_kernels(monkeypatch):
    """op.kernel builds and loads the dense and the sparse-mask kernel together (a later call,
    e.g. inside a CUDA-graph capture, at a length that needs the other one loads nothing); the
    sparse kernel is the persistent dynamic one by default; an op with
    ``Options.sparse_persistent='off'``: a non-persistent sparse kernel; with a persistent dense
    kernel (``Options.persistent``) the op builds that one only.  The compiler, loader and device
    queries are faked (no GPU)."""
    from types import SimpleNamespace

    import flashgen.ops.prefill.attention_kernels as kernels_mod
    import flashgen.runtime.launch as runtime
    from flashgen.families import build as family_build
    from flashgen.ops.op import build_op

    built = []

    def fake_build(spec, target, gpu=None, options=DEFAULT, persistent=False, sparse=False):
        built.append((sparse, persistent))
        return SimpleNamespace(tiles="sparse" if sparse else "dense"), f"cubin{sparse}", None

    monkeypatch.setattr(family_build, "build_forward", fake_build)
    monkeypatch.setattr(runtime, "load", lambda cubin, plan, index: SimpleNamespace(plan=plan))
    monkeypatch.setattr(kernels_mod, "target_for_device", lambda spec, device: "sm_90")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    op = build_op(dataclasses.replace(_spec("mistral_swa"), name="dens_op_twins"))
    dev = torch.device("cuda", 0)
    assert op.kernel(dev).plan.tiles == "dense"
    assert built == [(False, False), (True, "dynamic")]
    assert op.kernel(dev, sparse=True).plan.tiles == "sparse" and len(built) == 2
    off = op.with_options(DEFAULT.replace_path("sparse_persistent", "off"))
    assert off.kernel(dev, sparse=True).plan.tiles == "sparse"  # its own op and kernels
    assert built[2:] == [(True, False), (False, False)]
    del built[2:]
    static = op.with_options(DEFAULT.replace_path("persistent", "static"))
    assert static.kernel(dev, sparse=True).plan.tiles == "dense"  # persistent: never sparse
    assert built[2:] == [(False, "static")]


def test_sparse_persistent_option():
    """``Options.sparse_persistent`` (default dynamic) names the sparse calls' persistent
    scheduler, masks that divide included (the persistent producer walks warp-wide); the CI
    compile units follow it."""
    off = DEFAULT.replace_path("sparse_persistent", "off")
    for name in ("mistral_swa", "chunked_local"):
        assert compile_units(_spec(name), "sm_90", off)["fwd_sparse"].context[
            "scheduler"
        ] is None  # fmt: skip
    assert DEFAULT.sparse_persistent == "dynamic"
    for value in ("dynamic", "static", "m_major"):
        options = DEFAULT.replace_path("sparse_persistent", value)
        for name in ("mistral_swa", "chunked_local"):
            unit = compile_units(_spec(name), "sm_90", options)["fwd_sparse"]
            assert unit.context["scheduler"] == value and unit.tiles.block_n == 128, name
            assert unit.context["warp_walk"], name
    with pytest.raises(ValueError, match="sparse_persistent: expected one of .*, got 'sometimes'"):
        DEFAULT.replace_path("sparse_persistent", "sometimes")
