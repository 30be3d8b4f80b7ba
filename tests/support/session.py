"""A scripted serving session that drives KvCanary the way an engine does, on host or device.

Requests: prefill, chunked prefill with a cached prefix, shared prefixes, decode, finish and slot
reuse, an optional SWA group. ``corrupt`` hooks let a test break one thing at one step.
"""

from __future__ import annotations

import numpy as np

import kvcanary as kc
from kvcanary import abi
from kvcanary.manager.canary import KvCanary, PoolGroup
from kvcanary.reference import plan as reference_plan

N, ROWS, MAXLEN, BYTES = 512, 8, 64, 64


class Session:
    def __init__(self, device=None, *, swa=False, hash_mode="partial", mode="log", **kw):
        self.device, self.records = device, []
        self.rng = np.random.default_rng(0)
        self.k = [np.zeros((N, BYTES), np.uint8) for _ in range(2)]
        self.v = [np.zeros((N, BYTES), np.uint8) for _ in range(2)]
        self.dk = [self._dev(a) for a in self.k]
        self.dv = [self._dev(a) for a in self.v]
        self.rtt = np.zeros((ROWS, MAXLEN), np.int32)
        self.lens = {}      # row -> tokens in cache
        self.tokens = {}    # row -> token ids
        self.free = list(range(1, N))
        self.swa_map = np.arange(N, dtype=np.int64)[::-1].copy()  # full slot s -> SWA slot N-1-s
        self.swa_map[0] = 0
        src = lambda pools: [kc.RealKvSource(p, 1, BYTES) for p in pools]  # noqa: E731
        full = PoolGroup(N, src(self.dk), src(self.dv))
        swa_group = PoolGroup(N, src(self.dk), src(self.dv), window=4, full_to_swa=self._dev(self.swa_map)) if swa else None
        self.canary = KvCanary(full, swa_group, device=device, hash_mode=hash_mode, mode=mode, max_batch=8,
                               verify_capacity=4096, export=self.records.append, **kw)
        self.step_no = 0

    def _dev(self, a):
        if self.device is None:
            return a
        from kvcanary.runtime import memory
        return memory.to_device(a, self.device)

    def _kv(self, token, pos, layer):
        g = np.random.default_rng([int(token), int(pos), layer])
        return g.integers(0, 256, BYTES, dtype=np.uint8)

    def step(self, work, *, corrupt=None):
        """work: list of (row, new token ids). Runs HEAD, the forward (KV writes), TAIL."""
        arrays = self.plan_step(work, corrupt=corrupt)
        B = self._dev
        swa_loc = self.swa_map[arrays["loc"]]
        batch = kc.Batch(B(arrays["rows"]), B(arrays["prefix"]), B(arrays["extend"]), B(self.rtt.copy()),
                         B(arrays["ids"]), B(arrays["pos"]), B(arrays["loc"]), swa_out_cache_loc=B(swa_loc))
        self.canary.before_forward(batch)
        self.forward(arrays)
        self.canary.after_forward(batch)
        self.step_no += 1
        return batch

    def forward(self, arrays):
        """The model's forward: the new tokens' K and V bytes land in the pools, at their full slot
        and, with an SWA group, at their SWA slot too (the SWA group fingerprints the same arrays
        through its map; a store that never lands there is a lost write, K14)."""
        swa = "SWA" in self.canary.groups
        for t, p_, s in zip(arrays["ids"], arrays["pos"], arrays["loc"]):
            for layer in range(2):
                for slot in ((s, self.swa_map[s]) if swa else (s,)):
                    self.k[layer][slot] = self._kv(t, p_, layer)
                    self.v[layer][slot] = self._kv(t, p_, layer + 7)
        self.sync_pools()

    def plan_step(self, work, *, corrupt=None) -> dict:
        """The engine's bookkeeping of one step: slots from the free list, req_to_token, lengths."""
        rows, prefix, extend, ids, pos, loc = [], [], [], [], [], []
        for row, new in work:
            p = self.lens.get(row, 0)
            rows.append(row); prefix.append(p); extend.append(len(new))
            for j, t in enumerate(new):
                s = self.free.pop(0)
                self.rtt[row, p + j] = s
                ids.append(t); pos.append(p + j); loc.append(s)
            self.lens[row] = p + len(new)
            self.tokens.setdefault(row, []).extend(new)
        arrays = dict(rows=np.array(rows, np.int64), prefix=np.array(prefix, np.int64),
                      extend=np.array(extend, np.int64), ids=np.array(ids, np.int64),
                      pos=np.array(pos, np.int64), loc=np.array(loc, np.int64))
        if corrupt:
            corrupt(self, arrays)
        return arrays

    def sync_pools(self):
        if self.device is not None:
            for h, d in zip(self.k + self.v, self.dk + self.dv):
                d.copy_from_host(h)

    def share_prefix(self, src_row, dst_row, n):
        """Radix reuse: dst_row starts with src_row's first n cached tokens (same slots)."""
        self.rtt[dst_row, :n] = self.rtt[src_row, :n]
        self.lens[dst_row] = n
        self.tokens[dst_row] = list(self.tokens[src_row][:n])

    def finish(self, row, keep=0):
        for pos in range(keep, self.lens[row]):
            self.free.append(int(self.rtt[row, pos]))
        del self.lens[row]

    def play(self, corrupt_at=None, corrupt=None, step=None, stop_after=None):
        """Drive :data:`SCRIPT`: shares and finishes here, each engine step through
        ``step(work, corrupt)`` (default :meth:`step`), ``corrupt`` given to step ``corrupt_at``
        only; return right after step ``stop_after`` when given."""
        step = step or (lambda work, c: self.step(work, corrupt=c))
        k = 0
        for item in SCRIPT:
            if item == "share":
                self.share_prefix(1, 3, 6)
            elif item == "finish":
                self.finish(1, keep=6)  # the first 6 slots stay cached (shared with C)
            else:
                step(item, corrupt if k == corrupt_at else None)
                if k == stop_after:
                    return
                k += 1

    def script(self, corrupt_at=None, corrupt=None):
        """The standard session (:data:`SCRIPT`); ``corrupt`` is applied to step ``corrupt_at``."""
        self.play(corrupt_at, corrupt)
        self.canary.flush()
        return self.records


