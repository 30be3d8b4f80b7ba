"""Several CUDA devices in one process, without a GPU: per-device runtimes (context, library,
kernels), allocations made and freed in their device's context, launches that go to the device
owning their arrays, a kv-canary error when the arrays of one launch live on different devices,
and canaries on several devices driven from several threads at once.

:class:`MultiDeviceFake` extends tests/support/fake_cuda.py with N devices as the driver has them: one
primary context per device, a current-context stack per thread, allocations, streams and loaded
libraries that belong to the context current when they were made, and launches refused unless
their function and stream belong to the current context. Every pointer field of every launched
params struct (and every source descriptor it points to) must lie in memory of the launching
device; anything else is recorded in ``errors`` (a wrong-device pointer would fault a real GPU).
"""

from __future__ import annotations

import bisect
import ctypes
import threading

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import abi
from kvcanary.manager.canary import KvCanary, PoolGroup
from kvcanary.runtime import devices, driver, memory
from kvcanary.runtime.launch import Launch
from tests.support import fake_cuda
from tests.support.fake_cuda import OK, real

CTX0 = 0x7000
INVALID_HANDLE = real.CUresult.CUDA_ERROR_INVALID_HANDLE
INVALID_CONTEXT = real.CUresult.CUDA_ERROR_INVALID_CONTEXT
_DECLS = {d.name: d for d in abi.STRUCTS}
CORE_LOADS = sorted(d for d in range(3) for _ in abi.CORE_FAMILIES)  # fake.loads after three runtimes


