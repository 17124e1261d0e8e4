"""Tensor-param masks and biases on the GPU: document masking with the block-table
pre-pass, and the T5 bias table, against the float64 reference (``pytest -m gpu``).

Checks: the pre-pass table equals the brute-force table (:func:`block_table_reference`);
document_mask (2-D doc ids [batch, seqlen]), a 1-D non-causal variant, a per-head variant,
float row and column terms (flashgen/analysis/rowcol.py) and random (unsorted) ids against the fp64
reference at odd lengths, Sq != Sk, GQA, (B, S, H, D) views and rows with nothing to attend
to; query blocks whose whole table row is EMPTY (o = 0, lse = -inf); a BlockMask built once
and reused gives bitwise the per-call result, and is refused by a kernel of other tiles;
EMPTY tiles are never used (their V rows are NaN and the output stays finite); t5_bias with
distances past the table's clamp.
Accuracy bound as in test_forward.py: max|ours - ref64| <= 2 * max|ref in the input dtype -
ref64| + 1e-3.

Each case runs with both kernel families (the ``family`` fixture): on an H200 the default
is the Hopper TMA + wgmma kernel walking a table built for its tiles (checked on every
call), an op bound to ``Options(family="fa2")`` the FA2-class kernel with its own tiles.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import gpu_options  # noqa: E402

from flashgen.frontend.errors import OpInputError  # noqa: E402
from flashgen.frontend.spec import load_spec, loads_spec  # noqa: E402
from flashgen.ops.op import poison_outputs  # noqa: E402
from flashgen.ops.prefill.blockmask import EMPTY, FULL, PARTIAL, block_table_reference  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
DOC = load_spec(REPO / "specs" / "document_mask.yaml")
T5 = load_spec(REPO / "specs" / "t5_bias.yaml")
DOC1D = loads_spec(
    "name: gpu_doc1d\nhead_dim: 64\ndtype: fp16\nmask: doc[q_idx] == doc[kv_idx]\n"
    "params:\n  doc: {type: i32, shape: [seqlen_q]}\n",
    "doc1d.yaml",
)
PER_HEAD = loads_spec(
    "name: gpu_perhead\nhead_dim: 128\ndtype: bf16\n"
    "mask: 'causal && (q_idx - kv_idx < win[h] || doc[kv_idx] == 0)'\n"
    "params:\n  win: {type: i32, shape: [num_heads]}\n  doc: {type: i32, shape: [seqlen_k]}\n",
    "perhead.yaml",
)
#: float terms of each side (flashgen/analysis/rowcol.py: both kernel families read them once per
#: query
#: row and once per key column, shuffled to the elements), a bool column term, GQA
FLOAT_TERMS = loads_spec(
    "name: gpu_float_terms\nhead_dim: 128\ndtype: bf16\n"
    "mask: 'qb[b, q_idx] + kw[h, kv_idx] > 0.0 || (kw[h, kv_idx] < -1.0 && causal)'\n"
    "params:\n  qb: {type: f32, shape: [batch, seqlen_q]}\n"
    "  kw: {type: f32, shape: [num_heads, seqlen_k]}\n",
    "float_terms.yaml",
)
DEV = torch.device("cuda")


@pytest.fixture(autouse=True, params=["auto", "fa2"])
def family(request, monkeypatch):
    """Every case runs twice: with the default kernel (on an H200, the Hopper kernel) and
    with the FA2-class kernel: ops bound to ``Options(family=...)`` (:mod:`gpu_options`)."""
    gpu_options.use(monkeypatch, family=request.param)
    return request.param


def expected_template(family: str) -> str:
    hopper = family == "auto" and torch.cuda.get_device_capability(DEV) == (9, 0)
    return "sm_90/fwd.cu.j2" if hopper else "sm_80/fwd.cu.j2"


def doc_ids(b, s, n, gen, *, sort=True):
    t = torch.randint(0, n, (b, s), device=DEV, generator=gen, dtype=torch.int32)
    return t.sort(-1).values if sort else t


def qkv(spec, b, hq, hkv, sq, sk, gen, bshd=False):
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[spec.dtype]
    q = torch.randn(b, hq, sq, spec.head_dim, device=DEV, generator=gen).to(dt)
    k = torch.randn(b, hkv, sk, spec.head_dim, device=DEV, generator=gen).to(dt)
    v = torch.randn(b, hkv, sk, spec.head_dim_v, device=DEV, generator=gen).to(dt)
    if bshd:
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    return q, k, v


def check(spec, q, k, v, params, error_bound, **kw):
    op = gpu_options.build(spec)
    with poison_outputs():
        o, lse = op.attention(q, k, v, **params, **kw)
    torch.cuda.synchronize()
    family = op.options.family
    assert op.kernel(DEV).plan.template == expected_template(family), "not the expected kernel"
    assert not o.isnan().any() and not lse.isnan().any(), "an output element was not written"
    ref_o, ref_lse, bound = error_bound(spec, q, k, v, params)
    err = (o.double() - ref_o).abs().max().item()
    assert err <= bound, f"{spec.name} {list(q.shape)} Sk={k.shape[2]}: {err:.3e} > {bound:.3e}"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "rows with nothing to attend to differ"
    assert (o[empty] == 0).all()
    fin = ~empty
    if fin.any():
        rel = ((lse[fin] - ref_lse[fin]).abs() / (1 + ref_lse[fin].abs())).max().item()
        assert rel <= 1e-2, f"lse off by {rel:.3e}"
    return o, lse


# ----------------------------------------------------------------------------- the table itself
@pytest.mark.parametrize("sq, sk", [(1, 1), (17, 1000), (1000, 17), (127, 127), (2049, 1031)])
def test_pre_pass_table_matches_brute_force(sq, sk):
    gen = torch.Generator(device=DEV).manual_seed(sq + sk)
    op = gpu_options.build(DOC)
    b = 3
    params = {"doc_q": doc_ids(b, sq, 5, gen), "doc_kv": doc_ids(b, sk, 5, gen)}
    bm = op.block_mask(sq, sk, **params)
    ref = block_table_reference(
        DOC, op.kernel(DEV).plan.tiles, batch=b, heads_q=1, seqlen_q=sq, seqlen_k=sk,
        params=params, device=DEV,
    )  # fmt: skip
    assert bm.table.shape == ref.shape and torch.equal(bm.table, ref)


def test_pre_pass_table_per_head():
    gen = torch.Generator(device=DEV).manual_seed(1)
    op = gpu_options.build(PER_HEAD)
    win = torch.tensor([1, 64, 300, 5000], device=DEV, dtype=torch.int32)
    doc = doc_ids(1, 777, 3, gen)[0]
    bm = op.block_mask(777, 777, win=win, doc=doc)
    ref = block_table_reference(
        PER_HEAD, op.kernel(DEV).plan.tiles, batch=1, heads_q=4, seqlen_q=777, seqlen_k=777,
        params={"win": win, "doc": doc}, device=DEV,
    )  # fmt: skip
    assert bm.table.shape[:2] == (1, 4) and torch.equal(bm.table, ref)
    assert {EMPTY, PARTIAL, FULL} <= set(bm.table.unique().tolist())


# ----------------------------------------------------------------------------- numerics
@pytest.mark.parametrize(
    "b, hq, hkv, sq, sk",
    [(1, 2, 2, 1, 1), (2, 4, 2, 17, 17), (2, 4, 1, 127, 1000), (1, 8, 2, 1000, 127),
     (2, 4, 4, 1031, 1031), (1, 2, 1, 4097, 4097)],
)  # fmt: skip
@pytest.mark.parametrize("ndocs", [1, 3, 40])
def test_document_mask(b, hq, hkv, sq, sk, ndocs, error_bound):
    gen = torch.Generator(device=DEV).manual_seed(sq * 3 + sk + ndocs)
    q, k, v = qkv(DOC, b, hq, hkv, sq, sk, gen)
    params = {"doc_q": doc_ids(b, sq, ndocs, gen), "doc_kv": doc_ids(b, sk, ndocs, gen)}
    check(DOC, q, k, v, params, error_bound)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_document_mask_views_dtypes_and_random_ids(dtype, error_bound):
    """(B, S, H, D) views, both dtypes, and unsorted ids (every tile PARTIAL, and rows whose
    document has no key: nothing to attend to)."""
    spec = dataclasses.replace(DOC, name=f"gpu_doc_{dtype}", dtype=dtype)
    gen = torch.Generator(device=DEV).manual_seed(7)
    q, k, v = qkv(spec, 2, 8, 2, 300, 257, gen, bshd=True)
    params = {
        "doc_q": doc_ids(2, 300, 9, gen, sort=False),
        "doc_kv": doc_ids(2, 257, 6, gen, sort=False),
    }
    check(spec, q, k, v, params, error_bound)


@pytest.mark.parametrize("s", [1, 127, 1000, 2049])
def test_one_dim_doc_ids_without_causal(s, error_bound):
    """doc [seqlen_q] read at q_idx and kv_idx (so seqlen_k == seqlen_q), no causal."""
    gen = torch.Generator(device=DEV).manual_seed(s)
    q, k, v = qkv(DOC1D, 2, 4, 2, s, s, gen)
    check(DOC1D, q, k, v, {"doc": doc_ids(1, s, 6, gen)[0]}, error_bound)


def test_per_head_tensor_mask(error_bound):
    gen = torch.Generator(device=DEV).manual_seed(3)
    q, k, v = qkv(PER_HEAD, 1, 4, 2, 777, 777, gen)
    win = torch.tensor([1, 64, 300, 5000], device=DEV, dtype=torch.int32)
    check(PER_HEAD, q, k, v, {"win": win, "doc": doc_ids(1, 777, 3, gen)[0]}, error_bound)


@pytest.mark.parametrize("b, hq, hkv, sq, sk", [(2, 4, 2, 300, 257), (1, 2, 1, 17, 1031)])
def test_float_row_and_column_terms(b, hq, hkv, sq, sk, error_bound):
    gen = torch.Generator(device=DEV).manual_seed(sq + sk)
    q, k, v = qkv(FLOAT_TERMS, b, hq, hkv, sq, sk, gen)
    params = {
        "qb": torch.randn(b, sq, device=DEV, generator=gen),
        "kw": torch.randn(hq, sk, device=DEV, generator=gen),
    }
    check(FLOAT_TERMS, q, k, v, params, error_bound)
    for spec in (FLOAT_TERMS, DOC):  # both families took the row / column terms
        plan = gpu_options.build(spec).kernel(DEV).plan
        assert plan.context["row_terms"] and plan.context["col_terms"], spec.name


# ----------------------------------------------------------------------------- block-mask reuse
def test_block_mask_reuse_is_bitwise_the_per_call_result(error_bound):
    op = gpu_options.build(DOC)
    gen = torch.Generator(device=DEV).manual_seed(11)
    b, s = 2, 2000
    params = {"doc_q": doc_ids(b, s, 6, gen)}
    params["doc_kv"] = params["doc_q"].clone()
    bm = op.block_mask(s, s, **params)
    counts = bm.counts()
    assert counts["empty"] > 0 and counts["full"] > 0 and counts["partial"] > 0, counts
    for i in range(3):
        q, k, v = qkv(DOC, b, 4, 2, s, s, gen)
        o1, lse1 = check(DOC, q, k, v, params, error_bound, block_mask=bm)
        o2, lse2 = op.attention(q, k, v, **params)
        assert torch.equal(o1, o2) and torch.equal(lse1, lse2), f"call {i}"


def test_empty_tiles_are_never_used():
    """Documents of L tokens (a multiple of the kernel's BLOCK_M and BLOCK_N), no causal:
    each query tile sees FULL tiles of its own document and EMPTY ones elsewhere.  V of
    document 0 is NaN: only document 0's queries may see it."""
    op = gpu_options.build(DOC1D)
    tiles = op.kernel(DEV).plan.tiles
    L = math.lcm(tiles.block_m, tiles.block_n)
    gen = torch.Generator(device=DEV).manual_seed(5)
    s = L * 6
    doc = torch.arange(s, device=DEV, dtype=torch.int32) // L
    q, k, v = qkv(DOC1D, 1, 2, 2, s, s, gen)
    v[:, :, :L] = float("nan")
    bm = op.block_mask(s, s, doc=doc)
    assert set(bm.table.unique().tolist()) == {EMPTY, FULL}
    o, lse = op.attention(q, k, v, doc=doc, block_mask=bm)
    assert o[:, :, :L].isnan().all()
    assert not o[:, :, L:].isnan().any(), "an EMPTY tile was loaded and used"
    # the result for documents 1.. equals attention within each document
    for d in range(1, 6):
        sl = slice(L * d, L * (d + 1))
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, sl].float(), k[:, :, sl].float(), v[:, :, sl].float()
        )
        assert (o[:, :, sl].float() - ref).abs().max() < 2e-2


