"""flashgen.analysis.affine: which score_mods decompose as score + L (L affine in q_idx, kv_idx with
CTA-invariant coefficients), the identity L(q, kv) == L(q, n0) + beta * (kv - n0) in float64
from the IR, the lowered CUDA expressions (``lower.affine_context``) evaluated on the host
exactly as the Hopper forward's FULL tiles use them, and the rendered kernels."""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from host_cxx import preamble, scalar_params  # noqa: E402
from plan_helpers import plan_forward  # noqa: E402

from flashgen.analysis import affine  # noqa: E402
from flashgen.build.render import render  # noqa: E402
from flashgen.codegen.cuda_expr import Invariants  # noqa: E402
from flashgen.families.common import affine_context  # noqa: E402
from flashgen.frontend.spec import load_spec, loads_spec  # noqa: E402
from flashgen.ops.cpu.reference import _env, eval_expr  # noqa: E402
from flashgen.options import Options  # noqa: E402

PARAMS = (
    "params:\n"
    "  slopes: {type: f32, shape: [num_heads]}\n"
    "  wkv: {type: f32, shape: [num_heads_kv]}\n"
    "  bias: {type: f32, shape: [num_heads, 64]}\n"
    "  tab: {type: f32, shape: [batch, num_heads]}\n"
    "  p: {type: f32, default: 0.25}\n"
    "  n: {type: i32, default: 3}\n"
    "  softcap: {type: f32, default: 30.0}\n"
)

# score_mods with an affine form
# fmt: off
AFFINE = [
    "score - slopes[h] * (q_idx + seqlen_k - seqlen_q - kv_idx)",  # ALiBi
    "score + 0.125 * (kv_idx - q_idx)",
    "score - slopes[h] * (q_idx - kv_idx) + p",
    "score - wkv[h_kv] * (q_idx - kv_idx)",
    "q_idx - kv_idx + score",
    "-(kv_idx * n) + score - p * q_idx",
    "score + (q_idx - kv_idx) / 4.0",
    "score + (kv_idx - q_idx) / (p + 1.0) + tab[b, h] * kv_idx",
    "score + slopes[h]",
    "score + seqlen_k / n * kv_idx - 7",
    "score + p * (n * (q_idx - 2 * kv_idx) + seqlen_q)",
    # float division by an int divisor of an int coefficient (beta = -1 / n: a float division)
    "score + (q_idx * 1.0 - kv_idx) / n",
    "score + (kv_idx * n + 0.0) / seqlen_k",
    # int terms the score_mod adds to a float one by one (their int sum would wrap)
    "score + q_idx * 1000000 + kv_idx * 500000",
    # int coefficients the score_mod multiplies in float (500000 * (n * 1000) would wrap)
    "score + (kv_idx * 500000 + 0.5) * (n * 1000)",
]
# score_mods without one
NOT_AFFINE = [
    "score + bias[h, kv_idx - q_idx + 32]",     # a tensor indexed by a per-element index
    "softcap * tanh(score / softcap)",
    "score * 2 + q_idx",                        # score's coefficient is not 1
    "score + score + q_idx",
    "-score + q_idx",
    "score / p + q_idx",
    "score + q_idx * kv_idx",                   # not linear
    "score + (q_idx - kv_idx) / 4",             # integer division truncates
    "score + abs(q_idx - kv_idx)",
    "score + (q_idx >= kv_idx ? 0.0 : -1.0)",
    "score",                                    # no offset: nothing to gain
    "max(score, 0.0) + q_idx",
    "score + slopes[h] * slopes[h] * kv_idx + slopes[q_idx]",
]
# fmt: on


SPEC_DIR = Path(__file__).resolve().parents[2] / "specs"


def spec_for(mod: str, name: str = "t"):
    return loads_spec(
        f"name: {name}\nhead_dim: 64\ndtype: bf16\nscore_mod: '{mod}'\n{PARAMS}", f"{name}.yaml"
    )


def test_alibi_is_affine_with_the_slope_as_kv_coefficient():
    spec = load_spec(SPEC_DIR / "alibi.yaml")
    form = affine.decompose(spec.score_mod, spec)
    assert form is not None
    ctx = affine_context(spec, Invariants(raw_score="score_raw"))
    assert ctx["kv_coef"] == "t_slopes[(int64_t)(h)]"  # h is in range: no clamp
    assert "kv_idx_f" in ctx["offset"] and "score" not in ctx["offset"]


