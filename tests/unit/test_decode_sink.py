"""The attention sink inside the decode kernels (``Options.decode.fused_sink``, issue 37), on
the CPU: the option is typed, on by default and part of the kernel and cache keys; a unit
takes the sink logits (``sink``, ``sink_sb``, ``sink_sh``) only with the option on and a spec
with a sink, and scales both epilogues (the one split's store and the merge's weights) by
``fg::dec::sink_share``, which run on the host equals ``sigmoid(lse - sink)``; the planned fast
path (the driver faked) and the general launch pass the logits (the sink param's own address
for ``sinks[h]``), and ``with_kvcache`` then skips the torch epilogue, or passes null and runs
it (``apply_sink=False``: neither); the CPU op is unchanged; every fused unit compiles for
sm_80 and sm_90a without spills.  On the GPU: tests/gpu/test_decode_sink_gpu.py."""

from __future__ import annotations

import ctypes
import functools
import math
import os
import subprocess
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from flashgen.build import cache
from flashgen.build.render import render
from flashgen.families import decode as family
from flashgen.families import registry
from flashgen.frontend.errors import OpInputError
from flashgen.frontend.spec import load_spec, loads_spec
from flashgen.ops import sink as sink_mod
from flashgen.ops.decode.inputs import DecodeDims
from flashgen.ops.decode.op import decode_op
from flashgen.ops.op import build_op
from flashgen.ops.sink import sink_logits
from flashgen.options import DEFAULT, Options

ROOT = Path(__file__).resolve().parents[2]
SINK_SPEC = ROOT / "specs" / "gpt_oss_sink.yaml"
HEADER = ROOT / "templates" / "common" / "decode_sink.cuh"
ON = DEFAULT  # the sink inside the kernel: the default since it measured faster
OFF = Options().replace_path("decode.fused_sink", False)
BF16 = torch.bfloat16
SINK_ARGS = [("sink", "const float*"), ("sink_sb", "int64_t"), ("sink_sh", "int64_t")]


def _kv_sink_spec():
    """A spec whose sink is computed (a scalar plus a per-kv-head tensor): no view of a param."""
    return loads_spec(
        "name: sink_kv_scalar\nhead_dim: 64\ndtype: bf16\nmask: causal\nsink: s0 + sinks[h_kv]\n"
        "params:\n  sinks: {type: f32, shape: [num_heads_kv]}\n  s0: {type: f32, default: 0.5}\n",
        "sink_kv_scalar.yaml",
    )


# ----------------------------------------------------------------------------- the option
def test_fused_sink_is_a_typed_decode_option_on_by_default():
    assert "decode.fused_sink" in Options.paths() and DEFAULT.decode.fused_sink is True
    assert Options.describe("decode.fused_sink") == "bool (true, false, 1, 0)"
    for text, want in (("true", True), ("False", False), ("1", True), ("false", False)):
        assert Options().replace_path("decode.fused_sink", text).decode.fused_sink is want
    with pytest.raises(ValueError, match=r"Options\.decode\.fused_sink=1: expected a bool"):
        family.Options(fused_sink=1)
    with pytest.raises(ValueError, match=r"Options\.decode\.fused_sink='yes please'"):
        family.Options(fused_sink="yes please")
    for text in ("maybe", "on"):
        with pytest.raises(ValueError, match=rf"^decode\.fused_sink: expected a bool .*'{text}'$"):
            Options().replace_path("decode.fused_sink", text)
    with pytest.raises(ValueError, match=r"Options\.decode\.fused_sink=0: expected a bool"):
        Options().replace_path("decode.fused_sink", 0)


