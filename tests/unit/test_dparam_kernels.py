"""Param gradients accumulated by the backward kernels (issue 37, templates/common/dparam.j2):
the units that compile the dparam code in, their routing and host buffers, and (with nvcc)
every index form compiled spill-free for sm_80 and sm_90a, FA2-class and Hopper.  The
numbers are checked on a GPU by tests/gpu/test_param_grads_sinks_gpu.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import covering as sweeps
import pytest
import torch
from dparam_cases import FORMS, form_spec
from sass_helpers import sass
from shipped_specs import fa2_backward_covering

from flashgen.build.render import render
from flashgen.codegen import dparam
from flashgen.families import registry
from flashgen.families.build import build_backward
from flashgen.frontend.spec import load_spec, loads_spec
from flashgen.ops.prefill.backward import backward_path, dparam_buffers, param_shapes

REPO = Path(__file__).resolve().parents[2]

def _grads(spec) -> tuple[str, ...]:
    return registry.grad_params(spec)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_index_form_has_its_reduction_form(form):
    spec = form_spec(form)
    got = tuple(t["form"] for t in dparam.fields(spec, _grads(spec))["dparam_terms"])
    assert got == FORMS[form][2]


def test_without_param_grads_the_units_render_as_before():
    """The dparam code is a unit of its own: a plan without params renders no dparam text,
    and one with them names its dK/dV kernel ..._dparam and takes dp_/dps_ arguments last."""
    spec = load_spec(REPO / "specs" / "alibi.yaml")
    for t in ("sm_80", "sm_90"):
        for atomic in (False, True):
            plain = render(registry.plan_backward(spec, t, atomic_dq=atomic).unit)
            assert "dparam" not in plain and "dp_slopes" not in plain
            grad = registry.plan_backward(spec, t, atomic_dq=atomic, param_grads=("slopes",))
            src = render(grad.unit)
            assert grad.dkdv.kernel_name.endswith("_dparam")
            assert [a.name for a in grad.dkdv.args[-2:]] == ["dp_slopes", "dps_slopes"]
            assert "atomicAdd(dp_slopes" in src
    plain = render(registry.plan_hopper_backward(spec, "sm_90").unit)
    assert "dparam" not in plain
    grad = registry.plan_hopper_backward(spec, "sm_90", param_grads=("slopes",))
    assert "dp_slopes" in render(grad.unit) and grad.dkdv.kernel_name.endswith("_dparam")
    # the TMA descriptors stay the last arguments
    assert grad.dkdv.args[-1].ctype == "CUtensorMap"


def test_routing_with_param_grads():
    """deterministic=True never takes the (ordered) Hopper kernel with param grads; the Hopper
    backward takes per-CTA, per-key and, with ``hopper_bwd.dparam_diagonal`` (on by default)
    at head_dim 64 / 256, relative-position forms; the others run the FA2-class
    kernels."""
    alibi = load_spec(REPO / "specs" / "alibi.yaml")
    t5 = load_spec(REPO / "specs" / "t5_bias.yaml")
    assert backward_path(alibi, "sm_90", False, param_grads=("slopes",)) == "hopper"
    assert backward_path(t5, "sm_90", False) == "hopper"
    assert backward_path(t5, "sm_90", False, param_grads=("bias",)) == "hopper"
    assert backward_path(t5, "sm_90", True, param_grads=("bias",)) == "deterministic"
    from flashgen.options import Options

    diag = Options().replace_path("hopper_bwd.dparam_diagonal", True)
    no_diag = Options().replace_path("hopper_bwd.dparam_diagonal", False)
    assert backward_path(t5, "sm_90", False, diag, param_grads=("bias",)) == "hopper"
    assert backward_path(t5, "sm_90", False, no_diag, param_grads=("bias",)) == "deterministic"
    full = form_spec("full_bias", 64)
    assert backward_path(full, "sm_90", False, diag, param_grads=("fb",)) == "deterministic"
    rel128 = form_spec("relative_table")  # head_dim 128: cta terms only
    assert backward_path(rel128, "sm_90", False, diag, param_grads=("rel",)) == "deterministic"
    ordered = Options().replace_path("hopper_bwd.ordered_dq", True)
    causal = load_spec(REPO / "specs" / "causal_d128.yaml")
    assert backward_path(causal, "sm_90", True, ordered) == "hopper_ordered"
    key = form_spec("per_key", 64)
    assert backward_path(key, "sm_90", True, ordered, param_grads=("kb",)) == "deterministic"
    assert backward_path(key, "sm_90", False, param_grads=("kb",)) == "hopper"
    # per key at head_dim 128: the Hopper consumers' registers do not hold it
    key128 = form_spec("per_key")
    assert backward_path(key128, "sm_90", False, param_grads=("kb",)) == "deterministic"
    head = form_spec("per_batch_head")
    assert backward_path(head, "sm_90", False, param_grads=("bb",)) == "hopper"
    # a shipped spec the ordered Hopper form takes: never with param grads (either d64_block_m)
    alibi_ordered = ordered.replace_path("hopper_bwd.d64_block_m", 128)
    for o in (ordered, alibi_ordered):
        assert backward_path(alibi, "sm_90", True, o) == "hopper_ordered"
        assert backward_path(alibi, "sm_90", True, o, param_grads=("slopes",)) == "deterministic"
        learned = load_spec(REPO / "specs" / "alibi_learned.yaml")  # head_dim 64, no mask
        assert backward_path(learned, "sm_90", True, o) == "hopper_ordered"
        assert backward_path(learned, "sm_90", True, o, param_grads=("slopes",)) == "deterministic"
    with pytest.raises(ValueError, match="FA2-class"):
        registry.plan_hopper_backward(t5, "sm_90", no_diag, param_grads=("bias",))
    with pytest.raises(ValueError, match="FA2-class"):
        registry.plan_hopper_backward(full, "sm_90", diag, param_grads=("fb",))


def test_compile_units_add_the_dparam_units_of_trainable_specs():
    alibi = load_spec(REPO / "specs" / "alibi.yaml")
    t5 = load_spec(REPO / "specs" / "t5_bias.yaml")
    sink = load_spec(REPO / "specs" / "gpt_oss_sink.yaml")  # the sink param: the op's epilogue
    causal = load_spec(REPO / "specs" / "causal_d128.yaml")
    assert {"bwd_dparam", "bwd_atomic_dparam", "bwd_wgmma_dparam"} <= set(
        registry.compile_units(alibi, "sm_90"))  # fmt: skip
    from flashgen.options import DEFAULT

    no_diag = DEFAULT.replace_path("hopper_bwd.dparam_diagonal", False)
    units = registry.compile_units(t5, "sm_90", no_diag)
    assert "bwd_dparam" in units and "bwd_wgmma_dparam" not in units
    assert "bwd_wgmma_dparam" in registry.compile_units(t5, "sm_90")  # dparam_diagonal: default
    assert not any("dparam" in u for u in registry.compile_units(sink, "sm_90"))
    assert not any("dparam" in u for u in registry.compile_units(causal, "sm_80"))


def test_the_hopper_dparam_code_renders_at_both_d64_block_m():
    """Head dim 64: with 128-query steps (``hopper_bwd.d64_block_m``) S^T and dP^T hold 64
    floats per thread and P^T is packed into frag_p in the P^T pass (``dq_rows_split``); the
    dparam code rides in that pass at either step width, and its key slots are this
    warpgroup's keys."""
    from flashgen.options import DEFAULT

    for form in ("per_head", "per_key_head", "scalars"):
        spec = form_spec(form, 64)
        grads = _grads(spec)
        for bm in (64, 128):
            o = DEFAULT.replace_path("hopper_bwd.d64_block_m", bm)
            plan = registry.plan_hopper_backward(spec, "sm_90", o, param_grads=grads)
            ctx = plan.dkdv.context
            assert ctx.block_m == bm and ctx.dq_rows_split == (bm == 128)
            src = render(plan.unit)
            assert plan.dkdv.kernel_name.endswith("_dparam") and "const float dsm = pe[e]" in src
            assert "frag_p[j / 2][2 * (j % 2) + r] = Mma::pack(pe[0], pe[1]);" in src
            assert "fg::wgmma_wait<0>();  // S^T and dP^T have landed" in src
            if form != "scalars":
                assert "cg * 64 + warp * 16 + lane / 4" in src  # the key slots / warp sums


