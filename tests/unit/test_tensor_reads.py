"""Tensor-param reads as the kernels lower them (``flashgen.codegen.cuda_expr``): a subscript
is clamped into its extent (``fg::clamp_index``) exactly where interval bounds do not prove
it inside (``cuda_expr.index_in_bounds``), and the offset splits into a hoisted 64-bit base of
tile-invariant subscripts plus a 32-bit per-element part where that cannot overflow.

The lowered reads are also run on the host (a C++ program built with the host compiler, the
kernels' own ``fg::clamp_index``) over every (b, h, q_idx, kv_idx) of small sizes, with
GQA, and compared with the reference's ``eval_expr`` (which clamps every read): the same
element is read wherever the clamp was dropped or the offset split.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from host_cxx import preamble

from flashgen.codegen.cuda_expr import Invariants, cuda_expr, index_in_bounds
from flashgen.frontend import ir
from flashgen.frontend.spec import load_spec, loads_spec

SPEC_DIR = Path(__file__).resolve().parents[2] / "specs"


def _spec(score_mod: str, params: str):
    return loads_spec(
        f"name: tr\nhead_dim: 64\ndtype: bf16\nscore_mod: '{score_mod}'\nparams:\n{params}",
        "tr.yaml",
    )


def _subscripts(spec):
    """(subscript expr, declared dim) of the score_mod's first tensor read."""
    read = next(n for n in ir.walk(spec.score_mod) if isinstance(n, ir.Index))
    shape = spec.param(read.name).shape
    return list(zip(read.indices, shape, strict=True))


# (score_mod, params, per-subscript: provably inside (no clamp))
# fmt: off
BOUNDS = [
    ("score + bias[h, min(max(kv_idx - q_idx, -128), 128) + 128]",
     "  bias: {type: f32, shape: [num_heads, 257]}\n", [True, True]),
    # the distance is not bounded: the clamp stays
    ("score + bias[h, kv_idx - q_idx + 128]",
     "  bias: {type: f32, shape: [num_heads, 257]}\n", [True, False]),
    ("score + bias[h, min(max(kv_idx - q_idx, -128), 128) + 129]",
     "  bias: {type: f32, shape: [num_heads, 257]}\n", [True, False]),
    # a query head into a per-KV-head tensor (GQA): may leave it
    ("score + w[h]", "  w: {type: f32, shape: [num_heads_kv]}\n", [False]),
    ("score + w[h_kv]", "  w: {type: f32, shape: [num_heads_kv]}\n", [True]),
    ("score + w[h]", "  w: {type: f32, shape: [num_heads]}\n", [True]),
    ("score + w[b]", "  w: {type: f32, shape: [batch]}\n", [True]),
    ("score + w[h]", "  w: {type: f32, shape: [batch]}\n", [False]),
    ("score + w[q_idx]", "  w: {type: f32, shape: [seqlen_q]}\n", [True]),
    ("score + w[q_idx]", "  w: {type: f32, shape: [seqlen_k]}\n", [False]),
    ("score + w[kv_idx]", "  w: {type: f32, shape: [seqlen_k]}\n", [True]),
    ("score + w[kv_idx + 1]", "  w: {type: f32, shape: [seqlen_k]}\n", [False]),
    ("score + w[kv_idx % 4]", "  w: {type: f32, shape: [4]}\n", [True]),
    ("score + w[kv_idx % 5]", "  w: {type: f32, shape: [4]}\n", [False]),
    ("score + w[(kv_idx - q_idx) % 4]", "  w: {type: f32, shape: [4]}\n", [False]),
    ("score + w[abs(kv_idx - q_idx) % 4]", "  w: {type: f32, shape: [4]}\n", [True]),
    ("score + w[3]", "  w: {type: f32, shape: [4]}\n", [True]),
    ("score + w[4]", "  w: {type: f32, shape: [4]}\n", [False]),
    ("score + w[0]", "  w: {type: f32, shape: [num_heads]}\n", [False]),  # symbolic: not proven
    # scalar params range over their whole type
    ("score + w[p]", "  w: {type: f32, shape: [4]}\n  p: {type: i32, default: 1}\n", [False]),
    ("score + w[min(max(p, 0), 3)]",
     "  w: {type: f32, shape: [4]}\n  p: {type: i32, default: 1}\n", [True]),
    # a subscript read from a tensor is unknown
    ("score + w[ids[b]]", "  w: {type: f32, shape: [8]}\n  ids: {type: i32, shape: [batch]}\n",
     [False]),
    ("score + w[min(max(ids[b], 0), 7)]",
     "  w: {type: f32, shape: [8]}\n  ids: {type: i32, shape: [batch]}\n", [True]),
    # int32 overflow makes a bound unknown: q_idx * 4 may wrap
    ("score + w[(q_idx * 4) % 8]", "  w: {type: f32, shape: [8]}\n", [False]),
]
# fmt: on


