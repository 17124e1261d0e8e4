"""The Hopper backward's constant tiles of a relative-position table's gradient
(``hopper_bwd.dparam_const_tiles``; templates/common/dparam.j2, dparam_const.cuh): a step whose
whole tile reads one element of the table (T5's clamp away from the diagonal) adds its dS into
one running register per thread instead of summing it per diagonal.

On the host: the per-step test (:func:`flashgen.analysis.masktiles.constant_source`, the tile
classifier's interval rules on int32, int64 or double ranges) against brute force over the
kernel's own element offsets of every pair of each tile (``dparam.fields``' ``offset``, the
CUDA the kernel adds at), for tiles of the steps' shapes over sequence lengths 1 to 4097,
Sq != Sk, and against its Python mirror (:func:`flashgen.analysis.maskinfo.constant_over`).
With nvcc: the units compile spill-free, and the constant step's code is a few instructions.
The numbers are checked on a GPU by tests/gpu/test_param_grads_sinks_gpu.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from dparam_cases import CONST_TILE_CASES, DIAGONAL_FORMS, diagonal_spec, form_spec
from host_cxx import preamble, scalar_params
from sass_helpers import cuobjdump, sass

from flashgen.analysis import masktiles
from flashgen.analysis.derive import param_grad_terms
from flashgen.analysis.maskinfo import constant_over
from flashgen.build.render import render, template_root
from flashgen.codegen import dparam
from flashgen.families import registry
from flashgen.families.build import build_backward
from flashgen.frontend.spec import load_spec, loads_spec
from flashgen.options import DEFAULT, Options

REPO = Path(__file__).resolve().parents[2]
#: the diagonal form alone (``dparam_const_tiles`` off) and with the constant tiles (both on
#: by default)
DIAG = DEFAULT.with_values(
    {"hopper_bwd.dparam_diagonal": True, "hopper_bwd.dparam_const_tiles": False}
)
CONST = DIAG.replace_path("hopper_bwd.dparam_const_tiles", True)

#: The ranges each relative-position read's test takes, and whether the interval rules decide
#: every tile (the test holds exactly where brute force finds one element) or are sound only
#: (a float comparison's rounding slack at its boundary).
CASES = {
    "t5": ("int32", True),
    "rel4": ("int32", True),
    "param_clamp": ("int32", True),
    "buckets": ("int32", True),
    "two_sided": ("int32", True),
    "wide": ("int64", True),
    "float_cmp": ("double", False),
    "two_terms": ("int32", True),
}
assert set(CASES) == set(DIAGONAL_FORMS)
LENGTHS = (1, 17, 127, 1000, 4097)
#: (BLOCK_M, BLOCK_N) of the Hopper backward's steps: head_dim 64 at 64 and 128 queries, 256
TILES = ((64, 128), (128, 128), (64, 64))
#: shapes whose per-tile results are also compared with the Python mirror
MIRRORED = ((127, 1000), (1000, 127), (1000, 1000), (17, 4097))
BATCH, HEADS, HEADS_KV, B, H = 2, 8, 2, 1, 5


def _spec(name: str, head_dim: int = 64):
    return diagonal_spec(name, head_dim)


def _grads(spec) -> tuple[str, ...]:
    return registry.grad_params(spec)


def _diagonal_terms(spec):
    """``[(k, subscripts, offset CUDA)]`` of the diagonal terms, numbered as the kernel does."""
    fields = dparam.fields(spec, _grads(spec))["dparam_terms"]
    out, k = [], 0
    for p in spec.params:
        if p.name not in _grads(spec):
            continue
        for t in param_grad_terms(spec.score_mod, p.name):
            if fields[k]["form"] == "diagonal":
                out.append((k, t.indices, fields[k]["offset"]))
            k += 1
    return out


def _host_program(cases) -> str:
    """One test and one offset function per (case, term), and a run over every tile of each
    shape and tile size: per line the case, term, shape, tile, the tiles, those the test calls
    constant, those brute force finds constant, those called constant that are not, and (for
    :data:`MIRRORED` shapes at 64 x 128) the test's bit per tile."""
    root = template_root() / "common"
    parts = [preamble()]
    headers = ("masktiles.cuh", "masktiles_intrules.cuh", "masktiles_int.cuh", "masktiles_i32.cuh")
    parts += [(root / f).read_text() for f in headers]
    runs = []
    for ci, (name, spec, values) in enumerate(cases):
        decl, args = scalar_params(spec, values)
        for k, indices, offset in _diagonal_terms(spec):
            tag = f"c{ci}_{k}"
            parts.append(masktiles.constant_source(spec, indices, f"test_{tag}"))
            parts.append(
                f"static int64_t off_{tag}(int q_idx, int kv_idx, int b, int h, int h_kv, "
                f"int seqlen_q, int seqlen_k{decl}) {{\n"
                f"    const int batch = {BATCH}, heads_q = {HEADS}, heads_kv = {HEADS_KV};\n"
                "    (void)batch; (void)heads_q; (void)heads_kv; (void)b; (void)h; (void)h_kv;\n"
                "    (void)seqlen_q; (void)seqlen_k;\n"
                "    const float q_idx_f = (float)q_idx, kv_idx_f = (float)kv_idx;\n"
                "    (void)q_idx_f; (void)kv_idx_f;\n"
                f"    return {offset};\n}}\n"
            )
            # one pair of lambdas per term, so run() is instantiated once per term (g++ took 14
            # CPU-seconds on an instantiation per run)
            runs.append(
                "    {\n"
                f"    auto test = [](int q0, int q1, int k0, int k1, int sq, int sk) {{ return "
                f"test_{tag}(q0, q1, k0, k1, {B}, {H}, {H // 4}, sq, sk{args}); }};\n"
                f"    auto off = [](int q, int kv, int sq, int sk) {{ return off_{tag}(q, kv, {B}, "
                f"{H}, {H // 4}, sq, sk{args}); }};"
            )
            for sq in LENGTHS:
                for sk in LENGTHS:
                    for bm, bn in TILES:
                        bits = int((sq, sk) in MIRRORED and (bm, bn) == (64, 128))
                        runs.append(
                            f'    run("{name}", {k}, {sq}, {sk}, {bm}, {bn}, {bits}, test, off);'
                        )
            runs.append("    }")
    main = r"""
#include <string>
template <class Test, class Off>
static void run(const char* name, int k, int sq, int sk, int bm, int bn, int bits, Test test,
                Off off) {
    long tiles = 0, claimed = 0, constant = 0, unsound = 0;
    std::string row;
    for (int m0 = 0; m0 < sq; m0 += bm)
        for (int n0 = 0; n0 < sk; n0 += bn) {
            const int q1 = std::min(m0 + bm, sq) - 1, k1 = std::min(n0 + bn, sk) - 1;
            const bool says = test(m0, q1, n0, k1, sq, sk);
            const int64_t first = off(m0, n0, sq, sk);
            bool one = true;
            for (int q = m0; q <= q1 && (one || says); ++q)
                for (int kv = n0; kv <= k1; ++kv)
                    if (off(q, kv, sq, sk) != first) { one = false; break; }
            ++tiles;
            claimed += says;
            constant += one;
            unsound += says && !one;
            if (bits) row += says ? '1' : '0';
        }
    printf("%s %d %d %d %d %d %ld %ld %ld %ld %s\n", name, k, sq, sk, bm, bn, tiles, claimed,
           constant, unsound, bits ? row.c_str() : "-");
}
int main() {
"""
    return "\n".join(parts) + main + "\n".join(runs) + "\n}\n"


