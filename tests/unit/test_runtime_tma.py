"""The Hopper (TMA) launch path of :mod:`flashgen.runtime.launch` without a GPU: a fake
``cuLaunchKernel`` reads the argument block back, a fake encoder stands in for
``cuTensorMapEncodeTiled`` and a fake CuPy for the device switch.

Every argument must reach the driver with the bytes the generic conversion
(:func:`flashgen.runtime.launch.kernel_args`, numpy) gives; warm launches on the same tensors
encode nothing; tensors TMA cannot read in place are mapped through a copy; the op's CUDA
impl wires its tensors and grid through.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from plan_helpers import plan_forward  # noqa: E402

import flashgen  # noqa: E402
from flashgen.ops import calls as calls_mod  # noqa: E402
from flashgen.ops.op import kernel_values, validate  # noqa: E402
from flashgen.ops.prefill import attention as op_mod  # noqa: E402
from flashgen.runtime import launch as runtime  # noqa: E402
from flashgen.runtime import tma  # noqa: E402
from flashgen.runtime.launch import LoadedKernel, kernel_args  # noqa: E402
from flashgen.runtime.tma import DescriptorCache  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
_SIZE = {"int64_t": 8, "int": 4, "float": 4, "CUtensorMap": 128}


class FakeEncoder:
    def __init__(self):
        self.calls = []

    def __call__(self, data_ptr, shape, strides, dtype, box_rows, name="tensor", swizzle=3):
        call = (data_ptr, tuple(shape), tuple(strides), dtype, box_rows, swizzle)
        self.calls.append(call)
        tag = repr(call).encode()
        return (tag * (128 // len(tag) + 1))[:128]


class FakeDriver:
    """``cuLaunchKernel`` that copies each argument's bytes out of the parameter array."""

    def __init__(self):
        self.launches = []
        self.rc = 0
        self.plan = None

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        args = []
        for i, a in enumerate(self.plan.args):
            size = 8 if a.ctype.endswith("*") else _SIZE[a.ctype]
            args.append(ctypes.string_at(params[i], size))
        addrs = [params[i] for i in range(len(self.plan.args))]
        self.launches.append(
            {"fn": fn, "grid": (gx, gy, gz), "block": (bx, by, bz), "smem": smem,
             "stream": stream, "args": args, "addrs": addrs, "extra": extra}
        )  # fmt: skip
        return self.rc


@pytest.fixture
def fake_gpu(monkeypatch):
    drv = FakeDriver()
    enc = FakeEncoder()
    monkeypatch.setattr(tma, "driver", lambda: drv)
    monkeypatch.setattr(tma, "descriptors", DescriptorCache(encoder=enc))
    state = types.SimpleNamespace(current=0, entered=[])

    class Device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            state.entered.append(self.index)
            return self

        def __exit__(self, *exc):
            return False

    cuda = types.SimpleNamespace(
        Device=Device, runtime=types.SimpleNamespace(getDevice=lambda: state.current)
    )
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    return types.SimpleNamespace(driver=drv, encoder=enc, device=state)


def load(name):
    return flashgen.load(REPO / "specs" / f"{name}.yaml")


def problem(spec, b=2, hq=4, hkv=2, sq=37, sk=53, seed=0):
    """q in (B, S, H, D) storage viewed as [B, H, S, D]; k, v contiguous; o, lse empty."""
    g = torch.Generator().manual_seed(seed)
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[spec.dtype]
    q = torch.randn(b, sq, hq, spec.head_dim, generator=g).to(dt).transpose(1, 2)
    k = torch.randn(b, hkv, sk, spec.head_dim, generator=g).to(dt)
    v = torch.randn(b, hkv, sk, spec.head_dim_v, generator=g).to(dt)
    o = torch.empty(b, hq, sq, spec.head_dim_v, dtype=dt)
    lse = torch.empty(b, hq, sq)
    tensors = {}
    sym = {"batch": b, "num_heads": hq, "num_heads_kv": hkv, "seqlen_q": sq, "seqlen_k": sk}
    for p in spec.tensor_params:
        shape = [d if isinstance(d, int) else sym[d] for d in p.shape]
        dt_p = torch.int32 if p.ty.value == "i32" else torch.float32
        tensors[p.name] = torch.zeros(shape, dtype=dt_p)
    scalars = [p.default for p in spec.scalar_params]
    dims = validate(spec, q, k, v, tensors)
    values = kernel_values(spec, {"q": q, "k": k, "v": v, "o": o, "lse": lse}, dims, 0.0883,
                           scalars, tensors)  # fmt: skip
    if any(a.name == "blk_tab" for a in plan_forward(spec, "sm_90").args):
        values.update(blk_tab=torch.zeros(4, 4, dtype=torch.uint8), blk_sb=3, blk_sh=0)
    return values


