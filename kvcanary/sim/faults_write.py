"""Fault injectors of issue 43 for the simulated engine: K14, a KV store that never reaches its slot
(skipped, or redirected to the trash slot 0, for one token or for every token of a step, as a CUDA
graph replaying capture-time write positions), and K5b, a late zeroing that wipes a block after its
KV landed (a restored block, or a live block next to a freshly allocated one). See
:mod:`kvcanary.sim.faults` for the protocol."""

from __future__ import annotations

import numpy as np

from .faults import Fault
from .faults_kv import _Reload

TRASH_SLOT = 0  # the pool's padding slot: where CUDA-graph dummy writes go


def _stale(pool, names, slots, old: dict) -> np.ndarray:
    """Bool per slot: the bytes kept (``old``) differ from what the forward just wrote."""
    return np.any([(pool.read(n, slots) != old[n]).any(axis=1) for n in names], axis=0)


def _lane_kind(ln, lane: int) -> str:
    """Whether lane ``lane`` of a step carries a prefill, decode or draft token."""
    i = int(np.searchsorted(ln.start[:len(ln.reqs)], lane, side="right")) - 1
    r = ln.reqs[i]
    return "prefill" if r.cached < r.prompt_len else ("decode" if lane == ln.start[i] else "draft")


class K14(Fault):
    """Lost write: the engine's bookkeeping is right (the canary stamps the token into its slot)
    but the KV store never reaches the slot, which keeps its previous occupant's bytes. The store
    of one half (K, V or both, payload and scales) of the pool's layer is lost: skipped, or
    redirected to the trash slot 0, for one token (prefill, decode, draft, or the SWA group's
    store) or for every token of the step (a graph replaying its capture's write positions).
    ``layers`` 1: the check sees a lost store of every fingerprinted source of a half
    (docs/format.md §7.1; TransformersCanary's default fingerprints one layer)."""

    cls, needs = "K14", {"layers": 1}
    saved = None

    def on_batch(self, eng, ln):
        if not self.active or self.saved is not None:
            return
        real = np.flatnonzero(ln.out[:ln.num_real] > 0)
        if not len(real):
            return
        variant = str(self.pick(["skipped store", "store redirected to the trash slot",
                                 "graph replay: every store of the step to the trash slot"]))
        if variant.startswith("graph"):
            lanes, group = real, "FULL"
        else:
            lanes = real[int(self.rng.integers(len(real))):][:1]
            group = "SWA" if eng.swa is not None and self.rng.random() < 0.3 else "FULL"
        pool, out = (eng.full, ln.out) if group == "FULL" else (eng.swa, ln.swa_out)
        slots = out[lanes].copy()
        slots = slots[slots > 0]
        if not len(slots):
            return
        halves = str(self.pick(["K", "V", "KV"]))
        names = [n for n in pool.specs if n[0] in halves]
        keys = eng.slot_key if group == "FULL" else eng.swa_key
        self.lanes = [_lane_kind(ln, int(i)) for i in lanes]
        self.saved = (group, pool, names, slots, {n: pool.read(n, slots) for n in names}, keys[slots].copy(),
                      variant, halves)

    def on_forward(self, eng, ln):
        if self.saved is None or self.injected is not None:
            return
        group, pool, names, slots, old, old_keys, variant, halves = self.saved
        stale = _stale(pool, names, slots, old)
        for n in names:
            if "trash" in variant:  # the store landed in the trash slot instead (the last one wins)
                pool.write(n, [TRASH_SLOT], pool.read(n, slots[-1:]))
            pool.write(n, slots, old[n])
        keys = eng.slot_key if group == "FULL" else eng.swa_key
        keys[slots] = old_keys
        if stale.any():  # a slot reused by the same content keeps the right bytes: no fault there
            where = halves + (", SWA group" if group == "SWA" else "")
            self.fire(eng, {group: slots[stale]}, variant=f"{variant} ({where})", tokens=int(stale.sum()),
                      lanes=sorted(set(self.lanes)))
        else:
            self.saved = None


class K5b(_Reload):
    """Late zeroing: a block's KV arrives (a host->device restore) and a queued zeroing of "fresh"
    blocks wipes it after it landed; or a zeroer wipes a live block next to a freshly allocated
    one. Bookkeeping and records stay intact; only the bytes are zeros."""

    cls, needs = "K5b", {"offload": True}
    neighbour = None

    def before_step(self, eng):
        if self.neighbour is None:
            self.neighbour = bool(self.rng.random() < 0.5)
        if not self.neighbour:
            super().before_step(eng)

    def spoil(self, eng, x):
        """The restored block (the page of one restored slot) wiped after the copy landed."""
        ps = eng.cfg.page_size
        page = int(x.dst[int(self.rng.integers(x.n))]) // ps
        idx = np.flatnonzero(x.dst // ps == page)
        for k, (nbytes, _, _) in eng.full.specs.items():
            eng.full.write(k, x.dst[idx], np.zeros((len(idx), nbytes), np.uint8))
        return "restored block zeroed after it landed"

    def on_forward(self, eng, ln):
        if not self.active or not self.neighbour or self.injected is not None:
            return
        ps, n = eng.cfg.page_size, eng.cfg.num_slots
        fresh = ln.out[:ln.num_real]
        fresh = fresh[fresh > 0]
        if not len(fresh):
            return
        page = int(fresh[int(self.rng.integers(len(fresh)))]) // ps + int(self.pick([-1, 1]))
        block = np.arange(page * ps, (page + 1) * ps)
        if page < 0 or block[-1] >= n or np.isin(block, ln.out).any():
            return  # no neighbour, or one this step writes (its new stamp would hash the zeros)
        live = block[(block > 0) & (eng.cache.ref[block] > 0)]
        if not len(live):
            return  # nothing live next to it this step: wait for another
        before = {k: eng.full.read(k, live) for k in eng.full.specs}
        for k, (nbytes, _, _) in eng.full.specs.items():
            eng.full.write(k, block, np.zeros((len(block), nbytes), np.uint8))
        wiped = _stale(eng.full, list(eng.full.specs), live, before)
        if wiped.any():
            self.fire(eng, {"FULL": live[wiped]}, variant="neighbouring live block zeroed", slots=int(wiped.sum()))
