"""flashgen.distributed.ring_attention on CPU: gloo, 2 and 4 processes (torch.multiprocessing).

Each worker builds the same global q, k, v, shards them, runs ring_attention forward and
backward, and compares o, lse, dq, dk, dv with its rows of the single-process CPU op on the
whole sequence.  One spawn per world size runs every case (process start-up dominates): the
two-rank tests (the cases and the refusals) share one spawn, each its own process group."""

from __future__ import annotations

import os
import socket
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SPECS = Path(__file__).resolve().parents[2] / "specs"
TOL = {"atol": 2e-5, "rtol": 1e-5}  # float32 on CPU: both sides compute in float32


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank, world, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _docs(s: int, seed: int) -> torch.Tensor:
    """Document ids with uneven lengths (boundaries fall anywhere in the ranks' chunks)."""
    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < s:
        n = int(torch.randint(3, max(4, s // 3), (1,), generator=g))
        lengths.append(n)
        total += n
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:s]
    return ids.view(1, s).int()


def _case_params(name, s, h):
    """(params, q-sharded names, kv-sharded names) of each case's spec."""
    if name == "mistral_swa":
        return {"window": 37}, (), ()
    if name == "chunked_local":
        return {"chunk": 40}, (), ()
    if name == "alibi":  # trainable slopes: their gradient is summed over the ranks
        return {"slopes": torch.linspace(0.05, 0.5, h).requires_grad_()}, (), ()
    if name == "gpt_oss_sink":  # a trainable sink per head: joined once, after the merge
        return {"sinks": torch.linspace(-1.0, 2.0, h).requires_grad_()}, (), ()
    if name == "gemma2_softcap":  # a trainable 0-d scalar
        return {"softcap": torch.tensor(7.0, requires_grad=True)}, (), ()
    if name == "document_mask":
        doc = _docs(s, 7)
        return {"doc_q": doc, "doc_kv": doc}, ("doc_q",), ("doc_kv",)
    return {}, (), ()


def _check_case(rank, world, name, layout, mode, hkv, s_local=48):
    import flashgen
    from flashgen.distributed import ring_attention, shard_sequence

    op = flashgen.load(SPECS / f"{name}.yaml")
    s, h, d = world * s_local, 4, op.spec.head_dim
    g = torch.Generator().manual_seed(zlib.crc32(f"{name} {layout} {mode}".encode()))
    q = torch.randn(2, h, s, d, generator=g)
    k, v = (torch.randn(2, hkv, s, d, generator=g) for _ in range(2))
    do = torch.randn(2, h, s, d, generator=g)
    dlse = torch.randn(2, h, s, generator=g)
    params, qn, kn = _case_params(name, s, h)
    if name == "document_mask":
        params = {n: t.expand(2, s).contiguous() for n, t in params.items()}
    qf, kf, vf = (t.clone().requires_grad_(True) for t in (q, k, v))
    o, lse = op(qf, kf, vf, **params)
    ((o * do).sum() + (lse * dlse).sum()).backward()

    def sh(t, dim=2):
        return shard_sequence(t, rank, world, dim=dim, layout=layout)

    ql, kl, vl = (sh(t).requires_grad_(True) for t in (q, k, v))
    def mine(n, t):  # this rank's param: sharded, or a fresh leaf of its own
        if n in qn or n in kn:
            return sh(t, 1)
        return t.detach().clone().requires_grad_(t.requires_grad) if torch.is_tensor(t) else t

    local = {n: mine(n, t) for n, t in params.items()}
    ol, ll = ring_attention(op, ql, kl, vl, layout=layout, mode=mode, **local)
    ((ol * sh(do)).sum() + (ll * sh(dlse)).sum()).backward()
    what = f"{name} {layout} {mode} world {world} rank {rank}"
    checks = [
        (ol, sh(o), "o"), (ll, sh(lse), "lse"), (ql.grad, sh(qf.grad), "dq"),
        (kl.grad, sh(kf.grad), "dk"), (vl.grad, sh(vf.grad), "dv"),
    ]  # fmt: skip
    checks += [
        (local[n].grad, t.grad, f"d{n}") for n, t in params.items()
        if torch.is_tensor(t) and t.requires_grad
    ]  # fmt: skip
    for got, want, label in checks:
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, w=label: f"{what} {w}: {m}")


CASES_2 = [
    ("causal_d128", "zigzag", "ring", 4),
    ("causal_d128", "contiguous", "ring", 4),
    ("causal_d128", "zigzag", "allgather", 4),
    ("mistral_swa", "zigzag", "ring", 4),
    ("chunked_local", "contiguous", "ring", 4),
    ("document_mask", "zigzag", "ring", 4),
    ("document_mask", "contiguous", "allgather", 4),
    ("alibi", "zigzag", "ring", 4),
    ("alibi", "contiguous", "allgather", 2),
    ("gemma2_softcap", "zigzag", "ring", 2),
    ("gpt_oss_sink", "zigzag", "ring", 2),
    ("llama3_gqa", "zigzag", "ring", 2),
]
CASES_4 = [
    ("causal_d128", "zigzag", "ring", 4),
    ("mistral_swa", "contiguous", "ring", 4),
    ("document_mask", "zigzag", "ring", 4),
    ("llama3_gqa", "zigzag", "allgather", 1),
]


def _worker(rank, world, port, cases):
    _init(rank, world, port)
    try:
        for case in cases:
            _check_case(rank, world, *case)
    finally:
        dist.destroy_process_group()


#: the two-rank parts, run one after another by one pair of processes (:func:`two_ranks`)
TWO_RANK_PARTS = ("cases", "bad", "disagree", "replaced")


def _two_rank_worker(rank, world, ports, out):
    """Each part in turn, each with its own process group (on its own port): a spawn's
    process start-up (torch's import) costs more than most parts, so the two-rank tests
    share one.  A part writes ``out/<part>.<rank>``: ``ok``, or its traceback, and then the
    process exits with the error (mp.spawn stops the other rank, as a test of its own
    would; the later parts do not run)."""
    import traceback

    runs = {
        "cases": lambda port: _worker(rank, world, port, CASES_2),
        "bad": lambda port: _bad_worker(rank, world, port),
        "disagree": lambda port: _disagree_worker(rank, world, port),
        "replaced": lambda port: _replaced_worker(rank, world, port, out),
    }
    for part, port in zip(TWO_RANK_PARTS, ports, strict=True):
        try:
            runs[part](port)
        except BaseException:
            (Path(out) / f"{part}.{rank}").write_text(traceback.format_exc())
            raise
        (Path(out) / f"{part}.{rank}").write_text("ok")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One spawn of two processes for every two-rank test of this file: (out folder, the
    spawn's error or None)."""
    out = tmp_path_factory.mktemp("ring2")
    ports = [_port() for _ in TWO_RANK_PARTS]
    try:
        mp.spawn(_two_rank_worker, args=(2, ports, str(out)), nprocs=2)
    except Exception as e:  # noqa: BLE001 - each test reports its own part's outcome
        return out, e
    return out, None


def _two_rank_part(two_ranks, part):
    out, error = two_ranks
    for rank in (0, 1):
        got = out / f"{part}.{rank}"
        if not got.exists():
            pytest.fail(f"rank {rank} has no result for {part!r} (it failed on the other rank, "
                        f"or an earlier part failed):\n{error}")  # fmt: skip
        if got.read_text() != "ok":
            pytest.fail(f"rank {rank}, {part}:\n{got.read_text()}")


@pytest.mark.parametrize("world", [2, 4], ids=["2ranks", "4ranks"])
def test_ring_matches_single_process(world, request):
    """o, lse, dq, dk, dv (lse's gradient included) equal the single-process CPU op on the
    gathered sequence: causal (both layouts, ring and allgather), sliding window, chunked,
    document mask with uneven documents, ALiBi, GQA; and the gradients of trainable ALiBi
    slopes, a trainable softcap scalar and trainable sinks."""
    if world == 2:
        _two_rank_part(request.getfixturevalue("two_ranks"), "cases")
    else:
        mp.spawn(_worker, args=(world, _port(), CASES_4), nprocs=world)


def _bad_worker(rank, world, port):
    import flashgen
    from flashgen.distributed import ring_attention
    from flashgen.frontend.errors import OpInputError

    _init(rank, world, port)
    op = flashgen.load(SPECS / "mistral_swa.yaml")
    try:

        def expect(match, **kw):
            s = kw.pop("s", 16)
            q = torch.randn(1, 2, s, 128)
            with pytest.raises(OpInputError, match=match):
                ring_attention(op, q, q, q, **kw)

        # ranks with different shapes: the message names the multiple to pad to
        expect(r"S_local.*rank 0 has 16 and rank 1 has 18.*multiple of 4", s=16 + 2 * rank)
        expect("needs an even S_local", s=15)  # zigzag, odd length on every rank
        expect(r"layout: expected the same value.*rank 1 has 'contiguous'",
               layout="zigzag" if rank == 0 else "contiguous")  # fmt: skip
        # one rank refuses its own params: it raises its error, the other rank says so
        expect(r"window|rank\(s\) \[1\] of the group refused",
               window=4096 if rank == 0 else 0)  # fmt: skip
        expect("layout: expected one of", layout="diagonal")
        # a meta q on one rank (the fake kernel would take it): refused before the ring, not
        # left to fail inside it while the other rank waits for its blocks
        q = torch.randn(1, 2, 16, 128, dtype=torch.bfloat16, device="meta" if rank else "cpu")
        mine = r"q: expected a tensor on cpu or cuda.*got device meta" if rank else \
            r"rank\(s\) \[1\] of the group refused"  # fmt: skip
        with pytest.raises(OpInputError, match=mine):
            ring_attention(op, q, q, q, window=7)
        # a group this rank is not in: raised at once; rank 0 alone is a ring of one
        solo = dist.new_group([0])
        q = torch.randn(1, 2, 16, 128)
        if rank == 1:
            with pytest.raises(OpInputError, match="not a member of the group"):
                ring_attention(op, q, q, q, group=solo)
        else:
            o, _ = ring_attention(op, q, q, q, group=solo, window=7)
            torch.testing.assert_close(o, op(q, q, q, window=7)[0], **TOL)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_bad_input_raises_on_every_rank(two_ranks):
    _two_rank_part(two_ranks, "bad")


def _disagree_worker(rank, world, port):
    """Issue 38, item 6: ranks that disagree on ``softmax_scale`` or a param's value each
    returned an answer, and a rank raising anything but ``OpInputError`` before the
    exchange (``op=None``, a scale that is no number) left the others in ``all_gather``.
    The process group times out after 30 s, so a rank left waiting fails the test."""
    import datetime

    import flashgen
    from flashgen.distributed import ring_attention
    from flashgen.frontend.errors import OpInputError

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))  # fmt: skip
    swa = flashgen.load(SPECS / "mistral_swa.yaml")
    alibi = flashgen.load(SPECS / "alibi.yaml")
    try:
        q = torch.randn(1, 2, 16, 128)

        def expect(match, op=swa, q_=q, **kw):
            with pytest.raises(OpInputError, match=match):
                ring_attention(op, q_, q_, q_, **kw)

        expect(r"softmax_scale: expected the same value on every rank.*rank 0 has 0.125 and "
               r"rank 1 has 0.25", softmax_scale=0.125 * (1 + rank))  # fmt: skip
        expect(r"params \(the spec's scalar params\): expected the same value on every rank",
               window=7 + rank)  # fmt: skip
        expect(r"params \(the spec's tensor params", op=alibi,
               slopes=torch.tensor([0.5, 0.25 + rank]))  # fmt: skip
        mine = "op: expected a flashgen op" if rank == 1 else r"rank\(s\) \[1\] of the group"
        expect(mine, op=None if rank == 1 else swa)
        mine = "softmax_scale" if rank == 0 else r"rank\(s\) \[0\] of the group refused"
        expect(mine, softmax_scale="abc" if rank == 0 else None)
        # rank 0 under no_grad would skip the backward rank 1's ring waits in
        qg = q.clone().requires_grad_()
        with torch.set_grad_enabled(rank == 1):
            expect(r"q/k/v requires_grad.*rank 0 has 0 and rank 1 has 1", q_=qg, window=7)
        o, _ = ring_attention(swa, q, q, q, window=7, softmax_scale=0.2)  # agreement: runs
        assert torch.isfinite(o).all()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ranks_that_disagree_or_raise_anything_raise_on_every_rank(two_ranks):
    _two_rank_part(two_ranks, "disagree")


