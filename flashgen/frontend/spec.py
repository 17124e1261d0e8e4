"""Load a spec file (YAML) into a checked :class:`~flashgen.frontend.ir.Spec`.

This module handles the YAML layer: which fields exist, their YAML types, and
where each value sits in the file (``yaml.compose`` keeps marks for every node).
Expressions are parsed with :func:`flashgen.frontend.parse.parse_expr`; value ranges and
expression types are checked by :func:`flashgen.frontend.check.check_spec`, which gets the
field locations recorded here so its errors point into the file too.
"""

from __future__ import annotations

import os
import re
import stat

import numpy as np
import yaml

from flashgen.frontend import check, ir
from flashgen.frontend.errors import SpecError, clip, did_you_mean
from flashgen.frontend.parse import parse_expr

#: Top-level fields of a spec, in documentation order.
FIELDS = (
    "name",
    "description",
    "head_dim",
    "head_dim_v",
    "dtype",
    "targets",
    "mask",
    "score_mod",
    "sink",
    "params",
    "softmax_scale",
    "tiles",
    "varlen",
    "v_from_k",
)
REQUIRED = ("name", "head_dim", "dtype")
PARAM_FIELDS = ("type", "default", "shape", "min", "max", "above", "below")
TILE_FIELDS = ("block_m", "block_n", "num_warps")
#: ``targets`` when the spec gives none (fp8 specs: :data:`flashgen.frontend.ir.FP8_TARGETS`).
DEFAULT_TARGETS = ("sm_80", "sm_90")
#: Largest spec accepted, in bytes (a spec is a dozen lines; this bounds reading, YAML
#: parsing and every later pass).  Only regular files are read.
MAX_SPEC_BYTES = 64 * 1024
#: Longest ``description`` accepted, in characters.
MAX_DESCRIPTION = 4000

_YAML_TAG = "tag:yaml.org,2002:"
#: A float with an exponent and no dot (``1e-3``, ``-2E+5``): a string to PyYAML.
_EXP_FLOAT = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+")
_KIND = {"int": "an integer", "float": "a number", "bool": "a boolean", "null": "null"}