def test_the_option_is_part_of_the_kernel_and_cache_keys():
    assert OFF.key() == "decode.fused_sink=False" and ON.key() == ""
    assert OFF.family_key("decode") == "decode.fused_sink=False"
    assert all(OFF.family_key(f) == "" for f in ("fa2_fwd", "hopper_fwd", "fa2_bwd", "hopper_bwd"))
    assert family.Options(fused_sink=False).unit_key() != family.Options().unit_key()
    spec = load_spec(SINK_SPEC)
    off, on = (registry.plan_decode(spec, "sm_80", o) for o in (OFF, ON))
    assert (off.options_key, on.options_key) == ("decode.fused_sink=False", "")
    assert cache.cache_key(render(on), on) != cache.cache_key(render(off), off)
    # a spec without a sink: the same source and arguments, another cache entry
    llama = load_spec(ROOT / "specs" / "llama3_gqa.yaml")
    a, b = registry.plan_decode(llama, "sm_80"), registry.plan_decode(llama, "sm_80", OFF)
    assert render(a) == render(b) and a.args == b.args and not a.fused_sink
    assert cache.cache_key(render(a), a) != cache.cache_key(render(b), b)
    # a plan records its decode options; a CPU plan has no kernels (the torch epilogue runs)
    op = build_op(spec, ON)
    p = op.plan_decode(batch=2, num_heads=8, num_heads_kv=2, cache_capacity=64, device="cpu")
    assert p.options.fused_sink and not p.fused_sink


# ----------------------------------------------------------------------------- the unit
@pytest.mark.parametrize("cache_dtype", [None, "fp8_e4m3"], ids=["bf16", "kv8"])
@pytest.mark.parametrize("ragged", [False, True], ids=["padded", "ragged"])
@pytest.mark.parametrize("target", family.TARGETS)
def test_a_fused_unit_takes_the_sink_and_scales_both_epilogues(target, ragged, cache_dtype):
    spec = load_spec(SINK_SPEC)
    off = registry.plan_decode(spec, target, OFF, ragged=ragged, cache_dtype=cache_dtype)
    on = registry.plan_decode(spec, target, ON, ragged=ragged, cache_dtype=cache_dtype)
    assert on.fused_sink and not off.fused_sink
    assert [(a.name, a.ctype) for a in on.args if a not in off.args] == SINK_ARGS
    assert [a for a in on.args if (a.name, a.ctype) not in SINK_ARGS] == list(off.args)
    assert on.call_pointers == off.call_pointers
    assert on.kernel("append").args == off.kernel("append").args
    assert on.kernel_name == off.kernel_name and on.smem_bytes == off.smem_bytes
    src, base = render(on), render(off)
    assert "FG_DECODE_SINK_CUH" in src
    assert src.count("fg::dec::sink_share(") == 2  # the one split's store, the merge
    for code in ("sink_share", "FG_DECODE_SINK_CUH", "sink_sb", "Options.decode.fused_sink"):
        assert code not in base
    assert on.config()["fused_sink"] is True and "fused_sink" not in off.config()


def test_only_sink_specs_render_sink_code_and_off_renders_none():
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        spec = load_spec(path)
        if family.unsupported_reason(spec) is None:
            for ragged in (False, True):
                src = render(registry.plan_decode(spec, "sm_90", DEFAULT, ragged=ragged))
                assert ("sink_share" in src) == (spec.sink is not None), spec.name
                off = render(registry.plan_decode(spec, "sm_90", OFF, ragged=ragged))
                assert "sink_share" not in off and "sink_sb" not in off, spec.name


PROGRAM = r"""
#include "HEADER"
#include <cstdio>
int main() {
    float lse, sink;
    while (scanf("%f %f", &lse, &sink) == 2) printf("%.9g\n", fg::dec::sink_share(lse, sink));
    return 0;
}
"""


