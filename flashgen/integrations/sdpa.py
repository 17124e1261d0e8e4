"""flashgen as the flash backend of ``torch.nn.functional.scaled_dot_product_attention``.

    import flashgen.integrations.sdpa as fg_sdpa
    from torch.nn.attention import activate_flash_attention_impl
    fg_sdpa.register()                        # once per process
    activate_flash_attention_impl("flashgen")  # SDPA's flash backend now runs flashgen

Recent torch (``torch/nn/attention/_registry.py``, how FlashAttention-3/-4 plug in, see
``_fa3.py``) lets a provider replace the CUDA kernels of
``aten::_scaled_dot_product_flash_attention`` and its backward.  :func:`register` registers
flashgen there under ``"flashgen"``; activating it (``activate_flash_attention_impl``) installs
:func:`sdpa_flash_forward` / :func:`sdpa_flash_backward` as those CUDA kernels, so every SDPA
call that selects the flash backend on a CUDA device runs flashgen's forward and backward
kernels: causal (SDPA's ``is_causal`` is top-left aligned: key j <= query i; the DSL's
bottom-right ``causal`` when Sq == Sk), any ``scale``, GQA (``enable_gqa``: k/v heads are
read unexpanded).  A call flashgen cannot serve (:func:`unsupported_reason`: dropout > 0,
a debug mask, a head dim or dtype it lacks, a GPU below compute capability 8.0)
runs the kernel it replaced (``torch.library.get_kernel``), not an error.
``torch.nn.attention.restore_flash_attention_impl()`` puts torch's kernels back.

The spec per (head dims, dtype, causal) is built on first use (:mod:`._specs`) and compiled
on the first call on a device.  ``deterministic``: the backward's deterministic kernels
when ``torch.are_deterministic_algorithms_enabled()``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from flashgen.frontend import ir
from flashgen.frontend.errors import OpInputError
from flashgen.integrations._specs import SPEC_DTYPES, SpecKey, op_for
from flashgen.ops.validation import is_normal_f32

#: the name registered with torch.nn.attention
NAME = "flashgen"
_FWD = "_scaled_dot_product_flash_attention"
_BWD = "_scaled_dot_product_flash_attention_backward"


def register(name: str = NAME) -> None:
    """Register flashgen with ``torch.nn.attention``'s flash-attention registry under
    ``name``; then ``torch.nn.attention.activate_flash_attention_impl(name)`` switches SDPA's
    flash backend to flashgen.  Raises ``RuntimeError`` saying so where the installed torch
    lacks the registry (``register_flash_attention_impl``)."""
    try:
        from torch.nn.attention import register_flash_attention_impl
    except ImportError:
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.nn.attention.register_flash_attention_impl "
            "(the registry FlashAttention-3/-4 plug into, torch/nn/attention/_registry.py), so "
            "flashgen cannot become SDPA's flash backend here; upgrade torch, or call "
            "flashgen.flash_attn.flash_attn_func / the transformers backend directly"
        ) from None
    register_flash_attention_impl(name, register_fn=activate)


@dataclass
class FlashgenHandle:
    """Keeps the ``aten`` CUDA kernel overrides alive; :meth:`remove` restores torch's."""

    library: object | None

    def remove(self) -> None:
        lib, self.library = self.library, None
        if lib is not None and hasattr(lib, "_destroy"):
            lib._destroy()


def _original(op: str):
    """The CUDA kernel ``op`` has now (to fall back to), or None (a CPU-only torch)."""
    try:
        return torch.library.get_kernel(f"aten::{op}", "CUDA")
    except RuntimeError:
        return None


def activate() -> FlashgenHandle:
    """Install :func:`sdpa_flash_forward` / :func:`sdpa_flash_backward` as the CUDA kernels of
    ``aten::_scaled_dot_product_flash_attention`` (and its backward), keeping the kernels
    they replace as the fallback.  Called by ``activate_flash_attention_impl``."""
    fwd, bwd = _original(_FWD), _original(_BWD)
    lib = torch.library.Library("aten", "IMPL", "CUDA")

    def forward(keyset, query, key, value, dropout_p=0.0, is_causal=False,
                return_debug_mask=False, *, scale=None):  # fmt: skip
        fallback = None if fwd is None else (lambda *a, **kw: fwd.call_boxed(keyset, *a, **kw))
        return sdpa_flash_forward(query, key, value, dropout_p, is_causal, return_debug_mask,
                                  scale=scale, fallback=fallback)  # fmt: skip

    def backward(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                 max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                 scale=None):  # fmt: skip
        fallback = None if bwd is None else (lambda *a, **kw: bwd.call_boxed(keyset, *a, **kw))
        return sdpa_flash_backward(
            grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
            dropout_p, is_causal, philox_seed, philox_offset, scale=scale, fallback=fallback,
        )  # fmt: skip

    lib.impl(_FWD, forward, "CUDA", with_keyset=True)
    lib.impl(_BWD, backward, "CUDA", with_keyset=True)
    return FlashgenHandle(lib)


