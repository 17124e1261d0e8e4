"""Check a spec: value ranges, params, and expression types.

:func:`check_spec` returns a new :class:`~flashgen.frontend.ir.Spec` whose ``mask`` and
``score_mod`` trees have every node's ``ty`` filled in, or raises
:class:`~flashgen.frontend.errors.SpecError` pointing at the offending field or
sub-expression.  Pure Python; builds new trees with ``dataclasses.replace``.
"""

from __future__ import annotations

import keyword
import math
import re
import struct
import warnings
from collections.abc import Mapping
from dataclasses import replace

from flashgen.frontend import ir
from flashgen.frontend.errors import SpecError, SpecWarning, clip, did_you_mean
from flashgen.frontend.ir import Binary, Call, Causal, Cond, Const, Expr, Index, Ty, Unary, Var

#: A spec or param name (matched with ``fullmatch``: ``$`` would accept a trailing newline).
NAME_RE = re.compile(r"[a-z][a-z0-9_]*")
MAX_NAME_LEN = 64
#: Most params a spec may declare: every param is an argument of the op's schemas, and the
#: widest one (the varlen backward: 13 fixed arguments) must stay within torch's limit.
MAX_PARAMS = 32
#: Most nodes in one expression (mask or score_mod): every pass, the rendered CUDA and nvcc's
#: time grow with it.
MAX_NODES = 2000
#: Keyword arguments the op takes or will take (the open issues' features: paged KV,
#: split-KV decoding, fp8 scales, ...): no param may shadow one.
OP_KEYWORDS = frozenset(
    {
        "options",
        "plan",
        "block_table",
        "cache_seqlens",
        "num_splits",
        "k_new",
        "v_new",
        "cu_seqlens_q",
        "q_descale",
        "k_descale",
        "v_descale",
        "q_offset",
        "kv_offset",
        "seqlen_q_global",
        "seqlen_k_global",
        "out",
        "deterministic",
        "apply_sink",
        "softmax_scale",
        "block_mask",
        # with_kvcache's schema arguments and plan_decode's keywords (the decode ops are
        # registered with every op, so a param of these names would clash at load)
        "k_cache",
        "v_cache",
        "total_q",
        "cache_capacity",
        "page_size",
        "num_pages",
        "append",
        "pack_gqa",
        "device",
        "cache_dtype",
        "max_seqlen_q",
        # ring_attention's arguments (flashgen.distributed: op, group, layout, mode)
        "op",
        "group",
        "layout",
        "mode",
    }
)
#: Spec names that would clash with the package, the op namespace or generated files.
RESERVED_SPEC_NAMES = frozenset(
    {
        "attention",
        "flashgen",
        "generated",
        "ops",
        "op",
        "lib",
        "library",
        "torch",
        "cuda",
        "cupy",
        "common",
        "templates",
        "specs",
        "tests",
        "test",
        "cache",
        "default",
        "name",  # torch.ops.flashgen.name is the namespace's own name, not an op
        "forward",
        "backward",
        "kernel",
        "kernels",
        "reference",
        "init",
        "main",
    }
)
#: Names a param may not take: DSL words, index variables, op arguments.
RESERVED_PARAM_NAMES = frozenset(
    set(ir.INDEX_VARS)
    | set(ir.FUNCTIONS)
    | set(ir.SHAPE_SYMBOLS)
    | {
        ir.SCORE_VAR,
        "causal",
        "true",
        "false",
        "q",
        "k",
        "v",
        "softmax_scale",
        "deterministic",
        "block_mask",
        "out",
        "lse",
        "batch",
        "heads_q",
        "heads_kv",
        # the Python API's own argument names (op.attention / op.varlen / op.block_mask)
        "self",
        "params",
        "cu_seqlens_q",
        "cu_seqlens_k",
        "max_seqlen_q",
        "max_seqlen_k",
        "seqlen_q",
        "seqlen_k",
        "name",
    }
    | OP_KEYWORDS
)
BLOCK_M = (16, 32, 64, 128, 256)
BLOCK_N = (16, 32, 64, 128)
NUM_WARPS = (1, 2, 4, 8)
#: Dynamic shared memory one CTA may use per target (bytes); mirrors ``SMEM_LIMIT`` of the
#: lowering, and tests/unit/test_spec.py keeps the two (and the budget below) in step.
SMEM_LIMIT = {"sm_80": 166912, "sm_90": 232448}
#: Shared memory of the block-table row a mask that reads tensor params adds (bytes).
TABLE_ROW_SMEM = 2048
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
#: Largest finite float32; f32 literals, defaults and bounds must stay within it (a larger
#: value would be inf in the kernel but finite in the float64 reference).
F32_MAX = 3.4028234663852886e38
#: Smallest positive normal float32: the least softmax_scale accepted.
F32_MIN_NORMAL = 1.1754943508222875e-38
_NUMERIC = (Ty.I32, Ty.F32)
_ARITH = {"+", "-", "*", "/", "%"}
_ORDER = {"<", "<=", ">", ">="}
_EQUALITY = {"==", "!="}
_LOGIC = {"&&", "||"}
_FLOAT_FUNCS = {"exp", "log", "tanh", "sqrt"}


