"""One fuzz example's state twice: in guarded "device" memory, which the emulated kernels run on
through kvcanary.ops, and as host copies, which the reference runs on (tests only).

The reference is called directly (kvcanary.reference.canary / reference_plan), never through kvcanary.ops
on host arrays: ops rejects hostile host values before anything runs, by design, while the device
path must take them and report. :class:`World` builds both sides from one description (plain
numpy arrays and ints) and compares them: every plan array byte for byte, the canary buffer, the
counters, the write index or claim counter, and the ring rows as a multiset (rows land in any
order on the device; where the ring overflowed, the rows kept are some of the rows found). The
functions at the end run the reference side of each launch kind on the host copies.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

import kvcanary as kc
from kvcanary import abi
from kvcanary.reference import canary as reference
from kvcanary.reference import plan as reference_plan
from kvcanary.reference.canary import RefSource
from tests.support.guarded import Arena

PLAN_ENTRIES = ("slot", "expected_token", "expected_position", "prev_slot")
PLAN_WRITE = ("offsets", "seed", "num_valid_reqs", "entry_offsets", "num_valid", "enable")
BATCH_ARRAYS = ("req_pool_indices", "prefix_lens", "extend_lens", "req_to_token", "input_ids", "positions",
                "out_cache_loc", "expected_pool", "expected_valid_lens", "expected_input_ids", "expected_positions",
                "swa_out_cache_loc")


class World:
    """Guarded device arrays (``dev`` kvcanary views, ``np`` numpy views of the same bytes) and
    their host copies (``ref``), by name."""

    def __init__(self, placement: str):
        self.arena = Arena(placement)
        self.dev, self.np, self.ref = {}, {}, {}
        self.rows: list[np.ndarray] = []   # every row the reference recorded, in its order

    def add(self, name: str, host: np.ndarray, *, align: int | None = None):
        self.dev[name], self.np[name] = self.arena.put(host, align=align)
        self.ref[name] = np.array(host, copy=True)
        return self.dev[name]

    # ---- the canary's state: buffer, sink, sources ---------------------------------------------------
    def context(self, eng: dict, sink: dict, tag: abi.LaunchTag) -> kc.VerifyContext:
        """The verify context of ``eng`` (canary bytes, sources, mode, assert flag) and ``sink``
        (capacity, window mode, start values, ring poison)."""
        canary = self.add("canary", eng["canary"], align=16)
        ring = self.add("ring", sink["ring"])
        counters = [self.add(k, np.array([sink[k]], np.int64)) for k in ("kernel_runs", "slot_runs")]
        self.window = sink["window"]
        if self.window:
            claim = self.add("claim", np.array([sink["start"]], np.int64))
            wi = kc.from_pointer(claim.ptr, (1,), np.int32, device=0)  # the claim's low int32, as the manager hands it
            self.ref["write_index"] = self.ref["claim"].view(np.int32)[:1]
            extra = dict(claim=claim, consumed=self.add("consumed", np.array([sink["consumed"]], np.int64)),
                         skips=self.add("skips", np.array([sink["skips"]], np.int64)))
        else:
            wi, extra = self.add("write_index", np.array([sink["start"]], np.int32)), {}
        self.initial_ring = sink["ring"].copy()
        self.start, self.consumed = sink["start"], sink.get("consumed", 0)
        srcs, self.sources = [], []
        for k, (data, page, bpt, read, pitch) in enumerate(eng["sources"]):
            view, npv = self.arena.put_rows(data, pitch)
            full = np.zeros((data.shape[0], pitch), np.uint8)
            full[:, :data.shape[1]] = data
            self.dev[f"pool{k}"], self.np[f"pool{k}"], self.ref[f"pool{k}"] = view, npv, full[:, :data.shape[1]]
            srcs.append(kc.RealKvSource(view, page, bpt, read))
        flag = self.add("assert_flag", np.array([eng["assert_flag"]], np.int32))
        ctx = kc.VerifyContext(kc.CanaryBuffer(canary), kc.ViolationSink(ring, wi, *counters, **extra), tag, srcs,
                               eng["mode"], chain_position_assert=flag)
        self.sources = [RefSource(self.ref[f"pool{k}"], m.page_size, m.bytes_per_token, m.hash_bytes)
                        for k, m in enumerate(ctx.marshalled)]
        self.tag = int(tag)
        return ctx

    def sink_kw(self) -> dict:
        r = self.ref
        return dict(ring=r["ring"], write_index=r["write_index"], claim=r.get("claim"), consumed=r.get("consumed"))

    def report(self, rows: np.ndarray) -> None:
        """Rows the reference found: appended to its ring as kvc_record does, and remembered."""
        rows = np.asarray(rows, np.int64).reshape(-1, abi.RING_COLS)
        self.rows.append(rows)
        reference.ring_append(rows=rows, **self.sink_kw())

    # ---- plan and batch -----------------------------------------------------------------------------
    def plan(self, max_batch: int, capacity: int, materialize: bool, poison: dict) -> kc.StepPlan:
        """A StepPlan over guarded arrays, each starting as ``poison[name]`` (stale garbage)."""
        names = PLAN_WRITE + (PLAN_ENTRIES if materialize else ())
        arrays = {k: self.add(k, poison[k]) for k in names}
        if not materialize:  # the reference plan builder always fills entries: give it scratch ones
            for k in PLAN_ENTRIES:
                self.ref[k] = poison[k].copy()
        return kc.StepPlan(max_batch, capacity, 0, **arrays)

    def batch(self, b: dict, prefix: str = "") -> kc.Batch:
        """A kc.Batch over guarded copies of ``b``'s arrays (names prefixed by ``prefix``)."""
        kw = {k: self.add(prefix + k, b[k]) for k in BATCH_ARRAYS if b.get(k) is not None}
        return kc.Batch(**kw, expected_token_offset=b.get("expected_token_offset", 0))

    def host_batch(self, prefix: str = "") -> dict:
        return {k: self.ref.get(prefix + k) for k in BATCH_ARRAYS}

    def ref_plans(self):
        r = self.ref
        return (reference_plan.VerifyPlanArrays(*(r[k] for k in ("slot", "expected_token", "expected_position",
                                                                  "prev_slot", "num_valid", "enable"))),
                reference_plan.WritePlanArrays(r["offsets"], r["seed"], r["num_valid_reqs"]))

    # ---- comparisons --------------------------------------------------------------------------------
    def assert_equal(self, *names: str, what: str) -> None:
        for k in names:
            got, want = self.np[k], self.ref[k]
            if not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
                diff = np.flatnonzero(got.reshape(-1) != want.reshape(-1))[:8]
                raise AssertionError(f"{what}: {k} differs from the reference at flat index {diff.tolist()}: "
                                     f"kernel {got.reshape(-1)[diff].tolist()}, reference {want.reshape(-1)[diff].tolist()}")

    def assert_untouched(self, what: str) -> None:
        """Every array but the ring (compared as rows) equals the reference's: nothing a launch
        must not write was written."""
        self.assert_equal(*(k for k in self.np if k != "ring"), what=what)

    def checkpoint(self, *adopt: str) -> None:
        """Start the next launch's comparison from the state now: the ring (already compared) and
        the arrays named in ``adopt`` (results the spec leaves open) take the kernel's bytes."""
        for k in (*adopt, "ring"):
            if k in self.np:
                self.ref[k][...] = self.np[k]
        self.initial_ring = self.np["ring"].copy()
        self.start = int(self.np["claim"][0]) if self.window else int(self.np["write_index"][0])
        self.rows = []

    def ring_positions(self) -> tuple[np.ndarray, int]:
        """Ring rows the reference's rows were stored at, and how many rows it found."""
        n, cap = sum(len(r) for r in self.rows), len(self.initial_ring)
        idx = int(self.start) + np.arange(n, dtype=np.int64)
        if self.window:
            rel = idx - int(self.consumed)
            return idx[(rel >= 0) & (rel < cap)] % cap, n
        idx = (idx + (1 << 31)) % (1 << 32) - (1 << 31)  # int32 write index
        return idx[(idx >= 0) & (idx < cap)], n

    def assert_sink(self, what: str, *, rows_defined: bool = True) -> None:
        """Counters, and unless the rows are left open (``rows_defined`` False: only the launch
        and entry counters must hold), the skip counter, write index or claim and the ring."""
        self.assert_equal("kernel_runs", "slot_runs", what=what)
        if not rows_defined:
            return
        self.assert_equal(*(("claim", "skips") if self.window else ("write_index",)), what=what)
        pos, n = self.ring_positions()
        stored = np.zeros(len(self.initial_ring), bool)
        stored[pos] = True
        got_ring = self.np["ring"]
        if not np.array_equal(got_ring[~stored], self.initial_ring[~stored]):
            raise AssertionError(f"{what}: the kernel wrote ring rows outside the claimed ones {sorted(pos.tolist())}")
        got = Counter(map(tuple, got_ring[pos].tolist()))
        want = Counter(map(tuple, np.concatenate(self.rows).tolist())) if self.rows else Counter()
        extra, missing = got - want, want - got
        if extra or (len(pos) == n and missing):
            raise AssertionError(f"{what}: ring rows differ from the reference ({n} rows found, {len(pos)} stored): "
                                 f"kernel only {list(extra.elements())[:6]}, reference only {list(missing.elements())[:6]}")


