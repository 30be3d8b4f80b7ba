"""Public canary operations: validate on the host, then run the CPU reference (host arrays) or
launch the CUDA kernel (device arrays). The only module that wires validation -> params -> launch.

Every op runs the same host validation on either backend and never synchronises on the device
path. Launches go on ``stream`` or the default of :mod:`kvcanary.streams`.
"""

from __future__ import annotations

import numpy as np

import ctypes

from . import abi, reference, streams
from .errors import ValidationError
from .plan import Batch, StepPlan
from .state import VerifyContext, checked, same_device

BLOCK = abi.BLOCK_THREADS
_PREPARE_BLOCK = abi.PREPARE_THREADS
WIDE_HASH_BYTES = 64  # a source fingerprinting this many bytes per slot selects the *_wide verifies
_VERIFY_TILE = 32 * abi.VERIFY_LANE_ENTRIES - 1  # entries a warp tile of the narrow verifies checks
_WIDE_BLOCK = abi.WIDE_VERIFY_THREADS


class Launch:
    """A validated, packed kernel launch: replaying it costs one cuLaunchKernel.

    Holds the params struct and its pointer array, so both outlive every launch of it. Pointers
    inside are fixed: replay only while the arrays it was built from are alive and unchanged.
    ``go(stream)`` is the bound launch (``DeviceRuntime.launcher``): hot loops call it directly.
    Fields of ``params`` may be changed between launches (cuLaunchKernel copies the struct).
    """

    __slots__ = ("rt", "name", "grid", "block", "params", "_ptrs", "address", "stream", "keep", "go")

    def __init__(self, rt, name: str, grid: int, block: int, params, stream: int, keep=()):
        self.rt, self.name, self.grid, self.block, self.params, self.stream = rt, name, grid, block, params, stream
        self._ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        self.address = ctypes.addressof(self._ptrs)
        self.keep = keep  # the objects owning every pointer in params stay alive with the launch
        self.go = rt.launcher(name, grid, block, self.address)

    def __call__(self, stream: int | None = None) -> None:
        self.go(self.stream if stream is None else stream)


def _ref_sources(ctx: VerifyContext) -> list[reference.RefSource]:
    return [reference.RefSource(m.view.host, m.page_size, m.bytes_per_token, m.hash_bytes)
            for m in ctx.marshalled]


def _ref_sink(ctx: VerifyContext) -> dict:
    s = ctx.sink
    return dict(ring=s.ring_view.host, write_index=s.write_index_view.host,
                kernel_run_counter=s.kernel_run_view.host, slot_run_counter=s.slot_run_view.host)


