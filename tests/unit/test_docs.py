"""The README and docs/: every code block marked ```python cpu runs as written on a CPU
machine (each in a process of its own with fresh globals, forked from an interpreter that has
only imported torch and flashgen, from an empty directory, so shipped specs by name and files
it writes work as a user's would), and every relative link points at a file."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from doc_blocks import PAGES, REPO, blocks


def _blocks():
    for page, line, code in blocks("cpu"):
        yield pytest.param(page, code, id=f"{page.relative_to(REPO)}:{line}")


def test_the_readme_and_docs_mark_runnable_blocks():
    assert len(list(_blocks())) >= 6


#: Runs each block ``[cwd, code, out]`` of the JSON on stdin as ``python -c code`` would in
#: ``cwd``, in a child forked from this interpreter after it imported torch and flashgen
#: (what the blocks import; a fresh interpreter per block paid that import, most of a
#: block's time, once each): fresh globals named ``__main__``, stdout and stderr to ``out``;
#: prints the exit codes as JSON.
RUNNER = r"""
import json, os, sys, traceback
import torch, flashgen  # noqa: F401  (imported, nothing run: safe to fork)
codes = []
for cwd, code, out in json.load(sys.stdin):
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1); os.dup2(fd, 2)
        os.chdir(cwd)
        status = 0
        try:
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__",
                                                     "__builtins__": __builtins__})
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (e.code is not None)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(status)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(json.dumps(codes))
"""


@pytest.fixture(scope="module")
def block_runs(tmp_path_factory):
    """{block id: (exit code, output)} of every runnable block, each from an empty directory
    of its own, in one :data:`RUNNER` process."""
    pytest.importorskip("torch")
    blocks = [(p.id, p.values[1]) for p in _blocks()]
    jobs = []
    for i, (_, code) in enumerate(blocks):
        cwd = tmp_path_factory.mktemp(f"block{i}")
        jobs.append([str(cwd), code, str(cwd.parent / f"block{i}.out")])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO)  # this checkout's flashgen, as an installed one would be
    done = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(jobs), env=env,
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert done.returncode == 0, f"the block runner failed:\n{done.stdout}\n{done.stderr}"
    codes = json.loads(done.stdout.splitlines()[-1])
    return {bid: (rc, Path(out).read_text()) for (bid, _), rc, (_, _, out) in zip(
        blocks, codes, jobs, strict=True)}  # fmt: skip


@pytest.mark.parametrize("page, code", list(_blocks()))
def test_a_runnable_block_runs_as_written(page, code, request, block_runs):
    rc, output = block_runs[request.node.callspec.id]
    assert rc == 0, f"{page.name}:\n{code}\n{output}"


def test_gpu_blocks_parse_and_the_gpu_suite_runs_them():
    """```python gpu blocks (tests/gpu/test_docs_gpu.py runs them on a device) are Python."""
    gpu = blocks("gpu")
    assert gpu, "docs/serving.md's CUDA-graph decode step is a ```python gpu block"
    for page, line, code in gpu:
        compile(code, f"{page.name}:{line}", "exec")


def test_the_readme_stays_a_front_door():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 220
    for phrase in ("since fixed", "awaiting", "Awaiting", "validated on", "session "):
        assert phrase not in text, phrase


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_point_at_files(page):
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
        path = (page.parent / target).resolve()
        assert path.exists(), f"{page.name} links to missing {target}"
