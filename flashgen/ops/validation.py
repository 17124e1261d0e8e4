"""Input checks of the attention ops (no launch): the dtype tables, :class:`Dims`,
:func:`validate` (q, k, v, tensor params, scalars, softmax_scale) and the
:class:`~flashgen.frontend.errors.OpInputError` each check raises, the defaults the op fills
in, the poisoned-output debugging hook and the kernel target of a device.  Shared by
:mod:`flashgen.ops.prefill.attention`, :mod:`~flashgen.ops.prefill.backward`,
:mod:`~flashgen.ops.prefill.varlen` and :mod:`~flashgen.ops.decode.op`; imports none of them."""

from __future__ import annotations

import contextlib
import math
import numbers
from dataclasses import dataclass

import torch

from flashgen import env
from flashgen.codegen.abi import target_for_capability
from flashgen.frontend import ir
from flashgen.frontend.errors import OpInputError

#: torch dtype of each spec dtype.
TORCH_DTYPE = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": getattr(torch, "float8_e4m3fn", None),
}
#: torch dtype of a tensor param's element type.
PARAM_DTYPE = {ir.Ty.F32: torch.float32, ir.Ty.I32: torch.int32}
_SCHEMA_TYPE = {ir.Ty.I32: "int", ir.Ty.F32: "float"}
#: Input dtypes the CPU op takes besides the spec's own: float32 (what CPU callers expect)
#: and float64 (computed in float64 throughout, so ``torch.autograd.gradcheck`` runs on
#: the op itself).
CPU_DTYPES = (torch.float32, torch.float64)


#: Device types of the tensors the ops take: CPU and CUDA, and meta (the fake kernel: shapes
#: only; :func:`check_input_device`).
_DEVICE_TYPES = ("cpu", "cuda", "meta")


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The op's lse dtype for inputs of ``dtype``: float32, float64 for float64 (CPU)."""
    return torch.float64 if dtype == torch.float64 else torch.float32

_POISON = False


def out_dtype(spec: ir.Spec) -> torch.dtype:
    """Dtype of ``o``: the input dtype, bf16 for fp8 inputs."""
    return torch.bfloat16 if spec.dtype.startswith("fp8") else TORCH_DTYPE[spec.dtype]


# ----------------------------------------------------------------------------- validation
@dataclass(frozen=True)
class Dims:
    """Problem sizes read off validated inputs."""

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim_v: int

    def symbols(self) -> dict[str, int]:
        """Values of the shape symbols tensor params may use."""
        return {
            "batch": self.batch,
            "num_heads": self.heads_q,
            "num_heads_kv": self.heads_kv,
            "seqlen_q": self.seqlen_q,
            "seqlen_k": self.seqlen_k,
        }


def _shape(t) -> list:
    return list(t.shape)


def validate(
    spec: ir.Spec,
    q,
    k,
    v,
    tensor_params: dict | None = None,
    *,
    softmax_scale=None,
    scalars=None,
) -> Dims:
    """Check q, k, v (and tensor params) against ``spec`` and the op contract.

    ``tensor_params`` maps each tensor param name to its tensor (missing ones are
    reported).  When given, ``softmax_scale`` (see :func:`check_softmax_scale`) and
    ``scalars`` (scalar param values in spec order, see :func:`check_scalar`) are
    checked too.  Returns the problem :class:`Dims`.  Raises :class:`OpInputError`
    naming the offending argument with the expected and received value.  Reads only
    shapes, strides, dtypes and devices: never tensor contents (no device sync).  A
    ``v_from_k`` spec (decode only) raises here: its op has no prefill or backward.
    """
    if spec.v_from_k:
        raise OpInputError(
            f"spec {spec.name!r} has v_from_k: true (MLA's one latent cache): it is decode only "
            f"(op.with_kvcache, op.plan_decode); its attention, varlen and backward ops refuse "
            f"every call"
        )
    if softmax_scale is not None and not _symbolic(softmax_scale):
        check_softmax_scale(softmax_scale)
    if scalars is not None:
        for p, val in zip(spec.scalar_params, scalars, strict=True):
            if not _symbolic(val):
                check_scalar(p, val)
    dims = _dims_if_valid(spec, q, k, v)
    if dims is None:
        dims = _check_qkv(spec, q, k, v)
    if spec.tensor_params:
        validate_tensor_params(spec, tensor_params, q.device, dims.symbols())
    return dims


