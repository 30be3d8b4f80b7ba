"""Asynchronous violation pump (SPEC §10): the serving loop never waits on the canary.

Each step, a small status block (ring write index, per-launch counters, plan flags) is copied to
pinned host memory on a side stream behind an event; the host reads the *previous* step's copy
when its event has completed (``cuEventQuery``, never a wait). Only when that copy shows new
violations is the ring read back (a copy on a stream of its own, which waits for nothing else).
On the CPU backend the status is read directly.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from . import abi
from .arrays import from_pointer


def int64_slice(status, start: int, n: int, device: int | None):
    """``status[start:start+n]`` of an int64 block, host or device, without copying."""
    if device is None:
        return status[start:start + n]
    return from_pointer(status.ptr + 8 * start, (n,), np.int64, device=device, owner=status)


def int32_at(status, index: int, device: int | None):
    """The low int32 of ``status[index]`` as an int32 ``[1]`` array (little-endian)."""
    if device is None:
        return status[index:index + 1].view(np.int32)[:1]
    return from_pointer(status.ptr + 8 * index, (1,), np.int32, device=device, owner=status)


class Pump:
    """Snapshots ``status`` (int64 ``[n]``) into a FIFO of pinned buffers; hands back completed
    snapshots in order, so each violation is attributed to the first step whose snapshot shows it.
    When the device runs ``DEPTH`` steps behind, a new snapshot is skipped (the next covers it)."""

    DEPTH = 8

    def __init__(self, status, ring, ring_capacity: int, device: int | None):
        self.status, self.ring, self.capacity, self.device = status, ring, ring_capacity, device
        self.n = len(status) if device is None else status.shape[0]
        self.skipped = 0
        if device is not None:
            from . import memory
            self.pinned = [memory.PinnedBuffer((self.n,), np.int64, device) for _ in range(self.DEPTH)]
            self.ring_pinned = memory.PinnedBuffer((ring_capacity, abi.RING_COLS), np.int64, device)
            self.done = [memory.Event(device) for _ in range(self.DEPTH)]
            self.ready = memory.Event(device)
            self.side = memory.new_stream(device)
            self.ring_side = memory.new_stream(device)  # idle but for ring reads: never waits on steps
            self.meta: list = [None] * self.DEPTH
            self.queue: deque[int] = deque()
            self.free = list(range(self.DEPTH))

    def take(self, meta=None) -> list:
        """[(snapshot, its meta)] of every completed snapshot not yet taken, oldest first; never
        waits. On the CPU backend the status is current, and ``meta`` is passed through."""
        if self.device is None:
            return [(np.array(self.status, copy=True), meta)]
        out = []
        while self.queue and self.done[self.queue[0]].done():
            slot = self.queue.popleft()
            out.append((self.pinned[slot].array.copy(), self.meta[slot]))
            self.free.append(slot)
        return out

    def snapshot(self, stream: int, meta=None) -> None:
        """Enqueue a copy of the status block behind the work already on ``stream``; ``meta``
        (host bookkeeping of that moment) comes back with it from :meth:`take`."""
        if self.device is None:
            return
        if not self.free:
            self.skipped += 1
            return
        from . import memory
        slot = self.free.pop()
        self.meta[slot] = meta
        self.ready.record(stream)
        memory.stream_wait(self.side, self.ready)
        memory.copy_async(self.pinned[slot].ptr, self.status.ptr, 8 * self.n, self.side, self.device)
        self.done[slot].record(self.side)
        self.queue.append(slot)

    def drain(self, meta=None) -> list:
        """Block until every snapshot is complete and take them all (shutdown, tests)."""
        if self.device is None:
            return [(np.array(self.status, copy=True), meta)]
        from . import memory
        memory.stream_synchronize(self.side, self.device)
        return self.take()

    def read_ring(self, start: int, stop: int) -> np.ndarray:
        """Ring rows [start, stop) (already complete per a snapshot), as host numpy. Waits only
        for this copy, on a stream of its own: not for the steps enqueued since."""
        if stop <= start:
            return np.zeros((0, abi.RING_COLS), np.int64)
        if self.device is None:
            return np.array(self.ring[start:stop], copy=True)
        from . import memory
        row = 8 * abi.RING_COLS
        memory.copy_async(self.ring_pinned.ptr + start * row, self.ring.ptr + start * row,
                          (stop - start) * row, self.ring_side, self.device)
        memory.stream_synchronize(self.ring_side, self.device)
        return self.ring_pinned.array[start:stop].copy()
