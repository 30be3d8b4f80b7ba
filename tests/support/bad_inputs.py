"""The rows of tests/test_bad_inputs.py: ``ROWS`` is a list of ``(id, action, expected)``.

``id`` starts with the area of the public API (``KvCanary.``, ``step.``, ``ops.`` ...); ``action``
builds or does the thing on host numpy arrays; ``expected`` is ``ERR``, ``TYPE``, ``OK`` or a
``Report``. Every action builds its own arrays (no row can leak state into another).
"""

from __future__ import annotations

import atexit
import os
import pathlib
import shutil
import tempfile
from dataclasses import dataclass

import numpy as np

import kvcanary as kc
from kvcanary import FailReason, HashMode, KvCanary, PoolGroup
from kvcanary.errors import ValidationError, ValidationTypeError
from kvcanary.ops import prepare_build_plan, prepare_fused_verify, prepare_verify, prepare_write

ERR, TYPE, OK = ValidationError, ValidationTypeError, "accepted"


@dataclass(frozen=True)
class Report:
    reasons: frozenset

    def __init__(self, *reasons: str):
        object.__setattr__(self, "reasons", frozenset(reasons))


ROWS: list[tuple[str, object, object]] = []


def row(rid: str, expected, action) -> None:
    ROWS.append((rid, action, expected))


def rows(prefix: str, build, cases) -> None:
    """One row per ``(label, value, expected)``: ``build(value)`` is the action."""
    for label, value, expected in cases:
        row(f"{prefix}={label}", expected, lambda v=value: build(v))


TMP = tempfile.mkdtemp(prefix="kvcanary-bad-inputs-")
atexit.register(shutil.rmtree, TMP, ignore_errors=True)

# ---- fixtures: a 64-slot pool, a canary, a prefill and a decode batch ----------------------------------
N = 64


def pool(slots=N, width=64, dtype=np.uint8):
    """A pool holding KV (nonzero bytes): the rows stamp tokens without a forward, and stamping a
    token over never-written zero KV is a lost write (K14, docs/format.md §7.1)."""
    raw = np.random.default_rng([slots, width]).integers(1, 256, (slots, width * np.dtype(dtype).itemsize), np.uint8)
    return raw.view(dtype)


def pages_pool():
    return np.zeros((4, 16, 32), np.uint8)  # [pages, page_size, bytes]


def src():
    return kc.source_from_slots(pool())


def group(num_slots=N, **kw):
    kw.setdefault("k_sources", [src()])
    kw.setdefault("v_sources", [src()])
    return PoolGroup(num_slots, **kw)


def canary(full=None, swa=None, **kw):
    kw = {"max_batch": 4, "verify_capacity": 256, **kw}
    return KvCanary(group() if full is None else full, swa, **kw)


def rtt(**cells):
    a = np.zeros((4, 16), np.int32)
    a[1, :4], a[2, :3] = [5, 6, 7, 8], [9, 10, 11]
    for key, value in cells.items():  # "r1p2": row 1, position 2
        a[int(key[1]), int(key[3:])] = value
    return a


def i64(*values):
    return np.array(values, np.int64)


def prefill(**over):
    """Request row 1 writes 3 tokens (slots 5, 6, 7), row 2 writes 2 (slots 9, 10)."""
    d = dict(req_pool_indices=i64(1, 2), prefix_lens=i64(0, 0), extend_lens=i64(3, 2), req_to_token=rtt(),
             input_ids=i64(100, 101, 102, 103, 104), positions=i64(0, 1, 2, 0, 1), out_cache_loc=i64(5, 6, 7, 9, 10))
    d.update(over)
    return kc.Batch(**d)


def decode(**over):
    """The next step: one token each (row 1 -> slot 8 at position 3, row 2 -> slot 11 at position 2)."""
    d = dict(req_pool_indices=i64(1, 2), prefix_lens=i64(3, 2), extend_lens=i64(1, 1), req_to_token=rtt(),
             input_ids=i64(105, 106), positions=i64(3, 2), out_cache_loc=i64(8, 11))
    d.update(over)
    return kc.Batch(**d)


def step(c, *batches):
    for b in batches:
        c.before_forward(b)
        c.after_forward(b)
    c.flush()
    return c


def prefill_step(**over):
    return step(canary(mode="raise"), prefill(**over))


def decode_step(c=None, **over):
    c = c or step(canary(mode="raise"), prefill())
    return step(c, decode(**over))


def stamped(**kw):
    return step(canary(mode="raise", **kw), prefill())


def ctx(**kw):
    return kc.VerifyContext(kc.CanaryBuffer.allocate(N), kc.ViolationSink.allocate(16), **kw)


def plan(max_batch=4, capacity=64):
    return kc.StepPlan.allocate(max_batch, capacity)


def readonly(a):
    a.setflags(write=False)
    return a


def flip_kv(c):
    c.groups["FULL"].k_sources[0].tensor.host[6, 3] ^= 0x10  # slot 6's first 16 bytes (PARTIAL reads them)
    return c


INTS = [("0", 0, ERR), ("-1", -1, ERR), ("1.5", 1.5, TYPE), ("'8'", "8", TYPE), ("True", True, TYPE),
        ("None", None, TYPE)]