def test_the_hopper_diagonal_form_sums_each_diagonal_into_its_slot():
    """The diagonal form in the Hopper kernel (templates/common/dparam.j2, sm_90/bwd.cu.j2): pair
    (j, r, e) of lane l in warp w is query 8 j + 2 (l % 4) + e, key 16 w + l / 4 + 8 r of its
    warp's slice and goes to register (j - r + 1) * 2 + e, whose pairs share the diagonal
    8 (j - r) + 2 (l % 4) + e - l / 4 (the warp's shuffles and slots: the host test below).
    The flush's diagonal j of the CTA's tile (keys n0 + 64 wg .., queries m0 .. at 64-query
    steps; keys n0 .., queries m0 + QW wg .. in head_dim 256's query split) names a pair of
    the tile on it, its q - kv = j - (keys - 1) + m0 - n0; every pair of the tile has its j.
    (``hopper_bwd.dparam_diagonal``.)"""
    for qn in (32, 64, 128):  # d256's query split, 64-query steps, d64's 128-query steps
        nq = qn // 8
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for j in range(nq):
                for r in range(2):
                    for e in range(2):
                        d = (j - r + 1) * 2 + e
                        assert 0 <= d < 2 * (nq + 1)
                        assert 8 * (j - r) + 2 * t + e - g == (8 * j + 2 * t + e) - (g + 8 * r)
                        assert 8 * (d // 2 - 1) + 2 * t + d % 2 - g == 8 * (j - r) + 2 * t + e - g
    from flashgen.options import DEFAULT

    diag = DEFAULT.replace_path("hopper_bwd.dparam_diagonal", True)
    t5 = load_spec(REPO / "specs" / "t5_bias.yaml")
    src = render(registry.plan_hopper_backward(t5, "sm_90", diag, param_grads=("bias",)).unit)
    assert "__shared__ float dp_diag0[MMA_THREADS / 32 * fg::warp_diag_slots<NQ>()];" in src
    assert "dpd0[(j - r + 1) * 2 + e] += " in src
    assert ("fg::warp_diag_sums<NQ>(dpd0, dp_diag0 + threadIdx.x / 32 * fg::warp_diag_slots<NQ>(),"
            " lane);") in src  # fmt: skip
    assert "atomicAdd(&dp_diag" not in src
    t5_256 = loads_spec(
        (REPO / "specs" / "t5_bias.yaml").read_text().replace("head_dim: 64", "head_dim: 256")
        .replace("name: t5_bias", "name: t5_bias_d256"), "<t5_bias_d256>",
    )  # fmt: skip
    for spec, keys, queries, tile_sum in ((t5, 128, 64, "64, 0>(dp_diag0, j - (BLOCK_N - 1))"),
                                          (t5_256, 64, 64, "0, QW>(dp_diag0, j - (64 - 1))")):
        unit = registry.plan_hopper_backward(spec, "sm_90", diag, param_grads=("bias",)).unit
        code = render(unit)
        assert f"fg::diag_tile_sum<fg::warp_diag_slots<NQ>(), {tile_sum}" in code, spec.name
        n = "BLOCK_M + " + ("BLOCK_N" if keys == 128 else "64") + " - 1"
        assert f": ({n});" in code, spec.name  # the flush's diagonals
        lines = code.splitlines()
        i = next(k for k, x in enumerate(lines) if "kv_l = max(0, -dl);" in x)
        dl_expr = lines[i].strip()[len("const int dl = "):].split(", kv_l")[0]
        q_expr, kv_expr = lines[i + 1].strip()[len("const int q_idx = "):-1].split(", kv_idx = ")
        m0, n0 = 640, 1280
        on = {}
        for j in range(queries + keys - 1):
            env = {"j": j, "BLOCK_N": 128, "m0": m0, "n0": n0}
            env["dl"] = eval(dl_expr, {}, env)  # noqa: S307
            env["kv_l"] = max(0, -env["dl"])
            q, kv = (eval(x, {"max": max}, env) for x in (q_expr, kv_expr))  # noqa: S307
            assert q - kv == j - (keys - 1) + m0 - n0, (spec.name, j)
            assert n0 <= kv < n0 + keys and m0 <= q < m0 + queries
            on[q - kv] = j
        assert len(on) == queries + keys - 1  # one j per diagonal of the tile


#: The host side of templates/common/dparam_diag.cuh: the CUDA qualifiers defined away, a warp
#: of 32 threads whose shuffles meet at a barrier, and as the value type the list of elements a
#: sum holds (a slot counts its stores).
_WARP_HOST = r"""
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>
#define __host__
#define __device__
#define __forceinline__ inline
struct Elems {
    std::vector<int> ids;
    int stores = -1;  // a slot: the stores it took (-1: not a slot)
    Elems() = default;
    Elems(const Elems& o) : ids(o.ids) {}
    Elems& operator=(const Elems& o);
};
Elems operator+(const Elems& x, const Elems& y) {
    Elems r(x);
    r.ids.insert(r.ids.end(), y.ids.begin(), y.ids.end());
    return r;
}
std::mutex mu;
std::condition_variable cv;
int arrived = 0, generation = 0;
Elems& Elems::operator=(const Elems& o) {
    if (stores < 0) {
        ids = o.ids;
        return *this;
    }
    std::lock_guard<std::mutex> lock(mu);
    ids = o.ids;
    ++stores;
    return *this;
}
void warp_barrier() {
    std::unique_lock<std::mutex> lock(mu);
    const int g = generation;
    if (++arrived == 32) {
        arrived = 0;
        ++generation;
        cv.notify_all();
    } else {
        cv.wait(lock, [g] { return generation != g; });
    }
}
thread_local int this_lane;
Elems box[32];
Elems __shfl_sync(unsigned, const Elems& v, int src) {
    if (src < 0 || src >= 32) std::abort();
    box[this_lane] = v;
    warp_barrier();
    Elems got = box[src];
    warp_barrier();
    return got;
}
Elems __shfl_xor_sync(unsigned mask, const Elems& v, int x) {
    return __shfl_sync(mask, v, this_lane ^ x);
}
"""


def test_warp_diagonal_sums_hold_each_element_once_on_its_diagonal(cxx_exe):
    """``fg::warp_diag_sums`` and ``fg::diag_tile_sum`` (templates/common/dparam_diag.cuh), run
    on the host by 32 threads a warp: each lane's registers hold its elements of the m64nN
    accumulator layout by diagonal (element (j, r, e) of lane l: row l / 4 + 8 r, column 8 j +
    2 (l % 4) + e of the warp's slice, register 2 (j - r + 1) + e), as the kernel's P^T pass
    sums them.  Every slot of a warp is stored exactly once, the slots together hold every
    element exactly once, each in slot col - row + 16; and the CTA's per-diagonal sums over the
    8 warps' slots (warp w's slice at key 16 (w % 4) + KW (w / 4), query QW (w / 4) of the
    tile) hold every element of the tile once, on its diagonal q - k: 64-query steps (KW 64),
    128-query steps, head_dim 256's query split (QW 32)."""
    import subprocess

    header = (REPO / "templates" / "common" / "dparam_diag.cuh").read_text()
    body = header[header.index("namespace fg {"):]
    cases = ((8, 64, 0), (16, 64, 0), (4, 0, 32))  # NQ, KW, QW
    main = ["int main() {"]
    for nq, kw, qw in cases:
        keys, queries = 64 + kw, 8 * nq + qw
        main.append(f"""    {{
        constexpr int NQ = {nq}, SLOTS = fg::warp_diag_slots<NQ>();
        std::vector<Elems> slots(8 * SLOTS);
        for (Elems& e : slots) e.stores = 0;
        for (int w = 0; w < 8; ++w) {{
            std::vector<std::thread> lanes;
            for (int l = 0; l < 32; ++l)
                lanes.emplace_back([&slots, w, l] {{
                    this_lane = l;
                    Elems s[2 * (NQ + 1)];
                    for (int j = 0; j < NQ; ++j)
                        for (int r = 0; r < 2; ++r)
                            for (int e = 0; e < 2; ++e) {{
                                const int k = 16 * (w % 4) + {kw} * (w / 4) + l / 4 + 8 * r;
                                const int q = {qw} * (w / 4) + 8 * j + 2 * (l % 4) + e;
                                s[2 * (j - r + 1) + e].ids.push_back(k * {queries} + q);
                            }}
                    fg::warp_diag_sums<NQ>(s, slots.data() + w * SLOTS, l);
                }});
            for (std::thread& t : lanes) t.join();
        }}
        for (int i = 0; i < 8 * SLOTS; ++i) {{
            printf("slot {nq} %d %d", i, slots[i].stores);
            for (int id : slots[i].ids) printf(" %d", id);
            printf("\\n");
        }}
        for (int c = -({keys} - 1); c < {queries}; ++c) {{
            const Elems sum = fg::diag_tile_sum<SLOTS, {kw}, {qw}>(slots.data(), c);
            printf("tile {nq} %d 1", c);
            for (int id : sum.ids) printf(" %d", id);
            printf("\\n");
        }}
    }}""")
    main.append("}\n")
    program = _WARP_HOST + body + "\n".join(main)
    exe = cxx_exe(program, "warp_diag")
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, check=True)
    rows: dict = {}
    for line in out.stdout.splitlines():
        kind, nq, i, stores, *ids = (int(x) if k else x for k, x in enumerate(line.split()))
        rows.setdefault((kind, nq), []).append((i, stores, ids))
    for nq, kw, qw in cases:
        keys, queries = 64 + kw, 8 * nq + qw
        slots = dparam.warp_diag_slots(nq)  # as the header's
        assert slots >= 8 * nq + 16  # every diagonal u in [-15, 8 NQ) has its slot u + 16
        seen: dict = {}
        for i, stores, ids in rows[("slot", nq)]:
            assert stores == 1, (nq, i)
            w = i // slots
            for x in ids:
                k, q = divmod(x, queries)
                kl, ql = k - 16 * (w % 4) - kw * (w // 4), q - qw * (w // 4)
                assert 0 <= kl < 16 and 0 <= ql < 8 * nq and ql - kl + 16 == i % slots
                seen[x] = seen.get(x, 0) + 1
        every = {k * queries + q: 1 for k in range(keys) for q in range(queries)}
        assert seen == every, nq
        seen = {}
        for c, _, ids in rows[("tile", nq)]:
            for x in ids:
                k, q = divmod(x, queries)
                assert q - k == c, (nq, c, k, q)
                seen[x] = seen.get(x, 0) + 1
        assert seen == every, nq


def test_hopper_diagonal_units_compile_spill_free(requires_nvcc):
    """``hopper_bwd.dparam_diagonal``: t5_bias's trainable table at head_dim 64 (built at
    64-query steps: 128 spills, the build's candidates) and 256, and the relative-table form
    at 256, are Hopper units with 0 spills and no serialized wgmma; their per-diagonal sums
    take no shared-memory atomics (ATOMS: the CAS loops of an fp32 atomicAdd to shared
    memory) but a warp's shuffles: NQ + 2, (NQ + 2) / 2 by index and (NQ + 5) / 4 by xor (the
    dK/dV kernel's only other shuffle: one SHFL.IDX, the warpgroup index).  (The diagonal form
    alone: ``dparam_const_tiles``, on by default, adds its own shuffles,
    tests/unit/test_dparam_const_tiles.py.)"""
    from flashgen.options import DEFAULT

    diag = DEFAULT.with_values(
        {"hopper_bwd.dparam_diagonal": True, "hopper_bwd.dparam_const_tiles": False}
    )
    t5 = load_spec(REPO / "specs" / "t5_bias.yaml")
    t5_256 = loads_spec(
        (REPO / "specs" / "t5_bias.yaml").read_text().replace("head_dim: 64", "head_dim: 256")
        .replace("name: t5_bias", "name: t5_bias_d256"), "<t5_bias_d256>",
    )  # fmt: skip
    for spec in (t5, t5_256, form_spec("relative_table", 256)):
        plan, _, report = build_backward(
            spec, "sm_90", hopper=True, options=diag, param_grads=_grads(spec)
        )  # fmt: skip
        assert plan.dkdv.template == "sm_90/bwd.cu.j2", spec.name
        assert report.spill_bytes == 0 and not report.wgmma_serialized, (spec.name, report)
        assert "dp_diag0" in render(plan.unit)
        code = sass(plan.unit)
        dkdv = code[code.index(plan.dkdv.kernel_name):]
        dkdv = dkdv[: dkdv.find("Function :") if "Function :" in dkdv else None]
        nq = plan.dkdv.context["block_m"] // (16 if spec.head_dim == 256 else 8)
        assert "ATOMS" not in dkdv, spec.name
        assert dkdv.count("SHFL.IDX") == 1 + nq + 2 + (nq + 2) // 2, spec.name
        assert dkdv.count("SHFL.BFLY") == (nq + 5) // 4, spec.name


def test_element_offsets_clamp_where_the_read_clamps():
    t5 = load_spec(REPO / "specs" / "t5_bias.yaml")
    (term,) = dparam.fields(t5, ("bias",))["dparam_terms"]
    assert "clamp" not in term["offset"]  # proven inside [0, 257)
    spec = form_spec("full_bias")
    (term,) = dparam.fields(spec, ("fb",))["dparam_terms"]
    assert term["offset"].count("fg::clamp_index") == 0  # q_idx, kv_idx into their own extents
    spec = form_spec("two_reads")
    offs = [t["offset"] for t in dparam.fields(spec, ("t",))["dparam_terms"]]
    assert offs == ["(int64_t)(fg::clamp_index(fg::imod(q_idx, 3), 3))",
                    "(int64_t)(fg::clamp_index(fg::imod(kv_idx, 3), 3))"] or all(
        "3" in o for o in offs)  # fmt: skip
    scal = form_spec("scalars")
    assert [t["offset"] for t in dparam.fields(scal, ("temp", "g"))["dparam_terms"]] == ["0", "0"]


def test_dparam_buffers_atomic_and_deterministic():
    names = ("a", "s")
    shapes = param_shapes(names, {"a": torch.zeros(3, 4)})
    assert shapes == {"a": (3, 4), "s": ()}
    values, finish = dparam_buffers(names, shapes, 5, False, "cpu")
    assert values["dps_a"] == 0 and values["dp_a"].shape == (12,)
    assert values["dps_s"] == 0 and values["dp_s"].shape == (1,)
    values["dp_a"] += 1
    got = finish()
    assert got[0].shape == (3, 4) and got[1].shape == () and float(got[0].sum()) == 12
    values, finish = dparam_buffers(names, shapes, 5, True, "cpu")
    assert values["dps_a"] == 12 and values["dp_a"].shape == (5, 12)
    assert values["dps_s"] == 1 and values["dp_s"].shape == (5, 1)
    values["dp_a"][2, 7] = 2.0
    values["dp_a"][4, 7] = 3.0
    got = finish()
    assert got[0].shape == (3, 4) and float(got[0][1, 3]) == 5.0


def test_shared_memory_of_the_dparam_tiles_is_bounded():
    """Query, relative-position and general forms stage a KV_N x (KV_M + 1) fp32 tile per term
    in static shared memory; a spec with more than fits is refused by the plan."""
    spec = loads_spec(
        "name: many\nhead_dim: 64\ndtype: bf16\nscore_mod: \"score + t[q_idx] + t[q_idx + 1] + "
        "t[q_idx + 2] + t[q_idx + 3]\"\nparams:\n  t: {type: f32, shape: [4096]}\n", "<many>"
    )  # fmt: skip
    with pytest.raises(ValueError, match="shared-memory tiles"):
        registry.plan_backward(spec, "sm_80", param_grads=("t",))


# ----------------------------------------------------------------------------- nvcc
def _case_specs():
    """(spec, whether its Hopper dparam unit must compile as the Hopper kernel): every form
    at head_dim 128, some at 64 and 256, a windowed mask (its Hopper unit may take the
    FA2-class kernels, as a windowed softcap does without dparam), the shipped specs."""
    cases = [(form_spec(f), True) for f in sorted(FORMS)]
    cases += [(form_spec(f, 64), True) for f in ("per_head", "per_key_head", "relative_table")]
    cases += [(form_spec(f, 256), True) for f in ("per_head", "per_key", "relative_table")]
    window = "causal && q_idx + seqlen_k - seqlen_q - kv_idx < 256"
    cases.append((form_spec("per_head", mask=window, tag="_swa"), False))
    for name in ("alibi", "alibi_learned", "t5_bias", "gemma2_softcap"):
        cases.append((load_spec(REPO / "specs" / f"{name}.yaml"), True))
    return cases


def _build(spec, target, kind):
    grads = _grads(spec)
    plan, cubin, report = build_backward(
        spec, target, atomic_dq=kind == "atomic", hopper=kind == "hopper", param_grads=grads
    )  # fmt: skip
    return spec.name, target, kind, plan, report


def test_hopper_dparam_units_with_128_query_steps_stay_hopper_and_spill_free(requires_nvcc):
    """``hopper_bwd.d64_block_m=128``: a head-dim-64 dparam unit that spills at 128-query steps
    (S^T, dP^T and the sums live together through the P^T pass) is built at 64 by the build's
    candidates (families/build.py), not as the FA2-class unit; every one built is spill-free."""
    from flashgen.options import DEFAULT

    o = DEFAULT.replace_path("hopper_bwd.d64_block_m", 128)
    specs = [form_spec(f, 64) for f in ("per_head", "per_batch_head", "per_key", "per_key_head",
                                        "scalars")]  # fmt: skip
    specs.append(load_spec(REPO / "specs" / "alibi_learned.yaml"))

    def one(spec):
        return spec.name, build_backward(
            spec, "sm_90", hopper=True, options=o, param_grads=_grads(spec)
        )  # fmt: skip

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(one, specs))
    problems = []
    for name, (plan, _, report) in results:
        assert plan.dkdv.kernel_name.endswith("_dparam"), name
        if not plan.wgmma:
            problems.append(f"{name}: fell back to the FA2-class unit")
        assert plan.dkdv.context.block_m in (64, 128)
        for k in report.kernels:
            if k.spill_bytes or k.wgmma_serialized:
                problems.append(f"{name}: {k}")
    assert not problems, "\n".join(problems)