def test_sink_share_on_the_host_is_sigmoid_of_lse_minus_sink(host_exe):
    """``fg::dec::sink_share`` (templates/common/decode_sink.cuh) against float64
    ``sigmoid(lse - sink)``; a row with no key (lse = -inf) has share 0 whatever the sink,
    NaN in either input gives NaN."""
    exe = host_exe(PROGRAM.replace("HEADER", str(HEADER)), "sink_host")
    lses = [-math.inf, -1e4, -30.0, -2.5, 0.0, 1.0, 7.25, 88.0, 1e4, math.nan]
    sinks = [-math.inf, -90.0, -3.0, 0.0, 0.5, 3.0, 95.0, math.inf, math.nan]
    pairs = [(a, b) for a in lses for b in sinks]
    text = "".join(f"{a!r} {b!r}\n" for a, b in pairs)
    run = subprocess.run([str(exe)], input=text, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    got = [float(v) for v in run.stdout.split()]
    assert len(got) == len(pairs)
    for (lse, s), g in zip(pairs, got, strict=True):
        if lse == -math.inf:
            assert g == 0.0, (lse, s, g)
        elif math.isnan(lse) or math.isnan(s):
            assert math.isnan(g), (lse, s, g)
        else:
            want = torch.sigmoid(torch.tensor(lse - s, dtype=torch.float64)).item()
            assert g == pytest.approx(want, rel=1e-6, abs=1e-30), (lse, s, g)


# ----------------------------------------------------------------------------- the op
def _sink_param(spec, hq, hkv, g):
    return torch.randn(hkv if "num_heads_kv" in spec.param("sinks").shape else hq, generator=g) * 2


def _problem(spec, b=2, hq=8, hkv=2, s=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, 1, spec.head_dim, generator=g).to(BF16)
    kc = torch.randn(b, hkv, s, spec.head_dim, generator=g).to(BF16)
    vc = torch.randn(b, hkv, s, spec.head_dim_v, generator=g).to(BF16)
    lens = torch.tensor([5, 40][:b], dtype=torch.int32)
    return q, kc, vc, lens, {"sinks": _sink_param(spec, hq, hkv, g)}


def _fake_units(spec, options: Options, target="sm_90"):
    """A decode unit's kernels as loaded ones (no module: the driver is faked)."""
    from flashgen.runtime import launch as runtime

    unit = registry.plan_decode(spec, target, options)
    return {r: runtime.LoadedKernel(plan=unit.kernel(r), module=None,
                                    function=types.SimpleNamespace(ptr=11 + i), device_index=0)
            for i, r in enumerate(("attn", "append"))}  # fmt: skip


@pytest.fixture
def fake_driver(monkeypatch):
    """The planned fast path on CPU tensors: the driver's launches recorded (``fn, grid,
    threads, smem, params``), the eager-CUDA and device checks passed; the torch epilogue's
    calls (``flashgen.ops.sink.apply_sink``) recorded in ``.epilogues``."""
    from flashgen.ops import calls as calls_mod
    from flashgen.ops.decode import fast as dfast
    from flashgen.runtime import tma

    rec = types.SimpleNamespace(launches=[], epilogues=[])

    class Driver:
        @staticmethod
        def cuLaunchKernel(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            rec.launches.append((fn, (gx, gy, gz), bx, smem, params))
            return 0

    real = sink_mod.apply_sink
    monkeypatch.setattr(tma, "driver", lambda: Driver)
    monkeypatch.setattr(dfast, "_eager_cuda", lambda q, k, v: True)
    monkeypatch.setattr(dfast, "_GET_DEVICE", lambda: None)
    monkeypatch.setattr(calls_mod, "_RAW_STREAM", lambda index: 7)
    monkeypatch.setattr(sink_mod, "apply_sink",
                        lambda o, lse, s: rec.epilogues.append(s) or real(o, lse, s))  # fmt: skip
    return rec


def _planned(op, options, dims, splits):
    from flashgen.ops.decode import fast as dfast

    dop = decode_op(op)
    plan = dop.plan_for(dims, torch.device("cpu"), splits, options=options.decode)
    plan.kernels = _fake_units(op.spec, options)
    if splits > 1:
        plan.o_part, plan.lse_part, plan.counters = dfast._workspace(
            dims, plan.geometry, splits, torch.device("cpu")
        )
    plan.fast = dfast._FastPath(dop, plan)
    return dop, plan


def _unpack(layout, params) -> dict:
    base = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))[0]
    raw = ctypes.string_at(base, layout.size)
    return dict(zip(layout.names, layout.struct.unpack_from(raw, 0), strict=True))