def expected_args(plan, values, enc: FakeEncoder) -> list[bytes]:
    """The bytes the generic numpy conversion gives, descriptors from the fake encoder."""
    maps = {}
    for m in plan.tma:
        t = values[m.tensor]
        maps[m.name] = enc(t.data_ptr(), t.shape, t.stride(), plan.context["dtype"], m.box_rows)
    enc.calls.clear()
    return [bytes(v) if isinstance(v, bytes) else v.tobytes()
            for v in kernel_args(plan, {**values, **maps})]  # fmt: skip


def kernel(plan, fn_ptr=0xF00D, device=0):
    return LoadedKernel(plan=plan, module=None, function=types.SimpleNamespace(ptr=fn_ptr),
                        device_index=device)  # fmt: skip


@pytest.mark.parametrize(
    "name", ["causal_d128", "alibi", "mistral_swa", "gemma2_softcap", "document_mask"]
)
def test_every_argument_reaches_the_driver_as_the_generic_conversion_packs_it(fake_gpu, name):
    spec = load(name).spec
    plan = plan_forward(spec, "sm_90")
    assert plan.tma, "expected the Hopper (TMA) kernel for sm_90"
    fake_gpu.driver.plan = plan
    values = problem(spec)
    want = expected_args(plan, values, fake_gpu.encoder)
    kern = kernel(plan)
    kern.launch((9, 1, 1), values, 1234)
    (got,) = fake_gpu.driver.launches
    assert got["args"] == want
    assert got["fn"] == 0xF00D and got["grid"] == (9, 1, 1) and got["stream"] == 1234
    assert got["block"] == (plan.threads, 1, 1) and got["smem"] == plan.smem_bytes
    assert got["extra"] is None
    # descriptors sit at 64-byte aligned addresses, like a device-side CUtensorMap
    for i, a in enumerate(plan.args):
        if a.ctype == "CUtensorMap":
            assert got["addrs"][i] % 64 == 0
    assert len(fake_gpu.encoder.calls) == len(plan.tma) == 3


def test_warm_launches_encode_nothing_and_new_tensors_do(fake_gpu):
    spec = load("causal_d128").spec
    plan = plan_forward(spec, "sm_90")
    fake_gpu.driver.plan = plan
    values = problem(spec)
    kern = kernel(plan)
    for _ in range(3):
        kern.launch((1, 1, 1), values, 0)
    enc, cache = fake_gpu.encoder, tma.descriptors
    assert len(enc.calls) == 3 and cache.hits == 6 and cache.misses == 3
    a = fake_gpu.driver.launches
    assert a[0]["args"] == a[1]["args"] == a[2]["args"]
    # a new q (other address): one new descriptor, and its bytes reach the driver
    values2 = problem(spec, seed=1)
    values2["k"], values2["v"] = values["k"], values["v"]
    values2 = {**values2, "k_sb": values["k_sb"], "k_sh": values["k_sh"], "k_ss": values["k_ss"]}
    want = expected_args(plan, values2, enc)
    kern.launch((1, 1, 1), values2, 0)
    assert a[-1]["args"] == want
    assert [c[0] for c in enc.calls] == [values2["q"].data_ptr()]


def test_tensor_tma_cannot_read_is_mapped_through_a_contiguous_copy(fake_gpu):
    spec = load("causal_d128").spec
    plan = plan_forward(spec, "sm_90")
    fake_gpu.driver.plan = plan
    values = problem(spec)
    b, h, s, d = values["q"].shape
    q = torch.zeros(b, h, s, d + 4, dtype=torch.bfloat16)[..., :d]  # 264-byte row stride
    assert tma.needs_copy(q.shape, q.stride(), 2, q.data_ptr())
    values.update(q=q, q_sb=q.stride(0), q_sh=q.stride(1), q_ss=q.stride(2))
    kern = kernel(plan)
    kern.launch((1, 1, 1), values, 0)
    q_call = [c for c in fake_gpu.encoder.calls if c[4] == plan.tma[0].box_rows][0]
    assert q_call[0] != q.data_ptr() and q_call[2] == (h * s * d, s * d, d, 1)
    # the pointer argument is still q itself (what the generic path passed too)
    (got,) = fake_gpu.driver.launches
    assert got["args"][0] == np.uint64(q.data_ptr()).tobytes()
    # the copy is not cached under q's geometry: the next launch copies and looks up again
    kern.launch((1, 1, 1), values, 0)
    assert not any(c[0] == q.data_ptr() for c in fake_gpu.encoder.calls)


def test_numpy_scalars_and_floats_for_ints_convert_like_kernel_args(fake_gpu):
    spec = load("gemma2_softcap").spec
    plan = plan_forward(spec, "sm_90")
    fake_gpu.driver.plan = plan
    values = problem(spec)
    want = expected_args(plan, values, fake_gpu.encoder)
    odd = dict(values, seqlen_q=np.int64(values["seqlen_q"]), batch=float(values["batch"]),
               softmax_scale=np.float64(values["softmax_scale"]))  # fmt: skip
    kernel(plan).launch((1, 1, 1), odd, 0)
    assert fake_gpu.driver.launches[-1]["args"] == want


