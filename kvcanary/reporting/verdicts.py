"""Per-request verdicts on the host (docs/format.md §5.7): which requests of a step's batch read or
wrote KV that failed a check, with their fail bits and the slots their violation rows name.

The kernels OR every row they can attribute to a request of the batch into that request's verdict
word (reset by the step's first plan build); the pump's snapshot carries the words (only when the
step failed a request), and the rows' requests come back with the rows. A :class:`FailedRequest`
is what an engine adapter needs to fail that one request and keep its blocks out of reuse.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import abi
from .violations import reason_labels


@dataclass(frozen=True)
class FailedRequest:
    """Request ``batch_index`` of the batch of step ``step`` failed the checks ``reasons``.

    ``slots``: the slots its violation rows name, sorted (stored rows only: with a full ring some
    may be missing, and a BATCH_INDEX_OUT_OF_RANGE row names no slot). The engine's request id is
    the one at ``batch_index`` in the batch it handed to that step (an adapter maps it)."""

    step: int
    batch_index: int
    reasons: abi.FailReason
    slots: tuple[int, ...] = ()

    @property
    def reason_text(self) -> str:
        return "+".join(reason_labels(int(self.reasons)))

    def to_dict(self) -> dict:
        return {"type": "failed_request", "step": self.step, "batch_index": self.batch_index,
                "reasons": self.reason_text, "fail_reason_bits": int(self.reasons), "slots": list(self.slots)}

    def __str__(self) -> str:
        return (f"kv_canary failed request: step={self.step} batch_index={self.batch_index} "
                f"fail_reason={self.reason_text} slots={list(self.slots)}")


def failed_requests(step: int, words, rows: np.ndarray, requests: np.ndarray) -> list[FailedRequest]:
    """The failed requests of one step: a nonzero verdict word each, in batch order, with the slots
    of the step's ``rows`` whose ``requests`` name it."""
    out = []
    for r, word in enumerate(words):
        if not word:
            continue
        mine = rows[np.asarray(requests) == r, abi.COL_SLOT_IDX] if len(rows) else np.zeros(0, np.int64)
        slots = tuple(int(s) for s in np.unique(mine[mine >= 0]))
        out.append(FailedRequest(step, r, abi.FailReason(int(word) & abi.FAIL_BITS_MASK), slots))
    return out
