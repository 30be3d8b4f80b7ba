"""One view type for every array kvcanary is handed, and the checks made on it.

``as_view`` turns a torch tensor (duck-typed, torch is never imported), a
``__cuda_array_interface__`` producer (CuPy, JAX, Numba, ...), a DLPack producer or capsule, a
numpy array or an ``ArrayView`` into an ``ArrayView``: address, shape, BYTE strides, dtype, device
and an owner that keeps the memory alive. Nothing is copied and no device memory is touched; host
views carry a zero-copy numpy array in ``host``. ``from_pointer`` describes raw memory (the byte
view of a real-KV source is :func:`kvcanary.ops.sources.rows_view`, the state arrays' rules are
:func:`kvcanary.ops.checks.checked`, the element types :mod:`kvcanary.interop.dtypes`).

Device ordinals: ``device`` is None for host memory, else the CUDA ordinal, or -1 when the
producer does not say (``__cuda_array_interface__`` carries no ordinal): -1 means "a CUDA device,
ordinal to be resolved from the pointer" and the driver layer resolves it with
cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL) before a launch.
This module never imports torch, CuPy, JAX or the CUDA driver.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import NoReturn

import numpy as np

from ..errors import ValidationError, ValidationTypeError
from . import dlpack
from .dlpack import c_strides
from .dtypes import resolve_dtype, resolve_typestr, stand_in

_ACCEPTED = ("a torch tensor, an object with __cuda_array_interface__ (CuPy, JAX, Numba), an "
             "object with __dlpack__ or a DLPack capsule, a numpy array, or "
             "kvcanary.interop.arrays.from_pointer(...)")


def _fail(cls, name: str, expected: str, got: str, fix: str) -> NoReturn:
    """Raise ``cls`` with the house format: what was expected, what was got, how to fix it."""
    raise cls(f"kv-canary: {name}: expected {expected}, got {got}. Fix: {fix}")


@dataclass(frozen=True)
class ArrayView:
    """An array as kvcanary sees it. ``strides`` are in BYTES; ``dtype`` is a numpy dtype or a
    same-size unsigned stand-in (bf16, fp8 ...) with the real name in ``dtype_name``; ``device``
    is None (host), a CUDA ordinal, or -1 (CUDA, ordinal resolved later from the pointer);
    ``stream`` is the producer stream from CAI v3 that a launch must be ordered after."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: np.dtype
    dtype_name: str
    device: int | None
    readonly: bool
    owner: object
    stream: int | None = None
    host: np.ndarray | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes_span(self) -> int:
        """Bytes from the lowest to one past the highest byte any element occupies."""
        low, high = extent(self.shape, self.strides, self.itemsize)
        return high - low

    def is_c_contiguous(self) -> bool:
        if self.numel == 0:
            return True
        want = c_strides(self.shape, self.itemsize)
        return all(n == 1 or s == w for n, s, w in zip(self.shape, self.strides, want))

    def describe(self) -> str:
        dev = "host" if self.device is None else f"cuda:{self.device if self.device >= 0 else '?'}"
        return (f"shape={self.shape}, strides={self.strides} bytes, dtype={self.dtype_name}, "
                f"device={dev}")


def extent(shape, strides, itemsize: int) -> tuple[int, int]:
    """(lowest, one past the highest) byte offset from the data pointer that an element of an
    array of ``shape`` and byte ``strides`` occupies; (0, 0) if it is empty."""
    if math.prod(shape) == 0:
        return 0, 0
    ext = [(n - 1) * s for n, s in zip(shape, strides)]
    return sum(e for e in ext if e < 0), sum(e for e in ext if e > 0) + itemsize


def _ints(name: str, what: str, values) -> tuple[int, ...]:
    """``values`` as a tuple of Python ints (a sequence of ints: numpy ints pass, floats do not)."""
    try:
        return tuple(operator.index(n) for n in values)
    except TypeError:
        _fail(ValidationTypeError, name, f"{what} as a sequence of ints", repr(values),
              "describe the array with integer extents and byte strides")


def _finish(name, ptr, shape, strides, dtype, dtype_name, device, readonly, owner, stream=None,
            host=None) -> ArrayView:
    shape, strides = _ints(name, "a shape", shape), _ints(name, "strides", strides)
    if isinstance(ptr, (bool, np.bool_)) or not isinstance(ptr, (int, np.integer, type(None))):
        _fail(ValidationTypeError, name, "a data pointer (an int address)", repr(ptr), "pass the address as an int")
    ptr = int(ptr or 0)
    if len(strides) != len(shape) or any(n < 0 for n in shape):
        _fail(ValidationError, name, "one stride per dimension and non-negative extents",
              f"shape={shape}, strides={strides}", "describe the array correctly")
    if not 0 <= ptr < 1 << 64:
        _fail(ValidationError, name, "a data pointer in [0, 2**64)", hex(ptr), "pass the allocation's address")
    if ptr == 0 and math.prod(shape) > 0:
        _fail(ValidationError, name, "a non-NULL data pointer", f"NULL with shape {shape}",
              "pass an allocated array")
    if math.prod(shape) > 0:
        low, high = (ptr + e for e in extent(shape, strides, dtype.itemsize))
        if low < 0 or high > 1 << 63:
            _fail(ValidationError, name, "an array inside the address space", f"bytes [{low:#x}, {high:#x}) for "
                  f"shape {shape}, strides {strides}", "check the shape, the strides and the pointer")
    if device is None and host is None:
        host = dlpack.ndarray_at(ptr, shape, strides, dtype, readonly=readonly, owner=owner)
    return ArrayView(ptr, shape, strides, dtype, dtype_name, device, bool(readonly), owner,
                     stream, host)