def _replaced_worker(rank, world, port, tmp):
    """Issue 38, item 2, across ranks: a result ring_attention computed before every rank
    reloaded the edited spec has a backward that would run the new spec's backward
    operator; it raises the replaced op's error on every rank, before any collective."""
    import datetime

    import flashgen
    from flashgen.distributed import ring_attention

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))  # fmt: skip
    path = Path(tmp) / f"ring_reload_{rank}.yaml"
    path.write_text("name: ring_reload\nhead_dim: 64\ndtype: bf16\nmask: causal\n")
    try:
        op = flashgen.load(path)
        q = torch.randn(1, 2, 8, 64, requires_grad=True)
        o, _ = ring_attention(op, q, q, q)
        path.write_text("name: ring_reload\nhead_dim: 64\ndtype: bf16\n")  # mask: null
        assert flashgen.load(path).offsets is not None  # the new spec's operators registered
        with pytest.raises(RuntimeError, match="reloaded the edited spec"):
            o.sum().backward()
            pytest.fail("the ring backward of a replaced op ran")
        assert q.grad is None
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_the_backward_of_a_replaced_ops_ring_result_raises_on_every_rank(two_ranks):
    _two_rank_part(two_ranks, "replaced")


def test_shard_sequence_refuses_ranks_outside_the_world():
    """Issue 38, item 13: ``rank=-1`` returned rank 1's rows (Python's negative index),
    ``rank == world_size`` rows past the sequence in zigzag, ``world_size=0`` a
    ZeroDivisionError."""
    from flashgen.distributed import shard_sequence
    from flashgen.frontend.errors import OpInputError

    x = torch.arange(16).view(1, 1, 16, 1)
    for rank, world, what in [(-1, 2, "rank"), (2, 2, "rank"), (0, 0, "world_size"),
                              (0, -2, "world_size"), (True, 2, "rank"), (0, 2.0, "world_size"),
                              (1.0, 2, "rank")]:  # fmt: skip
        for layout in ("zigzag", "contiguous"):
            with pytest.raises(OpInputError, match=f"^{what}: expected"):
                shard_sequence(x, rank, world, layout=layout)
    with pytest.raises(OpInputError, match="^dim: expected one of x's 4 dims"):
        shard_sequence(x, 0, 2, dim=4)
    assert shard_sequence(x, 1, 2).flatten().tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