class _Loader:
    """Turns YAML nodes into values, raising SpecErrors at the node's mark."""

    def __init__(self, text: str, path: str):
        self.text = text
        self.path = path
        self.locations: dict[str, ir.Span] = {}

    # -- locations and errors
    def span(self, node: yaml.Node) -> ir.Span:
        m = node.start_mark
        return ir.Span(self.path, m.line + 1, m.column + 1)

    def error(self, node: yaml.Node, message: str) -> SpecError:
        return SpecError.at(self.span(node), message, self.text)

    def record(self, key: str, node: yaml.Node) -> None:
        self.locations[key] = self.span(node)

    # -- node kinds
    @staticmethod
    def describe(node: yaml.Node) -> str:
        if isinstance(node, yaml.SequenceNode):
            return "a list"
        if isinstance(node, yaml.MappingNode):
            return "a mapping"
        tag = node.tag.removeprefix(_YAML_TAG)
        if tag == "str":
            return f"the string '{clip(node.value)}'"
        return _KIND.get(tag, f"a value tagged {clip(node.tag)}") + (
            f" ({clip(node.value)})" if tag in ("int", "float", "bool") else ""
        )

    def value(self, node: yaml.ScalarNode):
        if not node.tag.startswith(_YAML_TAG):
            raise self.error(
                node,
                f"unexpected YAML tag '{clip(node.tag)}' (quote the value if it is an expression)",
            )
        tag = node.tag.removeprefix(_YAML_TAG)
        try:
            return yaml.SafeLoader("").construct_object(node, deep=True)
        except yaml.YAMLError as exc:
            raise self.error(node, f"invalid value: {getattr(exc, 'problem', exc)}") from None
        except Exception as exc:  # noqa: BLE001  PyYAML's constructors raise anything:
            # ValueError (an int over 4300 digits, `2001-13-45`, `!!int abc`, `!!float x`),
            # KeyError (`!!bool maybe`), TypeError/AttributeError (`!!timestamp x`)
            detail = f" ({clip(str(exc))})" if isinstance(exc, ValueError) else ""
            raise self.error(
                node,
                f"invalid {_KIND.get(tag, tag)} value '{clip(node.value)}'{detail} "
                "(quote it if it is meant as text or an expression)",
            ) from None

    def is_null(self, node: yaml.Node | None) -> bool:
        return node is None or (
            isinstance(node, yaml.ScalarNode) and node.tag == _YAML_TAG + "null"
        )

    def scalar(self, node: yaml.Node, field: str, tags: tuple[str, ...], what: str):
        """The Python value of a scalar node whose tag is one of ``tags``."""
        if isinstance(node, yaml.ScalarNode) and node.tag.removeprefix(_YAML_TAG) in tags:
            return self.value(node)
        if (
            "float" in tags
            and isinstance(node, yaml.ScalarNode)
            and node.style is None  # unquoted
            and node.tag == _YAML_TAG + "str"
            and _EXP_FLOAT.fullmatch(node.value)
        ):  # 1e-3: YAML 1.1 (PyYAML) wants a dot in a float, YAML 1.2 and the DSL do not
            return float(node.value)
        raise self.error(node, f"{field} must be {what}, got {self.describe(node)}")

    def integer(self, node: yaml.Node, field: str) -> int:
        return self.scalar(node, field, ("int",), "an integer")

    def number(self, node: yaml.Node, field: str) -> int | float:
        return self.scalar(node, field, ("int", "float"), "a number")

    def string(self, node: yaml.Node, field: str) -> str:
        return self.scalar(node, field, ("str",), "a string")

    def mapping(
        self, node: yaml.Node, field: str, allowed: tuple[str, ...] | None
    ) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        """``{key: (key_node, value_node)}``; rejects duplicate and unknown keys.

        ``allowed=None`` accepts any key (used for ``params``).
        """
        if not isinstance(node, yaml.MappingNode):
            raise self.error(node, f"{field} must be a mapping, got {self.describe(node)}")
        self.plain_tag(node, _YAML_TAG + "map")
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for k, v in node.value:
            if not (isinstance(k, yaml.ScalarNode) and k.tag == _YAML_TAG + "str"):
                hint = ""
                if isinstance(k, yaml.ScalarNode) and re.fullmatch(r"[A-Za-z_]\w*", k.value):
                    hint = f": YAML reads a bare {k.value} that way; quote it ('{k.value}')"
                raise self.error(k, f"keys of {field} must be names, got {self.describe(k)}{hint}")
            key = k.value
            if key in out:
                raise self.error(k, f"duplicate key '{clip(key)}' in {field}")
            if allowed is not None and key not in allowed:
                where = "field" if field == "the spec" else f"key in {field}"
                raise self.error(
                    k,
                    f"unknown {where} '{clip(key)}'{did_you_mean(key, allowed)}"
                    f"; expected one of: {', '.join(allowed)}",
                )
            out[key] = (k, v)
        return out

    def sequence(self, node: yaml.Node, field: str) -> list[yaml.Node]:
        if not isinstance(node, yaml.SequenceNode):
            raise self.error(node, f"{field} must be a list, got {self.describe(node)}")
        self.plain_tag(node, _YAML_TAG + "seq")
        return list(node.value)

    def plain_tag(self, node: yaml.Node, tag: str) -> None:
        """Reject an explicit tag (``!!python/...``, ``!custom``) on a mapping or list."""
        if node.tag != tag:
            raise self.error(node, f"unexpected YAML tag '{clip(node.tag)}' on a collection")

    # -- expressions
    def expr(self, node: yaml.Node, field: str) -> ir.Expr | None:
        """Parse a scalar node as a DSL expression; null gives None."""
        if self.is_null(node):
            return None
        if not isinstance(node, yaml.ScalarNode):
            raise self.error(
                node, f"{field} must be an expression (a string), got {self.describe(node)}"
            )
        self.value(node)  # rejects custom tags
        text, line, col = self.expr_source(node)
        return parse_expr(text, file=self.path, line=line, col=col, source=self.text)

    def expr_source(self, node: yaml.ScalarNode) -> tuple[str, int, int]:
        """Expression text and its (line, col) in the file.

        The raw source slice is parsed when it holds the same tokens as the scalar's
        value (so carets point at what the user wrote, even across lines); otherwise
        (escapes, folding quirks) the value is parsed at the scalar's start.
        """
        start, end = node.start_mark, node.end_mark
        line, col = start.line + 1, start.column + 1
        raw = self.text[start.index : end.index]
        if node.style in ("'", '"'):
            raw, col = raw[1:-1], col + 1
        elif node.style in ("|", ">"):
            nl = raw.find("\n")
            raw, line, col = (raw[nl + 1 :], line + 1, 1) if nl >= 0 else ("", line, col)
        if raw.split() == node.value.split():
            return raw, line, col
        return node.value, line, col


