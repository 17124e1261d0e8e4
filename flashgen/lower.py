"""Lowering: a checked :class:`~flashgen.ir.Spec` -> a :class:`KernelPlan` for one target.

Pure Python (no torch, no cupy).  The plan holds everything the renderer, the
compiler and the launcher need: the template to render and its context, the
tile configuration, the launch geometry and the kernel's argument list.

Kernel ABI (every forward kernel, every target), in this order:

    q, k, v            const T*     element (b, h, s, d) at b*sb + h*sh + s*ss + d
    o                  T*           same indexing with o's strides
    lse                float*       contiguous [batch, heads_q, seqlen_q], natural log
    q_sb q_sh q_ss  k_sb k_sh k_ss  v_sb v_sh v_ss  o_sb o_sh o_ss   int64_t element strides
    batch heads_q heads_kv seqlen_q seqlen_k                          int
    softmax_scale                                                     float
    p_<name>  for each scalar param, in spec order                    int | float
    t_<name>  for each tensor param, in spec order                    const int* | const float*
              (contiguous, shape as declared)

``KernelPlan.args`` lists these as (name, ctype) pairs, so a launcher only maps
names to values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from . import ir, masktiles
from .ir import Binary, Call, Causal, Cond, Const, Expr, Index, Spec, Ty, Unary, Var

#: CUDA element type per spec dtype.
CTYPE = {"fp16": "__half", "bf16": "__nv_bfloat16"}
#: nvcc/NVRTC code generation per target.
GENCODE = {
    "sm_80": "-gencode=arch=compute_80,code=sm_80",
    "sm_90": "-gencode=arch=compute_90a,code=sm_90a",
}
ARCH = {"sm_80": "sm_80", "sm_90": "sm_90a"}


@dataclass(frozen=True)
class TileConfig:
    """BLOCK_M query rows x BLOCK_N key columns per CTA step, with ``num_warps`` warps.

    Each warp owns BLOCK_M / num_warps query rows (a multiple of 16, one mma row tile).
    """

    block_m: int
    block_n: int
    num_warps: int

    @property
    def threads(self) -> int:
        return 32 * self.num_warps


#: Default tile table for the FA2-class kernel: (head_dim, has score_mod) -> tiles.
#: Picked from a sweep on the H200 (bf16, seqlen 16k; see docs/perf-notes.md); every
#: entry compiles with zero spills.  A score_mod at head_dim 256 needs registers for its
#: math, so it halves BLOCK_N.  ``flashgen tune`` measures per GPU, dtype and causal and
#: writes :mod:`flashgen.tuning`'s table, which :func:`choose_tiles` prefers when it has a key.
DEFAULT_TILES: dict[tuple[int, bool], TileConfig] = {
    (64, False): TileConfig(128, 64, 4),
    (128, False): TileConfig(128, 32, 4),
    (256, False): TileConfig(64, 64, 4),
    (256, True): TileConfig(64, 32, 4),
}


@dataclass(frozen=True)
class KernelArg:
    name: str
    ctype: str  # "const __nv_bfloat16*", "float*", "int64_t", "int", "float", "const int*" ...

    @property
    def is_pointer(self) -> bool:
        return self.ctype.endswith("*")


@dataclass(frozen=True)
class KernelPlan:
    """Everything needed to render, compile and launch one forward kernel."""

    spec_name: str
    target: str  # "sm_80" | "sm_90"
    template: str  # path under templates/, e.g. "sm_80/fwd.cu.j2"
    kernel_name: str  # extern "C" symbol
    tiles: TileConfig
    smem_bytes: int  # dynamic shared memory per CTA
    args: tuple[KernelArg, ...]
    context: dict = field(compare=False, hash=False)

    @property
    def threads(self) -> int:
        return self.tiles.threads

    @property
    def gencode(self) -> str:
        """nvcc flag selecting the target, e.g. ``-gencode=arch=compute_90a,code=sm_90a``."""
        return GENCODE[self.target]

    @property
    def arch(self) -> str:
        """NVRTC ``--gpu-architecture`` value (``sm_80`` or ``sm_90a``)."""
        return ARCH[self.target]

    def num_m_blocks(self, seqlen_q: int) -> int:
        return (seqlen_q + self.tiles.block_m - 1) // self.tiles.block_m

    def grid(self, batch: int, heads_q: int, seqlen_q: int) -> tuple[int, int, int]:
        """1-D grid over (m_block, batch*head): gridDim.x = ceil(seqlen_q/BLOCK_M)*batch*heads_q."""
        return (self.num_m_blocks(seqlen_q) * batch * heads_q, 1, 1)

    def config(self) -> dict:
        """JSON-able summary for manifests and ``flashgen show``."""
        return {
            "target": self.target,
            "template": self.template,
            "kernel": self.kernel_name,
            "block_m": self.tiles.block_m,
            "block_n": self.tiles.block_n,
            "num_warps": self.tiles.num_warps,
            "threads": self.threads,
            "smem_bytes": self.smem_bytes,
            "causal": self.context["causal"],
            "has_mask": self.context["mask_expr"] is not None,
            "has_score_mod": self.context["score_mod_expr"] is not None,
        }


# ----------------------------------------------------------------------------- expressions -> CUDA
_C_BINOPS = {"+", "-", "*", "/", "%", "<", "<=", ">", ">=", "==", "!=", "&&", "||"}
_F_CALLS = {
    "abs": "fabsf",
    "min": "fminf",
    "max": "fmaxf",
    "exp": "expf",
    "log": "logf",
    "tanh": "tanhf",
    "sqrt": "sqrtf",
    "trunc": "truncf",  # only in derived (backward) expressions
}
_I_CALLS = {"abs": "abs", "min": "min", "max": "max"}
_C_TYPE = {Ty.I32: "int", Ty.F32: "float", Ty.BOOL: "bool"}


def _cast(code: str, frm: Ty | None, to: Ty) -> str:
    if frm == to:
        return code
    return f"(({_C_TYPE[to]})({code}))"


def cuda_expr(e: Expr, spec: Spec) -> str:
    """Render a typed DSL expression as a CUDA C++ expression.

    Names map to kernel locals: index variables keep their names, ``score`` is the
    scaled logit, a scalar param ``x`` is ``p_x``, a tensor param ``t[i, j]`` reads
    ``t_t[i * (shape[1]) + j]`` (row-major, contiguous).  Integer ``/`` and ``%``
    truncate toward zero as in C; the reference does the same.
    """
    if isinstance(e, Const):
        if e.ty == Ty.BOOL:
            return "true" if e.value else "false"
        if e.ty == Ty.F32:
            v = float(e.value)
            if math.isinf(v):
                return "(-INFINITY)" if v < 0 else "INFINITY"
            return f"{v!r}f"
        return f"{int(e.value)}"
    if isinstance(e, Causal):
        return "(q_idx + seqlen_k - seqlen_q >= kv_idx)"
    if isinstance(e, Var):
        p = spec.param(e.name)
        return f"p_{e.name}" if p is not None else e.name
    if isinstance(e, Index):
        p = spec.param(e.name)
        assert p is not None and p.kind == "tensor"
        offset = ""
        for i, ix in enumerate(e.indices):
            extent = _shape_extent(p.shape[i])
            # clamped into the declared shape: a read is never out of bounds (the reference
            # refuses out-of-range indices at kept pairs; dropped pairs may compute any)
            term = f"fg::clamp_index((int64_t)({cuda_expr(ix, spec)}), (int64_t)({extent}))"
            offset = term if i == 0 else f"({offset}) * (int64_t)({extent}) + {term}"
        return f"t_{e.name}[{offset}]"
    if isinstance(e, Unary):
        return f"({e.op}{cuda_expr(e.arg, spec)})"
    if isinstance(e, Binary):
        assert e.op in _C_BINOPS
        lt, rt = e.lhs.ty, e.rhs.ty
        lhs, rhs = cuda_expr(e.lhs, spec), cuda_expr(e.rhs, spec)
        if e.op in ("&&", "||"):
            return f"({lhs} {e.op} {rhs})"
        if Ty.F32 in (lt, rt):  # mixed arithmetic / comparison promotes to float
            lhs, rhs = _cast(lhs, lt, Ty.F32), _cast(rhs, rt, Ty.F32)
            if e.op == "%":
                return f"fmodf({lhs}, {rhs})"
        return f"({lhs} {e.op} {rhs})"
    if isinstance(e, Cond):
        then, other = cuda_expr(e.then, spec), cuda_expr(e.other, spec)
        if e.ty == Ty.F32:
            then, other = _cast(then, e.then.ty, Ty.F32), _cast(other, e.other.ty, Ty.F32)
        return f"({cuda_expr(e.cond, spec)} ? {then} : {other})"
    if isinstance(e, Call):
        if e.ty == Ty.I32:
            return f"{_I_CALLS[e.fn]}({', '.join(cuda_expr(a, spec) for a in e.args)})"
        args = ", ".join(_cast(cuda_expr(a, spec), a.ty, Ty.F32) for a in e.args)
        return f"{_F_CALLS[e.fn]}({args})"
    raise TypeError(f"cannot lower {e!r}")


def _shape_extent(dim) -> str:
    """CUDA expression for one declared tensor-param extent."""
    if isinstance(dim, int):
        return str(dim)
    return {
        "batch": "batch",
        "num_heads": "heads_q",
        "num_heads_kv": "heads_kv",
        "seqlen_q": "seqlen_q",
        "seqlen_k": "seqlen_k",
    }[dim]


def split_causal(mask: Expr | None) -> tuple[bool, Expr | None]:
    """Split ``mask`` into (causal, residual): ``causal`` if it is a top-level ``&&`` conjunct.

    The kernel turns the causal part into block skipping and evaluates only the residual
    elementwise.  ``mask: causal`` gives (True, None).
    """
    if mask is None:
        return False, None
    conj: list[Expr] = []

    def flatten(e: Expr) -> None:
        if isinstance(e, Binary) and e.op == "&&":
            flatten(e.lhs)
            flatten(e.rhs)
        else:
            conj.append(e)

    flatten(mask)
    causal = any(isinstance(c, Causal) for c in conj)
    rest = [c for c in conj if not isinstance(c, Causal)]
    residual: Expr | None = None
    for c in rest:
        residual = c if residual is None else Binary("&&", residual, c, ty=Ty.BOOL)
    return causal, residual


def _uses(e: Expr | None, names: set[str]) -> bool:
    if e is None:
        return False
    return any(isinstance(n, (Var, Index)) and n.name in names for n in ir.walk(e))


# ----------------------------------------------------------------------------- plan
def choose_tiles(spec: Spec, target: str, gpu: str | None = None) -> TileConfig:
    """Tile config of ``spec``'s forward kernel for ``target``.

    Precedence: the spec's ``tiles:`` fields, then the tuning table entry measured on
    ``gpu`` (the CUDA device name, e.g. ``"NVIDIA H200"``; see :mod:`flashgen.tuning`,
    written by ``flashgen tune``), then ``DEFAULT_TILES``.  Without a GPU name (offline
    builds, ``generated/``) the table is not consulted.
    """
    from .tuning import lookup

    d = max(spec.head_dim, spec.head_dim_v)
    has_mod = spec.score_mod is not None
    tuned = lookup(gpu, target, d, spec.dtype, split_causal(spec.mask)[0], has_mod)
    if tuned is not None:
        base = TileConfig(*tuned)
    else:
        base = DEFAULT_TILES.get((d, has_mod)) or DEFAULT_TILES[(d, False)]
    o = spec.tiles
    return TileConfig(
        o.block_m or base.block_m, o.block_n or base.block_n, o.num_warps or base.num_warps
    )


def kernel_args(spec: Spec) -> tuple[KernelArg, ...]:
    t = CTYPE[spec.dtype]
    args = [
        KernelArg("q", f"const {t}*"),
        KernelArg("k", f"const {t}*"),
        KernelArg("v", f"const {t}*"),
        KernelArg("o", f"{t}*"),
        KernelArg("lse", "float*"),
    ]
    for x in "qkvo":
        args += [
            KernelArg(f"{x}_sb", "int64_t"),
            KernelArg(f"{x}_sh", "int64_t"),
            KernelArg(f"{x}_ss", "int64_t"),
        ]
    args += [KernelArg(n, "int") for n in ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k")]
    args.append(KernelArg("softmax_scale", "float"))
    for p in spec.scalar_params:
        args.append(KernelArg(f"p_{p.name}", "int" if p.ty == Ty.I32 else "float"))
    for p in spec.tensor_params:
        args.append(KernelArg(f"t_{p.name}", "const int*" if p.ty == Ty.I32 else "const float*"))
    return tuple(args)


def plan_forward(
    spec: Spec, target: str, gpu: str | None = None, tiles: TileConfig | None = None
) -> KernelPlan:
    """Lower ``spec`` to the forward kernel plan for ``target`` (``sm_80`` or ``sm_90``).

    ``gpu`` (the CUDA device name, optional) selects tuned tiles from the tuning table; see
    :func:`choose_tiles`.  ``tiles`` replaces that choice (the spill fallback of
    :mod:`flashgen.select` passes its candidates here).

    Both targets currently render the FA2-class template (``templates/sm_80/fwd.cu.j2``,
    Dao 2023, Algorithm 1); ``sm_90`` compiles it for ``sm_90a``.

    Raises ``ValueError`` for a target or dtype this version cannot lower.
    """
    if target not in GENCODE:
        raise ValueError(f"unknown target {target!r}; supported: {', '.join(GENCODE)}")
    if spec.dtype not in CTYPE:
        raise ValueError(f"dtype {spec.dtype!r} is not supported yet by the kernels")
    tiles = tiles or choose_tiles(spec, target, gpu)
    d, dv = spec.head_dim, spec.head_dim_v
    if tiles.block_m % (16 * tiles.num_warps):
        raise ValueError(f"BLOCK_M={tiles.block_m} must be a multiple of 16*num_warps")
    if tiles.block_n % 16:
        raise ValueError(f"BLOCK_N={tiles.block_n} must be a multiple of 16")
    elt = 2
    smem = (tiles.block_m * d + tiles.block_n * d + tiles.block_n * dv) * elt
    causal, residual = split_causal(spec.mask)
    score_mod = spec.score_mod
    ctx = {
        "spec_name": spec.name,
        "kernel_name": f"flashgen_{spec.name}_fwd_{target}",
        "dtype": spec.dtype,
        "elem_t": CTYPE[spec.dtype],
        "head_dim": d,
        "head_dim_v": dv,
        "block_m": tiles.block_m,
        "block_n": tiles.block_n,
        "num_warps": tiles.num_warps,
        "threads": tiles.threads,
        "causal": causal,
        "mask_expr": cuda_expr(residual, spec) if residual is not None else None,
        "score_mod_expr": cuda_expr(score_mod, spec) if score_mod is not None else None,
        "args": kernel_args(spec),
        # block sparsity: the mask's tile classifier and its arguments after the tile bounds
        "tile_classifier": masktiles.classifier_source(spec),
        "tile_class_args": ", ".join(n for _, n in masktiles.classifier_params(spec)[4:]),
        "needs_bh": _uses(residual, {"b", "h"})
        or _uses(score_mod, {"b", "h"})
        or bool(spec.tensor_params),
    }
    return KernelPlan(
        spec_name=spec.name,
        target=target,
        template="sm_80/fwd.cu.j2",
        kernel_name=ctx["kernel_name"],
        tiles=tiles,
        smem_bytes=smem,
        args=ctx["args"],
        context=ctx,
    )


# ----------------------------------------------------------------------------- backward
@dataclass(frozen=True)
class BackwardTiles:
    """Tiles of the backward kernels (FA2 backward, Dao 2023, Algorithm 2).

    dkdv: each CTA owns ``dkdv_block_n`` key rows (16 per warp) and walks the query rows of
    every head in its GQA group ``dkdv_block_m`` at a time; ``dkdv_dsplit`` > 1 splits the
    dK/dV columns over that many CTAs when the accumulators would not fit in registers.
    dq: each CTA owns ``dq_block_m`` query rows (16 per warp) and walks ``dq_block_n`` keys
    at a time (deterministic path only; the atomic-dQ path has no dq kernel and ignores
    these three fields).
    """

    dkdv_block_n: int
    dkdv_block_m: int
    dkdv_warps: int
    dkdv_dsplit: int
    dq_block_m: int
    dq_block_n: int
    dq_warps: int


#: (head_dim, has score_mod) -> tiles; every entry compiles with zero spills for the
#: shipped specs (a score_mod's math needs registers, so it gets narrower steps).
BACKWARD_TILES: dict[tuple[int, bool], BackwardTiles] = {
    (64, False): BackwardTiles(64, 64, 4, 1, 64, 64, 4),
    (128, False): BackwardTiles(64, 32, 4, 1, 64, 32, 4),
    (128, True): BackwardTiles(64, 16, 4, 1, 64, 32, 4),
    (256, False): BackwardTiles(64, 32, 4, 2, 64, 32, 4),
}
#: Tiles of the atomic-dQ path (:func:`plan_backward` with ``atomic_dq=True``), same keys.
#: Its dkdv kernel also holds a [dkdv_block_m x head_dim / dsplit / warps] dQ accumulator
#: during the dQ product (acc_s / acc_dp are dead by then) and KV_N x (KV_M + 8) elements of
#: shared memory for dS^T.  The number of float atomics is B*Hq*Sq*Sk*D / dkdv_block_n
#: (halved by causal), so a wider key block means fewer atomics.  Not tuned on a GPU yet:
#: the same tiles as the deterministic kernels, except a score_mod at head_dim 128, where
#: 64 key rows spill on sm_90a (alibi, 16-52 bytes) and 32 rows with 2 warps do not
#: (4x FA2's atomics; the other zero-spill option, dsplit 2, recomputes S and dP twice).
ATOMIC_BACKWARD_TILES: dict[tuple[int, bool], BackwardTiles] = {
    (64, False): BackwardTiles(64, 64, 4, 1, 64, 64, 4),
    (128, False): BackwardTiles(64, 32, 4, 1, 64, 32, 4),
    (128, True): BackwardTiles(32, 16, 2, 1, 64, 32, 4),
    (256, False): BackwardTiles(64, 32, 4, 2, 64, 32, 4),
}
#: Warps (one row each) per CTA of the preprocess kernel D = rowsum(dO * O).
PRE_WARPS = 8
#: Threads per CTA of the atomic path's convert kernel (dq = scale * dq_accum, 4 columns each).
CONVERT_THREADS = 256


@dataclass(frozen=True)
class BackwardPlan:
    """The kernels of the backward pass, rendered from one source (``sm_80/bwd.cu.j2``).

    Deterministic path (``atomic_dq`` False; ``dq`` set, ``convert`` None): ``pre``,
    D = rowsum(dO * O) per query row (fp32); ``dkdv``, dK and dV with KV outer / Q inner,
    summed over the query heads of a GQA group in registers; ``dq``, dQ with Q outer /
    KV inner.  No atomics: every output element is written by one thread, so the gradients
    are bitwise reproducible run to run.

    Atomic-dQ path (``atomic_dq`` True; ``convert`` set, ``dq`` None): ``pre`` also zeroes
    the fp32 ``dq_accum`` [B, Hq, Sq, D] buffer; ``dkdv`` also adds dS K of every step into
    it with float atomics; ``convert`` writes dq = softmax_scale * dq_accum in the input
    dtype.  5 matmuls per (query block, key block) instead of 7; dQ is not bitwise
    reproducible (the order of the atomic adds varies).
    """

    spec_name: str
    target: str
    tiles: BackwardTiles
    pre: KernelPlan
    dkdv: KernelPlan
    dq: KernelPlan | None
    convert: KernelPlan | None = None
    atomic_dq: bool = False

    @property
    def unit(self) -> KernelPlan:
        """The plan that stands for the whole translation unit when compiling (all its
        kernels share one source, template and target): ``dq``, or ``dkdv`` on the
        atomic path."""
        return self.dkdv if self.atomic_dq else self.dq

    @property
    def kernels(self) -> tuple[KernelPlan, ...]:
        """Every kernel of the unit, in launch order: (pre, dkdv, dq) or (pre, dkdv, convert)."""
        last = self.convert if self.atomic_dq else self.dq
        return (self.pre, self.dkdv, last)

    def config(self) -> dict:
        """JSON-able summary for manifests."""
        t = self.tiles
        out = {
            "target": self.target,
            "template": self.dkdv.template,
            "kernels": [kp.kernel_name for kp in self.kernels],
            "dkdv": {
                "block_n": t.dkdv_block_n,
                "block_m": t.dkdv_block_m,
                "num_warps": t.dkdv_warps,
                "dsplit": t.dkdv_dsplit,
                "smem_bytes": self.dkdv.smem_bytes,
            },
        }
        if self.atomic_dq:
            out["convert"] = {"threads": CONVERT_THREADS}
        else:
            out["dq"] = {
                "block_m": t.dq_block_m,
                "block_n": t.dq_block_n,
                "num_warps": t.dq_warps,
                "smem_bytes": self.dq.smem_bytes,
            }
        out["deterministic"] = not self.atomic_dq  # False: the atomic-dQ kernels
        return out

    def grids(
        self, batch: int, heads_q: int, heads_kv: int, seqlen_q: int, seqlen_k: int
    ) -> dict[str, tuple[int, int, int]]:
        """1-D grids (gridDim.x only) by kernel role: ``pre``, ``dkdv`` and ``dq`` (or
        ``convert`` on the atomic path)."""
        t = self.tiles
        rows = batch * heads_q * seqlen_q
        out = {"pre": (-(-rows // PRE_WARPS), 1, 1)}
        n_blocks = -(-seqlen_k // t.dkdv_block_n)
        out["dkdv"] = (n_blocks * batch * heads_kv * t.dkdv_dsplit, 1, 1)
        if self.atomic_dq:
            chunks = rows * (self.dkdv.context["head_dim"] // 4)
            out["convert"] = (-(-chunks // CONVERT_THREADS), 1, 1)
        else:
            m_blocks = -(-seqlen_q // t.dq_block_m)
            out["dq"] = (m_blocks * batch * heads_q, 1, 1)
        return out


def _strides(*names: str) -> list[KernelArg]:
    return [KernelArg(f"{x}_{s}", "int64_t") for x in names for s in ("sb", "sh", "ss")]


def _param_args(spec: Spec) -> list[KernelArg]:
    args = [
        KernelArg(f"p_{p.name}", "int" if p.ty == Ty.I32 else "float") for p in spec.scalar_params
    ]
    args += [
        KernelArg(f"t_{p.name}", "const int*" if p.ty == Ty.I32 else "const float*")
        for p in spec.tensor_params
    ]
    return args


def plan_backward(
    spec: Spec, target: str, *, atomic_dq: bool = False, tiles: BackwardTiles | None = None
) -> BackwardPlan:
    """Lower ``spec`` to its backward kernels for ``target`` (template ``sm_80/bwd.cu.j2``).

    ``atomic_dq`` False: the deterministic kernels (pre, dkdv, dq; tiles from
    ``BACKWARD_TILES``).  True: the atomic-dQ kernels (pre, dkdv with the dQ product and
    float atomics into ``dq_accum``, convert; tiles from ``ATOMIC_BACKWARD_TILES``); see
    :class:`BackwardPlan`.  The score_mod derivative d score_mod / d score comes from
    :func:`flashgen.derive.d_dscore`.  ``tiles`` replaces the table's choice (the spill
    fallback of :mod:`flashgen.select`).  Raises ``ValueError`` like :func:`plan_forward`.
    """
    from .derive import d_dscore

    fwd = plan_forward(spec, target)  # validates target and dtype
    t = tiles or _table_backward_tiles(spec, atomic_dq)
    d, dv = spec.head_dim, spec.head_dim_v
    et = CTYPE[spec.dtype]
    dims = [KernelArg(n, "int") for n in ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k")]
    ins = [KernelArg(n, f"const {et}*") for n in ("q", "k", "v", "dout")]
    stats = [KernelArg("lse", "const float*"), KernelArg("dsum", "const float*")]
    tail = [*dims, KernelArg("softmax_scale", "float"), *_param_args(spec)]
    accum = [KernelArg("dq_accum", "float*")] if atomic_dq else []
    pre_args = (
        KernelArg("o", f"const {et}*"),
        KernelArg("dout", f"const {et}*"),
        KernelArg("dsum", "float*"),
        *accum,
        *_strides("o", "dout"),
        KernelArg("batch", "int"),
        KernelArg("heads_q", "int"),
        KernelArg("seqlen_q", "int"),
    )
    dkdv_args = (
        *ins,
        *stats,
        KernelArg("dk", f"{et}*"),
        KernelArg("dv", f"{et}*"),
        *accum,
        *_strides("q", "k", "v", "dout", "dk", "dv"),
        *tail,
    )
    convert_args = (
        KernelArg("dq_accum", "const float*"),
        KernelArg("dq", f"{et}*"),
        *_strides("dq"),
        KernelArg("batch", "int"),
        KernelArg("heads_q", "int"),
        KernelArg("seqlen_q", "int"),
        KernelArg("softmax_scale", "float"),
    )
    dq_args = (
        *ins,
        *stats,
        KernelArg("dq", f"{et}*"),
        *_strides("q", "k", "v", "dout", "dq"),
        *tail,
    )
    score_grad = d_dscore(spec.score_mod) if spec.score_mod is not None else None
    base = f"flashgen_{spec.name}_bwd_{target}"
    ctx = dict(fwd.context)
    ctx.update(
        atomic_dq=atomic_dq,
        kernel_pre=f"{base}_pre",
        kernel_dkdv=f"{base}_dkdv_atomic" if atomic_dq else f"{base}_dkdv",
        kernel_dq=f"{base}_dq",
        kernel_convert=f"{base}_convert",
        pre_args=pre_args,
        dkdv_args=dkdv_args,
        dq_args=dq_args,
        convert_args=convert_args,
        convert_threads=CONVERT_THREADS,
        pre_warps=PRE_WARPS,
        dkdv_block_n=t.dkdv_block_n,
        dkdv_block_m=t.dkdv_block_m,
        dkdv_warps=t.dkdv_warps,
        dkdv_dsplit=t.dkdv_dsplit,
        dq_block_m=t.dq_block_m,
        dq_block_n=t.dq_block_n,
        dq_warps=t.dq_warps,
        score_grad_expr=cuda_expr(score_grad, spec) if score_grad is not None else None,
    )
    dkdv_smem = (t.dkdv_block_n * (d + dv) + 2 * t.dkdv_block_m * (d + dv)) * 2
    dkdv_smem += 2 * 2 * t.dkdv_block_m * 4  # lse and dsum of both stages
    if atomic_dq:
        dkdv_smem += t.dkdv_block_n * (t.dkdv_block_m * 2 + 16)  # dS^T, padded rows
    dq_smem = (t.dq_block_m * (d + dv) + 2 * t.dq_block_n * (d + dv)) * 2

    def kp(name: str, warps: int, smem: int, args) -> KernelPlan:
        return KernelPlan(
            spec_name=spec.name,
            target=target,
            template="sm_80/bwd.cu.j2",
            kernel_name=name,
            tiles=TileConfig(16 * warps, 16, warps),
            smem_bytes=smem,
            args=tuple(args),
            context=ctx,
        )

    pre = kp(ctx["kernel_pre"], PRE_WARPS, 0, pre_args)
    dkdv = kp(ctx["kernel_dkdv"], t.dkdv_warps, dkdv_smem, dkdv_args)
    if atomic_dq:
        convert = kp(ctx["kernel_convert"], CONVERT_THREADS // 32, 0, convert_args)
        return BackwardPlan(spec.name, target, t, pre, dkdv, None, convert, atomic_dq=True)
    dq = kp(ctx["kernel_dq"], t.dq_warps, dq_smem, dq_args)
    return BackwardPlan(spec.name, target, t, pre, dkdv, dq)


def compile_units(spec: Spec, target: str) -> dict[str, KernelPlan]:
    """The translation units ``flashgen build`` compiles for ``spec`` on ``target``:
    ``{"fwd": forward plan, "bwd": deterministic backward unit, "bwd_atomic": atomic-dQ
    backward unit}`` (see :attr:`BackwardPlan.unit`)."""
    return {
        "fwd": plan_forward(spec, target),
        "bwd": plan_backward(spec, target).unit,
        "bwd_atomic": plan_backward(spec, target, atomic_dq=True).unit,
    }


#: Forward tiles tried, in order, after the chosen ones spill (a user's score_mod or mask
#: can need more registers than the tables, measured on the shipped specs, leave free).
FORWARD_FALLBACK_TILES = (TileConfig(64, 64, 4), TileConfig(64, 32, 4), TileConfig(64, 16, 4))


def forward_tile_candidates(spec: Spec, target: str, gpu: str | None = None) -> list[TileConfig]:
    """Tiles to try for ``spec``'s forward kernel: the chosen ones, then (unless the spec
    fixes any of its ``tiles:``) :data:`FORWARD_FALLBACK_TILES`."""
    first = choose_tiles(spec, target, gpu)
    o = spec.tiles
    if o.block_m or o.block_n or o.num_warps:
        return [first]
    return [first, *(t for t in FORWARD_FALLBACK_TILES if t != first)]


def _table_backward_tiles(spec: Spec, atomic_dq: bool) -> BackwardTiles:
    """The tables' backward tiles for ``spec``.  On the atomic path, an elementwise mask
    beyond causal at head_dim 128 takes 16-row inner steps in dkdv (same key block, so the
    same number of atomics): its registers are gone at 32 rows (prefix_lm spills 76 bytes
    on sm_90a there)."""
    table = ATOMIC_BACKWARD_TILES if atomic_dq else BACKWARD_TILES
    dmax = max(spec.head_dim, spec.head_dim_v)
    t = table.get((dmax, spec.score_mod is not None)) or table[(dmax, False)]
    if atomic_dq and dmax == 128 and split_causal(spec.mask)[1] is not None:
        t = replace(t, dkdv_block_m=min(t.dkdv_block_m, 16))
    return t


def backward_tile_candidates(spec: Spec, *, atomic_dq: bool = False) -> list[BackwardTiles]:
    """Backward tiles to try: the table's, then the same with 16-row inner steps (the
    smallest score tiles), keeping the column split."""
    first = _table_backward_tiles(spec, atomic_dq)
    narrow = replace(first, dkdv_block_m=16, dq_block_n=16)
    return [first] if narrow == first else [first, narrow]
