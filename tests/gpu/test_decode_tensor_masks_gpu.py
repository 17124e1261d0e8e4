"""Masks that read tensors in the decode kernels (issue 40 part 2) on the device
(``python -m pytest -q tests/gpu/test_decode_tensor_masks_gpu.py``): specs/spec_tree.yaml's
tree mask against a brute-force mask built from the ancestor matrix on the host (float64),
and document_mask against its own, padded and ragged, dense and paged (page sizes 1, 16),
bf16 and e4m3 caches, appends, GQA 32/8 and 8/1 (the packed rows of one CTA have different
masks), num_splits 1 / 3 / heuristic, lengths 1, 17, 127, 1000, 4097; a plan captured in a
CUDA graph; compute-sanitizer memcheck over the units.  The accuracy rule is
tests/gpu/test_decode_gpu.py's: max|o - ref64| <= 2 * max|ref_bf16 - ref64| + 1e-3."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen.ops.decode.op import decode_reference  # noqa: E402
from flashgen.ops.op import poison_outputs  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
E4M3 = getattr(torch, "float8_e4m3fn", None)


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def op_of(name):
    return flashgen.load(REPO / "specs" / f"{name}.yaml")


def ancestors(batch, n, seed=0):
    """Random draft trees ``[batch, n, n]`` int32 (row i: token i and its ancestors)."""
    g = torch.Generator().manual_seed(seed)
    anc = torch.zeros(batch, n, n, dtype=torch.int32)
    for b in range(batch):
        parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        for i in range(n):
            j = i
            while j >= 0:
                anc[b, i, j] = 1
                j = parent[j]
    return anc


def make_cache(cap, batch, *, ps, hkv, d, dtype, dense, seed=0):
    """A cache of random rows (NaN-free garbage everywhere, so a mask that let a dropped
    pair through would show), dense ``[B, Hkv, cap, D]`` or paged through a shuffled table."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        x = torch.randn(*shape, generator=g, device="cuda")
        return (x * 40).to(dtype) if dtype == E4M3 else x.to(dtype)

    if dense:
        return rnd(batch, hkv, cap, d), rnd(batch, hkv, cap, d), None
    max_pages = -(-cap // ps)
    num_pages = batch * max_pages + 3
    table = torch.randperm(num_pages, generator=g, device="cuda")[: batch * max_pages]
    table = table.view(batch, max_pages).int().contiguous()
    return rnd(num_pages, ps, hkv, d), rnd(num_pages, ps, hkv, d), table


def brute(q, kc, vc, table, live, allowed, scale, kd=None, vd=None):
    """float64 attention on the host of each request's ``q[b]`` ``[Hq, n, D]`` over its
    ``live[b]`` keys under the bool mask ``allowed(b, n, live)``; ``(o, lse)`` lists."""
    kc, vc = kc.cpu(), vc.cpu()
    table = None if table is None else table.cpu()
    outs, lses = [], []
    for b, qb in enumerate(q):
        qb = qb.cpu().double()
        n, L = qb.shape[1], live[b]
        if table is None:
            k, v = kc[b, :, :L].double(), vc[b, :, :L].double()
        else:
            ps = kc.shape[1]
            pages = table[b].long()[torch.arange(L) // ps]
            slots = torch.arange(L) % ps
            k = kc[pages, slots].double().transpose(0, 1)
            v = vc[pages, slots].double().transpose(0, 1)
        if kd is not None:
            k = k * kd[b].cpu().double()[:, None, None]
            v = v * vd[b].cpu().double()[:, None, None]
        g = qb.shape[0] // k.shape[0]
        s = qb @ k.repeat_interleave(g, 0).transpose(-1, -2) * scale
        s = s.masked_fill(~allowed(b, n, L), -math.inf)
        lse = torch.logsumexp(s, -1)
        p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), 0.0)
        outs.append(p @ v.repeat_interleave(g, 0))
        lses.append(lse)
    return outs, lses


def tree_allowed(anc):
    anc = anc.cpu()

    def allowed(b, n, L):
        m = torch.zeros(n, L, dtype=torch.bool)
        m[:, : L - n] = True
        m[:, L - n :] = anc[b, :n, :n].bool()
        return m

    return allowed


def check(o, lse, eo, el, bound):
    """o within ``bound`` of the brute force, lse within 1e-2 relative, no NaN."""
    assert not torch.isnan(o).any(), "NaN in o (a row left unwritten, or garbage read)"
    err = (o.cpu().double() - eo).abs().max().item()
    assert err <= bound, f"o error {err:.3g} > bound {bound:.3g}"
    fin = torch.isfinite(el)
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    if fin.any():
        rel = ((lse.cpu().double() - el).abs() / el.abs().clamp_min(1.0))[fin].max().item()
        assert rel <= 1e-2