def violation_key(records) -> list:
    """The violation records of a canary's export, sorted (device rows land in any order)."""
    return sorted((r["step"], r["launch_tag"], r["slot_idx"], r["position"], r["fail_reason_bits"],
                   r["stored_chain_hash"], r["expected_aux"]) for r in records if r["type"] == "violation")


def host_buffers(canary) -> dict:
    """Every canary buffer of ``canary`` as host numpy, by (stage, group, half)."""
    out = {}
    for name, ctx in canary.ctx.items():
        arr = ctx.buffer.array
        out[name[:3]] = arr if isinstance(arr, np.ndarray) else arr.numpy()
    return out


SCRIPT = [
    [(1, list(range(100, 112)))],                                  # prefill A
    [(1, [112]), (2, list(range(200, 208)))],                      # decode A, chunk 1 of B
    [(1, [113]), (2, list(range(208, 214)))],                      # chunk 2 of B (cached prefix)
    "share",                                                        # C shares A's first 6
    [(1, [114]), (2, [214]), (3, [300, 301, 302, 303])],
    "finish",                                                       # A done, D reuses row 1
    [(2, [215]), (3, [304]), (1, [400, 401, 402])],
    [(2, [216]), (3, [305]), (1, [403])],
    [(2, [217]), (3, [306]), (1, [404])],
]


def host_plan(batch, kw, cap, max_batch=80):
    """The reference plan builder run directly on the batch (no host validation: the batch holds
    values the device must handle), with the rows it reports."""
    plan, rows = kc.StepPlan.allocate(max_batch, cap), []
    reference_plan.fill_plan(
        verify=reference_plan.VerifyPlanArrays(plan.slot, plan.expected_token, plan.expected_position,
                                               plan.prev_slot, plan.num_valid, plan.enable),
        write=reference_plan.WritePlanArrays(plan.offsets, plan.seed, plan.num_valid_reqs),
        entry_offsets=plan.entry_offsets, report=rows.append, tag=int(abi.LaunchTag.HEAD_K_FULL),
        **batch, **kw)
    return plan, sorted(map(tuple, np.concatenate(rows).tolist()))
