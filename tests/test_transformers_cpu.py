"""A real client on the CPU: Hugging Face transformers generating with continuous batching and its paged
KV cache (``generate_batch``, ``attn_implementation="sdpa"``) on a small randomly initialised Llama, with
the canary attached through :mod:`kvcanary.adapters.transformers_paged` (CPU reference backend).

Clean: many concurrent requests, shared prompt prefixes (block sharing) and chunked prefill give no
violation, and the canary does not change what is generated — also with a block pool so small that
finished requests' blocks are handed to new ones. Faults, each in its own generation: a flipped KV
byte, a corrupted read index and a wrong input token are reported with the right reason, in the
step where the corrupted data is read and in no other. Expected slots come from the documented slot
formula (block * page_size + offset) applied to the engine's own block table, never from the adapter.

The scenarios take the device; tests/gpu/device/test_transformers_client.py runs them on CUDA.
"""

from __future__ import annotations

import inspect
import random
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

import kvcanary as kc
from kvcanary.adapters import transformers_layout

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from kvcanary.adapters import TransformersCanary  # noqa: E402

PAGE = 16
VOCAB = 512
# The engine's configuration the scenarios generate with (the plain one: no CUDA graphs, no async batching,
# no decode fast path). The GPU tier runs the same scenarios with the engine's fast settings on.
CONFIG: dict = dict(use_cuda_graph=False, use_async_batching=False, max_blocks_per_request=0)


def make_model(device: str, **config):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=4096, **config)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    model.set_attn_implementation("sdpa")  # the spelling transformers >= 5.18 wants ("paged|" is deprecated)
    return model