def bound_of(spec, q, kc, vc, table, live, params):
    """2 * max|ref in q's dtype - ref64| + 1e-3 (the decode GPU tests' rule)."""
    lens = torch.as_tensor(live)
    r64, _ = decode_reference(spec, q, kc, vc, lens, table, params=params)
    rlo, _ = decode_reference(spec, q, kc, vc, lens, table, params=params, compute_dtype=q.dtype)
    return 2 * (rlo.double() - r64).abs().max().item() + 1e-3


TREE = [  # (Sq_new, (Hq, Hkv), page size (0: dense), num_splits, append)
    (8, (32, 8), 16, None, True),
    (17, (8, 1), 1, 3, True),
    (64, (8, 1), 16, None, True),
    (5, (32, 8), 0, 1, False),
    (16, (8, 1), 0, 3, True),
]


@pytest.mark.parametrize("sq,heads,ps,splits,append", TREE, ids=str)
def test_tree_mask_against_the_brute_force(sq, heads, ps, splits, append):
    op = op_of("spec_tree")
    hq, hkv = heads
    lens = [1, 17, 127, 1000, 4097]
    batch = len(lens)
    live = [n + (sq if append else 0) for n in lens]
    if not append:
        live = [max(n, sq) for n in live]
        lens = live
    kc, vc, table = make_cache(max(live) + 5, batch, ps=ps or 1, hkv=hkv, d=128,
                               dtype=torch.bfloat16, dense=ps == 0)  # fmt: skip
    q = torch.randn(batch, hq, sq, 128, device="cuda").bfloat16()
    anc = ancestors(batch, sq, seed=sq).cuda()
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kw = dict(block_table=table, ancestors=anc, num_splits=splits)
    if append:
        kw["k_new"] = torch.randn(batch, hkv, sq, 128, device="cuda").bfloat16()
        kw["v_new"] = torch.randn(batch, hkv, sq, 128, device="cuda").bfloat16()
    with poison_outputs():
        o, lse = op.with_kvcache(q, kc, vc, lens_t, **kw)
    torch.cuda.synchronize()
    eo, el = brute(q, kc, vc, table, live, tree_allowed(anc), 128**-0.5)
    bound = bound_of(op.spec, q, kc, vc, table, live, {"ancestors": anc})
    for b in range(batch):
        check(o[b], lse[b], eo[b], el[b], bound)


