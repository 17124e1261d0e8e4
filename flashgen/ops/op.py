"""A checked spec -> a PyTorch operator ``torch.ops.flashgen.<name>``.

:func:`build_op` registers, once per process and spec name, an operator with schema::

    <name>(Tensor q, Tensor k, Tensor v, float softmax_scale,
           <int|float scalar params, spec order>, <Tensor params, spec order>,
           *, bool deterministic=False) -> (Tensor, Tensor)

with a CUDA kernel (render -> nvcc -> cache -> CuPy launch), a CPU kernel (the
materialized float32 reference), a fake kernel (so ``torch.compile`` traces it) and an
autograd registration whose backward is the op ``<name>__backward`` (see
:mod:`flashgen.ops.backward`).

The user entry point is :meth:`AttentionOp.attention`, which validates its inputs up
front (:func:`validate`, also run by every kernel) and fills in defaults.  On plain CUDA
tensors in eager mode it launches the forward itself (:func:`_eager_cuda`; training through
``_EagerAttention``, whose backward is the registered one), which saves the dispatcher's
and the custom-op autograd wrapper's host time; everywhere else it calls the operator.

``deterministic`` does not change the forward (its impls ignore it); it is a schema
argument so that it reaches the autograd ``setup_context`` the same way in eager mode,
under ``torch.compile(fullgraph=True)`` and in opcheck, and picks the backward kernels
(see :mod:`flashgen.ops.backward`).

Op contract (README.md, section "Op contract"):

    q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv], all of the spec's dtype,
    on one device, any strides with stride(-1) == 1; Hq % Hkv == 0.
    o [B, Hq, Sq, Dv] in the input dtype (bf16 for fp8 inputs), contiguous;
    lse [B, Hq, Sq] float32, natural log, contiguous.
    A row with nothing to attend to: o = 0, lse = -inf.  B, Sq or Sk = 0: no launch.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import os
import sys
import threading
import warnings
from dataclasses import dataclass, replace

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from flashgen.analysis.indexbounds import IndexBoundsWarning, possible_violations
from flashgen.envflags import POISON_ENV, SIDE_TERMS_ENV, flag
from flashgen.frontend import ir
from flashgen.frontend.errors import OpInputError, SpecError
from flashgen.frontend.offsets import is_offsets_spec
from flashgen.lower import (
    SPARSE_TILES_ENV,
    hopper_eligible,
    hopper_tiles,
    kernel_family,
    needs_block_table,
    persistent_forward,
    sparse_persistent,
    sparse_tiles,
)
from flashgen.ops.density import bucket

#: torch dtype of each spec dtype.
TORCH_DTYPE = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": getattr(torch, "float8_e4m3fn", None),
}
#: torch dtype of a tensor param's element type.
PARAM_DTYPE = {ir.Ty.F32: torch.float32, ir.Ty.I32: torch.int32}
_SCHEMA_TYPE = {ir.Ty.I32: "int", ir.Ty.F32: "float"}

#: One torch library fragment per registered spec name (its forward, backward and fake
#: kernels), so a failed registration or a reload can be undone whole (``_destroy``).
_LIBS: dict[str, torch.library.Library] = {}
_REGISTRY: dict[str, AttentionOp] = {}
_REG_LOCK = threading.RLock()
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
    shapes, strides, dtypes and devices: never tensor contents (no device sync).
    """
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
    want = TORCH_DTYPE[spec.dtype]
    qs, ks, vs = q.shape, k.shape, v.shape
    if not (len(qs) == len(ks) == len(vs) == 4 and q.dtype == k.dtype == v.dtype):
        return None
    if q.dtype != want and not (q.dtype == torch.float32 and q.device.type == "cpu"):
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
    if k.device != dev or v.device != dev:
        return None
    return Dims(batch, hq, hkv, sq, sk, vs[3])


def _check_qkv(spec: ir.Spec, q, k, v) -> Dims:
    """Every check of q, k, v in turn, raising :class:`OpInputError` at the first failure."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise OpInputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
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


def check_input_dtype(spec: ir.Spec, name: str, t, q) -> None:
    """``t`` (the input called ``name``) has the spec's dtype, or float32 on CPU
    (:func:`flashgen.ops.cpu_attention.cpu_input_dtypes`), and q's dtype; else
    :class:`OpInputError`."""
    want = TORCH_DTYPE[spec.dtype]
    ok = t.dtype == want or (t.dtype == torch.float32 and t.device.type == "cpu")
    if not ok or t.dtype != q.dtype:
        also = "; float32 also on CPU, the same for q, k and v"
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
    spec: ir.Spec, tensor_params: dict | None, device, sym: dict, device_of: str = "q's device"
) -> None:
    """Check each tensor param (present, a tensor on ``device``, the declared shape with the
    shape symbols valued by ``sym`` (see :meth:`Dims.symbols`), the declared element kind);
    :class:`OpInputError` otherwise.  Metadata only.  ``device_of`` names where ``device``
    comes from in the error message."""
    if spec.tensor_params:
        tensor_params = tensor_params or {}
        for p in spec.tensor_params:
            t = tensor_params.get(p.name)
            if t is None:
                raise OpInputError(f"{p.name}: missing tensor param {_describe_param(p)}")
            if not isinstance(t, torch.Tensor):
                raise OpInputError(
                    f"{p.name}: expected a torch.Tensor {_describe_param(p)}, "
                    f"got {type(t).__name__}"
                )
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
    if not (math.isfinite(f) and _F32_MIN_NORMAL <= f <= _F32_MAX):
        raise OpInputError(
            f"softmax_scale: expected a finite positive float32 value, got {value!r}"
        )
    return f


def check_scalar(p: ir.Param, val) -> int | float:
    """Check one scalar param value against its declaration; return it as int / float.

    i32: an integer (not bool) in int32 range; f32: a real number, finite and within
    float32 range.  Either must lie within the param's declared ``min``/``max``.
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
    if p.minimum is not None and out < p.minimum:
        raise OpInputError(f"{p.name}: expected a value >= {p.minimum} (declared min), got {val!r}")
    if p.maximum is not None and out > p.maximum:
        raise OpInputError(f"{p.name}: expected a value <= {p.maximum} (declared max), got {val!r}")
    return out


