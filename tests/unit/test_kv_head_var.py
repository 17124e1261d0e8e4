"""The DSL index variable ``h_kv``: the KV head query head ``h`` reads under GQA.

``h_kv = h / (num_heads / num_heads_kv)`` (``h`` itself without GQA), so a tensor param
declared ``[num_heads_kv]`` (per-KV-head slopes, windows) is indexed in bounds.  Checked
here on CPU: the float reference against hand-written PyTorch GQA attention, the index
bounds analysis, the checker, derivatives, FlexAttention mods, the CPU op and its block
table, and (with nvcc) spill-free builds of every kernel that renders DSL expressions:
forward (FA2-class, Hopper, Hopper persistent), backward (deterministic, atomic-dQ,
Hopper) and the block-table pre-pass.  The GPU numerics are in
``tests/gpu/test_user_specs_gpu.py``.
"""

from __future__ import annotations

import math
import shutil

import pytest

torch = pytest.importorskip("torch")

from flashgen.analysis import derive  # noqa: E402
from flashgen.analysis.indexbounds import possible_violations  # noqa: E402
from flashgen.bench.flexmods import flex_mods  # noqa: E402
from flashgen.build import cache  # noqa: E402
from flashgen.build.render import render  # noqa: E402
from flashgen.codegen.abi import block_table_dims  # noqa: E402
from flashgen.codegen.cuda_expr import cuda_expr  # noqa: E402
from flashgen.families.build import build_backward, build_forward  # noqa: E402
from flashgen.families.hopper_bwd import eligible as hopper_bwd_eligible  # noqa: E402
from flashgen.families.registry import plan_block_table  # noqa: E402
from flashgen.frontend import ir  # noqa: E402
from flashgen.frontend.errors import OpInputError, SpecError  # noqa: E402
from flashgen.frontend.spec import loads_spec  # noqa: E402
from flashgen.ops.cpu.reference import _env, attention_reference, eval_expr, eval_mask  # noqa: E402
from flashgen.ops.op import build_op  # noqa: E402

#: ALiBi with one slope per KV head (the query heads of a group share it).
SCORE = """\
name: kv_alibi
head_dim: 64
dtype: fp16
score_mod: score - w[h_kv] * abs(q_idx - kv_idx)
params:
  w: {type: f32, shape: [num_heads_kv]}
"""
#: A window that widens with the KV head (index only: the tile classifier decides it).
MASK = """\
name: kv_window
head_dim: 64
dtype: fp16
mask: causal && q_idx - kv_idx < 16 + 24 * h_kv
"""
#: A per-KV-head window from a tensor (the block-table pre-pass builds its tiles).
TABLE_MASK = """\
name: kv_table_window
head_dim: 64
dtype: fp16
mask: causal && q_idx - kv_idx < win[h_kv]
params:
  win: {type: i32, shape: [num_heads_kv]}
"""


def _spec(text: str):
    return loads_spec(text, "hkv.yaml")


def _qkv(b, hq, hkv, sq, sk, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, sk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, sk, d, generator=g, dtype=torch.float64)
    return q, k, v