def _dims_if_valid(spec: ir.Spec, q, k, v) -> Dims | None:
    """The common case of :func:`_check_qkv` in few attribute reads: the :class:`Dims` of
    q, k, v when they pass every one of its checks, else None (and :func:`_check_qkv`
    runs to name the failure).  It may say None where :func:`_check_qkv` accepts (no kv
    heads, an empty tensor with stride(-1) != 1), never the reverse."""
    tensor = torch.Tensor
    if not (isinstance(q, tensor) and isinstance(k, tensor) and isinstance(v, tensor)):
        return None
    strided = torch.strided
    if not (q.layout == strided and k.layout == strided and v.layout == strided):
        return None
    want = TORCH_DTYPE[spec.dtype]
    qs, ks, vs = q.shape, k.shape, v.shape
    if not (len(qs) == len(ks) == len(vs) == 4 and q.dtype == k.dtype == v.dtype):
        return None
    if q.dtype != want and not (q.dtype in CPU_DTYPES and q.device.type == "cpu"):
        return None
    batch, hq, sq, d = qs
    _, hkv, sk, _ = ks
    if not (
        d == spec.head_dim
        and ks[3] == spec.head_dim
        and vs[3] == spec.head_dim_v
        and ks[0] == batch
        and vs[0] == batch
        and vs[1] == hkv
        and vs[2] == sk
        and hkv != 0
        and hq % hkv == 0
        and q.stride(3) == 1
        and k.stride(3) == 1
        and v.stride(3) == 1
    ):
        return None
    dev = q.device
    if k.device != dev or v.device != dev or dev.type not in _DEVICE_TYPES:
        return None
    return Dims(batch, hq, hkv, sq, sk, vs[3])


