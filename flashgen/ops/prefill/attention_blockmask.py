"""The block-mask methods of :class:`~flashgen.ops.prefill.attention.AttentionOp`, for specs whose
mask reads tensor params (document masking and the like): building a reusable block table
(``op.block_mask``, FlexAttention's ``create_block_mask``), checking a ``block_mask=``
argument against a call, the CUDA block-table pre-pass and its kernel, the tables a
``BlockMask`` holds for the backward's tiles, and the launches' ``blk_tab / blk_sb /
blk_sh`` values.  The table itself, its reference and its tile checks are
:mod:`flashgen.ops.prefill.blockmask`'s.

:class:`BlockMaskMethods` is a mixin of :class:`~flashgen.ops.prefill.attention.AttentionOp`: it
reads the op's ``spec``, ``options``, ``base_name``, ``_kernels`` / ``_kernel_lock`` (the
loaded kernels) and calls its ``kernel`` and ``_tensor_map``.  Imports no other op module.
"""

from __future__ import annotations

import torch

from flashgen.analysis.derive import reads_param
from flashgen.codegen.abi import _per_spec, needs_block_table
from flashgen.families import registry
from flashgen.frontend.errors import OpInputError
from flashgen.ops.calls import _mask_reads, current_stream_ptr, kernel_values
from flashgen.ops.validation import (
    Dims,
    resolve_params,
    target_for_device,
    validate_tensor_params,
)


