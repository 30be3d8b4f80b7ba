"""Fault injectors for the classes of FAULTS.md, each an honest model of the real bug, and the
coverage table (which hash mode can see which class).

An injector hooks the simulated engine (see :class:`kvcanary.sim.engine.NoFault`). Once the
campaign sets ``active`` it waits for a moment where its bug can happen, makes it happen, and
calls :meth:`Fault.fire` with evidence: ``injected`` is the step the corruption landed, ``cands``
the slots whose content is now wrong. ``read`` is set only when the engine's ground truth shows a
step or a sweep really read wrong content from one of them (:func:`bad_reads`); a fault
that was never read is "not exercised", never a detection or a miss. ``involved`` lists the
slots a violation row may name to count as catching this fault (the corrupted slots and their
chain successors). This module holds K1-K4; :mod:`kvcanary.sim.faults_step` the faults of a
running step (K8, K9, K11, K13); :mod:`kvcanary.sim.faults_kv` the byte-level ones (K5-K7, K10, K12);
:mod:`kvcanary.sim.faults_write` lost writes (K14) and late zeroing (K5b).
"""

from __future__ import annotations

import numpy as np

from .engine import NoFault
from .prefix_cache import lcp

TITLES = {
    "K1": "prefix reuse", "K2": "premature free", "K3": "index map", "K4": "sliding-window map",
    "K5": "offload copy", "K6": "layout mismatch", "K7": "transfer race", "K8": "speculative decoding",
    "K9": "padding write", "K10": "quantisation scales", "K11": "position / chunk offset",
    "K12": "bit flip / stray write", "K13": "input token",
    # issue 43's classes, after K13 so the earlier classes keep their campaign seeds (seed_for)
    "K14": "lost write", "K5b": "late zeroing",
}
CLASSES = tuple(TITLES)
MODES = ("none", "partial", "all")
_IDENTITY_BLIND = "identity-only mode hashes no KV bytes"
NOT_COVERED = {
    ("K6", "none"): _IDENTITY_BLIND + "; a layout permutation keeps every token, position and chain",
    ("K7", "none"): _IDENTITY_BLIND + "; a torn copy carries the right records over stale bytes",
    ("K10", "none"): _IDENTITY_BLIND + "; scales change while every record stays right",
    ("K12", "none"): _IDENTITY_BLIND + "; a bit flip changes bytes only",
    ("K14", "none"): _IDENTITY_BLIND + "; a lost store leaves every record right over stale bytes",
    ("K5b", "none"): _IDENTITY_BLIND + "; a zeroing changes bytes only",
}
PARTIAL_NOTE = ("PARTIAL hashes the first 16 bytes of each source strip: byte faults are injected "
                "inside that window (K12 flips and bursts start in bytes [0, 16), K7 tears whole "
                "layers, K6/K10 change the first bytes of a strip)")


def coverage(cls: str, mode: str) -> tuple[bool, str]:
    """(covered, why not) for one class in one hash mode (docs/faults.md: K9 is covered in every mode,
    by the plan builder's check of the tokens past the write ranges)."""
    note = NOT_COVERED.get((cls, mode))
    return (note is None, note or "")


class Fault(NoFault):
    cls, needs = "", {}

    def __init__(self, rng: np.random.Generator, mode: str):
        self.rng, self.mode = rng, mode
        self.active = False
        self.injected = self.read = None
        self.evidence: dict = {}
        self.cands = {"FULL": set(), "SWA": set()}
        self.involved = {"FULL": set(), "SWA": set()}

    def fire(self, eng, cands: dict, involved: dict | None = None, **evidence) -> None:
        self.injected, self.active = eng.t, False
        for g, s in cands.items():
            self.cands[g].update(int(x) for x in np.asarray(s).reshape(-1))
        for g, s in (involved or {}).items():
            self.involved[g].update(int(x) for x in np.asarray(s).reshape(-1))
        for g in self.cands:
            self.involved[g] |= self.cands[g]
        self.evidence.update(evidence, step=eng.t)

    def observe(self, eng, reads) -> None:
        if self.injected is None or self.read is not None:
            return
        hits = bad_reads(eng, reads, self.cands)
        if hits:
            self.read = eng.t
            self.evidence["read"] = [list(h) for h in hits[:3]]

    def pick(self, items):
        return items[int(self.rng.integers(len(items)))] if len(items) else None


