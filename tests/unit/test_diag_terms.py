"""Diagonal terms of a score_mod (``flashgen.analysis.rowcol.split_diagonal``, the Hopper
forward's ``hopper_fwd.diag_terms``): which sub-expressions are functions of ``kv_idx - q_idx``
alone, the staging of each warp's diagonals and the elements' reads of them run on the host
with the index formulas taken from the rendered kernel (every element of every warp of FULL
tiles equals the per-element score_mod code bit for bit), the rendering and an nvcc build."""

from __future__ import annotations

import random
import re
import subprocess

import pytest
from host_cxx import preamble, scalar_params  # noqa: E402
from shipped_specs import SPEC_DIR  # noqa: E402

from flashgen.analysis import rowcol  # noqa: E402
from flashgen.build.render import render  # noqa: E402
from flashgen.families import hopper_bwd, hopper_fwd  # noqa: E402
from flashgen.frontend.ir import Ty, Var  # noqa: E402
from flashgen.frontend.spec import load_spec, loads_spec  # noqa: E402

PARAMS = (
    "params:\n"
    "  slopes: {type: f32, shape: [num_heads]}\n"
    "  bias: {type: f32, shape: [num_heads, 257]}\n"
    "  buckets: {type: i32, shape: [512]}\n"
    "  tab: {type: f32, shape: [batch, num_heads]}\n"
    "  p: {type: f32, default: 0.25}\n"
)

# score_mods with diagonal terms: (score_mod, the diagonal sub-expressions' count)
# fmt: off
DIAGONAL = [
    ("score + bias[h, min(max(kv_idx - q_idx, -128), 128) + 128]", 1),          # T5, clamped
    ("score + bias[h, buckets[min(max(q_idx - kv_idx + 255, 0), 511)]]", 1),    # a bucket table
    ("score + p * log(1.0 + abs(kv_idx - q_idx))", 1),                          # computed buckets
    ("score * (1.0 + bias[h, abs(2 * kv_idx - 2 * q_idx) % 257]) + tab[b, h]", 1),
    ("score + bias[h, abs(kv_idx - q_idx) % 257] - bias[0, abs(q_idx - kv_idx) % 257]", 2),
    ("score + buckets[abs(q_idx + seqlen_k - seqlen_q - kv_idx) % 512]", 1),    # an i32 term
]
# score_mods without: no position, one position, affine, not through the difference
NOT_DIAGONAL = [
    "score",
    "score + tab[b, h]",
    "score + bias[h, q_idx % 257]",
    "score + bias[h, kv_idx % 257] * bias[h, q_idx % 257]",
    "score - slopes[h] * (q_idx - kv_idx)",
    "score + bias[h, (q_idx + kv_idx) % 257]",
    "score + bias[h, (q_idx - 2 * kv_idx) % 257]",
    "score + (q_idx * kv_idx) % 7",
    # worth no slot: an integer distance costs the element a few ALU ops
    "score - slopes[h] * abs(q_idx - kv_idx)",
    "score + (abs(kv_idx - q_idx) % 7) * 0.5",
    # float differences: each product (sum) rounds apart, not a function of kv_idx - q_idx
    "score + log(1.0 + abs(q_idx * 0.1 - kv_idx * 0.1))",
    "score + exp(-abs((q_idx + 0.1) - (kv_idx + 0.1)))",
]
# score_mods whose diagonal float product the element code fuses into an add (nvcc's FFMA,
# sm_90 SASS of the option off: fma(-slopes[h], |d|, x)): the product's operands are staged
CONTRACTED = [
    ("max(score, -10.0) - slopes[h] * log(1.0 + abs(q_idx - kv_idx))", 1),
    ("score + bias[h, min(max(kv_idx - q_idx, -128), 128) + 128] - p * sqrt(abs(q_idx - kv_idx))",
     2),
    ("score - p * log(1.0 + abs(kv_idx - q_idx)) * 1.5", 1),
    ("score + (q_idx > kv_idx ? -1.0 : 1.0) * 0.0", 0),
]
# fmt: on


#: The per-element form (the options off), the reference of the rendering tests.
FWD_OFF = hopper_fwd.Options(diag_terms=False)
BWD_OFF = hopper_bwd.Options(diag_terms=False)