class BlockMaskMethods:
    """:class:`~flashgen.ops.prefill.attention.AttentionOp`'s block tables (module doc)."""

    def block_mask(
        self,
        seqlen_q: int,
        seqlen_k: int,
        *,
        batch: int | None = None,
        num_heads: int | None = None,
        num_heads_kv: int | None = None,
        device=None,
        **params,
    ):
        """Build the block table of this op's tensor-reading mask for one problem size,
        to reuse across :meth:`attention` calls (FlexAttention's ``create_block_mask``).

        ``params``: the spec's params by name, as for :meth:`attention`: the tensor params
        the mask reads are required, the others optional (checked if given, never kept: a
        score_mod's trained slopes need not be passed); scalars default to their declared
        values.  ``batch`` / ``num_heads`` / ``num_heads_kv`` default to what the given
        tensor params' declared shapes imply, else 1 (``num_heads_kv``: ``num_heads``); they
        only matter where the mask reads ``b`` / ``h`` / ``h_kv``, and ``num_heads`` must be
        a multiple of ``num_heads_kv``.  ``device`` defaults to the tensor params' device.
        On a CUDA device the generated pre-pass kernel builds the table for the forward
        kernel's tiles; on CPU the brute-force reference builds it.  The mask holds the
        tensor params its mask reads (the tensors themselves, not copies, with their
        ``_version``): a call must pass the same tensors, not written in place since, and a
        backward whose kernel classifies other tiles builds its table from them once and
        keeps it in the mask (:meth:`_held_table_arg`).  For calls with ``q_offset`` /
        ``kv_offset`` / ``seqlen_q_global`` / ``seqlen_k_global``, build it with
        ``op.offsets.block_mask(..., q_offset=..., ...)``.  A varlen op has none.

        Returns a :class:`~flashgen.ops.prefill.blockmask.BlockMask`.  Raises :class:`OpInputError`
        if the spec's mask reads no tensor param, or for bad sizes or params (naming the
        argument, the expected and the received value).
        """
        from flashgen.codegen.abi import block_table_dims
        from flashgen.ops.prefill.blockmask import BlockMask, TableInputs

        self._check_live()
        if not needs_block_table(self.spec):
            raise OpInputError(
                f"block_mask: the mask of op {self.spec.name!r} reads no tensor param, so it "
                f"needs no block table (its tiles are classified from indices)"
            )
        scalars, tensors = resolve_params(self.spec, params)
        tmap = self._tensor_map(tensors)
        read = _mask_tensor_params(self.spec)
        given = {"batch": batch, "num_heads": num_heads, "num_heads_kv": num_heads_kv}
        how = {d: "given" if n is not None else "the default" for d, n in given.items()}
        for p in self.spec.tensor_params:
            t = tmap.get(p.name)
            if isinstance(t, torch.Tensor) and t.dim() == len(p.shape):
                for d, n in zip(p.shape, t.shape, strict=True):
                    if d in given and given[d] is None:
                        given[d], how[d] = int(n), f"from {p.name}'s shape"
        sizes = {k: 1 if val is None else val for k, val in given.items()}
        if given["num_heads_kv"] is None:
            sizes["num_heads_kv"], how["num_heads_kv"] = sizes["num_heads"], "num_heads"
        for name, n in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k), *sizes.items()):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise OpInputError(f"{name}: expected a non-negative int, got {n!r}")
        hq, hkv = sizes["num_heads"], sizes["num_heads_kv"]
        if hkv == 0 and hq != 0:
            raise OpInputError(
                f"num_heads_kv: expected at least one kv head for num_heads = {hq} "
                f"({how['num_heads']}), got 0 ({how['num_heads_kv']})"
            )
        if hkv != 0 and hq % hkv != 0:
            raise OpInputError(
                f"num_heads: expected a multiple of num_heads_kv = {hkv} "
                f"({how['num_heads_kv']}), got {hq} ({how['num_heads']}); pass num_heads= "
                f"(the query heads of the calls it is for)"
            )
        # the tensor params the mask reads are required and held; the others, checked if given
        names = {n for n in tmap if n in read or tmap[n] is not None}
        first = next((tmap[n] for n in names if isinstance(tmap[n], torch.Tensor)), None)
        if device is None:
            device = first.device if first is not None else torch.device("cpu")
        device = torch.device(device)
        dims = Dims(
            sizes["batch"], sizes["num_heads"], sizes["num_heads_kv"], seqlen_q, seqlen_k, 0
        )
        validate_tensor_params(self.spec, tmap, device, dims.symbols(), "the block mask's device",
                               names=names)  # fmt: skip
        tmap = {n: tmap[n] for n in read}
        values = dict(zip((p.name for p in self.spec.scalar_params), scalars, strict=True))
        per_b, per_h = block_table_dims(self.spec)
        tiles = self.kernel(device).plan.tiles if device.type == "cuda" else self._cpu_tiles()
        table = self._pre_pass(device, tiles, dims, scalars, tmap)
        used = {p.name for p in self.spec.scalar_params if _mask_reads(self.spec, p.name)}
        return BlockMask(
            spec_name=self.base_name,  # any op of this spec may take it: the tiles must fit
            table=table,
            block_m=tiles.block_m,
            block_n=tiles.block_n,
            batch=dims.batch if per_b else 1,
            heads_q=dims.heads_q if per_h else 1,
            seqlen_q=seqlen_q,
            seqlen_k=seqlen_k,
            scalars={n: v for n, v in values.items() if n in used},
            heads_kv=dims.heads_kv if _mask_reads(self.spec, "h_kv") else None,
            inputs=TableInputs(dims, tuple(scalars), dict(tmap)),
        )

    def _cpu_tiles(self):
        """The tiles of a CPU table (``op.block_mask`` on CPU, and what the CPU op checks a
        ``block_mask`` argument against): the forward's on sm_80 under this op's options."""
        return registry.choose_tiles(self.spec, "sm_80", None, self.options)

    def _check_cpu_table(self, arg, dims: Dims) -> None:
        """Refuse a ``block_mask`` argument of the CPU op as the CUDA op refuses one for its
        kernel (:func:`~flashgen.ops.prefill.blockmask.table_for_tiles`), against
        :meth:`_cpu_tiles`: the CPU op evaluates the mask per pair and never reads the table,
        but takes the arguments the CUDA op takes."""
        from flashgen.families.blocktable import block_table_shape
        from flashgen.ops.prefill.blockmask import table_for_tiles

        tiles = self._cpu_tiles()
        shape = block_table_shape(
            self.spec, tiles, dims.batch, dims.heads_q, dims.seqlen_q, dims.seqlen_k
        )
        table_for_tiles(arg, shape, tiles)

    def _pre_pass(self, device, tiles, dims: Dims, scalars, tensors: dict):
        """The uint8 block table for ``tiles``
        (:func:`~flashgen.families.blocktable.block_table_shape`): on a CUDA device the
        generated pre-pass (:meth:`_run_block_table`, current stream), elsewhere the
        brute-force reference (:func:`~flashgen.ops.prefill.blockmask.block_table_reference`).
        The one place a table is built: ``op.block_mask``'s, a call's without ``block_mask``
        and the tables a :class:`~flashgen.ops.prefill.blockmask.BlockMask` holds."""
        if device.type == "cuda":
            return self._run_block_table(device, tiles, dims, scalars, tensors)
        from flashgen.ops.prefill.blockmask import block_table_reference

        values = dict(zip((p.name for p in self.spec.scalar_params), scalars, strict=True))
        return block_table_reference(
            self.spec, tiles, batch=dims.batch, heads_q=dims.heads_q, seqlen_q=dims.seqlen_q,
            seqlen_k=dims.seqlen_k, params={**values, **tensors}, device=device,
            heads_kv=dims.heads_kv,
        )  # fmt: skip

    def _held_table_arg(self, bm, tiles):
        """The ``block_mask`` argument (:func:`~flashgen.ops.prefill.blockmask.table_arg`) of a
        kernel of ``tiles`` from the tables ``bm`` holds: the one for those tiles, built on
        first use by :meth:`_pre_pass` from the params ``bm`` was built with and held from
        then on (:meth:`BlockMask.held <flashgen.ops.prefill.blockmask.BlockMask.held>`).  A
        table built on one stream is waited for by a call on another (the fence of its
        build).  None where ``bm`` cannot give one: built without its inputs, or, while this
        call is captured into a CUDA graph, a table not yet held (a build in the capture
        would exist only in the graph's replays) or one built on another stream (no wait on
        it can be captured); the launch then runs the pre-pass itself, as without
        ``block_mask``.  A table used on another stream than its build's is also
        ``record_stream``-ed there, so the caching allocator does not hand its memory out
        again, once ``bm`` and its tables are dropped, before that stream's kernels are done
        with it.  Raises :class:`OpInputError` if a tensor ``bm`` holds was written in place
        since it was built (:func:`_check_unchanged`)."""
        from flashgen.ops.prefill.blockmask import table_arg, table_key

        device = bm.table.device
        cuda = device.type == "cuda"
        if bm.inputs is None:
            return None
        _check_unchanged(bm)
        if cuda and torch.cuda.is_current_stream_capturing():
            table, fence = bm.tables.get(table_key(tiles.block_m, tiles.block_n), (None, None))
            if table is None or (fence is not None and fence[0] != current_stream_ptr(device)):
                return None
            return table_arg(table, tiles.block_m, tiles.block_n)

        def build():
            src = bm.inputs
            table = self._pre_pass(device, tiles, src.dims, list(src.scalars), src.tensors)
            if not cuda:
                return table, None
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            return table, (current_stream_ptr(device), event)

        table, fence = bm.held(tiles.block_m, tiles.block_n, build)
        if fence is not None and fence[0] != current_stream_ptr(device):
            stream = torch.cuda.current_stream(device)
            stream.wait_event(fence[1])  # the build's kernel is done before this stream's
            table.record_stream(stream)  # ... and the memory outlives this stream's use
        return table_arg(table, tiles.block_m, tiles.block_n)

    def _block_mask_table(self, bm, q, dims: Dims, scalars, tensors: dict | None = None):
        """The table tensor of ``bm`` after checking it fits this call (metadata only): the
        spec, the sizes its table's axes depend on, the scalar params its mask reads, the
        device and, for a mask built with its inputs, the tensor params its mask reads
        (``tensors`` by name: the same tensors, by storage, storage offset, shape and
        strides, and none written in place since ``bm`` was built, by their ``_version``;
        contents are never read).  Under ``torch.compile`` tracing the tensor checks are
        skipped (a traced tensor has no storage or version to compare)."""
        from flashgen.codegen.abi import block_table_dims
        from flashgen.ops.prefill.blockmask import BlockMask

        if not needs_block_table(self.spec):
            raise OpInputError(
                f"block_mask: op {self.spec.name!r} takes none (its mask reads no tensor "
                f"param), got {type(bm).__name__}"
            )
        if not isinstance(bm, BlockMask):
            raise OpInputError(
                f"block_mask: expected a BlockMask from op.block_mask(...), got {type(bm).__name__}"
            )
        if bm.spec_name != self.base_name:  # ops of one spec under other options: tiles
            raise OpInputError(_other_spec(self, bm))
        want = (dims.seqlen_q, dims.seqlen_k)
        if (bm.seqlen_q, bm.seqlen_k) != want:
            raise OpInputError(
                f"block_mask: expected (seqlen_q, seqlen_k) = {want} (q's and k's), got "
                f"({bm.seqlen_q}, {bm.seqlen_k}); build one per problem size"
            )
        per_b, per_h = block_table_dims(self.spec)
        if per_b and bm.batch != dims.batch:
            raise OpInputError(
                f"block_mask: built for batch={bm.batch} (the mask reads b), but q has batch "
                f"{dims.batch}; build one per batch size"
            )
        if per_h and bm.heads_q != dims.heads_q:
            raise OpInputError(
                f"block_mask: built for num_heads={bm.heads_q} (the mask reads h), but q has "
                f"{dims.heads_q} heads; build one per head count"
            )
        if bm.heads_kv is not None and bm.heads_kv != dims.heads_kv:
            raise OpInputError(
                f"block_mask: built for num_heads_kv={bm.heads_kv} (the mask reads h_kv), but "
                f"k has {dims.heads_kv} heads; build one per head count"
            )
        values = dict(zip((p.name for p in self.spec.scalar_params), scalars, strict=True))
        for name, val in bm.scalars.items():
            if values[name] != val:
                raise OpInputError(
                    f"block_mask: built with {name}={val!r}, but this call has "
                    f"{name}={values[name]!r}; build it again with the new value"
                )
        if bm.table.device != q.device:
            raise OpInputError(
                f"block_mask: expected device {q.device} (q's device), got {bm.table.device}"
            )
        if bm.inputs is not None and tensors is not None and not torch.compiler.is_compiling():
            for name in _mask_tensor_params(self.spec):
                built, got = bm.inputs.tensors.get(name), tensors.get(name)
                if not _same_tensor(built, got):
                    raise OpInputError(
                        f"block_mask: built with {name} = {_describe(built)}, but this call has "
                        f"{name} = {_describe(got)}; its tables hold only for the tensors it "
                        f"was built with (their contents are not compared: that needs a device "
                        f"sync), so pass those or build it again with op.block_mask(...)"
                    )
            _check_unchanged(bm)
        return bm.op_arg()  # carries its tiles: the CUDA impl checks them against its kernel's

    def _run_block_table(self, device, tiles, dims: Dims, scalars, tensors: dict):
        """Launch the block-table pre-pass for ``tiles`` on ``device`` (current stream);
        returns the uint8 table (see :func:`flashgen.families.registry.plan_block_table`)."""
        from flashgen.families.blocktable import block_table_shape

        kern = self._block_table_kernel(device, tiles)
        shape = block_table_shape(
            self.spec, tiles, dims.batch, dims.heads_q, dims.seqlen_q, dims.seqlen_k
        )
        table = torch.empty(shape, dtype=torch.uint8, device=device)
        if table.numel() == 0:
            return table
        values = kernel_values(self.spec, {"tab": table}, dims, 1.0, scalars, tensors)
        values.update(tab_b=shape[0], tab_h=shape[1])
        kern.launch((table.numel(), 1, 1), values, current_stream_ptr(device))
        return table

    def _block_table_kernel(self, device, tiles):
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = ("blockmask", index, tiles)
        kern = self._kernels.get(key)
        if kern is None:
            with self._kernel_lock:
                kern = self._kernels.get(key)
                if kern is None:
                    from flashgen.build import cache
                    from flashgen.build.render import render
                    from flashgen.families.registry import plan_block_table
                    from flashgen.runtime import launch as runtime

                    plan = plan_block_table(self.spec, target_for_device(self.spec, device), tiles)
                    cubin, _report = cache.get_or_build(render(plan), plan)
                    kern = runtime.load(cubin, plan, index)
                    self._kernels[key] = kern
        return kern

    def _table_values(self, arg, tiles, dims: Dims, scalars, tensors: dict, device) -> dict:
        """``blk_tab / blk_sb / blk_sh`` for a launch whose kernel runs ``tiles`` (the forward's,
        or the Hopper backward's under ``hopper_bwd.tensor_masks``): the table of the
        ``block_mask`` argument ``arg`` (a ``BlockMask``'s forward table or one it holds for
        the backward's tiles; refused unless built for those tiles and this call's sizes, see
        :func:`flashgen.ops.prefill.blockmask.table_for_tiles`) or, when None, a fresh one from
        the pre-pass for those tiles (:meth:`_pre_pass`)."""
        from flashgen.families.blocktable import block_table_shape
        from flashgen.ops.prefill.blockmask import table_for_tiles, table_strides

        shape = block_table_shape(
            self.spec, tiles, dims.batch, dims.heads_q, dims.seqlen_q, dims.seqlen_k
        )
        if arg is None:
            table = self._pre_pass(device, tiles, dims, scalars, tensors)
        else:
            table = table_for_tiles(arg, shape, tiles)
        sb, sh = table_strides(self.spec, table)
        return {"blk_tab": table, "blk_sb": sb, "blk_sh": sh}


