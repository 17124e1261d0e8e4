"""``hopper_fwd.diag_terms`` on the GPU (needs a compute capability 9.x GPU: ``pytest -m gpu
tests/gpu/test_diag_terms_gpu.py``): the Hopper forward with the score_mod's diagonal terms
staged per warp and FULL tile (``flashgen.analysis.rowcol.split_diagonal``) for t5_bias (a
relative table) and a log-distance bias (``slopes[h] * log(1.0 + abs(q_idx - kv_idx))``: the
log staged, the product left to the element code's FFMA): against the float64
reference under tests/gpu/test_forward.py's bound (lengths 1, 17, 127, 1000, 4097, Sq != Sk,
GQA, a (B, S, H, D) view), and bit for bit equal to the same call with the option off (o and
lse: each element's logit is the same float either way)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import gpu_options  # noqa: E402
from test_forward import check, shipped  # noqa: E402

from flashgen.bench.verify import random_inputs  # noqa: E402
from flashgen.frontend.spec import loads_spec  # noqa: E402

pytestmark = pytest.mark.gpu

LENGTHS = [(1, 1), (17, 17), (127, 127), (1000, 1000), (4097, 4097), (17, 1000), (1000, 17),
           (127, 4097)]  # fmt: skip
ON = {"hopper_fwd.diag_terms": True}
NAMES = ["t5_bias", "logdist"]
LOGDIST = (
    "name: logdist\nhead_dim: 64\ndtype: bf16\n"
    "score_mod: 'score - slopes[h] * log(1.0 + abs(q_idx - kv_idx))'\n"
    "params:\n  slopes: {type: f32, shape: [num_heads]}\n"
)


def spec_of(name: str):
    return loads_spec(LOGDIST, "<logdist>") if name == "logdist" else shipped(name)


@pytest.fixture(autouse=True)
def _needs_hopper():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("hopper_fwd.diag_terms is the Hopper (sm_90) forward's option")


@pytest.mark.parametrize("sq, sk", LENGTHS)
@pytest.mark.parametrize("name", NAMES)
def test_against_the_float64_reference(name, sq, sk, monkeypatch, error_bound):
    gpu_options.use(monkeypatch, ON)
    check(spec_of(name), 2, 4, 2, sq, sk, error_bound, seed=sq + 7 * sk)


@pytest.mark.parametrize("persistent", ["static", "dynamic"])
@pytest.mark.parametrize("name", NAMES)
def test_the_persistent_forward(name, persistent, monkeypatch, error_bound):
    """stage_diag reads the tile's m0, b, h from tile_info there."""
    gpu_options.use(monkeypatch, ON, persistent=persistent)
    for i, (sq, sk) in enumerate([(1000, 1000), (4097, 127), (127, 4097)]):
        check(spec_of(name), 2, 4, 2, sq, sk, error_bound, seed=70 + i)


@pytest.mark.parametrize("name", NAMES)
def test_a_bshd_view(name, monkeypatch, error_bound):
    gpu_options.use(monkeypatch, ON)
    check(spec_of(name), 1, 4, 4, 1000, 1301, error_bound, bshd=True, seed=3)


def forward_outputs_with_and_without(spec, values: dict, sq: int, sk: int) -> tuple:
    """``((o, lse) with the options ``values``, (o, lse) with each of them negated)`` of one
    forward on the same random inputs (B=2, 8 query heads over 2 KV heads); ``values`` are
    booleans."""
    on = gpu_options.build(spec, gpu_options.options(values))
    off = gpu_options.build(spec, gpu_options.options({k: not v for k, v in values.items()}))
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(sq * 3 + sk)
    q, k, v, params = random_inputs(spec, 2, 8, 2, sq, sk, dev, gen)
    outs = on.attention(q, k, v, **params), off.attention(q, k, v, **params)
    torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("sq, sk", [(1000, 1000), (4097, 4097), (127, 4097), (4097, 17)])
@pytest.mark.parametrize("name", NAMES)
def test_bitwise_equal_to_the_option_off(name, sq, sk):
    (o1, lse1), (o0, lse0) = forward_outputs_with_and_without(spec_of(name), ON, sq, sk)
    assert torch.equal(o1, o0) and torch.equal(lse1, lse0)


# ----------------------------------------------------------------------------- the backward
BWD_SHAPES = [(1, 2, 2, 1, 1), (2, 4, 2, 17, 1000), (1, 4, 1, 127, 17), (1, 6, 2, 1000, 4097),
              (1, 2, 2, 4097, 1000)]  # fmt: skip
BWD_ON = {"hopper_fwd.diag_terms": True, "hopper_bwd.diag_terms": True}


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("name", NAMES)
def test_backward_against_the_float64_reference(name, block_m, monkeypatch):
    """dq, dk, dv of the Hopper backward with the staged diagonals (t5_bias now builds its
    128-query steps: tests/gpu/test_hopper_bwd_gpu.py's run_case asserts the steps)."""
    from test_hopper_bwd_gpu import check as check_bwd

    gpu_options.use(monkeypatch, {**BWD_ON, "hopper_bwd.d64_block_m": block_m})
    for i, (b, hq, hkv, sq, sk) in enumerate(BWD_SHAPES):
        check_bwd(spec_of(name), b, hq, hkv, sq, sk, seed=40 + i)


@pytest.mark.parametrize("name", NAMES)
def test_backward_dk_dv_bitwise_equal_to_the_option_off_at_the_same_steps(name):
    """dk, dv have one owner per element (fixed order): with 64-query steps on both sides,
    the staged form gives the same bits; dq (atomics) within the reference bound's slack."""
    spec = spec_of(name)
    dev = torch.device("cuda")
    grads = []
    for values in ({**BWD_ON, "hopper_bwd.d64_block_m": 64}, {"hopper_bwd.d64_block_m": 64}):
        op = gpu_options.build(spec, gpu_options.options(values))
        gen = torch.Generator(device=dev).manual_seed(11)
        q, k, v, params = random_inputs(spec, 1, 4, 2, 1000, 1301, dev, gen)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        o, _ = op.attention(q, k, v, deterministic=False, **params)
        o.backward(torch.randn(o.shape, device=dev, generator=gen).to(o.dtype))
        grads.append((q.grad, k.grad, v.grad))
    (dq1, dk1, dv1), (dq0, dk0, dv0) = grads
    assert torch.equal(dk1, dk0) and torch.equal(dv1, dv0)
    assert (dq1.float() - dq0.float()).abs().max().item() <= 1e-2 * dq0.float().abs().max().item()