class _Checker:
    def __init__(self, spec: ir.Spec, locations: Mapping[str, ir.Span] | None):
        self.spec = spec
        self.locations = dict(locations or {})

    def where(self, key: str) -> ir.Span:
        """Span recorded for field ``key`` (dotted), else its nearest recorded parent."""
        while key:
            if key in self.locations:
                return self.locations[key]
            key = key.rpartition(".")[0]
        return ir.Span(self.spec.path, 1, 1)

    def fail(self, where: str | ir.Span, message: str) -> SpecError:
        span = self.where(where) if isinstance(where, str) else where
        return SpecError.at(span, message, self.spec.source)

    # ------------------------------------------------------------------ fields
    def fields(self) -> None:
        s = self.spec
        self.name(s.name)
        if s.v_from_k:
            self.v_from_k()
        for key in ("head_dim", "head_dim_v") if not s.v_from_k else ():
            d = getattr(s, key)
            if d not in ir.SUPPORTED_HEAD_DIMS:
                supported = ", ".join(map(str, ir.SUPPORTED_HEAD_DIMS))
                mla = ""
                if any(d in pair for pair in ir.V_FROM_K_HEAD_DIMS):
                    pairs = ", ".join(f"{a}/{b}" for a, b in ir.V_FROM_K_HEAD_DIMS)
                    mla = f"; {pairs} is MLA's decode-only form, with v_from_k: true"
                raise self.fail(key, f"{key} {d} is not supported (supported: {supported}){mla}")
        if s.dtype not in ir.DTYPES:
            raise self.fail(
                "dtype",
                f"unknown dtype '{s.dtype}'{did_you_mean(s.dtype, ir.DTYPES)}; "
                f"expected one of: {', '.join(ir.DTYPES)}",
            )
        if not s.targets:
            raise self.fail(
                "targets", "targets must name at least one of: " + ", ".join(ir.TARGETS)
            )
        for i, t in enumerate(s.targets):
            if t not in ir.TARGETS:
                raise self.fail(
                    f"targets.{i}",
                    f"unknown target '{t}'{did_you_mean(t, ir.TARGETS)}; "
                    f"supported: {', '.join(ir.TARGETS)}",
                )
            if t in s.targets[:i]:
                raise self.fail(f"targets.{i}", f"target '{t}' is listed twice")
        if s.dtype in ir.FP8_DTYPES:
            self.fp8()
        if s.softmax_scale is not None and not (
            math.isfinite(s.softmax_scale) and F32_MIN_NORMAL <= s.softmax_scale <= F32_MAX
        ):
            raise self.fail(
                "softmax_scale",
                "softmax_scale must be 'auto' or a positive number within float32 range, "
                f"got {s.softmax_scale}",
            )
        for key, allowed in (("block_m", BLOCK_M), ("block_n", BLOCK_N), ("num_warps", NUM_WARPS)):
            v = getattr(s.tiles, key)
            if v is not None and v not in allowed:
                raise self.fail(
                    f"tiles.{key}",
                    f"tiles.{key} must be one of {', '.join(map(str, allowed))}, got {v}",
                )
        bm, nw = s.tiles.block_m, s.tiles.num_warps
        if bm is not None and nw is not None and bm % (16 * nw):
            raise self.fail(
                "tiles.block_m",
                f"tiles.block_m {bm} must be a multiple of 16 * num_warps = {16 * nw} "
                "(each warp owns 16-row mma tiles of the query block)",
            )
        if len(s.params) > MAX_PARAMS:
            raise self.fail(
                f"params.{s.params[MAX_PARAMS].name}",
                f"{len(s.params)} params; the limit (MAX_PARAMS) is {MAX_PARAMS} (each is an "
                "argument of the op's schemas, and torch limits their number)",
            )
        self.tiles_fit()
        seen: set[str] = set()
        for p in s.params:
            self.param(p, seen)

    def fp8(self) -> None:
        """An fp8 spec runs FlashAttention-3's FP8 forward (Shah et al. 2024, section 3.3),
        the Hopper kernel: sm_90 only (Ampere has no FP8 tensor cores), its head dims with
        head_dim == head_dim_v, padded inputs (no varlen form) and its own tiles."""
        s = self.spec
        allowed = ", ".join(ir.FP8_TARGETS)
        for i, t in enumerate(s.targets):
            if t not in ir.FP8_TARGETS:
                raise self.fail(
                    f"targets.{i}",
                    f"target '{t}' cannot run dtype {s.dtype}: it has no FP8 tensor cores; "
                    f"{s.dtype} specs target {allowed} only (leave targets out for the "
                    f"default [{allowed}])",
                )
        dims = ", ".join(map(str, ir.FP8_HEAD_DIMS))
        if s.head_dim not in ir.FP8_HEAD_DIMS:
            raise self.fail(
                "head_dim",
                f"dtype {s.dtype} supports head_dim {dims} (the Hopper FP8 forward), "
                f"got {s.head_dim}",
            )
        if s.head_dim_v != s.head_dim:
            raise self.fail(
                "head_dim_v",
                f"dtype {s.dtype} needs head_dim_v == head_dim (the Hopper FP8 forward), got "
                f"head_dim_v {s.head_dim_v} with head_dim {s.head_dim}",
            )
        if s.varlen:
            raise self.fail(
                "varlen",
                f"dtype {s.dtype} has no varlen form yet: the FP8 kernel takes padded "
                "[B, H, S, D] inputs",
            )
        for key in ("block_m", "block_n", "num_warps"):
            if getattr(s.tiles, key) is not None:
                raise self.fail(
                    f"tiles.{key}",
                    f"dtype {s.dtype} cannot pin tiles: pinned tiles select the FA2-class "
                    "kernel, which has no FP8 form; leave tiles out",
                )

    def v_from_k(self) -> None:
        """A ``v_from_k: true`` spec (MLA: the values are the first ``head_dim_v`` columns of
        the keys, one latent cache) is decode only (``op.with_kvcache`` / ``op.plan_decode``,
        ``num_heads_kv`` 1): head dims one of :data:`ir.V_FROM_K_HEAD_DIMS`, dtype fp16 or
        bf16 (the cache may be e4m3), no ``varlen`` form and no pinned ``tiles`` (both are
        prefill's)."""
        s = self.spec
        pairs = ", ".join(f"{a}/{b}" for a, b in ir.V_FROM_K_HEAD_DIMS)
        if (s.head_dim, s.head_dim_v) not in ir.V_FROM_K_HEAD_DIMS:
            key = "head_dim" if s.head_dim not in (a for a, _ in ir.V_FROM_K_HEAD_DIMS) else (
                "head_dim_v")  # fmt: skip
            raise self.fail(
                key,
                f"v_from_k: true supports head_dim/head_dim_v {pairs} (MLA: the values are the "
                f"first head_dim_v columns of the keys), got {s.head_dim}/{s.head_dim_v}",
            )
        if s.dtype not in ("fp16", "bf16"):
            raise self.fail(
                "dtype",
                f"v_from_k: true needs dtype fp16 or bf16 (an e4m3 cache is the decode op's "
                f"k_cache dtype, not the spec's), got {s.dtype}",
            )
        if s.varlen:
            raise self.fail("varlen", "v_from_k: true is decode only: it has no varlen form")
        for key in ("block_m", "block_n", "num_warps"):
            if getattr(s.tiles, key) is not None:
                raise self.fail(
                    f"tiles.{key}",
                    "v_from_k: true is decode only: tiles pin the prefill kernel, which it "
                    "does not have; leave tiles out",
                )

    def tiles_fit(self) -> None:
        """Pinned ``tiles:`` must fit each target's shared memory: the FA2-class forward (the
        kernel pinned tiles get) stages Q (``max(head_dim, head_dim_v)`` wide), K and V, plus
        the block-table row of a mask that reads tensors.  A field left to the tuned table
        counts at its smallest legal value, so this never refuses tiles the build accepts."""
        s, t = self.spec, self.spec.tiles
        if t.block_m is None and t.block_n is None:
            return
        bm = t.block_m or 16 * (t.num_warps or 1)
        bn = t.block_n or 16
        d, dv = s.head_dim, s.head_dim_v
        smem = (bm * max(d, dv) + bn * d + bn * dv) * 2
        if s.mask is not None and any(isinstance(n, Index) for n in ir.walk(s.mask)):
            smem += TABLE_ROW_SMEM
        for target in s.targets:
            limit = SMEM_LIMIT.get(target)
            if limit is not None and smem > limit:
                raise self.fail(
                    "tiles.block_n" if t.block_n is not None else "tiles.block_m",
                    f"tiles {t.block_m or '-'}x{t.block_n or '-'} need at least {smem} B of "
                    f"shared memory at head_dim {d}/{dv}; the limit of a CTA on {target} is "
                    f"{limit} B: pick a smaller tiles.block_m or tiles.block_n",
                )

    def name(self, name: str) -> None:
        if not NAME_RE.fullmatch(name) or len(name) > MAX_NAME_LEN:
            raise self.fail(
                "name",
                f"invalid name '{clip(name)}': use lowercase letters, digits and underscores, "
                f"starting with a letter, at most {MAX_NAME_LEN} characters (no dots or slashes)",
            )
        if "__" in name:
            raise self.fail(
                "name",
                f"name '{name}' contains '__', which is reserved for the ops flashgen derives "
                "from a spec (<name>__varlen, <name>__backward)",
            )
        if keyword.iskeyword(name) or name in RESERVED_SPEC_NAMES:
            raise self.fail("name", f"name '{name}' is reserved; pick another")

    def param(self, p: ir.Param, seen: set[str]) -> None:
        key = f"params.{p.name}"
        if not NAME_RE.fullmatch(p.name) or len(p.name) > MAX_NAME_LEN:
            raise self.fail(
                key,
                f"invalid param name '{clip(p.name)}': use lowercase letters, digits and "
                f"underscores, starting with a letter, at most {MAX_NAME_LEN} characters",
            )
        if keyword.iskeyword(p.name) or p.name in RESERVED_PARAM_NAMES or "__" in p.name:
            what = "an op keyword" if p.name in OP_KEYWORDS else "a built-in name of the DSL or op"
            raise self.fail(key, f"param name '{p.name}' is reserved ({what})")
        if p.name in seen:
            raise self.fail(key, f"param '{p.name}' is declared twice")
        seen.add(p.name)
        if p.ty not in (Ty.I32, Ty.F32):
            raise self.fail(key, f"param '{p.name}' must have type i32 or f32")
        if p.kind == "scalar":
            d = p.default
            if isinstance(d, bool) or not isinstance(d, (int, float)):
                raise self.fail(key + ".default", f"param '{p.name}' needs a numeric default")
            if p.ty == Ty.I32:
                if not isinstance(d, int):
                    raise self.fail(
                        key + ".default",
                        f"param '{p.name}' is i32, so its default must be an integer, got {d}",
                    )
                if not INT32_MIN <= d <= INT32_MAX:
                    raise self.fail(
                        key + ".default", f"default {d} of param '{p.name}' does not fit in int32"
                    )
                self.bounds(p, key)
            elif not (math.isfinite(d) and abs(d) <= F32_MAX):
                raise self.fail(
                    key + ".default",
                    f"default of param '{p.name}' must be a finite float32 value, got {d}",
                )
            self.bounds(p, key)
        elif p.kind == "tensor":
            if p.minimum is not None or p.maximum is not None:
                raise self.fail(key, f"tensor param '{p.name}' cannot have min/max bounds")
            if not p.shape:
                raise self.fail(key + ".shape", f"tensor param '{p.name}' needs a non-empty shape")
            for i, d in enumerate(p.shape):
                ok = (isinstance(d, int) and not isinstance(d, bool) and 0 < d <= INT32_MAX) or (
                    isinstance(d, str) and d in ir.SHAPE_SYMBOLS
                )
                if not ok:
                    hint = did_you_mean(d, ir.SHAPE_SYMBOLS) if isinstance(d, str) else ""
                    raise self.fail(
                        f"{key}.shape.{i}",
                        f"bad shape entry '{d}' of param '{p.name}'{hint}: expected a positive "
                        f"integer (at most {INT32_MAX}: extents are int32 in the kernels) "
                        f"or one of {', '.join(ir.SHAPE_SYMBOLS)}",
                    )
                if self.spec.varlen and d in ("seqlen_q", "seqlen_k"):
                    raise self.fail(
                        f"{key}.shape.{i}",
                        f"shape entry '{d}' of param '{p.name}' is not allowed in a varlen spec: "
                        "each packed sequence has its own length; declare a fixed size (an "
                        "integer) or use batch, num_heads or num_heads_kv",
                    )
        else:
            raise self.fail(key, f"param '{p.name}' has unknown kind '{p.kind}'")

    def bounds(self, p: ir.Param, key: str) -> None:
        """Check a scalar param's optional ``min``/``max``: typed, in range, around the default."""
        for word, b in (("min", p.minimum), ("max", p.maximum)):
            if b is None:
                continue
            where = f"{key}.{word}"
            if isinstance(b, bool) or not isinstance(b, (int, float)):
                raise self.fail(where, f"the {word} of param '{p.name}' must be a number")
            if p.ty == Ty.I32 and not (isinstance(b, int) and INT32_MIN <= b <= INT32_MAX):
                raise self.fail(
                    where, f"param '{p.name}' is i32, so its {word} must be an int32, got {b}"
                )
            if p.ty == Ty.F32 and not (math.isfinite(b) and abs(b) <= F32_MAX):
                raise self.fail(
                    where, f"the {word} of param '{p.name}' must be a finite float32, got {b}"
                )
        # messages name the bounds as declared: above: 0 is held as the least float32 above 0
        declared = dict(p.bounds())
        if p.minimum is not None and p.maximum is not None and p.minimum > p.maximum:
            if p.above is None and p.below is None:
                why = f"min {p.minimum} greater than max {p.maximum}"
            else:
                (lw, lb), (hw, hb) = p.bounds()
                why = f"{lw} {lb} and {hw} {hb}: no {p.ty.value} value lies between them"
            raise self.fail(f"{key}.max", f"param '{p.name}' has {why}")
        if p.minimum is not None and p.default < p.minimum:
            why = (f"is below its min {p.minimum}" if p.above is None
                   else f"is not above {declared['above']} (declared above)")  # fmt: skip
            raise self.fail(f"{key}.default", f"default {p.default} of param '{p.name}' {why}")
        if p.maximum is not None and p.default > p.maximum:
            why = (f"is above its max {p.maximum}" if p.below is None
                   else f"is not below {declared['below']} (declared below)")  # fmt: skip
            raise self.fail(f"{key}.default", f"default {p.default} of param '{p.name}' {why}")

    # ------------------------------------------------------------------ expressions
    def root(self, e: Expr | None, field: str) -> Expr | None:
        if e is None:
            return None
        self.in_score_mod = field == "score_mod"
        nodes = _count_nodes(e)
        if nodes > MAX_NODES:
            raise self.fail(
                e.span if e.span != ir.NO_SPAN else field,
                f"{field} has {nodes} operators and operands; the limit (MAX_NODES) is "
                f"{MAX_NODES} (the kernel's code and its compile time grow with it)",
            )
        try:
            typed = self.expr(e)
        except RecursionError:
            raise self.fail(field, f"{field} is nested too deeply") from None
        start = _leftmost(typed)
        if field == "mask" and typed.ty != Ty.BOOL:
            raise self.fail(
                start,
                f"mask must be a bool expression (e.g. q_idx >= kv_idx), got {typed.ty.value}",
            )
        if field == "score_mod" and typed.ty not in _NUMERIC:
            raise self.fail(
                start, f"score_mod must be a number (the new logit), got {typed.ty.value}"
            )
        if field == "sink":
            typed = self.sink(typed, start)
        if field == "mask" and _never_true(typed, self.spec):
            raise self.fail(
                start,
                "mask is never true: it removes every (q_idx, kv_idx) pair at every length "
                "and param value (every output row would be o = 0, lse = -inf)",
            )
        return typed

    def sink(self, typed: Expr, start: ir.Span) -> Expr:
        """A typed ``sink``: a number (read as f32) that reads no index variable but ``b``,
        ``h``, ``h_kv`` (one logit per (batch, head) row group)."""
        if typed.ty not in _NUMERIC:
            raise self.fail(
                start, f"sink must be a number (a logit per head, e.g. sinks[h]), got "
                f"{typed.ty.value}"
            )  # fmt: skip
        for n in ir.walk(typed):
            if isinstance(n, (Var, Causal)) and (
                isinstance(n, Causal) or (n.name in ir.INDEX_VARS and n.name not in ir.SINK_VARS)
            ):
                what = "causal" if isinstance(n, Causal) else n.name
                raise self.fail(
                    n.span,
                    f"sink may read only {', '.join(ir.SINK_VARS)} and params (one logit per "
                    f"batch entry and head, e.g. sinks[h]), not '{what}'",
                )
        return typed  # an i32 sink is read as f32

    def names(self) -> list[str]:
        out = list(ir.INDEX_VARS) + [p.name for p in self.spec.params] + ["causal", "true", "false"]
        if self.in_score_mod:
            out.append(ir.SCORE_VAR)
        return out

    def expr(self, e: Expr) -> Expr:
        if isinstance(e, Const):
            return self.const(e)
        if isinstance(e, Causal):
            return replace(e, ty=Ty.BOOL)
        if isinstance(e, Var):
            return self.var(e)
        if isinstance(e, Index):
            return self.index(e)
        if isinstance(e, Call):
            return self.call(e)
        if isinstance(e, Unary):
            return self.unary(e)
        if isinstance(e, Binary):
            return self.binary(e)
        if isinstance(e, Cond):
            return self.cond(e)
        raise TypeError(f"not an expression: {e!r}")

    def const(self, e: Const) -> Const:
        v = e.value
        if isinstance(v, bool):
            return replace(e, ty=Ty.BOOL)
        if isinstance(v, int):
            if not INT32_MIN <= v <= INT32_MAX:
                raise self.fail(e.span, f"integer literal {v} does not fit in int32")
            return replace(e, ty=Ty.I32)
        if not math.isfinite(v):
            raise self.fail(e.span, "float literal is not finite (too large)")
        if abs(v) > F32_MAX:
            raise self.fail(
                e.span, f"float literal {v!r} does not fit in float32 (max {F32_MAX:g})"
            )
        if v != 0 and struct.unpack("f", struct.pack("f", v))[0] == 0:
            raise self.fail(
                e.span,
                f"float literal {v!r} rounds to 0 in float32 (the kernels' arithmetic; the "
                "smallest nonzero float32 is about 1.4e-45)",
            )
        return replace(e, ty=Ty.F32)

    def var(self, e: Var) -> Var:
        if e.name in ir.INDEX_VARS:
            return replace(e, ty=ir.INDEX_VARS[e.name])
        if e.name == ir.SCORE_VAR:
            if not self.in_score_mod:
                raise self.fail(e.span, "'score' is only available in score_mod")
            return replace(e, ty=Ty.F32)
        p = self.spec.param(e.name)
        if p is not None:
            if p.kind == "tensor":
                idx = ", ".join(["h"] * len(p.shape))
                raise self.fail(
                    e.span, f"'{e.name}' is a tensor param; index it, e.g. {e.name}[{idx}]"
                )
            return replace(e, ty=p.ty)
        if e.name in ir.FUNCTIONS:
            raise self.fail(e.span, f"'{e.name}' is a function; call it, e.g. {e.name}(x)")
        raise self.fail(
            e.span, f"unknown identifier '{e.name}'{did_you_mean(e.name, self.names())}"
        )

    def index(self, e: Index) -> Index:
        p = self.spec.param(e.name)
        if p is None or p.kind != "tensor":
            if p is not None or e.name in ir.INDEX_VARS or e.name == ir.SCORE_VAR:
                raise self.fail(
                    e.span, f"cannot index '{e.name}': it is a scalar, not a tensor param"
                )
            tensors = [q.name for q in self.spec.tensor_params]
            hint = did_you_mean(e.name, tensors) or did_you_mean(e.name, self.names())
            raise self.fail(e.span, f"unknown identifier '{e.name}'{hint}")
        if len(e.indices) != len(p.shape):
            dims = ", ".join(map(str, p.shape))
            raise self.fail(
                e.span,
                f"'{e.name}' has {len(p.shape)} dimension(s) (shape [{dims}]) "
                f"but {len(e.indices)} index(es) were given",
            )
        indices = tuple(self.expr(i) for i in e.indices)
        for i in indices:
            if i.ty != Ty.I32:
                raise self.fail(_leftmost(i), f"a tensor index must be i32, got {i.ty.value}")
        return replace(e, indices=indices, ty=p.ty)

    def call(self, e: Call) -> Call:
        if e.fn not in ir.FUNCTIONS:
            raise self.fail(
                e.span,
                f"unknown function '{e.fn}'{did_you_mean(e.fn, ir.FUNCTIONS)}; "
                f"available: {', '.join(ir.FUNCTIONS)}",
            )
        n = ir.FUNCTIONS[e.fn]
        if len(e.args) != n:
            raise self.fail(
                e.span, f"{e.fn}() takes {n} argument{'s' if n != 1 else ''}, got {len(e.args)}"
            )
        args = tuple(self.expr(a) for a in e.args)
        for a in args:
            if a.ty not in _NUMERIC:
                raise self.fail(_leftmost(a), f"{e.fn}() needs a number, got {a.ty.value}")
        if e.fn in _FLOAT_FUNCS or any(a.ty == Ty.F32 for a in args):
            ty = Ty.F32
        else:
            ty = Ty.I32
        return replace(e, args=args, ty=ty)

    def unary(self, e: Unary) -> Unary:
        arg = self.expr(e.arg)
        if e.op == "-":
            if arg.ty not in _NUMERIC:
                raise self.fail(e.span, f"unary '-' needs a number, got {arg.ty.value}")
            return replace(e, arg=arg, ty=arg.ty)
        if e.op == "!":
            if arg.ty != Ty.BOOL:
                raise self.fail(e.span, f"'!' needs a bool, got {arg.ty.value}")
            return replace(e, arg=arg, ty=Ty.BOOL)
        raise self.fail(e.span, f"unknown unary operator '{e.op}'")

    def binary(self, e: Binary) -> Binary:
        lhs, rhs = self.expr(e.lhs), self.expr(e.rhs)
        lt, rt = lhs.ty, rhs.ty
        op = e.op
        if op in _LOGIC:
            for side, t in (("left", lt), ("right", rt)):
                if t != Ty.BOOL:
                    raise self.fail(e.span, f"'{op}' needs bools, but its {side} side is {t.value}")
            ty = Ty.BOOL
        elif op in _EQUALITY and lt == Ty.BOOL and rt == Ty.BOOL:
            ty = Ty.BOOL
        elif op in _ARITH | _ORDER | _EQUALITY:
            for side, t in (("left", lt), ("right", rt)):
                if t not in _NUMERIC:
                    kind = "arithmetic" if op in _ARITH else "comparison"
                    raise self.fail(
                        e.span, f"{kind} on bool: '{op}' needs numbers, but its {side} side is bool"
                    )
            if op in _ARITH:
                ty = Ty.I32 if lt == rt == Ty.I32 else Ty.F32
                if op in ("/", "%") and _is_zero(rhs):
                    raise self.fail(e.span, f"'{op}' by zero: the divisor is the constant 0")
            else:
                ty = Ty.BOOL
        else:
            raise self.fail(e.span, f"unknown operator '{op}'")
        return replace(e, lhs=lhs, rhs=rhs, ty=ty)

    def cond(self, e: Cond) -> Cond:
        c, a, b = self.expr(e.cond), self.expr(e.then), self.expr(e.other)
        if c.ty != Ty.BOOL:
            raise self.fail(_leftmost(c), f"the condition of '?:' must be bool, got {c.ty.value}")
        if a.ty == b.ty == Ty.BOOL:
            ty = Ty.BOOL
        elif a.ty in _NUMERIC and b.ty in _NUMERIC:
            ty = Ty.I32 if a.ty == b.ty == Ty.I32 else Ty.F32
        else:
            raise self.fail(
                e.span,
                f"the branches of '?:' have incompatible types {a.ty.value} and {b.ty.value}",
            )
        return replace(e, cond=c, then=a, other=b, ty=ty)