def _as_float(ld: _Loader, node: yaml.Node, value: int | float, field: str) -> float:
    """``float(value)``, as a SpecError at ``node`` when an integer is too large for that."""
    try:
        return float(value)
    except OverflowError:
        raise ld.error(node, f"{field} is too large ({str(value)[:12]}...)") from None


def _exclusive(ld: _Loader, node, value, ty: ir.Ty, lower: bool, field: str):
    """The inclusive bound equal to the exclusive bound ``value`` (``above:`` when ``lower``,
    else ``below:``) for a param of type ``ty``: the next int32, or the next float32 (the
    kernels' type) past ``value``.  Stored as ``minimum`` / ``maximum``, so the op, the
    reference and the interval analysis need no second kind of bound."""
    if ty == ir.Ty.I32:
        if not isinstance(value, int):
            raise ld.error(node, f"{field} must be an integer (the param is i32), got {value}")
        return value + 1 if lower else value - 1
    if not abs(value) <= check.F32_MAX:
        raise ld.error(node, f"{field} must be a finite float32, got {value}")
    f32 = float(np.float32(value))  # the nearest float32
    if f32 > value if lower else f32 < value:
        return f32
    nxt = float(np.nextafter(np.float32(f32), np.float32(np.inf if lower else -np.inf)))
    if abs(nxt) > check.F32_MAX:
        raise ld.error(node, f"{field} leaves no finite float32 value on its side")
    return nxt


def _param(ld: _Loader, key_node: yaml.Node, node: yaml.Node) -> ir.Param:
    name = key_node.value
    where = f"params.{name}"
    ld.record(where, key_node)
    fields = ld.mapping(node, f"param '{name}'", PARAM_FIELDS)
    if "type" not in fields:
        raise ld.error(node, f"param '{name}' needs a type (i32 or f32)")
    tnode = fields["type"][1]
    tname = ld.string(tnode, f"the type of param '{name}'")
    if tname not in ("i32", "f32"):
        raise ld.error(
            tnode,
            f"unknown param type '{tname}'{did_you_mean(tname, ('i32', 'f32'))}; "
            "expected i32 or f32",
        )
    ty = ir.Ty(tname)
    has_default, has_shape = "default" in fields, "shape" in fields
    if has_default and has_shape:
        raise ld.error(
            fields["shape"][0],
            f"param '{name}' has both a default and a shape; a tensor param has no default",
        )
    if has_shape:
        for key in ("min", "max", "above", "below"):
            if key in fields:
                raise ld.error(
                    fields[key][0], f"param '{name}' is a tensor; only scalar params take a {key}"
                )
        shape_node = fields["shape"][1]
        ld.record(where + ".shape", shape_node)
        dims: list[int | str] = []
        for i, d in enumerate(ld.sequence(shape_node, f"the shape of param '{name}'")):
            ld.record(f"{where}.shape.{i}", d)
            dims.append(
                ld.scalar(
                    d,
                    f"a shape entry of param '{name}'",
                    ("int", "str"),
                    "a positive integer or one of " + ", ".join(ir.SHAPE_SYMBOLS),
                )
            )
        return ir.Param(name, "tensor", ty, None, tuple(dims), ld.span(key_node))
    if has_default:
        dnode = fields["default"][1]
        ld.record(where + ".default", dnode)
        default = ld.number(dnode, f"the default of param '{name}'")
        if ty == ir.Ty.F32:
            default = _as_float(ld, dnode, default, f"the default of param '{name}'")
        bounds = {}
        for key in ("min", "max", "above", "below"):
            if key in fields:
                bnode = fields[key][1]
                ld.record(f"{where}.{key}", bnode)
                val = ld.number(bnode, f"the {key} of param '{name}'")
                if ty == ir.Ty.F32:
                    val = _as_float(ld, bnode, val, f"the {key} of param '{name}'")
                lower = key in ("min", "above")
                other = ("min", "above") if lower else ("max", "below")
                if all(o in fields for o in other):
                    raise ld.error(
                        fields[other[1]][0],
                        f"param '{name}' has both {other[0]} and {other[1]}; give one",
                    )
                if key in ("above", "below"):
                    ld.record(f"{where}.{'min' if lower else 'max'}", bnode)
                    bounds[key] = val  # as declared, for messages and display
                    val = _exclusive(ld, bnode, val, ty, lower, f"the {key} of param '{name}'")
                bounds["minimum" if lower else "maximum"] = val
        return ir.Param(name, "scalar", ty, default, (), ld.span(key_node), **bounds)
    raise ld.error(
        node,
        f"param '{name}' needs a default (a scalar, e.g. {{type: {tname}, default: 1}}) "
        f"or a shape (a tensor, e.g. {{type: {tname}, shape: [num_heads]}})",
    )


