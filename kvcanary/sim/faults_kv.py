"""Fault injectors that corrupt KV bytes (K5-K7 on a host->device load, K10, K12) for the
simulated engine. Byte faults count as fired only for slots whose bytes changed inside what the
scenario's hash mode reads (the first 16 bytes of a strip in PARTIAL, every configured byte in
ALL); see :mod:`kvcanary.sim.faults` for the protocol."""

from __future__ import annotations

import numpy as np

from ..abi import PARTIAL_HASH_BYTES
from .faults import Fault, chain, running
from .prefix_cache import lcp


def changed_in_window(eng, pool, slots, tokens, positions, mode: str) -> np.ndarray:
    """Bool per slot: some tensor differs from what the model wrote, inside the hashed window."""
    bad = np.zeros(len(slots), bool)
    for name, (nbytes, _, _) in pool.specs.items():
        eff = min(PARTIAL_HASH_BYTES, nbytes) if mode == "partial" else nbytes
        got = pool.read(name, slots)[:, :eff]
        bad |= (got != pool.expected(name, tokens, positions)[:, :eff]).any(axis=1)
    return bad


def _restore(eng, x, idx, names=None, records: bool = True) -> None:
    """Leave destination ``idx`` as it was before the copy (its old bytes, records and content)."""
    dst = x.dst[idx]
    for k in names or eng.full.specs:
        eng.full.write(k, dst, x.old_kv[k][idx])
    if records:
        eng.kv.import_records(dst, x.old_records.take(idx), group="FULL")
        eng.slot_key[dst] = x.old_keys[idx]


def _put(eng, x, dst_idx, src_idx) -> None:
    """Copy host element ``src_idx`` (KV, records, content) into destination ``dst_idx``."""
    h, dst_idx, src_idx = x.entry, np.atleast_1d(dst_idx), np.atleast_1d(src_idx)
    dst = x.dst[dst_idx]
    for k in eng.full.specs:
        eng.full.write(k, dst, h.kv[k][src_idx])
    eng.kv.import_records(dst, h.records.take(src_idx), group="FULL")
    eng.slot_key[dst] = h.keys[src_idx]


class _Reload(Fault):
    """Forces an offload of an idle cached prefix and, a few steps later (its slots reused by
    others), a request that brings it back; the fault spoils that host->device copy."""

    needs = {"offload": True}
    host = None
    submitted = False

    def before_step(self, eng):
        if not self.active:
            return
        if self.host is not None and self.host not in eng.cache.host:
            self.host, self.submitted = None, False  # trimmed from the host tier; start over
        if self.host is None:
            es = eng.cache.entries
            idle = [e for e in es if e.users == 0 and len(e.tokens) >= 8 and max(
                [lcp(e.tokens, o.tokens) for o in es if o is not e], default=0) < len(e.tokens) - 4]
            e = self.pick(idle)
            if e is not None:
                eng.cache.offload(e)
                eng.cache.drop(e)
                self.host, self.due = eng.cache.host[-1], eng.t + int(self.rng.integers(2, 5))
        elif not self.submitted and eng.t >= self.due:
            tail = self.rng.integers(1, eng.cfg.vocab, int(self.rng.integers(4, 16)))
            eng.submit(np.concatenate([self.host.tokens, tail]))
            self.submitted = True

    def on_load(self, eng, x):
        if not self.active or x.entry is not self.host:
            return
        variant = self.spoil(eng, x)
        pos = np.arange(x.n)
        wrong = (eng.slot_key[x.dst] != x.entry.keys[:x.n]) | changed_in_window(
            eng, eng.full, x.dst, x.entry.tokens[:x.n], pos, self.mode)
        idx = np.flatnonzero(wrong)
        if len(idx):
            self.fire(eng, {"FULL": x.dst[idx]}, {"FULL": chain(x.dst, idx)}, variant=variant,
                      loaded=x.n, wrong=len(idx))
        else:
            self.host, self.submitted = None, False  # the copy came out right after all: try again


