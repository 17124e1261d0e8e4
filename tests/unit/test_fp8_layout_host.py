"""The FP8 Hopper forward's index maps (templates/common/fp8.cuh), compiled for the host with
nvcc from the very header the kernels include, against a numpy model of the layouts they
connect (PTX ISA 8.x, "Matrix fragments for wgmma.m64nNk16 / m64nNk32", and the TMA / wgmma
128- and 64-byte swizzles):

- ``fg::fp8::VTranspose`` turns a V tile as TMA lands it into Vt as the P V wgmma reads it,
  every byte once, with Vt's columns in ``key_of_col`` order per 32-key step; with 128-byte
  panels each warp-wide load and store touches 32 distinct banks;
- ``fg::fp8::VTransposeLdsm`` (common/fp8_ldsm.cuh: ldmatrix.x4, 4 byte permutes,
  stmatrix.x4.trans per 512 bytes), run through host emulations of the two instructions (PTX
  ISA, "ldmatrix" / "stmatrix"; in the program and again in numpy), writes exactly
  VTranspose's bytes, bank-conflict free, with a quarter of its shared-memory instructions;
- ``fg::fp8::acc_of`` puts into byte n of A register m the accumulator register that holds
  the key ``key_of_col`` assigns to that A column, in the same row: P's columns and Vt's
  columns are permuted alike, so P V is unchanged (FlashAttention-3, section 3.3)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from flashgen.build.compile import NvccNotFoundError, find_nvcc

HEADER = Path(__file__).resolve().parents[2] / "templates" / "common" / "fp8.cuh"

PROGRAM = r"""
#include <cstdint>
#include <cstdio>
#include <vector>
#include "fp8.cuh"
#include "fp8_ldsm.cuh"
using namespace fg::fp8;

// The V stage from fixed data, laid out as TMA writes it: V[key][d] = (key * 3 + d * 5 + 1) & 255.
template <int BN, int D, int PANEL>
std::vector<unsigned char> staged() {
    std::vector<unsigned char> st(BN * D);
    for (int k = 0; k < BN; ++k)
        for (int d = 0; d < D; ++d)
            st[(d / PANEL) * BN * PANEL + swz<PANEL>(k, d % PANEL)] =
                (unsigned char)((k * 3 + d * 5 + 1) & 255);
    return st;
}

template <int BN, int D, int PANEL>
void tile(const char* tag) {
    using VT = VTranspose<BN, D, PANEL>;
    std::vector<unsigned char> st = staged<BN, D, PANEL>(), vt(BN * D, 0);
    std::vector<int> writes(BN * D, 0);
    int fast_ok = 1;
    for (int w = 0; w < VT::ITERS; ++w) {
        for (int lane = 0; lane < 32; ++lane) {
            int g, q;
            VT::unit(lane, w, g, q);
            uint32_t lv[4], lvt[4], xv, av, xvt, avt;  // the kernel's form of the offsets
            VT::lane_offsets(lane, lv, lvt);
            VT::iter_terms(w, xv, av, xvt, avt);
            for (int i = 0; i < 4; ++i)
                fast_ok &= ((lv[i] ^ xv) + av) == VT::v_offset(VT::key(g, i), q);
            for (int j = 0; j < 4; ++j)
                fast_ok &= ((lvt[j] ^ xvt) + avt) == VT::vt_offset(4 * q + j, g);
            uint32_t x[4], y[4];
            for (int i = 0; i < 4; ++i) {
                const uint32_t off = VT::v_offset(VT::key(g, i), q);
                x[i] = st[off] | (st[off + 1] << 8) | (st[off + 2] << 16)
                       | ((uint32_t)st[off + 3] << 24);
                printf("L %s %d %d %u\n", tag, w, i, off);
            }
            VT::transpose(x, y);
            for (int j = 0; j < 4; ++j) {
                const uint32_t off = VT::vt_offset(4 * q + j, g);
                for (int b = 0; b < 4; ++b) {
                    vt[off + b] = (y[j] >> (8 * b)) & 255;
                    writes[off + b]++;
                }
                printf("S %s %d %d %u\n", tag, w, j, off);
            }
        }
    }
    for (int i = 0; i < BN * D; ++i) printf("V %s %d %d %d\n", tag, i, vt[i], writes[i]);
    printf("F %s %d\n", tag, fast_ok);
}