class MultiDeviceFake(fake_cuda.FakeDriver):
    def __init__(self, devices: int):
        super().__init__()
        self.devices, self.immediate = devices, True
        self.lock = threading.RLock()
        self.local = threading.local()
        self.owner: dict[int, tuple[int, int, str]] = {}   # address -> (bytes, device, "device"/"pinned")
        self.starts: list[int] = []                        # sorted allocation addresses
        self.stream_device: dict[int, int] = {}
        self.loads: list[int] = []                         # device of each cuLibraryLoadData
        self.by_device: dict[int, list[str]] = {d: [] for d in range(devices)}  # kernels launched
        self.errors: list[str] = []

    # ---- contexts ----------------------------------------------------------------------------
    def stack(self) -> list[int]:
        if not hasattr(self.local, "stack"):
            self.local.stack = []
        return self.local.stack

    def current(self) -> int | None:
        """The device of the calling thread's current context (None: no context)."""
        s = self.stack()
        return s[-1] - CTX0 if s else None

    def cuDeviceGetCount(self):
        return OK, self.devices

    def cuDevicePrimaryCtxRetain(self, dev):
        return OK, real.CUcontext(CTX0 + int(dev))

    def cuCtxGetCurrent(self):
        s = self.stack()
        return OK, real.CUcontext(s[-1] if s else 0)

    def cuCtxPushCurrent(self, ctx):
        self.stack().append(int(ctx))
        return (OK,)

    def cuCtxPopCurrent(self):
        s = self.stack()
        if not s:
            return INVALID_CONTEXT, real.CUcontext(0)
        return OK, real.CUcontext(s.pop())

    def _need_context(self, what: str) -> int | None:
        dev = self.current()
        if dev is None:
            self.errors.append(f"{what} without a current context")
        return dev

    # ---- memory ----------------------------------------------------------------------------------
    def _register(self, nbytes: int, kind: str):
        dev = self._need_context(f"{kind} allocation")
        with self.lock:
            addr = self._alloc(nbytes)
            self.owner[addr] = (max(int(nbytes), 1), dev, kind)
            bisect.insort(self.starts, addr)
        return OK, addr

    def cuMemAlloc(self, nbytes):
        return self._register(nbytes, "device")

    def cuMemHostAlloc(self, nbytes, flags):
        return self._register(nbytes, "pinned")

    def where(self, ptr: int) -> tuple[int, str] | None:
        """(device, kind) of the allocation holding ``ptr``, None for memory the fake never made."""
        with self.lock:
            i = bisect.bisect_right(self.starts, ptr) - 1
            if i >= 0:
                size, dev, kind = self.owner[self.starts[i]]
                if ptr < self.starts[i] + size:
                    return dev, kind
        return None

    def _check_ptr(self, ptr: int, what: str) -> None:
        dev = self.current()
        found = self.where(int(ptr))
        if found is None or found[0] != dev:
            self.errors.append(f"{what}: 0x{int(ptr):x} is {found} while cuda:{dev} is current")

    def cuPointerGetAttribute(self, attr, ptr):
        found = self.where(int(ptr))
        return (OK, found[0]) if found else (real.CUresult.CUDA_ERROR_INVALID_VALUE, 0)

    def cuMemFree(self, ptr):
        self._check_ptr(ptr, "cuMemFree")
        with self.lock:
            if self.owner.pop(int(ptr), None) is not None:
                self.starts.remove(int(ptr))
        return super().cuMemFree(ptr)

    cuMemFreeHost = cuMemFree

    def cuMemsetD8Async(self, ptr, value, nbytes, stream):
        self._check_ptr(ptr, "cuMemsetD8Async")
        return super().cuMemsetD8Async(ptr, value, nbytes, stream)

    def cuMemcpyHtoDAsync(self, dst, src, nbytes, stream):
        self._check_ptr(dst, "cuMemcpyHtoDAsync")
        return self._copy(dst, src, nbytes)

    def cuMemcpyDtoH(self, dst, src, nbytes):
        self._check_ptr(src, "cuMemcpyDtoH")
        return super().cuMemcpyDtoH(dst, src, nbytes)

    # ---- libraries, streams, launches ------------------------------------------------------------
    def cuLibraryLoadData(self, cubin, *args):
        dev = self._need_context("cuLibraryLoadData")
        with self.lock:
            self.loads.append(dev)
            err, library = super().cuLibraryLoadData(cubin)
        library.device = dev
        return err, library

    def cuLibraryGetKernel(self, library, name):
        err, kernel = super().cuLibraryGetKernel(library, name)
        return err, (library.device, kernel)

    def cuKernelGetParamInfo(self, kernel, index):
        return super().cuKernelGetParamInfo(kernel[1], index)

    def cuKernelGetFunction(self, kernel):
        return OK, kernel  # (device, name): valid in that context only

    def cuStreamCreate(self, flags):
        dev = self._need_context("cuStreamCreate")
        with self.lock:
            handle = self._handle()
            self.stream_device[handle] = dev
        return OK, handle

    def run(self, stream=None):
        with self.lock:
            super().run(stream)

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        dev, name = fn
        if dev != self.current():
            return (INVALID_CONTEXT if self.current() is None else INVALID_HANDLE,)
        if self.stream_device.get(int(stream), dev) != dev:
            return (INVALID_HANDLE,)  # a stream of another context
        struct_at = ctypes.c_void_p.from_address(int(params)).value
        decl = _DECLS[abi.KERNELS[name]]
        p = abi.CTYPES[decl.name].from_address(struct_at)
        for f in decl.fields:
            if f.kind.startswith("ptr:") and getattr(p, f.name):
                self._check_ptr(getattr(p, f.name), f"{name}.{f.name}")
        if hasattr(p, "sources") and getattr(p, "num_sources", 0):
            descs = (abi.SourceDesc * p.num_sources).from_address(p.sources)
            for i, d in enumerate(descs):
                self._check_ptr(d.base, f"{name}.sources[{i}].base")
        with self.lock:
            self.by_device[dev].append(name)
            return super().cuLaunchKernel(name, gx, gy, gz, bx, by, bz, shared, stream, params, extra)


@pytest.fixture
def fake(monkeypatch):
    f = MultiDeviceFake(3)
    monkeypatch.setattr(fake_cuda, "FakeDriver", lambda: f)
    fake_cuda.install(monkeypatch)
    yield f
    fake_cuda.release(f)


