"""What happens to decoded violations and step stats: log, raise, export (docs/format.md §10), and the
host's exact account of the violation ring.

Nothing here can stop serving: an export target that fails (full disk, a raising callback or
listener) is logged once, counted in ``export_errors``, and the step carries on. ``raise`` mode
raises once for each new set of violations, never again for ones already raised.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Callable

from ..errors import CanaryViolationError, ValidationError
from ..validate import choice, path_like
from .violations import Violation

log = logging.getLogger("kvcanary")
MODES = ("none", "log", "raise", "fail_request")


class Exporter:
    """JSON lines to a file (appended, one object per line) or to a callback taking a dict."""

    def __init__(self, target: str | os.PathLike | Callable[[dict], None] | None):
        self._lock = threading.Lock()
        self._file = self._callback = None
        self.errors = 0
        if callable(target):
            self._callback = target
        elif target is not None:
            path = path_like("export", target)
            try:
                self._file = open(path, "a", buffering=1)
            except OSError as exc:
                raise ValidationError(f"kv-canary: export must be a file kvcanary can append to, got "
                                      f"{path!r} ({type(exc).__name__}: {exc.strerror or exc}). Fix: pass a "
                                      f"writable path (its folder must exist), or a callable") from None

    @property
    def active(self) -> bool:
        return self._file is not None or self._callback is not None

    def __call__(self, record: dict) -> None:
        if self._callback is not None:
            self._guard("export callback", self._callback, record)
        if self._file is not None:
            self._guard("export file", self._write, record)

    def _write(self, record: dict) -> None:
        with self._lock:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")

    def _guard(self, what: str, fn, record: dict) -> None:
        try:
            fn(record)
        except Exception as exc:  # noqa: BLE001 - export must never stop serving
            self.errors += 1
            if self.errors == 1:
                log.error("kv-canary: %s failed (%s: %s); records it should get are dropped and counted "
                          "in stats()['export_errors'] (logged once). Fix: free space or repair the target",
                          what, type(exc).__name__, exc)

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                self.errors += 1
            self._file = None


class Reporter:
    """Turns new ring rows into a log line each (``log``) or one exception (``raise``), and
    passes every record to the export target and the listeners."""

    def __init__(self, mode: str, export=None):
        self.mode = choice("mode", mode, MODES)
        self.export = Exporter(export)
        self.listeners: list[Callable[[dict], None]] = []
        self.event_listeners: list[Callable[[dict], None]] = []  # every record but the per-step stats

    @property
    def wants_stats(self) -> bool:
        """Whether per-step stats records have a consumer (an export target or a listener)."""
        return bool(self.listeners) or self.export.active

    def _emit(self, record: dict) -> None:
        self.export(record)
        for listener in self.listeners:
            self.export._guard("listener", listener, record)
        if self.event_listeners and record.get("type") != "stats":
            for listener in self.event_listeners:
                self.export._guard("listener", listener, record)

    def violations(self, rows: list[Violation], step: int, lost: int, overflow_total: int) -> None:
        """New rows and ``lost`` new violations the ring could not hold (``overflow_total`` so far)."""
        if not rows and not lost:
            return
        for v in rows:
            self._emit(v.to_dict(type="violation", step=step, ring_overflow=overflow_total))
        if self.mode == "raise":
            raise CanaryViolationError(rows, lost)  # "fail_request" reports as "log" does
        for v in rows:
            log.warning("%s", v)
        if lost:
            log.warning("kv_canary ring full: %d violation(s) not recorded at step %d (%d so far); fix: "
                        "raise ring_capacity or poll more often", lost, step, overflow_total)

    def failed_requests(self, failed: list) -> None:
        """A step's failed requests (:class:`~kvcanary.reporting.verdicts.FailedRequest`): a record and a log line each."""
        for f in failed:
            self._emit(f.to_dict())
            log.warning("%s", f)

    def stats(self, record: dict, emit_line: bool) -> None:
        self._emit({"type": "stats", **record})
        if emit_line:
            log.info("kv_canary stats: " + " ".join(f"{k}={v}" for k, v in record.items()))


class RingLedger:
    """The host's account of a ring used as a window (``kvc_record``): violation i is stored at
    ``i % capacity`` iff ``i - floor < capacity``, where ``floor`` is the consumed mark the
    launches that claimed it saw. ``take`` turns a snapshot's claim total into the rows to read
    and the violations lost; the consumed mark then moves to that total."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.total = 0       # violations claimed, as of the newest snapshot processed
        self.recorded = 0    # of them read back with their row
        self.lost = 0        # of them that did not fit
        self.consumed = 0    # the mark last written where the kernels read it
        self.floor = 0       # the smallest mark launches since the newest enqueued snapshot saw

    def window(self, total: int, floor: int) -> tuple[int, int, int]:
        """(start, stop, lost) for a snapshot whose claim counter reads ``total``: rows of claim
        indices [start, stop) are complete in the ring; ``lost`` more were claimed but not kept."""
        start = self.total
        if total <= start:
            return start, start, 0
        stop = max(start, min(total, floor + self.capacity))
        lost = total - stop
        self.total, self.recorded, self.lost = total, self.recorded + stop - start, self.lost + lost
        return start, stop, lost
