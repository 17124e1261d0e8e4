"""Streams, devices and CUDA graphs (``pytest -m gpu``).

* The op enqueues on the *current* stream without a host sync: on a side stream held
  busy by ``torch.cuda._sleep``, the op returns while the stream is still busy, and it
  sees data written earlier on that stream (it would not if it ran on another stream).
* Outputs live on the inputs' device, whatever the current device is.
* After a warm-up, the op is capturable in ``torch.cuda.graph`` (no sync, no host-side
  work that capture forbids) and replays give results identical to eager calls.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen import OpInputError  # noqa: E402
from flashgen.bench.verify import random_inputs  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
SLEEP_CYCLES = 200_000_000  # ~0.1 s at ~2 GHz


def load(name, options=None):
    """The op of shipped spec ``name`` (bound to ``options``, default the defaults)."""
    return flashgen.load(REPO / "specs" / f"{name}.yaml", options=options)


def inputs(op, seed=0, b=2, hq=4, hkv=2, sq=129, sk=77):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, params = random_inputs(op.spec, b, hq, hkv, sq, sk, torch.device("cuda"), gen)
    if "window" in op.param_names:
        params["window"] = 19
    return q, k, v, params


@pytest.mark.parametrize("name", ["causal_d128", "alibi", "mistral_swa"])
def test_runs_on_the_current_stream_without_host_sync(name):
    op = load(name)
    q_src, k, v, params = inputs(op, seed=1)
    expect, expect_lse = op.attention(q_src, k, v, **params)  # warm: kernel built and loaded
    torch.cuda.synchronize()

    side = torch.cuda.Stream()
    q = torch.zeros_like(q_src)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)  # keep the side stream busy
        q.copy_(q_src)  # ordered after the sleep, on the side stream
        o, lse = op.attention(q, k, v, **params)
        done = torch.cuda.Event()
        done.record(side)
        # the call returned while the side stream is still sleeping: no host sync
        assert not done.query(), "the op synchronized the host with the device"
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    # had the kernel run on another stream, it would have read q before the copy (zeros)
    assert torch.equal(o, expect) and torch.equal(lse, expect_lse)


def test_outputs_follow_the_input_device():
    op = load("causal_d128")
    n = torch.cuda.device_count()
    for idx in range(n):
        with torch.cuda.device(idx):
            q, k, v, _ = inputs(op, seed=2)
        with torch.cuda.device((idx + 1) % n):  # current device differs when n > 1
            o, lse = op.attention(q, k, v)
        assert o.device == q.device and lse.device == q.device
        torch.cuda.synchronize(q.device)
        ref, _ = op.attention(q.cpu(), k.cpu(), v.cpu())
        assert (o.cpu().double() - ref.double()).abs().max() < 3e-2


def test_cuda_tensor_scalar_param_is_refused_not_synced():
    op = load("mistral_swa")
    q, k, v, _ = inputs(op)
    with pytest.raises(OpInputError, match="window: expected a Python number"):
        op.attention(q, k, v, window=torch.tensor(5, device="cuda"))


@pytest.mark.parametrize("name", ["causal_d128", "alibi", "mistral_swa", "gemma2_softcap"])
def test_cuda_graph_capture_and_replay_match_eager(name):
    op = load(name)
    q, k, v, params = inputs(op, seed=3)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on the capture stream: build, load, allocate
        for _ in range(3):
            op.attention(q, k, v, **params)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        o_g, lse_g = op.attention(q, k, v, **params)

    for seed in (4, 5):
        q2, k2, v2, p2 = inputs(op, seed=seed)
        q.copy_(q2)
        k.copy_(k2)
        v.copy_(v2)
        for n, t in p2.items():
            if isinstance(t, torch.Tensor):
                params[n].copy_(t)
        g.replay()
        torch.cuda.synchronize()
        o_e, lse_e = op.attention(q2, k2, v2, **p2)
        torch.cuda.synchronize()
        assert torch.equal(o_g, o_e) and torch.equal(lse_g, lse_e), "graph != eager"


def test_graph_capture_with_poisoning_and_empty_rows():
    """Poisoning (a fill) and fully masked rows are capturable too."""
    from flashgen.ops.op import poison_outputs

    op = load("causal_d128")
    q, k, v, _ = inputs(op, seed=6, sq=100, sk=30)  # bottom-right causal: 70 empty rows
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with poison_outputs():
        with torch.cuda.stream(s):
            op.attention(q, k, v)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            o_g, lse_g = op.attention(q, k, v)
    g.replay()
    torch.cuda.synchronize()
    assert not o_g.isnan().any() and torch.isneginf(lse_g[:, :, :70]).all()
    o_e, lse_e = op.attention(q, k, v)
    assert torch.equal(o_g, o_e) and torch.equal(lse_g, lse_e)


def test_graphs_replayed_on_two_streams_at_once(monkeypatch):
    """The sparse calls' persistent kernel hands out tiles from a counter (the dynamic
    scheduler, the default): two graphs captured on one stream, replayed on two other streams
    at once while eager calls run on the capture stream, each get their own counter (a
    per-stream one would be shared by all three).  Every replay matches its eager call.
    Eight CTAs per launch (``Options.persistent_ctas``): the three kernels run side by side
    on the GPU for their whole length, so a shared counter would hand tiles of one launch to
    the CTAs of another (the session-12 per-stream counter failed here)."""
    import flashgen.ops.prefill.attention as op_mod

    op = load("mistral_swa", flashgen.Options(persistent_ctas=8))
    plans = []
    kernel = op.kernel

    def spy(device, **kw):
        kern = kernel(device, **kw)
        plans.append(kern.plan)
        return kern

    monkeypatch.setattr(op, "kernel", spy)
    shape = dict(b=2, hq=16, hkv=8, sq=4096, sk=4096)  # window 256: a sparse call, 512 tiles
    ins = [inputs(op, seed=20 + i, **shape) for i in range(3)]
    for _, _, _, p in ins:
        p["window"] = 256
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on the capture stream
        eager = [op.attention(q, k, v, **p) for q, k, v, p in ins]
    torch.cuda.synchronize()
    assert plans and all(p.context.get("scheduler") == "dynamic" for p in plans), plans
    counters = []
    tile_counter = op_mod._tile_counter
    monkeypatch.setattr(
        op_mod, "_tile_counter", lambda *a: counters.append(tile_counter(*a)) or counters[-1]
    )
    graphs, outs = [], []
    for q, k, v, p in ins[:2]:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            outs.append(op.attention(q, k, v, **p))
        graphs.append(g)
    assert len({c.data_ptr() for c in counters}) == 2  # one per captured call
    q, k, v, p = ins[2]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for _ in range(20):
        for st in (*streams, s):
            st.wait_stream(torch.cuda.current_stream())
        for g, st in zip(graphs, streams, strict=True):
            with torch.cuda.stream(st):
                g.replay()
        with torch.cuda.stream(s):
            o_e, lse_e = op.attention(q, k, v, **p)
        torch.cuda.synchronize()
        for (o_g, lse_g), (o_ref, lse_ref) in zip(outs, eager[:2], strict=True):
            assert torch.equal(o_g, o_ref) and torch.equal(lse_g, lse_ref), "replay != eager"
        assert torch.equal(o_e, eager[2][0]) and torch.equal(lse_e, eager[2][1])


def _in_private_pool(ptr: int) -> bool:
    """Whether device address ``ptr`` lies in a segment of one of the caching allocator's
    private pools (CUDA graphs, ``torch.cuda.MemPool``); False outside torch's memory."""
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)
    return False