// Host emulations of the two warp-wide instructions (PTX ISA, sm_90; .m8n8, .b16, .x4):
// ldmatrix (no .trans): lane l's register i = bytes 4 (l % 4)..+3 of row l / 4 of matrix i, the
//   16 bytes at the address of lane 8 i + l / 4 (element 2 (l % 4) in the low half);
// stmatrix .trans: the b16 element of lane l's register j in half h (low half: element column
//   2 (l % 4) of fragment row l / 4) is stored transposed: at element l / 4 (bytes 2 (l / 4),
//   +1) of row 2 (l % 4) + h of matrix j, the row at the address of lane 8 j + 2 (l % 4) + h.
static void ldmatrix_x4(const std::vector<unsigned char>& m, const uint32_t (&addr)[32],
                        uint32_t (&r)[32][4]) {
    for (int l = 0; l < 32; ++l)
        for (int i = 0; i < 4; ++i) {
            const uint32_t a = addr[8 * i + l / 4] + 4 * (l % 4);
            r[l][i] = m[a] | (m[a + 1] << 8) | (m[a + 2] << 16) | ((uint32_t)m[a + 3] << 24);
        }
}
static void stmatrix_x4_trans(std::vector<unsigned char>& m, std::vector<int>& writes,
                              const uint32_t (&addr)[32], const uint32_t (&r)[32][4]) {
    for (int l = 0; l < 32; ++l)
        for (int j = 0; j < 4; ++j)
            for (int h = 0; h < 2; ++h) {
                const uint32_t a = addr[8 * j + 2 * (l % 4) + h] + 2 * (l / 4);
                m[a] = (r[l][j] >> (16 * h)) & 255;
                m[a + 1] = (r[l][j] >> (16 * h + 8)) & 255;
                writes[a]++;
                writes[a + 1]++;
            }
}

template <int BN, int D, int PANEL>
void tile_ldsm(const char* tag) {
    using VT = VTransposeLdsm<BN, D, PANEL>;
    std::vector<unsigned char> st = staged<BN, D, PANEL>(), vt(BN * D, 0);
    std::vector<int> writes(BN * D, 0);
    int fast_ok = 1, smem = 0, prmt = 0;
    for (int lane = 0; lane < 32; ++lane) {
        uint32_t s[2];
        VT::sel(lane, s);
        printf("P %s %d %u %u\n", tag, lane, s[0], s[1]);
    }
    for (int w = 0; w < VT::ITERS; ++w) {
        int blk, dc;
        VT::unit(w, blk, dc);
        uint32_t la[32], sa[32], x[32][4], y[32][4];
        for (int lane = 0; lane < 32; ++lane) {
            la[lane] = VT::v_offset(lane, blk, dc);
            sa[lane] = VT::vt_offset(lane, blk, dc);
            uint32_t lv, lvt, xv, av, xvt, avt;  // the kernel's form of the offsets
            VT::lane_offsets(lane, lv, lvt);
            VT::iter_terms(w, xv, av, xvt, avt);
            fast_ok &= ((lv ^ xv) + av) == la[lane] && ((lvt ^ xvt) + avt) == sa[lane];
            printf("M %s %d %d %u %u\n", tag, w, lane, la[lane], sa[lane]);
        }
        ldmatrix_x4(st, la, x);
        ++smem;
        for (int lane = 0; lane < 32; ++lane) {
            uint32_t s[2];
            VT::sel(lane, s);
            VT::transpose(x[lane], s, y[lane]);
        }
        prmt += 4;
        stmatrix_x4_trans(vt, writes, sa, y);
        ++smem;
    }
    for (int i = 0; i < BN * D; ++i) printf("W %s %d %d %d\n", tag, i, vt[i], writes[i]);
    printf("G %s %d\n", tag, fast_ok);
    printf("C ldsm %s %d %d %d\n", tag, VT::ITERS, smem, prmt);
    printf("C lds32 %s %d %d %d\n", tag, VTranspose<BN, D, PANEL>::ITERS,
           8 * VTranspose<BN, D, PANEL>::ITERS, 8 * VTranspose<BN, D, PANEL>::ITERS);
}