@pytest.mark.parametrize("splits", [1, 4])
def test_the_planned_fast_path_passes_the_sink_params_own_address(fake_driver, splits):
    """``sinks[h]`` of a float32 tensor: the kernel reads the param itself (strides 0, 1 for
    [B, Hq]); ``with_kvcache`` runs no torch epilogue; ``apply_sink=False`` passes null (the
    keys alone); a second call with another sink tensor of the same layout passes its
    address without re-validating."""
    op = build_op(load_spec(SINK_SPEC), ON)
    q, kc, vc, lens, params = _problem(op.spec)
    dims = DecodeDims(2, 8, 2, 1, 64, False, 2, 64, 1, False)
    _, plan = _planned(op, ON, dims, splits)
    assert plan.fused_sink and plan.num_splits == splits
    layout = plan.fast.attn_layout
    op.with_kvcache(q, kc, vc, lens, plan=plan, **params)
    got = _unpack(layout, fake_driver.launches[-1][4])
    assert got["sink"] == params["sinks"].data_ptr() and (got["sink_sb"], got["sink_sh"]) == (0, 1)
    assert got["t_sinks"] == params["sinks"].data_ptr() and fake_driver.epilogues == []
    other = params["sinks"] + 1
    op.with_kvcache(q, kc, vc, lens, plan=plan, sinks=other)
    assert _unpack(layout, fake_driver.launches[-1][4])["sink"] == other.data_ptr()
    op.with_kvcache(q, kc, vc, lens, plan=plan, apply_sink=False, **params)
    assert _unpack(layout, fake_driver.launches[-1][4])["sink"] == 0
    assert fake_driver.epilogues == [] and len(fake_driver.launches) == 3


def test_the_fast_path_computes_a_sink_that_is_no_view_of_a_param(fake_driver, monkeypatch):
    """``s0 + sinks[h_kv]``: the call's logits (float32 [B, Hq], as
    :func:`~flashgen.ops.sink.sink_logits` computes them), their address and strides."""
    op = build_op(_kv_sink_spec(), ON)
    q, kc, vc, lens, params = _problem(op.spec)
    dims = DecodeDims(2, 8, 2, 1, 64, False, 2, 64, 1, False)
    dop, plan = _planned(op, ON, dims, 1)
    made = []
    real = dop.sink_values

    def record(*args):
        made.append(real(*args))
        return made[-1]

    monkeypatch.setattr(dop, "sink_values", record)
    op.with_kvcache(q, kc, vc, lens, plan=plan, s0=1.5, **params)
    got = _unpack(plan.fast.attn_layout, fake_driver.launches[-1][4])
    want = sink_logits(op.spec, {"s0": 1.5, **params}, batch=2, heads_q=8, heads_kv=2,
                       device="cpu")  # fmt: skip
    sink = made[-1]["sink"]  # the call's (the layout's were packed from the first)
    assert got["sink"] == sink.data_ptr() != params["sinks"].data_ptr()
    assert (got["sink_sb"], got["sink_sh"]) == (made[-1]["sink_sb"], made[-1]["sink_sh"])
    assert (made[-1]["sink_sb"], made[-1]["sink_sh"]) == sink.stride()
    assert sink.dtype == torch.float32 and torch.equal(sink, want)
    assert fake_driver.epilogues == []


def test_an_unfused_plan_passes_no_sink_and_the_epilogue_runs(fake_driver):
    op = build_op(load_spec(SINK_SPEC))
    q, kc, vc, lens, params = _problem(op.spec)
    dims = DecodeDims(2, 8, 2, 1, 64, False, 2, 64, 1, False)
    _, plan = _planned(op, OFF, dims, 1)
    assert not plan.fused_sink and "sink" not in plan.fast.attn_layout.names
    op.with_kvcache(q, kc, vc, lens, plan=plan, **params)
    assert len(fake_driver.launches) == 1 and len(fake_driver.epilogues) == 1