def test_hopper_dparam_units_under_exact_softmax_stay_hopper_and_spill_free(requires_nvcc):
    """``Options.exact_softmax`` caps P's exponent in the P^T pass the dparam code shares: every
    Hopper grad unit of the index forms and shipped specs is still the Hopper kernel, 0 spills
    (the register-tightest, per_head at head_dim 128, spilled 8 bytes before dS^T was packed
    in that pass)."""
    from flashgen.options import Options

    o = Options(exact_softmax=True)
    specs = [s for s, _ in _case_specs() if registry.hopper_bwd.eligible(s, "sm_90")
             and dparam.hopper_forms_ok(s, _grads(s)) and "_swa" not in s.name]  # fmt: skip

    def one(spec):
        return spec.name, build_backward(
            spec, "sm_90", hopper=True, options=o, param_grads=_grads(spec)
        )  # fmt: skip

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(one, specs))
    problems = []
    for name, (plan, _, report) in results:
        assert "capped_exponent" in render(plan.unit), name
        if not plan.wgmma:
            problems.append(f"{name}: fell back to the FA2-class unit")
        for k in report.kernels:
            if k.spill_bytes or k.wgmma_serialized:
                problems.append(f"{name}: {k}")
    assert not problems, "\n".join(problems)


def _jobs(cases) -> list:
    """(spec, target, kind) of the sweep below.  The FA2-class dparam units (``det``,
    ``atomic``) of the test specs cover spec x kind x target pairwise: spec i builds kind j
    for target (i + j) % 2, so every form builds both kinds, one per target, and every
    (kind, target) is built by half the forms at each head dim (the sm_80 and sm_90 units
    render the same CUDA but for the kernels' names and the sm_90 vector reduction; ptxas
    allocates registers per arch, so a form's other target is covered by the other forms,
    not proven for it).  The shipped specs' FA2-class dparam units are the pairwise covering
    tests/unit/test_compile.py builds (tests/shipped_specs.py's ``fa2_backward_covering``:
    each spec both kinds and both targets, every (kind, target); the same units, cache hits
    in a full run); the Hopper unit is built for every spec it takes (sm_90 only).  Under
    ``pytest --full-product`` every spec builds both kinds for both targets."""
    jobs = []
    shipped = {p.stem for p in (REPO / "specs").glob("*.yaml")}
    kind_of = {"bwd_dparam": "det", "bwd_atomic_dparam": "atomic"}
    names = [s.name for s, _ in cases if s.name in shipped]
    covering = {(n, t, kind_of[u]) for n, t, u in fa2_backward_covering(names, kind_of)}
    for i, spec in enumerate(s for s, _ in cases):
        if spec.name in shipped:
            jobs += [(spec, t, k) for n, t, k in sorted(covering) if n == spec.name]
        elif sweeps.FULL_PRODUCT:
            jobs += [(spec, t, k) for t in ("sm_80", "sm_90") for k in ("det", "atomic")]
        else:
            jobs += [(spec, ("sm_80", "sm_90")[(i + j) % 2], k)
                     for j, k in enumerate(("det", "atomic"))]  # fmt: skip
        if registry.hopper_bwd.eligible(spec, "sm_90") and dparam.hopper_forms_ok(
            spec, _grads(spec)
        ):
            jobs.append((spec, "sm_90", "hopper"))
    return jobs