def _shape_decl(p: ir.Param) -> str:
    return "[" + ", ".join(str(d) for d in p.shape) + "]"


def _describe_param(p: ir.Param) -> str:
    if p.kind == "tensor":
        return f"(tensor {_shape_decl(p)} of {p.ty.value})"
    return f"({p.ty.value}, default {p.default!r})"


def resolve_params(spec: ir.Spec, params: dict) -> tuple[list, list]:
    """Op keyword params -> (scalar values, tensor values), each in spec order.

    Missing scalars take their spec default; unknown names, a missing tensor param, and
    any value :func:`check_scalar` rejects (a non-integer for an ``i32`` param, a
    non-finite or non-number for an ``f32`` param, a value outside the declared
    ``min``/``max``) raise :class:`OpInputError`.  A scalar may also be a 0-d CPU
    tensor; a CUDA tensor is refused (reading it would synchronize the device), one that
    requires grad raises ``NotImplementedError`` (its gradient would be silently dropped).
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
            if val.requires_grad:  # .item() would drop its gradient without a word
                raise NotImplementedError(
                    f"flashgen::{spec.name}: gradients with respect to scalar param "
                    f"'{p.name}' are not supported; pass {p.name}.item() (a number) or "
                    f"{p.name}.detach()"
                )
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
    ``FLASHGEN_POISON_OUTPUTS=1`` does the same for a whole process.
    """
    global _POISON
    old, _POISON = _POISON, enabled
    try:
        yield
    finally:
        _POISON = old


def _poison_enabled() -> bool:
    return _POISON or (POISON_ENV in os.environ and bool(flag(POISON_ENV)))


# ----------------------------------------------------------------------------- target choice
def target_for_device(spec: ir.Spec, device: torch.device) -> str:
    """Kernel target for a CUDA ``device``: ``sm_90`` on 9.x, ``sm_80`` on 8.x.

    On 9.x the plan is built for ``sm_90`` even when the spec lists only ``sm_80``: the
    sm_80 template then compiles for sm_90a (an sm_80 cubin does not load there).
    Raises ``RuntimeError`` for other compute capabilities.
    """
    major, minor = torch.cuda.get_device_capability(device)
    if major == 9:
        return "sm_90"
    if major == 8:
        return "sm_80"
    raise RuntimeError(
        f"flashgen kernels need a compute capability 8.x or 9.x GPU; {device} is {major}.{minor}"
    )