BOOLS = [("1", 1, TYPE), ("'yes'", "yes", TYPE), ("None", None, TYPE), ("np.True_", np.True_, OK), ("False", False, OK)]

# ---- KvCanary ------------------------------------------------------------------------------------------
for name, extra in [("max_batch", [("2**24+1", 2**24 + 1, ERR), ("np.int32(4)", np.int32(4), OK), ("1", 1, OK)]),
                    ("verify_capacity", [("2**31", 2**31, ERR), ("np.int64(16)", np.int64(16), OK)]),
                    ("ring_capacity", [("2**31+8", 2**31 + 8, ERR), ("2**24+1", 2**24 + 1, ERR), ("1", 1, OK)]),
                    ("sweep_capacity", [("2**31", 2**31, ERR), ("8", 8, OK)])]:
    rows(f"KvCanary.{name}", lambda v, n=name: canary(**{n: v}), INTS + extra)
rows("KvCanary.stats_every", lambda v: canary(stats_every=v),
     [("-1", -1, ERR), ("1.5", 1.5, TYPE), ("'1'", "1", TYPE), ("0", 0, OK), ("10", 10, OK)])
rows("KvCanary.device", lambda v: canary(device=v),
     [("'cpu'", "cpu", TYPE), ("'cuda:0'", "cuda:0", TYPE), ("-1", -1, ERR), ("True", True, TYPE), ("1.5", 1.5, TYPE),
      ("None", None, OK)])
rows("KvCanary.hash_mode", lambda v: canary(hash_mode=v),
     [("'PARTIAL'", "PARTIAL", OK), ("'All'", "All", OK), ("'none'", "none", OK), ("HashMode.ALL", HashMode.ALL, OK),
      ("'x'", "x", ERR), ("''", "", ERR), ("'partial '", "partial ", ERR), ("1", 1, TYPE), ("None", None, TYPE),
      ("True", True, TYPE), ("FailReason", FailReason(1), TYPE)])
rows("KvCanary.mode", lambda v: canary(mode=v),
     [("'LOG'", "LOG", OK), ("'raise'", "raise", OK), ("'none'", "none", OK), ("'warn'", "warn", ERR), ("''", "", ERR),
      ("None", None, TYPE), ("1", 1, TYPE)])
for name in ("check_expected_token", "chain_position_assert", "fused"):
    rows(f"KvCanary.{name}", lambda v, n=name: canary(**{n: v}), BOOLS)
rows("KvCanary.export", lambda v: canary(export=v),
     [("/proc", "/proc/x.jsonl", ERR), ("no-folder", "/nonexistent-kvcanary/x.jsonl", ERR), ("a-folder", TMP, ERR),
      ("''", "", ERR), ("42", 42, TYPE), ("bytes", b"/tmp/x.jsonl", TYPE), ("a-file", os.path.join(TMP, "e.jsonl"), OK),
      ("Path", pathlib.Path(TMP) / "p.jsonl", OK), ("/dev/full", "/dev/full", OK), ("callable", print, OK),
      ("None", None, OK)])
rows("KvCanary.full", lambda v: KvCanary(v), [("None", None, TYPE), ("'x'", "x", TYPE), ("64", 64, TYPE)])
row("KvCanary.full=list-of-sources", TYPE, lambda: KvCanary([src()]))
row("KvCanary.full=more-slots-than-sources", ERR, lambda: canary(full=group(num_slots=128)))
row("KvCanary.full=2**40-slots", ERR, lambda: canary(full=group(num_slots=2**40, k_sources=(), v_sources=()),
                                                   hash_mode="none"))
row("KvCanary.full=window", ERR, lambda: canary(full=group(window=4)))
row("KvCanary.swa='x'", TYPE, lambda: canary(swa="x"))
row("KvCanary.swa=no-map", ERR, lambda: canary(swa=group(window=4)))
row("KvCanary.swa=map-int32", TYPE, lambda: canary(swa=group(window=4, full_to_swa=np.arange(N, dtype=np.int32))))
row("KvCanary.swa=map-list", TYPE, lambda: canary(swa=group(window=4, full_to_swa=list(range(N)))))
row("KvCanary.swa=map-2d", ERR, lambda: canary(swa=group(window=4, full_to_swa=np.zeros((N, 2), np.int64))))
row("KvCanary.swa=ok", OK, lambda: canary(swa=group(window=4, full_to_swa=np.arange(N, dtype=np.int64))))

# ---- PoolGroup -----------------------------------------------------------------------------------------
rows("PoolGroup.num_slots", lambda v: PoolGroup(v), INTS + [("2**41", 2**41, ERR), ("np.int64", np.int64(64), OK)])
rows("PoolGroup.window", lambda v: PoolGroup(N, window=v),
     [("-1", -1, ERR), ("1.5", 1.5, TYPE), ("2**31", 2**31, ERR), ("'4'", "4", TYPE), ("8", 8, OK)])
