"""The Hopper forward's masked-tile reductions (session 7) on the GPU, against the fp64
reference with the 2x rule (``tests/gpu/test_forward.py``'s ``check``): CAUSAL_ONLY and
NO_CAUSAL tiles (``Options`` ``hopper_fwd.causal_tiles``), the per-row column limit
(``hopper_fwd.col_limit``), the walk from the causal diagonal (``hopper_fwd.walk_from_diagonal``),
``kv_idx / chunk`` as ``fg::Divisor::div_nn`` (``hopper_fwd.nonneg_div``) and the first block
found by warp 0 alone (``hopper_fwd.single_walk``): all on, all off and the column limit alone
off, on the default kernel (the Hopper one on an H200) and the persistent one.  The masks
make every tile kind appear (chunks and windows shorter and longer than a tile, a prefix,
``causal`` under ``||`` and ``!``), with and without a score_mod (the score_mod path masks
after the scores; an affine one without a residual mask takes its affine form on masked
tiles too), at odd lengths, Sq != Sk both ways (bottom-right causal: empty query blocks when
Sq > Sk) and GQA.

    python3 -m pytest tests/gpu/test_mask_tiles_gpu.py -q
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_options  # noqa: E402
from test_forward import check  # noqa: E402

from flashgen.frontend.spec import load_spec, loads_spec  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
COL_LIMIT = "hopper_fwd.col_limit"
#: The reductions' options (dotted names of flashgen.Options).
SWITCHES = (
    "hopper_fwd.causal_tiles",
    COL_LIMIT,
    "hopper_fwd.walk_from_diagonal",
    "hopper_fwd.nonneg_div",
    "hopper_fwd.single_walk",
)


def _spec(name: str, mask: str, params: str = "", score_mod: str | None = None):
    text = f"name: {name}\nhead_dim: 128\ndtype: bf16\nmask: '{mask}'\n"
    if score_mod:
        text += f"score_mod: '{score_mod}'\n"
    if params:
        text += "params:\n" + params
    return loads_spec(text, f"{name}.yaml")


SPECS = {
    # (spec, param values): CAUSAL_ONLY on the diagonal, NO_CAUSAL at chunk boundaries
    "chunked_333": (lambda: load_spec(REPO / "specs" / "chunked_local.yaml"), {"chunk": 333}),
    "chunked_8192": (lambda: load_spec(REPO / "specs" / "chunked_local.yaml"), {}),
    "window_300": (lambda: load_spec(REPO / "specs" / "mistral_swa.yaml"), {"window": 300}),
    "prefix_200": (lambda: load_spec(REPO / "specs" / "prefix_lm.yaml"), {"prefix": 200}),
    # a score_mod with a residual mask: the score_mod path's three masked loops
    "softcap_window": (
        lambda: _spec(
            "mt_softcap_window",
            "causal && q_idx + seqlen_k - seqlen_q - kv_idx < w",
            "  w: {type: i32, default: 700}\n",
            "30.0 * tanh(score / 30.0) - 0.01 * (q_idx - kv_idx)",
        ),
        {},
    ),
    # an affine score_mod: plain causal takes the affine form on every tile (the column limit
    # masks after it); with a residual mask the masked tiles evaluate the score_mod
    "alibi": (lambda: load_spec(REPO / "specs" / "alibi.yaml"), {}),
    "affine_window": (
        lambda: _spec(
            "mt_affine_window",
            "causal && q_idx + seqlen_k - seqlen_q - kv_idx < w",
            "  w: {type: i32, default: 500}\n",
            "score + 0.05 * (kv_idx - q_idx)",
        ),
        {},
    ),
    # causal under || and !: CAUSAL_ONLY where the other side is decided
    "not_causal_or": (lambda: _spec("mt_not_causal_or", "!causal || kv_idx % 7 == 0"), {}),
    "causal_or_band": (
        lambda: _spec("mt_causal_or_band", "(causal || kv_idx < 50) && q_idx - kv_idx < 600"),
        {},
    ),
}
LENGTHS = [(1000, 1000), (127, 1000), (1000, 127), (1, 1000), (1031, 4097)]


# (switches off, kernel): every reduction on, on both kernels; all off (the old kernel); the
# CAUSAL_ONLY / NO_CAUSAL loops with the old per-element tests
SETTINGS = {
    "all_on": ((), "auto"),
    "all_on_persistent": ((), "persistent"),
    "all_off": (SWITCHES, "auto"),
    "col_limit_off": ((COL_LIMIT,), "auto"),
}


@pytest.fixture(params=sorted(SETTINGS))
def setting(request, monkeypatch):
    """Ops bound to the setting's options (:mod:`gpu_options`)."""
    off, kernel = SETTINGS[request.param]
    gpu_options.use(
        monkeypatch, {n: n not in off for n in SWITCHES}, family="auto",
        persistent="static" if kernel == "persistent" else "off",
    )  # fmt: skip
    return request.param


@pytest.mark.parametrize("key", sorted(SPECS))
def test_mask_tiles_forward(key, setting, error_bound):
    make, params = SPECS[key]
    base = make()
    # its own spec name per setting (each setting's options register their own op anyway)
    spec = dataclasses.replace(base, name=f"{base.name}_{setting}")
    for sq, sk in LENGTHS:
        check(spec, 1, 4, 2, sq, sk, error_bound, seed=sq + 3 * sk, **params)


# review7: causal under == and ?:, and a divisor that may be 0 (min 0: the signed division's
# zero case on CAUSAL_ONLY / NO_CAUSAL tiles); every reduction on, the default kernel
EDGE_SPECS = {
    "causal_eq": (lambda: _spec("mt_causal_eq", "causal == (q_idx % 5 < 2)"), {}),
    "causal_cond": (lambda: _spec("mt_causal_cond", "causal ? kv_idx % 2 == 0 : kv_idx < 3"), {}),
    "chunk_zero": (
        lambda: _spec(
            "mt_chunk_zero",
            "causal && q_idx / c == kv_idx / c",
            "  c: {type: i32, default: 0, min: 0}\n",
        ),
        {},
    ),
    "chunk_200": (
        lambda: _spec(
            "mt_chunk_min0",
            "causal && q_idx / c == kv_idx / c",
            "  c: {type: i32, default: 200, min: 0}\n",
        ),
        {},
    ),
}


@pytest.mark.parametrize("key", sorted(EDGE_SPECS))
def test_mask_tiles_edge_masks(key, monkeypatch, error_bound):
    gpu_options.use(monkeypatch, {n: True for n in SWITCHES}, family="auto", persistent="off")
    make, params = EDGE_SPECS[key]
    spec = make()
    for sq, sk in LENGTHS:
        check(spec, 1, 4, 2, sq, sk, error_bound, seed=sq + 3 * sk, **params)
