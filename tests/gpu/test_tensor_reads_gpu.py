"""Tensor-param reads in every lowered form (``flashgen.codegen.cuda_expr._tensor_read``, CPU side
in tests/unit/test_tensor_reads.py) on the GPU: forward (the default kernel, the persistent Hopper
one and the FA2-class one) and both backward paths against the fp64 reference, Hq = 8 over Hkv = 2,
odd lengths, Sq != Sk.  The forms: a clamped int element offset from a hoisted (h) base, literals
peeled into the base with a negative element offset, a (b, h_kv) base with a peeled literal, 64-bit
offsets behind symbolic strides.  T5's bias (the shipped spec) is in test_forward.py /
test_backward_kernels.py.

    python3 -m pytest tests/gpu/test_tensor_reads_gpu.py -q
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

HEAD = "head_dim: 64\ndtype: bf16\n"
# (name, mask, score_mod, params); every subscript stays inside its tensor at these sizes
# (the reference refuses one outside at a kept pair), but not all provably so
# fmt: off
SPECS = [
    ("tr_clamped", "causal",
     "score + t[h, kv_idx - q_idx + 1100]",                    # clamp kept, (h) base
     "  t: {type: f32, shape: [num_heads, 2201]}\n"),
    ("tr_peeled", None,
     "score + t[h, q_idx % 3 - 1 + 1, 2 + kv_idx % 4] - u[b, h_kv, min(kv_idx, 9) - 3 + 3]",
     "  t: {type: f32, shape: [num_heads, 3, 6]}\n"
     "  u: {type: f32, shape: [batch, num_heads_kv, 10]}\n"),
    ("tr_wide", "q_idx - kv_idx < 600",
     "score + t[h_kv, q_idx, kv_idx / 50] * s[q_idx, h % 3]",   # symbolic strides: 64-bit
     "  t: {type: f32, shape: [num_heads_kv, seqlen_q, 21]}\n"
     "  s: {type: f32, shape: [seqlen_q, 3]}\n"),
]
# fmt: on


def _spec(name, mask, mod, params):
    text = f"name: {name}\n{HEAD}score_mod: '{mod}'\nparams:\n{params}"
    if mask is not None:
        text += f"mask: '{mask}'\n"
    return loads_spec(text, f"{name}.yaml")


def _params(spec, b, hq, hkv, sq, sk, seed):
    """Tensor params with a spread (randn * 2) that makes a misread element visible."""
    sizes = {"batch": b, "num_heads": hq, "num_heads_kv": hkv, "seqlen_q": sq, "seqlen_k": sk}
    gen = torch.Generator(device="cuda").manual_seed(seed + 7)
    out = {}
    for p in spec.tensor_params:
        shape = [d if isinstance(d, int) else sizes[d] for d in p.shape]
        out[p.name] = 2 * torch.randn(shape, device="cuda", generator=gen)
    return out


@pytest.mark.parametrize(
    "family, persistent", [("auto", "0"), ("fa2", "0"), ("auto", "1")], ids=["auto", "fa2", "pers"]
)
@pytest.mark.parametrize("sq, sk", [(17, 300), (1000, 257)])
@pytest.mark.parametrize("case", SPECS, ids=[c[0] for c in SPECS])
def test_forward(case, sq, sk, family, persistent, error_bound, monkeypatch):
    """The default kernel (Hopper on an H200), the FA2-class one and the persistent Hopper one."""
    gpu_options.use(monkeypatch, family=family, persistent=gpu_options.persistent(persistent))
    spec = _spec(*case)
    kw = _params(spec, 2, 8, 2, sq, sk, seed=sq)
    check(spec, 2, 8, 2, sq, sk, error_bound, seed=sq + sk, **kw)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("case", SPECS, ids=[c[0] for c in SPECS])
def test_backward(case, deterministic):
    spec = _spec(*case)
    check_grads(spec, 2, 8, 2, 257, 129, seed=3, deterministic=deterministic)