def shipped(name: str):
    return load_spec(SPEC_DIR / f"{name}.yaml")


def spec_for(mod: str, name: str = "t"):
    return loads_spec(
        f"name: {name}\nhead_dim: 64\ndtype: bf16\nscore_mod: '{mod}'\n{PARAMS}", f"{name}.yaml"
    )


@pytest.mark.parametrize("mod, count", DIAGONAL)
def test_diagonal_terms_are_found(mod, count):
    spec = spec_for(mod)
    split = rowcol.split_diagonal(spec.score_mod, spec)
    assert len(split.terms) == count
    for t in split.terms:
        assert t.ty in (Ty.F32, Ty.I32) and t.name.startswith("fg_diag")
    names = {n.name for n in _walk(split.expr) if isinstance(n, Var)}
    assert "q_idx" not in names and "kv_idx" not in names, "the residual reads no position"


@pytest.mark.parametrize("mod", NOT_DIAGONAL)
def test_other_score_mods_have_none(mod):
    spec = spec_for(mod)
    split = rowcol.split_diagonal(spec.score_mod, spec)
    assert split.terms == () and split.expr == spec.score_mod


def test_a_float_difference_is_not_a_function_of_the_diagonal():
    """(1, 0), (1001, 1000) and (8, 7) lie on one diagonal, yet in float32 q * 0.1 - kv * 0.1
    differs at the first two (0.1 against 0.099998474), (q + 0.1) - (kv + 0.1) at the first and
    the last (1 against 1.0000005): a staged value, evaluated at another
    pair of the diagonal, would not be the element's (the host emulation counted 14152 of
    22968 elements off by an ulp or more for the first score_mod of NOT_DIAGONAL's tail)."""
    np = pytest.importorskip("numpy")
    f, c = np.float32, np.float32(0.1)
    assert f(1) * c - f(0) * c != f(1001) * c - f(1000) * c
    assert (f(1) + c) - (f(0) + c) != (f(8) + c) - (f(7) + c)
    for mod in NOT_DIAGONAL[-2:]:
        spec = spec_for(mod)
        assert rowcol.split_diagonal(spec.score_mod, spec).terms == ()


@pytest.mark.parametrize("mod, count", CONTRACTED)
def test_a_float_product_is_not_a_term(mod, count):
    """Its operands are: the element code keeps the product (and nvcc's fusion of it)."""
    from flashgen.frontend.ir import Binary, Unary

    spec = spec_for(mod)
    split = rowcol.split_diagonal(spec.score_mod, spec)
    assert len(split.terms) == count
    for t in split.terms:
        x = t.expr
        while isinstance(x, Unary):
            x = x.arg
        assert not (t.ty == Ty.F32 and isinstance(x, Binary) and x.op in ("*", "/")), t


def test_the_shipped_specs_with_diagonal_terms():
    found = {}
    for name in ("t5_bias", "alibi_learned", "alibi", "gemma2_softcap", "chunked_local"):
        spec = shipped(name)
        if spec.score_mod is not None:
            found[name] = len(rowcol.split_diagonal(spec.score_mod, spec).terms)
    assert found == {"t5_bias": 1, "alibi_learned": 0, "alibi": 0, "gemma2_softcap": 0}


def _walk(e):
    from flashgen.frontend.ir import walk

    return walk(e)


# ----------------------------------------------------------------------------- host emulation
SQ, SK = 1000, 1301


def _formulas(src: str) -> dict:
    """The index formulas of the rendered kernel: the thread's slot base, the staged pair
    (q_idx, kv_idx) of slot t, the slot count, and an element's slot."""
    base = re.search(r"const int diag_base = (.+?);", src).group(1)
    stage = re.search(r"const int q_idx = (.+?), kv_idx = (n0 \+ t);", src)
    bound = re.search(r"if \(t >= (.+?)\) break;", src).group(1)
    slot = re.search(r"diag_w\[0 \* DIAG_LEN \+ (diag_base [^\]]+)\]", src).group(1)
    return {"base": base, "q": stage.group(1), "kv": stage.group(2), "bound": bound,
            "slot": slot}  # fmt: skip


