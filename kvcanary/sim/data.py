"""Plain data of the simulated engine: configuration, requests, cache entries, one step's lanes,
what a step read, and a host<->device transfer. No behaviour beyond small helpers."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MASK = (1 << 64) - 1


@dataclass
class SimConfig:
    """Shape of a simulated engine and its workload (all sizes in tokens unless named bytes)."""

    num_slots: int = 4096
    page_size: int = 16
    layers: int = 2
    heads: int = 4
    head_bytes: int = 16          # FP8: one byte per element
    scales: bool = True           # FP8-style per-token scale tensors as extra sources
    swa_window: int = 0           # > 0: a sliding-window pool group with a full->SWA map
    spec_k: int = 0               # > 0: speculative decoding with this many draft tokens
    spec_accept: float = 0.7
    offload: bool = True          # evicted prefixes go to a host tier and come back on a hit
    offload_prob: float = 0.5
    sweep_every: int = 4          # steps between sweeps of idle cached slots (0: never)
    max_running: int = 8
    max_len: int = 512
    prompt_len: tuple[int, int] = (8, 120)
    output_len: tuple[int, int] = (4, 40)
    chunk: int = 48               # chunked prefill: tokens per request per step
    share_prob: float = 0.6
    num_system_prompts: int = 4
    pad_rows: int = 2             # CUDA-graph padding requests (and lanes) at the end of a batch
    admit_per_step: int = 2
    vocab: int = 32000
    cache_entries: int = 24
    host_entries: int = 12
    verify_capacity: int = 1 << 15
    self_test_every: int = 5      # the canary's self-test (docs/format.md §11): its rows are never violations
    sweep_capacity: int = 1 << 12
    seed: int = 0

    @property
    def bytes_per_token(self) -> int:
        return self.heads * self.head_bytes


def seq_keys(tokens, start_key: int = 0, start_pos: int = 0) -> np.ndarray:
    """Content identity of each position: a rolling hash of (token, position) over the prefix.
    Two slots hold the same KV exactly when their keys are equal (the engine's ground truth)."""
    out = np.empty(len(tokens), np.int64)
    k = start_key & MASK
    for i, t in enumerate(np.asarray(tokens, np.int64).tolist()):
        k = ((k ^ (t * 0x9E3779B97F4A7C15 + start_pos + i)) * 0x100000001B3) & MASK
        k ^= k >> 29
        out[i] = k - (1 << 64) if k >> 63 else k
    return out


@dataclass(eq=False)
class Req:
    rid: int
    row: int
    tokens: np.ndarray            # prompt + the whole output (revealed as it is "sampled")
    keys: np.ndarray              # seq_keys(tokens)
    prompt_len: int
    cached: int = 0               # positions whose KV is in the pool
    slots: list = field(default_factory=list)
    entry: "Entry | None" = None  # the cache entry its prefix came from (locked while running)

    @property
    def done(self) -> bool:
        return self.cached >= len(self.tokens) - 1


@dataclass(eq=False)
class Entry:
    """A cached prefix on the device: tokens, their keys and slots (each slot holds a reference)."""

    tokens: np.ndarray
    keys: np.ndarray
    slots: np.ndarray
    users: int = 0
    last: int = 0


@dataclass(eq=False)
class HostEntry:
    """An offloaded prefix: its KV bytes per tensor, canary records (CanaryRecords), and the SWA part."""

    tokens: np.ndarray
    keys: np.ndarray
    kv: dict
    records: object         # kvcanary.CanaryRecords (host)
    swa_kv: dict | None = None
    swa_records: object = None


@dataclass(eq=False)
class Lanes:
    """One step's batch as the engine sees it. Per request: row, prefix, extend and its lane
    range; per lane (new token): model input token and position, the intended token and
    position, full and SWA slot and content key. Padding lanes come last."""

    reqs: list
    rows: np.ndarray
    prefix: np.ndarray
    extend: np.ndarray
    tok: np.ndarray
    pos: np.ndarray
    exp_tok: np.ndarray
    exp_pos: np.ndarray
    out: np.ndarray
    swa_out: np.ndarray
    key: np.ndarray
    start: np.ndarray            # lane offset of each request
    num_real: int                # lanes before the padding lanes
    reads: list = field(default_factory=list)


@dataclass(eq=False)
class Read:
    """Slots a step (its attention) or a sweep read, with what each should hold."""

    group: str
    kind: str
    slots: np.ndarray
    positions: np.ndarray
    tokens: np.ndarray
    keys: np.ndarray


@dataclass(eq=False)
class Transfer:
    """A host -> device load of ``n`` tokens of a host entry into ``dst`` (and ``swa_dst``).
    ``old_*`` hold what the destination held before (a faulty copy may leave it there)."""

    entry: HostEntry
    n: int
    dst: np.ndarray
    swa_dst: np.ndarray | None
    old_kv: dict
    old_records: object     # kvcanary.CanaryRecords (host) of the destination before the copy
    old_keys: np.ndarray
    late: list = field(default_factory=list)   # callables run after the step (late landings)


def lane_keys(ln: Lanes) -> np.ndarray:
    """Content keys of what each lane's model input really is (recomputed from ``tok``/``pos``,
    which a fault may have changed), chained from the request's cached prefix."""
    keys = ln.key.copy()
    for i, r in enumerate(ln.reqs):
        lo, n = int(ln.start[i]), int(ln.extend[i])
        span = slice(lo, lo + n)
        if (ln.tok[span] != ln.exp_tok[span]).any() or (ln.pos[span] != ln.exp_pos[span]).any():
            c = int(ln.exp_pos[lo])
            k = int(r.keys[c - 1]) if c else 0
            for j in range(lo, lo + n):  # a changed token or position changes this and later content
                k = int(seq_keys(ln.tok[j:j + 1], k, int(ln.pos[j]))[0])
                keys[j] = k
    return keys
