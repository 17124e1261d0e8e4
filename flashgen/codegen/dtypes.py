"""Element types of the kernels, as records: what a plan needs to know of a spec's dtype.

Planning reads the element size, C type and MMA operand type from here, never a literal
(``fp8_e4m3`` is one more entry once a kernel family supports it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    """One element type: ``name`` (the spec's ``dtype``), ``ctype`` (the CUDA element type),
    ``elem_bytes`` (bytes per element) and ``mma_t`` (the PTX operand type of ``mma`` /
    ``wgmma``, e.g. ``bf16``); ``out`` is the spec dtype of ``o`` (the input's, bf16 for
    fp8 inputs) and ``scaled`` says whether the kernels take per-``[B, Hkv]`` descales
    (``q_descale``, ``k_descale``, ``v_descale``: FlashAttention-3's FP8 interface)."""

    name: str
    ctype: str
    elem_bytes: int
    mma_t: str
    out: str = ""
    scaled: bool = False

    @property
    def out_ctype(self) -> str:
        """CUDA type of ``o``."""
        return DTYPES[self.out or self.name].ctype


#: Element types the kernels support, by spec dtype name.
DTYPES: dict[str, DType] = {
    "fp16": DType("fp16", "__half", 2, "f16"),
    "bf16": DType("bf16", "__nv_bfloat16", 2, "bf16"),
    "fp8_e4m3": DType("fp8_e4m3", "__nv_fp8_e4m3", 1, "e4m3", out="bf16", scaled=True),
}
#: CUDA element type per spec dtype (``DTYPES[name].ctype``).
CTYPE: dict[str, str] = {n: d.ctype for n, d in DTYPES.items()}


def is_scaled(name: str) -> bool:
    """Whether spec dtype ``name`` takes FlashAttention-3's descales (its record is ``scaled``:
    fp8_e4m3); False for an unknown name."""
    rec = DTYPES.get(name)
    return rec is not None and rec.scaled


def dtype(name: str) -> DType:
    """The record of spec dtype ``name``; ``ValueError`` naming the supported ones otherwise."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(
            f"dtype {name!r} is not supported yet by the kernels; supported: {', '.join(DTYPES)}"
        ) from None
