"""``hopper_bwd.dparam_affine``: param gradients of per-CTA terms whose d score_mod / d param is
affine in the pair's indices (ALiBi's trainable slopes) summed in the Hopper backward's dS^T
pass from three sums of dS per thread and step (templates/common/dparam_affine.j2), on the
steps of the unit without param gradients.  Which terms take it, what the plans and units
become with it on and off, its sums against the per-pair form on the host, and (with nvcc)
its units spill-free.  The numbers on a GPU: tests/gpu/test_dparam_affine_gpu.py."""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from dparam_affine_cases import affine_spec
from dparam_cases import form_spec
from sass_helpers import sass

from flashgen.build.render import environment, render
from flashgen.codegen import dparam
from flashgen.families import registry
from flashgen.families.build import _hopper_backward_candidates, build_backward
from flashgen.families.common import HOPPER_SMEM_LIMIT
from flashgen.families.hopper_bwd import Options as HopperBwdOptions
from flashgen.families.hopper_bwd import affine_slots
from flashgen.frontend.spec import load_spec
from flashgen.options import DEFAULT

REPO = Path(__file__).resolve().parents[2]
AFFINE = DEFAULT.replace_path("hopper_bwd.dparam_affine", True)

def _grads(spec) -> tuple[str, ...]:
    return registry.grad_params(spec)


def test_the_option_is_off_by_default_and_takes_a_bool_only():
    assert HopperBwdOptions().dparam_affine is False
    assert DEFAULT.hopper_bwd.dparam_affine is False
    with pytest.raises(ValueError, match=r"hopper_bwd\.dparam_affine=1: expected a bool"):
        DEFAULT.replace_path("hopper_bwd.dparam_affine", 1)
    assert "hopper_bwd.dparam_affine" in DEFAULT.paths()


def test_only_per_cta_terms_with_an_affine_partial_and_a_unit_score_gradient_qualify():
    """ALiBi's ``-(q_idx + seqlen_k - seqlen_q - kv_idx)`` (coefficients -1 and 1), a float
    coefficient that reads (b, h), a coefficient that is another param, a constant partial
    (a per-(batch, head) bias): affine.  ``abs(q_idx - kv_idx)`` (alibi_learned), a per-key or
    per-query read, and a score_mod whose d / d score is not 1 (``temp * score``): not."""
    alibi = load_spec(REPO / "specs" / "alibi.yaml")
    (t,) = dparam.affine_fields(alibi, ("slopes",))
    assert (t["q_coef"], t["kv_coef"]) == ("((float)(-1))", "((float)(1))")
    assert t["partial"] == "(-(((q_idx + seqlen_k) - seqlen_q) - kv_idx))"
    scaled = affine_spec("slope_scaled_bias")
    got = {t["param"]: (t["q_coef"], t["kv_coef"])
           for t in dparam.affine_fields(scaled, _grads(scaled))}  # fmt: skip
    assert got == {"s": ("(-p_g)", "p_g"), "g": ("(-t_s[(int64_t)(h)])", "t_s[(int64_t)(h)]"),
                   "c": (None, None)}  # fmt: skip
    assert dparam.affine_fields(form_spec("per_batch_head"), ("bb",))[0]["partial"] == "1.0f"
    learned = load_spec(REPO / "specs" / "alibi_learned.yaml")
    assert dparam.affine_fields(learned, ("slopes",)) is None
    for form in ("per_head", "per_key", "per_query", "relative_table", "scalars", "two_reads"):
        spec = form_spec(form)
        assert dparam.affine_fields(spec, _grads(spec)) is None, form


def test_with_the_option_off_the_trained_unit_is_the_per_pair_one_at_64_query_steps():
    grad = registry.plan_hopper_backward(
        load_spec(REPO / "specs" / "alibi.yaml"), "sm_90", param_grads=("slopes",)
    )
    ctx = grad.dkdv.context
    assert ctx.block_m == 64 and not ctx.dq_swap and ctx.dparam_affine == []
    src = render(grad.unit)
    assert "dpx_" not in src and "dparam_affine" not in src
    assert "fg::wgmma_wait<0>();  // S^T and dP^T have landed" in src


