"""The Hopper forward's host fast path on the GPU (``pytest -m gpu``; needs sm_90 for the
TMA kernel, else skipped): with the CUtensorMap descriptor cache and the prepared argument
block (:mod:`flashgen.runtime.tma`, :mod:`flashgen.runtime.launch`), results are bitwise those of
the
uncached path, across different tensors, views, lengths, a tensor reallocated at a freed
one's address (same and other geometry), and CUDA graph capture with a warm or a cold
cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen.bench.verify import random_inputs  # noqa: E402
from flashgen.runtime import tma  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def hopper(monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the TMA kernel needs a compute capability 9.x GPU")
    tma.descriptors.enabled = True
    yield
    tma.descriptors.enabled = True


def load(name):
    op = flashgen.load(REPO / "specs" / f"{name}.yaml")
    assert op.kernel(torch.device("cuda")).plan.tma, "expected the TMA kernel"
    return op


def run(op, q, k, v, params, cached: bool):
    tma.descriptors.enabled = cached
    try:
        o, lse = op.attention(q, k, v, **params)
        torch.cuda.synchronize()
    finally:
        tma.descriptors.enabled = True
    return o, lse


def same(a, b):
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


CASES = [  # b, hq, hkv, sq, sk, layout
    (1, 16, 16, 1024, 1024, "bhsd"),
    (2, 4, 2, 17, 1000, "bhsd"),
    (2, 4, 2, 1000, 17, "bshd"),
    (1, 8, 1, 127, 127, "bshd"),
    (3, 2, 2, 1, 4097, "bhsd"),
]


@pytest.mark.parametrize("name", ["causal_d128", "alibi", "document_mask"])
def test_cached_path_is_bitwise_the_uncached_one_across_tensors(name):
    op = load(name)
    gen = torch.Generator(device="cuda").manual_seed(0)
    tma.descriptors.clear()
    for b, hq, hkv, sq, sk, layout in CASES:
        q, k, v, params = random_inputs(op.spec, b, hq, hkv, sq, sk, torch.device("cuda"), gen)
        if layout == "bshd":
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        ref = run(op, q, k, v, params, cached=False)
        for _ in range(2):  # a miss, then a hit
            assert same(run(op, q, k, v, params, cached=True), ref), (b, hq, hkv, sq, sk, layout)
    assert tma.descriptors.hits > 0


def test_reallocated_address_same_and_other_geometry():
    """A tensor freed and another allocated at its address: same geometry reuses the
    descriptor (correct: it holds only address and geometry), other geometry misses."""
    op = load("causal_d128")
    gen = torch.Generator(device="cuda").manual_seed(1)
    buf = torch.empty(2 * 8 * 512 * 128, device="cuda", dtype=torch.bfloat16)
    results = []
    for shape in [(2, 8, 512, 128), (2, 8, 512, 128), (1, 8, 1024, 128), (4, 8, 256, 128)]:
        q = buf.view(shape)
        q.copy_(torch.randn(shape, device="cuda", generator=gen))
        k, v = (torch.randn(shape, device="cuda", generator=gen).bfloat16() for _ in range(2))
        ref = run(op, q, k, v, {}, cached=False)
        got = run(op, q, k, v, {}, cached=True)
        assert same(got, ref), shape
        results.append(got)
    # freed and reallocated by the caching allocator (usually at the same address)
    for seed in (2, 3):
        gen.manual_seed(seed)
        q, k, v = (torch.randn(1, 16, 777, 128, device="cuda", generator=gen).bfloat16()
                   for _ in range(3))  # fmt: skip
        assert same(run(op, q, k, v, {}, cached=True), run(op, q, k, v, {}, cached=False))
        del q, k, v


def test_warm_calls_encode_nothing():
    op = load("causal_d128")
    q, k, v = (torch.randn(1, 16, 512, 128, device="cuda").bfloat16() for _ in range(3))
    op.attention(q, k, v)
    tma.descriptors.clear()
    op.attention(q, k, v)
    assert tma.descriptors.misses == 3
    for _ in range(5):
        op.attention(q, k, v)
    torch.cuda.synchronize()
    assert tma.descriptors.misses == 3 and tma.descriptors.hits == 15


@pytest.mark.parametrize("warm", [True, False])
def test_graph_capture_with_warm_and_cold_cache(warm):
    op = load("alibi")
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, k, v, params = random_inputs(op.spec, 2, 4, 2, 300, 517, torch.device("cuda"), gen)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            op.attention(q, k, v, **params)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    if not warm:
        tma.descriptors.clear()  # encode during capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        o_g, lse_g = op.attention(q, k, v, **params)
    for seed in (5, 6):
        gen.manual_seed(seed)
        q2, k2, v2, p2 = random_inputs(op.spec, 2, 4, 2, 300, 517, torch.device("cuda"), gen)
        q.copy_(q2)
        k.copy_(k2)
        v.copy_(v2)
        params["slopes"].copy_(p2["slopes"])
        g.replay()
        torch.cuda.synchronize()
        ref = run(op, q2, k2, v2, p2, cached=False)
        assert torch.equal(o_g, ref[0]) and torch.equal(lse_g, ref[1]), "graph != eager"
