"""RequestFailer (mode="fail_request" of the transformers client) on duck-typed engine objects shaped
like transformers 5.24's: which request is failed, which tokens the engine's update still gets, and
what happens to the blocks' content hashes. The real engine runs in tests/test_transformers_cpu.py
(scenario ``failed_request``) and on the GPU tier."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from kvcanary import FailedRequest, abi
from kvcanary.adapters.transformers_fail import RequestFailer, check_engine
from kvcanary.errors import CorruptedKvError, ValidationError


class Ledger:
    def __init__(self):
        self.hash_to_block, self.block_to_hash, self.cached_blocks = {}, {}, {}


class Pool:
    def __init__(self):
        self.freed = []

    def free_blocks(self, index, blocks):
        self.freed += blocks


class Engine:
    """A processor with one allocator: requests' block tables, a ledger, a scheduler that frees."""

    def __init__(self, tables: dict):
        self.alloc = NS(index=0, ledger=Ledger(), pool=Pool(), block_table={k: list(v) for k, v in tables.items()})
        self.cache = NS(cache_allocators={"full_attention": self.alloc}, mark_complete_blocks=lambda *a: None)
        self.states = {rid: NS(request_id=rid, status=2, generated_tokens=[1, 2]) for rid in tables}
        self.delivered = []
        self.scheduler = NS(active_requests=dict(self.states), finish_request=self._finish)
        self.inputs_and_outputs = NS(prepare_batch_update=lambda: None)

    def _finish(self, rid):
        self.alloc.block_table.pop(rid, None)
        self.scheduler.active_requests.pop(rid, None)

    def _handle_request_error(self, error, state):
        state.status = 4
        self.delivered.append((state.request_id, error))

    def hashed(self, block, h):
        self.alloc.ledger.block_to_hash[block], self.alloc.ledger.hash_to_block[h] = h, block


class Canary:
    def __init__(self, failed):
        self.failed = list(failed)

    def failed_requests(self):
        out, self.failed = self.failed, []
        return out


def futures(engine, ids, new_token=True):
    return [NS(state=engine.states[rid], has_new_token=new_token) for rid in ids]


def failed(step, index, slots=()):
    return FailedRequest(step, index, abi.FailReason.VERIFY_REAL_KV_HASH_MISMATCH, tuple(slots))


def test_the_failed_request_is_ended_and_dropped_with_its_token_and_logprob():
    e = Engine({"a": [3], "b": [4, 5], "c": [6]})
    f = RequestFailer(page_size=16)
    f.noted(7, ["a", "b", "c"], None)
    batch = futures(e, ["a", "b", "c"])
    batch[0].has_new_token = False  # a is still prefilling: no token of its own in the update
    out = f.update(e, Canary([failed(7, 1, [4 * 16 + 2])]), (batch, [11, 12], [0.1, 0.2]))
    assert [x.state.request_id for x in out[0]] == ["a", "c"] and out[1] == [12] and out[2] == [0.2]
    (rid, err), = e.delivered
    assert rid == "b" and isinstance(err, CorruptedKvError) and "in step 7" in str(err) and "[66]" in str(err)
    assert e.states["b"].status == 4 and "b" not in e.scheduler.active_requests
    assert f.failed == [{"request_id": "b", "step": 7, "reasons": "verify_real_kv_hash", "slots": [66],
                         "blocks": {"full_attention": [4, 5]}, "ended": True}]
    # async batching: the next step was launched with b in it before its update; b is dropped there too
    f.noted(8, ["a", "b", "c"], None)
    out = f.update(e, Canary([]), (futures(e, ["a", "b", "c"]), [21, 22, 23], None))
    assert [x.state.request_id for x in out[0]] == ["a", "c"] and out[1] == [21, 23] and out[2] is None
    assert len(e.delivered) == 1, "a request is failed (and delivered) once"


def test_a_verdict_of_a_later_step_waits_for_that_step_s_update():
    e = Engine({"a": [1], "b": [2]})
    f = RequestFailer(page_size=16)
    f.noted(3, ["a", "b"], None)
    f.noted(4, ["a", "b"], None)
    canary = Canary([failed(4, 0)])
    out = f.update(e, canary, (futures(e, ["a", "b"]), [5, 6], None))  # step 3's update
    assert out[1] == [5, 6] and e.delivered == [], "step 3 was clean for a: its token is kept"
    out = f.update(e, canary, (futures(e, ["a", "b"]), [7, 8], None))  # step 4's
    assert out[1] == [8] and [r for r, _ in e.delivered] == ["a"]


def test_a_request_that_already_ended_is_not_failed_again_but_its_blocks_are_forgotten():
    e = Engine({"a": [2], "b": [9]})
    e.hashed(9, 900)
    e.alloc.ledger.cached_blocks[9] = None  # b finished earlier: its hashed block is cached, unreferenced
    e._finish("b")
    e.states["b"].status = 3  # FINISHED
    f = RequestFailer(page_size=16)
    f.noted(1, ["a", "b"], None)
    f.update(e, Canary([failed(1, 1, [9 * 16])]), (futures(e, ["a", "b"]), [1, 2], None))
    assert e.delivered == [] and f.failed[0]["ended"] is False
    led = e.alloc.ledger
    assert 9 not in led.block_to_hash and 900 not in led.hash_to_block and 9 not in led.cached_blocks
    assert e.alloc.pool.freed == [9], "an unreferenced block that lost its hash goes back to the pool"