def unsupported_reason(query, key, value, dropout_p=0.0, return_debug_mask=False,
                       require_cuda: bool = True, *, scale=None) -> str | None:  # fmt: skip
    """Why flashgen cannot serve this SDPA flash call (then torch's kernel runs), or None:
    dropout, the debug mask, shapes, dtypes or head dims the kernels lack, a ``scale``
    outside the positive normal float32 range (torch takes 0 and negative scales; flashgen's
    ops refuse them), a device below compute capability 8.0."""
    if scale is not None and (
        isinstance(scale, bool)
        or not isinstance(scale, numbers.Real)
        or not is_normal_f32(float(scale))
    ):
        return f"scale {scale!r} (flashgen: a positive, finite float32 scale)"
    if dropout_p != 0.0:
        return "dropout_p > 0 (flashgen has no dropout)"
    if return_debug_mask:
        return "return_debug_mask"
    ts = (query, key, value)
    if any(t.dim() != 4 for t in ts):
        return "inputs are not 4-D"
    dtype = str(query.dtype).removeprefix("torch.")
    if len({t.dtype for t in ts}) != 1 or dtype not in SPEC_DTYPES:
        return f"dtype {query.dtype} (flashgen: float16 / bfloat16, the same for q, k, v)"
    dims = ir.SUPPORTED_HEAD_DIMS
    if query.shape[-1] not in dims or value.shape[-1] not in dims:
        return f"head dims ({query.shape[-1]}, {value.shape[-1]}) not in {ir.SUPPORTED_HEAD_DIMS}"
    hq, hkv = query.shape[1], key.shape[1]
    if hkv == 0 or hq % hkv or value.shape[1] != hkv:
        return f"heads {hq} / {hkv}"
    if key.shape[-1] != query.shape[-1] or len({t.shape[0] for t in ts}) != 1 or (
        key.shape[2] != value.shape[2]
    ):
        return "shapes of query, key, value that do not fit together"
    if require_cuda:
        if not all(t.is_cuda for t in ts) or len({t.device for t in ts}) != 1:
            return "inputs are not on one CUDA device"
        major = torch.cuda.get_device_capability(query.device)[0]
        if major < 8:  # 10.x and newer run the FA2-class units' compute_80 PTX
            return f"compute capability {major}.x (flashgen kernels: 8.0 and newer)"
    return None


def _op(query, value, is_causal: bool, seqlen_q: int, seqlen_k: int):
    causal = "none"
    if is_causal:
        causal = "bottom_right" if seqlen_q == seqlen_k else "top_left"
    dtype = SPEC_DTYPES[str(query.dtype).removeprefix("torch.")]
    return op_for(SpecKey(query.shape[-1], value.shape[-1], dtype, causal))


def _last_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def sdpa_flash_forward(query, key, value, dropout_p=0.0, is_causal=False,
                       return_debug_mask=False, *, scale=None, fallback=None,
                       require_cuda: bool = True):  # fmt: skip
    """The ``aten::_scaled_dot_product_flash_attention`` kernel on flashgen.

    query ``[B, Hq, Sq, D]``, key ``[B, Hkv, Sk, D]``, value ``[B, Hkv, Sk, Dv]``.  Returns
    the op's 9 outputs: (out ``[B, Hq, Sq, Dv]``, logsumexp float32 ``[B, Hq, Sq]``, None,
    None, Sq, Sk, rng_state, unused, debug mask), as FlashAttention-3's provider does.
    Calls ``fallback`` with the same arguments where :func:`unsupported_reason` says so
    (``RuntimeError`` naming the reason without one).  ``require_cuda=False`` lets the CPU
    tests run it on CPU tensors."""
    reason = unsupported_reason(query, key, value, dropout_p, return_debug_mask, require_cuda,
                                scale=scale)  # fmt: skip
    if reason is None:
        sq, sk = query.shape[2], key.shape[2]
        op = _op(query, value, is_causal, sq, sk)
        q, k, v = (_last_contiguous(t) for t in (query, key, value))
        try:  # anything else the op refuses (it validates before it launches): torch's kernel
            with torch.no_grad():
                out, lse = op.attention(q, k, v, softmax_scale=scale)
        except OpInputError as e:
            reason = str(e)
    if reason is not None:
        if fallback is None:
            raise RuntimeError(f"flashgen SDPA flash forward cannot serve this call: {reason}")
        return fallback(query, key, value, dropout_p, is_causal, return_debug_mask, scale=scale)
    rng_state = torch.zeros((2,), dtype=torch.uint64, device=query.device)
    unused = torch.zeros((), dtype=torch.uint64, device=query.device)
    debug = torch.empty(0, dtype=query.dtype, device=query.device)
    return out, lse, None, None, sq, sk, rng_state, unused, debug


def sdpa_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                        max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                        scale=None, fallback=None, require_cuda: bool = True):  # fmt: skip
    """The ``aten::_scaled_dot_product_flash_attention_backward`` kernel on flashgen:
    (dq, dk, dv) like query, key, value, from flashgen's backward kernels (FlashAttention-2's
    algorithm; lse is FlashAttention's, so a forward torch served is fine too).  Falls back
    as :func:`sdpa_flash_forward` does."""
    reason = unsupported_reason(query, key, value, dropout_p, False, require_cuda, scale=scale)
    b, hq, sq = query.shape[0], query.shape[1], query.shape[2]
    if reason is None and (tuple(logsumexp.shape) != (b, hq, sq)
                           or logsumexp.dtype != torch.float32):  # fmt: skip
        reason = f"logsumexp of shape {list(logsumexp.shape)} / {logsumexp.dtype}"
    if reason is not None:
        if fallback is None:
            raise RuntimeError(f"flashgen SDPA flash backward cannot serve this call: {reason}")
        return fallback(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                        max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset,
                        scale=scale)  # fmt: skip
    op = _op(query, value, is_causal, sq, key.shape[2])
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    q, k, v, o, dout = (_last_contiguous(t) for t in (query, key, value, out, grad_out))
    impl = op.backward.cuda if q.is_cuda else op.backward.cpu
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:  # anything else the op refuses (it validates before it launches): torch's kernel
        with torch.no_grad():
            return impl(dout, q, k, v, o, logsumexp, None, float(scale), deterministic)[:3]
    except OpInputError as e:
        if fallback is None:
            raise RuntimeError(f"flashgen SDPA flash backward cannot serve this call: {e}") from e
        return fallback(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                        max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset,
                        scale=scale)  # fmt: skip
