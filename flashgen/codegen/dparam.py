"""Param gradients inside the backward kernels: the template fields and kernel arguments of
the ``dparam`` code a backward unit compiles in when params require grad.  Pure Python.

For each requested param (spec order) the dK/dV kernel takes ``dp_<name>`` (``float*``, the
fp32 gradient buffer) and ``dps_<name>`` (``int64_t``, its row stride): 0 (atomic mode:
every CTA adds into the one buffer of the param's ``numel`` elements) or ``numel``
(deterministic mode: CTA ``r`` adds into row ``r`` of a ``[rows, numel]`` buffer, every add of
a CTA issued by one thread in a fixed order; the op sums the rows in a fixed order).

Each :class:`~flashgen.analysis.derive.ParamGradTerm` becomes one template entry
(:func:`fields`): its reduction form (:func:`flashgen.analysis.paramgrad.reduction_form`),
``partial`` (d score_mod / d param[idx] as CUDA, in the scope of the kernel's per-element
code: ``score``, the clamped ``q_idx`` / ``kv_idx`` and their float twins, ``b``, ``h``,
``h_kv``, the params) and ``offset`` (the flat int64 element offset of the read, each
subscript clamped into its extent exactly where the read clamps it, so the gradient goes
to the element the kernel read).
"""

from __future__ import annotations

from flashgen.analysis import masktiles
from flashgen.analysis.derive import d_dscore, param_grad_terms
from flashgen.analysis.paramgrad import affine_partial, reduction_form
from flashgen.codegen.abi import KernelArg
from flashgen.codegen.cuda_expr import _shape_extent, cuda_expr, float_expr, index_in_bounds
from flashgen.frontend import ir
from flashgen.frontend.ir import Expr, Spec, Var

#: The reduction forms whose per-step contributions go through a shared-memory tile
#: (``KV_N x KV_M`` floats per term) in the FA2-class dK/dV kernel; ``cta`` and ``key`` are
#: reduced in registers.  The Hopper backward takes the register forms (and ``diagonal``
#: with ``hopper_bwd.dparam_diagonal``: :func:`hopper_forms_ok`).
TILE_FORMS = ("query", "diagonal", "general")
REGISTER_FORMS = ("cta", "key")
#: The forms the Hopper backward accumulates at head_dim 64 and 256: the register forms and,
#: with ``hopper_bwd.dparam_diagonal``, ``diagonal`` (a step's sums per diagonal of each
#: warp's slice by shuffles, then of the CTA's tile, templates/common/dparam_diag.cuh).
HOPPER_FORMS = (*REGISTER_FORMS, "diagonal")


def _reads(e: Expr, name: str) -> bool:
    return any(isinstance(n, Var) and n.name == name for n in ir.walk(e))


def element_offset(spec: Spec, param: str, indices: tuple[Expr, ...]) -> str:
    """The flat element offset (int64 CUDA expression, row-major) of ``param[indices]``,
    each subscript clamped into its extent unless
    :func:`~flashgen.codegen.cuda_expr.index_in_bounds` proves it inside (as the read,
    :func:`flashgen.codegen.cuda_expr._tensor_read`, clamps it); ``"0"`` for a scalar."""
    if not indices:
        return "0"
    p = spec.param(param)
    offset = ""
    for i, ix in enumerate(indices):
        dim = p.shape[i]
        code = cuda_expr(ix, spec)
        if not index_in_bounds(ix, dim, spec):
            code = f"fg::clamp_index({code}, {_shape_extent(dim)})"
        term = f"(int64_t)({code})"
        offset = term if i == 0 else f"({offset}) * (int64_t)({_shape_extent(p.shape[i])}) + {term}"
    return offset


def numel_expr(spec: Spec, param: str) -> list:
    """The declared shape of ``param`` (ints and shape symbols); ``[]`` for a scalar."""
    p = spec.param(param)
    return list(p.shape) if p.kind == "tensor" else []


def fields(spec: Spec, names) -> dict:
    """Template fields of the dparam code for the params ``names`` (those whose gradient a
    backward computes; spec order kept): ``dparam`` (one dict per param: ``name``, ``ptr``,
    ``stride``) and ``dparam_terms`` (one dict per term: ``param``, ``ptr``, ``stride``,
    ``k`` (its number: the template's local names), ``form``, ``offset``, ``partial``,
    ``reads_h``: the element changes with the query head,
    so register forms flush when a step's head ends).  Empty lists without names: the
    unit renders exactly as it did before dparam existed."""
    wanted = set(names)
    params, terms = [], []
    for p in spec.params:
        if p.name not in wanted:
            continue
        ptr, stride = f"dp_{p.name}", f"dps_{p.name}"
        params.append({"name": p.name, "ptr": ptr, "stride": stride})
        for t in param_grad_terms(spec.score_mod, p.name):
            terms.append(
                {
                    "k": len(terms),
                    "param": p.name,
                    "ptr": ptr,
                    "stride": stride,
                    "form": reduction_form(t, spec),
                    "offset": element_offset(spec, p.name, t.indices),
                    "partial": float_expr(t.partial, spec, None),
                    "reads_h": any(_reads(i, "h") for i in t.indices),
                }
            )
    return {"dparam": params, "dparam_terms": terms}


#: The name of the Hopper kernel's constant-tile test of diagonal term ``k``
#: (:func:`const_tile_fields`), ``CONST_TEST + str(k)``.
CONST_TEST = "fg_dparam_const"