rows("PoolGroup.halves", lambda v: PoolGroup(N, halves=v),
     [("X", ("X",), ERR), ("KK", ("K", "K"), ERR), ("()", (), ERR), ("'KV'", "KV", ERR), ("5", 5, TYPE),
      ("K-None", ("K", None), TYPE), ("list", ["K", "V"], OK), ("'K'", "K", OK), ("None", None, OK)])
rows("PoolGroup.k_sources", lambda v: PoolGroup(N, k_sources=v),
     [("None", None, TYPE), ("array", pool(), TYPE), ("[array]", [pool()], TYPE), ("'abc'", "abc", TYPE),
      ("[]", [], OK)])
row("PoolGroup.k_sources=bare-source", TYPE, lambda: PoolGroup(N, k_sources=src()))
row("PoolGroup.v_sources=None", TYPE, lambda: PoolGroup(N, k_sources=[src()], v_sources=None))
row("PoolGroup.v_sources=unused-half", ERR, lambda: PoolGroup(N, [src()], [src()], halves=("K",)))
row("PoolGroup.sources=65", ERR, lambda: canary(full=group(k_sources=[src()] * 65)))
row("PoolGroup.sources=tuple", OK, lambda: canary(full=group(k_sources=(src(),), v_sources=(src(),))))

# ---- the step API: before_forward / after_forward ---------------------------------------------------------
for what in ("None", "dict", "str"):
    value = {"None": None, "dict": {}, "str": "batch"}[what]
    row(f"step.before_forward({what})", TYPE, lambda v=value: canary().before_forward(v))
    row(f"step.after_forward({what})", TYPE, lambda v=value: canary().after_forward(v))
row("step.before_forward(None)-mode-none", TYPE, lambda: canary(mode="none").before_forward(None))
row("step.before_forward(batch-dict)", TYPE, lambda: canary().before_forward(prefill().__dict__))
row("step.clean-prefill-then-decode", OK, lambda: decode_step())
for field_name, cases in {
    "req_pool_indices": [("None", None, TYPE), ("list", [1, 2], TYPE), ("int32", np.array([1, 2], np.int32), TYPE),
                         ("float", np.array([1.0, 2.0]), TYPE), ("2d", i64(1, 2)[None], ERR),
                         ("strided", i64(1, 0, 2, 0)[::2], ERR)],
    "prefix_lens": [("shape3", i64(0, 0, 0), ERR), ("int32", np.zeros(2, np.int32), TYPE), ("None", None, TYPE)],
    "extend_lens": [("int32", np.array([3, 2], np.int32), TYPE), ("shape1", i64(5), ERR)],
    "req_to_token": [("int64", rtt().astype(np.int64), TYPE), ("1d", rtt()[1], ERR), ("strided", np.zeros((4, 32),
                     np.int32)[:, ::2], ERR), ("None", None, TYPE), ("3d", rtt()[None], ERR), ("list", [[0]], TYPE)],
    "input_ids": [("short", i64(1, 2, 3, 4), ERR), ("float", np.zeros(5), TYPE), ("2d", np.zeros((5, 1), np.int64), ERR)],
    "positions": [("float", np.zeros(5), TYPE), ("long", np.zeros(6, np.int64), ERR)],
    "out_cache_loc": [("None", None, ERR), ("2d", np.zeros((5, 1), np.int64), ERR), ("uint64", np.zeros(5, np.uint64),
                      TYPE), ("readonly", readonly(i64(5, 6, 7, 9, 10)), OK)],
    "expected_input_ids": [("alone", i64(100, 101, 102, 103, 104), ERR)],
    "expected_token_offset": [("2**64+1", 2**64 + 1, ERR), ("2**62+1", 2**62 + 1, ERR), ("1.5", 1.5, TYPE),
                              ("'1'", "1", TYPE), ("None", None, TYPE), ("np.int64", np.int64(1), OK), ("-1", -1, OK)],
    "expected_pool": [("int32", np.zeros((4, 16), np.int32), TYPE), ("1d", np.zeros(16, np.int64), ERR)],
}.items():
    rows(f"step.batch.{field_name}", lambda v, f=field_name: prefill_step(**{f: v}), cases)
row("step.batch.expected_valid_lens=shape3", ERR, lambda: prefill_step(expected_pool=np.zeros((4, 16), np.int64),
                                                                      expected_valid_lens=i64(1, 1, 1)))
row("step.batch.expected_positions=alone", ERR, lambda: prefill_step(expected_positions=i64(0, 1, 2, 0, 1)))
row("step.batch.bs>max_batch", ERR, lambda: step(canary(max_batch=1), prefill()))
# values on host arrays the kernels would report as BATCH_INDEX_OUT_OF_RANGE: rejected before any launch
for label, over in {
    "row=rows": dict(req_pool_indices=i64(1, 4)), "row=-1": dict(req_pool_indices=i64(-1, 2)),
    "row=2**40": dict(req_pool_indices=i64(1, 2**40)), "padding-first": dict(req_pool_indices=i64(0, 2)),
    "prefix=-1": dict(prefix_lens=i64(-1, 0)), "prefix>max_len": dict(prefix_lens=i64(17, 0)),
    "extend=-1": dict(extend_lens=i64(3, -1), input_ids=i64(1, 2, 3), positions=i64(0, 1, 2), out_cache_loc=i64(5, 6, 7)),
    "T<sum(extend)": dict(extend_lens=i64(3, 3)), "token-past-sum": dict(extend_lens=i64(3, 1)),
    "extend-overflows-int64": dict(extend_lens=i64(2**63 - 1, 2)), "extend-sum-wraps": dict(extend_lens=i64(2**62, 2**62)),
    "extend=2**62": dict(extend_lens=i64(2**62, 2)),
}.items():
    row(f"step.values.{label}", ERR, lambda o=over: prefill_step(**o))
