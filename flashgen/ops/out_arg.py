"""The ``out=`` argument of the attention op: a caller's tensor the forward writes o into.

:meth:`flashgen.ops.prefill.attention.AttentionOp.attention` and the mutating overload
``torch.ops.flashgen.<name>.out`` take ``out`` ``[B, Hq, Sq, Dv]`` of any layout whose last
dim is contiguous (``stride(-1) == 1``): the kernels index o through its strides
(``o_sb, o_sh, o_ss``, :mod:`flashgen.codegen.abi`), so ``(B, S, H, D)`` storage viewed with
``.transpose(1, 2)`` is written in place, without a copy.  :func:`check_out` holds it to the
contract, from metadata only (never the contents, no device sync).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from flashgen.frontend.errors import OpInputError
from flashgen.ops.validation import Dims, out_dtype


def expected_out_dtype(spec, q) -> torch.dtype:
    """The dtype o has for inputs like ``q``: float32 for float32 inputs (CPU), else the
    spec's output dtype (:func:`flashgen.ops.validation.out_dtype`)."""
    return torch.float32 if q.dtype == torch.float32 else out_dtype(spec)


def check_out(spec, out, q, dims: Dims, inputs: dict) -> None:
    """Check ``out`` for a call with inputs like ``q`` and problem sizes ``dims``: a tensor
    of shape ``[B, Hq, Sq, Dv]``, o's dtype (:func:`expected_out_dtype`), on q's device, with
    ``stride(-1) == 1`` (unless empty), no two elements at one address (no stride 0 over a
    dim of size > 1, nor any other layout whose elements may share addresses), not a lazily
    negated view, sharing no memory with any of ``inputs`` (name -> tensor: q, k, v,
    tensor params; not checked while Dynamo traces, where the op's own kernels check it), and
    not requiring grad (it is overwritten).

    Raises :class:`OpInputError` naming ``out``, the expected and the received value.
    """
    if not isinstance(out, torch.Tensor):
        raise OpInputError(
            f"out: expected a torch.Tensor [batch, heads_q, seqlen_q, head_dim_v], got "
            f"{type(out).__name__}"
        )
    want = [dims.batch, dims.heads_q, dims.seqlen_q, dims.head_dim_v]
    if list(out.shape) != want:
        raise OpInputError(
            f"out: expected shape {want} ([batch, heads_q, seqlen_q, head_dim_v], o's), got "
            f"{[int(n) for n in out.shape]}"
        )
    dtype = expected_out_dtype(spec, q)
    if out.dtype != dtype:
        raise OpInputError(
            f"out: expected dtype {dtype} (o's dtype for these inputs), got {out.dtype}"
        )
    if out.device != q.device:
        raise OpInputError(f"out: expected device {q.device} (q's device), got {out.device}")
    if out.numel() == 0:
        return
    if out.stride(-1) != 1:
        raise OpInputError(
            f"out: expected stride(-1) == 1 (head_dim contiguous), got strides "
            f"{list(out.stride())}"
        )
    if any(n > 1 and s == 0 for n, s in zip(out.shape, out.stride(), strict=True)):
        raise OpInputError(
            f"out: expected every element at its own address (no stride 0 over a dim of size > "
            f"1, e.g. from .expand()), got shape {list(out.shape)} with strides "
            f"{list(out.stride())}"
        )
    if out.requires_grad:
        raise OpInputError(
            "out: expected a tensor that does not require grad (the op overwrites it; the "
            "returned o carries the gradient), got one with requires_grad=True"
        )
    if torch.compiler.is_compiling():
        return  # Dynamo traces no storage offsets: the op's kernels check again, on fakes
    if out.is_neg() or out.is_conj():
        raise OpInputError(
            "out: expected a tensor whose memory holds its values, got a lazily negated or "
            "conjugated view (writing it would need a copy; pass .resolve_neg() / "
            ".resolve_conj() of it, or a fresh tensor)"
        )
    if _self_overlapping(out):
        raise OpInputError(
            f"out: expected every element at its own address (dims that, ordered by stride, "
            f"each step past the span of the smaller ones), got shape {list(out.shape)} with "
            f"strides {list(out.stride())}, whose elements share addresses"
        )
    for name, t in inputs.items():
        if isinstance(t, torch.Tensor) and overlaps(out, t):
            raise OpInputError(
                f"out: expected memory that no input shares, got a tensor overlapping {name} "
                f"(out spans bytes {_span(out)} of its storage, {name} {_span(t)})"
            )


