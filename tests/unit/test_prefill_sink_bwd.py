"""The backward of a fused-sink forward (``Options.fa2_fwd.fused_sink`` /
``hopper_fwd.fused_sink``, issue 37) in the backward's pre kernel, on the CPU: the sink form of
every backward unit (FA2-class deterministic and atomic, Hopper, Hopper ordered) differs from
the default unit in its pre kernel alone (named ``..._pre_sink``, the extra arguments of
:func:`flashgen.families.bwd_common.backward_abi` last, ``fg::sink_lse`` / ``fg::sink_row_grad``
of templates/common/sink_bwd.cuh), and nothing renders it with the option off
(``fused_sink=False``; the plain units stay byte-identical either way:
tests/unit/test_unit_hashes.py); those helpers, run on the host, equal float64 torch; the op
registers ``<name>__backward_sink`` for a padded sink spec only, whose CPU implementation gives
the float64 reference's gradients and whose CUDA implementation (its kernels faked from their
arguments) launches the sink form with the sink-inclusive lse in a workspace, the saved lse
untouched, and d sink from atomics or per-row terms summed in a fixed order; the sink units
compile for sm_80 and sm_90a without spills.  The autograd node's choice of op:
tests/unit/test_prefill_sink.py.  On the GPU: tests/gpu/test_prefill_sink_gpu.py."""

from __future__ import annotations

import math
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from flashgen.build.render import render
from flashgen.families import hopper_bwd, registry
from flashgen.families.build import build_backward
from flashgen.families.bwd_common import backward_abi
from flashgen.frontend.errors import OpInputError
from flashgen.frontend.spec import load_spec, loads_spec
from flashgen.ops.cpu.reference import attention_reference
from flashgen.ops.op import build_op
from flashgen.ops.prefill import backward as backward_mod
from flashgen.ops.prefill.backward import Backward, backward_sink_schema
from flashgen.ops.sink import apply_sink
from flashgen.options import DEFAULT, Options

ROOT = Path(__file__).resolve().parents[2]
SINK_SPEC = ROOT / "specs" / "gpt_oss_sink.yaml"
HEADER = ROOT / "templates" / "common" / "sink_bwd.cuh"
ON = Options()  # the default: both forward families join the sink
OFF = Options().with_values({"fa2_fwd.fused_sink": False, "hopper_fwd.fused_sink": False})
F64 = torch.float64
#: The pre kernel's arguments of the sink form, after the default ones (backward_abi).
SINK_PRE_ARGS = [("lse_keys", "const float*"), ("lse", "float*"), ("sink", "const float*"),
                 ("sink_sb", "int64_t"), ("sink_sh", "int64_t"), ("dsink", "float*"),
                 ("dsink_rows", "int")]  # fmt: skip


def _spec(name, sink, params, mask="causal", head_dim=64):
    return loads_spec(
        f"name: {name}\nhead_dim: {head_dim}\ndtype: bf16\nmask: {mask}\nsink: {sink}\n"
        f"params:\n{params}\n",
        f"{name}.yaml",
    )


SPECS = {
    "gpt_oss_sink": lambda: load_spec(SINK_SPEC),
    "swa_d128": lambda: _spec("bsink_swa_d128", "sinks[h]",
                              "  sinks: {type: f32, shape: [num_heads]}\n"
                              "  window: {type: i32, default: 100}",
                              mask="causal && q_idx + seqlen_k - seqlen_q - kv_idx < window",
                              head_dim=128),
    "per_batch_head_d256": lambda: _spec("bsink_bh_d256", "sinks[b, h]",
                                         "  sinks: {type: f32, shape: [batch, num_heads]}",
                                         head_dim=256),
}  # fmt: skip


def _plans(spec, sink: bool) -> dict:
    """Every backward unit form of ``spec`` (a key per form), plain or the sink form."""
    out = {
        "sm_80": registry.plan_backward(spec, "sm_80", ON, sink=sink),
        "sm_80_atomic": registry.plan_backward(spec, "sm_80", ON, atomic_dq=True, sink=sink),
        "sm_90_atomic": registry.plan_backward(spec, "sm_90", ON, atomic_dq=True, sink=sink),
        "sm_90_wgmma": registry.plan_hopper_backward(spec, "sm_90", ON, sink=sink),
    }
    if hopper_bwd.ordered_eligible(spec, "sm_90"):
        out["sm_90_wgmma_ordered"] = registry.plan_hopper_backward(
            spec, "sm_90", ON, ordered_dq=True, sink=sink
        )
    return out


