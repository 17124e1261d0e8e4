"""Scaling of flashgen.distributed.ring_attention over GPUs of one host (NCCL).

    flashgen bench --ring --gpus 2 [--tokens 32768,65536,131072]
        [--spec causal_d128] [--layouts zigzag,contiguous] [--modes ring]
        [--json out.json]

For each tokens-per-GPU ``T`` (the local length S_local), layout and mode it measures, on
``--gpus`` GPUs, the time of one forward and one forward + backward step of ring_attention
over the global sequence ``gpus * T``, and on one GPU the same work done alone: the
op on the whole ``gpus * T`` sequence, whose time divided by ``gpus`` is the ideal
per-GPU step.  Efficiency = (one-GPU time / gpus) / ring time (1.0: perfect scaling).
The ring side is timed on every rank with CUDA events after a barrier, over ``--iters``
iterations after ``--warmup``; the slowest rank's median counts.  A one-GPU run that does
not fit in memory is reported as such (the ring run still is).

The child processes (torch.multiprocessing spawn, one per GPU) get NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 (NVLink multicast off).
Causal specs run zigzag and contiguous; for a non-causal spec (``--spec bidir_d256``) the
layout only changes which rows a rank holds.  Prints a table and writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
from pathlib import Path

from flashgen.bench import argtypes, helptext

LAYOUTS = ("zigzag", "contiguous")  # flashgen.distributed.ring's, without importing torch
MODES = ("ring", "allgather")

NCCL_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time(fn, warmup: int, iters: int, barrier=None) -> float:
    """Median milliseconds of ``fn`` with CUDA events (``barrier`` before each iteration)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if barrier is not None:
            barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _inputs(spec, batch, heads, heads_kv, s, device, requires_grad):
    import torch

    dt = torch.bfloat16 if spec.dtype == "bf16" else torch.float16
    mk = lambda h: torch.randn(batch, h, s, spec.head_dim, device=device, dtype=dt)  # noqa: E731
    q, k, v = mk(heads), mk(heads_kv), mk(heads_kv)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _measure_ring(ring_attention, op, q, k, v, layout, mode, args, rank) -> dict:
    """Slowest rank's median ms of a forward and a forward + backward ring step."""
    import torch
    import torch.distributed as dist

    do = torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            ring_attention(op, q, k, v, layout=layout, mode=mode)

    def fwd_bwd():
        o, _ = ring_attention(op, q, k, v, layout=layout, mode=mode)
        o.backward(do)

    t = {}
    for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        ms = _time(fn, args.warmup, args.iters, dist.barrier)
        worst = torch.tensor([ms], device=f"cuda:{rank}")
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        t[name] = float(worst)
    return t