def _self_overlapping(t: torch.Tensor) -> bool:
    """Whether ``t``'s layout may put two elements at one address: its dims of size > 1,
    ordered by stride, must each have a stride past the span ``sum((n - 1) * stride) + 1`` of
    the smaller ones (every layout torch makes without ``as_strided`` does; a conservative
    test, like :func:`overlaps`: interleavings that share no element are refused too).
    Metadata only; False for symbolic sizes."""
    if not all(type(x) is int for x in (*t.shape, *t.stride())):
        return False  # symbolic sizes (tracing): checked on the real tensors
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1)
    span = 0  # the largest offset the smaller dims reach
    for st, n in dims:
        if st <= span:
            return True
        span += (n - 1) * st
    return False


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """``[start, end)`` byte offsets of ``t``'s elements in its storage (the hull: strides
    are never negative in torch), None when empty."""
    if t.numel() == 0:
        return None
    last = sum((int(n) - 1) * int(s) for n, s in zip(t.shape, t.stride(), strict=True))
    size = t.element_size()
    start = int(t.storage_offset()) * size
    return start, start + (last + 1) * size


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte hulls of ``a`` and ``b`` intersect: in one storage, or in two
    storages whose device addresses are known (real tensors; fake and meta tensors are
    compared by storage only).  Conservative: interleaved tensors that share no element
    still count as overlapping.  Metadata only."""
    sa, sb = _span(a), _span(b)
    if sa is None or sb is None:
        return False
    try:
        store_a, store_b = a.untyped_storage(), b.untyped_storage()
        if store_a._cdata == store_b._cdata:
            base_a = base_b = 0
        elif a.device != b.device or is_fake(a) or is_fake(b) or a.is_meta or b.is_meta:
            return False
        else:
            base_a, base_b = store_a.data_ptr(), store_b.data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass)
        return False
    return base_a + sa[0] < base_b + sb[1] and base_b + sb[0] < base_a + sa[1]


def self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (an expanded, stride-0 tensor; a
    view whose strides interleave): True unless, with its dims of extent > 1 sorted by
    stride, each stride exceeds the span of the smaller ones (then every element has its
    own bytes).  Metadata only."""
    size = t.element_size()
    span = size  # bytes covered by one step of the dims below
    for stride, n in sorted((int(s) * size, int(n)) for n, s in zip(t.shape, t.stride(),
                                                                    strict=True) if n > 1):
        if stride < span:
            return True
        span += (n - 1) * stride
    return False


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have a byte in common: :func:`overlaps` of their hulls, then,
    for two views of one buffer with the same dims and byte strides (a combined KV buffer's
    ``kv[:, 0]`` and ``kv[:, 1]``, interleaved per page as FlashInfer lays it out), the exact
    answer: some ``sum_k c_k * stride_k`` (``c_k`` a difference of indices within both
    extents) equals the distance between their first bytes.  Conservative (True) for other
    layouts whose hulls meet.  Metadata only (real tensors' addresses)."""
    if not overlaps(a, b):
        return False
    ea, eb = a.element_size(), b.element_size()
    if a.dim() != b.dim() or [s * ea for s in a.stride()] != [s * eb for s in b.stride()]:
        return True
    if is_fake(a) or is_fake(b) or a.is_meta or b.is_meta:
        return True
    dims = [(int(s) * ea, int(na) - 1, int(nb) - 1)
            for s, na, nb in zip(a.stride(), a.shape, b.shape, strict=True)
            if max(na, nb) > 1]  # fmt: skip
    dims.append((1, ea - 1, eb - 1))  # the bytes of one element
    dims.sort(reverse=True)
    # below[k]: the most the dims after k add (positive: a's extents, negative: b's)
    below = [(0, 0)] * (len(dims) + 1)
    for k in range(len(dims) - 1, -1, -1):
        s, ha, hb = dims[k]
        below[k] = (below[k + 1][0] + ha * s, below[k + 1][1] + hb * s)
    budget = [4096]

    def reach(k: int, r: int) -> bool:
        if k == len(dims):
            return r == 0
        budget[0] -= 1
        if budget[0] < 0:
            return True  # too many ways to look at: conservative
        s, ha, hb = dims[k]
        pos, neg = below[k + 1]
        lo = max(-hb, -((pos - r) // s))  # r - c * s <= pos
        hi = min(ha, (r + neg) // s)  # r - c * s >= -neg
        return any(reach(k + 1, r - c * s) for c in range(lo, hi + 1))

    return reach(0, b.data_ptr() - a.data_ptr())
