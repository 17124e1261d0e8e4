"""IR -> PyTorch reference attention (materialized; for tests, verification and the CPU op).

Evaluates the same typed IR the kernels are generated from, with broadcasting index
tensors ``b [B,1,1,1]``, ``h [1,H,1,1]``, ``q_idx [1,1,Sq,1]``, ``kv_idx [1,1,1,Sk]``.
Integer arithmetic wraps like the kernels' 32-bit ``int`` (two's complement: values are
held in int64 and wrapped into int32 after every ``+ - *``, negation and ``abs``), so
``q_idx * 1000000 >= kv_idx`` decides the same pairs as the kernels.  Integer ``/`` and
``%`` truncate toward zero (C semantics) and give 0 for a zero divisor, matching the CUDA
lowering.  The mask's float (``f32``) arithmetic runs in float32 whatever
the compute dtype, as in the kernels: a mask is a decision, and float64 decides
``q_idx * 0.1 == 0.3`` or ``kv_idx <= q_idx / 0.3`` differently from float32 (the
score_mod, a continuous value, follows the compute dtype).
Semantics follow FlexAttention: ``score_mod`` rewrites the scaled logit, ``mask`` drops pairs.
A ``sink`` (gpt-oss) joins each row's softmax denominator: ``o = sum_j exp(s_j - m) v_j /
(sum_j exp(s_j - m) + exp(sink - m))``; lse stays the log-sum-exp of the keys alone.
"""

from __future__ import annotations

import math

import torch

from flashgen.analysis.derive import reads_param
from flashgen.frontend.errors import ParamIndexError
from flashgen.frontend.ir import (
    Binary,
    Call,
    Causal,
    Cond,
    Const,
    Expr,
    Index,
    Spec,
    Ty,
    Unary,
    Var,
)


def _float_dtype(env: dict) -> torch.dtype:
    return env["__float__"]


def _as(x, ty: Ty | None, env: dict):
    """Cast ``x`` (tensor or Python scalar) to the torch dtype of ``ty``."""
    want = {Ty.I32: torch.int64, Ty.F32: _float_dtype(env), Ty.BOOL: torch.bool}[ty]
    if isinstance(x, torch.Tensor):
        return x.to(want)
    return torch.tensor(x, dtype=want, device=env["__device__"])


def _wrap32(x):
    """An int64 tensor wrapped into int32's range (two's complement), as the kernels' ``int``."""
    return ((x + 2**31) & 0xFFFFFFFF) - 2**31


def _int_result(e: Expr, x):
    return _wrap32(x) if e.ty == Ty.I32 and isinstance(x, torch.Tensor) else x


