"""The decode units (flashgen.families.decode): every shipped spec that supports decode
compiles for sm_80 and sm_90a with its two kernels (attn with the fused combine, append)
spill-free (two nvcc runs per spec and form, in parallel), and the split scheduler and LSE merge of
templates/common/decode.cuh (and the normalized merge of templates/common/exact_softmax.cuh,
``Options.exact_softmax``), run on the host, agree with the Python ones."""

from __future__ import annotations

import math
import os
import random
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from covering import pairwise, uncovered_pairs
from shipped_specs import DISTINCT

from flashgen.build import cache
from flashgen.build.render import render
from flashgen.families import decode as family
from flashgen.frontend.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
HEADER = ROOT / "templates" / "common" / "decode.cuh"
EXACT_HEADER = ROOT / "templates" / "common" / "exact_softmax.cuh"


def _specs(paths=None):
    out = []
    for path in sorted((ROOT / "specs").glob("*.yaml")) if paths is None else paths:
        spec = load_spec(path)
        if family.unsupported_reason(spec) is None:
            out.append(spec)
    return out


def _compile(job):
    spec, target, ragged = job
    plan = family.plan(spec, target, ragged=ragged)
    _, report = cache.get_or_build(render(plan), plan)
    return job, plan, report


def test_ragged_and_padded_units_differ_only_when_asked():
    for spec in _specs():
        padded = family.plan(spec, "sm_80")
        assert render(padded) == render(family.plan(spec, "sm_80", ragged=False))
        ragged = family.plan(spec, "sm_80", ragged=True)
        src = render(ragged)
        assert "cu_seqlens_q" in src and "cu_seqlens_q" not in render(padded)
        assert ragged.kernel_name != padded.kernel_name
        assert [a.name for a in ragged.args][-1] == "cu_seqlens_q"
        assert [a.name for a in ragged.kernel("append").args][-1] == "cu_seqlens_q"


def _covering() -> list:
    """(spec, target, ragged) of the nvcc test below: a pairwise covering (tests/covering.py)
    of the supporting shipped specs (one per kernel code) x {sm_80, sm_90} x {padded, ragged}:
    every spec builds both targets and both units, every (target, unit) is built by half
    the specs.  A decode unit renders the same CUDA for both targets but for the
    kernels' names and the launch bounds' CTAs per SM (more on sm_90: a tighter register
    cap); ptxas allocates per arch, so a spec's other (target, unit) pair is covered by the
    other specs, not proven for it (``pytest --full-product`` builds them all)."""
    specs = {s.name: s for s in _specs(DISTINCT)}
    rows = pairwise(sorted(specs), ("sm_80", "sm_90"), (False, True))
    return [(specs[n], t, r) for n, t, r in rows]


def test_the_covering_builds_every_spec_target_and_unit():
    jobs = [(s.name, t, r) for s, t, r in _covering()]
    specs = sorted({s.name for s in _specs(DISTINCT)})
    assert not uncovered_pairs(jobs, specs, ("sm_80", "sm_90"), (False, True))
    assert {"document_mask", "spec_tree"} <= set(specs)
    if len(jobs) < 4 * len(specs):  # (not under pytest --full-product)
        assert len(jobs) == 2 * len(specs)


