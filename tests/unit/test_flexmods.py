"""flashgen IR -> FlexAttention score_mod/mask_mod (flashgen/bench/flexmods.py), on CPU."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from flashgen.bench.flexmods import flex_mods, mask_uses_batch_or_head
from flashgen.bench.verify import random_tensor_params
from flashgen.frontend.spec import load_spec, loads_spec
from flashgen.ops.cpu.reference import attention_reference, eval_expr

#: the shipped specs with a prefill (v_from_k specs are decode only: tests/unit/test_decode_mla.py)
SPECS = [
    p for p in sorted((Path(__file__).resolve().parents[2] / "specs").glob("*.yaml"))
    if not load_spec(p).v_from_k
]  # fmt: skip

TRICKY = """
name: tricky
head_dim: 64
dtype: bf16
mask: "!(q_idx % 3 == 1) || (kv_idx / 4 - q_idx / 4 > -2 && abs(q_idx - kv_idx) < w)"
score_mod: >-
  h % 2 == 0 ? max(score, -1.5) * slopes[h]
  : min(score, 0.5) + tanh(score / cap) * (kv_idx - q_idx) / 8.0
params:
  w: {type: i32, default: 5}
  cap: {type: f32, default: 20.0}
  slopes: {type: f32, shape: [num_heads]}
"""


def _grid(B, H, Sq, Sk):
    ar = lambda n: torch.arange(n, dtype=torch.int64)  # noqa: E731
    return (
        ar(B).view(B, 1, 1, 1),
        ar(H).view(1, H, 1, 1),
        ar(Sq).view(1, 1, Sq, 1),
        ar(Sk).view(1, 1, 1, Sk),
    )


@pytest.mark.parametrize("sq,sk", [(23, 23), (11, 29), (29, 11)])
def test_tricky_expressions_match_the_reference_evaluator(sq, sk):
    spec = loads_spec(TRICKY)
    B, H = 2, 4
    slopes = torch.rand(H)
    score_mod, mask_mod = flex_mods(spec, sq, sk, {"slopes": slopes})
    b, h, qi, ki = _grid(B, H, sq, sk)
    score = torch.randn(B, H, sq, sk)
    env = {
        "b": b,
        "h": h,
        "q_idx": qi,
        "kv_idx": ki,
        "seqlen_q": torch.tensor(sq),
        "seqlen_k": torch.tensor(sk),
        "w": torch.tensor(5),
        "cap": torch.tensor(20.0),
        "slopes": slopes,
        "score": score,
        "__float__": torch.float32,
        "__device__": torch.device("cpu"),
    }
    want_mask = eval_expr(spec.mask, env).expand(B, H, sq, sk)
    got_mask = mask_mod(b, h, qi, ki).expand(B, H, sq, sk)
    assert torch.equal(got_mask, want_mask)
    want = eval_expr(spec.score_mod, env).expand(B, H, sq, sk)
    got = score_mod(score, b, h, qi, ki).expand(B, H, sq, sk)
    torch.testing.assert_close(got, want)
    assert mask_uses_batch_or_head(spec) is False


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_shipped_specs_match_reference_through_eager_flex(path):
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    spec = load_spec(path)
    B, H, Sq, Sk, D = 1, 2, 33, 47, spec.head_dim
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, s, D, generator=g) for s in (Sq, Sk, Sk))
    sym = {"batch": B, "num_heads": H, "num_heads_kv": H, "seqlen_q": Sq, "seqlen_k": Sk}
    params = random_tensor_params(spec, sym, "cpu", g)
    if spec.param("window") is not None:
        params["window"] = 9
    score_mod, mask_mod = flex_mods(spec, Sq, Sk, params)
    block_mask = flex.create_block_mask(mask_mod, B, H, Sq, Sk, device="cpu") if mask_mod else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o, lse = flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                     return_lse=True)  # fmt: skip
    if spec.sink is not None:  # no mod: joined to Flex's output (flex_mods' docstring)
        from flashgen.ops.sink import apply_sink, sink_logits

        sink = sink_logits(spec, params, batch=B, heads_q=H, heads_kv=H, device="cpu")
        o = apply_sink(o, lse, sink.unsqueeze(-1))
    ref, _ = attention_reference(spec, q, k, v, params=params, compute_dtype=torch.float32)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)


def test_missing_tensor_param_is_an_error():
    with pytest.raises(ValueError, match="slopes"):
        flex_mods(loads_spec(TRICKY), 4, 4, {})


def test_flex_peer_joins_the_sink(monkeypatch):
    """``flashgen bench``'s FlexAttention peer (:func:`flashgen.bench.peers.make_forward`)
    computes what flashgen's op does for a spec with a sink: the sink joined to o from Flex's
    lse (eager flex_attention here; on CPU it has no backward)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    from flashgen.bench import peers, protocol

    monkeypatch.setattr(peers, "_FLEX", flex.flex_attention)  # no torch.compile on CPU
    spec = load_spec(Path(__file__).resolve().parents[2] / "specs" / "gpt_oss_sink.yaml")
    B, H, S, D = 1, 2, 40, spec.head_dim
    params = protocol.spec_params(spec, H, B, S, S, "cpu")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o = peers.make_forward("flex", spec, S, S, params, "cpu")(q, k, v)
    ref, _ = attention_reference(spec, q, k, v, params=params, compute_dtype=torch.float32)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)