def D(a, device):
    return memory.to_device(np.ascontiguousarray(a), device)


def make_canary(device: int, pool_device: int | None = None, records=None):
    pool = memory.zeros((64, 16), np.uint8, device if pool_device is None else pool_device)
    return KvCanary(PoolGroup(64, k_sources=[kc.RealKvSource(pool, 1, 16)], halves=("K",)), device=device,
                    hash_mode="partial", max_batch=2, verify_capacity=256,
                    export=None if records is None else records.append)


def make_batch(device: int) -> kc.Batch:
    return kc.Batch(D(np.array([1], np.int64), device), D(np.array([3], np.int64), device),
                    D(np.array([1], np.int64), device), D(np.zeros((2, 8), np.int32), device),
                    D(np.array([7], np.int64), device), D(np.array([3], np.int64), device),
                    D(np.array([9], np.int64), device))


def step(canary, batch):
    canary.before_forward(batch)
    canary.after_forward(batch)


def record_violation(canary, slot: int) -> None:
    """A ring row and the write index bumped in fake device memory, as a verify kernel would."""
    wi = ctypes.c_int32.from_address(canary.status.ptr)
    row = (ctypes.c_int64 * abi.RING_COLS).from_address(canary._ring.ptr + 8 * abi.RING_COLS * wi.value)
    row[:] = [int(abi.LaunchTag.TAIL_K_FULL), slot, 3, 7, 7, 0, 0, int(abi.FailReason.VERIFY_CHAIN_HASH_MISMATCH)]
    wi.value += 1


def test_flush_snapshots_behind_everything_even_with_every_fifo_slot_in_flight(fake):
    """A finding enqueued after every snapshot slot was taken (the device DEPTH steps behind,
    then a sweep) is reported by flush: its own snapshot waits for a free slot, never skipped."""
    records = []
    canary, batch = make_canary(2, records=records), make_batch(2)
    for _ in range(2):
        step(canary, batch)
    pump = canary.pump
    while pump.snapshot(driver.PER_THREAD_STREAM, canary.monitor.meta()):
        pass
    assert pump.in_flight == pump.DEPTH
    record_violation(canary, 11)
    canary.flush()
    assert [(r["slot_idx"], r["step"]) for r in records if r["type"] == "violation"] == [(11, 1)]
    assert pump.in_flight == 0


# ---- per-device state ----------------------------------------------------------------------------
def test_each_device_has_its_own_runtime_context_and_library(fake):
    rts = [devices.runtime(d) for d in range(3)]
    assert [rt.ordinal for rt in rts] == [0, 1, 2]
    assert [rt.context for rt in rts] == [CTX0, CTX0 + 1, CTX0 + 2]
    assert sorted(fake.loads) == CORE_LOADS           # one library per core family and device, in its own context
    assert all(rt.functions["kvc_write"] == (d, "kvc_write") for d, rt in enumerate(rts))
    assert not any(rt.sole for rt in rts)             # several devices: the context is checked per launch
    assert devices.runtime(1) is rts[1] and sorted(fake.loads) == CORE_LOADS
    assert fake.stack() == [] and fake.errors == []


def test_a_lazy_family_loads_once_in_its_own_devices_context_whatever_is_current(fake):
    """A family loaded on first use (probe) loads on the device of the runtime asked, in that
    device's context, even from a thread where another device's context (or none) is current,
    and leaves that thread's context as it was; each device loads it once."""
    rts = [devices.runtime(d) for d in range(3)]
    n = len(fake.loads)
    fake.cuCtxPushCurrent(real.CUcontext(CTX0))       # a caller working on cuda:0
    assert rts[2].functions["kvc_empty"] == (2, "kvc_empty")
    assert fake.loads[n:] == [2] and fake.stack() == [CTX0]
    fake.cuCtxPopCurrent()
    done = []
    thread = threading.Thread(target=lambda: done.append(rts[1].global_address("kvc_echo_buffer")[1]))
    fake.globals["kvc_echo_buffer"] = (0x5000, abi.ECHO_BYTES)
    thread.start()
    thread.join(10)
    assert done == [abi.ECHO_BYTES] and fake.loads[n:] == [2, 1]  # no context current there: pushed, popped
    rts[2].functions["kvc_abi_layout"]
    assert fake.loads[n:] == [2, 1] and fake.library_loads[-2:] == ["probe", "probe"]
    assert "probe" in rts[2].libraries and "probe" not in rts[0].libraries and fake.errors == []


