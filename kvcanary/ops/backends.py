"""Where a KvCanary's state lives and how its small reads and writes happen: the host backend
(numpy; the reference runs the launches) or the CUDA backend (device memory, the asynchronous
pump, ring reads on a side stream, sweep staging). :class:`~kvcanary.manager.canary.KvCanary` picks one
once and never branches on the device again.

Both give: ``zeros``, views of status cells, a pump (``take``/``snapshot``/``drain``), ring rows
by claim index (a window of the ring: row i lives at ``i % capacity``), the host's ``consumed``
mark written where the kernels read it, the stream of a step and whether it is capturing.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from .. import abi
from ..interop.arrays import ArrayView, from_pointer
from ..reporting.pump import HostPump, Pump
from ..runtime import devices, driver, memory, streams
from ..runtime.launch import Launch, folded, paired, snapshot_target
from . import packing
from .checks import checked
from .records import host_slots

# KVCANARY_FOLD=1: HEAD's plan build folded into its first launch at small steps (runtime.launch.folded).
# Off by default: on the H200 the folded step measured 1.2 us faster at decode bs 8 but 5 us slower at
# bs 1 and 1.6 us at bs 64 (graph-replayed; docs/performance.md, "Folding the plan build")
FOLD = os.environ.get("KVCANARY_FOLD", "0") == "1"
SWEEP_ROWS = ("slot", "expected_position", "prev_slot", "expected_token")  # a sweep plan's entry arrays, staged


class HostBackend:
    """State in host memory; launches run synchronously on the CPU reference."""

    device = None
    synchronous = True  # an op has run (and reported) when its call returns: the reference runs it

    def prepare(self, bound, stream) -> list:
        """Run bound ops (:class:`~kvcanary.ops.bind.Bound`) on the reference now, in order; nothing
        is left to replay ([])."""
        for b in bound:
            b.host()
        return []

    def prepare_halves(self, bound, stream) -> list:
        """A group's (write, verify) of each half, run on the reference half after half."""
        return self.prepare([op for half in bound for op in half], stream)

    def prepare_head(self, build, bound, stream) -> list:
        """A group's HEAD: its plan build, then its halves (:meth:`prepare_halves`)."""
        return self.prepare(build, stream) + self.prepare_halves(bound, stream)

    def run_eager(self, owner, head, args, names, stream, owners, stream_objs, pack) -> None:
        """An eager op: validated and run on the reference every call (host values are checked)."""
        for launch in pack():
            launch()

    def run_stage(self, stages, batch, stage: str, stream, end=None) -> bool:
        """A canary's stage: validated and run on the reference (every call). ``end`` is unused: the
        host pump reads the status directly."""
        stages.pack(batch, stage, stream)
        return True

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype)

    def to_device(self, host: np.ndarray):
        return host

    def records_array(self, records):
        """Records as this backend's int64 array (a device array comes back to the host)."""
        return np.ascontiguousarray(records if isinstance(records, np.ndarray) else records.numpy(), np.int64)

    def cells(self, status, start: int, n: int = 1, dtype=np.int64):
        """``n`` int64 status cells from ``start`` (as int32 [n]: their low halves)."""
        if np.dtype(dtype) == np.int32:
            return status[start:start + 1].view(np.int32)[:1]
        return status[start:start + n]

    def stream(self, stream, batch) -> None:
        return None

    def capturing(self, stream) -> bool:
        return False

    def pump(self, status, ring, head=None, ring_requests=None):
        return HostPump(status)

    def read_rows(self, ring, start: int, stop: int, ring_requests=None):
        """(rows of claim indices [start, stop), their requests from ``ring_requests`` or None)."""
        idx = np.arange(start, stop, dtype=np.int64) % ring.shape[0]
        return np.array(ring[idx], copy=True), None if ring_requests is None else np.array(ring_requests[idx])

    def set_consumed(self, status, value: int, stream) -> None:
        status[abi.STATUS_CONSUMED] = value

    def record_slots(self, slots, num_slots: int, what: str):
        """(the slots as ``copy_records`` takes them, their count): host slots, each checked."""
        host = host_slots(slots, num_slots, what)
        return host, len(host)

    def copy_records(self, bufs, slots, records, to_buffers: bool, ctx, stream) -> None:
        """Records of ``slots`` out of (or into) the canary buffers ``bufs`` (host arrays)."""
        for b, buf in enumerate(bufs):
            words = buf.view.host.view("<i8")
            if to_buffers:
                words[slots, :abi.FIELDS_PER_SLOT] = records[b]
            else:
                records[b] = words[slots, :abi.FIELDS_PER_SLOT]

    def upload_sweep(self, plan, host: dict, n: int, stream) -> None:
        for k, a in host.items():
            getattr(plan, k)[:n] = a
        plan.num_valid[0], plan.enable[0] = n, 1


