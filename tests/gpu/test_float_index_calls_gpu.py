"""``hopper_fwd.float_index_calls`` on the GPU (a compute capability 9.x GPU: ``pytest -m gpu
tests/gpu/test_float_index_calls_gpu.py``): alibi_learned's ``slopes[h] * abs(q_idx - kv_idx)``
computed on the index variables' float twins (``fabsf(q_idx_f - kv_idx_f)``, exact for indices
under 2^24) against the float64 reference under tests/gpu/test_forward.py's bound (lengths 1,
17, 127, 1000, 4097, Sq != Sk, GQA), and bit for bit equal to the same call with the option
off (each score's distance is the same float either way)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import gpu_options  # noqa: E402
from test_diag_terms_gpu import forward_outputs_with_and_without  # noqa: E402
from test_forward import check, shipped  # noqa: E402

pytestmark = pytest.mark.gpu

ON = {"hopper_fwd.float_index_calls": True}
LENGTHS = [(1, 1), (17, 17), (127, 127), (1000, 1000), (4097, 4097), (17, 1000), (1000, 17)]


@pytest.fixture(autouse=True)
def _needs_hopper():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("hopper_fwd.float_index_calls is the Hopper (sm_90) forward's option")


@pytest.mark.parametrize("sq, sk", LENGTHS)
def test_against_the_float64_reference(sq, sk, monkeypatch, error_bound):
    gpu_options.use(monkeypatch, ON)
    check(shipped("alibi_learned"), 2, 4, 2, sq, sk, error_bound, seed=sq + 5 * sk)


@pytest.mark.parametrize("sq, sk", [(1000, 1000), (4097, 4097), (127, 4097), (4097, 17)])
def test_bitwise_equal_to_the_option_off(sq, sk):
    spec = shipped("alibi_learned")
    (o1, lse1), (o0, lse0) = forward_outputs_with_and_without(spec, ON, sq, sk)
    assert torch.equal(o1, o0) and torch.equal(lse1, lse0)
