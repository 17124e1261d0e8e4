"""Test specs whose every trainable term is per CTA with d score_mod / d param affine in the
pair's indices (``hopper_bwd.dparam_affine``), shared by the CPU tests of the form
(tests/unit/test_dparam_affine.py) and their GPU run (tests/gpu/test_dparam_affine_gpu.py)."""

from __future__ import annotations

from flashgen.frontend.spec import loads_spec

#: (score_mod, params, mask) of each test spec.
AFFINE_SPECS = {
    "slope_head": ("score - s[h] * (q_idx - kv_idx)", "s: {type: f32, shape: [num_heads]}",
                   "causal"),
    "slope_batch_head": ("score + bb[b, h] * (kv_idx - q_idx) * 0.5",
                         "bb: {type: f32, shape: [batch, num_heads]}", "null"),
    "slope_scaled_bias": ("score - s[h] * g * (q_idx - kv_idx) + c[b, h]",
                          "s: {type: f32, shape: [num_heads]}\n  g: {type: f32, default: 1.0}\n"
                          "  c: {type: f32, shape: [batch, num_heads]}", "causal"),
    "slope_window": ("score - s[h] * (q_idx - kv_idx)",
                     "s: {type: f32, shape: [num_heads]}\n  w: {type: i32, default: 300, min: 1}",
                     "causal && q_idx - kv_idx < w"),
}  # fmt: skip


def affine_spec(form: str, head_dim: int = 128):
    """The test spec ``form`` of :data:`AFFINE_SPECS` at ``head_dim``."""
    score_mod, params, mask = AFFINE_SPECS[form]
    return loads_spec(
        f"name: aff_{form}_{head_dim}\nhead_dim: {head_dim}\ndtype: bf16\nmask: {mask}\n"
        f'score_mod: "{score_mod}"\nparams:\n  {params}\n',
        f"<aff_{form}>",
    )
