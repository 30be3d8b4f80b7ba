"""Canary records that travel with their KV: offload to a host tier and back, prefill -> decode
transfer in disaggregated serving, migration and defragmentation (docs/format.md §2).

The chain describes content, not slots, so a record stays valid at any slot: export the records
of the slots whose KV moves, move both, import them at the new slots, and the importing side's
first read verifies chain, positions and real KV as usual. A transfer that was torn, dropped,
reordered, duplicated or restored to the wrong slots is then caught with no extra kernel.

:class:`CanaryRecords` holds every buffer of a pool group (HEAD and TAIL x K and V) for ``n``
slots, int64 ``[buffers, n, 4]``, and a descriptor of what the fingerprints cover (format
version, hash mode, the bytes each source fingerprints per half); ``to_bytes``/``from_bytes``
carry it across processes with a version and a checksum of its own. Device records move with
``kvc_copy_records`` on the caller's stream (capturable, no host sync); host records with numpy.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import numpy as np

from .. import abi
from ..errors import ValidationError

MAGIC = b"KVCREC\x00\x01"   # record files, version 1
_DIGEST = 8                  # bytes of the blake2b checksum that ends a record file


@dataclass
class CanaryRecords:
    """Records of ``n`` slots: ``records`` int64 ``[len(buffers), n, FIELDS_PER_SLOT]`` (numpy, or a
    kvcanary DeviceArray), ``descriptor`` what they were written with (see :func:`descriptor`)."""

    records: object
    descriptor: dict

    @property
    def n(self) -> int:
        return int(self.records.shape[1])

    def to_host(self) -> "CanaryRecords":
        r = self.records
        return self if isinstance(r, np.ndarray) else CanaryRecords(r.numpy(), dict(self.descriptor))

    def take(self, index) -> "CanaryRecords":
        """The records of some of the slots (an index array, a slice or a boolean mask), host."""
        host = self.to_host().records
        if isinstance(index, (int, np.integer)):
            index = [index]
        picked = np.ascontiguousarray(host[:, index])
        return CanaryRecords(picked, dict(self.descriptor, n=picked.shape[1]))

    def to_bytes(self) -> bytes:
        """``MAGIC``, the descriptor as JSON (length-prefixed), the records (little-endian int64),
        then an 8-byte blake2b checksum of all that."""
        desc = json.dumps(self.descriptor, sort_keys=True).encode()
        body = MAGIC + struct.pack("<I", len(desc)) + desc + np.ascontiguousarray(self.to_host().records, "<i8").tobytes()
        return body + hashlib.blake2b(body, digest_size=_DIGEST).digest()

    @classmethod
    def from_bytes(cls, data: bytes) -> "CanaryRecords":
        data = bytes(data)
        if len(data) < len(MAGIC) + 4 + _DIGEST or data[:len(MAGIC)] != MAGIC:
            raise ValidationError(f"kv-canary: canary records must start with {MAGIC!r} (version 1), got "
                                  f"{data[:len(MAGIC)]!r} in {len(data)} bytes. Fix: pass what "
                                  f"CanaryRecords.to_bytes() wrote, unchanged")
        body, digest = data[:-_DIGEST], data[-_DIGEST:]
        if hashlib.blake2b(body, digest_size=_DIGEST).digest() != digest:
            raise ValidationError("kv-canary: canary records must match their checksum, got bytes that do not "
                                  "(torn, truncated or altered in transit). Fix: transfer them again")
        (k,) = struct.unpack_from("<I", body, len(MAGIC))
        desc = json.loads(body[len(MAGIC) + 4:len(MAGIC) + 4 + k])
        flat = np.frombuffer(body[len(MAGIC) + 4 + k:], "<i8").astype(np.int64)
        shape = (len(desc["buffers"]), int(desc["n"]), abi.FIELDS_PER_SLOT)
        if flat.size != shape[0] * shape[1] * shape[2]:
            raise ValidationError(f"kv-canary: canary records must hold {shape} int64, got {flat.size}. Fix: "
                                  f"pass what CanaryRecords.to_bytes() wrote")
        return cls(flat.reshape(shape), desc)


def descriptor(canary, group: str, n: int) -> dict:
    """What a group's records mean: format version, hash mode, the buffers in order and the bytes
    each TAIL source fingerprints per slot, per half."""
    grp = canary.groups[group]
    halves = grp.resolved_halves()
    sources = {h: list(canary.ctx["TAIL", group, h, "verify"].hash_bytes) for h in halves}
    return {"format": abi.FORMAT_VERSION, "group": group, "hash_mode": canary.hash_mode.name,
            "buffers": [f"{st}_{h}" for h in halves for st in ("HEAD", "TAIL")], "sources": sources, "n": n}


def check_compatible(mine: dict, theirs: dict) -> None:
    """The records can be imported here: the same format, buffers, hash mode and fingerprinted
    bytes (else the first read would report every record as a violation)."""
    for key, what in (("format", "format version"), ("buffers", "buffers (pool halves)"),
                      ("hash_mode", "hash mode"), ("sources", "fingerprinted bytes per source")):
        if mine.get(key) != theirs.get(key):
            raise ValidationError(f"kv-canary: imported canary records must have this canary's {what} "
                                  f"({mine.get(key)!r}), got {theirs.get(key)!r}. Fix: import into a canary "
                                  f"built like the exporting one (same halves, hash_mode and real-KV sources "
                                  f"per layer), or re-stamp the moved tokens instead")


def buffers(canary, group: str) -> list:
    """The group's canary buffers in descriptor order (K: HEAD, TAIL; then V)."""
    grp = canary.groups[group]
    return [canary.ctx[st, group, h, "write"].buffer for h in grp.resolved_halves() for st in ("HEAD", "TAIL")]


