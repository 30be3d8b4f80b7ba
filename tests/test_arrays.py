"""CPU tests of kvcanary.interop.arrays and kvcanary.interop.dlpack: every input kind, ownership, byte views."""

from __future__ import annotations

import ctypes
import gc
import weakref
from types import SimpleNamespace

import numpy as np
import pytest

from kvcanary.errors import ValidationError, ValidationTypeError
from kvcanary.interop import dlpack
from kvcanary.interop.arrays import as_view, from_pointer
from kvcanary.interop.dtypes import resolve_dtype
from kvcanary.ops.sources import rows_view


def addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class Producer:
    """A DLPack producer that delegates to a numpy array (or returns a prepared capsule)."""

    def __init__(self, array=None, capsule=None, device=(dlpack.kDLCPU, 0)):
        self.array, self.capsule, self.device, self.calls = array, capsule, device, []

    def __dlpack__(self, **kwargs):
        self.calls.append(kwargs)
        if self.capsule is not None:
            capsule, self.capsule = self.capsule, None
            return capsule
        kwargs.pop("stream", None)
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.device


class Counted:
    """An owner whose finalisation is counted, to prove a deleter ran exactly once."""

    deaths = 0

    def __init__(self, payload=None):
        self.payload = payload

    def __del__(self):
        Counted.deaths += 1


@pytest.fixture(autouse=True)
def _reset_counter():
    Counted.deaths = 0


# ---- numpy ---------------------------------------------------------------------------------------
def test_numpy_contiguous():
    a = np.arange(24, dtype=np.int64).reshape(2, 3, 4)
    v = as_view(a, name="a")
    assert (v.ptr, v.shape, v.strides) == (addr(a), (2, 3, 4), (96, 32, 8))
    assert v.dtype == np.int64 and v.dtype_name == "int64" and v.device is None
    assert v.host is a and v.owner is a and not v.readonly and v.stream is None
    assert v.is_c_contiguous() and v.numel == 24 and v.itemsize == 8 and v.nbytes_span == 192
    assert as_view(v, name="again") is v


def test_numpy_strided_and_sliced():
    base = np.arange(60, dtype=np.float32).reshape(6, 10)
    s = base[1::2, 3:9:3]
    v = as_view(s, name="s")
    assert v.ptr == addr(base) + (1 * 10 + 3) * 4
    assert v.shape == (3, 2) and v.strides == (80, 12)
    assert not v.is_c_contiguous()
    assert v.nbytes_span == 2 * 80 + 12 + 4
    np.testing.assert_array_equal(v.host, s)
    rev = as_view(base[::-1], name="rev")
    assert rev.strides == (-40, 4) and rev.ptr == addr(base) + 5 * 40 and rev.nbytes_span == 240


def test_numpy_readonly_flag():
    a = np.zeros(4, np.uint8)
    a.setflags(write=False)
    assert as_view(a, name="a").readonly
    assert not as_view(np.zeros(4, np.uint8), name="b").readonly


def test_numpy_object_dtype_rejected():
    with pytest.raises(ValidationTypeError, match=r"^kv-canary: x: expected .*got .*Fix:"):
        as_view(np.array([object()]), name="x")


def test_unknown_kind_names_argument_and_kinds():
    with pytest.raises(ValidationTypeError) as e:
        as_view([1, 2, 3], name="req_to_token")
    msg = str(e.value)
    assert msg.startswith("kv-canary: req_to_token: expected ") and "builtins.list" in msg
    assert "__cuda_array_interface__" in msg and "__dlpack__" in msg and "Fix:" in msg