def _never_true(mask: Expr, spec: ir.Spec) -> bool:
    """Whether the interval analysis (:mod:`flashgen.analysis.maskinfo`, sound) proves the typed
    ``mask`` false for every index, length and scalar param value the op accepts (params
    over their declared ``min``/``max``, as :func:`flashgen.analysis.maskinfo.static_env` has
    them).  Relational contradictions such as ``q_idx > kv_idx && kv_idx > q_idx`` are
    beyond intervals and pass."""
    from flashgen.analysis.maskinfo import Range, Truth, evaluate, static_env

    big = float(2**31 - 1)
    env = {n: Range(0.0, big) for n in ("b", "h", "h_kv", "q_idx", "kv_idx")}
    env |= {n: Range(1.0, big) for n in ("seqlen_q", "seqlen_k")}
    params = static_env(spec)  # declared bounds, f32 ones widened to their float32 rounding
    env |= {p.name: params[p.name] for p in spec.scalar_params}
    try:
        t = evaluate(mask, env)
    except (TypeError, KeyError):  # something the analysis does not model: no claim
        return False
    return t == Truth(False, True)


def _count_nodes(e: Expr) -> int:
    """Number of nodes of ``e``, without recursion."""
    n, stack = 0, [e]
    while stack:
        n += 1
        stack.extend(ir.children(stack.pop()))
    return n


