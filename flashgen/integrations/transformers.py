"""HuggingFace transformers attention backend: ``attn_implementation="flashgen"``.

    import flashgen.integrations.transformers as fg_hf
    fg_hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flashgen")
    # or model.set_attn_implementation("flashgen")

:func:`register` adds :func:`flashgen_attention_forward` to ``transformers.AttentionInterface``
and transformers' FlashAttention mask function (2-D padding mask or None) to
``AttentionMaskInterface`` under ``"flashgen"`` (without a mask function transformers drops
the mask for an unknown implementation).

Per layer call, the spec comes from what transformers passes (:mod:`._specs`, built and
cached per (head dims, dtype, causal, window, softcap); window sizes and the softcap value
are op params): ``is_causal`` (bottom-right causal), ``sliding_window`` (a causal layer
keeps the last ``sliding_window`` keys, FlashAttention's ``window_size=(w - 1, 0)``;
non-causal ``(w - 1, w - 1)``, as transformers' FlashAttention path), ``softcap``
(Gemma 2), ``scaling``; GQA k/v go in unexpanded.  Attention sinks (``s_aux``, gpt-oss's
per-head ``sinks``) are the spec's ``sink: sinks[h]`` (:mod:`flashgen.ops.sink`), in training
(differentiable in q, k, v and the sinks) and in generation (gpt-oss keeps the name
"flashgen": :func:`_keep_the_name`).

Padding (a 2-D ``attention_mask``) and packed batches (``cu_seq_lens_q/k`` with
``max_length_q/k``, or ``position_ids`` that restart in a batch of one) run the varlen op
on the real tokens only (no compute on padding); the output is ``(B, S, Hq, Dv)`` with
padded query rows 0.  Queries of a padded batch are right-aligned with their keys (left
padding, or Sq == Sk), as in transformers' FlashAttention path.

Dropout > 0 (training with ``attention_dropout``) raises :class:`~flashgen.OpInputError`:
flashgen has no dropout.  On CUDA, inputs must be fp16 / bf16 (load the model in that
dtype); on CPU float32 works too (the blocked CPU op).
"""

from __future__ import annotations

import torch

from flashgen.frontend.errors import OpInputError
from flashgen.integrations._specs import (
    SpecKey,
    check_head_dims,
    check_softcap,
    op_for,
    spec_dtype,
)

#: the name registered with transformers
NAME = "flashgen"


def register(name: str = NAME) -> None:
    """Register flashgen with transformers under ``name``: the attention function with
    ``AttentionInterface`` and FlashAttention's mask function with ``AttentionMaskInterface``.
    Idempotent.  Raises ``ModuleNotFoundError`` (saying so) without transformers."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "flashgen.integrations.transformers.register needs HuggingFace transformers "
            "(pip install transformers)", name=e.name,
        ) from None  # fmt: skip
    AttentionInterface.register(name, flashgen_attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    _answer_flash_lookup(name)
    _keep_the_name()


_NAMES: set[str] = set()


def _answer_flash_lookup(name: str) -> None:
    """transformers takes every implementation name containing "flash" for a FlashAttention
    build (``utils.generic.is_flash_attention_requested``) and preloads its functions when
    the implementation is set (``modeling_flash_attention_utils.lazy_import_flash_attention``
    -> ``_lazy_imports``), which for an unknown name means a hub kernel, and fails.  This
    answers that lookup for ``name`` with :mod:`flashgen.integrations.flash_attn`'s
    ``flash_attn_func`` / ``flash_attn_varlen_func`` (wrapping ``_lazy_imports`` once);
    other names go to transformers' own function.  Checked against transformers 5.17."""
    import transformers.modeling_flash_attention_utils as mfau

    _NAMES.add(name)
    orig = getattr(mfau, "_lazy_imports", None)
    if orig is None or getattr(orig, "_flashgen", False):
        return

    def _lazy_imports(implementation, attention_wrapper=None, allow_all_kernels=False):
        base = implementation.split("|")[-1] if isinstance(implementation, str) else None
        if base in _NAMES:
            from flashgen.integrations.flash_attn import flash_attn_func, flash_attn_varlen_func

            return flash_attn_func, flash_attn_varlen_func, None, mfau._pad_input, mfau._unpad_input
        return orig(implementation, attention_wrapper, allow_all_kernels=allow_all_kernels)

    _lazy_imports._flashgen = True
    mfau._lazy_imports = _lazy_imports