# ---- DLPack import -------------------------------------------------------------------------------
@pytest.mark.parametrize("versioned", [False, True])
def test_dlpack_producer_keeps_data_alive(versioned):
    base = np.arange(40, dtype=np.int32)            # owns the memory (weakref target)
    a = base.reshape(4, 10)[:, 2:8:2]
    expect = a.copy()
    producer = Producer(a)
    if not versioned:                       # a producer that predates max_version: TypeError
        producer.__dlpack__ = lambda: a.__dlpack__()  # noqa: F821 (the cell, emptied by del a below: holds nothing)
    v = as_view(producer, name="a")
    assert (v.ptr, v.shape, v.strides) == (addr(a), (4, 3), (40, 8))
    assert v.dtype == np.int32 and v.device is None and not v.readonly
    assert v.owner.capsule is not None and v.owner.producer is producer
    capsule_name = dlpack._get_name(v.owner.capsule)
    assert capsule_name == (b"used_dltensor_versioned" if versioned else b"used_dltensor")
    if versioned:
        assert producer.calls == [{"max_version": (1, 1)}]
    alive = weakref.ref(base)
    del a, base, producer
    gc.collect()
    assert alive() is not None              # the managed tensor still holds the array
    np.testing.assert_array_equal(v.host, expect)
    del v
    gc.collect()
    assert alive() is None                  # the deleter ran and released it


def test_raw_numpy_capsule_and_readonly_versioned():
    a = np.arange(6, dtype=np.uint16)
    v = as_view(a.__dlpack__(), name="cap")
    assert (v.ptr, v.shape, v.strides, v.dtype_name) == (addr(a), (6,), (2,), "uint16")
    a.setflags(write=False)
    r = as_view(a.__dlpack__(max_version=(1, 0)), name="ro")
    assert r.readonly and not r.host.flags.writeable
    np.testing.assert_array_equal(r.host, np.arange(6))


def test_dlpack_consumed_capsule_rejected():
    cap = np.zeros(3).__dlpack__()
    as_view(cap, name="first")
    with pytest.raises(ValidationTypeError, match="used_dltensor.*Fix: call __dlpack__"):
        as_view(cap, name="second")


def test_dlpack_stream_only_passed_to_cuda_producers():
    a = np.arange(4, dtype=np.uint8)
    cpu = Producer(a)
    as_view(cpu, name="cpu", stream=7)
    assert "stream" not in cpu.calls[0]
    cap = dlpack.make_capsule(0x1000, (4,), np.uint8, dlpack.kDLCUDA, 1, a, versioned=True)
    gpu = Producer(capsule=cap, device=(dlpack.kDLCUDA, 1))
    v = as_view(gpu, name="gpu", stream=7)
    assert gpu.calls[0] == {"max_version": (1, 1), "stream": 7}
    assert v.device == 1 and v.host is None and v.ptr == 0x1000 and v.stream is None


def test_dlpack_unsupported_device_rejected_and_freed():
    owner = Counted()
    cap = dlpack.make_capsule(0x1000, (4,), np.uint8, 4, 0, owner)   # kDLOpenCL
    del owner
    with pytest.raises(ValidationTypeError, match="got DLPack device OpenCL:0"):
        as_view(cap, name="x")
    del cap
    gc.collect()
    assert Counted.deaths == 1


def test_dlpack_cuda_host_is_host_and_managed_is_device():
    a = np.arange(8, dtype=np.uint8)
    h = as_view(dlpack.make_capsule(addr(a), (8,), np.uint8, dlpack.kDLCUDAHost, 0, a), name="h")
    assert h.device is None and h.host is not None
    np.testing.assert_array_equal(h.host, a)
    m = as_view(dlpack.make_capsule(0x2000, (8,), np.uint8, dlpack.kDLCUDAManaged, 3, a), name="m")
    assert m.device == 3 and m.host is None


def _patch_managed(capsule, versioned, **fields):
    name = b"dltensor_versioned" if versioned else b"dltensor"
    ptr = dlpack._get_pointer(capsule, name)
    managed = (dlpack.DLManagedTensorVersioned if versioned else dlpack.DLManagedTensor)
    m = managed.from_address(ptr)
    for key, value in fields.items():
        if key == "major":
            m.version.major = value
        else:
            setattr(m.dl_tensor.dtype, key, value)
    return m


def test_dlpack_major_version_2_rejected_without_consuming():
    cap = np.zeros(2).__dlpack__(max_version=(1, 0))
    m = _patch_managed(cap, True, major=2)
    with pytest.raises(ValidationError, match="expected a DLPack 1.x capsule, got version 2"):
        as_view(cap, name="x")
    assert dlpack._is_valid(cap, b"dltensor_versioned")      # still the producer's to free
    m.version.major = 1


