"""The FA2-class forward's ``fwd_split_o`` and ``fwd_q_regs`` switches (lower.FORWARD_OPTIONS):
off by default (the source is what it was), planning (threads, shared memory, refusals),
rendering for every kind of spec, the tuning-table path, spill-free nvcc builds at head_dim
256 (skipped without nvcc), and the tools around them (tools/perf_sweep.py flips,
tools/sass_mma_distance.py's metric).  No GPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from flashgen import lower, tuning
from flashgen.compile import NvccNotFoundError, find_nvcc
from flashgen.lower import TileConfig, plan_forward, split_o_error
from flashgen.render import render
from flashgen.spec import loads_spec
from flashgen.varlen import varlen_spec

REPO = Path(__file__).resolve().parents[2]
SPLIT = {"fwd_split_o": True, "fwd_even_loads": True}
SPLIT_Q = {**SPLIT, "fwd_q_regs": True}
#: Names only the split / Q-in-registers kernels have.
SPLIT_ONLY = ("sP_lane", "s_max", "bar.sync", "n_half", "sK_h", "sV_h")
Q_ONLY = ("qf[",)

DOC_MASK = """name: split_doc
head_dim: 256
dtype: bf16
mask: causal && doc[q_idx] == doc[kv_idx]
params:
  doc: {type: i32, shape: [seqlen_q]}