def test_reduce_overhead_keeps_eager_tile_counters_out_of_graph_pools(monkeypatch):
    """``torch.compile(mode="reduce-overhead")`` (CUDA-graph trees) runs each new shape once
    eagerly first, with every allocation of the thread routed into the trees' private pool:
    the eager tile counter the op keeps per stream (the sparse calls' dynamic scheduler, the
    default) must not be created there, or a later recording, once the trees reset the pool
    to a checkpoint, hands its memory to graph tensors (as the trees clear cuBLAS's cached
    workspaces for).  Shapes alternate (warm-up, recording, replay of each, and a new
    recording after a replay); every compiled call equals the eager one."""
    import flashgen.ops.prefill.attention as op_mod

    monkeypatch.setattr(op_mod, "_COUNTERS", {})  # none made before: this test makes them
    op = load("mistral_swa")
    made = []  # (capturing, address) of every counter handed out
    tile_counter = op_mod._tile_counter

    def spy(device, stream):
        c = tile_counter(device, stream)
        ptr = c if isinstance(c, int) else c.data_ptr()
        made.append((torch.cuda.is_current_stream_capturing(), ptr))
        return c

    monkeypatch.setattr(op_mod, "_tile_counter", spy)
    torch._dynamo.reset()
    f = torch.compile(
        lambda q, k, v: op.attention(q, k, v, window=256), mode="reduce-overhead", dynamic=False
    )
    for i, s in enumerate([1024, 2048, 1024, 2048, 1024, 2048]):
        q, k, v, _ = inputs(op, seed=40 + i, b=1, hq=8, hkv=4, sq=s, sk=s)
        o, lse = (t.clone() for t in f(q, k, v))
        o_e, lse_e = op.attention(q, k, v, window=256)
        assert torch.equal(o, o_e) and torch.equal(lse, lse_e), f"call {i}, S={s}"
    torch._dynamo.reset()
    assert any(cap for cap, _ in made), "no call captured: did the trees run the op eagerly?"
    eager = {ptr for cap, ptr in made if not cap}
    assert eager, "no eager call made a counter (is the call sparse, the scheduler dynamic?)"
    inside = [hex(p) for p in eager if _in_private_pool(p)]
    assert not inside, f"eager tile counters in a CUDA-graph pool: {inside}"
