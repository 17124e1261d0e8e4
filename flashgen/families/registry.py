"""The registry: which kernel family runs for a spec, a target and a call, in one place.

:func:`select` reads top to bottom; the ``plan_*`` functions plan what it chose (or what a
caller names), :func:`compile_units` lists the translation units ``flashgen build``
compiles.  Options come in as :class:`flashgen.options.Options`.  Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, replace

from flashgen.codegen import dparam
from flashgen.codegen.abi import needs_block_table, target_for_capability
from flashgen.codegen.dtypes import is_scaled
from flashgen.codegen.plan import KernelPlan, TileConfig
from flashgen.families import blocktable, decode, fa2_bwd, fa2_fwd, hopper_bwd, hopper_fwd, tiles
from flashgen.families.bwd_common import BackwardPlan
from flashgen.families.tiles import BackwardTiles
from flashgen.frontend.errors import OpInputError
from flashgen.frontend.ir import Spec
from flashgen.options import DEFAULT, Options

#: The families by name (the registry's one table; a new family is one more line).
FAMILIES = {
    "fa2_fwd": fa2_fwd,
    "hopper_fwd": hopper_fwd,
    "fa2_bwd": fa2_bwd,
    "hopper_bwd": hopper_bwd,
    "blocktable": blocktable,
    "decode": decode,
}
#: Calls :func:`select` answers: the dense forward, the forward of a call that keeps few
#: keys per row, the backward, the block-table pre-pass, attention against a KV cache.
CALLS = ("fwd", "sparse", "bwd", "blocktable", "decode")


@dataclass(frozen=True)
class Route:
    """What :func:`select` chose: the ``family`` name (a key of :data:`FAMILIES`), the Hopper
    forward's ``persistent`` scheduler (False: none), for the FA2-class backward
    ``atomic_dq``, for the Hopper backward ``ordered_dq`` (its deterministic form)."""

    family: str
    persistent: str | bool = False
    atomic_dq: bool = False
    ordered_dq: bool = False


def persistent_scheduler(spec: Spec, options: Options = DEFAULT) -> str | bool:
    """``options.persistent`` for ``spec``: False for ``off``, ``auto`` -> ``dynamic`` where the
    mask reads tensors (uneven block-table tiles: the dynamic scheduler balances them, which
    paid there; docs/perf-notes.md), else off; always off for an fp8 spec."""
    if is_fp8(spec):
        return False  # the fp8 forward has no persistent form
    p = options.persistent
    if p == "auto":
        p = "dynamic" if needs_block_table(spec) else "off"
    return False if p == "off" else p


def select(
    spec: Spec, target: str, call: str = "fwd", options: Options = DEFAULT, *,
    deterministic: bool = True, param_grads: tuple[str, ...] = (),
) -> Route:  # fmt: skip
    """The family that runs ``call`` (:data:`CALLS`) of ``spec`` on ``target``.

    - forward: the Hopper kernel where :func:`flashgen.families.hopper_fwd.eligible` (sm_90,
      head dims 64/128/256 with head_dim == head_dim_v, no varlen, no pinned tiles) and
      ``options.family`` is not ``fa2``, with ``options.persistent``'s scheduler (a sparse
      call: ``options.sparse_persistent``'s, unless the dense kernel is persistent already);
      else the FA2-class kernel.
    - backward: ``deterministic`` or ``options.atomic_dq is False``: the deterministic
      FA2-class kernels; else the Hopper backward where eligible; else the FA2-class
      atomic-dQ kernels if ``options.atomic_dq``, else the deterministic ones.  With
      ``param_grads`` (params whose gradients the kernels accumulate): never the ordered
      Hopper form, and the Hopper backward only where every term of theirs is a register
      form (:func:`flashgen.codegen.dparam.hopper_forms_ok`).
    - blocktable: the pre-pass.
    - decode: the split-KV decode kernels (:mod:`flashgen.families.decode`; its
      ``unsupported_reason`` says which specs have none); a ``v_from_k`` spec's unit on
      ``sm_90`` is the Hopper MLA one with ``options.decode.mla_unit`` ``"wgmma"``, or
      ``"auto"`` where a call's shape fills it
      (:func:`flashgen.families.decode.mla_unit_for_call`).

    An fp8 spec (``dtype: fp8_e4m3``) has the Hopper forward only, never persistent; a
    ``v_from_k`` spec (MLA's one latent cache) the decode only.

    Raises ``ValueError`` for an unknown call, for an fp8 spec's call that has no kernel:
    a forward the Hopper kernel cannot take, a backward, a decode; and for a ``v_from_k``
    spec's call other than decode."""
    if call not in CALLS:
        raise ValueError(f"unknown call {call!r}; known: {', '.join(CALLS)}")
    if spec.v_from_k and call != "decode":
        raise ValueError(
            f"{spec.name}: v_from_k: true is decode only (op.with_kvcache); it has no "
            f"{'backward' if call == 'bwd' else 'forward'} kernels"
        )
    if is_fp8(spec) and call != "blocktable":
        return _select_fp8(spec, target, call, options)
    if call in ("blocktable", "decode"):
        return Route(call)
    if call in ("fwd", "sparse"):
        if not hopper_fwd.eligible(spec, target, options.family):
            return Route("fa2_fwd")
        persistent = persistent_scheduler(spec, options)
        if call == "sparse" and not persistent:
            sp = options.sparse_persistent
            persistent = False if sp == "off" else sp
        return Route("hopper_fwd", persistent=persistent)
    if (
        deterministic
        and not param_grads
        and options.hopper_bwd.ordered_dq
        and hopper_bwd.ordered_eligible(spec, target, options.family, options.hopper_bwd)
    ):
        return Route("hopper_bwd", atomic_dq=True, ordered_dq=True)
    if deterministic or options.atomic_dq is False:
        return Route("fa2_bwd")
    hopper = hopper_bwd.eligible(spec, target, options.family, options.hopper_bwd)
    if hopper and (
        not param_grads
        or dparam.hopper_forms_ok(spec, param_grads, options.hopper_bwd.dparam_diagonal)
    ):
        return Route("hopper_bwd", atomic_dq=True)
    return Route("fa2_bwd", atomic_dq=bool(options.atomic_dq))


def is_fp8(spec: Spec) -> bool:
    """Whether ``spec``'s inputs are fp8 (1-byte elements with descales)."""
    return is_scaled(spec.dtype)


def _select_fp8(spec: Spec, target: str, call: str, options: Options) -> Route:
    """:func:`select` for an fp8 spec: its forward is the Hopper kernel's fp8 form
    (FlashAttention-3, section 3.3) and nothing else."""
    if call in ("fwd", "sparse"):
        if not hopper_fwd.eligible(spec, target, options.family):
            raise ValueError(
                f"{spec.name}: dtype {spec.dtype} runs on the Hopper forward only (target sm_90, "
                f"head_dim == head_dim_v in {list(tiles.HOPPER_HEAD_DIMS)}, no varlen, no pinned "
                f"tiles, family not fa2); got target {target}, head_dim "
                f"{spec.head_dim}/{spec.head_dim_v}, varlen {spec.varlen}, family {options.family}"
            )
        return Route("hopper_fwd")
    what = "backward" if call == "bwd" else "decode (use a bf16 spec with an fp8 KV cache)"
    raise ValueError(f"{spec.name}: dtype {spec.dtype} has no {what}")


@dataclass(frozen=True)
class DeviceKernels:
    """Which kernels a GPU of compute capability ``capability`` runs for a spec
    (:func:`for_capability`): the ``target`` its units are built for, the ``family``
    (``"Hopper"`` where the forward is the Hopper kernel, else ``"FA2-class"``), the
    :func:`select`-ed ``forward`` and ``backward`` families (the backward of a
    ``deterministic=False`` call) and ``ptx_jit``: whether the driver JIT-compiles the
    units' compute_80 PTX (no SASS for this GPU).  ``str()`` says it in a sentence."""

    capability: tuple[int, int]
    target: str
    family: str
    forward: str
    backward: str
    ptx_jit: bool

    def __str__(self) -> str:
        cc = f"compute capability {self.capability[0]}.{self.capability[1]}"
        fams = f"forward {self.forward}, backward {self.backward}"
        if self.ptx_jit:
            return (
                f"{cc}: FA2-class kernels through PTX JIT ({fams}: the sm_80 units' compute_80 "
                "PTX, compiled by the driver on first load; the Hopper kernels are sm_90a "
                "SASS, which runs on 9.0 only)"
            )
        if self.target == "sm_90":
            what = "Hopper kernels" if self.family == "Hopper" else "FA2-class kernels"
            return f"{cc}: {what} compiled for sm_90a ({fams})"
        return f"{cc}: FA2-class kernels, sm_80 SASS ({fams})"


def check_capability(capability) -> tuple[int, int]:
    """``capability`` as ``(major, minor)``: a tuple or list of two non-negative ints (not
    bools); else :class:`~flashgen.frontend.errors.OpInputError` (a ``ValueError``) naming it."""
    ok = (
        isinstance(capability, (tuple, list))
        and len(capability) == 2
        and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in capability)
    )
    if not ok:
        raise OpInputError(
            f"device: expected a compute capability (major, minor) of two non-negative ints "
            f"such as (9, 0), got {capability!r}"
        )
    return int(capability[0]), int(capability[1])


