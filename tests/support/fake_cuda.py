"""A stand-in CUDA driver for CPU tests of the device code paths of the host (manager, pump).

"Device memory" is host memory (ctypes buffers at real addresses), launches are queued per
stream and run when the test calls :meth:`FakeDriver.run` or a synchronising call is made. Each
runs from the params struct bytes copied at launch time, as the driver does: ``kvc_snapshot`` (and a
verify's ``snap``) is emulated, ``kvc_prepare`` (and the fold's plan part) enables an empty plan,
verify and write launches only count their run (``kernel_run_counter``), so a fake step is clean. Each ``cuLibraryLoadData`` is a :class:`FakeLibrary`
of the cubin's real entry points and variables (a kernel asked of another family's library is not
found, as on a device); ``library_loads`` names the family of each, in load order. Types and enums
come from the real ``cuda.bindings.driver`` (importing it needs no driver). Install with :func:`install`.
"""

from __future__ import annotations

import ctypes
import gc
from collections import defaultdict

from cuda.bindings import driver as real

from kvcanary import abi
from tests.support.cubin import entry_points, variables

OK = real.CUresult.CUDA_SUCCESS
NOT_FOUND = real.CUresult.CUDA_ERROR_NOT_FOUND
_SYMBOLS: dict[bytes, tuple[frozenset, frozenset]] = {}  # cubin -> its (entry points, variables), read once


class FakeLibrary:
    """A loaded cubin: the family its entry points belong to, its kernels and variables."""

    def __init__(self, cubin: bytes, device: int = 0):
        if cubin not in _SYMBOLS:
            _SYMBOLS[cubin] = frozenset(entry_points(cubin)), frozenset(variables(cubin))
        self.kernels, self.variables = _SYMBOLS[cubin]
        families = {abi.family_of(k).name for k in self.kernels}
        assert len(families) == 1, f"expected the cubin of one kernel family, got kernels of {sorted(families)}"
        self.family, self.device = families.pop(), device


def _snapshot(p) -> None:
    """What kvc_snapshot (or a launch's kvc_step_end) does: the status block, then the ticket."""
    ctypes.memmove(p.payload, p.status, 8 * p.n)
    ctypes.c_int64.from_address(p.done).value = p.ticket


def _prepare(p) -> None:
    """What kvc_prepare does for the fake step: a plan with nothing to verify, enabled."""
    ctypes.c_int32.from_address(p.verify_num_valid).value = 0
    ctypes.c_int32.from_address(p.verify_enable).value = 1


