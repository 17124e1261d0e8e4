"""The persistent Hopper forward (ops bound to ``Options(persistent="static")`` and the other
schedulers) on an sm_90 GPU against the
float64 reference (``pytest -m gpu``; skipped without an sm_90 device).

What it checks: the forward matrix of tests/gpu/test_forward.py that matters for the tile
loop (odd lengths 1 / 17 / 127 / 1000 / 4097, Sq != Sk, GQA, causal on and off, head dims
64 / 128 / 256, every shipped spec) and document masks with random documents (sorted and
unsorted ids, rows and whole query blocks with nothing to attend to), all with poisoned
outputs (NaN-filled before the launch: every element must be written).  Grids: the real SM
count (one CTA per SM, many tiles each at 4097) and forced small grids of 1 and 7 CTAs
(``Options.persistent_ctas``), which run every tile of a problem through few CTAs, empty tiles
and all: the mbarrier phases (q_full / q_empty per tile, the K/V ring across tiles) and the
double-buffered tile info get exercised hundreds of times per CTA.  The persistent output
must also match the non-persistent kernel's (same per-tile arithmetic: bitwise, reported as
the max difference when not).

Accuracy bound as in test_forward.py: max|ours - ref64| <= 2 * max|ref in the input dtype -
ref64| + 1e-3; lse relative error <= 1e-2; rows with nothing kept give o = 0, lse = -inf.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import gpu_options  # noqa: E402

from flashgen.bench.verify import random_inputs  # noqa: E402
from flashgen.frontend import ir  # noqa: E402
from flashgen.frontend.spec import load_spec, loads_spec  # noqa: E402
from flashgen.ops.op import poison_outputs  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
SPECS = {  # fp8 specs have no persistent kernel, v_from_k specs (decode only) no forward
    p.stem: p for p in sorted((REPO / "specs").glob("*.yaml"))
    if "fp8" not in p.stem and not load_spec(p).v_from_k
}  # fmt: skip


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(autouse=True)
def persistent(monkeypatch):
    """Every case runs the persistent Hopper kernel (skipped where there is none)."""
    if not _sm90():
        pytest.skip("the persistent forward is the sm_90 (Hopper) kernel's")
    gpu_options.use(monkeypatch, family="auto", persistent="static")


@pytest.fixture(scope="module", autouse=True)
def prebuild():
    """Compile every kernel the module runs in parallel first (one nvcc per core): the
    tests' sequential calls then hit the kernel cache."""
    if not _sm90():
        return
    from concurrent.futures import ThreadPoolExecutor

    from flashgen.build import cache
    from flashgen.build.render import render
    from flashgen.families.build import build_forward
    from flashgen.families.registry import plan_block_table

    gpu = torch.cuda.get_device_name()
    specs = [shipped(n) for n in SPECS] + [PER_HEAD]
    specs += [variant(shipped("causal_d128"), causal=c, head_dim=d)
              for c in (True, False) for d in (64, 128, 256)]  # fmt: skip
    jobs = [(s, "static") for s in specs] + [(shipped(n), False) for n, _, _ in SAME]
    others = [shipped(n) for n, _, _ in SAME] + [variant(shipped("causal_d128"), causal=c)
                                                 for c in (True, False)]  # fmt: skip
    jobs += [(s, sched) for sched in ("m_major", "dynamic") for s in others]

    def build(job):
        spec, persistent = job
        plan, _, _ = build_forward(spec, "sm_90", gpu=gpu, persistent=persistent)
        if plan.context["block_table"]:
            pre = plan_block_table(spec, "sm_90", plan.tiles)
            cache.get_or_build(render(pre), pre)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:
        list(pool.map(build, jobs))


@pytest.fixture(params=["static", "m_major", "dynamic"])
def scheduler(request, monkeypatch):
    """The tile scheduler (``Options.persistent``), for the tests that take it; the others
    run ``static``."""
    gpu_options.update(monkeypatch, persistent=request.param)
    return request.param


@pytest.fixture(params=[None, 1, 7], ids=["sms", "grid1", "grid7"])
def grid(request, monkeypatch):
    """The persistent grid: the device's SM count, or a forced small one
    (``Options.persistent_ctas``)."""
    gpu_options.update(monkeypatch, persistent_ctas=request.param)
    return request.param