def test_dlpack_dtypes_map_to_stand_ins():
    a = np.zeros((2, 3), np.uint8)
    cap = a.__dlpack__()
    _patch_managed(cap, False, code=10)                     # kDLFloat8_e4m3fn
    v = as_view(cap, name="fp8")
    assert v.dtype == np.uint8 and v.dtype_name == "float8_e4m3fn" and v.strides == (3, 1)
    cap = a.__dlpack__()
    _patch_managed(cap, False, code=99)
    assert as_view(cap, name="x").dtype_name == "dlpack(99,8)"
    cap = a.__dlpack__()
    _patch_managed(cap, False, code=17, bits=4)
    with pytest.raises(ValidationTypeError, match="packed sub-byte"):
        as_view(cap, name="fp4")


# ---- DLPack export -------------------------------------------------------------------------------
def test_make_capsule_roundtrip_through_numpy_deleter_once():
    buf = np.arange(12, dtype=np.float32)
    owner = Counted(buf)
    cap = dlpack.make_capsule(addr(buf), (3, 4), np.float32, dlpack.kDLCPU, 0, owner)
    del owner
    out = np.from_dlpack(Producer(capsule=cap))
    assert addr(out) == addr(buf)
    np.testing.assert_array_equal(out, np.arange(12, dtype=np.float32).reshape(3, 4))
    buf[5] = 99.0                                # zero copy: the consumer sees the write
    assert out[1, 1] == 99.0
    del cap
    gc.collect()
    assert Counted.deaths == 0                   # the consumer still holds the tensor
    del out
    gc.collect()
    assert Counted.deaths == 1


def test_make_capsule_versioned_strided_readonly_bf16():
    buf = np.arange(32, dtype=np.uint16)
    cap = dlpack.make_capsule(addr(buf) + 2, (4, 3), "torch.bfloat16", dlpack.kDLCUDA, 2, buf,
                              strides_bytes=(16, 4), readonly=True, versioned=True)
    m = _patch_managed(cap, True)
    assert (m.dl_tensor.dtype.code, m.dl_tensor.dtype.bits, m.dl_tensor.dtype.lanes) == (4, 16, 1)
    assert m.flags & dlpack.FLAG_READ_ONLY and m.dl_tensor.device.device_id == 2
    v = as_view(cap, name="bf16")
    assert (v.ptr, v.shape, v.strides) == (addr(buf) + 2, (4, 3), (16, 4))
    assert v.dtype_name == "bfloat16" and v.dtype == np.uint16 and v.readonly and v.device == 2


def test_make_capsule_unconsumed_frees_once_even_during_an_exception():
    def drop_while_raising():
        return [dlpack.make_capsule(0x1000, (2,), np.int64, dlpack.kDLCUDA, 0, Counted())][0] + 1

    with pytest.raises(TypeError, match="unsupported operand"):
        drop_while_raising()
    gc.collect()
    assert Counted.deaths == 1


def test_make_capsule_rejects_bad_requests():
    with pytest.raises(ValidationError, match="versioned=True"):
        dlpack.make_capsule(0x1000, (2,), np.uint8, dlpack.kDLCUDA, 0, None, readonly=True)
    with pytest.raises(ValidationError, match="multiples of the element size 4"):
        dlpack.make_capsule(0x1000, (2,), np.int32, dlpack.kDLCUDA, 0, None, strides_bytes=(6,))
    with pytest.raises(ValidationError, match="non-NULL pointer"):
        dlpack.make_capsule(0, (2,), np.int32, dlpack.kDLCUDA, 0, None)
    with pytest.raises(ValidationTypeError, match="DLPack-representable"):
        dlpack.make_capsule(0x1000, (2,), "mystery", dlpack.kDLCUDA, 0, None)


# ---- __cuda_array_interface__ --------------------------------------------------------------------
class FakeCai:
    def __init__(self, cai, **attrs):
        self.__cuda_array_interface__ = cai
        self.__dict__.update(attrs)


