"""The CUDA tile classifier (``flashgen.analysis.masktiles``) against the host analysis and brute
force.

The emitted classifiers are ``__host__ __device__``: the test compiles them for the host
with nvcc (no GPU needed), runs them on many tiles and block ranges, and requires the
same class as :func:`flashgen.analysis.maskinfo.classify` on every one (which is itself checked
against brute force in ``test_maskinfo.py``), for every shipped mask, the gallery masks
and random well-typed masks.  The block searches (``fg::iv::next_live`` /
``prev_live``) run on the host too, against a linear scan of the brute-force classes.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402
from dsl_strategies import expr, may_be_true, spec_text  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402

from flashgen.analysis import masktiles  # noqa: E402
from flashgen.analysis.maskinfo import classify, tile_classes  # noqa: E402
from flashgen.build.render import template_root  # noqa: E402
from flashgen.frontend.spec import load_spec, loads_spec  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "specs").glob("*.yaml"))
GALLERY = {
    "window": (
        "causal && q_idx + seqlen_k - seqlen_q - kv_idx < w",
        "  w: {type: i32, default: 9}\n",
    ),
    "prefix_lm": ("kv_idx < w || causal", "  w: {type: i32, default: 11}\n"),
    "chunked": ("q_idx / w == kv_idx / w", "  w: {type: i32, default: 8}\n"),
    "doc": ("causal && ids[q_idx] == ids[kv_idx]", "  ids: {type: i32, shape: [seqlen_q]}\n"),
    "float": ("abs(q_idx - kv_idx) * 0.5 <= c", "  c: {type: f32, default: 6.5}\n"),
    "overflow": ("q_idx * big >= kv_idx * big", "  big: {type: i32, default: 100000000}\n"),
    # per-KV-head masks (GQA): h_kv is exact per tile, like h
    "kv_head_window": ("causal && q_idx - kv_idx < w + 8 * h_kv", "  w: {type: i32, default: 9}\n"),
    "kv_head_mix": ("h_kv == 0 || (h - h_kv) % 2 == 0 && kv_idx <= q_idx", ""),
}  # fmt: skip
# Small values so the small test grids show every class.
SMALL_PARAMS = {"window": 13, "prefix": 11, "chunk": 7, "w": 9, "c": 6.5, "softcap": 50.0}


def _gallery(name: str):
    mask, params = GALLERY[name]
    text = f"name: {name}\nhead_dim: 64\ndtype: bf16\nmask: '{mask}'\n"
    text += f"params:\n{params}" if params else ""
    return loads_spec(text, "g.yaml")


def _random_specs(n: int, wild: bool) -> list:
    masks: list[str] = []

    @settings(
        max_examples=n, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(expr("bool", 3, False, wild).filter(may_be_true))
    def collect(m):
        masks.append(m)

    collect()
    return [loads_spec(spec_text(m, None), f"fuzz{i}.yaml") for i, m in enumerate(masks)]


def _program(specs, cases, causal_bits: bool = False, integer: bool = False) -> str:
    """A host program: one classifier per spec, then the cases (one line each) classified."""
    root = template_root()
    parts = [(root / "common" / f).read_text()
             for f in ("masktiles.cuh", "masktiles_intrules.cuh", "masktiles_int.cuh")]
    parts.append("#include <cstdio>")
    for i, spec in enumerate(specs):
        parts.append(
            masktiles.classifier_source(
                spec, name=f"cls{i}", causal_bits=causal_bits, integer=integer
            )
        )
    parts.append("int main() {\n    int i, q0, q1, k0, k1, b, h, hkv, sq, sk; double p[4];")
    parts.append(
        '    while (scanf("%d %d %d %d %d %d %d %d %d %d %lf %lf %lf %lf", &i, &q0, &q1, &k0, &k1,'
        " &b, &h, &hkv, &sq, &sk, p, p + 1, p + 2, p + 3) == 14) {\n        int c = -1;\n"
        "        switch (i) {"
    )
    for i, spec in enumerate(specs):
        ps = [f"({t})p[{j}]" for j, (t, _) in enumerate(masktiles.classifier_params(spec)[9:])]
        args = ", ".join(["q0", "q1", "k0", "k1", "b", "h", "hkv", "sq", "sk", *ps])
        parts.append(f"        case {i}: c = cls{i}({args}); break;")
    parts.append('        }\n        printf("%d\\n", c);\n    }\n    return 0;\n}\n')
    return "\n".join(parts)


def _run_host(host_exe, specs, cases, causal_bits: bool = False, integer=False) -> list[int]:
    exe = host_exe(_program(specs, cases, causal_bits, integer), f"cls{int(integer)}")
    stdin = "".join(" ".join(str(x) for x in c) + "\n" for c in cases)
    out = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True)
    return [int(x) for x in out.stdout.split()]


def _param_values(spec) -> dict:
    return {p.name: SMALL_PARAMS.get(p.name, p.default) for p in spec.scalar_params}


def _cases(i, spec, rng, n=150):
    """(case line, expected class) pairs: whole-grid tiles and random multi-block ranges."""
    params = _param_values(spec)
    pv = [params[p.name] for p in spec.scalar_params] + [0] * (4 - len(params))
    out = []
    for _ in range(n):
        sq, sk = rng.randint(1, 90), rng.randint(1, 90)
        q0 = rng.randrange(sq)
        q1 = rng.randrange(q0, min(sq, q0 + rng.choice([1, 4, 16, 64])))
        k0 = rng.randrange(sk)
        k1 = rng.randrange(k0, min(sk, k0 + rng.choice([1, 4, 16, 64])))
        b, h = rng.randrange(3), rng.randrange(4)
        h_kv = h // rng.choice([1, 2, 4])  # GQA groups of 1, 2, 4 query heads
        want = classify(
            spec, (q0, q1), (k0, k1), b=b, h=h, h_kv=h_kv, seqlen_q=sq, seqlen_k=sk, params=params
        )
        out.append(((i, q0, q1, k0, k1, b, h, h_kv, sq, sk, *pv), int(want)))
    return out


@pytest.mark.parametrize("integer", [False, True], ids=["double", "integer"])
def test_classifier_matches_maskinfo_on_host(host_exe, integer):
    """Also on 64-bit integer ranges (``integer``: fg::ivi, masktiles_int.cuh) for the masks
    that compute only int32 numbers (integer_only; the others keep the double ones)."""
    specs = [load_spec(p) for p in SHIPPED] + [_gallery(n) for n in sorted(GALLERY)]
    specs += _random_specs(60, wild=False) + _random_specs(40, wild=True)
    if integer:
        assert sum(map(masktiles.integer_only, specs)) >= 60  # most of them: the test bites
        src = masktiles.classifier_source(_gallery("window"), integer=True)
        assert "fg::ivi::range((long long)q0" in src and "fg::iv::R" not in src
    rng = random.Random(0)
    cases = [c for i, s in enumerate(specs) for c in _cases(i, s, rng)]
    got = _run_host(host_exe, specs, [c for c, _ in cases], integer=integer)
    assert len(got) == len(cases)
    bad = [(specs[c[0]].mask, c, w, g) for (c, w), g in zip(cases, got, strict=True) if w != g]
    assert not bad, f"{len(bad)} disagreements, first: {bad[:3]}"


#: int32 wrap-around of abs and / (tests/unit/test_maskinfo.py, WRAP_MASKS): abs(INT_MIN) and
#: INT_MIN / -1 are INT_MIN in the kernels, where both classifiers had 2^31.  (mask, p, r,
#: brute-force class of q 0..1 x kv 0..1; the class each classifier gave)
_WRAPS = [
    ("abs(p) >= 0", -(2**31), 1, 0, 2),
    ("abs(q_idx + p) > 0", -(2**31), 1, 1, 2),
    ("p / r < 0", -(2**31), -1, 2, 0),
    ("(kv_idx + p) / -1 < 0", -(2**31), 1, 1, 0),
]


@pytest.mark.parametrize("integer", [False, True], ids=["double", "integer"])
def test_classifier_wraps_abs_and_division(host_exe, integer):
    head = "name: w\nhead_dim: 64\ndtype: bf16\nmask: '{}'\nparams:\n"
    head += "  p: {{type: i32, default: 0}}\n  r: {{type: i32, default: 1}}\n"
    specs = [loads_spec(head.format(m), "w.yaml") for m, *_ in _WRAPS]
    cases = [(i, 0, 1, 0, 1, 0, 0, 0, 8, 8, p, r, 0, 0) for i, (_, p, r, *_) in enumerate(_WRAPS)]
    got = _run_host(host_exe, specs, cases, integer=integer)
    for (mask, p, r, truth, before), g, spec in zip(_WRAPS, got, specs, strict=True):
        kw = {"b": 0, "h": 0, "seqlen_q": 8, "seqlen_k": 8, "params": {"p": p, "r": r}}
        want = classify(spec, (0, 1), (0, 1), **kw)
        assert g == int(want) == 1 != before and truth != before, mask


#: Int masks at the edges of int32 (params INT_MIN .. INT_MAX, tiles at 0 and near 2^31 - 1):
#: products, quotients and remainders that overflow or divide by negative params, abs / min /
#: max / unary - of large values, causal at lengths near 2^31.
_INT32_MASKS = [
    "q_idx * p >= kv_idx * p",
    "(q_idx + p) / r <= kv_idx / r",
    "(kv_idx - p) % r < q_idx % r + 1",
    "abs(q_idx - p) < abs(kv_idx + r)",
    "min(q_idx * r, p) <= max(-kv_idx, p - r)",
    "-(q_idx + p) > kv_idx - r || causal",
    "(q_idx < p ? q_idx * 2 : kv_idx + r) > p / 2 == (kv_idx >= r)",
    "causal && q_idx + seqlen_k - seqlen_q - kv_idx < p",
]
_INT32_VALUES = [-(2**31), -(2**30), -1, 0, 1, 46341, 2**31 - 1]


def test_integer_and_double_classifiers_agree_soundly_at_int32_edges(host_exe):
    """integer=True (fg::ivi) gives the double rules' class on every tile, and both are sound
    against brute force with the kernels' int32 wrap-around (the reference evaluator)."""
    torch = pytest.importorskip("torch")
    from flashgen.ops.cpu.reference import eval_expr

    head = "name: e\nhead_dim: 64\ndtype: bf16\nmask: '{}'\nparams:\n"
    head += "  p: {{type: i32, default: 0}}\n  r: {{type: i32, default: 1}}\n"
    specs = [loads_spec(head.format(m), "e.yaml") for m in _INT32_MASKS]
    assert all(map(masktiles.integer_only, specs))
    big = 2**31 - 1
    tiles = [(0, 3, 0, 2, 9, 7), (5, 5, 0, 6, 9, 7), (big - 4, big - 1, big - 3, big - 1, big, big)]
    tiles += [(big - 3, big - 1, 2, 5, big, 6), (0, 2, big - 5, big - 2, 3, big - 1)]
    cases = [
        (i, q0, q1, k0, k1, 1, 2, 1, sq, sk, p, r, 0, 0)
        for i in range(len(specs))
        for q0, q1, k0, k1, sq, sk in tiles
        for p in _INT32_VALUES
        for r in _INT32_VALUES
    ]
    dbl = _run_host(host_exe, specs, cases)
    assert _run_host(host_exe, specs, cases, integer=True) == dbl
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    bad = []
    for c, got in zip(cases, dbl, strict=True):
        i, q0, q1, k0, k1, b, h, h_kv, sq, sk, p, r = c[:12]
        env = {"b": i64(b), "h": i64(h), "h_kv": i64(h_kv), "seqlen_q": i64(sq)}
        env |= {"seqlen_k": i64(sk), "p": i64(p), "r": i64(r), "__float__": torch.float64}
        env |= {"q_idx": torch.arange(q0, q1 + 1).view(-1, 1), "kv_idx": torch.arange(k0, k1 + 1)}
        keep = eval_expr(specs[i].mask, env | {"__device__": torch.device("cpu")})
        if (got == 0 and keep.any()) or (got == 2 and not keep.all()):
            bad.append((_INT32_MASKS[i], c[1:12], got))
    assert not bad, f"{len(bad)} unsound classes, first: {bad[:3]}"
    assert {0, 1, 2} <= set(dbl)  # the test bites: every class occurs