row("step.values.padding-last", OK, lambda: prefill_step(req_pool_indices=i64(1, 0), extend_lens=i64(3, 0),
                                                         out_cache_loc=i64(5, 6, 7, -1, -1)))
row("step.values.padding-tokens-0", OK, lambda: prefill_step(req_pool_indices=i64(1, 0), extend_lens=i64(3, 0),
                                                             out_cache_loc=i64(5, 6, 7, 0, 0)))
row("step.values.skipped-token", OK, lambda: prefill_step(out_cache_loc=i64(5, -1, 7, 9, 10)))
row("step.values.huge-token-id", OK, lambda: prefill_step(input_ids=i64(2**62, -5, 0, 1, 2)))
row("step.values.prefill-past-max-len", OK, lambda: step(canary(mode="raise"), prefill(req_to_token=np.zeros((4, 2),
                                                                                                             np.int32))))
row("step.values.prefix>max_len-next-step", ERR, lambda: decode_step(req_to_token=np.zeros((4, 2), np.int32)))
# values only the kernels see (req_to_token entries, slots, tokens): reported, never raised
for label, over, reasons in [
    ("rtt-slot>=num_slots", dict(req_to_token=rtt(r1p1=99)), ("slot_out_of_range",)),
    ("rtt-slot-negative", dict(req_to_token=rtt(r1p1=-7)), ("slot_out_of_range",)),
    ("rtt-slot-int32-max", dict(req_to_token=rtt(r2p0=2**31 - 1)), ("slot_out_of_range",)),
    ("rtt-slot-0-in-prefix", dict(req_to_token=rtt(r1p1=0)), ("padding_slot_read",)),
    ("rtt-other-requests-slot", dict(req_to_token=rtt(r1p1=9)), ("verify_position", "verify_chain_hash")),
    ("rtt-two-slots-swapped", dict(req_to_token=rtt(r1p0=6, r1p1=5)), ("verify_position", "verify_chain_hash")),
    ("stale-slot-never-written", dict(req_to_token=rtt(r2p1=40)), ("verify_position", "verify_chain_hash")),
    ("wrong-prefix-len", dict(prefix_lens=i64(4, 2), positions=i64(4, 2)), ("verify_position", "verify_chain_hash")),
]:
    row(f"step.report.{label}", Report(*reasons), lambda o=over: decode_step(**o))
for label, over, reasons in [
    ("loc>=num_slots", dict(out_cache_loc=i64(5, 6, 70, 9, 10)), ("slot_out_of_range",)),
    ("loc=2**40", dict(out_cache_loc=i64(5, 6, 7, 9, 2**40)), ("slot_out_of_range",)),
    ("loc=int64-max", dict(out_cache_loc=i64(2**63 - 1, 6, 7, 9, 10)), ("slot_out_of_range",)),
    ("write-token-mismatch", dict(expected_input_ids=i64(100, 101, 7, 103, 104), expected_positions=i64(0, 1, 2, 0, 1)),
     ("write_token",)),
    ("write-position-mismatch", dict(expected_input_ids=i64(100, 101, 102, 103, 104),
                                     expected_positions=i64(0, 1, 9, 0, 1)), ("write_position",)),
]:
    row(f"step.report.{label}", Report(*reasons), lambda o=over: prefill_step(**o))
row("step.report.chain-position-assert", Report("write_position"),
    lambda: step(stamped(chain_position_assert=True), decode(positions=i64(7, 2))))
row("step.report.kv-byte-flipped", Report("verify_real_kv_hash"), lambda: decode_step(flip_kv(stamped())))
row("step.report.expected-token", Report("verify_token"),
    lambda: decode_step(stamped(check_expected_token=True), expected_pool=np.full((4, 16), 7, np.int64)))
row("step.report.swa-map-out-of-range", Report("slot_out_of_range", "verify_position", "verify_chain_hash"),
    lambda: step(canary(mode="raise", swa=group(window=2, full_to_swa=np.full(N, 200, np.int64))),
                 prefill(swa_out_cache_loc=i64(5, 6, 7, 9, 10)), decode(swa_out_cache_loc=i64(8, 11))))
row("step.swa-loc-missing", ERR, lambda: step(canary(swa=group(window=2, full_to_swa=np.arange(N, dtype=np.int64))),
                                              prefill()))

rows("step.Batch.views.swa_map", lambda v: prefill().views(swa_map=v),
     [("list", [0] * N, TYPE), ("int32", np.arange(N, dtype=np.int32), TYPE), ("ok", np.arange(N, dtype=np.int64), OK)])
