"""Library-owned device memory, so a CuPy, JAX or raw-pointer pipeline needs no torch.

:class:`DeviceArray` is a ``cuMemAlloc`` allocation with a shape and a dtype that exports both
``__cuda_array_interface__`` (v3) and ``__dlpack__``; it is freed once the last reference (the
array or a consumer's DLPack capsule) goes away. Plus the few copies and fills the library needs.

Frees wait for a point outside any CUDA graph capture: a collected array's ``cuMemFree`` (or
``cuMemFreeHost``) while an engine captures a graph would invalidate that capture
(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED at the engine's next launch) and fail itself, and Python
collects garbage at any point, also inside a capture. So a collected allocation joins a pending
list, freed by :func:`release_pending` after the next successful allocation (a capture would
have refused it), by ``KvCanary.flush()``, or by the caller.

Every call runs in the owning device's context through its runtime
(:func:`kvcanary.runtime.devices.runtime`); nothing here loads or launches a kernel.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from ..interop.dlpack import kDLCUDA, make_capsule
from . import devices, driver
from .driver import check

_pending: list[tuple[devices.DeviceRuntime, str, int]] = []  # (runtime, driver free function, pointer)
_pending_lock = threading.Lock()


def _defer_free(rt: devices.DeviceRuntime, free: str, ptr: int) -> None:
    with _pending_lock:
        _pending.append((rt, free, ptr))


def release_pending() -> int:
    """Free the memory of collected kvcanary allocations (module docstring: why frees wait), each
    in its device's context; the number freed. Call it outside any graph capture of the process."""
    with _pending_lock:
        items = _pending[:]
        del _pending[:]
    for rt, free, ptr in items:
        try:
            rt.call(getattr(driver._driver(), free), ptr)
        except Exception:  # interpreter shutdown: the context is going away anyway
            pass
    return len(items)


class _Allocation:
    """Owns one cuMemAlloc block; its free waits for :func:`release_pending` once collected."""

    def __init__(self, rt: devices.DeviceRuntime, nbytes: int):
        d = driver._driver()
        self.rt, self.nbytes = rt, nbytes
        err, ptr = rt.call(d.cuMemAlloc, max(nbytes, 1))
        hint = {"CUDA_ERROR_OUT_OF_MEMORY": "the GPU is out of memory; fix: free memory or allocate less",
                "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED": "a stream of this context is capturing a CUDA graph, "
                "where allocation is not allowed; fix: create kvcanary state (and run the first step, which "
                "packs the launches) before the capture"}.get(getattr(err, "name", ""), "")
        self.ptr = int(check((err, ptr), f"cuMemAlloc({nbytes})", hint))
        release_pending()  # no capture refused the allocation

    def __del__(self):
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if ptr:
            _defer_free(self.rt, "cuMemFree", ptr)


class DeviceArray:
    """A C-contiguous array in device memory owned by kvcanary."""

    def __init__(self, shape, dtype, device: int = 0):
        self.shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        self.dtype = np.dtype(dtype)
        self.device = int(device)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self._alloc = _Allocation(devices.runtime(self.device), self.nbytes)
        self.ptr = self._alloc.ptr

    @property
    def strides(self) -> tuple[int, ...]:
        out, acc = [], self.dtype.itemsize
        for extent in reversed(self.shape):
            out.append(acc)
            acc *= extent
        return tuple(reversed(out))

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False),
                "strides": None, "version": 3, "stream": None}

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        versioned = max_version is not None and tuple(max_version) >= (1, 0)
        return make_capsule(self.ptr, self.shape, self.dtype, kDLCUDA, self.device, self,
                            versioned=versioned)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (kDLCUDA, self.device)

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, device={self.device})"

    # ---- copies (synchronous unless a stream is given) --------------------------------------
    def copy_from_host(self, host: np.ndarray, stream: int | None = None) -> "DeviceArray":
        host = np.ascontiguousarray(host, dtype=self.dtype)
        if host.nbytes != self.nbytes:
            raise ValueError(f"kv-canary: copy_from_host expected {self.nbytes} bytes "
                             f"(shape {self.shape}, {self.dtype}), got {host.nbytes} (shape {host.shape})")
        d, rt = driver._driver(), self._alloc.rt
        if stream is None:  # complete on return: pageable copies may otherwise still be in flight
            check(rt.call(d.cuMemcpyHtoDAsync, self.ptr, host.ctypes.data, host.nbytes, driver.PER_THREAD_STREAM),
                  "cuMemcpyHtoDAsync")
            check(rt.call(d.cuStreamSynchronize, driver.PER_THREAD_STREAM), "cuStreamSynchronize")
        else:
            check(rt.call(d.cuMemcpyHtoDAsync, self.ptr, host.ctypes.data, host.nbytes, stream), "cuMemcpyHtoDAsync")
        return self

    def numpy(self) -> np.ndarray:
        """A synchronous copy to host (waits for all work on the device's context)."""
        out = np.empty(self.shape, self.dtype)
        d, rt = driver._driver(), self._alloc.rt
        check(rt.call(d.cuCtxSynchronize), "cuCtxSynchronize")
        check(rt.call(d.cuMemcpyDtoH, out.ctypes.data, self.ptr, self.nbytes), "cuMemcpyDtoH")
        return out

    def zero_(self, stream: int | None = None) -> "DeviceArray":
        d, rt = driver._driver(), self._alloc.rt
        if stream is None:  # done before returning, so work on any stream sees the zeros
            check(rt.call(d.cuMemsetD8Async, self.ptr, 0, self.nbytes, driver.PER_THREAD_STREAM), "cuMemsetD8Async")
            check(rt.call(d.cuStreamSynchronize, driver.PER_THREAD_STREAM), "cuStreamSynchronize")
        else:
            check(rt.call(d.cuMemsetD8Async, self.ptr, 0, self.nbytes, stream), "cuMemsetD8Async")
        return self


