"""The FP8 (e4m3) KV cache of ``op.with_kvcache`` (:mod:`flashgen.ops.decode.op`): its descales.

An e4m3 cache (``k_cache`` / ``v_cache`` of dtype ``torch.float8_e4m3fn``, dense or paged, for
an fp16 / bf16 spec) holds ``K / k_descale`` and ``V / v_descale`` rounded to e4m3, with
FlashAttention-3's per (request, kv head) descales: the true key is ``k_descale[b, h_kv] *
k_cache[...]`` (the same for v).  A descale is a float32 tensor ``[B, Hkv]`` (any strides), a
one-element float32 tensor or a Python number (a broadcast of it), default 1.0; each must be
finite and > 0.  q stays in the spec's dtype, or is e4m3 too with ``q_descale`` (same forms):
it is then converted to the spec's dtype (exact: every e4m3 value is an fp16 and a bf16) and
``q_descale`` is folded into ``k_descale`` (q k = q_descale k_descale q_e4m3 k_e4m3).  k_new /
v_new are e4m3 already (quantized by the caller with the cache's descales) and are written as
they are.  o is in the spec's dtype and lse is that of the dequantized logits.

The kernels fold ``k_descale`` into the softmax scale and ``v_descale`` into o's
normalization (:mod:`flashgen.families.decode`); the CPU path dequantizes the gathered keys
(:func:`flashgen.ops.decode.reference.decode_reference`).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from flashgen.frontend.errors import OpInputError
from flashgen.ops.decode.inputs import FP8_CACHE, DecodeDims
from flashgen.ops.validation import _F32_MAX, _F32_MIN_NORMAL, TORCH_DTYPE, is_normal_f32

# The range of a descale (and of k's descale times q's) is the prefill op's: is_normal_f32.


@dataclass(frozen=True)
class KvScales:
    """The descales of one call, as the kernel takes them: ``k`` / ``v`` a float32 ``[B, Hkv]``
    view (strides 0 for a broadcast one-element tensor) or None (1.0), times the Python
    factor ``k_mul`` / ``v_mul``: the true K is ``k_mul * k[b, h_kv] * K_e4m3``."""

    k: torch.Tensor | None = None
    k_mul: float = 1.0
    v: torch.Tensor | None = None
    v_mul: float = 1.0
    #: whether ``k`` / ``k_mul`` include an e4m3 q's ``q_descale`` (for error messages)
    folded: bool = False

    def tensors(self, batch: int, heads_kv: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_descale, v_descale)`` as float32 ``[B, Hkv]`` tensors (the registered torch
        op's arguments): the factors multiplied in (a new tensor only where one is needed)."""
        out = []
        for t, mul in ((self.k, self.k_mul), (self.v, self.v_mul)):
            if t is None:
                t = torch.full((batch, heads_kv), mul, dtype=torch.float32, device=device)
            elif mul != 1.0:
                t = t * mul
            out.append(t)
        return out[0], out[1]

    def launch_values(self) -> dict:
        """The attention kernel's descale arguments (:func:`flashgen.families.decode.attn_args`)."""
        vals = {}
        for x, t, mul in (("k", self.k, self.k_mul), ("v", self.v, self.v_mul)):
            vals[f"{x}_descale"] = 0 if t is None else t
            vals[f"{x}_descale_mul"] = mul
            vals[f"{x}ds_sb"] = 0 if t is None else t.stride(0)
            vals[f"{x}ds_sh"] = 0 if t is None else t.stride(1)
        return vals


def _scale(name: str, x, batch: int, heads_kv: int, device) -> tuple[torch.Tensor | None, float]:
    """One descale argument -> ``(tensor view [B, Hkv] or None, factor)``; metadata checks
    (and the value of a Python number) only."""
    if x is None:
        return None, 1.0
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        v = float(x)
        if not is_normal_f32(v):
            raise OpInputError(
                f"{name}: expected a finite descale > 0, got {x!r} (a descale is a normal "
                f"float32, in [{_F32_MIN_NORMAL:.7g}, {_F32_MAX:.7g}])"
            )
        return None, v
    if not isinstance(x, torch.Tensor):
        raise OpInputError(
            f"{name}: expected a float32 tensor [batch, heads_kv] = [{batch}, {heads_kv}], a "
            f"one-element tensor or a Python float, got {type(x).__name__}"
        )
    if x.dtype != torch.float32:
        raise OpInputError(f"{name}: expected dtype torch.float32, got {x.dtype}")
    if x.device != device:
        raise OpInputError(f"{name}: expected device {device} (q's device), got {x.device}")
    if x.numel() == 1:
        return x.reshape(1, 1).expand(batch, heads_kv), 1.0
    if list(x.shape) != [batch, heads_kv]:
        raise OpInputError(
            f"{name}: expected shape [batch, heads_kv] = [{batch}, {heads_kv}] (or one "
            f"element), got {list(x.shape)}"
        )
    return x, 1.0