rows("step.Batch.check_window", kc.Batch.check_window, [("'x'", "x", TYPE), ("-2", -2, ERR), ("3", 3, OK)])
row("step.Batch.fields-all-None", TYPE, lambda: prefill_step(req_pool_indices=None, prefix_lens=None, extend_lens=None,
                                                              req_to_token=None))

# ---- other KvCanary methods --------------------------------------------------------------------------------
rows("KvCanary.add_listener", lambda v: canary().add_listener(v),
     [("None", None, TYPE), ("'f'", "f", TYPE), ("callable", print, OK)])
rows("KvCanary.record_replay", lambda v: canary().record_replay(v),
     [("None", None, TYPE), ("'X'", ("X",), ERR), ("'HEAD'", "HEAD", OK), ("both", ("HEAD", "TAIL"), OK),
      ("5", 5, TYPE)])
row("KvCanary.poll(stream=None)", OK, lambda: canary().poll())
row("KvCanary.health_check", OK, lambda: prefill_step().health_check())
row("KvCanary.stats", OK, lambda: prefill_step().stats())
row("KvCanary.buffers", OK, lambda: prefill_step().buffers())
row("state.CanaryBuffer.host_words", OK, lambda: kc.CanaryBuffer.allocate(8).host_words())

# ---- sweep / sweep_chains -----------------------------------------------------------------------------------
for label, args, expected in [
    ("None", (None, None, None), TYPE), ("floats", ([1.5], [0], [-1]), TYPE), ("str", ("abc", [0], [-1]), TYPE),
    ("objects", ([object()], [0], [-1]), TYPE), ("2d", ([[5]], [[0]], [[-1]]), ERR), ("lengths", ([5, 6], [0], [-1]), ERR),
    ("ragged", ([[5], [6, 7]], [0], [-1]), TYPE), ("empty", ([], [], []), OK), ("int32", (np.array([5], np.int32), [0],
                                                                                          [-1]), OK),
    ("chain", ([5, 6, 7], [0, 1, 2], [-1, 5, 6]), OK), ("dict", ({5: 0}, [0], [-1]), TYPE),
]:
    row(f"sweep.args={label}", expected, lambda a=args: stamped().sweep(*a))
row("sweep.over-capacity", ERR, lambda: stamped(sweep_capacity=2).sweep([5, 6, 7], [0, 1, 2], [-1, 5, 6]))
rows("sweep.group", lambda v: stamped().sweep([5], [0], [-1], group=v),
     [("'SWA'-absent", "SWA", ERR), ("None", None, TYPE), ("[]", [], TYPE), ("'full'", "full", OK), ("'FULL'", "FULL", OK),
      ("'X'", "X", ERR)])
for label, args, reasons in [
    ("slot>=num_slots", ([70], [0], [-1]), ("slot_out_of_range",)), ("slot<0", ([-4], [0], [-1]), ("slot_out_of_range",)),
    ("prev>=num_slots", ([6], [1], [700]), ("slot_out_of_range",)), ("wrong-position", ([5], [9], [-1]),
                                                                      ("verify_position",)),
    ("wrong-prev", ([6], [1], [9]), ("verify_chain_hash",)), ("slot=2**62", ([2**62], [0], [-1]), ("slot_out_of_range",)),
]:
    row(f"sweep.report.{label}", Report(*reasons), lambda a=args: stamped().sweep(*a))
for label, chains, expected in [
    ("None", None, TYPE), ("42", 42, TYPE), ("'abc'", "abc", TYPE), ("flat-list", [5, 6], TYPE),
    ("floats", [[5.0]], TYPE), ("3d", [[[5]]], ERR), ("ok", [[5, 6, 7], [9, 10]], OK), ("empty", [], OK),
    ("generator", ([5, 6, 7] for _ in range(1)), OK), ("array", np.array([[5, 6, 7]]), OK),
]:
    row(f"sweep.chains={label}", expected, lambda c=chains: stamped().sweep_chains(c))
row("sweep.chains.report.slot", Report("slot_out_of_range"), lambda: stamped().sweep_chains([[5, 99]]))
row("sweep.chains.group=7", TYPE, lambda: stamped().sweep_chains([[5]], group=7))

# ---- low-level ops (host contexts and plans) -----------------------------------------------------------------
for op, fn in [("build_plan", kc.build_plan), ("prepare_build_plan", prepare_build_plan)]:
    row(f"ops.{op}(batch=None)", TYPE, lambda f=fn: f(None, plan()))
    row(f"ops.{op}(plan=None)", TYPE, lambda f=fn: f(prefill(), None))
    row(f"ops.{op}(plan=dict)", TYPE, lambda f=fn: f(prefill(), {}))
    row(f"ops.{op}(ctx='x')", TYPE, lambda f=fn: f(prefill(), plan(), ctx="x"))
    row(f"ops.{op}(ok)", OK, lambda f=fn: f(prefill(), plan()))
rows("ops.build_plan.swa_window", lambda v: kc.build_plan(prefill(), plan(), swa_window=v),
     [("-1", -1, ERR), ("1.5", 1.5, TYPE), ("'4'", "4", TYPE), ("2**31", 2**31, ERR), ("4", 4, OK)])
