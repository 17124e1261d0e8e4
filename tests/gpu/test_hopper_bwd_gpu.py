"""The Hopper (sm_90a) wgmma backward (templates/sm_90/bwd.cu.j2) against the float64
reference's autograd (``pytest -m gpu``; skipped without an sm_90 GPU).

``deterministic=False`` on sm_90 takes this kernel for head_dim 64/128/256 and masks that
read no tensor, with or without a score_mod (:func:`flashgen.ops.prefill.backward.backward_path`);
every case asserts it ran (and, at 256, the split layout: 64-key CTAs whose two warpgroups split
dK, dV, dQ by head-dim columns, P^T and dS^T through shared memory).  Bound
per gradient (the FlashAttention rule, as in test_backward_kernels.py): max|ours - ref64|
<= 2 * max|reference in the input dtype - ref64| + 1e-3.  Fresh random inputs per case;
the caching allocator is poisoned with NaN before each backward, so an output element the
kernels never write (dq, dk, dv, or a dq_accum row not zeroed) shows up as NaN.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_options  # noqa: E402
from test_backward_kernels import REPO, ref_grads  # noqa: E402

from flashgen.bench.verify import random_inputs  # noqa: E402
from flashgen.frontend.spec import load_spec, loads_spec  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs an sm_90 GPU",
    ),
]

#: (B, Hq, Hkv, Sq, Sk): lengths 1, 17, 127, 1000, 4097 with Sq != Sk both ways, GQA.
SHAPES = [
    (1, 2, 2, 1, 1),
    (2, 4, 2, 17, 1000),
    (1, 4, 1, 127, 17),
    (1, 2, 1, 1000, 127),
    (1, 6, 2, 1000, 4097),
    (1, 2, 2, 4097, 1000),
    (2, 8, 8, 257, 257),
]


def hb_spec(d: int, dtype: str, causal: bool):
    name = f"hopbwd_d{d}_{dtype}_{'causal' if causal else 'full'}"
    mask = "causal" if causal else "null"
    return loads_spec(f"name: {name}\nhead_dim: {d}\ndtype: {dtype}\nmask: {mask}\n", f"<{name}>")


def shipped(name: str):
    """A shipped spec; ``d256:NAME``: the same at head_dim 256 (named NAME_d256)."""
    if not name.startswith("d256:"):
        return load_spec(REPO / "specs" / f"{name}.yaml")
    name = name.removeprefix("d256:")
    lines = [
        "head_dim: 256"
        if ln.startswith("head_dim:")
        else f"name: {name}_d256"
        if ln.startswith("name:")
        else ln
        for ln in (REPO / "specs" / f"{name}.yaml").read_text().splitlines()
    ]
    return loads_spec("\n".join(lines) + "\n", f"<{name}_d256>")


def build_op(spec):
    """The op of ``spec`` under the running test's options (:data:`gpu_options.CURRENT`)."""
    return gpu_options.build(spec)


def poison_allocator(*shapes_dtypes) -> None:
    """Fill freed blocks of these sizes with NaN, so the next torch.empty of the same size
    (the backward's dq, dk, dv, dq_accum) starts as NaN."""
    bufs = [torch.full(s, float("nan"), dtype=dt, device="cuda") for s, dt in shapes_dtypes]
    torch.cuda.synchronize()
    del bufs


#: Specs whose Hopper backward spills with 128-query steps at head_dim 64 and is built with 64
#: (tests/unit/test_hopper_bwd.py checks the list), unless ``hopper_bwd.diag_terms`` stages
#: their table (tests/unit/test_diag_terms.py).
SPILL_AT_128 = ("t5_bias",)


def run_case(spec, b, hq, hkv, sq, sk, *, seed, qkv=None, with_dlse=False, params=None):
    op = build_op(spec)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    q, k, v, defaults = random_inputs(spec, b, hq, hkv, sq, sk, dev, gen)
    params = {**defaults, **(params or {})}
    if qkv is not None:
        q, k, v = qkv
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o, lse = op.attention(q, k, v, deterministic=False, **params)
    do = torch.randn(o.shape, device=dev, generator=gen).to(o.dtype)
    dlse = torch.randn(lse.shape, device=dev, generator=gen) if with_dlse else None
    poison_allocator(
        (q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype), (q.shape, torch.float32)
    )
    if with_dlse:
        torch.autograd.backward([o, lse.masked_fill(torch.isneginf(lse), 0)], [do, dlse])
    else:
        o.backward(do)
    dev_index = torch.cuda.current_device()  # the key ends in "sink" for a fused-sink forward's
    hits = [h for key, h in op.backward._kernels.items() if key[:2] == (dev_index, "hopper")]
    assert len(hits) == 1, "not the Hopper path"
    hit = hits[0]
    assert hit[0].dkdv.context["split_d"] == (spec.head_dim > 128), "not the layout under test"
    if spec.head_dim == 64:
        opts = gpu_options.CURRENT.hopper_bwd
        spills = spec.name in SPILL_AT_128 and not opts.diag_terms
        want = 64 if spills else opts.d64_block_m
        assert hit[0].dkdv.context["block_m"] == want, "not the head-dim-64 steps under test"
    assert hit[0].dkdv.threads == 384, "not the warp-specialized kernel"
    return q, k, v, do, dlse, params


