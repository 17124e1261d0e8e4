"""Masks that read tensors in decode (op.with_kvcache, issue 40 part 2) on CPU: the
speculative-decoding tree mask of specs/spec_tree.yaml against a brute-force mask built from
the per-request ancestor matrix (not from the spec's IR), and document_mask against its own
brute force, in the padded, ragged, paged (page sizes 1 and 16), appending and e4m3-cache
forms, GQA 8/2 and 4/1, cache lengths 1, 17, 127, 1000, with plan=, out= and
torch.compile; tensor params shaped by seqlen_q / seqlen_k take the decode meaning
(Sq_new or max_seqlen_q, the cache's capacity), bad ones raise OpInputError naming the
param; the decode units read their tensor extents from the kernel's capacity and
max_seqlen_q."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import flashgen
from flashgen.build.render import render
from flashgen.families import decode as family
from flashgen.frontend.errors import OpInputError
from flashgen.ops.decode.op import decode_reference, decode_reference_ragged

ROOT = Path(__file__).resolve().parents[2]
E4M3 = getattr(torch, "float8_e4m3fn", None)


def _op(name):
    return flashgen.load(ROOT / "specs" / f"{name}.yaml")


def ancestors(batch, n, seed=0):
    """Random draft trees: ``[batch, n, n]`` int32 0/1, row i = token i and its ancestors
    (token i's parent is a random earlier token; token 0 is the root)."""
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


def make_cache(lens, *, cap, page_size, hkv, d, dtype=torch.bfloat16, seed=0, dense=False,
               fill=float("nan")):  # fmt: skip
    """Random keys / values at every slot a request can hold (``cap`` per request; slots
    past the live keys hold ``fill``), dense or paged through a shuffled table."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lens)

    def rnd(*shape):
        x = torch.randn(*shape, generator=g)
        return (x * 40).to(dtype) if dtype == E4M3 else x.to(dtype)

    if dense:
        kc, vc = rnd(batch, hkv, cap, d), rnd(batch, hkv, cap, d)
        for b, n in enumerate(lens):
            kc[b, :, n:] = fill
            vc[b, :, n:] = fill
        return kc, vc, None
    max_pages = -(-cap // page_size)
    num_pages = batch * max_pages + 2
    table = torch.randperm(num_pages, generator=g)[: batch * max_pages]
    table = table.view(batch, max_pages).to(torch.int32).contiguous()
    kc = rnd(num_pages, page_size, hkv, d)
    vc = rnd(num_pages, page_size, hkv, d)
    return kc, vc, table


def gathered(kc, vc, table, b, n):
    """Request b's first n keys as float64 ``[Hkv, n, D]``, slot by slot."""
    if table is None:
        return kc[b, :, :n].double(), vc[b, :, :n].double()
    ps = kc.shape[1]
    k = torch.stack([kc[int(table[b, p // ps]), p % ps].double() for p in range(n)], 1)
    v = torch.stack([vc[int(table[b, p // ps]), p % ps].double() for p in range(n)], 1)
    return k, v


def brute(q, kc, vc, table, live, allowed, scale, kd=None, vd=None):
    """float64 attention of request b's queries ``q[b]`` ``[Hq, n_b, D]`` over its ``live[b]``
    keys under the bool mask ``allowed(b, n_b, live_b)`` ``[n_b, live_b]`` (descales: the
    e4m3 cache's); returns per-request lists of o ``[Hq, n_b, D]`` and lse ``[Hq, n_b]``."""
    outs, lses = [], []
    for b, qb in enumerate(q):
        hq, n = qb.shape[0], qb.shape[1]
        k, v = gathered(kc, vc, table, b, live[b])
        if kd is not None:
            k = k * kd[b].double()[:, None, None]
            v = v * vd[b].double()[:, None, None]
        g = hq // k.shape[0]
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        s = qb.double() @ k.transpose(-1, -2) * scale
        s = s.masked_fill(~allowed(b, n, live[b]), -math.inf)
        lse = torch.logsumexp(s, -1)
        p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), 0.0)
        outs.append(p @ v)
        lses.append(lse)
    return outs, lses


def tree_allowed(anc):
    """The tree mask from the ancestor matrix: the cache before the new tokens, and among
    the n new tokens (the last n live keys) token i sees token j iff anc[b, i, j]."""

    def allowed(b, n, live):
        m = torch.zeros(n, live, dtype=torch.bool)
        first = live - n
        m[:, :first] = True
        m[:, first:] = anc[b, :n, :n].bool()
        return m

    return allowed


def _close_o(got, want, atol=2e-2):
    err = (got.double() - want).abs().amax(dim=None) if got.numel() else 0.0
    assert torch.allclose(got.double(), want, atol=atol, rtol=2e-2), err


def _close_lse(got, want):
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin)
    assert torch.allclose(got[fin].double(), want[fin], atol=1e-3, rtol=1e-4)


SCALE = 1 / math.sqrt(128)


# ----------------------------------------------------------------------------- tree mask
TREE_CASES = [
    # (lens, Sq_new, (Hq, Hkv), page size or None (dense), append)
    ([1, 17, 127], 5, (8, 2), 16, True),
    ([17, 1000], 17, (4, 1), 1, True),
    ([127, 5], 1, (8, 2), None, True),
    ([40, 17, 1000], 8, (4, 1), None, False),
    ([30, 64], 16, (8, 2), 16, False),
]


@pytest.mark.parametrize("lens,sq,heads,ps,append", TREE_CASES, ids=str)
def test_tree_mask_matches_a_brute_force_mask_from_the_ancestor_matrix(lens, sq, heads, ps,
                                                                       append):  # fmt: skip
    op = _op("spec_tree")
    hq, hkv = heads
    batch = len(lens)
    live = [n + sq if append else n for n in lens]
    cap = max(live) + 3
    kc, vc, table = make_cache(live if not append else lens, cap=cap, page_size=ps or 1,
                               hkv=hkv, d=128, dense=ps is None)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch, hq, sq, 128, generator=g).to(torch.bfloat16)
    anc = ancestors(batch, sq, seed=2)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    kw = dict(block_table=table, ancestors=anc)
    if append:
        kw["k_new"] = torch.randn(batch, hkv, sq, 128, generator=g).to(torch.bfloat16)
        kw["v_new"] = torch.randn(batch, hkv, sq, 128, generator=g).to(torch.bfloat16)
    o, lse = op.with_kvcache(q, kc, vc, lens_t, **kw)
    eo, el = brute(q, kc, vc, table, live, tree_allowed(anc), SCALE)
    for b in range(batch):
        _close_o(o[b], eo[b])
        _close_lse(lse[b], el[b])
    # the op's float64 reference path (the spec's IR) is the brute force to rounding
    ro, rl = decode_reference(op.spec, q, kc, vc, torch.tensor(live), table,
                              params={"ancestors": anc})  # fmt: skip
    for b in range(batch):
        assert torch.allclose(ro[b], eo[b], atol=1e-9)
        assert torch.allclose(rl[b], el[b], atol=1e-9)


def test_the_tree_changes_the_result():
    """The ancestor matrix is read: the chain (lower triangle, plain causal) and a tree
    give different outputs for the tokens whose ancestors differ, the same for the root."""
    op = _op("spec_tree")
    kc, vc, table = make_cache([20], cap=32, page_size=16, hkv=1, d=128)
    q = torch.randn(1, 4, 6, 128).to(torch.bfloat16)
    lens = torch.tensor([20], dtype=torch.int32)
    chain = torch.tril(torch.ones(1, 6, 6, dtype=torch.int32))
    tree = ancestors(1, 6, seed=5)
    assert not torch.equal(chain, tree)
    a, _ = op.with_kvcache(q, kc, vc, lens, block_table=table, ancestors=chain)
    b, _ = op.with_kvcache(q, kc, vc, lens, block_table=table, ancestors=tree)
    assert torch.equal(a[:, :, 0], b[:, :, 0])
    differ = [i for i in range(6) if not torch.equal(chain[0, i], tree[0, i])]
    assert differ and all(not torch.equal(a[:, :, i], b[:, :, i]) for i in differ)
    # the chain is the causal spec on the same call
    c, _ = _op("llama3_gqa").with_kvcache(q, kc, vc, lens, block_table=table)
    torch.testing.assert_close(a, c, atol=0, rtol=0)


@pytest.mark.parametrize("ps", [1, 16])
def test_ragged_tree_mask_reads_each_requests_corner_of_the_matrix(ps):
    """Ragged Sq_new: ancestors ``[B, max_seqlen_q, max_seqlen_q]``; request b's Sq_b
    tokens read its top-left Sq_b x Sq_b corner (the rest holds noise that must not
    matter), appended with k_new."""
    op = _op("spec_tree")
    sqs, lens = [3, 0, 7, 1], [17, 5, 127, 1]
    batch, hq, hkv, mx = len(sqs), 8, 2, max(sqs)
    live = [n + s for n, s in zip(lens, sqs, strict=True)]
    kc, vc, table = make_cache(lens, cap=max(live) + 1, page_size=ps, hkv=hkv, d=128)
    cu = torch.tensor([0, *torch.tensor(sqs).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    g = torch.Generator().manual_seed(3)
    q = torch.randn(total, hq, 128, generator=g).to(torch.bfloat16)
    kn = torch.randn(total, hkv, 128, generator=g).to(torch.bfloat16)
    vn = torch.randn(total, hkv, 128, generator=g).to(torch.bfloat16)
    anc = torch.randint(0, 2, (batch, mx, mx), generator=g, dtype=torch.int32)
    for b, n in enumerate(sqs):
        anc[b, :n, :n] = ancestors(1, n, seed=b)[0] if n else anc[b, :0, :0]
    lens_t = torch.tensor(lens, dtype=torch.int32)
    o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, k_new=kn, v_new=vn,
                             cu_seqlens_q=cu, max_seqlen_q=mx, ancestors=anc)  # fmt: skip
    qs = [q[cu[b] : cu[b + 1]].transpose(0, 1) for b in range(batch)]
    eo, el = brute(qs, kc, vc, table, live, tree_allowed(anc), SCALE)
    for b in range(batch):
        q0, q1 = int(cu[b]), int(cu[b + 1])
        _close_o(o[q0:q1].transpose(0, 1), eo[b])
        _close_lse(lse[:, q0:q1], el[b])
    ro, _ = decode_reference_ragged(op.spec, q, kc, vc, torch.tensor(live), cu, table,
                                    params={"ancestors": anc})  # fmt: skip
    for b in range(batch):
        assert torch.allclose(ro[cu[b] : cu[b + 1]].transpose(0, 1), eo[b], atol=1e-9)


@pytest.mark.skipif(E4M3 is None, reason="torch without float8_e4m3fn")
def test_ragged_tree_mask_on_an_e4m3_cache_with_appends():
    op = _op("spec_tree")
    sqs, lens = [4, 1, 0], [17, 127, 3]
    live = [n + s for n, s in zip(lens, sqs, strict=True)]
    kc, vc, table = make_cache(lens, cap=140, page_size=16, hkv=1, d=128, dtype=E4M3, fill=0.0)
    g = torch.Generator().manual_seed(11)
    kd = torch.rand(3, 1, generator=g) * 0.05 + 0.01
    vd = torch.rand(3, 1, generator=g) * 0.05 + 0.01
    cu = torch.tensor([0, 4, 5, 5], dtype=torch.int32)
    q = torch.randn(5, 4, 128, generator=g).to(torch.bfloat16)
    kn = (torch.randn(5, 1, 128, generator=g) * 40).to(E4M3)
    vn = (torch.randn(5, 1, 128, generator=g) * 40).to(E4M3)
    anc = ancestors(3, 4, seed=12)
    o, lse = op.with_kvcache(q, kc, vc, torch.tensor(lens, dtype=torch.int32), block_table=table,
                             k_new=kn, v_new=vn, cu_seqlens_q=cu, max_seqlen_q=4, k_descale=kd,
                             v_descale=vd, ancestors=anc)  # fmt: skip
    qs = [q[cu[b] : cu[b + 1]].transpose(0, 1) for b in range(3)]
    eo, el = brute(qs, kc, vc, table, live, tree_allowed(anc), SCALE, kd, vd)
    for b in range(3):
        q0, q1 = int(cu[b]), int(cu[b + 1])
        _close_o(o[q0:q1].transpose(0, 1), eo[b])
        _close_lse(lse[:, q0:q1], el[b])


@pytest.mark.skipif(E4M3 is None, reason="torch without float8_e4m3fn")
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "paged"])
def test_tree_mask_on_an_e4m3_cache(dense):
    op = _op("spec_tree")
    lens, sq, hq, hkv = [17, 127], 5, 8, 2
    kc, vc, table = make_cache([n for n in lens], cap=140, page_size=16, hkv=hkv, d=128,
                               dtype=E4M3, dense=dense, fill=0.0)  # fmt: skip
    g = torch.Generator().manual_seed(4)
    kd = torch.rand(2, hkv, generator=g) * 0.05 + 0.01
    vd = torch.rand(2, hkv, generator=g) * 0.05 + 0.01
    q = torch.randn(2, hq, sq, 128, generator=g).to(torch.bfloat16)
    anc = ancestors(2, sq, seed=6)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, k_descale=kd, v_descale=vd,
                             ancestors=anc)  # fmt: skip
    eo, el = brute(q, kc, vc, table, lens, tree_allowed(anc), SCALE, kd, vd)
    for b in range(2):
        _close_o(o[b], eo[b])
        _close_lse(lse[b], el[b])


def test_tree_mask_plan_out_and_torch_compile():
    """plan= (plan_decode for the call's shapes), out= and torch.compile(fullgraph=True)
    give the plain call's results bitwise, padded and ragged."""
    op = _op("spec_tree")
    lens, sq, hq, hkv = [17, 40], 4, 8, 2
    kc, vc, table = make_cache(lens, cap=48, page_size=16, hkv=hkv, d=128)
    q = torch.randn(2, hq, sq, 128).to(torch.bfloat16)
    anc = ancestors(2, sq, seed=7)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    kw = dict(block_table=table, ancestors=anc)
    want = op.with_kvcache(q, kc, vc, lens_t, **kw)
    p = op.plan_decode(batch=2, num_heads=hq, num_heads_kv=hkv, seqlen_q=sq, cache_capacity=48,
                       page_size=16, num_pages=kc.shape[0], device="cpu")  # fmt: skip
    got = op.with_kvcache(q, kc, vc, lens_t, plan=p, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    out = (torch.empty_like(want[0]), torch.empty_like(want[1]))
    got = op.with_kvcache(q, kc, vc, lens_t, out=out, plan=p, **kw)
    assert got is out and torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])

    def call(q, kc, vc, lens, anc):
        return op.with_kvcache(q, kc, vc, lens, block_table=table, ancestors=anc)

    got = torch.compile(call, fullgraph=True, backend="aot_eager")(q, kc, vc, lens_t, anc)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    cu = torch.tensor([0, 3, 4], dtype=torch.int32)
    qr = torch.randn(4, hq, 128).to(torch.bfloat16)

    def ragged(q, kc, vc, lens, anc):
        return op.with_kvcache(q, kc, vc, lens, block_table=table, cu_seqlens_q=cu,
                               max_seqlen_q=3, ancestors=anc)  # fmt: skip

    anc3 = anc[:, :3, :3].contiguous()
    want = ragged(qr, kc, vc, lens_t, anc3)
    got = torch.compile(ragged, fullgraph=True, backend="aot_eager")(qr, kc, vc, lens_t, anc3)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_tensor_params_take_the_decode_shapes():
    """ancestors must be ``[batch, Sq_new, Sq_new]`` (ragged: max_seqlen_q) of an integer
    dtype; doc_kv ``[batch, capacity]``: OpInputError naming the param, the expected and
    the received shape otherwise."""
    op = _op("spec_tree")
    kc, vc, table = make_cache([9, 9], cap=16, page_size=4, hkv=2, d=128)
    q = torch.randn(2, 8, 3, 128).to(torch.bfloat16)
    lens = torch.tensor([9, 9], dtype=torch.int32)
    with pytest.raises(OpInputError, match=r"ancestors: expected shape \[2, 3, 3\]"):
        op.with_kvcache(q, kc, vc, lens, block_table=table, ancestors=ancestors(2, 4))
    with pytest.raises(OpInputError, match="ancestors: expected an integer tensor"):
        op.with_kvcache(q, kc, vc, lens, block_table=table, ancestors=ancestors(2, 3).float())
    with pytest.raises(OpInputError, match="ancestors: missing tensor param"):
        op.with_kvcache(q, kc, vc, lens, block_table=table)
    kn = torch.randn(2, 2, 3, 128).to(torch.bfloat16)
    before = (kc.clone(), vc.clone())
    with pytest.raises(OpInputError, match=r"ancestors: expected shape \[2, 3, 3\]"):
        op.with_kvcache(q, kc, vc, lens, block_table=table, k_new=kn, v_new=kn,
                        ancestors=ancestors(2, 2))  # fmt: skip
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])  # nothing appended
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    with pytest.raises(OpInputError, match=r"ancestors: expected shape \[2, 2, 2\]"):
        op.with_kvcache(q[0].transpose(0, 1)[:3].contiguous(), kc, vc, lens, block_table=table,
                        cu_seqlens_q=cu, max_seqlen_q=2, ancestors=ancestors(2, 3))  # fmt: skip
    doc = _op("document_mask")
    with pytest.raises(OpInputError, match=r"doc_kv: expected shape \[2, 16\]"):
        doc.with_kvcache(q, kc, vc, lens, block_table=table,
                         doc_q=torch.zeros(2, 3, dtype=torch.int32),
                         doc_kv=torch.zeros(2, 9, dtype=torch.int32))  # fmt: skip


# ----------------------------------------------------------------------------- document mask
@pytest.mark.parametrize("ps", [None, 1, 16], ids=["dense", "page1", "page16"])
def test_document_mask_in_decode_matches_its_brute_force(ps):
    """document_mask: doc_q ``[B, Sq_new]``, doc_kv ``[B, capacity]`` (the documents of the
    cache's positions); causal and same-document against a brute force, with an append."""
    op = _op("document_mask")
    lens, sq, hq, hkv = [1, 127, 1000], 4, 4, 1
    cap = max(lens) + sq + 5
    kc, vc, table = make_cache(lens, cap=cap, page_size=ps or 1, hkv=hkv, d=128, dense=ps is None)
    cap = table.shape[1] * ps if ps else cap
    g = torch.Generator().manual_seed(8)
    q = torch.randn(3, hq, sq, 128, generator=g).to(torch.bfloat16)
    kn = torch.randn(3, hkv, sq, 128, generator=g).to(torch.bfloat16)
    vn = torch.randn(3, hkv, sq, 128, generator=g).to(torch.bfloat16)
    doc_kv = torch.sort(torch.randint(0, 4, (3, cap), generator=g), dim=1)[0].to(torch.int32)
    live = [n + sq for n in lens]
    doc_q = torch.stack([doc_kv[b, live[b] - sq : live[b]] for b in range(3)]).contiguous()
    lens_t = torch.tensor(lens, dtype=torch.int32)
    o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, k_new=kn, v_new=vn,
                             doc_q=doc_q, doc_kv=doc_kv)  # fmt: skip

    def allowed(b, n, L):
        i = torch.arange(n).view(-1, 1)
        kv = torch.arange(L).view(1, -1)
        return (kv <= i + L - n) & (doc_q[b].view(-1, 1) == doc_kv[b, :L].view(1, -1))

    eo, el = brute(q, kc, vc, table, live, allowed, SCALE)
    for b in range(3):
        _close_o(o[b], eo[b])
        _close_lse(lse[b], el[b])


def test_every_shipped_spec_with_fp16_or_bf16_decodes():
    """document_mask and spec_tree (masks that read tensors) have decode units now; only
    the fp8 spec (whose decode is the e4m3 cache of a bf16 spec) has none."""
    from flashgen.frontend.spec import load_spec

    names = set()
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        spec = load_spec(path)
        if family.unsupported_reason(spec) is None:
            names.add(spec.name)
        else:
            assert spec.dtype not in ("fp16", "bf16")
    assert {"document_mask", "spec_tree"} <= names


@pytest.mark.parametrize("ragged", [False, True], ids=["padded", "ragged"])
def test_decode_units_index_tensors_by_capacity_and_the_new_token_extent(ragged):
    """The rendered mask reads ancestors with the new-token extent (padded: seqlen_q, the
    call's Sq_new; ragged: params_seqlen_q, the call's max_seqlen_q, not the request's Sq_b
    nor the grid's max_seqlen_q) and doc_kv with the cache's capacity (not the request's live
    keys, the mask's seqlen_k); an index whose kernel bound is not that extent is clamped
    (kv_idx into capacity; ragged q_idx into params_seqlen_q), so a read never leaves the
    tensor whatever the unchecked lengths."""
    tree = family.plan(_op("spec_tree").spec, "sm_80", ragged=ragged)
    src = render(tree)
    ext = "params_seqlen_q" if ragged else "seqlen_q"
    assert f"(int64_t)({ext})" in src and "t_ancestors" in src
    assert ("fg::clamp_index(q_idx, params_seqlen_q)" in src) == ragged
    names = [a.name for a in tree.args]
    assert ("params_seqlen_q" in names) == ragged
    if ragged:
        assert names[-2:] == ["params_seqlen_q", "cu_seqlens_q"]
    doc = render(family.plan(_op("document_mask").spec, "sm_90", ragged=ragged))
    assert "(int64_t)(capacity)" in doc and "(int64_t)(seqlen_k)" not in doc
    assert "fg::clamp_index(kv_idx, capacity)" in doc
    alibi = family.plan(_op("alibi").spec, "sm_80", ragged=True)
    assert "params_seqlen_q" not in [a.name for a in alibi.args]


def test_a_planned_ragged_call_passes_its_own_max_seqlen_q_as_the_tensor_extent():
    """plan_decode(seqlen_q=8, total_q=...) and a call of max_seqlen_q 3: the grid is the
    plan's (max_seqlen_q 8), the ancestors extent the call's (params_seqlen_q 3)."""
    from flashgen.ops.decode.op import decode_op, validate_decode_ragged

    op = _op("spec_tree")
    dop = decode_op(op)
    kc, vc, table = make_cache([9, 9], cap=16, page_size=4, hkv=2, d=128)
    q = torch.randn(4, 8, 128).to(torch.bfloat16)
    cu = torch.tensor([0, 3, 4], dtype=torch.int32)
    lens = torch.tensor([9, 9], dtype=torch.int32)
    p = op.plan_decode(batch=2, num_heads=8, num_heads_kv=2, seqlen_q=8, total_q=16,
                       cache_capacity=16, page_size=4, num_pages=kc.shape[0], device="cpu")
    dims = validate_decode_ragged(op.spec, q, kc, vc, lens, table, None, None, cu, 3)
    anc = ancestors(2, 3)
    o, lse = dop._outputs(q, dims)
    values = dop.launch_values(p, q, kc, vc, lens, table, o, lse, 0.1, [], {"ancestors": anc},
                               None, dims)  # fmt: skip
    assert values["max_seqlen_q"] == 8 and values["params_seqlen_q"] == 3
    unit = family.plan(op.spec, "sm_80", ragged=True)
    assert {a.name for a in unit.args} - {"cu_seqlens_q"} <= set(values)
    # the planned call itself (CPU) equals the unplanned one
    want = op.with_kvcache(q, kc, vc, lens, block_table=table, cu_seqlens_q=cu, max_seqlen_q=3,
                           ancestors=anc, num_splits=p.num_splits)
    got = op.with_kvcache(q, kc, vc, lens, block_table=table, cu_seqlens_q=cu, max_seqlen_q=3,
                          ancestors=anc, plan=p)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_tensor_mask_units_vote_on_their_blocks_before_loading():
    """A unit whose mask reads tensors classifies and votes on its split's blocks before the
    loads (``s_keep``: VOTE_BLOCKS bytes of shared memory more), and its loader and loop
    step over the blocks voted out (``next_kept``); a unit whose mask reads none has no vote."""
    for name in ("spec_tree", "document_mask"):
        spec = _op(name).spec
        assert family.tensor_mask(spec)
        for kw in ({}, {"ragged": True}, {"cache_dtype": "fp8_e4m3"}):
            p = family.plan(spec, "sm_90", **kw)
            src = render(p)
            assert "s_keep[i] = 3" in src and "ld_j = next_kept(ld_j + block_step)" in src
            assert "j = next_kept(j + block_step);" in src
            assert "fetch_pages(next_kept(j + block_step))" in src
            assert "const int block_step = eff_splits;" in src
            kv = 1 if kw.get("cache_dtype") else 2
            assert p.smem_bytes == family.smem_bytes(spec, p.tiles.block_n, p.tiles.stages, kv)
            assert f"VOTE_BLOCKS = {family.VOTE_BLOCKS};" in src
    plain = _op("llama3_gqa").spec
    assert not family.tensor_mask(plain) and not family.tensor_mask(_op("alibi").spec)
    src = render(family.plan(plain, "sm_90"))
    assert "s_keep" not in src and "next_kept" not in src and "load_block(ld_j++, st)" in src
    assert "block_step" not in src and "fg::dec::split_range(n_lo, n_hi, eff_splits, split)" in src


@pytest.mark.parametrize("n_lo,n_hi", [(0, 1), (0, 17), (5, 1000), (3, 3)])
@pytest.mark.parametrize("splits", [1, 2, 7, 128])
def test_strided_splits_partition_the_blocks_and_share_out_a_removed_run(n_lo, n_hi, splits):
    """A tensor mask's splits take every splits-th block: together each block once; a
    contiguous run (the first half, another document's) lands on every split within one."""
    parts = [list(family.strided_split(n_lo, n_hi, splits, s)) for s in range(splits)]
    assert sorted(b for p in parts for b in p) == list(range(n_lo, n_hi))
    half = set(range(n_lo, (n_lo + n_hi) // 2))
    counts = [len(half & set(p)) for p in parts]
    assert max(counts) - min(counts) <= 1