def for_capability(
    spec: Spec, capability: tuple[int, int], options: Options = DEFAULT
) -> DeviceKernels:
    """What a GPU of compute capability ``capability`` (``(major, minor)``) runs for ``spec``
    under ``options``: 8.x the FA2-class sm_80 units; 9.x the ``sm_90`` target (the Hopper
    kernels where :func:`select` picks them, else FA2-class ones compiled for sm_90a); 10.x
    and newer the FA2-class sm_80 units through their compute_80 PTX.  ``ValueError`` below
    8.0 (:func:`flashgen.codegen.abi.target_for_capability`).  An fp8 spec has the Hopper
    forward only (``backward`` ``"none"``); ``ValueError`` on any other GPU."""
    major, minor = check_capability(capability)
    target = target_for_capability(major, minor)
    if is_fp8(spec) and major != 9:
        raise ValueError(
            f"compute capability {major}.{minor}: spec {spec.name!r} has dtype {spec.dtype}, "
            f"whose only kernel is the Hopper FP8 forward (sm_90a SASS), which runs on 9.0 only"
        )
    fwd = select(spec, target, "fwd", options).family
    if is_fp8(spec):
        return DeviceKernels((major, minor), target, "Hopper", fwd, "none", ptx_jit=False)
    bwd = select(spec, target, "bwd", options, deterministic=False).family
    family = "Hopper" if fwd == "hopper_fwd" else "FA2-class"
    return DeviceKernels((major, minor), target, family, fwd, bwd, ptx_jit=major >= 10)


