"""The planned decode call's layout check (:mod:`flashgen.ops.decode.fast`): a call whose
tensors and scalars match the validated layout skips validation (the layout's guard), and
anything that changes between calls, the same tensor object included, is either packed
anew (addresses, a stride the layout accepts) or refused with the general path's error;
the launch through the argument-type-free driver entry point
(:func:`flashgen.runtime.packed.raw_launcher`) passes what the driver's prototype does."""

from __future__ import annotations

import ctypes

import pytest
import torch
from fast_plan import faked_fast_plan, launched_args

import flashgen
from flashgen.frontend.errors import OpInputError
from flashgen.ops.decode import fast as dfast
from flashgen.ops.decode.inputs import DecodeDims

B, HQ, HKV, PS, PAGES, D = 2, 8, 2, 16, 8, 128


def _count_prepares(monkeypatch) -> list:
    """A list that gets an item per full validation of a layout (``_FastPath._prepare``)."""
    prepared = []
    real = dfast._FastPath._prepare

    def counted(self, *a, **k):
        prepared.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(dfast._FastPath, "_prepare", counted)
    return prepared


def _append_plan(monkeypatch, **kw):
    """A paged plan (4 pages a request) with an append, its launches, the inputs of a call
    and a counter of the full validations (``_prepare`` calls)."""
    op = flashgen.load("llama3_gqa")
    plan, launches = faked_fast_plan(
        monkeypatch, op, DecodeDims(B, HQ, HKV, 1, D, True, PAGES, PS, 4, True), **kw
    )
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, HQ, 1, D, generator=g).to(torch.bfloat16)
    kn, vn = (torch.randn(B, HKV, 1, D, generator=g).to(torch.bfloat16) for _ in range(2))
    args = dict(q=q, cache_seqlens=torch.tensor([5, 20], dtype=torch.int32),
                block_table=torch.arange(8, dtype=torch.int32).view(B, 4), k_new=kn,
                v_new=vn)  # fmt: skip
    prepared = _count_prepares(monkeypatch)

    def call(kc, vc, **more):
        return op.with_kvcache(k_cache=kc, v_cache=vc, plan=plan, **{**args, **more})

    return plan, launches, call, args, prepared


def _cache():
    return tuple(torch.zeros(PAGES, PS, HKV, D, dtype=torch.bfloat16) for _ in range(2))


def test_a_plan_reused_with_other_caches_of_the_layout_writes_into_them(monkeypatch):
    """The second call's caches are other tensors of the same layout: no validation, and
    both launches carry the new caches' addresses (the append writes into them)."""
    plan, launches, call, _, prepared = _append_plan(monkeypatch)
    kc, vc = _cache()
    call(kc, vc)
    kc2, vc2 = _cache()
    call(kc2, vc2)
    assert prepared == [1] and len(launches) == 4
    app, attn = (launched_args(lay, launches[i][3])
                 for i, lay in ((2, plan.fast.app_layout), (3, plan.fast.attn_layout)))  # fmt: skip
    assert (app["k_cache"], app["v_cache"]) == (kc2.data_ptr(), vc2.data_ptr())
    assert (attn["k_cache"], attn["v_cache"]) == (kc2.data_ptr(), vc2.data_ptr())


def test_the_same_tensor_object_changed_in_place_is_checked_again(monkeypatch):
    """Identity is not the layout: a block table moved to other memory (``set_``) is packed
    at its new address without validation; restrided in place to a row stride the kernel
    takes, it is validated and its stride packed; to a column stride it does not, refused
    with the general path's error; a q that now requires grad is refused too."""
    plan, launches, call, args, prepared = _append_plan(monkeypatch)
    kc, vc = _cache()
    table = args["block_table"]
    call(kc, vc)
    wide = torch.arange(16, dtype=torch.int32).view(B, 8)
    table.set_(wide.untyped_storage(), 0, (B, 4), (4, 1))  # same layout, other memory
    call(kc, vc)
    attn = launched_args(plan.fast.attn_layout, launches[-1][3])
    assert prepared == [1] and attn["block_table"] == wide.data_ptr() and attn["bt_sb"] == 4
    table.set_(wide.untyped_storage(), 0, (B, 4), (8, 1))  # rows 8 apart: accepted
    call(kc, vc)
    attn = launched_args(plan.fast.attn_layout, launches[-1][3])
    assert prepared == [1, 1] and attn["bt_sb"] == 8
    table.set_(wide.untyped_storage(), 0, (B, 4), (8, 2))
    with pytest.raises(OpInputError, match=r"block_table: expected stride\(-1\) == 1"):
        call(kc, vc)
    table.set_(wide.untyped_storage(), 0, (B, 4), (4, 1))
    args["q"].requires_grad_()
    with pytest.raises(OpInputError, match="q: expected a tensor that does not require grad"):
        call(kc, vc)
    assert len(launches) == 6  # nothing launched for the refused calls