"""


def _spec(mask="causal", d=256, score_mod=None, dtype="bf16", extra=""):
    text = f"name: split_t\nhead_dim: {d}\ndtype: {dtype}\nmask: {mask}\n{extra}"
    if score_mod:
        text += f"score_mod: {score_mod}\n"
    return loads_spec(text)


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _kinds():
    """Specs that reach each branch of the template the switches touch."""
    return [
        _spec(),
        _spec("null"),
        _spec("causal && q_idx - kv_idx < 300"),  # residual mask
        _spec("causal", score_mod="score * 0.5"),
        _spec("causal", score_mod="score - 0.25 * (q_idx - kv_idx)"),  # affine
        _spec("causal", score_mod="50.0 * tanh(score / 50.0)"),
        loads_spec(DOC_MASK),  # block table, row / column terms
        varlen_spec(_spec("causal && q_idx - kv_idx < 300")),
        _spec("causal", d=128),
    ]


def test_off_by_default_renders_the_same_source():
    assert not lower.FORWARD_OPTIONS["fwd_split_o"] and not lower.FORWARD_OPTIONS["fwd_q_regs"]
    for spec in _kinds():
        for target in ("sm_80", "sm_90"):
            plain = plan_forward(spec, target, family="fa2")
            off = plan_forward(
                spec, target, options={"fwd_split_o": False, "fwd_q_regs": False}, family="fa2"
            )
            src = render(plain)
            assert src == render(off)
            assert not any(w in src for w in SPLIT_ONLY + Q_ONLY), spec.name
            assert plain.threads == plain.tiles.threads


@pytest.mark.parametrize("opts", [SPLIT, SPLIT_Q, {"fwd_split_o": True}], ids=str)
def test_split_plan_doubles_the_warps(opts):
    spec, tiles = _spec(), TileConfig(64, 64, 4)
    plan = plan_forward(spec, "sm_90", tiles=tiles, options=opts, family="fa2")
    base = plan_forward(spec, "sm_90", tiles=tiles, family="fa2")
    assert plan.tiles == tiles and plan.threads == 256 and base.threads == 128
    assert plan.config()["threads"] == 256 and plan.context["num_warps"] == 8
    # sP (BLOCK_M x BLOCK_N elements) and s_max (two floats per row) after sQ, sK, sV
    assert plan.smem_bytes == base.smem_bytes + 64 * 64 * 2 + 64 * 8
    src = render(plan)
    assert "constexpr int NUM_WARPS = 8;" in src
    assert "constexpr int ROW_WARPS = NUM_WARPS / 2;" in src
    assert 'asm volatile("bar.sync %0, 64;\\n" :: "r"(1 + rw) : "memory");' in src
    assert f"{plan.smem_bytes}," in src  # the template static_asserts the plan's layout
    assert ("qf[" in src) == bool(opts.get("fwd_q_regs"))


def test_split_refuses_what_it_cannot_split():
    with pytest.raises(ValueError, match="BLOCK_N a multiple of 32"):
        plan_forward(_spec(), "sm_90", tiles=TileConfig(64, 48, 4), options=SPLIT, family="fa2")
    with pytest.raises(ValueError, match="head_dim_v a multiple of 128"):
        plan_forward(_spec(d=64), "sm_80", tiles=TileConfig(64, 64, 4), options=SPLIT)
    assert split_o_error(TileConfig(48, 64, 3), 256) is None
    assert split_o_error(TileConfig(32, 32, 2), 128) is None
    assert "got BLOCK_N 16 at head_dim_v 256" in split_o_error(TileConfig(64, 16, 4), 256)


@pytest.mark.parametrize("opts", [SPLIT, SPLIT_Q], ids=["split", "split_q"])
def test_split_renders_for_every_kind_of_spec(opts):
    for spec in _kinds():
        tiles = lower.default_tiles(spec)
        if split_o_error(tiles, spec.head_dim_v):
            tiles = TileConfig(64, 32, 4)
        for target in ("sm_80", "sm_90"):
            plan = plan_forward(spec, target, tiles=tiles, options=opts, family="fa2")
            src = render(plan)
            assert plan.template == "sm_80/fwd.cu.j2" and plan.threads == 2 * tiles.threads
            assert all(w in src for w in SPLIT_ONLY), spec.name
            # the scores see this warp's rows and key half
            assert "m0 + warp * WARP_M" not in src and "const int kv_raw = n0 + nt" not in src
            assert "(n0 + n_half) + nt * 8" in src and "m0 + rw * WARP_M" in src


def _table(tmp_path, monkeypatch, tiles: TileConfig, opts: dict, causal=True):
    path = tmp_path / "table.json"
    key = tuning.table_key("NVIDIA H200", "sm_90", 256, "bf16", causal, False)
    entry = {"block_m": tiles.block_m, "block_n": tiles.block_n, "num_warps": tiles.num_warps}
    tuning.update_table(key, {**entry, "options": opts}, path)
    monkeypatch.setenv(tuning.ENV, str(path))


def test_table_entry_selects_split(tmp_path, monkeypatch):
    _table(tmp_path, monkeypatch, TileConfig(48, 64, 3), SPLIT_Q)
    plan = plan_forward(_spec(), "sm_90", gpu="NVIDIA H200", family="fa2")
    assert plan.tiles == TileConfig(48, 64, 3) and plan.threads == 192
    assert all(plan.context[k] for k in SPLIT_Q)
    # an explicit option still wins over the table's
    off = plan_forward(
        _spec(), "sm_90", gpu="NVIDIA H200", family="fa2", options={"fwd_split_o": False}
    )
    assert off.tiles == TileConfig(48, 64, 3) and off.threads == 96
    assert not off.context["fwd_split_o"] and off.context["fwd_q_regs"]


def test_table_split_is_dropped_where_it_cannot_apply(tmp_path, monkeypatch):
    # head_dim_v 64: the entry's key is max(head_dim, head_dim_v) = 256, O cannot be halved
    _table(tmp_path, monkeypatch, TileConfig(64, 64, 4), SPLIT)
    spec = _spec(extra="head_dim_v: 64\n")
    plan = plan_forward(spec, "sm_90", gpu="NVIDIA H200", family="fa2")
    assert plan.tiles == TileConfig(64, 64, 4) and not plan.context["fwd_split_o"]
    assert plan.threads == 128 and plan.context["fwd_even_loads"]
    assert "s_max" not in render(plan)


def _nvcc() -> bool:
    try:
        find_nvcc()
    except NvccNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _nvcc(), reason="needs nvcc")
@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
@pytest.mark.parametrize(
    "tiles, opts",
    [(TileConfig(64, 64, 4), SPLIT), (TileConfig(64, 64, 4), SPLIT_Q)],
    ids=["64x64x4+split+even", "64x64x4+split+even+qregs"],
)
def test_split_compiles_spill_free_at_d256(target, tiles, opts):
    from flashgen import cache

    for causal in (True, False):
        spec = _spec("causal" if causal else "null")
        plan = plan_forward(spec, target, tiles=tiles, options=opts, family="fa2")
        _, report = cache.get_or_build(render(plan), plan)
        (kernel,) = report.kernels
        assert report.spill_bytes == 0, f"{target} causal={causal}: {report.spill_bytes} B"
        # at most 255: two warps per 16 rows leave ptxas room (about 160 without Q fragments)
        assert kernel.registers <= (232 if opts.get("fwd_q_regs") else 200)


def test_perf_sweep_flip_combinations():
    ps = _module("perf_sweep")
    argv = ["--candidates", "--dims", "256", "--no-fa3", "--tiles", "64x64x4", "64x48x4"]
    flips = ["--flip", "fwd_even_loads", "fwd_split_o+fwd_even_loads", "--flip-only"]
    args = ps.parse([*argv, *flips])
    assert args.flip == [("fwd_even_loads",), ("fwd_split_o", "fwd_even_loads")]
    got = {v.name: dict(v.options) for v in ps.all_variants(args) if v.causal}
    assert got == {
        "default": {},
        "default+even": {"fwd_even_loads": True},
        "default+split+even": {"fwd_split_o": True, "fwd_even_loads": True},
        "t64x64x4+even": {"fwd_even_loads": True},
        "t64x64x4+split+even": {"fwd_split_o": True, "fwd_even_loads": True},
        "t64x48x4+even": {"fwd_even_loads": True},  # BLOCK_N 48 cannot split
    }
    for v in ps.all_variants(args):
        plan = plan_forward(ps.spec_for(v.d, v.causal, v.dtype), "sm_90", tiles=v.tiles,
                            options=dict(v.options), family=v.family)  # fmt: skip
        assert plan.template == ps.FA2_TEMPLATE
        assert plan.context["fwd_split_o"] == ("+split" in v.name)
    with pytest.raises(SystemExit):
        ps.parse([*argv, "--flip", "fwd_split_o+nope"])


SASS = """
        Function : k
        /*0000*/                   LDSM.16.M88.4 R4, [R2] ;
        /*0010*/                   LDSM.16.M88.4 R8, [R3+0x800] ;
        /*0020*/                   IMAD R20, R1, R1, RZ ;
        /*0030*/                   HMMA.16816.F32.BF16 R12, R4, R8, R12 ;
        /*0040*/                   F2FP.BF16.F32.PACK_AB R4, R13, R12 ;
        /*0050*/                   HMMA.16816.F32.BF16 R16, R4, R10, R16 ;
        /*0060*/                   F2FP.BF16.F32.PACK_AB R24, R13, R12 ;
        /*0070*/                   IMAD.MOV.U32 R26, RZ, RZ, R13 ;
        /*0080*/                   HMMA.16816.F32.BF16 R16, R24, R26, R16 ;
        /*0090*/                   BAR.SYNC.DEFER_BLOCKING R60, 0x40 ;
        /*00a0*/              @P0 BRA 0x10 ;
        /*00b0*/                   EXIT ;