def test_cai_v2_c_contiguous_unknown_device():
    v = as_view(FakeCai({"data": (0x10000, False), "shape": (5, 8), "typestr": "<i8",
                         "strides": None, "version": 2, "stream": 9}), name="x")
    assert (v.ptr, v.shape, v.strides, v.dtype_name) == (0x10000, (5, 8), (64, 8), "int64")
    assert v.device == -1 and v.stream is None and v.host is None and not v.readonly


def test_cai_v3_stream_strides_readonly_and_device_hints():
    cai = {"data": (0x20000, True), "shape": (4, 2), "typestr": "|u1", "strides": (16, 1),
           "version": 3, "stream": 2}
    cupy_like = as_view(FakeCai(cai, device=SimpleNamespace(id=3)), name="x")
    assert cupy_like.stream == 2 and cupy_like.readonly and cupy_like.strides == (16, 1)
    assert cupy_like.device == 3 and cupy_like.dtype == np.uint8
    jax_dev = type("Device", (), {"id": 5, "local_hardware_id": 1})()   # hashable, in a set
    jax_like = as_view(FakeCai(dict(cai, stream=None), devices=lambda: {jax_dev}), name="y")
    assert jax_like.device == 1 and jax_like.stream is None


def test_cai_v3_stream_zero_and_mask_rejected():
    cai = {"data": (0x20000, False), "shape": (4,), "typestr": "<f2", "version": 3}
    with pytest.raises(ValidationError, match=r"stream'\]: expected None or a stream handle"):
        as_view(FakeCai(dict(cai, stream=0)), name="x")
    with pytest.raises(ValidationError, match="expected an unmasked array"):
        as_view(FakeCai(dict(cai, mask=FakeCai({}))), name="x")
    assert as_view(FakeCai(dict(cai, mask=None)), name="x").dtype == np.float16


def test_cai_opaque_two_byte_type_and_bfloat16_hint():
    cai = {"data": (0x30000, False), "shape": (3,), "typestr": "<V2", "version": 3}
    plain = as_view(FakeCai(cai), name="x")
    assert plain.dtype == np.uint16 and plain.dtype_name == "void16" and plain.strides == (2,)
    hinted = as_view(FakeCai(cai, dtype=SimpleNamespace(name="bfloat16")), name="x")
    assert hinted.dtype_name == "bfloat16" and hinted.dtype == np.uint16


def test_cai_null_pointer_rejected_unless_empty():
    with pytest.raises(ValidationError, match="expected a non-NULL data pointer"):
        as_view(FakeCai({"data": (0, False), "shape": (2,), "typestr": "<i4", "version": 2}),
                name="x")
    assert as_view(FakeCai({"data": (0, False), "shape": (0,), "typestr": "<i4",
                            "version": 2}), name="x").numel == 0


