"""Blocked CPU attention: the CPU op's forward and backward at real sizes.

The float64 materialized reference (:mod:`flashgen.ops.cpu.reference`) stays the test oracle;
this module is what the op runs on CPU tensors.  Query rows are independent, so the
computation is query-chunked: for each chunk of ``block_q`` query rows it builds the
``[B, Hq, block_q, K]`` logits for the key range ``K`` the mask may keep, applies the
spec's ``score_mod`` and ``mask`` (the same IR evaluator as the reference, with the index
tensors restricted to the chunk), and a max-subtracted softmax (Milakov & Gimelshein
2018's safe softmax; lse = max + log(sum)).  Memory is O(B * Hq * block_q * Sk) instead of
O(B * Hq * Sq * Sk); ``block_q`` shrinks as the problem grows (:func:`query_block`).

The key range of each chunk comes from the mask's interval analysis
(:func:`flashgen.analysis.maskinfo.classify`, the rules the kernels' tile classifier
uses): key blocks that are EMPTY for every row of the chunk are never touched (causal
attention computes about half the logits, a sliding window only its band), and when every
live block is FULL the mask is not evaluated.  Masks that read ``b``, ``h``, ``h_kv`` or
tensors (their class depends on the batch entry or head) use all keys.

A spec without a ``score_mod`` runs each chunk through torch's fused CPU attention kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``, the kernel behind SDPA on the CPU,
which returns the lse too), with the chunk's evaluated mask as an additive ``-inf`` bias
only when some live block is not FULL; its backward likewise runs the fused backward kernel
per chunk against the saved ``o`` and ``lse``.  A ``score_mod`` (evaluated on the logits),
``head_dim_v != head_dim``, a ``dlse`` or a backward without the saved outputs take the
matmul path below.

GQA is computed without expanding K and V: the ``Hq // Hkv`` query heads of a group are
stacked along the row axis of one matmul against their shared KV head.

The backward recomputes each chunk's forward under autograd (FlashAttention's
recomputation, chunk by chunk) and back-propagates ``dout`` (and ``dlse``) through it, so it
is O(chunk) in memory too; dk and dv are accumulated over chunks.

Param gradients: for each f32 param that requires grad, the backward also returns
``dparam[idx] = sum over (b, h, q_idx, kv_idx) of dS * d score_mod / d param[idx]``, with
dS the gradient of each chunk's modified logits (taken under autograd) and the partial
derivative from :func:`flashgen.analysis.derive.param_grad_terms` (the symbolic derivative
the kernels use too), evaluated on the chunk and scattered to the indexed elements.

Inputs: float32, float16 or bfloat16 (computed in float32; outputs in the input dtype), or
float64 (computed in float64 throughout: ``torch.autograd.gradcheck`` runs on the op);
``lse`` is float32 (float64 for float64 inputs).  A row with nothing to attend to gives
o = 0, lse = -inf and zero gradients.  Tensor-param reads outside their shape at a kept
pair raise ``IndexError`` like the reference.
"""

from __future__ import annotations

import math

import torch

from flashgen.analysis.derive import param_grad_terms
from flashgen.analysis.maskinfo import TileClass, classify
from flashgen.frontend import ir
from flashgen.ops.cpu.reference import _as, _check_bounds, _env, eval_expr

#: elements of one chunk's logits (B * Hq * block_q * keys) the chunk size aims for
_CHUNK_ELEMS = 1 << 21
#: key-block width of the per-chunk interval analysis
_KEY_BLOCK = 128
_PARAM_DTYPE = {ir.Ty.F32: torch.float32, ir.Ty.I32: torch.int32}