def test_no_mask_is_full_and_ignores_its_arguments():
    spec = load_spec(REPO / "specs" / "bidir_d256.yaml")
    src = masktiles.classifier_source(spec)
    assert "return fg::iv::FULL;" in src and "fg::iv::range" not in src


def test_call_uses_the_kernel_names():
    spec = load_spec(REPO / "specs" / "mistral_swa.yaml")
    call = masktiles.classifier_call(spec, "m0", "m1", "n0", "n1")
    assert call == "fg_tile_class(m0, m1, n0, n1, b, h, h_kv, seqlen_q, seqlen_k, p_window)"


def test_tensor_reads_are_unknown_unless_hooked():
    spec = _gallery("doc")
    assert "fg::iv::any()" in masktiles.classifier_source(spec)
    hooked = masktiles.classifier_source(spec, index_range=lambda e: f"table_range_{e.name}()")
    assert "table_range_ids()" in hooked and "fg::iv::any()" not in hooked


SEARCH_MAIN = r"""
#include <cstdio>
#include <climits>
int main() {
    int which, n; static char row[1 << 16];
    while (scanf("%d %d %65535s", &which, &n, row) == 3) {
        // tile(i0, i1): a range's class from the per-block classes in `row` (E, P, F)
        int calls = 0;
        auto tile = [&](int i0, int i1) {
            ++calls;
            bool any_live = false, all_full = true;
            for (int i = i0; i <= i1; ++i) {
                any_live |= row[i] != 'E';
                all_full &= row[i] == 'F';
            }
            return !any_live ? fg::iv::EMPTY : (all_full ? fg::iv::FULL : fg::iv::PARTIAL);
        };
        // one whole walk as in the kernels: first to last (next_live), last to first (prev_live)
        int cls = -1, full = which ? -1 : INT_MAX;
        if (which) {
            for (int j = fg::iv::next_live(0, n, cls, full, tile); j < n;
                 j = fg::iv::next_live(j + 1, n, cls, full, tile))
                printf("%d:%d ", j, cls);
        } else {
            for (int j = fg::iv::prev_live(n - 1, cls, full, tile); j >= 0;
                 j = fg::iv::prev_live(j - 1, cls, full, tile))
                printf("%d:%d ", j, cls);
        }
        printf("| %d\n", calls);
    }
    return 0;
}
"""