def empty(shape, dtype, device: int = 0) -> DeviceArray:
    return DeviceArray(shape, dtype, device)


def zeros(shape, dtype, device: int = 0) -> DeviceArray:
    return DeviceArray(shape, dtype, device).zero_()


def to_device(host: np.ndarray, device: int = 0) -> DeviceArray:
    host = np.asarray(host)
    return DeviceArray(host.shape, host.dtype, device).copy_from_host(host)


def copy_async(dst_ptr: int, src_ptr: int, nbytes: int, stream: int, device: int) -> None:
    """Any-direction async copy under unified addressing (device, pinned host)."""
    check(devices.runtime(device).hot(driver._driver().cuMemcpyAsync, dst_ptr, src_ptr, nbytes, stream), "cuMemcpyAsync")


def fill_async(ptr: int, byte: int, nbytes: int, stream: int, device: int) -> None:
    """Set ``nbytes`` bytes at ``ptr`` to ``byte`` on ``stream`` (capturable: a memset node)."""
    if nbytes > 0:
        check(devices.runtime(device).hot(driver._driver().cuMemsetD8Async, ptr, byte, nbytes, stream),
              "cuMemsetD8Async")


def copy_from_host_ptr(dst_ptr: int, host: np.ndarray, device: int) -> None:
    """Synchronous host -> device copy of ``host`` to ``dst_ptr``."""
    host = np.ascontiguousarray(host)
    d, rt = driver._driver(), devices.runtime(device)
    check(rt.call(d.cuMemcpyHtoDAsync, dst_ptr, host.ctypes.data, host.nbytes, driver.PER_THREAD_STREAM), "cuMemcpyHtoDAsync")
    check(rt.call(d.cuStreamSynchronize, driver.PER_THREAD_STREAM), "cuStreamSynchronize")


def copy_to_host_ptr(host: np.ndarray, src_ptr: int, device: int) -> np.ndarray:
    """Synchronous device -> host copy into ``host`` after the device's pending work."""
    d, rt = driver._driver(), devices.runtime(device)
    check(rt.call(d.cuCtxSynchronize), "cuCtxSynchronize")
    check(rt.call(d.cuMemcpyDtoH, host.ctypes.data, src_ptr, host.nbytes), "cuMemcpyDtoH")
    return host


class PinnedBuffer:
    """Page-locked host memory (cuMemHostAlloc) seen as a numpy array; device-visible under UVA.

    ``mapped``: allocated DEVICEMAP | PORTABLE, and ``device_ptr`` is the address kernels store
    to: ``cuMemHostGetDevicePointer``'s, or the host address itself, which is the device address
    of every pinned allocation under unified addressing (all 64-bit CUDA platforms)."""

    def __init__(self, shape, dtype, device: int, mapped: bool = False):
        d, self.rt = driver._driver(), devices.runtime(device)
        self.dtype, self.shape = np.dtype(dtype), tuple(shape)
        nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        flags = int(d.CU_MEMHOSTALLOC_DEVICEMAP | d.CU_MEMHOSTALLOC_PORTABLE) if mapped else 0
        self.ptr = int(check(self.rt.call(d.cuMemHostAlloc, max(nbytes, 1), flags), "cuMemHostAlloc"))
        self.device_ptr = self.ptr
        if mapped:
            err, dptr = self.rt.call(d.cuMemHostGetDevicePointer, self.ptr, 0)
            self.device_ptr = self.ptr if err else int(dptr)
        raw = (ctypes.c_ubyte * max(nbytes, 1)).from_address(self.ptr)
        self.array = np.frombuffer(raw, np.uint8, nbytes).view(self.dtype).reshape(self.shape)
        self.array[...] = 0

    def __del__(self):
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if ptr:
            _defer_free(self.rt, "cuMemFreeHost", ptr)


class Event:
    """A timing-free CUDA event: record on a stream, query without blocking."""

    def __init__(self, device: int, timing: bool = False):
        d, self.rt = driver._driver(), devices.runtime(device)
        flags = 0 if timing else d.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = check(self.rt.call(d.cuEventCreate, flags), "cuEventCreate")

    def record(self, stream: int) -> None:
        check(self.rt.hot(driver._driver().cuEventRecord, self.handle, stream), "cuEventRecord")

    def done(self) -> bool:
        d = driver._driver()
        (err,) = self.rt.hot(d.cuEventQuery, self.handle)
        if err == d.CUresult.CUDA_ERROR_NOT_READY:
            return False
        check((err,), "cuEventQuery")
        return True

    def synchronize(self) -> None:
        check(self.rt.hot(driver._driver().cuEventSynchronize, self.handle), "cuEventSynchronize")


def new_stream(device: int) -> int:
    """A non-blocking stream owned by the library (never synchronises with the legacy stream)."""
    d, rt = driver._driver(), devices.runtime(device)
    s = check(rt.call(d.cuStreamCreate, d.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
    return int(s)


def stream_synchronize(stream: int, device: int) -> None:
    check(devices.runtime(device).call(driver._driver().cuStreamSynchronize, stream), "cuStreamSynchronize")


def context_synchronize(device: int) -> None:
    """Wait for all work of the device's primary context, on every stream."""
    check(devices.runtime(device).call(driver._driver().cuCtxSynchronize), "cuCtxSynchronize")