#: The dtype of torch's fused CPU kernels' chunks here: the float32 compute of inputs that are
#: not float64 (float64 inputs, for gradcheck, take the blocked path).
_FUSED_DTYPE = torch.float32


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the CPU op computes in for inputs of ``dtype``: float64 for float64, else
    float32 (also the dtype of its lse)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def cpu_params(spec: ir.Spec, scalars, tensors: dict, dtype: torch.dtype) -> dict:
    """The ``params`` of :func:`attention_blocked` for inputs of ``dtype``: scalar values (in
    spec order) by name, and tensor params (by name) as float32 / int32, f32 ones as float64
    for float64 inputs."""
    params = dict(zip((p.name for p in spec.scalar_params), scalars, strict=True))
    for n, t in tensors.items():
        ty = spec.param(n).ty
        want = compute_dtype(dtype) if ty == ir.Ty.F32 else _PARAM_DTYPE[ty]
        params[n] = t.to(want)
    return params


def query_block(batch: int, heads: int, keys: int) -> int:
    """Query rows per chunk: about :data:`_CHUNK_ELEMS` logits per chunk, 16 to 512 rows."""
    per_row = max(1, batch * heads * max(keys, 1))
    return int(min(512, max(16, _CHUNK_ELEMS // per_row)))


def _reads(spec: ir.Spec) -> set[str]:
    """Names (variables and indexed tensors) the mask reads."""
    if spec.mask is None:
        return set()
    names = set()
    for e in ir.walk(spec.mask):
        if isinstance(e, (ir.Var, ir.Index)):
            names.add(e.name)
    return names


def _key_ranges(spec: ir.Spec, sq: int, sk: int, block_q: int, scalars: dict, b_offset: int):
    """Per query chunk: (q0, q1, k0, k1, full) with keys [k0, k1) covering every key the
    mask may keep for rows [q0, q1) and ``full`` when the mask keeps all of them."""
    reads = _reads(spec)
    tensor_names = {p.name for p in spec.tensor_params}
    exact = spec.mask is not None and not (reads & ({"b", "h", "h_kv"} | tensor_names))
    out = []
    for q0 in range(0, sq, block_q):
        q1 = min(q0 + block_q, sq)
        if spec.mask is None:
            out.append((q0, q1, 0, sk, True))
            continue
        if not exact:
            out.append((q0, q1, 0, sk, False))
            continue
        classes = [
            classify(
                spec, (q0, q1 - 1), (k0, min(k0 + _KEY_BLOCK, sk) - 1), b=b_offset, h=0,
                seqlen_q=sq, seqlen_k=sk, params=scalars,
            )
            for k0 in range(0, sk, _KEY_BLOCK)
        ]  # fmt: skip
        live = [j for j, c in enumerate(classes) if c != TileClass.EMPTY]
        if not live:
            out.append((q0, q1, 0, 0, True))
            continue
        first, last = live[0], live[-1]
        # EMPTY blocks between the first and the last live one are computed (and masked) too
        full = all(c == TileClass.FULL for c in classes[first : last + 1])
        out.append((q0, q1, first * _KEY_BLOCK, min((last + 1) * _KEY_BLOCK, sk), full))
    return out


def _chunk(spec, env, qs, k, v, q0, q1, k0, k1, full, softmax_scale, heads_q, kv_base=0):
    """o [B, Hq, C, Dv], lse [B, Hq, C] and the logits (the scaled ``score``, and the
    score_mod's result before the mask: [B, Hq, C, K] each, both None without grad mode) of
    query rows [q0, q1) against keys [k0, k1), in k's
    dtype (float32 or float64).  ``qs``: the chunk's queries as [B, Hkv, G * C, D] (G query
    heads per KV head stacked on rows); ``k``/``v``: [B, Hkv, Sk, D], whose key 0 is
    position ``kv_base`` (the backward passes the live keys alone).  Differentiable when
    grad mode is on; without it the softmax runs in place and o is normalized after the
    P V product (fewer passes over the chunk's logits)."""
    b, hkv = k.shape[0], k.shape[1]
    c, n = q1 - q0, k1 - k0
    grad = torch.is_grad_enabled()
    kc, vc = k[:, :, k0:k1], v[:, :, k0:k1]
    if spec.score_mod is None and not grad:  # scale folded into q: [C, D] instead of [C, K]
        s = torch.matmul(qs * softmax_scale, kc.transpose(-1, -2)).view(b, heads_q, c, n)
    else:
        s = torch.matmul(qs, kc.transpose(-1, -2)).view(b, heads_q, c, n) * softmax_scale
    dev = k.device
    env["q_idx"] = torch.arange(q0, q1, device=dev, dtype=torch.int64).view(1, 1, c, 1)
    env["kv_idx"] = torch.arange(
        kv_base + k0, kv_base + k1, device=dev, dtype=torch.int64
    ).view(1, 1, 1, n)
    env["__oob__"] = []
    raw = s.detach() if grad else None
    if spec.score_mod is not None:
        env["score"] = s
        s = eval_expr(spec.score_mod, env).to(k.dtype).expand_as(s)
        env.pop("score")
        if not grad:
            s = s.contiguous()
    modded = s if grad else None
    keep = None
    if spec.mask is not None and not full:
        keep = eval_expr(spec.mask, env)
        s = s.masked_fill_(~keep, -math.inf) if not grad else s.masked_fill(~keep, -math.inf)
    if env["__oob__"]:
        _check_bounds(env, None if keep is None else keep.expand_as(s))
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = s.sub_(m).exp_() if not grad else torch.exp(s - m)
    den = p.sum(dim=-1, keepdim=True)
    empty = den == 0
    lse = torch.where(empty, torch.full_like(den, -math.inf), m + torch.log(den)).squeeze(-1)
    den = torch.where(empty, torch.ones_like(den), den)
    if grad:
        p = p / den
    o = torch.matmul(p.reshape(b, hkv, -1, n), vc).view(b, heads_q, c, v.shape[-1])
    if not grad:
        o.div_(den)
    return o, lse, raw, modded


_FUSED = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FUSED_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _fused(spec: ir.Spec) -> bool:
    """Whether ``spec``'s chunks run through torch's fused CPU kernels (module docstring):
    no ``score_mod`` and ``head_dim_v == head_dim`` (the kernels' one head size)."""
    return _FUSED is not None and spec.score_mod is None and spec.head_dim == spec.head_dim_v


def _chunk_bias(spec, env, b, hq, hkv, q0, q1, k0, k1, full):
    """The additive mask of query rows [q0, q1) against keys [k0, k1), stacked like
    :func:`_stack_queries` ([B or 1, Hkv or 1, G * C, N] float32: 0 kept, -inf dropped; the
    kernel broadcasts it), and a [B or 1, Hq or 1, C] bool of the rows that keep no key;
    (None, None) when ``full``.
    Refuses a tensor-param read out of bounds at a kept pair as the reference does."""
    if full:
        return None, None
    c, n = q1 - q0, k1 - k0
    dev = env["q_idx"].device
    env["q_idx"] = torch.arange(q0, q1, device=dev, dtype=torch.int64).view(1, 1, c, 1)
    env["kv_idx"] = torch.arange(k0, k1, device=dev, dtype=torch.int64).view(1, 1, 1, n)
    env["__oob__"] = []
    keep = eval_expr(spec.mask, env)
    keep = keep.expand(keep.shape[0], keep.shape[1], c, n)
    if env["__oob__"]:
        _check_bounds(env, keep.expand(b, hq, c, n))
    dead = ~keep.any(dim=-1)
    if keep.shape[1] == 1:  # every head alike: the group's stacked rows repeat it
        keep = keep.repeat(1, 1, hq // hkv, 1) if hq != hkv else keep
    else:
        keep = keep.expand(keep.shape[0], hq, c, n).reshape(keep.shape[0], hkv, -1, n)
    zero = torch.zeros((), dtype=_FUSED_DTYPE, device=dev)
    return torch.where(keep, zero, torch.full((), -math.inf, dtype=_FUSED_DTYPE, device=dev)), dead


def _fused_forward(spec, env, q, kf, vf, ranges, softmax_scale, o, lse):
    """:func:`attention_blocked`'s chunks through the fused kernel, into ``o`` and ``lse``
    (one call per chunk: splitting off its FULL keys and merging costs more on 2 cores)."""
    b, hq, _, _ = q.shape
    hkv, dv = kf.shape[1], vf.shape[-1]
    for q0, q1, k0, k1, full in ranges:
        if k1 <= k0:
            continue
        c = q1 - q0
        bias, dead = _chunk_bias(spec, env, b, hq, hkv, q0, q1, k0, k1, full)
        qs = _stack_queries(q, q0, q1, hkv)
        oc, lc = _FUSED(qs, kf[:, :, k0:k1], vf[:, :, k0:k1], 0.0, False, attn_mask=bias,
                        scale=softmax_scale)  # fmt: skip
        lc = lc.reshape(b, hq, c)
        if dead is not None and bool(dead.any()):  # the kernel gives lse 0 there
            lc = lc.masked_fill(dead, -math.inf)
        o[:, :, q0:q1] = oc.reshape(b, hq, c, dv)
        lse[:, :, q0:q1] = lc


def _fused_backward(spec, env, dout, q, kf, vf, ranges, softmax_scale, o, lse, dq, dk, dv):
    """:func:`attention_blocked_backward`'s chunks through the fused backward kernel against
    the saved ``o`` and ``lse`` (rows whose lse is -inf keep no key: zero gradients)."""
    b, hq, _, d = q.shape
    hkv = kf.shape[1]
    for q0, q1, k0, k1, full in ranges:
        if k1 <= k0:
            continue
        c = q1 - q0
        bias, _ = _chunk_bias(spec, env, b, hq, hkv, q0, q1, k0, k1, full)
        ls = lse[:, :, q0:q1].to(_FUSED_DTYPE)
        ls = torch.where(torch.isfinite(ls), ls, torch.full_like(ls, math.inf))  # P = 0 there
        qs = _stack_queries(q, q0, q1, hkv)
        g = _stack_queries(dout, q0, q1, hkv)
        os_ = _stack_queries(o, q0, q1, hkv)
        gq, gk, gv = _FUSED_BWD(g, qs, kf[:, :, k0:k1], vf[:, :, k0:k1], os_,
                                ls.reshape(b, hkv, -1), 0.0, False, attn_mask=bias,
                                scale=softmax_scale)  # fmt: skip
        dq[:, :, q0:q1] = gq.reshape(b, hq, c, d)
        dk[:, :, k0:k1] += gk
        dv[:, :, k0:k1] += gv


def _stack_queries(q, q0, q1, hkv):
    """q[:, :, q0:q1] as [B, Hkv, G * C, D] (compute dtype): a group's query heads on rows."""
    b, hq, _, d = q.shape
    return q[:, :, q0:q1].to(compute_dtype(q.dtype)).reshape(b, hkv, (hq // hkv) * (q1 - q0), d)


def _setup(spec, q, k, params, batch_offset):
    b, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    env = _env(spec, b, hq, sq, sk, dict(params or {}), q.device, compute_dtype(q.dtype),
               batch_offset, Hkv=hkv)  # fmt: skip
    scalars = {p.name: params.get(p.name, p.default) for p in spec.scalar_params}
    rows = query_block(b, hq, sk)
    per_head = {"b", "h", "h_kv"} | {p.name for p in spec.tensor_params}
    if _fused(spec) and not _reads(spec) & per_head:  # the fused kernel's memory is O(its
        rows = query_block(1, 1, sk)  # blocks): a chunk costs its [C, N] mask alone
    ranges = _key_ranges(spec, sq, sk, rows, scalars, batch_offset)
    return env, ranges


def attention_blocked(
    spec: ir.Spec, q, k, v, *, softmax_scale: float, params: dict | None = None,
    batch_offset: int = 0,
):  # fmt: skip
    """Forward of ``spec`` on CPU tensors, query-chunked (module docstring).

    q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] (any strides; Hq % Hkv == 0),
    float32 / float16 / bfloat16.  ``params``: scalar values and tensor params by name
    (scalars default to the spec's).  ``batch_offset``: the ``b`` of the first batch entry
    (varlen).  Returns o [B, Hq, Sq, Dv] in q's dtype and lse [B, Hq, Sq] (natural log) in
    :func:`compute_dtype`.  Not differentiable itself: the op's autograd uses
    :func:`attention_blocked_backward`.  Raises ``IndexError`` as the reference does.
    """
    params = dict(params or {})
    b, hq, sq, _ = q.shape
    hkv = k.shape[1]
    cdt = compute_dtype(q.dtype)
    o = torch.zeros((b, hq, sq, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.full((b, hq, sq), -math.inf, dtype=cdt, device=q.device)
    if o.numel() == 0 or k.shape[2] == 0:
        return o, lse
    env, ranges = _setup(spec, q, k, params, batch_offset)
    with torch.no_grad():
        kf, vf = k.to(cdt), v.to(cdt)
        if _fused(spec) and cdt == _FUSED_DTYPE:
            _fused_forward(spec, env, q, kf, vf, ranges, softmax_scale, o, lse)
            return o, lse
        for q0, q1, k0, k1, full in ranges:
            if k1 <= k0:
                continue
            qs = _stack_queries(q, q0, q1, hkv)
            oc, lc, _, _ = _chunk(spec, env, qs, kf, vf, q0, q1, k0, k1, full, softmax_scale,
                                  hq)  # fmt: skip
            o[:, :, q0:q1] = oc
            lse[:, :, q0:q1] = lc
    return o, lse


def attention_blocked_backward(
    spec: ir.Spec, dout, q, k, v, dlse=None, *, softmax_scale: float, params: dict | None = None,
    batch_offset: int = 0, o=None, lse=None, param_grads: tuple[str, ...] = (),
):  # fmt: skip
    """dq, dk, dv (each in its input's dtype) and ``{param: gradient}`` of
    :func:`attention_blocked` for output gradient ``dout`` [B, Hq, Sq, Dv] and optional
    ``dlse`` [B, Hq, Sq]: each query chunk's forward is recomputed under autograd and
    back-propagated (module docstring).

    ``param_grads``: names of params (f32, read by the score_mod:
    :func:`flashgen.analysis.derive.differentiable_params`) whose gradient is wanted; each
    comes back in :func:`compute_dtype`, shaped like the param (0-d for a scalar).

    ``o`` [B, Hq, Sq, Dv] and ``lse`` [B, Hq, Sq] (both or neither): the forward's outputs,
    used as the kernels use them (FA2's backward, Dao 2023, Algorithm 2): P = exp(S - lse)
    and the row term D = rowsum(dout * o) - dlse, so dS = P (dP - D) and dV = P^T dout.
    For the op's own (o, lse) that is its gradient; for the (o, lse) of an attention over
    more keys than k, v hold (a ring-attention step with the merged result) it is this
    key block's share of that attention's gradient.  Without them each chunk's own
    softmax is differentiated."""
    params = dict(params or {})
    b, hq, sq, _ = q.shape
    hkv = k.shape[1]
    cdt = compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
    dk = torch.zeros(k.shape, dtype=cdt, device=q.device)
    dv = torch.zeros(v.shape, dtype=cdt, device=q.device)
    dparams = {n: _zero_grad(spec, n, params, cdt, q.device) for n in param_grads}
    terms = {n: param_grad_terms(spec.score_mod, n) for n in param_grads}
    fused = _fused(spec) and cdt == _FUSED_DTYPE and not param_grads
    if q.numel() and k.numel() and fused and dlse is None and lse is not None:
        env, ranges = _setup(spec, q, k, params, batch_offset)
        kf, vf = k.detach().to(cdt), v.detach().to(cdt)
        with torch.no_grad():
            _fused_backward(spec, env, dout, q.detach(), kf, vf, ranges, softmax_scale, o, lse,
                            dq, dk, dv)  # fmt: skip
    elif q.numel() and k.numel():
        env, ranges = _setup(spec, q, k, params, batch_offset)
        kf, vf = k.detach().to(cdt), v.detach().to(cdt)
        for q0, q1, k0, k1, full in ranges:
            if k1 <= k0:
                continue
            with torch.enable_grad():
                qs = _stack_queries(q.detach(), q0, q1, hkv).requires_grad_(True)
                ks = kf[:, :, k0:k1].detach().requires_grad_(True)
                vs = vf[:, :, k0:k1].detach().requires_grad_(True)
                oc, lc, raw, modded = _chunk(spec, env, qs, ks, vs, q0, q1, 0, k1 - k0, full,
                                             softmax_scale, hq, kv_base=k0)  # fmt: skip
                g = dout[:, :, q0:q1].to(cdt)
                if lse is None:
                    outs, seeds = [oc], [g]
                    if dlse is not None:
                        outs.append(lc)
                        seeds.append(dlse[:, :, q0:q1].to(cdt))
                else:
                    outs, seeds = [_saved_lse_loss(oc, lc, g, o, lse, dlse, q0, q1)], None
                inputs = (qs, ks, vs) + ((modded,) if param_grads else ())
                got = torch.autograd.grad(outs, inputs, seeds, allow_unused=True)
            gq, gk, gv = got[:3]
            if gq is not None:
                dq[:, :, q0:q1] = gq.view(b, hq, q1 - q0, q.shape[-1])
            if gk is not None:
                dk[:, :, k0:k1] += gk
            if gv is not None:
                dv[:, :, k0:k1] += gv
            if param_grads and got[3] is not None:
                _add_param_grads(env, terms, got[3], raw, dparams)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dparams


def _zero_grad(spec: ir.Spec, name: str, params: dict, dtype, device):
    """A zero gradient for param ``name``: its tensor's shape, or 0-d for a scalar."""
    t = params.get(name)
    shape = tuple(t.shape) if spec.param(name).kind == "tensor" else ()
    return torch.zeros(shape, dtype=dtype, device=device)


def _add_param_grads(env: dict, terms: dict, ds, score, dparams: dict) -> None:
    """Add one chunk's share of each param gradient: for each
    :class:`~flashgen.analysis.derive.ParamGradTerm`, ``ds * partial`` (``ds``: the gradient
    of the chunk's score_mod results, [B, Hq, C, K], zero at dropped pairs; the partial
    evaluated at the chunk's scaled logits ``score``) summed
    over the axes its subscripts do not vary along, then added to the subscripted elements
    (clamped into range as the forward reads them)."""
    env["score"] = score
    for name, ts in terms.items():
        g = dparams[name]
        flat = g.view(-1)
        for t in ts:
            contrib = ds * _as(eval_expr(t.partial, env), ir.Ty.F32, env)
            if not t.indices:
                g += contrib.sum()
                continue
            idx = torch.broadcast_tensors(*(eval_expr(i, env).to(torch.int64) for i in t.indices))
            shape = (1,) * (contrib.dim() - idx[0].dim()) + tuple(idx[0].shape)
            axes = [a for a, n in enumerate(shape) if n == 1 and contrib.shape[a] != 1]
            part = contrib.sum(dim=axes, keepdim=True) if axes else contrib
            lin = torch.zeros((), dtype=torch.int64, device=ds.device)
            for i, n in zip(idx, g.shape, strict=True):
                lin = lin * n + i.clamp(0, n - 1)
            lin = lin.reshape(shape).expand(part.shape)
            # sorted accumulation (CUDA's index_put_ sorts the indices): the same sums in the
            # same order on every run, unlike index_add_'s atomics
            flat.index_put_((lin.reshape(-1),), part.reshape(-1), accumulate=True)
    env.pop("score")


def _saved_lse_loss(oc, lc, g, o, lse, dlse, q0, q1):
    """A scalar whose gradient is FA2's backward with the saved ``o``, ``lse``
    (:func:`attention_blocked_backward`): with w = exp(lc - lse) (the chunk's own softmax
    rescaled to the saved lse: ``oc * w = P V`` and ``w = rowsum(P)`` for P = exp(S - lse)),
    ``sum(g * oc * w) - sum(D * w)``, D = rowsum(g * o) - dlse held constant."""
    ls = lse[:, :, q0:q1].to(lc.dtype)
    ok = torch.isfinite(ls) & torch.isfinite(lc.detach())
    arg = torch.where(ok, lc - torch.where(ok, ls, torch.zeros_like(ls)), torch.zeros_like(ls))
    w = torch.where(ok, torch.exp(arg), torch.zeros_like(arg))
    d = (g * o[:, :, q0:q1].to(g.dtype)).sum(-1)
    if dlse is not None:
        d = d - dlse[:, :, q0:q1].to(g.dtype)
    return (g * oc * w.unsqueeze(-1)).sum() - (d * w).sum()


def _sequences(cu_seqlens_q, cu_seqlens_k):
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    return [(i, cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]


def _seq4(t, a, z):
    """Rows [a, z) of a packed [total, H, D] tensor as [1, H, z - a, D] (a view)."""
    return t[a:z].transpose(0, 1).unsqueeze(0)


def varlen_blocked(spec: ir.Spec, q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale: float,
                   params: dict | None = None):  # fmt: skip
    """Varlen forward on CPU: :func:`attention_blocked` per sequence (``b`` = its index).
    q [total_q, Hq, D], k/v [total_k, Hkv, D/Dv]; cu_seqlens checked by the caller.
    Returns o [total_q, Hq, Dv] in q's dtype (rows no sequence covers: 0) and lse
    [Hq, total_q] in :func:`compute_dtype` (those rows: -inf)."""
    o = torch.zeros((q.shape[0], q.shape[1], v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=compute_dtype(q.dtype),
                     device=q.device)  # fmt: skip
    for i, q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0 or k1 == k0:
            continue
        oi, li = attention_blocked(
            spec, _seq4(q, q0, q1), _seq4(k, k0, k1), _seq4(v, k0, k1),
            softmax_scale=softmax_scale, params=params, batch_offset=i,
        )  # fmt: skip
        o[q0:q1] = oi[0].transpose(0, 1)
        lse[:, q0:q1] = li[0]
    return o, lse


def varlen_blocked_backward(spec: ir.Spec, dout, q, k, v, dlse, cu_seqlens_q, cu_seqlens_k, *,
                            softmax_scale: float, params: dict | None = None,
                            param_grads: tuple[str, ...] = (), o=None, lse=None):  # fmt: skip
    """dq, dk, dv (packed like q, k, v) and ``{param: gradient}`` (as
    :func:`attention_blocked_backward`'s, summed over the sequences) of
    :func:`varlen_blocked`; ``dlse`` [Hq, total_q] or None.  ``o`` [total_q, Hq, Dv] and
    ``lse`` [Hq, total_q] (both or neither): the forward's outputs, used per sequence as the
    kernels use them (:func:`attention_blocked_backward`'s ``o`` / ``lse``)."""
    dq, dk, dv = (torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    params = dict(params or {})
    cdt = compute_dtype(q.dtype)
    dparams = {n: _zero_grad(spec, n, params, cdt, q.device) for n in param_grads}
    for i, q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0 or k1 == k0:
            continue
        gl = None if dlse is None else dlse[:, q0:q1].unsqueeze(0)
        saved = {}
        if o is not None:
            saved = {"o": _seq4(o, q0, q1), "lse": lse[:, q0:q1].unsqueeze(0)}
        gq, gk, gv, gp = attention_blocked_backward(
            spec, _seq4(dout, q0, q1), _seq4(q, q0, q1), _seq4(k, k0, k1), _seq4(v, k0, k1), gl,
            softmax_scale=softmax_scale, params=params, batch_offset=i, param_grads=param_grads,
            **saved,
        )  # fmt: skip
        dq[q0:q1] = gq[0].transpose(0, 1)
        dk[k0:k1] += gk[0].transpose(0, 1)
        dv[k0:k1] += gv[0].transpose(0, 1)
        for n, g in gp.items():
            dparams[n] += g
    return dq, dk, dv, dparams