def _walks(host_exe, rows: list[str]) -> list[tuple[list[str], list[str], int, int]]:
    """Per row: (forward walk, backward walk, and their classification counts)."""
    exe = host_exe(
        (template_root() / "common" / "masktiles.cuh").read_text() + SEARCH_MAIN, "search"
    )
    lines = [f"{w} {len(r)} {r}" for r in rows for w in (1, 0)]
    out = subprocess.run(
        [str(exe)], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True
    ).stdout.splitlines()
    res = []
    for i in range(len(rows)):
        (fw, fc), (bw, bc) = (out[2 * i + k].split("|") for k in (0, 1))
        res.append((fw.split(), bw.split(), int(fc), int(bc)))
    return res


def test_block_searches_walk_exactly_the_live_blocks(host_exe):
    """Whole next_live / prev_live walks visit exactly the non-empty blocks, in order, each
    with its class (FULL runs are taken from one range check, so this checks that too)."""
    rng = random.Random(1)
    rows = []
    # rows of real masks (window, chunked, prefix), then random class strings
    for name in ("window", "chunked", "prefix_lm"):
        for row in tile_classes(_gallery(name), 90, 200, 8, 4, params={"w": 9}):
            rows.append("".join("EPF"[c] for c in row))
    for _ in range(300):
        n = rng.randint(1, 70)
        dens, full = rng.random(), rng.random()
        rows.append(
            "".join(
                ("F" if rng.random() < full else "P") if rng.random() < dens else "E"
                for _ in range(n)
            )
        )
    for row, (fw, bw, _, _) in zip(rows, _walks(host_exe, rows), strict=True):
        want = [f"{i}:{'EPF'.index(c)}" for i, c in enumerate(row) if c != "E"]
        assert fw == want, f"next_live walk of {row}"
        assert bw == want[::-1], f"prev_live walk of {row}"


