"""What every kernel call of the attention ops needs besides validation: the kernel ABI's
argument values (:func:`kernel_values`), the current CUDA stream, the SM count, alignment of
the tensors a kernel reads, and whether a call is plain eager (:func:`_plain_eager`).  Shared
by :mod:`flashgen.ops.prefill.attention`, :mod:`~flashgen.ops.prefill.backward`,
:mod:`~flashgen.ops.prefill.varlen` and :mod:`~flashgen.ops.decode.op`; imports none of them."""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.autograd.forward_ad as _fwad
from torch.utils._python_dispatch import _get_current_dispatch_mode

from flashgen.frontend import ir
from flashgen.ops.validation import DESCALE_NAMES, PARAM_DTYPE, Dims


@functools.cache
def _sm_count(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_index`` (a persistent kernel's
    grid)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _mask_reads(spec: ir.Spec, name: str) -> bool:
    return spec.mask is not None and any(
        isinstance(n, ir.Var) and n.name == name for n in ir.walk(spec.mask)
    )


def kernel_values(
    spec: ir.Spec, tensors: dict, dims: Dims, softmax_scale: float, scalars, tensor_params: dict,
    descales=None,
) -> dict:
    """Name -> value map for a launch under the kernel ABI (:mod:`flashgen.codegen.abi`).

    ``tensors``: the kernel's tensors by argument name (``q``, ``o``, ``lse``, ``dq`` ...);
    each 4-D one also gets its ``<name>_sb/_sh/_ss`` element strides.  Adds the problem
    sizes from ``dims``, ``softmax_scale``, the scalar params (``p_<name>``, spec order)
    and the tensor params (``t_<name>``) converted to the kernel's element type and made
    contiguous; such a copy is freed after the call returns, and the caching allocator
    reuses it only in stream order, after the kernel has read it.  A tensor param missing
    from ``tensor_params`` (one the kernel never reads: the block-table pre-pass of a
    ``BlockMask`` holds only those its mask reads) goes in as a null pointer.
    ``descales`` (fp8 ops): ``q_descale``, ``k_descale``, ``v_descale`` float32 [B, Hkv]
    (or per block, [B, H, ceil(S / 128)]), passed contiguous (a broadcast view becomes
    such a copy).
    """
    values = dict(
        tensors, batch=dims.batch, heads_q=dims.heads_q, heads_kv=dims.heads_kv,
        seqlen_q=dims.seqlen_q, seqlen_k=dims.seqlen_k, softmax_scale=softmax_scale,
    )  # fmt: skip
    for name, t in tensors.items():
        if t is not None:
            st = t.stride()
            if len(st) == 4:
                sb, sh, ss = _stride_names(name)
                values[sb], values[sh], values[ss] = st[0], st[1], st[2]
    for p, val in zip(spec.scalar_params, scalars, strict=True):
        values[f"p_{p.name}"] = val
    for p in spec.tensor_params:
        t = tensor_params.get(p.name)
        values[f"t_{p.name}"] = 0 if t is None else t.to(PARAM_DTYPE[p.ty]).contiguous()
    if descales is not None:
        for name, t in zip(DESCALE_NAMES, descales, strict=True):
            values[name] = t.to(torch.float32).contiguous()
    return values


@functools.lru_cache(maxsize=64)
def _stride_names(name: str) -> tuple[str, str, str]:
    """``(<name>_sb, <name>_sh, <name>_ss)``, built once per tensor name."""
    return f"{name}_sb", f"{name}_sh", f"{name}_ss"


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_ptr(device: torch.device) -> int:
    """The raw handle of ``device``'s current CUDA stream: what
    ``torch.cuda.current_stream(device).cuda_stream`` says, without building a Stream
    object (torch's ``_cuda_getCurrentRawStream``, which Inductor's generated code calls,
    where this torch build has it and ``device`` names its index)."""
    if _RAW_STREAM is not None and device.index is not None:
        return _RAW_STREAM(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def _kernel_aligned(t):
    """``t`` itself when the kernel's 16-byte async copies can read it, else a contiguous copy.

    The kernel moves rows in 16-byte chunks (8 fp16/bf16 elements, 16 fp8 ones), so it
    needs a 16-byte aligned base and batch/head/seq strides that are multiples of 16 bytes
    (strides of size-1 dims never move the pointer).  Any other stride(-1) == 1 view is still
    accepted: it costs one copy instead of an error or a misaligned-address fault.
    """
    (sb, sh, ss, _), (b, h, s, _) = t.stride(), t.shape
    n = 16 // t.element_size()
    ok = (
        t.data_ptr() % 16 == 0
        and (sb % n == 0 or b <= 1)
        and (sh % n == 0 or h <= 1)
        and (ss % n == 0 or s <= 1)
    )
    return t if ok else t.clone(memory_format=torch.contiguous_format)


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by the calling function name the first
    frame outside flashgen and torch: the user's ``op.attention`` line, whether the forward
    ran from it directly, from the fast path's autograd node (``Function.apply``) or from
    the dispatcher (``torch.ops``)."""
    inside = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
              os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)  # fmt: skip
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


_FUNCTORCH_ACTIVE = torch._C._are_functorch_transforms_active
_IS_GRAD_TRACKING = torch._C._functorch.is_gradtrackingtensor


def refuse_forward_ad(name: str, tensors) -> None:
    """Raise ``NotImplementedError`` naming the op if any of ``tensors`` (q, k, v, the params)
    carries a forward-mode tangent (``torch.func.jvp`` / ``jacfwd``,
    ``torch.autograd.forward_ad`` dual tensors): the ops have no forward-mode formula, and
    torch would give zero tangents silently; or is tracked by a ``torch.func`` reverse-mode
    transform (``grad``, ``vjp``, ``jacrev``, a GradTrackingTensor): the ops' autograd is
    torch.library's, whose generated ``autograd.Function`` has no ``setup_context``, so torch
    would raise an error that names neither the op nor what works (pytorch/pytorch#168393).
    Both messages point to ``torch.autograd.grad`` / ``.backward()``, which work.  Costs one
    check of two flags when no forward-mode AD or functorch transform is active."""
    if _fwad._current_level < 0 and not _FUNCTORCH_ACTIVE():
        return
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if _fwad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(
                f"flashgen::{name}: no forward-mode AD (torch.func.jvp, jacfwd, forward_ad dual "
                f"tensors); use reverse mode through torch.autograd (torch.autograd.grad, "
                f".backward())"
            )
        if _IS_GRAD_TRACKING(t):
            raise NotImplementedError(
                f"flashgen::{name}: no torch.func reverse mode (grad, vjp, jacrev): "
                f"torch.library ops' autograd does not run under functorch transforms "
                f"(pytorch/pytorch#168393); use torch.autograd.grad or .backward()"
            )


def _plain_eager(q, k, v) -> bool:
    """Plain tensors (no subclass such as FakeTensor or DTensor) in eager mode: no
    ``torch.compile`` or ``torch.jit.trace`` recording, no torch-function / dispatch mode
    and no functorch transform that must see the op."""
    tensor = torch.Tensor
    return (
        type(q) is tensor
        and type(k) is tensor
        and type(v) is tensor
        and not torch.compiler.is_compiling()
        and torch._C._get_tracing_state() is None
        and not torch._C._is_torch_function_mode_enabled()
        and _get_current_dispatch_mode() is None
        and not torch._C._are_functorch_transforms_active()
    )
