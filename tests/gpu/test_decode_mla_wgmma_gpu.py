"""The Hopper MLA decode unit on the device (issue 40 part 3; ``Options.decode.mla_wgmma``,
templates/sm_90/decode_mla.cu.j2; ``python -m pytest -q tests/gpu/test_decode_mla_wgmma_gpu.py``,
an sm_90 GPU): specs/mla_decode.yaml with the option on against the float64 reference with V
sliced from K, at cache lengths 1, 17, 127, 1000 and 4097 in one batch, dense and paged (page
sizes 1, 16, 64), 16, 64 and 128 query heads, Sq_new 1 and 2 (appended), num_splits 1, 3 and
the heuristic's; ragged Sq_new; a planned call in a CUDA graph; the mma.sync unit (option off)
within the same bound.  Outputs are poisoned (NaN) before launch, and every cache slot a
request does not own holds NaN, so a read past the live keys or through a wrong page shows
in o.  The accuracy rule is tests/gpu/test_decode_gpu.py's (test_decode_mla_gpu.check)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen.families import decode as family  # noqa: E402
from flashgen.ops.decode.op import decode_op  # noqa: E402
from flashgen.ops.op import poison_outputs  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "specs" / "mla_decode.yaml"
D, DV = 576, 512
LENS = [1, 17, 127, 1000, 4097]


@pytest.fixture(autouse=True)
def _sm90():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper MLA unit runs on sm_90 (compute capability 9.x)")


def _ops():
    on = flashgen.load(SPEC, options=flashgen.Options(decode=family.Options(mla_wgmma=True)))
    return on, flashgen.load(SPEC)


def latent_cache(lens, cap, *, ps, dense, seed=0):
    """A bf16 latent cache ``[B, 1, cap, 576]`` (dense) or ``[pages, ps, 1, 576]`` through a
    shuffled table, random where a request's keys live and NaN everywhere else (past each
    request's length, and the pages no table entry names)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch = len(lens)
    if dense:
        kc = torch.randn(batch, 1, cap, D, generator=g, device="cuda").bfloat16()
        for b, n in enumerate(lens):
            kc[b, :, n:] = math.nan
        return kc, None
    max_pages = -(-cap // ps)
    num_pages = batch * max_pages + 3
    kc = torch.full((num_pages, ps, 1, D), math.nan, device="cuda").bfloat16()
    table = torch.randperm(num_pages, generator=g, device="cuda")[: batch * max_pages]
    table = table.view(batch, max_pages).int().contiguous()
    for b, n in enumerate(lens):
        for p in range(-(-n // ps)):
            rows = min(ps, n - p * ps)
            kc[int(table[b, p]), :rows] = torch.randn(rows, 1, D, generator=g, device="cuda")
    return kc, table


def check(op, q, kc, table, live, o, lse):
    """o and lse against the float64 reference on the cache with V its first 512 columns (the
    rule of test_decode_mla_gpu.check; NaN slots past live are never part of the reference)."""
    from flashgen.ops.decode.op import decode_reference

    vc = kc[..., :DV]
    lens = torch.as_tensor(live)
    r64o, r64l = decode_reference(op.spec, q, kc, vc, lens, table)
    rlo, _ = decode_reference(op.spec, q, kc, vc, lens, table, compute_dtype=q.dtype)
    assert not torch.isnan(o).any(), "NaN in o: a read past the live keys or an unwritten row"
    bound = 2 * (rlo.double() - r64o).abs().max().item() + 1e-3
    err = (o.double() - r64o).abs().max().item()
    assert err <= bound, f"o error {err:.3g} > bound {bound:.3g}"
    fin = torch.isfinite(r64l)
    assert torch.equal(torch.isfinite(lse), fin)
    rel = ((lse.double() - r64l).abs() / r64l.abs().clamp_min(1.0))[fin].max().item()
    assert rel <= 1e-2, f"lse relative error {rel:.3g}"


def _runs_the_hopper_unit(op):
    dev = torch.device("cuda", torch.cuda.current_device())
    unit = decode_op(op).kernels(dev, op.options.decode)["attn"].plan
    assert unit.template == "sm_90/decode_mla.cu.j2", unit.template


@pytest.mark.parametrize("splits", [None, 1, 3], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("sq", [1, 2], ids=lambda s: f"sq{s}")
@pytest.mark.parametrize("hq", [16, 64, 128], ids=lambda h: f"h{h}")
@pytest.mark.parametrize("ps", [0, 1, 16, 64], ids=lambda p: "dense" if p == 0 else f"paged{p}")
def test_mla_wgmma_against_float64(ps, hq, sq, splits):
    op, _ = _ops()
    _runs_the_hopper_unit(op)
    append = sq > 1
    live = [n + (sq if append else 0) for n in LENS]
    kc, table = latent_cache(live if not append else LENS, max(live) + 5, ps=ps or 1,
                             dense=ps == 0)  # fmt: skip
    q = torch.randn(len(LENS), hq, sq, D, device="cuda").bfloat16()
    kw = dict(block_table=table, num_splits=splits)
    if append:
        kw["k_new"] = torch.randn(len(LENS), 1, sq, D, device="cuda").bfloat16()
    lens = torch.tensor(LENS, dtype=torch.int32, device="cuda")
    with poison_outputs():
        o, lse = op.with_kvcache(q, kc, None, lens, **kw)
    torch.cuda.synchronize()
    check(op, q, kc, table, live, o, lse)


def test_mla_wgmma_agrees_with_the_mma_sync_unit():
    on, off = _ops()
    kc, table = latent_cache(LENS, max(LENS) + 3, ps=16, dense=False, seed=1)
    q = torch.randn(len(LENS), 128, 1, D, device="cuda").bfloat16()
    lens = torch.tensor(LENS, dtype=torch.int32, device="cuda")
    o1, l1 = on.with_kvcache(q, kc, None, lens, block_table=table)
    o0, l0 = off.with_kvcache(q, kc, None, lens, block_table=table)
    torch.cuda.synchronize()
    check(on, q, kc, table, LENS, o1, l1)
    assert (o1.float() - o0.float()).abs().max().item() < 3e-2
    assert torch.allclose(l1, l0, rtol=1e-4, atol=1e-3)


def test_ragged_mla_wgmma_against_float64():
    op, _ = _ops()
    sqs, lens = [2, 0, 1, 2, 1], [17, 4, 1000, 127, 4097]
    live = [n + s for n, s in zip(lens, sqs, strict=True)]
    kc, table = latent_cache(lens, max(live) + 1, ps=64, dense=False, seed=2)
    cu = torch.tensor([0, *torch.tensor(sqs).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 128, D, device="cuda").bfloat16()
    kn = torch.randn(int(cu[-1]), 1, D, device="cuda").bfloat16()
    with poison_outputs():
        o, lse = op.with_kvcache(q, kc, None, torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                 block_table=table, k_new=kn, cu_seqlens_q=cu.cuda())  # fmt: skip
    torch.cuda.synchronize()
    for b in range(len(lens)):
        q0, q1 = int(cu[b]), int(cu[b + 1])
        if q1 == q0:
            continue
        one = q[q0:q1].transpose(0, 1)[None]
        check(op, one, kc, table[b : b + 1], [live[b]], o[q0:q1].transpose(0, 1)[None],
              lse[:, q0:q1][None])  # fmt: skip


def test_mla_wgmma_plan_in_a_cuda_graph():
    op, _ = _ops()
    lens = [17, 4000]
    kc, table = latent_cache(lens, 4096, ps=64, dense=False, seed=3)
    q = torch.randn(2, 128, 1, D, device="cuda").bfloat16()
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    p = op.plan_decode(batch=2, num_heads=128, num_heads_kv=1, seqlen_q=1, cache_capacity=4096,
                       page_size=64, num_pages=kc.shape[0])  # fmt: skip
    assert p.geometry.m_blocks == 2  # 128 heads: two CTAs of 64 rows per request and split
    op.with_kvcache(q, kc, None, lens_t, block_table=table, plan=p)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = op.with_kvcache(q, kc, None, lens_t, block_table=table, plan=p)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    want = op.with_kvcache(q, kc, None, lens_t, block_table=table, num_splits=p.num_splits)
    assert torch.equal(o, want[0]) and torch.equal(lse, want[1])
    check(op, q, kc, table, lens, o, lse)


def test_mla_wgmma_empty_and_bad_pages():
    """A request with no keys gives o 0 and lse -inf; table entries outside [0, num_pages)
    are never read (their keys are masked, as the mma.sync unit masks them)."""
    op, _ = _ops()
    lens = [0, 300]
    kc, table = latent_cache(lens, 320, ps=16, dense=False, seed=4)
    table[1, 3] = -1
    table[1, 7] = kc.shape[0] + 5
    q = torch.randn(2, 16, 1, D, device="cuda").bfloat16()
    with poison_outputs():
        o, lse = op.with_kvcache(q, kc, None, torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                 block_table=table, num_splits=2)  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.isneginf(lse[0]).all()
    # request 1 without the keys of pages 3 and 7 (16 keys each): the reference on a copy whose
    # table points those pages at zero-length holes is the same as masking them
    keep = torch.ones(300, dtype=torch.bool)
    keep[48:64] = False
    keep[112:128] = False
    pages = [int(table[1, p]) for p in range(-(-300 // 16))]
    rows = torch.stack([kc[pages[k // 16], k % 16, 0] if keep[k] else kc.new_zeros(D)
                        for k in range(300)]).double()  # fmt: skip
    s = q[1, :, 0].double() @ rows.T * op.spec.softmax_scale
    s[:, ~keep] = -math.inf
    ref = torch.softmax(s, -1) @ rows[:, :DV]
    assert (o[1, :, 0].double() - ref).abs().max().item() < 2e-2
    assert torch.allclose(lse[1, :, 0].double(), torch.logsumexp(s, -1), rtol=1e-3, atol=1e-3)