def test_with_the_option_alibi_trains_on_the_detached_units_steps():
    """alibi at head_dim 128 with trainable slopes: 80-query steps (dQ^T by stmatrix, as the
    detached unit), the P^T pass of the detached unit (it waits for S^T only, dP^T still
    running), and the slopes' sums in the dS^T pass; the detached unit renders the same CUDA
    with the option on and off."""
    alibi = load_spec(REPO / "specs" / "alibi.yaml")
    plain = render(registry.plan_hopper_backward(alibi, "sm_90").unit)
    assert plain == render(registry.plan_hopper_backward(alibi, "sm_90", AFFINE).unit)
    grad = registry.plan_hopper_backward(alibi, "sm_90", AFFINE, param_grads=("slopes",))
    ctx = grad.dkdv.context
    assert ctx.block_m == 80 and ctx.dq_swap and ctx.ds_from_frag and not ctx.dparam_terms
    assert [t["param"] for t in ctx.dparam_affine] == ["slopes"]
    src = render(grad.unit)
    assert "fg::wgmma_wait<1>();  // S^T has landed; dP^T may still run" in src
    assert "S^T and dP^T have landed" not in src and "dse[e]" not in src
    assert "dpx_q = fmaf((float)(8 * j + e), c, dpx_q);" in src
    # 720 bytes are left in this layout: 16 slots a warp (one shuffle a step), before the
    # CTA's coordinates at the end of the dynamic shared memory
    assert ctx.dparam_affine[0]["shift"] == 1
    assert "dpx_t0 += __shfl_xor_sync(0xffffffffu, dpx_t0, 1);" in src
    assert "if (lane % 2 == 0) dp_cta0[fg::iv::opaque((int)(threadIdx.x)) / 2] += dpx_t0;" in src
    assert "atomicAdd(dp_slopes + (int64_t)(blockIdx.x) * dps_slopes + ((int64_t)(h)), s);" in src
    slots = ctx.dparam_affine[0]["slots"]
    assert slots == grad.dkdv.smem_bytes - 6 * 4 - 8 * 16 * 4
    assert grad.dkdv.smem_bytes <= HOPPER_SMEM_LIMIT and f"smem_raw + {slots})" in src
    assert grad.dkdv.kernel_name.endswith("_dkdv_dparam")
    dp_args = [a.name for a in grad.dkdv.args if a.name.startswith("dp")]
    assert dp_args == ["dp_slopes", "dps_slopes"]


def test_the_slots_take_the_fewest_shuffles_that_fit():
    """``affine_slots``: 32 slots a warp (no shuffle) where 1 KiB a term fits, fewer (one
    shuffle per halving) where less is left, one a warp at the least; the 64-query layouts have
    room for 32, head_dim 128's 80-query one for 16 with one term and 8 with two."""
    assert [affine_slots(1, b) for b in (1024, 1023, 512, 256, 128, 32, 0)] == [0, 1, 1, 2, 3, 5, 5]
    assert affine_slots(2, 720) == 2 and affine_slots(3, 720) == 3
    for form, m, shift in (("slope_head", 80, 1), ("slope_scaled_bias", 64, 0)):
        spec = affine_spec(form)
        o = AFFINE.replace_path("hopper_bwd.d128_block_m", m)
        ctx = registry.plan_hopper_backward(spec, "sm_90", o, param_grads=_grads(spec)).dkdv.context
        assert ctx.block_m == m and {t["shift"] for t in ctx.dparam_affine} == {shift}, form
    spec = affine_spec("slope_scaled_bias")  # three terms at 80 queries: 4 slots a warp
    plan = registry.plan_hopper_backward(spec, "sm_90", AFFINE, param_grads=_grads(spec))
    ctx = plan.dkdv.context
    assert ctx.block_m == 80 and [t["shift"] for t in ctx.dparam_affine] == [3, 3, 3]
    assert len({t["slots"] for t in ctx.dparam_affine}) == 3


