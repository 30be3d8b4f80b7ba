"""What one rank contributes to a tensor-parallel exchange (:mod:`kvcanary.distributed`), and how
the group gathers it: a fixed-size int64 vector per rank (``HEADER`` cells, the ``STATS`` counters,
then up to ``rows_per_step`` violation rows of ``ROW`` cells each), all-gathered into
``[world_size, width]`` on a side stream (NCCL) or the process group's background work (gloo).
torch comes in through the caller (it is never imported here).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import abi
from ..errors import KvCanaryError
from ..reporting.violations import Violation

HEADER = ("exchange", "step", "reported_step", "flags", "rows", "pending", "dropped")
STATS = ("protected_tokens", "verified_slots", "violations", "violations_recorded", "ring_overflow",
         "skipped_verifies", "unattributed", "export_errors", "steps_behind", "snapshots_skipped")
ROW = ("launch_tag", "fail_reason_bits", "slot_idx", "position", "stored_token", "expected_token",
       "stored_chain_hash", "expected_aux", "step", "ring_overflow")
HEALTH_FAILED, VIOLATED, LOST = 1, 2, 4  # flag bits: own health check failed, saw violations, lost rows
COL = {name: i for i, name in enumerate(HEADER + STATS)}
_MASK64 = (1 << 64) - 1


def _int64(x) -> int:
    x = int(x, 16) if isinstance(x, str) else int(x)
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def _tag_value(name) -> int:
    if isinstance(name, (int, np.integer)):
        return int(name)
    if name in abi.LaunchTag.__members__:
        return int(abi.LaunchTag[name])
    try:
        return int(str(name).removeprefix("UNKNOWN_"))
    except ValueError:
        return -1


def pack_row(record: dict) -> list[int]:
    """A violation record (the dict ``add_listener`` callbacks get) as the int64 values of ROW."""
    return [_tag_value(record.get("launch_tag", -1))] + [_int64(record.get(k, 0)) for k in ROW[1:]]


@dataclass(frozen=True)
class RankViolation:
    """A violation row that the canary of ``source_rank`` reported in its step ``step``."""

    source_rank: int
    step: int
    ring_overflow: int
    violation: Violation

    @classmethod
    def from_row(cls, row, source_rank: int) -> "RankViolation":
        r = [int(x) for x in row]
        v = Violation(r[0], r[2], r[3], r[4], r[5], r[6] & _MASK64, r[7] & _MASK64,
                      abi.FailReason(r[1] & abi.FAIL_BITS_MASK))
        return cls(source_rank, r[8], r[9], v)

    def __str__(self) -> str:
        body = str(self.violation).removeprefix("kv_canary violation: ")
        return f"kv_canary violation: source_rank={self.source_rank} step={self.step} {body}"

    def to_dict(self, **extra) -> dict:
        """The source rank's record (same keys and values) plus ``source_rank`` and ``extra``."""
        return self.violation.to_dict(type="violation", step=self.step, ring_overflow=self.ring_overflow,
                                      source_rank=self.source_rank, **extra)


class Gather:
    """Double-buffered all-gather of a [width] int64 vector into [world, width]. Host backends
    (gloo): CPU tensors; :meth:`issue` starts the group's background work, :meth:`result` waits.
    NCCL (``device`` given): the vector goes from pinned memory to the device, is gathered and
    comes back to pinned memory, all on a side stream of that device (never the engine's stream);
    :meth:`result` waits on an event recorded behind the copy back."""

    def __init__(self, torch, dist, group, world: int, width: int, device: int | None = None):
        self.torch, self.group, self.world, self.width, self.device = torch, group, world, width, device
        self.gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        pin, i64 = device is not None, torch.int64
        self.send = [torch.zeros(width, dtype=i64, pin_memory=pin) for _ in range(2)]
        self.recv = [torch.zeros(world * width, dtype=i64, pin_memory=pin) for _ in range(2)]
        self.work = [None, None]
        if device is not None:
            dev = torch.device("cuda", device)
            self.stream = torch.cuda.Stream(dev)
            self.dev_send = [torch.zeros(width, dtype=i64, device=dev) for _ in range(2)]
            self.dev_recv = [torch.zeros(world * width, dtype=i64, device=dev) for _ in range(2)]
            self.events = [torch.cuda.Event() for _ in range(2)]
            torch.cuda.synchronize(dev)  # the zero fills ran on the current stream, not the side one

    def buffer(self, slot: int) -> np.ndarray:
        return self.send[slot].numpy()

    def issue(self, slot: int) -> None:
        if self.device is None:
            self.work[slot] = self.gather(self.recv[slot], self.send[slot], group=self.group, async_op=True)
            return
        with self.torch.cuda.stream(self.stream):
            self.dev_send[slot].copy_(self.send[slot], non_blocking=True)
            work = self.gather(self.dev_recv[slot], self.dev_send[slot], group=self.group, async_op=True)
            work.wait()  # the side stream waits for the collective; the host does not
            self.recv[slot].copy_(self.dev_recv[slot], non_blocking=True)
            self.events[slot].record(self.stream)

    def result(self, slot: int) -> np.ndarray:
        if self.device is not None:
            self.events[slot].synchronize()
        else:
            work, self.work[slot] = self.work[slot], None
            try:
                work.wait()
            except RuntimeError as exc:
                raise KvCanaryError(f"kv-canary: tensor-parallel exchange failed, expected every rank of the "
                                    f"group in exchange(), got {type(exc).__name__}: {exc}. Fix: look for a rank "
                                    f"that exited or hung; every rank must call exchange() once per step") from exc
        return self.recv[slot].numpy().reshape(self.world, self.width).copy()
