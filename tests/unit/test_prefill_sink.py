"""The attention sink inside the prefill forward kernels (``Options.fa2_fwd.fused_sink`` /
``Options.hopper_fwd.fused_sink``, issue 37's "prefill fused sink"), on the CPU: the options
are typed, on by default and part of the kernel and cache keys; a sink spec's forward units
take the sink logits (``sink``, ``sink_sb``, ``sink_sh``) and scale o by
``fg::dec::sink_share`` in the epilogue only with the option on (``fused_sink=False``:
neither), in every form the templates render (FA2-class padded and varlen, Hopper,
persistent, sparse tiles, fp8), and a spec without a sink renders byte-identical units; the op
passes the logits to the kernel (a fake one that does what the unit does from its arguments)
instead of the torch epilogue, and its outputs and gradients (q, k, v, the sink's params, a
gradient of lse too) equal those of the op with ``fused_sink=False`` (the torch epilogue); the
fused units compile for sm_80 and sm_90a without spills.  On the GPU:
tests/gpu/test_prefill_sink_gpu.py."""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from flashgen.build import cache
from flashgen.build.render import render
from flashgen.codegen.plan import TileConfig
from flashgen.families import fa2_fwd, hopper_fwd, registry
from flashgen.families.build import build_forward
from flashgen.frontend.errors import OpInputError, SpecError
from flashgen.frontend.spec import load_spec, loads_spec
from flashgen.ops.op import AttentionOp, build_op
from flashgen.ops.prefill import attention as op_mod
from flashgen.ops.prefill import varlen as varlen_mod
from flashgen.ops.prefill.varlen import VarlenDims, forward_launch, varlen_spec
from flashgen.ops.sink import keys_backward_inputs, sink_arg_values, varlen_rows
from flashgen.options import DEFAULT, Options

ROOT = Path(__file__).resolve().parents[2]
SINK_SPEC = ROOT / "specs" / "gpt_oss_sink.yaml"
FAMILIES = ("fa2_fwd", "hopper_fwd")
ON = Options()  # the default: both forward families join the sink
OFF = Options().with_values({f"{f}.fused_sink": False for f in FAMILIES})
SINK_ARGS = [("sink", "const float*"), ("sink_sb", "int64_t"), ("sink_sh", "int64_t")]
F64 = torch.float64


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
def test_fused_sink_is_a_typed_forward_option_on_by_default(family):
    path = f"{family}.fused_sink"
    record = {"fa2_fwd": fa2_fwd.Options, "hopper_fwd": hopper_fwd.Options}[family]
    assert path in Options.paths() and DEFAULT.get_path(path) is True
    assert record().fused_sink is True
    assert Options.describe(path) == "bool (true, false, 1, 0)"
    for text, want in (("true", True), ("TRUE", True), ("1", True), ("false", False)):
        assert Options().replace_path(path, text).get_path(path) is want
    for bad in (1, "yes please", None):
        with pytest.raises(ValueError, match=rf"Options\.{family}\.fused_sink=.*: expected a bool"):
            record(fused_sink=bad)
    for text in ("maybe", "on"):  # the forms describe() lists, no others
        with pytest.raises(ValueError, match=rf"^{family}\.fused_sink: expected a bool \(true, "
                           rf"false, 1, 0\), got '{text}'$"):  # fmt: skip
            Options().replace_path(path, text)