def write_conflicts(offsets, seed, num_valid_reqs, out_cache_loc, num_slots) -> tuple[bool, set]:
    """Whether a write launch's result depends on the order its requests run in (docs/format.md §7 leaves it
    unspecified): (a seed slot another request stamps, the slots more than one request stamps)."""
    T = len(out_cache_loc)
    R = min(max(int(num_valid_reqs[0]), 0), len(seed))
    owner: dict[int, set] = {}
    for r in range(R):
        s = int(seed[r])
        if abi.SEED_INVALID < s <= abi.SEED_INVALID + max(abi.BatchField):
            continue
        start = min(max(int(offsets[r]), 0), T)
        end = min(max(int(offsets[r + 1]), start), T)
        for slot in out_cache_loc[start:end].tolist():
            if 0 <= slot < num_slots:
                owner.setdefault(slot, set()).add(r)
    seed_hit = any(0 <= int(seed[r]) < num_slots and owner.get(int(seed[r]), set()) - {r} for r in range(R))
    return seed_hit, {s for s, rs in owner.items() if len(rs) > 1}


# ---- the reference side of each launch --------------------------------------------------------------
def scratch_sink() -> dict:
    return dict(ring=np.zeros((1 << 12, abi.RING_COLS), np.int64), write_index=np.zeros(1, np.int32))


