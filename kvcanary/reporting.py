"""What happens to decoded violations and step stats: log, raise, export (SPEC §10)."""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Callable

from .errors import CanaryViolationError, ValidationError
from .violations import Violation

log = logging.getLogger("kvcanary")
MODES = ("none", "log", "raise")


class Exporter:
    """JSON lines to a file (appended, one object per line) or to a callback taking a dict."""

    def __init__(self, target: str | os.PathLike | Callable[[dict], None] | None):
        self._lock = threading.Lock()
        self._file = None
        self._callback = None
        if callable(target):
            self._callback = target
        elif target is not None:
            self._file = open(target, "a", buffering=1)

    def __call__(self, record: dict) -> None:
        if self._callback is not None:
            self._callback(record)
        if self._file is not None:
            with self._lock:
                self._file.write(json.dumps(record, sort_keys=True) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class Reporter:
    """Turns new ring rows into a log line each (``log``) or one exception (``raise``)."""

    def __init__(self, mode: str, export=None):
        if mode not in MODES:
            raise ValidationError(f"kv-canary: mode must be one of {MODES}, got {mode!r}")
        self.mode, self.export = mode, Exporter(export)
        self.listeners: list[Callable[[dict], None]] = []
        self.reported = 0

    @property
    def wants_stats(self) -> bool:
        """Whether per-step stats records have a consumer (an export target or a listener)."""
        return bool(self.listeners) or self.export._file is not None or self.export._callback is not None

    def _emit(self, record: dict) -> None:
        self.export(record)
        for listener in self.listeners:
            listener(record)

    def violations(self, rows: list[Violation], step: int, overflow: int) -> None:
        if not rows and not overflow:
            return
        for v in rows:
            self._emit(v.to_dict(type="violation", step=step, ring_overflow=overflow))
        self.reported += len(rows)
        if self.mode == "raise":
            raise CanaryViolationError(rows, overflow)
        for v in rows:
            log.warning("%s", v)
        if overflow:
            log.warning("kv_canary ring full: %d violation(s) not recorded (ring overflow)", overflow)

    def stats(self, record: dict, emit_line: bool) -> None:
        self._emit({"type": "stats", **record})
        if emit_line:
            log.info("kv_canary stats: " + " ".join(f"{k}={v}" for k, v in record.items()))
