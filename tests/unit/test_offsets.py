"""Global positions (flashgen.frontend.offsets, op.attention(q_offset=...)): a call on a slice
of the sequence equals the same slice of the whole attention, the host classifier skips
key blocks the mask excludes at the call's offsets, bad offsets raise OpInputError, and
the CPU backward evaluates masks at the right key positions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import flashgen
from flashgen.analysis.maskinfo import TileClass, classify
from flashgen.frontend.errors import OpInputError
from flashgen.frontend.offsets import OFFSET_PARAMS, is_offsets_spec, offsets_spec
from flashgen.frontend.spec import load_spec, loads_spec
from flashgen.ops.cpu.reference import attention_reference

SPECS = Path(__file__).resolve().parents[2] / "specs"
S = 160


def _op(name):
    return flashgen.load(SPECS / f"{name}.yaml")


def _params(name, h):
    return {
        "mistral_swa": {"window": 40},
        "chunked_local": {"chunk": 48},
        "prefix_lm": {"prefix": 20},
        "alibi": {"slopes": torch.linspace(0.1, 1.0, h)},
        "t5_bias": {"bias": torch.randn(h, 257, generator=torch.Generator().manual_seed(1))},
        "gemma2_softcap": {"softcap": 5.0},
    }.get(name, {})


@pytest.mark.parametrize(
    "name",
    ["causal_d128", "mistral_swa", "chunked_local", "prefix_lm", "alibi", "t5_bias",
     "gemma2_softcap", "document_mask"],
)  # fmt: skip
def test_slices_match_full_attention(name):
    """Every query slice against all keys, at its q_offset, equals the rows of the whole
    attention; slices of keys merged by LSE too (what a ring step does)."""
    op = _op(name)
    g = torch.Generator().manual_seed(0)
    d = op.spec.head_dim
    q, k, v = (torch.randn(1, 2, S, d, generator=g) for _ in range(3))
    params = _params(name, 2)
    if name == "document_mask":
        doc = (torch.arange(S) // 37).view(1, S).int()
        params = {"doc_q": doc, "doc_kv": doc}
    o, lse = op(q, k, v, **params)
    for a, b in ((0, 64), (64, 128), (100, 160)):
        p = dict(params)
        if name == "document_mask":
            p["doc_q"] = params["doc_q"][:, a:b]
        oa, la = op(q[:, :, a:b], k, v, q_offset=a, seqlen_q_global=S, **p)
        torch.testing.assert_close(oa, o[:, :, a:b], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(la, lse[:, :, a:b], atol=1e-5, rtol=1e-5)
        # the same rows from two key slices merged by their LSE
        parts = []
        for c0, c1 in ((0, 96), (96, S)):
            pk = dict(p)
            if name == "document_mask":
                pk["doc_kv"] = params["doc_kv"][:, c0:c1]
            parts.append(op(q[:, :, a:b], k[:, :, c0:c1], v[:, :, c0:c1], q_offset=a,
                            kv_offset=c0, seqlen_q_global=S, seqlen_k_global=S, **pk))  # fmt: skip
        mo, ml = flashgen.merge_attention(*parts[0], *parts[1])
        torch.testing.assert_close(mo, o[:, :, a:b], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ml, lse[:, :, a:b], atol=1e-5, rtol=1e-5)


def test_offsets_gradients_match_slicing():
    """dq, dk, dv of a query slice at its offset equal the slice's share of the whole
    attention's gradient (window > one CPU key block: the backward's key positions)."""
    op = _op("mistral_swa")
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 320, 128, generator=g) for _ in range(3))
    do = torch.randn(1, 2, 320, 128, generator=g)
    a, b = 192, 320
    qf, kf, vf = (t.clone().requires_grad_(True) for t in (q, k, v))
    o, _ = op(qf, kf, vf, window=50)
    (o[:, :, a:b] * do[:, :, a:b]).sum().backward()
    qs, ks, vs = (t.clone().requires_grad_(True) for t in (q[:, :, a:b], k, v))
    os_, _ = op(qs, ks, vs, q_offset=a, seqlen_q_global=320, window=50)
    (os_ * do[:, :, a:b]).sum().backward()
    torch.testing.assert_close(qs.grad, qf.grad[:, :, a:b], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ks.grad, kf.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(vs.grad, vf.grad, atol=1e-5, rtol=1e-5)
    # and the whole op's CPU backward against the float64 reference
    qd, kd, vd = (t.double().requires_grad_(True) for t in (q, k, v))
    ro, _ = attention_reference(op.spec, qd, kd, vd, params={"window": 50})
    (ro[:, :, a:b] * do[:, :, a:b].double()).sum().backward()
    torch.testing.assert_close(kf.grad, kd.grad.float(), atol=1e-4, rtol=1e-4)


def _show(e):
    from flashgen.frontend import ir

    if isinstance(e, ir.Var):
        return e.name
    if isinstance(e, ir.Const):
        return str(e.value)
    if isinstance(e, ir.Index):
        return f"{e.name}[{', '.join(_show(i) for i in e.indices)}]"
    if isinstance(e, ir.Binary):
        return f"({_show(e.lhs)} {e.op} {_show(e.rhs)})"
    if isinstance(e, ir.Call):
        return f"{e.fn}({', '.join(_show(a) for a in e.args)})"
    if isinstance(e, ir.Causal):
        return "causal"
    if isinstance(e, ir.Unary):
        return f"{e.op}{_show(e.arg)}"
    raise AssertionError(e)


def test_transform_text():
    doc = offsets_spec(load_spec(SPECS / "document_mask.yaml"))
    assert doc.name == "document_mask__offsets" and is_offsets_spec(doc)
    assert [p.name for p in doc.params][-4:] == list(OFFSET_PARAMS)
    assert _show(doc.mask) == (
        "(((((q_idx + q_offset) + seqlen_k_global) - seqlen_q_global) >= (kv_idx + kv_offset))"
        " && (doc_q[b, q_idx] == doc_kv[b, kv_idx]))"
    )
    t5 = offsets_spec(load_spec(SPECS / "t5_bias.yaml"))
    assert "(kv_idx + kv_offset) - (q_idx + q_offset)" in _show(t5.score_mod)
    assert offsets_spec(doc) is doc
    # untransformed spec untouched; a user param may not take the reserved names
    assert load_spec(SPECS / "document_mask.yaml").name == "document_mask"
    for name in OFFSET_PARAMS:
        with pytest.raises(flashgen.SpecError, match="reserved"):
            loads_spec(f"name: x\nhead_dim: 64\ndtype: bf16\nmask: causal\nparams:\n"
                       f"  {name}: {{type: i32, default: 0}}\n")  # fmt: skip


@pytest.mark.parametrize("name", ["causal_d128", "mistral_swa", "chunked_local"])
def test_host_classifier_skips_blocks_at_offsets(name):
    """The interval analysis of the rewritten mask, at a call's offsets: a key chunk wholly
    in the future (causal) or behind the window is EMPTY, the diagonal PARTIAL, a chunk
    wholly in the past FULL (causal)."""
    spec = offsets_spec(load_spec(SPECS / f"{name}.yaml"))
    extra = {"window": 100, "chunk": 1 << 20}

    def cls(q_off, kv_off, n=64):
        params = {p.name: extra.get(p.name, p.default) for p in spec.scalar_params}
        params.update(q_offset=q_off, kv_offset=kv_off, seqlen_q_global=4096,
                      seqlen_k_global=4096)  # fmt: skip
        return classify(spec, (0, n - 1), (0, n - 1), b=0, h=0, seqlen_q=n, seqlen_k=n,
                        params=params)  # fmt: skip

    assert cls(0, 64) == TileClass.EMPTY  # keys after every query
    assert cls(64, 64) == TileClass.PARTIAL  # the diagonal
    if name == "mistral_swa":
        assert cls(1024, 0) == TileClass.EMPTY  # far behind the window
        assert cls(128, 64) == TileClass.PARTIAL
    else:
        assert cls(1024, 0) == TileClass.FULL


def test_kernel_classifier_sees_offsets():
    """The CUDA tile classifier of the offsets form reads q_offset / kv_offset as runtime
    scalars (its host-compiled twin is compared with classify in test_masktiles)."""
    from flashgen.analysis.masktiles import classifier_params, classifier_source

    spec = offsets_spec(load_spec(SPECS / "causal_d128.yaml"))
    names = [n for _, n in classifier_params(spec)]
    assert names[-4:] == [f"p_{n}" for n in OFFSET_PARAMS]
    src = classifier_source(spec)
    assert "p_q_offset" in src and "p_kv_offset" in src and "p_seqlen_k_global" in src


BAD = [
    ({"q_offset": -1}, "q_offset: expected an int in"),
    ({"kv_offset": 1.5}, "kv_offset: expected a Python int"),
    ({"q_offset": 10, "seqlen_q_global": 40}, "seqlen_q_global: expected at least q_offset"),
    ({"kv_offset": 1, "seqlen_k_global": 32}, "seqlen_k_global: expected at least kv_offset"),
    ({"seqlen_q_global": True}, "seqlen_q_global: expected a Python int"),
]


@pytest.mark.parametrize("kw,match", BAD)
def test_bad_offsets_raise(kw, match):
    op = _op("causal_d128")
    q = torch.randn(1, 1, 32, 128)
    with pytest.raises(OpInputError, match=match):
        op(q, q, q, **kw)
