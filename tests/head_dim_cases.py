"""Specs for the head-dim matrix, shared by tests/unit/test_head_dims.py (nvcc, CPU) and
the GPU suites (tests/gpu/test_forward.py, tests/gpu/test_backward_kernels.py).

``NEW_HEAD_DIMS`` are the (head_dim, head_dim_v) pairs beyond the original 64/128/256:
head_dim 32, 96, 160, 192 (rows of 64, 192, 320, 384 bytes) and two pairs with
head_dim_v != head_dim, (192, 128) as in DeepSeek MLA and (128, 256).
"""

from __future__ import annotations

from flashgen.frontend import ir
from flashgen.frontend.spec import loads_spec

NEW_HEAD_DIMS = ((32, 32), (96, 96), (160, 160), (192, 192), (192, 128), (128, 256))

#: score_mod variants: none, softcap (tanh, Gemma 2) and ALiBi (a tensor param read at h)
SCORE_MODS = {
    "none": (None, ""),
    "softcap": (
        "softcap * tanh(score / softcap)",
        "params:\n  softcap: {type: f32, default: 30.0}\n",
    ),
    "alibi": (
        "score - slopes[h] * (q_idx + seqlen_k - seqlen_q - kv_idx)",
        "params:\n  slopes: {type: f32, shape: [num_heads]}\n",
    ),
}


def dims_id(d: int, dv: int) -> str:
    return f"d{d}" if d == dv else f"d{d}_{dv}"


def hdim_spec(
    d: int, dv: int, dtype: str = "bf16", score_mod: str = "none", causal: bool = True
) -> ir.Spec:
    """A checked spec named ``hd_<dims>_<dtype>_<score_mod>_<causal|nomask>``."""
    expr, params = SCORE_MODS[score_mod]
    name = f"hd_{dims_id(d, dv)}_{dtype}_{score_mod}_{'causal' if causal else 'nomask'}"
    text = f"name: {name}\nhead_dim: {d}\nhead_dim_v: {dv}\ndtype: {dtype}\n"
    text += f"mask: {'causal' if causal else 'null'}\n"
    if expr is not None:
        text += f"score_mod: '{expr}'\n{params}"
    return loads_spec(text, path=f"<{name}>")


def prebuild(
    specs, device, *, backward: bool = False, atomic_dq: bool = False, options=None
) -> None:
    """Compile the kernels ``specs`` will need on CUDA ``device`` into the kernel cache, in
    parallel (one nvcc per CPU core), so the tests' sequential ``build_op`` calls hit the
    cache.  Forward always; with ``backward`` the deterministic backward unit, and with
    ``atomic_dq`` the atomic-dQ unit too.  Only warms the cache: a plan chosen differently
    at run time is still built then.  ``options``: the :class:`flashgen.options.Options` the
    ops will run under (default the defaults)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from flashgen.families.build import build_backward, build_forward
    from flashgen.ops.op import target_for_device
    from flashgen.options import DEFAULT

    options = DEFAULT if options is None else options

    gpu = torch.cuda.get_device_name(device)
    jobs = []
    for spec in specs:
        target = target_for_device(spec, device)
        jobs.append(lambda s=spec, t=target: build_forward(s, t, gpu=gpu, options=options))
        if backward:
            jobs.append(lambda s=spec, t=target: build_backward(s, t, options=options))
        if atomic_dq:
            jobs.append(
                lambda s=spec, t=target: build_backward(s, t, atomic_dq=True, options=options)
            )
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:
        list(pool.map(lambda job: job(), jobs))
