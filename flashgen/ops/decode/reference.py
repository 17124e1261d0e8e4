"""The decode op's references (:mod:`flashgen.ops.decode.op`): the cache append
(:func:`append_reference`), attention over the gathered cache (:func:`decode_reference`, the
op's CPU path and the tests' oracle), their ragged-Sq_new forms
(:func:`append_reference_ragged`, :func:`decode_reference_ragged`) and the exact merge of two
attention results (:func:`merge_attention`, FlashInfer's ``merge_state``).

:mod:`flashgen.ops.decode.op` re-exports the public names."""

from __future__ import annotations

import math

import torch

from flashgen.frontend import ir
from flashgen.frontend.errors import OpInputError
from flashgen.ops.decode.inputs import gather_cache
from flashgen.ops.validation import default_softmax_scale


def append_reference(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table=None) -> None:
    """Write ``k_new``/``v_new`` ``[B, Hkv, Sq, D]`` into the cache at ``cache_seqlens[b]`` (in
    place; rows past the request's pages dropped, as the kernel does)."""
    batch, _, sq, _ = k_new.shape
    lens = cache_seqlens.to("cpu", torch.int64).tolist()
    for b in range(batch):
        for s in range(sq):
            pos = lens[b] + s
            if pos < 0:
                continue
            if block_table is None:
                if pos >= k_cache.shape[2]:
                    continue
                k_cache[b, :, pos] = k_new[b, :, s]
                v_cache[b, :, pos] = v_new[b, :, s]
            else:
                ps = k_cache.shape[1]
                pi = pos // ps
                if pi >= block_table.shape[1]:
                    continue
                pg = int(block_table[b, pi])
                if not 0 <= pg < k_cache.shape[0]:
                    continue
                k_cache[pg, pos % ps] = k_new[b, :, s]
                v_cache[pg, pos % ps] = v_new[b, :, s]


def decode_reference(
    spec: ir.Spec,
    q,
    k_cache,
    v_cache,
    live_lens,
    block_table=None,
    *,
    softmax_scale: float | None = None,
    params: dict | None = None,
    compute_dtype=torch.float64,
    batch_offset: int = 0,
    k_descale=None,
    v_descale=None,
):
    """Attention of each request's queries over its first ``live_lens[b]`` cached keys, on
    the gathered keys (one request at a time, ``b`` its batch index, the mask's ``b`` being
    ``batch_offset + b``): by
    :func:`flashgen.ops.cpu.reference.attention_reference` for a float64 ``compute_dtype`` (the
    test oracle) or a low-precision one (the error bound's torch math), for float32 by the
    padded op's CPU path
    (:func:`flashgen.ops.cpu.attention.attention_blocked`, so the decode op on CPU equals the
    padded op on the gathered cache bitwise).  o ``[B, Hq, Sq, Dv]`` in ``compute_dtype``, lse
    ``[B, Hq, Sq]`` (float32, float64 for a float64 reference); no live key: o = 0,
    lse = -inf.  ``k_descale`` / ``v_descale``: float32 ``[B, Hkv]`` (an e4m3 cache,
    :mod:`flashgen.ops.decode.fp8`): request b's gathered keys and values are dequantized
    (``k_descale[b, h] * k``, in float32, float64 for the oracle) before the attention."""
    from flashgen.ops.cpu.attention import attention_blocked
    from flashgen.ops.cpu.reference import attention_reference

    batch, hq, sq, _ = q.shape
    dv = v_cache.shape[-1]
    lse_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    o = torch.zeros(batch, hq, sq, dv, dtype=compute_dtype, device=q.device)
    lse = torch.full((batch, hq, sq), -math.inf, dtype=lse_dtype, device=q.device)
    lens = [int(x) for x in torch.as_tensor(live_lens).tolist()]
    for b in range(batch):
        if lens[b] <= 0 or sq == 0:
            continue
        k, v = gather_cache(k_cache, v_cache, b, lens[b], block_table)
        if k_descale is not None:
            deq = torch.float64 if compute_dtype == torch.float64 else torch.float32
            k = k.to(deq) * k_descale[b].to(deq).view(-1, 1, 1)
            v = v.to(deq) * v_descale[b].to(deq).view(-1, 1, 1)
        if compute_dtype != torch.float32:  # the float64 oracle, or torch's low-precision math
            ob, lb = attention_reference(
                spec, q[b : b + 1], k[None], v[None], softmax_scale=softmax_scale,
                params=params, compute_dtype=compute_dtype, batch_offset=batch_offset + b,
            )  # fmt: skip
        else:
            if softmax_scale is None:
                softmax_scale = default_softmax_scale(spec)
            ob, lb = attention_blocked(
                spec, q[b : b + 1], k[None], v[None], softmax_scale=softmax_scale,
                params=params, batch_offset=batch_offset + b,
            )  # fmt: skip
        o[b] = ob[0]
        lse[b] = lb[0].to(lse_dtype)
    return o, lse


