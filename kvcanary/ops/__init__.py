"""Public canary operations (docs/format.md §6-§8): validate on the host, then run the CPU
reference (host arrays) or launch on the device (device arrays).

Each op is :mod:`kvcanary.ops.bind`'s validation and packing of that op, run now. Called eagerly on device
arrays, an op keeps its packed launches per array layout on its state (:mod:`kvcanary.ops.packing`:
validated once per layout, the addresses of each call patched in and checked); host arrays are
validated and run on the reference every call. Nothing here synchronises on the device path.
Launches go on ``stream`` or the default of :mod:`kvcanary.runtime.streams`.
"""

from __future__ import annotations

from operator import attrgetter

from ..runtime.launch import Launch
from . import packing
from .backends import executor
from .batch import BATCH_FIELD_NAMES, Batch, StepPlan
from .bind import Bound, bind_build_plan, bind_fused_verify, bind_verify, bind_write
from .state import VerifyContext

_PLAN_ARRAYS = ("offsets", "seed", "num_valid_reqs", "entry_offsets", "num_valid", "enable", "slot",
                "expected_token", "expected_position", "prev_slot")
_plan_arrays = attrgetter(*_PLAN_ARRAYS)  # the tuple of them, in one call


def _plan_key(plan: StepPlan):
    """What a launch reads of ``plan`` (None: not keyable, never cached). The plan itself stays
    alive with every launch packed from it, so its id is not reused while an entry holds it."""
    arrays = _plan_arrays(plan)
    if not packing.FIXED_STATE.issuperset(map(type, arrays)):  # an array of the caller's: by layout and address
        arrays = packing.state_key(arrays)
    return None if arrays is None else (id(plan), plan.max_batch, plan.verify_capacity, plan.device, arrays)


def _scalar(value):
    return type(value), value


def _batch_order(batch: Batch, swa_map) -> tuple:
    """The batch's arrays in the order of ``Batch.views`` (the stream a launch falls back to is the
    first producer stream among them)."""
    b = batch
    return (b.req_pool_indices, b.prefix_lens, b.extend_lens, b.req_to_token, b.input_ids, b.positions,
            b.out_cache_loc, b.expected_input_ids, b.expected_positions, b.swa_out_cache_loc, b.expected_pool,
            b.expected_valid_lens if b.expected_pool is not None else None, swa_map)


def _run(launches) -> None:
    for launch in launches:
        launch()


# ---- bound, then run on the arrays' backend ----------------------------------------------------------
def prepare_verify(ctx, plan, *, check_expected_token=False, stream=None, per_request=False) -> Launch | None:
    """:func:`bind_verify`, then its backend: host arrays run on the reference now (None), device
    arrays give the packed launch (not launched)."""
    return _one(bind_verify(ctx, plan, check_expected_token=check_expected_token, per_request=per_request), stream)


def prepare_write(ctx, plan, input_ids, positions, out_cache_loc, *, expected_input_ids=None,
                  expected_positions=None, stream=None, chain_from=None) -> Launch | None:
    """:func:`bind_write`, then its backend (as :func:`prepare_verify`)."""
    return _one(bind_write(ctx, plan, input_ids, positions, out_cache_loc, expected_input_ids=expected_input_ids,
                           expected_positions=expected_positions, chain_from=chain_from), stream)


def prepare_build_plan(batch, plan, *, swa_window=0, swa_map=None, ctx=None, stream=None,
                       reset_verdicts=True) -> list[Launch]:
    """:func:`bind_build_plan`, then its backend: the packed launches ([] on the host: the reference ran)."""
    bound = bind_build_plan(batch, plan, swa_window=swa_window, swa_map=swa_map, ctx=ctx, reset_verdicts=reset_verdicts)
    return executor(plan.device).prepare(bound, stream)


def prepare_fused_verify(ctx, batch, plan, *, swa_window=0, swa_map=None, check_expected_token=False,
                         stream=None) -> Launch | None:
    """:func:`bind_fused_verify`, then its backend (as :func:`prepare_verify`)."""
    return _one(bind_fused_verify(ctx, batch, plan, swa_window=swa_window, swa_map=swa_map,
                                  check_expected_token=check_expected_token), stream)


def _one(bound: Bound, stream) -> Launch | None:
    launches = executor(bound.device).prepare([bound], stream)
    return launches[0] if launches else None


# ---- verify --------------------------------------------------------------------------------------
def verify(ctx: VerifyContext, plan: StepPlan, *, check_expected_token: bool = False, stream=None,
           per_request: bool = False) -> None:
    """Verify the materialised plan's entries against ``ctx`` (docs/format.md §6). Read-only on the buffer.
    ``per_request``: attribute each row to its request through the plan's entry offsets (§5.7)."""
    def pack():
        launch = prepare_verify(ctx, plan, check_expected_token=check_expected_token, stream=stream,
                                per_request=per_request)
        return [] if launch is None else [launch]
    if not (isinstance(ctx, VerifyContext) and isinstance(plan, StepPlan)):
        return _run(pack())
    pk = _plan_key(plan)
    head = None if pk is None else ("verify", pk, ctx.common, _scalar(check_expected_token), _scalar(per_request))
    executor(ctx.device).run_eager(ctx, head, (), (), stream, (ctx.buffer.array, plan.slot),
                (plan.slot, plan.expected_token, plan.expected_position, plan.prev_slot), pack)


