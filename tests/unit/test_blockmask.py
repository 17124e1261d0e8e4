"""Block tables for masks that read tensor params: lowering, the brute-force reference
table, ``op.block_mask`` / ``block_mask=`` on CPU and their errors; the shipped
tensor-param specs (document_mask, t5_bias) against the reference.  No GPU needed (the
pre-pass kernel is compiled with nvcc, zero spills)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from plan_helpers import plan_forward  # noqa: E402

import flashgen  # noqa: E402
from flashgen.build import cache  # noqa: E402
from flashgen.build.render import render  # noqa: E402
from flashgen.codegen.abi import block_table_dims, needs_block_table  # noqa: E402
from flashgen.codegen.plan import TileConfig  # noqa: E402
from flashgen.families.blocktable import block_table_shape  # noqa: E402
from flashgen.families.build import build_forward  # noqa: E402
from flashgen.families.registry import plan_block_table  # noqa: E402
from flashgen.frontend.errors import OpInputError  # noqa: E402
from flashgen.frontend.spec import load_spec, loads_spec  # noqa: E402
from flashgen.ops.cpu.reference import attention_reference, eval_mask  # noqa: E402
from flashgen.ops.prefill.blockmask import EMPTY, FULL, PARTIAL, block_table_reference  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "specs" / "document_mask.yaml"
T5 = REPO / "specs" / "t5_bias.yaml"
DOC1D = (
    "name: doc1d\nhead_dim: 64\ndtype: fp16\nmask: doc[q_idx] == doc[kv_idx]\n"
    "params:\n  doc: {type: i32, shape: [seqlen_q]}\n"
)
PER_HEAD = (
    "name: perhead\nhead_dim: 64\ndtype: bf16\n"
    "mask: 'causal && q_idx - kv_idx < win[h] + shift'\n"
    "params:\n  win: {type: i32, shape: [num_heads]}\n  shift: {type: i32, default: 0}\n"
)


def docs(b, s, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (b, s), generator=g, dtype=torch.int32).sort(-1).values


def brute_classes(keep, bm, bn):
    """[..., Sq, Sk] bool -> per-tile class by loops (the definition)."""
    *lead, sq, sk = keep.shape
    mb, nb = -(-sq // bm), -(-sk // bn)
    out = torch.empty(*lead, mb, nb, dtype=torch.uint8)
    flat, oflat = keep.reshape(-1, sq, sk), out.view(-1, mb, nb)
    for s in range(flat.shape[0]):
        for i in range(mb):
            for j in range(nb):
                t = flat[s, i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
                oflat[s, i, j] = EMPTY if not t.any() else FULL if t.all() else PARTIAL
    return out


def test_which_specs_need_a_table():
    assert needs_block_table(load_spec(DOC))
    assert not needs_block_table(load_spec(T5))  # tensor in score_mod only
    assert not needs_block_table(load_spec(REPO / "specs" / "mistral_swa.yaml"))
    assert block_table_dims(load_spec(DOC)) == (True, False)
    assert block_table_dims(loads_spec(DOC1D, "d.yaml")) == (False, False)
    assert block_table_dims(loads_spec(PER_HEAD, "p.yaml")) == (False, True)


@pytest.mark.parametrize("target, family", [("sm_80", "auto"), ("sm_90", "fa2"), ("sm_90", "auto")])
def test_forward_abi_gets_the_table_only_when_needed(target, family):
    doc = plan_forward(load_spec(DOC), target, family=family)
    names = [a.name for a in doc.args if a.ctype != "CUtensorMap"]  # Hopper: + tma_q/k/v
    assert names[-3:] == ["blk_tab", "blk_sb", "blk_sh"]
    assert doc.context["block_table"] and doc.config()["block_table"]
    src = render(doc)
    if doc.template == "sm_80/fwd.cu.j2":  # the FA2-class kernel stages the row in smem
        assert "s_tab[j] = tab_row[j]" in src and "prev_tab(n_block - 1" in src
    else:  # the Hopper producer walks it in global memory
        assert target == "sm_90" and "prev_live(n_block - 1, c)" in src and "tab_row[j]" in src
    t5 = plan_forward(load_spec(T5), target, family=family)
    assert "blk_tab" not in [a.name for a in t5.args] and "tab_row" not in render(t5)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
@pytest.mark.parametrize("text", [DOC.read_text(), DOC1D, PER_HEAD])
def test_pre_pass_and_forward_compile_without_spills(text, target):
    """The op's build path (tables, then the spill fallback's smaller tiles) ends spill-free,
    on sm_90 with the Hopper kernel; the pre-pass for the chosen tiles never spills."""
    spec = loads_spec(text, "s.yaml")
    fwd, _, report = build_forward(spec, target)
    assert report.spill_bytes == 0, report
    assert (fwd.template == "sm_90/fwd.cu.j2") == (target == "sm_90")
    plan = plan_block_table(spec, target, fwd.tiles)
    _, report = cache.get_or_build(render(plan), plan)
    assert report.spill_bytes == 0, report


def test_pre_pass_plan_refuses_index_only_masks():
    with pytest.raises(ValueError, match="no tensor param"):
        plan_block_table(load_spec(T5), "sm_80", TileConfig(128, 32, 4))


@pytest.mark.parametrize(
    "sq,sk,bm,bn", [(1, 1, 128, 32), (17, 130, 16, 32), (127, 61, 64, 16), (300, 300, 128, 32)]
)
def test_reference_table_matches_brute_force(sq, sk, bm, bn):
    spec = load_spec(DOC)
    b = 2
    params = {"doc_q": docs(b, sq, 3), "doc_kv": docs(b, sk, 3, seed=1)}
    tiles = TileConfig(bm, bn, 4)
    table = block_table_reference(
        spec, tiles, batch=b, heads_q=4, seqlen_q=sq, seqlen_k=sk, params=params
    )
    assert tuple(table.shape) == block_table_shape(spec, tiles, b, 4, sq, sk) == (
        b, 1, -(-sq // bm), -(-sk // bn),
    )  # fmt: skip
    keep = eval_mask(spec, batch=b, heads_q=1, seqlen_q=sq, seqlen_k=sk, params=params)
    assert torch.equal(table, brute_classes(keep, bm, bn))


def test_reference_table_per_head_and_scalar():
    spec = loads_spec(PER_HEAD, "p.yaml")
    win = torch.tensor([1, 40, 1000], dtype=torch.int32)
    tiles = TileConfig(16, 16, 1)
    params = {"win": win, "shift": 3}
    table = block_table_reference(
        spec, tiles, batch=5, heads_q=3, seqlen_q=70, seqlen_k=70, params=params
    )
    keep = eval_mask(spec, batch=1, heads_q=3, seqlen_q=70, seqlen_k=70, params=params)
    assert table.shape == (1, 3, 5, 5)
    assert torch.equal(table, brute_classes(keep, 16, 16))
    assert set(table.unique().tolist()) == {EMPTY, PARTIAL, FULL}


def test_cpu_block_mask_api_and_reuse():
    op = flashgen.load(DOC)
    B, H, S = 2, 4, 150
    doc = docs(B, S, 4)
    bm = op.block_mask(S, S, doc_q=doc, doc_kv=doc)
    assert bm.shape[:2] == (B, 1) and bm.batch == B and bm.heads_q == 1
    assert sum(bm.counts().values()) == bm.table.numel()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, 128, generator=g).bfloat16()
    k, v = (torch.randn(B, 2, S, 128, generator=g).bfloat16() for _ in range(2))
    o1, lse1 = op.attention(q, k, v, doc_q=doc, doc_kv=doc, block_mask=bm)
    o2, lse2 = op.attention(q, k, v, doc_q=doc, doc_kv=doc)
    assert torch.equal(o1, o2) and torch.equal(lse1, lse2)
    ref, _ = attention_reference(op.spec, q, k, v, params={"doc_q": doc, "doc_kv": doc})
    assert (o1.double() - ref).abs().max() < 2e-2
    # positional schema call: block_mask is the last positional argument
    o3, _ = op.torch_op(q, k, v, 0.0884, doc, doc, bm.op_arg())
    assert o3.shape == o1.shape


def test_a_table_is_used_only_with_the_tiles_it_was_built_for():
    """op.block_mask's table travels to the CUDA impl as a [.., block_m, block_n] broadcast
    view; the impl's check (the same _table_values the CUDA launch runs) accepts it for a
    kernel of those tiles and refuses it for another, even where the tile counts agree
    (here 1 x 1 tiles for both the FA2-class 128x32 and the Hopper 128x128 kernels)."""
    from flashgen.ops.op import validate
    from flashgen.ops.prefill.blockmask import table_for_tiles

    op = flashgen.load(DOC)
    doc_q, doc_kv = docs(2, 100, 3), docs(2, 30, 3, seed=1)
    bm = op.block_mask(100, 30, doc_q=doc_q, doc_kv=doc_kv)  # CPU: the FA2-class tiles
    arg = bm.op_arg()
    assert arg.shape == (*bm.shape, bm.block_m, bm.block_n) and arg.stride()[4:] == (0, 0)
    assert arg.data_ptr() == bm.table.data_ptr()  # a view, no copy
    q = torch.zeros(2, 4, 100, 128).bfloat16()
    k = torch.zeros(2, 2, 30, 128).bfloat16()
    tensors = {"doc_q": doc_q, "doc_kv": doc_kv}
    dims = validate(op.spec, q, k, k, tensors)
    fa2 = plan_forward(op.spec, "sm_90", family="fa2")
    assert (fa2.tiles.block_m, fa2.tiles.block_n) == (bm.block_m, bm.block_n)
    vals = op._table_values(arg, fa2.tiles, dims, [], tensors, q.device)
    assert vals["blk_tab"].data_ptr() == bm.table.data_ptr() and vals["blk_sb"] == 1
    hopper = plan_forward(op.spec, "sm_90")
    assert block_table_shape(op.spec, hopper.tiles, 2, 4, 100, 30) == bm.shape
    with pytest.raises(OpInputError, match=r"built for 128x32 tiles, but this call runs a "
                       r"kernel with 128x128 tiles"):  # fmt: skip
        op._table_values(arg, hopper.tiles, dims, [], tensors, q.device)
    with pytest.raises(OpInputError, match=r"expected the uint8 table view .* \[2, 1, 1, 1, "):
        op._table_values(bm.table, fa2.tiles, dims, [], tensors, q.device)  # a bare table
    with pytest.raises(OpInputError, match="expected the uint8 table view"):
        table_for_tiles(arg.contiguous(), bm.shape, fa2.tiles)  # not a broadcast view
    with pytest.raises(OpInputError, match="expected the uint8 table view"):
        table_for_tiles(arg, (2, 1, 1, 2), fa2.tiles)  # other sizes


def test_block_mask_errors():
    op = flashgen.load(DOC)
    doc = docs(1, 64, 2)
    q = torch.randn(1, 2, 64, 128).bfloat16()
    k = v = torch.randn(1, 2, 64, 128).bfloat16()
    bm = op.block_mask(64, 64, doc_q=doc, doc_kv=doc)
    with pytest.raises(OpInputError, match=r"block_mask: expected \(seqlen_q, seqlen_k\)"):
        op.attention(q[:, :, :63], k, v, doc_q=doc[:, :63], doc_kv=doc, block_mask=bm)
    with pytest.raises(OpInputError, match="expected a BlockMask"):
        op.attention(q, k, v, doc_q=doc, doc_kv=doc, block_mask=bm.table)
    with pytest.raises(OpInputError, match=r"doc_kv: expected shape \[1, 64\]"):
        op.block_mask(64, 64, doc_q=doc, doc_kv=doc[:, :10])
    with pytest.raises(OpInputError, match="doc_q: expected an integer tensor"):
        op.block_mask(64, 64, doc_q=doc.float(), doc_kv=doc)
    with pytest.raises(OpInputError, match="doc_kv: missing tensor param"):
        op.block_mask(64, 64, doc_q=doc)
    with pytest.raises(OpInputError, match="seqlen_q: expected a non-negative int"):
        op.block_mask(-1, 64, doc_q=doc, doc_kv=doc)
    t5 = flashgen.load(T5)
    with pytest.raises(OpInputError, match="reads no tensor param"):
        t5.block_mask(64, 64, bias=torch.zeros(2, 257))
    q64 = torch.randn(1, 2, 64, 64).bfloat16()
    with pytest.raises(OpInputError, match="takes none"):
        t5.attention(q64, q64, q64, bias=torch.zeros(2, 257), block_mask=bm)


def test_block_mask_remembers_scalars_the_mask_reads():
    op = flashgen.load(_write(PER_HEAD))
    win = torch.tensor([4, 8], dtype=torch.int32)
    bm = op.block_mask(32, 32, win=win, shift=2)
    assert bm.scalars == {"shift": 2} and bm.heads_q == 2
    q = torch.randn(1, 2, 32, 64).bfloat16()
    op.attention(q, q, q, win=win, shift=2, block_mask=bm)
    with pytest.raises(OpInputError, match="built with shift=2"):
        op.attention(q, q, q, win=win, shift=3, block_mask=bm)


def _write(text: str) -> Path:
    import tempfile

    p = Path(tempfile.mkdtemp()) / "spec.yaml"
    p.write_text(text)
    return p


def test_t5_bias_reference_and_bounds():
    spec = load_spec(T5)
    g = torch.Generator().manual_seed(0)
    H, S = 3, 300  # distances beyond +-128 clamp to the table's ends
    q, k, v = (torch.randn(1, H, S, 64, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(H, 257, generator=g, dtype=torch.float64)
    o, _ = attention_reference(spec, q, k, v, params={"bias": bias})
    i = torch.arange(S)
    rel = (i.view(1, S) - i.view(S, 1)).clamp(-128, 128) + 128
    s = q @ k.transpose(-1, -2) / 8.0 + bias[:, rel]
    torch.testing.assert_close(o, torch.softmax(s, -1) @ v)
    bad = loads_spec(T5.read_text().replace("+ 128]", "+ 129]"), "t5.yaml")
    with pytest.raises(IndexError, match="tensor param 'bias' is indexed outside its shape"):
        attention_reference(bad, q, k, v, params={"bias": bias})


def test_t5_bias_op_validates_the_table():
    op = flashgen.load(T5)
    q = torch.randn(1, 4, 20, 64).bfloat16()
    with pytest.raises(OpInputError, match=r"bias: expected shape \[4, 257\]"):
        op.attention(q, q, q, bias=torch.zeros(4, 256))
    with pytest.raises(OpInputError, match="bias: expected a floating-point tensor"):
        op.attention(q, q, q, bias=torch.zeros(4, 257, dtype=torch.int32))
    o, lse = op.attention(q, q, q, bias=torch.zeros(4, 257, dtype=torch.float64))
    assert o.shape == q.shape and torch.isfinite(lse).all()


def test_launch_values_pack_for_the_pre_pass_and_the_forward():
    """Every argument of both kernels' ABIs gets a value from the op's maps (numpy-only)."""
    from flashgen.ops.op import kernel_values, validate
    from flashgen.ops.prefill.blockmask import table_strides
    from flashgen.runtime.launch import kernel_args

    spec = load_spec(DOC)
    B, H, S = 2, 4, 100
    q = torch.randn(B, H, S, 128).bfloat16()
    tensors = {"doc_q": docs(B, S, 3), "doc_kv": docs(B, S, 3)}
    dims = validate(spec, q, q, q, tensors)
    fwd = plan_forward(spec, "sm_90")
    table = block_table_reference(
        spec, fwd.tiles, batch=B, heads_q=H, seqlen_q=S, seqlen_k=S, params=tensors
    )
    values = kernel_values(spec, {"q": q, "k": q, "v": q, "o": q, "lse": q}, dims, 0.1, [],
                           tensors)  # fmt: skip
    sb, sh = table_strides(spec, table)
    assert (sb, sh) == (table.shape[2] * table.shape[3], 0)
    values.update(blk_tab=table, blk_sb=sb, blk_sh=sh)
    values.update({m.name: bytes(128) for m in fwd.tma})  # the Hopper kernel's tensor maps
    assert fwd.tma and len(kernel_args(fwd, values)) == len(fwd.args)
    pre = plan_block_table(spec, "sm_90", fwd.tiles)
    pv = kernel_values(spec, {"tab": table}, dims, 1.0, [], tensors)
    pv.update(tab_b=table.shape[0], tab_h=table.shape[1])
    assert len(kernel_args(pre, pv)) == len(pre.args)


def test_block_mask_of_one_spec_serves_its_ops_under_other_options():
    """A block table belongs to the spec and its tiles, not to the options an op was bound
    with: an op of the same spec under other options takes it where the tiles agree (the CPU
    op here; on CUDA a kernel of other tiles refuses it by its tiles), and an op of another
    spec refuses it by name."""
    op = flashgen.load(DOC)
    other = op.with_options(flashgen.Options(family="fa2"))
    assert other.name != op.name and other.base_name == op.base_name
    doc = docs(1, 64, 2)
    q = torch.randn(1, 2, 64, 128).bfloat16()
    k = v = torch.randn(1, 2, 64, 128).bfloat16()
    bm = op.block_mask(64, 64, doc_q=doc, doc_kv=doc)
    o1, _ = other.attention(q, k, v, doc_q=doc, doc_kv=doc, block_mask=bm)
    o2, _ = other.attention(q, k, v, doc_q=doc, doc_kv=doc)
    assert torch.equal(o1, o2)
    renamed = flashgen.loads_spec(DOC.read_text().replace("name: document_mask", "name: docm2"))
    from flashgen.ops.op import build_op

    with pytest.raises(OpInputError, match="expected one built by an op of spec 'docm2'"):
        build_op(renamed).attention(q, k, v, doc_q=doc, doc_kv=doc, block_mask=bm)


# ------------------------------------------------------ the backward's tables a BlockMask holds
class _Kernel:
    """A loaded kernel's stand-in: records each launch's name and argument values."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def launch(self, grid, values, stream):
        self.log.append((self.name, dict(values)))