# ----------------------------------------------------------------------------- ragged Sq_new
def _request(k_cache, v_cache, block_table, b: int):
    """Request ``b``'s cache as a batch of one: ``(k, v, table)`` (dense: views of its rows,
    so writes land in the cache; paged: the whole cache and its table row)."""
    if block_table is None:
        return k_cache[b : b + 1], v_cache[b : b + 1], None
    return k_cache, v_cache, block_table[b : b + 1]


def append_reference_ragged(k_cache, v_cache, cache_seqlens, cu_seqlens_q, k_new, v_new,
                            block_table=None) -> None:  # fmt: skip
    """The ragged append: request ``b``'s rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`` of
    ``k_new``/``v_new`` ``[total_q, Hkv, D]`` written at ``cache_seqlens[b]`` (in place; as
    :func:`append_reference`, rows past the request's pages dropped)."""
    cu = cu_seqlens_q.to("cpu", torch.int64).tolist()
    for b in range(len(cu) - 1):
        q0, q1 = cu[b], cu[b + 1]
        if q1 <= q0:
            continue
        kc, vc, table = _request(k_cache, v_cache, block_table, b)
        append_reference(kc, vc, cache_seqlens[b : b + 1], k_new[q0:q1].permute(1, 0, 2)[None],
                         v_new[q0:q1].permute(1, 0, 2)[None], table)  # fmt: skip


def decode_reference_ragged(
    spec: ir.Spec,
    q,
    k_cache,
    v_cache,
    live_lens,
    cu_seqlens_q,
    block_table=None,
    *,
    softmax_scale: float | None = None,
    params: dict | None = None,
    compute_dtype=torch.float64,
    k_descale=None,
    v_descale=None,
):
    """:func:`decode_reference` of a ragged call: request ``b``'s queries are rows
    ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`` of q ``[total_q, Hq, D]`` (Sq_b of them:
    ``seqlen_q = Sq_b``, the last Sq_b of its ``live_lens[b]`` keys; the mask's ``b`` is
    ``b``, as in the kernel).  o ``[total_q, Hq, Dv]`` in ``compute_dtype``, lse ``[Hq,
    total_q]`` (float32; float64 for a float64 reference); no live key: o = 0, lse = -inf.
    ``k_descale`` / ``v_descale``: float32 ``[B, Hkv]`` of an e4m3 cache (request b's row
    dequantizes its keys and values, as :func:`decode_reference`)."""
    total_q, hq, _ = q.shape
    lse_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    o = torch.zeros(total_q, hq, v_cache.shape[-1], dtype=compute_dtype, device=q.device)
    lse = torch.full((hq, total_q), -math.inf, dtype=lse_dtype, device=q.device)
    cu = cu_seqlens_q.to("cpu", torch.int64).tolist()
    lens = [int(x) for x in torch.as_tensor(live_lens).tolist()]
    for b in range(len(cu) - 1):
        q0, q1 = cu[b], cu[b + 1]
        if q1 <= q0:
            continue
        kc, vc, table = _request(k_cache, v_cache, block_table, b)
        ob, lb = decode_reference(
            spec, q[q0:q1].permute(1, 0, 2)[None], kc, vc, lens[b : b + 1], table,
            softmax_scale=softmax_scale, params=params, compute_dtype=compute_dtype,
            batch_offset=b, k_descale=None if k_descale is None else k_descale[b : b + 1],
            v_descale=None if v_descale is None else v_descale[b : b + 1],
        )  # fmt: skip
        o[q0:q1] = ob[0].permute(1, 0, 2)
        lse[:, q0:q1] = lb[0]
    return o, lse