def make_prompts(n: int, seed: int, longest: int = 90) -> list[list[int]]:
    """Prompts in groups sharing a prefix of several pages, each with its own suffix; some are
    longer than the token budget of a step, so their prefill is chunked."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(k)] for k in (41, 58, 37)]
    return [prefixes[i % 3] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, longest))] for i in range(n)]


def generate(model, prompts, *, max_new_tokens: int, canary: TransformersCanary | None = None, num_blocks=512,
             max_requests=16, **config):
    gen = transformers.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1)
    cb = transformers.ContinuousBatchingConfig(
        page_size=PAGE, num_blocks=num_blocks, max_batch_tokens=64, max_requests_per_batch=max_requests,
        **{**CONFIG, **config})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the canary changes nothing and warns of nothing
        if canary is None:
            out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
        else:
            with canary:
                out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    assert len(out) == len(prompts) and all(o.error is None for o in out.values())
    return [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def allocator(info):
    return info.cache.cache_allocators["full_attention"]


def physical_index(alloc, rid: str, pos: int) -> int:
    """The engine's own cache index of position ``pos`` of request ``rid`` (what its write/read indices hold)."""
    block = alloc.block_table[rid][pos // alloc.tokens_per_page]
    return block * alloc.block_physical_stride + pos % alloc.tokens_per_page


def canary_slot(alloc, rid: str, pos: int) -> int:
    """The README's slot formula: block * page_size + offset."""
    return alloc.block_table[rid][pos // alloc.tokens_per_page] * alloc.tokens_per_page + pos % alloc.tokens_per_page


class Log:
    """after_step hook: the requests of every step and which request wrote each canary slot."""

    def __init__(self):
        self.steps: list[list] = []
        self.writers: dict[int, set] = {}

    def __call__(self, info):
        self.steps.append(list(info.requests))
        slots = info.batch.out_cache_loc.tolist()
        at = 0
        for rid, _, q in info.requests:
            for s in slots[at:at + q]:
                self.writers.setdefault(s, set()).add(rid)
            at += q


class Schedule:
    """Records what the engine asks of every batch it prepares — each scheduled request's id, cached
    length, new tokens and the cache blocks it holds — by wrapping ``ContinuousBatchingIOs.
    prepare_batch_tensors`` on the class (async batching prepares through it too; the canary wraps
    instances, over this). Equal records mean the engine scheduled the same requests into the same
    blocks, batch by batch, with or without CUDA graphs."""

    def __init__(self, model):
        self.model, self.steps = model, []

    def __enter__(self):
        from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
        self.cls, self.original = ContinuousBatchingIOs, ContinuousBatchingIOs.prepare_batch_tensors
        original, steps, self.on = self.original, self.steps, True

        def recording(io, requests_in_batch, *args, **kwargs):
            if not self.on:  # a persistent manager's processor, wrapped over this while on, runs on
                return original(io, requests_in_batch, *args, **kwargs)
            noted = [(f.state.request_id, f.state.position_offset, f.query_length) for f in requests_in_batch]
            out = original(io, requests_in_batch, *args, **kwargs)
            blocks = io.cache.cache_allocators["full_attention"].block_table
            steps.append([(*n, tuple(blocks.get(n[0], ()))) for n in noted])
            return out
        self.cls.prepare_batch_tensors = recording
        return self

    def __exit__(self, *exc):
        self.cls.prepare_batch_tensors = self.original
        self.on = False


def report(name: str, tc: TransformersCanary, extra: dict | None = None) -> dict:
    s = tc.summary()
    print(f"\n[{name}] transformers={transformers.__version__} requests={s['requests']} steps={s['steps']} "
          f"verified_slots={s['verified_slots']} protected_tokens={s['protected_tokens']} "
          f"prefix_shared_tokens={s['prefix_shared_tokens']} detections={s['detections']} {extra or ''}")
    for d in tc.detections[:6]:
        print(f"  step {d['step']}: {d['launch_tag']} {'+'.join(d['fail_reason'])} slot={d['slot_idx']} "
              f"position={d['position']} stored_token={d['stored_token']} expected_token={d['expected_token']}")
    return s


def detections_by_step(tc) -> dict[int, list]:
    out: dict[int, list] = {}
    for d in tc.detections:
        out.setdefault(d["step"], []).append(d)
    return out


# ---- scenarios (device-parametrised; the GPU tier reuses them) ----------------------------------------
def clean_generation(device):
    model = make_model(device)
    prompts = make_prompts(24, seed=1)
    plain = generate(model, prompts, max_new_tokens=24)
    log = Log()
    tc = TransformersCanary(model, layers="all", after_step=log)
    guarded = generate(model, prompts, max_new_tokens=24, canary=tc)
    s = report(f"clean {device}", tc)
    chunked = {}
    for reqs in log.steps:
        for rid, _, q in reqs:
            chunked[rid] = chunked.get(rid, 0) + (q > 1)
    assert tc.detections == []
    assert guarded == plain, "attaching the canary changed the generated tokens"
    assert s["requests"] == 24 and s["steps"] == len(log.steps) > 30
    assert max(len(r) for r in log.steps) >= 8, "expected many concurrent requests per step"
    assert s["prefix_shared_tokens"] >= 3 * PAGE, "expected block sharing of the common prefixes"
    assert sum(n > 1 for n in chunked.values()) >= 5, "expected chunked prefills"
    assert s["verified_slots"] > 10_000 and s["protected_tokens"] > 0 and s["skipped_verifies"] == 0


def small_pool_same_tokens(device):
    """A pool of 24 blocks for 20 requests of up to 9 blocks each: requests wait for blocks, and
    finished requests' blocks are reused by later ones. The canary must not change the schedule."""
    model = make_model(device)
    prompts = make_prompts(20, seed=5, longest=60)
    with Schedule(model) as plain_schedule:
        plain = generate(model, prompts, max_new_tokens=32, num_blocks=24)
    log = Log()
    tc = TransformersCanary(model, layers="all", after_step=log)
    with Schedule(model) as guarded_schedule:
        guarded = generate(model, prompts, max_new_tokens=32, canary=tc, num_blocks=24)
    report(f"small pool {device}", tc, {"forwards": len(plain_schedule.steps)})
    reused = sum(len(w) > 1 for w in log.writers.values())
    assert tc.detections == []
    assert guarded_schedule.steps == plain_schedule.steps, "attaching the canary changed the engine's schedule"
    assert guarded == plain, "attaching the canary changed the generated tokens under memory pressure"
    assert reused >= 4 * PAGE, f"expected finished requests' blocks to be reused, {reused} slots were"
    assert max(len(r) for r in log.steps) < 20, "expected requests to wait for blocks"


def corrupted_kv_byte(device):
    model = make_model(device)
    hit = {}

    def before(info):  # flip a byte of a cached slot (layer 0 K, inside the 16 fingerprinted bytes)
        if hit or info.step < 12:
            return
        alloc = allocator(info)
        for rid, past, q in info.requests:
            if past >= 2 * PAGE:
                pos = past - 5
                k_rows = alloc._kv_token_views[0][0]  # the view layer 0's attention writes its K through
                row = k_rows[physical_index(alloc, rid, pos)].view(-1).view(torch.uint8)
                row[3] ^= 0x40
                sync()
                hit.update(step=info.step, slot=canary_slot(alloc, rid, pos), row=row)
                return

    def after(info):  # undo it once the step is over: later steps read clean bytes again
        if hit.get("step") == info.step:
            sync()
            hit["row"][3] ^= 0x40
            sync()

    tc = TransformersCanary(model, before_step=before, after_step=after)
    generate(model, make_prompts(12, seed=2), max_new_tokens=24, canary=tc)
    report(f"kv byte {device}", tc, {k: hit[k] for k in ("step", "slot")})
    by_step = detections_by_step(tc)
    assert list(by_step) == [hit["step"]]
    for d in by_step[hit["step"]]:
        assert d["fail_reason"] == ["verify_real_kv_hash"] and d["launch_tag"] == "TAIL_K_FULL"
        assert d["slot_idx"] == hit["slot"]


def corrupted_read_index(device):
    """One decode step of one request reads the slots of positions 0..15 for positions 16..31."""
    model = make_model(device)
    hit = {}

    def before(info):
        if hit or info.step < 12:
            return
        offset = 0
        for (rid, past, q), state in zip(info.requests, info.states):
            if q == 1 and past >= 3 * PAGE + 2:
                read = info.batch_data["read_index"][0]
                read[offset + PAGE:offset + 2 * PAGE] = read[offset:offset + PAGE].clone()
                sync()
                hit.update(step=info.step, rid=rid, slots={canary_slot(allocator(info), rid, p) for p in range(PAGE)})
                return
            offset += past + q  # full attention reads every position of every request

    tc = TransformersCanary(model, before_step=before)
    generate(model, make_prompts(12, seed=3), max_new_tokens=24, canary=tc)
    report(f"read index {device}", tc, {k: hit[k] for k in ("step", "rid")})
    by_step = detections_by_step(tc)
    assert list(by_step) == [hit["step"]]
    rows = by_step[hit["step"]]
    reasons = {r for d in rows for r in d["fail_reason"]}
    assert reasons <= {"verify_chain_hash", "verify_position"} and "verify_position" in reasons
    assert {"HEAD_K_FULL", "HEAD_V_FULL"} <= {d["launch_tag"] for d in rows}
    wrong = [d for d in rows if d["launch_tag"] == "HEAD_K_FULL" and "verify_position" in d["fail_reason"]]
    # positions 16..31 read slots holding positions 0..15 (a record's position is the stored one)
    assert sorted(d["position"] for d in wrong) == list(range(PAGE)) and {d["slot_idx"] for d in wrong} == hit["slots"]


def wrong_input_token(device):
    """Under async batching a decoding request's token is carried over on the device from the
    previous batch's output (the host cannot know it yet), so there a chunked prefill's token is
    corrupted instead."""
    model = make_model(device)
    hit = {}
    carried = bool(CONFIG.get("use_async_batching"))

    def before(info):  # the model reads a different token than the request's history holds
        if hit or info.step < (1 if carried else 12):
            return
        offset = 0
        for rid, past, q in info.requests:
            if (q > 1 and past >= PAGE) if carried else (q == 1 and past > PAGE):
                ids = info.batch_data["input_ids"]
                good = int(ids[0, offset])
                ids[0, offset] = (good + 1) % VOCAB
                sync()
                hit.update(step=info.step, good=good, bad=(good + 1) % VOCAB, position=past)
                return
            offset += q

    tc = TransformersCanary(model, before_step=before)
    generate(model, make_prompts(12, seed=4), max_new_tokens=24, canary=tc)
    report(f"input token {device}", tc, hit)
    by_step = detections_by_step(tc)
    assert list(by_step) == [hit["step"]]
    rows = by_step[hit["step"]]
    assert {d["launch_tag"] for d in rows} == {"HEAD_K_FULL", "HEAD_V_FULL", "TAIL_K_FULL", "TAIL_V_FULL"}
    for d in rows:
        assert d["fail_reason"] == ["write_token"]
        assert (d["stored_token"], d["expected_token"], d["position"]) == (hit["bad"], hit["good"], hit["position"])


def overwritten_block(device):
    """An engine bug writes one request's new token into another request's cached block (request B's
    write index names a slot of request A's second page): reported in that step, at A's slot."""
    model = make_model(device)
    hit = {}

    def before(info):
        if hit or info.step < 12:
            return
        decoding = [(i, rid, past) for i, (rid, past, q) in enumerate(info.requests) if q == 1]
        victims = [(rid, past) for _, rid, past in decoding if past >= 2 * PAGE + 4]
        if len(decoding) < 2 or not victims:
            return
        a, _ = victims[0]
        b_index = next(i for i, rid, _ in decoding if rid != a)
        at = sum(q for _, _, q in info.requests[:b_index])  # B's token in the step's write index
        alloc = allocator(info)
        info.batch_data["write_index"][0][at] = physical_index(alloc, a, PAGE + 3)
        sync()
        hit.update(step=info.step, victim=a, slot=canary_slot(alloc, a, PAGE + 3))

    tc = TransformersCanary(model, before_step=before)
    generate(model, make_prompts(12, seed=7), max_new_tokens=24, canary=tc)
    report(f"overwritten block {device}", tc, hit)
    by_step = detections_by_step(tc)
    assert hit and min(by_step) == hit["step"], "the overwrite must be reported in the step it happened"
    assert hit["slot"] in {d["slot_idx"] for d in by_step[hit["step"]]}


def _fail_request_run(model, prompts, make_before, gen, cb, again=None):
    """One fail_request generation through a persistent manager, then the prompts ``again()`` gives
    through the same engine (same cache): (TransformersCanary, outputs, outputs of ``again``, the
    :class:`Schedule` of the first generation). ``make_before(tc)`` gives the canary's before_step
    callback."""
    tc = TransformersCanary(model, mode="fail_request")
    tc.before_step = make_before(tc)
    second = None
    try:
        with tc:
            with Schedule(model) as schedule:
                out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                           persistent_manager=True)
            if again is not None:
                second = model.generate_batch(again(), generation_config=gen, continuous_batching_config=cb,
                                              persistent_manager=True)
    finally:
        model.destroy_cached_continuous_batching_manager()
    return tc, out, second, schedule


def engine_ended_baseline(model, prompts, rid: str, step: int, gen, cb):
    """The baseline of a fail_request run: the same prompts with no canary, where transformers' own
    engine ends ``rid`` at step ``step`` through its error path (tests/support/engine_end.py):
    (outputs, :class:`~tests.support.engine_end.EngineEndsRequest`, :class:`Schedule`)."""
    from tests.support.engine_end import engine_ended_generation
    with Schedule(model) as schedule:
        out, ends = engine_ended_generation(model, prompts, rid, step, generation_config=gen,
                                            continuous_batching_config=cb)
    return out, ends, schedule


def assert_as_engine_ended(out, schedule, rid: str, step: int, baseline, ends, baseline_schedule) -> None:
    """A fail_request run (``out``, its :class:`Schedule`), whose canary ended ``rid`` in the update of
    step ``step``, against :func:`engine_ended_baseline` ending the same request at the same step:
    the engine ran the same steps (each step's requests, cached lengths and new tokens; block numbers
    may differ, as the failer hands the failed request's blocks back to the pool where the engine
    keeps them as cached prefix blocks), so every batch has the same shape, and every request has
    the baseline's tokens, the failed one included. The same shapes are what makes this exact for
    bf16 on CUDA as well, whose numerics follow the batch's shape (a run without the failed request,
    or ending it a step early or late, may change another request's tokens there, canary or not)."""
    from transformers.generation.continuous_batching.requests import RequestStatus
    assert ends.ended is not None and ends.ended["step"] == step, f"the engine never ended {rid} at step {step}"
    assert ends.dropped[0] == step and ends.dropped == list(range(step, step + len(ends.dropped))) \
        and len(ends.dropped) <= 2, f"{rid} dropped from the updates of steps {ends.dropped}"
    ran = [[r[:3] for r in s] for s in schedule.steps]
    ran_baseline = [[r[:3] for r in s] for s in baseline_schedule.steps]
    differ = next((i for i, (a, b) in enumerate(zip(ran, ran_baseline)) if a != b), None)
    assert ran == ran_baseline, (f"the engine's steps differ from the engine-ended baseline's ({len(ran)} and "
                                 f"{len(ran_baseline)} batches prepared; first at batch {differ}: "
                                 f"{ran[differ] if differ is not None else ''} and "
                                 f"{ran_baseline[differ] if differ is not None else ''})")
    assert baseline[rid].status == RequestStatus.FAILED
    assert out[rid].generated_tokens == baseline[rid].generated_tokens, \
        "the failed request's tokens differ from those of the request the engine ended at that step"
    assert sorted(out) == sorted(baseline)
    changed = {k: (out[k].generated_tokens, baseline[k].generated_tokens) for k in out
               if k != rid and out[k].generated_tokens != baseline[k].generated_tokens}
    assert not changed, f"requests whose tokens differ from the engine-ended baseline's: {changed}"


def _in_order(outputs: dict, skip=None) -> list:
    return [outputs[k].generated_tokens for k in sorted(outputs, key=lambda k: int(k.split("_")[-1])) if k != skip]


def failed_request(device):
    """mode="fail_request" (issue 28): a KV byte of one request's own block is flipped and left so.
    That request ends FAILED with a kv-canary error in the step that verified it, keeping the tokens
    of the steps before; no other request fails. The baseline is a run with no canary in which the
    engine itself ends the same request at the same step (its error path, tests/support/engine_end.py):
    the engine runs the same steps in both, and every request has the baseline's tokens, the failed
    one included (:func:`assert_as_engine_ended`; on the CPU the others also have those of a plain
    clean run). Its blocks are kept out of prefix reuse: the same prompt sent again through the same
    engine (persistent manager, same cache) recomputes the corrupted block and runs clean, with the
    tokens of a fresh run of that prompt alone."""
    from transformers.generation.continuous_batching.requests import RequestStatus

    model = make_model(device)
    prompts = make_prompts(12, seed=2)
    gen = transformers.GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=-1)
    cb = transformers.ContinuousBatchingConfig(page_size=PAGE, num_blocks=512, max_batch_tokens=64,
                                               max_requests_per_batch=16, **CONFIG)
    hit, admitted, phase = {}, {}, [0]

    def corrupt(tc):
        def before(info):
            for rid, past, _ in info.requests:
                admitted.setdefault((phase[0], rid), past)  # cached tokens when first scheduled
            if hit or info.step < 12:
                return
            alloc = allocator(info)
            for (rid, past, q), state in zip(info.requests, info.states):
                # position 69 (block 4) lies past every shared prefix (<= 58 tokens): a block of its own,
                # and a full block of the prompt, which a request sending the same prompt would match
                if past > 5 * PAGE and len(state.initial_tokens) >= 5 * PAGE:
                    pos = 4 * PAGE + 5
                    row = alloc._kv_token_views[0][0][physical_index(alloc, rid, pos)].view(-1).view(torch.uint8)
                    row[3] ^= 0x40
                    sync()
                    hit.update(step=info.step, rid=rid, pos=pos, slot=canary_slot(alloc, rid, pos),
                               generated=len(state.generated_tokens))
                    return
        return before

    def again():
        phase[0] = 1
        return [prompts[int(hit["rid"].split("_")[-1])]]

    tc, out, second, schedule = _fail_request_run(model, prompts, corrupt, gen, cb, again=again)
    r = int(hit["rid"].split("_")[-1])
    report(f"failed request {device}", tc, {k: hit[k] for k in ("step", "rid", "slot")})
    baseline, ends, baseline_schedule = engine_ended_baseline(model, prompts, hit["rid"], hit["step"], gen, cb)
    solo = generate(model, [prompts[r]], max_new_tokens=24)[0]

    failed = out[hit["rid"]]
    assert failed.status == RequestStatus.FAILED and "kv-canary: request" in failed.error, failed
    assert f"in step {hit['step']}" in failed.error and str(hit["slot"]) in failed.error
    got = failed.generated_tokens
    assert hit["generated"] <= len(got) <= hit["generated"] + 1, \
        "the failed request keeps the tokens of the steps before the one that verified the corruption"
    others = {k: o for k, o in out.items() if k != hit["rid"]}
    assert all(o.status == RequestStatus.FINISHED and o.error is None for o in others.values())
    assert_as_engine_ended(out, schedule, hit["rid"], hit["step"], baseline, ends, baseline_schedule)
    records = tc.failed_requests
    assert records[0]["request_id"] == hit["rid"] and records[0]["step"] == hit["step"] and records[0]["ended"]
    assert hit["slot"] in records[0]["slots"] and hit["slot"] // PAGE in records[0]["blocks"]["full_attention"]
    assert [f["request_id"] for f in records] == [hit["rid"]], "only the request that read the corruption fails"
    assert tc.summary()["failed_requests"] == 1, "one failed request, whatever the steps whose verdicts name it"
    (again_out,) = second.values()
    assert again_out.status == RequestStatus.FINISHED and again_out.generated_tokens == solo
    assert admitted[1, again_out.request_id] <= hit["pos"] // PAGE * PAGE, \
        "the corrupted block was offered for prefix reuse"
    assert all(d["step"] <= hit["step"] + 1 for d in tc.detections), "the same prompt sent again must run clean"
    if device == "cpu":
        clean = generate(model, prompts, max_new_tokens=24)
        assert got == clean[r][:len(got)] and _in_order(out, hit["rid"]) == [t for i, t in enumerate(clean) if i != r]
        assert solo == clean[r]