def test_constant_tile_tests_agree_with_brute_force_on_the_host(cxx_exe):
    """Every tile of every step shape (64 x 128, 128 x 128, 64 x 64) over lengths 1, 17, 127,
    1000 and 4097 each way: where the test says a term's read is one element over the tile, the
    kernel's offset is the same at every pair of it (sound); for the forms the interval rules
    decide (clamps, buckets by division, a two-sided bucket table, a product past int32's
    static bounds) exactly there; at the mirrored shapes tile by tile as the Python mirror
    says.  The long shapes have constant tiles, the short ones none."""
    cases = [(n, _spec(n), DIAGONAL_FORMS[n][2]) for n in CASES]
    exe = cxx_exe(_host_program(cases), "const_tiles", "-O2")
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600, check=True)
    lines = [x.split() for x in out.stdout.splitlines()]
    assert len(lines) == sum(len(_diagonal_terms(s)) for _, s, _ in cases) * 25 * len(TILES)
    by_case: dict = {}
    for name, k, sq, sk, bm, bn, tiles, claimed, constant, unsound, bits in lines:
        sq, sk, bm, bn = int(sq), int(sk), int(bm), int(bn)
        tiles, claimed, constant, unsound = int(tiles), int(claimed), int(constant), int(unsound)
        where = (name, k, sq, sk, bm, bn)
        assert tiles == -(-sq // bm) * -(-sk // bn), where
        assert unsound == 0, where
        if CASES[name][1]:
            assert claimed == constant, where
        by_case[name] = by_case.get(name, 0) + claimed
        if bits != "-":
            spec, values = _spec(name), DIAGONAL_FORMS[name][2]
            (indices,) = [ix for kk, ix, _ in _diagonal_terms(spec) if str(kk) == k]
            want = "".join(
                "1" if constant_over(
                    spec, indices, (m0, min(m0 + bm, sq) - 1), (n0, min(n0 + bn, sk) - 1),
                    b=B, h=H, h_kv=H // 4, seqlen_q=sq, seqlen_k=sk, params=values,
                ) else "0"
                for m0 in range(0, sq, bm) for n0 in range(0, sk, bn)
            )  # fmt: skip
            assert bits == want, where
    assert all(by_case[n] > 0 for n in CASES), by_case  # every form has constant tiles


def test_constant_tests_pick_their_ranges():
    """int32 ranges (plain int arithmetic) where every int node's bounds over every call lie in
    int32 (T5's clamp, a param's clamp, buckets, the two-sided buckets), int64 where one may
    leave it (``(kv_idx - q_idx) * 3``), double where the subscript computes a float."""
    for name, (ranges, _) in CASES.items():
        spec = _spec(name)
        got = {masktiles.constant_ranges(spec, ix) for _, ix, _ in _diagonal_terms(spec)}
        assert got == {ranges}, name
        src = dparam.const_tile_fields(spec, _grads(spec))
        header = masktiles.RANGE_HEADERS[ranges]
        assert src["dparam_const_headers"] == ([header] if header else []), name
        ns = {"int32": "fg::iv32::", "int64": "fg::ivi::", "double": "fg::iv::"}[ranges]
        assert ns + "range(" in src["dparam_const_source"], name
    # a subscript the rules cannot bound (a tensor read) is never constant
    spec = loads_spec(
        "name: cst_tensor\nhead_dim: 64\ndtype: bf16\nmask: null\n"
        'score_mod: "score + t[ix[0] + 0 * (kv_idx - q_idx)]"\nparams:\n'
        "  t: {type: f32, shape: [4]}\n  ix: {type: i32, shape: [1]}\n",
        "<cst_tensor>",
    )
    (term,) = param_grad_terms(spec.score_mod, "t")
    assert masktiles.constant_ranges(spec, term.indices) == "double"
    assert not constant_over(spec, term.indices, (0, 0), (0, 0), b=0, h=0, seqlen_q=1,
                             seqlen_k=1)  # fmt: skip


def test_the_option_renders_only_units_with_a_diagonal_term():
    """Off every unit renders as before; on (the default), only a Hopper dparam
    unit with a relative-position term changes (a per-CTA or per-key form renders the same),
    and the option keys the op and the unit's plan."""
    assert Options().hopper_bwd.dparam_const_tiles is True
    assert CONST.key() == DEFAULT.key()
    assert CONST.key() != DIAG.key()
    assert CONST.family_key("hopper_bwd") != DIAG.family_key("hopper_bwd")
    t5 = load_spec(REPO / "specs" / "t5_bias.yaml")
    for spec, grads in ((t5, ()), (form_spec("per_head", 64), ("s",)),
                        (form_spec("per_key_head", 64), ("kb",))):  # fmt: skip
        a = render(registry.plan_hopper_backward(spec, "sm_90", DIAG, param_grads=grads).unit)
        on = CONST.replace_path("hopper_bwd.d64_block_m", DIAG.hopper_bwd.d64_block_m)
        b = render(registry.plan_hopper_backward(spec, "sm_90", on, param_grads=grads).unit)
        assert a == b, spec.name
        assert "dpc_on" not in a and "fg_dparam_const" not in a
    on = render(registry.plan_hopper_backward(t5, "sm_90", CONST, param_grads=("bias",)).unit)
    off = render(registry.plan_hopper_backward(t5, "sm_90", DIAG, param_grads=("bias",)).unit)
    assert "dpc_on" not in off and "masktiles_i32" not in off
    assert "const bool dpc_on0 = fg_dparam_const0(m0, min(m0 + BLOCK_M, seqlen_q) - 1, n0, " \
           "min(n0 + BLOCK_N, seqlen_k) - 1, b, h, h_kv, seqlen_q, seqlen_k) && " \
           "dps_bias == 0;" in on  # fmt: skip
    assert "dpc0 += fg::fold_sum(dpd0);" in on
    assert "if (!dpc_on0) {" in on and "if (last_step) fg::warp_add_element(dpc0, dp_bias" in on
    assert "namespace iv32" in on  # T5's subscripts on int32 ranges


def test_each_diagonal_term_has_its_own_constant_register():
    """Two reads of one table: each term its test, running register and element, its slots'
    flush skipped on its own constant steps."""
    spec = _spec("two_terms")
    src = render(registry.plan_hopper_backward(spec, "sm_90", CONST, param_grads=("bias",)).unit)
    for k in (0, 1):
        assert f"float dpc{k} = 0.f;" in src and f"int64_t dpc_off{k} = -1;" in src
        assert f"const bool dpc_on{k} = fg_dparam_const{k}(" in src
        assert f"if (!dpc_on{k}) {{" in src


def _kernel(code: str, name: str) -> str:
    body = code[code.index(name):]
    return body[: body.find("Function :") if "Function :" in body else None]


def _sass_by_line(plan) -> list[tuple[int, str]]:
    """``[(line of the rendered unit, instruction)]`` of the dK/dV kernel's SASS, by
    ``nvdisasm -g`` of the cached cubin (built with -lineinfo; the unit's headers are
    rendered into it, so its lines are those of ``render(plan.unit)``); skips without
    nvdisasm."""
    from flashgen.build import cache

    tool = cuobjdump()
    nvdisasm = Path(tool).with_name("nvdisasm") if tool else None
    if nvdisasm is None or not nvdisasm.is_file():
        pytest.skip("no nvdisasm beside cuobjdump")
    cubin, _ = cache.get_or_build(render(plan.unit), plan.unit)
    text = subprocess.run([str(nvdisasm), "-g", "-c", str(cubin)], capture_output=True,
                          text=True, timeout=300, check=True).stdout  # fmt: skip
    body = text[text.index(f".text.{plan.dkdv.kernel_name}:"):]
    out, line = [], 0
    for row in body.splitlines()[1:]:
        if row.startswith(".text.") or row.startswith("\t.section"):
            break
        m = re.search(r'//## File "([^"]+)", line (\d+)', row)
        if m:
            line = int(m.group(2)) if m.group(1).endswith(".cu") else 0
            continue
        m = re.search(r"/\*[0-9a-f]{4,5}\*/\s+(.*?)\s*;", row)
        if m:
            out.append((line, m.group(1)))
    return out


def _lines(src: str, first: str, last: str | None = None) -> range:
    """The 1-based lines of ``src`` from the one holding ``first`` to the next holding
    ``last`` (default: that line alone)."""
    rows = src.splitlines()
    a = next(i for i, x in enumerate(rows) if first in x)
    b = a if last is None else next(i for i in range(a, len(rows)) if last in rows[i])
    return range(a + 1, b + 2)


def test_the_gpu_tests_units_compile_spill_free_on_the_hopper_kernel(requires_nvcc):
    """Every (form, head dim, mask) the GPU test runs with ``dparam_const_tiles`` builds its
    Hopper grad unit (64-query steps at head_dim 64, as without the option) with 0 spills and
    no serialized wgmma, so the GPU test runs the constant tiles."""
    from concurrent.futures import ThreadPoolExecutor

    def build(case):
        spec = diagonal_spec(*case)
        plan, _, report = build_backward(spec, "sm_90", hopper=True, options=CONST,
                                         param_grads=_grads(spec))  # fmt: skip
        return case, plan, report

    with ThreadPoolExecutor(2) as ex:
        for case, plan, report in ex.map(build, CONST_TILE_CASES):
            assert plan.dkdv.template == "sm_90/bwd.cu.j2", case
            assert report.spill_bytes == 0 and not report.wgmma_serialized, (case, report)
            assert plan.dkdv.context.dparam_const_source, case


def test_constant_tile_units_compile_spill_free(requires_nvcc):
    """With ``dparam_const_tiles`` the Hopper grad units of t5_bias at head_dim 64 (built at
    64-query steps, as without it) and 256, the relative-table form at 256 and two terms of
    one table at 64 compile with 0 spills and no serialized wgmma, on the Hopper kernel; the
    per-diagonal shuffles stay (for the other steps; ptxas may copy one term's onto both
    paths of another's test), and each term adds two warp reductions
    (the element's change, the last step: 5 SHFL.BFLY each, more where ptxas copies a site
    for a diverged warp), no shared-memory atomic."""
    t5 = load_spec(REPO / "specs" / "t5_bias.yaml")
    for spec, terms in ((t5, 1), (_t5_256(), 1), (form_spec("relative_table", 256), 1),
                        (_spec("two_terms"), 2)):  # fmt: skip
        grads = _grads(spec)
        plan, _, report = build_backward(spec, "sm_90", hopper=True, options=CONST,
                                         param_grads=grads)  # fmt: skip
        assert plan.dkdv.template == "sm_90/bwd.cu.j2", spec.name
        assert report.spill_bytes == 0 and not report.wgmma_serialized, (spec.name, report)
        assert plan.dkdv.context.dparam_const_source, spec.name
        base = registry.plan_hopper_backward(spec, "sm_90", DIAG.replace_path(
            "hopper_bwd.d64_block_m", plan.dkdv.context.block_m if spec.head_dim == 64
            else DIAG.hopper_bwd.d64_block_m), param_grads=grads)  # fmt: skip
        code = _kernel(sass(plan.unit), plan.dkdv.kernel_name)
        was = _kernel(sass(base.unit), base.dkdv.kernel_name)
        assert code.count("SHFL.IDX") >= was.count("SHFL.IDX") > 1, spec.name
        assert code.count("SHFL.BFLY") >= was.count("SHFL.BFLY") + 10 * terms, spec.name
        assert "ATOMS" not in code, spec.name


def _t5_256():
    return loads_spec(
        (REPO / "specs" / "t5_bias.yaml").read_text().replace("head_dim: 64", "head_dim: 256")
        .replace("name: t5_bias", "name: t5_bias_d256"), "<t5_bias_d256>",
    )  # fmt: skip


@pytest.mark.parametrize("head_dim", [64, 256])
def test_a_constant_step_costs_a_few_instructions(requires_nvcc, head_dim):
    """The SASS of t5_bias's constant step, by source line (``nvdisasm -g``): the test of the
    step's tile (``fg_dparam_const0`` on int32 ranges, the tile's last query and key, the row
    stride's test) at most 20 instructions besides the P^T pass's FADDs ptxas files under its
    lines, its only 64-bit compares (``.EX``) those of the stride (a kernel argument, uniform
    registers); the element's offset and its compare with the held one at most 18; the fold of
    the thread's 2 (NQ + 1) diagonal registers 2 (NQ + 1) - 1 FADD (NQ: the warpgroup's
    8-query column tiles)."""
    spec = load_spec(REPO / "specs" / "t5_bias.yaml") if head_dim == 64 else _t5_256()
    # d64_block_m only sets head_dim 64's steps: at 256 the plan is CONST's, the unit
    # test_constant_tile_units_compile_spill_free builds (one cache entry, one nvcc run)
    opts = CONST.replace_path("hopper_bwd.d64_block_m", 64) if head_dim == 64 else CONST
    plan = registry.plan_hopper_backward(spec, "sm_90", opts, param_grads=("bias",))
    src = render(plan.unit)
    if head_dim == 256:  # the unit a 64-query d64_block_m would give: the same source
        at64 = CONST.replace_path("hopper_bwd.d64_block_m", 64)
        assert src == render(
            registry.plan_hopper_backward(spec, "sm_90", at64, param_grads=("bias",)).unit)
    rows = _sass_by_line(plan)
    test_lines = {*_lines(src, "bool fg_dparam_const0(", "return e0.lo == e0.hi"),
                  *_lines(src, "namespace iv32 {", "}  // namespace iv32"),
                  *_lines(src, "const bool dpc_on0 = ")}  # fmt: skip
    test = [x for line, x in rows if line in test_lines and not x.startswith("FADD")]
    assert 0 < len(test) <= 20, test
    assert all("UR" in x for x in test if ".EX" in x), test
    off_lines = _lines(src, "const int64_t off = ", "if (off != dpc_off0)")
    off = [x for line, x in rows if line in off_lines]
    assert 0 < len(off) <= 18, off
    fold = [x for line, x in rows if line in _lines(src, "float fold_sum(", "return x[0];")]
    nq = plan.dkdv.context.block_m // (16 if head_dim == 256 else 8)
    assert [x.split()[0] for x in fold] == ["FADD"] * (2 * (nq + 1) - 1), fold
