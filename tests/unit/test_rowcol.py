"""flashgen.rowcol: a mask's one-sided tensor reads become row / column terms.

The split is checked for meaning with the reference's evaluator (the residual expression
over the terms' values equals the mask, pair by pair, on random tensors), for shape (which
sub-expressions become terms), and the Hopper forward's use of it: the column shuffle's
index math replayed for every tile width, and the rendered document_mask kernel reading
no tensor per element.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from flashgen import ir, lower, rowcol  # noqa: E402
from flashgen.reference import _env, eval_expr  # noqa: E402
from flashgen.render import render  # noqa: E402
from flashgen.spec import load_spec, loads_spec  # noqa: E402

PARAMS = (
    "params:\n"
    "  doc_q: {type: i32, shape: [batch, seqlen_q]}\n"
    "  doc_kv: {type: i32, shape: [batch, seqlen_k]}\n"
    "  win: {type: i32, shape: [num_heads]}\n"
    "  kw: {type: f32, shape: [num_heads, seqlen_k]}\n"
    "  qb: {type: f32, shape: [seqlen_q]}\n"
    "  t: {type: f32, shape: [num_heads, 64]}\n"
    "  p: {type: i32, default: 3}\n"
)

# (mask, row terms, column terms) expected
MASKS = [
    ("doc_q[b, q_idx] == doc_kv[b, kv_idx]", 1, 1),
    ("causal && doc_q[b, q_idx] == doc_kv[b, kv_idx]", 1, 1),
    ("causal && (q_idx - kv_idx < win[h] || doc_kv[b, kv_idx] == 0)", 1, 1),
    ("qb[q_idx] + kw[h, kv_idx] > 0.25", 1, 1),
    # maximal one-sided sub-expressions: kw[h, kv_idx] and kw[h, kv_idx] < 0.5
    ("kw[h, kv_idx] > qb[q_idx] && kw[h, kv_idx] < 0.5", 1, 2),
    ("kw[h, kv_idx] > qb[q_idx] || kw[h, kv_idx] < qb[q_idx]", 1, 1),  # equal reads: one local
    ("(doc_q[b, q_idx] % p == 0 ? kw[h, kv_idx] : qb[q_idx]) > 0.0", 2, 1),
    ("doc_kv[b, min(kv_idx + p, seqlen_k - 1)] != doc_q[b, q_idx / 2]", 1, 1),
    ("t[h, abs(q_idx - kv_idx) % 64] > 0.0", 0, 0),  # reads both sides: stays per element
    ("q_idx - kv_idx < p", 0, 0),  # no tensor: nothing to hoist
    ("causal && !(doc_q[b, q_idx] > doc_kv[b, kv_idx] + win[h])", 1, 1),  # win[h] joins the column
]


def _spec(mask: str):
    return loads_spec(f"name: rc\nhead_dim: 64\ndtype: bf16\nmask: '{mask}'\n{PARAMS}", "rc.yaml")


def _values(b: int, hq: int, sq: int, sk: int, gen: torch.Generator) -> dict:
    return {
        "doc_q": torch.randint(0, 3, (b, sq), generator=gen, dtype=torch.int32),
        "doc_kv": torch.randint(0, 3, (b, sk), generator=gen, dtype=torch.int32),
        "win": torch.randint(-5, 40, (hq,), generator=gen, dtype=torch.int32),
        "kw": torch.randn(hq, sk, generator=gen),
        "qb": torch.randn(sq, generator=gen),
        "t": torch.randn(hq, 64, generator=gen),
    }


@pytest.mark.parametrize("mask,n_rows,n_cols", MASKS)
def test_split_keeps_the_mask_and_hoists_what_it_should(mask, n_rows, n_cols):
    spec = _spec(mask)
    parts = rowcol.split(spec.mask, spec)
    assert (len(parts.rows), len(parts.cols)) == (n_rows, n_cols)
    for t in parts.rows:
        used = {n.name for n in ir.walk(t.expr) if isinstance(n, ir.Var)}
        assert "kv_idx" not in used and "score" not in used
    for t in parts.cols:
        used = {n.name for n in ir.walk(t.expr) if isinstance(n, ir.Var)}
        assert "q_idx" not in used and "score" not in used
    if not parts.rows and not parts.cols:
        assert parts.expr == spec.mask
    # the residual over the terms' values is the mask, pair by pair
    b, hq, sq, sk = 2, 3, 37, 53
    gen = torch.Generator().manual_seed(len(mask))
    env = _env(spec, b, hq, sq, sk, _values(b, hq, sq, sk, gen), "cpu", torch.float64)
    want = eval_expr(spec.mask, dict(env))
    env2 = dict(env)
    for t in parts.rows + parts.cols:
        env2[t.name] = eval_expr(t.expr, dict(env))
    got = eval_expr(parts.expr, env2)
    want, got = torch.broadcast_tensors(want, got)
    assert torch.equal(want, got), f"{mask}: {(want != got).sum()} pairs differ"


def test_row_terms_have_no_key_shape_and_column_terms_no_query_shape():
    """A row term's value is the same for every key (shape [B, H, Sq, 1] at most), a
    column term's for every query row: what lets the kernel evaluate them once per side."""
    spec = _spec(MASKS[5][0])
    parts = rowcol.split(spec.mask, spec)
    gen = torch.Generator().manual_seed(0)
    env = _env(spec, 2, 3, 37, 53, _values(2, 3, 37, 53, gen), "cpu", torch.float64)
    for t in parts.rows:
        assert eval_expr(t.expr, dict(env)).shape[-1:] in (torch.Size([1]), torch.Size([]))
    for t in parts.cols:
        v = eval_expr(t.expr, dict(env))
        assert v.dim() < 2 or v.shape[-2] == 1


