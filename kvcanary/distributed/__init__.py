"""Tensor-parallel aggregation of canary reports over ``torch.distributed``.

Each rank of a tensor- (or pipeline-) parallel engine runs its own :class:`~kvcanary.KvCanary`
over its shard of the KV cache. A :class:`TensorParallelAggregator` attached to it subscribes to
the canary's records (``add_listener``) and, at :meth:`~TensorParallelAggregator.exchange` (once
per engine step on every rank), all-gathers one fixed-size int64 vector per rank on the process
group the engine already has (NCCL on GPUs, gloo on CPUs): the rank's canary step, health flags,
counters (``stats()`` keys) and up to ``rows_per_step`` new violation rows. So that

- a violation seen on any rank is logged (mode ``"log"``: logger ``kvcanary.distributed``, the line
  names the source rank) or raised (mode ``"raise"``: :class:`CanaryViolationError`) on every rank,
  at the same exchange;
- a rank whose canary stops running (its step falls more than ``stale_steps`` behind the leading
  rank's, or its own ``health_check`` fails) fails every rank's :meth:`health_check`.

Off the critical path: the vector is built from host-side records (no device access, no sync);
with ``lag=1`` (default) the gather issued at exchange k is consumed at exchange k+1, like the
canary's pump (NCCL: on a side stream of the rank's device, read back through pinned memory;
gloo: the process group's background work). Rows beyond ``rows_per_step`` wait for the next
exchanges; counters are exact at once. torch is imported on first use, never by ``import kvcanary``.
The vector's layout and the double-buffered gather are :mod:`kvcanary.distributed.wire`.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import numpy as np

from ..errors import (CanaryViolationError, KvCanaryError, ValidationError, ValidationTypeError)
from ..validate import callable_or_none, choice, integer, is_int, optional_integer
from .wire import (COL, HEADER, HEALTH_FAILED, LOST, ROW, STATS, VIOLATED, Gather, RankViolation, pack_row)

log = logging.getLogger("kvcanary.distributed")


def _torch():
    try:  # on first use: torch stays optional (import kvcanary.distributed never imports it)
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise ValidationError(f"kv-canary: TensorParallelAggregator needs torch with torch.distributed, "
                              f"got {type(exc).__name__}: {exc}. Fix: pip install torch") from None
    return torch, dist


class TensorParallelAggregator:
    """Combines the reports of one KvCanary per rank over a torch.distributed group (see the
    module docstring). Build it on every rank after ``init_process_group`` and call
    :meth:`exchange` once per engine step on every rank (after ``after_forward``, outside graph
    capture), whether or not the canary ran that step; it is a collective of ``group``.

    ``mode``: "log" or "raise" for the whole group (the canary itself must be in mode "log": a
    rank that raised alone would leave the others waiting in the collective). ``lag``: 1 (consume
    each gather one exchange later) or 0 (wait for it). ``export``: a callable that gets every
    aggregated violation record (the source rank's record plus ``source_rank``, ``reported_at``).
    Every rank must pass the same ``rows_per_step`` (it sets the size of the gathered vector).
    """

    def __init__(self, canary, group=None, *, rank: int | None = None, world_size: int | None = None,
                 mode: str = "log", lag: int = 1, rows_per_step: int = 4, stale_steps: int = 2,
                 export=None, max_backlog: int = 4096):
        if not callable(getattr(canary, "add_listener", None)):
            raise ValidationTypeError(f"kv-canary: TensorParallelAggregator needs this rank's KvCanary, got "
                                      f"{type(canary).__name__}. Fix: TensorParallelAggregator(canary, group=...)")
        if not isinstance(mode, str) or mode.lower() not in ("log", "raise"):
            kind = ValidationError if isinstance(mode, str) else ValidationTypeError
            raise kind(f"kv-canary: TensorParallelAggregator mode must be 'log' or 'raise', got "
                       f"{mode!r}. Fix: mode='log' (warn on every rank) or mode='raise'")
        mode = choice("mode", mode, ("log", "raise"))
        if not is_int(lag) or lag not in (0, 1):
            raise (ValidationError if is_int(lag) else ValidationTypeError)(
                f"kv-canary: TensorParallelAggregator lag must be 0 or 1, got lag={lag!r}. Fix: lag=1 (consume each "
                f"gather one exchange later) or lag=0 (wait for it)")
        for name, value in (("rows_per_step", rows_per_step), ("stale_steps", stale_steps), ("max_backlog", max_backlog)):
            integer(name, value, lo=1, fix=f"pass a count >= 1 (the default is fine: leave {name} out)")
        optional_integer("rank", rank, lo=0, fix="leave rank out (the process group's is used)")
        optional_integer("world_size", world_size, lo=1, fix="leave world_size out (the process group's is used)")
        callable_or_none("export", export, "pass a function taking one dict, or leave export out")
        if getattr(canary, "mode", "log") == "raise":
            raise ValidationError("kv-canary: TensorParallelAggregator expected its canary in mode 'log', got "
                                  "mode 'raise' (a rank raising alone would leave the other ranks waiting in "
                                  "the collective). Fix: KvCanary(..., mode='log') and "
                                  "TensorParallelAggregator(canary, mode='raise')")
        torch, dist = _torch()
        if not (dist.is_available() and dist.is_initialized()):
            raise ValidationError("kv-canary: TensorParallelAggregator expected an initialised torch.distributed "
                                  "process group, got none. Fix: torch.distributed.init_process_group(...) first "
                                  "(torchrun sets RANK, WORLD_SIZE and MASTER_ADDR for it)")
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        for name, given, actual in (("rank", rank, self.rank), ("world_size", world_size, self.world_size)):
            if given is not None and given != actual:
                raise ValidationError(f"kv-canary: TensorParallelAggregator {name} expected {actual} (the "
                                      f"process group's), got {given}. Fix: leave {name} out or pass the group's")
        self.canary, self.group, self.mode, self.lag = canary, group, mode, lag
        self.rows_per_step, self.stale_steps, self.max_backlog = rows_per_step, stale_steps, max_backlog
        self.export = export
        self.width = len(HEADER) + len(STATS) + rows_per_step * len(ROW)
        self.backend = str(dist.get_backend(group)).lower()
        device = None
        if self.backend == "nccl":  # CUDA tensors on the rank's device ("cpu:gloo,cuda:nccl" stays on the host)
            device = canary.device if getattr(canary, "device", None) is not None else torch.cuda.current_device()
        self._gather = Gather(torch, dist, group, self.world_size, self.width, device)
        self.exchanges = 0      # exchange() calls so far (the same on every rank)
        self.reported = 0       # rows reported here (logged or raised), from every rank
        self.matrix = None      # the newest consumed gather: int64 [world_size, width]
        self._inflight = None
        self._lock = threading.Lock()
        self._backlog: deque[list[int]] = deque()
        self._stats: dict = {}
        self._dropped, self._violated, self._local_error = 0, False, None
        canary.add_listener(self._on_record)

    # ---- this rank ---------------------------------------------------------------------------
    def _on_record(self, record: dict) -> None:
        """The canary's listener: queue violation rows, keep the newest stats."""
        with self._lock:
            if record.get("type") == "violation":
                self._violated = True
                if len(self._backlog) < self.max_backlog:
                    self._backlog.append(pack_row(record))
                else:
                    self._dropped += 1
            elif record.get("type") == "stats":
                self._stats = record

    def _pack(self, buf: np.ndarray, index: int) -> None:
        with self._lock:
            rows = [self._backlog.popleft() for _ in range(min(self.rows_per_step, len(self._backlog)))]
            pending, dropped, stats, violated = len(self._backlog), self._dropped, self._stats, self._violated
        flags = (VIOLATED if violated else 0) | (LOST if dropped or stats.get("ring_overflow", 0) else 0)
        try:
            self.canary.health_check()
            self._local_error = None
        except KvCanaryError as exc:
            if self._local_error is None:
                log.warning("kv_canary health: rank %d: %s", self.rank, exc)
            flags, self._local_error = flags | HEALTH_FAILED, str(exc)
        buf[:] = 0
        buf[:len(HEADER)] = [index, int(getattr(self.canary, "step", stats.get("step", 0))),
                             int(stats.get("step", -1)), flags, len(rows), pending, dropped]
        buf[len(HEADER):len(HEADER) + len(STATS)] = [int(stats.get(k, 0)) for k in STATS]
        if rows:
            start = len(HEADER) + len(STATS)
            buf[start:start + len(rows) * len(ROW)] = np.array(rows, np.int64).ravel()

    # ---- the collective ------------------------------------------------------------------------
    def exchange(self) -> None:
        """Gather every rank's vector; report the gather of this exchange (``lag=0``) or of the
        previous one (``lag=1``). May raise CanaryViolationError (mode "raise"), on every rank."""
        index, slot = self.exchanges, self.exchanges % 2
        self._pack(self._gather.buffer(slot), index)
        previous, self._inflight = self._inflight, slot
        self._gather.issue(slot)
        ready = None
        if self.lag == 0:
            ready, self._inflight = (self._gather.result(slot), index), None
        elif previous is not None:
            ready = (self._gather.result(previous), index - 1)
        self.exchanges += 1
        if ready is not None:
            self._consume(*ready, reported_at=index)

    def flush(self) -> None:
        """Flush the canary (it synchronises), then exchange until every rank's rows are reported.
        A collective: call it on every rank (shutdown, tests)."""
        self.canary.flush()
        if self._inflight is not None:
            slot, self._inflight = self._inflight, None
            self._consume(self._gather.result(slot), self.exchanges - 1, reported_at=self.exchanges)
        lag, self.lag = self.lag, 0
        try:
            for _ in range(self.max_backlog // self.rows_per_step + 2):
                self.exchange()
                if not self.matrix[:, COL["pending"]].any():
                    break
        finally:
            self.lag = lag

    def _consume(self, matrix: np.ndarray, at: int, reported_at: int) -> None:
        """Report the gather of exchange ``at`` at exchange ``reported_at`` (a flush counts as the
        next exchange)."""
        if (matrix[:, COL["exchange"]] != at).any():
            raise KvCanaryError(f"kv-canary: tensor-parallel exchange out of step, expected every rank at "
                                f"exchange {at}, got {matrix[:, COL['exchange']].tolist()}. Fix: call "
                                f"exchange() exactly once per engine step on every rank of the group")
        self.matrix = matrix
        start = len(HEADER) + len(STATS)
        found = [RankViolation.from_row(matrix[r, start + j * len(ROW):start + (j + 1) * len(ROW)], r)
                 for r in range(self.world_size) for j in range(min(int(matrix[r, COL["rows"]]), self.rows_per_step))]
        if not found:
            return
        self.reported += len(found)
        if self.export is not None:
            for rv in found:
                self.export(rv.to_dict(reported_at=reported_at))
        if self.mode == "raise":
            raise CanaryViolationError(found)
        for rv in found:
            log.warning("%s", rv)

    # ---- the group's view ------------------------------------------------------------------------
    def unhealthy_ranks(self) -> dict[int, str]:
        """Rank -> why, as of the newest consumed gather: the same ranks on every rank (a rank whose
        own health check failed adds its error text there)."""
        if self.matrix is None:
            return {}
        steps, flags = self.matrix[:, COL["step"]], self.matrix[:, COL["flags"]]
        lead = int(steps.argmax())
        out = {}
        for r in range(self.world_size):
            why = []
            behind = int(steps[lead] - steps[r])
            if behind > self.stale_steps:
                why.append(f"its canary stopped stepping (step {int(steps[r])}, {behind} behind rank {lead})")
            if flags[r] & HEALTH_FAILED:
                why.append("its own health check failed" + (f" ({self._local_error})" if r == self.rank
                                                           and self._local_error else " (see that rank's log)"))
            if why:
                out[r] = "; ".join(why)
        return out

    def health_check(self) -> None:
        """Raise KvCanaryError, on every rank alike, if some rank's canary stopped stepping or
        failed its own health check (as of the newest consumed gather)."""
        bad = self.unhealthy_ranks()
        if bad:
            got = "; ".join(f"rank {r}: {why}" for r, why in sorted(bad.items()))
            raise KvCanaryError(f"kv-canary: tensor-parallel health check failed, expected every rank's canary "
                                f"to keep stepping and pass its own health check, got: {got}. Fix: on that rank, "
                                f"run before_forward/after_forward every step and keep the canary launches on "
                                f"the stream (or in the CUDA graph) that is replayed")

    def stats(self) -> dict:
        """The group's counters as of the newest consumed gather: summed over ranks, and per rank."""
        names = ("step", "reported_step", "flags", "pending", "dropped") + STATS
        ranks = [] if self.matrix is None else [
            {"rank": r, **{k: int(self.matrix[r, COL[k]]) for k in names}} for r in range(self.world_size)]
        return {"world_size": self.world_size, "exchanges": self.exchanges, "reported": self.reported,
                **{k: sum(r[k] for r in ranks) for k in STATS}, "ranks": ranks}
