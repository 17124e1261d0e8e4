"""The docs' GPU examples: every code block marked ```python gpu in the README and docs/ runs as
written on a CUDA machine (a process of its own, from an empty directory, this checkout's
flashgen on the path); what it prints is kept in the test's output (e.g. the CUDA-graph decode
step's replay time in docs/serving.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from doc_blocks import REPO, blocks


@pytest.mark.gpu
@pytest.mark.parametrize("page, line, code", [pytest.param(*b, id=f"{b[0].name}:{b[1]}")
                                              for b in blocks("gpu")])  # fmt: skip
def test_a_gpu_block_runs_as_written(page, line, code, tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    print(done.stdout)
    assert done.returncode == 0, f"{page.name}:{line}\n{done.stdout}\n{done.stderr}"
