"""The benchmark protocol shared by ``flashgen bench``, ``flashgen ab`` and ``flashgen tune``.

The FlashAttention papers' shapes: batch x seqlen = 16384 tokens, hidden 2048, so
``heads = 2048 / head_dim`` and ``batch = 16384 / seqlen`` (:func:`problem`).  FLOPs by the
papers' count (:func:`attention_flops`: ``4 * B * H * Sq * Sk * D``, halved when causal,
backward 2.5x forward); estimated DRAM bytes for the roofline (:func:`attention_bytes`);
input rotation so the L2 never holds a timed call's inputs (:func:`rotation_sets`,
:class:`Rotation`); the values a spec's params take in a benchmark (:func:`spec_params`) and
the (q, kv) pairs its mask keeps (:func:`kept_pairs`, for kept-pair TFLOP/s).

Plain Python and the checked IR at import time; torch is imported inside the functions that
make tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable
from pathlib import Path

from flashgen.frontend import ir

#: Tokens per batch (batch * seqlen) and model width of the papers' protocol.
TOKENS = 16384
HIDDEN = 2048
#: L2 size assumed when sizing the input rotation, in bytes (H200: 60 MB).
L2_BYTES = 60 * 10**6
#: Every implementation, in table order.
IMPLS = ("flashgen", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex", "standard")
#: The implementation timed next to an fp8 spec's flashgen op: the bf16 build of the same spec
#: (:func:`bf16_twin`), in the same run.  No peer in torch runs FP8 attention, so the fp8 /
#: bf16 ratio is the figure (issue 24).
FP8_PEER = "flashgen_bf16"
DIRECTIONS = ("fwd", "fwd_bwd")
#: Backward FLOPs relative to forward (papers' convention).
BWD_FACTOR = 2.5

SPEC_TEMPLATE = """\
name: {name}
description: bench template ({mask_desc}, head_dim {head_dim}, {dtype})
head_dim: {head_dim}
dtype: {dtype}
mask: {mask}
softmax_scale: auto
"""


def attention_flops(
    batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool, direction
) -> float:
    """Papers' FLOP count: ``4*B*H*Sq*Sk*D``, halved for causal, x3.5 for forward+backward."""
    f = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    if causal:
        f *= 0.5
    return f * (1.0 + BWD_FACTOR) if direction == "fwd_bwd" else f


def attention_bytes(
    batch: int,
    heads: int,
    seqlen: int,
    head_dim: int,
    elt: int,
    direction: str,
    impl: str,
    causal: bool = False,
) -> float:
    """Estimated DRAM traffic in bytes, for the roofline's arithmetic intensity.

    Fused kernels: the compulsory traffic (forward reads q, k, v and writes o and the
    fp32 lse; backward also reads o, dO, lse and writes dq, dk, dv).  ``standard``
    additionally writes and reads the ``seqlen^2`` score and probability matrices
    (forward: 4 passes of ``elt`` bytes per element, plus the mask pass when causal;
    backward about twice the forward's).
    """
    t = batch * heads * seqlen * head_dim * elt
    lse = batch * heads * seqlen * 4
    b = 4 * t + lse
    if direction == "fwd_bwd":
        b += 8 * t + lse
    if impl == "standard":
        sq = batch * heads * seqlen * seqlen
        fwd = sq * elt * 4 + (sq * (2 * elt + 1) if causal else 0)
        b += fwd * (3 if direction == "fwd_bwd" else 1)
    return float(b)