def test_launch_values_carry_the_sink_only_for_a_fused_unit():
    spec = load_spec(SINK_SPEC)
    q, kc, vc, lens, params = _problem(spec)
    o, lse = torch.empty(2, 8, 1, 64, dtype=BF16), torch.empty(2, 8, 1)
    dims = DecodeDims(2, 8, 2, 1, 64, False, 2, 64, 1, False)
    logits = sink_logits(spec, params, batch=2, heads_q=8, heads_kv=2, device="cpu")
    for options in (ON, OFF):
        dop = decode_op(build_op(spec, options))
        plan = dop.plan_for(dims, torch.device("cpu"), 1, options=options.decode)
        plan.kernels = _fake_units(spec, options)
        args = (plan, q, kc, vc, lens, None, o, lse, 0.125, [], params)
        joined, keys = dop.launch_values(*args, sink=logits), dop.launch_values(*args)
        if options is ON:
            assert joined["sink"] is logits and (joined["sink_sb"], joined["sink_sh"]) == (0, 1)
            assert keys["sink"] == 0
        else:
            assert "sink" not in joined and "sink" not in keys


def test_the_general_launch_joins_the_sink_and_skips_the_epilogue(fake_driver, monkeypatch):
    """``_with_kvcache``'s eager CUDA branch (``q.is_cuda`` faked; a plan with fake kernels
    and ``num_splits``, so the fast path steps aside): it computes the logits, the kernel
    gets them, the epilogue does not run; ``apply_sink=False``: null."""
    from flashgen.ops.decode import op as dmod

    op = build_op(load_spec(SINK_SPEC), ON)
    q, kc, vc, lens, params = _problem(op.spec)
    dims = DecodeDims(2, 8, 2, 1, 64, False, 2, 64, 1, False)
    _, plan = _planned(op, ON, dims, 2)
    launched = []
    for role in ("attn", "append"):
        k = plan.kernels[role]
        plan.kernels[role] = types.SimpleNamespace(
            plan=k.plan, launch=lambda grid, values, stream: launched.append(values)
        )
    monkeypatch.setattr(dmod, "current_stream_ptr", lambda device: 0)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    op.with_kvcache(q, kc, vc, lens, plan=plan, num_splits=2, **params)
    op.with_kvcache(q, kc, vc, lens, plan=plan, num_splits=2, apply_sink=False, **params)
    monkeypatch.undo()
    assert fake_driver.launches == []  # the general path, not the fast one
    sink = launched[0]["sink"]
    assert isinstance(sink, torch.Tensor) and sink.data_ptr() == params["sinks"].data_ptr()
    assert (launched[0]["sink_sb"], launched[0]["sink_sh"]) == (0, 1)
    assert launched[1]["sink"] == 0 and fake_driver.epilogues == []


# ----------------------------------------------------------------------------- host cost
def _aten_ops(call) -> list[str]:
    """The aten ops one ``call()`` runs, in order (the profiler's CPU events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    return [e.name for e in prof.events() if e.name.startswith("aten::")]


def _unplanned(op, monkeypatch, splits=2):
    """An unplanned ``with_kvcache`` on CPU tensors through the general path's direct launch
    (``_direct_cuda`` passed; ``plan_for`` answers a fused-sink plan whose kernels record
    their values): returns the list the launches' values go to."""
    from flashgen.ops.decode import op as dmod

    dims = DecodeDims(2, 8, 2, 1, 64, False, 2, 64, 1, False)
    dop, plan = _planned(op, ON, dims, splits)
    launched = []
    for role in ("attn", "append"):
        k = plan.kernels[role]
        plan.kernels[role] = types.SimpleNamespace(
            plan=k.plan, launch=lambda grid, values, stream: launched.append(values)
        )
    monkeypatch.setattr(dmod, "_direct_cuda", lambda q, k, v: True)
    monkeypatch.setattr(dmod, "current_stream_ptr", lambda device: 0)
    monkeypatch.setattr(dop, "plan_for", lambda *a, **k: plan)
    return launched


