"""Declare -> bind -> execute, for the public ops (:mod:`kvcanary.ops`). ``bind_*`` checks an op's
arguments on the host and returns a :class:`Bound`: the op's kernel, its params struct filled with
the arrays' addresses, the launch shape it needs, and the same op on the CPU reference. Binding
touches no backend (no driver, no stream, no reference run); only a backend executes a Bound
(:meth:`~kvcanary.ops.backends.HostBackend.prepare` runs the reference now,
:meth:`~kvcanary.ops.backends.CudaBackend.prepare` packs the launch). ``kvcanary.ops.prepare_*`` binds,
then hands the Bound to the backend of its arrays.

Every op runs the same host validation on either backend; host arrays are also checked value by
value (a bad batch is rejected before anything runs), device arrays never are (no host reads):
the kernels check every index they read and report what is out of range. Nothing here
synchronises. Launches go on ``stream`` or the default of :mod:`kvcanary.runtime.streams`. A packed
:class:`Launch` keeps the canary's own state alive, not the batch's arrays: replay it only while
the arrays it was packed from (or others at the same addresses, shapes and strides) are alive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import abi
from ..errors import ValidationError
from ..validate import boolean, instance
from . import host as host_ops
from .batch import Batch, StepPlan, check_batch_values
from .checks import checked, same_device
from .state import VerifyContext

BLOCK = abi.BLOCK_THREADS


@dataclass(eq=False)
class Bound:
    """One op bound to its arrays, validated. ``params``: the kernel's struct, every address filled
    in; ``shape(rt)`` -> (entry point, grid, block) on a device runtime (the kernel variant and
    grid follow the device's occupancy); ``owners`` / ``views``: the arrays a default stream is
    taken from (:func:`kvcanary.runtime.streams.resolve`); ``keep``: what the params point into,
    kept alive with a launch; ``host()``: the same op on the CPU reference (host arrays)."""

    device: int | None
    params: Any
    shape: Callable[[Any], tuple[str, int, int]]
    owners: tuple
    views: Any
    keep: tuple
    host: Callable[[], None]


def _block_entries(block: int, lane_entries: int) -> int:
    """Entries a block of warp tiles verifies per round (a tile re-holds its predecessor entry)."""
    return (abi.WARP_SIZE * lane_entries - 1) * (block // abi.WARP_SIZE)


def _verify_shape(rt, name: str, capacity: int, hash_bytes: tuple[int, ...]) -> tuple[str, int, int]:
    """(kernel, grid, block) of a verify launch: the warp-cooperative *_wide variant when a source
    fingerprints KVC_WIDE_HASH_BYTES or more, the *_many variant for MANY_SOURCES or more short
    strips (their loads batched), else the narrow kernel (its warp tiles HASHED_LANE_ENTRIES deep
    when it fingerprints, VERIFY_LANE_ENTRIES when not), and at most one resident wave of blocks (the
    driver's occupancy for the kernel), never more blocks than the plan capacity has block tiles
    (the fused *_many: warp tiles, as a small step spreads each tile over a block)."""
    wide = any(h >= abi.WIDE_HASH_BYTES for h in hash_bytes)
    if wide:
        name, block, tile = f"{name}_wide", abi.WIDE_VERIFY_THREADS, _block_entries(abi.WIDE_VERIFY_THREADS, 1)
    elif len(hash_bytes) < abi.MANY_SOURCES:  # the narrow kernels tile by whether they fingerprint
        block, tile = BLOCK, _block_entries(BLOCK, abi.HASHED_LANE_ENTRIES if hash_bytes else abi.VERIFY_LANE_ENTRIES)
    else:
        name = f"{name}_many"
        # the fused one: a block per warp tile (a small step spreads each over the block)
        block, tile = BLOCK, _block_entries(32 if name == "kvc_fused_verify_many" else BLOCK, abi.VERIFY_LANE_ENTRIES)
    return name, max(1, min(rt.resident_blocks(name, block), -(-capacity // tile))), block


_NOT_TAKEN = object()


def _check_args(*, ctx=_NOT_TAKEN, batch=_NOT_TAKEN, plan=_NOT_TAKEN) -> None:
    """The kinds of an op's arguments (those it takes)."""
    if ctx is not _NOT_TAKEN:
        instance("ctx", ctx, VerifyContext, "a kvcanary.VerifyContext",
                 "VerifyContext(CanaryBuffer.allocate(num_slots), ViolationSink.allocate(), ...)")
    if batch is not _NOT_TAKEN:
        instance("batch", batch, Batch, "a kvcanary.Batch", "build one with kvcanary.Batch(...) or an adapter")
    if plan is not _NOT_TAKEN:
        instance("plan", plan, StepPlan, "a kvcanary.StepPlan", "StepPlan.allocate(max_batch, verify_capacity)")


def _check_plan_device(ctx: VerifyContext, plan: StepPlan) -> None:
    if plan.device != ctx.device:
        where = lambda d: "host" if d is None else f"cuda:{d}"  # noqa: E731
        raise ValidationError(f"kv-canary: the plan must live on the canary context's device "
                              f"({where(ctx.device)}), got a plan on {where(plan.device)}. Fix: "
                              f"allocate both on one device")


# ---- verify --------------------------------------------------------------------------------------
def bind_verify(ctx: VerifyContext, plan: StepPlan, *, check_expected_token: bool = False,
                per_request: bool = False) -> Bound:
    """:func:`verify` bound. ``per_request``: attribute each row to its entry's request through the plan's entry offsets
    (docs/format.md §5.7; a plan :func:`build_plan` filled, not a sweep's)."""
    _check_args(ctx=ctx, plan=plan)
    _check_plan_device(ctx, plan)
    check = boolean("check_expected_token", check_expected_token)
    offsets = plan.entry_offsets_view() if boolean("per_request", per_request) else None
    if not plan.materialized:
        raise ValidationError("kv-canary: verify() needs a materialised plan, got one without "
                              "entry arrays. Fix: StepPlan.allocate(..., materialize=True), or use "
                              "fused_verify()")
    if ctx.fingerprint_every > 1:
        raise ValidationError(f"kv-canary: verify() fingerprints every entry of a materialised plan, got a "
                              f"context with fingerprint_every={ctx.fingerprint_every} (a budget needs each "
                              f"request's positions, which only the batch has). Fix: use fused_verify(), or "
                              f"a context with fingerprint_every=1")
    views = plan.entry_views()
    num_valid, enable = plan.flag_views()
    p = ctx.params(abi.VerifyParams)
    ctx.fill_verify_tail(p)
    if offsets is not None:
        p.plan_entry_offsets, p.plan_requests = offsets.ptr, plan.max_batch
    p.plan_slot, p.plan_expected_token = views["slot"].ptr, views["expected_token"].ptr
    p.plan_expected_position, p.plan_prev_slot = views["expected_position"].ptr, views["prev_slot"].ptr
    p.plan_num_valid, p.plan_enable = num_valid.ptr, enable.ptr
    p.plan_capacity, p.check_expected_token = plan.verify_capacity, int(check)
    return Bound(ctx.device, p, lambda rt: _verify_shape(rt, "kvc_verify", plan.verify_capacity, ctx.hash_bytes),
                 (ctx.buffer.array, plan.slot), views.values(), (ctx, plan),
                 lambda: host_ops.verify(ctx, views, num_valid, enable, check, offsets))


# ---- write ---------------------------------------------------------------------------------------
def bind_write(ctx: VerifyContext, plan: StepPlan, input_ids, positions, out_cache_loc, *,
               expected_input_ids=None, expected_positions=None, chain_from: VerifyContext | None = None) -> Bound:
    """:func:`write` bound. With ``chain_from`` the kernel takes each request's chain from that buffer when every link
    checks out in parallel, instead of running the serial chain again; the stores are the same
    either way (docs/format.md §7), so the host reference ignores it."""
    _check_args(ctx=ctx, plan=plan)
    _check_plan_device(ctx, plan)
    if chain_from is not None:
        instance("chain_from", chain_from, VerifyContext, "a kvcanary.VerifyContext",
                 "pass the context of the group's buffer stamped first in the step, or None")
        b, c = ctx.buffer, chain_from.buffer
        if c is b or c.device != b.device or (c.num_slots, c.slot_stride) != (b.num_slots, b.slot_stride):
            raise ValidationError(f"kv-canary: write(chain_from=) must be another buffer of the same shape on the "
                                  f"same device, got {c.num_slots} x {c.slot_stride} bytes on device {c.device} "
                                  f"for {b.num_slots} x {b.slot_stride} on device {b.device}"
                                  f"{' (the same buffer)' if c is b else ''}. Fix: pass the context of the "
                                  f"group's buffer stamped first in the step")
    tok = checked(input_ids, "input_ids", dtype=np.int64, ndim=1)
    T = tok.shape[0]
    pos = checked(positions, "positions", dtype=np.int64, shape=(T,), ndim=1)
    loc = checked(out_cache_loc, "out_cache_loc", dtype=np.int64, shape=(T,), ndim=1)
    if (expected_input_ids is None) != (expected_positions is None):
        raise ValidationError("kv-canary: expected_input_ids and expected_positions go together, got "
                              "only one of them. Fix: pass both or neither")
    exp_tok = exp_pos = None
    if expected_input_ids is not None:
        exp_tok = checked(expected_input_ids, "expected_input_ids", dtype=np.int64, shape=(T,), ndim=1)
        exp_pos = checked(expected_positions, "expected_positions", dtype=np.int64, shape=(T,), ndim=1)
    offsets, seed, nreq = plan.write_views()
    views = (tok, pos, loc, exp_tok, exp_pos, offsets, seed, nreq)
    if same_device(views, "write()") != ctx.device:
        raise ValidationError("kv-canary: write() arrays must live on the canary buffer's device, got "
                              "them elsewhere. Fix: move them to the canary buffer's device")
    p = ctx.params(abi.WriteParams)
    p.offsets, p.seed, p.num_valid_reqs, p.req_capacity = offsets.ptr, seed.ptr, nreq.ptr, plan.max_batch
    p.input_ids, p.positions, p.out_cache_loc, p.num_tokens = tok.ptr, pos.ptr, loc.ptr, T
    p.expected_input_ids = 0 if exp_tok is None else exp_tok.ptr
    p.expected_positions = 0 if exp_pos is None else exp_pos.ptr
    p.chain_position_assert = ctx.flag_view.ptr
    p.chain_source = 0 if chain_from is None else chain_from.buffer.view.ptr
    def shape(rt):  # a block per request, one resident wave at most
        return "kvc_write", max(1, min(rt.resident_blocks("kvc_write", BLOCK), plan.max_batch)), BLOCK
    return Bound(ctx.device, p, shape, (input_ids, ctx.buffer.array), views, (ctx, plan),
                 lambda: host_ops.write(ctx, views))


# ---- plan builder and fused verify -------------------------------------------------------------------
def _fill_batch(p, v: dict, batch: Batch, plan: StepPlan, swa_window: int, swa_map) -> None:
    p.req_pool_indices, p.prefix_lens, p.extend_lens = (v[k].ptr for k in ("req_pool_indices", "prefix_lens", "extend_lens"))
    p.batch_size = v["req_pool_indices"].shape[0]
    rtt = v["req_to_token"]
    p.req_to_token, p.rtt_rows, p.rtt_max_len = rtt.ptr, rtt.shape[0], rtt.shape[1]
    p.rtt_row_stride = rtt.strides[0] // rtt.itemsize
    p.swa_window = swa_window
    if "swa_map" in v:
        p.swa_map, p.swa_map_len = v["swa_map"].ptr, v["swa_map"].shape[0]
    if "expected_pool" in v:
        pool = v["expected_pool"]
        p.expected_pool, p.expected_pool_len = pool.ptr, pool.shape[1]
        p.expected_row_stride = pool.strides[0] // pool.itemsize
        p.expected_valid_lens = v["expected_valid_lens"].ptr if "expected_valid_lens" in v else 0
        p.expected_token_offset = batch.expected_token_offset
    p.entry_offsets = plan.entry_offsets_view().ptr
    num_valid, enable = plan.flag_views()
    p.verify_num_valid, p.verify_enable, p.verify_capacity = num_valid.ptr, enable.ptr, plan.verify_capacity


def _batch_views(batch: Batch, plan: StepPlan, swa_window, swa_map) -> tuple[dict, int]:
    """The batch's views checked against the plan (host arrays are checked value by value when
    the reference runs them: :func:`_host_values`)."""
    v = batch.views(swa_map=swa_map)
    window = batch.check_window(swa_window)
    bs = v["req_pool_indices"].shape[0]
    if bs > plan.max_batch:
        raise ValidationError(f"kv-canary: batch size must be <= max_batch ({plan.max_batch}), got {bs} requests. "
                              f"Fix: build the canary with KvCanary(max_batch>={bs}) (the lower-level ops: "
                              f"StepPlan.allocate(max_batch>={bs}, ...))")
    pool = v.get("expected_pool")
    if pool is not None and pool.shape[0] < v["req_to_token"].shape[0]:
        raise ValidationError(f"kv-canary: batch.expected_pool must have a row per request-pool row (>= "
                              f"{v['req_to_token'].shape[0]}, like req_to_token), got {pool.shape[0]} rows. Fix: pass "
                              f"the engine's whole expected-token pool")
    if same_device(list(v.values()), "a Batch") != plan.device:
        raise ValidationError("kv-canary: the batch arrays must live on the plan's device, got them "
                              "elsewhere. Fix: allocate the plan on the batch's device")
    return v, window


def _host_values(v: dict, batch: Batch, swa_map, run):
    """``run`` on the reference after the batch's host values are checked (a bad batch is rejected
    before anything runs)."""
    def host():
        check_batch_values(v, batch, swa=swa_map is not None)
        run()
    return host


def bind_build_plan(batch: Batch, plan: StepPlan, *, swa_window: int = 0, swa_map=None,
                    ctx: VerifyContext | None = None, reset_verdicts: bool = True) -> list[Bound]:
    """:func:`build_plan` bound: kvc_prepare, then kvc_expand for a materialised plan (on the
    reference, one run that fills both). ``reset_verdicts``: first zero the sink's request verdicts (docs/format.md §5.7): a step's
    first build does, a second group's build of the same step must not."""
    _check_args(batch=batch, plan=plan, ctx=_NOT_TAKEN if ctx is None else ctx)
    reset = boolean("reset_verdicts", reset_verdicts)
    if ctx is not None:
        _check_plan_device(ctx, plan)
    v, window = _batch_views(batch, plan, swa_window, swa_map)
    sink, tag = (ctx.sink, ctx.tag) if ctx is not None else (plan.reject_sink, abi.LaunchTag.HEAD_K_FULL)
    loc = v.get("swa_out_cache_loc" if swa_map is not None else "out_cache_loc")
    p = sink.params(abi.PrepareParams, tag)
    p.verdict_reset = int(reset)
    _fill_batch(p, v, batch, plan, window, swa_map)
    offsets, seed, nreq = plan.write_views()
    p.write_offsets, p.write_seed, p.write_num_valid_reqs = offsets.ptr, seed.ptr, nreq.ptr
    p.write_req_capacity = plan.max_batch
    if loc is not None:
        p.out_cache_loc, p.num_tokens = loc.ptr, loc.shape[0]
    owners = (batch.req_pool_indices,)
    bound = [Bound(plan.device, p, lambda rt: ("kvc_prepare", 1, abi.PREPARE_THREADS), owners, v.values(),
                   (plan, swa_map, sink), _host_values(v, batch, swa_map, lambda: host_ops.build_plan(
                       plan, batch, v, window, loc, sink, tag, reset)))]
    if plan.materialized:
        e = abi.ExpandParams()
        _fill_batch(e, v, batch, plan, window, swa_map)
        entry = plan.entry_views()
        e.plan_slot, e.plan_expected_token = entry["slot"].ptr, entry["expected_token"].ptr
        e.plan_expected_position, e.plan_prev_slot = entry["expected_position"].ptr, entry["prev_slot"].ptr
        def shape(rt):
            return "kvc_expand", max(1, min(rt.resident_blocks("kvc_expand", BLOCK), -(-plan.verify_capacity // BLOCK))), BLOCK
        bound.append(Bound(plan.device, e, shape, owners, v.values(), (plan, swa_map), lambda: None))
    return bound


def bind_fused_verify(ctx: VerifyContext, batch: Batch, plan: StepPlan, *, swa_window: int = 0,
                      swa_map=None, check_expected_token: bool = False) -> Bound:
    """:func:`fused_verify` bound."""
    _check_args(ctx=ctx, batch=batch, plan=plan)
    _check_plan_device(ctx, plan)
    check = boolean("check_expected_token", check_expected_token)
    v, window = _batch_views(batch, plan, swa_window, swa_map)
    p = ctx.params(abi.FusedVerifyParams)
    ctx.fill_verify_tail(p)
    _fill_batch(p, v, batch, plan, window, swa_map)
    p.check_expected_token = int(check)
    return Bound(ctx.device, p, lambda rt: _verify_shape(rt, "kvc_fused_verify", plan.verify_capacity, ctx.hash_bytes),
                 (batch.req_pool_indices, ctx.buffer.array), v.values(), (ctx, plan, swa_map),
                 _host_values(v, batch, swa_map, lambda: host_ops.fused_verify(ctx, batch, plan, v, window, check)))
