"""Varlen (packed sequences with cu_seqlens) on the CPU: the ``varlen`` spec field and its
checks, lowering and rendering (non-varlen kernels' source unchanged, varlen units compile
without spills), input validation, the per-sequence reference, the CPU op and its
gradients against the padded op sequence by sequence, opcheck and torch.compile.  The
kernels themselves run in tests/gpu/test_varlen_gpu.py."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from plan_helpers import plan_backward, plan_forward  # noqa: E402

from flashgen.build.render import render  # noqa: E402
from flashgen.families.registry import compile_units  # noqa: E402
from flashgen.frontend.errors import OpInputError, SpecError  # noqa: E402
from flashgen.frontend.spec import load_spec, loads_spec  # noqa: E402
from flashgen.ops.cpu.reference import attention_reference, attention_reference_varlen  # noqa: E402
from flashgen.ops.op import build_op  # noqa: E402
from flashgen.ops.prefill.varlen import VarlenOp, check_cu_seqlens, varlen_spec  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

VARLEN_YAML = """\
name: vl_causal
head_dim: 64
dtype: bf16
mask: causal
varlen: true
"""


def shipped(name: str):
    return load_spec(REPO / "specs" / f"{name}.yaml")


def cu(lens) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def packed(spec, lens_q, lens_k, hq=4, hkv=2, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), hq, spec.head_dim, generator=g).to(dtype)
    k = torch.randn(sum(lens_k), hkv, spec.head_dim, generator=g).to(dtype)
    v = torch.randn(sum(lens_k), hkv, spec.head_dim_v, generator=g).to(dtype)
    return q, k, v, cu(lens_q), cu(lens_k)


# Empty sequences (q, k or both), a length-1 sequence, a sequence with no keys (o = 0,
# lse = -inf), causal rows with nothing to see (Sq > Sk), odd lengths.
LENS_Q = [5, 0, 1, 17, 3, 0, 1, 9]
LENS_K = [7, 4, 0, 17, 1, 0, 1, 30]


# ----------------------------------------------------------------------------- spec field
def test_varlen_field_parses_and_defaults_to_false():
    assert loads_spec(VARLEN_YAML, "v.yaml").varlen is True
    assert loads_spec(VARLEN_YAML.replace("varlen: true", "varlen: false")).varlen is False
    assert shipped("causal_d128").varlen is False


def test_varlen_field_must_be_a_bool():
    with pytest.raises(SpecError) as ei:
        loads_spec(VARLEN_YAML.replace("varlen: true", "varlen: 1"), "v.yaml")
    e = ei.value
    assert "varlen must be true or false" in str(e) and (e.line, e.col) == (5, 9)


@pytest.mark.parametrize("sym", ["seqlen_q", "seqlen_k"])
def test_varlen_spec_rejects_sequence_length_shapes(sym):
    text = VARLEN_YAML + f"params:\n  bias: {{type: f32, shape: [num_heads, {sym}]}}\n"
    with pytest.raises(SpecError) as ei:
        loads_spec(text, "v.yaml")
    assert "not allowed in a varlen spec" in str(ei.value) and ei.value.line == 7
    loads_spec(text.replace(sym, "batch"), "v.yaml")  # batch (= sequences) is fine


def test_varlen_form_of_a_padded_spec():
    spec = shipped("alibi")
    vs = varlen_spec(spec)
    assert vs.varlen and vs.name == "alibi__varlen" and vs.mask == spec.mask
    assert varlen_spec(vs) is vs
    bad = loads_spec(
        "name: t\nhead_dim: 64\ndtype: bf16\nparams:\n  bias: {type: f32, shape: [seqlen_k]}\n"
        "score_mod: score + bias[kv_idx]\n",
        "t.yaml",
    )
    with pytest.raises(SpecError, match="no varlen form"):
        varlen_spec(bad)


# ----------------------------------------------------------------------------- lowering
def test_varlen_plans_take_cu_seqlens_and_maxima():
    spec = loads_spec(VARLEN_YAML)
    names = [a.name for a in plan_forward(spec, "sm_80").args]
    assert names[names.index("o_ss") + 1 :][:8] == [
        "cu_seqlens_q", "cu_seqlens_k", "batch", "heads_q", "heads_kv", "max_seqlen_q",
        "max_seqlen_k", "total_q",
    ]  # fmt: skip
    assert "seqlen_q" not in names
    for atomic in (False, True):
        bp = plan_backward(spec, "sm_80", atomic_dq=atomic)
        for kp in (bp.dkdv, bp.dq or bp.convert):
            if kp is bp.convert:
                assert "cu_seqlens_q" not in [a.name for a in kp.args]
            else:
                assert {"cu_seqlens_q", "cu_seqlens_k", "total_q"} <= {a.name for a in kp.args}
        assert [a.name for a in bp.pre.args][-3:] == ["batch", "heads_q", "seqlen_q"]


def test_padded_kernels_do_not_mention_varlen():
    """The varlen flag renders nothing in a padded spec's kernels (their source is the same
    as before varlen existed: checked byte for byte against the pre-varlen templates when
    this test was written)."""
    for target in ("sm_80", "sm_90"):
        for plan in compile_units(shipped("causal_d128"), target).values():
            src = render(plan)
            assert "cu_seqlens" not in src and "q_start" not in src and "Varlen" not in src


def test_varlen_source_reads_offsets_and_exits_past_the_sequence():
    spec = loads_spec(VARLEN_YAML)
    fwd = render(plan_forward(spec, "sm_80"))
    assert "const int seqlen_q = cu_seqlens_q[b + 1] - q_start;" in fwd
    assert "if (m_rev >= num_m_blocks) return;" in fwd
    assert "lse_row0 = (int64_t)h * total_q + q_start;" in fwd
    bwd = render(plan_backward(spec, "sm_80").unit)
    assert "if (n_block * KV_N >= seqlen_k) return;" in bwd
    assert "if (m_rev >= m_blocks) return;" in bwd


@pytest.mark.parametrize("i,name", [
    pytest.param(i, n, id=n) for i, n in enumerate(["causal_d128", "alibi", "bidir_d256",
                                                    "gemma2_softcap"])
])  # fmt: skip
def test_varlen_kernels_compile_without_spills(i, name, requires_nvcc):
    """What the op builds (the spill fallback of flashgen.families.build included): every varlen
    unit (all FA2-class), forward and both backward paths, without spills.  Spec i builds
    unit j for target (i + j) % 2: every spec and every unit meets both targets (a pairwise
    covering, 12 builds instead of 24).  The sm_80 and sm_90 units render the same CUDA but
    for the kernels' names (and the atomic unit's sm_90 vector reduction); ptxas allocates
    registers per arch, so a spec's other target is covered by the other specs, not proven
    for it."""
    from flashgen.families.build import build_backward, build_forward

    spec = varlen_spec(shipped(name))
    targets = ("sm_80", "sm_90")
    target = targets[i % 2]
    plan, _, rep = build_forward(spec, target)
    assert rep.spill_bytes == 0, f"{name} fwd {target} {plan.tiles}: {rep.kernels}"
    for j, atomic in enumerate((False, True), start=1):
        target = targets[(i + j) % 2]
        bplan, _, rep = build_backward(spec, target, atomic_dq=atomic)
        assert rep.spill_bytes == 0, f"{name} bwd {target} {bplan.tiles}: {rep.kernels}"


# ----------------------------------------------------------------------------- validation
@pytest.fixture(scope="module")
def vop():
    op = build_op(varlen_spec(shipped("causal_d128")))
    assert isinstance(op, VarlenOp) and op is shipped_op().varlen
    return op


def shipped_op():
    return build_op(shipped("causal_d128"))


def _call(op, q, k, v, cq, ck, mq=None, mk=None, **kw):
    mq = max(1, int((cq[1:] - cq[:-1]).max())) if mq is None else mq
    mk = max(1, int((ck[1:] - ck[:-1]).max())) if mk is None else mk
    return op(q, k, v, cq, ck, mq, mk, **kw)


BAD = [
    (lambda a: {**a, "q": a["q"][None]}, "q: expected a 3-D packed tensor"),
    (lambda a: {**a, "k": a["k"].half()}, "k: expected dtype torch.bfloat16"),
    (lambda a: {**a, "v": a["v"][:, :, :64]}, "v: expected head_dim_v 128"),
    (lambda a: {**a, "v": a["v"][:-1]}, r"v: expected \[total_k, heads_kv\]"),
    (lambda a: {**a, "q": a["q"][:, :3]}, "q: expected num_heads to be a multiple"),
    (lambda a: {**a, "q": a["q"].transpose(1, 2).contiguous().transpose(1, 2)}, r"stride\(-1\)"),
    (lambda a: {**a, "cq": a["cq"].long()}, "cu_seqlens_q: expected dtype torch.int32"),
    (lambda a: {**a, "ck": a["ck"][None]}, "cu_seqlens_k: expected a 1-D tensor"),
    (lambda a: {**a, "ck": a["ck"][:0]}, "cu_seqlens_k: expected a 1-D tensor"),
    (lambda a: {**a, "ck": a["ck"][:-1]}, r"cu_seqlens_k: expected shape \[9\]"),
    (lambda a: {**a, "cq": a["cq"].tolist()}, "cu_seqlens_q: expected a torch.Tensor"),
    (lambda a: {**a, "mq": 3.0}, "max_seqlen_q: expected a Python int"),
    (lambda a: {**a, "mk": True}, "max_seqlen_k: expected a Python int"),
    (lambda a: {**a, "mq": -1}, "max_seqlen_q: expected an int in"),
    (lambda a: {**a, "mk": 0}, "max_seqlen_k: expected at least the longest"),
    # values (checked on CPU inputs; on CUDA with FLASHGEN_VARLEN_CHECK=1)
    (lambda a: {**a, "cq": a["cq"] + 1}, r"cu_seqlens_q: expected cu_seqlens\[0\] == 0"),
    (lambda a: {**a, "ck": a["ck"].flip(0).contiguous()}, "cu_seqlens_k: expected cu_seqlens"),
    (
        lambda a: {**a, "cq": cu([5, 0, 1, 17, 3, 0, 1, 8])},
        r"cu_seqlens_q: expected cu_seqlens\[-1\]",
    ),
    (
        lambda a: {**a, "cq": torch.tensor([0, 5, 4, 5, 22, 25, 25, 26, 35], dtype=torch.int32)},
        "nondecreasing",
    ),
    (lambda a: {**a, "mk": 29}, "max_seqlen_k: expected at least every sequence's length"),
]


@pytest.mark.parametrize("mutate, message", BAD, ids=[m for _, m in BAD])
def test_bad_inputs_are_rejected_clearly(vop, mutate, message):
    q, k, v, cq, ck = packed(vop.spec, LENS_Q, LENS_K)
    a = mutate({"q": q, "k": k, "v": v, "cq": cq, "ck": ck, "mq": 17, "mk": 30})
    with pytest.raises(OpInputError, match=message):
        vop(a["q"], a["k"], a["v"], a["cq"], a["ck"], a["mq"], a["mk"])


def test_cu_seqlens_on_another_device_is_rejected(vop):
    q, k, v, cq, ck = packed(vop.spec, [3], [3])
    with pytest.raises(OpInputError, match="cu_seqlens_k: expected device cpu"):
        vop(q, k, v, cq, ck.to("meta"), 3, 3)


def test_tensor_params_use_the_number_of_sequences_as_batch():
    op = shipped_op_named("alibi").varlen
    q, k, v, cq, ck = packed(op.spec, [3, 4], [3, 4], hq=4, hkv=4)
    with pytest.raises(OpInputError, match=r"slopes: expected shape \[4\]"):
        op(q, k, v, cq, ck, 4, 4, slopes=torch.ones(3))


def shipped_op_named(name):
    return build_op(shipped(name))


def test_check_cu_seqlens_accepts_good_offsets(vop):
    from flashgen.ops.prefill.varlen import validate_varlen

    q, k, v, cq, ck = packed(vop.spec, LENS_Q, LENS_K)
    dims = validate_varlen(vop.spec, q, k, v, cq, ck, 17, 30)
    check_cu_seqlens(cq, ck, dims)
    assert (dims.batch, dims.total_q, dims.total_k, dims.grid_seqlen_q) == (8, 36, 60, 17)
    big = validate_varlen(vop.spec, q, k, v, cq, ck, 10_000, 10_000)
    assert (big.grid_seqlen_q, big.grid_seqlen_k) == (36, 60)  # grid clamped to the totals


# ----------------------------------------------------------------------------- reference and op
def _per_sequence(spec_padded, q, k, v, cq, ck, params=None, dtype=torch.float64):
    """o, lse by calling the padded reference on each sequence."""
    hq, dv = q.shape[1], v.shape[2]
    o = torch.zeros(q.shape[0], hq, dv, dtype=dtype)
    lse = torch.full((hq, q.shape[0]), -math.inf, dtype=dtype)
    for i in range(len(cq) - 1):
        a, b, c, d = int(cq[i]), int(cq[i + 1]), int(ck[i]), int(ck[i + 1])
        if b == a or d == c:
            continue
        oi, li = attention_reference(
            spec_padded,
            *(t.transpose(0, 1)[None] for t in (q[a:b], k[c:d], v[c:d])),
            params=params,
            compute_dtype=dtype,
        )
        o[a:b], lse[:, a:b] = oi[0].transpose(0, 1), li[0]
    return o, lse


@pytest.mark.parametrize("name", ["causal_d128", "mistral_swa", "alibi", "gemma2_softcap"])
def test_reference_is_the_padded_reference_per_sequence(name):
    spec = shipped(name)
    q, k, v, cq, ck = packed(spec, LENS_Q, LENS_K, hq=4, hkv=2, dtype=torch.float64)
    params = {"slopes": torch.rand(4, dtype=torch.float64)} if spec.param("slopes") else {}
    if spec.param("window"):
        params["window"] = 4
    o, lse = attention_reference_varlen(spec, q, k, v, cq, ck, params=params)
    ro, rlse = _per_sequence(spec, q, k, v, cq, ck, params)
    assert o.shape == (36, 4, spec.head_dim_v) and lse.shape == (4, 36)
    torch.testing.assert_close(o, ro, rtol=0, atol=0)
    torch.testing.assert_close(lse, rlse, rtol=0, atol=0)
    a = int(cq[2])  # sequence 2: one query, no keys
    assert (o[a] == 0).all() and torch.isneginf(lse[:, a]).all()


def test_reference_b_is_the_sequence_index():
    spec = loads_spec(
        "name: docbias\nhead_dim: 64\ndtype: bf16\nvarlen: true\n"
        "params:\n  bonus: {type: f32, shape: [batch]}\nscore_mod: score + bonus[b]\n",
        "d.yaml",
    )
    q, k, v, cq, ck = packed(spec, [2, 3], [2, 3], hq=1, hkv=1, dtype=torch.float64)
    bonus = torch.tensor([0.0, 5.0], dtype=torch.float64)
    _, lse = attention_reference_varlen(spec, q, k, v, cq, ck, params={"bonus": bonus})
    _, lse0 = attention_reference_varlen(
        spec, q, k, v, cq, ck, params={"bonus": torch.zeros(2, dtype=torch.float64)}
    )
    torch.testing.assert_close(lse[:, :2], lse0[:, :2])
    torch.testing.assert_close(lse[:, 2:], lse0[:, 2:] + 5.0)


@pytest.mark.parametrize("name", ["causal_d128", "mistral_swa", "alibi"])
def test_cpu_op_matches_padded_op_per_sequence(name):
    pop = shipped_op_named(name)
    op = pop.varlen
    q, k, v, cq, ck = packed(op.spec, LENS_Q, LENS_K, hq=4, hkv=2)
    params = {"slopes": torch.rand(4)} if op.spec.param("slopes") else {}
    if op.spec.param("window"):
        params["window"] = 4
    o, lse = op(q, k, v, cq, ck, 1000, 1000, **params)  # oversized max_seqlen
    assert o.shape == (36, 4, op.spec.head_dim_v) and o.dtype == q.dtype
    assert lse.shape == (4, 36) and lse.dtype == torch.float32
    for i in range(len(LENS_Q)):
        a, b, c, d = int(cq[i]), int(cq[i + 1]), int(ck[i]), int(ck[i + 1])
        if b == a:
            continue
        po, plse = pop(*(t.transpose(0, 1)[None] for t in (q[a:b], k[c:d], v[c:d])), **params)
        torch.testing.assert_close(o[a:b], po[0].transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(lse[:, a:b], plse[0], rtol=0, atol=0)


def test_cpu_op_empty_problems(vop):
    q, k, v, cq, ck = packed(vop.spec, [0, 0], [3, 0])
    o, lse = vop(q, k, v, cq, ck, 0, 3)
    assert o.shape == (0, 4, 128) and lse.shape == (4, 0)
    q, k, v, cq, ck = packed(vop.spec, [2, 1], [0, 0])
    o, lse = vop(q, k, v, cq, ck, 2, 0)
    assert (o == 0).all() and torch.isneginf(lse).all()
    q, k, v, cq, ck = packed(vop.spec, [], [])
    o, lse = vop(q, k, v, cq, ck, 0, 0)
    assert o.shape == (0, 4, 128)


def test_cpu_gradients_match_padded_op_per_sequence():
    pop = shipped_op_named("llama3_gqa")
    op = pop.varlen
    q, k, v, cq, ck = packed(op.spec, LENS_Q, LENS_K, hq=4, hkv=2, dtype=torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, lse = op(q, k, v, cq, ck, 17, 30)
    g = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=g).to(o.dtype)
    dlse = torch.randn(lse.shape, generator=g)
    (o.float() * do.float()).sum().backward(retain_graph=True)
    (lse.masked_fill(torch.isneginf(lse), 0) * dlse).sum().backward()
    for i in range(len(LENS_Q)):
        a, b, c, d = int(cq[i]), int(cq[i + 1]), int(ck[i]), int(ck[i + 1])
        qs, ks, vs = (t.detach()[x:y].transpose(0, 1)[None].requires_grad_()
                      for t, x, y in ((q, a, b), (k, c, d), (v, c, d)))  # fmt: skip
        if b == a or d == c:
            assert (q.grad[a:b] == 0).all()
            assert (k.grad[c:d] == 0).all() and (v.grad[c:d] == 0).all()
            continue
        po, plse = pop(qs, ks, vs)
        seed_o = do[a:b].transpose(0, 1)[None]
        seed_l = dlse[:, a:b][None].masked_fill(torch.isneginf(plse), 0)
        torch.autograd.backward([po.float(), plse], [seed_o.float(), seed_l])
        for name, ours, ref in (("q", q.grad[a:b], qs.grad), ("k", k.grad[c:d], ks.grad),
                                ("v", v.grad[c:d], vs.grad)):  # fmt: skip
            torch.testing.assert_close(
                ours, ref[0].transpose(0, 1), atol=2e-2, rtol=2e-2, msg=f"d{name} seq {i}"
            )


def test_opcheck_with_gradients():
    op = shipped_op_named("alibi").varlen
    q, k, v, cq, ck = packed(op.spec, [3, 0, 5], [4, 2, 5], hq=2, hkv=1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    slopes = torch.rand(2)
    torch.library.opcheck(op.torch_op, (q, k, v, cq, ck, 5, 5, 0.125, slopes))


def test_torch_compile_fullgraph_forward_and_backward(vop):
    q, k, v, cq, ck = packed(vop.spec, [3, 0, 5], [4, 2, 5])
    q.requires_grad_()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(q, k, v, cq, ck):
        return vop(q, k, v, cq, ck, 5, 5)[0].float().sum()

    f(q, k, v, cq, ck).backward()
    g = q.grad.clone()
    q.grad = None
    vop(q, k, v, cq, ck, 5, 5)[0].float().sum().backward()
    torch.testing.assert_close(g, q.grad)


def test_varlen_spec_file_builds_its_own_op():
    spec = loads_spec(VARLEN_YAML, "vl.yaml")
    op = build_op(spec)
    assert isinstance(op, VarlenOp) and op.varlen is op
    assert "Tensor cu_seqlens_q" in str(op.torch_op._schema)
    q, k, v, cq, ck = packed(spec, [3, 2], [3, 4], hq=2, hkv=2)
    o, lse = op(q, k, v, cq, ck, 3, 4)
    ref_o, ref_lse = attention_reference_varlen(spec, q, k, v, cq, ck, compute_dtype=torch.float32)
    torch.testing.assert_close(o, ref_o.to(o.dtype))
    assert dataclasses.replace(spec, varlen=False) != spec


def test_build_verification_packs_padded_inputs_for_a_varlen_spec():
    """``flashgen build`` verifies a varlen spec through
    :func:`flashgen.bench.verify.call_padded`."""
    from flashgen.bench.verify import call_padded
    from flashgen.cli.commands import format_spec

    pop = shipped_op_named("alibi")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, n, 128, generator=g).to(torch.bfloat16) for n in (5, 7, 7))
    k, v = k[:, :2], v[:, :2]
    slopes = torch.rand(4, generator=g)
    o, lse = call_padded(pop.varlen, q, k, v, {"slopes": slopes})
    po, plse = call_padded(pop, q, k, v, {"slopes": slopes})
    assert o.shape == po.shape and lse.shape == plse.shape
    torch.testing.assert_close(o, po, rtol=0, atol=0)
    torch.testing.assert_close(lse, plse, rtol=0, atol=0)
    assert "varlen         true" in format_spec(loads_spec(VARLEN_YAML))


@pytest.mark.parametrize("name", ["alibi", "bidir_d256"])
def test_launch_values_cover_every_kernel_argument(name):
    """What the CUDA impls launch with, packed against each varlen kernel's ABI (numpy only):
    batch strides 0, the grid's max_seqlen clamped to the totals, pre/convert over the
    packed rows as one batch, grids sized from the clamped maxima."""
    from flashgen.ops.prefill.varlen import backward_launches, forward_launch, validate_varlen
    from flashgen.runtime.launch import kernel_args

    spec = varlen_spec(shipped(name))
    q, k, v, cq, ck = packed(spec, LENS_Q, LENS_K, hq=4, hkv=2)
    tensors = {p.name: torch.rand(4) for p in spec.tensor_params}
    dims = validate_varlen(spec, q, k, v, cq, ck, 100_000, 25, tensors)
    o = torch.empty(36, 4, spec.head_dim_v, dtype=q.dtype)
    lse = torch.empty(4, 36)
    fplan = plan_forward(spec, "sm_90")
    grid, values = forward_launch(spec, fplan, q, k, v, o, lse, cq, ck, dims, 0.1, [], tensors)
    assert len(kernel_args(fplan, values)) == len(fplan.args)
    assert (values["max_seqlen_q"], values["max_seqlen_k"], values["total_q"]) == (36, 25, 36)
    assert values["q_sb"] == values["o_sb"] == values["k_sb"] == 0
    assert (values["q_sh"], values["q_ss"]) == (q.stride(1), q.stride(0))
    assert grid == (fplan.num_m_blocks(36) * 8 * 4, 1, 1)
    for atomic in (False, True):
        bplan = plan_backward(spec, "sm_90", atomic_dq=atomic)
        t_in = {"q": q, "k": k, "v": v, "o": o, "dout": o, "lse": lse, "dsum": lse,
                "dq": q, "dk": k, "dv": v,
                "dq_accum": torch.empty(4, 36, spec.head_dim) if atomic else None}  # fmt: skip
        launches = backward_launches(spec, bplan, t_in, cq, ck, dims, 0.1, [], tensors)
        assert list(launches) == ["pre", "dkdv", "convert" if atomic else "dq"]
        for kp, (g, vals) in zip(bplan.kernels, launches.values(), strict=True):
            assert len(kernel_args(kp, vals)) == len(kp.args), kp.kernel_name
            assert g[0] > 0
        assert launches["pre"][1]["batch"] == 1 and launches["pre"][1]["seqlen_q"] == 36
        assert launches["dkdv"][1]["batch"] == 8
        t = bplan.tiles
        assert launches["dkdv"][0][0] == -(-25 // t.dkdv_block_n) * 8 * 2 * t.dkdv_dsplit


def test_a_grid_past_the_cuda_limit_is_refused():
    from flashgen.ops.prefill.varlen import _check_grids

    _check_grids((2**31 - 1, 1, 1))
    with pytest.raises(OpInputError, match="launch grid needs"):
        _check_grids((1, 1, 1), (2**31, 1, 1))