class K5(_Reload):
    """Offload copy: the load-back drops, duplicates, reorders or cuts short per-slot copies (KV
    and records travel together), or tears a slot (one half of its tensors not copied)."""

    cls = "K5"

    def spoil(self, eng, x):
        n, rng = x.n, self.rng
        kinds = ["dropped", "duplicated", "reordered", "partial"] + (["torn"] if self.mode != "none" else [])
        kind = str(self.pick(kinds))
        i = int(rng.integers(0, n - 1))
        if kind == "dropped":
            _restore(eng, x, [i])
        elif kind == "duplicated":
            _put(eng, x, i + 1, i)
        elif kind == "reordered":
            j = int(rng.integers(i + 1, n))
            _put(eng, x, i, j)
            _put(eng, x, j, i)
        elif kind == "partial":
            _restore(eng, x, np.arange(int(rng.integers(1, n)), n))
        else:
            names = list(eng.full.specs)
            _restore(eng, x, [i], names[len(names) // 2:], records=False)
        return f"{kind} copy"


class K6(_Reload):
    """Layout mismatch: producer and consumer of the load disagree on the byte layout of a
    token (heads x dim transposed, or K/V packed vs split), with the same byte count."""

    cls, needs = "K6", {"offload": True, "heads": lambda c: max(c.heads, 2)}

    def spoil(self, eng, x):
        H, D = eng.cfg.heads, eng.cfg.head_bytes
        layers = [k for k, (_, _, scale) in eng.full.specs.items() if not scale and k[0] == "K"]
        if self.rng.random() < 0.5:
            for k in [k for k, (_, _, scale) in eng.full.specs.items() if not scale]:
                data = eng.full.read(k, x.dst)
                eng.full.write(k, x.dst, data.reshape(-1, H, D).transpose(0, 2, 1).reshape(len(data), -1))
            return "HND read as NHD (heads x dim transposed)"
        for k in layers:
            v = "V" + k[1:]
            kd, vd = eng.full.read(k, x.dst), eng.full.read(v, x.dst)
            h = kd.shape[1] // 2
            eng.full.write(k, x.dst, np.concatenate([kd[:, :h], vd[:, :h]], axis=1))
            eng.full.write(v, x.dst, np.concatenate([kd[:, h:], vd[:, h:]], axis=1))
        return "K/V packed read as split"


class K7(_Reload):
    """Transfer race: the consumer reads the loaded prefix before the copy finished; the later
    layers (or, ALL only, the tail half of every strip) still hold the old bytes, and the rest
    lands after the step."""

    cls, needs = "K7", {"offload": True, "layers": lambda c: max(c.layers, 2)}

    def spoil(self, eng, x):
        late = [k for k in eng.full.specs if int(k[-1]) >= eng.cfg.layers // 2]
        fresh = {k: eng.full.read(k, x.dst) for k in eng.full.specs}
        if self.mode == "all" and self.rng.random() < 0.5:
            for k, (nbytes, _, _) in eng.full.specs.items():
                data = fresh[k].copy()
                data[:, nbytes // 2:] = x.old_kv[k][:, nbytes // 2:]
                eng.full.write(k, x.dst, data)
            variant = "tail half of each strip not landed"
        else:
            _restore(eng, x, np.arange(x.n), late, records=False)
            variant = f"layers >= {eng.cfg.layers // 2} not landed"
        dst = x.dst.copy()
        x.late.append(lambda: [eng.full.write(k, dst, fresh[k]) for k in fresh])
        return variant


def _victim(f: Fault, eng, swa_ok: bool = False):
    """(group, pool, slots, variant) of live slots a later step or sweep reads: a span of a
    running request's prefix, an idle cached prefix, or a window slot of the SWA pool."""
    idle = [e for e in eng.cache.entries if e.users == 0] if eng.cfg.sweep_every else []
    if idle and f.rng.random() < 0.3:
        e = f.pick(idle)
        p = int(f.rng.integers(0, len(e.slots)))
        return "FULL", eng.full, e.slots[p:p + 1], "idle cached slot (a sweep reads it)"
    r = f.pick(running(eng, min_cached=2, min_left=2, decode=swa_ok))
    if r is None:
        return None
    if swa_ok and eng.swa is not None and f.rng.random() < 0.3:
        p = int(f.rng.integers(max(0, r.cached - eng.cfg.swa_window + 1 + eng.cfg.spec_k), r.cached))
        return "SWA", eng.swa, eng.map[eng.rtt[r.row, p:p + 1]], "SWA window slot of a running request"
    p = int(f.rng.integers(0, r.cached))
    span = np.asarray(r.slots[p:p + int(f.rng.integers(1, 5))], np.int64)
    return "FULL", eng.full, span, "running request's prefix"


class K10(Fault):
    """Quantisation metadata: a scale tensor is zeroed, NaN or taken from another layer while
    the payload bytes stay unchanged."""

    cls, needs = "K10", {"scales": True}

    def before_step(self, eng):
        if not self.active:
            return
        v = _victim(self, eng)
        if v is None:
            return
        _, pool, slots, where = v
        names = [k for k, (_, _, scale) in pool.specs.items() if scale]
        name = str(self.pick(names))
        kinds = ["zeroed", "NaN"] + (["from another layer"] if eng.cfg.layers > 1 else [])
        kind = str(self.pick(kinds))
        before = pool.read(name, slots)
        if kind == "zeroed":
            data = np.zeros_like(before)
        elif kind == "NaN":
            data = np.full((len(slots), before.shape[1] // 4), np.nan, "<f4").view(np.uint8)
        else:
            other = str(self.pick([k for k in names if k != name and k[0] == name[0]] or names))
            data = pool.read(other, slots)
        pool.write(name, slots, data)
        changed = (data != before).any(axis=1)
        if changed.any():
            self.fire(eng, {"FULL": slots[changed]}, variant=f"{name} scale {kind}", where=where)


class K12(Fault):
    """Raw bit flip / stray write: 1 bit, 2-3 bits or a 32-byte burst inside the hashed window of
    a live slot (PARTIAL: within the first 16 bytes of the strip)."""

    cls = "K12"

    def before_step(self, eng):
        if not self.active:
            return
        v = _victim(self, eng, swa_ok=True)
        if v is None:
            return
        group, pool, slots, where = v
        s = int(slots[0])
        name = str(self.pick(list(pool.specs)))
        nbytes = pool.specs[name][0]
        win = min(PARTIAL_HASH_BYTES, nbytes) if self.mode == "partial" else nbytes
        row = pool.slots(name)[s]
        before = row.copy()
        kind = str(self.pick(["1 bit", "2-3 bits"] + (["32-byte burst"] if nbytes >= 32 else [])))
        if kind == "32-byte burst":
            start = int(self.rng.integers(0, min(win - 1, nbytes - 32) + 1))
            while (row[:win] == before[:win]).all():  # the burst must change a hashed byte
                row[start:start + 32] = self.rng.integers(0, 256, 32, dtype=np.uint8)
        else:
            bits = self.rng.choice(win * 8, 1 if kind == "1 bit" else int(self.rng.integers(2, 4)), replace=False)
            for b in bits:
                row[b // 8] ^= np.uint8(1 << (b % 8))
        pool.dirty.add(name)
        self.fire(eng, {group: [s]}, variant=f"{kind} in {name}", where=where,
                  bytes=np.flatnonzero(row != before).tolist())
