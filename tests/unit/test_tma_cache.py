"""The CUtensorMap descriptor cache (:class:`flashgen.runtime.tma.DescriptorCache`) with a fake
encoder: a hit calls no encoder, a change of any key field misses, the least recently
used entry is evicted first, a refused encoding is not stored, and
``flashgen.runtime.tma.set_cache_enabled(False)`` turns caching off.  No GPU, no driver."""

from __future__ import annotations

import pytest

from flashgen.runtime import tma
from flashgen.runtime.tma import SWIZZLE_128B, DescriptorCache, TmaError

BASE = {
    "device": 0,
    "data_ptr": 0x7F00_0000_0000,
    "shape": (2, 16, 1024, 128),
    "strides": (16 * 1024 * 128, 1024 * 128, 128, 1),
    "dtype": "bf16",
    "box_rows": 128,
    "swizzle": SWIZZLE_128B,
}


class FakeEncoder:
    """Records calls; returns 128 bytes derived from the arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, data_ptr, shape, strides, dtype, box_rows, name="tensor", swizzle=3):
        self.calls.append((data_ptr, tuple(shape), tuple(strides), dtype, box_rows, swizzle))
        tag = repr(self.calls[-1]).encode()
        return (tag * (128 // len(tag) + 1))[:128]


def get(cache, **over):
    a = {**BASE, **over}
    return cache.get(
        a["device"], a["data_ptr"], a["shape"], a["strides"], a["dtype"], a["box_rows"],
        name="q", swizzle=a["swizzle"],
    )  # fmt: skip


def test_hit_calls_no_encoder():
    enc = FakeEncoder()
    cache = DescriptorCache(encoder=enc)
    first = get(cache)
    assert len(first) == 128 and len(enc.calls) == 1
    assert get(cache) is first and len(enc.calls) == 1
    assert (cache.hits, cache.misses, len(cache)) == (1, 1, 1)


@pytest.mark.parametrize(
    "field, value",
    [
        ("device", 1),
        ("data_ptr", BASE["data_ptr"] + 256),
        ("shape", (2, 16, 1000, 128)),
        ("strides", (16 * 1024 * 128, 128, 16 * 128, 1)),  # (B, S, H, D) storage
        ("dtype", "fp16"),
        ("box_rows", 176),
        ("swizzle", 2),
    ],
)
def test_each_key_field_misses(field, value):
    enc = FakeEncoder()
    cache = DescriptorCache(encoder=enc)
    a = get(cache)
    b = get(cache, **{field: value})
    assert len(enc.calls) == 2
    assert (a == b) == (field == "device")  # the fake's bytes ignore the device
    assert cache.misses == 2 and cache.hits == 0 and len(cache) == 2
    assert get(cache, **{field: value}) is b and get(cache) is a  # both stay cached
    assert cache.hits == 2


def test_torch_size_and_list_keys_match_tuples():
    torch = pytest.importorskip("torch")
    enc = FakeEncoder()
    cache = DescriptorCache(encoder=enc)
    a = get(cache)
    assert get(cache, shape=torch.Size(BASE["shape"]), strides=list(BASE["strides"])) is a
    assert len(enc.calls) == 1


def test_same_address_and_geometry_after_free_is_the_same_descriptor():
    """The map holds only the address and geometry, so a new tensor at a freed one's
    address with the same geometry may (and does) reuse its descriptor."""
    enc = FakeEncoder()
    cache = DescriptorCache(encoder=enc)
    assert get(cache) is get(cache) and len(enc.calls) == 1


def test_least_recently_used_is_evicted_first():
    enc = FakeEncoder()
    cache = DescriptorCache(maxsize=3, encoder=enc)
    ptrs = [BASE["data_ptr"] + 1024 * i for i in range(4)]
    for p in ptrs[:3]:
        get(cache, data_ptr=p)
    get(cache, data_ptr=ptrs[0])  # 0 is now the most recently used; 1 the least
    get(cache, data_ptr=ptrs[3])  # evicts 1
    assert len(cache) == 3 and len(enc.calls) == 4
    for p in (ptrs[0], ptrs[2], ptrs[3]):
        get(cache, data_ptr=p)
    assert len(enc.calls) == 4  # all still cached
    get(cache, data_ptr=ptrs[1])
    assert len(enc.calls) == 5 and len(cache) == 3  # 1 was gone; re-encoded, 0 evicted now
    get(cache, data_ptr=ptrs[0])
    assert len(enc.calls) == 6


def test_default_bound_is_256():
    enc = FakeEncoder()
    cache = DescriptorCache(encoder=enc)
    for i in range(300):
        get(cache, data_ptr=BASE["data_ptr"] + 256 * i)
    assert len(cache) == 256 and cache.maxsize == 256
    get(cache, data_ptr=BASE["data_ptr"] + 256 * 299)
    assert len(enc.calls) == 300
    get(cache, data_ptr=BASE["data_ptr"])
    assert len(enc.calls) == 301


def test_refused_encoding_is_not_stored():
    calls = []

    def refuse(*a, **kw):
        calls.append(a)
        raise TmaError("cuTensorMapEncodeTiled failed (CUresult 1) for q")

    cache = DescriptorCache(encoder=refuse)
    for _ in range(2):
        with pytest.raises(TmaError, match="for q"):
            get(cache)
    assert len(calls) == 2 and len(cache) == 0


def test_disabled_encodes_every_time():
    from flashgen.runtime.tma import set_cache_enabled

    set_cache_enabled(False)  # what FLASHGEN_NO_TMA_CACHE=1 was
    try:
        enc = FakeEncoder()
        cache = DescriptorCache(encoder=enc)
        assert not cache.enabled
        get(cache)
        get(cache)
        assert len(enc.calls) == 2 and len(cache) == 0 and cache.misses == 2
    finally:
        set_cache_enabled(True)
    assert DescriptorCache().enabled


def test_clear_and_bad_size():
    enc = FakeEncoder()
    cache = DescriptorCache(encoder=enc)
    get(cache)
    cache.clear()
    assert len(cache) == 0 and cache.hits == cache.misses == 0
    get(cache)
    assert len(enc.calls) == 2
    with pytest.raises(ValueError, match="maxsize"):
        DescriptorCache(maxsize=0)


def test_encode_passes_geometry_box_and_swizzle_to_the_driver(monkeypatch):
    """:func:`tma.encode` through a fake ``cuTensorMapEncodeTiled`` that reads its ctypes
    arguments back."""
    import ctypes

    seen = {}

    def fake_encode(out, dtype, rank, addr, dims, strides, box, elem, inter, swz, l2, oob):
        seen.update(dtype=dtype, rank=rank, addr=addr.value, dims=list(dims[:4]),
                    strides=list(strides[:3]), box=list(box[:4]), elem=list(elem[:4]),
                    swizzle=swz, oob=oob)  # fmt: skip
        ctypes.memmove(out, bytes(range(128)), 128)
        return 0

    class Lib:
        cuTensorMapEncodeTiled = staticmethod(fake_encode)

    monkeypatch.setattr(tma, "driver", lambda: Lib)
    b, h, s, d = 2, 16, 1000, 128
    desc = tma.encode(0x7F00_0000_0000, (b, h, s, d), (s * h * d, d, h * d, 1), "fp16", 176,
                      swizzle=2)  # fmt: skip
    assert desc == bytes(range(128))
    assert seen == {
        "dtype": tma.DATA_TYPE["fp16"], "rank": 4, "addr": 0x7F00_0000_0000,
        "dims": [d, s, h, b], "strides": [2 * h * d, 2 * d, 2 * s * h * d],
        "box": [32, 176, 1, 1], "elem": [1, 1, 1, 1], "swizzle": 2, "oob": 0,
    }  # fmt: skip  (a box row is one 64-byte swizzle span: 32 fp16 columns)
    tma.encode(0x7F00_0000_0000, (b, h, s, d), (s * h * d, d, h * d, 1), "bf16", 128)
    assert seen["swizzle"] == SWIZZLE_128B and seen["dtype"] == tma.DATA_TYPE["bf16"]
    assert seen["box"] == [tma.BOX_COLS, 128, 1, 1]
    # e4m3: UINT8 elements, byte strides of 1-byte elements, 128 columns per 128-byte span
    tma.encode(0x7F00_0000_0000, (b, h, s, d), (s * h * d, d, h * d, 1), "fp8_e4m3", 128)
    assert seen["dtype"] == 0 and seen["box"] == [128, 128, 1, 1]
    assert seen["strides"] == [h * d, d, s * h * d]


def test_process_cache_uses_the_driver_encoder():
    assert isinstance(tma.descriptors, DescriptorCache) and tma.descriptors.encoder is tma.encode
