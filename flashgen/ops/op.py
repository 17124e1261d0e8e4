"""A checked spec -> a PyTorch operator ``torch.ops.flashgen.<name>``: the registration
(:func:`build_op`, :func:`registered_name`, :func:`schema`; one torch library fragment per
operator, all or nothing, replaced whole by a reload) and the public names of the op modules:
:class:`~flashgen.ops.prefill.attention.AttentionOp` (its schema and the op contract are described
there), the checks of :mod:`flashgen.ops.validation`, the call helpers of
:mod:`flashgen.ops.calls`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading

import torch

from flashgen.codegen.abi import needs_block_table
from flashgen.frontend import ir
from flashgen.frontend.errors import SpecError
from flashgen.ops.calls import (  # noqa: F401  (re-exported: flashgen.ops.op's public names)
    _kernel_aligned,
    _plain_eager,
    _sm_count,
    current_stream_ptr,
    kernel_values,
)
from flashgen.ops.prefill.attention import AttentionOp
from flashgen.ops.validation import (  # noqa: F401  (re-exported)
    _SCHEMA_TYPE,
    DESCALE_NAMES,
    PARAM_DTYPE,
    TORCH_DTYPE,
    Dims,
    _check_qkv,
    _dims_if_valid,
    _poison_enabled,
    _symbolic,
    check_heads_and_strides,
    check_input_dtype,
    check_scalar,
    check_softmax_scale,
    default_softmax_scale,
    is_scaled,
    out_dtype,
    poison_outputs,
    resolve_params,
    target_for_device,
    validate,
    validate_tensor_params,
)
from flashgen.options import DEFAULT, Options, check_options

#: One torch library fragment per registered spec name (its forward, backward and fake
#: kernels), so a failed registration or a reload can be undone whole (``_destroy``).
_LIBS: dict[str, torch.library.Library] = {}
_REGISTRY: dict[str, AttentionOp] = {}
_REG_LOCK = threading.RLock()


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
    Tensor slopes, *, bool deterministic=False) -> (Tensor, Tensor)``; an fp8 spec's has
    ``Tensor q_descale, Tensor k_descale, Tensor v_descale`` after ``softmax_scale``.

    ``deterministic`` is keyword-only with a default, so positional calls written for the
    schema without it still work; the forward ignores it and autograd hands it to the
    backward op (see :mod:`flashgen.ops.prefill.backward`).  A varlen spec's schema is
    :func:`flashgen.ops.prefill.varlen.schema`."""
    if spec.varlen:
        from flashgen.ops.prefill.varlen import schema as varlen_schema

        return varlen_schema(spec)
    args = ["Tensor q", "Tensor k", "Tensor v", "float softmax_scale"]
    if is_scaled(spec):  # fp8: FlashAttention-3's descales, where the kernel ABI has them
        args += [f"Tensor {name}" for name in DESCALE_NAMES]
    args += [f"{_SCHEMA_TYPE[p.ty]} {p.name}" for p in spec.scalar_params]
    args += [f"Tensor {p.name}" for p in spec.tensor_params]
    if needs_block_table(spec):  # positional: register_autograd refuses kwarg-only tensors
        args.append("Tensor? block_mask=None")
    args += ["*", "bool deterministic=False"]
    return f"{spec.name}({', '.join(args)}) -> (Tensor, Tensor)"


def out_schema(spec: ir.Spec) -> str:
    """The schema of the mutating overload ``<name>.out``: :func:`schema`'s arguments with a
    keyword-only ``Tensor(a!) o`` that o is written into, returning lse only, e.g.
    ``alibi.out(Tensor q, Tensor k, Tensor v, float softmax_scale, Tensor slopes, *,
    Tensor(a!) o, bool deterministic=False) -> Tensor``.  Its return aliases no input, so
    ``torch.compile`` functionalizes it (``auto_functionalized``); it has no autograd (a call
    with inputs that require grad raises, as torch's own ``out=`` ops do).  The argument is
    ``o``, not ``out``: Dynamo takes an ``out=`` keyword for torch's resizing out= convention
    and refuses a non-contiguous one.  Non-varlen specs only."""
    base = schema(spec)
    head, args = base.split("(", 1)
    args = args.replace("*, bool deterministic=False) -> (Tensor, Tensor)",
                        "*, Tensor(a!) o, bool deterministic=False) -> Tensor")  # fmt: skip
    return f"{head}.out({args}"


def _register_out(op: AttentionOp, lib) -> None:
    """Define and implement ``flashgen::<name>.out`` (:func:`out_schema`): the op's CUDA,
    CPU and fake kernels with o written into ``o``, and an autograd kernel that refuses
    inputs requiring grad (:meth:`AttentionOp.attention` routes those to the functional op)."""
    name = f"{op.spec.name}.out"
    lib.define(out_schema(op.spec))
    lib.impl(name, lambda *a, o, **kw: op._cuda_impl(*a, out=o, **kw)[1], "CUDA")
    lib.impl(name, lambda *a, o, **kw: op._cpu_impl(*a, out=o, **kw)[1], "CPU")
    torch.library.register_fake(
        f"{op.qualname}.out", lambda *a, o, **kw: op._fake_impl(*a, out=o, **kw)[1], lib=lib
    )
    overload = getattr(torch.ops.flashgen, op.spec.name).out

    def autograd(keyset, *args, **kwargs):
        if torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (*args, *kwargs.values())
        ):
            raise RuntimeError(
                f"{op.qualname}.out(): functions with out=... arguments don't support automatic "
                "differentiation, but one of the arguments requires grad; call "
                f"{op.qualname} (or op.attention(..., out=...), which does) instead"
            )
        with torch._C._AutoDispatchBelowAutograd():
            return overload.redispatch(keyset & torch._C._after_autograd_keyset, *args, **kwargs)

    lib.impl(name, autograd, "Autograd", with_keyset=True)