@pytest.fixture
def fake_cuda_backward(monkeypatch):
    """The CUDA backward of document_mask on CPU tensors, no GPU: ops built under it (fresh
    names) run their backward op's CUDA path (:meth:`Backward.cuda`, the sm_90 kernels'
    plans) with kernels that record their launches; the eager forward is the CPU one
    (tests/unit/test_eager_wiring.py's ``forced``); every table build (the pre-pass,
    :meth:`_pre_pass`) is recorded by its tiles and computed by the reference.  Yields
    ``make(options=None) -> op``, with ``make.launches`` and ``make.pre_passes``."""
    from flashgen.families import registry
    from flashgen.ops.prefill import attention as op_mod
    from flashgen.ops.prefill import backward as bwd_mod
    from flashgen.ops.prefill.attention import AttentionOp
    from flashgen.ops.prefill.backward import Backward

    launches, pre_passes = [], []

    def kernels(self, device, atomic_dq=False, path=None, param_grads=(), sink=False):
        key = (path, tuple(param_grads), sink)
        if key not in self._kernels:
            opts, names = self.op.options, tuple(param_grads)
            if path in ("hopper", "hopper_ordered"):
                plan = registry.plan_hopper_backward(
                    self.spec, "sm_90", opts, ordered_dq=path == "hopper_ordered",
                    param_grads=names, sink=sink,
                )  # fmt: skip
            else:
                plan = registry.plan_backward(self.spec, "sm_90", opts, atomic_dq=path == "atomic",
                                              param_grads=names, sink=sink)  # fmt: skip
            self._kernels[key] = (plan, *(_Kernel(n, launches) for n in ("pre", "dkdv", "last")))
        return self._kernels[key]

    real_pre_pass = AttentionOp._pre_pass

    def pre_pass(self, device, tiles, dims, scalars, tensors):
        pre_passes.append((tiles.block_m, tiles.block_n))
        return real_pre_pass(self, device, tiles, dims, scalars, tensors)

    def forward(self, q, k, v, dims, scale, scalars, tensors, table, descales=None, out=None):
        ordered = [tensors[p.name] for p in self.spec.tensor_params]
        return self._cpu_impl(q, k, v, scale, *scalars, *ordered, out=out)

    monkeypatch.setattr(Backward, "cpu", Backward.cuda)  # registered by the ops built below
    monkeypatch.setattr(Backward, "kernels", kernels)
    monkeypatch.setattr(bwd_mod, "_cuda_call", lambda q: True)
    monkeypatch.setattr(bwd_mod, "target_for_device", lambda spec, device: "sm_90")
    monkeypatch.setattr(bwd_mod, "current_stream_ptr", lambda device: 0)
    monkeypatch.setattr(AttentionOp, "_pre_pass", pre_pass)
    monkeypatch.setattr(op_mod, "_eager_cuda", lambda q, k, v: True)
    monkeypatch.setattr(AttentionOp, "_forward", forward)

    def make(options=None):
        from flashgen.ops.op import build_op

        make.count += 1
        name = f"docmask_held_{make.count}_{id(launches):x}"
        spec = loads_spec(DOC.read_text().replace("name: document_mask", f"name: {name}"), "d")
        return build_op(spec, options) if options is not None else build_op(spec)

    make.count, make.launches, make.pre_passes = 0, launches, pre_passes
    return make