def test_block_searches_cost_log_n_on_runs(host_exe):
    """A dense causal row (501 live blocks), a window (122) and an empty row (0) take
    O(log^2 n) range checks: 23, 46 and 10 here."""
    n = 512
    rows = ["F" * 500 + "P" + "E" * 11, "E" * 300 + "P" + "F" * 120 + "P" + "E" * 90, "E" * n]
    for row, (fw, bw, fc, bc) in zip(rows, _walks(host_exe, rows), strict=True):
        assert len(fw) == len(bw) == n - row.count("E")
        assert fc <= 50 and bc <= 50, f"{fc} / {bc} checks for {len(fw)} live blocks"


def _scoring_branches(src: str, open_marker: str) -> tuple[str, str]:
    """(masked, unmasked) scoring loops of a kernel: the text of ``if (<open_marker>...) {``
    up to ``} else {``, and from there to the closing brace at the same indentation."""
    start = src.index(open_marker)
    line_start = src.rindex("\n", 0, start) + 1
    indent = src[line_start:start]
    els = src.index(f"\n{indent}}} else {{", start)
    end = src.index(f"\n{indent}}}\n", els + 1)
    return src[start:els], src[els:end]


def test_kernels_skip_empty_tiles_and_leave_full_ones_unmasked():
    """The rendered kernels search live blocks with the spec's classifier and have a scoring
    path with no mask; causal has no separate skipping left (kv_end, m_first)."""
    from plan_helpers import plan_backward, plan_forward

    from flashgen.build.render import render

    spec = load_spec(REPO / "specs" / "mistral_swa.yaml")
    window = "p_window"
    fwd = render(plan_forward(spec, "sm_80"))
    assert fwd.count(f"int {masktiles.FUNCTION}(") == 1
    assert "fg::iv::prev_live(" in fwd and "kv_end" not in fwd
    masked, unmasked = _scoring_branches(fwd, "if (cls != fg::iv::FULL || n0 + BLOCK_N > seqlen_k)")
    assert window in masked and "keep" in masked
    assert window not in unmasked and "keep" not in unmasked and "-INFINITY" not in unmasked

    bwd = render(plan_backward(spec, "sm_80").unit)
    assert bwd.count("fg::iv::next_live(") == 3 and "m_first" not in bwd and "kv_end" not in bwd
    for marker in ("n0 + KV_N > seqlen_k) {", "n0 + DQ_N > seqlen_k) {"):
        masked, unmasked = _scoring_branches(bwd, "if (cls != fg::iv::FULL || " + marker)
        assert window in masked
        assert window not in unmasked and "constexpr bool keep = true;" in unmasked

    atomic = render(plan_backward(spec, "sm_80", atomic_dq=True).unit)
    assert "m_first" in atomic and "fg::iv::prev_live(" in atomic  # the hull of live blocks