def _same_spec(a: ir.Spec, b: ir.Spec) -> bool:
    blank = {"path": "", "description": ""}
    return dataclasses.replace(a, **blank) == dataclasses.replace(b, **blank)


def registered_name(name: str, options: Options = DEFAULT) -> str:
    """The operator name of spec ``name`` bound to ``options``: ``name`` for the defaults,
    else ``<name>__o<first 8 hex digits of sha256(options.key())>`` -- its own operator (with
    its own ``__backward`` and ``__varlen`` ops), so ``torch.ops.flashgen.<that name>`` (and
    ``torch.compile``) runs the kernels ``options`` pick, not the default op's."""
    if options == DEFAULT:
        return name
    return f"{name}__o{hashlib.sha256(options.key().encode()).hexdigest()[:8]}"


def build_op(spec: ir.Spec, options: Options = DEFAULT, *, replace: bool = False) -> AttentionOp:
    """Register ``torch.ops.flashgen.<registered_name(spec.name, options)>`` for a checked
    spec and return its op (:func:`registered_name`: ``spec.name`` for the default options).

    Idempotent per process: building an equal spec again (file path and description
    aside) with equal ``options`` returns the op already registered; other options register
    another operator (its ``spec.name`` is the registered name; ``base_name`` the spec's).
    Raises ``ValueError`` for an fp8 spec under ``Options(family="fa2")`` and if a different
    spec with the same name is already registered in this process, unless ``replace``
    (``flashgen.load`` of an edited file): then the old registrations of that spec name
    (under every options) are removed and the old op objects raise ``RuntimeError`` when
    called.  Registration is all or nothing: if any step fails,
    nothing of it stays registered.  ``TypeError`` if ``options`` is not an
    :class:`~flashgen.options.Options`.
    """
    check_options(options)
    if spec.dtype in ir.FP8_DTYPES and options.family == "fa2":
        raise ValueError(
            f"spec {spec.name!r} has dtype {spec.dtype}, which only the Hopper kernel runs; "
            f"Options(family='fa2') picks the FA2-class kernels, which have no FP8 form"
        )
    base = spec.name
    if options != DEFAULT:
        spec = dataclasses.replace(spec, name=registered_name(spec.name, options))
    return _build_op(spec, options, base, replace)


def _build_op(
    spec: ir.Spec, options: Options, base_name: str, replace: bool = False
) -> AttentionOp:
    with _REG_LOCK:
        existing = _REGISTRY.get(spec.name)
        if existing is not None:
            if _same_spec(existing.spec, spec) and existing.options == options:
                return existing
            if not replace:
                raise ValueError(
                    f"a different spec named {spec.name!r} is already registered as "
                    f"flashgen::{spec.name} (from {existing.spec.path}); rename one of them"
                )
            # the edited spec replaces its op under every options it was bound to
            for other in [o for o in _REGISTRY.values() if o.base_name == base_name]:
                _unregister(other.name, spec.path)
        if spec.varlen:
            from flashgen.ops.prefill.varlen import VarlenBackward as backward_cls
            from flashgen.ops.prefill.varlen import VarlenOp as op_cls
        elif is_scaled(spec):  # fp8: forward only
            from flashgen.ops.prefill.backward import ForwardOnly as backward_cls

            op_cls = AttentionOp
        else:
            from flashgen.ops.prefill.backward import Backward as backward_cls

            op_cls = AttentionOp
        op = op_cls(spec, options)
        op.base_name = base_name
        op._registration = _Registration
        lib = op._lib = torch.library.Library("flashgen", "FRAGMENT")
        try:
            lib.define(schema(spec))
            lib.impl(spec.name, op._cuda_impl, "CUDA")
            lib.impl(spec.name, op._cpu_impl, "CPU")
            torch.library.register_fake(op.qualname, op._fake_impl, lib=lib)
            op.backward = backward_cls(op)
            op.backward.register(lib)
            if not spec.varlen:  # with_kvcache's ops, now: they must exist under torch.compile
                _register_out(op, lib)
                from flashgen.ops.decode.op import decode_op

                decode_op(op)
        except BaseException:
            lib._destroy()  # no half-registered op stays behind
            raise
        _LIBS[spec.name] = lib
        _REGISTRY[spec.name] = op
        if not spec.varlen:  # registered now, so `op.varlen` also works inside torch.compile
            from flashgen.ops.prefill.varlen import varlen_spec

            try:
                op._varlen_op = _build_op(
                    varlen_spec(spec), options, base_name + "__varlen", replace
                )
            except SpecError:
                pass  # no varlen form; `op.varlen` raises the error on access
            except BaseException:
                _unregister(spec.name, spec.path)
                op._replaced_by = None
                raise
        return op


class _Registration:
    """What an :class:`~flashgen.ops.prefill.attention.AttentionOp` asks of the registration
    (``op._registration``): the op of a spec under other options, and its varlen form."""

    @staticmethod
    def build(spec: ir.Spec, options: Options) -> AttentionOp:
        return build_op(spec, options)

    @staticmethod
    def varlen_of(op: AttentionOp) -> AttentionOp:
        from flashgen.ops.prefill.varlen import varlen_spec

        return _build_op(varlen_spec(op.spec), op.options, op.base_name + "__varlen")

    @staticmethod
    def offsets_of(op: AttentionOp) -> AttentionOp:
        from flashgen.frontend.offsets import offsets_spec

        return _build_op(offsets_spec(op.spec), op.options, op.base_name + "__offsets")
