"""Block-sparse masks on the GPU: skipped EMPTY tiles, unmasked FULL tiles (``pytest -m gpu``).

The kernels classify (query block, key block) tiles with the spec's interval classifier
(``flashgen/analysis/masktiles.py``), never load EMPTY ones and evaluate no mask on FULL ones.
This suite checks forward and backward against the float64 reference where that matters:
the sparse shipped specs with parameters that make every class appear at many blocks
(windows, chunks and prefixes of 1 to 1000 keys), lengths that are not multiples of any
tile, Sq != Sk both ways and GQA; a mask with non-contiguous empty stripes (the block
search's skipping), a head-dependent window (per-head search in the dK/dV kernel), a
non-causal chunked mask (FULL tiles off the diagonal without the causal flag) and
document masking (tensor reads: PARTIAL tiles, causal EMPTY ones).  Same accuracy rule
and helpers as ``test_forward.py`` / ``test_backward_kernels.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_backward_kernels import PATHS, expected_path, ref_grads  # noqa: E402
from test_forward import check, shipped  # noqa: E402

from flashgen.bench.verify import random_inputs  # noqa: E402
from flashgen.frontend.spec import loads_spec  # noqa: E402
from flashgen.ops.op import build_op  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(params=PATHS)
def bwd_path(request) -> bool:
    """The ``deterministic`` flag of the backward path under test (as in
    ``test_backward_kernels.py``)."""
    return request.param


SPARSE = [
    ("mistral_swa", "window", [1, 40, 256, 1000]),
    ("chunked_local", "chunk", [1, 64, 100, 333]),
    ("prefix_lm", "prefix", [0, 1, 100, 777]),
]
CASES = [pytest.param(name, {p: v}, id=f"{name}-{p}{v}") for name, p, vals in SPARSE for v in vals]
LENGTHS = [(1000, 1000), (127, 1000), (1000, 127), (1, 1000)]


def custom(name: str, mask: str, params: str = "", head_dim: int = 128):
    text = f"name: {name}\nhead_dim: {head_dim}\ndtype: bf16\nmask: '{mask}'\n"
    if params:
        text += "params:\n" + params
    return loads_spec(text, f"{name}.yaml")


CUSTOM = {
    # empty stripes every third 64-key band: the search must skip and come back
    "stripes": ("causal && (kv_idx / 64) % 3 != 1", ""),
    # a window that grows with the head: classes differ per head of a GQA group
    "head_window": ("causal && q_idx + seqlen_k - seqlen_q - kv_idx < 48 * (h + 1)", ""),
    # bidirectional chunks: FULL blocks everywhere inside the chunk, no causal flag
    "chunks_bidir": ("q_idx / c == kv_idx / c", "  c: {type: i32, default: 200}\n"),
    # tensor reads: never FULL from the static classifier, EMPTY above the diagonal
    "doc_causal": (
        "causal && doc[q_idx + seqlen_k - seqlen_q] == doc[kv_idx]",
        "  doc: {type: i32, shape: [seqlen_k]}\n",
    ),
}


def _doc_ids(sk: int, dev):
    """Document ids of lengths 1, 50, 300, ... over the keys (sorted, like packing)."""
    cuts = torch.tensor([1, 51, 351, 400, 777], device=dev)
    return torch.bucketize(torch.arange(sk, device=dev), cuts, right=True).to(torch.int32)


# ----------------------------------------------------------------------------- forward
@pytest.mark.parametrize("sq, sk", LENGTHS)
@pytest.mark.parametrize("name, params", CASES)
def test_sparse_specs_forward(name, params, sq, sk, error_bound):
    check(shipped(name), 1, 4, 2, sq, sk, error_bound, seed=sq + sk, **params)


@pytest.mark.parametrize(
    "name, params",
    [
        ("mistral_swa", {"window": 256}),
        ("chunked_local", {"chunk": 333}),
        ("prefix_lm", {"prefix": 777}),
    ],
)
def test_sparse_specs_forward_long(name, params, error_bound):
    check(shipped(name), 1, 2, 1, 4097, 4097, error_bound, seed=7, **params)


@pytest.mark.parametrize("sq, sk", [(1000, 1000), (300, 1000), (1000, 300)])
@pytest.mark.parametrize("key", sorted(CUSTOM))
def test_custom_masks_forward(key, sq, sk, error_bound):
    spec = custom(key, *CUSTOM[key])
    extra = {"doc": _doc_ids(sk, torch.device("cuda"))} if key == "doc_causal" else {}
    check(spec, 1, 4, 2, sq, sk, error_bound, seed=sq, **extra)


# ----------------------------------------------------------------------------- backward
def check_grads_params(spec, b, hq, hkv, sq, sk, params, *, seed=0, deterministic=True):
    """``test_backward_kernels.check_grads`` with explicit params (scalars and tensors)."""
    op = build_op(spec)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    q, k, v, defaults = random_inputs(spec, b, hq, hkv, sq, sk, dev, gen)
    params = {**defaults, **params}
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o, _ = op.attention(q, k, v, deterministic=deterministic, **params)
    do = torch.randn(o.shape, device=dev, generator=gen).to(o.dtype)
    o.backward(do)
    assert (torch.cuda.current_device(), expected_path(spec, deterministic)) in op.backward._kernels
    ref64 = ref_grads(spec, q, k, v, do, params, torch.float64)
    low = ref_grads(spec, q, k, v, do, params, q.dtype)
    for name, ours, r64, rlow in zip("qkv", (q.grad, k.grad, v.grad), ref64, low, strict=True):
        assert not ours.isnan().any(), f"d{name} has NaN"
        err = (ours.double() - r64).abs().max().item()
        bound = 2 * (rlow.double() - r64).abs().max().item() + 1e-3
        assert err <= bound, (
            f"{spec.name} {params} d{name} Sq={sq} Sk={sk}: {err:.3e} > {bound:.3e}"
        )


@pytest.mark.parametrize("sq, sk", [(1000, 1000), (257, 1000), (1000, 257)])
@pytest.mark.parametrize("name, params", CASES)
def test_sparse_specs_backward(name, params, sq, sk, bwd_path):
    check_grads_params(shipped(name), 1, 4, 2, sq, sk, params, seed=sq, deterministic=bwd_path)


@pytest.mark.parametrize("key", sorted(CUSTOM))
def test_custom_masks_backward(key, bwd_path):
    spec = custom(key, *CUSTOM[key])
    sq, sk = 700, 1000
    extra = {"doc": _doc_ids(sk, torch.device("cuda"))} if key == "doc_causal" else {}
    check_grads_params(spec, 1, 4, 2, sq, sk, extra, seed=3, deterministic=bwd_path)


# ----------------------------------------------------------------------------- row / column terms
#: masks whose tensor reads the FA2-class backward takes as row / column terms
#: (flashgen/analysis/rowcol.py): float terms of each side (a bool column term among them) and
#: 2-D document ids, at every head dim of the backward tables' test set
TERM_MASKS = {
    "float_terms": (
        "qb[b, q_idx] + kw[h, kv_idx] > 0.0 || (kw[h, kv_idx] < -1.0 && causal)",
        "  qb: {type: f32, shape: [batch, seqlen_q]}\n"
        "  kw: {type: f32, shape: [num_heads, seqlen_k]}\n",
    ),
    "doc_2d": (
        "causal && doc_q[b, q_idx] == doc_kv[b, kv_idx]",
        "  doc_q: {type: i32, shape: [batch, seqlen_q]}\n"
        "  doc_kv: {type: i32, shape: [batch, seqlen_k]}\n",
    ),
}


def _term_params(key: str, b: int, hq: int, sq: int, sk: int, gen) -> dict:
    dev = torch.device("cuda")
    if key == "float_terms":
        return {
            "qb": torch.randn(b, sq, device=dev, generator=gen),
            "kw": torch.randn(hq, sk, device=dev, generator=gen),
        }
    ids = [
        torch.randint(0, 4, (b, s), device=dev, generator=gen, dtype=torch.int32) for s in (sq, sk)
    ]
    return {"doc_q": ids[0].sort(-1).values, "doc_kv": ids[1].sort(-1).values}


@pytest.mark.parametrize("sq, sk", [(300, 257), (17, 1031)])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("key", sorted(TERM_MASKS))
def test_row_and_column_terms_backward(key, d, sq, sk, bwd_path):
    """The backward kernels with row / column terms (dkdv: its keys' terms per thread, the
    step's query rows' by shuffles; dq the other way round; the Hopper backward's edge steps:
    once per key row and query column) against the float64 reference; the plan must have
    taken them (the atomic dK/dV kernel at d256 falls back to
    per-element reads for float_terms, where the terms spill)."""
    spec = custom(f"{key}_d{d}", *TERM_MASKS[key], head_dim=d)
    b, hq, hkv = 2, 4, 2
    gen = torch.Generator(device=torch.device("cuda")).manual_seed(sq + d)
    params = _term_params(key, b, hq, sq, sk, gen)
    check_grads_params(spec, b, hq, hkv, sq, sk, params, seed=sq + d, deterministic=bwd_path)
    path = expected_path(spec, bwd_path)
    plan = build_op(spec).backward.kernels(torch.device("cuda"), path=path)[0]
    ctx = plan.dkdv.context
    if plan.wgmma:  # sm_90, deterministic=False: the Hopper backward (hopper_bwd.tensor_masks)
        # its edge steps load the one-sided tensor reads once per key row and query column
        assert ctx["block_table"] and ctx["keep_expr"] is not None
        assert ctx["keep_rows"] and ctx["keep_cols"]
        return
    assert ctx["dq_side_terms"] or plan.atomic_dq
    assert ctx["dkdv_side_terms"] or (plan.atomic_dq and d == 256 and key == "float_terms")