def eval_expr(e: Expr, env: dict):
    """Evaluate a typed expression to a broadcastable tensor.

    ``env`` maps index variables, ``score`` and param names to tensors; it also carries
    ``__float__`` (the float dtype to compute in) and ``__device__``.
    """
    if isinstance(e, Const):
        return _as(e.value, e.ty, env)
    if isinstance(e, Causal):
        return env["q_idx"] + env["seqlen_k"] - env["seqlen_q"] >= env["kv_idx"]
    if isinstance(e, Var):
        return env[e.name]
    if isinstance(e, Index):
        t = env[e.name]
        idx = [eval_expr(i, env).to(torch.int64) for i in e.indices]
        idx = torch.broadcast_tensors(*idx)
        # Reads are clamped into bounds, as in the kernels; where an index was out of
        # bounds is recorded, and attention_reference refuses it at pairs that are kept.
        clamped = []
        for dim, (i, n) in enumerate(zip(idx, t.shape, strict=True)):
            oob = (i < 0) | (i >= n)
            env.setdefault("__oob__", []).append((e.name, oob, dim, t.dim(), n, i))
            clamped.append(i.clamp(0, n - 1))
        return t[tuple(clamped)]
    if isinstance(e, Unary):
        a = eval_expr(e.arg, env)
        return torch.logical_not(a) if e.op == "!" else _int_result(e, -a)
    if isinstance(e, Binary):
        a, b = eval_expr(e.lhs, env), eval_expr(e.rhs, env)
        if e.op == "&&":
            return torch.logical_and(a, b)
        if e.op == "||":
            return torch.logical_or(a, b)
        if Ty.F32 in (e.lhs.ty, e.rhs.ty):
            a, b = _as(a, Ty.F32, env), _as(b, Ty.F32, env)
        int_math = e.lhs.ty == Ty.I32 and e.rhs.ty == Ty.I32
        op = e.op
        if op == "+":
            return _int_result(e, a + b)
        if op == "-":
            return _int_result(e, a - b)
        if op == "*":
            return _int_result(e, a * b)
        if int_math and op in ("/", "%"):  # C truncation; a zero divisor gives 0 (as the kernels)
            zero = b == 0
            safe = torch.where(zero, torch.ones_like(b), b)
            r = torch.div(a, safe, rounding_mode="trunc") if op == "/" else torch.fmod(a, safe)
            return _wrap32(torch.where(zero, torch.zeros_like(r), r))  # INT_MIN / -1
        if op == "/":
            return a / b
        if op == "%":
            return torch.fmod(a, b)
        return {
            "<": torch.lt,
            "<=": torch.le,
            ">": torch.gt,
            ">=": torch.ge,
            "==": torch.eq,
            "!=": torch.ne,
        }[op](a, b)
    if isinstance(e, Cond):
        c = eval_expr(e.cond, env)
        t, o = eval_expr(e.then, env), eval_expr(e.other, env)
        if e.ty == Ty.F32:
            t, o = _as(t, Ty.F32, env), _as(o, Ty.F32, env)
        return torch.where(c, t, o)
    if isinstance(e, Call):
        args = [eval_expr(a, env) for a in e.args]
        if e.ty != Ty.I32:
            args = [_as(a, Ty.F32, env) for a in args]
        fn = {
            "abs": torch.abs,
            "min": torch.minimum,
            "max": torch.maximum,
            "exp": torch.exp,
            "log": torch.log,
            "tanh": torch.tanh,
            "sqrt": torch.sqrt,
            "trunc": torch.trunc,
        }[e.fn]
        return _int_result(e, fn(*args))
    raise TypeError(f"cannot evaluate {e!r}")


