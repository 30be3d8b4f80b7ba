"""KV storage of the simulated engine: paged uint8 tensors, the stand-in model's KV content, and
the canary records that must travel with KV when it moves between slots.

A :class:`Pool` owns named tensors ``[num_slots // page_size, page_size * bytes_per_token]`` uint8
(one row per page, slot s at byte ``(s % page_size) * bytes_per_token`` of row ``s // page_size``).
On the CPU backend the numpy array *is* the pool the canary fingerprints. On the GPU backend the
pool lives in a :class:`kvcanary.runtime.memory.DeviceArray` and the numpy array is a host mirror: every
write goes to the mirror and :meth:`Pool.upload` copies changed tensors to the device before the
canary reads them (no torch needed).
"""

from __future__ import annotations

import zlib

import numpy as np

from kvcanary.ops.sources import RealKvSource
from kvcanary.reference.hashing import sm_np
from kvcanary.runtime import devices, driver, memory

_GOLD = np.uint64(0x9E3779B97F4A7C15)
_TOK = np.uint64(0xD6E8FEB86659FD93)
SCALE_BYTES = 16  # FP8-style per-token scales: 4 heads x float32


def content(tokens, positions, salt: int, nbytes: int) -> np.ndarray:
    """Deterministic KV bytes ``[n, nbytes]`` of tokens at positions for one tensor (``salt``
    names layer and half): identical inputs give identical bytes, so a shared prefix is
    reproducible; any change of token, position or salt changes every 8-byte word."""
    t = np.asarray(tokens, np.int64).reshape(-1).view(np.uint64)
    p = np.asarray(positions, np.int64).reshape(-1).view(np.uint64)
    with np.errstate(over="ignore"):
        base = sm_np(sm_np(t * _TOK ^ p) ^ np.uint64(salt & 0xFFFFFFFFFFFFFFFF))
        words = sm_np(base[:, None] + _GOLD * np.arange(1, nbytes // 8 + 1, dtype=np.uint64))
    return words.view(np.uint8).reshape(len(t), nbytes)


def scale_content(tokens, positions, salt: int) -> np.ndarray:
    """Per-token float32 scales in [2^-8, 1) as bytes ``[n, 16]`` (deterministic like :func:`content`)."""
    w = content(tokens, positions, salt, SCALE_BYTES).view(np.uint32)
    scales = (w >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / (1 << 24))
    return np.maximum(scales, np.float32(1.0 / 256)).astype("<f4").view(np.uint8).reshape(-1, SCALE_BYTES)


class Pool:
    """Named paged KV tensors of one pool (full or sliding-window) on the host or a GPU.

    ``specs`` maps a tensor name to ``(bytes_per_token, salt, is_scale)``. Names starting with
    "K" feed the canary's K half, "V" its V half; layers first, then scales (the order is the
    fingerprint's source order).
    """

    def __init__(self, num_slots: int, page_size: int, specs: dict, device: int | None):
        if num_slots % page_size:
            raise ValueError(f"kv-canary: sim pool needs num_slots % page_size == 0, got "
                             f"{num_slots} % {page_size}")
        self.num_slots, self.page_size, self.specs, self.device = num_slots, page_size, specs, device
        rows = num_slots // page_size
        self.host = {n: np.zeros((rows, page_size * b), np.uint8) for n, (b, _, _) in specs.items()}
        self.dev = {}
        if device is not None:
            self.dev = {n: memory.zeros(a.shape, np.uint8, device) for n, a in self.host.items()}
        self.dirty: set[str] = set()

    def slots(self, name: str) -> np.ndarray:
        """The mirror of ``name`` as ``[num_slots, bytes_per_token]`` (a view: writes land in it)."""
        return self.host[name].reshape(self.num_slots, self.specs[name][0])

    def read(self, name: str, slots) -> np.ndarray:
        return self.slots(name)[np.asarray(slots, np.int64)].copy()

    def write(self, name: str, slots, data) -> None:
        self.slots(name)[np.asarray(slots, np.int64)] = data
        self.dirty.add(name)

    def expected(self, name: str, tokens, positions) -> np.ndarray:
        """What the model writes into ``name`` for these tokens at these positions."""
        nbytes, salt, is_scale = self.specs[name]
        return scale_content(tokens, positions, salt) if is_scale else content(tokens, positions, salt, nbytes)

    def write_tokens(self, slots, tokens, positions) -> None:
        """The forward's KV write: every tensor of every new token."""
        if len(slots):
            for name in self.specs:
                self.write(name, slots, self.expected(name, tokens, positions))

    def corrupt(self, slots, tokens, positions) -> np.ndarray:
        """Bool per slot: some tensor differs from what the model wrote for (token, position)."""
        bad = np.zeros(len(slots), bool)
        for name in self.specs:
            bad |= (self.read(name, slots) != self.expected(name, tokens, positions)).any(axis=1)
        return bad

    def sources(self, half: str) -> list[RealKvSource]:
        names = [n for n in self.specs if n.startswith(half)]
        return [RealKvSource(self.dev.get(n, self.host[n]), self.page_size, self.specs[n][0]) for n in names]

    def upload(self) -> None:
        """GPU backend: copy changed mirrors to the device (synchronously, between launches)."""
        if self.device is None or not self.dirty:
            self.dirty.clear()
            return
        sync(self.device)
        for name in self.dirty:
            self.dev[name].copy_from_host(self.host[name])
        self.dirty.clear()
        sync(self.device)


def sync(device: int | None) -> None:
    """Wait for all work on the device (the sim is not a latency benchmark)."""
    if device is None:
        return
    driver.check(devices.runtime(device).call(driver._driver().cuCtxSynchronize), "cuCtxSynchronize")


def make_specs(layers: int, per_token: int, scales: bool, prefix: str = "") -> dict:
    """Tensor specs of a pool: K and V per layer, then optional K and V scales per layer."""
    specs = {}
    for half in "KV":
        for layer in range(layers):
            name = f"{half}{prefix}{layer}"
            specs[name] = (per_token, zlib.crc32(name.encode()), False)
        if scales:
            for layer in range(layers):
                name = f"{half}S{prefix}{layer}"
                specs[name] = (SCALE_BYTES, zlib.crc32(name.encode()), True)
    return specs