def test_missing_argument_is_named(fake_gpu):
    spec = load("mistral_swa").spec
    plan = plan_forward(spec, "sm_90")
    fake_gpu.driver.plan = plan
    values = problem(spec)
    del values["p_window"]
    with pytest.raises(KeyError, match="kernel argument 'p_window'"):
        kernel(plan).launch((1, 1, 1), values, 0)


def test_driver_error_names_the_kernel(fake_gpu):
    spec = load("causal_d128").spec
    plan = plan_forward(spec, "sm_90")
    fake_gpu.driver.plan = plan
    fake_gpu.driver.rc = 700
    with pytest.raises(RuntimeError, match=rf"cuLaunchKernel\({plan.kernel_name}\).*700"):
        kernel(plan).launch((1, 1, 1), problem(spec), 0)


def test_switches_device_only_when_another_is_current(fake_gpu):
    spec = load("causal_d128").spec
    plan = plan_forward(spec, "sm_90")
    fake_gpu.driver.plan = plan
    values = problem(spec)
    kern = kernel(plan, device=1)
    fake_gpu.device.current = 1
    kern.launch((1, 1, 1), values, 0)
    assert fake_gpu.device.entered == []
    fake_gpu.device.current = 0
    kern.launch((1, 1, 1), values, 0)
    assert fake_gpu.device.entered == [1]
    # descriptors are cached per device: device 1's were encoded once
    assert len(fake_gpu.encoder.calls) == 3


def test_each_thread_packs_its_own_block(fake_gpu):
    spec = load("causal_d128").spec
    plan = plan_forward(spec, "sm_90")
    fake_gpu.driver.plan = plan
    values = problem(spec)
    kern = kernel(plan)
    kern.launch((1, 1, 1), values, 0)
    t = threading.Thread(target=kern.launch, args=((1, 1, 1), values, 0))
    t.start()
    t.join()
    a, b = fake_gpu.driver.launches
    assert a["args"] == b["args"] and set(a["addrs"]).isdisjoint(b["addrs"])


def test_cuda_impl_launches_its_outputs_on_the_current_stream(fake_gpu, monkeypatch):
    """``_cuda_impl`` end to end on CPU tensors: validation, outputs, kernel_values, grid
    and stream reach the (fake) driver."""
    op = load("mistral_swa")
    plan = plan_forward(op.spec, "sm_90")
    fake_gpu.driver.plan = plan
    monkeypatch.setattr(
        op, "kernel", lambda device, sparse=False, block_descale=False: kernel(plan)
    )
    monkeypatch.setattr(op_mod, "current_stream_ptr", lambda device: 4321)
    values = problem(op.spec)
    q, k, v = values["q"], values["k"], values["v"]
    o, lse = op._cuda_impl(q, k, v, 0.0883, 77)
    (got,) = fake_gpu.driver.launches
    b, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    grid = plan.grid(b, hq, sq, heads_kv=hkv, seqlen_k=sk)  # the grid carries the head groups
    assert got["grid"] == grid and grid[1] >= 1 and got["stream"] == 4321
    want = expected_args(plan, {**values, "o": o, "lse": lse, "p_window": 77}, fake_gpu.encoder)
    assert got["args"] == want
    assert o.shape == (b, hq, sq, op.spec.head_dim_v) and lse.shape == (b, hq, sq)


def test_current_stream_ptr_falls_back_without_raw_getter(monkeypatch):
    calls = []
    monkeypatch.setattr(calls_mod, "_RAW_STREAM", lambda index: calls.append(index) or 99)
    assert calls_mod.current_stream_ptr(torch.device("cuda", 3)) == 99 and calls == [3]
    monkeypatch.setattr(calls_mod, "_RAW_STREAM", None)
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=7)
    )
    assert calls_mod.current_stream_ptr(torch.device("cuda", 0)) == 7


def test_generic_path_is_untouched_for_kernels_without_tensor_maps():
    plan = plan_forward(load("causal_d128").spec, "sm_80")
    assert not plan.tma and runtime.LoadedKernel.launch  # CuPy's launcher, as before


def test_contiguous_but_unaligned_tensor_is_copied_to_an_aligned_address(fake_gpu):
    """A contiguous view at a storage offset that is not a multiple of 16 bytes needs a
    copy too (TMA wants a 16-byte aligned global address): ``t.contiguous()`` would return
    the view itself and encode its unaligned address."""
    spec = load("causal_d128").spec
    plan = plan_forward(spec, "sm_90")
    fake_gpu.driver.plan = plan
    values = problem(spec)
    b, h, s, d = values["k"].shape
    k = torch.zeros(b * h * s * d + 1, dtype=torch.bfloat16)[1:].view(b, h, s, d)
    assert k.is_contiguous() and k.data_ptr() % 16 == 2
    assert tma.needs_copy(k.shape, k.stride(), 2, k.data_ptr())
    values.update(k=k)
    kernel(plan).launch((1, 1, 1), values, 0)
    calls = fake_gpu.encoder.calls
    assert calls and all(c[0] % 16 == 0 for c in calls), calls