def _check_qkv(spec: ir.Spec, q, k, v) -> Dims:
    """Every check of q, k, v in turn, raising :class:`OpInputError` at the first failure."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise OpInputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_layout(name, t)
    check_input_device(spec, "q", q)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise OpInputError(
                f"{name}: expected a 4-D tensor [batch, heads, seqlen, head_dim], "
                f"got shape {_shape(t)}"
            )
        check_input_dtype(spec, name, t, q)
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise OpInputError(f"{name}: expected device {q.device} (q's device), got {t.device}")
    if q.shape[3] != spec.head_dim:
        raise OpInputError(f"q: expected head_dim {spec.head_dim} (shape[-1]), got {q.shape[3]}")
    if k.shape[3] != spec.head_dim:
        raise OpInputError(f"k: expected head_dim {spec.head_dim} (shape[-1]), got {k.shape[3]}")
    if v.shape[3] != spec.head_dim_v:
        raise OpInputError(
            f"v: expected head_dim_v {spec.head_dim_v} (shape[-1]), got {v.shape[3]}"
        )
    if k.shape[0] != q.shape[0]:
        raise OpInputError(f"k: expected batch {q.shape[0]} (q's batch), got {k.shape[0]}")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise OpInputError(
            f"v: expected [batch, heads_kv, seqlen_k] = {_shape(k)[:3]} (k's), got {_shape(v)[:3]}"
        )
    hq, hkv = check_heads_and_strides(q, k, v)
    return Dims(q.shape[0], hq, hkv, q.shape[2], k.shape[2], v.shape[3])


def check_layout(name: str, t) -> None:
    """``t`` (the tensor argument called ``name``) is dense: layout ``torch.strided``, not
    sparse (COO, CSR, ...), nested (jagged) or mkldnn, whose elements have no strides the
    kernels can walk; else :class:`OpInputError` naming ``name`` and the layout."""
    if t.layout != torch.strided:
        nested = t.is_nested
        hint = "pack the sequences for op.varlen" if nested else "call .to_dense() first"
        raise OpInputError(
            f"{name}: expected a dense tensor (layout torch.strided), got layout {t.layout}; "
            f"{hint}"
        )


def check_input_device(spec: ir.Spec, name: str, t, cpu_dtypes=CPU_DTYPES) -> None:
    """``t`` (the input called ``name``: q, whose device the other inputs must share) is on a
    device the op runs on: CPU or CUDA.  A meta tensor is taken except in one of
    ``cpu_dtypes`` (the dtypes the op takes on the CPU only: :data:`CPU_DTYPES`; decode's
    float32): the fake kernel gives o and lse of the right shapes for the spec's dtype.
    :class:`OpInputError` naming ``name`` and the device otherwise."""
    kind = t.device.type
    if kind in ("cpu", "cuda") or (kind == "meta" and t.dtype not in cpu_dtypes):
        return
    if kind == "meta":
        raise OpInputError(
            f"{name}: expected a CPU or CUDA tensor, got a {t.dtype} tensor on device 'meta' "
            f"({t.dtype} runs on the CPU only; a meta tensor gives the output shapes only, in "
            f"the spec's dtype {TORCH_DTYPE[spec.dtype]}: spec {spec.name!r} has dtype "
            f"{spec.dtype})"
        )
    raise OpInputError(f"{name}: expected a CPU or CUDA tensor, got a tensor on device {kind!r}")


def check_input_dtype(spec: ir.Spec, name: str, t, q) -> None:
    """``t`` (the input called ``name``) has the spec's dtype, or float32 / float64 on CPU
    (:data:`CPU_DTYPES`), and q's dtype; else :class:`OpInputError`."""
    want = TORCH_DTYPE[spec.dtype]
    ok = t.dtype == want or (t.dtype in CPU_DTYPES and t.device.type == "cpu")
    if ok and t.dtype != q.dtype:  # an accepted dtype, but not q's: name q's as expected
        raise OpInputError(
            f"{name}: expected dtype {q.dtype} (q's dtype: q, k and v share one dtype; spec "
            f"{spec.name!r} has dtype {spec.dtype}, float32 / float64 also on CPU), got {t.dtype}"
        )
    if not ok:
        also = "; float32 / float64 also on CPU, the same for q, k and v"
        raise OpInputError(
            f"{name}: expected dtype {want} (spec {spec.name!r} has dtype {spec.dtype}{also}), "
            f"got {t.dtype}" + ("" if t.dtype == q.dtype else f" (q has {q.dtype})")
        )


