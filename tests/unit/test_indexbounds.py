"""flashgen.analysis.indexbounds: tensor-param subscripts that may leave their tensor at a call's
sizes (the kernels clamp them), and the op's once-per-sizes warning."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashgen.analysis.indexbounds import possible_violations
from flashgen.frontend.spec import load_spec, loads_spec

REPO = Path(__file__).resolve().parents[2]


def sym(b=2, hq=8, hkv=2, sq=100, sk=100):
    return {"batch": b, "num_heads": hq, "num_heads_kv": hkv, "seqlen_q": sq, "seqlen_k": sk}


def spec(body: str):
    return loads_spec("name: ib\nhead_dim: 64\ndtype: bf16\n" + body, "ib.yaml")


PER_KV_HEAD = spec("score_mod: score + w[h]\nparams:\n  w: {type: f32, shape: [num_heads_kv]}\n")


def test_a_per_kv_head_tensor_read_by_query_head_under_gqa():
    (line,) = possible_violations(PER_KV_HEAD, sym(hq=8, hkv=2), {})
    assert line.startswith("ib.yaml:4:")
    assert "w[...] subscript 0 ranges over [0, 7]" in line and "extent 2" in line
    assert possible_violations(PER_KV_HEAD, sym(hq=2, hkv=2), {}) == []


def test_a_table_sized_by_the_other_sequence():
    s = spec("mask: 't[q_idx] > 0.0'\nparams:\n  t: {type: f32, shape: [seqlen_k]}\n")
    assert possible_violations(s, sym(sq=100, sk=100), {}) == []
    (line,) = possible_violations(s, sym(sq=101, sk=100), {})
    assert "ranges over [0, 100]" in line and "extent 100" in line


def test_scalar_params_take_their_values():
    s = spec(
        "score_mod: score + t[h, q_idx - kv_idx + shift]\n"
        "params:\n  t: {type: f32, shape: [num_heads, 64]}\n  shift: {type: i32, default: 31}\n"
    )
    assert possible_violations(s, sym(hq=8, sq=32, sk=32), {"shift": 31}) == []
    assert len(possible_violations(s, sym(hq=8, sq=34, sk=32), {"shift": 31})) == 1
    assert len(possible_violations(s, sym(hq=8, sq=32, sk=32), {"shift": 40})) == 1


def test_data_dependent_subscripts_are_not_reported():
    s = spec(
        "score_mod: score + t[ids[b]]\n"
        "params:\n  t: {type: f32, shape: [4]}\n  ids: {type: i32, shape: [batch]}\n"
    )
    assert possible_violations(s, sym(), {}) == []


@pytest.mark.parametrize("path", sorted((REPO / "specs").glob("*.yaml")), ids=lambda p: p.stem)
@pytest.mark.parametrize("sq, sk, hq, hkv", [(1, 1, 1, 1), (17, 1000, 8, 2), (4097, 127, 4, 4)])
def test_shipped_specs_stay_inside_their_tensors(path, sq, sk, hq, hkv):
    s = load_spec(path)
    assert possible_violations(s, sym(hq=hq, hkv=hkv, sq=sq, sk=sk), {}) == []


def test_the_op_warns_once_per_sizes():
    torch = pytest.importorskip("torch")
    from flashgen.analysis.indexbounds import IndexBoundsWarning
    from flashgen.ops.op import Dims, build_op

    op = build_op(PER_KV_HEAD)
    dims = Dims(batch=1, heads_q=8, heads_kv=2, seqlen_q=5, seqlen_k=5, head_dim_v=64)
    with pytest.warns(IndexBoundsWarning, match=r"w\[\.\.\.\] subscript 0"):
        op._check_index_bounds(dims, [])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        op._check_index_bounds(dims, [])  # the same sizes: no second warning
        op._check_index_bounds(Dims(1, 2, 2, 5, 5, 64), [])  # in bounds
    assert torch is not None