def test_the_sweep_builds_every_form_and_kind_for_both_targets():
    cases = _case_specs()
    jobs = _jobs(cases)
    fa2 = [(s.name, t, k) for s, t, k in jobs if k != "hopper"]
    assert len(fa2) == len(set(fa2))
    for spec, _ in cases:
        mine = {(t, k) for n, t, k in fa2 if n == spec.name}
        assert {k for _, k in mine} == {"det", "atomic"} and {t for t, _ in mine} == {
            "sm_80", "sm_90"}  # fmt: skip
    for d in (64, 128, 256):
        at_d = {(t, k) for s, t, k in jobs if s.head_dim == d and k != "hopper"}
        assert len(at_d) == 4, d  # both kinds for both targets at every head dim
    # the shipped specs: two units each (all four under --full-product), every (kind, target)
    # among them
    shipped = [(n, t, k) for n, t, k in fa2 if not n.startswith("dp_")]
    per_spec = 4 if sweeps.FULL_PRODUCT else 2
    assert len(shipped) == per_spec * len({n for n, _, _ in shipped}) == 4 * per_spec
    assert len({(t, k) for _, t, k in shipped}) == 4
    if sweeps.FULL_PRODUCT:  # the test specs too: every (target, kind)
        for spec, _ in cases:
            assert {(t, k) for n, t, k in fa2 if n == spec.name} == {
                (t, k) for t in ("sm_80", "sm_90") for k in ("det", "atomic")}  # fmt: skip