@pytest.mark.parametrize(("mod", "params", "inside"), BOUNDS, ids=[b[0] for b in BOUNDS])
def test_clamp_dropped_exactly_where_provable(mod, params, inside):
    spec = _spec(mod, params)
    got = [index_in_bounds(ix, dim, spec) for ix, dim in _subscripts(spec)]
    assert got == inside
    code = cuda_expr(spec.score_mod, spec, Invariants(raw_score="score_raw"))
    assert code.count("fg::clamp_index(") == inside.count(False), code


def test_t5_bias_reads_without_clamps():
    spec = load_spec(SPEC_DIR / "t5_bias.yaml")
    code = cuda_expr(spec.score_mod, spec, Invariants(raw_score="score_raw"))
    assert "clamp_index" not in code


def test_t5_bias_offset_is_a_hoisted_base_plus_an_int():
    """The head's row (and T5's + 128) is one per-tile base; the element offset is an int."""
    spec = load_spec(SPEC_DIR / "t5_bias.yaml")
    code = cuda_expr(spec.score_mod, spec, Invariants(raw_score="score_raw"))
    assert "__ldg(fg::base_ptr(t_bias + ((int64_t)(h) * (int64_t)(257) + 128)) + (" in code
    assert code.endswith("+ (min(max((kv_idx - q_idx), (-128)), 128))))")


@pytest.mark.parametrize(
    ("mod", "params", "want"),
    [
        # a varying subscript times a symbolic extent: one row-major 64-bit offset, no int
        # products
        ("score + t[q_idx, h % 3]", "  t: {type: f32, shape: [seqlen_q, 3]}\n",
         "t_t[((int64_t)(q_idx)) * (int64_t)(3) + (int64_t)((h % 3))]"),
        ("score + t[kv_idx, q_idx]", "  t: {type: f32, shape: [seqlen_k, seqlen_q]}\n",
         "t_t[((int64_t)(kv_idx)) * (int64_t)(seqlen_q) + (int64_t)(q_idx)]"),
        # a literal table: one int offset, no base
        ("score + t[q_idx % 4, kv_idx % 8]", "  t: {type: f32, shape: [4, 8]}\n",
         "t_t[(q_idx % 4) * 8 + (kv_idx % 8)]"),
        # only invariant subscripts: one 64-bit offset, as before
        ("score + w[h_kv]", "  w: {type: f32, shape: [num_heads_kv]}\n", "t_w[(int64_t)(h_kv)]"),
        # a clamped subscript keeps its literal (the clamp is of the whole sum)
        ("score + t[b, kv_idx + 1]", "  t: {type: f32, shape: [batch, 7]}\n",
         "__ldg(fg::base_ptr(t_t + ((int64_t)(b) * (int64_t)(7))) + "
         "(fg::clamp_index((kv_idx + 1), 7)))"),
    ],
)  # fmt: skip
def test_offset_forms(mod, params, want):
    spec = _spec(mod, params)
    assert want in cuda_expr(spec.score_mod, spec, Invariants(raw_score="score_raw"))