"""


def test_sass_mma_distance_metric():
    tool = _module("sass_mma_distance")
    m = tool.mma_distances(SASS)
    # HMMA 1: B (R8, R9) from the LDSM at 1 -> 2; HMMA 2: A's R5..R7 (LDSM at 0) and B R10..R11
    # (LDSM at 1) -> 4; HMMA 3: nothing from an LDSM.
    assert m.distances == (2, 4) and m.no_ldsm == 1 and m.near == 1 and m.median == 3
    # the loop is 0x10..0xa0: the first LDSM is outside it
    assert (m.instructions, m.hmma, m.ldsm, m.bars) == (10, 3, 1, 1)
    assert tool.parse_variant("t64x64x4+split+even-unroll") == (
        (64, 64, 4),
        {"fwd_split_o": True, "fwd_even_loads": True, "fwd_unrolled_loads": False},
    )


# ----------------------------------------------------------------------------- fragment layouts
# A model of the split kernel's shared-memory addressing (the template's formulas, by hand):
# tiles stored as load_tile / the P store write them, read back with ldmatrix as the kernel
# addresses them, compared with the m16n8k16 fragments the mmas need.  Elements are named
# by (tile, row, col); a 32-bit register holds a (lo, hi) pair of them.


def _swz(row: int, chunk: int, row_bytes: int) -> int:  # fg::swz
    if row_bytes % 128 == 0:
        return row * row_bytes + ((chunk ^ (row & 7)) << 4)
    return row * row_bytes + ((chunk ^ ((row >> 1) & 3)) << 4)


def _swz_at(row_bytes, lane_off, r, c, row0, chunk0):  # the template's swz_at (hoisted)
    if row_bytes % 128 == 0:
        return (lane_off ^ ((chunk0 & 7) << 4)) + row0 * row_bytes + (chunk0 & ~7) * 16
    return _swz(row0 + r, chunk0 + c, row_bytes)


def _lane_addrs(base, row_bytes, rs, cs, row0, chunk0):
    """Each lane's ldmatrix address: base + swz_at(swz(r, c), r, c, row0, chunk0)."""
    return [
        base + _swz_at(row_bytes, _swz(r, c, row_bytes), r, c, row0, chunk0)
        for r, c in zip(rs, cs, strict=True)
    ]


