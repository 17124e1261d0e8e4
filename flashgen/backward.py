"""Backward pass of a flashgen op and its autograd registration.

For every spec, ``flashgen::<name>__backward(dout, q, k, v, o, lse, dlse, softmax_scale,
*params) -> (dq, dk, dv)`` is registered beside the forward op, with

- a CUDA implementation: the three kernels of ``templates/sm_80/bwd.cu.j2`` (FA2 backward,
  Dao 2023, Algorithm 2: dsum = rowsum(dO * O); dK, dV with KV outer / Q inner, summed over
  the query heads of each GQA group in registers; dQ with Q outer / KV inner).  P is
  recomputed from the saved lse and never stored, so memory stays O(B*H*S*D).  No kernel
  uses atomics: gradients are bitwise reproducible from run to run;
- a CPU implementation: autograd through the float32 reference of the same IR;
- a fake implementation, so ``torch.compile`` traces the backward too.

The forward op's ``register_autograd`` calls it.  A gradient of ``lse`` folds into the row
term: dS = P * (dP - (dsum - dlse)).  Tensor params (ALiBi slopes, bias tables) get no
gradient: if one requires grad the forward raises ``NotImplementedError`` naming it, so
no gradient is ever silently zero.
"""

from __future__ import annotations

import threading

import torch

from .ir import Spec


def backward_name(spec: Spec) -> str:
    return f"{spec.name}__backward"


def backward_schema(spec: Spec) -> str:
    """Schema of the backward op, e.g. ``alibi__backward(Tensor dout, ..., Tensor slopes)
    -> (Tensor, Tensor, Tensor)``."""
    from .op import _SCHEMA_TYPE

    args = [
        "Tensor dout",
        "Tensor q",
        "Tensor k",
        "Tensor v",
        "Tensor o",
        "Tensor lse",
        "Tensor? dlse",
        "float softmax_scale",
    ]
    args += [f"{_SCHEMA_TYPE[p.ty]} {p.name}" for p in spec.scalar_params]
    args += [f"Tensor {p.name}" for p in spec.tensor_params]
    return f"{backward_name(spec)}({', '.join(args)}) -> (Tensor, Tensor, Tensor)"