rows("ops.build_plan.swa_map", lambda v: kc.build_plan(prefill(swa_out_cache_loc=i64(5, 6, 7, 9, 10)), plan(),
                                                       swa_window=2, swa_map=v),
     [("int32", np.arange(N, dtype=np.int32), TYPE), ("2d", np.zeros((N, 1), np.int64), ERR), ("list", [0] * N, TYPE),
      ("ok", np.arange(N, dtype=np.int64), OK)])
row("ops.build_plan.bs>max_batch", ERR, lambda: kc.build_plan(prefill(), plan(max_batch=1)))
for op, fn in [("fused_verify", kc.fused_verify), ("prepare_fused_verify", prepare_fused_verify)]:
    row(f"ops.{op}(ctx=None)", TYPE, lambda f=fn: f(None, prefill(), plan()))
    row(f"ops.{op}(batch=None)", TYPE, lambda f=fn: f(ctx(), None, plan()))
    row(f"ops.{op}(plan=None)", TYPE, lambda f=fn: f(ctx(), prefill(), None))
    row(f"ops.{op}(check_expected_token=1)", TYPE, lambda f=fn: f(ctx(), prefill(), plan(), check_expected_token=1))
    row(f"ops.{op}(swa_window='4')", TYPE, lambda f=fn: f(ctx(), prefill(), plan(), swa_window="4"))
    row(f"ops.{op}(ok)", OK, lambda f=fn: f(ctx(), prefill(), plan()))
for op, fn in [("verify", kc.verify), ("prepare_verify", prepare_verify)]:
    row(f"ops.{op}(ctx=None)", TYPE, lambda f=fn: f(None, plan()))
    row(f"ops.{op}(plan=None)", TYPE, lambda f=fn: f(ctx(), None))
    row(f"ops.{op}(ctx=sink)", TYPE, lambda f=fn: f(kc.ViolationSink.allocate(4), plan()))
    row(f"ops.{op}(check_expected_token='no')", TYPE, lambda f=fn: f(ctx(), plan(), check_expected_token="no"))
    row(f"ops.{op}(ok)", OK, lambda f=fn: f(ctx(), plan()))


def _plan_with(**arrays):
    p = plan()
    for k, v in arrays.items():
        setattr(p, k, v)
    return p


row("ops.verify(plan-without-entries)", ERR, lambda: kc.verify(ctx(), _plan_with(slot=None)))
row("ops.verify(plan.slot-int32)", TYPE, lambda: kc.verify(ctx(), _plan_with(slot=np.zeros(64, np.int32))))
row("ops.verify(plan.slot-short)", ERR, lambda: kc.verify(ctx(), _plan_with(slot=np.zeros(8, np.int64))))
row("ops.verify(plan.enable-list)", TYPE, lambda: kc.verify(ctx(), _plan_with(enable=[1])))
IDS = i64(1, 2, 3)
for op, fn in [("write", kc.write), ("prepare_write", prepare_write)]:
    row(f"ops.{op}(ctx=None)", TYPE, lambda f=fn: f(None, plan(), IDS, IDS, IDS))
    row(f"ops.{op}(plan=None)", TYPE, lambda f=fn: f(ctx(), None, IDS, IDS, IDS))
    row(f"ops.{op}(input_ids=None)", TYPE, lambda f=fn: f(ctx(), plan(), None, IDS, IDS))
    row(f"ops.{op}(ok)", OK, lambda f=fn: f(ctx(), plan(), IDS, IDS, IDS))
for label, args, kw, expected in [
    ("lists", ([1], [0], [5]), {}, TYPE), ("int32", (IDS.astype(np.int32), IDS, IDS), {}, TYPE),
    ("positions-short", (IDS, IDS[:2], IDS), {}, ERR), ("loc-2d", (IDS, IDS, IDS[None]), {}, ERR),
    ("expected-alone", (IDS, IDS, IDS), dict(expected_input_ids=IDS), ERR),
    ("expected-positions-short", (IDS, IDS, IDS), dict(expected_input_ids=IDS, expected_positions=IDS[:1]), ERR),
    ("expected-float", (IDS, IDS, IDS), dict(expected_input_ids=IDS * 1.0, expected_positions=IDS), TYPE),
    ("empty", (i64(), i64(), i64()), {}, OK),
]:
    row(f"ops.write.{label}", expected, lambda a=args, k=kw: kc.write(ctx(), plan(), *a, **k))

# ---- state objects -----------------------------------------------------------------------------------------------
rows("state.CanaryBuffer", lambda v: kc.CanaryBuffer(v),
     [("None", None, TYPE), ("list", [[0] * 32], TYPE), ("int64", np.zeros((8, 4), np.int64), TYPE),
      ("stride24", np.zeros((8, 24), np.uint8), ERR), ("stride36", np.zeros((8, 36), np.uint8), ERR),
      ("1d", np.zeros(256, np.uint8), ERR), ("strided", np.zeros((8, 64), np.uint8)[:, :32], ERR),
      ("readonly", readonly(np.zeros((8, 32), np.uint8)), ERR), ("0-slots", np.zeros((0, 32), np.uint8), ERR),
      ("ok", np.zeros((8, 32), np.uint8), OK), ("stride40", np.zeros((8, 40), np.uint8), OK)])