def resolve_scales(spec, dims: DecodeDims, q, k_descale, v_descale, q_descale):
    """The call's ``(q, scales)``: ``scales`` a :class:`KvScales` for an e4m3 cache
    (``dims.cache_dtype``), else None; ``q`` converted to the spec's dtype when it is e4m3,
    with ``q_descale`` folded into k's descale (module doc).  Raises :class:`OpInputError`
    for descales given with a cache of the spec's dtype, ``q_descale`` without an e4m3 q, or
    a descale of the wrong type, dtype, shape or device, or a Python number that is not finite
    and > 0.  Tensor values are checked by :func:`check_scale_values`."""
    fp8_q = FP8_CACHE is not None and q.dtype == FP8_CACHE
    if dims.cache_dtype is None:
        for name, x in (("k_descale", k_descale), ("v_descale", v_descale),
                        ("q_descale", q_descale)):  # fmt: skip
            if x is not None:
                raise OpInputError(
                    f"{name}: descales go with a {FP8_CACHE} cache; this cache's dtype is "
                    f"{TORCH_DTYPE[spec.dtype]}, so expected None, got {_what(x)}"
                )
        return q, None
    if q_descale is not None and not fp8_q:
        raise OpInputError(
            f"q_descale: only for a {FP8_CACHE} q; q has dtype {q.dtype}, so expected None, "
            f"got {_what(q_descale)}"
        )
    batch, hkv, dev = dims.batch, dims.heads_kv, q.device
    k, k_mul = _scale("k_descale", k_descale, batch, hkv, dev)
    v, v_mul = _scale("v_descale", v_descale, batch, hkv, dev)
    if fp8_q:
        qt, q_mul = _scale("q_descale", q_descale, batch, hkv, dev)
        q = q.to(TORCH_DTYPE[spec.dtype])  # exact: e4m3 values are fp16 / bf16 values
        if not is_normal_f32(k_mul * q_mul):
            raise OpInputError(
                f"q_descale, k_descale: their product (the folded descale of the logits) must "
                f"be a finite normal float32 in [{_F32_MIN_NORMAL:.7g}, {_F32_MAX:.7g}], got "
                f"{q_mul!r} * {k_mul!r} = {k_mul * q_mul!r}"
            )
        k_mul *= q_mul
        if qt is not None:
            k = qt if k is None else qt * k
        return q, KvScales(k, k_mul, v, v_mul, folded=True)
    return q, KvScales(k, k_mul, v, v_mul)


def check_scale_values(scales: KvScales | None) -> None:
    """Every descale tensor value finite and > 0 (reads them: a host sync on CUDA; the CPU
    path always, CUDA under the debug check).  :class:`OpInputError` naming the first bad
    entry."""
    if scales is None:
        return
    for name, t, mul in (("k_descale", scales.k, scales.k_mul), ("v_descale", scales.v,
                                                                  scales.v_mul)):  # fmt: skip
        if t is None:
            continue
        h = t.detach().to("cpu", torch.float64) * mul
        bad = ~(torch.isfinite(h) & (h >= _F32_MIN_NORMAL) & (h <= _F32_MAX))
        if bool(bad.any()):
            b, j = (int(i) for i in bad.nonzero()[0])
            folded = name == "k_descale" and scales.folded
            raise OpInputError(
                f"{'q_descale * ' if folded else ''}{name}: expected finite descales > 0, got "
                f"{float(h[b, j])!r} at [{b}, {j}]"
                + (" (k's descale times q's, as the kernel takes it)" if folded else "")
                + f" (a normal float32, in [{_F32_MIN_NORMAL:.7g}, {_F32_MAX:.7g}])"
            )


def _what(x) -> str:
    return f"a tensor of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)

