"""The shared-memory XOR swizzle ``fg::swz`` (templates/common/mma_sm80.cuh), checked
exhaustively in a host program compiled with nvcc from the very header the kernels include.

For every row width the head dims give (64 to 512 bytes in steps of 64: head_dim 32 to
256 in steps of 32) it must be
* a permutation of the row's 16-byte chunks (no two chunks share an address, none leaves
  the row), and
* bank-conflict free for the access patterns of the kernels: 8 consecutive rows at one
  chunk (each 8x8 matrix of an ldmatrix, and a warp's fragment stores of O) and 8
  consecutive chunks of the row-major tile (one phase of the cp.async tile loads) fall in
  8 different 16-byte bank groups ((address / 16) % 8).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

HEADER = Path(__file__).resolve().parents[2] / "templates" / "common" / "mma_sm80.cuh"

PROGRAM = r"""
#include "HEADER"
#include <cstdio>

static int bank(uint32_t byte) { return (byte / 16) % 8; }

int main() {
    int failures = 0;
    for (int row_bytes = 64; row_bytes <= 512; row_bytes += 64) {
        const int chunks = row_bytes / 16;
        for (int row = 0; row < 128; ++row) {  // a permutation of the row's chunks
            unsigned seen[32] = {0};
            for (int c = 0; c < chunks; ++c) {
                const uint32_t off = fg::swz(row, c, row_bytes) - row * row_bytes;
                if (off % 16 || off / 16 >= (uint32_t)chunks || seen[off / 16]++) {
                    printf("row_bytes %d row %d chunk %d: offset %u\n", row_bytes, row, c, off);
                    ++failures;
                }
            }
        }
        for (int r0 = 0; r0 < 120; ++r0)  // 8 rows at one chunk
            for (int c = 0; c < chunks; ++c) {
                unsigned mask = 0;
                for (int r = r0; r < r0 + 8; ++r) mask |= 1u << bank(fg::swz(r, c, row_bytes));
                if (mask != 0xff) {
                    printf("row_bytes %d rows %d.. chunk %d: banks 0x%x\n", row_bytes, r0, c, mask);
                    ++failures;
                }
            }
        for (int i0 = 0; i0 < 64 * chunks; i0 += 8) {  // 8 consecutive chunks of the tile
            unsigned mask = 0;
            for (int i = i0; i < i0 + 8; ++i)
                mask |= 1u << bank(fg::swz(i / chunks, i % chunks, row_bytes));
            if (mask != 0xff) {
                printf("row_bytes %d tile chunks %d..: banks 0x%x\n", row_bytes, i0, mask);
                ++failures;
            }
        }
    }
    printf(failures ? "FAILED %d\n" : "OK\n", failures);
    return failures != 0;
}
"""


def test_swizzle_is_a_conflict_free_permutation(host_exe):
    exe = host_exe(PROGRAM.replace("HEADER", str(HEADER)), "swz")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stdout[-3000:]