def choose_tiles(spec: Spec, target: str, gpu: str | None = None, options: Options = DEFAULT):
    """The forward tiles of the family :func:`select` picks (tuning table for ``gpu``)."""
    fam = FAMILIES[select(spec, target, "fwd", options).family]
    return fam.tiles(spec, target, gpu)


def plan_forward(
    spec: Spec,
    target: str,
    options: Options = DEFAULT,
    *,
    gpu: str | None = None,
    tiles: TileConfig | None = None,
    persistent: str | bool | None = None,
    side_terms: bool = True,
    block_descale: bool = False,
) -> KernelPlan:
    """The forward plan of the family :func:`select` picks, or, with ``tiles``, of the
    family those tiles are for (warp-specialized tiles: the Hopper kernel).  ``persistent``
    (None: the route's) applies to the Hopper kernel only.  ``side_terms`` (and
    ``options.side_terms``): row / column terms; ``options.exact_softmax`` goes to the
    family's ``plan`` as it does in :func:`plan_backward`, :func:`plan_hopper_backward` and
    :func:`plan_decode`.  ``block_descale``: the fp8 Hopper forward that reads per-block
    descales (:func:`flashgen.families.hopper_fwd.plan`).  The fused sink (``fused_sink``) is
    the routed family's option even where ``tiles`` are another family's (the spill
    fallback's FA2-class tiles for a Hopper route), so every forward unit of an op agrees
    with :func:`joins_sink`.  Raises ``ValueError`` like the families' ``plan``."""
    route = select(spec, target, "fwd", options)
    name = route.family if tiles is None else (
        "hopper_fwd" if tiles.warp_specialized else "fa2_fwd"
    )
    side_terms = side_terms and options.side_terms
    key = options.family_key(name)
    fused = getattr(options, route.family).fused_sink
    if name == "hopper_fwd":
        return hopper_fwd.plan(
            spec, target, replace(options.hopper_fwd, fused_sink=fused), gpu=gpu, tiles=tiles,
            side_terms=side_terms,
            persistent=route.persistent if persistent is None else persistent, options_key=key,
            exact_softmax=options.exact_softmax, block_descale=block_descale,
        )  # fmt: skip
    if block_descale:
        raise ValueError(
            f"{spec.name}: per-block descales are an input of the fp8 Hopper forward only "
            f"(the {name} family was chosen)"
        )
    return fa2_fwd.plan(
        spec, target, replace(options.fa2_fwd, fused_sink=fused), gpu=gpu, tiles=tiles,
        side_terms=side_terms, options_key=key, exact_softmax=options.exact_softmax,
    )  # fmt: skip


