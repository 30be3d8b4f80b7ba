"""A lost KV store in the real client (issue 43, K14), on the CPU: Hugging Face transformers continuous
batching with the canary attached, where layer 0's K/V store of one decode token is redirected to the
engine's write-trash index while the engine's bookkeeping (its write index, which the canary stamps
from) stays right. The canary fingerprints layer 0 (``layers="first"``, the default), so its TAIL write
of that step finds the slot's bytes unchanged under a new token: a ``lost_write`` row at that slot, in
that step; with ``mode="fail_request"`` that request ends FAILED and no other does.

The redirect is a device op inside the layer's store (``torch.where`` on the write index against a
target index held in a tensor, which the op clears once it has matched), so an engine's captured CUDA
graphs replay it: tests/gpu/device/test_transformers_lost_write.py runs the same scenario on CUDA with
CUDA graphs and async batching, tests/test_transformers_graphs.py's fixture on the CPU graph path.
"""

from __future__ import annotations

import contextlib

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from tests import test_transformers_cpu as tcpu  # noqa: E402

LAYER = 0  # the layer the canary fingerprints by default


@contextlib.contextmanager
def redirected_store(device: str, layer: int = LAYER):
    """While open, layer ``layer``'s K and V store of the token whose write index equals
    ``target[0]`` goes to the allocator's write-trash index instead, once (the op then sets
    ``target[0] = -1``). Yields ``target`` (an int64 device tensor; -1: nothing to redirect)."""
    from transformers.generation.continuous_batching.cache_allocators import full_attention
    cls = full_attention.FullAttentionCacheAllocator
    update = cls.update
    target = torch.full((1,), -1, dtype=torch.int64, device=device)

    def lossy_update(alloc, key_states, value_states, layer_idx, read_index, write_index):
        if layer_idx == layer:
            hit = write_index == target
            write_index = torch.where(hit, torch.full_like(write_index, alloc.write_trash_index), write_index)
            target.copy_(torch.where(hit.any(), torch.full_like(target, -1), target))
        return update(alloc, key_states, value_states, layer_idx, read_index, write_index)

    cls.update = lossy_update
    try:
        yield target
    finally:
        cls.update = update


def lost_store(device: str, *, config: dict | None = None):
    """One decode token's layer-0 store lost (redirected to the write trash) at step >= 12, under
    ``mode="fail_request"``: a lost_write row at its slot (TAIL_K_FULL and TAIL_V_FULL) in the step
    that lost it, or (async batching, the step already in flight when the hook ran) the next; that
    request FAILED with a kv-canary error, every other request FINISHED."""
    from transformers.generation.continuous_batching.requests import RequestStatus

    from kvcanary.adapters import TransformersCanary
    model = tcpu.make_model(device)
    prompts = tcpu.make_prompts(12, seed=43)
    gen = transformers.GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=-1)
    cb = transformers.ContinuousBatchingConfig(page_size=tcpu.PAGE, num_blocks=512, max_batch_tokens=64,
                                               max_requests_per_batch=16, **{**tcpu.CONFIG, **(config or {})})
    hit = {}
    with redirected_store(device) as target:
        def before(info):
            if hit or info.step < 12:
                return
            alloc = tcpu.allocator(info)
            for rid, past, q in info.requests:
                if q == 1 and past > tcpu.PAGE:  # a decoding request: its new token at position `past`
                    tcpu.sync()
                    target.fill_(tcpu.physical_index(alloc, rid, past))
                    tcpu.sync()
                    hit.update(step=info.step, rid=rid, position=past, slot=tcpu.canary_slot(alloc, rid, past))
                    return

        tc = TransformersCanary(model, mode="fail_request", before_step=before)
        try:
            with tc:
                out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                           persistent_manager=True)
        finally:
            model.destroy_cached_continuous_batching_manager()
        tcpu.sync()
        consumed = int(target.item()) == -1
    tcpu.report(f"lost store {device}", tc, hit)
    assert hit and consumed, f"the redirect never ran (hit={hit}): the target index was not written"
    rows = [d for d in tc.detections if "lost_write" in d["fail_reason"]]
    assert rows and {d["slot_idx"] for d in tc.detections} == {hit["slot"]}, tc.detections
    assert {d["launch_tag"] for d in rows} == {"TAIL_K_FULL", "TAIL_V_FULL"}, rows
    steps = {d["step"] for d in tc.detections}
    in_flight = bool(cb.use_async_batching)
    assert steps == {hit["step"]} or (in_flight and steps == {hit["step"] + 1}), (steps, hit)
    assert all(d["fail_reason"] == ["lost_write"] and d["position"] == hit["position"] for d in rows), rows
    failed = out[hit["rid"]]
    assert failed.status == RequestStatus.FAILED and "kv-canary: request" in failed.error, failed
    assert str(hit["slot"]) in failed.error
    others = [o for k, o in out.items() if k != hit["rid"]]
    assert all(o.status == RequestStatus.FINISHED and o.error is None for o in others)
    assert {f["request_id"] for f in tc.failed_requests} == {hit["rid"]}
    return hit


def test_lost_store_is_reported_in_its_step_and_fails_its_request():
    lost_store("cpu")


def test_without_the_redirect_the_same_run_is_clean():
    """The scenario's generation with the redirect armed at nothing: no row, no failed request (the
    wrapper alone changes nothing)."""
    from kvcanary.adapters import TransformersCanary
    model = tcpu.make_model("cpu")
    prompts = tcpu.make_prompts(12, seed=43)
    plain = tcpu.generate(model, prompts, max_new_tokens=24)
    with redirected_store("cpu"):
        tc = TransformersCanary(model, mode="fail_request")
        guarded = tcpu.generate(model, prompts, max_new_tokens=24, canary=tc)
    assert tc.detections == [] and guarded == plain
