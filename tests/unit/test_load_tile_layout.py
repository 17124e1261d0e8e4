"""The FA2-class forward's ``load_tile`` (templates/sm_80/fwd.cu.j2), run on the host: the
function's rendered text, cut out of a rendered kernel, compiled with g++ against recording
stand-ins for ``fg::cp_async_16`` and ``threadIdx`` and the very ``fg::swz`` of
templates/common/mma_sm80.cuh.

For every load layout (``fwd_row_chunks`` on and off, ``fwd_even_loads`` on and off, the
pointer chain and per-row offsets), every tile shape (ROWS x COLS) and block size THREADS
below, and several ``valid_rows`` (whole tiles, ragged last tiles, one row, none), the
threads' copies must
* write each 16-byte chunk of the swizzled tile exactly once, at
  ``dst + fg::swz(row, chunk, COLS * 2)`` (no other shared address; 16-bit elements, the
  template's ``ELEM_BYTES``, defined here as there),
* read that chunk from ``src + row * stride + chunk * 8`` when ``row < valid_rows``, and
  zero-fill it (``valid`` false, source address ``src``: the tile's first row, in bounds
  whenever ``valid_rows >= 1``, which every caller guarantees) otherwise.
Where the ``fwd_row_chunks`` guard admits the shape, thread t's first copy must be FA2's
(row t / 8, chunk t % 8), so the new layout is the one checked there.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import replace
from pathlib import Path

from plan_helpers import plan_forward

from flashgen.build.render import render
from flashgen.frontend.spec import loads_spec

HEADER = Path(__file__).resolve().parents[2] / "templates" / "common" / "mma_sm80.cuh"

THREADS = (32, 64, 128, 192, 256, 512)
ROWS = (16, 32, 48, 64, 96, 128, 192, 256)
COLS = (32, 64, 96, 128, 192, 256, 320, 512)

SPEC = "name: lt\nhead_dim: 128\ndtype: bf16\nmask: causal\n"

LAYOUTS = {  # name: (fwd_row_chunks, fwd_even_loads, load_chain)
    "rows": (True, False, False),
    "rows_even": (True, True, False),
    "chain": (False, False, True),
    "chain_even": (False, True, True),
    "offsets": (False, False, False),
}


def admitted(threads: int, rows: int, cols: int) -> bool:
    """The ``fwd_row_chunks`` guard of ``load_tile``."""
    return (cols // 8) % 8 == 0 and (threads // 8) % 8 == 0 and rows % (threads // 8) == 0


def _load_tile_text(row_chunks: bool, even: bool, chain: bool) -> str:
    plan = plan_forward(loads_spec(SPEC, path="<lt>"), "sm_80", family="fa2")
    ctx = replace(plan.context, fwd_row_chunks=row_chunks, fwd_even_loads=even, load_chain=chain)
    src = render(replace(plan, context=ctx))
    start = src.index("template <int ROWS, int COLS>\n__device__ __forceinline__ void load_tile")
    depth, i = 0, src.index("{", start)
    while True:
        depth += {"{": 1, "}": -1}.get(src[i], 0)
        if depth == 0:
            return src[start : i + 1]
        i += 1


def _swz_text() -> str:
    pattern = r"__host__ __device__ __forceinline__ uint32_t swz\(.*?\n}\n"
    m = re.search(pattern, HEADER.read_text(), re.S)
    assert m, "fg::swz not found in mma_sm80.cuh"
    return m.group(0).replace("__host__ __device__ __forceinline__", "inline")


PRELUDE = r"""
#include <cstdint>
#include <cstdio>
#include <vector>
#define __device__
#define __forceinline__ inline
struct { unsigned x; } threadIdx;
using elem_t = uint16_t;
constexpr int ELEM_BYTES = sizeof(elem_t);  // as the template defines them
constexpr int CHUNK_ELEMS = 16 / ELEM_BYTES;
namespace fg {
SWZ
struct Copy { uint32_t dst; const void* src; bool valid; unsigned thread; };
std::vector<Copy> copies;
inline void cp_async_16(uint32_t dst, const void* src, bool valid) {
    copies.push_back({dst, src, valid, threadIdx.x});
}
}  // namespace fg
static elem_t gmem[300 * 520 + 64];