def test_classifier_widens_float_math_like_maskinfo(host_exe):
    """The kernels' classifier rounds a mask's float results outward as maskinfo does
    (fg::iv::fl / fl_int): both sound for float32 evaluation, and equal to each other."""
    masks = [  # test_maskinfo.FLOAT_MASKS
        "kv_idx * 1.1 + 0.6 <= q_idx",
        "kv_idx <= q_idx / 0.3 - 1.0",
        "q_idx * 0.1 - kv_idx * 0.1 >= 1.0 || kv_idx * 0.7 == 2.1",
        "(q_idx - kv_idx) * 0.35 < 3.3 && kv_idx * 2.9 <= q_idx * 3.3",
        "exp((kv_idx - q_idx) * 0.05) * 3.3 >= 1.0",
        "tanh((q_idx - kv_idx) * 0.01) > 0.05",
    ]
    specs = [
        loads_spec(f"name: fm{i}\nhead_dim: 64\ndtype: bf16\nmask: '{m}'\n")
        for i, m in enumerate(masks)
    ]
    rng = random.Random(5)
    cases = [c for i, s in enumerate(specs) for c in _cases(i, s, rng, n=300)]
    # the tile around (q 335, kv 304), which the classifier called EMPTY: PARTIAL now
    cases += [((0, 320, 335, 304, 319, 0, 0, 0, 999, 999, 0, 0, 0, 0), 1)]
    got = _run_host(host_exe, specs, [c for c, _ in cases])
    assert [w for _, w in cases] == got


