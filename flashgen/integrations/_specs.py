"""Specs built on demand for the integrations (FlashAttention's calls, transformers, SDPA).

Each distinct *shape* of a call -- head dims, dtype, causal alignment, which window bounds,
soft-capping, ALiBi -- gets one spec, written from a small YAML template in the DSL the
shipped specs use (``specs/mistral_swa.yaml`` for windows, ``specs/gemma2_softcap.yaml``
for soft-capping, ``specs/alibi.yaml`` for ALiBi), checked by :func:`flashgen.loads_spec`
and registered once per process (:func:`op_for`).  Window sizes, the softcap value and the
slopes are the op's params, so changing them compiles nothing new.
"""

from __future__ import annotations

import math
import numbers
import threading
from dataclasses import dataclass

from flashgen.frontend import ir
from flashgen.frontend.errors import OpInputError

#: spec dtype names of the torch dtypes the kernels take
SPEC_DTYPES = {"float16": "fp16", "bfloat16": "bf16"}

#: relative position of key ``kv_idx`` to query ``q_idx``, bottom-right aligned
#: (``>= 0``: the key is at or before the query's diagonal)
_DIST = "q_idx + seqlen_k - seqlen_q - kv_idx"


def check_softcap(softcap) -> float | None:
    """The one softcap rule of every integration (issue 38, item 10): None or 0 means off
    (FlashAttention's documented convention; returns None), a finite positive number is the
    cap (returned as a float); NaN, +-inf, a negative value or a non-number raises
    :class:`OpInputError` naming ``softcap`` (NaN used to pass as off, and transformers'
    ``softcap=0.0`` capped every score at 0)."""
    if softcap is None:
        return None
    if (
        isinstance(softcap, bool)
        or not isinstance(softcap, numbers.Real)
        or not math.isfinite(softcap)
        or softcap < 0
    ):
        raise OpInputError(
            f"softcap: expected None or a finite number >= 0 (0 = off), got {softcap!r}"
        )
    return float(softcap) if softcap > 0 else None


@dataclass(frozen=True)
class SpecKey:
    """What a call needs from its spec.

    ``causal``: ``"none"``, ``"bottom_right"`` (FlashAttention's, the DSL's ``causal``) or
    ``"top_left"`` (``torch.nn.functional.scaled_dot_product_attention``'s ``is_causal``).
    ``window_left`` / ``window_right``: a finite left / right window bound (the params
    ``window_left`` / ``window_right``, FlashAttention's ``window_size``).  ``softcap``: the
    param ``softcap``; ``alibi``: the tensor param ``slopes [batch, num_heads]``."""

    head_dim: int
    head_dim_v: int
    dtype: str  # "fp16" | "bf16"
    causal: str = "none"
    window_left: bool = False
    window_right: bool = False
    softcap: bool = False
    alibi: bool = False

    @property
    def name(self) -> str:
        dv = "" if self.head_dim_v == self.head_dim else f"v{self.head_dim_v}"
        parts = [f"fgi_d{self.head_dim}{dv}", self.dtype, {"none": "full", "bottom_right": "causal",
                 "top_left": "causaltl"}[self.causal]]  # fmt: skip
        flags = (("wl", self.window_left), ("wr", self.window_right), ("softcap", self.softcap),
                 ("alibi", self.alibi))  # fmt: skip
        parts += [n for n, on in flags if on]
        return "_".join(parts)

    def text(self) -> str:
        """The spec's YAML."""
        mask = []
        if self.causal == "bottom_right":
            mask.append("causal")
        elif self.causal == "top_left":
            mask.append("kv_idx <= q_idx")
        if self.window_left:
            mask.append(f"{_DIST} <= window_left")
        if self.window_right:
            mask.append(f"0 - ({_DIST}) <= window_right")
        score = "score"
        if self.softcap:
            score = "softcap * tanh(score / softcap)"
        if self.alibi:
            score = f"{score} - slopes[b, h] * abs({_DIST})"
        params = []
        if self.window_left:
            params.append("  window_left: {type: i32, default: 0, min: 0}")
        if self.window_right:
            params.append("  window_right: {type: i32, default: 0, min: 0}")
        if self.softcap:
            params.append("  softcap: {type: f32, default: 1.0, above: 0}")
        if self.alibi:
            params.append("  slopes: {type: f32, shape: [batch, num_heads]}")
        lines = [
            f"name: {self.name}",
            "description: built by flashgen.integrations for a call of this shape",
            f"head_dim: {self.head_dim}",
            f"head_dim_v: {self.head_dim_v}",
            f"dtype: {self.dtype}",
            f"mask: '{' && '.join(mask)}'" if mask else "mask: null",
        ]
        if score != "score":
            lines.append(f"score_mod: '{score}'")
        if params:
            lines += ["params:", *params]
        return "\n".join(lines) + "\n"


_OPS: dict[SpecKey, object] = {}
_LOCK = threading.Lock()


def check_head_dims(head_dim: int, head_dim_v: int, arg: str = "q") -> None:
    """:class:`OpInputError` unless both head dims are ones the kernels have."""
    for name, d in ((arg, head_dim), ("v", head_dim_v)):
        if d not in ir.SUPPORTED_HEAD_DIMS:
            supported = ", ".join(map(str, ir.SUPPORTED_HEAD_DIMS))
            raise OpInputError(
                f"{name}: expected head_dim (shape[-1]) in {supported} (flashgen's kernels), "
                f"got {d}"
            )


def spec_dtype(dtype, arg: str = "q", device_type: str = "cuda") -> str:
    """The spec dtype for inputs of torch ``dtype``: fp16 / bf16; float32 on CPU builds a
    bf16 spec (the CPU op computes float32 inputs in float32).  Else :class:`OpInputError`."""
    name = str(dtype).removeprefix("torch.")
    if name in SPEC_DTYPES:
        return SPEC_DTYPES[name]
    if name == "float32" and device_type == "cpu":
        return "bf16"
    raise OpInputError(
        f"{arg}: expected dtype torch.float16 or torch.bfloat16 (float32 also on CPU), "
        f"got {dtype}"
    )


def op_for(key: SpecKey):
    """The :class:`~flashgen.ops.op.AttentionOp` of ``key``, built and registered on first
    use (``flashgen.loads_spec`` + :func:`flashgen.ops.op.build_op`), cached per process."""
    op = _OPS.get(key)
    if op is None:
        with _LOCK:
            op = _OPS.get(key)
            if op is None:
                from flashgen.frontend.spec import loads_spec
                from flashgen.ops.op import build_op

                op = build_op(loads_spec(key.text(), path=f"<flashgen.integrations {key.name}>"))
                _OPS[key] = op
    return op