@pytest.mark.parametrize("mod", AFFINE)
def test_affine_score_mods_are_recognised(mod):
    spec = spec_for(mod)
    assert affine.decompose(spec.score_mod, spec) is not None


@pytest.mark.parametrize("mod", NOT_AFFINE)
def test_other_score_mods_are_not(mod):
    spec = spec_for(mod)
    assert affine.decompose(spec.score_mod, spec) is None
    assert affine_context(spec, Invariants(raw_score="score_raw")) is None


def test_no_score_mod_and_the_shipped_specs():
    """Of the shipped specs only alibi's score_mod is affine (t5_bias reads a bucket table,
    gemma2 soft-caps)."""
    found = {}
    for path in sorted(SPEC_DIR.glob("*.yaml")):
        spec = load_spec(path)
        found[spec.name] = affine.decompose(spec.score_mod, spec) is not None
    assert [n for n, ok in found.items() if ok] == ["alibi"]


def _values(spec, B, Hq, Hkv, gen):
    vals = {}
    for prm in spec.tensor_params:
        shape = {"batch": B, "num_heads": Hq, "num_heads_kv": Hkv}
        vals[prm.name] = torch.randn([shape.get(d, d) for d in prm.shape], generator=gen)
    vals["p"], vals["n"] = 0.37, 5
    return vals


