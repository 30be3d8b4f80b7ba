"""DLPack in both directions, with ctypes only (DLPack 1.x: legacy and versioned capsules).

Import: ``capsule_of(producer, stream)`` asks a producer for a capsule; ``import_capsule(capsule)``
reads a ``"dltensor"`` or ``"dltensor_versioned"`` capsule, renames it ``"used_dltensor"`` /
``"used_dltensor_versioned"`` (the consumer's duty under the DLPack spec) and returns a
``DlpackTensor`` whose ``owner`` calls the producer's deleter exactly once, when the owner is
garbage-collected (or ``owner.release()`` is called). Nothing is copied. Every check runs before
the rename, so a rejected capsule stays the producer's to free.

Export: ``make_capsule(...)`` describes memory kvcanary owns (host or device) as a capsule that
CuPy, JAX, torch or numpy can consume. The managed tensor, its deleter and the capsule destructor
are numpy's C implementation: a zero-copy numpy array over the address (never dereferenced here)
whose base keeps ``owner`` alive is exported with ``ndarray.__dlpack__`` and its device and dtype
fields are then patched in place. This is deliberate: a ctypes callback used as a capsule
destructor or deleter runs Python code while an exception may be in flight (a capsule dropped
during unwinding) and clobbers it, which C destructors avoid with PyErr_Fetch/PyErr_Restore.

This module never imports torch, CuPy, JAX or the CUDA driver.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from ..errors import ValidationError, ValidationTypeError
from .dtypes import describe_dtype, dl_dtype, stand_in

# ---- device types and flags (dlpack.h, v1.1; dtype codes: kvcanary.interop.dtypes) ---------------------
kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged = 1, 2, 3, 13
DEVICE_NAMES = {1: "CPU", 2: "CUDA", 3: "CUDAHost", 4: "OpenCL", 7: "Vulkan", 8: "Metal", 9: "VPI",
                10: "ROCM", 11: "ROCMHost", 12: "ExtDev", 13: "CUDAManaged", 14: "OneAPI",
                15: "WebGPU", 16: "Hexagon", 17: "MAIA"}
HOST_DEVICE_TYPES = (kDLCPU, kDLCUDAHost)        # host-accessible memory: viewed as a host array
CUDA_DEVICE_TYPES = (kDLCUDA, kDLCUDAManaged)    # device memory with a CUDA ordinal

FLAG_READ_ONLY = 1 << 0
FLAG_IS_COPIED = 1 << 1
FLAG_IS_SUBBYTE_TYPE_PADDED = 1 << 2


# ---- structs (dlpack.h). Deleters are held as raw addresses and called through _DELETER. ---------
class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


# PYFUNCTYPE keeps the GIL held during the call: safe for deleters that assume it and for those
# that take it themselves with PyGILState_Ensure.
_DELETER = ctypes.PYFUNCTYPE(None, ctypes.c_void_p)


# ---- capsule API ---------------------------------------------------------------------------------
def _capi(fn_name, restype, *argtypes):
    """A private binding of a C-API function (never mutates the shared ctypes.pythonapi ones)."""
    return ctypes.PYFUNCTYPE(restype, *argtypes)((fn_name, ctypes.pythonapi))


_is_valid = _capi("PyCapsule_IsValid", ctypes.c_int, ctypes.py_object, ctypes.c_char_p)
_get_pointer = _capi("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)
_get_name = _capi("PyCapsule_GetName", ctypes.c_char_p, ctypes.py_object)
_set_name = _capi("PyCapsule_SetName", ctypes.c_int, ctypes.py_object, ctypes.c_void_p)


def _immortal_name(text: bytes):
    """A NUL-terminated name that is never freed: a capsule keeps the bare pointer we give it."""
    buf = ctypes.create_string_buffer(text)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(buf))
    return buf


_USED_NAMES = {False: _immortal_name(b"used_dltensor"),
               True: _immortal_name(b"used_dltensor_versioned")}


def is_capsule(obj) -> bool:
    return type(obj).__name__ == "PyCapsule"


# ---- numpy over raw memory -----------------------------------------------------------------------
def c_strides(shape, itemsize: int) -> tuple[int, ...]:
    """C-contiguous byte strides for ``shape``."""
    out, step = [], itemsize
    for n in reversed(shape):
        out.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(out))


class _Memory:
    """Exposes an address through ``__array_interface__`` and keeps ``owner`` alive."""

    def __init__(self, ptr, shape, strides, dtype, readonly, owner):
        self.__array_interface__ = {"data": (int(ptr), bool(readonly)), "shape": tuple(shape),
                                    "strides": tuple(strides), "typestr": np.dtype(dtype).str,
                                    "version": 3}
        self.owner = owner


def ndarray_at(ptr, shape, strides, dtype, *, readonly, owner) -> np.ndarray:
    """A zero-copy numpy array over ``ptr`` (byte strides) whose base keeps ``owner`` alive.

    The memory is not touched here; it must be host-accessible before the array is read."""
    return np.asarray(_Memory(ptr, shape, strides, dtype, readonly, owner))


# ---- import --------------------------------------------------------------------------------------
class DlpackOwner:
    """Owns one consumed managed tensor: calls its deleter exactly once, when collected."""

    __slots__ = ("_managed", "_deleter", "capsule", "producer", "__weakref__")

    def __init__(self, managed: int, deleter: int | None, capsule, producer):
        self._managed, self._deleter = managed, deleter
        self.capsule, self.producer = capsule, producer

    def release(self) -> None:
        deleter, self._deleter = self._deleter, None
        if deleter:
            _DELETER(deleter)(self._managed)

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - a deleter must never raise out of garbage collection
            pass


@dataclass(frozen=True)
class DlpackTensor:
    ptr: int                             # data + byte_offset
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None      # in ELEMENTS, None = C-contiguous
    dtype: np.dtype
    dtype_name: str
    device_type: int
    device_id: int
    readonly: bool
    owner: DlpackOwner


def _ints(ptr, n) -> tuple[int, ...]:
    return tuple(int(ptr[i]) for i in range(n))


def capsule_of(producer, stream: int | None):
    """A fresh capsule from ``producer.__dlpack__``: DLPack 1.x asked for (``max_version=(1, 1)``;
    the legacy call when the producer does not take it) and ``stream``, the consumer's, passed to
    a CUDA producer so it orders its pending work before it. Raises what the producer raises."""
    device = producer.__dlpack_device__() if hasattr(producer, "__dlpack_device__") else None
    kwargs = {"stream": stream} if stream is not None and device and device[0] in CUDA_DEVICE_TYPES else {}
    try:
        return producer.__dlpack__(max_version=(1, 1), **kwargs)
    except TypeError:
        return producer.__dlpack__(**kwargs)


def import_capsule(capsule, producer=None) -> DlpackTensor:
    """Consume a DLPack capsule (see the module docstring for the ownership contract)."""
    versioned = bool(_is_valid(capsule, b"dltensor_versioned"))
    if not versioned and not _is_valid(capsule, b"dltensor"):
        got = _get_name(capsule) if is_capsule(capsule) else type(capsule).__name__
        raise ValidationTypeError(
            f"kv-canary: expected an unconsumed DLPack capsule named 'dltensor' or "
            f"'dltensor_versioned', got {got!r}. Fix: call __dlpack__() again for a fresh capsule; "
            f"each capsule can be consumed once.")
    name = b"dltensor_versioned" if versioned else b"dltensor"
    addr = _get_pointer(capsule, name)
    flags = 0
    if versioned:
        managed = DLManagedTensorVersioned.from_address(addr)
        if managed.version.major != 1:
            raise ValidationError(
                f"kv-canary: expected a DLPack 1.x capsule, got version {managed.version.major}."
                f"{managed.version.minor}. Fix: ask the producer for max_version=(1, 0) or upgrade "
                f"kvcanary.")
        flags = int(managed.flags)
    else:
        managed = DLManagedTensor.from_address(addr)
    t = managed.dl_tensor
    if flags & FLAG_IS_COPIED:
        raise ValidationError(
            "kv-canary: expected a zero-copy DLPack view, got a capsule flagged IS_COPIED (writes "
            "to the original would be invisible). Fix: export the array itself, without copy=True "
            "or a dl_device transfer.")
    dtype, dtype_name = describe_dtype(t.dtype.code, t.dtype.bits, t.dtype.lanes,
                                       bool(flags & FLAG_IS_SUBBYTE_TYPE_PADDED))
    shape = _ints(t.shape, t.ndim)
    strides = _ints(t.strides, t.ndim) if t.strides else None
    fields = ((t.data or 0) + t.byte_offset, shape, strides, dtype, dtype_name,
              int(t.device.device_type), int(t.device.device_id), bool(flags & FLAG_READ_ONLY))
    if _set_name(capsule, ctypes.addressof(_USED_NAMES[versioned])) != 0:
        raise ValidationError("kv-canary: expected to rename the consumed DLPack capsule, got a "
                              "failure from PyCapsule_SetName. Fix: pass a fresh capsule.")
    return DlpackTensor(*fields, DlpackOwner(addr, managed.deleter, capsule, producer))


# ---- export --------------------------------------------------------------------------------------
def make_capsule(ptr: int, shape, dtype, device_type: int, device_id: int, owner,
                 strides_bytes=None, readonly: bool = False, versioned: bool = False):
    """A fresh DLPack capsule describing ``ptr`` (host or device memory, never touched here).

    ``owner`` is kept alive until the consumer calls the deleter, or, if the capsule is never
    consumed, until the capsule is collected; it is released exactly once. ``strides_bytes``
    (None = C-contiguous) must be multiples of the element size. A read-only buffer needs
    ``versioned=True``: legacy capsules cannot signal read-only."""
    code, bits, lanes = dl_dtype(dtype)
    itemsize = bits * lanes // 8
    if itemsize * 8 != bits * lanes:
        raise ValidationTypeError(
            f"kv-canary: expected whole-byte elements to export, got {dtype!r} ({bits}x{lanes} "
            f"bits). Fix: export the buffer as uint8.")
    shape = tuple(int(n) for n in shape)
    strides_bytes = (c_strides(shape, itemsize) if strides_bytes is None
                     else tuple(int(s) for s in strides_bytes))
    if len(strides_bytes) != len(shape) or any(s % itemsize for s in strides_bytes):
        raise ValidationError(
            f"kv-canary: make_capsule expected {len(shape)} byte strides that are multiples of "
            f"the element size {itemsize}, got {strides_bytes}. Fix: export a uint8 view instead.")
    if readonly and not versioned:
        raise ValidationError(
            "kv-canary: make_capsule expected versioned=True for a read-only buffer, got "
            "versioned=False (legacy DLPack cannot signal read-only). Fix: pass versioned=True, "
            "i.e. only export to consumers that ask with max_version >= (1, 0).")
    if not ptr and all(shape):
        raise ValidationError("kv-canary: make_capsule expected a non-NULL pointer for a "
                              f"non-empty buffer, got ptr=0 with shape {shape}. Fix: allocate it.")
    carrier = ndarray_at(ptr, shape, strides_bytes, stand_in(itemsize), readonly=readonly,
                         owner=owner)
    try:
        capsule = carrier.__dlpack__(max_version=(1, 0)) if versioned else carrier.__dlpack__()
    except TypeError:                  # numpy < 2.1 exports legacy capsules only, which the
        if readonly:                   # protocol allows in answer to max_version
            raise ValidationError("kv-canary: make_capsule expected numpy >= 2.1 to export a "
                                  "read-only (versioned) capsule, got numpy " + np.__version__ +
                                  ". Fix: upgrade numpy.") from None
        capsule, versioned = carrier.__dlpack__(), False
    name = b"dltensor_versioned" if versioned else b"dltensor"
    addr = _get_pointer(capsule, name)
    managed = (DLManagedTensorVersioned if versioned else DLManagedTensor).from_address(addr)
    if versioned and code >= 7 and managed.version.minor < 1:
        managed.version.minor = 1      # the fp8/fp6/fp4 codes arrived in DLPack 1.1
    t = managed.dl_tensor
    t.device.device_type, t.device.device_id = int(device_type), int(device_id)
    t.dtype.code, t.dtype.bits, t.dtype.lanes = code, bits, lanes
    if all(shape) and (t.data or 0) + t.byte_offset != int(ptr):
        raise ValidationError(f"kv-canary: make_capsule expected numpy to export address "
                              f"{int(ptr):#x}, got {(t.data or 0) + t.byte_offset:#x}. Fix: report "
                              f"this numpy version as unsupported.")
    return capsule
