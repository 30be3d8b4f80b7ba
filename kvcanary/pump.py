"""Asynchronous violation pump (SPEC §10): the serving loop never waits on the canary.

Each step, a small status block (ring write index, per-launch counters, plan flags) is copied to
pinned host memory on a side stream behind an event; the host reads the *previous* step's copy
when its event has completed (``cuEventQuery``, never a wait). Only when that copy shows new
violations is the ring read back (a copy on the otherwise idle side stream). On the CPU backend
the status is read directly.
"""

from __future__ import annotations

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
    """Snapshots ``status`` (int64 ``[n]``) each :meth:`poll`; hands completed ones to a callback."""

    def __init__(self, status, ring, ring_capacity: int, device: int | None):
        self.status, self.ring, self.capacity, self.device = status, ring, ring_capacity, device
        self.n = len(status) if device is None else status.shape[0]
        if device is not None:
            from . import memory
            self.pinned = [memory.PinnedBuffer((self.n,), np.int64, device) for _ in range(2)]
            self.ring_pinned = memory.PinnedBuffer((ring_capacity, abi.RING_COLS), np.int64, device)
            self.done = [memory.Event(device) for _ in range(2)]
            self.ready = memory.Event(device)
            self.side = memory.new_stream(device)
            self.pending = [False, False]
            self.meta = [None, None]
            self.cur = 0

    def take(self, meta=None):
        """(snapshot, its meta) of the newest completed snapshot not yet taken, or None; never
        waits. On the CPU backend the status is current, and ``meta`` is passed through."""
        if self.device is None:
            return np.array(self.status, copy=True), meta
        prev = self.cur ^ 1
        if self.pending[prev] and self.done[prev].done():
            self.pending[prev] = False
            return self.pinned[prev].array.copy(), self.meta[prev]
        return None

    def snapshot(self, stream: int, meta=None) -> None:
        """Enqueue a copy of the status block behind the work already on ``stream``; ``meta``
        (host bookkeeping of that moment) comes back with it from :meth:`take`."""
        if self.device is None:
            return
        self.meta[self.cur] = meta
        from . import memory
        self.ready.record(stream)
        memory.stream_wait(self.side, self.ready)
        memory.copy_async(self.pinned[self.cur].ptr, self.status.ptr, 8 * self.n, self.side, self.device)
        self.done[self.cur].record(self.side)
        self.pending[self.cur], self.cur = True, self.cur ^ 1

    def drain(self, meta=None):
        """Block until every snapshot is complete; (newest, its meta) or None (shutdown, tests)."""
        if self.device is None:
            return np.array(self.status, copy=True), meta
        from . import memory
        memory.stream_synchronize(self.side, self.device)
        newest = self.cur ^ 1
        if not self.pending[newest]:
            return None
        self.pending = [False, False]
        return self.pinned[newest].array.copy(), self.meta[newest]

    def read_ring(self, start: int, stop: int) -> np.ndarray:
        """Ring rows [start, stop) (already complete per a snapshot), as host numpy."""
        if stop <= start:
            return np.zeros((0, abi.RING_COLS), np.int64)
        if self.device is None:
            return np.array(self.ring[start:stop], copy=True)
        from . import memory
        row = 8 * abi.RING_COLS
        memory.copy_async(self.ring_pinned.ptr + start * row, self.ring.ptr + start * row,
                          (stop - start) * row, self.side, self.device)
        memory.stream_synchronize(self.side, self.device)
        return self.ring_pinned.array[start:stop].copy()