def _kernel_chunks(src: str, pre_name: str) -> list[str]:
    """The source after the first kernel, cut at each ``extern "C"``, the pre kernel's chunk
    left out (what follows it up to the next kernel is the same in both forms)."""
    chunks = src.split('extern "C"')[1:]
    return [c for c in chunks if f"{pre_name}(" not in c]


# ----------------------------------------------------------------------------- the units
@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_sink_form_differs_in_its_pre_kernel_alone(name):
    spec = SPECS[name]()
    sink, plain = _plans(spec, True), _plans(spec, False)
    assert ("sm_90_wgmma_ordered" in sink) == (name == "gpt_oss_sink")
    for form, plan in sink.items():
        base = plain[form]
        assert plan.sink and not base.sink, form
        assert plan.pre.kernel_name == base.pre.kernel_name + "_sink", form
        rest = [k.kernel_name for k in base.kernels[1:]]
        assert [k.kernel_name for k in plan.kernels[1:]] == rest, form
        n = len(base.pre.args)
        assert plan.pre.args[:n] == base.pre.args, form
        assert [(a.name, a.ctype) for a in plan.pre.args[n:]] == SINK_PRE_ARGS, form
        for a, b in zip(plan.kernels[1:], base.kernels[1:], strict=True):
            assert a.args == b.args and a.smem_bytes == b.smem_bytes and a.tiles == b.tiles
        assert plan.tiles == base.tiles
        assert plan.grids(2, 8, 2, 1000, 999) == base.grids(2, 8, 2, 1000, 999)
        src, plain_src = render(plan.unit), render(base.unit)
        assert "FG_SINK_BWD_CUH" in src and src.count("fg::sink_lse(") == 1, form
        assert "atomicAdd(dsink + bh, g)" in src and "if (dsink_rows) dsink[row] = g;" in src
        assert "__ldg(sink + bb * sink_sb + hh * sink_sh)" in src, form
        for code in ("FG_SINK_BWD_CUH", "sink_lse", "dsink", "lse_keys", "sink_sb"):
            assert code not in plain_src, (form, code)
        assert _kernel_chunks(src, plan.pre.kernel_name) == _kernel_chunks(
            plain_src, base.pre.kernel_name
        ), form


def test_the_sink_form_needs_a_sink_and_stays_out_of_the_unfused_units():
    llama = load_spec(ROOT / "specs" / "llama3_gqa.yaml")
    with pytest.raises(ValueError, match="has no sink"):
        registry.plan_backward(llama, "sm_80", ON, sink=True)
    with pytest.raises(ValueError, match="has no sink"):
        registry.plan_hopper_backward(llama, "sm_90", ON, sink=True)
    spec = load_spec(SINK_SPEC)
    for target in ("sm_80", "sm_90"):
        units = registry.compile_units(spec, target, OFF)
        assert not any(k.endswith("_sink") or u.context.get("sink") for k, u in units.items())
        on = registry.compile_units(spec, target, ON)
        assert on["bwd_sink"].context["sink"] and not on["bwd"].context["sink"]
        assert set(registry.compile_units(spec, target, DEFAULT)) == set(on)  # on by default
        assert render(on["bwd"]) == render(units["bwd"])
    packed = load_spec(SINK_SPEC)
    from flashgen.ops.prefill.varlen import varlen_spec

    varlen = registry.compile_units(varlen_spec(packed), "sm_80", ON)
    assert not any(k.endswith("_sink") for k in varlen)  # the varlen op keeps the torch path
    with pytest.raises(ValueError, match="is varlen"):
        registry.plan_backward(varlen_spec(packed), "sm_80", ON, sink=True)


def test_backward_abi_puts_the_sink_arguments_after_the_pre_kernels_sizes():
    spec = load_spec(SINK_SPEC)
    for atomic in (False, True):
        plain, sink = backward_abi(spec, atomic), backward_abi(spec, atomic, sink=True)
        n = len(plain["pre_args"])
        assert sink["pre_args"][:n] == plain["pre_args"]
        assert [(a.name, a.ctype) for a in sink["pre_args"][n:]] == SINK_PRE_ARGS
        assert [a.name for a in plain["pre_args"]][-3:] == ["batch", "heads_q", "seqlen_q"]
        assert {k: v for k, v in sink.items() if k != "pre_args"} == {
            k: v for k, v in plain.items() if k != "pre_args"
        }


