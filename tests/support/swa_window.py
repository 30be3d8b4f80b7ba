"""A sliding-window (SWA) request whose first verified entry's predecessor lies outside the window
and maps to the padding slot 0 (docs/format.md §8: an engine frees the SWA slots of out-of-window
tokens, so 0 there is legitimate and never reported), built for any backend, the fused or the
explicit-plan verify, and any fused-verify variant: ``hash_mode`` "partial" with 2 sources a half
picks the narrow kernels, 4 sources the *_many ones, "all" over 64-byte tokens the *_wide ones,
"none" the identity-only path."""

from __future__ import annotations

import numpy as np

import kvcanary as kc

N, BYTES, WINDOW, PREFILL = 64, 64, 4, 10


def run(device, hash_mode: str, layers: int, zero_position: int, fused: bool = True) -> list[tuple]:
    """Prefill one request (row 1) of PREFILL tokens at full slots 1.., then map the SWA slot of
    its position ``zero_position`` to 0 and decode one token. Returns the violation rows of the
    decode step as (tag, reason bits, slot, position) sorted; ``fused=False``: the explicit-plan
    path (the plan builder expands the entries, then the plain verify). With PREFILL cached tokens and
    WINDOW 4, the decode step verifies SWA positions 6..9; position 5 is the first entry's
    predecessor, outside the window."""
    rng = np.random.default_rng(layers)
    pools = {h: [rng.integers(0, 256, (N, BYTES), dtype=np.uint8) for _ in range(layers)] for h in "kv"}
    dev = (lambda a: a) if device is None else (lambda a: kc.runtime.memory.to_device(a, device))
    dpools = {h: [dev(p) for p in ps] for h, ps in pools.items()}
    src = lambda ps: [kc.RealKvSource(p, 1, BYTES) for p in ps]  # noqa: E731
    swa_map = np.arange(N, dtype=np.int64)  # SWA slot = full slot; 0 is the padding slot
    dmap = dev(swa_map)
    records = []
    canary = kc.KvCanary(kc.PoolGroup(N, src(dpools["k"]), src(dpools["v"])),
                         kc.PoolGroup(N, src(dpools["k"]), src(dpools["v"]), window=WINDOW, full_to_swa=dmap),
                         device=device, hash_mode=hash_mode, max_batch=2, export=records.append, fused=fused)
    rtt = np.zeros((2, 32), np.int32)

    def step(prefix, new, slots):
        rtt[1, prefix:prefix + new] = slots
        loc = np.array(slots, np.int64)
        b = kc.Batch(dev(np.array([1], np.int64)), dev(np.array([prefix], np.int64)), dev(np.array([new], np.int64)),
                     dev(rtt.copy()), dev(np.arange(100 + prefix, 100 + prefix + new, dtype=np.int64)),
                     dev(np.arange(prefix, prefix + new, dtype=np.int64)), dev(loc),
                     swa_out_cache_loc=dev(swa_map[loc]))
        canary.before_forward(b)
        for h, ps in pools.items():  # the forward writes the new tokens' K and V in every layer
            for p, d in zip(ps, dpools[h]):
                p[loc] = rng.integers(0, 256, (len(loc), BYTES), dtype=np.uint8)
                if device is not None:
                    d.copy_from_host(p)
        canary.after_forward(b)

    step(0, PREFILL, list(range(1, PREFILL + 1)))
    canary.flush()
    assert [r for r in records if r["type"] == "violation"] == []
    swa_map[int(rtt[1, zero_position])] = 0  # the engine freed this token's SWA slot
    if device is not None:
        dmap.copy_from_host(swa_map)
    before = len(records)
    step(PREFILL, 1, [PREFILL + 1])
    canary.flush()
    return sorted((r["launch_tag"], r["fail_reason_bits"], r["slot_idx"], r["position"])
                  for r in records[before:] if r["type"] == "violation")


VARIANTS = [("partial", 2), ("partial", 4), ("all", 1), ("none", 2)]  # narrow, *_many, *_wide, identity