def check_heads_and_strides(q, k, v) -> tuple[int, int]:
    """``(heads_q, heads_kv)`` after checking Hq % Hkv == 0 (heads on dim 1) and that the
    last dim of q, k, v is contiguous; :class:`OpInputError` otherwise.  Shared by the
    padded ``[B, H, S, D]`` and the packed varlen ``[total, H, D]`` layouts."""
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 and hq != 0:
        raise OpInputError(f"k: expected at least one kv head for {hq} query heads, got 0")
    if hkv != 0 and hq % hkv != 0:
        raise OpInputError(
            f"q: expected num_heads to be a multiple of k's num_heads_kv {hkv}, got {hq}"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.numel() > 0 and t.stride(-1) != 1:
            raise OpInputError(
                f"{name}: expected stride(-1) == 1 (head_dim contiguous), got strides "
                f"{list(t.stride())}; call .contiguous() first"
            )
    return hq, hkv


def validate_tensor_params(
    spec: ir.Spec, tensor_params: dict | None, device, sym: dict, device_of: str = "q's device",
    names=None,
) -> None:
    """Check each tensor param (present, a tensor on ``device``, the declared shape with the
    shape symbols valued by ``sym`` (see :meth:`Dims.symbols`), the declared element kind);
    :class:`OpInputError` otherwise.  Metadata only.  ``device_of`` names where ``device``
    comes from in the error message; ``names``: check only the params of these names (None:
    all)."""
    if spec.tensor_params:
        tensor_params = tensor_params or {}
        for p in spec.tensor_params:
            if names is not None and p.name not in names:
                continue
            t = tensor_params.get(p.name)
            if t is None:
                raise OpInputError(f"{p.name}: missing tensor param {_describe_param(p)}")
            if not isinstance(t, torch.Tensor):
                raise OpInputError(
                    f"{p.name}: expected a torch.Tensor {_describe_param(p)}, "
                    f"got {type(t).__name__}"
                )
            check_layout(p.name, t)
            if t.device != device:
                raise OpInputError(
                    f"{p.name}: expected device {device} ({device_of}), got {t.device}"
                )
            expected = [d if isinstance(d, int) else sym[d] for d in p.shape]
            if list(t.shape) != expected:
                raise OpInputError(
                    f"{p.name}: expected shape {expected} ({_shape_decl(p)}), got {_shape(t)}"
                )
            ok = (
                t.dtype.is_floating_point
                if p.ty == ir.Ty.F32
                else not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)
            )
            if not ok or t.dtype in _FP8_DTYPES:
                kind = "a floating-point" if p.ty == ir.Ty.F32 else "an integer"
                raise OpInputError(
                    f"{p.name}: expected {kind} tensor ({p.ty.value} elements, e.g. "
                    f"{PARAM_DTYPE[p.ty]}), got {t.dtype}"
                )


_FP8_DTYPES = tuple(
    d for d in (getattr(torch, n, None) for n in ("float8_e4m3fn", "float8_e5m2")) if d is not None
)
#: Largest finite float32 (a larger f32 param would reach the kernel as inf).
_F32_MAX = 3.4028234663852886e38
#: Smallest positive normal float32: the least softmax_scale accepted.
_F32_MIN_NORMAL = 1.1754943508222875e-38


def is_normal_f32(v: float) -> bool:
    """Whether Python float ``v`` is a positive normal float32 value (the range of a
    softmax_scale and of a descale: a subnormal is flushed to zero by the kernels, a larger
    value overflows to inf; NaN is not)."""
    return _F32_MIN_NORMAL <= v <= _F32_MAX


def _symbolic(x) -> bool:
    """Whether ``x`` is a traced symbolic number (``torch.compile`` with dynamic shapes)."""
    return isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))


def check_softmax_scale(value) -> float:
    """``value`` as a float if it is a usable softmax scale: a real number, finite,
    positive and representable in float32; else :class:`OpInputError`."""
    if type(value) is float and _F32_MIN_NORMAL <= value <= _F32_MAX:
        return value  # the common case: the checks below would all pass (NaN fails here)
    if _symbolic(value) or torch.compiler.is_compiling():
        return value  # checked again by the op's CPU / CUDA implementation, on the real value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise OpInputError(f"softmax_scale: expected a float (finite, > 0), got {value!r}")
    f = float(value)
    if not is_normal_f32(f):
        raise OpInputError(
            f"softmax_scale: expected a finite positive float32 value, got {value!r}"
        )
    return f


# ----------------------------------------------------------------------------- fp8 descales
#: The descale arguments of an fp8 op, in kernel-ABI order (:mod:`flashgen.codegen.abi`).
DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


def is_scaled(spec: ir.Spec) -> bool:
    """Whether ``spec``'s op takes ``q_descale``, ``k_descale``, ``v_descale`` (its dtype
    record is ``scaled``: fp8_e4m3, FlashAttention-3's FP8 interface)."""
    from flashgen.codegen.dtypes import is_scaled as dtype_is_scaled

    return dtype_is_scaled(spec.dtype)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)} on {value.device}"
    return repr(value)