def test_the_engine_ends_a_request_at_the_step_it_is_given():
    """Catches a fail_request baseline that ends its request elsewhere than asked
    (tests/support/engine_end.py, no canary anywhere): the engine ends req_0 in the update of step
    n, FAILED with the error and the tokens of a clean run before that step (one more when ended a
    step later), dropped from that update only (sync batching) and never scheduled again; every
    other request has the clean run's tokens (fp32 on the CPU)."""
    from transformers.generation.continuous_batching.requests import RequestStatus
    model = make_model("cpu")
    prompts = make_prompts(12, seed=2)
    gen = transformers.GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=-1)
    cb = transformers.ContinuousBatchingConfig(page_size=PAGE, num_blocks=512, max_batch_tokens=64,
                                               max_requests_per_batch=16, **CONFIG)
    clean = generate(model, prompts, max_new_tokens=24)
    kept = {}
    for step in (12, 13):
        out, ends, schedule = engine_ended_baseline(model, prompts, "req_0", step, gen, cb)
        failed = out["req_0"]
        assert failed.status == RequestStatus.FAILED and f"at step {step}" in failed.error, failed
        assert ends.ended["step"] == step and ends.dropped == [step] and ends.steps == len(schedule.steps)
        assert "req_0" in ends.ended["batch"]
        assert all("req_0" not in [r[0] for r in s] for s in schedule.steps[step + 1:])
        assert failed.generated_tokens == ends.ended["generated"] == clean[0][:len(failed.generated_tokens)]
        assert _in_order(out, "req_0") == clean[1:]
        kept[step] = len(failed.generated_tokens)
    assert 0 < kept[12] and kept[13] == kept[12] + 1, kept