def _store_tile(mem, name, base, rows, cols):
    for row in range(rows):
        for col in range(cols):
            mem[base + _swz(row, col // 8, cols * 2) + (col % 8) * 2] = (name, row, col)


def _ldmatrix(mem, addrs, trans=False):
    """regs[lane][i] of ldmatrix.x4 (``.trans``) with lane l addressing ``addrs[l]``."""
    out = []
    for t in range(32):
        regs = []
        for i in range(4):
            rows = [addrs[8 * i + j] for j in range(8)]  # matrix i's 8 row addresses
            if trans:
                pair = tuple(mem[rows[2 * (t % 4) + e] + (t // 4) * 2] for e in (0, 1))
            else:
                pair = tuple(mem[rows[t // 4] + (2 * (t % 4) + e) * 2] for e in (0, 1))
            regs.append(pair)
        out.append(regs)
    return out


def _a_frag(name, row0, col0, lane):  # m16n8k16 A (16 x 16, rows row0.., cols col0..)
    g, c = lane // 4, lane % 4
    return [
        tuple((name, row0 + g + 8 * (i % 2), col0 + 8 * (i // 2) + 2 * c + e) for e in (0, 1))
        for i in range(4)
    ]


@pytest.mark.parametrize("block_n", [64, 32])
def test_split_fragment_addressing(block_n):
    d = dv = 256
    q_rb, v_rb, p_rb = d * 2, dv * 2, block_n * 2
    warp_m, row_warps = 16, 2
    block_m = warp_m * row_warps
    nt, dt = block_n // 16, dv // 16  # this warp's 8-column tiles of S and of O
    mem: dict = {}
    s_k, s_v, s_p = 1 << 20, 2 << 20, 3 << 20
    _store_tile(mem, "K", s_k, block_n, d)
    _store_tile(mem, "V", s_v, block_n, dv)
    # P as the warps store it: row, chunk half * NT + nt, byte (lane % 4) * 4
    for rw in range(row_warps):
        for half in (0, 1):
            for lane in range(32):
                for j in range(nt):
                    for r in (0, 1):
                        row = rw * warp_m + lane // 4 + r * 8
                        addr = s_p + _swz(row, half * nt + j, p_rb) + (lane % 4) * 4
                        col = (half * nt + j) * 8 + (lane % 4) * 2
                        mem[addr], mem[addr + 2] = ("P", row, col), ("P", row, col + 1)
    for row in range(block_m):  # the same layout as a stored tile's
        for col in range(block_n):
            assert mem[s_p + _swz(row, col // 8, p_rb) + (col % 8) * 2] == ("P", row, col)
    lanes = range(32)
    q_r, q_c = [ln % 16 for ln in lanes], [ln // 16 for ln in lanes]
    k_r = [(ln % 8) + (ln // 16) * 8 for ln in lanes]
    k_c = [(ln // 8) % 2 for ln in lanes]
    v_r = [(ln % 8) + ((ln // 8) % 2) * 8 for ln in lanes]
    v_c = [ln // 16 for ln in lanes]
    for rw in range(row_warps):
        for half in (0, 1):
            n_half = half * (block_n // 2)
            s_k_h, s_v_h = s_k + n_half * q_rb, s_v + half * dt * 16
            s_p_lane = s_p + rw * warp_m * p_rb
            for kk in range(d // 16):  # S = Q K^T: B fragments of this warp's keys
                for np_ in range(nt // 2):
                    got = _ldmatrix(mem, _lane_addrs(s_k_h, q_rb, k_r, k_c, np_ * 16, kk * 2))
                    for ln in lanes:
                        g, c = ln // 4, ln % 4
                        for i, (key0, k0) in enumerate(((0, 0), (0, 8), (8, 0), (8, 8))):
                            key = n_half + np_ * 16 + key0 + g
                            want = tuple(("K", key, kk * 16 + k0 + 2 * c + e) for e in (0, 1))
                            assert got[ln][i] == want
            for kk in range(block_n // 16):  # O += P V: A from sP, B from this warp's V columns
                got = _ldmatrix(mem, _lane_addrs(s_p_lane, p_rb, q_r, q_c, 0, kk * 2))
                for ln in lanes:
                    assert got[ln] == _a_frag("P", rw * warp_m, kk * 16, ln)
                for dp in range(dt // 2):
                    addrs = _lane_addrs(s_v_h, v_rb, v_r, v_c, kk * 16, dp * 2)
                    got = _ldmatrix(mem, addrs, trans=True)
                    for ln in lanes:
                        g, c = ln // 4, ln % 4
                        for i, (k0, n0) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
                            col = half * dv // 2 + dp * 16 + n0 + g
                            want = tuple(("V", kk * 16 + k0 + 2 * c + e, col) for e in (0, 1))
                            assert got[ln][i] == want
