"""tools/sparse_walk_ab.py without a GPU: its modes name the real switches and plan the
kernels the tool expects (sparse 128 x 128 tiles; non-persistent, persistent dynamic with the
warp-wide walk, with the serial walk), its default cases are sparse calls, and it says it
needs a GPU where there is none."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from flashgen.envflags import scoped_env  # noqa: E402
from flashgen.MISSING import (  # noqa: E402
    PERSISTENT_WARP_WALK_ENV,
    SPARSE_PERSISTENT_ENV,
    SPARSE_TILES_ENV,
    sparse_persistent,
)
from plan_helpers import plan_forward  # noqa: E402

from flashgen.bench.runner import parse_spec_item  # noqa: E402
from flashgen.families.tiles import SPARSE_KEYS_PER_ROW, sparse_tiles  # noqa: E402
from flashgen.frontend.spec import load_spec  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location(
        "fg_walk_ab", REPO / "tools" / "sparse_walk_ab.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_modes_plan_the_expected_kernels(monkeypatch):
    tool = _tool()
    names = {n for env in tool.MODES.values() for n in env} | set(tool.BASE_ENV)
    assert names == {
        SPARSE_PERSISTENT_ENV,
        PERSISTENT_WARP_WALK_ENV,
        SPARSE_TILES_ENV,
        "FLASHGEN_PERSISTENT",
        "FLASHGEN_KERNEL_FAMILY",
    }
    for n in names:
        monkeypatch.delenv(n, raising=False)
    for item in tool.DEFAULT_CASES:
        name, params = parse_spec_item(item)
        spec = load_spec(REPO / "specs" / f"{name}.yaml")
        tiles = sparse_tiles(spec, plan_forward(spec, "sm_90").tiles)
        assert (tiles.block_m, tiles.block_n) == (128, 128), item
        for mode, env in tool.MODES.items():
            with scoped_env({**tool.BASE_ENV, **env}):
                sched = sparse_persistent()
                plan = plan_forward(spec, "sm_90", tiles=tiles, persistent=sched)
            got = (plan.context["scheduler"], plan.context["warp_walk"])
            assert got == tool.EXPECT[mode], (item, mode, got)
        assert all(n not in os.environ for n in names)  # restored


def test_default_cases_are_sparse_calls():
    from flashgen.ops.density import keys_per_row

    tool = _tool()
    for item in tool.DEFAULT_CASES:
        name, params = parse_spec_item(item)
        spec = load_spec(REPO / "specs" / f"{name}.yaml")
        scalars = tuple(params.get(p.name, p.default) for p in spec.scalar_params)
        assert keys_per_row(spec, 16384, 16384, scalars) < SPARSE_KEYS_PER_ROW / 2, item


def test_parse_spec_item_and_no_gpu(monkeypatch):
    tool = _tool()
    assert parse_spec_item("chunked_local:chunk=1024") == ("chunked_local", {"chunk": 1024})
    assert parse_spec_item("alibi") == ("alibi", {})
    assert parse_spec_item("gemma2_softcap:softcap=30.5,x=2") == (
        "gemma2_softcap",
        {"softcap": 30.5, "x": 2},
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tool.main([]) == 2
