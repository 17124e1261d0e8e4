"""Random well-typed specs on the GPU against the float64 reference (``pytest -m gpu``).

Tame expressions from ``tests/dsl_strategies.py``: score_mod stays finite and moderate,
masks keep at least a third of every row.  Each example compiles its own kernel (about a
second of nvcc), so the default is 10 examples; ``FLASHGEN_FUZZ_GPU=N`` runs N.
Also: stride-0 (expanded) k/v on the GPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hypothesis")

from dsl_strategies import specs  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import flashgen  # noqa: E402
from flashgen.bench.verify import error_bound, random_inputs  # noqa: E402
from flashgen.ops.op import build_op, poison_outputs  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning"),
]
REPO = Path(__file__).resolve().parents[2]


@settings(
    max_examples=int(os.environ.get("FLASHGEN_FUZZ_GPU", "10")),
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
@given(
    specs(wild=False, dtypes=("fp16", "bf16")),
    st.sampled_from([(2, 4, 2, 67, 131), (1, 2, 1, 200, 45), (3, 3, 3, 1, 129)]),
)
def test_random_specs_match_reference_on_gpu(text, shape):
    spec = flashgen.loads_spec(text, "fuzz.yaml")
    op = build_op(spec)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(len(text))
    b, hq, hkv, sq, sk = shape
    q, k, v, params = random_inputs(spec, b, hq, hkv, sq, sk, dev, gen)
    with poison_outputs():
        o, lse = op.attention(q, k, v, **params)
    torch.cuda.synchronize()
    assert not o.isnan().any() and not lse.isnan().any(), f"unwritten output\n{text}"
    ref_o, ref_lse, bound = error_bound(spec, q, k, v, params)
    assert torch.isfinite(ref_o).all()
    err = (o.double() - ref_o).abs().max().item()
    assert err <= bound, f"{err:.3e} > {bound:.3e} for\n{text}"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), f"empty rows differ\n{text}"
    fin = ~empty
    if fin.any():
        rel = ((lse[fin].double() - ref_lse[fin].double()).abs() / (1 + ref_lse[fin].abs())).max()
        assert rel.item() <= 1e-2, f"lse off by {rel.item():.3e}\n{text}"


@pytest.mark.parametrize("along", ["batch", "heads", "seq"])
@pytest.mark.parametrize("name", ["llama3_gqa", "alibi", "gpt2_d64"])
def test_stride0_expanded_kv_on_gpu(name, along):
    op = flashgen.load(REPO / "specs" / f"{name}.yaml")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(7)
    q, k, v, params = random_inputs(op.spec, 2, 4, 2, 97, 113, dev, gen)
    if along == "batch":
        ke, ve = k[:1].expand(2, -1, -1, -1), v[:1].expand(2, -1, -1, -1)
    elif along == "heads":
        ke, ve = k[:, :1].expand(-1, 2, -1, -1), v[:, :1].expand(-1, 2, -1, -1)
    else:
        ke, ve = k[:, :, :1].expand(-1, -1, 113, -1), v[:, :, :1].expand(-1, -1, 113, -1)
    assert 0 in ke.stride()
    with poison_outputs():
        o, lse = op.attention(q, ke, ve, **params)
        o2, lse2 = op.attention(q, ke.contiguous(), ve.contiguous(), **params)
    torch.cuda.synchronize()
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    ref_o, _, bound = error_bound(op.spec, q, ke.contiguous(), ve.contiguous(), params)
    assert (o.double() - ref_o).abs().max().item() <= bound