SCENARIOS = [clean_generation, small_pool_same_tokens, corrupted_kv_byte, corrupted_read_index, wrong_input_token,
             overwritten_block, failed_request]


def compiled_same_tokens(device):
    """torch.compile on (``default_compile_level=1``, the one speed setting a CPU user has; on CUDA the
    same padding as CUDA graphs): every step is padded to a static shape, and the padding tokens write
    to the engine's write-trash block. The canary keeps the compile config, reports nothing on a
    clean run with shared prefixes and block reuse, and the tokens equal the same compiled run
    without it (the canary used to drop the compile config, which changed 8 of 12 bf16 requests'
    tokens, and with the config kept refused every padded batch)."""
    model = make_model(device)
    prompts = make_prompts(12, seed=8, longest=40)
    config = dict(default_compile_level=1, num_blocks=24)
    plain = generate(model, prompts, max_new_tokens=12, **config)
    padded = []
    tc = TransformersCanary(model, layers="all",
                            after_step=lambda info: padded.append(int(info.batch.out_cache_loc.shape[0])
                                                                  - sum(q for _, _, q in info.requests)))
    guarded = generate(model, prompts, max_new_tokens=12, canary=tc, **config)
    s = report(f"compiled {device}", tc, {"padded_steps": sum(p > 0 for p in padded)})
    assert tc.detections == []
    assert guarded == plain, "attaching the canary changed the compiled run's tokens"
    assert sum(p > 0 for p in padded) >= 3, "expected padded (static-shape) steps"
    assert s["prefix_shared_tokens"] >= PAGE and s["verified_slots"] > 1000