def _point(spec, q, k, case) -> bool | None:
    """The mask at one pair (maskinfo on a one-pair tile: exact for integer masks), None where
    the analysis cannot tell (float rounding)."""
    _, _, _, _, _, b, h, h_kv, sq, sk, *_ = case
    c = classify(
        spec, (q, q), (k, k), b=b, h=h, h_kv=h_kv, seqlen_q=sq, seqlen_k=sk,
        params=_param_values(spec),
    )  # fmt: skip
    return None if c == 1 else c == 2


def test_causal_bits_are_sound_and_keep_the_class(host_exe):
    """causal_bits (the Hopper forward's classifier): the class without its flags is the plain
    one; CAUSAL_ONLY only where the mask equals causal on every pair of the tile, NO_CAUSAL only
    where causal holds on every pair; and both are found on the gallery masks' diagonal / edge
    tiles (chunked_local at chunk >= the tile: CAUSAL_ONLY on the diagonal)."""
    names = ("window", "prefix_lm", "chunked", "kv_head_window", "kv_head_mix", "doc")
    specs = [load_spec(p) for p in SHIPPED] + [_gallery(n) for n in names]
    specs += [
        loads_spec(f"name: c{i}\nhead_dim: 64\ndtype: bf16\nmask: '{m}'\n")
        for i, m in enumerate(
            [
                "causal && q_idx / 64 == kv_idx / 64",
                "!causal || kv_idx % 3 == 0",
                "(causal || kv_idx < 5) && q_idx - kv_idx < 20",
                "causal == (kv_idx % 2 == 0)",
            ]
        )
    ]
    specs += [s for s in _random_specs(40, wild=False) if masktiles.has_causal_bits(s)]
    rng = random.Random(7)
    cases = [c for i, s in enumerate(specs) for c in _cases(i, s, rng, n=120)]
    plain = _run_host(host_exe, specs, [c for c, _ in cases])
    got = _run_host(host_exe, specs, [c for c, _ in cases], causal_bits=True)
    seen = {4: 0, 8: 0}
    for (case, want), p, g in zip(cases, plain, got, strict=True):
        spec = specs[case[0]]
        assert g & 3 == p == want, (spec.mask, case, g, p, want)
        if g & 12 == 0:
            continue
        assert g & 3 == 1 and g & 12 != 12 and masktiles.has_causal_bits(spec), (spec.mask, g)
        _, q0, q1, k0, k1, _, _, _, sq, sk, *_ = case
        for q in range(q0, q1 + 1):
            for k in range(k0, k1 + 1):
                causal = k <= q + sk - sq
                if g & 8:
                    assert causal, (spec.mask, case, q, k)
                else:
                    m = _point(spec, q, k, case)
                    assert m is None or m == causal, (spec.mask, case, q, k)
        seen[g & 12] += 1
    assert seen[4] and seen[8], seen
    # causal && q / 64 == kv / 64 at 256 x 256
    c0 = next(j for j, s in enumerate(specs) if s.name == "c0")
    probe = [
        (c0, 16, 31, 16, 31, 0, 0, 0, 256, 256, 0, 0, 0, 0),  # diagonal, one chunk: CAUSAL_ONLY
        (c0, 32, 47, 0, 15, 0, 0, 0, 256, 256, 0, 0, 0, 0),  # below it, one chunk: FULL
        (c0, 64, 79, 48, 63, 0, 0, 0, 256, 256, 0, 0, 0, 0),  # below it, other chunk: EMPTY
        (c0, 70, 79, 60, 69, 0, 0, 0, 256, 256, 0, 0, 0, 0),  # below it, two chunks: NO_CAUSAL
    ]
    assert _run_host(host_exe, specs, probe, causal_bits=True) == [1 | 4, 2, 0, 1 | 8]