def test_owned_memory_is_allocated_and_freed_in_its_devices_context(fake):
    arrays = [memory.zeros((4, 4), np.int64, d) for d in (2, 0, 1)]
    pinned = memory.PinnedBuffer((8,), np.int64, 1, mapped=True)
    assert [fake.where(a.ptr) for a in arrays] == [(2, "device"), (0, "device"), (1, "device")]
    assert fake.where(pinned.ptr) == (1, "pinned")
    assert [kc.as_view(a, name="a").device for a in arrays] == [2, 0, 1]
    np.testing.assert_array_equal(arrays[0].numpy(), np.zeros((4, 4), np.int64))
    s = memory.new_stream(2)
    assert fake.stream_device[s] == 2
    del arrays, pinned
    import gc
    gc.collect()
    assert memory.release_pending() >= 4              # frees wait for a point outside any capture
    assert fake.owner == {} or all(kind == "device" for _, _, kind in fake.owner.values())
    assert fake.stack() == [] and fake.errors == []   # frees ran in the owning device's context


def test_a_canary_launches_on_the_device_of_its_arrays(fake):
    records = []
    canary, batch = make_canary(2, records=records), make_batch(2)
    for _ in range(3):
        step(canary, batch)
    record_violation(canary, 11)
    step(canary, batch)
    canary.flush()
    canary.health_check()
    assert fake.by_device[0] == fake.by_device[1] == []
    # each step's snapshot in its TAIL's last verify, and flush's own launch behind everything enqueued
    assert fake.by_device[2].count("kvc_snapshot") == 1 and fake.by_device[2].count("kvc_write") == 8
    assert canary.pump.folded == 4
    assert [(r["slot_idx"], r["step"]) for r in records if r["type"] == "violation"] == [(11, 3)]
    # flush's snapshot is labelled with the last step it covers (3), not the next one
    assert [r["step"] for r in records if r["type"] == "stats"][-2:] == [3, 3]
    assert fake.stack() == [] and fake.errors == []


def test_the_fake_flags_a_launch_that_reads_another_devices_memory(fake):
    """The pointer check itself: a params struct naming device-1 memory, launched on device 0."""
    foreign = memory.zeros((64, 32), np.uint8, 1)
    p = abi.VerifyParams()
    p.canary = foreign.ptr
    fake.immediate = False  # checked at launch, never run (its other pointers are NULL)
    Launch(devices.runtime(0), "kvc_verify", 1, 256, p, driver.PER_THREAD_STREAM)()
    assert len(fake.errors) == 1 and "kvc_verify.canary" in fake.errors[0] and "cuda:0" in fake.errors[0]


# ---- arrays of one launch on different devices ---------------------------------------------------
def test_a_batch_on_another_device_is_refused(fake):
    canary = make_canary(0)
    with pytest.raises(kc.ValidationError, match="kv-canary: .*device"):
        canary.before_forward(make_batch(1))
    assert fake.by_device[0] == [] and fake.errors == []


def test_kv_sources_on_another_device_are_refused(fake):
    with pytest.raises(kc.ValidationError, match=r"kv-canary: all arrays of a VerifyContext must live on one "
                                                 r"device, got cuda:0, cuda:1.*fix"):
        make_canary(0, pool_device=1)