def test_every_index_form_compiles_its_dparam_units_without_spills(requires_nvcc):
    """Every index form (and the shipped trainable specs) at head dims 64 / 128 / 256: the
    deterministic and atomic FA2-class dparam units on sm_80 and sm_90a (:func:`_jobs`: a
    pairwise covering for the test specs), and the Hopper one where it takes the forms, each
    built as the op builds it (the spill fallback's tiles): 0 spill bytes, no serialized
    wgmma, the dparam kernel present; the Hopper unit stays the Hopper kernel (no fallback
    to the FA2-class one) for every spec it takes."""
    cases = _case_specs()
    hold = {spec.name: must_hold for spec, must_hold in cases}
    jobs = _jobs(cases)
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda j: _build(*j), jobs))
    problems = []
    for name, target, kind, plan, report in results:
        assert plan.dkdv.kernel_name.endswith("_dparam"), (name, kind)
        if kind == "hopper" and not plan.wgmma and hold[name]:
            problems.append(f"{name}/{target}/{kind}: fell back to the FA2-class unit")
        for k in report.kernels:
            if k.spill_bytes or k.wgmma_serialized:
                problems.append(f"{name}/{target}/{kind}: {k}")
    assert not problems, "\n".join(problems)


def test_loaded_kernel_keys_keep_two_fields_without_param_grads(monkeypatch):
    """Backward.kernels caches a unit without param gradients under (device, path), as the
    GPU tests and tools/sanitize.py look it up, and a dparam unit under (device, path, names)
    (build and load stubbed: no GPU)."""
    import flashgen
    import flashgen.families.build as fb
    import flashgen.runtime.launch as rl
    from flashgen.ops.prefill import backward as bwd_mod

    class Plan:
        wgmma = True
        kernels = ()

    built = []

    def fake_build(spec, target, **kw):
        built.append(kw["param_grads"])
        return Plan(), "cubin", None

    monkeypatch.setattr(fb, "build_backward", fake_build)
    monkeypatch.setattr(rl, "load", lambda *a: None)
    monkeypatch.setattr(bwd_mod, "target_for_device", lambda spec, device: "sm_90")
    op = flashgen.load(REPO / "specs" / "alibi.yaml")
    dev = torch.device("cuda", 0)
    op.backward.kernels(dev, path="hopper")
    op.backward.kernels(dev, path="hopper", param_grads=("slopes",))
    assert set(op.backward._kernels) == {(0, "hopper"), (0, "hopper", ("slopes",))}
    assert built == [(), ("slopes",)]


