"""The implementations flashgen is timed against, as ``f(q, k, v) -> o`` callables.

    flashgen        the generated op
    sdpa_flash      torch SDPA, SDPBackend.FLASH_ATTENTION forced (FlashAttention-2)
    sdpa_cudnn      torch SDPA, SDPBackend.CUDNN_ATTENTION forced
    sdpa_efficient  torch SDPA, SDPBackend.EFFICIENT_ATTENTION forced
    flex            FlexAttention under torch.compile (mask/score_mod from flashgen.bench.flexmods;
                    a spec's sink joined to o from Flex's lse with flashgen.ops.sink.apply_sink)
    standard        eager matmul -> softmax -> matmul (materializes the seqlen^2 scores)
    flashgen_bf16   an fp8 spec's bf16 build (protocol.bf16_twin): fp8 specs are timed only
                    against it, no torch implementation runs FP8 attention

:func:`make_forward` builds one; an implementation that cannot express a spec raises
:class:`Unsupported`.  Used by ``flashgen bench`` (``--gallery`` too) and ``flashgen ab
--peers``.  torch is imported inside the functions.
"""

from __future__ import annotations

from flashgen.bench.protocol import FP8_PEER, IMPLS, bf16_twin, is_fp8, spec_impls
from flashgen.frontend import ir


class Unsupported(Exception):
    """An implementation cannot run this config (recorded, not raised to the user)."""


def standard_attention(q, k, v, causal: bool, scale: float, mask=None):
    """Eager PyTorch attention: ``softmax(q k^T * scale) v``, materializing the scores.

    ``mask`` is an optional precomputed bool ``[Sq, Sk]`` tensor, True where masked (the
    causal mask is cached by the caller so building it is not timed).
    """
    import torch

    s = torch.matmul(q * scale, k.transpose(-2, -1))
    if causal:
        if mask is None:
            sq, sk = q.shape[-2], k.shape[-2]
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)
        s = s.masked_fill(mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v)


_FLEX = None


#: FlexAttention kernel options tried when its default Triton configs do not fit in shared
#: memory (seen on the H200 for t5_bias: "No valid triton configs ... out of resource").
FLEX_SMALL_BLOCKS = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1}