# ----------------------------------------------------------------------------- host
PROGRAM = r"""
#include "HEADER"
#include <cstdio>
int main() {
    float lse, sink, d;
    while (scanf("%f %f %f", &lse, &sink, &d) == 3)
        printf("%.9g %.9g\n", fg::sink_lse(lse, sink), fg::sink_row_grad(lse, sink, d));
    return 0;
}
"""


def test_sink_lse_and_row_grad_on_the_host_match_float64(host_exe):
    """``fg::sink_lse`` against float64 ``logaddexp(lse, sink)`` (-inf for both -inf, the
    sink for a row with no key, NaN in gives NaN) and ``fg::sink_row_grad`` against
    ``-sigmoid(sink - lse) * d`` (0 for lse = -inf whatever the sink)."""
    exe = host_exe(PROGRAM.replace("HEADER", str(HEADER)), "sink_bwd_host")
    lses = [-math.inf, -1e4, -30.0, -2.5, 0.0, 1.0, 7.25, 88.0, 1e4, math.nan]
    sinks = [-math.inf, -90.0, -3.0, 0.0, 0.5, 3.0, 95.0, math.nan]
    triples = [(a, b, d) for a in lses for b in sinks for d in (-1.5, 0.0, 3.0)]
    text = "".join(f"{a!r} {b!r} {d!r}\n" for a, b, d in triples)
    run = subprocess.run([str(exe)], input=text, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    got = [float(v) for v in run.stdout.split()]
    assert len(got) == 2 * len(triples)
    for (lse, s, d), g_lse, g in zip(triples, got[::2], got[1::2], strict=True):
        t = torch.tensor([lse, s], dtype=F64)
        want_lse = torch.logaddexp(t[0], t[1]).item()
        if math.isnan(want_lse):
            assert math.isnan(g_lse), (lse, s, g_lse)
        elif math.isinf(want_lse):
            assert g_lse == want_lse, (lse, s, g_lse)
        else:
            assert g_lse == pytest.approx(want_lse, rel=1e-6, abs=1e-6), (lse, s, g_lse)
        if lse == -math.inf:
            assert g == 0.0, (lse, s, d, g)
        elif math.isnan(lse) or math.isnan(s):
            assert math.isnan(g), (lse, s, d, g)
        else:
            want = -(torch.sigmoid(t[1] - t[0]) * d).item()
            assert g == pytest.approx(want, rel=1e-6, abs=1e-30), (lse, s, d, g)


# ----------------------------------------------------------------------------- the op
def test_the_sink_form_of_the_backward_op_is_registered_for_padded_sink_specs_only():
    spec = load_spec(SINK_SPEC)
    op = build_op(spec, ON)
    ops = torch.ops.flashgen
    assert hasattr(ops, f"{op.name}__backward_sink") and hasattr(ops, f"{op.name}__backward")
    assert not hasattr(ops, f"{op.name}__varlen__backward_sink")
    assert backward_sink_schema(op.spec) == (
        f"{op.name}__backward_sink(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor o, "
        "Tensor lse, Tensor sink, float softmax_scale, bool deterministic, Tensor sinks, *, bool[] "
        "param_grads=[]) -> (Tensor, Tensor, Tensor, Tensor[], Tensor)"
    )
    llama = build_op(load_spec(ROOT / "specs" / "llama3_gqa.yaml"))
    assert not hasattr(ops, f"{llama.name}__backward_sink")


def _problem(seed=0, b=2, hq=8, hkv=2, sq=13, sk=9, d=64):
    """float64 inputs (Sq > Sk: rows with no key under causal), float32 per-head sinks, the
    fused forward's o (keys' o with the sink joined) and the keys' lse."""
    spec = load_spec(SINK_SPEC)
    op = build_op(spec, ON)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, generator=g, dtype=F64)
               for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))  # fmt: skip
    sinks = torch.randn(hq, generator=g) * 2
    o_keys, lse = op.attention(q, k, v, sinks=sinks, apply_sink=False)
    logits = sinks.expand(b, hq)
    o = apply_sink(o_keys, lse, logits.unsqueeze(-1))
    do = torch.randn(o.shape, generator=g, dtype=F64)
    return spec, op, (q, k, v), sinks, logits, o, lse, do


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_cpu_sink_form_gives_the_float64_references_gradients(deterministic):
    spec, op, (q, k, v), sinks, logits, o, lse, do = _problem()
    bwd = getattr(torch.ops.flashgen, f"{op.name}__backward_sink")
    dq, dk, dv, dparams, dsink = bwd(do, q, k, v, o, lse, logits, op.spec.softmax_scale or 0.125,
                                     deterministic, sinks)  # fmt: skip
    assert dparams == [] and dsink.shape == (2, 8) and dsink.dtype == F64
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    s = sinks.double().requires_grad_()
    ro, _ = attention_reference(spec, *leaves, params={"sinks": s},
                                softmax_scale=op.spec.softmax_scale or 0.125)  # fmt: skip
    torch.testing.assert_close(ro, o, rtol=1e-10, atol=1e-10)
    ro.backward(do)
    for what, ours, leaf in zip("qkv", (dq, dk, dv), leaves, strict=True):
        torch.testing.assert_close(ours, leaf.grad, rtol=1e-8, atol=1e-9, msg=f"d{what}")
    torch.testing.assert_close(dsink.sum(0), s.grad, rtol=1e-8, atol=1e-9, msg="dsinks")
    with pytest.raises(OpInputError, match="sink: expected logits"):
        bwd(do, q, k, v, o, lse, logits[:, :4], 0.125, deterministic, sinks)


