"""Mask analysis (``flashgen.analysis.maskinfo``) against brute force on small grids.

Soundness for every mask (shipped, gallery-style and random well-typed ones): a tile
called EMPTY has no kept pair, a tile called FULL keeps every pair.  Exactness for the
index-only masks the kernels will skip on (causal, sliding window, prefix-LM, chunked):
the class equals the brute-force class for every tile.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsl_strategies import expr, may_be_true, spec_text  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from flashgen.analysis.maskinfo import TileClass, classify, density, tile_classes  # noqa: E402
from flashgen.bench.verify import random_tensor_params  # noqa: E402
from flashgen.codegen.abi import needs_block_table  # noqa: E402
from flashgen.frontend.spec import load_spec, loads_spec  # noqa: E402
from flashgen.ops.cpu.reference import eval_expr  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

EXACT_MASKS = {
    "causal": ("causal", ""),
    "window": (
        "causal && q_idx + seqlen_k - seqlen_q - kv_idx < w",
        "  w: {type: i32, default: 9}\n",
    ),
    "prefix_lm": ("kv_idx < prefix || causal", "  prefix: {type: i32, default: 11}\n"),
    "chunked": ("q_idx / chunk == kv_idx / chunk", "  chunk: {type: i32, default: 8}\n"),
    "chunked_causal": (
        "causal && q_idx / chunk == kv_idx / chunk",
        "  chunk: {type: i32, default: 6}\n",
    ),
}
GRIDS = [(37, 53, 16, 16), (64, 64, 16, 8), (100, 30, 32, 8), (5, 70, 4, 16), (45, 45, 7, 5)]


def _spec(mask: str, params: str):
    body = f"name: m\nhead_dim: 64\ndtype: bf16\nmask: '{mask}'\n"
    if params:
        body += "params:\n" + params
    return loads_spec(body, "m.yaml")


def brute(spec, sq, sk, b=0, h=0, params=None, tensors=None, h_kv=None):
    """Boolean [sq, sk] mask by evaluating the IR on every pair (the reference evaluator)."""
    env = {
        "b": torch.tensor(b), "h": torch.tensor(h),
        "h_kv": torch.tensor(h if h_kv is None else h_kv),
        "q_idx": torch.arange(sq).view(sq, 1), "kv_idx": torch.arange(sk).view(1, sk),
        "seqlen_q": torch.tensor(sq), "seqlen_k": torch.tensor(sk),
        "__float__": torch.float64, "__device__": torch.device("cpu"),
    }  # fmt: skip
    for p in spec.scalar_params:
        env[p.name] = torch.tensor((params or {}).get(p.name, p.default))
    env.update(tensors or {})
    return eval_expr(spec.mask, env).expand(sq, sk)


def brute_class(tile) -> TileClass:
    if not tile.any():
        return TileClass.EMPTY
    return TileClass.FULL if tile.all() else TileClass.PARTIAL


def check_grid(spec, sq, sk, bm, bn, *, exact, b=0, h=0, params=None, tensors=None, h_kv=None):
    keep = brute(spec, sq, sk, b, h, params, tensors, h_kv)
    classes = tile_classes(spec, sq, sk, bm, bn, b=b, h=h, params=params, h_kv=h_kv)
    for i, row in enumerate(classes):
        for j, c in enumerate(row):
            tile = keep[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
            truth = brute_class(tile)
            if c == TileClass.EMPTY:
                assert not tile.any(), f"tile ({i},{j}) called EMPTY keeps pairs"
            if c == TileClass.FULL:
                assert tile.all(), f"tile ({i},{j}) called FULL drops pairs"
            if exact:
                assert c == truth, f"tile ({i},{j}): {c.name} != {truth.name}"


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "x".join(map(str, g)))
@pytest.mark.parametrize("name", sorted(EXACT_MASKS))
def test_index_only_masks_are_classified_exactly(name, grid):
    spec = _spec(*EXACT_MASKS[name])
    check_grid(spec, *grid, exact=True)


@pytest.mark.parametrize("path", sorted((REPO / "specs").glob("*.yaml")), ids=lambda p: p.stem)
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "x".join(map(str, g)))
def test_shipped_masks_exhaustively(path, grid):
    spec = load_spec(path)
    if spec.mask is None:
        assert all(c == TileClass.FULL for row in tile_classes(spec, 9, 9, 4, 4) for c in row)
        return
    params = {"window": 13} if spec.param("window") else None
    if needs_block_table(spec):  # reads tensors: sound here, exact in test_blockmask.py
        sq, sk = grid[0], grid[1]
        sizes = {"batch": 1, "num_heads": 1, "num_heads_kv": 1, "seqlen_q": sq, "seqlen_k": sk}
        tensors = random_tensor_params(spec, sizes, "cpu", torch.Generator().manual_seed(0))
        check_grid(spec, *grid, exact=False, params=params, tensors=tensors)
        return
    check_grid(spec, *grid, exact=True, params=params)


def test_tensor_masks_are_partial_not_wrong():
    """Document masking reads tensors: never EMPTY or FULL from the static analysis."""
    spec = loads_spec(
        "name: doc\nhead_dim: 64\ndtype: bf16\nmask: doc[q_idx] == doc[kv_idx]\n"
        "params:\n  doc: {type: i32, shape: [seqlen_q]}\n",
        "doc.yaml",
    )
    ids = torch.tensor([0] * 10 + [1] * 20 + [2] * 10)
    check_grid(spec, 40, 40, 8, 8, exact=False, tensors={"doc": ids})
    assert {c for row in tile_classes(spec, 40, 40, 8, 8) for c in row} == {TileClass.PARTIAL}


@settings(max_examples=150, deadline=None)
@given(
    mask=expr("bool", 3, False, False).filter(may_be_true),
    grid=st.sampled_from(GRIDS),
    bh=st.tuples(st.integers(0, 2), st.integers(0, 3), st.sampled_from([1, 2, 4])),
)
def test_random_masks_are_classified_soundly(mask, grid, bh):
    spec = loads_spec(spec_text(mask, None), "fuzz.yaml")
    b, h, group = bh  # h_kv = h // group: GQA groups of 1, 2, 4 query heads
    tensors = {
        "slopes": torch.linspace(-1, 1, 4, dtype=torch.float64),
        "kv_slopes": torch.linspace(-2, 1, 4, dtype=torch.float64),
        "ids": torch.tensor([3, 0, 7]),
    }
    check_grid(spec, *grid, exact=False, b=b, h=h, h_kv=h // group, tensors=tensors)


@pytest.mark.parametrize("grid", GRIDS[:3], ids=lambda g: "x".join(map(str, g)))
@pytest.mark.parametrize("h,group", [(0, 1), (3, 1), (3, 2), (5, 2), (7, 4)])
def test_kv_head_masks_are_classified_exactly(grid, h, group):
    """``h_kv`` is exact per tile, like ``h``: a per-KV-head window is decided exactly."""
    spec = _spec("causal && q_idx - kv_idx < 4 + 8 * h_kv", "")
    check_grid(spec, *grid, exact=True, h=h, h_kv=h // group)
    # h_kv, not h: with group 4, heads 4..7 share KV head 1's window
    if group == 4:
        assert tile_classes(spec, 40, 40, 8, 8, h=h, h_kv=1) == tile_classes(
            spec, 40, 40, 8, 8, h=4, h_kv=1
        )


def test_window_density_matches_the_band():
    spec = _spec(*EXACT_MASKS["window"])
    live, full = density(spec, 1024, 1024, 64, 64, params={"w": 128})
    # query block i sees key blocks i (diagonal, partial), i - 1 (full) and i - 2 (partial):
    # 1 + 2 + 14 * 3 live tiles of 256, 0 + 1 + 14 of them full
    assert live == pytest.approx(45 / 256)
    assert full == pytest.approx(15 / 256)


def test_no_mask_is_full_and_classify_takes_params():
    spec = _spec(*EXACT_MASKS["window"])
    kw = {"b": 0, "h": 0, "seqlen_q": 100, "seqlen_k": 100}
    assert classify(spec, (50, 59), (0, 9), params={"w": 8}, **kw) == TileClass.EMPTY
    assert classify(spec, (50, 59), (0, 9), params={"w": 100}, **kw) == TileClass.FULL


def test_integer_overflow_makes_the_tile_unknown():
    """The kernels compute the DSL's integers in C int: a range that may leave int32 has no
    sound bound, so the tile is PARTIAL (evaluated element by element), not FULL/EMPTY by
    double-precision arithmetic that the kernel would not reproduce."""
    spec = loads_spec(
        'name: o\nhead_dim: 64\ndtype: bf16\nmask: "q_idx * 100000000 >= kv_idx * 100000000"\n'
    )
    kw = dict(b=0, h=0, seqlen_q=64, seqlen_k=64)
    assert classify(spec, (3, 4), (0, 1), **kw) == TileClass.FULL  # no overflow: exact
    assert classify(spec, (30, 31), (0, 1), **kw) == TileClass.PARTIAL  # 3e9 > int32


#: int32 wrap-around of abs and / (as of + - * and unary -): abs(INT_MIN) and INT_MIN / -1
#: are INT_MIN in the kernels and the reference, where the rules had 2^31 (FULL, EMPTY).
#: (mask, params, whether the brute-force class at q 0..1, kv 0..1 is the analysis's)
WRAP_MASKS = [
    ("abs(p) >= 0", {"p": -(2**31)}, False),  # was FULL, keeps nothing
    ("abs(q_idx + p) > 0", {"p": -(2**31)}, False),  # was FULL, drops q 0
    ("p / r < 0", {"p": -(2**31), "r": -1}, False),  # was EMPTY, keeps all
    ("(kv_idx + p) / -1 < 0", {"p": -(2**31)}, False),  # was EMPTY, keeps kv 0
    ("abs(q_idx - kv_idx) < 2 + p", {"p": 0}, True),  # no wrap: still exact
    ("(q_idx - p) / r >= kv_idx", {"p": 1, "r": -1}, True),
]


@pytest.mark.parametrize("mask, params, exact", WRAP_MASKS, ids=[m for m, _, _ in WRAP_MASKS])
def test_abs_and_division_wrap_like_the_kernels(mask, params, exact):
    spec = _spec(mask, "  p: {type: i32, default: 0}\n  r: {type: i32, default: 1}\n")
    check_grid(spec, 2, 2, 2, 2, exact=exact, params=params)
    check_grid(spec, 9, 7, 3, 2, exact=False, params=params)


#: Masks whose float math the kernels round to float32 while the analysis bounds it in
#: double: at (q 335, kv 304) kv_idx * 1.1 + 0.6 <= q_idx is false in double and true in
#: float32, and the tile around it was called EMPTY (never loaded) at 16 x 16 tiles.
FLOAT_MASKS = [
    "kv_idx * 1.1 + 0.6 <= q_idx",
    "kv_idx * 0.6 + 0.6 <= q_idx",  # 128 x 64 tile (q 384, kv 576) was FULL, drops (384, 639)
    "kv_idx * 0.4 + 0.4 <= q_idx",
    "kv_idx <= q_idx / 0.3 - 1.0",
    "q_idx * 0.1 - kv_idx * 0.1 >= 1.0 || kv_idx * 0.7 == 2.1",
    "(q_idx - kv_idx) * 0.35 < 3.3 && kv_idx * 2.9 <= q_idx * 3.3",
    "exp((kv_idx - q_idx) * 0.05) * 3.3 >= 1.0",
    "tanh((q_idx - kv_idx) * 0.01) > 0.05",
]


@pytest.mark.parametrize("mask", FLOAT_MASKS)
def test_float_masks_are_classified_soundly_for_float32(mask):
    from flashgen.ops.cpu.reference import eval_mask

    spec = loads_spec(f"name: fm\nhead_dim: 64\ndtype: bf16\nmask: '{mask}'\n", "fm.yaml")
    for sq, sk, bm, bn in [(999, 999, 16, 16), (1024, 1000, 128, 64), (513, 700, 64, 32)]:
        keep = eval_mask(spec, batch=1, heads_q=1, seqlen_q=sq, seqlen_k=sk)[0, 0]  # float32
        classes = tile_classes(spec, sq, sk, bm, bn)
        for i, row in enumerate(classes):
            for j, c in enumerate(row):
                tile = keep[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
                where = f"{mask}: tile (q {i * bm}, kv {j * bn}) of {bm}x{bn}"
                assert c != TileClass.EMPTY or not tile.any(), f"{where} called EMPTY keeps pairs"
                assert c != TileClass.FULL or tile.all(), f"{where} called FULL drops pairs"
        assert any(c != TileClass.PARTIAL for row in classes for c in row) or "tanh" in mask