def bad_reads(eng, reads, candidates: dict) -> list[tuple]:
    """Reads of candidate slots that did not get what they should (key or bytes differ):
    the ground truth that a corruption was really read. (group, kind, slot, position)."""
    hits = []
    for rd in reads:
        cand = candidates.get(rd.group)
        if not cand or not len(rd.slots):
            continue
        idx = np.flatnonzero(np.isin(rd.slots, np.fromiter(cand, np.int64)))
        if not len(idx):
            continue
        s, p = rd.slots[idx], rd.positions[idx]
        pool, key = (eng.full, eng.slot_key) if rd.group == "FULL" else (eng.swa, eng.swa_key)
        bad = (key[s] != rd.keys[idx]) | pool.corrupt(s, rd.tokens[idx], p)
        hits += [(rd.group, rd.kind, int(a), int(b)) for a, b in zip(s[bad], p[bad])]
    return hits


def running(eng, min_cached: int = 2, min_left: int = 3, decode: bool = False) -> list:
    """Running requests that will be scheduled again for at least ``min_left`` steps."""
    return [r for r in eng.running if r.cached >= min_cached and len(r.tokens) - 1 - r.cached >= min_left
            and (not decode or r.cached >= r.prompt_len)]


def chain(slots, idx) -> np.ndarray:
    """The slots at ``idx`` and their successors (a chain check names the successor)."""
    slots = np.asarray(slots, np.int64)
    idx = np.asarray(idx, np.int64).reshape(-1)
    return slots[np.unique(np.clip(np.concatenate([idx, idx + 1]), 0, len(slots) - 1))]


def swa_of(eng, slots) -> np.ndarray:
    return eng.map[np.asarray(slots, np.int64)] if eng.swa is not None else np.zeros(0, np.int64)


class K1(Fault):
    """Prefix reuse: the cache hands out a cached prefix past the point where its tokens stop
    matching the new prompt (a radix key compare off by one, a page-hash collision)."""

    cls, needs = "K1", {"share_prob": 0.8}
    target = None

    def before_step(self, eng):
        if not self.active or self.target is not None:
            return
        e = self.pick([e for e in eng.cache.entries if len(e.tokens) >= 8])
        if e is None:
            return
        m = int(self.rng.integers(2, len(e.tokens) - 4))
        tail = self.rng.integers(1, eng.cfg.vocab, int(self.rng.integers(6, 24)))
        tail[0] = e.tokens[m] % (eng.cfg.vocab - 1) + 1  # differs from the cached token at m
        self.target = (e, np.concatenate([e.tokens[:m], tail]))
        eng.submit(self.target[1])

    def on_admit(self, eng, tokens, entry, m):
        if self.target is None or self.injected is not None or len(tokens) < len(self.target[1]) \
                or not (tokens[:len(self.target[1])] == self.target[1]).all():
            return super().on_admit(eng, tokens, entry, m)
        e = self.target[0]
        if e not in eng.cache.entries:
            self.target = None
            return super().on_admit(eng, tokens, entry, m)
        true = lcp(tokens, e.tokens)
        n = min(true + int(self.rng.integers(1, 4)), len(e.tokens), len(self.target[1]) - 1)
        wrong = e.slots[true:n]
        self.fire(eng, {"FULL": wrong, "SWA": swa_of(eng, wrong)}, variant="over-long match",
                  matched=true, reused=n)
        return e, n, e.slots[:n]