def check(spec, b, hq, hkv, sq, sk, *, seed=0, qkv=None, with_dlse=False, params=None):
    q, k, v, do, dlse, params = run_case(
        spec, b, hq, hkv, sq, sk, seed=seed, qkv=qkv, with_dlse=with_dlse, params=params
    )
    if with_dlse:
        ref64, low = (
            _ref_with_lse(spec, q, k, v, do, dlse, params, dt) for dt in (torch.float64, q.dtype)
        )
    else:
        ref64 = ref_grads(spec, q, k, v, do, params, torch.float64)
        low = ref_grads(spec, q, k, v, do, params, q.dtype)
    for name, ours, r64, rlow in zip("qkv", (q.grad, k.grad, v.grad), ref64, low, strict=True):
        assert ours.shape == r64.shape
        assert not ours.isnan().any(), f"d{name} has NaN (an element never written?)"
        err = (ours.double() - r64).abs().max().item()
        bound = 2 * (rlow.double() - r64).abs().max().item() + 1e-3
        assert err <= bound, (
            f"{spec.name} d{name} B={b} H={hq}/{hkv} Sq={sq} Sk={sk}: {err:.3e} > {bound:.3e}"
        )


def _ref_with_lse(spec, q, k, v, do, dlse, params, dtype):
    from flashgen.ops.cpu.reference import attention_reference

    qr, kr, vr = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    o, lse = attention_reference(spec, qr, kr, vr, params=params, compute_dtype=dtype)
    lse = lse.masked_fill(torch.isneginf(lse), 0)
    torch.autograd.backward([o, lse], [do.to(dtype), dlse.to(dtype)])
    return qr.grad, kr.grad, vr.grad


SHIPPED = ["alibi", "t5_bias", "mistral_swa", "chunked_local", "prefix_lm", "llama3_gqa",
           "bidir_d256", "gemma2_softcap", "d256:alibi", "d256:mistral_swa", "d256:chunked_local",
           "d256:prefix_lm"]  # fmt: skip


def softcap_spec():
    text = "name: hopbwd_softcap\nhead_dim: 128\ndtype: bf16\nmask: causal\n"
    text += "score_mod: 'softcap * tanh(score / softcap)'\n"
    text += "params:\n  softcap: {type: f32, default: 20.0}\n"
    return loads_spec(text, "<hopbwd_softcap>")


#: Fixtures that build their tests' kernels with other options than the defaults.
OPTION_FIXTURES = {"block_m128", "block_m64", "queries_split", "bwd_exp2_poly", "tensor_masks",
                   "masked_80", "int_classifier", "ds_split_barrier",
                   "stagger_steps"}


@pytest.fixture(scope="module", autouse=True)
def prebuilt(request):
    """Compile every kernel this module runs with the default options up front, in parallel
    (one nvcc per core): each spec's forward and its Hopper backward unit.  Skipped when
    every selected test of the module takes an option fixture (their kernels differ)."""
    mine = [it for it in request.session.items if it.module is request.module]
    if all(OPTION_FIXTURES & set(it.fixturenames) for it in mine):
        return
    import os
    from concurrent.futures import ThreadPoolExecutor

    from plan_helpers import plan_hopper_backward

    from flashgen.build import cache
    from flashgen.build.render import render
    from flashgen.families.build import build_forward

    dims = (64, 128, 256)
    specs = [hb_spec(d, t, c) for d in dims for t in ("bf16", "fp16") for c in (True, False)]
    specs += [shipped(n) for n in SHIPPED] + [softcap_spec()]
    gpu = torch.cuda.get_device_name()

    def bwd(spec):
        plan = plan_hopper_backward(spec, "sm_90")
        cache.get_or_build(render(plan.unit), plan.unit)

    jobs = [lambda s=s: build_forward(s, "sm_90", gpu=gpu) for s in specs]
    jobs += [lambda s=s: bwd(s) for s in specs]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:
        list(pool.map(lambda job: job(), jobs))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_lengths_gqa_dtypes(d, dtype, causal):
    spec = hb_spec(d, dtype, causal)
    for i, (b, hq, hkv, sq, sk) in enumerate(SHAPES):
        check(spec, b, hq, hkv, sq, sk, seed=100 * d + i)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_masks_and_score_mods(name):
    """Residual masks (tile classifier hull, per-step classes) and score_mods (their
    derivative in dS) at their default params; random_inputs gives the tensor params."""
    spec = shipped(name)
    for i, (b, hq, hkv, sq, sk) in enumerate(SHAPES[1:6]):
        check(spec, b, hq, hkv, sq, sk, seed=300 + i)


MASK_PARAMS = [
    ("mistral_swa", "window", [1, 40, 1000]), ("chunked_local", "chunk", [1, 64, 100]),
    ("prefix_lm", "prefix", [0, 1, 777]), ("d256:mistral_swa", "window", [1, 40, 1000]),
    ("d256:chunked_local", "chunk", [1, 32, 100]), ("d256:prefix_lm", "prefix", [0, 1, 777]),
]  # fmt: skip


@pytest.mark.parametrize("name, param, values", MASK_PARAMS)
def test_mask_params_sparse_and_dense(name, param, values):
    """Params that make the hull, the EMPTY blocks inside it and the FULL/PARTIAL tile
    classes differ (a window of 1 keeps one key per row; a chunk of 32 is one warpgroup's
    query half of a d256 step)."""
    spec = shipped(name)
    for v in values:
        for i, (b, hq, hkv, sq, sk) in enumerate([(1, 4, 2, 1000, 1000), (1, 2, 1, 127, 1000),
                                                  (1, 2, 2, 1000, 127)]):  # fmt: skip
            check(spec, b, hq, hkv, sq, sk, seed=500 + i, params={param: v})