# ----------------------------------------------------------------------------- merge
def merge_attention(o_a, lse_a, o_b, lse_b):
    """Exact merge of two attention results over disjoint key sets (FlashInfer's
    ``merge_state``; the combine of split-KV): ``lse = log(exp(lse_a) + exp(lse_b))``,
    ``o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b``, computed in float32.

    ``o_*`` ``[..., Dv]`` (at least 1-D; float32, float16 or bfloat16, both the same),
    ``lse_*`` ``[...]`` float32 (natural log; -inf: no key, weight 0: that side's o is
    ignored, NaN in it included), one device.  Returns ``(o, lse)``: o in ``o_a``'s dtype (a
    caller that accumulates keeps float32), lse float32; both -inf gives o = 0, lse = -inf;
    a NaN lse gives NaN (the combine kernel's rule).  Raises :class:`OpInputError` for
    mismatched shapes, dtypes or devices, a 0-d o, and for an lse of +inf (no finite
    weights; read on CPU tensors, on CUDA under
    :func:`~flashgen.ops.validation.check_enabled`: a host sync).  A spec with a sink: merge
    the results over the keys alone (``apply_sink=False``) and join the sink once to the
    merged one (:func:`flashgen.apply_sink`)."""
    from flashgen.ops.validation import check_enabled

    for name, t in (("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b)):
        if not isinstance(t, torch.Tensor):
            raise OpInputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.device != o_a.device:
            raise OpInputError(f"{name}: expected device {o_a.device} (o_a's), got {t.device}")
    if o_a.dim() == 0:
        raise OpInputError("o_a: expected a tensor [..., Dv] (at least 1-D), got a 0-d tensor")
    if o_a.shape != o_b.shape:
        raise OpInputError(f"o_b: expected shape {list(o_a.shape)} (o_a's), got {list(o_b.shape)}")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(t.shape) != tuple(o_a.shape[:-1]):
            raise OpInputError(
                f"{name}: expected shape {list(o_a.shape[:-1])} (o's without its last dim), got "
                f"{list(t.shape)}"
            )
        if t.dtype != torch.float32:
            raise OpInputError(f"{name}: expected dtype torch.float32, got {t.dtype}")
    for name, t in (("o_a", o_a), ("o_b", o_b)):
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise OpInputError(
                f"{name}: expected dtype float32, float16 or bfloat16, got {t.dtype}"
            )
    if o_b.dtype != o_a.dtype:
        raise OpInputError(f"o_b: expected dtype {o_a.dtype} (o_a's), got {o_b.dtype}")
    if (o_a.device.type == "cpu" or check_enabled()) and not torch.compiler.is_compiling():
        for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
            if bool(torch.isposinf(t).any()):
                i = tuple(torch.isposinf(t).nonzero()[0].tolist())
                raise OpInputError(
                    f"{name}: expected values < +inf (a log-sum-exp: -inf for no key), got "
                    f"+inf at {list(i)}"
                )
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa = torch.exp(lse_a - m_safe)
    wb = torch.exp(lse_b - m_safe)
    total = wa + wb
    empty = total == 0
    lse = torch.where(empty, torch.full_like(m, -math.inf), m_safe + torch.log(total))
    inv = torch.where(empty, torch.zeros_like(total), 1.0 / torch.where(empty, 1.0, total))
    zero = torch.zeros((), dtype=torch.float32, device=o_a.device)
    # a side of weight 0 is ignored, not multiplied: 0 * NaN (its o unset) would be NaN
    ta = torch.where((wa > 0).unsqueeze(-1), (wa * inv).unsqueeze(-1) * o_a.float(), zero)
    tb = torch.where((wb > 0).unsqueeze(-1), (wb * inv).unsqueeze(-1) * o_b.float(), zero)
    nan = torch.isnan(total).unsqueeze(-1)  # a NaN lse still poisons the merge
    o = torch.where(nan, torch.full_like(ta, math.nan), ta + tb)
    return o.to(o_a.dtype), lse
