"""Issue 38 (trust, round 3), the serving API on CPU (:mod:`flashgen.ops.decode.op`): plans
carry their op's identity and their checks are tight (item 12), aliased caches and slot
collisions are refused before anything is written (item 3), ``with_kvcache`` never looks
differentiable (item 4), a failed call writes nothing (item 5), and ragged ``k_new`` shape
errors name the caller's shapes (the "Also:" list)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from fast_plan import faked_fast_plan

import flashgen
from flashgen.frontend.errors import OpInputError

ROOT = Path(__file__).resolve().parents[2]
SPEC = "name: {name}\nhead_dim: {d}\ndtype: bf16\nmask: causal\n"


def _load(tmp_path, name, d=64, text=None):
    path = tmp_path / f"{name}.yaml"
    path.write_text(text or SPEC.format(name=name, d=d))
    return flashgen.load(path)


def _paged(batch=2, hkv=2, d=64, page_size=4, num_pages=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(num_pages, page_size, hkv, d, generator=g).to(torch.bfloat16)
    vc = torch.randn(num_pages, page_size, hkv, d, generator=g).to(torch.bfloat16)
    return kc, vc


# ----------------------------------------------------------------------------- item 12
def test_plan_decode_refuses_bad_page_counts_and_unknown_devices(tmp_path):
    op = _load(tmp_path, "trust_plan_checks")
    base = dict(batch=1, num_heads=2, num_heads_kv=2, cache_capacity=16, device="cpu")
    for num_pages in (0, -3, 2.0, True):
        with pytest.raises(OpInputError, match="num_pages"):
            op.plan_decode(**base, page_size=4, num_pages=num_pages)
    for num_pages in (0, -3, 4):  # without page_size (a dense plan) it was dropped silently
        with pytest.raises(OpInputError, match="^num_pages: expected None for a dense cache"):
            op.plan_decode(**base, num_pages=num_pages)
    for device in ("xla", "mps", "meta"):
        with pytest.raises(OpInputError, match="device: expected 'cpu' or a CUDA device"):
            op.plan_decode(**{**base, "device": device})
    with pytest.raises(OpInputError, match="device"):
        op.plan_decode(**{**base, "device": "no-such-device"})
    assert op.plan_decode(**base, page_size=4, num_pages=1).dims.num_pages == 1


def test_a_plan_of_another_op_is_refused(tmp_path):
    """A plan made by another op (here another head_dim) was accepted by ``with_kvcache``;
    plans carry their op and other ops refuse them."""
    a = _load(tmp_path, "trust_plan_a", d=64)
    b = _load(tmp_path, "trust_plan_b", d=128)
    c = _load(tmp_path, "trust_plan_c", d=64)  # the same shapes, another op
    plan_b = b.plan_decode(batch=1, num_heads=2, num_heads_kv=2, cache_capacity=8, device="cpu")
    plan_c = c.plan_decode(batch=1, num_heads=2, num_heads_kv=2, cache_capacity=8, device="cpu")
    q = torch.randn(1, 2, 1, 64).to(torch.bfloat16)
    kc = torch.randn(1, 2, 8, 64).to(torch.bfloat16)
    lens = torch.tensor([5], dtype=torch.int32)
    for plan, other in ((plan_b, "trust_plan_b"), (plan_c, "trust_plan_c")):
        with pytest.raises(OpInputError, match=f"plan: expected a plan from this op's.*{other}"):
            a.with_kvcache(q, kc, kc.clone(), lens, plan=plan)
    mine = a.plan_decode(batch=1, num_heads=2, num_heads_kv=2, cache_capacity=8, device="cpu")
    o, _ = a.with_kvcache(q, kc, kc.clone(), lens, plan=mine)
    assert torch.equal(o, a.with_kvcache(q, kc, kc.clone(), lens)[0])


# ----------------------------------------------------------------------------- item 3
def _append_call(op, kc, vc, table, lens, *, sq=1, hq=2, hkv=2, d=64, seed=1, **kw):
    g = torch.Generator().manual_seed(seed)
    batch = len(lens)
    q = torch.randn(batch, hq, sq, d, generator=g).to(torch.bfloat16)
    kn = torch.randn(batch, hkv, sq, d, generator=g).to(torch.bfloat16)
    vn = torch.randn(batch, hkv, sq, d, generator=g).to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    args = dict(block_table=table, k_new=kn, v_new=vn, **kw)
    return lambda: op.with_kvcache(q, kc, vc, lens_t, **args), (q, kn, vn, lens_t)


def test_aliased_caches_are_refused_before_an_append(tmp_path):
    """``k_cache is v_cache``, an expanded (stride-0) cache and k_new inside the cache were
    written through: one request's keys landed in another's slots (or the values over the
    keys) and were attended.  Refused from metadata now, the caches untouched."""
    op = _load(tmp_path, "trust_alias")
    kc, vc = _paged()
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    before = kc.clone()
    call, _ = _append_call(op, kc, kc, table, [3, 2])
    with pytest.raises(OpInputError, match=r"v_cache: expected memory apart from k_cache.*is"):
        call()
    expanded = kc[:1].expand(8, -1, -1, -1)
    call, _ = _append_call(op, expanded, vc, table, [3, 2])
    with pytest.raises(OpInputError, match="k_cache: expected a cache whose elements have their"):
        call()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 1, 64, generator=g).to(torch.bfloat16)
    lens = torch.tensor([3, 2], dtype=torch.int32)
    with pytest.raises(OpInputError, match="k_new: expected memory apart from k_cache"):
        op.with_kvcache(q, kc, vc, lens, block_table=table, k_new=kc[4:6, :1].permute(0, 2, 1, 3),
                        v_new=torch.zeros(2, 2, 1, 64, dtype=torch.bfloat16))  # fmt: skip
    assert torch.equal(kc, before)
    # without an append nothing is written: one buffer read as both is fine
    o, _ = op.with_kvcache(q, kc, kc, lens, block_table=table)
    assert torch.isfinite(o.float()).all()


def test_interleaved_views_of_one_kv_buffer_may_append(tmp_path):
    """FlashInfer's combined layout ``[num_pages, 2, page_size, Hkv, D]``: ``kv[:, 0]`` and
    ``kv[:, 1]`` interleave page by page but share no element (the exact check, not the
    hulls), so an append through them is allowed and equals separate caches."""
    op = _load(tmp_path, "trust_kv_buffer")
    kc, vc = _paged()
    kv = torch.stack([kc, vc], dim=1)  # [8, 2, 4, 2, 64]
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    call_a, _ = _append_call(op, kv[:, 0], kv[:, 1], table, [3, 2])
    call_b, _ = _append_call(op, kc, vc, table, [3, 2])
    oa, la = call_a()
    ob, lb = call_b()
    assert torch.equal(oa, ob) and torch.equal(la, lb)
    assert torch.equal(kv[:, 0], kc) and torch.equal(kv[:, 1], vc)


def test_a_planned_call_refuses_aliased_memory_on_every_call(tmp_path, monkeypatch):
    """The planned fast path validated a call layout (shapes, strides, dtypes) once and
    then only swapped addresses: a later call of the same layout with ``k_cache is
    v_cache``, or an ``out`` that is a view of the cache, appended v_new over the keys or
    wrote o into the cache.  Each call's addresses are checked now (the general path names
    the overlap); the interleaved halves of one KV buffer stay on the fast path."""
    from flashgen.ops.decode.inputs import DecodeDims

    op = flashgen.load("llama3_gqa")
    b, hq, hkv, ps, pages = 2, 8, 2, 16, 8
    plan, launches = faked_fast_plan(
        monkeypatch, op, DecodeDims(b, hq, hkv, 1, 128, True, pages, ps, 4, True)
    )
    g = torch.Generator().manual_seed(5)
    q = torch.randn(b, hq, 1, 128, generator=g).to(torch.bfloat16)
    kv = torch.zeros(pages, 2, ps, hkv, 128, dtype=torch.bfloat16)  # FlashInfer's layout
    kc, vc = kv[:, 0], kv[:, 1]
    lens = torch.tensor([5, 20], dtype=torch.int32)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    kn, vn = (torch.randn(b, hkv, 1, 128, generator=g).to(torch.bfloat16) for _ in range(2))

    def call(k_cache, v_cache, **kw):
        return op.with_kvcache(q, k_cache, v_cache, lens, block_table=table, k_new=kn,
                               v_new=vn, plan=plan, **kw)  # fmt: skip

    for _ in range(2):  # apart: the fast path launches the append and the attention
        call(kc, vc)
    assert len(launches) == 4
    same = torch.zeros(pages, 2, ps, hkv, 128, dtype=torch.bfloat16)[:, 0]  # kc's layout
    with pytest.raises(OpInputError, match=r"v_cache: expected memory apart from k_cache"):
        call(same, same)
    assert len(launches) == 4  # nothing was launched (the faked kernels write nothing)
    out = (torch.empty(b, hq, 1, 128, dtype=torch.bfloat16), torch.empty(b, hq, 1))
    call(kc, vc, out=out)
    into = (kv.view(-1)[: out[0].numel()].view(out[0].shape), out[1])  # out's layout
    with pytest.raises(OpInputError, match=r"out\[0\]: expected memory that no input shares"):
        call(kc, vc, out=into)
    assert len(launches) == 6


@pytest.mark.parametrize(
    "lens, table, why",
    [
        ([2, 2], [[0], [0]], "request 0 appends its key 2 to page 0 slot 2, where request 1 "
                             "appends its key 2"),
        ([3, 2], [[0], [0]], "request 1 appends its key 2 to page 0 slot 2, where request 0 "
                             "reads its key 2"),
        ([1, 6], [[1, 2], [0, 1]], "request 0 appends its key 1 to page 1 slot 1, where "
                                   "request 1 reads its key 5"),
        ([4, 1], [[0, 0], [3, 4]], "request 0 appends its key 4 to page 0 slot 0, where "
                                   "request 0 reads its key 0"),
    ],
)
def test_appends_that_collide_in_a_slot_are_refused(tmp_path, lens, table, why):
    """A block table that sends an append into a slot another key of the call uses (two
    requests' appends, or an append over a key some request reads) wrote one request's
    keys into another's cache and attended them; refused from values, nothing written."""
    op = _load(tmp_path, "trust_slots")
    kc, vc = _paged()
    before = (kc.clone(), vc.clone())
    call, _ = _append_call(op, kc, vc, torch.tensor(table, dtype=torch.int32), lens)
    with pytest.raises(OpInputError, match="block_table: " + why):
        call()
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_pages_shared_read_only_and_empty_appends_are_allowed(tmp_path):
    """A common prefix page read by both requests, each appending to its own page; and a
    ragged request that appends nothing sharing the page another appends to, reading only
    below the append."""
    op = _load(tmp_path, "trust_shared")
    kc, vc = _paged()
    table = torch.tensor([[0, 1], [0, 2]], dtype=torch.int32)
    call, (q, kn, vn, lens) = _append_call(op, kc, vc, table, [4, 4])
    o, _ = call()
    for b in range(2):  # each request alone: its own append, the same answer
        kc2, vc2 = _paged()
        ob, _ = op.with_kvcache(q[b : b + 1], kc2, vc2, lens[b : b + 1],
                                block_table=table[b : b + 1], k_new=kn[b : b + 1],
                                v_new=vn[b : b + 1])  # fmt: skip
        assert torch.equal(o[b : b + 1], ob)
    kc, vc = _paged()
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 64, generator=g).to(torch.bfloat16)  # ragged: total_q = 1
    kn = torch.randn(1, 2, 64, generator=g).to(torch.bfloat16)
    cu = torch.tensor([0, 1, 1], dtype=torch.int32)  # request 1 appends nothing
    table = torch.tensor([[0], [0]], dtype=torch.int32)
    op.with_kvcache(q, kc, vc, torch.tensor([2, 2], dtype=torch.int32), block_table=table,
                    cu_seqlens_q=cu, k_new=kn, v_new=kn.clone())  # fmt: skip
    with pytest.raises(OpInputError, match="where request 1 reads its key 2"):
        op.with_kvcache(q, kc, vc, torch.tensor([2, 3], dtype=torch.int32), block_table=table,
                        cu_seqlens_q=cu, k_new=kn, v_new=kn.clone())  # fmt: skip