def test_a_changed_dtype_or_shape_is_refused_with_the_general_paths_error(monkeypatch):
    plan, launches, call, args, prepared = _append_plan(monkeypatch)
    kc, vc = _cache()
    call(kc, vc)
    with pytest.raises(OpInputError, match="k_cache: expected dtype torch.bfloat16"):
        call(kc.half(), vc.half())
    with pytest.raises(OpInputError, match="v_cache: expected dtype torch.bfloat16"):
        call(kc, vc.half())
    with pytest.raises(OpInputError, match="cache_seqlens"):
        call(kc, vc, cache_seqlens=torch.tensor([5, 20, 1], dtype=torch.int32))
    call(kc, vc)  # the validated layout again: validated once more, launched
    assert len(launches) == 4 and len(prepared) == 5


def test_out_buffers_and_a_shared_cache_stay_on_the_guard(monkeypatch):
    """``out`` and ``k_cache is v_cache`` (no append) are part of the layout check: repeated
    calls validate once; a lazily negated ``out`` (the kernels would write its memory, the
    values read back negated) is refused, also after a call of its layout passed."""
    op = flashgen.load("llama3_gqa")
    plan, launches = faked_fast_plan(
        monkeypatch, op, DecodeDims(1, HQ, HKV, 1, D, True, PAGES, PS, 4, False)
    )
    prepared = _count_prepares(monkeypatch)
    q = torch.randn(1, HQ, 1, D).to(torch.bfloat16)
    kc = _cache()[0]
    kw = dict(cache_seqlens=torch.tensor([20], dtype=torch.int32),
              block_table=torch.arange(4, dtype=torch.int32).view(1, 4), plan=plan)  # fmt: skip
    out = (torch.empty(1, HQ, 1, D, dtype=torch.bfloat16), torch.empty(1, HQ, 1))
    for _ in range(3):
        assert op.with_kvcache(q, kc, kc, out=out, **kw) is out
    assert prepared == [1] and len(launches) == 3
    with pytest.raises(OpInputError, match=r"out\[0\]: expected a tensor whose memory holds"):
        op.with_kvcache(q, kc, kc, out=(torch._neg_view(out[0]), out[1]), **kw)
    with pytest.raises(OpInputError, match=r"out\[1\]: expected a tensor whose memory holds"):
        op.with_kvcache(q, kc, kc, out=(out[0], torch._neg_view(out[1])), **kw)
    assert len(launches) == 3


_RECORDING_DRIVER = r"""
#include <cstdint>
extern "C" {
uint64_t last[11];
int calls = 0, rc = 0;
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned smem, void *stream, void **params, void **extra) {
  uint64_t got[11] = {(uint64_t)f, gx, gy, gz, bx, by, bz, smem, (uint64_t)stream,
                      (uint64_t)params, (uint64_t)extra};
  for (int i = 0; i < 11; ++i) last[i] = got[i];
  ++calls;
  return rc;
}
int cuTensorMapEncodeTiled(void *, int, unsigned, void *, void *, void *, void *, void *, int,
                           int, int, int) {
  return 0;
}
}
"""


def test_the_raw_launcher_passes_what_the_prototype_does(monkeypatch, cxx_exe):
    """A C library standing in for the driver, with the driver's prototypes: the fast path's
    launch (no argument conversion by ctypes) hands it the kernel's handle, the plan's grid,
    block and shared memory, the current stream, the block's address array and null; a
    failed launch raises naming the kernel and the CUresult."""
    from flashgen.runtime import tma
    from flashgen.runtime.packed import raw_launcher

    lib = tma.set_prototypes(ctypes.CDLL(str(cxx_exe(_RECORDING_DRIVER, "libstub.so",
                                                     "-O1 -shared -fPIC"))))  # fmt: skip
    call_raw, handle = raw_launcher(lib.cuLaunchKernel)
    assert handle is ctypes.c_void_p and call_raw is not lib.cuLaunchKernel
    plan, _, call, _, _ = _append_plan(monkeypatch, driver=lib)
    kc, vc = _cache()
    call(kc, vc)
    last = (ctypes.c_uint64 * 11).in_dll(lib, "last")
    attn, st = plan.kernels["attn"].plan, plan.fast._state()
    want = (11, *plan.geometry.grid, attn.threads, 1, 1, attn.smem_bytes, 7,
            ctypes.addressof(st.attn_params), 0)  # fmt: skip
    assert tuple(last) == want and ctypes.c_int.in_dll(lib, "calls").value == 2
    ctypes.c_int.in_dll(lib, "rc").value = 700
    with pytest.raises(RuntimeError, match=r"cuLaunchKernel\(decode append\) failed: CUresult 700"):
        call(kc, vc)