# ----------------------------------------------------------------------------- the op
class AttentionOp:
    """The op generated for one spec; build it with :func:`build_op` or ``flashgen.load``.

    Attributes: ``spec`` (the checked :class:`~flashgen.frontend.ir.Spec`), ``name``, ``qualname``
    (``"flashgen::<name>"``).  Call :meth:`attention` (also ``op(q, k, v, ...)``).
    """

    def __init__(self, spec: ir.Spec):
        self.spec = spec
        self.name = spec.name
        self.qualname = f"flashgen::{spec.name}"
        self._kernels: dict[tuple[int, str], object] = {}
        #: whether a call may run the sparse-mask tiles (lower.sparse_tiles of the Hopper
        #: kernel's tiles), and per (seqlen_q, seqlen_k, scalars) whether it does
        self._sparse_possible = hopper_eligible(spec, "sm_90") and (
            sparse_tiles(spec, hopper_tiles(spec)) is not None
        )
        self._sparse_calls: dict[tuple, bool] = {}
        self._sparse_buckets: dict[tuple, bool] = {}  # the same per density.bucket of each length
        #: positions (in spec order) of the scalar params the mask reads: the others (a
        #: score_mod's float, say) do not change the estimate, so they are no part of its key
        self._sparse_scalars = tuple(
            i for i, p in enumerate(spec.scalar_params) if _mask_reads(spec, p.name)
        )
        self._varlen_op: AttentionOp | None = None
        #: the global-position form (``op.offsets``), and whether this op is one
        self._offsets_op: AttentionOp | None = None
        self._offsets_form = is_offsets_spec(spec)
        self._kernel_lock = threading.Lock()
        #: whether the mask reads tensor params (a block table); asked on every call
        self._block_table = needs_block_table(spec)
        #: (Dims, scalar values) whose tensor-param subscripts were bounded (indexbounds)
        self._bounds_seen: set = set()
        #: set when ``flashgen.load`` of the edited spec file replaced this op's registration
        self._replaced_by: str | None = None

    def _check_live(self) -> None:
        """Raise ``RuntimeError`` if a reload of the edited spec replaced this op."""
        if self._replaced_by is not None:
            raise RuntimeError(
                f"op {self.qualname} was replaced when flashgen.load reloaded the edited spec "
                f"{self._replaced_by}; use the op that flashgen.load returned then"
            )

    def __repr__(self) -> str:
        return f"<flashgen op {self.qualname} ({self.spec.dtype}, head_dim {self.spec.head_dim})>"

    @property
    def torch_op(self):
        """``torch.ops.flashgen.<name>.default``."""
        return getattr(torch.ops.flashgen, self.name).default

    @property
    def varlen(self) -> AttentionOp:
        """This variant over packed variable-length sequences (FlashAttention's varlen
        interface, see :mod:`flashgen.ops.varlen`): the op of the same spec with ``varlen:
        true``, registered as ``flashgen::<name>__varlen`` with this op.  Call it as
        ``op.varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)``.
        A varlen spec's op is its own varlen form."""
        if self.spec.varlen:
            return self
        if self._varlen_op is None:  # built once, outside any torch.compile trace after that
            from flashgen.ops.varlen import varlen_spec

            self._varlen_op = build_op(varlen_spec(self.spec))
        return self._varlen_op

    @property
    def offsets(self) -> AttentionOp:
        """This variant at global positions (:mod:`flashgen.frontend.offsets`): the op of
        ``<name>__offsets``, whose mask and score_mod see ``q_idx + q_offset``,
        ``kv_idx + kv_offset`` and the global lengths; built on first use (touch it once
        before ``torch.compile`` traces a call with offsets).  :meth:`attention` runs it when
        given ``q_offset``, ``kv_offset``, ``seqlen_q_global`` or ``seqlen_k_global``.  An
        offsets op is its own offsets form."""
        if self._offsets_form:
            return self
        if self._offsets_op is None:
            from flashgen.frontend.offsets import offsets_spec

            self._offsets_op = build_op(offsets_spec(self.spec))
        return self._offsets_op

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.spec.params)

    def attention(
        self,
        q,
        k,
        v,
        *,
        softmax_scale: float | None = None,
        deterministic: bool = False,
        block_mask=None,
        q_offset: int | None = None,
        kv_offset: int | None = None,
        seqlen_q_global: int | None = None,
        seqlen_k_global: int | None = None,
        **params,
    ):
        """Run the attention variant: returns ``(o, lse)``.

        q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] in the spec's dtype on
        one device, stride(-1) == 1 (``(B, S, H, D)`` storage viewed with
        ``.transpose(1, 2)`` is fine); Hq % Hkv == 0.  ``softmax_scale`` defaults to the
        spec's value (``auto``: 1/sqrt(D)).  ``params`` are the spec's params by name:
        scalars default to their declared value, tensors (declared shape, f32/i32
        elements, same device) are required.

        ``deterministic`` only affects the backward: True always uses the no-atomics
        kernels (bitwise reproducible dq, dk, dv).  False allows the faster atomic-dQ
        kernels (dq not bitwise reproducible): on sm_90 the Hopper wgmma backward for the
        specs it takes (:func:`flashgen.ops.backward.backward_path`), elsewhere the FA2-class
        atomic kernels only where the environment variable ``FLASHGEN_ATOMIC_DQ=1`` is set
        (else the deterministic ones); ``FLASHGEN_ATOMIC_DQ=0`` keeps every atomic path off.
        Must be a bool (else :class:`OpInputError`).

        ``block_mask`` (only for specs whose mask reads tensor params, e.g. document
        masking): a :class:`~flashgen.ops.blockmask.BlockMask` from :meth:`block_mask` for these
        sequence lengths and the same param values, reused across calls; without it the
        CUDA op runs the block-table pre-pass on every call.  The CPU op ignores it.

        Returns o [B, Hq, Sq, Dv] in the input dtype (bf16 for fp8) and lse float32
        [B, Hq, Sq] (natural log; -inf with o = 0 for rows that attend to nothing).

        ``q_offset``, ``kv_offset``, ``seqlen_q_global``, ``seqlen_k_global`` (ints): this
        call is a slice of a longer sequence -- q holds global rows ``q_offset ..
        q_offset + Sq - 1`` of ``seqlen_q_global``, k / v keys ``kv_offset .. kv_offset + Sk
        - 1`` of ``seqlen_k_global`` -- and the mask and score_mod see global positions
        (:meth:`offsets`; tensor params declared with a ``seqlen_q`` / ``seqlen_k`` dim are
        passed sliced like q / like k).  Offsets default to 0, the global lengths to
        ``q_offset + Sq`` and ``kv_offset + Sk``.  Used by
        :func:`flashgen.distributed.ring_attention`.

        Raises :class:`OpInputError` for bad inputs (message names the argument, the
        expected and the received value).

        Plain CUDA tensors in eager mode skip the dispatcher (the same kernels and results,
        less host time per call); under ``torch.compile`` or ``torch.jit.trace``, a
        torch-function or dispatch mode, a functorch transform, with tensor subclasses or
        CPU tensors this calls ``torch.ops.flashgen.<name>``.
        """
        self._check_live()
        if self._offsets_form or not (
            q_offset is None and kv_offset is None and seqlen_q_global is None
            and seqlen_k_global is None
        ):  # fmt: skip
            from flashgen.ops.offsets import offsets_values

            pos = offsets_values(q, k, q_offset, kv_offset, seqlen_q_global, seqlen_k_global)
            if not self._offsets_form:
                return self.offsets.attention(
                    q, k, v, softmax_scale=softmax_scale, deterministic=deterministic,
                    block_mask=block_mask, **pos, **params,
                )  # fmt: skip
            params = {**params, **pos}
        scalars, tensors = resolve_params(self.spec, params)
        tensor_map = self._tensor_map(tensors)
        dims = validate(self.spec, q, k, v, tensor_map)
        if softmax_scale is None:
            softmax_scale = default_softmax_scale(self.spec)
        softmax_scale = check_softmax_scale(softmax_scale)
        if not isinstance(deterministic, bool):
            raise OpInputError(f"deterministic: expected a bool, got {deterministic!r}")
        table = None
        if block_mask is not None:
            table = self._block_mask_table(block_mask, q, dims, scalars)
        if _eager_cuda(q, k, v):
            param_grad = any(t.requires_grad for t in tensors)  # refused by the op path
            if not torch.is_grad_enabled() or not (
                q.requires_grad or k.requires_grad or v.requires_grad or param_grad
            ):
                return self._forward(q, k, v, dims, softmax_scale, scalars, tensor_map, table)
            if not param_grad:
                return _EagerAttention.apply(
                    self, dims, softmax_scale, scalars, tensors, table, deterministic, q, k, v
                )
        extra = [table] if self._block_table else []
        return self.torch_op(
            q, k, v, softmax_scale, *scalars, *tensors, *extra, deterministic=deterministic
        )

    def block_mask(
        self,
        seqlen_q: int,
        seqlen_k: int,
        *,
        batch: int | None = None,
        num_heads: int | None = None,
        num_heads_kv: int | None = None,
        device=None,
        **params,
    ):
        """Build the block table of this op's tensor-reading mask for one problem size,
        to reuse across :meth:`attention` calls (FlexAttention's ``create_block_mask``).

        ``params``: the spec's params by name, as for :meth:`attention` (tensors required,
        scalars default to their declared values).  ``batch`` / ``num_heads`` /
        ``num_heads_kv`` default to what the tensor params' declared shapes imply, else 1
        (they only matter where the mask reads ``b`` / ``h``).  ``device`` defaults to the
        tensor params' device.  On a CUDA device the generated pre-pass kernel builds the
        table for the forward kernel's tiles; on CPU the brute-force reference builds it.

        Returns a :class:`~flashgen.ops.blockmask.BlockMask`.  Raises :class:`OpInputError` if
        the spec's mask reads no tensor param, or for bad sizes or params.
        """
        from flashgen.lower import block_table_dims, choose_tiles
        from flashgen.ops.blockmask import BlockMask, block_table_reference

        if not needs_block_table(self.spec):
            raise OpInputError(
                f"block_mask: the mask of op {self.spec.name!r} reads no tensor param, so it "
                f"needs no block table (its tiles are classified from indices)"
            )
        scalars, tensors = resolve_params(self.spec, params)
        tmap = self._tensor_map(tensors)
        given = {"batch": batch, "num_heads": num_heads, "num_heads_kv": num_heads_kv}
        for p in self.spec.tensor_params:
            t = tmap.get(p.name)
            if isinstance(t, torch.Tensor) and t.dim() == len(p.shape):
                for d, n in zip(p.shape, t.shape, strict=True):
                    if d in given and given[d] is None:
                        given[d] = int(n)
        sizes = {k: 1 if val is None else val for k, val in given.items()}
        if given["num_heads_kv"] is None:
            sizes["num_heads_kv"] = sizes["num_heads"]
        for name, n in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k), *sizes.items()):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise OpInputError(f"{name}: expected a non-negative int, got {n!r}")
        first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
        if device is None:
            device = first.device if first is not None else torch.device("cpu")
        device = torch.device(device)
        dims = Dims(
            sizes["batch"], sizes["num_heads"], sizes["num_heads_kv"], seqlen_q, seqlen_k, 0
        )
        validate_tensor_params(self.spec, tmap, device, dims.symbols(), "the block mask's device")
        values = dict(zip((p.name for p in self.spec.scalar_params), scalars, strict=True))
        per_b, per_h = block_table_dims(self.spec)
        if device.type == "cuda":
            kern = self.kernel(device)
            tiles = kern.plan.tiles
            table = self._run_block_table(device, tiles, dims, scalars, tmap)
        else:
            tiles = choose_tiles(self.spec, "sm_80")
            table = block_table_reference(
                self.spec, tiles, batch=dims.batch, heads_q=dims.heads_q, seqlen_q=seqlen_q,
                seqlen_k=seqlen_k, params={**values, **tmap}, device=device,
                heads_kv=dims.heads_kv,
            )  # fmt: skip
        used = {p.name for p in self.spec.scalar_params if _mask_reads(self.spec, p.name)}
        return BlockMask(
            spec_name=self.spec.name,
            table=table,
            block_m=tiles.block_m,
            block_n=tiles.block_n,
            batch=dims.batch if per_b else 1,
            heads_q=dims.heads_q if per_h else 1,
            seqlen_q=seqlen_q,
            seqlen_k=seqlen_k,
            scalars={n: v for n, v in values.items() if n in used},
            heads_kv=dims.heads_kv if _mask_reads(self.spec, "h_kv") else None,
        )

    def _block_mask_table(self, bm, q, dims: Dims, scalars):
        """The table tensor of ``bm`` after checking it fits this call (metadata only)."""
        from flashgen.ops.blockmask import BlockMask

        if not needs_block_table(self.spec):
            raise OpInputError(
                f"block_mask: op {self.spec.name!r} takes none (its mask reads no tensor "
                f"param), got {type(bm).__name__}"
            )
        if not isinstance(bm, BlockMask):
            raise OpInputError(
                f"block_mask: expected a BlockMask from op.block_mask(...), got {type(bm).__name__}"
            )
        if bm.spec_name != self.spec.name:
            raise OpInputError(
                f"block_mask: expected one built by op {self.spec.name!r}, got one built "
                f"by {bm.spec_name!r}"
            )
        want = (dims.seqlen_q, dims.seqlen_k)
        if (bm.seqlen_q, bm.seqlen_k) != want:
            raise OpInputError(
                f"block_mask: expected (seqlen_q, seqlen_k) = {want} (q's and k's), got "
                f"({bm.seqlen_q}, {bm.seqlen_k}); build one per problem size"
            )
        if bm.heads_kv is not None and bm.heads_kv != dims.heads_kv:
            raise OpInputError(
                f"block_mask: built for num_heads_kv={bm.heads_kv} (the mask reads h_kv), but "
                f"k has {dims.heads_kv} heads; build one per head count"
            )
        values = dict(zip((p.name for p in self.spec.scalar_params), scalars, strict=True))
        for name, val in bm.scalars.items():
            if values[name] != val:
                raise OpInputError(
                    f"block_mask: built with {name}={val!r}, but this call has "
                    f"{name}={values[name]!r}; build it again with the new value"
                )
        if bm.table.device != q.device:
            raise OpInputError(
                f"block_mask: expected device {q.device} (q's device), got {bm.table.device}"
            )
        return bm.op_arg()  # carries its tiles: the CUDA impl checks them against its kernel's

    def _run_block_table(self, device, tiles, dims: Dims, scalars, tensors: dict):
        """Launch the block-table pre-pass for ``tiles`` on ``device`` (current stream);
        returns the uint8 table (see :func:`flashgen.lower.plan_block_table`)."""
        from flashgen.lower import block_table_shape

        kern = self._block_table_kernel(device, tiles)
        shape = block_table_shape(
            self.spec, tiles, dims.batch, dims.heads_q, dims.seqlen_q, dims.seqlen_k
        )
        table = torch.empty(shape, dtype=torch.uint8, device=device)
        if table.numel() == 0:
            return table
        values = kernel_values(self.spec, {"tab": table}, dims, 1.0, scalars, tensors)
        values.update(tab_b=shape[0], tab_h=shape[1])
        kern.launch((table.numel(), 1, 1), values, current_stream_ptr(device))
        return table

    def _block_table_kernel(self, device, tiles):
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = ("blockmask", index, tiles)
        kern = self._kernels.get(key)
        if kern is None:
            with self._kernel_lock:
                kern = self._kernels.get(key)
                if kern is None:
                    from flashgen.build import cache
                    from flashgen.build.render import render
                    from flashgen.lower import plan_block_table
                    from flashgen.runtime import launch as runtime

                    plan = plan_block_table(self.spec, target_for_device(self.spec, device), tiles)
                    cubin, _report = cache.get_or_build(render(plan), plan)
                    kern = runtime.load(cubin, plan, index)
                    self._kernels[key] = kern
        return kern

    def with_kvcache(self, q, k_cache, v_cache, cache_seqlens, **kwargs):
        """Attention against a dense or paged KV cache, appending ``k_new``/``v_new`` first
        (FlashAttention's ``flash_attn_with_kvcache``): ``(o, lse)``.  See
        :meth:`flashgen.ops.decode.DecodeOp.with_kvcache` for the arguments and contract."""
        from flashgen.ops.decode import decode_op

        return decode_op(self).with_kvcache(q, k_cache, v_cache, cache_seqlens, **kwargs)

    def plan_decode(self, **kwargs):
        """A reusable schedule for :meth:`with_kvcache` calls of one shape; see
        :meth:`flashgen.ops.decode.DecodeOp.plan_decode`."""
        from flashgen.ops.decode import decode_op

        return decode_op(self).plan_decode(**kwargs)

    __call__ = attention

    # --------------------------------------------------------------------- kernels
    def _tensor_map(self, tensors) -> dict:
        return {p.name: t for p, t in zip(self.spec.tensor_params, tensors, strict=True)}

    def _split(self, rest) -> tuple[list, dict]:
        """Schema arguments after softmax_scale -> (scalars, tensor param map); a trailing
        ``block_mask`` argument (specs with a block table) is left out: see :meth:`_table_arg`."""
        n = len(self.spec.scalar_params)
        m = n + len(self.spec.tensor_params)
        return list(rest[:n]), self._tensor_map(rest[n:m])

    def _table_arg(self, rest):
        """The ``block_mask`` schema argument (a uint8 table or None)."""
        m = len(self.spec.scalar_params) + len(self.spec.tensor_params)
        return rest[m] if self._block_table and len(rest) > m else None

    def _empty_outputs(self, q, dims: Dims):
        o = torch.empty(
            (dims.batch, dims.heads_q, dims.seqlen_q, dims.head_dim_v),
            dtype=torch.float32 if q.dtype == torch.float32 else out_dtype(self.spec),
            device=q.device,
        )
        lse = torch.empty(
            (dims.batch, dims.heads_q, dims.seqlen_q), dtype=torch.float32, device=q.device
        )
        return o, lse

    def _fake_impl(self, q, k, v, softmax_scale, *rest, deterministic=False):
        scalars, tensors = self._split(rest)
        dims = validate(self.spec, q, k, v, tensors, softmax_scale=softmax_scale, scalars=scalars)
        return self._empty_outputs(q, dims)

    def _cpu_impl(self, q, k, v, softmax_scale, *rest, deterministic=False):
        from flashgen.ops.cpu_attention import attention_blocked

        scalars, tensors = self._split(rest)
        dims = validate(self.spec, q, k, v, tensors, softmax_scale=softmax_scale, scalars=scalars)
        o, lse = self._empty_outputs(q, dims)
        if lse.numel() == 0:
            return o, lse
        if dims.seqlen_k == 0:
            return o.zero_(), lse.fill_(-math.inf)
        params = dict(zip((p.name for p in self.spec.scalar_params), scalars, strict=True))
        params.update({n: t.to(PARAM_DTYPE[self.spec.param(n).ty]) for n, t in tensors.items()})
        ref_o, ref_lse = attention_blocked(
            self.spec, q, k, v, softmax_scale=softmax_scale, params=params
        )
        o.copy_(ref_o)
        lse.copy_(ref_lse)
        return o, lse

    def _check_index_bounds(self, dims: Dims, scalars) -> None:
        """Warn (:class:`~flashgen.analysis.indexbounds.IndexBoundsWarning`, once per sizes and
        scalar
        values) for each tensor-param subscript that may leave its tensor at these sizes:
        the kernels clamp it, so the result would use a clamped element
        (:func:`flashgen.analysis.indexbounds.possible_violations`)."""
        values = tuple(v.item() if isinstance(v, torch.Tensor) else v for v in scalars)
        key = (dims, values)
        if key in self._bounds_seen:
            return
        if len(self._bounds_seen) >= 1024:
            self._bounds_seen.clear()
        self._bounds_seen.add(key)
        named = {p.name: v for p, v in zip(self.spec.scalar_params, values, strict=True)}
        for line in possible_violations(self.spec, dims.symbols(), named):
            warnings.warn(line, IndexBoundsWarning, stacklevel=_caller_stacklevel())

    def _cuda_impl(self, q, k, v, softmax_scale, *rest, deterministic=False):
        scalars, tensors = self._split(rest)
        dims = validate(self.spec, q, k, v, tensors, softmax_scale=softmax_scale, scalars=scalars)
        return self._forward(q, k, v, dims, softmax_scale, scalars, tensors, self._table_arg(rest))

    def _forward(self, q, k, v, dims: Dims, softmax_scale, scalars, tensors: dict, table):
        """The CUDA forward of inputs :func:`validate` accepted (``dims`` its answer):
        ``(o, lse)``, launched on the current stream of q's device.  ``scalars`` in spec
        order, ``tensors`` by param name, ``table``: the ``block_mask`` argument or None."""
        if self.spec.tensor_params:
            self._check_index_bounds(dims, scalars)
        o, lse = self._empty_outputs(q, dims)
        if _poison_enabled():
            o.fill_(math.nan)
            lse.fill_(math.nan)
        if lse.numel() == 0:
            return o, lse
        if dims.seqlen_k == 0:
            return o.zero_(), lse.fill_(-math.inf)
        kern = self.kernel(q.device, sparse=self._sparse_call(dims, scalars))
        q, k, v = _kernel_aligned(q), _kernel_aligned(k), _kernel_aligned(v)
        values = kernel_values(
            self.spec, {"q": q, "k": k, "v": v, "o": o, "lse": lse}, dims, softmax_scale,
            scalars, tensors,
        )  # fmt: skip
        plan = kern.plan
        if plan.context["block_table"]:
            values.update(self._table_values(table, plan, dims, scalars, tensors, q.device))
        stream = current_stream_ptr(q.device)
        if plan.context.get("persistent"):
            ctas = _persistent_ctas(kern.device_index)
            grid = plan.grid(dims.batch, dims.heads_q, dims.seqlen_q, ctas)
            if plan.context["dynamic"]:
                values["tile_counter"] = _tile_counter(q.device, stream)
        else:
            grid = plan.grid(
                dims.batch, dims.heads_q, dims.seqlen_q,
                heads_kv=dims.heads_kv, seqlen_k=dims.seqlen_k,
            )  # fmt: skip
        kern.launch(grid, values, stream)
        return o, lse

    def _table_values(self, arg, plan, dims: Dims, scalars, tensors: dict, device) -> dict:
        """``blk_tab / blk_sb / blk_sh`` for the forward launch: the table of the
        ``block_mask`` argument ``arg`` (refused unless built for the plan's tiles, see
        :func:`flashgen.ops.blockmask.table_for_tiles`) or, when None, a fresh one from the
        pre-pass for those tiles."""
        from flashgen.lower import block_table_shape
        from flashgen.ops.blockmask import table_for_tiles, table_strides

        shape = block_table_shape(
            self.spec, plan.tiles, dims.batch, dims.heads_q, dims.seqlen_q, dims.seqlen_k
        )
        if arg is None:
            table = self._run_block_table(device, plan.tiles, dims, scalars, tensors)
        else:
            table = table_for_tiles(arg, shape, plan.tiles)
        sb, sh = table_strides(self.spec, table)
        return {"blk_tab": table, "blk_sb": sb, "blk_sh": sh}

    def _sparse_call(self, dims: Dims, scalars) -> bool:
        """Whether this call asks for the sparse-mask tiles (:func:`flashgen.lower.sparse_tiles`;
        :meth:`kernel` runs them where the kernel has them): the mask keeps fewer than
        :data:`~flashgen.lower.SPARSE_KEYS_PER_ROW` keys per query row at these lengths and
        scalars (:func:`flashgen.ops.density.keys_per_row`; the answer cached per op per lengths
        and per the lengths' :func:`~flashgen.ops.density.bucket`, keyed by the scalars the mask
        reads only: a loop over growing lengths (decoding) costs a few microseconds per call,
        a float param only the score_mod reads none).  Off with ``FLASHGEN_SPARSE_TILES=0``,
        read at every call."""
        if not self._sparse_possible:
            return False
        read = tuple(scalars[i] for i in self._sparse_scalars) if self._sparse_scalars else ()
        key = (dims.seqlen_q, dims.seqlen_k, *read)
        few = self._sparse_calls.get(key)
        if few is None:  # a new length: its bucket's answer, estimated once per bucket
            few = self._sparse_bucketed(dims, scalars, read)
            if len(self._sparse_calls) >= 4096:  # bounded: a loop over many lengths
                self._sparse_calls.clear()
            self._sparse_calls[key] = few
        return few and flag(SPARSE_TILES_ENV, True)

    def _sparse_bucketed(self, dims: Dims, scalars, read: tuple) -> bool:
        key = (bucket(dims.seqlen_q), bucket(dims.seqlen_k), *read)
        few = self._sparse_buckets.get(key)
        if few is None:
            from flashgen.lower import SPARSE_KEYS_PER_ROW
            from flashgen.ops.density import keys_per_row

            if len(self._sparse_buckets) >= 4096:  # bounded: a loop over many scalar values
                self._sparse_buckets.clear()
            few = keys_per_row(self.spec, dims.seqlen_q, dims.seqlen_k, tuple(scalars))
            few = self._sparse_buckets[key] = few < SPARSE_KEYS_PER_ROW
        return few

    def _sparse_key(self, base: tuple) -> tuple:
        """The cache key of the sparse kernel: ``base`` and its persistent scheduler
        (:func:`flashgen.lower.sparse_persistent`; ``FLASHGEN_SPARSE_PERSISTENT`` is read
        only where the op has a sparse kernel, and only for sparse calls and builds)."""
        sched = self._sparse_possible and sparse_persistent()
        return base + ("sparse", sched)

    def kernel(self, device: torch.device, sparse: bool = False):
        """The loaded kernel for CUDA ``device`` (built and cached on first use).

        Renders the plan for :func:`target_for_device`, compiles through the on-disk
        cache, falling back to smaller tiles if the chosen ones spill
        (:mod:`flashgen.select`), and loads it with :mod:`flashgen.runtime.launch`.  The kernel
        family follows ``FLASHGEN_KERNEL_FAMILY`` (``auto``, the default: the Hopper TMA +
        wgmma kernel on sm_90 where the spec allows; ``fa2``: the FA2-class kernel),
        read at every call, and so does ``FLASHGEN_PERSISTENT`` (``1``, ``static``, ``m_major``,
        ``dynamic``: the Hopper kernel's persistent tile scheduler,
        :func:`flashgen.lower.persistent_forward`; default ``dynamic`` for a mask that reads
        tensors, else off) and ``FLASHGEN_SIDE_TERMS`` (:mod:`flashgen.select`).  ``sparse``:
        the kernel with the tiles for masks that keep few keys per row
        (:func:`flashgen.lower.sparse_tiles`; the op's calls choose it per call,
        :meth:`_sparse_call`; not under ``FLASHGEN_PERSISTENT``), persistent where
        :func:`flashgen.lower.sparse_persistent` says so (``FLASHGEN_SPARSE_PERSISTENT``, read
        at every call), the same kernel as without where there are none (the FA2-class
        kernel).  Where the op may pick either, the
        first use builds and loads both, so a later call (a CUDA-graph capture at another
        length) never loads a kernel.
        Raises :class:`~flashgen.build.compile.CompileError` if nvcc fails.
        """
        index = device.index if device.index is not None else torch.cuda.current_device()
        family = kernel_family()
        persistent = persistent_forward(self.spec)
        base = (index, family, persistent) if persistent else (index, family)
        if not flag(SIDE_TERMS_ENV, True):  # read at every call too (to compare the two)
            base += ("per-element",)
        sparse = sparse and not persistent
        key = self._sparse_key(base) if sparse else base
        kern = self._kernels.get(key)
        if kern is not None:
            return kern
        with self._kernel_lock:
            kern = self._kernels.get(key)
            if kern is None:
                from flashgen.runtime import launch as runtime
                from flashgen.select import build_forward

                target = target_for_device(self.spec, device)
                gpu = torch.cuda.get_device_name(device)  # selects tuned tiles
                # Both tile choices at once where the op picks per call: a call at a length
                # that needs the other one (inside a CUDA-graph capture, say) loads nothing.
                both = self._sparse_possible and not persistent
                sparse_key = self._sparse_key(base)
                for want in (sparse, not sparse) if both else (sparse,):
                    k = sparse_key if want else base
                    if k not in self._kernels:
                        plan, cubin, _report = build_forward(
                            self.spec, target, gpu=gpu, family=family, sparse=want,
                            persistent=sparse_key[-1] if want else persistent,
                        )  # fmt: skip
                        self._kernels[k] = runtime.load(cubin, plan, index)
                kern = self._kernels[key]
        return kern


