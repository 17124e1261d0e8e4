"""``fg::tile_coord``, ``fg::grid_tile_coord`` and ``fg::head_group``
(templates/common/tile_order.cuh), the CTA order of both forwards and the Hopper backward, compiled
for the host with nvcc from a copy of the very header the kernels include (its functions made
``__host__ __device__``) and checked against their Python mirrors
:func:`flashgen.families.common.tile_coord` / :func:`~flashgen.families.common.grid_tile_coord` /
:func:`~flashgen.families.common.head_group`: every tile of every (query blocks 0-8, heads 1-24,
group 1 to heads + 2) grid, every CTA of :func:`~flashgen.families.common.grouped_grid`'s grids for
them, the head groups over seqlens 0 to 2^31 - 1, GQA ratios and L2 budgets, and grids at the int32
edge (every intermediate of ``tile_coord`` stays within the grid's tile count, checked under UBSan's
signed-overflow trap where the host toolchain has it)."""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import pytest

from flashgen.build.compile import find_nvcc
from flashgen.families.common import (
    HEAD_GROUP_L2_BYTES,
    grid_tile_coord,
    grouped_grid,
    head_group,
    tile_coord,
)

HEADER = Path(__file__).resolve().parents[2] / "templates" / "common" / "tile_order.cuh"

NUM_M = (0, 1, 2, 3, 5, 8)
NUM_BH = range(1, 25)
SEQLENS = (0, 1, 2, 127, 1000, 8192, 65536, 1 << 20, (1 << 31) - 1)
ROW_BYTES = (128, 256, 384, 512, 1024, 4096)
Q_PER_KV = (1, 2, 4, 8, 16)
BH = (0, 1, 5, 32, 64, 1000, 1 << 20)
L2 = (0, 1, 1 << 20, HEAD_GROUP_L2_BYTES, 1 << 40)

INT_MAX = (1 << 31) - 1
#: (num_m_blocks, num_bh, group) grids of close to 2^31 - 1 tiles (the most a 1-D grid has):
#: group 1 (head-major), num_bh and more (query-block major, one group), and in between.
EDGE_GRIDS = [
    (16384, 131071, 131071), (16384, 131071, 1 << 30), (16384, 131071, 1),
    (16384, 131071, 4096), (1, INT_MAX, INT_MAX), (1, INT_MAX, 1), (1, INT_MAX, 3),
    (INT_MAX, 1, 1), (INT_MAX, 1, 5), (65535, 32767, 7), (46340, 46341, 46341),
]  # fmt: skip


