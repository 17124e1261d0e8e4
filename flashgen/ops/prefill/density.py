"""How many keys a mask keeps per query row, estimated on the host for one call's lengths and
scalar params: what the forward op reads to pick its Hopper tiles (a mask that keeps a few
key blocks per query block runs faster on narrower key blocks,
:data:`flashgen.families.tiles.HOPPER_SPARSE_TILES`).

The estimate evaluates the mask (the reference semantics,
:func:`flashgen.ops.cpu.reference.eval_expr`) on CPU at a few evenly spaced query rows and key
columns, batch 0 and head 0; it never affects a result, only which of two correct kernels runs.
Lengths are rounded to a quarter octave first (:func:`bucket`), so a loop over growing lengths
(decoding) evaluates a few masks per doubling (the forward op caches each bucket's answer).
Imports torch (CPU only): every tensor here is made on the CPU with an explicit dtype, whatever
``torch.set_default_device`` / ``set_default_dtype`` say (a CUDA default would sync the device
at every new length and break a CUDA-graph capture).
"""

from __future__ import annotations

import math

from flashgen.codegen.abi import needs_block_table
from flashgen.frontend import ir

#: Query rows and key columns sampled per estimate (at most).
ROWS, COLS = 16, 2048


def bucket(n: int) -> int:
    """``n`` rounded up to the next of 2^(k/4) (integers; exact below 8)."""
    if n <= 8:
        return n
    return math.ceil(2 ** (math.ceil(4 * math.log2(n)) / 4))


def mask_keep(spec: ir.Spec, rows, cols, seqlen_q: int, seqlen_k: int, scalars: tuple):
    """bool ``[len(rows), len(cols)]``: ``spec``'s mask (the reference semantics) at query
    rows ``rows`` and key columns ``cols`` (int64 CPU tensors) of (b, h) = (0, 0)."""
    import torch

    from flashgen.ops.cpu.reference import eval_expr

    cpu = torch.device("cpu")
    zero = torch.tensor(0, dtype=torch.int64, device=cpu)
    env = {
        "b": zero,
        "h": zero,
        "h_kv": zero,
        "q_idx": rows.view(-1, 1),
        "kv_idx": cols.view(1, -1),
        "seqlen_q": torch.tensor(seqlen_q, dtype=torch.int64, device=cpu),
        "seqlen_k": torch.tensor(seqlen_k, dtype=torch.int64, device=cpu),
        "__float__": torch.float32,
        "__device__": cpu,
    }
    for p, val in zip(spec.scalar_params, scalars, strict=True):
        dtype = torch.int64 if p.ty == ir.Ty.I32 else torch.float32  # as the reference
        env[p.name] = torch.tensor(val, dtype=dtype, device=cpu)
    return eval_expr(spec.mask, env).expand(len(rows), len(cols))


def mean_keys_per_row(spec: ir.Spec, seqlen_q: int, seqlen_k: int, scalars: tuple) -> float:
    """Mean number of keys ``spec``'s mask keeps per query row at these lengths (``scalars``:
    the scalar params' values in spec order), from ``ROWS x COLS`` sampled pairs at (b, h) =
    (0, 0); ``seqlen_k`` without a mask.  The mask must not read tensor params
    (``ValueError``: those masks get a block table instead)."""
    import torch

    if spec.mask is None or seqlen_q <= 0 or seqlen_k <= 0:
        return float(max(seqlen_k, 0))
    if needs_block_table(spec):
        raise ValueError(f"{spec.name}: a mask that reads tensors has no host estimate")

    def spread(n: int, count: int):  # float64 on the CPU: exact for any int32 length
        pts = torch.linspace(0, n - 1, min(count, n), dtype=torch.float64, device="cpu")
        return pts.round().to(torch.int64)

    rows, cols = spread(seqlen_q, ROWS), spread(seqlen_k, COLS)
    keep = mask_keep(spec, rows, cols, seqlen_q, seqlen_k, scalars)
    return keep.float().mean().item() * seqlen_k


def keys_per_row(spec: ir.Spec, seqlen_q: int, seqlen_k: int, scalars: tuple) -> float:
    """:func:`mean_keys_per_row` at the :func:`bucket` of each length: one answer per quarter
    octave (the forward op caches it per bucket, ``AttentionOp._sparse_call``)."""
    return mean_keys_per_row(spec, bucket(seqlen_q), bucket(seqlen_k), scalars)
