"""The fail-closed hook of the SGLang and vLLM adapters (kvcanary.adapters.failures) on duck-typed
batch objects shaped like theirs: a failed batch index becomes the engine's request (SGLang's
``ScheduleBatch.reqs[i]``, its ``rid``; vLLM's ``InputBatch.req_ids[i]``) with the blocks to
evict, for the step the canary ran. The failure comes from a real host canary (tests/support/session.py):
request B (batch index 1 of step 3) reads a corrupted KV byte."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from kvcanary import CorruptedKvError, ValidationError, ValidationTypeError
from kvcanary.adapters import FailedRequests, sglang_request_ids, vllm_request_ids
from tests.support.session import Session
from tests.test_verdicts import _flip_b_cached_kv

ROW_IDS = {1: "req-A", 2: "req-B", 3: "req-C"}  # the session's request-pool rows, as an engine names them


def run(note) -> tuple[Session, FailedRequests, list]:
    """Play the session to step 3 (B's corrupted byte read), noting each step's batch through ``note``."""
    s = Session()
    hook = FailedRequests(s.canary, page_size=4)
    steps = []

    def step(work, corrupt):
        note(hook, [row for row, _ in work])
        steps.append(s.step(work, corrupt=corrupt))
    s.play(corrupt_at=3, corrupt=_flip_b_cached_kv, step=step, stop_after=3)
    return s, hook, hook.take()


def test_sglang_schedule_batch_maps_the_failed_index_to_its_req():
    reqs = {row: NS(rid=rid) for row, rid in ROW_IDS.items()}
    s, hook, failures = run(lambda hook, rows: hook.note(sglang_request_ids(NS(reqs=[reqs[r] for r in rows]))))
    (f,) = failures
    assert f.request is reqs[2] and (f.step, f.batch_index) == (3, 1)
    assert f.slots == (s.flipped,) and f.blocks == (s.flipped // 4,)
    assert isinstance(f.error, CorruptedKvError) and "'req-B'" in str(f.error) and "in step 3" in str(f.error)
    assert hook.take() == [] and hook.unmapped == 0


def test_sglang_forward_batch_rids_and_vllm_input_batch_req_ids_give_the_id():
    _, _, failures = run(lambda hook, rows: hook.note(sglang_request_ids(NS(rids=[ROW_IDS[r] for r in rows]))))
    assert [f.request for f in failures] == ["req-B"]
    _, _, failures = run(lambda hook, rows: hook.note(
        vllm_request_ids(NS(req_ids=[ROW_IDS[r] for r in rows] + [None]), num_reqs=len(rows))))
    assert [(f.request, f.batch_index) for f in failures] == [("req-B", 1)]


def test_a_step_not_noted_is_counted_not_guessed():
    s, hook, failures = run(lambda hook, rows: None)
    assert failures == [] and hook.unmapped == 1


def test_wrong_batch_objects_are_refused_naming_the_fix():
    with pytest.raises(ValidationError, match=r"needs a ScheduleBatch \(\.reqs\).*Fix: pass the ScheduleBatch"):
        sglang_request_ids(NS(req_pool_indices=[1]))
    with pytest.raises(ValidationError, match=r"InputBatch \(\.req_ids\).*Fix: pass self\.input_batch"):
        vllm_request_ids(NS())
    with pytest.raises(ValidationTypeError, match=r"note\(requests\) must be a sequence"):
        FailedRequests(Session().canary, page_size=1).note("req-A")