def test_a_poisoned_block_another_request_holds_never_gets_its_hash_back():
    e = Engine({"a": [1, 2], "b": [2, 3]})  # block 2 shared by a and b
    e.hashed(2, 200)
    f = RequestFailer(page_size=16)
    f.noted(5, ["a"], None)
    f.update(e, Canary([failed(5, 0, [2 * 16 + 1])]), (futures(e, ["a"]), [1], None))
    led = e.alloc.ledger
    assert 2 not in led.block_to_hash and f.poisoned == {"full_attention": {2}}  # block 1: a's alone, freed
    e.hashed(2, 200)  # b completes a block: the engine hashes every full block without a hash again
    f.guard(e.cache)
    assert 2 not in led.block_to_hash and 200 not in led.hash_to_block
    e._finish("b")
    f.guard(e.cache)
    assert f.poisoned == {"full_attention": set()}, "a block no request holds is written afresh by its next owner"


@pytest.mark.parametrize("path", ["_handle_request_error", "scheduler.finish_request",
                                  "inputs_and_outputs.prepare_batch_update", "cache.mark_complete_blocks"])
def test_an_engine_without_what_fail_request_needs_is_refused_naming_it(path):
    e = Engine({"a": [1]})
    check_engine(e)
    proc = NS(**vars(e), _handle_request_error=e._handle_request_error)  # a copy without class attributes
    head, _, name = path.rpartition(".")
    if head:
        setattr(proc, head, NS(**{k: v for k, v in vars(getattr(e, head)).items() if k != name}))
    else:
        delattr(proc, name)
    with pytest.raises(ValidationError, match=rf"mode='fail_request' needs the batch processor's {path}"):
        check_engine(proc)


def test_the_error_names_at_most_eight_slots_and_how_many_more():
    err = CorruptedKvError("r", failed(4, 0, range(1, 21)))
    assert "slots [1, 2, 3, 4, 5, 6, 7, 8] (+12 more)" in str(err) and "in step 4" in str(err)


def test_noted_steps_the_engine_never_updates_do_not_pile_up():
    f = RequestFailer(page_size=16)
    for step in range(200):
        f.noted(step, ["a"], None)
    assert len(f.steps) == 64 and min(f.steps) == 136


def test_a_failed_requests_id_is_forgotten_once_updates_stop_carrying_it():
    """Catches a failed id dropped forever: engines reuse request ids (a persistent manager's next
    generation may name a request as an earlier one was), and such a request lost every token."""
    e = Engine({"a": [1], "b": [2]})
    f = RequestFailer(page_size=16)
    f.noted(1, ["a", "b"], None)
    f.update(e, Canary([failed(1, 0)]), (futures(e, ["a", "b"]), [5, 6], None))  # a fails here
    out = f.update(e, Canary([]), (futures(e, ["a", "b"]), [7, 8], None))         # async: a once more
    assert [x.state.request_id for x in out[0]] == ["b"] and out[1] == [8]
    for tokens in ([9], [10]):                                                      # two updates without a
        f.update(e, Canary([]), (futures(e, ["b"]), tokens, None))
    e.states["a"] = NS(request_id="a", status=2, generated_tokens=[])              # a new request "a"
    out = f.update(e, Canary([]), (futures(e, ["a", "b"]), [11, 12], None))
    assert [x.state.request_id for x in out[0]] == ["a", "b"] and out[1] == [11, 12]


def test_a_request_failed_by_two_steps_verdicts_is_one_failed_request():
    """Async batching: step 12 ran with request b before step 11's update failed it, and step 12's
    verdict names b again. One failure (delivered once, one record); the later step's blocks are poisoned too."""
    e = Engine({"a": [1], "b": [2, 3]})
    f = RequestFailer(page_size=16)
    f.noted(11, ["a", "b"], None)
    f.noted(12, ["a", "b"], None)
    f.update(e, Canary([failed(11, 1, [2 * 16])]), (futures(e, ["a", "b"]), [5, 6], None))
    e.alloc.block_table["b"] = [7]  # (the engine freed b's blocks; the test names another for step 12)
    out = f.update(e, Canary([failed(12, 1, [7 * 16 + 3])]), (futures(e, ["a", "b"]), [7, 8], None))
    assert [x.state.request_id for x in out[0]] == ["a"] and out[1] == [7]
    assert [(r["request_id"], r["step"]) for r in f.failed] == [("b", 11)]
    assert [r for r, _ in e.delivered] == ["b"]
    assert 7 in f.poisoned["full_attention"], "the later step's blocks are kept out of reuse too"


def test_a_request_that_ended_before_its_verdicts_is_counted_once():
    e = Engine({"a": [1], "b": [9]})
    e._finish("b")
    e.states["b"].status = 3  # FINISHED in the step that read the bad KV
    f = RequestFailer(page_size=16)
    f.noted(1, ["a", "b"], None)
    f.noted(2, ["a", "b"], None)
    f.update(e, Canary([failed(1, 1, [9 * 16]), failed(2, 1, [9 * 16])]), (futures(e, ["a", "b"]), [1, 2], None))
    f.update(e, Canary([]), (futures(e, ["a", "b"]), [3, 4], None))
    assert [(r["request_id"], r["step"], r["ended"]) for r in f.failed] == [("b", 1, False)]
    assert e.delivered == []
