"""Asynchronous violation pump (docs/format.md §10): the serving loop never waits on the canary.

Each step, the last block to finish of the step's last launch (eager TAIL's last verify:
``kvc_step_end``, kernels_src/common.cuh), or a launch of ``kvc_snapshot`` (kernels_src/pump.cu) on
the step's stream after the step's launches (a replayed graph, a poll), copies a small status
block (ring write index, per-launch counters, plan flags) into a slot of pinned host memory mapped
for the device, then writes the slot's completion word.
The host reads completion words with plain memory loads (no driver call, no event) and takes the
finished snapshots in FIFO order. Only when a snapshot shows new violations is the ring read back
(a copy on a stream of its own, which waits for nothing else). The host backend's :class:`HostPump`
reads the status directly.
"""

from __future__ import annotations

import platform
import threading
from collections import deque

import numpy as np

from .. import abi
from ..runtime import devices, driver, memory
from ..runtime.launch import Launch

DEPTH = 8
_SNAPSHOT_BLOCK = 128
# x86-64 keeps loads in program order: the completion word is read before the payload. Weakly
# ordered hosts (aarch64) pass a lock between the two reads as a best-effort load barrier.
_ORDERED_LOADS = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_barrier = threading.Lock()


class SnapshotFifo:
    """The host side of the snapshot FIFO, over host memory the device writes.

    ``payload`` is int64 ``[depth, n]`` (slot i receives one copy of the status block) and
    ``words`` int64 ``[depth]`` (slot i's completion word). :meth:`claim` picks a free slot,
    clears its word and gives the ticket the device must write there once the payload is
    complete; :meth:`take` hands back completed slots oldest first, from plain loads. A claim
    when every slot is in flight is skipped (counted in ``skipped``): the next snapshot covers
    the same counters, so nothing is lost but the exact step of what happened in between.
    """

    def __init__(self, payload: np.ndarray, words: np.ndarray, head: int | None = None):
        self.payload, self.words = payload, words
        # cells [0, head] of a snapshot are always there; the rest (the step's request verdicts,
        # docs/format.md §5.7) only when cell head is nonzero: the kernel copied them then
        self.head = payload.shape[1] - 1 if head is None else head
        self._words = memoryview(words).cast("B").cast("q")  # element reads give Python ints
        self.depth = len(words)
        self.tickets = [0] * self.depth
        self.meta: list = [None] * self.depth
        self.queue: deque[int] = deque()
        self.free = list(range(self.depth - 1, -1, -1))
        self.skipped = 0
        self._next = 1

    def claim(self, meta=None) -> int:
        """A slot for the next snapshot with ``meta`` attached (-1 when all are in flight). Its
        completion word is 0 on return; ``tickets[slot]`` is what the device must write."""
        if not self.free:
            self.skipped += 1
            return -1
        slot = self.free.pop()
        self._words[slot] = 0  # cleared before the launch that sets it is enqueued
        self.tickets[slot], self._next = self._next, self._next + 1
        self.meta[slot] = meta
        self.queue.append(slot)
        return slot

    def unclaim(self, slot: int) -> None:
        """Return the newest claim (its launch could not be enqueued)."""
        if self.queue and self.queue[-1] == slot:
            self.queue.pop()
            self.free.append(slot)

    def completed(self) -> list:
        """[(snapshot as a list of ints, its meta)] of every completed slot not yet taken, oldest
        first; stops at the first slot still in flight. Never waits."""
        out, queue, words, tickets = [], self.queue, self._words, self.tickets
        while queue:
            slot = queue[0]
            if words[slot] != tickets[slot]:
                break
            if not _ORDERED_LOADS:
                with _barrier:
                    pass
            row = self.payload[slot]
            snap = row[:self.head + 1].tolist()
            if snap[self.head]:
                snap += row[self.head + 1:].tolist()
            out.append((snap, self.meta[slot]))
            queue.popleft()
            self.free.append(slot)
        return out

    @property
    def in_flight(self) -> int:
        return len(self.queue)


class HostPump:
    """The host backend's pump: the status is current after every (synchronous) launch."""

    launches = skipped = in_flight = folded = 0

    def __init__(self, status):
        self.status = status

    def take(self, meta=None) -> list:
        return [(self.status.tolist(), meta)]

    def snapshot(self, stream, meta=None) -> bool:
        return True

    def drain(self, meta=None) -> list:
        return self.take(meta)