rows("state.CanaryBuffer.allocate", lambda v: kc.CanaryBuffer.allocate(v), INTS + [("2**40+1", 2**40 + 1, ERR), ("8", 8, OK)])
rows("state.CanaryBuffer.allocate.device", lambda v: kc.CanaryBuffer.allocate(8, device=v),
     [("'cpu'", "cpu", TYPE), ("-1", -1, ERR), ("True", True, TYPE), ("None", None, OK)])
rows("state.CanaryBuffer.allocate.slot_stride_bytes", lambda v: kc.CanaryBuffer.allocate(8, slot_stride_bytes=v),
     [("24", 24, ERR), ("1.5", 1.5, TYPE), ("36", 36, ERR), ("64", 64, OK)])


def sink(ring=None, wi=None, k=None, s=None, **kw):
    return kc.ViolationSink(np.zeros((4, 8), np.int64) if ring is None else ring,
                            np.zeros(1, np.int32) if wi is None else wi, np.zeros(1, np.int64) if k is None else k,
                            np.zeros(1, np.int64) if s is None else s, **kw)


for label, kw, expected in [
    ("ring-7-cols", dict(ring=np.zeros((4, 7), np.int64)), ERR), ("ring-int32", dict(ring=np.zeros((4, 8), np.int32)), TYPE),
    ("ring-0-rows", dict(ring=np.zeros((0, 8), np.int64)), ERR), ("ring-readonly", dict(ring=readonly(np.zeros((4, 8),
                                                                                                      np.int64))), ERR),
    ("ring-list", dict(ring=[[0] * 8]), TYPE), ("write-index-int64", dict(wi=np.zeros(1, np.int64)), TYPE),
    ("counter-shape2", dict(k=np.zeros(2, np.int64)), ERR), ("claim-int32", dict(claim=np.zeros(1, np.int32)), TYPE),
    ("ok", {}, OK),
]:
    row(f"state.ViolationSink.{label}", expected, lambda k=kw: sink(**k))
row("state.ViolationSink(None...)", TYPE, lambda: kc.ViolationSink(None, None, None, None))
rows("state.ViolationSink.allocate", lambda v: kc.ViolationSink.allocate(v),
     INTS + [("2**31+8", 2**31 + 8, ERR), ("4", 4, OK)])
row("state.ViolationSink.allocate.device='cpu'", TYPE, lambda: kc.ViolationSink.allocate(4, device="cpu"))
row("state.VerifyContext(buffer=None)", TYPE, lambda: kc.VerifyContext(None, kc.ViolationSink.allocate(4)))
row("state.VerifyContext(buffer=array)", TYPE, lambda: kc.VerifyContext(np.zeros((8, 32), np.uint8),
                                                                        kc.ViolationSink.allocate(4)))
row("state.VerifyContext(sink=None)", TYPE, lambda: kc.VerifyContext(kc.CanaryBuffer.allocate(8), None))
rows("state.VerifyContext.tag", lambda v: ctx(tag=v),
     [("999", 999, ERR), ("-1", -1, ERR), ("'X'", "X", ERR), ("1.5", 1.5, TYPE), ("None", None, TYPE), ("True", True, TYPE),
      ("'HEAD_K_FULL'", "HEAD_K_FULL", OK), ("'tail_v_full'", "tail_v_full", OK), ("enum", kc.LaunchTag.SWEEP_V_FULL, OK),
      ("3", 3, OK)])
rows("state.VerifyContext.hash_mode", lambda v: ctx(hash_mode=v),
     [("'partial'", "partial", OK), ("'NONE'", "NONE", OK), ("enum", HashMode.ALL, OK), ("'x'", "x", ERR),
      ("1", 1, TYPE), ("None", None, TYPE), ("1.0", 1.0, TYPE)])
rows("state.VerifyContext.sources", lambda v: ctx(sources=v),
     [("None", None, TYPE), ("array", pool(), TYPE), ("[array]", [pool()], TYPE), ("'abc'", "abc", TYPE),
      ("()", (), OK)])
row("state.VerifyContext.sources=bare-source", TYPE, lambda: ctx(sources=src()))
row("state.VerifyContext.sources=65", ERR, lambda: ctx(sources=[src()] * 65))
row("state.VerifyContext.sources=too-few-slots", ERR, lambda: ctx(sources=[kc.source_from_slots(pool(slots=8))]))
row("state.VerifyContext.sources=too-few-slots-mode-none", OK,
    lambda: ctx(sources=[kc.source_from_slots(pool(slots=8))], hash_mode="none"))
rows("state.VerifyContext.chain_position_assert", lambda v: ctx(chain_position_assert=v),
     [("int64", np.zeros(1, np.int64), TYPE), ("shape2", np.zeros(2, np.int32), ERR), ("list", [0], TYPE),
      ("ok", np.zeros(1, np.int32), OK)])
row("state.VerifyContext.set_chain_position_assert(1)", TYPE, lambda: ctx().set_chain_position_assert(1))
rows("state.StepPlan.allocate.max_batch", lambda v: kc.StepPlan.allocate(v, 4),
     INTS + [("2**24+1", 2**24 + 1, ERR), ("2", 2, OK)])
