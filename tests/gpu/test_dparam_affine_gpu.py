"""``hopper_bwd.dparam_affine`` on the GPU: trainable ALiBi slopes (and the test specs whose
every trainable term is per CTA with d score_mod / d param affine in the pair's indices) summed
in the Hopper backward's dS^T pass, on the detached unit's steps (alibi: 80-query steps at
head_dim 128), against the float64 reference by the rule of
tests/gpu/test_param_grads_sinks_gpu.py (its ``_kernel_vs_reference``: dq, dk, dv within 2e-2
of the largest reference element, each param's gradient within 2x PyTorch's bf16 math + 1e-3,
never tighter than 2e-2 of its largest element; o and lse both carry a gradient).  GQA 8 / 2,
lengths 1 to 4097, Sq != Sk either way.  The CPU side: tests/unit/test_dparam_affine.py.

    python3 -m pytest tests/gpu/test_dparam_affine_gpu.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from dparam_affine_cases import affine_spec  # noqa: E402
from test_param_grads_sinks_gpu import _kernel_vs_reference, _params, _qkv  # noqa: E402

import flashgen  # noqa: E402
from flashgen.families.registry import grad_params  # noqa: E402
from flashgen.ops.op import build_op  # noqa: E402
from flashgen.options import Options  # noqa: E402

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
AFFINE = Options().replace_path("hopper_bwd.dparam_affine", True)
#: (Sq, Sk): a single row, odd lengths, several blocks either way, equal lengths, 4097
LENGTHS = [(1, 17), (17, 1), (1, 4097), (127, 1000), (1000, 127), (1000, 1000),
           (4097, 1000), (1000, 4097), (4097, 4097)]  # fmt: skip


def _ran_affine(op, spec, block_m=None):
    """The unit the op's last deterministic=False backward loaded is the Hopper kernel with the
    affine form (at ``block_m``-query steps where given)."""
    key = (torch.cuda.current_device(), "hopper", grad_params(spec))
    plan = op.backward._kernels[key][0]
    assert plan.wgmma and plan.dkdv.context.dparam_affine, spec.name
    if block_m is not None:
        assert plan.dkdv.context.block_m == block_m


@pytest.mark.parametrize("sq,sk", LENGTHS)
def test_alibi_slopes_with_the_affine_form_match_the_float64_reference(sq, sk):
    """alibi (causal, head_dim 128) with trainable slopes, the option on: the Hopper unit at
    the detached unit's 80-query steps; dslopes, dq, dk, dv against float64.  Batch 1 at 4097
    (the float64 reference's [B, H, Sq, Sk] tensors)."""
    op = flashgen.load(REPO / "specs" / "alibi.yaml", options=AFFINE)
    b = 1 if max(sq, sk) > 2000 else 2
    _kernel_vs_reference(op, op.spec, b, 8, 2, sq, sk, False)
    _ran_affine(op, op.spec, 80)


@pytest.mark.parametrize("sq,sk", [(1, 17), (127, 1000), (1000, 127), (1000, 1000)])
@pytest.mark.parametrize("form,head_dim", [("slope_head", 64), ("slope_head", 256),
                                           ("slope_batch_head", 128), ("slope_scaled_bias", 128),
                                           ("slope_window", 128)])  # fmt: skip
def test_affine_test_specs_match_the_float64_reference(form, head_dim, sq, sk):
    """The test specs of tests/unit/test_dparam_affine.py: a per-head slope at head_dim 64
    (128-query steps) and 256 (the query-split layout), a (batch, head) slope with a float
    coefficient and no mask, a slope times a trainable scalar plus a (batch, head) bias (three
    terms, one flushed at the CTA's end), a slope under a sliding window."""
    spec = affine_spec(form, head_dim)
    op = build_op(spec, options=AFFINE)
    _kernel_vs_reference(op, spec, 2, 8, 2, sq, sk, False)
    _ran_affine(op, spec)


def test_affine_gradients_agree_with_the_per_pair_form():
    """The same call with the option on and off: dslopes within 1e-2 of the largest element
    (the affine form sums the dS^T of the 80-query steps, from P^T as packed for dV, rounded
    to bf16: about 1e-3 apart on random inputs; the per-pair form fp32 P at 64-query steps),
    dq, dk, dv within 2e-2 (bf16 outputs of two accumulation orders)."""
    spec = flashgen.load(REPO / "specs" / "alibi.yaml").spec
    q, k, v = _qkv(2, 8, 2, 1000, 1000, 128, seed=11)
    params = _params(spec, 2, 8, 2, 1000, 1000, 12)
    got = []
    for options in (Options(), AFFINE):
        for t in (q, k, v, *params.values()):
            t.grad = None
        op = flashgen.load(REPO / "specs" / "alibi.yaml", options=options)
        o, _ = op.attention(q, k, v, **params)
        o.float().sum().backward()
        got.append([t.grad.clone() for t in (q, k, v, params["slopes"])])
    for a, b in zip(*got, strict=True):
        scale = a.abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * scale
    ds_off, ds_on = got[0][3], got[1][3]
    assert (ds_off - ds_on).abs().max().item() <= 1e-2 * ds_off.abs().max().item()


def test_deterministic_calls_with_the_option_stay_bitwise_reproducible():
    """deterministic=True never takes the Hopper kernel with param gradients (the FA2-class
    kernels' per-CTA rows): with the option on, 3 backwards bitwise equal."""
    op = flashgen.load(REPO / "specs" / "alibi.yaml", options=AFFINE)
    q, k, v = _qkv(2, 8, 2, 300, 777, 128, seed=5)
    params = _params(op.spec, 2, 8, 2, 300, 777, 6)
    runs = []
    for _ in range(3):
        for t in (q, k, v, *params.values()):
            t.grad = None
        o, _ = op.attention(q, k, v, deterministic=True, **params)
        o.float().sum().backward()
        runs.append(params["slopes"].grad.clone())
    assert all(torch.equal(runs[0], r) for r in runs[1:]) and runs[0].abs().max() > 0
