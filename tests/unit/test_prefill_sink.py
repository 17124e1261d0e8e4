"""The attention sink inside the prefill forward kernels (``Options.fa2_fwd.fused_sink`` /
``Options.hopper_fwd.fused_sink``, issue 37's "prefill fused sink"), on the CPU: the options
are typed, off by default and part of the kernel and cache keys; a sink spec's forward units
take the sink logits (``sink``, ``sink_sb``, ``sink_sh``) and scale o by
``fg::dec::sink_share`` in the epilogue only with the option on, in every form the templates
render (FA2-class padded and varlen, Hopper, persistent, sparse tiles, fp8), and a spec
without a sink renders byte-identical units; the fused units compile for sm_80 and sm_90a
without spills.  On the GPU:
tests/gpu/test_prefill_sink_gpu.py."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flashgen.build import cache
from flashgen.build.render import render
from flashgen.codegen.plan import TileConfig
from flashgen.families import fa2_fwd, hopper_fwd, registry
from flashgen.families.build import build_forward
from flashgen.frontend.errors import SpecError
from flashgen.frontend.spec import load_spec, loads_spec
from flashgen.ops.prefill.varlen import varlen_spec
from flashgen.options import DEFAULT, Options

ROOT = Path(__file__).resolve().parents[2]
SINK_SPEC = ROOT / "specs" / "gpt_oss_sink.yaml"
FAMILIES = ("fa2_fwd", "hopper_fwd")
ON = Options().with_values({f"{f}.fused_sink": True for f in FAMILIES})
SINK_ARGS = [("sink", "const float*"), ("sink_sb", "int64_t"), ("sink_sh", "int64_t")]


def _spec(name: str, sink: str, params: str, mask: str = "causal", head_dim: int = 64,
          dtype: str = "bf16", score_mod: str = "null"):  # fmt: skip
    return loads_spec(
        f"name: {name}\nhead_dim: {head_dim}\ndtype: {dtype}\nmask: {mask}\n"
        f"score_mod: {score_mod}\nsink: {sink}\nparams:\n{params}\n",
        f"{name}.yaml",
    )


PER_HEAD = "  sinks: {type: f32, shape: [num_heads]}"
SWA_D128 = ("psink_swa_d128", "sinks[h]",
            PER_HEAD + "\n  window: {type: i32, default: 100}",
            "causal && q_idx + seqlen_k - seqlen_q - kv_idx < window", 128)  # fmt: skip


# ----------------------------------------------------------------------------- the option
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_sink_is_a_typed_forward_option_off_by_default(family):
    path = f"{family}.fused_sink"
    record = {"fa2_fwd": fa2_fwd.Options, "hopper_fwd": hopper_fwd.Options}[family]
    assert path in Options.paths() and DEFAULT.get_path(path) is False
    assert Options.describe(path) == "bool (true, false, 1, 0)"
    for text, want in (("true", True), ("on", True), ("1", True), ("false", False)):
        assert Options().replace_path(path, text).get_path(path) is want
    for bad in (1, "yes please", None):
        with pytest.raises(ValueError, match=rf"Options\.{family}\.fused_sink=.*: expected a bool"):
            record(fused_sink=bad)
    with pytest.raises(ValueError, match=rf"option {family}\.fused_sink='maybe'"):
        Options().replace_path(path, "maybe")


def test_the_option_is_part_of_the_kernel_and_cache_keys():
    fa2 = Options().replace_path("fa2_fwd.fused_sink", True)
    assert fa2.key() == "fa2_fwd.fused_sink=True" and DEFAULT.key() == ""
    assert fa2.family_key("fa2_fwd") == "fa2_fwd.fused_sink=True"
    assert all(fa2.family_key(f) == "" for f in ("hopper_fwd", "fa2_bwd", "hopper_bwd", "decode"))
    assert ON.family_key("hopper_fwd") == "hopper_fwd.fused_sink=True"
    spec = load_spec(SINK_SPEC)
    for target, family in (("sm_80", "fa2_fwd"), ("sm_90", "hopper_fwd")):
        off, on = (registry.plan_forward(spec, target, o) for o in (DEFAULT, ON))
        assert (off.options_key, on.options_key) == ("", f"{family}.fused_sink=True")
        assert cache.cache_key(render(on), on) != cache.cache_key(render(off), off)
    # a spec without a sink: the same source and arguments, another cache entry
    llama = load_spec(ROOT / "specs" / "llama3_gqa.yaml")
    a, b = registry.plan_forward(llama, "sm_90"), registry.plan_forward(llama, "sm_90", ON)
    assert render(a) == render(b) and a.args == b.args and not b.context["sink"]
    assert cache.cache_key(render(a), a) != cache.cache_key(render(b), b)


# ----------------------------------------------------------------------------- the units
def _units(spec, options: Options) -> dict:
    """Every forward form of ``spec`` the templates render (a key per form)."""
    if spec.dtype == "fp8_e4m3":
        bd = registry.plan_forward(spec, "sm_90", options, block_descale=True)
        return {"sm_90_fp8": registry.plan_forward(spec, "sm_90", options), "sm_90_fp8_bd": bd}
    fa2 = options.replace_path("family", "fa2")
    out = {"sm_80": registry.plan_forward(spec, "sm_80", options),
           "sm_90_fa2": registry.plan_forward(spec, "sm_90", fa2),
           "sm_90": registry.plan_forward(spec, "sm_90", options)}  # fmt: skip
    for sched in ("static", "dynamic"):
        out[f"sm_90_{sched}"] = registry.plan_forward(spec, "sm_90", options, persistent=sched)
    alt = registry.sparse_tiles(spec, out["sm_90"].tiles, options)
    if alt is not None:
        out["sm_90_sparse"] = registry.plan_forward(spec, "sm_90", options, tiles=alt)
    out["varlen"] = registry.plan_forward(varlen_spec(spec), "sm_80", options)
    return out


SINK_SPECS = {
    "gpt_oss_sink": lambda: load_spec(SINK_SPEC),
    "swa_d128": lambda: _spec(*SWA_D128[:4], head_dim=SWA_D128[4]),
    "per_batch_head_d256": lambda: _spec("psink_bh_d256", "sinks[b, h]",
                                         "  sinks: {type: f32, shape: [batch, num_heads]}",
                                         head_dim=256),
    "fp8": lambda: _spec("psink_fp8", "sinks[h]", PER_HEAD, head_dim=128, dtype="fp8_e4m3"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SINK_SPECS))
def test_a_fused_unit_takes_the_sink_and_scales_o_in_its_epilogue(name):
    spec = SINK_SPECS[name]()
    on, off = _units(spec, ON), _units(spec, DEFAULT)
    if name == "swa_d128":
        assert "sm_90_sparse" in on  # the sparse-tile unit is among the forms
    for form, plan in on.items():
        base = off[form]
        assert plan.context["sink"] and not base.context["sink"], form
        assert [(a.name, a.ctype) for a in plan.args if a not in base.args] == SINK_ARGS, form
        assert [a for a in plan.args if (a.name, a.ctype) not in SINK_ARGS] == list(base.args)
        names = [a.name for a in plan.args]  # after softmax_scale (and the descales), before params
        anchor = "v_descale" if spec.dtype == "fp8_e4m3" else "softmax_scale"
        assert names[names.index(anchor) + 1 : names.index(anchor) + 4] == [n for n, _ in SINK_ARGS]
        assert plan.kernel_name == base.kernel_name and plan.smem_bytes == base.smem_bytes
        assert plan.tiles == base.tiles, form
        src, plain = render(plan), render(base)
        assert "FG_DECODE_SINK_CUH" in src and src.count("fg::dec::sink_share(") == 1, form
        b = "seq" if form == "varlen" else "b"  # varlen: the sequence, from blockIdx again
        assert f"__ldg(sink + {b} * sink_sb + h * sink_sh)" in src, form
        for code in ("sink_share", "FG_DECODE_SINK_CUH", "sink_sb", "fused_sink", "row_lse"):
            assert code not in plain, (form, code)


def test_specs_without_a_sink_render_the_same_units_with_the_option():
    """Every shipped spec's units (``flashgen build``'s, the forward's other forms too): a spec
    without a sink renders byte-identical sources and the same arguments with the option on;
    a sink spec's backward units are unchanged either way."""
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        spec = load_spec(path)
        if spec.v_from_k:
            continue
        for target in ("sm_80", "sm_90"):
            if spec.dtype == "fp8_e4m3" and target == "sm_80":
                continue
            off, on = (registry.compile_units(spec, target, o) for o in (DEFAULT, ON))
            assert off.keys() == on.keys()
            for key in off:
                fwd = key.startswith("fwd") and spec.sink is not None
                assert (render(off[key]) == render(on[key])) != fwd, (spec.name, target, key)
        try:
            packed = varlen_spec(spec)
        except SpecError:  # fp8, tensor params of seqlen_q / seqlen_k
            continue
        a, b = (render(registry.plan_forward(packed, "sm_80", o)) for o in (DEFAULT, ON))
        assert (a == b) == (spec.sink is None), spec.name