def joins_sink(spec: Spec, target: str, options: Options = DEFAULT) -> bool:
    """Whether the forward kernels of ``spec`` on ``target`` join its sink (a spec with a
    ``sink:`` and the ``fused_sink`` option of the family :func:`select` picks for the
    forward, which :func:`plan_forward` gives every forward unit of the op).  False for a
    spec without a sink.  Raises ``ValueError`` like :func:`select`."""
    if spec.sink is None:
        return False
    return getattr(options, select(spec, target, "fwd", options).family).fused_sink


def _causal_bits(spec: Spec, target: str, options: Options) -> bool:
    return hopper_fwd.eligible(spec, target) and options.hopper_fwd.causal_tiles


def plan_backward(
    spec: Spec,
    target: str,
    options: Options = DEFAULT,
    *,
    atomic_dq: bool = False,
    tiles: BackwardTiles | None = None,
    side_terms=True,
    param_grads: tuple[str, ...] = (),
    sink: bool = False,
) -> BackwardPlan:
    """The FA2-class backward (:func:`flashgen.families.fa2_bwd.plan`; ``param_grads``: the
    params whose gradients its dK/dV kernel accumulates; ``sink``: the sink form, the
    backward of a fused-sink forward).  Raises ``ValueError`` for an fp8 spec
    (:func:`has_backward`) and for ``sink`` on a spec without one."""
    _require_backward(spec)
    if not options.side_terms:
        side_terms = False
    return fa2_bwd.plan(
        spec, target, options.fa2_bwd, atomic_dq=atomic_dq, tiles=tiles, side_terms=side_terms,
        causal_bits=_causal_bits(spec, target, options), options_key=options.family_key("fa2_bwd"),
        exact_softmax=options.exact_softmax, param_grads=tuple(param_grads), sink=sink,
    )  # fmt: skip


def plan_hopper_backward(
    spec: Spec, target: str, options: Options = DEFAULT, *, ordered_dq: bool = False,
    param_grads: tuple[str, ...] = (), sink: bool = False,
) -> BackwardPlan:  # fmt: skip
    """The Hopper backward (:func:`flashgen.families.hopper_bwd.plan`; ``ordered_dq``: its
    deterministic form; ``param_grads``: the params whose gradients it accumulates;
    ``sink``: the sink form).  Raises ``ValueError`` for an fp8 spec (:func:`has_backward`)
    and for ``sink`` on a spec without one."""
    _require_backward(spec)
    return hopper_bwd.plan(
        spec, target, options.hopper_bwd, causal_bits=_causal_bits(spec, target, options),
        options_key=options.family_key("hopper_bwd"), ordered_dq=ordered_dq,
        exact_softmax=options.exact_softmax, param_grads=tuple(param_grads), sink=sink,
    )  # fmt: skip


def has_backward(spec: Spec) -> bool:
    """Whether ``spec`` has backward kernels: not for a dtype whose record is ``scaled``
    (fp8_e4m3: FlashAttention-3's FP8 attention is a forward, and so is flashgen's), and not
    for a ``v_from_k`` spec (decode only)."""
    return not is_fp8(spec) and not spec.v_from_k


def _require_backward(spec: Spec) -> None:
    if spec.v_from_k:
        raise ValueError(f"{spec.name}: v_from_k: true is decode only; it has no backward kernels")
    if not has_backward(spec):
        raise ValueError(
            f"spec {spec.name!r} has dtype {spec.dtype}, which has no backward kernels (the "
            f"FP8 attention is forward only)"
        )


def plan_block_table(spec: Spec, target: str, tile_config: TileConfig) -> KernelPlan:
    """The block-table pre-pass for the forward's tiles ``tile_config``."""
    return blocktable.plan(spec, target, tile_config)


def plan_decode(
    spec: Spec, target: str, options: Options = DEFAULT, *, ragged: bool = False,
    cache_dtype: str | None = None,
) -> decode.DecodePlan:
    """The decode unit (attention, combine, append kernels) of ``spec`` on ``target``
    (:func:`flashgen.families.decode.plan` with ``options.decode`` and
    ``options.exact_softmax``; ``ragged``: the
    ragged-Sq_new unit; ``cache_dtype``: the cache's dtype name, None for the spec's, e.g.
    ``fp8_e4m3``).  Raises ``ValueError`` for a spec decode does not support or tiles that
    do not fit."""
    return decode.plan(
        spec, target, options.decode, options_key=options.family_key("decode"), ragged=ragged,
        cache_dtype=cache_dtype, exact_softmax=options.exact_softmax,
    )  # fmt: skip


