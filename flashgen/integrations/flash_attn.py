"""FlashAttention's call shapes on flashgen ops (``flashgen.flash_attn``).

    from flashgen.flash_attn import flash_attn_func, flash_attn_varlen_func
    out = flash_attn_func(q, k, v, causal=True, window_size=(256, 0))  # q [B, S, H, D]

The argument names, layouts and semantics of ``flash_attn.flash_attn_func`` and
``flash_attn_varlen_func`` (FlashAttention 2.x, Dao 2023):

- q ``(B, Sq, Hq, D)``, k ``(B, Sk, Hkv, D)``, v ``(B, Sk, Hkv, Dv)`` (varlen: ``(total, H,
  D)`` with int32 ``cu_seqlens``); Hq % Hkv == 0 (GQA/MQA, k and v are not expanded).
- ``causal``: bottom-right aligned (query i sees keys j <= i + Sk - Sq).
- ``window_size=(left, right)``: query i sees keys j with
  ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``; -1 is an unbounded side;
  ``causal`` sets right to 0.
- ``softcap > 0``: scores become ``softcap * tanh(score / softcap)`` (after scaling);
  0 is off.
- ``alibi_slopes`` fp32 ``(H,)`` or ``(B, H)``: ``-slope * |i + Sk - Sq - j|`` is added to the
  (scaled, soft-capped) score.
- ``deterministic``: the backward's bitwise-reproducible kernels.
- A row with no key: output 0.

Each combination of (head dims, dtype, causal, which window sides, softcap, ALiBi) is a
spec built on demand (:mod:`flashgen.integrations._specs`) and compiled on first use on a
GPU; the CPU op runs anywhere (float32 inputs too).  ``dropout_p > 0``,
``return_attn_probs=True`` and ``block_table`` raise :class:`~flashgen.OpInputError`
(flashgen has no dropout, never materializes P, has no paged KV yet).

The output of :func:`flash_attn_func` is a contiguous ``(B, Sq, Hq, Dv)`` tensor, as
FlashAttention's: it is allocated in that layout and passed to the op as ``out=`` (viewed
``[B, Hq, Sq, Dv]``), which the kernel writes through its strides (no copy; see
:meth:`flashgen.ops.prefill.attention.AttentionOp.attention`).  lse stays ``[B, Hq, Sq]``.
"""

from __future__ import annotations

import numbers

import torch

from flashgen.frontend.errors import OpInputError
from flashgen.integrations._specs import (
    SpecKey,
    check_head_dims,
    check_softcap,
    op_for,
    spec_dtype,
)
from flashgen.ops.out_arg import expected_out_dtype

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func"]


def _unsupported(dropout_p, return_attn_probs) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise OpInputError(f"dropout_p: expected a float, got {dropout_p!r}")
    if dropout_p != 0.0:
        raise OpInputError(
            f"dropout_p: flashgen has no attention dropout; expected 0.0, got {dropout_p!r}"
        )
    if return_attn_probs:
        raise OpInputError(
            "return_attn_probs: flashgen never materializes the attention probabilities; "
            "expected False, got True"
        )


def _window(window_size, causal: bool) -> tuple[int | None, int | None]:
    """(left, right) bounds, None for unbounded; causal pins right to 0."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise OpInputError(
            f"window_size: expected a pair (left, right) of ints, -1 = unbounded, got "
            f"{window_size!r}"
        ) from None
    for side, w in (("left", left), ("right", right)):
        if isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < -1:
            raise OpInputError(
                f"window_size: expected {side} to be an int >= -1 (-1 = unbounded), got {w!r}"
            )
    left = None if left < 0 else int(left)
    right = None if right < 0 else int(right)
    if causal:
        right = None  # causal keeps j <= diagonal: the right bound 0, as FlashAttention
    return left, right


def _softcap(softcap) -> float | None:
    """:func:`~flashgen.integrations._specs.check_softcap` (0 = off; NaN, inf, < 0 raise)."""
    if softcap is None:  # FlashAttention's signature takes a float: None is no float
        raise OpInputError("softcap: expected a finite number >= 0 (0 = off), got None")
    return check_softcap(softcap)


def _slopes(alibi_slopes, batch: int, heads: int, device):
    """ALiBi slopes as the spec's ``[batch, num_heads]`` float32 param."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise OpInputError(
            f"alibi_slopes: expected a float32 tensor ({heads},) or ({batch}, {heads}), got "
            f"{type(alibi_slopes).__name__}"
        )
    if alibi_slopes.device != device:
        raise OpInputError(
            f"alibi_slopes: expected device {device} (q's device), got {alibi_slopes.device}"
        )
    if tuple(alibi_slopes.shape) == (heads,):
        alibi_slopes = alibi_slopes.unsqueeze(0)
    if tuple(alibi_slopes.shape) not in ((1, heads), (batch, heads)):
        raise OpInputError(
            f"alibi_slopes: expected shape ({heads},) or ({batch}, {heads}), got "
            f"{tuple(alibi_slopes.shape)}"
        )
    if not alibi_slopes.dtype.is_floating_point:
        raise OpInputError(f"alibi_slopes: expected a float32 tensor, got {alibi_slopes.dtype}")
    return alibi_slopes.to(torch.float32).expand(batch, heads).contiguous()