def test_the_option_is_part_of_the_kernel_and_cache_keys():
    fa2 = Options().replace_path("fa2_fwd.fused_sink", False)
    assert fa2.key() == "fa2_fwd.fused_sink=False" and DEFAULT.key() == ON.key() == ""
    assert fa2.family_key("fa2_fwd") == "fa2_fwd.fused_sink=False"
    assert all(fa2.family_key(f) == "" for f in ("hopper_fwd", "fa2_bwd", "hopper_bwd", "decode"))
    assert OFF.family_key("hopper_fwd") == "hopper_fwd.fused_sink=False"
    assert Options().replace_path("fa2_fwd.fused_sink", True).key() == ""  # the default, named
    spec = load_spec(SINK_SPEC)
    for target, family in (("sm_80", "fa2_fwd"), ("sm_90", "hopper_fwd")):
        off, on = (registry.plan_forward(spec, target, o) for o in (OFF, ON))
        assert (off.options_key, on.options_key) == (f"{family}.fused_sink=False", "")
        assert cache.cache_key(render(on), on) != cache.cache_key(render(off), off)
    # a spec without a sink: the same source and arguments, another cache entry
    llama = load_spec(ROOT / "specs" / "llama3_gqa.yaml")
    a, b = registry.plan_forward(llama, "sm_90", OFF), registry.plan_forward(llama, "sm_90")
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
    on, off = _units(spec, ON), _units(spec, OFF)
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
    without a sink renders byte-identical sources and the same arguments with the option on
    and off; a sink spec's backward units are unchanged either way, and the option adds their
    sink form (``bwd_sink``, ``bwd_atomic_sink``, ``bwd_wgmma_sink`` where the Hopper backward
    applies)."""
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        spec = load_spec(path)
        if spec.v_from_k:
            continue
        for target in ("sm_80", "sm_90"):
            if spec.dtype == "fp8_e4m3" and target == "sm_80":
                continue
            off, on = (registry.compile_units(spec, target, o) for o in (OFF, ON))
            added = {k for k in on if k.endswith("_sink")}
            assert set(off) == set(on) - added
            if spec.sink is not None and spec.dtype != "fp8_e4m3":
                want = {"bwd_sink", "bwd_atomic_sink"}
                want |= {"bwd_wgmma_sink"} if "bwd_wgmma" in off else set()
                assert added == want, (spec.name, target, added)
                assert all(on[k].context["sink"] for k in added)
            else:
                assert not added, (spec.name, target, added)
            for key in off:
                fwd = key.startswith("fwd") and spec.sink is not None
                assert (render(off[key]) == render(on[key])) != fwd, (spec.name, target, key)
        try:
            packed = varlen_spec(spec)
        except SpecError:  # fp8, tensor params of seqlen_q / seqlen_k
            continue
        a, b = (render(registry.plan_forward(packed, "sm_80", o)) for o in (OFF, ON))
        assert (a == b) == (spec.sink is None), spec.name


def test_joins_sink_follows_the_routed_forward_family():
    spec, llama = load_spec(SINK_SPEC), load_spec(ROOT / "specs" / "llama3_gqa.yaml")
    fa2 = Options().replace_path("hopper_fwd.fused_sink", False)  # only fa2_fwd's on
    hop = Options().replace_path("fa2_fwd.fused_sink", False)  # only hopper_fwd's on
    assert registry.joins_sink(spec, "sm_80") and registry.joins_sink(spec, "sm_90")
    assert not any(registry.joins_sink(spec, t, OFF) for t in ("sm_80", "sm_90"))
    assert registry.joins_sink(spec, "sm_80", fa2) and not registry.joins_sink(spec, "sm_90", fa2)
    assert registry.joins_sink(spec, "sm_90", hop) and not registry.joins_sink(spec, "sm_80", hop)
    assert registry.joins_sink(spec, "sm_90", fa2.replace_path("family", "fa2"))
    assert not registry.joins_sink(llama, "sm_90", ON)
    # the spill fallback's FA2-class tiles of a Hopper route keep the route's choice
    small = TileConfig(64, 64, 4)
    assert registry.plan_forward(spec, "sm_90", hop, tiles=small).context["sink"]
    assert not registry.plan_forward(spec, "sm_90", fa2, tiles=small).context["sink"]


# ----------------------------------------------------------------------------- launch values
def test_sink_arg_values_pass_the_logits_strides_or_null():
    assert sink_arg_values(None) == {"sink": 0, "sink_sb": 0, "sink_sh": 0}
    per_head = torch.randn(8).expand(3, 8)
    got = sink_arg_values(per_head)
    assert got["sink"] is per_head and (got["sink_sb"], got["sink_sh"]) == (0, 1)
    strided = torch.randn(3, 16)[:, ::2]
    assert (sink_arg_values(strided)["sink_sb"], sink_arg_values(strided)["sink_sh"]) == (16, 2)
    with pytest.raises(OpInputError, match=r"sink: expected float32 logits \[batch, heads_q\]"):
        sink_arg_values(torch.zeros(3, 8, dtype=F64))
    with pytest.raises(OpInputError, match="sink: expected float32"):
        sink_arg_values(torch.zeros(8))


def test_the_varlen_launch_passes_the_sink_only_to_a_fused_unit():
    spec = varlen_spec(load_spec(SINK_SPEC))
    q = torch.randn(10, 4, 64).to(torch.bfloat16)
    k, v = torch.randn(12, 2, 64).to(torch.bfloat16), torch.randn(12, 2, 64).to(torch.bfloat16)
    o, lse = torch.empty(10, 4, 64, dtype=torch.bfloat16), torch.empty(4, 10)
    cq = torch.tensor([0, 3, 10], dtype=torch.int32)
    ck = torch.tensor([0, 5, 12], dtype=torch.int32)
    dims = VarlenDims(2, 4, 2, 10, 12, 7, 7, 64)
    logits = torch.randn(4).expand(2, 4)
    tensors = {"sinks": torch.randn(4)}
    for options in (ON, OFF):
        plan = registry.plan_forward(spec, "sm_80", options)
        args = (spec, plan, q, k, v, o, lse, cq, ck, dims, 0.125, [], tensors)
        _, keys = forward_launch(*args)
        if options is ON:
            _, joined = forward_launch(*args, sink=logits)
            assert joined["sink"] is logits and (joined["sink_sb"], joined["sink_sh"]) == (0, 1)
            assert keys["sink"] == 0
        else:
            assert "sink" not in keys
            with pytest.raises(RuntimeError, match="has no fused sink"):
                forward_launch(*args, sink=logits)


# ----------------------------------------------------------------------------- the op
def _share(lse, logits):
    """``fg::dec::sink_share``: sigmoid(lse - sink), 0 for a row with no key."""
    return torch.where(lse == -math.inf, torch.zeros((), dtype=lse.dtype),
                       torch.sigmoid(lse - logits.to(lse.dtype)))  # fmt: skip


def _logits(values, batch, heads):
    s = values["sink"]
    return torch.as_strided(s, (batch, heads), (values["sink_sb"], values["sink_sh"]),
                            s.storage_offset())  # fmt: skip


def _wide(t):
    """16-bit inputs as float32 (exact): the fake kernel accumulates in fp32 as the unit does."""
    return t.float() if t.element_size() == 2 else t


class FakeKernel:
    """A loaded forward unit on the CPU: its launch does what the unit does from its arguments
    (the keys' attention by the CPU op, in fp32 for 16-bit inputs, and with the fused sink o
    scaled by ``sigmoid(lse - sink)`` read through the ``sink`` pointer's strides, rounded to
    o's dtype once, into ``o`` / ``lse``); launches recorded."""

    def __init__(self, op, plan, launched):
        self.op, self.plan, self.launched = op, plan, launched

    def launch(self, grid, values, stream):
        spec = self.op.spec
        self.launched.append(values)
        scalars = [values[f"p_{p.name}"] for p in spec.scalar_params]
        tensors = [values[f"t_{p.name}"] for p in spec.tensor_params]
        sink = self.plan.context["sink"] and not isinstance(values["sink"], int)
        if spec.varlen:
            q, k, v, o = (values[n][0].transpose(0, 1) for n in ("q", "k", "v", "o"))
            q, k, v = _wide(q), _wide(k), _wide(v)
            cq, ck = values["cu_seqlens_q"], values["cu_seqlens_k"]
            keys_o, lse = self.op._cpu_impl(q, k, v, cq, ck, values["max_seqlen_q"],
                                            values["max_seqlen_k"], values["softmax_scale"],
                                            *scalars, *tensors)  # fmt: skip
            if sink:
                rows = varlen_rows(_logits(values, cq.numel() - 1, q.shape[1]), cq, lse.shape[1])
                keys_o = (keys_o.to(lse.dtype) * _share(lse, rows).T.unsqueeze(-1)).to(o.dtype)
        else:
            q, k, v, o = (values[n] for n in ("q", "k", "v", "o"))
            q, k, v = _wide(q), _wide(k), _wide(v)
            keys_o, lse = self.op._cpu_impl(q, k, v, values["softmax_scale"], *scalars, *tensors)
            if sink:
                share = _share(lse, _logits(values, q.shape[0], q.shape[1]).unsqueeze(-1))
                keys_o = (keys_o.to(lse.dtype) * share.unsqueeze(-1)).to(o.dtype)
        o.copy_(keys_o)
        values["lse"].copy_(lse)


@pytest.fixture
def fake_cuda(monkeypatch):
    """CPU tensors take the eager CUDA paths: the kernel is a :class:`FakeKernel` of the sm_80
    plan under the op's options (and :meth:`AttentionOp._joins_sink` answers for sm_80), the
    stream 0; the launches' values in the returned list."""
    launched: list = []

    def kernel(self, device, sparse=False, block_descale=False):
        return FakeKernel(self, registry.plan_forward(self.spec, "sm_80", self.options), launched)

    monkeypatch.setattr(op_mod, "_eager_cuda", lambda q, k, v: True)
    monkeypatch.setattr(op_mod, "target_for_device", lambda spec, device: "sm_80")
    real = AttentionOp._joins_sink
    monkeypatch.setattr(AttentionOp, "_joins_sink",
                        lambda self, device: real(self, torch.device("cuda", 0)))  # fmt: skip
    monkeypatch.setattr(op_mod, "current_stream_ptr", lambda device: 0)
    monkeypatch.setattr(varlen_mod, "current_stream_ptr", lambda device: 0)
    monkeypatch.setattr(AttentionOp, "kernel", kernel)
    return launched


SINK_FORMS = {
    "per_head": ("sinks[h]", PER_HEAD,
                 lambda g, b, h, hkv: {"sinks": torch.randn(h, generator=g) * 2}),
    "per_batch_head": ("sinks[b, h]", "  sinks: {type: f32, shape: [batch, num_heads]}",
                       lambda g, b, h, hkv: {"sinks": torch.randn(b, h, generator=g) * 2}),
    "computed": ("s0 + sinks[h_kv]",
                 "  sinks: {type: f32, shape: [num_heads_kv]}\n  s0: {type: f32, default: 0.5}",
                 lambda g, b, h, hkv: {"sinks": torch.randn(hkv, generator=g), "s0": 1.5}),
    "strided_view": ("sinks[h]", PER_HEAD,
                     lambda g, b, h, hkv: {"sinks": (torch.randn(2 * h, generator=g) * 2)[::2]}),
}  # fmt: skip


def _ops(form: str, varlen: bool = False, score_mod: str = "null", extra: str = ""):
    sink, params, make = SINK_FORMS[form]
    spec = _spec(f"psink_op_{form}{'_sm' if extra else ''}", sink, params + extra,
                 head_dim=32, score_mod=score_mod)  # fmt: skip
    ops = build_op(spec), build_op(spec, OFF)
    return (*(o.varlen for o in ops), make) if varlen else (*ops, make)


def _run(op, inputs, params, grads, *, varlen=None, **kw):
    """o, lse and the gradients of the leaves (q, k, v and every float tensor param) of one
    call with output gradients ``grads`` (do, and dlse or None)."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    p = {n: t.clone().requires_grad_() if isinstance(t, torch.Tensor) else t
         for n, t in params.items()}  # fmt: skip
    args = (*leaves, *varlen) if varlen else leaves
    o, lse = op.attention(*args, **kw, **p)
    outs = [(o, grads[0])] + ([(lse, grads[1])] if grads[1] is not None else [])
    torch.autograd.backward([x for x, _ in outs], [g for _, g in outs])
    tensor_grads = [t.grad for t in p.values() if isinstance(t, torch.Tensor)]
    return [o.detach(), lse.detach(), *(t.grad for t in leaves), *tensor_grads], o


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=what)


@pytest.mark.parametrize("dlse", [False, True], ids=["do", "do_dlse"])
@pytest.mark.parametrize("form", sorted(SINK_FORMS))
def test_the_padded_op_joins_the_sink_in_the_kernel_and_its_gradients_match(fake_cuda, form,
                                                                              dlse):  # fmt: skip
    """GQA 8 / 2, Sq 13 > Sk 9 under a bottom-right causal mask (four rows with no key),
    float64: o, lse and the gradients of q, k, v and the sink's params equal the unfused op's
    (the torch epilogue), the launch got the logits (``sinks[h]``: the param's own memory),
    and the gradients come from the fused node."""
    fused, plain, make = _ops(form)
    g = torch.Generator().manual_seed(7)
    inputs = [torch.randn(2, h, s, 32, generator=g, dtype=F64)
              for h, s in ((8, 13), (2, 9), (2, 9))]  # fmt: skip
    params = make(g, 2, 8, 2)
    do = torch.randn(2, 8, 13, 32, generator=g, dtype=F64)
    grads = (do, torch.randn(2, 8, 13, generator=g, dtype=F64) if dlse else None)
    got, o = _run(fused, inputs, params, grads)
    assert type(o.grad_fn).__name__ == "FusedSinkAttentionBackward"
    sink = fake_cuda[-1]["sink"]
    assert isinstance(sink, torch.Tensor) and sink.dtype == torch.float32
    assert len(fake_cuda) == 1
    want, _ = _run(plain, inputs, params, grads)
    # the unfused op launched the keys' kernel itself (the eager fast path, its sinks that
    # require grad too), then applied the sink by torch ops
    assert len(fake_cuda) == 2 and "sink" not in fake_cuda[-1]
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv", "dsinks"), got, want, strict=False):
        _close(a, b, name)
    assert bool((got[0][:, :, :4] == 0).all()) and bool((got[1][:, :, :4] == -math.inf).all())
    assert all(bool(t.isfinite().all()) for t in got[2:])


@pytest.mark.parametrize("dlse", [False, True], ids=["do", "do_dlse"])
@pytest.mark.parametrize("form", ["per_head", "per_batch_head", "computed"])
def test_the_varlen_op_joins_each_sequences_sink_and_its_gradients_match(fake_cuda, form, dlse):
    """Sequences of 5, 0, 17 and 1 queries over 9, 0, 21 and 1 keys (an empty one; rows
    with no key under causal): as the padded test, per sequence."""
    fused, plain, make = _ops(form, varlen=True)
    g = torch.Generator().manual_seed(3)
    cq = torch.tensor([0, 5, 5, 22, 23], dtype=torch.int32)
    ck = torch.tensor([0, 9, 9, 30, 31], dtype=torch.int32)
    inputs = [torch.randn(n, h, 32, generator=g, dtype=F64) for n, h in ((23, 8), (31, 2), (31, 2))]
    params = make(g, 4, 8, 2)
    grads = (torch.randn(23, 8, 32, generator=g, dtype=F64),
             torch.randn(8, 23, generator=g, dtype=F64) if dlse else None)  # fmt: skip
    layout = (cq, ck, 17, 21)
    got, o = _run(fused, inputs, params, grads, varlen=layout)
    assert type(o.grad_fn).__name__ == "FusedSinkVarlenBackward" and len(fake_cuda) == 1
    assert fake_cuda[-1]["sink"].shape == (4, 8)
    want, _ = _run(plain, inputs, params, grads, varlen=layout)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv", "dsinks"), got, want, strict=False):
        _close(a, b, name)


def _spy_backward_ops(monkeypatch, ops) -> dict:
    """Wrap ``torch.ops.flashgen.<name>__backward`` and ``<name>__backward_sink`` of each op in
    ``ops`` (the nodes look them up at call time): ``{"plain": [...], "sink": [...]}`` of the
    op names called."""
    calls: dict = {"plain": [], "sink": []}

    def wrap(kind, name, fn):
        def call(*args, **kwargs):
            calls[kind].append(name)
            return fn(*args, **kwargs)

        return call

    for op in ops:
        for kind, suffix in (("plain", "__backward"), ("sink", "__backward_sink")):
            name = op.name + suffix
            real = getattr(torch.ops.flashgen, name)
            monkeypatch.setattr(torch.ops.flashgen, name, wrap(kind, name, real))
    return calls


@pytest.mark.parametrize("case", ["do", "do_dlse", "sinks_only", "with_slopes"])
def test_the_fused_node_takes_the_sink_form_without_dlse(fake_cuda, monkeypatch, case):
    """Without a gradient of lse the fused node makes one call of ``<name>__backward_sink``
    (also with a score_mod param's gradient, ``param_grads``), none of ``<name>__backward``;
    with one it keeps the torch inputs and the plain op; with only the sink's param requiring
    grad neither runs (d sink in torch).  The gradients equal the unfused op's."""
    score_mod, extra = "null", ""
    if case == "with_slopes":
        score_mod = "score - slopes[h] * abs(q_idx - kv_idx)"
        extra = "\n  slopes: {type: f32, shape: [num_heads]}"
    fused, plain, make = _ops("per_head", score_mod=score_mod, extra=extra)
    backward_calls = _spy_backward_ops(monkeypatch, (fused, plain))
    g = torch.Generator().manual_seed(9)
    inputs = [torch.randn(1, h, s, 32, generator=g, dtype=F64)
              for h, s in ((4, 7), (2, 11), (2, 11))]  # fmt: skip
    params = make(g, 1, 4, 2)
    if case == "with_slopes":
        params["slopes"] = torch.rand(4, generator=g)
    dl = torch.randn(1, 4, 7, generator=g, dtype=F64) if case == "do_dlse" else None
    grads = (torch.randn(1, 4, 7, 32, generator=g, dtype=F64), dl)
    if case == "sinks_only":
        sinks = params["sinks"].clone().requires_grad_()
        o, _ = fused.attention(*inputs, sinks=sinks)
        o.backward(grads[0])
        assert backward_calls == {"plain": [], "sink": []}
        ref = params["sinks"].clone().requires_grad_()
        plain.attention(*inputs, sinks=ref)[0].backward(grads[0])
        _close(sinks.grad, ref.grad, "dsinks")
        return
    got, o = _run(fused, inputs, params, grads)
    assert type(o.grad_fn).__name__ == "FusedSinkAttentionBackward"
    name = fused.name
    if case == "do_dlse":
        assert backward_calls == {"plain": [f"{name}__backward"], "sink": []}
    else:
        assert backward_calls == {"plain": [], "sink": [f"{name}__backward_sink"]}
    backward_calls["plain"].clear()
    want, _ = _run(plain, inputs, params, grads)
    assert backward_calls["sink"] == [f"{name}__backward_sink"] * (case != "do_dlse")
    assert len(got) == len(want) == 6 + (case == "with_slopes")
    for what, a, b in zip(("o", "lse", "dq", "dk", "dv", "dsinks", "dslopes"), got, want,
                          strict=False):  # fmt: skip
        _close(a, b, what)


def test_a_score_mod_param_and_the_sink_get_their_gradients_together(fake_cuda):
    """A spec whose score_mod reads a trainable param beside the sink: the fused node asks the
    backward op for that param's gradient (``param_grads``) and gives the sink's itself."""
    fused, plain, make = _ops("per_head", score_mod="score - slopes[h] * abs(q_idx - kv_idx)",
                              extra="\n  slopes: {type: f32, shape: [num_heads]}")  # fmt: skip
    g = torch.Generator().manual_seed(5)
    inputs = [torch.randn(1, h, s, 32, generator=g, dtype=F64)
              for h, s in ((4, 7), (2, 11), (2, 11))]  # fmt: skip
    params = {**make(g, 1, 4, 2), "slopes": torch.rand(4, generator=g)}
    grads = (torch.randn(1, 4, 7, 32, generator=g, dtype=F64), None)
    got, o = _run(fused, inputs, params, grads)
    assert type(o.grad_fn).__name__ == "FusedSinkAttentionBackward"
    want, _ = _run(plain, inputs, params, grads)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv", "dsinks", "dslopes"), got, want,
                          strict=True):  # fmt: skip
        _close(a, b, name)


def test_calls_without_gradients_apply_sink_false_and_out(fake_cuda):
    """No gradient wanted: the kernel joins the sink, no autograd node; ``apply_sink=False``:
    a null sink (the keys alone); ``out=``: the kernel writes the caller's tensor, with
    gradients too; only the sink's param requiring grad takes the fused node (d q, k, v not
    computed)."""
    fused, plain, make = _ops("per_head")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, s, 32, generator=g) for h, s in ((4, 6), (2, 6), (2, 6)))
    params = make(g, 1, 4, 2)
    with torch.no_grad():
        o, lse = fused.attention(q, k, v, **params)
    assert o.grad_fn is None and fake_cuda[-1]["sink"].data_ptr() == params["sinks"].data_ptr()
    _close(o, plain.attention(q, k, v, **params)[0], "o")
    assert "sink" not in fake_cuda[-1]  # the unfused unit, then the torch epilogue
    o_keys, _ = fused.attention(q, k, v, apply_sink=False, **params)
    assert fake_cuda[-1]["sink"] == 0
    _close(o_keys, plain.attention(q, k, v, apply_sink=False, **params)[0], "keys")
    buf = torch.empty(1, 6, 4, 32)  # (B, S, H, D) storage, o viewed [B, H, S, D]
    out = buf.transpose(1, 2)
    qg = q.clone().requires_grad_()
    o2, _ = fused.attention(qg, k, v, out=out, **params)
    assert o2.data_ptr() == buf.data_ptr() and type(o2.grad_fn).__name__.startswith("FusedSink")
    _close(out, o, "out")
    o2.sum().backward()
    sinks = params["sinks"].clone().requires_grad_()
    o3, _ = fused.attention(q, k, v, sinks=sinks)
    assert type(o3.grad_fn).__name__ == "FusedSinkAttentionBackward"
    o3.sum().backward()
    ref = params["sinks"].clone().requires_grad_()
    plain.attention(q, k, v, sinks=ref)[0].sum().backward()
    _close(sinks.grad, ref.grad, "dsinks")