@pytest.mark.parametrize("scenario", SCENARIOS + [compiled_same_tokens], ids=lambda f: f.__name__)
def test_transformers_cpu(scenario):
    scenario("cpu")


# ---- what is refused, and how ---------------------------------------------------------------------
def test_a_cuda_cache_stages_each_step_on_the_device_by_default():
    assert inspect.signature(TransformersCanary).parameters["stage_on_device"].default is True


def test_supported_range_is_the_declared_extra():
    """The adapter's range is the one ``pip install 'kvcanary[transformers]'`` installs, and the
    installed transformers (the one these tests ran with) is inside it."""
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    extra = re.search(r'^transformers = \[(.*?)\]', text, re.M | re.S).group(1)
    assert f'"transformers{transformers_layout.SUPPORTED_TRANSFORMERS}"' in extra
    transformers_layout.check_transformers_version(transformers.__version__)


@pytest.mark.parametrize("version", ["5.17.0", "5.12.1", "4.57.6", "5.26.0", "5.26.0.dev0", "6.0.0", "nightly"])
def test_unsupported_transformers_is_refused_naming_the_range(version, monkeypatch):
    from kvcanary.adapters import transformers_paged
    monkeypatch.setattr(transformers_paged, "_installed_transformers", lambda: version)
    with pytest.raises(kc.ValidationError, match=r"kv-canary: TransformersCanary supports transformers >=5\.18,<5\.26 \(checked against "
                                                  r"5\.18\.0, 5\.24\.0, 5\.25\.0\), got transformers "
                                                  + re.escape(version) + r".*fix: pip install"):
        TransformersCanary(object())


