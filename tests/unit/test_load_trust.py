"""Issue 22, items 11 and 14: registration is all or nothing, and ``flashgen.load`` of an
edited spec file in the same process gives an op with the new semantics while the old op
object refuses to run (it does not silently alias the new registration)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen import loads_spec  # noqa: E402
from flashgen.ops import op as opmod  # noqa: E402
from flashgen.ops.cpu.reference import attention_reference  # noqa: E402

SPEC = "name: {name}\nhead_dim: 64\ndtype: bf16\nmask: '{mask}'\n"


def _qkv():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(1, 2, 16, 64, generator=g).to(torch.bfloat16) for _ in range(3)]


def test_load_of_an_edited_spec_reloads_it(tmp_path):
    path = tmp_path / "reload_probe.yaml"
    path.write_text(SPEC.format(name="reload_probe", mask="q_idx >= kv_idx"))
    old = flashgen.load(path)
    q, k, v = _qkv()
    o_old, _ = old.attention(q, k, v)
    path.write_text(SPEC.format(name="reload_probe", mask="kv_idx <= 2"))
    new = flashgen.load(path)
    assert new is not old and new.spec.mask != old.spec.mask
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    o_new, _ = new.attention(qr, kr, vr)
    want, _ = attention_reference(new.spec, q, k, v, compute_dtype=torch.float64)
    assert (o_new.double() - want).abs().max() < 2e-2
    assert (o_new.double() - o_old.double()).abs().max() > 0.1
    o_new.float().sum().backward()  # the new backward is the registered one
    assert torch.isfinite(kr.grad).all()
    o_disp, _ = torch.ops.flashgen.reload_probe(q, k, v, 0.125)
    assert torch.equal(o_disp, o_new.detach())
    with pytest.raises(RuntimeError, match="reloaded the edited spec"):
        old.attention(q, k, v)
    assert flashgen.load(path) is new


def test_failed_registration_leaves_nothing_behind(monkeypatch):
    from flashgen.ops.prefill.backward import Backward

    spec = loads_spec(SPEC.format(name="partial_probe", mask="q_idx >= kv_idx"))

    def boom(self, lib):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(Backward, "register", boom)
    with pytest.raises(RuntimeError, match="injected"):
        opmod.build_op(spec)
    monkeypatch.undo()
    assert "partial_probe" not in opmod._REGISTRY
    op = opmod.build_op(spec)  # a clean second attempt: nothing half-defined is in the way
    q, k, v = _qkv()
    assert torch.isfinite(op.attention(q, k, v)[0]).all()


def test_the_most_params_the_checker_allows_register():
    from flashgen.frontend.check import MAX_PARAMS

    params = "".join(f"  p{i}: {{type: f32, default: 1.0}}\n" for i in range(MAX_PARAMS))
    spec = loads_spec(
        "name: many_params_probe\nhead_dim: 64\ndtype: bf16\nscore_mod: score * p0\n"
        "params:\n" + params
    )
    op = opmod.build_op(spec)
    q, k, v = _qkv()
    assert torch.isfinite(op.attention(q, k, v, p0=0.5)[0]).all()
    assert op.varlen is not None  # the widest schema (varlen backward) registered too


def test_a_reload_replaces_the_ops_under_every_options(tmp_path):
    """An op bound to non-default options registers its own operator: reloading the edited
    file (under any options) replaces those too, and ops of unchanged options stay."""
    path = tmp_path / "reload_opts.yaml"
    path.write_text(SPEC.format(name="reload_opts", mask="q_idx >= kv_idx"))
    fa2 = flashgen.Options(family="fa2")
    old, old_fa2 = flashgen.load(path), flashgen.load(path, options=fa2)
    assert old_fa2.name != old.name and old_fa2.base_name == old.name
    assert flashgen.load(path, options=fa2) is old_fa2 and flashgen.load(path) is old
    path.write_text(SPEC.format(name="reload_opts", mask="kv_idx <= 2"))
    new_fa2 = flashgen.load(path, options=fa2)
    q, k, v = _qkv()
    for stale in (old, old_fa2):
        with pytest.raises(RuntimeError, match="reloaded the edited spec"):
            stale.attention(q, k, v)
        with pytest.raises(RuntimeError, match="reloaded the edited spec"):
            stale.with_options(flashgen.Options())
    assert new_fa2.name == old_fa2.name and new_fa2.spec.mask != old_fa2.spec.mask
    new = flashgen.load(path)  # the default op of the edited file, registered afresh
    assert new.spec.mask == new_fa2.spec.mask and new.with_options(fa2) is new_fa2
    o, _ = new_fa2.attention(q, k, v)
    assert torch.equal(o, new.attention(q, k, v)[0])


def test_every_entry_point_of_a_replaced_op_raises(tmp_path):
    """Issue 38, item 2: after a reload of the edited spec, the old op's ``attention``
    raised, but ``with_kvcache`` and ``plan_decode`` ran the new spec's registered decode
    ops (a causal spec edited to ``mask: null``: the old op returned the new op's unmasked
    result).  Every entry point now raises the same error."""
    path = tmp_path / "reload_decode.yaml"
    path.write_text(SPEC.format(name="reload_decode", mask="q_idx >= kv_idx"))
    old = flashgen.load(path)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 4, 64, generator=g).to(torch.bfloat16)
    kc, vc = (torch.randn(1, 2, 8, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    lens = torch.tensor([8], dtype=torch.int32)
    plan = old.plan_decode(batch=1, num_heads=2, num_heads_kv=2, seqlen_q=4, cache_capacity=8,
                           device="cpu")  # fmt: skip
    o_old, _ = old.with_kvcache(q, kc, vc, lens)
    path.write_text("name: reload_decode\nhead_dim: 64\ndtype: bf16\n")  # mask: null
    new = flashgen.load(path)
    o_new, _ = new.with_kvcache(q, kc, vc, lens)
    assert (o_new.float() - o_old.float()).abs().max() > 0.01  # the edit changes the answer
    calls = {
        "with_kvcache": lambda: old.with_kvcache(q, kc, vc, lens),
        "with_kvcache(plan=)": lambda: old.with_kvcache(q, kc, vc, lens, plan=plan),
        "plan_decode": lambda: old.plan_decode(batch=1, num_heads=2, num_heads_kv=2,
                                               cache_capacity=8, device="cpu"),
        "attention": lambda: old.attention(q, kc, vc),
        "varlen": lambda: old.varlen,
        "offsets": lambda: old.offsets,
        "family_for": lambda: old.family_for((9, 0)),
        "with_options": lambda: old.with_options(opmod.Options(family="fa2")),
        "torch_op": lambda: old.torch_op,
        "block_mask": lambda: old.block_mask(4, 8, device="cpu"),
        "kernel": lambda: old.kernel(torch.device("cpu")),
    }
    for what, call in calls.items():
        with pytest.raises(RuntimeError, match="reloaded the edited spec"):
            call()
            pytest.fail(f"{what} ran on a replaced op")


def test_the_backward_of_a_replaced_ops_result_raises(tmp_path):
    """A result the old op computed before the reload still has its autograd node, whose
    backward looked the backward operator up by name: the new spec's.  A causal forward
    edited to ``mask: null`` got the unmasked spec's gradients (off by up to 65 here),
    silently.  That backward now raises the replaced op's error, padded and varlen."""
    path = tmp_path / "reload_grad.yaml"
    path.write_text(SPEC.format(name="reload_grad", mask="q_idx >= kv_idx"))
    old = flashgen.load(path)
    q, k, v = (t.requires_grad_() for t in _qkv())
    o, _ = old.attention(q, k, v)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    ov, _ = old.varlen.attention(*(t[0].transpose(0, 1) for t in (q, k, v)), cu, cu, 16, 16)
    path.write_text("name: reload_grad\nhead_dim: 64\ndtype: bf16\n")  # mask: null
    flashgen.load(path)
    for what, result in (("padded", o), ("varlen", ov)):
        with pytest.raises(RuntimeError, match="reloaded the edited spec"):
            result.float().sum().backward()
            pytest.fail(f"the {what} backward of a replaced op ran")
    assert q.grad is None and k.grad is None