def block_descale_shape(name: str, dims: Dims) -> list[int]:
    """The per-block shape of descale ``name`` (:data:`DESCALE_NAMES`): ``[batch, heads_q,
    ceil(seqlen_q / 128)]`` for ``q_descale``, ``[batch, heads_kv, ceil(seqlen_k / 128)]``
    for ``k_descale`` and ``v_descale`` (:data:`flashgen.frontend.ir.FP8_DESCALE_BLOCK`
    rows per descale: ``flashgen.fp8.quantize(block_rows=128)``)."""
    rows = ir.FP8_DESCALE_BLOCK
    if name == "q_descale":
        return [dims.batch, dims.heads_q, -(-dims.seqlen_q // rows)]
    return [dims.batch, dims.heads_kv, -(-dims.seqlen_k // rows)]


def is_block_form(descales) -> bool:
    """Whether resolved / checked descales (:func:`resolve_descales`,
    :func:`check_descales`) are the per-block form (3-D), not ``[B, Hkv]``."""
    return descales is not None and descales[0].dim() == 3


def resolve_descales(spec: ir.Spec, given: dict, dims: Dims, device) -> tuple | None:
    """:meth:`~flashgen.ops.prefill.attention.AttentionOp.attention`'s ``q_descale``, ``k_descale``,
    ``v_descale`` (``given``: name -> value or None) as the op's schema arguments.

    For an fp8 spec (:func:`is_scaled`): three float32 ``[B, Hkv]`` tensors on ``device``
    (q's), each from None (1.0), a Python float, a 0-d or one-element float32 tensor (all
    broadcast: an expanded view, no copy) or a float32 ``[B, Hkv]`` tensor (as is, any
    strides); query head ``h`` is dequantized with entry ``[b, h // (Hq / Hkv)]``.  When
    any of them is a 3-D tensor, all three take the per-block form
    (:func:`block_descale_shape`: ``[B, Hq, ceil(Sq / 128)]`` for q, ``[B, Hkv, ceil(Sk /
    128)]`` for k and v; row ``s`` of head ``h`` takes entry ``[b, h, s // 128]``): a 3-D
    one as is, and the others broadcast into it (a ``[B, Hkv]`` q descale repeated over the
    query heads of each kv head).  For other specs: None, and any descale given raises.
    Raises :class:`OpInputError` naming the argument, the expected and the received value
    for a wrong type, dtype, device or shape, and for non-finite or non-positive values
    (:func:`check_descale_values`: Python numbers and CPU tensors always, CUDA tensors when
    :func:`check_enabled`)."""
    if not is_scaled(spec):
        for name in DESCALE_NAMES:
            if given.get(name) is not None:
                raise OpInputError(
                    f"{name}: op {spec.name!r} has dtype {spec.dtype}; descales are "
                    f"arguments of fp8_e4m3 ops only (expected None), got "
                    f"{_describe(given[name])}"
                )
        return None
    block = any(
        isinstance(given.get(n), torch.Tensor) and given[n].dim() == 3 for n in DESCALE_NAMES
    )
    kv_shape = (dims.batch, dims.heads_kv)
    out = []
    for name in DESCALE_NAMES:
        shape = tuple(block_descale_shape(name, dims)) if block else kv_shape
        val = given.get(name)
        if val is None:
            out.append(torch.ones(shape, dtype=torch.float32, device=device))
            continue
        if isinstance(val, torch.Tensor):
            check_descale_meta(name, val, dims, device, broadcast=True, block=None)
            if val.dim() == 3 or (val.dim() == 2 and tuple(val.shape) == kv_shape):
                t = val
            else:
                t = val.reshape(1, 1)
            check_descale_values(name, t)
            out.append(_in_form(name, t, dims, shape) if block else t.expand(shape))
            continue
        if _symbolic(val) or torch.compiler.is_compiling():
            out.append(torch.full(shape, val, dtype=torch.float32, device=device))
            continue
        if isinstance(val, bool) or not isinstance(val, numbers.Real):
            raise OpInputError(
                f"{name}: expected a float32 tensor [batch, heads_kv] = {list(kv_shape)} or "
                f"the per-block {block_descale_shape(name, dims)}, a 0-d or one-element one, "
                f"or a Python float, got {_describe(val)}"
            )
        f = float(val)
        if not is_normal_f32(f):
            raise OpInputError(
                f"{name}: expected a finite positive float32 descale, got {val!r}"
            )
        out.append(torch.full(shape, f, dtype=torch.float32, device=device))
    return tuple(out)


def _in_form(name: str, t, dims: Dims, shape: tuple):
    """Descale ``t`` (3-D per block, ``[B, Hkv]`` or ``[1, 1]``, checked) as the per-block
    ``shape`` of ``name``: a 3-D one as is, the others expanded (a ``[B, Hkv]`` q descale
    first repeated over each kv head's query heads)."""
    if t.dim() == 3:
        return t
    if t.shape[1] == 1:
        return t.reshape(t.shape[0], 1, 1).expand(shape)
    if name == "q_descale" and dims.heads_q != dims.heads_kv:
        t = t.repeat_interleave(dims.heads_q // dims.heads_kv, dim=1)
    return t.unsqueeze(2).expand(shape)


def check_descale_meta(
    name: str, t, dims: Dims, device, *, broadcast: bool = False, block: bool | None = False
) -> None:
    """``t`` is a float32 tensor on ``device`` of shape ``[B, Hkv]`` (``block`` False), of the
    per-block shape :func:`block_descale_shape` (``block`` True), or of either (``block``
    None); ``broadcast``: or 0-d, or of one element.  Else :class:`OpInputError`.  Metadata
    only."""
    shape = [dims.batch, dims.heads_kv]
    blocks = block_descale_shape(name, dims)
    forms = " (or 0-d / one element, broadcast)" if broadcast else ""
    heads = "heads_q" if name == "q_descale" else "heads_kv"
    seq = "seqlen_q" if name == "q_descale" else "seqlen_k"
    per_block = f"[batch, {heads}, ceil({seq} / {ir.FP8_DESCALE_BLOCK})] = {blocks}"
    if block is None:
        wanted = f"[batch, heads_kv] = {shape} (k's) or the per-block {per_block}"
    elif block:
        wanted = f"the per-block {per_block}"
    else:
        wanted = f"[batch, heads_kv] = {shape} (k's)"
    if not isinstance(t, torch.Tensor):
        raise OpInputError(f"{name}: expected a float32 tensor {wanted}{forms}, got {_describe(t)}")
    if t.dtype != torch.float32:
        raise OpInputError(f"{name}: expected dtype torch.float32, got {t.dtype}")
    if t.device != device:
        raise OpInputError(f"{name}: expected device {device} (q's device), got {t.device}")
    one = broadcast and t.numel() == 1 and t.dim() <= 2
    fits = (block is not True and list(t.shape) == shape) or (
        block is not False and list(t.shape) == blocks
    )
    if not one and not fits:
        raise OpInputError(f"{name}: expected shape {wanted}{forms}, got {_shape(t)}")


def check_descale_values(name: str, t) -> None:
    """Every entry of descale ``t`` is finite and at least the smallest normal float32 (the
    range a Python float descale must lie in: a subnormal one is flushed to zero by the
    kernels' arithmetic); else :class:`OpInputError` with the first offending entry.  Reads
    the values of CPU tensors always and of CUDA tensors only when :func:`check_enabled` (a
    device sync; the debugging switch the varlen and decode value checks use); never while
    ``torch.compile`` traces (no values there)."""
    if t.numel() == 0 or torch.compiler.is_compiling():
        return
    if t.device.type != "cpu" and not check_enabled():
        return
    bad = ~(torch.isfinite(t) & (t >= _F32_MIN_NORMAL))
    if bool(bad.any()):
        idx = [int(i) for i in bad.nonzero()[0]]
        raise OpInputError(
            f"{name}: expected finite positive descales, got {t[tuple(idx)].item()!r} at index "
            f"{idx} (a descale is a normal float32, >= {_F32_MIN_NORMAL:.7g})"
        )


def check_descales(spec: ir.Spec, descales, dims: Dims, device, *, values: bool = True) -> None:
    """The descale arguments of an fp8 op's schema (float32 on q's device, finite and
    positive: :func:`check_descale_meta`, :func:`check_descale_values` when ``values``), as
    its CPU, CUDA and fake implementations receive them: all three ``[B, Hkv]``, or all three
    per block (:func:`block_descale_shape`) when ``q_descale`` is 3-D."""
    q = descales[0]
    block = isinstance(q, torch.Tensor) and q.dim() == 3
    for name, t in zip(DESCALE_NAMES, descales, strict=True):
        check_descale_meta(name, t, dims, device, block=block)
        if values:
            check_descale_values(name, t)


def check_scalar(p: ir.Param, val) -> int | float:
    """Check one scalar param value against its declaration; return it as int / float.

    i32: an integer (not bool) in int32 range; f32: a real number, finite and within
    float32 range.  Either must lie within the param's declared ``min``/``max`` (or
    ``above``/``below``, named so in the message).
    Raises :class:`OpInputError` naming the param, the expected and the received value.
    While ``torch.compile`` traces (a changed float becomes symbolic) the value is passed
    through: the op's CPU and CUDA implementations check it again on the real value.
    """
    if _symbolic(val) or torch.compiler.is_compiling():
        return val  # checked again by the op's CPU / CUDA implementation, on the real value
    if p.ty == ir.Ty.I32:
        if isinstance(val, bool) or not isinstance(val, numbers.Integral):
            raise OpInputError(f"{p.name}: expected an int (i32), got {val!r}")
        out: int | float = int(val)
        if not -(2**31) <= out < 2**31:
            raise OpInputError(f"{p.name}: expected an i32 value, got {val} (out of range)")
    else:
        if isinstance(val, bool) or not isinstance(val, numbers.Real):
            raise OpInputError(f"{p.name}: expected a float (f32), got {val!r}")
        out = float(val)
        if not math.isfinite(out):
            raise OpInputError(f"{p.name}: expected a finite float (f32), got {val!r}")
        if abs(out) > _F32_MAX:
            raise OpInputError(
                f"{p.name}: expected a float32 value, got {val!r} (out of float32 range)"
            )
    low, high = p.minimum is not None and out < p.minimum, p.maximum is not None and out > p.maximum
    if low or high:  # the bound as declared: above: 0 is held as the least float32 above 0
        word, bound = next((w, b) for w, b in p.bounds() if (w in ("min", "above")) == low)
        cmp = {"min": ">=", "above": ">", "max": "<=", "below": "<"}[word]
        raise OpInputError(
            f"{p.name}: expected a value {cmp} {bound} (declared {word}), got {val!r}"
        )
    return out


def _shape_decl(p: ir.Param) -> str:
    return "[" + ", ".join(str(d) for d in p.shape) + "]"


def _describe_param(p: ir.Param) -> str:
    if p.kind == "tensor":
        return f"(tensor {_shape_decl(p)} of {p.ty.value})"
    return f"({p.ty.value}, default {p.default!r})"


def resolve_params(spec: ir.Spec, params: dict, grads: dict | None = None) -> tuple[list, list]:
    """Op keyword params -> (scalar values, tensor values), each in spec order.

    Missing scalars take their spec default; unknown names, a missing tensor param, and
    any value :func:`check_scalar` rejects (a non-integer for an ``i32`` param, a
    non-finite or non-number for an ``f32`` param, a value outside the declared
    ``min``/``max``) raise :class:`OpInputError`.  A scalar may also be a 0-d CPU
    tensor; a CUDA tensor is refused (reading it would synchronize the device).  One that
    requires grad (while grad mode is on) is recorded in ``grads`` (name -> tensor) when
    the caller differentiates it (``grads`` given: :meth:`AttentionOp.attention
    <flashgen.ops.prefill.attention.AttentionOp.attention>`), else raises ``NotImplementedError``
    (its gradient would be silently dropped).
    """
    valid = [p.name for p in spec.params]
    for name in params:
        if name not in valid:
            listing = ", ".join(f"{p.name} {_describe_param(p)}" for p in spec.params)
            raise OpInputError(
                f"{name}: unknown param for op {spec.name!r}; valid params: {listing or '(none)'}"
            )
    scalars: list = []
    for p in spec.scalar_params:
        val = params.get(p.name, p.default)
        if val is None:
            raise OpInputError(f"{p.name}: missing scalar param {_describe_param(p)}")
        if isinstance(val, torch.Tensor) and val.dim() == 0:
            if val.device.type != "cpu":
                raise OpInputError(
                    f"{p.name}: expected a Python number or a CPU scalar tensor, got a tensor "
                    f"on {val.device} (reading it would synchronize the device)"
                )
            if val.requires_grad and torch.is_grad_enabled():
                if grads is None:  # .item() would drop its gradient without a word
                    raise NotImplementedError(
                        f"flashgen::{spec.name}: this call does not differentiate scalar "
                        f"param '{p.name}' (op.attention does); pass {p.name}.item() (a "
                        f"number) or {p.name}.detach()"
                    )
                grads[p.name] = val
            val = val.item()
        scalars.append(check_scalar(p, val))
    tensors = [params.get(p.name) for p in spec.tensor_params]
    return scalars, tensors


def default_softmax_scale(spec: ir.Spec) -> float:
    """``spec.softmax_scale``, or 1/sqrt(head_dim) for ``auto``."""
    if spec.softmax_scale is not None:
        return float(spec.softmax_scale)
    return 1.0 / math.sqrt(spec.head_dim)


# ----------------------------------------------------------------------------- debugging hook
@contextlib.contextmanager
def poison_outputs(enabled: bool = True):
    """Within the block, the CUDA kernel fills ``o`` and ``lse`` with NaN before launch.

    Lets tests prove the kernel writes every output element.  The environment variable
    :data:`flashgen.env.POISON_OUTPUTS` set to 1 does the same for a whole process.
    """
    global _POISON
    old, _POISON = _POISON, enabled
    try:
        yield
    finally:
        _POISON = old


def _poison_enabled() -> bool:
    return _POISON or bool(env.flag(env.POISON_OUTPUTS))


# ----------------------------------------------------------------------------- target choice
def target_for_device(spec: ir.Spec, device: torch.device) -> str:
    """Kernel target for a CUDA ``device``: ``sm_90`` on 9.x, ``sm_80`` on 8.x and on 10.x
    and newer (through the units' compute_80 PTX), as
    :func:`flashgen.codegen.abi.target_for_capability` says.

    On 9.x the plan is built for ``sm_90`` even when the spec lists only ``sm_80``: the
    sm_80 template then compiles for sm_90a (faster there than the JIT of its PTX).
    Raises ``RuntimeError`` below compute capability 8.0, and for an fp8 spec anywhere but
    9.x.
    """
    major, minor = torch.cuda.get_device_capability(device)
    if spec.dtype in ir.FP8_DTYPES and major != 9:
        raise RuntimeError(
            f"op {spec.name!r} has dtype {spec.dtype}: its kernel (the Hopper FP8 forward) "
            f"needs a compute capability 9.x GPU; {device} is {major}.{minor}"
        )
    try:
        return target_for_capability(major, minor)
    except ValueError as e:
        raise RuntimeError(f"{device}: {e}") from None


def check_enabled() -> bool:
    """Whether :data:`flashgen.env.VARLEN_CHECK` is set to 1 (read at each call): varlen and decode
    calls then check their offsets and lengths on the host."""
    return bool(env.flag(env.VARLEN_CHECK))
