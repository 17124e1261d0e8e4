"""``flashgen show`` and ``flashgen list``, and the IR printer they share.

Everything a spec supplies that reaches the terminal (description, path, names in errors)
goes through :func:`flashgen.frontend.errors.terminal_safe`: a spec cannot send escape
sequences to the terminal.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flashgen.cli.common import _consoles, _load_specs, _options
from flashgen.frontend import ir
from flashgen.frontend.errors import SpecError, terminal_safe
from flashgen.frontend.shipped import shipped_specs_dir

# ----------------------------------------------------------------------------- IR printing
_PREC = {
    "||": 1,
    "&&": 2,
    "==": 3,
    "!=": 3,
    "<": 4,
    "<=": 4,
    ">": 4,
    ">=": 4,
    "+": 5,
    "-": 5,
    "*": 6,
    "/": 6,
    "%": 6,
}


def _prec(e: ir.Expr) -> int:
    if isinstance(e, ir.Cond):
        return 0
    if isinstance(e, ir.Binary):
        return _PREC[e.op]
    return 9


def format_expr(e: ir.Expr | None) -> str:
    """DSL text of an expression tree, with only the parentheses precedence needs."""
    if e is None:
        return "-"
    if isinstance(e, ir.Const):
        if isinstance(e.value, bool):
            return "true" if e.value else "false"
        text = repr(e.value)
        if isinstance(e.value, float) and "." not in text and "e" in text:
            text = text.replace("e", ".0e", 1)  # the DSL's floats need a dot: 1e-05 -> 1.0e-05
        return text
    if isinstance(e, ir.Var):
        return e.name
    if isinstance(e, ir.Causal):
        return "causal"
    if isinstance(e, ir.Index):
        return f"{e.name}[{', '.join(format_expr(i) for i in e.indices)}]"
    if isinstance(e, ir.Call):
        return f"{e.fn}({', '.join(format_expr(a) for a in e.args)})"
    if isinstance(e, ir.Unary):
        arg = format_expr(e.arg)
        return f"{e.op}({arg})" if _prec(e.arg) < 9 else f"{e.op}{arg}"
    if isinstance(e, ir.Binary):
        p = _PREC[e.op]
        lhs, rhs = format_expr(e.lhs), format_expr(e.rhs)
        if _prec(e.lhs) < p:
            lhs = f"({lhs})"
        if _prec(e.rhs) <= p:
            rhs = f"({rhs})"
        return f"{lhs} {e.op} {rhs}"
    if isinstance(e, ir.Cond):
        c, a, b = format_expr(e.cond), format_expr(e.then), format_expr(e.other)
        c = f"({c})" if _prec(e.cond) == 0 else c
        return f"{c} ? {a} : {b}"
    return repr(e)


def format_spec(spec: ir.Spec) -> str:
    """A readable, multi-line rendering of a checked spec."""
    lines = [
        f"spec {spec.name}   ({spec.path})",
        f"  dtype          {spec.dtype}",
        f"  head_dim       {spec.head_dim} (v: {spec.head_dim_v})",
        f"  targets        {', '.join(spec.targets)}",
        f"  mask           {format_expr(spec.mask)}"
        + (f"   : {spec.mask.ty.value}" if spec.mask is not None and spec.mask.ty else ""),
        f"  score_mod      {format_expr(spec.score_mod)}"
        + (
            f"   : {spec.score_mod.ty.value}"
            if spec.score_mod is not None and spec.score_mod.ty
            else ""
        ),
        "  softmax_scale  "
        + ("auto (1/sqrt(head_dim))" if spec.softmax_scale is None else repr(spec.softmax_scale)),
    ]
    if spec.sink is not None:  # after score_mod: it joins each row's denominator
        lines.insert(-1, f"  sink           {format_expr(spec.sink)}   : a logit per (b, h)")
    if spec.params:
        lines.append("  params")
        for p in spec.params:
            if p.kind == "tensor":
                lines.append(f"    {p.name}: tensor [{', '.join(map(str, p.shape))}] {p.ty.value}")
            else:
                bounds = ", ".join(f"{w} {b!r}" for w, b in p.bounds())  # as declared
                lines.append(
                    f"    {p.name}: {p.ty.value} = {p.default!r}"
                    + (f"   ({bounds})" if bounds else "")
                )
    t = spec.tiles
    if any(x is not None for x in (t.block_m, t.block_n, t.num_warps)):
        lines.append(
            f"  tiles          block_m={t.block_m} block_n={t.block_n} num_warps={t.num_warps}"
        )
    if spec.varlen:
        lines.append("  varlen         true (packed sequences: cu_seqlens_q/k, max_seqlen_q/k)")
    if spec.v_from_k:
        lines.append("  v_from_k       true (decode only: v is k_cache's first head_dim_v columns)")
    if spec.description:  # untrusted text: escaped, so it cannot drive the terminal
        lines.append(f"  description    {terminal_safe(spec.description)}")
    lines[0] = terminal_safe(lines[0])  # the path
    return "\n".join(lines)


#: which kernels an option shapes, by dotted name or its family prefix (None: every unit);
#: ``fwd``: either forward family
_OPTION_UNITS = {
    "family": "fwd", "side_terms": "fwd", "exact_softmax": None, "atomic_dq": "bwd",
    "persistent": "hopper_fwd", "persistent_ctas": "hopper_fwd",
    "sparse_persistent": "fwd_sparse", "sparse_tiles": "fwd_sparse",
    "fa2_fwd": "fa2_fwd", "hopper_fwd": "hopper_fwd", "fa2_bwd": "bwd", "hopper_bwd": "bwd",
    "blocktable": "blocktable", "decode": "decode",
}  # fmt: skip
_UNIT_WORDS = {
    "fwd": "the forward", "fa2_fwd": "the FA2-class forward", "hopper_fwd": "the Hopper forward",
    "fwd_sparse": "the forward of calls that keep few keys per row",
    "bwd": "the backward kernels", "blocktable": "the block-table pre-pass",
    "decode": "the decode kernels (op.with_kvcache)",
}  # fmt: skip


def options_note(options, shown: str, plan=None) -> str | None:
    """The non-default options of ``options`` as ``show`` lists them under a plan
    (``hopper_fwd.affine=False; decode.fused_sink=False (not in the unit shown: ...)``), each
    that does not shape unit ``shown`` (a family name: ``fa2_fwd``, ``hopper_fwd``,
    ``decode``) marked; None for the defaults.  ``hopper_fwd.exp2_poly`` in the Hopper forward
    ``plan`` shown says its effective share (``hopper_fwd.exp2_poly=1: 0 of 10 tiles per row on
    the FMA pipe``)."""
    items = []
    for path, value in options.changed().items():
        unit = _OPTION_UNITS.get(path.partition(".")[0])
        text = f"{path}={value}"
        if unit is not None and unit != shown and not (unit == "fwd" and shown != "decode"):
            text += f" (not in the unit shown: an option of {_UNIT_WORDS[unit]})"
        elif path == "hopper_fwd.exp2_poly" and plan is not None:
            count, ns = plan.context.exp2_poly_tiles, plan.tiles.block_n // 8
            text += f": {count} of {ns} tiles per row on the FMA pipe"
        items.append(text)
    return "; ".join(items) or None


def cmd_show(args) -> int:
    from flashgen.build.render import render
    from flashgen.families.decode import mla_unit_note
    from flashgen.families.registry import plan_decode, plan_forward, select

    _, err = _consoles()
    try:
        options = _options(args)
    except (KeyError, ValueError) as e:
        err.print(f"error: {terminal_safe(str(e))}", markup=False)
        return 1
    specs = _load_specs([args.spec], err)
    if specs is None:
        return 1
    spec = specs[0]
    print(format_spec(spec))
    targets = args.target or list(spec.targets)
    for t in targets:
        try:
            plan_of = plan_decode if spec.v_from_k else plan_forward  # v_from_k: decode only
            plan = plan_of(spec, t, options)
        except ValueError as e:
            err.print(f"error: {spec.name} [{t}]: {e}", markup=False)
            return 1
        print(f"\n// ---- plan [{t}]: {json.dumps(plan.config())}")
        shown = "decode" if spec.v_from_k else select(spec, t, "fwd", options).family
        note = options_note(options, shown, plan if shown == "hopper_fwd" else None)
        if note:
            print(f"// ---- options [{t}]: {terminal_safe(note)}")
        mla = mla_unit_note(spec, t, options.decode)
        if mla:  # a v_from_k spec: which MLA unit is shown, and how calls pick theirs
            print(f"// ---- mla unit [{t}]: {terminal_safe(mla)}")
        print(f"// ---- source [{t}]: kernel {plan.kernel_name}, {plan.gencode}")
        sys.stdout.write(render(plan))
    return 0


def _print_list(rows, console) -> None:
    """One block per spec, wrapped by rich to ``console``'s width (the terminal's, or
    ``COLUMNS``): name, dtype and head dims on the first line, then the mask and score_mod
    under their labels (a mask of ``"-"``, none, keeps every pair; ``""``: no line, a spec
    that did not load), then the description, indented.  Text goes in as rich ``Text`` (no
    markup: descriptions are the spec author's)."""
    w0 = max([len(r[0]) for r in rows] + [4])
    w1 = max([len(r[1]) for r in rows] + [5])
    with console.capture() as captured:  # rich pads lines to the width: trailing spaces cut
        _print_blocks(rows, console, w0, w1)
    lines = captured.get().splitlines()
    console.file.write("".join(line.rstrip() + "\n" for line in lines))


def _print_blocks(rows, console, w0: int, w1: int) -> None:
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    for name, dtype, hd, mask, mod, desc in rows:
        console.print(Text(f"{name:<{w0}}  {dtype:<{w1}}  head_dim {hd}"), overflow="fold")
        mask = "none (every pair kept)" if mask == "-" else mask
        exprs = Table.grid(padding=(0, 1, 0, 0))
        exprs.add_column(no_wrap=True)
        exprs.add_column(overflow="fold")
        for label, text in (("mask:", mask), ("score_mod:", mod)):
            if text not in ("", "-"):
                exprs.add_row(label, Text(text))
        if exprs.row_count:
            console.print(Padding(exprs, (0, 0, 0, 4)))
        if desc not in ("", "-"):
            console.print(Padding(Text(desc, overflow="fold"), (0, 0, 0, 4)))
        console.print()


def cmd_list(args) -> int:
    from flashgen.frontend.spec import load_spec

    if args.dir is None:  # ./specs, else the shipped ones wherever flashgen is installed
        root = Path("specs") if Path("specs").is_dir() else shipped_specs_dir()
        if root is None:
            print("error: no specs/ here and no shipped specs found; give DIR", file=sys.stderr)
            return 1
    else:
        root = Path(args.dir)
    if not root.is_dir():
        print(f"error: {terminal_safe(str(root))} is not a directory", file=sys.stderr)
        return 1
    rows = [("name", "dtype", "head_dim", "mask", "score_mod", "description")]
    bad = False
    for f in sorted(root.glob("*.yaml")) + sorted(root.glob("*.yml")):
        try:
            s = load_spec(f)
        except SpecError as e:
            where = f"{e.file}:{e.line}:{e.col}"  # no mask or score_mod lines ("")
            rows.append((terminal_safe(f.stem), "-", "-", "", "",
                         terminal_safe(f"ERROR {where}: {e.message}")))  # fmt: skip
            bad = True
            continue
        except OSError as e:  # a directory named *.yaml, a dangling link, no permission
            rows.append((terminal_safe(f.stem), "-", "-", "", "",
                         f"ERROR cannot read spec: {e.strerror or e}"))  # fmt: skip
            bad = True
            continue
        hd = str(s.head_dim) if s.head_dim == s.head_dim_v else f"{s.head_dim}/{s.head_dim_v}"
        desc = terminal_safe(s.description)  # untrusted text: escaped
        rows.append((s.name, s.dtype, hd, format_expr(s.mask), format_expr(s.score_mod), desc))
    _print_list(rows[1:], _consoles()[0])
    return 1 if bad else 0