def test_plan_entries_on_another_device_are_refused_before_launch(fake):
    ctx = kc.VerifyContext(kc.CanaryBuffer.allocate(64, device=0), kc.ViolationSink.allocate(16, device=0))
    plan = kc.StepPlan.allocate(2, 32, device=0, materialize=True)
    plan.slot = memory.zeros((32,), np.int64, 1)
    with pytest.raises(kc.ValidationError) as err:
        kc.verify(ctx, plan)
    text = str(err.value)
    assert text.startswith("kv-canary:") and "expected cuda:0" in text and "on cuda:1" in text
    assert "Fix:" in text
    assert fake.by_device[0] == [] and fake.errors == []


def test_write_arrays_on_another_device_are_refused(fake):
    ctx = kc.VerifyContext(kc.CanaryBuffer.allocate(64, device=0), kc.ViolationSink.allocate(16, device=0))
    plan = kc.StepPlan.allocate(2, 32, device=0)
    ids, pos, loc = (D(np.array([1], np.int64), d) for d in (0, 1, 0))
    with pytest.raises(kc.ValidationError, match="kv-canary: .*one device, got cuda:0, cuda:1"):
        kc.write(ctx, plan, ids, pos, loc)
    assert fake.by_device[0] == [] and fake.errors == []


def test_an_swa_map_on_another_device_is_refused(fake):
    pool = memory.zeros((64, 16), np.uint8, 0)
    src = [kc.RealKvSource(pool, 1, 16)]
    swa = PoolGroup(64, src, halves=("K",), window=4, full_to_swa=memory.zeros((64,), np.int64, 1))
    canary = KvCanary(PoolGroup(64, src, halves=("K",)), swa, device=0, max_batch=2, verify_capacity=256)
    batch = make_batch(0)
    batch.swa_out_cache_loc = batch.out_cache_loc
    with pytest.raises(kc.ValidationError, match="kv-canary: .*device"):
        canary.before_forward(batch)
    assert fake.errors == []


def test_a_stream_of_another_device_gives_a_driver_error_that_names_the_device(fake):
    ctx = kc.VerifyContext(kc.CanaryBuffer.allocate(64, device=0), kc.ViolationSink.allocate(16, device=0))
    plan = kc.StepPlan.allocate(2, 32, device=0, materialize=True)
    foreign = memory.new_stream(1)
    with pytest.raises(kc.DriverError, match=r"CUDA_ERROR_INVALID_HANDLE; expected a stream of cuda:0 .*Fix:"):
        kc.verify(ctx, plan, stream=foreign)
    kc.verify(ctx, plan, stream=memory.new_stream(0))
    assert fake.by_device[0] == ["kvc_verify"] and fake.errors == []


# ---- several devices, several threads ------------------------------------------------------------
def test_canaries_on_several_devices_from_several_threads(fake):
    """Two threads per device, each with its own canary; the violation injected into one canary
    is reported by that canary only, every launch ran on its own device, every thread's context
    stack is balanced at the end."""
    workers = [(d, k) for d in range(3) for k in range(2)]
    start = threading.Barrier(len(workers))
    out, failures = {}, []

    def work(d, k):
        try:
            records = []
            canary = make_canary(d, records=records)
            batch = make_batch(d)
            start.wait()
            for i in range(6):
                step(canary, batch)
                if (d, k, i) == (1, 1, 2):
                    record_violation(canary, 40 + d)
            canary.flush()
            canary.health_check()
            out[d, k] = (records, canary.stats(), list(fake.stack()))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(f"{d},{k}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=w) for w in workers]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert failures == [] and len(out) == len(workers)
    for (d, k), (records, stats, stack) in out.items():
        got = [(r["slot_idx"], r["step"]) for r in records if r["type"] == "violation"]
        assert got == ([(41, 3)] if (d, k) == (1, 1) else []), (d, k)
        assert stats["step"] == 6 and stack == []
    assert sorted(fake.loads) == CORE_LOADS           # concurrent first use loaded each library once
    for d in range(3):
        assert fake.by_device[d].count("kvc_snapshot") == 2  # two canaries: a flush each (steps take theirs)
    assert fake.errors == []