def _doc_case(b=2, hq=4, hkv=2, s=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, s, 128, generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(b, hkv, s, 128, generator=g).bfloat16().requires_grad_() for _ in "kv")
    doc = docs(b, s, 5, seed=seed)
    return q, k, v, {"doc_q": doc, "doc_kv": doc}


def _fwd_bwd(op, q, k, v, params, **kw):
    o, lse = op.attention(q, k, v, **params, **kw)
    o.float().square().sum().backward()


def _dkdv_tables(launches):
    return [vals["blk_tab"] for name, vals in launches if name == "dkdv"]


def test_backward_with_a_block_mask_builds_its_table_once(fake_cuda_backward):
    """GQA at a length no tile divides: three forward+backward calls given one BlockMask run
    the pre-pass for the backward's tiles once (the first backward), every dK/dV launch reads
    that same held table (the reference's classes for those tiles); without the BlockMask
    each backward runs it again, as before."""
    from flashgen.ops.prefill.backward import table_tiles
    from flashgen.ops.prefill.blockmask import table_key

    op = fake_cuda_backward()
    q, k, v, params = _doc_case()
    bm = op.block_mask(1000, 1000, **params)
    fwd = (bm.block_m, bm.block_n)
    for _ in range(3):
        _fwd_bwd(op, q, k, v, params, block_mask=bm)
    plan = op.backward._kernels[("hopper", (), False)][0]
    tiles = table_tiles(plan)
    bwd = (tiles.block_m, tiles.block_n)
    assert bwd != fwd
    assert fake_cuda_backward.pre_passes == [fwd, bwd]
    held = bm.tables[table_key(*bwd)][0]
    tabs = _dkdv_tables(fake_cuda_backward.launches)
    assert len(tabs) == 3 and all(t.data_ptr() == held.data_ptr() for t in tabs)
    ref = block_table_reference(op.spec, tiles, batch=2, heads_q=4, seqlen_q=1000,
                                seqlen_k=1000, params=params)  # fmt: skip
    assert held.shape == (2, 1, 13, 8) and torch.equal(held, ref)
    assert set(bm.tables) == {table_key(*fwd), table_key(*bwd)}
    fake_cuda_backward.pre_passes.clear()
    fake_cuda_backward.launches.clear()
    for _ in range(2):
        _fwd_bwd(op, q, k, v, params)
    assert fake_cuda_backward.pre_passes == [bwd, bwd]
    tabs = _dkdv_tables(fake_cuda_backward.launches)
    assert len(tabs) == 2 and all(torch.equal(t, ref) for t in tabs)
    assert all(t.data_ptr() != held.data_ptr() for t in tabs)


