"""attn_implementation="flashgen" in real transformers models (tiny, randomly initialised
from configs, no downloads): logits, generation and gradients against "eager"."""

from __future__ import annotations

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashgen import OpInputError  # noqa: E402
from flashgen.integrations import transformers as fg_hf  # noqa: E402

SMALL = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
)  # fmt: skip


def _config(kind: str):
    if kind == "llama":
        return transformers.LlamaConfig(**SMALL)
    if kind == "mistral":
        return transformers.MistralConfig(**SMALL, sliding_window=5)
    if kind == "qwen2":
        return transformers.Qwen2Config(**SMALL)
    if kind == "gemma2":
        return transformers.Gemma2Config(
            **SMALL, sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=None,
            query_pre_attn_scalar=24,
        )  # fmt: skip
    raise ValueError(kind)


KINDS = ["llama", "mistral", "qwen2", "gemma2"]


@pytest.fixture(scope="module", autouse=True)
def _registered():
    fg_hf.register()


def _model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = _config(kind)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    return model


def _logits(model, impl, **inputs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_eager_with_and_without_padding(kind):
    model = _model(kind)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = _logits(model, "eager", input_ids=ids)
    out = _logits(model, "flashgen", input_ids=ids)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[1, :1] = 0
    ref = _logits(model, "eager", input_ids=ids, attention_mask=mask)
    out = _logits(model, "flashgen", input_ids=ids, attention_mask=mask)
    keep = mask.bool()
    torch.testing.assert_close(out[keep], ref[keep], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_packed_sequences_match_separate_runs(kind):
    model = _model(kind)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 96, (n,), generator=g) for n in (5, 9, 3)]
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    out = _logits(model, "flashgen", input_ids=ids, position_ids=pos)[0]
    start = 0
    for s in seqs:
        ref = _logits(model, "eager", input_ids=s[None])[0]
        torch.testing.assert_close(out[start : start + len(s)], ref, rtol=1e-4, atol=1e-4)
        start += len(s)


def test_generate_gives_the_same_tokens():
    model = _model("llama", seed=3)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    outs = {}
    for impl in ("eager", "flashgen"):
        model.set_attn_implementation(impl)
        outs[impl] = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
    assert torch.equal(outs["eager"], outs["flashgen"])