def test_softcap_d128():
    """A MUFU score_mod (tanh) with a non-trivial derivative at head_dim 128."""
    spec = softcap_spec()
    for i, (b, hq, hkv, sq, sk) in enumerate(SHAPES[1:6]):
        check(spec, b, hq, hkv, sq, sk, seed=400 + i)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_bshd_views_and_lse_gradient(d):
    """q, k, v as strided (B, S, H, D) views of one fused tensor, and a gradient on lse too
    (it folds into dsum before the dK/dV kernel)."""
    spec = hb_spec(d, "bf16", True)
    b, s, h = 2, 333, 4
    qkv = torch.randn(b, s, 3, h, d, device="cuda").to(torch.bfloat16)
    views = tuple(qkv[:, :, i].transpose(1, 2) for i in range(3))
    check(spec, b, h, h, s, s, seed=7, qkv=views, with_dlse=True)
    check(spec, 1, 4, 2, 300, 100, seed=8, with_dlse=True)  # causal rows with nothing to attend


@pytest.mark.parametrize("d", [128, 256])
def test_empty_rows_give_zero_dq(d):
    """Causal with Sq > Sk: the first Sq - Sk query rows attend to nothing: dq = 0 there."""
    spec = hb_spec(d, "bf16", True)
    q, *_ = run_case(spec, 1, 2, 2, 300, 100, seed=9)
    assert (q.grad[:, :, :200] == 0).all()
    assert not q.grad.isnan().any()


def repeated_backward(op, spec, shape, deterministic, *, seed, runs=5):
    """Five backwards of ``op`` on one random problem ``shape`` (B, Hq, Hkv, Sq, Sk): q, k, v,
    dO and the list of (dq, dk, dv) of each run."""
    b, hq, hkv, sq, sk = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, _ = random_inputs(spec, b, hq, hkv, sq, sk, torch.device("cuda"), gen)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    do = torch.randn(b, hq, sq, spec.head_dim_v, device="cuda", generator=gen).to(q.dtype)
    grads = []
    for _ in range(runs):
        q.grad = k.grad = v.grad = None
        op.attention(q, k, v, deterministic=deterministic)[0].backward(do)
        grads.append((q.grad.clone(), k.grad.clone(), v.grad.clone()))
    return q, k, v, do, grads


def ordered_backward(op, spec, shape, *, seed):
    """:func:`repeated_backward` with ``deterministic=True``, checked: dq, dk, dv bitwise equal
    over the runs, none NaN, each within the 2x rule of the float64 reference.  Returns the
    ordered unit's plan."""
    q, k, v, do, grads = repeated_backward(op, spec, shape, True, seed=seed)
    for g in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(g, grads[0], strict=True))
    ref64 = ref_grads(spec, q, k, v, do, {}, torch.float64)
    low = ref_grads(spec, q, k, v, do, {}, q.dtype)
    for name, ours, r64, rlow in zip("qkv", grads[0], ref64, low, strict=True):
        assert not ours.isnan().any(), name
        err = (ours.double() - r64).abs().max().item()
        assert err <= 2 * (rlow.double() - r64).abs().max().item() + 1e-3, (name, err)
    return op.backward._kernels[(torch.cuda.current_device(), "hopper_ordered")][0]


@pytest.mark.parametrize("d", [128, 256])
def test_dk_dv_reproducible_dq_close(d):
    """dk, dv bitwise equal run to run (one owner per element); dq within fp32 reordering."""
    spec = hb_spec(d, "bf16", True)
    *_, grads = repeated_backward(build_op(spec), spec, (1, 8, 2, 1000, 1000), False, seed=11)
    for g in grads[1:]:
        assert torch.equal(g[1], grads[0][1]) and torch.equal(g[2], grads[0][2])
        scale = grads[0][0].float().abs().max().item()
        torch.testing.assert_close(g[0].float(), grads[0][0].float(), atol=1e-2 * scale, rtol=0)


#: B, Hq, Hkv, Sq, Sk of the ordered tests: 2 x 2 x 65 key-block CTAs, more than one wave, so
#: CTAs wait on key blocks that are not resident yet
ORDERED_SHAPE = (2, 8, 2, 1000, 8193)