# ----------------------------------------------------------------------------- item 4
def test_with_kvcache_refuses_inputs_that_require_grad(tmp_path):
    """``o.requires_grad`` was True and ``backward()`` left ``q.grad`` None (a torch
    deprecation warning only): with_kvcache has no backward, so it refuses at the call,
    naming the argument."""
    op = _load(tmp_path, "trust_grad")
    q = torch.randn(1, 2, 1, 64).to(torch.bfloat16)
    kc = torch.randn(1, 2, 8, 64).to(torch.bfloat16)
    lens = torch.tensor([5], dtype=torch.int32)
    kn = torch.randn(1, 2, 1, 64).to(torch.bfloat16)
    with pytest.raises(OpInputError, match="q: expected a tensor that does not require grad"):
        op.with_kvcache(q.requires_grad_(), kc, kc.clone(), lens)
    q = q.detach()
    with pytest.raises(OpInputError, match="v_new: expected a tensor that does not require"):
        op.with_kvcache(q, kc, kc.clone(), lens, k_new=kn, v_new=kn.clone().requires_grad_())
    with torch.no_grad():  # serving code: fine
        o, _ = op.with_kvcache(q.requires_grad_(), kc, kc.clone(), lens)
    assert not o.requires_grad


def test_the_registered_decode_ops_refuse_inputs_that_require_grad(tmp_path):
    """The torch ops under ``with_kvcache`` (``torch.ops.flashgen.<name>__with_kvcache*``,
    named in docs/serving.md) had no autograd kernel: torch's fallback gave an ``o`` that
    required grad and ``q.grad`` None after ``backward()`` (a deprecation warning only).
    They refuse at the call now, naming the argument, before the append writes."""
    from flashgen.ops.decode.op import decode_op

    op = _load(tmp_path, "trust_grad_ops")
    dop = decode_op(op)
    kc, vc = _paged()
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([3, 2], dtype=torch.int32)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 2, 1, 64, generator=g).to(torch.bfloat16)
    kn, vn = (torch.randn(2, 2, 1, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    scale = 64**-0.5
    with pytest.raises(OpInputError, match="^q: expected a tensor that does not require grad"):
        dop.torch_op(False)(q.clone().requires_grad_(), kc, vc, lens, table, scale, 0)
    before = (kc.clone(), vc.clone())
    with pytest.raises(OpInputError, match="^v_new: expected a tensor that does not require"):
        dop.torch_op(True)(q, kc, vc, lens, table, kn, vn.clone().requires_grad_(), scale, 0)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    with torch.no_grad():  # serving code: fine, and the same answer as with_kvcache
        o, _ = dop.torch_op(False)(q.clone().requires_grad_(), kc, vc, lens, table, scale, 0)
    assert not o.requires_grad
    assert torch.equal(o, op.with_kvcache(q, kc, vc, lens, block_table=table)[0])


# ----------------------------------------------------------------------------- item 5
def test_a_param_indexed_out_of_range_writes_nothing(tmp_path):
    """``w[h]`` on a ``[2]`` param with 4 heads: the CPU path raised ``IndexError`` after
    ``k_new`` / ``v_new`` were written.  Now an :class:`OpInputError` naming ``w``, the
    caches unchanged; an in-range call still appends."""
    text = ("name: trust_param_index\nhead_dim: 64\ndtype: bf16\nmask: causal\n"
            "score_mod: score + w[h]\nparams:\n  w: {type: f32, shape: [2]}\n")  # fmt: skip
    op = _load(tmp_path, "trust_param_index", text=text)
    kc, vc = _paged(hkv=4)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    before = (kc.clone(), vc.clone())
    call, _ = _append_call(op, kc, vc, table, [3], hq=4, hkv=4, w=torch.zeros(2))
    with pytest.raises(OpInputError, match=r"^w: .*indexed outside its shape"):
        call()
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    ok = _load(tmp_path, "trust_param_index_ok", text=text.replace(
        "trust_param_index", "trust_param_index_ok").replace("[2]", "[4]"))  # fmt: skip
    call, (q, kn, vn, lens) = _append_call(ok, kc, vc, table, [3], hq=4, hkv=4, w=torch.zeros(4))
    call()
    assert torch.equal(kc[0, 3], kn[0, :, 0]) and torch.equal(vc[0, 3], vn[0, :, 0])


def test_a_param_indexed_by_a_tensors_values_out_of_range_writes_nothing(tmp_path):
    """``w[ids[b]]``: an index that reads a tensor cannot be bounded from the sizes, so the
    CPU path appended first and the reference's refusal (``w[5]`` on a ``[2]`` param) came
    after ``k_new`` / ``v_new`` were in the cache.  Now the call runs on copies first; an
    in-range call appends as before."""
    text = ("name: trust_param_gather\nhead_dim: 64\ndtype: bf16\nmask: causal\n"
            "score_mod: score + w[ids[b]]\nparams:\n  w: {type: f32, shape: [2]}\n"
            "  ids: {type: i32, shape: [batch]}\n")  # fmt: skip
    op = _load(tmp_path, "trust_param_gather", text=text)
    kc, vc = _paged()
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    before = (kc.clone(), vc.clone())
    ids = torch.tensor([5], dtype=torch.int32)
    call, _ = _append_call(op, kc, vc, table, [3], w=torch.zeros(2), ids=ids)
    with pytest.raises(OpInputError, match=r"^w: .*indexed outside its shape"):
        call()
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    ids = torch.tensor([1], dtype=torch.int32)
    call, (q, kn, vn, lens) = _append_call(op, kc, vc, table, [3], w=torch.zeros(2), ids=ids)
    call()
    assert torch.equal(kc[0, 3], kn[0, :, 0]) and torch.equal(vc[0, 3], vn[0, :, 0])


# ----------------------------------------------------------------------------- also: ragged
def test_ragged_k_new_shape_errors_name_the_callers_shapes(tmp_path):
    """A ragged ``k_new`` with the wrong heads or head_dim was reported in the internal
    row-free stand-in's shape (``[batch, heads, 0, D]``); now in the caller's ``[total_q,
    heads_kv, head_dim]``."""
    op = _load(tmp_path, "trust_ragged_msg")
    kc, vc = _paged()
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    q = torch.randn(3, 2, 64).to(torch.bfloat16)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    lens = torch.tensor([2, 2], dtype=torch.int32)
    good = torch.randn(3, 2, 64).to(torch.bfloat16)
    for name, bad, got in (("k_new", torch.randn(3, 1, 64), "[3, 1, 64]"),
                           ("v_new", torch.randn(3, 2, 32), "[3, 2, 32]")):  # fmt: skip
        kw = {"k_new": good, "v_new": good.clone(), name: bad.to(torch.bfloat16)}
        with pytest.raises(OpInputError) as e:
            op.with_kvcache(q, kc, vc, lens, block_table=table, cu_seqlens_q=cu, **kw)
        assert str(e.value).startswith(f"{name}: expected shape [3, 2, 64]"), str(e.value)
        assert got in str(e.value) and ", 0, " not in str(e.value)


def test_ragged_batch_mismatch_names_cu_seqlens_q(tmp_path):
    """A ragged call whose cu_seqlens_q holds one request fewer than cache_seqlens was
    refused as ``k_cache: expected batch 2 (q's batch ...)``: a ragged q has no batch, the
    batch is cu_seqlens_q's length - 1."""
    op = _load(tmp_path, "trust_ragged_batch")
    kc, vc = _paged()
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    q = torch.randn(3, 2, 64).to(torch.bfloat16)
    lens = torch.tensor([2, 2], dtype=torch.int32)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    msg = "cu_seqlens_q: expected shape [3] (batch + 1: cache_seqlens has 2 requests), got [2]"
    with pytest.raises(OpInputError, match=re.escape(msg)):
        op.with_kvcache(q, kc, vc, lens, block_table=table, cu_seqlens_q=cu)


# ----------------------------------------------------------------------------- item 14
def test_merge_attention_edges():
    """A partial of weight 0 (lse -inf) with NaN in its o made the merge NaN; lse +inf gave
    NaN silently; mismatched o dtypes were accepted though documented to raise; 0-d inputs
    came back with shape [1]."""
    from flashgen.ops.decode.op import merge_attention

    o = torch.randn(3, 8)
    lse = torch.tensor([0.5, -1.0, 2.0])
    unset = torch.full((3, 8), float("nan"))
    empty = torch.full((3,), float("-inf"))
    mo, ml = merge_attention(o, lse, unset, empty)
    assert torch.equal(mo, o) and torch.equal(ml, lse)
    mo, ml = merge_attention(unset, empty, o, lse)
    assert torch.equal(mo, o) and torch.equal(ml, lse)
    inf = lse.clone()
    inf[1] = float("inf")
    with pytest.raises(OpInputError, match=r"lse_b: expected values < \+inf.*\[1\]"):
        merge_attention(o, lse, o, inf)
    with pytest.raises(OpInputError, match="o_b: expected dtype torch.float32"):
        merge_attention(o, lse, o.bfloat16(), lse)
    with pytest.raises(OpInputError, match="o_a: expected a tensor"):
        merge_attention(torch.tensor(1.0), torch.tensor(0.0), torch.tensor(2.0),
                        torch.tensor(0.0))  # fmt: skip
    nan = lse.clone()
    nan[0] = float("nan")  # a NaN lse still poisons its row (the combine kernel's rule)
    mo, ml = merge_attention(o, nan, o, lse)
    assert torch.isnan(mo[0]).all() and torch.isnan(ml[0]) and torch.isfinite(mo[1:]).all()


def test_plan_decode_refuses_flags_that_are_not_bools():
    """``append="no"`` used to build a plan that every later call refused with a confusing
    message; a flag is a bool or the call is refused naming it."""
    import flashgen

    op = flashgen.load("llama3_gqa")
    for name, bad in (("append", "no"), ("append", 1), ("pack_gqa", "yes")):
        with pytest.raises(OpInputError, match=f"{name}: expected a bool, got {bad!r}"):
            op.plan_decode(batch=1, num_heads=32, num_heads_kv=8, seqlen_q=1,
                           cache_capacity=64, device="cpu", **{name: bad})  # fmt: skip
