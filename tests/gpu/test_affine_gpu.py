"""The affine score_mod decomposition (flashgen/analysis/affine.py) on the GPU: score_mods ``score +
L`` with L affine in q_idx, kv_idx, whose FULL tiles compute ``x' = score + beta * (kv_idx -
n0)`` and add ``L(q_idx, n0)`` to the row max and the exp2 addend, against the fp64
reference with the 2x rule (tests/gpu/test_forward.py's ``check``), on the default kernel
(the Hopper one on an H200), the persistent Hopper kernel and the FA2-class kernel.

    python3 -m pytest tests/gpu/test_affine_gpu.py -q
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

from flashgen.analysis import affine  # noqa: E402
from flashgen.frontend.spec import load_spec, loads_spec  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]

LINEAR_CAUSAL = """\
name: affine_linear_causal
head_dim: 128
dtype: bf16
mask: causal
score_mod: score + 0.125 * (kv_idx - q_idx)
"""
SLOPE_PARAM = """\
name: affine_slope_param
head_dim: 64
dtype: fp16
score_mod: score - w[h] * (q_idx - kv_idx) + p
params:
  w: {type: f32, shape: [num_heads]}
  p: {type: f32, default: 0.25}
"""
SPECS = {
    "alibi": lambda: load_spec(REPO / "specs" / "alibi.yaml"),
    "linear_causal": lambda: loads_spec(LINEAR_CAUSAL, "affine_linear_causal.yaml"),
    "slope_param": lambda: loads_spec(SLOPE_PARAM, "affine_slope_param.yaml"),
}
LENGTHS = [(1, 1), (17, 4097), (127, 127), (1000, 17), (1000, 4097), (4097, 1000), (4097, 4097)]


@pytest.fixture(params=["auto", "persistent", "fa2"])
def kernel(request, monkeypatch):
    """The default kernel (Hopper on an H200), the persistent Hopper kernel, the FA2 one (ops
    bound to those options, :mod:`gpu_options`)."""
    gpu_options.use(
        monkeypatch,
        family="fa2" if request.param == "fa2" else "auto",
        persistent="static" if request.param == "persistent" else "off",
    )
    return request.param


def _slopes(h: int) -> torch.Tensor:
    """ALiBi's own slopes for h heads (2^(-8i/h)): the weight spreads over many key tiles."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device="cuda")


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("sq, sk", LENGTHS)
def test_affine_score_mods(name, sq, sk, kernel, error_bound):
    """GQA 8/2, Sq != Sk, odd lengths; random tensor params (uniform [0, 1)) and, for the
    slope ones, small slopes that leave weight on FULL tiles far from the diagonal."""
    spec = SPECS[name]()
    assert affine.decompose(spec.score_mod, spec) is not None
    check(spec, 2, 8, 2, sq, sk, error_bound, seed=sq + sk)
    if name == "alibi":
        check(spec, 1, 8, 2, sq, sk, error_bound, seed=sq, slopes=_slopes(8))
    if name == "slope_param":
        w = torch.linspace(-0.02, 0.02, 8, device="cuda")
        check(spec, 1, 8, 2, sq, sk, error_bound, seed=sk, w=w, p=-1.5)


def test_alibi_bshd_views_and_backward(error_bound):
    """(B, S, H, D) views through the default kernel, and the backward (which reads the
    forward's lse) against the reference gradients."""
    spec = SPECS["alibi"]()
    check(spec, 2, 8, 2, 1000, 1337, error_bound, bshd=True, seed=3, slopes=_slopes(8))
    check_grads(spec, 1, 8, 2, 700, 1000, seed=5, deterministic=True)