def test_backward_tables_are_held_per_tile_geometry(fake_cuda_backward):
    """One BlockMask serves ops of its spec whose backward kernels classify other tiles (an op
    under other options: 64 x 128 instead of 80 x 128): a table per tile geometry, each built
    once and each launch given its own kernel's; a backward whose kernels read no table
    (``deterministic=True``: the FA2-class ones) builds none."""
    from flashgen.ops.prefill.blockmask import table_key

    op = fake_cuda_backward()
    other = op.with_options(op.options.with_values({"hopper_bwd.masked_80": False}))
    q, k, v, params = _doc_case(s=333)
    bm = op.block_mask(333, 333, **params)
    fake_cuda_backward.pre_passes.clear()
    for o in (op, other, op, other):
        _fwd_bwd(o, q, k, v, params, block_mask=bm)
    assert fake_cuda_backward.pre_passes == [(80, 128), (64, 128)]
    assert set(bm.tables) == {table_key(bm.block_m, bm.block_n), table_key(80, 128),
                              table_key(64, 128)}  # fmt: skip
    shapes = [tuple(t.shape) for t in _dkdv_tables(fake_cuda_backward.launches)]
    assert shapes == [(2, 1, 5, 3), (2, 1, 6, 3)] * 2
    fake_cuda_backward.launches.clear()
    _fwd_bwd(op, q, k, v, params, block_mask=bm, deterministic=True)
    assert fake_cuda_backward.pre_passes == [(80, 128), (64, 128)]
    dkdv = [vals for name, vals in fake_cuda_backward.launches if name == "dkdv"]
    assert len(dkdv) == 1 and "blk_tab" not in dkdv[0]


