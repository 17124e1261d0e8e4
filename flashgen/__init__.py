"""flashgen: compile short YAML attention specs into CUDA kernels and PyTorch ops.

    import flashgen
    op = flashgen.load("causal_d128")    # a shipped spec's name, or a spec file's path
    o, lse = op.attention(q, k, v)       # q [B, Hq, Sq, D]: bf16 on a CUDA device; also the CPU

Importing this package needs neither torch nor cupy; :func:`load` imports torch.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from flashgen.frontend.errors import OpInputError, SpecError
from flashgen.frontend.spec import load_spec, loads_spec
from flashgen.version import __version__

if TYPE_CHECKING:  # pragma: no cover
    from flashgen.ops.op import AttentionOp
    from flashgen.options import Options

__all__ = [
    "__version__",
    "load",
    "load_spec",
    "loads_spec",
    "SpecError",
    "OpInputError",
    "AttentionOp",
    "Options",
    "merge_attention",
    "apply_sink",
]

_loaded: dict[tuple, AttentionOp] = {}
#: spec name -> the resolved path flashgen.load registered it from
_origin: dict[str, str] = {}
_lock = threading.Lock()


def load(path: str | Path, options: Options | None = None) -> AttentionOp:
    """Load, check and register the spec at ``path`` (a file, or a shipped spec's name such as
    ``"gpt2_d64"``: a file that exists wins); return its :class:`AttentionOp` bound
    to ``options`` (:class:`flashgen.Options`, default ``Options()``: which kernels it runs).

    Cached by (resolved path, sha256 of the file's bytes, options): loading the same file with
    the same options again is free.  An edited file is reloaded: its op replaces the registration
    of ``torch.ops.flashgen.<name>`` (forward, backward and varlen form; and the operators of the
    spec under other options), and the op objects earlier loads returned raise ``RuntimeError``
    when called (use the new one).  Only a regular file of at most ``MAX_SPEC_BYTES`` is
    read.  Raises :class:`flashgen.env.RemovedVariableError` if a removed environment switch
    (:data:`flashgen.env.REMOVED`) is set, naming its option, :class:`SpecError` (with
    file:line:col) for a bad spec, ``OSError`` for an unreadable file, ``ValueError`` if a spec
    with the same name from another file is already registered in this process,
    ``TypeError`` if ``options`` is not an :class:`flashgen.Options` or ``path`` not a ``str``
    or ``os.PathLike``,
    ``ModuleNotFoundError`` saying so without torch.
    """
    from flashgen import env
    from flashgen.frontend.shipped import resolve_spec_path
    from flashgen.frontend.spec import loads_spec_bytes, read_spec_bytes
    from flashgen.options import DEFAULT, check_options

    env.check_removed()
    options = DEFAULT if options is None else check_options(options)
    p = resolve_spec_path(path).resolve()
    data = read_spec_bytes(p)
    key = (str(p), hashlib.sha256(data).hexdigest(), options)
    op = _loaded.get(key)
    if op is not None:
        return op
    try:
        from flashgen.ops.op import build_op
    except ModuleNotFoundError as e:  # pip install -e . does not pull torch in
        if e.name != "torch":
            raise
        raise ModuleNotFoundError(
            "flashgen.load needs PyTorch (the op is a torch.library operator): "
            "pip install torch (flashgen build, show and list do not)",
            name="torch",
        ) from None

    with _lock:
        op = _loaded.get(key)
        if op is None:
            spec = loads_spec_bytes(data, str(path))  # the bytes hashed: no second read
            op = build_op(spec, options, replace=_origin.get(spec.name) == str(p))
            for k in [k for k, v in _loaded.items() if v._replaced_by is not None]:
                del _loaded[k]  # the replaced ops
            _loaded[key] = op
            _origin[spec.name] = str(p)
    return op


def __getattr__(name: str):
    if name == "Options":
        from flashgen.options import Options

        return Options
    if name == "AttentionOp":
        from flashgen.ops.op import AttentionOp

        return AttentionOp
    if name == "merge_attention":
        from flashgen.ops.decode.op import merge_attention

        return merge_attention
    if name == "apply_sink":
        from flashgen.ops.sink import apply_sink

        return apply_sink
    if name == "fp8":  # flashgen.fp8.quantize after a bare `import flashgen`
        import flashgen.fp8 as fp8

        return fp8
    raise AttributeError(f"module 'flashgen' has no attribute {name!r}")