def _keep_the_name() -> None:
    """transformers (checked against 5.17) reroutes every implementation name containing
    "flash" (``utils.generic.is_flash_attention_requested``) for a model that lists its
    ``_compatible_flash_implementations`` (gpt-oss, whose sinks SDPA cannot express) to the
    first of them, a hub kernel (``kernels-community/vllm-flash-attn3``): a download, which
    fails offline, and another library's kernels in any case.  This wraps
    ``PreTrainedModel._check_and_adjust_attn_implementation`` (once) so that for a name
    :func:`register` registered the model's list is out of sight during the check: the
    model keeps flashgen's implementation (``s_aux`` is the spec's sink, see the module doc).
    Other names are checked as before."""
    from transformers.modeling_utils import PreTrainedModel

    orig = PreTrainedModel._check_and_adjust_attn_implementation
    if getattr(orig, "_flashgen", False):
        return

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        base = attn_implementation.split("|")[-1] if isinstance(attn_implementation, str) else None
        if base not in _NAMES or not getattr(self, "_compatible_flash_implementations", None):
            return orig(self, attn_implementation, *args, **kwargs)
        key = "_compatible_flash_implementations"
        had, own = key in self.__dict__, self.__dict__.get(key)
        self.__dict__[key] = None  # the class's list, hidden for this check only
        try:
            return orig(self, attn_implementation, *args, **kwargs)
        finally:
            if had:
                self.__dict__[key] = own
            else:
                del self.__dict__[key]

    _check_and_adjust_attn_implementation._flashgen = True
    PreTrainedModel._check_and_adjust_attn_implementation = _check_and_adjust_attn_implementation


def _spec_key(query, value, is_causal: bool, window: tuple, softcap: bool,
              sink: bool = False) -> SpecKey:  # fmt: skip
    check_head_dims(query.shape[-1], value.shape[-1], "query")
    return SpecKey(
        head_dim=query.shape[-1], head_dim_v=value.shape[-1],
        dtype=spec_dtype(query.dtype, "query", query.device.type),
        causal="bottom_right" if is_causal else "none", window_left=window[0] is not None,
        window_right=window[1] is not None, softcap=softcap, sink=sink,
    )  # fmt: skip


def _cu(lens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))