def test_backward_of_the_forward_tiles_takes_the_forward_table():
    """A backward kernel of the forward's tiles builds nothing: the forward's table is held
    under the same key (tiles and layout)."""
    from flashgen.codegen.plan import TileConfig
    from flashgen.ops.prefill.blockmask import TABLE_LAYOUT, table_key

    op = flashgen.load(DOC)
    doc = docs(2, 100, 3)
    bm = op.block_mask(100, 100, doc_q=doc, doc_kv=doc)
    assert table_key(bm.block_m, bm.block_n) == (bm.block_m, bm.block_n, TABLE_LAYOUT)
    assert bm.held(bm.block_m, bm.block_n, lambda: 1 / 0) == (bm.table, None)
    arg = op._held_table_arg(bm, TileConfig(bm.block_m, bm.block_n, 4))
    assert arg.data_ptr() == bm.table.data_ptr() and arg.shape[4:] == (bm.block_m, bm.block_n)
    assert list(bm.tables) == [table_key(bm.block_m, bm.block_n)]


def test_a_mismatched_block_mask_is_refused_before_anything_runs(fake_cuda_backward):
    """A BlockMask built for other lengths, another batch or other doc-id tensors is refused
    by the call that gets it, naming the argument with the expected and received values,
    before the forward runs, any kernel or pre-pass launches, or the mask holds a new table;
    the backward op refuses a table for other tiles or sizes before its first launch."""
    from flashgen.ops.prefill.backward import backward_name, table_tiles

    op = fake_cuda_backward()
    q, k, v, params = _doc_case(s=200)
    bm = op.block_mask(200, 200, **params)
    keys = set(bm.tables)
    fake_cuda_backward.pre_passes.clear()
    doc = params["doc_q"]
    cases = [
        ((q[:, :, :199], k[:, :, :199], v[:, :, :199]),
         {"doc_q": doc[:, :199], "doc_kv": doc[:, :199]},
         r"block_mask: expected \(seqlen_q, seqlen_k\) = \(199, 199\) \(q's and k's\), got "
         r"\(200, 200\)"),
        ((q[:1], k[:1], v[:1]), {"doc_q": doc[:1], "doc_kv": doc[:1]},
         r"block_mask: built for batch=2 \(the mask reads b\), but q has batch 1"),
        ((q, k, v), {"doc_q": doc.clone(), "doc_kv": doc},
         r"block_mask: built with doc_q = int32 \[2, 200\] strides \[200, 1\] storage offset 0 "
         r"at 0x[0-9a-f]+ on cpu, but this call has doc_q = int32 \[2, 200\] strides \[200, 1\] "
         r"storage offset 0 at 0x[0-9a-f]+ on cpu"),
    ]  # fmt: skip
    for (qq, kk, vv), call_params, msg in cases:
        with pytest.raises(OpInputError, match=msg):
            _fwd_bwd(op, qq, kk, vv, call_params, block_mask=bm)
    assert fake_cuda_backward.pre_passes == [] and fake_cuda_backward.launches == []
    assert set(bm.tables) == keys and q.grad is None
    # the backward op itself: a table for the forward's tiles, or for other sizes
    bwd = getattr(torch.ops.flashgen, backward_name(op.spec))
    o, lse = op.attention(q.detach(), k.detach(), v.detach(), **params)
    args = (o, q.detach(), k.detach(), v.detach(), o, lse, None, 0.088, False, doc, doc)
    tiles = table_tiles(op.backward.kernels(q.device, path="hopper")[0])
    with pytest.raises(OpInputError, match=rf"block_mask: built for {bm.block_m}x{bm.block_n} "
                       rf"tiles, but this call runs a kernel with 80x128 tiles"):  # fmt: skip
        bwd(*args, block_mask=bm.op_arg())
    small = op.block_mask(100, 200, doc_q=doc[:, :100], doc_kv=doc)
    with pytest.raises(OpInputError, match=r"block_mask: expected the uint8 table view .* of "
                       r"shape \[2, 1, 3, 2, 80, 128\] .* got torch.uint8 \[2, 1, 2, 2, 80, "
                       r"128\]"):  # fmt: skip
        bwd(*args, block_mask=op._held_table_arg(small, tiles))
    assert fake_cuda_backward.launches == []
    assert fake_cuda_backward.pre_passes == [(bm.block_m, bm.block_n), (80, 128)]  # small's