def problem(seqlen: int, head_dim: int) -> tuple[int, int]:
    """``(batch, heads)`` of the protocol: ``16384 / seqlen`` and ``2048 / head_dim``."""
    return max(1, TOKENS // seqlen), max(1, HIDDEN // head_dim)


def template_spec(head_dim: int, dtype: str, causal: bool) -> ir.Spec:
    """The plain (causal or unmasked) spec the sweep builds flashgen's kernels from."""
    from flashgen.frontend.spec import loads_spec

    kind = "causal" if causal else "full"
    text = SPEC_TEMPLATE.format(
        name=f"bench_{kind}_d{head_dim}_{dtype}",
        mask_desc=kind,
        mask="causal" if causal else "null",
        head_dim=head_dim,
        dtype=dtype,
    )
    return loads_spec(text, path=f"<bench {kind} d{head_dim} {dtype}>")


def is_fp8(spec: ir.Spec) -> bool:
    """Whether ``spec``'s dtype is an FP8 one (its op takes descales, runs forward only)."""
    return spec.dtype in ir.FP8_DTYPES


@functools.lru_cache(maxsize=64)
def bf16_twin(spec: ir.Spec) -> ir.Spec:
    """The bf16 build of fp8 spec ``spec``: the same variant (mask, score_mod, params, head
    dims, targets) with ``dtype: bf16``, named ``<name>_bf16`` (its own op and kernels); from
    the spec text when there is one (checked again), else by replacing the two fields."""
    name = f"{spec.name}_bf16"
    if spec.source:
        text = re.sub(r"(?m)^dtype:.*$", "dtype: bf16", spec.source, count=1)
        text = re.sub(r"(?m)^name:.*$", f"name: {name}", text, count=1)
        from flashgen.frontend.spec import loads_spec

        return loads_spec(text, path=f"<bf16 build of {spec.path}>")
    return dataclasses.replace(spec, name=name, dtype="bf16")


def spec_impls(spec: ir.Spec, impls) -> tuple[str, ...]:
    """The implementations that time ``spec`` out of ``impls``: all of them, except for an fp8
    spec: flashgen and :data:`FP8_PEER` (when ``impls`` has flashgen), since no torch
    implementation runs FP8 attention."""
    if not is_fp8(spec):
        return tuple(i for i in impls if i != FP8_PEER)
    return ("flashgen", FP8_PEER) if "flashgen" in impls or FP8_PEER in impls else ()


def spec_directions(spec: ir.Spec, directions) -> tuple[str, ...]:
    """``directions`` ``spec`` is timed in: an fp8 spec's op is forward only."""
    return tuple(d for d in directions if d == "fwd" or not is_fp8(spec))


def shipped_spec_paths() -> list[Path]:
    """The shipped specs with a prefill op (:func:`flashgen.frontend.shipped.shipped_spec_paths`;
    a ``v_from_k`` spec is decode only: ``flashgen.bench.decode`` times it)."""
    from flashgen.frontend.shipped import shipped_spec_paths as paths
    from flashgen.frontend.spec import load_spec

    return [p for p in paths() if not load_spec(p).v_from_k]


def parse_spec_item(item: str) -> tuple[str, dict]:
    """``spec`` or ``spec:p=v,q=w`` (a shipped spec's name and scalar param overrides, as the
    A/B tools take them) -> ``(name, {p: v, ...})``; a value with a ``.`` is a float, else
    an int."""
    name, _, rest = item.partition(":")
    over = {}
    for kv in filter(None, rest.split(",")):
        k, _, v = kv.partition("=")
        over[k] = float(v) if "." in v else int(v)
    return name, over


def rotation_sets(bytes_per_set: int, l2_bytes: int = L2_BYTES) -> int:
    """Input sets to rotate: ``max(2, ceil(2 * l2_bytes / bytes_per_set))``."""
    return max(2, math.ceil(2 * l2_bytes / max(1, bytes_per_set)))


class Rotation:
    """Cycles through ``n`` input sets made by ``make()``; ``next()`` returns the next one."""

    def __init__(self, make: Callable[[], tuple], n: int):
        self.sets = [make() for _ in range(n)]
        self.i = 0

    def next(self) -> tuple:
        s = self.sets[self.i]
        self.i = (self.i + 1) % len(self.sets)
        return s


def kept_pairs(
    spec, batch: int, heads: int, seqlen: int, params: dict, device, heads_kv: int | None = None
) -> int:
    """Number of (b, h, q, kv) pairs ``spec``'s mask keeps at ``seqlen_q = seqlen_k =
    seqlen`` with ``params``, evaluated from the mask IR
    (:func:`flashgen.ops.cpu.reference.eval_mask`) over the batch rows / heads it reads, one batch
    row at a time (``seqlen^2`` bytes per head of memory on ``device``; row ``b0`` sees ``b = b0``
    and the whole params, so a mask that reads ``b`` directly or through a param of any shape counts
    each row's own pairs). ``batch * heads * seqlen^2`` without a mask.  ``heads_kv``: the KV heads
    a mask reading ``h_kv`` sees (default ``heads``, no GQA)."""
    from flashgen.codegen.abi import block_table_dims
    from flashgen.ops.cpu.reference import eval_mask

    if spec.mask is None:
        return batch * heads * seqlen * seqlen
    per_b, per_h = block_table_dims(spec)
    tb, th = (batch if per_b else 1), (heads if per_h else 1)
    total = 0
    for b0 in range(tb):  # one batch row at a time keeps memory at seqlen^2 bytes per head
        keep = eval_mask(
            spec, batch=1, heads_q=th, seqlen_q=seqlen, seqlen_k=seqlen, params=params,
            device=device, batch_offset=b0, heads_kv=heads_kv if per_h and heads_kv else th,
        )  # fmt: skip
        total += int(keep.sum())
    return total * (batch // tb) * (heads // th)


#: Mean document length (tokens) of the document ids the benchmark gives an int tensor param
#: along a sequence axis (document_mask's doc_q / doc_kv).
DOC_LEN = 1024


def doc_ids(batch: int, seqlen: int, mean_len: int, gen):
    """int32 ``[batch, seqlen]``: each row cut into documents of random lengths (uniform in
    [1, 2 * mean_len]), ids 0, 1, 2, ... in order (packed sequences, as document masking
    sees them).  ``gen``: a CPU ``torch.Generator``."""
    import torch

    rows = []
    for _ in range(batch):
        ids, pos, d = torch.empty(seqlen, dtype=torch.int32), 0, 0
        while pos < seqlen:
            n = int(torch.randint(1, 2 * mean_len + 1, (1,), generator=gen))
            ids[pos : pos + n] = d
            pos, d = pos + n, d + 1
        rows.append(ids)
    return torch.stack(rows)


def trained_params(spec: ir.Spec) -> tuple[str, ...]:
    """The params ``flashgen ab --param-grads`` trains: the tensor params among those whose
    gradients the backward kernels accumulate (:func:`flashgen.families.registry.grad_params`:
    f32 params the score_mod reads), spec order."""
    from flashgen.families.registry import grad_params

    return tuple(n for n in grad_params(spec) if spec.param(n).kind == "tensor")


def spec_params(
    spec: ir.Spec,
    heads: int,
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    device,
    doc_len: int = DOC_LEN,
    heads_kv: int | None = None,
):
    """Values for a spec's params in the benchmark: scalar defaults; ``slopes`` the ALiBi
    slopes ``2^(-8 (h+1) / H)``; other f32 tensors uniform [0, 1); i32 tensors along a
    sequence axis (``[batch, seqlen_*]`` or ``[seqlen_*]``) document ids of mean length
    ``doc_len`` (:func:`doc_ids`, one set shared by every such param, so ``doc_q`` and
    ``doc_kv`` agree where ``seqlen_q == seqlen_k``); other i32 tensors uniform [0, 16).
    ``heads_kv``: the KV heads a ``num_heads_kv`` axis has (default ``heads``, no GQA)."""
    import torch

    out: dict = {}
    sym = {
        "batch": batch,
        "num_heads": heads,
        "num_heads_kv": heads_kv or heads,
        "seqlen_q": seqlen_q,
        "seqlen_k": seqlen_k,
    }
    g = torch.Generator(device="cpu").manual_seed(0)
    docs = None
    for p in spec.tensor_params:
        shape = [d if isinstance(d, int) else sym[d] for d in p.shape]
        if p.ty == ir.Ty.F32:
            if p.name == "slopes" and len(shape) == 1:
                n = shape[0]
                t = torch.tensor([2.0 ** (-8.0 * (i + 1) / n) for i in range(n)])
            else:
                t = torch.rand(shape, generator=g)
        elif p.shape[-1] in ("seqlen_q", "seqlen_k") and (
            len(p.shape) == 1 or (len(p.shape) == 2 and p.shape[0] == "batch")
        ):
            if docs is None:
                docs = doc_ids(batch, max(seqlen_q, seqlen_k), doc_len, g)
            t = docs[:, : shape[-1]] if len(shape) == 2 else docs[0, : shape[-1]]
        else:
            t = torch.randint(0, 16, shape, generator=g, dtype=torch.int32)
        out[p.name] = t.contiguous().to(device)
    return out