@pytest.mark.parametrize("splits", [1, 2])
def test_a_sink_call_launches_and_runs_the_torch_ops_of_one_without(fake_driver, monkeypatch,
                                                                     splits):  # fmt: skip
    """The host cost of the fused sink (``flashgen bench --training``'s "gpt_oss_sink decode"
    row): a call that joins a float32 ``sinks[h]`` launches what ``apply_sink=False`` does
    (one kernel) and runs the same torch ops (no view, expand, copy or epilogue: the kernel
    reads the param itself, ``sink_sb`` 0), planned (the fast path) and unplanned (the
    general path's direct launch)."""
    op = build_op(load_spec(SINK_SPEC), ON)
    q, kc, vc, lens, params = _problem(op.spec)
    dims = DecodeDims(2, 8, 2, 1, 64, False, 2, 64, 1, False)
    _, plan = _planned(op, ON, dims, splits)
    layout = plan.fast.attn_layout
    runs = {}
    for sink in (False, True):
        call = functools.partial(op.with_kvcache, q, kc, vc, lens, plan=plan, apply_sink=sink,
                                 **params)  # fmt: skip
        call()  # the layout validated and packed
        before = len(fake_driver.launches)
        runs[sink] = _aten_ops(call)
        assert len(fake_driver.launches) == before + 1
        got = _unpack(layout, fake_driver.launches[-1][4])
        assert got["sink"] == (params["sinks"].data_ptr() if sink else 0)
    assert runs[True] == runs[False]
    launched = _unplanned(op, monkeypatch, splits)
    runs = {}
    for sink in (False, True):
        call = functools.partial(op.with_kvcache, q, kc, vc, lens, apply_sink=sink, **params)
        call()
        before = len(launched)
        runs[sink] = _aten_ops(call)
        assert len(launched) == before + 1
        if sink:
            assert launched[-1]["sink"] is params["sinks"]
            assert (launched[-1]["sink_sb"], launched[-1]["sink_sh"]) == (0, 1)
        else:
            assert launched[-1]["sink"] == 0
    assert runs[True] == runs[False]
    assert fake_driver.epilogues == []


def test_a_decode_call_walks_no_ir_for_its_sink(fake_driver, monkeypatch):
    """The sink's IR is analysed once per op (:class:`~flashgen.ops.sink.SinkRead`, made with
    the decode op): no call builds one or walks the sink (``reads_param``), planned or not;
    a computed sink (``s0 + sinks[h_kv]``) walks it on its op's first evaluation at most."""
    walks, reads = [], []
    real_walk, real_init = sink_mod.reads_param, sink_mod.SinkRead.__init__
    monkeypatch.setattr(sink_mod, "reads_param", lambda *a: walks.append(a) or real_walk(*a))
    monkeypatch.setattr(sink_mod.SinkRead, "__init__",
                        lambda self, spec: reads.append(spec) or real_init(self, spec))  # fmt: skip
    op = build_op(load_spec(SINK_SPEC), ON)
    q, kc, vc, lens, params = _problem(op.spec)
    dims = DecodeDims(2, 8, 2, 1, 64, False, 2, 64, 1, False)
    dop, plan = _planned(op, ON, dims, 1)
    assert dop.sink_read.subs == ("h",)
    made = len(reads)  # the decode op's, unless an earlier test built it (ops are cached)
    for _ in range(3):
        op.with_kvcache(q, kc, vc, lens, plan=plan, **params)
    launched = _unplanned(op, monkeypatch)
    for _ in range(3):
        op.with_kvcache(q, kc, vc, lens, **params)
    assert len(launched) == 3 and launched[-1]["sink"] is params["sinks"]
    assert len(fake_driver.launches) == 3 and (walks, len(reads)) == ([], made)
    op = build_op(_kv_sink_spec(), ON)
    q, kc, vc, lens, params = _problem(op.spec)
    _, plan = _planned(op, ON, dims, 1)
    made = len(reads)
    op.with_kvcache(q, kc, vc, lens, plan=plan, s0=1.5, **params)
    first = len(walks)
    assert first <= len(op.spec.params) and len(reads) == made
    for _ in range(3):
        op.with_kvcache(q, kc, vc, lens, plan=plan, s0=1.5, **params)
    assert (len(walks), len(reads)) == (first, made) and len(fake_driver.launches) == 7