class K2(Fault):
    """Premature free: a slot returns to the free list while a request (or a cache entry) still
    references it; the allocator hands it out again and the new owner overwrites it."""

    cls = "K2"
    victim = None

    def before_step(self, eng):
        if not self.active or self.victim is not None:
            return
        idle = [e for e in eng.cache.entries if e.users == 0] if eng.cfg.sweep_every else []
        if idle and self.rng.random() < 0.3:
            e = self.pick(idle)
            slots, variant = e.slots, "cached prefix freed (sweep reads it)"
        else:
            r = self.pick(running(eng, min_cached=3, min_left=4))
            if r is None:
                return
            slots, variant = np.asarray(r.slots, np.int64), "running request's slot freed"
        p = int(self.rng.integers(0, len(slots) - 1))
        s = int(slots[p])
        eng.cache.ref[s] = 0
        eng.cache.free.append(s)
        if eng.swa is not None:
            eng.cache.swa_free.append(int(eng.map[s]))
        self.victim = (s, chain(slots, p), variant)

    def on_forward(self, eng, lanes):
        if self.victim is None or self.injected is not None:
            return
        s, near, variant = self.victim
        if (lanes.out[:lanes.num_real] == s).any():
            self.fire(eng, {"FULL": [s], "SWA": swa_of(eng, [s])},
                      {"FULL": near, "SWA": swa_of(eng, near)}, variant=variant, slot=s)


class K3(Fault):
    """Index map: a req_to_token entry of a running request goes wrong (off by one, clipped to
    the last slot, two entries swapped, or a stale slot)."""

    cls = "K3"

    def before_step(self, eng):
        if not self.active:
            return
        r = self.pick(running(eng, min_cached=3, min_left=2))
        if r is None:
            return
        N, row = eng.cfg.num_slots, r.row
        p = int(self.rng.integers(0, r.cached))
        old = int(eng.rtt[row, p])
        variant = str(self.pick(["off by one", "clipped to last slot", "swapped", "stale slot"]))
        q = p
        if variant == "off by one":
            new = old + int(self.pick([-1, 1]))
        elif variant == "clipped to last slot":
            new = N - 1
        elif variant == "swapped":
            q = int(self.pick([i for i in range(r.cached) if i != p]))
            new = int(eng.rtt[row, q])
        else:
            new = int(self.rng.integers(1, N))
        if not 0 < new < N or eng.slot_key[new] == r.keys[p]:
            return  # not a fault: the entry would still name the right content
        eng.rtt[row, p] = new
        if q != p:
            eng.rtt[row, q] = old
        near = chain(eng.rtt[row, :r.cached], [p, q])
        self.fire(eng, {"FULL": [new, old] if q != p else [new], "SWA": swa_of(eng, [new, old])},
                  {"FULL": near, "SWA": swa_of(eng, near)}, variant=variant, position=p, old=old, new=new)


class K4(Fault):
    """Sliding-window translation: a full->SWA map entry inside a request's window names an SWA
    slot holding another request's token, or the SWA slot is freed early and reused."""

    cls, needs = "K4", {"swa_window": lambda c: max(c.swa_window, 16)}
    victim = None

    def before_step(self, eng):
        if not self.active or self.victim is not None:
            return
        r = self.pick(running(eng, min_cached=6, decode=True))
        if r is None:
            return
        w = eng.cfg.swa_window
        p = int(self.rng.integers(max(0, r.cached - w + 1 + eng.cfg.spec_k), r.cached))
        s = int(eng.rtt[r.row, p])
        old = int(eng.map[s])
        near = eng.map[chain(eng.rtt[r.row, :r.cached], p)]
        if self.rng.random() < 0.5:
            others = [o for o in eng.running if o is not r and o.cached > 0]
            o = self.pick(others)
            if o is None:
                return
            new = int(eng.map[eng.rtt[o.row, int(self.rng.integers(0, o.cached))]])
            if eng.swa_key[new] == r.keys[p]:
                return
            eng.map[s] = new
            self.fire(eng, {"SWA": [new]}, {"SWA": np.append(near, new)},
                      variant="map names another request's SWA slot")
        else:
            eng.cache.swa_free.append(old)
            self.victim = (old, near)

    def on_forward(self, eng, lanes):
        if self.victim is None or self.injected is not None:
            return
        if (lanes.swa_out[:lanes.num_real] == self.victim[0]).any():
            self.fire(eng, {"SWA": [self.victim[0]]}, {"SWA": self.victim[1]},
                      variant="SWA slot freed early and reused")