def _grid(rt, work_items: int, per_block: int = BLOCK) -> int:
    return max(1, min(rt.sm_count * (2048 // BLOCK), -(-work_items // per_block)))


def request_major(batch_size: int, hash_bytes: tuple[int, ...]) -> bool:
    """Whether a fused verify of ``batch_size`` requests whose sources fingerprint ``hash_bytes``
    each runs request-major tasks (kvc_fused_verify_rm)."""
    return abi.RM_MIN_BATCH <= batch_size <= abi.RM_MAX_BATCH and all(h < WIDE_HASH_BYTES for h in hash_bytes)


def _verify_kernel(name: str, rt, p, capacity: int, hash_bytes: tuple[int, ...]) -> tuple[str, int, int]:
    """(kernel, grid, block) of a verify launch: the warp-cooperative variant when a source
    fingerprints long strips; else, for a fused verify of 32..1024 requests, request-major
    tiles; and enough blocks for every warp tile of a full plan (at most 16 blocks of 256
    threads per SM)."""
    wide = any(h >= WIDE_HASH_BYTES for h in hash_bytes)
    block = _WIDE_BLOCK if wide else BLOCK
    per_block = (31 if wide else _VERIFY_TILE) * (block // 32)
    most = rt.sm_count * 16 * BLOCK // block
    if wide:
        name = f"{name}_wide"
    elif name == "kvc_fused_verify" and request_major(p.batch_size, hash_bytes):
        # one resident wave: each block stages the batch once, its warps take tasks grid-stride
        name, per_block = "kvc_fused_verify_rm", 32 * abi.RM_CHUNKS * abi.VERIFY_LANE_ENTRIES * (block // 32)
        most = rt.sm_count * abi.RM_MIN_BLOCKS
    grid = max(1, min(most, -(-capacity // per_block)))
    return name, grid, block


def _runtime(device: int):
    from . import driver
    return driver.runtime(device)


def _check_plan_device(ctx: VerifyContext, plan: StepPlan) -> None:
    if plan.device != ctx.device:
        where = lambda d: "host" if d is None else f"cuda:{d}"  # noqa: E731
        raise ValidationError(f"kv-canary: the plan lives on {where(plan.device)} but the canary "
                              f"context on {where(ctx.device)}; fix: allocate both on one device")


# ---- verify --------------------------------------------------------------------------------------
def verify(ctx: VerifyContext, plan: StepPlan, *, check_expected_token: bool = False, stream=None) -> None:
    """Verify the materialised plan's entries against ``ctx`` (SPEC §6). Read-only on the buffer."""
    launch = prepare_verify(ctx, plan, check_expected_token=check_expected_token, stream=stream)
    if launch is not None:
        launch()


def prepare_verify(ctx: VerifyContext, plan: StepPlan, *, check_expected_token: bool = False,
                   stream=None) -> Launch | None:
    """:func:`verify` validated and packed; host arrays run on the reference now (returns None)."""
    _check_plan_device(ctx, plan)
    if not plan.materialized:
        raise ValidationError("kv-canary: verify() needs a materialised plan; fix: "
                              "StepPlan.allocate(..., materialize=True), or use fused_verify()")
    arrays = dict(slot=plan.slot, expected_token=plan.expected_token,
                  expected_position=plan.expected_position, prev_slot=plan.prev_slot)
    views = {k: checked(a, f"plan.{k}", dtype=np.int64, shape=(plan.verify_capacity,), ndim=1)
             for k, a in arrays.items()}
    num_valid = checked(plan.num_valid, "plan.num_valid", dtype=np.int32, shape=(1,), ndim=1)
    enable = checked(plan.enable, "plan.enable", dtype=np.int32, shape=(1,), ndim=1)
    if ctx.device is None:
        reference.verify(canary=ctx.buffer.view.host, **{k: v.host for k, v in views.items()},
                         num_valid=num_valid.host, enable=enable.host, sources=_ref_sources(ctx),
                         tag=int(ctx.tag), check_expected_token=check_expected_token, **_ref_sink(ctx))
        return
    p = ctx.params(abi.VerifyParams)
    p.plan_slot, p.plan_expected_token = views["slot"].ptr, views["expected_token"].ptr
    p.plan_expected_position, p.plan_prev_slot = views["expected_position"].ptr, views["prev_slot"].ptr
    p.plan_num_valid, p.plan_enable = num_valid.ptr, enable.ptr
    p.plan_capacity, p.check_expected_token = plan.verify_capacity, int(bool(check_expected_token))
    rt = _runtime(ctx.device)
    s = streams.resolve(stream, (ctx.buffer.array, plan.slot), views.values(), ctx.device)
    name, grid, block = _verify_kernel("kvc_verify", rt, p, plan.verify_capacity, ctx.hash_bytes)
    return Launch(rt, name, grid, block, p, s, (ctx, plan))


# ---- write ---------------------------------------------------------------------------------------
def write(ctx: VerifyContext, plan: StepPlan, input_ids, positions, out_cache_loc, *,
          expected_input_ids=None, expected_positions=None, stream=None) -> None:
    """Stamp new tokens into ``ctx``'s buffer along the write plan (SPEC §7)."""
    launch = prepare_write(ctx, plan, input_ids, positions, out_cache_loc, stream=stream,
                           expected_input_ids=expected_input_ids, expected_positions=expected_positions)
    if launch is not None:
        launch()


def prepare_write(ctx: VerifyContext, plan: StepPlan, input_ids, positions, out_cache_loc, *,
                  expected_input_ids=None, expected_positions=None, stream=None) -> Launch | None:
    """:func:`write` validated and packed; host arrays run on the reference now (returns None)."""
    _check_plan_device(ctx, plan)
    tok = checked(input_ids, "input_ids", dtype=np.int64, ndim=1)
    T = tok.shape[0]
    pos = checked(positions, "positions", dtype=np.int64, shape=(T,), ndim=1)
    loc = checked(out_cache_loc, "out_cache_loc", dtype=np.int64, shape=(T,), ndim=1)
    if (expected_input_ids is None) != (expected_positions is None):
        raise ValidationError("kv-canary: expected_input_ids and expected_positions go together; "
                              "got only one of them. Fix: pass both or neither")
    exp_tok = exp_pos = None
    if expected_input_ids is not None:
        exp_tok = checked(expected_input_ids, "expected_input_ids", dtype=np.int64, shape=(T,), ndim=1)
        exp_pos = checked(expected_positions, "expected_positions", dtype=np.int64, shape=(T,), ndim=1)
    offsets = checked(plan.offsets, "plan.offsets", dtype=np.int64, shape=(plan.max_batch + 1,), ndim=1)
    seed = checked(plan.seed, "plan.seed", dtype=np.int64, shape=(plan.max_batch,), ndim=1)
    nreq = checked(plan.num_valid_reqs, "plan.num_valid_reqs", dtype=np.int32, shape=(1,), ndim=1)
    views = (tok, pos, loc, exp_tok, exp_pos, offsets, seed, nreq)
    if same_device(views, "write()") != ctx.device:
        raise ValidationError("kv-canary: write() arrays must live on the canary buffer's device")
    if ctx.device is None:
        reference.write(canary=ctx.buffer.view.host, offsets=offsets.host, seed=seed.host,
                        num_valid_reqs=nreq.host, input_ids=tok.host, positions=pos.host,
                        out_cache_loc=loc.host,
                        expected_input_ids=None if exp_tok is None else exp_tok.host,
                        expected_positions=None if exp_pos is None else exp_pos.host,
                        chain_position_assert=ctx.flag_view.host, sources=_ref_sources(ctx),
                        tag=int(ctx.tag), **_ref_sink(ctx))
        return
    p = ctx.params(abi.WriteParams)
    p.offsets, p.seed, p.num_valid_reqs, p.req_capacity = offsets.ptr, seed.ptr, nreq.ptr, plan.max_batch
    p.input_ids, p.positions, p.out_cache_loc, p.num_tokens = tok.ptr, pos.ptr, loc.ptr, T
    p.expected_input_ids = 0 if exp_tok is None else exp_tok.ptr
    p.expected_positions = 0 if exp_pos is None else exp_pos.ptr
    p.chain_position_assert = ctx.flag_view.ptr
    rt = _runtime(ctx.device)
    s = streams.resolve(stream, (input_ids, ctx.buffer.array), views, ctx.device)
    return Launch(rt, "kvc_write", _grid(rt, plan.max_batch, 1), BLOCK, p, s,  # a block per request
                  (ctx, plan, input_ids, positions, out_cache_loc, expected_input_ids, expected_positions))


# ---- plan builder and fused verify -------------------------------------------------------------------
def _fill_batch(p, v: dict, batch: Batch, plan: StepPlan, swa_window: int, swa_map) -> None:
    p.req_pool_indices, p.prefix_lens, p.extend_lens = (v[k].ptr for k in ("req_pool_indices", "prefix_lens", "extend_lens"))
    p.batch_size = v["req_pool_indices"].shape[0]
    rtt = v["req_to_token"]
    p.req_to_token, p.rtt_rows, p.rtt_max_len = rtt.ptr, rtt.shape[0], rtt.shape[1]
    p.rtt_row_stride = rtt.strides[0] // 4
    p.swa_window = int(swa_window)
    if swa_map is not None:
        m = checked(swa_map, "swa_map", dtype=np.int64, ndim=1)
        p.swa_map, p.swa_map_len = m.ptr, m.shape[0]
    if "expected_pool" in v:
        pool = v["expected_pool"]
        p.expected_pool, p.expected_pool_len = pool.ptr, pool.shape[1]
        p.expected_row_stride = pool.strides[0] // 8
        p.expected_valid_lens = v["expected_valid_lens"].ptr if "expected_valid_lens" in v else 0
        p.expected_token_offset = int(batch.expected_token_offset)
    p.entry_offsets = checked(plan.entry_offsets, "plan.entry_offsets", dtype=np.int64, ndim=1).ptr
    p.verify_num_valid = checked(plan.num_valid, "plan.num_valid", dtype=np.int32, shape=(1,), ndim=1).ptr
    p.verify_enable = checked(plan.enable, "plan.enable", dtype=np.int32, shape=(1,), ndim=1).ptr
    p.verify_capacity = plan.verify_capacity


def _batch_views(batch: Batch, plan: StepPlan, swa_window: int, swa_map) -> dict:
    v = batch.views()
    bs = v["req_pool_indices"].shape[0]
    if bs > plan.max_batch:
        raise ValidationError(f"kv-canary: batch size {bs} exceeds the plan's max_batch "
                              f"{plan.max_batch}; fix: StepPlan.allocate(max_batch>={bs}, ...)")
    if swa_window < 0:
        raise ValidationError(f"kv-canary: swa_window must be >= 0 (0 = no window), got {swa_window}")
    if "expected_pool" in v and v["expected_pool"].shape[0] < v["req_to_token"].shape[0]:
        raise ValidationError(f"kv-canary: batch.expected_pool must have a row per request-pool row "
                              f"({v['req_to_token'].shape[0]}, like req_to_token), got "
                              f"{v['expected_pool'].shape[0]} rows")
    if same_device(list(v.values()), "a Batch") != plan.device:
        raise ValidationError("kv-canary: the batch arrays must live on the plan's device")
    return v


def build_plan(batch: Batch, plan: StepPlan, *, swa_window: int = 0, swa_map=None, stream=None) -> None:
    """Fill ``plan`` from ``batch`` (SPEC §8): WritePlan, entry offsets, overflow rule, and the
    per-entry VerifyPlan when the plan is materialised."""
    for launch in prepare_build_plan(batch, plan, swa_window=swa_window, swa_map=swa_map, stream=stream):
        launch()


def prepare_build_plan(batch: Batch, plan: StepPlan, *, swa_window: int = 0, swa_map=None,
                       stream=None) -> list[Launch]:
    """:func:`build_plan` validated and packed (one or two launches); host arrays run now."""
    v = _batch_views(batch, plan, swa_window, swa_map)
    if plan.device is None:
        h = lambda a: None if a is None else np.asarray(a)  # noqa: E731
        vp = reference.VerifyPlanArrays(plan.slot, plan.expected_token, plan.expected_position,
                                        plan.prev_slot, plan.num_valid, plan.enable)
        wp = reference.WritePlanArrays(plan.offsets, plan.seed, plan.num_valid_reqs)
        reference.fill_plan(verify=vp, write=wp, req_pool_indices=v["req_pool_indices"].host,
                            prefix_lens=v["prefix_lens"].host, extend_lens=v["extend_lens"].host,
                            req_to_token=v["req_to_token"].host, swa_window=swa_window,
                            swa_map=h(swa_map), expected_pool=h(batch.expected_pool),
                            expected_valid_lens=h(batch.expected_valid_lens),
                            expected_token_offset=batch.expected_token_offset)
        return []
    rt = _runtime(plan.device)
    s = streams.resolve(stream, (batch.req_pool_indices,), v.values(), plan.device)
    p = abi.PrepareParams()
    _fill_batch(p, v, batch, plan, swa_window, swa_map)
    p.write_offsets = checked(plan.offsets, "plan.offsets", dtype=np.int64, ndim=1).ptr
    p.write_seed = checked(plan.seed, "plan.seed", dtype=np.int64, ndim=1).ptr
    p.write_num_valid_reqs = checked(plan.num_valid_reqs, "plan.num_valid_reqs", dtype=np.int32, ndim=1).ptr
    p.write_req_capacity = plan.max_batch
    launches = [Launch(rt, "kvc_prepare", 1, _PREPARE_BLOCK, p, s, (batch, plan, swa_map))]
    if plan.materialized:
        e = abi.ExpandParams()
        _fill_batch(e, v, batch, plan, swa_window, swa_map)
        e.plan_slot, e.plan_expected_token, e.plan_expected_position, e.plan_prev_slot = (
            checked(a, "plan entries", dtype=np.int64, ndim=1).ptr
            for a in (plan.slot, plan.expected_token, plan.expected_position, plan.prev_slot))
        launches.append(Launch(rt, "kvc_expand", _grid(rt, plan.verify_capacity), BLOCK, e, s, (batch, plan, swa_map)))
    return launches


def fused_verify(ctx: VerifyContext, batch: Batch, plan: StepPlan, *, swa_window: int = 0,
                 swa_map=None, check_expected_token: bool = False, stream=None) -> None:
    """Verify the batch's cached prefixes straight from ``req_to_token`` (after :func:`build_plan`
    filled ``plan``'s entry offsets); same rows and counters as build_plan + verify."""
    launch = prepare_fused_verify(ctx, batch, plan, swa_window=swa_window, swa_map=swa_map,
                                  check_expected_token=check_expected_token, stream=stream)
    if launch is not None:
        launch()


def prepare_fused_verify(ctx: VerifyContext, batch: Batch, plan: StepPlan, *, swa_window: int = 0,
                         swa_map=None, check_expected_token: bool = False, stream=None) -> Launch | None:
    """:func:`fused_verify` validated and packed; host arrays run on the reference now."""
    _check_plan_device(ctx, plan)
    if ctx.device is None:  # the reference has one definition: the materialised plan
        return prepare_verify(ctx, plan, check_expected_token=check_expected_token)
    v = _batch_views(batch, plan, swa_window, swa_map)
    p = ctx.params(abi.FusedVerifyParams)
    _fill_batch(p, v, batch, plan, swa_window, swa_map)
    p.check_expected_token = int(bool(check_expected_token))
    rt = _runtime(ctx.device)
    s = streams.resolve(stream, (batch.req_pool_indices, ctx.buffer.array), v.values(), ctx.device)
    name, grid, block = _verify_kernel("kvc_fused_verify", rt, p, plan.verify_capacity, ctx.hash_bytes)
    return Launch(rt, name, grid, block, p, s, (ctx, batch, plan, swa_map))