def _host_pieces(spec, terms, warp: str, slot: str) -> tuple[str, str, str, str]:
    """The pieces both host programs share: the staging stores and the element reads of
    ``terms`` (warp index ``warp``, a pair's slot ``slot``), the tensor params as host arrays
    with the bit-cast helpers, and their initialisation."""
    stores = "".join(
        f"                sdiag[{warp}][{i} * DIAG_LEN + t] = "
        f"{'i2f' if t['ctype'] == 'int' else ''}(({t['ctype']})({t['code']}));\n"
        for i, t in enumerate(terms)
    )
    reads = "".join(
        f"                    const {t['ctype']} {t['name']} = "
        f"{'f2i' if t['ctype'] == 'int' else ''}(sdiag[{warp}][{i} * DIAG_LEN + {slot}]);\n"
        for i, t in enumerate(terms)
    )
    tensors = "".join(f"static float t_{p.name}[8192];\n" if p.ty == Ty.F32 else
                      f"static int t_{p.name}[8192];\n" for p in spec.tensor_params)  # fmt: skip
    header = (
        "#include <cstring>\n"
        "static float i2f(int v) { float f; std::memcpy(&f, &v, 4); return f; }\n"
        "static int f2i(float v) { int i; std::memcpy(&i, &v, 4); return i; }\n" + tensors
    )
    init = "".join(
        f"    for (int i = 0; i < 8192; ++i) t_{p.name}[i] = "
        + ("(float)((i * 37) % 23 - 11) * 0.173f;\n" if p.ty == Ty.F32 else "(i * 7) % 257;\n")
        for p in spec.tensor_params
    )
    return stores, reads, header, init


def _stage_loop(cols: str, f: dict, stores: str) -> str:
    """A lane's staging loop over its warp's ``cols + 15`` diagonals, with the kernel's slot
    bound and staged pair (``f``)."""
    return (
        f"            for (int c = 0; c < ({cols} + 15 + 31) / 32; ++c) {{\n"
        "                const int t = 32 * c + lane;\n"
        f"                if (t >= {f['bound']}) break;\n"
        f"                const int q_idx = {f['q']}, kv_idx = {f['kv']};\n"
        "                const float q_idx_f = (float)q_idx, kv_idx_f = (float)kv_idx;\n"
        "                (void)q_idx_f; (void)kv_idx_f;\n"
        f"{stores}            }}\n"
    )


def _program(spec, ctx, f: dict, tiles, values) -> str:
    """A host program: for each FULL tile (m0, n0) every warp stages its diagonals as
    stage_diag does, then every element of every lane computes x both ways; prints the
    number of elements (rows inside seqlen_q) and of those whose bits differ."""
    terms = ctx["diag_terms"]
    nt = len(terms)
    decl, args = scalar_params(spec, values)
    stores, reads, header, init = _host_pieces(spec, terms, "w", f["slot"])
    rows = "".join(f"    {{{m0}, {n0}, {b}, {h}}},\n" for m0, n0, b, h in tiles)
    return preamble() + f"""
{header}
constexpr int BLOCK_N = {ctx['block_n']}, NS = BLOCK_N / 8, DIAG_LEN = BLOCK_N + 16;
static float sdiag[8][{max(nt, 1)} * DIAG_LEN];
struct Tile {{ int m0, n0, b, h; }};
static const Tile tiles[] = {{
{rows}}};
static void run(const Tile& tl, long& n, long& bad{decl}) {{
    const int m0 = tl.m0, b = tl.b, h = tl.h, h_kv = h / 4, batch = 2, heads_q = 8, heads_kv = 2;
    const int seqlen_q = {SQ}, seqlen_k = {SK};
    const float softmax_scale = 0.125f;
    (void)b; (void)h; (void)h_kv; (void)batch; (void)heads_q; (void)heads_kv;
    {ctx['prologue']}
    const int n0 = tl.n0;
    for (int w = 0; w < 8; ++w) {{
        const int cg = w / 4, warp = w % 4;
        for (int lane = 0; lane < 32; ++lane) {{
            const int row_base = cg * 64 + warp * 16 + lane / 4;
{_stage_loop("BLOCK_N", f, stores)}        }}
    }}
    for (int w = 0; w < 8; ++w) {{
        const int cg = w / 4, warp = w % 4;
        for (int lane = 0; lane < 32; ++lane) {{
            const int row_base = cg * 64 + warp * 16 + lane / 4;
            const int diag_base = {f['base']};
            for (int j = 0; j < NS; ++j)
                for (int i = 0; i < 4; ++i) {{
                    const int q_raw = m0 + row_base + (i / 2) * 8;
                    const int kv_raw = n0 + j * 8 + (lane % 4) * 2 + (i % 2);
                    if (q_raw >= seqlen_q) continue;
                    const int q_idx = min(q_raw, seqlen_q - 1), kv_idx = kv_raw;
                    const float q_idx_f = (float)q_idx, kv_idx_f = (float)kv_idx;
                    (void)q_idx_f; (void)kv_idx_f;
                    const float score_raw = (float)((q_raw * 131 + kv_raw * 71) % 97 - 48) * 0.37f;
                    const float score = score_raw * softmax_scale;
                    const float direct = (float)({ctx['score_mod_expr']});
{reads}                    const float staged = (float)({ctx['score_mod_expr_diag']});
                    ++n;
                    if (f2i(direct) != f2i(staged)) {{
                        if (bad < 5) printf("m0 %d n0 %d w %d lane %d j %d i %d: %.9g vs %.9g\\n",
                                            m0, n0, w, lane, j, i, direct, staged);
                        ++bad;
                    }}
                }}
        }}
    }}
}}
int main() {{
{init}    long n = 0, bad = 0;
    for (const Tile& tl : tiles) run(tl, n, bad{args});
    printf("%ld %ld\\n", n, bad);
}}
"""