def more_ctas_than_sms(plan, shape) -> bool:
    b, _, hkv, _, sk = shape
    ctas = b * hkv * -(-sk // plan.dkdv.context["block_n"])
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return ctas > props.multi_processor_count


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("d, block_m", [(64, 64), (128, 64), (128, 80)])
def test_ordered_dq_is_bitwise_reproducible_and_accurate(d, block_m, causal):
    """``hopper_bwd.ordered_dq``: ``deterministic=True`` runs the Hopper kernel with dQ added in
    key-block order: dq, dk, dv bitwise equal over five runs (GQA, Sq != Sk, more key blocks
    than one wave of CTAs), each within the 2x rule of the float64 reference; head_dim 128
    with 64-query steps and, under ``hopper_bwd.ordered_80``, 80-query ones."""
    spec = hb_spec(d, "bf16", causal)
    opts = {"hopper_bwd.ordered_dq": True, "hopper_bwd.ordered_80": block_m == 80}
    op = gpu_options.build(spec, gpu_options.options(opts))
    plan = ordered_backward(op, spec, ORDERED_SHAPE, seed=13)
    assert more_ctas_than_sms(plan, ORDERED_SHAPE)
    if d == 128:
        assert plan.dkdv.context["block_m"] == block_m



@pytest.mark.parametrize(
    "shape", [(2, 8, 2, 1000, 4097), (1, 4, 4, 4097, 1000), (1, 2, 1, 1, 17)],
    ids=["sk_long", "sq_long", "one_row"],
)  # fmt: skip
@pytest.mark.parametrize("name", ["causal_bf16", "full_bf16", "causal_fp16", "gemma2_softcap"])
def test_ordered_d256_is_bitwise_reproducible_and_accurate(name, shape):
    """``hopper_bwd.ordered_d256``: ``deterministic=True`` at head_dim 256 runs the split
    layout's ordered form (each consumer warpgroup adds its dQ columns in key-block order):
    dq, dk, dv bitwise equal over five runs, each within the 2x rule of the float64
    reference; GQA, Sq != Sk both ways, one query row, a score_mod (gemma2's softcap)."""
    if name == "gemma2_softcap":
        spec = load_spec(REPO / "specs" / "gemma2_softcap.yaml")
    else:
        mask, dtype = name.split("_")
        spec = hb_spec(256, dtype, mask == "causal")
    assert spec.head_dim == 256
    op = gpu_options.build(spec, gpu_options.options({"hopper_bwd.ordered_d256": True}))
    plan = ordered_backward(op, spec, shape, seed=29)
    assert plan.dkdv.context["split_d"]


@pytest.mark.parametrize(
    "name, params, opts",
    [("mistral_swa", {"window": 40}, {}), ("mistral_swa", {"window": 1000}, {}),
     ("prefix_lm", {"prefix": 777}, {"hopper_bwd.ordered_80": True}),
     ("chunked_local", {"chunk": 100}, {"hopper_bwd.int_classifier": True}),
     ("document_mask", {}, {}), ("spec_tree", {}, {"hopper_bwd.ordered_80": True}),
     ("d64:mistral_swa", {"window": 100}, {}), ("d64:prefix_lm", {"prefix": 300}, {})],
)  # fmt: skip
def test_ordered_masks_are_bitwise_reproducible_and_accurate(name, params, opts):
    """``hopper_bwd.ordered_masks``: ``deterministic=True`` under a residual mask runs the
    ordered Hopper form, each CTA's writer adding after the earlier key blocks whose published
    hull holds the query block: dq, dk, dv bitwise equal over five runs, within the 2x rule of
    the float64 reference (GQA, Sq != Sk, more CTAs than one wave)."""
    spec = d64(name.removeprefix("d64:")) if name.startswith("d64:") else shipped(name)
    op = gpu_options.build(
        spec, gpu_options.options({"hopper_bwd.ordered_masks": True, **opts})
    )
    gen = torch.Generator(device="cuda").manual_seed(31)
    b, hq, hkv, sq, sk = ORDERED_SHAPE
    q, k, v, inputs = random_inputs(spec, b, hq, hkv, sq, sk, torch.device("cuda"), gen)
    inputs.update(params)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    do = torch.randn(b, hq, sq, spec.head_dim_v, device="cuda", generator=gen).to(q.dtype)
    grads = []
    for _ in range(5):
        q.grad = k.grad = v.grad = None
        op.attention(q, k, v, deterministic=True, **inputs)[0].backward(do)
        grads.append((q.grad.clone(), k.grad.clone(), v.grad.clone()))
    plan = op.backward._kernels[(torch.cuda.current_device(), "hopper_ordered")][0]
    assert plan.wgmma and plan.dkdv.context["ordered_hull"]
    assert more_ctas_than_sms(plan, ORDERED_SHAPE)
    for g in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(g, grads[0], strict=True))
    ref64 = ref_grads(spec, q, k, v, do, inputs, torch.float64)
    low = ref_grads(spec, q, k, v, do, inputs, q.dtype)
    for gname, ours, r64, rlow in zip("qkv", grads[0], ref64, low, strict=True):
        assert not ours.isnan().any(), gname
        err = (ours.double() - r64).abs().max().item()
        assert err <= 2 * (rlow.double() - r64).abs().max().item() + 1e-3, (gname, err)


#: Head-dim-64 forms of shipped specs (masks walked with the tile classifier, score_mods).
D64_SHIPPED = ["gpt2_d64", "alibi_learned", "gpt_oss_sink", "mistral_swa", "chunked_local",
               "prefix_lm", "gemma2_softcap"]  # fmt: skip


def d64(name: str):
    """A shipped spec at head_dim 64 (named NAME_d64 unless it is one already)."""
    text = (REPO / "specs" / f"{name}.yaml").read_text()
    if "head_dim: 64" in text:
        return load_spec(REPO / "specs" / f"{name}.yaml")
    lines = [
        "head_dim: 64" if ln.startswith("head_dim:") else f"name: {name}_d64"
        if ln.startswith("name:") else ln
        for ln in text.splitlines()
    ]  # fmt: skip
    return loads_spec("\n".join(lines) + "\n", f"<{name}_d64>")


@pytest.fixture
def block_m128(monkeypatch):
    """``hopper_bwd.d64_block_m=128``: head dim 64 with 128-query steps (dQ split by rows
    between the warpgroups; P^T in registers, dS^T computed from it as packed)."""
    return gpu_options.use(monkeypatch, {"hopper_bwd.d64_block_m": 128})


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_d64_block_m128_lengths_gqa_dtypes(block_m128, dtype, causal):
    spec = hb_spec(64, dtype, causal)
    for i, (b, hq, hkv, sq, sk) in enumerate(SHAPES):
        check(spec, b, hq, hkv, sq, sk, seed=900 + i)


@pytest.mark.parametrize("name", D64_SHIPPED)
def test_d64_block_m128_masks_and_score_mods(block_m128, name):
    """128-query steps: the 64 keep bits of a 64-key x 128-query tile, the hull of 128-row
    query blocks, score_mod derivatives and sinks (t5_bias, which spills with them, runs 64)."""
    spec = d64(name)
    for i, (b, hq, hkv, sq, sk) in enumerate(SHAPES[1:6]):
        check(spec, b, hq, hkv, sq, sk, seed=950 + i)


