"""Fault injectors that strike while a step's batch is built or run: speculative drafts (K8),
CUDA-graph padding lanes (K9), positions (K11) and input tokens (K13). See
:mod:`kvcanary.sim.faults` for the protocol."""

from __future__ import annotations

import numpy as np

from ..abi import PARTIAL_HASH_BYTES
from .faults import Fault, chain, running


class K8(Fault):
    """Speculative decoding: a draft token's KV write lands in a committed or shared slot, or an
    accepted draft's KV (and canary stamp) is never written."""

    cls, needs = "K8", {"spec_k": lambda c: max(c.spec_k, 2), "spec_accept": 0.8}
    restore = None

    def on_batch(self, eng, ln):
        if not self.active:
            return
        picks = [(i, r) for i, r in enumerate(ln.reqs) if r.cached >= r.prompt_len and ln.extend[i] >= 2
                 and r.cached >= 2 and len(r.tokens) - 1 - r.cached - ln.extend[i] >= 2]
        if not picks:
            return
        i, r = picks[int(self.rng.integers(len(picks)))]
        lo, n = int(ln.start[i]), int(ln.extend[i])
        accepted = int(np.cumprod(ln.tok[lo + 1:lo + n] == r.tokens[r.cached + 1:r.cached + n]).sum())
        if accepted and self.rng.random() < 0.4:  # the draft path skipped the writes it accepted
            lanes = np.arange(lo + 1, lo + 1 + accepted)
            self.restore = (lanes, ln.out[lanes].copy(), ln.swa_out[lanes].copy() if eng.swa is not None else None)
            ln.out[lanes] = -1
            if eng.swa is not None:
                ln.swa_out[lanes] = -1
            slots = self.restore[1]
            succ = np.append(slots, ln.out[lo + 1 + accepted]) if accepted + 1 < n else slots
            self.fire(eng, {"FULL": slots, "SWA": () if eng.swa is None else self.restore[2]},
                      {"FULL": succ}, variant="accepted draft KV left unwritten", lanes=len(lanes))
            return
        j = lo + int(self.rng.integers(1, n))
        shared = [e.slots for e in eng.cache.entries if e.users]
        if shared and self.rng.random() < 0.5:
            src, variant = shared[int(self.rng.integers(len(shared)))], "draft write into a shared prefix slot"
        else:
            src, variant = np.asarray(r.slots[:r.cached], np.int64), "draft write into a committed slot"
        q = int(self.rng.integers(0, len(src)))
        c = int(src[q])
        eng.release([ln.out[j]])  # the allocator handed out c instead of this fresh slot
        ln.out[j] = c
        eng.rtt[r.row, r.cached + j - lo] = c
        self.fire(eng, {"FULL": [c]}, {"FULL": chain(src, q)}, variant=variant)

    def on_forward(self, eng, ln):
        if self.restore is not None:  # the engine still believes those slots hold the drafts
            lanes, out, swa = self.restore
            ln.out[lanes] = out
            if swa is not None:
                ln.swa_out[lanes] = swa
            self.restore = None


class K9(Fault):
    """Padding write: a CUDA-graph padding lane writes its dummy KV into the last slot (index -1)
    or a stale captured slot instead of the padding slot 0."""

    cls, needs = "K9", {"pad_rows": lambda c: max(c.pad_rows, 1)}
    target = None

    def on_batch(self, eng, ln):
        if not self.active or ln.num_real == len(ln.out):
            return
        last = eng.cfg.num_slots - 1
        if eng.cache.ref[last] > 0:
            self.target = (last, "padding lane wrote index -1 (the last slot)")
        else:
            r = self.pick(running(eng, min_cached=2, min_left=2))
            if r is None:
                return
            self.target = (int(r.slots[-1]), "padding lane wrote a stale captured slot")
        ln.out[ln.num_real + int(self.rng.integers(0, len(ln.out) - ln.num_real))] = self.target[0]
        self.before = {k: eng.full.read(k, [self.target[0]]) for k in eng.full.specs}

    def on_forward(self, eng, ln):
        if self.target is None or self.injected is not None:
            return
        s, variant = self.target
        eff = (lambda n: min(PARTIAL_HASH_BYTES, n)) if self.mode == "partial" else (lambda n: n)
        if any((eng.full.read(k, [s])[:, :eff(n)] != self.before[k][:, :eff(n)]).any()
               for k, (n, _, _) in eng.full.specs.items()):
            self.fire(eng, {"FULL": [s]}, variant=variant, slot=s)


class K11(Fault):
    """Position / chunk offset: a prefill chunk (or a decode step) is fed positions off by one,
    so RoPE and the written records use the wrong position."""

    cls = "K11"

    def on_batch(self, eng, ln):
        if not self.active:
            return
        picks = [i for i, r in enumerate(ln.reqs)
                 if r.cached > 0 and len(r.tokens) - 1 - r.cached - ln.extend[i] >= 2]
        i = self.pick(picks)
        if i is None:
            return
        r, lo, n = ln.reqs[i], int(ln.start[i]), int(ln.extend[i])
        ln.pos[lo:lo + n] += int(self.pick([-1, 1]))
        where = "prefill chunk boundary" if r.cached < r.prompt_len else "decode step"
        out = ln.out[lo:lo + n]
        self.fire(eng, {"FULL": out, "SWA": ln.swa_out[lo:lo + n] if eng.swa is not None else ()},
                  variant=f"off by one at a {where}", position=int(ln.exp_pos[lo]))


class K13(Fault):
    """Input token: the model is fed another token than the scheduler's (a sampler swap between
    requests, or a token ring read past its wrap)."""

    cls = "K13"

    def on_batch(self, eng, ln):
        if not self.active:
            return
        picks = [i for i, r in enumerate(ln.reqs) if len(r.tokens) - 1 - r.cached - ln.extend[i] >= 2]
        i = self.pick(picks)
        if i is None:
            return
        r, lo, n = ln.reqs[i], int(ln.start[i]), int(ln.extend[i])
        j = lo + (int(self.rng.integers(0, n)) if r.cached < r.prompt_len else 0)
        others = [int(t) for t in ln.tok[:ln.num_real] if t != ln.tok[j]]
        if others and self.rng.random() < 0.5:
            wrong, variant = self.pick(others), "sampler swap with another request"
        else:
            wrong, variant = int(r.tokens[max(0, int(ln.pos[j]) - 7)]), "token ring read past its wrap"
        if wrong == ln.tok[j]:
            wrong = int(ln.tok[j]) % (eng.cfg.vocab - 1) + 1
        ln.tok[j] = wrong
        later = ln.out[j:lo + n]
        self.fire(eng, {"FULL": later, "SWA": ln.swa_out[j:lo + n] if eng.swa is not None else ()},
                  variant=variant, position=int(ln.pos[j]))