def test_joins_sink_follows_the_routed_forward_family():
    spec, llama = load_spec(SINK_SPEC), load_spec(ROOT / "specs" / "llama3_gqa.yaml")
    fa2 = Options().replace_path("fa2_fwd.fused_sink", True)
    hop = Options().replace_path("hopper_fwd.fused_sink", True)
    assert not registry.joins_sink(spec, "sm_80") and not registry.joins_sink(spec, "sm_90")
    assert registry.joins_sink(spec, "sm_80", fa2) and not registry.joins_sink(spec, "sm_90", fa2)
    assert registry.joins_sink(spec, "sm_90", hop) and not registry.joins_sink(spec, "sm_80", hop)
    assert registry.joins_sink(spec, "sm_90", fa2.replace_path("family", "fa2"))
    assert not registry.joins_sink(llama, "sm_90", ON)
    # the spill fallback's FA2-class tiles of a Hopper route keep the route's choice
    small = TileConfig(64, 64, 4)
    assert registry.plan_forward(spec, "sm_90", hop, tiles=small).context["sink"]
    assert not registry.plan_forward(spec, "sm_90", fa2, tiles=small).context["sink"]


# ----------------------------------------------------------------------------- nvcc
def _compile_jobs():
    """The sink specs' fused units as the op builds them (:func:`flashgen.families.build.
    build_forward`: the first candidate tiles and features that compile without spills):
    sm_80 padded and varlen, the FA2-class unit for sm_90a, the Hopper unit, persistent
    (dynamic), the sparse-tile unit; fp8 in both descale forms.  d64, d128 with a sliding
    window, d256 with a per-(batch, head) sink."""
    fa2 = ON.replace_path("family", "fa2")
    jobs = []
    for name in ("gpt_oss_sink", "swa_d128", "per_batch_head_d256"):
        spec = SINK_SPECS[name]()
        jobs += [(name, "sm_80", spec, "sm_80", ON, {}),
                 (name, "varlen", varlen_spec(spec), "sm_80", ON, {}),
                 (name, "sm_90_fa2", spec, "sm_90", fa2, {}),
                 (name, "sm_90", spec, "sm_90", ON, {}),
                 (name, "sm_90_dynamic", spec, "sm_90", ON, {"persistent": "dynamic"})]  # fmt: skip
        if name == "swa_d128":
            jobs.append((name, "sm_90_sparse", spec, "sm_90", ON, {"sparse": True}))
    fp8 = SINK_SPECS["fp8"]()
    jobs += [("fp8", "sm_90", fp8, "sm_90", ON, {}),
             ("fp8", "sm_90_bd", fp8, "sm_90", ON, {"block_descale": True})]  # fmt: skip
    return jobs


def _compile(job):
    name, form, spec, target, options, kw = job
    plan, _, report = build_forward(spec, target, options=options, **kw)
    return name, form, plan, report


def test_every_fused_sink_forward_unit_compiles_without_spills(requires_nvcc):
    """Each job of :func:`_compile_jobs` (16 units, in parallel through the session cache):
    the unit the op would load joins the sink and has no spill and no serialized wgmma."""
    workers = int(os.environ.get("FLASHGEN_TEST_JOBS", (os.cpu_count() or 1) + 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(_compile, _compile_jobs()))
    problems = []
    for name, form, plan, report in results:
        assert plan.context["sink"], (name, form)
        assert [k.name for k in report.kernels] == [plan.kernel_name]
        for k in report.kernels:
            assert 0 < k.registers <= 255
            if k.spill_bytes or report.wgmma_serialized:
                problems.append(f"{name} {form} {plan.tiles}: {k}")
    assert not problems, "fused-sink forward kernels spill:\n" + "\n".join(problems)