def _packed_from_positions(position_ids, total: int):
    """cu_seqlens of the sequences ``position_ids`` [1, S] packs (a new sequence wherever the
    position does not continue the previous one), or None for a single sequence."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return None
    pos = position_ids[0]
    if pos.shape[0] != total or total == 0:
        return None
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    if int(starts.sum()) == 1:
        return None
    idx = torch.nonzero(starts).flatten()
    bounds = torch.cat([idx, torch.tensor([total], device=idx.device)])
    return _cu(bounds.diff().to(torch.int32))


def flashgen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract on flashgen ops.

    query ``(B, Hq, Sq, D)``, key ``(B, Hkv, Sk, D)``, value ``(B, Hkv, Sk, Dv)`` (as the
    model's attention layer passes them); ``attention_mask``: None or a 2-D bool padding
    mask ``(B, Sk)`` (from the FlashAttention mask function :func:`register` installs).
    ``softcap``: None or 0 is off (FlashAttention's rule, as ``flash_attn_func``).
    Returns ``(out, None)`` with out ``(B, Sq, Hq, Dv)``.  Raises
    :class:`~flashgen.OpInputError` for dropout > 0, a softcap that is NaN, infinite or
    negative, a 4-D mask (a custom mask this
    backend cannot read), a head dim or dtype flashgen lacks.
    """
    if dropout:
        raise OpInputError(
            f"dropout: flashgen has no attention dropout; expected 0.0, got {dropout!r} "
            "(set config.attention_dropout = 0.0 for training, or use another "
            "attn_implementation)"
        )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise OpInputError(
            f"attention_mask: expected None or a 2-D padding mask (batch, seqlen_k), got shape "
            f"{list(attention_mask.shape)}; register() installs the mask function that makes "
            "one (a custom 4-D mask needs the eager or sdpa implementation)"
        )
    if attention_mask is not None:
        b, sq, sk = query.shape[0], query.shape[2], key.shape[2]
        if attention_mask.shape[0] != b or not sq <= attention_mask.shape[1]:
            raise OpInputError(
                f"attention_mask: expected shape (batch {b}, seqlen_k) with seqlen_k >= the "
                f"queries' {sq}, got {list(attention_mask.shape)}"
            )
        if attention_mask.shape[1] < sk:
            # a static cache: k / v hold max_cache_len slots, the mask the tokens seen so
            # far, the first of those slots (transformers' FlashAttention path slices so too)
            n = attention_mask.shape[1]
            key, value = key[:, :, :n], value[:, :, :n]
    if is_causal is None:
        is_causal = bool(getattr(module, "is_causal", True))
    window = (None, None)
    if sliding_window is not None:
        w = int(sliding_window) - 1
        window = (w, None) if is_causal else (w, w)
    softcap = check_softcap(softcap)  # 0 = off, as flash_attn_func; NaN / inf / < 0 raise
    key_ = _spec_key(query, value, is_causal, window, softcap is not None, s_aux is not None)
    op = op_for(key_)
    params = {}
    if window[0] is not None:
        params["window_left"] = window[0]
    if window[1] is not None:
        params["window_right"] = window[1]
    if softcap is not None:
        params["softcap"] = float(softcap)
    if s_aux is not None:
        params["sinks"] = s_aux
    b, hq, sq, _ = query.shape
    sk = key.shape[2]
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if attention_mask is None and cu_q is None and sq == sk:
        cu_q = cu_k = _packed_from_positions(kwargs.get("position_ids"), b * sq)
        max_q = max_k = None
    if attention_mask is None and cu_q is None:  # one sequence per batch entry
        o, _ = op.attention(query, key, value, softmax_scale=scaling, **params)
        return o.transpose(1, 2), None
    qt, kt, vt = (t.transpose(1, 2) for t in (query, key, value))  # (B, S, H, D) views
    idx_q = None
    if attention_mask is not None:  # unpad: only the real tokens
        mask_k = attention_mask.to(torch.bool)[:, -sk:]
        mask_q = mask_k if sq == sk else mask_k[:, -sq:]
        idx_k = torch.nonzero(mask_k.flatten()).flatten()
        idx_q = idx_k if sq == sk else torch.nonzero(mask_q.flatten()).flatten()
        lens_k, lens_q = mask_k.sum(1, dtype=torch.int32), mask_q.sum(1, dtype=torch.int32)
        cu_k, cu_q = _cu(lens_k), _cu(lens_q)
        max_k, max_q = int(lens_k.max()), int(lens_q.max())
        q_p = qt.reshape(b * sq, hq, -1).index_select(0, idx_q)
        k_p = kt.reshape(b * sk, kt.shape[2], -1).index_select(0, idx_k)
        v_p = vt.reshape(b * sk, vt.shape[2], -1).index_select(0, idx_k)
    else:  # packed: cu_seq_lens given, or from position_ids
        q_p, k_p, v_p = (t.reshape(-1, t.shape[2], t.shape[3]) for t in (qt, kt, vt))
        cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
        max_q = int(cu_q.diff().max()) if max_q is None else int(max_q)
        max_k = int(cu_k.diff().max()) if max_k is None else int(max_k)
    o, _ = op.varlen(q_p, k_p, v_p, cu_q, cu_k, max_q, max_k, softmax_scale=scaling, **params)
    if idx_q is not None:
        full = o.new_zeros((b * sq, hq, o.shape[-1]))
        o = full.index_copy(0, idx_q, o)
    return o.view(b, sq, hq, o.shape[-1]), None