@pytest.mark.parametrize("sq, sk", [(1000, 777), (300, 1031), (17, 5)])
@pytest.mark.parametrize("prebuilt", [True, False], ids=["block_mask", "per_call"])
def test_query_blocks_with_no_live_key_block(sq, sk, prebuilt, error_bound):
    """Query blocks whose whole table row is EMPTY (their rows' documents have no key):
    o = 0 and lse = -inf there, the rest as the reference; GQA, Sq != Sk, odd lengths,
    with a table from op.block_mask and one the op builds itself."""
    op = gpu_options.build(DOC)
    bm_rows = op.kernel(DEV).plan.tiles.block_m
    gen = torch.Generator(device=DEV).manual_seed(sq + sk)
    b = 2
    q, k, v = qkv(DOC, b, 4, 2, sq, sk, gen)
    doc_q, doc_kv = doc_ids(b, sq, 4, gen), doc_ids(b, sk, 4, gen)
    gone = [(0, 0)] + [(1, (sq - 1) // bm_rows)]  # (batch, query block) with no live tile
    gone += [(0, 1)] if sq > bm_rows else []
    for bi, m in gone:
        doc_q[bi, m * bm_rows : (m + 1) * bm_rows] = 1000  # a document no key belongs to
    params = {"doc_q": doc_q, "doc_kv": doc_kv}
    bm = op.block_mask(sq, sk, **params)
    for bi, m in gone:
        assert (bm.table[bi, 0, m] == EMPTY).all()
    kw = {"block_mask": bm} if prebuilt else {}
    o, lse = check(DOC, q, k, v, params, error_bound, **kw)
    for bi, m in gone:
        rows = slice(m * bm_rows, (m + 1) * bm_rows)
        assert (o[bi, :, rows] == 0).all() and torch.isneginf(lse[bi, :, rows]).all()


def test_block_mask_is_refused_by_a_kernel_of_other_tiles(family):
    """A BlockMask built for one kernel family's tiles, used after switching families: the
    op refuses it (never reinterprets it) when the tiles differ, and runs when they agree."""
    op = gpu_options.build(DOC)
    gen = torch.Generator(device=DEV).manual_seed(2)
    s = 1000
    params = {"doc_q": doc_ids(1, s, 3, gen), "doc_kv": doc_ids(1, s, 3, gen)}
    bm = op.block_mask(s, s, **params)
    assert (bm.block_m, bm.block_n) == astuple_tiles(op)
    q, k, v = qkv(DOC, 1, 2, 2, s, s, gen)
    op = op.with_options(gpu_options.options(family="fa2" if family == "auto" else "auto"))
    if astuple_tiles(op) == (bm.block_m, bm.block_n):
        op.attention(q, k, v, **params, block_mask=bm)  # same tiles (e.g. no Hopper here)
        return
    with pytest.raises(OpInputError, match=r"block_mask: built for \d+x\d+ tiles, but this call"):
        op.attention(q, k, v, **params, block_mask=bm)
    o1, _ = op.attention(q, k, v, **params, block_mask=op.block_mask(s, s, **params))
    o2, _ = op.attention(q, k, v, **params)
    assert torch.equal(o1, o2)


def astuple_tiles(op) -> tuple[int, int]:
    t = op.kernel(DEV).plan.tiles
    return t.block_m, t.block_n


# ----------------------------------------------------------------------------- t5 bias
@pytest.mark.parametrize("sq, sk", [(1, 1), (17, 1000), (1000, 17), (1031, 1031)])
def test_t5_bias(sq, sk, error_bound):
    gen = torch.Generator(device=DEV).manual_seed(sq + 2 * sk)
    q, k, v = qkv(T5, 2, 4, 2, sq, sk, gen)
    bias = torch.randn(4, 257, device=DEV, generator=gen)
    check(T5, q, k, v, {"bias": bias}, error_bound)