def shipped(name: str) -> ir.Spec:
    return load_spec(SPECS[name])


PER_HEAD = loads_spec(
    "name: gpu_persist_perhead\nhead_dim: 128\ndtype: bf16\n"
    "mask: 'causal && (q_idx - kv_idx < win[h] || doc[kv_idx] == 0)'\n"
    "params:\n  win: {type: i32, shape: [num_heads]}\n  doc: {type: i32, shape: [seqlen_k]}\n",
    "perhead.yaml",
)
#: compared with the non-persistent kernel (test_matches_non_persistent)
SAME = [("causal_d128", 4097, 4097), ("document_mask", 4097, 4097), ("bidir_d256", 1000, 1031),
        ("gpt2_d64", 2049, 2049), ("alibi", 1000, 1000)]  # fmt: skip


def variant(spec: ir.Spec, *, causal: bool | None = None, head_dim: int | None = None):
    changes, suffix = {}, ""
    if causal is not None:
        changes["mask"] = ir.Causal() if causal else None
        suffix += "_causal" if causal else "_nomask"
    if head_dim is not None and head_dim != spec.head_dim:
        changes.update(head_dim=head_dim, head_dim_v=head_dim)
        suffix += f"_d{head_dim}"
    return dataclasses.replace(spec, name=spec.name + suffix, **changes) if changes else spec


def run(spec, q, k, v, params):
    op = gpu_options.build(spec)
    with poison_outputs():
        o, lse = op.attention(q, k, v, **params)
    torch.cuda.synchronize()
    plan = op.kernel(q.device).plan
    assert plan.template == "sm_90/fwd.cu.j2" and plan.context["persistent"], "not persistent"
    assert plan.context["scheduler"] == op.options.persistent
    return o, lse


def check(spec, q, k, v, params, error_bound):
    """The persistent kernel's o, lse against the fp64 reference."""
    o, lse = run(spec, q, k, v, params)
    b, hq, sq, _ = q.shape
    assert o.shape == (b, hq, sq, spec.head_dim_v) and lse.shape == (b, hq, sq)
    assert not o.isnan().any(), "o has NaN: an element was not written"
    assert not lse.isnan().any(), "lse has NaN: an element was not written"
    if o.numel() == 0:
        return o, lse
    ref_o, ref_lse, bound = error_bound(spec, q, k, v, params)
    err = (o.double() - ref_o).abs().max().item()
    where = f"{spec.name} {list(q.shape)} Sk={k.shape[2]}"
    assert err <= bound, f"{where}: {err:.3e} > {bound:.3e}"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), f"{where}: rows with nothing kept differ"
    assert (o[empty] == 0).all()
    fin = ~empty
    if fin.any():
        rel = ((lse[fin] - ref_lse[fin]).abs() / (1 + ref_lse[fin].abs())).max().item()
        assert rel <= 1e-2, f"{where}: lse off by {rel:.3e}"
    return o, lse


def inputs(spec, b, hq, hkv, sq, sk, seed):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    q, k, v, params = random_inputs(spec, b, hq, hkv, sq, sk, dev, gen)
    if spec.param("window") is not None:
        params["window"] = 37
    return q, k, v, params


# ----------------------------------------------------------------------------- lengths x causal
@pytest.mark.parametrize(
    "sq, sk",
    [(1, 1), (17, 17), (127, 127), (1000, 1000), (4097, 4097), (1, 4097), (4097, 1),
     (127, 1000), (1000, 127), (17, 4097)],
)  # fmt: skip
@pytest.mark.parametrize("causal", [True, False])
def test_lengths(sq, sk, causal, grid, error_bound):
    if grid is not None and sq * sk > 1000 * 1000:
        pytest.skip("small grids: the shorter problems (each CTA still takes many tiles)")
    spec = variant(shipped("causal_d128"), causal=causal)
    check(spec, *inputs(spec, 2, 3, 1, sq, sk, seed=sq + 3 * sk), error_bound)