def test_generate_with_a_static_cache_gives_the_same_tokens():
    """A static cache hands the layer k / v of max_cache_len slots and a 2-D mask of the
    tokens seen so far (shorter): the keys are the mask's first slots.  Unpadding k / v with
    the shorter mask's indices attended to the wrong keys (other tokens, empty slots)."""
    model = _model("llama", seed=3)
    ids = torch.randint(0, 96, (3, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    for m in (torch.ones_like(ids), mask):
        outs = {}
        for impl in ("eager", "flashgen"):
            model.set_attn_implementation(impl)
            outs[impl] = model.generate(
                input_ids=ids, attention_mask=m, max_new_tokens=4, do_sample=False,
                pad_token_id=0, cache_implementation="static",
            )  # fmt: skip
        assert torch.equal(outs["eager"], outs["flashgen"])


def test_a_padding_mask_of_the_wrong_batch_or_too_short_is_refused():
    g = torch.Generator().manual_seed(8)
    q, k = torch.randn(2, 4, 6, 32, generator=g), torch.randn(2, 2, 6, 32, generator=g)
    mod = torch.nn.Module()
    mod.is_causal = True
    for bad in (torch.ones(3, 6, dtype=torch.bool), torch.ones(2, 5, dtype=torch.bool)):
        msg = (
            f"attention_mask: expected shape (batch 2, seqlen_k) with seqlen_k >= the "
            f"queries' 6, got {list(bad.shape)}"
        )
        with pytest.raises(OpInputError, match=re.escape(msg)):
            fg_hf.flashgen_attention_forward(mod, q, k, k, bad)


def test_training_step_gradients_match():
    grads = {}
    for impl in ("eager", "flashgen"):
        model = _model("gemma2", seed=5).train()
        model.set_attn_implementation(impl)
        ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(6))
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        labels = ids.clone()
        labels[0, :4] = -100  # pad rows' logits (predicting token 3 from row 2) are undefined
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["eager"].keys() == grads["flashgen"].keys() and grads["eager"]
    for n, g in grads["eager"].items():
        torch.testing.assert_close(grads["flashgen"][n], g, rtol=1e-3, atol=1e-5, msg=n)


def test_sinks_dropout_and_mask_errors():
    """s_aux (attention sinks): o * sigmoid(lse - sink) equals softmax over [scores, sink]."""
    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(2, 4, 6, 32, generator=g), torch.randn(2, 2, 6, 32, generator=g), \
        torch.randn(2, 2, 6, 32, generator=g)  # fmt: skip
    sink = torch.randn(4, generator=g)
    mod = torch.nn.Module()
    mod.is_causal = True
    out, _ = fg_hf.flashgen_attention_forward(mod, q, k, v, None, scaling=0.2, s_aux=sink)
    kk, vv = k.repeat_interleave(2, 1).double(), v.repeat_interleave(2, 1).double()
    s = (q.double() @ kk.transpose(-1, -2)) * 0.2
    s = s.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    s = torch.cat([s, sink.double().view(1, 4, 1, 1).expand(2, 4, 6, 1)], dim=-1)
    ref = (torch.softmax(s, -1)[..., :-1] @ vv).transpose(1, 2)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(OpInputError, match="dropout: flashgen has no attention dropout"):
        fg_hf.flashgen_attention_forward(mod, q, k, v, None, dropout=0.1)
    with pytest.raises(OpInputError, match="attention_mask: expected None or a 2-D"):
        fg_hf.flashgen_attention_forward(mod, q, k, v, torch.zeros(2, 1, 6, 6))


GPT_OSS_NAME = "flashgen"  # kept for gpt-oss, which lists its own flash kernels


def _gpt_oss(seed: int):
    torch.manual_seed(seed)
    cfg = transformers.GptOssConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4, max_position_embeddings=128,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # sinks that matter: some large, some negative
        for m in model.modules():
            if hasattr(m, "sinks"):
                m.sinks.copy_(torch.randn(m.sinks.shape) * 2)
    return model


def test_gpt_oss_training_step_with_the_specs_sink_matches_eager():
    """gpt-oss (sinks, a sliding-window and a full layer, GQA) from a config: one training
    step's loss and every gradient, the sinks' included, equal eager's; the flashgen path's
    attention is the spec's ``sink: sinks[h]``."""
    from flashgen.integrations._specs import _OPS

    losses, grads = {}, {}
    for impl in ("eager", "flashgen"):
        model = _gpt_oss(seed=3).train()
        model.set_attn_implementation(GPT_OSS_NAME if impl == "flashgen" else impl)
        ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(4))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses[impl] = loss.detach()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert any(k.sink for k in _OPS), "the flashgen path built no spec with a sink"
    torch.testing.assert_close(losses["flashgen"], losses["eager"], rtol=1e-5, atol=1e-6)
    sink_grads = [n for n in grads["eager"] if n.endswith("sinks")]
    assert sink_grads and all(grads["eager"][n].abs().max() > 0 for n in sink_grads)
    for n, g in grads["eager"].items():
        torch.testing.assert_close(grads["flashgen"][n], g, rtol=1e-3, atol=1e-5, msg=n)


def test_gpt_oss_generation_with_the_specs_sink_gives_the_same_tokens():
    model = _gpt_oss(seed=8).eval()
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(9))
    outs = {}
    for impl in ("eager", "flashgen"):
        model.set_attn_implementation(GPT_OSS_NAME if impl == "flashgen" else impl)
        with torch.no_grad():
            outs[impl] = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(outs["eager"], outs["flashgen"])
