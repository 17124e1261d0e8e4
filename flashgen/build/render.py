"""Render CUDA source from a :class:`~flashgen.codegen.plan.KernelPlan` with Jinja2.

One ``jinja2.Environment`` (StrictUndefined) over the ``templates/`` tree, which
ships inside the package as ``flashgen.templates``.  Shared device code in
``templates/common/*.cuh`` is pulled in with ``{% include %}``, so every rendered
source is a single self-contained translation unit (nvcc and NVRTC need no -I).
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path

import jinja2

from flashgen.codegen.plan import KernelPlan


def template_root() -> Path:
    """The directory holding the templates: the checkout's ``templates/`` when running from
    source, else the ``flashgen.templates`` package of an installed wheel."""
    checkout = Path(__file__).resolve().parents[2] / "templates"
    if (checkout / "sm_80").is_dir():
        return checkout
    return Path(str(resources.files("flashgen.templates")))


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    """The one Jinja environment: StrictUndefined, no autoescape, trimmed blocks."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_root())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


#: Probe points of the templates: instrumentation (``flashgen bench --timeline`` and
#: ``--ablation``), each rendered only when :func:`render` is asked for it (``probes=``), else
#: nothing (the source is byte-identical).
#: Name -> what it does; all are in ``templates/sm_90/fwd.cu.j2``.
PROBES: dict[str, str] = {
    "timeline": "non-persistent Hopper forward: clock64 stamps, 32 int64 slots per CTA in the "
    "__device__ array fg_prof[65536 * 32] (flashgen/bench/timeline.py)",
    "no_softmax": "Hopper forward: the softmax returns at once, P is S "
    "(flashgen/bench/ablation.py)",
    "no_s_gemm": "Hopper forward: the Q K^T wgmmas left out",
    "no_pv_gemm": "Hopper forward: the P V wgmmas left out",
    "no_o_rescale": "Hopper forward: O is not multiplied by alpha",
    "vote_o_rescale": "Hopper forward: the O rescale skipped when no row of the warp changed "
    "its max (a warp vote; the result stays exact)",
    "no_kv_loads": "Hopper forward: the producer arms k_full / v_full without loading K and V",
    "half_kv_loads": "Hopper forward: only the first 64 columns of each K and V row are loaded",
    "no_transpose": "fp8 Hopper forward: the transposing warps arrive without transposing V",
}


def render(plan: KernelPlan, probes: frozenset[str] = frozenset()) -> str:
    """CUDA C++ source of ``plan``'s kernel (one translation unit, ``extern "C"`` symbol).

    ``probes``: names of :data:`PROBES` to render (instrumentation for tools; the outputs of a
    probed kernel are wrong by design, but ``timeline``'s and ``vote_o_rescale``'s).  A probe
    whose template has no such point renders as nothing.  Raises ``ValueError`` naming an
    unknown probe, ``jinja2.UndefinedError`` if the template reads a name the plan lacks.
    """
    unknown = sorted(set(probes) - PROBES.keys())
    if unknown:
        raise ValueError(f"render: unknown probes {unknown}; expected names of {sorted(PROBES)}")
    context = {**plan.context.fields(), "probes": frozenset(probes)}
    return environment().get_template(plan.template).render(**context)
