"""A real client: Hugging Face transformers generating with continuous batching and the paged KV
cache (``generate_batch``, ``paged|sdpa``) on a small randomly initialised Llama, with the canary
attached through :mod:`kvcanary.adapters.transformers_paged`.

Clean: many concurrent requests, shared prompt prefixes (block sharing) and chunked prefill give no
violation, and the canary does not change what is generated. Faults, each in its own generation:
a flipped KV byte, a corrupted block table and a wrong input token are reported with the right
reason in the step where the corrupted data is next read, and in no other step.
Runs on the CPU (reference backend) and, marked ``gpu``, on CUDA (the kernels).
"""

from __future__ import annotations

import random

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from kvcanary.adapters import TransformersCanary  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
BLOCK = 16
VOCAB = 512


def make_model(device: str):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=4096)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    model.set_attn_implementation("paged|sdpa")
    return model


def make_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts in groups sharing a prefix of several blocks, each with its own suffix; some are
    longer than the token budget of a step, so their prefill is chunked."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(k)] for k in (41, 58, 37)]
    return [prefixes[i % 3] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 90))] for i in range(n)]


def generate(model, prompts, *, max_new_tokens: int, canary: TransformersCanary | None = None):
    gen = transformers.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1)
    cb = transformers.ContinuousBatchingConfig(
        block_size=BLOCK, num_blocks=512, max_batch_tokens=64, max_requests_per_batch=16,
        use_cuda_graph=False, use_async_batching=False, max_blocks_per_request=0)
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


class Log:
    """after_step hook: the requests of every step."""

    def __init__(self):
        self.steps: list[list] = []

    def __call__(self, info):
        self.steps.append(list(info.requests))


def report(name: str, tc: TransformersCanary, extra: dict | None = None) -> dict:
    s = tc.summary()
    print(f"\n[{name}] requests={s['requests']} steps={s['steps']} verified_slots={s['verified_slots']} "
          f"protected_tokens={s['protected_tokens']} prefix_shared_tokens={s['prefix_shared_tokens']} "
          f"detections={s['detections']} {extra or ''}")
    for d in tc.detections[:6]:
        print(f"  step {d['step']}: {d['launch_tag']} {'+'.join(d['fail_reason'])} slot={d['slot_idx']} "
              f"position={d['position']} stored_token={d['stored_token']} expected_token={d['expected_token']}")
    return s


@pytest.mark.parametrize("device", DEVICES)
def test_clean_generation_has_no_violations(device):
    model = make_model(device)
    prompts = make_prompts(48, seed=1)
    plain = generate(model, prompts, max_new_tokens=48)
    log = Log()
    tc = TransformersCanary(model, layers="all", after_step=log)
    guarded = generate(model, prompts, max_new_tokens=48, canary=tc)
    s = report(f"clean {device}", tc)
    chunked = {}
    for reqs in log.steps:
        for rid, _, q in reqs:
            chunked[rid] = chunked.get(rid, 0) + (q > 1)
    assert tc.detections == []
    assert guarded == plain, "attaching the canary changed the generated tokens"
    assert s["requests"] == 48 and s["steps"] == len(log.steps) > 60
    assert max(len(r) for r in log.steps) >= 8, "expected many concurrent requests per step"
    assert s["prefix_shared_tokens"] >= 3 * BLOCK, "expected block sharing of the common prefixes"
    assert sum(n > 1 for n in chunked.values()) >= 5, "expected chunked prefills"
    assert s["verified_slots"] > 10_000 and s["protected_tokens"] > 0 and s["skipped_verifies"] == 0


def detections_by_step(tc) -> dict[int, list]:
    out: dict[int, list] = {}
    for d in tc.detections:
        out.setdefault(d["step"], []).append(d)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_corrupted_kv_byte_is_reported_when_read(device):
    model = make_model(device)
    hit = {}

    def before(info):  # flip a byte of a cached slot (layer 0 K, inside the 16 fingerprinted bytes)
        if hit or info.step < 12:
            return
        for rid, past, q in info.requests:
            if past >= 2 * BLOCK:
                table = info.cache.group_cache_managers[0].block_table[rid]
                pos = past - 5
                slot = table[pos // BLOCK] * BLOCK + pos % BLOCK
                k = info.cache.key_cache[0].view(info.cache.key_cache[0].shape[0], -1).view(torch.uint8)
                k[slot, 3] ^= 0x40
                sync()
                hit.update(step=info.step, slot=slot, rows=k)
                return

    def after(info):  # undo it once the step is over: later steps read clean bytes again
        if hit.get("step") == info.step:
            sync()
            hit["rows"][hit["slot"], 3] ^= 0x40
            sync()

    tc = TransformersCanary(model, before_step=before, after_step=after)
    generate(model, make_prompts(12, seed=2), max_new_tokens=24, canary=tc)
    report(f"kv byte {device}", tc, {k: hit[k] for k in ("step", "slot")})
    by_step = detections_by_step(tc)
    assert list(by_step) == [hit["step"]]
    for d in by_step[hit["step"]]:
        assert d["fail_reason"] == ["verify_real_kv_hash"] and d["launch_tag"] == "TAIL_K_FULL"
        assert d["slot_idx"] == hit["slot"]


@pytest.mark.parametrize("device", DEVICES)
def test_corrupted_block_table_is_reported_when_read(device):
    model = make_model(device)
    max_new = 24
    hit = {}
    log = Log()

    def after(info):
        log(info)
        cms = info.cache.group_cache_managers[0].block_table
        if "rid" in hit:  # restore before the engine updates (and may free) the request
            if info.step > hit["step"] and hit["rid"] in {r for r, _, _ in info.requests}:
                cms[hit["rid"]][1] = hit["block"]
            return
        if info.step < 12:
            return
        for (rid, past, q), state in zip(info.requests, info.states):
            if q == 1 and past >= 3 * BLOCK + 2 and state.generated_len() < max_new - 4:
                table = cms[rid]
                hit.update(step=info.step, rid=rid, block=table[1])
                table[1] = table[0]  # positions 16..31 now map onto the slots of positions 0..15
                return

    tc = TransformersCanary(model, after_step=after)
    generate(model, make_prompts(12, seed=3), max_new_tokens=max_new, canary=tc)
    read_at = next(i for i, reqs in enumerate(log.steps) if i > hit["step"] and hit["rid"] in {r for r, _, _ in reqs})
    report(f"block table {device}", tc, {"corrupted_after_step": hit["step"], "read_at": read_at})
    by_step = detections_by_step(tc)
    assert list(by_step) == [read_at]
    rows = by_step[read_at]
    reasons = {r for d in rows for r in d["fail_reason"]}
    assert reasons <= {"verify_chain_hash", "verify_position"} and "verify_position" in reasons
    assert {"HEAD_K_FULL", "HEAD_V_FULL"} <= {d["launch_tag"] for d in rows}
    assert sum("verify_position" in d["fail_reason"] for d in rows if d["launch_tag"] == "HEAD_K_FULL") == BLOCK


@pytest.mark.parametrize("device", DEVICES)
def test_wrong_input_token_is_reported_when_consumed(device):
    model = make_model(device)
    hit = {}

    def before(info):  # the model reads a different token than the request's history holds
        if hit or info.step < 12:
            return
        offset = 0
        for rid, past, q in info.requests:
            if q == 1 and past > BLOCK:
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