@pytest.mark.parametrize("mod, count", DIAGONAL)
def test_staged_diagonals_equal_the_per_element_code_on_the_host(mod, count, cxx_exe):
    """Every element of every warp's part of FULL tiles (rows inside seqlen_q, the last
    query block included) reads, at the rendered kernel's slot, the value its per-element
    score_mod code computes: the same bits."""
    spec = spec_for(mod)
    plan = hopper_fwd.plan(spec, "sm_90", hopper_fwd.Options(diag_terms=True))
    ctx = plan.context
    assert len(ctx["diag_terms"]) == count
    f = _formulas(render(plan))
    rng = random.Random(count * 7 + len(mod))
    bn = ctx["block_n"]
    tiles = [(0, 0, 0, 0), (896, SK - bn, 1, 7), (128, 384, 1, 3)]
    tiles += [(rng.randrange(0, SQ, 128), rng.randrange(0, SK - bn + 1), rng.randrange(2),
               rng.randrange(8)) for _ in range(5)]  # fmt: skip
    exe = cxx_exe(_program(spec, ctx, f, tiles, {"p": 0.25}), f"diag{count}_{abs(hash(mod))}")
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, check=True)
    n, bad = (int(v) for v in out.stdout.split()[-2:])
    assert n > 8 * 32 * 4 and bad == 0, out.stdout


def _fma_flags() -> str:
    """g++ flags that contract ``a * b + c`` into an FMA as nvcc does by default (``-fmad``);
    skips where the host has no FMA."""
    import platform

    if platform.machine() in ("x86_64", "AMD64"):
        try:
            with open("/proc/cpuinfo") as f:
                has = " fma " in f.read()
        except OSError:
            has = False
        if not has:
            pytest.skip("needs a host CPU with FMA")
        return "-O2 -mfma -ffp-contract=fast"
    return "-O2 -ffp-contract=fast"


