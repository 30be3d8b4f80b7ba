"""The CUDA driver: its binding, ``cuInit``, ``check``, and each device's primary context.

The bottom of the driver side of kvcanary.runtime: it imports no other runtime module and knows
nothing of kvcanary's kernels (their loading is :mod:`~kvcanary.runtime.kernel_library`'s, their
launches :mod:`~kvcanary.runtime.devices`'). ``cuda.bindings.driver`` is imported on first use and
``cuInit`` runs on the first call that needs the driver, never at import (forking servers break
after it). Every failed driver call becomes a DriverError naming the operation and the CUresult
(:func:`check`); no driver, or no device, becomes NoCudaDriverError. Thread-safe.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from .. import abi
from ..errors import DriverError, KvCanaryError, NoCudaDriverError, UnsupportedDeviceError

_lock = threading.Lock()
_initialised = False

# Stream handles with a meaning of their own (cuda.h): never chosen implicitly.
LEGACY_STREAM = 0x1
PER_THREAD_STREAM = 0x2
CONTEXT_ERRORS = (201, 400, 709)  # INVALID_CONTEXT, INVALID_HANDLE, CONTEXT_IS_DESTROYED: no (or another) context current


_module = None  # cuda.bindings.driver once imported


def _driver():
    """cuda.bindings.driver, imported on first use (importing it does not initialise CUDA; ``import
    kvcanary`` never needs it, and it takes about 0.1 s)."""
    global _module
    if _module is None:
        from cuda.bindings import driver
        _module = driver
    return _module


def check(result, operation: str, hint: str = ""):
    """Unpack a cuda.bindings return tuple, raising DriverError on any CUresult but SUCCESS."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise DriverError(operation, getattr(err, "name", str(err)), hint)
    return rest[0] if len(rest) == 1 else tuple(rest)


def init() -> None:
    """cuInit once per process. No driver, or no device, becomes NoCudaDriverError."""
    global _initialised
    if _initialised:
        return
    with _lock:
        if _initialised:
            return
        try:
            (err,) = _driver().cuInit(0)
        except Exception as exc:  # cuda.pathfinder raises DynamicLibNotFoundError without libcuda
            raise NoCudaDriverError(f"{type(exc).__name__}: {exc}") from None
        if int(err) != 0:
            raise NoCudaDriverError(f"cuInit returned {getattr(err, 'name', err)}")
        _initialised = True


def device_count() -> int:
    init()
    return int(check(_driver().cuDeviceGetCount(), "cuDeviceGetCount"))


def unavailable_reason() -> str | None:
    """None when at least one CUDA device answers, else why not (for skipping GPU work cleanly)."""
    try:
        return None if device_count() > 0 else "no CUDA device"
    except KvCanaryError as exc:
        return str(exc).splitlines()[0][:200]


def driver_version() -> int:
    init()
    return int(check(_driver().cuDriverGetVersion(), "cuDriverGetVersion"))


def pointer_device(ptr: int) -> int:
    """Device ordinal of a device pointer (for producers that do not say, like raw CAI)."""
    init()
    d = _driver()
    attr = d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    return int(check(d.cuPointerGetAttribute(attr, ptr), "cuPointerGetAttribute(DEVICE_ORDINAL)",
                     "expected a pointer to CUDA device memory"))


@dataclass
class Context:
    """The primary context of one device (shared with torch, CuPy and JAX) and what the device is:
    how to run a driver call with it current. ``sole``: the only CUDA device of the process, so a
    call may be made first as it is (:meth:`hot`)."""

    ordinal: int
    context: int
    capability: tuple[int, int]
    sm_count: int
    sole: bool

    def enter(self) -> bool:
        """Make this device's primary context current; True if one had to be pushed (pushing leaves
        the caller's context, e.g. torch's current device, as it was once :meth:`leave` pops it)."""
        d = _driver()
        err, current = d.cuCtxGetCurrent()
        if int(err) == 0 and int(current) == self.context:
            return False
        check(d.cuCtxPushCurrent(d.CUcontext(self.context)), "cuCtxPushCurrent")
        return True

    def leave(self, pushed: bool) -> None:
        if pushed:
            check(_driver().cuCtxPopCurrent(), "cuCtxPopCurrent")

    def call(self, fn, *args):
        """Run a driver call with this device's context current; returns its raw result tuple."""
        pushed = self.enter()
        try:
            return fn(*args)
        finally:
            self.leave(pushed)

    def hot(self, fn, *args):
        """:meth:`call` for a call made every step (a copy, an event): with one device it is made
        first as it is, and again with the context made current only if the driver refuses it for
        want of one (as a launch does: :meth:`kvcanary.runtime.devices.DeviceRuntime.launch`)."""
        if self.sole:
            res = fn(*args)
            if not res[0] or int(res[0]) not in CONTEXT_ERRORS:
                return res
        return self.call(fn, *args)


def primary_context(ordinal: int) -> Context:
    """Retain the primary context of device ``ordinal`` (cuInit first). A device older than
    abi.MIN_ARCH is refused before any context is made (UnsupportedDeviceError)."""
    init()
    d = _driver()
    count = device_count()
    if not 0 <= ordinal < count:
        raise DriverError(f"cuDeviceGet({ordinal})", "CUDA_ERROR_INVALID_DEVICE",
                          f"expected a device ordinal in [0, {count})")
    dev = check(d.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    A = d.CUdevice_attribute
    major = int(check(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cuDeviceGetAttribute"))
    minor = int(check(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cuDeviceGetAttribute"))
    if major * 10 + minor < abi.MIN_ARCH:  # before a context or a compile: the kernels need sm_80
        raise UnsupportedDeviceError(ordinal, major * 10 + minor, abi.MIN_ARCH)
    sms = int(check(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev), "cuDeviceGetAttribute"))
    ctx = check(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    return Context(ordinal=ordinal, context=int(ctx), capability=(major, minor), sm_count=sms, sole=count == 1)