@functools.cache
def _sm_count(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_index`` (a persistent kernel's
    grid)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_COUNTERS: dict[tuple[int, int], int] = {}  # (device, stream) -> address (runtime.device_zeros)
_COUNTER_LOCK = threading.Lock()


def _tile_counter(device: torch.device, stream_ptr: int) -> torch.Tensor | int:
    """The work-tile counter of the dynamic persistent scheduler for a launch on CUDA stream
    ``stream_ptr``: int32 ``[2]``, zero when the kernel starts; its last CTA leaves it at zero.

    Eager launches share one per (device, stream), zeroed once: launches on one stream run
    in order, so they never use it at the same time.  It is an address from
    :func:`flashgen.runtime.launch.device_zeros`, outside torch's caching allocator: an eager call
    inside torch.compile's CUDA-graph trees (their warm-up of a new shape) has its
    allocations routed to the trees' private pool, whose memory they hand to graph tensors
    again after resetting the pool to a checkpoint.  A launch captured into a CUDA graph
    gets its own, zeroed inside the capture (a memset node before the kernel, memory from
    the graph's pool): two graphs captured on one stream and replayed on two streams at
    once, or a replay next to eager calls on the capture stream, would otherwise share it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):  # the launch's device, whichever is current
        if torch.cuda.is_current_stream_capturing():
            return torch.zeros(2, dtype=torch.int32, device=device)
    key = (index, stream_ptr)
    t = _COUNTERS.get(key)
    if t is None:
        with _COUNTER_LOCK:
            t = _COUNTERS.get(key)
            if t is None:
                from flashgen.runtime import launch as runtime

                t = _COUNTERS[key] = runtime.device_zeros(8, index, stream_ptr)
    return t


def _persistent_ctas(device_index: int) -> int:
    """CTAs of a persistent launch: the SM count, or ``FLASHGEN_PERSISTENT_CTAS`` where set
    (a debugging knob: with a few CTAs every CTA loops over many tiles, e.g. under
    ``tools/sanitize.py``).  ``ValueError`` unless it is a positive integer."""
    value = os.environ.get("FLASHGEN_PERSISTENT_CTAS")
    if not value:
        return _sm_count(device_index)
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"FLASHGEN_PERSISTENT_CTAS={value!r}: expected a positive integer")
    return int(value)


def _mask_reads(spec: ir.Spec, name: str) -> bool:
    return spec.mask is not None and any(
        isinstance(n, ir.Var) and n.name == name for n in ir.walk(spec.mask)
    )


def kernel_values(
    spec: ir.Spec, tensors: dict, dims: Dims, softmax_scale: float, scalars, tensor_params: dict
) -> dict:
    """Name -> value map for a launch under the kernel ABI (:mod:`flashgen.lower`).

    ``tensors``: the kernel's tensors by argument name (``q``, ``o``, ``lse``, ``dq`` ...);
    each 4-D one also gets its ``<name>_sb/_sh/_ss`` element strides.  Adds the problem
    sizes from ``dims``, ``softmax_scale``, the scalar params (``p_<name>``, spec order)
    and the tensor params (``t_<name>``) converted to the kernel's element type and made
    contiguous; such a copy is freed after the call returns, and the caching allocator
    reuses it only in stream order, after the kernel has read it.
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
        values[f"t_{p.name}"] = tensor_params[p.name].to(PARAM_DTYPE[p.ty]).contiguous()
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

    The kernel moves rows in 16-byte chunks (8 fp16/bf16 elements), so it needs a 16-byte
    aligned base and batch/head/seq strides that are multiples of 8 elements (strides of
    size-1 dims never move the pointer).  Any other stride(-1) == 1 view is still accepted:
    it costs one copy instead of an error or a misaligned-address fault.
    """
    (sb, sh, ss, _), (b, h, s, _) = t.stride(), t.shape
    ok = (
        t.data_ptr() % 16 == 0
        and (sb % 8 == 0 or b <= 1)
        and (sh % 8 == 0 or h <= 1)
        and (ss % 8 == 0 or s <= 1)
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


# ----------------------------------------------------------------------------- eager fast path
def _eager_cuda(q, k, v) -> bool:
    """Whether :meth:`AttentionOp.attention` may run the CUDA forward itself instead of
    going through the dispatcher (``torch.ops.flashgen.<name>``): CUDA tensors and
    :func:`_plain_eager`.  The op path costs ~40-60 us more host time per call (dispatch,
    the custom-op autograd wrapper, a second validation); the results are the same."""
    return q.is_cuda and _plain_eager(q, k, v)


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


class _EagerAttention(torch.autograd.Function):
    """Autograd node of the eager fast path: the forward launches :meth:`AttentionOp._forward`
    directly, the backward is the op's registered one (:class:`flashgen.ops.backward.Backward`),
    so gradients match the ``torch.ops.flashgen.<name>`` path exactly."""

    @staticmethod
    def forward(ctx, op, dims, softmax_scale, scalars, tensors, table, deterministic, q, k, v):
        o, lse = op._forward(q, k, v, dims, softmax_scale, scalars, op._tensor_map(tensors), table)
        ctx.op = op
        # what the op path's autograd saves, from the same function and the schema's inputs
        inputs = (q, k, v, softmax_scale, *scalars, *tensors, *([table] if op._block_table else []))
        op.backward.setup_context(ctx, inputs, (o, lse), {"deterministic": deterministic})
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        dq, dk, dv = ctx.op.backward.backward(ctx, grad_o, grad_lse)[:3]
        return (None,) * 7 + (dq, dk, dv)


# ----------------------------------------------------------------------------- registration
def _unregister(name: str, path: str) -> None:
    """Remove ``flashgen::<name>`` (with its backward and varlen companion) from the
    dispatcher and mark its op object replaced (by a reload of ``path``)."""
    op = _REGISTRY.pop(name, None)
    if op is not None:
        op._replaced_by = path
        if op._varlen_op is not None and op._varlen_op is not op:
            _unregister(op._varlen_op.name, path)
        if op._offsets_op is not None and op._offsets_op is not op:
            _unregister(op._offsets_op.name, path)
    lib = _LIBS.pop(name, None)
    if lib is not None:
        lib._destroy()


def schema(spec: ir.Spec) -> str:
    """The operator schema, e.g. ``alibi(Tensor q, Tensor k, Tensor v, float softmax_scale,
    Tensor slopes, *, bool deterministic=False) -> (Tensor, Tensor)``.

    ``deterministic`` is keyword-only with a default, so positional calls written for the
    schema without it still work; the forward ignores it and autograd hands it to the
    backward op (see :mod:`flashgen.ops.backward`).  A varlen spec's schema is
    :func:`flashgen.ops.varlen.schema`."""
    if spec.varlen:
        from flashgen.ops.varlen import schema as varlen_schema

        return varlen_schema(spec)
    args = ["Tensor q", "Tensor k", "Tensor v", "float softmax_scale"]
    args += [f"{_SCHEMA_TYPE[p.ty]} {p.name}" for p in spec.scalar_params]
    args += [f"Tensor {p.name}" for p in spec.tensor_params]
    if needs_block_table(spec):  # positional: register_autograd refuses kwarg-only tensors
        args.append("Tensor? block_mask=None")
    args += ["*", "bool deterministic=False"]
    return f"{spec.name}({', '.join(args)}) -> (Tensor, Tensor)"


def _same_spec(a: ir.Spec, b: ir.Spec) -> bool:
    return replace(a, path="", description="") == replace(b, path="", description="")


def build_op(spec: ir.Spec, *, replace: bool = False) -> AttentionOp:
    """Register ``torch.ops.flashgen.<spec.name>`` for a checked spec and return its op.

    Idempotent per process: building an equal spec again (file path and description
    aside) returns the op already registered.  Raises ``ValueError`` if a different spec
    with the same name is already registered in this process, unless ``replace``
    (``flashgen.load`` of an edited file): then the old registration is removed and the old
    op object raises ``RuntimeError`` when called.  Registration is all or nothing: if any
    step fails, nothing of it stays registered.
    """
    with _REG_LOCK:
        existing = _REGISTRY.get(spec.name)
        if existing is not None:
            if _same_spec(existing.spec, spec):
                return existing
            if not replace:
                raise ValueError(
                    f"a different spec named {spec.name!r} is already registered as "
                    f"flashgen::{spec.name} (from {existing.spec.path}); rename one of them"
                )
            _unregister(spec.name, spec.path)
        if spec.varlen:
            from flashgen.ops.varlen import VarlenBackward as backward_cls
            from flashgen.ops.varlen import VarlenOp as op_cls
        else:
            from flashgen.ops.backward import Backward as backward_cls

            op_cls = AttentionOp
        op = op_cls(spec)
        lib = torch.library.Library("flashgen", "FRAGMENT")
        try:
            lib.define(schema(spec))
            lib.impl(spec.name, op._cuda_impl, "CUDA")
            lib.impl(spec.name, op._cpu_impl, "CPU")
            torch.library.register_fake(op.qualname, op._fake_impl, lib=lib)
            op.backward = backward_cls(op)
            op.backward.register(lib)
        except BaseException:
            lib._destroy()  # no half-registered op stays behind
            raise
        _LIBS[spec.name] = lib
        _REGISTRY[spec.name] = op
        if not spec.varlen:  # registered now, so `op.varlen` also works inside torch.compile
            from flashgen.ops.varlen import varlen_spec

            try:
                op._varlen_op = build_op(varlen_spec(spec), replace=replace)
            except SpecError:
                pass  # no varlen form; `op.varlen` raises the error on access
            except BaseException:
                _unregister(spec.name, spec.path)
                op._replaced_by = None
                raise
        return op