def test_fused_sink_values_pass_a_float32_param_itself_with_its_strides():
    """:func:`~flashgen.ops.sink.fused_sink_values`: ``sinks[h]`` / ``sinks[b, h]`` of a float32
    tensor on the device: the tensor itself and its strides (a strided or stride-0 one
    too); another dtype, a per-kv-head or computed sink: the logits of
    :func:`~flashgen.ops.sink.sink_logits` (float32 ``[B, Hq]``), equal to the param's."""
    cpu = torch.device("cpu")
    read = sink_mod.SinkRead(load_spec(SINK_SPEC))
    assert (read.name, read.subs) == ("sinks", ("h",))
    kw = dict(batch=3, heads_q=8, heads_kv=2, device=cpu)
    per_head = torch.randn(8)
    got = sink_mod.fused_sink_values(read, {"sinks": per_head}, **kw)
    assert got["sink"] is per_head and (got["sink_sb"], got["sink_sh"]) == (0, 1)
    strided = torch.randn(16)[::2]
    got = sink_mod.fused_sink_values(read, {"sinks": strided}, **kw)
    assert got["sink"] is strided and (got["sink_sb"], got["sink_sh"]) == (0, 2)
    half = per_head.to(torch.bfloat16)
    got = sink_mod.fused_sink_values(read, {"sinks": half}, **kw)
    assert got["sink"].dtype == torch.float32 and list(got["sink"].shape) == [3, 8]
    assert torch.equal(got["sink"], half.float().expand(3, 8))
    assert (got["sink_sb"], got["sink_sh"]) == got["sink"].stride()
    per_bh = loads_spec(
        "name: sink_bh\nhead_dim: 64\ndtype: bf16\nmask: causal\nsink: sinks[b, h]\n"
        "params:\n  sinks: {type: f32, shape: [batch, num_heads]}\n",
        "sink_bh.yaml",
    )
    read = sink_mod.SinkRead(per_bh)
    for t in (torch.randn(3, 8), torch.randn(8, 3).t(), torch.randn(8).expand(3, 8)):
        got = sink_mod.fused_sink_values(read, {"sinks": t}, **kw)
        assert got["sink"] is t and (got["sink_sb"], got["sink_sh"]) == t.stride()
    read = sink_mod.SinkRead(_kv_sink_spec())
    assert read.subs is None
    sinks = torch.randn(2)
    got = sink_mod.fused_sink_values(read, {"sinks": sinks, "s0": 1.5}, **kw)
    want = (1.5 + sinks).repeat_interleave(4).expand(3, 8)
    assert torch.allclose(got["sink"], want) and got["sink"].dtype == torch.float32
    with pytest.raises(ValueError, match="has no sink"):
        sink_mod.SinkRead(loads_spec("name: plain\nhead_dim: 64\ndtype: bf16\n", "p.yaml"))


def test_a_bad_sink_param_is_named_on_the_direct_paths(fake_driver, monkeypatch):
    """The checks before the sink's arguments still name ``sinks`` (the direct launch of an
    unplanned call, the planned fast path's validation of a new layout)."""
    op = build_op(load_spec(SINK_SPEC), ON)
    q, kc, vc, lens, params = _problem(op.spec)
    dims = DecodeDims(2, 8, 2, 1, 64, False, 2, 64, 1, False)
    _, plan = _planned(op, ON, dims, 1)
    bad = [(torch.randn(4), r"sinks: expected shape \[8\]"), ([0.0] * 8, "sinks: expected a torch"),
           (torch.zeros(8, dtype=torch.int32), "sinks: expected a floating-point")]  # fmt: skip
    for kw in ({"plan": plan}, {}):
        if not kw:
            _unplanned(op, monkeypatch)
        for sinks, msg in bad:
            with pytest.raises(OpInputError, match=msg):
                op.with_kvcache(q, kc, vc, lens, sinks=sinks, **kw)
        with pytest.raises(OpInputError, match="sinks: missing tensor param"):
            op.with_kvcache(q, kc, vc, lens, **kw)