def _grads_like(q, k, v, fill_zero: bool):
    make = torch.zeros if fill_zero else torch.empty
    return tuple(make(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


class Backward:
    """The backward implementations of one :class:`~flashgen.op.AttentionOp`."""

    def __init__(self, op):
        self.op = op
        self.spec = op.spec
        self._kernels: dict[int, tuple] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ op impls
    def fake(self, dout, q, k, v, o, lse, dlse, softmax_scale, *rest):
        return _grads_like(q, k, v, fill_zero=False)

    def cpu(self, dout, q, k, v, o, lse, dlse, softmax_scale, *rest):
        """Autograd through the float32 reference; dq, dk, dv in the input dtype."""
        from .op import PARAM_DTYPE, validate
        from .reference import attention_reference

        scalars, tensors = self.op._split(rest)
        validate(self.spec, q, k, v, tensors)
        if q.numel() == 0 or k.numel() == 0:
            return _grads_like(q, k, v, fill_zero=True)
        params = dict(zip((p.name for p in self.spec.scalar_params), scalars, strict=True))
        params.update({n: t.to(PARAM_DTYPE[self.spec.param(n).ty]) for n, t in tensors.items()})
        with torch.enable_grad():
            qf, kf, vf = (t.detach().to(torch.float32).requires_grad_(True) for t in (q, k, v))
            ref_o, ref_lse = attention_reference(
                self.spec,
                qf,
                kf,
                vf,
                softmax_scale=softmax_scale,
                params=params,
                compute_dtype=torch.float32,
            )
            outs, seeds = [ref_o], [dout.to(torch.float32)]
            if dlse is not None:
                outs.append(ref_lse)
                seeds.append(dlse.to(torch.float32))
            grads = torch.autograd.grad(outs, (qf, kf, vf), seeds, allow_unused=True)
        return tuple(
            (g if g is not None else torch.zeros_like(t, dtype=torch.float32)).to(t.dtype)
            for g, t in zip(grads, (q, k, v), strict=True)
        )

    def cuda(self, dout, q, k, v, o, lse, dlse, softmax_scale, *rest):
        """The three backward kernels on the current stream of q's device."""
        from .op import PARAM_DTYPE, _kernel_aligned, validate

        scalars, tensors = self.op._split(rest)
        dims = validate(self.spec, q, k, v, tensors)
        if q.numel() == 0 or k.numel() == 0:
            return _grads_like(q, k, v, fill_zero=True)
        plan, pre, dkdv, dqk = self.kernels(q.device)
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        q, k, v, o, dout = (_kernel_aligned(t) for t in (q, k, v, o, dout))
        dq, dk, dv = _grads_like(q, k, v, fill_zero=False)
        dsum = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
        values: dict = {
            "q": q,
            "k": k,
            "v": v,
            "o": o,
            "dout": dout,
            "lse": lse,
            "dsum": dsum,
            "dq": dq,
            "dk": dk,
            "dv": dv,
        }
        for name in ("q", "k", "v", "o", "dout", "dq", "dk", "dv"):
            t = values[name]
            values[f"{name}_sb"], values[f"{name}_sh"], values[f"{name}_ss"] = t.stride()[:3]
        values.update(
            batch=dims.batch,
            heads_q=dims.heads_q,
            heads_kv=dims.heads_kv,
            seqlen_q=dims.seqlen_q,
            seqlen_k=dims.seqlen_k,
            softmax_scale=softmax_scale,
        )
        for p, val in zip(self.spec.scalar_params, scalars, strict=True):
            values[f"p_{p.name}"] = val
        for p in self.spec.tensor_params:
            values[f"t_{p.name}"] = tensors[p.name].to(PARAM_DTYPE[p.ty]).contiguous()
        grids = plan.grids(dims.batch, dims.heads_q, dims.heads_kv, dims.seqlen_q, dims.seqlen_k)
        stream = torch.cuda.current_stream(q.device).cuda_stream
        pre.launch(grids["pre"], values, stream)
        if dlse is not None:
            dsum.sub_(dlse)
        dkdv.launch(grids["dkdv"], values, stream)
        dqk.launch(grids["dq"], values, stream)
        return dq, dk, dv

    def kernels(self, device: torch.device):
        """(BackwardPlan, pre, dkdv, dq) loaded on ``device``; built and cached on first use."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        hit = self._kernels.get(index)
        if hit is not None:
            return hit
        with self._lock:
            hit = self._kernels.get(index)
            if hit is None:
                from . import cache, runtime
                from .lower import plan_backward
                from .op import target_for_device
                from .render import render

                plan = plan_backward(self.spec, target_for_device(self.spec, device))
                cubin, _ = cache.get_or_build(render(plan.unit), plan.unit)
                hit = (
                    plan,
                    *(runtime.load(cubin, kp, index) for kp in (plan.pre, plan.dkdv, plan.dq)),
                )
                self._kernels[index] = hit
        return hit

    # ------------------------------------------------------------------ autograd
    def setup_context(self, ctx, inputs, output):
        q, k, v, softmax_scale, *rest = inputs
        n = len(self.spec.scalar_params)
        tensors = rest[n:]
        for p, t in zip(self.spec.tensor_params, tensors, strict=True):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise NotImplementedError(
                    f"flashgen::{self.spec.name}: gradients with respect to tensor param "
                    f"'{p.name}' are not supported yet; pass {p.name}.detach() to train "
                    f"only q, k and v"
                )
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse, *tensors)
        ctx.softmax_scale = softmax_scale
        ctx.scalars = list(rest[:n])

    def backward(self, ctx, grad_o, grad_lse):
        q, k, v, o, lse, *tensors = ctx.saved_tensors
        if grad_o is None:
            grad_o = torch.zeros_like(o)
        bwd = getattr(torch.ops.flashgen, backward_name(self.spec))
        dq, dk, dv = bwd(
            grad_o, q, k, v, o, lse, grad_lse, ctx.softmax_scale, *ctx.scalars, *tensors
        )
        return (dq, dk, dv, None, *([None] * (len(ctx.scalars) + len(tensors))))

    def register(self, lib) -> None:
        """Define the backward op on ``lib`` and attach autograd to the forward op."""
        name = backward_name(self.spec)
        lib.define(backward_schema(self.spec))
        lib.impl(name, self.cuda, "CUDA")
        lib.impl(name, self.cpu, "CPU")
        torch.library.register_fake(f"flashgen::{name}", self.fake, lib=lib)
        torch.library.register_autograd(
            self.op.qualname, self.backward, setup_context=self.setup_context, lib=lib
        )