def _gqa_by_hand(q, k, v, bias, keep):
    """softmax(q k^T / sqrt(d) + bias, masked by keep) v with k, v repeated per group."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ vv


# ----------------------------------------------------------------------------- semantics
def test_index_var_is_declared_and_reserved():
    assert ir.INDEX_VARS["h_kv"] == ir.Ty.I32
    with pytest.raises(SpecError, match="h_kv"):
        _spec("name: x\nhead_dim: 64\ndtype: fp16\nparams:\n  h_kv: {type: i32, default: 1}\n")
    with pytest.raises(SpecError, match="cannot index 'h_kv'"):
        _spec("name: x\nhead_dim: 64\ndtype: fp16\nmask: h_kv[0] > 0\n")


@pytest.mark.parametrize("hq,hkv", [(8, 2), (6, 3), (4, 4), (5, 1)])
@pytest.mark.parametrize("sq,sk", [(17, 17), (1, 33), (29, 7)])
def test_reference_score_mod_matches_hand_written_gqa(hq, hkv, sq, sk):
    spec = _spec(SCORE)
    q, k, v = _qkv(2, hq, hkv, sq, sk)
    w = torch.rand(hkv, dtype=torch.float64) + 0.1
    o, _ = attention_reference(spec, q, k, v, params={"w": w})
    dist = (torch.arange(sq).view(sq, 1) - torch.arange(sk).view(1, sk)).abs()
    slope = w.repeat_interleave(hq // hkv).view(1, hq, 1, 1)  # query head h -> w[h // group]
    want = _gqa_by_hand(q, k, v, -slope * dist, torch.ones(1, 1, sq, sk, dtype=torch.bool))
    torch.testing.assert_close(o, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (6, 3), (4, 4)])
@pytest.mark.parametrize("sq,sk", [(40, 40), (23, 61)])
def test_reference_masks_match_hand_written_gqa(hq, hkv, sq, sk):
    q, k, v = _qkv(1, hq, hkv, sq, sk, seed=1)
    h_kv = (torch.arange(hq) // (hq // hkv)).view(1, hq, 1, 1)
    qi, ki = torch.arange(sq).view(sq, 1), torch.arange(sk).view(1, sk)
    causal = qi + sk - sq >= ki
    zero = torch.zeros(1, 1, sq, sk, dtype=torch.float64)
    # index-only
    o, _ = attention_reference(_spec(MASK), q, k, v)
    keep = causal & (qi - ki < 16 + 24 * h_kv)
    torch.testing.assert_close(o, _gqa_by_hand(q, k, v, zero, keep), rtol=1e-6, atol=1e-6)
    got = eval_mask(_spec(MASK), batch=1, heads_q=hq, seqlen_q=sq, seqlen_k=sk, heads_kv=hkv)
    assert torch.equal(got, keep.expand(1, hq, sq, sk))
    # through a [num_heads_kv] tensor
    win = torch.tensor([3, 9, 1, 20])[:hkv]
    o, _ = attention_reference(_spec(TABLE_MASK), q, k, v, params={"win": win})
    keep = causal & (qi - ki < win[h_kv])
    torch.testing.assert_close(o, _gqa_by_hand(q, k, v, zero, keep), rtol=1e-6, atol=1e-6)


def test_reference_refuses_heads_that_do_not_divide():
    with pytest.raises(ValueError, match="not a multiple"):
        eval_mask(_spec(MASK), batch=1, heads_q=6, seqlen_q=4, seqlen_k=4, heads_kv=4)


def test_indexbounds_accepts_per_kv_head_tensors():
    sym = {"batch": 2, "num_heads": 8, "num_heads_kv": 2, "seqlen_q": 100, "seqlen_k": 100}
    assert possible_violations(_spec(SCORE), sym, {}) == []
    assert possible_violations(_spec(TABLE_MASK), sym, {}) == []
    by_h = _spec(SCORE.replace("w[h_kv]", "w[h]"))  # the pre-h_kv way: leaves the tensor
    assert possible_violations(by_h, sym, {})


def test_derivative_treats_h_kv_as_a_constant():
    spec = _spec(SCORE.replace("score - w[h_kv] * abs(q_idx - kv_idx)", "score * (h_kv + 2)"))
    d = derive.d_dscore(spec.score_mod)
    env = {
        "h_kv": torch.arange(3).view(1, 3, 1, 1),
        "__float__": torch.float64,
        "__device__": torch.device("cpu"),
    }
    assert torch.equal(eval_expr(d, env).reshape(-1), torch.tensor([2.0, 3.0, 4.0]).double())


def test_lowering_names_the_kernel_local():
    spec = _spec(SCORE)
    assert "h_kv" in cuda_expr(spec.score_mod, spec)
    assert block_table_dims(_spec(TABLE_MASK)) == (False, True)  # per head, as h


def test_flex_mods_take_the_group():
    spec = _spec(TABLE_MASK)
    win = torch.tensor([2, 7])
    _, mask_mod = flex_mods(spec, 12, 12, {"win": win}, group=4)
    h = torch.arange(8).view(1, 8, 1, 1)
    qi, ki = torch.arange(12).view(1, 1, 12, 1), torch.arange(12).view(1, 1, 1, 12)
    got = mask_mod(torch.zeros(1, 1, 1, 1, dtype=torch.int64), h, qi, ki)
    want = eval_mask(
        spec, batch=1, heads_q=8, seqlen_q=12, seqlen_k=12, params={"win": win}, heads_kv=2
    )
    assert torch.equal(got.expand_as(want), want)
    score_mod, _ = flex_mods(_spec(SCORE), 12, 12, {"w": torch.tensor([0.5, 2.0])}, group=4)
    s = torch.zeros(1, 8, 12, 12)
    out = score_mod(s, 0, h, qi, ki)
    assert torch.equal(out[0, 3], -0.5 * (qi - ki).abs()[0, 0].float())
    assert torch.equal(out[0, 4], -2.0 * (qi - ki).abs()[0, 0].float())
    with pytest.raises(ValueError, match="group"):
        flex_mods(spec, 12, 12, {"win": win}, group=0)


def test_cpu_op_and_block_table_under_gqa():
    op = build_op(_spec(TABLE_MASK))
    q, k, v = (t.to(torch.float16) for t in _qkv(1, 8, 2, 70, 70, seed=3))
    win = torch.tensor([5, 40], dtype=torch.int32)
    bm = op.block_mask(70, 70, win=win, batch=1, num_heads=8, num_heads_kv=2)
    assert bm.heads_kv == 2 and bm.heads_q == 8
    o, _ = op.attention(q, k, v, win=win, block_mask=bm)
    want, _ = attention_reference(op.spec, q, k, v, params={"win": win})
    torch.testing.assert_close(o.double(), want, rtol=2e-2, atol=2e-2)
    # the table holds for 2 KV heads only
    k4, v4 = (t.repeat_interleave(2, 1) for t in (k, v))
    with pytest.raises(OpInputError, match="num_heads_kv=2"):
        op.attention(q, k4, v4, win=torch.tensor([5, 40, 5, 40], dtype=torch.int32), block_mask=bm)


# ----------------------------------------------------------------------------- kernels
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


# The nvcc tests below prove that h_kv renders and compiles in every kernel that renders DSL
# expressions.  The FA2-class units render the same CUDA for sm_80 and sm_90 but for the
# kernels' names (and the atomic unit's sm_90 vector reduction), so each spec builds each
# FA2-class unit for one target, alternating (spec i, unit j: target (i + j) % 2): every
# spec and every unit meets both targets.  The forward (FA2-class on sm_80, Hopper on
# sm_90, different code) builds for both; each spec's Hopper forward builds one persistent
# scheduler besides its default (static and dynamic differ in two index expressions).
TARGETS = ("sm_80", "sm_90")
PERSISTENT = {"score": "static", "mask": "dynamic", "table": "static"}


@needs_nvcc
@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
@pytest.mark.parametrize("text", [SCORE, MASK, TABLE_MASK], ids=["score", "mask", "table"])
def test_forward_kernels_compile_without_spills(text, target):
    spec = _spec(text)
    plan, _, report = build_forward(spec, target)
    assert report.spill_bytes == 0, report
    assert "h_kv" in render(plan)
    if target == "sm_90" and plan.template == "sm_90/fwd.cu.j2":
        scheduler = PERSISTENT[{SCORE: "score", MASK: "mask", TABLE_MASK: "table"}[text]]
        assert plan.context["persistent"] != scheduler
        plan, _, report = build_forward(spec, target, persistent=scheduler)
        assert plan.context["persistent"] and report.spill_bytes == 0, (scheduler, report)


@needs_nvcc
@pytest.mark.parametrize("i,text", [pytest.param(i, t, id=n) for i, (n, t) in enumerate(
    [("score", SCORE), ("mask", MASK), ("table", TABLE_MASK)])])  # fmt: skip
def test_backward_units_compile_without_spills(i, text):
    """The deterministic and atomic units, one target each (alternating by spec), and the
    Hopper one where the spec takes it."""
    spec = _spec(text)
    for j, atomic in enumerate((False, True)):
        _, _, report = build_backward(spec, TARGETS[(i + j) % 2], atomic_dq=atomic)
        assert report.spill_bytes == 0, (atomic, report)
    if hopper_bwd_eligible(spec, "sm_90"):  # not a tensor-reading mask
        plan, _, report = build_backward(spec, "sm_90", hopper=True)
        assert plan.dkdv.template == "sm_90/bwd.cu.j2"
        assert report.spill_bytes == 0, report


@needs_nvcc
@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_pre_pass_compiles_without_spills(target):
    spec = _spec(TABLE_MASK)
    fwd, _, _ = build_forward(spec, target)
    plan = plan_block_table(spec, target, fwd.tiles)
    src = render(plan)
    assert "const int h_kv = h / (heads_q / heads_kv);" in src
    _, report = cache.get_or_build(src, plan)
    assert report.spill_bytes == 0, report


def test_env_needs_the_kv_heads():
    env = _env(_spec(MASK), 1, 6, 3, 3, {}, "cpu", torch.float32, Hkv=2)
    assert env["h_kv"].reshape(-1).tolist() == [0, 0, 0, 1, 1, 1]


@needs_nvcc
@pytest.mark.parametrize("i,text", [pytest.param(0, SCORE, id="score"),
                                    pytest.param(1, MASK, id="mask")])  # fmt: skip
def test_varlen_kernels_compile_without_spills(i, text):
    """Forward, deterministic and atomic varlen units (all FA2-class), one target each
    (spec i, unit j: target (i + j) % 2)."""
    spec = _spec(text + "varlen: true\n")
    _, _, report = build_forward(spec, TARGETS[i % 2])
    assert report.spill_bytes == 0, report
    for j, atomic in enumerate((False, True), start=1):
        _, _, report = build_backward(spec, TARGETS[(i + j) % 2], atomic_dq=atomic)
        assert report.spill_bytes == 0, (atomic, report)