def _build(ld: _Loader, root: yaml.Node) -> ir.Spec:
    f = ld.mapping(root, "the spec", FIELDS)
    for req in REQUIRED:
        if req not in f:
            raise SpecError.at(ld.span(root), f"missing required field '{req}'", ld.text)
    for key, (_, vnode) in f.items():
        ld.record(key, vnode)

    def get(key):
        node = f.get(key, (None, None))[1]
        return None if ld.is_null(node) else node

    name = ld.string(f["name"][1], "name")
    head_dim = ld.integer(f["head_dim"][1], "head_dim")
    head_dim_v = head_dim
    if get("head_dim_v") is not None:
        head_dim_v = ld.integer(get("head_dim_v"), "head_dim_v")
    dtype = ld.string(f["dtype"][1], "dtype")

    targets: tuple[str, ...] = ir.FP8_TARGETS if dtype in ir.FP8_DTYPES else DEFAULT_TARGETS
    if get("targets") is not None:
        items = ld.sequence(get("targets"), "targets")
        for i, t in enumerate(items):
            ld.record(f"targets.{i}", t)
        targets = tuple(ld.string(t, "each target") for t in items)

    params: list[ir.Param] = []
    if get("params") is not None:
        for k, v in ld.mapping(get("params"), "params", None).values():
            params.append(_param(ld, k, v))

    scale = None
    if get("softmax_scale") is not None:
        snode = get("softmax_scale")
        if not (isinstance(snode, yaml.ScalarNode) and snode.value == "auto"):
            scale = _as_float(
                ld,
                snode,
                ld.scalar(snode, "softmax_scale", ("int", "float"), "'auto' or a number"),
                "softmax_scale",
            )

    tiles = ir.TileOverride()
    if get("tiles") is not None:
        vals = {}
        for key, (_, v) in ld.mapping(get("tiles"), "tiles", TILE_FIELDS).items():
            ld.record(f"tiles.{key}", v)
            vals[key] = None if ld.is_null(v) else ld.integer(v, f"tiles.{key}")
        tiles = ir.TileOverride(**vals)

    varlen = False
    if get("varlen") is not None:
        varlen = ld.scalar(get("varlen"), "varlen", ("bool",), "true or false")

    v_from_k = False
    if get("v_from_k") is not None:
        v_from_k = ld.scalar(get("v_from_k"), "v_from_k", ("bool",), "true or false")

    description = ""
    if get("description") is not None:
        description = ld.string(get("description"), "description")
        if len(description) > MAX_DESCRIPTION:
            raise ld.error(
                get("description"),
                f"description is {len(description)} characters long; the limit "
                f"(MAX_DESCRIPTION) is {MAX_DESCRIPTION}",
            )

    return ir.Spec(
        name=name,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        dtype=dtype,
        targets=targets,
        mask=ld.expr(get("mask"), "mask"),
        score_mod=ld.expr(get("score_mod"), "score_mod"),
        sink=ld.expr(get("sink"), "sink"),
        params=tuple(params),
        softmax_scale=scale,
        tiles=tiles,
        description=description,
        varlen=varlen,
        v_from_k=v_from_k,
        path=ld.path,
        source=ld.text,
    )


def _yaml_error(exc: yaml.YAMLError, text: str, path: str) -> SpecError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or getattr(exc, "reason", None) or str(exc)
    if mark is not None:
        span = ir.Span(path, mark.line + 1, mark.column + 1)
    elif isinstance(getattr(exc, "position", None), int):  # ReaderError: bad character
        before = text[: exc.position]
        span = ir.Span(path, before.count("\n") + 1, exc.position - before.rfind("\n"))
    else:
        span = ir.Span(path, 1, 1)
    message = f"invalid YAML: {problem}"
    if problem == "mapping values are not allowed here":
        message += " (quote an expression that contains ': ', e.g. score_mod: \"c ? a : b\")"
    return SpecError.at(span, message, text)