class FakeDriver:
    def __init__(self):
        self.memory: dict[int, object] = {}
        self.pending: dict[int, list] = defaultdict(list)   # stream -> [(kernel, params bytes)]
        self.launched: list[str] = []                        # kernel names, in launch order
        self.shapes: list[tuple[str, int, int]] = []         # (kernel, grid, block) per launch
        self.pdl: list[bool] = []                            # per cuLaunchKernelEx: PDL allowed
        self.streams: list[int] = []                         # the stream handle of each launch
        self.capturing: set[int] = set()                     # streams reported as capturing
        self.captured: list = []                             # launches made while capturing, as pending's
        self.invalidated: set[int] = set()                   # captures a capture-unsafe call broke
        self.unsafe_calls: list[str] = []                    # those calls, in order
        self.calls: dict[str, int] = defaultdict(int)
        self.library_loads: list[str] = []                   # the family of each cuLibraryLoadData
        self.immediate = False                               # run each launch when it is made
        self.kernels = None                                  # tests.emu.Kernels: run kernels for real
        self.globals: dict[str, tuple[int, int]] = {}        # variables (address, size) without the emulator
        self._next_handle = 0x1000

    def __getattr__(self, name):  # types, enums and flags of the real module
        return getattr(real, name)

    # ---- test controls ---------------------------------------------------------------------
    def run(self, stream: int | None = None) -> None:
        """Execute the queued launches of ``stream`` (all streams when None), in order."""
        for s in [stream] if stream is not None else list(self.pending):
            queue, self.pending[s] = self.pending[s], []
            for kernel, grid, grid_y, block, params in queue:
                p = abi.CTYPES[abi.KERNELS[kernel]].from_buffer_copy(params)
                if self.kernels is not None:
                    self.kernels.launch(kernel, grid, block, params, grid_y)
                    continue
                if hasattr(p, "plan"):  # HEAD's fold: the plan builder's part first
                    _prepare(p.plan[0])
                if hasattr(p, "half"):  # a paired launch: each half counts its run
                    for half in p.half:
                        ctypes.c_int64.from_address(half.kernel_run_counter).value += 1
                elif kernel == "kvc_snapshot":
                    _snapshot(p)
                elif kernel == "kvc_prepare":
                    _prepare(p)
                elif hasattr(p, "kernel_run_counter"):
                    ctypes.c_int64.from_address(p.kernel_run_counter).value += 1
                holder = p.half[0] if hasattr(p, "half") else p
                if hasattr(holder, "snap") and holder.snap[0].done:  # the step's last launch takes the snapshot
                    _snapshot(holder.snap[0])

    def replay(self, ops: list, stream: int) -> None:
        """Run a captured sequence (``captured`` entries: launches, memcpy and memset nodes, and
        callables a test put there) in order on ``stream``, as a graph replay runs its nodes."""
        for op in ops:
            if callable(op):
                op()
            elif op[0] == "memcpy":
                ctypes.memmove(op[1], op[2], op[3])
            elif op[0] == "memset":
                ctypes.memset(op[1], op[2], op[3])
            else:
                self.pending[stream].append(op)
                self.run(stream)

    def _alloc(self, nbytes: int) -> int:
        buf = ctypes.create_string_buffer(max(int(nbytes), 1))
        addr = ctypes.addressof(buf)
        self.memory[addr] = buf
        return addr

    def _handle(self) -> int:
        self._next_handle += 16
        return self._next_handle

    # ---- initialisation and loading ------------------------------------------------------------
    def cuInit(self, flags):
        return (OK,)

    def cuDeviceGetCount(self):
        return OK, 1

    def cuDeviceGet(self, ordinal):
        return OK, ordinal

    def cuDeviceGetAttribute(self, attr, dev):
        A = real.CUdevice_attribute
        return OK, {A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9,
                    A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0}.get(attr, 132)

    def cuDevicePrimaryCtxRetain(self, dev):
        return OK, real.CUcontext(0x7000)

    def cuCtxGetCurrent(self):
        return OK, real.CUcontext(0x7000)

    def cuCtxPushCurrent(self, ctx):
        return (OK,)

    def cuCtxPopCurrent(self):
        return OK, real.CUcontext(0x7000)

    def cuLibraryLoadData(self, cubin, *args):
        library = FakeLibrary(cubin)
        self.library_loads.append(library.family)
        return OK, library

    def cuLibraryGetKernel(self, library, name):
        return (OK, name.decode()) if name.decode() in library.kernels else (NOT_FOUND, None)

    def cuKernelGetParamInfo(self, kernel, index):
        if index:
            return real.CUresult.CUDA_ERROR_INVALID_VALUE, 0, 0
        return OK, 0, ctypes.sizeof(abi.CTYPES[abi.KERNELS[kernel]])

    def cuLibraryGetGlobal(self, library, name):
        if name.decode() not in library.variables:
            return NOT_FOUND, 0, 0
        ptr, size = (self.kernels.globals if self.kernels is not None else self.globals)[name.decode()]
        return OK, ptr, size

    def cuKernelGetFunction(self, kernel):
        return OK, kernel

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, fn, block, smem):
        return OK, 2048 // int(block)

    def cuPointerGetAttribute(self, attr, ptr):
        return OK, 0

    # ---- memory ----------------------------------------------------------------------------------
    def _capture_unsafe(self, call: str):
        """A call CUDA refuses while a stream captures a graph (global capture mode): it fails and
        invalidates every capture in progress; None when none is."""
        if not self.capturing:
            return None
        self.invalidated |= self.capturing
        self.unsafe_calls.append(call)
        return real.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED

    def cuMemAlloc(self, nbytes):
        err = self._capture_unsafe("cuMemAlloc")
        return (err, 0) if err is not None else (OK, self._alloc(nbytes))

    def cuMemHostAlloc(self, nbytes, flags):
        return OK, self._alloc(nbytes)

    def cuMemHostGetDevicePointer(self, ptr, flags):
        return OK, ptr

    def _free(self, ptr, call: str):
        err = self._capture_unsafe(call)
        if err is not None:
            return (err,)
        self.memory.pop(int(ptr), None)
        return (OK,)

    def cuMemFree(self, ptr):
        return self._free(ptr, "cuMemFree")

    def cuMemFreeHost(self, ptr):
        return self._free(ptr, "cuMemFreeHost")

    def cuMemsetD8Async(self, ptr, value, nbytes, stream):
        if int(stream) in self.capturing:  # a memset node: runs at each replay
            self.captured.append(("memset", int(ptr), int(value), int(nbytes)))
            return (OK,)
        ctypes.memset(int(ptr), value, nbytes)
        return (OK,)

    def cuMemsetD32Async(self, ptr, value, n, stream):
        self.calls["cuMemsetD32Async"] += 1
        (ctypes.c_uint32 * int(n)).from_address(int(ptr))[:] = [int(value)] * int(n)
        return (OK,)

    def _copy(self, dst, src, nbytes, stream=None):
        if stream is not None and int(stream) in self.capturing:  # a memcpy node: runs at each replay
            self.captured.append(("memcpy", int(dst), int(src), int(nbytes)))
            return (OK,)
        ctypes.memmove(int(dst), int(src), nbytes)
        return (OK,)

    cuMemcpyHtoDAsync = cuMemcpyAsync = _copy

    def cuMemcpyDtoH(self, dst, src, nbytes):
        self.run()
        return self._copy(dst, src, nbytes)

    # ---- streams, events, launches -----------------------------------------------------------
    def cuStreamCreate(self, flags):
        return OK, self._handle()

    def cuEventCreate(self, flags):
        return OK, self._handle()

    def cuEventRecord(self, event, stream):
        return (OK,)

    def cuEventQuery(self, event):
        self.calls["cuEventQuery"] += 1
        return (OK,)

    def cuStreamWaitEvent(self, stream, event, flags):
        return (OK,)

    def cuStreamSynchronize(self, stream):
        self.run(int(stream))
        return (OK,)

    def cuEventSynchronize(self, event):
        self.run()
        return (OK,)

    def cuCtxSynchronize(self):
        self.calls["cuCtxSynchronize"] += 1
        self.run()
        return (OK,)

    def cuStreamIsCapturing(self, stream):
        self.calls["cuStreamIsCapturing"] += 1
        S = real.CUstreamCaptureStatus
        active = int(stream) in self.capturing
        return OK, S.CU_STREAM_CAPTURE_STATUS_ACTIVE if active else S.CU_STREAM_CAPTURE_STATUS_NONE

    def cuLaunchKernelEx(self, config, fn, params, extra):
        """As the driver: the config's grid, block and stream; its attributes are recorded (the
        launch's programmatic stream serialization flag in ``pdl``) and the launch runs as
        :meth:`cuLaunchKernel` (every kernel waits for the previous one first)."""
        PSS = real.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attrs = list(config.attrs)[:config.numAttrs]
        self.pdl.append(any(a.id == PSS and a.value.programmaticStreamSerializationAllowed for a in attrs))
        return self.cuLaunchKernel(fn, config.gridDimX, config.gridDimY, config.gridDimZ, config.blockDimX,
                                   config.blockDimY, config.blockDimZ, config.sharedMemBytes, config.hStream,
                                   params, extra)

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        size = ctypes.sizeof(abi.CTYPES[abi.KERNELS[fn]])
        struct_at = ctypes.c_void_p.from_address(int(params)).value
        self.launched.append(fn)
        self.streams.append(int(stream))
        self.shapes.append((fn, gx, bx))
        launch = (fn, gx, gy, bx, ctypes.string_at(struct_at, size))
        if int(stream) in self.capturing:  # a captured launch runs only on replay
            self.captured.append(launch)
        else:
            self.pending[int(stream)].append(launch)
            if self.immediate:
                self.run(int(stream))
        return (OK,)


def install(monkeypatch) -> FakeDriver:
    """Route kvcanary's driver layer to a fresh FakeDriver until ``monkeypatch`` is undone; call
    :func:`release` before that."""
    from kvcanary.runtime import devices, driver
    fake = FakeDriver()
    monkeypatch.setattr(driver, "_driver", lambda: fake)
    monkeypatch.setattr(driver, "_initialised", False)
    monkeypatch.setattr(devices, "_runtimes", {})
    return fake


def release(fake: FakeDriver) -> None:
    """Disarm the fake runtimes before ``monkeypatch`` is undone: whatever still holds fake memory
    (e.g. objects kept by a failed test's traceback) frees it later through its runtime's
    ``call``, which must then never hand a fake pointer or context to a real driver."""
    from kvcanary.runtime import devices, memory
    gc.collect()
    memory.release_pending()  # frees waiting for a point outside a capture: this fake's, now
    for rt in devices._runtimes.values():
        rt.call = lambda fn, *args: (OK,)