def test_backward_schema_takes_a_block_mask_only_for_tensor_masks():
    from flashgen.ops.prefill.backward import backward_schema, backward_sink_schema

    doc = load_spec(DOC)
    assert backward_schema(doc).endswith(
        "*, bool[] param_grads=[], Tensor? block_mask=None) -> (Tensor, Tensor, Tensor, Tensor[])"
    )
    text = DOC.read_text().replace("name: document_mask", "name: doc_sink")
    sinky = loads_spec(text + "sink: 0.0\n", "s.yaml")
    assert "param_grads=[], Tensor? block_mask=None) -> (" in backward_sink_schema(sinky)
    alibi = load_spec(REPO / "specs" / "alibi.yaml")
    assert "block_mask" not in backward_schema(alibi)


# ------------------------------------------------------------------ copies, staleness, messages
def test_a_block_mask_pickles_and_copies_without_its_held_tables():
    """copy.copy, copy.deepcopy, pickle, torch.save and a DataLoader worker's pickler
    (shared-memory tensors) give a BlockMask with a fresh lock, holding the forward's table
    only (the held tables are a cache, as after dataclasses.replace); the tensors pickled
    along with it serve it on the other side, and one written in place before pickling is
    still refused after."""
    import copy
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (its tensor reductions for ForkingPickler)

    from flashgen.ops.prefill.blockmask import table_key

    op = flashgen.load(DOC)
    doc = docs(1, 256, 3)
    bm = op.block_mask(256, 256, doc_q=doc, doc_kv=doc)
    fwd = table_key(bm.block_m, bm.block_n)
    bm.held(64, 64, lambda: (torch.zeros(1, 1, 4, 4, dtype=torch.uint8), None))
    assert set(bm.tables) == {fwd, table_key(64, 64)}

    def torch_roundtrip(x):
        buf = io.BytesIO()
        torch.save(x, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    q = torch.randn(1, 2, 256, 128).bfloat16()
    shallow = lambda x: (x[0], copy.copy(x[1]))  # noqa: E731
    for how in (shallow, copy.deepcopy, lambda x: pickle.loads(pickle.dumps(x)),
                torch_roundtrip, lambda x: pickle.loads(ForkingPickler.dumps(x))):  # fmt: skip
        d2, bm2 = how((doc, bm))
        assert type(bm2) is type(bm) and repr(bm2) == repr(bm) and bm2.scalars == bm.scalars
        assert torch.equal(bm2.table, bm.table) and bm2.inputs.dims == bm.inputs.dims
        assert list(bm2.tables) == [fwd] and bm2.tables[fwd][0] is bm2.table
        assert bm2._lock is not bm._lock
        assert bm2.inputs.tensors["doc_q"] is d2
        op.attention(q, q, q, doc_q=d2, doc_kv=d2, block_mask=bm2)
    assert set(bm.tables) == {fwd, table_key(64, 64)}  # the original keeps its own
    doc.add_(0)  # written in place: stale, and so are its copies
    for how in (shallow, copy.deepcopy, lambda x: pickle.loads(pickle.dumps(x))):
        d2, bm2 = how((doc, bm))
        with pytest.raises(OpInputError, match="block_mask: built when doc_q was at version"):
            op.attention(q, q, q, doc_q=d2, doc_kv=d2, block_mask=bm2)


def test_a_block_mask_refuses_tensors_written_in_place_since_it_was_built(fake_cuda_backward):
    """A doc-ids buffer refilled in place (same storage, shape and strides) is refused with
    the BlockMask built before, by its _version (no device sync), naming block_mask, the
    param and both versions; forward + backward steps that write nothing pass (autograd's
    saving included), as do tensors that track no version (inference tensors).  The
    backward's held-table path checks the same before building or taking a table."""
    from flashgen.ops.prefill.backward import table_tiles

    op = fake_cuda_backward()
    q, k, v, params = _doc_case(s=200)
    buf = params["doc_q"].clone()
    bm = op.block_mask(200, 200, doc_q=buf, doc_kv=buf)
    for _ in range(3):  # legitimate steps: forward and backward, nothing written
        _fwd_bwd(op, q, k, v, {"doc_q": buf, "doc_kv": buf}, block_mask=bm)
    built = buf._version
    buf.copy_(docs(2, 200, 7, seed=3))
    msg = (rf"block_mask: built when doc_q was at version {built} \(its _version\), but doc_q "
           rf"is now at version {built + 1}: .* rebuild with op.block_mask\(\.\.\.\)")  # fmt: skip
    with torch.no_grad():
        with pytest.raises(OpInputError, match=msg):
            op.attention(q, k, v, doc_q=buf, doc_kv=buf, block_mask=bm)
    tiles = table_tiles(op.backward.kernels(q.device, path="hopper")[0])
    with pytest.raises(OpInputError, match=msg):  # the backward's held tables: same check
        op._held_table_arg(bm, tiles)
    fresh = op.block_mask(200, 200, doc_q=buf, doc_kv=buf)
    _fwd_bwd(op, q, k, v, {"doc_q": buf, "doc_kv": buf}, block_mask=fresh)
    with torch.inference_mode():
        inf = docs(2, 200, 3)
        bmi = op.block_mask(200, 200, doc_q=inf, doc_kv=inf)
        op.attention(q, k, v, doc_q=inf, doc_kv=inf, block_mask=bmi)


def test_the_other_tensors_refusal_shows_strides_and_storage_offset():
    """Tensors at one address with one shape but other strides are told apart in the
    message (the expected and the received description differ)."""
    op = flashgen.load(DOC)
    doc = docs(1, 64, 2)
    bm = op.block_mask(64, 64, doc_q=doc, doc_kv=doc)
    other = doc.as_strided((1, 64), (70, 1))  # same elements, another batch stride
    q = torch.randn(1, 2, 64, 128).bfloat16()
    with pytest.raises(OpInputError) as e:
        op.attention(q, q, q, doc_q=other, doc_kv=doc, block_mask=bm)
    assert ("built with doc_q = int32 [1, 64] strides [64, 1] storage offset 0 at" in str(e.value)
            and "this call has doc_q = int32 [1, 64] strides [70, 1] storage offset 0 at"
            in str(e.value))  # fmt: skip


HEADKV = (
    "name: headkv_bm\nhead_dim: 64\ndtype: bf16\nmask: causal && keep[h_kv, kv_idx / 32] != 0\n"
    "params:\n  keep: {type: i32, shape: [num_heads_kv, 16]}\n"
)


def test_block_mask_refuses_query_heads_not_a_multiple_of_the_kv_heads():
    """num_heads inferred or given must be a multiple of num_heads_kv (inferred here from
    the param's shape): an OpInputError naming the argument, the expected and the received
    value and where each came from, not the reference's ValueError."""
    op = flashgen.load(_write(HEADKV))
    keep = torch.ones(2, 16, dtype=torch.int32)
    with pytest.raises(OpInputError, match=r"num_heads: expected a multiple of num_heads_kv = 2 "
                       r"\(from keep's shape\), got 1 \(the default\)"):  # fmt: skip
        op.block_mask(256, 256, keep=keep)
    with pytest.raises(OpInputError, match=r"num_heads: expected a multiple of num_heads_kv = 2 "
                       r"\(from keep's shape\), got 3 \(given\)"):  # fmt: skip
        op.block_mask(256, 256, keep=keep, num_heads=3)
    with pytest.raises(OpInputError, match=r"num_heads_kv: expected at least one kv head"):
        op.block_mask(256, 256, keep=keep[:0], num_heads=2)
    bm = op.block_mask(256, 256, keep=keep, num_heads=4)
    assert bm.heads_q == 4 and bm.heads_kv == 2


DOC_ALIBI = (
    "name: doc_alibi_bm\nhead_dim: 64\ndtype: bf16\n"
    "mask: causal && doc_q[b, q_idx] == doc_kv[b, kv_idx]\n"
    "score_mod: score - slopes[h] * (q_idx - kv_idx)\n"
    "params:\n  doc_q: {type: i32, shape: [batch, seqlen_q]}\n"
    "  doc_kv: {type: i32, shape: [batch, seqlen_k]}\n  slopes: {type: f32, shape: [num_heads]}\n"
)


def test_block_mask_needs_and_holds_only_the_params_its_mask_reads():
    """A score_mod's tensor param (trained slopes) is optional for op.block_mask (checked if
    given) and never held, with its autograd graph; the tables the mask builds later (the
    backward's) come from the params it holds, and the CUDA pre-pass passes an unread
    param as a null pointer."""
    from flashgen.codegen.plan import TileConfig
    from flashgen.ops.calls import kernel_values
    from flashgen.ops.prefill.blockmask import table_key
    from flashgen.ops.validation import Dims

    op = flashgen.load(_write(DOC_ALIBI))
    doc = docs(1, 64, 2)
    bm = op.block_mask(64, 64, doc_q=doc, doc_kv=doc)
    slopes = torch.nn.functional.softplus(torch.zeros(2, requires_grad=True))
    bm2 = op.block_mask(64, 64, doc_q=doc, doc_kv=doc, slopes=slopes)
    for m in (bm, bm2):
        assert set(m.inputs.tensors) == {"doc_q", "doc_kv"}
        assert torch.equal(m.table, bm.table)
    with pytest.raises(OpInputError, match=r"slopes: expected shape \[2\]"):
        op.block_mask(64, 64, doc_q=doc, doc_kv=doc, slopes=torch.ones(3), num_heads=2)
    q = torch.randn(1, 2, 64, 64).bfloat16()
    o, _ = op.attention(q, q, q, doc_q=doc, doc_kv=doc, slopes=torch.ones(2), block_mask=bm)
    want, _ = op.attention(q, q, q, doc_q=doc, doc_kv=doc, slopes=torch.ones(2))
    assert torch.equal(o, want)
    op._held_table_arg(bm, TileConfig(32, 32, 4))  # built from the held params alone
    ref = block_table_reference(op.spec, TileConfig(32, 32, 4), batch=1, heads_q=1, seqlen_q=64,
                                seqlen_k=64, params={"doc_q": doc, "doc_kv": doc})  # fmt: skip
    assert torch.equal(bm.tables[table_key(32, 32)][0], ref)
    vals = kernel_values(op.spec, {"tab": bm.table}, Dims(1, 1, 1, 64, 64, 0), 1.0, [],
                         bm.inputs.tensors)  # fmt: skip
    assert vals["t_slopes"] == 0 and vals["t_doc_q"].data_ptr() == doc.data_ptr()


LENS = (
    "name: lens_bm\nhead_dim: 64\ndtype: bf16\nmask: kv_idx < lens[b] || kv_idx < prefix\n"
    "params:\n  lens: {type: i32, shape: [batch]}\n  prefix: {type: i32, default: 0, min: 0}\n"
)


def test_varlen_ops_take_no_block_mask():
    """A varlen op neither builds a block mask nor takes one (its kernels read no table):
    both say so, naming block_mask; block_mask=None is the plain call."""
    op = flashgen.load(_write(LENS))
    lens = torch.tensor([30, 100], dtype=torch.int32)
    bm = op.block_mask(128, 128, lens=lens)
    cu = torch.tensor([0, 100, 228], dtype=torch.int32)
    q = torch.randn(228, 2, 64).bfloat16()
    msg = r"block_mask: op 'lens_bm__varlen' is a varlen op, which takes no block mask"
    with pytest.raises(OpInputError, match=msg):
        op.varlen.block_mask(128, 128, lens=lens)
    with pytest.raises(OpInputError, match=msg):
        op.varlen(q, q, q, cu, cu, 128, 128, lens=lens, block_mask=bm)
    o, _ = op.varlen(q, q, q, cu, cu, 128, 128, lens=lens, block_mask=None)
    assert o.shape == q.shape


def test_a_block_mask_of_the_other_positions_form_names_the_method_to_call():
    """A BlockMask of op.block_mask given to a call with q_offset (which runs op.offsets)
    says to build it with op.offsets.block_mask, and one of op.offsets.block_mask given to
    a call without offsets says to pass them or use op.block_mask, not the internal op's
    name."""
    op = flashgen.load(DOC)
    doc = docs(1, 256, 3)
    q = torch.randn(1, 2, 256, 128).bfloat16()
    qs, dq = q[:, :, 128:], doc[:, 128:]
    bm = op.block_mask(256, 256, doc_q=doc, doc_kv=doc)
    with pytest.raises(OpInputError, match=r"block_mask: built by op.block_mask\(\.\.\.\) for "
                       r"calls without offsets, .* op.offsets.block_mask\(seqlen_q, seqlen_k, "
                       r"\.\.\., q_offset=\.\.\."):  # fmt: skip
        op.attention(qs, q, q, doc_q=dq, doc_kv=doc, q_offset=128, block_mask=bm)
    bmo = op.offsets.block_mask(128, 256, doc_q=dq, doc_kv=doc, q_offset=128, kv_offset=0,
                                seqlen_q_global=256, seqlen_k_global=256)  # fmt: skip
    op.attention(qs, q, q, doc_q=dq, doc_kv=doc, q_offset=128, block_mask=bmo)
    with pytest.raises(OpInputError, match=r"block_mask: built by op.offsets.block_mask\(\.\.\.\) "
                       r"\(q_offset=128, kv_offset=0, .*\), but this call has none of q_offset"
                       r".* or build one with op.block_mask\(\.\.\.\)"):  # fmt: skip
        op.attention(qs, q, q, doc_q=dq, doc_kv=doc, block_mask=bmo)


def test_the_cpu_operator_checks_its_block_mask_table_as_cuda_does():
    """The CPU operator refuses a block_mask argument the CUDA one would (wrong dtype,
    shape, a bare table, one for other tiles), against the tiles op.block_mask builds CPU
    tables for, and takes bm.op_arg()."""
    from flashgen.ops.prefill.blockmask import table_arg

    op = flashgen.load(DOC)
    doc = docs(1, 256, 3)
    bm = op.block_mask(256, 256, doc_q=doc, doc_kv=doc)
    q = torch.randn(1, 2, 256, 128).bfloat16()
    run = lambda t: op.torch_op(q, q, q, 0.1, doc, doc, t)  # noqa: E731
    o, _ = run(bm.op_arg())
    assert torch.equal(o, op.torch_op(q, q, q, 0.1, doc, doc)[0])
    view = r"block_mask: expected the uint8 table view of op.block_mask\(\.\.\.\).op_arg\(\)"
    for bad in (torch.zeros(3), torch.zeros(*bm.shape, bm.block_m, bm.block_n), bm.table,
                table_arg(bm.table[:, :, :1], bm.block_m, bm.block_n)):  # fmt: skip
        with pytest.raises(OpInputError, match=view):
            run(bad)
    with pytest.raises(OpInputError, match=rf"block_mask: built for 64x64 tiles, but this call "
                       rf"runs a kernel with {bm.block_m}x{bm.block_n} tiles"):  # fmt: skip
        run(table_arg(bm.table, 64, 64))


def test_a_held_table_used_on_another_stream_is_recorded_there(monkeypatch):
    """A table the BlockMask holds, built on one stream (its fence) and taken by a backward on
    another, is waited for there and record_stream-ed there (the caching allocator must not
    reuse its memory before that stream is done with it once the mask drops it); on its own
    stream neither."""
    from types import SimpleNamespace

    from flashgen.codegen.plan import TileConfig
    from flashgen.ops.prefill import attention_blockmask as abm
    from flashgen.ops.prefill.blockmask import TableInputs

    op = flashgen.load(DOC)
    table = torch.zeros(1, 1, 2, 2, dtype=torch.uint8)
    calls = []

    class Stream:
        def wait_event(self, event):
            calls.append(("wait", event))

    stream = Stream()
    bm = SimpleNamespace(
        table=SimpleNamespace(device=torch.device("cuda", 0)),
        inputs=TableInputs(None, (), {}),
        held=lambda m, n, build: (table, (111, "build-event")),
    )
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, s: calls.append(("record", self.data_ptr(), s)))  # fmt: skip
    monkeypatch.setattr(abm, "current_stream_ptr", lambda device: 222)
    arg = op._held_table_arg(bm, TileConfig(64, 64, 4))
    assert arg.data_ptr() == table.data_ptr()
    assert calls == [("wait", "build-event"), ("record", table.data_ptr(), stream)]
    calls.clear()
    monkeypatch.setattr(abm, "current_stream_ptr", lambda device: 111)
    op._held_table_arg(bm, TileConfig(64, 64, 4))
    assert calls == []