class _FakeKernel:
    """A loaded kernel of a backward unit on the CPU: its launch does what the kernel does from
    its arguments (:func:`~flashgen.families.bwd_common.backward_abi`), recorded in
    ``launched`` as ``(role, values)``.  pre: dsum = rowsum(dO * O) and, in the sink form,
    ``lse = logaddexp(lse_keys, sink)`` and the rows' terms of d sink (stored per row or
    added per (b, h)); dkdv / last: the CPU backward against ``values["lse"]`` (dk, dv; dq)."""

    def __init__(self, op, plan, role, launched):
        self.op, self.plan, self.role, self.launched = op, plan, role, launched

    def launch(self, grid, values, stream):
        self.launched.append((self.role, dict(values)))
        o, do = values["o"], values["dout"]
        if self.role == "pre":
            d = (o.to(F64) * do.to(F64)).sum(-1)
            values["dsum"].copy_(d)
            if self.plan.sink:
                b, h = o.shape[:2]
                s = values["sink"]
                logits = torch.as_strided(s, (b, h), (values["sink_sb"], values["sink_sh"]),
                                          s.storage_offset()).to(F64)  # fmt: skip
                keys = values["lse_keys"].to(F64)
                values["lse"].copy_(torch.logaddexp(keys, logits.unsqueeze(-1)))
                g = torch.where(keys == -math.inf, torch.zeros((), dtype=F64),
                                -torch.sigmoid(logits.unsqueeze(-1) - keys) * d)  # fmt: skip
                if values["dsink_rows"]:
                    values["dsink"].copy_(g)
                else:
                    values["dsink"].add_(g.sum(-1))
            return
        from flashgen.ops.cpu.attention import attention_blocked_backward

        spec = self.op.spec
        params = {p.name: values[f"t_{p.name}"].to(F64) for p in spec.tensor_params}
        dq, dk, dv, _ = attention_blocked_backward(
            spec, do, values["q"], values["k"], values["v"], softmax_scale=values["softmax_scale"],
            params=params, o=o, lse=values["lse"],
        )  # fmt: skip
        if self.role == "dkdv":
            values["dk"].copy_(dk)
            values["dv"].copy_(dv)
        else:
            values["dq"].copy_(dq)