def test_reference_keeps_its_bounds_check():
    """Dropping a kernel clamp changes nothing in the reference: it still refuses an index
    outside the tensor at a kept pair."""
    torch = pytest.importorskip("torch")
    from flashgen.ops.cpu.reference import attention_reference

    spec = _spec("score + w[kv_idx - q_idx + 2]", "  w: {type: f32, shape: [4]}\n")
    q = torch.randn(1, 1, 4, 64)
    with pytest.raises(IndexError, match="indexed outside its shape"):
        attention_reference(spec, q, q, q, params={"w": torch.zeros(4)})


# ----------------------------------------------------------------------------- host C++
B, HQ, HKV, SQ, SK = 2, 4, 2, 21, 300  # |kv_idx - q_idx| passes 128; GQA groups of 2

# (score_mod, params): every read form -- clamps dropped and kept, 64-bit base plus 32-bit
# element offset, element offset only, 64-bit element terms (symbolic strides), a subscript
# read from a tensor, a per-KV-head tensor read by the query head (clamped)
# fmt: off
HOST_CASES = [
    ("score + bias[h, min(max(kv_idx - q_idx, -128), 128) + 128]",
     "  bias: {type: f32, shape: [num_heads, 257]}\n"),
    ("score + bias[h, kv_idx - q_idx + 128]", "  bias: {type: f32, shape: [num_heads, 257]}\n"),
    ("score + t[q_idx, h % 3]", "  t: {type: f32, shape: [seqlen_q, 3]}\n"),
    ("score + t[b, kv_idx]", "  t: {type: f32, shape: [batch, seqlen_k]}\n"),
    ("score + t[kv_idx % 4, q_idx % 2, h]", "  t: {type: f32, shape: [4, 2, num_heads]}\n"),
    ("score + t[q_idx % 4, kv_idx % 8]", "  t: {type: f32, shape: [4, 8]}\n"),
    ("score + t[h_kv, q_idx, kv_idx / 50]",
     "  t: {type: f32, shape: [num_heads_kv, seqlen_q, 6]}\n"),
    # literals peeled off proven subscripts into the base, a negative element offset
    ("score + t[h, q_idx % 3 - 1 + 1, 2 + kv_idx % 4]",
     "  t: {type: f32, shape: [num_heads, 3, 6]}\n"),
    ("score + t[b, h_kv, min(kv_idx, 9) - 3 + 3]",
     "  t: {type: f32, shape: [batch, num_heads_kv, 10]}\n"),
    ("score + w[h] * t[ids[b], kv_idx % 5]",
     "  w: {type: f32, shape: [num_heads_kv]}\n  t: {type: f32, shape: [8, 5]}\n"
     "  ids: {type: i32, shape: [batch]}\n"),
]
# fmt: on
SIZES = {"batch": B, "num_heads": HQ, "num_heads_kv": HKV, "seqlen_q": SQ, "seqlen_k": SK}


