"""Issue 38 (trust, round 3), the integrations on CPU: a gpt-oss model (attention sinks)
keeps ``attn_implementation="flashgen"`` under transformers 5.17 instead of being rerouted
to a hub kernel (item 9); one softcap rule in every integration (item 10); the SDPA hook
falls back to torch's kernel for any call it cannot serve (item 11)."""

from __future__ import annotations

import math

import pytest
import torch

from flashgen import OpInputError
from flashgen.flash_attn import flash_attn_func
from flashgen.integrations import sdpa as fg_sdpa

transformers = pytest.importorskip("transformers")

from flashgen.integrations import transformers as fg_hf  # noqa: E402


def _rnd(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ----------------------------------------------------------------------------- item 9
def _gpt_oss():
    cfg = transformers.GptOssConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        num_local_experts=2, num_experts_per_tok=1, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return cfg, transformers.AutoModelForCausalLM.from_config(cfg).eval()


def test_gpt_oss_keeps_the_flashgen_implementation_offline(monkeypatch):
    """transformers 5.17 took every name containing "flash" for a FlashAttention build and,
    for a model listing ``_compatible_flash_implementations`` (gpt-oss: sinks), replaced it
    by ``kernels-community/vllm-flash-attn3``, a hub download (fails offline).  The model
    now keeps "flashgen", fetches nothing, and matches eager (sinks, sliding window)."""
    import transformers.integrations.hub_kernels as hub

    def no_network(*args, **kwargs):
        raise AssertionError(f"a hub kernel was asked for: {args}")

    monkeypatch.setattr(hub, "load_and_register_attn_kernel", no_network)
    fg_hf.register()
    ran = []  # flashgen's attention function picks its op here: it ran, not another
    monkeypatch.setattr(fg_hf, "op_for", lambda key, _op_for=fg_hf.op_for: ran.append(key)
                        or _op_for(key))  # fmt: skip
    cfg, model = _gpt_oss()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        want = [model(input_ids=ids).logits, model(input_ids=ids, attention_mask=mask).logits]
    model.set_attn_implementation("flashgen")
    assert model.config._attn_implementation == "flashgen"
    assert not ran
    with torch.no_grad():
        got = [model(input_ids=ids).logits, model(input_ids=ids, attention_mask=mask).logits]
    assert len(ran) == 2 * 2 and all(key.sink for key in ran)  # 2 layers, 2 calls, sinks
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1][0], want[1][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1][1, 3:], want[1][1, 3:], rtol=1e-4, atol=1e-4)
    built = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="flashgen")
    assert built.config._attn_implementation == "flashgen"
    model.set_attn_implementation("eager")  # generation (a KV cache: Sq < Sk) matches too
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,
                              do_sample=False)  # fmt: skip
        model.set_attn_implementation("flashgen")
        ran.clear()
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,
                             do_sample=False)  # fmt: skip
    assert torch.equal(got, want) and len(ran) == 2 * 4
    # other names keep transformers' own behaviour: the model's flash kernel list applies
    assert type(built)._compatible_flash_implementations[0].startswith("kernels-community/")