@pytest.fixture
def fake_kernels(monkeypatch):
    """:meth:`Backward.cuda_sink` on CPU tensors: the sm_80 units (the plan the op would build),
    their kernels :class:`_FakeKernel`; the launches in the returned list."""
    launched: list = []

    def kernels(self, device, atomic_dq=False, path=None, param_grads=(), sink=False):
        atomic = path in ("atomic", "hopper", "hopper_ordered") or atomic_dq
        plan = registry.plan_backward(self.spec, "sm_80", self.op.options, atomic_dq=atomic,
                                      param_grads=param_grads, sink=sink)  # fmt: skip
        return (plan, *(_FakeKernel(self.op, plan, r, launched) for r in ("pre", "dkdv", "last")))

    monkeypatch.setattr(Backward, "kernels", kernels)
    monkeypatch.setattr(backward_mod, "target_for_device", lambda spec, device: "sm_80")
    monkeypatch.setattr(backward_mod, "current_stream_ptr", lambda device: 0)
    return launched


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_cuda_sink_form_launches_the_sink_units_with_a_workspace(fake_kernels, deterministic):
    """The sink form's launches: pre, dkdv, last of the sink unit; pre gets the saved lse as
    ``lse_keys`` and a fresh float32 workspace as ``lse``, which the dK/dV and dQ kernels
    read; the saved lse is untouched; d sink's buffer is [B, Hq] zeroed with ``dsink_rows``
    0 (atomics), or [B, Hq, Sq] with 1 (summed after); the results are the CPU form's."""
    spec, op, (q, k, v), sinks, logits, o, lse, do = _problem(seed=3)
    saved = lse.clone()
    lse32 = lse.float()  # the kernels' lse dtype
    got = op.backward.cuda_sink(do, q, k, v, o, lse32, logits, 0.125, deterministic, sinks)
    roles = [r for r, _ in fake_kernels]
    assert roles == ["pre", "dkdv", "last"]
    pre = fake_kernels[0][1]
    assert pre["lse_keys"] is lse32 or torch.equal(pre["lse_keys"], lse32)
    assert pre["lse"] is not lse32 and pre["lse"].dtype == torch.float32
    assert pre["lse"].data_ptr() != lse32.data_ptr()
    assert all(v["lse"] is pre["lse"] for _, v in fake_kernels[1:])
    assert pre["dsink_rows"] == int(deterministic)
    assert pre["dsink"].shape == ((2, 8, 13) if deterministic else (2, 8))
    assert (pre["sink_sb"], pre["sink_sh"]) == (0, 1) and pre["sink"] is logits
    assert torch.equal(lse, saved)
    want = op.backward.cpu_sink(do, q, k, v, o, lse32, logits, 0.125, deterministic, sinks)
    for what, a, b in zip(("dq", "dk", "dv"), got[:3], want[:3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=what)
    assert got[3] == [] and got[4].dtype == torch.float32 and got[4].shape == (2, 8)
    torch.testing.assert_close(got[4], want[4].float(), rtol=1e-5, atol=1e-6, msg="dsink")
    with pytest.raises(OpInputError, match=r"sink: expected float32 logits \[batch, heads_q\]"):
        op.backward.cuda_sink(do, q, k, v, o, lse32, logits[:1], 0.125, deterministic, sinks)


# ----------------------------------------------------------------------------- nvcc
def _jobs():
    """The sink form of every backward unit the op builds, per spec: sm_80 deterministic and
    atomic; sm_90a FA2-class atomic, Hopper and (gpt_oss_sink) Hopper ordered."""
    jobs = []
    for name in sorted(SPECS):
        spec = SPECS[name]()
        jobs += [(name, "sm_80", spec, "sm_80", {}),
                 (name, "sm_80_atomic", spec, "sm_80", {"atomic_dq": True}),
                 (name, "sm_90_atomic", spec, "sm_90", {"atomic_dq": True}),
                 (name, "sm_90_wgmma", spec, "sm_90", {"hopper": True})]  # fmt: skip
        if hopper_bwd.ordered_eligible(spec, "sm_90"):
            jobs.append((name, "sm_90_wgmma_ordered", spec, "sm_90",
                         {"hopper": True, "ordered_dq": True}))  # fmt: skip
    return jobs


def _compile(job):
    name, form, spec, target, kw = job
    plan, _, report = build_backward(spec, target, options=ON, sink=True, **kw)
    return name, form, plan, report


def test_every_sink_backward_unit_compiles_without_spills(requires_nvcc):
    """Each job of :func:`_jobs` (13 units, in parallel through the session cache): the unit
    the op would load is the sink form (the Hopper one where asked), and no kernel spills."""
    workers = int(os.environ.get("FLASHGEN_TEST_JOBS", (os.cpu_count() or 1) + 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(_compile, _jobs()))
    problems = []
    for name, form, plan, report in results:
        assert plan.sink, (name, form)
        assert plan.wgmma == ("wgmma" in form), (name, form)
        names = {k.name for k in report.kernels}
        assert names == {k.kernel_name for k in plan.kernels}, (name, form, names)
        assert plan.pre.kernel_name.endswith("_pre_sink")
        for k in report.kernels:
            if k.spill_bytes or report.wgmma_serialized:
                problems.append(f"{name} {form}: {k}")
    assert not problems, "sink backward kernels spill:\n" + "\n".join(problems)