@pytest.mark.parametrize(
    "name, param, values",
    [("mistral_swa", "window", [1, 40, 1000]), ("chunked_local", "chunk", [1, 64, 100]),
     ("prefix_lm", "prefix", [0, 1, 777])],
)  # fmt: skip
def test_d64_block_m128_mask_params(block_m128, name, param, values):
    spec = d64(name)
    for v in values:
        for i, (b, hq, hkv, sq, sk) in enumerate([(1, 4, 2, 1000, 1000), (1, 2, 1, 127, 1000),
                                                  (1, 2, 2, 1000, 127)]):  # fmt: skip
            check(spec, b, hq, hkv, sq, sk, seed=970 + i, params={param: v})


def test_d64_block_m128_views_lse_gradient_empty_rows(block_m128):
    spec = hb_spec(64, "bf16", True)
    b, s, h = 2, 333, 4
    qkv = torch.randn(b, s, 3, h, 64, device="cuda").to(torch.bfloat16)
    views = tuple(qkv[:, :, i].transpose(1, 2) for i in range(3))
    check(spec, b, h, h, s, s, seed=17, qkv=views, with_dlse=True)
    q, *_ = run_case(spec, 1, 2, 2, 300, 100, seed=19)
    assert (q.grad[:, :, :200] == 0).all() and not q.grad.isnan().any()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_d64_block_m128_ordered_dq(causal):
    spec = hb_spec(64, "bf16", causal)
    opts = gpu_options.options({"hopper_bwd.ordered_dq": True, "hopper_bwd.d64_block_m": 128})
    op = gpu_options.build(spec, opts)
    plan = ordered_backward(op, spec, ORDERED_SHAPE, seed=23)
    assert plan.dkdv.context["block_m"] == 128


# ------------------------------- head dim 128 with 64-query steps on unmasked and causal specs
@pytest.fixture
def block_m64(monkeypatch):
    """``hopper_bwd.d128_block_m=64``: head dim 128's 64-query layout (the one masked specs
    take) on the specs that default to 80-query steps."""
    return gpu_options.use(monkeypatch, {"hopper_bwd.d128_block_m": 64})


def _unmasked_d128(name: str):
    """A shipped spec at head_dim 128 with its mask removed (softcap: score_mod with a
    derivative that is not 1, alibi: one that is)."""
    lines = [ln for ln in (REPO / "specs" / f"{name}.yaml").read_text().splitlines()
             if not ln.startswith("mask:")]  # fmt: skip
    lines = ["head_dim: 128" if ln.startswith("head_dim:") else f"name: {name}_d128_full"
             if ln.startswith("name:") else ln for ln in lines]  # fmt: skip
    return loads_spec("\n".join(lines) + "\n", f"<{name}_d128_full>")


@pytest.mark.parametrize("name", ["gemma2_softcap", "alibi"])
def test_d128_unmasked_score_mods(name):
    """The default 80-query layout on score_mods with and without a derivative of 1."""
    spec = _unmasked_d128(name)
    for i, (b, hq, hkv, sq, sk) in enumerate(SHAPES[1:6]):
        check(spec, b, hq, hkv, sq, sk, seed=1250 + i)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_d128_block_m64_lengths_gqa_dtypes(block_m64, dtype, causal):
    spec = hb_spec(128, dtype, causal)
    for i, (b, hq, hkv, sq, sk) in enumerate(SHAPES):
        check(spec, b, hq, hkv, sq, sk, seed=1200 + i)


@pytest.mark.parametrize("name", ["gemma2_softcap", "alibi"])
def test_d128_block_m64_score_mods(block_m64, name):
    spec = _unmasked_d128(name)
    for i, (b, hq, hkv, sq, sk) in enumerate(SHAPES[1:6]):
        check(spec, b, hq, hkv, sq, sk, seed=1260 + i)


# ------------------------- head dim 256 with S^T and dP^T split by queries (param-gradient layout)
@pytest.fixture
def queries_split(monkeypatch):
    """``hopper_bwd.d256_sdp_warpgroups=False``: each warpgroup computes S^T and dP^T on half
    the step's queries (the layout units with param gradients take)."""
    return gpu_options.use(monkeypatch, {"hopper_bwd.d256_sdp_warpgroups": False})


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_d256_queries_split_lengths_gqa_dtypes(queries_split, dtype, causal):
    spec = hb_spec(256, dtype, causal)
    for i, (b, hq, hkv, sq, sk) in enumerate(SHAPES):
        check(spec, b, hq, hkv, sq, sk, seed=1500 + i)


@pytest.mark.parametrize("name", ["bidir_d256", "gemma2_softcap", "d256:mistral_swa", "d256:alibi"])
def test_d256_queries_split_masks_and_score_mods(queries_split, name):
    spec = shipped(name)
    for i, (b, hq, hkv, sq, sk) in enumerate(SHAPES[1:6]):
        check(spec, b, hq, hkv, sq, sk, seed=1550 + i)


# ------------------------- part of P^T's exponentials on the FMA pipe (hopper_bwd.exp2_poly)
@pytest.fixture(params=[4, 16], ids=["poly4", "poly16"])
def bwd_exp2_poly(request, monkeypatch):
    """``hopper_bwd.exp2_poly``: 4 sixteenths of P^T's query tiles (the share the option is
    meant for) and all of them (every exponential of a step that is not an edge) by
    ``fg::exp2_poly``."""
    return gpu_options.use(monkeypatch, {"hopper_bwd.exp2_poly": request.param})


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_exp2_poly_lengths_gqa(bwd_exp2_poly, d, causal):
    """Each head dim's layout (64: 128-query steps; 128: 80; 256: the warpgroup split) with
    the polynomial, bf16 and every SHAPES length (edges keep the SFU, FULL steps take it)."""
    spec = hb_spec(d, "bf16", causal)
    for i, (b, hq, hkv, sq, sk) in enumerate(SHAPES):
        check(spec, b, hq, hkv, sq, sk, seed=1700 + i)