def test_the_option_keeps_the_other_forms_and_deterministic_calls_as_they_were():
    """A term that is not affine per CTA keeps the per-pair form with the option on (the same
    unit as with it off); ``deterministic=True`` with param grads still runs the FA2-class
    kernels (their per-CTA rows are the ordered form), and the ordered Hopper plan refuses
    param grads."""
    from flashgen.ops.prefill.backward import backward_path

    for spec in (load_spec(REPO / "specs" / "alibi_learned.yaml"), form_spec("per_head"),
                 form_spec("per_key", 64)):  # fmt: skip
        g = _grads(spec)
        off = render(registry.plan_hopper_backward(spec, "sm_90", param_grads=g).unit)
        on = render(registry.plan_hopper_backward(spec, "sm_90", AFFINE, param_grads=g).unit)
        assert on == off, spec.name
    alibi = load_spec(REPO / "specs" / "alibi.yaml")
    assert backward_path(alibi, "sm_90", False, AFFINE, param_grads=("slopes",)) == "hopper"
    assert backward_path(alibi, "sm_90", True, AFFINE, param_grads=("slopes",)) == "deterministic"
    with pytest.raises(ValueError, match="without ordered_dq"):
        registry.hopper_bwd.plan(alibi, "sm_90", AFFINE.hopper_bwd, ordered_dq=True,
                                 param_grads=("slopes",))  # fmt: skip


def test_the_build_tries_the_affine_steps_then_the_per_pair_form():
    alibi = load_spec(REPO / "specs" / "alibi.yaml")
    got = [(o.hopper_bwd.d128_block_m, o.hopper_bwd.dparam_affine)
           for o in _hopper_backward_candidates(alibi, AFFINE, ("slopes",))]  # fmt: skip
    assert got == [(80, True), (64, True), (80, False), (64, False)]
    # a unit the option does not shape (no param gradients, or a term it does not take) is
    # not tried twice
    assert len(_hopper_backward_candidates(alibi, AFFINE)) == 2
    learned = load_spec(REPO / "specs" / "alibi_learned.yaml")
    assert len(_hopper_backward_candidates(learned, AFFINE, ("slopes",))) == 2
    assert [o.hopper_bwd.dparam_affine for o in _hopper_backward_candidates(alibi, DEFAULT)] == [
        False, False]  # fmt: skip


#: The host program's params and sizes: every name a partial or a coefficient may read.
_HOST_PRELUDE = """
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
static float t_s[8], t_bb[16], t_c[16], t_slopes[8];
static float p_g = 0.75f;
static const int batch = 2, heads_q = 8, heads_kv = 2;
"""