def move(canary, slots, records: CanaryRecords | None, group: str, stream) -> CanaryRecords | None:
    """``KvCanary.export_records`` (``records`` None: the records of ``slots``, returned) or
    ``import_records`` (``records`` placed at ``slots``) of ``canary``'s group ``group``, on the
    canary's backend (a device launch on ``stream``, no host sync)."""
    bufs = buffers(canary, group)
    num_slots = bufs[0].num_slots
    exporting = records is None
    backend = canary.backend
    where, n = backend.record_slots(slots, num_slots, "export_records" if exporting else "import_records")
    mine = descriptor(canary, group, n)
    if exporting:
        out = backend.zeros((len(bufs), n, abi.FIELDS_PER_SLOT), np.int64)
    else:
        check_compatible(mine, records.descriptor)
        if records.n != n:
            raise ValidationError(f"kv-canary: import_records needs one record per slot ({n}), got {records.n}. "
                                  f"Fix: pass the slots the records were exported for, in order")
        out = backend.records_array(records.records)
    first = canary.ctx["HEAD", group, canary.groups[group].resolved_halves()[0], "verify"]  # reports bad slots
    backend.copy_records(bufs, where, out, not exporting, first, backend.stream(stream, None))
    return CanaryRecords(out, mine) if exporting else None


def host_slots(slots, num_slots: int, what: str) -> np.ndarray:
    if isinstance(slots, (int, np.integer)) or getattr(slots, "ndim", 1) == 0:
        v = np.asarray(slots).item()
        raise ValidationError(f"kv-canary: {what} slots must be a 1-D sequence of ints, got the scalar "
                              f"{v!r} ({type(slots).__name__}). Fix: pass a list or an int64 array, "
                              f"e.g. [{v!r}] for one slot")
    try:
        s = np.ascontiguousarray(slots, np.int64).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"kv-canary: {what} slots must be a 1-D sequence of ints, got "
                              f"{type(slots).__name__} ({exc}). Fix: pass a list or an int64 array") from None
    bad = np.flatnonzero((s < 0) | (s >= num_slots))
    if len(bad):
        raise ValidationError(f"kv-canary: {what} slots must lie in [0, {num_slots}), got {int(s[bad[0]])} at "
                              f"index {int(bad[0])}. Fix: pass slots of this canary's pool")
    return s