def _is_zero(e: Expr) -> bool:
    """Whether ``e`` is a constant zero: a literal (possibly negated or parenthesized) or
    ``+ - *`` of literals, such as ``3 - 3`` or ``0.5 * 0.0``."""
    return _constant(e) == 0


def _constant(e: Expr) -> int | float | None:
    """The value of ``e`` if it is built from number literals with unary ``-`` and
    ``+ - *`` only, else None."""
    if isinstance(e, Const):
        return None if isinstance(e.value, bool) else e.value
    if isinstance(e, Unary) and e.op == "-":
        v = _constant(e.arg)
        return None if v is None else -v
    if isinstance(e, Binary) and e.op in ("+", "-", "*"):
        a, b = _constant(e.lhs), _constant(e.rhs)
        if a is None or b is None:
            return None
        return a + b if e.op == "+" else a - b if e.op == "-" else a * b
    return None


def _leftmost(e: Expr) -> ir.Span:
    """Span of the first character of ``e`` in the source (its leftmost leaf)."""
    return min((n.span for n in ir.walk(e)), key=lambda s: (s.line, s.col))


def check_spec(spec: ir.Spec, *, locations: Mapping[str, ir.Span] | None = None) -> ir.Spec:
    """Check ``spec`` and return a copy with fully typed ``mask`` and ``score_mod``.

    ``locations`` maps field keys (``"head_dim"``, ``"targets.0"``, ``"params.window.default"``,
    ``"tiles.block_m"`` ...) to their spans in the file; :func:`flashgen.frontend.spec.loads_spec`
    passes them so field errors point at the value.  Without them, field errors point at
    the param's span or the top of the file.  Expression errors use the nodes' spans.

    Raises :class:`~flashgen.frontend.errors.SpecError` for unsupported head dims or dtypes,
    bad names, targets, tiles, params, and any expression type error.
    """
    ck = _Checker(spec, locations)
    for p in spec.params:  # params built by hand carry their own span
        if p.span != ir.NO_SPAN:
            ck.locations.setdefault(f"params.{p.name}", p.span)
    ck.fields()
    mask = ck.root(spec.mask, "mask")
    score_mod = ck.root(spec.score_mod, "score_mod")
    sink = ck.root(spec.sink, "sink")
    checked = replace(spec, mask=mask, score_mod=score_mod, sink=sink)
    for span, message in zero_divisors(checked):
        warnings.warn(SpecWarning(f"{span.file}:{span.line}:{span.col}: warning: {message}"),
                      stacklevel=2)  # fmt: skip
    return checked