def loads_spec(text: str, path: str = "<string>") -> ir.Spec:
    """Parse and check a spec from its YAML ``text``; ``path`` names it in errors.

    Returns a checked :class:`~flashgen.frontend.ir.Spec` (typed expressions, ``source=text``,
    ``path=path``).  Raises :class:`~flashgen.frontend.errors.SpecError` (file:line:col and the
    offending line) for YAML syntax errors, unknown/missing/mistyped fields, DSL
    syntax errors, a text over :data:`MAX_SPEC_BYTES`, and everything
    :func:`flashgen.frontend.check.check_spec` rejects.
    """
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise SpecError(_too_large(size), file=path, line=1, col=1)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, text, path) from None
    except RecursionError:
        raise SpecError.at(ir.Span(path, 1, 1), "YAML is nested too deeply", text) from None
    if root is None:
        raise SpecError.at(
            ir.Span(path, 1, 1),
            "empty spec: expected a mapping with at least name, head_dim and dtype",
            text,
        )
    ld = _Loader(text, path)
    spec = _build(ld, root)
    return check.check_spec(spec, locations=ld.locations)


def _too_large(size: int | str) -> str:
    return (
        f"spec is {size} bytes; the limit (MAX_SPEC_BYTES) is {MAX_SPEC_BYTES} bytes "
        "(a spec is a few lines of YAML)"
    )


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def read_spec_bytes(path: str | os.PathLike) -> bytes:
    """The bytes of the spec file at ``path``: a regular file (a link to one is fine) of at
    most :data:`MAX_SPEC_BYTES` bytes.

    The file is opened without blocking (a FIFO cannot hang the call) and checked with
    ``fstat`` on the open descriptor, so what is read is what was checked.  Raises
    :class:`~flashgen.frontend.errors.SpecError` at ``path:1:1`` for a directory, FIFO,
    device or socket (``/dev/zero``, or a ``*.yaml`` link to it) and for a larger file;
    ``OSError`` when it cannot be opened.
    """
    p = os.fspath(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    fd = os.open(p, flags | getattr(os, "O_BINARY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((k for test, k in _KINDS if test(st.st_mode)), "not a regular file")
            raise SpecError(
                f"a spec must be a regular file; {p} is {kind}", file=p, line=1, col=1
            )
        if st.st_size > MAX_SPEC_BYTES:
            raise SpecError(_too_large(st.st_size), file=p, line=1, col=1)
        chunks, size = [], 0
        while size <= MAX_SPEC_BYTES:  # the size may change while reading: read at most limit+1
            chunk = os.read(fd, MAX_SPEC_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_SPEC_BYTES:
            raise SpecError(_too_large(f"more than {MAX_SPEC_BYTES}"), file=p, line=1, col=1)
        return b"".join(chunks)
    finally:
        os.close(fd)


def load_spec(path: str | os.PathLike) -> ir.Spec:
    """Read the spec file at ``path`` (UTF-8) and return it checked, as :func:`loads_spec`.
    ``path`` may also name a shipped spec (``"gpt2_d64"``; a file that exists wins:
    :func:`~flashgen.frontend.shipped.resolve_spec_path`).

    Only a regular file of at most :data:`MAX_SPEC_BYTES` bytes is read
    (:func:`read_spec_bytes`).  Raises :class:`~flashgen.frontend.errors.SpecError` for any
    problem in the file and ``OSError`` when it cannot be read.
    """
    from flashgen.frontend.shipped import resolve_spec_path

    p = os.fspath(resolve_spec_path(path))
    return loads_spec_bytes(read_spec_bytes(p), p)


def loads_spec_bytes(data: bytes, path: str) -> ir.Spec:
    """:func:`loads_spec` of ``data`` decoded as UTF-8 (a decoding error is a
    :class:`~flashgen.frontend.errors.SpecError` at its line and column)."""
    p = path
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = data[: exc.start]
        line = before.count(b"\n") + 1
        col = exc.start - before.rfind(b"\n")
        raise SpecError("file is not valid UTF-8", file=p, line=line, col=col) from None
    return loads_spec(text, p)
