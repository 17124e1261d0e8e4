"""``fg::exp2_poly`` (templates/common/mma_sm80.cuh), the FMA-pipe exp2 the Hopper kernel uses
for half the softmax of a score_mod that takes a MUFU op: checked on the host (nvcc, the very
header) against exp2 in double over the softmax's whole domain x <= 0."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

HEADER = Path(__file__).resolve().parents[2] / "templates" / "common" / "mma_sm80.cuh"

PROGRAM = r"""
#include "HEADER"
#include <cmath>
#include <cstdio>

int main() {
    int failures = 0;
    double worst = 0;
    float prev = 0.f;
    for (long i = -126L * 65536; i <= 0; ++i) {  // [-126, 0] in steps of 2^-16, ascending
        const float x = (float)i / 65536.f;
        const float y = fg::exp2_poly(x);
        const double rel = fabs((double)y / exp2((double)x) - 1.0);
        if (rel > worst) worst = rel;
        if (rel > 1.1e-4 || y < prev) {
            if (failures++ < 10)
                printf("x %.8g: %.9g vs %.9g (rel %.3g)\n", x, y, exp2((double)x), rel);
        }
        prev = y;
    }
    const float edge[] = {-126.5f, -126.9f, -127.f, -150.f, -1e30f, -INFINITY};
    for (float x : edge) {  // below the normal range: tiny, finite, >= 0
        const float y = fg::exp2_poly(x);
        if (!(y >= 0.f && y < 1e-37f)) { printf("x %g: %g\n", x, y); ++failures; }
    }
    if (fg::exp2_poly(0.f) != 1.f || fg::exp2_poly(-1.f) != 0.5f
        || fg::exp2_poly(-20.f) != 0x1p-20f) {
        printf("integers not exact\n");
        ++failures;
    }
    printf("worst %.3g\n", worst);
    printf(failures ? "FAILED %d\n" : "OK\n", failures);
    return failures != 0;
}
"""


def test_exp2_poly_matches_exp2(requires_nvcc, tmp_path):
    from flashgen.compile import find_nvcc

    src = tmp_path / "e.cu"
    src.write_text(PROGRAM.replace("HEADER", str(HEADER)))
    exe = tmp_path / "e"
    build = subprocess.run(
        [find_nvcc(), "-std=c++17", "-O2", "-o", str(exe), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if build.returncode:
        pytest.fail(f"nvcc failed:\n{build.stdout}{build.stderr}")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stdout[-3000:]