def _mask_tensor_params(spec) -> tuple[str, ...]:
    """The tensor params ``spec``'s mask reads (spec order): what its block table depends on
    (:func:`flashgen.analysis.derive.reads_param` of the mask), remembered on the spec."""
    return _per_spec(
        spec, "mask_tensor_params",
        lambda: tuple(p.name for p in spec.tensor_params if reads_param(spec.mask, p.name)),
    )  # fmt: skip


def _check_unchanged(bm) -> None:
    """Raise :class:`OpInputError` if a tensor param ``bm`` holds was written in place since
    ``bm`` was built (its ``_version`` moved: ``copy_``, an indexed assignment, an in-place
    op on it or on a view sharing its version counter): its tables classify the old
    contents.  Host metadata only, no device sync; inference tensors track no version and
    are not checked."""
    for name, built, now in bm.inputs.changed():
        raise OpInputError(
            f"block_mask: built when {name} was at version {built} (its _version), but {name} "
            f"is now at version {now}: written in place since, so the block tables may not "
            f"match its contents; rebuild with op.block_mask(...) after changing it"
        )


def _other_spec(op, bm) -> str:
    """The message refusing ``bm`` (built by an op of spec ``bm.spec_name``) for ``op``: which
    method builds one for this call where an ``op.offsets`` form is involved."""
    from flashgen.frontend.offsets import OFFSET_PARAMS, SUFFIX

    given = ", ".join(OFFSET_PARAMS)
    if op._offsets_form and bm.spec_name + SUFFIX == op.base_name:
        return (
            f"block_mask: built by op.block_mask(...) for calls without offsets, but this call "
            f"has global positions ({given}: it runs op.offsets); build one for it with "
            f"op.offsets.block_mask(seqlen_q, seqlen_k, ..., q_offset=..., kv_offset=..., "
            f"seqlen_q_global=..., seqlen_k_global=...) and this call's values"
        )
    if not op._offsets_form and bm.spec_name == op.base_name + SUFFIX:
        built = ", ".join(f"{n}={bm.scalars[n]}" for n in OFFSET_PARAMS if n in bm.scalars)
        return (
            f"block_mask: built by op.offsets.block_mask(...) ({built or 'with offsets'}), but "
            f"this call has none of {given}; pass the values it was built with, or build one "
            f"with op.block_mask(...) for calls without offsets"
        )
    return (
        f"block_mask: expected one built by an op of spec {op.base_name!r}, got one built by "
        f"{bm.spec_name!r}"
    )


def _same_tensor(a, b) -> bool:
    """Whether ``a`` and ``b`` are the same tensor's elements: one object, or views of one
    storage at the same address with the same shape, strides, dtype and device (no sync)."""
    if a is b:
        return True
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


def _describe(t) -> str:
    """``t``'s dtype, shape, strides, storage offset, address and device (what
    :func:`_same_tensor` compares), or its repr."""
    if not isinstance(t, torch.Tensor):
        return repr(t)
    dtype = str(t.dtype).removeprefix("torch.")
    return (
        f"{dtype} {list(t.shape)} strides {list(t.stride())} storage offset "
        f"{t.storage_offset()} at {t.data_ptr():#x} on {t.device}"
    )