class Pump:
    """Snapshots ``status`` (a device int64 ``[n]``) into a FIFO of ``DEPTH`` pinned slots; hands
    back completed snapshots in order, so each violation is attributed to the first step whose
    snapshot shows it. When the device runs ``DEPTH`` steps behind, a new snapshot is skipped
    (the next covers it). ``launches`` counts the snapshot launches enqueued, ``folded`` the snapshots
    a step's last launch took (:meth:`claim_end`)."""

    DEPTH = DEPTH

    def __init__(self, status, ring, ring_capacity: int, device: int, head: int | None = None, ring_requests=None):
        self.status, self.ring, self.capacity, self.device = status, ring, ring_capacity, device
        self.n = status.shape[0]
        self.head = self.n - 1 if head is None else head  # cells past head: copied only when cell head != 0
        self.ring_requests = ring_requests
        self.launches = 0  # kvc_snapshot launches enqueued
        self.folded = 0    # snapshots claimed by a step's last launch (claim_end)
        rt = devices.runtime(device)
        self.pinned = memory.PinnedBuffer((self.DEPTH, self.n), np.int64, device, mapped=True)
        self.done = memory.PinnedBuffer((self.DEPTH,), np.int64, device, mapped=True)
        self.fifo = SnapshotFifo(self.pinned.array, self.done.array, self.head)
        self.ring_pinned = memory.PinnedBuffer((ring_capacity, abi.RING_COLS), np.int64, device)
        self.requests_pinned = None
        self.ring_side = memory.new_stream(device)  # idle but for ring reads: never waits on steps
        block = min(_SNAPSHOT_BLOCK, abi.WARP_SIZE * -(-self.n // abi.WARP_SIZE))
        # a snapshot folded into a step's last launch counts that launch's finished blocks here, a
        # cell per slot: no two snapshots in flight share one (common.cuh kvc_step_end)
        self.arrive = memory.zeros((self.DEPTH,), np.int64, device)
        self.slot_launches = []  # one prepacked launch per slot; its ticket set per use
        for slot in range(self.DEPTH):
            p = abi.SnapshotParams()
            p.status, p.n = status.ptr, self.n
            p.payload = self.pinned.device_ptr + abi.WORD_BYTES * self.n * slot
            p.done = self.done.device_ptr + abi.WORD_BYTES * slot
            p.head = self.head
            p.arrive = self.arrive.ptr + abi.WORD_BYTES * slot
            self.slot_launches.append(Launch(rt, "kvc_snapshot", 1, block, p, driver.PER_THREAD_STREAM,
                                                    (status, self.pinned, self.done, self.arrive)))

    @property
    def skipped(self) -> int:
        return self.fifo.skipped

    @property
    def in_flight(self) -> int:
        return self.fifo.in_flight

    def take(self, meta=None) -> list:
        """[(snapshot, its meta)] of every completed snapshot not yet taken, oldest first; never
        waits. A snapshot is the status block as a list of ints."""
        return self.fifo.completed()

    def snapshot(self, stream: int, meta=None) -> bool:
        """Enqueue one ``kvc_snapshot`` launch on ``stream`` behind the work already there;
        ``meta`` (host bookkeeping of that moment) comes back with it from :meth:`take`. False
        when skipped (every slot in flight). Never call it while ``stream`` is capturing."""
        fifo = self.fifo
        slot = fifo.claim(meta)
        if slot < 0:
            return False
        launch = self.slot_launches[slot]
        launch.params.ticket = fifo.tickets[slot]
        try:
            launch.go(stream)
        except BaseException:
            fifo.unclaim(slot)
            raise
        self.launches += 1
        return True

    def claim_end(self, meta=None):
        """(FIFO slot, its snapshot params with the ticket set) for a snapshot that a step's last
        launch takes (kvc_step_end), or None when skipped (every slot in flight, as :meth:`snapshot`)."""
        fifo = self.fifo
        slot = fifo.claim(meta)
        if slot < 0:
            return None
        params = self.slot_launches[slot].params
        params.ticket = fifo.tickets[slot]
        self.folded += 1
        return slot, params

    def unclaim(self, slot: int) -> None:
        """Give back the newest claim: the launch that was to take it could not be enqueued."""
        self.fifo.unclaim(slot)
        self.folded -= 1

    def drain(self, meta=None) -> list:
        """Wait for the device (context synchronise) and take every snapshot (shutdown, tests)."""
        memory.context_synchronize(self.device)
        return self.fifo.completed()

    def read_ring(self, start: int, stop: int, with_requests: bool = False):
        """Ring rows [start, stop) (complete per a snapshot), as host numpy; with ``with_requests``
        (rows, their requests: docs/format.md §5.7). Waits only for these copies, on a stream of its
        own: not for the steps enqueued since."""
        rows = np.zeros((max(stop - start, 0), abi.RING_COLS), np.int64)
        requests = np.full(len(rows), abi.NO_REQUEST, np.int64)
        if stop > start:
            word = abi.WORD_BYTES
            copies = [(self.ring_pinned, self.ring, word * abi.RING_COLS)]
            if with_requests and self.ring_requests is not None:
                if self.requests_pinned is None:  # allocated on the first read of row requests
                    self.requests_pinned = memory.PinnedBuffer((self.capacity,), np.int64, self.device)
                copies.append((self.requests_pinned, self.ring_requests, word))
            for pinned, src, width in copies:
                memory.copy_async(pinned.ptr + start * width, src.ptr + start * width, (stop - start) * width,
                                  self.ring_side, self.device)
            memory.stream_synchronize(self.ring_side, self.device)
            rows = self.ring_pinned.array[start:stop].copy()
            if len(copies) > 1:
                requests = self.requests_pinned.array[start:stop].copy()
        return (rows, requests) if with_requests else rows
