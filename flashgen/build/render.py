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


def render(plan: KernelPlan) -> str:
    """CUDA C++ source of ``plan``'s kernel (one translation unit, ``extern "C"`` symbol).

    Raises ``jinja2.UndefinedError`` if the template reads a name the plan lacks.
    """
    return environment().get_template(plan.template).render(**plan.context.fields())