def from_pointer(ptr: int, shape, dtype, *, device: int | None, strides=None,
                 readonly: bool = False, owner=None) -> ArrayView:
    """Describe raw memory. ``strides`` in bytes (None = C-contiguous); ``device`` None = host
    (a zero-copy ``host`` array is built; the caller keeps the memory alive through ``owner``)."""
    dt, dt_name = resolve_dtype(dtype)
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        _fail(ValidationTypeError, "from_pointer(shape=)", "a tuple of ints", repr(shape), "pass e.g. shape=(4,)")
    shape = _ints("from_pointer(shape=)", "a shape", shape)
    if strides is not None and (isinstance(strides, (str, bytes)) or not hasattr(strides, "__iter__")):
        _fail(ValidationTypeError, "from_pointer(strides=)", "None or a tuple of byte strides", repr(strides),
              "pass e.g. strides=(8,) or None (C-contiguous)")
    strides = c_strides(shape, dt.itemsize) if strides is None else tuple(strides)
    if device is not None and (isinstance(device, (bool, np.bool_)) or not isinstance(device, (int, np.integer))):
        _fail(ValidationTypeError, "from_pointer(device=)", "None (host), a CUDA ordinal or -1 (ordinal unknown)",
              repr(device), "pass the device ordinal the memory lives on as an int")
    if device is not None and device < -1:
        _fail(ValidationError, "from_pointer(device=)", "None (host), a CUDA ordinal or -1 "
              "(ordinal unknown)", repr(device), "pass the device ordinal the memory lives on")
    return _finish("from_pointer", ptr, shape, strides, dt, dt_name, None if device is None else int(device),
                   readonly, owner)


def _is_torch_like(obj) -> bool:
    return all(hasattr(obj, a) for a in ("data_ptr", "stride", "element_size", "device")) \
        and isinstance(getattr(obj.device, "type", None), str)


def _torch_ordinal(obj) -> int | None:
    """The CUDA ordinal of a torch tensor (-1 when torch does not say), None for a CPU one."""
    if obj.device.type != "cuda":
        return None
    index = obj.device.index
    return -1 if index is None else int(index)


def _from_torch(obj, name) -> ArrayView:
    kind = obj.device.type
    layout = getattr(obj, "layout", None)
    if kind not in ("cuda", "cpu") or (layout is not None and str(layout) != "torch.strided"):
        _fail(ValidationTypeError, name, "a strided CUDA or CPU tensor",
              f"device={kind}, layout={layout}", "t.to('cuda') / t.to_dense()")
    for flag in ("is_conj", "is_neg"):
        if getattr(obj, flag, lambda: False)():
            _fail(ValidationError, name, f"a tensor without a lazy {flag[3:]} bit",
                  f"{flag}()=True", f"t.resolve_{flag[3:]}()")
    esize = int(obj.element_size())
    dtype, dtype_name = resolve_dtype(str(obj.dtype), esize)
    if dtype.itemsize != esize:
        dtype = stand_in(esize)
    shape = tuple(int(n) for n in obj.shape)
    strides = tuple(int(s) * esize for s in obj.stride())
    ptr = int(obj.data_ptr())
    ordinal = _torch_ordinal(obj)
    if ordinal is not None:
        return _finish(name, ptr, shape, strides, dtype, dtype_name, ordinal, False, obj)
    host = None
    if dtype.name == dtype_name and hasattr(obj, "__dlpack__"):
        try:
            host = np.from_dlpack(obj)
            if host.__array_interface__["data"][0] != ptr and host.size:
                host = None
        except Exception:  # noqa: BLE001 - e.g. requires_grad; fall back to the pointer
            host = None
    return _finish(name, ptr, shape, strides, dtype, dtype_name, None, False, obj, host=host)


