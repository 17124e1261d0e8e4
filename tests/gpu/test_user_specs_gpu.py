"""GPU checks of user-written specs that broke on the CPU machine (trial 5): a head_dim 256
score_mod + conditional mask whose atomic-dQ backward now takes dsplit 4 (64 dK/dV columns
per CTA, a tile config no shipped spec runs), and masks with float math, whose reference
now decides in float32 as the kernels do.  ``python3 -m pytest tests/gpu/test_user_specs_gpu.py -q``
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_options  # noqa: E402
from test_backward_kernels import check_grads  # noqa: E402
from test_forward import check  # noqa: E402

from flashgen.frontend.spec import loads_spec  # noqa: E402

pytestmark = pytest.mark.gpu

D256_COND = """\
name: d256_cond
head_dim: 256
dtype: fp16
mask: "q_idx >= kv_idx ? true : kv_idx - q_idx < 4"
score_mod: max(score, -10.0) * 0.5
"""

FLOAT_MASK = """\
name: float_mask
head_dim: 64
dtype: bf16
mask: 'kv_idx * 0.1 == 0.3 || kv_idx <= q_idx / 0.3 - 31.0 || kv_idx * f == 0.7'
params: {f: {type: f32, default: 0.1}}
"""


@pytest.mark.parametrize("sq, sk", [(17, 33), (130, 127), (257, 300)])
def test_d256_atomic_backward_with_dsplit_4(sq, sk, monkeypatch):
    gpu_options.use(monkeypatch, atomic_dq=True)  # the FA2-class atomic-dQ kernels
    spec = loads_spec(D256_COND, "d256_cond.yaml")
    check_grads(spec, 2, 4, 2, sq, sk, seed=sq, deterministic=False)
    check_grads(spec, 1, 2, 1, sq, sk, seed=sk, deterministic=True)


@pytest.mark.parametrize("sq, sk", [(13, 11), (200, 333), (1000, 70)])
def test_float_mask_math_matches_the_float32_reference(sq, sk, error_bound):
    spec = loads_spec(FLOAT_MASK, "float_mask.yaml")
    check(spec, 1, 2, 1, sq, sk, error_bound, seed=sq)
    check(spec, 1, 2, 1, sq, sk, error_bound, seed=sk, f=0.7)


FLOAT_TILES = """\
name: float_tiles
head_dim: 64
dtype: bf16
mask: >-
  kv_idx * 1.1 + 0.6 <= q_idx
  || (q_idx - kv_idx) * 0.35 < 3.3 && exp((kv_idx - q_idx) * 0.05) * 3.3 >= 1.0
"""


@pytest.mark.parametrize(
    "mask", [None, "kv_idx * 0.6 + 0.6 <= q_idx", "kv_idx * 0.4 + 0.4 <= q_idx"]
)
@pytest.mark.parametrize("sq, sk", [(999, 999), (1000, 700), (333, 1025)])
def test_float_mask_tiles_match_the_float32_reference(mask, sq, sk, error_bound):
    """The tile classifier rounds float results outward (fg::iv::fl): forward and backward
    against the reference, whose mask math is float32 like the kernels'.  The two plain
    masks had 128 x 64 tiles called FULL that drop pairs in float32 (e.g. (384, 639))."""
    text = FLOAT_TILES if mask is None else FLOAT_TILES.split("mask:")[0] + f"mask: '{mask}'\n"
    if mask is not None:  # one op name per mask: a process registers each name once
        text = text.replace(
            "name: float_tiles", f"name: float_tiles_{mask.split()[2].replace('.', '')}"
        )
    spec = loads_spec(text, "float_tiles.yaml")
    check(spec, 1, 2, 1, sq, sk, error_bound, seed=sq)
    check_grads(spec, 1, 2, 1, sq, sk, seed=sk, deterministic=True)


def test_a_per_kv_head_tensor_read_by_query_head_warns_under_gqa():
    """``w[h]`` on a [num_heads_kv] tensor: with 4 query heads over 2 KV heads the kernel
    clamps h = 2, 3 to w[1]; the op says so (IndexBoundsWarning) instead of staying silent."""
    from flashgen.analysis.indexbounds import IndexBoundsWarning
    from flashgen.ops.op import build_op

    spec = loads_spec(
        "name: gpu_per_kv_head\nhead_dim: 64\ndtype: bf16\nscore_mod: score + w[h]\n"
        "params:\n  w: {type: f32, shape: [num_heads_kv]}\n",
        "per_kv_head.yaml",
    )
    op = build_op(spec)
    q = torch.randn(1, 4, 33, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 33, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2, device="cuda")
    with pytest.warns(IndexBoundsWarning, match=r"w\[\.\.\.\] subscript 0 ranges over \[0, 3\]"):
        op.attention(q, k, k, w=w)
    k4 = torch.randn(1, 4, 33, 64, device="cuda", dtype=torch.bfloat16)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", IndexBoundsWarning)
        op.attention(q, k4, k4, w=torch.randn(4, device="cuda"))  # in bounds: no warning


# h_kv: the KV head query head h reads (h / (num_heads / num_heads_kv)), so a [num_heads_kv]
# tensor param is read in bounds under GQA (tests/unit/test_kv_head_var.py on CPU).
KV_ALIBI = """\
name: gpu_kv_alibi
head_dim: 64
dtype: bf16
score_mod: score - w[h_kv] * abs(q_idx - kv_idx)
params:
  w: {type: f32, shape: [num_heads_kv]}
"""
KV_WINDOW = """\
name: gpu_kv_window
head_dim: 64
dtype: fp16
mask: causal && q_idx - kv_idx < 40 + 200 * h_kv
"""
KV_TABLE_WINDOW = """\
name: gpu_kv_table_window
head_dim: 64
dtype: fp16
mask: causal && q_idx - kv_idx < win[h_kv] * 16
params:
  win: {type: i32, shape: [num_heads_kv]}
"""


@pytest.mark.parametrize("persistent", ["0", "1"])
@pytest.mark.parametrize("sq, sk", [(17, 17), (300, 1000), (1000, 300)])
@pytest.mark.parametrize("text", [KV_ALIBI, KV_WINDOW, KV_TABLE_WINDOW])
def test_kv_head_index_under_gqa(text, sq, sk, persistent, error_bound, monkeypatch):
    """Hq = 8 over Hkv = 2: forward (also the persistent Hopper kernel on sm_90) and both
    backward paths against the fp64 reference, where ``h_kv = h // 4``."""
    import warnings

    from flashgen.analysis.indexbounds import IndexBoundsWarning

    gpu_options.use(monkeypatch, persistent=gpu_options.persistent(persistent))
    spec = loads_spec(text, "kv_head.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("error", IndexBoundsWarning)  # w[h_kv] stays inside [Hkv]
        check(spec, 2, 8, 2, sq, sk, error_bound, seed=sq + sk)
        if persistent == "0":
            check_grads(spec, 2, 8, 2, sq, sk, seed=sq, deterministic=True)
            check_grads(spec, 1, 8, 2, sq, sk, seed=sk, deterministic=False)