@pytest.mark.parametrize("version", ["5.18.0", "5.20.2", "5.24.0", "5.24.1", "5.25.0", "5.25.3"])
def test_supported_versions_pass_the_check(version):
    assert transformers_layout.check_transformers_version(version) == tuple(int(x) for x in version.split(".")[:2])


def test_sliding_window_model_is_refused():
    model = make_model("cpu", layer_types=["sliding_attention", "full_attention", "full_attention"], sliding_window=32)
    with pytest.raises(kc.ValidationError, match=r"full attention.*sliding_attention"):
        generate(model, make_prompts(2, seed=6), max_new_tokens=2, canary=TransformersCanary(model))


def test_forks_are_refused():
    model = make_model("cpu")
    gen = transformers.GenerationConfig(max_new_tokens=2, do_sample=True, num_return_sequences=2, eos_token_id=-1)
    with TransformersCanary(model):
        with pytest.raises(kc.ValidationError, match="num_return_sequences=2"):
            model.init_continuous_batching(generation_config=gen)


def test_an_mla_cache_is_one_half_whose_sources_read_each_layers_row_of_a_token():
    """transformers 5.25's MLACacheAllocator, duck-typed: one row per token ([kv_latent | rotated_key],
    48 float32 here), block_physical_stride = page_size * layers, layer i's row of physical index p at
    row p + i * page_size. The canary's slot s (block b = s // 4, offset o) reads, in layer i's source,
    the row b * 12 + i * 4 + o (the formula, by hand); an offset past the page is out of range."""
    from types import SimpleNamespace
    page, layers, blocks, width = 4, 3, 5, 48
    rows = torch.arange(blocks * page * layers, dtype=torch.float32)[:, None].repeat(1, width)  # row r holds r
    alloc = SimpleNamespace(tokens_per_page=page, block_physical_stride=page * layers, layer_indices=[0, 1, 2],
                            rows_per_token=1, cache_tensor=rows)
    cache = SimpleNamespace(cache_allocators={"full_attention": alloc}, pool=SimpleNamespace(num_reserved_sectors=1))
    layout = transformers_layout.PagedLayout(cache)
    assert (layout.halves, layout.token_bytes, layout.num_blocks, layout.num_slots) == (("K",), 4 * width, 5, 20)
    k, v = layout.sources("all")
    assert v == [] and len(k) == layers
    for i, src in enumerate(k):
        assert (src.page_size, src.num_bytes_per_token) == (page, 4 * width)
        table = src.view.host  # uint8 [blocks, page * row bytes], rows a block apart
        for s in (1, 6, 19):
            b, o = divmod(s, page)
            token = table[b, o * 4 * width:(o + 1) * 4 * width].view(np.float32)
            assert (token == b * page * layers + i * page + o).all(), (i, s)
    p = torch.tensor([0, 13, 2 * 12 + 3, 12 + 4, -1, 5 * 12])
    assert layout.to_slots(p).tolist() == [0, 5, 11, 20, 20, 20]