# ---- write ---------------------------------------------------------------------------------------
def write(ctx: VerifyContext, plan: StepPlan, input_ids, positions, out_cache_loc, *,
          expected_input_ids=None, expected_positions=None, stream=None,
          chain_from: VerifyContext | None = None) -> None:
    """Stamp new tokens into ``ctx``'s buffer along the write plan (docs/format.md §7).
    ``chain_from``: the context of another buffer of the group stamped with these tokens earlier
    on the stream (HEAD's, for TAIL): the chain is then taken from it where it checks out
    (the chain once per step, §7); the buffer ends the same either way."""
    def pack():
        launch = prepare_write(ctx, plan, input_ids, positions, out_cache_loc, stream=stream,
                               expected_input_ids=expected_input_ids, expected_positions=expected_positions,
                               chain_from=chain_from)
        return [] if launch is None else [launch]
    if not (isinstance(ctx, VerifyContext) and isinstance(plan, StepPlan)) \
            or not (chain_from is None or isinstance(chain_from, VerifyContext)):
        return _run(pack())
    pk = _plan_key(plan)
    chain = None if chain_from is None else chain_from.common  # its buffer's address and shape
    head = None if pk is None else ("write", pk, ctx.common, chain)
    args = (input_ids, positions, out_cache_loc, expected_input_ids, expected_positions)
    executor(ctx.device).run_eager(ctx, head, args, _WRITE_NAMES, stream, (input_ids, ctx.buffer.array),
                (*args, plan.offsets, plan.seed, plan.num_valid_reqs), pack)


_WRITE_NAMES = ("input_ids", "positions", "out_cache_loc", "expected_input_ids", "expected_positions")


# ---- plan builder and fused verify -------------------------------------------------------------------
def build_plan(batch: Batch, plan: StepPlan, *, swa_window: int = 0, swa_map=None, ctx: VerifyContext | None = None,
               stream=None, reset_verdicts: bool = True) -> None:
    """Fill ``plan`` from ``batch`` (docs/format.md §8): WritePlan, entry offsets, overflow rule, and the
    per-entry VerifyPlan when the plan is materialised. Batch values the device finds out of range
    are reported through ``ctx``'s sink (tag ``ctx.tag``), else through ``plan.reject_sink``.
    ``reset_verdicts``: zero the sink's request verdicts first (§5.7; a step's first build)."""
    def pack():
        return prepare_build_plan(batch, plan, swa_window=swa_window, swa_map=swa_map, ctx=ctx, stream=stream,
                                  reset_verdicts=reset_verdicts)
    if not (isinstance(batch, Batch) and isinstance(plan, StepPlan) and (ctx is None or isinstance(ctx, VerifyContext))):
        return _run(pack())
    pk = _plan_key(plan)
    sink = (plan._reject_sink,) if ctx is None else (ctx.sink, int(ctx.tag), ctx.device)
    head = None if pk is None or sink[0] is None else ("build_plan", pk, sink, _scalar(swa_window),
                                                       _scalar(reset_verdicts))
    args = (*batch.__dict__.values(), swa_map)
    executor(plan.device).run_eager(plan, head, args, (*BATCH_FIELD_NAMES, "swa_map"), stream,
                                    (batch.req_pool_indices,),
                _batch_order(batch, swa_map), pack)


def fused_verify(ctx: VerifyContext, batch: Batch, plan: StepPlan, *, swa_window: int = 0,
                 swa_map=None, check_expected_token: bool = False, stream=None) -> None:
    """Verify the batch's cached prefixes straight from ``req_to_token`` (after :func:`build_plan`
    filled ``plan``'s entry offsets); same rows and counters as build_plan + verify when the batch
    is the one the plan was built from, and a BATCH row per request where it is not."""
    def pack():
        launch = prepare_fused_verify(ctx, batch, plan, swa_window=swa_window, swa_map=swa_map,
                                      check_expected_token=check_expected_token, stream=stream)
        return [] if launch is None else [launch]
    if not (isinstance(ctx, VerifyContext) and isinstance(batch, Batch) and isinstance(plan, StepPlan)):
        return _run(pack())
    pk = _plan_key(plan)
    head = None if pk is None else ("fused_verify", pk, ctx.common, _scalar(swa_window), _scalar(check_expected_token))
    args = (*batch.__dict__.values(), swa_map)
    executor(ctx.device).run_eager(ctx, head, args, (*BATCH_FIELD_NAMES, "swa_map"), stream,
                (batch.req_pool_indices, ctx.buffer.array), _batch_order(batch, swa_map), pack)
