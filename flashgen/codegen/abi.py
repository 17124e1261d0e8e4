"""The kernel ABI: argument records (:class:`KernelArg`, :class:`TmaArg`), the argument
lists every family shares, and the per-spec facts that shape them.  Pure Python.

Kernel ABI (every forward kernel, every target), in this order:

    q, k, v            const T*     element (b, h, s, d) at b*sb + h*sh + s*ss + d
    o                  T*           same indexing with o's strides
    lse                float*       contiguous [batch, heads_q, seqlen_q], natural log
    q_sb q_sh q_ss  k_sb k_sh k_ss  v_sb v_sh v_ss  o_sb o_sh o_ss   int64_t element strides
    batch heads_q heads_kv seqlen_q seqlen_k                          int
    softmax_scale                                                     float
    q_descale k_descale v_descale   fp8 specs only: const float*, contiguous [batch, heads_kv]
              (the per-block kernel, hopper_fwd.plan(block_descale=True): q's [batch, heads_q,
              ceil(seqlen_q/128)], k's and v's [batch, heads_kv, ceil(seqlen_k/128)])
    sink sink_sb sink_sh   the fused sink only (Options.fa2_fwd / hopper_fwd.fused_sink on a spec
              with a sink): const float*, int64_t, int64_t: the logit of (b, h) at
              b * sink_sb + h * sink_sh (b the sequence for varlen), or null for the keys alone
    p_<name>  for each scalar param, in spec order                    int | float
    t_<name>  for each tensor param, in spec order                    const int* | const float*
              (contiguous, shape as declared)
    blk_tab blk_sb blk_sh   only when the mask reads a tensor param   const unsigned char*,
              int64_t, int64_t: the per-tile class table of the block-table pre-pass
              (uint8 [tab_b, tab_h, ceil(seqlen_q/BLOCK_M), ceil(seqlen_k/BLOCK_N)],
              0 = EMPTY, 1 = PARTIAL, 2 = FULL) and its batch / head strides (0 when
              the mask does not depend on b / h)

varlen specs (``spec.varlen``) differ: ``cu_seqlens_q, cu_seqlens_k`` (const int*,
[batch + 1]) follow the strides, and the sizes are ``batch heads_q heads_kv
max_seqlen_q max_seqlen_k total_q``.  q/k/v/o are packed [total, heads, d], passed with
``x_sb = 0``, ``x_sh`` = the head stride and ``x_ss`` = the token stride (the kernel
adds the sequence's start row times ``x_ss`` itself); lse is contiguous [heads_q, total_q].  The
backward's pre and convert kernels keep the plain ABI (called with batch 1 and
seqlen_q = total_q over the packed tensors).

``KernelPlan.args`` lists these as (name, ctype) pairs, so a launcher only maps
names to values.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashgen.codegen.dtypes import dtype
from flashgen.frontend import ir
from flashgen.frontend.ir import Expr, Index, Spec, Ty, Var

#: nvcc/NVRTC code generation per target.  sm_80 units carry compute_80 PTX besides their
#: sm_80 SASS, so the driver JIT-compiles them on GPUs newer than any SASS they hold (10.x,
#: 12.x); sm_90a SASS is arch-specific (wgmma, setmaxnreg) and runs on compute capability 9.0
#: only, so those units carry no PTX.
GENCODE = {
    "sm_80": "-gencode=arch=compute_80,code=[sm_80,compute_80]",
    "sm_90": "-gencode=arch=compute_90a,code=sm_90a",
}
ARCH = {"sm_80": "sm_80", "sm_90": "sm_90a"}


def target_for_capability(major: int, minor: int) -> str:
    """The kernel target for a GPU of compute capability ``major.minor``: ``sm_90`` on 9.x
    (the Hopper kernels where they apply), ``sm_80`` on 8.x (its SASS) and on 10.x and newer
    (its compute_80 PTX, JIT-compiled by the driver).  ``ValueError`` below 8.0 (the kernels
    use sm_80's mma.sync shapes, ldmatrix and cp.async)."""
    if major == 9:
        return "sm_90"
    if major >= 8:
        return "sm_80"
    raise ValueError(
        f"compute capability {major}.{minor}: flashgen kernels need 8.0 or newer (sm_80's "
        "mma.sync, ldmatrix and cp.async)"
    )


def check_target(target: str) -> None:
    """``ValueError`` naming the supported targets unless ``target`` is one."""
    if target not in GENCODE:
        raise ValueError(f"unknown target {target!r}; supported: {', '.join(GENCODE)}")


@dataclass(frozen=True)
class KernelArg:
    """One kernel argument: its ``name`` and C type ``ctype``."""

    name: str
    ctype: str  # "const __nv_bfloat16*", "float*", "int64_t", "int", "float", "const int*" ...

    @property
    def is_pointer(self) -> bool:
        return self.ctype.endswith("*")


@dataclass(frozen=True)
class TmaArg:
    """A ``CUtensorMap`` kernel argument ``name`` mapping tensor argument ``tensor``
    (``[B, H, S, D]``) in boxes of ``box_cols`` columns x ``box_rows`` rows, with the
    ``swizzle``-byte swizzle (128 or 64; see :mod:`flashgen.runtime.tma`), of element type
    ``dtype`` (a key of :data:`flashgen.runtime.tma.DATA_TYPE`; None: the spec's dtype)."""

    name: str
    tensor: str
    box_rows: int
    box_cols: int = 64
    swizzle: int = 128
    dtype: str | None = None


def dim_args(spec: Spec) -> list[KernelArg]:
    """The problem-size arguments: per-batch lengths, or for varlen the grid's maxima and
    the packed query count (lse and dsum are ``[heads_q, total_q]`` there)."""
    if spec.varlen:
        names = ("batch", "heads_q", "heads_kv", "max_seqlen_q", "max_seqlen_k", "total_q")
    else:
        names = ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k")
    return [KernelArg(n, "int") for n in names]


def varlen_args(spec: Spec) -> list[KernelArg]:
    """``cu_seqlens_q``, ``cu_seqlens_k`` (int32 [batch + 1]) for a varlen spec, else none."""
    if not spec.varlen:
        return []
    return [KernelArg("cu_seqlens_q", "const int*"), KernelArg("cu_seqlens_k", "const int*")]


#: Bytes of shared memory that stage a query block's row of the block table (key blocks;
#: a longer row is read from global memory).
TABLE_ROW_SMEM = 2048


def needs_block_table(spec: Spec) -> bool:
    """Whether ``spec``'s mask reads a tensor param (e.g. document masking
    ``doc_q[q_idx] == doc_kv[kv_idx]``): its tiles cannot be classified from indices alone,
    so a generated pre-pass (:mod:`flashgen.families.blocktable`) writes a per-tile class table that
    the forward kernel reads to skip EMPTY tiles and drop the mask on FULL ones."""
    return _per_spec(
        spec,
        "needs_block_table",
        lambda: spec.mask is not None and any(isinstance(n, Index) for n in ir.walk(spec.mask)),
    )


def block_table_dims(spec: Spec) -> tuple[bool, bool]:
    """``(per_batch, per_head)``: whether the block table needs a batch / head axis
    (the mask reads ``b`` / ``h`` or ``h_kv``, directly or inside a tensor index; a mask
    reading ``h_kv`` gets the per-query-head table, as one reading ``h``); else that axis
    has extent 1 and the kernel reads it with stride 0."""

    def dims() -> tuple[bool, bool]:
        per_h = _uses_index_var(spec.mask, "h") or _uses_index_var(spec.mask, "h_kv")
        return _uses_index_var(spec.mask, "b"), per_h

    return _per_spec(spec, "block_table_dims", dims)


def _per_spec(spec: Spec, what: str, compute):
    """``compute()``, remembered on ``spec`` itself: facts the op reads on every call (IR
    walks on every call add measurable host time on a block-table path).  Kept in the frozen
    dataclass's ``__dict__`` (not a field: equality, hashing and ``replace`` ignore it), so
    they live and die with the spec."""
    facts = spec.__dict__.setdefault("_lower_facts", {})
    if what not in facts:
        facts[what] = compute()
    return facts[what]


def _uses_index_var(e: Expr | None, name: str) -> bool:
    return e is not None and any(
        isinstance(n, Var) and n.name == name and n.name in ir.INDEX_VARS for n in ir.walk(e)
    )


def kernel_args(spec: Spec, sink: bool = False) -> tuple[KernelArg, ...]:
    """The forward ABI of the module docstring, for ``spec``; ``sink``: with the fused sink's
    arguments (:func:`sink_args`) after ``softmax_scale`` and the descales."""
    dt = dtype(spec.dtype)
    t = dt.ctype
    args = [
        KernelArg("q", f"const {t}*"),
        KernelArg("k", f"const {t}*"),
        KernelArg("v", f"const {t}*"),
        KernelArg("o", f"{dt.out_ctype}*"),
        KernelArg("lse", "float*"),
    ]
    for x in "qkvo":
        args += [
            KernelArg(f"{x}_sb", "int64_t"),
            KernelArg(f"{x}_sh", "int64_t"),
            KernelArg(f"{x}_ss", "int64_t"),
        ]
    args += varlen_args(spec)
    args += dim_args(spec)
    args.append(KernelArg("softmax_scale", "float"))
    if dt.scaled:
        args += descale_args()
    if sink:
        args += sink_args()
    for p in spec.scalar_params:
        args.append(KernelArg(f"p_{p.name}", "int" if p.ty == Ty.I32 else "float"))
    for p in spec.tensor_params:
        args.append(KernelArg(f"t_{p.name}", "const int*" if p.ty == Ty.I32 else "const float*"))
    if needs_block_table(spec):
        args += [
            KernelArg("blk_tab", "const unsigned char*"),
            KernelArg("blk_sb", "int64_t"),
            KernelArg("blk_sh", "int64_t"),
        ]
    return tuple(args)



def sink_args() -> list[KernelArg]:
    """``sink, sink_sb, sink_sh``: the fused sink's float32 logit of row (b, h) at ``b *
    sink_sb + h * sink_sh`` (``b`` the request for decode, the sequence for varlen), or null
    for the keys alone (:mod:`flashgen.ops.sink` has the math).  The decode attention kernel and
    the forward kernels with the fused sink take them."""
    return [KernelArg("sink", "const float*")] + [
        KernelArg(n, "int64_t") for n in ("sink_sb", "sink_sh")
    ]


def descale_args() -> list[KernelArg]:
    """``q_descale, k_descale, v_descale`` (const float*, contiguous ``[batch, heads_kv]``):
    an fp8 spec's inputs are ``x_descale[b, h_kv] * x_fp8`` (FlashAttention-3's interface);
    the kernels fold q's and k's into the softmax scale and v's into o.  The same arguments
    carry per-block descales to the kernel planned with ``block_descale`` (contiguous ``[batch,
    heads, ceil(seqlen / 128)]``, heads_q for q, heads_kv for k and v)."""
    return [KernelArg(f"{x}_descale", "const float*") for x in "qkv"]


def strides(*names: str) -> list[KernelArg]:
    """``x_sb, x_sh, x_ss`` (int64_t element strides) for each tensor name ``x``."""
    return [KernelArg(f"{x}_{s}", "int64_t") for x in names for s in ("sb", "sh", "ss")]


def param_args(spec: Spec) -> list[KernelArg]:
    """``p_<name>`` per scalar param, then ``t_<name>`` per tensor param, in spec order."""
    args = [
        KernelArg(f"p_{p.name}", "int" if p.ty == Ty.I32 else "float") for p in spec.scalar_params
    ]
    args += [
        KernelArg(f"t_{p.name}", "const int*" if p.ty == Ty.I32 else "const float*")
        for p in spec.tensor_params
    ]
    return args


#: Code-generation switches of the backward template (``templates/sm_80/bwd.cu.j2``), like
#: :data:`FORWARD_OPTIONS`.  ``bwd_unrolled_loads``: tile loads with a compile-time trip
#: count (as the forward's ``fwd_unrolled_loads``).  ``bwd_async_stats``: the dK/dV kernel
#: fetches each step's lse and dsum with cp.async along with Q and dO (they were plain
#: global loads, a full memory latency inside every step); not with a score_mod, whose
#: math leaves no registers for it (alibi's dK/dV kernels spill 8-16 bytes).