def test_a_changed_cache_layout_is_an_error_naming_the_attribute():
    from types import SimpleNamespace
    cache = SimpleNamespace(cache_allocators={"full_attention": SimpleNamespace(tokens_per_page=16)})
    with pytest.raises(kc.ValidationError, match=r"'block_physical_stride'.*>=5\.18,<5\.26"):
        transformers_layout.PagedLayout(cache)
    with pytest.raises(kc.ValidationError, match=r"'cache_allocators'"):
        transformers_layout.PagedLayout(SimpleNamespace(key_cache=[]))


def resolved_config(model, **config):
    gen = transformers.GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-1)
    cb = transformers.ContinuousBatchingConfig(page_size=PAGE, num_blocks=64, max_batch_tokens=64,
                                               max_requests_per_batch=4, **config)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    return manager.continuous_batching_config


def test_the_engines_fast_settings_are_left_as_the_user_set_them():
    """Catches an adapter that turns the engine's speed settings off behind the user's back (the
    canary used to drop CUDA graphs, async batching, the decode fast path and torch.compile)."""
    model = make_model("cpu")
    fast = dict(use_async_batching=True, use_cuda_graph=True, max_blocks_per_request=8, default_compile_level=1)
    plain = resolved_config(model, **fast)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        with TransformersCanary(model):
            guarded = resolved_config(model, **fast)
    keys = ("use_async_batching", "use_cuda_graph", "max_blocks_per_request", "cpu_offload_space")
    assert {k: getattr(guarded, k) for k in keys} == {k: getattr(plain, k) for k in keys}
    assert guarded.use_async_batching is True and guarded.varlen_compile_config is not None
    assert repr(guarded.varlen_compile_config) == repr(plain.varlen_compile_config)
    assert repr(guarded.decode_compile_config) == repr(plain.decode_compile_config)


