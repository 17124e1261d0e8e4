"""The op side of global positions: check a call's offsets and fill in the defaults.

:meth:`flashgen.ops.op.AttentionOp.attention` with ``q_offset``, ``kv_offset``,
``seqlen_q_global`` or ``seqlen_k_global`` runs the op of the spec's offsets form
(:func:`flashgen.frontend.offsets.offsets_spec`, ``op.offsets``) with the values
:func:`offsets_values` returns as its four i32 scalar params.
"""

from __future__ import annotations

import numbers

import torch

from flashgen.frontend.errors import OpInputError

_INT32_MAX = 2**31 - 1


def _symbolic(x) -> bool:
    return isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _int(name: str, value) -> int:
    if _symbolic(value):
        return value
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.device.type == "cpu":
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OpInputError(f"{name}: expected a Python int, got {value!r}")
    value = int(value)
    if not 0 <= value <= _INT32_MAX:
        raise OpInputError(f"{name}: expected an int in [0, 2**31 - 1], got {value}")
    return value


def offsets_values(q, k, q_offset=None, kv_offset=None, seqlen_q_global=None,
                   seqlen_k_global=None) -> dict:  # fmt: skip
    """The four offsets params of a padded call on q ``[B, Hq, Sq, D]`` and k ``[B, Hkv, Sk,
    D]`` (only their lengths are read): ``q_offset`` and ``kv_offset`` default to 0,
    ``seqlen_q_global`` to ``q_offset + Sq`` and ``seqlen_k_global`` to ``kv_offset + Sk``
    (the slice ends the sequence).

    Raises :class:`OpInputError` naming the argument unless each is an int in [0, 2**31 -
    1] and the local rows fit inside the global sequence (``q_offset + Sq <=
    seqlen_q_global``, ``kv_offset + Sk <= seqlen_k_global``).  Inputs that are not 4-D
    tensors are left to the op's own validation (lengths 0 here)."""
    sq = q.shape[2] if isinstance(q, torch.Tensor) and q.dim() == 4 else 0
    sk = k.shape[2] if isinstance(k, torch.Tensor) and k.dim() == 4 else 0
    q_offset = 0 if q_offset is None else _int("q_offset", q_offset)
    kv_offset = 0 if kv_offset is None else _int("kv_offset", kv_offset)
    out = {"q_offset": q_offset, "kv_offset": kv_offset}
    for name, glob, off, n, what in (
        ("seqlen_q_global", seqlen_q_global, q_offset, sq, "q"),
        ("seqlen_k_global", seqlen_k_global, kv_offset, sk, "k"),
    ):
        if glob is None:
            glob = off + n
        glob = _int(name, glob)
        if not any(_symbolic(x) for x in (glob, off, n)) and off + n > glob:
            offset = "q_offset" if what == "q" else "kv_offset"
            raise OpInputError(
                f"{name}: expected at least {offset} + {what}'s length = {off} + {n} = "
                f"{off + n} (the local rows must lie inside the global sequence), got {glob}"
            )
        out[name] = glob
    return out