def test_a_trained_backward_routes_once_per_op(monkeypatch):
    """A backward call with param gradients routes (backward_path: the params' kernel forms
    derived from the spec, tens of microseconds of host time) once per op, target,
    deterministic flag and param names, not on every call; each key gets backward_path's
    answer (kernels stubbed: CPU tensors, no GPU)."""
    import flashgen
    from flashgen.ops.prefill import backward as bwd_mod
    from flashgen.options import DEFAULT

    routed, paths, launched = [], [], []

    def counting(spec, target, deterministic, options=DEFAULT, param_grads=()):
        routed.append((target, deterministic, tuple(param_grads)))
        return backward_path(spec, target, deterministic, options, param_grads)

    class Kernel:
        def launch(self, grid, values, stream):
            launched.append(grid)

    def kernels(self, device, atomic_dq=False, path=None, param_grads=(), sink=False):
        paths.append((path, tuple(param_grads)))
        plan = registry.plan_hopper_backward(self.spec, "sm_90", self.op.options,
                                             param_grads=param_grads)  # fmt: skip
        return plan, Kernel(), Kernel(), Kernel()

    monkeypatch.setattr(bwd_mod, "backward_path", counting)
    monkeypatch.setattr(bwd_mod.Backward, "kernels", kernels)
    monkeypatch.setattr(bwd_mod, "target_for_device", lambda spec, device: "sm_90")
    monkeypatch.setattr(bwd_mod, "current_stream_ptr", lambda device: 0)
    op = flashgen.load(REPO / "specs" / "alibi.yaml")
    q, k, v, o, do = (torch.randn(1, 2, 16, 128, dtype=torch.bfloat16) for _ in range(5))
    lse = torch.zeros(1, 2, 16)
    slopes = torch.tensor([0.25, 0.5])
    for _ in range(3):
        op.backward.cuda(do, q, k, v, o, lse, None, 0.1, False, slopes, param_grads=[True])
    assert routed == [("sm_90", False, ("slopes",))]
    assert paths == [("hopper", ("slopes",))] * 3 and len(launched) == 9
    op.backward.cuda(do, q, k, v, o, lse, None, 0.1, False, slopes)
    op.backward.cuda(do, q, k, v, o, lse, None, 0.1, False, slopes)
    assert routed[1:] == [("sm_90", False, ())] and paths[3:] == [("hopper", ())] * 2
    assert op.backward.path("sm_90", True, ("slopes",)) == "deterministic"
    assert op.backward.path("sm_80", False, ("slopes",)) == backward_path(
        op.spec, "sm_80", False, op.options, ("slopes",)
    )
    assert len(routed) == 4