@pytest.mark.parametrize("space", [0.5, None])
def test_cpu_offloading_is_refused_naming_the_setting_and_the_fix(space):
    """Offloaded KV comes back in other blocks without its canary records: refused, never turned off."""
    model = make_model("cpu")
    with TransformersCanary(model):
        with pytest.raises(kc.ValidationError, match=r"kv-canary: .*CPU offloading.*cpu_offload_space="
                                                      + re.escape(repr(space)) + r".*fix: .*cpu_offload_space=0\.0"):
            resolved_config(model, cpu_offload_space=space)


def test_a_persistent_manager_is_checked_in_every_attach():
    """Catches a canary silently off: with ``persistent_manager=True`` the engine reuses its batch
    processor, which a second attach found marked as hooked (its patches were gone), so the second
    generation ran 0 canary steps. Its prefix blocks from the first generation are read again, so
    the records must live on with the cache: the second generation is checked and clean."""
    model = make_model("cpu")
    prompts = make_prompts(6, seed=9, longest=30)
    gen = transformers.GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1)
    cb = transformers.ContinuousBatchingConfig(page_size=PAGE, num_blocks=128, max_batch_tokens=64,
                                               max_requests_per_batch=8, **CONFIG)
    tc = TransformersCanary(model)
    runs = []
    try:
        for _ in range(2):
            steps, shared, verified = tc.steps, tc.prefix_shared_tokens, tc.summary()["verified_slots"]
            with tc:
                out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                           persistent_manager=True)
            assert all(o.error is None for o in out.values())
            runs.append((tc.steps - steps, tc.prefix_shared_tokens - shared, tc.summary()["verified_slots"] - verified))
    finally:
        model.destroy_cached_continuous_batching_manager()
    assert tc.detections == []
    (steps1, _, verified1), (steps2, shared2, verified2) = runs
    assert steps1 > 0 and steps2 > 0 and verified2 > 0, runs
    assert shared2 >= PAGE, "expected the second generation to read the first one's prefix blocks"


def test_a_new_canary_on_a_reused_cache_recomputes_its_cached_prefixes():
    """Catches false reports on a persistent manager: a second TransformersCanary (other settings,
    so it cannot adopt the first one's records) attached to the engine's reused cache read every
    prefix block the first one had stamped as corrupted (7552 violation rows here, each one a
    request failed in mode fail_request). The new canary drops those blocks from prefix reuse, so
    they are recomputed and stamped by it: no report, the same tokens."""
    model = make_model("cpu")
    prompts = make_prompts(6, seed=9, longest=30)
    gen = transformers.GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1)
    cb = transformers.ContinuousBatchingConfig(page_size=PAGE, num_blocks=128, max_batch_tokens=64,
                                               max_requests_per_batch=8, **CONFIG)
    outputs, canaries = [], []
    try:
        for layers in ("first", "all"):
            tc = TransformersCanary(model, layers=layers)
            with tc:
                out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                           persistent_manager=True)
            outputs.append(_in_order(out))
            canaries.append(tc)
    finally:
        model.destroy_cached_continuous_batching_manager()
    first, second = canaries
    assert first.prefix_shared_tokens > 0, "expected shared prefixes within the first generation"
    assert second.detections == [] and second.summary()["verified_slots"] > 0
    assert outputs[1] == outputs[0]


def test_the_canary_keeps_nothing_per_request_it_has_seen():
    """Catches host memory that grows with every request a server ever ran: the canary used to keep
    each request id in a set (to count requests and spot a request's first step). 20 000 requests
    noted in steps of 32 must leave the canary's retained memory flat, and still be counted once
    each, with the cached tokens of their first step counted as shared prefix."""
    import gc
    import tracemalloc
    from types import SimpleNamespace
    tc = TransformersCanary(make_model("cpu"))

    def step(first: int):
        batch = []
        for i in range(first, first + 32):
            state = SimpleNamespace(request_id=f"req_{i}", initial_tokens=[1] * 40, generated_tokens=[],
                                    position_offset=17)
            batch.append(SimpleNamespace(state=state, query_length=1))
        tc._note_requests(batch)
        tc._note_requests(batch)  # the same requests' next step: not new
    step(0)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for first in range(32, 20_000, 32):
        step(first)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert tc.requests == 20_000 and tc.prefix_shared_tokens == 20_000 * 16
    assert grown < 64 << 10, f"the canary's memory grew by {grown} bytes over 20 000 requests"
