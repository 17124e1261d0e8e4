"""flashgen.analysis.rowcol: a mask's one-sided tensor reads become row / column terms.

The split is checked for meaning with the reference's evaluator (the residual expression
over the terms' values equals the mask, pair by pair, on random tensors), for shape (which
sub-expressions become terms), and the Hopper forward's use of it: the column shuffle's
index math replayed for every tile width, and the rendered document_mask kernel reading
no tensor per element.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from plan_helpers import forward_tile_candidates, plan_backward, plan_forward, plan_hopper_forward  # noqa: E402

from flashgen.analysis import rowcol  # noqa: E402
from flashgen.build.render import render  # noqa: E402
from flashgen.codegen.plan import TileConfig  # noqa: E402
from flashgen.families.common import forward_context as _forward_context  # noqa: E402
from flashgen.families.tiles import (  # noqa: E402
    BackwardTiles,
    backward_tile_candidates,
    default_tiles,
    hopper_tiles,
)
from flashgen.frontend import ir  # noqa: E402
from flashgen.frontend.spec import load_spec, loads_spec  # noqa: E402
from flashgen.ops.cpu.reference import _env, eval_expr  # noqa: E402
from flashgen.options import Options  # noqa: E402

PARAMS = (
    "params:\n"
    "  doc_q: {type: i32, shape: [batch, seqlen_q]}\n"
    "  doc_kv: {type: i32, shape: [batch, seqlen_k]}\n"
    "  win: {type: i32, shape: [num_heads]}\n"
    "  kw: {type: f32, shape: [num_heads, seqlen_k]}\n"
    "  qb: {type: f32, shape: [seqlen_q]}\n"
    "  t: {type: f32, shape: [num_heads, 64]}\n"
    "  p: {type: i32, default: 3}\n"
    "  kvw: {type: i32, shape: [num_heads_kv]}\n"
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
    # h_kv (the KV head of h) is per CTA like h: kvw[h_kv] joins either side
    ("q_idx - kv_idx < kvw[h_kv] + doc_kv[b, kv_idx]", 0, 1),
    ("doc_q[b, q_idx] + kvw[h_kv] > doc_kv[b, kv_idx]", 1, 1),
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
        "kvw": torch.randint(-5, 40, (hq // 2,), generator=gen, dtype=torch.int32),
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
    b, hq, sq, sk = 2, 4, 37, 53  # GQA: 2 query heads per KV head
    gen = torch.Generator().manual_seed(len(mask))
    env = _env(spec, b, hq, sq, sk, _values(b, hq, sq, sk, gen), "cpu", torch.float64, Hkv=2)
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
    env = _env(spec, 2, 4, 37, 53, _values(2, 4, 37, 53, gen), "cpu", torch.float64, Hkv=2)
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
    plan = plan_hopper_forward(spec, "sm_90", hopper_tiles(spec))
    return render(plan)


def test_document_mask_kernel_reads_no_tensor_per_element():
    spec = load_spec(Path(__file__).resolve().parents[2] / "specs" / "document_mask.yaml")
    src = _hopper_source(spec)
    loop = src[src.index("auto softmax = [&]") : src.index("auto row_max_log2")]
    assert "t_doc_" not in loop.split("for (int j = 0; j < NS; ++j)")[1]
    assert "__shfl_sync(0xffffffffu, fg_col0_v[j / 4]" in loop
    assert "fg_row0_r[r] = (int)(__ldg(fg::base_ptr(t_doc_q + " in src
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
    tiles = default_tiles(spec)
    plain = _forward_context(spec, "sm_80", tiles)
    assert plain["row_terms"] == [] and plain["col_terms"] == []
    assert plain["mask_reads_memory"] and "__ldg(fg::base_ptr(t_doc_q + " in plain["mask_expr"]
    split = _forward_context(spec, "sm_90", tiles, side_terms=True)
    assert not split["mask_reads_memory"] and split["mask_expr"] == "(fg_row0 == fg_col0)"


DOC_MASK = "causal && doc_q[b, q_idx] == doc_kv[b, kv_idx]"
FLOAT_MASK = "qb[q_idx] + kw[h, kv_idx] > 0.0 || (kw[h, kv_idx] < -1.0 && causal)"
PER_HEAD = "causal && (q_idx - kv_idx < win[h] || doc_kv[b, kv_idx] == 0)"


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", [DOC_MASK, FLOAT_MASK, PER_HEAD])
def test_select_keeps_terms_where_they_fit_and_never_spills(requires_nvcc, mask, d):
    """family_build.build_forward: the Hopper kernel with row / column terms at the planned tiles,
    or (where those spill, as PER_HEAD's do on ptxas 13.0 at d128) the same tiles with the
    reads per element, before any narrower tiles."""
    from flashgen.families import build as family_build

    spec = loads_spec(f"name: rc\nhead_dim: {d}\ndtype: bf16\nmask: '{mask}'\n{PARAMS}", "rc.yaml")
    first = forward_tile_candidates(spec, "sm_90")[0]
    plan, _, report = family_build.build_forward(spec, "sm_90")
    assert report.spill_bytes == 0, report
    assert plan.template == "sm_90/fwd.cu.j2" and plan.tiles == first
    if mask == DOC_MASK:  # the shipped document_mask's form keeps its terms at every head dim
        assert plan.context["row_terms"] and plan.context["col_terms"]
    if not plan.context["col_terms"]:
        assert plan.context["mask_reads_memory"]


# ----------------------------------------------------------------------------- FA2-class kernels
# The mma.sync m16n8k16 accumulator layout of templates/sm_80: a thread holds rows lane/4 (+8)
# of each 16-row tile and, per 8-column tile nt, columns nt*8 + 2(lane%4) + e.  The index
# expressions below are asserted to appear verbatim in the rendered kernels, then replayed.
FETCH_SRC = "(nt % 4) * 8 + (lane % 4) * 2 + e"
FETCH_REG = "_v[nt / 4]"


@functools.cache
def _code(expr: str):
    return compile(expr.replace(" / ", " // "), "<index>", "eval")


def _c(expr: str, **env) -> int:
    """A rendered C index expression over non-negative ints, evaluated in Python (compiled
    once per expression: the replays evaluate each for every element of every lane)."""
    return eval(_code(expr), {"min": min}, env)  # noqa: S307


def _doc_spec(d: int = 128, mask: str = DOC_MASK):
    return loads_spec(f"name: rc\nhead_dim: {d}\ndtype: bf16\nmask: '{mask}'\n{PARAMS}", "rc.yaml")


def _between(src: str, start: str, end: str) -> str:
    i = src.index(start)
    return src[i : src.index(end, i)]


def test_fa2_forward_reads_no_tensor_per_element():
    spec = load_spec(Path(__file__).resolve().parents[2] / "specs" / "document_mask.yaml")
    for target in ("sm_80", "sm_90"):
        plan = plan_forward(spec, target, family="fa2")
        assert plan.template == "sm_80/fwd.cu.j2"
        src = render(plan)
        # row terms once per CTA, before the key loop
        pre = _between(src, "Row terms (flashgen/analysis/rowcol.py)", "while (n_block >= 0)")
        assert "fg_row0_r[m][r] = (int)(__ldg(fg::base_ptr(t_doc_q + " in pre
        masked = _between(src, "if (cls != fg::iv::FULL || n0 + BLOCK_N > seqlen_k) {", "} else {")
        vec, elems = masked.split("for (int nt = 0; nt < NT; ++nt) {")
        assert "fg_col0_v[c] = (int)(__ldg(fg::base_ptr(t_doc_kv + " in vec and "t_doc_q" not in vec
        assert "t_doc_" not in elems  # per element: registers only
        assert f"const int src = {FETCH_SRC};" in elems
        assert f"__shfl_sync(0xffffffffu, fg_col0{FETCH_REG}, src)" in elems
        assert "const int fg_row0 = fg_row0_r[mt][i / 2];" in elems
        assert "const int fg_col0 = fg_col0_c[i % 2];" in elems
        assert "&& ((fg_row0 == fg_col0))" in elems
        # the unmasked (FULL) path reads no term at all
        assert "fg_" not in _between(src, "} else {", "// Online softmax")


def test_fa2_forward_without_terms_is_the_per_element_kernel():
    spec = _doc_spec()
    src = render(plan_forward(spec, "sm_80", side_terms=False))
    assert "fg_row0" not in src and "__shfl_sync(0xffffffffu, fg_col" not in src
    assert "&& ((__ldg(fg::base_ptr(t_doc_q + " in src


@pytest.mark.parametrize("block_m,num_warps", [(64, 4), (128, 4), (128, 8), (64, 2)])
@pytest.mark.parametrize("block_n", [16, 32, 64, 96, 128, 160, 256])
def test_fa2_forward_term_indices_replay(block_m, num_warps, block_n):
    """Every element (mt, nt, i) of every lane of the FA2 forward's masked tile reads the
    row term of its own query row and the column term of its own key column."""
    spec = _doc_spec()
    tiles = TileConfig(block_m, block_n, num_warps)
    src = render(plan_forward(spec, "sm_80", tiles=tiles))
    q_raw = "m0 + warp * WARP_M + mt * 16 + lane / 4 + (i / 2) * 8"
    kv_raw = "n0 + nt * 8 + (lane % 4) * 2 + (i % 2)"
    fixed = "m0 + warp * WARP_M + m * 16 + lane / 4"
    assert f"const int q_raw = {q_raw};" in src and f"const int kv_raw = {kv_raw};" in src
    assert f"min({fixed} + r * 8, seqlen_q - 1)" in src
    assert "min(n0 + 32 * c + lane, seqlen_k - 1)" in src
    warp_m, nc = block_m // num_warps, (block_n + 31) // 32
    m0, n0 = 3 * block_m, 5 * block_n
    for warp in range(num_warps):
        for lane in range(32):
            for mt in range(warp_m // 16):
                for nt in range(block_n // 8):
                    for i in range(4):
                        env = dict(
                            m0=m0, n0=n0, warp=warp, WARP_M=warp_m, lane=lane, mt=mt, nt=nt, i=i
                        )
                        # row term: fg_row0_r[mt][i / 2], filled at m = mt, r = i / 2
                        row = (
                            _c(fixed, m0=m0, warp=warp, WARP_M=warp_m, m=mt, lane=lane)
                            + (i // 2) * 8
                        )
                        assert row == _c(q_raw, **env)
                        # column term: register nt / 4 of lane src, column n0 + 32 (nt / 4) + src
                        src_lane = _c(FETCH_SRC, nt=nt, lane=lane, e=i % 2)
                        reg = nt // 4
                        assert reg < nc and 0 <= src_lane < 32
                        assert n0 + 32 * reg + src_lane == _c(kv_raw, **env)


def _bwd_sources(spec, target="sm_80", atomic_dq=False, side_terms=True):
    plan = plan_backward(spec, target, atomic_dq=atomic_dq, side_terms=side_terms)
    return plan, render(plan.unit)


@pytest.mark.parametrize("atomic_dq", [False, True])
def test_fa2_backward_reads_no_tensor_per_element(atomic_dq):
    spec = load_spec(Path(__file__).resolve().parents[2] / "specs" / "document_mask.yaml")
    for target in ("sm_80", "sm_90"):
        plan, src = _bwd_sources(spec, target, atomic_dq)
        assert plan.dkdv.context["dkdv_side_terms"]
        assert plan.dkdv.context["dq_side_terms"] is (not atomic_dq)
        kernels = [src[src.index(plan.dkdv.kernel_name + "(") :]]
        if not atomic_dq:
            kernels = [
                src[src.index(plan.dkdv.kernel_name + "(") : src.index(plan.dq.kernel_name + "(")]
            ]
            kernels.append(src[src.index(plan.dq.kernel_name + "(") :])
        for k, (fixed, stepped) in zip(
            kernels, [("col0_k", "row0"), ("row0_r", "col0")], strict=False
        ):
            head = "Row / column terms (flashgen/analysis/rowcol.py)"
            masked = _between(k, head, "acc_dp[nt][i] = p *")
            vec, elems = masked.split("for (int nt = 0; nt < NT; ++nt) {")
            assert f"fg_{fixed}[m][r] = (int)(__ldg(fg::base_ptr(t_doc_" in vec
            assert f"fg_{stepped}_v[c] = (int)(__ldg(fg::base_ptr(t_doc_" in vec
            assert "t_doc_" not in elems
            assert f"const int src = {FETCH_SRC};" in elems
            assert f"__shfl_sync(0xffffffffu, fg_{stepped}{FETCH_REG}, src)" in elems
            assert "&& ((fg_row0 == fg_col0))" in elems


def test_fa2_backward_terms_per_kernel():
    spec = _doc_spec()
    plan, src = _bwd_sources(spec, side_terms=["dq"])
    assert not plan.dkdv.context["dkdv_side_terms"] and plan.dkdv.context["dq_side_terms"]
    dkdv = src[src.index(plan.dkdv.kernel_name + "(") : src.index(plan.dq.kernel_name + "(")]
    dq = src[src.index(plan.dq.kernel_name + "(") :]
    assert "fg_row0" not in dkdv and "&& ((__ldg(fg::base_ptr(t_doc_q + " in dkdv
    assert "fg_row0_r[m][r]" in dq
    plan, src = _bwd_sources(spec, side_terms=False)
    assert "fg_row0" not in src and "fg_col0" not in src
    with pytest.raises(ValueError, match="unknown kernels"):
        plan_backward(spec, "sm_80", side_terms=["dkdv", "convert"])
    # a mask without tensor reads has no terms, whatever side_terms says
    plain = plan_backward(_doc_spec(mask="causal && q_idx - kv_idx < p"), "sm_80")
    assert not plain.dkdv.context["dkdv_side_terms"] and not plain.dkdv.context["dq_side_terms"]


@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
@pytest.mark.parametrize("rows,cols", [(64, 16), (64, 32), (64, 64), (32, 64), (64, 128)])
def test_fa2_backward_term_indices_replay(kernel, rows, cols):
    """dkdv holds keys in fragment rows (S^T: its column terms are the fixed side, the step's
    query rows come by shuffles); dq holds query rows (row terms fixed, keys shuffled).  Every
    element of every lane reads the terms of its own (query, key) pair.  ``rows``: the
    kernel's rows per CTA (16 per warp), ``cols``: its columns per step."""
    spec = _doc_spec()
    warp_rows = "warp * 16 + lane / 4"
    if kernel == "dkdv":
        tiles = BackwardTiles(rows, cols, rows // 16, 1, 64, 64, 4)
        q_el, kv_el = "(m0 + qi)", f"(n0 + {warp_rows} + (i / 2) * 8)"
        fixed, stepped = f"n0 + {warp_rows}", "m0"
    else:
        tiles = BackwardTiles(64, 64, 4, 1, rows, cols, rows // 16)
        q_el, kv_el = (
            f"(m0 + {warp_rows} + (i / 2) * 8)",
            "(n0 + nt * 8 + (lane % 4) * 2 + (i % 2))",
        )
        fixed, stepped = f"m0 + {warp_rows}", "n0"
    src = render(plan_backward(spec, "sm_80", tiles=tiles).unit)
    assert f"min({q_el}, seqlen_q - 1)" in src and f"min({kv_el}, seqlen_k - 1)" in src
    assert f"min({fixed} + r * 8, " in src and f"min({stepped} + 32 * c + lane, " in src
    nc = (cols + 31) // 32
    m0, n0 = 7 * 64, 3 * 64
    for warp in range(rows // 16):
        for lane in range(32):
            for nt in range(cols // 8):
                for i in range(4):
                    qi = nt * 8 + (lane % 4) * 2 + (i % 2)
                    env = dict(m0=m0, n0=n0, warp=warp, lane=lane, nt=nt, i=i, qi=qi)
                    q, kv = _c(q_el, **env), _c(kv_el, **env)
                    # the fixed side: NAME[0][i / 2], filled at r = i / 2
                    fixed_val = _c(fixed, m0=m0, n0=n0, warp=warp, lane=lane) + (i // 2) * 8
                    # the stepped side: register nt / 4 of lane src
                    src_lane, reg = _c(FETCH_SRC, nt=nt, lane=lane, e=i % 2), nt // 4
                    assert reg < nc and 0 <= src_lane < 32
                    stepped_val = _c(stepped, m0=m0, n0=n0) + 32 * reg + src_lane
                    want = (kv, q) if kernel == "dkdv" else (q, kv)
                    assert (fixed_val, stepped_val) == want


def test_select_backward_drops_terms_only_where_they_spill(monkeypatch):
    """family_build.build_backward: all kernels with terms first; a kernel that spills with them
    is retried without (the others keep theirs), before any narrower tiles."""
    from flashgen.build import cache
    from flashgen.build.compile import CompileReport, KernelResources
    from flashgen.families import build as family_build

    seen = []

    def fake_build(source, plan):
        ctx = plan.context
        seen.append((ctx["dkdv_side_terms"], ctx["dq_side_terms"], ctx["dkdv_block_m"]))
        spill = 8 if ctx["dkdv_side_terms"] else 0  # dkdv spills with terms only
        ks = (
            KernelResources(ctx["kernel_dkdv"], 255, spill, spill),
            KernelResources(ctx["kernel_dq"], 200),
            KernelResources(ctx["kernel_pre"], 28),
        )
        return "cubin", CompileReport("sm_80", "sm_80", ks, 0.0, "13.0")

    monkeypatch.setattr(cache, "get_or_build", fake_build)
    plan, _, report = family_build.build_backward(_doc_spec(), "sm_80")
    assert report.spill_bytes == 0
    assert seen == [(True, True, 32), (False, True, 32)]
    assert plan.dq.context["dq_side_terms"] and not plan.dkdv.context["dkdv_side_terms"]
    seen.clear()
    family_build.build_backward(_doc_spec(), "sm_80", options=Options(side_terms=False))
    assert seen == [(False, False, 32)]


# The FA2-class nvcc cases below cover mask x head dim x target (x dQ path) pairwise rather
# than as the product: (mask m, head dim i[, atomic a]) builds for target (m + i [+ a]) % 2.
# Every mask and every head dim builds for both targets, and (backward) each (mask, head
# dim) builds its deterministic and atomic units for different targets.  A unit renders the
# same CUDA for sm_80 and sm_90 but for the kernels' names (and the atomic unit's sm_90
# vector reduction); ptxas allocates registers per arch, so the other target of a case is
# covered by the neighbouring cases, not proven for it (half the nvcc runs: 9 + 18, not
# 18 + 36).
RC_MASKS = (("doc", DOC_MASK), ("float", FLOAT_MASK), ("perhead", PER_HEAD))
RC_TARGETS = ("sm_80", "sm_90")

FWD_SELECT_CASES = [
    pytest.param(mask, RC_TARGETS[(m + i) % 2], d, id=f"{name}-d{d}-{RC_TARGETS[(m + i) % 2]}")
    for m, (name, mask) in enumerate(RC_MASKS)
    for i, d in enumerate((64, 128, 256))
]

BWD_SELECT_CASES = [
    pytest.param(
        mask, d, RC_TARGETS[(m + i + atomic) % 2], atomic,
        id=f"{name}-d{d}-{RC_TARGETS[(m + i + atomic) % 2]}-{'atomic' if atomic else 'det'}",
    )  # fmt: skip
    for m, (name, mask) in enumerate(RC_MASKS)
    for i, d in enumerate((64, 128, 256))
    for atomic in (False, True)
]


def test_the_fa2_cases_meet_every_mask_and_head_dim_on_both_targets():
    fwd = [p.values for p in FWD_SELECT_CASES]
    bwd = [p.values for p in BWD_SELECT_CASES]
    for cases, d_at, t_at in ((fwd, 2, 1), (bwd, 1, 2)):
        assert {(c[0], c[t_at]) for c in cases} == {(m, t) for _, m in RC_MASKS for t in RC_TARGETS}
        assert {(c[d_at], c[t_at]) for c in cases} == {(d, t) for d in (64, 128, 256)
                                                       for t in RC_TARGETS}  # fmt: skip
    every = {(m, d, a) for _, m in RC_MASKS for d in (64, 128, 256) for a in (False, True)}
    assert {(m, d, a) for m, d, _, a in bwd} == every
    assert {(a, t) for _, _, t, a in bwd} == {(a, t) for a in (False, True) for t in RC_TARGETS}


@pytest.mark.parametrize("mask,target,d", FWD_SELECT_CASES)
def test_select_fa2_forward_keeps_terms_without_spills(requires_nvcc, mask, target, d):
    """The FA2-class forward (sm_80, and sm_90a with family fa2) keeps its row / column
    terms at the planned tiles with 0 spills (ptxas 13.0) for the test masks (the
    covering of FWD_SELECT_CASES)."""
    from flashgen.families import build as family_build

    spec = _doc_spec(d, mask)
    first = forward_tile_candidates(spec, target, family="fa2")[0]
    plan, _, report = family_build.build_forward(spec, target, options=Options(family="fa2"))
    assert report.spill_bytes == 0, report
    assert plan.template == "sm_80/fwd.cu.j2" and plan.tiles == first
    assert plan.context["row_terms"] and plan.context["col_terms"]


@pytest.mark.parametrize("mask,d,target,atomic", BWD_SELECT_CASES)
def test_select_fa2_backward_keeps_terms_without_spills(requires_nvcc, mask, d, target, atomic):
    """The FA2-class backward keeps row / column terms in every kernel at the table's tiles
    with 0 spills (ptxas 13.0), except the atomic dK/dV kernel at d256 for masks with more
    than one term or a float term (FLOAT_MASK, PER_HEAD: 76-116 bytes with them), which
    falls back to per-element reads at the same tiles."""
    from flashgen.families import build as family_build

    spec = _doc_spec(d, mask)
    first = backward_tile_candidates(spec, atomic_dq=atomic)[0]
    plan, _, report = family_build.build_backward(spec, target, atomic_dq=atomic)
    assert report.spill_bytes == 0, report
    assert plan.tiles == first and plan.atomic_dq is atomic
    ctx = plan.dkdv.context
    assert ctx["dq_side_terms"] is (not atomic)
    assert ctx["dkdv_side_terms"] is not (atomic and d == 256 and mask != DOC_MASK)