# ----------------------------------------------------------------------------- item 10
def test_one_softcap_rule_everywhere():
    """``flash_attn_func(softcap=nan)`` equalled no softcap; the transformers backend took
    ``softcap=0.0`` as a cap of 0 (uniform attention) where flash_attn_func takes 0 as off.
    Now 0 is off in both; NaN, inf and negative values raise naming softcap."""
    q, k, v = (_rnd(1, 6, 4, 32, seed=s) for s in (1, 2, 3))
    plain = flash_attn_func(q, k, v, causal=True)
    assert torch.equal(flash_attn_func(q, k, v, causal=True, softcap=0.0), plain)
    mod = torch.nn.Module()
    mod.is_causal = True
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # transformers' (B, H, S, D)
    hf_plain, _ = fg_hf.flashgen_attention_forward(mod, qt, kt, vt, None, softcap=None)
    hf_zero, _ = fg_hf.flashgen_attention_forward(mod, qt, kt, vt, None, softcap=0.0)
    assert torch.equal(hf_zero, hf_plain)
    torch.testing.assert_close(hf_plain, plain, rtol=1e-5, atol=1e-5)
    for bad in (math.nan, math.inf, -math.inf, -1.0):
        with pytest.raises(OpInputError, match="softcap: expected"):
            flash_attn_func(q, k, v, softcap=bad)
        with pytest.raises(OpInputError, match="softcap: expected"):
            fg_hf.flashgen_attention_forward(mod, qt, kt, vt, None, softcap=bad)
    capped = flash_attn_func(q, k, v, causal=True, softcap=2.0)
    hf_capped, _ = fg_hf.flashgen_attention_forward(mod, qt, kt, vt, None, softcap=2.0)
    torch.testing.assert_close(hf_capped, capped, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- item 11
@pytest.mark.parametrize("scale", [0.0, -0.5, math.nan, math.inf, 1e-45])
def test_sdpa_hook_falls_back_for_scales_torch_takes(scale):
    """SDPA takes ``scale=0.0`` or a negative scale; the hook raised the op's
    OpInputError instead of letting torch's kernel run it."""
    q, k, v = (_rnd(1, 2, 5, 64, seed=s, dtype=torch.bfloat16) for s in (1, 2, 3))
    seen = []

    def fallback(*args, **kw):
        seen.append(kw)
        return "torch's kernel"

    got = fg_sdpa.sdpa_flash_forward(q, k, v, 0.0, False, False, scale=scale,
                                     fallback=fallback, require_cuda=False)  # fmt: skip
    assert got == "torch's kernel" and len(seen) == 1
    assert "scale" in fg_sdpa.unsupported_reason(q, k, v, require_cuda=False, scale=scale)
    o, lse = q[..., :64].float(), torch.zeros(1, 2, 5)
    got = fg_sdpa.sdpa_flash_backward(q, q, k, v, o, lse, None, None, 5, 5, 0.0, False, None,
                                      None, scale=scale, fallback=fallback,
                                      require_cuda=False)  # fmt: skip
    assert got == "torch's kernel" and len(seen) == 2


def test_sdpa_hook_falls_back_for_anything_the_op_refuses():
    """Shapes SDPA itself would check (key / value lengths that differ) or that the op
    refuses are torch's kernel's to answer, not an OpInputError from the hook."""
    q, k = (_rnd(1, 2, 5, 64, seed=s, dtype=torch.bfloat16) for s in (1, 2))
    v = _rnd(1, 2, 6, 64, seed=3, dtype=torch.bfloat16)
    got = fg_sdpa.sdpa_flash_forward(q, k, v, 0.0, False, False, scale=0.1,
                                     fallback=lambda *a, **kw: "torch's kernel",
                                     require_cuda=False)  # fmt: skip
    assert got == "torch's kernel"
    out = fg_sdpa.sdpa_flash_forward(q, k, k, 0.0, False, False, scale=0.1, require_cuda=False)
    assert out[0].shape == (1, 2, 5, 64)


def test_sdpa_backward_falls_back_for_anything_the_op_refuses(monkeypatch):
    """The forward fell back to torch's kernel on any OpInputError of the op, the backward
    did not: a refusal of flashgen's backward reached the caller's ``loss.backward()``.
    Both directions now answer with torch's kernel (stood in by an op whose backward
    refuses every call)."""
    import types

    def refuse(*args, **kwargs):
        raise OpInputError("q: a refusal of the op's backward")

    stub = types.SimpleNamespace(backward=types.SimpleNamespace(cpu=refuse, cuda=refuse))
    monkeypatch.setattr(fg_sdpa, "_op", lambda *args: stub)
    q, k, v = (_rnd(1, 2, 5, 64, seed=s, dtype=torch.bfloat16) for s in (1, 2, 3))
    o, lse = q.clone(), torch.zeros(1, 2, 5)
    got = fg_sdpa.sdpa_flash_backward(q, q, k, v, o, lse, None, None, 5, 5, 0.0, False, None,
                                      None, scale=0.1, fallback=lambda *a, **kw: "torch's",
                                      require_cuda=False)  # fmt: skip
    assert got == "torch's"
    with pytest.raises(RuntimeError, match="cannot serve this call: q: a refusal"):
        fg_sdpa.sdpa_flash_backward(q, q, k, v, o, lse, None, None, 5, 5, 0.0, False, None,
                                    None, scale=0.1, require_cuda=False)  # fmt: skip
