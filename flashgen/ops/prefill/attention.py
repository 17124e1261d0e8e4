"""The attention op of one spec, :class:`AttentionOp`: :func:`flashgen.ops.op.build_op`
registers it, once per process and spec name, as an operator with schema::

    <name>(Tensor q, Tensor k, Tensor v, float softmax_scale,
           [Tensor q_descale, Tensor k_descale, Tensor v_descale: fp8_e4m3 specs only],
           <int|float scalar params, spec order>, <Tensor params, spec order>,
           *, bool deterministic=False) -> (Tensor, Tensor)

with a CUDA kernel (render -> nvcc -> cache -> CuPy launch), a CPU kernel (the blocked
float32 implementation of :mod:`flashgen.ops.cpu.attention`), a fake kernel (so
``torch.compile`` traces it) and an autograd registration whose backward is the op
``<name>__backward`` (see :mod:`flashgen.ops.prefill.backward`).

The user entry point is :meth:`AttentionOp.attention`, which validates its inputs up
front (:func:`validate`, also run by every kernel) and fills in defaults.  On plain CUDA
tensors in eager mode it launches the forward itself (:func:`_eager_cuda`; training through
``_EagerAttention``, whose backward is the registered one, tensor params that require grad
included), which saves the dispatcher's and the custom-op autograd wrapper's host time and
the kernel's second validation; everywhere else it calls the operator.

``deterministic`` does not change the forward (its impls ignore it); it is a schema
argument so that it reaches the autograd ``setup_context`` the same way in eager mode,
under ``torch.compile(fullgraph=True)`` and in opcheck, and picks the backward kernels
(see :mod:`flashgen.ops.prefill.backward`).

This module holds the op, its entry point, its registered kernels and the forward launch;
its block-mask methods are :mod:`flashgen.ops.prefill.attention_blockmask`'s and the choice and
loading of its CUDA kernels :mod:`flashgen.ops.prefill.attention_kernels`' (mixins of
:class:`AttentionOp`).

Op contract (README.md, section "Op contract"):

    q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv], all of the spec's dtype,
    on one device, any strides with stride(-1) == 1; Hq % Hkv == 0.
    fp8_e4m3 specs: q_descale, k_descale, v_descale float32 [B, Hkv] on q's device,
    finite and positive; the attention runs on x * x_descale[b, h // (H / Hkv)].  Or all
    three per block: [B, Hq, ceil(Sq / 128)], [B, Hkv, ceil(Sk / 128)] twice, row s of head
    h taking x_descale[b, h, s // 128] (q_descale 3-D decides the form).
    o [B, Hq, Sq, Dv] in the input dtype (bf16 for fp8 inputs), contiguous, or written into
    the caller's ``out=`` (any layout with stride(-1) == 1; mutating overload ``<name>.out``);
    lse [B, Hq, Sq] float32, natural log, contiguous.
    A row with nothing to attend to: o = 0, lse = -inf.  B, Sq or Sk = 0: no launch.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import warnings

import torch

from flashgen.analysis.indexbounds import IndexBoundsWarning, possible_violations
from flashgen.codegen.abi import needs_block_table
from flashgen.families import registry
from flashgen.families.hopper_fwd import eligible as hopper_eligible
from flashgen.families.tiles import hopper_tiles
from flashgen.frontend import ir
from flashgen.frontend.errors import OpInputError
from flashgen.frontend.offsets import is_offsets_spec
from flashgen.ops.calls import (
    _caller_stacklevel,
    _kernel_aligned,
    _mask_reads,
    _plain_eager,
    _sm_count,
    current_stream_ptr,
    kernel_values,
    refuse_forward_ad,
)
from flashgen.ops.decode.op import decode_op
from flashgen.ops.out_arg import check_out
from flashgen.ops.prefill.attention_blockmask import BlockMaskMethods
from flashgen.ops.prefill.attention_kernels import KernelChoice
from flashgen.ops.prefill.fused_sink import FusedSinkAttention
from flashgen.ops.sink import sink_arg_values
from flashgen.ops.validation import (
    CPU_DTYPES,
    Dims,
    _poison_enabled,
    check_descales,
    check_softmax_scale,
    default_softmax_scale,
    is_block_form,
    is_scaled,
    lse_dtype,
    out_dtype,
    resolve_descales,
    resolve_params,
    target_for_device,
    validate,
)
from flashgen.options import DEFAULT, Options


# ----------------------------------------------------------------------------- the op
class AttentionOp(BlockMaskMethods, KernelChoice):
    """The op generated for one spec; build it with :func:`build_op` or ``flashgen.load``.

    Attributes: ``spec`` (the checked :class:`~flashgen.frontend.ir.Spec`), ``name``, ``qualname``
    (``"flashgen::<name>"``).  Call :meth:`attention` (also ``op(q, k, v, ...)``).
    :meth:`block_mask` comes from
    :class:`~flashgen.ops.prefill.attention_blockmask.BlockMaskMethods`, :meth:`kernel` from
    :class:`~flashgen.ops.prefill.attention_kernels.KernelChoice`.
    """

    def __init__(self, spec: ir.Spec, options: Options = DEFAULT):
        self.spec = spec
        #: the :class:`flashgen.options.Options` that pick this op's kernels
        self.options = options
        self.name = spec.name
        #: the spec's own name (``name`` is the registered one, see :func:`registered_name`)
        self.base_name = spec.name
        self.qualname = f"flashgen::{spec.name}"
        self._kernels: dict[tuple[int, str], object] = {}
        #: whether a call may run the sparse-mask tiles (registry.sparse_tiles of the Hopper
        #: kernel's tiles), and per (seqlen_q, seqlen_k, scalars) whether it does
        self._sparse_possible = hopper_eligible(spec, "sm_90", options.family) and (
            registry.sparse_tiles(spec, hopper_tiles(spec), options) is not None
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
        #: whether the op takes q_descale, k_descale, v_descale (fp8_e4m3 specs)
        self._scaled = is_scaled(spec)
        #: per device index, whether its forward kernels join the spec's sink (the fused sink)
        self._sink_joins: dict[int, bool] = {}
        #: (Dims, scalar values) whose tensor-param subscripts were bounded (indexbounds)
        self._bounds_seen: set = set()
        #: set when ``flashgen.load`` of the edited spec file replaced this op's registration
        self._replaced_by: str | None = None
        #: set by :func:`flashgen.ops.op.build_op` (which imports this module, not the other
        #: way round): its ``build(spec, options)`` and ``varlen_of(op)`` register ops, and
        #: ``_lib`` is this op's torch library fragment
        self._registration = None
        self._lib = None

    def _check_live(self) -> None:
        """Raise ``RuntimeError`` if a reload of the edited spec replaced this op (every
        entry point asks: :meth:`attention`, :meth:`with_kvcache`, :meth:`plan_decode`, a
        plan's fast path, :attr:`varlen`, :attr:`offsets`, :meth:`block_mask`,
        :meth:`kernel`, :meth:`family_for`, :meth:`with_options`, and the backward of a result
        it computed before the reload)."""
        if self._replaced_by is not None:
            raise RuntimeError(
                f"op {self.qualname} was replaced when flashgen.load reloaded the edited spec "
                f"{self._replaced_by}; use the op that flashgen.load returned then"
            )

    def __repr__(self) -> str:
        return f"<flashgen op {self.qualname} ({self.spec.dtype}, head_dim {self.spec.head_dim})>"

    def family_for(self, device) -> registry.DeviceKernels:
        """Which kernels this op runs on ``device`` (a CUDA ``torch.device`` / device string,
        or a compute capability ``(major, minor)``), under its options: a
        :class:`flashgen.families.registry.DeviceKernels` (``target``, ``family``: FA2-class
        or Hopper, the forward and backward families, ``ptx_jit``; ``str()`` says it).
        8.x: FA2-class (sm_80 SASS); 9.0: Hopper where the spec allows; 10.x and newer:
        FA2-class through the driver's JIT of the units' compute_80 PTX.  Raises
        ``RuntimeError`` below compute capability 8.0, ``ValueError`` for a non-CUDA device
        (the CPU op runs :mod:`flashgen.ops.cpu.attention`), a CUDA device where torch sees
        no GPU, or anything else (a malformed capability: not two non-negative ints).
        ``OpInputError`` is a ``ValueError``.  ``RuntimeError`` if a reload replaced the op."""
        self._check_live()
        if isinstance(device, (tuple, list)):
            capability = registry.check_capability(device)
        elif isinstance(device, (str, torch.device)):
            try:
                device = torch.device(device)
            except RuntimeError:
                raise OpInputError(
                    f"device: expected a CUDA device ('cuda', 'cuda:1', a torch.device) or a "
                    f"compute capability (major, minor) such as (9, 0), got {device!r}"
                ) from None
            if device.type != "cuda":
                raise OpInputError(
                    f"device: expected a CUDA device or a compute capability (major, minor), got "
                    f"{device} (on CPU the op runs flashgen/ops/cpu/attention.py)"
                )
            try:
                capability = torch.cuda.get_device_capability(device)
            except (AssertionError, RuntimeError) as e:  # torch without CUDA, no such GPU
                raise OpInputError(
                    f"device: {device} asked for, but torch sees no CUDA GPU here ({e}); pass "
                    f"the compute capability instead, e.g. family_for((9, 0))"
                ) from None
        else:
            raise OpInputError(
                f"device: expected a CUDA device ('cuda', 'cuda:1', a torch.device) or a compute "
                f"capability (major, minor) such as (9, 0), got {device!r}"
            )
        try:
            return registry.for_capability(self.spec, capability, self.options)
        except ValueError as e:
            raise RuntimeError(str(e)) from None

    def with_options(self, options: Options) -> AttentionOp:
        """The op of this spec bound to ``options`` (:class:`flashgen.options.Options`):
        :func:`build_op` of the spec under its own name, so its :meth:`attention`,
        :attr:`varlen` and ``torch.ops.flashgen.<its name>`` all run the kernels ``options``
        pick.  Raises ``RuntimeError`` if a reload of the edited spec replaced this op,
        ``TypeError`` if ``options`` is not an ``Options``."""
        self._check_live()
        if options == self.options:
            return self
        spec = dataclasses.replace(self.spec, name=self.base_name)
        return self._registration.build(spec, options)

    @property
    def torch_op(self):
        """``torch.ops.flashgen.<name>.default``; ``RuntimeError`` if a reload of the edited
        spec replaced this op (that name is the new spec's operator then)."""
        self._check_live()
        return getattr(torch.ops.flashgen, self.name).default

    @property
    def varlen(self) -> AttentionOp:
        """This variant over packed variable-length sequences (FlashAttention's varlen
        interface, see :mod:`flashgen.ops.prefill.varlen`): the op of the same spec with ``varlen:
        true``, registered as ``flashgen::<name>__varlen`` with this op.  Call it as
        ``op.varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)``.
        A varlen spec's op is its own varlen form.  ``RuntimeError`` if a reload of the
        edited spec replaced this op."""
        self._check_live()
        if self.spec.varlen:
            return self
        if self._varlen_op is None:  # built once, outside any torch.compile trace after that
            self._varlen_op = self._registration.varlen_of(self)
        return self._varlen_op

    @property
    def offsets(self) -> AttentionOp:
        """This variant at global positions (:mod:`flashgen.frontend.offsets`): the op of
        ``<name>__offsets``, whose mask and score_mod see ``q_idx + q_offset``,
        ``kv_idx + kv_offset`` and the global lengths; built on first use (touch it once
        before ``torch.compile`` traces a call with offsets).  :meth:`attention` runs it when
        given ``q_offset``, ``kv_offset``, ``seqlen_q_global`` or ``seqlen_k_global``.  An
        offsets op is its own offsets form.  ``RuntimeError`` if a reload replaced this op."""
        self._check_live()
        if self._offsets_form:
            return self
        if self._offsets_op is None:
            self._offsets_op = self._registration.offsets_of(self)
        return self._offsets_op

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.spec.params)

    def attention(self, q, k, v, *, apply_sink: bool = True, out=None, **kwargs):
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
        specs it takes (:func:`flashgen.ops.prefill.backward.backward_path`), elsewhere the
        FA2-class atomic kernels only for an op bound to ``Options(atomic_dq=True)`` (else the
        deterministic ones); ``Options(atomic_dq=False)`` keeps every atomic path off.
        Must be a bool (else :class:`OpInputError`).

        ``block_mask`` (only for specs whose mask reads tensor params, e.g. document
        masking): a :class:`~flashgen.ops.prefill.blockmask.BlockMask` from :meth:`block_mask`
        for these sequence lengths and the same param values (the same tensors for the
        tensor params its mask reads, not written in place since it was built: checked by
        their ``_version``, not under ``torch.compile``), reused across calls; with
        ``q_offset`` and the like, one from ``op.offsets.block_mask``.  Without it the CUDA
        op runs the block-table pre-pass on every call.  The backward of such a call takes
        the table the BlockMask holds for the backward kernel's tiles, built on its first
        backward (:meth:`_held_table_arg`).  The CPU op checks it as the CUDA op does but
        does not read it.

        Returns o [B, Hq, Sq, Dv] in the input dtype (bf16 for fp8) and lse float32
        [B, Hq, Sq] (natural log; -inf with o = 0 for rows that attend to nothing).

        ``out``: a tensor to write o into, returned as o: ``[B, Hq, Sq, Dv]`` in o's dtype
        on q's device, any layout with ``stride(-1) == 1`` (``(B, S, H, Dv)`` storage viewed
        with ``.transpose(1, 2)``), sharing no memory with the inputs, not requiring grad
        (:func:`flashgen.ops.out_arg.check_out`).  The kernel writes it through its strides,
        no copy; the CPU op and calls that autograd records through the operator (CPU
        tensors, ``torch.compile``) copy o into it.  Without gradients the operator call is
        the mutating overload ``torch.ops.flashgen.<name>.out(..., o=out)`` (returns lse).
        lse is always allocated ``[B, Hq, Sq]``.

        ``q_descale``, ``k_descale``, ``v_descale`` (fp8_e4m3 specs only; FlashAttention-3's
        FP8 interface): q, k, v are ``torch.float8_e4m3fn`` and the attention runs on the
        dequantized ``x[b, h] * x_descale[b, h // (H / Hkv)]`` (query head h takes the
        descale of its kv head), so lse is the log-sum-exp of the dequantized, scaled logits.
        Each is a float32 ``[B, Hkv]`` tensor on q's device, or a Python float / 0-d /
        one-element float32 tensor (broadcast); None is 1.0.  Per-block descales (a 3-D
        tensor, :func:`flashgen.fp8.quantize` with ``block_rows=128``): ``q_descale [B, Hq,
        ceil(Sq / 128)]``, ``k_descale`` and ``v_descale [B, Hkv, ceil(Sk / 128)]``, row ``s``
        of head ``h`` dequantized with ``x_descale[b, h, s // 128]``; once one descale is
        3-D the others broadcast into that form, and the CUDA op runs the kernel that reads
        them (built on its first such call).  Non-finite or non-positive
        values raise (checked on the host for numbers and CPU tensors; for CUDA tensors only
        when :func:`flashgen.ops.validation.check_enabled`, since reading them synchronizes
        the device).
        :func:`flashgen.fp8.quantize` makes q, k, v and the descales from float tensors.
        Giving a descale to an op of another dtype raises.  fp8 ops have no backward.

        ``q_offset``, ``kv_offset``, ``seqlen_q_global``, ``seqlen_k_global`` (ints): this
        call is a slice of a longer sequence -- q holds global rows ``q_offset ..
        q_offset + Sq - 1`` of ``seqlen_q_global``, k / v keys ``kv_offset .. kv_offset + Sk
        - 1`` of ``seqlen_k_global`` -- and the mask and score_mod see global positions
        (:meth:`offsets`; tensor params declared with a ``seqlen_q`` / ``seqlen_k`` dim are
        passed sliced like q / like k).  Offsets default to 0, the global lengths to
        ``q_offset + Sq`` and ``kv_offset + Sk``.  Used by
        :func:`flashgen.distributed.ring_attention`.

        Gradients: q, k, v, and each f32 param the score_mod reads, whether a tensor or a
        0-d CPU scalar tensor (``requires_grad=True``): ``dparam[idx]`` is the sum over
        (b, h, q_idx, kv_idx) of dS times the derivative of the score_mod with respect to
        ``param[idx]`` (:mod:`flashgen.ops.prefill.backward`; CPU tensors, float64 included, so
        ``torch.autograd.gradcheck`` runs on the op).  An i32 param or one only the mask
        reads has no gradient: requiring one raises :class:`OpInputError` naming it.

        A spec with a ``sink`` (:mod:`flashgen.ops.sink`): o has the sink joined to every
        row's denominator and lse is the log-sum-exp of the keys alone.  ``apply_sink=False``
        returns the attention over the keys alone (o normalized without the sink), for
        partial results merged with :func:`flashgen.merge_attention`; apply the sink once
        at the end with :func:`flashgen.ops.sink.apply_sink`.  (The operator
        ``torch.ops.flashgen.<name>`` computes the keys alone; this method applies the
        sink, differentiably, so the sink's params get their gradient too.)  With the
        ``fused_sink`` option of the forward family that runs (``Options.fa2_fwd`` /
        ``Options.hopper_fwd``; on by default), a call on plain eager CUDA tensors has the
        forward kernel join the sink instead, from the float32 logits per (batch, query head)
        (:meth:`_fuses_sink`): the same results and gradients (q, k, v, the sink's params; the
        backward kernels take P against ``logaddexp(lse, sink)``,
        :mod:`flashgen.ops.prefill.fused_sink`); ``apply_sink=False`` gives the kernel a null
        sink.  An fp8 op's forward joins it too, in calls without gradients (it has no
        backward); with them, and for a 0-d scalar param that requires grad, the torch
        epilogue runs.

        Raises :class:`OpInputError` for bad inputs (message names the argument, the
        expected and the received value).

        Plain CUDA tensors in eager mode skip the dispatcher (the same kernels and results,
        less host time per call), tensor params that require grad included (plain tensors
        or ``nn.Parameter``); under ``torch.compile`` or ``torch.jit.trace``, a
        torch-function or dispatch mode, a functorch transform, with tensor subclasses (a
        tensor param's among them when it requires grad) or CPU tensors this calls
        ``torch.ops.flashgen.<name>``.
        """
        return self._with_sink(self._attention, (q, k, v), q, k, None, apply_sink, out, kwargs)

    def _with_sink(self, run, args, q, k, cu_seqlens_q, apply_sink, out, kwargs):
        """``run(*args, out=out, **kwargs)`` (the attention over the keys alone), with the
        spec's sink applied to o (module :mod:`flashgen.ops.sink`) unless ``apply_sink`` is
        False.  ``cu_seqlens_q``: a varlen call's (the sink is per sequence)."""
        if not isinstance(apply_sink, bool):
            raise OpInputError(f"apply_sink: expected a bool, got {apply_sink!r}")
        refuse_forward_ad(self.spec.name, (*args, *kwargs.values()))
        if self.spec.sink is None or not apply_sink:
            return run(*args, out=out, **kwargs)
        if self._fuses_sink(*args[:3], kwargs):  # the forward kernel joins the sink
            return run(*args, out=out, join_sink=True, **kwargs)
        from flashgen.ops.sink import apply_sink as join
        from flashgen.ops.sink import sink_logits, varlen_rows

        grad = torch.is_grad_enabled()
        o, lse = run(*args, out=None if grad else out, **kwargs)
        if grad and out is not None:  # checked as the operator's out is, then copied into
            tmap = {p.name: kwargs.get(p.name) for p in self.spec.tensor_params}
            self._check_out_arg(out, q, k, args[2], validate(self.spec, q, k, args[2], tmap),
                                tmap)  # fmt: skip
        names = {p.name for p in self.spec.params}
        params = {n: t for n, t in kwargs.items() if n in names}
        heads_q, heads_kv = q.shape[1], k.shape[1]  # [B, H, S, D] and [total, H, D] alike
        if cu_seqlens_q is None:
            sink = sink_logits(self.spec, params, batch=q.shape[0], heads_q=heads_q,
                               heads_kv=heads_kv, device=q.device, dtype=lse.dtype)  # fmt: skip
            o_sunk = join(o, lse, sink.unsqueeze(-1))
        else:
            sink = sink_logits(self.spec, params, batch=cu_seqlens_q.numel() - 1,
                               heads_q=heads_q, heads_kv=heads_kv, device=q.device,
                               dtype=lse.dtype)  # fmt: skip
            rows = varlen_rows(sink, cu_seqlens_q, lse.shape[1])
            o_sunk = join(o.transpose(0, 1), lse, rows).transpose(0, 1)
        if out is None:
            return o_sunk, lse
        return out.copy_(o_sunk), lse

    def _fuses_sink(self, q, k, v, kwargs: dict) -> bool:
        """Whether a call that joins the spec's sink (``kwargs``: its keyword arguments) has
        the forward kernel join it (:meth:`_joins_sink`): plain eager CUDA tensors
        (:func:`_eager_cuda`), no 0-d scalar param that requires grad (those take
        :class:`ScalarParamGrad` and the torch epilogue), and an fp8 op only without
        gradients (it has no backward).  Anything else (CPU, ``torch.compile``, modes) applies
        the sink after the kernel (:func:`flashgen.ops.sink.apply_sink`)."""
        tensor = torch.Tensor
        if not all(isinstance(t, tensor) for t in (q, k, v)) or not _eager_cuda(q, k, v):
            return False
        if torch.is_grad_enabled():
            values = (q, k, v, *kwargs.values())
            if any(isinstance(t, tensor) and t.requires_grad for t in values) and (
                self._scaled
                or any(isinstance(kwargs.get(p.name), tensor) and kwargs[p.name].requires_grad
                       for p in self.spec.scalar_params)  # fmt: skip
            ):
                return False
        return self._joins_sink(q.device)

    def _joins_sink(self, device) -> bool:
        """Whether this op's forward kernels on CUDA ``device`` join its sink
        (:func:`flashgen.families.registry.joins_sink` under its options: the routed forward
        family's ``fused_sink``), remembered per device."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        hit = self._sink_joins.get(index)
        if hit is None:
            target = target_for_device(self.spec, device)
            hit = self._sink_joins[index] = registry.joins_sink(self.spec, target, self.options)
        return hit

    def _sink_logits(self, params: dict, batch: int, heads_q: int, heads_kv: int, device):
        """The sink logits a fused-sink kernel reads: float32 ``[batch, heads_q]`` on ``device``
        (:func:`flashgen.ops.sink.sink_logits` of the call's ``params``; a view of the param
        for ``sinks[h]``-like forms), differentiable in the params."""
        from flashgen.ops.sink import sink_logits

        return sink_logits(self.spec, params, batch=batch, heads_q=heads_q, heads_kv=heads_kv,
                           device=device, dtype=torch.float32)  # fmt: skip

    def _attention(
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
        out=None,
        q_descale=None,
        k_descale=None,
        v_descale=None,
        join_sink: bool = False,
        **params,
    ):
        """:meth:`attention` over the keys alone (no sink applied); ``join_sink`` (a call
        :meth:`_fuses_sink` accepted): with the sink, joined by the forward kernel."""
        self._check_live()
        if self._offsets_form or not (
            q_offset is None and kv_offset is None and seqlen_q_global is None
            and seqlen_k_global is None
        ):  # fmt: skip
            from flashgen.ops.prefill.offsets import offsets_values

            pos = offsets_values(q, k, q_offset, kv_offset, seqlen_q_global, seqlen_k_global)
            if not self._offsets_form:
                return self.offsets._attention(
                    q, k, v, softmax_scale=softmax_scale, deterministic=deterministic,
                    block_mask=block_mask, out=out, q_descale=q_descale, k_descale=k_descale,
                    v_descale=v_descale, join_sink=join_sink, **pos, **params,
                )  # fmt: skip
            params = {**params, **pos}
        scalar_grads: dict = {}
        scalars, tensors = resolve_params(self.spec, params, scalar_grads)
        tensor_map = self._tensor_map(tensors)
        dims = validate(self.spec, q, k, v, tensor_map)
        descales = None
        if self._scaled or not (q_descale is None and k_descale is None and v_descale is None):
            given = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
            descales = resolve_descales(self.spec, given, dims, q.device)
        if softmax_scale is None:
            softmax_scale = default_softmax_scale(self.spec)
        softmax_scale = check_softmax_scale(softmax_scale)
        if not isinstance(deterministic, bool):
            raise OpInputError(f"deterministic: expected a bool, got {deterministic!r}")
        table = None
        if block_mask is not None:
            table = self._block_mask_table(block_mask, q, dims, scalars, tensor_map)
        if out is not None:
            check_out(self.spec, out, q, dims, {"q": q, "k": k, "v": v, **tensor_map})
        if scalar_grads:  # a float in the schema: autograd of the op cannot see it
            extra = [table] if self._block_table else []
            o, lse = ScalarParamGrad.apply(
                self, (q, k, v, softmax_scale, *scalars, *tensors, *extra), deterministic,
                tuple(scalar_grads), block_mask, q, k, v, *tensors, *scalar_grads.values(),
            )  # fmt: skip
            return (o, lse) if out is None else (out.copy_(o), lse)
        if join_sink:  # plain eager CUDA (_fuses_sink): the kernel joins the sink
            sink = self._sink_logits(params, dims.batch, dims.heads_q, dims.heads_kv, q.device)
            if not torch.is_grad_enabled() or not any(
                t.requires_grad for t in (q, k, v, sink, *tensors)
            ):
                return self._forward(q, k, v, dims, softmax_scale, scalars, tensor_map, table,
                                     descales, out=out, sink=sink)  # fmt: skip
            return FusedSinkAttention.apply(
                self, dims, softmax_scale, scalars, block_mask, deterministic, (out,), q, k, v,
                sink, *tensors,
            )  # fmt: skip
        if _eager_cuda(q, k, v):
            param_grad = any(t.requires_grad for t in tensors)
            if not torch.is_grad_enabled() or not (
                q.requires_grad or k.requires_grad or v.requires_grad or param_grad
            ):
                return self._forward(
                    q, k, v, dims, softmax_scale, scalars, tensor_map, table, descales, out=out
                )
            # fp8 ops: the op path says no backward; a param of a tensor subclass that
            # requires grad: the op path's autograd, which its dispatch sees
            if descales is None and (not param_grad or _plain_params(tensors)):
                return _EagerAttention.apply(
                    self, dims, softmax_scale, scalars, block_mask, deterministic, (out,),
                    q, k, v, *tensors,
                )  # fmt: skip
        extra = [table] if self._block_table else []
        args = (q, k, v, softmax_scale, *(descales or ()), *scalars, *tensors, *extra)
        if out is None:
            return self.torch_op(*args, deterministic=deterministic)
        if torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, *tensors)
        ):  # the mutating overload has no autograd: the functional op, o copied into out
            o, lse = self.torch_op(*args, deterministic=deterministic)
            return out.copy_(o), lse
        lse = getattr(torch.ops.flashgen, self.name).out(*args, o=out, deterministic=deterministic)
        return out, lse

    @property
    def with_kvcache(self):
        """Attention against a dense or paged KV cache, appending ``k_new``/``v_new`` first
        (FlashAttention's ``flash_attn_with_kvcache``): ``op.with_kvcache(q, k_cache,
        v_cache, cache_seqlens, **kwargs)`` -> ``(o, lse)``.  The op's
        :meth:`flashgen.ops.decode.op.DecodeOp.with_kvcache` itself (its arguments and
        contract; no forwarding frame on the planned call's host path).  ``RuntimeError``
        if a reload of the edited spec replaced this op (here, and at each call)."""
        self._check_live()
        return decode_op(self).with_kvcache

    def plan_decode(self, **kwargs):
        """A reusable schedule for :meth:`with_kvcache` calls of one shape; see
        :meth:`flashgen.ops.decode.op.DecodeOp.plan_decode`.  ``RuntimeError`` if a reload of
        the edited spec replaced this op."""
        self._check_live()
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

    def _descales_split(self, rest) -> tuple:
        """Schema arguments after softmax_scale -> (the three descales of an fp8 op, or
        None; the arguments after them)."""
        if not self._scaled:
            return None, rest
        return tuple(rest[:3]), rest[3:]

    def _table_arg(self, rest):
        """The ``block_mask`` schema argument (a uint8 table or None)."""
        m = len(self.spec.scalar_params) + len(self.spec.tensor_params)
        return rest[m] if self._block_table and len(rest) > m else None

    def _empty_outputs(self, q, dims: Dims, out=None):
        """``(o, lse)`` to fill: o is ``out`` when given (checked by the caller)."""
        o = out if out is not None else torch.empty(
            (dims.batch, dims.heads_q, dims.seqlen_q, dims.head_dim_v),
            dtype=q.dtype if q.dtype in CPU_DTYPES else out_dtype(self.spec),
            device=q.device,
        )  # fmt: skip
        lse = torch.empty(
            (dims.batch, dims.heads_q, dims.seqlen_q), dtype=lse_dtype(q.dtype), device=q.device
        )
        return o, lse

    def _fake_impl(self, q, k, v, softmax_scale, *rest, deterministic=False, out=None):
        descales, rest = self._descales_split(rest)
        scalars, tensors = self._split(rest)
        dims = validate(self.spec, q, k, v, tensors, softmax_scale=softmax_scale, scalars=scalars)
        if descales is not None:
            check_descales(self.spec, descales, dims, q.device, values=False)
        self._check_out_arg(out, q, k, v, dims, tensors)
        return self._empty_outputs(q, dims, out)

    def _check_out_arg(self, out, q, k, v, dims: Dims, tensors: dict) -> None:
        """:func:`~flashgen.ops.out_arg.check_out` of the mutating overload's ``out``."""
        if out is not None:
            check_out(self.spec, out, q, dims, {"q": q, "k": k, "v": v, **tensors})

    def _cpu_impl(self, q, k, v, softmax_scale, *rest, deterministic=False, out=None):
        """The blocked CPU forward (:mod:`flashgen.ops.cpu.attention`), in float32; an fp8 op
        first dequantizes q, k, v with their descales (:func:`flashgen.fp8.dequantize`).  A
        ``block_mask`` table is checked where the CUDA op checks it, as the CUDA op does
        (:meth:`_check_cpu_table`), and not read."""
        from flashgen.ops.cpu.attention import attention_blocked, cpu_params

        descales, rest = self._descales_split(rest)
        scalars, tensors = self._split(rest)
        dims = validate(self.spec, q, k, v, tensors, softmax_scale=softmax_scale, scalars=scalars)
        if descales is not None:
            check_descales(self.spec, descales, dims, q.device)
        self._check_out_arg(out, q, k, v, dims, tensors)
        o, lse = self._empty_outputs(q, dims, out)
        if lse.numel() == 0:
            return o, lse
        if dims.seqlen_k == 0:
            return o.zero_(), lse.fill_(-math.inf)
        table = self._table_arg(rest)
        if table is not None:
            self._check_cpu_table(table, dims)
        if descales is not None:
            from flashgen.fp8 import dequantize

            q, k, v = (dequantize(t, d) for t, d in zip((q, k, v), descales, strict=True))
        params = cpu_params(self.spec, scalars, tensors, q.dtype)
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

    def _cuda_impl(self, q, k, v, softmax_scale, *rest, deterministic=False, out=None):
        descales, rest = self._descales_split(rest)
        scalars, tensors = self._split(rest)
        dims = validate(self.spec, q, k, v, tensors, softmax_scale=softmax_scale, scalars=scalars)
        if descales is not None:
            check_descales(self.spec, descales, dims, q.device)
        self._check_out_arg(out, q, k, v, dims, tensors)
        return self._forward(
            q, k, v, dims, softmax_scale, scalars, tensors, self._table_arg(rest), descales,
            out=out,
        )

    def _forward(
        self, q, k, v, dims: Dims, softmax_scale, scalars, tensors: dict, table, descales=None,
        out=None, sink=None,
    ):
        """The CUDA forward of inputs :func:`validate` accepted (``dims`` its answer):
        ``(o, lse)``, launched on the current stream of q's device.  ``scalars`` in spec
        order, ``tensors`` by param name, ``table``: the ``block_mask`` argument or None,
        ``descales``: an fp8 op's three float32 [B, Hkv] descales (checked), else None;
        ``out``: o's tensor (checked by :func:`~flashgen.ops.out_arg.check_out`) or None;
        ``sink``: float32 ``[B, Hq]`` logits the kernel joins to o (:meth:`_joins_sink` must
        hold), None: o over the keys alone (a fused-sink kernel gets a null sink).  Raises
        ``RuntimeError`` for logits given to a kernel without the fused sink."""
        if self.spec.tensor_params:
            self._check_index_bounds(dims, scalars)
        o, lse = self._empty_outputs(q, dims, out)
        if _poison_enabled():
            o.fill_(math.nan)
            lse.fill_(math.nan)
        if lse.numel() == 0:
            return o, lse
        if dims.seqlen_k == 0:
            return o.zero_(), lse.fill_(-math.inf)
        kern = self.kernel(
            q.device, sparse=self._sparse_call(dims, scalars),
            block_descale=is_block_form(descales),
        )  # fmt: skip
        q, k, v = _kernel_aligned(q), _kernel_aligned(k), _kernel_aligned(v)
        values = kernel_values(
            self.spec, {"q": q, "k": k, "v": v, "o": o, "lse": lse}, dims, softmax_scale,
            scalars, tensors, descales,
        )  # fmt: skip
        plan = kern.plan
        if plan.context["block_table"]:
            values.update(self._table_values(table, plan.tiles, dims, scalars, tensors, q.device))
        if plan.context["sink"]:
            values.update(sink_arg_values(sink))
        elif sink is not None:
            raise RuntimeError(f"{plan.kernel_name} has no fused sink to take the sink logits")
        stream = current_stream_ptr(q.device)
        if plan.context.get("persistent"):
            ctas = self.options.persistent_ctas or _sm_count(kern.device_index)
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


# ----------------------------------------------------------------------------- eager fast path
def _eager_cuda(q, k, v) -> bool:
    """Whether :meth:`AttentionOp.attention` may run the CUDA forward itself instead of
    going through the dispatcher (``torch.ops.flashgen.<name>``): CUDA tensors and
    :func:`_plain_eager`.  The op path costs more host time per call (dispatch, the
    custom-op autograd wrapper, a second validation: see docs/perf-notes.md); the results
    are the same."""
    return q.is_cuda and _plain_eager(q, k, v)


_PARAMETER = torch.nn.Parameter


def _plain_params(tensors) -> bool:
    """Whether the tensor params are plain tensors (``nn.Parameter`` too, which disables
    ``__torch_function__``): a call whose params require grad takes the eager fast path's
    autograd node only then; a subclass (DTensor, a fake tensor) goes to the operator."""
    return all(type(t) is torch.Tensor or type(t) is _PARAMETER for t in tensors)


class _EagerAttention(torch.autograd.Function):
    """Autograd node of the eager fast path: the forward launches :meth:`AttentionOp._forward`
    directly, the backward is the op's registered one
    (:class:`flashgen.ops.prefill.backward.Backward`: one call of the backward op, with the
    gradients of the tensor params that require grad), so gradients match the
    ``torch.ops.flashgen.<name>`` path exactly.  ``apply(op, dims, softmax_scale, scalars,
    block_mask, deterministic, (out,), q, k, v, *tensors)``: ``tensors`` the tensor params in
    spec order (inputs of the node: their gradients flow back through it), ``block_mask`` the
    call's checked :class:`~flashgen.ops.prefill.blockmask.BlockMask` or None (the backward
    takes the table it holds for the backward's tiles, ``ctx.block_mask``)."""

    @staticmethod
    def forward(ctx, op, dims, softmax_scale, scalars, block_mask, deterministic, out, q, k, v,
                *tensors):  # fmt: skip
        # out: (o's tensor or None,), out of autograd's sight: o is that tensor, not an alias
        table = None if block_mask is None else block_mask.op_arg()
        o, lse = op._forward(
            q, k, v, dims, softmax_scale, scalars, op._tensor_map(tensors), table, out=out[0]
        )
        ctx.op = op
        # what the op path's autograd saves, from the same function and the schema's inputs
        # (its param_grads flags from the params that require grad, each checked there)
        inputs = (q, k, v, softmax_scale, *scalars, *tensors, *([table] if op._block_table else []))
        op.backward.setup_context(ctx, inputs, (o, lse), {"deterministic": deterministic})
        ctx.block_mask = block_mask
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        op = ctx.op
        dq, dk, dv, dparams = op.backward.grads(ctx, grad_o, grad_lse)
        if not dparams:
            return (None,) * 7 + (dq, dk, dv) + (None,) * len(op.spec.tensor_params)
        return (None,) * 7 + (dq, dk, dv, *(dparams.get(p.name) for p in op.spec.tensor_params))


class ScalarParamGrad(torch.autograd.Function):
    """Autograd node of a call where a 0-d scalar param tensor requires grad (the schema
    takes scalars as floats, so the op's own autograd cannot reach it): the forward calls
    the operator with the scalars as numbers; the backward is one call of the backward op
    with the flags of those scalars and of the tensor params that require grad."""

    @staticmethod
    def forward(ctx, op, inputs, deterministic, scalar_names, block_mask, q, k, v, *tensors):
        # inputs: the operator's positional arguments; tensors: its tensor params, then the
        # 0-d tensors of ``scalar_names`` (tracked here only for their gradients); block_mask:
        # the call's checked BlockMask or None (its table for the backward's tiles)
        o, lse = op.torch_op(*inputs, deterministic=deterministic)
        op.backward.setup_context(ctx, inputs, (o, lse), {"deterministic": deterministic})
        ctx.block_mask = block_mask
        from flashgen.ops.prefill.backward import param_grad_flags

        n_t = len(op.spec.tensor_params)
        want = {p.name: True for p, t in zip(op.spec.tensor_params, tensors[:n_t], strict=True)
                if t.requires_grad}  # fmt: skip
        want.update(dict.fromkeys(scalar_names, True))
        ctx.param_grads = param_grad_flags(op.spec, want)
        ctx.op, ctx.scalar_names = op, scalar_names
        ctx.scalar_dtypes = [t.dtype for t in tensors[n_t:]]
        ctx.scalar_devices = [t.device for t in tensors[n_t:]]  # CPU 0-d tensors, CUDA grads
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        op = ctx.op
        dq, dk, dv, dparams = op.backward.grads(ctx, grad_o, grad_lse)
        tensor_grads = [dparams.get(p.name) for p in op.spec.tensor_params]
        scalar_grads = [
            None if dparams.get(n) is None else dparams[n].to(device=dev, dtype=dt)
            for n, dt, dev in zip(ctx.scalar_names, ctx.scalar_dtypes, ctx.scalar_devices,
                                  strict=True)  # fmt: skip
        ]
        return (None, None, None, None, None, dq, dk, dv, *tensor_grads, *scalar_grads)