int main() {
    for (int c = 0; c < 32; ++c) printf("K %d %d\n", c, key_of_col(c));
    for (int m = 0; m < 4; ++m)
        for (int n = 0; n < 4; ++n) printf("A %d %d %d\n", m, n, acc_of(m, n));
    tile<128, 128, 128>("d128");
    tile<128, 256, 128>("d256");
    tile<128, 64, 64>("d64");
    tile<64, 256, 128>("d256n64");
    tile_ldsm<128, 128, 128>("d128");
    tile_ldsm<128, 256, 128>("d256");
    tile_ldsm<128, 64, 64>("d64");
    tile_ldsm<64, 256, 128>("d256n64");
    return 0;
}
"""

CONFIGS = {
    "d128": (128, 128, 128), "d256": (128, 256, 128), "d64": (128, 64, 64),
    "d256n64": (64, 256, 128),
}  # fmt: skip


def _swz(row: int, byte: int, span: int) -> int:
    """The TMA / wgmma swizzle of ``span``-byte rows (Swizzle<3,4,3> for 128 bytes: address
    bits 4-6 ^= bits 7-9; Swizzle<2,4,3> for 64: bits 4-5 ^= bits 7-8)."""
    addr = row * span + byte
    bits = 7 if span == 128 else 3
    return addr ^ (((addr >> 7) & bits) << 4)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    try:
        find_nvcc()
    except NvccNotFoundError as e:
        pytest.skip(str(e))
    tmp = tmp_path_factory.mktemp("fp8host")
    (tmp / "fp8.cuh").write_text(HEADER.read_text())
    (tmp / "fp8_ldsm.cuh").write_text(HEADER.with_name("fp8_ldsm.cuh").read_text())
    (tmp / "prog.cu").write_text(PROGRAM)
    cmd = [find_nvcc(), "-std=c++17", "-O1", "-x", "cu", "prog.cu", "-o", "prog"]
    built = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    out = subprocess.run([str(tmp / "prog")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rec: dict = {k: {} for k in "KALSVFGPMWC"}
    for line in out.stdout.splitlines():
        kind, *f = line.split()
        if kind in "FG":
            rec[kind][f[0]] = int(f[1])
        elif kind == "P":
            rec["P"].setdefault(f[0], {})[int(f[1])] = (int(f[2]), int(f[3]))
        elif kind == "M":
            rec["M"].setdefault((f[0], int(f[1])), {})[int(f[2])] = (int(f[3]), int(f[4]))
        elif kind == "W":
            rec["W"].setdefault(f[0], {})[int(f[1])] = (int(f[2]), int(f[3]))
        elif kind == "C":
            rec["C"][f[0], f[1]] = tuple(int(x) for x in f[2:])
        elif kind == "K":
            rec["K"][int(f[0])] = int(f[1])
        elif kind == "A":
            rec["A"][int(f[0]), int(f[1])] = int(f[2])
        elif kind in "LS":
            rec[kind].setdefault((f[0], int(f[1]), int(f[2])), []).append(int(f[3]))
        else:
            rec["V"].setdefault(f[0], {})[int(f[1])] = (int(f[2]), int(f[3]))
    return rec


def test_the_swizzle_model_is_the_headers():
    """The model's swizzle (address-bit XOR) is a permutation of each 8-row atom's chunks."""
    for span in (64, 128):
        rows = 1024 // span
        offs = sorted(_swz(r, b, span) for r in range(rows) for b in range(span))
        assert offs == list(range(rows * span))


@pytest.mark.parametrize("tag", list(CONFIGS))
def test_v_transpose_writes_vt_in_key_of_col_order(run, tag):
    bn, d, _ = CONFIGS[tag]
    key_of_col = run["K"]
    vt = run["V"][tag]
    assert all(n == 1 for _, n in vt.values()), "every Vt byte written exactly once"
    for row in range(d):
        for col in range(bn):
            key = 32 * (col // 32) + key_of_col[col % 32]
            want = (key * 3 + row * 5 + 1) & 255
            assert vt[_swz(row, col, bn)][0] == want, (tag, row, col)


@pytest.mark.parametrize("tag", list(CONFIGS))
def test_kernel_offsets_equal_the_definition(run, tag):
    """The kernel's per-lane offsets XOR / plus per-iteration terms are the unit's offsets."""
    assert run["F"][tag] == 1


@pytest.mark.parametrize("tag", ["d128", "d256"])
def test_v_transpose_is_bank_conflict_free(run, tag):
    for kind in "LS":
        for key, offs in run[kind].items():
            if key[0] != tag:
                continue
            assert len(offs) == 32
            assert len({(o // 4) % 32 for o in offs}) == 32, (kind, key)


def test_p_to_a_operand_matches_vt_columns(run):
    """For every lane: the accumulator register acc_of(m, n) holds (PTX accumulator layout of
    m64nNk16: register 4j + 2r + e is row 8r + lane/4, column 8j + 2(lane%4) + e) the key
    key_of_col assigns to A column 16(m/2) + 4(lane%4) + n, in A row 8(m%2) + lane/4 (PTX A
    layout of m64nNk32 for 8-bit types)."""
    key_of_col, acc_of = run["K"], run["A"]
    assert sorted(key_of_col.values()) == list(range(32))
    for lane in range(32):
        t = lane % 4
        for m in range(4):
            for n in range(4):
                a = acc_of[m, n]
                j, r, e = a // 4, (a // 2) % 2, a % 2
                acc_row, acc_key = 8 * r + lane // 4, 8 * j + 2 * t + e
                a_row, a_col = 8 * (m % 2) + lane // 4, 16 * (m // 2) + 4 * t + n
                assert acc_row == a_row and acc_key == key_of_col[a_col], (lane, m, n)
    # the 16 registers of a step are each used once
    assert sorted(acc_of.values()) == list(range(16))


def test_model_sanity_numpy_product():
    """P V with both operands permuted by key_of_col is P V (a numpy statement of the trick)."""
    rng = np.random.default_rng(0)
    p, v = rng.standard_normal((4, 32)), rng.standard_normal((32, 8))
    perm = np.array([16 * (c >> 4) + 2 * ((c >> 2) & 3) + (c & 1) + 8 * ((c & 3) >> 1)
                     for c in range(32)])  # fmt: skip
    np.testing.assert_allclose(p[:, perm] @ v[perm], p @ v)


# ------------------------------------------------------------------ VTransposeLdsm
def _staging(bn: int, d: int, panel: int) -> np.ndarray:
    """The V tile as TMA lands it (the program's data: V[key][d] = (3 key + 5 d + 1) & 255)."""
    st = np.zeros(bn * d, np.uint8)
    for k in range(bn):
        for c in range(d):
            st[(c // panel) * bn * panel + _swz(k, c % panel, panel)] = (3 * k + 5 * c + 1) & 255
    return st


def ldmatrix_x4(mem: np.ndarray, addr: np.ndarray) -> np.ndarray:
    """numpy model of ``ldmatrix.sync.aligned.m8n8.x4.shared.b16`` (PTX ISA, "Warp-level matrix
    load instruction: ldmatrix"): lane ``8 i + r`` gives the address of row r of matrix i (16
    bytes); lane l receives in register i the b16 elements 2 (l % 4), 2 (l % 4) + 1 of row l / 4
    of matrix i, i.e. bytes 4 (l % 4).. of that row, as (32, 4) little-endian uint32."""
    lane = np.arange(32)[:, None]
    i = np.arange(4)[None, :]
    base = addr[8 * i + lane // 4] + 4 * (lane % 4)
    b = [mem[base + k].astype(np.uint32) << (8 * k) for k in range(4)]
    return b[0] | b[1] | b[2] | b[3]


def stmatrix_x4_trans(mem: np.ndarray, addr: np.ndarray, regs: np.ndarray) -> np.ndarray:
    """numpy model of ``stmatrix.sync.aligned.m8n8.x4.trans.shared.b16`` (PTX ISA, "stmatrix"):
    the fragment is ldmatrix's (lane l, register j, half h: element (l / 4, 2 (l % 4) + h) of
    matrix j) and .trans stores element (row, col) at row col, element row: bytes 2 (l / 4), +1
    of row 2 (l % 4) + h, whose address lane 8 j + 2 (l % 4) + h gives.  Returns the byte
    addresses written (each twice per 16-bit element, in order)."""
    written = []
    for lane in range(32):
        for j in range(4):
            for h in range(2):
                a = addr[8 * j + 2 * (lane % 4) + h] + 2 * (lane // 4)
                e = (int(regs[lane, j]) >> (16 * h)) & 0xFFFF
                mem[a], mem[a + 1] = e & 255, e >> 8
                written += [a, a + 1]
    return np.array(written)


def _prmt(x: int, y: int, sel: int) -> int:
    xy = (y << 32) | x
    return sum(((xy >> (8 * ((sel >> (4 * k)) & 7))) & 255) << (8 * k) for k in range(4))


@pytest.mark.parametrize("tag", list(CONFIGS))
def test_ldsm_transpose_writes_the_same_bytes_as_vtranspose(run, tag):
    """The program's emulation (the header's offsets and permutes) writes every Vt byte once and
    exactly the bytes VTranspose writes."""
    bn, d, _ = CONFIGS[tag]
    new, old = run["W"][tag], run["V"][tag]
    assert all(n == 1 for _, n in new.values()), "every Vt byte written exactly once"
    assert [new[i][0] for i in range(bn * d)] == [old[i][0] for i in range(bn * d)]
    assert run["G"][tag] == 1  # the kernel's lane offsets ^ / + iteration terms


@pytest.mark.parametrize("tag", list(CONFIGS))
def test_ldsm_transpose_under_the_numpy_instruction_model(run, tag):
    """The same, with the instructions modeled in numpy (independently of the program's
    emulation) from the header's per-lane addresses and byte-permute selectors."""
    bn, d, panel = CONFIGS[tag]
    st, vt = _staging(bn, d, panel), np.zeros(bn * d, np.uint8)
    sel = run["P"][tag]
    iters = run["C"]["ldsm", tag][0]
    count = np.zeros(bn * d, int)
    for w in range(iters):
        m = run["M"][tag, w]
        la = np.array([m[lane][0] for lane in range(32)])
        sa = np.array([m[lane][1] for lane in range(32)])
        x = ldmatrix_x4(st, la)
        y = np.zeros((32, 4), np.uint64)
        for lane in range(32):
            for a in range(2):
                for b in range(2):
                    y[lane, 2 * a + b] = _prmt(int(x[lane, 2 * a]), int(x[lane, 2 * a + 1]),
                                               sel[lane][b])
        np.add.at(count, stmatrix_x4_trans(vt, sa, y), 1)
    assert (count == 1).all()
    assert vt.tolist() == [run["V"][tag][i][0] for i in range(bn * d)]


@pytest.mark.parametrize("tag", list(CONFIGS))
def test_ldsm_transpose_is_bank_conflict_free(run, tag):
    """Each 8-row phase (one matrix) of the ldmatrix.x4 and of the stmatrix.x4 touches the 8
    distinct 16-byte bank groups: 4 wavefronts per instruction, 512 bytes each way."""
    for (t, _w), m in run["M"].items():
        if t != tag:
            continue
        for side in (0, 1):
            for mat in range(4):
                rows = [m[8 * mat + r][side] for r in range(8)]
                assert all(a % 16 == 0 for a in rows)
                assert len({(a // 16) % 8 for a in rows}) == 8, (tag, side, mat, rows)


@pytest.mark.parametrize("tag", list(CONFIGS))
def test_ldsm_transpose_instruction_counts(run, tag):
    """Warp-level shared-memory instructions and byte permutes per V tile: VTranspose takes 8
    (4 LDS.32 + 4 STS.32) and 8 PRMT per 512 bytes, VTransposeLdsm 2 (LDSM.x4 + STSM.x4.trans)
    and 4 PRMT per 512 bytes."""
    bn, d, _ = CONFIGS[tag]
    iters_old, smem_old, prmt_old = run["C"]["lds32", tag]
    iters_new, smem_new, prmt_new = run["C"]["ldsm", tag]
    assert iters_old == iters_new == bn * d // 512
    assert (smem_old, prmt_old) == (8 * iters_old, 8 * iters_old)
    assert (smem_new, prmt_new) == (2 * iters_new, 4 * iters_new)
