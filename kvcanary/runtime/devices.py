"""The runtime of each CUDA device: its primary context, its kernels, and how to launch them.

:func:`runtime` builds a device's :class:`DeviceRuntime` on first use (thread-safe, one per device
ordinal): the primary context (:func:`kvcanary.runtime.driver.primary_context`), then its kernels,
one CUlibrary per kernel family of the device's arch, the core families at once, the others on
first use, each kernel's parameter size checked against abi.py
(:class:`kvcanary.runtime.kernel_library.Kernels`). A launch is one ``cuLaunchKernelEx`` with the
params struct passed by value through a pointer array (a packed one:
:class:`kvcanary.runtime.launch.Launch`); on sm_90+ it allows programmatic stream serialization
(:func:`launch_config`; ``KVCANARY_PDL=0``: not). Above the driver and the kernel library; the
packed launches, memory and streams are above it. Never called at import: the first launch is
where CUDA is initialised.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass, field

from .. import abi
from . import driver, kernel_library
from ..errors import DriverError
from .driver import CONTEXT_ERRORS

_lock = threading.Lock()
_runtimes: dict[int, "DeviceRuntime"] = {}


def launch_config(d, grid: int, grid_y: int, block: int, stream, pdl: bool):
    """The cuLaunchKernelEx config (``d``: cuda.bindings.driver) of a ``grid`` x ``grid_y`` launch of
    ``block`` threads on ``stream``. ``pdl``: the launch may begin while the previous kernel of the
    stream still runs (programmatic stream serialization), so its blocks are resident when that
    kernel ends; every kvcanary kernel first waits for that kernel's completion and memory
    (KVC_AFTER_PREVIOUS_GRID in common.cuh), so only the launch latency overlaps."""
    cfg = d.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = grid, grid_y, 1, block, 1, 1
    cfg.sharedMemBytes, cfg.hStream = 0, stream
    if pdl:
        attr = d.CUlaunchAttribute()
        attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg.attrs, cfg.numAttrs = [attr], 1
    return cfg


def pdl_wanted(arch: int) -> bool:
    """Whether launches of a cubin for ``arch`` (e.g. 90) use programmatic dependent launch: its
    kernels were compiled with the wait (sm_90+) and KVCANARY_PDL is not "0"."""
    return arch * 10 >= abi.PDL_CUDA_ARCH and os.environ.get("KVCANARY_PDL", "1") != "0"


@dataclass
class DeviceRuntime(driver.Context):
    """The loaded kernels of one device and how to launch them (its context: :class:`driver.Context`)."""

    arch: int  # the arch of the cubins it runs (abi: sm_<arch>)
    functions: kernel_library.Kernels = None  # kernel -> CUfunction; a lazy family loads on its first lookup
    pdl: bool = False  # launches may start during the previous kernel of their stream (common.cuh)
    _streams: dict = field(default_factory=dict)  # CUstream objects by handle (launch hot path)
    _occupancy: dict = field(default_factory=dict)  # (kernel, block) -> resident blocks
    _configs: dict = field(default_factory=dict)  # (grid, grid_y, block, stream, pdl) -> launch config

    def cu_stream(self, stream: int):
        """The CUstream object of a raw handle, built once per handle (building one costs ~1 us)."""
        s = self._streams.get(stream)
        if s is None:
            s = self._streams.setdefault(stream, driver._driver().CUstream(stream))
        return s

    def config(self, grid: int, grid_y: int, block: int, stream: int, name: str = ""):
        """The launch config (:func:`launch_config`) of kernel ``name``'s ``grid`` x ``grid_y`` grid on the
        raw stream handle ``stream``, PDL unless in ``abi.PLAIN_KERNELS``; built once, kept (4096 at most)."""
        pdl = self.pdl and name not in abi.PLAIN_KERNELS
        key = (grid, grid_y, block, stream, pdl)
        cfg = self._configs.get(key)
        if cfg is None:
            if len(self._configs) >= 4096:
                self._configs.clear()
            cfg = launch_config(driver._driver(), grid, grid_y, block, self.cu_stream(stream), pdl)
            cfg = self._configs.setdefault(key, cfg)
        return cfg

    def launch(self, name: str, grid: int, block: int, args_address: int, stream: int, grid_y: int = 1) -> None:
        """Launch ``name`` with a prepacked ``void*[1]`` at ``args_address`` on ``stream`` (a
        ``grid`` x ``grid_y`` grid: ``grid_y`` is abi.HALVES for a paired launch). With one device
        (one primary context) launch first, and make it current only if the driver refuses (no or
        another context current); with several the current context is checked before every launch."""
        fn, cfg = self.functions[name], self.config(grid, grid_y, block, stream, name)
        if self.sole:
            (err,) = driver._driver().cuLaunchKernelEx(cfg, fn, args_address, 0)
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
        fn, configs, launch_ex = self.functions[name], {}, driver._driver().cuLaunchKernelEx

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
        if int(err) not in CONTEXT_ERRORS:
            raise DriverError(f"cuLaunchKernelEx({name}, grid={grid}, block={block})", err.name)

    def _launch_in_context(self, fn, name: str, cfg, args_address: int) -> None:
        pushed = self.enter()
        try:
            (err,) = driver._driver().cuLaunchKernelEx(cfg, fn, args_address, 0)
        finally:
            self.leave(pushed)
        if int(err) != 0:
            hint = ""
            if int(err) in CONTEXT_ERRORS:  # refused in this device's own context: the stream
                hint = (f"expected a stream of cuda:{self.ordinal} (the device of the launch's arrays), "
                        f"got stream 0x{int(cfg.hStream):x}, which this device's context refuses (a stream of "
                        f"another device, or a destroyed one). Fix: pass a stream created on "
                        f"cuda:{self.ordinal}, e.g. under torch.cuda.device({self.ordinal})")
            raise DriverError(f"cuLaunchKernelEx({name}, grid={cfg.gridDimX}, block={cfg.blockDimX})", err.name, hint)

    def capturing(self, stream: int) -> bool:
        """Whether ``stream`` is being captured into a CUDA graph (any status but NONE). One
        cuStreamIsCapturing; the context is made current only if the driver asks for it."""
        d, s = driver._driver(), self.cu_stream(stream)
        if self.sole:
            err, status = d.cuStreamIsCapturing(s)
            if not err:
                return bool(status)  # CU_STREAM_CAPTURE_STATUS_NONE is 0
        return bool(driver.check(self.call(d.cuStreamIsCapturing, s), "cuStreamIsCapturing"))

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
            occupancy = driver._driver().cuOccupancyMaxActiveBlocksPerMultiprocessor
            per_sm = driver.check(self.call(occupancy, self.functions[name], block, 0),
                                  f"cuOccupancyMaxActiveBlocksPerMultiprocessor({name})")
            n = self._occupancy[key] = max(1, int(per_sm)) * self.sm_count
        return n

    @property
    def libraries(self) -> dict[str, object]:
        """The CUlibrary of each family loaded on this device, by family name."""
        return self.functions.libraries

    def global_address(self, name: str) -> tuple[int, int]:
        """Address and size of the __device__ variable ``name`` (its family loaded if not yet)."""
        library = self.functions.library(abi.family_of(name))
        ptr, size = driver.check(self.call(driver._driver().cuLibraryGetGlobal, library, name.encode()),
                                 f"cuLibraryGetGlobal({name})")
        return int(ptr), int(size)


def _load(ordinal: int) -> DeviceRuntime:
    """The runtime of device ``ordinal``, its core families loaded in its primary context."""
    context = driver.primary_context(ordinal)
    arch, cubins = kernel_library.device_cubins(context.capability)
    rt = DeviceRuntime(**vars(context), arch=arch, pdl=pdl_wanted(arch))
    pushed = rt.enter()
    try:
        rt.functions = kernel_library.Kernels(rt, arch, cubins)
        rt.functions.load_core()
    finally:
        rt.leave(pushed)
    return rt


def runtime(ordinal: int) -> DeviceRuntime:
    """The runtime of device ``ordinal``, loading it on first use (thread-safe)."""
    rt = _runtimes.get(ordinal)
    if rt is None:
        driver.init()
        with _lock:
            rt = _runtimes.get(ordinal)
            if rt is None:
                rt = _runtimes[ordinal] = _load(ordinal)
    return rt