def sparse_tiles(spec: Spec, dense: TileConfig, options: Options = DEFAULT) -> TileConfig | None:
    """The tiles of a sparse call (:func:`flashgen.families.tiles.sparse_tiles`), or None
    (also with ``options.sparse_tiles`` off)."""
    return tiles.sparse_tiles(spec, dense) if options.sparse_tiles else None


def compile_units(spec: Spec, target: str, options: Options = DEFAULT) -> dict[str, KernelPlan]:
    """The translation units ``flashgen build`` compiles for ``spec`` on ``target``:
    ``{"fwd": forward plan, "bwd": deterministic backward unit, "bwd_atomic": atomic-dQ
    backward unit}``, and where the Hopper backward applies ``"bwd_wgmma"``; for a spec with
    trainable params (:func:`grad_params`) ``"bwd_dparam"``, ``"bwd_atomic_dparam"`` (and
    ``"bwd_wgmma_dparam"`` where the Hopper backward takes their forms): the same units with
    the gradients of all of them accumulated; for a padded spec whose forward joins its sink
    (:func:`joins_sink`: the ``fused_sink`` option on) ``"bwd_sink"``, ``"bwd_atomic_sink"``
    (and ``"bwd_wgmma_sink"``): the sink form of the backward units (the default options
    leave it off, so their units are the same as ever); and where a sparse
    call has its own tiles ``"fwd_sparse"`` (with the sparse call's scheduler; not where the
    dense forward is persistent: the op's sparse calls run the dense kernel there).  A spec
    without backward (:func:`has_backward`: fp8) has only the forward units; a ``v_from_k``
    spec none (its units are the decode family's)."""
    if spec.v_from_k:
        return {}
    fwd = plan_forward(spec, target, options)
    units = {"fwd": fwd}
    if has_backward(spec):
        units["bwd"] = plan_backward(spec, target, options).unit
        units["bwd_atomic"] = plan_backward(spec, target, options, atomic_dq=True).unit
    hopper = hopper_bwd.eligible(spec, target, options.family, options.hopper_bwd)
    if hopper:
        units["bwd_wgmma"] = plan_hopper_backward(spec, target, options).unit
    grads = grad_params(spec) if has_backward(spec) else ()
    if grads:  # the units a backward that accumulates every trainable param's gradient runs
        units["bwd_dparam"] = plan_backward(spec, target, options, param_grads=grads).unit
        units["bwd_atomic_dparam"] = plan_backward(
            spec, target, options, atomic_dq=True, param_grads=grads
        ).unit
        if hopper and dparam.hopper_forms_ok(spec, grads, options.hopper_bwd.dparam_diagonal):
            units["bwd_wgmma_dparam"] = plan_hopper_backward(
                spec, target, options, param_grads=grads
            ).unit
    if has_backward(spec) and not spec.varlen and joins_sink(spec, target, options):
        units["bwd_sink"] = plan_backward(spec, target, options, sink=True).unit
        units["bwd_atomic_sink"] = plan_backward(
            spec, target, options, atomic_dq=True, sink=True
        ).unit
        if hopper:
            units["bwd_wgmma_sink"] = plan_hopper_backward(spec, target, options, sink=True).unit
    alt = None if persistent_scheduler(spec, options) else sparse_tiles(spec, fwd.tiles, options)
    if alt is not None:
        sp = options.sparse_persistent
        units["fwd_sparse"] = plan_forward(
            spec, target, options, tiles=alt, persistent=False if sp == "off" else sp
        )
    return units


def grad_params(spec: Spec) -> tuple[str, ...]:
    """The params whose gradients the backward kernels accumulate: the f32 params the
    score_mod reads (:func:`flashgen.analysis.derive.differentiable_params`; a param read
    only by the sink gets its gradient in the op's sink epilogue), spec order."""
    from flashgen.analysis.derive import differentiable_params, reads_param

    return tuple(n for n in differentiable_params(spec) if reads_param(spec.score_mod, n))


def forward_tile_candidates(
    spec: Spec, target: str, gpu: str | None = None, options: Options = DEFAULT
) -> list[TileConfig]:
    """Forward tiles to try, in order (:func:`flashgen.families.tiles.forward_tile_candidates`
    after the chosen ones)."""
    return tiles.forward_tile_candidates(spec, choose_tiles(spec, target, gpu, options))
