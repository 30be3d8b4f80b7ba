"""Canary state: the canary buffer, the violation sink and the verify context (docs/format.md §2, §5).

State lives either in host memory (numpy; the CPU reference backend runs on it) or on one CUDA
device (kernels run on it). ``allocate`` makes zeroed state through the library (no torch needed);
the constructors wrap arrays the caller already has (torch, CuPy, JAX, numpy, raw pointers).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .. import abi
from ..errors import ValidationError
from ..runtime import memory
from ..validate import INT32_MAX, boolean, instance, integer, launch_tag
from ..validate import hash_mode as parse_hash_mode
from .checks import alloc_zeros, checked, same_device
from .sources import (MarshalledSource, RealKvSource, marshal_sources, source_list)

RING_CAPACITY_LIMIT = 1 << 24  # rows (1 GiB of ring): more would only hide a reporting backlog
SLOTS_LIMIT = 1 << 40          # canary slots (32 TiB of records)


class CanaryBuffer:
    """``[num_slots, slot_stride_bytes]`` uint8, zero-initialised, one record per KV slot."""

    def __init__(self, array):
        v = checked(array, "canary buffer", dtype=np.uint8, ndim=2, writable=True)
        stride = v.shape[1]
        if stride < abi.SLOT_BYTES or stride % 8:
            raise ValidationError(f"kv-canary: canary buffer slot stride must be >= {abi.SLOT_BYTES} "
                                  f"bytes and a multiple of 8, got {stride}. Fix: allocate it as uint8 "
                                  f"[num_slots, {abi.SLOT_BYTES}] (CanaryBuffer.allocate(num_slots))")
        if v.shape[0] < 1:
            raise ValidationError("kv-canary: canary buffer must have at least 1 slot, got 0 rows. Fix: one row "
                                  "per KV slot of the pool (CanaryBuffer.allocate(num_slots))")
        if v.ptr % 8:
            raise ValidationError(f"kv-canary: canary buffer must be 8-byte aligned, got 0x{v.ptr:x}. Fix: pass "
                                  f"the allocation itself (CanaryBuffer.allocate does)")
        self.array, self.view = array, v
        self.num_slots, self.slot_stride = v.shape[0], stride
        self.device = v.device

    @classmethod
    def allocate(cls, num_slots: int, *, device: int | None = None, slot_stride_bytes: int = abi.SLOT_BYTES):
        integer("num_slots", num_slots, lo=1, hi=SLOTS_LIMIT, fix="pass the pool's slot count")
        integer("slot_stride_bytes", slot_stride_bytes, lo=abi.SLOT_BYTES, hi=1 << 16,
                fix=f"leave it at {abi.SLOT_BYTES} (or a larger multiple of 8)")
        return cls(alloc_zeros((num_slots, slot_stride_bytes), np.uint8, device))

    def host_words(self) -> np.ndarray:
        """[num_slots, 4] int64 fields (a copy for device buffers, a view for host ones)."""
        data = self.view.host if self.device is None else self.array.numpy() if hasattr(self.array, "numpy") else None
        if data is None:
            raise ValidationError("kv-canary: host_words needs a host buffer or a device array with .numpy(), got "
                                  f"{type(self.array).__name__}. Fix: allocate it with CanaryBuffer.allocate")
        return np.ascontiguousarray(data).view(np.int64)[:, : abi.FIELDS_PER_SLOT]


class ViolationSink:
    """Violation ring ``[capacity, 8]`` int64, its int32 write index and the two int64 counters.

    Format v1 (SGLang's layout) is those four arrays: the ring fills once. The manager also gives
    ``claim`` (an int64 ``[1]`` whose low int32 is ``write_index``: the 64-bit count of every
    violation), ``consumed`` (int64 ``[1]``: ring rows the host has taken; rows are then kept in a
    window of ``capacity`` after it) and ``skips`` (int64 ``[1]``: verify entries the kernels
    skipped because the plan and the launch's batch disagree).

    Request verdicts (docs/format.md §5.7), each optional: ``verdicts`` (int64 ``[n]``: a row
    attributed to request r < n of the batch ORs its fail bits into ``verdicts[r]``),
    ``failed_requests`` (int64 ``[1]``: the words that became nonzero) and ``ring_requests`` (int64
    ``[capacity]``: the request of the row stored at the same ring index, -1 for none). A step's
    first plan build resets the first two.
    """

    def __init__(self, ring, write_index, kernel_run_counter, slot_run_counter, *, claim=None,
                 consumed=None, skips=None, verdicts=None, failed_requests=None, ring_requests=None):
        self.ring_view = checked(ring, "violation ring", dtype=np.int64, ndim=2, writable=True,
                                 shape=(None, abi.RING_COLS))
        self.write_index_view = checked(write_index, "write_index", dtype=np.int32, shape=(1,), ndim=1, writable=True)
        self.kernel_run_view = checked(kernel_run_counter, "kernel_run_counter", dtype=np.int64, shape=(1,), ndim=1, writable=True)
        self.slot_run_view = checked(slot_run_counter, "slot_run_counter", dtype=np.int64, shape=(1,), ndim=1, writable=True)
        opt = lambda a, name: None if a is None else checked(a, name, dtype=np.int64, shape=(1,), ndim=1, writable=True)  # noqa: E731
        self.claim_view, self.consumed_view, self.skips_view = (
            opt(claim, "claim"), opt(consumed, "consumed"), opt(skips, "skips"))
        self.arrays = (ring, write_index, kernel_run_counter, slot_run_counter)  # format v1
        self.window_arrays = (claim, consumed, skips)
        self.capacity = self.ring_view.shape[0]
        if self.capacity < 1:
            raise ValidationError("kv-canary: violation ring must have at least 1 row, got 0. Fix: "
                                  "allocate it as [capacity >= 1, 8]")
        self.verdicts_view = None if verdicts is None else checked(verdicts, "verdicts", dtype=np.int64, ndim=1,
                                                                   writable=True)
        self.failed_view = opt(failed_requests, "failed_requests")
        self.ring_requests_view = None if ring_requests is None else checked(
            ring_requests, "ring_requests", dtype=np.int64, shape=(self.capacity,), ndim=1, writable=True)
        self.verdict_arrays = (verdicts, failed_requests, ring_requests)
        self.device = same_device([self.ring_view, self.write_index_view, self.kernel_run_view,
                                   self.slot_run_view, self.claim_view, self.consumed_view, self.skips_view,
                                   self.verdicts_view, self.failed_view, self.ring_requests_view],
                                  "a ViolationSink")

    @classmethod
    def allocate(cls, capacity: int = abi.DEFAULT_RING_CAPACITY, *, device: int | None = None):
        integer("capacity", capacity, lo=1, hi=RING_CAPACITY_LIMIT, fix="pass the ring's rows, e.g. capacity=4096")
        return cls(alloc_zeros((capacity, abi.RING_COLS), np.int64, device),
                   alloc_zeros((1,), np.int32, device), alloc_zeros((1,), np.int64, device),
                   alloc_zeros((1,), np.int64, device))

    def pack_ring(self, p, tag) -> None:
        """Fill the ring fields of a params struct (the _COMMON prefix) from this sink."""
        p.ring, p.ring_capacity, p.write_index = self.ring_view.ptr, self.capacity, self.write_index_view.ptr
        p.ring_claim = 0 if self.claim_view is None else self.claim_view.ptr
        p.ring_consumed = 0 if self.consumed_view is None else self.consumed_view.ptr
        p.skip_counter = 0 if self.skips_view is None else self.skips_view.ptr
        p.kernel_run_counter, p.slot_run_counter = self.kernel_run_view.ptr, self.slot_run_view.ptr
        p.tag = int(tag)
        v = self.verdicts_view
        p.verdicts, p.verdict_len = (0, 0) if v is None else (v.ptr, v.shape[0])
        p.failed_requests = 0 if self.failed_view is None else self.failed_view.ptr
        p.ring_requests = 0 if self.ring_requests_view is None else self.ring_requests_view.ptr

    def params(self, struct_type, tag):
        """A fresh params struct with only this sink's fields filled (the plan builder's)."""
        p = struct_type()
        self.pack_ring(p, tag)
        return p


@dataclass
class VerifyContext:
    """What one launch tag verifies and writes: a buffer, a sink, the real-KV sources and mode.

    Source pointers and the mode are fixed for the life of the context (docs/format.md §9): the ABI bytes
    shared by every launch of the context are packed once here. ``chain_position_assert`` is an
    int32 [1] flag in the context's memory (set it with :meth:`set_chain_position_assert`).
    """

    buffer: CanaryBuffer
    sink: ViolationSink
    tag: abi.LaunchTag = abi.LaunchTag.HEAD_K_FULL
    sources: Sequence[RealKvSource] = ()
    hash_mode: abi.HashMode = abi.HashMode.PARTIAL
    chain_position_assert: Any = None
    self_test_every: int = 0
    fingerprint_every: int = 1
    fingerprint_phase: Any = None
    marshalled: tuple[MarshalledSource, ...] = field(init=False)
    common: bytes = field(init=False, repr=False)

    def __post_init__(self):
        instance("VerifyContext.buffer", self.buffer, CanaryBuffer, "a kvcanary.CanaryBuffer",
                 "wrap the array: CanaryBuffer(array), or CanaryBuffer.allocate(num_slots)")
        instance("VerifyContext.sink", self.sink, ViolationSink, "a kvcanary.ViolationSink",
                 "pass ViolationSink.allocate(capacity) or ViolationSink(ring, write_index, ...)")
        self.tag = launch_tag(self.tag, "VerifyContext.tag")
        self.hash_mode = parse_hash_mode(self.hash_mode, "VerifyContext.hash_mode")
        self.sources = source_list(self.sources, "VerifyContext.sources")
        self.marshalled = marshal_sources(self.sources, self.hash_mode, self.buffer.num_slots)
        if self.chain_position_assert is None:
            self.chain_position_assert = alloc_zeros((1,), np.int32, self.buffer.device)
        self.flag_view = checked(self.chain_position_assert, "chain_position_assert", dtype=np.int32,
                                 shape=(1,), ndim=1)
        same_device([self.buffer.view, self.sink.ring_view, self.flag_view,
                     *(m.view for m in self.marshalled)], "a VerifyContext")
        self.source_descs = self._pack_sources()
        self.common = self._pack_common()
        integer("VerifyContext.self_test_every", self.self_test_every, lo=0, hi=INT32_MAX,
                fix="pass 0 (off) or the number of verify launches between self-tests")
        integer("VerifyContext.fingerprint_every", self.fingerprint_every, lo=1, hi=INT32_MAX,
                fix="pass 1 (fingerprint every entry) or N: a rotating 1/N of the cached tokens per launch")
        self.phase_view = None  # the fingerprint budget's phase counter (docs/format.md §6.1)
        if self.fingerprint_phase is not None:
            self.phase_view = checked(self.fingerprint_phase, "fingerprint_phase", dtype=np.int64, shape=(1,), ndim=1)
            same_device([self.buffer.view, self.phase_view], "a VerifyContext")
        self.self_test_view = None
        if self.self_test_every:  # the canary-only known-bad record (docs/format.md §11)
            bad = np.array([abi.SELF_TEST_TOKEN, abi.SELF_TEST_POSITION + 1, 0, 0], np.int64)
            if self.device is not None:
                bad = memory.to_device(bad, device=self.device)
            self._self_test = bad
            self.self_test_view = checked(bad, "self_test", dtype=np.int64, shape=(abi.FIELDS_PER_SLOT,), ndim=1)

    def fill_verify_tail(self, p) -> None:
        """The fields of abi._VERIFY_TAIL a verify params struct takes from the context: the self-test
        and the fingerprint budget (0: off)."""
        if self.self_test_view is not None:
            p.self_test, p.self_test_every = self.self_test_view.ptr, self.self_test_every
        p.fingerprint_every = self.fingerprint_every
        p.fingerprint_phase = 0 if self.phase_view is None else self.phase_view.ptr

    def phase(self) -> int:
        """The fingerprint budget's phase counter as the host reference reads it (0 without one)."""
        return 0 if self.phase_view is None else int(self.phase_view.host[0])

    @property
    def device(self) -> int | None:
        return self.buffer.device

    def set_chain_position_assert(self, on: bool) -> None:
        """Turn the write-position assert on or off (a host write; not for use inside a graph)."""
        value = np.array([1 if boolean("on", on) else 0], np.int32)
        if self.device is None:
            self.flag_view.host[...] = value
        else:
            memory.copy_from_host_ptr(self.flag_view.ptr, value, self.device)

    def _pack_sources(self):
        """The KvcSourceDesc array the kernels read (device memory of the context; host memory
        for a host context, whose launches the reference runs). At least one element."""
        descs = (abi.SourceDesc * max(1, len(self.marshalled)))()
        for d, m in zip(descs, self.marshalled):
            d.base, d.row_stride = m.view.ptr, m.view.strides[0]
            d.page_size, d.bytes_per_token, d.hash_bytes = m.page_size, m.bytes_per_token, m.hash_bytes
        raw = np.frombuffer(bytes(descs), np.uint8)
        if self.device is None:
            return raw.copy()
        return memory.to_device(raw, device=self.device)

    @property
    def hash_bytes(self) -> tuple[int, ...]:
        """Bytes fingerprinted per slot of each source, in order."""
        return tuple(m.hash_bytes for m in self.marshalled)

    def _pack_common(self) -> bytes:
        p = abi.VerifyParams()
        p.canary = self.buffer.view.ptr
        p.slot_stride_words = self.buffer.slot_stride // abi.WORD_BYTES
        p.num_slots = self.buffer.num_slots
        self.sink.pack_ring(p, self.tag)
        p.num_sources = len(self.marshalled)
        s = self.source_descs
        p.sources = s.ctypes.data if isinstance(s, np.ndarray) else s.ptr
        return bytes(p)[:COMMON_BYTES]

    def params(self, struct_type):
        """A fresh params struct of ``struct_type`` with the shared fields filled in."""
        p = struct_type()
        ctypes.memmove(ctypes.addressof(p), self.common, COMMON_BYTES)
        return p


COMMON_BYTES = abi.layout(abi.VERIFY_PARAMS)["plan_slot"]
for _decl in (abi.WRITE_PARAMS, abi.FUSED_VERIFY_PARAMS, abi.PREPARE_PARAMS):  # they share the prefix
    assert [f.name for f in _decl.fields[:len(abi.COMMON)]] == [f.name for f in abi.COMMON]
