"""The ops on host arrays: a validated op's state and batch views handed to the CPU reference
(:mod:`kvcanary.reference.canary`, :mod:`kvcanary.reference.plan`), which runs the launch now and
mutates the host arrays as the kernel mutates device memory (docs/format.md §5-§8). Only
:mod:`kvcanary.ops.bind` calls these, after its checks; each mutates the host state and returns nothing.
"""

from __future__ import annotations

from .. import abi
from ..reference import canary as reference
from ..reference import plan as reference_plan
from .batch import Batch, StepPlan
from .state import VerifyContext, ViolationSink


def _ref_sources(ctx: VerifyContext) -> list[reference.RefSource]:
    return [reference.RefSource(m.view.host, m.page_size, m.bytes_per_token, m.hash_bytes)
            for m in ctx.marshalled]


def _ref_sink(sink: ViolationSink) -> dict:
    return dict(ring=sink.ring_view.host, write_index=sink.write_index_view.host,
                claim=None if sink.claim_view is None else sink.claim_view.host,
                consumed=None if sink.consumed_view is None else sink.consumed_view.host,
                verdicts=_verdicts(sink))


def _verdicts(sink: ViolationSink) -> reference.Verdicts | None:
    """The sink's request verdict arrays (docs/format.md §5.7) as the reference takes them."""
    views = (sink.verdicts_view, sink.failed_view, sink.ring_requests_view)
    if all(v is None for v in views):
        return None
    return reference.Verdicts(*(None if v is None else v.host for v in views))


def _ref_counters(ctx: VerifyContext) -> dict:
    s = ctx.sink
    return dict(kernel_run_counter=s.kernel_run_view.host, slot_run_counter=s.slot_run_view.host, **_ref_sink(s))


def _ref_self_test(ctx: VerifyContext) -> dict:
    view = ctx.self_test_view
    return dict(self_test=None if view is None else view.host, self_test_every=ctx.self_test_every)


def _report(sink: ViolationSink):
    """Host rows (and the request each is attributed to) -> the sink's ring, as kvc_record appends them."""
    return lambda rows, requests=None: reference.ring_append(**_ref_sink(sink), rows=rows, requests=requests)


def _report_batch(sink: ViolationSink):
    """The plan builder's BATCH rows -> the sink's ring, each attributed to the request it names
    (its POSITION column; NO_REQUEST for the flat token arrays)."""
    return lambda rows: _report(sink)(rows, rows[:, abi.COL_POSITION])


def verify(ctx: VerifyContext, views: dict, num_valid, enable, check: bool, entry_offsets=None) -> None:
    """One verify over the plan's entry ``views`` and flags; rows attributed through the plan's
    ``entry_offsets`` view when given."""
    offsets = None if entry_offsets is None else entry_offsets.host
    reference.verify(canary=ctx.buffer.view.host, **{k: v.host for k, v in views.items()},
                     num_valid=num_valid.host, enable=enable.host, sources=_ref_sources(ctx),
                     tag=int(ctx.tag), check_expected_token=check, **_ref_counters(ctx), **_ref_self_test(ctx),
                     entry_offsets=offsets, plan_requests=0 if offsets is None else len(offsets) - 1)


def write(ctx: VerifyContext, views: tuple) -> None:
    """One write of the token views and the plan's write views (``prepare_write``'s order)."""
    tok, pos, loc, exp_tok, exp_pos, offsets, seed, nreq = views
    reference.write(canary=ctx.buffer.view.host, offsets=offsets.host, seed=seed.host,
                    num_valid_reqs=nreq.host, input_ids=tok.host, positions=pos.host,
                    out_cache_loc=loc.host,
                    expected_input_ids=None if exp_tok is None else exp_tok.host,
                    expected_positions=None if exp_pos is None else exp_pos.host,
                    chain_position_assert=ctx.flag_view.host, sources=_ref_sources(ctx),
                    tag=int(ctx.tag), **_ref_counters(ctx))


def build_plan(plan: StepPlan, batch: Batch, v: dict, window: int, loc, sink: ViolationSink, tag,
               reset_verdicts: bool = True) -> None:
    """Fill ``plan`` from the batch views ``v``; rejected requests are reported through ``sink``
    (after its request verdicts are reset, when ``reset_verdicts``: a step's first build)."""
    h = lambda k: v[k].host if k in v else None  # noqa: E731
    verdicts = _verdicts(sink)
    if reset_verdicts and verdicts is not None:
        verdicts.reset()
    reference_plan.fill_plan(
        verify=reference_plan.VerifyPlanArrays(plan.slot, plan.expected_token, plan.expected_position,
                                               plan.prev_slot, plan.num_valid, plan.enable),
        write=reference_plan.WritePlanArrays(plan.offsets, plan.seed, plan.num_valid_reqs),
        req_pool_indices=h("req_pool_indices"), prefix_lens=h("prefix_lens"), extend_lens=h("extend_lens"),
        req_to_token=h("req_to_token"), swa_window=window, swa_map=h("swa_map"),
        expected_pool=h("expected_pool"), expected_valid_lens=h("expected_valid_lens"),
        expected_token_offset=batch.expected_token_offset, entry_offsets=plan.entry_offsets,
        out_cache_loc=None if loc is None else loc.host, report=_report_batch(sink), tag=int(tag))


def fused_verify(ctx: VerifyContext, batch: Batch, plan: StepPlan, v: dict, window: int, check: bool) -> None:
    """One fused verify of the batch views ``v`` against the entry offsets ``plan`` holds."""
    h = lambda k: v[k].host if k in v else None  # noqa: E731
    rtt = h("req_to_token")
    q = reference_plan.requests(h("req_pool_indices"), h("prefix_lens"), h("extend_lens"), rtt.shape, window)
    num_valid, enable = plan.flag_views()
    rows, active, skipped, requests = reference_plan.fused_verify_rows(
        canary=ctx.buffer.view.host, q=q, entry_offsets=plan.entry_offsets, num_valid=num_valid.host,
        enable=enable.host, capacity=plan.verify_capacity, req_to_token=rtt, sources=_ref_sources(ctx),
        tag=int(ctx.tag), check_expected_token=check, swa_map=h("swa_map"), expected_pool=h("expected_pool"),
        expected_valid_lens=h("expected_valid_lens"), expected_token_offset=batch.expected_token_offset,
        fingerprint_every=ctx.fingerprint_every, fingerprint_phase=ctx.phase(), with_requests=True)
    s = ctx.sink
    s.kernel_run_view.host[0] += 1
    _report(s)(reference.self_test_rows(run=int(s.kernel_run_view.host[0]), num_slots=ctx.buffer.num_slots,
                                        tag=int(ctx.tag), **_ref_self_test(ctx)))
    if active >= 0:
        s.slot_run_view.host[0] += active
        if skipped and s.skips_view is not None:
            s.skips_view.host[0] += skipped
        _report(s)(rows, requests)