def _env(
    spec: Spec,
    B: int,
    Hq: int,
    Sq: int,
    Sk: int,
    params: dict,
    dev,
    fdt,
    batch_offset: int = 0,
    *,
    Hkv: int,
    optional=(),
) -> dict:
    """Evaluation environment: broadcasting index tensors, sizes and param values (``b``
    counts from ``batch_offset``: the sequence index in varlen; ``h_kv`` is the KV head
    query head ``h`` reads, ``h // (Hq // Hkv)``; ``optional``: tensor params that may be
    missing from ``params``, left out).  Raises ``ValueError`` unless ``Hkv`` divides
    ``Hq``."""
    if Hkv <= 0 or Hq % Hkv:
        raise ValueError(f"num_heads {Hq} is not a multiple of num_heads_kv {Hkv}")
    ar = lambda n: torch.arange(n, device=dev, dtype=torch.int64)  # noqa: E731
    env = {
        "b": (ar(B) + batch_offset).view(B, 1, 1, 1),
        "h": ar(Hq).view(1, Hq, 1, 1),
        "h_kv": (ar(Hq) // (Hq // Hkv)).view(1, Hq, 1, 1),
        "q_idx": ar(Sq).view(1, 1, Sq, 1),
        "kv_idx": ar(Sk).view(1, 1, 1, Sk),
        "seqlen_q": torch.tensor(Sq, device=dev),
        "seqlen_k": torch.tensor(Sk, device=dev),
        "__float__": fdt,
        "__device__": dev,
    }
    for p in spec.params:
        val = params.get(p.name, p.default)
        if p.kind == "tensor":
            if val is None and p.name in optional:
                continue
            if val is None:
                raise ValueError(f"tensor param '{p.name}' is required")
            env[p.name] = val.to(dev, fdt if p.ty == Ty.F32 else torch.int64)
        else:
            env[p.name] = _as(val, p.ty, env)
    return env


def _check_bounds(env: dict, keep) -> None:
    """Refuse a tensor-param index outside the declared shape at a kept pair, naming the
    index, its value, the extent and the first such (b, h, q_idx, kv_idx)."""
    for name, oob, dim, rank, n, idx in env.get("__oob__", []):
        hit = oob if keep is None else oob & keep
        if bool(hit.any()):
            where = tuple(hit.nonzero()[0].tolist())
            value = int(idx.expand(hit.shape)[where])
            at = ""
            if hit.dim() == 4:  # the [B, H, Sq, Sk] grid; env[k] varies along axis i only
                names = ("b", "h", "q_idx", "kv_idx")
                vals = [int(env[k].reshape(-1)[where[i]]) for i, k in enumerate(names)]
                at = " at " + ", ".join(f"{k}={v}" for k, v in zip(names, vals, strict=True))
            subs = ", ".join("." if d != dim else str(value) for d in range(rank))
            raise ParamIndexError(
                f"tensor param '{name}' is indexed outside its shape at a (q_idx, kv_idx) pair "
                f"the mask keeps: {name}[{subs}]{at}, but dim {dim} has extent {n}; the CUDA "
                f"kernels clamp such indices into range, so fix the expression or the "
                f"param's declared shape"
            )


def eval_mask(
    spec: Spec,
    *,
    batch: int,
    heads_q: int,
    seqlen_q: int,
    seqlen_k: int,
    params: dict | None = None,
    device=None,
    batch_offset: int = 0,
    heads_kv: int | None = None,
):
    """``spec.mask`` materialized: bool ``[batch, heads_q, seqlen_q, seqlen_k]`` (all True
    without a mask), with ``b`` in ``range(batch_offset, batch_offset + batch)`` and ``h``
    in ``range(heads_q)`` (pass 1 for an axis the mask does not read, to broadcast over it).
    ``heads_kv``: the KV heads (``h_kv = h // (heads_q // heads_kv)``); default
    ``heads_q`` (no GQA).  ``params`` as in :func:`attention_reference` (whole: ``b``
    indexes them), the tensor params the mask does not read optional.  Raises
    ``IndexError`` like it for an out-of-range tensor-param index at a kept pair,
    ``ValueError`` unless ``heads_kv`` divides ``heads_q``.
    """
    dev = torch.device("cpu") if device is None else torch.device(device)
    unread = tuple(p.name for p in spec.tensor_params if not reads_param(spec.mask, p.name))
    env = _env(
        spec, batch, heads_q, seqlen_q, seqlen_k, dict(params or {}), dev, torch.float32,
        batch_offset, Hkv=heads_q if heads_kv is None else heads_kv, optional=unread,
    )  # fmt: skip
    shape = (batch, heads_q, seqlen_q, seqlen_k)
    if spec.mask is None:
        return torch.ones(shape, dtype=torch.bool, device=dev)
    keep = eval_expr(spec.mask, env).expand(shape)
    _check_bounds(env, keep)
    return keep.contiguous()


def attention_reference(
    spec: Spec,
    q,
    k,
    v,
    *,
    softmax_scale: float | None = None,
    params: dict | None = None,
    compute_dtype=torch.float64,
    batch_offset: int = 0,
    round_p=None,
):
    """Materialized attention with ``spec``'s mask and score_mod.

    Args:
        q: ``[B, Hq, Sq, D]``; k: ``[B, Hkv, Sk, D]``; v: ``[B, Hkv, Sk, Dv]``, any float dtype,
            any device; Hq % Hkv == 0 (query head h reads kv head h // (Hq // Hkv)).
        softmax_scale: logit scale; default ``spec.softmax_scale`` or 1/sqrt(head_dim).
        params: values of the spec's params (scalars as numbers, tensors as tensors);
            missing scalars take the spec default.
        compute_dtype: dtype of every intermediate (float64 for test references; the input
            dtype to model PyTorch's own low-precision math), except the mask's float
            math, which is float32 as in the kernels.
        batch_offset: value of the index variable ``b`` for the first batch entry (the
            varlen reference passes one sequence at a time).
        round_p: None, or a function applied to the unnormalized probabilities
            ``exp(s - rowmax)`` (in [0, 1]) before the P V product, the row sum staying
            unrounded: o = round_p(P) V / rowsum(P).  :func:`flashgen.fp8.round_e4m3`
            emulates the FP8 kernel, which rounds P to e4m3 for its FP8 P V GEMM
            (FlashAttention-3, Shah et al. 2024, section 3.3).

    Returns:
        ``(o, lse)``: o ``[B, Hq, Sq, Dv]`` in ``compute_dtype``; lse ``[B, Hq, Sq]``,
        natural log, float32 (float64 when ``compute_dtype`` is float64), of the keys alone
        (a ``sink`` joins o's normalizer only).  Rows with nothing to attend to give o = 0
        and lse = -inf, with zero (not NaN) gradients.

    Raises:
        IndexError: a tensor param is indexed outside its shape at a pair the mask keeps
            (reads at dropped pairs are clamped into range, as in the kernels).
    """
    params = dict(params or {})
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    dev = q.device
    if softmax_scale is None:
        softmax_scale = spec.softmax_scale or 1.0 / math.sqrt(spec.head_dim)
    low = compute_dtype in (torch.float16, torch.bfloat16)
    fdt = torch.float32 if low else compute_dtype  # expression math never below fp32
    group = Hq // Hkv
    qc = q.to(compute_dtype)
    kc = k.to(compute_dtype).repeat_interleave(group, dim=1)
    vc = v.to(compute_dtype).repeat_interleave(group, dim=1)
    s = torch.matmul(qc, kc.transpose(-1, -2)).to(fdt) * softmax_scale  # [B,Hq,Sq,Sk]

    env = _env(spec, B, Hq, Sq, Sk, params, dev, fdt, batch_offset, Hkv=Hkv)
    if spec.score_mod is not None:
        env["score"] = s
        s = _as(eval_expr(spec.score_mod, env), Ty.F32, env).expand(B, Hq, Sq, Sk)
    keep = None
    if spec.mask is not None:  # float32 float math, as the kernels decide (see the module doc)
        mask_env = _env(spec, B, Hq, Sq, Sk, params, dev, torch.float32, batch_offset, Hkv=Hkv)
        keep = eval_expr(spec.mask, mask_env).expand(B, Hq, Sq, Sk)
        env.setdefault("__oob__", []).extend(mask_env.get("__oob__", []))
        s = s.masked_fill(~keep, float("-inf"))
    _check_bounds(env, keep)
    # Softmax normalized as PyTorch's: exp(s - rowmax) divided by its row sum, so p sums to 1
    # even where exp(s - lse) would not (lse rounds to s's precision when many large logits
    # tie: bf16 q = k = 1e4 gave errors of 30 in o); NaN-free, in value and in gradient, on
    # rows with nothing to attend to.  A sink joins the row sum (and the max) only.
    row_has = torch.isfinite(s).any(dim=-1, keepdim=True)
    s_safe = torch.where(row_has, s, torch.zeros_like(s))
    row_max = s_safe.amax(dim=-1, keepdim=True).detach()
    sink = None
    if spec.sink is not None:
        sink = _as(eval_expr(spec.sink, env), Ty.F32, env).expand(B, Hq, 1, 1)
        row_max = torch.maximum(row_max, sink.detach())
    e_s = torch.exp(s_safe - row_max)
    keys = e_s.sum(dim=-1, keepdim=True)
    denom = keys if sink is None else keys + torch.exp(sink - row_max)
    if round_p is None:
        p = torch.where(row_has, e_s / denom, torch.zeros_like(s))
    else:
        p = torch.where(row_has, round_p(e_s) / denom, torch.zeros_like(s))
    lse_safe = row_max + torch.log(keys)
    lse = torch.where(row_has, lse_safe, torch.full_like(lse_safe, float("-inf"))).squeeze(-1)
    o = torch.matmul(p.to(compute_dtype), vc)
    return o, lse.to(fdt)  # float32, or float64 for a float64 reference


def attention_reference_varlen(
    spec: Spec,
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    softmax_scale: float | None = None,
    params: dict | None = None,
    compute_dtype=torch.float64,
):
    """Varlen attention as a loop over :func:`attention_reference`, one sequence at a time.

    Args:
        q: packed ``[total_q, Hq, D]``; k: ``[total_k, Hkv, D]``; v: ``[total_k, Hkv, Dv]``.
        cu_seqlens_q, cu_seqlens_k: ``[batch + 1]`` integer offsets (any device; read on
            the host), nondecreasing from 0; sequence ``i`` is rows
            ``cu_seqlens[i]:cu_seqlens[i + 1]``.  Its ``b`` is ``i``; its ``q_idx``,
            ``kv_idx``, ``seqlen_q``, ``seqlen_k`` are its own (causal is bottom-right per
            sequence).
        softmax_scale, params, compute_dtype: as for :func:`attention_reference`.

    Returns:
        ``(o, lse)``: o ``[total_q, Hq, Dv]`` in ``compute_dtype``; lse ``[Hq, total_q]``
        (FlashAttention's varlen layout), float32 (float64 for a float64 reference).  Rows
        past ``cu_seqlens_q[-1]`` are 0 / -inf; a sequence with no keys gives o = 0,
        lse = -inf.  Differentiable in q, k, v.
    """
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    total_q, hq = q.shape[0], q.shape[1]
    dv = v.shape[2]
    fdt = compute_dtype if compute_dtype == torch.float64 else torch.float32
    o_parts, lse_parts = [], []
    covered = 0
    for i in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[i], cq[i + 1], ck[i], ck[i + 1]
        if q1 == q0:
            continue
        if k1 == k0:
            o_parts.append(torch.zeros(q1 - q0, hq, dv, dtype=compute_dtype, device=q.device))
            lse_parts.append(torch.full((hq, q1 - q0), float("-inf"), dtype=fdt, device=q.device))
        else:
            o_i, lse_i = attention_reference(
                spec,
                q[q0:q1].transpose(0, 1).unsqueeze(0),
                k[k0:k1].transpose(0, 1).unsqueeze(0),
                v[k0:k1].transpose(0, 1).unsqueeze(0),
                softmax_scale=softmax_scale,
                params=params,
                compute_dtype=compute_dtype,
                batch_offset=i,
            )
            o_parts.append(o_i[0].transpose(0, 1))
            lse_parts.append(lse_i[0].to(fdt))
        covered = q1
    if covered < total_q:  # rows no sequence covers
        rest = total_q - covered
        o_parts.append(torch.zeros(rest, hq, dv, dtype=compute_dtype, device=q.device))
        lse_parts.append(torch.full((hq, rest), float("-inf"), dtype=fdt, device=q.device))
    if not o_parts:
        return (
            torch.zeros(0, hq, dv, dtype=compute_dtype, device=q.device),
            torch.zeros(hq, 0, dtype=fdt, device=q.device),
        )
    return torch.cat(o_parts, dim=0), torch.cat(lse_parts, dim=1)