@pytest.mark.parametrize("name", ["alibi", "gemma2_softcap", "t5_bias", "mistral_swa"])
def test_exp2_poly_masks_and_score_mods(monkeypatch, name):
    """A score_mod with a derivative of 1 (alibi) and one without (softcap), a staged diagonal
    term (t5_bias at head_dim 64) and a window mask, with 4 sixteenths of P^T by the polynomial
    (with all of them mistral_swa's head-dim-128 unit spills and runs the FA2-class kernels)."""
    gpu_options.use(monkeypatch, {"hopper_bwd.exp2_poly": 4})
    spec = shipped(name)
    for i, (b, hq, hkv, sq, sk) in enumerate(SHAPES[1:6]):
        check(spec, b, hq, hkv, sq, sk, seed=1750 + i)


# ------------------------- masks that read tensors (hopper_bwd.tensor_masks: a block table)
@pytest.fixture
def tensor_masks(monkeypatch):
    """``hopper_bwd.tensor_masks``: document_mask's backward on the Hopper kernel, its tile
    classes from a block table built for the backward's tiles; 64-query steps at head_dim 128
    (80: the ``masked_80`` tests)."""
    return gpu_options.use(
        monkeypatch, {"hopper_bwd.tensor_masks": True, "hopper_bwd.masked_80": False}
    )


def _doc_mask(d: int):
    text = (REPO / "specs" / "document_mask.yaml").read_text()
    text = text.replace("head_dim: 128", f"head_dim: {d}")
    text = text.replace("name: document_mask", f"name: document_mask_d{d}")
    return loads_spec(text, f"<document_mask_d{d}>")


@pytest.mark.parametrize("d", [64, 128, 256])
def test_tensor_masks_document_mask_lengths_gqa(tensor_masks, d):
    """Packed documents (sorted ids in [0, 4): EMPTY, FULL and PARTIAL tiles) at every
    SHAPES length, with GQA and Sq != Sk: dQ, dK, dV against the float64 reference."""
    spec = _doc_mask(d)
    for i, (b, hq, hkv, sq, sk) in enumerate(SHAPES):
        check(spec, b, hq, hkv, sq, sk, seed=1800 + i)


def test_tensor_masks_lse_gradient(tensor_masks):
    spec = _doc_mask(128)
    check(spec, 2, 4, 2, 1000, 1000, seed=1850, with_dlse=True)


@pytest.mark.parametrize(
    "deterministic, opts", [(False, {}), (True, {"hopper_bwd.ordered_masks": True})],
    ids=["atomic_dq", "ordered_dq"],
)  # fmt: skip
@pytest.mark.parametrize("b, hq, hkv, sq, sk", [(2, 8, 2, 1000, 1000), (1, 4, 1, 4097, 4097),
                                                (1, 6, 2, 1000, 4097)])  # fmt: skip
def test_held_backward_table_gives_the_per_call_gradients(tensor_masks, monkeypatch,
                                                          deterministic, opts, b, hq, hkv, sq,
                                                          sk):  # fmt: skip
    """document_mask, GQA, lengths no tile divides: a BlockMask holds the table of the
    backward's own tiles, built by the pre-pass on the first backward given it and never
    again (three calls), equal to the reference's for those tiles; dK, dV are bitwise those
    of calls that run the pre-pass in every backward, and so is dQ where it is added in a
    fixed order (``hopper_bwd.ordered_masks`` with ``deterministic=True``); the atomic dQ's
    sums change order run to run, so there it is held to that run-to-run spread."""
    from flashgen.ops.prefill.attention import AttentionOp
    from flashgen.ops.prefill.backward import table_tiles
    from flashgen.ops.prefill.blockmask import block_table_reference, table_key

    spec = shipped("document_mask")
    op = gpu_options.build(spec, gpu_options.update(monkeypatch, opts))
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(2000 + sq + sk)
    q, k, v, params = random_inputs(spec, b, hq, hkv, sq, sk, dev, gen)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    do = torch.randn(b, hq, sq, spec.head_dim_v, device=dev, generator=gen).to(q.dtype)
    built = []
    real = AttentionOp._run_block_table

    def counted(self, device, tiles, dims, scalars, tensors):
        built.append((tiles.block_m, tiles.block_n))
        return real(self, device, tiles, dims, scalars, tensors)

    monkeypatch.setattr(AttentionOp, "_run_block_table", counted)

    def grads(**kw):
        q.grad = k.grad = v.grad = None
        op.attention(q, k, v, deterministic=deterministic, **params, **kw)[0].backward(do)
        return q.grad.clone(), k.grad.clone(), v.grad.clone()

    per_call = [grads(), grads()]
    path = "hopper_ordered" if deterministic else "hopper"
    plan = op.backward._kernels[(torch.cuda.current_device(), path)][0]
    tiles = table_tiles(plan)
    assert plan.wgmma and tiles is not None, "not the Hopper backward with a block table"
    bwd = (tiles.block_m, tiles.block_n)
    bm = op.block_mask(sq, sk, **params)
    built.clear()
    held = [grads(block_mask=bm) for _ in range(3)]
    torch.cuda.synchronize()
    assert built == ([] if bwd == (bm.block_m, bm.block_n) else [bwd]), built
    table = bm.tables[table_key(*bwd)][0]
    ref = block_table_reference(spec, tiles, batch=b, heads_q=hq, seqlen_q=sq, seqlen_k=sk,
                                params=params, device=dev)  # fmt: skip
    assert torch.equal(table, ref)
    base = per_call[0]
    for i, (dq, dk, dv) in enumerate(held):
        assert not any(t.isnan().any() for t in (dq, dk, dv)), i
        assert torch.equal(dk, base[1]) and torch.equal(dv, base[2]), f"call {i}: dk, dv"
        if deterministic:
            assert torch.equal(dq, base[0]), f"call {i}: dq"
        else:
            spread = (per_call[1][0].float() - base[0].float()).abs().max().item()
            err = (dq.float() - base[0].float()).abs().max().item()
            slack = 2**-7 * base[0].float().abs().max().item()
            assert err <= 2 * spread + slack, f"call {i}: dq {err:.3e} (spread {spread:.3e})"