def cuda_ordinal(obj) -> int:
    """The CUDA ordinal a CAI producer names (CuPy .device.id, JAX .devices()), else -1."""
    try:
        dev = getattr(obj, "device", None)
        if (dev is None or callable(dev)) and callable(getattr(obj, "devices", None)):
            devs = list(obj.devices())
            dev = devs[0] if len(devs) == 1 else None
        if isinstance(dev, int) and not isinstance(dev, bool):
            return dev
        if isinstance(dev, str) and dev.startswith("cuda:"):
            return int(dev[5:])
        for attr in ("local_hardware_id", "id"):
            value = getattr(dev, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    except Exception:  # noqa: BLE001 - a producer that cannot say leaves it to the driver
        pass
    return -1


def _from_cai(obj, name) -> ArrayView:
    try:
        cai = obj.__cuda_array_interface__
        ptr, readonly = cai["data"]
        shape, typestr = cai["shape"], cai["typestr"]
        strides, version = cai.get("strides"), cai.get("version", 0)
    except Exception as exc:  # noqa: BLE001 - torch raises TypeError for bf16; a malformed dict, KeyError
        _fail(ValidationTypeError, name, "a readable __cuda_array_interface__ (a dict with data=(ptr, readonly), "
              "shape, typestr)", f"{type(exc).__name__}: {exc}", "pass it through DLPack or viewed as uint8")
    if cai.get("mask") is not None:
        _fail(ValidationError, name, "an unmasked array", "a __cuda_array_interface__ with a "
              "mask (unsupported)", "pass the unmasked data")
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        _fail(ValidationTypeError, name, "a __cuda_array_interface__ shape tuple", repr(shape), "fix the producer")
    shape = _ints(name, "a shape", shape)
    dtype, dtype_name = resolve_typestr(typestr, obj)
    strides = c_strides(shape, dtype.itemsize) if strides is None else strides
    stream = cai.get("stream") if isinstance(version, int) and version >= 3 else None
    if stream is not None and (not isinstance(stream, int) or stream == 0):
        _fail(ValidationError, f"{name}.__cuda_array_interface__['stream']", "None or a stream "
              "handle (1 = legacy default, 2 = per-thread default)", f"{stream!r} (CAI v3 "
              "disallows 0)", "export it with the producer's stream, or None if no sync is needed")
    return _finish(name, ptr, shape, strides, dtype, dtype_name, cuda_ordinal(obj), readonly,
                   obj, stream=stream)


def _from_dlpack(obj, name, stream) -> ArrayView:
    producer = None
    if not dlpack.is_capsule(obj):
        producer = obj
        try:
            obj = dlpack.capsule_of(producer, stream)
        except Exception as exc:  # noqa: BLE001 - whatever the producer raises is its refusal to export
            _fail(ValidationTypeError, name, "an array that exports through __dlpack__",
                  f"{type(exc).__name__}: {exc}", "pass it viewed as uint8, or via another kind")
    t = dlpack.import_capsule(obj, producer)
    if t.device_type in dlpack.HOST_DEVICE_TYPES:
        device = None
    elif t.device_type in dlpack.CUDA_DEVICE_TYPES:
        device = t.device_id
    else:
        where = dlpack.DEVICE_NAMES.get(t.device_type, t.device_type)
        _fail(ValidationTypeError, name, "CPU, CUDA, CUDA-host or CUDA-managed memory",
              f"DLPack device {where}:{t.device_id}", "move it to a CUDA device or the host")
    itemsize = t.dtype.itemsize
    strides = (c_strides(t.shape, itemsize) if t.strides is None
               else tuple(s * itemsize for s in t.strides))
    return _finish(name, t.ptr, t.shape, strides, t.dtype, t.dtype_name, device, t.readonly,
                   t.owner)


def _from_numpy(obj: np.ndarray, name) -> ArrayView:
    if obj.dtype.hasobject:
        _fail(ValidationTypeError, name, "an array of plain data", f"numpy dtype {obj.dtype}",
              "convert it, e.g. a.astype(np.int64)")
    return _finish(name, obj.__array_interface__["data"][0], obj.shape, obj.strides, obj.dtype,
                   obj.dtype.name, None, not obj.flags.writeable, obj, host=obj)


def as_view(obj, *, name: str, stream: int | None = None) -> ArrayView:
    """An ``ArrayView`` of ``obj`` (see the module docstring), zero-copy.

    ``stream`` is the consumer stream the caller will launch on: it is passed to a CUDA producer's
    ``__dlpack__(stream=...)`` so the producer orders its pending work before it. A CAI v3
    producer reports its own stream instead, in ``ArrayView.stream``, which the caller must order
    after. Detection order: ArrayView, torch-like, __cuda_array_interface__, numpy, DLPack."""
    if isinstance(obj, ArrayView):
        return obj
    if _is_torch_like(obj):
        return _from_torch(obj, name)
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_cai(obj, name)
    if isinstance(obj, np.ndarray):
        return _from_numpy(obj, name)
    if hasattr(obj, "__dlpack__") or dlpack.is_capsule(obj):
        return _from_dlpack(obj, name, stream)
    _fail(ValidationTypeError, name, _ACCEPTED, f"{type(obj).__module__}.{type(obj).__qualname__}",
          "pass one of those, e.g. a torch.Tensor on the KV cache's device")
