"""The kernels of one device, one CUlibrary per kernel family (abi.FAMILIES).

A device's runtime loads its core families' cubins with ``cuLibraryLoadData`` when it is created;
a family that is not core (stage: the adapters' staging; probe: the ABI probe, the doctor, the
tests) is loaded on the first lookup of one of its kernels or variables (thread-safe, once, in the
device's primary context). Every kernel loaded has its parameter size checked against the ctypes
struct of abi.py. A device whose arch is outside the configured list gets its families compiled
(and cached) when they are first loaded.

Above the driver (a device's primary context, ``check``) and the compile side
(:mod:`~kvcanary.runtime.nvrtc_build`); the device runtime (:mod:`~kvcanary.runtime.devices`) that
owns one :class:`Kernels` per device is above it, and hands its context in.
"""

from __future__ import annotations

import ctypes
import threading

from .. import abi
from . import driver, nvrtc_build
from ..errors import DriverError, KvCanaryError


def device_cubins(capability: tuple[int, int]) -> tuple[int, dict[str, bytes]]:
    """The arch a device of ``capability`` runs and its cubins by family: those of the configured
    archs (``import kvcanary``) when one fits the device, else its own arch's core families
    compiled now (and cached); the other families compile when first loaded."""
    compiled = nvrtc_build.loaded()
    arch = nvrtc_build.pick_cubin(compiled.cubins, capability) if compiled else None
    if arch is None:  # an arch outside the configured list: compile it now (and cache it)
        arch = capability[0] * 10 + capability[1]
        compiled = nvrtc_build.load_kernels((arch,), families=abi.CORE_FAMILIES)
    return arch, dict(compiled.cubins.get(arch, {}))


class Kernels(dict):
    """Kernel name -> its CUfunction on one device (``context``, running the sm_``arch`` ``cubins``
    by family name), and each loaded family's CUlibrary (``libraries``, by family name). Looking up
    a kernel of a family not loaded yet loads that family first (``__missing__``); ``get`` and
    ``in`` see only loaded kernels."""

    def __init__(self, context: driver.Context, arch: int, cubins: dict[str, bytes]):
        super().__init__()
        self.context, self.arch, self.cubins = context, arch, cubins
        self.libraries: dict[str, object] = {}
        self._lock = threading.Lock()

    def __missing__(self, name: str):
        self.library(abi.family_of(name))
        return dict.__getitem__(self, name)

    def library(self, family: abi.KernelFamily):
        """The CUlibrary of ``family`` on this device, loaded on the first call."""
        lib = self.libraries.get(family.name)
        if lib is None:
            with self._lock:
                lib = self.libraries.get(family.name)
                if lib is None:
                    lib = self._load(family)
        return lib

    def load_core(self) -> None:
        for family in abi.CORE_FAMILIES:
            self.library(family)

    def _cubin(self, family: abi.KernelFamily) -> bytes:
        cubin = self.cubins.get(family.name)
        if cubin is None:  # an arch outside the configured list: this family compiles now (and is cached)
            arch = self.arch
            compiled = nvrtc_build.load_kernels((arch,), families=(family,))
            cubin = compiled.cubins.get(arch, {}).get(family.name)
            if cubin is None:
                raise KvCanaryError(f"kv-canary: expected an sm_{arch} cubin of kernels_src/{family.source} for "
                                    f"CUDA device {self.context.ordinal}, got none: NVRTC {compiled.nvrtc} cannot target "
                                    f"sm_{arch}. Fix: upgrade nvidia-cuda-nvrtc, or use the CPU reference backend")
            self.cubins[family.name] = cubin
        return cubin

    def _load(self, family: abi.KernelFamily):
        """Load ``family``'s cubin in the device's context, check and keep its kernels (lock held)."""
        d, ctx, check, cubin = driver._driver(), self.context, driver.check, self._cubin(family)
        pushed = ctx.enter()
        try:
            lib = check(d.cuLibraryLoadData(cubin, None, None, 0, None, None, 0), "cuLibraryLoadData",
                        f"loading the sm_{self.arch} cubin of the {family.name} kernels on device {ctx.ordinal} "
                        f"(sm_{ctx.capability[0]}{ctx.capability[1]})")
            functions = {}
            for name, struct_name in family.kernels.items():
                kernel = check(d.cuLibraryGetKernel(lib, name.encode()), f"cuLibraryGetKernel({name})")
                _check_param_size(d, kernel, name, ctypes.sizeof(abi.CTYPES[struct_name]))
                functions[name] = check(d.cuKernelGetFunction(kernel), f"cuKernelGetFunction({name})")
        finally:
            ctx.leave(pushed)
        self.update(functions)
        self.libraries[family.name] = lib  # last: a reader without the lock sees a family whole
        return lib


def _check_param_size(d, kernel, name: str, expected: int) -> None:
    offset, size = driver.check(d.cuKernelGetParamInfo(kernel, 0), f"cuKernelGetParamInfo({name}, 0)")
    err, *_ = d.cuKernelGetParamInfo(kernel, 1)
    if int(offset) != 0 or int(size) != expected or int(err) == 0:
        raise DriverError(f"load of kernel {name}", "ABI_MISMATCH",
                          f"expected one parameter of {expected} bytes (ctypes sizeof), the cubin "
                          f"declares {size} bytes at offset {offset}"
                          + (" and more parameters" if int(err) == 0 else "")
                          + ". Fix: clear the compile cache (KVCANARY_CACHE_DIR) and reinstall kvcanary")