def _edge_tiles(num_m: int, num_bh: int, group: int) -> list[int]:
    """Tiles around every group boundary the decode has: the first, the last, and either
    side of the big / small group split."""
    total = num_m * num_bh
    assert total <= INT_MAX
    n = -(-num_bh // group)
    q, rem = divmod(num_bh, n)
    big = (q + 1) * rem * num_m
    ts = {0, 1, total - 2, total - 1, big - 1, big, big + 1, total // 2}
    return sorted(t for t in ts if 0 <= t < total)


def _cases():
    small = [
        (m, bh, g, t)
        for m in NUM_M
        for bh in NUM_BH
        for g in range(1, bh + 3)
        for t in range(m * bh)
    ]
    edge = [(m, bh, g, t) for m, bh, g in EDGE_GRIDS for t in _edge_tiles(m, bh, g)]
    groups = list(itertools.product(L2, SEQLENS, ROW_BYTES, Q_PER_KV, BH))
    return small + edge, groups


def _edge_ctas() -> list[tuple[int, int, int, int]]:
    """(num_bh, n, x, y): CTAs at the corners and middles of the edge grids'
    :func:`grouped_grid` grids (at most 2^31 - 1 CTAs along x, 65535 groups)."""
    out = []
    for m, bh, g in EDGE_GRIDS:
        gx, gy, _ = grouped_grid(m, bh, g)
        assert gx <= INT_MAX and gy <= 65535
        xs = {0, 1, gx // 2, gx - 2, gx - 1}
        ys = {0, 1, gy // 2, gy - 2, gy - 1}
        out += [
            (bh, gy, x, y) for x in sorted(xs) for y in sorted(ys) if 0 <= x < gx and 0 <= y < gy
        ]
    return out


_N_EDGE_CTAS = len(_edge_ctas())


def _grid_cases() -> list[tuple[int, int, int, int]]:
    """(num_bh, n, x, y): every CTA of the small grids, then :func:`_edge_ctas`."""
    out = []
    for m in NUM_M:
        for bh in NUM_BH:
            for g in range(1, bh + 3):
                gx, gy, _ = grouped_grid(m, bh, g)
                out += [(bh, gy, x, y) for y in range(gy) for x in range(gx)]
    return out + _edge_ctas()


PROGRAM = r"""
#include "tile_order_host.cuh"
#include <cstdio>

int main() {
    int m, bh, g, t;
    long long l2;
    int s, row, qpk, nbh;
    char kind;
    while (scanf(" %c", &kind) == 1) {
        if (kind == 't' && scanf("%d %d %d %d", &m, &bh, &g, &t) == 4) {
            const fg::TileCoord c = fg::tile_coord(t, m, bh, g);
            printf("%d %d\n", c.m_rev, c.bh);
        } else if (kind == 'c' && scanf("%d %d %d %d", &bh, &g, &m, &t) == 4) {
            const fg::TileCoord c = fg::grid_tile_coord(bh, g, m, t);
            printf("%d %d\n", c.m_rev, c.bh);
        } else if (kind == 'g' && scanf("%lld %d %d %d %d", &l2, &s, &row, &qpk, &nbh) == 5) {
            printf("%d\n", fg::head_group(l2, s, row, qpk, nbh));
        } else {
            return 2;
        }
    }
    return 0;
}
"""


def _build(tmp_path: Path, extra: list[str]) -> subprocess.CompletedProcess:
    text = HEADER.read_text()
    host = text.replace("__device__ __forceinline__", "__host__ __device__ __forceinline__")
    assert host.count("__host__ __device__") == 3  # tile_coord, grid_tile_coord, head_group
    (tmp_path / "tile_order_host.cuh").write_text(host)
    (tmp_path / "prog.cu").write_text(PROGRAM)
    cmd = [find_nvcc(), "-std=c++17", "-O1", "-x", "cu", "prog.cu", "-o", "prog", *extra]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)


def _run(exe: Path, tiles, groups, ctas=()) -> list[str]:
    stdin = "".join(f"t {m} {bh} {g} {t}\n" for m, bh, g, t in tiles)
    stdin += "".join(f"c {bh} {n} {x} {y}\n" for bh, n, x, y in ctas)
    stdin += "".join(f"g {l2} {s} {row} {q} {bh}\n" for l2, s, row, q, bh in groups)
    run = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.splitlines()


def _same_cta(line: str, case: tuple[int, int, int, int]) -> bool:
    """The header's (m_rev, bh) for CTA ``case`` = (num_bh, n, x, y) is the mirror's, bh -1
    where the mirror has a hole (None)."""
    num_bh, n, x, y = case
    m_rev, bh = map(int, line.split())
    want = grid_tile_coord(x, y, num_bh, n)
    return bh == -1 if want is None else (m_rev, bh) == want


def test_tile_order_matches_the_python_mirror(tmp_path, requires_nvcc):
    built = _build(tmp_path, [])
    assert built.returncode == 0, built.stdout + built.stderr
    tiles, groups = _cases()
    ctas = _grid_cases()
    out = _run(tmp_path / "prog", tiles, groups, ctas)
    assert len(out) == len(tiles) + len(ctas) + len(groups)
    bad = [
        (case, line)
        for case, line in zip(tiles, out[: len(tiles)], strict=True)
        if tuple(map(int, line.split())) != tile_coord(*case[3:], *case[:3])
    ]
    assert not bad, bad[:10]
    n_t = len(tiles)
    bad = [
        (case, line)
        for case, line in zip(ctas, out[n_t : n_t + len(ctas)], strict=True)
        if not _same_cta(line, case)
    ]
    assert not bad, bad[:10]
    bad = [
        (case, line)
        for case, line in zip(groups, out[n_t + len(ctas) :], strict=True)
        if int(line) != head_group(case[1], case[2], case[3], case[4], l2_bytes=case[0])
    ]
    assert not bad, bad[:10]


def test_tile_order_is_a_bijection_at_the_int32_edge(tmp_path, requires_nvcc):
    """At grids of nearly 2^31 - 1 tiles no intermediate of ``fg::tile_coord`` overflows
    int (UBSan traps on signed overflow), and the edge tiles decode in range, as the mirror
    does."""
    flags = ["-Xcompiler", "-fsanitize=signed-integer-overflow",
             "-Xcompiler", "-fno-sanitize-recover=all", "-lubsan"]  # fmt: skip
    built = _build(tmp_path, flags)
    if built.returncode:
        pytest.skip(f"no UBSan in the host toolchain: {built.stderr[-300:]}")
    tiles = [(m, bh, g, t) for m, bh, g in EDGE_GRIDS for t in _edge_tiles(m, bh, g)]
    ctas = _grid_cases()[-_N_EDGE_CTAS:]
    out = _run(tmp_path / "prog", tiles, [], ctas)
    for (m, bh, g, t), line in zip(tiles, out[: len(tiles)], strict=True):
        got = tuple(map(int, line.split()))
        assert got == tile_coord(t, m, bh, g), (m, bh, g, t, got)
        assert 0 <= got[0] < m and 0 <= got[1] < bh, (m, bh, g, t, got)
    for case, line in zip(ctas, out[len(tiles) :], strict=True):
        assert _same_cta(line, case), (case, line)
