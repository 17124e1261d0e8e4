"""Test specs of every index form a param read can take (issue 37), shared by the CPU compile
tests of the dparam units (tests/unit/test_dparam_kernels.py, test_dparam_const_tiles.py) and
their GPU run (tests/gpu/test_param_grads_sinks_gpu.py)."""

from __future__ import annotations

from flashgen.frontend.spec import loads_spec

#: One spec per index form of a param read (tests/unit/test_param_grads.py's INDEX_FORMS at
#: kernel head dims), with the reduction forms of its terms.
FORMS = {
    "per_head": ("score - s[h] * abs(q_idx - kv_idx)", "s: {type: f32, shape: [num_heads]}",
                 ("cta",)),
    "per_batch_head": ("score + bb[b, h]", "bb: {type: f32, shape: [batch, num_heads]}",
                       ("cta",)),
    "per_query": ("score * qs[b, q_idx]", "qs: {type: f32, shape: [batch, seqlen_q]}",
                  ("query",)),
    "per_key": ("score + kb[h_kv, kv_idx]", "kb: {type: f32, shape: [num_heads_kv, seqlen_k]}",
                ("key",)),
    "per_key_head": ("score + kb[h, kv_idx]", "kb: {type: f32, shape: [num_heads, seqlen_k]}",
                     ("key",)),
    "relative_table": ("score + rel[h, min(max(q_idx - kv_idx, -4), 4) + 4]",
                       "rel: {type: f32, shape: [num_heads, 9]}", ("diagonal",)),
    "full_bias": ("score + fb[q_idx, kv_idx]", "fb: {type: f32, shape: [seqlen_q, seqlen_k]}",
                  ("general",)),
    "two_reads": ("score + t[q_idx % 3] - 2.0 * t[kv_idx % 3]", "t: {type: f32, shape: [3]}",
                  ("query", "key")),
    "scalars": ("temp * score + g * tanh(score / temp)",
                "temp: {type: f32, default: 1.0, above: 0}\n  g: {type: f32, default: 0.5}",
                ("cta", "cta")),
}  # fmt: skip


def form_spec(form: str, head_dim: int = 128, mask: str = "causal", tag: str = ""):
    """The test spec of index form ``form`` (``tag``: a suffix of its name, for a spec with
    another mask)."""
    score_mod, params, _ = FORMS[form]
    return loads_spec(
        f"name: dp_{form}_{head_dim}{tag}\nhead_dim: {head_dim}\ndtype: bf16\nmask: {mask}\n"
        f'score_mod: "{score_mod}"\nparams:\n  {params}\n',
        f"<dp_{form}>",
    )


#: Relative-position (diagonal) reads whose tiles away from the diagonal read one element (the
#: Hopper backward's constant tiles, ``hopper_bwd.dparam_const_tiles``): score_mod, params and
#: the scalar params' values the tests use.
DIAGONAL_FORMS = {
    "t5": ("score + bias[h, min(max(kv_idx - q_idx, -128), 128) + 128]",
           "bias: {type: f32, shape: [num_heads, 257]}", {}),
    "rel4": ("score + rel[h, min(max(q_idx - kv_idx, -4), 4) + 4]",
             "rel: {type: f32, shape: [num_heads, 9]}", {}),
    "param_clamp": ("score + bias[h, min(max(kv_idx - q_idx, -w), w) + w]",
                    "bias: {type: f32, shape: [num_heads, 129]}\n"
                    "  w: {type: i32, default: 16, min: 1, max: 64}", {"w": 40}),
    "buckets": ("score + bb[b, h, min(abs(kv_idx - q_idx) / 16, 7)]",
                "bb: {type: f32, shape: [batch, num_heads, 8]}", {}),
    "two_sided": ("score + tb[h, kv_idx - q_idx > 0 ? 8 + min((kv_idx - q_idx) / 8, 7)"
                  " : min((q_idx - kv_idx) / 8, 7)]",
                  "tb: {type: f32, shape: [num_heads, 16]}", {}),
    "wide": ("score + t3[min(max((kv_idx - q_idx) * 3, -6), 6) + 6]",
             "t3: {type: f32, shape: [13]}", {}),
    "float_cmp": ("score + tf[h, (kv_idx - q_idx) * 0.5 > 3.0 ? 1 : 0]",
                  "tf: {type: f32, shape: [num_heads, 2]}", {}),
    "two_terms": ("score + bias[h, min(max(kv_idx - q_idx, -8), 8) + 8] * 0.5"
                  " + bias[h, min(max(q_idx - kv_idx, -2), 2) + 2]",
                  "bias: {type: f32, shape: [num_heads, 17]}", {}),
}  # fmt: skip


def diagonal_spec(form: str, head_dim: int = 64, mask: str = "null"):
    """The test spec of relative-position read ``form`` (:data:`DIAGONAL_FORMS`)."""
    score_mod, params, _ = DIAGONAL_FORMS[form]
    tag = "" if mask == "null" else "_masked"
    return loads_spec(
        f"name: cst_{form}_{head_dim}{tag}\nhead_dim: {head_dim}\ndtype: bf16\nmask: {mask}\n"
        f'score_mod: "{score_mod}"\nparams:\n  {params}\n',
        f"<cst_{form}>",
    )


#: (form, head_dim, mask) of :data:`DIAGONAL_FORMS` the GPU test runs with the constant tiles
#: (each a Hopper unit, compiled spill-free by tests/unit/test_dparam_const_tiles.py).
CONST_TILE_CASES = [
    ("t5", 64, "null"), ("t5", 256, "null"), ("rel4", 64, "causal"), ("rel4", 256, "causal"),
    ("param_clamp", 64, "null"), ("buckets", 64, "null"), ("two_sided", 64, "null"),
    ("wide", 64, "null"), ("float_cmp", 256, "null"), ("two_terms", 64, "null"),
]  # fmt: skip