@pytest.mark.parametrize("mod, count", DIAGONAL + [m for m in CONTRACTED if m[1]])
def test_staged_diagonals_equal_the_per_element_code_under_fma_contraction(mod, count, cxx_exe):
    """As above, with the host compiler fusing products into adds as nvcc does: a staged
    float product (``slopes[h] * abs(q_idx - kv_idx)``, rounded) against the element code's
    ``fma(-slopes[h], |d|, x)`` differed in 8690 of 22968 elements for ``max(score, -10.0) -
    slopes[h] * abs(q_idx - kv_idx)``; with the product's operands staged, none differ.  The
    backward's pairs (128-query steps) likewise."""
    flags = _fma_flags()
    spec = spec_for(mod)
    plan = hopper_fwd.plan(spec, "sm_90", hopper_fwd.Options(diag_terms=True))
    ctx = plan.context
    assert len(ctx["diag_terms"]) == count
    bn = ctx["block_n"]
    tiles = [(0, 0, 0, 0), (896, SK - bn, 1, 7), (128, 384, 1, 3), (512, 640, 0, 5)]
    src = _program(spec, ctx, _formulas(render(plan)), tiles, {"p": 0.25})
    exe = cxx_exe(src, f"diagfma_{abs(hash(mod))}", opt=flags)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, check=True)
    n, bad = (int(v) for v in out.stdout.split()[-2:])
    assert n > 8 * 32 * 4 and bad == 0, out.stdout
    unit = _bwd_plan(spec, d64_block_m=128)
    steps = [(0, 0, 0, 0), (SK - 64, SQ - 128, 1, 7), (640, 384, 1, 3)]
    src = _bwd_program(spec, unit.context, _bwd_formulas(render(unit)), steps, {"p": 0.25})
    exe = cxx_exe(src, f"bdiagfma_{abs(hash(mod))}", opt=flags)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, check=True)
    n, bad = (int(v) for v in out.stdout.split()[-2:])
    assert n == len(steps) * 64 * 128 and bad == 0, out.stdout


def test_a_slot_outside_the_warps_diagonals_is_caught(cxx_exe):
    """The host check fails on a wrong element slot (one row off)."""
    spec = spec_for(DIAGONAL[0][0])
    plan = hopper_fwd.plan(spec, "sm_90", hopper_fwd.Options(diag_terms=True))
    f = _formulas(render(plan))
    f["slot"] = f["slot"].replace("(i / 2) * 8", "(i / 2) * 7")
    exe = cxx_exe(_program(spec, plan.context, f, [(0, 0, 0, 0)], {"p": 0.25}), "diag_mut")
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, check=True)
    assert int(out.stdout.split()[-1]) > 0


# ----------------------------------------------------------------------------- rendering
def test_t5_renders_staged_diagonals_and_more_shared_memory():
    spec = shipped("t5_bias")
    on = hopper_fwd.plan(spec, "sm_90", hopper_fwd.Options(diag_terms=True))
    off = hopper_fwd.plan(spec, "sm_90", FWD_OFF)
    src = render(on)
    assert "stage_diag(info_n0, info_cls & 0xff);" in src and "fg_diag0" in src
    assert src.count("__ldg(fg::base_ptr(t_bias") == 2, "staging and the masked tiles' loop"
    assert on.smem_bytes == off.smem_bytes + 16 * 2 * (on.context["block_n"] + 16)
    assert "stage_diag" not in render(off) and off.context["diag_terms"] == []


@pytest.mark.parametrize("name", ["causal_d128", "alibi", "gemma2_softcap", "document_mask"])
def test_specs_without_diagonal_terms_render_unchanged(name):
    spec = shipped(name)
    on = hopper_fwd.plan(spec, "sm_90", hopper_fwd.Options(diag_terms=True))
    assert render(on) == render(hopper_fwd.plan(spec, "sm_90", FWD_OFF))


def test_t5_with_diagonal_terms_builds_without_spills(requires_nvcc):
    from flashgen.build import cache

    plan = hopper_fwd.plan(shipped("t5_bias"), "sm_90", hopper_fwd.Options(diag_terms=True))
    _, report = cache.get_or_build(render(plan), plan)
    assert report.spill_bytes == 0


# ----------------------------------------------------------------------------- the backward
def _bwd_formulas(src: str) -> dict:
    """The Hopper backward's: the staged pair of slot t, the slot count, the thread's slot
    base and a pair's offset from it."""
    stage = re.search(r"const int q_idx = (qw0 .+?), kv_idx = (kw0 .+?);", src)
    bound = re.search(r"if \(t >= (.+?)\) break;", src).group(1)
    base = re.search(r"const float\* diag_t = sDiag \+ .+? \* DIAG_LEN \+ (.+?);", src).group(1)
    slot = re.search(r"diag_t\[0 \* DIAG_LEN \+ (.+?)\]\)", src).group(1)
    return {"q": stage.group(1), "kv": stage.group(2), "bound": bound, "base": base,
            "slot": slot}  # fmt: skip