rows("state.StepPlan.allocate.verify_capacity", lambda v: kc.StepPlan.allocate(2, v),
     INTS + [("2**31", 2**31, ERR), ("4", 4, OK)])
rows("state.StepPlan.allocate.materialize", lambda v: kc.StepPlan.allocate(2, 4, materialize=v), BOOLS)
rows("state.StepPlan.allocate.device", lambda v: kc.StepPlan.allocate(2, 4, device=v),
     [("'cpu'", "cpu", TYPE), ("-1", -1, ERR), ("1.5", 1.5, TYPE), ("None", None, OK)])

# ---- real-KV sources and the layout helpers -------------------------------------------------------------------
rows("sources.RealKvSource.page_size", lambda v: kc.RealKvSource(pool(), v, 16),
     INTS + [("np.int64(2)", np.int64(2), OK), ("65", 65, OK)])
rows("sources.RealKvSource.num_bytes_per_token", lambda v: kc.RealKvSource(pool(), 1, v),
     INTS + [("24", 24, ERR), ("-16", -16, ERR), ("np.int32(16)", np.int32(16), OK)])
rows("sources.RealKvSource.read_bytes", lambda v: kc.RealKvSource(pool(), 1, 64, v),
     [("0", 0, ERR), ("8", 8, ERR), ("80", 80, ERR), ("1.5", 1.5, TYPE), ("'16'", "16", TYPE), ("True", True, TYPE),
      ("None", None, OK), ("32", 32, OK)])
rows("sources.RealKvSource.tensor", lambda v: kc.RealKvSource(v, 1, 16),
     [("None", None, TYPE), ("list", [[0] * 16], TYPE), ("1d", np.zeros(64, np.uint8), ERR),
      ("stride40", np.zeros((8, 40), np.uint8)[:, :32], ERR), ("object", np.array([[object()]]), TYPE),
      ("str", "pool", TYPE), ("fp16", np.zeros((8, 2, 8), np.float16), OK)])
rows("sources.sources_from_pages.page_size", lambda v: kc.sources_from_pages(pages_pool(), page_size=v),
     INTS[:-1] + [("3", 3, ERR), ("64", 64, ERR), ("None", None, OK), ("8", 8, OK)])
rows("sources.sources_from_pages.pool", lambda v: kc.sources_from_pages(v),
     [("None", None, TYPE), ("1d", np.zeros(64, np.uint8), ERR), ("list", [[0]], TYPE),
      ("transposed", np.zeros((16, 4, 32), np.uint8).transpose(1, 0, 2), ERR), ("0-pages", np.zeros((0, 16, 32), np.uint8),
                                                                                ERR)])
rows("sources.sources_from_pages.read_bytes", lambda v: kc.sources_from_pages(pages_pool(), read_bytes=v),
     [("8", 8, ERR), ("1.5", 1.5, TYPE), ("64", 64, ERR), ("16", 16, OK)])
rows("sources.source_from_slots", lambda v: kc.source_from_slots(v),
     [("None", None, TYPE), ("1d", np.zeros(64, np.uint8), ERR), ("24-bytes", np.zeros((64, 24), np.uint8), ERR),
      ("transposed", np.zeros((64, 64), np.uint8).T, ERR), ("fp16-3d", np.zeros((64, 2, 16), np.float16), OK),
      ("'x'", "x", TYPE), ("reversed", np.zeros((64, 16), np.uint8)[::-1], ERR),
      ("0-slots", np.zeros((0, 16), np.uint8), ERR), ("1-slot", np.zeros((1, 16), np.uint8), OK)])
rows("sources.source_from_slots.read_bytes", lambda v: kc.source_from_slots(pool(), read_bytes=v),
     [("7", 7, ERR), ("'16'", "16", TYPE), ("0", 0, ERR), ("64", 64, OK)])
rows("sources.sources_from_vllm", lambda v: kc.sources_from_vllm(v),
     [("None", None, TYPE), ("kv3", np.zeros((3, 4, 16, 2, 8), np.float16), ERR), ("3d", np.zeros((2, 4, 16), np.uint8), ERR),
      ("ok", np.zeros((2, 4, 16, 2, 8), np.float16), OK)])
row("sources.sources_from_vllm.read_bytes=1.5", TYPE,
    lambda: kc.sources_from_vllm(np.zeros((2, 4, 16, 2, 8), np.float16), read_bytes=1.5))
rows("sources.sources_from_layers", lambda v: kc.sources_from_layers(v),
     [("None", None, TYPE), ("42", 42, TYPE), ("'abc'", "abc", TYPE), ("[None]", [None], TYPE), ("[]", [], OK),
      ("[pool]", [pool()], OK), ("stacked", np.zeros((2, N, 64), np.uint8), OK), ("dict", {"l0": pool()}, TYPE)])
rows("sources.sources_from_layers.page_size", lambda v: kc.sources_from_layers([pages_pool()], page_size=v),
     [("0", 0, ERR), ("1.5", 1.5, TYPE), ("16", 16, OK)])