@pytest.mark.parametrize("sq, sk", [(17, 17), (1000, 1000), (127, 1000), (4097, 127)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("scheduler", ["m_major", "dynamic"], indirect=True)
def test_lengths_schedulers(sq, sk, causal, scheduler, monkeypatch, error_bound):
    """The other schedulers on causal / non-causal problems through 5 CTAs."""
    gpu_options.update(monkeypatch, persistent_ctas=5)
    spec = variant(shipped("causal_d128"), causal=causal)
    check(spec, *inputs(spec, 2, 3, 1, sq, sk, seed=sq + 5 * sk), error_bound)


def test_dynamic_counter_resets(monkeypatch, error_bound):
    """The dynamic scheduler's counter is left at zero by every launch: repeated launches,
    two streams, a CUDA graph replayed, all give the same output."""
    gpu_options.update(monkeypatch, persistent="dynamic", persistent_ctas=7)
    spec = DOC
    q, k, v, params = inputs(spec, 2, 4, 2, 2049, 2049, seed=4)
    op = gpu_options.build(spec)
    o0, lse0 = check(spec, q, k, v, params, error_bound)
    for _ in range(5):
        o, lse = op.attention(q, k, v, **params)
        assert torch.equal(o, o0) and torch.equal(lse, lse0)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = []
    for _ in range(3):
        for st in streams:
            st.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(st):
                outs.append(op.attention(q, k, v, **params)[0])
    torch.cuda.synchronize()
    assert all(torch.equal(o, o0) for o in outs)
    bm = op.block_mask(2049, 2049, **params)
    op.attention(q, k, v, block_mask=bm, **params)  # warm: builds nothing in the capture
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        op.attention(q, k, v, block_mask=bm, **params)  # the stream's counter, outside the capture
        with torch.cuda.graph(g, stream=s):
            og, _ = op.attention(q, k, v, block_mask=bm, **params)
    for _ in range(3):
        og.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(og, o0)


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_head_dims(d, causal, grid, error_bound):
    """d64 (separate O staging, 192-wide steps) and d256 (the epilogue stages in sQ: the next
    tile's Q waits for it)."""
    spec = variant(shipped("causal_d128"), causal=causal, head_dim=d)
    sq, sk = (1000, 1031) if grid is not None else (4097, 4097)
    check(spec, *inputs(spec, 2, 2, 1, sq, sk, seed=d), error_bound)


@pytest.mark.parametrize("hq, hkv, sq, sk", [(32, 8, 1000, 1000), (8, 1, 127, 1000)])
def test_gqa(hq, hkv, sq, sk, grid, error_bound):
    spec = shipped("llama3_gqa")
    check(spec, *inputs(spec, 1, hq, hkv, sq, sk, seed=hq), error_bound)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("sq, sk", [(127, 127), (17, 1000), (1000, 17), (2049, 1031)])
def test_shipped_spec(name, sq, sk, error_bound):
    spec = shipped(name)
    check(spec, *inputs(spec, 2, 4, 2, sq, sk, seed=sq * 7 + sk), error_bound)


@pytest.mark.parametrize("name", ["mistral_swa", "chunked_local", "gemma2_softcap", "alibi"])
def test_shipped_spec_small_grid(name, monkeypatch, error_bound):
    """Classifier walks (window, chunks: EMPTY tiles in the middle of a row) and score_mods
    through 3 CTAs."""
    gpu_options.update(monkeypatch, persistent_ctas=3)
    spec = shipped(name)
    q, k, v, params = inputs(spec, 2, 2, 1, 1000, 1000, seed=11)
    if spec.param("chunk") is not None:
        params["chunk"] = 300
    check(spec, q, k, v, params, error_bound)


# ----------------------------------------------------------------------------- document masks
DOC = shipped("document_mask")


def doc_ids(b, s, n, gen, *, sort=True, offset=0):
    t = torch.randint(0, n, (b, s), device="cuda", generator=gen, dtype=torch.int32) + offset
    return t.sort(-1).values if sort else t


@pytest.mark.parametrize(
    "sq, sk, ndocs, sort",
    [(4097, 4097, 6, True), (1000, 4097, 3, True), (4097, 1000, 5, True), (127, 127, 2, True),
     (1000, 1000, 4, False), (17, 1000, 3, False), (1, 17, 2, True)],
)  # fmt: skip
def test_document_mask(sq, sk, ndocs, sort, grid, scheduler, error_bound):
    """Random documents: sorted ids (packed documents: EMPTY, FULL and PARTIAL tiles) and
    unsorted ones (queries with no earlier key of their document: empty rows)."""
    if grid is not None and sq * sk > 1000 * 4097:
        pytest.skip("small grids: the shorter problems")
    gen = torch.Generator(device="cuda").manual_seed(sq + sk + ndocs)
    q, k, v, _ = inputs(DOC, 2, 4, 2, sq, sk, seed=sq)
    params = {"doc_q": doc_ids(2, sq, ndocs, gen, sort=sort),
              "doc_kv": doc_ids(2, sk, ndocs, gen, sort=sort)}  # fmt: skip
    check(DOC, q, k, v, params, error_bound)


def test_document_mask_empty_query_blocks(grid, scheduler, error_bound):
    """Query documents that no key has: whole query blocks (tiles) with no live key block, so
    the producer hands over tiles without Q or K/V loads, between live ones."""
    sq = sk = 2000
    gen = torch.Generator(device="cuda").manual_seed(5)
    doc_q = doc_ids(2, sq, 4, gen)
    doc_kv = doc_q.clone()
    doc_q[:, 300:700] = 100  # ids no key has: ~3 empty query blocks per (batch, head)
    doc_q[:, 1500:1800] = 101
    q, k, v, _ = inputs(DOC, 2, 3, 3, sq, sk, seed=6)
    o, lse = check(DOC, q, k, v, {"doc_q": doc_q, "doc_kv": doc_kv}, error_bound)
    assert torch.isneginf(lse[:, :, 300:700]).all() and (o[:, :, 300:700] == 0).all()


def test_all_tiles_empty(grid, scheduler):
    gen = torch.Generator(device="cuda").manual_seed(9)
    q, k, v, _ = inputs(DOC, 2, 2, 2, 1000, 1000, seed=9)
    params = {"doc_q": doc_ids(2, 1000, 3, gen), "doc_kv": doc_ids(2, 1000, 3, gen, offset=10)}
    o, lse = run(DOC, q, k, v, params)
    assert torch.isneginf(lse).all() and (o == 0).all()


def test_per_head_tensor_mask(grid, error_bound):
    spec = PER_HEAD
    q, k, v, _ = inputs(spec, 2, 4, 2, 1000, 1000, seed=3)
    gen = torch.Generator(device="cuda").manual_seed(3)
    win = torch.tensor([1, 50, 300, 5000], device="cuda", dtype=torch.int32)
    doc = torch.randint(0, 30, (1000,), device="cuda", generator=gen, dtype=torch.int32)
    check(spec, q, k, v, {"win": win, "doc": doc}, error_bound)


# ----------------------------------------------------------------------------- = non-persistent
@pytest.mark.parametrize("name, sq, sk", SAME)
def test_matches_non_persistent(name, sq, sk, scheduler, monkeypatch, error_bound):
    """Same per-tile arithmetic: the persistent output equals the non-persistent kernel's
    (bitwise expected; at least within the accuracy bound of each other)."""
    spec = shipped(name)
    q, k, v, params = inputs(spec, 2, 4, 2, sq, sk, seed=1)
    o1, lse1 = run(spec, q, k, v, params)
    plain = gpu_options.build(spec, gpu_options.CURRENT.replace_path("persistent", "off"))
    with poison_outputs():
        o0, lse0 = plain.attention(q, k, v, **params)
    torch.cuda.synchronize()
    assert not plain.kernel(q.device).plan.context["persistent"]
    diff = (o1.float() - o0.float()).abs().max().item()
    if not (torch.equal(o1, o0) and torch.equal(lse1, lse0)):
        _, _, bound = error_bound(spec, q, k, v, params)
        print(f"{name}: persistent != non-persistent bitwise, max |diff| {diff:.3e}")
        assert diff <= bound, f"{name}: persistent vs non-persistent {diff:.3e} > {bound:.3e}"
