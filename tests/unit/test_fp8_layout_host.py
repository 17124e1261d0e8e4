"""The FP8 Hopper forward's index maps (templates/common/fp8.cuh), compiled for the host with
nvcc from the very header the kernels include, against a numpy model of the layouts they
connect (PTX ISA 8.x, "Matrix fragments for wgmma.m64nNk16 / m64nNk32", and the TMA / wgmma
128- and 64-byte swizzles):

- ``fg::fp8::VTranspose`` turns a V tile as TMA lands it into Vt as the P V wgmma reads it,
  every byte once, with Vt's columns in ``key_of_col`` order per 32-key step; with 128-byte
  panels each warp-wide load and store touches 32 distinct banks;
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
using namespace fg::fp8;

template <int BN, int D, int PANEL>
void tile(const char* tag) {
    using VT = VTranspose<BN, D, PANEL>;
    // staging[] from stdin-free data: V[key][d] = (key * 3 + d * 5 + 1) & 255, laid out as TMA does
    std::vector<unsigned char> st(BN * D), vt(BN * D, 0);
    for (int k = 0; k < BN; ++k)
        for (int d = 0; d < D; ++d)
            st[(d / PANEL) * BN * PANEL + swz<PANEL>(k, d % PANEL)] =
                (unsigned char)((k * 3 + d * 5 + 1) & 255);
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

int main() {
    for (int c = 0; c < 32; ++c) printf("K %d %d\n", c, key_of_col(c));
    for (int m = 0; m < 4; ++m)
        for (int n = 0; n < 4; ++n) printf("A %d %d %d\n", m, n, acc_of(m, n));
    tile<128, 128, 128>("d128");
    tile<128, 256, 128>("d256");
    tile<128, 64, 64>("d64");
    tile<64, 256, 128>("d256n64");
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
    (tmp / "prog.cu").write_text(PROGRAM)
    cmd = [find_nvcc(), "-std=c++17", "-O1", "-x", "cu", "prog.cu", "-o", "prog"]
    built = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    out = subprocess.run([str(tmp / "prog")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rec: dict = {"K": {}, "A": {}, "L": {}, "S": {}, "V": {}, "F": {}}
    for line in out.stdout.splitlines():
        kind, *f = line.split()
        if kind == "K":
            rec["K"][int(f[0])] = int(f[1])
        elif kind == "A":
            rec["A"][int(f[0]), int(f[1])] = int(f[2])
        elif kind == "F":
            rec["F"][f[0]] = int(f[1])
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
