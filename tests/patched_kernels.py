"""Shared by the tests of what instruments rendered kernels (``flashgen bench --timeline`` and
``--ablation``: probe points) and of tools/sass_identity.py: load a tool module by path, and
compile a probed source with the plan's own nvcc command."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from flashgen.build.compile import nvcc_command

REPO = Path(__file__).resolve().parents[1]


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def compile_source(plan, src: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """nvcc of ``src`` as ``plan``'s unit would be built (a cubin in ``tmp_path``)."""
    (tmp_path / "k.cu").write_text(src)
    cmd = nvcc_command(plan, tmp_path / "k.cu", tmp_path / "k.cubin")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)
