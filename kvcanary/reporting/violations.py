"""Decoding of the violation ring (docs/format.md §10): records, the grep-able log line, JSON lines."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from .. import abi
from ..errors import ValidationError, ValidationTypeError


def _u64(x: int) -> int:
    return int(x) & 0xFFFFFFFFFFFFFFFF


def reason_labels(bits: int) -> list[str]:
    """Bit names lower-cased without ``_mismatch``, in bit order; unknown bits as ``bit<N>``."""
    out = []
    for n in range(63):
        if bits >> n & 1:
            try:
                out.append(abi.FailReason(1 << n).name.lower().removesuffix("_mismatch"))
            except ValueError:
                out.append(f"bit{n}")
    return out


def tag_name(tag: int) -> str:
    try:
        return abi.LaunchTag(tag).name
    except ValueError:
        return f"UNKNOWN_{tag}"


@dataclass(frozen=True)
class Violation:
    """One ring row. ``str()`` is the one-line log format of docs/format.md §10."""

    tag: int
    slot: int
    position: int
    stored_token: int
    expected_token: int
    stored_chain_hash: int  # unsigned
    expected_aux: int       # unsigned
    reasons: abi.FailReason

    @classmethod
    def from_row(cls, row) -> "Violation":
        r = [int(x) for x in row]
        return cls(r[abi.COL_KERNEL_KIND], r[abi.COL_SLOT_IDX], r[abi.COL_POSITION],
                   r[abi.COL_STORED_TOKEN], r[abi.COL_EXPECTED_TOKEN], _u64(r[abi.COL_STORED_CHAIN_HASH]),
                   _u64(r[abi.COL_EXPECTED_AUX]), abi.FailReason(r[abi.COL_FAIL_REASON_BITS] & abi.FAIL_BITS_MASK))

    @property
    def tag_name(self) -> str:
        return tag_name(self.tag)

    @property
    def reason_text(self) -> str:
        return "+".join(reason_labels(int(self.reasons)))

    @property
    def batch_field(self) -> str | None:
        """The field code of a BATCH_INDEX_OUT_OF_RANGE row (its EXPECTED_TOKEN) by name
        (``UNKNOWN_<n>`` outside :class:`~kvcanary.abi.BatchField`); None for other rows."""
        if not self.reasons & abi.FailReason.BATCH_INDEX_OUT_OF_RANGE:
            return None
        try:
            return abi.BatchField(self.expected_token).name
        except ValueError:
            return f"UNKNOWN_{self.expected_token}"

    def __str__(self) -> str:
        field = self.batch_field
        return (f"kv_canary violation: launch_tag={self.tag_name} fail_reason={self.reason_text} "
                f"slot_idx={self.slot} position={self.position} stored_token={self.stored_token} "
                f"expected_token={self.expected_token} stored_chain_hash=0x{self.stored_chain_hash:016x} "
                f"expected_aux=0x{self.expected_aux:016x}" + ("" if field is None else f" batch_field={field}"))

    def to_dict(self, **extra) -> dict:
        out = {"launch_tag": self.tag_name, "fail_reason": reason_labels(int(self.reasons)),
               "fail_reason_bits": int(self.reasons), "slot_idx": self.slot, "position": self.position,
               "stored_token": self.stored_token, "expected_token": self.expected_token,
               "stored_chain_hash": f"0x{self.stored_chain_hash:016x}",
               "expected_aux": f"0x{self.expected_aux:016x}"}
        field = self.batch_field
        if field is not None:
            out["batch_field"] = field
        return {**out, **extra}

    def to_json(self, **extra) -> str:
        return json.dumps(self.to_dict(**extra), sort_keys=True)


@dataclass(frozen=True)
class RingReadout:
    """Rows ``[start, min(write_index, capacity))`` of a ring and how many did not fit."""

    violations: list[Violation]
    write_index: int
    capacity: int

    @property
    def overflow(self) -> int:
        return max(0, self.write_index - self.capacity)


def decode_ring(ring: np.ndarray, write_index: int, start: int = 0) -> RingReadout:
    """Records of a host copy of the ring from row ``start`` (rows already reported are skipped)."""
    try:
        ring = np.asarray(ring)
        ok = ring.dtype == np.int64 and ring.size % abi.RING_COLS == 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValidationError(f"kv-canary: decode_ring needs the ring as int64 rows of {abi.RING_COLS} columns "
                              f"(a host copy of ViolationSink.ring), got {type(ring).__name__} "
                              f"{getattr(ring, 'dtype', '')}{getattr(ring, 'shape', '')}. Fix: pass "
                              f"np.asarray(ring) of the sink's [capacity, {abi.RING_COLS}] int64 ring")
    for name, v in (("write_index", write_index), ("start", start)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValidationTypeError(f"kv-canary: decode_ring({name}=) must be an int, got "
                                      f"{type(v).__name__}. Fix: pass the sink's write index as an int")
    ring = ring.reshape(-1, abi.RING_COLS)
    stop = min(max(int(write_index), 0), ring.shape[0])
    rows = [Violation.from_row(ring[i]) for i in range(min(start, stop), stop)]
    return RingReadout(rows, int(write_index), ring.shape[0])