def test_calls_the_kernel_cannot_fuse_keep_the_torch_epilogue(fake_cuda, monkeypatch):
    """A 0-d scalar param that requires grad (:class:`ScalarParamGrad`), CPU tensors (no eager
    CUDA) and an op with ``fused_sink=False``: the unfused path, the same results."""
    fused, plain, make = _ops("computed")
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, s, 32, generator=g, dtype=F64)
               for h, s in ((4, 5), (2, 5), (2, 5)))  # fmt: skip
    params = make(g, 1, 4, 2)
    s0 = torch.tensor(0.25, dtype=F64, requires_grad=True)
    o, _ = fused.attention(q, k, v, sinks=params["sinks"], s0=s0)
    assert not fake_cuda and type(o.grad_fn).__name__ == "MulBackward0"  # apply_sink's
    o.sum().backward()
    assert s0.grad is not None
    assert not plain._fuses_sink(q, k, v, params)
    monkeypatch.setattr(op_mod, "_eager_cuda", lambda q, k, v: False)
    assert not fused._fuses_sink(q, k, v, params)


def test_keys_backward_inputs_of_a_row_without_keys_or_with_an_infinite_sink():
    """lse = -inf (no key) with a -inf sink: d sink 0, not NaN; the sink-inclusive lse is the
    sink where the row has no key; with a gradient of lse the keys' lse and a dO scaled by
    the keys' share."""
    o = torch.zeros(1, 2, 3, 4)
    o[..., 1:, :] = 1.0
    lse = torch.tensor([[[-math.inf, 0.0, 1.0], [-math.inf, 0.5, 2.0]]])
    rows = torch.tensor([[[-math.inf], [0.25]]])
    do = torch.ones_like(o)
    dout, lse_arg, dlse, d_rows = keys_backward_inputs(o, lse, rows, do, None)
    assert dout is do and dlse is None and d_rows.shape == rows.shape
    assert bool(d_rows.isfinite().all()) and d_rows[0, 0, 0] == 0
    assert lse_arg[0, 0, 0] == -math.inf and lse_arg[0, 1, 0] == 0.25
    torch.testing.assert_close(lse_arg[0, 1, 1:], torch.logaddexp(lse[0, 1, 1:], rows[0, 1]))
    want = -(torch.sigmoid(rows[0, 1] - lse[0, 1, 1:]) * 4).sum()
    torch.testing.assert_close(d_rows[0, 1, 0], want)
    dl = torch.ones_like(lse)
    dout, lse_arg, dlse, _ = keys_backward_inputs(o, lse, rows, do, dl)
    assert lse_arg is lse and dlse is dl
    torch.testing.assert_close(dout[0, 1, 1:, 0], torch.sigmoid(lse[0, 1, 1:] - rows[0, 1]))
    assert bool((dout[0, :, 0] == 0).all())


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
