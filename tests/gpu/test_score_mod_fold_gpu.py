"""Score_mods at the edges of the lowering's rewrites, on the GPU against the float64
reference (``pytest -m gpu``):

* a float ``%`` of a quotient (``(kv_idx / 41.0) % 1.0``): the division must stay a
  division (``lower._exact_operands``); with ``x * (1 / 41.0f)`` the kernel added
  8 * 0.99999994 instead of 0 at kv_idx = 41, 82, ... (``(score / d) % 1.0`` is left to
  tests/unit/test_score_mod_host.py: on random inputs its jumps sit where fp32 and fp64
  scores straddle a multiple of d);
* the softmax_scale fold (``score / d``, ``c * score``) with a user softmax_scale;
* a score_mod whose Hopper (wgmma) backward spills in both dQ variants: on sm_90 the
  non-deterministic backward falls back to the FA2-class kernels
  (``select.build_backward``) and must still be right.

Forward: both kernel families (auto, fa2); backward: deterministic and not.  Bounds as in
test_forward.py / test_backward_kernels.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_options  # noqa: E402
from test_backward_kernels import check_grads  # noqa: E402
from test_forward import check  # noqa: E402

from flashgen.bench.verify import random_inputs  # noqa: E402
from flashgen.frontend.spec import loads_spec  # noqa: E402

pytestmark = pytest.mark.gpu

MODS = {
    "idx_mod": ("score + 8.0 * ((kv_idx / 41.0) % 1.0)", "{}"),
    "fold": ("c * tanh(score / c) - score / d", "{c: {type: f32, default: 7.0}, "
             "d: {type: f32, default: 3.0}}"),
}  # fmt: skip
#: Hopper backward spills in both dQ variants (255 registers, 44-60 bytes): FA2 fallback.
HEAVY = (
    "c * tanh(score / c) + exp(-abs(q_idx - kv_idx) / s) * sqrt(abs(score) + 1.0)"
    " - log(1.0 + abs(score / c)) * min(score, c)"
)
HEAVY_MASK = "causal && (q_idx / w) % 3 != kv_idx % 5 && abs(q_idx - kv_idx) * 1.5 < s"
HEAVY_PARAMS = (
    "{c: {type: f32, default: 30.0}, s: {type: f32, default: 512.0}, w: {type: i32, default: 16}}"
)
SHAPES = [(1, 2, 2, 200, 300), (1, 4, 2, 127, 1000), (2, 2, 1, 1000, 127)]


def mod_spec(key: str, d: int = 128):
    mod, params = MODS[key]
    return loads_spec(
        f"name: fold_{key}_d{d}\nhead_dim: {d}\ndtype: bf16\nmask: causal\n"
        f"score_mod: '{mod}'\nparams: {params}\n",
        f"<fold_{key}>",
    )


def heavy_spec():
    return loads_spec(
        f"name: fold_heavy\nhead_dim: 128\ndtype: bf16\nmask: '{HEAVY_MASK}'\n"
        f"score_mod: '{HEAVY}'\nparams: {HEAVY_PARAMS}\n",
        "<fold_heavy>",
    )


@pytest.fixture(params=["auto", "fa2"])
def family(request, monkeypatch):
    """Ops bound to ``Options(family=...)`` (:mod:`gpu_options`)."""
    gpu_options.use(monkeypatch, family=request.param)
    return request.param


@pytest.mark.parametrize("key", sorted(MODS))
@pytest.mark.parametrize("d", [64, 128])
def test_forward_matches_reference(key, d, family, error_bound):
    spec = mod_spec(key, d)
    for i, shape in enumerate(SHAPES):
        check(spec, *shape, error_bound, seed=10 + i)
    check_scale(spec, *SHAPES[1], softmax_scale=0.3, seed=20)


def check_scale(spec, b, hq, hkv, sq, sk, *, softmax_scale, seed):
    """The op with a user softmax_scale (the fold hoists softmax_scale / d from the
    kernel argument) against the reference at that scale."""
    from flashgen.ops.cpu.reference import attention_reference

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    q, k, v, params = random_inputs(spec, b, hq, hkv, sq, sk, dev, gen)
    o, _ = gpu_options.build(spec).attention(q, k, v, softmax_scale=softmax_scale, **params)
    ref, low = (
        attention_reference(
            spec, q, k, v, softmax_scale=softmax_scale, params=params, compute_dtype=dt
        )[0]
        for dt in (torch.float64, q.dtype)
    )
    err = (o.double() - ref).abs().max().item()
    bound = 2 * (low.double() - ref).abs().max().item() + 1e-3
    assert err <= bound, f"{spec.name} softmax_scale={softmax_scale}: {err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("key", sorted(MODS))
def test_backward_matches_reference(key, deterministic):
    spec = mod_spec(key)
    for i, shape in enumerate(SHAPES):
        check_grads(spec, *shape, seed=30 + i, deterministic=deterministic)


@pytest.mark.parametrize("deterministic", [True, False])
def test_heavy_score_mod_forward_and_backward(deterministic, error_bound):
    """The forward (Hopper kernel on sm_90) and the backward: on sm_90 with
    deterministic=False the "hopper" path, which built the FA2-class unit instead."""
    spec = heavy_spec()
    for i, shape in enumerate([*SHAPES[:2], (2, 2, 1, 700, 600)]):  # 1000 x 127: all masked
        check(spec, *shape, error_bound, seed=40 + i)
        op = check_grads(spec, *shape, seed=50 + i, deterministic=deterministic)
    if not deterministic and torch.cuda.get_device_capability() == (9, 0):
        # the "hopper" path ran; with nvcc 13.0 and today's template it built the FA2-class
        # unit (sm_80/bwd.cu.j2) because both wgmma variants spill
        assert (torch.cuda.current_device(), "hopper") in op.backward._kernels