@pytest.mark.parametrize("block_n", [16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 256])
def test_column_shuffle_reaches_every_element_s_column(block_n):
    """The Hopper forward's col_vectors / col_fetch: lane l holds the column terms of
    columns 32c + l (c < NC); element (j, e) of lane L reads register j / 4 of lane
    (j % 4) * 8 + (L % 4) * 2 + e, which must hold its column 8j + 2(L % 4) + e."""
    nc = (block_n + 31) // 32
    for lane in range(32):
        for j in range(block_n // 8):
            for e in range(2):
                src, reg = (j % 4) * 8 + (lane % 4) * 2 + e, j // 4
                assert reg < nc and 0 <= src < 32
                assert 32 * reg + src == 8 * j + 2 * (lane % 4) + e


def _hopper_source(spec) -> str:
    plan = lower.plan_hopper_forward(spec, "sm_90", lower.hopper_tiles(spec))
    return render(plan)


def test_document_mask_kernel_reads_no_tensor_per_element():
    spec = load_spec(Path(__file__).resolve().parents[2] / "specs" / "document_mask.yaml")
    src = _hopper_source(spec)
    loop = src[src.index("auto softmax = [&]") : src.index("auto row_max_log2")]
    assert "t_doc_" not in loop.split("for (int j = 0; j < NS; ++j)")[1]
    assert "__shfl_sync(0xffffffffu, fg_col0_v[j / 4]" in loop
    assert "fg_row0_r[r] = (int)(t_doc_q[" in src
    assert "& ((fg_row0 == fg_col0))" in loop  # no short-circuit left: registers only


def test_bool_and_float_terms_render_with_their_types():
    spec = _spec("causal && (q_idx - kv_idx < win[h] || kw[h, kv_idx] > 0.5) && qb[q_idx] < 1.0")
    src = _hopper_source(spec)
    assert "int fg_row0_r[2];" in src  # win[h]
    assert "int fg_row1_r[2];" in src  # qb[q_idx] < 1.0 (a bool travels as int)
    assert "const bool fg_row1 = fg_row1_r[i / 2];" in src
    assert "int fg_col0_v[NC];" in src and "const bool fg_col0 = fg_col0_c[i % 2];" in src


def test_forward_context_without_side_terms_is_unchanged():
    spec = _spec(MASKS[0][0])
    tiles = lower.default_tiles(spec)
    plain = lower._forward_context(spec, "sm_80", tiles)
    assert plain["row_terms"] == [] and plain["col_terms"] == []
    assert plain["mask_reads_memory"] and "t_doc_q[" in plain["mask_expr"]
    split = lower._forward_context(spec, "sm_90", tiles, side_terms=True)
    assert not split["mask_reads_memory"] and split["mask_expr"] == "(fg_row0 == fg_col0)"


DOC_MASK = "causal && doc_q[b, q_idx] == doc_kv[b, kv_idx]"
FLOAT_MASK = "qb[q_idx] + kw[h, kv_idx] > 0.0 || (kw[h, kv_idx] < -1.0 && causal)"
PER_HEAD = "causal && (q_idx - kv_idx < win[h] || doc_kv[b, kv_idx] == 0)"


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", [DOC_MASK, FLOAT_MASK, PER_HEAD])
def test_select_keeps_terms_where_they_fit_and_never_spills(requires_nvcc, mask, d):
    """select.build_forward: the Hopper kernel with row / column terms at the planned tiles,
    or (where those spill, as PER_HEAD's do on ptxas 13.0 at d128) the same tiles with the
    reads per element, before any narrower tiles."""
    from flashgen import select

    spec = loads_spec(f"name: rc\nhead_dim: {d}\ndtype: bf16\nmask: '{mask}'\n{PARAMS}", "rc.yaml")
    first = lower.forward_tile_candidates(spec, "sm_90")[0]
    plan, _, report = select.build_forward(spec, "sm_90")
    assert report.spill_bytes == 0, report
    assert plan.template == "sm_90/fwd.cu.j2" and plan.tiles == first
    if mask == DOC_MASK:  # the shipped document_mask's form keeps its terms at every head dim
        assert plan.context["row_terms"] and plan.context["col_terms"]
    if not plan.context["col_terms"]:
        assert plan.context["mask_reads_memory"]
