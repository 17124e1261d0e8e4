"""The Hopper forward's column bounds (``Options`` ``hopper_fwd.col_bound``,
flashgen/analysis/colbound.py) on the GPU.

A residual conjunct such as mistral_swa's ``q_idx + seqlen_k - seqlen_q - kv_idx < window`` is
folded into the masked tiles' per-row column range.  Checked here: the fp64 reference with the
2x rule (``tests/gpu/test_forward.py``'s ``check``) on the default and the persistent kernel,
windows shorter than a tile, longer than the sequence and at int32's edge, lower and upper
bounds together, a bound beside a remaining conjunct and beside a score_mod, at odd lengths,
Sq != Sk both ways and GQA; and that the option changes no bit of the output (the same pairs
are kept, the scores and the softmax are the same instructions).

    python3 -m pytest tests/gpu/test_colbound_gpu.py -q
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

from flashgen.bench.verify import random_inputs  # noqa: E402
from flashgen.frontend.spec import load_spec, loads_spec  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
I32_MAX = 2**31 - 1


def _spec(name: str, mask: str, params: str = "", score_mod: str | None = None):
    text = f"name: {name}\nhead_dim: 128\ndtype: bf16\nmask: '{mask}'\n"
    if score_mod:
        text += f"score_mod: '{score_mod}'\n"
    if params:
        text += "params:\n" + params
    return loads_spec(text, f"{name}.yaml")


def _mistral():
    return load_spec(REPO / "specs" / "mistral_swa.yaml")


SPECS = {
    # (spec, param sets)
    "mistral": (_mistral, [{"window": w} for w in (1, 37, 128, 300, 4096, I32_MAX)]),
    "band": (
        lambda: _spec(
            "cb_band",
            "causal && kv_idx > q_idx - w && kv_idx <= q_idx + p",
            "  w: {type: i32, default: 200}\n  p: {type: i32, default: -3}\n",
        ),
        [{}, {"w": 1, "p": 0}, {"w": 5000, "p": -100}],
    ),
    "bound_and_rest": (
        lambda: _spec(
            "cb_rest",
            "causal && q_idx + seqlen_k - seqlen_q - kv_idx < w && kv_idx % 3 != 1",
            "  w: {type: i32, default: 300}\n",
        ),
        [{}],
    ),
    "affine": (  # an affine score_mod: its masked tiles mask after the scores (limit pass)
        lambda: _spec(
            "cb_affine",
            "causal && q_idx + seqlen_k - seqlen_q - kv_idx < w",
            "  w: {type: i32, default: 500}\n",
            "score - 0.01 * (q_idx - kv_idx)",
        ),
        [{}, {"w": 1}],
    ),
    "score_mod": (
        lambda: _spec(
            "cb_softcap",
            "causal && q_idx + seqlen_k - seqlen_q - kv_idx < w",
            "  w: {type: i32, default: 700}\n",
            "30.0 * tanh(score / 30.0)",
        ),
        [{}],
    ),
}
LENGTHS = [(1000, 1000), (127, 1000), (1000, 127), (1, 1000), (1031, 4097)]


@pytest.fixture(params=["auto", "persistent"])
def kernel(request, monkeypatch):
    gpu_options.use(
        monkeypatch, {"hopper_fwd.col_bound": True}, family="auto",
        persistent="static" if request.param == "persistent" else "off",
    )  # fmt: skip
    return request.param


@pytest.mark.parametrize("key", sorted(SPECS))
def test_column_bound_forward(key, kernel, error_bound):
    make, param_sets = SPECS[key]
    base = make()
    spec = dataclasses.replace(base, name=f"{base.name}_cb_{kernel}")
    for params in param_sets:
        for sq, sk in LENGTHS:
            check(spec, 1, 4, 2, sq, sk, error_bound, seed=sq + 3 * sk, **params)


@pytest.mark.parametrize("window", [37, 1000])
def test_switch_changes_no_bit(window):
    """Two ops of one spec, ``hopper_fwd.col_bound`` on and off (the kernels differ: the
    plans say so), compute the same bits."""
    dev = torch.device("cuda")
    base = _mistral()
    spec = dataclasses.replace(base, name="mistral_swa_cb_bits")
    outs = []
    for on in (True, False):
        op = gpu_options.build(
            spec, gpu_options.options({"hopper_fwd.col_bound": on}, persistent="off")
        )
        assert (op.kernel(dev).plan.context["col_bound"] is not None) is on
        gen = torch.Generator(device=dev).manual_seed(window)
        q, k, v, params = random_inputs(base, 2, 8, 2, 1500, 3001, dev, gen)
        params["window"] = window
        outs.append(op.attention(q, k, v, **params))
    torch.cuda.synchronize()
    (o1, l1), (o0, l0) = outs
    assert torch.equal(l1, l0), (l1 - l0).abs().max().item()
    assert torch.equal(o1, o0), (o1.float() - o0.float()).abs().max().item()