def flush(w: World, scratch: dict) -> None:
    w.report(scratch["ring"][:int(scratch["write_index"][0])])


def ref_requests(b: dict, window: int):
    return reference_plan.requests(b["req_pool_indices"], b["prefix_lens"], b["extend_lens"], b["req_to_token"].shape,
                                   window)


def ref_verify(w: World, check: bool) -> None:
    r, s = w.ref, scratch_sink()
    reference.verify(canary=r["canary"], **{k: r[k] for k in PLAN_ENTRIES}, num_valid=r["num_valid"],
                     enable=r["enable"], kernel_run_counter=r["kernel_runs"], slot_run_counter=r["slot_runs"],
                     sources=w.sources, tag=w.tag, check_expected_token=check, **s)
    flush(w, s)


def ref_fused(w: World, b: dict, window: int, capacity: int, check: bool, offset: int) -> None:
    r = w.ref
    rows, active, skipped = reference_plan.fused_verify_rows(
        canary=r["canary"], q=ref_requests(b, window), entry_offsets=r["entry_offsets"], num_valid=r["num_valid"],
        enable=r["enable"], capacity=capacity, req_to_token=b["req_to_token"], sources=w.sources, tag=w.tag,
        check_expected_token=check, swa_map=r.get("swa_map"), expected_pool=b["expected_pool"],
        expected_valid_lens=b["expected_valid_lens"], expected_token_offset=offset)
    r["kernel_runs"][0] += 1
    if active >= 0:
        r["slot_runs"][0] += active
        if w.window:
            r["skips"][0] += skipped
        w.report(rows)


def ref_expand(w: World, b: dict, window: int, capacity: int, offset: int) -> None:
    r = w.ref
    if int(r["enable"][0]) == 0 or len(b["req_pool_indices"]) == 0:
        return
    active = min(max(int(r["num_valid"][0]), 0), capacity)
    x = reference_plan.entries(ref_requests(b, window), r["entry_offsets"], active, b["req_to_token"], r.get("swa_map"),
                               b["expected_pool"], b["expected_valid_lens"], offset)
    for k, v in (("slot", x.slot), ("prev_slot", x.prev), ("expected_token", x.expected_token),
                 ("expected_position", x.position)):
        r[k][:active] = v


def write_and_check(w: World, ctx, plan, prefix: str, loc: str, what: str) -> None:
    """One kvc_write of the plan's write arrays over the token arrays ``prefix`` + name, checked
    against reference.write as far as docs/format.md §7 defines it."""
    d, r = w.dev, w.ref
    exp = {k: d.get(prefix + k) for k in ("expected_input_ids", "expected_positions")}
    kc.write(ctx, plan, d[prefix + "input_ids"], d[prefix + "positions"], d[prefix + loc], **exp)
    seed_hit, shared = write_conflicts(r["offsets"], r["seed"], r["num_valid_reqs"], r[prefix + loc], len(r["canary"]))
    s = scratch_sink()
    reference.write(canary=r["canary"], offsets=r["offsets"], seed=r["seed"], num_valid_reqs=r["num_valid_reqs"],
                    input_ids=r[prefix + "input_ids"], positions=r[prefix + "positions"], out_cache_loc=r[prefix + loc],
                    expected_input_ids=r.get(prefix + "expected_input_ids"),
                    expected_positions=r.get(prefix + "expected_positions"), chain_position_assert=r["assert_flag"],
                    kernel_run_counter=r["kernel_runs"], slot_run_counter=r["slot_runs"], sources=w.sources,
                    tag=w.tag, **s)
    flush(w, s)
    # A seed slot stamped in the same launch: rows and records depend on the order. So do the
    # lost-write rows (docs/format.md §7.1) of a real slot two requests stamp in a fingerprinting write.
    if seed_hit or (w.sources and shared - {abi.PADDING_SLOT}):
        w.assert_sink(f"{what} (requests write each other's seed or stamped slots)", rows_defined=False)
        w.checkpoint("canary", "write_index", "claim")
        return
    w.assert_sink(what)
    keep = np.ones(len(r["canary"]), bool)
    keep[list(shared)] = False  # slots two requests stamp: either record may stay
    w.np["canary_kept"], w.ref["canary_kept"] = w.np["canary"][keep], r["canary"][keep]
    w.assert_equal("canary_kept", what=what)
    del w.np["canary_kept"], w.ref["canary_kept"]
    w.checkpoint("canary")
