"""The kernel options the GPU tests' ops run under (what the ``FLASHGEN_*`` switches were).

A fixture calls :func:`use` (``monkeypatch`` restores the defaults after the test); the
shared check helpers build their ops with :func:`build` / :func:`load`, so an op is bound to
the options of the test that runs it (``flashgen.load(spec, options=...)``: its own operator
and kernels, see :func:`flashgen.ops.op.registered_name`)."""

from __future__ import annotations

import sys

from flashgen.options import DEFAULT, Options

#: The options of the running test (:func:`use` sets it).
CURRENT: Options = DEFAULT


def options(values: dict | None = None, **fields) -> Options:
    """``Options()`` with ``fields`` (top-level names) and ``values`` (dotted names) set."""
    return DEFAULT.with_values({**fields, **(values or {})})


def use(monkeypatch, values: dict | None = None, **fields) -> Options:
    """Make :func:`options` of these the running test's options; returns them."""
    opts = options(values, **fields)
    monkeypatch.setattr(sys.modules[__name__], "CURRENT", opts)
    return opts


def update(monkeypatch, values: dict | None = None, **fields) -> Options:
    """The running test's options with these set too (fixtures that each set a part)."""
    opts = CURRENT.with_values({**fields, **(values or {})})
    monkeypatch.setattr(sys.modules[__name__], "CURRENT", opts)
    return opts


def head_groups(on: bool) -> dict:
    """The dotted names of the L2 head groups of every kernel (``FLASHGEN_HEAD_GROUPS``)."""
    return {"hopper_fwd.head_groups": on, "fa2_fwd.head_groups": on, "hopper_bwd.head_groups": on}


def persistent(value: str) -> str:
    """``Options.persistent`` for an old ``FLASHGEN_PERSISTENT`` value (``1``: static, ``0``:
    off, a scheduler's name: itself)."""
    return {"1": "static", "0": "off"}.get(value, value)


def build(spec, opts: Options | None = None):
    """``build_op(spec, opts or CURRENT)``."""
    from flashgen.ops.op import build_op

    return build_op(spec, CURRENT if opts is None else opts)


def load(path, opts: Options | None = None):
    """``flashgen.load(path, options=opts or CURRENT)``."""
    import flashgen

    return flashgen.load(path, options=CURRENT if opts is None else opts)