# Hand-made masks for the kernel-semantics brute force below: causal under ||, !, ==, ?:,
# negative offsets, a divisor that may be 0 (min 0), seqlen_k - seqlen_q < 0 on the grids.
_W9, _W12 = "  w: {type: i32, default: 9}\n", "  w: {type: i32, default: 12, min: 0}\n"
_EDGE_MASKS = [
    ("causal && q_idx / c == kv_idx / c", "  c: {type: i32, default: 0, min: 0}\n"),
    ("causal && (q_idx - 5) / 4 == kv_idx / 4", ""),
    ("causal || kv_idx < q_idx - 20", ""),
    ("!causal", ""),
    ("!causal || kv_idx % 3 == 0", ""),
    ("causal != (kv_idx > 3)", ""),
    ("causal ? kv_idx % 2 == 0 : kv_idx < 3", ""),
    ("(kv_idx > q_idx - 9 ? causal : kv_idx < 2) && q_idx != 7", ""),
    ("causal && (causal || kv_idx == 0) && q_idx + seqlen_k - seqlen_q - kv_idx < w", _W9),
    ("causal && kv_idx + seqlen_q - seqlen_k > q_idx - w", _W12),
    ("(causal && kv_idx >= 4) || (kv_idx < 4 && q_idx >= 0)", ""),
    ("causal && kv_idx - seqlen_k + seqlen_q >= 0", ""),
    ("causal == (q_idx % 5 < 2)", ""),
]  # fmt: skip


def test_causal_bits_match_the_kernels_masked_loops_by_brute_force(host_exe):
    """Every tile of small grids (seqlen_k < seqlen_q and >, 16 x 16 and 16 x 8 tiles clamped
    like the Hopper forward's ``kv_class``): what the kernel keeps per class (EMPTY nothing,
    FULL all, CAUSAL_ONLY the causal test alone, NO_CAUSAL the mask with causal := true,
    else the mask) equals the reference mask on every in-range pair."""
    import dataclasses

    import torch

    from flashgen.codegen.cuda_expr import causal_as_true as _causal_as_true
    from flashgen.ops.cpu.reference import eval_mask

    specs = []
    for i, (m, params) in enumerate(_EDGE_MASKS):
        text = f"name: e{i}\nhead_dim: 64\ndtype: bf16\nmask: '{m}'\n"
        specs.append(loads_spec(text + (f"params:\n{params}" if params else ""), "e.yaml"))
    specs += [_gallery(n) for n in ("window", "prefix_lm", "chunked", "kv_head_window")]
    specs += [
        s
        for s in _random_specs(60, wild=False)
        if masktiles.has_causal_bits(s) and not s.tensor_params
    ]
    grids = [(50, 21), (21, 50), (37, 37), (1, 40), (40, 1), (70, 33)]
    cases, where = [], []
    for i, spec in enumerate(specs):
        params = {p.name: p.default for p in spec.scalar_params}
        pv = list(params.values()) + [0] * (4 - len(params))
        for sq, sk in grids:
            for bm, bn in ((16, 16), (16, 8)):
                for q0 in range(0, sq, bm):
                    for k0 in range(0, sk, bn):
                        q1, k1 = min(q0 + bm, sq) - 1, min(k0 + bn, sk) - 1
                        cases.append((i, q0, q1, k0, k1, 0, 1, 1, sq, sk, *pv))
                        where.append((sq, sk))
    got = _run_host(host_exe, specs, cases, causal_bits=True)
    grids_of: dict = {}
    seen = {0: 0, 1: 0, 2: 0, 4: 0, 8: 0}
    for case, g in zip(cases, got, strict=True):
        i, q0, q1, k0, k1, _, _, _, sq, sk, *_ = case
        spec = specs[i]
        key = (i, sq, sk)
        if key not in grids_of:
            kw = dict(batch=1, heads_q=2, seqlen_q=sq, seqlen_k=sk, heads_kv=2)
            m = eval_mask(spec, **kw)[0, 1]
            nc = eval_mask(dataclasses.replace(spec, mask=_causal_as_true(spec.mask)), **kw)
            qi = torch.arange(sq).view(-1, 1)
            ki = torch.arange(sk).view(1, -1)
            grids_of[key] = (m, nc[0, 1], ki <= qi + sk - sq)
        m, nc, causal = (t[q0 : q1 + 1, k0 : k1 + 1] for t in grids_of[key])
        base, bits = g & 3, g & 12
        if base == 0:
            kernel = torch.zeros_like(m)
        elif base == 2:
            kernel = torch.ones_like(m)
        elif bits == 4:
            kernel = causal
        elif bits == 8:
            assert bool(causal.all()), (spec.mask, case)
            kernel = nc
        else:
            assert bits == 0, (spec.mask, case, g)
            kernel = m
        assert torch.equal(kernel, m), (spec.mask, case, g)
        seen[bits or base] += 1
    assert all(seen.values()), seen