def zero_divisors(spec: ir.Spec) -> list[tuple[ir.Span, str]]:
    """(span, message) for each float ``/`` or ``%`` of the typed ``spec`` whose divisor
    reads a scalar param and can be 0 for a param value the op accepts (interval analysis,
    :mod:`flashgen.analysis.maskinfo`, over the params' declared bounds): ``score / c`` with
    ``c: 0.0`` makes every logit infinite or NaN (o = 0, lse = -inf) without a word.
    :func:`check_spec` warns (:class:`~flashgen.frontend.errors.SpecWarning`) for each."""
    from flashgen.analysis.maskinfo import ANY, Range, evaluate, static_env

    scalars = {p.name: p for p in spec.scalar_params}
    if not scalars:
        return []
    big = float(INT32_MAX)
    env = {n: Range(0.0, big) for n in ("b", "h", "h_kv", "q_idx", "kv_idx")}
    env |= {n: Range(1.0, big) for n in ("seqlen_q", "seqlen_k")}
    env[ir.SCORE_VAR] = ANY
    params = static_env(spec)  # the values the kernels may receive, as the analysis sees them
    env |= {name: params[name] for name in scalars}
    found = []
    for e in (spec.mask, spec.score_mod):
        for n in ir.walk(e) if e is not None else ():
            if not (isinstance(n, Binary) and n.op in ("/", "%") and n.ty == Ty.F32):
                continue
            names = sorted({v.name for v in ir.walk(n.rhs) if isinstance(v, Var)} & set(scalars))
            if not names:
                continue
            try:
                r = evaluate(n.rhs, env)
            except (TypeError, KeyError, ValueError, ArithmeticError):
                continue  # beyond the analysis: no claim
            if isinstance(r, Range) and r.lo <= 0 <= r.hi:
                which = ", ".join(f"'{x}'" for x in names)
                found.append((
                    n.span,
                    f"the divisor of '{n.op}' reads param {which} and can be 0 (o = 0 and "
                    f"lse = -inf, or NaN, on every row then); declare a bound that excludes "
                    f"0, e.g. {{type: f32, default: ..., above: 0}}",
                ))  # fmt: skip
    return found