def _bwd_program(spec, ctx, f: dict, steps, values) -> str:
    """As :func:`_program` for the backward's steps (kw0, qw0): each of a warpgroup's four
    warps stages its 16 keys' diagonals, then every pair compares the score_mod and its
    derivative computed per element with the staged form."""
    terms = ctx["diag_terms"]
    decl, args = scalar_params(spec, values)
    stores, reads, header, init = _host_pieces(spec, terms, "warp", "base + " + f["slot"])
    rows = "".join(f"    {{{kw0}, {qw0}, {b}, {h}}},\n" for kw0, qw0, b, h in steps)
    return preamble() + f"""
{header}
constexpr int QN = {ctx['block_m']}, NQ = QN / 8, DIAG_LEN = QN + 16;
static float sdiag[4][{max(len(terms), 1)} * DIAG_LEN];
struct Step {{ int kw0, qw0, b, h; }};
static const Step steps[] = {{
{rows}}};
static void run(const Step& st, long& n, long& bad{decl}) {{
    const int kw0 = st.kw0, qw0 = st.qw0, b = st.b, h = st.h, h_kv = h / 4;
    const int batch = 2, heads_q = 8, heads_kv = 2, seqlen_q = {SQ}, seqlen_k = {SK};
    const float softmax_scale = 0.125f;
    (void)b; (void)h; (void)h_kv; (void)batch; (void)heads_q; (void)heads_kv;
    for (int warp = 0; warp < 4; ++warp)
        for (int lane = 0; lane < 32; ++lane)
{_stage_loop("QN", f, stores)}    for (int warp = 0; warp < 4; ++warp)
        for (int lane = 0; lane < 32; ++lane) {{
            const int base = {f['base']};
            const int key_raw = kw0 + warp * 16 + lane / 4;
            for (int j = 0; j < NQ; ++j)
                for (int r = 0; r < 2; ++r)
                    for (int e = 0; e < 2; ++e) {{
                    const int q_idx = qw0 + j * 8 + (lane % 4) * 2 + e, kv_idx = key_raw + 8 * r;
                    const float q_idx_f = (float)q_idx, kv_idx_f = (float)kv_idx;
                    (void)q_idx_f; (void)kv_idx_f;
                    const float score = (float)((q_idx * 131 + kv_idx * 71) % 97 - 48) * 0.37f;
                    const float direct = (float)({ctx['score_mod_expr']});
                    const float gdirect = (float)({ctx['score_grad_expr']});
{reads}                    const float staged = (float)({ctx['score_mod_expr_diag']});
                    const float gstaged = (float)({ctx['score_grad_expr_diag']});
                    ++n;
                    if (f2i(direct) != f2i(staged) || f2i(gdirect) != f2i(gstaged)) {{
                        if (bad < 5) printf("kw0 %d qw0 %d warp %d lane %d j %d r %d e %d\\n",
                                            kw0, qw0, warp, lane, j, r, e);
                        ++bad;
                    }}
                }}
        }}
}}
int main() {{
{init}    long n = 0, bad = 0;
    for (const Step& st : steps) run(st, n, bad{args});
    printf("%ld %ld\\n", n, bad);
}}
"""


def _bwd_plan(spec, **kw):
    return hopper_bwd.plan(spec, "sm_90", hopper_bwd.Options(diag_terms=True, **kw)).unit


@pytest.mark.parametrize("mod, count", DIAGONAL)
def test_backward_staged_diagonals_equal_the_per_element_code_on_the_host(mod, count, cxx_exe):
    """The Hopper backward's steps that are not edges: each pair's score_mod and d score_mod /
    d score from the staged slots equal the per-element code's bits (64- and 128-query
    steps at head_dim 64)."""
    spec = spec_for(mod)
    for block_m in (64, 128):
        unit = _bwd_plan(spec, d64_block_m=block_m)
        ctx = unit.context
        assert len(ctx["diag_terms"]) == count
        f = _bwd_formulas(render(unit))
        rng = random.Random(block_m + count)
        steps = [(0, 0, 0, 0), (SK - 64, SQ - block_m, 1, 7)]
        steps += [(rng.randrange(0, SK - 63), rng.randrange(0, SQ - block_m + 1), rng.randrange(2),
                   rng.randrange(8)) for _ in range(4)]  # fmt: skip
        src = _bwd_program(spec, ctx, f, steps, {"p": 0.25})
        exe = cxx_exe(src, f"bdiag{block_m}_{count}_{abs(hash(mod))}")
        out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, check=True)
        n, bad = (int(v) for v in out.stdout.split()[-2:])
        assert n == len(steps) * 64 * block_m and bad == 0, out.stdout