def _host_case(form: str, spec) -> str:
    """A host block: for spec ``spec`` (its terms' entries) at several sizes, every lane of a
    consumer warp, random dS on the thread's 2 x NQ x 2 pairs (0 on pairs past the lengths,
    as P is there), the dS^T pass's macros as rendered for the kernel against the per-pair sum
    of dS times the term's partial (the per-pair form's expression, evaluated in double)."""
    terms = dparam.affine_fields(spec, _grads(spec))
    env = environment()
    macros = env.from_string(
        '{% from "common/dparam_affine.j2" import affine_begin, affine_pair, affine_step '
        "with context %}"
        '{{ affine_begin("") }}\n'
        "for (int j = 0; j < NQ; ++j)\n    for (int e = 0; e < 2; ++e) {\n"
        '{{ affine_pair("acc_dp[4 * j + e]", "acc_dp[4 * j + 2 + e]", "8 * j + e", "        ") }}\n'
        "    }\n"
        '{{ affine_step("qw0 + (lane % 4) * 2", "key_raw", "") }}\n'
    ).render(dparam_affine=terms)
    checks = []
    for t in terms:
        checks.append(f"""
            {{
                double ref = 0.0, mag = 0.0;
                for (int j = 0; j < NQ; ++j)
                    for (int r = 0; r < 2; ++r)
                        for (int e = 0; e < 2; ++e) {{
                            const int q_idx = qw0 + 8 * j + 2 * (lane % 4) + e;
                            const int kv_idx = key_raw + 8 * r;
                            const float q_idx_f = (float)q_idx, kv_idx_f = (float)kv_idx;
                            (void)q_idx_f; (void)kv_idx_f;
                            const float partial = (float)({t["partial"]});
                            const double term = (double)acc_dp[4 * j + 2 * r + e] * partial;
                            ref += term;
                            mag += std::fabs(term);
                        }}
                const double err = std::fabs((double)dpx_t{t["k"]} - ref);
                if (err > 1e-5 * mag + 1e-30) {{
                    printf("MISMATCH {form} {t["param"]} NQ %d h %d q %d k %d lane %d: %g vs %g\\n",
                           NQ, h, qw0, key_raw, lane, (double)dpx_t{t["k"]}, ref);
                    ++bad;
                }}
                ++checked;
            }}""")
    return f"""
    for (int nq : {{8, 10, 16, 4}})  // 64-, 80-, 128-query steps; head_dim 256's query half
    for (int sizes = 0; sizes < 3; ++sizes) {{
        const int NQ = nq;
        const int seqlen_q = sizes == 0 ? 1000 : sizes == 1 ? 17 : 4097;
        const int seqlen_k = sizes == 0 ? 777 : sizes == 1 ? 1 : 4097;
        for (int b = 0; b < batch; ++b)
        for (int h = 0; h < heads_q; h += 3)
        for (int qw0 : {{0, 80, 960, 4032}})
        for (int kw0 : {{0, 64, 704, 4032}})
        for (int warp = 0; warp < 4; ++warp)
        for (int lane = 0; lane < 32; ++lane) {{
            const int key_raw = kw0 + warp * 16 + lane / 4;
            float acc_dp[64];
            for (int j = 0; j < NQ; ++j)
                for (int r = 0; r < 2; ++r)
                    for (int e = 0; e < 2; ++e) {{
                        const bool in = qw0 + 8 * j + 2 * (lane % 4) + e < seqlen_q
                                        && key_raw + 8 * r < seqlen_k;
                        acc_dp[4 * j + 2 * r + e] = in ? dist(rng) : 0.f;
                    }}
{macros}
{"".join(checks)}
        }}
    }}"""


def test_affine_sums_equal_the_per_pair_sums_on_the_host(cxx_exe):
    """The dS^T pass's sums (``affine_begin`` / ``affine_pair`` / ``affine_step`` as the kernel
    renders them) give each term's step sum of dS times d score_mod / d param: against the
    per-pair form's partial at every pair of the thread (the accumulator layout: element
    4 j + 2 r + e is query qw0 + 8 j + 2 (lane % 4) + e, key key_raw + 8 r), to 1e-5 of the
    sum of the terms' magnitudes, for ALiBi and the test specs (coefficients that are params,
    a constant partial), at each step width's NQ, with pairs past the lengths at dS = 0."""
    cases = [("alibi", load_spec(REPO / "specs" / "alibi.yaml"))]
    cases += [(f, affine_spec(f)) for f in ("slope_head", "slope_batch_head", "slope_scaled_bias")]
    body = "".join(_host_case(f, s) for f, s in cases)
    program = _HOST_PRELUDE + f"""
int main() {{
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> dist(-1.f, 1.f);
    for (float& x : t_s) x = dist(rng);
    for (float& x : t_bb) x = dist(rng);
    for (float& x : t_c) x = dist(rng);
    for (float& x : t_slopes) x = dist(rng);
    long checked = 0, bad = 0;
{body}
    printf("checked %ld bad %ld\\n", checked, bad);
    return bad != 0;
}}
"""
    exe = cxx_exe(program, "dparam_affine")
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:]
    checked = int(re.search(r"checked (\d+)", out.stdout).group(1))
    assert checked > 100_000