def _draft_tree(b: int, sq: int, seed: int):
    """``ancestors`` of ``b`` random draft trees of ``sq`` tokens (token i's parent is a
    random earlier token): [b, sq, sq] int32, 1 where j is i or one of its ancestors."""
    gen = torch.Generator().manual_seed(seed)
    anc = torch.zeros(b, sq, sq, dtype=torch.int32)
    for r in range(b):
        for i in range(sq):
            anc[r, i, i] = 1
            if i:
                parent = int(torch.randint(0, i, (1,), generator=gen))
                anc[r, i] |= anc[r, parent]
    return anc.cuda()


@pytest.mark.parametrize("b,hq,hkv,sq,sk", [(2, 4, 2, 17, 1000), (1, 2, 1, 127, 4097),
                                            (1, 4, 4, 200, 200), (1, 2, 2, 1, 1)])  # fmt: skip
def test_two_sided_masks_spec_tree(tensor_masks, monkeypatch, b, hq, hkv, sq, sk):
    """spec_tree (a two-sided tensor read, ``ancestors[b, q_idx, f(kv_idx)]``) on the
    Hopper backward (``two_sided_masks``): its draft tree's edge steps read the table per
    element."""
    gpu_options.use(monkeypatch, {"hopper_bwd.tensor_masks": True, "hopper_bwd.masked_80": False,
                                  "hopper_bwd.two_sided_masks": True})  # fmt: skip
    spec = shipped("spec_tree")
    anc = _draft_tree(b, sq, seed=sq)
    check(spec, b, hq, hkv, sq, sk, seed=1870 + sq, params={"ancestors": anc})


# ------------------------- 80-query steps for masked specs at head_dim 128 (masked_80)
@pytest.fixture
def masked_80(monkeypatch):
    """``hopper_bwd.masked_80`` (with ``tensor_masks``): prefix_lm takes 80-query steps;
    chunked_local and document_mask spill with them and take 64 (the fallback runs)."""
    return gpu_options.use(
        monkeypatch, {"hopper_bwd.masked_80": True, "hopper_bwd.tensor_masks": True,
                      "hopper_bwd.two_sided_masks": True}
    )  # fmt: skip


@pytest.mark.parametrize("name", ["prefix_lm", "document_mask", "chunked_local"])
def test_masked_80_masks(masked_80, name):
    spec = shipped(name)
    for i, (b, hq, hkv, sq, sk) in enumerate(SHAPES):
        check(spec, b, hq, hkv, sq, sk, seed=1900 + i)


@pytest.mark.parametrize("b,hq,hkv,sq,sk", [(2, 4, 2, 17, 1000), (1, 2, 1, 127, 4097),
                                            (1, 4, 4, 200, 200)])  # fmt: skip
def test_masked_80_spec_tree(masked_80, b, hq, hkv, sq, sk):
    """spec_tree's 80-query steps (its block table at 80 x 128 tiles)."""
    check(shipped("spec_tree"), b, hq, hkv, sq, sk, seed=1950 + sq,
          params={"ancestors": _draft_tree(b, sq, seed=sq + 1)})  # fmt: skip


# ------------------------- the tile classifier on integer ranges (int_classifier)
@pytest.fixture
def int_classifier(monkeypatch):
    """``hopper_bwd.int_classifier`` with ``masked_80``: the masks that compute only int32
    numbers classify their steps on 64-bit integer ranges; chunked_local and mistral_swa then
    take 80-query steps at head_dim 128 (spill-free)."""
    return gpu_options.use(
        monkeypatch, {"hopper_bwd.int_classifier": True, "hopper_bwd.masked_80": True}
    )


@pytest.mark.parametrize("name", ["chunked_local", "mistral_swa", "prefix_lm", "d256:chunked_local",
                                  "d256:mistral_swa", "d256:prefix_lm", "alibi"])  # fmt: skip
def test_int_classifier_masks(int_classifier, name):
    spec = shipped(name)
    params = {"window": 300} if "mistral_swa" in name else None
    for i, (b, hq, hkv, sq, sk) in enumerate(SHAPES):
        check(spec, b, hq, hkv, sq, sk, seed=1980 + i, params=params)


@pytest.mark.parametrize("name, param, values", MASK_PARAMS)
def test_int_classifier_mask_params(int_classifier, name, param, values):
    test_mask_params_sparse_and_dense(name, param, values)