def test_the_cpu_op_is_unchanged_and_a_sink_that_requires_grad_is_refused():
    """The option changes nothing on the CPU (the registered op's reference, then the torch
    epilogue): padded, ragged, paged and split calls equal the unfused op's bitwise; a sink
    that requires grad is refused with grad enabled, as without the option."""
    spec = load_spec(SINK_SPEC)
    off, on = build_op(spec, OFF), build_op(spec, ON)
    q, kc, vc, lens, params = _problem(spec)
    for kw in ({}, {"num_splits": 3}, {"apply_sink": False}):
        a, b = off.with_kvcache(q, kc, vc, lens, **kw, **params), on.with_kvcache(
            q, kc, vc, lens, **kw, **params
        )
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    pages = kc.permute(0, 2, 1, 3).reshape(8, 16, 2, 64)  # request b's pages 4b .. 4b + 3
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    pv = vc.permute(0, 2, 1, 3).reshape(8, 16, 2, 64)
    a = off.with_kvcache(q, pages, pv, lens, block_table=table, **params)
    b = on.with_kvcache(q, pages, pv, lens, block_table=table, **params)
    assert torch.equal(a[0], b[0])
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    qr = q[:, :, 0].contiguous()  # [total_q, Hq, D]
    a = off.with_kvcache(qr, kc, vc, lens, cu_seqlens_q=cu, max_seqlen_q=1, **params)
    b = on.with_kvcache(qr, kc, vc, lens, cu_seqlens_q=cu, max_seqlen_q=1, **params)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    sinks = params["sinks"].clone().requires_grad_()
    for op in (off, on):
        with pytest.raises(OpInputError, match="sinks: expected a tensor that does not require"):
            op.with_kvcache(q, kc, vc, lens, sinks=sinks)
        with torch.no_grad():
            assert torch.equal(op.with_kvcache(q, kc, vc, lens, sinks=sinks)[0],
                               off.with_kvcache(q, kc, vc, lens, **params)[0])  # fmt: skip


# ----------------------------------------------------------------------------- nvcc
SINK_PARAM = "sink: sinks[h]\nparams:\n  sinks: {type: f32, shape: [num_heads]}\n"


def _compile_specs():
    """The shipped sink spec (d64) and sink specs at the other shapes of the decode family:
    d128 with a sliding window (a scalar param), d256 (two warps along the output's columns)
    and MLA's one latent cache (576 / 512, ``v_from_k``)."""
    mla = (ROOT / "specs" / "mla_decode.yaml").read_text().replace("name: mla_decode",
                                                                    "name: sink_mla")
    return [
        load_spec(SINK_SPEC),
        loads_spec("name: sink_swa_d128\nhead_dim: 128\ndtype: bf16\n"
                   "mask: causal && q_idx + seqlen_k - seqlen_q - kv_idx < window\n"
                   "sink: sinks[h]\nparams:\n  sinks: {type: f32, shape: [num_heads]}\n"
                   "  window: {type: i32, default: 128}\n", "sink_swa_d128.yaml"),
        loads_spec("name: sink_d256\nhead_dim: 256\ndtype: bf16\nmask: causal\n" + SINK_PARAM,
                   "sink_d256.yaml"),
        loads_spec(mla + SINK_PARAM, "sink_mla.yaml"),
    ]  # fmt: skip


def _compile(job):
    spec, target, ragged, cache_dtype = job
    plan = registry.plan_decode(spec, target, ON, ragged=ragged, cache_dtype=cache_dtype)
    assert plan.fused_sink
    _, report = cache.get_or_build(render(plan), plan)
    return job, plan, report


def test_every_fused_sink_unit_compiles_without_spills(requires_nvcc):
    """Each spec on sm_80 (padded, spec-dtype cache) and sm_90a (ragged, e4m3 cache): 8 nvcc
    runs, in parallel; both kernels of each unit, spill-free."""
    jobs = [(s, t, t == "sm_90", "fp8_e4m3" if t == "sm_90" else None)
            for s in _compile_specs() for t in family.TARGETS]  # fmt: skip
    workers = int(os.environ.get("FLASHGEN_TEST_JOBS", (os.cpu_count() or 1) + 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(_compile, jobs))
    problems = []
    for (spec, target, ragged, cache_dtype), plan, report in results:
        names = {k.name for k in report.kernels}
        assert names == {plan.kernel("attn").kernel_name, plan.kernel("append").kernel_name}
        for k in report.kernels:
            assert 0 < k.registers <= 255
            if k.spill_bytes:
                problems.append(f"{spec.name} {target} ragged={ragged} {cache_dtype}: {k}")
    assert not problems, "fused-sink decode kernels spill:\n" + "\n".join(problems)
