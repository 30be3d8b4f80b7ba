"""A small simulated paged-KV serving engine that drives a :class:`kvcanary.KvCanary` only the
way a real engine would: ``before_forward(batch)``, the forward's KV writes, ``after_forward``,
and ``sweep`` of idle cached slots.

It has real K/V byte tensors for a few layers (numpy, or kvcanary DeviceArrays on a GPU), a
request pool with ``req_to_token``, a free list (slot 0 reserved for padding writes), radix-style
prefix reuse, chunked prefill, decode, optional speculative drafts, an optional sliding-window
group, FP8-style scales, a host tier (offload and load-back) and CUDA-graph-style padding rows.
A ``fault`` object (see :mod:`kvcanary.sim.faults`) may hook each phase; the engine itself is
correct, so a clean run must report nothing.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from kvcanary.errors import BatchValueError, CanaryViolationError
from kvcanary.manager.canary import KvCanary, PoolGroup
from kvcanary.ops.batch import Batch
from kvcanary.runtime import memory

from .data import Lanes, Read, Req, SimConfig, lane_keys, seq_keys
from .kvpool import Pool, make_specs, sync
from .prefix_cache import Cache


class NoFault:
    """The hooks an engine calls; every one is a no-op here."""

    def before_step(self, eng): pass
    def on_admit(self, eng, tokens, entry, m): return entry, m, (entry.slots[:m] if entry is not None else [])
    def on_batch(self, eng, lanes): pass
    def on_forward(self, eng, lanes): pass
    def on_load(self, eng, xfer): pass
    def observe(self, eng, reads): pass


class Engine:
    """See module docstring. ``backend`` "cpu" (host numpy) or "gpu" (device 0); ``report`` is the
    KvCanary mode ("log" collects rows through the export callback, "raise" from the exception)."""

    def __init__(self, cfg: SimConfig, *, hash_mode: str = "partial", backend: str = "cpu",
                 report: str = "log", fault=None):
        self.cfg, self.fault = cfg, fault or NoFault()
        self.rng = np.random.default_rng(cfg.seed)
        self.device = None if backend == "cpu" else 0
        N, bpt = cfg.num_slots, cfg.bytes_per_token
        self.full = Pool(N, cfg.page_size, make_specs(cfg.layers, bpt, cfg.scales), self.device)
        self.swa = Pool(N, cfg.page_size, make_specs(1, bpt, False, "W"), self.device) if cfg.swa_window else None
        self.map = np.zeros(N, np.int64)              # full -> SWA slot, 0 when none
        self.map_dev = None if self.device is None else _dev(self.map, self.device)
        self.rtt = np.zeros((cfg.max_running + 1, cfg.max_len), np.int32)
        self.pool_tokens = np.zeros((cfg.max_running + 1, cfg.max_len), np.int64)
        self.free_rows = list(range(cfg.max_running, 0, -1))
        self.slot_key = np.zeros(N, np.int64)         # ground truth: identity of each slot's KV
        self.swa_key = np.zeros(N, np.int64)
        self.cache = Cache(self)
        self.running: list[Req] = []
        self.pending: list[tuple[np.ndarray, int]] = []
        self.violations: list[dict] = []
        self.t, self._rid, self._kvsteps, self._sweepsteps = 0, 0, {}, {}
        self.counts: Counter = Counter()  # what the workload exercised (prefix hits, drafts, ...)
        self.system_prompts = [self.rng.integers(1, cfg.vocab, int(self.rng.integers(8, 64)))
                               for _ in range(cfg.num_system_prompts)]
        def group(pool, **kw):
            return PoolGroup(N, k_sources=pool.sources("K"), v_sources=pool.sources("V"), **kw)
        swa = group(self.swa, window=cfg.swa_window, full_to_swa=self.map_dev if self.device is not None
                    else self.map) if self.swa else None
        self.kv = KvCanary(group(self.full), swa, device=self.device, hash_mode=hash_mode, mode=report,
                           max_batch=cfg.max_running + cfg.pad_rows, verify_capacity=cfg.verify_capacity,
                           sweep_capacity=cfg.sweep_capacity, check_expected_token=True,
                           self_test_every=cfg.self_test_every,
                           chain_position_assert=True, export=self._export if report == "log" else None)

    # ---- canary reports --------------------------------------------------------------------------
    def _export(self, rec: dict) -> None:
        if rec.get("type") == "violation":
            # a sweep between steps carries the next step's label (on the device its rows come with
            # that step's snapshot): its own map keeps it on the engine step that swept
            steps = self._sweepsteps if rec["launch_tag"].startswith("SWEEP") else self._kvsteps
            self.violations.append(dict(step=steps.get(rec["step"], self.t), tag=rec["launch_tag"],
                                        group=rec["launch_tag"].rsplit("_", 1)[1], slot=rec["slot_idx"],
                                        position=rec["position"], reasons=rec["fail_reason"]))

    def _canary(self, call, *args, **kw) -> None:
        (self._sweepsteps if call == self.kv.sweep else self._kvsteps)[self.kv.step] = self.t
        try:
            call(*args, **kw)
        except CanaryViolationError as exc:
            for v in exc.violations:
                self._export(dict(v.to_dict(type="violation", step=self.kv.step)))
        except BatchValueError as exc:  # host arrays: rejected before anything ran (the device reports it)
            self._export(dict(type="violation", step=self.kv.step, launch_tag="HEAD_K_FULL", slot_idx=exc.slot,
                              position=exc.request, fail_reason=["batch_index_out_of_range"]))

    def finish(self) -> None:
        """Report everything still in flight (GPU pump) and stop."""
        self._canary(self.kv.flush)

    # ---- allocation --------------------------------------------------------------------------------
    def release(self, slots) -> None:
        """Drop one reference from each slot; slots reaching zero go back with their SWA slots
        (and their map entries are cleared)."""
        slots = np.asarray(slots, np.int64)
        np.add.at(self.cache.ref, slots, -1)
        gone = np.unique(slots[self.cache.ref[slots] == 0])
        self.cache.free.extend(gone.tolist())
        if self.swa is not None:
            swa = self.map[gone]
            self.cache.swa_free.extend(swa[swa > 0].tolist())
            self.map[gone] = 0

    def submit(self, prompt, out_len: int | None = None) -> None:
        """Queue a request (admitted before random arrivals)."""
        lo, hi = self.cfg.output_len
        self.pending.append((np.asarray(prompt, np.int64), out_len or int(self.rng.integers(lo, hi))))

    def _random_prompt(self) -> np.ndarray:
        cfg, rng = self.cfg, self.rng
        n = int(rng.integers(*cfg.prompt_len))
        if rng.random() < cfg.share_prob:
            seen = self.cache.entries + self.cache.host
            if seen and rng.random() < 0.5:  # a follow-up turn of a cached (or offloaded) conversation
                tokens = seen[int(rng.integers(len(seen)))].tokens
                base = tokens[:int(rng.integers(1, len(tokens) + 1))]
            else:
                base = self.system_prompts[int(rng.integers(len(self.system_prompts)))]
            return np.concatenate([base, rng.integers(1, cfg.vocab, max(1, n - len(base)))])[:cfg.max_len // 2]
        return rng.integers(1, cfg.vocab, n)

    def _admit(self) -> None:
        cfg = self.cfg
        for _ in range(cfg.admit_per_step + len(self.pending)):
            if len(self.running) >= cfg.max_running or not self.free_rows:
                return
            prompt, out_len = self.pending.pop(0) if self.pending else (self._random_prompt(), None)
            out_len = out_len or int(self.rng.integers(*cfg.output_len))
            tokens = np.concatenate([prompt, self.rng.integers(1, cfg.vocab, out_len)])[:cfg.max_len]
            entry, m = self.cache.match(tokens, len(prompt) - 1)
            entry, m, slots = self.fault.on_admit(self, tokens, entry, m)
            need = len(tokens) - m + cfg.spec_k + sum(len(r.tokens) - r.cached + cfg.spec_k for r in self.running)
            if not self.cache.reserve(need, keep=entry):
                self.pending.insert(0, (prompt, out_len))
                return
            row = self.free_rows.pop()
            self._rid += 1
            req = Req(self._rid, row, tokens, seq_keys(tokens), len(prompt), m,
                      np.asarray(slots, np.int64).tolist(), entry)
            self.rtt[row, :m] = slots
            self.pool_tokens[row, :len(tokens)] = tokens
            np.add.at(self.cache.ref, np.asarray(slots, np.int64), 1)
            self.counts["requests"] += 1
            self.counts["prefix_hit_tokens"] += m
            if entry is not None:
                entry.users += 1
                entry.last = self.t
            self.running.append(req)

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> None:
        self.fault.before_step(self)
        self._admit()
        lanes = self._schedule()
        self.fault.on_batch(self, lanes)
        batch = self._batch(lanes)
        self._canary(self.kv.before_forward, batch)
        self._forward(lanes)
        self.fault.on_forward(self, lanes)
        self._upload()
        self.fault.observe(self, lanes.reads)
        self._canary(self.kv.after_forward, batch)
        for land in self.cache.late:
            land()
        if self.cache.late:
            self.cache.late.clear()
            self._upload()
        self._commit(lanes)
        if self.cfg.sweep_every and self.t % self.cfg.sweep_every == self.cfg.sweep_every - 1:
            self.cache.sweep()
        self.t += 1

    def _schedule(self) -> Lanes:
        cfg, rng = self.cfg, self.rng
        cols = {k: [] for k in ("tok", "pos", "out", "swa_out", "key")}
        start, extend, reads = [], [], []
        for r in self.running:
            c = r.cached
            if c < r.prompt_len:
                toks = r.tokens[c:min(r.prompt_len, c + cfg.chunk)]
                self.counts["prefill_chunks"] += 1
            else:
                k = max(0, min(cfg.spec_k, len(r.tokens) - 2 - c))
                truth = r.tokens[c + 1:c + 1 + k]
                guess = np.where(rng.random(k) < cfg.spec_accept, truth, rng.integers(1, cfg.vocab, k))
                toks = np.concatenate([r.tokens[c:c + 1], guess])
            n = len(toks)
            slots = self.cache.alloc(n)
            self.rtt[r.row, c:c + n] = slots
            start.append(len(cols["tok"]))
            extend.append(n)
            cols["tok"] += toks.tolist()
            cols["pos"] += range(c, c + n)
            cols["out"] += slots.tolist()
            cols["key"] += seq_keys(toks, int(r.keys[c - 1]) if c else 0, c).tolist()
            if self.swa is not None:
                swa = self.cache.alloc_swa(n)
                self.map[slots] = swa
                cols["swa_out"] += swa.tolist()
            reads += self._reads(r)
        real = len(cols["tok"])
        pad = cfg.pad_rows
        arr = {k: np.asarray(v + [0] * pad, np.int64) for k, v in cols.items() if k != "swa_out"}
        arr["swa_out"] = np.asarray(cols["swa_out"] + [0] * pad if self.swa is not None else [], np.int64)
        zeros = [0] * pad
        return Lanes(list(self.running), np.asarray([r.row for r in self.running] + zeros, np.int64),
                     np.asarray([r.cached for r in self.running] + zeros, np.int64),
                     np.asarray(extend + zeros, np.int64), arr["tok"], arr["pos"].copy(), arr["tok"].copy(),
                     arr["pos"], arr["out"], arr["swa_out"], arr["key"],
                     np.asarray(start + [real] * pad, np.int64), real, reads)

    def _reads(self, r: Req) -> list[Read]:
        """What the request's attention reads this step: its cached prefix through req_to_token."""
        p = r.cached
        pos = np.arange(p)
        slots = self.rtt[r.row, :p].astype(np.int64)
        out = [Read("FULL", "step", slots, pos, r.tokens[:p], r.keys[:p])]
        if self.swa is not None:
            lo = max(0, p - self.cfg.swa_window)
            out.append(Read("SWA", "step", self.map[slots[lo:]], pos[lo:], r.tokens[lo:p], r.keys[lo:p]))
        return out

    def _batch(self, ln: Lanes):
        # the step's batch is fixed here (a copy): later changes to the engine's lanes are not seen
        d = (lambda a: np.array(a)) if self.device is None else (lambda a: _dev(a, self.device))
        sync(self.device)  # the previous step's launches may still read arrays about to be replaced
        if self.map_dev is not None:
            self.map_dev.copy_from_host(self.map)
        return Batch(req_pool_indices=d(ln.rows), prefix_lens=d(ln.prefix), extend_lens=d(ln.extend),
                     req_to_token=d(self.rtt), input_ids=d(ln.tok), positions=d(ln.pos),
                     out_cache_loc=d(ln.out), expected_pool=d(self.pool_tokens),
                     expected_valid_lens=d(ln.prefix), expected_input_ids=d(ln.exp_tok),
                     expected_positions=d(ln.exp_pos),
                     swa_out_cache_loc=d(ln.swa_out) if self.swa is not None else None)

    def _forward(self, ln: Lanes) -> None:
        """The model's KV writes: every lane (padding lanes too) writes its token's KV."""
        ok = ln.out >= 0
        keys = lane_keys(ln)
        self.full.write_tokens(ln.out[ok], ln.tok[ok], ln.pos[ok])
        self.slot_key[ln.out[ok]] = keys[ok]
        if self.swa is not None:
            ok = ln.swa_out >= 0
            self.swa.write_tokens(ln.swa_out[ok], ln.tok[ok], ln.pos[ok])
            self.swa_key[ln.swa_out[ok]] = keys[ok]

    def _upload(self) -> None:
        self.full.upload()
        if self.swa is not None:
            self.swa.upload()

    def _commit(self, ln: Lanes) -> None:
        """Accept drafts, free rejected draft slots, finish requests (their prefix is cached)."""
        for i, r in enumerate(ln.reqs):
            lo, n = int(ln.start[i]), int(ln.extend[i])
            out = ln.out[lo:lo + n]
            keep = n
            if r.cached >= r.prompt_len and n > 1:  # decode with drafts: accept the matching prefix
                ok = ln.tok[lo + 1:lo + n] == r.tokens[r.cached + 1:r.cached + n]
                keep = 1 + int(np.cumprod(ok).sum())
                self.counts["drafts_accepted"] += keep - 1
                self.counts["drafts_rejected"] += n - keep
                self.release(out[keep:])
            r.slots += out[:keep].tolist()
            r.cached += keep
            if r.done:
                self.counts["finished"] += 1
                self.running.remove(r)
                self.cache.insert(r)
                self.release(r.slots)
                if r.entry is not None:
                    r.entry.users -= 1
                self.free_rows.append(r.row)

    def stats(self) -> dict:
        return self.kv.stats()


def _dev(host: np.ndarray, device: int):
    return memory.to_device(np.ascontiguousarray(host), device)