class CudaBackend:
    """State in device memory of one CUDA device (kvcanary-owned allocations)."""

    synchronous = False  # ops are enqueued on a stream; the pump reports them later

    def __init__(self, device: int):
        self.device, self.rt = device, devices.runtime(device)
        self._sweep_staging = self._sweep_done = self._pump = None

    def prepare(self, bound, stream) -> list[Launch]:
        """The packed launches of bound ops (:class:`~kvcanary.ops.bind.Bound`), not launched: each on
        ``stream``, or the default its arrays name (:func:`kvcanary.runtime.streams.resolve`), its
        kernel variant and grid chosen for this device."""
        out = []
        for b in bound:
            s = streams.resolve(stream, b.owners, b.views, self.device)
            name, grid, block = b.shape(self.rt)
            out.append(Launch(self.rt, name, grid, block, b.params, s, b.keep))
        return out

    def prepare_halves(self, bound, stream) -> list[Launch]:
        """A group's (write, verify) of each half packed: with both halves, the writes paired into one
        launch and the verifies into another (abi.PAIRED; each pair as two launches where they
        cannot share one), else write then verify."""
        writes, verifies = (self.prepare([wv[k] for wv in bound], stream) for k in (0, 1))
        if len(bound) != abi.HALVES:
            return [x for wv in zip(writes, verifies) for x in wv]
        out = []
        for launches in (writes, verifies):
            both = paired(*launches)
            out += launches if both is None else [both]
        return out

    def prepare_head(self, build, bound, stream) -> list[Launch]:
        """A group's HEAD packed: its plan build and its halves (:meth:`prepare_halves`), the build
        folded into the paired writes with KVCANARY_FOLD=1 where the step is small enough
        (:func:`~kvcanary.runtime.launch.folded`)."""
        plan, rest = self.prepare(build, stream), self.prepare_halves(bound, stream)
        if FOLD and len(plan) == 1 and rest:
            one = folded(plan[0], rest[0])
            if one is not None:
                return [one, *rest[1:]]
        return plan + rest

    def run_eager(self, owner, head, args, names, stream, owners, stream_objs, pack) -> None:
        """An eager op: its launches packed once per layout of ``args`` and replayed
        (:func:`kvcanary.ops.packing.run`)."""
        packing.run(owner, head, args, names, stream, self.device, owners, stream_objs, pack)

    def run_stage(self, stages, batch, stage: str, stream, end=None) -> bool:
        """A canary's stage enqueued on ``stream`` (its launches packed once per batch layout:
        ``stages.launches``); False when the stream is capturing a CUDA graph (the launches run when
        the graph is replayed). ``end``: the step ends with this stage, whose last launch then takes
        the pump's snapshot when the stream is not capturing (``end.claim()`` gives its params, or
        None when every FIFO slot is in flight; ``end.unclaim`` when the launch fails)."""
        captured = self.rt.capturing(stream)
        launches = stages.launches(batch, stage, stream)
        snap = None if end is None or not launches else snapshot_target(launches[-1])
        claim = None
        if snap is not None:
            claim = None if captured else end.claim()
            if claim is None:
                snap.done = 0  # a graph replays no host ticket: its snapshot is launched after the replay
            else:
                ctypes.memmove(ctypes.addressof(snap), ctypes.addressof(claim[1]), ctypes.sizeof(snap))
        try:
            for launch in launches:
                launch.go(stream)
        except BaseException:
            if claim is not None:
                end.unclaim(claim[0])
            raise
        stages.launched += len(launches)
        return not captured

    def zeros(self, shape, dtype):
        return memory.zeros(shape, dtype, self.device)

    def to_device(self, host: np.ndarray):
        return memory.to_device(np.ascontiguousarray(host), self.device)

    def records_array(self, records):
        """Records on this device: host records (e.g. from bytes) are uploaded, records on
        another device are copied through the host; records on this device are used as they are."""
        if getattr(records, "device", None) == self.device and hasattr(records, "ptr"):
            return records
        host = records if isinstance(records, np.ndarray) else records.numpy()
        return self.to_device(np.ascontiguousarray(host, np.int64))

    def cells(self, status, start: int, n: int = 1, dtype=np.int64):
        """``n`` int64 status cells from ``start``, no copy (int32: the low half of each cell, which
        is what an int32 [1] array at its address reads; only n = 1 then)."""
        if np.dtype(dtype) == np.int32:
            return from_pointer(status.ptr + abi.WORD_BYTES * start, (1,), np.int32, device=self.device, owner=status)
        return from_pointer(status.ptr + abi.WORD_BYTES * start, (n,), np.int64, device=self.device, owner=status)

    def stream(self, stream, batch) -> int:
        if type(stream) is int:
            return stream
        first = None if batch is None else batch.req_pool_indices
        # a kvcanary view names the stream it was produced on (a stager's, a CAI v3 producer's)
        return streams.resolve(stream, () if first is None else (first,),
                               (first,) if type(first) is ArrayView else (), self.device)

    def capturing(self, stream: int) -> bool:
        return self.rt.capturing(stream)

    def pump(self, status, ring, head=None, ring_requests=None):
        self._pump = Pump(status, ring, ring.shape[0], self.device, head, ring_requests)
        return self._pump

    def read_rows(self, ring, start: int, stop: int, ring_requests=None):
        """(rows of claim indices [start, stop) in index order, their requests or None): complete
        per a snapshot, copied on the pump's side stream (one wait for the rows and the requests)."""
        cap, want = ring.shape[0], ring_requests is not None
        if stop <= start:
            return np.zeros((0, abi.RING_COLS), np.int64), np.zeros(0, np.int64) if want else None
        a, b = start % cap, (stop - 1) % cap + 1
        spans = [(a, b)] if a < b else [(a, cap), (0, b)]  # the window wraps past the ring's end
        if not want:
            return np.concatenate([self._pump.read_ring(lo, hi) for lo, hi in spans]), None
        parts = [self._pump.read_ring(lo, hi, with_requests=True) for lo, hi in spans]
        return np.concatenate([r for r, _ in parts]), np.concatenate([q for _, q in parts])

    def set_consumed(self, status, value: int, stream: int) -> None:
        """The host's consumed mark into the status cell, in stream order: two 32-bit memsets that
        carry their values (no host buffer that must outlive the call)."""
        d, ptr = driver._driver(), status.ptr + abi.WORD_BYTES * abi.STATUS_CONSUMED
        s = driver.PER_THREAD_STREAM if stream is None else stream  # any order is safe: the mark only grows
        for k, word in enumerate((value & abi.INT32_MASK, (value >> 32) & abi.INT32_MASK)):
            driver.check(self.rt.call(d.cuMemsetD32Async, ptr + 4 * k, word, 1, self.rt.cu_stream(s)),
                         "cuMemsetD32Async")

    def record_slots(self, slots, num_slots: int, what: str):
        """(a device int64 [n] view of the slots, n): host sequences are checked and uploaded;
        device slots are not read (the kernel reports each one outside the pool)."""
        if isinstance(slots, (list, tuple, np.ndarray, int, np.integer)):
            slots = self.to_device(host_slots(slots, num_slots, what))
        view = checked(slots, "slots", dtype=np.int64, ndim=1)
        return view, view.shape[0]

    def copy_records(self, bufs, slots, records, to_buffers: bool, ctx, stream: int) -> None:
        """One kvc_copy_records launch on ``stream``: records of ``slots`` (a device int64 [n] view)
        out of (or into) the buffers; a slot outside them is reported through ``ctx``'s sink."""
        records = checked(records, "records", dtype=np.int64, ndim=3)
        p = abi.RecordsParams()
        ctx.sink.pack_ring(p, ctx.tag)
        p.kernel_run_counter = p.slot_run_counter = p.skip_counter = 0  # no launch of a verify context
        p.canary, p.num_slots = bufs[0].view.ptr, bufs[0].num_slots
        p.slot_stride_words = bufs[0].slot_stride // abi.WORD_BYTES
        p.canary1, p.canary2, p.canary3 = (bufs[k].view.ptr if k < len(bufs) else 0 for k in (1, 2, 3))
        p.slots, p.n, p.records = slots.ptr, slots.shape[0], records.ptr
        p.num_buffers, p.import_records = len(bufs), int(to_buffers)
        grid = max(1, min(self.rt.resident_blocks("kvc_copy_records", abi.BLOCK_THREADS),
                          -(-slots.shape[0] // abi.BLOCK_THREADS)))
        Launch(self.rt, "kvc_copy_records", grid, abi.BLOCK_THREADS, p, stream, (bufs, slots, records))(stream)

    def upload_sweep(self, plan, host: dict, n: int, stream: int) -> None:
        """Upload a host sweep plan through pinned memory on ``stream`` (the previous upload has
        left the staging buffer before it is refilled)."""
        cap, word, flags = plan.verify_capacity, abi.WORD_BYTES, len(SWEEP_ROWS)  # the flags' row follows the entries'
        if self._sweep_staging is None:
            self._sweep_staging = memory.PinnedBuffer((flags + 1, cap), np.int64, self.device)
            self._sweep_done = memory.Event(self.device)
            self._sweep_done.record(stream)
        self._sweep_done.synchronize()
        st = self._sweep_staging.array
        for row, k in enumerate(SWEEP_ROWS):
            st[row, :n] = host[k]
            memory.copy_async(getattr(plan, k).ptr, self._sweep_staging.ptr + row * word * cap, word * n, stream,
                              self.device)
        st[flags, 0], st[flags, 1] = n, 1  # little-endian: the low int32 of each cell is the value
        cells, int32 = self._sweep_staging.ptr + flags * cap * word, np.dtype(np.int32).itemsize
        memory.copy_async(plan.num_valid.ptr, cells, int32, stream, self.device)
        memory.copy_async(plan.enable.ptr, cells + word, int32, stream, self.device)
        self._sweep_done.record(stream)


def for_device(device: int | None):
    """A canary's own backend (its pump and staging buffers are its own)."""
    return HostBackend() if device is None else CudaBackend(device)


_HOST = HostBackend()


_EXECUTORS: dict[int, CudaBackend] = {}


def executor(device: int | None):
    """The backend that runs ops bound to ``device``'s arrays: the host's, or one per device
    (rebuilt when the device's runtime is)."""
    if device is None:
        return _HOST
    rt, found = devices.runtime(device), _EXECUTORS.get(device)
    if found is None or found.rt is not rt:
        found = _EXECUTORS[device] = CudaBackend(device)
    return found