@pytest.mark.parametrize("ragged", [False, True], ids=["padded", "ragged"])
def test_every_decode_unit_compiles_without_spills(ragged, requires_nvcc):
    """Both kernels (attn, append) of the padded or ragged-Sq_new units of :func:`_covering`
    (every supporting shipped spec, one per kernel code, for sm_80 or sm_90a; the other
    target in the other test), spill-free, in parallel; the masks that read tensors
    (document_mask, spec_tree) among them (tests/shipped_specs.py: llama3_gqa's units are
    causal_d128's)."""
    jobs = [job for job in _covering() if job[2] == ragged]
    workers = int(os.environ.get("FLASHGEN_TEST_JOBS", (os.cpu_count() or 1) + 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(_compile, jobs))
    problems = []
    for (spec, target, _), plan, report in results:
        names = {k.name for k in report.kernels}
        assert names == {plan.kernel("attn").kernel_name, plan.kernel("append").kernel_name}
        for k in report.kernels:
            assert 0 < k.registers <= 255
            if k.spill_bytes:
                problems.append(f"{spec.name} {target}: {k}")
    assert not problems, "decode kernels spill:\n" + "\n".join(problems)


PROGRAM = r"""
#include "HEADER"
#include "EXACT_HEADER"
#include <cstdio>
int main() {
    int lo, hi, n;
    while (scanf("%d %d %d", &lo, &hi, &n) == 3) {
        if (lo < 0) break;
        for (int s = 0; s < n; ++s) {
            fg::dec::Range r = fg::dec::split_range(lo, hi, n, s);
            printf("%d %d %d\n", r.begin, r.end, fg::dec::effective_splits(lo, hi, n));
        }
    }
    int m;
    while (scanf("%d", &m) == 1) {
        float lse[64];
        for (int i = 0; i < m; ++i) scanf("%f", &lse[i]);
        const float l = fg::dec::merged_lse(lse, m, 1);
        const fg::dec::Merged s = fg::dec::merge_stats(lse, m, 1);
        printf("%.9g", l);
        for (int i = 0; i < m; ++i) printf(" %.9g", fg::dec::merge_weight(lse[i], l));
        printf("\n%.9g", s.lse);
        for (int i = 0; i < m; ++i) printf(" %.9g", fg::dec::normalized_weight(lse[i], s));
        printf("\n");
    }
    return 0;
}
"""


#: lse of splits at huge logits (1.4177e11: an ulp of 2^14), where log(sum) is lost in lse's
#: rounding: the default merge weighs each of two equal splits exp(lse_i - lse) = 1, the
#: normalized merge (Options.exact_softmax) 1/2.
HUGE_LSES = [[1.4177e11, 1.4177e11], [1.4177e11, 1.4177e11, 1.4177e11 - 16384.0, -math.inf],
             [-1.4177e11, -1.4177e11, -1.4177e11], [3.0e10, 3.0e10, 3.0e10, 3.0e10, 3.0e10]]


def test_split_scheduler_and_merge_on_the_host(host_exe):
    src = PROGRAM.replace("EXACT_HEADER", str(EXACT_HEADER)).replace("HEADER", str(HEADER))
    exe = host_exe(src, "decode_host")
    rng = random.Random(0)
    ranges = [(0, 0, 1), (0, 1, 4), (3, 17, 5), (0, 1024, 128), (7, 8, 3)]
    ranges += [(a, a + rng.randrange(0, 300), rng.randrange(1, 129)) for a in range(20)]
    lses = [[0.0], [-math.inf, -math.inf], [1.0, -math.inf, 3.5], [80.0, 81.0, -20.0, 0.0],
            [math.nan, 2.0], [-math.inf, math.nan, -math.inf], [1.0, 2.0, math.nan]]
    lses += HUGE_LSES
    text = "".join(f"{a} {b} {n}\n" for a, b, n in ranges) + "-1 -1 -1\n"
    text += "".join(f"{len(x)} " + " ".join("-inf" if v == -math.inf else repr(v) for v in x) + "\n"
                    for x in lses)  # fmt: skip
    run = subprocess.run([str(exe)], input=text, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    i = 0
    for a, b, n in ranges:
        for s in range(n):
            got = tuple(map(int, lines[i].split()))
            assert got[:2] == family.split_range(a, b, n, s)
            assert got[2] == family.effective_splits(a, b, n)
            i += 1
    for x in lses:
        got = [float(v) for v in lines[i].split()]
        exact = [float(v) for v in lines[i + 1].split()]
        i += 2
        if any(math.isnan(v) for v in x):  # a NaN split poisons the merge (as one split)
            assert all(math.isnan(v) for v in got) and all(math.isnan(v) for v in exact)
            continue
        m = max(x)
        if m == -math.inf:
            for row in (got, exact):
                assert row[0] == -math.inf and all(w == 0 for w in row[1:])
            continue
        total = sum(math.exp(v - m) for v in x)
        lse = m + math.log(total)
        for row in (got, exact):
            assert row[0] == pytest.approx(lse, rel=1e-6, abs=1e-6)
        # normalized by the sum: at lse 1.4e11 (an ulp of 2^14) log(sum) is lost in lse's
        # rounding, and exp(v - lse) gave each of two equal splits 1
        for v, w in zip(x, exact[1:], strict=True):
            assert w == pytest.approx(math.exp(v - m) / total, rel=1e-5, abs=1e-7)
        assert sum(exact[1:]) == pytest.approx(1.0, rel=1e-5)
        if x in HUGE_LSES:  # the default merge's exp(v - lse) is exp(v - m) there, unnormalized
            continue
        for v, w in zip(x, got[1:], strict=True):
            assert w == pytest.approx(math.exp(v - lse), rel=1e-5, abs=1e-7)
        assert sum(got[1:]) == pytest.approx(1.0, rel=1e-5)
