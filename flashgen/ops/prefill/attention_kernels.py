"""Which CUDA forward kernel an :class:`~flashgen.ops.prefill.attention.AttentionOp` runs, and
loading it: :meth:`KernelChoice.kernel` (built through the cache, loaded once per device and
options, the dense and the sparse-mask tiles together where the op may pick either) and the
per-call choice of the sparse-mask tiles (:meth:`KernelChoice._sparse_call`, from
:func:`flashgen.ops.prefill.density.keys_per_row`, cached per lengths and per length bucket).

:class:`KernelChoice` is a mixin of :class:`~flashgen.ops.prefill.attention.AttentionOp`: it reads
the op's ``spec``, ``options``, ``_kernels`` / ``_kernel_lock`` and the ``_sparse_*`` caches
its ``__init__`` sets.  Imports no other op module.
"""

from __future__ import annotations

import torch

from flashgen.families import registry
from flashgen.ops.prefill.density import bucket
from flashgen.ops.validation import Dims, target_for_device


class KernelChoice:
    """:class:`~flashgen.ops.prefill.attention.AttentionOp`'s forward kernels (module doc)."""

    def _sparse_call(self, dims: Dims, scalars) -> bool:
        """Whether this call asks for the sparse-mask tiles
        (:func:`flashgen.families.registry.sparse_tiles`; :meth:`kernel` runs them where the
        kernel has them): the mask keeps fewer than
        :data:`~flashgen.families.tiles.SPARSE_KEYS_PER_ROW` keys per query row at these lengths and
        scalars (:func:`flashgen.ops.prefill.density.keys_per_row`; the answer cached per op per
        lengths and per the lengths' :func:`~flashgen.ops.prefill.density.bucket`, keyed by the
        scalars the mask reads only: a loop over growing lengths (decoding) costs a few microseconds
        per call, a float param only the score_mod reads none).  Off with the op's
        ``Options.sparse_tiles`` False."""
        if not self._sparse_possible:
            return False
        read = tuple(scalars[i] for i in self._sparse_scalars) if self._sparse_scalars else ()
        key = (dims.seqlen_q, dims.seqlen_k, *read)
        few = self._sparse_calls.get(key)
        if few is None:  # a new length: its bucket's answer, estimated once per bucket
            few = self._sparse_bucketed(dims, scalars, read)
            if len(self._sparse_calls) >= 4096:  # bounded: a loop over many lengths
                self._sparse_calls.clear()
            self._sparse_calls[key] = few
        return few and self.options.sparse_tiles

    def _sparse_bucketed(self, dims: Dims, scalars, read: tuple) -> bool:
        key = (bucket(dims.seqlen_q), bucket(dims.seqlen_k), *read)
        few = self._sparse_buckets.get(key)
        if few is None:
            from flashgen.families.tiles import SPARSE_KEYS_PER_ROW
            from flashgen.ops.prefill.density import keys_per_row

            if len(self._sparse_buckets) >= 4096:  # bounded: a loop over many scalar values
                self._sparse_buckets.clear()
            few = keys_per_row(self.spec, dims.seqlen_q, dims.seqlen_k, tuple(scalars))
            few = self._sparse_buckets[key] = few < SPARSE_KEYS_PER_ROW
        return few

    def _sparse_key(self, base: tuple) -> tuple:
        """The cache key of the sparse kernel: ``base`` and its persistent scheduler (the op's
        ``Options.sparse_persistent``, where the op has a sparse kernel)."""
        sp = self.options.sparse_persistent
        sched = self._sparse_possible and (False if sp == "off" else sp)
        return base + ("sparse", sched)

    def kernel(self, device: torch.device, sparse: bool = False, block_descale: bool = False):
        """The loaded kernel for CUDA ``device`` (built and cached on first use).

        Renders the plan for :func:`target_for_device` (the family
        :func:`flashgen.families.registry.select` picks under the op's options), compiles
        through the on-disk cache, falling back to smaller tiles if the chosen ones spill
        (:mod:`flashgen.families.build`), and loads it with :mod:`flashgen.runtime.launch`.
        The op's :class:`~flashgen.options.Options` decide: ``family`` (``auto``, the
        default: the Hopper TMA + wgmma kernel on sm_90 where the spec allows; ``fa2``: the
        FA2-class kernel), ``persistent`` (the Hopper kernel's persistent tile scheduler,
        :func:`flashgen.families.registry.persistent_scheduler`; ``auto``: ``dynamic`` for a
        mask that reads tensors, else off) and ``side_terms``.  ``sparse``: the kernel with
        the tiles for masks that keep few keys per row
        (:func:`flashgen.families.registry.sparse_tiles`; the op's calls choose it per call,
        :meth:`_sparse_call`; not when the dense kernel is persistent), persistent as
        ``Options.sparse_persistent`` says, the same kernel as without where there are none
        (the FA2-class kernel).  Where the op may pick either, the
        first use builds and loads both, so a later call (a CUDA-graph capture at another
        length) never loads a kernel.  ``block_descale`` (fp8 ops): the kernel that reads
        per-block descales (:func:`flashgen.fp8.quantize` with ``block_rows=128``), built and
        loaded on the first call that passes them (warm it up before a CUDA-graph capture).
        Raises :class:`~flashgen.build.compile.CompileError` if nvcc fails, ``RuntimeError``
        if a reload of the edited spec replaced the op.
        """
        self._check_live()
        index = device.index if device.index is not None else torch.cuda.current_device()
        options = self.options
        persistent = registry.persistent_scheduler(self.spec, options)
        base = (index, options.key(), persistent)
        sparse = sparse and not persistent
        key = self._sparse_key(base) if sparse else base
        if block_descale:
            key = base + ("block_descale",)
        kern = self._kernels.get(key)
        if kern is not None:
            return kern
        if block_descale:
            return self._block_descale_kernel(device, index, key, persistent)
        with self._kernel_lock:
            kern = self._kernels.get(key)
            if kern is None:
                from flashgen.families.build import build_forward
                from flashgen.runtime import launch as runtime

                target = target_for_device(self.spec, device)
                gpu = torch.cuda.get_device_name(device)  # selects tuned tiles
                # Both tile choices at once where the op picks per call: a call at a length
                # that needs the other one (inside a CUDA-graph capture, say) loads nothing.
                both = self._sparse_possible and not persistent
                sparse_key = self._sparse_key(base)
                for want in (sparse, not sparse) if both else (sparse,):
                    k = sparse_key if want else base
                    if k not in self._kernels:
                        plan, cubin, _report = build_forward(
                            self.spec, target, gpu=gpu, options=options, sparse=want,
                            persistent=sparse_key[-1] if want else persistent,
                        )  # fmt: skip
                        self._kernels[k] = runtime.load(cubin, plan, index)
                kern = self._kernels[key]
        return kern

    def _block_descale_kernel(self, device: torch.device, index: int, key: tuple, persistent):
        """:meth:`kernel` with ``block_descale``: build (through the cache) and load the fp8
        forward that reads per-block descales, once per device and options."""
        with self._kernel_lock:
            kern = self._kernels.get(key)
            if kern is None:
                from flashgen.families.build import build_forward
                from flashgen.runtime import launch as runtime

                target = target_for_device(self.spec, device)
                gpu = torch.cuda.get_device_name(device)
                plan, cubin, _report = build_forward(
                    self.spec, target, gpu=gpu, options=self.options, persistent=persistent,
                    block_descale=True,
                )  # fmt: skip
                kern = self._kernels[key] = runtime.load(cubin, plan, index)
        return kern