def flex_retrying_smaller_blocks(flex):
    """``flex`` (a compiled ``flex_attention``) that, when a call fails because no Triton
    config fits the GPU's shared memory, retries once with :data:`FLEX_SMALL_BLOCKS` and
    keeps those options for later calls (FlexAttention measured at a config it can run,
    rather than not at all).  Other errors propagate."""
    options: dict = {}

    def call(*args, **kwargs):
        if options:
            return flex(*args, kernel_options=dict(options), **kwargs)
        try:
            return flex(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - Inductor wraps the Triton error
            text = str(e)
            if "out of resource" not in text and "No valid triton configs" not in text:
                raise
        options.update(FLEX_SMALL_BLOCKS)
        return flex(*args, kernel_options=dict(options), **kwargs)

    call.kernel_options = options
    return call


def flex_compiled():
    """``torch.compile(flex_attention, dynamic=False)``, created once, recompile limits raised."""
    global _FLEX
    if _FLEX is None:
        import torch
        from torch.nn.attention.flex_attention import flex_attention

        cfg = torch._dynamo.config
        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), 4096))
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def flex_lse_kwargs() -> dict:
    """The keyword that has ``flex_attention`` return the log-sum-exp (natural log, ``[B, Hq,
    Sq]`` float32) with o: ``return_aux=AuxRequest(lse=True)`` where this torch has it (o and
    an ``AuxOutput``), else ``return_lse=True`` (o and the lse)."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


SDPA_BACKENDS = {
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
}


def make_forward(impl: str, spec: ir.Spec, seqlen_q: int, seqlen_k: int, params: dict, device):
    """``f(q, k, v) -> o`` for ``impl`` on problems of ``spec``'s semantics.

    ``params`` holds the spec's param values (tensors on ``device``).  Raises
    :class:`Unsupported` when ``impl`` cannot express the spec (e.g. SDPA with a
    score_mod) or the backend is unavailable.
    """
    import torch

    from flashgen.codegen.cuda_expr import split_causal
    from flashgen.ops.op import build_op, default_softmax_scale

    scale = default_softmax_scale(spec)
    causal, residual = split_causal(spec.mask)
    plain = residual is None and spec.score_mod is None and not spec.params
    if impl == "flashgen":
        op = build_op(spec)
        if is_fp8(spec):  # descales of 1.0 made once per [B, Hkv], not on every call
            ones: dict = {}

            def fp8(q, k, v):
                key = (k.shape[0], k.shape[1], k.device)
                d = ones.get(key)
                if d is None:
                    d = ones[key] = torch.ones(key[:2], dtype=torch.float32, device=k.device)
                return op.attention(q, k, v, q_descale=d, k_descale=d, v_descale=d, **params)[0]

            return fp8
        return lambda q, k, v: op.attention(q, k, v, **params)[0]
    if impl == FP8_PEER:
        if not is_fp8(spec):
            raise Unsupported(f"{FP8_PEER} is the bf16 build of an fp8 spec")
        return make_forward("flashgen", bf16_twin(spec), seqlen_q, seqlen_k, params, device)
    if is_fp8(spec):
        raise Unsupported(f"{impl} has no FP8 attention (fp8 specs: flashgen and {FP8_PEER})")
    if impl in SDPA_BACKENDS:
        if not plain:
            raise Unsupported("SDPA has no equivalent of this mask/score_mod")
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, SDPA_BACKENDS[impl])
        F = torch.nn.functional

        def sdpa(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
                )

        if causal and seqlen_q != seqlen_k:
            raise Unsupported("SDPA's is_causal is top-left aligned; flashgen's bottom-right")
        return sdpa
    if impl == "flex":
        try:
            from torch.nn.attention.flex_attention import create_block_mask
        except ImportError as e:
            raise Unsupported(f"no FlexAttention in this torch: {e}") from e
        from flashgen.bench.flexmods import flex_mods, mask_uses_batch_or_head

        flex = flex_retrying_smaller_blocks(flex_compiled())
        block_masks: dict = {}
        mods: dict = {}  # group (num_heads // num_heads_kv: the DSL's h_kv) -> the mods
        sinks: dict = {}  # (B, Hq, Hkv) -> the sink logits [B, Hq] (a spec with a sink)
        lse_kw = flex_lse_kwargs() if spec.sink is not None else {}

        def run_flex(q, k, v):
            group = q.shape[1] // k.shape[1]
            if group not in mods:
                mods[group] = flex_mods(spec, seqlen_q, seqlen_k, params, group=group)
            score_mod, mask_mod = mods[group]
            key = (q.shape[0], q.shape[1], group)
            if mask_mod is not None and key not in block_masks:
                bh = mask_uses_batch_or_head(spec)
                block_masks[key] = create_block_mask(
                    mask_mod,
                    q.shape[0] if bh else None,
                    q.shape[1] if bh else None,
                    seqlen_q,
                    seqlen_k,
                    device=q.device,
                )
            out = flex(
                q,
                k,
                v,
                score_mod=score_mod,
                block_mask=block_masks.get(key),
                scale=scale,
                enable_gqa=k.shape[1] != q.shape[1],
                **lse_kw,
            )
            if spec.sink is None:
                return out
            # FlexAttention's softmax has no sink logit: join it to o from the lse of the
            # keys, as flashgen's op does (flashgen.ops.sink.apply_sink, differentiable)
            from flashgen.ops.sink import apply_sink, sink_logits

            o, aux = out
            lse = getattr(aux, "lse", aux)  # AuxOutput (return_aux) or the lse (return_lse)
            skey = (q.shape[0], q.shape[1], k.shape[1])
            if skey not in sinks:
                sinks[skey] = sink_logits(
                    spec, params, batch=skey[0], heads_q=skey[1], heads_kv=skey[2],
                    device=q.device,
                )  # fmt: skip
            return apply_sink(o, lse, sinks[skey])

        run_flex.kernel_options = flex.kernel_options  # non-empty once the retry happened
        return run_flex
    if impl == "standard":
        if plain:
            mask = None
            if causal:
                mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device).triu(
                    seqlen_k - seqlen_q + 1
                )
            return lambda q, k, v: standard_attention(q, k, v, causal, scale, mask)
        from flashgen.ops.cpu.reference import attention_reference

        def ref(q, k, v):
            return attention_reference(spec, q, k, v, params=params, compute_dtype=q.dtype)[0]

        return ref
    raise ValueError(f"unknown implementation {impl!r}; known: {', '.join(IMPLS)}")


def expressible(impl: str, spec: ir.Spec) -> bool:
    """Whether ``impl`` can compute ``spec``: SDPA only plain causal/unmasked attention; an
    fp8 spec only flashgen and :data:`FP8_PEER` (its bf16 build), which nothing else is."""
    from flashgen.codegen.cuda_expr import split_causal

    if is_fp8(spec) or impl == FP8_PEER:
        return impl in spec_impls(spec, (impl,))
    if impl in SDPA_BACKENDS:
        causal, residual = split_causal(spec.mask)
        return residual is None and spec.score_mod is None and not spec.params
    return True


def flashgen_has_backward(op) -> bool | None:
    """The op's backward capability flag if it has one (``supports_backward`` /
    ``has_backward``), else None: the caller then tries ``backward`` and catches
    ``NotImplementedError``."""
    for name in ("supports_backward", "has_backward"):
        flag = getattr(op, name, None)
        if isinstance(flag, bool):
            return flag
    return None
