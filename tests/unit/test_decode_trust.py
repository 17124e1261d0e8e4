"""Issue 38 (trust, round 3), the serving API on CPU (:mod:`flashgen.ops.decode`): plans
carry their op's identity and their checks are tight (item 12), aliased caches and slot
collisions are refused before anything is written (item 3), ``with_kvcache`` never looks
differentiable (item 4), a failed call writes nothing (item 5), and ragged ``k_new`` shape
errors name the caller's shapes (the "Also:" list)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import flashgen
from flashgen.frontend.errors import OpInputError

ROOT = Path(__file__).resolve().parents[2]
SPEC = "name: {name}\nhead_dim: {d}\ndtype: bf16\nmask: causal\n"


def _load(tmp_path, name, d=64, text=None):
    path = tmp_path / f"{name}.yaml"
    path.write_text(text or SPEC.format(name=name, d=d))
    return flashgen.load(path)


def _paged(batch=2, hkv=2, d=64, page_size=4, num_pages=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(num_pages, page_size, hkv, d, generator=g).to(torch.bfloat16)
    vc = torch.randn(num_pages, page_size, hkv, d, generator=g).to(torch.bfloat16)
    return kc, vc


# ----------------------------------------------------------------------------- item 12
def test_plan_decode_refuses_bad_page_counts_and_unknown_devices(tmp_path):
    op = _load(tmp_path, "trust_plan_checks")
    base = dict(batch=1, num_heads=2, num_heads_kv=2, cache_capacity=16, device="cpu")
    for num_pages in (0, -3, 2.0, True):
        with pytest.raises(OpInputError, match="num_pages"):
            op.plan_decode(**base, page_size=4, num_pages=num_pages)
    for device in ("xla", "mps", "meta"):
        with pytest.raises(OpInputError, match="device: expected 'cpu' or a CUDA device"):
            op.plan_decode(**{**base, "device": device})
    with pytest.raises(OpInputError, match="device"):
        op.plan_decode(**{**base, "device": "no-such-device"})
    assert op.plan_decode(**base, page_size=4, num_pages=1).dims.num_pages == 1


def test_a_plan_of_another_op_is_refused(tmp_path):
    """A plan made by another op (here another head_dim) was accepted by ``with_kvcache``;
    plans carry their op and other ops refuse them."""
    a = _load(tmp_path, "trust_plan_a", d=64)
    b = _load(tmp_path, "trust_plan_b", d=128)
    c = _load(tmp_path, "trust_plan_c", d=64)  # the same shapes, another op
    plan_b = b.plan_decode(batch=1, num_heads=2, num_heads_kv=2, cache_capacity=8, device="cpu")
    plan_c = c.plan_decode(batch=1, num_heads=2, num_heads_kv=2, cache_capacity=8, device="cpu")
    q = torch.randn(1, 2, 1, 64).to(torch.bfloat16)
    kc = torch.randn(1, 2, 8, 64).to(torch.bfloat16)
    lens = torch.tensor([5], dtype=torch.int32)
    for plan, other in ((plan_b, "trust_plan_b"), (plan_c, "trust_plan_c")):
        with pytest.raises(OpInputError, match=f"plan: expected a plan from this op's.*{other}"):
            a.with_kvcache(q, kc, kc.clone(), lens, plan=plan)
    mine = a.plan_decode(batch=1, num_heads=2, num_heads_kv=2, cache_capacity=8, device="cpu")
    o, _ = a.with_kvcache(q, kc, kc.clone(), lens, plan=mine)
    assert torch.equal(o, a.with_kvcache(q, kc, kc.clone(), lens)[0])
