"""The reduction form of each param-gradient term (flashgen.analysis.paramgrad): what a
backward kernel's dparam code may reduce on chip before its one atomic per element per CTA."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashgen.analysis.derive import param_grad_terms
from flashgen.analysis.paramgrad import grad_plan, reduction_form
from flashgen.frontend.spec import load_spec, loads_spec

REPO = Path(__file__).resolve().parents[2]


def _forms(score_mod: str, shape: str) -> tuple[str, ...]:
    spec = loads_spec(
        f"name: pf\nhead_dim: 64\ndtype: bf16\nscore_mod: \"{score_mod}\"\nparams:\n"
        f"  t: {{type: f32, shape: {shape}}}\n  c: {{type: i32, default: 4}}\n",
        "pf.yaml",
    )
    return tuple(reduction_form(t, spec) for t in param_grad_terms(spec.score_mod, "t"))


@pytest.mark.parametrize(
    ("score_mod", "shape", "forms"),
    [
        ("score + t[h]", "[num_heads]", ("cta",)),
        ("score + t[b, h_kv] * (q_idx - kv_idx)", "[batch, num_heads_kv]", ("cta",)),
        ("score + t[c % 2]", "[2]", ("cta",)),
        ("score + t[h, kv_idx]", "[num_heads, seqlen_k]", ("key",)),
        ("score + t[b, q_idx]", "[batch, seqlen_q]", ("query",)),
        ("score + t[h, min(max(kv_idx - q_idx, -8), 8) + 8]", "[num_heads, 17]", ("diagonal",)),
        ("score + t[q_idx + seqlen_k - seqlen_q - kv_idx + 40]", "[100]", ("diagonal",)),
        ("score + t[2 * q_idx - 2 * kv_idx + 50]", "[100]", ("diagonal",)),
        ("score + t[q_idx + kv_idx]", "[100]", ("general",)),
        ("score + t[q_idx % 3] - t[kv_idx % 3]", "[3]", ("query", "key")),
        ("score + t[abs(q_idx - kv_idx) / 4]", "[100]", ("diagonal",)),
    ],
)
def test_reduction_form_of_each_index_form(score_mod, shape, forms):
    assert _forms(score_mod, shape) == forms


def test_grad_plan_of_the_shipped_specs_keys_only_the_params_asked_for():
    alibi = load_spec(REPO / "specs" / "alibi.yaml")
    assert grad_plan(alibi, ["slopes"]) == (("slopes", ("cta",)),)
    assert grad_plan(alibi, []) == ()
    t5 = load_spec(REPO / "specs" / "t5_bias.yaml")
    assert grad_plan(t5, ["bias"]) == (("bias", ("diagonal",)),)
    softcap = load_spec(REPO / "specs" / "gemma2_softcap.yaml")
    assert grad_plan(softcap, ["softcap"]) == (("softcap", ("cta",)),)