# ---- torch-like ----------------------------------------------------------------------------------
class FakeTensor:
    """Duck-types the torch.Tensor attributes kvcanary reads, over a numpy array."""

    def __init__(self, array, dtype, device="cpu", index=None, esize=None, layout="torch.strided"):
        self.array, self.dtype, self.layout = array, dtype, layout
        self.device = SimpleNamespace(type=device, index=index)
        self.shape, self._esize = array.shape, esize or array.itemsize

    def data_ptr(self):
        return addr(self.array)

    def stride(self):
        return tuple(s // self._esize for s in self.array.strides)

    def element_size(self):
        return self._esize


def test_torch_like_cuda_fp8():
    a = np.zeros((4, 16), np.uint8)
    t = FakeTensor(a[:, :8], "torch.float8_e4m3fn", "cuda", 2)
    v = as_view(t, name="kv")
    assert (v.ptr, v.shape, v.strides, v.device) == (addr(a), (4, 8), (16, 1), 2)
    assert v.dtype == np.uint8 and v.dtype_name == "float8_e4m3fn" and v.host is None
    assert v.owner is t


def test_torch_like_cpu_host_view_is_zero_copy():
    a = np.arange(12, dtype=np.uint16).reshape(3, 4)
    v = as_view(FakeTensor(a, "torch.bfloat16"), name="kv")
    assert v.dtype_name == "bfloat16" and v.dtype == np.uint16 and v.device is None
    a[2, 3] = 777
    assert v.host[2, 3] == 777 and addr(v.host) == addr(a)
    ints = FakeTensor(np.arange(6, dtype=np.int64), "torch.int64")
    ints.__dlpack__ = lambda **kw: ints.array.__dlpack__(**kw)
    w = as_view(ints, name="idx")
    assert w.dtype == np.int64 and w.strides == (8,) and addr(w.host) == addr(ints.array)


def test_torch_like_unknown_dtype_uses_element_size_and_bad_devices_fail():
    v = as_view(FakeTensor(np.zeros(4, np.uint32), "torch.qfancy32", "cuda", 0), name="q")
    assert v.dtype == np.uint32 and v.dtype_name == "qfancy32"
    with pytest.raises(ValidationTypeError, match="expected a strided CUDA or CPU tensor"):
        as_view(FakeTensor(np.zeros(4), "torch.float64", "meta"), name="m")
    with pytest.raises(ValidationTypeError, match="layout=torch.sparse_coo"):
        as_view(FakeTensor(np.zeros(4), "torch.float64", layout="torch.sparse_coo"), name="s")


# ---- raw pointers --------------------------------------------------------------------------------
def test_from_pointer_host_and_device():
    buf = np.arange(16, dtype=np.int32)
    v = from_pointer(addr(buf), (2, 4), np.int32, device=None, strides=(32, 4), owner=buf)
    np.testing.assert_array_equal(v.host, [[0, 1, 2, 3], [8, 9, 10, 11]])
    assert v.owner is buf and v.host.base.owner is buf
    d = from_pointer(0xABC000, (3, 32), "<V2", device=0, readonly=True)
    assert d.strides == (64, 2) and d.host is None and d.readonly and d.dtype == np.uint16
    with pytest.raises(ValidationError, match="from_pointer\\(device=\\): expected None"):
        from_pointer(0xABC000, (3,), np.uint8, device=-2)
    with pytest.raises(ValidationError, match="non-NULL"):
        from_pointer(0, (3,), np.uint8, device=0)


@pytest.mark.parametrize("spec, itemsize, name", [
    ("<i8", 8, "int64"), ("|u1", 1, "uint8"), ("<f2", 2, "float16"), ("<V2", 2, "void16"),
    ("torch.int64", 8, "int64"), ("torch.bfloat16", 2, "bfloat16"), ("torch.bool", 1, "bool"),
    ("torch.float8_e5m2", 1, "float8_e5m2"), ("torch.float4_e2m1fn_x2", 1, "float4_e2m1fn_x2"),
    ("torch.int32", 4, "int32"), ("torch.float32", 4, "float32"), (np.float64, 8, "float64"),
])
def test_resolve_dtype(spec, itemsize, name):
    dt, got = resolve_dtype(spec)
    assert (dt.itemsize, got) == (itemsize, name)


# ---- rows_view -----------------------------------------------------------------------------------
def test_uint8_2d_collapses_paged_layout():
    pool = np.arange(5 * 4 * 2 * 8, dtype=np.float16).reshape(5, 4, 2, 8)   # [pages, ps, h, d]
    u = rows_view(as_view(pool, name="pool"), "pool")
    assert (u.ptr, u.shape, u.strides, u.dtype_name) == (addr(pool), (5, 128), (128, 1), "uint8")
    assert u.host.base is not None and addr(u.host) == addr(pool)
    np.testing.assert_array_equal(u.host[3], pool[3].reshape(-1).view(np.uint8))


def test_uint8_2d_per_layer_slice_keeps_real_row_stride():
    buf = np.zeros((3, 10, 48), np.uint8)                 # [layers, slots, bytes]
    layer = buf[1, :, :32]
    u = rows_view(as_view(layer, name="layer"), "layer")
    assert u.shape == (10, 32) and u.strides == (48, 1) and u.ptr == addr(buf) + 480
    buf[1, 4, 5] = 9
    assert u.host[4, 5] == 9
    mla = rows_view(as_view(np.zeros((6, 1, 64), np.uint16)[:, :, :], name="mla"), "mla")
    assert mla.shape == (6, 128)
    single = rows_view(as_view(buf[0, :1, :], name="one"), "one")
    assert single.strides == (48, 1)


def test_uint8_2d_rejects_transposed_with_fix():
    t = np.zeros((8, 4, 16), np.float16).transpose(0, 2, 1)
    with pytest.raises(ValidationError) as e:
        rows_view(as_view(t, name="kv"), "kv")
    msg = str(e.value)
    assert msg.startswith("kv-canary: kv: expected ") and " got " in msg
    assert "reshape to [num_slots, bytes_per_slot], e.g. t.view(t.shape[0], -1)" in msg
    with pytest.raises(ValidationError, match="contiguous last dimension"):
        rows_view(as_view(np.zeros((4, 8), np.int32)[:, ::2], name="kv"), "kv")


def test_uint8_2d_rejects_1d():
    fix = r"t\.view\(t\.shape\[0\], -1\)"
    with pytest.raises(ValidationError, match=r"got 1-D shape \(16,\).*" + fix):
        rows_view(as_view(np.zeros(16, np.uint8), name="kv"), "kv")


# ---- state arrays --------------------------------------------------------------------------------
def test_a_state_array_in_non_native_byte_order_is_named_so():
    from kvcanary.ops.checks import checked
    assert checked(np.zeros(3, np.int64), "ok", dtype=np.int64).shape == (3,)
    with pytest.raises(ValidationTypeError, match=r"be must have dtype int64, got int64 in non-native byte order "
                                                  r"\(>i8\)\. Fix: allocate it as int64"):
        checked(np.zeros(3, dtype=">i8"), "be", dtype=np.int64)


def test_ctypes_layouts_match_dlpack_h():
    assert ctypes.sizeof(dlpack.DLDevice) == 8 and ctypes.sizeof(dlpack.DLDataType) == 4
    assert ctypes.sizeof(dlpack.DLTensor) == 48 and dlpack.DLTensor.byte_offset.offset == 40
    assert ctypes.sizeof(dlpack.DLManagedTensor) == 64
    assert dlpack.DLManagedTensorVersioned.flags.offset == 24
    assert dlpack.DLManagedTensorVersioned.dl_tensor.offset == 32


def test_make_capsule_falls_back_to_legacy_on_old_numpy(monkeypatch):
    class OldNumpy(np.ndarray):                          # numpy < 2.1: no max_version keyword
        def __dlpack__(self, stream=None):
            return super().__dlpack__(stream=stream)

    real = dlpack.ndarray_at
    monkeypatch.setattr(dlpack, "ndarray_at", lambda *a, **k: real(*a, **k).view(OldNumpy))
    buf = np.arange(4, dtype=np.int16)
    cap = dlpack.make_capsule(addr(buf), (4,), np.int16, dlpack.kDLCUDA, 0, buf, versioned=True)
    assert dlpack._is_valid(cap, b"dltensor")
    assert as_view(cap, name="x").device == 0
    with pytest.raises(ValidationError, match="numpy >= 2.1"):
        dlpack.make_capsule(addr(buf), (4,), np.int16, dlpack.kDLCUDA, 0, buf, readonly=True,
                            versioned=True)


def test_core_modules_never_import_frameworks():
    import ast
    import pathlib

    import kvcanary.interop.arrays
    import kvcanary.interop.dtypes
    for module in (kvcanary.interop.arrays, kvcanary.interop.dtypes, dlpack):
        tree = ast.parse(pathlib.Path(module.__file__).read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                 for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree)
                  if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        assert names <= {"__future__", "ctypes", "dataclasses", "functools", "math", "operator", "typing",
                         "numpy"}, names


@pytest.mark.parametrize("bad,kind,match", [
    (True, "ValidationTypeError", "got the bool True"),      # would be handle 1: the legacy stream
    (False, "ValidationTypeError", "got the bool False"),
    (-1, "ValidationError", r"in \[0, 2\*\*64\), got -1"),
    (1 << 64, "ValidationError", r"in \[0, 2\*\*64\), got 18446744073709551616"),
])
def test_a_stream_that_is_no_handle_is_refused(bad, kind, match):
    from kvcanary import errors
    from kvcanary.runtime.streams import stream_handle
    with pytest.raises(getattr(errors, kind), match=match):
        stream_handle(bad)
    assert stream_handle(np.uint64(7)) == stream_handle(7) == 7