def _tensors(spec, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for p in spec.tensor_params:
        shape = [d if isinstance(d, int) else SIZES[d] for d in p.shape]
        if p.ty.name == "I32":
            out[p.name] = torch.tensor([3, 11])[: shape[0]].to(torch.int32)  # 11: past t's 8 rows
        else:
            out[p.name] = torch.randn(shape, generator=g, dtype=torch.float32)
    return out


def _host_program(cases) -> str:
    funcs, calls = [], []
    for i, (spec, tensors) in enumerate(cases):
        inv = Invariants(raw_score="score_raw")
        code = cuda_expr(spec.score_mod, spec, inv)
        data = ""
        for name, t in tensors.items():
            is_int = t.dtype.is_floating_point is False
            vals = ", ".join(str(int(v)) if is_int else f"{float(v)!r}f" for v in t.flatten())
            ctype = "int" if is_int else "float"
            data += f"static const {ctype} d{i}_{name}[] = {{{vals}}};\n"
        ptrs = "".join(
            f"    const {'int' if not t.dtype.is_floating_point else 'float'}* t_{n} = d{i}_{n};\n"
            for n, t in tensors.items()
        )
        funcs.append(
            data + f"static float mod_{i}(int b, int h, int q_idx, int kv_idx) {{\n"
            f"    const int batch = {B}, heads_q = {HQ}, heads_kv = {HKV};\n"
            f"    const int seqlen_q = {SQ}, seqlen_k = {SK};\n"
            "    const int h_kv = h / (heads_q / heads_kv);\n"
            "    (void)batch; (void)heads_q; (void)heads_kv; (void)seqlen_q; (void)seqlen_k;\n"
            "    (void)h_kv;\n"
            "    const float q_idx_f = (float)q_idx, kv_idx_f = (float)kv_idx;\n"
            "    (void)q_idx_f; (void)kv_idx_f;\n"
            f"{ptrs}"
            "    const float softmax_scale = 1.0f, score_raw = 0.5f;\n"
            f"    {inv.prologue}\n"
            "    const float score = score_raw * softmax_scale;\n"
            "    (void)score_raw; (void)score;\n"
            f"    return (float)({code});\n}}\n"
        )
        calls.append(
            f"    for (int b = 0; b < {B}; ++b) for (int h = 0; h < {HQ}; ++h)\n"
            f"    for (int q = 0; q < {SQ}; ++q) for (int k = 0; k < {SK}; ++k)\n"
            f'        printf("%.9g\\n", mod_{i}(b, h, q, k));\n'
        )
    return preamble() + "".join(funcs) + "int main() {\n" + "".join(calls) + "}\n"


def test_lowered_reads_match_the_reference_on_the_host(cxx_exe):
    torch = pytest.importorskip("torch")
    from flashgen.ops.cpu.reference import _env, eval_expr

    cases = []
    for i, (mod, params) in enumerate(HOST_CASES):
        spec = _spec(mod, params)
        cases.append((spec, _tensors(spec, seed=i)))
    exe = cxx_exe(_host_program(cases), "reads")
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300).stdout.split()
    per = B * HQ * SQ * SK
    got_all = torch.tensor([float(x) for x in out], dtype=torch.float64)
    assert len(got_all) == per * len(cases)
    for (spec, tensors), got, (mod, _) in zip(cases, got_all.split(per), HOST_CASES, strict=True):
        env = _env(spec, B, HQ, SQ, SK, tensors, "cpu", torch.float64, Hkv=HKV)
        env["score"] = torch.tensor(0.5, dtype=torch.float64)
        want = eval_expr(spec.score_mod, env).expand(B, HQ, SQ, SK).flatten()
        bad = ((got - want).abs() > 1e-6 * (want.abs() + 1)).nonzero().flatten()
        assert len(bad) == 0, (
            f"{mod}: {len(bad)} of {per} differ; first at flat index {int(bad[0])}: "
            f"kernel {float(got[bad[0]])!r}, reference {float(want[bad[0]])!r}"
        )


def test_cpu_op_refuses_an_index_read_from_a_tensor_as_op_input_error():
    """``w[ids[b]]`` with ``ids`` holding 4 for a ``[4]`` w: the CPU op raises an
    :class:`OpInputError` (as docs/reliability.md says, and as ``with_kvcache`` does) naming
    the param, still an ``IndexError`` for code that catches that."""
    torch = pytest.importorskip("torch")
    from flashgen.frontend.errors import OpInputError
    from flashgen.ops.op import build_op

    params = "  w: {type: f32, shape: [4]}\n  ids: {type: i32, shape: [batch]}\n"
    spec = _spec("score + w[ids[b]]", params)
    op = build_op(spec)
    q = torch.randn(2, 2, 5, 64)
    ids = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(OpInputError, match="tensor param 'w' is indexed outside") as info:
        op.attention(q, q, q, ids=ids, w=torch.rand(4))
    assert isinstance(info.value, IndexError)
