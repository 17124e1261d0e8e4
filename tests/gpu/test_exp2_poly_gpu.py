"""``hopper_fwd.exp2_poly`` on the GPU (issue 41; needs a compute capability 9.x GPU:
``pytest -m gpu tests/gpu/test_exp2_poly_gpu.py``): the Hopper forward with sixteenths of the
softmax's P computed by the FMA-pipe polynomial (``fg::exp2_poly``, relative error 8.8e-5)
against the float64 reference, o and lse, under the bounds of the neighbouring tests: bf16
as tests/gpu/test_forward.py (max |o - ref64| <= 2x the input dtype's own reference error +
1e-3, lse 1e-2 relative, empty rows -inf and 0), fp8 as tests/gpu/test_fp8_gpu.py (issue
24's rule on the dequantized inputs).  Head dims 64, 128, 256, causal and not, lengths 1, 17,
127, 1000, 4097 (Sq == Sk and Sq != Sk), 3/16 (a mixed split) and 16/16 (every P on the FMA
pipe, the SFU keeping the rescale alone)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import gpu_options  # noqa: E402
from test_forward import check as check_bf16  # noqa: E402
from test_forward import shipped, variant  # noqa: E402
from test_fp8_gpu import as_fp8  # noqa: E402
from test_fp8_gpu import check as check_fp8  # noqa: E402

pytestmark = pytest.mark.gpu

BASES = {64: "gpt2_d64", 128: "causal_d128", 256: "bidir_d256"}
LENGTHS = [(1, 1), (17, 17), (127, 127), (1000, 1000), (4097, 4097), (17, 1000), (1000, 17),
           (127, 4097)]  # fmt: skip


@pytest.fixture(autouse=True)
def _needs_hopper():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("hopper_fwd.exp2_poly is the Hopper (sm_90) forward's option")


@pytest.mark.parametrize("sixteenths", [3, 16])
@pytest.mark.parametrize("sq, sk", LENGTHS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_bf16(d, causal, sq, sk, sixteenths, monkeypatch, error_bound):
    gpu_options.use(monkeypatch, {"hopper_fwd.exp2_poly": sixteenths})
    spec = variant(shipped(BASES[d]), dtype="bf16", causal=causal)
    check_bf16(spec, 1, 4, 2, sq, sk, error_bound, seed=sq + 3 * sk + d)


@pytest.mark.parametrize("sixteenths", [3, 16])
@pytest.mark.parametrize("sq, sk", LENGTHS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8(d, causal, sq, sk, sixteenths):
    from flashgen.options import Options

    opts = Options().replace_path("hopper_fwd.exp2_poly", sixteenths)
    spec = as_fp8(shipped(BASES[d]), causal=causal)
    check_fp8(spec, 1, 4, 2, sq, sk, seed=sq + 5 * sk + d, options=opts)


@pytest.mark.parametrize("sixteenths", [3, 8])
def test_shipped_specs_with_masks_and_score_mods(sixteenths, monkeypatch, error_bound):
    """The score_mod softmax (the second call site) and masked tiles: gemma2_softcap,
    mistral_swa, alibi, and llama3_fp8 with GQA."""
    gpu_options.use(monkeypatch, {"hopper_fwd.exp2_poly": sixteenths})
    for name in ("gemma2_softcap", "mistral_swa", "alibi"):
        spec = shipped(name)
        extra = {"window": 37} if spec.param("window") is not None else {}
        for i, (sq, sk) in enumerate([(127, 127), (17, 1000), (1000, 17), (1, 1)]):
            check_bf16(spec, 2, 4, 2, sq, sk, error_bound, seed=50 + i, **extra)
    from flashgen.options import Options

    opts = Options().replace_path("hopper_fwd.exp2_poly", sixteenths)
    check_fp8(shipped("llama3_fp8"), 2, 8, 2, 1000, 1000, seed=7, options=opts)