def _build(spec, options):
    return spec.name, build_backward(spec, "sm_90", hopper=True, options=options,
                                     param_grads=_grads(spec))  # fmt: skip


def test_affine_units_compile_spill_free_on_the_hopper_kernel(requires_nvcc):
    """With the option on, alibi and the test specs at head_dims 64 / 128 / 256 build the
    Hopper unit with the affine form and 0 spills: alibi, and the causal / unmasked specs at
    head_dim 128, at the detached unit's 80-query steps; the three-term one at the 64 its
    detached unit takes (``d128_block_m``'s fallback), the windowed one at 64 (or 80 with
    ``masked_80`` where its unit fits)."""
    specs = [load_spec(REPO / "specs" / "alibi.yaml")]
    specs += [affine_spec(f, d) for f in ("slope_head", "slope_batch_head") for d in (64, 128, 256)]
    specs += [affine_spec("slope_scaled_bias"), affine_spec("slope_window")]
    want_m = {"alibi": 80, "aff_slope_head_128": 80, "aff_slope_batch_head_128": 80,
              "aff_slope_scaled_bias_128": 64, "aff_slope_window_128": 64}  # fmt: skip
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda s: _build(s, AFFINE), specs))
    spilled = [f"{name}: {k}" for name, (_, _, report) in results for k in report.kernels
               if k.spill_bytes or k.wgmma_serialized]  # fmt: skip
    assert not spilled, "\n".join(spilled)
    affine = {name: plan.wgmma and bool(plan.dkdv.context.dparam_affine)
              for name, (plan, _, _) in results}  # fmt: skip
    assert all(affine.values()), affine
    steps = {name: plan.dkdv.context.block_m for name, (plan, _, _) in results if name in want_m}
    # the windowed spec takes 80 where masked_80 and its classifier fit the registers
    assert steps.pop("aff_slope_window_128") in (64, 80)
    assert steps == {n: m for n, m in want_m.items() if n != "aff_slope_window_128"}


def _dkdv_sass(plan) -> str:
    code = sass(plan.unit)
    code = code[code.index(f"Function : {plan.dkdv.kernel_name}"):]
    return code[: code.find("Function :", 20) if "Function :" in code[20:] else None]


def test_alibis_affine_unit_converts_no_index_per_pair(requires_nvcc):
    """The trained alibi unit (option on) against the detached one in SASS: no more
    integer-to-float conversions than the detached unit's plus the step's base pair (the
    per-pair form converted the partial at every pair: 116 I2FP against the detached 64 on
    nvcc 13.0), the same MUFU.EX2 (the P^T pass is the detached one), and one warp's shuffle
    reduction (5 SHFL.BFLY) per step besides the warpgroup index's SHFL.IDX."""
    alibi = load_spec(REPO / "specs" / "alibi.yaml")
    detached = _dkdv_sass(build_backward(alibi, "sm_90", hopper=True)[0])
    plan = build_backward(alibi, "sm_90", hopper=True, options=AFFINE, param_grads=("slopes",))[0]
    assert plan.dkdv.context.dparam_affine
    trained = _dkdv_sass(plan)

    def count(code, op):
        return len(re.findall(rf"\b{op}\b", code))

    assert count(trained, "I2FP.F32.S32") <= count(detached, "I2FP.F32.S32") + 2
    assert count(trained, "MUFU.EX2") == count(detached, "MUFU.EX2")
    assert count(trained, "SHFL.BFLY") == 5
