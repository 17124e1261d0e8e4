"""The forward op's per-call choice of the Hopper tiles for sparse masks
(``registry.sparse_tiles``: 128 x 128 in place of 128 x 160 at head_dim 128 when the mask keeps
fewer than ``tiles.SPARSE_KEYS_PER_ROW`` keys per query row, ``flashgen.ops.prefill.density``) on an
sm_90 GPU: both kernels against the fp64 reference with the 2x rule (``test_forward.check``, outputs
poisoned), the sparse one where the mask keeps few keys per row, the dense one (an op bound to
``Options(sparse_tiles=False)``) at the same lengths and by itself where the mask keeps many.

    python3 -m pytest tests/gpu/test_sparse_tiles_gpu.py -q
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_options  # noqa: E402
from test_forward import check  # noqa: E402

from flashgen.families.tiles import SPARSE_KEYS_PER_ROW  # noqa: E402
from flashgen.frontend.spec import load_spec  # noqa: E402
from flashgen.ops.prefill import density  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]

#: key -> (shipped spec, params, (hq, hkv))
CASES = {
    "causal_d128": ("causal_d128", {}, (4, 2)),
    "window_300": ("mistral_swa", {"window": 300}, (4, 2)),
    "chunked_333": ("chunked_local", {"chunk": 333}, (2, 2)),
    "prefix_200": ("prefix_lm", {"prefix": 200}, (2, 2)),
    "alibi": ("alibi", {}, (2, 2)),
    "llama3_gqa": ("llama3_gqa", {}, (8, 2)),
}
LENGTHS = [(1000, 1000), (127, 1000), (1031, 4097), (1, 1000), (1000, 127)]


def _env(monkeypatch, sparse: str = "1", **more) -> None:
    """Ops of the default (Hopper, non-persistent) forward, non-persistent sparse calls too,
    with ``Options.sparse_tiles`` ``sparse == "1"`` (:mod:`gpu_options`); ``more``: other
    options by dotted name."""
    values = {"sparse_tiles": sparse == "1", "sparse_persistent": "off", **more}
    gpu_options.use(monkeypatch, values, family="auto", persistent="off")


def build_op(spec):
    return gpu_options.build(spec)


def _keys_per_row(spec, sq: int, sk: int, scalars: tuple) -> float:
    """The exact mean number of keys ``spec``'s mask keeps per query row (asserted far from
    the rule's threshold, so the host estimate's sampling cannot flip the choice)."""
    if spec.mask is None:
        n = float(sk)
    else:
        keep = density.mask_keep(spec, torch.arange(sq), torch.arange(sk), sq, sk, scalars)
        n = keep.float().sum().item() / sq
    assert abs(n - SPARSE_KEYS_PER_ROW) > 0.2 * SPARSE_KEYS_PER_ROW, (spec.name, sq, sk, n)
    return n


def _sparse_lengths(base, params) -> list[bool]:
    """Per entry of LENGTHS, whether the mask keeps few keys per row there (exact counts)."""
    scalars = tuple(params.get(p.name, p.default) for p in base.scalar_params)
    return [_keys_per_row(base, sq, sk, scalars) < SPARSE_KEYS_PER_ROW for sq, sk in LENGTHS]


def _record_tiles(op, monkeypatch) -> list:
    """The plan of the kernel each later call of ``op`` runs (appended per call; the op
    loads both kernels on first use, so which ones are loaded says nothing)."""
    ran, kernel = [], op.kernel

    def spy(device, **kw):
        kern = kernel(device, **kw)
        ran.append(kern.plan)
        return kern

    monkeypatch.setattr(op, "kernel", spy)
    return ran


@pytest.mark.parametrize("mode", ["auto", "dense"])
@pytest.mark.parametrize("key", sorted(CASES))
def test_sparse_and_dense_tiles(key, mode, monkeypatch, error_bound):
    _env(monkeypatch, "1" if mode == "auto" else "0")
    name, params, (hq, hkv) = CASES[key]
    base = load_spec(REPO / "specs" / f"{name}.yaml")
    spec = dataclasses.replace(base, name=f"{base.name}_st_{mode}")  # its own op per mode
    ran = _record_tiles(build_op(spec), monkeypatch)
    for sq, sk in LENGTHS:
        check(spec, 1, hq, hkv, sq, sk, error_bound, seed=sq + 5 * sk, **params)
    assert len(ran) == len(LENGTHS)
    block_n = [p.tiles.block_n for p in ran]
    if mode == "auto":  # 128 x 128 where the mask keeps few keys per row (exact counts)
        assert block_n == [128 if few else 160 for few in _sparse_lengths(base, params)]
    else:
        assert all(n != 128 for n in block_n), block_n


@pytest.mark.parametrize("key", sorted(CASES))
def test_sparse_calls_on_the_persistent_kernel(key, monkeypatch, error_bound):
    """``Options.sparse_persistent`` at its default (dynamic): the calls that keep few keys
    per row run the persistent 128 x 128 kernel, its producer walking warp-wide (masks that
    divide included), the others the non-persistent dense one; all against the reference."""
    _env(monkeypatch, sparse_persistent="dynamic")
    name, params, (hq, hkv) = CASES[key]
    base = load_spec(REPO / "specs" / f"{name}.yaml")
    spec = dataclasses.replace(base, name=f"{base.name}_st_persistent")
    op = build_op(spec)
    ran = _record_tiles(op, monkeypatch)
    for sq, sk in LENGTHS:  # check builds the same op (spec and options): the spy sees it
        check(spec, 1, hq, hkv, sq, sk, error_bound, seed=sq + 7 * sk, **params)
    want = [(128, "dynamic", True) if few else (160, None, False)
            for few in _sparse_lengths(base, params)]  # fmt: skip
    got = [(p.tiles.block_n, p.context.get("scheduler"), p.context["warp_walk"]) for p in ran]
    assert got == want, got


#: key -> (shipped spec, params, (hq, hkv), (sq, sk)): sparse calls
WALK_CASES = {
    "chunked_333": ("chunked_local", {"chunk": 333}, (2, 2), (1031, 4097)),
    "chunked_1024": ("chunked_local", {"chunk": 1024}, (3, 1), (5000, 5000)),
    "window_300": ("mistral_swa", {"window": 300}, (4, 2), (1000, 1000)),
    "prefix_200": ("prefix_lm", {"prefix": 200}, (2, 2), (127, 1000)),
}


@pytest.mark.parametrize("key", sorted(WALK_CASES))
def test_persistent_walks_are_bitwise_the_non_persistent_kernel(key, monkeypatch):
    """The sparse calls' persistent kernel, its producer walking warp-wide (fg::iv::WarpWalk,
    a fresh window per tile) or one classifier call at a time (prev_live,
    ``hopper_fwd.warp_walk`` False), computes the non-persistent kernel's outputs bit for
    bit (same blocks, same classes, same per-tile arithmetic); outputs poisoned first."""
    from flashgen.ops.op import poison_outputs

    name, params, (hq, hkv), (sq, sk) = WALK_CASES[key]
    base = load_spec(REPO / "specs" / f"{name}.yaml")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(sq + sk)
    q = torch.randn(1, hq, sq, 128, device=dev, generator=gen).bfloat16()
    k, v = (torch.randn(1, hkv, sk, 128, device=dev, generator=gen).bfloat16() for _ in "kv")
    modes = {"nonpers": ("off", True, None), "warp": ("dynamic", True, True),
             "serial": ("dynamic", False, False)}  # fmt: skip
    outs = {}
    for mode, (sched, walk, want_walk) in modes.items():
        _env(monkeypatch, sparse_persistent=sched, **{"hopper_fwd.warp_walk": walk})
        op = build_op(dataclasses.replace(base, name=f"{base.name}_st_walk_{mode}"))
        ran = _record_tiles(op, monkeypatch)
        with poison_outputs():
            outs[mode] = op.attention(q, k, v, **params)
        torch.cuda.synchronize()
        (plan,) = ran
        assert plan.tiles.block_n == 128, (mode, plan.tiles)
        if want_walk is None:
            assert not plan.context["persistent"], mode
        else:
            assert plan.context["scheduler"] == "dynamic", mode
            assert plan.context["warp_walk"] is want_walk, mode
    o, lse = outs["nonpers"]
    assert not o.isnan().any() and not lse.isnan().any()
    for mode in ("warp", "serial"):
        assert torch.equal(outs[mode][0], o) and torch.equal(outs[mode][1], lse), mode


def test_long_causal_keeps_the_dense_tiles(monkeypatch, error_bound):
    _env(monkeypatch)
    base = load_spec(REPO / "specs" / "causal_d128.yaml")
    spec = dataclasses.replace(base, name="causal_d128_st_long")
    ran = _record_tiles(build_op(spec), monkeypatch)
    check(spec, 1, 2, 2, 8192, 8192, error_bound, seed=3)  # ~4096 keys per row: dense
    check(spec, 1, 2, 2, 3000, 3000, error_bound, seed=4)  # ~1500: sparse
    assert [p.tiles.block_n for p in ran] == [160, 128], ran


def _capture_and_compare(op, warm, capture, params):
    """Warm the op up at lengths ``warm`` (eager, on the capture stream), then capture one
    call at lengths ``capture`` under ``torch.device("cuda")`` as the default device, replay
    it and compare with an eager call (bitwise: the same kernel)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(11)

    def qkv(s):
        return [torch.randn(1, 2, s, 128, device=dev, generator=gen).bfloat16() for _ in "qkv"]

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            op.attention(*qkv(warm), **params)
    torch.cuda.synchronize()
    q, k, v = qkv(capture)
    g = torch.cuda.CUDAGraph()
    with torch.device("cuda"), torch.cuda.graph(g, stream=s):
        o_g, lse_g = op.attention(q, k, v, **params)
    g.replay()
    torch.cuda.synchronize()
    o_e, lse_e = op.attention(q, k, v, **params)
    torch.cuda.synchronize()
    assert torch.equal(o_g, o_e) and torch.equal(lse_g, lse_e), "graph != eager"


#: (warm-up length, capture length, tiles of the calls: warm-up x 2, capture, eager)
CAPTURES = {
    # the estimate for a length the op has not seen runs inside the capture: it must make no
    # CUDA tensor (the default device is CUDA there) and sync nothing; both lengths keep few
    # keys per row (~500, ~1500)
    "new_length": (1000, 3000, [128, 128, 128, 128]),
    # the capture needs the other kernel: the op loaded both at its first call (op.kernel)
    "other_kernel": (8192, 1000, [160, 160, 128, 128]),
}


@pytest.mark.parametrize("case", sorted(CAPTURES))
def test_capture(case, monkeypatch):
    _env(monkeypatch)
    warm, capture, tiles = CAPTURES[case]
    base = load_spec(REPO / "specs" / "causal_d128.yaml")
    op = build_op(dataclasses.replace(base, name=f"causal_d128_st_capture_{case}"))
    ran = _record_tiles(op, monkeypatch)
    _capture_and_compare(op, warm, capture, {})
    assert [p.tiles.block_n for p in ran] == tiles, ran