def test_a_backward_slot_one_query_off_is_caught(cxx_exe):
    spec = spec_for(DIAGONAL[0][0])
    unit = _bwd_plan(spec, d64_block_m=128)
    f = _bwd_formulas(render(unit))
    f["slot"] = f["slot"].replace("- e", "+ e")
    exe = cxx_exe(_bwd_program(spec, unit.context, f, [(0, 0, 0, 0)], {"p": 0.25}), "bdiag_mut")
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, check=True)
    assert int(out.stdout.split()[-1]) > 0


def test_t5_backward_with_diagonal_terms_builds_128_query_steps_without_spills(requires_nvcc):
    """The default t5_bias unit spills 56 bytes at 128-query steps (and falls back to 64);
    with its table staged per diagonal it does not."""
    from flashgen.build import cache

    unit = _bwd_plan(shipped("t5_bias"), d64_block_m=128)
    assert "__shared__ float sDiag[8 * 1 * DIAG_LEN]" in render(unit)
    _, report = cache.get_or_build(render(unit), unit)
    assert report.spill_bytes == 0


@pytest.mark.parametrize("name", ["causal_d128", "alibi", "gemma2_softcap", "bidir_d256"])
def test_backward_specs_without_diagonal_terms_render_unchanged(name):
    spec = shipped(name)
    assert render(_bwd_plan(spec)) == render(hopper_bwd.plan(spec, "sm_90", BWD_OFF).unit)


# ----------------------------------------------------------------------------- no room
def _t5(head_dim: int):
    return loads_spec(
        f"name: t5_d{head_dim}\nhead_dim: {head_dim}\ndtype: bf16\nscore_mod: "
        f"'score + bias[h, min(max(kv_idx - q_idx, -128), 128) + 128]'\n{PARAMS}",
        f"t5_d{head_dim}.yaml",
    )


@pytest.mark.parametrize(
    "head_dim, kw",
    [(256, {}), (256, {"persistent": "static"}), (128, {"persistent": "static"}),
     (128, {"persistent": "dynamic"}), (128, {"persistent": "m_major"})],
)  # fmt: skip
def test_forward_without_room_for_the_slots_renders_as_the_option_off(head_dim, kw):
    """The slots (BLOCK_N + 16 words per consumer warp and term) do not fit next to head_dim
    256's tiles, nor the persistent head_dim 128's with its own O staging: the kernel keeps
    the per-element form (this raised ValueError, so that an op or ``flashgen build`` of such
    a spec failed with the option on; a mask that reads tensors routes head_dim 128 to the
    persistent kernel by default)."""
    spec = _t5(head_dim)
    on = hopper_fwd.plan(spec, "sm_90", hopper_fwd.Options(diag_terms=True), **kw)
    off = hopper_fwd.plan(spec, "sm_90", FWD_OFF, **kw)
    assert on.context["diag_terms"] == [] and on.smem_bytes == off.smem_bytes
    assert render(on) == render(off)


def test_forward_head_dim_128_keeps_the_slots_where_they_fit():
    spec = _t5(128)
    on = hopper_fwd.plan(spec, "sm_90", hopper_fwd.Options(diag_terms=True))
    assert len(on.context["diag_terms"]) == 1
    assert on.smem_bytes == hopper_fwd.plan(spec, "sm_90", FWD_OFF).smem_bytes + 16 * 2 * (
        on.context["block_n"] + 16
    )


def test_backward_80_query_steps_without_room_render_as_the_option_off():
    """head_dim 128's 80-query steps leave 720 bytes for 3 KiB of slots: the per-element form
    (this raised ValueError before the 64-query candidate was tried); 64-query steps stage."""
    spec = _t5(128)
    on = _bwd_plan(spec)
    assert on.context["diag_terms"] == [] and on.context["block_m"] == 80
    assert render(on) == render(hopper_bwd.plan(spec, "sm_90", BWD_OFF).unit)
    assert len(_bwd_plan(spec, d128_block_m=64).context["diag_terms"]) == 1