template <class F>
int check(F load, const char* layout, int threads, int rows, int cols, bool row_chunks) {
    const int cpr = cols / 8, stride = cols + 8;  // a row stride other than the row's width
    const uint32_t dst = 1u << 20;
    const elem_t* src = gmem + 32;
    const int valids[] = {rows, rows + 7, rows - 1, rows / 2 + 3, 1, 0};
    int failures = 0;
    for (int valid_rows : valids) {
        fg::copies.clear();
        for (int t = 0; t < threads; ++t) { threadIdx.x = t; load(dst, src, stride, valid_rows); }
        std::vector<int> seen(rows * cpr, 0);
        std::vector<int> first(threads, -1);
        for (const auto& c : fg::copies) {
            const uint32_t off = c.dst - dst;
            const int row = off / (cols * 2);
            int chunk = -1;
            for (int k = 0; k < cpr; ++k)
                if (c.dst >= dst && row < rows && fg::swz(row, k, cols * 2) == off) chunk = k;
            if (chunk < 0) {
                printf("%s T%d %dx%d v%d: thread %u wrote outside the tile (offset %u)\n",
                       layout, threads, rows, cols, valid_rows, c.thread, off);
                ++failures;
                continue;
            }
            if (first[c.thread] < 0) first[c.thread] = row * cpr + chunk;
            ++seen[row * cpr + chunk];
            const bool in = row < valid_rows;
            const elem_t* want = in ? src + (int64_t)row * stride + chunk * 8 : src;
            if (c.valid != in || c.src != want) {
                printf("%s T%d %dx%d v%d: row %d chunk %d valid %d src %+ld (want %d %+ld)\n",
                       layout, threads, rows, cols, valid_rows, row, chunk, c.valid,
                       (long)((const elem_t*)c.src - src), in, (long)(want - src));
                ++failures;
            }
        }
        for (int i = 0; i < rows * cpr; ++i)
            if (seen[i] != 1) {
                printf("%s T%d %dx%d v%d: row %d chunk %d written %d times\n", layout, threads,
                       rows, cols, valid_rows, i / cpr, i % cpr, seen[i]);
                ++failures;
            }
        if (row_chunks)
            for (int t = 0; t < threads && t < rows * cpr; ++t)
                if (first[t] != (t / 8) * cpr + t % 8) {
                    printf("%s T%d %dx%d: thread %d starts at row %d chunk %d, not (%d, %d)\n",
                           layout, threads, rows, cols, t, first[t] / cpr, first[t] % cpr, t / 8,
                           t % 8);
                    ++failures;
                }
        if (failures > 20) return failures;
    }
    return failures;
}
"""


def _program() -> str:
    parts = [PRELUDE.replace("SWZ", _swz_text())]
    for name, flags in LAYOUTS.items():
        text = _load_tile_text(*flags)
        for t in THREADS:
            parts.append(f"namespace {name}_{t} {{ constexpr int THREADS = {t};\n{text}\n}}")
    parts.append("int main() {\n    int failures = 0;")
    for name, flags in LAYOUTS.items():
        for t in THREADS:
            for r in ROWS:
                for c in COLS:
                    if t * 8 > r * c:  # more threads than chunks: no kernel has such a tile
                        continue
                    new = flags[0] and admitted(t, r, c)
                    parts.append(
                        f'    failures += check({name}_{t}::load_tile<{r}, {c}>, "{name}", '
                        f"{t}, {r}, {c}, {str(new).lower()});"
                    )
    parts.append('    printf(failures ? "FAILED %d\\n" : "OK\\n", failures);')
    parts.append("    return failures != 0;\n}")
    return "\n".join(parts)


def test_guard_admits_the_h200_d256_tiles():
    assert admitted(128, 64, 256) and admitted(256, 128, 256) and admitted(128, 64, 64)
    assert admitted(128, 48, 256) and not admitted(256, 48, 256)
    assert not admitted(128, 64, 96) and not admitted(32, 64, 256)


def test_rendered_layouts_differ():
    texts = {name: _load_tile_text(*flags) for name, flags in LAYOUTS.items()}
    assert "FA2's copy layout" in texts["rows"] and "FA2's copy layout" not in texts["chain"]
    assert len(set(texts.values())) == len(texts)


def test_load_tile_writes_every_chunk_once_from_its_row(cxx_exe):
    # -O0: integer bookkeeping only, and g++ takes 12 CPU-seconds on it at -O1, 3 at -O0
    # (which runs it in 5 instead of 1.4)
    exe = cxx_exe(_program(), "load_tile", "-O0")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stdout[-4000:]
