"""The timers pytest-benchmark reads in this suite, so that its statistics are the operation's time.

pytest-benchmark times a round by reading its timer before and after the target
(``end - start``). A test picks the timer with a marker (pytest-benchmark's own per-test option):

- ``@gpu_timed`` (``GPU_CLOCK``, an :class:`EventClock`): GPU time from CUDA events. The first
  reading of a round records a start event on the suite's stream and returns at once; the second
  records an end event, waits for it, and advances the clock by the GPU time between the two
  events (divided by ``per``, the operations one round enqueues). So a round's duration is the
  GPU time of the work the target enqueued, never the host's launch or synchronisation time. The
  round's ``setup`` (untimed) flushes L2 and enqueues a spin kernel that keeps the GPU busy while
  the host enqueues (perf/timing.py); :attr:`EventClock.late` counts rounds where it did not.
- ``@reported`` (``REPORTED_CLOCK``, a :class:`ReportedClock`): the clock advances only by what
  the target reports with ``REPORTED_CLOCK.add(seconds)``: for work timed elsewhere, e.g. an
  import timed inside a fresh interpreter, without the interpreter's start-up.
- no marker: pytest-benchmark's default ``time.perf_counter`` (host-time and CPU rows).

This module imports neither CUDA nor kvcanary: the GPU clock is bound to the session's
``GpuTimer`` (which records and waits for the events) when that is created.
"""

from __future__ import annotations

import time
from typing import Protocol

import pytest


class EventBackend(Protocol):
    def start(self) -> None: ...      # record the start event on the timed stream
    def end(self) -> None: ...        # record the end event
    def elapsed(self) -> float: ...   # wait for the end event; GPU seconds between the two


class EventClock:
    """A GPU-time stopwatch read in pairs (see the module docstring)."""

    def __init__(self):
        self.__name__ = type(self).__name__  # what pytest-benchmark writes as the timer's name
        self.backend: EventBackend | None = None
        self.reading = 0.0
        self.per = 1
        self.gate_ns: float | None = None
        self.late = 0
        self._started: float | None = None

    def bind(self, backend: EventBackend) -> None:
        self.backend = backend

    def configure(self, *, per: int = 1, gate_ns: float | None = None) -> None:
        """Before a measurement: ``per`` operations per round; host enqueue times over ``gate_ns``
        count as late rounds (the GPU may have waited for the host)."""
        self.per, self.gate_ns, self.late = max(1, int(per)), gate_ns, 0
        self._started = None  # a round that raised between its two readings left it open

    def __call__(self) -> float:
        if self.backend is None:
            raise RuntimeError("perf: the GPU clock is not bound to a GpuTimer; a @gpu_timed test "
                               "must measure through the report fixture's gpu() (which takes the timer fixture)")
        if self._started is None:
            self.backend.start()
            self._started = time.perf_counter()
            return self.reading
        self.backend.end()
        host_ns = (time.perf_counter() - self._started) * 1e9
        self._started = None
        if self.gate_ns is not None and host_ns > self.gate_ns:
            self.late += 1
        self.reading += self.backend.elapsed() / self.per
        return self.reading


class ReportedClock:
    """A stopwatch that advances only by :meth:`add` (see the module docstring)."""

    def __init__(self):
        self.__name__ = type(self).__name__
        self.reading = 0.0

    def add(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"perf: a reported duration must be >= 0 s, got {seconds!r}")
        self.reading += float(seconds)

    def __call__(self) -> float:
        return self.reading


GPU_CLOCK = EventClock()
REPORTED_CLOCK = ReportedClock()
gpu_timed = pytest.mark.benchmark(timer=GPU_CLOCK)
reported = pytest.mark.benchmark(timer=REPORTED_CLOCK)
