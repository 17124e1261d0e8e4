"""The head-grouped CTA order (``templates/common/tile_order.cuh``) on a GPU: with the L2
budget shrunk so that problems of this size split into several groups of unequal sizes, the
forward (Hopper, FA2-class, persistent with the dynamic scheduler) and the Hopper backward
must compute exactly what the head-major order computes (an op bound to the head groups off:
``hopper_fwd.head_groups``, ``fa2_fwd.head_groups``, ``hopper_bwd.head_groups`` False, which
the rest of ``pytest -m gpu`` checks against the float64 reference): the order moves whole
tiles between CTAs and changes no arithmetic, so o, lse, dK and dV are bitwise equal (dQ
accumulates with atomics in either order: compared to 1e-2 of its scale).  Outputs are
poisoned (NaN) before each launch, so a tile the order skips shows up.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_options  # noqa: E402
from test_hopper_bwd_gpu import poison_allocator  # noqa: E402

from flashgen.bench.verify import random_inputs  # noqa: E402
from flashgen.env import POISON_OUTPUTS as POISON_ENV  # noqa: E402
from flashgen.families import common as families_common  # noqa: E402
from flashgen.frontend.spec import loads_spec  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs an sm_90 GPU (the Hopper kernels; the FA2-class one runs there too)",
    ),
]

#: (B, Hq, Hkv, Sq, Sk, K/V heads of L2 budget): 10 heads in groups of 3, 3, 2, 2 (Sq != Sk
#: both ways); GQA 2:1, 12 heads in groups of 4 (two K/V heads' worth); a mask with a
#: window (uneven rows of another shape).
CASES = [
    ("causal", 2, 5, 5, 1000, 1000, 3),
    ("causal", 2, 5, 5, 127, 4097, 3),
    ("causal", 3, 4, 2, 1000, 127, 2),
    ("causal && q_idx - kv_idx < 300", 2, 5, 5, 1000, 1000, 3),
]
#: kernel -> its options (the dense tiles at these short lengths too, so op.kernel(dev) is
#: the kernel that ran: sparse_tiles off)
KERNELS = {"hopper": {}, "fa2": {"family": "fa2"}, "dynamic": {"persistent": "dynamic"}}


def _spec(mask: str, tag: str):
    name = f"order_{tag}"
    return loads_spec(f"name: {name}\nhead_dim: 128\ndtype: bf16\nmask: {mask}\n", f"<{name}>")


def _ops(monkeypatch, mask, tag, budget, **fields):
    """Two ops of the same spec under the options ``fields``: head groups of ``budget``
    bytes, and head-major (every kernel's head groups off)."""
    monkeypatch.setattr(families_common, "HEAD_GROUP_L2_BYTES", budget)
    spec = _spec(mask, tag)
    on, off = (gpu_options.options(gpu_options.head_groups(g), **fields) for g in (True, False))
    grouped = gpu_options.build(dataclasses.replace(spec, name=f"{spec.name}_grouped"), on)
    plain = gpu_options.build(dataclasses.replace(spec, name=f"{spec.name}_plain"), off)
    return spec, grouped, plain


def _spills_with_groups(op, dev) -> bool:
    """Whether ``op``'s forward kernel, rendered with its head groups (every other feature
    as built), spills on ``dev``'s target."""
    from flashgen.build import cache
    from flashgen.build.render import render
    from flashgen.families import registry

    plan = op.kernel(dev).plan
    with_groups = registry.plan_forward(op.spec, plan.target, op.options, tiles=plan.tiles)
    assert with_groups.context["tile_group"].startswith("fg::head_group(")
    _, report = cache.get_or_build(render(with_groups), with_groups)
    return plan.context["tile_group"] == "1" and bool(report.spill_bytes)


def _run(monkeypatch, op, groups: bool, fn):
    assert op.options.hopper_fwd.head_groups is groups
    return fn(op)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[1:])))
def test_forward_matches_head_major(monkeypatch, kernel, case):
    mask, b, hq, hkv, sq, sk, kv_heads = case
    monkeypatch.setenv(POISON_ENV, "1")
    tag = f"f{kernel}{CASES.index(case)}"  # one spec name per mask and kernel
    spec, grouped, plain = _ops(
        monkeypatch, mask, tag, kv_heads * sk * 512, sparse_tiles=False, **KERNELS[kernel]
    )
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(sq + sk)
    q, k, v, params = random_inputs(spec, b, hq, hkv, sq, sk, dev, gen)
    o1, lse1 = _run(monkeypatch, grouped, True, lambda op: op.attention(q, k, v, **params))
    o0, lse0 = _run(monkeypatch, plain, False, lambda op: op.attention(q, k, v, **params))
    group = grouped.kernel(dev).plan.context["tile_group"]
    # the build drops the groups only from a kernel that spills with them (the FA2-class
    # forward on sm_90 can: ptxas's allocation, not the mask, decides which)
    assert group.startswith("fg::head_group(") or _spills_with_groups(grouped, dev), group
    assert plain.kernel(dev).plan.context["tile_group"] == "1"
    assert not o1.isnan().any() and not lse1.isnan().any(), "a tile was never computed"
    assert torch.equal(o1, o0) and torch.equal(lse1, lse0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[1:])))
def test_hopper_backward_matches_head_major(monkeypatch, case):
    mask, b, hq, hkv, sq, sk, kv_heads = case
    budget = kv_heads * sq * 512 * (hq // hkv)
    spec, grouped, plain = _ops(monkeypatch, mask, f"bwd{CASES.index(case)}", budget)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(sq * sk)
    q, k, v, params = random_inputs(spec, b, hq, hkv, sq, sk, dev, gen)
    do = torch.randn(b, hq, sq, 128, device=dev, generator=gen).to(q.dtype)

    def grads(op):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        o, _ = op.attention(qq, kk, vv, deterministic=False, **params)
        poison_allocator(
            (q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype), (q.shape, torch.float32)
        )
        o.backward(do)
        plan = op.backward._kernels[(torch.cuda.current_device(), "hopper")][0]
        return plan.dkdv.context["bwd_tile_group"], qq.grad, kk.grad, vv.grad

    g1, dq1, dk1, dv1 = _run(monkeypatch, grouped, True, grads)
    g0, dq0, dk0, dv0 = _run(monkeypatch, plain, False, grads)
    assert g1.startswith("fg::head_group(") and g0 == "1"
    for t in (dq1, dk1, dv1):
        assert not t.isnan().any(), "a gradient element was never written"
    assert torch.equal(dk1, dk0) and torch.equal(dv1, dv0)
    scale = dq0.float().abs().max().item()
    assert (dq1.float() - dq0.float()).abs().max().item() <= 1e-2 * scale + 1e-3
