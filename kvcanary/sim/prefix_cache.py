"""Slot allocation, the radix-style prefix cache, the host tier and sweeps of the simulated engine.

Every slot carries a reference count: one per running request that reads it and one per cache
entry that holds it. A slot goes back to the free list (LIFO, as a real allocator reuses hot
memory first) only at zero; its SWA slot goes with it. Evicted entries may be offloaded: their
KV bytes and canary records are copied to host memory and copied back on a later prefix hit.
"""

from __future__ import annotations

import numpy as np

from kvcanary.abi import CHAIN_HEAD

from .data import Entry, HostEntry, Read, Transfer


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class Cache:
    def __init__(self, eng):
        self.eng, cfg = eng, eng.cfg
        self.ref = np.zeros(cfg.num_slots, np.int32)
        self.free = eng.rng.permutation(np.arange(1, cfg.num_slots)).tolist()
        self.swa_free = eng.rng.permutation(np.arange(1, cfg.num_slots)).tolist() if cfg.swa_window else []
        self.entries: list[Entry] = []
        self.host: list[HostEntry] = []
        self.late: list = []
        self._cursor = 0

    # ---- allocation ----------------------------------------------------------------------------
    def alloc(self, n: int) -> np.ndarray:
        if len(self.free) < n:
            self.reserve(n)
        if len(self.free) < n:
            raise RuntimeError(f"kv-canary sim: out of KV slots (need {n}, {len(self.free)} free)")
        out = np.asarray(self.free[len(self.free) - n:][::-1], np.int64)
        del self.free[len(self.free) - n:]
        self.ref[out] += 1
        return out

    def alloc_swa(self, n: int) -> np.ndarray:
        out = np.asarray(self.swa_free[len(self.swa_free) - n:][::-1], np.int64)
        del self.swa_free[len(self.swa_free) - n:]
        return out

    def reserve(self, need: int, keep: Entry | None = None) -> bool:
        """Evict idle entries (LRU) until ``need`` slots are free; False if that is impossible."""
        while len(self.free) < need:
            if not self.evict_one(keep):
                return False
        return True

    def evict_one(self, keep: Entry | None = None) -> bool:
        idle = [e for e in self.entries if e.users == 0 and e is not keep]
        if not idle:
            return False
        e = min(idle, key=lambda x: x.last)
        cfg = self.eng.cfg
        if cfg.offload and self.eng.rng.random() < cfg.offload_prob:
            self.offload(e)
        self.drop(e)
        return True

    def drop(self, e: Entry) -> None:
        self.entries.remove(e)
        self.eng.release(e.slots)

    # ---- prefix cache ----------------------------------------------------------------------------
    def insert(self, req) -> None:
        """A finished request's written prefix becomes a cache entry."""
        n = req.cached
        if n < 2:
            return
        e = Entry(req.tokens[:n].copy(), req.keys[:n].copy(), np.asarray(req.slots[:n], np.int64), last=self.eng.t)
        self.ref[e.slots] += 1
        self.entries.append(e)
        while len(self.entries) > self.eng.cfg.cache_entries and self.evict_one(keep=e):
            pass

    def match(self, tokens: np.ndarray, cap: int) -> tuple[Entry | None, int]:
        """Longest cached prefix of ``tokens`` (at most ``cap``), loading it from the host tier
        when that holds a longer one."""
        best, m = None, 0
        for e in self.entries:
            n = lcp(tokens, e.tokens)
            if n > m:
                best, m = e, n
        hbest, hm = None, 0
        for h in self.host:
            n = lcp(tokens, h.tokens)
            if n > hm:
                hbest, hm = h, n
        if self.eng.cfg.offload and hbest is not None and min(hm, cap) > max(m, 3):
            loaded = self.load(hbest, min(hm, cap))
            if loaded is not None:
                best, m = loaded, min(hm, cap)
        m = min(m, cap)
        return (best, m) if m > 0 else (None, 0)

    # ---- host tier -------------------------------------------------------------------------------
    def offload(self, e: Entry) -> None:
        """Device -> host copy of an entry's KV and its canary records (they travel together,
        through KvCanary.export_records / import_records)."""
        eng = self.eng
        h = HostEntry(e.tokens, e.keys, {n: eng.full.read(n, e.slots) for n in eng.full.specs},
                      eng.kv.export_records(e.slots, group="FULL").to_host())
        if eng.swa is not None:
            swa = eng.map[e.slots]
            h.swa_kv = {n: eng.swa.read(n, swa) for n in eng.swa.specs}
            h.swa_records = eng.kv.export_records(swa, group="SWA").to_host()
        self.host.append(h)
        eng.counts["offloads"] += 1
        del self.host[:max(0, len(self.host) - eng.cfg.host_entries)]

    def load(self, h: HostEntry, n: int) -> Entry | None:
        """Host -> device copy of ``n`` tokens into fresh slots; the fault may spoil the copy."""
        eng = self.eng
        if not self.reserve(n + sum(len(r.tokens) - r.cached + eng.cfg.spec_k for r in eng.running)):
            return None
        dst = self.alloc(n)
        xfer = Transfer(h, n, dst, None, {k: eng.full.read(k, dst) for k in eng.full.specs},
                        eng.kv.export_records(dst, group="FULL").to_host(), eng.slot_key[dst].copy())
        for k in eng.full.specs:
            eng.full.write(k, dst, h.kv[k][:n])
        eng.kv.import_records(dst, h.records.take(slice(0, n)), group="FULL")
        eng.slot_key[dst] = h.keys[:n]
        if eng.swa is not None:
            xfer.swa_dst = swa = self.alloc_swa(n)
            eng.map[dst] = swa
            for k in eng.swa.specs:
                eng.swa.write(k, swa, h.swa_kv[k][:n])
            eng.kv.import_records(swa, h.swa_records.take(slice(0, n)), group="SWA")
            eng.swa_key[swa] = h.keys[:n]
        eng.counts["loads"] += 1
        eng.fault.on_load(eng, xfer)
        self.late.extend(xfer.late)
        if h in self.host:  # (making room may have trimmed it from the host tier meanwhile)
            self.host.remove(h)
        e = Entry(h.tokens[:n].copy(), h.keys[:n].copy(), dst, last=eng.t)
        self.entries.append(e)
        return e

    # ---- sweep -------------------------------------------------------------------------------------
    def sweep(self) -> None:
        """Verify idle cached slots (entries no running request holds) through KvCanary.sweep,
        round robin, at most sweep_capacity slots per group."""
        eng = self.eng
        idle = [e for e in self.entries if e.users == 0]
        if not idle:
            return
        k = self._cursor % len(idle)
        picked, total = [], 0
        for e in idle[k:] + idle[:k]:
            if total + len(e.slots) > eng.cfg.sweep_capacity:
                break
            picked.append(e)
            total += len(e.slots)
        self._cursor += max(1, len(picked))
        if not picked:
            return
        slots = np.concatenate([e.slots for e in picked])
        pos = np.concatenate([np.arange(len(e.slots)) for e in picked])
        prev = np.concatenate([np.concatenate([[CHAIN_HEAD], e.slots[:-1]]) for e in picked]).astype(np.int64)
        toks = np.concatenate([e.tokens for e in picked])
        keys = np.concatenate([e.keys for e in picked])
        eng._canary(eng.kv.sweep, slots, pos, prev, group="FULL")
        eng.counts["swept_slots"] += len(slots)
        reads = [Read("FULL", "sweep", slots, pos, toks, keys)]
        if eng.swa is not None:
            swa, swa_prev = eng.map[slots], np.where(prev >= 0, eng.map[np.maximum(prev, 0)], CHAIN_HEAD)
            eng._canary(eng.kv.sweep, swa, pos, swa_prev, group="SWA")
            reads.append(Read("SWA", "sweep", swa, pos, toks, keys))
        eng.fault.observe(eng, reads)