@pytest.mark.parametrize("ps", [1, 16])
def test_ragged_tree_mask_against_the_brute_force(ps):
    op = op_of("spec_tree")
    sqs, lens = [3, 0, 17, 1, 64], [17, 5, 1000, 1, 127]
    batch, hq, hkv, mx = len(sqs), 32, 8, max(sqs)
    live = [n + s for n, s in zip(lens, sqs, strict=True)]
    kc, vc, table = make_cache(max(live) + 1, batch, ps=ps, hkv=hkv, d=128,
                               dtype=torch.bfloat16, dense=False)  # fmt: skip
    cu = torch.tensor([0, *torch.tensor(sqs).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    q = torch.randn(total, hq, 128, device="cuda").bfloat16()
    kn = torch.randn(total, hkv, 128, device="cuda").bfloat16()
    vn = torch.randn(total, hkv, 128, device="cuda").bfloat16()
    anc = torch.randint(0, 2, (batch, mx, mx), dtype=torch.int32)  # noise past each Sq_b
    for b, n in enumerate(sqs):
        if n:
            anc[b, :n, :n] = ancestors(1, n, seed=b)[0]
    anc = anc.cuda()
    with poison_outputs():
        o, lse = op.with_kvcache(q, kc, vc, torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                 block_table=table, k_new=kn, v_new=vn, cu_seqlens_q=cu.cuda(),
                                 max_seqlen_q=mx, ancestors=anc)  # fmt: skip
    torch.cuda.synchronize()
    qs = [q[cu[b] : cu[b + 1]].transpose(0, 1) for b in range(batch)]
    eo, el = brute(qs, kc, vc, table, live, tree_allowed(anc), 128**-0.5)
    for b in range(batch):
        q0, q1 = int(cu[b]), int(cu[b + 1])
        if q1 > q0:
            check(o[q0:q1].transpose(0, 1), lse[:, q0:q1], eo[b], el[b], 2e-2)


@pytest.mark.skipif(E4M3 is None, reason="torch without float8_e4m3fn")
@pytest.mark.parametrize("ps", [0, 16])
def test_tree_mask_on_an_e4m3_cache(ps):
    op = op_of("spec_tree")
    lens, sq, hq, hkv = [17, 127, 1000], 8, 32, 8
    kc, vc, table = make_cache(1010, 3, ps=ps or 1, hkv=hkv, d=128, dtype=E4M3, dense=ps == 0)
    kd = torch.rand(3, hkv, device="cuda") * 0.05 + 0.01
    vd = torch.rand(3, hkv, device="cuda") * 0.05 + 0.01
    q = torch.randn(3, hq, sq, 128, device="cuda").bfloat16()
    anc = ancestors(3, sq, seed=9).cuda()
    with poison_outputs():
        o, lse = op.with_kvcache(q, kc, vc, torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                 block_table=table, k_descale=kd, v_descale=vd, ancestors=anc)
    torch.cuda.synchronize()
    eo, el = brute(q, kc, vc, table, lens, tree_allowed(anc), 128**-0.5, kd, vd)
    for b in range(3):
        check(o[b], lse[b], eo[b], el[b], 3e-2)


@pytest.mark.parametrize("ps", [0, 1, 16])
def test_document_mask_against_the_brute_force(ps):
    op = op_of("document_mask")
    lens, sq, hq, hkv = [1, 127, 1000, 4097], 4, 32, 8
    kc, vc, table = make_cache(4110, 4, ps=ps or 1, hkv=hkv, d=128, dtype=torch.bfloat16,
                               dense=ps == 0)  # fmt: skip
    cap = table.shape[1] * ps if ps else 4110
    q = torch.randn(4, hq, sq, 128, device="cuda").bfloat16()
    kn = torch.randn(4, hkv, sq, 128, device="cuda").bfloat16()
    doc_kv = torch.sort(torch.randint(0, 9, (4, cap)), dim=1)[0].int()
    live = [n + sq for n in lens]
    doc_q = torch.stack([doc_kv[b, live[b] - sq : live[b]] for b in range(4)]).contiguous()
    with poison_outputs():
        o, lse = op.with_kvcache(q, kc, vc, torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                 block_table=table, k_new=kn, v_new=kn.clone(),
                                 doc_q=doc_q.cuda(), doc_kv=doc_kv.cuda())  # fmt: skip
    torch.cuda.synchronize()

    def allowed(b, n, L):
        i = torch.arange(n).view(-1, 1)
        kv = torch.arange(L).view(1, -1)
        return (kv <= i + L - n) & (doc_q[b].view(-1, 1) == doc_kv[b, :L].view(1, -1))

    eo, el = brute(q, kc, vc, table, live, allowed, 128**-0.5)
    for b in range(4):
        check(o[b], lse[b], eo[b], el[b], 2e-2)


@pytest.mark.parametrize("ps,splits,alternate", [(0, 1, False), (16, 3, False), (1, None, False),
                                                (16, 7, True), (0, None, True)])  # fmt: skip
def test_blocks_the_tensor_mask_empties_are_never_read(ps, splits, alternate):
    """document_mask, one new token of document 1 over a cache whose document-0 keys hold
    NaN: the first 1024 keys (16 whole blocks of 64), or (``alternate``) every other run of
    1024 (two holes, spread over 7 splits or the heuristic's).  The kernel's vote skips those
    blocks unread (a block loaded and masked would give 0 * NaN = NaN in P V), whichever split
    they fall in, and the result is attention over document 1's keys alone."""
    op = op_of("document_mask")
    # each query (the last live key) in document 1: keys 1024 .. 2047 and 3072 .. 4095 alternate
    lens, hq, hkv = ([4000, 1500] if alternate else [3000, 1500]), 8, 2
    kc, vc, table = make_cache(4100, 2, ps=ps or 1, hkv=hkv, d=128, dtype=torch.bfloat16,
                               dense=ps == 0)  # fmt: skip
    cap = table.shape[1] * ps if ps else 4100
    pos = torch.arange(cap, device="cuda")
    doc = ((pos // 1024) % 2 if alternate else (pos >= 1024)).int()
    other = pos[doc == 0]
    for b in range(2):
        if table is None:
            kc[b, :, other] = float("nan")
            vc[b, :, other] = float("nan")
        else:
            pages = table[b].long()[other // ps]
            kc[pages, other % ps] = float("nan")
            vc[pages, other % ps] = float("nan")
    doc_kv = doc.view(1, -1).repeat(2, 1).contiguous()
    doc_q = torch.ones(2, 1, dtype=torch.int32, device="cuda")
    q = torch.randn(2, hq, 1, 128, device="cuda").bfloat16()
    with poison_outputs():
        o, lse = op.with_kvcache(q, kc, vc, torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                 block_table=table, num_splits=splits, doc_q=doc_q,
                                 doc_kv=doc_kv)  # fmt: skip
    torch.cuda.synchronize()
    assert not torch.isnan(o).any(), "a block the mask empties was read"
    for b in range(2):  # the brute force over document 1's keys alone (the NaN rows left out)
        mine = pos[: lens[b]][doc[: lens[b]] == 1]
        if table is None:
            kk, vv = kc[b, :, mine], vc[b, :, mine]
        else:
            pages = table[b].long()[mine // ps]
            kk, vv = kc[pages, mine % ps].transpose(0, 1), vc[pages, mine % ps].transpose(0, 1)
        n = mine.numel()
        eo, el = brute(q[b : b + 1], kk[None], vv[None], None, [n],
                       lambda *_, n=n: torch.ones(1, n, dtype=torch.bool), 128**-0.5)  # fmt: skip
        check(o[b], lse[b], eo[0], el[0], 2e-2)


def test_tree_mask_plan_in_a_cuda_graph():
    """A planned tree-mask call captured in a CUDA graph replays the eager call's result
    with new ancestors copied into the captured tensor."""
    op = op_of("spec_tree")
    lens, sq, hq, hkv = [17, 1000], 8, 32, 8
    kc, vc, table = make_cache(1024, 2, ps=16, hkv=hkv, d=128, dtype=torch.bfloat16, dense=False)
    q = torch.randn(2, hq, sq, 128, device="cuda").bfloat16()
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    anc = ancestors(2, sq, seed=1).cuda()
    p = op.plan_decode(batch=2, num_heads=hq, num_heads_kv=hkv, seqlen_q=sq, cache_capacity=1024,
                       page_size=16, num_pages=kc.shape[0])  # fmt: skip
    op.with_kvcache(q, kc, vc, lens_t, block_table=table, plan=p, ancestors=anc)  # warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, plan=p, ancestors=anc)
    new = ancestors(2, sq, seed=2).cuda()
    anc.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    want = op.with_kvcache(q, kc, vc, lens_t, block_table=table, num_splits=p.num_splits,
                           ancestors=new)  # fmt: skip
    assert torch.equal(o, want[0]) and torch.equal(lse, want[1])


SANITIZE_DRIVER = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import flashgen
from pathlib import Path
R = Path(sys.argv[1])
tree = flashgen.load(R / "specs" / "spec_tree.yaml")
doc = flashgen.load(R / "specs" / "document_mask.yaml")
for ps, splits in ((1, 1), (16, 3)):
    pp = -(-48 // ps)  # pages per request: 48 keys
    kc = torch.randn(2 * pp + 2, ps, 2, 128, device="cuda").bfloat16()
    table = torch.randperm(2 * pp + 2, device="cuda")[: 2 * pp].view(2, pp).int().contiguous()
    lens = torch.tensor([5, 40], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 8, 4, 128, device="cuda").bfloat16()
    anc = torch.tril(torch.ones(2, 4, 4, dtype=torch.int32, device="cuda"))
    tree.with_kvcache(q, kc, kc, lens, block_table=table, ancestors=anc, num_splits=splits)
    cu = torch.tensor([0, 1, 4], dtype=torch.int32, device="cuda")
    tree.with_kvcache(q[0].transpose(0, 1)[:4].contiguous(), kc, kc, lens, block_table=table,
                      cu_seqlens_q=cu, max_seqlen_q=3, ancestors=anc[:, :3, :3].contiguous(),
                      num_splits=splits)
    cap = table.shape[1] * ps
    doc.with_kvcache(q, kc, kc, lens, block_table=table, num_splits=splits,
                     doc_q=torch.zeros(2, 4, dtype=torch.int32, device="cuda"),
                     doc_kv=torch.zeros(2, cap, dtype=torch.int32, device="cuda"))
torch.cuda.synchronize()
print("FLASHGEN DRIVER OK", flush=True)
"""


@pytest.mark.device_memory(8)
def test_tensor_mask_decode_is_memcheck_clean():
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        pytest.skip("no compute-sanitizer")
    cmd = [sanitizer, "--tool", "memcheck", "--print-limit", "20", sys.executable, "-c",
           SANITIZE_DRIVER, str(REPO)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=REPO)
    log = proc.stdout + proc.stderr
    assert "FLASHGEN DRIVER OK" in log and proc.returncode == 0, log[-6000:]
    assert "ERROR SUMMARY: 0 errors" in log, log[-6000:]