def _worker(rank, world, port, args, out_path):
    for k, v in NCCL_ENV.items():
        os.environ[k] = v
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    import torch
    import torch.distributed as dist

    import flashgen
    from flashgen.distributed import ring_attention

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device(rank))
    op = flashgen.load(args.spec)
    rows = []
    for tokens in args.tokens:
        for layout in args.layouts:
            for mode in args.modes:
                q, k, v = _inputs(op.spec, args.batch, args.heads, args.heads_kv, tokens,
                                  f"cuda:{rank}", True)  # fmt: skip
                t = _measure_ring(ring_attention, op, q, k, v, layout, mode, args, rank)
                del q, k, v
                rows.append({"tokens_per_gpu": tokens, "layout": layout, "mode": mode,
                             "ring_fwd_ms": t["fwd"], "ring_fwd_bwd_ms": t["fwd_bwd"]})  # fmt: skip
                torch.cuda.empty_cache()
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _single(args, tokens_global):
    """One GPU doing the whole work: (fwd ms, fwd+bwd ms) or None when it does not fit."""
    import torch

    import flashgen

    op = flashgen.load(args.spec)
    try:
        q, k, v = _inputs(op.spec, args.batch, args.heads, args.heads_kv, tokens_global,
                          "cuda:0", True)  # fmt: skip
        do = torch.randn_like(q)

        def fwd():
            with torch.no_grad():
                op(q, k, v)

        def fwd_bwd():
            o, _ = op(q, k, v)
            o.backward(do)

        return _time(fwd, args.warmup, args.iters), _time(fwd_bwd, args.warmup, args.iters)
    except torch.OutOfMemoryError:
        return None
    finally:
        torch.cuda.empty_cache()


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(
        prog=prog, description=helptext.plain(__doc__), formatter_class=helptext.HelpFormatter
    )
    ap.add_argument("--gpus", type=argtypes.positive_int("gpus"), default=2)
    ap.add_argument("--tokens", type=argtypes.positive_ints("tokens"),
                    default=[32768, 65536, 131072], help="tokens per GPU")  # fmt: skip
    ap.add_argument("--spec", default="causal_d128", help="a spec file or a shipped spec's name")
    ap.add_argument("--layouts", type=argtypes.choices("layouts", LAYOUTS), default=LAYOUTS)
    ap.add_argument("--modes", type=argtypes.choices("modes", MODES), default=("ring",))
    ap.add_argument("--batch", type=argtypes.positive_int("batch"), default=1)
    ap.add_argument("--heads", type=argtypes.positive_int("heads"), default=32)
    ap.add_argument("--heads-kv", type=argtypes.positive_int("heads-kv"), default=None,
                    help="default: --heads (no GQA)")  # fmt: skip
    ap.add_argument("--warmup", type=argtypes.nonnegative_int("warmup"), default=2)
    ap.add_argument("--iters", type=argtypes.positive_int("iters"), default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.heads_kv = args.heads_kv or args.heads
    if args.heads % args.heads_kv:
        ap.error(f"--heads-kv: expected a divisor of --heads {args.heads}, got {args.heads_kv}")
    odd = [t for t in args.tokens if t % 2]
    if "zigzag" in args.layouts and odd:
        ap.error(f"--tokens: layout zigzag splits each rank's tokens in two halves; expected "
                 f"even counts, got {odd[0]}")  # fmt: skip
    for k, v in NCCL_ENV.items():
        os.environ.setdefault(k, v)  # spawned children inherit it too

    import tempfile

    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < args.gpus:
        print(f"needs {args.gpus} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ring.json"
        mp.spawn(_worker, args=(args.gpus, _port(), args, str(out)), nprocs=args.gpus)
        rows = json.loads(out.read_text())
    singles = {t: _single(args, args.gpus * t) for t in args.tokens}
    print(f"{args.spec}, {args.gpus} GPUs, batch {args.batch}, heads {args.heads}/"
          f"{args.heads_kv}; efficiency = (1-GPU time / {args.gpus}) / ring time")  # fmt: skip
    print(f"{'tok/GPU':>8} {'layout':>10} {'mode':>9} {'fwd ms':>9} {'1GPU fwd':>9} {'eff':>5} "
          f"{'f+b ms':>9} {'1GPU f+b':>9} {'eff':>5}")  # fmt: skip
    for r in rows:
        one = singles[r["tokens_per_gpu"]]
        r["single_fwd_ms"], r["single_fwd_bwd_ms"] = one if one else (None, None)
        for key in ("fwd", "fwd_bwd"):
            s = r[f"single_{key}_ms"]
            r[f"eff_{key}"] = None if s is None else s / args.gpus / r[f"ring_{key}_ms"]
        fmt = lambda x, f: "  OOM" if x is None else format(x, f)  # noqa: E731
        print(f"{r['tokens_per_gpu']:>8} {r['layout']:>10} {r['mode']:>9} "
              f"{r['ring_fwd_ms']:9.2f} {fmt(r['single_fwd_ms'], '9.2f')} "
              f"{fmt(r['eff_fwd'], '5.2f')} {r['ring_fwd_bwd_ms']:9.2f} "
              f"{fmt(r['single_fwd_bwd_ms'], '9.2f')} {fmt(r['eff_fwd_bwd'], '5.2f')}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