# ------------------------- the dS^T hand-off by arrive / wait (ds_split_barrier)
@pytest.fixture
def ds_split_barrier(monkeypatch):
    """``hopper_bwd.ds_split_barrier``: each consumer warpgroup signals its dS^T rows on its own
    barrier (by the step's parity), issues dK, then waits for the other's rows before dQ."""
    return gpu_options.use(monkeypatch, {"hopper_bwd.ds_split_barrier": True})


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
def test_ds_split_barrier_lengths_gqa_dtypes(ds_split_barrier, d, dtype, causal):
    """head_dim 128 (80-query steps, dQ^T by stmatrix) and 64 (128-query steps, dQ rows split
    between the warpgroups), every SHAPES length."""
    spec = hb_spec(d, dtype, causal)
    for i, (b, hq, hkv, sq, sk) in enumerate(SHAPES):
        check(spec, b, hq, hkv, sq, sk, seed=2100 + i)


@pytest.mark.parametrize("name", ["alibi", "mistral_swa", "prefix_lm", "document_mask",
                                  "gpt_oss_sink", "alibi_learned", "spec_tree"])  # fmt: skip
def test_ds_split_barrier_masks_and_score_mods(ds_split_barrier, name):
    """64-query steps under a window mask (mistral_swa), 80 under a residual mask (prefix_lm,
    document_mask's block table, spec_tree's two-sided read), a score_mod, a sink, head_dim 64."""
    spec = shipped(name)
    for i, (b, hq, hkv, sq, sk) in enumerate(SHAPES[1:6]):
        params = None
        if name == "spec_tree":
            params = {"ancestors": _draft_tree(b, sq, seed=sq + 3)}
        elif name == "mistral_swa":
            params = {"window": 300}
        check(spec, b, hq, hkv, sq, sk, seed=2150 + i, params=params)


@pytest.mark.parametrize("d", [64, 128])
def test_ds_split_barrier_ordered_dq_is_bitwise_reproducible(d):
    """``deterministic=True`` (the ordered form) with the hand-off: dq, dk, dv bitwise equal over
    five runs with more key blocks than one wave of CTAs."""
    spec = hb_spec(d, "bf16", True)
    op = gpu_options.build(spec, gpu_options.options({"hopper_bwd.ds_split_barrier": True}))
    plan = ordered_backward(op, spec, ORDERED_SHAPE, seed=2190)
    assert plan.dkdv.context["ds_split_barrier"]


# ------------------------- steps staggered by key block (stagger_steps)
@pytest.fixture
def stagger_steps(monkeypatch):
    """``hopper_bwd.stagger_steps``: each CTA walks its hull of query blocks from a position set
    by its key block, wrapping around."""
    return gpu_options.use(monkeypatch, {"hopper_bwd.stagger_steps": True})


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_stagger_steps_lengths_gqa(stagger_steps, d, causal):
    """Every head dim's layout, every SHAPES length (GQA groups walk one rotated hull per query
    head; Sq != Sk either way)."""
    spec = hb_spec(d, "bf16", causal)
    for i, (b, hq, hkv, sq, sk) in enumerate(SHAPES):
        check(spec, b, hq, hkv, sq, sk, seed=2200 + i)


@pytest.mark.parametrize("name", ["mistral_swa", "prefix_lm", "document_mask", "alibi",
                                  "gpt_oss_sink", "spec_tree"])  # fmt: skip
def test_stagger_steps_masks_and_score_mods(stagger_steps, name):
    """Hulls from the tile classifier (mistral_swa, prefix_lm) and from a block table
    (document_mask, spec_tree), a score_mod, a sink."""
    spec = shipped(name)
    for i, (b, hq, hkv, sq, sk) in enumerate(SHAPES[1:6]):
        params = None
        if name == "spec_tree":
            params = {"ancestors": _draft_tree(b, sq, seed=sq + 5)}
        elif name == "mistral_swa":
            params = {"window": 300}
        check(spec, b, hq, hkv, sq, sk, seed=2250 + i, params=params)


# ------------------------- ordered dQ from the last key block down (ordered_descending)
DESC = {"hopper_bwd.ordered_descending": True}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("d, opts", [(64, {}), (128, {"hopper_bwd.ordered_80": True}),
                                     (128, {"hopper_bwd.ordered_80": False}),
                                     (256, {"hopper_bwd.ordered_d256": True})])  # fmt: skip
def test_ordered_descending_is_bitwise_reproducible_and_accurate(d, opts, causal):
    """``hopper_bwd.ordered_descending``: each query block's adds from the last key block that
    sees it down, the CTAs launched last key block first; dq, dk, dv bitwise equal over five
    runs with more key blocks than one wave of CTAs (GQA, Sq != Sk), within the 2x rule."""
    spec = hb_spec(d, "bf16", causal)
    op = gpu_options.build(spec, gpu_options.options({**DESC, **opts}))
    plan = ordered_backward(op, spec, ORDERED_SHAPE, seed=2300 + d)
    assert plan.dkdv.context["ordered_desc"] and more_ctas_than_sms(plan, ORDERED_SHAPE)


@pytest.mark.parametrize(
    "name, params, opts",
    [("mistral_swa", {"window": 40}, {}),
     ("prefix_lm", {"prefix": 777}, {"hopper_bwd.ordered_80": True}),
     ("document_mask", {}, {}), ("spec_tree", {}, {"hopper_bwd.ordered_80": True}),
     ("d64:mistral_swa", {"window": 100}, {})],
)  # fmt: skip
def test_ordered_descending_masks_are_bitwise_reproducible_and_accurate(name, params, opts):
    """The hull form with descending turns: each writer counts the later key blocks whose
    published hull holds the query block."""
    test_ordered_masks_are_bitwise_reproducible_and_accurate(name, params, {**DESC, **opts})
