"""The host half of the self-test (docs/format.md §11): which rows are self-tests, how many the
device owes by a snapshot, and what the health check says when they did not come."""

from __future__ import annotations

from .. import abi

WANT = abi.FailReason.SELF_TEST | abi.FailReason.VERIFY_POSITION_MISMATCH  # a working check's bits
KEPT_FAULTS = 4  # wrong self-test rows quoted by the health check


class SelfTest:
    """Self-test rows of the verify context ``index`` (tag ``tag``) of a pool of ``num_slots``
    slots, one every ``every`` runs of it (0: off)."""

    def __init__(self, every: int, index: int, tag: abi.LaunchTag, num_slots: int):
        self.every, self.index, self.tag, self.num_slots = every, index, tag, num_slots
        self.seen, self.faults = 0, []

    def sift(self, found: list) -> list:
        """``found`` without its self-test rows, which are counted (or kept as faults when they
        are not the known-bad record's row)."""
        if not self.every:
            return found
        out = []
        for v in found:
            if not v.reasons & abi.FailReason.SELF_TEST:
                out.append(v)
            elif (v.tag, v.slot, v.position, v.stored_token, v.reasons) == (
                    self.tag, self.num_slots, abi.SELF_TEST_POSITION, abi.SELF_TEST_TOKEN, WANT):
                self.seen += 1
            elif len(self.faults) < KEPT_FAULTS:
                self.faults.append(str(v))
        return out

    def due(self, runs) -> int:
        """Rows the device owes by a snapshot whose (kernel runs, slot runs) per context are ``runs``."""
        return int(runs[self.index, 0]) // self.every if self.every else 0

    def problems(self, runs, lost: int) -> list[str]:
        """The health check's complaints (none when every due row arrived and matched)."""
        due = self.due(runs)
        if self.seen >= due and not self.faults:
            return []
        why = f" (the ring overflowed: {lost} rows lost; raise ring_capacity)" if lost else ""
        wrong = f"; rows that did not match the known-bad record: {self.faults}" if self.faults else ""
        return [f"self-test: {self.seen} of {due} expected self-test rows arrived{why}{wrong}"]
