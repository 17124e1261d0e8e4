"""The dynamic persistent scheduler's tile counters without a GPU (``op._tile_counter``,
``runtime.device_zeros``), CuPy and torch.cuda's device / capture queries replaced by fakes:
eager launches get one counter per (device, stream), zeroed once on that stream, from memory
outside torch's caching allocator (so never in a CUDA-graph pool torch.compile's trees route
a warm-up's allocations to); a launch captured on its device's current stream, whichever
device is current, gets a fresh zeroed tensor.  tests/gpu/test_streams_graphs.py runs them."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from flashgen.ops.prefill import attention as op_mod  # noqa: E402
from flashgen.runtime import launch as runtime  # noqa: E402


class FakeCupy:
    """Records ``cuda.Device``, ``cuda.runtime.malloc`` and ``cuda.runtime.memsetAsync``."""

    def __init__(self):
        self.calls, self.base, self.device = [], 0x7F0000000000, None
        self.cuda = SimpleNamespace(
            Device=self._device,
            runtime=SimpleNamespace(malloc=self._malloc, memsetAsync=self._memset),
        )

    @contextlib.contextmanager
    def _device(self, index):
        prev, self.device = self.device, index
        yield
        self.device = prev

    def _malloc(self, n):
        self.base += 1 << 20
        self.calls.append(("malloc", self.device, n))
        return self.base

    def _memset(self, ptr, value, n, stream):
        self.calls.append(("memset", self.device, ptr, value, n, stream))


@pytest.fixture
def cupy(monkeypatch):
    fake = FakeCupy()
    monkeypatch.setattr(runtime, "_cupy", lambda: fake)
    monkeypatch.setattr(runtime, "_slabs", {})
    monkeypatch.setattr(op_mod, "_COUNTERS", {})
    return fake


def test_device_zeros_carves_slabs_and_zeroes_on_the_stream(cupy):
    ptrs = [runtime.device_zeros(8, 0, 0xAB) for _ in range(4096 // 16 + 1)]
    assert all(p % 16 == 0 for p in ptrs) and len(set(ptrs)) == len(ptrs)
    mallocs = [c for c in cupy.calls if c[0] == "malloc"]
    assert mallocs == [("malloc", 0, 4096)] * 2  # a second slab for the 257th
    memsets = [c for c in cupy.calls if c[0] == "memset"]
    assert memsets == [("memset", 0, p, 0, 16, 0xAB) for p in ptrs]
    other = runtime.device_zeros(64, 1, 0xCD)
    assert cupy.calls[-2:] == [("malloc", 1, 4096), ("memset", 1, other, 0, 64, 0xCD)]
    for bad in (0, 4097):
        with pytest.raises(ValueError, match="nbytes"):
            runtime.device_zeros(bad, 0, 0)


@pytest.fixture
def cuda(monkeypatch):
    """Fake torch.cuda device switching and capture query: ``state.capturing`` is the set of
    devices whose current stream captures."""
    state = SimpleNamespace(current=0, capturing=set(), zeros=[])

    @contextlib.contextmanager
    def device(index):
        prev, state.current = state.current, index
        yield
        state.current = prev

    def zeros(*shape, dtype=None, device=None):
        state.zeros.append((shape, dtype, device, state.current))
        return ("tensor", len(state.zeros))

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state.current)
    monkeypatch.setattr(
        torch.cuda, "is_current_stream_capturing", lambda: state.current in state.capturing
    )
    monkeypatch.setattr(torch, "zeros", zeros)
    return state


def test_eager_counters_one_per_device_and_stream_outside_torch(cupy, cuda):
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
    a = op_mod._tile_counter(d0, 0x10)
    assert isinstance(a, int) and op_mod._tile_counter(d0, 0x10) == a
    assert op_mod._tile_counter(torch.device("cuda"), 0x10) == a  # the current device's
    b, c = op_mod._tile_counter(d0, 0x20), op_mod._tile_counter(d1, 0x10)
    assert len({a, b, c}) == 3 and not cuda.zeros
    memsets = [(c[1], c[5]) for c in cupy.calls if c[0] == "memset"]
    assert memsets == [(0, 0x10), (0, 0x20), (1, 0x10)]  # each zeroed once, on its stream


def test_a_captured_launch_gets_a_fresh_tensor_on_its_own_device(cupy, cuda):
    cuda.capturing = {1}  # device 1's current stream captures; device 0 is current
    d1 = torch.device("cuda", 1)
    got = [op_mod._tile_counter(d1, 0x30) for _ in range(2)]
    assert got[0] != got[1] and all(g[0] == "tensor" for g in got)
    assert cuda.zeros == [((2,), torch.int32, d1, 1)] * 2 and cuda.current == 0
    assert isinstance(op_mod._tile_counter(torch.device("cuda", 0), 0x30), int)  # not capturing
    assert not [c for c in cupy.calls if c[0] == "malloc" and c[1] == 1]