def const_tile_fields(spec: Spec, names) -> dict:
    """Template fields of the Hopper backward's constant tiles (``hopper_bwd.dparam_const_tiles``)
    for the params ``names``: ``dparam_const_source``, per diagonal term ``k`` (numbered as
    :func:`fields` numbers them) the C++ test ``fg_dparam_const<k>(q0, q1, k0, k1, <the
    classifier's other arguments>)``, true when every subscript of the term's read is one value
    over the tile (:func:`flashgen.analysis.masktiles.constant_source`: the tile classifier's
    interval rules); ``dparam_const_headers``, the headers of their ranges
    (:data:`flashgen.analysis.masktiles.RANGE_HEADERS`: ``masktiles_i32.cuh`` for T5's
    subscripts); ``dparam_const_args``, the arguments after the tile's bounds.  None, [] and
    "" without a diagonal term: the unit renders as without the option."""
    wanted = set(names)
    funcs, headers, k = [], [], 0
    for p in spec.params:
        if p.name not in wanted:
            continue
        for t in param_grad_terms(spec.score_mod, p.name):
            if reduction_form(t, spec) == "diagonal":
                funcs.append(masktiles.constant_source(spec, t.indices, f"{CONST_TEST}{k}"))
                header = masktiles.RANGE_HEADERS[masktiles.constant_ranges(spec, t.indices)]
                if header is not None and header not in headers:
                    headers.append(header)
            k += 1
    if not funcs:
        return {"dparam_const_source": None, "dparam_const_headers": [], "dparam_const_args": ""}
    return {
        "dparam_const_source": "\n".join(funcs),
        "dparam_const_headers": sorted(headers),
        "dparam_const_args": ", ".join(n for _, n in masktiles.classifier_params(spec)[4:]),
    }


def affine_fields(spec: Spec, names) -> list | None:
    """The template entries of the Hopper backward's ``dparam_affine`` form
    (``hopper_bwd.dparam_affine``, templates/common/dparam_affine.j2) for the params
    ``names``: :func:`fields`' ``dparam_terms`` entries with ``q_coef`` / ``kv_coef`` (the
    partial's coefficients of ``q_idx`` / ``kv_idx`` as CUDA floats, None for 0), where every
    term is :func:`~flashgen.analysis.paramgrad.affine_partial` and d score_mod / d score is
    1 (the dS^T the kernel computes for dK and dQ is then dS w.r.t. the score_mod's result);
    None otherwise (the per-pair form)."""
    g = d_dscore(spec.score_mod) if spec.score_mod is not None else None
    if not (isinstance(g, ir.Const) and g.value == 1.0):
        return None
    wanted = set(names)
    terms = [t for p in spec.params if p.name in wanted
             for t in param_grad_terms(spec.score_mod, p.name)]  # fmt: skip
    entries = fields(spec, names)["dparam_terms"]
    out = []
    for entry, t in zip(entries, terms, strict=True):
        lin = affine_partial(t, spec)
        if lin is None:
            return None
        coef = {k: None if lin[k] is None else float_expr(lin[k], spec, None)
                for k in ("q_idx", "kv_idx")}  # fmt: skip
        out.append({**entry, "q_coef": coef["q_idx"], "kv_coef": coef["kv_idx"]})
    return out or None


def kernel_args(spec: Spec, names) -> tuple[KernelArg, ...]:
    """``dp_<name>`` (float*) and ``dps_<name>`` (int64_t) per requested param, spec order."""
    wanted = set(names)
    out: list[KernelArg] = []
    for p in spec.params:
        if p.name in wanted:
            out += [KernelArg(f"dp_{p.name}", "float*"), KernelArg(f"dps_{p.name}", "int64_t")]
    return tuple(out)


def forms(spec: Spec, names) -> set[str]:
    """The reduction forms of every term of the params ``names``."""
    return {t["form"] for t in fields(spec, names)["dparam_terms"]}


def hopper_forms_ok(spec: Spec, names, diagonal: bool = False) -> bool:
    """Whether the Hopper backward can accumulate these params' gradients: every term per
    CTA (``cta``), or at head_dim 64 / 256 per CTA, per key (``key``) or, with ``diagonal``
    (``Options.hopper_bwd.dparam_diagonal``), per relative position (a table indexed through
    q_idx - kv_idx, such as T5's bias: each warp's sums per diagonal by shuffles, the CTA's
    from the warps' in a fixed order; deterministic=True never takes the Hopper kernel with
    param gradients); at
    head_dim 128 the consumers' 240 registers do not hold a key term's two sums (68-76
    spilled bytes on nvcc 13.0), so only ``cta``.  The others (a query / general table)
    take the FA2-class backward with the accumulation."""
    got = forms(spec, names)
    if spec.head_dim == 128:
        return got <= {"cta"}
    return got <= (set(HOPPER_FORMS) if diagonal else set(REGISTER_FORMS))


def warp_diag_slots(nq: int) -> int:
    """Shared floats per warp of a diagonal term in the Hopper kernel (``fg::warp_diag_slots``,
    templates/common/dparam_diag.cuh) for a warp slice of ``nq`` 8-column tiles: its
    diagonals u in [-15, 8 nq) at u + 16, rounded up to whole 32-float rows of the lanes'
    stores."""
    return 32 * ((nq + 5) // 4)


def tile_terms(spec: Spec, names) -> int:
    """How many terms of ``names`` reduce through a shared-memory tile (:data:`TILE_FORMS`)."""
    return sum(t["form"] in TILE_FORMS for t in fields(spec, names)["dparam_terms"])
