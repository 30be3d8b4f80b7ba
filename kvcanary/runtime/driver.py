"""CUDA driver runtime: initialised on the first launch, never at import.

Per device: ``cuInit``, the primary context (shared with torch, CuPy and JAX), and its kernels:
one ``cuLibraryLoadData`` per kernel family of the device's arch, the core families at once, the
others on first use, each kernel's parameter size checked against abi.py (:mod:`kvcanary.runtime.kernel_library`).
A launch is one ``cuLaunchKernelEx`` with the params struct passed by value through a pointer
array (a packed one: :class:`kvcanary.runtime.launch.Launch`); on sm_90+ it allows programmatic stream
serialization (:func:`kvcanary.runtime.launch.launch_config`; ``KVCANARY_PDL=0``: not).
Thread-safe; one runtime per device ordinal.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field

from .. import abi
from . import kernel_library
from ..errors import DriverError, KvCanaryError, NoCudaDriverError, UnsupportedDeviceError
from .launch import PLAIN_KERNELS, launch_config, pdl_wanted

_lock = threading.Lock()
_initialised = False
_runtimes: dict[int, "DeviceRuntime"] = {}

# Stream handles with a meaning of their own (cuda.h): never chosen implicitly.
LEGACY_STREAM = 0x1
PER_THREAD_STREAM = 0x2
_CONTEXT_ERRORS = (201, 400, 709)  # INVALID_CONTEXT, INVALID_HANDLE, CONTEXT_IS_DESTROYED


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
class DeviceRuntime:
    """The loaded kernels of one device and how to launch them."""

    ordinal: int
    context: int
    capability: tuple[int, int]
    sm_count: int
    arch: int
    functions: kernel_library.Kernels = None  # kernel -> CUfunction; a lazy family loads on its first lookup
    sole: bool = False  # the only CUDA device of the process
    pdl: bool = False  # launches may start during the previous kernel of their stream (common.cuh)
    _streams: dict = field(default_factory=dict)  # CUstream objects by handle (launch hot path)
    _occupancy: dict = field(default_factory=dict)  # (kernel, block) -> resident blocks
    _configs: dict = field(default_factory=dict)  # (grid, grid_y, block, stream, pdl) -> launch config

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
        want of one (as :meth:`launch` does)."""
        if self.sole:
            res = fn(*args)
            if not res[0] or int(res[0]) not in _CONTEXT_ERRORS:
                return res
        return self.call(fn, *args)

    def cu_stream(self, stream: int):
        """The CUstream object of a raw handle, built once per handle (building one costs ~1 us)."""
        s = self._streams.get(stream)
        if s is None:
            s = self._streams.setdefault(stream, _driver().CUstream(stream))
        return s

    def config(self, grid: int, grid_y: int, block: int, stream: int, name: str = ""):
        """The launch config (:func:`~kvcanary.runtime.launch.launch_config`) of kernel ``name``'s ``grid`` x ``grid_y`` grid
        on the raw stream handle ``stream``, PDL unless in ``PLAIN_KERNELS``; built once, kept (4096 at most)."""
        pdl = self.pdl and name not in PLAIN_KERNELS
        key = (grid, grid_y, block, stream, pdl)
        cfg = self._configs.get(key)
        if cfg is None:
            if len(self._configs) >= 4096:
                self._configs.clear()
            cfg = self._configs.setdefault(key, launch_config(_driver(), grid, grid_y, block, self.cu_stream(stream), pdl))
        return cfg

    def launch(self, name: str, grid: int, block: int, args_address: int, stream: int, grid_y: int = 1) -> None:
        """Launch ``name`` with a prepacked ``void*[1]`` at ``args_address`` on ``stream`` (a
        ``grid`` x ``grid_y`` grid: ``grid_y`` is abi.HALVES for a paired launch). With one device
        (one primary context) launch first, and make it current only if the driver refuses (no or
        another context current); with several the current context is checked before every launch."""
        fn, cfg = self.functions[name], self.config(grid, grid_y, block, stream, name)
        if self.sole:
            (err,) = _driver().cuLaunchKernelEx(cfg, fn, args_address, 0)
            if not err:
                return
            self._raise_unless_context_error(err, name, grid, block)
        self._launch_in_context(fn, name, cfg, args_address)

    def launcher(self, name: str, grid: int, block: int, args_address: int, grid_y: int = 1):
        """:meth:`launch` bound to one prepacked pointer array: a function ``f(stream)``. With one
        device its fast path is a dict lookup (the stream's launch config) and one
        cuLaunchKernelEx, with the same fallback on a context error."""
        if not self.sole:
            return lambda stream: self.launch(name, grid, block, args_address, stream, grid_y)
        fn, configs, launch_ex = self.functions[name], {}, _driver().cuLaunchKernelEx

        def launch(stream: int) -> None:
            cfg = configs.get(stream)
            if cfg is None:
                cfg = configs.setdefault(stream, self.config(grid, grid_y, block, stream, name))
            (err,) = launch_ex(cfg, fn, args_address, 0)
            if err:
                self._raise_unless_context_error(err, name, grid, block)
                self._launch_in_context(fn, name, cfg, args_address)
        return launch

    def _raise_unless_context_error(self, err, name: str, grid: int, block: int) -> None:
        if int(err) not in _CONTEXT_ERRORS:
            raise DriverError(f"cuLaunchKernelEx({name}, grid={grid}, block={block})", err.name)

    def _launch_in_context(self, fn, name: str, cfg, args_address: int) -> None:
        pushed = self.enter()
        try:
            (err,) = _driver().cuLaunchKernelEx(cfg, fn, args_address, 0)
        finally:
            self.leave(pushed)
        if int(err) != 0:
            hint = ""
            if int(err) in _CONTEXT_ERRORS:  # refused in this device's own context: the stream
                hint = (f"expected a stream of cuda:{self.ordinal} (the device of the launch's arrays), "
                        f"got stream 0x{int(cfg.hStream):x}, which this device's context refuses (a stream of "
                        f"another device, or a destroyed one). Fix: pass a stream created on "
                        f"cuda:{self.ordinal}, e.g. under torch.cuda.device({self.ordinal})")
            raise DriverError(f"cuLaunchKernelEx({name}, grid={cfg.gridDimX}, block={cfg.blockDimX})", err.name, hint)

    def capturing(self, stream: int) -> bool:
        """Whether ``stream`` is being captured into a CUDA graph (any status but NONE). One
        cuStreamIsCapturing; the context is made current only if the driver asks for it."""
        d, s = _driver(), self.cu_stream(stream)
        if self.sole:
            err, status = d.cuStreamIsCapturing(s)
            if not err:
                return bool(status)  # CU_STREAM_CAPTURE_STATUS_NONE is 0
        return bool(check(self.call(d.cuStreamIsCapturing, s), "cuStreamIsCapturing"))

    def launch_struct(self, name: str, grid: int, block: int, params: ctypes.Structure, stream: int) -> None:
        expected = abi.CTYPES[abi.KERNELS[name]]
        if type(params) is not expected:
            raise TypeError(f"kv-canary: kernel {name} takes {expected.__name__}, got {type(params).__name__}")
        ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        self.launch(name, grid, block, ctypes.addressof(ptrs), stream)  # params, ptrs alive until return

    def resident_blocks(self, name: str, block: int) -> int:
        """Blocks of ``name`` (``block`` threads) the whole device holds at once: the driver's
        occupancy for the kernel times the SM count (cuOccupancyMaxActiveBlocksPerMultiprocessor,
        so register and shared-memory limits of the compiled kernel count). Cached."""
        key = (name, block)
        n = self._occupancy.get(key)
        if n is None:
            per_sm = check(self.call(_driver().cuOccupancyMaxActiveBlocksPerMultiprocessor, self.functions[name],
                                     block, 0), f"cuOccupancyMaxActiveBlocksPerMultiprocessor({name})")
            n = self._occupancy[key] = max(1, int(per_sm)) * self.sm_count
        return n

    @property
    def libraries(self) -> dict[str, object]:
        """The CUlibrary of each family loaded on this device, by family name."""
        return self.functions.libraries

    def global_address(self, name: str) -> tuple[int, int]:
        """Address and size of the __device__ variable ``name`` (its family loaded if not yet)."""
        library = self.functions.library(abi.family_of(name))
        ptr, size = check(self.call(_driver().cuLibraryGetGlobal, library, name.encode()), f"cuLibraryGetGlobal({name})")
        return int(ptr), int(size)


def _load(ordinal: int) -> DeviceRuntime:
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
    check(d.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        return _load_library(ordinal, int(ctx), (major, minor), sms)
    finally:
        check(d.cuCtxPopCurrent(), "cuCtxPopCurrent")


def _load_library(ordinal: int, ctx: int, capability: tuple[int, int], sms: int) -> DeviceRuntime:
    """The runtime of a device whose context is current, its core families loaded."""
    arch, cubins = kernel_library.device_cubins(capability)
    rt = DeviceRuntime(ordinal=ordinal, context=ctx, capability=capability, sm_count=sms,
                       arch=arch, sole=device_count() == 1, pdl=pdl_wanted(arch))
    rt.functions = kernel_library.Kernels(rt, cubins)
    rt.functions.load_core()
    return rt


def runtime(ordinal: int) -> DeviceRuntime:
    """The runtime of device ``ordinal``, loading it on first use (thread-safe)."""
    rt = _runtimes.get(ordinal)
    if rt is None:
        init()
        with _lock:
            rt = _runtimes.get(ordinal)
            if rt is None:
                rt = _runtimes[ordinal] = _load(ordinal)
    return rt