def _prepare(q, v, causal, window_size, softcap, alibi_slopes, batch, heads):
    """(op, params) for a call; validates the FlashAttention-level arguments."""
    for name, t in (("q", q), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise OpInputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not isinstance(causal, bool):
        raise OpInputError(f"causal: expected a bool, got {causal!r}")
    left, right = _window(window_size, causal)
    cap = _softcap(softcap)
    check_head_dims(q.shape[-1], v.shape[-1])
    key = SpecKey(
        head_dim=q.shape[-1], head_dim_v=v.shape[-1],
        dtype=spec_dtype(q.dtype, "q", q.device.type),
        causal="bottom_right" if causal else "none", window_left=left is not None,
        window_right=right is not None, softcap=cap is not None, alibi=alibi_slopes is not None,
    )  # fmt: skip
    params = {}
    if left is not None:
        params["window_left"] = left
    if right is not None:
        params["window_right"] = right
    if cap is not None:
        params["softcap"] = cap
    if alibi_slopes is not None:
        params["slopes"] = _slopes(alibi_slopes, batch, heads, q.device)
    return op_for(key), params


def flash_attn_func(
    q,
    k,
    v,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """``flash_attn.flash_attn_func`` on flashgen (module docstring for the semantics).

    q ``(B, Sq, Hq, D)``, k ``(B, Sk, Hkv, D)``, v ``(B, Sk, Hkv, Dv)``: fp16 / bf16 (float32
    also on CPU), one device, last dim contiguous; D, Dv in flashgen's head dims.
    ``softmax_scale`` defaults to 1/sqrt(D).  Returns out ``(B, Sq, Hq, Dv)``, contiguous,
    in q's dtype: allocated so and written by the op through ``out=`` (without gradients the
    very tensor allocated; with them a view of it carrying the autograd history).
    Differentiable in q, k, v.  Raises :class:`~flashgen.OpInputError` for bad or
    unsupported arguments (``dropout_p > 0``, ``return_attn_probs``).
    """
    _unsupported(dropout_p, return_attn_probs)
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise OpInputError(
            f"q: expected a 4-D tensor (batch, seqlen, heads, head_dim), got "
            f"{list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}"
        )
    op, params = _prepare(q, v, causal, window_size, softcap, alibi_slopes, q.shape[0], q.shape[2])
    t = (x.transpose(1, 2) if isinstance(x, torch.Tensor) and x.dim() == 4 else x
         for x in (q, k, v))  # fmt: skip
    b, sq, hq = q.shape[:3]
    out = torch.empty(
        (b, sq, hq, v.shape[-1]), dtype=expected_out_dtype(op.spec, q), device=q.device
    )
    o, _ = op.attention(
        *t, softmax_scale=softmax_scale, deterministic=deterministic, out=out.transpose(1, 2),
        **params,
    )  # fmt: skip
    return o.transpose(1, 2) if o.requires_grad else out


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """``flash_attn.flash_attn_qkvpacked_func``: qkv ``(B, S, 3, H, D)`` -> ``(B, S, H, D)``
    (views of qkv, no copy); otherwise as :func:`flash_attn_func`."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        raise OpInputError(
            f"qkv: expected a 5-D tensor (batch, seqlen, 3, heads, head_dim), got "
            f"{list(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__}"
        )
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)  # fmt: skip


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table=None,
):
    """``flash_attn.flash_attn_varlen_func`` on flashgen's varlen ops.

    q ``(total_q, Hq, D)``, k ``(total_k, Hkv, D)``, v ``(total_k, Hkv, Dv)``; int32
    ``cu_seqlens_q`` / ``cu_seqlens_k`` ``(batch + 1,)``; ``max_seqlen_*`` Python ints.
    Per sequence the semantics of :func:`flash_attn_func` (causal and windows aligned at
    each sequence's bottom-right; ``alibi_slopes`` ``(H,)`` or ``(batch, H)``); empty
    sequences are allowed.  Returns out ``(total_q, Hq, Dv)``.  ``block_table`` (paged KV)
    raises :class:`~flashgen.OpInputError`, like ``dropout_p > 0`` and
    ``return_attn_probs``.
    """
    _unsupported(dropout_p, return_attn_probs)
    if block_table is not None:
        raise OpInputError("block_table: paged KV caches are not supported yet; expected None")
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise OpInputError(
            f"q: expected a 3-D packed tensor (total_q, heads, head_dim), got "
            f"{list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}"
        )
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1:
        raise OpInputError(
            "cu_seqlens_q: expected a 1-D int32 tensor (batch + 1,), got "
            f"{cu_seqlens_q!r}"
        )
    batch = cu_seqlens_q.shape[0] - 1
    op, params = _prepare(q, v, causal, window_size, softcap, alibi_slopes, batch, q.shape[1])
    o, _ = op.varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        softmax_scale=softmax_scale, deterministic=deterministic, **params,
    )  # fmt: skip
    return o