@pytest.mark.parametrize("mod", AFFINE)
def test_offset_splits_at_the_tile_start_float64(mod):
    """L(q, kv) == L(q, n0) + beta * (kv - n0) and alpha is L's q_idx coefficient, for random
    (b, h, q, kv, n0) in float64, and score_mod == score + L."""
    spec = spec_for(mod)
    form = affine.decompose(spec.score_mod, spec)
    B, Hq, Hkv, Sq, Sk = 2, 8, 2, 300, 1000
    gen = torch.Generator().manual_seed(len(mod))
    env = _env(spec, B, Hq, Sq, Sk, _values(spec, B, Hq, Hkv, gen), "cpu", torch.float64, Hkv=Hkv)
    q = torch.randint(0, Sq, (1, 1, Sq, 1), generator=gen)
    kv = torch.randint(0, Sk, (1, 1, 1, 64), generator=gen)
    n0 = (kv // 160) * 160
    score = torch.randn(B, Hq, Sq, 64, generator=gen, dtype=torch.float64) * 10

    env_at = lambda qi, ki: {**env, "q_idx": qi, "kv_idx": ki, "score": score}  # noqa: E731
    shape = score.shape

    def ev(e, qi, ki):
        return eval_expr(e, env_at(qi, ki)).double().expand(shape)

    full = ev(form.offset, q, kv)
    split = ev(form.offset, q, n0)
    beta, alpha = ev(form.kv_coef, q, kv), ev(form.q_coef, q, kv)
    torch.testing.assert_close(full, split + beta * (kv - n0), rtol=1e-12, atol=1e-9)
    at0 = ev(form.offset, torch.zeros_like(q), kv)
    torch.testing.assert_close(full, at0 + alpha * q, rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(ev(spec.score_mod, q, kv), score + full, rtol=1e-12, atol=1e-9)


# ----------------------------------------------------------------------------- host C++
SQ, SK = 1000, 4097
N = 400


def _program(cases) -> str:
    """Per case: the kernel's FULL-tile arithmetic (affine_context's expressions, the
    template's locals) and the score_mod itself, both printed per sample."""
    from flashgen.codegen.cuda_expr import cuda_expr

    funcs, calls = [], []
    for i, (spec, values, samples) in enumerate(cases):
        inv = Invariants(raw_score="score_raw")
        ctx = affine_context(spec, inv)
        mod = cuda_expr(spec.score_mod, spec, inv)
        decl, args = scalar_params(spec, values)
        tensors = "".join(f"static float t_{p.name}[64];\n" for p in spec.tensor_params)
        funcs.append(
            f"namespace c{i} {{\n{tensors}"
            f"static void run(float score_raw, float softmax_scale, int q_idx, int kv, int n0, "
            f"int lane4, int b, int h, int h_kv, int batch, int heads_q, int heads_kv, "
            f"int seqlen_q, int seqlen_k{decl}) {{\n"
            "    (void)b; (void)h; (void)h_kv; (void)batch; (void)heads_q; (void)heads_kv;\n"
            "    (void)seqlen_q; (void)seqlen_k;\n"
            f"    {inv.prologue}\n"
            "    float d, col;\n"
            "    {  // the template: kv_idx := n0 for the row offset\n"
            "        const int kv_idx = n0;\n"
            "        const float q_idx_f = (float)q_idx, kv_idx_f = (float)kv_idx;\n"
            "        (void)kv_idx; (void)q_idx_f; (void)kv_idx_f;\n"
            f"        d = (float)({ctx['offset']});\n"
            f"        const float aff_beta = (float)({ctx['kv_coef']});\n"
            "        const float aff_c0 = aff_beta * (float)(lane4 * 2);\n"
            "        col = fmaf(aff_beta, (float)(kv - n0 - lane4 * 2), aff_c0);\n"
            "    }\n"
            "    const float xp = fmaf(score_raw, softmax_scale, col);\n"
            "    const int kv_idx = kv;\n"
            "    const float q_idx_f = (float)q_idx, kv_idx_f = (float)kv_idx;\n"
            "    (void)q_idx_f; (void)kv_idx_f;\n"
            "    const float score = score_raw * softmax_scale;\n"
            "    (void)score;\n"
            f"    const float x = (float)({mod});\n"
            '    printf("%.9g %.9g %.9g\\n", xp, d, x);\n'
            "}\n}\n"
        )
        init = "".join(
            f"    for (int t = 0; t < 64; ++t) c{i}::t_{p.name}[t] = {values['__tensor__']}f * "
            f"(float)((t * 37) % 11 - 5);\n"
            for p in spec.tensor_params
        )
        calls.append(init)
        # the samples as data (a call statement per sample made a main the host compiler
        # took seconds over)
        rows = []
        for q, kv, n0, raw, b, h in samples:
            lane4 = (kv - n0) % 8 // 2  # the lane % 4 holding column kv - n0
            rows.append(f"{{{raw!r}f, {q}, {kv}, {n0}, {lane4}, {b}, {h}}},")
        funcs.append(f"static const Sample samples_{i}[] = {{\n" + "\n".join(rows) + "\n};\n")
        calls.append(
            f"    for (const Sample& x : samples_{i})\n"
            f"        c{i}::run(x.raw, 0.08838834764831845f, x.q, x.kv, x.n0, x.lane4, x.b, "
            f"x.h, x.h / 4, 2, 8, 2, {SQ}, {SK}{args});\n"
        )
    sample = "struct Sample { float raw; int q, kv, n0, lane4, b, h; };\n"
    return preamble() + sample + "".join(funcs) + "int main() {\n" + "".join(calls) + "}\n"


def _samples(seed: int):
    rng = random.Random(seed)
    out = []
    for _ in range(N):
        n0 = rng.randrange(0, SK - 160, 16)
        kv = n0 + rng.randrange(160)
        q = rng.randrange(SQ)
        out.append((q, kv, n0, rng.uniform(-80.0, 80.0), rng.randrange(2), rng.randrange(8)))
    return out


def _reference64(spec, values, samples) -> torch.Tensor:
    """The score_mod in float64 at each sample (score = float32(raw * scale), the host's
    tensor values), as tests/unit/test_score_mod_host.py does."""
    table = torch.tensor([values["__tensor__"] * ((t * 37) % 11 - 5) for t in range(64)])
    shapes = {"slopes": (8,), "wkv": (2,), "bias": (8, 64), "tab": (2, 8)}
    params = {k: v for k, v in values.items() if not k.startswith("__")}
    for prm in spec.tensor_params:
        n = 1
        for d in shapes[prm.name]:
            n *= d
        params[prm.name] = table[:n].reshape(shapes[prm.name]) if n <= 64 else table
    env = _env(spec, 2, 8, SQ, SK, params, "cpu", torch.float64, Hkv=2)
    col = lambda i: torch.tensor([s[i] for s in samples])  # noqa: E731
    f32 = torch.float32
    score = (col(3).to(f32) * torch.tensor(0.08838834764831845, dtype=f32)).double()
    env.update(q_idx=col(0), kv_idx=col(1), b=col(4), h=col(5), h_kv=col(5) // 4, score=score)
    return eval_expr(spec.score_mod, env).double().expand(len(samples))


def test_lowered_offsets_reproduce_the_score_mod_on_the_host(cxx_exe):
    """The kernel's FULL-tile x' + L(q, n0) (float32, host) against the float64 score_mod:
    no further off than twice the kernel's plain score_mod code plus a few ulps of the
    result, for every :data:`AFFINE` case (tensors of small integers times 0.3)."""
    cases = []
    for i, mod in enumerate(AFFINE):
        spec = spec_for(mod, f"c{i}")
        cases.append((spec, {"p": 0.37, "n": 5, "softcap": 30.0, "__tensor__": 0.3}, _samples(i)))
    exe = cxx_exe(_program(cases), "affine")
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, check=True)
    rows = torch.tensor([[float(v) for v in line.split()] for line in out.stdout.splitlines()])
    assert rows.shape == (N * len(cases), 3)
    for i, (spec, values, samples) in enumerate(cases):
        xp, d, x = rows[i * N : (i + 1) * N].double().unbind(1)
        want = _reference64(spec, values, samples)
        got = xp + d
        tol = 2 * (x - want).abs() + 16 * 2.0**-24 * (want.abs() + d.abs() + 80.0)
        bad = ((got - want).abs() > tol).nonzero().flatten()
        assert len(bad) == 0, (
            f"{AFFINE[i]!r}: {len(bad)} of {N} differ; first {samples[bad[0]]}: x' + d = "
            f"{float(got[bad[0]])!r}, score_mod code {float(x[bad[0]])!r}, "
            f"float64 {float(want[bad[0]])!r}"
        )


# ----------------------------------------------------------------------------- rendering
def test_the_hopper_forward_takes_the_affine_path_for_alibi(monkeypatch):
    spec = load_spec(SPEC_DIR / "alibi.yaml")
    plan = plan_forward(spec, "sm_90")
    assert plan.template == "sm_90/fwd.cu.j2" and plan.context["affine"] is not None
    src = render(plan)
    assert "aff_d[r] = (float)(" in src
    assert "fmaf(acc_s[4 * j + 2 * r + e], softmax_scale, col)" in src
    assert "fmaf(acc_s[4 * j + 2 * r + e], LOG2E, shift)" in src
    plain = plan_forward(spec, "sm_90", affine=False)
    assert plain.context["affine"] is None and "aff_d" not in render(plain)


@pytest.mark.parametrize("name", ["gemma2_softcap", "t5_bias", "causal_d128"])
def test_other_specs_render_without_it(name):
    plan = plan_forward(load_spec(SPEC_DIR / f"{name}.yaml"), "sm_90")
    assert plan.context["affine"] is None and "aff_d" not in render(plan)


def test_the_fa2_forward_takes_it_too(monkeypatch):
    spec = load_spec(SPEC_DIR / "alibi.yaml")
    for target, family in (("sm_80", "auto"), ("sm_90", "fa2")):
        plan = plan_forward(spec, target, family=family)
        assert plan.template == "sm_80/fwd.cu.j2" and plan.context["affine"] is not None
        src = render(plan)
        assert "fmaf(acc_s[mt][nt][2 * r + e], scale_log2, col)" in src
        assert "exp2_approx(acc_s[mt][nt][2 * r + j] - shift)" in src
    assert "aff_d" not in render(plan_forward(spec, "sm_80", affine=False))


SPILLS_WITH_SPLIT = """\
name: affine_spill
head_dim: 128
dtype: bf16
mask: causal && q_idx - kv_idx < win
score_mod: q_idx - kv_idx + score
params:
  win: {type: i32, default: 256}
"""


def test_a_spilling_split_is_retried_without_it(requires_nvcc, monkeypatch):
    """The FA2-class kernel on sm_90 at 128 x 32 spills 56 bytes with this spec's split
    (ptxas 13.0) and none without: select.build_forward keeps the tiles, drops the split.
    (In head-major CTA order: with the head groups' prologue neither spills.)"""
    from flashgen.build import cache
    from flashgen.families.build import build_forward

    spec = loads_spec(SPILLS_WITH_SPLIT, "affine_spill.yaml")
    split = plan_forward(spec, "sm_90", family="fa2", head_groups=False)
    _, report = cache.get_or_build(render(split), split)
    if not report.spill_bytes:
        pytest.skip("this ptxas does not spill the split kernel")
    options = Options(family="fa2").with_values(
        {"fa2_fwd.head_groups": False, "hopper_fwd.head_groups": False}
    )
    plan, _, report = build_forward(spec, "sm_90", options=options)
    assert not report.spill_bytes and plan.tiles == split.tiles
    assert plan.context["affine"] is None
