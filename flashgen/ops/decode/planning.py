"""Planning of decode calls: the :class:`~flashgen.ops.decode.op.DecodeOp` methods that
turn a call's sizes into a :class:`~flashgen.ops.decode.fast.DecodeCallPlan` --
:meth:`DecodePlanning.plan_decode` (the user's plan for calls of one shape, FlashInfer's
plan), :meth:`DecodePlanning.plan_for` (the plan of one call: the decode unit, the split
count, the grids, the fixed launch values), the check of a given ``plan=`` against a call,
and the decode units' kernels that a plan loads.  Launching a plan stays in
:mod:`flashgen.ops.decode.op`.

:class:`DecodePlanning` is a mixin of :class:`~flashgen.ops.decode.op.DecodeOp`: it reads the
op's ``spec``, ``op`` (the attention op: its options), ``_units`` / ``_lock`` (the loaded
units), ``_live`` (the live-block memo), ``_mla`` (the MLA unit choice's memo) and calls its
``_refuse``.  It imports
:mod:`~flashgen.ops.decode.fast`, :mod:`~flashgen.ops.decode.inputs`, ``calls`` and
``validation``, never :mod:`flashgen.ops.decode.op`.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from flashgen.families import decode as family
from flashgen.families import registry
from flashgen.frontend.errors import OpInputError
from flashgen.ops.calls import _sm_count
from flashgen.ops.decode.fast import DecodeCallPlan, _FastPath, _workspace
from flashgen.ops.decode.inputs import FP8_CACHE, DecodeDims, check_num_splits
from flashgen.ops.validation import TORCH_DTYPE, check_scalar, target_for_device


class DecodePlanning:
    """:class:`~flashgen.ops.decode.op.DecodeOp`'s planning (module doc)."""

    def plan_decode(
        self,
        *,
        batch: int,
        num_heads: int,
        num_heads_kv: int,
        seqlen_q: int = 1,
        cache_capacity: int,
        page_size: int | None = None,
        num_pages: int | None = None,
        append: bool = False,
        total_q: int | None = None,
        num_splits: int | None = None,
        device=None,
        pack_gqa: bool = True,
        options=None,
        cache_dtype=None,
        **params,
    ) -> DecodeCallPlan:
        """Plan calls of one shape (FlashInfer's plan/run): ``batch`` requests, ``num_heads`` /
        ``num_heads_kv`` heads, ``seqlen_q`` new queries, ``cache_capacity`` keys per request
        (dense: S_cache; paged: max_pages * page_size, with ``page_size`` and ``num_pages``
        the paged cache's), ``append``: calls pass k_new/v_new.
        ``total_q``: a plan for ragged calls (``cu_seqlens_q=``): q ``[total_q, Hq, D]`` with
        at most ``total_q`` rows (the split workspace's), ``seqlen_q`` their ``max_seqlen_q``
        (the grid's; the calls' Sq_b and own ``max_seqlen_q`` at most that), ``batch`` the
        requests (``cu_seqlens_q`` ``[batch + 1]``); None: padded calls, q ``[batch, Hq,
        seqlen_q, D]``.
        ``num_splits`` None: the heuristic for this capacity on ``device``'s SM count.
        ``pack_gqa`` False: one query head per CTA (for measurements).  ``options``: the
        unit's tiles and the split schedule (:class:`flashgen.families.decode.Options`, or a
        :class:`flashgen.Options` whose ``decode`` is taken, its ``exact_softmax`` the op's;
        default: the op's ``Options.decode``; ``flashgen.bench.decode --sweep`` times a grid
        of them).  ``params``: values of the mask's scalar params the calls will pass (the
        spec's defaults otherwise): a mask that bounds the live keys (a sliding window) sizes
        the splits by its blocks, not the capacity's; calls may pass other values.
        ``cache_dtype``: the calls' cache dtype, None (the spec's) or ``torch.float8_e4m3fn``
        (an e4m3 cache: its own unit; the calls pass the descales).
        A ``v_from_k`` spec (MLA) under ``Options.decode.mla_unit="auto"`` gets its unit for
        this shape here (:func:`flashgen.families.decode.mla_unit_for_call`; the plan's
        :attr:`~flashgen.ops.decode.fast.DecodeCallPlan.mla_unit`), and the planned calls run
        it; an unplanned call picks its own at call time.
        ``device``: where the calls run; None: the current CUDA device if there is one,
        else the CPU.  On a CUDA device it builds and loads the kernels and allocates the
        workspace, so planned calls do no host planning and can be captured in a CUDA graph.
        Raises :class:`OpInputError` for bad sizes, options or params, for a CUDA
        ``device`` where no CUDA device is available and for another device type (the op
        runs on CPU and CUDA); ``RuntimeError`` if a reload of the edited spec replaced the
        op."""
        self.op._check_live()
        self._refuse()
        options = self._decode_options(options)
        for name, flag in (("append", append), ("pack_gqa", pack_gqa)):
            if not isinstance(flag, bool):
                raise OpInputError(f"{name}: expected a bool, got {flag!r}")
        scalar = {p.name: p for p in self.spec.scalar_params}
        for name, val in params.items():
            if name not in scalar:
                raise OpInputError(
                    f"{name}: not a scalar param of spec {self.spec.name!r} (expected one of "
                    f"{sorted(scalar)} or a plan_decode argument)"
                )
            check_scalar(scalar[name], val)
        for name, v in (("batch", batch), ("num_heads", num_heads), ("num_heads_kv", num_heads_kv),
                        ("seqlen_q", seqlen_q), ("cache_capacity", cache_capacity),
                        ("total_q", 0 if total_q is None else total_q)):  # fmt: skip
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise OpInputError(f"{name}: expected a non-negative int, got {v!r}")
        if total_q is not None and total_q > 0 and seqlen_q == 0:
            raise OpInputError(
                f"seqlen_q: expected >= 1 (the ragged calls' max_seqlen_q) for total_q {total_q}"
            )
        if num_heads_kv == 0:
            raise OpInputError("num_heads_kv: expected >= 1, got 0")
        if num_heads % num_heads_kv:
            raise OpInputError(
                f"num_heads: expected a multiple of num_heads_kv {num_heads_kv}, got {num_heads}"
            )
        kv_dtype = None
        if cache_dtype is not None and cache_dtype != TORCH_DTYPE[self.spec.dtype]:
            if FP8_CACHE is None or cache_dtype != FP8_CACHE:
                raise OpInputError(
                    f"cache_dtype: expected None, {TORCH_DTYPE[self.spec.dtype]} or {FP8_CACHE}, "
                    f"got {cache_dtype!r}"
                )
            why = family.cache_dtype_reason(self.spec, "fp8_e4m3")
            if why is not None:
                raise OpInputError(f"cache_dtype: {why}")
            kv_dtype = "fp8_e4m3"
        paged = page_size is not None
        if not paged and num_pages is not None:  # a dense plan would drop it without a word
            raise OpInputError(
                f"num_pages: expected None for a dense cache (num_pages goes with page_size, a "
                f"paged cache), got {num_pages!r} without page_size"
            )
        if paged:
            if (
                isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1
                or isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1
            ):  # fmt: skip
                raise OpInputError(
                    f"page_size, num_pages: expected ints >= 1 for a paged cache, got "
                    f"{page_size!r}, {num_pages!r}"
                )
            max_pages = -(-cache_capacity // page_size)
            dims = DecodeDims(batch, num_heads, num_heads_kv, seqlen_q, self.spec.head_dim_v,
                              True, num_pages, page_size, max_pages, append,
                              cache_dtype=kv_dtype)  # fmt: skip
        else:
            dims = DecodeDims(batch, num_heads, num_heads_kv, seqlen_q, self.spec.head_dim_v,
                              False, batch, cache_capacity, 1, append,
                              cache_dtype=kv_dtype)  # fmt: skip
        if total_q is not None:
            dims = dataclasses.replace(dims, total_q=total_q)
        if device is None:  # where the op runs: the current CUDA device if any, else the CPU
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise OpInputError(
                f"device: expected 'cpu' or a CUDA device ('cuda', 'cuda:1', a torch.device), "
                f"got {device!r}"
            ) from None
        if device.type not in ("cpu", "cuda"):  # the decode op runs on these only
            raise OpInputError(
                f"device: expected 'cpu' or a CUDA device (the decode op runs on these), got "
                f"{str(device)!r}"
            )
        if device.type == "cuda" and not torch.cuda.is_available():
            raise OpInputError(
                f"device: expected 'cpu' or a CUDA device, got {str(device)!r} and no CUDA "
                "device is available"
            )
        if device.type == "cuda" and device.index is None:  # the current device, by index
            device = torch.device("cuda", torch.cuda.current_device())
        splits = check_num_splits(num_splits)
        return self.plan_for(dims, device, splits or None, pack_gqa=pack_gqa, own_workspace=True,
                             options=options, params=params)  # fmt: skip

    def _decode_options(self, options) -> family.Options | None:
        """``plan_decode``'s ``options``: a :class:`flashgen.families.decode.Options`, None, or
        a full :class:`flashgen.Options` (its ``decode``; the rest of it that shapes decode
        units, ``exact_softmax``, must be the op's, whose kernels a plan runs).
        :class:`OpInputError` otherwise."""
        from flashgen.options import Options

        if isinstance(options, Options):
            if options.exact_softmax != self.op.options.exact_softmax:
                raise OpInputError(
                    f"options: exact_softmax={options.exact_softmax} differs from the op's "
                    f"({self.op.options.exact_softmax}); a plan runs the op's kernels: load the "
                    "op with it (flashgen.load(spec, options=...)) or pass options.decode"
                )
            return options.decode
        if options is not None and not isinstance(options, family.Options):
            raise OpInputError(
                f"options: expected flashgen.families.decode.Options (or a flashgen.Options, "
                f"whose .decode is used), got {type(options).__name__}"
            )
        return options

    def _check_plan(self, plan, dims: DecodeDims, device, splits: int,
                    k_cache_dtype: torch.dtype | None = None) -> None:  # fmt: skip
        """Refuse ``plan`` for a call it was not made for (:meth:`plan_decode`): another form
        (padded / ragged), batch, heads, Sq_new (ragged: a longer max_seqlen_q or more q rows
        than planned), paged or dense, append or not, a larger cache or another page size,
        device, cache dtype or num_splits.  :class:`OpInputError` naming what differs (for the
        cache dtype: the plan's and ``k_cache_dtype``, the call's k_cache's)."""
        if not isinstance(plan, DecodeCallPlan):
            raise OpInputError(
                f"plan: expected a plan from op.plan_decode, got {type(plan).__name__}"
            )
        if plan.owner is not self:
            made = getattr(getattr(plan.owner, "op", None), "qualname", "another op")
            raise OpInputError(
                f"plan: expected a plan from this op's plan_decode ({self.op.qualname}, "
                f"head_dim {self.spec.head_dim}), got one made by {made}'s"
            )
        p = plan.dims

        def form(d):
            return ("ragged calls (cu_seqlens_q, q [total_q, Hq, D]; plan_decode(total_q=...))"
                    if d.ragged else "padded calls (q [B, Hq, Sq_new, D])")  # fmt: skip

        if p.ragged != dims.ragged:
            raise OpInputError(f"plan: planned for {form(p)}, this call is one of {form(dims)}")
        pairs = [("batch", p.batch, dims.batch), ("num_heads", p.heads_q, dims.heads_q),
                 ("num_heads_kv", p.heads_kv, dims.heads_kv), ("paged", p.paged, dims.paged),
                 ("append", p.append, dims.append)]  # fmt: skip
        if not dims.ragged:
            pairs.insert(3, ("seqlen_q", p.seqlen_q, dims.seqlen_q))
        diff = [f"{n} {a} (this call: {b})" for n, a, b in pairs if a != b]
        if dims.ragged:  # the plan's grid and workspace bound the call's
            if dims.seqlen_q > p.seqlen_q:
                diff.append(f"max_seqlen_q at most {p.seqlen_q} (this call: {dims.seqlen_q})")
            if dims.total_q > p.total_q:
                diff.append(f"total_q at most {p.total_q} (this call's q rows: {dims.total_q})")
        if diff:
            raise OpInputError(f"plan: planned for {'; '.join(diff)}")
        if dims.capacity > p.capacity or (dims.paged and dims.page_size != p.page_size):
            raise OpInputError(
                f"plan: planned for a cache of {p.capacity} keys per request (page_size "
                f"{p.page_size}), this call has {dims.capacity} (page_size {dims.page_size})"
            )
        if plan.device != device:
            raise OpInputError(f"plan: planned for device {plan.device}, q is on {device}")
        if p.cache_dtype != dims.cache_dtype:
            planned = FP8_CACHE if p.cache_dtype else TORCH_DTYPE[self.spec.dtype]
            got = k_cache_dtype
            if got is None:
                got = FP8_CACHE if dims.cache_dtype else TORCH_DTYPE[self.spec.dtype]
            raise OpInputError(
                f"plan: planned for a {planned} cache (plan_decode's cache_dtype), this call's "
                f"k_cache has dtype {got}; plan_decode(..., cache_dtype="
                f"{FP8_CACHE if dims.cache_dtype else None}) plans for it"
            )
        if splits and splits != plan.num_splits:
            raise OpInputError(
                f"num_splits: the plan fixes {plan.num_splits}, this call asks for {splits}"
            )

    # ------------------------------------------------------------------ per-call plans
    def kernels(self, device: torch.device, options: family.Options | None = None,
                ragged: bool = False, cache_dtype: str | None = None) -> dict:  # fmt: skip
        """The unit's loaded kernels on CUDA ``device`` (``attn``, ``append``) for the unit
        knobs of ``options`` (default: the head dim's), built through the cache on first use;
        ``ragged``: the ragged-Sq_new unit; ``cache_dtype``: the e4m3-cache unit for
        ``"fp8_e4m3"``."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        options = options or self.op.options.decode
        key = (index, options.unit_key()) + (("ragged",) if ragged else ())
        if cache_dtype is not None:
            key += (cache_dtype,)
        hit = self._units.get(key)
        if hit is not None:
            return hit
        with self._lock:
            hit = self._units.get(key)
            if hit is None:
                from flashgen.build import cache
                from flashgen.build.render import render
                from flashgen.runtime import launch as runtime

                target = target_for_device(self.spec, torch.device("cuda", index))
                why = family.mla_wgmma_fallback(self.spec, target, options, cache_dtype)
                if why is not None:  # asked for the Hopper MLA unit, which does not serve this
                    warnings.warn(why, stacklevel=3)
                p = registry.plan_decode(
                    self.spec, target, dataclasses.replace(self.op.options, decode=options),
                    ragged=ragged, cache_dtype=cache_dtype,
                )  # fmt: skip
                cubin, report = cache.get_or_build(render(p), p)
                hit = {r: runtime.load(cubin, p.kernel(r), index) for r in ("attn", "append")}
                hit["report"] = report
                self._units[key] = hit
        return hit

    def plan_for(
        self, dims: DecodeDims, device, num_splits: int | None, *, pack_gqa: bool = True,
        own_workspace: bool = False, options: family.Options | None = None,
        params: dict | None = None,
    ) -> DecodeCallPlan:  # fmt: skip
        """A :class:`DecodeCallPlan` for ``dims`` on ``device`` (see :meth:`plan_decode`);
        ``options`` None: the op's ``Options.decode``; ``params``: the mask's scalar params
        the split count is sized for (the spec's defaults where missing)."""
        options = options or self.op.options.decode
        pack_gqa = pack_gqa and options.pack_gqa
        if num_splits is None:
            num_splits = options.num_splits
        mla_unit = None
        if self.spec.v_from_k:  # MLA: the unit of this shape (options' "auto" resolved here)
            mla_unit = self._mla_unit(dims, device, options, pack_gqa, params)
            if options.mla_unit == "auto":
                options = dataclasses.replace(options, mla_unit=mla_unit)
        kern = (
            self.kernels(device, options, dims.ragged, dims.cache_dtype)
            if device.type == "cuda" else {}
        )  # fmt: skip
        try:
            unit = kern["attn"].plan if kern else registry.plan_decode(
                self.spec, "sm_80", dataclasses.replace(self.op.options, decode=options),
                cache_dtype=dims.cache_dtype,
            )  # fmt: skip
        except family.DecodeTilesError as e:  # the CPU plans as the smallest target
            raise OpInputError(
                f"options: {e} (a plan on the CPU is made for sm_80, the target whose limits "
                "every decode unit must meet to run there)"
            ) from None
        heads = dims.heads_kv if pack_gqa else dims.heads_q
        live_blocks = None
        g0 = family.geometry(
            unit, batch=dims.batch, heads_q=dims.heads_q, heads_kv=dims.heads_kv,
            seqlen_q=dims.seqlen_q, num_splits=1, pack_gqa=pack_gqa,
        )  # fmt: skip
        if num_splits is None:
            sms = _sm_count(device.index if device.index is not None else 0) if kern else 132
            live_blocks = self._live_blocks(dims, unit.tiles.block_n, params)
            num_splits = family.choose_num_splits(
                unit, batch=dims.batch, heads_kv_ctas=heads, m_blocks=g0.m_blocks,
                max_seqlen_k=dims.capacity, num_sms=sms, live_blocks=live_blocks,
                split_waves=options.split_waves, balance_waves=options.balance_waves,
            )  # fmt: skip
        geo = family.geometry(
            unit, batch=dims.batch, heads_q=dims.heads_q, heads_kv=dims.heads_kv,
            seqlen_q=dims.seqlen_q, num_splits=num_splits, pack_gqa=pack_gqa,
        )  # fmt: skip
        rows = dims.heads_q * (dims.total_q if dims.ragged else dims.batch * dims.seqlen_q)
        o_part = lse_part = counters = None
        if own_workspace and num_splits > 1 and device.type == "cuda":
            o_part, lse_part, counters = _workspace(dims, geo, num_splits, device)
        fixed = {
            "max_pages": dims.max_pages, "num_pages": dims.num_pages, "page_size": dims.page_size,
            "batch": dims.batch, "heads_q": dims.heads_q, "heads_kv": dims.heads_kv,
            "seqlen_q": dims.seqlen_q, "num_splits": num_splits,
            "new_keys": dims.seqlen_q if dims.append else 0, "group": geo.group, "rows": rows,
        }  # fmt: skip
        if dims.ragged:  # new_keys: the append flag; each request appends its own Sq_b
            fixed["max_seqlen_q"] = fixed.pop("seqlen_q")
            fixed["new_keys"] = int(dims.append)
        plan = DecodeCallPlan(
            dims, num_splits, geo, device, kern, fixed, o_part, lse_part, pack_gqa, counters,
            options=options, live_blocks=live_blocks, owner=self, mla_unit=mla_unit,
        )  # fmt: skip
        if own_workspace and kern and rows > 0:
            plan.fast = _FastPath(self, plan)
        return plan

    def _mla_unit(self, dims: DecodeDims, device, options: family.Options, pack_gqa: bool,
                  params: dict | None) -> str:  # fmt: skip
        """The MLA unit (``"wgmma"`` / ``"mma_sync"``) of a ``v_from_k`` spec's call of
        ``dims`` on ``device`` under ``options``
        (:func:`flashgen.families.decode.mla_unit_for_call` for the CUDA device's target and
        SM count; the CPU plans for sm_80: the mma.sync unit).  Memoized per op in ``_mla``:
        each device's target and SM count, and the Hopper unit's plan that the ``"auto"``
        rule reads (pure Python, nothing compiled)."""
        if device.type != "cuda":
            return "mma_sync"
        index = device.index if device.index is not None else torch.cuda.current_device()
        where = self._mla.get(index)
        if where is None:
            target = target_for_device(self.spec, torch.device("cuda", index))
            where = self._mla[index] = (target, _sm_count(index))
        target, sms = where
        wgmma = live_blocks = None
        if options.mla_unit == "auto" and (
            family.mla_wgmma_support(self.spec, target, dims.cache_dtype) is None
        ):
            key = (target, options.min_split_blocks, dims.ragged)
            wgmma = self._mla.get(key)
            if wgmma is None:
                wgmma = self._mla[key] = family.plan(
                    self.spec, target, dataclasses.replace(options, mla_unit="wgmma"),
                    ragged=dims.ragged,
                )  # fmt: skip
            live_blocks = self._live_blocks(dims, wgmma.tiles.block_n, params)
        return family.mla_unit_for_call(
            self.spec, target, options, dims.cache_dtype, batch=dims.batch,
            heads_q=dims.heads_q, heads_kv=dims.heads_kv, seqlen_q=dims.seqlen_q,
            capacity=dims.capacity, num_sms=sms, pack_gqa=pack_gqa, live_blocks=live_blocks,
            wgmma=wgmma,
        )  # fmt: skip

    def _live_blocks(self, dims: DecodeDims, block_n: int, params: dict | None) -> int | None:
        """:func:`flashgen.families.decode.live_key_blocks`, memoized per op (an unplanned
        call plans on every call)."""
        key = (dims.capacity, dims.seqlen_q, block_n, tuple(sorted((params or {}).items())))
        hit = self._live.get(key, False)
        if hit is False:
            hit = family.live_key_blocks(
                self.spec, capacity=dims.capacity, seqlen_q=dims.seqlen_q, block_n=block_n,
                params=params,
            )  # fmt: skip
            if len(self._live) > 1024:
                self._live.clear()
            self._live[key] = hit
        return hit
