"""The launch-argument map (``op.kernel_values``) covers every argument of every kernel's
ABI, forward and backward (both paths), and the runtime can pack it (no GPU needed:
packing is numpy-only)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from plan_helpers import plan_backward, plan_forward  # noqa: E402

from flashgen.frontend.spec import load_spec  # noqa: E402
from flashgen.ops.op import kernel_values, validate  # noqa: E402
from flashgen.runtime.launch import kernel_args  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["alibi", "mistral_swa", "bidir_d256"])
def test_every_kernel_argument_has_a_value(name):
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 5, 7, spec.head_dim
    q = torch.randn(B, Sq, Hq, D, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, Hkv, Sk, D, dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, Sk, D, dtype=torch.bfloat16)
    tensors = {p.name: torch.rand(Hq) for p in spec.tensor_params}
    scalars = [p.default for p in spec.scalar_params]
    dims = validate(spec, q, k, v, tensors)
    o, lse = torch.empty_like(q), torch.empty(B, Hq, Sq)
    fwd = kernel_values(spec, {"q": q, "k": k, "v": v, "o": o, "lse": lse}, dims, 0.1,
                        scalars, tensors)  # fmt: skip
    packed = kernel_args(plan_forward(spec, "sm_80"), fwd)
    assert packed[len(packed) - len(spec.params) - 1] == pytest.approx(0.1)  # softmax_scale
    # The Hopper kernel appends CUtensorMap args, built at launch from the tensors plan.tma names.
    hopper = plan_forward(spec, "sm_90")
    maps = {a.name for a in hopper.args if a.ctype == "CUtensorMap"}
    assert maps == {m.name for m in hopper.tma} == {"tma_q", "tma_k", "tma_v"}
    assert all(m.tensor in fwd for m in hopper.tma)
    packed = kernel_args(hopper, {**fwd, **{m: bytes(128) for m in maps}})
    assert len(packed) == len(hopper.args) and packed[-1] == bytes(128)
    assert fwd["q_ss"] == q.stride(2) == Hq * D  # the (B, S, H, D) view's strides
    for atomic in (False, True):
        bwd = kernel_values(
            spec,
            {"q": q, "k": k, "v": v, "o": o, "dout": o, "lse": lse, "dsum": lse,
             "dq": q, "dk": k, "dv": v, "dq_accum": q.float() if atomic else None},
            dims, 0.1, scalars, tensors,
        )  # fmt: skip
        for kp in plan_backward(spec, "sm_90", atomic_dq=atomic).kernels:
            assert len(kernel_args(kp, bwd)) == len(kp.args)
