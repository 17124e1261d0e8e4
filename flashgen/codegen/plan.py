"""The plan record every kernel family produces: :class:`TileConfig`, :class:`KernelPlan`
and the base of the families' typed template contexts, :class:`TemplateContext`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from flashgen.codegen.abi import ARCH, GENCODE, KernelArg, TmaArg


@dataclass(frozen=True)
class TileConfig:
    """BLOCK_M query rows x BLOCK_N key columns per CTA step, with ``num_warps`` warps.

    Each warp owns BLOCK_M / num_warps query rows (a multiple of 16, one mma row tile).
    """

    block_m: int
    block_n: int
    num_warps: int

    @property
    def threads(self) -> int:
        return 32 * self.num_warps


    @property
    def warp_specialized(self) -> bool:
        """True for a warp-specialized Hopper tile config (a producer warpgroup plus consumer
        warpgroups of 64 query rows each)."""
        return is_hopper_tiles(self)


def is_hopper_tiles(tiles: TileConfig) -> bool:
    """True for a warp-specialized Hopper tile config (a producer warpgroup plus consumer
    warpgroups of 64 query rows each)."""
    return tiles.num_warps % 4 == 0 and tiles.block_m == 64 * (tiles.num_warps // 4 - 1)


class TemplateContext:
    """Base of the typed template contexts (one frozen dataclass per kernel family): its
    fields are the names the family's template reads.  :meth:`fields` gives them to Jinja;
    ``ctx["name"]`` / ``ctx.get("name")`` read a field as a mapping would (``KeyError`` for a
    name the family does not have).  :meth:`grid` is the family's launch geometry."""

    def fields(self) -> dict:
        """``{name: value}`` of every field (shallow: values are not copied)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __getitem__(self, name: str):
        if name not in self.__dataclass_fields__:
            raise KeyError(name)
        return getattr(self, name)

    def __contains__(self, name: str) -> bool:
        return name in self.__dataclass_fields__

    def get(self, name: str, default=None):
        return getattr(self, name, default) if name in self else default

    def keys(self):
        return self.__dataclass_fields__.keys()

    def grid(self, plan, batch, heads_q, seqlen_q, num_sms=None, *, heads_kv=None, seqlen_k=None):
        """1-D: one CTA per (query block, batch * head) tile."""
        return (plan.num_m_blocks(seqlen_q) * batch * heads_q, 1, 1)


@dataclass(frozen=True)
class KernelPlan:
    """Everything needed to render, compile and launch one forward kernel."""

    spec_name: str
    target: str  # "sm_80" | "sm_90"
    template: str  # path under templates/, e.g. "sm_80/fwd.cu.j2"
    kernel_name: str  # extern "C" symbol
    tiles: TileConfig
    smem_bytes: int  # dynamic shared memory per CTA
    args: tuple[KernelArg, ...]
    #: the family's typed template context (:class:`TemplateContext`)
    context: TemplateContext = field(compare=False, hash=False)
    #: CUtensorMap arguments (Hopper kernels): built at launch from the named tensors.
    tma: tuple[TmaArg, ...] = ()
    #: the non-default options the plan was made with (:meth:`flashgen.options.Options.key`
    #: of its family's part; empty for the defaults): part of the kernel cache key
    options_key: str = ""

    @classmethod
    def of(
        cls, spec_name: str, target: str, template: str, tiles, smem_bytes: int, context,
        options_key: str = "", **extra,
    ):  # fmt: skip
        """The plan of a family whose typed ``context`` carries ``kernel_name`` and ``args``
        (the forward families, decode); ``extra``: further fields (``tma``, ``role``)."""
        return cls(
            spec_name=spec_name, target=target, template=template,
            kernel_name=context.kernel_name, tiles=tiles, smem_bytes=smem_bytes,
            args=context.args, context=context, options_key=options_key, **extra,
        )  # fmt: skip

    @property
    def threads(self) -> int:
        return self.tiles.threads

    @property
    def gencode(self) -> str:
        """nvcc flag selecting the target, e.g. ``-gencode=arch=compute_90a,code=sm_90a``."""
        return GENCODE[self.target]

    @property
    def arch(self) -> str:
        """NVRTC ``--gpu-architecture`` value (``sm_80`` or ``sm_90a``)."""
        return ARCH[self.target]

    def num_m_blocks(self, seqlen_q: int) -> int:
        return (seqlen_q + self.tiles.block_m - 1) // self.tiles.block_m

    def grid(
        self,
        batch: int,
        heads_q: int,
        seqlen_q: int,
        num_sms: int | None = None,
        *,
        heads_kv: int | None = None,
        seqlen_k: int | None = None,
    ) -> tuple[int, int, int]:
        """The launch grid over the ``ceil(seqlen_q/BLOCK_M) * batch * heads_q`` work tiles
        (query block, batch*head): the family's launch geometry, :meth:`TemplateContext.grid`
        of the plan's context (1-D, one tile per CTA, unless the family says otherwise: the
        Hopper forward's grouped and persistent grids need ``heads_kv`` / ``seqlen_k`` /
        ``num_sms``).  ``ValueError`` if an argument the plan needs is missing."""
        return self.context.grid(
            self, batch, heads_q, seqlen_q, num_sms, heads_kv=heads_kv, seqlen_k=seqlen_k
        )

    def base_config(self) -> dict:
        """The part of :meth:`config` every plan has: target, template, kernel, tiles,
        threads and dynamic shared memory."""
        return {
            "target": self.target,
            "template": self.template,
            "kernel": self.kernel_name,
            "block_m": self.tiles.block_m,
            "block_n": self.tiles.block_n,
            "num_warps": self.tiles.num_warps,
            "threads": self.threads,
            "smem_bytes": self.smem_bytes,
        }

    def config(self) -> dict:
        """JSON-able summary for manifests and ``flashgen show``."""
        return {
            **self.base_config(),
            "causal": self.context["causal"],
            "has_mask": self.context["mask_expr"] is not None,
            "has_score_mod": self.context["score_mod_expr"] is not None,
            "block_table": self.context["block_table"],
        }

